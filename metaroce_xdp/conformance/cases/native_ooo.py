"""Native responder: validation, out-of-order placement, RSN, completions, READ and atomics (04-native.md 4.4,
4.3.2, 4.3.6, 02-headers.md 3.7/3.9).  The LT is the requester; it sends packets of messages out of PSN order
and reads placement through mem_read, completions through poll_cq and the responder's answers on the wire."""
from __future__ import annotations

import struct

from .. import native_packets as N
from .. import packets as P
from ..registry import case
from ._common import ACK_WAIT
from ._native import (FILL, check_wcs, connect_native, counted, is_sack, ndropped, need, nv, pattern, summ)

RECV_OK = "IBV_WC_SUCCESS"


def _resps(c, after, n, timeout=ACK_WAIT):
    return c.expect(n, timeout, after=after, match=lambda f: f.roce.op == N.NATIVE_READ_RESP)


@case("TC-OOO-004-a", rules=["MR-OOO-004", "MR-OOO-002", "MR-SACK-003", "MR-SACK-014"], category="OOO",
      profile="native", timeout=30)
def write_placed_out_of_order(t):
    """A 4-packet NATIVE_WRITE sent last packet first: each packet placed on arrival, the message complete
    (AETH.MSN) only once all four arrived."""
    c = connect_native(t)
    e = c.psn
    data = pattern(4 * 1024, 11)
    fr = c.write_msg(data, 0)
    mark = c.send(fr[3], fr[2], fr[1])
    s = c.first_sack(mark, match=lambda f: P.psn_add(e, 3) in nv(f).received())
    need(s is not None, "no SACK reporting the last three packets")
    early = c.mem(1024, 3 * 1024) == data[1024:]
    hole = c.mem(0, 1024) == bytes([FILL]) * 1024
    t.check("MR-OOO-004", early and hole, f"packets 2-4 placed before packet 1 arrived: {early}; packet 1's bytes "
            f"untouched: {hole}", frames=[s], expected="bytes 1024..4095 placed, 0..1023 untouched")
    v = nv(s)
    t.check("MR-OOO-002", v.msn == 0, f"AETH.MSN {v.msn} while PSN {e:#08x} is missing", frames=[s],
            expected="MSN 0: the message is not complete")
    mark2 = c.send(fr[0])
    s2 = c.sack_for(P.psn_add(e, 3), mark2)
    ok = s2 is not None and nv(s2).psn == P.psn_add(e, 3) and nv(s2).msn == 1 and c.mem(0, 4096) == data
    t.check("MR-SACK-003", ok, f"after the first packet: {summ([s2]) if s2 else 'no SACK'}", frames=[s2] if s2 else [],
            expected=f"cum {P.psn_add(e, 3):#08x}, MSN 1, the whole message placed")
    t.check("MR-SACK-014", s2 is not None, "the gap-filling packet was SACKed", frames=[s2] if s2 else [mark2 + 1],
            expected="a SACK without waiting for coalescing (it fills a gap)")
    t.check("MR-OOO-002", ok, f"message complete after all four: MSN {nv(s2).msn if s2 else None}",
            frames=[s2] if s2 else [], expected="MSN 1")


@case("TC-OOO-007-a", rules=["MR-OOO-007", "MR-OOO-006", "MR-OOO-013", "MR-OOO-014", "MR-OOO-015", "MR-NAT-025"],
      category="OOO", profile="native", timeout=30)
