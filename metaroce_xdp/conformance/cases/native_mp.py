"""Native loss detection by time and its tolerance of reordering across entropy values (04-native.md 4.3.5, 4.5.3).

The LT gives the IUT requester one RTT sample it controls (a SACK held D0 = 3 ms, below the 4 ms rto_initial), so
that the IUT's min_rtt and SRTT are at least the RTT the LT measured, r0 (capture of the packet to capture of the
SACK: the IUT's own sample can only be longer), and its reordering window reo_wnd = min(max(min_rtt / 4,
reo_wnd_floor), srtt) is at least r0 / 4 on a fresh QP (reo_wnd_mult 1: no spurious retransmission was ever
detected).  Every later SACK of the LT has flags.N set: no further sample moves min_rtt or SRTT.  The tolerances
are the tester's: DELTA for what the IUT may add to an RTT or take to act on a SACK, JIT for capture jitter.

Also here: path selection after losses (TC-MP-008-a: two losses on one entropy value evict it, so it carries only
probes with AckReq; TC-MP-013-a: losses on every value leave one usable).
"""
from __future__ import annotations

import time

from .. import packets as P
from ..registry import case
from ._native import (CAP, WC_OK, connect_native, fpsn, is_req, need, peek, post, sent_at, summ, wait_requests,
                      wc_list, wr)

D0 = 0.003                  # s: the LT's hold of the SACK that gives the IUT its RTT sample
DELTA = 1.5e-3              # s: the IUT's own delays (stamp to wire, wire to timer) the tester allows
JIT = 0.2e-3                # s: capture jitter between two of the IUT's packets sent back to back
T_PEER = 5e-6               # s: the LT announces no ack_coalesce_us: the default T (MR-SACK-015)
MP = CAP["NATIVE"] | CAP["SACK"] | CAP["OOO_PLACEMENT"] | CAP["MULTIPATH"]


def _sack(c, trig, cum, received=(), **kw):
    from .native_req import _sack_for
    return _sack_for(c, trig, cum, received, **kw)


def _sleep_until(ts: float) -> None:
    d = ts - time.time()
    if d > 0:
        time.sleep(d)


def _first(frames) -> dict:
    out: dict = {}
    for f in frames:
        out.setdefault(fpsn(f), f)
    return out


def _burst_len(first: dict, q: int, n: int, within: float) -> int:
    """How many PSNs after q (up to n - 1) left within `within` s of q (their first transmissions)."""
    j = 0
    for i in range(1, n):
        f = first.get(P.psn_add(q, i))
        if f is None or f.ts - first[q].ts > within:
            break
        j = i
    return j


@case("TC-SACK-028-a", rules=["MR-SACK-028", "MR-MP-014", "MR-SACK-029"], category="SACK", caps=("MULTIPATH",),
      profile="native", timeout=40, timing=True)
