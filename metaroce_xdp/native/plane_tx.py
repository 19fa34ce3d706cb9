"""The native profile in the compiled data plane, part 3 of 4: the requester and the SACKs that come back.

`nat_requester` turns a native QP's WQEs into NETH/RSNETH packets within the window, the pacing and the
READ limit, spraying them over the QP's entropy values (MR-MP-004); `nat_timers` runs RACK, TLP and the
RTO (MR-LOSS-007, MR-SACK-028, MR-LOSS-010); `nat_on_sack` applies a NATIVE_SACK to the scoreboard
(native/sender.py decides) and completes what it acknowledged.

NATIVE_SACKs mostly never reach the AF_XDP socket: the XDP program verifies their ICRC and puts them, as
received, in the QP's ring of its mr_sacks map (bpf/metaroce_xdp.c mr_sack_push, MR-SACK-043);
`nat_kern_sacks` drains the rings at the start of each round into the same `nat_on_sack` a SACK from the
socket goes to.  A SACK whose ring is full still comes through the socket (and every SACK does with
METAROCE_XDP_SACKS=0).
"""
from __future__ import annotations

from numba import carray, njit
from .. import jitcache  # noqa: F401  (cache keyed on every module compiled code depends on)

from ..dp.layout import *  # noqa: F401,F403  (column numbers are compile-time constants)
from . import layout as NL
from ..dp.completer import advance, nak_error_due
from ..dp.core import (F_FENCE, F_SOLICITED, ST_RTS, ST_SQD, ST_SQE, S_RETRY_EXC, S_RNR_EXC, WR_CAS, WR_FAA, WR_READ,
                       WR_SEND, WR_SEND_IMM, WR_WRITE, WR_WRITE_IMM, activate, emit, mr_live_a, qp_error, rd_atomic,
                       sg_valid, sq_row, src_of)
from ..dp.layout import EV_QP_FATAL, PSN_MASK, PSN_NONE
from ..dp.prims import c_monotonic_ns, ld_acq_i64, ld_acq_u32, ld_acq_u64, ptr_u8, st_rel_u32, st_rel_u64
from ..dp.reasons import WHY_RD_ATOMIC_0, WHY_RETRY_EXHAUSTED, WHY_RNR_RETRY_EXHAUSTED
from ..dp.requester import loc_why  # local errors before the first packet (MR-RC-008, MR-RC-022)
from ..kern.layout import MR_SACK_RING_LEN, SACK_REC_DTYPE, SACK_RING_DTYPE
from ..wire.fastpath import BTH_SE
from ..wire.hdr import (OPT, OT_AETH, OT_PAY, OT_SACKETH, aeth_syndrome, bth_psn, ext_at, put_immdt, put_neth, put_reth,
                        put_rsneth, sacketh_ce_count, sacketh_credit, sacketh_echo_sport, sacketh_end, sacketh_flags,
                        sacketh_tsecr, sacketh_word, sacketh_words)
from ..wire.headers import SACK_MAX_WORDS
from .multipath import mp_pick, mp_pick_retx
from .sender import (ACT_FAIL, ACT_RNR_END, ACT_RTO, ACT_TLP, TK_NEW, TK_RETX, TK_RTO, TK_TLP, tsval_of, tx_can_send,
                     tx_next_deadline, tx_next_lost, tx_on_rnr_nak, tx_on_sack, tx_on_timer, tx_on_transmit)
from .plane_slot import (NETH_FIRST, NETH_LAST, NETH_RETX, NSBX, OP_N_SACK, OP_N_SEND, OP_N_SEND_IMM, OP_N_WRITE,
                         OP_N_WRITE_IMM, O_SBX, O_WD, P_NAT_OFF, X_CUR_MSN, X_CUR_RSN, X_C_RTO, X_C_SACK_BAD,
                         X_C_SACK_NAK_SEQ, X_C_SACK_RX, X_C_TLP, X_MSN_NEXT, X_RNR_ACK, X_RSN_NEXT, _jit, count_tx,
                         nat_ext, nat_slot, rows, set_entropy, slot_base)
from .plane_read import nat_rd_issue, nat_tx_rd

