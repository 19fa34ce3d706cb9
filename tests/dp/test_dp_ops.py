"""The compiled data plane's operations beyond SEND/WRITE/READ (dp/atomics.py, dp/core.py, dp/responder.py, dp/requester.py), end to end: two
namespaces on a veth, the real XDP program (ACKs and CNPs consumed in the kernel), AF_XDP sockets.
ATOMICs (results, alignment and access NAKs with memory untouched, a duplicate answered from the saved
result), SEND WITH INVALIDATE, gather/scatter lists, FENCE behind a READ, completion channels (solicited
only, threaded wake-ups), SQD draining."""
from __future__ import annotations

import struct
import time

import numpy as np
import pytest

from dp_players import FULL, collect, connected, run_until
from metaroce_xdp.dp import layout as L
from metaroce_xdp.verbs_types import EventType
from metaroce_xdp.verbs_types import (SGE, Access, Busy, InvalidArgument, QPAttr, QPState, RecvWR, SendFlags,
                                      SendWR, WCFlags, WCOpcode, WCStatus, WROpcode)

pytestmark = [pytest.mark.netns, pytest.mark.fabric("flat")]


@pytest.fixture
def pair(fabric):
    return connected(fabric.a, fabric.b, drain=True)    # completions and events of earlier tests' QPs


def u64(buf, off):
    return struct.unpack_from("<Q", buf, off)[0]


def atomic(a, b, wr_id, op, loff, roff, add_or_cmp=0, swap=0, sgl=None, flags=SendFlags.SIGNALED):
    return SendWR(wr_id=wr_id, opcode=op, sg_list=sgl or [a.sge(loff, 8)], remote_addr=b.mr.addr + roff,
                  rkey=b.mr.rkey, compare_add=add_or_cmp, swap=swap, send_flags=flags)


def post_unchecked(side, wr_id, op, laddr, raddr, rkey, add_or_cmp=0, swap=0):
    """A WQE written straight into the send queue, past post_send's checks: how a peer that does not
    check would send (the responder must judge the packet by itself)."""
    pl, qp = side.ctx.plane, side.qp
    r = qp.row
    tail = int(r[L.Q_SQ_TAIL])
    row = np.zeros(L.NW, np.int64)
    row[[L.W_WR_ID, L.W_OPCODE, L.W_FLAGS, L.W_LADDR, L.W_LENGTH, L.W_RADDR, L.W_RKEY, L.W_IMM, L.W_SWAP]] = \
        (wr_id, int(op), int(SendFlags.SIGNALED), laddr, 8, raddr, rkey, add_or_cmp, swap)
    row[L.W_LMR] = side.mr.ref            # the MR reference a WQE keeps (MR-SEC-003)
    pl.SW[qp.sq_base + (tail & (qp.sq_size - 1))] = row
    r[L.Q_SQ_TAIL] = tail + 1
    pl.mark_ready(qp.qi)


def test_fetch_add_and_compare_swap(pair):
    a, b = pair
    b.buf[64:72] = np.frombuffer(struct.pack("<Q", 1000), np.uint8)
    b.buf[72:80] = np.frombuffer(struct.pack("<Q", 0xFFFF_FFFF_FFFF_FFFF), np.uint8)
    wrs = [atomic(a, b, 1, WROpcode.ATOMIC_FETCH_AND_ADD, 0, 64, 5),
           atomic(a, b, 2, WROpcode.ATOMIC_FETCH_AND_ADD, 8, 64, (1 << 64) - 1),       # adds -1
           atomic(a, b, 3, WROpcode.ATOMIC_CMP_AND_SWP, 16, 64, 1004, 77),             # matches: swapped
           atomic(a, b, 4, WROpcode.ATOMIC_CMP_AND_SWP, 24, 64, 1004, 88),             # no match: kept
           atomic(a, b, 5, WROpcode.ATOMIC_FETCH_AND_ADD, 32, 72, 2),                  # wraps around 2^64
           SendWR(wr_id=6, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(1000, 100)], remote_addr=b.mr.addr + 5000,
                  rkey=b.mr.rkey)]
    a.qp.post_send(wrs)
    wcs = collect(a, len(wrs), [b])
    assert [(w.wr_id, w.status, w.opcode, w.byte_len) for w in wcs] == [
        (1, WCStatus.SUCCESS, WCOpcode.FETCH_ADD, 8), (2, WCStatus.SUCCESS, WCOpcode.FETCH_ADD, 8),
        (3, WCStatus.SUCCESS, WCOpcode.COMP_SWAP, 8), (4, WCStatus.SUCCESS, WCOpcode.COMP_SWAP, 8),
        (5, WCStatus.SUCCESS, WCOpcode.FETCH_ADD, 8), (6, WCStatus.SUCCESS, WCOpcode.RDMA_WRITE, 100)]
    assert [u64(a.buf, o) for o in (0, 8, 16, 24, 32)] == [1000, 1005, 1004, 77, 0xFFFF_FFFF_FFFF_FFFF]
    assert u64(b.buf, 64) == 77 and u64(b.buf, 72) == 1
    assert (b.buf[5000:5100] == a.buf[1000:1100]).all()
    assert a.ctx.stats()["rx_drop_op"] == 0 and b.ctx.stats()["rx_drop_op"] == 0


