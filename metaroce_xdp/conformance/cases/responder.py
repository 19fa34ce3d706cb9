"""The IUT as responder (03-compat-rc.md): invalid requests, RNR, READ responses, ATOMICs, duplicate READ
and ATOMIC requests, responder resources and receive completions.

The LT plays the requester frame by frame.  NAKs are checked for their code, the
offending packet's PSN and the current MSN; fatal ones for the QP in ERR afterwards
(query_qp, and silence towards a valid request); memory through mem_read.  PSN
sequence errors and duplicate SEND/WRITE are the PSN cases' (header.py and the PSN
module); memory-key violations are in memory.py.
"""
from __future__ import annotations

from .. import packets as P
from ..registry import case
from ._common import describe
from ._resp import (ACKNOWLEDGE, ATOMIC_ACKNOWLEDGE, READ_RESPONSES, atomic_req, check_err, check_nak,
                    check_state, check_untouched, connect, expect_fatal, first_response, npsn, poll_one, prime,
                    read_req, read_responses, req, wc_text)

ERR1 = ["MR-NAK-009", "MR-QP-022"]
U64 = (1 << 64) - 1


def _le(v: int) -> bytes:
    return (v & U64).to_bytes(8, "little")


def _orig(f) -> int | None:
    h = f.roce.headers.get("AtomicAckETH") if f is not None else None
    return None if h is None else int(h.orig)


def _pattern(n: int, seed: int) -> bytes:
    return bytes((i * 31 + seed) & 0xFF for i in range(n))


def _check_read_stream(t, c, rules, frames, psn0: int, data: bytes, msn: int, what: str, mark: int,
                       resume: bool = False) -> bool:
    """frames are the READ RESPONSE packets of one READ of len(data) bytes whose first PSN is psn0: the
    opcodes FIRST, MIDDLE..., LAST (or ONLY), consecutive PSNs, PMTU payloads but the last, PadCnt, AETH
    of type ACK with `msn` on FIRST/LAST/ONLY only, and the data.  resume: a re-executed READ starting
    inside the original, which may also continue the original's opcodes (MIDDLE..., LAST; MR-DUP-003
    does not say which -- Linux rxe continues, the reference endpoint starts a new stream)."""
    mtu = c.mtu
    n = npsn(len(data), mtu)
    probs = []
    if len(frames) != n:
        probs.append(f"{len(frames)} responses, expected {n}")
    cont = resume and bool(frames) and frames[0].roce.op in (0x0E, 0x0F)
    for k, f in enumerate(frames[:n]):
        v = f.roce
        if cont:
            want = 0x0F if k == n - 1 else 0x0E
        else:
            want = (0x10 if n == 1 else 0x0D if k == 0 else 0x0F if k == n - 1 else 0x0E)
        chunk = data[k * mtu:(k + 1) * mtu]
        if v.op != want:
            probs.append(f"#{f.num} is {v.name}, expected {P.op_name(want)}")
        if v.psn != P.psn_add(psn0, k):
            probs.append(f"#{f.num} psn {v.psn:#08x}, expected {P.psn_add(psn0, k):#08x}")
        if v.malformed:
            probs.append(f"#{f.num} malformed: {v.malformed}")
        if v.payload != chunk:
            probs.append(f"#{f.num} payload {len(v.payload)} B differs from the {len(chunk)} B expected")
        if v.pad != (-len(chunk)) & 3:
            probs.append(f"#{f.num} PadCnt {v.pad}, expected {(-len(chunk)) & 3}")
        else:
            end = P._ip_end(f.data) - 4
            if any(f.data[end - v.pad:end]):
                probs.append(f"#{f.num} pad bytes {f.data[end - v.pad:end].hex()} are not zero")
        if want != 0x0E and (v.ack_kind != "ACK" or v.msn != msn):
            probs.append(f"#{f.num} AETH {v.ack_kind} msn {v.msn}, expected ACK msn {msn}")
    ok = not probs
    exp = (f"{n} READ RESPONSE packets from psn {psn0:#08x}: " + ("ONLY" if n == 1 else
           f"FIRST, {n - 2} MIDDLE, LAST") + f"; AETH ACK msn={msn} on FIRST/LAST/ONLY; {len(data)} bytes")
    detail = f"{what}: " + ("as expected" if ok else "; ".join(probs[:4]))
    for r in rules:
        t.check(r, ok, detail, frames=frames or [mark + 1], expected=exp)
    return ok


def _next_write_acked(t, c, rules, msn: int, what: str) -> None:
    """A WRITE at c.psn (the expected PSN, if the responder advanced it right) is ACKed with msn."""
    p = c.psn
    mark = c.send(c.write(b"after it", offset=c.mr_len - 256))
    f = first_response(c, mark)
    ok = f is not None and f.roce.op == ACKNOWLEDGE and f.roce.ack_kind == "ACK" and f.roce.psn == p \
        and f.roce.msn == msn
    for r in rules:
        t.check(r, ok, f"{what}: the WRITE at PSN {p:#08x}: {describe([f] if f else [])}",
                frames=[f] if f else [mark + 1], expected=f"ACKNOWLEDGE ACK psn={p:#08x} msn={msn}")


# ---- invalid requests (NAK code 1, MR-NAK-006) -------------------------------------------------
@case("TC-RC-017-a", rules=["MR-RC-017", "MR-NAK-006", "MR-NAK-001", "MR-MEM-026", "MR-MEM-027", *ERR1],
      category="ACK", timeout=10)
def write_qp_without_remote_write(t):
    """A WRITE to a QP without REMOTE_WRITE (its MR allows it): NAK code 1, not 2; nothing written; QP in ERR."""
    c = connect(t, access=["REMOTE_READ", "REMOTE_ATOMIC"])
    mark = c.send(c.write(b"first!!!", offset=0))       # the first message: msn 0
    f = first_response(c, mark)
    p = P.psn_add(c.psn, -1)
    ok = (f is not None and f.roce.ack_kind == "NAK" and f.roce.nak_code == 1 and f.roce.psn == p
          and f.roce.msn == 0)
    exp = f"ACKNOWLEDGE NAK(0x61) psn={p:#08x} msn=0"
    for r in ("MR-RC-017", "MR-NAK-006", "MR-NAK-001", "MR-MEM-026"):
        t.check(r, ok, f"WRITE on a QP without REMOTE_WRITE: {describe([f] if f else [])}",
                frames=[f] if f else [mark + 1], expected=exp)
    check_untouched(t, c, ["MR-MEM-027", "MR-NAK-009"], 0, 64, "WRITE on a QP without REMOTE_WRITE")
    check_err(t, c, ERR1, "WRITE on a QP without REMOTE_WRITE")


@case("TC-RC-017-b", rules=["MR-RC-017", "MR-NAK-006", "MR-NAK-001", "MR-MEM-027", *ERR1], category="ACK",
      timeout=10)
def read_qp_without_remote_read(t):
    """A READ on a QP without REMOTE_READ, after a WRITE: NAK code 1 (msn 1), no READ RESPONSE, QP in ERR."""
    c = connect(t, access=["REMOTE_WRITE", "REMOTE_ATOMIC"])
    prime(t, c)
    p = c.psn
    mark = c.send(read_req(c, c.va + 64, 64))
    check_nak(t, c, ["MR-RC-017", "MR-NAK-006", "MR-NAK-001"], mark, 1, p, 1, "READ on a QP without REMOTE_READ")
    data = [f for f in c.quiet(0.1, after=mark) if f.roce.op in READ_RESPONSES]
    t.check("MR-MEM-027", not data, f"READ RESPONSEs: {describe(data)}", frames=data or [mark + 1],
            expected="no READ RESPONSE")
    check_err(t, c, ERR1, "READ on a QP without REMOTE_READ")


@case("TC-RC-017-c", rules=["MR-RC-017", "MR-ATOM-005", "MR-ATOM-011", "MR-NAK-006", "MR-NAK-001", *ERR1],
      category="ATOM", caps=("ATOMICS",), timeout=10)
def atomic_qp_without_remote_atomic(t):
    """A FETCH_ADD on a QP without REMOTE_ATOMIC: NAK code 1, the word unchanged, QP in ERR."""
    c = connect(t, access=["REMOTE_WRITE", "REMOTE_READ"])
    prime(t, c)
    expect_fatal(t, c, atomic_req(c, "FETCH_ADD", c.va + 64, 5), 1, "FETCH_ADD on a QP without REMOTE_ATOMIC",
                 nak=["MR-RC-017", "MR-ATOM-005", "MR-NAK-006", "MR-NAK-001"], mem=["MR-ATOM-011"], err=ERR1,
                 untouched=[(None, 64, 8)])


@case("TC-RC-016-a", rules=["MR-RC-016", "MR-NAK-006", "MR-NAK-001", "MR-MEM-027", "MR-NAK-009"], category="SEQ",
      timeout=15)
