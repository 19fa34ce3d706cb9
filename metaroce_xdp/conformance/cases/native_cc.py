"""Native sender congestion control and timers observable on the wire (05-congestion.md 5.2 to 5.3.6, 04-native.md
4.6.2 and 4.6.3): the LT plays the responder of an IUT requester, answers its WRITE packets with NATIVE_SACKs it
crafts -- when it chooses, with the losses, CE counts and echoes it chooses -- and counts what the IUT puts in
flight.

Windows are judged by counting: the IUT must not have more PSNs in flight than its window allows (MR-CC-001), so
after a SACK that leaves nothing in flight, the number of distinct PSNs it transmits before the LT answers again
is bounded by the window the rules give it.  The tester computes that window from the spec's arithmetic and its
defaults (05 5.7.1: init_cwnd 16, ai 1, max_mdf 0.5, alpha_init 1, g_ecn 1/16, rto_cwnd_reset 2, min_cwnd 0.01);
where two readings of the pseudocode's order are possible it takes the larger window.  Only upper bounds are
judged: how fast the IUT paces within its window is a SHOULD (MR-CC-004), so counting stops before the IUT's
tail-loss probe can fire -- 2 x its SRTT after its last transmission (MR-LOSS-010), and its SRTT is at least the RTT
the LT gave it: the time from the capture of the packet whose TSval the SACK echoed to the capture of the SACK.
A probe inside the count all the same (an IUT whose samples come out short) ends it and is not counted: probes are
exempt from the window (MR-CC-003).

To keep that window wide the LT holds its first SACK for D1 = 2 ms (below the IUT's 4 ms rto_initial, MR-LOSS-004),
so the IUT's SRTT is about 2 ms and nothing the tester does takes a meaningful fraction of it.  CC_DELAY is not
agreed (connect_native's caps): MR-CC-010 then grows the window on every SACK whatever its RTT sample, and
MR-CC-044 makes every loss on a QP that has seen no CE a congestion signal for MR-CC-022.

Also here: the requester's timers as the LT sees them or the agent reports them (TC-LOSS-003-a: SRTT, RTTVAR and RTO
from get_counters qp srtt_us / rto_us after SACKs with RTTs the LT chose; TC-LOSS-008-a: the retry counter), the
native drain of SQD (TC-NAT-027-a) and the capability rule of the negotiation (TC-NAT-004-a, through cm_listen).
A case whose precondition the tester spoilt (a SACK too late for the IUT's 4 ms rto_initial on a loaded host)
starts again on a new QP, up to 3 times, before it says ERROR.
"""
from __future__ import annotations

import math
import time

from .. import native_packets as N
from .. import packets as P
from ..context import CannotDrive, CaseError
from ..registry import case
from ._native import (CAP, WC_OK, NConn, check_wcs, connect_native, fpsn, is_req, need, nv, peek, post, sent_at,
                      summ, wait_requests, wc_list, wr)

MTU = 256                    # small packets: 120 of them are one 30 KiB WRITE
NPKT = 120
W = 64                       # the window W never binds below (init_cwnd 16 < W)
INIT_CWND, AI, MAX_MDF, G_ECN, MIN_CWND = 16.0, 1.0, 0.5, 1 / 16, 0.01     # 05 5.7.1 defaults
INIT_CREDIT = 16
D1 = 0.002                   # s: how long the LT holds its first SACK (the IUT's first RTT sample)
PTO_SHARE = 1.9              # count for at most this many RTTs (the LT's) after an event: before any probe
SLACK = 10e-3                # s: TC-LOSS-003-a's allowance for the IUT's delays on its samples (above r)
LAG = 0.03                   # s: how far the LT's capture thread may run behind its kernel time stamps


class _Slow(CaseError):
    """The tester (or a loaded host) spoilt a precondition: the case starts again on a new QP (3 attempts)."""


def _slow(cond: bool, why: str) -> None:
    if not cond:
        raise _Slow(why)


def _attempts(t, fn):
    """fn() up to 3 times while it raises _Slow; the last _Slow is raised (ERROR: the tester was too slow)."""
    for k in range(3):
        try:
            return fn()
        except _Slow:
            if k == 2:
                raise


def _in_flight_max(cwnd: float) -> int:
    """The most PSNs a sender can have in flight with window cwnd (it sends while in flight < max(cwnd, 1))."""
    return max(1, math.ceil(max(cwnd, 1.0) - 1e-9))


def _rel(p: int, f) -> int:
    return (fpsn(f) - p) & 0xFFFFFF


def _reqs(c, after: int, duration: float, until=None):
    return c.t.lt.collect(lambda f: c.is_mine(f) and is_req(f), max(0.0, duration), after=after, until=until)


def _sleep_until(ts: float) -> None:
    d = ts - time.time()
    if d > 0:
        time.sleep(d)


def _sack(c, trig, cum: int, received=(), **kw) -> bytes:
    from .native_req import _sack_for
    return _sack_for(c, trig, cum, received, **kw)