def test_atomic_work_requests_are_checked_at_post(pair):
    a, b = pair
    with pytest.raises(InvalidArgument, match="multiple of 8"):
        a.qp.post_send(atomic(a, b, 1, WROpcode.ATOMIC_FETCH_AND_ADD, 0, 4, 1))
    with pytest.raises(InvalidArgument, match="8-byte"):
        a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.ATOMIC_CMP_AND_SWP, sg_list=[a.sge(0, 16)],
                              remote_addr=b.mr.addr, rkey=b.mr.rkey))
    assert a.qp.query()["sq_outstanding"] == 0


@pytest.mark.parametrize("op", [WROpcode.ATOMIC_FETCH_AND_ADD, WROpcode.ATOMIC_CMP_AND_SWP])
def test_misaligned_atomic_is_naked_and_memory_untouched(pair, op):
    """MR-ATOM-002: a peer that sends a VA not a multiple of 8 gets an invalid request NAK; not a byte of
    the target (nor of the requester's result buffer) changes; the responder's QP goes to ERR."""
    a, b = pair
    before_b, before_a = b.buf[:64].copy(), a.buf[:16].copy()
    post_unchecked(a, 7, op, a.mr.addr, b.mr.addr + 4, b.mr.rkey, 1, 2)
    (wc,) = collect(a, 1, [b])
    assert (wc.wr_id, wc.status, wc.opcode) == (7, WCStatus.REM_INV_REQ_ERR,
                                                WCOpcode.FETCH_ADD if op == WROpcode.ATOMIC_FETCH_AND_ADD
                                                else WCOpcode.COMP_SWAP)
    assert (b.buf[:64] == before_b).all() and (a.buf[:16] == before_a).all()
    assert b.qp.query_state() == QPState.ERR
    ev = b.ctx.get_async_event(1.0)
    assert ev is not None and ev.event_type == EventType.QP_REQ_ERR and "aligned" in ev.reason


def test_atomic_with_a_bad_key_is_a_remote_access_error(pair):
    a, b = pair
    before = b.buf[:64].copy()
    a.qp.post_send(SendWR(wr_id=3, opcode=WROpcode.ATOMIC_FETCH_AND_ADD, sg_list=[a.sge(0, 8)],
                          remote_addr=b.mr.addr + 8, rkey=b.mr.rkey ^ 1, compare_add=1))
    (wc,) = collect(a, 1, [b])
    assert (wc.wr_id, wc.status) == (3, WCStatus.REM_ACCESS_ERR)
    assert (b.buf[:64] == before).all()


def test_duplicate_atomic_is_answered_from_the_saved_result(pair):
    """The requester's local ACK timer fires before the responder answered, so the FETCH_ADD goes out
    twice with one PSN: the responder executes the first, answers the second from the value it saved
    (MR-DUP-005) -- the target is incremented once and the completion carries the first original value."""
    a, b = pair
    b.buf[128:136] = np.frombuffer(struct.pack("<Q", 40), np.uint8)
    with a.topo.enter(a.ns):
        a.qp.modify(QPAttr(qp_state=QPState.RTS, timeout=6))            # 4.096 us * 2^6 = 262 us
    a.qp.post_send(atomic(a, b, 1, WROpcode.ATOMIC_FETCH_AND_ADD, 0, 128, 2))
    t0 = time.monotonic()
    while a.ctx.stats()["timeouts"] < 1 and time.monotonic() - t0 < 5:   # B does not run meanwhile
        a.ctx.progress()
    assert a.ctx.stats()["timeouts"] >= 1
    dup0 = b.ctx.stats()["rx_dup"]
    (wc,) = collect(a, 1, [b])
    assert (wc.wr_id, wc.status, wc.opcode) == (1, WCStatus.SUCCESS, WCOpcode.FETCH_ADD)
    run_until([a, b], lambda: b.ctx.plane.A[L.P_RX_DUP_ATOMIC] >= 1, 5)
    assert u64(a.buf, 0) == 40 and u64(b.buf, 128) == 42               # executed once
    assert b.ctx.stats()["rx_dup"] > dup0


