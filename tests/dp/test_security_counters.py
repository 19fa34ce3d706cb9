"""Counters of 10-security.md kept by the responder, on the compiled plane: every request after ePSN is
counted as out of sequence, not only the one that drew the sequence-error NAK (MR-SEC-031), and remote
access errors are counted per source address as well as per QP (MR-SEC-006).  The conformance cases
TC-SEC-031-a and TC-SEC-006-a check the same through the agent on the wire.  A scripted peer
(tests/scripted_players.py) sends the requests to a compiled-plane QP."""
from __future__ import annotations

import pytest

from metaroce_xdp.wire import RETH, Op
from scripted_players import Peer, nak_of

pytestmark = [pytest.mark.netns, pytest.mark.fabric(prefix="mrsec")]

MTU = 1024


def _frames(q, psns, rkey=None):
    return [(Op.RDMA_WRITE_ONLY, p, b"x" * 8,
             {"reth": RETH(va=q.mr.addr, rkey=q.mr.rkey if rkey is None else rkey, dma_len=8)}) for p in psns]


def test_every_request_after_epsn_is_counted(wire):
    """MR-SEC-031, MR-NAK-003: four requests after ePSN 100 in one burst: one sequence-error NAK, all four
    counted as out of sequence (the loop's rx_oos, the QP's rx_drop_out_of_seq), nothing written."""
    q = Peer(wire, rq_psn=100, mtu=MTU)
    try:
        s0 = q.ctx.stats()
        out = q.inject_burst(_frames(q, [105, 106, 107, 108]))
        s1 = q.ctx.stats()
        assert nak_of(out) == [(100, 0x60)]
        assert s1["rx_oos"] - s0["rx_oos"] == 4 and s1["tx_nak"] - s0["tx_nak"] == 1
        assert not q.buf[:8].any() and q.qp.query()["rq_psn"] == 100
        assert q.qp.query()["rx_drop_out_of_seq"] == 4
    finally:
        q.close()


def test_remote_access_errors_counted_per_source_address(wire):
    """MR-SEC-006: a WRITE with a bad R_Key counts once in the QP's rx_rkey_violation and once for the
    requester's source address."""
    q = Peer(wire, rq_psn=100, mtu=MTU)
    try:
        s0 = q.ctx.source_counters(q.qp.dgid)["rx_rkey_violation"]
        out = q.inject_burst(_frames(q, [100], rkey=q.mr.rkey ^ 0x5B))
        assert nak_of(out) == [(100, 0x62)]
        assert q.qp.query()["rx_rkey_violation"] == 1
        src = q.ctx.source_counters(q.qp.dgid)["rx_rkey_violation"]
        assert src == s0 + 1
        q.qp.destroy()                      # a destroyed QP's count stays with its source address
        assert q.ctx.source_counters(q.qp.dgid)["rx_rkey_violation"] == src
    finally:
        q.close()
