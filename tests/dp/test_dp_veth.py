"""The compiled data plane (metaroce_xdp.dp) end to end: two namespaces on a veth, the real XDP
program (ACKs consumed in the kernel into the mr_qps slots the compiled loop reads), AF_XDP
sockets, every operation the plane implements, in order, with the WC fields checked."""
from __future__ import annotations


import numpy as np
import pytest

from dp_players import collect, connected
from metaroce_xdp.dp import Unsupported
from metaroce_xdp.dp import layout as L
from metaroce_xdp.verbs_types import (Access, InvalidArgument, QPState, RecvWR, SendWR, WCFlags, WCOpcode,
                                      WCStatus, WROpcode)

pytestmark = [pytest.mark.netns, pytest.mark.fabric("flat")]


@pytest.fixture
def pair(fabric):
    return connected(fabric.a, fabric.b)


def _write(a, b, wr_id, off, n, roff, op=WROpcode.RDMA_WRITE, imm=0):
    return SendWR(wr_id=wr_id, opcode=op, sg_list=[a.sge(off, n)] if n else [], remote_addr=b.mr.addr + roff,
                  rkey=b.mr.rkey, imm_data=imm)


def test_write_8_bytes_and_multi_packet_acked_in_the_kernel(pair):
    a, b = pair
    ev0 = a.ctx.loader.events()["ACK_CONSUMED"]
    a.qp.post_send(_write(a, b, 1, 0, 8, 0))
    a.qp.post_send(_write(a, b, 2, 4096, 100_000, 8192))          # 98 packets at path MTU 1024
    wcs = collect(a, 2, [b])
    assert [(w.wr_id, w.status, w.opcode, w.byte_len) for w in wcs] == [
        (1, WCStatus.SUCCESS, WCOpcode.RDMA_WRITE, 8), (2, WCStatus.SUCCESS, WCOpcode.RDMA_WRITE, 100_000)]
    assert (b.buf[:8] == a.buf[:8]).all()
    assert (b.buf[8192:8192 + 100_000] == a.buf[4096:4096 + 100_000]).all()
    assert (b.buf[8:8192] == np.random.default_rng(2).integers(0, 256, b.buf.size, dtype=np.uint8)[8:8192]).all()
    # the ACKs never reached user space: the XDP program consumed them into the QP's slot
    assert a.ctx.loader.events()["ACK_CONSUMED"] > ev0
    assert a.ctx.stats()["acks_seen"] >= 1 and a.ctx.stats()["rx_drop_op"] == 0
    # nothing outstanding: both QPs leave the active list, so an idle round looks at no QP at all
    for _ in range(3):
        a.ctx.progress(), b.ctx.progress()
    assert a.ctx.plane.A[L.P_N_ACT] == 0 and b.ctx.plane.A[L.P_N_ACT] == 0


