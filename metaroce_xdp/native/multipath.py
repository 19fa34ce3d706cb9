"""Native multipath path selection (04-native.md 4.5.2): entropy values, weights, eviction, probes.

`pt` holds the K entropy values of one QP (rows 0..K-1 used); weights are fixed point (FP).
"""
from __future__ import annotations

import hashlib

from .. import jitcache  # noqa: F401,E402  (cache keyed on every module compiled code depends on)
from ..jitcache import lazy_njit  # noqa: E402  (explicit signatures, compiled or loaded at first use)

from .layout import *  # noqa: F401,F403
from .layout import FP, NONE

_jit = dict(cache=True, nogil=True)

ENTROPY_LO = 0xC000       # MR-MP-002: entropy values are UDP source ports in 0xC000-0xFFFF


def entropy_context(lqpn: int, rqpn: int, lgid: bytes, rgid: bytes) -> bytes:
    """What names the QP's two ends for MR-MP-002 and MR-MP-016: the local and remote QPNs (24 bits each)
    and GIDs (the IP addresses: 4 bytes for IPv4, 16 for IPv6)."""
    return ((lqpn & 0xFFFFFF).to_bytes(3, "big") + (rqpn & 0xFFFFFF).to_bytes(3, "big")
            + bytes(lgid) + bytes(rgid))


def entropy_values(secret: bytes, ctx: bytes, k: int) -> list[int]:
    """MR-MP-002: the QP's K entropy values, distinct UDP source ports in 0xC000-0xFFFF, from a pseudo-random
    function of the QP's ends `ctx` (entropy_context) under its per-QP random secret: BLAKE2b keyed with
    `secret` over ctx and a counter, 14 bits of each output under the 0xC000 prefix; an output equal to an
    earlier value is skipped (K <= 255 of 16384 ports, so a few extra draws at most).  Computed once at RTS
    (native/plane.py NativeSlots.start), so the set is fixed for the QP's life."""
    if not 1 <= k <= 0x4000:
        raise ValueError(f"entropy count {k} outside 1-16384")
    out: list[int] = []
    seen: set[int] = set()
    i = 0
    while len(out) < k:
        h = hashlib.blake2b(ctx + i.to_bytes(4, "big"), key=secret, digest_size=2, person=b"MR-MP-002")
        v = ENTROPY_LO | (int.from_bytes(h.digest(), "big") & 0x3FFF)
        i += 1
        if v not in seen:
            seen.add(v)
            out.append(v)
    return out


def flow_label_key(secret: bytes, ctx: bytes) -> int:
    """MR-MP-016: the 63-bit key of native/plane_slot.py flow_label, the same keyed function as entropy_values over the
    same ends and secret (another personalisation), so a value's label is a pseudo-random function of the
    value, the QPNs, the GIDs and the secret."""
    h = hashlib.blake2b(ctx, key=secret, digest_size=8, person=b"MR-MP-016")
    return int.from_bytes(h.digest(), "little") >> 1


@lazy_njit("void(int64[:, ::1], int64[::1], int64[::1])", **_jit)
def mp_init(pt, par, sports):
    """QP enters RTS: K values from `sports` (MR-MP-002 derives them), all ACTIVE with weight 1.  The
    rest of `sports` (rows K..KMAX-1, 0 = none) are the fresh values MR-MP-011 may replace an evicted
    value with, kept in those rows' E_SPORT and cleared when taken."""
    k = par[P_K]
    for i in range(k, pt.shape[0]):
        pt[i, :] = 0
        pt[i, E_SPORT] = sports[i] if i < sports.shape[0] else 0
    for i in range(k):
        e = pt[i]
        e[:] = 0
        e[E_SPORT] = sports[i]
        e[E_STATE] = ST_ACTIVE
        e[E_WEIGHT] = FP
        e[E_SRTT] = NONE
        e[E_LOSS_START] = NONE
        e[E_EVICT_UNTIL] = NONE
        e[E_PENALIZED_SINCE] = NONE
        e[E_LAST_PROBE] = NONE


@lazy_njit("boolean(int64[:, ::1], int64)", **_jit)
def _usable(pt, i):
    s = pt[i, E_STATE]
    return s == ST_ACTIVE or s == ST_PENALIZED


@lazy_njit("int64(int64[:, ::1], int64[::1])", **_jit)
def _min_active_srtt(pt, par):
    m = NONE
    for i in range(par[P_K]):
        if pt[i, E_STATE] == ST_ACTIVE and pt[i, E_SRTT] != NONE:
            if m == NONE or pt[i, E_SRTT] < m:
                m = pt[i, E_SRTT]
    return m