def test_send_with_invalidate(pair):
    a, b = pair
    mem = np.zeros(1 << 16, np.uint8)
    mr2 = b.pd.reg_mr(mem, Access.LOCAL_WRITE | Access.REMOTE_WRITE, remote_invalidate=True)
    plain = b.pd.reg_mr(np.zeros(64, np.uint8), Access.LOCAL_WRITE | Access.REMOTE_WRITE)
    try:
        mr3 = b.pd.reg_mr(np.zeros(64, np.uint8), Access.LOCAL_WRITE | Access.REMOTE_WRITE, remote_invalidate=True)
        b.qp.post_recv([RecvWR(wr_id=10, sg_list=[b.sge(0, 8000)]), RecvWR(wr_id=11, sg_list=[b.sge(8000, 100)])])
        a.qp.post_send([SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 64)], remote_addr=mr2.addr,
                               rkey=mr2.rkey),
                        SendWR(wr_id=2, opcode=WROpcode.SEND_WITH_INV, sg_list=[a.sge(100, 3000)],   # 3 packets
                               invalidate_rkey=mr2.rkey, send_flags=SendFlags.SIGNALED | SendFlags.SOLICITED),
                        SendWR(wr_id=4, opcode=WROpcode.SEND_WITH_INV, sg_list=[a.sge(100, 50)],   # 1 packet
                               invalidate_rkey=mr3.rkey)])
        wcs = collect(a, 3, [b])
        assert [(w.wr_id, w.status) for w in wcs] == [(1, WCStatus.SUCCESS), (2, WCStatus.SUCCESS),
                                                      (4, WCStatus.SUCCESS)]
        r, r2 = collect(b, 2, [a])
        assert (r.wr_id, r.status, r.opcode, r.byte_len) == (10, WCStatus.SUCCESS, WCOpcode.RECV, 3000)
        assert r.wc_flags & WCFlags.WITH_INV and r.invalidated_rkey == mr2.rkey and r.imm_data is None
        assert (r2.wr_id, r2.byte_len, r2.invalidated_rkey) == (11, 50, mr3.rkey)
        assert b.ctx.plane.MRT[mr3.index, L.M_VALID] == 0
        assert (b.buf[:3000] == a.buf[100:3100]).all() and (mem[:64] == a.buf[:64]).all()
        # the key is dead: a WRITE through it is a remote access error, and memory stays as it was
        a.qp.post_send(SendWR(wr_id=3, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(200, 64)], remote_addr=mr2.addr,
                              rkey=mr2.rkey))
        (w,) = collect(a, 1, [b])
        assert (w.wr_id, w.status) == (3, WCStatus.REM_ACCESS_ERR)
        assert (mem[:64] == a.buf[:64]).all()
    finally:
        mr2.dereg()
        mr3.dereg()
        plain.dereg()


def test_send_with_invalidate_of_a_plain_key_is_an_invalid_request(pair):
    a, b = pair
    plain = b.pd.reg_mr(np.zeros(64, np.uint8), Access.LOCAL_WRITE | Access.REMOTE_WRITE)
    try:
        b.qp.post_recv(RecvWR(wr_id=20, sg_list=[b.sge(0, 100)]))
        a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND_WITH_INV, sg_list=[a.sge(0, 10)],
                              invalidate_rkey=plain.rkey))
        (w,) = collect(a, 1, [b])
        assert (w.wr_id, w.status) == (1, WCStatus.REM_INV_REQ_ERR)
        (r,) = collect(b, 1, [a])
        assert (r.wr_id, r.status) == (20, WCStatus.REM_INV_REQ_ERR)
        assert b.ctx.plane.MRT[plain.index, L.M_VALID] == 1          # not invalidated
    finally:
        plain.dereg()


