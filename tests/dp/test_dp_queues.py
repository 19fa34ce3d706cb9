"""Several RX queues through the compiled data plane: one AF_XDP socket and one progress loop (thread) per
queue, QPs spread over them.

Two namespaces joined by a veth with 2 RX and 2 TX queues on each end; each endpoint opens
`Context.open(queues=2, progress_thread=True)`.  On veth a frame arrives on the queue the peer sent it
from, and an AF_XDP socket only receives from its own queue, so a QP is bound at RTR to the queue both
ends compute from the two QPNs (QP._bind_queue): QP pairs created in step alternate over the queues.
Checked: QPs on both queues, WRITE, SEND and READ on every pair (both directions on the wire) with the
bytes verified, both loops of both hosts received and sent, no frame reached a queue whose loop does not
own its QP, and the XDP program consumed the ACKs of both queues.  Twice: with a progress thread per
queue at MTU 1500, and without threads (the application's polls run each queue's loop in turn) at MTU
9000 and path MTU 4096 (multi-buffer sockets on both queues); and on the native profile (threads, MTU
1500), whose SACKs the XDP program hands each queue's loop through the mr_sacks rings."""
from __future__ import annotations

import pytest

from dp_players import collect, to_rts
from metaroce_xdp.verbs_types import RecvWR, SendWR, WCStatus, WROpcode

pytestmark = pytest.mark.netns

NPAIRS = 4
REGION = 1 << 20            # per pair: WRITE 256 KiB, SEND 64 KiB, READ 128 KiB


def _connect(side, qp, peer_qp, peer_gid, pmtu, profile):
    with side.topo.enter(side.ns):
        to_rts(qp, peer_qp.qp_num, peer_gid, mtu=pmtu, rq_psn=0x200, sq_psn=0x200, timeout=14, rd_atomic=16,
               profile=profile)


@pytest.mark.parametrize("mtu,pmtu,threads,profile", [(1500, 1024, True, "compat"), (9000, 4096, False, "compat"),
                                                     (1500, 1024, True, "native")])
def test_two_rx_queues_one_loop_each_qps_spread_and_verified(make_fabric, mtu, pmtu, threads, profile):
    _, a, b = make_fabric("flat", mtu=mtu, veth_queues=2, queues=2, progress_thread=threads, busy_poll=False)
    assert len(a.ctx.plane.group) == 2
    assert all(p.threaded == threads for p in a.ctx.plane.group + b.ctx.plane.group)
    a.fill(31)
    b.fill(32)
    pairs = []
    for _ in range(NPAIRS):                      # created in step on both hosts
        qa = a.ctx.create_qp(a.pd, a.cq, a.cq)
        qb = b.ctx.create_qp(b.pd, b.cq, b.cq)
        _connect(a, qa, qb, b.ctx.gid, pmtu, profile)
        _connect(b, qb, qa, a.ctx.gid, pmtu, profile)
        assert qa.queue == qb.queue              # both ends of a connection on the same queue
        assert qa.query()["profile"] == qb.query()["profile"] == profile
        pairs.append((qa, qb))
    assert sorted(qa.queue for qa, _ in pairs) == [0, 0, 1, 1]
    acks0 = a.ctx.loader.events()["ACK_CONSUMED"]
    for k, (qa, qb) in enumerate(pairs):
        base = k * REGION
        w, s, r = base, base + (256 << 10), base + (512 << 10)
        qb.post_recv(RecvWR(wr_id=100 + k, sg_list=[b.sge(s, 64 << 10)]))
        qa.post_send([SendWR(wr_id=3 * k, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(w, 256 << 10)],
                             remote_addr=b.mr.addr + w, rkey=b.mr.rkey),
                      SendWR(wr_id=3 * k + 1, opcode=WROpcode.SEND, sg_list=[a.sge(s, 64 << 10)]),
                      SendWR(wr_id=3 * k + 2, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(r, 128 << 10)],
                             remote_addr=b.mr.addr + r, rkey=b.mr.rkey)])
    if threads:
        got = a.cq.wait(3 * NPAIRS, timeout=30)
        rcv = b.cq.wait(NPAIRS, timeout=10)
    else:
        got = collect(a, 3 * NPAIRS, [b], timeout=30)     # progress() runs a round of each queue's loop
        rcv = collect(b, NPAIRS, [a], timeout=10)
    assert sorted((w.wr_id, w.status) for w in got) == [(i, WCStatus.SUCCESS) for i in range(3 * NPAIRS)]
    assert sorted((w.wr_id, w.status, w.byte_len) for w in rcv) == [
        (100 + k, WCStatus.SUCCESS, 64 << 10) for k in range(NPAIRS)]
    for k in range(NPAIRS):
        for lo, n in ((0, 256 << 10), (256 << 10, 64 << 10), (512 << 10, 128 << 10)):   # WRITE, SEND, READ
            lo += k * REGION
            assert (a.buf[lo:lo + n] == b.buf[lo:lo + n]).all(), (k, lo)
        gap = slice(k * REGION + (320 << 10), k * REGION + (512 << 10))
        assert (a.buf[gap] != b.buf[gap]).any()              # untouched: the two random fills differ
    # per QP, its completions came in order (each queue's loop fills its own ring of the CQ)
    for k in range(NPAIRS):
        assert [w.wr_id for w in got if w.wr_id // 3 == k] == [3 * k, 3 * k + 1, 3 * k + 2]
    for side in (a, b):
        qs = side.ctx.plane.queue_stats()
        assert len(qs) == 2
        for i, st in enumerate(qs):
            assert st["rx"] > 0 and st["tx"] > 0 and st["rounds"] > 0, (side.ns, i, qs)
            assert st["rx_wrong_q"] == 0 and st["rx_drop_qp"] == 0, (side.ns, i, qs)
        assert side.ctx.stats()["rx"] == qs[0]["rx"] + qs[1]["rx"]
        if pmtu == 4096:
            assert all(st["rx_sg"] > 0 for st in qs), (side.ns, qs)       # multi-buffer on both queues
    if profile == "compat":
        assert a.ctx.loader.events()["ACK_CONSUMED"] > acks0
    else:                       # the XDP program put the native SACKs of both queues in mr_sacks rings
        assert all(st["rx_sack_kern"] > 0 for st in a.ctx.plane.queue_stats()), a.ctx.plane.queue_stats()
