"""The kernel ACK fast path's seqcount (struct mr_qp_state.ack_seq), read by the compiled plane's
loop (dp/completer.py kernel_acks): while the count is odd -- a writer mid-update on another CPU -- the
XDP program drops ACKs for the QP (counted ACK_BUSY; ACKs are cumulative, a later one repairs it)
and the loop reads nothing from the slot; neither side fails the QP.  Once the count is even again
the next ACK (the duplicate answering the local-ACK-timeout retry) is applied and the WR completes
once (MR-ACK-002 on the XDP path)."""
from __future__ import annotations

import time

import pytest

from metaroce_xdp.stress import Fabric
from metaroce_xdp.verbs_types import QPState, SendWR, WCStatus, WROpcode

pytestmark = pytest.mark.netns


def test_odd_seqcount_defers_the_ack_and_never_fails_progress():
    with Fabric("switch") as fab:
        a, b = fab.endpoints(4 << 20)
        a.new_qp(), b.new_qp()
        a.connect(b, sq_psn=10, rq_psn=20, timeout=14)
        b.connect(a, sq_psn=20, rq_psn=10, timeout=14)
        ld = a.ctx.loader
        slot = ld.qp(a.qp.qp_num)
        seq0 = int(slot["ack_seq"])
        assert seq0 % 2 == 0
        busy0 = ld.drops().get("ACK_BUSY", 0)
        slot["ack_seq"] = seq0 + 1                       # a writer "mid-update"
        a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 4096)],
                              remote_addr=b.mr.addr, rkey=b.mr.rkey))
        deadline = time.monotonic() + 5
        while ld.drops().get("ACK_BUSY", 0) - busy0 < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ld.drops().get("ACK_BUSY", 0) - busy0 >= 2  # the first ACK and a retry's duplicate
        assert a.cq.poll(4) == []                          # nothing applied from a half-written slot
        assert int(slot["ack_seq"]) == seq0 + 1            # and nobody wrote under the odd count
        assert a.qp_counters()["state"] == QPState.RTS
        slot["ack_seq"] = seq0 + 2                       # the writer finishes
        wcs = []
        deadline = time.monotonic() + 10
        while not wcs and time.monotonic() < deadline:
            wcs = a.cq.poll(4)
            time.sleep(0.001)
        assert [(w.wr_id, w.status) for w in wcs] == [(1, WCStatus.SUCCESS)]
        assert int(slot["ack_seq"]) > seq0 + 2             # the kernel applied the next ACK
        assert a.cq.poll(4) == []
        assert a.qp_counters()["state"] == QPState.RTS
