"""The compiled data plane's operations beyond SEND/WRITE/READ: ATOMICs, SEND WITH INVALIDATE,
gather/scatter lists, completion events, SQD draining and DCQCN (called from loop.py).

* ATOMICs: the requester sends the AtomicETH (VA, R_Key, swap or add data, compare data; MR-XH-011); the responder checks,
  in the order of Table 3-4 (MR-NAK-014), the opcode sequence, the QP's REMOTE_ATOMIC, the R_Key
  and bounds of [VA, VA + 8) (NAK code 2) and then the 8-byte alignment (NAK invalid request,
  MR-ATOM-002, MR-ATOM-005) before it touches memory; it executes in host byte order (MR-ATOM-001,
  MR-ATOM-003), remembers (PSN, original value) in a ring of MAX_RD per QP and answers with an
  ATOMIC ACKNOWLEDGE queued behind the READ responses before it (MR-RC-025, MR-ATOM-006); a
  duplicate is answered from the saved value, never executed again (MR-DUP-005).  The completer
  places the original value (host order) and completes the WQE in order.
* SEND WITH INVALIDATE (MR-MEM-040 to MR-MEM-043): the IETH names an MR of the QP's PD registered
  remotely invalidatable (ACC_REMOTE_INV in the MR table's access word); the receive completion
  carries WITH_INV and the key; afterwards no access through that key succeeds.
* Gather/scatter lists of more than one SGE: the WQE names rows of the SG table; sends gather
  into a per-port scratch buffer, READ responses, ATOMIC results and RECVs scatter.
* Completion events: an armed CQ (C_ARMED 1: any completion, 2: solicited or unsuccessful only,
  MR-BTH-004) disarms and hands EV_CQ_NOTIFY to Python at the completion.
* SQD (MR-QP-013): no new WQE starts; once nothing started is outstanding, EV_SQ_DRAINED when
  en_sqd_async_notify asked for it.
* DCQCN (parameters in congestion.py): notification point -- a CE-marked request or
  READ RESPONSE that was accepted is counted and answered by at most one CNP per cnp_interval;
  reaction point -- the kernel's per-QP cnp_count cuts the rate, alpha decays every K, the rate
  timer T and byte counter B raise it again, and a token bucket paces the QP's packets.  The state
  is float64 words of the arena (F table, F_* columns); row 0 holds the parameters (D_* columns).
* READ before a later write (MR-RC-025): protect_reads sends the queued READ responses that would
  read bytes a later WRITE, SEND or ATOMIC is about to write.

Caching: the entry points (inproc.dp_round, dp_run, serve.dp_serve) are compiled with this module's functions inside;
numba's on-disk cache would check only loop.py's stamp, so metaroce_xdp/jitcache.py keys it on a
digest of every module compiled code depends on (this one included).
"""
from __future__ import annotations

import sys

if __name__.rpartition(".")[0] + ".loop" not in sys.modules:      # loop.py imports this module half way
    raise ImportError(f"import {__name__.rpartition('.')[0]}.loop, which imports {__name__}")

import numpy as np  # noqa: E402
from numba import carray, njit
from .. import jitcache  # noqa: F401,E402  (cache keyed on every module compiled code depends on)

from .layout import *  # noqa: F401,F403
from .layout import (ACC_REMOTE_INV, G_ADDR, G_LENGTH, G_MR, MAX_RD, NAT, NEVF, NF, NG, NJ, NM, PSN_MASK, RK_NONE,
                     SG_ROWS, TM_CNP)
from .reasons import (WHY_ATOMIC_NOT_ALLOWED, WHY_ATOMIC_UNALIGNED, WHY_BAD_RESPONSE, WHY_LOCAL_MR_DEREGISTERED,
                      WHY_OPCODE_SEQUENCE, WHY_REMOTE_ACCESS)
from .loop import (ACC_REMOTE_READ, AETH_ACK_SYN, KS_SND_NXT, NAK_INV_REQ, NAK_REM_ACCESS, NAK_SEQ, OP_ACK, S_BAD_RESP,
                   S_LOC_PROT, S_OK, ST_ERR, ST_RTR, ST_SQD, advance, complete_head, emit, frame_alloc, get_be, ks_addr,
                   mr_check, read_responses, tx_push,
                   psn_diff, publish_comp, push_event, put_be, qp_error, responder_error, rewind, send_syndrome,
                   sq_row)
