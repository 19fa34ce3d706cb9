"""Local errors reported by completions, not at post time (spec 03 MR-RC-008, MR-RC-022; 08 MR-MEM-011,
MR-MEM-020, MR-MEM-032; 07 MR-QP-027), on the compiled plane (dp_loop pairs of tests/dp_players.py)."""
from __future__ import annotations

import mmap

import numpy as np
import pytest

from dp_players import FULL, run_until, wait_wcs
from metaroce_xdp.dp import layout as L
from metaroce_xdp.verbs_types import (SGE, Access, InvalidArgument, QPAttr, QPState, RecvWR, SendWR, WCOpcode,
                                      WCStatus, WROpcode)

pytestmark = [pytest.mark.netns]


def _write(a, b, wr_id, off, n, sge=None):
    return SendWR(wr_id=wr_id, opcode=WROpcode.RDMA_WRITE, sg_list=[sge or a.sge(off, n)],
                  remote_addr=b.mr.addr + off, rkey=b.mr.rkey)


@pytest.mark.parametrize("bad", ["null", "lkey", "bounds"])
def test_bad_local_sge_completes_in_error_without_a_packet(dp_loop, bad):
    """MR-RC-022, MR-MEM-020, MR-QP-023, MR-QP-027: a WR whose SGE fails the lkey or bounds check is
    accepted; the WRs before it complete normally, it completes with IBV_WC_LOC_PROT_ERR without any
    packet, the QP moves to ERR and the WRs after it are flushed."""
    a, b = dp_loop()
    a.buf[:] = 0x42
    sge = {"null": SGE(0, 10, 0), "lkey": SGE(a.mr.addr, 10, a.mr.lkey ^ 1),
           "bounds": a.sge(a.mr.length - 5, 10)}[bad]
    a.qp.post_send([_write(a, b, 1, 0, 4096), _write(a, b, 2, 8192, 10, sge=sge), _write(a, b, 3, 16384, 8)])
    wcs = wait_wcs([a, b], a, 3)
    assert [(w.wr_id, w.status) for w in wcs] == [(1, WCStatus.SUCCESS), (2, WCStatus.LOC_PROT_ERR),
                                                  (3, WCStatus.WR_FLUSH_ERR)]
    assert a.qp.query_state() == QPState.ERR and b.qp.query_state() == QPState.RTS
    assert (b.buf[:4096] == 0x42).all() and not b.buf[4096:].any()
    assert a.qp.query()["sq_psn"] == 104             # PSNs 100-103 for WR 1; none ever for WR 2
    assert b.qp.query()["rq_psn"] == 104


def test_unsignaled_local_error_still_completes(dp_loop):
    """MR-QP-033, MR-RC-022: the error completion comes even for an unsignaled WR."""
    a, b = dp_loop()
    wr = _write(a, b, 9, 0, 10, sge=SGE(a.mr.addr, 10, a.mr.lkey ^ 1))
    wr.send_flags = 0
    a.qp.post_send(wr)
    (wc,) = wait_wcs([a, b], a, 1)
    assert (wc.wr_id, wc.status) == (9, WCStatus.LOC_PROT_ERR)


def test_message_over_2_31_bytes_completes_with_loc_len_err(dp_loop):
    """MR-RC-008: a message of more than 2^31 bytes completes with IBV_WC_LOC_LEN_ERR without any packet;
    exactly 2^31 bytes is a valid message (only posted here, then flushed)."""
    a, b = dp_loop()
    big = np.frombuffer(mmap.mmap(-1, (1 << 31) + 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), np.uint8)
    mr = a.pd.reg_mr(big, FULL)
    try:
        tx0 = a.ctx.stats()["tx"]
        a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[SGE(mr.addr, (1 << 31) + 1, mr.lkey)],
                              remote_addr=b.mr.addr, rkey=b.mr.rkey))
        (wc,) = wait_wcs([a, b], a, 1)
        assert (wc.wr_id, wc.status) == (1, WCStatus.LOC_LEN_ERR)
        assert a.ctx.stats()["tx"] == tx0 and a.qp.query_state() == QPState.ERR
    finally:
        mr.dereg()
    a, b = dp_loop()
    mr = a.pd.reg_mr(big, FULL)
    try:
        b.qp.modify(QPAttr(qp_state=QPState.ERR))         # the peer does not take it: only posted, then flushed
        a.qp.post_send(SendWR(wr_id=2, opcode=WROpcode.RDMA_WRITE, sg_list=[SGE(mr.addr, 1 << 31, mr.lkey)],
                              remote_addr=b.mr.addr, rkey=b.mr.rkey))
        assert a.qp.query()["sq_outstanding"] == 1
        a.qp.modify(QPAttr(qp_state=QPState.ERR))
        assert [(x.wr_id, x.status) for x in wait_wcs([a], a, 1)] == [(2, WCStatus.WR_FLUSH_ERR)]
    finally:
        mr.dereg()


