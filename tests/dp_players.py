"""Compiled-plane players (tests/players.py) in namespaces of an emulated network: a Side owns a Context, a
Fabric builds the network with a Side on host A and one on host B (what the `fabric` and `make_fabric`
fixtures of tests/conftest.py yield), and LoopPairs makes fresh connected players on one Fabric per test
(the `dp_loop` fixture)."""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from types import SimpleNamespace

from metaroce_xdp.dp import Context
from metaroce_xdp.verbs_types import Access
from players import FULL, Player, run_until, to_rts, wait_wcs

__all__ = ["FULL", "Side", "FreshSide", "Fabric", "Faults", "LoopPlayer", "LoopPairs", "collect", "connected",
           "make_switched", "run_until", "to_rts", "wait_wcs"]


class Side(Player):
    """A compiled-plane Context opened on `ifname` in namespace `ns` (open_kw: Context.open's; no progress
    thread unless asked: the test runs the rounds) -- or `ctx`, opened there already -- a PD, an MR over a
    zeroed buffer of `size` bytes and a CQ of `cq_depth`; a QP made at once (qp) or by new_qp()."""

    CONNECT = dict(timeout=12, rd_atomic=16, min_rnr_timer=1)

    def __init__(self, topo, ns, ifname=None, size: int = 1 << 22, cq_depth: int = 1 << 14, ctx=None,
                 qp: bool = False, **open_kw):
        if ctx is None:
            with topo.enter(ns):
                ctx = Context.open(ifname, **open_kw)
        super().__init__(ctx, topo, ns)
        self.resources(size, cq_depth=cq_depth, qp=qp)


class FreshSide(Side):
    """A Side (8 MiB unless `size` says) whose CQ outlives the QPs a module's tests make: new_qp() takes what
    the previous QP left on it first; connected with 4 RDMA READ / atomic resources each way."""

    CONNECT = dict(timeout=12, rd_atomic=4, min_rnr_timer=1)

    def __init__(self, topo, ns, ifname=None, size: int = 1 << 23, cq_depth: int = 1 << 16, **kw):
        super().__init__(topo, ns, ifname, size, cq_depth, **kw)

    def new_qp(self, cap=None):
        self.destroy_qp()
        while self.cq.poll(1 << 14):
            pass
        self.qp = self.ctx.create_qp(self.pd, self.cq, self.cq, cap)
        return self.qp


def collect(side, n, others, timeout=10.0):
    """n completions from side.cq, progressing side and `others` meanwhile."""
    return wait_wcs([side, *others], side, n, timeout)


# ---- the emulated network ---------------------------------------------------------------------------------------

class Capture:
    """tcpdump in namespace `ns` on `ifname` writing `filt`'s frames to a pcap file (`path`) as they pass;
    stop() ends it (the file then holds everything), close() removes the file too (unless
    METAROCE_KEEP_PCAP is set)."""

    def __init__(self, topo, ns: str, ifname: str, tag: str, args=(), filt: str = "udp port 4791") -> None:
        self.path = f"/tmp/metaroce-{tag}-{os.getpid()}.pcap"
        self.proc = topo.popen(ns, ["tcpdump", "-q", "--immediate-mode", *args, "-i", ifname, "-w", self.path,
                                    "-U", filt], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self, timeout: float = 5) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def close(self) -> None:
        self.stop()
        if os.path.exists(self.path) and not os.environ.get("METAROCE_KEEP_PCAP"):
            os.unlink(self.path)


