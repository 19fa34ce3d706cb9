"""One PSN midpoint rule (issue 20): wire/psn.py's psn_diff is the signed PSN distance everywhere.

psn_diff(a, b) lies in [-2^23, 2^23): a PSN exactly 2^23 away counts as behind (rxe's psn_compare;
a request there is in the responder's duplicate region [ePSN - 2^23, ePSN)).  MR-BTH-020's strict
order (psn_lt) leaves that midpoint unordered.  The compiled plane classifies with this very
function: dp/'s role modules import it, and no other module of the package defines one.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from metaroce_xdp.wire import psn as P

PKG = Path(__file__).resolve().parents[2] / "metaroce_xdp"
HALF = 1 << 23

pytestmark = pytest.mark.compiles      # psn_diff is compiled: called here with Python ints


@pytest.mark.parametrize("a, b, want", [
    (0, 0, 0),
    (1, 0, 1), (0, 1, -1),
    (0, 0xFFFFFF, 1), (0xFFFFFF, 0, -1),                  # across the wrap
    (HALF - 1, 0, HALF - 1), (0, HALF - 1, -(HALF - 1)),  # the largest distances both ways
    (HALF, 0, -HALF), (0, HALF, -HALF),                   # the midpoint: behind, whichever way round
    (HALF + 5, 5, -HALF), (0xFFFFFF, HALF - 1, -HALF),
    (HALF + 1, 0, -(HALF - 1)),
])
def test_psn_diff_at_the_boundaries(a, b, want):
    assert P.psn_diff(a, b) == want


def test_psn_diff_range_and_agreement_with_psn_lt():
    """Everywhere but the midpoint, psn_diff's sign is MR-BTH-020's order."""
    for d in list(range(0, 70)) + list(range(HALF - 70, HALF + 70)) + list(range((1 << 24) - 70, 1 << 24)):
        for a in (0, 12345, 0xFFFFF0):
            b = (a + d) & P.PSN_MASK
            got = P.psn_diff(b, a)
            assert -HALF <= got < HALF
            assert (got - d) % (1 << 24) == 0
            if d != HALF:
                assert (got > 0) == P.psn_lt(a, b) and (got < 0) == P.psn_lt(b, a)
            else:
                assert got == -HALF and not P.psn_lt(a, b) and not P.psn_lt(b, a)


def _defines(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text(), str(path))
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in ast.walk(tree))


def test_no_other_psn_diff_in_the_package():
    defs = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if _defines(p, "psn_diff"))
    assert defs == ["wire/psn.py"], defs


def test_the_compiled_plane_uses_the_same_function_object():
    """Importing dp/ loads its compiled loop (numba's cache; compiled when cold)."""
    from metaroce_xdp.dp import completer, core, requester, responder, round  # noqa: F401
    for mod in (completer, core, requester, responder):
        assert mod.psn_diff is P.psn_diff, mod.__name__
