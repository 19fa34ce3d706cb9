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
from ..wire.fastpath import TABLES
from ..wire.psn import PSN_MASK, psn_diff
from .burst import rx_rsp_skip_run
from .wqe import WC_OF_WR, SendWQE, scatter

if TYPE_CHECKING:
    from .qp import QP
    from .rxparse import RxPkt

# MR-NAK-010; code 4 (invalid RD request) and the reserved codes like code 3 (MR-NAK-011:
# IBV_WC_REM_INV_RD_REQ_ERR is never produced, MR-QP-032).
NAK_STATUS = {
    NAK_INVALID_REQUEST: WCStatus.REM_INV_REQ_ERR,
    NAK_REMOTE_ACCESS_ERR: WCStatus.REM_ACCESS_ERR,
    NAK_REMOTE_OP_ERR: WCStatus.REM_OP_ERR,
    NAK_INVALID_RD_REQUEST: WCStatus.REM_OP_ERR,
}
_AETH_NOT_ACK = 0xE0        # bit 7 or a type other than ACK (MR-XH-008, MR-NAK-012)


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
        self.stale = 0                    # rx_stale_rsp: responses before comp_psn (MR-ACK-015)
        self.ghost = 0                    # rx_ghost_rsp: responses at or after next_psn (MR-ACK-015)
        self.bad_rsp = 0                  # rx_bad_rsp: bad responses, QP to ERR (MR-NAK-012)
        self.retrying_from: int | None = None   # PSN of the go-back-N in progress
        self._st = np.zeros(2, np.int64)        # exchanged with burst.rx_rsp_skip_run
        # An implied NAK the kernel fast path may have judged too early (MR-RETRY-015): [WQE, ACK PSN, the
        # engine round it was seen in, later rounds since]; decided once the AF_XDP ring has been drained
        self._implied: list | None = None

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
                    # the READ RESPONSE that precedes this ACK on the wire, if any, was in the AF_XDP ring
                    # when the kernel took the ACK: judge after the next rounds have drained the ring
                    if self._implied is None or self._implied[0] is not w:
                        self._implied = [w, psn, self.qp.now(), 0]
                    return False
                missing = (w.first_psn + w.resp_bytes // self.qp.pmtu) & PSN_MASK
                self._retry(missing, "response lost (implicit NAK)")
                return False
            self._complete_head()
        return True

    # -- inputs ------------------------------------------------------------------
    def _valid_ack_psn(self, psn: int, nak_of_partial_read: bool = False) -> bool:
        """MR-ACK-015: every response is classified by its PSN first.  At or after next_psn it is a
        ghost (it answers nothing ever sent), counted in rx_ghost_rsp; before comp_psn -- the oldest
        unacknowledged PSN, so comp_psn - 1 too -- it is stale, counted in rx_stale_rsp; both are
        discarded and restart no timer, complete nothing (MR-SEC-022, MR-SEC-024).  The NAK of a
        READ whose MR went away mid-stream names the READ's first PSN and is processed
        (nak_of_partial_read, MR-MEM-033).  True when the response is processed."""
        if psn_diff(psn, (self.req.psn_next - 1) & PSN_MASK) > 0:
            self.ghost += 1
            return False
        if psn_diff(psn, self.req.oldest_unacked_psn()) < 0 and not nak_of_partial_read:
            self.stale += 1
            return False
        return True

    def _bad_response(self, why: str) -> None:
        """MR-NAK-012: the oldest outstanding WQE completes with IBV_WC_BAD_RESP_ERR and the QP moves
        to ERR, counted in rx_bad_rsp."""
        self.bad_rsp += 1
        self.qp.to_error(WCStatus.BAD_RESP_ERR, f"bad response: {why}")

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
        if not self._valid_ack_psn(psn, (syndrome & AETH_TYPE_MASK) == AETH_NAK and syndrome & 0x1F
                                   and self._is_partial_read_psn(psn)):
            return
        kind = syndrome & AETH_TYPE_MASK
        if syndrome & 0x80 or kind not in (AETH_ACK, AETH_RNR_NAK, AETH_NAK):
            # bit 7 set, or type 10 (reserved): a bad response, never silently dropped (MR-XH-008)
            self._bad_response(f"AETH syndrome {syndrome:#04x}")
            return
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
        if target is None:                       # inside the window, yet no sent WQE holds the PSN
            self.ghost += 1
            return
        # the response also acknowledges everything before its request (MR-ACK-006); a SEND or
        # WRITE before it is acknowledged implicitly (Table 3-9, CHECK_PSN)
        if not self.ack_upto((target.first_psn - 1) & PSN_MASK, stop=target):
            return
        if sq[0] is not target:
            return
        # the WQE at comp_psn must be of the response's kind (MR-NAK-012)
        if op.mask & MI.ATOMIC and not (target.is_rd_atomic and target.opcode != WROpcode.RDMA_READ):
            self._bad_response(f"ATOMIC ACKNOWLEDGE for a {target.opcode.name} WQE")
            return
        if op.mask & MI.READ and target.opcode != WROpcode.RDMA_READ:
            self._bad_response(f"{op.name} for a {target.opcode.name} WQE")
            return
        if not all(mr.valid for mr in target.mrs):
            # MR-MEM-035: the destination MR was deregistered after the WR was posted: nothing is
            # placed; the WQE completes with LOC_PROT_ERR and the QP moves to ERR
            self.qp.to_error(WCStatus.LOC_PROT_ERR, f"{target.opcode.name} WR {target.wr.wr_id}: "
                                                    "its local MR was deregistered")
            return
        if op.mask & MI.ATOMIC:
            if pkt.syndrome & _AETH_NOT_ACK:
                self._bad_response(f"ATOMIC ACKNOWLEDGE with AETH syndrome {pkt.syndrome:#04x}")
                return
            self.acks += 1
            orig = np.frombuffer(struct.pack("<Q", pkt.orig), dtype=np.uint8)   # host order (MR-ATOM-008)
            scatter(target.sinks, 0, orig)
            self._complete_head()
            self._resume_acked()
            return
        mtu = self.qp.pmtu
        expect = (target.first_psn + target.resp_bytes // mtu) & PSN_MASK
        d = psn_diff(pkt.psn, expect)
        if d < 0:
            return                                   # duplicate response (MR-RETRY-009)
        if d > 0:                                    # an earlier response was lost (MR-RETRY-013)
            if self.retrying_from == expect:
                # The rest of the stream the responder sent before it saw our request for the
                # remainder: the restarted stream queues behind it.  Restart the local ACK timer
                # (never the retry budget), so it measures silence, not the time a slow receiver
                # takes to drain that backlog (as rxe's completer re-arms its timer on every
                # response); else each expiry re-requests the remainder, the responder restarts
                # its stream behind the backlog again, and the READ fails with RETRY_EXC_ERR.
                self.last_progress = self.qp.now()
            self._retry(expect, "READ response lost")
            return
        # MR-NAK-012: FIRST/LAST/ONLY carry an AETH of type ACK; the opcodes follow each other
        # (no MIDDLE or LAST without a FIRST; a FIRST or ONLY inside a stream only when the requester
        # asked for the rest again, MR-RETRY-008); the payloads add up to the requested length
        if op.mask & MI.AETH and pkt.syndrome & _AETH_NOT_ACK:
            self._bad_response(f"{op.name} with AETH syndrome {pkt.syndrome:#04x}")
            return
        first = bool(op.mask & MI.START)
        if not first and target.resp_bytes == 0:
            self._bad_response(f"{op.name} without RDMA_READ_RESPONSE_FIRST")
            return
        if first and target.resp_bytes and not (target.restart_psns and pkt.psn in target.restart_psns):
            self._bad_response(f"{op.name} inside a response stream (PSN {pkt.psn}, READ from "
                               f"{target.first_psn}, asked again at {sorted(target.restart_psns or ())})")
            return
        remaining = target.length - target.resp_bytes
        n = len(pkt.payload)
        last = bool(op.mask & MI.END)
        if (last and n != remaining) or (not last and (n != mtu or n >= remaining)) or n > remaining:
            self._bad_response(f"{op.name} of {n} bytes, {remaining} remaining")
            return
        scatter(target.sinks, target.resp_bytes, pkt.payload)
        target.resp_bytes += n
        self.last_progress = self.qp.now()
        self.reset_budgets()
        if last:
            self.acks += 1
            self._complete_head()
            self._resume_acked()

    def skip_run(self, umem, addrs, lens, i: int, n: int) -> int:
        """Hand a run of READ RESPONSE frames for the READ at the head of the send queue that
        on_response would only count -- stale, or after the expected PSN while the remainder is
        re-requested -- to the compiled skipper (burst.rx_rsp_skip_run), with on_response's effects:
        rx_stale_rsp, and the timer restart of MR-RETRY-013.  Returns the index of the first frame
        it did not take."""
        sq = self.req.sq
        if not sq:
            return i
        w = sq[0]
        if w.first_psn is None or w.opcode != WROpcode.RDMA_READ:
            return i
        expect = (w.first_psn + w.resp_bytes // self.qp.pmtu) & PSN_MASK
        st = self._st
        st[0] = st[1] = 0
        j = rx_rsp_skip_run(TABLES, umem, addrs, lens, i, n, self.qp.qp_num, self.qp.pkey, w.first_psn, w.npsn,
                            expect, self.retrying_from == expect, st)
        self.stale += int(st[0])
        if st[1]:
            self.last_progress = self.qp.now()
        return j

    def _resume_acked(self) -> None:
        """WQEs after a just-completed READ/ATOMIC that a cumulative ACK already covered (the
        ACK arrived first, through the kernel) complete now; otherwise nothing ever would,
        since a repeated ACK for the same PSN changes nothing the fast path reports."""
        if self.req.sq and self.req.sq[0].first_psn is not None:
            self.ack_upto(self.req.acked_psn, implied_nak=False)

    # -- timers ----------------------------------------------------------------------
    def _settle_implied(self, now: int) -> None:
        """MR-RETRY-015: an ACK the kernel consumed covered an unfinished READ/ATOMIC (ack_upto with
        implied_nak=False).  Two engine rounds later every response that arrived before that ACK has left
        the AF_XDP ring and been processed (each round drains it before the fast path is read); if the
        READ/ATOMIC is still the oldest WQE and unfinished, its response was lost: retry now, not at
        the local ACK timer (MR-RETRY-012), from the first PSN whose response is missing."""
        p = self._implied
        w, psn, seen, rounds = p
        if now != seen:
            p[2], p[3] = now, rounds + 1
        if p[3] < 2:
            return
        self._implied = None
        sq = self.req.sq
        if (not sq or sq[0] is not w or w.done or w.first_psn is None
                or psn_diff(self.req.acked_psn, w.last_psn) < 0):
            return                                   # completed by its response, or the QP moved on
        missing = (w.first_psn + w.resp_bytes // self.qp.pmtu) & PSN_MASK
        self._retry(missing, "response lost (implicit NAK, fast-path ACK)")

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
        if self._implied is not None:
            self._settle_implied(now)
        tmo = local_ack_timeout_ns(self.qp.attr_timeout)
        if tmo is None or not self.req.outstanding():
            self.last_progress = now
            return
        if now < self.req.pause_until:
            return
        if now - self.last_progress > tmo:
            self.timeouts += 1
            self._retry(self.req.oldest_unacked_psn(), "local ACK timeout", timeout=True)
