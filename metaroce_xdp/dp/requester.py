"""The requester: send queue WQEs into packets.

`requester` segments a QP's WQEs into UMEM frames -- PSNs, AckReq every ACKREQ_EVERY packets and on a
message's last (MR-ACK-013), the window, the port's in-flight budget, fences and the READ/atomic limit
(max_rd_atomic) -- gathering SGE lists; `atomic_request` builds the AtomicETH (VA, R_Key, swap or add
data, compare data; MR-XH-011).  `rewind` moves the send point back to a PSN for go-back-N (after a NAK,
a timeout, or a READ response gap).  SQD (MR-QP-013): no new WQE starts; once nothing started is
outstanding, `sqd_check` raises EV_SQ_DRAINED when en_sqd_async_notify asked for it.
"""
from __future__ import annotations

import numpy as np
from numba import njit
from .. import jitcache  # noqa: F401  (cache keyed on every module compiled code depends on)

from .layout import *  # noqa: F401,F403  (column numbers are compile-time constants)
from ..wire.fastpath import BTH_SE, segment_opcode
from ..wire.hdr import put_atomiceth, put_ieth, put_immdt, put_reth
from ..wire.psn import psn_diff
from .layout import ACKREQ_EVERY, MR_BAD, MR_LEN, PSN_MASK
from .reasons import WHY_LOC_LEN, WHY_LOCAL_MR_DEREGISTERED, WHY_RD_ATOMIC_0, WHY_SGE_LOCAL_CHECK
from .prims import ld_acq_i64, st_rel_u32
from .core import (F_FENCE, F_SOLICITED, KS_SND_NXT, OP_CAS, OP_FAA, OP_READ_REQ, OP_SEND_LAST_INV, OP_SEND_ONLY_INV,
                   ST_SQD, S_LOC_LEN, S_LOC_PROT, S_LOC_QP_OP, WR_CAS, WR_FAA, WR_READ, WR_SEND_IMM, WR_SEND_INV,
                   WR_WRITE, WR_WRITE_IMM, ack_deadline, emit, ks_addr, mr_live_a, push_event, qp_error, rd_atomic,
                   sg_valid, sq_row, src_of)

_jit = dict(cache=True, nogil=True)


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
def loc_why(lmr):
    """The why code of a WQE that fails its local checks before its first packet (MR-RC-022): its SGE
    failed the lkey, PD, bounds or access check, its SGEs add up to more than 2^31 bytes (MR-RC-008), or a
    local MR was deregistered under it (MR-MEM-035)."""
    if lmr == MR_BAD:
        return WHY_SGE_LOCAL_CHECK
    if lmr == MR_LEN:
        return WHY_LOC_LEN
    return WHY_LOCAL_MR_DEREGISTERED


@njit(**_jit)
def loc_status(why):
    """The completion status of a local error found before the first packet (Table 7-6): IBV_WC_LOC_LEN_ERR
    for a message over 2^31 bytes (MR-RC-008), IBV_WC_LOC_QP_OP_ERR for a READ or ATOMIC with max_rd_atomic
    0 (MR-RC-009), IBV_WC_LOC_PROT_ERR otherwise (MR-MEM-020, MR-MEM-035)."""
    if why == WHY_LOC_LEN:
        return S_LOC_LEN
    if why == WHY_RD_ATOMIC_0:
        return S_LOC_QP_OP
    return S_LOC_PROT


@njit(**_jit)
def fail_local(A, Q, SW, CQT, CE, qi):
    """The local error the requester found before a WQE's first packet (Q_LOCERR, a reason code) fails the
    QP with its completion status (loc_status)."""
    if Q[qi, Q_LOCERR]:
        why = Q[qi, Q_LOCERR]
        Q[qi, Q_LOCERR] = 0
        qp_error(A, Q, SW, CQT, CE, qi, loc_status(why), EV_QP_FATAL, why)


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
            # its local MR was deregistered (MR-MEM-035), its SGE failed the local checks (MR-RC-022) or
            # the message is over 2^31 bytes (MR-RC-008): nothing of it is read or written; it fails once it
            # is the oldest
            if nxt == Q[qi, Q_SQ_HEAD]:
                SW[r, W_STARTED] = 1
                Q[qi, Q_LOCERR] = loc_why(lmr)          # round_ fails it (qp_error, loc_status), the why code
            break
        if SW[r, W_STARTED] == 0:
            if rd_atomic(op) and Q[qi, Q_MAX_RD] == 0:
                # MR-RC-009, Table 7-6: with max_rd_atomic 0 a READ or ATOMIC can never be outstanding: it
                # completes IBV_WC_LOC_QP_OP_ERR, nothing of it sent, once it is the oldest
                if nxt == Q[qi, Q_SQ_HEAD]:
                    SW[r, W_STARTED] = 1
                    Q[qi, Q_LOCERR] = WHY_RD_ATOMIC_0
                break
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
            ext_len = put_reth(ext, 0, SW[r, W_RADDR] + k * pmtu, SW[r, W_RKEY], length - k * pmtu)
            if kaddr:
                np_ = (first + npsn) & PSN_MASK
                if psn_diff(np_, Q[qi, Q_SND_MAX]) > 0:
                    st_rel_u32(kaddr + KS_SND_NXT, np_)
            if not emit(A, Q, TM, umem, tables, qi, OP_READ_REQ, 0, 1, psn, ext, ext_len, 0, 0):
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
                    ext_len = put_reth(ext, 0, SW[r, W_RADDR], SW[r, W_RKEY], length)
                if last and has_imm:
                    ext_len = put_immdt(ext, ext_len, SW[r, W_IMM])
                elif last and op == WR_SEND_INV:
                    ext_len = put_ieth(ext, ext_len, SW[r, W_IMM])     # the key to invalidate
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
                if not emit(A, Q, TM, umem, tables, qi, opc, BTH_SE if (last and se) else 0, ackreq, psn, ext, ext_len,
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
def atomic_request(A, Q, SW, TM, umem, tables, ext, qi, r, kaddr):
    """The AtomicETH request of WQE r (one PSN, AckReq); False when no TX frame was free."""
    op = SW[r, W_OPCODE]
    psn = SW[r, W_FIRST_PSN]
    if op == WR_CAS:
        ext_len = put_atomiceth(ext, 0, SW[r, W_RADDR], SW[r, W_RKEY], SW[r, W_SWAP], SW[r, W_IMM])
    else:
        ext_len = put_atomiceth(ext, 0, SW[r, W_RADDR], SW[r, W_RKEY], SW[r, W_IMM], 0)
    if kaddr:
        np_ = (psn + 1) & PSN_MASK
        if psn_diff(np_, Q[qi, Q_SND_MAX]) > 0:
            st_rel_u32(kaddr + KS_SND_NXT, np_)      # before the frame can leave
    if not emit(A, Q, TM, umem, tables, qi, OP_CAS if op == WR_CAS else OP_FAA, 0, 1, psn, ext, ext_len, 0, 0):
        return False
    SW[r, W_SENT] = 1
    return True


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
