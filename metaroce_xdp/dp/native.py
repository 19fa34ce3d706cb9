"""The native profile in the compiled data plane: NETH/RSNETH requests, NATIVE_SACK, out-of-order
placement, selective retransmission, RACK/TLP/RTO (docs/spec/04-native.md), called from loop.py.

The transport decisions are metaroce_xdp/native/'s compiled logic (receiver.py, sender.py,
multipath.py) over its int64 rows; this module keeps those rows in the port's arena and does the
I/O around them: parsing native packets straight from the UMEM frame, placing their payload,
building native frames and SACKs from the QP's template, and completing work requests.

Layout: a native region of the arena (`region_words`), found through word P_NAT_OFF of the port
scalars: NATQ (one word per QP slot: native slot + 1, 0 for a compat QP), then NSLOT slots of
SLOT_WORDS words each holding one QP's rows:

  PAR RX TX        native/layout.py's rows (parameters, responder, requester)
  NX               this module's scalars (MSN/RSN numbering, counters)
  SB SBX           the scoreboard and, per PSN, (send queue index, packet in the WQE)
  RM RMX LM        responder messages by RSN (+ length, immediate, flags), message-end marks by PSN
  PT SP            entropy values and their UDP source ports
  WD HDR OUT       scratch: SACK bitmap words, SACK fields, receive completions

What is not built yet (refused before it reaches the wire): READ and atomics on a native QP
(MR-OOO-016..027), the XDP program consuming SACKs.  The profile is chosen at RTR
(QPAttr.profile; dp/cmconnect.py negotiates it).
"""
from __future__ import annotations

import sys

if __name__.rpartition(".")[0] + ".loop" not in sys.modules:      # loop.py imports this module half way
    raise ImportError(f"import {__name__.rpartition('.')[0]}.loop, which imports {__name__}")

import numpy as np  # noqa: E402
from numba import carray, njit  # noqa: E402
from .. import jitcache  # noqa: F401,E402  (cache keyed on every module compiled code depends on)

from ..native import layout as NL  # noqa: E402
from ..native.multipath import mp_init, mp_pick, mp_pick_retx  # noqa: E402
from ..native.receiver import (RSN_INVALID, RSN_NOT_READY, RX_NEW, RX_OOW, RX_SACK_NOW, rx_build_sack,  # noqa: E402
                               rx_init, rx_on_not_ready, rx_on_packet, rx_recv_completions, rx_rsn_check,
                               rx_sack_due)
from ..native.sender import (ACT_FAIL, ACT_RTO, ACT_TLP, TK_NEW, TK_RETX, TK_RTO, TK_TLP, tsval_of,  # noqa: E402
                             tx_can_send, tx_init, tx_next_deadline, tx_next_lost, tx_on_rnr_nak, tx_on_sack,
                             tx_on_timer, tx_on_transmit)
from .layout import *  # noqa: F401,F403,E402
from .layout import N_P, NM, PSN_MASK, PSN_NONE  # noqa: E402
from .loop import (ACC_REMOTE_WRITE, EV_QP_ACCESS_ERR, EV_QP_FATAL, EV_QP_REQ_ERR, S_LOC_LEN, S_LOC_PROT,  # noqa: E402
                   S_OK, S_RETRY_EXC, S_RNR_EXC, ST_RTR, ST_RTS, ST_SQD, ST_SQE, ST_ERR, WC_RECV, WC_RECV_IMM,
                   WR_SEND, WR_SEND_IMM, WR_WRITE, WR_WRITE_IMM, F_SOLICITED, WCF_IMM, AETH_ACK_SYN, NAK_INV_REQ,
                   NAK_REM_ACCESS, RNR_SYN, activate, advance, emit, flush_queues, get_be, mr_check,
                   nak_error_due, push_cqe, put_be, qp_error, sq_row)
from .ops import CQE_SOLICITED, F_FENCE, ce_marked, comm_est, place, sg_valid, sqd_check, src_of  # noqa: E402
from .prims import ld_acq_i64, ptr_u8  # noqa: E402

_jit = dict(cache=True, nogil=True)

# port scalars beyond P_FIELDS (layout.py keeps N_P - 32 words for them)
P_NAT_OFF = N_P - 1          # offset of the native region in the arena (0: the port has none)
P_NAT_EXT = N_P - 2          # raw address of the 512-byte header scratch (SACK bitmaps exceed loop's 32)
NSLOT = 16                   # native QPs per port
EXT_BYTES = 512

OP_N_SEND, OP_N_SEND_IMM, OP_N_WRITE, OP_N_WRITE_IMM, OP_N_READ_REQ, OP_N_READ_RESP, OP_N_SACK = range(0xC0, 0xC7)
NETH_FIRST, NETH_LAST, NETH_RETX = 0x80, 0x40, 0x20

NX_FIELDS = """msn_next rsn_next cur_msn cur_rsn r_msn sack_owed c_tx c_retx c_rto c_tlp c_sack_tx c_sack_rx
               c_sack_bad c_ooo c_dup c_oow c_notready c_rsn_inv c_bad_len c_placed c_rx_bytes""".split()
