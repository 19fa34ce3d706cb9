"""Native profile edge cases: the far ends of the PSN window, duplicates of sacked PSNs, gap filling, messages
that are not ready behind ready ones, zero-length messages, atomics in order, forged sources, and READ responses
that repeat bytes already received (04-native.md 4.3.2-4.3.4, 4.4)."""
from __future__ import annotations

import struct

from .. import native_packets as N
from .. import packets as P
from ..registry import case
from ._common import ACK_WAIT, QUIET
from ._native import (FILL, WC_OK, check_wcs, connect_native, counted, fpsn, is_sack, need, nv, op, pattern, post,
                      summ, wait_requests, wc_list, wr)
from .native_req import _first_tx, _sack_for


@case("TC-SACK-011-b", rules=["MR-SACK-011", "MR-SACK-013"], category="SACK", profile="native", timeout=30)
def psn_half_space(t):
    """A WRITE at ePSN + 2^23 - 1 (ahead, outside the window) is discarded without a SACK; one at ePSN - 2^23 + 1
    (the farthest PSN before the ePSN: a duplicate) is answered with a SACK at once; neither is placed."""
    c = connect_native(t)
    e = c.psn
    mark0 = c.send(*c.write_msg(b"0" * 8, 0))
    need(c.sack_for(e, mark0) is not None, "the first WRITE was not SACKed")
    ep = c.psn
    ahead = c.write_msg(b"A" * 8, 1024, psn=P.psn_add(ep, (1 << 23) - 1), msn=c.msn + 3, advance=False)
    mark = c.send(*ahead)
    seen = c.quiet(QUIET, after=mark)
    behind = c.write_msg(b"B" * 8, 2048, psn=P.psn_add(ep, 1 - (1 << 23)), msn=c.msn + 4, advance=False)
    mark2 = c.send(*behind)
    s = c.first_sack(mark2)
    t.check("MR-SACK-011", not seen and c.mem(1024, 8) == bytes([FILL]) * 8,
            f"ePSN + 2^23 - 1: {summ(seen) or 'no response'}", frames=seen or [mark + 1],
            expected="discarded: no SACK, nothing placed")
    t.check("MR-SACK-013", s is not None and nv(s).psn == e and c.mem(2048, 8) == bytes([FILL]) * 8,
            f"ePSN - 2^23 + 1 (a duplicate): {summ([s]) if s else 'no SACK'}", frames=[s] if s else [mark2 + 1],
            expected=f"a NATIVE_SACK cum {e:#08x} at once, nothing placed")


@case("TC-SACK-013-b", rules=["MR-SACK-013", "MR-SACK-014", "MR-OOO-005"], category="DUP", profile="native",
      timeout=30)
def duplicate_of_a_sacked_psn(t):
    """A copy of a PSN recorded beyond the ePSN (AckReq clear, other bytes) is SACKed at once and not placed
    again."""
    c = connect_native(t)
    e = c.psn
    f0 = c.write_msg(b"a" * 32, 0, ackreq_last=False)
    f1 = c.write_msg(b"b" * 32, 512, ackreq_last=False)
    mark = c.send(*f1)
    s = c.first_sack(mark)
    need(s is not None and P.psn_add(e, 1) in nv(s).received(), "the out-of-order WRITE was not reported")
    dup = c.write_msg(b"X" * 32, 512, psn=P.psn_add(e, 1), msn=1, ackreq_last=False, retx=True, advance=False)
    mark2 = c.send(*dup)
    s2 = c.first_sack(mark2)
    ok = s2 is not None and P.psn_add(e, 1) in nv(s2).received()
    t.check("MR-SACK-013", ok, f"copy of the sacked PSN: {summ([s2]) if s2 else 'no SACK'}",
            frames=[s2] if s2 else [mark2 + 1], expected="a SACK at once, still reporting it")
    t.check("MR-SACK-014", ok, "a duplicate triggers a SACK without AckReq", frames=[s2] if s2 else [])
    t.check("MR-OOO-005", c.mem(512, 32) == b"b" * 32, "the copy's bytes not placed", expected="32 x 'b'",
            observed=[c.mem(512, 8).hex()])
    c.send(*f0)


