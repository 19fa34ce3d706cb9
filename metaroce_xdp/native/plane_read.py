"""The native profile in the compiled data plane, part 2 of 4: READ and atomics, both ends (MR-OOO-016..028).

Requester (MR-NAT-021/022, MR-OOO-018..021, MR-OOO-025..028, MR-LOSS-013): a READ work request is issued
as READ request messages of at most rd_chunk PSNs, each with its own MSN and a row in the requester table
(RQ); its responses are placed at their offset in any order, a missing one is re-requested once a later
response shows it overdue by reo_wnd, or at the RTO.  An atomic is one PSN without NETH; it stays in the
table until its ATOMIC_ACKNOWLEDGE came and is replayed when its PSN was delivered but no result followed.
Responder (MR-OOO-003, MR-OOO-016, MR-OOO-022..024): a READ or atomic is recorded on arrival, held in a
resource (RS) until the cumulative PSN reaches it, then executed in PSN order; its responses leave from
the job ring (JB), paced (MR-CC-021, native/rdpace.py); copies of executed ones are answered from the
resource, never executed again.
"""
from __future__ import annotations

import numpy as np
from numba import carray, njit
from .. import jitcache  # noqa: F401  (cache keyed on every module compiled code depends on)

from ..dp.layout import *  # noqa: F401,F403  (column numbers are compile-time constants)
from . import layout as NL
from ..dp.cc import FRAME_TO_WIRE, ce_marked
from ..dp.completer import advance, retire_answered
from ..dp.core import (ACC_REMOTE_ATOMIC, ACC_REMOTE_READ, AETH_ACK_SYN, NAK_INV_REQ, NAK_REM_ACCESS, OP_ATOMIC_ACK,
                       OP_CAS, ST_ERR, S_LOC_PROT, S_RETRY_EXC, WR_READ, emit, mr_check, mr_live, mr_live_a, place,
                       qp_error, sg_valid, sq_row)
from ..dp.layout import EV_QP_ACCESS_ERR, EV_QP_FATAL, EV_QP_REQ_ERR, PSN_MASK
from ..dp.prims import ptr_u64
from ..dp.reasons import WHY_LOCAL_MR_DEREGISTERED, WHY_OPCODE_SEQUENCE, WHY_REMOTE_ACCESS, WHY_RETRY_EXHAUSTED
from ..dp.requester import atomic_request
from ..wire.hdr import (OPT, OT_AETH, OT_ATOMICACKETH, OT_ATOMICETH, OT_NETH, OT_PAY, OT_RETH, aeth_syndrome,
                        atomicacketh_orig, atomiceth_compare, atomiceth_rkey, atomiceth_swap_add, atomiceth_va,
                        bth_ackreq, ext_at, neth_flags, neth_msg_len, neth_msn, neth_offset, neth_tsval, put_aeth,
                        put_atomicacketh, put_neth, put_reth, reth_dlen, reth_rkey, reth_va, udp_of, udp_sport)
from .multipath import mp_pick, mp_pick_retx
from .rdpace import rpace_may_send, rpace_on_sent
from .receiver import RX_SACK_NOW, rx_on_packet, rx_on_range, rx_recorded
from .sender import TK_NEW, rd_on_loss, rd_on_response, reo_wnd, tsval_of, tx_on_sack, tx_on_transmit
from .plane_slot import (JB_AMSN, JB_I, JB_IEND, JB_KIND, JB_LEN, JB_MR, JB_MSN, JB_ORIG, JB_PSN0, JB_RETX, JB_STRIDE,
                         JB_VA, K_ATOMIC, K_READ, NETH_FIRST, NETH_LAST, NETH_RETX, NJB, NRQ, NRS, NSBX, OP_N_READ_REQ,
                         OP_N_READ_RESP, O_JB, O_LM, O_RQ, O_RS, O_SBX, O_WD, PW_NPEND, PW_RATE, P_NAT_EXT, RQ_ACKED_TS,
                         RQ_BLEN, RQ_BM, RQ_GAP_TS, RQ_GOT, RQ_HI, RQ_K0, RQ_KIND, RQ_LO, RQ_MSN, RQ_N, RQ_PSN,
                         RQ_REQ_TS, RQ_RR_TS, RQ_SEQ, RQ_STRIDE, RQ_WI, RS_AMSN, RS_CMP, RS_DONE, RS_HELD, RS_KIND,
                         RS_LEN, RS_MSN, RS_N, RS_OP, RS_ORD, RS_ORIG, RS_PSN, RS_RKEY, RS_STATE, RS_STRIDE, RS_SWAP,
                         RS_VA, X_CUR_MSN, X_C_AT_ACK_BAD, X_C_AT_ACK_RX, X_C_AT_EXEC, X_C_AT_REPLAY, X_C_BAD_LEN,
                         X_C_DUP, X_C_ERR_HELD, X_C_OOO, X_C_OOW, X_C_PLACED, X_C_RD_BAD, X_C_RD_DUP_DROP, X_C_RD_EXEC,
                         X_C_RD_REQ, X_C_RD_RESP_DUP, X_C_RD_RESP_RX, X_C_RD_RESP_TX, X_C_RD_RTO, X_C_REREQ,
                         X_C_REREQ_QUEUED, X_C_REREQ_RX, X_C_TX, X_ERR_PSN, X_ERR_SYN, X_JB_HEAD, X_JB_TAIL, X_MSN_NEXT,
                         X_RD_GAP, X_RD_LAST, X_RD_OUT, X_RD_PROG, X_RD_RTO, X_RQ_SEQ, X_RS_HELD, X_RS_NEXT, _jit,
                         count_tx, nat_advanced, nat_error_due, nat_ext, nat_fail, nat_rd_pend,
                         nat_reject, nat_send_sack, pw_base, rd_row, rows, rp_row, set_entropy)

_jit = dict(cache=True, nogil=True)


# Requester (MR-NAT-021/022, MR-OOO-018..021, MR-OOO-025..028, MR-LOSS-013): a READ work request is
# issued as READ request messages of at most rd_chunk PSNs, each with its own MSN and a row in the
# requester table (RQ); its responses are placed at their offset in any order, a missing one is
# re-requested once a later response shows it overdue by reo_wnd, or at the RTO.  An atomic is one
# PSN without NETH; it stays in the table until its ATOMIC_ACKNOWLEDGE came and is replayed when its
# PSN was delivered but no result followed.  Responder (MR-OOO-003, MR-OOO-016, MR-OOO-022..024): a
# READ or atomic is recorded on arrival, held in a resource (RS) until the cumulative PSN reaches it,
# then executed in PSN order; its responses leave from the job ring (JB); copies of executed ones are
# answered from the resource, never executed again.
@njit(**_jit)
def rd_chunk(par):
    """PSNs per READ request message (MR-NAT-022: at most W; half of it, so that the next message of a
    long READ fits the window while one is answered, MR-CC-002)."""
    c = par[NL.P_W] // 2
    return c if c > 0 else 1


