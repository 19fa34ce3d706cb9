"""metaroced's busy mode and its idle fallback (`busy_idle_ms`): a real daemon process on a veth end, a
client in this process (the client library over the daemon's socket and shared memory).

Behaviour, not timing: with busy_idle_ms > 0 a busy daemon that has a QP but no work goes to sleep (it
says so in the client's session header, H_SLEEPING, which makes the next post write the wake-up
eventfd), a post wakes it and is taken, and it goes back to sleep when idle again; with busy_idle_ms = 0
it spins for as long as the interface has a QP (the mode before the option existed).  The option is a
flag and a TOML key like the others, checked, and changes on reload.  METAROCE_DP_TRACE records the loop's
trace (each entry taken, in order) and writes it at stop."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import daemon_procs
import numpy as np
import pytest

from metaroce_xdp import shm
from metaroce_xdp.daemon import client
from metaroce_xdp.daemon.config import ConfigError, DaemonConfig, load_config
from metaroce_xdp.dp import serve
from metaroce_xdp.topo import two_hosts
from metaroce_xdp.verbs_types import Access, QPAttr, QPCap, QPState, RecvWR

ROOT = Path(__file__).resolve().parents[2]


def test_busy_idle_ms_is_an_option_like_the_others(tmp_path):
    assert DaemonConfig().busy_idle_ms == 1000
    f = tmp_path / "d.toml"
    f.write_text("[metaroced]\nbusy_idle_ms = 25\n")
    assert load_config(str(f)).busy_idle_ms == 25
    assert load_config(str(f), {"busy_idle_ms": "0"}).busy_idle_ms == 0          # the flag (a string) wins
    for bad in (-1, "soon", 3_600_001):
        with pytest.raises(ConfigError) as ei:
            load_config(os.devnull, {"busy_idle_ms": bad})
        assert ei.value.option == "busy_idle_ms"
    r = subprocess.run([sys.executable, "-m", "metaroce_xdp.daemon", "--config", os.devnull, "--busy-idle-ms", "7",
                        "--print-config"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0 and "busy_idle_ms = 7" in r.stdout, r.stderr
    from metaroce_xdp.daemon.server import Daemon
    d = Daemon(DaemonConfig(interfaces=["x0"], socket_path=str(tmp_path / "s.sock")))
    assert d.reload(DaemonConfig(interfaces=["x0"], socket_path=str(tmp_path / "s.sock"), busy_idle_ms=5)) == \
        ["busy_idle_ms"]                                                          # a run-time option
    d.drain_and_stop(0)


def _until(cond, what: str, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.01)


@pytest.mark.netns
def test_busy_daemon_sleeps_when_idle_wakes_on_a_post_and_spins_with_busy_idle_ms_0(tmp_path):
    topo, pair = two_hosts()
    bpffs = tmp_path / "bpf"
    bpffs.mkdir()
    subprocess.run(["mount", "-t", "bpf", "bpf", str(bpffs)], check=True)
    sock = str(tmp_path / "d.sock")
    procs = []

    def start(busy_idle_ms: int, env: dict | None = None):
        cfg = tmp_path / "d.toml"
        cfg.write_text(f'interfaces = ["{pair.b.ifname}"]\nsocket_path = "{sock}"\nprogress = "busy"\n'
                       f'busy_idle_ms = {busy_idle_ms}\nbpffs_prefix = "{bpffs}/metaroce"\n')
        p = topo.popen(topo[1], [sys.executable, "-m", "metaroce_xdp.daemon.server", "--config", str(cfg)],
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=str(ROOT),
                       preexec_fn=daemon_procs.die_with_parent, env={**os.environ, **(env or {})})
        procs.append(p)
        assert '"ready": true' in p.stdout.readline()
        ctx = client.connect(sock, pair.b.ifname)
        pd = ctx.alloc_pd()
        buf = ctx.alloc_buf(4096)
        mr = pd.reg_mr(buf, Access.LOCAL_WRITE)
        cq = ctx.create_cq(16)
        qp = ctx.create_qp(pd, cq, cq, QPCap(max_send_wr=4, max_recv_wr=8))
        qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=Access.LOCAL_WRITE))
        return p, ctx, qp, mr

    def sleeping(ctx) -> bool:
        return bool(ctx.H[shm.H_SLEEPING])

    def recv_taken(qp, n: int) -> bool:
        return int(qp.W[shm.QH_RQ_HEAD]) == n

    try:
        # busy_idle_ms = 100: busy while there is work, asleep (H_SLEEPING) once idle although a QP exists
        trace = str(tmp_path / "trace")                 # and the loop's trace (daemon/bench.py --trace)
        p, ctx, qp, mr = start(100, {"METAROCE_DP_TRACE": trace})
        _until(lambda: sleeping(ctx), "the idle busy daemon never went to sleep")
        for n in (1, 2):
            qp.post_recv(RecvWR(wr_id=n, sg_list=[mr.sge(0, 64)]))   # sees H_SLEEPING: writes the eventfd
            _until(lambda: recv_taken(qp, n), f"the sleeping daemon did not take post {n}")
            _until(lambda: sleeping(ctx), "the daemon did not go back to sleep when idle again")
        ctx.close()
        daemon_procs.reap(p)
        t = np.load(f"{trace}.{pair.b.ifname}.npy")     # written at stop: rows (ns, kind, count)
        assert t[t[:, 1] == serve.T_TAKE, 2].sum() == 2 and (np.diff(t[:, 0]) >= 0).all(), t
        # busy_idle_ms = 0: spins for as long as the interface has a QP, asleep without one
        p, ctx, qp, mr = start(0)
        qp.post_recv(RecvWR(wr_id=1, sg_list=[mr.sge(0, 64)]))
        _until(lambda: recv_taken(qp, 1), "the busy daemon did not take the post")
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            assert not sleeping(ctx), "busy_idle_ms = 0: the daemon slept although a QP exists"
            time.sleep(0.01)
        qp.destroy()
        _until(lambda: sleeping(ctx), "with no QP left the busy daemon kept spinning")
        ctx.close()
    finally:
        for p in procs:
            daemon_procs.reap(p)
        topo.close()
        subprocess.run(["umount", str(bpffs)], check=False)
