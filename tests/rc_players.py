"""Player pairs for transport tests, after rdma-core's tests/base.py.

A player is one side: context, PD, one big MR, CQ, QP.  `loop_pair()` joins
two players through in-process LoopPorts (seeded faults optional) for the
transport logic; the veth tests build players in namespaces instead.
"""
from __future__ import annotations

import contextlib
import socket
import time

import numpy as np

from metaroce_xdp.rc.engine import Context
from metaroce_xdp.rc.port import Faults, LoopPort
from wire_players import (FULL, MTU, PACKET_OUTGOING, Plan, PortTap, ScriptedQP, VethPlayer,  # noqa: F401
                          engine_context, is_roce_v4, is_roce_v6, scripted_dp_wire, scripted_wire)
from metaroce_xdp.verbs_types import (SGE, Access, QPAttr, QPState, RecvWR, SendFlags, SendWR, WCStatus,
                                      WROpcode)



class Player:
    def __init__(self, ctx: Context, size: int = 1 << 20, access: Access = FULL, qp_access: Access = FULL,
                 cq_depth: int = 1 << 16):
        self.ctx = ctx
        self.pd = ctx.alloc_pd()
        self.buf = np.zeros(size, np.uint8)
        self.mr = self.pd.reg_mr(self.buf, access)
        self.cq = ctx.create_cq(cq_depth)
        self.qp = ctx.create_qp(self.pd, self.cq, self.cq)
        self.qp_access = qp_access

    def connect(self, peer: "Player", mtu: int = 1024, psn: int = 100, peer_psn: int = 100, timeout: int = 8,
                retry_cnt: int = 7, rnr_retry: int = 7, min_rnr_timer: int = 1, rd_atomic: int = 4) -> None:
        qp = self.qp
        qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=self.qp_access))
        qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=peer.qp.qp_num, rq_psn=peer_psn, path_mtu=mtu,
                         dgid=peer.ctx.gid, dmac=peer.ctx.engine.local_mac, max_dest_rd_atomic=rd_atomic,
                         min_rnr_timer=min_rnr_timer))
        qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=psn, timeout=timeout, retry_cnt=retry_cnt,
                         rnr_retry=rnr_retry, max_rd_atomic=rd_atomic))

    def sge(self, off: int, length: int) -> SGE:
        return SGE(self.mr.addr + off, length, self.mr.lkey)


def set_burst(ctx: Context, burst: bool) -> None:
    """Choose the engine's path: the compiled bursts (burst.py) or the per-packet Python path.  Takes
    effect at once, also for QPs that exist already (the requester reads the flag at every send)."""
    with ctx.engine.lock:
        ctx.engine.burst_tx = ctx.engine.burst_rx = burst


def loop_pair(faults_ab: Faults | None = None, faults_ba: Faults | None = None, size: int = 1 << 20,
              b_access: Access = FULL, b_qp_access: Access = FULL, burst: bool | None = None,
              a_cq_depth: int = 1 << 16, **conn):
    """Two connected players; burst=False uses the per-packet Python path only, burst=True the compiled
    bursts, None the engine's own choice (bursts unless METAROCE_NO_BURST=1)."""
    pa, pb = LoopPort.pair(faults_ab, faults_ba)
    ca, cb = Context(pa), Context(pb)
    if burst is not None:
        for c in (ca, cb):
            set_burst(c, burst)                 # before any QP exists, and QPs follow later changes too
    a, b = Player(ca, size, cq_depth=a_cq_depth), Player(cb, size, b_access, b_qp_access)
    a.connect(b, psn=conn.get("psn", 100), peer_psn=conn.get("peer_psn", 100),
              **{k: v for k, v in conn.items() if k not in ("psn", "peer_psn")})
    b.connect(a, psn=conn.get("peer_psn", 100), peer_psn=conn.get("psn", 100),
              **{k: v for k, v in conn.items() if k not in ("psn", "peer_psn")})
    return a, b


def run_until(players, cond, timeout: float = 10.0) -> None:
    """Drive both engines until cond() is true (bounded)."""
    deadline = time.monotonic() + timeout
    while not cond():
        for p in players:
            p.ctx.engine.progress()
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached; QPs: " + "; ".join(str(p.qp.query()) for p in players))


def wait_wcs(players, player, n: int, timeout: float = 10.0):
    got = []

    def cond():
        got.extend(player.cq.q.popleft() for _ in range(len(player.cq.q)))
        return len(got) >= n

    run_until(players, cond, timeout)
    return got


__all__ = ["Player", "Plan", "ScriptedQP", "VethPlayer", "MTU", "loop_pair", "set_burst", "run_until", "wait_wcs",
           "FULL", "SendWR",
           "RecvWR", "WROpcode", "WCStatus", "SendFlags", "Faults"]
