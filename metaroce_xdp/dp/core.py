"""What every role of the compiled RC plane shares: the numbers (QP states, opcodes, statuses, access
bits, the kernel slot's offsets), MR checks, frames out (`emit`, the syndrome-only packets), completions
(`push_cqe`, the CQ's notification, `complete_head`, `flush_queues`), the error path (`qp_error`), the
event ring, and gather/scatter over SGE lists.  Imports no role module (requester, completer, responder,
atomics, cc, round); they all import it.

All state is the port's Arena (layout.py): A is the arena's int64 words, Q the QP table, SW/RW the send
and receive WQEs, CE/CQT the CQEs and CQs, MRT the MR table, TM the per-QP frame templates, umem the
AF_XDP UMEM, tables the ICRC tables, ext a scratch buffer for extension headers.

* References to an MR (a WQE's SGE, a queued READ response) keep the reference, never the bare row:
  `mr_live` checks the valid bit and the generation on use (MR-SEC-003).
* Gather/scatter lists of more than one SGE: the WQE names rows of the SG table; sends gather into a
  per-port scratch buffer, READ responses, ATOMIC results and RECVs scatter (`place`).
* Completion events: an armed CQ (C_ARMED 1: any completion, 2: solicited or unsuccessful only,
  MR-BTH-004) disarms and hands EV_CQ_NOTIFY to Python at the completion.
"""
from __future__ import annotations

import numpy as np
from numba import carray, njit
from .. import jitcache  # noqa: F401  (cache keyed on every module compiled code depends on)

from .layout import *  # noqa: F401,F403  (column numbers are compile-time constants)
from ..kern.layout import QP_STATE_DTYPE
from ..wire.fastpath import build_frame
from ..wire.hdr import put_aeth
from ..wire.psn import psn_diff
from .layout import (C_BASE, C_HEAD, C_OVERFLOW, C_SIZE, C_TAIL, E_BYTE_LEN, E_FLAGS, E_IMM, E_OPCODE, E_QP_NUM,
                     E_STATUS, E_WR_ID, G_ADDR, G_LENGTH, G_MR, NEVF, NG, NM, PSN_MASK, RK_NONE, SG_ROWS)
from .reasons import WHY_CQ_OVERFLOW
from .prims import c_memcpy, ld_acq_i64, ptr_u8, st_rel_i64, st_rel_u32, st_rel_u8
from .ring import frame_alloc, tx_push

_jit = dict(cache=True, nogil=True)

# kernel slot offsets (struct mr_qp_state)
_KF = {k: v[1] for k, v in QP_STATE_DTYPE.fields.items()}
KS_STATE = _KF["state"]
KS_SND_NXT = _KF["snd_nxt"]
KS_COMP_PSN = _KF["comp_psn"]
KS_NAK_READ = _KF["nak_read_psn"]
KS_ACK_SEQ = _KF["ack_seq"]
KS_ACK_PSN = _KF["ack_psn"]
KS_NAK_PSN = _KF["nak_psn"]
KS_NAK_SEQ = _KF["nak_seq"]
KS_RNR_PSN = _KF["rnr_psn"]
KS_RNR_SEQ = _KF["rnr_seq"]
KS_NAK_CODE = _KF["nak_code"]
KS_RNR_TIMER = _KF["rnr_timer"]
KS_CNP_COUNT = _KF["cnp_count"]