for _i, _n in enumerate(NX_FIELDS):
    globals()["X_" + _n.upper()] = _i
NNX = 32
X_FL_KEY = NNX - 1           # the QP's flow label key (MR-MP-016, NativeSlots.start)
NSBX = 4                     # send queue index, packet index k, the message's MSN and RSN
NRMX = 4                     # message length, immediate, flags (1 imm, 2 solicited, 4 WRITE_IMM)

O_PAR = 0
O_RX = O_PAR + NL.NPAR
O_TX = O_RX + NL.NRX
O_NX = O_TX + NL.NTX
O_SB = O_NX + NNX
O_SBX = O_SB + NL.WMAX * NL.NSB
O_RM = O_SBX + NL.WMAX * NSBX
O_RMX = O_RM + NL.WMAX * NL.NRM
O_LM = O_RMX + NL.WMAX * NRMX
O_PT = O_LM + NL.WMAX
O_SP = O_PT + NL.KMAX * NL.NPT
O_WD = O_SP + NL.KMAX
O_HDR = O_WD + 32
O_OUT = O_HDR + 8
SLOT_WORDS = (O_OUT + 64 + 7) & ~7


def region_words(maxq: int) -> int:
    return ((maxq + 7) & ~7) + NSLOT * SLOT_WORDS + EXT_BYTES // 8


# ============================================================================ rows of a slot
@njit(**_jit)
def nat_slot(A, qi):
    """The native slot of QP qi, -1 for a compat QP."""
    o = A[P_NAT_OFF]
    if o == 0:
        return -1
    return A[o + qi] - 1


@njit(**_jit)
def slot_base(A, sl):
    return A[P_NAT_OFF] + ((A[P_MAXQ] + 7) & ~7) + sl * SLOT_WORDS


@njit(**_jit)
def rows(A, b):
    par = A[b + O_PAR:b + O_PAR + NL.NPAR]
    rx = A[b + O_RX:b + O_RX + NL.NRX]
    s = A[b + O_TX:b + O_TX + NL.NTX]
    nx = A[b + O_NX:b + O_NX + NNX]
    sb = A[b + O_SB:b + O_SB + NL.WMAX * NL.NSB].reshape((NL.WMAX, NL.NSB))
    pt = A[b + O_PT:b + O_PT + NL.KMAX * NL.NPT].reshape((NL.KMAX, NL.NPT))
    return par, rx, s, nx, sb, pt


@njit(**_jit)
def nat_ext(A):
    return carray(ptr_u8(A[P_NAT_EXT]), (EXT_BYTES,))


# ============================================================================ requester
@njit(**_jit)
def set_sport(Q, TM, qi, sport):
    """The UDP source port of the QP's next frame (per-packet entropy, MR-MP-004): the template's."""
    u = Q[qi, Q_L3_OFF] + (40 if Q[qi, Q_IPV6] else 20)
    TM[qi, u] = (sport >> 8) & 0xFF
    TM[qi, u + 1] = sport & 0xFF


@njit(**_jit)
def flow_label(key, sport):
    """MR-MP-016: the IPv6 flow label of entropy value `sport` on a QP with flow label key `key`: a
    permutation of 20-bit words keyed by `key` (4 Feistel rounds on 10-bit halves) applied to the
    value's 14 bits under a 6-bit tag of the key, so distinct values of a QP get distinct labels;
    never 0 (the one value it would map to 0 is mapped with its tag flipped, an input no value of
    the QP uses).  Callable from Python as flow_label.py_func."""
    x = (((key >> 50) & 0x3F) << 14) | (sport & 0x3FFF)
    y = 0
    for _t in range(2):
        lo = x & 0x3FF
        hi = x >> 10
        for i in range(4):
            f = ((((lo ^ (key >> (10 * i))) & 0x3FF) * 0x2C5) ^ (lo >> 3) ^ (key >> (40 + i))) & 0x3FF
            hi, lo = lo, hi ^ f
        y = (hi << 10) | lo
        if y != 0:
            return y
        x ^= 1 << 14
    return y


@njit(**_jit)
def set_entropy(Q, TM, qi, nx, sport):
    """The QP's next frames go out on entropy value `sport`: its UDP source port (MR-MP-004) and, over
    IPv6, its flow label (MR-MP-016), kept in the template so a SACK carries the pair too."""
    set_sport(Q, TM, qi, sport)
    if Q[qi, Q_IPV6]:
        o = Q[qi, Q_L3_OFF]
        fl = flow_label(nx[X_FL_KEY], sport)
        TM[qi, o + 1] = (TM[qi, o + 1] & 0xF0) | (fl >> 16)
        TM[qi, o + 2] = (fl >> 8) & 0xFF
        TM[qi, o + 3] = fl & 0xFF


