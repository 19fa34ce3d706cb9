"""Native profile: the responder's validation table (04-native.md 4.4.1) check by check, duplicate READs,
multipath reception, and the requester's completion order, error NAKs, READ timeouts and RNR budget."""
from __future__ import annotations

from .. import native_packets as N
from .. import packets as P
from ..registry import case
from ._common import ACK_WAIT
from ._native import (CAP, FILL, WC_FLUSH, WC_OK, check_wcs, connect_native, is_sack, need, nv, op,
                      pattern, post, sent_at, summ, wait_requests, wc_list, wr)
from .native_req import _first_tx, _sack_for


def _nak_after(t, c, frames, psn, syndrome, rules, what, settle=0.4):
    """Send frames; decide rules on the first NAK-type SACK being `syndrome` at `psn` with no bitmap."""
    mark = c.send(*frames)
    res = c.quiet(settle, after=mark)
    nk = [f for f in res if is_sack(f) and nv(f).sack_kind in ("NAK", "RNR")]
    v = nv(nk[0]) if nk else None
    ok = v is not None and v.syndrome == syndrome and v.psn == psn and int(v.sack.bitmap_words) == 0
    for r in ([rules] if isinstance(rules, str) else rules):
        t.check(r, ok, f"{what}: {summ(nk[:1]) if nk else 'no NAK; ' + summ(res[:3])}", frames=nk[:1] or res[:3] or
                [mark + 1], expected=f"NAK-type SACK syndrome {syndrome:#04x} psn {psn:#08x}, no bitmap")
    return ok


@case("TC-OOO-001-b", rules=["MR-OOO-001", "MR-SACK-031", "MR-OOO-005"], category="MEM", profile="native",
      timeout=30)
def write_outside_mr_is_access_error(t):
    """Check 6: a NATIVE_WRITE whose range ends past the MR is a remote access error (0x62) and places nothing."""
    c = connect_native(t, mr_len=4096)
    e = c.psn
    f = c.write_msg(b"X" * 64, 4096 - 32)
    _nak_after(t, c, f, e, 0x62, ["MR-OOO-001", "MR-SACK-031"], "WRITE of 64 bytes at offset 4064 of a 4096-byte MR")
    t.check("MR-OOO-005", c.mem(4096 - 32, 32) == bytes([FILL]) * 32, "nothing placed",
            expected="the MR's last 32 bytes untouched")


@case("TC-OOO-001-c", rules=["MR-OOO-001", "MR-SACK-032"], category="MEM", profile="native", timeout=30)
def read_bad_rkey_is_access_error(t):
    """Check 7: a NATIVE_READ_REQ with an unknown R_Key is a remote access error (0x62), no response data; the
    NAK-type SACK echoes the READ's TSval and source port as an ACK-type SACK would (MR-SACK-032)."""
    c = connect_native(t)
    e = c.psn
    f = c.read_req(0, 100, rkey=c.rkey ^ 0x00A5A500)
    ts = N.parse(f).neth.tsval                      # the TSval the LT stamped on the READ
    ok = _nak_after(t, c, [f], e, 0x62, ["MR-OOO-001"], "READ with a bad R_Key")
    nk = [x for x in c.quiet(0.0) if is_sack(x) and nv(x).sack_kind == "NAK"]
    k = nv(nk[0]).sack if nk else None
    t.check("MR-SACK-032", ok and k is not None and int(k.tsecr) == int(ts) and int(k.echo_sport) == c.sport
            and not k.n, f"the NAK-type SACK: {summ(nk[:1]) or 'none'}", frames=nk[:1],
            expected=f"syndrome 0x62 psn {e:#08x}, no bitmap, tsecr {int(ts):#x} (the READ's TSval), echo_sport "
                     f"{c.sport:#06x}, N 0")
    resp = [x for x in c.quiet(0.0) if not x.outgoing and op(x) == N.NATIVE_READ_RESP]
    t.check("MR-OOO-001", not resp, f"READ responses: {summ(resp) or 'none'}", frames=resp,
            expected="no NATIVE_READ_RESP")


