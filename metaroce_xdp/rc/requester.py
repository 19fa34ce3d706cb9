"""Requester: send queue -> request packets (spec 03-compat-rc.md).

Segments messages by path MTU (MR-RC-002, MR-RC-003), assigns PSNs (MR-RC-004),
limits in-flight packets and outstanding READ/ATOMICs (max_rd_atomic, MR-RC-009),
sets AckReq on the last packet of each message and periodically inside long
ones (MR-ACK-013), and rewinds for go-back-N when the completer asks
(MR-RETRY-006).  PSNs of a WQE are assigned once, when first sent, and reused
on every retransmission (MR-RC-005).
"""
from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from ..verbs_types import SendFlags, WCStatus, WROpcode
from ..wire.opcodes import Op
from ..wire.psn import PSN_MASK, psn_diff
from .burst import segment_opcode
from .dcqcn import WIRE_OVERHEAD
from .wqe import SendWQE

if TYPE_CHECKING:
    from .qp import QP

_RETH = struct.Struct("!QII")
_IMM = struct.Struct("!I")              # ImmDt, and IETH (a 4-byte R_Key in the same place)
_ATOM = struct.Struct("!QIQQ")

ACKREQ_EVERY = 32          # AckReq inside long messages, so ACKs keep the window open (MR-ACK-013: <= 64)