class _Flow:
    """One NPKT-packet WRITE of the IUT and what the LT saw of it: first transmissions by PSN offset (sent), every
    request frame in capture order (frames)."""

    def __init__(self, t, *, caps=None, w: int = W):
        self.t = t
        self.c = connect_native(t, mtu=MTU, w=w, timeout=18, caps=caps)
        self.p = self.c.iut_psn
        self.mark = post(self.c, wr(self.c, "RDMA_WRITE", NPKT * MTU, wr_id=1))
        self.sent: dict[int, object] = {}
        self.frames: list = []
        self.notes: list[str] = []

    def add(self, frames) -> None:
        for f in frames:
            self.frames.append(f)
            self.sent.setdefault(_rel(self.p, f), f)

    def send_checked(self, frame: bytes, what: str) -> tuple[int, float]:
        """Send the LT's next SACK; returns (capture mark, capture time).  A retransmission the IUT sent before it
        -- a timer that expired while the tester was slow to send it -- spoils the case's precondition: _Slow, and
        the case starts again (a window counted after it would judge the RTO's window, not the SACK's)."""
        c = self.c
        mk = c.send(frame)
        ts = sent_at(c, mk)
        firsts: set[int] = set()
        early = []
        for f in c.quiet(0.0, after=self.mark):
            if is_req(f) and f.ts < ts:
                r = _rel(self.p, f)
                if r in firsts:
                    early.append(f)
                firsts.add(r)
        if early:
            self.drain()
        _slow(not early, f"the tester was too slow: the IUT retransmitted before {what}: " + summ(early[:2]))
        return mk, ts

    def initial_burst(self, horizon: float = 0.0035, want: int | None = None):
        """The first transmissions before the first retransmission, within `horizon` s of the first packet (the IUT
        retransmits after rto_initial, 4 ms, without a SACK), or until `want` distinct PSNs were seen.  Returns
        (distinct offsets in order, the first retransmission or None, capture time of the first packet)."""
        c = self.c
        first = _reqs(c, self.mark, 3.0, until=lambda fs: bool(fs))
        need(first, "the WRITE was not sent")
        t0 = first[0].ts

        def stop(fs):
            s: set[int] = set()
            for f in fs:
                r = _rel(self.p, f)
                if r in s:
                    return True
                s.add(r)
            return want is not None and len(s) >= want
        fr = _reqs(c, self.mark, t0 + horizon - time.time() + LAG, until=stop)
        order, retx, s = [], None, set()
        for f in fr:
            if f.ts > t0 + horizon:
                break
            r = _rel(self.p, f)
            if r in s:
                retx = f
                break
            s.add(r)
            order.append(r)
        self.add(fr if retx is None else fr[:fr.index(retx)])
        return order, retx, t0

    def prime(self):
        """The common start of the window cases: the initial window (16 packets, offsets 0 to 15), then the LT's
        first SACK D1 after the first packet, cumulative through offset 15 (nothing left in flight), echoing offset
        15's TSval: cwnd1 = 16 + 16 / 16 = 17.  Then the new PSNs the IUT sends for 1.4 RTTs (at most 17,
        MR-CC-001).  (The first SACK leaves no hole: a packet left in flight from the initial burst was sent in
        the microsecond of the last one acknowledged, so the time rule, MR-SACK-028, would rightly make it lost.)
        Returns (t_sack1, r1 = the LT's RTT of that sample, new offsets in order)."""
        order, retx, t0 = self.initial_burst(D1 * 0.9, want=int(INIT_CWND))
        _slow(len(order) == int(INIT_CWND) and retx is None, f"the initial window is not {int(INIT_CWND)} packets "
             f"within {0.9e3 * D1:.1f} ms (offsets {order}; see TC-CC-005-a)")
        c, p = self.c, self.p
        trig = self.sent[15]
        _sleep_until(t0 + D1)
        mk = c.send(_sack(c, trig, P.psn_add(p, 15)))
        ts1 = sent_at(c, mk)
        first = set(id(f) for f in self.sent.values())
        early = [f for f in c.quiet(0.0, after=self.mark) if is_req(f) and f.ts < ts1 and id(f) not in first]
        _slow(not early, "the tester was too slow: the IUT retransmitted before the first SACK: " + summ(early[:2]))
        r1 = ts1 - trig.ts
        fr = _reqs(c, mk, ts1 + 1.4 * r1 - time.time())
        fr = [f for f in fr if ts1 < f.ts <= ts1 + 1.4 * r1]      # by capture time: a slow tester reads later
        new = []
        for f in fr:
            r = _rel(self.p, f)
            if r not in self.sent and r not in new:
                new.append(r)
        self.add(fr)
        rx, seen = [], set()
        for f in fr:
            r = _rel(self.p, f)
            if r < 16 or r in seen:
                rx.append(f)
            seen.add(r)
        _slow(not rx, "the IUT retransmitted before the second SACK: " + summ(rx[:2]))
        return ts1, r1, new

    def window_after(self, mark: int, ts: float, r1: float, done: set[int] = frozenset(),
                     first_wait: float = 0.0) -> tuple[list, object]:
        """Request frames the IUT sent from ts to ts + PTO_SHARE x r1, up to its first tail-loss probe, and that
        probe (or None).  MR-CC-003 exempts a probe from the window, and an IUT whose SRTT is below the RTT the LT
        gave it (the plane's, in some runs) probes within the count: a probe is a frame with AckReq that
        retransmits the highest offset sent and not in `done` (acknowledged or sacked) or sends the next new one
        (MR-LOSS-010); the count ends there.  first_wait > 0: the count starts at the IUT's first request after ts
        (waited for up to first_wait s; a loaded host may hold the IUT's answer to a SACK for milliseconds), and
        an IUT that sends nothing is an ERROR, not a verdict (the bound is an upper one)."""
        if first_wait > 0:
            f0 = self.c.t.lt.wait(lambda f: self.c.is_mine(f) and is_req(f) and f.ts > ts, first_wait, after=mark)
            need(f0 is not None, f"the IUT sent nothing within {1e3 * first_wait:.0f} ms of the LT's SACK")
            ts = f0.ts - 1e-6
        fr = _reqs(self.c, mark, ts + PTO_SHARE * r1 - time.time() + LAG)
        fr = [f for f in fr if f.ts > ts and f.ts < ts + PTO_SHARE * r1]
        out, probe = [], None
        for f in fr:
            r = _rel(self.p, f)
            k = peek(f)
            top = max((x for x in self.sent if x not in done), default=-1)
            if k is not None and k[3] and r != NPKT - 1 and (r == top or r == max(self.sent) + 1):
                probe = f
                break
            if k is not None and k[3] and out:
                self.notes.append(f"AckReq on +{r} counted (highest outstanding +{top}, highest sent "
                                  f"+{max(self.sent)})")
            out.append(f)
            self.sent.setdefault(r, f)
        self.add(out)
        return out, probe

    def drain(self) -> list:
        """Acknowledge whatever comes until the WRITE completes (so that the QP is left clean)."""
        c, p = self.c, self.p
        end = time.monotonic() + 3.0
        top = max(self.sent) if self.sent else -1
        wcs: list = []
        mk = c.t.lt.last_num()
        last = None
        while time.monotonic() < end:
            fs = _reqs(c, mk, 0.02)
            if fs:
                mk = fs[-1].num
                last = fs[-1]
                top = max(top, max(_rel(p, f) for f in fs))
            if last is not None:
                c.send(_sack(c, last, P.psn_add(p, top)))
            if top >= NPKT - 1:
                wcs = c.poll(1, 1.0)
                break
        return wcs