def test_send_recv_imm_write_imm_read_in_order(pair):
    a, b = pair
    sizes = [0, 1, 1023, 1024, 1025, 65536]
    for i, n in enumerate(sizes):
        b.qp.post_recv(RecvWR(wr_id=100 + i, sg_list=[b.sge(200_000 + i * 70_000, 70_000)]))
    b.qp.post_recv(RecvWR(wr_id=200, sg_list=[]))                 # for the WRITE WITH IMM
    wrs = []
    for i, n in enumerate(sizes):
        op = WROpcode.SEND_WITH_IMM if i % 2 else WROpcode.SEND
        wrs.append(SendWR(wr_id=i, opcode=op, sg_list=[a.sge(i * 70_000, n)] if n else [], imm_data=0xABC0 + i))
    wrs.append(_write(a, b, 50, 0, 5000, 1_000_000, WROpcode.RDMA_WRITE_WITH_IMM, imm=0x12345678))
    wrs.append(SendWR(wr_id=60, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(2_000_000, 70_000)],
                      remote_addr=b.mr.addr + 1_500_000, rkey=b.mr.rkey))
    wrs.append(SendWR(wr_id=61, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(2_100_000, 1)],
                      remote_addr=b.mr.addr + 7, rkey=b.mr.rkey))
    wrs.append(_write(a, b, 62, 0, 3, 1_100_000))
    a.qp.post_send(wrs)
    sent = collect(a, len(wrs), [b])
    got = collect(b, len(sizes) + 1, [a])
    assert [(w.wr_id, w.status, w.opcode) for w in sent] == [
        (w.wr_id, WCStatus.SUCCESS, {WROpcode.SEND: WCOpcode.SEND, WROpcode.SEND_WITH_IMM: WCOpcode.SEND,
                                     WROpcode.RDMA_READ: WCOpcode.RDMA_READ}.get(w.opcode, WCOpcode.RDMA_WRITE))
        for w in wrs]
    for i, n in enumerate(sizes):
        w = got[i]
        assert (w.wr_id, w.status, w.opcode, w.byte_len) == (100 + i, WCStatus.SUCCESS, WCOpcode.RECV, n)
        assert w.imm_data == (0xABC0 + i if i % 2 else None)
        assert bool(w.wc_flags & WCFlags.WITH_IMM) == bool(i % 2)
        o = 200_000 + i * 70_000
        assert (b.buf[o:o + n] == a.buf[i * 70_000:i * 70_000 + n]).all()
    w = got[-1]
    assert (w.wr_id, w.opcode, w.byte_len, w.imm_data) == (200, WCOpcode.RECV_RDMA_WITH_IMM, 5000, 0x12345678)
    assert (b.buf[1_000_000:1_005_000] == a.buf[:5000]).all()
    assert (a.buf[2_000_000:2_070_000] == b.buf[1_500_000:1_570_000]).all()
    assert a.buf[2_100_000] == b.buf[7]
    assert (b.buf[1_100_000:1_100_003] == a.buf[:3]).all()


def test_rnr_then_receive_posted(pair):
    """A SEND without a posted receive gets an RNR NAK (consumed by the kernel); posted later, it lands."""
    a, b = pair
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND, sg_list=[a.sge(0, 100)]))
    for _ in range(200):
        a.ctx.progress(), b.ctx.progress()
    assert b.ctx.stats()["tx_rnr"] >= 1
    b.qp.post_recv(RecvWR(wr_id=9, sg_list=[b.sge(0, 4096)]))
    assert collect(a, 1, [b])[0].status == WCStatus.SUCCESS
    w = collect(b, 1, [a])[0]
    assert (w.wr_id, w.byte_len) == (9, 100) and (b.buf[:100] == a.buf[:100]).all()


def test_remote_access_error_leaves_memory_untouched(pair):
    a, b = pair
    before = b.buf[:64].copy()
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 64)], remote_addr=b.mr.addr,
                          rkey=b.mr.rkey ^ 0x1))           # a wrong key tag
    a.qp.post_send(_write(a, b, 2, 0, 8, 0))
    wcs = collect(a, 2, [b])
    assert [(w.wr_id, w.status) for w in wcs] == [(1, WCStatus.REM_ACCESS_ERR), (2, WCStatus.WR_FLUSH_ERR)]
    assert (b.buf[:64] == before).all()
    assert a.qp.query_state() == QPState.ERR and b.qp.query_state() == QPState.ERR
    ev = a.ctx.get_async_event(1.0)
    assert ev is not None and "remote access" in ev.reason


def test_bad_work_requests_are_refused_at_post(pair):
    """ATOMICs, SEND WITH INVALIDATE, SGE lists and FENCE are implemented (tests/dp/test_dp_ops.py); what no
    engine takes is refused with a typed error, and nothing is queued."""
    a, b = pair
    with pytest.raises(InvalidArgument, match="opcode"):
        a.qp.post_send(SendWR(wr_id=1, opcode=7, sg_list=[a.sge(0, 8)]))
    with pytest.raises(InvalidArgument, match="SGEs"):
        a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND, sg_list=[a.sge(0, 8)] * 17))
    with pytest.raises(InvalidArgument, match="LOCAL_WRITE"):
        a.pd.reg_mr(np.zeros(64, np.uint8), Access.REMOTE_ATOMIC)
    assert a.qp.query()["sq_outstanding"] == 0
    assert issubclass(Unsupported, InvalidArgument)
