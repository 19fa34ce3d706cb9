"""MR-MEM-035: a READ or ATOMIC whose local destination MR is deregistered while the WQE is outstanding
completes with IBV_WC_LOC_PROT_ERR when its response arrives, nothing is placed, and the QP moves to ERR
(before: the response was scattered into the deregistered buffer and the WQE completed with success).
The conformance case TC-MEM-035-a checks the same on the wire."""
from __future__ import annotations

import numpy as np
import pytest

from metaroce_xdp.verbs_types import SGE, Access, QPState
from metaroce_xdp.wire import AETH, Op, encode
from metaroce_xdp.wire.headers import AtomicAckETH
from rc_players import SendWR, WCStatus, WROpcode, loop_pair


@pytest.mark.parametrize("op", [WROpcode.RDMA_READ, WROpcode.ATOMIC_FETCH_AND_ADD])
def test_response_into_a_deregistered_mr_is_a_local_protection_error(op):
    a, b = loop_pair(mtu=1024)
    buf = np.full(4096, 0x5A, np.uint8)
    mr = a.pd.reg_mr(buf, Access.LOCAL_WRITE)
    n = 8 if op != WROpcode.RDMA_READ else 64
    a.qp.post_send(SendWR(wr_id=7, opcode=op, sg_list=[SGE(mr.addr, n, mr.lkey)], remote_addr=b.mr.addr,
                          rkey=b.mr.rkey, compare_add=1))
    a.ctx.engine.progress()
    b.ctx.port.inbox.clear()
    psn = a.qp.requester.sq[0].first_psn
    a.ctx.dereg_mr(mr)
    rp, qp = b.ctx.port, a.ctx.port
    if op == WROpcode.RDMA_READ:
        opcode, hdr, payload = Op.RDMA_READ_RESPONSE_ONLY, {"aeth": AETH(syndrome=0x1F, msn=1)}, b"\x11" * n
    else:
        opcode, hdr, payload = Op.ATOMIC_ACKNOWLEDGE, {"aeth": AETH(syndrome=0x1F, msn=1),
                                                       "atomicacketh": AtomicAckETH(orig=0x1111)}, b""
    qp.inbox.append(encode(opcode, src_mac=rp.mac, dst_mac=qp.mac, src_ip=rp.ip, dst_ip=qp.ip, sport=b.qp.sport,
                           dest_qp=a.qp.qp_num, psn=psn, headers=hdr, payload=payload))
    a.ctx.engine.progress()
    (wc,) = a.cq.poll(4)
    assert (wc.wr_id, wc.status) == (7, WCStatus.LOC_PROT_ERR)
    assert a.qp.state == QPState.ERR
    assert (buf == 0x5A).all()
