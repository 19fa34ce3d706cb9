"""ATOMICs, both ends (the request itself is built by requester.atomic_request).

* The responder (`responder_atomic`) checks, in the order of Table 3-4 (MR-NAK-014), the opcode sequence,
  the QP's REMOTE_ATOMIC, the responder resources (max_dest_rd_atomic: NAK invalid request, MR-DUP-007),
  the R_Key and bounds of [VA, VA + 8) (NAK code 2) and then the 8-byte alignment (NAK invalid request,
  MR-ATOM-002, MR-ATOM-005) before it touches memory; it executes in host byte order (MR-ATOM-001,
  MR-ATOM-003), remembers (PSN, original value) in a ring of MAX_RD per QP and answers with an ATOMIC
  ACKNOWLEDGE queued behind the READ responses before it (MR-RC-025, MR-ATOM-006); a duplicate among the
  last max_dest_rd_atomic is answered from the saved value, never executed again (MR-DUP-005).
* The completer (`completer_atomic`) places the original value (host order) and completes the WQE in order.
"""
from __future__ import annotations

import numpy as np
from numba import carray, njit
from .. import jitcache  # noqa: F401  (cache keyed on every module compiled code depends on)

from .layout import *  # noqa: F401,F403  (column numbers are compile-time constants)
from ..wire.hdr import (OPT, OT_AETH, OT_ATOMICACKETH, OT_ATOMICETH, OT_PAY, aeth_syndrome, atomicacketh_orig,
                        atomiceth_compare, atomiceth_rkey, atomiceth_swap_add, atomiceth_va, ext_at)
from ..wire.psn import psn_diff
from .layout import MAX_RD, NAT, NJ, PSN_MASK, RK_NONE
from .reasons import (WHY_ATOMIC_NOT_ALLOWED, WHY_ATOMIC_UNALIGNED, WHY_BAD_RESPONSE, WHY_LOCAL_MR_DEREGISTERED,
                      WHY_REMOTE_ACCESS, WHY_RESPONDER_RESOURCES)
from .prims import addr_of, ptr_u64
from .core import (ACC_REMOTE_ATOMIC, NAK_INV_REQ, NAK_REM_ACCESS, NAK_SEQ, OP_ATOMIC_ACK, OP_CAS, ST_ERR, S_BAD_RESP,
                   S_LOC_PROT, WR_CAS, WR_FAA, ack_deadline, mr_check, mr_live_a, place, publish_comp, qp_error,
                   sg_valid)
from .completer import advance, retire_answered, rsp_gap, rsp_outside, rsp_stale, rsp_wqe
from .responder import ack_now, protect_reads, rd_full, responder_error, send_nak, sequence_error

_jit = dict(cache=True, nogil=True)


@njit(**_jit)
def at_row(A, qi, t):
    return A[P_AT_OFF] + (qi * MAX_RD + (t % MAX_RD)) * NAT


@njit(**_jit)
def queue_atomic_ack(A, Q, qi, psn, orig):
    """The ATOMIC ACKNOWLEDGE as a job of the READ response queue: it leaves after the READ
    responses of earlier PSNs (MR-RC-025).  J_LENGTH -1 marks it; J_ADDR holds the original value."""
    j = A[P_RDJ_OFF] + (qi * MAX_RD + (Q[qi, Q_RD_TAIL] % MAX_RD)) * NJ
    A[j + J_PSN] = psn
    A[j + J_ADDR] = orig
    A[j + J_LENGTH] = -1
    A[j + J_MR] = 0
    A[j + J_NPK] = 1
    A[j + J_SENT] = 0
    A[j + J_ACK] = 0
    A[j + J_NAK] = 0
    A[j + J_DUP] = 0                                # the caller marks a duplicate's replay
    Q[qi, Q_RD_TAIL] += 1


@njit(**_jit)
def flush_ack(A, Q, TM, umem, tables, ext, qi):
    """The coalesced ACK owed so far leaves before a response to a later request -- behind the READ
    responses of earlier PSNs still queued (responder.ack_now, MR-RC-025)."""
    ack_now(A, Q, TM, umem, tables, ext, qi)


