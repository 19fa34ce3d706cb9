"""First run (issue 6): no JIT compilation on a live data path, and failures reported as failures.

* `metaroce_xdp.jitwarm.warm_up()` (run by `Context.open`, `metaroce warmup`, `make setup`) must leave
  nothing to compile: after it, a real transfer over veth on the compiled plane -- every operation, in
  the compat and the native profile -- adds no specialisation to any numba dispatcher of the data path.
* The demo (the compiled data plane, what `make demo` runs) passes on its first run with an empty numba
  cache (`NUMBA_CACHE_DIR` a fresh folder, so the repository's own cache is neither used nor written),
  and says it is compiling.
* metaroced, started with an empty numba cache, says so, comes up and carries traffic; once serving it
  compiles nothing.
* A work request that fails (here: the peer never answers, RETRY_EXC_ERR) is reported by its
  completion status and the QP's reason by the demo and the perf tools, never as CORRUPT.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dp_players import FULL, Faults, wait_wcs
from metaroce_xdp import jitwarm
from metaroce_xdp.verbs_types import WC, RecvWR, SendWR, WCOpcode, WCStatus, WROpcode, wc_failure

ROOT = Path(__file__).resolve().parents[2]
root_only = pytest.mark.root


# ------------------------------------------------------------------ failure reporting (in process)

def test_wc_failure_names_operation_status_and_reason():
    wc = WC(wr_id=3, status=WCStatus.RETRY_EXC_ERR, opcode=WCOpcode.RDMA_WRITE, qp_num=0x11)
    assert wc_failure(wc, "retries exhausted (local ACK timeout)").startswith(
        "WRITE failed: RETRY_EXC_ERR, retries exhausted (local ACK timeout)")
    flushed = WC(wr_id=4, status=WCStatus.WR_FLUSH_ERR, opcode=WCOpcode.RDMA_READ, qp_num=0x11)
    assert wc_failure(flushed, "retries exhausted (local ACK timeout)").startswith(
        "READ failed: WR_FLUSH_ERR, flushed: the QP was in error (retries exhausted (local ACK timeout))")


def _silent_peer(dp_loop):
    """A WRITE to a peer that never answers: every frame A sends is lost on the switch (MR-RETRY-011)."""
    a, b = dp_loop(faults_ab=Faults(drop=1.0), timeout=1, retry_cnt=2)
    a.buf[:4096] = 7
    a.qp.post_send([SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 4096)],
                           remote_addr=b.mr.addr, rkey=b.mr.rkey),
                    SendWR(wr_id=2, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 4096)],
                           remote_addr=b.mr.addr, rkey=b.mr.rkey)])
    wcs = wait_wcs([a], a, 2, timeout=20)
    return a, b, wcs


@pytest.mark.netns
@root_only
def test_retry_exhausted_write_is_a_failure_not_corruption(dp_loop):
    from tools import demo
    a, b, wcs = _silent_peer(dp_loop)
    assert [w.status for w in wcs] == [WCStatus.RETRY_EXC_ERR, WCStatus.WR_FLUSH_ERR]
    assert a.qp.query()["error"] == "retries exhausted (local ACK timeout)"
    # the demo's verdict: the failed WR by status and reason (its data check would say "differ")
    verdict = demo.outcome(wcs, {a: wcs}, lambda: False)
    assert verdict.startswith("WRITE failed: RETRY_EXC_ERR, retries exhausted (local ACK timeout)"), verdict
    assert verdict != demo.CORRUPT
    # all WRs succeeded but the bytes differ: that, and only that, is CORRUPT
    ok = [WC(wr_id=1, status=WCStatus.SUCCESS, opcode=WCOpcode.RDMA_WRITE, qp_num=a.qp.qp_num)]
    assert demo.outcome(ok, {a: ok}, lambda: False) == demo.CORRUPT
    assert demo.outcome(ok, {a: ok}, lambda: True) == demo.INTACT


@pytest.mark.netns
@root_only
def test_perf_tools_report_the_failed_completion(dp_loop):
    from metaroce_xdp.cli import perf
    a, b, wcs = _silent_peer(dp_loop)
    with pytest.raises(perf.PerfError) as e:
        perf._check_wc(wcs[0], a)                 # a side: anything with .qp
    assert str(e.value).startswith("WRITE failed: RETRY_EXC_ERR, retries exhausted (local ACK timeout)")


# ------------------------------------------------------------------ warm-up covers the live data path

def test_warm_up_plan_covers_every_dispatcher():
    """Every numba function of the data path is either an entry warm_up calls or compiled into one."""
    rep = jitwarm.warm_up()
    if not rep.jit:
        pytest.skip("NUMBA_DISABLE_JIT")
    disps = jitwarm.dispatchers()
    entries = {(e.module, e.name) for e in rep.entries}
    called_from_compiled = {n for _, _, d in disps for n in d.py_func.__code__.co_names}
    for mod, name, d in disps:
        assert (mod, name) in entries or name in called_from_compiled, f"{mod}.{name} is never warmed up"
        if (mod, name) in entries:
            assert d.signatures, f"{mod}.{name} has no specialisation after warm_up"
    for e in rep.entries:
        assert e.source in ("cache", "compiled", "present"), (e.name, e.source)
    assert jitwarm.cache_is_warm() is True


def test_a_new_process_sees_the_warm_cache_as_warm():
    """After warm-up, a fresh process (what `metaroce perf` or the demo is) finds every entry in numba's
    on-disk cache -- the lazily compiled ones (lazy_njit, keyed by their declared signature) included --
    so it prints no "compiling the data path" notice and reports the cache warm."""
    jitwarm.warm_up()
    code = ("from metaroce_xdp import jitwarm\n"
            "print([e.name for e in jitwarm.plan() if not jitwarm._has_in_memory(e)"
            " and jitwarm._index_has(e.fn, e.args) is not True])\n"
            "r = jitwarm.warm_up()\nprint(r.was_warm)")
    cp = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert cp.returncode == 0, cp.stderr[-2000:]
    assert cp.stdout.split() == ["[]", "True"], cp.stdout
    assert jitwarm.COLD_MESSAGE not in cp.stderr


def test_every_numba_module_is_warmed_up():
    """A new module with numba functions must join jitwarm.MODULES (and the plan)."""
    pkg = ROOT / "metaroce_xdp"
    users = {".".join(f.relative_to(ROOT).with_suffix("").parts) for f in pkg.rglob("*.py")
             if any(d in f.read_text() for d in ("@njit", "@jit", "@lazy_njit"))}
    assert users == set(jitwarm.MODULES) | set(jitwarm.NOT_ON_THE_DATA_PATH), \
        users ^ (set(jitwarm.MODULES) | set(jitwarm.NOT_ON_THE_DATA_PATH))
    # ...and the modules excused from warm-up are really off the data path: no data-path module imports them
    srcs = {m: (ROOT / (m.replace(".", "/") + ".py")).read_text() for m in jitwarm.MODULES}
    for off in jitwarm.NOT_ON_THE_DATA_PATH:
        short = off.rsplit(".", 2)[-2] + "." + off.rsplit(".", 1)[-1]          # e.g. native.sender
        users_of = [m for m, src in srcs.items() if off in src or short in src or "native import" in src]
        assert not users_of, f"{off} is used by {users_of}: add it to jitwarm.MODULES and the warm-up plan"


def _snapshot():
    return {(m, n): (len(d.signatures), sum(d.stats.cache_misses.values()), sum(d.stats.cache_hits.values()))
            for m, n, d in jitwarm.dispatchers()}


@pytest.mark.netns
@root_only
@pytest.mark.parametrize("profile", ["compat", "native"])
def test_no_compilation_during_a_transfer_on_veth(profile):
    """After Context.open (which warms up), every operation over XDP + AF_XDP on the compiled plane, in
    either profile, with the progress threads users run, runs on specialisations that already exist."""
    from metaroce_xdp.dp import Context
    from metaroce_xdp.topo import switched_hosts
    from metaroce_xdp.verbs_types import QPAttr, QPCap, QPState, SGE

    if not jitwarm.JIT_ENABLED:
        pytest.skip("NUMBA_DISABLE_JIT")
    topo, _, _ = switched_hosts()
    ctxs = []
    try:
        with topo.enter(topo[0]):
            ctxs.append(Context.open("mr0", progress_thread=True))
        with topo.enter(topo[2]):
            ctxs.append(Context.open("mr1", progress_thread=True))
        before = _snapshot()
        size = 4 << 20
        bufs = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(2)]
        pds = [c.alloc_pd() for c in ctxs]
        mrs = [pd.reg_mr(buf, FULL) for pd, buf in zip(pds, bufs)]
        cqs = [c.create_cq(4096) for c in ctxs]
        qps = [c.create_qp(pd, cq, cq, QPCap(max_send_wr=64, max_recv_wr=64))
               for c, pd, cq in zip(ctxs, pds, cqs)]
        for i, (ns, q) in enumerate(zip((topo[0], topo[2]), qps)):
            peer = qps[1 - i]
            with topo.enter(ns):
                q.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
                q.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=peer.qp_num, rq_psn=0xFFFF00, path_mtu=1024,
                                dgid=ctxs[1 - i].gid, max_dest_rd_atomic=4, min_rnr_timer=1, profile=profile))
                q.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0xFFFF00, timeout=14, retry_cnt=7, rnr_retry=7,
                                max_rd_atomic=4))
        a, b = qps
        assert a.query()["profile"] == profile and b.query()["profile"] == profile
        ma, mb = mrs

        def sge(off, n, m=ma):
            return SGE(m.addr + off, n, m.lkey)

        b.post_recv([RecvWR(wr_id=500 + k, sg_list=[SGE(mb.addr + (3 << 20) + k * 8192, 8192, mb.lkey)])
                     for k in range(4)])
        wrs = [SendWR(wr_id=k, opcode=WROpcode.RDMA_WRITE, sg_list=[sge(k * 70000, n)],
                      remote_addr=mb.addr + k * 70000, rkey=mb.rkey)
               for k, n in enumerate([0, 1, 1023, 1025, 65536])]
        wrs += [SendWR(wr_id=10, opcode=WROpcode.RDMA_WRITE, sg_list=[sge(0, 1 << 20)],
                       remote_addr=mb.addr + (1 << 20), rkey=mb.rkey),
                SendWR(wr_id=11, opcode=WROpcode.RDMA_WRITE_WITH_IMM, sg_list=[sge(0, 3000)],
                       remote_addr=mb.addr, rkey=mb.rkey, imm_data=0x1234),
                SendWR(wr_id=12, opcode=WROpcode.RDMA_READ, sg_list=[sge(2 << 20, 1 << 20)],
                       remote_addr=mb.addr + (2 << 20), rkey=mb.rkey),
                SendWR(wr_id=13, opcode=WROpcode.SEND, sg_list=[sge(0, 100), sge(5000, 2000)]),
                SendWR(wr_id=14, opcode=WROpcode.SEND_WITH_IMM, sg_list=[sge(0, 1)], imm_data=5),
                SendWR(wr_id=15, opcode=WROpcode.SEND, sg_list=[]),
                SendWR(wr_id=16, opcode=WROpcode.ATOMIC_FETCH_AND_ADD, sg_list=[sge(4 << 19, 8)],
                       remote_addr=mb.addr + (3 << 20) - 8, rkey=mb.rkey, compare_add=3),
                SendWR(wr_id=17, opcode=WROpcode.ATOMIC_CMP_AND_SWP, sg_list=[sge(4 << 19, 8)],
                       remote_addr=mb.addr + (3 << 20) - 16, rkey=mb.rkey, compare_add=0, swap=9)]
        want_read = bufs[1][2 << 20:3 << 20].copy()
        a.post_send(wrs)
        got = cqs[0].wait(len(wrs), timeout=60)
        assert all(w.status == WCStatus.SUCCESS for w in got), [wc_failure(w, a.query()["error"]) for w in got
                                                                if w.status != WCStatus.SUCCESS]
        rgot = cqs[1].wait(4, timeout=30)          # 3 SENDs and the WRITE with immediate
        assert all(w.status == WCStatus.SUCCESS for w in rgot)
        assert np.array_equal(bufs[1][1 << 20:2 << 20], bufs[0][:1 << 20])
        # the READ's bytes: not its first 8 (where both atomics then return the original value), nor its last
        # 16 (the atomics' targets: posted after the READ without a fence, they may change them before the
        # responder reads them, as the native profile's pipelined responder does)
        got_read = bufs[0][(2 << 20) + 8:(3 << 20) - 16]
        assert np.array_equal(got_read, want_read[8:-16]), np.flatnonzero(got_read != want_read[8:-16])[:8]
        after = _snapshot()
        grown = {k: (before[k], after[k]) for k in before if after[k][:2] != before[k][:2]}
        assert not grown, f"compiled during the transfer (signatures, cache misses, hits): {grown}"
    finally:
        for c in ctxs:
            c.close()
        topo.close()


# ------------------------------------------------------------------ first runs, empty caches
# The demo and metaroced each start on an empty numba cache of their own, at the same time: numba compiles
# on one CPU, so the two cold compiles share the wall-clock time of one (this machine has two CPUs).

def _start_cold_demo(tmp_path):
    """`python -m tools.demo` (what `make demo` runs: the compiled data plane in process) on an empty numba
    cache (NUMBA_CACHE_DIR a fresh folder, so the repository's own cache is neither used nor written)."""
    cache = tmp_path / "demo-numba-cache"
    cache.mkdir()
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), COLUMNS="200", PYTHONUNBUFFERED="1")
    env.pop("NUMBA_DISABLE_JIT", None)
    out, err = open(tmp_path / "demo.out", "w+"), open(tmp_path / "demo.err", "w+")
    p = subprocess.Popen([sys.executable, "-m", "tools.demo", "--size-mib", "4"], cwd=ROOT, env=env,
                         stdout=out, stderr=err, text=True)
    return p, cache, out, err, time.monotonic()