def test_scatter_gather_lists(pair):
    a, b = pair
    b.buf[4096:4104] = np.frombuffer(struct.pack("<Q", 7), np.uint8)
    b.qp.post_recv(RecvWR(wr_id=30, sg_list=[b.sge(100_000, 700), b.sge(200_000, 1), SGE(b.mr.addr, 0, 0),
                                             b.sge(300_000, 5000)]))
    gather = [a.sge(10_000, 1500), a.sge(20_000, 0), a.sge(30_000, 777), a.sge(40_000, 2000)]     # 4277 bytes
    scatter = [a.sge(500_000, 1000), a.sge(600_000, 1), a.sge(700_000, 3000)]
    wrs = [SendWR(wr_id=1, opcode=WROpcode.SEND, sg_list=gather),
           SendWR(wr_id=2, opcode=WROpcode.RDMA_WRITE, sg_list=gather, remote_addr=b.mr.addr + 1_000_000,
                  rkey=b.mr.rkey),
           SendWR(wr_id=3, opcode=WROpcode.RDMA_READ, sg_list=scatter, remote_addr=b.mr.addr + 2_000_000,
                  rkey=b.mr.rkey),
           SendWR(wr_id=4, opcode=WROpcode.ATOMIC_FETCH_AND_ADD, sg_list=[a.sge(800_000, 3), a.sge(900_000, 5)],
                  remote_addr=b.mr.addr + 4096, rkey=b.mr.rkey, compare_add=1)]
    a.qp.post_send(wrs)
    wcs = collect(a, 4, [b])
    assert [(w.wr_id, w.status, w.byte_len) for w in wcs] == [(1, WCStatus.SUCCESS, 4277), (2, WCStatus.SUCCESS, 4277),
                                                              (3, WCStatus.SUCCESS, 4001), (4, WCStatus.SUCCESS, 8)]
    msg = np.concatenate([a.buf[10_000:11_500], a.buf[30_000:30_777], a.buf[40_000:42_000]])
    (r,) = collect(b, 1, [a])
    assert (r.wr_id, r.status, r.byte_len) == (30, WCStatus.SUCCESS, 4277)
    got = np.concatenate([b.buf[100_000:100_700], b.buf[200_000:200_001], b.buf[300_000:303_576]])
    assert (got == msg).all()
    assert (b.buf[1_000_000:1_004_277] == msg).all()
    src = b.buf[2_000_000:2_004_001]
    assert (a.buf[500_000:501_000] == src[:1000]).all() and a.buf[600_000] == src[1000]
    assert (a.buf[700_000:703_000] == src[1001:]).all()
    orig = bytes(a.buf[800_000:800_003]) + bytes(a.buf[900_000:900_005])
    assert struct.unpack("<Q", orig)[0] == 7 and u64(b.buf, 4096) == 8
    # every SG row went back to the pool once the loop was done with them
    a.qp.post_send(SendWR(wr_id=5, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 1), a.sge(1, 1)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    collect(a, 1, [b])
    a.qp._sg_release(int(a.qp.row[L.Q_SQ_HEAD]), int(a.qp.row[L.Q_RQ_HEAD]))
    b.qp._sg_release(int(b.qp.row[L.Q_SQ_HEAD]), int(b.qp.row[L.Q_RQ_HEAD]))
    assert a.ctx.plane.sg_pool.free == [(0, L.SG_ROWS)] and b.ctx.plane.sg_pool.free == [(0, L.SG_ROWS)]


def test_fence_waits_behind_a_read(pair):
    """MR-RC-013: a fenced WRITE starts only once the READ before it completed, so the READ returns the
    memory as it was before the WRITE overwrote it."""
    a, b = pair
    old = b.buf[1_000_000:1_200_000].copy()
    a.qp.post_send([SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(0, 200_000)],
                           remote_addr=b.mr.addr + 1_000_000, rkey=b.mr.rkey),
                    SendWR(wr_id=2, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(500_000, 200_000)],
                           remote_addr=b.mr.addr + 1_000_000, rkey=b.mr.rkey,
                           send_flags=SendFlags.SIGNALED | SendFlags.FENCE)])
    a.ctx.progress()
    qp = a.qp
    row2 = a.ctx.plane.SW[qp.sq_base + 1]
    assert int(qp.row[L.Q_SQ_NEXT]) == 1 and row2[L.W_STARTED] == 0 and int(qp.row[L.Q_RD_OUT]) == 1
    wcs = collect(a, 2, [b])
    assert [(w.wr_id, w.status) for w in wcs] == [(1, WCStatus.SUCCESS), (2, WCStatus.SUCCESS)]
    assert (a.buf[:200_000] == old).all()
    assert (b.buf[1_000_000:1_200_000] == a.buf[500_000:700_000]).all()


