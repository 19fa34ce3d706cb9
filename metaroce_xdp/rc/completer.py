"""Completer: responses -> completions in work-request order (spec 03, MR-ACK/MR-NAK/MR-RNR/MR-RETRY).

Inputs are ACK/NAK syndromes (from packets, or from the kernel's ACK fast
path through the shared QP state), READ responses and ATOMIC ACKs.  Outputs
are completions, popped only from the head of the send queue so they appear
in WR order, and go-back-N requests to the requester.  Also owns the local
ACK timeout and the retry / RNR-retry budgets.
"""
from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import numpy as np

from ..verbs_types import RNR_TIMER_US, WC, WCStatus, WROpcode, local_ack_timeout_ns
from ..wire.headers import (AETH_ACK, AETH_NAK, AETH_RNR_NAK, AETH_TYPE_MASK, NAK_INVALID_RD_REQUEST,
                            NAK_INVALID_REQUEST, NAK_PSN_SEQ_ERR, NAK_REMOTE_ACCESS_ERR,
                            NAK_REMOTE_OP_ERR)
from ..wire.opcodes import MI
from ..wire.psn import PSN_MASK, psn_diff
from .wqe import WC_OF_WR, SendWQE, scatter

if TYPE_CHECKING:
    from .qp import QP
    from .rxparse import RxPkt

# MR-NAK-010.  Code 4 maps to REM_INV_RD_REQ_ERR, where MR-NAK-011 says "like code 3"
# (see docs/spec/traceability.md); reserved codes fall back to REM_OP_ERR.
NAK_STATUS = {
    NAK_INVALID_REQUEST: WCStatus.REM_INV_REQ_ERR,
    NAK_REMOTE_ACCESS_ERR: WCStatus.REM_ACCESS_ERR,
    NAK_REMOTE_OP_ERR: WCStatus.REM_OP_ERR,
    NAK_INVALID_RD_REQUEST: WCStatus.REM_INV_RD_REQ_ERR,
}