def opcode_sequence_errors(t):
    """Missing FIRST (WRITE MIDDLE, SEND LAST) and missing LAST (SEND ONLY inside a WRITE): NAK code 1 each."""
    # (a) an RDMA WRITE MIDDLE with no WRITE in progress
    c = connect(t, mtu=256)
    prime(t, c)
    expect_fatal(t, c, req(c, "RDMA_WRITE_MIDDLE", payload=bytes([1]) * 256), 1, "WRITE MIDDLE without FIRST",
                 nak=["MR-RC-016", "MR-NAK-006", "MR-NAK-001"], mem=["MR-MEM-027"], err=["MR-NAK-009"],
                 untouched=[(None, 64, 1024)])
    # (b) a SEND LAST with no SEND in progress (a receive WQE is posted)
    c = connect(t, mtu=256)
    c.post_recv(1024, offset=4096, wr_id=0x16)
    prime(t, c)
    expect_fatal(t, c, req(c, "SEND_LAST", payload=b"tail"), 1, "SEND LAST without FIRST",
                 nak=["MR-RC-016", "MR-NAK-006", "MR-NAK-001"], mem=["MR-MEM-027"], untouched=[(None, 4096, 1024)])
    # (c) a SEND ONLY while a WRITE is in progress: the FIRST's bytes stay, the SEND is not executed
    c = connect(t, mtu=256)
    c.post_recv(1024, offset=4096, wr_id=0x17)
    prime(t, c)
    first = bytes([7]) * 256
    mark = c.send(req(c, "RDMA_WRITE_FIRST", reth=(c.va + 1024, c.rkey, 512), payload=first, ackreq=True))
    f = first_response(c, mark)
    if f is None or f.roce.ack_kind != "ACK":
        t.undecided("MR-RC-016", f"the WRITE FIRST was not ACKed: {describe([f] if f else [])}")
    expect_fatal(t, c, req(c, "SEND_ONLY", payload=b"interloper"), 1, "SEND ONLY inside a WRITE",
                 nak=["MR-RC-016", "MR-NAK-006", "MR-NAK-001"], mem=["MR-MEM-027"], err=["MR-NAK-009"],
                 untouched=[(None, 4096, 1024), (None, 1024 + 256, 256)])
    t.check("MR-MEM-027", c.mem(1024, 256) == first, "the WRITE FIRST's bytes stay placed")


@case("TC-RC-012-a", rules=["MR-RC-012", "MR-NAK-006", "MR-QP-032", "MR-QP-024", "MR-MEM-027", *ERR1],
      category="ACK", timeout=10)
def send_longer_than_receive_buffer(t):
    """A 100-byte SEND ONLY into a 64-byte receive WQE: NAK code 1, LOC_LEN_ERR at the IUT, then flushes."""
    c = connect(t)
    c.post_recv(64, offset=4096, wr_id=0x12)
    c.post_recv(64, offset=8192, wr_id=0x13)
    prime(t, c)
    expect_fatal(t, c, req(c, "SEND_ONLY", payload=_pattern(100, 1)), 1, "SEND of 100 bytes into 64",
                 nak=["MR-RC-012", "MR-NAK-006"], mem=["MR-MEM-027"], untouched=[(None, 4096, 128)])
    wcs = c.poll(2, 1.0)
    got = [(int(w["wr_id"], 16), w["status"]) for w in wcs]
    t.check("MR-QP-032", got[:1] == [(0x12, "IBV_WC_LOC_LEN_ERR")], f"completions: {got}",
            expected="wr_id 0x12 IBV_WC_LOC_LEN_ERR", observed=[wc_text(w) for w in wcs])
    t.check("MR-RC-012", got[:1] == [(0x12, "IBV_WC_LOC_LEN_ERR")], f"completions: {got}",
            expected="wr_id 0x12 IBV_WC_LOC_LEN_ERR", observed=[wc_text(w) for w in wcs])
    t.check("MR-QP-024", got == [(0x12, "IBV_WC_LOC_LEN_ERR"), (0x13, "IBV_WC_WR_FLUSH_ERR")],
            f"completions in order: {got}", expected="0x12 LOC_LEN_ERR, then 0x13 WR_FLUSH_ERR",
            observed=[wc_text(w) for w in wcs])
    check_err(t, c, ERR1, "SEND longer than the receive buffer")


@case("TC-RC-012-b", rules=["MR-RC-012", "MR-NAK-006", "MR-NAK-001", "MR-MEM-027", "MR-ACK-008"], category="ACK",
      timeout=10)
def send_overflows_at_last_packet(t):
    """A 2-packet SEND whose FIRST fits a 300-byte receive WQE and whose LAST does not: NAK code 1 at the LAST."""
    c = connect(t, mtu=256)
    c.post_recv(300, offset=4096, wr_id=0x21)
    prime(t, c)
    first = _pattern(256, 3)
    mark = c.send(req(c, "SEND_FIRST", payload=first, ackreq=True))
    f = first_response(c, mark)
    t.check("MR-ACK-008", f is not None and f.roce.ack_kind == "ACK" and f.roce.msn == 1,
            f"the SEND FIRST: {describe([f] if f else [])} (msn must stay 1 until the LAST)",
            frames=[f] if f else [mark + 1], expected="ACKNOWLEDGE ACK msn=1")
    expect_fatal(t, c, req(c, "SEND_LAST", payload=_pattern(100, 4)), 1, "SEND LAST past the receive buffer",
                 nak=["MR-RC-012", "MR-NAK-006", "MR-NAK-001"], mem=["MR-MEM-027"],
                 untouched=[(None, 4096 + 300, 256)])
    wc = poll_one(t, c)
    t.check("MR-RC-012", wc is not None and wc["status"] == "IBV_WC_LOC_LEN_ERR" and int(wc["wr_id"], 16) == 0x21,
            f"completion: {wc_text(wc)}", expected="wr_id 0x21 IBV_WC_LOC_LEN_ERR", observed=[wc_text(wc)])
    # the FIRST's bytes were placed by a valid packet and stay (MR-MEM-027)
    t.check("MR-MEM-027", c.mem(4096, 256) == first, "the SEND FIRST's bytes stay in the receive buffer")


@case("TC-XH-004-a", rules=["MR-XH-004", "MR-SEC-013", "MR-NAK-006", "MR-NAK-001", *ERR1], category="ACK",
      timeout=10)
def read_dma_length_above_2_31(t):
    """A READ REQUEST with DMA Length 2^31 + 1: invalid request (NAK code 1), or remote access error (code 2)
    since the range also leaves the MR (MR-NAK-014, checks 5 and 6), QP in ERR."""
    c = connect(t)
    prime(t, c)
    p = c.psn
    mark = c.send(req(c, "RDMA_READ_REQUEST", reth=(c.va, c.rkey, (1 << 31) + 1), n=1))
    check_nak(t, c, ["MR-XH-004", "MR-SEC-013", "MR-NAK-006", "MR-NAK-001"], mark, (1, 2), p, 1,
              "READ of 2^31 + 1 bytes")
    check_err(t, c, ERR1, "READ of 2^31 + 1 bytes")


# ---- responder resources (MR-DUP-007, MR-SEC-012) ---------------------------------------------------------
@case("TC-DUP-007-a", rules=["MR-DUP-007", "MR-SEC-012", "MR-NAK-006", "MR-NAK-001", "MR-NAK-009"], category="ACK",
      timeout=12)
def max_dest_rd_atomic_zero(t):
    """With max_dest_rd_atomic 0 a READ, and an ATOMIC, are invalid requests: NAK code 1, QP in ERR."""
    rules = ["MR-DUP-007", "MR-SEC-012", "MR-NAK-006", "MR-NAK-001"]
    c = connect(t, max_dest_rd_atomic=0)
    prime(t, c)
    p = c.psn
    mark = c.send(read_req(c, c.va + 64, 64))
    check_nak(t, c, rules, mark, 1, p, 1, "READ with max_dest_rd_atomic 0")
    check_err(t, c, ["MR-NAK-009"], "READ with max_dest_rd_atomic 0")
    if "ATOMICS" in t.claim.caps:
        c = connect(t, max_dest_rd_atomic=0)
        prime(t, c)
        expect_fatal(t, c, atomic_req(c, "FETCH_ADD", c.va + 64, 1), 1, "FETCH_ADD with max_dest_rd_atomic 0",
                     nak=rules, mem=["MR-NAK-009"], err=["MR-NAK-009"], untouched=[(None, 64, 8)])


@case("TC-DUP-007-b", rules=["MR-DUP-007", "MR-SEC-012", "MR-RC-025", "MR-NAK-006", "MR-NAK-009"], category="ACK",
      timeout=15)
