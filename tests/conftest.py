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
import sys
import time

import pytest

# Tests live in folders by layer (wire, kern, afxdp, dp, native, daemon, conformance, tools); the harnesses
# they share (players.py, dp_players.py, daemon_players.py ...) sit here, and a few test modules import
# another's helpers by name across folders (test_routed uses test_perf_pingpong's Proc): every folder is
# importable by module name, as when the tests were one directory.
_HERE = os.path.dirname(os.path.abspath(__file__))
for _d in sorted(os.listdir(_HERE)):
    if os.path.isdir(os.path.join(_HERE, _d)) and not _d.startswith(("_", ".")):
        sys.path.append(os.path.join(_HERE, _d))

import daemon_procs  # noqa: E402

EXPECTED_SKIPS = (
    re.compile(r"already the nested run"),       # test_afxdp_rings re-runs itself without the JIT
)

_unexpected: list[tuple[str, str]] = []


def _reason(report) -> str:
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        return str(lr[2])
    return str(lr)


# One root check for the suite: a test marked `netns` (it builds namespaces, veths, XDP and AF_XDP) or `root`
# (it loads BPF or opens raw sockets, without namespaces) is skipped when not run as root -- and a skip is a
# failure unless METAROCE_ALLOW_SKIPS=1 (above): `make test` runs as root.
def pytest_collection_modifyitems(config, items):
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="needs root: network namespaces, BPF, XDP and AF_XDP")
    for item in items:
        if item.get_closest_marker("netns") is not None or item.get_closest_marker("root") is not None:
            item.add_marker(skip)


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


# Once a process is sealed, numba may compile nothing more in it (jitwarm.seal).  Unit tests
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


# ---- emulated networks (tests/dp_players.py Fabric) -----------------------------------------------------------
#
# `fabric`: one network of namespaces per test module, a compiled-plane Side on host A and one on host B, taken
# away after the module's last test.  What it builds comes from the module's mark
#     pytestmark = pytest.mark.fabric("flat" | "switched" | "routed", mtu=..., hosts=..., prefix=..., ...)
# (Fabric's arguments; none: a switched network at MTU 1500).  `make_fabric(...)`: a Fabric built inside one
# test (Fabric's arguments), taken away when that test ends.

def _fabric_args(request) -> tuple[tuple, dict]:
    mark = request.node.get_closest_marker("fabric")
    return (mark.args, dict(mark.kwargs)) if mark is not None else ((), {})


@pytest.fixture(scope="module")
def fabric(request):
    from dp_players import Fabric
    args, kw = _fabric_args(request)
    with Fabric(*args, **kw) as f:
        yield f


@pytest.fixture
def make_fabric():
    from dp_players import Fabric
    made = []

    def make(*args, **kw):
        made.append(Fabric(*args, **kw))
        return made[-1]
    try:
        yield make
    finally:
        for f in reversed(made):
            f.close()


# `wire`: one QP's side facing a scripted peer per test module (tests/wire_players.py scripted_dp_wire): (topology,
# veth pair, the script's raw socket on mr1, the compiled-plane Context on mr0); the module's fabric mark's prefix
# names its namespaces.
@pytest.fixture(scope="module")
def wire(request):
    from wire_players import scripted_dp_wire
    _, kw = _fabric_args(request)
    with scripted_dp_wire(kw.get("prefix", "mrw")) as w:
        yield w


# Loop pairs on the compiled plane (tests/dp_players.py): one switched Fabric per test module (its `fabric` mark's
# options), a fresh pair of connected QPs per call, torn down after each test.
@pytest.fixture(scope="module")
def _dp_loop_pairs(request):
    from dp_players import LoopPairs
    _, kw = _fabric_args(request)
    pairs = LoopPairs(**kw)
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


