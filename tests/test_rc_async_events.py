"""Asynchronous events and the states that raise them (spec 07-qp-state.md: MR-QP-013, MR-QP-014,
MR-QP-021, MR-QP-030, MR-QP-036), over in-process player pairs.
"""
from __future__ import annotations

import pytest

from metaroce_xdp.rc.engine import Context
from metaroce_xdp.verbs_types import (IBV_EVENT_COMM_EST, IBV_EVENT_CQ_ERR, IBV_EVENT_QP_ACCESS_ERR,
                                    IBV_EVENT_QP_FATAL, IBV_EVENT_SQ_DRAINED, AsyncEvent, AsyncEventQueue,
                                    EventType)
from metaroce_xdp.rc.port import LoopPort
from metaroce_xdp.verbs_types import Busy, QPAttr, QPState
from rc_players import (Faults, Player, RecvWR, SendWR, WCStatus, WROpcode, loop_pair, run_until, wait_wcs)


def events(ctx) -> list:
    out = []
    while (ev := ctx.get_async_event(0)) is not None:
        out.append(ev)
    return out


def _write(a, b, wr_id, off, n):
    return SendWR(wr_id=wr_id, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(off, n)],
                  remote_addr=b.mr.addr + off, rkey=b.mr.rkey)


def test_event_numbers_are_libibverbs():
    """MR-QP-036, MR-QP-013: event numbers of enum ibv_event_type."""
    assert (IBV_EVENT_CQ_ERR, IBV_EVENT_QP_FATAL, IBV_EVENT_QP_ACCESS_ERR, IBV_EVENT_COMM_EST,
            IBV_EVENT_SQ_DRAINED, EventType.QP_LAST_WQE_REACHED) == (0, 1, 3, 4, 5, 16)


def test_cq_overflow_moves_its_qps_to_err_with_an_event():
    """MR-QP-036: a CQ that overflows raises IBV_EVENT_CQ_ERR and moves every QP using it to ERR (with
    IBV_EVENT_QP_FATAL for each); the completions that did not fit are lost and counted; the CQ never
    holds more than its depth."""
    a, b = loop_pair(a_cq_depth=2)
    a.qp.post_send([_write(a, b, i, i * 64, 64) for i in range(6)])
    run_until([a, b], lambda: a.qp.state == QPState.ERR)
    assert len(a.cq.q) == 2 and a.cq.overruns >= 1
    evs = events(a.ctx)
    assert [e.event_type for e in evs] == [EventType.CQ_ERR, EventType.QP_FATAL]
    assert evs[0].cq is a.cq and evs[1].qp is a.qp and "overflow" in evs[1].reason
    assert [w.wr_id for w in a.cq.poll(4)] == [0, 1]
    # later completions (flushes of posts in ERR) fit again once the application polled; bounded meanwhile
    a.qp.post_send([_write(a, b, 10 + i, 0, 8) for i in range(5)])
    assert len(a.cq.q) == 2 and a.cq.overruns >= 4
    assert [e.event_type for e in events(a.ctx)] == [EventType.CQ_ERR]   # a second overflow, no QP to move
    assert b.qp.state == QPState.RTS                                      # the peer is not concerned


def test_async_event_queue_is_bounded():
    """MR-QP-036 (nothing grows without bound): a full event queue drops and counts new events."""
    q = AsyncEventQueue(depth=3)
    for _ in range(5):
        q.put(AsyncEvent(EventType.QP_FATAL))
    assert len(q) == 3 and q.overruns == 2 and q.raised == 5


def test_get_async_event_waits_with_a_timeout():
    """MR-QP-021: get_async_event(timeout) returns None when nothing happened in time."""
    a, b = loop_pair()
    assert a.ctx.get_async_event(0) is None
    assert a.ctx.get_async_event(0.01) is None


def _rtr_only(p: Player, peer: Player):
    p.qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=p.qp_access))
    p.qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=peer.qp.qp_num, rq_psn=100, path_mtu=1024,
                       dgid=peer.ctx.gid, dmac=peer.ctx.engine.local_mac, max_dest_rd_atomic=4))


def test_comm_est_once_for_the_first_request_accepted_in_rtr():
    """MR-QP-021: the first request packet accepted in RTR raises IBV_EVENT_COMM_EST, once; a packet
    refused with an RNR NAK is not accepted and raises nothing."""
    pa, pb = LoopPort.pair()
    a, b = Player(Context(pa)), Player(Context(pb))
    a.connect(b)
    _rtr_only(b, a)
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND, sg_list=[a.sge(0, 8)]))
    run_until([a, b], lambda: b.qp.responder.rnr_naks_sent >= 1)
    assert events(b.ctx) == []
    b.qp.post_recv(RecvWR(wr_id=2, sg_list=[b.sge(0, 8)]))
    a.qp.post_send(_write(a, b, 3, 64, 64))
    wcs = wait_wcs([a, b], a, 2)
    assert [w.status for w in wcs] == [WCStatus.SUCCESS] * 2
    evs = events(b.ctx)
    assert [(e.event_type, e.qp) for e in evs] == [(EventType.COMM_EST, b.qp)]
    assert events(a.ctx) == []                     # a was in RTS before any request came