class Fabric:
    """An emulated network of namespaces (metaroce_xdp.topo) with a Side on host A and one on host B; close()
    (or the `with` block's end) takes all of it away.  `topo, a, b = fabric` unpacks it.

    kind "flat": two_hosts -- A (mr0, 10.77.0.1) and B (mr1, 10.77.0.2) on one veth (veth_queues: RX/TX queues
         of each end);
    "switched": switched_hosts -- A (mr0) and B (mr1) through a switch namespace (bridge sw0, ports swA, swB),
         with `hosts` - 2 more hosts on it (namespace topo[3 + i], mr<2 + i>, 10.77.0.<3 + i>, port sw<C + i>);
    "routed": routed_hosts -- A (10.78.0.1) and B in two subnets behind `routers` IP routers (veth_queues: RX/TX
         queues of every veth end); `routed` is the RoutedHosts.
    `ifaces`: A's, B's (and further hosts') interface, each with its ns, ifname and ipv4.
    addr6: IPv6 on the hosts' links: True, the builder's own (two_hosts: fd77::1 and ::2; routed_hosts: the
         segments fd78:<k>::/64); or (A's, B's) addresses added to their interfaces (/64, no DAD).
    capture: {"tag": name in the pcap's path, "args": more tcpdump arguments}: a Capture on the switch's bridge
         sw0 (`capture`).
    side: the Side class (None: no Sides; the namespaces only), side_kw its arguments.

    Frames an AF_XDP socket sends skip the sender's own tc egress hook, so impairments sit where the network
    forwards them: the switch's or the router's egress port towards a host."""

    def __init__(self, kind: str = "switched", *, mtu: int = 1500, hosts: int = 2, routers: int = 1,
                 addr6: bool | tuple[str, str] = False, prefix: str = "mr", veth_queues: int = 1, capture=None,
                 side=Side, **side_kw) -> None:
        from metaroce_xdp import topo as T
        self.kind = kind
        self.routed = self.capture = self.a = self.b = None
        if kind == "flat":
            self.topo, self.pair = T.two_hosts(mtu=mtu, prefix=prefix, queues=veth_queues, ipv6=addr6 is True)
            self.ifaces = [self.pair.a, self.pair.b]
        elif kind == "switched":
            if addr6 is True:
                raise ValueError("switched_hosts has no IPv6 addresses of its own: name them, addr6=(A's, B's)")
            self.topo, left, right = T.switched_hosts(mtu=mtu, prefix=prefix, extra_hosts=hosts - 2)
            self.ifaces = [left.a, right.b] + [SimpleNamespace(ns=self.topo[3 + i], ifname=f"mr{2 + i}",
                                                              ipv4=f"10.77.0.{3 + i}") for i in range(hosts - 2)]
        elif kind == "routed":
            self.routed = T.routed_hosts(routers=routers, ipv6=addr6 is True, mtu=mtu, prefix=prefix,
                                         queues=veth_queues)
            self.topo = self.routed.topo
            self.ifaces = [self.routed.a, self.routed.b]
        else:
            raise ValueError(f"no fabric kind {kind!r}: flat, switched or routed")
        try:
            for ep, addr in zip(self.ifaces, addr6 if isinstance(addr6, tuple) else ()):
                h = self.topo.ipr(ep.ns)
                h.addr("add", index=h.link_lookup(ifname=ep.ifname)[0], address=addr, prefixlen=64,
                       flags=T.IFA_F_NODAD)
            if capture is not None:
                if kind != "switched":
                    raise ValueError("a capture sits on the switch's bridge: a switched fabric's")
                self.capture = Capture(self.topo, self.topo[1], "sw0", **capture)
            if side is not None:
                self.a = side(self.topo, self.ifaces[0].ns, self.ifaces[0].ifname, **side_kw)
                self.b = side(self.topo, self.ifaces[1].ns, self.ifaces[1].ifname, **side_kw)
        except BaseException:
            self.close()
            raise

    def __iter__(self):
        return iter((self.topo, self.a, self.b))

    def port_toward(self, host: str) -> tuple[str, str]:
        """(namespace, interface) where the network sends frames out towards host "a", "b" (or "c", ... on a
        switch)."""
        if self.kind == "switched":
            return self.topo[1], "sw" + host.upper()
        if self.kind == "routed":
            ep = {"a": self.routed.toward_a, "b": self.routed.toward_b}[host]
            return ep.ns, ep.ifname
        raise ValueError("a flat fabric forwards nothing: no port to impair")

    def impair(self, toward: str, **knobs):
        """A FaultInjector (metaroce_xdp.faults: seeded drop, duplication, corruption, reordering, CE marks...)
        on the port towards host `toward`; a context manager: the test closes it."""
        from metaroce_xdp.faults import FaultInjector
        ns, ifname = self.port_toward(toward)
        return FaultInjector(ifname, netns=ns, **knobs)

    def close(self) -> None:
        for s in (self.a, self.b):
            if s is not None:
                s.close()
        self.a = self.b = None
        if self.capture is not None:
            self.capture.close()
        self.topo.close()

    def __enter__(self) -> "Fabric":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def make_switched(**kw):
    """(topology, A's Side, B's Side) of a switched Fabric(**kw), closed by the caller: tools/native_loss_bench.py."""
    f = Fabric("switched", **kw)
    return f.topo, f.a, f.b


def connected(a: Side, b: Side, seeds=(1, 2), drain: bool = False, **kw):
    """A fresh QP on each Side, connected to each other (Side.connect: kw, both ways), A's buffer filled with
    seeded random bytes (seeds[0]) and B's (seeds[1]); a seed None zeroes the buffer, a side without a seed
    keeps its bytes.  drain=True also takes what earlier tests' QPs left: completions and async events."""
    a.new_qp(), b.new_qp()
    a.connect(b, **kw), b.connect(a, **kw)
    for s, seed in zip((a, b), seeds):
        if seed is None:
            s.buf[:] = 0
        else:
            s.fill(seed)
    if drain:
        a.flush(), b.flush()
    return a, b


