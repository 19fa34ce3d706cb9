"""Asynchronous events and the states that raise them (spec 07-qp-state.md: MR-QP-013, MR-QP-014,
MR-QP-021, MR-QP-030, MR-QP-036), between two compiled-plane endpoints (dp_loop).
"""
from __future__ import annotations


import pytest

from dp_players import Faults, LoopPlayer, run_until, wait_wcs
from metaroce_xdp.dp import layout as L
from metaroce_xdp.verbs_types import (IBV_EVENT_COMM_EST, IBV_EVENT_CQ_ERR, IBV_EVENT_QP_ACCESS_ERR,
                                      IBV_EVENT_QP_FATAL, IBV_EVENT_SQ_DRAINED, AsyncEvent, AsyncEventQueue, Busy,
                                      EventType, QPAttr, QPState, RecvWR, SendWR, WCStatus, WROpcode)

pytestmark = pytest.mark.netns


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


def _held(cq) -> int:
    """Completions the CQ holds now (without a progress round)."""
    return int(cq.row[L.C_TAIL]) - int(cq.row[L.C_HEAD])


def test_cq_overflow_moves_its_qps_to_err_with_an_event(dp_loop):
    """MR-QP-036: a CQ that overflows raises IBV_EVENT_CQ_ERR and moves every QP using it to ERR (with
    IBV_EVENT_QP_FATAL for each); the completion that did not fit is lost (the WRITE it reported is
    flushed instead); the CQ never holds more than its depth: the flushes of the QP's other work come as
    the application polls, each overflow raising CQ_ERR again and no QP to move."""
    a, b = dp_loop(a_cq_depth=2)
    a.qp.post_send([_write(a, b, i, i * 64, 64) for i in range(6)])
    run_until([a, b], lambda: a.qp.query_state() == QPState.ERR)
    for _ in range(20):
        a.ctx.progress(), b.ctx.progress()
    assert _held(a.cq) == 2
    evs = events(a.ctx)
    assert [e.event_type for e in evs] == [EventType.CQ_ERR, EventType.QP_FATAL]
    assert evs[0].cq is a.cq and evs[1].qp is a.qp and "overflow" in evs[1].reason
    assert [(w.wr_id, w.status) for w in a.cq.poll(4)] == [(0, WCStatus.SUCCESS), (1, WCStatus.SUCCESS)]
    for _ in range(20):
        a.ctx.progress(), b.ctx.progress()
    assert _held(a.cq) == 2
    assert [e.event_type for e in events(a.ctx)] == [EventType.CQ_ERR]   # a second overflow, no QP to move
    got = a.cq.poll(4)
    for _ in range(20):
        a.ctx.progress(), b.ctx.progress()
    assert _held(a.cq) <= 2
    got += a.cq.poll(4)
    assert [(w.wr_id, w.status) for w in got] == [(i, WCStatus.WR_FLUSH_ERR) for i in range(2, 6)]
    assert b.qp.query_state() == QPState.RTS                              # the peer is not concerned


def test_async_event_queue_is_bounded():
    """MR-QP-036 (nothing grows without bound): a full event queue drops and counts new events."""
    q = AsyncEventQueue(depth=3)
    for _ in range(5):
        q.put(AsyncEvent(EventType.QP_FATAL))
    assert len(q) == 3 and q.overruns == 2 and q.raised == 5


def test_get_async_event_waits_with_a_timeout(dp_loop):
    """MR-QP-021: get_async_event(timeout) returns None when nothing happened in time."""
    a, b = dp_loop()
    assert a.ctx.get_async_event(0) is None
    assert a.ctx.get_async_event(0.01) is None


def _rtr_only(p: LoopPlayer, peer: LoopPlayer):
    """p's QP back through RESET to RTR (dp_loop connected it to RTS): a responder that has not reached RTS."""
    with p.topo.enter(p.ns):
        p.qp.modify(QPAttr(qp_state=QPState.RESET))
        p.qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=p.qp_access))
        p.qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=peer.qp.qp_num, rq_psn=100, path_mtu=1024,
                           dgid=peer.ctx.gid, max_dest_rd_atomic=4))