@njit(**_jit)
def nat_tx_packet(A, Q, SW, TM, umem, tables, qi, b, psn, kind, ackreq, now):
    """(Re)transmit PSN `psn` of the QP's send queue as a native request (MR-NAT-005, MR-NAT-017..020,
    MR-NAT-025): RETH (WRITE), NETH, RSNETH (recv-consuming), ImmDt; RETX set unless kind is TK_NEW
    (MR-NAT-015); entropy from the multipath logic (MR-MP-006, MR-SACK-025).  False: no frame."""
    par, rx, s, nx, sb, pt = rows(A, b)
    j = b + O_SBX + (psn & NL.WMASK) * NSBX
    wi = A[j]
    k = A[j + 1]
    r = sq_row(Q, qi, wi)
    op = SW[r, W_OPCODE]
    length = SW[r, W_LENGTH]
    pmtu = Q[qi, Q_PMTU]
    npsn = SW[r, W_NPSN]
    off = k * pmtu
    plen = min(pmtu, length - off)
    if plen < 0:
        plen = 0
    last = k == npsn - 1
    if kind == TK_NEW:
        e = mp_pick(pt, par, s[NL.S_SRTT], now)
    else:
        e = mp_pick_retx(pt, par, s[NL.S_SRTT], now, sb[psn & NL.WMASK, NL.B_ENTROPY])
    if e & NL.PICK_PROBE:
        ackreq = 1                                   # a probe on a PROBING value (MR-MP-010)
        e &= NL.PICK_PROBE - 1
    set_entropy(Q, TM, qi, nx, pt[e, NL.E_SPORT])
    ext = nat_ext(A)
    n = 0
    is_write = op == WR_WRITE or op == WR_WRITE_IMM
    has_imm = op == WR_WRITE_IMM or op == WR_SEND_IMM
    if is_write:                                     # MR-NAT-019: the same RETH in every packet
        put_be(ext, 0, SW[r, W_RADDR], 8)
        put_be(ext, 8, SW[r, W_RKEY], 4)
        put_be(ext, 12, length, 4)
        n = 16
    fl = (NETH_FIRST if k == 0 else 0) | (NETH_LAST if last else 0) | (0 if kind == TK_NEW else NETH_RETX)
    put_be(ext, n, (fl << 24) | (A[j + 2] & PSN_MASK), 4)
    put_be(ext, n + 4, off, 4)
    put_be(ext, n + 8, length, 4)
    put_be(ext, n + 12, tsval_of(now), 4)
    n += 16
    if op != WR_WRITE:                               # RSNETH (MR-NAT-025, MR-XH-037)
        put_be(ext, n, A[j + 3] & PSN_MASK, 4)
        n += 4
    if has_imm:                                      # MR-NAT-020: ImmDt in every packet
        put_be(ext, n, SW[r, W_IMM], 4)
        n += 4
    opc = (OP_N_WRITE_IMM if has_imm else OP_N_WRITE) if is_write else (OP_N_SEND_IMM if has_imm else OP_N_SEND)
    se = 0x80 if (last and op != WR_WRITE and (SW[r, W_FLAGS] & F_SOLICITED) != 0) else 0
    if not emit(A, Q, TM, umem, tables, qi, opc, se, ackreq, psn, ext, n, src_of(A, SW, r, off, plen), plen):
        return False
    tx_on_transmit(s, sb, par, psn, e, kind, now)
    nx[X_C_TX] += 1
    if kind != TK_NEW:
        nx[X_C_RETX] += 1
        A[P_RETRANSMITS] += 1
    return True


