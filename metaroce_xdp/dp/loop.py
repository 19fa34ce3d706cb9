"""The compiled progress loop: one function per port does a whole round of RC work.

`round_` -- run by dp/inproc.py's `dp_round(A, TM, umem, tables)` and `dp_run` (a GIL-free loop of
rounds) for the in-process plane, and by dp/serve.py's `dp_serve` for metaroced -- does: receive a
burst straight from the AF_XDP RX ring, validate it (header lengths, ICRC,
QP, state), run the responder (in-order SEND/WRITE placement, RECV consumption, READ
responses, coalesced ACKs, one sequence-error NAK per gap, re-ACKed duplicates, remote
access checks against the MR table, RNR NAKs), the completer (the kernel-written ACK
state in the mmap'd mr_qps slot, READ RESPONSE placement), the requester (segmentation
of SQ WQEs into UMEM frames, PSNs, AckReq every ACKREQ_EVERY packets, window) and the
timers (local ACK timeout, go-back-N, retry_cnt, RNR waits), then fill the TX ring, kick
it and reap the completion ring.  No Python object is created; what Python must see
(errors, state changes) goes to the event ring.

All state is the port's Arena (layout.py): A is the arena's int64 words, TM the per-QP
frame templates, umem the AF_XDP UMEM, tables the ICRC tables.  Work finding: a post
puts its QP in the ready ring; only QPs in the active list (outstanding work) have their
kernel slot and timers looked at, so idle cost does not grow with the number of QPs.

The entry points (dp/inproc.py, dp/serve.py, dp/drive.py) have explicit signatures and cache=True
(their SIGNATURES; metaroce warmup loads them) and compiling is disabled after definition: a call with
other types fails at once instead of compiling on a live path.  They live in modules of their own so
that a process loads only those it runs (metaroced: dp_serve; loading one from numba's cache costs
~0.1 s of CPU).
"""
from __future__ import annotations

import numpy as np
from numba import carray, njit
from .. import jitcache  # noqa: F401,E402  (cache keyed on every module compiled code depends on)

from ..kern.layout import QP_STATE_DTYPE
from ..wire.fastpath import build_frame, frame_icrc_ok, peek_bth, segment_opcode
from ..wire.psn import psn_diff  # noqa: F401  (a - b in [-2^23, 2^23): the one midpoint rule; ops.py takes it from here)
from .layout import *  # noqa: F401,F403  (column numbers are compile-time constants)
from .layout import (ACKREQ_EVERY, MR_BAD, C_HEAD, C_OVERFLOW, C_SIZE, C_TAIL, C_BASE, E_BYTE_LEN, E_FLAGS, E_IMM,
                     E_OPCODE, E_QP_NUM, E_STATUS, E_WR_ID, MAX_RD, NC, NE, NEVF, NJ, NM, NQ, NR, NW, PSN_MASK,
                     PSN_NONE, RK_NONE, RK_SEND, RK_WRITE, TX_BATCH)
from .reasons import (WHY_ACCESS_OR_DMA_LENGTH, WHY_BAD_RESPONSE, WHY_CQ_OVERFLOW, WHY_INVALIDATE_REFUSED,
                      WHY_LOCAL_MR_DEREGISTERED, WHY_OPCODE_SEQUENCE, WHY_PAYLOAD_LENGTH, WHY_PEER_NAK,
                      WHY_RECV_MR_INVALID, WHY_REMOTE_ACCESS, WHY_RETRY_EXHAUSTED, WHY_RNR_RETRY_EXHAUSTED,
                      WHY_SEND_TOO_LONG, WHY_SGE_LOCAL_CHECK)
from .prims import (addr_of, c_memcpy, c_monotonic_ns, c_poll, c_read8, c_recvfrom_kick, c_sendto_kick,
                    ld_acq_i64, ld_acq_u8, ld_acq_u32, ld_acq_u64, ptr_u8, ptr_u64, st_rel_i64, st_rel_u8,
                    st_rel_u32, st_rel_u64)

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

ST_RESET, ST_INIT, ST_RTR, ST_RTS, ST_SQD, ST_SQE, ST_ERR = 0, 1, 2, 3, 4, 5, 6
# WR opcodes (verbs_types.WROpcode) and WC opcodes / statuses (libibverbs numbers)
WR_WRITE, WR_WRITE_IMM, WR_SEND, WR_SEND_IMM, WR_READ = 0, 1, 2, 3, 4
WC_SEND, WC_WRITE, WC_READ, WC_RECV, WC_RECV_IMM = 0, 1, 2, 128, 129
S_OK, S_LOC_LEN, S_LOC_QP_OP, S_LOC_PROT, S_FLUSH, S_BAD_RESP = 0, 1, 2, 4, 5, 7
S_REM_INV_REQ, S_REM_ACCESS, S_REM_OP, S_RETRY_EXC, S_RNR_EXC = 9, 10, 11, 12, 13
F_SIGNALED, F_SOLICITED = 2, 4
WCF_IMM = 2
ACC_REMOTE_WRITE, ACC_REMOTE_READ = 2, 4
AETH_ACK_SYN = 0x1F          # ACK, credits invalid
NAK_SEQ, NAK_INV_REQ, NAK_REM_ACCESS, NAK_REM_OP = 0x60, 0x61, 0x62, 0x63
RNR_SYN = 0x20
OP_READ_REQ, OP_RSP_FIRST, OP_RSP_MIDDLE, OP_RSP_LAST, OP_RSP_ONLY, OP_ACK = 12, 13, 14, 15, 16, 17
RING_NEED_WAKEUP = 1

RNR_TIMER_US = np.array((655360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920,
                         2560, 3840, 5120, 7680, 10240, 15360, 20480, 30720, 40960, 61440, 81920, 122880,
                         163840, 245760, 327680, 491520), np.int64)

_jit = dict(cache=True, nogil=True)


# ============================================================================ small helpers
# local ACK timeouts that may start go-back-N in one round (the rest wait for the next rounds, a few
# microseconds each while QPs are active): 1,000 QPs that lost packets in the same burst would
# otherwise all retransmit in the same round, overflow the peer's fill ring again and lose the
# packet at comp_psn at every retry until RETRY_EXC_ERR (see timers)
TO_PER_ROUND = 64


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


# ============================================================================ frames and the TX ring
@njit(**_jit)
def frame_alloc(A):
    """A free UMEM frame address, or -1 (after reaping the completion ring once)."""
    if A[P_FREE_TOP] == 0:
        comp_reap(A)
        if A[P_FREE_TOP] == 0:
            A[P_TX_NO_FRAME] += 1
            return -1
    A[P_FREE_TOP] -= 1
    return A[A[P_FREE_OFF] + A[P_FREE_TOP]]


@njit(**_jit)
def frame_free(A, a):
    A[A[P_FREE_OFF] + A[P_FREE_TOP]] = a & A[P_FRAME_MASK]
    A[P_FREE_TOP] += 1


@njit(**_jit)
def comp_reap(A):
    size = A[P_CQ_SIZE]
    if size == 0:
        return 0
    prod = ld_acq_u32(A[P_CQ_PROD])
    cons = ld_acq_u32(A[P_CQ_CONS])
    n = (prod - cons) & 0xFFFFFFFF
    if n == 0:
        return 0
    ring = carray(ptr_u64(A[P_CQ_ADDRS]), (size,))
    if A[P_SG] == 0:
        for i in range(n):
            frame_free(A, np.int64(ring[(cons + i) & (size - 1)]))
    else:
        # multi-buffer: a frame of two chained descriptors completes twice; only the descriptor in
        # the first chunk of its slot returns the slot
        inner = ~A[P_FRAME_MASK]
        chunk = A[P_FRAME_SIZE]
        for i in range(n):
            a = np.int64(ring[(cons + i) & (size - 1)])
            if (a & inner) < chunk:
                frame_free(A, a)
    st_rel_u32(A[P_CQ_CONS], (cons + n) & 0xFFFFFFFF)
    return n


@njit(**_jit)
def tx_kick(A):
    """Kick until the kernel took what the TX ring holds (copy mode sends <= 32 per kick)."""
    fd = A[P_FD]
    for _ in range(16):
        if ld_acq_u32(A[P_TX_PROD]) == ld_acq_u32(A[P_TX_CONS]):
            break
        if (ld_acq_u32(A[P_TX_FLAGS]) & RING_NEED_WAKEUP) == 0 and _ > 0:
            break
        c_sendto_kick(fd)
        A[P_KICKS] += 1


@njit(**_jit)
def tx_descs_sg(A, q, done, n, prod, room):
    """Multi-buffer TX (XDP_USE_SG): pending frames done.. onto the TX ring, a frame longer than what
    is left of its chunk as chained descriptors (XDP_PKT_CONTD on all but the last), each within one
    chunk (the frame's bytes are contiguous in its slot); whole frames only, at most `room`
    descriptors.  Publishes the producer index; returns the frames queued."""
    size = A[P_TX_SIZE]
    chunk = A[P_FRAME_SIZE]
    ring = carray(ptr_u64(A[P_TX_DESC]), (size * 2,))
    w = 0
    k = 0
    while done + k < n:
        a = A[q + 2 * (done + k)]
        ln = A[q + 2 * (done + k) + 1]
        first = chunk - (a & (chunk - 1))
        nd = 1 if ln <= first else 1 + (ln - first + chunk - 1) // chunk
        if w + nd > room:
            break
        left = ln
        take = min(ln, first)
        while True:
            j = ((prod + w) & (size - 1)) * 2
            left -= take
            ring[j] = np.uint64(a)
            ring[j + 1] = np.uint64(take | (np.int64(1) << 32 if left > 0 else 0))
            w += 1
            if left <= 0:
                break
            a += take
            take = min(left, chunk)
        k += 1
    if w:
        st_rel_u32(A[P_TX_PROD], (prod + w) & 0xFFFFFFFF)
    return k