def send_placed_by_rsn(t):
    """Two SENDs (RSN 0 of 2 packets, RSN 1 of 1): RSN 1 arrives first and is placed in the second receive WQE;
    receive completions come only when the cumulative PSN covers them, in receive WQE order."""
    c = connect_native(t)
    c.post_recv(4096, 0, wr_id=0xA1)
    c.post_recv(4096, 8192, wr_id=0xA2)
    m0, m1 = pattern(1500, 21), pattern(300, 22)
    f0 = c.send_msg(m0)                  # PSN e, e + 1; RSN 0
    f1 = c.send_msg(m1)                  # PSN e + 2; RSN 1
    mark = c.send(f1[0])
    c.first_sack(mark)
    placed1 = c.mem(8192, 300) == m1
    early = c.poll(1, 0.2)
    t.check("MR-OOO-007", placed1, f"RSN 1's packet placed in the second WQE before RSN 0 arrived: {placed1}",
            expected="300 bytes at offset 8192")
    t.check("MR-OOO-006", placed1 and c.mem(0, 16) == bytes([FILL]) * 16,
            "RSN 1 took the second receive WQE, the first stayed free", expected="RSN r -> the r-th receive WQE")
    mark2 = c.send(f0[1])
    c.first_sack(mark2)
    placed_mid = c.mem(1024, 476) == m0[1024:]
    early += c.poll(1, 0.2)
    t.check("MR-OOO-007", placed_mid, f"RSN 0's second packet placed at offset 1024 of the first WQE: {placed_mid}",
            expected="bytes 1024..1499 of message 0 at offset 1024")
    t.check("MR-OOO-014", not early, f"completions before PSN {c.psn - 3:#08x} arrived: {early or 'none'}",
            expected="no receive completion while the first PSN is missing", observed=[str(early)])
    mark3 = c.send(f0[0])
    c.first_sack(mark3)
    wcs = c.poll(2, 2.0)
    check_wcs(t, "MR-OOO-013", wcs, [(0xA1, RECV_OK), (0xA2, RECV_OK)], "receive completions")
    ok = (len(wcs) == 2 and [w.get("opcode") for w in wcs] == ["IBV_WC_RECV"] * 2
          and [w.get("byte_len") for w in wcs] == [1500, 300] and all(w.get("qp_num") == c.qpn for w in wcs)
          and c.mem(0, 1500) == m0)
    t.check("MR-OOO-015", ok, f"completions {wcs}", expected="IBV_WC_RECV, byte_len 1500 then 300, qp_num the QP's",
            observed=[str(wcs)])
    t.check("MR-NAT-025", ok and placed1, "messages placed by the RSN in their RSNETH",
            expected="RSN 0 -> first WQE, RSN 1 -> second")


@case("TC-OOO-010-a", rules=["MR-OOO-010", "MR-OOO-011", "MR-OOO-015"], category="OOO", profile="native",
      timeout=30)
def write_imm_consumes_a_wqe(t):
    """A NATIVE_WRITE_IMM consumes a receive WQE without placing into it and reports its ImmDt."""
    c = connect_native(t)
    c.post_recv(256, 8192, wr_id=0xB1)
    data = pattern(1500, 5)
    mark = c.send(*c.write_msg(data, 0, imm=0xCAFEBABE))
    c.sack_for(P.psn_add(c.psn, -1), mark)
    wcs = c.poll(1, 2.0)
    w = wcs[0] if wcs else {}
    t.check("MR-OOO-010", bool(wcs) and c.mem(0, 1500) == data and c.mem(8192, 256) == bytes([FILL]) * 256,
            f"data at the RETH address: {c.mem(0, 1500) == data}; receive buffer untouched: "
            f"{c.mem(8192, 256) == bytes([FILL]) * 256}; completion {w}", expected="placed at RETH, WQE consumed, "
            "its buffer untouched", observed=[str(w)])
    t.check("MR-OOO-011", w.get("imm") == 0xCAFEBABE, f"immediate {w.get('imm')}", expected="imm 0xcafebabe",
            observed=[str(w)])
    t.check("MR-OOO-015", w.get("opcode") == "IBV_WC_RECV_RDMA_WITH_IMM" and w.get("status") == RECV_OK
            and w.get("qp_num") == c.qpn, f"completion {w}", expected="IBV_WC_RECV_RDMA_WITH_IMM, success",
            observed=[str(w)])


@case("TC-SACK-035-a", rules=["MR-SACK-035", "MR-OOO-012", "MR-OOO-008"], category="RNR", profile="native",
      timeout=30)