from .loop import ack_deadline, ack_now, send_nak  # noqa: E402  (the local ACK timer, with its jitter; ACK, NAK)
from .loop import key_row, mr_live_a  # noqa: E402  (MR references, checked on use: MR-SEC-003)
from .prims import addr_of, c_memcpy, ld_acq_i64, ld_acq_u64, ptr_u8, ptr_u64, st_rel_u32

from ..congestion import WIRE_OVERHEAD  # wire bytes of a packet besides its payload
from ..kern.layout import QP_STATE_DTYPE
from ..wire.fastpath import build_frame

_jit = dict(cache=True, nogil=True)
KS_CNP_COUNT = QP_STATE_DTYPE.fields["cnp_count"][1]

WR_READ, WR_CAS, WR_FAA, WR_SEND_INV = 4, 5, 6, 9
OP_ATOMIC_ACK, OP_CAS, OP_FAA, OP_SEND_LAST_INV, OP_SEND_ONLY_INV = 18, 19, 20, 22, 23
ACC_REMOTE_ATOMIC = 8
F_FENCE = 1
WCF_INV = 8
CQE_SOLICITED = 0x100        # a private bit of push_cqe's flags: the completion is solicited (SE)
ARM_NEXT, ARM_SOLICITED = 1, 2


@njit(**_jit)
def rd_atomic(op):
    """READ and ATOMICs: the WQEs that wait for responses (max_rd_atomic, FENCE, implied NAK)."""
    return op == WR_READ or op == WR_CAS or op == WR_FAA


# ============================================================================ gather / scatter
@njit(**_jit)
def sg_rows(A):
    o = A[P_SG_OFF]
    return A[o:o + SG_ROWS * NG].reshape((SG_ROWS, NG))


@njit(**_jit)
def sg_valid(A, sg, nsge):
    """Every MR of a gather/scatter list still valid and still the same registration (MR-MEM-035,
    MR-SEC-003: G_MR holds MR references)."""
    if nsge <= 1:
        return True
    G = sg_rows(A)
    for i in range(nsge):
        m = G[sg + i, G_MR]
        if m and not mr_live_a(A, m):
            return False
    return True


@njit(**_jit)
def place(A, laddr, sg, nsge, off, src, n):
    """Copy n bytes from raw address src to byte `off` of a WQE's buffer (one SGE at laddr, or its list)."""
    if n <= 0:
        return
    if nsge <= 1:
        c_memcpy(laddr + off, src, n)
        return
    G = sg_rows(A)
    base = 0
    pos = 0
    for i in range(nsge):
        ln = G[sg + i, G_LENGTH]
        if off < base + ln:
            start = max(off - base, 0)
            take = min(ln - start, n - pos)
            c_memcpy(G[sg + i, G_ADDR] + start, src + pos, take)
            pos += take
            off += take
            if pos >= n:
                return
        base += ln


@njit(**_jit)
def gather(A, sg, nsge, off, n):
    """Bytes [off, off + n) of a gather list, copied into the port's scratch buffer; its address."""
    dst = A[P_SGX_ADDR]
    G = sg_rows(A)
    base = 0
    pos = 0
    for i in range(nsge):
        ln = G[sg + i, G_LENGTH]
        if off < base + ln and pos < n:
            start = max(off - base, 0)
            take = min(ln - start, n - pos)
            c_memcpy(dst + pos, G[sg + i, G_ADDR] + start, take)
            pos += take
            off += take
        base += ln
    return dst


@njit(**_jit)
def src_of(A, SW, r, off, n):
    """Where the bytes [off, off + n) of send WQE r are (gathered first when it has an SGE list)."""
    if SW[r, W_NSGE] <= 1:
        return SW[r, W_LADDR] + off
    return gather(A, SW[r, W_SG], SW[r, W_NSGE], off, n)


