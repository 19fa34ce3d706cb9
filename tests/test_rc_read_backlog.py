"""A large RDMA READ recovers from a lost response while the requester is slower than the responder
(MR-RETRY-002 to MR-RETRY-004, MR-RETRY-008, MR-RETRY-013, MR-DUP-003, MR-DUP-008).

The fault matrix found an 8 MiB READ failing with IBV_WC_RETRY_EXC_ERR at 1 % loss: the requester's
engine takes READ RESPONSEs more slowly than the responder's engine sends them, so after a lost response
its receive queue still holds the rest of the stream the responder sent before it saw the request for
the remainder, and the restarted stream waits behind it.  Draining that backlog took several local ACK
timeouts; each one re-requested the remainder, the responder restarted its stream behind the backlog
again, and the eighth expiry without progress failed the READ.

Here the same happens deterministically in process: a clock that moves a fixed step per engine round,
a requester that takes 16 frames per round while the responder sends ~60, and one lost response.

The backlogs themselves shrink when the frames nobody keeps cost little: the compiled skippers
(burst.rx_skip_run for the responder's duplicates and out-of-sequence requests, burst.rx_rsp_skip_run
for the completer's stale and old-stream READ RESPONSEs) are checked here against the per-packet path.
"""
from __future__ import annotations

import types
import zlib

import numpy as np

from metaroce_xdp.rc import engine as engine_mod
from metaroce_xdp.wire.psn import psn_diff
from rc_players import SendWR, WCStatus, WROpcode, loop_pair, wait_wcs

READ_LEN = 1 << 20            # 1024 responses of 1024 bytes
LOST = 8                      # the response lost once


class StepClock:
    """time for the engines: each reading is `step_ns` after the previous one."""

    def __init__(self, step_ns: int) -> None:
        self.t = 10**12
        self.step = step_ns

    def monotonic_ns(self) -> int:
        self.t += self.step
        return self.t


def test_read_remainder_behind_a_backlog_completes(monkeypatch):
    clock = StepClock(250_000)                                   # 0.25 ms per engine round
    fake = types.SimpleNamespace(monotonic_ns=clock.monotonic_ns, monotonic=lambda: clock.t / 1e9,
                                 sleep=lambda s: None)
    monkeypatch.setattr(engine_mod, "time", fake)
    a, b = loop_pair(size=2 << 20, timeout=8, retry_cnt=7)     # T = 1.05 ms: about 2 rounds of A
    a.ctx.engine.budget = 16                                     # A: a slow requester
    src = np.random.default_rng(3).integers(0, 256, READ_LEN, dtype=np.uint8)
    b.buf[:READ_LEN] = src
    first = a.qp.requester.psn_next
    port_ba = b.ctx.port
    deliver = port_ba._deliver
    lost = []

    def drop_once(frame: bytes) -> None:
        psn = int.from_bytes(frame[42 + 9:42 + 12], "big")      # Ethernet 14 + IPv4 20 + UDP 8, BTH PSN
        if frame[42] in (0x0D, 0x0E, 0x0F) and psn == (first + LOST) & 0xFFFFFF and not lost:
            lost.append(psn)
            return
        deliver(frame)

    port_ba._deliver = drop_once
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(0, READ_LEN)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    (wc,) = wait_wcs([a, b], a, 1, timeout=60)
    q = a.qp.query()
    assert lost, "the response was never lost: the test did not test anything"
    assert wc.status == WCStatus.SUCCESS, q
    assert zlib.crc32(a.buf[:READ_LEN]) == zlib.crc32(src)
    # one loss, one request for the remainder: no local ACK timeout while the old stream drained
    assert q["timeouts"] == 0, q
    assert b.qp.responder.dup_read_replays == 1, b.qp.query()
    assert psn_diff(a.qp.requester.acked_psn, first) >= 0 or a.qp.requester.sq == []


