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
from .multipath import mp_init, mp_pick
from .receiver import RX_NEW, RX_SACK_NOW, rx_build_sack, rx_init, rx_on_packet, rx_sack_due
from .sender import (ACT_FAIL, ACT_RTO, ACT_TLP, TK_NEW, TK_RETX, TK_RTO, TK_TLP, tx_can_send, tx_init,
                     tx_next_deadline, tx_next_lost, tx_on_sack, tx_on_timer, tx_on_transmit)

US = 1000


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
    per_path_tx: list = field(default_factory=list)
    credit_violations: int = 0
    failed: bool = False


def run(n=2000, loss=0.0, seed=1, k=1, delays_us=(10,), path_loss=None, dup=0.0, sack_loss=None,
        max_us=200_000, isn=0xFFFF00, credits=False, credit=None, on_step=None, **par_kw) -> Result:
    """Stream n packets; returns a Result.  path_loss (per path) overrides loss for data packets;
    sack_loss defaults to loss.  on_step(t, pt) may change path_loss in place (healing)."""
    rng = np.random.default_rng(seed)
    par = L.params(k=k, credits=1 if credits else 0, **par_kw)
    rpar = par.copy()
    s = L.new_tx()[0]
    sb = L.new_sb()
    pt = L.new_pt()
    r = L.new_rx()[0]
    tx_init(s, par, isn, 0)
    mp_init(pt, par, np.arange(0xC000, 0xC000 + L.KMAX, dtype=np.int64))
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

    def received(p):
        d = (r[L.R_EPSN] - p) & L.PSN_MASK
        if 0 < d < L.PSN_HALF:
            return True
        i = p & L.WMASK
        return (r[L.R_BM + (i >> 6)] >> (i & 63)) & 1 == 1 and ((p - r[L.R_EPSN]) & L.PSN_MASK) < par[L.P_W]

    def send_data(t, psn, kind, ackreq):
        nonlocal seq
        if kind == TK_RETX and received(psn):
            res.bad_retx.append(psn)
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
        nonlocal seq
        nw = rx_build_sack(r, rpar, hdr, words)
        if rng.random() < sl:
            return
        seq += 1
        sport = int(hdr[5])
        e = (sport - 0xC000) % k
        heapq.heappush(ev, (t + delays[e], seq, 1, (hdr.copy(), words[:max(nw, 1)].copy(), nw)))

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
