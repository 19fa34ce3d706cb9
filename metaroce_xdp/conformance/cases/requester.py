"""The IUT as requester (03-compat-rc.md MR-RETRY, MR-RNR, MR-NAK-004/005/010-012, MR-ACK-002/006/013/015).

The agent posts work requests at the IUT; the LT plays the responder and
withholds, forges or reorders the responses.  Each case checks the requests the
IUT sends (PSNs, content, when) and the completions it reports.  The IUT QP's
local ACK timeout is set small (timeout 8 to 12: T = 1 to 17 ms) so that the
retransmission cases take milliseconds; cases whose verdict rests on measured
times are marked timing=True (tolerance of MR-CONF-011).
"""
from __future__ import annotations

import time

from .. import packets as P
from ..registry import case
from ._common import counter, describe
from ._req import (REMOTE_VA, REQUEST_OPS, WC_FLUSH, WC_OK, ack, agent_error, all_requests, check_err_silent,
                   connect_req, expect_wcs, nak, need, pattern, post, read_rsp, read_stream, read_wr, requests, rnr,
                   same_request, timeout_s, tolerance_s, wr, write_wr)

FATAL = ["MR-QP-023", "MR-QP-027", "MR-QP-032"]


def _first(c, mark, n=1, timeout=1.0):
    got = requests(c, mark, n, timeout)
    need(len(got) >= n, f"the IUT sent {len(got)} of the {n} request packets posted: {describe(got)}")
    return got


def _psns(frames) -> list[int]:
    return [f.roce.psn for f in frames]


def _hex(psns) -> str:
    return "[" + ", ".join(f"{p:#08x}" for p in psns) + "]"


# ---- local ACK timeout and retry_cnt (MR-RETRY) ---------------------------------------------
@case("TC-RETRY-004-a", rules=["MR-RETRY-004", "MR-RC-005", "MR-RETRY-006", "MR-RETRY-007", "MR-RC-021"],
      category="RTO", timeout=10)
def timeout_retransmits_unchanged(t):
    """A WRITE whose ACK the LT withholds is sent again at its PSN, unchanged, on its source port; the ACK
    of the retransmission completes it once."""
    c = connect_req(t, timeout=14)
    c.mem_write(0, pattern(300))
    p = c.iut_psn
    mark = post(c, write_wr(c, 300, 1))
    (orig,) = _first(c, mark)
    again = requests(c, orig.num, 1, 1.0, psn=p)
    c.send(ack(c, p, 1))
    wcs = c.poll(2, 0.3)
    frames = [orig] + again
    ok = bool(again)
    t.check("MR-RETRY-004", ok, f"original {orig.summary()}; retransmission: {describe(again)}", frames=frames,
            expected=f"the request at PSN {p:#08x} sent again after the local ACK timeout")
    diff = same_request(orig, again[0]) if again else ["no retransmission"]
    t.check("MR-RC-005", ok and again[0].roce.psn == orig.roce.psn, f"PSNs {_hex(_psns(frames))}", frames=frames,
            expected=f"retransmission at PSN {p:#08x}")
    t.check("MR-RETRY-006", not diff, "retransmission identical" if not diff else "; ".join(diff), frames=frames,
            expected="same opcode, PSN, RETH and payload")
    t.check("MR-RETRY-007", ok and again[0].roce.sport == orig.roce.sport,
            f"UDP source ports {[f.roce.sport for f in frames]}", frames=frames, expected="one UDP source port")
    expect_wcs(t, "MR-RC-021", wcs, [(1, WC_OK)], "after the ACK of the retransmission", frames=frames)


@case("TC-RETRY-003-a", rules=["MR-RETRY-001", "MR-RETRY-003", "MR-RETRY-002"], category="RTO", timeout=10,
      timing=True)
def timeout_not_before_t(t):
    """timeout 12 (T = 16.8 ms): the first retransmission comes no earlier than T after the original, the
    second no earlier than T after the first (the timer restarts), each within the MR-CONF-011 tolerance."""
    code = 12
    c = connect_req(t, timeout=code)
    T = timeout_s(code)
    tol = tolerance_s(t, T)
    p = c.iut_psn
    mark = post(c, write_wr(c, 64, 1))
    (orig,) = _first(c, mark)
    again = requests(c, orig.num, 2, 8 * T + 0.5, psn=p)
    c.send(ack(c, p, 1))
    c.poll(1, 0.3)
    need(len(again) == 2, f"two retransmissions expected, got {describe(again)}")
    d1, d2 = again[0].ts - orig.ts, again[1].ts - again[0].ts
    lo = T - tol
    det = (f"retransmissions {d1 * 1e3:.2f} ms and {d2 * 1e3:.2f} ms apart; T = {T * 1e3:.2f} ms, tolerance "
           f"{tol * 1e3:.2f} ms (the SHOULD bound 2T = {2 * T * 1e3:.1f} ms is reported, not asserted)")
    frames = [orig] + again
    t.check("MR-RETRY-001", d1 >= lo, det, frames=frames, expected=f"first retransmission >= {lo * 1e3:.2f} ms")
    t.check("MR-RETRY-003", d1 >= lo and d2 >= lo, det, frames=frames,
            expected=f"each retransmission >= {lo * 1e3:.2f} ms after the previous transmission")
    t.check("MR-RETRY-002", d2 >= lo, det, frames=frames, expected="the timer restarted with the retransmission")


def _exhaust(t, c, n_wr: int, retry_cnt: int, bound: float):
    """Post n_wr WRITEs (wr_id 1..n, the 2nd unsignaled) to an LT that never answers; returns (wcs, requests)."""
    p = c.iut_psn
    mark = post(c, *[write_wr(c, 64, i + 1, offset=64 * i, signaled=(i != 1)) for i in range(n_wr)])
    _first(c, mark, n_wr)
    wcs = c.poll(n_wr, bound)
    reqs = all_requests(c, mark)
    per = {P.psn_add(p, k): sum(1 for f in reqs if f.roce.psn == P.psn_add(p, k)) for k in range(n_wr)}
    return wcs, reqs, per


@case("TC-RETRY-005-a", rules=["MR-RETRY-004", "MR-RETRY-005", "MR-RETRY-010", "MR-RETRY-006", "MR-QP-025",
                               "MR-QP-033", *FATAL], category="RTO", timeout=10)
def retry_budget_exhausted(t):
    """retry_cnt 2, timeout 8, three WRITEs never answered: each PSN sent 1 + 2 times (go-back-N from the
    first), then RETRY_EXC_ERR for the first and WR_FLUSH_ERR for the others (the unsignaled one too), QP in
    ERR and silent."""
    c = connect_req(t, timeout=8, retry_cnt=2)
    wcs, reqs, per = _exhaust(t, c, 3, 2, 2.0)
    frames = reqs[-12:]
    ok_count = list(per.values()) == [3, 3, 3]
    t.check("MR-RETRY-005", ok_count, f"transmissions per PSN {list(per.values())}", frames=frames,
            expected="each PSN sent 3 times (retry_cnt 2)")
    t.check("MR-RETRY-004", ok_count, f"transmissions per PSN {list(per.values())}", frames=frames,
            expected="2 retransmissions from comp_psn, then the error")
    p = c.iut_psn
    order_ok = _psns(reqs) == [P.psn_add(p, k) for k in range(3)] * 3
    t.check("MR-RETRY-006", order_ok, f"request PSNs in order: {_hex(_psns(reqs))}", frames=frames,
            expected="p, p+1, p+2 three times")
    want = [(1, "IBV_WC_RETRY_EXC_ERR"), (2, WC_FLUSH), (3, WC_FLUSH)]
    expect_wcs(t, ["MR-RETRY-010", "MR-QP-033", *FATAL], wcs, want, "retries exhausted", frames=frames)
    check_err_silent(t, c, "MR-QP-025", "after RETRY_EXC_ERR")


@case("TC-RETRY-005-b", rules=["MR-RETRY-005", "MR-RETRY-004"], category="RTO", timeout=10)
def retry_cnt_7_is_seven_retries(t):
    """retry_cnt 7 is seven retries, not infinite: a WRITE never answered is sent 8 times, then RETRY_EXC_ERR."""
    c = connect_req(t, timeout=8, retry_cnt=7)
    wcs, reqs, per = _exhaust(t, c, 1, 7, 3.0)
    n = per[c.iut_psn]
    ok = n == 8 and [w["status"] for w in wcs] == ["IBV_WC_RETRY_EXC_ERR"]
    for r in ("MR-RETRY-005", "MR-RETRY-004"):
        t.check(r, ok, f"{n} transmissions; completions {[w['status'] for w in wcs]}", frames=reqs[-8:],
                expected="8 transmissions (1 + 7 retries), then IBV_WC_RETRY_EXC_ERR")


@case("TC-RETRY-005-c", rules=["MR-RETRY-005", "MR-RETRY-004"], category="RTO", timeout=10)
def retry_cnt_0_no_retransmission(t):
    """retry_cnt 0: the WRITE is sent once and fails with RETRY_EXC_ERR at the first expiry."""
    c = connect_req(t, timeout=8, retry_cnt=0)
    wcs, reqs, per = _exhaust(t, c, 1, 0, 2.0)
    n = per[c.iut_psn]
    ok = n == 1 and [w["status"] for w in wcs] == ["IBV_WC_RETRY_EXC_ERR"]
    for r in ("MR-RETRY-005", "MR-RETRY-004"):
        t.check(r, ok, f"{n} transmissions; completions {[w['status'] for w in wcs]}", frames=reqs,
                expected="1 transmission, then IBV_WC_RETRY_EXC_ERR")


