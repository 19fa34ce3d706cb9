"""No JIT after start (issue 7): once a compiled-plane Context is open, numba compiles nothing in the process.

`Context.open` warms the compiled plane up (jitwarm.warm_up(planes=("compiled",)): its modules load from
numba's cache, or compile and say so, before any socket exists).  Every function Python calls on the data
path -- the plane's entry points (dp_round, dp_run, dp_serve, the drivers) and the native profile's
functions called at RTR and RTS -- has explicit signatures, so numba refuses to compile it for any other
type: a type the warm-up missed is a TypeError at the call, which fails a test, instead of a compilation
of seconds on a live QP, which stalls a transfer past the peer's ACK timeout.

* after a Context has opened, every entry point of the compiled plane refuses new signatures, and calling
  one with a new argument type raises at once, compiles nothing and adds no signature;
* jitwarm.seal() extends that to every dispatcher of the data-path modules (the helpers only compiled into
  their callers too), and unsealed() lifts it for a block and restores it (in a process of its own: the seal
  is process-wide);
* a full mixed transfer over veth (XDP program + AF_XDP sockets, one endpoint busy polled by this thread and
  one on its progress thread), in the compat and the native profile, triggers no numba compilation anywhere
  in the process (numba's "numba:compile" event, any dispatcher) and adds no signature or cache load to any
  registered dispatcher.  (tests/conftest.py fails any test during which numba compiles with a
  compiled-plane Context open.)
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from numba.core import event as nb_event

from dp_players import wait_wcs
from metaroce_xdp import jitwarm
from wire_players import FULL, Plan, VethPlayer

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not jitwarm.JIT_ENABLED, reason="NUMBA_DISABLE_JIT: no compiler to stop")


class CompileWatch(nb_event.Listener):
    """Every numba compilation in the process while installed (not only our dispatchers)."""

    def __init__(self):
        self.compiled: list[str] = []

    def on_start(self, ev):
        if ev.kind == "numba:compile":
            self.compiled.append(str(ev.data.get("dispatcher", "?")) + str(ev.data.get("args", "")))

    def on_end(self, ev):
        pass


def _signatures():
    """(signatures, cache hits, cache misses) of every registered dispatcher of the compiled plane."""
    return {(m, n): (len(d.signatures), sum(d.stats.cache_hits.values()), sum(d.stats.cache_misses.values()))
            for m, n, d in jitwarm.dispatchers(jitwarm.PLANES["compiled"])}


def test_the_compiled_planes_entry_points_refuse_new_types():
    """What Context.open warms: every function Python calls on the data path refuses to compile; a call with
    a type it was not warmed up for raises TypeError at the call, nothing compiled, no signature added."""
    jitwarm.warm_up(planes=("compiled",))          # what Context.open does before any socket exists
    entries = jitwarm.plan(("compiled",))
    assert {(e.module, e.name) for e in entries} >= {("metaroce_xdp.dp.inproc", "dp_round"),
                                                     ("metaroce_xdp.dp.inproc", "dp_run"),
                                                     ("metaroce_xdp.dp.serve", "dp_serve")}
    assert all(e.fn._can_compile is False and e.fn.signatures for e in entries), \
        [e.name for e in entries if e.fn._can_compile or not e.fn.signatures]
    before = _signatures()
    watch = CompileWatch()
    calls = []
    for e in entries:                              # each warm-up call, its first array argument of another dtype
        k = next(i for i, x in enumerate(e.args) if isinstance(x, np.ndarray))
        calls.append((e.fn, (*e.args[:k], np.zeros(e.args[k].shape, np.float32), *e.args[k + 1:])))
    with nb_event.install_listener("numba:compile", watch):
        for fn, args in calls:
            with pytest.raises(TypeError, match="No matching definition"):
                fn(*args)
    assert watch.compiled == []
    assert _signatures() == before


SEAL = r"""
import numpy as np
from numba.core import event
from metaroce_xdp import jitwarm
from metaroce_xdp.dp import ring, round  # noqa: F401  (the whole plane: round imports every role)