def test_bad_receive_sge_gives_nak_code_3(dp_loop):
    """MR-MEM-020, MR-NAK-008, MR-NAK-014 (row 8): a receive WR with a bad lkey is accepted; the SEND that
    would fill it gets NAK code 3 (IBV_WC_REM_OP_ERR at the requester), the receive WR completes with
    IBV_WC_LOC_PROT_ERR, and nothing is placed."""
    a, b = dp_loop()
    b.qp.post_recv(RecvWR(wr_id=5, sg_list=[SGE(b.mr.addr, 64, b.mr.lkey ^ 1)]))
    a.buf[:32] = 9
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND, sg_list=[a.sge(0, 32)]))
    (swc,) = wait_wcs([a, b], a, 1)
    (rwc,) = wait_wcs([a, b], b, 1)
    assert swc.status == WCStatus.REM_OP_ERR
    assert (rwc.wr_id, rwc.status) == (5, WCStatus.LOC_PROT_ERR)
    assert b.qp.query_state() == QPState.ERR and not b.buf.any()


def test_receive_mr_deregistered_after_post_gives_nak_code_3(dp_loop):
    """MR-MEM-020, MR-MEM-033, MR-NAK-008: a receive WR posted into an MR that is deregistered before the
    SEND arrives is not filled (the memory was once written all the same): NAK code 3, the receive WR
    completes with IBV_WC_LOC_PROT_ERR, and the old memory is untouched.  (Conformance TC-MEM-020-c.)"""
    a, b = dp_loop()
    mem = np.zeros(4096, np.uint8)
    mr = b.pd.reg_mr(mem, FULL)
    b.qp.post_recv(RecvWR(wr_id=6, sg_list=[SGE(mr.addr, 64, mr.lkey)]))
    mr.dereg()
    a.buf[:32] = 9
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND, sg_list=[a.sge(0, 32)]))
    (swc,) = wait_wcs([a, b], a, 1)
    (rwc,) = wait_wcs([a, b], b, 1)
    assert swc.status == WCStatus.REM_OP_ERR
    assert (rwc.wr_id, rwc.status) == (6, WCStatus.LOC_PROT_ERR)
    assert b.qp.query_state() == QPState.ERR and not mem.any()


def test_zero_length_sge_is_skipped(dp_loop):
    """MR-MEM-032: an SGE of length 0 is skipped: its lkey is not checked and it carries no data."""
    a, b = dp_loop()
    a.buf[:8] = 7
    junk = SGE(0xDEAD, 0, 0x12345)
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[junk, a.sge(0, 8), junk],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    b.qp.post_recv(RecvWR(wr_id=2, sg_list=[junk, b.sge(100, 8)]))
    a.qp.post_send(SendWR(wr_id=3, opcode=WROpcode.SEND, sg_list=[a.sge(0, 8)]))
    wcs = wait_wcs([a, b], a, 2)
    assert [w.status for w in wcs] == [WCStatus.SUCCESS] * 2
    (rwc,) = wait_wcs([a, b], b, 1)
    assert (rwc.status, rwc.byte_len) == (WCStatus.SUCCESS, 8)
    assert (b.buf[:8] == 7).all() and (b.buf[100:108] == 7).all()