# ============================================================================ completion events
@njit(**_jit)
def cq_notify(A, CQT, cq, qi, status, flags):
    """An armed CQ reports this completion to Python (its channel), once: ARM_NEXT for any completion,
    ARM_SOLICITED for a solicited or unsuccessful one (MR-BTH-004)."""
    arm = CQT[cq, C_ARMED]
    if arm == 0:
        return
    if arm == ARM_NEXT or (flags & CQE_SOLICITED) != 0 or status != S_OK:
        CQT[cq, C_ARMED] = 0
        push_event(A, EV_CQ_NOTIFY, qi, cq, 0)


# ============================================================================ ATOMIC: requester
@njit(**_jit)
def atomic_request(A, Q, SW, TM, umem, tables, ext, qi, r, kaddr):
    """The AtomicETH request of WQE r (one PSN, AckReq); False when no TX frame was free."""
    op = SW[r, W_OPCODE]
    psn = SW[r, W_FIRST_PSN]
    put_be(ext, 0, SW[r, W_RADDR], 8)
    put_be(ext, 8, SW[r, W_RKEY], 4)
    if op == WR_CAS:
        put_be(ext, 12, SW[r, W_SWAP], 8)
        put_be(ext, 20, SW[r, W_IMM], 8)
    else:
        put_be(ext, 12, SW[r, W_IMM], 8)
        put_be(ext, 20, 0, 8)
    if kaddr:
        np_ = (psn + 1) & PSN_MASK
        if psn_diff(np_, Q[qi, Q_SND_MAX]) > 0:
            st_rel_u32(kaddr + KS_SND_NXT, np_)      # before the frame can leave
    if not emit(A, Q, TM, umem, tables, qi, OP_CAS if op == WR_CAS else OP_FAA, 0, 1, psn, ext, 28, 0, 0):
        return False
    SW[r, W_SENT] = 1
    return True


# ============================================================================ ATOMIC: responder
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
    Q[qi, Q_RD_TAIL] += 1


@njit(**_jit)
def flush_ack(A, Q, TM, umem, tables, ext, qi):
    """The coalesced ACK owed so far leaves before a response to a later request -- behind the READ responses of earlier PSNs still queued (loop.ack_now, MR-RC-025)."""
    ack_now(A, Q, TM, umem, tables, ext, qi)


@njit(**_jit)
def responder_atomic(A, Q, SW, CQT, CE, MRT, TM, umem, tables, ext, qi, op, psn, b, end, pad):
    """A COMPARE_SWAP or FETCH_ADD request of QP qi (b = BTH offset, end = ICRC offset)."""
    hdr = b + 12
    if end - pad - (hdr + 28) != 0:
        A[P_RX_DROP_LEN] += 1                       # not an AtomicETH and nothing else: malformed
        return
    e = Q[qi, Q_EPSN]
    d = psn_diff(psn, e)
    if d > 0:                                        # out of sequence: one NAK per gap (MR-NAK-003)
        A[P_RX_OOS] += 1
        if Q[qi, Q_NAK_PEND] == 0:
            Q[qi, Q_NAK_PEND] = 1
            send_nak(A, Q, TM, umem, tables, ext, qi, NAK_SEQ, e)      # behind earlier READs (MR-RC-025)
        return
    if d < 0:                                        # duplicate: the saved result, never executed again
        A[P_RX_DUP] += 1
        t = Q[qi, Q_AT_TAIL]
        lo = max(0, t - MAX_RD)
        while t > lo:
            t -= 1
            a = at_row(A, qi, t)
            if A[a] == psn:
                if Q[qi, Q_RD_TAIL] - Q[qi, Q_RD_HEAD] < MAX_RD:
                    flush_ack(A, Q, TM, umem, tables, ext, qi)
                    queue_atomic_ack(A, Q, qi, psn, A[a + 1])
                    A[P_RX_DUP_ATOMIC] += 1
                return
        return                                       # too old to be remembered: dropped (MR-DUP-005)
    if Q[qi, Q_R_KIND] != RK_NONE:                   # inside a SEND or WRITE (MR-RC-016)
        responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_INV_REQ, psn, EV_QP_REQ_ERR, WHY_OPCODE_SEQUENCE)
        return
    if (Q[qi, Q_ACCESS] & ACC_REMOTE_ATOMIC) == 0:   # the QP does not allow ATOMICs at all (MR-RC-017)
        responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_INV_REQ, psn, EV_QP_REQ_ERR, WHY_ATOMIC_NOT_ALLOWED)
        return
    if Q[qi, Q_RD_TAIL] - Q[qi, Q_RD_HEAD] >= MAX_RD:
        return                                       # beyond max_dest_rd_atomic: dropped, retried
    va = get_be(umem, hdr, 8)
    rkey = get_be(umem, hdr + 8, 4)
    swap_add = get_be(umem, hdr + 12, 8)
    cmp = get_be(umem, hdr + 20, 8)
    # R_Key, PD, access and bounds of [VA, VA + 8) first, then the alignment (Table 3-4, MR-ATOM-005)
    if mr_check(MRT, rkey, Q[qi, Q_PD], va, 8, ACC_REMOTE_ATOMIC) < 0:
        responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_REM_ACCESS, psn, EV_QP_ACCESS_ERR, WHY_REMOTE_ACCESS)
        return
    if va & 7:                                       # MR-ATOM-002: NAK, memory untouched
        responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_INV_REQ, psn, EV_QP_REQ_ERR, WHY_ATOMIC_UNALIGNED)
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
def atomic_ack_job(A, Q, TM, umem, tables, ext, qi, j):
    """Send the ATOMIC ACKNOWLEDGE of job j: the request's PSN, an ACK AETH with the current MSN, the
    original value (MR-ATOM-006, MR-DUP-005).  False when no TX frame was free (sent next round)."""
    put_be(ext, 0, (AETH_ACK_SYN << 24) | (Q[qi, Q_MSN] & PSN_MASK), 4)
    put_be(ext, 4, A[j + J_ADDR], 8)
    return emit(A, Q, TM, umem, tables, qi, OP_ATOMIC_ACK, 0, 0, A[j + J_PSN] & PSN_MASK, ext, 12, 0, 0)