@njit(**_jit)
def tx_flush(A):
    """Queue the pending frames on the TX ring, kick, reap."""
    n = A[P_TXN]
    size = A[P_TX_SIZE]
    if n == 0 or size == 0:
        if size:
            # a kick the kernel turned down (EAGAIN/EBUSY/ENOBUFS) leaves frames in the ring: kick again
            if ld_acq_u32(A[P_TX_PROD]) != ld_acq_u32(A[P_TX_CONS]):
                tx_kick(A)
            comp_reap(A)
        return
    q = A[P_TXQ_OFF]
    done = 0
    for attempt in range(8):
        prod = ld_acq_u32(A[P_TX_PROD])
        cons = ld_acq_u32(A[P_TX_CONS])
        room = size - ((prod - cons) & 0xFFFFFFFF)
        k = min(room, n - done)
        if k > 0 and A[P_SG] == 0:
            ring = carray(ptr_u64(A[P_TX_DESC]), (size * 2,))
            for i in range(k):
                j = ((prod + i) & (size - 1)) * 2
                ring[j] = np.uint64(A[q + 2 * (done + i)])
                ring[j + 1] = np.uint64(A[q + 2 * (done + i) + 1])
            st_rel_u32(A[P_TX_PROD], (prod + k) & 0xFFFFFFFF)
            done += k
        elif k > 0:
            k = tx_descs_sg(A, q, done, n, prod, room)
            done += k
        tx_kick(A)
        comp_reap(A)
        if done == n:
            break
    if done < n:                                  # ring full: those frames are lost (retransmission recovers)
        A[P_TX_RING_FULL] += n - done
        for i in range(done, n):
            frame_free(A, A[q + 2 * i])
    A[P_TXN] = 0


@njit(**_jit)
def tx_push(A, a, ln):
    q = A[P_TXQ_OFF]
    n = A[P_TXN]
    A[q + 2 * n] = a
    A[q + 2 * n + 1] = ln
    A[P_TXN] = n + 1
    A[P_TX] += 1
    A[P_TX_BYTES] += ln
    if n + 1 >= TX_BATCH:
        tx_flush(A)


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
def put_be(ext, off, v, nbytes):
    for i in range(nbytes):
        ext[off + i] = (v >> (8 * (nbytes - 1 - i))) & 0xFF


@njit(**_jit)
def send_syndrome(A, Q, TM, umem, tables, ext, qi, syn, psn):
    """An ACKNOWLEDGE: ACK, NAK or RNR NAK (MR-ACK-001) with the QP's MSN.  False when no UMEM frame
    was free (counted in tx_no_frame): the caller keeps what it owes."""
    return send_syndrome_msn(A, Q, TM, umem, tables, ext, qi, syn, psn, Q[qi, Q_MSN])


@njit(**_jit)
def send_syndrome_msn(A, Q, TM, umem, tables, ext, qi, syn, psn, msn):
    """send_syndrome with a given MSN (an ACK decided earlier and held behind READ responses: ack_now)."""
    put_be(ext, 0, ((syn & 0xFF) << 24) | (msn & PSN_MASK), 4)
    if emit(A, Q, TM, umem, tables, qi, OP_ACK, 0, 0, psn & PSN_MASK, ext, 4, 0, 0):
        if syn == AETH_ACK_SYN:
            A[P_TX_ACK] += 1
        elif (syn & 0x60) == RNR_SYN:
            A[P_TX_RNR] += 1
        else:
            A[P_TX_NAK] += 1
            Q[qi, Q_N_NAKS_TX] += 1                   # per QP too (metaroced's qp show)
        return True
    return False


# ============================================================================ completions
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
        cq_notify(A, CQT, cq, qi, status, flags)       # completion channels (dp/ops.py)
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
        # ePSN would be out of sequence there (tests/test_dp_requester_resume.py)
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


# ============================================================================ requester side
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
def rewind(A, Q, SW, qi, psn):
    """Go back N: transmit again from PSN `psn` (the WQE holding it resumes at that packet)."""
    i = Q[qi, Q_SQ_HEAD]
    end = Q[qi, Q_SQ_NEXT]
    found = -1
    while i != end:
        r = sq_row(Q, qi, i)
        d = psn_diff(psn, SW[r, W_FIRST_PSN])
        if SW[r, W_STARTED] and d >= 0 and d < SW[r, W_NPSN]:
            found = i
            break
        i += 1
    if found < 0:
        # the WQE being sent now (sq_next) may hold it
        if end != ld_acq_i64(Q[qi], Q_SQ_TAIL):
            r = sq_row(Q, qi, end)
            d = psn_diff(psn, SW[r, W_FIRST_PSN])
            if SW[r, W_STARTED] and d >= 0 and d < SW[r, W_NPSN]:
                SW[r, W_SENT] = d
                Q[qi, Q_SND_PSN] = psn
        return
    r = sq_row(Q, qi, found)
    SW[r, W_SENT] = psn_diff(psn, SW[r, W_FIRST_PSN])
    j = found + 1
    while j != end + 1 and j != ld_acq_i64(Q[qi], Q_SQ_TAIL):
        rr = sq_row(Q, qi, j)
        if SW[rr, W_STARTED] == 0:
            break
        SW[rr, W_SENT] = 0
        j += 1
    Q[qi, Q_SQ_NEXT] = found
    Q[qi, Q_SND_PSN] = psn
    A[P_RETRANSMITS] += 1
    Q[qi, Q_N_RETX] += 1


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
            rewind(A, Q, SW, qi, psn)
        return
    # the WQE the NAK names fails once everything before it has completed: READ responses for
    # earlier WQEs may still be in the RX ring (the kernel consumed the NAK ahead of them)
    Q[qi, Q_NERR_PSN] = psn + 1
    Q[qi, Q_NERR_CODE] = code
    nak_error_due(A, Q, SW, CQT, CE, qi)


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
def infl_weight(A, Q, qi):
    """The peer's fill-ring buffers one full packet of QP qi takes: 2 on a multi-buffer port when the
    packet is larger than one RX buffer (a chunk less the kernel's 256-byte headroom: path MTU 4096),
    else 1.  The port's in-flight budget counts these, so path MTU 1024 keeps the whole budget."""
    if A[P_SG] != 0 and Q[qi, Q_PMTU] + 128 > A[P_FRAME_SIZE] - 256:
        return 2
    return 1


@njit(**_jit)
def port_full(A, Q, qi):
    """The port's in-flight budget is spent -- but a QP with fewer than 16 packets out may always send
    (a retransmission after a timeout must never wait for other QPs' packets, which may be lost too)."""
    return A[P_INFL_LEFT] <= 0 and psn_diff(Q[qi, Q_SND_PSN], Q[qi, Q_COMP_PSN]) >= 16