def rnr_for_send(t):
    """No receive WQE: the SEND gets an RNR NAK-type SACK (PSN = its first PSN, the min_rnr_timer code), again on
    each copy; a WRITE after it is accepted; once a WQE is posted the SEND is accepted."""
    c = connect_native(t, min_rnr_timer=14)
    e = c.psn
    sendf = c.send_msg(b"S" * 100)
    wr = c.write_msg(b"W" * 16, 4096)
    mark = c.send(*sendf)
    s = c.first_sack(mark)
    need(s is not None, "no answer to the SEND without a receive WQE")
    v = nv(s)
    ok = v.sack_kind == "RNR" and v.syndrome == 0x20 | 14 and v.psn == e and int(v.sack.bitmap_words) == 0
    t.check("MR-SACK-035", ok, f"first SEND: {v.summary()}", frames=[s],
            expected=f"RNR NAK-type SACK syndrome 0x2e, PSN {e:#08x}, no bitmap")
    mark2 = c.send(*wr)
    s2 = c.first_sack(mark2)
    v2 = nv(s2) if s2 else None
    ok2 = (v2 is not None and v2.sack_kind == "ACK" and P.psn_add(e, 1) in v2.received() and v2.psn == P.psn_add(e, -1)
           and c.mem(4096, 16) == b"W" * 16)
    t.check("MR-SACK-035", ok2, f"WRITE after the not-ready SEND: {summ([s2]) if s2 else 'nothing'}",
            frames=[s2] if s2 else [], expected=f"ACK-type, cum {P.psn_add(e, -1):#08x}, {P.psn_add(e, 1):#08x} sacked")
    t.check("MR-OOO-012", ok2 and c.mem(0, 100) == bytes([FILL]) * 100,
            "the SEND was neither recorded nor placed", frames=[s2] if s2 else [],
            expected=f"PSN {e:#08x} not reported, nothing placed")
    mark3 = c.send(*sendf)
    s3 = c.first_sack(mark3)
    t.check("MR-SACK-035", s3 is not None and nv(s3).sack_kind == "RNR" and nv(s3).psn == e,
            f"copy of the SEND, still no WQE: {summ([s3]) if s3 else 'nothing'}", frames=[s3] if s3 else [],
            expected="the RNR NAK again")
    c.post_recv(256, 0, wr_id=0xC1)
    mark4 = c.send(*sendf)
    s4 = c.sack_for(P.psn_add(e, 1), mark4)
    wcs = c.poll(1, 2.0)
    ok4 = s4 is not None and nv(s4).psn == P.psn_add(e, 1) and c.mem(0, 100) == b"S" * 100 and \
        [w["status"] for w in wcs] == [RECV_OK]
    t.check("MR-OOO-008", ok4, f"with a WQE posted: {summ([s4]) if s4 else 'nothing'}, completions {wcs}",
            frames=[s4] if s4 else [], expected=f"cum {P.psn_add(e, 1):#08x}, placed, completed")
    t.check("MR-OOO-012", ok4, "the message became ready once a WQE was posted", frames=[s4] if s4 else [])


@case("TC-OOO-016-a", rules=["MR-OOO-016", "MR-OOO-003", "MR-OOO-017", "MR-NAT-013", "MR-XH-023", "MR-XH-017",
                             "MR-XH-018", "MR-XH-019"],
      category="OOO", profile="native", timeout=30)