ST_RESET, ST_INIT, ST_RTR, ST_RTS, ST_SQD, ST_SQE, ST_ERR = 0, 1, 2, 3, 4, 5, 6
# WR opcodes (verbs_types.WROpcode) and WC opcodes / statuses (libibverbs numbers)
WR_WRITE, WR_WRITE_IMM, WR_SEND, WR_SEND_IMM, WR_READ, WR_CAS, WR_FAA, WR_SEND_INV = 0, 1, 2, 3, 4, 5, 6, 9
WC_SEND, WC_WRITE, WC_READ, WC_RECV, WC_RECV_IMM = 0, 1, 2, 128, 129
S_OK, S_LOC_LEN, S_LOC_QP_OP, S_LOC_PROT, S_FLUSH, S_BAD_RESP = 0, 1, 2, 4, 5, 7
S_LOC_ACCESS, S_REM_INV_REQ, S_REM_ACCESS, S_REM_OP, S_RETRY_EXC, S_RNR_EXC = 8, 9, 10, 11, 12, 13
F_FENCE, F_SIGNALED, F_SOLICITED = 1, 2, 4
WCF_IMM, WCF_INV = 2, 8
CQE_SOLICITED = 0x100        # a private bit of push_cqe's flags: the completion is solicited (SE)
ARM_NEXT, ARM_SOLICITED = 1, 2
ACC_REMOTE_WRITE, ACC_REMOTE_READ, ACC_REMOTE_ATOMIC = 2, 4, 8
AETH_ACK_SYN = 0x1F          # ACK, credits invalid
NAK_SEQ, NAK_INV_REQ, NAK_REM_ACCESS, NAK_REM_OP = 0x60, 0x61, 0x62, 0x63
RNR_SYN = 0x20
OP_READ_REQ, OP_RSP_FIRST, OP_RSP_MIDDLE, OP_RSP_LAST, OP_RSP_ONLY, OP_ACK = 12, 13, 14, 15, 16, 17
OP_ATOMIC_ACK, OP_CAS, OP_FAA, OP_SEND_LAST_INV, OP_SEND_ONLY_INV, OP_CNP = 18, 19, 20, 22, 23, 0x81

RNR_TIMER_US = np.array((655360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920,
                         2560, 3840, 5120, 7680, 10240, 15360, 20480, 30720, 40960, 61440, 81920, 122880,
                         163840, 245760, 327680, 491520), np.int64)


@njit(**_jit)
def ack_deadline(Q, qi, now):
    """When the local ACK timer of QP qi, (re)started at `now`, expires (0: timeout 0, never): T plus a
    jitter in [0, T/4), from a hash of the QP and the time, so that the timers of QPs armed in the same
    round do not all expire in the same round.  MR-RETRY-003: never before T, and by 1.25 T well
    before 2 T (a timeout deferred by TO_PER_ROUND waits rounds, not T)."""
    t = Q[qi, Q_TIMEOUT_NS]
    if t == 0:
        return 0
    h = (qi + 1) * 0x9E3779B1 + (now >> 10) * 0x85EBCA6B
    h ^= h >> 15
    h = (h * 0x2C1B3C6D) & 0x7FFFFFFFFFFF
    h ^= h >> 13
    return now + t + (h % max(1, t >> 2))


@njit(**_jit)
def ks_addr(A, qi):
    return A[P_KS_ADDR] + qi * A[P_KS_SIZE]


@njit(**_jit)
def push_event(A, typ, qi, arg, arg2):
    off = A[P_EV_OFF]
    n = (A[P_EV_TAIL] - A[P_EV_HEAD])
    cap = 1024
    if n >= cap:
        A[P_EV_DROP] += 1                            # nobody drains the ring: counted, not silent
        return
    i = off + (A[P_EV_TAIL] % cap) * NEVF
    A[i] = typ
    A[i + 1] = qi
    A[i + 2] = arg
    A[i + 3] = arg2
    st_rel_i64(A, P_EV_TAIL, A[P_EV_TAIL] + 1)


@njit(**_jit)
def activate(A, Q, qi):
    if Q[qi, Q_ACTIVE] == 0:
        Q[qi, Q_ACTIVE] = 1
        A[A[P_ACT_OFF] + A[P_N_ACT]] = qi
        A[P_N_ACT] += 1


@njit(**_jit)
def key_row(key):
    """The MR table row a key or MR reference names (layout.key_slot, compiled)."""
    return (key >> 8) & MR_SLOT_MASK


@njit(**_jit)
def in_mr(base, mlen, va, length):
    """[va, va + length) inside [base, base + mlen), with no sum of untrusted numbers (STYLE 14): a VA
    read as a negative int64 (>= 2^63) is outside every user address space (MR-MEM-024)."""
    if va < 0 or length < 0 or length > mlen or va < base:
        return False
    return va - base <= mlen - length


