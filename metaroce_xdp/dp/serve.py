"""metaroced's progress loop: client rings in, completions out, rounds in between -- all compiled.

The daemon (metaroce_xdp/daemon/server.py) hosts one data plane per interface; each client posts
into shared-memory rings it writes and the daemon reads (shm.py).  `dp_serve` is the
daemon's driver thread: a GIL-free loop that, every round,

* reads each client's doorbell ring (QPNs it posted to) and, every `G_SCAN_NS`, every client QP
  (a doorbell lost to a full ring costs at most that);
* takes new entries of those QPs' send and receive rings into the data plane's queues, checking
  each one -- the client is not trusted: opcode, flags, the SGE's lkey (index and tag), the MR's
  valid bit, **its PD against the QP's PD** (PDs are per client, so a client reaches only its own
  MRs), bounds, LOCAL_WRITE where the WR writes (READ, atomics); an atomic's one 8-byte SGE and remote
  address a multiple of 8 (MR-XH-011); ring tails within the ring; sends only in RTS/SQD/ERR.
  An SGE that fails its MR checks is taken with the reference MR_BAD, as the in-process post takes it: the
  loop completes the WQE with LOC_PROT_ERR when it is the oldest, nothing of it sent (MR-RC-022), or, a
  receive WQE, when a SEND comes for it (NAK code 3, MR-MEM-020).  Any other bad entry completes with
  LOC_PROT_ERR (SGE length) or LOC_QP_OP_ERR (the rest) on that QP's CQ, the
  QP goes to ERR (event EV_QP_FATAL, why WHY_BAD_WR, details in its QX row for Python's message)
  and its rings are not read again;
* runs `round.round_` (the data plane's round);
* copies new completions of client CQs from the data plane's CQ rings into the clients' CQ rings
  (as much as the client ring has room for: a client that never polls overflows its own CQ);
* every `G_CREDIT_NS` (the receiver's credit_interval), shares the receive budget among the port's
  native QPs with CREDITS agreed (`credits`: native/receiver.rx_credit_alloc, MR-CC-018) -- every
  client's QPs together, since they share the interface's downlink.

Native QPs (native/plane.py, chosen at RTR) run in `round.round_` like compat ones, READ and atomics
included: a READ or atomic entry becomes a send-queue row as the in-process post_send writes it (the
local SGE where the responses or the original value are placed, in the client's registered memory;
compare_add in W_IMM, swap in W_SWAP), and from there the round does the rest -- request messages of
at most W/2 PSNs, responses placed by offset, re-requests, the READ window, atomics executed once
(MR-NAT-006, MR-NAT-021/022, MR-OOO-016..028) -- and completes the WQE in order (MR-SACK-026).

It returns to Python only for data-plane events (1), a stop or pause (2) or after max_ns (0).
After G_YIELD_AFTER idle rounds it calls sched_yield() each round, so that a client or another
daemon sharing its CPU runs at once rather than after its time slice.
When idle with sleep_ok -- or, busy, after G_BUSY_IDLE_NS without work (the daemon's busy_idle_ms) --
it sets H_SLEEPING in every client's header and sleeps in poll() on the AF_XDP socket and the port's
eventfd (a post that sees H_SLEEPING writes it); the next work makes a busy loop spin again.
With G_TRACE_CAP > 0 it records (time, T_* kind, count) entries in G after NG (daemon/bench.py --trace).

Tables the daemon owns (numpy arrays beside the arena, never seen by clients):
  QX[qi]  one row per data-plane QP slot: the client ring's address in the daemon (0: no client QP),
          the owner's session slot, QPN, ring sizes, entries taken, dead flag, byte counters,
          the first bad entry (why code and fields).
  CX[cq]  one row per data-plane CQ: the client CQ ring's address (0: none), size, entries delivered.
  SX[s]   one row per client session: its header's address (0: free slot), doorbell ring head.
  G       scalars: scan period and deadline, completions seen, a CQ left with entries, counters.
Rows are filled and cleared by Python with the loop paused (Plane.paused()).

Explicit signature, cache=True, compiling disabled after import (as dp/inproc.py).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import cgutils
from numba import types as nbt
from numba.extending import intrinsic
from .. import jitcache  # noqa: F401,E402  (cache keyed on every module compiled code depends on)

from .. import shm as S
from .layout import (C_BASE, C_HEAD, C_SIZE, C_TAIL, EV_QP_FATAL, E_BYTE_LEN, E_FLAGS, E_IMM, E_OPCODE, E_QP_NUM,
                     E_STATUS, E_WR_ID, MAGIC, NW, N_P, P_CQE_OUT, P_EFD, P_EV_HEAD, P_EV_TAIL, P_IDLE_POLLS,
                     P_MAGIC, P_MAXQ, P_NOW, P_NPOLLFD, P_N_ACT, P_PAUSE, P_POLLFD, P_POLL_MS, P_RDY_HEAD, P_RDY_TAIL,
                     P_SLEEPING, P_SPIN_IDLE, P_STOP, P_TXN, P_WAKEUPS, Q_CRQ, Q_CRQ_SIZE, Q_CRQ_TAKEN, Q_ERR, Q_PD,
                     Q_QPN, Q_RECV_CQ, Q_SEND_CQ, Q_SQ_BASE, Q_SQ_HEAD, Q_SQ_TAIL, Q_STATE, W_FLAGS, W_IMM, W_LADDR,
                     W_LENGTH, W_LMR, W_OPCODE, W_RADDR, W_RKEY, W_SWAP, W_WR_ID)
from .layout import P_RX, P_RX_BYTES, P_TX_BYTES      # the trace's counters
from .layout import MR_BAD
from .reasons import WHY_BAD_WORK_REQUEST
from .core import (S_LOC_PROT, S_LOC_QP_OP, ST_ERR, ST_RTS, ST_SQD, WC_RECV, WR_SEND_INV, activate, push_cqe,
                   push_event, qp_error, wc_of)
from .clientq import ACC_LOCAL_WRITE, MAX_PUMP_PER_QP, local_mr, recv_entry, take_recvs
from .round import round_, views
from ..native.plane_slot import NSLOT, O_PAR, O_RX, P_NAT_OFF, nat_slot, slot_base
from ..native import layout as NL
from ..native.receiver import rx_credit_alloc
from .prims import c_monotonic_ns, c_poll, c_read8, ld_acq_i64, ld_acq_u64, st_rel_i64, st_rel_u64, unowned

_jit = dict(cache=True, nogil=True)

# ---- QX columns --------------------------------------------------------------------------------
QX_FIELDS = ("addr sess qpn sq_size sq_taken dead bytes_tx bytes_rx "
             "bad bad_wr_id bad_op bad_a bad_b bad_c pend").split()
# columns of QX_FIELDS (prefix QX_): generated by scripts/gen_columns.py
QX_ADDR = 0
QX_SESS = 1
QX_QPN = 2
QX_SQ_SIZE = 3
QX_SQ_TAKEN = 4
QX_DEAD = 5
QX_BYTES_TX = 6
QX_BYTES_RX = 7
QX_BAD = 8
QX_BAD_WR_ID = 9
QX_BAD_OP = 10
QX_BAD_A = 11
QX_BAD_B = 12
QX_BAD_C = 13
QX_PEND = 14
# end of QX_FIELDS columns
NQX = 24
assert len(QX_FIELDS) <= NQX
CX_ADDR, CX_SIZE, CX_TAIL = 0, 1, 2
NCX = 4
SX_ADDR, SX_RDY_HEAD = 0, 1
NSX = 2
(G_NSX, G_SCAN_NS, G_NEXT_SCAN, G_CQE_SEEN, G_CQ_PENDING, G_TAKEN, G_DELIVERED, G_BAD, G_SCANS, G_YIELD_AFTER,
 G_QP_PENDING, G_CREDIT_NS, G_NEXT_CREDIT, G_CREDIT_RUNS, G_BUSY_IDLE_NS, G_LAST_WORK, G_TRACE_CAP,
 G_TRACE_POS) = range(18)
NG = 24
# the loop's trace (tables(trace=N)): N entries (time ns, kind, count) in G from NG on, kept until full
T_TAKE, T_RX, T_RXP, T_TX, T_CQE = 1, 2, 3, 4, 5   # ring entries taken (time: before the round); payload bytes
                                    # placed, packets received, frame bytes sent (after the round's kick); CQEs delivered

WHY_BAD_WR = WHY_BAD_WORK_REQUEST   # Q_ERR code: the client wrote an invalid work request into its ring

# bad entry codes (QX_BAD); Python turns them into the QP_FATAL message (server.Device.bad_wr_text)
BAD_SQ_TAIL, BAD_RQ_TAIL, BAD_SEND_STATE, BAD_OPCODE, BAD_FLAGS, BAD_SGE_LEN, BAD_SGE, BAD_ATOMIC = 1, 2, 3, 4, 5, 6, 7, 8
OP_READ, OP_LAST = 4, 6         # send opcodes served: WRITE, WRITE_IMM, SEND, SEND_IMM, READ, CAS (5), FETCH_ADD (6),
OP_SEND_INV = WR_SEND_INV       # and SEND_WITH_INV (9, compat QPs only: MR-NAT-010), its invalidate key in S_IMM
SEND_FLAGS = 0x7                # FENCE, SIGNALED, SOLICITED (dp/core.py F_*)
OP_RECV = 128                   # QX_BAD_OP of a refused receive WR (its SGE is written, as a READ's or an atomic's)

# shared-memory layout (shm.py; jitcache re-keys this module's cache when it changes)
QH_WORDS, SQE_WORDS, RQE_WORDS = S.QH_WORDS, S.SQE_WORDS, S.RQE_WORDS
QH_SQ_TAIL, QH_SQ_HEAD, QH_RQ_TAIL, QH_RQ_HEAD = S.QH_SQ_TAIL, S.QH_SQ_HEAD, S.QH_RQ_TAIL, S.QH_RQ_HEAD
QH_STATE, QH_ERR = S.QH_STATE, S.QH_ERR
CH_WORDS, CQE_WORDS, CH_TAIL, CH_HEAD = S.CH_WORDS, S.CQE_WORDS, S.CH_TAIL, S.CH_HEAD
H_SLEEPING, H_RDY_TAIL, H_RDY_HEAD, H_RDY_OFF, N_RDY_H = S.H_SLEEPING, S.H_RDY_TAIL, S.H_RDY_HEAD, S.H_RDY_OFF, S.N_RDY


@intrinsic
def fence_sc(typingctx):
    """A sequentially consistent fence (mfence): the store of H_SLEEPING before the loads of the tails."""
    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return nbt.none(), codegen


@intrinsic
def c_sched_yield(typingctx):
    """sched_yield(): an idle loop leaves its CPU to any other runnable thread there (a client)."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()
    return nbt.none(), codegen