def read_beyond_responder_resources(t):
    """max_dest_rd_atomic 1, two READs back to back: the second is NAKed (code 1) or answered, after the first.

    Which one depends on whether the first READ's 1024 responses had all left when the second was
    processed (MR-DUP-007): a responder that finishes each request before the next (MR-RC-025, Table
    3-8, Linux rxe) has reused the entry and answers; one that takes requests while responses are
    queued (the reference endpoint) finds every entry busy and NAKs.  Either way nothing of the second
    READ's may come before the first's last response."""
    c = connect(t, mtu=256, mr_len=1 << 18, max_dest_rd_atomic=1)
    p1 = c.psn
    n1 = npsn(c.mr_len, c.mtu)
    p2 = P.psn_add(p1, n1)
    c.mem_write(0, _pattern(256, 16))
    mark = c.send(read_req(c, c.va, c.mr_len), read_req(c, c.va, 256))
    end = c.expect(1, min(8.0, t.left() - 3), after=mark, match=lambda f: f.roce.psn == p2)
    got = c.t.lt.collect(c.is_mine, 0.2, after=mark)
    reads = [f for f in got if f.roce.op in READ_RESPONSES]
    first = [f for f in reads if ((f.roce.psn - p1) & 0xFFFFFF) < n1]
    f = end[0] if end else None
    before = [x for x in first if f is not None and x.num < f.num]
    detail = (f"at the second READ's PSN {p2:#08x}: {describe(end)}; responses of the first READ: {len(first)} of "
              f"{n1}, {len(before)} before that")
    if f is not None and f.roce.op == ACKNOWLEDGE:        # (a) the entry was busy: invalid request
        ok = (f.roce.ack_kind == "NAK" and f.roce.nak_code == 1 and f.roce.msn == 1
              and not [x for x in reads if x.roce.psn == p2])
        exp = f"ACKNOWLEDGE NAK(0x61) psn={p2:#08x} msn=1 and no READ RESPONSE at {p2:#08x}"
        for r in ("MR-DUP-007", "MR-SEC-012", "MR-NAK-006"):
            t.check(r, ok, detail, frames=[f], expected=exp)
        check_state(t, c, ["MR-NAK-009"], "ERR", "after the NAK")
    elif f is not None:                                    # (b) the entry was free again: answered
        ok = (f.roce.op == 0x10 and f.roce.ack_kind == "ACK" and f.roce.msn == 2
              and f.roce.payload == _pattern(256, 16))
        for r in ("MR-DUP-007", "MR-SEC-012"):
            t.check(r, ok, detail + " (answered: the entry was reused after the first READ's responses)",
                    frames=[f], expected=f"RDMA_READ_RESPONSE_ONLY psn={p2:#08x} msn=2 with the data")
        for r in ("MR-NAK-006", "MR-NAK-009"):
            t.cannot_drive(r, "the second READ was answered, not NAKed (its entry was free again)")
    else:
        for r in ("MR-DUP-007", "MR-SEC-012", "MR-NAK-006", "MR-NAK-009"):
            t.check(r, False, detail, frames=reads[-1:] or [mark + 1],
                    expected=f"a NAK(0x61) or a READ RESPONSE at {p2:#08x}")
    t.check("MR-RC-025", f is not None and len(before) == n1, detail, frames=[f] if f else [mark + 1],
            expected=f"all {n1} responses of the first READ before anything at {p2:#08x}")


@case("TC-DUP-007-c", rules=["MR-DUP-007", "MR-DUP-003", "MR-DUP-005"], category="DUP", caps=("ATOMICS",),
      timeout=12)
def resource_reused_by_newer_request(t):
    """max_dest_rd_atomic 1: an ATOMIC takes a finished READ's entry; that READ's duplicate is then discarded."""
    c = connect(t, max_dest_rd_atomic=1)
    c.mem_write(2048, _pattern(100, 9))
    c.mem_write(4096, _le(5))
    p1 = c.psn
    mark = c.send(read_req(c, c.va + 2048, 100))
    rs = read_responses(c, mark, 1)
    p2 = c.psn
    mark = c.send(atomic_req(c, "FETCH_ADD", c.va + 4096, 1))
    a = first_response(c, mark)
    ok = a is not None and a.roce.op == ATOMIC_ACKNOWLEDGE and _orig(a) == 5 and a.roce.msn == 2
    t.check("MR-DUP-007", bool(rs) and ok, f"READ answered ({describe(rs)}); FETCH_ADD: {describe([a] if a else [])}",
            frames=rs + ([a] if a else []) or [mark + 1], expected="ATOMIC_ACKNOWLEDGE orig=5 msn=2")
    # the READ's entry was taken by the ATOMIC: its duplicate finds nothing and is discarded
    mark = c.send(read_req(c, c.va + 2048, 100, psn=p1))
    seen = c.quiet(0.3, after=mark)
    t.check("MR-DUP-007", not seen, f"duplicate of the evicted READ: {describe(seen)}", frames=seen or [mark + 1],
            expected="no response")
    t.check("MR-DUP-003", not seen, f"duplicate READ not in resources[]: {describe(seen)}", frames=seen or [mark + 1],
            expected="silently discarded")
    mark = c.send(atomic_req(c, "FETCH_ADD", c.va + 4096, 1, psn=p2))
    d = first_response(c, mark)
    good = d is not None and d.roce.op == ATOMIC_ACKNOWLEDGE and d.roce.psn == p2 and _orig(d) == 5
    t.check("MR-DUP-005", good and c.mem(4096, 8) == _le(6), f"duplicate FETCH_ADD: {describe([d] if d else [])}, "
            f"memory {int.from_bytes(c.mem(4096, 8), 'little')}", frames=[d] if d else [mark + 1],
            expected=f"ATOMIC_ACKNOWLEDGE psn={p2:#08x} orig=5, memory 6")


# ---- READ responses (MR-RC-015, MR-ACK-008, MR-OPC-007) -------------------------------------------------
@case("TC-OPC-007-a", rules=["MR-OPC-007", "MR-RC-015", "MR-ACK-008", "MR-ACK-007", "MR-OPC-002", "MR-ENC-026"],
      category="WIRE", timeout=10)
def read_response_segmentation(t):
    """A READ of 3 MTU + 513 bytes: FIRST, 2 MIDDLE, LAST at consecutive PSNs, AETH on FIRST/LAST, PadCnt 3."""
    c = connect(t, mtu=1024)
    data = _pattern(3 * 1024 + 513, 5)
    c.mem_write(8192, data)
    prime(t, c)
    p = c.psn
    mark = c.send(read_req(c, c.va + 8192, len(data)))
    rs = read_responses(c, mark, 4)
    _check_read_stream(t, c, ["MR-ACK-008", "MR-OPC-007", "MR-OPC-002", "MR-ENC-026"], rs, p, data, 2,
                       "READ of 3585 bytes", mark)
    acks = [f for f in c.quiet(0.05, after=mark) if f.roce.op == ACKNOWLEDGE]
    t.check("MR-ACK-007", not acks, f"ACKNOWLEDGEs for the READ: {describe(acks)}", frames=acks or [mark + 1],
            expected="no ACKNOWLEDGE")
    _next_write_acked(t, c, ["MR-RC-015"], 3, "epsn advanced by 4")


@case("TC-OPC-007-b", rules=["MR-OPC-007", "MR-RC-015", "MR-OPC-002", "MR-ENC-026", "MR-ACK-008"], category="WIRE",
      timeout=12)
def read_response_edges(t):
    """READs of 1 byte, exactly 1 MTU and exactly 2 MTU: ONLY (PadCnt 3), ONLY, FIRST + LAST."""
    c = connect(t, mtu=256)
    c.mem_write(4096, _pattern(1024, 6))
    msn = 0
    for n in (1, 256, 512):
        p = c.psn
        msn += 1
        mark = c.send(read_req(c, c.va + 4096, n))
        rs = read_responses(c, mark, npsn(n, c.mtu))
        extra = [f for f in c.quiet(0.05, after=rs[-1].num if rs else mark) if f.roce.op in READ_RESPONSES]
        _check_read_stream(t, c, ["MR-OPC-007", "MR-OPC-002", "MR-ENC-026", "MR-ACK-008"], rs + extra, p,
                           _pattern(1024, 6)[:n], msn, f"READ of {n} bytes at PMTU 256", mark)
    _next_write_acked(t, c, ["MR-RC-015"], msn + 1, "epsn advanced by 1 + 1 + 2")


# ---- ATOMIC execution (MR-ATOM) ----------------------------------------------------------------------
@case("TC-ATOM-001-a", rules=["MR-ATOM-001", "MR-ATOM-003", "MR-ATOM-006", "MR-XH-013", "MR-ACK-007"],
      category="ATOM", caps=("ATOMICS",), timeout=10)