def test_comm_est_once_for_the_first_request_accepted_in_rtr(dp_loop):
    """MR-QP-021: the first request packet accepted in RTR raises IBV_EVENT_COMM_EST, once; a packet
    refused with an RNR NAK is not accepted and raises nothing."""
    a, b = dp_loop()
    _rtr_only(b, a)
    events(a.ctx), events(b.ctx)
    rnr0 = b.ctx.stats()["tx_rnr"]
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND, sg_list=[a.sge(0, 8)]))
    run_until([a, b], lambda: b.ctx.stats()["tx_rnr"] > rnr0)
    assert events(b.ctx) == []
    b.qp.post_recv(RecvWR(wr_id=2, sg_list=[b.sge(0, 8)]))
    a.qp.post_send(_write(a, b, 3, 64, 64))
    wcs = wait_wcs([a, b], a, 2)
    assert [w.status for w in wcs] == [WCStatus.SUCCESS] * 2
    evs = events(b.ctx)
    assert [(e.event_type, e.qp) for e in evs] == [(EventType.COMM_EST, b.qp)]
    assert events(a.ctx) == []                     # a was in RTS before any request came
    assert b.qp.query_state() == QPState.RTR


def test_responder_errors_raise_their_event(dp_loop):
    """MR-QP-030: a responder that moves its QP to ERR after NAK code 2 raises IBV_EVENT_QP_ACCESS_ERR,
    after NAK code 1 IBV_EVENT_QP_REQ_ERR; the requester, told by its completion, gets no event."""
    a, b = dp_loop()
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 8)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey ^ 1))
    (wc,) = wait_wcs([a, b], a, 1)
    assert wc.status == WCStatus.REM_ACCESS_ERR
    assert [(e.event_type, e.qp) for e in events(b.ctx)] == [(EventType.QP_ACCESS_ERR, b.qp)]
    a, b = dp_loop()
    b.qp.post_recv(RecvWR(wr_id=9, sg_list=[b.sge(0, 10)]))
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND, sg_list=[a.sge(0, 3000)]))
    (wc,) = wait_wcs([a, b], a, 1)
    assert wc.status == WCStatus.REM_INV_REQ_ERR
    assert [(e.event_type, e.qp) for e in events(b.ctx)] == [(EventType.QP_REQ_ERR, b.qp)]


def test_requester_told_by_its_completion(dp_loop):
    """MR-QP-030: the requester learns of the responder's error from its completion (REM_ACCESS_ERR); an event
    is not required ("need no asynchronous event").  The compiled plane also raises IBV_EVENT_QP_FATAL for the
    QP it moved to ERR -- allowed, and applications that watch events only (test_dp_loss) rely on it -- and
    nothing about any other QP or the CQ."""
    a, b = dp_loop()
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 8)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey ^ 1))
    (wc,) = wait_wcs([a, b], a, 1)
    assert wc.status == WCStatus.REM_ACCESS_ERR
    assert all((e.event_type, e.qp) == (EventType.QP_FATAL, a.qp) for e in events(a.ctx))


# ---- SQD (MR-QP-013, MR-QP-014) -----------------------------------------------------------------

def _sqd_setup(dp_loop, faults: Faults | None = None):
    """A 1 MiB WRITE (1024 packets: more than one round sends) partly sent, a 4 KiB WRITE behind it not
    started; then RTS -> SQD with notification."""
    a, b = dp_loop(faults, size=2 << 20)
    a.buf[:] = 0x5C
    n1, n2 = 1 << 20, 4096
    a.qp.post_send([_write(a, b, 1, 0, n1), _write(a, b, 2, n1, n2)])
    a.ctx.progress()                               # WQE 1 partly sent, WQE 2 not started
    sw = a.ctx.plane.SW[a.qp.sq_base:a.qp.sq_base + 2]
    assert int(a.qp.row[L.Q_SQ_NEXT]) == 0 and sw[0, L.W_STARTED] and 0 < sw[0, L.W_SENT] < sw[0, L.W_NPSN]
    assert not sw[1, L.W_STARTED]
    with a.topo.enter(a.ns):
        a.qp.modify(QPAttr(qp_state=QPState.SQD, en_sqd_async_notify=True))
    return a, b, n1, n2


