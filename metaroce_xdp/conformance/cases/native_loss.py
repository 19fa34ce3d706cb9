"""Native requester timers: the tail-loss probe, the RTO and its back-off, the retry budget (04-native.md 4.6).

The tolerances are the tester's (TOL below), never the IUT's declared timer granularity: a probe or a
retransmission is judged against the times the tester can compute from what it sent and saw -- the RTT sample
it gave the IUT (from the capture times of the packet whose TSval its SACK echoed and of the SACK itself), the
intervals between the IUT's own retransmissions.
"""
from __future__ import annotations

import time

from .. import native_packets as N
from .. import packets as P
from ..registry import case
from ._native import (WC_FLUSH, check_wcs, connect_native, fpsn, need, nv, op, post, sent_at, summ,
                      wait_requests, wr)

TOL_ABS = 1.5e-3            # s: the tester's allowance for both ends' scheduling (not the IUT's granularity)
TOL_REL = 0.10              # and 10 % of the nominal time (MR-CONF-011's relative part)
IUT_DELAY = 1.0e-3          # s: what the IUT may add to the LT's RTT sample (its receive path to its timers)


def tol(nominal: float) -> float:
    return max(TOL_REL * nominal, TOL_ABS)


def _sack_for(c, trig, cum, received=(), **kw):
    from .native_req import _sack_for as f
    return f(c, trig, cum, received, **kw)


@case("TC-LOSS-010-a", rules=["MR-LOSS-010", "MR-LOSS-011", "MR-NAT-023"], category="RTO", profile="native",
      timeout=30, timing=True)
def tail_loss_probe(t):
    """09 9.3.4: the LT acknowledges the first two packets with one SACK, the last two are "lost" and nothing
    more comes: the IUT retransmits the fourth (AckReq, RETX) once, between 2 x SRTT and the RTO after its last
    transmission, and sends no second probe before the RTO.

    The four packets are two 2-packet WRITEs, the second posted once the SACK for the first arrived: sent in one
    burst, the last two would share the first two's transmit time and RACK (MR-SACK-028) would rightly declare
    them lost a quarter RTT after the SACK -- no tail the probe is for (the spec's text, one 4-packet WRITE,
    overlooks it)."""
    for attempt in range(3):        # a QP whose first packets left later than the IUT stamped them: a new one
        c = connect_native(t, timeout=18)
        p = c.iut_psn
        mark = post(c, wr(c, "RDMA_WRITE", 2048, wr_id=1))
        fr = wait_requests(c, mark, {p, P.psn_add(p, 1)})
        first = {}
        for f in fr:
            first.setdefault(fpsn(f), f)
        need(len(first) == 2, f"the first WRITE's packets: {summ(fr)}")
        trig = first[P.psn_add(p, 1)]
        mark_s = c.send(_sack_for(c, trig, P.psn_add(p, 1)))
        t_sack = sent_at(c, mark_s)
        early = [f for f in c.quiet(0.0, after=mark) if not f.outgoing and nv(f).neth is not None
                 and nv(f).neth.retx and f.ts < t_sack]
        if not early:
            break
    need(not early, "the tester was too slow: the IUT retransmitted (its initial RTO) before the SACK: "
         + summ(early[:2]))
    r = t_sack - trig.ts                            # the RTT sample the IUT takes, as the LT sees it
    need(c.poll(1, 1.0), "the first WRITE did not complete")
    time.sleep(0.02)                                # idle between the two: the probe's clock starts at WR 2
    mark2 = post(c, wr(c, "RDMA_WRITE", 2048, wr_id=2, remote_off=8192))
    fr2 = wait_requests(c, mark2, {P.psn_add(p, 2), P.psn_add(p, 3)})
    tail = [f for f in fr2 if fpsn(f) in (P.psn_add(p, 2), P.psn_add(p, 3))]
    need(len(tail) >= 2, f"the second WRITE's packets: {summ(fr2)}")
    t_last = max(f.ts for f in tail[:2])
    d = t.caps.get("defaults", {})
    rto_min = float(d.get("rto_min_us") or 50) * 1e-6
    g = float(t.hello.get("timer_granularity_us") or 0) * 1e-6   # only to widen the upper bound
    pto_lo = 2 * r
    rto_hi = max(3 * (r + IUT_DELAY), r + IUT_DELAY + g, rto_min)
    horizon = rto_hi + tol(rto_hi) + 0.03
    rx = c.t.lt.collect(lambda f: c.is_mine(f) and op(f) == N.NATIVE_WRITE and f.ts > t_last, horizon, after=mark2)
    probe = rx[0] if rx else None
    pv = nv(probe) if probe else None
    dt = (probe.ts - t_last) if probe else None
    st = c.native_counters() or {}
    state = (f"; the IUT reports srtt {st['srtt_us']} us, rto {st['rto_us']} us" if "srtt_us" in st else "")
    ok = (pv is not None and pv.psn == P.psn_add(p, 3) and pv.ackreq and pv.neth.retx
          and pto_lo - tol(pto_lo) <= dt <= rto_hi + tol(rto_hi))
    exp = (f"NATIVE_WRITE psn {P.psn_add(p, 3):#08x} with AckReq and RETX, {1e3 * (pto_lo - tol(pto_lo)):.2f} to "
           f"{1e3 * (rto_hi + tol(rto_hi)):.2f} ms after the last transmission (RTT sample {1e3 * r:.2f} ms)")
    t.check("MR-LOSS-010", ok, f"first retransmission: {summ([probe]) if probe else 'none'}"
            + (f", {1e3 * dt:.2f} ms after the last transmission" if dt is not None else "") + state,
            frames=[probe] if probe else tail, expected=exp)
    # the RTO shows as the retransmission of the lowest outstanding PSN; before it, no second probe (the highest
    # again)
    rto_tx = next((f for f in rx if fpsn(f) == P.psn_add(p, 2)), None)
    t_rto = rto_tx.ts if rto_tx is not None else t_last + horizon
    second = [f for f in rx[1:] if fpsn(f) == P.psn_add(p, 3) and f.ts < t_rto]
    t.check("MR-LOSS-011", probe is not None and not second,
            f"probes before the RTO retransmission ({summ([rto_tx]) if rto_tx else 'none within the horizon'}): "
            f"{summ(second) or 'no second probe'}", frames=second or ([probe] if probe else tail),
            expected=f"one probe of {P.psn_add(p, 3):#08x}, then nothing until the RTO retransmits "
                     f"{P.psn_add(p, 2):#08x}")
    t.check("MR-NAT-023", pv is not None and pv.ackreq, f"the probe: {summ([probe]) if probe else 'none'}",
            frames=[probe] if probe else tail, expected="AckReq set on the tail-loss probe")
    c.send(_sack_for(c, rx[-1] if rx else tail[-1], P.psn_add(p, 3)))
    c.poll(1, 1.0)


