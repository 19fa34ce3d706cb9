"""The compiled plane's AF_XDP rings: the UMEM frame stack, the TX ring (batched, kicked, reaped) and the
fill ring's top-up.  The RX ring is walked by round.py's `rx_burst`, which hands each frame to
`rx_frame`.  Ring addresses and sizes are port scalars of the arena (P_TX_*, P_CQ_*) and, for the RX and
fill rings of every socket the loop receives from, rows of the XR table (layout.XR_FIELDS);
indices follow libxdp's protocol (load-acquire the other side's index, store-release our own).

Multi-buffer sockets (XDP_USE_SG, path MTU 4096): a frame longer than a chunk goes out as chained
descriptors (`tx_descs_sg`), and a completed frame returns its slot once (`comp_reap`).
afxdp/rings.py holds the same operations over numpy ring views, for sockets driven from Python
(afxdp/xsk.py, the raw benchmark loop).
"""
from __future__ import annotations

import numpy as np
from numba import carray, njit
from .. import jitcache  # noqa: F401  (cache keyed on every module compiled code depends on)

from .layout import *  # noqa: F401,F403  (column numbers are compile-time constants)
from .layout import TX_BATCH
from .prims import c_sendto_kick, ld_acq_u32, ptr_u64, st_rel_u32

_jit = dict(cache=True, nogil=True)

RING_NEED_WAKEUP = 1         # XDP_RING_NEED_WAKEUP in a ring's flags word


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
def fq_topup(A, x):
    """Give the fill ring of RX ring row x (the arena offset of its XR row) the frames owed to it
    (rx_burst found no room for them) from the free stack."""
    fsize = A[x + XR_FQ_SIZE]
    fprod = ld_acq_u32(A[x + XR_FQ_PROD])
    room = fsize - ((fprod - ld_acq_u32(A[x + XR_FQ_CONS])) & 0xFFFFFFFF)
    k = min(room, A[x + XR_OWED], A[P_FREE_TOP])
    if k <= 0:
        return
    fring = carray(ptr_u64(A[x + XR_FQ_ADDRS]), (fsize,))
    for i in range(k):
        A[P_FREE_TOP] -= 1
        fring[(fprod + i) & (fsize - 1)] = np.uint64(A[A[P_FREE_OFF] + A[P_FREE_TOP]])
    st_rel_u32(A[x + XR_FQ_PROD], (fprod + k) & 0xFFFFFFFF)
    A[x + XR_OWED] -= k