@njit(**_jit)
def rq_base(b, t):
    return b + O_RQ + t * RQ_STRIDE


@njit(**_jit)
def rq_bit(A, e, i):
    return (A[e + RQ_BM + (i >> 6)] >> (i & 63)) & 1


@njit(**_jit)
def rq_find(A, b, kind, key):
    """The requester row of the READ request with MSN `key` (K_READ) or of the atomic at PSN `key`, -1."""
    for t in range(NRQ):
        e = rq_base(b, t)
        if A[e + RQ_KIND] == kind and A[e + (RQ_MSN if kind == K_READ else RQ_PSN)] == key:
            return e
    return -1


@njit(**_jit)
def nat_tx_rd(A, Q, SW, TM, umem, tables, qi, b, psn, kind, now):
    """(Re)transmit the READ request message or the atomic that PSN `psn` belongs to: NATIVE_READ_REQ
    with the sub-range's RETH and NETH FIRST|LAST, offset 0, msg_len = DMA Length (MR-NAT-021), or
    COMPARE_SWAP / FETCH_ADD with no NETH (MR-NAT-006); AckReq set (MR-NAT-023), RETX on a
    retransmission (MR-NAT-015).  Every unsacked PSN of a READ's range is recorded as (re)sent: the
    PSNs of a READ request share one fate (04 section 4.3.4).  False: no frame."""
    par, rx, s, nx, sb, pt = rows(A, b)
    j = b + O_SBX + (psn & NL.WMASK) * NSBX
    k0 = A[j + 3]
    r = sq_row(Q, qi, A[j])
    op = SW[r, W_OPCODE]
    pmtu = Q[qi, Q_PMTU]
    p0 = (SW[r, W_FIRST_PSN] + k0) & PSN_MASK
    if kind == TK_NEW:
        e = mp_pick(pt, par, s[NL.S_SRTT], now)
    else:
        e = mp_pick_retx(pt, par, s[NL.S_SRTT], now, sb[psn & NL.WMASK, NL.B_ENTROPY])
    e &= NL.PICK_PROBE - 1                          # AckReq is set anyway
    set_entropy(Q, TM, qi, nx, pt[e, NL.E_SPORT])
    ext = nat_ext(A)
    n = 1
    if op == WR_READ:
        # the message's PSNs: those whose records name this WQE and sub-range (nat_rd_issue wrote them; the
        # credits may have made the sub-range shorter than rd_chunk), so a retransmission repeats its range
        lim = min(rd_chunk(par), SW[r, W_NPSN] - k0)
        j0 = b + O_SBX + (p0 & NL.WMASK) * NSBX
        while n < lim:
            jn = b + O_SBX + ((p0 + n) & NL.WMASK) * NSBX
            if A[jn] != A[j0] or A[jn + 1] != k0 + n or A[jn + 3] != k0:
                break
            n += 1
        blen = min(n * pmtu, SW[r, W_LENGTH] - k0 * pmtu)
        if blen < 0:
            blen = 0
        h = put_reth(ext, 0, SW[r, W_RADDR] + k0 * pmtu, SW[r, W_RKEY], blen)
        fl = NETH_FIRST | NETH_LAST | (0 if kind == TK_NEW else NETH_RETX)
        ext_len = put_neth(ext, h, fl, A[j + 2] & PSN_MASK, 0, blen, tsval_of(now))
        if not emit(A, Q, TM, umem, tables, qi, OP_N_READ_REQ, 0, 1, p0, ext, ext_len, 0, 0):
            return False
    elif not atomic_request(A, Q, SW, TM, umem, tables, ext, qi, r, 0):
        return False
    # one scoreboard record for the request (04 section 4.3.4), one packet in flight (05 section 5.2);
    # the rest of the range only moves snd_nxt: its responses are the READ window's (MR-CC-019/020)
    if kind == TK_NEW:
        tx_on_transmit(s, sb, par, p0, e, TK_NEW, now)
        for i in range(1, n):
            sb[(p0 + i) & NL.WMASK, NL.B_FLAGS] = 0
        s[NL.S_SND_NXT] = (p0 + n) & PSN_MASK
    else:
        f = sb[p0 & NL.WMASK, NL.B_FLAGS]
        if (f & NL.BF_OUT) != 0 and sb[p0 & NL.WMASK, NL.B_PSN] == p0 and (f & NL.BF_SACKED) == 0:
            tx_on_transmit(s, sb, par, p0, e, kind, now)
    count_tx(A, nx, kind)
    return True


