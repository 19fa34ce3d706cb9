"""The completer's compat rules for unexpected and malformed responses (spec 03: MR-ACK-015, MR-NAK-011,
MR-NAK-012, MR-XH-008), with crafted response packets, on the compiled plane.

A compiled-plane QP (real XDP program, AF_XDP socket) posts its WQE and sends it to a scripted peer (a raw
socket in the other namespace, tests/scripted_players.py); the only responses it sees are the ones the test
puts on the wire.  ACKNOWLEDGEs meet the XDP program first (it consumes the ones it can judge), the rest
reach the compiled loop.
"""
from __future__ import annotations

import pytest

from metaroce_xdp.verbs_types import QPState, SendWR, WCStatus, WROpcode
from metaroce_xdp.wire import AETH, Op
from metaroce_xdp.wire.headers import AtomicAckETH
from scripted_players import Peer

pytestmark = [pytest.mark.netns, pytest.mark.fabric(prefix="mrcpl")]

MTU = 1024


@pytest.fixture
def posted(wire):
    """posted(op, n): a fresh QP (first PSN 100) that sent one WQE of `op` (n bytes) to the script."""
    made = []

    def make(op=WROpcode.RDMA_WRITE, n=64):
        q = Peer(wire, sq_psn=100, mtu=MTU)
        made.append(q)
        q.qp.post_send(SendWR(wr_id=1, opcode=op, sg_list=[q.sge(0, 8 if op.name.startswith("ATOMIC") else n)],
                              remote_addr=0x10000, rkey=0x1234, compare_add=1))
        sent = q.rounds()                           # PSN 100 onwards on the wire
        assert sent and sent[0].bth.psn == 100
        assert q.qp.query()["sq_outstanding"] == 1
        return q

    yield make
    for q in made:
        q.close()


def respond(q, opcode, psn, payload=b"", **headers) -> None:
    """One response frame from the script to q's QP, then q's rounds until quiet."""
    q.inject(opcode, psn, payload, **headers)


def _bad(q, wr_id=1):
    (wc,) = q.cq.poll(4)
    assert (wc.wr_id, wc.status) == (wr_id, WCStatus.BAD_RESP_ERR)
    assert q.qp.query_state() == QPState.ERR


@pytest.mark.parametrize("syndrome", [0x80, 0x9F, 0xE1, 0x40, 0x5F])
def test_bad_aeth_is_a_bad_response(posted, syndrome):
    """MR-NAK-012, MR-XH-008: an AETH with bit 7 set or of type 10 completes the oldest WQE with
    IBV_WC_BAD_RESP_ERR and moves the QP to ERR, not a silent drop."""
    q = posted()
    respond(q, Op.ACKNOWLEDGE, 100, aeth=AETH(syndrome=syndrome, msn=1))
    _bad(q)


def test_ghost_and_stale_responses_change_nothing(posted):
    """MR-ACK-015, MR-SEC-024: an ACK or READ RESPONSE at or after next_psn is a ghost, one before comp_psn --
    comp_psn - 1 included -- is stale; both are discarded: nothing completes, the QP stays in RTS, even for a
    bad AETH."""
    q = posted()
    respond(q, Op.ACKNOWLEDGE, 101, aeth=AETH(syndrome=0x1F, msn=1))        # next_psn is 101
    respond(q, Op.RDMA_READ_RESPONSE_ONLY, 5000, payload=b"x" * 8, aeth=AETH(syndrome=0x1F, msn=1))
    respond(q, Op.ACKNOWLEDGE, 99, aeth=AETH(syndrome=0x1F, msn=0))         # comp_psn - 1
    respond(q, Op.ACKNOWLEDGE, 90, aeth=AETH(syndrome=0x80, msn=0))
    assert q.cq.poll(4) == [] and q.qp.query_state() == QPState.RTS and q.qp.query()["sq_outstanding"] == 1
    respond(q, Op.ACKNOWLEDGE, 100, aeth=AETH(syndrome=0x1F, msn=1))        # the real one still works
    (wc,) = q.cq.poll(4)
    assert wc.status == WCStatus.SUCCESS


