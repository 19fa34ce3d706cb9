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

READ and atomics (MR-OOO-016..028): see the section "READ and atomics" below; slot rows RQ (the
requester's outstanding READ request messages and atomics), RS (the responder's resources) and JB
(the responder's jobs: READ responses and ATOMIC_ACKNOWLEDGEs to send).
NATIVE_SACKs mostly never reach the AF_XDP socket: the XDP program verifies their ICRC and puts them,
as received, in the QP's ring of its mr_sacks map (bpf/metaroce_xdp.c mr_sack_push, MR-SACK-043);
`nat_kern_sacks` drains the rings at the start of each round into the same `nat_on_sack` a SACK from
the socket goes to.  A SACK whose ring is full still comes through the socket (and every SACK does
with METAROCE_XDP_SACKS=0).

The profile is chosen at RTR (QPAttr.profile; dp/cmconnect.py negotiates it).
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
                               rx_init, rx_on_not_ready, rx_on_packet, rx_on_range, rx_recorded, rx_recv_completions,
                               rx_rsn_check)
from ..native.sender import (ACT_FAIL, ACT_RTO, ACT_TLP, TK_NEW, TK_RETX, TK_RTO, TK_TLP, tsval_of,  # noqa: E402
                             tx_can_send, tx_init, tx_next_deadline, tx_next_lost, tx_on_rnr_nak, tx_on_sack,
                             tx_on_timer, tx_on_transmit)
from ..native.sender import rd_on_loss, rd_on_response, reo_wnd  # noqa: E402
from ..native.rdpace import (NRP, RP_C_PACED, RP_C_SHARED, RP_C_WAIT, RP_PEND, RP_SHARE, RP_SHARE_MIN,  # noqa: E402
                             rpace_may_send, rpace_on_sent, rpace_pending)
from .layout import *  # noqa: F401,F403,E402
from .layout import N_P, NM, PSN_MASK, PSN_NONE  # noqa: E402
from .reasons import (WHY_IMMDT_DIFFERS, WHY_LOCAL_MR_DEREGISTERED, WHY_OPCODE_SEQUENCE, WHY_RECV_MR_INVALID,
                      WHY_REMOTE_ACCESS, WHY_RETRY_EXHAUSTED, WHY_RNR_RETRY_EXHAUSTED, WHY_SEND_TOO_LONG,
                      WHY_SGE_LOCAL_CHECK)
from .loop import (ACC_REMOTE_WRITE, EV_QP_ACCESS_ERR, EV_QP_FATAL, EV_QP_REQ_ERR, S_LOC_LEN, S_LOC_PROT,  # noqa: E402
                   S_OK, S_RETRY_EXC, S_RNR_EXC, ST_RTR, ST_RTS, ST_SQD, ST_SQE, ST_ERR, WC_RECV, WC_RECV_IMM,
                   WR_SEND, WR_SEND_IMM, WR_WRITE, WR_WRITE_IMM, F_SOLICITED, WCF_IMM, AETH_ACK_SYN, NAK_INV_REQ,
                   NAK_REM_ACCESS, RNR_SYN, activate, advance, emit, flush_queues, get_be, mr_check,
                   nak_error_due, push_cqe, put_be, qp_error, sq_row)
from .ops import FRAME_TO_WIRE  # noqa: E402
from .ops import CQE_SOLICITED, F_FENCE, ce_marked, comm_est, place, sg_valid, sqd_check, src_of  # noqa: E402
from .loop import ACC_REMOTE_READ, WR_READ  # noqa: E402
from .loop import mr_live, mr_live_a  # noqa: E402  (MR references, checked on use: MR-SEC-003)
from .ops import (ACC_REMOTE_ATOMIC, OP_ATOMIC_ACK, OP_CAS, OP_FAA, WR_CAS, WR_FAA, atomic_request,  # noqa: E402
                  rd_atomic, retire_answered)
from .prims import ld_acq_i64, ptr_u8, ptr_u64  # noqa: E402
from .prims import ld_acq_u32, ld_acq_u64, st_rel_u32, st_rel_u64  # noqa: E402
from .prims import add_i64  # noqa: E402
from ..kern.layout import MR_SACK_RING_LEN, SACK_REC_DTYPE, SACK_RING_DTYPE  # noqa: E402

_jit = dict(cache=True, nogil=True)

# port scalars beyond P_FIELDS (layout.py keeps N_P - 32 words for them)
P_NAT_OFF = N_P - 1          # offset of the native region in the arena (0: the port has none)
P_NAT_EXT = N_P - 2          # raw address of the 512-byte header scratch (SACK bitmaps exceed loop's 32)
NSLOT = 16                   # native QPs per port
EXT_BYTES = 512

OP_N_SEND, OP_N_SEND_IMM, OP_N_WRITE, OP_N_WRITE_IMM, OP_N_READ_REQ, OP_N_READ_RESP, OP_N_SACK = range(0xC0, 0xC7)
NETH_FIRST, NETH_LAST, NETH_RETX = 0x80, 0x40, 0x20

NX_FIELDS = """msn_next rsn_next cur_msn cur_rsn r_msn sack_owed c_tx c_retx c_rto c_tlp c_sack_tx c_sack_rx
               c_sack_bad c_ooo c_dup c_oow c_notready c_rsn_inv c_bad_len c_placed c_rx_bytes
               rd_prog jb_head jb_tail rs_next rs_held c_rd_req c_rd_resp_rx c_rd_resp_dup c_rd_bad c_rereq
               c_rd_rto c_at_replay c_rd_resp_tx c_rereq_rx c_rd_dup_drop c_rd_exec c_at_exec c_at_ack_rx
               c_at_ack_bad rd_out c_sack_nak_seq err_syn err_psn err_why c_err_held c_imm_inv rq_seq
               c_rereq_queued rd_gap rd_last rd_rto""".split()
