"""Long, checked traffic between two real endpoints: the fault matrix and the soak.

Role: drive one RC QP pair over XDP + AF_XDP endpoints with a mix of WRITE, READ, SEND and ATOMIC
across a set of sizes, keep a window of work requests in flight, and check every completion: its
status, its bytes, its order.  Around that, the bookkeeping a long run needs to be trusted: resident
memory over time (psutil) of the process that owns the data plane, UMEM frames (nothing leaks), and
packet conservation (what one side transmitted = what the other side's XDP program saw + what the
fault injector took away + what it added).

The endpoints run on one of two planes, the two ways the data plane ships:

  compiled   metaroce_xdp.dp.Context in this process, opened with a progress thread (as users run it);
  daemon     a metaroced process in each host's namespace (its own config, socket and bpffs), the
             workload driving its QPs through metaroce_xdp.daemon.client (memory from ctx.alloc_buf,
             MR addresses are the daemon's IOVAs: mr.addr + offset).

Each plane has a small adapter (_CompiledPlane, _DaemonPlane) that opens it and reads its counters
into one shape (`counters()`: frames transmitted and received by the loop, the XDP program's
events, the socket's statistics, where the UMEM frames are, the owner's RSS); the checks
(conservation, delivery, umem_account) are the same functions for both.

    with Fabric("switch", plane="daemon") as fab:   # or "router": hosts in two subnets
        a, b = fab.endpoints()
        connect_near_wrap(a, b)
        wl = Workload(a, b, ops=("write", "read"), sizes=(0, 1, 65536))
        base = fab.mark(a, b)
        with fab.faults(drop_ppm=10_000):
            rep = wl.run(packets=200_000)
            fab.quiesce(a, b)
        print(fab.conservation(a, b, base), a.umem_frames())

Neighbours: topo.py (namespaces, routers), faults.py (the tc BPF impairment), dp/context.py
(the compiled plane), daemon/server.py (metaroced; `umem_frames`, the frame accounting both planes
report), daemon/client.py, tools/soak.py (the `make soak` CLI), tests/dp/test_fault_matrix.py.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil

from .faults import FaultInjector
from .verbs_types import SGE, Access, QPAttr, QPState, RecvWR, SendWR, WCStatus, WROpcode

FULL = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC
OPS = ("write", "read", "send", "atomic")
PLANES = ("compiled", "daemon")
PSN_MOD = 1 << 24
CQ_DEPTH = 4096                        # within the daemon's per-client CQ entries (daemon/server.py)

# The fault matrix of issue 6, shared by tests/dp/test_fault_matrix.py and tools/soak.py
MATRIX_PMTU = 1024
MATRIX_SIZES = (0, 1, MATRIX_PMTU - 1, MATRIX_PMTU, MATRIX_PMTU + 1, 64 << 10, 8 << 20)
MATRIX_WRAP = PSN_MOD - 2000           # A's first PSN: its requests wrap past 2^24 early on
MATRIX_FAULTS = {
    "loss-0.1%": dict(drop_ppm=1_000),
    "loss-1%": dict(drop_ppm=10_000),
    "loss-5%": dict(drop_ppm=50_000),
    "reorder-2%": dict(reorder_ppm=20_000, reorder_delay_us=300),
    "dup-2%": dict(dup_ppm=20_000),
    "corrupt-1%": dict(corrupt_ppm=10_000),
}


def connect_near_wrap(a: "Endpoint", b: "Endpoint", mtu: int = MATRIX_PMTU) -> None:
    """Fresh QPs on both endpoints, connected with PSNs just below 2^24 (MR-BTH-020)."""
    a.new_qp(), b.new_qp()
    a.connect(b, sq_psn=MATRIX_WRAP, rq_psn=MATRIX_WRAP - 3000, mtu=mtu)
    b.connect(a, sq_psn=MATRIX_WRAP - 3000, rq_psn=MATRIX_WRAP, mtu=mtu)


class StressError(AssertionError):
    """A checked run found a wrong byte, a wrong status, a hang or a leak; the message says which."""


# ---- the two planes -----------------------------------------------------------------------------
class _CompiledPlane:
    """The compiled data plane in this process: dp.Context with a progress thread."""

    name = "compiled"

    def __init__(self, topo, ns: str, ifname: str, ipv6: bool) -> None:
        from .dp import Context
        with topo.enter(ns):
            self.ctx = Context.open(ifname, progress_thread=True, ipv6=ipv6)
        self.proc = psutil.Process()

    def alloc(self, nbytes: int) -> np.ndarray:
        buf = np.empty(nbytes, np.uint8)
        buf.fill(0)                      # touch every page now, so RSS samples compare like with like
        return buf

    def destroy_qp(self, qp) -> None:
        self.ctx.destroy_qp(qp)

    def qp_counters(self, qp) -> dict:
        from .dp import layout as L
        q = qp.query()
        return {"state": QPState(q["state"]), "sq_psn": q["sq_psn"], "rq_psn": q["rq_psn"],
                "retransmits": int(qp.row[L.Q_N_RETX]), "error": q.get("error")}

    def counters(self) -> dict:
        from .daemon.server import umem_frames
        ctx = self.ctx
        st = ctx.stats()
        return {"tx": st["tx"], "rx": st["rx"], "xdp": ctx.loader.events(), "xsk": ctx.port.xsk.statistics(),
                "umem": umem_frames(ctx), "rss": self.proc.memory_info().rss, "plane": st}

    def close(self) -> None:
        self.ctx.close()


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)        # PR_SET_PDEATHSIG


class _DaemonPlane:
    """metaroced in the host's namespace on `ifname` (a bpffs and socket of its own in a temporary
    directory, its log in daemon.log there); this process is its client."""

    name = "daemon"

    def __init__(self, topo, ns: str, ifname: str, ipv6: bool, progress: str = "sleep",
                 start_timeout: float = 300.0) -> None:
        from .daemon import client
        self.ifname = ifname
        self.dir = tempfile.mkdtemp(prefix="stress-mrd-")
        self.bpffs = os.path.join(self.dir, "bpf")
        os.mkdir(self.bpffs)
        subprocess.run(["mount", "-t", "bpf", "bpf", self.bpffs], check=True)
        self.proc = self.ctx = None
        self.d: subprocess.Popen | None = None
        try:
            sock = os.path.join(self.dir, "d.sock")
            conf = os.path.join(self.dir, "d.toml")
            Path(conf).write_text(f'interfaces = ["{ifname}"]\nsocket_path = "{sock}"\nprogress = "{progress}"\n'
                                  f'bpffs_prefix = "{self.bpffs}/metaroce"\n')
            self.log = open(os.path.join(self.dir, "daemon.log"), "a")
            root = str(Path(__file__).resolve().parents[1])
            self.d = topo.popen(ns, [sys.executable, "-m", "metaroce_xdp.daemon.server", "--config", conf],
                                stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=root,
                                preexec_fn=_die_with_parent)
            ready = {}
            if select.select([self.d.stdout], [], [], start_timeout)[0]:
                line = self.d.stdout.readline()
                ready = json.loads(line) if line.strip() else {}
            if not ready.get("ready"):
                raise StressError(f"metaroced in {ns} not ready within {start_timeout:.0f} s:\n"
                                  + Path(self.dir, "daemon.log").read_text()[-2000:])
            self.pid = int(ready["pid"])
            self.proc = psutil.Process(self.pid)
            self.ctx = client.connect(sock, ifname)
        except BaseException:
            self.close()
            raise

    def alloc(self, nbytes: int) -> np.ndarray:
        buf = self.ctx.alloc_buf(nbytes)            # zeroed shared memory the daemon maps
        buf.fill(0)
        return buf

    def destroy_qp(self, qp) -> None:
        qp.destroy()

    def qp_counters(self, qp) -> dict:
        q = qp.query()
        return {"state": QPState(q["state"]), "sq_psn": q["sq_psn"], "rq_psn": q["rq_psn"],
                "retransmits": q["retransmits"], "error": q.get("error")}

    def counters(self) -> dict:
        devs = [d for d in self.ctx.status()["devices"] if d.get("ifname") == self.ifname]
        c = devs[0]["counters"]
        return {"tx": c["plane"]["tx"], "rx": c["plane"]["rx"], "xdp": c["xdp_events"], "xsk": c["xsk"],
                "umem": c["umem"], "rss": self.proc.memory_info().rss, "plane": c["plane"]}

    def close(self) -> None:
        if self.ctx is not None:
            with contextlib.suppress(Exception):
                self.ctx.close()
            self.ctx = None
        if self.d is not None:
            _reap(self.d)
            self.d = None
            self.log.close()
        subprocess.run(["umount", self.bpffs], check=False, capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def _reap(p: subprocess.Popen, term_timeout: float = 15.0) -> None:
    """SIGTERM (metaroced drains and unpins), SIGKILL to its process group if it has not exited in time."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGTERM)
        try:
            p.wait(term_timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(p.pid), signal.SIGKILL)
            p.wait(10)
    if p.stdout is not None:
        p.stdout.close()