@case("TC-OOO-001-d", rules=["MR-OOO-001", "MR-SACK-031"], category="OOO", profile="native", timeout=30)
def neth_offset_not_pmtu_multiple_is_invalid(t):
    """Check 4: a WRITE packet whose NETH offset is not a multiple of the path MTU (or whose payload is not
    min(pmtu, msg_len - offset)) is an invalid request (0x61)."""
    c = connect_native(t)
    e = c.psn
    nh = N.neth(c.msn, 512, 2048, c.tsval(), first=False, last=False)
    f = c.nframe(N.NATIVE_WRITE, psn=e, ackreq=True, payload=b"m" * 1024, reth=(c.va, c.rkey, 2048), neth_=nh)
    _nak_after(t, c, [f], e, 0x61, ["MR-OOO-001", "MR-SACK-031"], "offset 512 with path MTU 1024")


@case("TC-OOO-001-e", rules=["MR-OOO-001", "MR-SACK-031"], category="OOO", profile="native", timeout=30)
def neth_short_middle_payload_is_invalid(t):
    """Check 4: the first packet of a 3000-byte WRITE carrying 512 bytes (not min(pmtu, msg_len - offset) = 1024)
    is an invalid request (0x61)."""
    c = connect_native(t)
    e = c.psn
    nh = N.neth(c.msn, 0, 3000, c.tsval(), first=True, last=False)
    f = c.nframe(N.NATIVE_WRITE, psn=e, ackreq=True, payload=b"s" * 512, reth=(c.va, c.rkey, 3000), neth_=nh)
    _nak_after(t, c, [f], e, 0x61, ["MR-OOO-001", "MR-SACK-031"], "a first packet of 512 bytes of 3000")


@case("TC-OOO-001-f", rules=["MR-OOO-001", "MR-SACK-031"], category="ATOM", caps=("ATOMICS",), profile="native",
      timeout=30)
def atomic_misaligned_is_invalid(t):
    """Check 7 (as compat Table 3-4): a FETCH_ADD at an address not 8-byte aligned is an invalid request (0x61)
    and changes no memory."""
    c = connect_native(t)
    e = c.psn
    f = c.atomic("FETCH_ADD", 68, 1)
    _nak_after(t, c, [f], e, 0x61, ["MR-OOO-001", "MR-SACK-031"], "FETCH_ADD at offset 68")
    t.check("MR-OOO-001", c.mem(64, 16) == bytes([FILL]) * 16, "memory untouched", expected="no change")


@case("TC-OOO-001-g", rules=["MR-OOO-001", "MR-SACK-031", "MR-SACK-032"], category="OOO", profile="native",
      timeout=30)
def send_too_long_for_wqe(t):
    """Check 9: a SEND longer than its receive WQE's scatter list is a remote operational error (0x63) and the WQE
    completes IBV_WC_LOC_LEN_ERR; the NAK-type SACK echoes the SEND's TSval and source port."""
    c = connect_native(t)
    c.post_recv(64, 0, wr_id=0x51)
    e = c.psn
    f = c.send_msg(b"L" * 200, tsval=0x0BADF00D)
    _nak_after(t, c, f, e, 0x63, ["MR-OOO-001", "MR-SACK-031"], "a 200-byte SEND into a 64-byte receive WQE")
    nk = [x for x in c.quiet(0.0) if is_sack(x) and nv(x).sack_kind == "NAK"]
    k = nv(nk[0]).sack if nk else None
    t.check("MR-SACK-032", k is not None and int(k.tsecr) == 0x0BADF00D and int(k.echo_sport) == c.sport
            and not k.n, f"the NAK-type SACK: {summ(nk[:1]) or 'none'}", frames=nk[:1],
            expected=f"tsecr 0xbadf00d, echo_sport {c.sport:#06x}, N 0 (filled as for an ACK-type SACK)")
    wcs = c.poll(1, 1.0)
    t.check("MR-OOO-001", [w["status"] for w in wcs] == ["IBV_WC_LOC_LEN_ERR"], f"receive completion {wc_list(wcs)}",
            expected="0x51:LOC_LEN_ERR", observed=[wc_list(wcs)])


