"""Errors the transport must report exactly (MR-MEM, MR-NAK, MR-RNR, MR-RETRY, MR-QP), on the compiled plane.

Access violations produce a remote access error NAK and an error completion and leave the target memory
untouched; RNR is retried and gives the documented error when its budget runs out; a dead peer exhausts
retry_cnt; the API refuses bad arguments with typed errors.  Loop pairs of tests/dp_players.py (two
compiled-plane Contexts through a switch namespace, the test driving the rounds); counters are the
Contexts' stats(), diffed around each case since a module shares its Contexts.
"""
from __future__ import annotations

import numpy as np
import pytest

from dp_players import Faults, run_until, wait_wcs
from metaroce_xdp.verbs_types import (Access, InvalidArgument, InvalidState, QPAttr, QPState, RecvWR, SendWR,
                                      WCOpcode, WCStatus, WROpcode)

pytestmark = [pytest.mark.netns]


def _snapshot(p):
    return p.buf.copy()


@pytest.mark.parametrize("case", ["bad_rkey", "out_of_bounds", "no_remote_write", "stale_rkey"])
def test_write_access_violation(dp_loop, case):
    """MR-MEM-021, MR-MEM-023, MR-MEM-024, MR-MEM-033 -> NAK code 2 (MR-NAK-007), both QPs in ERR
    (MR-NAK-009, MR-NAK-010), later WQEs flushed (MR-QP-027), memory untouched (MR-MEM-027)."""
    access = Access.LOCAL_WRITE | Access.REMOTE_READ if case == "no_remote_write" else None
    kw = {"b_access": access} if access is not None else {}
    a, b = dp_loop(**kw)
    a.buf[:] = 0xAA
    rkey, addr, n = b.mr.rkey, b.mr.addr, 5000
    if case == "bad_rkey":
        rkey ^= 0x01                               # wrong key tag
    elif case == "out_of_bounds":
        addr = b.mr.addr + b.mr.length - 100       # runs past the end of the MR
    elif case == "stale_rkey":
        b.ctx.dereg_mr(b.mr)
    before = _snapshot(b)
    naks0 = a.ctx.stats()["naks_seen"]
    a.qp.post_send([SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, n)], remote_addr=addr, rkey=rkey),
                    SendWR(wr_id=2, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 8)], remote_addr=b.mr.addr,
                           rkey=b.mr.rkey)])
    wcs = wait_wcs([a, b], a, 2)
    assert (wcs[0].wr_id, wcs[0].status) == (1, WCStatus.REM_ACCESS_ERR)
    assert (wcs[1].wr_id, wcs[1].status) == (2, WCStatus.WR_FLUSH_ERR)
    assert a.qp.query_state() == QPState.ERR and b.qp.query_state() == QPState.ERR
    assert np.array_equal(b.buf, before)           # MR-MEM-027: a violation never touches memory
    assert b.qp.query()["error"] and a.ctx.stats()["naks_seen"] - naks0 == 1


def test_read_and_atomic_violations(dp_loop):
    """MR-MEM-023, MR-ATOM-005, MR-ATOM-011: READ/ATOMIC without the MR's access right fail, nothing written."""
    a, b = dp_loop(b_access=Access.LOCAL_WRITE | Access.REMOTE_WRITE)
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(0, 64)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    (wc,) = wait_wcs([a, b], a, 1)
    assert wc.status == WCStatus.REM_ACCESS_ERR
    a, b = dp_loop(b_access=Access.LOCAL_WRITE | Access.REMOTE_WRITE)
    before = _snapshot(b)
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.ATOMIC_FETCH_AND_ADD, sg_list=[a.sge(0, 8)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey, compare_add=5))
    (wc,) = wait_wcs([a, b], a, 1)
    assert wc.status == WCStatus.REM_ACCESS_ERR and np.array_equal(b.buf, before)


@pytest.mark.parametrize("op", [WROpcode.RDMA_WRITE, WROpcode.RDMA_READ, WROpcode.ATOMIC_FETCH_AND_ADD])
def test_qp_without_remote_access_flag(dp_loop, op):
    """MR-RC-017, MR-NAK-006 (b): an operation the QP's access flags do not allow is an
    invalid request (the MR's own flags give a remote access error, MR-MEM-021)."""
    a, b = dp_loop(b_qp_access=Access.LOCAL_WRITE)
    before = b.buf.copy()
    a.qp.post_send(SendWR(wr_id=1, opcode=op, sg_list=[a.sge(0, 8)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey, compare_add=1))
    (wc,) = wait_wcs([a, b], a, 1)
    assert wc.status == WCStatus.REM_INV_REQ_ERR
    assert np.array_equal(b.buf, before)


def test_post_in_err_is_flushed(dp_loop):
    """MR-QP-017, MR-QP-018, MR-QP-028: in ERR a post is accepted and completes with WR_FLUSH_ERR."""
    a, b = dp_loop()
    a.qp.modify(QPAttr(qp_state=QPState.ERR))
    a.qp.post_send(SendWR(wr_id=7, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 8)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    a.qp.post_recv(RecvWR(wr_id=8, sg_list=[a.sge(0, 8)]))
    wcs = wait_wcs([a], a, 2)
    assert [(w.wr_id, w.status) for w in wcs] == [(7, WCStatus.WR_FLUSH_ERR), (8, WCStatus.WR_FLUSH_ERR)]


def test_send_longer_than_receive_buffer(dp_loop):
    """MR-RC-012, MR-NAK-006 (e), MR-QP-024: invalid request there, LOC_LEN_ERR on the receive WQE."""
    a, b = dp_loop()
    b.qp.post_recv(RecvWR(wr_id=9, sg_list=[b.sge(0, 100)]))
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND, sg_list=[a.sge(0, 3000)]))
    (swc,) = wait_wcs([a, b], a, 1)
    (rwc,) = wait_wcs([a, b], b, 1)
    assert swc.status == WCStatus.REM_INV_REQ_ERR
    assert rwc.wr_id == 9 and rwc.status == WCStatus.LOC_LEN_ERR


