"""Native responder logic (04-native.md 4.3.2, 4.3.3, 4.4.4, 4.4.5): receive window, SACKs, RSN.

I/O free: the data plane validates a packet (04 section 4.4.1 checks 1-2 and 4-9), calls
`rx_on_packet` for check 3 (window, duplicates) and to record it, places the payload when
the result has RX_NEW, and builds a NATIVE_SACK from `rx_build_sack` when the result has
RX_SACK_NOW or when `rx_sack_due` says the coalescing timer ran out.
"""
from __future__ import annotations

from .. import jitcache  # noqa: F401,E402  (cache keyed on every module compiled code depends on)
from ..jitcache import lazy_njit  # noqa: E402  (explicit signatures, compiled or loaded at first use)

from .layout import *  # noqa: F401,F403  (column numbers are compile-time constants)
from .layout import NONE, PSN_HALF, PSN_MASK, R_BM, WMASK

_jit = dict(cache=True, nogil=True)

RX_NEW, RX_DUP, RX_OOW, RX_SACK_NOW = 1, 2, 4, 8
RSN_NOT_READY, RSN_INVALID = -1, -2

_ROW = "int64[::1]"


@lazy_njit("boolean(int64[::1], int64)", **_jit)
def _bit(r, psn):
    i = psn & WMASK
    return (r[R_BM + (i >> 6)] >> (i & 63)) & 1 == 1


@lazy_njit("void(int64[::1], int64, int64)", **_jit)
def _setbit(r, psn, v):
    i = psn & WMASK
    m = 1 << (i & 63)
    if v:
        r[R_BM + (i >> 6)] |= m
    else:
        r[R_BM + (i >> 6)] &= ~m


@lazy_njit("int64(int64[::1], int64)", **_jit)
def _past_recorded(r, epsn):
    """PSN epsn has arrived in order: the ePSN moves past it and past every PSN recorded out of order
    right behind it (their bits cleared, nrec counted down).  Returns the new ePSN, also stored."""
    epsn = (epsn + 1) & PSN_MASK
    while r[R_NREC] > 0 and _bit(r, epsn):
        _setbit(r, epsn, 0)
        r[R_NREC] -= 1
        epsn = (epsn + 1) & PSN_MASK
    r[R_EPSN] = epsn
    return epsn


@lazy_njit("void(int64[::1], int64[::1], int64)", **_jit)
def rx_init(r, par, epsn):
    """QP enters RTR: ePSN = the peer's initial PSN, nothing recorded."""
    r[:] = 0
    r[R_EPSN] = epsn & PSN_MASK
    r[R_HIGHEST] = (epsn - 1) & PSN_MASK
    r[R_FIRST_TS] = NONE
    r[R_CREDIT] = par[P_INIT_CREDIT]
    r[R_EDGE] = NONE                                    # no right edge advertised yet (MR-CC-016)
    r[R_LAST_RX_TS] = NONE


