"""Responder: request packets -> memory, receive completions, ACKs and NAKs
(spec 03-compat-rc.md: MR-RC, MR-ACK, MR-NAK, MR-RNR, MR-DUP, MR-ATOM; 08: MR-MEM).

Ingress is a validation pipeline (Table 3-4, MR-NAK-014), in this order: PSN (expected, duplicate or
out of sequence), opcode sequence, QP access flags, receive WQE (RNR) or
responder resources, lengths, key / PD / access / bounds -- and only then is
memory touched.  READ and ATOMIC requests are remembered in a small ring of
responder resources (max_dest_rd_atomic) so duplicates are re-executed (READ,
after the same checks again) or replayed (ATOMIC) without touching memory twice.
"""
from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import numpy as np

from ..verbs_types import Access, QPState, WC, WCFlags, WCOpcode, WCStatus
from ..wire.headers import (AETH_ACK, AETH_CREDIT_INVALID, AETH_NAK, AETH_RNR_NAK, NAK_INVALID_REQUEST,
                            NAK_PSN_SEQ_ERR, NAK_REMOTE_ACCESS_ERR, NAK_REMOTE_OP_ERR)
from ..wire.opcodes import MI, Op
from ..wire.psn import PSN_MASK, psn_diff
from ..wire.fastpath import TABLES
from .burst import rx_skip_run, rx_write_run
from ..verbs_types import EventType
from .wqe import scatter

if TYPE_CHECKING:
    from .qp import QP
    from .rxparse import RxPkt

_AETH = struct.Struct("!I")
_AETH_ORIG = struct.Struct("!IQ")
U64_MASK = (1 << 64) - 1
DMA_LEN_MAX = 1 << 31                      # MR-XH-004
SNAPSHOT_MAX = 16 << 20                    # the largest unsent READ copied aside for a later request (_protect_reads)
# the asynchronous event of a responder error, by NAK code (MR-QP-030)
_NAK_EVENT = {NAK_INVALID_REQUEST: EventType.QP_REQ_ERR, NAK_REMOTE_ACCESS_ERR: EventType.QP_ACCESS_ERR,
              NAK_REMOTE_OP_ERR: EventType.QP_FATAL}


class Resource:
    """A remembered READ (first PSN, response count, VA, R_Key, DMA Length) or ATOMIC (PSN,
    original value): IBTA responder resources, MR-DUP-007.  A re-executed READ is a Resource of
    its own whose `origin` is the saved one."""
    __slots__ = ("kind", "psn", "npsn", "mr", "offset", "length", "orig", "va", "rkey", "origin", "mem", "mem_off")

    def __init__(self, kind: str, psn: int, npsn: int, mr, offset: int, length: int, va: int = 0,
                 rkey: int = 0, origin: "Resource | None" = None) -> None:
        self.kind = kind
        self.psn = psn
        self.npsn = npsn
        self.mr = mr
        self.offset = offset
        self.length = length
        self.orig = 0
        self.va = va
        self.rkey = rkey
        self.origin = origin
        # where READ RESPONSE data comes from: the MR's memory at `offset`, or a private copy of the part
        # not yet sent, taken before a later request wrote over it (Responder._protect_reads)
        self.mem = None
        self.mem_off = offset


