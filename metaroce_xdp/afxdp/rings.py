"""AF_XDP ring operations and the UMEM frame pool: the numba hot path.

Role: every per-packet operation on the four AF_XDP rings (fill, completion, RX, TX) and
on the pool of free UMEM frames.  Functions here see numpy arrays and scalars only, never
Python objects, so the engine can call them from its own `@njit` loops.  `xsk.py` maps the
kernel's rings and hands these functions the views; `tests/afxdp/test_afxdp_rings.py` drives them
against a simulated kernel on plain arrays, with and without `NUMBA_DISABLE_JIT`.

Ring representation (what `xsk.Ring` exposes):
  producer, consumer, flags  uint32[1] views of the shared index words
  addrs                      uint64[size]      fill and completion rings (UMEM addresses)
  descs                      uint64[size, 2]   RX and TX rings; word 0 = addr,
                                               word 1 = len | options << 32
Indices are free-running u32 counters; the slot is `index & (size - 1)`.  `size` is
always taken from the array length, so it cannot disagree with the mapping.

Multi-buffer (XDP_USE_SG) variants, used only when a socket is bound with XDP_USE_SG
(path MTU 4096: a frame spans two 4 KiB chunks; `port.py`):
  rx_burst_sg    reassembles a packet that came in several descriptors (XDP_PKT_CONTD)
                 into its first buffer's slot, so callers still see one contiguous frame;
  tx_burst_sg    splits a frame longer than a chunk into chained descriptors;
  comp_reap_sg   returns only the slot-start chunk of each completed frame to the pool.
They assume the "slot" pool layout: the FramePool hands out slots of `slot` bytes (a
multiple of the UMEM chunk size, aligned), only slot-start chunks ever go on the fill
ring, and the rest of a slot is this process's to write.  The single-buffer functions
above are unchanged and keep their cost.

Ownership.  Each index has one writer: user space writes the producer of fill and TX and
the consumer of RX and completion; the kernel writes the other two.  So a producer may read
its own producer index back instead of caching it, which keeps these functions stateless.

Memory ordering.  The protocol is libxdp's: a producer writes descriptors, then
store-releases the producer index; a consumer load-acquires the producer index, then reads
descriptors, then store-releases the consumer index once it is done reading them.
On x86-64 (TSO) loads are not reordered with loads, stores not with stores, and stores not
ahead of earlier loads, so every one of those barriers is free in hardware: only the
*compiler* must be kept from moving accesses across them.  `acquire_fence()` and
`release_fence()` emit LLVM `fence acquire` / `fence release`, which are compiler barriers
on x86 and real barriers (dmb ish / fence r,rw / ...) on arm64, ppc64 and riscv, so the
code stays correct if it is ever built there.  One rule the fences cannot enforce: never
spin on an index *inside* a jitted function (LLVM may hoist the load out of the loop);
return to the caller and call again, as every function below does.
"""
from __future__ import annotations

import numpy as np
from numba import config, njit
from .. import jitcache  # noqa: F401,E402  (cache keyed on every module compiled code depends on)

__all__ = [
    "JIT_ENABLED",
    "acquire_fence",
    "release_fence",
    "prod_free",
    "prod_submit",
    "cons_avail",
    "cons_release",
    "needs_wakeup",
    "fill_ring_refill",
    "rx_burst",
    "tx_burst",
    "comp_reap",
    "frame_alloc",
    "frame_free",
    "rx_burst_sg",
    "tx_burst_sg",
    "comp_reap_sg",
    "FramePool",
]

JIT_ENABLED = not config.DISABLE_JIT

U32_MASK = 0xFFFFFFFF
RING_NEED_WAKEUP = 1  # uapi.XDP_RING_NEED_WAKEUP; literal so jitted code sees a constant
DESC_LEN_MASK = np.uint64(0xFFFFFFFF)
PKT_CONTD = 1  # uapi.XDP_PKT_CONTD: more descriptors of this packet follow

if JIT_ENABLED:
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def _acquire_fence(typingctx):
        def codegen(context, builder, signature, args):
            builder.fence("acquire")
            return context.get_dummy_value()

        return types.none(), codegen

    @intrinsic
    def _release_fence(typingctx):
        def codegen(context, builder, signature, args):
            builder.fence("release")
            return context.get_dummy_value()

        return types.none(), codegen

    @njit(cache=True, nogil=True, inline="always")
    def acquire_fence():
        """Later loads/stores stay after earlier loads (smp_load_acquire's half)."""
        _acquire_fence()

    @njit(cache=True, nogil=True, inline="always")
    def release_fence():
        """Earlier loads/stores complete before later stores (smp_store_release's half)."""
        _release_fence()