class Requester:
    def __init__(self, qp: "QP") -> None:
        self.qp = qp
        self.sq: list[SendWQE] = []     # posted, not yet completed; head is the oldest
        self.cursor = 0                 # index in sq of the next WQE to (re)transmit
        self.psn_next = 0               # next PSN never used
        self.acked_psn = PSN_MASK       # highest cumulatively acknowledged PSN
        self.pause_until = 0            # RNR back-off: no sending before this time (ns)
        self.max_inflight = qp.ctx.engine.window   # packets between the oldest unacked PSN and the next
        self.packets_sent = 0
        self.retransmits = 0
        self.bytes_sent = 0

    @property
    def burst(self) -> bool:
        """Segment SEND/WRITE messages with the compiled builder (burst.py).  Read from the engine at
        every use, not cached: a test (or METAROCE_NO_BURST) that turns Engine.burst_tx off after the QP
        exists must get the per-packet path."""
        return self.qp.ctx.engine.burst_tx

    def reset(self, sq_psn: int) -> None:
        self.psn_next = sq_psn & PSN_MASK
        self.acked_psn = (sq_psn - 1) & PSN_MASK
        self.cursor = 0

    # -- helpers ---------------------------------------------------------
    def oldest_unacked_psn(self) -> int:
        for w in self.sq:
            if w.first_psn is None:
                break
            if w.done:
                continue
            if w.is_rd_atomic:
                return (w.first_psn + w.resp_bytes // self.qp.pmtu) & PSN_MASK
            nxt = (self.acked_psn + 1) & PSN_MASK
            d = psn_diff(nxt, w.first_psn)
            return nxt if 0 < d < w.npsn else w.first_psn
        return self.psn_next

    def send_psn(self) -> int:
        """The PSN the next packet goes out with: inside the WQE being sent (a go-back-N moves it back),
        else psn_next.  psn_next runs a whole WQE ahead as soon as the WQE starts, so it does not say
        what is in flight."""
        if self.cursor < len(self.sq):
            w = self.sq[self.cursor]
            if w.first_psn is not None:
                return (w.first_psn + w.sent) & PSN_MASK
        return self.psn_next

    def note_acked(self, psn: int) -> None:
        if psn_diff(psn, self.acked_psn) > 0:
            self.acked_psn = psn

    def outstanding(self) -> bool:
        """True when some sent PSN is not yet acknowledged."""
        return any(w.first_psn is not None and not w.done for w in self.sq)

    def _rd_atomic_inflight(self, upto: int) -> int:
        return sum(1 for w in self.sq[:upto] if w.is_rd_atomic and w.first_psn is not None and not w.done)

    # -- transmit ----------------------------------------------------------
    def progress(self, budget: int) -> int:
        """Send up to `budget` packets; returns how many were sent."""
        qp = self.qp
        if not qp.can_send() or qp.now() < self.pause_until:
            return 0
        # DCQCN pacing (MR-CC-034): new packets and retransmissions alike (MR-CNP-009)
        rp = qp.dcqcn.rp
        budget = rp.allowance(qp.now(), budget, qp.pmtu + WIRE_OVERHEAD)
        if budget <= 0:
            return 0
        bytes0 = self.bytes_sent
        sent = 0
        mtu = qp.pmtu
        una = self.oldest_unacked_psn()
        eng = qp.ctx.engine
        window = self.max_inflight
        if 0 < eng.qp_share < window:
            window = eng.qp_share                   # this round's share of the port's in-flight budget
        while sent < budget and self.cursor < len(self.sq):
            w = self.sq[self.cursor]
            if w.done:
                self.cursor += 1
                continue
            new = w.first_psn is None
            if new:
                if not qp.may_start_wqe():          # SQD: no new WQE starts (MR-QP-013)
                    break
                if w.is_rd_atomic and qp.attr_max_rd_atomic == 0 and w.status_error is None:
                    w.status_error = WCStatus.LOC_QP_OP_ERR     # no READ/ATOMIC allowed (MR-RC-009, Table 7-6)
                if w.status_error is not None:      # local check failed: fails when oldest (MR-RC-022)
                    if self.cursor == 0:
                        qp.fail_unsent(w)
                    break
                if w.is_rd_atomic and self._rd_atomic_inflight(self.cursor) >= qp.attr_max_rd_atomic:
                    break
                # MR-RC-013: a fenced WQE waits for earlier READ/ATOMICs to complete
                if (w.wr.send_flags & SendFlags.FENCE) and self._rd_atomic_inflight(self.cursor):
                    break
                if w.opcode == WROpcode.RDMA_READ or w.opcode in (WROpcode.RDMA_WRITE, WROpcode.RDMA_WRITE_WITH_IMM,
                                                                  WROpcode.SEND, WROpcode.SEND_WITH_IMM,
                                                                  WROpcode.SEND_WITH_INV):
                    w.npsn = max(1, -(-w.length // mtu))
                else:
                    w.npsn = 1
                w.first_psn = self.psn_next
                self.psn_next = (self.psn_next + w.npsn) & PSN_MASK
                qp.publish_snd_nxt()            # before any packet leaves: the kernel checks ACKs against it
                w.sent = 0
            psn = (w.first_psn + w.sent) & PSN_MASK
            out = psn_diff(psn, una)
            # the port's budget spent: only a QP with fewer than 16 packets out may still send (a
            # retransmission after a timeout must never wait for other QPs' packets)
            if out >= window or (eng.infl_left <= 0 and out >= 16):
                break
            if (self.burst and w.opcode in (WROpcode.RDMA_WRITE, WROpcode.RDMA_WRITE_WITH_IMM, WROpcode.SEND,
                                            WROpcode.SEND_WITH_IMM)):
                room = min(budget - sent, window - out, w.npsn - w.sent, max(eng.infl_left, 16 - out))
                made = eng.emit_segments(qp, w, room)
                if made == 0:
                    break
                w.sent += made
                sent += made
                eng.infl_left -= made
                if w.sent >= w.npsn:
                    self.cursor += 1
            elif w.opcode in (WROpcode.RDMA_WRITE, WROpcode.RDMA_WRITE_WITH_IMM, WROpcode.SEND, WROpcode.SEND_WITH_IMM,
                              WROpcode.SEND_WITH_INV):      # SEND WITH INVALIDATE: this path only
                k = w.sent
                n = w.npsn
                off = k * mtu
                plen = min(mtu, w.length - off)
                last = k == n - 1
                imm = w.opcode in (WROpcode.RDMA_WRITE_WITH_IMM, WROpcode.SEND_WITH_IMM)
                if w.opcode in (WROpcode.RDMA_WRITE, WROpcode.RDMA_WRITE_WITH_IMM):
                    opcode = segment_opcode(True, imm, k, n)
                    ext = b""
                    if k == 0:                              # RETH in FIRST/ONLY only (MR-RC-007, MR-XH-002)
                        ext = _RETH.pack(w.wr.remote_addr, w.wr.rkey, w.length)
                elif w.opcode == WROpcode.SEND_WITH_INV:
                    # FIRST, MIDDLE, then LAST/ONLY WITH INVALIDATE carrying the IETH (MR-RC-001, MR-RC-003)
                    if n == 1:
                        opcode = Op.SEND_ONLY_WITH_INVALIDATE
                    elif last:
                        opcode = Op.SEND_LAST_WITH_INVALIDATE
                    else:
                        opcode = Op.SEND_FIRST if k == 0 else Op.SEND_MIDDLE
                    ext = _IMM.pack(w.wr.invalidate_rkey & 0xFFFFFFFF) if last else b""
                else:
                    opcode = segment_opcode(False, imm, k, n)
                    ext = b""
                if last and imm:
                    ext += _IMM.pack(w.wr.imm_data & 0xFFFFFFFF)
                # MR-BTH-003: SE only on the last packet of a solicited SEND / WRITE WITH IMMEDIATE
                se = 1 if (last and w.wr.send_flags & SendFlags.SOLICITED and
                           w.opcode in (WROpcode.SEND, WROpcode.SEND_WITH_IMM, WROpcode.SEND_WITH_INV,
                                        WROpcode.RDMA_WRITE_WITH_IMM)) else 0
                ack_req = 1 if (last or (k + 1) % ACKREQ_EVERY == 0) else 0
                qp.emit(opcode, psn, ack_req, se, ext, w.data, off, plen)
                self.bytes_sent += plen
                w.sent += 1
                sent += 1
                eng.infl_left -= 1
                if w.sent >= n:
                    self.cursor += 1
            elif w.opcode == WROpcode.RDMA_READ:
                k = w.sent if w.sent else w.resp_bytes // mtu      # retry resumes at the first missing response
                # (MR-RETRY-008: READ REQUEST for the remainder, same R_Key)
                off = k * mtu
                ext = _RETH.pack(w.wr.remote_addr + off, w.wr.rkey, w.length - off)
                if k:
                    # its responses start again with FIRST/ONLY at this PSN.  Recorded as the request
                    # leaves, not when the retry was decided: a stream that answers an earlier request
                    # may arrive in between, and the PSN asked for is known only now.
                    if w.restart_psns is None:
                        w.restart_psns = set()
                    w.restart_psns.add((w.first_psn + k) & PSN_MASK)
                qp.emit(Op.RDMA_READ_REQUEST, (w.first_psn + k) & PSN_MASK, 1, 0, ext, None, 0, 0)
                w.sent = w.npsn                                    # one request covers the rest
                sent += 1
                eng.infl_left -= w.npsn - k                        # its responses
                self.cursor += 1
            else:
                if w.opcode == WROpcode.ATOMIC_CMP_AND_SWP:
                    ext = _ATOM.pack(w.wr.remote_addr, w.wr.rkey, w.wr.swap & (2**64 - 1), w.wr.compare_add & (2**64 - 1))
                    opcode = Op.COMPARE_SWAP
                else:
                    ext = _ATOM.pack(w.wr.remote_addr, w.wr.rkey, w.wr.compare_add & (2**64 - 1), 0)
                    opcode = Op.FETCH_ADD
                qp.emit(opcode, w.first_psn, 1, 0, ext, None, 0, 0)
                w.sent = 1
                sent += 1
                self.cursor += 1
        self.packets_sent += sent
        rp.on_sent(self.bytes_sent - bytes0 + sent * WIRE_OVERHEAD)
        return sent

    # -- go-back-N -----------------------------------------------------------
    def retry_from(self, psn: int) -> None:
        """Rewind so the next packet sent is `psn` (go-back-N, MR-RETRY-006); the PSNs of the
        WQEs are kept (MR-RC-005)."""
        for i, w in enumerate(self.sq):
            if w.done or w.first_psn is None:
                continue
            d = psn_diff(psn, w.first_psn)
            if d < w.npsn:
                self.cursor = i
                if w.opcode == WROpcode.RDMA_READ:
                    w.sent = 0       # re-request from the first missing response
                else:
                    w.sent = max(0, d)
                for later in self.sq[i + 1:]:
                    if later.first_psn is not None:
                        later.sent = 0
                self.retransmits += 1
                return
        # nothing outstanding at or after psn: nothing to resend