# columns of NX_FIELDS (prefix X_): generated by scripts/gen_columns.py
X_MSN_NEXT = 0
X_RSN_NEXT = 1
X_CUR_MSN = 2
X_CUR_RSN = 3
X_R_MSN = 4
X_SACK_OWED = 5
X_C_TX = 6
X_C_RETX = 7
X_C_RTO = 8
X_C_TLP = 9
X_C_SACK_TX = 10
X_C_SACK_RX = 11
X_C_SACK_BAD = 12
X_C_OOO = 13
X_C_DUP = 14
X_C_OOW = 15
X_C_NOTREADY = 16
X_C_RSN_INV = 17
X_C_BAD_LEN = 18
X_C_PLACED = 19
X_C_RX_BYTES = 20
X_RD_PROG = 21
X_JB_HEAD = 22
X_JB_TAIL = 23
X_RS_NEXT = 24
X_RS_HELD = 25
X_C_RD_REQ = 26
X_C_RD_RESP_RX = 27
X_C_RD_RESP_DUP = 28
X_C_RD_BAD = 29
X_C_REREQ = 30
X_C_RD_RTO = 31
X_C_AT_REPLAY = 32
X_C_RD_RESP_TX = 33
X_C_REREQ_RX = 34
X_C_RD_DUP_DROP = 35
X_C_RD_EXEC = 36
X_C_AT_EXEC = 37
X_C_AT_ACK_RX = 38
X_C_AT_ACK_BAD = 39
X_RD_OUT = 40
X_C_SACK_NAK_SEQ = 41
X_ERR_SYN = 42
X_ERR_PSN = 43
X_ERR_WHY = 44
X_C_ERR_HELD = 45
X_C_IMM_INV = 46
X_RQ_SEQ = 47
X_C_REREQ_QUEUED = 48
X_RD_GAP = 49
X_RD_LAST = 50
X_RD_RTO = 51
# end of NX_FIELDS columns
NNX = 56
X_FL_KEY = NNX - 1           # the QP's flow label key (MR-MP-016, NativeSlots.start)
assert len(NX_FIELDS) < X_FL_KEY
NSBX = 4                     # send queue index, packet index k, the message's MSN and RSN
NRMX = 4                     # message length, immediate, flags (1 imm, 2 solicited, 4 WRITE_IMM), first ImmDt

# READ and atomics (MR-OOO-016..028).  Requester row per outstanding READ request message or atomic:
RQ_FIELDS = "kind psn n msn wi k0 blen got lo hi gap_ts rr_ts acked_ts req_ts seq".split()
# columns of RQ_FIELDS (prefix RQ_): generated by scripts/gen_columns.py
RQ_KIND = 0
RQ_PSN = 1
RQ_N = 2
RQ_MSN = 3
RQ_WI = 4
RQ_K0 = 5
RQ_BLEN = 6
RQ_GOT = 7
RQ_LO = 8
RQ_HI = 9
RQ_GAP_TS = 10
RQ_RR_TS = 11
RQ_ACKED_TS = 12
RQ_REQ_TS = 13
RQ_SEQ = 14
# end of RQ_FIELDS columns
RQ_BM = 16                   # then WMAX / 64 words: response PSNs received (bit i = PSN psn + i)
RQ_STRIDE = RQ_BM + NL.WMAX // 64
NRQ = 16                     # >= max_rd_atomic (MR-OOO-028)
K_READ, K_ATOMIC = 1, 2
# responder resource (MR-OOO-022..024): state 1 held (not executed yet), 2 executed; ord: execution number
RS_FIELDS = "state kind psn n msn va rkey len op swap cmp orig amsn ord".split()
# columns of RS_FIELDS (prefix RS_): generated by scripts/gen_columns.py
RS_STATE = 0
RS_KIND = 1
RS_PSN = 2
RS_N = 3
RS_MSN = 4
RS_VA = 5
RS_RKEY = 6
RS_LEN = 7
RS_OP = 8
RS_SWAP = 9
RS_CMP = 10
RS_ORIG = 11
RS_AMSN = 12
RS_ORD = 13
# end of RS_FIELDS columns
RS_STRIDE = 16
NRS = 16                     # max_dest_rd_atomic (dp/layout.py MAX_RD)
RS_HELD, RS_DONE = 1, 2
# responder job: READ responses [i, iend) of the READ at psn0, or an ATOMIC_ACKNOWLEDGE
JB_FIELDS = "kind psn0 i iend msn va len mr retx orig amsn".split()
# columns of JB_FIELDS (prefix JB_): generated by scripts/gen_columns.py
JB_KIND = 0
JB_PSN0 = 1
JB_I = 2
JB_IEND = 3
JB_MSN = 4
JB_VA = 5
JB_LEN = 6
JB_MR = 7
JB_RETX = 8
JB_ORIG = 9
JB_AMSN = 10
# end of JB_FIELDS columns
JB_STRIDE = 12
NJB = 64

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
O_RQ = O_OUT + 64            # READ requests and atomics owed a response (requester), NRQ rows
O_RS = O_RQ + NRQ * RQ_STRIDE    # responder resources: the last READ and atomic requests, NRS rows
O_JB = O_RS + NRS * RS_STRIDE    # responder jobs: READ responses and ATOMIC_ACKNOWLEDGEs to send, NJB rows
O_TXR = O_JB + NJB * JB_STRIDE  # the READ window's state (MR-CC-019): a requester row of its own
O_RP = O_TXR + NL.NTX        # READ response pacing (MR-CC-021): native/rdpace.py's row
SLOT_WORDS = (O_RP + NRP + 7) & ~7
# words of the port the loops of all its RX queues share, after the slots and the header scratch:
# the link rate READ responses are paced at (bits/s, 0: not paced) and how many of the port's QPs have
# responses pending (MR-CC-021), counted as they gain and lose them (nat_rd_pend)
PW_RATE, PW_NPEND = 0, 1
NPW = 8


def region_words(maxq: int) -> int:
    return ((maxq + 7) & ~7) + NSLOT * SLOT_WORDS + EXT_BYTES // 8 + NPW


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
def rd_row(A, b):
    """The READ window's copy of the congestion state of 05 section 5.2 (MR-CC-019), a requester row of
    which only the window, RTT, ECN and decrease fields are used."""
    return A[b + O_TXR:b + O_TXR + NL.NTX]


@njit(**_jit)
def rp_row(A, b):
    """The QP's READ response pacing row (native/rdpace.py, MR-CC-021)."""
    return A[b + O_RP:b + O_RP + NRP]


@njit(**_jit)
def pw_base(A):
    """The port words the RX-queue loops share (PW_*)."""
    return A[P_NAT_OFF] + ((A[P_MAXQ] + 7) & ~7) + NSLOT * SLOT_WORDS + EXT_BYTES // 8


