"""A deterministic in-process link simulation of two native endpoints (no sockets, no I/O).

One requester streams `n` single-packet messages to one responder over K paths; time advances in
1 us steps and each direction carries at most one packet per step (the link rate).  Each path has
a propagation delay, a drop probability and a duplication probability drawn from a seeded RNG;
SACKs return over the same kind of paths.  Every decision is made by the compiled functions of
this package, exactly as the data plane will call them; the simulation only moves packets.
It is evidence for the design, not a benchmark of the implementation.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from . import layout as L
from .multipath import entropy_context, entropy_values, mp_init, mp_pick, mp_pick_retx
from .receiver import RX_NEW, RX_SACK_NOW, rx_build_sack, rx_init, rx_on_packet, rx_sack_due
from .sender import (ACT_FAIL, ACT_RTO, ACT_TLP, TK_NEW, TK_RETX, TK_RTO, TK_TLP, tx_can_send, tx_init,
                     tx_next_deadline, tx_next_lost, tx_on_sack, tx_on_timer, tx_on_transmit)

US = 1000


def _entropy(seed: int, q: int, k: int) -> np.ndarray:
    """QP q's K entropy values as the data plane derives them (MR-MP-002, multipath.entropy_values), under a
    secret that follows from the seed so that a run repeats; the ends are made up (QPNs q + 1 and q + 2)."""
    sp = np.zeros(L.KMAX, np.int64)
    ends = entropy_context(q + 1, q + 2, bytes((10, 0, 0, 1)), bytes((10, 0, 0, 2)))
    sp[:k] = entropy_values((seed % (1 << 128)).to_bytes(16, "big"), ends, k)
    return sp


@dataclass
class Result:
    done_us: int | None                  # step at which the responder's ePSN passed the last PSN
    delivered: int
    retx_sack: int
    retx_tlp: int
    retx_rto: int
    spurious: int
    dropped: set = field(default_factory=set)          # PSNs of which some copy was dropped
    bad_retx: list = field(default_factory=list)       # SACK retransmissions of PSNs already received
    retx_psns: set = field(default_factory=set)        # PSNs retransmitted because SACKs showed them lost
    same_path_retx: int = 0                            # retransmissions on the value of the lost copy
    per_path_tx: list = field(default_factory=list)
    credit_violations: int = 0
    failed: bool = False


def run(n=2000, loss=0.0, seed=1, k=1, delays_us=(10,), path_loss=None, dup=0.0, sack_loss=None,
        max_us=200_000, isn=0xFFFF00, credits=False, credit=None, on_step=None, host_delay=None,
        **par_kw) -> Result:
    """Stream n packets; returns a Result.  path_loss (per path) overrides loss for data packets;
    sack_loss defaults to loss.  on_step(t, pt) may change path_loss in place (healing).
    host_delay(rng) -> us, when given, holds each SACK that long before the sender sees it, in
    order (a software endpoint's polling thread descheduled on a shared core: RTT samples mostly
    carry the hold, a few do not, so min_rtt stays near the path's delay and srtt does not)."""
    rng = np.random.default_rng(seed)
    par = L.params(k=k, credits=1 if credits else 0, **par_kw)
    rpar = par.copy()
    s = L.new_tx()[0]
    sb = L.new_sb()
    pt = L.new_pt()
    r = L.new_rx()[0]
    tx_init(s, par, isn, 0)
    mp_init(pt, par, _entropy(seed, 0, k))
    path_of = {int(pt[e, L.E_SPORT]): e for e in range(k)}
    rx_init(r, rpar, isn)
    if credit is not None:
        r[L.R_CREDIT] = credit
    ploss = list(path_loss) if path_loss is not None else [loss] * k
    sl = loss if sack_loss is None else sack_loss
    delays = [delays_us[i % len(delays_us)] for i in range(k)]
    ev: list = []
    seq = 0
    hdr = np.zeros(8, np.int64)
    words = np.zeros(32, np.int64)
    res = Result(None, 0, 0, 0, 0, 0)
    per_path = [0] * k
    last = (isn + n - 1) & L.PSN_MASK
    sent_new = 0
    grant = (isn + par[L.P_INIT_CREDIT] - 1) & L.PSN_MASK
    sack_at = 0                                        # host_delay: SACKs reach the sender in order

    def received(p):
        d = (r[L.R_EPSN] - p) & L.PSN_MASK
        if 0 < d < L.PSN_HALF:
            return True
        i = p & L.WMASK
        return (r[L.R_BM + (i >> 6)] >> (i & 63)) & 1 == 1 and ((p - r[L.R_EPSN]) & L.PSN_MASK) < par[L.P_W]

    def send_data(t, psn, kind, ackreq):
        nonlocal seq
        if kind == TK_RETX:
            res.retx_psns.add(psn)
            if received(psn):
                res.bad_retx.append(psn)
            old = int(sb[psn & L.WMASK, L.B_ENTROPY])
            pick = mp_pick_retx(pt, par, s[L.S_SRTT], t * US, old)    # MR-SACK-025
            res.same_path_retx += k > 1 and (pick & 0xFFFF) == old
        else:
            pick = mp_pick(pt, par, s[L.S_SRTT], t * US)
        e = pick & 0xFFFF
        ackreq = ackreq or bool(pick & L.PICK_PROBE) or psn == last
        tsval = tx_on_transmit(s, sb, par, psn, e, kind, t * US)
        per_path[e] += 1
        copies = 1 + (rng.random() < dup)
        for _ in range(copies):
            if rng.random() < ploss[e]:
                res.dropped.add(psn)
                continue
            seq += 1
            heapq.heappush(ev, (t + delays[e], seq, 0, (psn, tsval, int(pt[e, L.E_SPORT]), int(ackreq))))

    def send_sack(t):
        nonlocal seq, sack_at
        nw = rx_build_sack(r, rpar, hdr, words)
        if rng.random() < sl:
            return
        seq += 1
        sport = int(hdr[5])
        e = path_of.get(sport, 0)
        at = t + delays[e]
        if host_delay is not None:
            at = sack_at = max(at + int(host_delay(rng)), sack_at)
        heapq.heappush(ev, (at, seq, 1, (hdr.copy(), words[:max(nw, 1)].copy(), nw)))

    for t in range(max_us):
        now = t * US
        if on_step is not None:
            on_step(t, ploss)
        while ev and ev[0][0] <= t:
            _, _, kind, pl = heapq.heappop(ev)
            if kind == 0:
                psn, tsval, sport, ackreq = pl
                f = rx_on_packet(r, rpar, psn, ackreq, 0, 1, tsval, sport, now)
                if f & RX_NEW:
                    res.delivered += 1
                if f & RX_SACK_NOW:
                    send_sack(t)
            else:
                h, w, nw = pl
                if credits:
                    g = (h[0] + min(max(h[3], 1), par[L.P_W])) & L.PSN_MASK
                    if 0 < ((g - grant) & L.PSN_MASK) < L.PSN_HALF:
                        grant = g
                tx_on_sack(s, sb, pt, par, h[0], nw, w, h[2], h[6], h[4], h[3], h[5], now)
        if rx_sack_due(r, rpar, now):
            send_sack(t)
        if r[L.R_EPSN] == (last + 1) & L.PSN_MASK:
            res.done_us = t
            break
        dl = tx_next_deadline(s)
        if dl != L.NONE and dl <= now:
            a = tx_on_timer(s, sb, pt, par, now)
            act, psn = a >> 32, a & 0xFFFFFFFF
            if act == ACT_FAIL:
                res.failed = True
                break
            if act == ACT_RTO and psn != L.PSN_NONE:
                send_data(t, psn, TK_RTO, True)
                continue
            if act == ACT_TLP:
                send_data(t, psn, TK_TLP, True)
                continue
        lp = tx_next_lost(s, sb)
        if lp != L.PSN_NONE:
            if tx_can_send(s, par, now, 0) == 0:
                send_data(t, lp, TK_RETX, False)
        elif sent_new < n and tx_can_send(s, par, now, 1) == 0:
            psn = int(s[L.S_SND_NXT])
            if credits and 0 < ((psn - grant) & L.PSN_MASK) < L.PSN_HALF:
                res.credit_violations += 1
            send_data(t, psn, TK_NEW, False)
            sent_new += 1
    res.retx_sack = int(s[L.S_C_RETX_SACK])
    res.retx_tlp = int(s[L.S_C_RETX_TLP])
    res.retx_rto = int(s[L.S_C_RETX_RTO])
    res.spurious = int(s[L.S_C_SPURIOUS])
    res.per_path_tx = per_path
    res.sender = s
    res.paths = pt
    return res


@dataclass
class IncastResult:
    done_us: list                        # per sender: step its last PSN was cumulatively received (None: not)
    delivered: list                      # per sender: packets delivered in the measuring window
    window_us: int
    drops: int
    marks: int
    max_queue: int
    queue: list                          # queue depth sampled every 10 us
    retx: int
    senders: list = field(default_factory=list)


def incast(senders=4, n=3000, seed=1, credits=True, ecn_at=30, drop_at=120, one_way_us=5,
           window=(500, 2500), max_us=100_000, **par_kw) -> IncastResult:
    """`senders` requesters, each with a line-rate uplink (one packet per 1 us step), stream `n` packets
    each into one responder through one bottleneck of one packet per step: a FIFO queue that CE-marks
    a packet arriving when it holds `ecn_at` packets or more and drops it at `drop_at` (a
    DCTCP-configured switch).  The responder keeps one RX row per QP and, with credits, allocates them
    with rx_credit_alloc every credit_interval.  Delivered packets are counted per sender over the
    steps window[0]..window[1] (all senders active)."""
    from .receiver import rx_credit_alloc
    rng = np.random.default_rng(seed)
    base = dict(k=1, credits=1 if credits else 0)
    base.update(par_kw)
    par = L.params(**base)
    ns = senders
    S = L.new_tx(ns)
    SB = np.zeros((ns, L.WMAX, L.NSB), np.int64)
    PT = np.zeros((ns, L.KMAX, L.NPT), np.int64)
    R = L.new_rx(ns)
    isn = 0xFFFF00
    for q in range(ns):
        tx_init(S[q], par, isn, 0)
        mp_init(PT[q], par, _entropy(seed, q, int(par[L.P_K])))
        rx_init(R[q], par, isn)
    last = (isn + n - 1) & L.PSN_MASK
    ev: list = []
    seq = 0
    queue: list = []
    hdr = np.zeros(8, np.int64)
    words = np.zeros(32, np.int64)
    sent = [0] * ns
    done = [None] * ns
    got = [0] * ns
    res = IncastResult(done, got, window[1] - window[0], 0, 0, 0, [], 0)
    next_credit = 0
    start = rng.integers(0, 5, ns)

    def push(t, kind, pl):
        nonlocal seq
        seq += 1
        heapq.heappush(ev, (t, seq, kind, pl))

    def tx_one(q, t, psn, kind, ackreq):
        pick = mp_pick(PT[q], par, S[q, L.S_SRTT], t * US)
        tsval = tx_on_transmit(S[q], SB[q], par, psn, pick & 0xFFFF, kind, t * US)
        push(t + one_way_us, 0, (q, psn, tsval, int(ackreq or psn == last)))

    for t in range(max_us):
        now = t * US
        while ev and ev[0][0] <= t:
            _, _, kind, pl = heapq.heappop(ev)
            if kind == 0:                                   # arrives at the switch
                if len(queue) >= drop_at:
                    res.drops += 1
                    continue
                ce = len(queue) >= ecn_at
                res.marks += ce
                queue.append(pl + (int(ce),))
            elif kind == 1:                                 # arrives at the responder
                q, psn, tsval, ackreq, ce = pl
                f = rx_on_packet(R[q], par, psn, ackreq, ce, 1, tsval, int(PT[q][0, L.E_SPORT]), now)
                if f & RX_NEW and window[0] <= t < window[1]:
                    got[q] += 1
                if f & RX_SACK_NOW:
                    nw = rx_build_sack(R[q], par, hdr, words)
                    push(t + 2 * one_way_us, 2, (q, hdr.copy(), words[:max(nw, 1)].copy(), nw))
            else:
                q, h, w, nw = pl
                tx_on_sack(S[q], SB[q], PT[q], par, h[0], nw, w, h[2], h[6], h[4], h[3], h[5], now)
        if queue:                                           # the bottleneck: one packet per step
            push(t + one_way_us, 1, queue.pop(0))
        res.max_queue = max(res.max_queue, len(queue))
        if t % 10 == 0:
            res.queue.append(len(queue))
        if credits and now >= next_credit:
            rx_credit_alloc(R, par, now)
            next_credit = now + par[L.P_CREDIT_INTERVAL]
        for q in range(ns):
            if rx_sack_due(R[q], par, now):
                nw = rx_build_sack(R[q], par, hdr, words)
                push(t + 2 * one_way_us, 2, (q, hdr.copy(), words[:max(nw, 1)].copy(), nw))
            if done[q] is None and R[q, L.R_EPSN] == (last + 1) & L.PSN_MASK:
                done[q] = t
        if all(d is not None for d in done):
            break
        for q in range(ns):
            if t < start[q] or done[q] is not None:
                continue
            s = S[q]
            dl = tx_next_deadline(s)
            if dl != L.NONE and dl <= now:
                a = tx_on_timer(s, SB[q], PT[q], par, now)
                act, psn = a >> 32, a & 0xFFFFFFFF
                if act in (ACT_RTO, ACT_TLP) and psn != L.PSN_NONE:
                    tx_one(q, t, psn, TK_RTO if act == ACT_RTO else TK_TLP, True)
                    continue
            lp = tx_next_lost(s, SB[q])
            if lp != L.PSN_NONE:
                if tx_can_send(s, par, now, 0) == 0:
                    tx_one(q, t, lp, TK_RETX, False)
            elif sent[q] < n and tx_can_send(s, par, now, 1) == 0:
                tx_one(q, t, int(s[L.S_SND_NXT]), TK_NEW, False)
                sent[q] += 1
    res.retx = int(sum(S[q, L.S_C_RETX_SACK] + S[q, L.S_C_RETX_TLP] + S[q, L.S_C_RETX_RTO] for q in range(ns)))
    res.senders = S
    return res