def _check_cold_demo(p, cache, out, err, t0, timeout):
    try:
        p.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    took = time.monotonic() - t0
    out.seek(0), err.seek(0)
    stdout, stderr = out.read(), err.read()
    out.close(), err.close()
    text = stdout + stderr
    assert p.returncode == 0, text[-4000:]
    assert "integrity verified" in text, text[-4000:]
    assert "CORRUPT" not in text and "failed" not in text, text[-4000:]
    assert "compiling the data path" in stderr, "a cold start must say why it is slow: " + stderr[-2000:]
    # the compiled data path went to the fresh cache (so the repository's cache was not touched): the demo
    # runs the compiled data plane (dp/, `from metaroce_xdp import Context`), whose loop compiles at import
    index = {f.name.split("-")[0] for f in cache.rglob("*.nbi")}
    for name in ("inproc.dp_run", "inproc.dp_round", "round.rx_burst", "ring.comp_reap"):
        assert name in index, (name, sorted(index))
    print(f"cold demo: {took:.1f} s")


# ------------------------------------------------------------------ metaroced, first run, empty cache

@pytest.mark.netns
@root_only
@pytest.mark.timeout(900)
def test_demo_and_metaroced_first_run_with_empty_numba_caches(tmp_path):
    """The demo passes on its first run with an empty numba cache and says it is compiling (_start_cold_demo,
    running meanwhile).  metaroced started with an empty numba cache (NUMBA_CACHE_DIR a fresh folder) says it is compiling its
    data path, compiles it, comes up and carries traffic: its client (this process, the client library)
    WRITEs to, READs from and SENDs to a compiled-plane Context in this process (on the repository's warm
    cache); once it serves it compiles nothing (tests/daemon_watch.py).  tests/daemon/test_daemon_startup.py starts
    it on a warm cache."""
    import daemon_watch
    from metaroce_xdp.daemon import client
    from metaroce_xdp.dp import Context
    from metaroce_xdp.topo import two_hosts
    from metaroce_xdp.verbs_types import SGE, QPAttr, QPCap, QPState

    demo = _start_cold_demo(tmp_path)
    cache = tmp_path / "numba-cache"
    cache.mkdir()
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    env.pop("NUMBA_DISABLE_JIT", None)
    topo, _ = two_hosts(prefix="mrcold")
    b_ctx, ok = None, False
    try:
        t0 = time.monotonic()
        with daemon_watch.serving(topo, topo[0], "mr0", tag="mrcold", env=env, ready_timeout=720) as (sock, tmp, d):
            took = time.monotonic() - t0
            log = Path(tmp, "B.log").read_text()
            assert "compiling the data path" in log, "a cold start must say why it is slow: " + log[-2000:]
            index = {f.name.split("-")[0] for f in cache.rglob("*.nbi")}
            for name in ("serve.dp_serve", "round.rx_burst", "ring.comp_reap"):
                assert name in index, (name, sorted(index))
            a = client.connect(sock, "mr0")
            with topo.enter(topo[1]):
                b_ctx = Context.open("mr1", progress_thread=True)
            size = 4 << 20
            abuf = a.alloc_buf(size)
            abuf[:] = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
            bbuf = np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8)
            apd, bpd = a.alloc_pd(), b_ctx.alloc_pd()
            amr, bmr = apd.reg_mr(abuf, FULL), bpd.reg_mr(bbuf, FULL)
            acq, bcq = a.create_cq(64), b_ctx.create_cq(64)
            aqp = a.create_qp(apd, acq, acq, QPCap(max_send_wr=16, max_recv_wr=16))
            bqp = b_ctx.create_qp(bpd, bcq, bcq, QPCap(max_send_wr=16, max_recv_wr=16))
            for ns, q, peer, ip in ((topo[0], aqp, bqp, "10.77.0.2"), (topo[1], bqp, aqp, "10.77.0.1")):
                with topo.enter(ns):
                    q.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
                    q.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=peer.qp_num, rq_psn=0x100, path_mtu=1024,
                                    dgid=ip, max_dest_rd_atomic=4, min_rnr_timer=1))
                    q.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0x100, timeout=14, retry_cnt=7, rnr_retry=7,
                                    max_rd_atomic=4))
            bqp.post_recv(RecvWR(wr_id=9, sg_list=[SGE(bmr.addr + (3 << 20), 8192, bmr.lkey)]))
            want_read = bbuf[1 << 20:2 << 20].copy()
            aqp.post_send([SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[amr.sge(0, 1 << 20)],
                                  remote_addr=bmr.addr, rkey=bmr.rkey),
                           SendWR(wr_id=2, opcode=WROpcode.RDMA_READ, sg_list=[amr.sge(1 << 20, 1 << 20)],
                                  remote_addr=bmr.addr + (1 << 20), rkey=bmr.rkey),
                           SendWR(wr_id=3, opcode=WROpcode.SEND, sg_list=[amr.sge(2 << 20, 5000)])])
            got = acq.wait(3, timeout=60)
            assert [(w.wr_id, w.status) for w in got] == [(i, WCStatus.SUCCESS) for i in (1, 2, 3)], got
            rgot = bcq.wait(1, timeout=30)
            assert rgot[0].status == WCStatus.SUCCESS and rgot[0].byte_len == 5000, rgot
            assert np.array_equal(bbuf[:1 << 20], abuf[:1 << 20])
            assert np.array_equal(abuf[1 << 20:2 << 20], want_read)
            assert np.array_equal(bbuf[3 << 20:(3 << 20) + 5000], abuf[2 << 20:(2 << 20) + 5000])
            a.close()
        print(f"cold metaroced: ready in {took:.1f} s")
        ok = True
    finally:
        if b_ctx is not None:
            b_ctx.close()
        topo.close()
        if not ok and demo[0].poll() is None:
            demo[0].kill()
            demo[0].wait()
    _check_cold_demo(*demo, timeout=780)