@lazy_njit("int64(int64[:, ::1], int64[::1], int64, int64)", **_jit)
def mp_pick(pt, par, srtt, now):
    """MR-MP-006/010: the entropy value for the next packet; index | PICK_PROBE when it is a probe
    on a PROBING value (the caller sets AckReq).  Smooth weighted round-robin over ACTIVE and
    PENALIZED values."""
    k = par[P_K]
    for i in range(k):
        e = pt[i]
        if e[E_STATE] == ST_EVICTED and now >= e[E_EVICT_UNTIL]:
            e[E_STATE] = ST_PROBING
        if e[E_STATE] == ST_PROBING and srtt != NONE and (e[E_LAST_PROBE] == NONE
                                                          or now - e[E_LAST_PROBE] >= srtt):
            e[E_LAST_PROBE] = now
            e[E_C_TX] += 1
            return i | PICK_PROBE
    best = -1
    total = 0
    for i in range(k):
        if _usable(pt, i):
            pt[i, E_CURRENT] += pt[i, E_WEIGHT]
            total += pt[i, E_WEIGHT]
            if best < 0 or pt[i, E_CURRENT] > pt[best, E_CURRENT]:
                best = i
    if best < 0:                     # cannot happen (MR-MP-013 keeps one usable); be safe
        best = 0
        pt[0, E_STATE] = ST_ACTIVE
        if pt[0, E_WEIGHT] < par[P_MP_MIN_WEIGHT]:
            pt[0, E_WEIGHT] = par[P_MP_MIN_WEIGHT]
    pt[best, E_CURRENT] -= total
    pt[best, E_C_TX] += 1
    return best


@lazy_njit("boolean(int64[:, ::1], int64[::1], int64, int64)", **_jit)
def _replace(pt, par, i, now):
    """MR-MP-011: the evicted value i gives way to the next fresh value (mp_init's spare rows, derived
    like the set, MR-MP-002, and not in it), ACTIVE with weight mp_initial_weight and no history;
    `since` marks when, so that losses of packets sent on the old value are not laid on the new one
    (sender._detect_losses).  False when no fresh value is left: the value stays EVICTED and is probed."""
    for j in range(par[P_K], pt.shape[0]):
        v = pt[j, E_SPORT]
        if v != 0:
            pt[j, E_SPORT] = 0
            e = pt[i]
            e[E_SPORT] = v
            e[E_STATE] = ST_ACTIVE
            e[E_WEIGHT] = par[P_MP_INITIAL_WEIGHT]
            e[E_CURRENT] = 0
            e[E_SRTT] = NONE
            e[E_CE_EWMA] = 0
            e[E_LOSS_N] = 0
            e[E_LOSS_START] = NONE
            e[E_EVICTIONS] = 0
            e[E_EVICT_UNTIL] = NONE
            e[E_PENALIZED_SINCE] = NONE
            e[E_LAST_PROBE] = NONE
            e[E_DIRTY] = 0
            e[E_SINCE] = now
            e[E_C_REPLACE] += 1
            return True
    return False


@lazy_njit("void(int64[:, ::1], int64[::1], int64, int64)", **_jit)
def _evict(pt, par, i, now):
    """MR-MP-010, MR-MP-013: evict value i unless it is the last usable one."""
    others = 0
    for j in range(par[P_K]):
        if j != i and _usable(pt, j):
            others += 1
    if others == 0:
        pt[i, E_STATE] = ST_ACTIVE
        if pt[i, E_WEIGHT] < par[P_MP_MIN_WEIGHT]:
            pt[i, E_WEIGHT] = par[P_MP_MIN_WEIGHT]
        return
    e = pt[i]
    e[E_STATE] = ST_EVICTED
    e[E_EVICTIONS] += 1
    e[E_C_EVICT] += 1
    d = par[P_MP_EVICT_TIME]
    for _ in range(e[E_EVICTIONS] - 1):
        d *= 2
        if d >= par[P_MP_EVICT_MAX]:
            break
    if d > par[P_MP_EVICT_MAX]:
        d = par[P_MP_EVICT_MAX]
    e[E_EVICT_UNTIL] = now + d
    e[E_LOSS_N] = 0
    e[E_LOSS_START] = NONE
    e[E_PENALIZED_SINCE] = NONE
    e[E_CURRENT] = 0
    if par[P_MP_REPLACE]:
        _replace(pt, par, i, now)


@lazy_njit("void(int64[:, ::1], int64[::1], int64, int64)", **_jit)
def _reclassify(pt, par, i, now):
    """MR-MP-009."""
    e = pt[i]
    if e[E_STATE] == ST_ACTIVE and e[E_WEIGHT] < par[P_MP_MIN_WEIGHT]:
        e[E_STATE] = ST_PENALIZED
        e[E_PENALIZED_SINCE] = now
    if e[E_LOSS_N] >= par[P_MP_EVICT_LOSSES] or (
            e[E_STATE] == ST_PENALIZED and now - e[E_PENALIZED_SINCE] > par[P_MP_EVICT_WINDOW]):
        _evict(pt, par, i, now)