@njit(**_jit)
def requester(A, Q, SW, TM, umem, tables, ext, qi, now, budget):
    """Transmit from the send queue: up to `budget` packets, inside the window.  Returns packets sent."""
    sent = 0
    pmtu = Q[qi, Q_PMTU]
    window = A[P_WINDOW]
    iw = infl_weight(A, Q, qi)
    share = A[P_QP_SHARE] // iw                      # this round's fair share of the port's budget
    if 0 < share < window:
        window = share
    if 0 < Q[qi, Q_TO_WIN] < window:
        window = Q[qi, Q_TO_WIN]                     # reopening after a local ACK timeout
    kaddr = ks_addr(A, qi) if A[P_KS_ADDR] != 0 else 0
    while sent < budget:
        nxt = Q[qi, Q_SQ_NEXT]
        if nxt == ld_acq_i64(Q[qi], Q_SQ_TAIL):
            break
        if psn_diff(Q[qi, Q_SND_PSN], Q[qi, Q_COMP_PSN]) >= window or port_full(A, Q, qi):
            break
        r = sq_row(Q, qi, nxt)
        op = SW[r, W_OPCODE]
        length = SW[r, W_LENGTH]
        lmr = SW[r, W_LMR]
        if (lmr and not mr_live_a(A, lmr)) or not sg_valid(A, SW[r, W_SG], SW[r, W_NSGE]):
            # its local MR was deregistered (MR-MEM-035): nothing of it is read or written; it fails
            # LOC_PROT_ERR once it is the oldest
            if nxt == Q[qi, Q_SQ_HEAD]:
                SW[r, W_STARTED] = 1
                Q[qi, Q_LOCERR] = WHY_SGE_LOCAL_CHECK if lmr == MR_BAD else WHY_LOCAL_MR_DEREGISTERED   # round_ fails it (qp_error)
            break
        if SW[r, W_STARTED] == 0:
            if rd_atomic(op) and Q[qi, Q_RD_OUT] >= Q[qi, Q_MAX_RD]:
                break
            if Q[qi, Q_STATE] == ST_SQD:
                break                                # SQD: no new WQE starts (MR-QP-013)
            if (SW[r, W_FLAGS] & F_FENCE) and Q[qi, Q_RD_OUT] > 0:
                break                                # MR-RC-013: behind earlier READ/ATOMICs
            SW[r, W_FIRST_PSN] = Q[qi, Q_SND_PSN]
            SW[r, W_NPSN] = max(1, (length + pmtu - 1) // pmtu)
            SW[r, W_SENT] = 0
            SW[r, W_STARTED] = 1
            SW[r, W_DONE] = 0
            if rd_atomic(op):
                Q[qi, Q_RD_OUT] += 1
        first = SW[r, W_FIRST_PSN]
        npsn = SW[r, W_NPSN]
        if op == WR_CAS or op == WR_FAA:
            if SW[r, W_SENT] == 0:
                if not atomic_request(A, Q, SW, TM, umem, tables, ext, qi, r, kaddr):
                    break
                sent += 1
        elif op == WR_READ:
            k = SW[r, W_SENT]
            psn = (first + k) & PSN_MASK
            put_be(ext, 0, SW[r, W_RADDR] + k * pmtu, 8)
            put_be(ext, 8, SW[r, W_RKEY], 4)
            put_be(ext, 12, length - k * pmtu, 4)
            if kaddr:
                np_ = (first + npsn) & PSN_MASK
                if psn_diff(np_, Q[qi, Q_SND_MAX]) > 0:
                    st_rel_u32(kaddr + KS_SND_NXT, np_)
            if not emit(A, Q, TM, umem, tables, qi, OP_READ_REQ, 0, 1, psn, ext, 16, 0, 0):
                break
            SW[r, W_STATUS] = k                      # where this request's response stream starts
            SW[r, W_SENT] = npsn
            sent += 1
            A[P_INFL_LEFT] -= (npsn - k) * iw
        else:
            is_write = op == WR_WRITE or op == WR_WRITE_IMM
            has_imm = op == WR_WRITE_IMM or op == WR_SEND_IMM
            se = (SW[r, W_FLAGS] & F_SOLICITED) != 0 and op != WR_WRITE
            ok = True
            while SW[r, W_SENT] < npsn and sent < budget:
                if psn_diff(Q[qi, Q_SND_PSN], Q[qi, Q_COMP_PSN]) >= window or port_full(A, Q, qi):
                    ok = False
                    break
                k = SW[r, W_SENT]
                last = k == npsn - 1
                ext_len = 0
                if is_write and k == 0:
                    put_be(ext, 0, SW[r, W_RADDR], 8)
                    put_be(ext, 8, SW[r, W_RKEY], 4)
                    put_be(ext, 12, length, 4)
                    ext_len = 16
                if last and (has_imm or op == WR_SEND_INV):
                    put_be(ext, ext_len, SW[r, W_IMM], 4)   # ImmDt, or the IETH (the key to invalidate)
                    ext_len += 4
                off = k * pmtu
                plen = min(pmtu, length - off)
                if plen < 0:
                    plen = 0
                psn = (first + k) & PSN_MASK
                if kaddr and psn_diff((psn + 1) & PSN_MASK, Q[qi, Q_SND_MAX]) > 0:
                    st_rel_u32(kaddr + KS_SND_NXT, (psn + 1) & PSN_MASK)   # before the frame can leave
                # AckReq also on the last packet this QP sends before it stops for the window, the
                # port's budget or the round's: the ACK for it is what lets it go on
                ackreq = 1 if (last or (k + 1) % ACKREQ_EVERY == 0 or sent + 1 >= budget or A[P_INFL_LEFT] <= iw
                               or psn_diff((psn + 1) & PSN_MASK, Q[qi, Q_COMP_PSN]) >= window) else 0
                opc = segment_opcode(is_write, has_imm, k, npsn)
                if last and op == WR_SEND_INV:
                    opc = OP_SEND_ONLY_INV if npsn == 1 else OP_SEND_LAST_INV
                if not emit(A, Q, TM, umem, tables, qi, opc, 0x80 if (last and se) else 0, ackreq, psn, ext, ext_len,
                            src_of(A, SW, r, off, plen), plen):
                    ok = False
                    break
                SW[r, W_SENT] = k + 1
                sent += 1
                A[P_INFL_LEFT] -= iw
                Q[qi, Q_SND_PSN] = (psn + 1) & PSN_MASK
                if psn_diff(Q[qi, Q_SND_PSN], Q[qi, Q_SND_MAX]) > 0:
                    Q[qi, Q_SND_MAX] = Q[qi, Q_SND_PSN]
            if not ok or SW[r, W_SENT] < npsn:
                break
        Q[qi, Q_SND_PSN] = (first + npsn) & PSN_MASK
        if psn_diff(Q[qi, Q_SND_PSN], Q[qi, Q_SND_MAX]) > 0:
            Q[qi, Q_SND_MAX] = Q[qi, Q_SND_PSN]
        Q[qi, Q_SQ_NEXT] = nxt + 1
    if sent and Q[qi, Q_DEADLINE] == 0 and Q[qi, Q_TIMEOUT_NS]:
        Q[qi, Q_DEADLINE] = ack_deadline(Q, qi, now)
    return sent


@njit(**_jit)
def to_expired(A, Q, qi, now):
    """QP qi's local ACK timer has expired and would start a go-back-N (not an RNR wait, not the last
    retry, not a native QP: dp/native.py has timers of its own)."""
    st = Q[qi, Q_STATE]
    if st != ST_RTS and st != ST_SQD:
        return False
    if A[P_NAT_OFF] != 0 and A[A[P_NAT_OFF] + qi] > 0:
        return False
    return Q[qi, Q_RNR_UNTIL] == 0 and Q[qi, Q_DEADLINE] != 0 and now >= Q[qi, Q_DEADLINE] \
        and Q[qi, Q_RETRY_LEFT] > 0


@njit(**_jit)
def timeout_cut(A, Q, now):
    """The latest local ACK deadline that may start a go-back-N this round: `now` while at most
    TO_PER_ROUND active QPs have expired timers, else the TO_PER_ROUND-th oldest of their deadlines --
    the oldest go first, so a QP deferred in one round is ahead of every timer that expires later,
    wherever it sits in the active list.  (Handing the round's TO_PER_ROUND out in list order starved
    the QPs at the start of the list, walked last -- the ones the first packets of a burst activated --
    for as long as other QPs kept expiring: their peers' retries ran out meanwhile, the 1,000-QP test
    beside CPU hogs.)  One pass over the active list, only when it is longer than TO_PER_ROUND."""
    n = A[P_N_ACT]
    if n <= TO_PER_ROUND:
        return now
    act = A[P_ACT_OFF]
    k = 0
    for j in range(n):
        if to_expired(A, Q, A[act + j], now):
            k += 1
    if k <= TO_PER_ROUND:
        return now
    d = np.empty(k, np.int64)
    k = 0
    for j in range(n):
        qi = A[act + j]
        if to_expired(A, Q, qi, now):
            d[k] = Q[qi, Q_DEADLINE]
            k += 1
    return np.partition(d, TO_PER_ROUND - 1)[TO_PER_ROUND - 1]


@njit(**_jit)
def timers(A, Q, SW, CQT, CE, qi, now, to_left, cut):
    """Local ACK timeout (MR-RETRY-001): go back N from comp_psn, or RETRY_EXC_ERR when retries ran out;
    the end of an RNR wait resumes at the PSN the RNR NAK named.  Returns 1 when a timeout started a
    go-back-N; with to_left (what is left of the round's TO_PER_ROUND) at 0, or a deadline later than
    the round's `cut` (timeout_cut: the oldest expired timers first), an expired timer waits for a
    later round, its retry not spent."""
    if Q[qi, Q_RNR_UNTIL]:
        if now < Q[qi, Q_RNR_UNTIL]:
            return 0
        Q[qi, Q_RNR_UNTIL] = 0
        rewind(A, Q, SW, qi, Q[qi, Q_RNR_PSN])
        Q[qi, Q_DEADLINE] = ack_deadline(Q, qi, now)
        return 0
    if Q[qi, Q_DEADLINE] == 0:
        return 0
    if psn_diff(Q[qi, Q_SND_MAX], Q[qi, Q_COMP_PSN]) <= 0 and Q[qi, Q_SQ_HEAD] == Q[qi, Q_SQ_NEXT]:
        Q[qi, Q_DEADLINE] = 0                         # nothing outstanding
        return 0
    if now < Q[qi, Q_DEADLINE]:
        return 0
    if A[P_KS_ADDR] != 0 and psn_diff((Q[qi, Q_K_ACK] + 1) & PSN_MASK, Q[qi, Q_COMP_PSN]) > 0:
        advance(A, Q, SW, CQT, CE, qi, (Q[qi, Q_K_ACK] + 1) & PSN_MASK, now)   # held back by a READ before
        if Q[qi, Q_STATE] == ST_ERR or now < Q[qi, Q_DEADLINE]:
            return 0
    if (to_left <= 0 or Q[qi, Q_DEADLINE] > cut) and Q[qi, Q_RETRY_LEFT] > 0:
        return 0                                      # this round's go-back-N starts are spent, or older ones first
    A[P_TIMEOUTS] += 1
    # what the QP looked like at its last timeout (Plane.stats(); for diagnosis)
    A[P_LAST_TO_COMP], A[P_LAST_TO_MAX] = Q[qi, Q_COMP_PSN], Q[qi, Q_SND_MAX]
    A[P_LAST_TO_KACK], A[P_LAST_TO_KSEQ] = Q[qi, Q_K_ACK], Q[qi, Q_K_SEQ]
    A[P_LAST_TO_HEAD], A[P_LAST_TO_NEXT], A[P_LAST_TO_TAIL] = Q[qi, Q_SQ_HEAD], Q[qi, Q_SQ_NEXT], \
        ld_acq_i64(Q[qi], Q_SQ_TAIL)
    if Q[qi, Q_RETRY_LEFT] <= 0:
        qp_error(A, Q, SW, CQT, CE, qi, S_RETRY_EXC, EV_QP_FATAL, WHY_RETRY_EXHAUSTED)
        return 0
    Q[qi, Q_RETRY_LEFT] -= 1
    # go back N with a window of one packet (AckReq), doubled per advancing ACK (advance): a timeout
    # means the peer's RX ring overflowed (no PFC on veth); resending the whole window at once, on top
    # of what the other QPs resend, overflowed it again, and the packet at comp_psn -- the one that
    # matters -- could be lost at every retry until RETRY_EXC_ERR
    Q[qi, Q_TO_WIN] = 1
    rewind(A, Q, SW, qi, Q[qi, Q_COMP_PSN])
    Q[qi, Q_DEADLINE] = ack_deadline(Q, qi, now)
    return 1


# ============================================================================ receive side
@njit(**_jit)
def get_be(umem, off, nbytes):
    v = np.int64(0)
    for i in range(nbytes):
        v = (v << 8) | np.int64(umem[off + i])
    return v


@njit(**_jit)
def responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, syn, psn, ev, why):
    """A NAK that ends the connection (invalid request, remote access), then ERR -- held behind the READ
    responses already queued, which go first (MR-RC-025); meanwhile no new request is taken.  The
    coalesced ACK owed so far goes before it."""
    ack_now(A, Q, TM, umem, tables, ext, qi)
    if Q[qi, Q_RD_HEAD] != Q[qi, Q_RD_TAIL]:
        if Q[qi, Q_FNAK_SYN] == 0:
            Q[qi, Q_FNAK_SYN], Q[qi, Q_FNAK_PSN], Q[qi, Q_FNAK_EV], Q[qi, Q_FNAK_WHY] = syn, psn, ev, why
        return
    send_syndrome(A, Q, TM, umem, tables, ext, qi, syn, psn)
    qp_error(A, Q, SW, CQT, CE, qi, -1, ev, why)


