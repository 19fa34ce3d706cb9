"""Completion events: ibv_req_notify_cq semantics and the SE bit (MR-BTH-003, MR-BTH-004), on two
compiled-plane endpoints (dp_loop).

A CQ armed with req_notify() reports its next completion to its completion
channel; armed with solicited_only, only a solicited completion (a receive
completed by a packet with SE = 1) or an unsuccessful one.  Each arming gives
one event.  (tests/dp/test_dp_ops.py::test_completion_channel_and_solicited_events covers a CQ without a
channel of its own and a solicited event on a channel.)
"""
from __future__ import annotations

import socket
import time

import pytest

from dp_players import FULL, wait_wcs
from metaroce_xdp.verbs_types import (InvalidState, QPAttr, QPState, RecvWR, SendFlags, SendWR, WCStatus,
                                      WROpcode)
from metaroce_xdp.wire import Op, encode

pytestmark = pytest.mark.netns

MTU = 1024


def _recv(b, n=4, length=4096):
    b.qp.post_recv([RecvWR(wr_id=i, sg_list=[b.sge(i * length, length)]) for i in range(n)])


def _send(a, wr_id, solicited, opcode=WROpcode.SEND, length=100, **kw):
    flags = SendFlags.SIGNALED | (SendFlags.SOLICITED if solicited else 0)
    a.qp.post_send(SendWR(wr_id=wr_id, opcode=opcode, sg_list=[a.sge(0, length)], send_flags=flags, **kw))


def test_solicited_only_is_woken_by_a_solicited_receive_only(dp_loop):
    """MR-BTH-004, MR-BTH-003: a CQ armed with solicited_only gets no event for a SEND without
    IBV_SEND_SOLICITED (the completion is in the CQ all the same) and one for a SEND with it; the event
    disarms the CQ."""
    a, b = dp_loop(mtu=MTU, b_cq_depth=64)
    _recv(b)
    b.cq.req_notify(solicited_only=True)
    _send(a, 1, solicited=False)
    (wc,) = wait_wcs([a, b], b, 1)
    assert wc.status == WCStatus.SUCCESS and not b.cq.get_event(0)
    _send(a, 2, solicited=True, length=3000)            # three packets, SE on the last one
    wait_wcs([a, b], b, 1)
    assert b.cq.get_event(0) and not b.cq.get_event(0)
    _send(a, 3, solicited=True)                          # not armed again: no event
    wait_wcs([a, b], b, 1)
    assert not b.cq.get_event(0) and b.cq.events == 1


def test_any_completion_wakes_a_cq_armed_without_solicited_only(dp_loop):
    """ibv_req_notify_cq(cq, 0): the next completion of any kind -- here a send completion on A's
    CQ -- gives an event; arming for any completion outranks a later solicited_only arming."""
    a, b = dp_loop(mtu=MTU)
    _recv(b)
    a.cq.req_notify()
    a.cq.req_notify(solicited_only=True)
    _send(a, 1, solicited=False)
    wait_wcs([a, b], a, 1)
    assert a.cq.get_event(0)


def test_write_with_imm_solicited_and_send_with_se_on_a_middle_packet(dp_loop):
    """MR-BTH-004: an RDMA WRITE WITH IMMEDIATE sent with IBV_SEND_SOLICITED completes a receive
    solicited; SE on a packet that does not complete the receive WQE (SEND FIRST) is ignored.  The
    SEND FIRST (SE = 1) / SEND LAST (SE = 0) pair is written onto B's link from the switch, as A's QP."""
    a, b = dp_loop(mtu=MTU)
    _recv(b)
    b.cq.req_notify(solicited_only=True)
    _send(a, 1, solicited=True, opcode=WROpcode.RDMA_WRITE_WITH_IMM, length=2000,
          remote_addr=b.mr.addr + 60000, rkey=b.mr.rkey, imm_data=5)
    (wc,) = wait_wcs([a, b], b, 1)
    assert wc.opcode.name == "RECV_RDMA_WITH_IMM" and b.cq.get_event(0)
    b.cq.req_notify(solicited_only=True)
    qa, qb = a.qp.query(), b.qp.query()
    psn = qb["rq_psn"]
    with b.topo.enter(b.topo[1]):
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
        sock.bind(("swB", 0))
    try:
        for k, (op, se) in enumerate(((Op.SEND_FIRST, 1), (Op.SEND_LAST, 0))):
            sock.send(encode(op, src_mac=qb["dmac"], dst_mac=qa["dmac"], src_ip=a.ctx.gid, dst_ip=b.ctx.gid,
                             sport=0xC001, dest_qp=b.qp.qp_num, psn=psn + k, ack_req=k, se=se,
                             payload=b"f" * (MTU if k == 0 else 8)))
    finally:
        sock.close()
    (wc,) = wait_wcs([a, b], b, 1)
    assert wc.status == WCStatus.SUCCESS and wc.byte_len == MTU + 8
    assert (b.buf[4096:4096 + MTU + 8] == ord("f")).all()
    assert not b.cq.get_event(0)