# ============================================================================ responses: the WQE they answer
@njit(**_jit)
def rsp_wqe(Q, SW, qi, psn):
    """The send-queue row whose PSN range holds a response's `psn`, searched from the queue head and
    never past a READ/ATOMIC still unanswered; -1 when there is none (a response was lost: a gap)."""
    i = Q[qi, Q_SQ_HEAD]
    while i != Q[qi, Q_SQ_NEXT]:
        r = sq_row(Q, qi, i)
        d = psn_diff(psn, SW[r, W_FIRST_PSN])
        if d >= 0 and d < SW[r, W_NPSN]:
            return r
        if rd_atomic(SW[r, W_OPCODE]) and SW[r, W_DONE] == 0:
            return -1                                # an earlier READ/ATOMIC is not answered yet
        i += 1
    return -1


@njit(**_jit)
def rsp_gap(A, Q, SW, qi):
    """A response that answers no WQE in order: the requests go again from comp_psn (once per
    comp_psn, go back N), and the packet is counted stale."""
    comp = Q[qi, Q_COMP_PSN]
    if Q[qi, Q_RR_RETRY] != comp + 1:
        Q[qi, Q_RR_RETRY] = comp + 1
        rewind(A, Q, SW, qi, comp)
    A[P_RX_RSP_STALE] += 1


# ============================================================================ ATOMIC: completer
@njit(**_jit)
def completer_atomic(A, Q, SW, CQT, CE, umem, ext, qi, psn, b, end, pad, now):
    """An ATOMIC ACKNOWLEDGE: the original value is placed (host order, MR-ATOM-008) and the WQE
    completes, in order; stale ones are counted and dropped; a gap sends again from comp_psn."""
    if end - pad - (b + 24) != 0:
        A[P_RX_DROP_LEN] += 1
        return
    comp = Q[qi, Q_COMP_PSN]
    if psn_diff(psn, comp) < 0 or psn_diff(psn, Q[qi, Q_SND_MAX]) >= 0:
        A[P_RX_RSP_STALE] += 1
        return
    r = rsp_wqe(Q, SW, qi, psn)
    if r < 0:
        rsp_gap(A, Q, SW, qi)
        return
    if SW[r, W_OPCODE] != WR_CAS and SW[r, W_OPCODE] != WR_FAA:
        qp_error(A, Q, SW, CQT, CE, qi, S_BAD_RESP, EV_QP_FATAL, WHY_BAD_RESPONSE)     # MR-NAK-012
        return
    if psn != comp:
        advance(A, Q, SW, CQT, CE, qi, psn, now)     # the response acknowledges what is before it
        if Q[qi, Q_STATE] == ST_ERR or Q[qi, Q_COMP_PSN] != psn:
            A[P_RX_RSP_STALE] += 1
            return
    if (umem[b + 12] & 0xE0) != 0:                   # an AETH that is not an ACK (MR-NAK-012)
        qp_error(A, Q, SW, CQT, CE, qi, S_BAD_RESP, EV_QP_FATAL, WHY_BAD_RESPONSE)
        return
    lmr = SW[r, W_LMR]
    if (lmr and not mr_live_a(A, lmr)) or not sg_valid(A, SW[r, W_SG], SW[r, W_NSGE]):
        qp_error(A, Q, SW, CQT, CE, qi, S_LOC_PROT, EV_QP_FATAL, WHY_LOCAL_MR_DEREGISTERED)   # MR-MEM-035, MR-SEC-003: never placed
        return
    orig = get_be(umem, b + 16, 8)
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


