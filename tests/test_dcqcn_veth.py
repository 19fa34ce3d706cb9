"""DCQCN end to end on veth: A and B in namespaces joined through a switch namespace whose
port towards B marks CE on ECN-capable frames (bpf/fault_inject.c, ecn_ce_ppm), as a
congested switch does.  B's compiled plane (notification point) answers marks with CNPs; A's XDP
program verifies each CNP's ICRC, counts it into the QP's slot and consumes it; A's reaction
point reads the count and cuts its rate; the data arrives intact.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from metaroce_xdp.faults import FaultInjector
from metaroce_xdp.dp import Context
from metaroce_xdp.topo import switched_hosts
from metaroce_xdp.verbs_types import SGE, QPAttr, QPState
from dp_players import FULL, wait_wcs
from metaroce_xdp.verbs_types import SendWR, WCStatus, WROpcode

pytestmark = pytest.mark.netns


class Host:
    def __init__(self, topo, ns, ifname, size=1 << 23):
        self.topo, self.ns = topo, ns
        with topo.enter(ns):
            self.ctx = Context.open(ifname)
        self.pd = self.ctx.alloc_pd()
        self.buf = np.zeros(size, np.uint8)
        self.mr = self.pd.reg_mr(self.buf, FULL)
        self.cq = self.ctx.create_cq(1 << 16)
        self.qp = self.ctx.create_qp(self.pd, self.cq, self.cq)

    def connect(self, peer, timeout=14):
        with self.topo.enter(self.ns):
            q = self.qp
            q.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
            q.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=peer.qp.qp_num, rq_psn=0x100, path_mtu=1024,
                            dgid=peer.ctx.gid, max_dest_rd_atomic=4, min_rnr_timer=1))
            q.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0x100, timeout=timeout, retry_cnt=7, rnr_retry=7,
                            max_rd_atomic=4))

    def sge(self, off, n):
        return SGE(self.mr.addr + off, n, self.mr.lkey)


@pytest.fixture
def hosts():
    topo, _, _ = switched_hosts(prefix="mrcn")
    a = b = None
    try:
        a = Host(topo, topo[0], "mr0")
        b = Host(topo, topo[2], "mr1")
        a.connect(b), b.connect(a)
        a.buf[:] = np.random.default_rng(1).integers(0, 256, a.buf.size, dtype=np.uint8)
        b.buf[:] = np.random.default_rng(2).integers(0, 256, b.buf.size, dtype=np.uint8)
        yield topo, a, b
    finally:
        for h in (a, b):
            if h is not None:
                h.ctx.close()
        topo.close()


def test_ecn_ce_marks_slow_the_sender(hosts):
    """MR-ECN-007, MR-ECN-009, MR-ECN-012, MR-CNP-001, MR-CNP-002, MR-CNP-003, MR-CNP-005, MR-CNP-006,
    MR-CNP-010, MR-ENC-032 (CNP counted only after its ICRC), MR-ENC-013 (the switch fixed the IPv4
    checksum, so nothing is dropped for it), MR-ECN-006 (CE-marked data is delivered)."""
    topo, a, b = hosts
    line = a.qp.query()["rate_bps"]
    with FaultInjector("swB", netns=topo[1], seed=9, ecn_ce_ppm=20_000) as sw:
        wrs = [SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(i << 20, 1 << 20)],
                      remote_addr=b.mr.addr + (i << 20), rkey=b.mr.rkey) for i in range(6)]
        # READs too: their responses cross swA unmarked, their requests cross swB
        wrs.append(SendWR(wr_id=6, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(6 << 20, 1 << 20)],
                          remote_addr=b.mr.addr + (7 << 20), rkey=b.mr.rkey))
        a.qp.post_send(wrs)
        wcs = wait_wcs([a, b], a, len(wrs), timeout=120)
        marked = sw.stats()["ce_marked"]
    assert [w.status for w in wcs] == [WCStatus.SUCCESS] * len(wrs)
    for i in range(6):
        assert zlib.crc32(a.buf[i << 20:(i + 1) << 20]) == zlib.crc32(b.buf[i << 20:(i + 1) << 20])
    assert zlib.crc32(a.buf[6 << 20:7 << 20]) == zlib.crc32(b.buf[7 << 20:8 << 20])

    qa, qb = a.qp.query(), b.qp.query()
    # the notification point: every mark counted, CNPs rate limited (one per 50 us at most)
    assert marked > 20 and qb["rx_ce_marked"] == marked
    assert 1 <= qb["tx_cnp"] <= marked
    # A's XDP program verified, counted and consumed each CNP; none reached A's user space as a packet
    ev_a, drops_a = a.ctx.loader.events(), a.ctx.loader.drops()
    assert ev_a["CNP_CONSUMED"] == ev_a["CNP"] == qb["tx_cnp"]
    assert int(a.ctx.loader.qp(a.qp.qp_num)["cnp_count"]) == qb["tx_cnp"]
    assert drops_a["BAD_ICRC"] == 0 and drops_a["BAD_PKEY"] == 0
    assert b.ctx.loader.drops()["BAD_IP_CSUM"] == 0
    # A's reaction point saw them all and cut its rate
    assert qa["rx_cnp"] == qb["tx_cnp"] and qa["rate_cuts"] >= 1
    assert qa["rate_min_bps"] < line and qa["alpha"] < 1.0 + 1e-9
    assert qb["rate_cuts"] == 0 and qa["tx_cnp"] == 0       # nothing marked towards A
