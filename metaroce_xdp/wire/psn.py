"""PSN arithmetic modulo 2^24 (MR-BTH-020: PSN is a 24-bit serial number).

Order (MR-BTH-020): `a` is before `b` when (b - a) mod 2^24 lies in [1, 2^23) -- `psn_lt`.
A requester never has 2^23 PSNs outstanding (MR-BTH-021), so two PSNs of one live window are never
2^23 apart; a peer's packet can be.

`psn_diff` is the signed distance the compiled plane classifies with (dp/'s role modules and native/plane.py
import this function: one midpoint rule).  It lies in [-2^23, 2^23): the midpoint counts as *behind*, so a
request 2^23 away from the expected PSN is in the duplicate region [ePSN - 2^23, ePSN) and the
out-of-sequence region is (ePSN, ePSN + 2^23) -- the same split as Linux rxe's psn_compare (the
24-bit difference shifted into the sign bit of an s32).  It is compiled (numba) so that compiled
callers inline it; from Python it is an ordinary function.
"""
from __future__ import annotations

from numba import njit
from .. import jitcache  # noqa: F401,E402  (cache keyed on every module compiled code depends on)

PSN_BITS = 24
PSN_MOD = 1 << PSN_BITS
PSN_MASK = PSN_MOD - 1
PSN_HALF = 1 << (PSN_BITS - 1)


def psn_add(psn: int, n: int) -> int:
    return (psn + n) & PSN_MASK


@njit(cache=True, nogil=True)
def psn_diff(a, b):
    """Signed distance a - b in [-2^23, 2^23) (negative: a is before b, or exactly 2^23 away)."""
    d = (a - b) & PSN_MASK
    if d >= PSN_HALF:
        d -= PSN_MOD
    return d


def psn_lt(a: int, b: int) -> bool:
    """a is strictly before b (MR-BTH-020)."""
    d = (b - a) & PSN_MASK
    return 0 < d < PSN_HALF


def psn_le(a: int, b: int) -> bool:
    return a == b or psn_lt(a, b)


def psn_in_window(psn: int, start: int, count: int) -> bool:
    """psn lies in [start, start + count) modulo 2^24 (count <= 2^23)."""
    return ((psn - start) & PSN_MASK) < count
