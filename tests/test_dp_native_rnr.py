"""MR-SACK-035's immediate notice in the compiled data plane (dp/native.py nat_rx): a native SEND with no
receive posted whose first packet arrives while an earlier packet is still missing is refused without a
word; once the missing packet comes and the ePSN reaches the SEND's first PSN, the responder sends the
RNR NAK-type SACK at once -- the requester does not have to find out by a retransmission timeout."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from dp_players import FULL, collect, drive, make_switched, opened
from metaroce_xdp.faults import FaultInjector
from metaroce_xdp.verbs_types import QPAttr, QPState, RecvWR, SendWR, WCStatus, WROpcode

pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces, XDP and AF_XDP")]

# timeouts far beyond the test's wait: only the SACKs can tell the requester of the RNR in time
SLOW_RTO = {"reo_floor": 5000, "rto_min": 3_000_000, "rto_initial": 3000, "rto_max": 5}


@pytest.fixture(scope="module")
def fabric():
    with opened(make_switched) as f:
        yield f


def test_rnr_sack_goes_out_as_the_epsn_reaches_a_not_ready_send(fabric):
    """MR-SACK-035 (the RNR NAK-type SACK once the message's first PSN is the ePSN), MR-OOO-012 (the SEND's
    packets are not recorded meanwhile), MR-SACK-036/042 (the requester waits, then resends): a 16-packet
    WRITE with its 6th packet dropped once, then a 2-packet SEND with no receive posted.  The SEND's
    packets arrive beyond the gap; when the dropped packet is resent (SACK, RACK) the responder names the
    SEND's first PSN in an RNR SACK right away: the requester counts the RNR with no timeout fired.  After
    a receive is posted both complete intact."""
    topo, a, b = fabric
    a.new_qp(), b.new_qp()
    for s, p in ((a, b), (b, a)):
        with s.topo.enter(s.ns):
            s.qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
            s.qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=p.qp.qp_num, rq_psn=0x100, path_mtu=1024,
                               dgid=p.ctx.gid, max_dest_rd_atomic=16, min_rnr_timer=1, profile="native",
                               native_params=SLOW_RTO))
            s.qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0x100, timeout=20, retry_cnt=7, rnr_retry=7,
                               max_rd_atomic=16))
    a.buf[:] = np.random.default_rng(3).integers(0, 256, a.buf.size, dtype=np.uint8)
    b.buf[:] = 0
    with FaultInjector("swB", netns=topo[1], psn_drop_once=[0x105]) as fb:
        a.qp.post_send([SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 16 * 1024)],
                               remote_addr=b.mr.addr, rkey=b.mr.rkey),
                        SendWR(wr_id=2, opcode=WROpcode.SEND, sg_list=[a.sge(100_000, 2000)])])
        t0 = time.monotonic()
        drive([a, b], lambda: a.qp.native_counters()["c_rnr"] >= 1, timeout=2.5)
        waited = time.monotonic() - t0
        assert fb.stats()["psn_dropped"] == 1
    na, nb = a.qp.native_counters(), b.qp.native_counters()
    assert na["c_rto"] == 0 and na["c_retx"] >= 1, na          # told by the SACK, not by a timeout
    assert nb["c_notready"] >= 1 and b.cq.poll(4) == [], nb
    assert waited < 2.5
    wcs = collect(a, 1, [b], timeout=2)                       # the PSNs before the SEND are acknowledged
    assert [(w.wr_id, w.status) for w in wcs] == [(1, WCStatus.SUCCESS)]
    b.qp.post_recv(RecvWR(wr_id=9, sg_list=[b.sge(200_000, 4096)]))
    assert [(w.wr_id, w.status) for w in collect(a, 1, [b], timeout=5)] == [(2, WCStatus.SUCCESS)]
    assert [(w.wr_id, w.status, w.byte_len) for w in collect(b, 1, [a])] == [(9, WCStatus.SUCCESS, 2000)]
    assert (b.buf[:16 * 1024] == a.buf[:16 * 1024]).all() and (b.buf[200_000:202_000] == a.buf[100_000:102_000]).all()
