"""Two compiled-plane endpoints in two namespaces joined by a veth (tests/test_dp_*.py)."""
from __future__ import annotations

import contextlib

import numpy as np

from metaroce_xdp.dp import Context
from metaroce_xdp.topo import two_hosts
from metaroce_xdp.verbs_types import SGE, Access, QPAttr, QPCap, QPState

FULL = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC


class Side:
    def __init__(self, topo, ns, ifname, size=1 << 22, ctx_cls=Context, **open_kw):
        self.topo, self.ns = topo, ns
        with topo.enter(ns):
            self.ctx = ctx_cls.open(ifname, **open_kw)
        self.pd = self.ctx.alloc_pd()
        self.buf = np.zeros(size, np.uint8)
        self.mr = self.pd.reg_mr(self.buf, FULL)
        self.cq = self.ctx.create_cq(1 << 14)
        self.qp = None

    def new_qp(self, cap=None):
        if self.qp is not None:
            self.ctx.destroy_qp(self.qp)
        self.qp = self.ctx.create_qp(self.pd, self.cq, self.cq, cap or QPCap())
        return self.qp

    def connect(self, peer, mtu=1024, timeout=12, retry_cnt=7, rnr_retry=7, min_rnr_timer=1, psn=0x100,
                peer_psn=0x100):
        with self.topo.enter(self.ns):
            q = self.qp
            q.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
            q.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=peer.qp.qp_num, rq_psn=peer_psn, path_mtu=mtu,
                            dgid=peer.ctx.gid, max_dest_rd_atomic=16, min_rnr_timer=min_rnr_timer))
            q.modify(QPAttr(qp_state=QPState.RTS, sq_psn=psn, timeout=timeout, retry_cnt=retry_cnt,
                            rnr_retry=rnr_retry, max_rd_atomic=16))

    def sge(self, off, n):
        return SGE(self.mr.addr + off, n, self.mr.lkey)

    def close(self):
        self.ctx.close()


def step(side):
    """One progress round of the side's compiled plane."""
    side.ctx.progress()


def stats(side):
    return side.ctx.stats()


def drive(sides, until, timeout=10.0):
    """Progress the (non-threaded) endpoints until until() is true."""
    import time
    t0 = time.monotonic()
    while not until():
        for s in sides:
            step(s)
        if time.monotonic() - t0 > timeout:
            raise TimeoutError("condition not reached; stats: " + "; ".join(str(stats(s)) for s in sides))


def collect(side, n, others, timeout=10.0):
    """n completions from side.cq, progressing all sides meanwhile."""
    out = []
    drive([side, *others], lambda: (out.extend(side.cq.poll(n - len(out))) or len(out) >= n), timeout)
    return out


def make_pair(mtu=1500, **kw):
    topo, pair = two_hosts(mtu=mtu)
    a = b = None
    try:
        a = Side(topo, topo[0], "mr0", **kw)
        b = Side(topo, topo[1], "mr1", **kw)
    except BaseException:
        for s in (a, b):
            if s is not None:
                s.close()
        topo.close()
        raise
    return topo, a, b


def make_switched(mtu=1500, topo=None, **kw):
    """A (mr0) <-> switch namespace (swA, swB: where faults are injected) <-> B (mr1)."""
    from metaroce_xdp.topo import switched_hosts
    if topo is None:
        topo, _, _ = switched_hosts(mtu=mtu)
    a = b = None
    try:
        a = Side(topo, topo[0], "mr0", **kw)
        b = Side(topo, topo[2], "mr1", **kw)
    except BaseException:
        for s in (a, b):
            if s is not None:
                s.close()
        topo.close()
        raise
    return topo, a, b


@contextlib.contextmanager
def opened(make=make_pair, **kw):
    """The topology and two Sides `make` builds (make_pair or make_switched, with kw), closed after:
    what each test module's `fabric` fixture yields."""
    topo, a, b = make(**kw)
    try:
        yield topo, a, b
    finally:
        a.close()
        b.close()
        topo.close()


def connected(fabric, drain: bool = False):
    """A fresh QP on each Side of `fabric`, connected to each other, the buffers filled with seeded
    random bytes; drain=True first takes what earlier tests' QPs left: completions and async events."""
    topo, a, b = fabric
    a.new_qp(), b.new_qp()
    a.connect(b), b.connect(a)
    a.buf[:] = np.random.default_rng(1).integers(0, 256, a.buf.size, dtype=np.uint8)
    b.buf[:] = np.random.default_rng(2).integers(0, 256, b.buf.size, dtype=np.uint8)
    if drain:
        for s in (a, b):
            while s.cq.poll(1 << 14):
                pass
            while s.ctx.async_events.get() is not None:
                pass
    return a, b


# ---- loop pairs on the compiled plane ---------------------------------------------------------------------------
#
# Two compiled-plane Contexts (no progress thread: the test drives the rounds) on a switched topology
# (A mr0 -- switch -- B mr1), shared by every pair a test module asks for; each pair() is a fresh PD, MR, CQ and
# QP on both sides, connected.  Faults go where AF_XDP frames can be touched: the switch's egress ports (an
# AF_XDP transmit skips the sender's own tc hook), swB for A -> B and swA for B -> A, through the same tc
# program the fault matrix uses.  Everything a pair made is destroyed when the test ends; the topology is
# rebuilt when a Context runs short of CQ rows.