def read_executed_in_order(t):
    """A NATIVE_READ_REQ overtaking a WRITE is recorded (its PSNs SACKed) but executed only once the WRITE
    arrived; its three NATIVE_READ_RESPs carry the READ's MSN, offsets, F/L flags and no AETH."""
    c = connect_native(t)
    src = pattern(2500, 33)
    c.mem_write(8192, src)
    e = c.psn
    wf = c.write_msg(b"w" * 64, 0)
    read_msn = c.msn
    rf = c.read_req(8192, 2500)                  # PSNs e+1 .. e+3
    mark = c.send(rf)
    early = c.quiet(0.3, after=mark)
    resp_early = [f for f in early if f.roce.op == N.NATIVE_READ_RESP]
    sk = [f for f in early if is_sack(f)]
    t.check("MR-OOO-016", not resp_early, f"before the WRITE at {e:#08x}: {summ(resp_early) or 'no READ response'}",
            frames=resp_early or early[:1], expected="no NATIVE_READ_RESP while an earlier PSN is missing")
    rec = set().union(*(nv(f).received() for f in sk)) if sk else set()
    want = {P.psn_add(e, i) for i in (1, 2, 3)}
    t.check("MR-OOO-003", want <= rec, f"PSNs of the READ reported received: {sorted(rec)}", frames=sk,
            expected=f"{sorted(want)} in a SACK bitmap")
    mark2 = c.send(*wf)
    rs = _resps(c, mark2, 3)
    need(len(rs) == 3, f"{len(rs)} READ responses once the WRITE arrived: {summ(rs)}")
    vs = [nv(f) for f in rs]
    ok = ([v.psn for v in vs] == [P.psn_add(e, i) for i in (1, 2, 3)]
          and [int(v.neth.offset) for v in vs] == [0, 1024, 2048]
          and all(int(v.neth.msg_len) == 2500 and int(v.neth.msn) == read_msn and v.aeth is None for v in vs)
          and [(int(v.neth.first), int(v.neth.last)) for v in vs] == [(1, 0), (0, 0), (0, 1)]
          and b"".join(v.payload for v in vs) == src and all(not v.neth.retx and v.neth.resv5 == 0 for v in vs))
    exp = (f"PSNs {e + 1:#x}..{e + 3:#x}, MSN {read_msn}, offsets 0/1024/2048, msg_len 2500, F on the first, L on the "
           "last, no AETH, the MR's bytes")
    t.check("MR-OOO-016", True, "READ executed after the WRITE arrived", frames=rs[:1])
    t.check("MR-OOO-017", ok, summ(rs), frames=rs, expected=exp)
    t.check("MR-NAT-013", all(int(v.neth.msn) == read_msn for v in vs) and [int(v.neth.offset) for v in vs] ==
            [0, 1024, 2048], summ(rs), frames=rs, expected=f"MSN {read_msn}, offsets 0, 1024, 2048")
    t.check("MR-XH-023", all(int(v.neth.msg_len) == 2500 for v in vs), summ(rs), frames=rs,
            expected="Message Length 2500 (the read length)")
    t.check("MR-XH-017", all(v.neth is not None and not v.malformed and v.hdr_len == 16 for v in vs), summ(rs),
            frames=rs, expected="a 16-byte NETH right after the BTH")
    t.check("MR-XH-018", [(int(v.neth.first), int(v.neth.last), int(v.neth.retx), int(v.neth.resv5)) for v in vs]
            == [(1, 0, 0, 0), (0, 0, 0, 0), (0, 1, 0, 0)], summ(rs), frames=rs,
            expected="F only at offset 0, L only on the last, R 0, Rsvd 0")
    t.check("MR-XH-019", all(int(v.neth.msn) == read_msn for v in vs), summ(rs), frames=rs,
            expected=f"the READ_REQ's MSN {read_msn}")


@case("TC-OOO-022-a", rules=["MR-OOO-022", "MR-NAT-015", "MR-LOSS-012"], category="OOO", profile="native",
      timeout=30)
def read_rerequest_answered(t):
    """READ re-requests for the middle and the last response: answered with RETX set, offsets relative to the
    original READ, F/L as in the original stream; no response is resent unasked."""
    c = connect_native(t)
    src = pattern(3000, 44)
    c.mem_write(4096, src)
    e = c.psn
    m = c.msn
    mark = c.send(c.read_req(4096, 3000))
    rs = _resps(c, mark, 3)
    need(len(rs) == 3, f"READ answered with {len(rs)} responses")
    quiet = [f for f in c.quiet(0.3, after=rs[-1].num) if f.roce.op == N.NATIVE_READ_RESP]
    t.check("MR-LOSS-012", not quiet, f"responses resent unasked: {summ(quiet)}", frames=quiet,
            expected="no NATIVE_READ_RESP without a re-request")
    for q, off, n, fl in ((1, 1024, 1024, (0, 0)), (2, 2048, 952, (0, 1))):
        psn = P.psn_add(e, q)
        nh = N.neth(m, off, 3000, c.tsval(), first=True, last=True, retx=True)
        f = c.nframe(N.NATIVE_READ_REQ, psn=psn, ackreq=True, reth=(c.va + 4096 + off, c.rkey, n), neth_=nh)
        mk = c.send(f)
        got = _resps(c, mk, 1)
        v = nv(got[0]) if got else None
        ok = (v is not None and v.psn == psn and int(v.neth.offset) == off and int(v.neth.msg_len) == 3000
              and (int(v.neth.first), int(v.neth.last)) == fl and v.neth.retx and v.payload == src[off:off + n]
              and int(v.neth.msn) == m)
        exp = (f"NATIVE_READ_RESP psn={psn:#08x} offset {off} msg_len 3000 F={fl[0]} L={fl[1]} R=1, "
               f"{n} bytes of the original range")
        t.check("MR-OOO-022", ok, f"re-request at {psn:#08x}: {summ(got)}", frames=got or [mk + 1], expected=exp)
        t.check("MR-NAT-015", v is not None and bool(v.neth.retx), f"RETX of the answer: {summ(got)}",
                frames=got or [mk + 1], expected="flags.RETX 1")


