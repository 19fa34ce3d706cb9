"""The completer: what the responder said back, turned into completions.

ACKs and NAKs mostly never reach this process: the XDP program judges them and writes the QP's kernel
slot (struct mr_qp_state, mmap'd); `kernel_acks` reads the slot and `advance`s the send queue to the
acknowledged PSN, or takes the NAK (`on_nak`: sequence error -> go-back-N; RNR -> wait the timer; others
-> the QP's error, `nak_error_due`).  READ RESPONSEs come here through the socket (`completer_rsp`):
placed in order into the WQE's SGE list, a gap answered by re-reading from the gap (MR-RC-019), a
response the requester cannot take a bad response (MR-NAK-012).
`retire_answered` completes READs and atomics whose answers arrived, in order.
"""
from __future__ import annotations

import numpy as np
from numba import njit
from .. import jitcache  # noqa: F401  (cache keyed on every module compiled code depends on)

from .layout import *  # noqa: F401,F403  (column numbers are compile-time constants)
from ..wire.hdr import OPT, OT_AETH, OT_PAY, aeth_syndrome, ext_at
from ..wire.psn import psn_diff
from .layout import PSN_MASK, PSN_NONE
from .reasons import (WHY_BAD_RESPONSE, WHY_LOCAL_MR_DEREGISTERED, WHY_PEER_NAK, WHY_RETRY_EXHAUSTED,
                      WHY_RNR_RETRY_EXHAUSTED)
from .prims import ld_acq_i64, ld_acq_u32, ld_acq_u64, ld_acq_u8
from .core import (KS_ACK_PSN, KS_ACK_SEQ, KS_NAK_CODE, KS_NAK_PSN, KS_NAK_SEQ, KS_RNR_PSN, KS_RNR_SEQ, KS_RNR_TIMER,
                   OP_RSP_FIRST, OP_RSP_LAST, OP_RSP_MIDDLE, OP_RSP_ONLY, RNR_TIMER_US, ST_ERR, S_BAD_RESP, S_LOC_PROT,
                   S_OK, S_REM_ACCESS, S_REM_INV_REQ, S_REM_OP, S_RETRY_EXC, S_RNR_EXC, WR_READ, ack_deadline,
                   complete_head, ks_addr, mr_live_a, place, publish_comp, publish_nak_read, qp_error, rd_atomic,
                   sg_valid, sq_row)
from .requester import rewind

_jit = dict(cache=True, nogil=True)


@njit(**_jit)
def advance(A, Q, SW, CQT, CE, qi, target, now):
    """Everything before PSN `target` is acknowledged: complete SEND/WRITE WQEs wholly before it and
    READs already answered, in order; stop at a READ still waiting for responses (its responses
    may still be in the RX ring: an ACK consumed in the kernel can overtake them)."""
    if psn_diff(target, Q[qi, Q_SND_MAX]) > 0 or psn_diff(target, Q[qi, Q_COMP_PSN]) <= 0:
        return
    moved = False
    while Q[qi, Q_SQ_HEAD] != Q[qi, Q_SQ_NEXT] or (Q[qi, Q_SQ_HEAD] != ld_acq_i64(Q[qi], Q_SQ_TAIL)):
        r = sq_row(Q, qi, Q[qi, Q_SQ_HEAD])
        if SW[r, W_STARTED] == 0:
            break
        last = (SW[r, W_FIRST_PSN] + SW[r, W_NPSN] - 1) & PSN_MASK
        if rd_atomic(SW[r, W_OPCODE]) and SW[r, W_DONE] == 0:
            if psn_diff(target, SW[r, W_FIRST_PSN]) > 0:
                target = Q[qi, Q_COMP_PSN] if psn_diff(Q[qi, Q_COMP_PSN], SW[r, W_FIRST_PSN]) > 0 \
                    else SW[r, W_FIRST_PSN]
            break
        if psn_diff(last, target) >= 0:
            break
        complete_head(A, Q, SW, CQT, CE, qi, S_OK)
        moved = True
        if Q[qi, Q_STATE] == ST_ERR:
            return
    if psn_diff(target, Q[qi, Q_COMP_PSN]) > 0:
        Q[qi, Q_COMP_PSN] = target
        moved = True
    if moved:
        if Q[qi, Q_TO_WIN] > 0:
            # after a timeout the window reopens by doubling per advancing ACK (see timers)
            Q[qi, Q_TO_WIN] = 0 if Q[qi, Q_TO_WIN] >= A[P_WINDOW] else 2 * Q[qi, Q_TO_WIN]
        Q[qi, Q_RETRY_LEFT] = Q[qi, Q_RETRY_CNT]
        Q[qi, Q_DEADLINE] = ack_deadline(Q, qi, now)
        publish_comp(A, Q, qi)