def rack_time_rule(t):
    """K = 4.  After the RTT sample r0 (SACK held 3 ms), an 8-packet WRITE q..q+7: the LT sacks the j packets sent
    back to back after q (q+1..q+j, flags.N), leaving q the only hole.  rack_xmit_ts is q+j's transmission and
    rack_rtt the time since it, so q is lost at xmit(q) + rack_rtt + reo_wnd + T_peer: the SACK's arrival minus the
    gap between q and q+j plus reo_wnd + T_peer.  MR-SACK-028: the IUT retransmits q no earlier than the SACK +
    r0 / 4 - gap - JIT, and no later than the SACK + (r0 + DELTA) / 4 + DELTA + 1 ms (before the probe of 2 SRTT >=
    2 r0 = 6 ms would retransmit it).  MR-MP-014: with K > 1 no count rule -- j >= 3 = dup_thresh sacked after q
    must not make q lost at once (the lower bound) -- and a second 8-packet WRITE whose hole q' the LT fills 0.25 ms
    after sacking the packets after it (within reo_wnd >= 0.75 ms) is never retransmitted."""
    from .native_cc import _attempts
    res = _attempts(t, lambda: _rack_run(t))
    r0, srtt, j, gap, lo, hi, got, ts, first, trig, j2, ta, tb, rx2, wcs, first2 = res
    q = min(first, key=lambda x: first[x].ts)
    dt = (got.ts - ts) if got else None
    ok = got is not None and lo <= got.ts <= hi
    t.check("MR-SACK-028", ok, f"RTT sample {1e3 * r0:.2f} ms{srtt}; SACK of q+1..q+{j} (sent {1e6 * gap:.0f} us after "
            f"q); q retransmitted " + (f"{1e3 * dt:.2f} ms after the SACK" if got else "not within 30 ms"),
            frames=[first[q], trig] + ([got] if got else []),
            expected=f"q retransmitted {1e3 * (lo - ts):.2f} to {1e3 * (hi - ts):.2f} ms after the SACK "
                     f"(rack_rtt + reo_wnd + T_peer after its own transmission)")
    early_mp = got is not None and got.ts < lo
    t.check("MR-SACK-029", not early_mp, f"K = 4, {j} >= dup_thresh PSNs sacked after q: q retransmitted " +
            (f"{1e3 * dt:.2f} ms after the SACK" if got else "not within 30 ms"),
            frames=[first[q]] + ([got] if got else []),
            expected=f"no earlier than {1e3 * (lo - ts):.2f} ms after the SACK (K > 1: the count rule is not used)")
    t.check("MR-MP-014", not early_mp, f"K = 4, {j} PSNs sacked after q: q retransmitted " +
            (f"{1e3 * dt:.2f} ms after the SACK" if got else "not within 30 ms"),
            frames=[first[q]] + ([got] if got else []),
            expected=f"no earlier than {1e3 * (lo - ts):.2f} ms after the SACK (no count rule with K > 1)")
    q2 = min(first2, key=lambda x: first2[x].ts)
    t.check("MR-MP-014", not rx2 and [w["status"] for w in wcs] == [WC_OK],
            f"q' sacked around: q'+1..q'+{j2} sacked, then q' acknowledged {1e3 * (tb - ta):.2f} ms later: "
            f"retransmissions of q' {summ(rx2) or 'none'}; completion {wc_list(wcs)}",
            frames=[first2[q2]] + rx2, expected="no retransmission of q' (reordered by less than reo_wnd)")