else:
    # Interpreted numpy executes each access in program order and, on x86 TSO, the hardware
    # keeps that order; a no-op is the honest equivalent.
    def acquire_fence():
        """No-op without JIT (see module docstring)."""

    def release_fence():
        """No-op without JIT (see module docstring)."""


# --------------------------------------------------------------------------- primitives


@njit(cache=True, nogil=True)
def prod_free(prod, cons, size):
    """Slots a producer may fill now: size - (prod - cons), in u32 arithmetic."""
    c = np.int64(cons[0])
    # We are about to overwrite slots the kernel has released; its reads of them must be
    # ordered before our writes (libxdp: load_acquire of the consumer index).
    acquire_fence()
    return np.int64(size) - ((np.int64(prod[0]) - c) & U32_MASK)


@njit(cache=True, nogil=True)
def prod_submit(prod, n):
    """Publish n descriptors written at slots prod .. prod+n-1."""
    release_fence()  # descriptor stores before the index store
    prod[0] = np.uint32((np.int64(prod[0]) + n) & U32_MASK)


@njit(cache=True, nogil=True)
def cons_avail(prod, cons):
    """Entries the kernel has published and we have not consumed."""
    p = np.int64(prod[0])
    acquire_fence()  # descriptor loads after the index load
    return (p - np.int64(cons[0])) & U32_MASK


@njit(cache=True, nogil=True)
def cons_release(cons, n):
    """Hand n consumed slots back to the kernel."""
    release_fence()  # our descriptor loads finish before the kernel may reuse the slots
    cons[0] = np.uint32((np.int64(cons[0]) + n) & U32_MASK)


@njit(cache=True, nogil=True)
def needs_wakeup(flags):
    """True when the kernel asked for a syscall kick (XDP_RING_NEED_WAKEUP)."""
    return (flags[0] & RING_NEED_WAKEUP) != 0


# --------------------------------------------------------------------------- frame pool
# A LIFO stack of free chunk addresses: stack[0:top[0]] are free.  LIFO hands back the
# most recently used (cache-warm) frames first.  top is int64[1] so jitted code can update it.


@njit(cache=True, nogil=True)
def frame_alloc(stack, top, out, n):
    """Pop up to n free frame addresses into out[0:k]; return k."""
    t = top[0]
    k = min(n, t, out.shape[0])
    for i in range(k):
        t -= 1
        out[i] = stack[t]
    top[0] = t
    return k


@njit(cache=True, nogil=True)
def frame_free(stack, top, addrs, n, frame_mask):
    """Push n frames back, rounding each address down to its chunk start; return count.

    Returns fewer than n only if the stack is full, which means a frame was freed twice."""
    t = top[0]
    cap = stack.shape[0]
    k = 0
    while k < n and t < cap:
        stack[t] = addrs[k] & frame_mask
        t += 1
        k += 1
    top[0] = t
    return k


# --------------------------------------------------------------------------- ring bursts


@njit(cache=True, nogil=True)
def fill_ring_refill(fq_prod, fq_cons, fq_addrs, stack, top, max_n):
    """Move up to max_n free frames from the pool to the fill ring; return count."""
    size = fq_addrs.shape[0]
    n = min(prod_free(fq_prod, fq_cons, size), max_n, top[0])
    if n <= 0:
        return 0
    mask = size - 1
    idx = np.int64(fq_prod[0])
    t = top[0]
    for i in range(n):
        t -= 1
        fq_addrs[(idx + i) & mask] = stack[t]
    top[0] = t
    prod_submit(fq_prod, n)
    return n


@njit(cache=True, nogil=True)
def rx_burst(rx_prod, rx_cons, rx_descs, out_addr, out_len, max_n):
    """Take up to max_n received frames: out_addr[i], out_len[i]; return count.

    The frames now belong to the caller until it frees them (frame_free) or recycles them
    to the fill ring; the RX slots are released before returning."""
    n = min(cons_avail(rx_prod, rx_cons), max_n, out_addr.shape[0], out_len.shape[0])
    if n <= 0:
        return 0
    mask = rx_descs.shape[0] - 1
    idx = np.int64(rx_cons[0])
    for i in range(n):
        j = (idx + i) & mask
        out_addr[i] = rx_descs[j, 0]
        out_len[i] = rx_descs[j, 1] & DESC_LEN_MASK
    cons_release(rx_cons, n)
    return n