@lazy_njit("int64(int64[:, ::1], int64[::1], int64)", **_jit)
def mp_index(pt, par, sport):
    for i in range(par[P_K]):
        if pt[i, E_SPORT] == sport:
            return i
    return -1


@lazy_njit("void(int64[:, ::1], int64[::1], int64, int64, int64, int64)", **_jit)
def mp_on_sack(pt, par, sport, rtt, ce, now):
    """MR-MP-007/009/010: feedback of a SACK to the value in its echo_sport (rtt in ns or NONE)."""
    i = mp_index(pt, par, sport)
    if i < 0:
        return
    e = pt[i]
    if rtt != NONE:
        e[E_SRTT] = rtt if e[E_SRTT] == NONE else (7 * e[E_SRTT] + rtt) // 8
    e[E_CE_EWMA] = (15 * e[E_CE_EWMA] + (FP if ce else 0)) // 16
    m = _min_active_srtt(pt, par)
    if e[E_STATE] == ST_PROBING:
        if not ce and rtt != NONE and (m == NONE or rtt * FP < par[P_MP_RTT_FACTOR] * m):
            e[E_STATE] = ST_ACTIVE
            e[E_WEIGHT] = par[P_MP_INITIAL_WEIGHT]
            e[E_CURRENT] = 0
        elif ce:
            _evict(pt, par, i, now)
        return
    if e[E_STATE] == ST_EVICTED:
        return                       # a late SACK for an evicted value changes nothing
    if ce:
        e[E_WEIGHT] = e[E_WEIGHT] * (FP - par[P_MP_CE_PENALTY] * e[E_CE_EWMA] // FP) // FP
        e[E_DIRTY] = 1
    if m != NONE and e[E_SRTT] != NONE and e[E_SRTT] * FP > par[P_MP_RTT_FACTOR] * m:
        e[E_WEIGHT] //= 2
    _reclassify(pt, par, i, now)


@lazy_njit("void(int64[:, ::1], int64[::1], int64, int64)", **_jit)
def mp_on_loss(pt, par, i, now):
    """MR-MP-008: a loss declared by SACK on value i halves its weight; mp_evict_losses losses
    within mp_evict_window evict it."""
    if i < 0 or i >= par[P_K]:
        return
    e = pt[i]
    e[E_C_LOSS] += 1
    if e[E_STATE] == ST_PROBING:
        _evict(pt, par, i, now)
        return
    if e[E_STATE] == ST_EVICTED:
        return
    e[E_WEIGHT] //= 2
    if e[E_LOSS_START] == NONE or now - e[E_LOSS_START] > par[P_MP_EVICT_WINDOW]:
        e[E_LOSS_START] = now
        e[E_LOSS_N] = 1
    else:
        e[E_LOSS_N] += 1
    e[E_DIRTY] = 1
    _reclassify(pt, par, i, now)


@lazy_njit("void(int64[:, ::1], int64[::1], int64)", **_jit)
def mp_on_round(pt, par, now):
    """MR-MP-012: once per srtt, values without loss or CE in the round recover mp_recover."""
    for i in range(par[P_K]):
        e = pt[i]
        if _usable(pt, i) and e[E_DIRTY] == 0:
            e[E_WEIGHT] += par[P_MP_RECOVER]
            if e[E_WEIGHT] >= FP:
                e[E_WEIGHT] = FP
                e[E_EVICTIONS] = 0
            if e[E_STATE] == ST_PENALIZED and e[E_WEIGHT] >= par[P_MP_MIN_WEIGHT]:
                e[E_STATE] = ST_ACTIVE
                e[E_PENALIZED_SINCE] = NONE
        if e[E_STATE] == ST_PENALIZED and now - e[E_PENALIZED_SINCE] > par[P_MP_EVICT_WINDOW]:
            _evict(pt, par, i, now)
        e[E_DIRTY] = 0


@lazy_njit("int64(int64[:, ::1], int64[::1], int64, int64, int64)", **_jit)
def mp_pick_retx(pt, par, srtt, now, avoid):
    """MR-SACK-025: the entropy value for a retransmission, other than `avoid` (the value the lost
    transmission used) when another usable value exists."""
    i = mp_pick(pt, par, srtt, now)
    if (i & 0xFFFF) != avoid or par[P_K] == 1:
        return i
    for _ in range(par[P_K]):
        j = mp_pick(pt, par, srtt, now)
        if (j & 0xFFFF) != avoid:
            return j
    return i