@case("TC-RETRY-001-a", rules=["MR-RETRY-001"], category="RTO", timeout=10)
def timeout_0_is_infinite(t):
    """timeout 0 is infinite: a WRITE not answered for 0.4 s is not retransmitted; a late ACK completes it."""
    c = connect_req(t, timeout=0, retry_cnt=0)
    p = c.iut_psn
    mark = post(c, write_wr(c, 64, 1))
    (orig,) = _first(c, mark)
    more = requests(c, orig.num, 1, 0.4)
    c.send(ack(c, p, 1))
    wcs = c.poll(1, 0.5)
    ok = not more and [w["status"] for w in wcs] == [WC_OK]
    t.check("MR-RETRY-001", ok, f"retransmissions within 0.4 s: {describe(more)}; completion "
            f"{[w['status'] for w in wcs]}",
            frames=[orig] + more, expected="no retransmission, then IBV_WC_SUCCESS after the ACK")


@case("TC-RETRY-005-d", rules=["MR-RETRY-005", "MR-RETRY-002"], category="RTO", timeout=10)
def progress_resets_retry_budget(t):
    """retry_cnt 1: WRITE 1 is retransmitted once, then ACKed (forward progress); WRITE 2 still gets one
    retransmission of its own before RETRY_EXC_ERR."""
    c = connect_req(t, timeout=16, retry_cnt=1)
    p = c.iut_psn
    mark = post(c, write_wr(c, 64, 1), write_wr(c, 64, 2, offset=64))
    _first(c, mark, 2)
    r1 = requests(c, mark + 2, 1, 1.0, psn=p)
    need(bool(r1), "WRITE 1 was not retransmitted")
    m2 = c.send(ack(c, p, 1))
    wcs = c.poll(2, 3.0)
    after = [f for f in all_requests(c, m2) if f.roce.psn == P.psn_add(p, 1)]
    ok = [(int(w["wr_id"], 16), w["status"]) for w in wcs] == [(1, WC_OK), (2, "IBV_WC_RETRY_EXC_ERR")]
    t.check("MR-RETRY-005", ok and len(after) >= 1,
            f"completions {[w['status'] for w in wcs]}; PSN {P.psn_add(p, 1):#08x} sent {len(after)} time(s) after "
            f"the ACK of {p:#08x}", frames=r1 + after,
            expected="WRITE 2 retransmitted after the progress, then IBV_WC_RETRY_EXC_ERR")
    t.check("MR-RETRY-002", len(after) >= 1, f"retransmissions after the ACK: {describe(after)}", frames=r1 + after,
            expected="the timer restarted by the ACK, expiring again for WRITE 2")


@case("TC-RETRY-006-a", rules=["MR-RETRY-006", "MR-RETRY-004", "MR-ACK-002", "MR-RC-005"], category="RTO",
      timeout=10)
def go_back_n_from_first_unacked(t):
    """Three WRITEs; the LT ACKs the first only: after the timeout the IUT resends the 2nd and 3rd, in order,
    never the 1st; the first completes at once."""
    c = connect_req(t, timeout=16)
    p = c.iut_psn
    mark = post(c, *[write_wr(c, 64, i + 1, offset=64 * i) for i in range(3)])
    _first(c, mark, 3)
    m = c.send(ack(c, p, 1))
    w1 = c.poll(1, 0.5)
    again = requests(c, m, 2, 1.0)
    c.send(ack(c, P.psn_add(p, 2), 3))
    rest = c.poll(2, 0.5)
    want = [P.psn_add(p, 1), P.psn_add(p, 2)]
    ok = _psns(again) == want
    for r in ("MR-RETRY-006", "MR-RETRY-004", "MR-RC-005"):
        t.check(r, ok, f"after ACK {p:#08x}: resent {_hex(_psns(again))}", frames=again or [m],
                expected=f"resent {_hex(want)}")
    expect_wcs(t, "MR-ACK-002", w1 + rest, [(1, WC_OK), (2, WC_OK), (3, WC_OK)],
               "first ACKed alone, the others by the ACK of the last")


@case("TC-RETRY-016-a", rules=["MR-RETRY-016", "MR-RETRY-006"], category="RTO", timeout=10)
def timeout_go_back_n_window(t):
    """24 one-packet WRITEs, never ACKed (timeout 16, T = 268 ms): the go-back-N the timeout starts resends, at
    once and in PSN order, at least the first 16 of them (MR-RETRY-016 lets a requester hold the rest until
    an ACK), and never a PSN twice before it has sent the ones before it; then an ACK for all completes
    them."""
    c = connect_req(t, timeout=16)
    n, p = 24, c.iut_psn
    mark = post(c, *[write_wr(c, 8, i + 1, offset=8 * i) for i in range(n)])
    orig = _first(c, mark, n)
    again = requests(c, orig[-1].num, 16, 1.0)
    psns = _psns(again)
    k = len(psns)
    want = [P.psn_add(p, i) for i in range(16)]
    ok = k >= 16 and psns[:16] == want                  # (a slow tester may see the next timeout's resends too)
    span = again[15].ts - again[0].ts if k >= 16 else None
    c.send(ack(c, P.psn_add(p, n - 1), n))
    wcs = c.poll(n, 1.0)
    ok_wc = [w["status"] for w in wcs] == [WC_OK] * n
    det = (f"resent after the timeout: {_hex(psns[:20])}{' ...' if k > 20 else ''} ({k} packets"
           + (f", the first 16 within {span * 1e3:.2f} ms" if span is not None else "") + f"); completions "
           f"{len(wcs)} of {n} SUCCESS: {ok_wc}")
    for r in ("MR-RETRY-016", "MR-RETRY-006"):
        t.check(r, ok and ok_wc, det, frames=again[:16] or [orig[-1]],
                expected=f"PSNs {p:#08x}.. in order, at least 16 without an ACK; then 24 completions")


@case("TC-RETRY-006-b", rules=["MR-RETRY-006", "MR-RC-005"], category="RTO", timeout=10)
def go_back_n_inside_a_message(t):
    """A 4-packet WRITE (path MTU 256) ACKed up to its 2nd packet: the retransmission starts with the MIDDLE
    packet at the 3rd PSN (no RETH, the same payload), then the LAST."""
    c = connect_req(t, mtu=256, timeout=16)
    data = pattern(1000, 3)
    c.mem_write(0, data)
    p = c.iut_psn
    mark = post(c, write_wr(c, 1000, 1))
    orig = _first(c, mark, 4)
    m = c.send(ack(c, P.psn_add(p, 1), 0))
    again = requests(c, m, 2, 1.0)
    c.send(ack(c, P.psn_add(p, 3), 1))
    wcs = c.poll(1, 0.5)
    probs = []
    if _psns(again) != [P.psn_add(p, 2), P.psn_add(p, 3)]:
        probs.append(f"resent PSNs {_hex(_psns(again))}")
    else:
        probs += same_request(orig[2], again[0]) + same_request(orig[3], again[1])
        if again[0].roce.op != 0x07 or "RETH" in again[0].roce.headers:
            probs.append(f"first retransmitted packet is {again[0].roce.name}")
    ok = not probs and [w["status"] for w in wcs] == [WC_OK]
    for r in ("MR-RETRY-006", "MR-RC-005"):
        t.check(r, ok, "; ".join(probs) or f"resent MIDDLE, LAST; completion {[w['status'] for w in wcs]}",
                frames=orig + again, expected=f"RDMA_WRITE_MIDDLE psn={P.psn_add(p, 2):#08x}, RDMA_WRITE_LAST, "
                                              "unchanged; then IBV_WC_SUCCESS")


@case("TC-RETRY-009-a", rules=["MR-RETRY-009", "MR-RC-020"], category="RTO", timeout=10)
def late_response_after_retry_ignored(t):
    """After a NAK-driven retry from the 2nd WRITE, a late ACK of the 1st changes nothing: two completions,
    each once, in order."""
    c = connect_req(t, timeout=16)
    p = c.iut_psn
    mark = post(c, write_wr(c, 64, 1), write_wr(c, 64, 2, offset=64))
    _first(c, mark, 2)
    m = c.send(nak(c, P.psn_add(p, 1), 1, 0))
    requests(c, m, 1, 1.0, psn=P.psn_add(p, 1))
    c.send(ack(c, p, 1), ack(c, p, 1))
    time.sleep(0.02)
    c.send(ack(c, P.psn_add(p, 1), 2))
    wcs = c.poll(4, 0.5)
    expect_wcs(t, ["MR-RETRY-009", "MR-RC-020"], wcs, [(1, WC_OK), (2, WC_OK)], "late ACKs of the first WRITE")


