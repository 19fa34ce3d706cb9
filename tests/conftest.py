"""Suite-wide rule: a test that skips where its feature could run is a failure.

Every skip is listed (as with `pytest -rs`) and, unless its reason is one of the expected
ones below, the session fails.  Expected skips are those that are part of how a test
works, not a missing capability.  METAROCE_ALLOW_SKIPS=1 lets a developer on a machine
without root or tshark run what it can without the session failing.
"""
from __future__ import annotations

import os
import re
import signal
import time

import daemon_procs
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
    _no_daemon_left(session)


# Every metaroced a test starts inherits this session's tag (tests/daemon_procs.py); one still running at the
# end is killed and fails the session (earlier runs left daemons spinning on the CPUs).
os.environ.setdefault(daemon_procs.TAG_ENV, f"pytest-{os.getpid()}-{time.time_ns()}")


def _no_daemon_left(session) -> None:
    left = daemon_procs.leftovers()
    end = time.monotonic() + 5                  # one in the middle of its drain gets a moment
    while left and time.monotonic() < end:
        time.sleep(0.2)
        left = daemon_procs.leftovers()
    if not left:
        return
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.section("metaroced processes left running by the tests (killed; each is a failure)", red=True)
        for pid, cmd in left:
            tr.line(f"pid {pid}: {cmd}")
    if session.exitstatus == 0:
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


# Loop pairs on the compiled plane (tests/dp_players.py): one switched topology per test module, a fresh pair of
# connected QPs per call, torn down after each test.
@pytest.fixture(scope="module")
def _dp_loop_pairs():
    from dp_players import LoopPairs
    pairs = LoopPairs()
    try:
        yield pairs
    finally:
        pairs.close()


@pytest.fixture
def dp_loop(_dp_loop_pairs):
    try:
        yield _dp_loop_pairs
    finally:
        _dp_loop_pairs.end_test()