@njit(cache=True, nogil=True)
def tx_burst(tx_prod, tx_cons, tx_descs, addrs, lens, n):
    """Queue up to n frames (addrs[i], lens[i]) on the TX ring; return count queued.

    Does not kick the kernel: the caller checks needs_wakeup(tx_flags) and calls
    sendto() (XskSocket.kick_tx) because a syscall is not possible from jitted code."""
    size = tx_descs.shape[0]
    k = min(prod_free(tx_prod, tx_cons, size), n)
    if k <= 0:
        return 0
    mask = size - 1
    idx = np.int64(tx_prod[0])
    for i in range(k):
        j = (idx + i) & mask
        tx_descs[j, 0] = addrs[i]
        tx_descs[j, 1] = np.uint64(lens[i]) & DESC_LEN_MASK  # options = 0: single buffer
    prod_submit(tx_prod, k)
    return k


@njit(cache=True, nogil=True)
def comp_reap(cq_prod, cq_cons, cq_addrs, stack, top, frame_mask, max_n):
    """Return up to max_n completed TX frames to the pool; return count."""
    n = min(cons_avail(cq_prod, cq_cons), max_n, stack.shape[0] - top[0])
    if n <= 0:
        return 0
    mask = cq_addrs.shape[0] - 1
    idx = np.int64(cq_cons[0])
    t = top[0]
    for i in range(n):
        stack[t] = cq_addrs[(idx + i) & mask] & frame_mask
        t += 1
    top[0] = t
    cons_release(cq_cons, n)
    return n


# --------------------------------------------------------------------------- multi-buffer (XDP_USE_SG)


@njit(cache=True, nogil=True)
def rx_burst_sg(rx_prod, rx_cons, rx_descs, frames, out_addr, out_len, stack, top, slot_mask, stats, max_n):
    """Take up to max_n received packets, each as ONE contiguous frame out_addr[i], out_len[i]
    (the caller owns those frames, as after rx_burst).

    A packet in several descriptors (XDP_PKT_CONTD on all but the last) is reassembled in
    its first buffer's slot: the later buffers' bytes are copied right after the first
    buffer's, into the rest of that slot (never on the fill ring), and the later buffers'
    slots go straight back to the pool (stack, top).  A packet that does not fit in its
    slot is dropped, all its slots returned (stats[0] += 1); stats[1] counts reassembled
    packets.  A packet whose last descriptor is not published yet stays in the ring for
    the next call.  Returns the number of packets."""
    avail = cons_avail(rx_prod, rx_cons)
    mask = rx_descs.shape[0] - 1
    idx = np.int64(rx_cons[0])
    slot = np.int64(~slot_mask) + 1
    inner = ~slot_mask
    cap = stack.shape[0]
    np_ = 0
    used = np.int64(0)
    lim_out = min(max_n, out_addr.shape[0], out_len.shape[0])
    contd = np.uint64(PKT_CONTD) << np.uint64(32)
    while np_ < lim_out and used < avail:
        # single-buffer packets: the same loop as rx_burst plus one flag test
        run = min(avail - used, lim_out - np_)
        for _ in range(run):
            j0 = (idx + used) & mask
            w1 = rx_descs[j0, 1]
            if w1 & contd:
                break
            out_addr[np_] = rx_descs[j0, 0]
            out_len[np_] = w1 & DESC_LEN_MASK
            np_ += 1
            used += 1
        if np_ >= lim_out or used >= avail:
            break
        j0 = (idx + used) & mask                   # a multi-buffer packet starts here
        w1 = rx_descs[j0, 1]
        a0 = rx_descs[j0, 0]
        k = used + 1                               # find the packet's last descriptor
        while k < avail and rx_descs[(idx + k) & mask, 1] & contd:
            k += 1
        if k >= avail:
            break                                  # incomplete: wait for the rest
        nd = k - used + 1
        if top[0] + nd > cap:
            break                                  # cannot happen unless a frame was freed twice
        total = np.int64(w1 & DESC_LEN_MASK)
        room = slot - np.int64(a0 & inner)
        t = top[0]
        for d in range(1, nd):
            jd = (idx + used + d) & mask
            ad = rx_descs[jd, 0]
            ld = np.int64(rx_descs[jd, 1] & DESC_LEN_MASK)
            if total + ld <= room:
                dst = np.int64(a0) + total
                src = np.int64(ad)
                frames[dst:dst + ld] = frames[src:src + ld]
            total += ld
            stack[t] = ad & slot_mask
            t += 1
        if total <= room:
            out_addr[np_] = a0
            out_len[np_] = total
            np_ += 1
            stats[1] += 1
        else:
            stack[t] = a0 & slot_mask              # too long for a slot: dropped
            t += 1
            stats[0] += 1
        top[0] = t
        used += nd
    if used:
        cons_release(rx_cons, used)
    return np_