@case("TC-OOO-022-b", rules=["MR-OOO-022", "MR-SACK-013"], category="DUP", profile="native", timeout=30)
def duplicate_read_answered_again(t):
    """A copy of an executed NATIVE_READ_REQ (same PSN, RETX) is answered with the responses again (RETX set);
    a copy whose VA does not fit the original READ is discarded, counted and answered with an ACK-type SACK."""
    c = connect_native(t)
    src = pattern(2000, 6)
    c.mem_write(1024, src)
    e = c.psn
    m = c.msn
    rq = c.read_req(1024, 2000)
    mark = c.send(rq)
    rs = c.expect(2, ACK_WAIT, after=mark, match=lambda f: op(f) == N.NATIVE_READ_RESP)
    need(len(rs) == 2, f"the READ was answered with {summ(rs)}")
    again = c.read_req(1024, 2000, psn=e, msn=m, retx=True)
    mark2 = c.send(again)
    rs2 = c.expect(2, ACK_WAIT, after=mark2, match=lambda f: op(f) == N.NATIVE_READ_RESP)
    vs = [nv(f) for f in rs2]
    ok = (len(vs) == 2 and [v.psn for v in vs] == [e, P.psn_add(e, 1)] and all(v.neth.retx for v in vs)
          and b"".join(v.payload for v in vs) == src and (vs[0].neth.first, vs[1].neth.last) == (1, 1))
    t.check("MR-OOO-022", ok, f"the copy: {summ(rs2)}", frames=rs2 or [mark2 + 1],
            expected="both responses again, RETX set, F on the first, L on the last")
    t.check("MR-SACK-013", ok, "a duplicate READ is executed again (the re-request exception)", frames=rs2)
    before = c.native_counters()
    bad = c.read_req(0, 2000, psn=e, msn=m, retx=True)             # VA 1024 bytes before the original
    mark3 = c.send(bad)
    res = c.quiet(0.4, after=mark3)
    resp = [f for f in res if op(f) == N.NATIVE_READ_RESP]
    sk = [f for f in res if is_sack(f) and nv(f).sack_kind == "ACK"]
    t.check("MR-OOO-022", not resp and bool(sk), f"a copy with another VA: {summ(res)}", frames=res or [mark3 + 1],
            expected="no response, an ACK-type SACK")


@case("TC-MP-004-a", rules=["MR-MP-004"], category="MP", caps=("MULTIPATH",), profile="native", timeout=30)
def any_source_port_accepted(t):
    """The packets of one 4-packet WRITE arrive from four UDP source ports: all are placed, the message completes
    and each SACK echoes its trigger's port."""
    c = connect_native(t, caps=CAP["NATIVE"] | CAP["SACK"] | CAP["OOO_PLACEMENT"] | CAP["MULTIPATH"], k=4)
    data = pattern(4096, 8)
    e = c.psn
    frames = c.write_msg(data, 0)
    ports = (0xC001, 0xD555, 0xEAAA, 0xFFFE)
    again = [c.nframe(N.NATIVE_WRITE, psn=P.psn_add(e, i), ackreq=True, payload=data[1024 * i:1024 * (i + 1)],
                      reth=(c.va, c.rkey, 4096), neth_=N.neth(0, 1024 * i, 4096, c.tsval(), payload_len=1024),
                      sport=ports[i]) for i in range(4)]
    mark = c.send(*again)
    sk = c.sacks(mark, 0.3)
    last = nv(sk[-1]) if sk else None
    echoes = {int(nv(f).sack.echo_sport) for f in sk}
    ok = last is not None and last.psn == P.psn_add(e, 3) and last.msn == 1 and c.mem(0, 4096) == data \
        and echoes <= set(ports)
    t.check("MR-MP-004", ok, f"SACKs {summ(sk)}", frames=sk, expected="cum at the last PSN, MSN 1, data placed, "
            "echo_sport among the ports used")
    del frames


