"""The compiled progress round: one function per port does a whole round of RC work.

`round_` -- run by dp/inproc.py's `dp_round(A, TM, umem, tables)` and `dp_run` (a GIL-free loop of rounds)
for the in-process plane, by dp/drive.py's benchmark drivers, and by dp/serve.py's `dp_serve` for metaroced
-- receives a burst straight from the AF_XDP RX ring (`rx_burst`), validates each frame (header lengths,
ICRC, QP, state; `rx_frame`) and hands it to its role: responder.py (requests), completer.py (READ
responses, the kernel-judged ACKs), atomics.py, cc.py (CE marks, CNPs), or the native profile
(native/plane.py).  Then, for the QPs with work, the requester (requester.py) fills frames within the
round's budget and DCQCN's allowance, the timers (`timers`: local ACK timeout, go-back-N, retry_cnt, RNR
waits) run, and the TX ring is kicked and reaped (ring.py).  No Python object is created; what Python
must see (errors, state changes) goes to the event ring.

Work finding: a post puts its QP in the ready ring; only QPs in the active list (outstanding work) have
their kernel slot and timers looked at, so idle cost does not grow with the number of QPs.

The entry points (dp/inproc.py, dp/serve.py, dp/drive.py) have explicit signatures and cache=True
(their SIGNATURES; metaroce warmup loads them) and compiling is disabled after definition: a call with
other types fails at once instead of compiling on a live path.  They live in modules of their own so
that a process loads only those it runs (metaroced: dp_serve).
"""
from __future__ import annotations

import numpy as np
from numba import carray, njit
from .. import jitcache  # noqa: F401  (cache keyed on every module compiled code depends on)

from .layout import *  # noqa: F401,F403  (column numbers are compile-time constants)
from ..congestion import WIRE_OVERHEAD
from ..native.plane import nat_qp, nat_rx
from ..native.plane_slot import P_NAT_OFF
from ..native.plane_tx import nat_kern_sacks
from ..wire.fastpath import icrc_ok_at
from ..wire.hdr import R_UNKNOWN_OPCODE, bth_psn, parse_frame
from ..wire.psn import psn_diff
from .layout import NC, NE, NM, NQ, NR, NW, NXR, PSN_MASK
from .reasons import WHY_BAD_RESPONSE, WHY_RETRY_EXHAUSTED
from .prims import c_memcpy, c_monotonic_ns, c_recvfrom_kick, ld_acq_i64, ld_acq_u32, ptr_u64, st_rel_i64, st_rel_u32
from .ring import RING_NEED_WAKEUP, fq_topup, frame_free, tx_flush
from .core import (OP_ACK, OP_ATOMIC_ACK, OP_CAS, OP_FAA, OP_READ_REQ, OP_RSP_ONLY, OP_SEND_LAST_INV, OP_SEND_ONLY_INV,
                   ST_ERR, ST_RTR, ST_RTS, ST_SQD, ST_SQE, S_BAD_RESP, S_RETRY_EXC, ack_deadline, activate,
                   comm_est, flush_queues, qp_error)
from .cc import FRAME_TO_WIRE, ce_marked, np_on_ce, rp_allowance, rp_cnps, rp_on_sent
from .requester import fail_local, infl_weight, requester, rewind, sqd_check
from .completer import advance, completer_rsp, kernel_acks, nak_error_due
from .responder import ack_now, read_responses, responder, responder_error
from .atomics import completer_atomic, responder_atomic

_jit = dict(cache=True, nogil=True)

# local ACK timeouts that may start go-back-N in one round (the rest wait for the next rounds, a few
# microseconds each while QPs are active): 1,000 QPs that lost packets in the same burst would
# otherwise all retransmit in the same round, overflow the peer's fill ring again and lose the
# packet at comp_psn at every retry until RETRY_EXC_ERR (see timers)
TO_PER_ROUND = 64
# the window a go-back-N after a local ACK timeout starts with (packets; MR-RETRY-016 allows no fewer)
TO_WIN_START = 16


@njit(**_jit)
def to_expired(A, Q, qi, now):
    """QP qi's local ACK timer has expired and would start a go-back-N (not an RNR wait, not the last
    retry, not a native QP: native/plane.py has timers of its own)."""
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
    # go back N from comp_psn (MR-RETRY-006) with a window of TO_WIN_START packets, doubled per advancing
    # ACK (advance) up to the normal one (MR-RETRY-016): a timeout means the peer's RX ring overflowed (no
    # PFC on veth); resending whole windows at once, on top of what the other QPs resend, overflowed it
    # again, and the packet at comp_psn -- the one that matters -- could be lost at every retry until
    # RETRY_EXC_ERR.  (A window of one packet left even a short burst unresent until an ACK came, which
    # MR-RETRY-006 does not allow: TC-RETRY-005-a, -006-a, -006-b.)
    Q[qi, Q_TO_WIN] = TO_WIN_START
    Q[qi, Q_RETRY_FROM] = Q[qi, Q_COMP_PSN] + 1      # a NAK for it now starts no second retry (MR-NAK-005)
    rewind(A, Q, SW, qi, Q[qi, Q_COMP_PSN])
    Q[qi, Q_DEADLINE] = ack_deadline(Q, qi, now)
    return 1