@case("TC-OOO-023-a", rules=["MR-OOO-023", "MR-NAT-006", "MR-SACK-006", "MR-XH-038", "MR-XH-030"],
      category="ATOM", caps=("ATOMICS",), profile="native", timeout=30)
def atomic_held_until_in_order(t):
    """A FETCH_ADD overtaking a WRITE: SACKed at once with N set and TSecr 0, executed only once the WRITE arrived,
    answered by an ATOMIC_ACKNOWLEDGE (its PSN, 0x1f, MSN 2, the original value)."""
    c = connect_native(t)
    c.mem_write(64, struct.pack("<Q", 100))
    e = c.psn
    wf = c.write_msg(b"w" * 32, 0)
    af = c.atomic("FETCH_ADD", 64, 5)
    mark = c.send(af)
    s = c.first_sack(mark)
    acks_early = [f for f in c.quiet(0.2, after=mark) if f.roce.op == N.ATOMIC_ACKNOWLEDGE]
    need(s is not None, "no SACK for the atomic that opened a gap")
    v = nv(s)
    t.check("MR-SACK-006", v.sack.n == 1 and v.sack.tsecr == 0, f"SACK triggered by the atomic: {v.summary()}",
            frames=[s], expected="flags.N 1, tsecr 0")
    t.check("MR-XH-038", v.sack.n == 1 and v.sack.tsecr == 0, v.summary(), frames=[s], expected="N 1, TSecr 0")
    t.check("MR-XH-030", v.sack.tsecr == 0, v.summary(), frames=[s], expected="TSecr 0")
    held = struct.unpack("<Q", c.mem(64, 8))[0] == 100 and not acks_early
    mark2 = c.send(*wf)
    got = c.expect(1, ACK_WAIT, after=mark2, match=lambda f: f.roce.op == N.ATOMIC_ACKNOWLEDGE)
    a = nv(got[0]) if got else None
    val = struct.unpack("<Q", c.mem(64, 8))[0]
    ok = (a is not None and a.psn == P.psn_add(e, 1) and a.syndrome == 0x1F and a.msn == 2 and a.atomic_ack == 100
          and val == 105)
    t.check("MR-OOO-023", held and ok, f"before the WRITE: value unchanged and no ATOMIC_ACKNOWLEDGE: {held}; after: "
            f"{summ(got)}, value {val}", frames=acks_early + got, expected=f"ATOMIC_ACKNOWLEDGE psn "
            f"{P.psn_add(e, 1):#08x} only after the WRITE, value 105")
    t.check("MR-NAT-006", ok, summ(got), frames=got, expected=f"ATOMIC_ACKNOWLEDGE psn={P.psn_add(e, 1):#08x} "
            "syndrome 0x1f msn=2 orig=100")


@case("TC-OOO-024-a", rules=["MR-OOO-024", "MR-SACK-013"], category="ATOM", caps=("ATOMICS",), profile="native",
      timeout=30)