@njit(**_jit)
def push_read_job(A, Q, MRT, qi, psn, va, rkey, dlen):
    """Queue the READ RESPONSEs for a READ request (new or duplicate); False: access violation."""
    mr = 0
    if dlen > 0:
        mr = mr_check(MRT, rkey, Q[qi, Q_PD], va, dlen, ACC_REMOTE_READ)
        if mr < 0 or (Q[qi, Q_ACCESS] & ACC_REMOTE_READ) == 0:
            return -1
    if Q[qi, Q_RD_TAIL] - Q[qi, Q_RD_HEAD] >= MAX_RD:
        return 0                                    # beyond max_dest_rd_atomic: dropped, retried
    j = A[P_RDJ_OFF] + (qi * MAX_RD + (Q[qi, Q_RD_TAIL] % MAX_RD)) * NJ
    pmtu = Q[qi, Q_PMTU]
    A[j + J_PSN] = psn
    A[j + J_ADDR] = va
    A[j + J_LENGTH] = dlen
    A[j + J_MR] = mr
    A[j + J_NPK] = max(1, (dlen + pmtu - 1) // pmtu)
    A[j + J_SENT] = 0
    A[j + J_ACK] = 0
    A[j + J_NAK] = 0
    Q[qi, Q_RD_TAIL] += 1
    return 1


@njit(**_jit)
def abandon_replays(A, Q, qi, psn):
    """MR-DUP-008: a duplicate READ REQUEST at psn restarts its READ there; the responses still queued for
    that READ (its first execution or an earlier replay: a queued READ job whose PSNs hold psn) are not
    sent -- the requester asked again from psn and drops them as stale.  Replaying every duplicate in
    full instead let a go-back-N over a large READ queue up to max_dest_rd_atomic replays of it, and the
    ACKs behind them waited past the requester's local ACK timeout until its retries ran out.  The
    jobs' ACK/NAK attachments still leave in order."""
    i = Q[qi, Q_RD_HEAD]
    while i != Q[qi, Q_RD_TAIL]:
        j = A[P_RDJ_OFF] + (qi * MAX_RD + (i % MAX_RD)) * NJ
        k = psn_diff(psn, A[j + J_PSN])
        if A[j + J_LENGTH] >= 0 and k >= 0 and k < A[j + J_NPK] and A[j + J_SENT] < A[j + J_NPK]:
            A[j + J_SENT] = A[j + J_NPK]
        i += 1


@njit(**_jit)
def dup_read_saved(A, Q, MRT, qi, psn, va, rkey, dlen):
    """MR-DUP-003, MR-DUP-007: a duplicate READ REQUEST is executed again only when it asks for part of
    one of the READs the responder still keeps -- the last max_dest_rd_atomic READ/ATOMIC jobs, which
    stay in the job ring's slots after they were sent -- from the PSN of that part on: the saved READ's
    PSN range holds psn, the R_Key names the same MR, and [va, va + dlen) lies within what the
    saved READ has left from psn on.  Anything else is discarded, as rxe does: 60 bytes in must not
    buy a re-execution of any READ ever answered (up to GiBs out)."""
    pmtu = Q[qi, Q_PMTU]
    t = Q[qi, Q_RD_TAIL]
    lo = max(0, t - MAX_RD)
    mr = -1
    while t > lo:
        t -= 1
        j = A[P_RDJ_OFF] + (qi * MAX_RD + (t % MAX_RD)) * NJ
        slen = A[j + J_LENGTH]
        if slen < 0:                                 # an ATOMIC's job
            continue
        k = psn_diff(psn, A[j + J_PSN])
        if k < 0 or k >= A[j + J_NPK]:
            continue
        if slen > 0 and dlen > 0:
            if mr == -1:
                mr = mr_check(MRT, rkey, Q[qi, Q_PD], va, dlen, ACC_REMOTE_READ)
            if mr != A[j + J_MR]:
                # the saved READ's own R_Key matches even when its MR has gone since: the re-execution's
                # key check then fails and is NAKed with code 2 (MR-DUP-003, MR-MEM-021, MR-MEM-033)
                ref = A[j + J_MR]
                i = key_row(ref)
                if not (mr < 0 and MRT[i, M_REF] == ref and MRT[i, M_KEY] == rkey):
                    continue
        skip = k * pmtu                              # no overflow: k < J_NPK <= 2^31 / pmtu + 1
        if skip > slen:
            continue
        base = A[j + J_ADDR] + skip
        if dlen == 0 or (va >= base and va - base <= (slen - skip) - dlen):
            return True
    return False


@njit(**_jit)
def ack_psn(Q, qi):
    """The PSN of the coalesced ACK (MR-ACK-001): epsn - 1; but while the last requests executed were
    RDMA READs -- only duplicates can have asked for an ACK then -- r - 1, r the PSN of the first of
    them (MR-DUP-002, as rxe does): a requester whose READ responses were
    lost must not take the re-ACK for them."""
    rr = Q[qi, Q_READ_RUN]
    e = rr - 1 if rr else Q[qi, Q_EPSN]
    return (e - 1) & PSN_MASK


@njit(**_jit)
def last_job_before(A, Q, qi, psn, inclusive):
    """The newest queued READ RESPONSE / ATOMIC ACKNOWLEDGE job of QP qi whose PSN is before psn (at or
    before it when inclusive): an ACK or NAK for psn is held behind it (MR-RC-025); -1 when none is."""
    h = Q[qi, Q_RD_HEAD]
    t = Q[qi, Q_RD_TAIL]
    while t != h:
        t -= 1
        j = A[P_RDJ_OFF] + (qi * MAX_RD + (t % MAX_RD)) * NJ
        d = psn_diff(A[j + J_PSN], psn)
        if d < 0 or (inclusive and d == 0):
            return j
    return -1


@njit(**_jit)
def ack_now(A, Q, TM, umem, tables, ext, qi):
    """The coalesced ACK owed (Q_ACK_PEND) is decided now, with the PSN (ack_psn) and MSN of now: sent at
    once -- unless READ responses or ATOMIC ACKNOWLEDGEs of
    PSNs up to it are still queued: then it is attached to the last of those jobs and leaves right
    after its responses (read_responses), so that responses leave in PSN order (MR-RC-025); an ACK
    attached there before is replaced (coalesced, MR-ACK-003: no READ between them).  With no job
    queued this costs one test.  False when it had to be sent and no TX frame was free (the flag stays)."""
    if Q[qi, Q_ACK_PEND] == 0:
        return True
    psn = ack_psn(Q, qi)
    j = last_job_before(A, Q, qi, psn, 1)
    if j >= 0:
        A[j + J_ACK] = psn + 1
        A[j + J_AMSN] = Q[qi, Q_MSN]
        if A[j + J_NAK] and psn_diff(psn, (A[j + J_NAK] - 1) & PSN_MASK) >= 0:
            A[j + J_NAK] = 0                           # requests at the NAK's PSN were executed since
        Q[qi, Q_ACK_PEND] = 0
        return True
    if send_syndrome(A, Q, TM, umem, tables, ext, qi, AETH_ACK_SYN, psn):
        Q[qi, Q_ACK_PEND] = 0
        return True
    return False


@njit(**_jit)
def send_nak(A, Q, TM, umem, tables, ext, qi, syn, psn):
    """A PSN sequence error NAK or an RNR NAK with PSN psn (ePSN), after the coalesced ACK owed: sent at
    once, or -- when READ responses or ATOMIC ACKNOWLEDGEs of earlier PSNs
    are still queued -- attached to the last of those jobs and sent after its responses and its ACK
    (MR-RC-025).  A NAK attached there before stays unless this one names a later PSN (an RNR NAK and
    the sequence error NAK of the packets after it name the same ePSN: the requester goes back to it
    either way)."""
    ack_now(A, Q, TM, umem, tables, ext, qi)
    j = last_job_before(A, Q, qi, psn, 0)
    if j >= 0:
        if A[j + J_NAK] == 0 or psn_diff(psn, (A[j + J_NAK] - 1) & PSN_MASK) > 0:
            A[j + J_NAK] = 1 + (((syn & 0xFF) << 24) | (psn & PSN_MASK))
            A[j + J_NMSN] = Q[qi, Q_MSN]
        return True
    return send_syndrome(A, Q, TM, umem, tables, ext, qi, syn, psn)


@njit(**_jit)
def note_invalid(A, Q, qi, op, psn, plen):
    """What the last invalid request NAK (opcode out of sequence, wrong payload length) was about:
    the QP (+1), the packet's opcode, PSN and payload length, the expected PSN and the message in
    progress (RK_*).  The QP's error reason names them (dp/context.py), for the implementation
    at the other end to be told what it sent."""
    A[P_INV_QP] = qi + 1
    A[P_INV_OP] = op
    A[P_INV_PSN] = psn
    A[P_INV_EPSN] = Q[qi, Q_EPSN]
    A[P_INV_KIND] = Q[qi, Q_R_KIND]
    A[P_INV_LEN] = plen


@njit(**_jit)
def responder(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, qi, op, psn, b, end, pad):
    """One request packet (SEND, WRITE, READ) of QP qi; b = BTH offset, end = ICRC offset."""
    e = Q[qi, Q_EPSN]
    d = psn_diff(psn, e)
    hdr = b + 12
    pmtu = Q[qi, Q_PMTU]
    ackreq = (umem[b + 8] & 0x80) != 0
    if d < 0:                                        # duplicate (MR-DUP-002): ACK again; READ re-executed
        A[P_RX_DUP] += 1
        if op == OP_READ_REQ:
            ack_now(A, Q, TM, umem, tables, ext, qi)       # the ACK owed before this READ's responses
            va = get_be(umem, hdr, 8)
            dlen = get_be(umem, hdr + 12, 4)
            if not dup_read_saved(A, Q, MRT, qi, psn, va, get_be(umem, hdr + 8, 4), dlen):
                A[P_RX_DUP_RD_DROP] += 1                 # MR-DUP-003: not one of resources[]: discarded
                return
            abandon_replays(A, Q, qi, psn)
            if push_read_job(A, Q, MRT, qi, psn, va, get_be(umem, hdr + 8, 4), dlen) < 0:
                responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_REM_ACCESS, psn,
                                EV_QP_ACCESS_ERR, WHY_REMOTE_ACCESS)
        else:
            Q[qi, Q_ACK_PEND] = 1
        return
    if d > 0:                                        # out of sequence: one NAK per gap (MR-NAK-003)
        A[P_RX_OOS] += 1
        if Q[qi, Q_NAK_PEND] == 0:
            Q[qi, Q_NAK_PEND] = 1
            send_nak(A, Q, TM, umem, tables, ext, qi, NAK_SEQ, e)      # behind earlier READs (MR-RC-025)
        return
    kind = Q[qi, Q_R_KIND]
    if op == OP_READ_REQ:
        if kind != RK_NONE:
            note_invalid(A, Q, qi, op, psn, end - pad - hdr)
            responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_INV_REQ, psn, EV_QP_REQ_ERR, WHY_OPCODE_SEQUENCE)
            return
        dlen = get_be(umem, hdr + 12, 4)
        if dlen > (1 << 31) or (Q[qi, Q_ACCESS] & ACC_REMOTE_READ) == 0:
            # a READ the QP does not allow (MR-RC-017) or a DMA Length above 2^31 (MR-XH-004): code 1
            responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_INV_REQ, psn, EV_QP_REQ_ERR, WHY_ACCESS_OR_DMA_LENGTH)
            return
        # the ACK owed for earlier requests is decided before this READ: its PSN is before the READ's and
        # it leaves before the READ's responses (MR-RC-025, MR-ACK-001)
        ack_now(A, Q, TM, umem, tables, ext, qi)
        k = push_read_job(A, Q, MRT, qi, psn, get_be(umem, hdr, 8), get_be(umem, hdr + 8, 4), dlen)
        if k < 0:
            responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_REM_ACCESS, psn, EV_QP_ACCESS_ERR, WHY_REMOTE_ACCESS)
            return
        if k == 0:
            return
        Q[qi, Q_NAK_PEND] = 0
        Q[qi, Q_EPSN] = (psn + max(1, (dlen + pmtu - 1) // pmtu)) & PSN_MASK
        Q[qi, Q_MSN] = (Q[qi, Q_MSN] + 1) & PSN_MASK
        if Q[qi, Q_READ_RUN] == 0:
            Q[qi, Q_READ_RUN] = psn + 1                # the first of a run of READs (MR-DUP-002)
        return
    inv = op == OP_SEND_LAST_INV or op == OP_SEND_ONLY_INV     # SEND WITH INVALIDATE (dp/ops.py)
    is_write = op >= 6 and not inv
    sub = op - 6 if is_write else ((2 if op == OP_SEND_LAST_INV else 4) if inv else op)
    first = sub == 0 or sub == 4 or sub == 5
    lastp = sub >= 2
    has_imm = sub == 3 or sub == 5
    want = RK_NONE if first else (RK_WRITE if is_write else RK_SEND)
    if kind != want:
        note_invalid(A, Q, qi, op, psn, end - pad - hdr)
        responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_INV_REQ, psn, EV_QP_REQ_ERR, WHY_OPCODE_SEQUENCE)
        return
    pay = hdr
    va = np.int64(0)
    rkey = np.int64(0)
    dlen = np.int64(0)
    if is_write and first:
        va = get_be(umem, pay, 8)
        rkey = get_be(umem, pay + 8, 4)
        dlen = get_be(umem, pay + 12, 4)
        pay += 16
    imm = np.int64(0)
    if has_imm or inv:
        imm = get_be(umem, pay, 4)                   # ImmDt, or the IETH
        pay += 4
    plen = end - pad - pay
    if plen < 0 or (not lastp and plen != pmtu) or plen > pmtu or (lastp and not first and plen < 1):
        note_invalid(A, Q, qi, op, psn, plen)
        responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_INV_REQ, psn, EV_QP_REQ_ERR, WHY_PAYLOAD_LENGTH)
        return
    src = A[P_UMEM_ADDR] + pay
    if has_imm or (not is_write and first):
        if Q[qi, Q_RQ_HEAD] == ld_acq_i64(Q[qi], Q_RQ_TAIL):      # no receive WQE: RNR NAK (MR-RNR-001)
            send_nak(A, Q, TM, umem, tables, ext, qi, RNR_SYN | (Q[qi, Q_MIN_RNR] & 0x1F), psn)
            return
    if not is_write:
        r = Q[qi, Q_RQ_BASE] + (Q[qi, Q_RQ_HEAD] & (Q[qi, Q_RQ_SIZE] - 1))
        if first and not protect_reads_recv(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, qi, r):
            return                                   # earlier READ responses first (MR-RC-025): retransmitted
        if first:
            Q[qi, Q_R_TOTAL] = 0
            Q[qi, Q_R_KIND] = RK_SEND
        if (RW[r, R_LMR] and not mr_live_a(A, RW[r, R_LMR])) or not sg_valid(A, RW[r, R_SG], RW[r, R_NSGE]):
            # the receive buffer's MR was deregistered (or re-registered: MR-SEC-003): the RECV fails,
            # nothing is placed
            push_cqe(A, Q, CQT, CE, Q[qi, Q_RECV_CQ], qi, RW[r, R_WR_ID], S_LOC_PROT, WC_RECV, 0, 0, 0)
            Q[qi, Q_RQ_HEAD] += 1
            Q[qi, Q_R_KIND] = RK_NONE
            responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_REM_OP, psn, EV_QP_FATAL, WHY_RECV_MR_INVALID)
            return
        if Q[qi, Q_R_TOTAL] + plen > RW[r, R_LENGTH]:
            # the message is longer than the receive buffer: the RECV fails, the requester gets
            # an invalid request NAK (MR-RC-017)
            push_cqe(A, Q, CQT, CE, Q[qi, Q_RECV_CQ], qi, RW[r, R_WR_ID], S_LOC_LEN, WC_RECV, 0, 0, 0)
            Q[qi, Q_RQ_HEAD] += 1
            Q[qi, Q_R_KIND] = RK_NONE
            responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_INV_REQ, psn, EV_QP_REQ_ERR, WHY_SEND_TOO_LONG)
            return
        if inv and inv_ok(MRT, imm, Q[qi, Q_PD]) < 0:
            # the IETH names no valid, remotely invalidatable MR of the QP's PD (MR-MEM-041, MR-NAK-006 (h))
            push_cqe(A, Q, CQT, CE, Q[qi, Q_RECV_CQ], qi, RW[r, R_WR_ID], S_REM_INV_REQ, WC_RECV, 0, 0, 0)
            Q[qi, Q_RQ_HEAD] += 1
            Q[qi, Q_R_KIND] = RK_NONE
            responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_INV_REQ, psn, EV_QP_REQ_ERR, WHY_INVALIDATE_REFUSED)
            return
        if plen:
            place(A, RW[r, R_LADDR], RW[r, R_SG], RW[r, R_NSGE], Q[qi, Q_R_TOTAL], src, plen)
        Q[qi, Q_R_TOTAL] += plen
        if lastp:
            flags = (WCF_IMM if has_imm else 0) | (CQE_SOLICITED if umem[b + 1] & 0x80 else 0)
            if inv:
                invalidate(MRT, imm, Q[qi, Q_PD])    # MR-MEM-040
                flags |= WCF_INV
            Q[qi, Q_R_KIND] = RK_NONE
            Q[qi, Q_RQ_HEAD] += 1
            Q[qi, Q_MSN] = (Q[qi, Q_MSN] + 1) & PSN_MASK
            push_cqe(A, Q, CQT, CE, Q[qi, Q_RECV_CQ], qi, RW[r, R_WR_ID], S_OK, WC_RECV, Q[qi, Q_R_TOTAL],
                     imm, flags)
    else:
        if first:
            if dlen > (1 << 31) or (Q[qi, Q_ACCESS] & ACC_REMOTE_WRITE) == 0:
                # a WRITE the QP does not allow (MR-RC-017) or a DMA Length above 2^31 (MR-XH-004): code 1
                responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_INV_REQ, psn, EV_QP_REQ_ERR, WHY_ACCESS_OR_DMA_LENGTH)
                return
            mr = 0
            if dlen > 0:
                mr = mr_check(MRT, rkey, Q[qi, Q_PD], va, dlen, ACC_REMOTE_WRITE)
                if mr < 0:
                    responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_REM_ACCESS, psn,
                                    EV_QP_ACCESS_ERR, WHY_REMOTE_ACCESS)
                    return
                if not protect_reads(A, Q, SW, CQT, CE, MRT, TM, umem, tables, ext, qi, va, dlen):
                    return                           # earlier READ responses first (MR-RC-025): retransmitted
            Q[qi, Q_R_ADDR] = va
            Q[qi, Q_R_LEFT] = dlen
            Q[qi, Q_R_MR] = mr
            Q[qi, Q_R_TOTAL] = dlen
            Q[qi, Q_R_KIND] = RK_WRITE
        elif Q[qi, Q_R_MR] and not mr_live(MRT, Q[qi, Q_R_MR]):
            # its MR deregistered meanwhile, or its row registered again (MR-MEM-033, MR-SEC-003)
            responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_REM_ACCESS, psn, EV_QP_ACCESS_ERR, WHY_REMOTE_ACCESS)
            return
        if plen > Q[qi, Q_R_LEFT] or (lastp and plen != Q[qi, Q_R_LEFT]):
            note_invalid(A, Q, qi, op, psn, plen)
            responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_INV_REQ, psn, EV_QP_REQ_ERR, WHY_PAYLOAD_LENGTH)
            return
        if plen:
            c_memcpy(Q[qi, Q_R_ADDR], src, plen)
        Q[qi, Q_R_ADDR] += plen
        Q[qi, Q_R_LEFT] -= plen
        if lastp:
            Q[qi, Q_R_KIND] = RK_NONE
            Q[qi, Q_MSN] = (Q[qi, Q_MSN] + 1) & PSN_MASK
            if has_imm:
                r = Q[qi, Q_RQ_BASE] + (Q[qi, Q_RQ_HEAD] & (Q[qi, Q_RQ_SIZE] - 1))
                Q[qi, Q_RQ_HEAD] += 1
                push_cqe(A, Q, CQT, CE, Q[qi, Q_RECV_CQ], qi, RW[r, R_WR_ID], S_OK, WC_RECV_IMM, Q[qi, Q_R_TOTAL],
                         imm, WCF_IMM | (CQE_SOLICITED if umem[b + 1] & 0x80 else 0))
    A[P_RX_BYTES] += plen
    Q[qi, Q_NAK_PEND] = 0
    Q[qi, Q_EPSN] = (psn + 1) & PSN_MASK
    Q[qi, Q_READ_RUN] = 0
    if ackreq:
        Q[qi, Q_ACK_PEND] = 1


