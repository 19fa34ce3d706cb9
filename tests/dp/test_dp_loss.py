"""The compiled data plane under loss (metaroce_xdp.faults on a switch namespace between the hosts):
one sequence-error NAK per gap and go-back-N, seeded loss/duplication/corruption/reordering with every
operation completing intact and in order, retry exhaustion -> RETRY_EXC_ERR and flushed work."""
from __future__ import annotations


import numpy as np
import pytest

from dp_players import collect, connected
from metaroce_xdp.verbs_types import QPState, RecvWR, SendWR, WCOpcode, WCStatus, WROpcode

pytestmark = pytest.mark.netns


def _fresh(a, b, **kw):
    connected(a, b, seeds=(11, None), **kw)


def test_one_sequence_nak_per_gap_and_go_back_n(fabric):
    topo, a, b = fabric
    _fresh(a, b)
    with fabric.impair("b", psn_drop_once=[0x100 + 5]):
        a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 20 * 1024)],
                              remote_addr=b.mr.addr, rkey=b.mr.rkey))
        w = collect(a, 1, [b])[0]
    assert (w.wr_id, w.status, w.byte_len) == (1, WCStatus.SUCCESS, 20 * 1024)
    assert (b.buf[:20 * 1024] == a.buf[:20 * 1024]).all()
    sb, sa = b.ctx.stats(), a.ctx.stats()
    assert sb["tx_nak"] == 1 and sb["rx_oos"] >= 1          # one NAK for the gap, the rest discarded
    assert sa["naks_seen"] == 1 and sa["retransmits"] >= 1   # consumed by the kernel, then go back N
    assert a.ctx.loader.events()["NAK_CONSUMED"] >= 1
    # and per QP (metaroced's qp show): this QP pair's own counts, the port's being those of this pair alone
    from metaroce_xdp.dp import layout as L
    assert int(b.qp.row[L.Q_N_NAKS_TX]) == 1 and int(a.qp.row[L.Q_N_RETX]) == sa["retransmits"]


def test_seeded_faults_every_operation_completes_intact(fabric):
    topo, a, b = fabric
    _fresh(a, b, timeout=12)
    rng = np.random.default_rng(5)
    wrs, checks, recvs = [], [], 0
    off = 0
    for i in range(36):
        n = int(rng.choice([1, 8, 1000, 1024, 1025, 4096, 30_000, 65_536]))
        kind = i % 3
        src, dst = off, 2_000_000 + off
        off += n + 64
        if kind == 0:
            wrs.append(SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(src, n)],
                              remote_addr=b.mr.addr + dst, rkey=b.mr.rkey))
            checks.append(("w", src, dst, n))
        elif kind == 1:
            b.qp.post_recv(RecvWR(wr_id=1000 + i, sg_list=[b.sge(dst, n)]))
            recvs += 1
            wrs.append(SendWR(wr_id=i, opcode=WROpcode.SEND, sg_list=[a.sge(src, n)]))
            checks.append(("w", src, dst, n))
        else:
            b.buf[dst:dst + n] = rng.integers(0, 256, n, dtype=np.uint8)
            wrs.append(SendWR(wr_id=i, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(src, n)],
                              remote_addr=b.mr.addr + dst, rkey=b.mr.rkey))
            checks.append(("r", src, dst, n))
    knobs = dict(drop_ppm=20_000, dup_ppm=10_000, corrupt_ppm=10_000, reorder_ppm=10_000, reorder_delay_us=500)
    with fabric.impair("b", seed=3, **knobs) as fb, \
            fabric.impair("a", seed=4, **knobs) as fa:
        a.qp.post_send(wrs)
        got = collect(a, len(wrs), [b], timeout=60)
        rcv = collect(b, recvs, [a], timeout=10)
        hit = sum(f.stats()[k] for f in (fa, fb) for k in ("dropped", "duplicated", "corrupted"))
    assert [(w.wr_id, w.status) for w in got] == [(w.wr_id, WCStatus.SUCCESS) for w in wrs]
    assert all(w.status == WCStatus.SUCCESS and w.opcode == WCOpcode.RECV for w in rcv)
    for kind, src, dst, n in checks:
        assert (a.buf[src:src + n] == b.buf[dst:dst + n]).all(), (kind, src, dst, n)
    assert hit > 0
    st = a.ctx.stats()
    assert st["retransmits"] >= 1
    assert b.ctx.stats()["rx_drop_icrc"] + a.ctx.stats()["rx_drop_icrc"] + sum(
        s.ctx.loader.drops().get("BAD_ICRC", 0) for s in (a, b)) >= 1


def test_retry_exhaustion_fails_the_head_and_flushes_the_rest(fabric):
    topo, a, b = fabric
    _fresh(a, b, timeout=8, retry_cnt=2)
    with fabric.impair("b", drop_ppm=1_000_000):
        a.qp.post_send([SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 3000)],
                               remote_addr=b.mr.addr, rkey=b.mr.rkey),
                        SendWR(wr_id=2, opcode=WROpcode.SEND, sg_list=[a.sge(0, 10)])])
        got = collect(a, 2, [b], timeout=10)
    assert [(w.wr_id, w.status, w.opcode) for w in got] == [(1, WCStatus.RETRY_EXC_ERR, WCOpcode.RDMA_WRITE),
                                                             (2, WCStatus.WR_FLUSH_ERR, WCOpcode.SEND)]
    assert a.qp.query_state() == QPState.ERR and "retries exhausted" in a.qp.query()["error"]
    assert a.ctx.stats()["timeouts"] >= 3                  # the first send + retry_cnt retries
    ev = a.ctx.get_async_event(1.0)
    assert ev is not None and "retries exhausted" in ev.reason
    # posting to a QP in ERR completes with WR_FLUSH_ERR at once
    a.qp.post_send(SendWR(wr_id=3, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 8)], remote_addr=b.mr.addr,
                          rkey=b.mr.rkey))
    assert [(w.wr_id, w.status) for w in collect(a, 1, [b])] == [(3, WCStatus.WR_FLUSH_ERR)]