@njit(**_jit)
def kernel_acks(A, Q, SW, CQT, CE, qi, now):
    """The ACK state the XDP program wrote into the QP's mr_qps slot (seqcount read protocol)."""
    if A[P_KS_ADDR] == 0:
        return False
    k = ks_addr(A, qi)
    s1 = ld_acq_u64(k + KS_ACK_SEQ)
    if s1 == Q[qi, Q_K_SEQ] or (s1 & 1):
        return False
    ack = ld_acq_u32(k + KS_ACK_PSN)
    nak_psn = ld_acq_u32(k + KS_NAK_PSN)
    nak_seq = ld_acq_u32(k + KS_NAK_SEQ)
    rnr_psn = ld_acq_u32(k + KS_RNR_PSN)
    rnr_seq = ld_acq_u32(k + KS_RNR_SEQ)
    nak_code = ld_acq_u8(k + KS_NAK_CODE)
    rnr_timer = ld_acq_u8(k + KS_RNR_TIMER)
    if ld_acq_u64(k + KS_ACK_SEQ) != s1:
        return False                                 # the kernel wrote meanwhile: next round
    Q[qi, Q_K_SEQ] = s1
    if psn_diff(ack, Q[qi, Q_K_ACK]) > 0:
        Q[qi, Q_K_ACK] = ack
        A[P_ACKS_SEEN] += 1
        # forward progress (MR-RNR-008): the response acknowledged request packets not acknowledged before --
        # also where a READ still waiting for its responses keeps comp_psn behind them (advance moves nothing)
        Q[qi, Q_RETRY_LEFT] = Q[qi, Q_RETRY_CNT]
        advance(A, Q, SW, CQT, CE, qi, (ack + 1) & PSN_MASK, now)
    if nak_seq != Q[qi, Q_K_NAK_SEQ]:
        Q[qi, Q_K_NAK_SEQ] = nak_seq
        A[P_NAKS_SEEN] += 1
        on_nak(A, Q, SW, CQT, CE, qi, nak_psn, nak_code, now)
    if rnr_seq != Q[qi, Q_K_RNR_SEQ] and Q[qi, Q_STATE] != ST_ERR:
        Q[qi, Q_K_RNR_SEQ] = rnr_seq
        A[P_RNR_SEEN] += 1
        advance(A, Q, SW, CQT, CE, qi, rnr_psn, now)
        if Q[qi, Q_RNR_LEFT] == 0:
            qp_error(A, Q, SW, CQT, CE, qi, S_RNR_EXC, EV_QP_FATAL, WHY_RNR_RETRY_EXHAUSTED)
        else:
            if Q[qi, Q_RNR_RETRY] != 7:               # 7: retry for ever
                Q[qi, Q_RNR_LEFT] -= 1
            Q[qi, Q_RNR_UNTIL] = now + RNR_TIMER_US[rnr_timer & 31] * 1000
            Q[qi, Q_RNR_PSN] = rnr_psn
    return True


@njit(**_jit)
def on_nak(A, Q, SW, CQT, CE, qi, psn, code, now):
    if Q[qi, Q_STATE] == ST_ERR:
        return
    advance(A, Q, SW, CQT, CE, qi, psn, now)
    if code == 0:                                   # PSN sequence error: go back to it
        if psn_diff(psn, Q[qi, Q_COMP_PSN]) >= 0:
            seq_nak_retry(A, Q, SW, CQT, CE, qi, psn, now)
        return
    # the WQE the NAK names fails once everything before it has completed: READ responses for
    # earlier WQEs may still be in the RX ring (the kernel consumed the NAK ahead of them)
    Q[qi, Q_NERR_PSN] = psn + 1
    Q[qi, Q_NERR_CODE] = code
    nak_error_due(A, Q, SW, CQT, CE, qi)