@njit(**_jit)
def retire_answered(A, Q, SW, CQT, CE, qi):
    """Complete, in order, the answered READ/ATOMIC WQEs at the head and the others wholly before comp_psn."""
    while Q[qi, Q_SQ_HEAD] != Q[qi, Q_SQ_NEXT]:
        rr = sq_row(Q, qi, Q[qi, Q_SQ_HEAD])
        if rd_atomic(SW[rr, W_OPCODE]):
            if SW[rr, W_DONE] == 0:
                break
        elif psn_diff((SW[rr, W_FIRST_PSN] + SW[rr, W_NPSN] - 1) & PSN_MASK, Q[qi, Q_COMP_PSN]) >= 0:
            break
        complete_head(A, Q, SW, CQT, CE, qi, S_OK)
        if Q[qi, Q_STATE] == ST_ERR:
            break


# ============================================================================ SEND WITH INVALIDATE
@njit(**_jit)
def inv_ok(MRT, key, pd):
    """MR-MEM-041: the MR an IETH key may invalidate -- valid, of the QP's PD, registered remotely
    invalidatable (MR-MEM-042) -- or -1."""
    idx = key_row(key)
    if idx <= 0 or idx >= MRT.shape[0]:
        return -1
    if MRT[idx, M_VALID] == 0 or MRT[idx, M_KEY] != key or MRT[idx, M_PD] != pd:
        return -1
    if (MRT[idx, M_ACCESS] & ACC_REMOTE_INV) == 0:
        return -1
    return idx


@njit(**_jit)
def invalidate(MRT, key, pd):
    """MR-MEM-040: from now on no access through the key succeeds; the MR stays registered."""
    idx = inv_ok(MRT, key, pd)
    if idx > 0:
        MRT[idx, M_VALID] = 0


@njit(**_jit)
def comm_est(A, Q, qi, st, epsn0):
    """MR-QP-021: the first request accepted in RTR (it moved the expected PSN) raises COMM_EST, once."""
    if st == ST_RTR and Q[qi, Q_COMM_EST] == 0 and Q[qi, Q_EPSN] != epsn0 and Q[qi, Q_STATE] == ST_RTR:
        Q[qi, Q_COMM_EST] = 1
        push_event(A, EV_COMM_EST, qi, 0, 0)


# ============================================================================ SQD
@njit(**_jit)
def sqd_check(A, Q, SW, qi):
    """MR-QP-013: in SQD the send queue is drained once no started WQE is outstanding; then (once per
    RTS -> SQD) EV_SQ_DRAINED when en_sqd_async_notify asked for it."""
    if Q[qi, Q_SQD_DRAIN] == 0 or Q[qi, Q_STATE] != ST_SQD:
        return
    nxt = Q[qi, Q_SQ_NEXT]
    if Q[qi, Q_SQ_HEAD] != nxt:
        return
    if nxt != ld_acq_i64(Q[qi], Q_SQ_TAIL) and SW[sq_row(Q, qi, nxt), W_STARTED] != 0:
        return
    Q[qi, Q_SQD_DRAIN] = 0
    if Q[qi, Q_SQD_NOTIFY]:
        push_event(A, EV_SQ_DRAINED, qi, 0, 0)