class Completer:
    def __init__(self, qp: "QP") -> None:
        self.qp = qp
        self.retry_left = 7
        self.rnr_left = 7
        self.last_progress = 0            # ns: last forward progress or (re)transmission start
        self.acks = 0
        self.naks = 0
        self.rnr_naks = 0
        self.timeouts = 0
        self.stale = 0
        self.retrying_from: int | None = None   # PSN of the go-back-N in progress

    def reset_budgets(self) -> None:
        self.retrying_from = None
        self.retry_left = self.qp.attr_retry_cnt
        self.rnr_left = self.qp.attr_rnr_retry

    @property
    def req(self):
        return self.qp.requester

    # -- completion -----------------------------------------------------------
    def _complete_head(self, status: WCStatus = WCStatus.SUCCESS) -> None:
        """Retire the oldest WQE: completions in posting order (MR-RC-020), always on error
        (MR-QP-033); forward progress resets both retry budgets (MR-RNR-008, MR-RETRY-005)."""
        w = self.req.sq.pop(0)
        w.done = True
        if self.req.cursor > 0:
            self.req.cursor -= 1
        if status != WCStatus.SUCCESS or w.signaled:
            self.qp.send_cq.push(WC(wr_id=w.wr.wr_id, status=status, opcode=WC_OF_WR[w.opcode],
                                    byte_len=w.length if status == WCStatus.SUCCESS else 0,
                                    qp_num=self.qp.qp_num))
        self.last_progress = self.qp.now()
        self.reset_budgets()
        if self.qp.sq_draining:
            self.qp.check_drained()                  # MR-QP-013

    def ack_upto(self, psn: int, stop: SendWQE | None = None, implied_nak: bool = True) -> bool:
        """Complete SEND/WRITE WQEs whose PSNs are all <= psn (MR-ACK-002, MR-RC-021).

        Reaching an unfinished READ/ATOMIC that psn covers means its response
        was lost: go back to it (implied NAK, MR-RETRY-012; returns False) -- but only
        when the ACK came through user space, in order with the responses.  An ACK the
        kernel fast path consumed may overtake a READ response still in the AF_XDP ring
        (implied_nak=False): the walk stops there, and the response's completion resumes
        it from acked_psn; a response that really was lost is caught by the timer."""
        sq = self.req.sq
        while sq:
            w = sq[0]
            if w is stop or w.first_psn is None:
                return True
            if psn_diff(psn, w.last_psn) < 0:
                return True
            if w.is_rd_atomic:
                if not implied_nak:
                    return False
                missing = (w.first_psn + w.resp_bytes // self.qp.pmtu) & PSN_MASK
                self._retry(missing, "response lost (implicit NAK)")
                return False
            self._complete_head()
        return True

    # -- inputs ------------------------------------------------------------------
    def _valid_ack_psn(self, psn: int) -> bool:
        """Only PSNs in [oldest unacked - 1, last sent] move state (MR-SEC-022, MR-ACK-015: stale or
        spoofed ACKs; MR-SEC-024: they restart no timer and complete nothing)."""
        una = self.req.oldest_unacked_psn()
        d_lo = psn_diff(psn, (una - 1) & PSN_MASK)
        d_hi = psn_diff(psn, (self.req.psn_next - 1) & PSN_MASK)
        return d_lo >= 0 and d_hi <= 0

    def _is_partial_read_psn(self, psn: int) -> bool:
        """True when psn is the first PSN of the oldest outstanding READ and some of its responses
        were placed: the PSN a responder NAKs when the READ's MR goes away mid-stream (MR-MEM-033)."""
        for w in self.req.sq:
            if w.first_psn is None:
                return False
            if w.done:
                continue
            return w.opcode == WROpcode.RDMA_READ and w.resp_bytes > 0 and psn == w.first_psn
        return False

    def on_syndrome(self, psn: int, syndrome: int, msn: int, from_kernel: bool = False) -> None:
        """An ACK, RNR NAK or NAK for `psn` (from a packet, or from the kernel fast path:
        from_kernel, possibly ahead of responses still queued for user space)."""
        if not self._valid_ack_psn(psn) and not (
                (syndrome & AETH_TYPE_MASK) == AETH_NAK and syndrome & 0x1F and self._is_partial_read_psn(psn)):
            self.stale += 1
            return
        kind = syndrome & AETH_TYPE_MASK
        if kind == AETH_ACK:
            self.acks += 1
            if psn_diff(psn, self.req.acked_psn) > 0:
                self.req.note_acked(psn)
                self.last_progress = self.qp.now()
                self.reset_budgets()
            self.ack_upto(psn, implied_nak=not from_kernel)
        elif kind == AETH_RNR_NAK:
            self.rnr_naks += 1
            self._implied_ack((psn - 1) & PSN_MASK)
            if not self.ack_upto((psn - 1) & PSN_MASK):
                return
            if self.rnr_left == 0:
                self.qp.to_error(WCStatus.RNR_RETRY_EXC_ERR, "RNR retries exhausted")
                return
            if self.rnr_left != 7:           # MR-RNR-007: rnr_retry 7 means retry forever
                self.rnr_left -= 1
            # the responder's timer code, then go-back-N from p (MR-RNR-004, MR-RNR-005); no retry_left (MR-RNR-009)
            wait_ns = RNR_TIMER_US[syndrome & 0x1F] * 1000
            self.req.pause_until = self.qp.now() + wait_ns
            self.req.retry_from(psn)
            self.last_progress = self.req.pause_until
        elif kind == AETH_NAK:
            self.naks += 1
            code = syndrome & 0x1F
            self._implied_ack((psn - 1) & PSN_MASK)
            if not self.ack_upto((psn - 1) & PSN_MASK):
                return
            if code == NAK_PSN_SEQ_ERR:                  # go-back-N from p (MR-NAK-004)
                self._retry(psn, "PSN sequence error NAK")
            else:
                self.qp.to_error(NAK_STATUS.get(code, WCStatus.REM_OP_ERR), f"NAK code {code}")
        else:
            self.stale += 1

    def _implied_ack(self, psn: int) -> None:
        """A NAK or RNR NAK for p acknowledges p - 1: forward progress when that is new, which
        resets both retry budgets (MR-RNR-008, MR-RETRY-005).  Otherwise a long message on a
        lossy path, where each NAK reports a new gap further on, ran out of retries while it
        was moving (an 8 MiB WRITE at 5 % loss failed with RETRY_EXC_ERR)."""
        if psn_diff(psn, self.req.acked_psn) > 0:
            self.req.note_acked(psn)
            self.last_progress = self.qp.now()
            self.reset_budgets()

    def on_response(self, pkt: "RxPkt") -> None:
        """READ response or ATOMIC ACK (these carry data, so they always reach user space)."""
        if not self._valid_ack_psn(pkt.psn):
            self.stale += 1
            return
        op = pkt.op
        sq = self.req.sq
        target = None
        for w in sq:
            if w.first_psn is None:
                break
            if not w.done and 0 <= psn_diff(pkt.psn, w.first_psn) < w.npsn:
                target = w
                break
        if target is None or not target.is_rd_atomic:
            self.stale += 1
            return
        # the response also acknowledges everything before its request (MR-ACK-006)
        if not self.ack_upto((target.first_psn - 1) & PSN_MASK, stop=target):
            return
        if sq[0] is not target:
            return
        if op.has(MI.ATOMIC):
            if target.opcode not in (WROpcode.ATOMIC_CMP_AND_SWP, WROpcode.ATOMIC_FETCH_AND_ADD):
                self.qp.to_error(WCStatus.BAD_RESP_ERR, "ATOMIC ACK for a non-atomic request")
                return
            self.acks += 1
            orig = np.frombuffer(struct.pack("<Q", pkt.orig), dtype=np.uint8)   # host order (MR-ATOM-008)
            scatter(target.sinks, 0, orig)
            self._complete_head()
            self._resume_acked()
            return
        if target.opcode != WROpcode.RDMA_READ:          # bad response (MR-NAK-012)
            self.qp.to_error(WCStatus.BAD_RESP_ERR, "READ response for a non-READ request")
            return
        mtu = self.qp.pmtu
        expect = (target.first_psn + target.resp_bytes // mtu) & PSN_MASK
        d = psn_diff(pkt.psn, expect)
        if d < 0:
            return                                   # duplicate response (MR-RETRY-009)
        if d > 0:                                    # an earlier response was lost (MR-RETRY-013)
            self._retry(expect, "READ response lost")
            return
        remaining = target.length - target.resp_bytes
        n = len(pkt.payload)
        last = bool(op.mask & MI.END)
        if (last and n != remaining) or (not last and n != mtu) or n > remaining:
            self.qp.to_error(WCStatus.BAD_RESP_ERR, f"READ response of {n} bytes, {remaining} remaining")
            return
        scatter(target.sinks, target.resp_bytes, pkt.payload)
        target.resp_bytes += n
        self.last_progress = self.qp.now()
        self.reset_budgets()
        if last:
            self.acks += 1
            self._complete_head()
            self._resume_acked()

    def _resume_acked(self) -> None:
        """WQEs after a just-completed READ/ATOMIC that a cumulative ACK already covered (the
        ACK arrived first, through the kernel) complete now; otherwise nothing ever would,
        since a repeated ACK for the same PSN changes nothing the fast path reports."""
        if self.req.sq and self.req.sq[0].first_psn is not None:
            self.ack_upto(self.req.acked_psn, implied_nak=False)

    # -- timers ----------------------------------------------------------------------
    def _retry(self, psn: int, why: str, timeout: bool = False) -> None:
        if not timeout and self.retrying_from == psn:
            # Responses that were already in flight when we went back report the
            # same hole again: one loss event costs one retry (the timer covers
            # a lost retransmission).  MR-NAK-005.
            return
        if self.retry_left == 0:                     # every go-back-N costs a retry (MR-RETRY-011)
            self.qp.to_error(WCStatus.RETRY_EXC_ERR, f"retries exhausted ({why})")
            return
        self.retry_left -= 1
        self.qp.log(f"go-back-N from PSN {psn}: {why}")
        self.retrying_from = psn
        self.req.retry_from(psn)
        self.last_progress = self.qp.now()

    def check_timer(self, now: int) -> None:
        """MR-RETRY-001, MR-RETRY-004: local ACK timeout 4.096 us x 2^timeout with packets
        outstanding; never during an RNR wait (MR-RNR-006)."""
        tmo = local_ack_timeout_ns(self.qp.attr_timeout)
        if tmo is None or not self.req.outstanding():
            self.last_progress = now
            return
        if now < self.req.pause_until:
            return
        if now - self.last_progress > tmo:
            self.timeouts += 1
            self._retry(self.req.oldest_unacked_psn(), "local ACK timeout", timeout=True)