@njit(cache=True, nogil=True)
def tx_burst_sg(tx_prod, tx_cons, tx_descs, addrs, lens, n, chunk):
    """Queue up to n frames on the TX ring, a frame longer than what is left of its chunk
    as chained descriptors (XDP_PKT_CONTD on all but the last), each within one chunk; the
    frame's bytes are contiguous from addrs[i] (the chunks of a slot are adjacent).  Only
    whole frames are queued.  Returns the number of frames queued."""
    size = tx_descs.shape[0]
    free = prod_free(tx_prod, tx_cons, size)
    mask = size - 1
    idx = np.int64(tx_prod[0])
    w = np.int64(0)
    k = 0
    cmask = np.uint64(chunk - 1)
    while k < n:
        a = np.uint64(addrs[k])
        ln = np.int64(lens[k])
        first = np.int64(chunk) - np.int64(a & cmask)
        if ln <= first:                            # one descriptor: as tx_burst
            if w >= free:
                break
            j = (idx + w) & mask
            tx_descs[j, 0] = a
            tx_descs[j, 1] = np.uint64(ln) & DESC_LEN_MASK
            w += 1
            k += 1
            continue
        nd = 1 + (ln - first + chunk - 1) // chunk
        if w + nd > free:
            break
        left = ln
        take = min(left, first)
        while True:
            j = (idx + w) & mask
            tx_descs[j, 0] = a
            left -= take
            opt = np.uint64(PKT_CONTD) if left > 0 else np.uint64(0)
            tx_descs[j, 1] = (np.uint64(take) & DESC_LEN_MASK) | (opt << np.uint64(32))
            w += 1
            if left <= 0:
                break
            a = a + np.uint64(take)
            take = min(left, np.int64(chunk))
        k += 1
    if w:
        prod_submit(tx_prod, w)
    return k


@njit(cache=True, nogil=True)
def comp_reap_sg(cq_prod, cq_cons, cq_addrs, stack, top, slot_mask, chunk, max_n):
    """comp_reap for the slot layout: each completed descriptor comes back, but only one
    that lies in the first chunk of its slot returns the slot to the pool (the later
    descriptors of a chained frame lie in the slot's later chunks).  Returns the number of
    completion entries consumed."""
    n = min(cons_avail(cq_prod, cq_cons), max_n)
    if n <= 0:
        return 0
    mask = cq_addrs.shape[0] - 1
    idx = np.int64(cq_cons[0])
    t = top[0]
    cap = stack.shape[0]
    inner = ~slot_mask
    k = 0
    while k < n:
        a = cq_addrs[(idx + k) & mask]
        if (a & inner) < np.uint64(chunk):
            if t >= cap:
                break
            stack[t] = a & slot_mask
            t += 1
        k += 1
    top[0] = t
    cons_release(cq_cons, k)
    return k


# --------------------------------------------------------------------------- Python side


class FramePool:
    """Free list of UMEM chunk addresses, as the two arrays the jitted functions take.

    `stack` (uint64[nframes]) and `top` (int64[1]) are public so an engine's own jitted
    loop can pass them straight to frame_alloc / fill_ring_refill / comp_reap."""

    def __init__(self, nframes: int, frame_size: int):
        if frame_size & (frame_size - 1):
            raise ValueError(f"frame_size {frame_size} must be a power of two")
        self.nframes = nframes
        self.frame_size = frame_size
        # Reversed so the first pops return frames 0, 1, 2, ... (easier to read in dumps).
        self.stack = (np.arange(nframes, dtype=np.uint64) * np.uint64(frame_size))[::-1].copy()
        self.top = np.array([nframes], dtype=np.int64)
        self.frame_mask = np.uint64(~(frame_size - 1) & 0xFFFFFFFFFFFFFFFF)

    @property
    def free_count(self) -> int:
        return int(self.top[0])

    def alloc(self, n: int) -> np.ndarray:
        out = np.empty(n, dtype=np.uint64)
        k = frame_alloc(self.stack, self.top, out, n)
        return out[:k]

    def free(self, addrs) -> None:
        addrs = np.ascontiguousarray(addrs, dtype=np.uint64)
        k = frame_free(self.stack, self.top, addrs, addrs.shape[0], self.frame_mask)
        if k != addrs.shape[0]:
            raise RuntimeError(
                f"frame pool overflow: freed {addrs.shape[0]} frames, room for {k}; "
                "a frame was freed twice (check RX recycle and completion handling)"
            )
