"""The compiled data plane's thread model and its overflow and memory rules, over veth with the XDP program:
a progress thread per endpoint that sleeps in poll() (AF_XDP socket + eventfd) when idle and is woken by a
post or a packet; a full CQ puts the QP in ERR with CQ_ERR raised, nothing grows; a deregistered MR is
never touched again (the valid bit is checked on every access)."""
from __future__ import annotations

import contextlib
import time
from collections import Counter

import numpy as np
import pytest

from dp_players import FULL, collect, connected
from metaroce_xdp.dp import layout as L
from metaroce_xdp.verbs_types import EventType
from metaroce_xdp.verbs_types import SGE, QPAttr, QPState, RecvWR, SendWR, WCStatus, WROpcode

pytestmark = [pytest.mark.netns, pytest.mark.fabric("flat")]


def _fresh(a, b):
    connected(a, b, seeds=(3,))                 # B's buffer as the last test left it


def test_progress_threads_sleep_and_are_woken_by_posts_and_packets(fabric):
    topo, a, b = fabric
    _fresh(a, b)
    for s in (a, b):
        s.ctx.plane.start(busy=False)
    try:
        deadline = time.monotonic() + 5                   # both loops go to sleep in poll()
        while not all(s.ctx.plane.A[L.P_SLEEPING] for s in (a, b)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(s.ctx.plane.A[L.P_SLEEPING] for s in (a, b))
        w0 = a.ctx.stats()["wakeups"], b.ctx.stats()["wakeups"]
        b.qp.post_recv(RecvWR(wr_id=5, sg_list=[b.sge(0, 4096)]))
        for i in range(20):                               # each post wakes A's loop, each packet B's
            a.qp.post_send(SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(i * 5000, 5000)],
                                  remote_addr=b.mr.addr + 100_000 + i * 5000, rkey=b.mr.rkey))
            assert a.cq.wait(1, timeout=5)[0].status == WCStatus.SUCCESS
            time.sleep(0.002)
        a.qp.post_send(SendWR(wr_id=99, opcode=WROpcode.SEND, sg_list=[a.sge(0, 300)]))
        assert a.cq.wait(1, timeout=5)[0].wr_id == 99
        w = b.cq.wait(1, timeout=5)[0]
        assert (w.wr_id, w.byte_len) == (5, 300)
        assert (b.buf[100_000:200_000] == a.buf[:100_000]).all() and (b.buf[:300] == a.buf[:300]).all()
        assert a.ctx.stats()["wakeups"] > w0[0] and b.ctx.stats()["wakeups"] > w0[1]
    finally:
        for s in (a, b):
            s.ctx.plane.stop()


def test_cq_overflow_puts_the_qp_in_err_and_raises_cq_err(fabric):
    topo, a, b = fabric
    _fresh(a, b)
    small = a.ctx.create_cq(4)
    qp = a.ctx.create_qp(a.pd, small, small)
    peer = b.ctx.create_qp(b.pd, b.cq, b.cq)
    with topo.enter(a.ns):
        qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
        qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=peer.qp_num, rq_psn=7, dgid=b.ctx.gid))
        qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=9))
    with topo.enter(b.ns):
        peer.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
        peer.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=qp.qp_num, rq_psn=9, dgid=a.ctx.gid))
        peer.modify(QPAttr(qp_state=QPState.RTS, sq_psn=7))
    qp.post_send([SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 8)], remote_addr=b.mr.addr,
                         rkey=b.mr.rkey) for i in range(8)])
    evs = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(e.event_type == EventType.CQ_ERR for e in evs):
        a.ctx.progress(), b.ctx.progress()
        ev = a.ctx.get_async_event(0)
        if ev is not None:
            evs.append(ev)
    assert any(e.event_type == EventType.CQ_ERR for e in evs)
    assert qp.query_state() == QPState.ERR
    got = small.poll(16)
    assert len(got) == 4 and [w.wr_id for w in got] == [0, 1, 2, 3]   # the CQ never held more than its depth
    a.ctx.destroy_qp(qp)
    b.ctx.destroy_qp(peer)