def test_responder_errors_raise_their_event():
    """MR-QP-030: a responder that moves its QP to ERR after NAK code 2 raises IBV_EVENT_QP_ACCESS_ERR,
    after NAK code 1 IBV_EVENT_QP_REQ_ERR; the requester, told by its completion, gets no event."""
    a, b = loop_pair()
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 8)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey ^ 1))
    (wc,) = wait_wcs([a, b], a, 1)
    assert wc.status == WCStatus.REM_ACCESS_ERR
    assert [(e.event_type, e.qp) for e in events(b.ctx)] == [(EventType.QP_ACCESS_ERR, b.qp)]
    assert events(a.ctx) == []
    a, b = loop_pair()
    b.qp.post_recv(RecvWR(wr_id=9, sg_list=[b.sge(0, 10)]))
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND, sg_list=[a.sge(0, 3000)]))
    wait_wcs([a, b], a, 1)
    assert [e.event_type for e in events(b.ctx)] == [EventType.QP_REQ_ERR]


# ---- SQD (MR-QP-013, MR-QP-014) -----------------------------------------------------------------

def _sqd_setup(faults_after: Faults | None = None):
    a, b = loop_pair()
    a.buf[:] = 0x5C
    n1, n2 = 200 * 1024, 4096
    a.ctx.engine.budget = 8
    a.qp.post_send([_write(a, b, 1, 0, n1), _write(a, b, 2, n1, n2)])
    a.ctx.engine.progress()                        # WQE 1 partly sent, WQE 2 not started
    w1, w2 = a.qp.requester.sq
    assert w1.first_psn is not None and 0 < w1.sent < w1.npsn and w2.first_psn is None
    if faults_after is not None:
        a.ctx.port.faults = faults_after
    a.qp.modify(QPAttr(qp_state=QPState.SQD, en_sqd_async_notify=True))
    return a, b, n1, n2


def test_sqd_finishes_the_wqe_in_progress_then_reports_drained():
    """MR-QP-013, MR-QP-014, MR-QP-018: in SQD the WQE being sent is finished and completes, the next one
    (posted earlier, or posted in SQD) does not start; IBV_EVENT_SQ_DRAINED when nothing is outstanding;
    SQD -> SQD fails with EBUSY while draining and works once drained; SQD -> RTS resumes."""
    a, b, n1, n2 = _sqd_setup()
    with pytest.raises(Busy, match="EBUSY"):          # the agent answers EBUSY (MR-QP-014)
        a.qp.modify(QPAttr(qp_state=QPState.SQD))
    assert a.qp.state == QPState.SQD
    a.qp.post_send(_write(a, b, 3, n1 + n2, 64))    # accepted in SQD, queued without starting
    ev = None

    def drained():
        nonlocal ev
        ev = ev or a.ctx.get_async_event(0)
        return ev is not None

    run_until([a, b], drained)
    assert ev.event_type == EventType.SQ_DRAINED and ev.qp is a.qp
    assert [(w.wr_id, w.status) for w in a.cq.poll(8)] == [(1, WCStatus.SUCCESS)]
    assert (b.buf[:n1] == 0x5C).all() and not b.buf[n1:].any()
    assert all(w.first_psn is None for w in a.qp.requester.sq)
    for _ in range(20):                            # nothing more leaves while in SQD
        a.ctx.engine.progress(), b.ctx.engine.progress()
    assert not b.buf[n1:].any() and len(a.qp.requester.sq) == 2
    a.qp.modify(QPAttr(qp_state=QPState.SQD))      # drained: SQD -> SQD is allowed
    a.qp.modify(QPAttr(qp_state=QPState.RTS))
    wcs = wait_wcs([a, b], a, 2)
    assert [(w.wr_id, w.status) for w in wcs] == [(2, WCStatus.SUCCESS), (3, WCStatus.SUCCESS)]
    assert (b.buf[:n1 + n2 + 64] == 0x5C).all()


def test_sqd_retransmits_until_drained():
    """MR-QP-013: retransmissions of outstanding packets continue in SQD (here with 10 % loss)."""
    a, b, n1, _ = _sqd_setup(Faults(seed=4, drop=0.1))
    run_until([a, b], lambda: not a.qp.sq_draining, timeout=30)
    assert a.qp.requester.retransmits > 0
    assert [(w.wr_id, w.status) for w in a.cq.poll(8)] == [(1, WCStatus.SUCCESS)]
    assert [e.event_type for e in events(a.ctx)] == [EventType.SQ_DRAINED]
    assert (b.buf[:n1] == 0x5C).all()


def test_sqd_without_notify_raises_no_event():
    """MR-QP-013: IBV_EVENT_SQ_DRAINED only when en_sqd_async_notify was set; an idle QP is drained at once."""
    a, b = loop_pair()
    a.qp.modify(QPAttr(qp_state=QPState.SQD))
    assert not a.qp.sq_draining and events(a.ctx) == []
    a.qp.modify(QPAttr(qp_state=QPState.SQD))
    a.qp.modify(QPAttr(qp_state=QPState.RTS))
    a.qp.modify(QPAttr(qp_state=QPState.SQD, en_sqd_async_notify=True))
    assert [e.event_type for e in events(a.ctx)] == [EventType.SQ_DRAINED]