@lazy_njit("int64(int64[::1], int64[::1], int64, int64, int64, int64, int64, int64, int64)", **_jit)
def rx_on_packet(r, par, psn, ackreq, ce, has_ts, tsval, sport, now):
    """A validated native request packet with PSN `psn` arrived (check 3 of 4.4.1 and the SACK
    triggers).  Returns RX_* flags: RX_NEW record and place it (MR-SACK-010), RX_DUP a duplicate
    (MR-SACK-013: do not place again), RX_OOW beyond the window (MR-SACK-011: drop, no SACK),
    RX_SACK_NOW send a SACK now (MR-SACK-013/014/016, or the packet count of MR-SACK-015)."""
    w = par[P_W]
    out = 0
    imm = False
    if ce:                                              # MR-CC-025, MR-SACK-007, MR-SACK-016
        if r[R_CE_COUNT] == 0:
            imm = True
        if r[R_CE_COUNT] < 0xFFFF:
            r[R_CE_COUNT] += 1
        r[R_CE_TOTAL] = (r[R_CE_TOTAL] + 1) & 0xFFFF     # MR-SACK-007: what every SACK reports
    epsn = r[R_EPSN]
    d = (psn - epsn) & PSN_MASK
    if d < w:
        if d == 0 or not _bit(r, psn):
            out |= RX_NEW
            r[R_C_NEW] += 1
            hi = r[R_HIGHEST]
            if d == 0:
                epsn = _past_recorded(r, epsn)
                if r[R_NREC] > 0:
                    imm = True                          # fills a gap, MR-SACK-014 (2)
                    # highest stays (it is beyond the new ePSN)
                else:
                    r[R_HIGHEST] = (epsn - 1) & PSN_MASK
            else:
                _setbit(r, psn, 1)
                r[R_NREC] += 1
                dh = (psn - hi) & PSN_MASK
                if 1 < dh < PSN_HALF:
                    imm = True                          # opens a new gap, MR-SACK-014 (1)
                if 0 < dh < PSN_HALF:
                    r[R_HIGHEST] = psn
        else:
            out |= RX_DUP
            r[R_C_DUP] += 1
            imm = True                                  # MR-SACK-014 (4)
    elif d > PSN_HALF:
        out |= RX_DUP                                   # before the ePSN: duplicate
        r[R_C_DUP] += 1
        imm = True
    else:
        r[R_C_OOW] += 1                                 # MR-SACK-011: no record, no SACK
        return RX_OOW
    r[R_TRIG_TSVAL] = tsval if has_ts else 0            # MR-SACK-006: the triggering packet
    r[R_TRIG_N] = 0 if has_ts else 1
    r[R_TRIG_SPORT] = sport
    r[R_TRIG_CE] = 1 if ce else 0
    r[R_LAST_RX_TS] = now
    if ackreq:
        imm = True                                      # MR-SACK-014 (3)
    r[R_SINCE_SACK] += 1
    if r[R_FIRST_TS] == NONE:
        r[R_FIRST_TS] = now
    if r[R_SINCE_SACK] >= par[P_ACK_N]:
        imm = True                                      # MR-SACK-015 count
    if imm:
        out |= RX_SACK_NOW
    return out


@lazy_njit("boolean(int64[::1], int64[::1], int64)", **_jit)
def rx_sack_due(r, par, now):
    """MR-SACK-015/017: the coalescing timer T ran out with a packet received since the last SACK."""
    return r[R_SINCE_SACK] > 0 and now - r[R_FIRST_TS] >= par[P_ACK_T]


@lazy_njit("int64(int64[::1], int64[::1])", **_jit)
def rx_sack_deadline(r, par):
    """When rx_sack_due becomes true (NONE: nothing to acknowledge)."""
    if r[R_SINCE_SACK] == 0:
        return NONE
    return r[R_FIRST_TS] + par[P_ACK_T]


@lazy_njit("int64(int64[::1], int64[::1], int64[::1], int64[::1])", **_jit)
def rx_build_sack(r, par, hdr, words):
    """Fill an ACK-type NATIVE_SACK (4.3.1) and restart coalescing.  hdr gets
    [cum PSN, bitmap_words, tsecr, credit, ce_count, echo_sport, flags byte (CE 0x80, N 0x40)],
    words[0:bitmap_words] the 32-bit bitmap words (bit i = PSN cum + 2 + i, MR-SACK-004;
    the fewest words covering `highest`, MR-SACK-005).  Returns bitmap_words."""
    epsn = r[R_EPSN]
    cum = (epsn - 1) & PSN_MASK
    nw = 0
    if r[R_NREC] > 0:
        span = (r[R_HIGHEST] - epsn) & PSN_MASK        # highest - ePSN, >= 1
        nw = (span + 31) >> 5
        lim = par[P_W] >> 5
        if nw > lim:
            nw = lim
    for j in range(nw):
        words[j] = 0
    left = r[R_NREC]
    for i in range(32 * nw):
        if left == 0:
            break
        p = (epsn + 1 + i) & PSN_MASK
        if _bit(r, p):
            words[i >> 5] |= 1 << (31 - (i & 31))
            left -= 1
    hdr[0] = cum
    hdr[1] = nw
    hdr[2] = r[R_TRIG_TSVAL]
    if par[P_CREDITS]:                                  # MR-SACK-008, MR-CC-015
        c = r[R_CREDIT]
        if c < 1:
            c = 1
        if c > par[P_W]:
            c = par[P_W]
        if r[R_EDGE] != NONE:                           # MR-CC-016: cum + credit never moves backwards; a
            d = (r[R_EDGE] - cum) & PSN_MASK            # lower share shows as the cumulative PSN advances
            if c < d < PSN_HALF:                        # (the last edge lies ahead of cum + c: keep it)
                c = d if d < par[P_W] else par[P_W]
        hdr[3] = c
        r[R_EDGE] = (cum + c) & PSN_MASK
    else:
        hdr[3] = 0xFFFF
    hdr[4] = r[R_CE_TOTAL]                              # MR-SACK-007: the running count, modulo 2^16
    hdr[5] = r[R_TRIG_SPORT]
    hdr[6] = (0x80 if r[R_TRIG_CE] else 0) | (0x40 if r[R_TRIG_N] else 0)
    r[R_SINCE_SACK] = 0
    r[R_FIRST_TS] = NONE
    r[R_CE_COUNT] = 0                                   # marks since this SACK (MR-SACK-016)
    r[R_C_SACKS] += 1
    return nw