compiled = []
class Watch(event.Listener):
    def on_start(self, ev):
        compiled.append(ev.data["dispatcher"].py_func.__name__)
    def on_end(self, ev):
        pass
event.register("numba:compile", Watch())
jitwarm.warm_up(planes=("compiled",))
assert not jitwarm.is_sealed()
n = jitwarm.seal()
ds = jitwarm.sealable()
assert n == len(ds) and jitwarm.is_sealed()
assert {id(d) for _, _, d in jitwarm.dispatchers(jitwarm.PLANES["compiled"])} <= {id(d) for d in ds}
assert all(d._can_compile is False for d in ds), [d.py_func.__name__ for d in ds if d._can_compile]
assert jitwarm.seal() == n                                   # idempotent
# a helper compiled only into its callers (dp/ring.py frame_free) refuses too, sealed
A = np.zeros(8, np.float32)
try:
    ring.frame_free(A, 0)
except TypeError as e:
    assert "No matching definition" in str(e) or "compil" in str(e), e
else:
    raise AssertionError("a sealed helper compiled")
with jitwarm.unsealed():
    assert not jitwarm.is_sealed() and ring.frame_free._can_compile
assert jitwarm.is_sealed() and not ring.frame_free._can_compile
assert compiled == [], compiled
print("sealed", n)
"""


def test_seal_covers_every_dispatcher_and_unsealed_lifts_it_for_a_block():
    r = subprocess.run([sys.executable, "-c", SEAL], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.startswith("sealed "), r.stdout


@pytest.fixture(scope="module")
def veth_players():
    if os.geteuid() != 0:
        pytest.fail("needs root for namespaces, XDP and AF_XDP")
    from metaroce_xdp.dp import Context
    from metaroce_xdp.topo import two_hosts
    topo, _ = two_hosts(prefix="mrjit")
    ps = []
    try:
        t0 = time.monotonic()
        with topo.enter(topo[0]):
            ps.append(VethPlayer(topo, topo[0], Context.open("mr0")))
        with topo.enter(topo[1]):
            ps.append(VethPlayer(topo, topo[1], Context.open("mr1", progress_thread=True)))
        print(f"two endpoints open in {time.monotonic() - t0:.2f} s")
        yield ps
    finally:
        for p in ps:
            p.ctx.close()
        topo.close()


def _connect(p, peer, profile):
    from metaroce_xdp.verbs_types import QPAttr, QPState
    with p.topo.enter(p.ns):
        p.qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
        p.qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=peer.qp.qp_num, rq_psn=0xFFFF80, path_mtu=1024,
                           dgid=peer.ctx.gid, max_dest_rd_atomic=4, min_rnr_timer=1, profile=profile))
        p.qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0xFFFF80, timeout=14, retry_cnt=7, rnr_retry=7,
                           max_rd_atomic=4))


@pytest.mark.netns
def test_no_compilation_during_a_mixed_transfer_over_veth(veth_players):
    """Every operation and size class, compat then native, A busy polled by this thread and B on its
    progress thread: no compile event anywhere, no new signature or cache load on any registered
    dispatcher, nothing lost on the event ring."""
    a, b = veth_players
    before = _signatures()
    watch = CompileWatch()
    with nb_event.install_listener("numba:compile", watch):
        for k, profile in enumerate(("compat", "native")):
            for p in (a, b):
                p.new_qp()
            _connect(a, b, profile)
            _connect(b, a, profile)
            assert a.qp.query()["profile"] == profile
            plan = Plan(a, b, seed=20 + k)
            a.qp.post_send(plan.wrs)
            wcs = wait_wcs([a], a, len(plan.wrs), timeout=60)
            rwcs = b.cq.wait(3, timeout=30)
            plan.check(wcs, rwcs)
    assert watch.compiled == []
    assert _signatures() == before
    assert a.ctx.stats()["ev_drop"] == 0 and b.ctx.stats()["ev_drop"] == 0