# ============================================================================ DCQCN (congestion.py)
FRAME_TO_WIRE = 24          # of WIRE_OVERHEAD, what a built frame (Ethernet to ICRC, no FCS) lacks: FCS 4 + preamble/IFG 20
_MAX_STEPS = 4096


@njit(**_jit)
def f_rows(A):
    """The float64 table: row 0 the DCQCN parameters (D_*), row qi the QP's state (F_*)."""
    o = A[P_F_OFF]
    m = A[P_MAXQ]
    return A[o:o + m * NF].view(np.float64).reshape((m, NF))


@njit(**_jit)
def rp_increase(F, qi):
    P = F[0]
    s = F[qi]
    lo = min(s[F_T_CNT], s[F_B_CNT])
    hi = max(s[F_T_CNT], s[F_B_CNT])
    if hi < P[D_F]:
        pass                                      # fast recovery: Rt unchanged
    elif lo > P[D_F]:
        s[F_RT] += (lo - P[D_F]) * P[D_R_HAI_BPS]   # hyper increase
    else:
        s[F_RT] += P[D_R_AI_BPS]                  # additive increase
    s[F_RT] = min(s[F_RT], P[D_R_LINE_BPS])
    s[F_RC] = min(P[D_R_LINE_BPS], (s[F_RT] + s[F_RC]) / 2)


@njit(**_jit)
def rp_advance(F, qi, now):
    """The alpha timer (K) and the rate timer (T) up to now (MR-CC-036, MR-CC-037)."""
    P = F[0]
    s = F[qi]
    k = np.int64(P[D_K_NS])
    t = np.int64(P[D_T_NS])
    ad = np.int64(s[F_ALPHA_DUE])
    if now >= ad:
        m = (now - ad) // k + 1
        n = m
        if s[F_CNP_IN_PERIOD] != 0:               # the period that saw a CNP does not decay alpha
            n -= 1
            s[F_CNP_IN_PERIOD] = 0
        s[F_ALPHA] *= (1 - P[D_G]) ** n
        s[F_ALPHA_DUE] = ad + m * k
    rd = np.int64(s[F_RATE_DUE])
    if now >= rd:
        n = (now - rd) // t + 1
        s[F_RATE_DUE] = rd + n * t
        if s[F_RC] >= P[D_R_LINE_BPS] and s[F_RT] >= P[D_R_LINE_BPS]:
            s[F_T_CNT] += n                       # at line rate an increase changes nothing
        else:
            for _ in range(min(n, _MAX_STEPS)):
                s[F_T_CNT] += 1
                rp_increase(F, qi)
            if n > _MAX_STEPS:
                s[F_T_CNT] += n - _MAX_STEPS
                s[F_RC] = P[D_R_LINE_BPS]
                s[F_RT] = P[D_R_LINE_BPS]


@njit(**_jit)
def rp_cnps(A, Q, qi, now):
    """CNPs the XDP program verified and counted into the QP's slot since the last look: the reaction
    point cuts the rate (MR-CC-035): Rt = Rc, Rc = max(R_min, Rc (1 - alpha/2)), alpha = (1-g) alpha + g."""
    if A[P_KS_ADDR] == 0:
        return
    c = ld_acq_u64(ks_addr(A, qi) + KS_CNP_COUNT)
    count = c - Q[qi, Q_K_CNP]
    if count <= 0:
        return
    Q[qi, Q_K_CNP] = c
    A[P_RX_CNP] += count
    F = f_rows(A)
    P = F[0]
    s = F[qi]
    s[F_RX_CNP] += count
    if P[D_ENABLED] == 0:
        return
    # MR-CC-035: one reaction per cnp_interval.  A notification point sends at most one CNP per interval
    # (MR-CNP-003); more in one interval are duplicates or forged -- a CNP carries no PSN, so its only
    # check is the QPN -- and must not cut the rate once each (they did, up to 64 a round).
    # (cnp_interval 0: each CNP reacts, up to 64 a look)
    cuts = min(count, 64)
    iv = np.int64(P[D_CNP_INTERVAL_NS])
    if iv > 0:
        last = np.int64(s[F_RP_LAST_CUT])
        if last != 0 and now - (last - 1) < iv:
            s[F_CNP_COALESCED] += count
            A[P_RX_CNP_COALESCED] += count
            return
        s[F_CNP_COALESCED] += count - 1
        A[P_RX_CNP_COALESCED] += count - 1
        s[F_RP_LAST_CUT] = now + 1                    # + 1: 0 is "never"
        cuts = 1
    rp_advance(F, qi, now)
    for _ in range(cuts):
        s[F_RT] = s[F_RC]
        s[F_RC] = max(P[D_R_MIN_BPS], s[F_RC] * (1 - s[F_ALPHA] / 2))
        s[F_ALPHA] = (1 - P[D_G]) * s[F_ALPHA] + P[D_G]
    s[F_RATE_CUTS] += 1
    s[F_RATE_MIN] = min(s[F_RATE_MIN], s[F_RC])
    s[F_CNP_IN_PERIOD] = 1
    s[F_T_CNT] = 0
    s[F_B_CNT] = 0
    s[F_BYTES_SINCE] = 0
    s[F_RATE_DUE] = now + P[D_T_NS]
    s[F_TOKENS] = min(s[F_TOKENS], P[D_BURST_BYTES])