@njit(**_jit)
def pace_slack(s, par):
    """MR-CC-004: with cwnd >= 1 the sender paces at pacing_gain * cwnd / srtt but may send up to
    max_burst packets back-to-back: tx_can_send is asked at now + (max_burst - 1) packet gaps, so the
    loop leaves bursts of frames per kick instead of one frame per round."""
    c = s[NL.S_CWND]
    if s[NL.S_SRTT] == NL.NONE or c < NL.FP or par[NL.P_MAX_BURST] <= 1:
        return 0
    gap = (s[NL.S_SRTT] * NL.FP // par[NL.P_PACING_GAIN]) * NL.FP // c
    return (par[NL.P_MAX_BURST] - 1) * gap


@njit(**_jit)
def nat_requester(A, Q, SW, TM, umem, tables, qi, b, now, budget):
    """Lost PSNs first (MR-SACK-023), then new packets from the send queue, as the window, credits,
    congestion window and pacing allow (tx_can_send: MR-CC-001..004).  Returns packets sent."""
    par, rx, s, nx, sb, pt = rows(A, b)
    sent = 0
    pnow = now + pace_slack(s, par)
    while sent < budget:
        p = tx_next_lost(s, sb)
        if p == PSN_NONE:
            break
        if tx_can_send(s, par, pnow, 0) != 0:
            return sent
        if not nat_tx_packet(A, Q, SW, TM, umem, tables, qi, b, p, TK_RETX, 0, now):
            return sent
        sent += 1
    pmtu = Q[qi, Q_PMTU]
    while sent < budget:
        nxt = Q[qi, Q_SQ_NEXT]
        if nxt == ld_acq_i64(Q[qi], Q_SQ_TAIL):
            break
        if tx_can_send(s, par, pnow, 1) != 0:
            break
        r = sq_row(Q, qi, nxt)
        op = SW[r, W_OPCODE]
        lmr = SW[r, W_LMR]
        if (lmr and A[A[P_MR_OFF] + lmr * NM + M_VALID] == 0) or not sg_valid(A, SW[r, W_SG], SW[r, W_NSGE]):
            if nxt == Q[qi, Q_SQ_HEAD]:              # MR-MEM-035, as the compat requester
                SW[r, W_STARTED] = 1
                Q[qi, Q_LOCERR] = 30 if lmr == MR_BAD else 5
            break
        if SW[r, W_STARTED] == 0:
            if Q[qi, Q_STATE] == ST_SQD:
                break                                # MR-QP-013
            if (SW[r, W_FLAGS] & F_FENCE) and Q[qi, Q_SQ_HEAD] != nxt:
                break                                # MR-NAT-024: a fence waits for every earlier WR
            SW[r, W_FIRST_PSN] = s[NL.S_SND_NXT]
            SW[r, W_NPSN] = max(1, (SW[r, W_LENGTH] + pmtu - 1) // pmtu)
            SW[r, W_SENT] = 0
            SW[r, W_STARTED] = 1
            SW[r, W_DONE] = 0
            nx[X_CUR_MSN] = nx[X_MSN_NEXT]           # MR-NAT-012
            nx[X_MSN_NEXT] = (nx[X_MSN_NEXT] + 1) & PSN_MASK
            nx[X_CUR_RSN] = nx[X_RSN_NEXT]
            if op != WR_WRITE:                       # MR-NAT-025
                nx[X_RSN_NEXT] = (nx[X_RSN_NEXT] + 1) & PSN_MASK
        k = SW[r, W_SENT]
        npsn = SW[r, W_NPSN]
        psn = (SW[r, W_FIRST_PSN] + k) & PSN_MASK
        j = b + O_SBX + (psn & NL.WMASK) * NSBX
        A[j] = nxt
        A[j + 1] = k
        A[j + 2] = nx[X_CUR_MSN]
        A[j + 3] = nx[X_CUR_RSN]
        last = k == npsn - 1
        if not nat_tx_packet(A, Q, SW, TM, umem, tables, qi, b, psn, TK_NEW, 1 if last else 0, now):
            break                                    # MR-NAT-023: AckReq on the last packet
        sent += 1
        SW[r, W_SENT] = k + 1
        Q[qi, Q_SND_PSN] = s[NL.S_SND_NXT]
        Q[qi, Q_SND_MAX] = s[NL.S_SND_NXT]
        if last:
            Q[qi, Q_SQ_NEXT] = nxt + 1
    return sent


@njit(**_jit)
def nat_timers(A, Q, SW, CQT, CE, TM, umem, tables, qi, b, now):
    """RTO, reordering timer and tail-loss probe (MR-LOSS-007, MR-SACK-028, MR-LOSS-010); the RTO's
    packet and the probe carry AckReq (MR-NAT-023); retry_cnt exceeded: RETRY_EXC_ERR (MR-LOSS-009)."""
    par, rx, s, nx, sb, pt = rows(A, b)
    d = tx_next_deadline(s)
    if d == NL.NONE or now < d:
        return 0
    a = tx_on_timer(s, sb, pt, par, now)
    act = a >> 32
    p = a & 0xFFFFFFFF
    if act == ACT_FAIL:
        qp_error(A, Q, SW, CQT, CE, qi, S_RETRY_EXC, EV_QP_FATAL, 2)
        return 0
    if act == ACT_RTO:
        nx[X_C_RTO] += 1
        A[P_TIMEOUTS] += 1
        if p != PSN_NONE and nat_tx_packet(A, Q, SW, TM, umem, tables, qi, b, p, TK_RTO, 1, now):
            return 1
    elif act == ACT_TLP:
        nx[X_C_TLP] += 1
        if nat_tx_packet(A, Q, SW, TM, umem, tables, qi, b, p, TK_TLP, 1, now):
            return 1
    return 0


@njit(**_jit)
def nat_on_sack(A, Q, SW, CQT, CE, umem, qi, b, psn, bo, end, now):
    """A NATIVE_SACK (04 section 4.3.1) for our requester: ACK-type to tx_on_sack (MR-SACK-019..030,
    MR-SACK-038), RNR NAK-type to tx_on_rnr_nak, error NAKs fail the WQE holding the PSN once the
    WQEs before it completed; then WQEs wholly before snd_una complete in order (MR-SACK-026)."""
    par, rx, s, nx, sb, pt = rows(A, b)
    h = bo + 12
    syn = np.int64(umem[h])
    k = h + 4
    if k + 12 > end:
        nx[X_C_SACK_BAD] += 1
        A[P_RX_DROP_LEN] += 1
        return
    tsecr = get_be(umem, k, 4)
    credit = get_be(umem, k + 4, 2)
    ce_count = get_be(umem, k + 6, 2)
    sport = get_be(umem, k + 8, 2)
    nw = np.int64(umem[k + 10])
    flags = np.int64(umem[k + 11])
    if nw > 32 or k + 12 + 4 * nw != end:            # MR-SACK-005, MR-NAT-009
        nx[X_C_SACK_BAD] += 1
        A[P_RX_DROP_LEN] += 1
        return
    words = A[b + O_WD:b + O_WD + 32]
    for i in range(nw):
        words[i] = get_be(umem, k + 12 + 4 * i, 4)
    nx[X_C_SACK_RX] += 1
    typ = (syn >> 5) & 3
    if typ == 0:
        tx_on_sack(s, sb, pt, par, psn, nw, words, tsecr, flags, ce_count, credit, sport, now)
    elif typ == 1:
        j = b + O_SBX + (psn & NL.WMASK) * NSBX
        starts = 0
        if A[j + 1] == 0:
            r = sq_row(Q, qi, A[j])
            starts = 1 if SW[r, W_OPCODE] != WR_WRITE else 0
        if tx_on_rnr_nak(s, sb, pt, par, psn, syn, starts, tsecr, flags, ce_count, credit, now) == -2:
            qp_error(A, Q, SW, CQT, CE, qi, S_RNR_EXC, EV_QP_FATAL, 3)
            return
    elif typ == 3:
        tx_on_sack(s, sb, pt, par, (psn - 1) & PSN_MASK, 0, words, tsecr, flags, ce_count, credit, sport, now)
        Q[qi, Q_NERR_PSN] = psn + 1
        Q[qi, Q_NERR_CODE] = syn & 0x1F
    else:
        nx[X_C_SACK_BAD] += 1
        return
    advance(A, Q, SW, CQT, CE, qi, s[NL.S_SND_UNA], now)
    if Q[qi, Q_NERR_PSN]:
        nak_error_due(A, Q, SW, CQT, CE, qi)


# ============================================================================ responder
@njit(**_jit)
def nat_send_sack(A, Q, TM, umem, tables, qi, b, syn, psn):
    """A NATIVE_SACK (MR-SACK-002/003): ACK-type (syn 0x1F, BTH.PSN the cumulative PSN, psn < 0) from
    rx_build_sack, or a NAK-type with syndrome `syn` at `psn` and no bitmap.  False: no frame (owed)."""
    par, rx, s, nx, sb, pt = rows(A, b)
    hdr = A[b + O_HDR:b + O_HDR + 8]
    words = A[b + O_WD:b + O_WD + 32]
    nw = rx_build_sack(rx, par, hdr, words)
    if psn >= 0:
        nw = 0
    else:
        psn = hdr[0]
    ext = nat_ext(A)
    put_be(ext, 0, ((syn & 0xFF) << 24) | (Q[qi, Q_MSN] & PSN_MASK), 4)
    put_be(ext, 4, hdr[2], 4)
    put_be(ext, 8, hdr[3], 2)
    put_be(ext, 10, hdr[4], 2)
    put_be(ext, 12, hdr[5], 2)
    ext[14] = nw
    ext[15] = hdr[6]
    for i in range(nw):
        put_be(ext, 16 + 4 * i, words[i], 4)
    if emit(A, Q, TM, umem, tables, qi, OP_N_SACK, 0, 0, psn & PSN_MASK, ext, 16 + 4 * nw, 0, 0):
        nx[X_C_SACK_TX] += 1
        nx[X_SACK_OWED] = 0
        return True
    nx[X_SACK_OWED] = 1
    return False


@njit(**_jit)
def nat_fail(A, Q, SW, CQT, CE, TM, umem, tables, qi, b, syn, psn, ev, why):
    """An error NAK-type SACK (MR-SACK-034), then ERR."""
    nat_send_sack(A, Q, TM, umem, tables, qi, b, syn, psn)
    qp_error(A, Q, SW, CQT, CE, qi, -1, ev, why)


@njit(**_jit)
def nat_rx(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, qi, op, psn, bo, end, pad, l3, now):
    """One native packet of QP qi (ICRC checked; bo = BTH offset, end = ICRC offset): a SACK for the
    requester, or a NATIVE_SEND/SEND_IMM/WRITE/WRITE_IMM request, placed where NETH.offset and the
    RETH or the RSN's receive WQE say whatever its order (MR-OOO-001..014), recorded in the receive
    window (MR-SACK-010..017), completed in order, SACKed on gaps, duplicates, AckReq and every
    ack_n packets."""
    sl = nat_slot(A, qi)
    b = slot_base(A, sl)
    st = Q[qi, Q_STATE]
    if op == OP_N_SACK:
        if st != ST_RTS and st != ST_SQD and st != ST_SQE:
            A[P_RX_DROP_STATE] += 1
            return
        nat_on_sack(A, Q, SW, CQT, CE, umem, qi, b, psn, bo, end, now)
        activate(A, Q, qi)
        return
    if op < OP_N_SEND or op > OP_N_WRITE_IMM:
        A[P_RX_DROP_OP] += 1                         # MR-NAT-007 (native READ and atomics: not built yet)
        return
    if (st != ST_RTR and st != ST_RTS and st != ST_SQD) or Q[qi, Q_FNAK_SYN]:
        A[P_RX_DROP_STATE] += 1
        return
    par, rx, s, nx, sb, pt = rows(A, b)
    h = bo + 12
    is_write = op >= OP_N_WRITE
    recv = op != OP_N_WRITE
    has_imm = op == OP_N_SEND_IMM or op == OP_N_WRITE_IMM
    va = np.int64(0)
    rkey = np.int64(0)
    dlen = np.int64(-1)
    need = 16 + (16 if is_write else 0) + (4 if recv else 0) + (4 if has_imm else 0)
    if h + need + pad > end:
        nx[X_C_BAD_LEN] += 1
        A[P_RX_DROP_LEN] += 1                        # MR-NAT-009, MR-XH-039
        return
    if is_write:
        va = get_be(umem, h, 8)
        rkey = get_be(umem, h + 8, 4)
        dlen = get_be(umem, h + 12, 4)
        h += 16
    fl = np.int64(umem[h])
    msn = get_be(umem, h + 1, 3)
    off = get_be(umem, h + 4, 4)
    mlen = get_be(umem, h + 8, 4)
    tsval = get_be(umem, h + 12, 4)
    h += 16
    rsn = np.int64(0)
    if recv:
        rsn = get_be(umem, h + 1, 3)
        h += 4
    imm = np.int64(0)
    if has_imm:
        imm = get_be(umem, h, 4)
        h += 4
    plen = end - pad - h
    pmtu = Q[qi, Q_PMTU]
    rest = mlen - off
    want = pmtu if rest > pmtu else rest
    # MR-NAT-017/018/019: offset on a packet boundary, the payload the offset implies, flags to match
    if off % pmtu != 0 or rest < 0 or plen != want or (is_write and dlen != mlen) or \
            ((fl & NETH_FIRST) != 0) != (off == 0) or ((fl & NETH_LAST) != 0) != (off + plen == mlen):
        nx[X_C_BAD_LEN] += 1
        A[P_RX_DROP_LEN] += 1
        return
    npk = (rest + pmtu - 1) // pmtu
    if npk < 1:
        npk = 1
    last_psn = (psn + npk - 1) & PSN_MASK
    lastp = (fl & NETH_LAST) != 0
    ackreq = 1 if (umem[bo + 8] & 0x80) else 0
    ce = 1 if ce_marked(umem, l3) else 0
    sport = get_be(umem, l3 + (40 if (umem[l3] >> 4) == 6 else 20), 2)
    e0 = rx[NL.R_EPSN]
    d = (psn - e0) & PSN_MASK
    kq = np.int64(0)
    if recv and d < NL.PSN_HALF:                     # not a duplicate of a completed PSN
        rq_head = Q[qi, Q_RQ_HEAD]
        kq = rx_rsn_check(rx, A[b + O_RM:b + O_RM + NL.WMAX * NL.NRM].reshape((NL.WMAX, NL.NRM)), par, rsn, msn,
                          last_psn, ld_acq_i64(Q[qi], Q_RQ_TAIL) - rq_head)
        if kq == RSN_INVALID:                        # MR-OOO-026
            nx[X_C_RSN_INV] += 1
            A[P_RX_DROP_STATE] += 1
            return
        if kq == RSN_NOT_READY:                      # MR-OOO-012: not recorded; comes again
            rx_on_not_ready(rx, ce, 1, tsval, sport, now)
            nx[X_C_NOTREADY] += 1
            if off == 0 and d == 0:
                # MR-SACK-035: the RNR NAK-type SACK names the message's first PSN once it is the ePSN (and
                # again for each copy of it while not ready); a later first PSN gets it when retransmitted
                nat_send_sack(A, Q, TM, umem, tables, qi, b, RNR_SYN | (Q[qi, Q_MIN_RNR] & 0x1F), psn)
            return
    src = A[P_UMEM_ADDR] + h
    mr = np.int64(0)
    if is_write and d < NL.PSN_HALF and d < par[NL.P_W] and plen > 0:
        mr = mr_check(MRT, rkey, Q[qi, Q_PD], va + off, plen, ACC_REMOTE_WRITE)
        if mr < 0 or (Q[qi, Q_ACCESS] & ACC_REMOTE_WRITE) == 0:
            nat_fail(A, Q, SW, CQT, CE, TM, umem, tables, qi, b, NAK_REM_ACCESS, psn, EV_QP_ACCESS_ERR, 22)
            return
    rr = np.int64(0)
    if recv and d < NL.PSN_HALF:
        rr = Q[qi, Q_RQ_BASE] + ((Q[qi, Q_RQ_HEAD] + kq) & (Q[qi, Q_RQ_SIZE] - 1))
        if not is_write and off + plen > RW[rr, R_LENGTH]:
            # longer than the receive buffer (MR-RC-017): the RECV fails, invalid request
            push_cqe(A, Q, CQT, CE, Q[qi, Q_RECV_CQ], qi, RW[rr, R_WR_ID], S_LOC_LEN, WC_RECV, 0, 0, 0)
            nat_fail(A, Q, SW, CQT, CE, TM, umem, tables, qi, b, NAK_INV_REQ, psn, EV_QP_REQ_ERR, 24)
            return
        if not is_write and plen and ((RW[rr, R_LMR] and A[A[P_MR_OFF] + RW[rr, R_LMR] * NM + M_VALID] == 0)
                                      or not sg_valid(A, RW[rr, R_SG], RW[rr, R_NSGE])):
            push_cqe(A, Q, CQT, CE, Q[qi, Q_RECV_CQ], qi, RW[rr, R_WR_ID], S_LOC_PROT, WC_RECV, 0, 0, 0)
            nat_fail(A, Q, SW, CQT, CE, TM, umem, tables, qi, b, 0x63, psn, EV_QP_FATAL, 26)
            return
    res = rx_on_packet(rx, par, psn, ackreq, ce, 1, tsval, sport, now)
    if res & RX_OOW:
        nx[X_C_OOW] += 1
        return
    if res & RX_NEW:
        if d != 0:
            nx[X_C_OOO] += 1                         # placed out of order (MR-OOO-001)
        if plen:
            if is_write:
                place(A, va + off, 0, 0, 0, src, plen)
            else:
                place(A, RW[rr, R_LADDR], RW[rr, R_SG], RW[rr, R_NSGE], off, src, plen)
        nx[X_C_PLACED] += 1
        nx[X_C_RX_BYTES] += plen
        A[P_RX_BYTES] += plen
        if lastp:
            A[b + O_LM + (psn & NL.WMASK)] = psn + 1        # a message ends here (MR-SACK-003's MSN)
            if recv:
                x = b + O_RMX + (rsn & NL.WMASK) * NRMX
                A[x] = mlen
                A[x + 1] = imm
                A[x + 2] = (1 if has_imm else 0) | (2 if (umem[bo + 1] & 0x80) else 0) | (4 if is_write else 0)
    else:
        nx[X_C_DUP] += 1
        A[P_RX_DUP] += 1
    e1 = rx[NL.R_EPSN]
    if e1 != e0:
        p = e0
        m = nx[X_R_MSN]
        while p != e1:
            lm = b + O_LM + (p & NL.WMASK)
            if A[lm] == p + 1:
                m += 1
                A[lm] = 0
            p = (p + 1) & PSN_MASK
        nx[X_R_MSN] = m & PSN_MASK
        Q[qi, Q_MSN] = m & PSN_MASK
        Q[qi, Q_EPSN] = e1
        out = A[b + O_OUT:b + O_OUT + 64]
        rm = A[b + O_RM:b + O_RM + NL.WMAX * NL.NRM].reshape((NL.WMAX, NL.NRM))
        while True:
            n = rx_recv_completions(rx, rm, out)     # in receive WQE order (MR-OOO-013/014)
            for i in range(n):
                x = b + O_RMX + (out[i] & NL.WMASK) * NRMX
                r = Q[qi, Q_RQ_BASE] + (Q[qi, Q_RQ_HEAD] & (Q[qi, Q_RQ_SIZE] - 1))
                f = A[x + 2]
                push_cqe(A, Q, CQT, CE, Q[qi, Q_RECV_CQ], qi, RW[r, R_WR_ID], S_OK,
                         WC_RECV_IMM if f & 4 else WC_RECV, A[x], A[x + 1],
                         (WCF_IMM if f & 1 else 0) | (CQE_SOLICITED if f & 2 else 0))
                Q[qi, Q_RQ_HEAD] += 1
            if n < 64:
                break
        comm_est(A, Q, qi, st, e0)
    if res & RX_SACK_NOW:
        nat_send_sack(A, Q, TM, umem, tables, qi, b, AETH_ACK_SYN, -1)
    activate(A, Q, qi)


# ============================================================================ per QP, per round
@njit(**_jit)
def nat_qp(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, qi, now, budget):
    """A native QP's turn in the round: the coalescing timer's SACK (MR-SACK-015/017), the timers and
    the requester.  Returns packets sent | (still busy << 32)."""
    b = slot_base(A, nat_slot(A, qi))
    par, rx, s, nx, sb, pt = rows(A, b)
    sent = 0
    if nx[X_SACK_OWED] or rx_sack_due(rx, par, now):
        if nat_send_sack(A, Q, TM, umem, tables, qi, b, AETH_ACK_SYN, -1):
            sent += 1
    st = Q[qi, Q_STATE]
    if st == ST_RTS or st == ST_SQD:
        sent += nat_timers(A, Q, SW, CQT, CE, TM, umem, tables, qi, b, now)
        if Q[qi, Q_STATE] == ST_RTS or Q[qi, Q_STATE] == ST_SQD:
            sent += nat_requester(A, Q, SW, TM, umem, tables, qi, b, now, budget)
            if Q[qi, Q_LOCERR]:
                why = Q[qi, Q_LOCERR]
                Q[qi, Q_LOCERR] = 0
                qp_error(A, Q, SW, CQT, CE, qi, S_LOC_PROT, EV_QP_FATAL, why)
        if Q[qi, Q_SQD_DRAIN]:
            sqd_check(A, Q, SW, qi)
    if Q[qi, Q_STATE] == ST_ERR:
        flush_queues(A, Q, SW, RW, CQT, CE, qi)
    busy = rx[NL.R_SINCE_SACK] > 0 or nx[X_SACK_OWED] != 0 or \
        (Q[qi, Q_STATE] != ST_ERR and Q[qi, Q_SQ_HEAD] != ld_acq_i64(Q[qi], Q_SQ_TAIL))
    return sent | ((1 if busy else 0) << 32)


# ============================================================================ control plane (Python)
class NativeSlots:
    """The native region of a port's arena and its slots (dp.context.Plane owns one)."""

    def __init__(self, A: np.ndarray, off: int, maxq: int) -> None:
        self.A, self.off, self.maxq = A, off, maxq
        self.natq = A[off:off + maxq]
        self.base = off + ((maxq + 7) & ~7)
        ext = self.base + NSLOT * SLOT_WORDS
        A[P_NAT_OFF] = off
        A[P_NAT_EXT] = int(A.ctypes.data) + ext * 8
        self.free = list(range(NSLOT - 1, -1, -1))
        self.par_kw: dict[int, dict] = {}

    def _w(self, sl: int, o: int, n: int) -> np.ndarray:
        b = self.base + sl * SLOT_WORDS + o
        return self.A[b:b + n]

    def rows(self, qi: int):
        sl = int(self.natq[qi]) - 1
        if sl < 0:
            return None
        return (self._w(sl, O_PAR, NL.NPAR), self._w(sl, O_RX, NL.NRX), self._w(sl, O_TX, NL.NTX),
                self._w(sl, O_NX, NNX), self._w(sl, O_PT, NL.KMAX * NL.NPT).reshape(NL.KMAX, NL.NPT),
                self._w(sl, O_SP, NL.KMAX))

    def attach(self, qi: int, rq_psn: int, **params) -> None:
        """QP qi runs the native profile from RTR (MR-NAT-003): a slot, the parameters, rx_init."""
        if int(self.natq[qi]):
            self.detach(qi)
        par_row = NL.params(**params)
        if not self.free:
            from .context import Unsupported
            raise Unsupported(f"at most {NSLOT} native QPs per port")
        sl = self.free.pop()
        b = self.base + sl * SLOT_WORDS
        self.A[b:b + SLOT_WORDS] = 0
        self._w(sl, O_PAR, NL.NPAR)[:] = par_row
        rx_init(self._w(sl, O_RX, NL.NRX), self._w(sl, O_PAR, NL.NPAR), rq_psn & PSN_MASK)
        self.natq[qi] = sl + 1

    def start(self, qi: int, sq_psn: int, sport: int, now: int, tm: np.ndarray | None = None,
              l3: int = -1) -> None:
        """RTS: the requester's state (04 4.3.5, 05 5.2) and K entropy values around the QP's port.
        tm, l3: the QP's header template and, for IPv6, its IP header's offset: the flow label key is
        a keyed hash of the template (addresses, QPNs, ports) under a per-QP random secret (MR-MP-016),
        and the template starts on entropy value 0 (port and label) for the SACKs sent before any
        request."""
        import hashlib
        import secrets
        par, rx, s, nx, pt, sp = self.rows(qi)
        tx_init(s, par, sq_psn & PSN_MASK, now)
        k = int(par[NL.P_K])
        for i in range(k):
            sp[i] = 0xC000 | ((sport + 0x101 * i) & 0x3FFF)           # MR-MP-002: distinct ports
        mp_init(pt, par, sp)
        seen = bytes(tm) if tm is not None else b""
        key = hashlib.blake2b(seen, key=secrets.token_bytes(16), digest_size=8).digest()
        nx[X_FL_KEY] = int.from_bytes(key, "little") >> 1
        if tm is not None and l3 >= 0:
            fl = flow_label.py_func(int(nx[X_FL_KEY]), int(sp[0]))
            tm[l3 + 40:l3 + 42] = (int(sp[0]) >> 8, int(sp[0]) & 0xFF)
            tm[l3 + 1] = (int(tm[l3 + 1]) & 0xF0) | (fl >> 16)
            tm[l3 + 2:l3 + 4] = ((fl >> 8) & 0xFF, fl & 0xFF)

    def detach(self, qi: int) -> None:
        sl = int(self.natq[qi]) - 1
        if sl >= 0:
            self.natq[qi] = 0
            self.free.append(sl)

    def counters(self, qi: int) -> dict:
        r = self.rows(qi)
        if r is None:
            return {}
        par, rx, s, nx, pt, sp = r
        out = {n: int(nx[i]) for i, n in enumerate(NX_FIELDS) if n.startswith("c_")}
        out.update({n: int(s[getattr(NL, "S_" + n.upper())]) for n in NL.TX_FIELDS if n.startswith("c_")})
        out.update({"rx_" + n: int(rx[getattr(NL, "R_" + n.upper())]) for n in NL.RX_FIELDS if n.startswith("c_")})
        out.update(srtt_ns=int(s[NL.S_SRTT]), rto_ns=int(s[NL.S_RTO]), cwnd=int(s[NL.S_CWND]) / NL.FP,
                   snd_una=int(s[NL.S_SND_UNA]), snd_nxt=int(s[NL.S_SND_NXT]), epsn=int(rx[NL.R_EPSN]))
        return out
