"""What the fuzzers run against: two namespaces joined by a veth (topo.two_hosts), a metaroced in each, and
a well-behaved client of each joined by one QP -- the canary that says, after every batch of hostile
input, that the daemon still serves everyone else (its WRITE completes, the bytes arrive).

The daemons are started the way tests/daemon_procs.py starts them (a bpffs of their own, sleep mode,
killed with their parent); `Daemons.alive()` says whether A still runs and, if not, how it died (the
signal, the last lines of its log: the traceback of an uncaught exception).
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ..verbs_types import SGE, Access, QPAttr, QPCap, QPState, SendFlags, SendWR, WCStatus, WROpcode

ROOT = Path(__file__).resolve().parents[2]
FULL = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC


def batches(cases, batch: int, deadline: float | None):
    """`cases` in chunks of `batch` until the monotonic `deadline` (None: all).  A range stays lazy (--duration
    hands in 10^9 case numbers)."""
    cases = cases if isinstance(cases, range) else list(cases)
    for i in range(0, len(cases), batch):
        if deadline is not None and time.monotonic() > deadline:
            return
        yield cases[i:i + batch]


def die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)       # PR_SET_PDEATHSIG


def signame(rc: int | None) -> str:
    if rc is None:
        return "running"
    if rc < 0:
        try:
            return signal.Signals(-rc).name
        except ValueError:
            return f"signal {-rc}"
    return f"exit {rc}"


class Daemons:
    """metaroced on both ends of a veth; A is the target, B the peer of the well-behaved pair."""

    def __init__(self, prefix: str = "fz", extra: str = "") -> None:
        from ..topo import two_hosts
        self.topo, self.pair = two_hosts(prefix=prefix)
        self.tmp = tempfile.mkdtemp(prefix=f"{prefix}-")
        os.chmod(self.tmp, 0o755)
        self.bpffs = os.path.join(self.tmp, "bpf")
        os.mkdir(self.bpffs)
        subprocess.run(["mount", "-t", "bpf", "bpf", self.bpffs], check=True)
        self.extra = extra
        self.procs: dict[str, subprocess.Popen] = {}
        self.good: dict[str, object] = {}
        self.restarts = 0
        self._psn = 100

    # ---- processes ------------------------------------------------------------------------------------
    def sock(self, h: str) -> str:
        return os.path.join(self.tmp, f"{h}.sock")

    def log(self, h: str) -> str:
        return os.path.join(self.tmp, f"{h}.log")

    def start(self, h: str) -> None:
        ns, ep = (self.topo[0], self.pair.a) if h == "A" else (self.topo[1], self.pair.b)
        conf = os.path.join(self.tmp, f"{h}.toml")
        Path(conf).write_text(
            f'interfaces = ["{ep.ifname}"]\nsocket_path = "{self.sock(h)}"\nprogress = "sleep"\n'
            f'bpffs_prefix = "{self.bpffs}/{h}"\nmax_clients = 64\nmax_qps_per_client = 16\n'
            f'max_mr_bytes_per_client = {64 << 20}\ndrain_timeout_s = 1.0\nsocket_mode = "0660"\n'
            f'socket_group = "nogroup"\n{self.extra}')    # status_leak() asks as nobody:nogroup
        err = open(self.log(h), "a")
        p = self.topo.popen(ns, [sys.executable, "-m", "metaroce_xdp.daemon.server", "--config", conf],
                            stdout=subprocess.PIPE, stderr=err, text=True, cwd=str(ROOT), preexec_fn=die_with_parent)
        err.close()
        line = p.stdout.readline()
        if not line or not json.loads(line).get("ready"):
            raise RuntimeError(f"metaroced {h} did not start: {Path(self.log(h)).read_text()[-2000:]}")
        self.procs[h] = p

    def alive(self, h: str = "A", wait: float = 0.0) -> tuple[bool, str]:
        """(running, how it ended: the signal or exit code and the tail of its log).  wait: seconds to give a
        daemon that is on its way out (it drains for up to drain_timeout_s after an uncaught exception)."""
        p = self.procs[h]
        t_end = time.monotonic() + wait
        while p.poll() is None and time.monotonic() < t_end:
            time.sleep(0.1)
        if p.poll() is None:
            return True, ""
        tail = Path(self.log(h)).read_text(errors="replace")[-3000:]
        return False, f"metaroced {h} died: {signame(p.returncode)}\n{tail}"

    def pid(self, h: str = "A") -> int:
        """The daemon's own pid (`ip netns exec` execs it, so the Popen's pid)."""
        return self.procs[h].pid

    def fds(self, h: str = "A") -> int:
        try:
            return len(os.listdir(f"/proc/{self.pid(h)}/fd"))
        except OSError:
            return -1

    def rss(self, h: str = "A") -> int:
        """The daemon's resident memory in bytes (-1: gone)."""
        try:
            with open(f"/proc/{self.pid(h)}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return -1

    def stop(self, h: str) -> None:
        p = self.procs.pop(h, None)
        if p is None:
            return
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        with contextlib.suppress(Exception):
            p.stdout.close()

    def restart(self) -> None:
        """After A died or hung: A again (B keeps running; its well-behaved client goes and comes back with a
        QP pointed at the new A's), the pair again."""
        self.close_good()
        self.stop("A")
        with contextlib.suppress(OSError):
            os.unlink(self.sock("A"))
        self.restarts += 1
        self.start("A")
        self.connect_good()

    # ---- the well-behaved pair ----------------------------------------------------------------------------
    def connect_good(self) -> None:
        from ..daemon import client
        g = {}
        for h in ("A", "B"):
            ctx = client.connect(self.sock(h)).open_device()
            pd = ctx.alloc_pd()
            buf = ctx.alloc_buf(1 << 16)
            mr = pd.reg_mr(buf, FULL)
            cq = ctx.create_cq(64)
            qp = ctx.create_qp(pd, cq, cq, QPCap(max_send_wr=16, max_recv_wr=16))
            g[h] = (ctx, pd, buf, mr, cq, qp)
        for h, o, ip in (("A", "B", self.pair.b.ipv4), ("B", "A", self.pair.a.ipv4)):
            qp = g[h][5]
            qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
            qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=g[o][5].qp_num, rq_psn=self._psn, path_mtu=1024,
                             dgid=ip, max_dest_rd_atomic=4, min_rnr_timer=1))
            qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=self._psn, timeout=14, retry_cnt=7, rnr_retry=7,
                             max_rd_atomic=4))
        self.good = g
        self._n = 0

    def good_handles(self) -> dict:
        """What a hostile client could guess of the well-behaved client's objects (handles, QPN, keys)."""
        ctx, pd, buf, mr, cq, qp = self.good["A"]
        return {"pd": pd.handle, "mr": mr.handle, "cq": cq.handle, "qp": qp.handle, "qpn": qp.qp_num,
                "lkey": mr.lkey, "rkey": mr.rkey, "addr": mr.addr}

    def good_write(self, timeout: float = 15.0) -> str | None:
        """One 4 KiB WRITE from A's well-behaved client to B's: None when it completed and the bytes arrived,
        else what went wrong."""
        _, _, abuf, amr, acq, aqp = self.good["A"]
        _, _, bbuf, bmr, _, _ = self.good["B"]
        self._n += 1
        pat = np.random.default_rng(self._n).integers(0, 256, 4096, dtype=np.uint8)
        abuf[:4096] = pat
        try:
            aqp.post_send(SendWR(wr_id=self._n, opcode=WROpcode.RDMA_WRITE, send_flags=SendFlags.SIGNALED,
                                 sg_list=[SGE(amr.addr, 4096, amr.lkey)], remote_addr=bmr.addr, rkey=bmr.rkey))
            wcs = acq.wait(1, timeout=timeout)
        except Exception as e:                       # noqa: BLE001 - anything here is the canary failing
            return f"well-behaved WRITE: {type(e).__name__}: {e}"
        if not wcs or wcs[0].status != WCStatus.SUCCESS:
            return f"well-behaved WRITE did not complete: {wcs!r}"
        if not np.array_equal(bbuf[:4096], pat):
            return "well-behaved WRITE completed but the bytes at B differ"
        return None

    def close_good(self) -> None:
        for g in self.good.values():
            with contextlib.suppress(Exception):
                g[0].close()
        self.good = {}

    def close(self) -> None:
        self.close_good()
        for h in list(self.procs):
            self.stop(h)
        self.topo.close()
        subprocess.run(["umount", self.bpffs], check=False)
        if not os.environ.get("METAROCE_KEEP_TMP"):
            subprocess.run(["rm", "-rf", self.tmp], check=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