@njit(**_jit)
def retry_in_progress(Q, qi, psn):
    """A retry from `psn` is in progress (MR-NAK-005): one started from it (Q_RETRY_FROM, set by a
    sequence error NAK or a local ACK timeout) and nothing has acknowledged `psn` since."""
    return Q[qi, Q_RETRY_FROM] == psn + 1 and psn_diff(Q[qi, Q_COMP_PSN], psn) <= 0


@njit(**_jit)
def seq_nak_retry(A, Q, SW, CQT, CE, qi, psn, now):
    """A PSN sequence error NAK for `psn` (everything before it acknowledged already): go back N from it
    (MR-NAK-004), which counts against retry_left -- with none left the WQE holding it fails RETRY_EXC_ERR
    (MR-RETRY-011) -- unless a retry from `psn` is in progress: a repeated NAK for it is a copy and starts
    nothing (MR-NAK-005).  The budget is reset by every response that acknowledges request packets not
    acknowledged before (kernel_acks: the kernel's ack_psn moving, a NAK's implied ACK included), also while
    a READ whose responses were lost holds comp_psn back -- counting with comp_psn alone as progress spent
    the READ's retries on NAKs for the WRITEs after it (tests/dp/test_fault_matrix.py at 5 % loss)."""
    if retry_in_progress(Q, qi, psn):
        return
    if Q[qi, Q_RETRY_LEFT] <= 0:
        qp_error(A, Q, SW, CQT, CE, qi, S_RETRY_EXC, EV_QP_FATAL, WHY_RETRY_EXHAUSTED)
        return
    Q[qi, Q_RETRY_LEFT] -= 1
    Q[qi, Q_RETRY_FROM] = psn + 1
    rewind(A, Q, SW, qi, psn)
    Q[qi, Q_DEADLINE] = ack_deadline(Q, qi, now)


@njit(**_jit)
def nak_error_due(A, Q, SW, CQT, CE, qi):
    """A NAK with an error code (MR-NAK-005..007) fails the WQE holding its PSN when that WQE is the oldest."""
    if Q[qi, Q_NERR_PSN] == 0 or Q[qi, Q_STATE] == ST_ERR:
        return
    psn = Q[qi, Q_NERR_PSN] - 1
    if Q[qi, Q_SQ_HEAD] != Q[qi, Q_SQ_NEXT]:
        r = sq_row(Q, qi, Q[qi, Q_SQ_HEAD])
        d = psn_diff(psn, SW[r, W_FIRST_PSN])
        if d >= SW[r, W_NPSN]:
            return                                   # an earlier WQE is still waiting for its responses
    code = Q[qi, Q_NERR_CODE]
    Q[qi, Q_NERR_PSN] = 0
    st = S_REM_INV_REQ if code == 1 else (S_REM_ACCESS if code == 2 else S_REM_OP)
    qp_error(A, Q, SW, CQT, CE, qi, st, EV_QP_FATAL, WHY_PEER_NAK + code)


