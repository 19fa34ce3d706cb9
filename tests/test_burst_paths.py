"""The per-packet and the burst paths, each really exercised (issue 7, "Tests").

The engine has two ways through its data path: compiled bursts (rc/burst.py: `tx_segment` builds
many SEND/WRITE frames per call, `rx_write_run` places in-order WRITE MIDDLE/LAST runs, the skip
runs count duplicates and stale responses) and the per-packet path (`Engine.emit` builds one
frame, `Engine._rx_frame` hands each frame to its role).  `Engine.burst_tx` / `burst_rx` choose
(METAROCE_NO_BURST=1 turns both off).  The requester used to copy `burst_tx` when its QP was
created, so turning the flag off afterwards -- as tests/rc_players.py did -- still segmented with
the compiled builder: the "per-packet" cases were not per-packet on the send side.

Here every mode is chosen *after* the QPs are connected, a mixed transfer runs (every operation,
sizes around the path MTU, multi-packet messages), and the engines' counters prove which path
moved the frames: `tx_burst` (frames from tx_segment), `rx_burst` (frames placed by rx_write_run),
`rx_skipped` (skip runs), `rx_polls` / `rx_idle_polls` (rounds of the raw burst receive) are all 0
on the per-packet path and non-zero on the burst path.  In process over LoopPorts, with seeded
loss / duplication / reordering, and over veth through the real XDP program and AF_XDP sockets.
"""
from __future__ import annotations

import os

import pytest

from rc_players import MTU, Faults, Plan, VethPlayer, loop_pair, set_burst, wait_wcs

MODES = {"burst": True, "per-packet": False}
BURST_COUNTERS = ("tx_burst", "rx_burst", "rx_skipped", "rx_polls", "rx_idle_polls")


def _counters(ctx) -> dict:
    return {k: ctx.engine.stats[k] for k in BURST_COUNTERS + ("tx", "rx")}


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def _assert_path(burst: bool, da: dict, db: dict, faults: bool = False) -> None:
    """Which path moved the frames, from the engines' counters (A requests, B responds)."""
    assert da["tx"] > 0 and db["tx"] > 0 and da["rx"] > 0 and db["rx"] > 0
    if burst:
        assert da["tx_burst"] > 0, da                  # A's WRITEs/SENDs segmented by tx_segment
        assert db["rx_burst"] > 0, db                  # B placed WRITE MIDDLE/LAST runs with rx_write_run
        assert da["rx_polls"] > 0 and db["rx_polls"] > 0
        assert da["tx"] > da["tx_burst"]               # READ/ATOMIC requests: one frame each
        if faults:
            assert da["rx_skipped"] + db["rx_skipped"] > 0, (da, db)
    else:
        for d in (da, db):
            assert all(d[k] == 0 for k in BURST_COUNTERS), d


# ------------------------------------------------------------------------------------------ in process

def _loop_run(burst: bool, faults: Faults | None = None, back: Faults | None = None):
    a, b = loop_pair(faults, back, size=2 << 20, mtu=MTU, timeout=10)
    for p in (a, b):
        set_burst(p.ctx, burst)                        # after the QPs exist: the case the old flag missed
        assert p.qp.requester.burst is burst
    plan = Plan(a, b)
    a0, b0 = _counters(a.ctx), _counters(b.ctx)
    a.qp.post_send(plan.wrs)
    wcs = wait_wcs([a, b], a, len(plan.wrs), timeout=60)
    rwcs = wait_wcs([a, b], b, 3, timeout=30)
    plan.check(wcs, rwcs)
    return _delta(_counters(a.ctx), a0), _delta(_counters(b.ctx), b0), a.buf.copy(), b.buf.copy()


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_runs_its_own_path(mode):
    da, db, _, _ = _loop_run(MODES[mode])
    _assert_path(MODES[mode], da, db)


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_runs_its_own_path_under_faults(mode):
    """Seeded loss, duplication and reordering both ways: go-back-N, duplicate and stale frames go
    through the skip runs on the burst path only; the bytes are the same either way."""
    f = Faults(seed=11, drop=0.01, dup=0.03, reorder=0.02)
    g = Faults(seed=12, drop=0.01, dup=0.03, reorder=0.02)
    da, db, _, _ = _loop_run(MODES[mode], f, g)
    _assert_path(MODES[mode], da, db, faults=True)