def _skip_case(burst: bool):
    """B receives, in one burst, the frames of a 32-packet WRITE as a go-back-N leaves them: 0-9, then
    20-25 (out of sequence: one NAK, the rest discarded), 0-9 again (duplicates), a corrupted copy
    of 5 (ICRC), then 10-31.  Returns what B sent and counted, and the target bytes."""
    a, b = loop_pair(burst=burst, mtu=1024)
    held: list[bytes] = []
    a.ctx.port._deliver = held.append                            # A's frames are kept, not delivered
    a.buf[:32 << 10] = np.arange(32 << 10, dtype=np.uint32).astype(np.uint8)
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 32 << 10)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    a.ctx.engine.progress()
    assert len(held) == 32
    bad = bytearray(held[5])
    bad[100] ^= 0x10
    sent: list[bytes] = []
    port = b.ctx.port
    commit = port.tx_commit
    port.tx_commit = lambda off, n: (sent.append(bytes(port._scratch[off:off + n])), commit(off, n))
    port.inbox.extend(held[:10] + held[20:26] + held[:10] + [bytes(bad)] + held[10:])
    while port.inbox:
        b.ctx.engine.progress()
    b.ctx.engine.progress()
    q = b.qp.query()
    keep = ("rq_psn", "msn", "bytes_received", "seq_naks_sent", "duplicates")
    st = b.ctx.engine.stats
    return sent, {k: q[k] for k in keep}, (st["rx"], st["drop_icrc"]), bytes(b.buf[:32 << 10]), st


def test_skipped_duplicates_and_out_of_sequence_frames_match_the_per_packet_path():
    """burst.rx_skip_run (MR-DUP-002, MR-DUP-006, MR-DUP-010, MR-NAK-003, MR-ICRC-013): the same ACKs
    and NAK leave, the same counters move, the same bytes land as frame by frame."""
    fast, slow = _skip_case(True), _skip_case(False)
    assert fast[:4] == slow[:4]
    assert fast[1]["duplicates"] == 10 and fast[1]["seq_naks_sent"] == 1 and fast[2][1] == 1
    assert fast[4]["rx_skipped"] == 15                          # 21-25 after the NAK, and the ten duplicates


def _rsp_skip_case(burst: bool):
    """A receives, in one burst, the responses of a 32-packet READ as a lossy path leaves them: 0-9,
    20-25 (20 reveals the loss: one request for the remainder; the rest are the old stream), 0-9 again
    (stale), a corrupted copy of 5 (ICRC), then 10-31.  Returns what A sent and counted, its
    completion and the bytes it placed."""
    a, b = loop_pair(burst=burst, mtu=1024, timeout=14)
    b.buf[:32 << 10] = np.arange(32 << 10, dtype=np.uint32).astype(np.uint8) ^ 0x5A
    held: list[bytes] = []
    b.ctx.port._deliver = held.append                            # B's responses are kept, not delivered
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(0, 32 << 10)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    a.ctx.engine.progress()
    b.ctx.engine.progress()
    assert len(held) == 32
    bad = bytearray(held[5])
    bad[100] ^= 0x10
    sent: list[bytes] = []
    port = a.ctx.port
    commit = port.tx_commit
    port.tx_commit = lambda off, n: (sent.append(bytes(port._scratch[off:off + n])), commit(off, n))
    port.inbox.extend(held[:10] + held[20:26] + held[:10] + [bytes(bad)] + held[10:])
    wcs = wait_wcs([a], a, 1)
    q = a.qp.query()
    keep = ("acked_psn", "retransmits", "timeouts", "naks_received", "rx_stale_rsp", "rx_ghost_rsp", "rx_bad_rsp")
    st = a.ctx.engine.stats
    return (sent, {k: q[k] for k in keep}, (st["rx"], st["drop_icrc"]), [(w.wr_id, w.status) for w in wcs],
            bytes(a.buf[:32 << 10]), st)