@njit(**_jit)
def _w(base, i):
    return ld_acq_u64(base + 8 * i)


@njit(**_jit)
def _set(base, i, v):
    st_rel_u64(base + 8 * i, v)


@njit(**_jit)
def bad_wr(A, Q, SW, CQT, CE, QX, G, qi, code, has_entry, recv, wr_id, op, a, b, c):
    """A work request no honest client library writes: its error completion (when there is an entry),
    the QP to ERR, its rings never read again; Python hears of it (EV_QP_FATAL, WHY_BAD_WR)."""
    QX[qi, QX_DEAD] = 1
    Q[qi, Q_CRQ] = 0                    # nor by the responder (dp/clientq.late_recvs)
    QX[qi, QX_BAD] = code
    QX[qi, QX_BAD_WR_ID] = wr_id
    QX[qi, QX_BAD_OP] = op
    QX[qi, QX_BAD_A] = a
    QX[qi, QX_BAD_B] = b
    QX[qi, QX_BAD_C] = c
    G[G_BAD] += 1
    if has_entry:
        status = S_LOC_PROT if code == BAD_SGE or code == BAD_SGE_LEN else S_LOC_QP_OP
        if recv:
            push_cqe(A, Q, CQT, CE, Q[qi, Q_RECV_CQ], qi, wr_id, status, WC_RECV, 0, 0, 0)
        else:
            push_cqe(A, Q, CQT, CE, Q[qi, Q_SEND_CQ], qi, wr_id, status,
                     wc_of(op) if 0 <= op <= OP_LAST or op == OP_SEND_INV else 0, 0, 0, 0)
    if Q[qi, Q_STATE] == ST_ERR:
        push_event(A, EV_QP_FATAL, qi, WHY_BAD_WR, -1)
    else:
        qp_error(A, Q, SW, CQT, CE, qi, -1, EV_QP_FATAL, WHY_BAD_WR)
    mirror(Q, QX, qi)