@njit(**_jit)
def nat_rd_pend(A, b, nx):
    """The port's count of QPs with responses pending follows this QP's job queue (MR-CC-021): +1 when
    it turned non-empty, -1 when it emptied -- O(1), no scan over the QPs."""
    d = rpace_pending(rp_row(A, b), 1 if nx[X_JB_HEAD] != nx[X_JB_TAIL] else 0)
    if d != 0:
        add_i64(A, pw_base(A) + PW_NPEND, d)


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
def count_tx(A, nx, kind):
    """A request packet left: counted per QP, and as a retransmission (QP and port) unless new."""
    nx[X_C_TX] += 1
    if kind != TK_NEW:
        nx[X_C_RETX] += 1
        A[P_RETRANSMITS] += 1


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
    if op == WR_READ or op == WR_CAS or op == WR_FAA:
        return nat_tx_rd(A, Q, SW, TM, umem, tables, qi, b, psn, kind, now)
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
    count_tx(A, nx, kind)
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
def more_follows(Q, s, qi, nxt, sent, budget):
    """MR-NAT-023: the message ending with the packet about to leave is followed at once by another
    packet of this burst -- a further work request is queued, the budget has room and the window will
    after this packet -- so its AckReq may stay clear: the responder's coalescing (MR-SACK-015, at most
    ack_n packets or ack_t) acknowledges both.  (Pacing may still hold the next one; ack_t bounds the
    wait.)"""
    if sent + 1 >= budget or nxt + 1 == ld_acq_i64(Q[qi], Q_SQ_TAIL):
        return False
    c = s[NL.S_CWND] if s[NL.S_CWND] > NL.FP else NL.FP
    return (s[NL.S_IN_FLIGHT] + 1) * NL.FP < c


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
        if (lmr and not mr_live_a(A, lmr)) or not sg_valid(A, SW[r, W_SG], SW[r, W_NSGE]):
            if nxt == Q[qi, Q_SQ_HEAD]:              # MR-MEM-035, as the compat requester
                SW[r, W_STARTED] = 1
                Q[qi, Q_LOCERR] = WHY_SGE_LOCAL_CHECK if lmr == MR_BAD else WHY_LOCAL_MR_DEREGISTERED
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
            if op == WR_SEND or op == WR_SEND_IMM or op == WR_WRITE_IMM:    # MR-NAT-025
                nx[X_RSN_NEXT] = (nx[X_RSN_NEXT] + 1) & PSN_MASK
            if rd_atomic(op):
                Q[qi, Q_RD_OUT] += 1
        if rd_atomic(op):                            # READ request messages and atomics (MR-OOO-016..028)
            if not nat_rd_issue(A, Q, SW, TM, umem, tables, qi, b, nxt, r, now):
                break
            sent += 1
            Q[qi, Q_SND_PSN] = s[NL.S_SND_NXT]
            Q[qi, Q_SND_MAX] = s[NL.S_SND_NXT]
            if SW[r, W_SENT] >= SW[r, W_NPSN]:
                Q[qi, Q_SQ_NEXT] = nxt + 1
            continue
        k = SW[r, W_SENT]
        npsn = SW[r, W_NPSN]
        psn = (SW[r, W_FIRST_PSN] + k) & PSN_MASK
        j = b + O_SBX + (psn & NL.WMASK) * NSBX
        A[j] = nxt
        A[j + 1] = k
        A[j + 2] = nx[X_CUR_MSN]
        A[j + 3] = nx[X_CUR_RSN]
        last = k == npsn - 1
        if not nat_tx_packet(A, Q, SW, TM, umem, tables, qi, b, psn, TK_NEW,
                             1 if last and not more_follows(Q, s, qi, nxt, sent, budget) else 0, now):
            break                                    # MR-NAT-023: AckReq on the last packet of a burst
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
        qp_error(A, Q, SW, CQT, CE, qi, S_RETRY_EXC, EV_QP_FATAL, WHY_RETRY_EXHAUSTED)
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
    syn = np.int64(umem[h]) & 0x7F                   # MR-SACK-038: bit 7 of every syndrome is ignored
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
            qp_error(A, Q, SW, CQT, CE, qi, S_RNR_EXC, EV_QP_FATAL, WHY_RNR_RETRY_EXHAUSTED)
            return
    elif typ == 3:
        if syn == 0x60 or syn == 0x64:               # MR-SACK-033: never sent on a native QP: discarded, counted
            nx[X_C_SACK_NAK_SEQ] += 1
            return
        una = s[NL.S_SND_UNA]
        if not ((psn == una or 0 < ((psn - una) & PSN_MASK) < NL.PSN_HALF)
                and 0 < ((s[NL.S_SND_NXT] - psn) & PSN_MASK) < NL.PSN_HALF):
            s[NL.S_C_SACK_INV] += 1                  # MR-SACK-034 / MR-SACK-019: BTH.PSN outside [snd_una, snd_nxt - 1]
            return
        tx_on_sack(s, sb, pt, par, (psn - 1) & PSN_MASK, 0, words, tsecr, flags, ce_count, credit, sport, now)
        Q[qi, Q_NERR_PSN] = psn + 1
        Q[qi, Q_NERR_CODE] = syn & 0x1F
    else:
        nx[X_C_SACK_BAD] += 1
        return
    advance(A, Q, SW, CQT, CE, qi, s[NL.S_SND_UNA], now)
    if Q[qi, Q_NERR_PSN]:
        nak_error_due(A, Q, SW, CQT, CE, qi)


# ============================================================================ SACKs the kernel consumed
# struct mr_sack_ring / mr_sack_rec offsets (kern/layout.py, checked against the C header)
SR_CONS = SACK_RING_DTYPE.fields["cons"][1]
SR_OWNER = SACK_RING_DTYPE.fields["owner"][1]
SR_SLEEPING = SACK_RING_DTYPE.fields["sleeping"][1]
SR_DRAINED = SACK_RING_DTYPE.fields["drained"][1]
SR_DISCARDED = SACK_RING_DTYPE.fields["discarded"][1]
SR_REC = SACK_RING_DTYPE.fields["rec"][1]
SREC_SIZE = SACK_REC_DTYPE.itemsize
SREC_SEQ = SACK_REC_DTYPE.fields["seq"][1]
SREC_TS = SACK_REC_DTYPE.fields["ts_ns"][1]
SREC_QPN = SACK_REC_DTYPE.fields["qpn"][1]
SREC_LEN = SACK_REC_DTYPE.fields["len"][1]
SREC_RAW = SACK_REC_DTYPE.fields["raw"][1]
SR_MASK = MR_SACK_RING_LEN - 1
SACK_MIN = 12 + 4 + 12                       # BTH, AETH, SACKETH


