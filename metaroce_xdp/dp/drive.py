"""Compiled application loops over the compiled data plane: post, progress and poll in one call.

An application written in Python pays a few microseconds per verbs call (building a SendWR,
validating it, creating a WC object): at 8-byte messages that, not the data plane, sets the
message rate, and on the 64 KiB stream it costs a tenth of the sender's CPU.  These entry
points do what perftest's C loops do -- keep DEPTH work requests outstanding on each QP,
reap completions, timestamp them; or ping-pong one WRITE for latency -- inside one compiled,
GIL-free call that runs the port's progress rounds (round.round_) in between, on the same
tables Python's verbs use (the SQ rings, the CQ ring), so QP.post_send and CQ.poll stay valid
before and after.

* `sq_post_n(A, qi, wqe, n)`: n copies of a send WQE row (what QP.send_wqe validated and
  built) appended to QP qi's send queue and the QP marked ready -- a batch post for any
  compiled or Python caller (a progress thread picks it up through the ready ring).
* `dp_drive_bw(...)`: write-bw/read-bw/send-bw on several QPs at once (one CQ), resumable:
  returns to Python every max_ns (watchdog), for events, or when done.  Busy polling, or (sleep_ok)
  idle waits in ppoll() until the next timer or pacing deadline of a native QP, a frame on the
  socket (its SACKs are steered there while it sleeps) or a post.
* `dp_drive_lat(...)`: perftest's write_lat loop, waits on the watched byte inside the loop.

Explicit signatures, cache=True, compiling disabled after import (as dp/inproc.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit
from numba import types as nbt
from .. import jitcache  # noqa: F401,E402  (cache keyed on every module compiled code depends on)

from ..native import layout as NL
from .layout import (N_P, C_BASE, C_HEAD, C_SIZE, C_TAIL, E_STATUS, E_WR_ID, N_RDY, NW, P_EFD, P_EV_HEAD, P_EV_TAIL,
                     P_IDLE_POLLS, P_MAGIC, P_NOW, P_POLLFD, P_RDY_HEAD, P_RDY_OFF, P_RDY_TAIL, P_RX, P_SLEEPING,
                     P_TXN, P_WAKEUPS, P_YIELD_AFTER, P_YIELDS, MAGIC, Q_SQ_BASE, Q_SQ_HEAD, Q_SQ_SIZE, Q_SQ_TAIL)
from .core import activate
from .round import round_, views
from ..native.plane_slot import nat_slot, rows, slot_base
from ..native.plane_tx import nat_kern_sleep, pace_slack
from .prims import (c_monotonic_ns, c_ppoll_ns, c_read8, c_sched_yield, ld_acq_i64, ld_acq_u8, st_rel_i64, st_rel_u8,
                    unowned)

_jit = dict(cache=True, nogil=True)

_A = nbt.int64[::1]
_TM = nbt.uint8[:, ::1]
_U = nbt.uint8[::1]
_T = nbt.uint32[:, ::1]


@njit(**_jit)
def _sq_write(Q, SW, qi, wqe, n):
    """Append up to n copies of wqe to QP qi's SQ; returns how many fit."""
    tail = Q[qi, Q_SQ_TAIL]
    size = Q[qi, Q_SQ_SIZE]
    room = size - (tail - ld_acq_i64(Q[qi], Q_SQ_HEAD))
    if n > room:
        n = room
    base = Q[qi, Q_SQ_BASE]
    for i in range(n):
        r = base + ((tail + i) & (size - 1))
        for c in range(NW):
            SW[r, c] = wqe[c]
    st_rel_i64(Q[qi], Q_SQ_TAIL, tail + n)          # published after the rows
    return n


@njit(nbt.int64(_A, _TM, nbt.int64, nbt.int64[::1], nbt.int64), **_jit)
def sq_post_n(A, TM, qi, wqe, n):
    """n copies of the send WQE row `wqe` on QP qi's send queue, the QP put in the ready ring (the
    progress loop, in this thread or another, activates it).  Returns how many were posted (fewer
    when the queue is full).  The caller holds Plane.post_lock when other threads post too."""
    if A[P_MAGIC] != MAGIC:
        return -1
    Q, SW, RW, CE, CQT, MRT = views(A, TM)
    k = _sq_write(Q, SW, qi, wqe, n)
    if k > 0:
        t = A[P_RDY_TAIL]
        A[A[P_RDY_OFF] + (t & (N_RDY - 1))] = qi
        st_rel_i64(A, P_RDY_TAIL, t + 1)
    return k


SLEEP_MAX_NS = 1_000_000          # a sleeping bw loop looks again at least this often
SLEEP_MIN_NS = 20_000             # a deadline nearer than this is waited for spinning (a wake-up costs ~10 us)