@case("TC-SACK-014-b", rules=["MR-SACK-014"], category="SACK", profile="native", timeout=30)
def gap_filling_sacked_without_ackreq(t):
    """AckReq clear everywhere: ePSN + 1 (a new gap) and then the ePSN (it fills the gap) are each answered by a
    SACK at once, the second with the cumulative PSN at ePSN + 1."""
    c = connect_native(t)
    e = c.psn
    f0 = c.write_msg(b"0" * 16, 0, ackreq_last=False)
    f1 = c.write_msg(b"1" * 16, 64, ackreq_last=False)
    mark = c.send(*f1)
    s1 = c.first_sack(mark)
    mark2 = c.send(*f0)
    s2 = c.sack_for(P.psn_add(e, 1), mark2)
    t.check("MR-SACK-014", s1 is not None and P.psn_add(e, 1) in nv(s1).received(),
            f"new gap: {summ([s1]) if s1 else 'no SACK'}", frames=[s1] if s1 else [mark + 1],
            expected=f"a SACK reporting {P.psn_add(e, 1):#08x}")
    t.check("MR-SACK-014", s2 is not None and nv(s2).psn == P.psn_add(e, 1),
            f"gap filled: {summ([s2]) if s2 else 'no SACK'}", frames=[s2] if s2 else [mark2 + 1],
            expected=f"a SACK cum {P.psn_add(e, 1):#08x}")


@case("TC-OOO-012-b", rules=["MR-OOO-012", "MR-SACK-035"], category="RNR", profile="native", timeout=30)
def later_message_not_ready(t):
    """One receive WQE, two SENDs: RSN 1 arriving first is not ready -- not recorded, not placed; RSN 0 is accepted;
    a copy of RSN 1 once it is the ePSN gets an RNR NAK-type SACK."""
    c = connect_native(t, min_rnr_timer=12)
    c.post_recv(256, 0, wr_id=0x61)
    e = c.psn
    s0 = c.send_msg(b"zero" * 8)
    s1 = c.send_msg(b"one!" * 8)
    mark = c.send(*s1)
    res = c.quiet(0.25, after=mark)
    rec = [f for f in res if is_sack(f) and nv(f).sack_kind == "ACK" and P.psn_add(e, 1) in nv(f).received()]
    mark2 = c.send(*s0)
    sk = c.sack_for(e, mark2)
    mark3 = c.send(*s1)
    rnr = c.first_sack(mark3, match=lambda f: nv(f).sack_kind == "RNR")
    ok = not rec and sk is not None and nv(sk).psn == e and c.mem(0, 32) == b"zero" * 8
    t.check("MR-OOO-012", ok, f"RSN 1 first: {summ(res) or 'nothing'}; RSN 0: {summ([sk]) if sk else 'no SACK'}",
            frames=rec + ([sk] if sk else []), expected=f"{P.psn_add(e, 1):#08x} never reported; RSN 0 placed")
    t.check("MR-SACK-035", rnr is not None and nv(rnr).psn == P.psn_add(e, 1) and nv(rnr).syndrome == 0x20 | 12,
            f"the copy of RSN 1 at the ePSN: {summ([rnr]) if rnr else 'no RNR NAK'}", frames=[rnr] if rnr else [],
            expected=f"RNR NAK-type SACK 0x2c psn {P.psn_add(e, 1):#08x}")


@case("TC-OOO-003-b", rules=["MR-OOO-003", "MR-SACK-003"], category="OOO", profile="native", timeout=30)
def read_psns_recorded(t):
    """An in-order READ of three PSNs with AckReq: the SACK's cumulative PSN covers all three (the READ's range is
    recorded when the request is accepted) and its MSN counts the READ."""
    c = connect_native(t)
    e = c.psn
    mark = c.send(c.read_req(0, 2500))
    s = c.sack_for(P.psn_add(e, 2), mark)
    ok = s is not None and nv(s).psn == P.psn_add(e, 2)
    t.check("MR-OOO-003", ok, f"{summ([s]) if s else 'no SACK covering the READ'}", frames=[s] if s else [mark + 1],
            expected=f"cum {P.psn_add(e, 2):#08x}")
    t.check("MR-SACK-003", ok and nv(s).msn == 1, f"AETH.MSN {nv(s).msn if s else None}", frames=[s] if s else [],
            expected="MSN 1 (the READ executed)")