# ---- NAKs received (MR-NAK-004/005/010/011/012, MR-RETRY-011) ------------------------------------
@case("TC-NAK-004-a", rules=["MR-NAK-004", "MR-RETRY-006", "MR-NAK-001"], category="ACK", timeout=10)
def seq_nak_goes_back(t):
    """Three WRITEs, NAK sequence error at the 2nd: the 1st completes, the IUT resends the 2nd and 3rd at once
    (within 0.3 s, long before its timeout of 1.07 s), then the ACK of the 3rd completes both."""
    c = connect_req(t, timeout=18)
    p = c.iut_psn
    mark = post(c, *[write_wr(c, 64, i + 1, offset=64 * i) for i in range(3)])
    _first(c, mark, 3)
    m = c.send(nak(c, P.psn_add(p, 1), 1, 0))
    again = requests(c, m, 2, 0.5)
    sent = t.lt.wait(lambda f: f.outgoing and f.roce is not None and f.roce.op == 0x11, 0.5, after=m)
    quick = sent is not None and len(again) == 2 and again[0].ts - sent.ts < 0.3
    w1 = c.poll(1, 0.3)
    c.send(ack(c, P.psn_add(p, 2), 3))
    rest = c.poll(2, 0.5)
    want = [P.psn_add(p, 1), P.psn_add(p, 2)]
    ok = _psns(again) == want and quick
    t.check("MR-NAK-004", ok, f"after NAK(0x60) {P.psn_add(p, 1):#08x}: resent {_hex(_psns(again))}",
            frames=again or [m], expected=f"resent {_hex(want)} within 0.3 s of the NAK")
    t.check("MR-RETRY-006", ok, f"resent {_hex(_psns(again))}", frames=again or [m], expected=f"resent {_hex(want)}")
    expect_wcs(t, ["MR-NAK-001", "MR-NAK-004"], w1 + rest, [(1, WC_OK), (2, WC_OK), (3, WC_OK)],
               "WRITE 1 acknowledged by the NAK, the others by the final ACK")


@case("TC-NAK-005-a", rules=["MR-NAK-005"], category="ACK", timeout=10)
def repeated_seq_nak_one_retry(t):
    """Two identical sequence-error NAKs back to back: one go-back-N (the 2nd PSN resent once), whether the
    second NAK arrives before or after the retransmission has sent that PSN again: nothing has acknowledged
    it and the timer (timeout 18, about 1 s) has not expired, so the retry is still in progress (MR-NAK-005)."""
    c = connect_req(t, timeout=18)
    p = c.iut_psn
    mark = post(c, *[write_wr(c, 64, i + 1, offset=64 * i) for i in range(3)])
    _first(c, mark, 3)
    f = nak(c, P.psn_add(p, 1), 1, 0)
    m = c.send(f, f)
    requests(c, m, 2, 0.5)
    got = [x for x in c.quiet(0.1, after=m) if x.roce.op in P.OPS and x.roce.psn == P.psn_add(p, 1)]
    c.send(ack(c, P.psn_add(p, 2), 3))
    c.poll(3, 0.5)
    t.check("MR-NAK-005", len(got) == 1, f"PSN {P.psn_add(p, 1):#08x} resent {len(got)} time(s)",
            frames=got or [m], expected="resent once")


@case("TC-RETRY-011-a", rules=["MR-RETRY-011", "MR-NAK-004"], category="ACK", timeout=10)
def seq_nak_with_no_retry_left(t):
    """retry_cnt 0: a sequence-error NAK for the first PSN fails the WRITE with RETRY_EXC_ERR, no retransmission."""
    c = connect_req(t, timeout=16, retry_cnt=0)
    p = c.iut_psn
    mark = post(c, write_wr(c, 64, 1), write_wr(c, 64, 2, offset=64))
    _first(c, mark, 2)
    m = c.send(nak(c, p, 0, 0))
    wcs = c.poll(2, 0.5)
    again = all_requests(c, m)
    expect_wcs(t, "MR-RETRY-011", wcs, [(1, "IBV_WC_RETRY_EXC_ERR"), (2, WC_FLUSH)], "NAK with retry_cnt 0",
               frames=again)
    t.check("MR-NAK-004", not again, f"requests after the NAK: {describe(again)}", frames=again or [m],
            expected="no retransmission (no retry left)")


@case("TC-RETRY-011-b", rules=["MR-RETRY-011", "MR-NAK-004"], category="ACK", timeout=10)
def seq_nak_consumes_a_retry(t):
    """retry_cnt 1: a sequence-error NAK costs the one retry (the WRITE is resent); the timeout that follows
    finds none left: RETRY_EXC_ERR, no second retransmission."""
    c = connect_req(t, timeout=16, retry_cnt=1)
    p = c.iut_psn
    mark = post(c, write_wr(c, 64, 1))
    _first(c, mark)
    m = c.send(nak(c, p, 0, 0))
    wcs = c.poll(1, 2.0)
    again = all_requests(c, m)
    expect_wcs(t, "MR-RETRY-011", wcs, [(1, "IBV_WC_RETRY_EXC_ERR")], "NAK then timeout with retry_cnt 1",
               frames=again)
    t.check("MR-NAK-004", len(again) == 1 and again[0].roce.psn == p,
            f"requests after the NAK: {describe(again)}", frames=again or [m],
            expected=f"exactly one retransmission at {p:#08x}")


@case("TC-RETRY-011-c", rules=["MR-RETRY-011", "MR-RETRY-012"], category="ACK", timeout=10)
def implied_nak_with_no_retry_left(t):
    """retry_cnt 0: two READs; the LT answers only the second (READ RESPONSE ONLY at its PSN), which implies the
    first's response was lost (MR-RETRY-012).  The retry that implied NAK calls for counts against retry_left
    (MR-RETRY-011) and none is left: no READ REQUEST goes again, the first READ completes RETRY_EXC_ERR (at once
    or at the local ACK timer, 67 ms) and the second WR_FLUSH_ERR."""
    c = connect_req(t, timeout=14, retry_cnt=0)
    p = c.iut_psn
    mark = post(c, read_wr(c, 64, 1), read_wr(c, 64, 2, offset=256))
    _first(c, mark, 2)
    m = c.send(read_rsp(c, "RDMA_READ_RESPONSE_ONLY", P.psn_add(p, 1), pattern(64, 3), 2))
    wcs = c.poll(2, 1.0)
    again = all_requests(c, m)
    expect_wcs(t, "MR-RETRY-011", wcs, [(1, "IBV_WC_RETRY_EXC_ERR"), (2, WC_FLUSH)],
               "an implied NAK with retry_cnt 0", frames=again or [m + 1])
    t.check("MR-RETRY-012", not again, f"requests after the second READ's response: {describe(again)}",
            frames=again or [m + 1], expected="no READ REQUEST again (no retry left)")


WC_STATUSES = {"IBV_WC_SUCCESS", "IBV_WC_LOC_LEN_ERR", "IBV_WC_LOC_QP_OP_ERR", "IBV_WC_LOC_PROT_ERR",
               "IBV_WC_WR_FLUSH_ERR", "IBV_WC_BAD_RESP_ERR", "IBV_WC_LOC_ACCESS_ERR", "IBV_WC_REM_INV_REQ_ERR",
               "IBV_WC_REM_ACCESS_ERR", "IBV_WC_REM_OP_ERR", "IBV_WC_RETRY_EXC_ERR", "IBV_WC_RNR_RETRY_EXC_ERR",
               "IBV_WC_FATAL_ERR", "IBV_WC_GENERAL_ERR"}      # Table 7-5, the values MetaRoCE v1 generates


def _fatal_nak(t, code: int, status: str, rules):
    c = connect_req(t, timeout=14)
    p = c.iut_psn
    mark = post(c, *[write_wr(c, 64, i + 1, offset=64 * i) for i in range(3)])
    _first(c, mark, 3)
    m = c.send(nak(c, P.psn_add(p, 1), 1, code))
    wcs = c.poll(3, 1.0)
    want = [(1, WC_OK), (2, status), (3, WC_FLUSH)]
    expect_wcs(t, rules, wcs, want, f"NAK code {code} at the 2nd WRITE", frames=[m + 1])
    check_err_silent(t, c, ["MR-QP-025", "MR-QP-038"], f"after NAK code {code}")
    errs = [w for w in wcs if w["status"] != WC_OK]
    t.check("MR-QP-029", bool(errs) and all(w.get("qp_num") == c.qpn and "wr_id" in w for w in errs),
            f"error completions {errs}", expected=f"wr_id, status and qp_num {c.qpn:#x} defined",
            observed=[str(errs)])
    t.check("MR-QP-031", bool(wcs) and all(w["status"] in WC_STATUSES for w in wcs),
            f"statuses {[w['status'] for w in wcs]}", expected="statuses of Table 7-5", observed=[str(wcs)])


@case("TC-NAK-010-a", rules=["MR-NAK-010", "MR-QP-025", "MR-QP-038", "MR-QP-029", "MR-QP-031", *FATAL],
      category="ACK", timeout=10)
def nak_remote_access(t):
    """NAK remote access error at the 2nd of 3 WRITEs: SUCCESS, REM_ACCESS_ERR, WR_FLUSH_ERR; QP in ERR, silent."""
    _fatal_nak(t, 2, "IBV_WC_REM_ACCESS_ERR", ["MR-NAK-010", *FATAL])


@case("TC-NAK-010-b", rules=["MR-NAK-010", "MR-QP-025", "MR-QP-038", "MR-QP-029", "MR-QP-031", *FATAL],
      category="ACK", timeout=10)
def nak_invalid_request(t):
    """NAK invalid request at the 2nd of 3 WRITEs: SUCCESS, REM_INV_REQ_ERR, WR_FLUSH_ERR; QP in ERR, silent."""
    _fatal_nak(t, 1, "IBV_WC_REM_INV_REQ_ERR", ["MR-NAK-010", *FATAL])


@case("TC-NAK-010-c", rules=["MR-NAK-010", "MR-QP-025", "MR-QP-038", "MR-QP-029", "MR-QP-031", *FATAL],
      category="ACK", timeout=10)