@njit(**_jit)
def nat_rd_issue(A, Q, SW, TM, umem, tables, qi, b, wi, r, now):
    """Issue the next READ request message of READ WQE r (MR-NAT-022: sub-ranges of rd_chunk PSNs, fewer
    where the credits end, each its own MSN) or its atomic, once it is within max_rd_atomic of the
    oldest READ request or atomic still owed its response (MR-OOO-028: answers that came out of order
    free no place, since the responder keeps only the last max_dest_rd_atomic results) and every PSN
    of the range lies inside the window and the credits (MR-CC-002).  1 when sent, else 0."""
    par, rx, s, nx, sb, pt = rows(A, b)
    op = SW[r, W_OPCODE]
    k0 = SW[r, W_SENT]
    n = min(rd_chunk(par), SW[r, W_NPSN] - k0) if op == WR_READ else 1
    t = -1
    oldest = nx[X_RQ_SEQ]                            # issue number of the oldest row (RQ_SEQ)
    for i in range(NRQ):
        e = rq_base(b, i)
        if A[e + RQ_KIND] != 0:
            if A[e + RQ_SEQ] < oldest:
                oldest = A[e + RQ_SEQ]
        elif t < 0:
            t = i
    if t < 0 or nx[X_RQ_SEQ] - oldest >= Q[qi, Q_MAX_RD]:
        return 0
    nxt = s[NL.S_SND_NXT]
    if par[NL.P_CREDITS] and op == WR_READ:
        # MR-CC-002: every PSN of the range within right_edge.  A range longer than the credits allow goes as a
        # shorter sub-range (MR-NAT-022 permits any): waiting for credits to cover all of it could wait forever,
        # since no SACK comes back before a request leaves (init_credit 16 < W / 2, MR-CC-017)
        room = ((s[NL.S_RIGHT_EDGE] - nxt) & PSN_MASK) + 1
        if room < n:
            n = room
    last = (nxt + n - 1) & PSN_MASK
    if ((last - s[NL.S_SND_UNA]) & PSN_MASK) >= par[NL.P_W]:
        return 0
    if par[NL.P_CREDITS] and 0 < ((last - s[NL.S_RIGHT_EDGE]) & PSN_MASK) < NL.PSN_HALF:
        return 0
    if op == WR_READ and nx[X_RD_OUT] > 0 and nx[X_RD_OUT] + n > max(rd_row(A, b)[NL.S_CWND] // NL.FP, 1):
        return 0                                     # MR-CC-020: the READ window
    msn = nx[X_CUR_MSN] if k0 == 0 else nx[X_MSN_NEXT]
    for i in range(n):
        j = b + O_SBX + ((nxt + i) & NL.WMASK) * NSBX
        A[j] = wi
        A[j + 1] = k0 + i
        A[j + 2] = msn
        A[j + 3] = k0
    if not nat_tx_rd(A, Q, SW, TM, umem, tables, qi, b, nxt, TK_NEW, now):
        return 0
    if k0 != 0:
        nx[X_MSN_NEXT] = (nx[X_MSN_NEXT] + 1) & PSN_MASK
    else:
        SW[r, W_STATUS] = 0                          # response PSNs received so far (nat_rd_answered)
    e = rq_base(b, t)
    A[e:e + RQ_STRIDE] = 0
    A[e + RQ_KIND] = K_READ if op == WR_READ else K_ATOMIC
    A[e + RQ_PSN] = nxt
    A[e + RQ_N] = n
    A[e + RQ_MSN] = msn
    A[e + RQ_WI] = wi
    A[e + RQ_K0] = k0
    blen = min(n * Q[qi, Q_PMTU], SW[r, W_LENGTH] - k0 * Q[qi, Q_PMTU])
    A[e + RQ_BLEN] = blen if blen > 0 else 0
    A[e + RQ_GAP_TS] = NL.NONE
    A[e + RQ_RR_TS] = NL.NONE
    A[e + RQ_ACKED_TS] = NL.NONE
    A[e + RQ_REQ_TS] = now if op == WR_READ else NL.NONE     # MR-CC-019: the READ window's RTT sample
    A[e + RQ_SEQ] = nx[X_RQ_SEQ]
    nx[X_RQ_SEQ] += 1
    SW[r, W_SENT] = k0 + n
    nx[X_RD_PROG] = now
    nx[X_RD_LAST] = now
    nx[X_C_RD_REQ] += 1
    if op == WR_READ:
        nx[X_RD_OUT] += n
    return 1


@njit(**_jit)
def nat_implicit_ack(A, Q, SW, CQT, CE, qi, b, cum, now):
    """A READ response or an ATOMIC_ACKNOWLEDGE shows that the responder received every PSN up to `cum`
    (MR-OOO-019, MR-OOO-025): acknowledged as by an ACK-type SACK with flags.N (no RTT sample, no
    path feedback), then the WQEs that completes (MR-SACK-026)."""
    par, rx, s, nx, sb, pt = rows(A, b)
    if not (0 < ((cum + 1 - s[NL.S_SND_UNA]) & PSN_MASK) < NL.PSN_HALF):
        return                                       # nothing new
    if not (0 < ((s[NL.S_SND_NXT] - cum) & PSN_MASK) < NL.PSN_HALF):
        return
    credit = 0xFFFF
    if par[NL.P_CREDITS]:
        credit = (s[NL.S_RIGHT_EDGE] - cum) & PSN_MASK      # the right edge stays where SACKs put it
        if credit < 1 or credit > par[NL.P_W]:
            credit = 1
    tx_on_sack(s, sb, pt, par, cum, 0, A[b + O_WD:b + O_WD + 32], 0, 0x40, 0, credit, -1, now)
    advance(A, Q, SW, CQT, CE, qi, s[NL.S_SND_UNA], now)


@njit(**_jit)
def nat_rd_answered(A, Q, SW, CQT, CE, qi, b, r, n, now):
    """n more response PSNs of READ/atomic WQE r arrived; once all did, the WQE is answered and
    completes in WQE order (MR-SACK-026), with what follows it and is acknowledged."""
    par, rx, s, nx, sb, pt = rows(A, b)
    SW[r, W_STATUS] += n
    if SW[r, W_STATUS] >= SW[r, W_NPSN] and SW[r, W_SENT] >= SW[r, W_NPSN] and SW[r, W_DONE] == 0:
        SW[r, W_DONE] = 1
        Q[qi, Q_RD_OUT] -= 1
        retire_answered(A, Q, SW, CQT, CE, qi)
        if Q[qi, Q_STATE] != ST_ERR:
            advance(A, Q, SW, CQT, CE, qi, s[NL.S_SND_UNA], now)


@njit(**_jit)
def nat_on_read_resp(A, Q, SW, CQT, CE, umem, qi, b, psn, bo, end, pad, ce, now):
    """A NATIVE_READ_RESP (MR-OOO-018): its MSN names an outstanding READ request, its PSN lies in that
    READ's range, offset, length and flags agree (MR-NAT-018 applied to the response), else it is
    dropped and counted; it is placed at its offset of the WQE's buffer whatever the order, a copy of a
    response already placed is ignored.  A response beyond a missing one is MR-OOO-020's evidence
    (for this READ, and for every earlier READ still missing responses).  Each response placed drives
    the READ window (MR-CC-019): ce (its IP ECN field is CE) counts one, and the first one after the
    request or a re-request gives the RTT sample."""
    par, rx, s, nx, sb, pt = rows(A, b)
    pay = bo + OPT[OP_N_READ_RESP, OT_PAY]
    if pay + pad > end:
        nx[X_C_RD_BAD] += 1
        A[P_RX_DROP_LEN] += 1
        return
    h = ext_at(bo, OP_N_READ_RESP, OT_NETH)
    fl = neth_flags(umem, h)
    msn = neth_msn(umem, h)
    off = neth_offset(umem, h)
    mlen = neth_msg_len(umem, h)
    plen = end - pad - pay
    e = rq_find(A, b, K_READ, msn)
    if e < 0:
        nx[X_C_RD_RESP_DUP] += 1                     # a late copy for a READ already answered: stale
        A[P_RX_RSP_STALE] += 1
        return
    p = A[e + RQ_PSN]
    n = A[e + RQ_N]
    pmtu = Q[qi, Q_PMTU]
    i = (psn - p) & PSN_MASK
    blen = A[e + RQ_BLEN]
    want = min(pmtu, blen - off)
    if i >= n or off != i * pmtu or mlen != blen or plen != want or ((fl & NETH_FIRST) != 0) != (i == 0) or \
            ((fl & NETH_LAST) != 0) != (i == n - 1):
        nx[X_C_RD_BAD] += 1
        A[P_RX_DROP_LEN] += 1
        return
    if rq_bit(A, e, i):
        nx[X_C_RD_RESP_DUP] += 1
        return
    r = sq_row(Q, qi, A[e + RQ_WI])
    lmr = SW[r, W_LMR]
    if (lmr and not mr_live_a(A, lmr)) or not sg_valid(A, SW[r, W_SG], SW[r, W_NSGE]):
        qp_error(A, Q, SW, CQT, CE, qi, S_LOC_PROT, EV_QP_FATAL, WHY_LOCAL_MR_DEREGISTERED)     # MR-MEM-035: never placed
        return
    if plen:
        place(A, SW[r, W_LADDR], SW[r, W_SG], SW[r, W_NSGE], A[e + RQ_K0] * pmtu + off, A[P_UMEM_ADDR] + pay, plen)
    A[e + RQ_BM + (i >> 6)] |= np.int64(1) << (i & 63)
    A[e + RQ_GOT] += 1
    A[P_RX_BYTES] += plen
    nx[X_C_RD_RESP_RX] += 1
    g = now - nx[X_RD_LAST]                          # MR-LOSS-013: the interval since the last new response
    if g > 0:                                        # (or request), not since an RTO
        nx[X_RD_GAP] = g if g > nx[X_RD_GAP] else nx[X_RD_GAP] - ((nx[X_RD_GAP] - g) >> 3)
    nx[X_RD_LAST] = now
    nx[X_RD_PROG] = now
    nx[X_RD_RTO] = 0                                 # progress: the READ timer's backoff ends
    nx[X_RD_OUT] -= 1                                # MR-CC-019: a response delivered
    rtt = NL.NONE
    if A[e + RQ_REQ_TS] != NL.NONE:
        rtt = now - A[e + RQ_REQ_TS]
        A[e + RQ_REQ_TS] = NL.NONE
    rd_on_response(rd_row(A, b), par, rtt, ce, now)
    s[NL.S_RETRY_COUNT] = 0                          # progress (MR-LOSS-008)
    lo = A[e + RQ_LO]
    while lo < n and rq_bit(A, e, lo):
        lo += 1
    A[e + RQ_LO] = lo
    if i + 1 > A[e + RQ_HI]:
        A[e + RQ_HI] = i + 1
    if lo < i and A[e + RQ_GAP_TS] == NL.NONE:
        A[e + RQ_GAP_TS] = now                       # MR-OOO-020: a later response arrived
    for t in range(NRQ):
        o = rq_base(b, t)
        if o != e and A[o + RQ_KIND] == K_READ and A[o + RQ_GOT] < A[o + RQ_N] and \
                0 < ((p - A[o + RQ_PSN]) & PSN_MASK) < NL.PSN_HALF:
            A[o + RQ_HI] = A[o + RQ_N]               # ... of a later READ: the earlier one's tail is due
            if A[o + RQ_GAP_TS] == NL.NONE:
                A[o + RQ_GAP_TS] = now
    nat_implicit_ack(A, Q, SW, CQT, CE, qi, b, (p + n - 1) & PSN_MASK, now)
    if Q[qi, Q_STATE] == ST_ERR:
        return
    if A[e + RQ_GOT] >= n:
        A[e + RQ_KIND] = 0
        nat_rd_answered(A, Q, SW, CQT, CE, qi, b, r, n, now)


@njit(**_jit)
def nat_on_atomic_ack(A, Q, SW, CQT, CE, umem, qi, b, psn, bo, end, pad, now):
    """An ATOMIC_ACKNOWLEDGE on a native QP (MR-NAT-006, MR-OOO-025): accepted only for an atomic sent
    and still owed its result (else dropped and counted: a replay's second answer, or forged); the
    original value is placed (host order), its PSN and all before it are acknowledged, and the WQE
    completes in order."""
    par, rx, s, nx, sb, pt = rows(A, b)
    if end - pad - (bo + OPT[OP_ATOMIC_ACK, OT_PAY]) != 0 or pad != 0:
        nx[X_C_AT_ACK_BAD] += 1
        A[P_RX_DROP_LEN] += 1
        return
    if (aeth_syndrome(umem, ext_at(bo, OP_ATOMIC_ACK, OT_AETH)) >> 5) & 3 != 0:     # not an ACK syndrome
        nx[X_C_AT_ACK_BAD] += 1
        return
    e = rq_find(A, b, K_ATOMIC, psn)
    if e < 0:
        nx[X_C_AT_ACK_BAD] += 1
        A[P_RX_RSP_STALE] += 1
        return
    r = sq_row(Q, qi, A[e + RQ_WI])
    lmr = SW[r, W_LMR]
    if (lmr and not mr_live_a(A, lmr)) or not sg_valid(A, SW[r, W_SG], SW[r, W_NSGE]):
        qp_error(A, Q, SW, CQT, CE, qi, S_LOC_PROT, EV_QP_FATAL, WHY_LOCAL_MR_DEREGISTERED)
        return
    orig = atomicacketh_orig(umem, ext_at(bo, OP_ATOMIC_ACK, OT_ATOMICACKETH))
    ext = nat_ext(A)
    for k in range(8):                               # host (little-endian) order, MR-ATOM-008
        ext[k] = (orig >> (8 * k)) & 0xFF
    place(A, SW[r, W_LADDR], SW[r, W_SG], SW[r, W_NSGE], 0, A[P_NAT_EXT], 8)
    A[e + RQ_KIND] = 0
    nx[X_C_AT_ACK_RX] += 1
    nx[X_RD_PROG] = now
    nx[X_RD_RTO] = 0
    s[NL.S_RETRY_COUNT] = 0
    nat_implicit_ack(A, Q, SW, CQT, CE, qi, b, psn, now)
    if Q[qi, Q_STATE] != ST_ERR:
        nat_rd_answered(A, Q, SW, CQT, CE, qi, b, r, 1, now)


@njit(**_jit)
def nat_rereq(A, Q, SW, TM, umem, tables, qi, b, e, upto, now):
    """READ re-requests (MR-OOO-020/021) for each maximal run of missing response PSNs below index
    `upto` of the READ request at row e: a NATIVE_READ_REQ at the run's first PSN q with RETH.VA
    `VA + (q - p) * pmtu`, the rkey, the run's bytes, the READ's MSN, RETX, FIRST and LAST, offset
    `(q - p) * pmtu` and msg_len the READ's.  Packets sent, or -1 when a frame ran out."""
    par, rx, s, nx, sb, pt = rows(A, b)
    r = sq_row(Q, qi, A[e + RQ_WI])
    pmtu = Q[qi, Q_PMTU]
    p = A[e + RQ_PSN]
    blen = A[e + RQ_BLEN]
    va = SW[r, W_RADDR] + A[e + RQ_K0] * pmtu
    ext = nat_ext(A)
    sent = 0
    i = A[e + RQ_LO]
    while i < upto:
        if rq_bit(A, e, i):
            i += 1
            continue
        k = i
        while k < upto and not rq_bit(A, e, k):
            k += 1
        off = i * pmtu
        ln = min((k - i) * pmtu, blen - off)
        if ln < 0:
            ln = 0
        h = put_reth(ext, 0, va + off, SW[r, W_RKEY], ln)
        ext_len = put_neth(ext, h, NETH_FIRST | NETH_LAST | NETH_RETX, A[e + RQ_MSN] & PSN_MASK, off, blen,
                           tsval_of(now))
        ep = mp_pick(pt, par, s[NL.S_SRTT], now) & (NL.PICK_PROBE - 1)
        set_entropy(Q, TM, qi, nx, pt[ep, NL.E_SPORT])
        if not emit(A, Q, TM, umem, tables, qi, OP_N_READ_REQ, 0, 1, (p + i) & PSN_MASK, ext, ext_len, 0, 0):
            return -1
        sent += 1
        nx[X_C_REREQ] += 1
        nx[X_C_TX] += 1
        A[e + RQ_REQ_TS] = now                       # MR-CC-019: the re-request's first response is a sample
        i = k
    return sent


@njit(**_jit)
def nat_replay(A, Q, SW, TM, umem, tables, qi, b, e, now):
    """MR-OOO-027: the atomic at row e sent again, unchanged but for AckReq and the UDP source port."""
    par, rx, s, nx, sb, pt = rows(A, b)
    ep = mp_pick(pt, par, s[NL.S_SRTT], now) & (NL.PICK_PROBE - 1)
    set_entropy(Q, TM, qi, nx, pt[ep, NL.E_SPORT])
    if not atomic_request(A, Q, SW, TM, umem, tables, nat_ext(A), qi, sq_row(Q, qi, A[e + RQ_WI]), 0):
        return False
    nx[X_C_AT_REPLAY] += 1
    nx[X_C_TX] += 1
    return True


@njit(**_jit)
def nat_rd_timers(A, Q, SW, CQT, CE, TM, umem, tables, qi, b, now):
    """The requester's READ and atomic timers: re-requests once a later response showed a gap reo_wnd
    ago (MR-OOO-020; not again before one srtt, so the re-request's responses can come), atomic replays
    reo_wnd after the atomic's PSN was delivered without its result (MR-OOO-027), and the RTO for
    responses owed to requests the responder has (MR-LOSS-013: the retry budget of MR-LOSS-007/009;
    the oldest READ's missing ranges are re-requested, or the oldest atomic replayed).  A response
    received for the first time is progress (nat_on_read_resp: the timer restarts, the retry count is
    reset); the timer runs for at least twice rd_gap, the interval between new responses (the first one:
    since its request), rising at once and falling by 1/8 per response, so that responses paced far
    apart (MR-CC-021) are not taken for lost, and for twice its last run after each READ RTO until a
    new response (rd_rto: the SACK answering a re-request gives an RTT sample that recomputes the RTO,
    which would otherwise undo MR-LOSS-007's doubling and spend the retry budget in ~8 RTOs).
    Packets sent."""
    par, rx, s, nx, sb, pt = rows(A, b)
    rw = reo_wnd(s, par)
    guard = s[NL.S_SRTT] if s[NL.S_SRTT] != NL.NONE else s[NL.S_RTO]
    if guard < rw:
        guard = rw
    una = s[NL.S_SND_UNA]
    sent = 0
    oldest = -1
    for t in range(NRQ):
        e = rq_base(b, t)
        kind = A[e + RQ_KIND]
        if kind == 0:
            continue
        p = A[e + RQ_PSN]
        acked = 0 < ((una - ((p + A[e + RQ_N] - 1) & PSN_MASK)) & PSN_MASK) < NL.PSN_HALF
        rr = A[e + RQ_RR_TS]
        if kind == K_READ:
            g = A[e + RQ_GAP_TS]
            if g != NL.NONE and now >= g + rw and (rr == NL.NONE or now >= rr + guard):
                k = nat_rereq(A, Q, SW, TM, umem, tables, qi, b, e, A[e + RQ_HI], now)
                if k < 0:
                    return sent
                sent += k
                rd_on_loss(rd_row(A, b), par, s[NL.S_SRTT], now)
                A[e + RQ_RR_TS] = now
                A[e + RQ_GAP_TS] = NL.NONE
        elif acked:
            if A[e + RQ_ACKED_TS] == NL.NONE:
                A[e + RQ_ACKED_TS] = now
            elif now >= A[e + RQ_ACKED_TS] + rw and (rr == NL.NONE or now >= rr + guard):
                if not nat_replay(A, Q, SW, TM, umem, tables, qi, b, e, now):
                    return sent
                sent += 1
                A[e + RQ_RR_TS] = now
        if acked or A[e + RQ_GOT] > 0:               # the responder has the request: responses owed
            if oldest < 0 or 0 < ((A[oldest + RQ_PSN] - p) & PSN_MASK) < NL.PSN_HALF:
                oldest = e
    if oldest < 0:
        return sent
    prog = nx[X_RD_PROG]
    if s[NL.S_LAST_SACK_TS] > prog:
        prog = s[NL.S_LAST_SACK_TS]
    wait = max(s[NL.S_RTO], nx[X_RD_RTO])            # MR-LOSS-007: doubled per RTO until progress, even
    if 2 * nx[X_RD_GAP] > wait:                      # when the SACK of a re-request recomputed the RTO
        wait = max(wait, min(2 * nx[X_RD_GAP], par[NL.P_RTO_MAX]))    # MR-LOSS-013: paced responses come
    if now < prog + wait:                                              # this far apart: not lost yet
        return sent
    nx[X_RD_RTO] = min(2 * wait, par[NL.P_RTO_MAX])
    s[NL.S_RETRY_COUNT] += 1                         # MR-LOSS-013 -> MR-LOSS-007
    if s[NL.S_RETRY_COUNT] > par[NL.P_RETRY_CNT]:
        qp_error(A, Q, SW, CQT, CE, qi, S_RETRY_EXC, EV_QP_FATAL, WHY_RETRY_EXHAUSTED)      # MR-LOSS-009
        return sent
    rto = 2 * s[NL.S_RTO]
    s[NL.S_RTO] = rto if rto < par[NL.P_RTO_MAX] else par[NL.P_RTO_MAX]
    nx[X_C_RD_RTO] += 1
    A[P_TIMEOUTS] += 1
    nx[X_RD_PROG] = now
    if A[oldest + RQ_KIND] == K_READ:
        k = nat_rereq(A, Q, SW, TM, umem, tables, qi, b, oldest, A[oldest + RQ_N], now)
        if k > 0:
            sent += k
        rd_on_loss(rd_row(A, b), par, s[NL.S_SRTT], now)
    elif nat_replay(A, Q, SW, TM, umem, tables, qi, b, oldest, now):
        sent += 1
    A[oldest + RQ_RR_TS] = now
    A[oldest + RQ_GAP_TS] = NL.NONE
    return sent


@njit(**_jit)
def atomic_check(Q, MRT, qi, va, rkey):
    """Check 7 for an atomic, in the order of 03 Table 3-4: the QP's REMOTE_ATOMIC, R_Key and bounds of
    [VA, VA + 8), then the 8-byte alignment (MR-ATOM-002).  0, or the NAK syndrome."""
    if (Q[qi, Q_ACCESS] & ACC_REMOTE_ATOMIC) == 0:
        return NAK_INV_REQ
    if mr_check(MRT, rkey, Q[qi, Q_PD], va, 8, ACC_REMOTE_ATOMIC) < 0:
        return NAK_REM_ACCESS
    if va & 7:
        return NAK_INV_REQ
    return 0


@njit(**_jit)
def nat_job(A, nx, b, kind, psn0, i, iend, msn, va, ln, mr, retx, orig, amsn, keep):
    """Queue a responder job: READ responses [i, iend) of the READ at psn0, or an ATOMIC_ACKNOWLEDGE.
    False when fewer than `keep` rows would stay free (answers to copies leave room for executions)."""
    if nx[X_JB_TAIL] - nx[X_JB_HEAD] + keep >= NJB:
        return False
    x = b + O_JB + (nx[X_JB_TAIL] % NJB) * JB_STRIDE
    A[x + JB_KIND] = kind
    A[x + JB_PSN0] = psn0
    A[x + JB_I] = i
    A[x + JB_IEND] = iend
    A[x + JB_MSN] = msn
    A[x + JB_VA] = va
    A[x + JB_LEN] = ln
    A[x + JB_MR] = mr
    A[x + JB_RETX] = retx
    A[x + JB_ORIG] = orig
    A[x + JB_AMSN] = amsn
    nx[X_JB_TAIL] += 1
    return True


@njit(**_jit)
def nat_rd_execute(A, Q, SW, CQT, CE, MRT, TM, umem, tables, qi, b):
    """MR-OOO-016, MR-OOO-023: the held READs and atomics whose PSN the cumulative PSN has passed execute
    now, in PSN order.  A READ repeats check 7 and queues its responses; an atomic repeats check 7,
    reads and writes the remote cell once (host byte order, MR-ATOM-001), keeps the original value in
    its resource and queues its ATOMIC_ACKNOWLEDGE, whose AETH.MSN counts the atomic (MR-NAT-006)."""
    par, rx, s, nx, sb, pt = rows(A, b)
    while nx[X_RS_HELD] > 0:
        epsn = rx[NL.R_EPSN]
        x = -1
        bd = 0
        for t in range(NRS):
            y = b + O_RS + t * RS_STRIDE
            if A[y + RS_STATE] == RS_HELD:
                d = (epsn - A[y + RS_PSN]) & PSN_MASK
                if 0 < d < NL.PSN_HALF and d > bd:
                    x = y
                    bd = d
        if x < 0 or nx[X_JB_TAIL] - nx[X_JB_HEAD] >= NJB:
            return                                   # nothing due, or the job ring full: next round
        psn = A[x + RS_PSN]
        if A[x + RS_KIND] == K_READ:
            mr = np.int64(0)
            if A[x + RS_LEN] > 0:
                mr = mr_check(MRT, A[x + RS_RKEY], Q[qi, Q_PD], A[x + RS_VA], A[x + RS_LEN], ACC_REMOTE_READ)
                if mr < 0 or (Q[qi, Q_ACCESS] & ACC_REMOTE_READ) == 0:
                    nat_fail(A, Q, SW, CQT, CE, TM, umem, tables, qi, b, NAK_REM_ACCESS, psn, EV_QP_ACCESS_ERR, WHY_REMOTE_ACCESS)
                    return
            nat_job(A, nx, b, K_READ, psn, 0, A[x + RS_N], A[x + RS_MSN], A[x + RS_VA], A[x + RS_LEN], mr, 0, 0, 0,
                    0)
            nx[X_C_RD_EXEC] += 1
        else:
            va = A[x + RS_VA]
            err = atomic_check(Q, MRT, qi, va, A[x + RS_RKEY])
            if err:
                nat_fail(A, Q, SW, CQT, CE, TM, umem, tables, qi, b, err, psn,
                         EV_QP_ACCESS_ERR if err == NAK_REM_ACCESS else EV_QP_REQ_ERR, 22 if err == NAK_REM_ACCESS else 28)
                return
            cell = carray(ptr_u64(va), (1,))
            orig = cell[0]
            if A[x + RS_OP] == OP_CAS:
                if orig == np.uint64(A[x + RS_CMP]):
                    cell[0] = np.uint64(A[x + RS_SWAP])
            else:
                cell[0] = orig + np.uint64(A[x + RS_SWAP])
            A[x + RS_ORIG] = np.int64(orig)
            A[x + RS_AMSN] = Q[qi, Q_MSN]
            nat_job(A, nx, b, K_ATOMIC, psn, 0, 1, 0, 0, 0, 0, 0, A[x + RS_ORIG], A[x + RS_AMSN], 0)
            nx[X_C_AT_EXEC] += 1
        A[x + RS_STATE] = RS_DONE
        A[x + RS_ORD] = nx[X_RS_NEXT]                # execution number: PSN order (rs_take)
        nx[X_RS_NEXT] += 1
        nx[X_RS_HELD] -= 1


@njit(**_jit)
def rs_take(A, b):
    """The responder resource a new READ or atomic takes (MR-OOO-023): a free one, else the one executed
    first, i.e. of the lowest PSN (not the one recorded first: requests arrive out of order), whose
    response its requester has, as it never has more than max_rd_atomic requests sent from the oldest
    one it still awaits (MR-OOO-028); -1 when every resource holds a request not yet executed."""
    x = -1
    for t in range(NRS):
        y = b + O_RS + t * RS_STRIDE
        if A[y + RS_STATE] == 0:
            return y
        if A[y + RS_STATE] == RS_DONE and (x < 0 or A[y + RS_ORD] < A[x + RS_ORD]):
            x = y
    return x


@njit(**_jit)
def jb_unqueued(A, nx, b, psn0, msn, k, end):
    """The first run [k0, k1) of response indices in [k, end) of the READ at psn0 (MSN msn) that no
    queued job still has to send (a job's [JB_I, JB_IEND) is still to go): (end, end) when none.  At
    most NJB rows per step, each covering run skipped at once."""
    while k < end:
        nxt = end
        covered = False
        for h in range(nx[X_JB_HEAD], nx[X_JB_TAIL]):
            x = b + O_JB + (h % NJB) * JB_STRIDE
            if A[x + JB_KIND] != K_READ or A[x + JB_PSN0] != psn0 or A[x + JB_MSN] != msn:
                continue
            j0 = A[x + JB_I]
            j1 = A[x + JB_IEND]
            if j0 <= k < j1:
                k = j1
                covered = True
                break
            if k < j0 < nxt:
                nxt = j0
        if not covered:
            return k, nxt
    return end, end


@njit(**_jit)
def nat_rd_dup(A, Q, MRT, qi, b, is_read, op, psn, va, rkey, dlen, msn, off, mlen, swap, cmp):
    """A copy of a READ request (a re-request, MR-OOO-021/022) or of an atomic (a replay, MR-OOO-024):
    answered from the resource that holds it once it was executed and the copy agrees with it (a READ:
    MSN, VA and offset relative to the original, range within it, check 7 again; an atomic: the same
    AtomicETH; the saved result, never executed again).  A READ's response PSNs that a queued job still
    has to send are not queued again (counted in c_rereq_queued): responses paced at the link's share
    (MR-CC-021) may still be queued when the requester's RTO re-requests them, and a second copy behind
    them would only delay what follows.  Anything else is dropped and counted.
    Returns 0, or the NAK syndrome when check 7 fails."""
    par, rx, s, nx, sb, pt = rows(A, b)
    pmtu = Q[qi, Q_PMTU]
    for t in range(NRS):
        x = b + O_RS + t * RS_STRIDE
        if A[x + RS_STATE] != RS_DONE:
            continue
        if is_read:
            if A[x + RS_KIND] != K_READ or A[x + RS_MSN] != msn:
                continue
            i = (psn - A[x + RS_PSN]) & PSN_MASK
            ln = A[x + RS_LEN]
            if i >= A[x + RS_N] or off != i * pmtu or mlen != ln or va != A[x + RS_VA] + off or \
                    rkey != A[x + RS_RKEY] or dlen > ln - off or dlen < 0:
                continue
            n = max(1, (dlen + pmtu - 1) // pmtu)
            if i + n > A[x + RS_N]:
                continue
            mr = np.int64(0)
            if dlen > 0:
                mr = mr_check(MRT, rkey, Q[qi, Q_PD], va, dlen, ACC_REMOTE_READ)
                if mr < 0 or (Q[qi, Q_ACCESS] & ACC_REMOTE_READ) == 0:
                    return NAK_REM_ACCESS
            # MR-OOO-022: response PSNs still queued (the original READ's or an earlier re-request's job) are
            # not queued again -- their responses answer this copy too; only PSNs already sent go again
            k = i
            while k < i + n:
                k0, k1 = jb_unqueued(A, nx, b, A[x + RS_PSN], msn, k, i + n)
                nx[X_C_REREQ_QUEUED] += k0 - k
                if k0 < k1 and not nat_job(A, nx, b, K_READ, A[x + RS_PSN], k0, k1, msn, A[x + RS_VA], ln, mr, 1, 0,
                                           0, NRS):
                    break
                k = k1
            if k >= i + n:
                nx[X_C_REREQ_RX] += 1
                return 0
            break
        else:
            if A[x + RS_KIND] != K_ATOMIC or A[x + RS_PSN] != psn:
                continue
            if A[x + RS_VA] == va and A[x + RS_RKEY] == rkey and A[x + RS_SWAP] == swap and A[x + RS_CMP] == cmp \
                    and A[x + RS_OP] == op and nat_job(A, nx, b, K_ATOMIC, psn, 0, 1, 0, 0, 0, 0, 0, A[x + RS_ORIG],
                                                      A[x + RS_AMSN], NRS):
                nx[X_C_REREQ_RX] += 1
                return 0
            break
    nx[X_C_RD_DUP_DROP] += 1
    return 0


@njit(**_jit)
def nat_rx_rd(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, qi, b, op, psn, bo, end, pad, l3, st, now):
    """A NATIVE_READ_REQ or an atomic request at the responder (04 section 4.4.1 checks 2-4 and 7):
    a copy is answered per MR-OOO-022/024 and SACKed (MR-SACK-013); a new one is recorded with every
    PSN of its range (MR-OOO-003), held in a resource and executed when the cumulative PSN reaches it
    (MR-OOO-016, MR-OOO-023).  A SACK triggered by an atomic has flags.N (MR-SACK-006)."""
    par, rx, s, nx, sb, pt = rows(A, b)
    is_read = op == OP_N_READ_REQ
    if end != bo + OPT[op, OT_PAY] or pad != 0:
        nx[X_C_BAD_LEN] += 1
        A[P_RX_DROP_LEN] += 1                        # MR-NAT-009
        return
    h = ext_at(bo, op, OT_RETH if is_read else OT_ATOMICETH)
    va = reth_va(umem, h) if is_read else atomiceth_va(umem, h)
    rkey = reth_rkey(umem, h) if is_read else atomiceth_rkey(umem, h)
    dlen = np.int64(8)
    msn = np.int64(0)
    off = np.int64(0)
    mlen = np.int64(0)
    tsval = np.int64(0)
    swap = np.int64(0)
    cmp = np.int64(0)
    if is_read:
        dlen = reth_dlen(umem, h)
        t = ext_at(bo, op, OT_NETH)
        fl = neth_flags(umem, t)
        msn = neth_msn(umem, t)
        off = neth_offset(umem, t)
        mlen = neth_msg_len(umem, t)
        tsval = neth_tsval(umem, t)
        if (fl & (NETH_FIRST | NETH_LAST)) != (NETH_FIRST | NETH_LAST):
            nx[X_C_BAD_LEN] += 1                     # MR-NAT-021, MR-XH-021
            A[P_RX_DROP_LEN] += 1
            return
    else:
        swap = atomiceth_swap_add(umem, h)
        cmp = atomiceth_compare(umem, h)
    has_ts = 1 if is_read else 0
    ackreq = 1 if bth_ackreq(umem, bo) else 0
    ce = 1 if ce_marked(umem, l3) else 0
    sport = udp_sport(umem, udp_of(umem, l3))
    pmtu = Q[qi, Q_PMTU]
    if rx_recorded(rx, par, psn):                    # a copy (MR-SACK-013): a re-request or a replay
        rx_on_packet(rx, par, psn, ackreq, ce, has_ts, tsval, sport, now)
        nx[X_C_DUP] += 1
        A[P_RX_DUP] += 1
        syn = nat_rd_dup(A, Q, MRT, qi, b, is_read, op, psn, va, rkey, dlen, msn, off, mlen, swap, cmp)
        if syn:
            nat_fail(A, Q, SW, CQT, CE, TM, umem, tables, qi, b, syn, psn, EV_QP_ACCESS_ERR, WHY_REMOTE_ACCESS)
            return
        nat_rd_send(A, Q, SW, CQT, CE, MRT, TM, umem, tables, qi, b, now, 1)
        nat_send_sack(A, Q, TM, umem, tables, qi, b, AETH_ACK_SYN, -1)
        return
    d = (psn - rx[NL.R_EPSN]) & PSN_MASK
    if d >= par[NL.P_W]:
        rx_on_packet(rx, par, psn, ackreq, ce, has_ts, tsval, sport, now)     # MR-SACK-011: counted there
        nx[X_C_OOW] += 1
        return
    if nx[X_ERR_SYN] and psn == nx[X_ERR_PSN]:
        nx[X_C_ERR_HELD] += 1                        # MR-SACK-031: never recorded while its error waits
        return
    npk = np.int64(1)
    if is_read:
        npk = max(1, (dlen + pmtu - 1) // pmtu)
        if off != 0 or mlen != dlen or d + npk > par[NL.P_W]:
            # check 4 (a READ that is not a copy has offset 0), check 7 (the range ends inside the window)
            nat_reject(A, Q, SW, RW, CQT, CE, TM, umem, tables, qi, b, NAK_INV_REQ, psn, WHY_OPCODE_SEQUENCE, ce,
                       has_ts, tsval, sport, now)
            return
        if dlen > 0 and (mr_check(MRT, rkey, Q[qi, Q_PD], va, dlen, ACC_REMOTE_READ) < 0 or
                         (Q[qi, Q_ACCESS] & ACC_REMOTE_READ) == 0):
            nat_reject(A, Q, SW, RW, CQT, CE, TM, umem, tables, qi, b, NAK_REM_ACCESS, psn, WHY_REMOTE_ACCESS, ce,
                       has_ts, tsval, sport, now)
            return
    else:
        err = atomic_check(Q, MRT, qi, va, rkey)
        if err:
            # the NAK-type SACK of an atomic: tsecr 0 and flags.N (MR-SACK-006, MR-SACK-032)
            nat_reject(A, Q, SW, RW, CQT, CE, TM, umem, tables, qi, b, err, psn, 22 if err == NAK_REM_ACCESS else 28,
                       ce, has_ts, tsval, sport, now)
            return
    x = rs_take(A, b)
    if x < 0:
        nx[X_C_RD_DUP_DROP] += 1                     # more than max_dest_rd_atomic held: not recorded
        return
    e0 = rx[NL.R_EPSN]
    res = rx_on_range(rx, par, psn, npk, ackreq, ce, has_ts, tsval, sport, now)
    A[x:x + RS_STRIDE] = 0
    A[x + RS_STATE] = RS_HELD
    A[x + RS_KIND] = K_READ if is_read else K_ATOMIC
    A[x + RS_PSN] = psn
    A[x + RS_N] = npk
    A[x + RS_MSN] = msn
    A[x + RS_VA] = va
    A[x + RS_RKEY] = rkey
    A[x + RS_LEN] = dlen
    A[x + RS_OP] = op
    A[x + RS_SWAP] = swap
    A[x + RS_CMP] = cmp
    nx[X_RS_HELD] += 1
    if d != 0:
        nx[X_C_OOO] += 1
    nx[X_C_PLACED] += 1
    lastp = (psn + npk - 1) & PSN_MASK
    A[b + O_LM + (lastp & NL.WMASK)] = lastp + 1    # a message ends here (MR-SACK-003's MSN)
    nat_advanced(A, Q, RW, CQT, CE, qi, b, e0, st)
    nat_rd_execute(A, Q, SW, CQT, CE, MRT, TM, umem, tables, qi, b)
    if Q[qi, Q_STATE] == ST_ERR or nat_error_due(A, Q, SW, RW, CQT, CE, TM, umem, tables, qi, b):
        return
    if not is_read:
        nat_rd_send(A, Q, SW, CQT, CE, MRT, TM, umem, tables, qi, b, now, 1)     # the result before the SACK
    if res & RX_SACK_NOW:
        nat_send_sack(A, Q, TM, umem, tables, qi, b, AETH_ACK_SYN, -1)


@njit(**_jit)
def nat_rd_send(A, Q, SW, CQT, CE, MRT, TM, umem, tables, qi, b, now, budget):
    """The responder's jobs in order (MR-OOO-017): NATIVE_READ_RESP packets -- BTH.PSN the READ's PSN
    + i, NETH.MSN the READ's, offset i * pmtu, msg_len the READ's length, FIRST / LAST of the READ,
    RETX when answering a re-request (MR-NAT-015), no AETH -- and ATOMIC_ACKNOWLEDGEs (MR-NAT-006:
    BTH.PSN the atomic's, AETH 0x1F with the MSN, the original value).  A READ whose MR went away
    meanwhile ends the QP with a remote access error (as MR-MEM-033).  READ responses are paced at the
    port's link rate over the QPs with responses pending (MR-CC-021, native/rdpace.py): one that must
    wait ends the call and stays at the head (the QP stays busy; the loop comes back next round).
    Returns packets sent."""
    par, rx, s, nx, sb, pt = rows(A, b)
    nat_rd_pend(A, b, nx)
    n = nat_rd_jobs(A, Q, SW, CQT, CE, MRT, TM, umem, tables, qi, b, now, budget)
    nat_rd_pend(A, b, nx)
    return n


@njit(**_jit)
def nat_rd_jobs(A, Q, SW, CQT, CE, MRT, TM, umem, tables, qi, b, now, budget):
    """nat_rd_send's jobs, in order, paced (MR-OOO-017, MR-CC-021)."""
    par, rx, s, nx, sb, pt = rows(A, b)
    ext = nat_ext(A)
    pmtu = Q[qi, Q_PMTU]
    rp = rp_row(A, b)
    pw = pw_base(A)
    rate = A[pw + PW_RATE]
    n = 0
    while n < budget and nx[X_JB_HEAD] != nx[X_JB_TAIL]:
        x = b + O_JB + (nx[X_JB_HEAD] % NJB) * JB_STRIDE
        if A[x + JB_KIND] == K_ATOMIC:
            ext_len = put_atomicacketh(ext, put_aeth(ext, 0, AETH_ACK_SYN, A[x + JB_AMSN] & PSN_MASK), A[x + JB_ORIG])
            if not emit(A, Q, TM, umem, tables, qi, OP_ATOMIC_ACK, 0, 0, A[x + JB_PSN0] & PSN_MASK, ext, ext_len, 0, 0):
                return n
            n += 1
            nx[X_JB_HEAD] += 1
            continue
        ln = A[x + JB_LEN]
        npk = max(1, (ln + pmtu - 1) // pmtu)
        while A[x + JB_I] < A[x + JB_IEND] and n < budget:
            if A[x + JB_MR] and not mr_live(MRT, A[x + JB_MR]):     # deregistered or re-registered: MR-SEC-003
                nx[X_JB_HEAD] = nx[X_JB_TAIL]
                nat_fail(A, Q, SW, CQT, CE, TM, umem, tables, qi, b, NAK_REM_ACCESS, A[x + JB_PSN0],
                         EV_QP_ACCESS_ERR, WHY_REMOTE_ACCESS)
                return n
            i = A[x + JB_I]
            off = i * pmtu
            plen = min(pmtu, ln - off)
            if plen < 0:
                plen = 0
            fl = (NETH_FIRST if i == 0 else 0) | (NETH_LAST if i == npk - 1 else 0) | \
                (NETH_RETX if A[x + JB_RETX] else 0)
            ext_len = put_neth(ext, 0, fl, A[x + JB_MSN] & PSN_MASK, off, ln, tsval_of(now))
            if not rpace_may_send(rp, rate, now):       # MR-CC-021: this QP's share of the link
                return n
            tb0 = A[P_TX_BYTES]
            if not emit(A, Q, TM, umem, tables, qi, OP_N_READ_RESP, 0, 0, (A[x + JB_PSN0] + i) & PSN_MASK, ext, ext_len,
                        A[x + JB_VA] + off, plen):
                return n
            rpace_on_sent(rp, rate, A[pw + PW_NPEND], A[P_TX_BYTES] - tb0 + FRAME_TO_WIRE, par[NL.P_MAX_BURST], now)
            A[x + JB_I] = i + 1
            n += 1
            nx[X_C_RD_RESP_TX] += 1
        if A[x + JB_I] >= A[x + JB_IEND]:
            nx[X_JB_HEAD] += 1
    return n
