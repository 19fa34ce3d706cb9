"""The completer's compat rules for unexpected and malformed responses (spec 03: MR-ACK-015,
MR-NAK-011, MR-NAK-012, MR-XH-008), with crafted response packets.

The requester posts its WQE and sends it; its peer never runs, so the only
responses it sees are the ones the test puts into its LoopPort inbox.
"""
from __future__ import annotations

import pytest

from metaroce_xdp.wire import AETH, Op, encode
from metaroce_xdp.wire.headers import AtomicAckETH
from metaroce_xdp.verbs_types import QPState
from rc_players import SendWR, WCStatus, WROpcode, loop_pair

MTU = 1024


def respond(resp, req, opcode, psn, payload=b"", **headers) -> None:
    """One response frame from `resp` to `req`, then one round of req's engine."""
    rp, qp = resp.ctx.port, req.ctx.port
    qp.inbox.append(encode(opcode, src_mac=rp.mac, dst_mac=qp.mac, src_ip=rp.ip, dst_ip=qp.ip,
                           sport=resp.qp.sport, dest_qp=req.qp.qp_num, psn=psn, headers=headers,
                           payload=payload))
    req.ctx.engine.progress()


def _posted(op=WROpcode.RDMA_WRITE, n=64):
    a, b = loop_pair(mtu=MTU)
    a.qp.post_send(SendWR(wr_id=1, opcode=op, sg_list=[a.sge(0, 8 if op.name.startswith("ATOMIC") else n)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey, compare_add=1))
    a.ctx.engine.progress()                       # PSN 100 onwards sent; b never runs
    b.ctx.port.inbox.clear()
    assert a.qp.requester.outstanding()
    return a, b


def _bad(a, wr_id=1):
    (wc,) = a.cq.poll(4)
    assert (wc.wr_id, wc.status) == (wr_id, WCStatus.BAD_RESP_ERR)
    assert a.qp.state == QPState.ERR and a.qp.query()["rx_bad_rsp"] == 1


@pytest.mark.parametrize("syndrome", [0x80, 0x9F, 0xE1, 0x40, 0x5F])
def test_bad_aeth_is_a_bad_response(syndrome):
    """MR-NAK-012, MR-XH-008: an AETH with bit 7 set or of type 10 completes the oldest WQE with
    IBV_WC_BAD_RESP_ERR and moves the QP to ERR (counted in rx_bad_rsp), not a silent drop."""
    a, b = _posted()
    respond(b, a, Op.ACKNOWLEDGE, 100, aeth=AETH(syndrome=syndrome, msn=1))
    _bad(a)


def test_ghost_and_stale_responses_are_counted_and_change_nothing():
    """MR-ACK-015, MR-SEC-024: an ACK or READ RESPONSE at or after next_psn is a ghost (rx_ghost_rsp),
    one before comp_psn -- comp_psn - 1 included -- is stale (rx_stale_rsp); both are discarded: nothing
    completes, the QP stays in RTS, even for a bad AETH."""
    a, b = _posted()
    respond(b, a, Op.ACKNOWLEDGE, 101, aeth=AETH(syndrome=0x1F, msn=1))        # next_psn is 101
    respond(b, a, Op.RDMA_READ_RESPONSE_ONLY, 5000, payload=b"x" * 8, aeth=AETH(syndrome=0x1F, msn=1))
    respond(b, a, Op.ACKNOWLEDGE, 99, aeth=AETH(syndrome=0x1F, msn=0))         # comp_psn - 1
    respond(b, a, Op.ACKNOWLEDGE, 90, aeth=AETH(syndrome=0x80, msn=0))
    q = a.qp.query()
    assert (q["rx_ghost_rsp"], q["rx_stale_rsp"], q["rx_bad_rsp"]) == (2, 2, 0)
    assert a.cq.poll(4) == [] and a.qp.state == QPState.RTS and a.qp.requester.outstanding()
    respond(b, a, Op.ACKNOWLEDGE, 100, aeth=AETH(syndrome=0x1F, msn=1))        # the real one still works
    (wc,) = a.cq.poll(4)
    assert wc.status == WCStatus.SUCCESS


@pytest.mark.parametrize("wqe,rsp", [(WROpcode.RDMA_WRITE, Op.RDMA_READ_RESPONSE_ONLY),
                                     (WROpcode.SEND, Op.ATOMIC_ACKNOWLEDGE),
                                     (WROpcode.RDMA_READ, Op.ATOMIC_ACKNOWLEDGE),
                                     (WROpcode.ATOMIC_FETCH_AND_ADD, Op.RDMA_READ_RESPONSE_ONLY)])
def test_response_of_the_wrong_kind_is_a_bad_response(wqe, rsp):
    """MR-NAK-012: a READ RESPONSE when the WQE at comp_psn is not a READ, an ATOMIC ACKNOWLEDGE when it is
    not an ATOMIC: IBV_WC_BAD_RESP_ERR (before: discarded as stale)."""
    a, b = _posted(wqe, n=8)
    hdr = dict(aeth=AETH(syndrome=0x1F, msn=1))
    if rsp == Op.ATOMIC_ACKNOWLEDGE:
        hdr["atomicacketh"] = AtomicAckETH(orig=7)
    respond(b, a, rsp, 100, payload=b"r" * 8 if rsp != Op.ATOMIC_ACKNOWLEDGE else b"", **hdr)
    _bad(a)
    assert not a.buf[:8].any()                    # nothing placed


@pytest.mark.parametrize("op", [Op.RDMA_READ_RESPONSE_ONLY, Op.ATOMIC_ACKNOWLEDGE])
@pytest.mark.parametrize("syndrome", [0x61, 0x20, 0x9F])
def test_response_aeth_not_of_type_ack(op, syndrome):
    """MR-NAK-012: a READ RESPONSE ONLY or ATOMIC ACKNOWLEDGE whose AETH is a NAK, an RNR NAK or has bit 7
    set is a bad response."""
    wqe = WROpcode.RDMA_READ if op == Op.RDMA_READ_RESPONSE_ONLY else WROpcode.ATOMIC_FETCH_AND_ADD
    a, b = _posted(wqe, n=8)
    hdr = dict(aeth=AETH(syndrome=syndrome, msn=1))
    if op == Op.ATOMIC_ACKNOWLEDGE:
        hdr["atomicacketh"] = AtomicAckETH(orig=7)
    respond(b, a, op, 100, payload=b"r" * 8 if op != Op.ATOMIC_ACKNOWLEDGE else b"", **hdr)
    _bad(a)


def test_read_response_opcode_sequence():
    """MR-NAK-012: READ RESPONSE MIDDLE or LAST without a FIRST, a FIRST inside a stream, and a FIRST that
    would end the message are bad responses."""
    ack = dict(aeth=AETH(syndrome=0x1F, msn=1))
    a, b = _posted(WROpcode.RDMA_READ, n=3 * MTU)
    respond(b, a, Op.RDMA_READ_RESPONSE_MIDDLE, 100, payload=b"m" * MTU)
    _bad(a)
    a, b = _posted(WROpcode.RDMA_READ, n=3 * MTU)
    respond(b, a, Op.RDMA_READ_RESPONSE_LAST, 100, payload=b"m" * MTU, **ack)
    _bad(a)
    a, b = _posted(WROpcode.RDMA_READ, n=3 * MTU)
    respond(b, a, Op.RDMA_READ_RESPONSE_FIRST, 100, payload=b"f" * MTU, **ack)
    respond(b, a, Op.RDMA_READ_RESPONSE_FIRST, 101, payload=b"f" * MTU, **ack)
    _bad(a)
    a, b = _posted(WROpcode.RDMA_READ, n=MTU)
    respond(b, a, Op.RDMA_READ_RESPONSE_FIRST, 100, payload=b"f" * MTU, **ack)
    _bad(a)


def test_read_response_stream_in_order_completes():
    """MR-NAK-012, MR-ACK-006: FIRST, MIDDLE, LAST in order complete the READ; a FIRST after the requester
    asked for the rest again (MR-RETRY-008) starts a new stream inside the WQE."""
    ack = dict(aeth=AETH(syndrome=0x1F, msn=1))
    a, b = _posted(WROpcode.RDMA_READ, n=3 * MTU)
    respond(b, a, Op.RDMA_READ_RESPONSE_FIRST, 100, payload=b"1" * MTU, **ack)
    respond(b, a, Op.RDMA_READ_RESPONSE_LAST, 102, payload=b"3" * MTU, **ack)     # 101 lost: go back
    assert a.qp.requester.retransmits == 1 and a.qp.state == QPState.RTS
    respond(b, a, Op.RDMA_READ_RESPONSE_FIRST, 101, payload=b"2" * MTU, **ack)    # the re-request's stream
    respond(b, a, Op.RDMA_READ_RESPONSE_LAST, 102, payload=b"3" * MTU, **ack)
    (wc,) = a.cq.poll(4)
    assert wc.status == WCStatus.SUCCESS
    assert bytes(a.buf[:3 * MTU]) == b"1" * MTU + b"2" * MTU + b"3" * MTU


@pytest.mark.parametrize("code", [3, 4, 5, 31])
def test_nak_code_4_and_reserved_codes_are_remote_operational_errors(code):
    """MR-NAK-011, MR-QP-032: NAK code 4 (invalid RD request) and reserved codes are handled like code 3:
    IBV_WC_REM_OP_ERR (IBV_WC_REM_INV_RD_REQ_ERR is never produced)."""
    a, b = _posted()
    respond(b, a, Op.ACKNOWLEDGE, 100, aeth=AETH(syndrome=0x60 | code, msn=0))
    (wc,) = a.cq.poll(4)
    assert wc.status == WCStatus.REM_OP_ERR and a.qp.state == QPState.ERR