def _open_plane(plane: str, topo, ns: str, ifname: str, ipv6: bool, **kw):
    if plane == "compiled":
        return _CompiledPlane(topo, ns, ifname, ipv6)
    if plane == "daemon":
        return _DaemonPlane(topo, ns, ifname, ipv6, **kw)
    raise ValueError(f"plane must be one of {PLANES}, not {plane!r}")


# ---- what both planes are checked with ------------------------------------------------------------
def kernel_seen(c: dict) -> int:
    """MetaRoCE frames an endpoint's XDP program handled (steered, consumed or dropped), from counters()."""
    ev = c["xdp"]
    return (ev["STEERED"] + ev["ACK_CONSUMED"] + ev["NAK_CONSUMED"] + ev["RNR_CONSUMED"] + ev["DROPPED"]
            + ev.get("CNP_CONSUMED", 0))


def umem_account(u: dict) -> dict:
    """Where every UMEM frame is (daemon/server.py umem_frames): free on the loop's stack, with the
    kernel to receive into (fill ring to RX ring), with the kernel to send (TX ring to completion
    ring), in the loop's TX batch.  `leaked` is what none of those accounts for; it must be 0."""
    d = dict(u)
    d["leaked"] = u["total"] - (u["free"] + u["kernel_rx"] + u["kernel_tx"] + u["tx_pending"])
    return d


