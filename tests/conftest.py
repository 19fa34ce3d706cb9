"""Suite-wide rule: a test that skips where its feature could run is a failure.

Every skip is listed (as with `pytest -rs`) and, unless its reason is one of the expected
ones below, the session fails.  Expected skips are those that are part of how a test
works, not a missing capability.  METAROCE_ALLOW_SKIPS=1 lets a developer on a machine
without root or tshark run what it can without the session failing.
"""
from __future__ import annotations

import os
import re

import pytest

EXPECTED_SKIPS = (
    re.compile(r"already the nested run"),       # test_afxdp_rings re-runs itself without the JIT
)

_unexpected: list[tuple[str, str]] = []


def _reason(report) -> str:
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        return str(lr[2])
    return str(lr)


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = _reason(report)
        if not any(p.search(reason) for p in EXPECTED_SKIPS):
            _unexpected.append((report.nodeid, reason))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _unexpected:
        tr = terminalreporter
        tr.section("unexpected skips (each is a failure: the feature could run here)", red=True)
        for nodeid, reason in _unexpected:
            tr.line(f"{nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if _unexpected and os.environ.get("METAROCE_ALLOW_SKIPS") != "1" and session.exitstatus == 0:
        session.exitstatus = 1


# Once an Engine has started, numba may compile nothing more in the process (jitwarm.seal).  Unit tests
# of the compiled functions themselves call them with types of their own: they carry the `compiles`
# mark and run inside jitwarm.unsealed().
def pytest_configure(config):
    config.addinivalue_line("markers", "compiles: calls compiled (numba) functions with its own argument types; "
                                       "runs with compilation allowed (jitwarm.unsealed)")


@pytest.fixture(autouse=True)
def _jit_unsealed_for_compiled_unit_tests(request):
    if request.node.get_closest_marker("compiles") is None:
        yield
        return
    from metaroce_xdp import jitwarm
    with jitwarm.unsealed():
        yield