# ---- no numba compilation during a transfer (issue 20) ------------------------------------------------------
#
# A compilation on a live data path stalls it for seconds, past the peer's ACK timeout.  A listener on numba's
# "numba:compile" event (fired for a real compilation only: a load from numba's on-disk cache fires nothing)
# is registered for the whole session.  A compilation fails the test during whose setup, call or teardown it
# started -- the report names the function and its argument types -- when, at that moment,
#   * a compiled-plane Context (metaroce_xdp.dp.Context, the compat and the native profile) is open in this
#     process: its warm-up ran inside Context.open, so nothing may compile while it can carry traffic; or
#   * the process is sealed (jitwarm.seal);
# unless the test carries the `compiles` mark (it calls compiled functions with argument types of its own).
# metaroced's own process is checked by its tests (tests/daemon/test_daemon_startup.py, tests/dp/test_jit_guard.py).

import gc as _gc  # noqa: E402
import sys as _sys  # noqa: E402
import threading as _threading  # noqa: E402
import weakref  # noqa: E402

from numba.core import event as _nb_event  # noqa: E402


_planes: "weakref.WeakSet" = weakref.WeakSet()       # every compiled-plane Context made since tracking began
_tracking = False


def _open_planes() -> int:
    """Compiled-plane Contexts open in this process.  The first time it is asked with the compiled plane
    imported, it finds the Contexts made so far on the heap and wraps Context.__init__ to note later ones."""
    global _tracking
    mod = _sys.modules.get("metaroce_xdp.dp.context")
    if mod is None:
        return 0                         # the compiled plane was never imported: no Context can be open
    if not _tracking:
        ctx, init = mod.Context, mod.Context.__init__

        def noted_init(self, *args, **kw):
            init(self, *args, **kw)
            _planes.add(self)
        ctx.__init__ = noted_init
        # type(), not isinstance(): the heap holds weak proxies, whose isinstance() may raise
        _planes.update(o for o in _gc.get_objects() if issubclass(type(o), ctx))
        _tracking = True
    return sum(1 for c in list(_planes) if not c.closed)


class _CompileGuard(_nb_event.Listener):
    def __init__(self) -> None:
        self.item = None                 # the test running (setup, call, teardown), or None between tests
        self.allowed = False             # it carries the `compiles` mark
        self.found: list[tuple[str, str]] = []      # (phase, what) for the running test
        self.phase = ""
        self.lock = _threading.Lock()

    def on_start(self, ev) -> None:
        if self.item is None or self.allowed:
            return
        from metaroce_xdp import jitwarm
        sealed = jitwarm.is_sealed()
        planes = _open_planes()
        if not planes and not sealed:
            return
        d = ev.data.get("dispatcher")
        fn = getattr(d, "py_func", None)
        name = f"{fn.__module__}.{fn.__qualname__}" if fn is not None else repr(d)
        why = f"{planes} compiled-plane Context(s) open" if planes else "the process is sealed (jitwarm.seal)"
        with self.lock:
            self.found.append((self.phase, f"{name}{tuple(ev.data.get('args', ()))} compiled in "
                                           f"{_threading.current_thread().name} while {why}"))

    def on_end(self, ev) -> None:
        pass


_compile_guard = _CompileGuard()
_nb_event.register("numba:compile", _compile_guard)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _compile_guard.item = item
    _compile_guard.allowed = item.get_closest_marker("compiles") is not None
    _compile_guard.found = []
    try:
        return (yield)
    finally:
        _compile_guard.item = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    _compile_guard.phase = "setup"
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    _compile_guard.phase = "call"
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    _compile_guard.phase = "teardown"
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    with _compile_guard.lock:
        mine = [what for phase, what in _compile_guard.found if phase == call.when]
    if mine and not rep.failed:
        rep.outcome = "failed"
        rep.longrepr = ("numba compiled during a transfer (a compiled-plane Context open or the process sealed); "
                        "a warm-up must cover it, or the test carries the `compiles` mark:\n  " + "\n  ".join(mine))
    elif mine:
        rep.sections.append(("numba compiled during a transfer", "\n".join(mine)))
    return rep