class Responder:
    def __init__(self, qp: "QP") -> None:
        self.qp = qp
        self.epsn = 0
        self.msn = 0
        self.rq: list = []                  # posted receive WQEs
        self.cur_recv = None                # receive WQE being filled by a multi-packet SEND
        self.recv_off = 0
        self.recv_status = WCStatus.SUCCESS
        self.write_mr = None                # WRITE in progress: MR, offset, bytes left
        self.write_off = 0
        self.write_left = 0
        self.write_len = 0                  # DMA Length of the WRITE in progress (byte_len, MR-RC-019)
        self.in_progress = 0                # 0 none, MI.SEND or MI.WRITE in the middle of a message
        self.resources: list[Resource] = []
        self.nak_sent = False               # one PSN-sequence-error NAK per ePSN (MR-NAK-003)
        self.ack_pending = False
        self.bytes_received = 0
        self.bytes_sent = 0                 # READ response payload
        self.dup_requests = 0
        self.dup_read_discards = 0          # duplicate READs inconsistent with the saved one (MR-DUP-003)
        self.dup_read_replays = 0           # duplicate READs re-executed (MR-DUP-003)
        self.seq_naks = 0
        self.out_of_seq = 0                 # requests after epsn, every one discarded (MR-NAK-002, MR-SEC-031)
        self.rnr_naks_sent = 0
        self.rkey_violations = 0            # remote key check failures, NAK code 2 (MR-MEM-019, MR-SEC-006)
        self.read_queue: list = []          # [resource, next k]: READ responses still to send
        # other responses (ACK, NAK, ATOMIC ACKNOWLEDGE) held behind queued READ responses of earlier
        # PSNs, in order: (psn, opcode, ext, coalescable ACK) (MR-RC-025)
        self.held: list = []
        self.drain_in_err = False           # a fatal NAK is held: send what is before it, then it
        self._st = np.zeros(6, np.int64)    # state exchanged with burst.rx_write_run
        # PSN of the first of the READ REQUESTs executed last, None when the last request executed was
        # not a READ: a duplicate SEND/WRITE is then re-ACKed at read_run - 1 (MR-DUP-002, as rxe does)
        self.read_run: int | None = None

    def reset(self, rq_psn: int) -> None:
        self.epsn = rq_psn & PSN_MASK
        self.msn = 0
        self.read_run = None

    # -- outputs --------------------------------------------------------------
    def _send_syndrome(self, psn: int, syndrome: int, ack: bool = False) -> None:
        self._respond(Op.ACKNOWLEDGE, psn, _AETH.pack((syndrome << 24) | (self.msn & 0xFFFFFF)), ack)

    def _respond(self, opcode: int, psn: int, ext: bytes, ack: bool = False) -> None:
        """Send an ACKNOWLEDGE or ATOMIC ACKNOWLEDGE -- unless READ responses of an earlier PSN are still
        queued: then it is held until they have left, so that responses leave in PSN order as if each
        request were finished before the next (MR-RC-025); a requester such as rxe takes an ACK beyond an
        unanswered READ for an implied NAK.  A held ACK (`ack`) is replaced by the next coalesced one
        (MR-ACK-003).  With no READ queued this costs one test."""
        if self.read_queue and (self.held or self._behind_read(psn)):
            h = self.held
            if ack and h and h[-1][3] and not any(psn_diff(e[0].psn, h[-1][0]) > 0 > psn_diff(e[0].psn, psn)
                                                  for e in self.read_queue):
                h[-1] = (psn, opcode, ext, True)      # no READ queued in between: coalesce
            else:
                h.append((psn, opcode, ext, ack))
            return
        self.qp.emit(opcode, psn, 0, 0, ext, None, 0, 0)

    def _behind_read(self, psn: int) -> bool:
        """True while a queued READ response stream starts before `psn` (MR-RC-025)."""
        return any(psn_diff(e[0].psn, psn) < 0 for e in self.read_queue)

    def _release_held(self) -> None:
        """Send the held responses whose earlier READ responses have all left (MR-RC-025)."""
        h = self.held
        while h and not self._behind_read(h[0][0]):
            psn, opcode, ext, _ = h.pop(0)
            self.qp.emit(opcode, psn, 0, 0, ext, None, 0, 0)
        if not h:
            self.drain_in_err = False

    def flush_ack(self) -> None:
        """Coalesced ACK for everything received so far: PSN epsn - 1, current msn, credit
        code 0x1F (MR-ACK-001, MR-ACK-003, MR-ACK-009); also re-ACKs duplicates (MR-DUP-002).
        Held behind queued READ responses of earlier PSNs (MR-RC-025)."""
        if self.held:
            self._release_held()
        if self.ack_pending:
            self.ack_pending = False
            # after READs only duplicates can have asked for it: ACK before the READs (MR-DUP-002 r - 1),
            # so that a requester whose READ responses were lost does not take the ACK for them
            last = self.epsn if self.read_run is None else self.read_run
            self._send_syndrome((last - 1) & PSN_MASK, AETH_ACK | AETH_CREDIT_INVALID, ack=True)

    def _nak(self, code: int, psn: int, fatal: bool, status: WCStatus, why: str) -> None:
        """NAK with the offending packet's PSN (MR-NAK-006 to MR-NAK-008); a fatal one completes the
        receive WQE in use, then moves the QP to ERR (MR-NAK-009, MR-QP-024) and raises the
        asynchronous event of its code (MR-QP-030)."""
        self.flush_ack()
        self._send_syndrome(psn, AETH_NAK | code)
        if code == NAK_REMOTE_ACCESS_ERR:
            self.rkey_violations += 1
            self.qp.ctx.engine.rae_by_src[self.qp.dgid or "?"] += 1       # MR-SEC-006: per source too
        if fatal:
            self.qp.log(f"responder error: {why}")
            if self.cur_recv is not None:
                self.qp.recv_cq.push(WC(wr_id=self.cur_recv.wr_id, status=status, opcode=WCOpcode.RECV,
                                        qp_num=self.qp.qp_num))
                self.cur_recv = None
            if self.qp.state != QPState.ERR:
                self.qp.to_error(None, why)
                self.qp.ctx.raise_event(_NAK_EVENT.get(code, EventType.QP_FATAL), qp=self.qp, reason=why)
            # the NAK held behind READ responses of earlier PSNs: the engine sends them, then the NAK,
            # although the QP is in ERR (MR-RC-025)
            self.drain_in_err = bool(self.held)

    # -- input ----------------------------------------------------------------
    def on_request(self, pkt: "RxPkt") -> None:
        if pkt.op.mask & MI.NATIVE:
            # native opcodes on a compat connection are dropped, no NAK (MR-OPC-004), and counted
            # (WRONG_PROFILE) before they get here: by the XDP program or Engine._rx_frame
            return
        d = psn_diff(pkt.psn, self.epsn)
        if d > 0:
            # out of sequence: NAK once per ePSN, drop (MR-NAK-002, MR-NAK-003), count each (MR-SEC-031)
            self.out_of_seq += 1
            if not self.nak_sent:
                self.nak_sent = True
                self.seq_naks += 1
                self.flush_ack()
                self._send_syndrome(self.epsn, AETH_NAK | NAK_PSN_SEQ_ERR)
            return
        if d < 0:
            self._duplicate(pkt)
            return
        self.nak_sent = False
        op = pkt.op
        m = op.mask
        # opcode sequence: continue the message in progress, or start a new one (MR-RC-016)
        if self.in_progress:
            if not (m & self.in_progress) or (m & MI.START):
                self._nak(NAK_INVALID_REQUEST, pkt.psn, True, WCStatus.REM_INV_REQ_ERR,
                          f"{op.name} inside a {'SEND' if self.in_progress == MI.SEND else 'WRITE'}")
                return
        elif not (m & MI.START) and (m & (MI.SEND | MI.WRITE)):
            self._nak(NAK_INVALID_REQUEST, pkt.psn, True, WCStatus.REM_INV_REQ_ERR, f"{op.name} without FIRST")
            return
        need = (Access.REMOTE_WRITE if m & MI.WRITE else Access.REMOTE_READ if m & MI.READ
                else Access.REMOTE_ATOMIC if m & MI.ATOMIC else Access(0))
        if need and (m & MI.START) and not (self.qp.access & need):
            # the QP does not allow this operation at all: invalid request, not an
            # access error -- the MR's own flags are what give code 2 (MR-RC-017, MR-NAK-006(b))
            self._nak(NAK_INVALID_REQUEST, pkt.psn, True, WCStatus.REM_INV_REQ_ERR,
                      f"{op.name} not allowed by the QP's access flags")
            return
        if m & MI.SEND:
            self._send(pkt)
        elif m & MI.WRITE:
            self._write(pkt)
        elif m & MI.READ:
            self._read(pkt)
        elif m & MI.ATOMIC:
            self._atomic(pkt)
        else:
            self._nak(NAK_INVALID_REQUEST, pkt.psn, True, WCStatus.REM_INV_REQ_ERR, f"unexpected {op.name}")

    def _len_ok(self, pkt: "RxPkt") -> bool:
        """MR-RC-010: FIRST/MIDDLE carry exactly one path MTU; LAST 1..MTU; ONLY 0..MTU."""
        n = len(pkt.payload)
        mtu = self.qp.pmtu
        m = pkt.op.mask
        if not (m & MI.END):
            return n == mtu
        if not (m & MI.START):
            return 1 <= n <= mtu
        return n <= mtu

    def _take_recv(self, pkt: "RxPkt") -> bool:
        """A receive WQE for this message (MR-OPC-008), or an RNR NAK with the packet's PSN and
        epsn, msn, op_state left unchanged (MR-RNR-001, MR-RNR-003)."""
        if self.rq:
            self.cur_recv = self.rq.pop(0)
            self.recv_off = 0
            self.recv_status = WCStatus.SUCCESS
            return True
        self.flush_ack()
        self.rnr_naks_sent += 1
        self._send_syndrome(pkt.psn, AETH_RNR_NAK | (self.qp.attr_min_rnr_timer & 0x1F))
        return False

    def _advance(self, pkt: "RxPkt", npsn: int = 1) -> None:
        self.epsn = (self.epsn + npsn) & PSN_MASK
        self.read_run = None
        if pkt.ack_req:
            self.ack_pending = True

    def _send(self, pkt: "RxPkt") -> None:
        m = pkt.op.mask
        # Table 3-4 (MR-NAK-014): the receive WQE (RNR, row 4) before the lengths (row 5)
        if m & MI.RWR and not self._take_recv(pkt):
            return
        if not self._len_ok(pkt):
            self._nak(NAK_INVALID_REQUEST, pkt.psn, True, WCStatus.REM_INV_REQ_ERR, "SEND packet length")
            return
        w = self.cur_recv
        n = len(pkt.payload)
        if self.recv_off + n > w.length:
            # the message is longer than the receive buffer: local length error here, invalid request there
            # (MR-RC-012)
            self._nak(NAK_INVALID_REQUEST, pkt.psn, True, WCStatus.LOC_LEN_ERR, "SEND longer than receive buffer")
            return
        if not w.usable():
            # Table 3-4 row 8: the receive WQE's scatter list failed its lkey / PD / bounds / LOCAL_WRITE
            # check (MR-MEM-020), or an MR of it was deregistered or invalidated since it was posted
            # (MR-MEM-033): NAK code 3 before any byte is placed (MR-NAK-008)
            self._nak(NAK_REMOTE_OP_ERR, pkt.psn, True, WCStatus.LOC_PROT_ERR, f"receive WR {w.wr_id}: bad local SGE")
            return
        if pkt.ieth is not None and self.qp.ctx.keys.check_invalidate(pkt.ieth, self.qp.pd) is None:
            # Table 3-4 row 9: the IETH key names no valid, remotely invalidatable MR of the QP's PD:
            # invalid request, the receive WQE completes with REM_INV_REQ_ERR (MR-MEM-041, MR-NAK-006 (h))
            self._nak(NAK_INVALID_REQUEST, pkt.psn, True, WCStatus.REM_INV_REQ_ERR,
                      f"SEND WITH INVALIDATE of key {pkt.ieth:#x}, which cannot be invalidated")
            return
        if self.read_queue and self.recv_off == 0:
            for mem, off, ln in w.sinks:                 # MR-RC-025: earlier READs read first
                self._protect_reads(int(mem.ctypes.data) + off, ln)
        scatter(w.sinks, self.recv_off, pkt.payload)     # in order, continuing the message (MR-RC-018)
        self.recv_off += n
        self.bytes_received += n
        if m & MI.END:
            self.in_progress = 0
            self.msn = (self.msn + 1) & 0xFFFFFF         # MR-ACK-008: LAST/ONLY of a SEND
            flags = WCFlags(0)
            if pkt.imm is not None:
                flags |= WCFlags.WITH_IMM
            if pkt.ieth is not None:
                self.qp.ctx.invalidate_rkey(pkt.ieth, self.qp.pd)    # checked above (MR-MEM-040)
                flags |= WCFlags.WITH_INV
            # receive completion: byte_len the message length, the immediate or the invalidated key
            # (MR-RC-019); solicited by SE of this, the completing packet only (MR-BTH-004)
            self.qp.recv_cq.push(WC(wr_id=w.wr_id, status=WCStatus.SUCCESS, opcode=WCOpcode.RECV,
                                    byte_len=self.recv_off, qp_num=self.qp.qp_num, imm_data=pkt.imm,
                                    wc_flags=flags, invalidated_rkey=pkt.ieth), solicited=bool(pkt.se))
            self.cur_recv = None
        else:
            self.in_progress = MI.SEND
        self._advance(pkt)

    def _write(self, pkt: "RxPkt") -> None:
        m = pkt.op.mask
        # Table 3-4 (MR-NAK-014): receive WQE of a WRITE WITH IMMEDIATE (RNR, row 4), lengths (row 5),
        # then R_Key, PD, access, bounds (row 6); memory is touched only after all of them (MR-MEM-027)
        if m & MI.RWR and not self._take_recv(pkt):
            return
        if not self._len_ok(pkt):
            self._nak(NAK_INVALID_REQUEST, pkt.psn, True, WCStatus.REM_INV_REQ_ERR, "WRITE packet length")
            return
        if m & MI.START:
            if pkt.dma_len > DMA_LEN_MAX:                # on its own, whatever the MR (MR-XH-004, MR-NAK-006 (d))
                self._nak(NAK_INVALID_REQUEST, pkt.psn, True, WCStatus.REM_INV_REQ_ERR,
                          f"WRITE DMA Length {pkt.dma_len} above 2^31")
                return
            left = pkt.dma_len
        else:
            left = self.write_left
        n = len(pkt.payload)
        # payloads add up to the DMA Length, never beyond it (MR-RC-011, MR-MEM-028)
        if n > left or ((m & MI.END) and n != left):
            self._nak(NAK_INVALID_REQUEST, pkt.psn, True, WCStatus.REM_INV_REQ_ERR,
                      f"WRITE carries {n} bytes, {left} left")
            return
        if m & MI.START:
            # key, PD, access and bounds once for the whole message (MR-MEM-025); none for 0 bytes (MR-MEM-030)
            if pkt.dma_len == 0:
                self.write_mr, self.write_off, self.write_left = None, 0, 0
            else:
                chk = self.qp.ctx.keys.check_remote(pkt.rkey, self.qp.pd, pkt.va, pkt.dma_len, Access.REMOTE_WRITE)
                if chk is None:
                    # a receive WQE already taken completes with LOC_ACCESS_ERR (Table 7-6)
                    self._nak(NAK_REMOTE_ACCESS_ERR, pkt.psn, True, WCStatus.LOC_ACCESS_ERR,
                              f"WRITE rkey {pkt.rkey:#x} va {pkt.va:#x} len {pkt.dma_len}")
                    return
                self.write_mr, self.write_off = chk
                self.write_left = pkt.dma_len
                self._protect_reads(self.write_mr.addr + self.write_off, pkt.dma_len)   # MR-RC-025
            self.write_len = pkt.dma_len
        elif n and not self.write_mr.valid:
            # deregistered (or invalidated) while the WRITE was in progress: no later packet reaches
            # its memory (MR-MEM-033)
            self._nak(NAK_REMOTE_ACCESS_ERR, pkt.psn, True, WCStatus.LOC_ACCESS_ERR,
                      "WRITE target MR deregistered during the message")
            return
        if n:
            self.write_mr.mem[self.write_off:self.write_off + n] = pkt.payload
            self.write_off += n
            self.write_left -= n
            self.bytes_received += n
        if m & MI.END:
            self.in_progress = 0
            self.msn = (self.msn + 1) & 0xFFFFFF
            if m & MI.IMMDT:
                w = self.cur_recv
                self.qp.recv_cq.push(WC(wr_id=w.wr_id, status=WCStatus.SUCCESS,
                                        opcode=WCOpcode.RECV_RDMA_WITH_IMM, byte_len=self.write_len,
                                        qp_num=self.qp.qp_num,
                                        imm_data=pkt.imm, wc_flags=WCFlags.WITH_IMM),
                                     solicited=bool(pkt.se))          # MR-BTH-004
                self.cur_recv = None
        else:
            self.in_progress = MI.WRITE
        self._advance(pkt)

    def fast_write(self, umem, addrs, lens, i: int, n: int) -> int:
        """Hand a run of in-order WRITE MIDDLE/LAST packets to the compiled placer (burst.py).
        Returns the index of the first frame it did not take."""
        st = self._st
        st[0], st[1], st[2], st[3], st[4], st[5] = self.epsn, self.write_off, self.write_left, 0, 0, 0
        j = rx_write_run(TABLES, umem, addrs, lens, i, n, self.qp.qp_num, self.qp.pmtu, self.write_mr.mem, st)
        if j > i:
            self.nak_sent = False
            self.epsn, self.write_off, self.write_left = int(st[0]), int(st[1]), int(st[2])
            self.bytes_received += int(st[4])
            if st[3]:
                self.ack_pending = True
            if st[5]:
                self.in_progress = 0
                self.msn = (self.msn + 1) & 0xFFFFFF
        return j

    def skip_run(self, umem, addrs, lens, i: int, n: int) -> int:
        """Hand a run of duplicate or (after the NAK) out-of-sequence SEND/WRITE frames to the compiled
        skipper (burst.rx_skip_run): counted as _duplicate and on_request count them, one re-ACK for
        the duplicates (MR-DUP-002, MR-DUP-010), epsn/msn/nak_sent untouched (MR-DUP-006).  Returns the
        index of the first frame it did not take."""
        st = self._st
        st[0] = st[1] = 0
        j = rx_skip_run(TABLES, umem, addrs, lens, i, n, self.qp.qp_num, self.qp.pkey, self.epsn, self.nak_sent,
                        st)
        if st[0]:
            self.dup_requests += int(st[0])
            self.ack_pending = True
        self.out_of_seq += int(st[1])
        return j

    def _resources_full(self) -> bool:
        """MR-DUP-007, MR-NAK-006 (f): no entry for a new READ/ATOMIC when max_dest_rd_atomic is 0, or
        when every entry holds a READ whose responses are not all sent (its requester cannot have
        completed it, so the entry cannot be reused)."""
        limit = self.qp.attr_max_dest_rd_atomic
        if limit == 0:
            return True
        if len(self.resources) < limit:
            return False
        # first streams only: a re-execution says nothing about whether the requester completed the READ
        unsent = {id(e[0]) for e in self.read_queue if e[0].origin is None}
        return all(id(r) in unsent for r in self.resources)

    def _remember(self, res: Resource) -> None:
        """At most max_dest_rd_atomic resources; a new READ/ATOMIC takes the oldest entry (MR-DUP-007,
        MR-SEC-012), which the requester, completing in order, finished first."""
        if len(self.resources) >= self.qp.attr_max_dest_rd_atomic:
            del self.resources[0]
        self.resources.append(res)

    def _protect_reads(self, addr: int, n: int) -> None:
        """MR-RC-025, MR-RC-014: a request is executed only after every earlier request has been processed
        entirely, READ RESPONSEs included.  Those are built as they leave (progress), so before a later
        request writes [addr, addr + n) -- WRITE, SEND placement, ATOMIC -- the part not yet sent of each
        queued READ that overlaps it is taken now: copied aside (up to SNAPSHOT_MAX bytes) or, for a
        larger one, sent at once.  Overlap is by address, so MRs that alias the same memory count."""
        if not self.read_queue or n <= 0:
            return
        mtu = self.qp.pmtu
        for e in list(self.read_queue):
            res, k = e
            if res.mr is None or res.mem is not None:
                continue
            lo = res.mr.addr + res.offset + k * mtu
            hi = res.mr.addr + res.offset + res.length
            if not (lo < addr + n and addr < hi):
                continue
            if hi - lo <= SNAPSHOT_MAX:
                res.mem = res.mr.mem[res.offset + k * mtu:res.offset + res.length].copy()
                res.mem_off = -k * mtu
            else:
                while e in self.read_queue:
                    self.progress(self.qp.ctx.engine.budget)
                    self.qp.ctx.engine.port.flush()

    def _read(self, pkt: "RxPkt") -> None:
        # Table 3-4 (MR-NAK-014): resources (row 4), DMA Length (row 5), R_Key and bounds (row 6)
        if self._resources_full():
            self._nak(NAK_INVALID_REQUEST, pkt.psn, True, WCStatus.REM_INV_REQ_ERR,
                      f"READ beyond max_dest_rd_atomic {self.qp.attr_max_dest_rd_atomic}")
            return
        if pkt.dma_len > DMA_LEN_MAX:                    # MR-XH-004, MR-NAK-006 (d), MR-SEC-013
            self._nak(NAK_INVALID_REQUEST, pkt.psn, True, WCStatus.REM_INV_REQ_ERR,
                      f"READ DMA Length {pkt.dma_len} above 2^31")
            return
        mtu = self.qp.pmtu
        if pkt.dma_len == 0:
            mr, off = None, 0
        else:
            chk = self.qp.ctx.keys.check_remote(pkt.rkey, self.qp.pd, pkt.va, pkt.dma_len, Access.REMOTE_READ)
            if chk is None:
                self._nak(NAK_REMOTE_ACCESS_ERR, pkt.psn, True, WCStatus.REM_ACCESS_ERR,
                          f"READ rkey {pkt.rkey:#x} va {pkt.va:#x} len {pkt.dma_len}")
                return
            mr, off = chk
        # one PSN per response packet (MR-RC-015); msn counts the READ before its responses (MR-ACK-008)
        npsn = max(1, -(-pkt.dma_len // mtu))
        self.flush_ack()
        self.msn = (self.msn + 1) & 0xFFFFFF
        res = Resource("read", pkt.psn, npsn, mr, off, pkt.dma_len, pkt.va, pkt.rkey)
        self._remember(res)
        self.read_queue.append([res, 0])
        if self.read_run is None:
            self.read_run = pkt.psn
        self.epsn = (self.epsn + npsn) & PSN_MASK

    def progress(self, budget: int) -> int:
        """Send queued READ responses, at most `budget` packets (the TX ring is finite)."""
        sent = 0
        while self.read_queue and sent < budget:
            entry = self.read_queue[0]
            res, k = entry
            stop = min(res.npsn, k + budget - sent)
            if not self._read_responses(res, k, stop):
                return sent
            sent += stop - k
            if stop >= res.npsn:
                self.read_queue.pop(0)
                if self.held:
                    self._release_held()          # before the next READ's responses (MR-RC-025)
            else:
                entry[1] = stop
        return sent

    def _read_responses(self, res: Resource, start: int, stop: int) -> bool:
        """READ RESPONSE packets start..stop-1 of `res`.  The R_Key and the bounds of what is left
        are checked again first: after ibv_dereg_mr no packet reads the MR (MR-MEM-033), and the
        stream ends with NAK code 2 carrying the READ REQUEST's PSN and the QP in ERR.  (The engine
        lock is held from here to the last packet, and dereg_mr takes it, so one check covers every
        packet of this call.)  False when the stream was ended."""
        mtu = self.qp.pmtu
        n = res.npsn
        if res.mr is not None:
            left = res.length - start * mtu
            if self.qp.ctx.keys.check_remote(res.rkey, self.qp.pd, res.va + start * mtu, left,
                                             Access.REMOTE_READ) is None:
                self.read_queue.clear()
                # nothing after this READ was answered yet, and now never is (MR-RC-025)
                self.held = [h for h in self.held if psn_diff(h[0], res.psn) < 0]
                self._nak(NAK_REMOTE_ACCESS_ERR, res.psn, True, WCStatus.REM_ACCESS_ERR,
                          f"READ rkey {res.rkey:#x}: memory region no longer valid")
                return False
        mem = (res.mem if res.mem is not None else res.mr.mem) if res.mr is not None else None
        # FIRST, LAST and ONLY carry the current msn (MR-ACK-008)
        aeth = _AETH.pack((AETH_ACK | AETH_CREDIT_INVALID) << 24 | (self.msn & 0xFFFFFF))
        for k in range(start, stop):
            plen = min(mtu, res.length - k * mtu)
            if n == 1:
                opcode, ext = Op.RDMA_READ_RESPONSE_ONLY, aeth
            elif k == 0:
                opcode, ext = Op.RDMA_READ_RESPONSE_FIRST, aeth
            elif k == n - 1:
                opcode, ext = Op.RDMA_READ_RESPONSE_LAST, aeth
            else:
                opcode, ext = Op.RDMA_READ_RESPONSE_MIDDLE, b""
            self.qp.emit(opcode, (res.psn + k) & PSN_MASK, 0, 0, ext, mem, res.mem_off + k * mtu, max(0, plen))
            self.bytes_sent += max(0, plen)
        return True

    def _atomic(self, pkt: "RxPkt") -> None:
        if self._resources_full():                        # Table 3-4 row 4 (MR-DUP-007, MR-NAK-006 (f))
            self._nak(NAK_INVALID_REQUEST, pkt.psn, True, WCStatus.REM_INV_REQ_ERR,
                      f"ATOMIC beyond max_dest_rd_atomic {self.qp.attr_max_dest_rd_atomic}")
            return
        # R_Key and bounds of [VA, VA + 8) first, then alignment (MR-ATOM-005, MR-ATOM-002, Table 3-4)
        chk = self.qp.ctx.keys.check_remote(pkt.rkey, self.qp.pd, pkt.va, 8, Access.REMOTE_ATOMIC)
        if chk is None:
            self._nak(NAK_REMOTE_ACCESS_ERR, pkt.psn, True, WCStatus.REM_ACCESS_ERR,
                      f"ATOMIC rkey {pkt.rkey:#x} va {pkt.va:#x}")
            return
        if pkt.va % 8:
            self._nak(NAK_INVALID_REQUEST, pkt.psn, True, WCStatus.REM_INV_REQ_ERR, "ATOMIC address not 8-byte aligned")
            return
        mr, off = chk
        self._protect_reads(mr.addr + off, 8)            # MR-RC-025: earlier READs read first (MR-ATOM-009)
        cell = mr.mem[off:off + 8].view(np.uint64)       # host byte order (MR-ATOM-001, MR-ATOM-003)
        orig = int(cell[0])
        if pkt.opcode == Op.COMPARE_SWAP:
            if orig == pkt.compare:
                cell[0] = pkt.swap_add
        else:
            cell[0] = (orig + pkt.swap_add) & U64_MASK
        self.flush_ack()
        self.msn = (self.msn + 1) & 0xFFFFFF
        res = Resource("atomic", pkt.psn, 1, mr, off, 8, pkt.va, pkt.rkey)
        res.orig = orig
        self._remember(res)
        self._atomic_ack(res)
        self.read_run = None
        self.epsn = (self.epsn + 1) & PSN_MASK

    def _atomic_ack(self, res: Resource) -> None:
        """ATOMIC ACKNOWLEDGE: the request's PSN, an ACK AETH with the current msn, the original value
        (MR-ATOM-006, MR-DUP-005)."""
        ext = _AETH_ORIG.pack((AETH_ACK | AETH_CREDIT_INVALID) << 24 | (self.msn & 0xFFFFFF), res.orig)
        self._respond(Op.ATOMIC_ACKNOWLEDGE, res.psn, ext)      # behind queued READ responses (MR-RC-025)

    def _duplicate(self, pkt: "RxPkt") -> None:
        """MR-DUP-002: re-ACK SEND/WRITE; MR-DUP-003: re-execute READ; MR-DUP-005: replay ATOMIC.
        Never re-applied to memory, epsn/msn/op_state/nak_sent untouched (MR-DUP-006), counted (MR-DUP-010)."""
        self.dup_requests += 1
        m = pkt.op.mask
        if m & (MI.SEND | MI.WRITE):
            self.ack_pending = True
            return
        for res in reversed(self.resources):
            d = psn_diff(pkt.psn, res.psn)
            if 0 <= d < res.npsn:
                if res.kind == "read" and m & MI.READ:
                    self._replay_read(pkt, res, d)
                elif res.kind == "atomic" and m & MI.ATOMIC and d == 0:
                    self.flush_ack()
                    self._atomic_ack(res)
                return
        # too old to be remembered, or another kind of operation: drop it (MR-DUP-003, MR-DUP-005, MR-DUP-009)

    def _replay_read(self, pkt: "RxPkt", res: Resource, d: int) -> None:
        """MR-DUP-003: re-execute a duplicate READ REQUEST found in resources[] -- only with the saved
        R_Key and a range inside the saved one whose responses fit the saved PSNs (else discarded and
        counted in dup_read_discards), and only after the R_Key and bounds pass again (MR-MEM-021 to
        MR-MEM-024): after ibv_dereg_mr the replay gets NAK code 2 and no byte of memory
        (MR-MEM-033).  The stream restarts at the duplicate's PSN (MR-DUP-008)."""
        mtu = self.qp.pmtu
        npsn = max(1, -(-pkt.dma_len // mtu))
        if (pkt.rkey != res.rkey or pkt.va < res.va or pkt.va + pkt.dma_len > res.va + res.length
                or d + npsn > res.npsn):
            self.dup_read_discards += 1
            return
        if pkt.dma_len == 0:
            mr, off = None, 0
        else:
            chk = self.qp.ctx.keys.check_remote(pkt.rkey, self.qp.pd, pkt.va, pkt.dma_len, Access.REMOTE_READ)
            if chk is None:
                self.read_queue.clear()
                self._nak(NAK_REMOTE_ACCESS_ERR, pkt.psn, True, WCStatus.REM_ACCESS_ERR,
                          f"duplicate READ rkey {pkt.rkey:#x} va {pkt.va:#x}: R_Key or bounds check failed")
                return
            mr, off = chk
        self.dup_read_replays += 1
        self.flush_ack()
        # abandon any stream of the same READ still queued (MR-DUP-008)
        self.read_queue = [e for e in self.read_queue if (e[0].origin or e[0]) is not res]
        self.read_queue.append([Resource("read", pkt.psn, npsn, mr, off, pkt.dma_len, pkt.va, pkt.rkey,
                                         origin=res), 0])