def test_sqd_finishes_the_wqe_in_progress_then_reports_drained(dp_loop):
    """MR-QP-013, MR-QP-014, MR-QP-018: in SQD the WQE being sent is finished and completes, the next one
    (posted earlier, or posted in SQD) does not start; IBV_EVENT_SQ_DRAINED when nothing is outstanding;
    SQD -> SQD fails with EBUSY while draining and works once drained; SQD -> RTS resumes."""
    a, b, n1, n2 = _sqd_setup(dp_loop)
    with pytest.raises(Busy, match="EBUSY"):          # the agent answers EBUSY (MR-QP-014)
        a.qp.modify(QPAttr(qp_state=QPState.SQD))
    assert a.qp.query_state() == QPState.SQD
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
    for _ in range(20):                            # nothing more leaves while in SQD
        a.ctx.progress(), b.ctx.progress()
    assert not b.buf[n1:].any() and a.qp.query()["sq_outstanding"] == 2
    sw = a.ctx.plane.SW[a.qp.sq_base:a.qp.sq_base + a.qp.sq_size]
    assert not sw[:, L.W_STARTED][[(int(a.qp.row[L.Q_SQ_HEAD]) + k) & (a.qp.sq_size - 1) for k in range(2)]].any()
    with a.topo.enter(a.ns):
        a.qp.modify(QPAttr(qp_state=QPState.SQD))      # drained: SQD -> SQD is allowed
        a.qp.modify(QPAttr(qp_state=QPState.RTS))
    wcs = wait_wcs([a, b], a, 2)
    assert [(w.wr_id, w.status) for w in wcs] == [(2, WCStatus.SUCCESS), (3, WCStatus.SUCCESS)]
    assert (b.buf[:n1 + n2 + 64] == 0x5C).all()


def test_sqd_retransmits_until_drained(dp_loop):
    """MR-QP-013: retransmissions of outstanding packets continue in SQD (here with 10 % loss)."""
    retx0 = None

    def loop(*args, **kw):
        nonlocal retx0
        a, b = dp_loop(*args, **kw)
        retx0 = a.ctx.stats()["retransmits"]
        return a, b

    a, b, n1, _ = _sqd_setup(loop, Faults(seed=4, drop=0.1))
    evs = []
    run_until([a, b], lambda: evs.extend(events(a.ctx)) or evs, timeout=30)
    assert a.ctx.stats()["retransmits"] > retx0
    assert [(w.wr_id, w.status) for w in a.cq.poll(8)] == [(1, WCStatus.SUCCESS)]
    assert [e.event_type for e in evs] == [EventType.SQ_DRAINED]
    assert (b.buf[:n1] == 0x5C).all()


def test_sqd_without_notify_raises_no_event(dp_loop):
    """MR-QP-013: IBV_EVENT_SQ_DRAINED only when en_sqd_async_notify was set; an idle QP is drained at once."""
    a, b = dp_loop()
    with a.topo.enter(a.ns):
        a.qp.modify(QPAttr(qp_state=QPState.SQD))
        assert events(a.ctx) == []
        a.qp.modify(QPAttr(qp_state=QPState.SQD))      # drained at once: SQD -> SQD is allowed
        a.qp.modify(QPAttr(qp_state=QPState.RTS))
        a.qp.modify(QPAttr(qp_state=QPState.SQD, en_sqd_async_notify=True))
    assert [e.event_type for e in events(a.ctx)] == [EventType.SQ_DRAINED]