def nak_remote_operational(t):
    """NAK remote operational error at the 2nd of 3 WRITEs: SUCCESS, REM_OP_ERR, WR_FLUSH_ERR; QP in ERR."""
    _fatal_nak(t, 3, "IBV_WC_REM_OP_ERR", ["MR-NAK-010", *FATAL])


@case("TC-NAK-011-a", rules=["MR-NAK-011", "MR-NAK-010"], category="ACK", timeout=10)
def nak_code_4_and_reserved_as_3(t):
    """NAK code 4 (invalid RD request) and a reserved code (9), each on a QP of its own: REM_OP_ERR."""
    for code in (4, 9):
        c = connect_req(t, timeout=14)
        mark = post(c, write_wr(c, 64, code))
        _first(c, mark)
        m = c.send(nak(c, c.iut_psn, 0, code))
        wcs = c.poll(1, 1.0)
        expect_wcs(t, ["MR-NAK-011", "MR-NAK-010"], wcs, [(code, "IBV_WC_REM_OP_ERR")], f"NAK code {code}",
                   frames=[m + 1])


def _bad_response(t, c, frames_fn, n_req: int, wrs, what: str, rules):
    mark = post(c, *wrs)
    reqs = _first(c, mark, n_req)
    m = c.send(*frames_fn(reqs))
    wcs = c.poll(len(wrs), 1.0)
    want = [(int(wrs[0]["wr_id"], 16), "IBV_WC_BAD_RESP_ERR")] + [(int(w["wr_id"], 16), WC_FLUSH) for w in wrs[1:]]
    expect_wcs(t, rules, wcs, want, what, frames=reqs + [m + 1])
    check_err_silent(t, c, ["MR-QP-025"], what)


@case("TC-NAK-012-a", rules=["MR-NAK-012", "MR-QP-025", "MR-QP-032"], category="ACK", timeout=10)
def read_response_wrong_length(t):
    """A READ of 100 bytes answered by a READ RESPONSE ONLY of 60: BAD_RESP_ERR, the next WR flushed, QP in ERR."""
    c = connect_req(t, timeout=14)
    _bad_response(t, c, lambda r: [read_rsp(c, "RDMA_READ_RESPONSE_ONLY", c.iut_psn, pattern(60), 1)], 1,
                  [read_wr(c, 100, 1), write_wr(c, 8, 2, offset=512)], "READ RESPONSE of the wrong length",
                  ["MR-NAK-012", "MR-QP-032"])


@case("TC-NAK-012-b", rules=["MR-NAK-012", "MR-QP-025", "MR-QP-032"], category="ACK", timeout=10)
def read_response_middle_first(t):
    """A 3-packet READ (path MTU 256) answered by a MIDDLE before any FIRST: BAD_RESP_ERR, QP in ERR."""
    c = connect_req(t, mtu=256, timeout=14)
    _bad_response(t, c, lambda r: [read_rsp(c, "RDMA_READ_RESPONSE_MIDDLE", c.iut_psn, pattern(256), 1)], 1,
                  [read_wr(c, 700, 1)], "READ RESPONSE MIDDLE without FIRST", ["MR-NAK-012", "MR-QP-032"])


@case("TC-NAK-012-c", rules=["MR-NAK-012", "MR-QP-025", "MR-QP-032"], category="ACK", timeout=10)
def read_response_for_a_write(t):
    """A READ RESPONSE ONLY at the PSN of an RDMA WRITE: BAD_RESP_ERR for the WRITE, QP in ERR."""
    c = connect_req(t, timeout=14)
    _bad_response(t, c, lambda r: [read_rsp(c, "RDMA_READ_RESPONSE_ONLY", c.iut_psn, pattern(64), 1)], 1,
                  [write_wr(c, 64, 1)], "READ RESPONSE for a WRITE", ["MR-NAK-012", "MR-QP-032"])


@case("TC-NAK-012-d", rules=["MR-NAK-012", "MR-XH-008", "MR-QP-025"], category="ACK", timeout=10)
def aeth_reserved_type(t):
    """An ACKNOWLEDGE whose AETH has type 10 (syndrome 0x40), and on another QP one with bit 7 set (0x9f):
    each a bad response, BAD_RESP_ERR, QP in ERR."""
    for syn, wid in ((0x40, 1), (0x9F, 2)):
        c = connect_req(t, timeout=14)
        _bad_response(t, c, lambda r, s=syn, c=c: [ack(c, c.iut_psn, 1, s)], 1, [write_wr(c, 64, wid)],
                      f"AETH syndrome {syn:#04x}", ["MR-NAK-012", "MR-XH-008"])


# ---- ACK semantics at the completer (MR-ACK-002/006/015, MR-RETRY-012) --------------------------
@case("TC-ACK-002-a", rules=["MR-ACK-002", "MR-RC-020", "MR-QP-035", "MR-RC-021", "MR-QP-037"], category="ACK",
      timeout=10)
def coalesced_ack_completes_all(t):
    """Four WRITEs and one ACK for the last PSN: four SUCCESS completions in posting order."""
    c = connect_req(t, timeout=14)
    p = c.iut_psn
    mark = post(c, *[write_wr(c, 32, i + 1, offset=32 * i) for i in range(4)])
    reqs = _first(c, mark, 4)
    c.send(ack(c, P.psn_add(p, 3), 4))
    wcs = c.poll(4, 1.0)
    expect_wcs(t, ["MR-ACK-002", "MR-RC-020", "MR-QP-035", "MR-RC-021"], wcs, [(i + 1, WC_OK) for i in range(4)],
               "one ACK for the 4th PSN", frames=reqs)
    t.check("MR-QP-037", len(wcs) == 4 and all(int(w.get("vendor_err", 0)) == 0 for w in wcs),
            f"vendor_err of the successful completions: {[w.get('vendor_err', 0) for w in wcs]}",
            expected="0 (absent) in every successful completion", observed=[str(wcs)])


@case("TC-ACK-006-a", rules=["MR-ACK-006", "MR-RC-021", "MR-RC-020", "MR-QP-034"], category="ACK", timeout=10)
def read_response_acks_earlier_write(t):
    """A WRITE then a READ; the LT never ACKs the WRITE but answers the READ: the READ RESPONSE completes the
    WRITE first, then the READ with its data placed and byte_len the bytes read."""
    c = connect_req(t, timeout=14)
    p = c.iut_psn
    data = pattern(200, 11)
    mark = post(c, write_wr(c, 64, 1), read_wr(c, 200, 2, offset=1024))
    _first(c, mark, 2)
    c.send(*read_stream(c, P.psn_add(p, 1), data, 2))
    wcs = c.poll(2, 1.0)
    expect_wcs(t, ["MR-ACK-006", "MR-RC-020"], wcs, [(1, WC_OK), (2, WC_OK)], "READ RESPONSE only")
    placed = c.mem(1024, 200)
    bl = wcs[1].get("byte_len") if len(wcs) == 2 else None
    t.check("MR-RC-021", placed == data, f"READ data placed: {placed == data}", expected="the 200 bytes placed",
            observed=[placed[:32].hex()])
    t.check("MR-QP-034", bl == 200 and wcs[1].get("opcode") == "IBV_WC_RDMA_READ",
            f"READ completion {wcs[1] if len(wcs) == 2 else None}", expected="IBV_WC_RDMA_READ, byte_len 200")


@case("TC-RETRY-012-a", rules=["MR-RETRY-012", "MR-RETRY-008", "MR-RC-021"], category="ACK", timeout=10)
def implied_nak_retries_read(t):
    """A READ then a WRITE; the LT ACKs the WRITE's PSN without answering the READ: the READ's response was
    lost (implied NAK) and the IUT sends the READ REQUEST again at its PSN; answered, both complete.  (The
    deadline, the local ACK timer, is TC-RETRY-012-b's; here the wait is 1 s, and how soon is reported, with
    whether the local ACK timer had expired by then where the IUT reports its per-QP `timeouts`: a retry
    without a timeout is the prompt one MR-RETRY-015 recommends.)"""
    c = connect_req(t, timeout=14)
    p = c.iut_psn
    data = pattern(100, 5)
    timers = "timeouts" in (t.caps.get("qp_counters") or ())
    k0 = c.counters()["timeouts"] if timers else None
    mark = post(c, read_wr(c, 100, 1), write_wr(c, 64, 2, offset=512))
    orig = _first(c, mark, 2)
    m = c.send(ack(c, P.psn_add(p, 1), 2))
    a = c.t.lt.wait(lambda f: f.outgoing and f.roce is not None and f.roce.op == 0x11, 0.2, after=m)
    again = requests(c, m, 1, 1.0, psn=p)
    if timers and again:
        k1 = c.counters()["timeouts"] - k0
        how = "the implying ACK, the timer not expired" if k1 == 0 else f"the local ACK timer ({k1} expiries)"
    c.send(*read_stream(c, p, data, 2), ack(c, P.psn_add(p, 1), 2))
    wcs = c.poll(2, 1.0)
    ok = bool(again) and again[0].roce.op == 0x0C and not same_request(orig[0], again[0])
    after = f", {(again[0].ts - a.ts) * 1e3:.1f} ms after the ACK" if again and a is not None else ""
    if timers and again:
        after += f"; retried on {how}"
    t.check("MR-RETRY-012", ok, f"after ACK {P.psn_add(p, 1):#08x}: {describe(again)}{after}", frames=orig + again,
            expected=f"RDMA_READ_REQUEST psn={p:#08x} again, unchanged")
    t.check("MR-RETRY-008", ok, f"re-sent READ: {describe(again)}", frames=orig + again,
            expected="the original READ REQUEST (first PSN, address, length)")
    expect_wcs(t, "MR-RC-021", wcs, [(1, WC_OK), (2, WC_OK)], "after the READ response")
    t.check("MR-RC-021", c.mem(0, 100) == data, "READ data placed", expected="the 100 bytes placed")