@case("TC-LOSS-007-a", rules=["MR-LOSS-007", "MR-LOSS-009", "MR-LOSS-005", "MR-NAT-023"], category="RTO",
      profile="native", timeout=30, timing=True)
def rto_backoff_and_retry_budget(t):
    """A WRITE that is never answered (retry_cnt 6, timeout 14: rto_max 67.1 ms): the IUT retransmits it with AckReq
    at RTO intervals that double up to rto_max, six times, then completes it IBV_WC_RETRY_EXC_ERR (a later WR
    flushed) and the QP is in ERR."""
    retry = 6
    c = connect_native(t, timeout=14, retry_cnt=retry)
    rto_max = max(4.096e-6 * (1 << 14), float(t.caps.get("defaults", {}).get("rto_min_us") or 50) * 1e-6)
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_WRITE", 64, wr_id=1), wr(c, "RDMA_WRITE", 64, wr_id=2, remote_off=4096))
    fr = wait_requests(c, mark, {p})
    need(fr, "the WRITE was not sent")
    t0 = fr[0].ts
    wcs = c.poll(2, 4.0)
    txs = [f for f in c.quiet(0.05, after=mark) if c.is_mine(f) and fpsn(f) == p]
    retx = txs[1:]
    times = [f.ts for f in retx]            # intervals between retransmissions: the first transmission may leave
    ivs = [b - a for a, b in zip(times, times[1:])]     # an idle IUT later than it was built
    detail = (f"{len(retx)} retransmissions of PSN {p:#08x}, intervals "
              f"{', '.join(f'{1e3 * x:.1f}' for x in ivs)} ms; completions {[(w['wr_id'], w['status']) for w in wcs]}")
    # the back-off: each interval twice the one before (within the tolerance) until rto_max, then rto_max
    bad = []                 # doubling (MR-LOSS-007); the cap at rto_max is MR-LOSS-005's, judged below
    for i in range(1, len(ivs)):
        want = 2 * ivs[i - 1]
        if abs(ivs[i] - want) > tol(want) and abs(ivs[i] - rto_max) > tol(rto_max):
            bad.append(f"interval {i + 1}: {1e3 * ivs[i]:.1f} ms, expected {1e3 * want:.1f} or rto_max")
    t.check("MR-LOSS-007", bool(ivs) and not bad and all(nv(f).ackreq and nv(f).neth.retx for f in retx),
            detail + ("; " + "; ".join(bad) if bad else ""), frames=txs,
            expected="retransmissions with AckReq and RETX, each RTO twice the previous (or rto_max)")
    t.check("MR-LOSS-005", bool(ivs) and max(ivs) <= rto_max + tol(rto_max),
            f"largest interval {1e3 * max(ivs or [0]):.1f} ms", frames=txs,
            expected=f"at most rto_max = 4.096 us x 2^14 = {1e3 * rto_max:.1f} ms (+ {1e3 * tol(rto_max):.1f})")
    t.check("MR-NAT-023", all(nv(f).ackreq for f in retx), summ(retx[:3]), frames=retx,
            expected="AckReq on every RTO retransmission")
    ok = len(retx) == retry
    check_wcs(t, "MR-LOSS-009", wcs, [(1, "IBV_WC_RETRY_EXC_ERR"), (2, WC_FLUSH)], detail, frames=txs)
    t.check("MR-LOSS-009", ok and c.query()["state"] == "ERR", detail, frames=txs,
            expected=f"exactly {retry} retransmissions (retry_cnt {retry}), then RETRY_EXC_ERR and the QP in ERR")