def test_completion_channel_and_solicited_events(pair):
    a, b = pair
    ch = b.ctx.create_comp_channel()
    rcq = b.ctx.create_cq(64, cq_context="rx", channel=ch)
    qb = b.ctx.create_qp(b.pd, b.cq, rcq)
    qa = a.ctx.create_qp(a.pd, a.cq, a.cq)
    try:
        for q, peer, s in ((qa, qb, a), (qb, qa, b)):
            with s.topo.enter(s.ns):
                q.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
                q.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=peer.qp_num, rq_psn=0, path_mtu=1024,
                                dgid=(b if s is a else a).ctx.gid, max_dest_rd_atomic=16))
                q.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0, max_rd_atomic=16))
        qb.post_recv([RecvWR(wr_id=i, sg_list=[b.sge(i * 1000, 1000)]) for i in range(4)])
        rcq.req_notify(solicited_only=True)
        qa.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND, sg_list=[a.sge(0, 10)]))
        collect(a, 1, [b])
        run_until([a, b], lambda: int(rcq.row[L.C_TAIL]) >= 1, 5)
        assert ch.get_cq_event(0.05) is None                     # not solicited: no event
        qa.post_send(SendWR(wr_id=2, opcode=WROpcode.SEND, sg_list=[a.sge(0, 10)],
                            send_flags=SendFlags.SIGNALED | SendFlags.SOLICITED))
        collect(a, 1, [b])
        got = ch.get_cq_event(2.0)
        assert got is rcq and got.cq_context == "rx" and rcq.events == 1 and rcq.armed == 0
        assert [w.wr_id for w in rcq.poll()] == [0, 1]
        # disarmed: nothing more until req_notify; then any completion reports, from the progress thread
        qa.post_send(SendWR(wr_id=3, opcode=WROpcode.SEND, sg_list=[a.sge(0, 10)]))
        collect(a, 1, [b])
        assert ch.get_cq_event(0.05) is None
        rcq.poll()
        b.ctx.plane.start(busy=False)
        try:
            rcq.req_notify()
            time.sleep(0.05)
            qa.post_send(SendWR(wr_id=4, opcode=WROpcode.SEND, sg_list=[a.sge(0, 10)]))
            t0 = time.monotonic()
            while not ch.q and time.monotonic() - t0 < 5:
                a.ctx.progress()
            assert ch.get_cq_event(1.0) is rcq and [w.wr_id for w in rcq.poll()] == [3]
        finally:
            b.ctx.plane.stop()
        collect(a, 1, [b])
        # a CQ without a channel: its private one (CQ.get_event); B's send completion
        b.cq.req_notify()
        qb.post_send(SendWR(wr_id=9, opcode=WROpcode.RDMA_WRITE, sg_list=[b.sge(0, 8)], remote_addr=a.mr.addr,
                            rkey=a.mr.rkey))
        t0 = time.monotonic()
        ok = False
        while not ok and time.monotonic() - t0 < 5:
            a.ctx.progress()
            ok = b.cq.get_event(0.001)
        assert ok and [w.wr_id for w in b.cq.poll()] == [9]
        with pytest.raises(Exception, match="channel"):
            rcq.get_event(0)
    finally:
        a.ctx.destroy_qp(qa)
        b.ctx.destroy_qp(qb)


def test_sqd_drains_then_resumes(pair):
    """RTS -> SQD: the started WQEs finish, no new one starts, SQ_DRAINED is raised once (MR-QP-013);
    SQD -> SQD while draining is EBUSY (MR-QP-014); SQD -> RTS sends the rest."""
    a, b = pair
    wrs = [SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(i * 65536, 65536)],
                  remote_addr=b.mr.addr + i * 65536, rkey=b.mr.rkey) for i in range(16)]
    a.qp.post_send(wrs)
    a.ctx.progress()                                    # starts some of them (256 packets a round)
    started = int(a.qp.row[L.Q_SQ_NEXT]) + int(a.ctx.plane.SW[a.qp.sq_base + int(a.qp.row[L.Q_SQ_NEXT]), L.W_STARTED])
    assert 0 < started < 16
    with a.topo.enter(a.ns):
        a.qp.modify(QPAttr(qp_state=QPState.SQD, en_sqd_async_notify=True))
        with pytest.raises(Busy):
            a.qp.modify(QPAttr(qp_state=QPState.SQD))
    a.qp.post_send(SendWR(wr_id=99, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 8)], remote_addr=b.mr.addr,
                          rkey=b.mr.rkey))                       # accepted in SQD, not started
    got = collect(a, started, [b])
    assert [w.wr_id for w in got] == list(range(started))
    ev = a.ctx.get_async_event(2.0)
    assert ev is not None and ev.event_type == EventType.SQ_DRAINED and ev.qp is a.qp
    for _ in range(50):
        a.ctx.progress(), b.ctx.progress()
    assert a.cq.poll() == [] and a.ctx.get_async_event(0) is None       # nothing new started, one event
    assert a.qp.query_state() == QPState.SQD
    with a.topo.enter(a.ns):
        a.qp.modify(QPAttr(qp_state=QPState.RTS))
    rest = collect(a, 17 - started, [b])
    assert [w.wr_id for w in rest] == list(range(started, 16)) + [99]
    assert all(w.status == WCStatus.SUCCESS for w in got + rest)
    assert (b.buf[8:16 * 65536] == a.buf[8:16 * 65536]).all()