@case("TC-RETRY-008-a", rules=["MR-RETRY-008", "MR-RETRY-004", "MR-RC-021"], category="RTO", timeout=10)
def read_retry_inside_responses(t):
    """A 4-packet READ (path MTU 256) answered with FIRST and MIDDLE only: after the timeout the IUT asks again,
    for the whole READ or for the remainder (PSN + 2, VA + 512, 512 bytes, same R_Key); answered, the data is
    complete."""
    c = connect_req(t, mtu=256, timeout=14)
    p = c.iut_psn
    data = pattern(1024, 9)
    mark = post(c, read_wr(c, 1024, 1))
    (orig,) = _first(c, mark)
    s = read_stream(c, p, data, 1)
    m = c.send(*s[:2])
    again = requests(c, m, 1, 1.0)
    need(bool(again), "the READ was not requested again")
    v = again[0].roce
    r = v.headers.get("RETH")
    whole = v.psn == p and r is not None and int(r.dlen) == 1024
    rest = (v.psn == P.psn_add(p, 2) and r is not None and int(r.va) == int(orig.roce.headers["RETH"].va) + 512
            and int(r.dlen) == 512 and int(r.rkey) == int(orig.roce.headers["RETH"].rkey))
    if whole:
        c.send(*s)
    elif rest:
        c.send(*read_stream(c, P.psn_add(p, 2), data[512:], 1))
    wcs = c.poll(1, 1.0)
    t.check("MR-RETRY-008", whole or rest, f"READ asked again: {again[0].summary()}", frames=[orig, again[0]],
            expected=f"READ REQUEST psn={p:#08x} len=1024, or psn={P.psn_add(p, 2):#08x} va+512 len=512")
    t.check("MR-RETRY-004", whole or rest, "retried after the timeout", frames=[orig, again[0]])
    expect_wcs(t, "MR-RC-021", wcs, [(1, WC_OK)], "READ completed")
    t.check("MR-RC-021", c.mem(0, 1024) == data, "all 1024 bytes placed", expected="the 1024 bytes")


@case("TC-ACK-015-a", rules=["MR-ACK-015", "MR-SEC-022"], category="ACK", timeout=10)
def ghost_acks_ignored(t):
    """ACKs for PSNs never sent (next_psn + 4, next_psn + 2^22) complete nothing; the real ACK then completes
    the WRITE once."""
    c = connect_req(t, timeout=14)
    p = c.iut_psn
    mark = post(c, write_wr(c, 64, 1))
    _first(c, mark)
    c.send(ack(c, P.psn_add(p, 5), 1), ack(c, P.psn_add(p, 1 << 22), 1))
    early = c.poll(1, 0.2)
    m = c.send(ack(c, p, 1))
    wcs = c.poll(2, 0.3)
    ok = not early and [w["status"] for w in wcs] == [WC_OK]
    for r in ("MR-ACK-015", "MR-SEC-022"):
        t.check(r, ok, f"completions after the ghost ACKs: {[w['status'] for w in early]}; after the real ACK: "
                f"{[w['status'] for w in wcs]}", frames=[m], expected="none, then one IBV_WC_SUCCESS")


@case("TC-ACK-015-b", rules=["MR-ACK-015", "MR-SEC-024", "MR-SEC-022"], category="ACK", timeout=10)
def stale_acks_restart_nothing(t):
    """WRITE 1 ACKed; while WRITE 2 waits, the LT repeats the ACK of WRITE 1 (stale, comp_psn - 1) every few ms:
    it completes nothing, neither restarts the timer nor refills the budget (retry_cnt 1): WRITE 2 is
    retransmitted and fails with RETRY_EXC_ERR."""
    c = connect_req(t, timeout=16, retry_cnt=1)
    p = c.iut_psn
    m0 = post(c, write_wr(c, 64, 1))
    _first(c, m0)
    c.send(ack(c, p, 1))
    w1 = c.poll(1, 0.5)
    need([w["status"] for w in w1] == [WC_OK], f"WRITE 1 not completed: {w1}")
    mark = post(c, write_wr(c, 64, 2, offset=64))
    _first(c, mark)
    wcs: list = []
    end = time.monotonic() + 3.0
    stale = ack(c, p, 1)
    while time.monotonic() < end and not wcs:
        c.send(stale)
        wcs = c.poll(1, 0.002)
    resent = [f for f in all_requests(c, mark) if f.roce.psn == P.psn_add(p, 1)]
    ok = [w["status"] for w in wcs] == ["IBV_WC_RETRY_EXC_ERR"] and len(resent) == 2
    for r in ("MR-ACK-015", "MR-SEC-024", "MR-SEC-022"):
        t.check(r, ok, f"WRITE 2 sent {len(resent)} time(s); completion {[w['status'] for w in wcs]} while stale "
                f"ACKs of {p:#08x} arrived", frames=resent, expected="2 transmissions, then IBV_WC_RETRY_EXC_ERR")


@case("TC-BTH-016-r", rules=["MR-BTH-016"], category="ACK", timeout=10)
def ack_for_unknown_qp_ignored(t):
    """An ACK of the WRITE's PSN addressed to a QPN that does not exist completes nothing (dropped, counted in
    rx_drop_qpn when reported); the real ACK then completes the WRITE."""
    c = connect_req(t, timeout=14)
    p = c.iut_psn
    mark = post(c, write_wr(c, 64, 1))
    _first(c, mark)
    other = (c.qpn ^ 0x5A5A00) & 0xFFFFFF
    n0 = counter(t, "rx_drop_qpn")
    m = c.send(ack(c, p, 1, dqpn=other))
    early = c.poll(1, 0.2)
    n1 = counter(t, "rx_drop_qpn")
    c.send(ack(c, p, 1))
    wcs = c.poll(1, 0.5)
    counted = n0 is None or (n1 is not None and n1 > n0)
    ok = not early and [w["status"] for w in wcs] == [WC_OK] and counted
    t.check("MR-BTH-016", ok, f"completion from the ACK to QPN {other:#08x}: {[w['status'] for w in early]}; "
            f"rx_drop_qpn {n0} -> {n1}; after the real ACK {[w['status'] for w in wcs]}", frames=[m + 1],
            expected="nothing, rx_drop_qpn +1, then IBV_WC_SUCCESS")


# ---- RNR (MR-RNR-002/004-009) ---------------------------------------------------------------------
@case("TC-RNR-005-a", rules=["MR-RNR-005", "MR-RNR-002", "MR-RC-005"], category="RNR", timeout=10)
def rnr_nak_then_retry(t):
    """A SEND answered by an RNR NAK (timer code 1, 10 us) is sent again, unchanged, at its PSN; the ACK
    then completes it."""
    c = connect_req(t, timeout=14)
    p = c.iut_psn
    c.mem_write(0, pattern(40))
    mark = post(c, wr("SEND", 40, wr_id=1, c=c))
    (orig,) = _first(c, mark)
    m = c.send(rnr(c, p, 0, 1))
    again = requests(c, m, 1, 1.0, psn=p)
    c.send(ack(c, p, 1))
    wcs = c.poll(1, 0.5)
    diff = same_request(orig, again[0]) if again else ["no retransmission"]
    for r in ("MR-RNR-005", "MR-RC-005"):
        t.check(r, not diff, "; ".join(diff) or "SEND resent unchanged", frames=[orig] + again,
                expected=f"SEND_ONLY psn={p:#08x} again")
    expect_wcs(t, "MR-RNR-002", wcs, [(1, WC_OK)], "after RNR NAK and ACK")


@case("TC-RNR-006-a", rules=["MR-RNR-004", "MR-RNR-005", "MR-RNR-006"], category="RNR", timeout=10, timing=True)
def rnr_wait_respected(t):
    """RNR NAK with timer code 29 (245.76 ms) on a QP whose local ACK timeout is 134 ms (timeout 15): the SEND
    comes again no earlier than 245.76 ms after the NAK (tolerance of MR-CONF-011), with nothing sent in between
    (the local ACK timer causes no retry during the wait)."""
    c = connect_req(t, timeout=15)
    p = c.iut_psn
    mark = post(c, wr("SEND", 16, wr_id=1, c=c))
    _first(c, mark)
    m = c.send(rnr(c, p, 0, 29))
    sent = t.lt.wait(lambda f: f.outgoing and f.roce is not None and f.roce.op == 0x11, 0.5, after=m)
    need(sent is not None, "the RNR NAK was not captured")
    wait = 245.76e-3
    # a request the IUT sent before the NAK reached it (capture time within 1 ms of the NAK) crossed it
    again = c.expect(1, 2.0, after=m, match=lambda f: f.roce.op in REQUEST_OPS and f.ts > sent.ts + 1e-3)
    c.send(ack(c, p, 1))
    c.poll(1, 0.5)
    need(bool(again), "the SEND was not sent again")
    lo = wait - tolerance_s(t, wait)
    d = again[0].ts - sent.ts
    ok = again[0].roce.psn == p and d >= lo
    det = f"first request after the RNR NAK: {again[0].summary()} {d * 1e3:.2f} ms later (at least {lo * 1e3:.2f})"
    for r in ("MR-RNR-004", "MR-RNR-005", "MR-RNR-006"):
        t.check(r, ok, det, frames=[sent, again[0]], expected=f"psn={p:#08x} >= {lo * 1e3:.2f} ms after the NAK")