@njit(**_jit)
def completer_rsp(A, Q, SW, CQT, CE, umem, qi, op, psn, b, end, pad, now):
    """A READ RESPONSE: placed when it is the PSN the completer waits for; stale ones are counted
    and dropped; a gap (a lost response) sends the READ again for the rest (go back N); one the
    requester cannot take (for a WQE that is not a READ, out of sequence, an AETH that is not an ACK,
    the wrong payload length) fails the oldest WQE with IBV_WC_BAD_RESP_ERR (MR-NAK-012)."""
    comp = Q[qi, Q_COMP_PSN]
    if psn_diff(psn, comp) < 0 or psn_diff(psn, Q[qi, Q_SND_MAX]) >= 0:
        rsp_outside(A, Q, qi, psn)
        return
    r = rsp_wqe(Q, SW, qi, psn)
    if r < 0:
        rsp_gap(A, Q, SW, CQT, CE, qi, now)          # a lost response: the READ goes again for the rest
        return
    if SW[r, W_OPCODE] != WR_READ:
        # MR-NAK-012: "an RDMA READ RESPONSE when the WQE at comp_psn is not an RDMA READ" is a bad response
        qp_error(A, Q, SW, CQT, CE, qi, S_BAD_RESP, EV_QP_FATAL, WHY_BAD_RESPONSE)
        return
    k = psn_diff(psn, SW[r, W_FIRST_PSN])
    if psn != comp:
        # only the first response of a READ may implicitly acknowledge what is before it
        if k != 0:
            rsp_gap(A, Q, SW, CQT, CE, qi, now)      # the one at comp_psn was lost
            return
        advance(A, Q, SW, CQT, CE, qi, psn, now)
        if Q[qi, Q_COMP_PSN] != psn:
            rsp_stale(A, Q, qi)
            return
    npsn = SW[r, W_NPSN]
    # MR-NAK-012: READ RESPONSE opcodes out of sequence are a bad response.  The last PSN of the READ
    # comes as LAST or ONLY, the others as FIRST or MIDDLE; a FIRST or ONLY only where a stream starts:
    # the READ's first PSN or the PSN the requester last asked the rest from (W_STATUS, MR-RETRY-008),
    # where a MIDDLE or LAST continuing the old stream is accepted too (MR-DUP-003); a MIDDLE or LAST
    # at a PSN after the first follows the response just placed (responses are placed at comp_psn only)
    last_k = k == npsn - 1
    if op == OP_RSP_FIRST or op == OP_RSP_ONLY:
        ok_op = (k == 0 or k == SW[r, W_STATUS]) and (op == OP_RSP_ONLY) == last_k
    else:
        ok_op = k != 0 and (op == OP_RSP_LAST) == last_k
    # MR-NAK-012: a READ RESPONSE FIRST, LAST or ONLY "whose AETH is not of type ACK" (bit 7, NAK, RNR
    # NAK, type 10) and "READ RESPONSE payloads that do not match the requested length" are bad too
    pay = b + OPT[op, OT_PAY]
    plen = end - pad - pay
    pmtu = Q[qi, Q_PMTU]
    expect = min(pmtu, SW[r, W_LENGTH] - k * pmtu)
    if expect < 0:
        expect = 0
    if (not ok_op or (op != OP_RSP_MIDDLE and (aeth_syndrome(umem, ext_at(b, op, OT_AETH)) & 0xE0) != 0)
            or plen != expect):
        qp_error(A, Q, SW, CQT, CE, qi, S_BAD_RESP, EV_QP_FATAL, WHY_BAD_RESPONSE)
        return
    lmr = SW[r, W_LMR]
    if (lmr and not mr_live_a(A, lmr)) or not sg_valid(A, SW[r, W_SG], SW[r, W_NSGE]):
        qp_error(A, Q, SW, CQT, CE, qi, S_LOC_PROT, EV_QP_FATAL, WHY_LOCAL_MR_DEREGISTERED)   # MR-MEM-035: never placed
        return
    if plen:
        place(A, SW[r, W_LADDR], SW[r, W_SG], SW[r, W_NSGE], k * pmtu, A[P_UMEM_ADDR] + pay, plen)
    A[P_RX_BYTES] += plen
    publish_nak_read(A, Q, qi, PSN_NONE if k == npsn - 1 else (SW[r, W_FIRST_PSN] + SW[r, W_STATUS]) & PSN_MASK)
    Q[qi, Q_COMP_PSN] = (psn + 1) & PSN_MASK
    Q[qi, Q_RETRY_LEFT] = Q[qi, Q_RETRY_CNT]
    Q[qi, Q_DEADLINE] = ack_deadline(Q, qi, now)
    if k == npsn - 1:
        SW[r, W_DONE] = 1                            # answered; retired in order below
        Q[qi, Q_RD_OUT] -= 1
        retire_answered(A, Q, SW, CQT, CE, qi)
        # the kernel may have taken an ACK for what follows the READ while it waited: apply it now
        if A[P_KS_ADDR] != 0 and Q[qi, Q_STATE] != ST_ERR:
            advance(A, Q, SW, CQT, CE, qi, (Q[qi, Q_K_ACK] + 1) & PSN_MASK, now)
    publish_comp(A, Q, qi)