@njit(**_jit)
def _idle_ns(A, W, now):
    """How long dp_drive_bw may sleep: until the earliest timer (RTO, probe, reordering, RNR) or
    pacing deadline of W's QPs, at most SLEEP_MAX_NS; 0 when one of them is a compat QP (its ACKs are
    taken by the XDP program into the kernel slot: nothing would wake the loop)."""
    t = now + SLEEP_MAX_NS
    for q in range(W.shape[0]):
        sl = nat_slot(A, W[q, 0])
        if sl < 0:
            return 0
        par, rx, s, nx, sb, pt = rows(A, slot_base(A, sl))
        for c in (NL.S_RNR_UNTIL, NL.S_RTO_AT, NL.S_PTO_AT, NL.S_REO_AT):
            if s[c] != NL.NONE and s[c] < t:
                t = s[c]
        p = s[NL.S_NEXT_SEND] - pace_slack(s, par)      # nat_requester sends from here on (MR-CC-004)
        if p > now and p < t:
            t = p
    return t - now


@njit(nbt.int64(_A, _TM, _U, _T, nbt.int64[:, ::1], nbt.int64[::1], nbt.int64[::1], nbt.int64, nbt.int64,
                nbt.int64, nbt.int64), **_jit)
def dp_drive_bw(A, TM, umem, tables, W, S, done_ns, cq, depth, max_ns, sleep_ok):
    """Keep `depth` WQEs outstanding on each of the QPs of W until each has completed S[1] of them.

    W[q] = (qi, the NW fields of the WQE row; wr_id = q).  S (in/out): S[0] completions so far,
    S[1] iterations per QP, S[2] status of a failed completion + 1 (0: none), S[3] its wr_id,
    S[4 + q] posted on QP q, S[4 + nq + q] completed on QP q.  done_ns[i]: the clock at the
    i-th completion.  Returns 0 when every QP is done,
    1 when events wait for Python, 3 on a failed completion, 4 after max_ns (call again).
    sleep_ok: after P_YIELD_AFTER idle rounds (nothing received, sent or completed) with native QPs only,
    sleep in ppoll() on the AF_XDP socket and the eventfd until _idle_ns's deadline (timers, pacing),
    the kernel steering the QPs' SACKs to the socket meanwhile (nat_kern_sleep) so that one wakes it:
    on a host with fewer cores than busy loops, the peer's loop and the other senders run instead of
    this one spinning out its time slice (tools/bench_fabric's incast)."""
    if A[P_MAGIC] != MAGIC:
        return -1
    A, TM, umem, tables = unowned(A), unowned(TM), unowned(umem), unowned(tables)   # no refcounts below
    W, S, done_ns = unowned(W), unowned(S), unowned(done_ns)
    ext = np.empty(32, np.uint8)
    Q, SW, RW, CE, CQT, MRT = views(A, TM)
    nq = W.shape[0]
    iters = S[1]
    total = nq * iters
    start = c_monotonic_ns()
    now = start
    csize = CQT[cq, C_SIZE]
    cbase = CQT[cq, C_BASE]
    idle = 0
    while True:
        # post: top every QP up to `depth` outstanding
        for q in range(nq):
            out = S[4 + q] - S[4 + nq + q]
            room = min(depth - out, iters - S[4 + q])
            if room > 0:
                qi = W[q, 0]
                k = _sq_write(Q, SW, qi, W[q, 1:], room)
                if k > 0:
                    S[4 + q] += k
                    activate(A, Q, qi)
        now = c_monotonic_ns()
        A[P_NOW] = now
        w = round_(A, Q, SW, RW, CE, CQT, MRT, TM, umem, tables, ext, now)
        # reap
        head = CQT[cq, C_HEAD]
        tail = ld_acq_i64(CQT[cq], C_TAIL)
        if w or head != tail:
            idle = 0
        else:
            idle += 1                                # waiting on the peer (window, ACKs)
            A[P_IDLE_POLLS] += 1
            if A[P_YIELD_AFTER] > 0 and idle % A[P_YIELD_AFTER] == 0:
                wait = _idle_ns(A, W, now) if sleep_ok and A[P_TXN] == 0 else 0
                if wait >= SLEEP_MIN_NS:
                    st_rel_i64(A, P_SLEEPING, 1)
                    if nat_kern_sleep(A, Q, 1) == 0 and ld_acq_i64(A, P_RDY_TAIL) == A[P_RDY_HEAD]:
                        c_ppoll_ns(A[P_POLLFD], 2, min(wait, max(0, max_ns - (now - start))))
                    nat_kern_sleep(A, Q, 0)          # SACKs to the kernel's rings again
                    st_rel_i64(A, P_SLEEPING, 0)
                    c_read8(A[P_EFD], A[P_POLLFD] + 16)      # drain the eventfd (non-blocking)
                    A[P_WAKEUPS] += 1
                    idle = 0
                else:
                    c_sched_yield()                  # a loaded host: the CPU to whoever can use it
                    A[P_YIELDS] += 1
        if head != tail:
            t = c_monotonic_ns()
            while head != tail:
                r = cbase + (head & (csize - 1))
                st = CE[r, E_STATUS]
                q = CE[r, E_WR_ID]
                head += 1
                if st != 0 or q < 0 or q >= nq:
                    st_rel_i64(CQT[cq], C_HEAD, head)
                    S[2] = st + 1
                    S[3] = q
                    return 3
                if S[0] < done_ns.shape[0]:
                    done_ns[S[0]] = t
                S[0] += 1
                S[4 + nq + q] += 1
            st_rel_i64(CQT[cq], C_HEAD, head)
        if S[0] >= total:
            return 0
        if A[P_EV_TAIL] != A[P_EV_HEAD]:
            return 1
        if now - start >= max_ns:
            return 4


