"""An ACK the kernel fast path (the XDP program) consumed can overtake a READ response that is still in the
AF_XDP ring (the two take different paths from the same wire).  The completer must neither treat that as a
lost response (implied NAK, MR-RETRY-012, is for in-order arrival) nor forget the cumulative ACK: once the
READ completes, the WQEs the ACK covered complete too (MR-ACK-002, MR-RC-020).  Found by the stress workload
(metaroce_xdp/stress.py): a SEND after a READ hung until RETRY_EXC_ERR with no loss.

On the compiled plane (dp_loop pairs): A sends a READ and a SEND; only B runs until it has answered both (the
READ RESPONSE and the SEND's ACK are on their way to A); A's kernel consumes the ACK on arrival while the
response waits in A's AF_XDP ring for A's next round."""
from __future__ import annotations

import time

import numpy as np
import pytest

from dp_players import run_until, wait_wcs
from metaroce_xdp.verbs_types import RecvWR, SendWR, WCStatus, WROpcode

pytestmark = [pytest.mark.netns]


def test_kernel_ack_ahead_of_read_response_completes_in_order_without_retry(dp_loop):
    """MR-ACK-002, MR-RC-020, MR-RETRY-012."""
    a, b = dp_loop()
    a.buf[:4096] = np.arange(4096) % 251
    b.buf[8192:9192] = 7
    b.qp.post_recv(RecvWR(wr_id=50, sg_list=[b.sge(0, 4096)]))
    kack0 = a.ctx.loader.events()["ACK_CONSUMED"]
    rt0, to0 = a.ctx.stats()["retransmits"], a.ctx.stats()["timeouts"]
    tx0 = b.ctx.stats()["tx"]
    a.qp.post_send([SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(4096, 1000)],
                           remote_addr=b.mr.addr + 8192, rkey=b.mr.rkey),
                    SendWR(wr_id=2, opcode=WROpcode.SEND, sg_list=[a.sge(0, 1000)])])
    a.ctx.progress()                                   # both requests leave
    run_until([b], lambda: b.ctx.stats()["tx"] - tx0 >= 2, 5)    # READ RESPONSE ONLY, then the SEND's ACK
    deadline = time.monotonic() + 5
    while a.ctx.loader.events()["ACK_CONSUMED"] == kack0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert a.ctx.loader.events()["ACK_CONSUMED"] > kack0, "the kernel did not take the ACK first"
    wcs = wait_wcs([a, b], a, 2, 5)
    assert [(w.wr_id, w.status) for w in wcs] == [(1, WCStatus.SUCCESS), (2, WCStatus.SUCCESS)]
    assert a.ctx.stats()["retransmits"] == rt0 and a.ctx.stats()["timeouts"] == to0   # not taken for a loss
    assert bytes(a.buf[4096:5096]) == bytes(b.buf[8192:9192])