def test_dcqcn_cnps_cut_the_senders_rate(make_fabric):
    """A switch port marks CE on A's requests towards B (bpf/fault_inject.c ecn_ce_ppm): B's notification
    point counts the marks and answers with CNPs, at most one per cnp_interval (MR-CNP-003); A's XDP
    program verifies each CNP's ICRC (so the compiled plane's CNP is a well-formed RoCEv2 packet),
    counts it into the QP's slot and consumes it; A's reaction point reads the count and cuts its
    rate; the paced transfer arrives intact."""
    fab = make_fabric(size=1 << 23)
    a, b = connected(fab.a, fab.b, seeds=(4,))
    r_line = a.ctx.plane.dcqcn.r_line_bps
    cnp0 = a.ctx.loader.events()["CNP_CONSUMED"]
    with fab.impair("b", seed=5, ecn_ce_ppm=300_000) as fi:
        a.qp.post_send([SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(i << 20, 1 << 20)],
                               remote_addr=b.mr.addr + (i << 20), rkey=b.mr.rkey) for i in range(4)])
        wcs = collect(a, 4, [b], timeout=60)
        marked = fi.stats()["ce_marked"]
    assert [(w.wr_id, w.status) for w in wcs] == [(i, WCStatus.SUCCESS) for i in range(4)]
    assert (b.buf[:4 << 20] == a.buf[:4 << 20]).all()
    qa, qb = a.qp.query(), b.qp.query()
    assert marked > 0 and qb["rx_ce_marked"] > 0 and qb["tx_cnp"] >= 1
    assert qb["tx_cnp"] <= qb["rx_ce_marked"] and b.ctx.stats()["tx_cnp"] == qb["tx_cnp"]
    assert a.ctx.loader.events()["CNP_CONSUMED"] - cnp0 >= 1        # ICRC verified by A's kernel
    assert qa["rx_cnp"] >= 1 and qa["rate_cuts"] >= 1
    # alpha has decayed since the QP was made (g = 1/256 every K = 55 us), so each cut is small;
    # every CNP adds g back
    assert qa["rate_min_bps"] < r_line and qa["alpha"] > 0


def test_a_bad_sge_is_reported_by_a_completion_not_at_post(pair):
    """MR-RC-022, MR-MEM-020: a send WR whose SGE fails its lkey / bounds check is
    accepted; the WRs before it complete, it fails LOC_PROT_ERR when it is the oldest with nothing of it
    sent, the rest are flushed.  A receive WR with a bad SGE fails LOC_PROT_ERR when a SEND comes for it,
    and the sender gets NAK code 3 (REM_OP_ERR)."""
    a, b = pair
    before = b.buf[:300].copy()
    a.qp.post_send([SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 100)], remote_addr=b.mr.addr,
                           rkey=b.mr.rkey),
                    SendWR(wr_id=2, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 8), SGE(a.mr.addr, 8, a.mr.lkey ^ 1)],
                           remote_addr=b.mr.addr + 100, rkey=b.mr.rkey),
                    SendWR(wr_id=3, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 100)], remote_addr=b.mr.addr + 200,
                           rkey=b.mr.rkey)])
    wcs = collect(a, 3, [b])
    assert [(w.wr_id, w.status) for w in wcs] == [(1, WCStatus.SUCCESS), (2, WCStatus.LOC_PROT_ERR),
                                                  (3, WCStatus.WR_FLUSH_ERR)]
    assert (b.buf[:100] == a.buf[:100]).all() and (b.buf[100:300] == before[100:]).all()
    assert a.qp.query_state() == QPState.ERR and a.ctx.get_async_event(0.1) is None
    assert b.qp.query_state() == QPState.RTS


def test_a_receive_with_a_bad_sge_fails_when_used(pair):
    a, b = pair
    b.qp.post_recv(RecvWR(wr_id=40, sg_list=[SGE(b.mr.addr + b.mr.length - 10, 100, b.mr.lkey)]))   # past the end
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND, sg_list=[a.sge(0, 50)]))
    (w,) = collect(a, 1, [b])
    assert (w.wr_id, w.status) == (1, WCStatus.REM_OP_ERR)
    (r,) = collect(b, 1, [a])
    assert (r.wr_id, r.status) == (40, WCStatus.LOC_PROT_ERR)