@njit(**_jit)
def read_responses(A, Q, SW, CQT, CE, MRT, TM, umem, tables, ext, qi, budget):
    """Send READ RESPONSE packets of the oldest queued READ jobs (AETH on FIRST, LAST, ONLY), and after
    a job's last one the coalesced ACK held behind it (ack_now, MR-RC-025)."""
    n = 0
    pmtu = Q[qi, Q_PMTU]
    while n < budget and Q[qi, Q_RD_HEAD] != Q[qi, Q_RD_TAIL]:
        j = A[P_RDJ_OFF] + (qi * MAX_RD + (Q[qi, Q_RD_HEAD] % MAX_RD)) * NJ
        npk = A[j + J_NPK]
        if A[j + J_LENGTH] < 0:                      # an ATOMIC ACKNOWLEDGE, in PSN order (dp/ops.py)
            if A[j + J_SENT] == 0:
                if not atomic_ack_job(A, Q, TM, umem, tables, ext, qi, j):
                    return n
                A[j + J_SENT] = 1
                n += 1
        while A[j + J_SENT] < npk and n < budget:
            k = A[j + J_SENT]
            if A[j + J_MR] and not mr_live(MRT, A[j + J_MR]):      # MR-MEM-033, MR-SEC-003: NAK the READ's PSN
                Q[qi, Q_RD_HEAD] = Q[qi, Q_RD_TAIL]
                responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, NAK_REM_ACCESS,
                                A[j + J_PSN], EV_QP_ACCESS_ERR, WHY_REMOTE_ACCESS)
                return n
            if npk == 1:
                op = OP_RSP_ONLY
            elif k == 0:
                op = OP_RSP_FIRST
            elif k == npk - 1:
                op = OP_RSP_LAST
            else:
                op = OP_RSP_MIDDLE
            ext_len = 0
            if op != OP_RSP_MIDDLE:
                put_be(ext, 0, (AETH_ACK_SYN << 24) | (Q[qi, Q_MSN] & PSN_MASK), 4)
                ext_len = 4
            off = k * pmtu
            plen = min(pmtu, A[j + J_LENGTH] - off)
            if plen < 0:
                plen = 0
            if not emit(A, Q, TM, umem, tables, qi, op, 0, 0, (A[j + J_PSN] + k) & PSN_MASK, ext, ext_len,
                        A[j + J_ADDR] + off, plen):
                return n
            A[j + J_SENT] = k + 1
            n += 1
        if A[j + J_SENT] >= npk:
            if A[j + J_ACK]:
                if not send_syndrome_msn(A, Q, TM, umem, tables, ext, qi, AETH_ACK_SYN, A[j + J_ACK] - 1,
                                         A[j + J_AMSN]):
                    return n
                A[j + J_ACK] = 0
            if A[j + J_NAK]:
                k = A[j + J_NAK] - 1
                if not send_syndrome_msn(A, Q, TM, umem, tables, ext, qi, k >> 24, k & PSN_MASK, A[j + J_NMSN]):
                    return n
                A[j + J_NAK] = 0
            Q[qi, Q_RD_HEAD] += 1
    return n


