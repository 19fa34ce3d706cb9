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

KNOWN_OPEN: tuple[tuple[str, str, str], ...] = (
    ("F3", r"RecursionError|maximum recursion depth",
     "deeply nested JSON: json.loads raises RecursionError, which proto.recv and Daemon._serve do not catch"),
    ("F2", r"SIGSEGV.*(near-2\^63|wrap)|(near-2\^63|wrap).*SIGSEGV",
     "mr_check/local_mr add untrusted va+len in int64: a VA just below 2^63 wraps past the bounds check (the "
     "fuzzers tag such a VA near-2^63 / wrap in the crash's description; a remote request or a ring entry)"),
    ("F4", r"status answered uid|ring dest=good",
     "status shows every tenant's QPs; a tenant may aim a QP at another's peer QP (same dgid, dest_qp) and "
     "inject into that connection"),
    ("N1", r"control thread was blocked.*modify_qp",
     "NEW, not in issue 19 (found by these fuzzers): modify_qp to RTR resolves the destination's MAC on the "
     "daemon's one control thread, up to 2 s per request for an address that does not answer ARP, so one tenant "
     "stalls every tenant's control requests and new connections, as often as it likes"),
    ("N2", r"MalformedRequest: message of \d+ bytes exceeds",
     "NEW, not in issue 19 (found by these fuzzers): a request (any op) whose `id` is a string of ~65,500 bytes "
     "fits MAX_MSG, but the reply echoes the id and does not; Session.push catches that and sends an error reply "
     "that echoes the same id, whose MalformedRequest nothing catches: metaroced exits"),
    ("F9", r"SIGBUS",
     "a placement faults on client memory that is not backed (hole, hugetlb)"),
)


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
