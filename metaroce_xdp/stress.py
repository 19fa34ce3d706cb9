"""Long, checked traffic between two real endpoints: the fault matrix and the soak.

Role: drive one RC QP pair over XDP + AF_XDP endpoints (progress threads, as
users run them) with a mix of WRITE, READ, SEND and ATOMIC across a set of
sizes, keep a window of work requests in flight, and check every completion:
its status, its bytes, its order.  Around that, the bookkeeping a long run
needs to be trusted: resident memory over time (psutil), UMEM frames owned by
user space, the kernel and the rings (nothing leaks), and packet conservation
(what one side transmitted = what the other side's XDP program saw + what the
fault injector took away + what it added).

    with Fabric("switch") as fab:             # or "router": hosts in two subnets
        a, b = fab.endpoints()
        wl = Workload(a, b, ops=("write", "read"), sizes=(0, 1, 65536), start_psn=(1 << 24) - 500)
        with fab.faults(drop_ppm=10_000):
            rep = wl.run(packets=200_000)
        fab.quiesce(); print(fab.conservation(), a.umem_leak())

Neighbours: topo.py (namespaces, routers), faults.py (the tc BPF impairment),
rc/engine.py (Context), tools/soak.py (the `make soak` CLI), the fault-matrix
tests in tests/test_fault_matrix.py.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np
import psutil

from .faults import FaultInjector
from .rc.engine import Context
from .verbs_types import SGE, Access, QPAttr, QPState, RecvWR, SendWR, WCStatus, WROpcode

FULL = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC
OPS = ("write", "read", "send", "atomic")
PSN_MOD = 1 << 24

# The fault matrix of issue 6, shared by tests/test_fault_matrix.py and tools/soak.py
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


def _u32(x) -> int:
    return int(x) & 0xFFFFFFFF


@dataclass
class Endpoint:
    """One host's endpoint: context (engine on a progress thread), one PD, one MR, one CQ, one QP."""

    topo: object
    ns: str
    ctx: Context
    buf: np.ndarray
    mr: object = None
    cq: object = None
    qp: object = None
    pd: object = None

    @classmethod
    def open(cls, topo, ns: str, ifname: str, mem: int, ipv6: bool = False) -> "Endpoint":
        with topo.enter(ns):
            ctx = Context.open(ifname, progress_thread=True, ipv6=ipv6)
        buf = np.empty(mem, np.uint8)
        buf.fill(0)                          # touch every page now, so RSS samples compare like with like
        ep = cls(topo, ns, ctx, buf)
        ep.pd = ctx.alloc_pd()
        ep.mr = ep.pd.reg_mr(ep.buf, FULL)
        ep.cq = ctx.create_cq(1 << 16)
        return ep

    def new_qp(self) -> None:
        if self.qp is not None:
            self.ctx.destroy_qp(self.qp)
        while self.cq.poll(4096):
            pass
        self.qp = self.ctx.create_qp(self.pd, self.cq, self.cq)

    def connect(self, peer: "Endpoint", *, sq_psn: int, rq_psn: int, mtu: int = 1024, timeout: int = 12,
                retry_cnt: int = 7) -> None:
        with self.topo.enter(self.ns):       # the route and neighbour lookups happen in our namespace
            q = self.qp
            q.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
            q.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=peer.qp.qp_num, rq_psn=rq_psn, path_mtu=mtu,
                            dgid=peer.ctx.gid, max_dest_rd_atomic=16, min_rnr_timer=1))
            q.modify(QPAttr(qp_state=QPState.RTS, sq_psn=sq_psn, timeout=timeout, retry_cnt=retry_cnt,
                            rnr_retry=7, max_rd_atomic=16))

    def sge(self, off: int, n: int) -> SGE:
        return SGE(self.mr.addr + off, n, self.mr.lkey)

    # ---- bookkeeping ---------------------------------------------------------
    def umem_frames(self) -> dict[str, int]:
        """Where every UMEM frame is: free in the pool, held by the kernel for RX (fill ring
        and the socket's pool), in flight on TX (TX and completion rings), or cached by the
        port.  `leaked` is what none of those accounts for; it must be 0."""
        port = self.ctx.port
        with self.ctx.engine.lock:
            xsk = port.xsk
            rx_owned = _u32(int(xsk.fill.producer[0]) - int(xsk.rx.consumer[0]))
            tx_owned = _u32(int(xsk.tx.producer[0]) - int(xsk.comp.consumer[0]))
            cached = len(port._cache) - port._ci if port._cache is not None else 0
            held = 0 if port._rx_addrs is None else len(port._rx_addrs)
            free = port.pool.free_count
            total = port.umem.nframes
            d = {"total": total, "free": free, "kernel_rx": rx_owned, "kernel_tx": tx_owned,
                 "cached": cached, "pending_tx": port.tx_n, "rx_held": held}
        d["leaked"] = total - (free + rx_owned + tx_owned + cached + port.tx_n + held)
        return d

    def kernel_seen(self) -> int:
        """MetaRoCE frames this endpoint's XDP program handled (steered, consumed or dropped)."""
        ev = self.ctx.loader.events()
        return (ev["STEERED"] + ev["ACK_CONSUMED"] + ev["NAK_CONSUMED"] + ev["RNR_CONSUMED"] + ev["DROPPED"]
                + ev.get("CNP_CONSUMED", 0))

    def delivery(self) -> dict[str, int]:
        """Inside this host: frames the XDP program steered to the AF_XDP socket = frames the
        engine took in + frames the socket dropped (ring full, no fill buffer).  `residual` must
        be 0 once quiet."""
        steered = self.ctx.loader.events()["STEERED"]
        xs = self.ctx.port.xsk.statistics()
        rx = self.ctx.engine.stats["rx"]
        lost = int(xs.get("rx_dropped", 0)) + int(xs.get("rx_ring_full", 0))
        return {"steered": steered, "engine_rx": rx, "socket_dropped": lost, "residual": steered - rx - lost}

    def close(self) -> None:
        self.ctx.close()