def test_read_then_overlapping_write_without_fence(pair):
    """MR-RC-025: the responder executes a WRITE only after the READ before it, responses included: the
    READ request and the WRITE arrive in one receive burst (B does not run while A sends both), yet the
    READ returns the memory as it was before the WRITE."""
    a, b = pair
    old = b.buf[3_000_000:3_065_536].copy()
    a.qp.post_send([SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(0, 65536)],
                           remote_addr=b.mr.addr + 3_000_000, rkey=b.mr.rkey),
                    SendWR(wr_id=2, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(500_000, 65536)],
                           remote_addr=b.mr.addr + 3_000_000, rkey=b.mr.rkey),
                    SendWR(wr_id=3, opcode=WROpcode.ATOMIC_FETCH_AND_ADD, sg_list=[a.sge(600_000, 8)],
                           remote_addr=b.mr.addr + 3_000_008, rkey=b.mr.rkey, compare_add=1)])
    for _ in range(3):
        a.ctx.progress()
    assert int(a.qp.row[L.Q_SQ_NEXT]) == 3                 # all three went out before B ran
    wcs = collect(a, 3, [b])
    assert [(w.wr_id, w.status) for w in wcs] == [(1, WCStatus.SUCCESS), (2, WCStatus.SUCCESS), (3, WCStatus.SUCCESS)]
    assert (a.buf[:65536] == old).all()
    new = a.buf[500_000:565_536]
    assert u64(a.buf, 600_000) == u64(new, 8)                # the ATOMIC came after the WRITE
    assert (b.buf[3_000_000:3_000_008] == new[:8]).all() and u64(b.buf, 3_000_008) == (u64(new, 8) + 1) % (1 << 64)
    assert (b.buf[3_000_016:3_065_536] == new[16:]).all()


def test_wire_bytes_of_atomics_invalidate_and_gathers_parse_strictly(make_fabric):
    """The wire bytes: the ATOMIC, ATOMIC ACKNOWLEDGE, SEND WITH INVALIDATE, gathered and scattered packets
    the compiled plane sends, both ways between two of its endpoints (compat RoCEv2, through the real XDP
    program on each side), are captured on the switch port before B and each one is decoded by the strict
    parser (metaroce_xdp.wire.decode: lengths, pad, extension headers, ICRC): the headers carry what the
    work requests asked for (MR-XH-*), and the operations complete with the memory they must leave."""
    from metaroce_xdp.wire import Op, decode
    from wire_players import PortTap, is_roce_v4
    topo, a, b = make_fabric()
    connected(a, b, seeds=(5, 6))                                   # path MTU 1024
    for s in (a, b):
        s.buf[8192:8208] = 0
    tap = None
    try:
        inv_a = a.pd.reg_mr(np.zeros(64, np.uint8), Access.LOCAL_WRITE | Access.REMOTE_WRITE, remote_invalidate=True)
        inv_b = b.pd.reg_mr(np.zeros(64, np.uint8), Access.LOCAL_WRITE | Access.REMOTE_WRITE, remote_invalidate=True)
        tap = PortTap(topo, topo[1], "swB")
        for src, dst, inv in ((a, b, inv_b), (b, a, inv_a)):        # A -> B, then B -> A
            tap.frames()                                            # what went before
            dst.qp.post_recv(RecvWR(wr_id=50, sg_list=[dst.sge(100_000, 1500), dst.sge(200_000, 5000)]))
            wrs = [SendWR(wr_id=1, opcode=WROpcode.ATOMIC_FETCH_AND_ADD, sg_list=[src.sge(0, 8)],
                          remote_addr=dst.mr.addr + 8192, rkey=dst.mr.rkey, compare_add=3),
                   SendWR(wr_id=2, opcode=WROpcode.ATOMIC_CMP_AND_SWP, sg_list=[src.sge(8, 4), src.sge(16, 4)],
                          remote_addr=dst.mr.addr + 8192, rkey=dst.mr.rkey, compare_add=3, swap=0xAABBCCDD11223344),
                   SendWR(wr_id=3, opcode=WROpcode.SEND_WITH_INV, sg_list=[src.sge(300_000, 1000), src.sge(400_000, 2500)],
                          invalidate_rkey=inv.rkey, send_flags=SendFlags.SIGNALED | SendFlags.SOLICITED),
                   SendWR(wr_id=4, opcode=WROpcode.RDMA_READ, sg_list=[src.sge(500_000, 3000), src.sge(600_000, 100)],
                          remote_addr=dst.mr.addr + 700_000, rkey=dst.mr.rkey, send_flags=SendFlags.SIGNALED | SendFlags.FENCE)]
            msg = np.concatenate([src.buf[300_000:301_000], src.buf[400_000:402_500]])
            rd = dst.buf[700_000:703_100].copy()
            src.qp.post_send(wrs)
            wcs = collect(src, 4, [dst])
            assert [(w.wr_id, w.status, w.byte_len) for w in wcs] == [
                (1, WCStatus.SUCCESS, 8), (2, WCStatus.SUCCESS, 8), (3, WCStatus.SUCCESS, 3500),
                (4, WCStatus.SUCCESS, 3100)], src.ctx
            (r,) = collect(dst, 1, [src])
            assert (r.wr_id, r.status, r.byte_len, r.invalidated_rkey) == (50, WCStatus.SUCCESS, 3500, inv.rkey)
            assert r.wc_flags & WCFlags.WITH_INV
            assert u64(src.buf, 0) == 0 and bytes(src.buf[8:12]) + bytes(src.buf[16:20]) == struct.pack("<Q", 3)
            assert u64(dst.buf, 8192) == 0xAABBCCDD11223344
            assert (np.concatenate([dst.buf[100_000:101_500], dst.buf[200_000:202_000]]) == msg).all()
            assert (src.buf[500_000:503_000] == rd[:3000]).all() and (src.buf[600_000:600_100] == rd[3000:]).all()

            time.sleep(0.05)                                        # the last frames reach the tap
            pkts = [decode(f) for f in tap.frames(is_roce_v4)]      # raises on any malformed frame
            assert pkts and all(p.icrc_ok for p in pkts)
            req = [p for p in pkts if p.bth.dest_qp == dst.qp.qp_num]
            rsp = [p for p in pkts if p.bth.dest_qp == src.qp.qp_num]
            seen = []                                               # each PSN once (no loss here)
            for p in req:
                if p.bth.psn not in [q.bth.psn for q in seen]:
                    seen.append(p)
            assert [Op(p.bth.opcode) for p in seen] == [
                Op.FETCH_ADD, Op.COMPARE_SWAP, Op.SEND_FIRST, Op.SEND_MIDDLE, Op.SEND_MIDDLE,
                Op.SEND_LAST_WITH_INVALIDATE, Op.RDMA_READ_REQUEST]
            fa, cs, *send, rr = seen
            assert (fa.atomiceth.va, fa.atomiceth.rkey, fa.atomiceth.swap_add) == (dst.mr.addr + 8192, dst.mr.rkey, 3)
            assert (cs.atomiceth.va, cs.atomiceth.rkey, cs.atomiceth.compare, cs.atomiceth.swap_add) == \
                (dst.mr.addr + 8192, dst.mr.rkey, 3, 0xAABBCCDD11223344)
            assert [len(p.payload) for p in send] == [1024, 1024, 1024, 428]
            assert b"".join(p.payload for p in send) == msg.tobytes()           # the gathered message
            assert send[-1].ieth.rkey == inv.rkey and send[-1].bth.se == 1       # IETH and SOLICITED on the last
            assert (rr.reth.va, rr.reth.rkey, rr.reth.dma_len) == (dst.mr.addr + 700_000, dst.mr.rkey, 3100)
            acks = [p for p in rsp if p.bth.opcode == Op.ATOMIC_ACKNOWLEDGE]
            assert sorted({(p.bth.psn, p.atomicacketh.orig) for p in acks}) == [(fa.bth.psn, 0), (cs.bth.psn, 3)]
            rresp = {p.bth.psn: p for p in rsp if Op.RDMA_READ_RESPONSE_FIRST <= p.bth.opcode
                     <= Op.RDMA_READ_RESPONSE_ONLY}
            assert sorted(rresp) == [(rr.bth.psn + k) & 0xFFFFFF for k in range(4)]
            assert b"".join(rresp[(rr.bth.psn + k) & 0xFFFFFF].payload for k in range(4)) == rd.tobytes()
        inv_a.dereg()
        inv_b.dereg()
    finally:
        if tap is not None:
            tap.close()


