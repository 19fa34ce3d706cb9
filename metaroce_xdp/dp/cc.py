"""DCQCN in the compiled plane (parameters: congestion.py).

* Notification point: a CE-marked request or READ RESPONSE that was accepted is counted and answered by
  at most one CNP per cnp_interval (`np_on_ce`, `send_cnp`; MR-ECN-007).
* Reaction point: the kernel's per-QP cnp_count cuts the rate (`rp_cnps`), alpha decays every K, the rate
  timer T and byte counter B raise it again (`rp_advance`, `rp_increase`), and a token bucket paces the
  QP's packets (`rp_allowance`, `rp_on_sent`).

The state is float64 words of the arena (F table, F_* columns); row 0 holds the parameters (D_* columns).
"""
from __future__ import annotations

import numpy as np
from numba import njit
from .. import jitcache  # noqa: F401  (cache keyed on every module compiled code depends on)

from .layout import *  # noqa: F401,F403  (column numbers are compile-time constants)
from ..wire.fastpath import build_frame
from ..wire.hdr import ip_ecn, put_cnp
from .layout import NF, TM_CNP
from .prims import ld_acq_u64
from .ring import frame_alloc, tx_push
from .core import KS_CNP_COUNT, OP_CNP, ks_addr

_jit = dict(cache=True, nogil=True)

# of WIRE_OVERHEAD, what a built frame (Ethernet to ICRC, no FCS) lacks: FCS 4 + preamble/IFG 20
FRAME_TO_WIRE = 24
_MAX_STEPS = 4096
ECN_CE = 3                   # the ECN codepoint Congestion Experienced, binary 11 (RFC 3168)


@njit(**_jit)
def f_rows(A):
    """The float64 table: row 0 the DCQCN parameters (D_*), row qi the QP's state (F_*)."""
    o = A[P_F_OFF]
    m = A[P_MAXQ]
    return A[o:o + m * NF].view(np.float64).reshape((m, NF))


@njit(**_jit)
def rp_increase(F, qi):
    P = F[0]
    s = F[qi]
    lo = min(s[F_T_CNT], s[F_B_CNT])
    hi = max(s[F_T_CNT], s[F_B_CNT])
    if hi < P[D_F]:
        pass                                      # fast recovery: Rt unchanged
    elif lo > P[D_F]:
        s[F_RT] += (lo - P[D_F]) * P[D_R_HAI_BPS]   # hyper increase
    else:
        s[F_RT] += P[D_R_AI_BPS]                  # additive increase
    s[F_RT] = min(s[F_RT], P[D_R_LINE_BPS])
    s[F_RC] = min(P[D_R_LINE_BPS], (s[F_RT] + s[F_RC]) / 2)


@njit(**_jit)
def rp_advance(F, qi, now):
    """The alpha timer (K) and the rate timer (T) up to now (MR-CC-036, MR-CC-037)."""
    P = F[0]
    s = F[qi]
    k = np.int64(P[D_K_NS])
    t = np.int64(P[D_T_NS])
    ad = np.int64(s[F_ALPHA_DUE])
    if now >= ad:
        m = (now - ad) // k + 1
        n = m
        if s[F_CNP_IN_PERIOD] != 0:               # the period that saw a CNP does not decay alpha
            n -= 1
            s[F_CNP_IN_PERIOD] = 0
        s[F_ALPHA] *= (1 - P[D_G]) ** n
        s[F_ALPHA_DUE] = ad + m * k
    rd = np.int64(s[F_RATE_DUE])
    if now >= rd:
        n = (now - rd) // t + 1
        s[F_RATE_DUE] = rd + n * t
        if s[F_RC] >= P[D_R_LINE_BPS] and s[F_RT] >= P[D_R_LINE_BPS]:
            s[F_T_CNT] += n                       # at line rate an increase changes nothing
        else:
            for _ in range(min(n, _MAX_STEPS)):
                s[F_T_CNT] += 1
                rp_increase(F, qi)
            if n > _MAX_STEPS:
                s[F_T_CNT] += n - _MAX_STEPS
                s[F_RC] = P[D_R_LINE_BPS]
                s[F_RT] = P[D_R_LINE_BPS]