_jit = dict(cache=True, nogil=True)

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
SACK_MIN = int(OPT[OP_N_SACK, OT_PAY])       # BTH, AETH, SACKETH without bitmap words


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
        n = put_reth(ext, 0, SW[r, W_RADDR], SW[r, W_RKEY], length)
    fl = (NETH_FIRST if k == 0 else 0) | (NETH_LAST if last else 0) | (0 if kind == TK_NEW else NETH_RETX)
    n = put_neth(ext, n, fl, A[j + 2] & PSN_MASK, off, length, tsval_of(now))
    if op != WR_WRITE:                               # RSNETH (MR-NAT-025, MR-XH-037)
        n = put_rsneth(ext, n, A[j + 3] & PSN_MASK)
    if has_imm:                                      # MR-NAT-020: ImmDt in every packet
        n = put_immdt(ext, n, SW[r, W_IMM])
    opc = (OP_N_WRITE_IMM if has_imm else OP_N_WRITE) if is_write else (OP_N_SEND_IMM if has_imm else OP_N_SEND)
    se = BTH_SE if (last and op != WR_WRITE and (SW[r, W_FLAGS] & F_SOLICITED) != 0) else 0
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
        ack = 1 if nx[X_RNR_ACK] == p + 1 else 0    # MR-SACK-042: the last packet of the message at p
        if not nat_tx_packet(A, Q, SW, TM, umem, tables, qi, b, p, TK_RETX, ack, now):
            return sent
        if ack:
            nx[X_RNR_ACK] = 0
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
                Q[qi, Q_LOCERR] = loc_why(lmr)
            break
        if SW[r, W_STARTED] == 0 and rd_atomic(op) and Q[qi, Q_MAX_RD] == 0:
            if nxt == Q[qi, Q_SQ_HEAD]:              # MR-RC-009, as the compat requester
                SW[r, W_STARTED] = 1
                Q[qi, Q_LOCERR] = WHY_RD_ATOMIC_0
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
    elif act == ACT_RNR_END:
        # MR-SACK-042: the held PSNs are lost now and go under the window (nat_requester), AckReq set on
        # the last packet of the message at p, the RNR NAK's PSN (that message's first, MR-SACK-036)
        j = b + O_SBX + (p & NL.WMASK) * NSBX
        r = sq_row(Q, qi, A[j])
        nx[X_RNR_ACK] = ((p + SW[r, W_NPSN] - 1 - A[j + 1]) & PSN_MASK) + 1
    return 0


@njit(**_jit)
def nat_on_sack(A, Q, SW, CQT, CE, umem, qi, b, psn, bo, end, now):
    """A NATIVE_SACK (04 section 4.3.1) for our requester: ACK-type to tx_on_sack (MR-SACK-019..030,
    MR-SACK-038), RNR NAK-type to tx_on_rnr_nak, error NAKs fail the WQE holding the PSN once the
    WQEs before it completed; then WQEs wholly before snd_una complete in order (MR-SACK-026)."""
    par, rx, s, nx, sb, pt = rows(A, b)
    syn = aeth_syndrome(umem, ext_at(bo, OP_N_SACK, OT_AETH)) & 0x7F   # MR-SACK-038: bit 7 is ignored
    k = ext_at(bo, OP_N_SACK, OT_SACKETH)
    # a SACK from the kernel's ring (nat_kern_sacks) was not through parse_frame: its length is checked here
    if bo + SACK_MIN > end:
        nx[X_C_SACK_BAD] += 1
        A[P_RX_DROP_LEN] += 1
        return
    tsecr = sacketh_tsecr(umem, k)
    credit = sacketh_credit(umem, k)
    ce_count = sacketh_ce_count(umem, k)
    sport = sacketh_echo_sport(umem, k)
    nw = sacketh_words(umem, k)
    flags = sacketh_flags(umem, k)
    if nw > SACK_MAX_WORDS or sacketh_end(umem, k) != end:     # MR-SACK-005, MR-NAT-009
        nx[X_C_SACK_BAD] += 1
        A[P_RX_DROP_LEN] += 1
        return
    words = A[b + O_WD:b + O_WD + 32]
    for i in range(nw):
        words[i] = sacketh_word(umem, k, i)
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


@njit(**_jit)
def own_ring(A, Q, ri):
    """(address, QP index) of mr_sacks ring ri when it has an owner QP; (0, -1) when it has none."""
    r = A[P_SR_ADDR] + ri * A[P_SR_SIZE]
    qi = ld_acq_u32(r + SR_OWNER) - 1
    if qi < 0 or qi >= A[P_MAXQ]:
        return 0, -1
    return r, qi


@njit(**_jit)
def nat_kern_sacks(A, Q, SW, CQT, CE, now):
    """The NATIVE_SACKs the XDP program put in the mr_sacks rings (MR-SACK-043; the protocol is struct
    mr_sack_ring's): each ring whose owner QP this loop runs, drained in ring order into nat_on_sack, as
    nat_rx hands it a SACK from the AF_XDP socket -- the same state check first, the same arguments
    (`now` read again at the first record, as rx_burst does for the socket's), the same counters.  A record is judged against the requester state of
    now (MR-SACK-019, MR-SACK-037); none waits longer than a frame in the socket's ring would (while
    the loop sleeps the kernel steers SACKs to the socket: nat_kern_sleep).  Records of another QPN
    (the slot's previous QP) or uncopied are discarded, counted.  Returns the records taken."""
    if A[P_SR_ADDR] == 0 or A[P_NAT_OFF] == 0:
        return 0
    n = 0
    fresh = False
    for ri in range(A[P_SR_N]):
        r, qi = own_ring(A, Q, ri)
        if r == 0:
            continue
        cons = ld_acq_u64(r + SR_CONS)
        while True:
            e = r + SR_REC + (cons & SR_MASK) * SREC_SIZE
            if ld_acq_u64(e + SREC_SEQ) != cons + 1:
                break                                # empty, or the kernel is still writing it
            if not fresh:                            # an RTT sample (MR-LOSS-001) with the time it is taken
                now = c_monotonic_ns()
                A[P_NOW] = now                       # round_ goes on with it (tsval never steps back)
                fresh = True
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
                psn = bth_psn(raw, 0)                # the record starts with the BTH
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
