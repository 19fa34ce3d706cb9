"""One compiled-plane QP against a scripted peer, for rule tests that need to put chosen frames on the wire
and read what the QP answers: tests/wire_players.py's scripted_dp_wire (the Context on mr0 in namespace 0, a
raw socket on mr1 in namespace 1 where nothing answers but the script) and ScriptedQP, with the rounds driven
by the test and the port's per-round budget settable.  A module opens one wire (fixture) and makes a fresh
Peer per test."""
from __future__ import annotations

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
        if budget is not None:
            self.budget(budget)
        self.drain()

    def close(self) -> None:
        """ScriptedQP.close, and the MRs (extra_mrs too) gone unless the test took them already, what the QP
        left on the CQ and the Context's events taken (the Context serves the next test)."""
        super().close()
        if self.ctx.closed:
            return
        self.dereg(getattr(self, "extra_mrs", ()))
        self.flush()

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