def delivery(c: dict) -> dict[str, int]:
    """Inside one host: frames the XDP program steered to the AF_XDP socket = frames the loop took in
    + frames the socket dropped (ring full, no fill buffer).  `residual` must be 0 once quiet."""
    steered = c["xdp"]["STEERED"]
    lost = int(c["xsk"].get("rx_dropped", 0)) + int(c["xsk"].get("rx_ring_full", 0))
    return {"steered": steered, "loop_rx": c["rx"], "socket_dropped": lost, "residual": steered - c["rx"] - lost}


@dataclass
class Endpoint:
    """One host's endpoint on a plane (compiled or daemon): one PD, one MR, one CQ, one QP."""

    topo: object
    ns: str
    plane: object
    buf: np.ndarray
    mr: object = None
    cq: object = None
    qp: object = None
    pd: object = None

    @classmethod
    def open(cls, topo, ns: str, ifname: str, mem: int, ipv6: bool = False, plane: str = "compiled",
             **plane_kw) -> "Endpoint":
        pl = _open_plane(plane, topo, ns, ifname, ipv6, **plane_kw)
        try:
            ep = cls(topo, ns, pl, pl.alloc(mem))
            ep.pd = pl.ctx.alloc_pd()
            ep.mr = ep.pd.reg_mr(ep.buf, FULL)
            ep.cq = pl.ctx.create_cq(CQ_DEPTH)
        except BaseException:
            pl.close()
            raise
        return ep

    @property
    def ctx(self):
        return self.plane.ctx

    def new_qp(self) -> None:
        if self.qp is not None:
            self.plane.destroy_qp(self.qp)
        while self.cq.poll(4096):
            pass
        self.qp = self.ctx.create_qp(self.pd, self.cq, self.cq)

    def connect(self, peer: "Endpoint", *, sq_psn: int, rq_psn: int, mtu: int = 1024, timeout: int = 12,
                retry_cnt: int = 7) -> None:
        with self.topo.enter(self.ns):       # in process: the route and neighbour lookups happen in our namespace
            q = self.qp
            q.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
            q.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=peer.qp.qp_num, rq_psn=rq_psn, path_mtu=mtu,
                            dgid=peer.ctx.gid, max_dest_rd_atomic=16, min_rnr_timer=1))
            q.modify(QPAttr(qp_state=QPState.RTS, sq_psn=sq_psn, timeout=timeout, retry_cnt=retry_cnt,
                            rnr_retry=7, max_rd_atomic=16))

    def sge(self, off: int, n: int) -> SGE:
        return SGE(self.mr.addr + off, n, self.mr.lkey)

    # ---- bookkeeping ---------------------------------------------------------
    def counters(self) -> dict:
        """The plane's counters in one shape: tx, rx (frames the loop sent and took in), xdp (the XDP
        program's events), xsk (the socket's statistics), umem (frames by place), rss (of the process
        that owns the plane: this one, or metaroced), plane (the loop's own stats)."""
        return self.plane.counters()

    def qp_counters(self) -> dict:
        """The QP's state, sq_psn, rq_psn, retransmits (go-back-N restarts) and error."""
        return self.plane.qp_counters(self.qp)

    def umem_frames(self) -> dict[str, int]:
        return umem_account(self.counters()["umem"])

    def kernel_seen(self) -> int:
        return kernel_seen(self.counters())

    def delivery(self) -> dict[str, int]:
        return delivery(self.counters())

    def close(self) -> None:
        self.plane.close()