@case("TC-RNR-007-a", rules=["MR-RNR-007"], category="RNR", timeout=10)
def rnr_retry_7_is_infinite(t):
    """rnr_retry 7: ten RNR NAKs in a row (timer code 1), each followed by a retry; the ACK then completes."""
    c = connect_req(t, timeout=16, rnr_retry=7)
    p = c.iut_psn
    mark = post(c, wr("SEND", 16, wr_id=1, c=c))
    (f,) = _first(c, mark)
    got = [f]
    retried = 0
    for _ in range(10):
        m = c.send(rnr(c, p, 0, 1))
        nxt = requests(c, m, 1, 1.0, psn=p)
        if not nxt:
            break
        retried += 1
        got += nxt
    c.send(ack(c, p, 1))
    wcs = c.poll(1, 0.5)
    ok = retried == 10 and [w["status"] for w in wcs] == [WC_OK]
    t.check("MR-RNR-007", ok, f"{retried} of 10 RNR NAKs followed by a retry; completion "
            f"{[w['status'] for w in wcs]}", frames=got[-3:], expected="a retry after each, then IBV_WC_SUCCESS")


@case("TC-RNR-005-b", rules=["MR-RNR-005", "MR-RNR-007", "MR-QP-025", *FATAL], category="RNR", timeout=10)
def rnr_retry_exhausted(t):
    """rnr_retry 2: RNR NAK, retry, RNR NAK, retry, RNR NAK -> RNR_RETRY_EXC_ERR (no third retry), the next
    WR flushed, QP in ERR."""
    c = connect_req(t, timeout=16, rnr_retry=2)
    p = c.iut_psn
    mark = post(c, wr("SEND", 16, wr_id=1, c=c), wr("SEND", 16, wr_id=2, c=c, offset=64))
    _first(c, mark, 2)
    n = 0
    m = mark
    for _ in range(2):
        m = c.send(rnr(c, p, 0, 1))
        if requests(c, m, 1, 1.0, psn=p):
            n += 1
    m = c.send(rnr(c, p, 0, 1))
    wcs = c.poll(2, 1.0)
    extra = [f for f in all_requests(c, m) if f.roce.psn == p]
    ok = n == 2 and not extra
    for r in ("MR-RNR-005", "MR-RNR-007"):
        t.check(r, ok, f"retries after the first two RNR NAKs: {n}; after the third: {describe(extra)}",
                frames=extra or [m + 1], expected="2 retries, none after the third RNR NAK")
    expect_wcs(t, ["MR-RNR-005", *FATAL], wcs, [(1, "IBV_WC_RNR_RETRY_EXC_ERR"), (2, WC_FLUSH)],
               "third RNR NAK with rnr_retry 2")
    check_err_silent(t, c, "MR-QP-025", "after RNR_RETRY_EXC_ERR")


@case("TC-RNR-009-a", rules=["MR-RNR-009"], category="RNR", timeout=10)
def rnr_does_not_use_retry_cnt(t):
    """retry_cnt 0: two RNR NAKs are retried all the same (they do not count against retry_left)."""
    c = connect_req(t, timeout=16, retry_cnt=0, rnr_retry=7)
    p = c.iut_psn
    mark = post(c, wr("SEND", 16, wr_id=1, c=c))
    _first(c, mark)
    n = 0
    for _ in range(2):
        m = c.send(rnr(c, p, 0, 1))
        if requests(c, m, 1, 1.0, psn=p):
            n += 1
    c.send(ack(c, p, 1))
    wcs = c.poll(1, 0.5)
    ok = n == 2 and [w["status"] for w in wcs] == [WC_OK]
    t.check("MR-RNR-009", ok, f"{n} retries for 2 RNR NAKs with retry_cnt 0; completion {[w['status'] for w in wcs]}",
            frames=[m + 1], expected="2 retries, IBV_WC_SUCCESS")


@case("TC-RNR-008-a", rules=["MR-RNR-008", "MR-RNR-005"], category="RNR", timeout=10)
def rnr_budget_reset_by_progress(t):
    """rnr_retry 1, two SENDs: RNR NAK at the 1st (budget used), retry, ACK of the 1st (progress, budget
    refilled), RNR NAK at the 2nd: retried, not failed; both complete."""
    c = connect_req(t, timeout=16, rnr_retry=1)
    p = c.iut_psn
    mark = post(c, wr("SEND", 16, wr_id=1, c=c), wr("SEND", 16, wr_id=2, c=c, offset=64))
    _first(c, mark, 2)
    m = c.send(rnr(c, p, 0, 1))
    r1 = requests(c, m, 2, 1.0)
    m2 = c.send(ack(c, p, 1))
    w1 = c.poll(1, 0.5)
    m3 = c.send(rnr(c, P.psn_add(p, 1), 1, 1))
    r2 = requests(c, m3, 1, 1.0, psn=P.psn_add(p, 1))
    c.send(ack(c, P.psn_add(p, 1), 2))
    w2 = c.poll(1, 0.5)
    ok = _psns(r1) == [p, P.psn_add(p, 1)] and bool(r2)
    t.check("MR-RNR-008", ok, f"after RNR 1: {_hex(_psns(r1))}; after RNR 2: {describe(r2)}", frames=r1 + r2 or [m2],
            expected=f"retry of {P.psn_add(p, 1):#08x} after the second RNR NAK")
    expect_wcs(t, ["MR-RNR-008", "MR-RNR-005"], w1 + w2, [(1, WC_OK), (2, WC_OK)], "both SENDs")


@case("TC-RNR-005-c", rules=["MR-RNR-005", "MR-RNR-002"], category="RNR", timeout=10)
def rnr_nak_acks_earlier(t):
    """A WRITE then a SEND; an RNR NAK at the SEND's PSN acknowledges the WRITE (it completes at once) and the
    IUT resends the SEND only."""
    c = connect_req(t, timeout=14)
    p = c.iut_psn
    mark = post(c, write_wr(c, 64, 1), wr("SEND", 16, wr_id=2, c=c, offset=128))
    _first(c, mark, 2)
    m = c.send(rnr(c, P.psn_add(p, 1), 1, 1))
    w1 = c.poll(1, 0.5)
    again = requests(c, m, 1, 1.0)
    c.send(ack(c, P.psn_add(p, 1), 2))
    w2 = c.poll(1, 0.5)
    expect_wcs(t, "MR-RNR-002", w1, [(1, WC_OK)], "WRITE acknowledged by the RNR NAK at the next PSN")
    t.check("MR-RNR-005", _psns(again) == [P.psn_add(p, 1)] and [w["status"] for w in w2] == [WC_OK],
            f"resent {describe(again)}; SEND completion {[w['status'] for w in w2]}", frames=again or [m + 1],
            expected=f"SEND_ONLY psn={P.psn_add(p, 1):#08x} again, then IBV_WC_SUCCESS")


# ---- what the requester sends (MR-ACK-013, MR-RC-009) ------------------------------------------------
@case("TC-ACK-013-a", rules=["MR-ACK-013"], category="ACK", timeout=10)
def ackreq_on_last_packets(t):
    """A 100-packet WRITE (path MTU 256), a SEND ONLY and a READ: AckReq on the last packet of each message and
    at least once in every 64 packets of the long one."""
    c = connect_req(t, mtu=256, timeout=14)
    p = c.iut_psn
    mark = post(c, write_wr(c, 25600, 1), wr("SEND", 16, wr_id=2, c=c, offset=30000),
                read_wr(c, 64, 3, offset=31000))
    firsts: dict[int, object] = {}
    for f in requests(c, mark, 102, 2.0):          # first transmissions only (a slow LT may see retries too)
        firsts.setdefault(f.roce.psn, f)
    reqs = [firsts[P.psn_add(p, k)] for k in range(102) if P.psn_add(p, k) in firsts]
    need(len(reqs) == 102, f"{len(reqs)} of the 102 request packets seen")
    c.send(ack(c, P.psn_add(p, 100), 2), *read_stream(c, P.psn_add(p, 101), pattern(64), 3))
    c.poll(3, 0.5)
    w = reqs[:100]
    probs = []
    if not w[-1].roce.ackreq:
        probs.append(f"WRITE LAST #{w[-1].num} without AckReq")
    if not reqs[100].roce.ackreq:
        probs.append("SEND ONLY without AckReq")
    if not reqs[101].roce.ackreq:
        probs.append("READ REQUEST without AckReq")
    marks = [i for i, f in enumerate(w) if f.roce.ackreq]
    gaps = [b - a for a, b in zip([-1] + marks, marks)]
    if gaps and max(gaps) > 64:
        probs.append(f"{max(gaps)} packets without AckReq")
    t.check("MR-ACK-013", not probs, "; ".join(probs) or f"AckReq at WRITE packets {marks}, SEND, READ",
            frames=[w[-1], reqs[100], reqs[101]], expected="AckReq on each last/only packet, every <= 64 packets")