@njit(**_jit)
def mirror(Q, QX, qi):
    """The QP's state and error code into the client's ring header (what QP.state reads)."""
    base = QX[qi, QX_ADDR]
    if base != 0:
        _set(base, QH_ERR, Q[qi, Q_ERR])
        _set(base, QH_STATE, Q[qi, Q_STATE])


@njit(**_jit)
def pump_qp(A, Q, SW, RW, CQT, CE, MRT, QX, G, qi):
    """New entries of client QP qi's rings into the data plane's queues; returns how many."""
    base = QX[qi, QX_ADDR]
    if base == 0 or QX[qi, QX_DEAD] != 0:
        return 0
    moved = 0
    pend = 0
    pd = Q[qi, Q_PD]
    # ---- send ring
    size = QX[qi, QX_SQ_SIZE]
    taken = QX[qi, QX_SQ_TAKEN]
    tail = _w(base, QH_SQ_TAIL)
    n = tail - taken
    if n != 0:
        if n < 0 or n > size:
            bad_wr(A, Q, SW, CQT, CE, QX, G, qi, BAD_SQ_TAIL, False, False, 0, 0, tail, taken, size)
            return moved
        st = Q[qi, Q_STATE]
        if st != ST_RTS and st != ST_SQD and st != ST_ERR:          # SQD: queued, not started (MR-QP-018)
            bad_wr(A, Q, SW, CQT, CE, QX, G, qi, BAD_SEND_STATE, False, False, 0, 0, st, 0, 0)
            return moved
        dtail = Q[qi, Q_SQ_TAIL]
        room = size - (dtail - ld_acq_i64(Q[qi], Q_SQ_HEAD))
        k = min(n, room, MAX_PUMP_PER_QP)
        if k < n:
            pend = 1
        mask = size - 1
        dbase = Q[qi, Q_SQ_BASE]
        took = 0
        for i in range(k):
            e = base + 8 * (QH_WORDS + ((taken + i) & mask) * SQE_WORDS)
            wr_id = _w(e, S.S_WR_ID)
            op = _w(e, S.S_OPCODE)
            flags = _w(e, S.S_FLAGS)
            laddr = _w(e, S.S_LADDR)
            length = _w(e, S.S_LENGTH)
            lkey = _w(e, S.S_LKEY)
            raddr = _w(e, S.S_RADDR)
            code = 0
            lmr = 0
            atomic = OP_READ < op <= OP_LAST
            if (op < 0 or op > OP_LAST) and not (op == OP_SEND_INV and nat_slot(A, qi) < 0):
                code = BAD_OPCODE
            elif flags & ~SEND_FLAGS:
                code = BAD_FLAGS
            elif atomic and (length != 8 or raddr & 7):
                code = BAD_ATOMIC                       # one 8-byte SGE; MR-XH-011: the VA a multiple of 8
            else:
                lmr = local_mr(MRT, pd, laddr, length, lkey, ACC_LOCAL_WRITE if OP_READ <= op <= OP_LAST else 0)
                if lmr == -1:
                    code = BAD_SGE_LEN
                elif lmr < 0:
                    lmr = MR_BAD                        # LOC_PROT_ERR when it is the oldest (MR-RC-022)
                    laddr = 0
            if code != 0:
                if took:
                    st_rel_i64(Q[qi], Q_SQ_TAIL, dtail + took)
                    activate(A, Q, qi)
                QX[qi, QX_SQ_TAKEN] = taken + took
                _set(base, QH_SQ_HEAD, taken + took)
                G[G_TAKEN] += took
                bad_wr(A, Q, SW, CQT, CE, QX, G, qi, code, True, False, wr_id, op,
                       flags if code == BAD_FLAGS else raddr if code == BAD_ATOMIC else laddr, length, lkey)
                return moved + took
            r = dbase + ((dtail + took) & mask)
            for c in range(NW):
                SW[r, c] = 0
            SW[r, W_WR_ID] = wr_id
            SW[r, W_OPCODE] = op
            SW[r, W_FLAGS] = flags
            SW[r, W_LADDR] = laddr if length else 0
            SW[r, W_LENGTH] = length
            SW[r, W_LMR] = lmr
            SW[r, W_RADDR] = raddr
            SW[r, W_RKEY] = _w(e, S.S_RKEY) & 0xFFFFFFFF
            if atomic:                                  # as dp/context.py's _send_row (dp/requester.atomic_request)
                SW[r, W_IMM] = _w(e, S.S_COMPARE_ADD)
                SW[r, W_SWAP] = _w(e, S.S_SWAP)
            else:
                SW[r, W_IMM] = _w(e, S.S_IMM) & 0xFFFFFFFF      # the immediate, or SEND_WITH_INV's IETH
            if (op < OP_READ or op == OP_SEND_INV) and lmr != MR_BAD:
                QX[qi, QX_BYTES_TX] += length
            took += 1
        if took:
            st_rel_i64(Q[qi], Q_SQ_TAIL, dtail + took)          # published after the rows
            QX[qi, QX_SQ_TAKEN] = taken + took
            _set(base, QH_SQ_HEAD, taken + took)
            activate(A, Q, qi)
            moved += took
    # ---- receive ring (dp/clientq.py: the responder takes from it too, before an RNR NAK)
    size = Q[qi, Q_CRQ_SIZE]
    taken = Q[qi, Q_CRQ_TAKEN]
    tail = _w(base, QH_RQ_TAIL)
    n = tail - taken
    if n != 0:
        if n < 0 or n > size:
            bad_wr(A, Q, SW, CQT, CE, QX, G, qi, BAD_RQ_TAIL, False, True, 0, 0, tail, taken, size)
            return moved
        took, bad = take_recvs(Q, RW, MRT, qi, tail)
        if bad:
            G[G_TAKEN] += took
            e = recv_entry(Q, qi, taken + took)
            bad_wr(A, Q, SW, CQT, CE, QX, G, qi, BAD_SGE_LEN, True, True, _w(e, S.R_WR_ID), OP_RECV,
                   _w(e, S.R_LADDR), _w(e, S.R_LENGTH), _w(e, S.R_LKEY))
            return moved + took
        if taken + took != tail:
            pend = 1
        if took and Q[qi, Q_STATE] == ST_ERR:
            activate(A, Q, qi)                                  # the loop flushes them
        moved += took
    G[G_TAKEN] += moved
    QX[qi, QX_PEND] = pend              # entries left for want of room: looked at again every round
    if pend:
        G[G_QP_PENDING] = 1
    return moved