@njit(**_jit)
def own_ring(A, Q, ri):
    """(address, QP index) of mr_sacks ring ri when this loop drains it: its owner is a QP on this loop's
    RX queue; (0, -1) when the ring has no owner or another queue's loop drains it."""
    r = A[P_SR_ADDR] + ri * A[P_SR_SIZE]
    qi = ld_acq_u32(r + SR_OWNER) - 1
    if qi < 0 or qi >= A[P_MAXQ] or Q[qi, Q_PLANE] != A[P_QUEUE]:
        return 0, -1
    return r, qi


@njit(**_jit)
def nat_kern_sacks(A, Q, SW, CQT, CE, now):
    """The NATIVE_SACKs the XDP program put in the mr_sacks rings (MR-SACK-043; the protocol is struct
    mr_sack_ring's): each ring whose owner QP this loop runs, drained in ring order into nat_on_sack, as
    nat_rx hands it a SACK from the AF_XDP socket -- the same state check first, the same arguments
    (`now` the round's clock), the same counters.  A record is judged against the requester state of
    now (MR-SACK-019, MR-SACK-037); none waits longer than a frame in the socket's ring would (while
    the loop sleeps the kernel steers SACKs to the socket: nat_kern_sleep).  Records of another QPN
    (the slot's previous QP) or uncopied are discarded, counted.  Returns the records taken."""
    if A[P_SR_ADDR] == 0 or A[P_NAT_OFF] == 0:
        return 0
    n = 0
    for ri in range(A[P_SR_N]):
        r, qi = own_ring(A, Q, ri)
        if r == 0:
            continue
        cons = ld_acq_u64(r + SR_CONS)
        while True:
            e = r + SR_REC + (cons & SR_MASK) * SREC_SIZE
            if ld_acq_u64(e + SREC_SEQ) != cons + 1:
                break                                # empty, or the kernel is still writing it
            ln = ld_acq_u32(e + SREC_LEN)
            sl = nat_slot(A, qi)
            st = Q[qi, Q_STATE]
            if ln < SACK_MIN or sl < 0 or ld_acq_u32(e + SREC_QPN) != Q[qi, Q_QPN]:
                A[P_RX_SACK_KERN_DROP] += 1
                st_rel_u64(r + SR_DISCARDED, ld_acq_u64(r + SR_DISCARDED) + 1)
            elif st != ST_RTS and st != ST_SQD and st != ST_SQE:
                A[P_RX_DROP_STATE] += 1              # as nat_rx
                st_rel_u64(r + SR_DISCARDED, ld_acq_u64(r + SR_DISCARDED) + 1)
            else:
                raw = carray(ptr_u8(e + SREC_RAW), (ln,))
                psn = (np.int64(raw[9]) << 16) | (np.int64(raw[10]) << 8) | raw[11]
                nat_on_sack(A, Q, SW, CQT, CE, raw, qi, slot_base(A, sl), psn, 0, ln, now)
                activate(A, Q, qi)
                A[P_RX_SACK_KERN] += 1
                st_rel_u64(r + SR_DRAINED, ld_acq_u64(r + SR_DRAINED) + 1)
            cons += 1
            st_rel_u64(r + SR_CONS, cons)            # the position is free for the kernel again
            n += 1
    return n


@njit(**_jit)
def nat_kern_sleep(A, Q, on):
    """The loop is about to sleep in poll() (on = 1) or woke (0): the `sleeping` word of each ring it
    drains, so that meanwhile the kernel steers its QPs' SACKs to the socket, whose frame wakes it.
    With on = 1, returns the records the rings already hold (then the loop must not sleep: they came
    before the flag could be seen)."""
    if A[P_SR_ADDR] == 0 or A[P_NAT_OFF] == 0:
        return 0
    n = 0
    for ri in range(A[P_SR_N]):
        r = own_ring(A, Q, ri)[0]
        if r == 0:
            continue
        st_rel_u32(r + SR_SLEEPING, on)
        if on:
            cons = ld_acq_u64(r + SR_CONS)
            if ld_acq_u64(r + SR_REC + (cons & SR_MASK) * SREC_SIZE + SREC_SEQ) == cons + 1:
                n += 1
    return n


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
def nat_nak_error(A, Q, SW, RW, CQT, CE, TM, umem, tables, qi, b, syn, psn, why):
    """The error found on request PSN psn, now the ePSN: the receive WQE of a SEND that did not fit its
    buffer (why 24) or whose buffer failed the local checks (why 26) completes with the error -- it is the
    oldest one left, every earlier message having completed -- then the NAK-type SACK and ERR."""
    if (why == WHY_SEND_TOO_LONG or why == WHY_RECV_MR_INVALID) and Q[qi, Q_RQ_HEAD] != ld_acq_i64(Q[qi], Q_RQ_TAIL):
        rr = Q[qi, Q_RQ_BASE] + (Q[qi, Q_RQ_HEAD] & (Q[qi, Q_RQ_SIZE] - 1))
        push_cqe(A, Q, CQT, CE, Q[qi, Q_RECV_CQ], qi, RW[rr, R_WR_ID], S_LOC_LEN if why == WHY_SEND_TOO_LONG else S_LOC_PROT,
                 WC_RECV, 0, 0, 0)
        Q[qi, Q_RQ_HEAD] += 1
    ev = EV_QP_ACCESS_ERR if why == WHY_REMOTE_ACCESS else (EV_QP_FATAL if why == WHY_RECV_MR_INVALID else EV_QP_REQ_ERR)
    nat_fail(A, Q, SW, CQT, CE, TM, umem, tables, qi, b, syn, psn, ev, why)


@njit(**_jit)
def nat_error(A, Q, SW, RW, CQT, CE, TM, umem, tables, qi, b, syn, psn, why):
    """An error (invalid request, remote access error, remote operational error) found on arrival of the
    request at PSN psn, in the window (MR-SACK-031): NAKed at once when psn is the ePSN, else remembered
    against psn -- which is not recorded as received, so no SACK reports it -- and NAKed by nat_error_due
    once every PSN before it has come.  Only the lowest PSN with an error is kept: its NAK ends the QP,
    so the NAK of a later one could never be sent."""
    par, rx, s, nx, sb, pt = rows(A, b)
    if psn == rx[NL.R_EPSN]:
        nat_nak_error(A, Q, SW, RW, CQT, CE, TM, umem, tables, qi, b, syn, psn, why)
        return
    nx[X_C_ERR_HELD] += 1
    if nx[X_ERR_SYN] == 0 or ((psn - nx[X_ERR_PSN]) & PSN_MASK) >= NL.PSN_HALF:
        nx[X_ERR_SYN] = syn
        nx[X_ERR_PSN] = psn
        nx[X_ERR_WHY] = why


