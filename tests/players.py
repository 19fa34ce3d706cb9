"""What every test harness shares: one endpoint's verbs resources (Player), a QP taken to RTS (to_rts), and
bounded waits for a condition or for completions (run_until, wait_wcs).

The harnesses derive from it: tests/dp_players.py (compiled-plane Sides, loop pairs and the Fabric of the
`fabric` fixture), tests/wire_players.py (a player in a namespace, a QP facing a scripted peer),
tests/scripted_players.py, tests/daemon_players.py and tests/daemon_native_players.py (client processes of
metaroced), tests/dp_peer.py (a compiled-plane endpoint in a process of its own).  It imports numpy and the
verbs vocabulary only: metaroced's client processes load it without numba.
"""
from __future__ import annotations

import time

import numpy as np

from metaroce_xdp.verbs_types import Access, InvalidState, QPAttr, QPState

FULL = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC


def to_rts(qp, dest_qp_num: int, dgid: str, *, access: Access = FULL, mtu: int = 1024, rq_psn: int = 0x100,
           sq_psn: int = 0x100, timeout: int = 12, retry_cnt: int = 7, rnr_retry: int = 7,
           rd_atomic: int | None = None, min_rnr_timer: int | None = None, **rtr) -> None:
    """INIT (access), RTR towards QP dest_qp_num at dgid, RTS.  rd_atomic: max_dest_rd_atomic and
    max_rd_atomic; None leaves an attribute at the QP's default (QPAttr.given); rtr: more RTR attributes
    (profile, native_params, dmac...)."""
    qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=access))
    qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=dest_qp_num, rq_psn=rq_psn, path_mtu=mtu, dgid=dgid,
                     max_dest_rd_atomic=rd_atomic, min_rnr_timer=min_rnr_timer, **rtr))
    qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=sq_psn, timeout=timeout, retry_cnt=retry_cnt,
                     rnr_retry=rnr_retry, max_rd_atomic=rd_atomic))


class Player:
    """One endpoint on a verbs context `ctx` (the compiled plane in this process, or a metaroced client): a PD,
    a buffer with one MR over all of it, a CQ, and the current QP (send and receive on that CQ).

    topo and ns: the namespace the context lives in, entered while a QP is connected (its neighbour lookup
    happens there); None for this process's own."""

    CONNECT: dict = {}          # connect()'s to_rts defaults: what a harness's tests assume

    def __init__(self, ctx, topo=None, ns=None) -> None:
        self.ctx, self.topo, self.ns = ctx, topo, ns
        self.pd = self.buf = self.mr = self.cq = self.qp = None

    def resources(self, size: int, *, access: Access = FULL, cq_depth: int = 1024, seed: int | None = None,
                  qp: bool = False, cap=None) -> "Player":
        """PD, a buffer of `size` bytes (seed: filled with seeded random bytes first), the MR over it, a CQ of
        cq_depth; qp: a QP too (cap)."""
        self.pd = self.ctx.alloc_pd()
        self.buf = self.alloc(size)
        if seed is not None:
            self.fill(seed)
        self.mr = self.pd.reg_mr(self.buf, access)
        self.cq = self.ctx.create_cq(cq_depth)
        if qp:
            self.new_qp(cap)
        return self

    def alloc(self, size: int) -> np.ndarray:
        """The buffer the MR covers: process memory (a metaroced client: memory the daemon can map)."""
        return np.zeros(size, np.uint8)

    def fill(self, seed: int) -> None:
        self.buf[:] = np.random.default_rng(seed).integers(0, 256, self.buf.size, dtype=np.uint8)

    def sge(self, off: int, n: int):
        return self.mr.sge(off, n)

    def new_qp(self, cap=None):
        """A fresh QP on the CQ; the previous one destroyed first."""
        self.destroy_qp()
        self.qp = self.ctx.create_qp(self.pd, self.cq, self.cq, cap)
        return self.qp

    def destroy_qp(self) -> None:
        """Destroy the current QP, unless the test destroyed it already (a second destroy is InvalidState)."""
        if self.qp is None:
            return
        try:
            self.ctx.destroy_qp(self.qp)
        except InvalidState:
            pass

    def connect(self, peer: "Player", **kw) -> None:
        """The current QP to RTS towards the peer's (to_rts: this harness's CONNECT defaults, then kw), inside
        this player's namespace."""
        args = {**self.CONNECT, **kw}
        if self.topo is None:
            to_rts(self.qp, peer.qp.qp_num, peer.ctx.gid, **args)
            return
        with self.topo.enter(self.ns):
            to_rts(self.qp, peer.qp.qp_num, peer.ctx.gid, **args)

    def flush(self) -> None:
        """Take what earlier QPs left on the CQ and the context's asynchronous events."""
        while self.cq.poll(1 << 14):
            pass
        while self.ctx.async_events.get() is not None:
            pass

    def dereg(self, mrs=()) -> None:
        """Deregister `mrs` and the player's MR, each unless it is deregistered already."""
        for mr in [*mrs, self.mr]:
            if getattr(mr, "valid", True):
                self.ctx.dereg_mr(mr)

    def release(self) -> None:
        """Destroy what this player made on a context still open -- QP, MR, CQ, PD -- whatever the test
        destroyed already; a CQ or PD that what the test left still uses stays."""
        ctx = self.ctx
        if ctx.closed:
            return
        self.destroy_qp()
        self.dereg()
        for release in (lambda: ctx.destroy_cq(self.cq), lambda: ctx.dealloc_pd(self.pd)):
            try:
                release()
            except Exception:                      # noqa: BLE001 -- what a test left may still use them
                pass

    def close(self) -> None:
        self.ctx.close()


def run_until(players, cond, timeout: float = 10.0) -> None:
    """Progress every distinct context of `players` (in their order) until cond() is true; TimeoutError after
    `timeout` seconds, naming each context's stats and each QP's state."""
    ctxs = list({id(p.ctx): p.ctx for p in players}.values())
    deadline = time.monotonic() + timeout
    while not cond():
        for c in ctxs:
            c.progress()
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached; stats: " + "; ".join(str(c.stats()) for c in ctxs)
                               + "; QPs: " + "; ".join(str(p.qp.query()) for p in players if p.qp is not None))


def wait_wcs(players, player, n: int, timeout: float = 10.0):
    """n completions from player.cq (fewer only on timeout: TimeoutError), progressing all meanwhile."""
    got = []
    run_until(players, lambda: (got.extend(player.cq.poll(n - len(got))) or len(got) >= n), timeout)
    return got