def _distinct(p: int, frames) -> list[int]:
    out: list[int] = []
    for f in frames:
        r = _rel(p, f)
        if r not in out:
            out.append(r)
    return out


# ---- the initial window ------------------------------------------------------------------------------------------
@case("TC-CC-005-a", rules=["MR-CC-005", "MR-CC-001"], category="CC", profile="native", timeout=30, timing=True)
def initial_window(t):
    """W 64, no SACK yet: the IUT sends exactly min(init_cwnd, W) = 16 new PSNs (offsets 0 to 15), all at once --
    within 1.5 ms of the first (MR-CC-005: no pacing below line rate before the first RTT sample; the tester's
    allowance for both ends' scheduling) -- and no new PSN after them before its RTO retransmission (MR-CC-001:
    nothing new while 16 >= max(cwnd, 1) are in flight).  Counted for 3.5 ms, before the 4 ms rto_initial of
    MR-LOSS-004 or up to the first retransmission."""
    fl = _Flow(t)
    order, retx, t0 = fl.initial_burst()
    want = list(range(int(min(INIT_CWND, W))))
    span = max(fl.sent[r].ts for r in order) - t0 if order else 0.0
    fr = [fl.sent[r] for r in order]
    t.check("MR-CC-005", order[:len(want)] == want and len(order) >= len(want) and span <= 1.5e-3,
            f"{len(order)} PSNs before the first retransmission ({summ([retx]) if retx else 'none within 3.5 ms'}): "
            f"offsets {order}, sent over {1e3 * span:.2f} ms", frames=fr[-3:] + ([retx] if retx else []),
            expected=f"offsets 0 to {len(want) - 1} (min(init_cwnd 16, W {W})) within 1.5 ms of the first")
    over = [r for r in order if r >= len(want)]
    t.check("MR-CC-001", not over, f"new PSNs beyond the 16 in flight: {over or 'none'}",
            frames=[fl.sent[r] for r in over] or fr[-1:], expected="no new PSN while 16 are in flight")
    fl.drain()


@case("TC-CC-017-a", rules=["MR-CC-017"], category="CC", caps=("CREDITS",), profile="native", timeout=30,
      timing=True)
def initial_right_edge(t):
    """CREDITS agreed, W 64, no SACK yet: right_edge is initial PSN + init_credit - 1 = offset 15, so before its RTO
    retransmission the IUT sends offsets 0 to 15 and nothing after (counted as in TC-CC-005-a, 3.5 ms).  With the
    defaults init_credit = init_cwnd = 16, so an edge above 15 shows only if the window is also ignored, and one
    below 15 as fewer than 16 packets (MR-CC-005 forbids pacing them out before the first RTT sample)."""
    caps = CAP["NATIVE"] | CAP["SACK"] | CAP["OOO_PLACEMENT"] | CAP["CREDITS"]
    fl = _Flow(t, caps=caps)
    order, retx, _ = fl.initial_burst()
    need(order, "nothing sent")
    want = list(range(INIT_CREDIT))
    t.check("MR-CC-017", order == want, f"offsets before the first SACK: {order}",
            frames=[fl.sent[r] for r in order if r > INIT_CREDIT - 1] or [fl.sent[order[-1]]],
            expected=f"offsets 0 to {INIT_CREDIT - 1} (initial PSN + init_credit - 1), nothing after")
    fl.drain()


# ---- window decreases -----------------------------------------------------------------------------------------
CWND1 = INIT_CWND + AI * 16 / INIT_CWND          # after the first SACK of _Flow.prime: 17


def _retx_in(p, frames, sent_before: set[int]) -> list[int]:
    return [r for r in _distinct(p, frames) if r in sent_before]


@case("TC-CC-022-a", rules=["MR-CC-022", "MR-CC-003", "MR-CC-001", "MR-CC-044"], category="CC", profile="native",
      timeout=30, timing=True)