def test_deregistered_mr_is_never_touched(fabric):
    topo, a, b = fabric
    _fresh(a, b)
    target = np.full(1 << 16, 0x5A, np.uint8)
    mr = b.pd.reg_mr(target, b.mr.access)
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 4000)], remote_addr=mr.addr,
                          rkey=mr.rkey))
    assert collect(a, 1, [b])[0].status == WCStatus.SUCCESS
    assert (target[:4000] == a.buf[:4000]).all()
    b.ctx.dereg_mr(mr)
    target[:] = 0x5A
    a.qp.post_send(SendWR(wr_id=2, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 40_000)], remote_addr=mr.addr,
                          rkey=mr.rkey))
    a.qp.post_send(SendWR(wr_id=3, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(100_000, 100)], remote_addr=mr.addr,
                          rkey=mr.rkey))
    got = collect(a, 2, [b])
    assert [(w.wr_id, w.status) for w in got] == [(2, WCStatus.REM_ACCESS_ERR), (3, WCStatus.WR_FLUSH_ERR)]
    assert (target == 0x5A).all()


def test_mr_deregistered_in_the_middle_of_a_read_stream(fabric):
    """MR-MEM-033: the rest of the stream is not sent; the NAK names the READ's PSN, which the kernel accepts
    though responses of that READ were placed (nak_read_psn published), and the READ fails REM_ACCESS_ERR."""
    topo, a, b = fabric
    _fresh(a, b)
    target = np.full(1 << 20, 7, np.uint8)
    mr = b.pd.reg_mr(target, b.mr.access)
    a.buf[:1 << 20] = 0
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(0, 1 << 20)], remote_addr=mr.addr,
                          rkey=mr.rkey))
    a.ctx.progress()                                      # the READ request leaves
    deadline = time.monotonic() + 5
    tx0 = b.ctx.stats()["tx"]
    while b.ctx.stats()["tx"] == tx0 and time.monotonic() < deadline:
        b.ctx.progress()                                  # B answers with one round of responses
    sent, naks_sent = b.ctx.stats()["tx"], b.ctx.stats()["tx_nak"]
    assert 0 < sent - tx0 < 1024
    b.ctx.dereg_mr(mr)
    naks0 = a.ctx.loader.events()["NAK_CONSUMED"]
    w = collect(a, 1, [b])[0]
    assert (w.wr_id, w.status) == (1, WCStatus.REM_ACCESS_ERR)
    assert b.ctx.stats()["tx"] == sent + 1 and b.ctx.stats()["tx_nak"] == naks_sent + 1   # the NAK, nothing more
    assert a.ctx.loader.events()["NAK_CONSUMED"] == naks0 + 1
    placed = int((a.buf[:1 << 20] == 7).sum())
    assert 0 < placed <= (sent - tx0) * 1024


def test_many_qps_all_carrying_traffic_at_once(fabric):
    """1,000 QP pairs, a WRITE and a READ on every one and a WRITE back from B, posted at once: every completion
    arrives and every byte is right; afterwards the active lists are empty again."""
    topo, a, b = fabric
    from metaroce_xdp.verbs_types import QPCap
    n = 1000
    a.buf[:] = np.random.default_rng(8).integers(0, 256, a.buf.size, dtype=np.uint8)
    b.buf[:] = np.random.default_rng(9).integers(0, 256, b.buf.size, dtype=np.uint8)
    ref_a, ref_b = a.buf.copy(), b.buf.copy()
    qa = [a.ctx.create_qp(a.pd, a.cq, a.cq, QPCap(max_send_wr=4, max_recv_wr=4)) for _ in range(n)]
    qb = [b.ctx.create_qp(b.pd, b.cq, b.cq, QPCap(max_send_wr=4, max_recv_wr=4)) for _ in range(n)]
    for mine, theirs, me, peer in ((qa, qb, a, b), (qb, qa, b, a)):
        with topo.enter(me.ns):
            for q, p in zip(mine, theirs):
                q.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
                q.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=p.qp_num, rq_psn=0x10, dgid=peer.ctx.gid))
                q.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0x10))
    sz = 1300                                             # two packets each; 1000 x 3 x 1300 B fit 4 MiB
    for i in range(n):
        o = i * 3 * sz
        qa[i].post_send([SendWR(wr_id=2 * i, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(o, sz)],
                                remote_addr=b.mr.addr + o, rkey=b.mr.rkey),
                         SendWR(wr_id=2 * i + 1, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(o + sz, sz)],
                                remote_addr=b.mr.addr + o + sz, rkey=b.mr.rkey)])
        qb[i].post_send(SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE, sg_list=[b.sge(o + 2 * sz, sz)],
                               remote_addr=a.mr.addr + o + 2 * sz, rkey=a.mr.rkey))
    got_a = collect(a, 2 * n, [b], timeout=60)
    got_b = collect(b, n, [a], timeout=60)
    assert all(w.status == WCStatus.SUCCESS for w in got_a + got_b), Counter(w.status.name for w in got_a + got_b)
    assert sorted(w.wr_id for w in got_a) == list(range(2 * n)) and sorted(w.wr_id for w in got_b) == list(range(n))
    for i in range(n):
        o = i * 3 * sz
        assert (b.buf[o:o + sz] == ref_a[o:o + sz]).all()
        assert (a.buf[o + sz:o + 2 * sz] == ref_b[o + sz:o + 2 * sz]).all()
        assert (a.buf[o + 2 * sz:o + 3 * sz] == ref_b[o + 2 * sz:o + 3 * sz]).all()
    for _ in range(3):
        a.ctx.progress(), b.ctx.progress()
    assert a.ctx.plane.A[L.P_N_ACT] == 0 and b.ctx.plane.A[L.P_N_ACT] == 0
    for q in qa:
        a.ctx.destroy_qp(q)
    for q in qb:
        b.ctx.destroy_qp(q)