def test_comm_est_when_rtr_accepts_the_first_request(pair):
    """MR-QP-021: a QP still in RTR that accepts a request raises COMM_EST once."""
    a, b = pair
    qb = b.ctx.create_qp(b.pd, b.cq, b.cq)
    qa = a.ctx.create_qp(a.pd, a.cq, a.cq)
    try:
        with b.topo.enter(b.ns):
            qb.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
            qb.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=qa.qp_num, rq_psn=0, path_mtu=1024, dgid=a.ctx.gid))
        with a.topo.enter(a.ns):
            qa.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
            qa.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=qb.qp_num, rq_psn=0, path_mtu=1024, dgid=b.ctx.gid))
            qa.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0))
        assert b.ctx.get_async_event(0.05) is None
        qa.post_send([SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 100)], remote_addr=b.mr.addr,
                             rkey=b.mr.rkey) for i in range(3)])
        assert [w.status for w in collect(a, 3, [b])] == [WCStatus.SUCCESS] * 3
        ev = b.ctx.get_async_event(1.0)
        assert ev is not None and ev.event_type == EventType.COMM_EST and ev.qp is qb
        assert b.ctx.get_async_event(0.05) is None                     # once
    finally:
        a.ctx.destroy_qp(qa)
        b.ctx.destroy_qp(qb)
