"""MR-MEM-035: a READ or ATOMIC whose local destination MR is deregistered while the WQE is outstanding
completes with IBV_WC_LOC_PROT_ERR when its response arrives, nothing is placed, and the QP moves to ERR.
The conformance case TC-MEM-035-a checks the same on the wire.  A compiled-plane QP against a scripted peer
(tests/scripted_players.py) that answers with the response once the MR is gone."""
from __future__ import annotations

import numpy as np
import pytest

from metaroce_xdp.verbs_types import SGE, Access, QPState, SendWR, WCStatus, WROpcode
from metaroce_xdp.wire import AETH, Op
from metaroce_xdp.wire.headers import AtomicAckETH
from scripted_players import Peer

pytestmark = [pytest.mark.netns, pytest.mark.fabric(prefix="mrdro")]


@pytest.mark.parametrize("op", [WROpcode.RDMA_READ, WROpcode.ATOMIC_FETCH_AND_ADD])
def test_response_into_a_deregistered_mr_is_a_local_protection_error(wire, op):
    q = Peer(wire, sq_psn=100)
    try:
        buf = np.full(4096, 0x5A, np.uint8)
        mr = q.pd.reg_mr(buf, Access.LOCAL_WRITE)
        n = 8 if op != WROpcode.RDMA_READ else 64
        q.qp.post_send(SendWR(wr_id=7, opcode=op, sg_list=[SGE(mr.addr, n, mr.lkey)], remote_addr=0x10000,
                              rkey=0x1234, compare_add=1))
        sent = q.rounds()
        assert [p.bth.psn for p in sent] == [100]      # the request is out
        mr.dereg()
        if op == WROpcode.RDMA_READ:
            frame = (Op.RDMA_READ_RESPONSE_ONLY, 100, b"\x11" * n, {"aeth": AETH(syndrome=0x1F, msn=1)})
        else:
            frame = (Op.ATOMIC_ACKNOWLEDGE, 100, b"", {"aeth": AETH(syndrome=0x1F, msn=1),
                                                       "atomicacketh": AtomicAckETH(orig=0x1111)})
        q.send([frame])
        q.rounds()
        (wc,) = q.cq.poll(4)
        assert (wc.wr_id, wc.status) == (7, WCStatus.LOC_PROT_ERR)
        assert q.qp.query_state() == QPState.ERR
        assert (buf == 0x5A).all()
    finally:
        q.close()
