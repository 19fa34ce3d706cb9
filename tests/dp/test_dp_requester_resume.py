"""Where a compat requester of the compiled data plane goes on after an ACK overtakes its go-back-N, against a
scripted responder (wire_players.scripted_wire: a raw socket in the other namespace, nothing there answers but
the script) through the real XDP program and AF_XDP socket.

The case (MR-RETRY-001; MR-RC-004: a new message takes the next PSNs, never ones already used): five
4-packet WRITEs go out unacknowledged; the local ACK timer fires and the requester goes back to the first
PSN (the compiled plane resends at most TO_WIN_START = 16 packets, its window reopening from there after a
timeout, MR-RETRY-016); a sixth WRITE is posted; then the responder's ACK for all twenty PSNs arrives -- the
packets had arrived, the ACK was late.  The five WRITEs complete, and the sixth must start at PSN first +
20.  Started where the resending had got to (first + 16), its PSNs would be ones the responder had executed,
taken as duplicates,
until one fell at the responder's ePSN in the middle of the new message: "opcode out of sequence" and both
QPs in ERR -- a rare REM_INV_REQ_ERR in 16-QP bidirectional streams under CPU load (tests/dp/test_dp_bidir.py),
where RX-ring overflow makes timeouts with late ACKs common.
"""
from __future__ import annotations

import time

import pytest

from metaroce_xdp.verbs_types import SGE, QPState, SendWR, WCStatus, WROpcode
from metaroce_xdp.wire import AETH, Op, encode
from wire_players import ScriptedQP

pytestmark = [pytest.mark.netns, pytest.mark.fabric(prefix="mrres")]

PEER_QPN = 0x77A            # the scripted responder's QP: exists nowhere
MTU = 1024
SQ_PSN = 0xFFFFF8           # the requester's first PSN: the twenty packets cross 2^24
N_WR = 5                    # 4-packet WRITEs, 20 packets: more than the window a timeout reopens with
TIMEOUT = 12                # 4.096 us x 2^12 = 16.8 ms


@pytest.fixture(scope="module")
def ctx(wire):
    return wire[3]


class Requester(ScriptedQP):
    def __init__(self, wire, ctx) -> None:
        topo, pair, self.sock, _ = wire
        super().__init__(ctx, topo, pair, PEER_QPN, rq_psn=100, sq_psn=SQ_PSN, rd_atomic=16, mtu=MTU,
                         timeout=TIMEOUT)
        self.drain()

    def rounds(self, seconds: float, first_burst: bool = False) -> list:
        """Rounds for `seconds` (or, first_burst, until a round sent something); the frames the QP sent."""
        out, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            self.round()
            time.sleep(0.001)
            out += self.drain()
            if first_burst and out:
                break
        return out

    def write(self, wr_id: int, off: int, n: int) -> None:
        self.qp.post_send(SendWR(wr_id=wr_id, opcode=WROpcode.RDMA_WRITE, sg_list=[SGE(self.mr.addr + off, n,
                                                                                        self.mr.lkey)],
                                 remote_addr=0x10000 + off, rkey=0x1234))

    def ack(self, psn: int, msn: int) -> None:
        a, b = self.pair.a, self.pair.b
        self.sock.send(encode(Op.ACKNOWLEDGE, src_mac=b.mac, dst_mac=a.mac, src_ip=b.ipv4, dst_ip=a.ipv4,
                              sport=0xC124, dest_qp=self.qp.qp_num, psn=psn,
                              headers={"aeth": AETH(syndrome=0x1F, msn=msn)}))
        time.sleep(self.settle)


def test_a_late_ack_during_go_back_n_leaves_the_next_message_its_own_psns(wire, ctx):
    r = Requester(wire, ctx)
    try:
        from metaroce_xdp.dp.round import TO_WIN_START
        n = 4 * N_WR
        for i in range(N_WR):
            r.write(i, i * 4096, 4096)
        first = r.rounds(0.005)
        assert [p.bth.psn for p in first] == [(SQ_PSN + k) & 0xFFFFFF for k in range(n)]
        # no ACK: the local ACK timer fires, the requester goes back to SQ_PSN
        again = r.rounds(0.2, first_burst=True)
        assert again and again[0].bth.psn == SQ_PSN and again[0].bth.opcode == Op.RDMA_WRITE_FIRST, again[:3]
        psns = [p.bth.psn for p in again]
        assert psns == [(SQ_PSN + k) & 0xFFFFFF for k in range(len(psns))] and len(psns) <= TO_WIN_START, psns
        r.write(N_WR, N_WR * 4096, 2048)
        r.rounds(0.005)
        r.drain()
        r.ack((SQ_PSN + n - 1) & 0xFFFFFF, N_WR)       # everything arrived: the ACK was late
        after = r.rounds(0.05)
        sixth = [(p.bth.psn, p.bth.opcode) for p in after]
        assert sixth[:2] == [((SQ_PSN + n) & 0xFFFFFF, Op.RDMA_WRITE_FIRST),
                             ((SQ_PSN + n + 1) & 0xFFFFFF, Op.RDMA_WRITE_LAST)], \
            [(hex(p.bth.psn), Op(p.bth.opcode).name) for p in after]
        got = r.cq.poll(8)
        assert [(w.wr_id, w.status) for w in got] == [(i, WCStatus.SUCCESS) for i in range(N_WR)]
    finally:
        r.ctx.destroy_qp(r.qp)


def test_an_out_of_sequence_opcode_is_named_in_the_error_reason(wire, ctx):
    """The responder's side of the same failure, as another implementation would meet it: a WRITE MIDDLE at
    the ePSN with no WRITE in progress gets an invalid request NAK and the QP goes to ERR (MR-NAK-006); the
    compiled plane's error reason names the packet -- opcode, PSN, payload, the expected PSN and the
    message in progress -- so the sender's author is told what was wrong with it."""
    r = Requester(wire, ctx)
    try:
        a, b = r.pair.a, r.pair.b
        r.sock.send(encode(Op.RDMA_WRITE_MIDDLE, src_mac=b.mac, dst_mac=a.mac, src_ip=b.ipv4, dst_ip=a.ipv4,
                           sport=0xC125, dest_qp=r.qp.qp_num, psn=100, ack_req=1, payload=bytes(MTU)))
        time.sleep(r.settle)
        out = r.rounds(0.05)
        assert [(p.bth.opcode, p.ext["aeth"].syndrome) for p in out] == [(Op.ACKNOWLEDGE, 0x61)], out
        q = r.qp.query()
        assert q["state"] == QPState.ERR, q
        assert q["error"] == ("invalid request: opcode out of sequence (opcode 0x07 at PSN 0x000064, 1024 B of "
                              "payload; expected PSN 0x000064, no message in progress)"), q["error"]
    finally:
        r.ctx.destroy_qp(r.qp)