@njit(**_jit)
def nat_error_due(A, Q, SW, RW, CQT, CE, TM, umem, tables, qi, b):
    """MR-SACK-031: the ePSN moved; the error remembered against a PSN is NAKed once that PSN is the ePSN
    (or was passed: a READ's range recorded it).  True when the QP failed."""
    par, rx, s, nx, sb, pt = rows(A, b)
    if nx[X_ERR_SYN] == 0:
        return False
    d = (nx[X_ERR_PSN] - rx[NL.R_EPSN]) & PSN_MASK
    if d != 0 and d < NL.PSN_HALF:
        return False
    syn = nx[X_ERR_SYN]
    nx[X_ERR_SYN] = 0
    nat_nak_error(A, Q, SW, RW, CQT, CE, TM, umem, tables, qi, b, syn, nx[X_ERR_PSN], nx[X_ERR_WHY])
    return True


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
    if op == OP_N_READ_RESP or op == OP_ATOMIC_ACK:  # the requester's READ responses and atomic results
        if st != ST_RTS and st != ST_SQD and st != ST_SQE:
            A[P_RX_DROP_STATE] += 1
            return
        if op == OP_N_READ_RESP:
            nat_on_read_resp(A, Q, SW, CQT, CE, umem, qi, b, psn, bo, end, pad, 1 if ce_marked(umem, l3) else 0,
                             now)
        else:
            nat_on_atomic_ack(A, Q, SW, CQT, CE, umem, qi, b, psn, bo, end, pad, now)
        activate(A, Q, qi)
        return
    if op == OP_N_READ_REQ or op == OP_CAS or op == OP_FAA:
        if (st != ST_RTR and st != ST_RTS and st != ST_SQD) or Q[qi, Q_FNAK_SYN]:
            A[P_RX_DROP_STATE] += 1
            return
        nat_rx_rd(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, qi, b, op, psn, bo, end, pad, l3, st, now)
        activate(A, Q, qi)
        return
    if op < OP_N_SEND or op > OP_N_WRITE_IMM:
        A[P_RX_DROP_OP] += 1                         # MR-NAT-007
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
    if nx[X_ERR_SYN] and psn == nx[X_ERR_PSN]:
        nx[X_C_ERR_HELD] += 1                        # MR-SACK-031: never recorded while its error waits
        return
    kq = np.int64(0)
    if recv and d < NL.PSN_HALF:                     # not a duplicate of a completed PSN
        rq_head = Q[qi, Q_RQ_HEAD]
        rm = A[b + O_RM:b + O_RM + NL.WMAX * NL.NRM].reshape((NL.WMAX, NL.NRM))
        fresh = rm[rsn & NL.WMASK, NL.M_STATE] == 0  # the first packet of its message to be taken
        kq = rx_rsn_check(rx, rm, par, rsn, msn, last_psn, ld_acq_i64(Q[qi], Q_RQ_TAIL) - rq_head)
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
        xi = b + O_RMX + (rsn & NL.WMASK) * NRMX + 3
        if fresh:
            A[xi] = imm                              # the message's ImmDt, as its first packet taken says
        elif has_imm and A[xi] != imm and d < par[NL.P_W] and not rx_recorded(rx, par, psn):
            nx[X_C_IMM_INV] += 1                     # MR-OOO-011: check 5, invalid request (MR-SACK-031)
            nat_error(A, Q, SW, RW, CQT, CE, TM, umem, tables, qi, b, NAK_INV_REQ, psn, WHY_IMMDT_DIFFERS)
            activate(A, Q, qi)
            return
    src = A[P_UMEM_ADDR] + h
    mr = np.int64(0)
    if is_write and d < NL.PSN_HALF and d < par[NL.P_W] and plen > 0:
        # a VA >= 2^63 (negative here) is refused before the offset is added to it (STYLE 14, MR-SEC-004)
        mr = mr_check(MRT, rkey, Q[qi, Q_PD], va + off, plen, ACC_REMOTE_WRITE) if va >= 0 else np.int64(-1)
        if mr < 0 or (Q[qi, Q_ACCESS] & ACC_REMOTE_WRITE) == 0:
            nat_error(A, Q, SW, RW, CQT, CE, TM, umem, tables, qi, b, NAK_REM_ACCESS, psn, WHY_REMOTE_ACCESS)
            activate(A, Q, qi)
            return
    rr = np.int64(0)
    if recv and d < NL.PSN_HALF and d < par[NL.P_W]:
        rr = Q[qi, Q_RQ_BASE] + ((Q[qi, Q_RQ_HEAD] + kq) & (Q[qi, Q_RQ_SIZE] - 1))
        if not is_write and off + plen > RW[rr, R_LENGTH]:
            # longer than the receive buffer (MR-RC-017): the RECV fails, invalid request
            nat_error(A, Q, SW, RW, CQT, CE, TM, umem, tables, qi, b, NAK_INV_REQ, psn, WHY_SEND_TOO_LONG)
            activate(A, Q, qi)
            return
        if not is_write and plen and ((RW[rr, R_LMR] and not mr_live_a(A, RW[rr, R_LMR]))
                                      or not sg_valid(A, RW[rr, R_SG], RW[rr, R_NSGE])):
            nat_error(A, Q, SW, RW, CQT, CE, TM, umem, tables, qi, b, 0x63, psn, WHY_RECV_MR_INVALID)
            activate(A, Q, qi)
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
    if rx[NL.R_EPSN] != e0:
        nat_advanced(A, Q, RW, CQT, CE, qi, b, e0, st)
        if nx[X_RS_HELD]:
            nat_rd_execute(A, Q, SW, CQT, CE, MRT, TM, umem, tables, qi, b)     # READs, atomics now due
        if Q[qi, Q_STATE] == ST_ERR or nat_error_due(A, Q, SW, RW, CQT, CE, TM, umem, tables, qi, b):
            activate(A, Q, qi)
            return                                   # the NAK-type SACK acknowledges what came before
    if res & RX_SACK_NOW:
        nat_send_sack(A, Q, TM, umem, tables, qi, b, AETH_ACK_SYN, -1)
    activate(A, Q, qi)