@contextlib.contextmanager
def _small_pairs(topo, a, b, n):
    """n QP pairs of two WRs each, connected (PSN 0x10, local ACK timeout 16: 268 ms, 7 retries); every QP
    destroyed on the way out, also when the test failed (the module's fabric is shared: QPs left behind
    with expired timers would take the next test's TO_PER_ROUND)."""
    from metaroce_xdp.verbs_types import QPCap
    qa = [a.ctx.create_qp(a.pd, a.cq, a.cq, QPCap(max_send_wr=2, max_recv_wr=2)) for _ in range(n)]
    qb = [b.ctx.create_qp(b.pd, b.cq, b.cq, QPCap(max_send_wr=2, max_recv_wr=2)) for _ in range(n)]
    try:
        for mine, theirs, me, peer in ((qa, qb, a, b), (qb, qa, b, a)):
            with topo.enter(me.ns):
                for q, p in zip(mine, theirs):
                    q.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
                    q.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=p.qp_num, rq_psn=0x10,
                                    dgid=peer.ctx.gid))
                    q.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0x10, timeout=16, retry_cnt=7))
        yield qa, qb
    finally:
        for s, qs in ((a, qa), (b, qb)):
            for q in qs:
                s.ctx.destroy_qp(q)
        for s in (a, b):
            while s.cq.poll(64):                          # their completions and flushes, not the next test's
                pass


def _all_complete_intact(a, b, qa, qb):
    """Each QP of qa's one 64-byte WRITE completes SUCCESS, the bytes at B."""
    n = len(qa)
    got = collect(a, n, [b], timeout=60)
    assert all(w.status == WCStatus.SUCCESS for w in got), Counter(w.status.name for w in got)
    assert (b.buf[:64 * n] == a.buf[:64 * n]).all()