@case("TC-NAT-006-b", rules=["MR-NAT-006", "MR-OOO-023"], category="ATOM", caps=("ATOMICS",), profile="native",
      timeout=30)
def compare_swap_in_order(t):
    """COMPARE_SWAP on a native QP: a matching compare swaps, a failing one does not; each is answered by an
    ATOMIC_ACKNOWLEDGE with its PSN, syndrome 0x1f, the running MSN and the original value."""
    c = connect_native(t)
    c.mem_write(256, struct.pack("<Q", 7))
    e = c.psn
    mark = c.send(c.atomic("COMPARE_SWAP", 256, 99, 7), c.atomic("COMPARE_SWAP", 256, 55, 7))
    got = c.expect(2, ACK_WAIT, after=mark, match=lambda f: op(f) == N.ATOMIC_ACKNOWLEDGE)
    vs = [nv(f) for f in got]
    val = struct.unpack("<Q", c.mem(256, 8))[0]
    ok = ([(v.psn, v.syndrome, v.msn, v.atomic_ack) for v in vs] == [(e, 0x1F, 1, 7), (P.psn_add(e, 1), 0x1F, 2, 99)]
          and val == 99)
    for r in ("MR-NAT-006", "MR-OOO-023"):
        t.check(r, ok, f"{summ(got)}; value {val}", frames=got or [mark + 1],
                expected=f"ATOMIC_ACKNOWLEDGE {e:#08x} msn 1 orig 7, then {P.psn_add(e, 1):#08x} msn 2 orig 99; "
                         "value 99")


@case("TC-SACK-019-c", rules=["MR-SACK-019"], category="SEC", profile="native", timeout=30)
def sack_from_another_source_ignored(t):
    """A SACK from another IP source address, and one for another QPN, acknowledge nothing; the right one then
    completes the WRITE."""
    c = connect_native(t, timeout=18)
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_WRITE", 16, wr_id=1))
    fr = wait_requests(c, mark, {p})
    need(fr, "the WRITE was not sent")
    import ipaddress
    other = str(ipaddress.ip_address(t.lt_ip) + 77)
    c.send(_sack_for(c, fr[0], p, src_ip=other), _sack_for(c, fr[0], p, dqpn=c.qpn ^ 0x5A5A))
    w0 = c.poll(1, 0.2)
    c.send(_sack_for(c, fr[0], p))
    w1 = c.poll(1, 2.0)
    t.check("MR-SACK-019", not w0 and [w["status"] for w in w1] == [WC_OK],
            f"forged source / other QPN: completions {wc_list(w0)}; the connected peer's: {wc_list(w1)}",
            expected="nothing from the forged SACKs, the WRITE completes on the right one")


@case("TC-OOO-018-b", rules=["MR-OOO-018"], category="OOO", profile="native", timeout=30)
def read_response_copy_ignored(t):
    """A copy of a READ response already received, carrying other bytes, is ignored: the READ's data are the
    first copy's."""
    c = connect_native(t, timeout=18)
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_READ", 2048, wr_id=1))
    fr = wait_requests(c, mark, {p})
    need(fr, "no READ request")
    m = int(nv(fr[0]).neth.msn)
    src = pattern(2048, 12)
    c.send(c.read_resp(p, m, 0, 2048, src[:1024]), c.read_resp(p, m, 0, 2048, b"\xEE" * 1024, retx=True),
           c.read_resp(P.psn_add(p, 1), m, 1024, 2048, src[1024:]))
    wcs = c.poll(1, 2.0)
    t.check("MR-OOO-018", [w["status"] for w in wcs] == [WC_OK] and c.mem(0, 2048) == src,
            f"completion {wc_list(wcs)}; first bytes {c.mem(0, 4).hex()}", expected="the first copy's bytes")


