"""Header cases of 02-headers.md that header.py leaves open: the opcodes and PSNs the IUT puts in what it
sends (as requester and as responder), the AtomicETH and IETH it builds, the compare value a responder
ignores, the outstanding-PSN window, and the routing of requests, responses and CNPs."""
from __future__ import annotations

import struct

from .. import packets as P
from ..registry import case
from ._common import QUIET, describe, expect_ack
from ._req import (REMOTE_RKEY, REMOTE_VA, ack, agent_error, cnp, connect_req, is_req, pattern, post, requests, wr,
                   write_wr)

ATOMIC_ACK = 0x12


def _udp_payload_len(f) -> int:
    """The UDP payload length (BTH to ICRC) of a captured frame, from the UDP Length field."""
    ip, ver = P._ip_offset(f.data)
    udp = ip + (20 if ver == 4 else 40)
    return struct.unpack_from("!H", f.data, udp + 4)[0] - 8


@case("TC-BTH-002-a", rules=["MR-BTH-002", "MR-BTH-018"], category="WIRE", timeout=10)
def opcodes_and_psns_of_what_the_iut_sends(t):
    """As requester (path MTU 1024): a 2500-byte SEND is SEND FIRST, MIDDLE, LAST; a 2500-byte WRITE is WRITE
    FIRST, MIDDLE, LAST; SEND and WRITE with immediate of 10 bytes are the ONLY_WITH_IMMEDIATE opcodes; the 8 PSNs
    run on from sq_psn.  As responder: a 2500-byte READ is answered FIRST, MIDDLE, LAST at the request's PSN and
    the two after it, a WRITE and a FETCH_ADD are answered at their own PSNs."""
    c = connect_req(t, mtu=1024, timeout=14)
    c.mem_write(0, pattern(2500))
    p = c.iut_psn
    mark = post(c, wr("SEND", 2500, wr_id=1, c=c), write_wr(c, 2500, 2),
                wr("SEND_WITH_IMM", 10, wr_id=3, c=c), wr("RDMA_WRITE_WITH_IMM", 10, wr_id=4, c=c))
    reqs = c.expect(8, 3.0, after=mark, match=is_req)
    if reqs:
        c.send(ack(c, reqs[-1].roce.psn, 4))
    c.poll(4, 0.5)
    want = [0x00, 0x01, 0x02, 0x06, 0x07, 0x08, 0x05, 0x0B]
    ops = [f.roce.op for f in reqs]
    compat = all(op in P.OPS and P.OPS[op].kind == "Req" for op in ops)
    t.check("MR-BTH-002", ops == want and compat, f"requester opcodes {[P.op_name(o) for o in ops]}",
            frames=reqs, expected="SEND FIRST/MIDDLE/LAST, WRITE FIRST/MIDDLE/LAST, SEND_ONLY_WITH_IMMEDIATE, "
                                  "RDMA_WRITE_ONLY_WITH_IMMEDIATE")
    psns = [f.roce.psn for f in reqs]
    want_psn = [P.psn_add(p, i) for i in range(8)]
    t.check("MR-BTH-018", psns == want_psn, f"request PSNs {[hex(x) for x in psns]}", frames=reqs,
            expected=f"PSNs {hex(p)} to {hex(want_psn[-1])}, one per packet")
    # the IUT as responder
    q = c.psn
    m2 = c.send(c.frame("RDMA_READ_REQUEST", psn=q, reth=(c.va, c.rkey, 2500)))
    rsps = c.expect(3, 2.0, after=m2, match=lambda f: 0x0D <= f.roce.op <= 0x10)
    c.psn = P.psn_add(q, 3)
    w = c.psn
    m3 = c.send(c.write(b"psn check", offset=4096))
    wack = expect_ack(c, w, m3)
    rsp_ops = [f.roce.op for f in rsps]
    t.check("MR-BTH-002", rsp_ops == [0x0D, 0x0E, 0x0F], f"READ response opcodes {[P.op_name(o) for o in rsp_ops]}",
            frames=rsps, expected="RDMA_READ_RESPONSE FIRST, MIDDLE, LAST")
    got = [f.roce.psn for f in rsps]
    t.check("MR-BTH-018", got == [q, P.psn_add(q, 1), P.psn_add(q, 2)] and wack is not None,
            f"READ request at {q:#08x}: responses at {[hex(x) for x in got]}; WRITE at {w:#08x}: "
            + (f"ACK at {wack.roce.psn:#08x}" if wack else "no ACK at its PSN"),
            frames=rsps + ([wack] if wack else []), expected=f"responses at {q:#08x}+0..2, ACK at {w:#08x}")
    if "ATOMICS" in t.claim.caps:
        a = c.psn
        m4 = c.send(c.frame("FETCH_ADD", psn=a, atomic=(c.va + 8192, c.rkey, 1, 0)))
        c.psn = P.psn_add(a, 1)
        aa = c.expect(1, 2.0, after=m4, match=lambda f: f.roce.op == ATOMIC_ACK)
        t.check("MR-BTH-018", bool(aa) and aa[0].roce.psn == a,
                f"FETCH_ADD at {a:#08x}: {describe(aa)}", frames=aa, expected=f"ATOMIC ACKNOWLEDGE psn={a:#08x}")


