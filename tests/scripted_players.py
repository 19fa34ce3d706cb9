"""One compiled-plane QP against a scripted peer, for rule tests that need to put chosen frames on the wire
and read what the QP answers: tests/wire_players.py's scripted_dp_wire (the Context on mr0 in namespace 0, a
raw socket on mr1 in namespace 1 where nothing answers but the script) and ScriptedQP, with the rounds driven
by the test and the port's per-round budget settable.  A module opens one wire (fixture) and makes a fresh
Peer per test."""
from __future__ import annotations

import time

from metaroce_xdp.dp import layout as L
from metaroce_xdp.wire import Op
from wire_players import ScriptedQP

PEER_QPN = 0x777            # the scripted peer's QP: exists nowhere


class Peer(ScriptedQP):
    """A fresh QP of the wire's Context (ePSN rq_psn, first PSN sq_psn) facing the script."""

    def __init__(self, wire, rq_psn: int = 100, sq_psn: int = 100, rd_atomic: int = 4, mtu: int = 1024,
                 budget: int | None = None, **kw) -> None:
        topo, pair, self.sock, ctx = wire
        super().__init__(ctx, topo, pair, PEER_QPN, rq_psn=rq_psn, sq_psn=sq_psn, rd_atomic=rd_atomic, mtu=mtu,
                         **kw)
        self._budget0 = int(ctx.plane.A[L.P_BUDGET])
        if budget is not None:
            self.budget(budget)
        self.drain()

    def sge(self, off: int, n: int):
        from metaroce_xdp.verbs_types import SGE
        return SGE(self.mr.addr + off, n, self.mr.lkey)

    def budget(self, n: int) -> None:
        """At most n frames sent per round (the port's round budget)."""
        self.ctx.plane.A[L.P_BUDGET] = n

    def close(self) -> None:
        self.ctx.plane.A[L.P_BUDGET] = self._budget0
        ctx = self.ctx
        if ctx.closed:
            return
        if ctx.qps.get(self.qp.qi) is self.qp:       # (the test may have destroyed it)
            ctx.destroy_qp(self.qp)
        for mr in list(getattr(self, "extra_mrs", ())) + [self.mr]:
            if mr.valid:
                mr.dereg()
        self.cq.poll(1 << 10)
        while ctx.async_events.get() is not None:
            pass

    def rounds(self, n: int | None = None, quiet_after: int = 25) -> list:
        """n rounds (or rounds until nothing more comes, bounded); what the QP sent meanwhile, decoded."""
        out = []
        quiet = 0
        for _ in range(n if n is not None else 400):
            self.round()
            time.sleep(0.002)
            got = self.drain()
            out += got
            quiet = 0 if got else quiet + 1
            if n is None and quiet >= quiet_after:
                break
        return out

    def inject(self, opcode, psn, payload=b"", **headers) -> list:
        """One frame from the script to the QP; the QP's rounds until it is quiet; what it sent back."""
        self.send([(opcode, psn, payload, headers)])
        return self.rounds()

    def inject_burst(self, frames, budget: int | None = None) -> list:
        """Several frames (opcode, psn, payload, headers) at once, then rounds until quiet."""
        if budget is not None:
            self.budget(budget)
        self.send(frames)
        return self.rounds()


def nak_of(pkts) -> list[tuple[int, int]]:
    """(PSN, syndrome) of the ACKNOWLEDGE packets among pkts."""
    return [(p.bth.psn, p.ext["aeth"].syndrome) for p in pkts if p.bth.opcode == Op.ACKNOWLEDGE]


def read_responses(pkts) -> list:
    return [p for p in pkts if Op.RDMA_READ_RESPONSE_FIRST <= p.bth.opcode <= Op.RDMA_READ_RESPONSE_ONLY]


def order_of(pkts) -> list[tuple[str, int]]:
    names = {Op.ACKNOWLEDGE: "ACK", Op.ATOMIC_ACKNOWLEDGE: "ATOMIC_ACK"}
    return [(names.get(p.bth.opcode, "RR"), p.bth.psn) for p in pkts]