@njit(**_jit)
def completer_rsp(A, Q, SW, CQT, CE, qi, op, psn, b, end, pad, now):
    """A READ RESPONSE: placed when it is the PSN the completer waits for; stale ones are counted
    and dropped; a gap (a lost response) sends the READ again for the rest (go back N)."""
    comp = Q[qi, Q_COMP_PSN]
    if psn_diff(psn, comp) < 0 or psn_diff(psn, Q[qi, Q_SND_MAX]) >= 0:
        A[P_RX_RSP_STALE] += 1
        return
    r = rsp_wqe(Q, SW, qi, psn)
    if r < 0 or SW[r, W_OPCODE] != WR_READ:
        rsp_gap(A, Q, SW, qi)                        # a lost response: the READ goes again for the rest
        return
    k = psn_diff(psn, SW[r, W_FIRST_PSN])
    if psn != comp:
        # only the first response of a READ may implicitly acknowledge what is before it
        if k != 0:
            if Q[qi, Q_RR_RETRY] != comp + 1:
                Q[qi, Q_RR_RETRY] = comp + 1
                rewind(A, Q, SW, qi, comp)
            A[P_RX_RSP_STALE] += 1
            return
        advance(A, Q, SW, CQT, CE, qi, psn, now)
        if Q[qi, Q_COMP_PSN] != psn:
            A[P_RX_RSP_STALE] += 1
            return
    npsn = SW[r, W_NPSN]
    # the last PSN of the READ comes as LAST or ONLY, the others as FIRST or MIDDLE; a request for the
    # rest of a READ (after a lost response) is answered from FIRST (or ONLY) at the PSN it asked for
    if k == npsn - 1:
        ok_op = op == OP_RSP_LAST or op == OP_RSP_ONLY
    else:
        ok_op = op == OP_RSP_FIRST or op == OP_RSP_MIDDLE
    if not ok_op or (k == 0 and op != OP_RSP_FIRST and op != OP_RSP_ONLY):
        A[P_RX_DROP_OP] += 1
        return
    pay = b + 12 + (0 if op == OP_RSP_MIDDLE else 4)
    plen = end - pad - pay
    pmtu = Q[qi, Q_PMTU]
    expect = min(pmtu, SW[r, W_LENGTH] - k * pmtu)
    if expect < 0:
        expect = 0
    if plen != expect:
        A[P_RX_DROP_LEN] += 1
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
def rx_frame(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, a, ln, now):
    op, qpn, boff, loff = peek_bth(umem, a, ln)
    if op < 0:
        A[P_RX_DROP_LEN] += 1
        return
    qi = qpn % A[P_MAXQ]
    if Q[qi, Q_QPN] != qpn or qpn == 0:
        A[P_RX_DROP_QP] += 1
        return
    if Q[qi, Q_PLANE] != A[P_QUEUE]:
        A[P_RX_WRONG_Q] += 1                         # another queue's loop owns the QP (several RX queues)
        return
    st = Q[qi, Q_STATE]
    b = a + boff
    l3 = a + loff
    if umem[l3] >> 4 == 6:
        end = l3 + 40 + ((np.int64(umem[l3 + 4]) << 8) | umem[l3 + 5])
    else:
        end = l3 + ((np.int64(umem[l3 + 2]) << 8) | umem[l3 + 3])
    if end > a + ln or end < b + 16 or (umem[b + 1] & 0x0F):
        A[P_RX_DROP_LEN] += 1
        return
    if not frame_icrc_ok(tables, umem, a, ln):
        A[P_RX_DROP_ICRC] += 1                       # MR-ICRC-013: dropped, counted
        return
    pad = (umem[b + 1] >> 4) & 3
    psn = (np.int64(umem[b + 9]) << 16) | (np.int64(umem[b + 10]) << 8) | umem[b + 11]
    end -= 4                                         # the ICRC
    if A[P_NAT_OFF] != 0 and A[A[P_NAT_OFF] + qi] > 0:
        nat_rx(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, qi, op, psn, b, end, pad, l3, now)   # dp/native.py
        return
    if op <= OP_READ_REQ or op == OP_SEND_LAST_INV or op == OP_SEND_ONLY_INV:
        if (st != ST_RTR and st != ST_RTS and st != ST_SQD) or Q[qi, Q_FNAK_SYN]:
            A[P_RX_DROP_STATE] += 1
            return
        e0 = Q[qi, Q_EPSN]
        responder(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, qi, op, psn, b, end, pad)
        comm_est(A, Q, qi, st, e0)
        activate(A, Q, qi)
        if ce_marked(umem, l3):                      # DCQCN notification point (MR-ECN-007, dp/ops.py)
            np_on_ce(A, Q, TM, umem, tables, ext, qi, now)
    elif op <= OP_RSP_ONLY:
        if st != ST_RTS and st != ST_SQD and st != ST_SQE:
            A[P_RX_DROP_STATE] += 1
            return
        completer_rsp(A, Q, SW, CQT, CE, qi, op, psn, b, end, pad, now)
        activate(A, Q, qi)
        if ce_marked(umem, l3):
            np_on_ce(A, Q, TM, umem, tables, ext, qi, now)
    elif op == OP_ACK:
        # only ACKNOWLEDGEs the kernel could not judge come here: a bad AETH (MR-XH-008, MR-NAK-012)
        if st == ST_RTS or st == ST_SQD:
            qp_error(A, Q, SW, CQT, CE, qi, S_BAD_RESP, EV_QP_FATAL, WHY_BAD_RESPONSE)
    elif op == OP_CAS or op == OP_FAA:
        if (st != ST_RTR and st != ST_RTS and st != ST_SQD) or Q[qi, Q_FNAK_SYN]:
            A[P_RX_DROP_STATE] += 1
            return
        e0 = Q[qi, Q_EPSN]
        responder_atomic(A, Q, SW, CQT, CE, MRT, TM, umem, tables, ext, qi, op, psn, b, end, pad)
        comm_est(A, Q, qi, st, e0)
        activate(A, Q, qi)
        if ce_marked(umem, l3):
            np_on_ce(A, Q, TM, umem, tables, ext, qi, now)
    elif op == OP_ATOMIC_ACK:
        if st != ST_RTS and st != ST_SQD and st != ST_SQE:
            A[P_RX_DROP_STATE] += 1
            return
        completer_atomic(A, Q, SW, CQT, CE, umem, ext, qi, psn, b, end, pad, now)
        activate(A, Q, qi)
    else:
        A[P_RX_DROP_OP] += 1                         # native opcodes: not on a compat QP