@njit(**_jit)
def doorbells(A, Q, SW, RW, CQT, CE, MRT, QX, SX, G):
    """Every client's doorbell ring: the QPNs it posted to (only its own QPs are taken)."""
    moved = 0
    maxq = A[P_MAXQ]
    for s in range(G[G_NSX]):
        hb = SX[s, SX_ADDR]
        if hb == 0:
            continue
        t = _w(hb, H_RDY_TAIL)
        h = SX[s, SX_RDY_HEAD]
        if t == h:
            continue
        n = t - h
        if n < 0:
            h = t                                   # nonsense: the periodic scan covers its QPs
        elif n > N_RDY_H:
            h = t - N_RDY_H
        for i in range(h, t):
            v = _w(hb, H_RDY_OFF + (i & (N_RDY_H - 1)))
            if v <= 0:
                continue
            qi = v % maxq
            if QX[qi, QX_ADDR] != 0 and QX[qi, QX_SESS] == s and Q[qi, Q_QPN] == v:
                moved += pump_qp(A, Q, SW, RW, CQT, CE, MRT, QX, G, qi)
        SX[s, SX_RDY_HEAD] = t
        _set(hb, H_RDY_HEAD, t)
    return moved


@njit(**_jit)
def pending(A, Q, SW, RW, CQT, CE, MRT, QX, G):
    """QPs whose ring entries did not all fit in the data plane's queue: again, now that some may."""
    G[G_QP_PENDING] = 0
    moved = 0
    for qi in range(QX.shape[0]):
        if QX[qi, QX_PEND] != 0:
            moved += pump_qp(A, Q, SW, RW, CQT, CE, MRT, QX, G, qi)
    return moved