@njit(**_jit)
def rp_allowance(A, qi, now, budget, packet_bytes):
    """How many of `budget` packets the QP may send now (MR-CC-034): at line rate all; below it the token
    bucket decides, and a positive balance lets one more packet go (paid in rp_on_sent)."""
    F = f_rows(A)
    P = F[0]
    if P[D_ENABLED] == 0:
        return budget
    s = F[qi]
    rp_advance(F, qi, now)
    dt = now - np.int64(s[F_T_TOKENS])
    s[F_T_TOKENS] = now
    if s[F_RC] >= P[D_R_LINE_BPS]:
        s[F_TOKENS] = P[D_BURST_BYTES]
        return budget
    if dt > 0:
        s[F_TOKENS] = min(P[D_BURST_BYTES], s[F_TOKENS] + dt * s[F_RC] / 8e9)
    if s[F_TOKENS] < 0:
        return 0
    return min(budget, 1 + np.int64(s[F_TOKENS] // max(1, packet_bytes)))


@njit(**_jit)
def rp_on_sent(A, qi, nbytes):
    """The QP put nbytes on the wire: pay the pacer, drive the byte counter B (MR-CC-037)."""
    F = f_rows(A)
    P = F[0]
    if P[D_ENABLED] == 0 or nbytes <= 0:
        return
    s = F[qi]
    s[F_TOKENS] -= nbytes
    s[F_BYTES_SINCE] += nbytes
    while s[F_BYTES_SINCE] >= P[D_B_BYTES]:
        s[F_BYTES_SINCE] -= P[D_B_BYTES]
        s[F_B_CNT] += 1
        rp_increase(F, qi)


@njit(**_jit)
def ce_marked(umem, l3):
    """ECN CE (binary 11) in the IPv4 TOS or IPv6 traffic class."""
    if umem[l3] >> 4 == 6:
        return ((umem[l3 + 1] >> 4) & 3) == 3
    return (umem[l3 + 1] & 3) == 3


@njit(**_jit)
def np_on_ce(A, Q, TM, umem, tables, ext, qi, now):
    """A CE-marked request or READ RESPONSE was accepted: counted (MR-ECN-012) and answered by a CNP at
    most once per cnp_interval (MR-ECN-009, MR-CNP-002, MR-CNP-003)."""
    F = f_rows(A)
    s = F[qi]
    s[F_NP_CE] += 1
    A[P_RX_CE] += 1
    if s[F_NP_LAST] >= 0 and now - np.int64(s[F_NP_LAST]) < np.int64(F[0, D_CNP_INTERVAL_NS]):
        return
    s[F_NP_LAST] = now
    s[F_NP_TX] += 1
    send_cnp(A, Q, TM, umem, tables, ext, qi)


@njit(**_jit)
def send_cnp(A, Q, TM, umem, tables, ext, qi):
    """One CNP to the peer QP from the QP's CNP template (its path, UDP source port and P_Key; DSCP
    cnp_dscp, Not-ECT, BECN 1): opcode 0x81, PSN 0, AckReq 0, 16 zero bytes (MR-CNP-001, MR-XH-016); no
    PSN consumed, never acknowledged (MR-CNP-004).  No free TX frame: the next CE mark sends one."""
    a = frame_alloc(A)
    if a < 0:
        return
    for i in range(16):
        ext[i] = 0
    n = build_frame(tables, umem, a, TM[qi, TM_CNP:], Q[qi, Q_TMPL_LEN], Q[qi, Q_L3_OFF], Q[qi, Q_IPV6] != 0,
                    0x81, 0, 0, 0, ext, 16, ext, 0, 0)
    tx_push(A, a, n)
    A[P_TX_CNP] += 1


# ============================================================================ READ before a later write
@njit(**_jit)
def reads_overlap(A, Q, qi, addr, n):
    """True when a queued READ response stream still has to read bytes of [addr, addr + n)."""
    pmtu = Q[qi, Q_PMTU]
    t = Q[qi, Q_RD_HEAD]
    while t != Q[qi, Q_RD_TAIL]:
        j = A[P_RDJ_OFF] + (qi * MAX_RD + (t % MAX_RD)) * NJ
        if A[j + J_LENGTH] > 0 and A[j + J_MR] > 0:
            lo = A[j + J_ADDR] + A[j + J_SENT] * pmtu
            hi = A[j + J_ADDR] + A[j + J_LENGTH]
            if lo < addr + n and addr < hi:
                return True
        t += 1
    return False


@njit(**_jit)
def protect_reads(A, Q, SW, CQT, CE, MRT, TM, umem, tables, ext, qi, addr, n):
    """MR-RC-025, MR-RC-014: a request is executed only after every earlier one, READ responses included.
    The responses are built as they leave, so before a later request writes [addr, addr + n) -- WRITE,
    SEND placement, ATOMIC -- the queued READ responses that would read any of it leave now (the Python
    engine copies such a READ aside).  Only as many as the round has left (P_RDPROT_LEFT, the port's
    budget, shared by the QPs of the round), paid to the QP's pacer: a peer that queues
    max_dest_rd_atomic large READs and then an overlapping request would otherwise hold the port's one
    loop -- every tenant's QPs, no RX -- for the seconds those responses take, past DCQCN's rate.
    False when they could not all leave: the caller drops the request, counted here (P_RX_RD_DEFER), and
    the requester retransmits it (the PSN sequence error NAK of its next packet, or its timer, go-back-N)
    while the rest of the responses leave at their paced rate in the rounds after.  Not an RNR NAK:
    that is for a request that needs a receive WQE (MR-RNR-001), and a WRITE never does; a request
    dropped for want of responder resources is the loss go-back-N exists for (MR-NAK-003)."""
    if Q[qi, Q_RD_HEAD] == Q[qi, Q_RD_TAIL] or n <= 0 or not reads_overlap(A, Q, qi, addr, n):
        return True
    left = A[P_RDPROT_LEFT]
    if left > 0:
        tb0 = A[P_TX_BYTES]
        k = read_responses(A, Q, SW, CQT, CE, MRT, TM, umem, tables, ext, qi, left)
        A[P_RDPROT_LEFT] = left - k
        rp_on_sent(A, qi, A[P_TX_BYTES] - tb0 + k * FRAME_TO_WIRE)
    if reads_overlap(A, Q, qi, addr, n):
        A[P_RX_RD_DEFER] += 1
        return False
    return True


@njit(**_jit)
def protect_reads_recv(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, qi, r):
    """protect_reads for every piece of receive WQE r (a SEND is placed there)."""
    if Q[qi, Q_RD_HEAD] == Q[qi, Q_RD_TAIL]:
        return True
    if RW[r, R_NSGE] <= 1:
        return protect_reads(A, Q, SW, CQT, CE, MRT, TM, umem, tables, ext, qi, RW[r, R_LADDR], RW[r, R_LENGTH])
    G = sg_rows(A)
    for i in range(RW[r, R_NSGE]):
        g = RW[r, R_SG] + i
        if not protect_reads(A, Q, SW, CQT, CE, MRT, TM, umem, tables, ext, qi, G[g, G_ADDR], G[g, G_LENGTH]):
            return False
    return True