def loss_cuts_the_window(t):
    """After the initial window and a first SACK of all 16 (cwnd1 = 17; MR-CC-001: at most 17 new PSNs follow), the
    LT's second SACK acknowledges nothing more and sacks only the last 4 new PSNs: the others (the holes H, at least
    6) the IUT marks lost, by the time rule (sent before the sacked ones) or the count rule (K = 1).  MR-CC-022 cuts
    cwnd to max(min_cwnd, cwnd x (1 - max_mdf)) <= max((cwnd1 + 4 / cwnd1) / 2, cwnd1 / 2 + 4 / (cwnd1 / 2)) (the
    increase for the 4 sacked taken before or after the cut): at most 9 in flight.  Until the LT answers again the
    IUT transmits at most max(9, ceil(cwnd1 + 4 / cwnd1) - |H|) distinct PSNs (new PSNs it may send before a
    timer declares the holes lost stay in flight), retransmissions of lost PSNs included (MR-CC-003: none while in
    flight >= cwnd); an IUT that did not cut would put 18 in flight.  Counted for 1.9 RTTs from the IUT's first
    transmission after the SACK, before any probe (MR-LOSS-010: 2 SRTT after the IUT's last transmission)."""
    def start():
        f = _Flow(t)
        r = f.prime()
        if len(r[2]) < 10:
            f.drain()
        _slow(len(r[2]) >= 10, f"only {len(r[2])} new PSNs within 1.4 RTT after the first SACK: {r[2]}")
        sacked = r[2][-4:]
        before = set(f.sent)
        trig = f.sent[sacked[-1]]
        mk, ts2 = f.send_checked(_sack(f.c, trig, P.psn_add(f.p, 15), received={P.psn_add(f.p, x) for x in sacked}),
                                 "the second SACK")
        return (f, *r, before, trig, mk, ts2)
    fl, ts1, r1, new, before, trig, mk, ts2 = _attempts(t, start)
    c, p = fl.c, fl.p
    over1 = len(new) > _in_flight_max(CWND1)
    sacked = new[-4:]
    holes = new[:-4]
    win, probe = fl.window_after(mk, ts2, r1, set(range(16)) | set(sacked), first_wait=0.05)
    d = _distinct(p, win)
    n2 = len(sacked)
    up = CWND1 + AI * n2 / CWND1
    cmax = max(up * (1 - MAX_MDF), CWND1 * (1 - MAX_MDF) + AI * n2 / (CWND1 * (1 - MAX_MDF)))
    lim = max(_in_flight_max(cmax), _in_flight_max(up) - len(holes))
    retx = _retx_in(p, win, before)
    detail = (f"first SACK (cum +15) after {1e3 * r1:.2f} ms; {len(new)} new PSNs +{new[0]}..+{new[-1]}; second "
              f"SACK sacks +{sacked}, holes +{holes}; then in {1e3 * PTO_SHARE * r1:.2f} ms from its first "
              f"transmission after it the IUT sent {len(d)} distinct PSNs: +{d}"
              + (f" (then a probe, not counted: {summ([probe])})" if probe else "")
              + "".join(f"; {x}" for x in fl.notes))
    ok = 1 <= len(d) <= lim
    exp = f"1 to {lim} PSNs (cwnd <= {cmax:.2f} after the loss cut; {len(holes)} lost)"
    t.check("MR-CC-022", ok, detail, frames=win or [trig], expected=exp)
    t.check("MR-CC-003", ok and bool(retx) and all(r in holes for r in retx), detail + f"; retransmitted +{retx}",
            frames=win or [trig], expected=exp + ", the retransmissions among them of lost PSNs only")
    t.check("MR-CC-044", ok, "a QP that has seen no CE (CC_DELAY not agreed): " + detail, frames=win or [trig],
            expected=exp + " -- until a QP has seen CE every loss is a congestion signal (the branch for a path that "
                           "marks is not exercised here)")
    t.check("MR-CC-001", not over1 and ok, f"after the first SACK {len(new)} new PSNs (at most "
            f"{_in_flight_max(CWND1)}); " + detail, frames=win or [trig],
            expected=f"at most {_in_flight_max(CWND1)} new PSNs after the first SACK, {lim} after the second")
    fl.drain()


@case("TC-CC-012-a", rules=["MR-CC-012", "MR-CC-013"], category="CC", profile="native", timeout=30, timing=True)
def ce_cuts_the_window(t):
    """After the initial window and a first SACK of all 16 (cwnd1 = 17), the LT's second SACK acknowledges every
    PSN sent (nothing left in flight) and reports CE: ce_count 3 (3 new marks) and flags.CE.  MR-CC-012 gives the
    ECN candidate cwnd1 x (1 - alpha / 2), alpha at least 1 - g_ecn = 15/16 (alpha_init 1, at most one epoch
    ended), and MR-CC-013 sets cwnd to it and forbids any increase on that SACK: at most ceil(17 x 17/32) = 10 in
    flight.  An IUT that did not cut would send 17 new PSNs, one that grew the window after the cut (by the n >= 8
    PSNs newly acknowledged) at least 11.  Counted for 1.9 RTTs from the IUT's first transmission after the SACK
    (before any probe)."""
    def start():
        f = _Flow(t)
        r = f.prime()
        if len(r[2]) < 8:
            f.drain()
        _slow(len(r[2]) >= 8, f"only {len(r[2])} new PSNs within 1.4 RTT after the first SACK: {r[2]}")
        top = max(r[2])
        mk, ts2 = f.send_checked(_sack(f.c, f.sent[top], P.psn_add(f.p, top), ce_count=3, ce=True), "the second SACK")
        return (f, *r, mk, ts2)
    fl, ts1, r1, new, mk, ts2 = _attempts(t, start)
    c, p = fl.c, fl.p
    top = max(new)
    trig = fl.sent[top]
    win, probe = fl.window_after(mk, ts2, r1, set(range(top + 1)), first_wait=0.05)
    d = _distinct(p, win)
    cmax = CWND1 * (1 - (1 - G_ECN) / 2)
    lim = _in_flight_max(cmax)
    again = [r for r in d if r <= top]
    detail = (f"first SACK (cum +15) after {1e3 * r1:.2f} ms; {len(new)} new PSNs; second SACK cum +{top}, "
              f"ce_count 3, C: then in {1e3 * PTO_SHARE * r1:.2f} ms from its first transmission after it the IUT "
              f"sent {len(d)} distinct PSNs: +{d}"
              + (f" (then a probe, not counted: {summ([probe])})" if probe else "")
              + "".join(f"; {x}" for x in fl.notes))
    t.check("MR-CC-012", len(d) <= lim and not again, detail, frames=win or [trig],
            expected=f"at most {lim} new PSNs (cwnd <= {cmax:.2f} after the ECN cut), none at or before +{top}")
    t.check("MR-CC-013", len(d) <= lim, detail, frames=win or [trig],
            expected=f"at most {lim}: cwnd set to the candidate, no increase on the CE SACK")
    fl.drain()