@njit(**_jit)
def rsp_wqe(Q, SW, qi, psn):
    """The send-queue row whose PSN range holds a response's `psn`, searched from the queue head and
    never past a READ/ATOMIC still unanswered; -1 when there is none (a response was lost: a gap).
    The search goes on past sq_next over WQEs already started: after a go-back-N they wait to be sent
    again, but their first transmission was answered all the same (psn is before snd_max) -- an ATOMIC
    ACKNOWLEDGE that arrives just after the one before it, when the timeout resent only the first ATOMIC,
    is not a gap (conformance TC-ATOM-008-a)."""
    i = Q[qi, Q_SQ_HEAD]
    tail = ld_acq_i64(Q[qi], Q_SQ_TAIL)
    while i != tail:
        r = sq_row(Q, qi, i)
        if i - Q[qi, Q_SQ_NEXT] >= 0 and SW[r, W_STARTED] == 0:
            break
        d = psn_diff(psn, SW[r, W_FIRST_PSN])
        if d >= 0 and d < SW[r, W_NPSN]:
            return r
        if rd_atomic(SW[r, W_OPCODE]) and SW[r, W_DONE] == 0:
            return -1                                # an earlier READ/ATOMIC is not answered yet
        i += 1
    return -1


@njit(**_jit)
def rsp_gap(A, Q, SW, CQT, CE, qi, now):
    """A response that answers no WQE in order: the response at comp_psn was lost (an implied NAK,
    MR-RETRY-012), and the requests go again from comp_psn (go back N) -- once per comp_psn, and not while
    a retry from it (a local ACK timeout's, a NAK's) is in progress.  That retry counts against retry_left,
    and with none left the WQE fails with RETRY_EXC_ERR (MR-RETRY-011).  While it is in progress, such a
    response -- the rest of the old stream, queued ahead of the one asked for again -- restarts the local
    ACK timer and changes no retry count (MR-RETRY-013).  The packet is counted stale."""
    comp = Q[qi, Q_COMP_PSN]
    rsp_stale(A, Q, qi)
    if Q[qi, Q_RR_RETRY] == comp + 1 or retry_in_progress(Q, qi, comp):
        Q[qi, Q_DEADLINE] = ack_deadline(Q, qi, now)
        return
    if Q[qi, Q_RETRY_LEFT] <= 0:
        qp_error(A, Q, SW, CQT, CE, qi, S_RETRY_EXC, EV_QP_FATAL, WHY_RETRY_EXHAUSTED)
        return
    Q[qi, Q_RETRY_LEFT] -= 1
    Q[qi, Q_RR_RETRY] = Q[qi, Q_RETRY_FROM] = comp + 1
    rewind(A, Q, SW, qi, comp)
    Q[qi, Q_DEADLINE] = ack_deadline(Q, qi, now)


@njit(**_jit)
def rsp_stale(A, Q, qi):
    """A response discarded as stale: counted per port (rx_rsp_stale) and per QP (rx_stale_rsp, MR-ACK-015 (b))."""
    A[P_RX_RSP_STALE] += 1
    Q[qi, Q_N_STALE] += 1


@njit(**_jit)
def rsp_outside(A, Q, qi, psn):
    """A response outside [comp_psn, next_psn), discarded (MR-ACK-015): at or after next_psn it answers a PSN
    never sent, a ghost (rx_ghost_rsp, port and QP); before comp_psn a stale one (rsp_stale)."""
    if psn_diff(psn, Q[qi, Q_SND_MAX]) >= 0:
        A[P_RX_GHOST_RSP] += 1
        Q[qi, Q_N_GHOST] += 1
    else:
        rsp_stale(A, Q, qi)


@njit(**_jit)
def retire_answered(A, Q, SW, CQT, CE, qi):
    """Complete, in order, the answered READ/ATOMIC WQEs at the head and the others wholly before comp_psn --
    also those a go-back-N left waiting at or after sq_next to be sent again (rsp_wqe; complete_head
    moves sq_next past them)."""
    while Q[qi, Q_SQ_HEAD] != ld_acq_i64(Q[qi], Q_SQ_TAIL):
        rr = sq_row(Q, qi, Q[qi, Q_SQ_HEAD])
        if Q[qi, Q_SQ_HEAD] - Q[qi, Q_SQ_NEXT] >= 0 and SW[rr, W_STARTED] == 0:
            break
        if rd_atomic(SW[rr, W_OPCODE]):
            if SW[rr, W_DONE] == 0:
                break
        elif psn_diff((SW[rr, W_FIRST_PSN] + SW[rr, W_NPSN] - 1) & PSN_MASK, Q[qi, Q_COMP_PSN]) >= 0:
            break
        complete_head(A, Q, SW, CQT, CE, qi, S_OK)
        if Q[qi, Q_STATE] == ST_ERR:
            break