@dataclass
class Report:
    ops: dict = field(default_factory=dict)          # op -> completed count
    bytes: int = 0
    wrs: int = 0
    packets_a: int = 0
    seconds: float = 0.0
    rss_samples: list = field(default_factory=list)  # (t, rss A-process bytes)
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
        self.proc = psutil.Process()

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
        qa, qb = self.a.qp.query(), self.b.qp.query()
        keep = ("state", "error", "sq_psn", "acked_psn", "rq_psn", "retransmits", "timeouts", "naks_received",
                "seq_naks_sent", "duplicates", "dup_read_replays", "dup_read_discards", "rx_stale_rsp",
                "rx_ghost_rsp")
        raise StressError(f"{msg}\n  A's QP: {({k: qa[k] for k in keep if k in qa})}"
                          f"\n  B's QP: {({k: qb[k] for k in keep if k in qb})}"
                          f"\n  A's engine: {dict(self.a.ctx.engine.stats)}\n  B's engine: {dict(self.b.ctx.engine.stats)}")

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
        pkts0 = a.qp.query()["packets_sent"]
        rep = self.report

        def done() -> bool:
            if wrs is not None and self.next_wr - first_wr >= wrs:
                return True
            if seconds is not None and time.monotonic() - t0 >= seconds:
                return True
            return packets is not None and a.qp.query()["packets_sent"] - pkts0 >= packets

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
                rep.rss_samples.append((round(now - t0, 1), self.proc.memory_info().rss))
                next_rss = now + rss_every
        rep.rss_samples.append((round(time.monotonic() - t0, 1), self.proc.memory_info().rss))
        rep.seconds = time.monotonic() - t0
        rep.packets_a = a.qp.query()["packets_sent"] - pkts0
        return rep


class Fabric:
    """Hosts A and B joined through a switch (one subnet, a Linux bridge in namespace M), a
    router (two subnets, namespace R forwarding) or two routers in a row.  `ports` are the
    (namespace, interface) of the forwarding hop's egress towards A and towards B, where faults
    go (AF_XDP frames skip the sender's own tc hook)."""

    def __init__(self, path: str = "switch", *, mtu: int = 1500, ipv6: bool = False) -> None:
        from . import topo as topo_mod
        self.path, self.ipv6 = path, ipv6
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
        a = Endpoint.open(self.topo, self.ns_a, self.if_a, mem, self.ipv6)
        self.eps.append(a)
        b = Endpoint.open(self.topo, self.ns_b, self.if_b, mem, self.ipv6)
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
        return {"a_to_b": snapshot(a, b), "b_to_a": snapshot(b, a), "links": self.link_drops()}

    def conservation(self, a: Endpoint, b: Endpoint, base: dict) -> dict:
        """conservation() both ways since `base` (mark()), with the injectors' counters of the last
        faults() block and the fabric's own interface drops."""
        to_a, to_b = getattr(self, "fault_stats", ({}, {}))
        links = self.link_drops()
        return {"a_to_b": conservation(a, b, to_b, base["a_to_b"], links["a_to_b"] - base["links"]["a_to_b"]),
                "b_to_a": conservation(b, a, to_a, base["b_to_a"], links["b_to_a"] - base["links"]["b_to_a"])}

    def quiesce(self, a: Endpoint, b: Endpoint, timeout: float = 10.0) -> None:
        """Wait until neither engine has work and no frame is on its way."""
        deadline = time.monotonic() + timeout
        quiet = 0
        last = None
        while time.monotonic() < deadline:
            now = (a.ctx.engine.stats["tx"], b.ctx.engine.stats["tx"], a.kernel_seen(), b.kernel_seen())
            busy = a.ctx.engine.busy() or b.ctx.engine.busy()
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


def conservation(src: Endpoint, dst: Endpoint, fault: dict | None, base: tuple | None = None,
                 fabric_dropped: int = 0) -> dict:
    """Packets one way: what src's engine transmitted, what the path added and took away (the
    injector, and `fabric_dropped`: the forwarding hops' own interface drops, Fabric.link_drops),
    and what dst's XDP program handled.  `residual` must be 0 once the fabric is quiet.  `base`
    is an earlier `snapshot()` so only a run's own packets count."""
    tx = src.ctx.engine.stats["tx"]
    seen = dst.kernel_seen()
    if base is not None:
        tx -= base[0]
        seen -= base[1]
    f = fault or {}
    dropped = int(f.get("dropped", 0))
    added = int(f.get("duplicated", 0))
    lost_in_delay = int(f.get("delay_lost", 0)) + int(f.get("reinject_failed", 0))
    return {"sent": tx, "duplicated": added, "dropped": dropped, "delay_lost": lost_in_delay,
            "fabric_dropped": fabric_dropped, "received": seen,
            "residual": tx + added - dropped - lost_in_delay - fabric_dropped - seen}


def snapshot(src: Endpoint, dst: Endpoint) -> tuple:
    return (src.ctx.engine.stats["tx"], dst.kernel_seen())


__all__ = ["Endpoint", "Fabric", "Workload", "Report", "StressError", "conservation", "snapshot", "OPS",
           "MATRIX_FAULTS", "MATRIX_SIZES", "MATRIX_PMTU", "MATRIX_WRAP", "connect_near_wrap"]
