"""PSN arithmetic modulo 2^24 (MR-BTH-020: PSN is a 24-bit serial number).

`a` is before `b` when (b - a) mod 2^24 lies in (0, 2^23): the same
half-window rule as IBTA and as RFC 1982 serial numbers.
"""
from __future__ import annotations

PSN_BITS = 24
PSN_MOD = 1 << PSN_BITS
PSN_MASK = PSN_MOD - 1
PSN_HALF = 1 << (PSN_BITS - 1)


def psn_add(psn: int, n: int) -> int:
    return (psn + n) & PSN_MASK


def psn_diff(a: int, b: int) -> int:
    """Signed distance a - b in (-2^23, 2^23]."""
    d = (a - b) & PSN_MASK
    return d - PSN_MOD if d > PSN_HALF else d


def psn_lt(a: int, b: int) -> bool:
    """a is strictly before b."""
    d = (b - a) & PSN_MASK
    return 0 < d < PSN_HALF


def psn_le(a: int, b: int) -> bool:
    return a == b or psn_lt(a, b)


def psn_in_window(psn: int, start: int, count: int) -> bool:
    """psn lies in [start, start + count) modulo 2^24 (count <= 2^23)."""
    return ((psn - start) & PSN_MASK) < count