@case("TC-NAT-017-b", rules=["MR-NAT-017", "MR-NAT-018", "MR-NAT-016"], category="WIRE", profile="native",
      timeout=30)
def zero_length_write(t):
    """A zero-length RDMA WRITE is one NATIVE_WRITE: FIRST and LAST set, offset 0, msg_len 0, no payload, RETH
    DMA Length 0; the next message takes the next PSN."""
    c = connect_native(t, timeout=18)
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_WRITE", 0, wr_id=1), wr(c, "RDMA_WRITE", 4, wr_id=2))
    fr = wait_requests(c, mark, {p, P.psn_add(p, 1)})
    first = _first_tx(fr)
    need(len(first) == 2, f"requests: {summ(fr)}")
    v = nv(first[p])
    ok = (v.op == N.NATIVE_WRITE and v.neth.first and v.neth.last and int(v.neth.offset) == 0
          and int(v.neth.msg_len) == 0 and v.payload == b"" and int(v.reth.dlen) == 0 and v.pad == 0)
    t.check("MR-NAT-017", ok, summ([first[p]]), frames=[first[p]], expected="one packet, no payload")
    t.check("MR-NAT-018", ok, summ([first[p]]), frames=[first[p]], expected="F and L set, offset 0, msg_len 0")
    t.check("MR-NAT-016", int(nv(first[P.psn_add(p, 1)]).neth.msn) == 1, summ(fr[:2]), frames=fr[:2],
            expected="the next WRITE at the next PSN, MSN 1")
    c.send(_sack_for(c, first[P.psn_add(p, 1)], P.psn_add(p, 1)))
    wcs = c.poll(2, 2.0)
    check_wcs(t, "MR-NAT-017", wcs, [(1, WC_OK), (2, WC_OK)], "both complete")


@case("TC-OOO-015-a", rules=["MR-OOO-015", "MR-OOO-007"], category="OOO", profile="native", timeout=30)
def zero_length_send_received(t):
    """A zero-length NATIVE_SEND consumes a receive WQE and completes it with byte_len 0, IBV_WC_RECV."""
    c = connect_native(t)
    c.post_recv(64, 0, wr_id=0x71)
    mark = c.send(*c.send_msg(b""))
    s = c.sack_for(P.psn_add(c.psn, -1), mark)
    wcs = c.poll(1, 2.0)
    w = wcs[0] if wcs else {}
    t.check("MR-OOO-015", w.get("status") == WC_OK and w.get("opcode") == "IBV_WC_RECV" and w.get("byte_len") == 0,
            f"completion {w}", expected="IBV_WC_RECV, byte_len 0", observed=[str(w)])
    t.check("MR-OOO-007", s is not None and c.mem(0, 64) == bytes([FILL]) * 64, "SACKed, nothing placed",
            frames=[s] if s else [], expected="a SACK; the buffer untouched")


@case("TC-OOO-017-b", rules=["MR-OOO-017", "MR-XH-018"], category="OOO", profile="native", timeout=30)
def zero_length_read(t):
    """A zero-length NATIVE_READ_REQ takes one PSN and is answered by one NATIVE_READ_RESP with F and L set,
    offset 0, msg_len 0 and no payload."""
    c = connect_native(t)
    e = c.psn
    mark = c.send(c.read_req(0, 0))
    rs = c.expect(1, ACK_WAIT, after=mark, match=lambda f: op(f) == N.NATIVE_READ_RESP)
    v = nv(rs[0]) if rs else None
    ok = (v is not None and v.psn == e and v.neth.first and v.neth.last and int(v.neth.offset) == 0
          and int(v.neth.msg_len) == 0 and v.payload == b"" and v.pad == 0)
    for r in ("MR-OOO-017", "MR-XH-018"):
        t.check(r, ok, summ(rs) or "no response", frames=rs or [mark + 1],
                expected=f"NATIVE_READ_RESP psn {e:#08x} F L offset 0 msg_len 0, no payload")