@njit(**_jit)
def responder_atomic(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, qi, op, psn, b, end, pad):
    """A COMPARE_SWAP or FETCH_ADD request of QP qi (b = BTH offset, end = ICRC offset)."""
    hdr = ext_at(b, op, OT_ATOMICETH)
    if end - pad - (b + OPT[op, OT_PAY]) != 0:
        A[P_RX_DROP_LEN] += 1                       # not an AtomicETH and nothing else: malformed
        return
    e = Q[qi, Q_EPSN]
    d = psn_diff(psn, e)
    if d > 0:                                        # out of sequence: one NAK per gap (MR-NAK-003)
        A[P_RX_OOS] += 1
        Q[qi, Q_N_OOS] += 1                          # rx_drop_out_of_seq (MR-SEC-031)
        if Q[qi, Q_NAK_PEND] == 0:
            Q[qi, Q_NAK_PEND] = 1
            send_nak(A, Q, TM, umem, tables, ext, qi, NAK_SEQ, e)      # behind earlier READs (MR-RC-025)
        return
    if d < 0:                                        # duplicate: the saved result, never executed again
        A[P_RX_DUP] += 1
        Q[qi, Q_N_DUP_REQ] += 1                      # rx_dup_req (MR-DUP-010)
        t = Q[qi, Q_AT_TAIL]
        lo = max(0, t - Q[qi, Q_MAX_DEST])           # resources[] holds max_dest_rd_atomic entries (MR-DUP-007)
        while t > lo:
            t -= 1
            a = at_row(A, qi, t)
            if A[a] == psn:
                if Q[qi, Q_RD_TAIL] - Q[qi, Q_RD_HEAD] < MAX_RD:
                    flush_ack(A, Q, TM, umem, tables, ext, qi)
                    queue_atomic_ack(A, Q, qi, psn, A[a + 1])
                    # a replay: no responder resource of its own (responder.rd_full)
                    A[A[P_RDJ_OFF] + (qi * MAX_RD + ((Q[qi, Q_RD_TAIL] - 1) % MAX_RD)) * NJ + J_DUP] = 1
                    A[P_RX_DUP_ATOMIC] += 1
                return
        return                                       # too old to be remembered: dropped (MR-DUP-005)
    if Q[qi, Q_R_KIND] != RK_NONE:                   # inside a SEND or WRITE (MR-RC-016)
        sequence_error(A, Q, SW, RW, CQT, CE, TM, umem, tables, ext, qi, psn)
        return
    if (Q[qi, Q_ACCESS] & ACC_REMOTE_ATOMIC) == 0:   # the QP does not allow ATOMICs at all (MR-RC-017)
        responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_INV_REQ, psn,
                        EV_QP_REQ_ERR, WHY_ATOMIC_NOT_ALLOWED)
        return
    if rd_full(A, Q, qi):
        # beyond the responder resources, or max_dest_rd_atomic 0 (MR-DUP-007, MR-NAK-006 (f), Table 3-4 row 4)
        responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_INV_REQ, psn,
                        EV_QP_REQ_ERR, WHY_RESPONDER_RESOURCES)
        return
    va = atomiceth_va(umem, hdr)
    rkey = atomiceth_rkey(umem, hdr)
    swap_add = atomiceth_swap_add(umem, hdr)
    cmp = atomiceth_compare(umem, hdr)
    # R_Key, PD, access and bounds of [VA, VA + 8) first, then the alignment (Table 3-4, MR-ATOM-005)
    if mr_check(MRT, rkey, Q[qi, Q_PD], va, 8, ACC_REMOTE_ATOMIC) < 0:
        responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_REM_ACCESS, psn,
                        EV_QP_ACCESS_ERR, WHY_REMOTE_ACCESS)
        return
    if va & 7:                                       # MR-ATOM-002: NAK, memory untouched
        responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_INV_REQ, psn,
                        EV_QP_REQ_ERR, WHY_ATOMIC_UNALIGNED)
        return
    if not protect_reads(A, Q, SW, CQT, CE, MRT, TM, umem, tables, ext, qi, va, 8):
        return                                       # earlier READ responses first (MR-RC-025, MR-ATOM-009)
    cell = carray(ptr_u64(va), (1,))                 # host byte order (MR-ATOM-001, MR-ATOM-003)
    orig = cell[0]
    if op == OP_CAS:
        if orig == np.uint64(cmp):
            cell[0] = np.uint64(swap_add)
    else:
        cell[0] = orig + np.uint64(swap_add)
    o = np.int64(orig)
    flush_ack(A, Q, TM, umem, tables, ext, qi)
    Q[qi, Q_MSN] = (Q[qi, Q_MSN] + 1) & PSN_MASK
    a = at_row(A, qi, Q[qi, Q_AT_TAIL])
    A[a] = psn
    A[a + 1] = o
    Q[qi, Q_AT_TAIL] += 1
    queue_atomic_ack(A, Q, qi, psn, o)
    Q[qi, Q_NAK_PEND] = 0
    Q[qi, Q_EPSN] = (psn + 1) & PSN_MASK
    Q[qi, Q_READ_RUN] = 0                            # not a READ: a later re-ACK is at epsn - 1 (MR-DUP-002)


