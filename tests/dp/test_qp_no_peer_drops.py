"""MR-QP-020, MR-ENC-032 step 10 (issue 10): a QP without a connected peer -- in RESET, in INIT, or in ERR
entered from INIT -- is not addressable yet, so a packet for it is dropped under rx_drop_qpn, as an unknown
QPN; a QP that has a peer (RTR onwards, ERR entered from there) drops it under rx_drop_qp_state.  On the
compiled plane a drop is the XDP program's (kern DropReason UNKNOWN_QP, QP_STATE) or the loop's (stats
rx_drop_qp, rx_drop_state): rx_drop_qpn and rx_drop_qp_state are the sums (agent.SPEC_DROPS).  A scripted
peer (tests/scripted_players.py) sends the packets, one at a time, and sees what comes back."""
from __future__ import annotations

import pytest

from metaroce_xdp.verbs_types import QPAttr, QPState
from metaroce_xdp.wire import RETH, Op
from scripted_players import PEER_QPN, Peer
from wire_players import FULL

pytestmark = [pytest.mark.netns, pytest.mark.fabric(prefix="mrnop")]

MTU = 1024


def drops(ctx) -> tuple[int, int]:
    """(rx_drop_qpn, rx_drop_qp_state) of the Context: the XDP program's and the loop's."""
    k, s = ctx.loader.drops(), ctx.stats()
    return k["UNKNOWN_QP"] + s["rx_drop_qp"], k["QP_STATE"] + s["rx_drop_state"]


def test_packets_to_a_qp_without_peer_count_as_unknown_qpn(wire):
    q = Peer(wire, rq_psn=100, mtu=MTU)
    try:
        def write(psn: int) -> list:
            return q.inject(Op.RDMA_WRITE_ONLY, psn, b"NOPE", reth=RETH(va=q.mr.addr, rkey=q.mr.rkey, dma_len=4))

        def moved():
            now = drops(q.ctx)
            return now[0] - d0[0], now[1] - d0[1]

        d0 = drops(q.ctx)
        q.qp.modify(QPAttr(qp_state=QPState.ERR))                 # had a peer: the state check drops it
        assert write(100) == [] and moved() == (0, 1)
        q.qp.modify(QPAttr(qp_state=QPState.RESET))               # RESET discards the peer (MR-QP-015)
        assert write(100) == [] and moved() == (1, 1)           # no peer: an unknown QPN now
        q.qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
        assert write(100) == [] and moved() == (2, 1)
        q.qp.modify(QPAttr(qp_state=QPState.ERR))                 # ERR entered from INIT: still no peer
        assert write(100) == [] and moved() == (3, 1)
        assert not q.buf[:4].any()
        q.qp.modify(QPAttr(qp_state=QPState.RESET))
        with q.topo.enter(q.topo[0]):                             # RTR: addressable again, and the WRITE lands
            q.qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
            q.qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=PEER_QPN, rq_psn=100, path_mtu=MTU,
                               dgid=q.pair.b.ipv4, max_dest_rd_atomic=4))
        out = write(100)
        assert len(out) == 1 and moved() == (3, 1) and bytes(q.buf[:4]) == b"NOPE"
    finally:
        q.close()