def test_local_ack_timers_armed_together_expire_spread_and_paced(fabric):
    """MR-RETRY-001..004 with many QPs: timers started in the same round expire between T and 1.25 T, each QP
    at its own instant (a per-QP jitter), and when many have expired anyway (here: the peer's loop stood
    still for longer than 1.25 T) at most TO_PER_ROUND of them go back N per round, none losing a retry by
    waiting; then every WRITE completes.  (A mass expiry retransmitting on all QPs in one round overflowed
    the peer's fill ring again and again until RETRY_EXC_ERR: the 1,000-QP test above under CPU load.)"""
    from metaroce_xdp.dp.round import TO_PER_ROUND
    topo, a, b = fabric
    n = 3 * TO_PER_ROUND + 8
    t = 4096 << 16                                        # T at timeout 16: 268 ms
    with _small_pairs(topo, a, b, n) as (qa, qb):
        a.buf[:64 * n] = np.arange(64 * n, dtype=np.uint8)
        for i, q in enumerate(qa):
            q.post_send(SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(64 * i, 64)],
                               remote_addr=b.mr.addr + 64 * i, rkey=b.mr.rkey))
        A = a.ctx.plane.A
        a.ctx.progress()                                  # one round sends a packet on every QP; B stands still
        assert all(q.query()["snd_max"] == 0x11 for q in qa)
        now = int(A[L.P_NOW])
        due = np.array([int(q.row[L.Q_DEADLINE]) - now for q in qa])
        assert (due >= t).all() and (due < t + t // 4).all(), (due.min(), due.max())
        assert len(set(due.tolist())) > n * 9 // 10       # not one instant for all
        while time.monotonic_ns() <= now + int(due.max()):
            time.sleep(0.01)
        fired = []
        t0 = time.monotonic_ns()
        for _ in range(4):
            a.ctx.progress()                              # a QP that went back N has spent a retry
            # (<= 6: on a loaded host the four rounds may outlast T, and the first go-back-Ns expire again)
            fired.append(sum(q.query()["retry_left"] <= 6 for q in qa) - sum(fired))
        spent = (time.monotonic_ns() - t0) // t           # how many more expiries the wait allowed
        assert fired == [TO_PER_ROUND, TO_PER_ROUND, TO_PER_ROUND, 8]
        left = [q.query()["retry_left"] for q in qa]
        assert max(left) == 6 and min(left) >= 6 - spent, (sorted(Counter(left).items()), spent)
        _all_complete_intact(a, b, qa, qb)                # none lost a retry to the wait


def test_expired_local_ack_timers_go_back_n_oldest_first(fabric):
    """MR-RETRY-001/003 with TO_PER_ROUND: when more timers have expired than one round may act on, the
    oldest deadlines go first, wherever their QPs sit in the active list.  The loop walks that list from
    its end, and used to hand the round's budget out in that order: a QP near the start of the list (the
    first packets of a burst activate their QPs first) waited for as long as more than TO_PER_ROUND others
    kept expiring, and its peer ran out of retries meanwhile (the 1,000-QP test above beside CPU hogs:
    the last 30 QP pairs failed RETRY_EXC_ERR, B's timer for the WRITE overdue by more than a second).
    Here every QP has an expired timer, the oldest at the start of the list: each round starts
    go-back-N on exactly the TO_PER_ROUND oldest, in deadline order; then every WRITE completes."""
    from metaroce_xdp.dp.round import TO_PER_ROUND
    topo, a, b = fabric
    n = 2 * TO_PER_ROUND + 8
    with _small_pairs(topo, a, b, n) as (qa, qb):
        a.buf[:64 * n] = np.arange(64 * n, dtype=np.uint8)
        for i, q in enumerate(qa):
            q.post_send(SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(64 * i, 64)],
                               remote_addr=b.mr.addr + 64 * i, rkey=b.mr.rkey))
        A = a.ctx.plane.A
        a.ctx.progress()                                  # a packet on every QP; B stands still
        assert all(q.query()["snd_max"] == 0x11 for q in qa)
        act = int(A[L.P_ACT_OFF])
        order = [int(x) for x in A[act:act + int(A[L.P_N_ACT])]]
        by_qi = {q.qi: q for q in qa}
        walk = [by_qi[qi] for qi in order if qi in by_qi]     # list order; the loop walks it from the end
        assert len(walk) == n
        now = time.monotonic_ns()
        for k, q in enumerate(walk):                      # expired a second ago and more: oldest at the start
            q.row[L.Q_DEADLINE] = now - 1_000_000_000 - (n - k) * 1_000_000
        fired = []
        for _ in range(4):
            a.ctx.progress()                              # a QP that went back N has spent a retry
            fired.append([k for k, q in enumerate(walk) if q.query()["retry_left"] <= 6 and
                          all(k not in f for f in fired)])
        assert fired == [list(range(0, TO_PER_ROUND)), list(range(TO_PER_ROUND, 2 * TO_PER_ROUND)),
                         list(range(2 * TO_PER_ROUND, n)), []]
        _all_complete_intact(a, b, qa, qb)


@pytest.mark.parametrize("op", [WROpcode.RDMA_WRITE, WROpcode.RDMA_READ])
def test_local_mr_deregistered_under_a_posted_wr(fabric, op):
    """MR-MEM-035: a work request whose local MR is deregistered before it runs fails LOC_PROT_ERR; its memory
    is neither read nor written (the loop checks the MR's valid bit, not only the post)."""
    topo, a, b = fabric
    _fresh(a, b)
    local = np.full(8192, 3, np.uint8)
    lmr = a.pd.reg_mr(local, FULL)
    b.buf[:8192] = 9
    a.qp.post_send(SendWR(wr_id=1, opcode=op, sg_list=[SGE(lmr.addr, 8192, lmr.lkey)], remote_addr=b.mr.addr,
                          rkey=b.mr.rkey))
    a.ctx.dereg_mr(lmr)
    w = collect(a, 1, [b])[0]
    assert (w.wr_id, w.status) == (1, WCStatus.LOC_PROT_ERR)
    assert (local == 3).all() and (b.buf[:8192] == 9).all()
    assert a.qp.query_state() == QPState.ERR