@njit(**_jit)
def doorbell_pending(SX, G):
    for s in range(G[G_NSX]):
        hb = SX[s, SX_ADDR]
        if hb != 0 and _w(hb, H_RDY_TAIL) != SX[s, SX_RDY_HEAD]:
            return True
    return False


@njit(**_jit)
def set_sleeping(SX, G, v):
    for s in range(G[G_NSX]):
        hb = SX[s, SX_ADDR]
        if hb != 0:
            _set(hb, H_SLEEPING, v)


@njit(**_jit)
def scan(A, Q, SW, RW, CQT, CE, MRT, QX, G):
    """Every client QP (a doorbell lost to a full ring); the QP states mirrored into the rings."""
    moved = 0
    for qi in range(QX.shape[0]):
        if QX[qi, QX_ADDR] != 0:
            moved += pump_qp(A, Q, SW, RW, CQT, CE, MRT, QX, G, qi)
            mirror(Q, QX, qi)
    G[G_SCANS] += 1
    return moved


@njit(**_jit)
def deliver(A, CQT, CE, QX, CX, G):
    """New completions of client CQs into the clients' CQ rings, as many as each has room for."""
    moved = 0
    pending = 0
    maxq = A[P_MAXQ]
    G[G_CQE_SEEN] = A[P_CQE_OUT]
    for cq in range(CX.shape[0]):
        base = CX[cq, CX_ADDR]
        if base == 0:
            continue
        h = CQT[cq, C_HEAD]
        t = ld_acq_i64(CQT[cq], C_TAIL)
        if h == t:
            continue
        size = CX[cq, CX_SIZE]
        ctail = CX[cq, CX_TAIL]
        used = ctail - _w(base, CH_HEAD)
        room = size - used if 0 <= used <= size else 0          # a nonsense head: deliver nothing
        k = min(t - h, room)
        if k < t - h:
            pending = 1
        if k <= 0:
            continue
        dbase = CQT[cq, C_BASE]
        dmask = CQT[cq, C_SIZE] - 1
        for i in range(k):
            r = dbase + ((h + i) & dmask)
            off = base + 8 * (CH_WORDS + ((ctail + i) & (size - 1)) * CQE_WORDS)
            _set(off, 0, CE[r, E_WR_ID])
            _set(off, 1, CE[r, E_STATUS])
            _set(off, 2, CE[r, E_OPCODE])
            _set(off, 3, CE[r, E_BYTE_LEN])
            _set(off, 4, CE[r, E_QP_NUM])
            _set(off, 5, CE[r, E_IMM])
            _set(off, 6, CE[r, E_FLAGS])
            op = CE[r, E_OPCODE]
            if CE[r, E_STATUS] == 0 and (op == WC_RECV or op == WC_RECV + 1 or op == 2):
                qi = CE[r, E_QP_NUM] % maxq
                if QX[qi, QX_ADDR] != 0:
                    QX[qi, QX_BYTES_RX] += CE[r, E_BYTE_LEN]
        CX[cq, CX_TAIL] = ctail + k
        _set(base, CH_TAIL, ctail + k)                           # published after the entries
        st_rel_i64(CQT[cq], C_HEAD, h + k)
        moved += k
    G[G_CQ_PENDING] = pending
    G[G_DELIVERED] += moved
    return moved


