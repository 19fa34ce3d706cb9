"""No JIT after start (issue 7): once an engine has started, numba compiles nothing in the process.

`Engine.__init__` warms up (jitwarm.warm_up: every function of its plane with its run-time types) and
then seals (jitwarm.seal: every registered dispatcher of the planes warmed -- and of any module of
MODULES imported -- stops compiling; a plane warmed later is sealed as it is warmed).
So a type the warm-up missed is a TypeError at the call, which fails a test, instead of a
compilation of seconds on a live QP, which stalls a transfer past the peer's ACK timeout.

* after an engine exists, every registered dispatcher is sealed, and calling a data-path function
  with a new argument type raises at once and adds no signature;
* a full mixed transfer over veth (XDP program + AF_XDP sockets, burst and per-packet paths, one
  endpoint with its progress thread) triggers no numba compilation anywhere in the process
  (numba's "numba:compile" event, any dispatcher) and adds no signature or cache load to any
  registered dispatcher;
* unsealed() lifts the seal for a block and restores it.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
from numba.core import event as nb_event

from metaroce_xdp import jitwarm
from rc_players import Plan, VethPlayer, loop_pair, set_burst, wait_wcs

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
    """(signatures, cache hits, cache misses) of every registered dispatcher."""
    return {(m, n): (len(d.signatures), sum(d.stats.cache_hits.values()), sum(d.stats.cache_misses.values()))
            for m, n, d in jitwarm.dispatchers()}


def test_an_engine_seals_every_registered_dispatcher():
    """The Python engine warms and seals its plane; the compiled plane, warmed later in the same
    process (a dp Context opening), is sealed as it is warmed."""
    a, b = loop_pair()
    assert jitwarm.is_sealed()
    ds = jitwarm.sealable()
    py = jitwarm.PLANES["python"]
    assert {id(d) for _, _, d in jitwarm.dispatchers(py)} <= {id(d) for d in ds}
    assert {id(e.fn) for e in jitwarm.plan(("python",))} <= {id(d) for d in ds}
    assert all(d._can_compile is False for d in ds), [d.py_func.__name__ for d in ds if d._can_compile]
    assert jitwarm.seal() == len(ds)               # idempotent
    jitwarm.warm_up(planes=("compiled",))
    ds = jitwarm.sealable()
    assert {id(d) for _, _, d in jitwarm.dispatchers()} <= {id(d) for d in ds}
    assert {id(e.fn) for e in jitwarm.plan()} <= {id(d) for d in ds}
    assert all(d._can_compile is False for d in ds), [d.py_func.__name__ for d in ds if d._can_compile]


def test_a_new_type_raises_instead_of_compiling():
    """A data-path function called with types it was not warmed up for: TypeError at the call, nothing
    compiled, no signature added -- for entry points and for functions compiled into their callers."""
    from metaroce_xdp.afxdp import rings
    from metaroce_xdp.rc import burst
    from metaroce_xdp.wire import fastpath, icrc
    from metaroce_xdp.wire.fastpath import TABLES

    loop_pair()                                    # an engine has started
    before = _signatures()
    watch = CompileWatch()
    calls = [
        (fastpath.frame_icrc_ok, (TABLES, np.zeros(128, np.float64), 0, 128)),     # float frame
        (burst.peek_bth, (np.zeros(128, np.uint16), 0, 128)),                      # uint16 UMEM
        (icrc.crc32_update, (TABLES, 0, np.zeros(8, np.int32), 0, 8)),             # compiled into callers only
        (rings.frame_alloc, (np.zeros(4, np.float32), np.zeros(1, np.int64), np.empty(4, np.uint64), 4)),
    ]
    with nb_event.install_listener("numba:compile", watch):
        for fn, args in calls:
            with pytest.raises(TypeError, match="No matching definition"):
                fn(*args)
    assert watch.compiled == []
    assert _signatures() == before


def test_unsealed_lifts_the_seal_for_a_block_only():
    from metaroce_xdp.rc import burst

    loop_pair()
    assert jitwarm.is_sealed()
    with jitwarm.unsealed():
        assert not jitwarm.is_sealed()
        assert burst.peek_bth._can_compile
    assert jitwarm.is_sealed() and not burst.peek_bth._can_compile


@pytest.fixture(scope="module")
def veth_players():
    if os.geteuid() != 0:
        pytest.fail("needs root for namespaces, XDP and AF_XDP")
    from metaroce_xdp.rc.engine import Context
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


@pytest.mark.netns
def test_no_compilation_during_a_mixed_transfer_over_veth(veth_players):
    """Every operation and size class, on the burst path and then the per-packet path, A busy polling
    and B on its progress thread: no compile event anywhere, no new signature or cache load on any
    registered dispatcher, no failed progress round."""
    a, b = veth_players
    assert jitwarm.is_sealed()
    before = _signatures()
    watch = CompileWatch()
    with nb_event.install_listener("numba:compile", watch):
        for k, burst in enumerate((True, False)):
            for p in (a, b):
                set_burst(p.ctx, burst)
                with p.ctx.engine.lock:
                    p.new_qp()
            a.connect(b)
            b.connect(a)
            plan = Plan(a, b, seed=20 + k)
            a.qp.post_send(plan.wrs)
            wcs = wait_wcs([a], a, len(plan.wrs), timeout=60)
            rwcs = b.cq.wait(3, timeout=30)
            plan.check(wcs, rwcs)
    assert watch.compiled == []
    assert _signatures() == before
    assert a.ctx.engine.stats["progress_errors"] == 0 and b.ctx.engine.stats["progress_errors"] == 0