from dataclasses import dataclass  # noqa: E402


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


class Player:
    """One side of a loop pair: the shared Context, a PD, one MR over `buf`, a CQ and a QP of its own."""

    def __init__(self, side: Side, size: int = 1 << 20, access: Access = FULL, qp_access: Access = FULL,
                 cq_depth: int = 1024):
        self.side, self.ctx, self.topo, self.ns = side, side.ctx, side.topo, side.ns
        self.pd = self.ctx.alloc_pd()
        self.buf = np.zeros(size, np.uint8)
        self.mr = self.pd.reg_mr(self.buf, access)
        self.cq = self.ctx.create_cq(cq_depth)
        self.qp = self.ctx.create_qp(self.pd, self.cq, self.cq)
        self.qp_access = qp_access

    def connect(self, peer: "Player", mtu: int = 1024, psn: int = 100, peer_psn: int = 100, timeout: int = 8,
                retry_cnt: int = 7, rnr_retry: int = 7, min_rnr_timer: int = 1, rd_atomic: int = 4) -> None:
        with self.topo.enter(self.ns):
            q = self.qp
            q.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=self.qp_access))
            q.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=peer.qp.qp_num, rq_psn=peer_psn, path_mtu=mtu,
                            dgid=peer.ctx.gid, max_dest_rd_atomic=rd_atomic, min_rnr_timer=min_rnr_timer))
            q.modify(QPAttr(qp_state=QPState.RTS, sq_psn=psn, timeout=timeout, retry_cnt=retry_cnt,
                            rnr_retry=rnr_retry, max_rd_atomic=rd_atomic))

    def sge(self, off: int, length: int) -> SGE:
        return SGE(self.mr.addr + off, length, self.mr.lkey)

    def release(self) -> None:
        ctx = self.ctx
        if not ctx.closed:
            if ctx.qps.get(self.qp.qi) is self.qp:       # (a test may have destroyed it)
                ctx.destroy_qp(self.qp)
            if getattr(self.mr, "valid", True):
                ctx.dereg_mr(self.mr)
            for release in (lambda: ctx.destroy_cq(self.cq), lambda: ctx.dealloc_pd(self.pd)):
                try:
                    release()
                except Exception:                      # noqa: BLE001 -- what a test left may still use them
                    pass


class LoopPairs:
    """The factory behind the `dp_loop` fixture (tests/conftest.py)."""

    CQ_HEADROOM = 8

    def __init__(self, mtu: int = 1500) -> None:
        self.mtu = mtu
        self.fabric = None
        self.players: list[Player] = []
        self.injectors: list = []

    def _open(self):
        if self.fabric is not None:
            a, b = self.fabric[1], self.fabric[2]
            from metaroce_xdp.dp import layout as L
            if max(a.ctx._cq_next, b.ctx._cq_next) + self.CQ_HEADROOM <= L.MAX_CQS:
                return self.fabric
            self.close()
        self.fabric = make_switched(mtu=self.mtu, size=1 << 12)
        return self.fabric

    def __call__(self, faults_ab: Faults | None = None, faults_ba: Faults | None = None, size: int = 1 << 20,
                 b_access: Access = FULL, b_qp_access: Access = FULL, a_cq_depth: int = 1024,
                 b_cq_depth: int = 1024, **conn):
        topo, sa, sb = self._open()
        a = Player(sa, size, cq_depth=a_cq_depth)
        self.players.append(a)
        b = Player(sb, size, b_access, b_qp_access, cq_depth=b_cq_depth)
        self.players.append(b)
        from metaroce_xdp.faults import FaultInjector
        for f, port in ((faults_ab, "swB"), (faults_ba, "swA")):
            if f is not None:
                self.injectors.append(FaultInjector(port, netns=topo[1], **f.knobs()))
        psn, peer_psn = conn.pop("psn", 100), conn.pop("peer_psn", 100)
        a.connect(b, psn=psn, peer_psn=peer_psn, **conn)
        b.connect(a, psn=peer_psn, peer_psn=psn, **conn)
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
            for s in self.fabric[1:]:
                if s.ctx.closed:
                    self.close()
                    return
                s.ctx.progress()
                while s.ctx.async_events.get() is not None:
                    pass

    def close(self) -> None:
        if self.fabric is not None:
            topo, a, b = self.fabric
            self.fabric = None
            for s in (a, b):
                s.close()
            topo.close()


def run_until(players, cond, timeout: float = 10.0) -> None:
    """Progress every distinct Context of `players` until cond() is true (bounded)."""
    import time
    ctxs = list({id(p.ctx): p.ctx for p in players}.values())
    deadline = time.monotonic() + timeout
    while not cond():
        for c in ctxs:
            c.progress()
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached; QPs: " + "; ".join(str(p.qp.query()) for p in players))


def wait_wcs(players, player, n: int, timeout: float = 10.0):
    """n completions from player.cq (fewer only on timeout: TimeoutError), progressing all meanwhile."""
    got = []
    run_until(players, lambda: (got.extend(player.cq.poll(n - len(got))) or len(got) >= n), timeout)
    return got