@case("TC-XH-010-a", rules=["MR-XH-010", "MR-XH-011", "MR-XH-012"], category="ATOM", caps=("ATOMICS",),
      timeout=10)
def atomic_eth_the_iut_builds(t):
    """COMPARE_SWAP and FETCH_ADD posted at the IUT: each request's UDP payload is BTH + 28-byte AtomicETH +
    ICRC, with the posted VA (a multiple of 8), R_Key, swap/add and compare values big-endian, and Compare Data 0
    in FETCH_ADD; an ATOMIC with a VA that is not a multiple of 8 is refused at post or completes in error,
    and no packet with that VA is sent; a FETCH_ADD from the LT with a non-zero Compare Data adds normally."""
    c = connect_req(t, timeout=14)
    p = c.iut_psn
    cmp_, swap, add = 0x0102030405060708, 0x1112131415161718, 0x0000000100000002
    mark = post(c, wr("ATOMIC_CMP_AND_SWP", 8, wr_id=1, c=c, offset=0, remote_off=64, compare=hex(cmp_),
                      swap_add=hex(swap)),
                wr("ATOMIC_FETCH_AND_ADD", 8, wr_id=2, c=c, offset=8, remote_off=72, swap_add=hex(add)))
    reqs = c.expect(2, 2.0, after=mark, match=is_req)
    c.send(c.frame("ATOMIC_ACKNOWLEDGE", psn=p, aeth=(0x1F, 1), atomic_ack=5),
           c.frame("ATOMIC_ACKNOWLEDGE", psn=P.psn_add(p, 1), aeth=(0x1F, 2), atomic_ack=6))
    c.poll(2, 0.5)
    probs = []
    if len(reqs) != 2 or [f.roce.op for f in reqs] != [0x13, 0x14]:
        probs.append(f"requests {describe(reqs)}")
    else:
        for f in reqs:
            n = _udp_payload_len(f)
            if n != 12 + 28 + 4:
                probs.append(f"{f.roce.name}: UDP payload {n} B, not 44")
            raw = f.roce.headers["AtomicETH"]
            if bytes(raw)[:8] != struct.pack("!Q", int(raw.va)):
                probs.append("VA not big-endian")
        e1, e2 = reqs[0].roce.headers["AtomicETH"], reqs[1].roce.headers["AtomicETH"]
        want1 = (REMOTE_VA + 64, REMOTE_RKEY, swap, cmp_)
        got1 = (int(e1.va), int(e1.rkey), int(e1.swap_add), int(e1.compare))
        if got1 != want1:
            probs.append(f"COMPARE_SWAP AtomicETH {[hex(x) for x in got1]}, posted {[hex(x) for x in want1]}")
        if (int(e2.va), int(e2.rkey), int(e2.swap_add)) != (REMOTE_VA + 72, REMOTE_RKEY, add):
            probs.append(f"FETCH_ADD AtomicETH va={int(e2.va):#x} rkey={int(e2.rkey):#x} add={int(e2.swap_add):#x}")
    t.check("MR-XH-010", not probs, "; ".join(probs) or "two requests of 44 B, AtomicETH fields as posted",
            frames=reqs, expected="UDP payload 44 B: BTH, AtomicETH (VA, R_Key, Swap/Add, Compare), ICRC")
    vas = [int(f.roce.headers["AtomicETH"].va) for f in reqs if "AtomicETH" in f.roce.headers]
    fa_cmp = [int(f.roce.headers["AtomicETH"].compare) for f in reqs if f.roce.op == 0x14]
    t.check("MR-XH-012", fa_cmp == [0], f"FETCH_ADD Compare Data {[hex(x) for x in fa_cmp]}", frames=reqs,
            expected="FETCH_ADD with Compare Data 0")
    # a misaligned VA: refused at post, or completed in error -- never sent
    mark2 = c.t.lt.last_num()
    err = agent_error(lambda: c.t.agent.call("post_send", qp=c.qp, wr=wr(
        "ATOMIC_FETCH_AND_ADD", 8, wr_id=3, c=c, offset=16, remote_off=84, swap_add="0x1")))
    sent = c.quiet(QUIET, after=mark2)
    bad = [f for f in sent if "AtomicETH" in f.roce.headers and int(f.roce.headers["AtomicETH"].va) % 8]
    wcs = [] if err else c.poll(1, 0.5)
    t.check("MR-XH-011", all(v % 8 == 0 for v in vas) and bool(vas) and not bad,
            f"VAs sent {[hex(v) for v in vas]}; VA {REMOTE_VA + 84:#x} posted: "
            + (f"refused ({err})" if err else f"completions {[w.get('status') for w in wcs]}")
            + f"; frames after it: {describe(sent)}", frames=bad or reqs,
            expected="every AtomicETH VA a multiple of 8; the misaligned one never on the wire")
    # the IUT as responder ignores Compare Data in FETCH_ADD
    c2 = t.connect()
    c2.mem_write(256, struct.pack("<Q", 1000))
    a = c2.psn
    m = c2.send(c2.frame("FETCH_ADD", psn=a, atomic=(c2.va + 256, c2.rkey, 7, 0xDEADBEEFCAFEF00D)))
    c2.psn = P.psn_add(a, 1)
    aa = c2.expect(1, 2.0, after=m, match=lambda f: f.roce.op == ATOMIC_ACK)
    val = struct.unpack("<Q", c2.mem(256, 8))[0]
    orig = int(aa[0].roce.headers["AtomicAckETH"].orig) if aa and "AtomicAckETH" in aa[0].roce.headers else None
    t.check("MR-XH-012", bool(aa) and orig == 1000 and val == 1007 and aa[0].roce.psn == a,
            f"FETCH_ADD +7 with Compare Data 0xdeadbeefcafef00d on 1000: {describe(aa)}, memory now {val}",
            frames=aa, expected=f"ATOMIC ACKNOWLEDGE psn={a:#08x} orig=1000, memory 1007")