@njit(**_jit)
def rx_frame(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, a, ln, now):
    op, qpn, l3, b, pay, end, pad = parse_frame(umem, a, ln)     # end: the ICRC's offset
    if op < 0:
        # the XDP program refuses all of these before steering (mr_rx_l3, mr_rx_bth, mr_rx_headers)
        if op == -R_UNKNOWN_OPCODE:
            A[P_RX_DROP_OP] += 1
        else:
            A[P_RX_DROP_LEN] += 1                    # lengths, IP/UDP header rules, TVer, pad
        return
    qi = qpn % A[P_MAXQ]
    if Q[qi, Q_QPN] != qpn or qpn == 0:
        A[P_RX_DROP_QP] += 1
        return
    st = Q[qi, Q_STATE]
    if not icrc_ok_at(tables, umem, l3, end):
        A[P_RX_DROP_ICRC] += 1                       # MR-ICRC-013: dropped, counted
        return
    psn = bth_psn(umem, b)
    if A[P_NAT_OFF] != 0 and A[A[P_NAT_OFF] + qi] > 0:
        nat_rx(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, qi, op, psn, b, end, pad, l3, now)   # native/plane.py
        return
    if op <= OP_READ_REQ or op == OP_SEND_LAST_INV or op == OP_SEND_ONLY_INV:
        if (st != ST_RTR and st != ST_RTS and st != ST_SQD) or Q[qi, Q_FNAK_SYN]:
            A[P_RX_DROP_STATE] += 1
            return
        e0 = Q[qi, Q_EPSN]
        responder(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, qi, op, psn, b, end, pad)
        comm_est(A, Q, qi, st, e0)
        activate(A, Q, qi)
        if ce_marked(umem, l3):                      # DCQCN notification point (MR-ECN-007, dp/cc.py)
            np_on_ce(A, Q, TM, umem, tables, ext, qi, now)
    elif op <= OP_RSP_ONLY:
        if st != ST_RTS and st != ST_SQD and st != ST_SQE:
            A[P_RX_DROP_STATE] += 1
            return
        completer_rsp(A, Q, SW, CQT, CE, umem, qi, op, psn, b, end, pad, now)
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
        responder_atomic(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, qi, op, psn, b, end, pad)
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


@njit(**_jit)
def rx_burst_sg(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, now, x, ring, cons, prod, n, fring, fprod,
                froom):
    """rx_burst's loop on a multi-buffer socket (XDP_USE_SG): a packet in several descriptors
    (XDP_PKT_CONTD on all but the last) is joined in its first buffer's slot -- the later buffers'
    bytes copied right after the first's, into the rest of that slot, which is never on the fill
    ring -- and handled as one frame; a packet longer than its slot is dropped (rx_sg_long); one
    whose last descriptor is not published yet waits in the ring.  Every buffer goes back to the
    fill ring (as its slot's start).  Returns the descriptors consumed."""
    size = A[x + XR_RX_SIZE]
    fsize = A[x + XR_FQ_SIZE]
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
        A[x + XR_RX] += 1
        if ln >= 0:
            rx_frame(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, a, ln, now)
        for d in range(nd):
            ad = np.int64(ring[((cons + i + d) & (size - 1)) * 2])
            if nf < froom:
                fring[(fprod + nf) & (fsize - 1)] = np.uint64(ad & mask)
                nf += 1
            else:
                frame_free(A, ad)                    # owed to the fill ring (fq_topup), as in rx_ring
                A[x + XR_OWED] += 1
        i += nd
    st_rel_u32(A[x + XR_RX_CONS], (cons + i) & 0xFFFFFFFF)
    st_rel_u32(A[x + XR_FQ_PROD], (fprod + nf) & 0xFFFFFFFF)
    return i