@case("TC-CC-023-a", rules=["MR-CC-023", "MR-CC-003"], category="CC", profile="native", timeout=30, timing=True)
def rto_cuts_the_window(t):
    """After the initial window and a first SACK of all 16 (cwnd1 = 17; the new PSNs N in flight), the LT answers
    nothing more.  The first RTO marks every outstanding PSN lost, retransmits the lowest (offset 16) and cuts cwnd
    to cwnd1 x (1 - max_mdf) = 8.5: until the next probe the IUT retransmits at most 9 distinct PSNs (MR-CC-003),
    where one that did not cut would retransmit all of N (8 or more).  The second RTO (consecutive_rto 2 =
    rto_cwnd_reset) sets cwnd to min_cwnd: the RTO's own retransmission of offset 16 and nothing else (one that
    only halved again would send up to 5).  Each window is counted for 1.9 RTTs (the LT's RTT) from the
    retransmission of offset 16 that starts it: the IUT's probe timer restarts at its last transmission
    (MR-LOSS-010), and a probe retransmits the highest outstanding PSN, not offset 16."""
    def start():
        f = _Flow(t)
        return (f, *f.prime())
    fl, ts1, r1, _ = _attempts(t, start)
    c, p = fl.c, fl.p
    is16 = lambda f: c.is_mine(f) and fpsn(f) == P.psn_add(p, 16)        # noqa: E731
    need(16 in fl.sent, "offset 16 was not sent after the first SACK")
    f16 = fl.sent[16]
    rto1 = c.t.lt.wait(lambda f: is16(f) and f.ts > f16.ts + 1e-4, 0.5, after=fl.mark)
    need(rto1 is not None, "no retransmission of offset 16 (the first RTO) within 0.5 s")
    new = _distinct(p, [f for f in c.quiet(0.0, after=fl.mark) if is_req(f) and ts1 < f.ts < rto1.ts])
    new = [r for r in new if r >= 16]
    need(len(new) >= 10, f"only {len(new)} new PSNs in flight before the first RTO: {new}")
    win1, pr1 = fl.window_after(rto1.num - 1, rto1.ts - 1e-6, r1, set(range(16)))
    d1 = _distinct(p, win1)
    lim1 = _in_flight_max(CWND1 * (1 - MAX_MDF))
    rto2 = c.t.lt.wait(lambda f: is16(f) and f.ts > rto1.ts + 1e-4, 1.0, after=rto1.num)
    need(rto2 is not None, "no second retransmission of offset 16 (the second RTO) within 1 s")
    win2, pr2 = fl.window_after(rto2.num - 1, rto2.ts - 1e-6, r1, set(range(16)))
    d2 = _distinct(p, win2)
    lim2 = _in_flight_max(MIN_CWND)
    detail = (f"{len(new)} PSNs in flight after the first SACK (RTT {1e3 * r1:.2f} ms); first RTO "
              f"{1e3 * (rto1.ts - ts1):.2f} ms after it: {len(d1)} distinct PSNs in {1e3 * PTO_SHARE * r1:.2f} ms "
              f"(+{d1}); second RTO {1e3 * (rto2.ts - rto1.ts):.2f} ms later: {len(d2)} (+{d2})"
              + "".join(f"; probe not counted: {summ([x])}" for x in (pr1, pr2) if x is not None)
              + "".join(f"; {x}" for x in fl.notes))
    t.check("MR-CC-023", 1 <= len(d1) <= lim1 and d2 == [16], detail, frames=win1 + win2,
            expected=f"at most {lim1} after the first RTO (cwnd {CWND1 * (1 - MAX_MDF):.2f}), only offset 16 "
                     f"after the second (cwnd = min_cwnd)")
    t.check("MR-CC-003", 1 <= len(d1) <= lim1 and len(d2) <= lim2, detail, frames=win1 + win2,
            expected=f"lost PSNs retransmitted only while in flight < max(cwnd, 1): {lim1}, then {lim2}")
    fl.drain()


# ---- the retry counter ----------------------------------------------------------------------------------------------
@case("TC-LOSS-008-a", rules=["MR-LOSS-008"], category="RTO", profile="native", timeout=60)
def retry_counter_reset_on_progress(t):
    """retry_cnt 7: nine one-packet WRITEs, one after the other; the LT answers none of them until the IUT has
    retransmitted it by RTO (the first WRITE: once, after rto_initial -- no probe without an RTT sample; the later
    ones: twice, a tail-loss probe then at least one RTO, MR-LOSS-011 allowing a single probe before the RTO), and
    then acknowledges the retransmission.  Nine RTOs or more in all, each WRITE's retry count reset when its SACK
    advances snd_una and never raised by a probe: every WRITE completes IBV_WC_SUCCESS and the QP stays in RTS.  An
    IUT that did not reset the counter would exceed retry_cnt at the eighth RTO (RETRY_EXC_ERR)."""
    retry = 7
    c = connect_native(t, timeout=18, retry_cnt=retry)
    p = c.iut_psn
    c0 = c.native_counters() or {}
    log, wcs_all, seen = [], [], []
    failed = None
    for i in range(retry + 2):
        q = P.psn_add(p, i)
        mark = post(c, wr(c, "RDMA_WRITE", 64, wr_id=i + 1, remote_off=64 * i))
        want = 2 if i == 0 else 3
        txs = c.t.lt.collect(lambda f, q=q: c.is_mine(f) and fpsn(f) == q, 4.0, after=mark,
                             until=lambda fs, w=want: len(fs) >= w)
        seen += txs
        if len(txs) < want:
            wcs = c.poll(1, 1.0)
            failed = f"WRITE {i + 1}: {len(txs)} transmissions of PSN {q:#08x}, completions {wc_list(wcs)}"
            wcs_all += wcs
            break
        mk = c.send(_sack(c, txs[-1], q))
        wcs = c.poll(1, 2.0)
        wcs_all += wcs
        log.append(f"#{i + 1}: {len(txs) - 1} retx over {1e3 * (txs[-1].ts - txs[0].ts):.1f} ms")
        if [w["status"] for w in wcs] != [WC_OK]:
            failed = f"WRITE {i + 1}: completions {wc_list(wcs)}"
            break
        del mk
    c1 = c.native_counters() or {}
    rto_n = (int(c1.get("retx_rto", 0)) - int(c0.get("retx_rto", 0))) if "retx_rto" in c0 else None
    state = c.query().get("state")
    ok = failed is None and state == "RTS"
    t.check("MR-LOSS-008", ok, (failed + "; " if failed else "") + "; ".join(log) + f"; QP {state}"
            + (f"; retx_rto +{rto_n}" if rto_n is not None else ""), frames=seen[-3:],
            expected=f"{retry + 2} WRITEs completed IBV_WC_SUCCESS, each after at least one RTO, QP in RTS")