def test_no_burst_environment_selects_the_per_packet_path(monkeypatch):
    """METAROCE_NO_BURST=1: engines start on the per-packet path, and loop_pair() leaves them there."""
    monkeypatch.setenv("METAROCE_NO_BURST", "1")
    a, b = loop_pair(size=2 << 20, mtu=MTU)
    assert not (a.ctx.engine.burst_tx or a.ctx.engine.burst_rx or b.ctx.engine.burst_tx or b.ctx.engine.burst_rx)
    plan = Plan(a, b, seed=3)
    a.qp.post_send(plan.wrs)
    plan.check(wait_wcs([a, b], a, len(plan.wrs)), wait_wcs([a, b], b, 3))
    _assert_path(False, _counters(a.ctx), _counters(b.ctx))


def test_switching_paths_mid_stream():
    """The flag is read at every send and every receive round: a long WRITE started on one path
    finishes on the other, and both paths' counters show their share."""
    a, b = loop_pair(size=2 << 20, mtu=MTU)
    plan = Plan(a, b, seed=4)
    set_burst(a.ctx, True)
    set_burst(b.ctx, True)
    a.ctx.engine.budget = b.ctx.engine.budget = 16     # small rounds: most of the work is left after three
    a.qp.post_send(plan.wrs)
    for _ in range(3):                                 # a few rounds on the burst path
        a.ctx.engine.progress()
        b.ctx.engine.progress()
    mid_a, mid_b = _counters(a.ctx), _counters(b.ctx)
    assert mid_a["tx_burst"] > 0 and len(a.cq.q) < len(plan.wrs)
    set_burst(a.ctx, False)
    set_burst(b.ctx, False)
    plan.check(wait_wcs([a, b], a, len(plan.wrs)), wait_wcs([a, b], b, 3))
    da, db = _delta(_counters(a.ctx), mid_a), _delta(_counters(b.ctx), mid_b)
    assert da["tx"] > 0 and db["rx"] > 0
    _assert_path(False, da, db)


# ------------------------------------------------------------------------------------------ over veth

@pytest.fixture(scope="module")
def veth_pair():
    if os.geteuid() != 0:
        pytest.fail("needs root for namespaces, XDP and AF_XDP")
    from metaroce_xdp.rc.engine import Context
    from metaroce_xdp.topo import two_hosts
    topo, _ = two_hosts(prefix="mrbp")
    ps = []
    try:
        for i in (0, 1):
            with topo.enter(topo[i]):
                ps.append(VethPlayer(topo, topo[i], Context.open("mr0" if i == 0 else "mr1"), size=2 << 20))
        yield ps
    finally:
        for p in ps:
            p.ctx.close()
        topo.close()


@pytest.mark.netns
@pytest.mark.parametrize("mode", MODES)
def test_each_mode_runs_its_own_path_over_veth(veth_pair, mode):
    """The same over XDP + AF_XDP: XskPort's batched slots and raw receive on the burst path,
    tx_slot/tx_commit and XskSocket.rx_burst frame by frame on the per-packet path.  PSNs wrap."""
    a, b = veth_pair
    for p in (a, b):
        set_burst(p.ctx, True)                         # QPs made on the default path ...
        p.new_qp()
    a.connect(b)
    b.connect(a)
    for p in (a, b):
        set_burst(p.ctx, MODES[mode])                  # ... then switched
    plan = Plan(a, b, seed=7)
    a0, b0 = _counters(a.ctx), _counters(b.ctx)
    a.qp.post_send(plan.wrs)
    wcs = wait_wcs([a, b], a, len(plan.wrs), timeout=60)
    rwcs = wait_wcs([a, b], b, 3, timeout=30)
    plan.check(wcs, rwcs)
    _assert_path(MODES[mode], _delta(_counters(a.ctx), a0), _delta(_counters(b.ctx), b0))