@case("TC-NAT-021-b", rules=["MR-NAT-021", "MR-NAT-016"], category="OOO", profile="native", timeout=30)
def zero_length_read_request(t):
    """A zero-length RDMA READ is a NATIVE_READ_REQ of DMA Length 0 taking one PSN; the next request follows it."""
    c = connect_native(t, timeout=18)
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_READ", 0, wr_id=1), wr(c, "RDMA_WRITE", 4, wr_id=2))
    fr = wait_requests(c, mark, {p, P.psn_add(p, 1)})
    first = _first_tx(fr)
    need(len(first) == 2, f"requests: {summ(fr)}")
    v = nv(first[p])
    ok = (v.op == N.NATIVE_READ_REQ and int(v.reth.dlen) == 0 and int(v.neth.msg_len) == 0 and v.neth.first
          and v.neth.last and v.payload == b"")
    t.check("MR-NAT-021", ok, summ([first[p]]), frames=[first[p]], expected="READ_REQ, DMA Length 0, F L, msg_len 0")
    t.check("MR-NAT-016", nv(first[P.psn_add(p, 1)]).op == N.NATIVE_WRITE, summ(fr[:2]), frames=fr[:2],
            expected=f"the WRITE at {P.psn_add(p, 1):#08x}")
    c.send(c.read_resp(p, int(v.neth.msn), 0, 0, b""), _sack_for(c, first[P.psn_add(p, 1)], P.psn_add(p, 1)))
    wcs = c.poll(2, 2.0)
    check_wcs(t, "MR-NAT-021", wcs, [(1, WC_OK), (2, WC_OK)], "READ and WRITE complete")


@case("TC-SACK-030-a", rules=["MR-SACK-030"], category="SACK", profile="native", timeout=30)
def spurious_retransmission_detected(t):
    """The LT answers a WRITE only after the IUT's RTO retransmitted it, with a SACK echoing the first
    transmission's TSval: the IUT counts a spurious retransmission (the Eifel test of MR-SACK-030)."""
    c = connect_native(t, timeout=18)
    p = c.iut_psn
    before = c.native_counters()
    if not before or "spurious_retx" not in before:
        from ..context import NotApplicable
        raise NotApplicable("the agent reports no per-QP spurious_retx counter")
    mark = post(c, wr(c, "RDMA_WRITE", 16, wr_id=1))
    txs = c.t.lt.collect(lambda f: c.is_mine(f) and fpsn(f) == p, 1.0, after=mark, until=lambda fs: len(fs) >= 2)
    need(len(txs) >= 2, f"no retransmission: {summ(txs)}")
    c.send(_sack_for(c, txs[0], p))        # tsecr: the first transmission's TSval, before the retransmission's
    wcs = c.poll(1, 2.0)
    grew, text = counted(t, c, "spurious_retx", before)
    t.check("MR-SACK-030", grew and [w["status"] for w in wcs] == [WC_OK],
            f"SACK echoing TSval {int(nv(txs[0]).neth.tsval):#x} (first transmission) after the retransmission "
            f"with TSval {int(nv(txs[1]).neth.tsval):#x}: {text}; {wc_list(wcs)}", frames=txs[:2],
            expected="spurious_retx +1, the WRITE completes")


@case("TC-OOO-025-b", rules=["MR-OOO-025"], category="ATOM", caps=("ATOMICS",), profile="native", timeout=30)
def atomic_ack_copy_discarded(t):
    """A second ATOMIC_ACKNOWLEDGE for an atomic already completed is discarded and counted; nothing completes
    twice."""
    c = connect_native(t, timeout=18)
    p = c.iut_psn
    mark = post(c, wr(c, "ATOMIC_FETCH_AND_ADD", 8, wr_id=1, offset=64, swap_add=hex(1)))
    fr = wait_requests(c, mark, {p})
    need(fr, "the atomic was not sent")
    c.send(c.atomic_ack(p, 41, msn=1))
    w1 = c.poll(1, 2.0)
    before = c.native_counters()
    c.send(c.atomic_ack(p, 999, msn=1))
    w2 = c.poll(1, 0.2)
    grew, text = counted(t, c, "atomic_ack_discarded", before)
    val = struct.unpack("<Q", c.mem(64, 8))[0]
    t.check("MR-OOO-025", [w["status"] for w in w1] == [WC_OK] and not w2 and grew and val == 41,
            f"first: {wc_list(w1)}; the copy: {wc_list(w2)}, {text}; local value {val}",
            expected="one completion with 41; the copy discarded and counted")