# ============================================================================ READ and atomics
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
        put_be(ext, 0, SW[r, W_RADDR] + k0 * pmtu, 8)
        put_be(ext, 8, SW[r, W_RKEY], 4)
        put_be(ext, 12, blen, 4)
        fl = NETH_FIRST | NETH_LAST | (0 if kind == TK_NEW else NETH_RETX)
        put_be(ext, 16, (fl << 24) | (A[j + 2] & PSN_MASK), 4)
        put_be(ext, 20, 0, 4)
        put_be(ext, 24, blen, 4)
        put_be(ext, 28, tsval_of(now), 4)
        if not emit(A, Q, TM, umem, tables, qi, OP_N_READ_REQ, 0, 1, p0, ext, 32, 0, 0):
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
    h = bo + 12
    if h + 16 + pad > end:
        nx[X_C_RD_BAD] += 1
        A[P_RX_DROP_LEN] += 1
        return
    fl = np.int64(umem[h])
    msn = get_be(umem, h + 1, 3)
    off = get_be(umem, h + 4, 4)
    mlen = get_be(umem, h + 8, 4)
    pay = h + 16
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
    if end - pad - (bo + 24) != 0 or pad != 0:
        nx[X_C_AT_ACK_BAD] += 1
        A[P_RX_DROP_LEN] += 1
        return
    if (umem[bo + 12] >> 5) & 3 != 0:                # not an ACK syndrome
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
    orig = get_be(umem, bo + 16, 8)
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
        put_be(ext, 0, va + off, 8)
        put_be(ext, 8, SW[r, W_RKEY], 4)
        put_be(ext, 12, ln, 4)
        put_be(ext, 16, ((NETH_FIRST | NETH_LAST | NETH_RETX) << 24) | (A[e + RQ_MSN] & PSN_MASK), 4)
        put_be(ext, 20, off, 4)
        put_be(ext, 24, blen, 4)
        put_be(ext, 28, tsval_of(now), 4)
        ep = mp_pick(pt, par, s[NL.S_SRTT], now) & (NL.PICK_PROBE - 1)
        set_entropy(Q, TM, qi, nx, pt[ep, NL.E_SPORT])
        if not emit(A, Q, TM, umem, tables, qi, OP_N_READ_REQ, 0, 1, (p + i) & PSN_MASK, ext, 32, 0, 0):
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


# ---------------------------------------------------------------------------- responder
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
    h = bo + 12
    is_read = op == OP_N_READ_REQ
    if end - h != (32 if is_read else 28) or pad != 0:
        nx[X_C_BAD_LEN] += 1
        A[P_RX_DROP_LEN] += 1                        # MR-NAT-009
        return
    va = get_be(umem, h, 8)
    rkey = get_be(umem, h + 8, 4)
    dlen = np.int64(8)
    msn = np.int64(0)
    off = np.int64(0)
    mlen = np.int64(0)
    tsval = np.int64(0)
    swap = np.int64(0)
    cmp = np.int64(0)
    if is_read:
        dlen = get_be(umem, h + 12, 4)
        fl = np.int64(umem[h + 16])
        msn = get_be(umem, h + 17, 3)
        off = get_be(umem, h + 20, 4)
        mlen = get_be(umem, h + 24, 4)
        tsval = get_be(umem, h + 28, 4)
        if (fl & (NETH_FIRST | NETH_LAST)) != (NETH_FIRST | NETH_LAST):
            nx[X_C_BAD_LEN] += 1                     # MR-NAT-021, MR-XH-021
            A[P_RX_DROP_LEN] += 1
            return
    else:
        swap = get_be(umem, h + 12, 8)
        cmp = get_be(umem, h + 20, 8)
    has_ts = 1 if is_read else 0
    ackreq = 1 if (umem[bo + 8] & 0x80) else 0
    ce = 1 if ce_marked(umem, l3) else 0
    sport = get_be(umem, l3 + (40 if (umem[l3] >> 4) == 6 else 20), 2)
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
            nat_error(A, Q, SW, RW, CQT, CE, TM, umem, tables, qi, b, NAK_INV_REQ, psn, WHY_OPCODE_SEQUENCE)
            return
        if dlen > 0 and (mr_check(MRT, rkey, Q[qi, Q_PD], va, dlen, ACC_REMOTE_READ) < 0 or
                         (Q[qi, Q_ACCESS] & ACC_REMOTE_READ) == 0):
            nat_error(A, Q, SW, RW, CQT, CE, TM, umem, tables, qi, b, NAK_REM_ACCESS, psn, WHY_REMOTE_ACCESS)
            return
    else:
        err = atomic_check(Q, MRT, qi, va, rkey)
        if err:
            nat_error(A, Q, SW, RW, CQT, CE, TM, umem, tables, qi, b, err, psn, 22 if err == NAK_REM_ACCESS else 28)
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
            put_be(ext, 0, (AETH_ACK_SYN << 24) | (A[x + JB_AMSN] & PSN_MASK), 4)
            put_be(ext, 4, A[x + JB_ORIG], 8)
            if not emit(A, Q, TM, umem, tables, qi, OP_ATOMIC_ACK, 0, 0, A[x + JB_PSN0] & PSN_MASK, ext, 12, 0, 0):
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
            put_be(ext, 0, (fl << 24) | (A[x + JB_MSN] & PSN_MASK), 4)
            put_be(ext, 4, off, 4)
            put_be(ext, 8, ln, 4)
            put_be(ext, 12, tsval_of(now), 4)
            if not rpace_may_send(rp, rate, now):       # MR-CC-021: this QP's share of the link
                return n
            tb0 = A[P_TX_BYTES]
            if not emit(A, Q, TM, umem, tables, qi, OP_N_READ_RESP, 0, 0, (A[x + JB_PSN0] + i) & PSN_MASK, ext, 16,
                        A[x + JB_VA] + off, plen):
                return n
            rpace_on_sent(rp, rate, A[pw + PW_NPEND], A[P_TX_BYTES] - tb0 + FRAME_TO_WIRE, par[NL.P_MAX_BURST], now)
            A[x + JB_I] = i + 1
            n += 1
            nx[X_C_RD_RESP_TX] += 1
        if A[x + JB_I] >= A[x + JB_IEND]:
            nx[X_JB_HEAD] += 1
    return n