# ============================================================================ the operations of dp/ops.py
# (imported here: it uses the helpers above, and everything below -- compiled at import through the
# explicit signatures -- uses it)
from .ops import (CQE_SOLICITED, F_FENCE, OP_ATOMIC_ACK, OP_CAS, OP_FAA, OP_SEND_LAST_INV,  # noqa: E402
                  OP_SEND_ONLY_INV, WCF_INV, WR_CAS, WR_FAA, WR_SEND_INV, atomic_ack_job, atomic_request,
                  completer_atomic, cq_notify, inv_ok, invalidate, place, rd_atomic, responder_atomic, retire_answered,
                  rsp_gap, rsp_wqe, sg_valid, sqd_check, src_of)
from .ops import comm_est, protect_reads, protect_reads_recv  # noqa: E402
from .ops import (FRAME_TO_WIRE, WIRE_OVERHEAD, ce_marked, np_on_ce, rp_allowance, rp_cnps,  # noqa: E402
                  rp_on_sent)
from .native import P_NAT_OFF, nat_qp, nat_rx  # noqa: E402  (the native profile, dp/native.py)
from .native import nat_kern_sacks, nat_kern_sleep  # noqa: E402  (NATIVE_SACKs the XDP program consumed: MR-SACK-043)


# ============================================================================ the round
@njit(**_jit)
def fq_topup(A):
    """Give the fill ring the frames owed to it (rx_burst found no room for them) from the free stack."""
    fsize = A[P_FQ_SIZE]
    fprod = ld_acq_u32(A[P_FQ_PROD])
    room = fsize - ((fprod - ld_acq_u32(A[P_FQ_CONS])) & 0xFFFFFFFF)
    k = min(room, A[P_RX_OWED], A[P_FREE_TOP])
    if k <= 0:
        return
    fring = carray(ptr_u64(A[P_FQ_ADDRS]), (fsize,))
    for i in range(k):
        A[P_FREE_TOP] -= 1
        fring[(fprod + i) & (fsize - 1)] = np.uint64(A[A[P_FREE_OFF] + A[P_FREE_TOP]])
    st_rel_u32(A[P_FQ_PROD], (fprod + k) & 0xFFFFFFFF)
    A[P_RX_OWED] -= k


@njit(**_jit)
def rx_burst_sg(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, now, ring, cons, prod, n, fring, fprod, froom):
    """rx_burst's loop on a multi-buffer socket (XDP_USE_SG): a packet in several descriptors
    (XDP_PKT_CONTD on all but the last) is joined in its first buffer's slot -- the later buffers'
    bytes copied right after the first's, into the rest of that slot, which is never on the fill
    ring -- and handled as one frame; a packet longer than its slot is dropped (rx_sg_long); one
    whose last descriptor is not published yet waits in the ring.  Every buffer goes back to the
    fill ring (as its slot's start).  Returns the descriptors consumed."""
    size = A[P_RX_SIZE]
    fsize = A[P_FQ_SIZE]
    avail = (prod - cons) & 0xFFFFFFFF
    mask = A[P_FRAME_MASK]
    slot = ~mask + 1
    ubase = A[P_UMEM_ADDR]
    nf = 0
    i = 0
    while i < n:
        j = ((cons + i) & (size - 1)) * 2
        a = np.int64(ring[j])
        w1 = np.int64(ring[j + 1])
        ln = w1 & 0xFFFFFFFF
        nd = 1
        if (w1 >> 32) & 1:
            k = i + 1
            while k < avail and (np.int64(ring[((cons + k) & (size - 1)) * 2 + 1]) >> 32) & 1:
                k += 1
            if k >= avail:
                break                                # its last descriptor is not there yet
            nd = k - i + 1
            room = slot - (a & ~mask)
            for d in range(1, nd):
                jd = ((cons + i + d) & (size - 1)) * 2
                ld = np.int64(ring[jd + 1]) & 0xFFFFFFFF
                if ln + ld <= room:
                    c_memcpy(ubase + a + ln, ubase + np.int64(ring[jd]), ld)
                ln += ld
            if ln <= room:
                A[P_RX_SG] += 1
            else:
                A[P_RX_SG_LONG] += 1
                ln = -1
        A[P_RX] += 1
        if ln >= 0:
            rx_frame(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, a, ln, now)
        for d in range(nd):
            ad = np.int64(ring[((cons + i + d) & (size - 1)) * 2])
            if nf < froom:
                fring[(fprod + nf) & (fsize - 1)] = np.uint64(ad & mask)
                nf += 1
            else:
                frame_free(A, ad)                    # owed to the fill ring (fq_topup), as in rx_burst
                A[P_RX_OWED] += 1
        i += nd
    st_rel_u32(A[P_RX_CONS], (cons + i) & 0xFFFFFFFF)
    st_rel_u32(A[P_FQ_PROD], (fprod + nf) & 0xFFFFFFFF)
    return i