def fetch_add(t):
    """FETCH_ADD returns the original value, adds modulo 2^64 in host (little-endian) order, msn + 1."""
    c = connect(t)
    c.mem_write(1024, _le(U64 - 1))
    msn = 0
    for add, before in ((3, U64 - 1), (0x0102030405060708, 1)):
        p = c.psn
        msn += 1
        mark = c.send(atomic_req(c, "FETCH_ADD", c.va + 1024, add))
        f = first_response(c, mark)
        after = (before + add) & U64
        mem = c.mem(1024, 8)
        ok = (f is not None and f.roce.op == ATOMIC_ACKNOWLEDGE and f.roce.psn == p and _orig(f) == before
              and f.roce.ack_kind == "ACK" and f.roce.msn == msn)
        exp = f"ATOMIC_ACKNOWLEDGE psn={p:#08x} AETH ACK msn={msn} orig={before:#x}"
        for r in ("MR-ATOM-001", "MR-ATOM-006", "MR-XH-013"):
            t.check(r, ok, f"FETCH_ADD {add:#x} to {before:#x}: {describe([f] if f else [])}",
                    frames=[f] if f else [mark + 1], expected=exp)
        t.check("MR-ATOM-001", mem == _le(after), f"memory {mem.hex()} (expected {after:#x} little-endian)")
        t.check("MR-ATOM-003", mem == _le(after), f"memory {mem.hex()} (expected {_le(after).hex()})")
        acks = [x for x in c.quiet(0.05, after=mark) if x.roce.op == ACKNOWLEDGE]
        t.check("MR-ACK-007", not acks, f"ACKNOWLEDGEs for the ATOMIC: {describe(acks)}", frames=acks or [mark + 1])
    _next_write_acked(t, c, ["MR-ATOM-006"], msn + 1, "epsn advanced by 1 per ATOMIC")


@case("TC-ATOM-001-b", rules=["MR-ATOM-001", "MR-ATOM-006", "MR-ATOM-003"], category="ATOM", caps=("ATOMICS",),
      timeout=10)
def compare_swap(t):
    """COMPARE_SWAP swaps when the word equals Compare Data and not otherwise; both return the original."""
    c = connect(t)
    c.mem_write(2048, _le(0x1122334455667788))
    cases = ((0x1122334455667788, 0xAAAA, 0x1122334455667788, 0xAAAA),     # equal: swapped
             (0x1122334455667788, 0xBBBB, 0xAAAA, 0xAAAA))                 # not equal: unchanged
    for i, (cmp_, swap, orig, after) in enumerate(cases):
        p = c.psn
        mark = c.send(atomic_req(c, "COMPARE_SWAP", c.va + 2048, swap, cmp_))
        f = first_response(c, mark)
        ok = (f is not None and f.roce.op == ATOMIC_ACKNOWLEDGE and f.roce.psn == p and _orig(f) == orig
              and f.roce.msn == i + 1)
        t.check("MR-ATOM-006", ok, f"COMPARE_SWAP {i}: {describe([f] if f else [])}", frames=[f] if f else [mark + 1],
                expected=f"ATOMIC_ACKNOWLEDGE psn={p:#08x} orig={orig:#x} msn={i + 1}")
        mem = c.mem(2048, 8)
        for r in ("MR-ATOM-001", "MR-ATOM-003"):
            t.check(r, ok and mem == _le(after), f"COMPARE_SWAP {i}: orig {_orig(f) if f else None}, memory "
                    f"{mem.hex()}", frames=[f] if f else [mark + 1], expected=f"orig {orig:#x}, memory {after:#x}")


@case("TC-ATOM-002-a", rules=["MR-ATOM-002", "MR-ATOM-011", "MR-MEM-039", "MR-NAK-006", "MR-NAK-001", *ERR1],
      category="ATOM", caps=("ATOMICS",), timeout=10)
def atomic_unaligned(t):
    """A FETCH_ADD at an address inside the MR that is not a multiple of 8: NAK code 1, no byte changed."""
    c = connect(t)
    prime(t, c)
    expect_fatal(t, c, atomic_req(c, "FETCH_ADD", c.va + 1028, 1), 1, "FETCH_ADD at VA + 1028",
                 nak=["MR-ATOM-002", "MR-MEM-039", "MR-NAK-006", "MR-NAK-001"], mem=["MR-ATOM-011"], err=ERR1,
                 untouched=[(None, 1016, 24)])


# ---- duplicates (MR-DUP-003, MR-DUP-005, MR-DUP-009) -------------------------------------------------------
@case("TC-DUP-003-a", rules=["MR-DUP-003", "MR-DUP-004", "MR-DUP-006", "MR-DUP-001"], category="DUP", timeout=10)
def duplicate_read_current_memory(t):
    """A duplicate READ is executed again from the memory as it is now, at its own PSNs, with the current msn."""
    c = connect(t, mtu=1024)
    old, new = _pattern(2500, 1), _pattern(2500, 2)
    c.mem_write(4096, old)
    p = c.psn
    mark = c.send(read_req(c, c.va + 4096, len(old)))
    rs = read_responses(c, mark, 3)
    _check_read_stream(t, c, ["MR-DUP-003"], rs, p, old, 1, "original READ", mark)
    prime(t, c, offset=64)                                  # msn 2
    c.mem_write(4096, new)
    mark = c.send(read_req(c, c.va + 4096, len(new), psn=p))
    rs = read_responses(c, mark, 3)
    _check_read_stream(t, c, ["MR-DUP-003", "MR-DUP-004"], rs, p, new, 2, "duplicate READ after the memory changed",
                       mark)
    check_state(t, c, ["MR-DUP-001"], "RTS", "after the duplicate READ")
    _next_write_acked(t, c, ["MR-DUP-006"], 3, "epsn and msn unchanged by the duplicate")


@case("TC-DUP-003-b", rules=["MR-DUP-003", "MR-DUP-006"], category="DUP", timeout=10)
def duplicate_read_remainder(t):
    """A duplicate READ for the remainder (PSN + 1, VA + PMTU) is answered from that PSN with that part."""
    c = connect(t, mtu=512)
    data = _pattern(1800, 3)
    c.mem_write(0x3000, data)
    p = c.psn
    mark = c.send(read_req(c, c.va + 0x3000, len(data)))
    rs = read_responses(c, mark, 4)
    _check_read_stream(t, c, ["MR-DUP-003"], rs, p, data, 1, "original READ", mark)
    q = P.psn_add(p, 1)
    mark = c.send(read_req(c, c.va + 0x3000 + 512, len(data) - 512, psn=q))
    rs = read_responses(c, mark, 3)
    _check_read_stream(t, c, ["MR-DUP-003"], rs, q, data[512:], 1, "duplicate READ of the remainder", mark,
                       resume=True)
    _next_write_acked(t, c, ["MR-DUP-006"], 2, "epsn and msn unchanged by the duplicate")


@case("TC-DUP-003-c", rules=["MR-DUP-003", "MR-DUP-006", "MR-SEC-011"], category="DUP", timeout=10)
def duplicate_read_inconsistent(t):
    """Duplicate READs with another R_Key, or a range beyond the saved one, are discarded silently."""
    c = connect(t, mtu=1024)
    c.mem_write(4096, _pattern(1000, 4))
    p = c.psn
    mark = c.send(read_req(c, c.va + 4096, 1000))
    if not read_responses(c, mark, 1):
        t.undecided("MR-DUP-003", "the original READ was not answered")
    for what, frame in (("another R_Key", read_req(c, c.va + 4096, 1000, rkey=c.rkey ^ 0x100, psn=p)),
                        ("a longer range", read_req(c, c.va + 4096, 1001, psn=p)),
                        ("an earlier VA", read_req(c, c.va + 4088, 1000, psn=p))):
        mark = c.send(frame)
        seen = c.quiet(0.25, after=mark)
        for r in ("MR-DUP-003", "MR-SEC-011"):
            t.check(r, not seen, f"duplicate READ with {what}: {describe(seen)}", frames=seen or [mark + 1],
                    expected="no response")
    _next_write_acked(t, c, ["MR-DUP-006"], 2, "the discarded duplicates changed nothing")


@case("TC-DUP-005-a", rules=["MR-DUP-005", "MR-ATOM-007", "MR-DUP-006", "MR-DUP-001"], category="DUP",
      caps=("ATOMICS",), timeout=10)
def duplicate_fetch_add(t):
    """A duplicate FETCH_ADD gets the saved original value with the current msn; the memory is added to once."""
    c = connect(t)
    c.mem_write(1024, _le(41))
    p = c.psn
    mark = c.send(atomic_req(c, "FETCH_ADD", c.va + 1024, 1))
    a = first_response(c, mark)
    if a is None or _orig(a) != 41:
        t.undecided("MR-DUP-005", f"the FETCH_ADD was not answered with 41: {describe([a] if a else [])}")
    prime(t, c, offset=64)                                   # msn 2
    for k in range(2):
        mark = c.send(atomic_req(c, "FETCH_ADD", c.va + 1024, 1, psn=p))
        d = first_response(c, mark)
        ok = (d is not None and d.roce.op == ATOMIC_ACKNOWLEDGE and d.roce.psn == p and _orig(d) == 41
              and d.roce.msn == 2 and d.roce.ack_kind == "ACK")
        t.check("MR-DUP-005", ok, f"duplicate {k + 1}: {describe([d] if d else [])}", frames=[d] if d else [mark + 1],
                expected=f"ATOMIC_ACKNOWLEDGE psn={p:#08x} orig=0x29 AETH ACK msn=2")
    mem = int.from_bytes(c.mem(1024, 8), "little")
    t.check("MR-ATOM-007", mem == 42, f"memory after one FETCH_ADD and two duplicates: {mem}",
            expected="42", observed=[str(mem)])
    check_state(t, c, ["MR-DUP-001"], "RTS", "after the duplicates")
    _next_write_acked(t, c, ["MR-DUP-006"], 3, "epsn and msn unchanged by the duplicates")