def test_skipped_read_responses_match_the_per_packet_path():
    """burst.rx_rsp_skip_run (MR-ACK-015, MR-RETRY-009, MR-RETRY-013, MR-ICRC-013): the same request
    for the remainder leaves, the same counters move, the READ completes with the same bytes as
    frame by frame."""
    fast, slow = _rsp_skip_case(True), _rsp_skip_case(False)
    assert fast[:5] == slow[:5]
    assert fast[1]["rx_stale_rsp"] == 10 and fast[1]["retransmits"] == 1 and fast[2][1] == 1
    assert fast[3] == [(1, WCStatus.SUCCESS)]
    assert fast[4] == bytes(np.arange(32 << 10, dtype=np.uint32).astype(np.uint8) ^ 0x5A)
    assert fast[5]["rx_skipped"] == 15                          # 21-25 during the retry, and the ten stale ones


def _rsp(frame: bytes) -> tuple[int, int]:
    """(opcode, PSN) of an IPv4 frame without VLAN."""
    return frame[42], int.from_bytes(frame[42 + 9:42 + 12], "big")


def test_restart_at_a_psn_asked_for_after_the_retry_was_decided():
    """MR-RETRY-008, MR-NAK-012, MR-DUP-008.  The 10-minute soak failed a 1 MiB READ with
    IBV_WC_BAD_RESP_ERR ("READ_RESPONSE_ONLY inside a response stream"): a timeout decided a retry,
    the stream answering the previous request for the remainder arrived before the new request
    left, and the new request asked from a later PSN -- whose restarted stream (FIRST/ONLY there) the
    completer no longer expected.  A FIRST or ONLY inside a stream is accepted exactly at the PSNs
    the requester asked for the rest at."""
    a, b = loop_pair(burst=False, timeout=14)
    src = np.random.default_rng(8).integers(0, 256, 4096, dtype=np.uint8)
    b.buf[:4096] = src
    f = a.qp.requester.psn_next
    held: list[bytes] = []
    b.ctx.port._deliver = held.append                  # B's responses wait here until handed to A
    inbox = a.ctx.port.inbox

    def from_b(opcode_psns):
        for fr in list(held):
            if _rsp(fr) in opcode_psns:
                inbox.append(fr)
        held.clear()

    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(0, 4096)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    a.ctx.engine.progress()                            # READ REQUEST at f
    b.ctx.engine.progress(), b.ctx.engine.progress()   # FIRST f, MIDDLE f+1, f+2, LAST f+3
    from_b({(0x0D, f), (0x0E, f + 2)})                 # f+1 is lost
    a.ctx.engine.progress()                            # A: f placed, f+2 early -> asks again from f+1
    b.ctx.engine.progress(), b.ctx.engine.progress()   # B replays from f+1: FIRST f+1, MIDDLE f+2, LAST f+3
    replay1 = [fr for fr in held]
    held.clear()
    c = a.qp.completer
    c.check_timer(a.ctx.engine.now + 10**12)           # the local ACK timer decides another retry ...
    inbox.extend(fr for fr in replay1 if _rsp(fr) == (0x0D, f + 1))
    a.ctx.engine.progress()                            # ... FIRST f+1 lands, then the request leaves at f+2
    assert a.qp.requester.sq[0].restart_psns == {f + 1, f + 2}
    b.ctx.engine.progress(), b.ctx.engine.progress()   # B restarts from f+2: FIRST f+2, LAST f+3
    from_b({(0x0D, f + 2), (0x0F, f + 3)})             # the rest of the first replay never arrives
    wcs = []
    for _ in range(20):
        a.ctx.engine.progress()
        wcs += a.cq.poll(4)
        if wcs:
            break
    assert [(w.wr_id, w.status) for w in wcs] == [(1, WCStatus.SUCCESS)], a.qp.query()
    assert a.qp.query()["rx_bad_rsp"] == 0
    assert bytes(a.buf[:4096]) == bytes(src)