def _rack_run(t):
    """One attempt of TC-SACK-028-a on a new QP (_Slow when the tester was too slow for the IUT's timers)."""
    from .native_cc import _slow
    c = connect_native(t, timeout=18, k=4, caps=MP)
    p = c.iut_psn
    # 1. the RTT sample
    mark = post(c, wr(c, "RDMA_WRITE", 64, wr_id=1))
    fr = wait_requests(c, mark, {p})
    need(fr, "the first WRITE was not sent")
    f0 = fr[0]
    _sleep_until(f0.ts + D0)
    mk = c.send(_sack(c, f0, p))
    ts0 = sent_at(c, mk)
    early = [f for f in c.quiet(0.0, after=mark) if fpsn(f) == p and f is not f0 and f.ts < ts0]
    _slow(not early, "the tester was too slow: the first WRITE was retransmitted before its SACK: " + summ(early))
    r0 = ts0 - f0.ts
    wcs = c.poll(1, 1.0)
    need([w["status"] for w in wcs] == [WC_OK], f"the first WRITE: {wc_list(wcs)}")
    st = c.native_counters() or {}
    srtt = f", the IUT reports srtt {st['srtt_us']} us" if "srtt_us" in st else ""
    # 2. the time rule
    q = P.psn_add(p, 1)
    mark = post(c, wr(c, "RDMA_WRITE", 8 * 1024, wr_id=2, remote_off=4096))
    fr = wait_requests(c, mark, {P.psn_add(q, i) for i in range(8)})
    first = _first(fr)
    need(len(first) >= 8, f"the 8-packet WRITE: {summ(fr)}")
    j = _burst_len(first, q, 8, 0.1e-3)
    need(j >= 1, "q+1 did not follow q within 0.1 ms: " + summ(fr[:2]))
    gap = first[P.psn_add(q, j)].ts - first[q].ts
    trig = first[P.psn_add(q, j)]
    mk = c.send(_sack(c, trig, p, received={P.psn_add(q, i) for i in range(1, j + 1)}, n=True, tsecr=0))
    ts = sent_at(c, mk)
    pre = [f for f in c.quiet(0.0, after=mark) if fpsn(f) == q and f is not first[q] and f.ts < ts]
    _slow(not pre, "the tester was too slow: q was retransmitted before the SACK: " + summ(pre))
    rx = c.t.lt.collect(lambda f: c.is_mine(f) and fpsn(f) == q and f.ts > ts, 0.03, after=mk,
                        until=lambda fs: bool(fs))
    lo = ts + max(r0 / 4, 10e-6) + T_PEER - gap - JIT
    hi = ts + max((r0 + DELTA) / 4, 10e-6) + T_PEER + DELTA + 1e-3
    got = rx[0] if rx else None
    last = first[P.psn_add(q, 7)]
    c.send(_sack(c, last, P.psn_add(q, 7), n=True, tsecr=0))
    wcs = c.poll(1, 2.0)
    need([w["status"] for w in wcs] == [WC_OK], f"the 8-packet WRITE: {wc_list(wcs)}")
    # 3. reordering within reo_wnd: no retransmission
    q2 = P.psn_add(q, 8)
    time.sleep(0.01)
    mark = post(c, wr(c, "RDMA_WRITE", 8 * 1024, wr_id=3, remote_off=16384))
    fr = wait_requests(c, mark, {P.psn_add(q2, i) for i in range(8)})
    first2 = _first(fr)
    need(len(first2) >= 8, f"the second 8-packet WRITE: {summ(fr)}")
    j2 = _burst_len(first2, q2, 8, 0.1e-3)
    need(j2 >= 1, "q'+1 did not follow q' within 0.1 ms: " + summ(fr[:2]))
    gap2 = first2[P.psn_add(q2, j2)].ts - first2[q2].ts
    a = _sack(c, first2[P.psn_add(q2, j2)], P.psn_add(q2, -1),
              received={P.psn_add(q2, i) for i in range(1, j2 + 1)}, n=True, tsecr=0)
    b = _sack(c, first2[P.psn_add(q2, 7)], P.psn_add(q2, 7), n=True, tsecr=0)
    mka = c.send(a)
    t_a = time.time()
    while time.time() < t_a + 0.25e-3:      # spin: a sleep this short can wake a scheduler tick (4 ms) late
        pass
    mkb = c.send(b)
    ta = sent_at(c, mka)
    tb = sent_at(c, mkb)
    _slow(tb - ta < r0 / 4 - gap2 - 0.1e-3, f"the tester was too slow: the SACK filling the hole went "
          f"{1e3 * (tb - ta):.2f} ms after the one that opened it (reo_wnd >= {1e3 * r0 / 4:.2f} ms)")
    wcs = c.poll(1, 2.0)
    rx2 = [f for f in c.quiet(0.03, after=mark) if c.is_mine(f) and fpsn(f) == q2 and f is not first2[q2]]
    pre2 = [f for f in rx2 if f.ts < ta]
    _slow(not pre2, "the tester was too slow: q' was retransmitted before the LT's first SACK reached it: "
          + summ(pre2))
    return r0, srtt, j, gap, lo, hi, got, ts, first, trig, j2, ta, tb, rx2, wcs, first2


@case("TC-MP-008-a", rules=["MR-MP-008", "MR-MP-009", "MR-MP-010"], category="MP", caps=("MULTIPATH",),
      profile="native", timeout=40, timing=True)
