"""Every RX queue, correct under RSS: one QP's packets spread over all of the receiver's queues.

A NIC's RSS hashes each flow to one of its RX queues, and the native profile's multipath spraying varies
the UDP source port, so one QP's packets arrive on every queue.  Context.open binds an AF_XDP socket to
every RX queue of the interface by default (all on one UMEM, XDP_SHARED_UMEM), and one loop serves
them all: a frame's QP is found from its BTH whatever queue it came on.

Hosts A and B in two subnets behind a router (routed_hosts), every veth end with 4 RX and TX queues.  The
router's egress ports carry a fault injector that does nothing but spread (faults.FaultInjector
spread_queues=4): consecutive MetaRoCE frames leave on TX queues 0, 1, 2, 3 in turn, and on veth a frame
is received on the RX queue of the number it was sent from -- so every QP's requests, responses, ACKs and
SACKs reach the other host on all four queues.  Checked, compat and native, and at path MTU 4096
(multi-buffer sockets on every queue): WRITE, SEND and READ on every QP pair with the bytes verified,
every queue of both hosts received frames, the XDP program dropped none as NO_XSK (a queue without a
socket) and the plane none as for an unknown QP, the kernel consumed ACKs (compat) or put SACKs in the
mr_sacks rings (native) arriving on several queues, and the UMEM frame account of each host balances."""
from __future__ import annotations

import pytest

from metaroce_xdp.dp import layout as L
from metaroce_xdp.faults import FaultInjector
from metaroce_xdp.verbs_types import RecvWR, SendWR, WCStatus, WROpcode

pytestmark = pytest.mark.netns

NQ = 4
NPAIRS = 3
REGION = 1 << 20            # per pair: WRITE 256 KiB, SEND 64 KiB, READ 128 KiB


def _connect(side, qp, peer_qp, peer_gid, pmtu, profile):
    from dp_players import to_rts
    with side.topo.enter(side.ns):
        to_rts(qp, peer_qp.qp_num, peer_gid, mtu=pmtu, rq_psn=0x200, sq_psn=0x200, timeout=14, rd_atomic=16,
               profile=profile)


@pytest.mark.parametrize("mtu,pmtu,profile", [(1500, 1024, "compat"), (1500, 1024, "native"),
                                              (9000, 4096, "compat")])