@njit(**_jit)
def rp_cnps(A, Q, qi, now):
    """CNPs the XDP program verified and counted into the QP's slot since the last look: the reaction
    point cuts the rate (MR-CC-035): Rt = Rc, Rc = max(R_min, Rc (1 - alpha/2)), alpha = (1-g) alpha + g."""
    if A[P_KS_ADDR] == 0:
        return
    c = ld_acq_u64(ks_addr(A, qi) + KS_CNP_COUNT)
    count = c - Q[qi, Q_K_CNP]
    if count <= 0:
        return
    Q[qi, Q_K_CNP] = c
    A[P_RX_CNP] += count
    F = f_rows(A)
    P = F[0]
    s = F[qi]
    s[F_RX_CNP] += count
    if P[D_ENABLED] == 0:
        return
    # MR-CC-035: one reaction per cnp_interval.  A notification point sends at most one CNP per interval
    # (MR-CNP-003); more in one interval are duplicates or forged -- a CNP carries no PSN, so its only
    # check is the QPN -- and must not cut the rate once each (they did, up to 64 a round).
    # (cnp_interval 0: each CNP reacts, up to 64 a look)
    cuts = min(count, 64)
    iv = np.int64(P[D_CNP_INTERVAL_NS])
    if iv > 0:
        last = np.int64(s[F_RP_LAST_CUT])
        if last != 0 and now - (last - 1) < iv:
            s[F_CNP_COALESCED] += count
            A[P_RX_CNP_COALESCED] += count
            return
        s[F_CNP_COALESCED] += count - 1
        A[P_RX_CNP_COALESCED] += count - 1
        s[F_RP_LAST_CUT] = now + 1                    # + 1: 0 is "never"
        cuts = 1
    rp_advance(F, qi, now)
    for _ in range(cuts):
        s[F_RT] = s[F_RC]
        s[F_RC] = max(P[D_R_MIN_BPS], s[F_RC] * (1 - s[F_ALPHA] / 2))
        s[F_ALPHA] = (1 - P[D_G]) * s[F_ALPHA] + P[D_G]
    s[F_RATE_CUTS] += 1
    s[F_RATE_MIN] = min(s[F_RATE_MIN], s[F_RC])
    s[F_CNP_IN_PERIOD] = 1
    s[F_T_CNT] = 0
    s[F_B_CNT] = 0
    s[F_BYTES_SINCE] = 0
    s[F_RATE_DUE] = now + P[D_T_NS]
    s[F_TOKENS] = min(s[F_TOKENS], P[D_BURST_BYTES])


@njit(**_jit)
def rp_allowance(A, qi, now, budget, packet_bytes):
    """How many of `budget` packets the QP may send now (MR-CC-034): at line rate all; below it the token
    bucket decides, and a positive balance lets one more packet go (paid in rp_on_sent)."""
    F = f_rows(A)
    P = F[0]
    if P[D_ENABLED] == 0:
        return budget
    s = F[qi]
    rp_advance(F, qi, now)
    dt = now - np.int64(s[F_T_TOKENS])
    s[F_T_TOKENS] = now
    if s[F_RC] >= P[D_R_LINE_BPS]:
        s[F_TOKENS] = P[D_BURST_BYTES]
        return budget
    if dt > 0:
        s[F_TOKENS] = min(P[D_BURST_BYTES], s[F_TOKENS] + dt * s[F_RC] / 8e9)
    if s[F_TOKENS] < 0:
        return 0
    return min(budget, 1 + np.int64(s[F_TOKENS] // max(1, packet_bytes)))


@njit(**_jit)
def rp_on_sent(A, qi, nbytes):
    """The QP put nbytes on the wire: pay the pacer, drive the byte counter B (MR-CC-037)."""
    F = f_rows(A)
    P = F[0]
    if P[D_ENABLED] == 0 or nbytes <= 0:
        return
    s = F[qi]
    s[F_TOKENS] -= nbytes
    s[F_BYTES_SINCE] += nbytes
    while s[F_BYTES_SINCE] >= P[D_B_BYTES]:
        s[F_BYTES_SINCE] -= P[D_B_BYTES]
        s[F_B_CNT] += 1
        rp_increase(F, qi)


@njit(**_jit)
def ce_marked(umem, l3):
    """ECN CE (binary 11) in the IPv4 TOS or IPv6 traffic class."""
    return ip_ecn(umem, l3) == ECN_CE


@njit(**_jit)
def np_on_ce(A, Q, TM, umem, tables, ext, qi, now):
    """A CE-marked request or READ RESPONSE was accepted: counted (MR-ECN-012) and answered by a CNP at
    most once per cnp_interval (MR-ECN-009, MR-CNP-002, MR-CNP-003); never on a QP with ECN disabled
    (MR-ECN-011), whose marks are only counted."""
    F = f_rows(A)
    s = F[qi]
    s[F_NP_CE] += 1
    A[P_RX_CE] += 1
    if Q[qi, Q_ECN_OFF] != 0:
        return
    if s[F_NP_LAST] >= 0 and now - np.int64(s[F_NP_LAST]) < np.int64(F[0, D_CNP_INTERVAL_NS]):
        return
    s[F_NP_LAST] = now
    s[F_NP_TX] += 1
    send_cnp(A, Q, TM, umem, tables, ext, qi)


@njit(**_jit)
def send_cnp(A, Q, TM, umem, tables, ext, qi):
    """One CNP to the peer QP from the QP's CNP template (its path, UDP source port and P_Key; DSCP
    cnp_dscp, Not-ECT, BECN 1): opcode 0x81, PSN 0, AckReq 0, 16 zero bytes (MR-CNP-001, MR-XH-016); no
    PSN consumed, never acknowledged (MR-CNP-004).  No free TX frame: the next CE mark sends one."""
    a = frame_alloc(A)
    if a < 0:
        return
    ext_len = put_cnp(ext, 0)
    n = build_frame(tables, umem, a, TM[qi, TM_CNP:], Q[qi, Q_TMPL_LEN], Q[qi, Q_L3_OFF], Q[qi, Q_IPV6] != 0,
                    OP_CNP, 0, 0, 0, ext, ext_len, ext, 0, 0)
    tx_push(A, a, n)
    A[P_TX_CNP] += 1