def two_losses_evict_a_value(t):
    """K = 4, W 64, a 240-packet WRITE of 256-byte packets.  The LT holds its first SACK 2 ms (the RTT sample), then
    sacks the initial window but for the first two packets sent on one entropy value e (offset 0's UDP source port):
    both are holes sent before packets it sacks, so the time rule (MR-SACK-028) makes them lost within about
    reo_wnd, and MR-MP-008 attributes both losses to e: two within mp_evict_window (1 ms) evict it (MR-MP-009).
    From then on the LT acknowledges everything it receives, never echoing e.  MR-MP-010: an EVICTED value carries
    no new data, and once PROBING at most one packet per srtt, with AckReq -- and no SACK echoing e ever returns
    it to ACTIVE -- so every new PSN sent on e after the first retransmission of a hole (which follows the losses)
    carries AckReq.  An IUT that kept e ACTIVE or PENALIZED would send e ordinary data packets (AckReq clear) among
    the 20 or more new ones the case waits for.  (An IUT that replaces e with a fresh value, MR-MP-011, sends
    nothing more on e and passes.)"""
    r = _mp_losses(t, lambda port: [x for x in range(16) if port[x] == port[0]][:2])
    e, holes, after, t_l, ts1, seen = r["e"][0], r["holes"], r["after"], r["t_l"], r["ts1"], r["seen"]
    on_e = [(x, f) for x, f in after if peek(f)[5] == e]
    plain = [(x, f) for x, f in on_e if not peek(f)[3] and x != r["n"] - 1]
    before = [x for x in sorted(seen) if x >= 16 and seen[x][0].ts <= t_l and peek(seen[x][0])[5] == e]
    detail = (f"value {e:#06x}: holes +{holes}, first retransmitted {1e3 * (t_l - ts1):.2f} ms after the SACK; "
              f"{len(after)} new PSNs after it, {len(on_e)} on {e:#06x} (+{[x for x, _ in on_e]}), "
              f"{len(plain)} of them without AckReq; before it on {e:#06x}: +{before}")
    ok = not plain
    for rule in ("MR-MP-008", "MR-MP-009", "MR-MP-010"):
        t.check(rule, ok, detail, frames=[f for _, f in plain[:4]] or [f for _, f in after[:2]],
                expected=f"no ordinary data on {e:#06x} once its two losses were declared (EVICTED, then PROBING: "
                         f"probes with AckReq only)")
    r["finish"]()


@case("TC-MP-013-a", rules=["MR-MP-013"], category="MP", caps=("MULTIPATH",), profile="native", timeout=40,
      timing=True)
def one_value_stays_usable(t):
    """As TC-MP-008-a, but the LT's first SACK leaves as holes the first two packets of every one of the K = 4
    entropy values (the rest of the initial window sacked): each value has two losses within mp_evict_window, so
    each would be EVICTED (MR-MP-009), and MR-MP-013 keeps one ACTIVE.  The LT then acknowledges everything,
    echoing none of the four values.  After the first retransmission of a hole, new data keeps flowing -- at least
    10 ordinary packets (AckReq clear) among the new PSNs -- and every ordinary packet is on one and the same value;
    the others carry probes (AckReq) at most.  An IUT that evicted all four would send no ordinary data; one that
    evicted none would spread it over several values."""
    r = _mp_losses(t, lambda port: sorted(x for v in set(port.values())
                                          for x in [y for y in range(16) if port[y] == v][:2]))
    after, t_l, ts1, holes = r["after"], r["t_l"], r["ts1"], r["holes"]
    plain = [(x, f) for x, f in after if not peek(f)[3] and x != r["n"] - 1]
    ports = sorted({peek(f)[5] for _, f in plain})
    detail = (f"values {[hex(x) for x in r['e']]}: holes +{holes}, first retransmitted {1e3 * (t_l - ts1):.2f} ms "
              f"after the SACK; {len(after)} new PSNs after it, {len(plain)} ordinary (AckReq clear) on "
              f"{[hex(x) for x in ports]}")
    t.check("MR-MP-013", len(plain) >= 10 and len(ports) == 1, detail,
            frames=[f for _, f in plain[:4]] or [f for _, f in after[:2]],
            expected="10 or more ordinary new packets, all on one value")
    r["finish"]()