@njit(**_jit)
def rx_burst(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, now, budget):
    size = A[P_RX_SIZE]
    if size == 0:
        return 0
    prod = ld_acq_u32(A[P_RX_PROD])
    cons = ld_acq_u32(A[P_RX_CONS])
    n = min((prod - cons) & 0xFFFFFFFF, budget)
    if A[P_RX_OWED] > 0:
        fq_topup(A)
    if n == 0:
        fqf = A[P_FQ_FLAGS]
        if fqf and (ld_acq_u32(fqf) & RING_NEED_WAKEUP):
            c_recvfrom_kick(A[P_FD])
        return 0
    ring = carray(ptr_u64(A[P_RX_DESC]), (size * 2,))
    fsize = A[P_FQ_SIZE]
    fring = carray(ptr_u64(A[P_FQ_ADDRS]), (fsize,))
    fprod = ld_acq_u32(A[P_FQ_PROD])
    froom = fsize - ((fprod - ld_acq_u32(A[P_FQ_CONS])) & 0xFFFFFFFF)
    nf = 0
    if A[P_SG] != 0:
        n = rx_burst_sg(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, now, ring, cons, prod, n, fring, fprod,
                        froom)
        return n
    for i in range(n):
        j = ((cons + i) & (size - 1)) * 2
        a = np.int64(ring[j])
        ln = np.int64(ring[j + 1] & 0xFFFFFFFF)
        A[P_RX] += 1
        rx_frame(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, a, ln, now)
        # the frame goes straight back to the fill ring (we took it from there)
        if nf < froom:
            fring[(fprod + nf) & (fsize - 1)] = np.uint64(a & A[P_FRAME_MASK])
            nf += 1
        else:
            # no room yet: the kernel publishes the fill ring's consumer index lazily.  The frame
            # goes to the free stack and one is owed to the fill ring (fq_topup), or the frames the
            # kernel can receive into would dwindle -- and the peer's packets be dropped
            frame_free(A, a)
            A[P_RX_OWED] += 1
    st_rel_u32(A[P_RX_CONS], (cons + n) & 0xFFFFFFFF)
    st_rel_u32(A[P_FQ_PROD], (fprod + nf) & 0xFFFFFFFF)
    return n


@njit(**_jit)
def views(A, TM):
    maxq = A[P_MAXQ]
    Q = A[A[P_Q_OFF]:A[P_Q_OFF] + maxq * NQ].reshape((maxq, NQ))
    SW = A[A[P_SQ_OFF]:A[P_RQ_OFF]].reshape(((A[P_RQ_OFF] - A[P_SQ_OFF]) // NW, NW))
    RW = A[A[P_RQ_OFF]:A[P_CE_OFF]].reshape(((A[P_CE_OFF] - A[P_RQ_OFF]) // NR, NR))
    CE = A[A[P_CE_OFF]:A[P_CQ_OFF]].reshape(((A[P_CQ_OFF] - A[P_CE_OFF]) // NE, NE))
    CQT = A[A[P_CQ_OFF]:A[P_MR_OFF]].reshape(((A[P_MR_OFF] - A[P_CQ_OFF]) // NC, NC))
    MRT = A[A[P_MR_OFF]:A[P_RDJ_OFF]].reshape(((A[P_RDJ_OFF] - A[P_MR_OFF]) // NM, NM))
    return Q, SW, RW, CE, CQT, MRT


@njit(**_jit)
def round_(A, Q, SW, RW, CE, CQT, MRT, TM, umem, tables, ext, now):
    """One round; returns the number of packets handled and sent."""
    budget = A[P_BUDGET]
    A[P_RDPROT_LEFT] = budget                            # READ responses protect_reads may send this round
    work = nat_kern_sacks(A, Q, SW, CQT, CE, now)        # before the socket's: a full ring's overflow went there
    work += rx_burst(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, now, budget)
    # posts: the ready ring
    rdy = A[P_RDY_OFF]
    tail = ld_acq_i64(A, P_RDY_TAIL)
    while A[P_RDY_HEAD] != tail:
        qi = A[rdy + (A[P_RDY_HEAD] & 4095)]
        st_rel_i64(A, P_RDY_HEAD, A[P_RDY_HEAD] + 1)
        if 0 <= qi < A[P_MAXQ] and Q[qi, Q_PLANE] == A[P_QUEUE]:
            activate(A, Q, qi)
    # the active QPs only
    act = A[P_ACT_OFF]
    if A[P_INFL_CAP] > 0:
        # the port's QPs share what the peer can take in before its fill ring runs dry (a peer like us
        # holds its RX ring's size in frames): without PFC, more in flight is dropped there and costs
        # go-back-N and local ACK timeouts (bidirectional and many-QP streams did)
        left = A[P_INFL_CAP]
        nsend = 0
        for j in range(A[P_N_ACT]):
            qj = A[act + j]
            if Q[qj, Q_STATE] == ST_RTS:
                out = psn_diff(Q[qj, Q_SND_PSN], Q[qj, Q_COMP_PSN])
                if out > 0:
                    left -= out * infl_weight(A, Q, qj)
                if out > 0 or Q[qj, Q_SQ_NEXT] != Q[qj, Q_SQ_TAIL]:
                    nsend += 1
        A[P_INFL_LEFT] = left
        A[P_QP_SHARE] = max(16, A[P_INFL_CAP] // max(1, nsend))
    else:
        A[P_INFL_LEFT] = 1 << 40
        A[P_QP_SHARE] = 0
    to_left = TO_PER_ROUND
    to_cut = timeout_cut(A, Q, now)
    i = A[P_N_ACT] - 1
    while i >= 0:
        qi = A[act + i]
        st = Q[qi, Q_STATE]
        busy = False
        if st == ST_ERR:
            flush_queues(A, Q, SW, RW, CQT, CE, qi)
        elif st >= ST_RTR and A[P_NAT_OFF] != 0 and A[A[P_NAT_OFF] + qi] > 0:
            k = nat_qp(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, qi, now, budget)    # dp/native.py
            work += k & 0xFFFFFFFF
            busy = (k >> 32) != 0
        elif st >= ST_RTR:
            # responder: coalesced ACK for this batch (MR-ACK-004), READ responses.  The ACK leaves now,
            # or, when READ responses of PSNs before it are still queued, right after them (ack_now,
            # MR-RC-025).  (The flag stays set while no TX frame is free: a lost coalesced ACK would
            # cost the requester a local ACK timeout, 67 ms at timeout 14, with nothing lost on the wire)
            if Q[qi, Q_ACK_PEND]:
                ack_now(A, Q, TM, umem, tables, ext, qi)
            if Q[qi, Q_RD_HEAD] != Q[qi, Q_RD_TAIL]:
                # READ RESPONSEs are paced by the QP's DCQCN rate too (MR-CNP-009)
                bud = rp_allowance(A, qi, now, budget, Q[qi, Q_PMTU] + WIRE_OVERHEAD)
                if bud > 0:
                    tb0 = A[P_TX_BYTES]
                    k = read_responses(A, Q, SW, CQT, CE, MRT, TM, umem, tables, ext, qi, bud)
                    rp_on_sent(A, qi, A[P_TX_BYTES] - tb0 + k * FRAME_TO_WIRE)
                    work += k
                busy = busy or Q[qi, Q_RD_HEAD] != Q[qi, Q_RD_TAIL]
            if Q[qi, Q_FNAK_SYN] and Q[qi, Q_RD_HEAD] == Q[qi, Q_RD_TAIL]:
                syn = Q[qi, Q_FNAK_SYN]
                Q[qi, Q_FNAK_SYN] = 0
                responder_error(A, Q, SW, TM, umem, tables, ext, CQT, CE, qi, syn, Q[qi, Q_FNAK_PSN],
                                Q[qi, Q_FNAK_EV], Q[qi, Q_FNAK_WHY])
            if st == ST_RTS or st == ST_SQD or st == ST_SQE:
                if kernel_acks(A, Q, SW, CQT, CE, qi, now):
                    work += 1
                if Q[qi, Q_NERR_PSN]:
                    nak_error_due(A, Q, SW, CQT, CE, qi)
                if Q[qi, Q_STATE] == ST_RTS or Q[qi, Q_STATE] == ST_SQD:
                    to_left -= timers(A, Q, SW, CQT, CE, qi, now, to_left, to_cut)
                if (Q[qi, Q_STATE] == ST_RTS or Q[qi, Q_STATE] == ST_SQD) and Q[qi, Q_RNR_UNTIL] == 0:
                    rp_cnps(A, Q, qi, now)                   # DCQCN reaction point (dp/ops.py)
                    bud = rp_allowance(A, qi, now, budget, Q[qi, Q_PMTU] + WIRE_OVERHEAD)
                    if bud > 0:
                        tb0 = A[P_TX_BYTES]
                        k = requester(A, Q, SW, TM, umem, tables, ext, qi, now, bud)
                        rp_on_sent(A, qi, A[P_TX_BYTES] - tb0 + k * FRAME_TO_WIRE)
                        work += k
                    if Q[qi, Q_LOCERR]:
                        why = Q[qi, Q_LOCERR]
                        Q[qi, Q_LOCERR] = 0
                        qp_error(A, Q, SW, CQT, CE, qi, S_LOC_PROT, EV_QP_FATAL, why)
                if Q[qi, Q_SQD_DRAIN]:
                    sqd_check(A, Q, SW, qi)
                if Q[qi, Q_STATE] == ST_ERR:
                    flush_queues(A, Q, SW, RW, CQT, CE, qi)
                busy = busy or Q[qi, Q_SQ_HEAD] != ld_acq_i64(Q[qi], Q_SQ_TAIL) or Q[qi, Q_RNR_UNTIL] != 0
        if Q[qi, Q_STATE] == ST_ERR:
            idle = Q[qi, Q_SQ_HEAD] == ld_acq_i64(Q[qi], Q_SQ_TAIL) and Q[qi, Q_RQ_HEAD] == ld_acq_i64(Q[qi], Q_RQ_TAIL)
        else:
            idle = not busy and Q[qi, Q_ACK_PEND] == 0
        if idle:
            # idle: off the active list (a post or a packet puts it back)
            n = A[P_N_ACT] - 1
            A[act + i] = A[act + n]
            A[P_N_ACT] = n
            Q[qi, Q_ACTIVE] = 0
        i -= 1
    tx_flush(A)
    A[P_ROUNDS] += 1
    return work