def test_reused_index_never_gets_its_last_tag(dp_loop):
    """MR-MEM-011: when an index (MR row) is reused after deregistration its key's tag differs from the one
    it had.  Registered and deregistered one at a time until rows come round again."""
    a, _ = dp_loop()
    mem = np.zeros(8, np.uint8)
    last_tag: dict[int, int] = {}
    reused = 0
    for _ in range(3000):
        mr = a.pd.reg_mr(mem, Access.LOCAL_WRITE)
        assert L.key_slot(mr.lkey) == mr.index
        if mr.index in last_tag:
            reused += 1
            assert mr.lkey & 0xFF != last_tag[mr.index], f"row {mr.index} got its last tag again"
        last_tag[mr.index] = mr.lkey & 0xFF
        mr.dereg()
    assert reused >= 50, f"only {reused} rows came round: the rule was hardly exercised"


def test_partial_send_receive_is_flushed_on_err(dp_loop):
    """MR-QP-027: the receive WR that a partially received SEND was filling is flushed, before the other
    receive WRs, when the QP enters ERR by a modify."""
    a, b = dp_loop(mtu=1024)
    b.qp.post_recv([RecvWR(wr_id=i, sg_list=[b.sge(i * 8192, 8192)]) for i in (1, 2)])
    a.buf[:6000] = 0x5C
    budget = int(a.ctx.plane.A[L.P_BUDGET])
    a.ctx.plane.A[L.P_BUDGET] = 2
    try:
        a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND, sg_list=[a.sge(0, 6000)]))
        a.ctx.progress()                              # SEND FIRST and MIDDLE only
    finally:
        a.ctx.plane.A[L.P_BUDGET] = budget
    run_until([b], lambda: (b.buf[8192:8192 + 2048] == 0x5C).all(), 5)
    assert b.qp.query()["rq_psn"] == 102 and not b.buf[8192 + 2048:].any()   # in the middle of the SEND
    b.qp.modify(QPAttr(qp_state=QPState.ERR))
    wcs = wait_wcs([b], b, 2)
    assert [(w.wr_id, w.status, w.opcode) for w in wcs] == [(1, WCStatus.WR_FLUSH_ERR, WCOpcode.RECV),
                                                            (2, WCStatus.WR_FLUSH_ERR, WCOpcode.RECV)]


@pytest.mark.parametrize("op", [WROpcode.RDMA_READ, WROpcode.ATOMIC_FETCH_AND_ADD])
def test_read_with_max_rd_atomic_0_is_a_local_qp_operation_error(dp_loop, op):
    """MR-RC-009 (Table 7-6): with max_rd_atomic 0 a READ or ATOMIC may never be outstanding: the WR
    completes with IBV_WC_LOC_QP_OP_ERR without a packet; a WRITE still works."""
    a, b = dp_loop(rd_atomic=0)
    b.buf[:8] = 3
    a.qp.post_send([_write(a, b, 1, 64, 8),
                    SendWR(wr_id=2, opcode=op, sg_list=[a.sge(0, 8)], remote_addr=b.mr.addr,
                           rkey=b.mr.rkey, compare_add=1)])
    wcs = wait_wcs([a, b], a, 2)
    assert [(w.wr_id, w.status) for w in wcs] == [(1, WCStatus.SUCCESS), (2, WCStatus.LOC_QP_OP_ERR)]
    assert a.qp.query()["sq_psn"] == 101 and not a.buf[:8].any() and (b.buf[:8] == 3).all()


def test_zero_length_registration_is_refused(dp_loop):
    """MR-MEM-004: registering an MR of 0 bytes fails with EINVAL (InvalidArgument); 1 byte is fine.
    (Conformance TC-MEM-004-a.)"""
    a, _ = dp_loop()
    with pytest.raises(InvalidArgument):
        a.pd.reg_mr(np.zeros(0, np.uint8), Access.LOCAL_WRITE)
    mr = a.pd.reg_mr(np.zeros(1, np.uint8), Access.LOCAL_WRITE)
    assert mr.length == 1
    mr.dereg()