def test_ghost_and_stale_responses_are_counted(posted):
    """MR-ACK-015: the ghosts count in rx_ghost_rsp, the stale ones in rx_stale_rsp, none in rx_bad_rsp -- per
    QP (QP.query) whether the XDP program dropped them (the ACKs: GHOST_ACK, STALE_ACK) or the loop (the READ
    RESPONSE); a bad AETH inside the window is the one bad response that ends the QP."""
    q = posted()
    d0 = q.ctx.loader.drops()
    respond(q, Op.ACKNOWLEDGE, 101, aeth=AETH(syndrome=0x1F, msn=1))
    respond(q, Op.RDMA_READ_RESPONSE_ONLY, 5000, payload=b"x" * 8, aeth=AETH(syndrome=0x1F, msn=1))
    respond(q, Op.ACKNOWLEDGE, 99, aeth=AETH(syndrome=0x1F, msn=0))
    respond(q, Op.ACKNOWLEDGE, 90, aeth=AETH(syndrome=0x80, msn=0))
    qq = q.qp.query()
    assert (qq["rx_ghost_rsp"], qq["rx_stale_rsp"], qq["rx_bad_rsp"]) == (2, 2, 0)
    d1 = q.ctx.loader.drops()
    # dropped: the ghost ACK and the stale one at 90; the duplicate at comp_psn - 1 is consumed for its MSN
    assert (d1["GHOST_ACK"] - d0["GHOST_ACK"], d1["STALE_ACK"] - d0["STALE_ACK"]) == (1, 1)
    assert q.ctx.stats()["rx_ghost_rsp"] >= 1                   # the READ RESPONSE, port-wide
    respond(q, Op.ACKNOWLEDGE, 100, aeth=AETH(syndrome=0x40, msn=0))       # reserved AETH type, in the window
    _bad(q)
    assert q.qp.query()["rx_bad_rsp"] == 1


@pytest.mark.parametrize("wqe,rsp", [(WROpcode.RDMA_WRITE, Op.RDMA_READ_RESPONSE_ONLY),
                                     (WROpcode.SEND, Op.ATOMIC_ACKNOWLEDGE),
                                     (WROpcode.RDMA_READ, Op.ATOMIC_ACKNOWLEDGE),
                                     (WROpcode.ATOMIC_FETCH_AND_ADD, Op.RDMA_READ_RESPONSE_ONLY)])
def test_response_of_the_wrong_kind_is_a_bad_response(posted, wqe, rsp):
    """MR-NAK-012: a READ RESPONSE when the WQE at comp_psn is not a READ, an ATOMIC ACKNOWLEDGE when it is
    not an ATOMIC: IBV_WC_BAD_RESP_ERR."""
    q = posted(wqe, n=8)
    hdr = dict(aeth=AETH(syndrome=0x1F, msn=1))
    if rsp == Op.ATOMIC_ACKNOWLEDGE:
        hdr["atomicacketh"] = AtomicAckETH(orig=7)
    respond(q, rsp, 100, payload=b"r" * 8 if rsp != Op.ATOMIC_ACKNOWLEDGE else b"", **hdr)
    _bad(q)
    assert not q.buf[:8].any()                    # nothing placed


@pytest.mark.parametrize("op", [Op.RDMA_READ_RESPONSE_ONLY, Op.ATOMIC_ACKNOWLEDGE])
@pytest.mark.parametrize("syndrome", [0x61, 0x20, 0x9F])
def test_response_aeth_not_of_type_ack(posted, op, syndrome):
    """MR-NAK-012: a READ RESPONSE ONLY or ATOMIC ACKNOWLEDGE whose AETH is a NAK, an RNR NAK or has bit 7
    set is a bad response."""
    wqe = WROpcode.RDMA_READ if op == Op.RDMA_READ_RESPONSE_ONLY else WROpcode.ATOMIC_FETCH_AND_ADD
    q = posted(wqe, n=8)
    hdr = dict(aeth=AETH(syndrome=syndrome, msn=1))
    if op == Op.ATOMIC_ACKNOWLEDGE:
        hdr["atomicacketh"] = AtomicAckETH(orig=7)
    respond(q, op, 100, payload=b"r" * 8 if op != Op.ATOMIC_ACKNOWLEDGE else b"", **hdr)
    _bad(q)