@njit(**_jit)
def mr_check(MRT, key, pd, va, length, need):
    """The MR reference (M_REF) for a remote access, or -1: key (index and tag), valid bit, PD, access,
    bounds.  Whoever keeps it past this packet checks it with mr_live on every later use (MR-SEC-003)."""
    idx = key_row(key)
    if idx <= 0 or idx >= MRT.shape[0]:
        return -1
    if MRT[idx, M_VALID] == 0 or MRT[idx, M_KEY] != key or MRT[idx, M_PD] != pd:
        return -1
    if (MRT[idx, M_ACCESS] & need) == 0:
        return -1
    if not in_mr(MRT[idx, M_ADDR], MRT[idx, M_LENGTH], va, length):
        return -1
    ref = MRT[idx, M_REF]
    return ref if ref > 0 else -1


@njit(**_jit)
def mr_live(MRT, ref):
    """MR-SEC-003, MR-MEM-011: the registration `ref` names is still the row's and still valid.  A
    deregistration clears the valid bit and a re-registration of the row gets a new generation, so a
    reference taken before either never reaches the row's memory again.  The valid bit is read first,
    with acquire: a re-registration stores the new reference before it sets the bit, so a set bit is never
    seen beside the old reference."""
    i = key_row(ref)
    return ld_acq_i64(MRT[i], M_VALID) != 0 and MRT[i, M_REF] == ref


@njit(**_jit)
def mr_live_a(A, ref):
    """mr_live for code that has the port block only (the MR table at A[P_MR_OFF])."""
    o = A[P_MR_OFF] + key_row(ref) * NM
    return ld_acq_i64(A, o + M_VALID) != 0 and A[o + M_REF] == ref


@njit(**_jit)
def emit(A, Q, TM, umem, tables, qi, opcode, flags, ackreq, psn, ext, ext_len, src_addr, plen):
    """Build one frame of QP qi (payload plen bytes at raw address src_addr) and queue it."""
    a = frame_alloc(A)
    if a < 0:
        return False
    pay = carray(ptr_u8(src_addr), (plen,))
    n = build_frame(tables, umem, a, TM[qi], Q[qi, Q_TMPL_LEN], Q[qi, Q_L3_OFF], Q[qi, Q_IPV6] != 0,
                    opcode, flags, ackreq, psn, ext, ext_len, pay, 0, plen)
    tx_push(A, a, n)
    return True


@njit(**_jit)
def send_syndrome(A, Q, TM, umem, tables, ext, qi, syn, psn):
    """An ACKNOWLEDGE: ACK, NAK or RNR NAK (MR-ACK-001) with the QP's MSN.  False when no UMEM frame
    was free (counted in tx_no_frame): the caller keeps what it owes."""
    return send_syndrome_msn(A, Q, TM, umem, tables, ext, qi, syn, psn, Q[qi, Q_MSN])


@njit(**_jit)
def send_syndrome_msn(A, Q, TM, umem, tables, ext, qi, syn, psn, msn):
    """send_syndrome with a given MSN (an ACK decided earlier and held behind READ responses: ack_now)."""
    n = put_aeth(ext, 0, syn, msn)
    if emit(A, Q, TM, umem, tables, qi, OP_ACK, 0, 0, psn & PSN_MASK, ext, n, 0, 0):
        if syn == AETH_ACK_SYN:
            A[P_TX_ACK] += 1
        elif (syn & 0x60) == RNR_SYN:
            A[P_TX_RNR] += 1
            Q[qi, Q_N_RNR_TX] += 1                    # rnr_naks_sent (MR-SEC-031)
        else:
            A[P_TX_NAK] += 1
            Q[qi, Q_N_NAKS_TX] += 1                   # per QP too (metaroced's qp show)
        return True
    return False