@case("TC-NAT-019-b", rules=["MR-NAT-019", "MR-NAT-020", "MR-NAT-025"], category="WIRE", profile="native",
      timeout=30)
def write_imm_every_packet(t):
    """A 2500-byte RDMA WRITE WITH IMMEDIATE: three NATIVE_WRITE_IMM packets, each with the same RETH (the message's
    VA, rkey, 2500), the same ImmDt and the same RSN 0."""
    c = connect_native(t, timeout=18)
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_WRITE_WITH_IMM", 2500, wr_id=1, imm=0x5EED5EED))
    fr = wait_requests(c, mark, {P.psn_add(p, i) for i in range(3)})
    first = _first_tx(fr)
    need(len(first) == 3, f"requests: {summ(fr)}")
    vs = [nv(first[P.psn_add(p, i)]) for i in range(3)]
    frames = [first[P.psn_add(p, i)] for i in range(3)]
    t.check("MR-NAT-019", all(v.op == N.NATIVE_WRITE_IMM and bytes(v.reth) == bytes(vs[0].reth) for v in vs)
            and int(vs[0].reth.dlen) == 2500, summ(frames), frames=frames, expected="one RETH, dlen 2500, in each")
    t.check("MR-NAT-020", [v.imm for v in vs] == [0x5EED5EED] * 3, f"ImmDt {[v.imm for v in vs]}", frames=frames,
            expected="0x5eed5eed in every packet")
    t.check("MR-NAT-025", [int(v.rsneth.rsn) if v.rsneth else None for v in vs] == [0, 0, 0], summ(frames),
            frames=frames, expected="RSN 0 in every packet")
    c.send(_sack_for(c, frames[-1], P.psn_add(p, 2)))
    c.poll(1, 1.0)


@case("TC-NAT-025-b", rules=["MR-NAT-025", "MR-XH-037", "MR-SACK-024"], category="WIRE", profile="native",
      timeout=30)
def rsn_kept_in_retransmissions(t):
    """An unanswered SEND_WITH_IMM retransmitted on RTO keeps its RSNETH (RSN 1, after a first SEND) and ImmDt."""
    c = connect_native(t, timeout=18)
    p = c.iut_psn
    mark = post(c, wr(c, "SEND", 8, wr_id=1), wr(c, "SEND_WITH_IMM", 8, wr_id=2, imm=0x77))
    fr = wait_requests(c, mark, {p, P.psn_add(p, 1)})
    first = _first_tx(fr)
    need(len(first) == 2, f"requests: {summ(fr)}")
    c.send(_sack_for(c, first[p], p))
    rx = c.t.lt.collect(lambda f: c.is_mine(f) and fpsn(f) == P.psn_add(p, 1) and f.num > first[P.psn_add(p, 1)].num,
                        1.0, after=mark, until=lambda fs: bool(fs))
    v = nv(rx[0]) if rx else None
    ok = v is not None and v.neth.retx and v.rsneth is not None and int(v.rsneth.rsn) == 1 and v.imm == 0x77
    for r in ("MR-NAT-025", "MR-XH-037", "MR-SACK-024"):
        t.check(r, ok, f"retransmission: {summ(rx)}", frames=rx or [first[P.psn_add(p, 1)]],
                expected="NATIVE_SEND_IMM RETX with RSN 1 and ImmDt 0x77")
    if rx:
        c.send(_sack_for(c, rx[0], P.psn_add(p, 1)))
    c.poll(2, 1.0)