@pytest.mark.parametrize("case", ["middle", "last", "first_in_stream", "first_ending"])
def test_read_response_opcode_sequence(posted, case):
    """MR-NAK-012: READ RESPONSE MIDDLE or LAST without a FIRST, a FIRST inside a stream, and a FIRST that
    would end the message are bad responses."""
    ack = dict(aeth=AETH(syndrome=0x1F, msn=1))
    if case == "middle":
        q = posted(WROpcode.RDMA_READ, n=3 * MTU)
        respond(q, Op.RDMA_READ_RESPONSE_MIDDLE, 100, payload=b"m" * MTU)
    elif case == "last":
        q = posted(WROpcode.RDMA_READ, n=3 * MTU)
        respond(q, Op.RDMA_READ_RESPONSE_LAST, 100, payload=b"m" * MTU, **ack)
    elif case == "first_in_stream":
        q = posted(WROpcode.RDMA_READ, n=3 * MTU)
        respond(q, Op.RDMA_READ_RESPONSE_FIRST, 100, payload=b"f" * MTU, **ack)
        respond(q, Op.RDMA_READ_RESPONSE_FIRST, 101, payload=b"f" * MTU, **ack)
    else:
        q = posted(WROpcode.RDMA_READ, n=MTU)
        respond(q, Op.RDMA_READ_RESPONSE_FIRST, 100, payload=b"f" * MTU, **ack)
    _bad(q)


def test_read_response_stream_in_order_completes(posted):
    """MR-NAK-012, MR-ACK-006: FIRST, MIDDLE, LAST in order complete the READ; a FIRST after the requester
    asked for the rest again (MR-RETRY-008) starts a new stream inside the WQE."""
    ack = dict(aeth=AETH(syndrome=0x1F, msn=1))
    q = posted(WROpcode.RDMA_READ, n=3 * MTU)
    rt0 = q.ctx.stats()["retransmits"]
    q.send([(Op.RDMA_READ_RESPONSE_FIRST, 100, b"1" * MTU, ack)])
    q.send([(Op.RDMA_READ_RESPONSE_LAST, 102, b"3" * MTU, ack)])        # 101 lost: go back
    again = q.rounds()
    assert [(p.bth.opcode, p.bth.psn) for p in again] == [(Op.RDMA_READ_REQUEST, 101)]   # the rest asked for
    assert q.ctx.stats()["retransmits"] - rt0 == 1 and q.qp.query_state() == QPState.RTS
    respond(q, Op.RDMA_READ_RESPONSE_FIRST, 101, payload=b"2" * MTU, **ack)    # the re-request's stream
    respond(q, Op.RDMA_READ_RESPONSE_LAST, 102, payload=b"3" * MTU, **ack)
    (wc,) = q.cq.poll(4)
    assert wc.status == WCStatus.SUCCESS
    assert bytes(q.buf[:3 * MTU]) == b"1" * MTU + b"2" * MTU + b"3" * MTU


@pytest.mark.parametrize("code", [3, 4, 5, 31])
def test_nak_code_4_and_reserved_codes_are_remote_operational_errors(posted, code):
    """MR-NAK-011, MR-QP-032: NAK code 4 (invalid RD request) and reserved codes are handled like code 3:
    IBV_WC_REM_OP_ERR (IBV_WC_REM_INV_RD_REQ_ERR is never produced)."""
    q = posted()
    respond(q, Op.ACKNOWLEDGE, 100, aeth=AETH(syndrome=0x60 | code, msn=0))
    (wc,) = q.cq.poll(4)
    assert wc.status == WCStatus.REM_OP_ERR and q.qp.query_state() == QPState.ERR
