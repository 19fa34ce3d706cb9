"""Counters of 10-security.md kept by the responder: every request after ePSN is counted in
rx_drop_out_of_seq, not only the one that drew the sequence-error NAK (MR-SEC-031; on the per-packet
path and through the compiled skip run), and remote access errors are counted per source address as
well as per QP (MR-SEC-006).  The conformance cases TC-SEC-031-a and TC-SEC-006-a check the same
through the agent on the wire."""
from __future__ import annotations

import pytest

from metaroce_xdp.wire import RETH, Op, encode
from rc_players import loop_pair

MTU = 1024


def _frames(req, resp, psns, rkey=None):
    rp, sp = req.ctx.port, resp.ctx.port
    return [encode(Op.RDMA_WRITE_ONLY, src_mac=rp.mac, dst_mac=sp.mac, src_ip=rp.ip, dst_ip=sp.ip,
                   sport=req.qp.sport, dest_qp=resp.qp.qp_num, psn=p, ack_req=1,
                   headers={"reth": RETH(va=resp.mr.addr, rkey=resp.mr.rkey if rkey is None else rkey, dma_len=8)},
                   payload=b"x" * 8) for p in psns]


@pytest.mark.parametrize("burst", [False, True])
def test_every_request_after_epsn_is_counted(burst):
    a, b = loop_pair(mtu=MTU, burst=burst)
    b.ctx.port.inbox.extend(_frames(a, b, [105, 106, 107, 108]))     # ePSN is 100
    b.ctx.engine.progress()
    q = b.qp.query()
    assert q["rx_drop_out_of_seq"] == 4 and q["seq_naks_sent"] == 1


def test_remote_access_errors_counted_per_source_address():
    a, b = loop_pair(mtu=MTU)
    eng = b.ctx.engine
    before = eng.rae_by_src[b.qp.dgid]
    b.ctx.port.inbox.extend(_frames(a, b, [100], rkey=b.mr.rkey ^ 0x5B))
    eng.progress()
    assert b.qp.query()["rx_rkey_violation"] == 1
    assert eng.rae_by_src[b.qp.dgid] == before + 1 and b.qp.dgid == a.ctx.port.ip