@case("TC-DUP-005-b", rules=["MR-DUP-005", "MR-ATOM-007"], category="DUP", caps=("ATOMICS",), timeout=10)
def duplicate_compare_swap_not_reexecuted(t):
    """A duplicate COMPARE_SWAP is not executed again: restoring the old word first shows it stays restored."""
    c = connect(t)
    c.mem_write(1024, _le(7))
    p = c.psn
    mark = c.send(atomic_req(c, "COMPARE_SWAP", c.va + 1024, 99, 7))
    a = first_response(c, mark)
    if a is None or _orig(a) != 7 or c.mem(1024, 8) != _le(99):
        t.undecided("MR-DUP-005", f"the COMPARE_SWAP did not swap: {describe([a] if a else [])}")
    c.mem_write(1024, _le(7))                                # the application puts 7 back
    mark = c.send(atomic_req(c, "COMPARE_SWAP", c.va + 1024, 99, 7, psn=p))
    d = first_response(c, mark)
    ok = d is not None and d.roce.op == ATOMIC_ACKNOWLEDGE and d.roce.psn == p and _orig(d) == 7
    t.check("MR-DUP-005", ok, f"duplicate: {describe([d] if d else [])}", frames=[d] if d else [mark + 1],
            expected=f"ATOMIC_ACKNOWLEDGE psn={p:#08x} orig=0x7")
    mem = int.from_bytes(c.mem(1024, 8), "little")
    t.check("MR-ATOM-007", mem == 7, f"memory after the duplicate: {mem} (99 would mean it was executed again)",
            expected="7", observed=[str(mem)])


@case("TC-DUP-005-c", rules=["MR-DUP-005", "MR-DUP-007", "MR-ATOM-007"], category="DUP", caps=("ATOMICS",),
      timeout=10)
def duplicate_atomic_evicted(t):
    """max_dest_rd_atomic 1: the duplicate of an ATOMIC whose entry a newer ATOMIC took is discarded, not run."""
    c = connect(t, max_dest_rd_atomic=1)
    c.mem_write(1024, _le(10))
    c.mem_write(2048, _le(20))
    pa = c.psn
    mark = c.send(atomic_req(c, "FETCH_ADD", c.va + 1024, 1))
    a = first_response(c, mark)
    mark = c.send(atomic_req(c, "FETCH_ADD", c.va + 2048, 1))
    b = first_response(c, mark)
    if a is None or b is None or _orig(a) != 10 or _orig(b) != 20:
        t.undecided("MR-DUP-005", f"the two FETCH_ADDs were not answered: {describe([x for x in (a, b) if x])}")
    mark = c.send(atomic_req(c, "FETCH_ADD", c.va + 1024, 1, psn=pa))
    seen = c.quiet(0.3, after=mark)
    for r in ("MR-DUP-005", "MR-DUP-007"):
        t.check(r, not seen, f"duplicate of the evicted FETCH_ADD: {describe(seen)}", frames=seen or [mark + 1],
                expected="silently discarded")
    mem = int.from_bytes(c.mem(1024, 8), "little")
    t.check("MR-ATOM-007", mem == 11, f"the first target after its duplicate: {mem}", expected="11",
            observed=[str(mem)])
    _next_write_acked(t, c, ["MR-DUP-005"], 3, "the discarded duplicate changed nothing")


@case("TC-DUP-009-a", rules=["MR-DUP-009", "MR-DUP-003", "MR-DUP-005", "MR-DUP-002", "MR-DUP-006"], category="DUP",
      caps=("ATOMICS",), timeout=10)
def duplicate_of_another_kind(t):
    """A READ or ATOMIC at an earlier WRITE's PSN is discarded; a WRITE at a READ's PSN is re-ACKed, not placed."""
    c = connect(t)
    c.mem_write(1024, _le(100))
    pw = c.psn
    mark = c.send(c.write(b"W" * 16, offset=256))
    if first_response(c, mark) is None:
        t.undecided("MR-DUP-009", "the WRITE was not ACKed")
    pr = c.psn
    mark = c.send(read_req(c, c.va + 512, 16))
    if not read_responses(c, mark, 1):
        t.undecided("MR-DUP-009", "the READ was not answered")
    for what, frame in (("READ at the WRITE's PSN", read_req(c, c.va + 1024, 8, psn=pw)),
                        ("FETCH_ADD at the WRITE's PSN", atomic_req(c, "FETCH_ADD", c.va + 1024, 1, psn=pw))):
        mark = c.send(frame)
        seen = c.quiet(0.25, after=mark)
        t.check("MR-DUP-009", not seen, f"{what}: {describe(seen)}", frames=seen or [mark + 1],
                expected="discarded, no response")
        t.check("MR-DUP-003" if "READ" in what else "MR-DUP-005", not seen, f"{what}: {describe(seen)}",
                frames=seen or [mark + 1], expected="discarded, no response")
    t.check("MR-DUP-009", c.mem(1024, 8) == _le(100), "the ATOMIC target is unchanged")
    epsn = c.psn
    mark = c.send(c.write(b"X" * 16, offset=2048, psn=pr))
    f = first_response(c, mark)
    # epsn - 1, or r - 1 with r the PSN of the READ that was the last request executed (MR-DUP-002, Linux rxe)
    psns = (P.psn_add(epsn, -1), P.psn_add(pr, -1))
    ok = f is not None and f.roce.ack_kind == "ACK" and f.roce.psn in psns and f.roce.msn == 2
    which = ("" if f is None or f.roce.psn not in psns else
             "; the PSN before the READ, r - 1 (recommended)" if f.roce.psn == psns[1] else "; epsn - 1 (allowed)")
    t.check("MR-DUP-002", ok, f"WRITE at the READ's PSN: {describe([f] if f else [])}{which}",
            frames=[f] if f else [mark + 1],
            expected=f"ACKNOWLEDGE ACK psn={psns[0]:#08x} (or {psns[1]:#08x}, before the READ) msn=2")
    check_untouched(t, c, ["MR-DUP-009"], 2048, 16, "WRITE at the READ's PSN")
    _next_write_acked(t, c, ["MR-DUP-006"], 3, "after the duplicates")


# ---- receiver not ready (MR-RNR) -----------------------------------------------------------------------------
@case("TC-RNR-001-a", rules=["MR-RNR-001", "MR-RNR-002", "MR-XH-007", "MR-ACK-008", "MR-RC-019"],
      category="RNR", timeout=10)
def rnr_nak_then_accepted(t):
    """A SEND with no receive WQE: RNR NAK 0x20|14 at its PSN and msn; after post_recv the retry is accepted."""
    c = connect(t, min_rnr_timer=14)
    prime(t, c)
    p = c.psn
    frame = req(c, "SEND_ONLY", payload=b"ready now?")
    mark = c.send(frame)
    f = first_response(c, mark)
    ok = (f is not None and f.roce.op == ACKNOWLEDGE and f.roce.ack_kind == "RNR" and f.roce.syndrome == 0x2E
          and f.roce.psn == p and f.roce.msn == 1)
    for r in ("MR-RNR-001", "MR-XH-007"):
        t.check(r, ok, f"SEND with an empty receive queue: {describe([f] if f else [])}",
                frames=[f] if f else [mark + 1], expected=f"ACKNOWLEDGE RNR(0x2e) psn={p:#08x} msn=1")
    check_state(t, c, ["MR-RNR-002"], "RTS", "after the RNR NAK")
    c.post_recv(64, offset=4096, wr_id=0x501)
    mark = c.send(frame)                                      # the LT retries at the same PSN
    f = first_response(c, mark)
    ok = f is not None and f.roce.ack_kind == "ACK" and f.roce.psn == p and f.roce.msn == 2
    for r in ("MR-RNR-001", "MR-RNR-002", "MR-ACK-008"):
        t.check(r, ok, f"the retried SEND: {describe([f] if f else [])}", frames=[f] if f else [mark + 1],
                expected=f"ACKNOWLEDGE ACK psn={p:#08x} msn=2")
    wc = poll_one(t, c)
    good = (wc is not None and wc["status"] == "IBV_WC_SUCCESS" and wc["opcode"] == "IBV_WC_RECV"
            and wc["byte_len"] == 10 and int(wc["wr_id"], 16) == 0x501)
    t.check("MR-RC-019", good and c.mem(4096, 10) == b"ready now?", f"completion: {wc_text(wc)}",
            expected="wr_id 0x501 IBV_WC_SUCCESS IBV_WC_RECV byte_len 10", observed=[wc_text(wc)])


