"""The in-process compiled plane's entry points: `dp_round` (one round of the port) and `dp_run` (rounds in
a GIL-free loop until Python must see something), both around round.py's `round_` -- see round.py's docstring
for what a round does.  dp.Plane calls them (progress(), run(), its progress thread).

They live in a module of their own so that metaroced, which drives its planes only through dp/serve.py's
dp_serve, does not load them from numba's cache at start (two of the largest entries: ~0.25 s of CPU).
Importing this module loads them (explicit signatures, cache=True); compiling is disabled after definition.
"""
from __future__ import annotations

import numpy as np
from numba import njit
from numba import types as nbt
from .. import jitcache  # noqa: F401,E402  (cache keyed on every module compiled code depends on)

from .layout import (MAGIC, N_P, P_CQE_OUT, P_EFD, P_EV_HEAD, P_EV_TAIL, P_IDLE_POLLS, P_MAGIC, P_N_ACT, P_NOW,
                     P_NPOLLFD, P_PAUSE, P_POLL_MS, P_POLLFD, P_RDY_HEAD, P_RDY_TAIL, P_SLEEPING, P_SPIN_IDLE, P_STOP,
                     P_TXN, P_WAKEUPS, P_YIELD_AFTER, P_YIELDS)
from .round import round_, views
from ..native.plane_tx import nat_kern_sleep
from .prims import c_monotonic_ns, c_poll, c_read8, c_sched_yield, ld_acq_i64, ld_acq_u8, st_rel_i64, unowned

_jit = dict(cache=True, nogil=True)


@njit(nbt.int64(nbt.int64[::1], nbt.uint8[:, ::1], nbt.uint8[::1], nbt.uint32[:, ::1]), **_jit)
def dp_round(A, TM, umem, tables):
    """One progress round of the port whose state is A (see the module docstring)."""
    if A[P_MAGIC] != MAGIC:
        return -1
    A, TM, umem, tables = unowned(A), unowned(TM), unowned(umem), unowned(tables)   # no refcounts below
    ext = np.empty(32, np.uint8)
    now = c_monotonic_ns()
    A[P_NOW] = now
    Q, SW, RW, CE, CQT, MRT = views(A, TM)
    return round_(A, Q, SW, RW, CE, CQT, MRT, TM, umem, tables, ext, now)


@njit(nbt.int64(nbt.int64[::1], nbt.uint8[:, ::1], nbt.uint8[::1], nbt.uint32[:, ::1], nbt.int64, nbt.int64,
                nbt.int64, nbt.int64), **_jit)
def dp_run(A, TM, umem, tables, max_ns, watch_addr, watch_val, sleep_ok):
    """Rounds until something Python must see, without the GIL: returns 1 when events are queued,
    2 when asked to stop or pause, 3 when the byte at watch_addr (if any) equals watch_val, 4 when
    a completion was added (watch_val = -2; -3: either, the byte nonzero or a completion -- metaroced's
    doorbell), 0 when max_ns passed.  Idle, with sleep_ok, it sleeps
    in poll() on the AF_XDP socket and the port's eventfd (a post writes it) after spin_idle rounds."""
    if A[P_MAGIC] != MAGIC:
        return -1
    A, TM, umem, tables = unowned(A), unowned(TM), unowned(umem), unowned(tables)   # no refcounts below
    ext = np.empty(32, np.uint8)
    Q, SW, RW, CE, CQT, MRT = views(A, TM)
    start = c_monotonic_ns()
    now = start
    idle = 0
    cqe0 = A[P_CQE_OUT]
    while True:
        if idle & 7 == 0:                    # the clock costs more than an idle round: read it every 8th
            now = c_monotonic_ns()
            A[P_NOW] = now
        w = round_(A, Q, SW, RW, CE, CQT, MRT, TM, umem, tables, ext, now)
        if A[P_EV_TAIL] != A[P_EV_HEAD]:
            return 1
        if ld_acq_i64(A, P_STOP) or ld_acq_i64(A, P_PAUSE):
            return 2
        if watch_addr != 0 and (ld_acq_u8(watch_addr) == watch_val or (watch_val == -3 and ld_acq_u8(watch_addr))):
            return 3
        if (watch_val == -2 or watch_val == -3) and A[P_CQE_OUT] != cqe0:
            return 4
        if now - start >= max_ns:
            return 0
        if w:
            idle = 0
            continue
        idle += 1
        A[P_IDLE_POLLS] += 1
        if A[P_YIELD_AFTER] > 0 and idle % A[P_YIELD_AFTER] == 0:
            c_sched_yield()                              # a loaded host: the CPU to whoever can use it
            A[P_YIELDS] += 1
        if sleep_ok and idle > A[P_SPIN_IDLE] and A[P_N_ACT] == 0 and A[P_TXN] == 0:
            st_rel_i64(A, P_SLEEPING, 1)
            if nat_kern_sleep(A, Q, 1) == 0 and ld_acq_i64(A, P_RDY_TAIL) == A[P_RDY_HEAD] \
                    and not ld_acq_i64(A, P_STOP) and not ld_acq_i64(A, P_PAUSE):
                left = (max_ns - (now - start)) // 1000000
                c_poll(A[P_POLLFD], A[P_NPOLLFD], max(0, min(A[P_POLL_MS], left)))
            nat_kern_sleep(A, Q, 0)                      # SACKs to the kernel's rings again (native/plane.py)
            st_rel_i64(A, P_SLEEPING, 0)
            c_read8(A[P_EFD], A[P_POLLFD] + 8 * A[P_NPOLLFD])          # drain the eventfd (non-blocking)
            A[P_WAKEUPS] += 1
            idle = 0


SIGNATURES = {"dp_round": dp_round, "dp_run": dp_run}
for _f in SIGNATURES.values():
    _f.disable_compile()        # a call with other types fails at once instead of compiling on a live path
del _f


def warm_plan() -> list[tuple[str, str, tuple]]:
    """(name, why, args) for metaroce_xdp.jitwarm: the entry points with their run-time types on an
    arena that is not a port (magic 0), so each returns at once."""
    from ..wire.fastpath import TABLES
    A = np.zeros(N_P, np.int64)
    TM = np.zeros((2, 128), np.uint8)
    umem = np.zeros(4096, np.uint8)
    return [("dp_round", "dp.Plane.progress", (A, TM, umem, TABLES)),
            ("dp_run", "dp.Plane.run / the progress thread", (A, TM, umem, TABLES, 0, 0, 0, 0))]