def _mp_losses(t, choose) -> dict:
    """TC-MP-008-a and TC-MP-013-a: K = 4, W 64, a 240-packet WRITE of 256-byte packets; the initial window's
    offsets chosen by choose(port: offset -> UDP source port) are left as holes by the LT's first SACK (held 2 ms,
    echoing none of their values); then the LT acknowledges everything else until a hole is retransmitted (t_l),
    then everything, until 40 new PSNs came after t_l or 60 ms passed.  Returns c, p, n, e (the holes' values),
    holes, ts1 (the first SACK), t_l, seen (offset -> its frames), after ((offset, first frame) of the new PSNs first
    sent after t_l) and finish() (acknowledges the rest of the WRITE)."""
    from .native_cc import _attempts, _slow
    mtu, n, w = 256, 240, 64
    box: dict = {}

    def start():
        c = connect_native(t, mtu=mtu, w=w, timeout=18, k=4, caps=MP)
        p = c.iut_psn
        mark = post(c, wr(c, "RDMA_WRITE", n * mtu, wr_id=1))
        fr = c.t.lt.collect(lambda f: c.is_mine(f) and is_req(f), 0.05, after=mark,
                            until=lambda fs: len({fpsn(f) for f in fs}) >= 16)
        first = _first(fr)
        rel = {(q - p) & 0xFFFFFF: f for q, f in first.items()}
        _slow(sorted(rel) == list(range(16)), f"the initial window: offsets {sorted(rel)}")
        t0 = rel[0].ts
        port = {x: peek(f)[5] for x, f in rel.items()}
        holes = choose(port)
        es = sorted({port[x] for x in holes})
        need(holes and max(holes) < 15 and all(len([x for x in holes if port[x] == v]) >= 2 for v in es),
             f"ports of the initial window {[hex(port[x]) for x in range(16)]}: no two holes per value before "
             f"offset 15 ({holes})")
        trig = rel[15]
        others = [v for v in port.values() if v not in es]
        echo = others[0] if others else 0
        _sleep_until(t0 + 0.002)
        mk = c.send(_sack(c, trig, P.psn_add(p, -1), received={P.psn_add(p, x) for x in range(1, 16) if x not in holes},
                          echo_sport=echo))
        ts1 = sent_at(c, mk)
        early = [f for f in c.quiet(0.0, after=mark) if c.is_mine(f) and is_req(f) and f.ts < ts1
                 and ((fpsn(f) - p) & 0xFFFFFF) < 16 and f is not first.get(fpsn(f))]
        _slow(not early, "the tester was too slow: the IUT retransmitted before the first SACK: " + summ(early[:2]))
        box.update(c=c, p=p, mark=mark, e=es, holes=holes, echo=echo)
        return ts1
    ts1 = _attempts(t, start)
    c, p, es, holes, echo = box["c"], box["p"], box["e"], box["holes"], box["echo"]
    seen: dict[int, list] = {}
    mk = box["mark"]
    t_l = None
    end = time.monotonic() + 0.06
    hole_psns = {P.psn_add(p, x) for x in holes}
    top = 15
    while time.monotonic() < end:
        fs = c.t.lt.collect(lambda f: c.is_mine(f) and is_req(f), 0.001, after=mk)
        if not fs:
            continue
        mk = fs[-1].num
        for f in fs:
            x = (fpsn(f) - p) & 0xFFFFFF
            seen.setdefault(x, []).append(f)
            if fpsn(f) in hole_psns and f.ts > ts1 and t_l is None:
                t_l = f.ts
        top = max(seen)
        trig = next((f for f in reversed(fs) if peek(f)[5] not in es), fs[-1])
        if t_l is None:
            c.send(_sack(c, trig, P.psn_add(p, -1), received={P.psn_add(p, x) for x in seen if x not in holes},
                         echo_sport=echo))
        else:
            c.send(_sack(c, trig, P.psn_add(p, top), echo_sport=echo))
        if t_l is not None and len([x for x in seen if x >= 16 and seen[x][0].ts > t_l]) >= 40:
            break
    need(t_l is not None, f"the holes +{holes} were not retransmitted within 60 ms")
    after = [(x, seen[x][0]) for x in sorted(seen) if x >= 16 and seen[x][0].ts > t_l]
    need(len(after) >= 20, f"only {len(after)} new PSNs after the losses")

    def finish():
        nonlocal mk, top
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            fs = c.t.lt.collect(lambda f: c.is_mine(f) and is_req(f), 0.01, after=mk)
            if fs:
                mk = fs[-1].num
                top = max([top] + [(fpsn(f) - p) & 0xFFFFFF for f in fs])
                c.send(_sack(c, fs[-1], P.psn_add(p, top), echo_sport=echo))
                if top >= n - 1:
                    break
        c.poll(1, 1.0)
    return dict(c=c, p=p, n=n, e=es, holes=holes, ts1=ts1, t_l=t_l, seen=seen, after=after, finish=finish)