def test_rnr_retried_until_a_receive_is_posted(dp_loop):
    """MR-RNR-001, MR-RNR-003, MR-RNR-005, MR-RNR-007: RNR NAKs are retried forever with rnr_retry 7."""
    a, b = dp_loop(min_rnr_timer=1, rnr_retry=7)
    rnr0, sent0 = a.ctx.stats()["rnr_seen"], b.ctx.stats()["tx_rnr"]
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND, sg_list=[a.sge(0, 10)]))
    run_until([a, b], lambda: a.ctx.stats()["rnr_seen"] - rnr0 >= 3)
    b.qp.post_recv(RecvWR(wr_id=2, sg_list=[b.sge(0, 10)]))
    (wc,) = wait_wcs([a, b], a, 1)
    assert wc.status == WCStatus.SUCCESS
    assert b.ctx.stats()["tx_rnr"] - sent0 >= 3


def test_rnr_retry_exhausted(dp_loop):
    """MR-RNR-005: rnr_retry 2 gives up after the third RNR NAK with RNR_RETRY_EXC_ERR."""
    a, b = dp_loop(min_rnr_timer=1, rnr_retry=2)
    rnr0 = a.ctx.stats()["rnr_seen"]
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND, sg_list=[a.sge(0, 10)]))
    (wc,) = wait_wcs([a, b], a, 1)
    assert wc.status == WCStatus.RNR_RETRY_EXC_ERR
    assert a.ctx.stats()["rnr_seen"] - rnr0 == 3          # the first try plus two retries
    assert a.qp.query_state() == QPState.ERR


def test_retry_exhausted_when_peer_is_gone(dp_loop):
    """MR-RETRY-001, MR-RETRY-004, MR-RETRY-005: retry_cnt 3 is the first try plus three retries."""
    a, b = dp_loop(Faults(drop=1.0), timeout=4, retry_cnt=3)   # timeout 4: 65 us
    to0 = a.ctx.stats()["timeouts"]
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 100)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    (wc,) = wait_wcs([a, b], a, 1)
    assert wc.status == WCStatus.RETRY_EXC_ERR and a.ctx.stats()["timeouts"] - to0 == 4


def test_typed_api_errors(dp_loop):
    """MR-QP-004, MR-QP-005, MR-QP-018, MR-MEM-006, MR-ATOM-008, MR-ENC-028: refused at the API.  (A bad
    local SGE is not: it completes in error, MR-RC-022, test_local_errors.)"""
    a, b = dp_loop()
    with pytest.raises(InvalidArgument, match="8-byte"):
        a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.ATOMIC_FETCH_AND_ADD, sg_list=[a.sge(0, 4)]))
    with pytest.raises(InvalidArgument):
        a.ctx.reg_mr(a.pd, b"read-only bytes", Access.LOCAL_WRITE)
    with pytest.raises(InvalidArgument):
        a.ctx.reg_mr(a.pd, bytearray(10), Access.REMOTE_WRITE)      # needs LOCAL_WRITE
    qp = a.ctx.create_qp(a.pd, a.cq, a.cq)
    try:
        with pytest.raises(InvalidState):
            qp.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND))
        with pytest.raises(InvalidState):
            qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=1))
        qp.modify(QPAttr(qp_state=QPState.INIT))
        with pytest.raises(InvalidArgument, match="needs"):
            qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=5))
        with a.topo.enter(a.ns), pytest.raises(InvalidArgument, match="path_mtu"):
            qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=5, rq_psn=0, path_mtu=1500, dgid=b.ctx.gid))
        assert qp.query_state() == QPState.INIT
    finally:
        a.ctx.destroy_qp(qp)


def test_error_state_flushes_receives(dp_loop):
    """MR-QP-016, MR-QP-027: a modify to ERR flushes posted receives in order."""
    a, b = dp_loop()
    b.qp.post_recv([RecvWR(wr_id=i, sg_list=[b.sge(0, 8)]) for i in range(3)])
    b.qp.modify(QPAttr(qp_state=QPState.ERR))
    wcs = wait_wcs([b], b, 3)
    assert [w.wr_id for w in wcs] == [0, 1, 2] and all(w.status == WCStatus.WR_FLUSH_ERR for w in wcs)
    assert all(w.opcode == WCOpcode.RECV for w in wcs)