@njit(**_jit)
def nat_advanced(A, Q, RW, CQT, CE, qi, b, e0, st):
    """The ePSN moved from e0: count the messages it passed (MR-SACK-003's MSN), generate the receive
    completions now due in receive WQE order (MR-OOO-013/014), COMM_EST in RTR."""
    par, rx, s, nx, sb, pt = rows(A, b)
    e1 = rx[NL.R_EPSN]
    if e1 == e0:
        return
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
        n = rx_recv_completions(rx, rm, out)         # in receive WQE order (MR-OOO-013/014)
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


# ============================================================================ per QP, per round
@njit(**_jit)
def nat_qp(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, qi, now, budget):
    """A native QP's turn in the round: the coalesced SACK (MR-SACK-015/017), the timers and
    the requester.  Returns packets sent | (still busy << 32)."""
    b = slot_base(A, nat_slot(A, qi))
    par, rx, s, nx, sb, pt = rows(A, b)
    sent = 0
    # the round's receive batch is done: packets not yet acknowledged get their SACK now, before ack_n
    # or ack_t (MR-SACK-015 "MAY send it earlier"; waiting for ack_t across a loop that yields the CPU
    # held SACKs for milliseconds, and pacing at cwnd / srtt followed the inflated srtt)
    if nx[X_SACK_OWED] or rx[NL.R_SINCE_SACK] > 0:
        if nat_send_sack(A, Q, TM, umem, tables, qi, b, AETH_ACK_SYN, -1):
            sent += 1
    st = Q[qi, Q_STATE]
    if st != ST_ERR:                                 # the responder's READ responses, atomic results
        if nx[X_RS_HELD]:
            nat_rd_execute(A, Q, SW, CQT, CE, MRT, TM, umem, tables, qi, b)
        if nx[X_JB_HEAD] != nx[X_JB_TAIL] and Q[qi, Q_STATE] != ST_ERR:
            sent += nat_rd_send(A, Q, SW, CQT, CE, MRT, TM, umem, tables, qi, b, now, budget)
        st = Q[qi, Q_STATE]
    if st == ST_RTS or st == ST_SQD:
        sent += nat_timers(A, Q, SW, CQT, CE, TM, umem, tables, qi, b, now)
        if Q[qi, Q_STATE] == ST_RTS or Q[qi, Q_STATE] == ST_SQD:
            sent += nat_rd_timers(A, Q, SW, CQT, CE, TM, umem, tables, qi, b, now)
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
        nx[X_JB_HEAD] = nx[X_JB_TAIL]
        nat_rd_pend(A, b, nx)
    busy = rx[NL.R_SINCE_SACK] > 0 or nx[X_SACK_OWED] != 0 or nx[X_JB_HEAD] != nx[X_JB_TAIL] or \
        (Q[qi, Q_STATE] != ST_ERR and Q[qi, Q_SQ_HEAD] != ld_acq_i64(Q[qi], Q_SQ_TAIL))
    return sent | ((1 if busy else 0) << 32)


# ============================================================================ control plane (Python)
DEFAULT_READ_RATE_BPS = 10e9     # when the interface does not tell its speed (as DCQCN's R_line)


def read_rate_bps(ifname: str | None, mbps: float | None = None) -> float:
    """The link rate a port's native READ responses share (MR-CC-021), bits/s: `mbps` when given (the
    tunable read_rate_mbps; 0: not paced), else the interface's speed (/sys/class/net/IF/speed; veth says
    10000), else DEFAULT_READ_RATE_BPS.  Context.set_read_rate changes it for one port."""
    if mbps is not None:
        return float(mbps) * 1e6
    from ..congestion import link_rate_bps
    return link_rate_bps(ifname, default=DEFAULT_READ_RATE_BPS)


