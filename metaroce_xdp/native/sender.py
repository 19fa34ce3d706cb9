"""Native requester logic (04-native.md 4.3.4-4.3.6, 4.6; 05-congestion.md 5.2-5.3.7).

I/O free.  Per QP: the row `s` (TX_FIELDS), the scoreboard `sb` (WMAX rows, one per PSN in
flight, ring by psn & WMASK), the entropy values `pt` and the parameter row `par`.  The data
plane calls, per event:

  tx_can_send(s, par, now, new)      may a packet leave now? 0 or a TXB_* reason
  mp_pick(pt, par, s[S_SRTT], now)   which entropy value (multipath.py)
  tx_on_transmit(...)                after building a packet: records it, paces, arms timers
  tx_next_lost(s, sb)                the PSN to retransmit next (lost ones first, MR-SACK-023)
  tx_on_sack(...)                    a valid-looking ACK-type NATIVE_SACK arrived
  tx_on_rnr_nak(...)                 an RNR NAK-type SACK arrived
  tx_next_deadline(s)                earliest timer, for the caller's sleep
  tx_on_timer(...)                   timers that are due: RNR end, RTO, reordering, PTO
"""
from __future__ import annotations

import numpy as np
from .. import jitcache  # noqa: F401,E402  (cache keyed on every module compiled code depends on)
from ..jitcache import lazy_njit  # noqa: E402  (explicit signatures, compiled or loaded at first use)

from .layout import *  # noqa: F401,F403
from .layout import FP, NONE, PSN_HALF, PSN_MASK, PSN_NONE, WMASK
from .multipath import mp_on_loss, mp_on_round, mp_on_sack

_jit = dict(cache=True, nogil=True)

# transmission kinds (tx_on_transmit)
TK_NEW, TK_RETX, TK_TLP, TK_RTO, TK_REPLAY = 0, 1, 2, 3, 4
# tx_can_send blocks
TXB_CWND, TXB_W, TXB_CREDIT, TXB_PACE, TXB_RNR, TXB_FAILED = 1, 2, 3, 4, 5, 6
# tx_on_sack results
SACK_INVALID, SACK_STALE = -1, -2
# tx_on_timer actions (action << 32 | psn)
ACT_NONE, ACT_RTO, ACT_TLP, ACT_LOST, ACT_RNR_END, ACT_FAIL = 0, 1, 2, 3, 4, 5

RTT_SAMPLE_MAX = 1 << 31          # us (MR-LOSS-001)
RNR_TIMER_US = np.array((655360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920,
                         2560, 3840, 5120, 7680, 10240, 15360, 20480, 30720, 40960, 61440, 81920, 122880,
                         163840, 245760, 327680, 491520), np.int64)      # Table 3-5