@case("TC-SACK-026-a", rules=["MR-SACK-026", "MR-SACK-020"], category="SACK", profile="native", timeout=30)
def completions_wait_for_earlier_wrs(t):
    """The second of two WRITEs sacked entirely while the first's last PSN is missing: nothing completes; once the
    cumulative PSN covers both they complete in posted order."""
    c = connect_native(t, timeout=18)
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_WRITE", 2048, wr_id=1), wr(c, "RDMA_WRITE", 2048, wr_id=2, remote_off=4096))
    fr = wait_requests(c, mark, {P.psn_add(p, i) for i in range(4)})
    first = _first_tx(fr)
    need(len(first) == 4, f"requests: {summ(fr)}")
    c.send(_sack_for(c, first[P.psn_add(p, 3)], p, received={P.psn_add(p, 2), P.psn_add(p, 3)}))
    early = c.poll(2, 0.2)
    t.check("MR-SACK-026", not early, f"WR 2 sacked, WR 1's last PSN missing: completions {wc_list(early)}",
            expected="no completion", observed=[wc_list(early)])
    t.check("MR-SACK-020", not early, "sacked PSNs are not acknowledged: nothing completes", expected="no completion",
            observed=[wc_list(early)])
    c.send(_sack_for(c, first[P.psn_add(p, 3)], P.psn_add(p, 3)))
    wcs = c.poll(2, 2.0)
    check_wcs(t, ["MR-SACK-026", "MR-SACK-020"], early + wcs, [(1, WC_OK), (2, WC_OK)], "then cum covering both")


@case("TC-SACK-034-b", rules=["MR-SACK-034"], category="SACK", profile="native", timeout=30)
def invalid_request_nak(t):
    """An invalid request NAK-type SACK (0x61) at the only WRITE's PSN: IBV_WC_REM_INV_REQ_ERR, QP in ERR."""
    c = connect_native(t, timeout=18)
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_WRITE", 16, wr_id=1), wr(c, "RDMA_WRITE", 16, wr_id=2))
    fr = wait_requests(c, mark, {p, P.psn_add(p, 1)})
    need(fr, "nothing sent")
    c.send(_sack_for(c, fr[0], p, syndrome=0x61))
    wcs = c.poll(2, 2.0)
    check_wcs(t, "MR-SACK-034", wcs, [(1, "IBV_WC_REM_INV_REQ_ERR"), (2, WC_FLUSH)], "NAK 0x61 at the first PSN")
    st = c.query()["state"]
    t.check("MR-SACK-034", st == "ERR", f"QP state {st}", expected="ERR", observed=[st])


@case("TC-SACK-034-c", rules=["MR-SACK-034"], category="SACK", profile="native", timeout=30)
def remote_op_error_nak(t):
    """A remote operational error NAK-type SACK (0x63) at the second WRITE's PSN: the first succeeds, the second
    completes IBV_WC_REM_OP_ERR."""
    c = connect_native(t, timeout=18)
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_WRITE", 16, wr_id=1), wr(c, "RDMA_WRITE", 16, wr_id=2))
    fr = wait_requests(c, mark, {p, P.psn_add(p, 1)})
    first = _first_tx(fr)
    need(len(first) == 2, f"requests: {summ(fr)}")
    c.send(_sack_for(c, first[P.psn_add(p, 1)], P.psn_add(p, 1), syndrome=0x63))
    wcs = c.poll(2, 2.0)
    check_wcs(t, "MR-SACK-034", wcs, [(1, WC_OK), (2, "IBV_WC_REM_OP_ERR")], "NAK 0x63 at the second PSN")