class NativeSlots:
    """The native region of a port's arena and its slots (dp.context.Plane owns one)."""

    def __init__(self, A: np.ndarray, off: int, maxq: int) -> None:
        self.A, self.off, self.maxq = A, off, maxq
        self.natq = A[off:off + maxq]
        self.base = off + ((maxq + 7) & ~7)
        ext = self.base + NSLOT * SLOT_WORDS
        A[P_NAT_OFF] = off
        A[P_NAT_EXT] = int(A.ctypes.data) + ext * 8
        self.pw = A[ext + EXT_BYTES // 8:ext + EXT_BYTES // 8 + NPW]      # PW_*: shared by the queues' loops
        self.free = list(range(NSLOT - 1, -1, -1))
        self.par_kw: dict[int, dict] = {}
        self.loader = None

    def bind_kernel(self, loader) -> None:
        """The XDP program's NATIVE_SACK rings (kern/loader.XdpLoader.sacks, MR-SACK-043): native slot i's QP
        gets ring i at RTS (start), and every loop of the port drains the rings of its QPs."""
        A = self.A
        if loader is None or getattr(loader, "sacks", None) is None:
            A[P_SR_ADDR] = A[P_SR_N] = 0             # (tunable xdp_sacks off: SACKs through the socket)
            return
        self.loader = loader
        A[P_SR_ADDR] = int(loader.sacks.ctypes.data)
        A[P_SR_SIZE] = loader.sacks.dtype.itemsize
        A[P_SR_N] = min(NSLOT, len(loader.sacks))

    def set_read_rate(self, bps: float) -> None:
        """The link rate the port's READ responses share (MR-CC-021), bits/s; 0: not paced."""
        if bps < 0:
            raise ValueError(f"READ response rate {bps}: bits/s >= 0 (0: not paced)")
        self.pw[PW_RATE] = int(bps)

    @property
    def read_rate(self) -> int:
        return int(self.pw[PW_RATE])

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
        """RTS: the requester's state (04 4.3.5, 05 5.2) and the QP's K entropy values, fixed from now on
        (MR-MP-002): distinct ports in 0xC000-0xFFFF from a keyed pseudo-random function (native/multipath.py
        entropy_values) of the local and remote QPNs and GIDs under a per-QP random secret drawn here.
        The flow label key (MR-MP-016) comes from the same function, ends and secret.  sport, the QP's
        compat-style port, is not used (MR-ENC-017 is compat's rule).  tm, l3: the QP's header template
        (its addresses are the GIDs) and, for IPv6, its IP header's offset: the template starts on entropy
        value 0 (its port, and over IPv6 its label) for the SACKs sent before any request."""
        import secrets
        from ..native.multipath import entropy_context, entropy_values, flow_label_key
        par, rx, s, nx, pt, sp = self.rows(qi)
        tx_init(s, par, sq_psn & PSN_MASK, now)
        sl = int(self.natq[qi]) - 1
        tx_init(self._w(sl, O_TXR, NL.NTX), par, 0, now)                # the READ window (MR-CC-019)
        k = int(par[NL.P_K])
        q = int(self.A[P_Q_OFF]) + qi * NQ
        o = int(self.A[q + Q_L3_OFF])
        gids = b""
        if tm is not None:
            gids = bytes(tm[o + 8:o + 40]) if self.A[q + Q_IPV6] else bytes(tm[o + 12:o + 20])
        ends = entropy_context(int(self.A[q + Q_QPN]), int(self.A[q + Q_DEST_QP]), gids[:len(gids) // 2],
                               gids[len(gids) // 2:])
        secret = secrets.token_bytes(16)                                # per QP, never leaves this call
        sp[:] = entropy_values(secret, ends, len(sp))                   # MR-MP-002: the K values, then the
        # fresh ones MR-MP-011 may take (mp_init keeps them in the rows after K)
        mp_init(pt, par, sp)
        nx[X_FL_KEY] = flow_label_key(secret, ends)                     # MR-MP-016
        if tm is not None:                       # over IPv4 too: a SACK before any request is a native packet
            u = o + (40 if self.A[q + Q_IPV6] else 20)               # of the QP (MR-MP-001, MR-MP-003)
            tm[u:u + 2] = (int(sp[0]) >> 8, int(sp[0]) & 0xFF)
        if tm is not None and l3 >= 0:
            fl = flow_label.py_func(int(nx[X_FL_KEY]), int(sp[0]))
            tm[l3 + 1] = (int(tm[l3 + 1]) & 0xF0) | (fl >> 16)
            tm[l3 + 2:l3 + 4] = ((fl >> 8) & 0xFF, fl & 0xFF)
        self._kernel_ring(qi)

    def _kernel_ring(self, qi: int) -> None:
        """From now on the XDP program puts QP qi's NATIVE_SACKs in its slot's ring (MR-SACK-043)."""
        sl = int(self.natq[qi]) - 1
        if self.loader is None or not 0 <= sl < int(self.A[P_SR_N]):
            return
        qpn = int(self.A[int(self.A[P_Q_OFF]) + qi * NQ + Q_QPN])
        self.loader.set_sack_ring(qpn, sl, owner=qi + 1)

    def detach(self, qi: int) -> None:
        sl = int(self.natq[qi]) - 1
        if sl >= 0:
            rp = self._w(sl, O_RP, NRP)
            if rp[RP_PEND]:                                # counted among the pending (called paused)
                rp[RP_PEND] = 0
                self.pw[PW_NPEND] -= 1
            self.natq[qi] = 0
            self.free.append(sl)
            if self.loader is not None and sl < int(self.A[P_SR_N]):
                self.loader.sacks[sl]["owner"] = 0         # its loop stops draining; the next start skips the rest

    def sack_counters(self, qi: int) -> dict:
        """QP qi's NATIVE_SACK ring: SACKs consumed in the kernel (k_sack_pushed), steered to the socket
        because it was full or contended or the loop asleep (k_sack_full, k_sack_busy, k_sack_asleep),
        applied and discarded by the loop."""
        sl = int(self.natq[qi]) - 1
        if self.loader is None or not 0 <= sl < int(self.A[P_SR_N]):
            return {}
        r = self.loader.sacks[sl]
        return {"k_sack_pushed": int(r["pushed"]), "k_sack_full": int(r["full"]), "k_sack_busy": int(r["busy"]),
                "k_sack_asleep": int(r["asleep"]),
                "c_sack_kern": int(r["drained"]), "c_sack_kern_discarded": int(r["discarded"])}

    def counters(self, qi: int) -> dict:
        r = self.rows(qi)
        if r is None:
            return {}
        par, rx, s, nx, pt, sp = r
        out = {n: int(nx[i]) for i, n in enumerate(NX_FIELDS) if n.startswith("c_")}
        out.update({n: int(s[getattr(NL, "S_" + n.upper())]) for n in NL.TX_FIELDS if n.startswith("c_")})
        out.update({"rx_" + n: int(rx[getattr(NL, "R_" + n.upper())]) for n in NL.RX_FIELDS if n.startswith("c_")})
        out.update(srtt_ns=int(s[NL.S_SRTT]), rto_ns=int(s[NL.S_RTO]), cwnd=int(s[NL.S_CWND]) / NL.FP,
                   alpha=int(s[NL.S_ALPHA]) / NL.FP,
                   snd_una=int(s[NL.S_SND_UNA]), snd_nxt=int(s[NL.S_SND_NXT]), epsn=int(rx[NL.R_EPSN]),
                   rd_gap_ns=int(nx[X_RD_GAP]))
        k = int(par[NL.P_K])                                           # the entropy values (MR-MP-010/011)
        out.update(mp_evicted=int(pt[:k, NL.E_C_EVICT].sum()), mp_replaced=int(pt[:k, NL.E_C_REPLACE].sum()))
        rd = self._w(int(self.natq[qi]) - 1, O_TXR, NL.NTX)           # the READ window (MR-CC-019)
        out.update(rd_cwnd=int(rd[NL.S_CWND]) / NL.FP, rd_srtt_ns=int(rd[NL.S_SRTT]),
                   rd_alpha=int(rd[NL.S_ALPHA]) / NL.FP,
                   c_rd_dec_delay=int(rd[NL.S_C_DEC_DELAY]), c_rd_dec_ecn=int(rd[NL.S_C_DEC_ECN]),
                   c_rd_dec_loss=int(rd[NL.S_C_DEC_LOSS]))
        rp = self._w(int(self.natq[qi]) - 1, O_RP, NRP)                # READ response pacing (MR-CC-021)
        out.update(c_rd_pace_wait=int(rp[RP_C_WAIT]), c_rd_paced=int(rp[RP_C_PACED]),
                   c_rd_paced_shared=int(rp[RP_C_SHARED]), rd_pace_bps=int(rp[RP_SHARE]),
                   rd_pace_min_bps=int(rp[RP_SHARE_MIN]), rd_pace_link_bps=int(self.pw[PW_RATE]),
                   rd_pace_pending_qps=int(self.pw[PW_NPEND]))
        out.update(self.sack_counters(qi))
        return out