@case("TC-RNR-001-c", rules=["MR-RNR-001", "MR-XH-007"], category="RNR", timeout=12)
def rnr_timer_field(t):
    """The RNR NAK carries the QP's min_rnr_timer, whichever: codes 0, 1, 19 and 31."""
    for code in (0, 1, 19, 31):
        c = connect(t, min_rnr_timer=code)
        p = c.psn
        mark = c.send(req(c, "SEND_ONLY", payload=b"x"))
        f = first_response(c, mark)
        ok = (f is not None and f.roce.ack_kind == "RNR" and f.roce.syndrome == 0x20 | code and f.roce.psn == p
              and f.roce.msn == 0)
        for r in ("MR-RNR-001", "MR-XH-007"):
            t.check(r, ok, f"min_rnr_timer {code}: {describe([f] if f else [])}", frames=[f] if f else [mark + 1],
                    expected=f"ACKNOWLEDGE RNR({0x20 | code:#04x}) psn={p:#08x} msn=0")


@case("TC-RNR-003-a", rules=["MR-RNR-003", "MR-RNR-001", "MR-NAK-002"], category="RNR", timeout=10)
def rnr_every_packet(t):
    """Each retry that still finds the queue empty gets its own RNR NAK; a packet after epsn gets the sequence NAK."""
    c = connect(t, min_rnr_timer=5)
    p = c.psn
    frame = req(c, "SEND_ONLY", payload=b"again")
    rnrs = []
    for _ in range(3):
        mark = c.send(frame)
        f = first_response(c, mark)
        rnrs.append(f)
        ok = f is not None and f.roce.ack_kind == "RNR" and f.roce.psn == p and f.roce.syndrome == 0x25
        for r in ("MR-RNR-003", "MR-RNR-001"):
            t.check(r, ok, f"SEND at {p:#08x}: {describe([f] if f else [])}", frames=[f] if f else [mark + 1],
                    expected=f"ACKNOWLEDGE RNR(0x25) psn={p:#08x} msn=0")
    # the next PSN is after epsn (epsn stayed p): a PSN sequence error, not RNR
    mark = c.send(req(c, "SEND_ONLY", payload=b"ahead"))
    f = first_response(c, mark)
    ok = f is not None and f.roce.ack_kind == "NAK" and f.roce.nak_code == 0 and f.roce.psn == p
    for r in ("MR-RNR-003", "MR-NAK-002"):
        t.check(r, ok, f"SEND at {P.psn_add(p, 1):#08x}: {describe([f] if f else [])}", frames=[f] if f else [mark + 1],
                expected=f"ACKNOWLEDGE NAK(0x60) psn={p:#08x}")


@case("TC-RNR-001-b", rules=["MR-RNR-001", "MR-RC-019", "MR-OPC-008", "MR-MEM-027"], category="RNR", timeout=10)
def rnr_write_with_immediate(t):
    """A WRITE WITH IMMEDIATE with no receive WQE gets an RNR NAK and writes nothing; the retry is placed."""
    c = connect(t, min_rnr_timer=3)
    p = c.psn
    data = _pattern(200, 8)
    frame = req(c, "RDMA_WRITE_ONLY_WITH_IMMEDIATE", reth=(c.va + 8192, c.rkey, len(data)), imm=0xCAFEF00D,
                payload=data)
    mark = c.send(frame)
    f = first_response(c, mark)
    ok = f is not None and f.roce.ack_kind == "RNR" and f.roce.syndrome == 0x23 and f.roce.psn == p
    t.check("MR-RNR-001", ok, f"WRITE WITH IMMEDIATE, empty receive queue: {describe([f] if f else [])}",
            frames=[f] if f else [mark + 1], expected=f"ACKNOWLEDGE RNR(0x23) psn={p:#08x} msn=0")
    check_untouched(t, c, ["MR-RNR-001", "MR-MEM-027"], 8192, len(data), "WRITE WITH IMMEDIATE refused by RNR")
    c.post_recv(16, offset=4096, wr_id=0x502)
    mark = c.send(frame)
    f = first_response(c, mark)
    ok = f is not None and f.roce.ack_kind == "ACK" and f.roce.psn == p and f.roce.msn == 1
    t.check("MR-RNR-001", ok, f"retry: {describe([f] if f else [])}", frames=[f] if f else [mark + 1],
            expected=f"ACKNOWLEDGE ACK psn={p:#08x} msn=1")
    wc = poll_one(t, c)
    good = (wc is not None and wc["status"] == "IBV_WC_SUCCESS" and wc["opcode"] == "IBV_WC_RECV_RDMA_WITH_IMM"
            and wc["byte_len"] == len(data) and wc.get("imm") == 0xCAFEF00D and int(wc["wr_id"], 16) == 0x502)
    for r in ("MR-RC-019", "MR-OPC-008"):
        t.check(r, good and c.mem(8192, len(data)) == data, f"completion: {wc_text(wc)}",
                expected="wr_id 0x502 IBV_WC_SUCCESS IBV_WC_RECV_RDMA_WITH_IMM byte_len 200 imm 0xcafef00d",
                observed=[wc_text(wc)])
    check_untouched(t, c, ["MR-OPC-008"], 4096, 16, "the receive buffer of a WRITE WITH IMMEDIATE")


@case("TC-RNR-010-a", rules=["MR-RNR-010", "MR-OPC-008"], category="RNR", timeout=10)
def no_rnr_without_receive_wqe_need(t):
    """With the receive queue empty, WRITE, READ (and ATOMIC, if claimed) are executed, never RNR NAKed."""
    c = connect(t)
    c.mem_write(2048, _pattern(64, 9))
    c.mem_write(1024, _le(1))
    checks = [("WRITE", lambda: c.write(b"no RQ needed", offset=512), lambda f: f.roce.ack_kind == "ACK"),
              ("READ", lambda: read_req(c, c.va + 2048, 64),
               lambda f: f.roce.op == 0x10 and f.roce.payload == _pattern(64, 9))]
    if "ATOMICS" in t.claim.caps:
        checks.append(("FETCH_ADD", lambda: atomic_req(c, "FETCH_ADD", c.va + 1024, 1),
                       lambda f: f.roce.op == ATOMIC_ACKNOWLEDGE and _orig(f) == 1))
    for what, mk, good in checks:
        mark = c.send(mk())
        f = first_response(c, mark)
        ok = f is not None and f.roce.ack_kind != "RNR" and good(f)
        for r in ("MR-RNR-010", "MR-OPC-008"):
            t.check(r, ok, f"{what} with an empty receive queue: {describe([f] if f else [])}",
                    frames=[f] if f else [mark + 1], expected=f"{what} executed, no RNR NAK")
    t.check("MR-OPC-008", c.mem(512, 12) == b"no RQ needed", "the WRITE was placed")


@case("TC-RNR-003-b", rules=["MR-RNR-001", "MR-RNR-003", "MR-NAK-002", "MR-RC-018", "MR-OPC-008"], category="RNR",
      timeout=10)
def rnr_multi_packet_send(t):
    """A 3-packet SEND with no receive WQE: RNR NAK at the FIRST, one sequence NAK for the rest; resent, placed."""
    c = connect(t, mtu=256, min_rnr_timer=2)
    p = c.psn
    data = _pattern(600, 10)
    frames = [req(c, "SEND_FIRST", payload=data[:256], ackreq=False),
              req(c, "SEND_MIDDLE", payload=data[256:512], ackreq=False),
              req(c, "SEND_LAST", payload=data[512:])]
    mark = c.send(*frames)
    got = [f for f in c.quiet(0.3, after=mark) if f.roce.op == ACKNOWLEDGE]
    rnr = [f for f in got if f.roce.ack_kind == "RNR"]
    seq = [f for f in got if f.roce.ack_kind == "NAK" and f.roce.nak_code == 0]
    ok = (len(rnr) == 1 and rnr[0].roce.psn == p and rnr[0].roce.syndrome == 0x22
          and got and got[0] is rnr[0])
    t.check("MR-RNR-001", ok, f"responses: {describe(got)}", frames=got or [mark + 1],
            expected=f"ACKNOWLEDGE RNR(0x22) psn={p:#08x} first")
    ok2 = len(seq) == 1 and seq[0].roce.psn == p and len(got) == 2
    for r in ("MR-RNR-003", "MR-NAK-002"):
        t.check(r, ok and ok2, f"responses: {describe(got)}", frames=got or [mark + 1],
                expected=f"one RNR NAK psn={p:#08x}; for the MIDDLE and LAST one NAK(0x60) psn={p:#08x}")
    c.post_recv(1024, offset=4096, wr_id=0x503)
    mark = c.send(*frames)
    f = c.expect(1, 1.0, after=mark, match=lambda x: x.roce.op == ACKNOWLEDGE and x.roce.psn == P.psn_add(p, 2))
    wc = poll_one(t, c)
    good = (bool(f) and f[0].roce.ack_kind == "ACK" and wc is not None and wc["status"] == "IBV_WC_SUCCESS"
            and wc["byte_len"] == 600 and c.mem(4096, 600) == data)
    for r in ("MR-RC-018", "MR-OPC-008"):
        t.check(r, good, f"resent: {describe(f)}; completion {wc_text(wc)}", frames=f or [mark + 1],
                expected=f"ACKNOWLEDGE ACK psn={P.psn_add(p, 2):#08x}, one RECV of 600 bytes, data in order")