@njit(**_jit)
def rx_ring(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, now, budget, x):
    """Up to `budget` frames from the RX ring of XR row x (arena offset), each handed to rx_frame and
    its frame put straight back on that socket's fill ring.  Returns the frames (descriptors) taken."""
    size = A[x + XR_RX_SIZE]
    prod = ld_acq_u32(A[x + XR_RX_PROD])
    cons = ld_acq_u32(A[x + XR_RX_CONS])
    n = min((prod - cons) & 0xFFFFFFFF, budget)
    if A[x + XR_OWED] > 0:
        fq_topup(A, x)
    if n == 0:
        fqf = A[x + XR_FQ_FLAGS]
        if fqf and (ld_acq_u32(fqf) & RING_NEED_WAKEUP):
            c_recvfrom_kick(A[x + XR_FD])
        return 0
    # the clock again: the loop reads it only every 8th idle round, and a thread preempted since then would
    # time these packets -- an RTT sample from a SACK (MR-LOSS-001) -- with a `now` as old as the preemption
    now = c_monotonic_ns()
    A[P_NOW] = now                  # round_ goes on with it: a stamp (NETH.tsval) never steps back
    ring = carray(ptr_u64(A[x + XR_RX_DESC]), (size * 2,))
    fsize = A[x + XR_FQ_SIZE]
    fring = carray(ptr_u64(A[x + XR_FQ_ADDRS]), (fsize,))
    fprod = ld_acq_u32(A[x + XR_FQ_PROD])
    froom = fsize - ((fprod - ld_acq_u32(A[x + XR_FQ_CONS])) & 0xFFFFFFFF)
    nf = 0
    if A[P_SG] != 0:
        return rx_burst_sg(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, now, x, ring, cons, prod, n, fring,
                           fprod, froom)
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
            A[x + XR_OWED] += 1
    st_rel_u32(A[x + XR_RX_CONS], (cons + n) & 0xFFFFFFFF)
    st_rel_u32(A[x + XR_FQ_PROD], (fprod + nf) & 0xFFFFFFFF)
    A[x + XR_RX] += n
    return n


@njit(**_jit)
def rx_burst(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, now, budget):
    """Every RX ring of the port (XR rows: one per RX queue's socket), up to `budget` frames from each.  A
    frame's QP is found from its BTH whatever queue it came on -- the NIC's RSS hashes flows (and the native
    profile's sprayed source ports) over all of them.  When several rings hold frames they are taken one
    from each in turn, not a burst from one ring and then the next: one QP's packets spread over the queues
    then reach the QP near the order they were sent in (a burst per ring would turn a spreading into a
    reordering: the compat responder NAKs every gap, the native one SACKs it)."""
    x = A[P_XR_OFF]
    nr = A[P_XR_N]
    if nr == 1:
        return rx_ring(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, now, budget, x)
    busy = 0
    last = x
    for k in range(nr):
        xk = x + k * NXR
        if ((ld_acq_u32(A[xk + XR_RX_PROD]) - ld_acq_u32(A[xk + XR_RX_CONS])) & 0xFFFFFFFF) == 0:
            rx_ring(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, now, 0, xk)   # fill debt, wake-up
        else:
            busy += 1
            last = xk
    if busy <= 1:
        return rx_ring(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, now, budget, last) if busy else 0
    n = 0
    for _ in range(budget):
        got = 0
        for k in range(nr):
            xk = x + k * NXR
            if (ld_acq_u32(A[xk + XR_RX_PROD]) - ld_acq_u32(A[xk + XR_RX_CONS])) & 0xFFFFFFFF:
                got += rx_ring(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, max(now, A[P_NOW]), 1, xk)
        if got == 0:
            break
        n += got
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
    # `now` is the loop's, read every 8th idle round; A[P_NOW] is the latest read, also the fresh ones of
    # nat_kern_sacks and rx_burst (which time RTT samples with it): everything after them goes on with the
    # later one, so what the round stamps (NETH.tsval, MR-NAT-014) never steps back (tests/native/
    # test_dp_native_wire.py saw a READ response stamped before the SACK that preceded it)
    now = max(now, A[P_NOW])
    work = nat_kern_sacks(A, Q, SW, CQT, CE, now)        # before the socket's: a full ring's overflow went there
    now = max(now, A[P_NOW])
    work += rx_burst(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, ext, now, budget)
    now = max(now, A[P_NOW])
    # posts: the ready ring
    rdy = A[P_RDY_OFF]
    tail = ld_acq_i64(A, P_RDY_TAIL)
    while A[P_RDY_HEAD] != tail:
        qi = A[rdy + (A[P_RDY_HEAD] & 4095)]
        st_rel_i64(A, P_RDY_HEAD, A[P_RDY_HEAD] + 1)
        if 0 <= qi < A[P_MAXQ]:
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
            k = nat_qp(A, Q, SW, RW, CQT, CE, MRT, TM, umem, tables, qi, now, budget)    # native/plane.py
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
                    rp_cnps(A, Q, qi, now)                   # DCQCN reaction point (dp/cc.py)
                    bud = rp_allowance(A, qi, now, budget, Q[qi, Q_PMTU] + WIRE_OVERHEAD)
                    if bud > 0:
                        tb0 = A[P_TX_BYTES]
                        k = requester(A, Q, SW, TM, umem, tables, ext, qi, now, bud)
                        rp_on_sent(A, qi, A[P_TX_BYTES] - tb0 + k * FRAME_TO_WIRE)
                        work += k
                    fail_local(A, Q, SW, CQT, CE, qi)
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