# ---- SRTT, RTTVAR, RTO and the samples that must be discarded -----------------------------------------------------
@case("TC-LOSS-003-a", rules=["MR-LOSS-003", "MR-LOSS-001"], category="RTO", profile="native", timeout=40,
      timing=True)
def srtt_rttvar_rto(t):
    """One-packet WRITEs, each answered by the LT with a SACK after a delay it chooses; the IUT's SRTT and RTO read
    with get_counters qp (srtt_us, rto_us: the agent's view of the requester's state) after each.

    * first sample (SACK held 2 ms): SRTT = R1 within [r1 - 50 us, r1 + 10 ms], r1 the LT's RTT (capture of the
      packet to capture of the SACK, a lower bound of the IUT's sample: 50 us for the capture stamps; 10 ms the
      tester's allowance for the IUT's own paths on a loaded host, which only catches gross errors -- the wrong
      gains and variances show in the lower bounds and in the exact relation of RTO to SRTT);
      RTO = SRTT + 4 x R1 / 2 = 3 SRTT (clamped to [rto_min, rto_max]);
    * second sample (answered at once): SRTT2 = 7/8 SRTT1 + 1/8 R2 with R2 in [r2 - 50 us, r2 + 10 ms];
      RTO2 = SRTT2 + 4 x (3/4 RTTVAR1 + 1/4 |SRTT1 - R2|), R2 taken back from the reported SRTTs (the tolerance
      is the 1 us rounding of the reported values, amplified: 25 us + 0.5 %);
    * MR-LOSS-001: SACKs whose tsecr is 1 s in the future, 50 ms before the TSval of the PSN they deliver, or with
      flags.N set give no sample: SRTT and RTO stay exactly as they were (each WRITE still completes); a later
      valid SACK held 1 ms moves SRTT again as the EWMA says."""
    box: dict = {}

    d = t.caps.get("defaults", {})
    rto_min = float(d.get("rto_min_us") or 500)
    rto_max = max(4.096 * (1 << 18), rto_min)
    g = float(t.hello.get("timer_granularity_us") or 1)

    def one(i: int, delay: float, tsecr_delta: int | None = None, **kw):
        c = box["c"]
        q = P.psn_add(c.iut_psn, i)
        mark = post(c, wr(c, "RDMA_WRITE", 64, wr_id=i + 1, remote_off=64 * i))
        fr = wait_requests(c, mark, {q})
        need(fr, f"WRITE {i + 1} was not sent")
        f = fr[0]
        _sleep_until(f.ts + delay)
        if tsecr_delta is not None:
            kw["tsecr"] = (peek(f)[6] + tsecr_delta) & 0xFFFFFFFF
        mk = c.send(_sack(c, f, q, **kw))
        ts = sent_at(c, mk)
        wcs = c.poll(1, 2.0)
        # any retransmission: the IUT's timer ran out before it took the SACK (whose tsecr then echoes an older
        # transmission and gives no sample, MR-LOSS-001): the tester was too slow
        rx = [x for x in c.quiet(0.0, after=mark) if c.is_mine(x) and fpsn(x) == q and x is not f]
        _slow(not rx, f"the tester was too slow: WRITE {i + 1} was retransmitted before its SACK: {summ(rx[:1])}")
        s = c.native_counters() or {}
        return (ts - f.ts) * 1e6, int(s.get("srtt_us", -1)), int(s.get("rto_us", -1)), f, wcs

    def run():
        """The six WRITEs on a new QP (again, up to 3 times, when the tester was too slow for the IUT's timers)."""
        box["c"] = connect_native(t, timeout=18)
        st = box["c"].native_counters()
        if not st or "srtt_us" not in st or "rto_us" not in st:
            raise CannotDrive("the agent reports no srtt_us / rto_us for a native QP (get_counters qp)")
        box["s0"] = int(st["srtt_us"])
        return [one(0, 0.002), one(1, 0.0), one(2, 0.0, tsecr_delta=1_000_000), one(3, 0.0, tsecr_delta=-50_000),
                one(4, 0.0, n=True, tsecr=0), one(5, 0.001)]

    def clamp(x):
        return min(max(x, rto_min), rto_max)

    res = _attempts(t, run)
    s0 = box["s0"]
    for i, (_, _, _, f, wcs) in enumerate(res):
        check_wcs(t, "MR-LOSS-001", wcs, [(i + 1, WC_OK)], f"WRITE {i + 1}", frames=[f])
    (r1, s1, o1, f1, _), (r2, s2, o2, f2, _) = res[0], res[1]
    ok1 = r1 - 50 <= s1 <= r1 + SLACK * 1e6
    want_o1 = clamp(s1 + max(g, 2 * s1))
    ok1o = abs(o1 - want_o1) <= 25 + 0.005 * want_o1
    t.check("MR-LOSS-003", ok1 and ok1o, f"before: srtt {s0} us; after a SACK {r1:.0f} us after the packet: srtt "
            f"{s1} us, rto {o1} us (3 x srtt = {want_o1:.0f})", frames=[f1],
            expected=f"srtt in [{r1 - 50:.0f}, {r1 + SLACK * 1e6:.0f}] us, rto {want_o1:.0f} +- "
                     f"{25 + 0.005 * want_o1:.0f} us")
    lo, hi = 7 / 8 * s1 + (r2 - 50) / 8 - 2, 7 / 8 * s1 + (r2 + SLACK * 1e6) / 8 + 2
    R2 = s1 + 8 * (s2 - s1)
    var2 = 3 / 4 * (s1 / 2) + 1 / 4 * abs(s1 - R2)
    want_o2 = clamp(s2 + max(g, 4 * var2))
    ok2 = lo <= s2 <= hi and abs(o2 - want_o2) <= 25 + 0.005 * want_o2
    t.check("MR-LOSS-003", ok2, f"second SACK {r2:.0f} us after its packet: srtt {s2} us (the sample it implies: "
            f"{R2:.0f} us), rto {o2} us (srtt + 4 rttvar = {want_o2:.0f})", frames=[f2],
            expected=f"srtt in [{lo:.0f}, {hi:.0f}] us, rto {want_o2:.0f} +- {25 + 0.005 * want_o2:.0f} us")
    bad = []
    for (r, s_, o, f, _), what in zip(res[2:5], ("tsecr 1 s in the future", "tsecr 50 ms before the TSval",
                                                   "flags.N")):
        if (s_, o) != (s2, o2):
            bad.append(f"{what}: srtt {s2} -> {s_} us, rto {o2} -> {o} us")
    t.check("MR-LOSS-001", not bad, "; ".join(bad) or f"srtt {s2} us and rto {o2} us unchanged by SACKs with a "
            f"tsecr in the future, a tsecr before the TSval of the PSN delivered, flags.N",
            frames=[x[3] for x in res[2:5]], expected="no sample from any of the three: srtt and rto unchanged")
    r6, s6, o6, f6, _ = res[5]
    lo6, hi6 = 7 / 8 * s2 + (r6 - 50) / 8 - 2, 7 / 8 * s2 + (r6 + SLACK * 1e6) / 8 + 2
    t.check("MR-LOSS-001", lo6 <= s6 <= hi6, f"a valid SACK {r6:.0f} us after its packet: srtt {s2} -> {s6} us",
            frames=[f6], expected=f"a sample again: srtt in [{lo6:.0f}, {hi6:.0f}] us")
    t.check("MR-LOSS-003", lo6 <= s6 <= hi6, f"third sample {r6:.0f} us: srtt {s2} -> {s6} us", frames=[f6],
            expected=f"srtt in [{lo6:.0f}, {hi6:.0f}] us")