# ---- receive completions (MR-RC-019) -------------------------------------------------------------------------
@case("TC-RC-019-a", rules=["MR-RC-019", "MR-RC-018", "MR-QP-034", "MR-ACK-008"], category="ACK", timeout=10)
def send_with_immediate_completion(t):
    """SEND ONLY WITH IMMEDIATE: IBV_WC_RECV with the immediate data and byte_len, data at the buffer's start."""
    c = connect(t)
    c.post_recv(256, offset=4096, wr_id=0x601)
    data = _pattern(77, 11)
    p = c.psn
    mark = c.send(req(c, "SEND_ONLY_WITH_IMMEDIATE", imm=0x12345678, payload=data))
    f = first_response(c, mark)
    t.check("MR-ACK-008", f is not None and f.roce.ack_kind == "ACK" and f.roce.psn == p and f.roce.msn == 1,
            f"response: {describe([f] if f else [])}", frames=[f] if f else [mark + 1],
            expected=f"ACKNOWLEDGE ACK psn={p:#08x} msn=1")
    wc = poll_one(t, c)
    good = (wc is not None and wc["status"] == "IBV_WC_SUCCESS" and wc["opcode"] == "IBV_WC_RECV"
            and wc["byte_len"] == 77 and wc.get("imm") == 0x12345678 and int(wc["wr_id"], 16) == 0x601
            and "invalidated_rkey" not in wc)
    for r in ("MR-RC-019", "MR-QP-034"):
        t.check(r, good, f"completion: {wc_text(wc)}",
                expected="wr_id 0x601 IBV_WC_SUCCESS IBV_WC_RECV byte_len 77 imm 0x12345678",
                observed=[wc_text(wc)])
    t.check("MR-RC-018", c.mem(4096, 77) == data, "SEND data at the start of the receive buffer")
    check_untouched(t, c, ["MR-RC-018"], 4096 + 77, 256 - 77, "rest of the receive buffer")


@case("TC-RC-019-b", rules=["MR-RC-019", "MR-RC-018", "MR-QP-034", "MR-OPC-008"], category="ACK", timeout=10)
def write_with_immediate_completion(t):
    """A 3-packet WRITE ending in LAST WITH IMMEDIATE: RECV_RDMA_WITH_IMM, byte_len the DMA Length, data at VA."""
    c = connect(t, mtu=256)
    c.post_recv(64, offset=4096, wr_id=0x602)
    data = _pattern(700, 12)
    frames = [req(c, "RDMA_WRITE_FIRST", reth=(c.va + 8192, c.rkey, len(data)), payload=data[:256], ackreq=False),
              req(c, "RDMA_WRITE_MIDDLE", payload=data[256:512], ackreq=False),
              req(c, "RDMA_WRITE_LAST_WITH_IMMEDIATE", imm=0x0BADBEEF, payload=data[512:])]
    p = P.psn_add(c.psn, -1)
    mark = c.send(*frames)
    f = c.expect(1, 1.0, after=mark, match=lambda x: x.roce.op == ACKNOWLEDGE)
    t.check("MR-RC-019", bool(f) and f[0].roce.ack_kind == "ACK" and f[0].roce.psn == p and f[0].roce.msn == 1,
            f"response: {describe(f)}", frames=f or [mark + 1], expected=f"ACKNOWLEDGE ACK psn={p:#08x} msn=1")
    wc = poll_one(t, c)
    good = (wc is not None and wc["status"] == "IBV_WC_SUCCESS" and wc["opcode"] == "IBV_WC_RECV_RDMA_WITH_IMM"
            and wc["byte_len"] == 700 and wc.get("imm") == 0x0BADBEEF and int(wc["wr_id"], 16) == 0x602)
    for r in ("MR-RC-019", "MR-QP-034", "MR-OPC-008"):
        t.check(r, good, f"completion: {wc_text(wc)}",
                expected="wr_id 0x602 IBV_WC_SUCCESS IBV_WC_RECV_RDMA_WITH_IMM byte_len 700 imm 0x0badbeef",
                observed=[wc_text(wc)])
    t.check("MR-RC-018", c.mem(8192, 700) == data, "the WRITE's data at RETH.VA")
    check_untouched(t, c, ["MR-RC-018"], 4096, 64, "the receive buffer of a WRITE WITH IMMEDIATE")


@case("TC-RC-019-c", rules=["MR-RC-019", "MR-RC-018", "MR-OPC-008", "MR-ACK-008"], category="ACK", timeout=10)
def multi_packet_send_completion(t):
    """A 3-packet SEND with immediate fills one receive WQE in order; the next SEND takes the next WQE."""
    c = connect(t, mtu=256)
    c.post_recv(1024, offset=4096, wr_id=0x701)
    c.post_recv(1024, offset=8192, wr_id=0x702)
    data = _pattern(600, 13)
    frames = [req(c, "SEND_FIRST", payload=data[:256], ackreq=False),
              req(c, "SEND_MIDDLE", payload=data[256:512], ackreq=False),
              req(c, "SEND_LAST_WITH_IMMEDIATE", imm=0x600, payload=data[512:]),
              req(c, "SEND_ONLY", payload=b"second")]
    p = P.psn_add(c.psn, -1)
    mark = c.send(*frames)
    f = c.expect(1, 1.0, after=mark, match=lambda x: x.roce.op == ACKNOWLEDGE and x.roce.psn == p)
    t.check("MR-ACK-008", bool(f) and f[0].roce.ack_kind == "ACK" and f[0].roce.msn == 2,
            f"ACK of the last packet: {describe(f)}", frames=f or [mark + 1],
            expected=f"ACKNOWLEDGE ACK psn={p:#08x} msn=2")
    wcs = c.poll(2, 1.0)
    got = [(int(w["wr_id"], 16), w["status"], w["opcode"], w["byte_len"], w.get("imm")) for w in wcs]
    want = [(0x701, "IBV_WC_SUCCESS", "IBV_WC_RECV", 600, 0x600), (0x702, "IBV_WC_SUCCESS", "IBV_WC_RECV", 6, None)]
    for r in ("MR-RC-019", "MR-OPC-008"):
        t.check(r, got == want, f"completions: {got}", expected=str(want), observed=[wc_text(w) for w in wcs])
    t.check("MR-RC-018", c.mem(4096, 600) == data and c.mem(8192, 6) == b"second",
            "the 3-packet SEND in order in the first buffer, the next SEND in the second")


@case("TC-RC-016-b", rules=["MR-RC-016", "MR-NAK-006", "MR-QP-032", "MR-QP-024", "MR-NAK-009"], category="SEQ",
      timeout=10)
def send_interrupted_by_write(t):
    """A WRITE ONLY inside a SEND (missing LAST): NAK code 1; the receive WQE in use completes REM_INV_REQ_ERR."""
    c = connect(t, mtu=256)
    c.post_recv(1024, offset=4096, wr_id=0x81)
    c.post_recv(1024, offset=8192, wr_id=0x82)
    mark = c.send(req(c, "SEND_FIRST", payload=_pattern(256, 14)))
    f = first_response(c, mark)
    if f is None or f.roce.ack_kind != "ACK":
        t.undecided("MR-RC-016", f"the SEND FIRST was not ACKed: {describe([f] if f else [])}")
    expect_fatal(t, c, c.write(b"interloper", offset=512), 1, "WRITE ONLY inside a SEND",
                 nak=["MR-RC-016", "MR-NAK-006"], msn=0)
    wcs = c.poll(2, 1.0)
    got = [(int(w["wr_id"], 16), w["status"]) for w in wcs]
    want = [(0x81, "IBV_WC_REM_INV_REQ_ERR"), (0x82, "IBV_WC_WR_FLUSH_ERR")]
    t.check("MR-QP-032", got[:1] == want[:1], f"completions: {got}", expected=str(want[:1]),
            observed=[wc_text(w) for w in wcs])
    t.check("MR-QP-024", got == want, f"completions: {got}", expected=str(want), observed=[wc_text(w) for w in wcs])
    check_err(t, c, ["MR-NAK-009"], "WRITE ONLY inside a SEND")