# ---- loop pairs on the compiled plane ---------------------------------------------------------------------------
#
# Two compiled-plane Contexts (no progress thread: the test drives the rounds) on a switched Fabric
# (A mr0 -- switch -- B mr1), shared by every pair a test module asks for; each pair() is a fresh PD, MR, CQ and
# QP on both sides, connected.  Faults go on the switch's egress ports (Fabric.impair), through the same tc
# program the fault matrix uses.  Everything a pair made is destroyed when the test ends; the Fabric is
# rebuilt when a Context runs short of CQ rows.

@dataclass
class Faults:
    """Seeded impairments of one direction (probabilities), applied by metaroce_xdp.faults on the switch."""
    seed: int = 1
    drop: float = 0.0
    dup: float = 0.0
    corrupt: float = 0.0
    reorder: float = 0.0
    ce: float = 0.0
    psn_drop_once: tuple = ()

    def knobs(self) -> dict:
        ppm = lambda p: int(round(p * 1_000_000))          # noqa: E731
        return dict(seed=self.seed, drop_ppm=ppm(self.drop), dup_ppm=ppm(self.dup),
                    corrupt_ppm=ppm(self.corrupt), reorder_ppm=ppm(self.reorder), reorder_delay_us=300,
                    ecn_ce_ppm=ppm(self.ce), psn_drop_once=tuple(self.psn_drop_once))


class LoopPlayer(Player):
    """One side of a loop pair: the Side's Context, and a PD, one MR over `buf`, a CQ and a QP of its own."""

    CONNECT = dict(sq_psn=100, rq_psn=100, timeout=8, rd_atomic=4, min_rnr_timer=1)

    def __init__(self, side: Side, size: int = 1 << 20, access: Access = FULL, qp_access: Access = FULL,
                 cq_depth: int = 1024):
        super().__init__(side.ctx, side.topo, side.ns)
        self.side = side
        self.resources(size, access=access, cq_depth=cq_depth, qp=True)
        self.qp_access = qp_access

    def connect(self, peer: "LoopPlayer", **kw) -> None:
        super().connect(peer, access=self.qp_access, **kw)


class LoopPairs:
    """The factory behind the `dp_loop` fixture (tests/conftest.py); fabric_kw: the module's `fabric` mark."""

    CQ_HEADROOM = 8

    def __init__(self, mtu: int = 1500, **fabric_kw) -> None:
        self.fabric_kw = dict(fabric_kw, mtu=mtu, size=1 << 12)
        self.fabric: Fabric | None = None
        self.players: list[LoopPlayer] = []
        self.injectors: list = []

    def _open(self) -> Fabric:
        if self.fabric is not None:
            from metaroce_xdp.dp import layout as L
            if max(self.fabric.a.ctx._cq_next, self.fabric.b.ctx._cq_next) + self.CQ_HEADROOM <= L.MAX_CQS:
                return self.fabric
            self.close()
        self.fabric = Fabric("switched", **self.fabric_kw)
        return self.fabric

    def __call__(self, faults_ab: Faults | None = None, faults_ba: Faults | None = None, size: int = 1 << 20,
                 b_access: Access = FULL, b_qp_access: Access = FULL, a_cq_depth: int = 1024,
                 b_cq_depth: int = 1024, **conn):
        fab = self._open()
        a = LoopPlayer(fab.a, size, cq_depth=a_cq_depth)
        self.players.append(a)
        b = LoopPlayer(fab.b, size, b_access, b_qp_access, cq_depth=b_cq_depth)
        self.players.append(b)
        for f, toward in ((faults_ab, "b"), (faults_ba, "a")):
            if f is not None:
                self.injectors.append(fab.impair(toward, **f.knobs()))
        psn, peer_psn = conn.pop("psn", 100), conn.pop("peer_psn", 100)
        a.connect(b, sq_psn=psn, rq_psn=peer_psn, **conn)
        b.connect(a, sq_psn=peer_psn, rq_psn=psn, **conn)
        return a, b

    def end_test(self) -> None:
        for fi in self.injectors:
            fi.close()
        self.injectors.clear()
        for p in self.players:
            try:
                p.release()
            except Exception:                          # noqa: BLE001 -- a test may have closed the context
                pass
        self.players.clear()
        if self.fabric is not None:
            for s in (self.fabric.a, self.fabric.b):
                if s.ctx.closed:
                    self.close()
                    return
                s.ctx.progress()
                while s.ctx.async_events.get() is not None:
                    pass

    def close(self) -> None:
        if self.fabric is not None:
            fab, self.fabric = self.fabric, None
            fab.close()