@njit(**_jit)
def trace(G, t, kind, n):
    p = G[G_TRACE_POS]
    if p < G[G_TRACE_CAP]:
        o = NG + 3 * p
        G[o] = t
        G[o + 1] = kind
        G[o + 2] = n
        G[G_TRACE_POS] = p + 1


@njit(**_jit)
def credits(A, CPAR, CRX, CB, now):
    """MR-CC-018 over every native QP of the port with CREDITS agreed: their responder rows copied into
    CRX (one row per native slot; the rest look idle forever), native/receiver.rx_credit_alloc with the
    receiver's parameters CPAR (rx_budget, active_window, init_credit), each QP's credit written back
    within its own W.  Returns how many QPs it served."""
    o = A[P_NAT_OFF]
    if o == 0:
        return 0
    n = 0
    for qi in range(A[P_MAXQ]):
        sl = A[o + qi] - 1
        if sl < 0 or n >= NSLOT:
            continue
        b = slot_base(A, sl)
        if A[b + O_PAR + NL.P_CREDITS] == 0:
            continue
        for c in range(NL.NRX):
            CRX[n, c] = A[b + O_RX + c]
        CB[n] = b
        n += 1
    if n == 0:
        return 0
    for i in range(n, CRX.shape[0]):
        CRX[i, NL.R_LAST_RX_TS] = NL.NONE
    rx_credit_alloc(CRX, CPAR, now)
    for i in range(n):
        b = CB[i]
        c = CRX[i, NL.R_CREDIT]
        w = A[b + O_PAR + NL.P_W]
        A[b + O_RX + NL.R_CREDIT] = c if c < w else w
    return n