@lazy_njit("int64(int64[::1], int64[:, ::1], int64[::1], int64[::1], int64, int64, int64, int64)", **_jit)
def rx_rsn_check(r, rm, lr, par, rsn, msn, last_psn, posted):
    """A packet of a recv-consuming message (RSN `rsn`, message `msn` ending at `last_psn`):
    its receive offset k (MR-OOO-006, the (k+1)-th oldest receive WQE not yet completed) when
    ready; RSN_NOT_READY when k >= posted (MR-OOO-012: do not record, RNR per MR-SACK-035);
    RSN_INVALID when k >= W or the RSN contradicts an earlier packet (MR-OOO-026): another
    message holds the RSN, or the message ending at `last_psn` (the same MSN: distinct incomplete
    messages end at distinct PSNs of the window) holds another RSN.  lr (WMAX words, by last
    PSN): RSN + 1 of the message recorded as ending there, trusted only while rm still holds it."""
    k = (rsn - r[R_RSN_NEXT]) & PSN_MASK
    if k >= par[P_W]:
        r[R_C_RSN_INV] += 1
        return RSN_INVALID
    m = rm[rsn & WMASK]
    if m[M_STATE] == 1:
        if m[M_RSN] != rsn or m[M_MSN] != msn or m[M_LAST_PSN] != last_psn:
            r[R_C_RSN_INV] += 1
            return RSN_INVALID
    o = lr[last_psn & WMASK] - 1
    if o >= 0 and o != rsn:
        mo = rm[o & WMASK]
        if mo[M_STATE] == 1 and mo[M_RSN] == o and mo[M_LAST_PSN] == last_psn:
            r[R_C_RSN_INV] += 1                         # MR-OOO-026: its MSN came with RSN o before
            return RSN_INVALID
    if k >= posted:
        r[R_C_NOTREADY] += 1
        return RSN_NOT_READY
    if m[M_STATE] == 0:
        m[M_STATE] = 1
        m[M_RSN] = rsn
        m[M_MSN] = msn
        m[M_LAST_PSN] = last_psn
        lr[last_psn & WMASK] = rsn + 1
    return k


@lazy_njit("int64(int64[::1], int64[:, ::1], int64[::1])", **_jit)
def rx_recv_completions(r, rm, out):
    """Receive completions now due, in RSN (= receive WQE) order (MR-OOO-013): the oldest
    messages whose last PSN the cumulative PSN has reached (MR-OOO-014).  Writes their RSNs to
    out, advances rsn_next (MR-OOO-006) and returns how many."""
    n = 0
    epsn = r[R_EPSN]
    while n < out.shape[0]:
        rsn = r[R_RSN_NEXT]
        m = rm[rsn & WMASK]
        if m[M_STATE] != 1 or m[M_RSN] != rsn:
            break
        d = (epsn - m[M_LAST_PSN]) & PSN_MASK          # last_psn before ePSN
        if not (0 < d < PSN_HALF):
            break
        out[n] = rsn
        n += 1
        m[M_STATE] = 0
        r[R_RSN_NEXT] = (rsn + 1) & PSN_MASK
    return n


@lazy_njit("void(int64[:, ::1], int64[::1], int64)", **_jit)
def rx_credit_alloc(rxs, par, now):
    """MR-CC-018 reference allocation over the responder rows of one receiver: every QP active in
    the last active_window shares rx_budget packets; idle ones keep init_credit.  Run every
    credit_interval.  A share lowered here does not pull a right edge already advertised back:
    rx_build_sack grants less only as the cumulative PSN advances (MR-CC-016)."""
    n = rxs.shape[0]
    active = 0
    for q in range(n):
        t = rxs[q, R_LAST_RX_TS]
        if t != NONE and now - t <= par[P_ACTIVE_WINDOW]:
            active += 1
    share = par[P_RX_BUDGET] // (active if active > 0 else 1)
    if share < 1:
        share = 1
    for q in range(n):
        t = rxs[q, R_LAST_RX_TS]
        c = share if (t != NONE and now - t <= par[P_ACTIVE_WINDOW]) else par[P_INIT_CREDIT]
        rxs[q, R_CREDIT] = c if c < par[P_W] else par[P_W]