@lazy_njit("int64(int64)", **_jit)
def tsval_of(now):
    """NETH.tsval for local time `now` (ns): microseconds modulo 2^32 (MR-NAT-014)."""
    return (now // 1000) & 0xFFFFFFFF


@lazy_njit("boolean(int64, int64)", **_jit)
def _before(a, b):
    d = (b - a) & PSN_MASK
    return 0 < d < PSN_HALF


@lazy_njit("void(int64[::1], int64[::1], int64, int64)", **_jit)
def tx_init(s, par, isn, now):
    """QP enters RTS: 04 section 4.3.5 state, then 05 section 5.2 state, in the spec's order."""
    s[:] = 0
    isn &= PSN_MASK
    s[S_ISN] = isn
    s[S_SND_UNA] = isn
    s[S_SND_NXT] = isn
    s[S_SRTT] = NONE
    s[S_RTTVAR] = NONE
    s[S_RTO] = par[P_RTO_INITIAL]                      # MR-LOSS-004
    s[S_MIN_RTT] = NONE
    s[S_MIN_RTT_TS] = NONE
    s[S_LAST_RTT] = NONE
    s[S_RACK_XMIT_TS] = NONE
    s[S_RACK_RTT] = NONE
    s[S_REO_MULT] = 1
    s[S_RTO_AT] = NONE
    s[S_PTO_AT] = NONE
    s[S_REO_AT] = NONE
    s[S_LAST_SACK_TS] = NONE
    s[S_LAST_TX_TS] = NONE
    s[S_RNR_UNTIL] = NONE
    s[S_RNR_PSN] = PSN_NONE
    s[S_MP_ROUND_END] = NONE
    c = par[P_INIT_CWND]                               # MR-CC-005
    if c > par[P_W] * FP:
        c = par[P_W] * FP
    s[S_CWND] = c
    s[S_ALPHA] = par[P_ALPHA_INIT]
    s[S_T_LAST_DEC] = NONE
    s[S_CWND_BEFORE_CUT] = NONE
    s[S_EPOCH_END] = NONE
    s[S_RIGHT_EDGE] = (isn + par[P_INIT_CREDIT] - 1) & PSN_MASK   # MR-CC-017
    s[S_BEST_CUM] = PSN_NONE
    s[S_NEXT_SEND] = now
    s[S_LAST_CE_TS] = NONE


# ------------------------------------------------------------------ RTT, RTO, reo_wnd
@lazy_njit("void(int64[::1], int64[::1], int64, int64)", **_jit)
def _rtt_sample(s, par, r, now):
    """MR-LOSS-003 (RFC 6298) and the min_rtt filter of MR-CC-007; r in ns."""
    s[S_LAST_RTT] = r
    if s[S_SRTT] == NONE:
        s[S_SRTT] = r
        s[S_RTTVAR] = r // 2
    else:
        dv = s[S_SRTT] - r
        if dv < 0:
            dv = -dv
        s[S_RTTVAR] = (3 * s[S_RTTVAR] + dv) // 4
        s[S_SRTT] = (7 * s[S_SRTT] + r) // 8
    v = 4 * s[S_RTTVAR]
    if v < par[P_TIMER_G]:
        v = par[P_TIMER_G]
    rto = s[S_SRTT] + v
    if rto < par[P_RTO_MIN]:
        rto = par[P_RTO_MIN]
    if rto > par[P_RTO_MAX]:
        rto = par[P_RTO_MAX]
    s[S_RTO] = rto
    if s[S_MIN_RTT] == NONE or r <= s[S_MIN_RTT] or now - s[S_MIN_RTT_TS] > par[P_MIN_RTT_WIN]:
        s[S_MIN_RTT] = r
        s[S_MIN_RTT_TS] = now


@lazy_njit("int64(int64[::1], int64[::1])", **_jit)
def reo_wnd(s, par):
    """04 section 4.3.5: min(reo_wnd_mult * max(min_rtt / 4, reo_wnd_floor), srtt)."""
    base = par[P_REO_FLOOR]
    if s[S_MIN_RTT] != NONE and s[S_MIN_RTT] // 4 > base:
        base = s[S_MIN_RTT] // 4
    w = s[S_REO_MULT] * base
    if s[S_SRTT] != NONE and w > s[S_SRTT]:
        w = s[S_SRTT]
    return w


@lazy_njit("int64(int64[::1], int64[::1])", **_jit)
def cc_target(s, par):
    """MR-CC-007 with q_eff of MR-CC-040 (ns); NONE before the first sample."""
    if s[S_MIN_RTT] == NONE:
        return NONE
    q = par[P_Q_TARGET]
    if 4 * par[P_T_PEER] > q:
        q = 4 * par[P_T_PEER]
    t = s[S_MIN_RTT] + q
    if t < par[P_TARGET_MIN]:
        t = par[P_TARGET_MIN]
    if t > par[P_TARGET_MAX]:
        t = par[P_TARGET_MAX]
    return t


@lazy_njit("boolean(int64[::1], int64)", **_jit)
def _can_decrease(s, now):
    return s[S_SRTT] == NONE or s[S_T_LAST_DEC] == NONE or now - s[S_T_LAST_DEC] >= s[S_SRTT]


@lazy_njit("void(int64[::1], int64[::1])", **_jit)
def _clamp_cwnd(s, par):
    if s[S_CWND] < par[P_MIN_CWND]:
        s[S_CWND] = par[P_MIN_CWND]
    if s[S_CWND] > par[P_W] * FP:
        s[S_CWND] = par[P_W] * FP


@lazy_njit("void(int64[::1], int64, int64)", **_jit)
def _repace(s, old, now):
    """MR-CC-043: the pacing wait still ahead (next_send_time - now) was set for window `old`; when the
    window grew (or was restored) while that wait is longer than srtt, scale it by old / cwnd."""
    new = s[S_CWND]
    ns = s[S_NEXT_SEND]
    if new <= old or old <= 0 or s[S_SRTT] == NONE or ns - now <= s[S_SRTT]:
        return
    rem = ns - now
    if rem > 1 << 40:                                  # ~18 min: keeps rem * old inside int64
        rem = 1 << 40
    s[S_NEXT_SEND] = now + rem * old // new


# ------------------------------------------------------------------ scoreboard transitions
@lazy_njit("void(int64[::1], int64[::1])", **_jit)
def _leave_flight(s, b):
    """Book-keeping before a record changes: it stops counting as in flight or as lost."""
    f = b[B_FLAGS]
    if f & BF_LOST:
        s[S_N_LOST] -= 1
    elif not (f & (BF_SACKED | BF_RNR)):
        s[S_IN_FLIGHT] -= 1


@lazy_njit("void(int64[::1], int64[::1], int64)", **_jit)
def _mark_lost(s, b, attributed):
    _leave_flight(s, b)
    b[B_FLAGS] = (b[B_FLAGS] & ~BF_RNR) | BF_LOST
    s[S_N_LOST] += 1
    s[S_C_LOST] += 1


@lazy_njit("boolean(int64[::1], int64[:, ::1], int64)", **_jit)
def _outstanding(s, sb, p):
    b = sb[p & WMASK]
    return b[B_FLAGS] & BF_OUT != 0 and b[B_PSN] == p


# ------------------------------------------------------------------ transmit side
@lazy_njit("int64(int64[::1], int64[::1], int64, int64)", **_jit)
def tx_can_send(s, par, now, new):
    """0 when a packet may leave now, else why not: MR-CC-001/003 (cwnd), MR-CC-002 (W, credits),
    MR-CC-004 (pacing), MR-SACK-039 (RNR wait).  new=1 for a new PSN, 0 for a retransmission."""
    if s[S_FAILED]:
        return TXB_FAILED
    if s[S_RNR_UNTIL] != NONE:
        return TXB_RNR
    c = s[S_CWND] if s[S_CWND] > FP else FP
    if s[S_IN_FLIGHT] * FP >= c:
        s[S_C_BLK_CWND] += 1
        return TXB_CWND
    if new:
        nxt = s[S_SND_NXT]
        if ((nxt - s[S_SND_UNA]) & PSN_MASK) >= par[P_W]:
            s[S_C_BLK_W] += 1
            return TXB_W
        if par[P_CREDITS] and _before(s[S_RIGHT_EDGE], nxt):
            s[S_C_BLK_CREDIT] += 1
            return TXB_CREDIT
    if now < s[S_NEXT_SEND]:
        s[S_C_BLK_PACE] += 1
        return TXB_PACE
    return 0


@lazy_njit("void(int64[::1], int64[::1], int64)", **_jit)
def _arm_timers(s, par, now):
    """04 section 4.6.4 arm_timers()."""
    if s[S_RNR_UNTIL] != NONE:
        return
    if s[S_SND_UNA] == s[S_SND_NXT]:
        s[S_RTO_AT] = NONE
        s[S_PTO_AT] = NONE
        return
    if s[S_RTO_AT] == NONE:
        s[S_RTO_AT] = now + s[S_RTO]
    if s[S_SRTT] != NONE and s[S_PROBE_OUT] == 0:
        pto = 2 * s[S_SRTT] + par[P_T_PEER]
        if pto < par[P_PTO_MIN]:
            pto = par[P_PTO_MIN]
        base = s[S_LAST_TX_TS]
        if s[S_LAST_SACK_TS] != NONE and s[S_LAST_SACK_TS] > base:
            base = s[S_LAST_SACK_TS]
        at = base + pto
        if at > s[S_RTO_AT]:
            at = s[S_RTO_AT]                               # MR-LOSS-011
        s[S_PTO_AT] = at


@lazy_njit("int64(int64[::1], int64[:, ::1], int64[::1], int64, int64, int64, int64)", **_jit)
def tx_on_transmit(s, sb, par, psn, entropy, kind, now):
    """Record a transmission of `psn` on entropy index `entropy`; kind TK_NEW (psn must be
    snd_nxt), TK_RETX (a lost PSN, MR-SACK-023), TK_TLP, TK_RTO or TK_REPLAY.  Updates the
    scoreboard (xmit_ts, last_tsval, tx_count, entropy), the pacing clock (MR-CC-004) and the
    timers.  Returns the NETH.tsval to send, or -1 if the call is not consistent."""
    tsval = tsval_of(now)
    if kind == TK_NEW:
        if psn != s[S_SND_NXT]:
            return -1
        b = sb[psn & WMASK]
        b[B_PSN] = psn
        b[B_FLAGS] = BF_OUT
        b[B_TX_COUNT] = 1
        s[S_IN_FLIGHT] += 1
        s[S_SND_NXT] = (psn + 1) & PSN_MASK
    else:
        if not _outstanding(s, sb, psn):
            return -1
        b = sb[psn & WMASK]
        if b[B_FLAGS] & BF_SACKED and kind != TK_REPLAY:
            return -1                                       # MR-SACK-022
        if b[B_FLAGS] & BF_LOST:
            s[S_N_LOST] -= 1
            s[S_IN_FLIGHT] += 1
            b[B_FLAGS] &= ~BF_LOST
        b[B_TX_COUNT] += 1
        if kind == TK_RETX:
            s[S_C_RETX_SACK] += 1
        elif kind == TK_TLP:
            s[S_C_RETX_TLP] += 1
        elif kind == TK_RTO:
            s[S_C_RETX_RTO] += 1
    b[B_XMIT_TS] = now
    b[B_LAST_TSVAL] = tsval
    b[B_ENTROPY] = entropy
    s[S_C_TX] += 1
    s[S_LAST_TX_TS] = now
    # pacing clock, MR-CC-004 / MR-CC-005: no burst credit
    gap = 0
    if s[S_SRTT] != NONE:
        c = s[S_CWND]
        if c < FP:
            gap = s[S_SRTT] * FP // c
        else:
            gap = (s[S_SRTT] * FP // par[P_PACING_GAIN]) * FP // c
    ns = s[S_NEXT_SEND]
    if ns < now:
        ns = now
    s[S_NEXT_SEND] = ns + gap
    _arm_timers(s, par, now)
    return tsval


@lazy_njit("int64(int64[::1], int64[:, ::1])", **_jit)
def tx_next_lost(s, sb):
    """The lowest PSN marked lost (MR-SACK-023), PSN_NONE if none."""
    if s[S_N_LOST] == 0:
        return PSN_NONE
    p = s[S_SND_UNA]
    while p != s[S_SND_NXT]:
        b = sb[p & WMASK]
        if b[B_FLAGS] & BF_LOST:
            return p
        p = (p + 1) & PSN_MASK
    return PSN_NONE


# ------------------------------------------------------------------ congestion control
@lazy_njit("void(int64[::1], int64[::1])", **_jit)
def _mdf_cut(s, par):
    """cwnd = max(min_cwnd, cwnd * (1 - max_mdf)): the cut of a loss (MR-CC-022), an RTO (MR-CC-023) and a
    lost READ response (rd_on_loss)."""
    c = s[S_CWND] * (FP - par[P_MAX_MDF]) // FP
    s[S_CWND] = c if c > par[P_MIN_CWND] else par[P_MIN_CWND]


@lazy_njit("void(int64[::1], int64[::1], int64, int64)", **_jit)
def _cc_on_loss(s, par, now, attributed):
    """MR-CC-022 with the congestion gate of MR-CC-041."""
    if not _can_decrease(s, now):
        return
    if (not par[P_CC_DELAY] and s[S_LAST_CE_TS] != NONE and s[S_SRTT] != NONE
            and s[S_SRTT] < now - s[S_LAST_CE_TS] <= par[P_MIN_RTT_WIN]):
        s[S_C_LOSS_NOCUT] += 1                             # MR-CC-044: the path marks, and did not
        return
    if par[P_CC_DELAY]:
        congested = False
        t = cc_target(s, par)
        if t == NONE or s[S_LAST_RTT] == NONE or s[S_LAST_RTT] >= t:
            congested = True
        if s[S_LAST_CE_TS] != NONE and (s[S_SRTT] == NONE or now - s[S_LAST_CE_TS] <= s[S_SRTT]):
            congested = True
        if not congested:
            s[S_C_LOSS_NOCUT] += 1                         # MR-CC-041: loss without congestion
            return
    s[S_CWND_BEFORE_CUT] = s[S_CWND]
    _mdf_cut(s, par)
    s[S_T_LAST_DEC] = now
    s[S_C_DEC_LOSS] += 1


@lazy_njit("void(int64[::1], int64[::1], int64, int64, int64, int64, int64, int64)", **_jit)
def _cc_on_sack(s, par, n, rtt, ce_count, flags_ce, stale, now):
    """05 section 5.3.7 cc_on_sack() (credits are applied by the caller)."""
    old = s[S_CWND]
    ce = ce_count > 0 or flags_ce != 0
    if ce:
        s[S_LAST_CE_TS] = now
    s[S_EPOCH_PKTS] += n                                   # MR-CC-011
    s[S_EPOCH_CE] += ce_count
    if s[S_EPOCH_END] == NONE and s[S_SRTT] != NONE:
        s[S_EPOCH_END] = now + s[S_SRTT]
    elif s[S_EPOCH_END] != NONE and now >= s[S_EPOCH_END]:
        d = s[S_EPOCH_PKTS] if s[S_EPOCH_PKTS] > 1 else 1
        f = s[S_EPOCH_CE] * FP // d
        if f > FP:
            f = FP
        s[S_ALPHA] = ((FP - par[P_G_ECN]) * s[S_ALPHA] + par[P_G_ECN] * f) // FP
        s[S_EPOCH_PKTS] = 0
        s[S_EPOCH_CE] = 0
        s[S_EPOCH_END] = now + s[S_SRTT]
    if stale:
        return
    cand = -1
    below = True
    if par[P_CC_DELAY] and rtt != NONE:
        t = cc_target(s, par)
        floor = par[P_DELAY_FLOOR]
        if rtt >= t and s[S_CWND] > floor and _can_decrease(s, now):   # MR-CC-009
            f = FP - par[P_BETA] * (rtt - t) // rtt
            if f < FP - par[P_MAX_MDF]:
                f = FP - par[P_MAX_MDF]
            cand = s[S_CWND] * f // FP
            if cand < floor:                             # MR-CC-046: delay cuts stop at delay_floor
                cand = floor
            s[S_C_DEC_DELAY] += 1
        below = rtt < t or s[S_CWND] < floor             # MR-CC-046: below it, delay is no signal
    if ce and _can_decrease(s, now):                     # MR-CC-012
        c2 = s[S_CWND] * (FP - s[S_ALPHA] // 2) // FP
        if cand < 0 or c2 < cand:
            cand = c2
        s[S_C_DEC_ECN] += 1
    if cand >= 0:                                        # MR-CC-013
        s[S_CWND] = cand
        s[S_T_LAST_DEC] = now
        s[S_CWND_BEFORE_CUT] = NONE                      # a delay/ECN cut: no undo (MR-CC-024)
    elif n > 0 and not ce and below:                     # MR-CC-008, MR-CC-010
        if s[S_CWND] >= FP:
            s[S_CWND] += par[P_AI] * n * FP // s[S_CWND]
        else:
            s[S_CWND] += par[P_AI] * n
    _clamp_cwnd(s, par)
    _repace(s, old, now)                                 # MR-CC-043


# ------------------------------------------------------------------ the READ window (MR-CC-019)
@lazy_njit("void(int64[::1], int64[::1], int64, int64, int64)", **_jit)
def rd_on_response(r, par, rtt, ce, now):
    """MR-CC-019: a READ response received.  r is a requester row that holds only the READ window's own
    copy of the state of 05 section 5.2 (cwnd, srtt, min_rtt, alpha, t_last_decrease, the ECN epoch),
    adjusted by the rules of cwnd (MR-CC-007 to MR-CC-013, MR-CC-046): one packet delivered, rtt (not
    NONE for the first response after a request or re-request) its sample, ce 1 for a CE-marked
    response (counted in epoch_ce)."""
    if rtt != NONE:
        _rtt_sample(r, par, rtt, now)
    _cc_on_sack(r, par, 1, rtt, ce, 0, 0, now)


@lazy_njit("void(int64[::1], int64[::1], int64, int64)", **_jit)
def rd_on_loss(r, par, fallback_srtt, now):
    """A READ response re-requested or timed out: the READ window is cut by max_mdf (MR-CC-022's cut),
    at most once per its srtt (the request's srtt, fallback_srtt, before it has a sample of its own)."""
    srtt = r[S_SRTT] if r[S_SRTT] != NONE else fallback_srtt
    if r[S_T_LAST_DEC] != NONE and srtt != NONE and now - r[S_T_LAST_DEC] < srtt:
        return
    _mdf_cut(r, par)
    r[S_T_LAST_DEC] = now
    r[S_C_DEC_LOSS] += 1


# ------------------------------------------------------------------ loss detection
@lazy_njit("int64(int64[::1], int64[:, ::1], int64[:, ::1], int64[::1], int64)", **_jit)
def _detect_losses(s, sb, pt, par, now):
    """04 section 4.3.5 detect_losses(): MR-SACK-028 (time), MR-SACK-029 (count, K = 1 only).
    Returns the number of PSNs newly marked lost and arms the reordering timer."""
    if s[S_RNR_UNTIL] != NONE:                           # MR-SACK-040
        return 0
    newly = 0
    nxt_t = NONE
    rw = reo_wnd(s, par)
    count_rule = par[P_K] == 1
    p = s[S_SND_UNA]
    while p != s[S_SND_NXT]:
        b = sb[p & WMASK]
        f = b[B_FLAGS]
        if f & BF_OUT and not (f & (BF_SACKED | BF_LOST | BF_RNR)):
            lost = False
            rack = s[S_RACK_XMIT_TS] != NONE and b[B_XMIT_TS] <= s[S_RACK_XMIT_TS]
            due = NONE
            if rack:                                     # MR-SACK-028 (T_peer: the SACK hold, revised)
                due = b[B_XMIT_TS] + s[S_RACK_RTT] + rw + par[P_T_PEER]
                lost = now >= due
            if not lost and count_rule:                  # MR-SACK-029 (sacked_after(p) >= dup_thresh)
                cnt = 0
                q = (p + 1) & PSN_MASK
                while q != s[S_SND_NXT] and cnt < par[P_DUP_THRESH]:
                    c = sb[q & WMASK]
                    if c[B_FLAGS] & BF_SACKED and c[B_XMIT_TS] > b[B_XMIT_TS]:
                        cnt += 1
                    q = (q + 1) & PSN_MASK
                lost = cnt >= par[P_DUP_THRESH]
            if lost:
                _mark_lost(s, b, 1)
                newly += 1
                e = b[B_ENTROPY]
                if 0 <= e < par[P_K] and b[B_XMIT_TS] >= pt[e, E_SINCE]:
                    mp_on_loss(pt, par, e, now)          # MR-MP-008 (not if the value was replaced since, MR-MP-011)
            elif rack and (nxt_t == NONE or due < nxt_t):
                nxt_t = due
        p = (p + 1) & PSN_MASK
    s[S_REO_AT] = nxt_t
    if newly:
        s[S_RECOV_CLEAN] += 1                           # MR-SACK-030: 16 clean recoveries reset
        if s[S_RECOV_CLEAN] >= 16:
            s[S_REO_MULT] = 1
            s[S_RECOV_CLEAN] = 0
    return newly


# ------------------------------------------------------------------ SACK processing
@lazy_njit("int64(int64[::1], int64[:, ::1], int64[:, ::1], int64[::1], int64, int64, int64[::1], int64, int64,"
      " int64, int64, int64, int64)", **_jit)
def tx_on_sack(s, sb, pt, par, cum, nw, words, tsecr, flags, ce_count, credit, sport, now):
    """An ACK-type NATIVE_SACK (syndrome bits 6-5 = 00, MR-SACK-038) from the connected peer:
    cum = BTH.PSN, nw = bitmap_words, words[0:nw] the 32-bit words, flags = SACKETH byte 11.
    Applies 04 section 4.3.5 on_sack(): validation (MR-SACK-019), RTT (MR-LOSS-001/003),
    path feedback (MR-MP-007), staleness (MR-SACK-037), cumulative and selective
    acknowledgement (MR-SACK-020/021), RACK (MR-SACK-027), spurious retransmissions
    (MR-SACK-030), loss detection, congestion control (05 5.3.7) and timers (MR-LOSS-006).
    Returns the number of PSNs newly delivered, SACK_STALE, or SACK_INVALID (nothing changed)."""
    una = s[S_SND_UNA]
    nxt = s[S_SND_NXT]
    # MR-SACK-019 / MR-SACK-005: validate before touching any state.  BTH.PSN + 1 must lie in
    # [snd_una - W, snd_nxt]: a SACK names at most the last PSN sent, and one sent before snd_una - W
    # is older than any the peer can still send (it acknowledged at most W PSNs ahead of snd_una);
    # the rest of the PSN space, about half of it before, is a forgery or another connection's
    # (MR-SEC-032): one blind guess must not reach the RTT, path or congestion state.
    if nw < 0 or nw > 32 or nw > words.shape[0]:
        s[S_C_SACK_INV] += 1
        return SACK_INVALID
    lo = (una - par[P_W]) & PSN_MASK
    if ((cum + 1 - lo) & PSN_MASK) > ((nxt - lo) & PSN_MASK):
        s[S_C_SACK_INV] += 1
        return SACK_INVALID
    for j in range(nw - 1, -1, -1):
        wv = words[j] & 0xFFFFFFFF
        if wv:
            low = 0                                   # lowest set bit = highest index in the word
            while not (wv >> low) & 1:
                low += 1
            i = 32 * j + (31 - low)
            if not _before((cum + 2 + i) & PSN_MASK, nxt):
                s[S_C_SACK_INV] += 1
                return SACK_INVALID
            break
    s[S_C_SACK] += 1
    flags_n = (flags >> 6) & 1
    flags_ce = (flags >> 7) & 1
    # MR-SACK-007 / MR-CC-011: ce_count is the responder's running count of CE marks modulo 2^16; what
    # is new is its advance over the last count taken (AccECN-style), so a lost SACK loses no mark and
    # a duplicated or reordered one adds none
    ce_new = (ce_count - s[S_CE_SEEN]) & 0xFFFF
    if 0 < ce_new < 0x8000:
        s[S_CE_SEEN] = ce_count & 0xFFFF
    else:
        ce_new = 0
    stale = _before(cum, (una - 1) & PSN_MASK)        # MR-SACK-037
    n = 0
    spurious = False
    rack_ts = s[S_RACK_XMIT_TS]
    rack_rtt = s[S_RACK_RTT]
    # the earliest tsval among the PSNs this SACK newly delivers (MR-LOSS-001): the packet whose tsval
    # it echoes was sent no earlier, unless it echoes an older transmission (then no sample, as Karn)
    ts_lo = NONE
    if not stale:
        end = (cum + 1) & PSN_MASK
        p = una
        while p != end and _before(p, end):           # cumulative part, MR-SACK-020
            b = sb[p & WMASK]
            if b[B_FLAGS] & BF_OUT and b[B_PSN] == p:
                if not (b[B_FLAGS] & BF_SACKED):
                    n += 1
                    if ts_lo == NONE or 0 < ((ts_lo - b[B_LAST_TSVAL]) & 0xFFFFFFFF) < (1 << 31):
                        ts_lo = b[B_LAST_TSVAL]
                    if b[B_TX_COUNT] > 1 and not flags_n and 0 < ((b[B_LAST_TSVAL] - tsecr) & 0xFFFFFFFF) < (1 << 31):
                        spurious = True
                    if b[B_TX_COUNT] == 1 or (not flags_n and tsecr == b[B_LAST_TSVAL]):
                        if rack_ts == NONE or b[B_XMIT_TS] > rack_ts:
                            rack_ts = b[B_XMIT_TS]
                            rack_rtt = now - b[B_XMIT_TS]
                _leave_flight(s, b)
                b[B_FLAGS] = 0
            p = (p + 1) & PSN_MASK
        if _before(una, end):
            s[S_SND_UNA] = end
        for j in range(nw):                            # MR-SACK-004
            wv = words[j] & 0xFFFFFFFF
            if wv == 0:
                continue
            for k in range(32):
                if (wv >> (31 - k)) & 1:
                    q = (cum + 2 + 32 * j + k) & PSN_MASK
                    b = sb[q & WMASK]
                    if b[B_FLAGS] & BF_OUT and b[B_PSN] == q and not (b[B_FLAGS] & BF_SACKED):
                        n += 1
                        if ts_lo == NONE or 0 < ((ts_lo - b[B_LAST_TSVAL]) & 0xFFFFFFFF) < (1 << 31):
                            ts_lo = b[B_LAST_TSVAL]
                        if b[B_TX_COUNT] > 1 and not flags_n and 0 < ((b[B_LAST_TSVAL] - tsecr) & 0xFFFFFFFF) < (1 << 31):
                            spurious = True
                        if b[B_TX_COUNT] == 1 or (not flags_n and tsecr == b[B_LAST_TSVAL]):
                            if rack_ts == NONE or b[B_XMIT_TS] > rack_ts:
                                rack_ts = b[B_XMIT_TS]
                                rack_rtt = now - b[B_XMIT_TS]
                        _leave_flight(s, b)
                        b[B_FLAGS] = (b[B_FLAGS] & ~(BF_LOST | BF_RNR)) | BF_SACKED
    rtt = NONE
    if not flags_n and n > 0:                         # MR-LOSS-001 (RFC 7323 section 4.3)
        su = (tsval_of(now) - tsecr) & 0xFFFFFFFF     # not in the future: less than 2^31 us back
        if su < RTT_SAMPLE_MAX and ((tsecr - ts_lo) & 0xFFFFFFFF) < RTT_SAMPLE_MAX:
            rtt = su * 1000                           # and not before the newly delivered PSNs were sent
            _rtt_sample(s, par, rtt, now)
        else:
            s[S_C_RTT_BAD] += 1
    mp_on_sack(pt, par, sport, rtt, flags_ce, now)    # MR-MP-007
    if s[S_SRTT] != NONE and (s[S_MP_ROUND_END] == NONE or now >= s[S_MP_ROUND_END]):
        if s[S_MP_ROUND_END] != NONE:
            mp_on_round(pt, par, now)                 # MR-MP-012
        s[S_MP_ROUND_END] = now + s[S_SRTT]
    s[S_LAST_SACK_TS] = now
    if stale:
        s[S_C_SACK_STALE] += 1
        _cc_on_sack(s, par, 0, rtt, ce_new, flags_ce, 1, now)
        return SACK_STALE
    s[S_RACK_XMIT_TS] = rack_ts
    s[S_RACK_RTT] = rack_rtt
    if spurious:                                       # MR-SACK-030, MR-CC-024
        s[S_C_SPURIOUS] += 1
        s[S_RECOV_CLEAN] = 0
        if s[S_SRTT] == NONE or reo_wnd(s, par) < s[S_SRTT]:
            s[S_REO_MULT] += 1
        if s[S_CWND_BEFORE_CUT] != NONE:
            if s[S_CWND_BEFORE_CUT] > s[S_CWND]:
                old = s[S_CWND]
                s[S_CWND] = s[S_CWND_BEFORE_CUT]
                _repace(s, old, now)                     # MR-CC-043
            s[S_CWND_BEFORE_CUT] = NONE
    newly_lost = _detect_losses(s, sb, pt, par, now)
    _cc_on_sack(s, par, n, rtt, ce_new, flags_ce, 0, now)
    if par[P_CREDITS]:                                 # MR-CC-014
        if s[S_BEST_CUM] == PSN_NONE or not _before(cum, s[S_BEST_CUM]):
            c = credit
            if c < 1:
                c = 1
            if c > par[P_W]:
                c = par[P_W]
            s[S_BEST_CUM] = cum
            s[S_RIGHT_EDGE] = (cum + c) & PSN_MASK
    if newly_lost:
        _cc_on_loss(s, par, now, 1)                    # MR-CC-022 / MR-CC-041
    if s[S_SND_UNA] != una:
        s[S_RETRY_COUNT] = 0                           # MR-LOSS-008
        s[S_CONSEC_RTO] = 0                            # MR-CC-023
        if s[S_RNR_UNTIL] == NONE:
            s[S_RNR_COUNT] = 0                         # MR-SACK-041
    s[S_PROBE_OUT] = 0                                 # MR-LOSS-011
    if n > 0 and s[S_RNR_UNTIL] == NONE:
        s[S_RTO_AT] = now + s[S_RTO]                   # MR-LOSS-006
    _arm_timers(s, par, now)
    return n


@lazy_njit("int64(int64[::1], int64[:, ::1], int64[:, ::1], int64[::1], int64, int64, int64, int64, int64,"
      " int64, int64, int64)", **_jit)
def tx_on_rnr_nak(s, sb, pt, par, psn, syndrome, starts_recv, tsecr, flags, ce_count, credit, now):
    """An RNR NAK-type SACK (syndrome 0x20-0x3F) for `psn`; starts_recv: psn is the first PSN of a
    recv-consuming message.  MR-SACK-036 (accept or discard), MR-SACK-041 (during a wait: only
    acknowledgement and feedback), MR-SACK-040 (start: stop timers, hold PSNs).  Returns 1 when
    a wait started, 0 when only acknowledged, -1 discarded, -2 the QP failed (RNR_RETRY_EXC)."""
    words = np.zeros(1, np.int64)
    if s[S_RNR_UNTIL] != NONE:
        tx_on_sack(s, sb, pt, par, (psn - 1) & PSN_MASK, 0, words, tsecr, flags, ce_count, credit, -1, now)
        s[S_C_RNR_WAIT] += 1
        return 0
    una = s[S_SND_UNA]
    if not ((psn == una or _before(una, psn)) and _before(psn, s[S_SND_NXT])) or not starts_recv:
        s[S_C_RNR_INV] += 1
        return -1
    tx_on_sack(s, sb, pt, par, (psn - 1) & PSN_MASK, 0, words, tsecr, flags, ce_count, credit, -1, now)
    s[S_C_RNR] += 1
    s[S_RNR_COUNT] += 1
    if par[P_RNR_RETRY] != 7 and s[S_RNR_COUNT] > par[P_RNR_RETRY]:
        s[S_FAILED] = 1
        return -2
    s[S_RNR_UNTIL] = now + RNR_TIMER_US[syndrome & 0x1F] * 1000
    s[S_RNR_PSN] = psn
    s[S_RTO_AT] = NONE
    s[S_PTO_AT] = NONE
    s[S_REO_AT] = NONE
    p = psn
    while p != s[S_SND_NXT]:
        b = sb[p & WMASK]
        if b[B_FLAGS] & BF_OUT and not (b[B_FLAGS] & BF_SACKED):
            _leave_flight(s, b)
            b[B_FLAGS] = (b[B_FLAGS] & ~BF_LOST) | BF_RNR
        p = (p + 1) & PSN_MASK
    return 1


# ------------------------------------------------------------------ timers
@lazy_njit("int64(int64[::1])", **_jit)
def tx_next_deadline(s):
    """The earliest armed timer (ns), NONE if none (the caller also wakes for pacing)."""
    t = NONE
    for c in (S_RNR_UNTIL, S_RTO_AT, S_PTO_AT, S_REO_AT):
        v = s[c]
        if v != NONE and (t == NONE or v < t):
            t = v
    return t


@lazy_njit("int64(int64[::1], int64[:, ::1], int64[:, ::1], int64[::1], int64)", **_jit)
def tx_on_timer(s, sb, pt, par, now):
    """Run the timers that are due (04 sections 4.3.5, 4.3.6, 4.6.3, 4.6.4).  Returns
    (action << 32) | psn: ACT_RTO retransmit psn now with AckReq (exempt from cwnd, MR-CC-003),
    then the other lost PSNs under the window; ACT_TLP probe psn with AckReq; ACT_LOST /
    ACT_RNR_END lost PSNs are waiting (tx_next_lost); ACT_FAIL retry_cnt exceeded (MR-LOSS-009);
    ACT_NONE nothing."""
    if s[S_FAILED]:
        return ACT_FAIL << 32
    if s[S_RNR_UNTIL] != NONE:
        if now < s[S_RNR_UNTIL]:
            return ACT_NONE << 32
        s[S_RNR_UNTIL] = NONE                           # MR-SACK-042
        p = s[S_SND_UNA]
        while p != s[S_SND_NXT]:
            b = sb[p & WMASK]
            if b[B_FLAGS] & BF_RNR:
                b[B_FLAGS] &= ~BF_RNR
                b[B_FLAGS] |= BF_LOST
                s[S_N_LOST] += 1
                s[S_C_RETX_RNR] += 1
            p = (p + 1) & PSN_MASK
        s[S_RTO_AT] = now + s[S_RTO]
        _arm_timers(s, par, now)
        return (ACT_RNR_END << 32) | s[S_RNR_PSN]
    if s[S_RTO_AT] != NONE and now >= s[S_RTO_AT]:     # MR-LOSS-007
        s[S_RETRY_COUNT] += 1
        if s[S_RETRY_COUNT] > par[P_RETRY_CNT]:
            s[S_FAILED] = 1                             # MR-LOSS-009
            return ACT_FAIL << 32
        p = s[S_SND_UNA]
        while p != s[S_SND_NXT]:
            b = sb[p & WMASK]
            if b[B_FLAGS] & BF_OUT and not (b[B_FLAGS] & (BF_SACKED | BF_LOST)):
                _mark_lost(s, b, 0)                     # not attributed to a path (MR-MP-008)
            p = (p + 1) & PSN_MASK
        r = 2 * s[S_RTO]
        s[S_RTO] = r if r < par[P_RTO_MAX] else par[P_RTO_MAX]
        s[S_CONSEC_RTO] += 1                            # MR-CC-023
        old = s[S_CWND]
        if s[S_CWND_BEFORE_CUT] == NONE or s[S_CWND_BEFORE_CUT] < old:
            s[S_CWND_BEFORE_CUT] = old                  # MR-CC-045: undone if the RTO proves spurious
        _mdf_cut(s, par)
        if s[S_CONSEC_RTO] >= par[P_RTO_CWND_RESET]:
            s[S_CWND] = par[P_MIN_CWND]
        s[S_C_DEC_RTO] += 1
        s[S_RTO_AT] = now + s[S_RTO]
        s[S_PROBE_OUT] = 0
        s[S_PTO_AT] = NONE
        s[S_REO_AT] = NONE
        return (ACT_RTO << 32) | tx_next_lost(s, sb)
    act = ACT_NONE
    if s[S_REO_AT] != NONE and now >= s[S_REO_AT]:     # MR-SACK-028 reordering timer
        if _detect_losses(s, sb, pt, par, now):
            _cc_on_loss(s, par, now, 1)
            act = ACT_LOST
    if s[S_PTO_AT] != NONE and now >= s[S_PTO_AT]:     # MR-LOSS-010
        s[S_PTO_AT] = NONE
        p = s[S_SND_NXT]
        while p != s[S_SND_UNA]:
            p = (p - 1) & PSN_MASK
            b = sb[p & WMASK]
            if b[B_FLAGS] & BF_OUT and not (b[B_FLAGS] & BF_SACKED):
                s[S_PROBE_OUT] = 1
                return (ACT_TLP << 32) | p
    return act << 32