@case("TC-RC-009-a", rules=["MR-RC-009"], category="ACK", timeout=10)
def max_rd_atomic_limits_reads(t):
    """max_rd_atomic 1: of two READs and a WRITE posted, only the first READ leaves until it is answered
    (the WRITE waits behind the second READ); then the second READ and the WRITE."""
    c = connect_req(t, timeout=16, max_rd_atomic=1)
    p = c.iut_psn
    mark = post(c, read_wr(c, 64, 1), read_wr(c, 64, 2, offset=128), write_wr(c, 32, 3, offset=256))
    first = _first(c, mark)
    more = [f for f in c.quiet(0.1, after=first[0].num) if f.roce.psn != p]
    m = c.send(*read_stream(c, p, pattern(64), 1))
    nxt = [f for f in requests(c, m, 2, 1.0)]
    c.send(*read_stream(c, P.psn_add(p, 1), pattern(64, 2), 2), ack(c, P.psn_add(p, 2), 3))
    wcs = c.poll(3, 1.0)
    ok = (not more and _psns(nxt) == [P.psn_add(p, 1), P.psn_add(p, 2)] and nxt[0].roce.op == 0x0C
          and [w["status"] for w in wcs] == [WC_OK] * 3)
    t.check("MR-RC-009", ok, f"while READ 1 outstanding: {describe(more)}; after its response: {describe(nxt)}; "
            f"completions {[w['status'] for w in wcs]}", frames=first + more + nxt,
            expected="nothing else while READ 1 is outstanding (the WRITE waits behind READ 2), then READ 2 "
                     "and the WRITE")


@case("TC-RC-013-a", rules=["MR-RC-013"], category="ACK", timeout=10)
def fence_waits_for_read(t):
    """A READ, then a WRITE with FENCE: the WRITE does not leave until the READ has completed; then it does."""
    c = connect_req(t, timeout=16)
    p = c.iut_psn
    mark = post(c, read_wr(c, 64, 1), write_wr(c, 8, 2, offset=256, flags=["SIGNALED", "FENCE"]))
    first = _first(c, mark)
    early = [f for f in c.quiet(0.15, after=first[0].num) if f.roce.psn != p]
    m = c.send(*read_stream(c, p, pattern(64), 1))
    later = requests(c, m, 1, 1.0, psn=P.psn_add(p, 1))
    if later:
        c.send(ack(c, P.psn_add(p, 1), 2))
    wcs = c.poll(2, 1.0)
    ok = not early and bool(later) and [w["status"] for w in wcs] == [WC_OK, WC_OK]
    t.check("MR-RC-013", ok, f"while the READ was outstanding: {describe(early)}; after its response: "
            f"{describe(later)}; completions {[w['status'] for w in wcs]}", frames=first + early + later,
            expected="the fenced WRITE only after the READ completed")


@case("TC-SEC-025-a", rules=["MR-SEC-025", "MR-RC-021"], category="ACK", timeout=10)
def ack_does_not_complete_a_read(t):
    """A READ answered by an ACK of its PSN (no data) is not completed; its READ RESPONSE then completes it with
    the data."""
    c = connect_req(t, timeout=16)
    p = c.iut_psn
    data = pattern(48, 21)
    mark = post(c, read_wr(c, 48, 1))
    _first(c, mark)
    m = c.send(ack(c, p, 1))
    early = c.poll(1, 0.2)
    c.send(*read_stream(c, p, data, 1))
    wcs = c.poll(1, 1.0)
    t.check("MR-SEC-025", not early, f"completions after the bare ACK: {[w['status'] for w in early]}",
            frames=[m + 1], expected="none")
    expect_wcs(t, "MR-RC-021", early + wcs, [(1, WC_OK)], "after the READ RESPONSE")
    t.check("MR-RC-021", c.mem(0, 48) == data, "READ data placed", expected="the 48 bytes placed")


@case("TC-ATOM-008-a", rules=["MR-ATOM-008", "MR-RC-005", "MR-RETRY-004", "MR-RC-021"], category="ATOM",
      caps=("ATOMICS",), timeout=10)
def atomic_requester(t):
    """FETCH_ADD and COMPARE_SWAP from the IUT: the AtomicETH carries the operands; a lost ATOMIC ACKNOWLEDGE gets
    the request resent unchanged; the original value lands in the 8-byte local buffer in host (little-endian)
    order and the completions are IBV_WC_FETCH_ADD and IBV_WC_COMP_SWAP."""
    c = connect_req(t, timeout=14)
    p = c.iut_psn
    mark = post(c, wr("ATOMIC_FETCH_AND_ADD", 8, wr_id=1, c=c, offset=0, remote_off=8, swap_add="0x5"),
                wr("ATOMIC_CMP_AND_SWP", 8, wr_id=2, c=c, offset=8, remote_off=16, compare="0x7",
                   swap_add="0x99"))
    orig = _first(c, mark, 2)
    again = requests(c, orig[1].num, 1, 1.0, psn=p)
    o1, o2 = 0x1122334455667788, 0x0102030405060708
    c.send(c.frame("ATOMIC_ACKNOWLEDGE", psn=p, aeth=(0x1F, 1), atomic_ack=o1),
           c.frame("ATOMIC_ACKNOWLEDGE", psn=P.psn_add(p, 1), aeth=(0x1F, 2), atomic_ack=o2))
    wcs = c.poll(2, 1.0)
    probs = []
    e1, e2 = orig[0].roce.headers.get("AtomicETH"), orig[1].roce.headers.get("AtomicETH")
    if orig[0].roce.op != 0x14 or e1 is None or int(e1.swap_add) != 5 or int(e1.va) != REMOTE_VA + 8:
        probs.append(f"FETCH_ADD request {orig[0].summary()}")
    if (orig[1].roce.op != 0x13 or e2 is None or int(e2.swap_add) != 0x99 or int(e2.compare) != 7
            or int(e2.va) != REMOTE_VA + 16):
        probs.append(f"COMPARE_SWAP request {orig[1].summary()}")
    mem = c.mem(0, 16)
    if mem != o1.to_bytes(8, "little") + o2.to_bytes(8, "little"):
        probs.append(f"local buffers {mem.hex()}")
    ops = [w.get("opcode") for w in wcs]
    if [w["status"] for w in wcs] != [WC_OK, WC_OK] or ops != ["IBV_WC_FETCH_ADD", "IBV_WC_COMP_SWAP"]:
        probs.append(f"completions {wcs}")
    t.check("MR-ATOM-008", not probs, "; ".join(probs) or "operands, results and completions as specified",
            frames=orig, expected="AtomicETH operands; orig little-endian in the local buffer; FETCH_ADD/COMP_SWAP")
    diff = same_request(orig[0], again[0]) if again else ["no retransmission"]
    t.check("MR-RC-005", not diff, "; ".join(diff) or "FETCH_ADD resent unchanged", frames=orig + again,
            expected=f"FETCH_ADD psn={p:#08x} again, unchanged")
    t.check("MR-RETRY-004", bool(again), f"retransmission: {describe(again)}", frames=orig + again,
            expected="the ATOMIC resent after the timeout")
    expect_wcs(t, "MR-RC-021", wcs, [(1, WC_OK), (2, WC_OK)], "after the ATOMIC ACKNOWLEDGEs")


@case("TC-NAK-012-e", rules=["MR-NAK-012", "MR-QP-025"], category="ACK", timeout=10)
def atomic_ack_for_a_read(t):
    """An ATOMIC ACKNOWLEDGE at the PSN of an RDMA READ: BAD_RESP_ERR for the READ, QP in ERR."""
    c = connect_req(t, timeout=14)
    _bad_response(t, c, lambda r: [c.frame("ATOMIC_ACKNOWLEDGE", psn=c.iut_psn, aeth=(0x1F, 1), atomic_ack=3)], 1,
                  [read_wr(c, 64, 1)], "ATOMIC ACKNOWLEDGE for a READ", ["MR-NAK-012"])


@case("TC-RC-006-a", rules=["MR-RC-006", "MR-RC-004", "MR-RC-003", "MR-ECN-001", "MR-ECN-004", "MR-QP-011",
                            "MR-RC-023"], category="SEQ", timeout=10)
def messages_in_order_not_interleaved(t):
    """A 3-packet SEND, a 3-packet WRITE, a 600-byte READ and a WRITE ONLY (path MTU 256): packets in posting
    order, not interleaved, opcodes by position, PSNs consecutive with the READ taking 3; every request
    packet DSCP 26 and ECT(0)."""
    c = connect_req(t, mtu=256, timeout=16)
    p = c.iut_psn
    mark = post(c, wr("SEND", 600, wr_id=1, c=c), write_wr(c, 600, 2, offset=1024), read_wr(c, 600, 3, offset=2048),
                write_wr(c, 8, 4, offset=4096))
    reqs = _first(c, mark, 8)
    want = [(0x00, 0), (0x01, 1), (0x02, 2), (0x06, 3), (0x07, 4), (0x08, 5), (0x0C, 6), (0x0A, 9)]
    got = [(f.roce.op, (f.roce.psn - p) & 0xFFFFFF) for f in reqs]
    c.send(ack(c, P.psn_add(p, 5), 2), *read_stream(c, P.psn_add(p, 6), pattern(600), 3), ack(c, P.psn_add(p, 9), 4))
    wcs = c.poll(4, 1.0)
    ok = got == want and [w["status"] for w in wcs] == [WC_OK] * 4
    det = "packets (opcode, PSN - sq_psn): " + ", ".join(f"({o:#04x}, {d})" for o, d in got)
    for r in ("MR-RC-006", "MR-RC-004", "MR-RC-003"):
        t.check(r, ok, det + f"; completions {[w['status'] for w in wcs]}", frames=reqs,
                expected="SEND F/M/L at 0-2, WRITE F/M/L at 3-5, READ at 6, WRITE ONLY at 9")
    t.check("MR-QP-011", bool(got) and got[0][1] == 0, f"first request PSN {reqs[0].roce.psn:#08x}, sq_psn {p:#08x}",
            frames=reqs[:1], expected="the first request at sq_psn")
    every = [f for f in c.quiet(0.0, after=mark)]
    odd = [f for f in every if f.roce.op not in P.OPS]
    t.check("MR-RC-023", not odd, f"opcodes sent: {sorted({f.roce.name for f in every})}", frames=odd or reqs[:1],
            expected="compat opcodes of Table 2-1 only")
    tos = sorted({f.roce.tos for f in reqs})
    t.check("MR-ECN-001", all(f.roce.ecn == 2 for f in reqs), f"TOS bytes {[hex(x) for x in tos]}", frames=reqs,
            expected="ECN ECT(0) (binary 10)")
    t.check("MR-ECN-004", all(f.roce.tos >> 2 == 26 for f in reqs), f"TOS bytes {[hex(x) for x in tos]}",
            frames=reqs, expected="DSCP 26 (TOS 0x6a)")