def test_one_qps_packets_on_every_rx_queue_are_all_served(make_fabric, mtu, pmtu, profile):
    f = make_fabric("routed", mtu=mtu, veth_queues=NQ, progress_thread=True, busy_poll=False)
    topo, a, b = f
    r = f.routed
    for side in (a, b):
        assert side.ctx.port.queues == list(range(NQ))                    # every RX queue by default
        assert [int(q) for q in side.ctx.plane.XR[:, L.XR_QUEUE]] == list(range(NQ))
    a.fill(41)
    b.fill(42)
    drops0 = [s.ctx.loader.drops() for s in (a, b)]
    rx0 = [[q["rx"] for q in s.ctx.plane.queue_stats()] for s in (a, b)]
    with FaultInjector(r.toward_b.ifname, netns=r.toward_b.ns, spread_queues=NQ) as to_b, \
            FaultInjector(r.toward_a.ifname, netns=r.toward_a.ns, spread_queues=NQ) as to_a:
        pairs = []
        for _ in range(NPAIRS):
            qa = a.ctx.create_qp(a.pd, a.cq, a.cq)
            qb = b.ctx.create_qp(b.pd, b.cq, b.cq)
            _connect(a, qa, qb, b.ctx.gid, pmtu, profile)
            _connect(b, qb, qa, a.ctx.gid, pmtu, profile)
            assert qa.query()["profile"] == qb.query()["profile"] == profile
            pairs.append((qa, qb))
        for k, (qa, qb) in enumerate(pairs):
            base = k * REGION
            w, s, rd = base, base + (256 << 10), base + (512 << 10)
            qb.post_recv(RecvWR(wr_id=100 + k, sg_list=[b.sge(s, 64 << 10)]))
            qa.post_send([SendWR(wr_id=3 * k, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(w, 256 << 10)],
                                 remote_addr=b.mr.addr + w, rkey=b.mr.rkey),
                          SendWR(wr_id=3 * k + 1, opcode=WROpcode.SEND, sg_list=[a.sge(s, 64 << 10)]),
                          SendWR(wr_id=3 * k + 2, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(rd, 128 << 10)],
                                 remote_addr=b.mr.addr + rd, rkey=b.mr.rkey)])
        got = a.cq.wait(3 * NPAIRS, timeout=30)
        rcv = b.cq.wait(NPAIRS, timeout=10)
        spread = [to_b.stats(), to_a.stats()]
    assert sorted((w.wr_id, w.status) for w in got) == [(i, WCStatus.SUCCESS) for i in range(3 * NPAIRS)]
    assert sorted((w.wr_id, w.status, w.byte_len) for w in rcv) == [
        (100 + k, WCStatus.SUCCESS, 64 << 10) for k in range(NPAIRS)]
    for k in range(NPAIRS):
        for lo, n in ((0, 256 << 10), (256 << 10, 64 << 10), (512 << 10, 128 << 10)):   # WRITE, SEND, READ
            lo += k * REGION
            assert (a.buf[lo:lo + n] == b.buf[lo:lo + n]).all(), (k, lo)
        gap = slice(k * REGION + (320 << 10), k * REGION + (512 << 10))
        assert (a.buf[gap] != b.buf[gap]).any()              # untouched: the two random fills differ
        # per QP, its completions came in order though its packets came on four queues
        assert [w.wr_id for w in got if w.wr_id // 3 == k] == [3 * k, 3 * k + 1, 3 * k + 2]
    assert all(st["roce"] > NQ for st in spread), spread
    for i, side in enumerate((a, b)):
        per_q = [q["rx"] - q0 for q, q0 in zip(side.ctx.plane.queue_stats(), rx0[i])]
        assert len(per_q) == NQ and min(per_q) > 0, (side.ns, per_q)          # every queue carried frames
        drops = side.ctx.loader.drops()
        assert drops.get("NO_XSK", 0) == drops0[i].get("NO_XSK", 0), (side.ns, drops)
        st = side.ctx.stats()
        assert st["rx_drop_qp"] == 0 and st["rx"] >= sum(per_q), (side.ns, st)
        if pmtu == 4096:
            assert st["rx_sg"] > 0, (side.ns, st)                # multi-buffer frames joined
        with side.ctx.plane.paused():
            fr = side.ctx.plane.frames()
        assert fr["leaked"] == 0, (side.ns, fr)
    if profile == "compat":
        assert a.ctx.loader.events()["ACK_CONSUMED"] > 0
    else:                       # SACKs from several queues went to the QPs' mr_sacks rings
        assert a.ctx.stats()["rx_sack_kern"] > 0, a.ctx.stats()


def test_rx_queues_option_limits_and_refuses_queues_the_interface_lacks(make_fabric):
    """queues=N opens queues 0..N-1 (the rest get no socket: the XDP program drops their frames as NO_XSK);
    more than the interface has, or none, is InvalidArgument naming the interface's queues."""
    from metaroce_xdp.dp import Context
    from metaroce_xdp.verbs_types import InvalidArgument
    f = make_fabric("flat", veth_queues=NQ, side=None)
    ep = f.ifaces[0]
    with f.topo.enter(ep.ns):
        for bad in (0, NQ + 1):
            with pytest.raises(InvalidArgument, match=f"RX queues 0..{NQ - 1}"):
                Context.open(ep.ifname, queues=bad)
        with Context.open(ep.ifname, queues=2) as ctx:
            assert ctx.port.queues == [0, 1] and len(ctx.plane.XR) == 2