@lazy_njit("void(int64[::1], int64, int64, int64, int64, int64)", **_jit)
def rx_on_unrecorded(r, ce, has_ts, tsval, sport, now):
    """A request packet that is not recorded but answered -- a packet of a not-ready message (the RNR
    NAK-type SACK, MR-SACK-035) or one whose error is NAKed at once (MR-SACK-031): its ECN mark counts
    (MR-CC-025) and it is the trigger of that SACK, whose tsecr, credit, ce_count, echo_sport and
    flags rx_build_sack fills as for an ACK-type SACK (MR-SACK-032; the data plane sets the syndrome,
    BTH.PSN = the ePSN and bitmap_words 0)."""
    if ce:
        if r[R_CE_COUNT] < 0xFFFF:
            r[R_CE_COUNT] += 1
        r[R_CE_TOTAL] = (r[R_CE_TOTAL] + 1) & 0xFFFF
    r[R_TRIG_TSVAL] = tsval if has_ts else 0
    r[R_TRIG_N] = 0 if has_ts else 1
    r[R_TRIG_SPORT] = sport
    r[R_TRIG_CE] = 1 if ce else 0
    r[R_LAST_RX_TS] = now


@lazy_njit("void(int64[::1], int64, int64, int64, int64, int64)", **_jit)
def rx_on_not_ready(r, ce, has_ts, tsval, sport, now):
    """A packet of a not-ready recv-consuming message (MR-OOO-012): not recorded, but the trigger of
    the RNR NAK-type SACK the data plane may send for it (rx_on_unrecorded)."""
    rx_on_unrecorded(r, ce, has_ts, tsval, sport, now)
    r[R_C_NOTREADY] += 1


@lazy_njit("boolean(int64[::1], int64[::1], int64)", **_jit)
def rx_recorded(r, par, psn):
    """Has PSN `psn` been received (MR-SACK-013's duplicate test): before the ePSN (within 2^23) or
    recorded in the window.  Used for READ and atomic requests, whose duplicates are answered
    (MR-OOO-022, MR-OOO-024) rather than only SACKed."""
    d = (psn - r[R_EPSN]) & PSN_MASK
    if d >= PSN_HALF:
        return True
    return d < par[P_W] and d != 0 and _bit(r, psn)


@lazy_njit("int64(int64[::1], int64[::1], int64, int64, int64, int64, int64, int64, int64, int64)", **_jit)
def rx_on_range(r, par, psn, n, ackreq, ce, has_ts, tsval, sport, now):
    """A validated, new NATIVE_READ_REQ for the n PSNs from `psn` (MR-OOO-003: every PSN of the
    READ's range is recorded as received) or an atomic (n = 1, has_ts = 0): rx_on_packet for the
    request's PSN, then the rest of the range recorded without counting the packet again.
    Returns rx_on_packet's flags for the request, with RX_SACK_NOW if recording the range fills
    a gap."""
    out = rx_on_packet(r, par, psn, ackreq, ce, has_ts, tsval, sport, now)
    if not (out & RX_NEW):
        return out
    for i in range(1, n):
        p = (psn + i) & PSN_MASK
        epsn = r[R_EPSN]
        d = (p - epsn) & PSN_MASK
        if d >= par[P_W]:
            break                                       # the caller checked the range fits (check 7)
        if d == 0:
            epsn = _past_recorded(r, epsn)
            if r[R_NREC] > 0:
                out |= RX_SACK_NOW                      # fills a gap, MR-SACK-014 (2)
            else:
                r[R_HIGHEST] = (epsn - 1) & PSN_MASK
        elif not _bit(r, p):
            _setbit(r, p, 1)
            r[R_NREC] += 1
            dh = (p - r[R_HIGHEST]) & PSN_MASK
            if 0 < dh < PSN_HALF:
                r[R_HIGHEST] = p
    return out