@case("TC-RC-022-a", rules=["MR-RC-022", "MR-QP-032", "MR-QP-023", "MR-QP-027"], category="ACK", timeout=10)
def local_sge_failure_sends_nothing(t):
    """A WRITE, then a READ into an MR without LOCAL_WRITE, then a WRITE: the first is sent and ACKed; the READ
    completes LOC_PROT_ERR without a packet of its own, the last is flushed and never sent; QP in ERR."""
    c = connect_req(t, timeout=16)
    p = c.iut_psn
    mr2 = t.reg_mr(c.pd, 4096, access=["REMOTE_READ"])[0]
    mark = post(c, write_wr(c, 8, 1), wr("RDMA_READ", 64, wr_id=2, mr=mr2), write_wr(c, 8, 3, offset=64))
    first = _first(c, mark)
    c.send(ack(c, p, 1))
    wcs = c.poll(3, 1.0)
    reqs = all_requests(c, mark)
    others = [f for f in reqs if f.roce.psn != p]
    expect_wcs(t, ["MR-QP-032", "MR-QP-023", "MR-QP-027"], wcs,
               [(1, WC_OK), (2, "IBV_WC_LOC_PROT_ERR"), (3, WC_FLUSH)], "READ into an MR without LOCAL_WRITE")
    t.check("MR-RC-022", not others and [w["status"] for w in wcs][1:2] == ["IBV_WC_LOC_PROT_ERR"],
            f"requests other than the first WRITE: {describe(others)}", frames=first + others,
            expected="nothing sent for the READ or after it")


@case("TC-ATOM-008-b", rules=["MR-ATOM-008"], category="ATOM", caps=("ATOMICS",), timeout=10)
def atomic_buffer_not_8_bytes(t):
    """A FETCH_ADD whose local buffer is 4 bytes is refused at post time with EINVAL, produces no completion and
    sends no ATOMIC request (MR-ATOM-008)."""
    c = connect_req(t, timeout=16)
    mark = t.lt.last_num()
    e = agent_error(lambda: t.agent.call("post_send", qp=c.qp, wr=wr("ATOMIC_FETCH_AND_ADD", 4, wr_id=1, c=c,
                                                                       swap_add="0x1")))
    wcs = c.poll(1, 0.3)
    sent = [f for f in c.quiet(0.1, after=mark) if f.roce.op in (0x13, 0x14)]
    ok = not sent and e == "EINVAL" and not wcs
    t.check("MR-ATOM-008", ok, f"post: {e or 'accepted'}; completion {[w['status'] for w in wcs]}; atomic "
            f"requests {describe(sent)}", frames=sent, expected="EINVAL at post, no completion, nothing sent")


@case("TC-RETRY-012-b", rules=["MR-RETRY-012"], category="ACK", timeout=10, timing=True)
def implied_nak_retry_deadline(t):
    """As TC-RETRY-012-a with timeout 16 (T = 268 ms): the READ REQUEST is sent again at the latest when the
    local ACK timer expires -- which MR-RETRY-003 allows from T up to 2T (a SHOULD) after it was last started,
    at the READ's transmission or at the implying ACK -- so no later than 2T plus the MR-CONF-011 tolerance
    after the ACK.  How soon is reported; retrying before T (MR-RETRY-015) is a SHOULD this case does not
    judge.  (A limit of T plus the tolerance judged the timer's own spread, which the spec leaves to the IUT:
    the reference endpoint's timers expire up to T/4 after T, so that timers armed in one round spread out.)"""
    c = connect_req(t, timeout=16)
    p = c.iut_psn
    mark = post(c, read_wr(c, 100, 1), write_wr(c, 64, 2, offset=512))
    _first(c, mark, 2)
    T = timeout_s(16)
    m = c.send(ack(c, P.psn_add(p, 1), 2))
    a = c.t.lt.wait(lambda f: f.outgoing and f.roce is not None and f.roce.op == 0x11, 0.2, after=m)
    limit = 2 * T + tolerance_s(t, 2 * T)
    again = requests(c, m, 1, limit + 0.05, psn=p)
    d = again[0].ts - a.ts if again and a is not None else None
    c.send(*read_stream(c, p, pattern(100, 5), 2), ack(c, P.psn_add(p, 1), 2))
    c.poll(2, 1.0)
    t.check("MR-RETRY-012", d is not None and d <= limit,
            f"READ REQUEST psn={p:#08x} again {'never' if d is None else f'{d * 1e3:.1f} ms'} after the ACK",
            frames=again or [m + 1], expected=f"within {limit * 1e3:.1f} ms (2T + tolerance)")


@case("TC-RETRY-015-a", rules=["MR-RETRY-015", "MR-RETRY-012"], category="ACK", timeout=10)
def ack_right_after_read_response_implies_nothing(t):
    """A READ then a WRITE; the LT answers the READ and ACKs the WRITE's PSN in one burst, the ACK right behind
    the READ RESPONSE: the responses are judged in arrival order, so the ACK implies no NAK -- both WQEs
    complete and the READ REQUEST is not sent again.  (Retrying at once after a real implied NAK, the SHOULD
    of MR-RETRY-015, is not judged.)"""
    c = connect_req(t, timeout=14)
    p = c.iut_psn
    data = pattern(100, 7)
    mark = post(c, read_wr(c, 100, 1), write_wr(c, 64, 2, offset=512))
    _first(c, mark, 2)
    m = c.send(*read_stream(c, p, data, 1), ack(c, P.psn_add(p, 1), 2))
    wcs = c.poll(2, 1.0)
    again = [f for f in c.quiet(0.2, after=m) if f.roce.op in P.OPS and f.roce.psn == p]
    ok = not again and [(w["wr_id"], w["status"]) for w in wcs] == [("0x1", WC_OK), ("0x2", WC_OK)]
    for r in ("MR-RETRY-015", "MR-RETRY-012"):
        t.check(r, ok, f"READ REQUEST sent again: {describe(again)}; completions {wcs}", frames=again or [m + 1],
                expected="no READ REQUEST again; READ and WRITE complete IBV_WC_SUCCESS")


@case("TC-RETRY-013-a", rules=["MR-RETRY-013", "MR-RETRY-008", "MR-RC-021"], category="RTO", timeout=10)
def old_read_stream_restarts_the_timer(t):
    """retry_cnt 1, timeout 16 (T = 268 ms): an 8-packet READ (path MTU 256) answered FIRST, then a gap, then the
    rest of the old stream trickling in every 100 ms for 0.4 s.  The gap may start a retry for the remainder; the
    late responses must neither use up the retry nor let the timer expire (each restarts it), so when the LT
    finally answers the READ asked again the READ completes with all its data."""
    c = connect_req(t, mtu=256, timeout=16, retry_cnt=1)
    p = c.iut_psn
    data = pattern(2048, 17)
    mark = post(c, read_wr(c, 2048, 1))
    (orig,) = _first(c, mark)
    s = read_stream(c, p, data, 1)
    rest = read_stream(c, P.psn_add(p, 1), data[256:], 1)   # built now: the answer must come within T of the
    c.send(s[0], s[2])                                        # last late response, on a loaded host too
    for k in range(3, 7):
        time.sleep(0.1)
        c.send(s[k])
    asked = [f for f in all_requests(c, orig.num) if f.roce.op == 0x0C]
    if not asked:       # no retry at the gap (a MAY): the timer, restarted by each late response, asks again
        asked = [f for f in requests(c, orig.num, 1, 2.0) if f.roce.op == 0x0C]
    rr = asked[-1] if asked else None
    if rr is not None and rr.roce.psn == P.psn_add(p, 1):
        c.send(*rest)
    elif rr is not None and rr.roce.psn == p:
        c.send(*s)
    wcs = c.poll(1, 1.0)
    ok = rr is not None and [w["status"] for w in wcs] == [WC_OK] and c.mem(0, 2048) == data
    det = (f"READ asked again: {describe(asked)}; completion {[w['status'] for w in wcs]}; data complete "
           f"{c.mem(0, 2048) == data}")
    for r in ("MR-RETRY-013", "MR-RC-021"):
        t.check(r, ok, det, frames=[orig] + asked, expected="the READ completes IBV_WC_SUCCESS with its 2048 bytes")
    t.check("MR-RETRY-008", rr is not None and rr.roce.psn in (p, P.psn_add(p, 1)), det, frames=[orig] + asked,
            expected=f"READ REQUEST at {p:#08x} (whole) or {P.psn_add(p, 1):#08x} (remainder)")


__all__: list[str] = []