# ---- SQD ----------------------------------------------------------------------------------------------------------
@case("TC-NAT-027-a", rules=["MR-NAT-027"], category="QPS", profile="native", timeout=30)
def sqd_finishes_started_work(t):
    """Two WRITEs posted together, a 40-packet one (MTU 256) and a 4-packet one: the initial window (16) holds the
    first back.  RTS -> SQD while it is under way: the IUT sends the rest of the first WRITE (offsets 16 to 39) as
    the LT's SACKs open the window, and completes it, but does not transmit the first packet of the second (offset
    40) while in SQD -- the LT watches for it 50 ms after the first WRITE completed.  Back in RTS the second WRITE
    goes out and completes."""
    from ..agentproto import AgentError
    c = connect_native(t, mtu=MTU, w=W, timeout=18)
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_WRITE", 40 * MTU, wr_id=1), wr(c, "RDMA_WRITE", 4 * MTU, wr_id=2,
                                                              offset=40 * MTU, remote_off=40 * MTU))
    fr = _reqs(c, mark, 0.5, until=lambda fs: len({fpsn(f) for f in fs}) >= 8)
    need(fr, "the first WRITE was not sent")
    c.sync()
    try:
        t.agent.call("modify_qp", qp=c.qp, state="SQD", attrs={})
    except AgentError as e:
        if e.code == "ENOTSUP":
            raise
        raise CaseError(f"RTS -> SQD with a WRITE under way refused: {e}") from None
    t_sqd = time.time()
    sent: dict[int, object] = {}
    mk = mark
    end = time.monotonic() + 3.0
    wcs: list = []
    top = -1
    while time.monotonic() < end and not wcs:
        fs = _reqs(c, mk, 0.005)
        if fs:
            mk = fs[-1].num
            for f in fs:
                sent.setdefault(_rel(p, f), f)
            top = max(top, max(_rel(p, f) for f in fs if _rel(p, f) < 40) if any(_rel(p, f) < 40 for f in fs)
                      else top)
            if top >= 0:
                c.send(_sack(c, fs[-1], P.psn_add(p, top)))
        if top >= 39:
            wcs = c.poll(1, 0.5)
    quiet = _reqs(c, mk, 0.05)
    for f in quiet:
        sent.setdefault(_rel(p, f), f)
    state = c.query().get("state")
    second = [sent[r] for r in sorted(sent) if r >= 40]
    rest = sorted(r for r in sent if 16 <= r < 40)
    ok = [w["status"] for w in wcs] == [WC_OK] and not second and state == "SQD"
    t.check("MR-NAT-027", ok, f"SQD {1e3 * (t_sqd - fr[0].ts):.1f} ms after the first packet; offsets sent "
            f"0..{max(sent) if sent else -1} (of the rest 16..39: {len(rest)}); first WRITE: {wc_list(wcs)}; the "
            f"second WRITE in SQD: {summ(second[:2]) or 'nothing'}; QP {state}",
            frames=second[:2] or list(sent.values())[-2:],
            expected="offsets 16 to 39 sent, WRITE 1 complete, nothing of WRITE 2 (offset 40) while in SQD")
    mk2 = c.t.lt.last_num()
    t.agent.call("modify_qp", qp=c.qp, state="RTS", attrs={})
    got = _reqs(c, mk2, 1.0, until=lambda fs: any(_rel(p, f) >= 43 for f in fs))
    if got:
        c.send(_sack(c, got[-1], P.psn_add(p, max(_rel(p, f) for f in got))))
    wcs2 = c.poll(1, 1.0)
    t.check("MR-NAT-027", [w["status"] for w in wcs2] == [WC_OK] and any(_rel(p, f) == 40 for f in got),
            f"back in RTS: {summ(got[:1])}; second WRITE: {wc_list(wcs2)}", frames=got[:1],
            expected="the second WRITE sent from offset 40 and completed")


