"""Findings of issue 19 that are known to be open on this branch: a crash the fuzzers find is "known" when
its description matches one of these signatures, and the short form (tests/test_fuzz_*.py) passes with
known crashes only.  Once the fixes are merged, switch them all off -- empty KNOWN_OPEN, or run with
METAROCE_FUZZ_STRICT=1 (make fuzz FUZZ_ARGS=--strict) -- and every crash fails the run.

A signature: (finding, regex over the crash's `what` + `where` text, one line on the cause).  "F<n>" is finding n of
issue 19; "N<n>" a hole these fuzzers found that the issue does not list (open until someone fixes it).
"""
from __future__ import annotations

import os
import re

# Empty since the issue-19 fixes landed: F2, F3, F4, F9 and the fuzzers' own N1 (modify_qp resolved the MAC
# on the control thread) and N2 (a request id nearly filling MAX_MSG made the error reply too large) are
# fixed, each with a regression test (docs/fuzzing.md, "What the fuzzers found").  Name a signature here
# only for a hole that is filed and not yet fixed.
KNOWN_OPEN: tuple[tuple[str, str, str], ...] = ()


def avoid() -> bool:
    """Generate around the known-open findings (METAROCE_FUZZ_AVOID_KNOWN=1, --avoid-known): JSON nesting at most
    800 deep (F3), no address within 2^32 below 2^63 or 2^64 (F2), no QP aimed at the neighbour that never
    answers (N1), so that a long run on a branch where they are
    still open spends its time looking past them.  The rest of each case is as without it."""
    return os.environ.get("METAROCE_FUZZ_AVOID_KNOWN", "") not in ("", "0")


def near_2_63(v) -> bool:
    """An address of finding 2's shape: within 2^32 below 2^63, or below 2^64 (negative as int64)."""
    if not isinstance(v, int):
        return False
    v %= 1 << 64
    return (1 << 63) - (1 << 32) <= v < (1 << 63) or v >= (1 << 64) - (1 << 32)


def strict() -> bool:
    """Every crash is a failure: after the merge (METAROCE_FUZZ_STRICT=1)."""
    return os.environ.get("METAROCE_FUZZ_STRICT", "") not in ("", "0")


def classify(text: str) -> str | None:
    """The finding a crash description matches ("F2"...), or None: a NEW hole (or a known one fixed
    differently).  Always None in strict mode."""
    if strict():
        return None
    for fid, rx, _ in KNOWN_OPEN:
        if re.search(rx, text, re.S):
            return fid
    return None
