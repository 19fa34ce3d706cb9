"""Path MTU 4096 through the compiled data plane: multi-buffer AF_XDP (XDP_USE_SG) in the compiled loop.

Two compiled-plane endpoints whose veths run at MTU 9000 (through a switch namespace, where the lossy
test injects faults): a frame with 4096 bytes of payload (~4.2 KB) is more than a 4 KiB UMEM chunk, so
the loop sends it as two chained TX descriptors (ring.tx_descs_sg) and joins the two RX descriptors it
arrives in (round.rx_burst_sg) -- with no Python per packet.  Checked: WRITE, SEND and READ of 1 B to
1 MiB move the right bytes at path MTU 4096, the frames really were multi-buffer on both sides (READ
responses too), the ACKs were consumed by the XDP program; and under seeded loss, duplication and
corruption every operation completes intact and in order."""
from __future__ import annotations


import pytest

from dp_players import collect, connected
from metaroce_xdp.dp import layout as L
from metaroce_xdp.verbs_types import RecvWR, SendWR, WCOpcode, WCStatus, WROpcode

pytestmark = [pytest.mark.netns, pytest.mark.fabric(mtu=9000)]

SIZES = [1, 4095, 4096, 4097, 64 << 10, 1 << 20]


def _fresh(a, b, **kw):
    connected(a, b, seeds=(21, 22), mtu=4096, **kw)


def _plan(a, b, sizes):
    """WRITE, SEND and READ of each size: (send WRs, receive WRs, (kind, a offset, b offset, n) checks)."""
    wrs, recvs, checks = [], [], []
    off = 0
    for i, n in enumerate(sizes):
        for kind in ("w", "s", "r"):
            src, dst = off, off
            off += n + 64
            wid = 3 * i + "wsr".index(kind)
            if kind == "w":
                wrs.append(SendWR(wr_id=wid, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(src, n)],
                                  remote_addr=b.mr.addr + dst, rkey=b.mr.rkey))
            elif kind == "s":
                recvs.append(RecvWR(wr_id=1000 + wid, sg_list=[b.sge(dst, n)]))
                wrs.append(SendWR(wr_id=wid, opcode=WROpcode.SEND, sg_list=[a.sge(src, n)]))
            else:
                wrs.append(SendWR(wr_id=wid, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(src, n)],
                                  remote_addr=b.mr.addr + dst, rkey=b.mr.rkey))
            checks.append((kind, src, dst, n))
    assert off <= a.buf.size
    return wrs, recvs, checks


def _check(a, b, wrs, got, rcv, checks, nrecv):
    assert [(w.wr_id, w.status) for w in got] == [(w.wr_id, WCStatus.SUCCESS) for w in wrs]
    assert len(rcv) == nrecv and all(w.status == WCStatus.SUCCESS and w.opcode == WCOpcode.RECV for w in rcv)
    for kind, src, dst, n in checks:
        assert (a.buf[src:src + n] == b.buf[dst:dst + n]).all(), (kind, src, dst, n)


def test_write_send_read_at_path_mtu_4096(fabric):
    topo, a, b = fabric
    assert a.ctx.max_pmtu == 4096 and a.ctx.plane.A[L.P_SG] == 1 and b.ctx.plane.A[L.P_SG] == 1
    for s in (a, b):                                   # XDP_USE_SG sockets, a frags-aware program
        assert s.ctx.port.sg and s.ctx.port.xsk.bind_flags & 0x10 and s.ctx.loader.frags
    _fresh(a, b)
    acks0 = a.ctx.loader.events()["ACK_CONSUMED"]
    wrs, recvs, checks = _plan(a, b, SIZES)
    b.qp.post_recv(recvs)
    a.qp.post_send(wrs)
    got = collect(a, len(wrs), [b], timeout=30)
    rcv = collect(b, len(recvs), [a], timeout=10)
    _check(a, b, wrs, got, rcv, checks, len(recvs))
    sa, sb = a.ctx.stats(), b.ctx.stats()
    # WRITE/SEND packets of 4096 B arrived in two descriptors at B, READ responses at A: joined by the loop
    assert sb["rx_sg"] >= 2 * (1 << 20) // 4096 and sa["rx_sg"] >= (1 << 20) // 4096
    assert sa["rx_sg_long"] == 0 and sb["rx_sg_long"] == 0
    assert sb["rx_drop_len"] == 0 and sb["rx_drop_icrc"] == 0 and sa["rx_drop_icrc"] == 0
    assert a.ctx.loader.events()["ACK_CONSUMED"] > acks0       # the ACK path in the kernel, as at 1024
    drops = b.ctx.loader.drops()
    assert drops["BAD_IP_HEADER"] == 0 and drops["TRUNCATED_EXT"] == 0, drops
    # every UMEM slot comes back: nothing outstanding, the free stacks are whole again after a few rounds
    for _ in range(5):
        a.ctx.progress(), b.ctx.progress()
    for s in (a, b):
        A = s.ctx.plane.A
        assert A[L.P_N_ACT] == 0
        # slots: the fill ring's (less what is owed to it) + the free stack = all of them
        owed = int(s.ctx.plane.XR[:, L.XR_OWED].sum())
        assert A[L.P_FREE_TOP] - owed == s.ctx.port.umem.nframes // 2 - s.ctx.port.xsk.fill.size, \
            s.ctx.stats()


def test_seeded_faults_at_path_mtu_4096(fabric):
    topo, a, b = fabric
    _fresh(a, b, timeout=12)
    wrs, recvs, checks = _plan(a, b, [1, 4096, 4097, 30_000, 64 << 10, 200_000])
    knobs = dict(drop_ppm=20_000, dup_ppm=10_000, corrupt_ppm=10_000)
    b.qp.post_recv(recvs)
    with fabric.impair("b", seed=7, **knobs) as fb, \
            fabric.impair("a", seed=8, **knobs) as fa:
        a.qp.post_send(wrs)
        got = collect(a, len(wrs), [b], timeout=60)
        rcv = collect(b, len(recvs), [a], timeout=10)
        hit = sum(f.stats()[k] for f in (fa, fb) for k in ("dropped", "duplicated", "corrupted"))
    _check(a, b, wrs, got, rcv, checks, len(recvs))
    assert hit > 0 and a.ctx.stats()["retransmits"] >= 1
    assert b.ctx.stats()["rx_sg"] > 0 and a.ctx.stats()["rx_sg"] > 0