@case("TC-XH-015-a", rules=["MR-XH-015"], category="WIRE", timeout=10)
def ieth_the_iut_builds(t):
    """A SEND WITH INVALIDATE posted at the IUT goes out as SEND_ONLY_WITH_INVALIDATE whose 4-byte IETH holds the
    posted R_Key big-endian (UDP payload BTH 12 + IETH 4 + payload + pad + ICRC 4)."""
    c = connect_req(t, timeout=14)
    c.mem_write(0, b"invalidate!")
    key = 0x12345678
    mark = post(c, wr("SEND_WITH_INV", 11, wr_id=1, c=c, invalidate_rkey=key))
    reqs = requests(c, mark, 1, 2.0)
    if reqs:
        c.send(ack(c, reqs[0].roce.psn, 1))
    c.poll(1, 0.5)
    probs = []
    f = reqs[0] if reqs else None
    if f is None or f.roce.op != 0x17:
        probs.append(f"request {describe(reqs)}")
    else:
        ieth = bytes(f.roce.headers["IETH"])
        n = _udp_payload_len(f)
        if ieth != struct.pack("!I", key):
            probs.append(f"IETH {ieth.hex()}")
        if n != 12 + 4 + 12 + 4 or f.roce.payload != b"invalidate!":
            probs.append(f"UDP payload {n} B, payload {f.roce.payload!r}")
    t.check("MR-XH-015", not probs, "; ".join(probs) or f"IETH 12345678 as posted, {describe(reqs)}",
            frames=reqs, expected=f"SEND_ONLY_WITH_INVALIDATE, IETH {key:08x}, UDP payload 32 B")


