"""metaroced's client receive rings as the data plane takes them (dp/serve.py's pump and the responder).

A client of metaroced posts receive WRs into a ring in shared memory (shm.py) and rings a doorbell; the
daemon's loop checks each entry and copies it into the data plane's receive queue (`take_recvs`).  The
loop reads the doorbells once per round, so a SEND can reach the responder after the client's post_recv
returned but before the loop took that WR -- the client then told its peer it was ready, and the peer's
SEND met an RNR NAK (with rnr_retry 0, RNR_RETRY_EXC_ERR: TC-RNR-003-b through metaroced).  A NIC reads
the receive queue's doorbell record when a request needs a WQE; so does the responder here: before an
RNR NAK it takes what the client's ring holds (`late_recvs`, for the compat responder and the native
plane alike).

Q columns (dp/layout.py) of a client QP, written by metaroced with the loop paused, never by a client:
  Q_CRQ        the address of the client's ring (shm.QP ring words) in the daemon; 0 for a QP of the
               in-process plane, a client QP whose rings are no longer read (a refused entry) or detached
  Q_CRQ_OFF    the byte offset of its receive entries
  Q_CRQ_SIZE   its receive ring's size (a power of two, the data plane's receive queue's too)
  Q_CRQ_TAKEN  the receive entries taken so far (the client's QH_RQ_HEAD mirrors it)
"""
from __future__ import annotations

from numba import njit
from .. import jitcache  # noqa: F401  (cache keyed on every module compiled code depends on)

from .. import shm as S
from .layout import (M_ACCESS, M_ADDR, M_KEY, M_LENGTH, M_PD, M_REF, M_VALID, MR_BAD, NR, P_LATE_RECVS, Q_CRQ,
                     Q_CRQ_OFF, Q_CRQ_SIZE, Q_CRQ_TAKEN, Q_PD, Q_RQ_BASE, Q_RQ_HEAD, Q_RQ_TAIL, R_LADDR, R_LENGTH,
                     R_LMR, R_WR_ID)
from .core import in_mr, key_row      # MR-MEM-024 bounds without overflow, the one key decoder
from .prims import ld_acq_i64, ld_acq_u64, st_rel_i64, st_rel_u64

_jit = dict(cache=True, nogil=True)

MAX_PUMP_PER_QP = 1024      # entries taken from one client ring per visit (one client cannot hold the loop)
ACC_LOCAL_WRITE = 1


@njit(**_jit)
def local_mr(MRT, pd, addr, length, lkey, need):
    """The MR reference (M_REF) of a local SGE of a QP of PD pd: 0 for no SGE, -1 length out of range, -2
    not inside a valid MR of pd with the access `need` (key index and tag, valid bit, PD, bounds).  The loop
    checks the reference again on every use (MR-SEC-003); the client's address and length are compared
    without a sum that could wrap (STYLE 14: an address >= 2^63 is refused)."""
    if length == 0:
        return 0
    if length < 0 or length >= 1 << 31:
        return -1
    idx = key_row(lkey)
    if idx <= 0 or idx >= MRT.shape[0]:
        return -2
    if MRT[idx, M_VALID] == 0 or MRT[idx, M_KEY] != lkey or MRT[idx, M_PD] != pd:
        return -2
    if not in_mr(MRT[idx, M_ADDR], MRT[idx, M_LENGTH], addr, length):
        return -2
    if need != 0 and (MRT[idx, M_ACCESS] & need) == 0:
        return -2
    return MRT[idx, M_REF]


@njit(**_jit)
def recv_entry(Q, qi, i):
    """The address of client QP qi's receive entry number i (mod the ring)."""
    return Q[qi, Q_CRQ] + Q[qi, Q_CRQ_OFF] + 8 * S.RQE_WORDS * (i & (Q[qi, Q_CRQ_SIZE] - 1))


@njit(**_jit)
def take_recvs(Q, RW, MRT, qi, tail):
    """Client QP qi's receive entries from Q_CRQ_TAKEN up to `tail` (the client's QH_RQ_TAIL, already
    checked to lie within the ring) into the data plane's receive queue, each checked: its SGE inside a
    valid MR of the QP's PD with LOCAL_WRITE (local_mr).  An SGE that fails only its MR checks is taken
    with the reference MR_BAD: a SEND that comes for it is NAKed with code 3 and the WQE completes with
    LOC_PROT_ERR (MR-MEM-020).  Stops at the room the queue has, MAX_PUMP_PER_QP, or an entry whose length
    is out of range (not taken: the caller refuses it).  Returns (taken, 1 if that entry stopped it)."""
    taken = Q[qi, Q_CRQ_TAKEN]
    size = Q[qi, Q_CRQ_SIZE]
    dtail = Q[qi, Q_RQ_TAIL]
    room = size - (dtail - ld_acq_i64(Q[qi], Q_RQ_HEAD))
    k = min(tail - taken, room, MAX_PUMP_PER_QP)
    mask = size - 1
    dbase = Q[qi, Q_RQ_BASE]
    pd = Q[qi, Q_PD]
    took = 0
    bad = 0
    for i in range(k):
        e = recv_entry(Q, qi, taken + i)
        laddr = ld_acq_u64(e + 8 * S.R_LADDR)
        length = ld_acq_u64(e + 8 * S.R_LENGTH)
        lkey = ld_acq_u64(e + 8 * S.R_LKEY)
        lmr = local_mr(MRT, pd, laddr, length, lkey, ACC_LOCAL_WRITE)
        if lmr == -1:
            bad = 1
            break
        if lmr == -2:
            lmr = MR_BAD
            laddr = 0
        r = dbase + ((dtail + took) & mask)
        for c in range(NR):
            RW[r, c] = 0
        RW[r, R_WR_ID] = ld_acq_u64(e + 8 * S.R_WR_ID)
        RW[r, R_LADDR] = laddr if length else 0
        RW[r, R_LENGTH] = length
        RW[r, R_LMR] = lmr
        took += 1
    if took:
        st_rel_i64(Q[qi], Q_RQ_TAIL, dtail + took)           # published after the rows
        Q[qi, Q_CRQ_TAKEN] = taken + took
        st_rel_u64(Q[qi, Q_CRQ] + 8 * S.QH_RQ_HEAD, taken + took)
    return took, bad


@njit(**_jit)
def late_recvs(A, Q, RW, MRT, qi):
    """Before an RNR NAK (MR-RNR-001) on QP qi: receive WRs its metaroced client posted that the loop has not
    taken yet, taken now (take_recvs); what the ring holds beyond a refused entry stays for dp/serve.py's
    pump, which fails the QP.  Returns how many were taken (0 for a QP of the in-process plane)."""
    base = Q[qi, Q_CRQ]
    if base == 0:
        return 0
    tail = ld_acq_u64(base + 8 * S.QH_RQ_TAIL)
    n = tail - Q[qi, Q_CRQ_TAKEN]
    if n <= 0 or n > Q[qi, Q_CRQ_SIZE]:
        return 0                                              # nothing, or nonsense the pump refuses
    took, _bad = take_recvs(Q, RW, MRT, qi, tail)
    A[P_LATE_RECVS] += took
    return took
