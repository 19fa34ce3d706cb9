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
    """One progress round of either engine (the compiled plane or the Python engine)."""
    ctx = side.ctx
    if hasattr(ctx, "plane"):
        ctx.progress()
    else:
        ctx.engine.progress()


def stats(side):
    return side.ctx.stats() if hasattr(side.ctx, "plane") else dict(side.ctx.engine.stats)


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