def atomic_replay_exactly_once(t):
    """A copy of an executed FETCH_ADD (its ATOMIC_ACKNOWLEDGE "lost") gets the same ATOMIC_ACKNOWLEDGE and
    does not add twice; a copy with another AtomicETH is discarded with an ACK-type SACK."""
    c = connect_native(t)
    c.mem_write(128, struct.pack("<Q", 1000))
    e = c.psn
    af = c.atomic("FETCH_ADD", 128, 7)
    mark = c.send(af)
    got = c.expect(1, ACK_WAIT, after=mark, match=lambda f: f.roce.op == N.ATOMIC_ACKNOWLEDGE)
    need(got, "no ATOMIC_ACKNOWLEDGE for the FETCH_ADD")
    first = nv(got[0])
    mark2 = c.send(af)
    again = c.quiet(0.4, after=mark2)
    aa = [f for f in again if f.roce.op == N.ATOMIC_ACKNOWLEDGE]
    val = struct.unpack("<Q", c.mem(128, 8))[0]
    ok = (len(aa) == 1 and nv(aa[0]).psn == e and nv(aa[0]).atomic_ack == 1000 and nv(aa[0]).msn == first.msn
          and val == 1007)
    t.check("MR-OOO-024", ok, f"the copy: {summ(again)}; value {val}", frames=aa or [mark2 + 1],
            expected=f"the same ATOMIC_ACKNOWLEDGE (psn {e:#08x}, orig 1000, msn {first.msn}), value 1007")
    other = c.atomic("FETCH_ADD", 128, 9, psn=e)
    mark3 = c.send(other)
    res = c.quiet(0.4, after=mark3)
    sk = [f for f in res if is_sack(f)]
    bad = [f for f in res if f.roce.op == N.ATOMIC_ACKNOWLEDGE]
    val2 = struct.unpack("<Q", c.mem(128, 8))[0]
    ok2 = not bad and sk and nv(sk[0]).sack_kind == "ACK" and nv(sk[0]).psn == e and val2 == 1007
    t.check("MR-OOO-024", ok2, f"a copy with another AtomicETH: {summ(res)}; value {val2}", frames=res or [mark3 + 1],
            expected=f"an ACK-type SACK cum {e:#08x}, no ATOMIC_ACKNOWLEDGE, value 1007")
    t.check("MR-SACK-013", ok and ok2, "duplicates not executed again, answered at once", frames=aa + sk)


@case("TC-SACK-013-a", rules=["MR-SACK-013", "MR-OOO-005", "MR-SACK-012"], category="DUP", profile="native",
      timeout=30)
def duplicate_write_not_placed(t):
    """A copy of a received WRITE (other bytes, RETX) is SACKed at once and not placed again."""
    c = connect_native(t)
    e = c.psn
    before = c.native_counters()
    mark = c.send(*c.write_msg(b"A" * 64, 0))
    need(c.sack_for(e, mark) is not None, "the WRITE was not SACKed")
    dup = c.write_msg(b"B" * 64, 0, psn=e, msn=0, ackreq_last=False, retx=True, advance=False)
    mark2 = c.send(*dup)
    s = c.first_sack(mark2)
    grew, text = counted(t, c, "rx_duplicates", before)
    ok = s is not None and nv(s).psn == e
    t.check("MR-SACK-013", ok and grew, f"duplicate (AckReq clear): {summ([s]) if s else 'no SACK'}; {text}",
            frames=[s] if s else [mark2 + 1], expected=f"a NATIVE_SACK cum {e:#08x} at once, counted")
    t.check("MR-OOO-005", c.mem(0, 64) == b"A" * 64, "the duplicate's bytes were not placed",
            expected="64 x 'A' still at offset 0", observed=[c.mem(0, 8).hex()])
    t.check("MR-SACK-012", ok, "the duplicate's SACK still reports the PSN received", frames=[s] if s else [])


@case("TC-SACK-031-a", rules=["MR-SACK-031", "MR-SACK-032", "MR-SACK-033", "MR-OOO-001"], category="SACK",
      profile="native", timeout=30)