@njit(**_jit)
def push_cqe(A, Q, CQT, CE, cq, qi, wr_id, status, opcode, byte_len, imm, flags):
    """Add a CQE; a full CQ overflows: the completion is lost, CQ_ERR raised once, the QP goes to ERR."""
    size = CQT[cq, C_SIZE]
    tail = CQT[cq, C_TAIL]
    if tail - ld_acq_i64(CQT[cq], C_HEAD) >= size:
        if CQT[cq, C_OVERFLOW] == 0:
            CQT[cq, C_OVERFLOW] = 1
            push_event(A, EV_CQ_ERR, qi, cq, 0)
        return False
    CQT[cq, C_OVERFLOW] = 0
    r = CQT[cq, C_BASE] + (tail & (size - 1))
    CE[r, E_WR_ID] = wr_id
    CE[r, E_STATUS] = status
    CE[r, E_OPCODE] = opcode
    CE[r, E_BYTE_LEN] = byte_len
    CE[r, E_QP_NUM] = Q[qi, Q_QPN]
    CE[r, E_IMM] = imm
    CE[r, E_FLAGS] = flags & 0xFF
    st_rel_i64(CQT[cq], C_TAIL, tail + 1)
    A[P_CQE_OUT] += 1
    if CQT[cq, C_ARMED]:
        cq_notify(A, CQT, cq, qi, status, flags)       # completion channels
    return True


@njit(**_jit)
def wc_of(op):
    if op == WR_WRITE or op == WR_WRITE_IMM:
        return WC_WRITE
    if op == WR_READ:
        return WC_READ
    if op == 5 or op == 6:
        return op - 2                                  # COMP_SWAP 3, FETCH_ADD 4
    return WC_SEND


@njit(**_jit)
def sq_row(Q, qi, idx):
    return Q[qi, Q_SQ_BASE] + (idx & (Q[qi, Q_SQ_SIZE] - 1))


@njit(**_jit)
def complete_head(A, Q, SW, CQT, CE, qi, status):
    r = sq_row(Q, qi, Q[qi, Q_SQ_HEAD])
    if rd_atomic(SW[r, W_OPCODE]) and SW[r, W_DONE] == 0 and SW[r, W_STARTED]:
        Q[qi, Q_RD_OUT] -= 1                          # an unanswered READ or ATOMIC leaves (error)
    SW[r, W_DONE] = 1
    if status != S_OK or (SW[r, W_FLAGS] & F_SIGNALED) or Q[qi, Q_SIG_ALL]:
        if not push_cqe(A, Q, CQT, CE, Q[qi, Q_SEND_CQ], qi, SW[r, W_WR_ID], status, wc_of(SW[r, W_OPCODE]),
                        SW[r, W_LENGTH] if status == S_OK else 0, 0, 0):
            qp_error(A, Q, SW, CQT, CE, qi, -1, EV_QP_FATAL, WHY_CQ_OVERFLOW)
            return
    Q[qi, Q_SQ_HEAD] += 1
    if Q[qi, Q_SQ_NEXT] - Q[qi, Q_SQ_HEAD] < 0:
        # a go-back-N was resending this WQE when the ACK for it came (it had arrived; the ACK was
        # late): sending goes on after it, not from the PSN the resending had reached -- a WQE started
        # next would take PSNs the responder already executed (MR-RC-004), and the one of them at its
        # ePSN would be out of sequence there (tests/dp/test_dp_requester_resume.py)
        Q[qi, Q_SQ_NEXT] = Q[qi, Q_SQ_HEAD]
        after = (SW[r, W_FIRST_PSN] + SW[r, W_NPSN]) & PSN_MASK
        if psn_diff(Q[qi, Q_SND_PSN], after) < 0:
            Q[qi, Q_SND_PSN] = after
    Q[qi, Q_RETRY_LEFT] = Q[qi, Q_RETRY_CNT]       # forward progress resets both budgets
    Q[qi, Q_RNR_LEFT] = Q[qi, Q_RNR_RETRY]