@case("TC-BTH-021-a", rules=["MR-BTH-021"], category="SEQ", timeout=15)
def outstanding_psns_within_window(t):
    """32 WRITEs of 4 KB at path MTU 256 (512 packets) that the LT never acknowledges: every PSN the IUT sends is
    within 2^23 - 1 of the oldest unacknowledged one (sq_psn); then one ACK completes them all."""
    c = connect_req(t, mtu=256, timeout=16)
    p = c.iut_psn
    c.mem_write(0, pattern(4096))
    mark = post(c, *[write_wr(c, 4096, i + 1, remote_off=4096 * i) for i in range(32)])
    reqs = c.expect(512, 6.0, after=mark, match=is_req)
    out = [f for f in reqs if (f.roce.psn - p) & 0xFFFFFF >= (1 << 23) - 1]
    last = P.psn_add(p, 511)
    c.send(ack(c, last, 32))
    wcs = c.poll(32, 2.0)
    t.check("MR-BTH-021", len(reqs) >= 512 and not out and len(wcs) == 32,
            f"{len(reqs)} request packets, PSNs beyond sq_psn + 2^23 - 2: {describe(out[:3])}; {len(wcs)} completions",
            frames=out[:3] or reqs[-1:], expected=f"512 PSNs from {p:#08x}, none 2^23 - 1 or more after it")


@case("TC-OPC-006-a", rules=["MR-OPC-006"], category="SEQ", timeout=10)
def requests_responses_and_cnps_are_routed(t):
    """A request goes to the responder (ACKed, placed); an ACKNOWLEDGE for a PSN the IUT never sent goes to the
    completer (no answer, rx_ghost_rsp + 1, the responder's ePSN unchanged); a CNP goes to the rate
    controller (no answer, rx_cnp + 1, the responder's ePSN unchanged)."""
    t.need_qp_counters("rx_ghost_rsp", "rx_cnp")
    c = t.connect()
    names = set(t.caps.get("counters", ()))
    k0 = c.counters()
    mark = c.send(c.write(b"routed", offset=0))
    a1 = expect_ack(c, P.psn_add(c.psn, -1), mark)
    placed = c.mem(0, 6) == b"routed"
    t.check("MR-OPC-006", a1 is not None and placed, f"WRITE: {describe([a1] if a1 else [])}, placed {placed}",
            frames=[a1] if a1 else [mark + 1], expected="ACK for the WRITE, data placed")
    m2 = c.send(ack(c, P.psn_add(c.iut_psn, 100), 1))
    quiet2 = c.quiet(QUIET, after=m2)
    k1 = c.counters()
    m3 = c.send(cnp(c))
    quiet3 = c.quiet(QUIET, after=m3)
    k2 = c.counters()
    m4 = c.send(c.write(b"after", offset=64))
    a4 = expect_ack(c, P.psn_add(c.psn, -1), m4)
    ghost = (k1.get("rx_ghost_rsp", 0) - k0.get("rx_ghost_rsp", 0)) if "rx_ghost_rsp" in names else None
    rxc = (k2.get("rx_cnp", 0) - k1.get("rx_cnp", 0)) if "rx_cnp" in names else None
    ok_rsp = not quiet2 and a4 is not None and ghost in (None, 1)
    t.check("MR-OPC-006", ok_rsp,
            f"ACKNOWLEDGE for an unsent PSN: answered by {describe(quiet2)}, rx_ghost_rsp "
            + ("not reported" if ghost is None else f"+{ghost}") + f"; next WRITE ACKed: {a4 is not None}",
            frames=quiet2 or ([a4] if a4 else [m2 + 1]), expected="no answer, rx_ghost_rsp +1, next WRITE ACKed")
    ok_cnp = not quiet3 and a4 is not None and rxc in (None, 1)
    t.check("MR-OPC-006", ok_cnp,
            f"CNP: answered by {describe(quiet3)}, rx_cnp " + ("not reported" if rxc is None else f"+{rxc}"),
            frames=quiet3 or ([a4] if a4 else [m3 + 1]), expected="no answer, rx_cnp +1")