@dataclass
class Report:
    ops: dict = field(default_factory=dict)          # op -> completed count
    bytes: int = 0
    wrs: int = 0
    packets_a: int = 0
    seconds: float = 0.0
    rss_samples: list = field(default_factory=list)  # (t, RSS of the process that owns A's plane)
    failures: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"ops": self.ops, "bytes": self.bytes, "wrs": self.wrs, "packets_sent_by_a": self.packets_a,
                "seconds": round(self.seconds, 2), "failures": self.failures[:10],
                "rss_start": self.rss_samples[0][1] if self.rss_samples else None,
                "rss_end": self.rss_samples[-1][1] if self.rss_samples else None}


class Workload:
    """A keeps up to `depth` work requests in flight to B, drawn round-robin from ops x sizes.

    Every WR owns a slot of both buffers until it completes, so a check never races with
    the next transfer: WRITE (A's slot -> B's slot), READ (B's slot -> A's slot), SEND with
    immediate (A's slot -> a receive WQE on B's slot; checked when both completions are
    in), ATOMIC FetchAdd of 1 on one counter (the k-th returns base + k: exactly once, in
    order).  Data comes from a random pool at a moving offset, so no two WRs carry the same
    bytes at the same place."""

    def __init__(self, a: Endpoint, b: Endpoint, *, ops=OPS, sizes=(0, 1, 1023, 1024, 1025, 65536),
                 depth: int = 16, seed: int = 1) -> None:
        self.a, self.b = a, b
        self.ops = [o for o in ops]
        for o in self.ops:
            if o not in OPS:
                raise ValueError(f"unknown op {o!r}; choose from {OPS}")
        self.sizes = list(sizes)
        self.plan = [(o, s) for s in self.sizes for o in self.ops if not (o == "atomic" and s != self.sizes[0])]
        self.slot = max(4096, -(-max(self.sizes) // 4096) * 4096)
        cells = 4096                                       # counter + atomic results live above the slots
        nslots = (min(a.buf.size, b.buf.size) - cells) // self.slot
        if nslots < 1:
            raise ValueError(f"buffers of {min(a.buf.size, b.buf.size)} B hold no slot of {self.slot} B")
        self.depth = min(depth, nslots)
        self.free_slots = list(range(self.depth))
        self.cell = min(a.buf.size, b.buf.size) - cells      # the FetchAdd counter (B), results above it (A)
        self.rng = np.random.default_rng(seed)
        self.pool = self.rng.integers(0, 256, self.slot * 2, dtype=np.uint8)
        self.next_wr = 0
        self.a_next = 0                                    # the wr_id A's next completion must carry
        self.atomics_done = 0
        self.counter_base = 0
        self.inflight: dict[int, tuple] = {}               # wr_id -> (op, size, slot, pool offset, extra)
        self.recv_wcs: dict[int, object] = {}               # wr_id (recv) -> WC
        self.report = Report(ops={o: 0 for o in self.ops})

    # ---- posting ---------------------------------------------------------------
    def _post_one(self) -> None:
        a, b = self.a, self.b
        op, size = self.plan[self.next_wr % len(self.plan)]
        wr_id = self.next_wr
        self.next_wr += 1
        slot = self.free_slots.pop()
        off = slot * self.slot
        po = int(self.rng.integers(0, self.slot))
        src = self.pool[po:po + size]
        if op == "write":
            a.buf[off:off + size] = src
            wr = SendWR(wr_id=wr_id, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(off, size)],
                        remote_addr=b.mr.addr + off, rkey=b.mr.rkey)
        elif op == "read":
            b.buf[off:off + size] = src
            a.buf[off:off + size] = ~src                 # a READ that moved nothing shows
            wr = SendWR(wr_id=wr_id, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(off, size)],
                        remote_addr=b.mr.addr + off, rkey=b.mr.rkey)
        elif op == "send":
            a.buf[off:off + size] = src
            b.buf[off:off + size] = ~src
            b.qp.post_recv(RecvWR(wr_id=wr_id, sg_list=[b.sge(off, self.slot)]))
            wr = SendWR(wr_id=wr_id, opcode=WROpcode.SEND_WITH_IMM, sg_list=[a.sge(off, size)],
                        imm_data=wr_id & 0xFFFFFFFF)
        else:
            res = self.cell + 8 + (slot % 500) * 8
            wr = SendWR(wr_id=wr_id, opcode=WROpcode.ATOMIC_FETCH_AND_ADD, sg_list=[a.sge(res, 8)],
                        remote_addr=b.mr.addr + self.cell, rkey=b.mr.rkey, compare_add=1)
            size = 8
        self.inflight[wr_id] = (op, size, slot, po)
        a.qp.post_send(wr)

    # ---- checking ----------------------------------------------------------------
    def _fail(self, msg: str) -> None:
        self.report.failures.append(msg)
        info = []
        for name, ep in (("A", self.a), ("B", self.b)):
            try:
                info.append(f"\n  {name}'s QP: {ep.qp_counters()}\n  {name}'s {ep.plane.name} plane: "
                            f"{ {k: v for k, v in ep.counters()['plane'].items() if v} }")
            except Exception as e:              # noqa: BLE001 - the failure itself is what matters
                info.append(f"\n  {name}: counters unreadable ({e})")
        raise StressError(msg + "".join(info))

    def _check(self, wr_id: int, recv_wc=None) -> None:
        op, size, slot, po = self.inflight.pop(wr_id)
        off = slot * self.slot
        src = self.pool[po:po + size]
        a, b = self.a, self.b
        if op == "write":
            ok = np.array_equal(b.buf[off:off + size], src)
        elif op == "read":
            ok = np.array_equal(a.buf[off:off + size], src)
        elif op == "send":
            if recv_wc.status != WCStatus.SUCCESS:
                self._fail(f"SEND wr {wr_id}: receive completed {recv_wc.status.name}")
            if recv_wc.byte_len != size or recv_wc.imm_data != (wr_id & 0xFFFFFFFF):
                self._fail(f"SEND wr {wr_id}: receive byte_len {recv_wc.byte_len} imm {recv_wc.imm_data} "
                           f"(sent {size}, imm {wr_id})")
            ok = np.array_equal(b.buf[off:off + size], src)
        else:
            res = self.cell + 8 + (slot % 500) * 8
            got = int(a.buf[res:res + 8].view(np.uint64)[0])
            ok = got == self.counter_base + self.atomics_done
            if not ok:
                self._fail(f"ATOMIC wr {wr_id}: FetchAdd returned {got}, expected "
                           f"{self.counter_base + self.atomics_done} (applied twice or lost)")
            self.atomics_done += 1
        if not ok:
            self._fail(f"{op.upper()} wr {wr_id} of {size} B completed SUCCESS but its bytes differ (CORRUPT)")
        self.report.ops[op] += 1
        self.report.bytes += size
        self.report.wrs += 1
        self.free_slots.append(slot)

    def _reap(self) -> bool:
        got = False
        for wc in self.b.cq.poll(256):
            got = True
            if wc.status != WCStatus.SUCCESS:
                self._fail(f"B's receive wr {wc.wr_id} failed: {wc.status.name}")
            self.recv_wcs[wc.wr_id] = wc
        for wc in self.a.cq.poll(256):
            got = True
            if wc.wr_id not in self.inflight:
                self._fail(f"completion for unknown wr {wc.wr_id}")
            if wc.wr_id != self.a_next:
                self._fail(f"completion of wr {wc.wr_id} where wr {self.a_next} was due (out of order)")
            self.a_next += 1
            if wc.status != WCStatus.SUCCESS:
                op = self.inflight[wc.wr_id][0].upper()
                self._fail(f"{op} wr {wc.wr_id} failed: {wc.status.name}")
            if self.inflight[wc.wr_id][0] == "send":
                self._pending_send.append(wc.wr_id)
            else:
                self._check(wc.wr_id)
        while self._pending_send and self._pending_send[0] in self.recv_wcs:
            w = self._pending_send.pop(0)
            self._check(w, self.recv_wcs.pop(w))
        return got

    def run(self, *, packets: int | None = None, seconds: float | None = None, wrs: int | None = None,
            stall: float = 30.0, rss_every: float = 5.0) -> Report:
        """Run until A has sent `packets` packets, `seconds` passed or `wrs` work requests were
        posted (whichever comes first), then drain.

        Raises StressError on the first wrong status, wrong byte, out-of-order completion or
        when no completion arrives for `stall` seconds (a hang)."""
        if packets is None and seconds is None and wrs is None:
            raise ValueError("give packets, seconds or wrs")
        first_wr = self.next_wr
        a = self.a
        self._pending_send: list[int] = []
        self.counter_base = int(self.b.buf[self.cell:self.cell + 8].view(np.uint64)[0])
        t0 = last = time.monotonic()
        next_rss = t0
        pkts0 = a.counters()["tx"]
        rep = self.report
        next_count = t0

        def done() -> bool:
            nonlocal next_count
            if wrs is not None and self.next_wr - first_wr >= wrs:
                return True
            now = time.monotonic()
            if seconds is not None and now - t0 >= seconds:
                return True
            if packets is None or now < next_count:
                return False
            next_count = now + 0.05            # the daemon's counters cost a request on its socket
            return a.counters()["tx"] - pkts0 >= packets

        stopping = False
        while True:
            if not stopping and done():
                stopping = True
            if not stopping:
                while self.free_slots and not (wrs is not None and self.next_wr - first_wr >= wrs):
                    self._post_one()
            if self._reap():
                last = time.monotonic()
            elif stopping and not self.inflight:
                break
            else:
                if time.monotonic() - last > stall:
                    self._fail(f"no completion for {stall:.0f} s with {len(self.inflight)} WRs in flight (hang)")
                time.sleep(0.0002)
            now = time.monotonic()
            if now >= next_rss:
                rep.rss_samples.append((round(now - t0, 1), a.plane.proc.memory_info().rss))
                next_rss = now + rss_every
        rep.rss_samples.append((round(time.monotonic() - t0, 1), a.plane.proc.memory_info().rss))
        rep.seconds = time.monotonic() - t0
        rep.packets_a = a.counters()["tx"] - pkts0
        return rep


