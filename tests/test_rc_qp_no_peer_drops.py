"""MR-QP-020, MR-ENC-032 step 10 (issue 10): a QP without a connected peer -- in RESET, in INIT, or in ERR
entered from INIT -- is not addressable yet, so a packet for it is dropped under rx_drop_qpn (the engine's
drop_unknown_qp), as the XDP program does; a QP that has a peer (RTR onwards, ERR entered from there)
drops it under rx_drop_qp_state.  On the in-process path, checked packet by packet."""
from __future__ import annotations

from metaroce_xdp.verbs_types import QPAttr, QPState
from metaroce_xdp.wire import RETH, Op, encode
from rc_players import FULL, loop_pair

MTU = 1024


def _write(a, b, psn: int) -> list:
    """One valid RDMA WRITE ONLY from a to b's QP; b's engine runs alone; what b sent back."""
    rp, sp = a.ctx.port, b.ctx.port
    sp.inbox.append(encode(Op.RDMA_WRITE_ONLY, src_mac=rp.mac, dst_mac=sp.mac, src_ip=rp.ip, dst_ip=sp.ip,
                           sport=a.qp.sport, dest_qp=b.qp.qp_num, psn=psn, ack_req=1,
                           headers={"reth": RETH(va=b.mr.addr, rkey=b.mr.rkey, dma_len=4)}, payload=b"NOPE"))
    b.ctx.engine.progress()
    out = list(rp.inbox)
    rp.inbox.clear()
    return out


def test_packets_to_a_qp_without_peer_count_as_unknown_qpn():
    a, b = loop_pair(mtu=MTU)
    st = b.ctx.engine.stats

    def drops():
        return st["drop_unknown_qp"], st["drop_qp_state"]

    b.qp.modify(QPAttr(qp_state=QPState.ERR))                 # had a peer: the state check drops it
    assert _write(a, b, 100) == [] and drops() == (0, 1)
    b.qp.modify(QPAttr(qp_state=QPState.RESET))               # RESET discards the peer (MR-QP-015)
    assert b.qp.dgid is None
    assert _write(a, b, 100) == [] and drops() == (1, 1)
    b.qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
    assert _write(a, b, 100) == [] and drops() == (2, 1)
    b.qp.modify(QPAttr(qp_state=QPState.ERR))                 # ERR entered from INIT: still no peer
    assert _write(a, b, 100) == [] and drops() == (3, 1)
    assert not b.buf[:4].any()
    b.qp.modify(QPAttr(qp_state=QPState.RESET))
    b.connect(a, mtu=MTU)                                    # RTR: addressable again, and the WRITE lands
    out = _write(a, b, 100)
    assert len(out) == 1 and drops() == (3, 1) and bytes(b.buf[:4]) == b"NOPE"