@njit(nbt.int64(nbt.int64[::1], nbt.uint8[:, ::1], nbt.uint8[::1], nbt.uint32[:, ::1], nbt.int64[:, ::1],
                nbt.int64[:, ::1], nbt.int64[:, ::1], nbt.int64[::1], nbt.int64[::1], nbt.int64[:, ::1], nbt.int64,
                nbt.int64), **_jit)
def dp_serve(A, TM, umem, tables, QX, CX, SX, G, CPAR, CRX, max_ns, sleep_ok):
    """The daemon's loop (module docstring): returns 1 when events wait for Python, 2 on stop or pause,
    0 after max_ns, -1 when A is not a port."""
    if A[P_MAGIC] != MAGIC:
        return -1
    A, TM, umem, tables = unowned(A), unowned(TM), unowned(umem), unowned(tables)   # no refcounts below
    QX, CX, SX, G, CPAR, CRX = unowned(QX), unowned(CX), unowned(SX), unowned(G), unowned(CPAR), unowned(CRX)
    ext = np.empty(32, np.uint8)
    cb = np.zeros(NSLOT, np.int64)
    Q, SW, RW, CE, CQT, MRT = views(A, TM)
    start = c_monotonic_ns()
    now = start
    idle = 0
    tr = G[G_TRACE_CAP] > 0
    rx0 = rb0 = tb0 = 0
    while True:
        if idle & 7 == 0:
            now = c_monotonic_ns()
            A[P_NOW] = now
        w = doorbells(A, Q, SW, RW, CQT, CE, MRT, QX, SX, G)
        if G[G_QP_PENDING]:
            w += pending(A, Q, SW, RW, CQT, CE, MRT, QX, G)
        if now >= G[G_NEXT_SCAN]:
            G[G_NEXT_SCAN] = now + G[G_SCAN_NS]
            w += scan(A, Q, SW, RW, CQT, CE, MRT, QX, G)
        if G[G_CREDIT_NS] > 0 and now >= G[G_NEXT_CREDIT]:
            G[G_NEXT_CREDIT] = now + G[G_CREDIT_NS]
            if credits(A, CPAR, CRX, cb, now):
                G[G_CREDIT_RUNS] += 1
        if tr:
            if w:
                trace(G, c_monotonic_ns(), T_TAKE, w)
            rx0, rb0, tb0 = A[P_RX], A[P_RX_BYTES], A[P_TX_BYTES]
        w += round_(A, Q, SW, RW, CE, CQT, MRT, TM, umem, tables, ext, now)
        if tr and (A[P_RX] != rx0 or A[P_TX_BYTES] != tb0):
            t1 = c_monotonic_ns()
            if A[P_RX_BYTES] != rb0:
                trace(G, t1, T_RX, A[P_RX_BYTES] - rb0)
            if A[P_RX] != rx0:
                trace(G, t1, T_RXP, A[P_RX] - rx0)
            if A[P_TX_BYTES] != tb0:
                trace(G, t1, T_TX, A[P_TX_BYTES] - tb0)
        if A[P_CQE_OUT] != G[G_CQE_SEEN] or G[G_CQ_PENDING]:
            k = deliver(A, CQT, CE, QX, CX, G)
            if tr and k:
                trace(G, c_monotonic_ns(), T_CQE, k)
            w += k
        if A[P_EV_TAIL] != A[P_EV_HEAD]:
            return 1
        if ld_acq_i64(A, P_STOP) or ld_acq_i64(A, P_PAUSE):
            return 2
        if now - start >= max_ns:
            return 0
        if w:
            idle = 0
            G[G_LAST_WORK] = now
            continue
        idle += 1
        A[P_IDLE_POLLS] += 1
        if idle > G[G_YIELD_AFTER]:
            # idle: a client (or the peer's daemon) on this CPU runs now, not after our time slice -- on a host
            # with fewer free cores than spinning threads that slice (ms) would be every message's latency;
            # with the CPU to itself sched_yield returns at once
            c_sched_yield()
        # busy mode's idle fallback: no work for G_BUSY_IDLE_NS (0: never) -> sleep as sleep mode does
        if ((sleep_ok or (G[G_BUSY_IDLE_NS] > 0 and now - G[G_LAST_WORK] >= G[G_BUSY_IDLE_NS]))
                and idle > A[P_SPIN_IDLE] and A[P_N_ACT] == 0 and A[P_TXN] == 0):
            set_sleeping(SX, G, 1)
            st_rel_i64(A, P_SLEEPING, 1)
            fence_sc()
            if (ld_acq_i64(A, P_RDY_TAIL) == A[P_RDY_HEAD] and not doorbell_pending(SX, G)
                    and not ld_acq_i64(A, P_STOP) and not ld_acq_i64(A, P_PAUSE)):
                left = (max_ns - (now - start)) // 1000000
                c_poll(A[P_POLLFD], A[P_NPOLLFD], max(0, min(A[P_POLL_MS], left)))
            st_rel_i64(A, P_SLEEPING, 0)
            set_sleeping(SX, G, 0)
            c_read8(A[P_EFD], A[P_POLLFD] + 8 * A[P_NPOLLFD])          # drain the eventfd (non-blocking)
            A[P_WAKEUPS] += 1
            idle = 0