def test_error_completion_wakes_a_solicited_only_cq(dp_loop):
    """IBTA 11.4.2.2 (as in rxe): an unsuccessful completion -- here receive WQEs flushed when the QP
    moves to ERR -- also wakes a CQ armed with solicited_only."""
    a, b = dp_loop(mtu=MTU)
    _recv(b, n=2)
    b.cq.req_notify(solicited_only=True)
    with b.topo.enter(b.ns):
        b.qp.modify(QPAttr(qp_state=QPState.ERR))
    assert b.cq.get_event(1.0)
    assert [w.status for w in b.cq.poll(4)] == [WCStatus.WR_FLUSH_ERR] * 2


def test_completion_channel_shared_by_two_cqs_with_a_progress_thread(dp_loop):
    """ibv_create_comp_channel / ibv_get_cq_event: one channel serving a send CQ and a receive CQ gives
    back the CQ that fired and its cq_context; get_cq_event waits with a timeout while a progress
    thread runs the plane; a CQ on a channel is read through the channel."""
    a, b = dp_loop(mtu=MTU)
    cb = b.ctx
    ch = cb.create_comp_channel()
    scq, rcq = cb.create_cq(64, cq_context="send", channel=ch), cb.create_cq(64, cq_context="recv", channel=ch)
    qb = cb.create_qp(b.pd, scq, rcq)
    qa = a.qp
    try:
        with b.topo.enter(b.ns):
            qb.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
            qb.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=qa.qp_num, rq_psn=0, path_mtu=MTU,
                             dgid=a.ctx.gid, max_dest_rd_atomic=4))
            qb.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0, max_rd_atomic=4))
        with a.topo.enter(a.ns):                          # A's QP faces qb from a fresh start
            qa.modify(QPAttr(qp_state=QPState.RESET))
            qa.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
            qa.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=qb.qp_num, rq_psn=0, path_mtu=MTU,
                             dgid=b.ctx.gid, max_dest_rd_atomic=4))
            qa.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0, max_rd_atomic=4))
        with pytest.raises(InvalidState):
            rcq.get_event(0)
        assert ch.get_cq_event(0.05) is None
        rcq.req_notify(solicited_only=True)
        scq.req_notify()
        qb.post_recv(RecvWR(wr_id=7, sg_list=[b.sge(0, 64)]))
        cb.plane.start(busy=False)
        try:
            def a_until(cond, timeout=5.0):              # A has no thread: the test drives it
                t0 = time.monotonic()
                while not cond() and time.monotonic() - t0 < timeout:
                    a.ctx.progress()

            qa.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND, sg_list=[a.sge(0, 16)],
                                send_flags=SendFlags.SOLICITED | SendFlags.SIGNALED))
            a_until(lambda: bool(ch.q))
            cq = ch.get_cq_event(5.0)
            assert cq is rcq and cq.cq_context == "recv"
            assert rcq.wait(1)[0].wr_id == 7
            qb.post_send(SendWR(wr_id=2, opcode=WROpcode.RDMA_WRITE, sg_list=[b.sge(0, 8)],
                                remote_addr=a.mr.addr, rkey=a.mr.rkey, send_flags=SendFlags.SIGNALED))
            a_until(lambda: bool(ch.q))
            cq = ch.get_cq_event(5.0)
            assert cq is scq and cq.cq_context == "send" and scq.wait(1)[0].status == WCStatus.SUCCESS
        finally:
            cb.plane.stop()
    finally:
        cb.destroy_qp(qb)