@njit(**_jit)
def completer_atomic(A, Q, SW, CQT, CE, umem, ext, qi, psn, b, end, pad, now):
    """An ATOMIC ACKNOWLEDGE: the original value is placed (host order, MR-ATOM-008) and the WQE
    completes, in order; stale ones are counted and dropped; a gap sends again from comp_psn."""
    if end - pad - (b + OPT[OP_ATOMIC_ACK, OT_PAY]) != 0:
        A[P_RX_DROP_LEN] += 1
        return
    comp = Q[qi, Q_COMP_PSN]
    if psn_diff(psn, comp) < 0 or psn_diff(psn, Q[qi, Q_SND_MAX]) >= 0:
        rsp_outside(A, Q, qi, psn)
        return
    r = rsp_wqe(Q, SW, qi, psn)
    if r < 0:
        rsp_gap(A, Q, SW, CQT, CE, qi, now)
        return
    if SW[r, W_OPCODE] != WR_CAS and SW[r, W_OPCODE] != WR_FAA:
        qp_error(A, Q, SW, CQT, CE, qi, S_BAD_RESP, EV_QP_FATAL, WHY_BAD_RESPONSE)     # MR-NAK-012
        return
    if psn != comp:
        advance(A, Q, SW, CQT, CE, qi, psn, now)     # the response acknowledges what is before it
        if Q[qi, Q_STATE] == ST_ERR or Q[qi, Q_COMP_PSN] != psn:
            rsp_stale(A, Q, qi)
            return
    if (aeth_syndrome(umem, ext_at(b, OP_ATOMIC_ACK, OT_AETH)) & 0xE0) != 0:     # not an ACK (MR-NAK-012)
        qp_error(A, Q, SW, CQT, CE, qi, S_BAD_RESP, EV_QP_FATAL, WHY_BAD_RESPONSE)
        return
    lmr = SW[r, W_LMR]
    if (lmr and not mr_live_a(A, lmr)) or not sg_valid(A, SW[r, W_SG], SW[r, W_NSGE]):
        qp_error(A, Q, SW, CQT, CE, qi, S_LOC_PROT, EV_QP_FATAL, WHY_LOCAL_MR_DEREGISTERED)   # MR-MEM-035, MR-SEC-003: never placed
        return
    orig = atomicacketh_orig(umem, ext_at(b, OP_ATOMIC_ACK, OT_ATOMICACKETH))
    for k in range(8):                               # host (little-endian) order
        ext[k] = (orig >> (8 * k)) & 0xFF
    place(A, SW[r, W_LADDR], SW[r, W_SG], SW[r, W_NSGE], 0, addr_of(ext), 8)
    Q[qi, Q_COMP_PSN] = (psn + 1) & PSN_MASK
    Q[qi, Q_RETRY_LEFT] = Q[qi, Q_RETRY_CNT]
    Q[qi, Q_DEADLINE] = ack_deadline(Q, qi, now)
    SW[r, W_DONE] = 1
    Q[qi, Q_RD_OUT] -= 1
    retire_answered(A, Q, SW, CQT, CE, qi)
    if A[P_KS_ADDR] != 0 and Q[qi, Q_STATE] != ST_ERR:
        advance(A, Q, SW, CQT, CE, qi, (Q[qi, Q_K_ACK] + 1) & PSN_MASK, now)
    publish_comp(A, Q, qi)
