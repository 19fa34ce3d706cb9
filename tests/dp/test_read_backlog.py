"""A large RDMA READ recovers from a lost response, and the frames a lossy path leaves behind -- duplicates,
the old stream after a gap, a corrupted copy -- cost nothing but a count (MR-RETRY-002 to MR-RETRY-004,
MR-RETRY-008, MR-RETRY-013, MR-DUP-002, MR-DUP-003, MR-DUP-006, MR-DUP-008, MR-NAK-003, MR-ICRC-013), on the
compiled plane.

The fault matrix found an 8 MiB READ failing with IBV_WC_RETRY_EXC_ERR at 1 % loss: after a lost response the
requester's receive ring still held the rest of the stream the responder sent before it saw the request for
the remainder, and the restarted stream waited behind it; each local ACK timeout re-requested the remainder.
Here: a 1 MiB READ between two compiled-plane endpoints, one response lost once on the switch (dp_loop).

Then the same kind of traffic replayed by a scripted peer (tests/scripted_players.py) in the order a go-back-N
leaves it, against a compiled-plane responder (a WRITE's packets) and requester (a READ's responses).
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from dp_players import Faults, wait_wcs
from metaroce_xdp.verbs_types import SendWR, WCStatus, WROpcode
from metaroce_xdp.wire import AETH, RETH, Op, encode
from scripted_players import Peer, nak_of

pytestmark = [pytest.mark.netns, pytest.mark.fabric(prefix="mrbkl")]

READ_LEN = 1 << 20            # 1024 responses of 1024 bytes
LOST = 8                      # the response lost once
MTU = 1024


def test_read_remainder_behind_a_backlog_completes(dp_loop):
    """One response of a 1 MiB READ lost once: one request for the remainder (a duplicate READ at the
    responder), no local ACK timeout while the old stream drained (timeout 14: 67 ms, far more than the stream
    takes, so an expiry would be the completer forgetting it asked), the data intact."""
    first = 100
    a, b = dp_loop(faults_ba=Faults(psn_drop_once=(first + LOST,)), size=2 << 20, timeout=14, retry_cnt=7)
    fi = dp_loop.injectors[-1]
    src = np.random.default_rng(3).integers(0, 256, READ_LEN, dtype=np.uint8)
    b.buf[:READ_LEN] = src
    sa0, sb0 = a.ctx.stats(), b.ctx.stats()
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(0, READ_LEN)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    (wc,) = wait_wcs([a, b], a, 1, timeout=60)
    sa1, sb1 = a.ctx.stats(), b.ctx.stats()
    assert fi.stats()["psn_dropped"] == 1, "the response was never lost: the test did not test anything"
    assert wc.status == WCStatus.SUCCESS, a.qp.query()
    assert zlib.crc32(a.buf[:READ_LEN]) == zlib.crc32(src)
    # one loss, one request for the remainder: no local ACK timeout while the old stream drained
    assert sa1["timeouts"] - sa0["timeouts"] == 0, sa1
    assert sa1["retransmits"] - sa0["retransmits"] == 1, sa1
    assert sb1["rx_dup"] - sb0["rx_dup"] == 1, sb1
    assert a.qp.query()["sq_outstanding"] == 0


def _bad_icrc(q, opcode, psn, payload, headers) -> None:
    """The frame the script would send, with an ICRC that does not match (a corrupted copy)."""
    a, b = q.pair.a, q.pair.b
    q.sock.send(encode(opcode, src_mac=b.mac, dst_mac=a.mac, src_ip=b.ipv4, dst_ip=a.ipv4, sport=0xC123,
                       dest_qp=q.qp.qp_num, psn=psn, ack_req=1, headers=headers, payload=payload, icrc=0x0BADC0DE))


def _icrc_drops(q) -> int:
    return q.ctx.loader.drops()["BAD_ICRC"] + q.ctx.stats()["rx_drop_icrc"]


def test_duplicates_and_out_of_sequence_requests_are_counted_and_cost_nothing(wire):
    """MR-DUP-002, MR-DUP-006, MR-DUP-010, MR-NAK-003, MR-ICRC-013, MR-SEC-031: the responder receives the
    packets of a 32-packet WRITE as a go-back-N leaves them: 0-9, then 20-25 (out of sequence: one NAK, all
    counted), 0-9 again (duplicates: counted, never placed again), a corrupted copy of 5 (ICRC: dropped,
    counted), then 10-31.  One sequence-error NAK leaves, at PSN 110; the WRITE lands whole."""
    q = Peer(wire, rq_psn=100, mtu=MTU)
    try:
        data = (np.arange(32 << 10, dtype=np.uint32).astype(np.uint8) ^ 0x3C).tobytes()
        ops = [Op.RDMA_WRITE_FIRST] + [Op.RDMA_WRITE_MIDDLE] * 30 + [Op.RDMA_WRITE_LAST]
        frames = [(ops[i], 100 + i, data[i * MTU:(i + 1) * MTU],
                   dict(reth=RETH(va=q.mr.addr, rkey=q.mr.rkey, dma_len=32 << 10)) if i == 0 else {})
                  for i in range(32)]
        s0, ic0 = q.ctx.stats(), _icrc_drops(q)
        q.send(frames[:10] + frames[20:26] + frames[:10])
        _bad_icrc(q, *frames[5])
        q.send(frames[10:])
        out = q.rounds()
        s1 = q.ctx.stats()
        naks = [(psn, syn) for psn, syn in nak_of(out) if syn != 0x1F]
        assert naks == [(110, 0x60)]
        assert s1["rx_dup"] - s0["rx_dup"] == 10 and s1["rx_oos"] - s0["rx_oos"] == 6
        assert _icrc_drops(q) - ic0 == 1
        assert q.qp.query()["rq_psn"] == 132 and nak_of(out)[-1] == (131, 0x1F)
        assert bytes(q.buf[:32 << 10]) == data
    finally:
        q.close()


def test_stale_and_old_stream_read_responses_are_counted_and_cost_nothing(wire):
    """MR-ACK-015, MR-RETRY-008, MR-RETRY-009, MR-RETRY-013, MR-ICRC-013, MR-DUP-003, MR-NAK-012: the requester
    receives the responses of a 32-packet READ as a lossy path leaves them, in one burst: 0-9, 20-25 (20
    reveals the loss: a retry from 110 is due), 0-9 again (stale), a corrupted copy of 5 (ICRC), then the old
    stream's 10-31.  Those continue the READ at the PSN the completer waits for, with the original's opcodes,
    which a remainder may carry (MR-DUP-003, MR-NAK-012): they are placed and the READ completes in that
    burst, so the retry never has to leave.  The stream the responder then sends for a remainder (FIRST at
    110 ... LAST at 131) is stale.  Every response not placed is counted and dropped, no local ACK timeout,
    the READ completes once with the right bytes."""
    q = Peer(wire, sq_psn=100, mtu=MTU, timeout=14)
    try:
        data = (np.arange(32 << 10, dtype=np.uint32).astype(np.uint8) ^ 0x5A).tobytes()
        q.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[q.sge(0, 32 << 10)],
                              remote_addr=0x100000, rkey=0x4321))
        sent = q.rounds(quiet_after=5)
        assert [(p.bth.opcode, p.bth.psn) for p in sent] == [(Op.RDMA_READ_REQUEST, 100)]
        ack = dict(aeth=AETH(syndrome=0x1F, msn=1))

        def stream(first):
            n = 132 - first
            ops = ([Op.RDMA_READ_RESPONSE_FIRST] + [Op.RDMA_READ_RESPONSE_MIDDLE] * (n - 2)
                   + [Op.RDMA_READ_RESPONSE_LAST])
            return {first + i: (ops[i], first + i, data[(first - 100 + i) * MTU:(first - 100 + i + 1) * MTU],
                                ack if ops[i] != Op.RDMA_READ_RESPONSE_MIDDLE else {}) for i in range(n)}

        old = stream(100)
        s0, ic0 = q.ctx.stats(), _icrc_drops(q)
        q.send([old[p] for p in [*range(100, 110), *range(120, 126), *range(100, 110)]])
        _bad_icrc(q, *old[105])
        q.send([old[p] for p in range(110, 132)])
        out = q.rounds(quiet_after=5)
        assert out == []
        (wc,) = q.cq.poll(4)
        assert (wc.wr_id, wc.status) == (1, WCStatus.SUCCESS)
        assert bytes(q.buf[:32 << 10]) == data
        new = stream(110)
        q.send([new[p] for p in range(110, 132)])
        out = q.rounds(quiet_after=5)
        s1 = q.ctx.stats()
        assert out == [] and q.cq.poll(4) == []
        assert s1["timeouts"] == s0["timeouts"]
        # 20-25, the ten stale ones and the remainder's stream after the READ completed: 38 counted, none placed
        assert s1["rx_rsp_stale"] - s0["rx_rsp_stale"] == 38
        assert _icrc_drops(q) - ic0 == 1
    finally:
        q.close()


def test_restart_at_the_psn_asked_for_is_accepted(wire):
    """MR-RETRY-008, MR-NAK-012, MR-DUP-008: after the requester asked for the rest of a READ again -- once on
    a gap, once more on its local ACK timer -- the responder's restarted stream (FIRST at the PSN asked for)
    is accepted and the READ completes with the right bytes, no bad response."""
    q = Peer(wire, sq_psn=100, mtu=MTU, timeout=16)                 # 268 ms local ACK timeout
    try:
        src = np.random.default_rng(8).integers(0, 256, 4096, dtype=np.uint8).tobytes()
        q.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[q.sge(0, 4096)],
                              remote_addr=0x100000, rkey=0x4321))
        assert [p.bth.psn for p in q.rounds(quiet_after=5)] == [100]
        ack = dict(aeth=AETH(syndrome=0x1F, msn=1))
        chunk = [src[i * MTU:(i + 1) * MTU] for i in range(4)]
        q.send([(Op.RDMA_READ_RESPONSE_FIRST, 100, chunk[0], ack),
                (Op.RDMA_READ_RESPONSE_MIDDLE, 102, chunk[2], {})])     # 101 lost
        again = q.rounds(quiet_after=5)
        assert [(p.bth.opcode, p.bth.psn) for p in again][:1] == [(Op.RDMA_READ_REQUEST, 101)]
        q.send([(Op.RDMA_READ_RESPONSE_FIRST, 101, chunk[1], ack)])      # the first replay's FIRST only
        later = []
        for _ in range(400):                                            # the local ACK timer asks again
            later += [p for p in q.rounds(1) if p.bth.psn == 102]
            if later:
                break
        assert [(p.bth.opcode, p.bth.psn) for p in later] == [(Op.RDMA_READ_REQUEST, 102)]
        q.send([(Op.RDMA_READ_RESPONSE_FIRST, 102, chunk[2], ack),
                (Op.RDMA_READ_RESPONSE_LAST, 103, chunk[3], ack)])
        q.rounds(quiet_after=5)
        wcs = q.cq.poll(4)
        assert [(w.wr_id, w.status) for w in wcs] == [(1, WCStatus.SUCCESS)], q.qp.query()
        assert bytes(q.buf[:4096]) == src
    finally:
        q.close()