class Fabric:
    """Hosts A and B joined through a switch (one subnet, a Linux bridge in namespace M), a
    router (two subnets, namespace R forwarding) or two routers in a row.  `ports` are the
    (namespace, interface) of the forwarding hop's egress towards A and towards B, where faults
    go (AF_XDP frames skip the sender's own tc hook).  `plane`: what the endpoints run on ("compiled"
    in this process, or "daemon": a metaroced per host, `daemon_progress` its progress option)."""

    def __init__(self, path: str = "switch", *, mtu: int = 1500, ipv6: bool = False, plane: str = "compiled",
                 daemon_progress: str = "sleep") -> None:
        from . import topo as topo_mod
        if plane not in PLANES:
            raise ValueError(f"plane must be one of {PLANES}, not {plane!r}")
        self.path, self.ipv6, self.plane = path, ipv6, plane
        self.plane_kw = {"progress": daemon_progress} if plane == "daemon" else {}
        if path == "switch":
            if ipv6:
                raise ValueError("the switched fabric is IPv4 only; use path='router' for IPv6")
            self.topo, _, _ = topo_mod.switched_hosts(mtu=mtu)
            self.ns_a, self.ns_b = self.topo[0], self.topo[2]
            self.if_a, self.if_b = "mr0", "mr1"
            self.ports = ((self.topo[1], "swA"), (self.topo[1], "swB"))
        elif path in ("router", "routers2"):
            r = topo_mod.routed_hosts(routers=1 if path == "router" else 2, mtu=mtu, ipv6=ipv6)
            self.topo = r.topo
            self.ns_a, self.ns_b = r.a.ns, r.b.ns
            self.if_a, self.if_b = r.a.ifname, r.b.ifname
            self.ports = ((r.toward_a.ns, r.toward_a.ifname), (r.toward_b.ns, r.toward_b.ifname))
            self.routers = list(r.routers)
        else:
            raise ValueError(f"path must be 'switch', 'router' or 'routers2', not {path!r}")
        self.eps: list[Endpoint] = []
        self.injectors: list[FaultInjector] = []

    def endpoints(self, mem: int = 64 << 20) -> tuple[Endpoint, Endpoint]:
        a = Endpoint.open(self.topo, self.ns_a, self.if_a, mem, self.ipv6, self.plane, **self.plane_kw)
        self.eps.append(a)
        b = Endpoint.open(self.topo, self.ns_b, self.if_b, mem, self.ipv6, self.plane, **self.plane_kw)
        self.eps.append(b)
        return a, b

    @contextlib.contextmanager
    def faults(self, seed: int = 1, **knobs):
        """The same impairment on the forwarding namespace's egress towards A and towards B."""
        (ns_ta, to_a), (ns_tb, to_b) = self.ports
        with FaultInjector(to_b, netns=ns_tb, seed=seed, **knobs) as fb, \
             FaultInjector(to_a, netns=ns_ta, seed=seed + 1000, **knobs) as fa:
            self.injectors = [fa, fb]
            try:
                yield fa, fb
            finally:
                self.fault_stats = [fa.stats(), fb.stats()]

    def link_drops(self) -> dict[str, int]:
        """Frames the forwarding namespaces' own interfaces dropped, by direction: a full input
        backlog counts as rx_dropped on the port the frame came in on, a full veth ring as
        tx_dropped on the port it was to leave by -- losses of the fabric itself, like a switch's
        buffer overflowing, which no injector counter sees.  A-facing ports end in "A"/"a"
        (swA, rA, r2a), B-facing ones in "B"/"b"."""
        out = {"a_to_b": 0, "b_to_a": 0}
        for ns in {ns for ns, _ in self.ports} | set(getattr(self, "routers", [])):
            for link in self.topo.ipr(ns).get_links():
                name = link.get_attr("IFLA_IFNAME") or ""
                st = link.get_attr("IFLA_STATS64") or {}
                side = name[-1:].lower()
                if side not in ("a", "b") or name.startswith("sw0"):
                    continue
                rx, tx = int(st.get("rx_dropped", 0)), int(st.get("tx_dropped", 0))
                if side == "a":
                    out["a_to_b"] += rx
                    out["b_to_a"] += tx
                else:
                    out["b_to_a"] += rx
                    out["a_to_b"] += tx
        return out

    def mark(self, a: Endpoint, b: Endpoint) -> dict:
        """Counters now, so that conservation() counts only what follows."""
        ca, cb = a.counters(), b.counters()
        return {"a_to_b": snapshot(ca, cb), "b_to_a": snapshot(cb, ca), "links": self.link_drops()}

    def conservation(self, a: Endpoint, b: Endpoint, base: dict) -> dict:
        """conservation() both ways since `base` (mark()), with the injectors' counters of the last
        faults() block and the fabric's own interface drops."""
        to_a, to_b = getattr(self, "fault_stats", ({}, {}))
        links = self.link_drops()
        ca, cb = a.counters(), b.counters()
        return {"a_to_b": conservation(ca, cb, to_b, base["a_to_b"], links["a_to_b"] - base["links"]["a_to_b"]),
                "b_to_a": conservation(cb, ca, to_a, base["b_to_a"], links["b_to_a"] - base["links"]["b_to_a"])}

    def quiesce(self, a: Endpoint, b: Endpoint, timeout: float = 10.0) -> None:
        """Wait until neither endpoint sends and no frame is on its way: both loops' transmit counts and
        both XDP programs' counts unchanged for half a second, and neither QP with work outstanding."""
        deadline = time.monotonic() + timeout
        quiet = 0
        last = None
        while time.monotonic() < deadline:
            ca, cb = a.counters(), b.counters()
            now = (ca["tx"], cb["tx"], kernel_seen(ca), kernel_seen(cb))
            busy = any(_outstanding(ep) for ep in (a, b))
            quiet = quiet + 1 if (now == last and not busy) else 0
            if quiet >= 5:
                return
            last = now
            time.sleep(0.1)
        raise StressError(f"endpoints still busy after {timeout}s")

    def close(self) -> None:
        for ep in self.eps:
            with contextlib.suppress(Exception):
                ep.close()
        self.eps.clear()
        self.topo.close()

    def __enter__(self) -> "Fabric":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _outstanding(ep: Endpoint) -> bool:
    """Work requests of the endpoint's QP not yet completed (either plane's query)."""
    q = ep.qp.query()
    return bool(q.get("sq_outstanding", q.get("outstanding_send", 0)))