@njit(nbt.int64(_A, _TM, _U, _T, nbt.int64[::1], nbt.int64, nbt.int64, nbt.int64, nbt.int64, nbt.int64, nbt.int64,
                nbt.int64[::1], nbt.int64), **_jit)
def dp_drive_lat(A, TM, umem, tables, wqe, qi, cq, post_addr, poll_addr, iters, sends_first, posted_ns, stall_ns):
    """perftest's write_lat: each side writes its counter's low byte into the last byte of the message
    (post_addr) and posts the WRITE; it answers the peer's write, seen as the byte at poll_addr
    changing.  posted_ns[i]: the clock at the i-th post.  Returns 0 when done, -2 when nothing
    arrived for stall_ns, -1 for events (a QP error), 100 + status of a failed completion."""
    if A[P_MAGIC] != MAGIC:
        return -1
    A, TM, umem, tables = unowned(A), unowned(TM), unowned(umem), unowned(tables)   # no refcounts below
    wqe, posted_ns = unowned(wqe), unowned(posted_ns)
    ext = np.empty(32, np.uint8)
    Q, SW, RW, CE, CQT, MRT = views(A, TM)
    csize = CQT[cq, C_SIZE]
    cbase = CQT[cq, C_BASE]
    scnt = 0
    rcnt = 0
    ccnt = 0
    while scnt < iters or ccnt < iters or rcnt < iters:
        if rcnt < iters and not (scnt < 1 and sends_first):
            rcnt += 1
            want = rcnt & 0xFF
            t0 = c_monotonic_ns()
            rx0 = A[P_RX]
            n = 0
            while ld_acq_u8(poll_addr) != want:
                now = c_monotonic_ns()
                round_(A, Q, SW, RW, CE, CQT, MRT, TM, umem, tables, ext, now)
                n += 1
                if (n & 255) == 0:
                    if A[P_EV_TAIL] != A[P_EV_HEAD]:
                        return -1
                    if A[P_RX] != rx0:
                        rx0 = A[P_RX]
                        t0 = now
                    elif now - t0 > stall_ns:
                        return -2
        if scnt < iters:
            posted_ns[scnt] = c_monotonic_ns()
            scnt += 1
            st_rel_u8(post_addr, scnt & 0xFF)
            _sq_write(Q, SW, qi, wqe, 1)
            activate(A, Q, qi)
        if ccnt < iters:
            t0 = c_monotonic_ns()
            n = 0
            while True:
                head = CQT[cq, C_HEAD]
                if head != ld_acq_i64(CQT[cq], C_TAIL):
                    r = cbase + (head & (csize - 1))
                    st = CE[r, E_STATUS]
                    st_rel_i64(CQT[cq], C_HEAD, head + 1)
                    if st != 0:
                        return 100 + st
                    ccnt += 1
                    break
                now = c_monotonic_ns()
                round_(A, Q, SW, RW, CE, CQT, MRT, TM, umem, tables, ext, now)
                n += 1
                if (n & 255) == 0:
                    if A[P_EV_TAIL] != A[P_EV_HEAD]:
                        return -1
                    if now - t0 > stall_ns:
                        return -2
    return 0


SIGNATURES = {"sq_post_n": sq_post_n, "dp_drive_bw": dp_drive_bw, "dp_drive_lat": dp_drive_lat}
for _f in SIGNATURES.values():
    _f.disable_compile()        # a call with other types fails at once instead of compiling on a live path
del _f


def warm_plan() -> list[tuple[str, str, tuple]]:
    """(name, why, args) for metaroce_xdp.jitwarm, on an arena that is not a port (magic 0)."""
    from ..wire.fastpath import TABLES
    A = np.zeros(N_P, np.int64)
    TM = np.zeros((2, 128), np.uint8)
    umem = np.zeros(4096, np.uint8)
    w = np.zeros(NW, np.int64)
    i8 = np.zeros(8, np.int64)
    return [("sq_post_n", "QP.post_send_n (batch post)", (A, TM, 0, w, 0)),
            ("dp_drive_bw", "metaroce perf bw tests, compiled plane", (A, TM, umem, TABLES, np.zeros((1, NW + 1), np.int64),
                                                                       i8, i8, 0, 0, 0, 0)),
            ("dp_drive_lat", "metaroce perf write-lat, compiled plane", (A, TM, umem, TABLES, w, 0, 0, 0, 0, 0, 0, i8, 0))]