def nak_only_at_the_epsn(t):
    """A WRITE with a bad R_Key at ePSN + 1 arriving first: no NAK (and no record of it) until the ePSN arrives;
    then one NAK-type SACK, remote access error, BTH.PSN the bad PSN, no bitmap."""
    c = connect_native(t)
    e = c.psn
    good = c.write_msg(b"g" * 16, 0)
    bad = c.write_msg(b"b" * 16, 512, rkey=c.rkey ^ 0x5A5A00)
    mark = c.send(*bad)
    early = c.quiet(0.3, after=mark)
    naks = [f for f in early if is_sack(f) and nv(f).sack_kind == "NAK"]
    rec = [f for f in early if is_sack(f) and P.psn_add(e, 1) in nv(f).received()]
    t.check("MR-SACK-031", not naks and not rec, f"before the ePSN arrived: {summ(early)}", frames=naks + rec,
            expected=f"no NAK and no report of {P.psn_add(e, 1):#08x} while {e:#08x} is missing")
    mark2 = c.send(*good)
    res = c.quiet(0.4, after=mark2)
    nk = [f for f in res if is_sack(f) and nv(f).sack_kind == "NAK"]
    v = nv(nk[0]) if nk else None
    ok = (len(nk) == 1 and v.syndrome == 0x62 and v.psn == P.psn_add(e, 1) and int(v.sack.bitmap_words) == 0
          and v.sack.credit == 0xFFFF)
    t.check("MR-SACK-031", ok, f"after the ePSN: {summ(res)}", frames=nk or res or [mark2 + 1],
            expected=f"one NAK-type SACK 0x62 psn {P.psn_add(e, 1):#08x}")
    t.check("MR-SACK-032", ok, summ(nk), frames=nk, expected="BTH.PSN the NAK'd PSN, bitmap_words 0, credit 0xffff")
    t.check("MR-OOO-001", ok and c.mem(512, 16) == bytes([FILL]) * 16, "check 6 failed: remote access error, "
            "nothing placed", frames=nk, expected="NAK 0x62, memory untouched")
    seq = [f for f in c.quiet(0.0) if is_sack(f) and nv(f).syndrome in (0x60, 0x64)]
    t.check("MR-SACK-033", not seq, f"PSN sequence error NAKs: {summ(seq) or 'none'}", frames=seq,
            expected="no syndrome 0x60 on a native QP")


@case("TC-XH-021-a", rules=["MR-XH-021", "MR-XH-018"], category="WIRE", profile="native", timeout=30)
def neth_contradictions_dropped(t):
    """NETH flags or lengths that contradict the packet are dropped silently and counted in rx_drop_len."""
    c = connect_native(t)
    cases = []
    m = c.msn
    # F set at offset 1024 (second packet of a 2-packet message)
    nh = N.neth(m, 1024, 2048, c.tsval(), first=True, last=True)
    cases.append(("F set at offset 1024", c.nframe(N.NATIVE_WRITE, psn=c.psn, ackreq=True, payload=b"x" * 1024,
                                                 reth=(c.va, c.rkey, 2048), neth_=nh)))
    # L clear on a single-packet message
    nh = N.neth(m, 0, 16, c.tsval(), first=True, last=False)
    cases.append(("L clear on the only packet", c.nframe(N.NATIVE_WRITE, psn=c.psn, ackreq=True, payload=b"y" * 16,
                                                       reth=(c.va, c.rkey, 16), neth_=nh)))
    # offset + payload above Message Length
    nh = N.neth(m, 0, 8, c.tsval(), first=True, last=True)
    cases.append(("offset + payload 16 above Message Length 8",
                  c.nframe(N.NATIVE_WRITE, psn=c.psn, ackreq=True, payload=b"z" * 16, reth=(c.va, c.rkey, 8),
                           neth_=nh)))
    oks = [ndropped(t, c, [f], ["MR-XH-021"], what, offset=0, length=16, counter_name="rx_drop_len")
           for what, f in cases]
    t.check("MR-XH-018", all(oks[:2]), "the receiver judged F and L against Offset, payload and Message Length: "
            f"F set at offset 1024 dropped {oks[0]}, L clear on the only packet dropped {oks[1]}",
            expected="both dropped (and counted), the valid WRITE after each SACKed")


@case("TC-NAT-009-a", rules=["MR-NAT-009", "MR-XH-039"], category="WIRE", profile="native", timeout=30)
def native_too_short_dropped(t):
    """Native packets shorter than their fixed headers (SEND without its RSNETH, WRITE cut in the NETH) are
    dropped and counted in rx_drop_len."""
    c = connect_native(t)
    c.post_recv(256, 4096, wr_id=1)
    nh = N.neth(c.msn, 0, 0, c.tsval(), first=True, last=True)
    short_send = c.nframe(N.NATIVE_SEND, psn=c.psn, ackreq=True, headers=bytes(nh)[:16] + b"\0\0")
    short_write = c.nframe(N.NATIVE_WRITE, psn=c.psn, ackreq=True,
                           headers=N.headers_of(N.NATIVE_WRITE, reth=(c.va, c.rkey, 0), neth_=nh)[:24])
    ndropped(t, c, [short_send], ["MR-NAT-009", "MR-XH-039"], "NATIVE_SEND with 2 of the RSNETH's 4 bytes",
             counter_name="rx_drop_len")
    ndropped(t, c, [short_write], ["MR-NAT-009"], "NATIVE_WRITE cut after 8 bytes of its NETH",
             counter_name="rx_drop_len")


