"""The kernel ACK fast path's seqcount, read by user space (metaroce_xdp/rc/fastack.py): while the
slot's ack_seq is odd -- a writer mid-update on the other CPU, or a reader that keeps losing the
race -- the progress loop must go on (count it, try again next round), never fail the round; the
acknowledgement is applied once the count is even again (MR-ACK-002 on the XDP path)."""
from __future__ import annotations

import os
import time

import pytest

from metaroce_xdp.stress import Fabric
from metaroce_xdp.verbs_types import SendWR, WCStatus, WROpcode

pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces, XDP and AF_XDP")]


def test_odd_seqcount_defers_the_ack_and_never_fails_progress():
    with Fabric("switch") as fab:
        a, b = fab.endpoints(4 << 20)
        a.new_qp(), b.new_qp()
        a.connect(b, sq_psn=10, rq_psn=20, timeout=14)
        b.connect(a, sq_psn=20, rq_psn=10, timeout=14)
        eng, fa = a.ctx.engine, a.ctx.engine.fast_ack
        i = a.ctx.loader.slot_of(a.qp.qp_num)
        with eng.lock:                                   # a writer "mid-update"
            fa._u64[i, fa._seq] |= 1
        a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 4096)],
                              remote_addr=b.mr.addr, rkey=b.mr.rkey))
        deadline = time.monotonic() + 5
        while eng.stats["ack_snapshot_busy"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.stats["ack_snapshot_busy"] >= 3
        assert eng.stats["progress_errors"] == 0
        with eng.lock:                                   # the writer finishes
            fa._u64[i, fa._seq] += 1
        wcs = []
        deadline = time.monotonic() + 10
        while not wcs and time.monotonic() < deadline:
            wcs = a.cq.poll(1)
            time.sleep(0.001)
        assert [(w.wr_id, w.status) for w in wcs] == [(1, WCStatus.SUCCESS)]
        assert eng.stats["progress_errors"] == 0
        assert a.ctx.loader.events()["ACK_CONSUMED"] >= 1
