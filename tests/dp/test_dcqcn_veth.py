"""DCQCN end to end on veth: A and B in namespaces joined through a switch namespace whose
port towards B marks CE on ECN-capable frames (bpf/fault_inject.c, ecn_ce_ppm), as a
congested switch does.  B's compiled plane (notification point) answers marks with CNPs; A's XDP
program verifies each CNP's ICRC, counts it into the QP's slot and consumes it; A's reaction
point reads the count and cuts its rate; the data arrives intact.
"""
from __future__ import annotations

import zlib

import pytest

from dp_players import wait_wcs
from metaroce_xdp.verbs_types import SendWR, WCStatus, WROpcode

pytestmark = pytest.mark.netns


@pytest.fixture
def hosts(make_fabric):
    """A and B (8 MiB, CQ 1<<16, a QP each, connected: local ACK timeout 14, 4 RDMA READ / atomic resources)
    through a switch namespace."""
    fab = make_fabric(prefix="mrcn", size=1 << 23, cq_depth=1 << 16, qp=True)
    topo, a, b = fab
    a.connect(b, timeout=14, rd_atomic=4), b.connect(a, timeout=14, rd_atomic=4)
    a.fill(1)
    b.fill(2)
    return fab


def test_ecn_ce_marks_slow_the_sender(hosts):
    """MR-ECN-007, MR-ECN-009, MR-ECN-012, MR-CNP-001, MR-CNP-002, MR-CNP-003, MR-CNP-005, MR-CNP-006,
    MR-CNP-010, MR-ENC-032 (CNP counted only after its ICRC), MR-ENC-013 (the switch fixed the IPv4
    checksum, so nothing is dropped for it), MR-ECN-006 (CE-marked data is delivered)."""
    topo, a, b = hosts
    line = a.qp.query()["rate_bps"]
    with hosts.impair("b", seed=9, ecn_ce_ppm=20_000) as sw:
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