@njit(**_jit)
def flush_queues(A, Q, SW, RW, CQT, CE, qi):
    """ERR: everything still queued completes with WR_FLUSH_ERR, in posting order (MR-QP-027)."""
    tail = ld_acq_i64(Q[qi], Q_SQ_TAIL)
    while Q[qi, Q_SQ_HEAD] != tail:
        r = sq_row(Q, qi, Q[qi, Q_SQ_HEAD])
        if not push_cqe(A, Q, CQT, CE, Q[qi, Q_SEND_CQ], qi, SW[r, W_WR_ID], S_FLUSH, wc_of(SW[r, W_OPCODE]),
                        0, 0, 0):
            break
        Q[qi, Q_SQ_HEAD] += 1
    Q[qi, Q_SQ_NEXT] = Q[qi, Q_SQ_HEAD]
    Q[qi, Q_RD_OUT] = 0
    rtail = ld_acq_i64(Q[qi], Q_RQ_TAIL)
    while Q[qi, Q_RQ_HEAD] != rtail:
        r = Q[qi, Q_RQ_BASE] + (Q[qi, Q_RQ_HEAD] & (Q[qi, Q_RQ_SIZE] - 1))
        if not push_cqe(A, Q, CQT, CE, Q[qi, Q_RECV_CQ], qi, RW[r, R_WR_ID], S_FLUSH, WC_RECV, 0, 0, 0):
            break
        Q[qi, Q_RQ_HEAD] += 1
    Q[qi, Q_R_KIND] = RK_NONE
    Q[qi, Q_RD_HEAD] = Q[qi, Q_RD_TAIL]
    Q[qi, Q_ACK_PEND] = 0


@njit(**_jit)
def qp_error(A, Q, SW, CQT, CE, qi, status, ev, why):
    """Enter ERR: the head WQE completes with `status` (when >= 0 and it was sent), the queues are
    flushed; the kernel stops steering requests to the QP; Python hears of it (event `ev`, `why`)."""
    if Q[qi, Q_STATE] == ST_ERR:
        return
    Q[qi, Q_STATE] = ST_ERR
    Q[qi, Q_ERR] = why
    if A[P_KS_ADDR] != 0:
        st_rel_u8(ks_addr(A, qi) + KS_STATE, ST_ERR)
    if status >= 0 and Q[qi, Q_SQ_HEAD] != ld_acq_i64(Q[qi], Q_SQ_TAIL):
        r = sq_row(Q, qi, Q[qi, Q_SQ_HEAD])
        if SW[r, W_STARTED]:
            if push_cqe(A, Q, CQT, CE, Q[qi, Q_SEND_CQ], qi, SW[r, W_WR_ID], status, wc_of(SW[r, W_OPCODE]),
                        0, 0, 0):
                Q[qi, Q_SQ_HEAD] += 1
    push_event(A, ev, qi, why, status)
    Q[qi, Q_FLUSHED] = 0
    activate(A, Q, qi)


@njit(**_jit)
def publish_nak_read(A, Q, qi, psn):
    """The PSN a responder NAKs when a READ's MR goes away mid-stream (MR-MEM-033): the first PSN of
    the READ request whose responses are being placed, or PSN_NONE.  Written before comp_psn."""
    if A[P_KS_ADDR] != 0 and Q[qi, Q_PUB_NAKR] != psn:
        st_rel_u32(ks_addr(A, qi) + KS_NAK_READ, psn)
        Q[qi, Q_PUB_NAKR] = psn


@njit(**_jit)
def publish_comp(A, Q, qi):
    if A[P_KS_ADDR] != 0 and Q[qi, Q_PUB_COMP] != Q[qi, Q_COMP_PSN]:
        st_rel_u32(ks_addr(A, qi) + KS_COMP_PSN, Q[qi, Q_COMP_PSN])
        Q[qi, Q_PUB_COMP] = Q[qi, Q_COMP_PSN]


@njit(**_jit)
def rd_atomic(op):
    """READ and ATOMICs: the WQEs that wait for responses (max_rd_atomic, FENCE, implied NAK)."""
    return op == WR_READ or op == WR_CAS or op == WR_FAA


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


@njit(**_jit)
def comm_est(A, Q, qi, st, epsn0):
    """MR-QP-021: the first request accepted in RTR (it moved the expected PSN) raises COMM_EST, once."""
    if st == ST_RTR and Q[qi, Q_COMM_EST] == 0 and Q[qi, Q_EPSN] != epsn0 and Q[qi, Q_STATE] == ST_RTR:
        Q[qi, Q_COMM_EST] = 1
        push_event(A, EV_COMM_EST, qi, 0, 0)