def conservation(src: dict, dst: dict, fault: dict | None, base: tuple | None = None,
                 fabric_dropped: int = 0) -> dict:
    """Packets one way, from the two endpoints' counters(): what src's loop transmitted, what the
    path added and took away (the injector, and `fabric_dropped`: the forwarding hops' own interface
    drops, Fabric.link_drops), and what dst's XDP program handled.  `residual` must be 0 once the
    fabric is quiet.  `base` is an earlier `snapshot()` so only a run's own packets count."""
    tx = src["tx"]
    seen = kernel_seen(dst)
    if base is not None:
        tx -= base[0]
        seen -= base[1]
    f = fault or {}
    dropped = int(f.get("dropped", 0))
    added = int(f.get("duplicated", 0))
    # a frame to delay whose copy found the perf buffer full is passed undelayed (delay_failed) and the
    # same overrun is reported as a lost sample (delay_lost): not a frame lost, so only a failed
    # reinjection counts
    lost_in_delay = int(f.get("reinject_failed", 0))
    return {"sent": tx, "duplicated": added, "dropped": dropped, "delay_lost": lost_in_delay,
            "perf_overruns": int(f.get("delay_lost", 0)),
            "fabric_dropped": fabric_dropped, "received": seen,
            "residual": tx + added - dropped - lost_in_delay - fabric_dropped - seen}


def snapshot(src: dict, dst: dict) -> tuple:
    """(frames src's loop transmitted, frames dst's XDP program handled) from two counters()."""
    return (src["tx"], kernel_seen(dst))


__all__ = ["Endpoint", "Fabric", "Workload", "Report", "StressError", "conservation", "snapshot", "delivery",
           "kernel_seen", "umem_account", "OPS", "PLANES", "MATRIX_FAULTS", "MATRIX_SIZES", "MATRIX_PMTU",
           "MATRIX_WRAP", "connect_near_wrap"]