# ---- negotiation ---------------------------------------------------------------------------------------------------
@case("TC-NAT-004-a", rules=["MR-NAT-004"], category="CM", profile="native", timeout=25)
def native_needs_sack_and_ooo(t):
    """The IUT passive (cm_listen with NATIVE, SACK, OOO_PLACEMENT and ATOMICS), the LT active, COMPAT_OK set:
    (1) a REQ offering NATIVE, SACK and OOO_PLACEMENT (W 256, K 1): if the REP's agreed set has NATIVE it has SACK
    and OOO_PLACEMENT too; (2) a REQ offering NATIVE without SACK and OOO_PLACEMENT: the IUT treats NATIVE as clear
    -- a REP whose agreed set has none of the three, and the QP, after the RTU, in profile compat."""
    from .cm import COMPAT_OK, Passive
    nat = CAP["NATIVE"] | CAP["SACK"] | CAP["OOO_PLACEMENT"]
    out = []
    for offer, what in ((nat | CAP["ATOMICS"], "NATIVE, SACK, OOO_PLACEMENT"), (CAP["NATIVE"] | CAP["ATOMICS"],
                                                                               "NATIVE alone")):
        pv = Passive(t, caps=nat | CAP["ATOMICS"])
        rep, _, q = pv.established(caps=offer, flags=COMPAT_OK, sack_window=256, entropy_count=1)
        out.append((what, int(rep["caps"]), q.get("profile"), q.get("state")))
    (w1, c1, p1, s1), (w2, c2, p2, s2) = out
    ok1 = not (c1 & CAP["NATIVE"]) or (c1 & nat) == nat
    t.check("MR-NAT-004", ok1, f"REQ offering {w1}: REP agreed {c1:#04x}, QP profile {p1} ({s1})",
            expected="NATIVE in the agreed set only with SACK and OOO_PLACEMENT")
    ok2 = not (c2 & nat) and p2 == "compat"
    t.check("MR-NAT-004", ok2, f"REQ offering {w2}: REP agreed {c2:#04x}, QP profile {p2} ({s2})",
            expected="no NATIVE (nor SACK, OOO_PLACEMENT) agreed; the QP in profile compat")


@case("TC-CM-014-a", rules=["MR-CM-014", "MR-CM-015", "MR-CM-016"], category="CM", timeout=25)
def agreed_set_chooses_the_profile(t):
    """The spec's example (09 9.3, both profiles): the IUT passive, listening with everything it claims (the native
    set and MULTIPATH when it claims them, ATOMICS); the LT's REQ offers 0xbf (W 256, K 16, COMPAT_OK).  The REP's
    agreed set is the intersection with the claim, obeying the NATIVE dependency (MR-CM-014) and within the REQ's
    offer (MR-CM-015); W and K no larger than the REQ's.  After the RTU the QP runs the native profile exactly when
    NATIVE is in the REP (MR-CM-016): a NATIVE_WRITE of the LT is placed and answered by an ACK-type NATIVE_SACK, a
    WRITE the IUT posts leaves as NATIVE_WRITE at the REP's PSN and completes on the LT's SACK -- or, compat, both
    as RoCEv2 WRITEs and ACKs."""
    from .cm import COMPAT_OK, Passive, traffic
    base = CAP["NATIVE"] | CAP["SACK"] | CAP["OOO_PLACEMENT"]
    listen = CAP["ATOMICS"] if "ATOMICS" in t.claim.caps else 0
    if t.claim.native:
        listen |= base | (CAP["MULTIPATH"] if "MULTIPATH" in t.claim.caps else 0)
    pv = Passive(t, caps=listen)
    offer = 0xBF
    rep, psn, q = pv.established(caps=offer, flags=COMPAT_OK, sack_window=256, entropy_count=16)
    got = int(rep["caps"])
    want = offer & listen
    if want & base != base:
        want &= ~(base | CAP["MULTIPATH"] | CAP["CC_DELAY"] | CAP["CREDITS"])
    w, k = int(rep["sack_window"]), int(rep["entropy_count"])
    native = bool(got & CAP["NATIVE"])
    params = (32 <= w <= 256 and w % 32 == 0 and 1 <= k <= 16) if native else (w == 0 and k == 1)
    t.check("MR-CM-014", got == want and params,
            f"REP agreed {got:#04x} W {w} K {k}; REQ offered {offer:#04x} (W 256, K 16), the IUT listened with "
            f"{listen:#04x}", expected=f"{want:#04x}" + (", W 32..256, K 1..16" if want & base else ", W 0, K 1"))
    t.check("MR-CM-015", got & ~offer == 0, f"REP agreed {got:#04x}, REQ offered {offer:#04x}",
            expected="no capability the REQ did not offer")
    prof = q.get("profile", "compat")
    mtu = 128 << int(rep["path_mtu"])
    c = pv.c
    if not native:
        pv.bind(rep, psn, mtu)
        t.check("MR-CM-016", prof == "compat", f"QP profile {prof} after a REP agreeing {got:#04x}",
                expected="compat")
        traffic(t, c, ["MR-CM-016"], "after the exchange")
        return
    n = NConn(t, c.qp, c.qpn, c.pd, c.cq, {"va": hex(c.va), "rkey": c.rkey, "lkey": c.lkey, "len": c.mr_len},
              c.mr, pv.lt_qpn, psn, int(rep["psn"]), mtu, c.sport, w=w, k=k if got & CAP["MULTIPATH"] else 1, caps=got)
    t._conns.append(n)
    body = bytes(range(48))
    mark = n.send(*n.write_msg(body, 256))
    sk = n.sack_for(P.psn_add(n.psn, -1), mark)
    placed = n.mem(256, len(body)) == body
    mark = post(n, wr(n, "RDMA_WRITE", 32, wr_id=0x14A))
    rq = n.requests(mark, 1)
    first = nv(rq[0]) if rq else None
    if rq:
        n.send(n.sack(first.psn))
    wcs = n.poll(1, 1.0)
    ok = (prof == "native" and sk is not None and placed and first is not None and first.op == N.NATIVE_WRITE
          and first.psn == n.iut_psn and [w_["status"] for w_ in wcs] == [WC_OK])
    t.check("MR-CM-016", ok, f"QP profile {prof}; LT NATIVE_WRITE -> {summ([sk] if sk else [])}, placed {placed}; "
            f"IUT WRITE -> {summ(rq)}; completion {wc_list(wcs)}", frames=([sk] if sk else []) + rq,
            expected=f"profile native, an ACK-type NATIVE_SACK, a NATIVE_WRITE at PSN {n.iut_psn:#08x}, SUCCESS")