@case("TC-NAT-007-a", rules=["MR-NAT-007", "MR-OPC-004"], category="SEQ", profile="native", timeout=30)
def compat_opcodes_dropped_on_native(t):
    """On a native QP a compat RDMA_WRITE_ONLY, a CNP and reserved opcode 0xC7 are discarded without a response
    and counted in rx_drop_opcode."""
    c = connect_native(t)
    w = P.build("RDMA_WRITE_ONLY", **c.addr(), psn=c.psn, ackreq=True, reth=(c.va, c.rkey, 16), payload=b"c" * 16)
    cnp = P.build("CNP", **c.addr(tos=0xC2), psn=0, becn=True)
    resv = N.build(0xC7, **c.addr(), psn=c.psn, ackreq=True, headers=bytes(16), payload=b"r" * 16)
    ndropped(t, c, [w], ["MR-NAT-007"], "compat RDMA_WRITE_ONLY", length=16, counter_name="rx_drop_opcode")
    ndropped(t, c, [cnp], ["MR-NAT-007", "MR-OPC-004"], "CNP on a native QP", counter_name="rx_drop_opcode")
    ndropped(t, c, [resv], ["MR-NAT-007"], "reserved opcode 0xC7", length=16, counter_name="rx_drop_opcode")


@case("TC-NAT-011-a", rules=["MR-NAT-011", "MR-NAT-015", "MR-XH-037"], category="WIRE", profile="native",
      timeout=30)
def reserved_bits_and_retx_ignored(t):
    """NETH bits 4-0, the RSNETH's reserved byte and flags.RETX on a first arrival change nothing: the WRITE and the
    SEND are placed and SACKed as usual."""
    c = connect_native(t)
    c.post_recv(256, 4096, wr_id=0xD1)
    e = c.psn
    nh = N.neth(c.msn, 0, 32, c.tsval(), first=True, last=True, retx=True, resv5=0x1F)
    w = c.nframe(N.NATIVE_WRITE, psn=e, ackreq=True, payload=b"R" * 32, reth=(c.va, c.rkey, 32), neth_=nh)
    nh2 = N.neth(c.msn + 1, 0, 20, c.tsval(), first=True, last=True, resv5=0x15)
    hdr = bytes(nh2) + b"\xff" + (0).to_bytes(3, "big")                  # RSNETH Rsvd 0xff, RSN 0
    s = c.nframe(N.NATIVE_SEND, psn=P.psn_add(e, 1), ackreq=True, payload=b"Q" * 20, headers=hdr)
    c.psn, c.msn = P.psn_add(e, 2), c.msn + 2
    mark = c.send(w)
    s1 = c.sack_for(e, mark)
    ok1 = s1 is not None and c.mem(0, 32) == b"R" * 32
    t.check("MR-NAT-011", ok1, f"WRITE with NETH bits 4-0 = 0x1f: {summ([s1]) if s1 else 'no SACK'}",
            frames=[s1] if s1 else [mark + 1], expected="placed and SACKed")
    t.check("MR-NAT-015", ok1, "a first transmission with flags.RETX 1 processed as any other",
            frames=[s1] if s1 else [mark + 1], expected="placed and SACKed")
    mark2 = c.send(s)
    s2 = c.sack_for(P.psn_add(e, 1), mark2)
    wcs = c.poll(1, 2.0)
    ok2 = s2 is not None and c.mem(4096, 20) == b"Q" * 20 and [w_["status"] for w_ in wcs] == [RECV_OK]
    t.check("MR-XH-037", ok2, f"SEND with RSNETH Rsvd 0xff: {summ([s2]) if s2 else 'no SACK'}, completions {wcs}",
            frames=[s2] if s2 else [mark2 + 1], expected="placed, SACKed, received")