@case("TC-NAK-014-a", rules=["MR-NAK-014", "MR-NAK-006", "MR-NAK-007", "MR-RNR-001"], category="ACK", timeout=15)
def responder_check_order(t):
    """Table 3-4's order decides which error is reported when a request breaks two checks at once."""
    # QP access flags (3) before the receive WQE (4): WRITE WITH IMMEDIATE, no REMOTE_WRITE, receive queue empty
    c = connect(t, access=["REMOTE_READ"])
    p = c.psn
    mark = c.send(req(c, "RDMA_WRITE_ONLY_WITH_IMMEDIATE", reth=(c.va, c.rkey, 4), imm=1, payload=b"abcd"))
    check_nak(t, c, ["MR-NAK-014", "MR-NAK-006"], mark, 1, p, 0, "QP access (3) before receive WQE (4)")
    # receive WQE (4) before length (5): a SEND longer than any buffer with the receive queue empty is RNR
    c = connect(t, min_rnr_timer=9)
    p = c.psn
    mark = c.send(req(c, "SEND_ONLY", payload=bytes(c.mtu)))
    f = first_response(c, mark)
    ok = f is not None and f.roce.ack_kind == "RNR" and f.roce.syndrome == 0x29 and f.roce.psn == p
    for r in ("MR-NAK-014", "MR-RNR-001"):
        t.check(r, ok, f"receive WQE (4) before length (5): {describe([f] if f else [])}",
                frames=[f] if f else [mark + 1], expected=f"ACKNOWLEDGE RNR(0x29) psn={p:#08x}")
    # responder resources (4) before R_Key (6): a READ with a bad key on max_dest_rd_atomic 0
    c = connect(t, max_dest_rd_atomic=0)
    p = c.psn
    mark = c.send(read_req(c, c.va, 64, rkey=c.rkey ^ 0x5500))
    check_nak(t, c, ["MR-NAK-014", "MR-NAK-006"], mark, 1, p, 0, "resources (4) before R_Key (6)")
    # length (5) and R_Key (6) both failing: a WRITE ONLY carrying 16 bytes for a DMA Length of 8, with a bad
    # key, may be answered after either (MR-NAK-014's one exception): code 1 or 2, fatal
    c = connect(t)
    p = c.psn
    mark = c.send(req(c, "RDMA_WRITE_ONLY", reth=(c.va + 64, c.rkey ^ 0x5500, 8), payload=bytes(16)))
    check_nak(t, c, ["MR-NAK-014", "MR-NAK-006"], mark, (1, 2), p, 0, "length (5) and R_Key (6) both failing")
    # R_Key (6) before ATOMIC alignment (7): an unaligned FETCH_ADD with a bad key
    if "ATOMICS" in t.claim.caps:
        c = connect(t)
        p = c.psn
        mark = c.send(atomic_req(c, "FETCH_ADD", c.va + 12, 1, rkey=c.rkey ^ 0x5500))
        check_nak(t, c, ["MR-NAK-014", "MR-NAK-007"], mark, 2, p, 0, "R_Key (6) before alignment (7)")
    else:
        c = connect(t)
        p = c.psn
        mark = c.send(req(c, "RDMA_WRITE_ONLY", reth=(c.va + c.mr_len - 4, c.rkey, 8), payload=bytes(8)))
        check_nak(t, c, ["MR-NAK-007"], mark, 2, p, 0, "bounds")


@case("TC-NAK-013-a", rules=["MR-NAK-013", "MR-ACK-014"], category="ACK", timeout=12)
def naks_whatever_ackreq(t):
    """Invalid-request, access-error and RNR NAKs are sent for packets without AckReq, and never repeated."""
    subjects = []
    c = connect(t, access=["REMOTE_READ"])
    p = c.psn
    subjects.append((c, c.send(req(c, "RDMA_WRITE_ONLY", reth=(c.va, c.rkey, 4), payload=b"abcd", ackreq=False)),
                     "ACKNOWLEDGE NAK(0x61)", lambda f, p=p: f.roce.nak_code == 1 and f.roce.psn == p,
                     "invalid request"))
    c = connect(t)
    p = c.psn
    subjects.append((c, c.send(req(c, "RDMA_WRITE_ONLY", reth=(c.va, c.rkey ^ 0x100, 4), payload=b"abcd",
                                   ackreq=False)),
                     "ACKNOWLEDGE NAK(0x62)", lambda f, p=p: f.roce.nak_code == 2 and f.roce.psn == p, "access error"))
    c = connect(t, min_rnr_timer=1)
    p = c.psn
    subjects.append((c, c.send(req(c, "SEND_ONLY", payload=b"x", ackreq=False)), "ACKNOWLEDGE RNR(0x21)",
                     lambda f, p=p: f.roce.syndrome == 0x21 and f.roce.psn == p, "receiver not ready"))
    for c, mark, exp, good, what in subjects:
        got = [f for f in c.quiet(0.6, after=mark) if f.roce.op == ACKNOWLEDGE]
        ok = len(got) == 1 and good(got[0])
        t.check("MR-ACK-014", len(got) >= 1 and good(got[0]), f"{what} without AckReq: {describe(got)}",
                frames=got or [mark + 1], expected=exp)
        t.check("MR-NAK-013", ok, f"{what} without AckReq, over 0.6 s: {describe(got)}", frames=got or [mark + 1],
                expected=f"exactly one {exp}")


@case("TC-RC-025-a", rules=["MR-RC-025", "MR-RC-014"], category="ACK", caps=("ATOMICS",), timeout=12)
def responses_leave_in_psn_order(t):
    """A 256-packet READ, a WRITE with AckReq and a FETCH_ADD sent together: all READ responses, then the ACK, then
    the ATOMIC ACKNOWLEDGE."""
    c = connect(t, mtu=256)
    data = _pattern(65536, 15)
    c.mem_write(0, data[:32768])
    c.mem_write(32768, data[32768:])
    c.mem_write(4096 * 15, _le(9))          # the ATOMIC target lies inside the READ's range: read before the add
    data = data[:4096 * 15] + _le(9) + data[4096 * 15 + 8:]
    pr = c.psn
    frames = [read_req(c, c.va, 65536)]
    pw = c.psn
    frames.append(c.write(b"W" * 8, offset=c.mr_len - 64))
    pa = c.psn
    frames.append(atomic_req(c, "FETCH_ADD", c.va + 4096 * 15, 1))
    mark = c.send(*frames)
    got = c.expect(258, 5.0, after=mark)
    kinds = [("R" if f.roce.op in READ_RESPONSES else "A" if f.roce.op == ACKNOWLEDGE else "T") for f in got]
    order = "".join(kinds)
    reads = [f for f in got if f.roce.op in READ_RESPONSES]
    ok = order == "R" * 256 + "AT"
    exp = f"256 READ RESPONSEs from {pr:#08x}, then ACK psn={pw:#08x}, then ATOMIC_ACKNOWLEDGE psn={pa:#08x}"
    tail = got[-2:] if len(got) >= 2 else got
    detail = (f"order of the {len(got)} responses: {len(reads)} READ RESPONSE, then "
              f"{describe([f for f in got if f.roce.op not in READ_RESPONSES])}")
    t.check("MR-RC-025", ok, detail, frames=tail or [mark + 1], expected=exp)
    good_tail = (ok and tail[0].roce.psn == pw and tail[0].roce.ack_kind == "ACK" and tail[0].roce.msn == 2
                 and tail[1].roce.psn == pa and _orig(tail[1]) == 9 and tail[1].roce.msn == 3)
    t.check("MR-RC-014", good_tail and b"".join(f.roce.payload for f in reads) == data,
            "the READ saw the word before the FETCH_ADD; ACK msn 2, ATOMIC ACKNOWLEDGE orig 9 msn 3" if good_tail
            else detail, frames=tail or [mark + 1], expected=exp)


def _credits(code: int) -> int:
    """Table 3-3."""
    if code < 4:
        return code
    return 1 << (code // 2) if code % 2 == 0 else 3 << ((code - 1) // 2 - 1)


@case("TC-ACK-009-a", rules=["MR-ACK-009"], category="ACK", timeout=10)
def ack_credit_code(t):
    """The credit code of each ACK is 0x1F or the largest code not above the receive WQEs left (5, 3, 0)."""
    c = connect(t)
    for i in range(5):
        c.post_recv(64, offset=4096 + 64 * i, wr_id=0x900 + i)
    for left, frames in ((5, [c.write(b"w", offset=64)]),
                         (3, [req(c, "SEND_ONLY", payload=b"a", ackreq=False), req(c, "SEND_ONLY", payload=b"b")]),
                         (0, [req(c, "SEND_ONLY", payload=b"c", ackreq=False), req(c, "SEND_ONLY", payload=b"d",
                                                                                  ackreq=False),
                              req(c, "SEND_ONLY", payload=b"e")])):
        p = P.parse(frames[-1]).psn
        mark = c.send(*frames)
        got = c.expect(1, 1.0, after=mark, match=lambda f, p=p: f.roce.op == ACKNOWLEDGE and f.roce.psn == p)
        best = max(k for k in range(0x1F) if _credits(k) <= left)
        f = got[0] if got else None
        ok = f is not None and f.roce.ack_kind == "ACK" and f.roce.syndrome in (0x1F, best)
        t.check("MR-ACK-009", ok, f"{left} receive WQEs left: {describe(got)}", frames=got or [mark + 1],
                expected=f"ACKNOWLEDGE ACK psn={p:#08x} with credit code {best:#04x} or 0x1f")