@case("TC-LOSS-013-a", rules=["MR-LOSS-013", "MR-OOO-021"], category="RTO", profile="native", timeout=30)
def unanswered_read_rerequested_on_rto(t):
    """A READ with no response at all: on the RTO the IUT re-requests the whole READ (same PSN, RETX, offset 0,
    the READ's length) with AckReq; answered, the READ completes."""
    c = connect_native(t, timeout=18)
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_READ", 1500, wr_id=1))
    fr = wait_requests(c, mark, {p})
    need(fr, "no READ request")
    orig = nv(fr[0])
    rr = c.expect(1, 1.0, after=fr[0].num, match=lambda f: op(f) == N.NATIVE_READ_REQ)
    v = nv(rr[0]) if rr else None
    ok = (v is not None and v.psn == p and v.neth.retx and v.ackreq and int(v.neth.offset) == 0
          and int(v.reth.dlen) == 1500 and int(v.reth.va) == int(orig.reth.va)
          and int(v.neth.msn) == int(orig.neth.msn))
    t.check("MR-LOSS-013", ok, f"after the RTO: {summ(rr)}", frames=rr or fr,
            expected=f"NATIVE_READ_REQ psn {p:#08x} RETX AckReq, the whole READ")
    t.check("MR-OOO-021", ok, summ(rr), frames=rr or fr, expected="the run starting at the READ's first PSN, VA as the "
            "original, DMA Length 1500, offset 0, msg_len 1500")
    src = pattern(1500, 2)
    m = int(orig.neth.msn)
    c.send(c.read_resp(p, m, 0, 1500, src[:1024]), c.read_resp(P.psn_add(p, 1), m, 1024, 1500, src[1024:]))
    wcs = c.poll(1, 2.0)
    t.check("MR-LOSS-013", [w["status"] for w in wcs] == [WC_OK] and c.mem(0, 1500) == src,
            f"answered: {wc_list(wcs)}", expected="the READ completes")


@case("TC-SACK-036-b", rules=["MR-SACK-036"], category="RNR", profile="native", timeout=30)
def rnr_retry_budget(t):
    """rnr_retry 1: the second RNR NAK-type SACK for the SEND (after the first wait) completes it
    IBV_WC_RNR_RETRY_EXC_ERR, the WRITE after it flushed, the QP in ERR."""
    c = connect_native(t, timeout=18, rnr_retry=1)
    p = c.iut_psn
    mark = post(c, wr(c, "SEND", 16, wr_id=1), wr(c, "RDMA_WRITE", 16, wr_id=2))
    fr = wait_requests(c, mark, {p})
    need(fr, "the SEND was not sent")
    mk = c.send(_sack_for(c, fr[0], p, syndrome=0x20 | 14))           # 1.28 ms
    ts = sent_at(c, mk)
    again = c.t.lt.collect(lambda f: c.is_mine(f) and op(f) == N.NATIVE_SEND and f.ts > ts, 0.5, after=mark,
                           until=lambda fs: bool(fs))
    need(again, "the SEND was not retransmitted after the RNR wait")
    c.send(_sack_for(c, again[0], p, syndrome=0x20 | 14))
    wcs = c.poll(2, 1.0)
    st = c.query()["state"]
    ok = [(int(w["wr_id"], 16), w["status"]) for w in wcs] == [(1, "IBV_WC_RNR_RETRY_EXC_ERR"), (2, WC_FLUSH)]
    t.check("MR-SACK-036", ok and st == "ERR", f"after the second RNR NAK: {wc_list(wcs)}, QP {st}",
            expected="0x1:RNR_RETRY_EXC_ERR, 0x2:WR_FLUSH_ERR, QP in ERR", observed=[wc_list(wcs), st])
    if not ok:
        c.send(_sack_for(c, again[0], P.psn_add(p, 1)))