SIGNATURES = {"dp_serve": dp_serve}
for _f in SIGNATURES.values():
    _f.disable_compile()        # a call with other types fails at once instead of compiling on a live path
del _f


def tables(maxq: int, max_cqs: int, max_sessions: int, scan_ns: int, busy_idle_ns: int = 0,
           trace: int = 0) -> tuple[np.ndarray, ...]:
    """Fresh QX, CX, SX, G for a port of maxq QP slots and max_cqs CQs; busy_idle_ns: busy mode sleeps after
    that long without work (0: never); trace: room for that many trace entries (read them with traced(G))."""
    G = np.zeros(NG + 3 * trace, np.int64)
    G[G_SCAN_NS] = scan_ns
    G[G_BUSY_IDLE_NS] = busy_idle_ns
    G[G_TRACE_CAP] = trace
    G[G_YIELD_AFTER] = 2            # idle rounds before the loop yields its CPU each round
    return (np.zeros((maxq, NQX), np.int64), np.zeros((max_cqs, NCX), np.int64),
            np.zeros((max_sessions, NSX), np.int64), G)


def traced(G: np.ndarray) -> np.ndarray:
    """The trace entries recorded so far: rows of (monotonic ns, T_* kind, count)."""
    return G[NG:NG + 3 * int(G[G_TRACE_POS])].reshape(-1, 3).copy()


def credit_tables(G: np.ndarray, **receiver) -> tuple[np.ndarray, np.ndarray]:
    """(CPAR, CRX) for `credits`: the receiver's parameter row (native.layout.params in its units:
    rx_budget packets, active_window and credit_interval in us, init_credit packets) and the scratch rows;
    G's credit period set from credit_interval."""
    par = NL.params(**receiver)
    G[G_CREDIT_NS] = int(par[NL.P_CREDIT_INTERVAL])
    return par, np.zeros((NSLOT, NL.NRX), np.int64)


def warm_plan() -> list[tuple[str, str, tuple]]:
    """(name, why, args) for metaroce_xdp.jitwarm, on an arena that is not a port (magic 0)."""
    from ..wire.fastpath import TABLES
    A = np.zeros(N_P, np.int64)
    TM = np.zeros((2, 128), np.uint8)
    umem = np.zeros(4096, np.uint8)
    QX, CX, SX, G = tables(2, 2, 2, 0)
    CPAR, CRX = credit_tables(G)
    return [("dp_serve", "metaroced's driver thread (daemon/server.py)",
             (A, TM, umem, TABLES, QX, CX, SX, G, CPAR, CRX, 0, 0))]
