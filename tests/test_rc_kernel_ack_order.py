"""An ACK the kernel fast path consumed can overtake a READ response that is still in the
AF_XDP ring (the two take different paths from the same wire).  The completer must
neither treat that as a lost response (implied NAK, MR-RETRY-012, is for in-order
arrival) nor forget the cumulative ACK: once the READ completes, the WQEs the ACK
covered complete too (MR-ACK-002, MR-RC-020).  Found by the stress workload
(metaroce_xdp/stress.py): a SEND after a READ hung until RETRY_EXC_ERR with no loss."""
from __future__ import annotations

import numpy as np

from metaroce_xdp.wire import decode
from rc_players import RecvWR, SendWR, WCStatus, WROpcode, loop_pair

ACK_OPCODE = 0x11


def _is_ack(frame) -> bool:
    return decode(bytes(frame)).bth.opcode == ACK_OPCODE


def test_kernel_ack_ahead_of_read_response_completes_in_order_without_retry():
    """MR-ACK-002, MR-RC-020, MR-RETRY-012."""
    a, b = loop_pair(burst=False)
    a.buf[:4096] = np.arange(4096) % 251
    b.buf[8192:9192] = 7
    b.qp.post_recv(RecvWR(wr_id=50, sg_list=[b.sge(0, 4096)]))
    a.qp.post_send([SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(4096, 1000)],
                           remote_addr=b.mr.addr + 8192, rkey=b.mr.rkey),
                    SendWR(wr_id=2, opcode=WROpcode.SEND, sg_list=[a.sge(0, 1000)])])
    a.ctx.engine.progress()                # both requests leave
    for _ in range(3):
        b.ctx.engine.progress()            # READ RESPONSE ONLY, then the ACK of the SEND
    inbox = a.ctx.port.inbox
    frames = list(inbox)
    acks = [f for f in frames if _is_ack(f)]
    assert acks and len(frames) > len(acks)        # a response and an ACK are waiting for A
    # The kernel consumes the ACK first (FastAck hands it over with from_kernel=True) ...
    ack = decode(bytes(acks[-1]))
    inbox.clear()
    inbox.extend(f for f in frames if not _is_ack(f))
    a.qp.completer.on_syndrome(ack.bth.psn, ack.aeth.syndrome, ack.aeth.msn, from_kernel=True)
    assert a.qp.requester.retransmits == 0          # not taken for a lost response
    # ... and a repeated ACK of the same PSN is never reported again by the fast path.
    wcs = []
    for _ in range(50):
        a.ctx.engine.progress()
        for f in list(inbox):
            if _is_ack(f) and decode(bytes(f)).bth.psn == ack.bth.psn:
                inbox.remove(f)
        b.ctx.engine.progress()
        wcs += a.cq.poll(8)
        if len(wcs) == 2:
            break
    assert [(w.wr_id, w.status) for w in wcs] == [(1, WCStatus.SUCCESS), (2, WCStatus.SUCCESS)]
    assert a.qp.requester.retransmits == 0
    assert bytes(a.buf[4096:5096]) == bytes(b.buf[8192:9192])
