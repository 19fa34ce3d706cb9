"""The verbs API over the compiled data plane: Context, PD, MR, CQ, QP as in the README.

    from metaroce_xdp.dp import Context
    ctx = Context.open("eth1")             # XDP program + AF_XDP socket + compiled loop
    pd = ctx.alloc_pd(); mr = pd.reg_mr(buf, Access.LOCAL_WRITE | Access.REMOTE_WRITE)
    cq = ctx.create_cq(256); qp = ctx.create_qp(pd, cq, cq)
    qp.modify(QPAttr(...INIT...)); qp.modify(QPAttr(...RTR...)); qp.modify(QPAttr(...RTS...))
    qp.post_send(SendWR(...)); cq.poll()

Python is the control plane: it validates and writes work requests into the arrays of
layout.py, marks the QP in the ready ring and wakes the loop; QP state changes pause the
loop for the moment of the change.  The packet work is all in round.round_, run by inproc.dp_round / dp_run.

ATOMICs, SEND WITH INVALIDATE (remote_invalidate MRs), gather/scatter lists, FENCE, SQD and
completion channels (solicited events too) are dp/core.py's.  Multi-buffer ports (XDP_USE_SG, path
MTU 4096 on an interface MTU >= 4178) are the loop's (rx_burst_sg, tx_descs_sg).  Not implemented by
this plane, refused with `Unsupported` (a typed InvalidArgument): native profile.
"""
from __future__ import annotations

import functools
import ipaddress
import os
import secrets
import struct
import threading
import time
from typing import Any

import numpy as np

from collections import deque

from ..compchannel import CompChannelBase
from ..tunables import Tunables
from ..tunables import load as load_tunables
from ..verbs_types import AsyncEvent, AsyncEventQueue, EventType, Unsupported
from ..netinfo import NetInfoError, PathWatch
from ..verbs import ATOMIC_OPCODES, QP_RX_COUNTERS, PostRules, check_post_state, check_send_wr, check_sg_list
from ..verbs_types import (PATH_MTUS, SGE, Access, Busy, InvalidArgument, InvalidState, QPAttr, QPCap, QPState,
                           QueueFull, RecvWR, ResourceError, SendFlags, SendWR, VerbsError, WC, WCFlags, WCOpcode,
                           WCStatus, WROpcode, local_ack_timeout_ns)
from . import layout as L
from . import reasons
from .reasons import Why

_MESSAGE_IN_PROGRESS = {L.RK_NONE: "no message in progress", L.RK_SEND: "a SEND in progress",
                        L.RK_WRITE: "a WRITE in progress"}
_EV_TYPE = {L.EV_QP_FATAL: EventType.QP_FATAL, L.EV_CQ_ERR: EventType.CQ_ERR,
            L.EV_QP_REQ_ERR: EventType.QP_REQ_ERR, L.EV_QP_ACCESS_ERR: EventType.QP_ACCESS_ERR}
# What post_send takes on this plane (verbs.check_send_wr): every send opcode and flag, any number of SGEs up to
# the QP's max_send_sge (an SG table row each), posts in RTS, SQD and ERR.
COMPILED_POST = PostRules("the compiled plane")
_NOTIFY_NEXT, _NOTIFY_SOLICITED = 1, 2         # CQ.armed (dp/core.py cq_notify)
# MR-QP-005 (Table 7-2): the attributes each transition takes, required or optional.  IBV_QP_AV is dgid, dmac,
# sport, dscp and ecn here.  Like the reference endpoint, RTS -> RTS and SQD -> RTS also take the requester's timeout
# and retry counts.  cur_qp_state, alt_path, path_mig_state and profile have checks of their own (MR-QP-006,
# MR-QP-008, MR-NAT-003); qp_state is the transition itself.
_AV_ATTRS = {"dgid", "dmac", "sport", "dscp", "ecn"}
# QP.rx_counters (verbs.QP_RX_COUNTERS): the loop's (Q row) and, for responses, the XDP program's (the QP's
# slot: ghost_acks, stale_acks).  Counted per source address too (Context.source_counters).
_TAKES = {
    (QPState.RESET, QPState.INIT): {"qp_access_flags", "pkey_index", "port_num"},
    (QPState.INIT, QPState.INIT): {"qp_access_flags", "pkey_index", "port_num"},
    (QPState.INIT, QPState.RTR): _AV_ATTRS | {"path_mtu", "dest_qp_num", "rq_psn", "max_dest_rd_atomic",
                                              "min_rnr_timer", "pkey_index", "qp_access_flags", "native_params"},
    (QPState.RTR, QPState.RTS): {"sq_psn", "timeout", "retry_cnt", "rnr_retry", "max_rd_atomic", "qp_access_flags",
                                 "min_rnr_timer"},
    (QPState.RTS, QPState.RTS): {"qp_access_flags", "min_rnr_timer", "timeout", "retry_cnt", "rnr_retry"},
    (QPState.RTS, QPState.SQD): {"en_sqd_async_notify"},
    (QPState.SQD, QPState.SQD): _AV_ATTRS | {"timeout", "retry_cnt", "rnr_retry", "max_rd_atomic", "max_dest_rd_atomic",
                                             "qp_access_flags", "pkey_index", "min_rnr_timer"},
    (QPState.SQD, QPState.RTS): {"qp_access_flags", "min_rnr_timer", "timeout", "retry_cnt", "rnr_retry"},
    (QPState.SQE, QPState.RTS): {"qp_access_flags"},
}
_OWN_CHECKS = {"qp_state", "cur_qp_state", "alt_path", "path_mig_state", "profile"}
_RANGES = {"timeout": (0, 31), "min_rnr_timer": (0, 31), "retry_cnt": (0, 7), "rnr_retry": (0, 7),
           "max_rd_atomic": (0, 16), "max_dest_rd_atomic": (0, 16)}     # Table 7-3
DEFAULT_DSCP = 26          # a QP's DSCP unless its address vector says otherwise: every packet but CNPs (MR-ECN-004)


def _i64(v: int) -> int:
    """A 64-bit unsigned field (wr_id, addresses) as the int64 the tables hold."""
    v &= 0xFFFFFFFFFFFFFFFF
    return v - (1 << 64) if v >= 1 << 63 else v


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p <<= 1
    return p


# XdpLoaders built beforehand, by interface: Context.open takes one instead of compiling the XDP program
# (metaroced compiles it in a thread while numba loads: start to READY)
PREBUILT_LOADERS: dict[str, Any] = {}


def _loader_for(ifname: str) -> Any:
    from ..kern.loader import XdpLoader
    ld = PREBUILT_LOADERS.pop(ifname, None)
    return ld if ld is not None else XdpLoader(max_qps=L.MAX_QPS)


def as_u8(buf: Any) -> np.ndarray:
    """A writable flat uint8 view over the caller's memory (numpy array, bytearray, memoryview)."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise InvalidArgument("MR memory must be C-contiguous")
        if not buf.flags.writeable:
            raise InvalidArgument("MR memory must be writable")
        return buf.reshape(-1).view(np.uint8)
    if isinstance(buf, (bytearray, memoryview)):
        mv = memoryview(buf)
        if mv.readonly:
            raise InvalidArgument("MR memory must be writable (bytes is read-only: use bytearray)")
        return np.frombuffer(mv, dtype=np.uint8)
    raise InvalidArgument(f"MR memory must be a numpy array, bytearray or memoryview, not {type(buf).__name__}")


# ============================================================================ the port
class Plane:
    """The tables of one port (an Arena), its AF_XDP socket and XDP program, and the loop driver."""

    SQ_ROWS = 1 << 15
    RQ_ROWS = 1 << 15
    CQE_ROWS = 1 << 17

    def __init__(self, port: Any, loader: Any, maxq: int = L.MAX_QPS, tunables: Tunables | None = None) -> None:
        """port: afxdp/port.XskPort -- its first socket sends and receives, further RX queues' sockets
        (port.rx_socks, on the same UMEM) receive: one loop serves them all (XR rows), so a QP's packets are
        handled whichever queue they arrive on.  See docs/design-dataplane.md, "Several RX queues".
        tunables: window, budget, spinning ... (metaroce_xdp/tunables.py; default: tunables.load())."""
        self.tunables = tun = tunables if tunables is not None else load_tunables()
        from ..wire.fastpath import TABLES
        from ..native import plane as native, plane_slot as nslot
        self.port, self.loader, self.maxq = port, loader, maxq
        self.tables = TABLES
        nframes = port.umem.nframes
        rx_socks = getattr(port, "rx_socks", None) or [port.xsk]
        if len(rx_socks) > L.MAX_XR:
            raise ValueError(f"{len(rx_socks)} RX queues: at most {L.MAX_XR}")
        npfd = len(rx_socks) + 1 + 1                 # a pollfd per socket, the eventfd's, a scratch word
        words = (L.N_P + 2 * L.TX_BATCH + npfd + len(rx_socks) * L.NXR + maxq * L.NQ + self.SQ_ROWS * L.NW + self.RQ_ROWS * L.NR
                 + self.CQE_ROWS * L.NE + L.MAX_CQS * L.NC + L.MAX_MRS * L.NM + maxq * L.MAX_RD * L.NJ
                 + L.N_EV * L.NEVF + L.N_RDY + maxq + nframes + 16 * 8
                 + L.SG_ROWS * L.NG + maxq * L.MAX_RD * L.NAT + maxq * L.NF + 1024 + 4 * 8
                 + nslot.region_words(maxq) + 8)
        ar = self.arena = L.Arena(words)
        A = self.A = ar.a
        p0 = ar.alloc(L.N_P)
        assert p0 == 0
        txq = ar.alloc(2 * L.TX_BATCH)
        pfd = ar.alloc(npfd)
        xr = ar.alloc(len(rx_socks) * L.NXR)
        q = ar.alloc(maxq * L.NQ)
        sq = ar.alloc(self.SQ_ROWS * L.NW)
        rq = ar.alloc(self.RQ_ROWS * L.NR, align=False)
        ce = ar.alloc(self.CQE_ROWS * L.NE, align=False)
        cqt = ar.alloc(L.MAX_CQS * L.NC, align=False)
        mr = ar.alloc(L.MAX_MRS * L.NM, align=False)
        rdj = ar.alloc(maxq * L.MAX_RD * L.NJ, align=False)
        ev = ar.alloc(L.N_EV * L.NEVF)
        rdy = ar.alloc(L.N_RDY)
        act = ar.alloc(maxq)
        free = ar.alloc(nframes)
        # dp/core.py, dp/atomics.py, dp/cc.py: SGE lists, saved ATOMIC results, DCQCN state (float64 words), the gather scratch
        sg = ar.alloc(L.SG_ROWS * L.NG)
        at = ar.alloc(maxq * L.MAX_RD * L.NAT)
        fo = ar.alloc(maxq * L.NF)
        sgx = ar.alloc(1024)
        # the native profile's rows (native/plane.py): a slot per native QP
        self.nat = native.NativeSlots(A, ar.alloc(nslot.region_words(maxq)), maxq)
        for name, off in (("sg_off", sg), ("at_off", at), ("f_off", fo)):
            A[getattr(L, "P_" + name.upper())] = off
        A[L.P_SGX_ADDR] = int(A.ctypes.data) + sgx * 8
        A[L.P_SGX_SIZE] = 1024 * 8
        self.SG = A[sg:sg + L.SG_ROWS * L.NG].reshape(-1, L.NG)
        self.sg_pool = L.RowPool(0, L.SG_ROWS)
        self.F = A[fo:fo + maxq * L.NF].view(np.float64).reshape(maxq, L.NF)
        # the compiled views need these regions contiguous and in this order
        for name, off in (("q_off", q), ("sq_off", sq), ("rq_off", rq), ("ce_off", ce), ("cq_off", cqt),
                          ("mr_off", mr), ("rdj_off", rdj), ("ev_off", ev), ("rdy_off", rdy), ("act_off", act),
                          ("free_off", free), ("txq_off", txq)):
            A[getattr(L, "P_" + name.upper())] = off
        A[L.P_MAXQ] = maxq
        A[L.P_NQ] = L.NQ
        self.Q = A[q:q + maxq * L.NQ].reshape(maxq, L.NQ)
        self.SW = A[sq:rq].reshape(-1, L.NW)
        self.RW = A[rq:ce].reshape(-1, L.NR)
        self.CE = A[ce:cqt].reshape(-1, L.NE)
        self.CQT = A[cqt:mr].reshape(-1, L.NC)
        self.MRT = A[mr:rdj].reshape(-1, L.NM)
        self.EV = A[ev:ev + L.N_EV * L.NEVF].reshape(-1, L.NEVF)
        self.qps_view = ar.view(q, maxq, L.QP_DTYPE)          # the same bytes as named records
        # the padding between regions (alignment) must not break the compiled reshapes
        for a, b, n in ((sq, rq, L.NW), (rq, ce, L.NR), (ce, cqt, L.NE), (cqt, mr, L.NC), (mr, rdj, L.NM)):
            assert (b - a) % n == 0, (a, b, n)
        self.sq_pool = L.RowPool(0, (rq - sq) // L.NW)
        self.rq_pool = L.RowPool(0, (ce - rq) // L.NR)
        self.ce_pool = L.RowPool(0, (cqt - ce) // L.NE)
        self.TM = np.zeros((maxq, 2 * L.TM_CNP), np.uint8)      # frame template | CNP template
        # DCQCN (dp/cc.py): congestion.py's parameters -- R_line the interface's speed, METAROCE_DCQCN_* -- in F row 0
        from ..congestion import DcqcnParams, link_rate_bps
        self.dcqcn = DcqcnParams.from_env(r_line_bps=link_rate_bps(getattr(port, "ifname", None)))
        self.nat.set_read_rate(native.read_rate_bps(getattr(port, "ifname", None), tun.read_rate_mbps))  # MR-CC-021
        for i, name in enumerate(L.D_FIELDS):
            self.F[0, i] = float(getattr(self.dcqcn, name))
        A[L.P_KS_ADDR] = int(loader.qps.ctypes.data) if loader is not None else 0
        A[L.P_KS_SIZE] = loader.qps.dtype.itemsize if loader is not None else 256
        self.nat.bind_kernel(loader if tun.xdp_sacks else None)   # the XDP program's NATIVE_SACK rings (MR-SACK-043)
        A[L.P_WINDOW] = tun.window
        A[L.P_BUDGET] = tun.budget
        A[L.P_SPIN_IDLE] = tun.spin_idle
        # idle rounds (nothing received, sent or completed) after which dp_run / dp_drive_bw give the
        # CPU away with sched_yield() while QPs wait on the peer, every that many (0: never).  Free on an
        # idle host (nothing else to run); on a loaded one the spinning was our share of the CPU spent
        # waiting (docs/design-dataplane.md, "Measured": +15-70 % on a 64 KiB WRITE stream)
        A[L.P_YIELD_AFTER] = tun.yield_after
        A[L.P_POLL_MS] = 1000
        self._bind_port(port, rx_socks, free, pfd, xr)
        self.lock = threading.Lock()
        self.post_lock = threading.Lock()
        self.threaded = False
        self._thread: threading.Thread | None = None
        self.on_event = None
        self.on_timeout = None          # Context: local ACK timeouts fired -> re-resolve paths (PathWatch)
        self._timeouts_seen = 0

    def _bind_port(self, port: Any, rx_socks: list, free: int, pfd: int, xr: int) -> None:
        """The words of the P block that are the port's: TX and completion ring addresses and fd (the first
        socket's), an XR row per receiving socket (at `xr`: its RX and fill rings, fd, queue), UMEM, the
        free frame stack (at `free`), the eventfd and pollfds (at `pfd`), the in-flight budget; then MAGIC."""
        A = self.A
        nframes = port.umem.nframes
        self.umem = port.frames
        self.rx_socks = rx_socks
        # AF_XDP rings by address
        x = port.xsk
        ad = lambda arr: int(arr.ctypes.data)  # noqa: E731
        for pre, ring, body in (("tx", x.tx, "desc"), ("cq", x.comp, "addrs")):
            A[getattr(L, f"P_{pre.upper()}_PROD")] = ad(ring.producer)
            A[getattr(L, f"P_{pre.upper()}_CONS")] = ad(ring.consumer)
            A[getattr(L, f"P_{pre.upper()}_{body.upper()}")] = ad(ring.descs if body == "desc" else ring.addrs)
            A[getattr(L, f"P_{pre.upper()}_SIZE")] = ring.size
        A[L.P_TX_FLAGS] = ad(x.tx.flags)
        A[L.P_FD] = x.fileno()
        self.XR = A[xr:xr + len(rx_socks) * L.NXR].reshape(-1, L.NXR)
        for row, s in zip(self.XR, rx_socks):
            row[:] = 0
            row[L.XR_RX_PROD], row[L.XR_RX_CONS] = ad(s.rx.producer), ad(s.rx.consumer)
            row[L.XR_RX_DESC], row[L.XR_RX_SIZE] = ad(s.rx.descs), s.rx.size
            row[L.XR_FQ_PROD], row[L.XR_FQ_CONS] = ad(s.fill.producer), ad(s.fill.consumer)
            row[L.XR_FQ_FLAGS], row[L.XR_FQ_ADDRS], row[L.XR_FQ_SIZE] = ad(s.fill.flags), ad(s.fill.addrs), s.fill.size
            row[L.XR_FD], row[L.XR_QUEUE] = s.fileno(), s.queue_id
        A[L.P_XR_OFF] = xr
        A[L.P_XR_N] = len(rx_socks)
        A[L.P_UMEM_ADDR] = ad(port.frames)
        A[L.P_FRAME_SIZE] = port.umem.frame_size
        A[L.P_FRAME_MASK] = ~(port.umem.frame_size - 1)
        sg = bool(getattr(port, "sg", False))
        if sg:
            # multi-buffer (XDP_USE_SG, path MTU 4096): frames live in slots of adjacent chunks (the
            # pool's), built contiguously; the loop chains/joins descriptors at chunk boundaries
            A[L.P_SG] = 1
            A[L.P_FRAME_MASK] = ~(port.umem.slot - 1)
        # the free frames: what the port's pool still holds becomes ours
        pool = port.pool
        k = int(pool.top[0])
        A[free:free + k] = pool.stack[:k].astype(np.int64)
        A[L.P_FREE_TOP] = k
        A[L.P_FREE_CAP] = nframes
        pool.top[0] = 0
        # wake-ups: poll() on every receiving socket and an eventfd a post writes
        self.efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        A[L.P_EFD] = self.efd
        fds = [rx_socks[0].fileno(), self.efd, *(s.fileno() for s in rx_socks[1:])]
        for i, fd in enumerate(fds):
            A[pfd + i] = (fd & 0xFFFFFFFF) | (1 << 32)          # struct pollfd {fd, POLLIN, 0}
        A[L.P_NPOLLFD] = len(fds)                                # then the eventfd's read scratch
        A[L.P_POLLFD] = ad(A) + pfd * 8
        # packets all QPs of the port may have un-ACKed (0: no port limit, each QP its window)
        # (multi-buffer: a packet larger than one RX buffer counts twice, requester.infl_weight)
        cap = self.tunables.port_inflight
        A[L.P_INFL_CAP] = cap if cap is not None else x.rx.size * 3 // 4
        A[L.P_MAGIC] = L.MAGIC

    def _check_timeouts(self) -> None:
        n = int(self.A[L.P_TIMEOUTS])
        if n != self._timeouts_seen:
            self._timeouts_seen = n
            if self.on_timeout is not None:
                self.on_timeout()

    # ---- driving the loop ---------------------------------------------------------------
    @functools.cached_property
    def loop(self) -> Any:
        """dp/inproc.py (dp_round, dp_run), imported at first use and kept (progress() reads it every
        round); Context.open imports it beforehand unless told that the caller drives the plane itself
        (metaroced: dp/serve.py's dp_serve)."""
        from . import inproc
        return inproc

    def progress(self) -> int:
        with self.lock:
            n = self.loop.dp_round(self.A, self.TM, self.umem, self.tables)
        if self.A[L.P_EV_TAIL] != self.A[L.P_EV_HEAD]:
            self.drain_events()
        if self.A[L.P_TIMEOUTS] != self._timeouts_seen:
            self._check_timeouts()
        return n

    def run(self, max_ns: int, watch_addr: int = 0, watch_val: int = 0, sleep_ok: bool = False) -> int:
        """The GIL-free loop for up to max_ns (busy polling; sleep_ok: asleep in poll() when idle, as the
        sleeping progress thread), until the byte at watch_addr equals watch_val, or (watch_val=-2) a
        completion was added."""
        with self.lock:
            rc = self.loop.dp_run(self.A, self.TM, self.umem, self.tables, max_ns, watch_addr, watch_val,
                                  1 if sleep_ok else 0)
        if self.A[L.P_EV_TAIL] != self.A[L.P_EV_HEAD]:
            self.drain_events()
        self._check_timeouts()
        return rc

    def start(self, busy: bool = True) -> None:
        """A dedicated progress thread: the compiled loop runs without the GIL and returns only for
        events, pauses or stop.  busy=False sleeps in poll() when idle (a post or a frame on any RX
        queue's socket wakes it)."""
        if self._thread is not None:
            return
        self.threaded = True
        self.A[L.P_STOP] = 0
        self._sleep_ok = 0 if busy else 1
        self._thread = threading.Thread(target=self._run, name="metaroce-dp", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        A = self.A
        while not A[L.P_STOP]:
            with self.lock:
                rc = self.loop.dp_run(A, self.TM, self.umem, self.tables, 50_000_000, 0, 0, self._sleep_ok)
            if A[L.P_EV_TAIL] != A[L.P_EV_HEAD]:
                self.drain_events()
            self._check_timeouts()
            if rc == 2:
                time.sleep(0)          # let the control operation that paused us take the lock

    def stop(self) -> None:
        if self._thread is None:
            return
        self.A[L.P_STOP] = 1
        self.wake()
        self._thread.join(timeout=5)
        self._thread = None
        self.threaded = False

    def wake(self) -> None:
        if self.A[L.P_SLEEPING]:
            os.eventfd_write(self.efd, 1)
            self.A[L.P_WAKEUPS] += 0

    class _Paused:
        def __init__(self, plane: "Plane") -> None:
            self.p = plane

        def __enter__(self):
            self.p.A[L.P_PAUSE] = 1
            self.p.wake()
            self.p.lock.acquire()
            return self.p

        def __exit__(self, *exc):
            self.p.A[L.P_PAUSE] = 0
            self.p.lock.release()

    def paused(self) -> "_Paused":
        """Control operations run with the loop between rounds."""
        return Plane._Paused(self)

    def frames(self) -> dict:
        """Where this plane's UMEM frames are -- call it with the loop paused: free on the loop's stack, with the
        kernel to receive into (fill ring to RX ring: the loop's fill producer less its RX consumer), with the
        kernel to send (TX ring to completion ring), in the loop's TX batch (tx_pending).  `leaked`, what none
        of those holds, must be 0 (on a multi-buffer socket, `sg`, frames are counted in slots, a chained TX
        frame once per descriptor while in flight)."""
        A, u, x = self.A, self.port.umem, self.port.xsk
        sg = bool(A[L.P_SG])
        d = {"total": u.nframes * u.frame_size // u.slot if sg else int(u.nframes), "free": int(A[L.P_FREE_TOP]),
             "kernel_rx": sum((int(s.fill.producer[0]) - int(s.rx.consumer[0])) & 0xFFFFFFFF for s in self.rx_socks),
             "kernel_tx": (int(x.tx.producer[0]) - int(x.comp.consumer[0])) & 0xFFFFFFFF,
             "tx_pending": int(A[L.P_TXN]), "sg": sg}
        d["leaked"] = d["total"] - d["free"] - d["kernel_rx"] - d["kernel_tx"] - d["tx_pending"]
        return d

    def mark_ready(self, qi: int) -> None:
        """A post: the QP goes in the ready ring (the loop puts it on its active list)."""
        A = self.A
        while A[L.P_RDY_TAIL] - A[L.P_RDY_HEAD] >= L.N_RDY:
            if self.threaded:
                time.sleep(0)
            else:
                self.progress()
        t = int(A[L.P_RDY_TAIL])
        A[int(A[L.P_RDY_OFF]) + (t & (L.N_RDY - 1))] = qi
        A[L.P_RDY_TAIL] = t + 1
        self.wake()

    def drain_events(self) -> None:
        A = self.A
        while A[L.P_EV_HEAD] != A[L.P_EV_TAIL]:
            h = int(A[L.P_EV_HEAD])
            typ, qi, arg, arg2 = (int(v) for v in self.EV[h % L.N_EV])
            A[L.P_EV_HEAD] = h + 1
            if self.on_event is not None:
                self.on_event(typ, qi, arg, arg2)

    def stats(self) -> dict[str, int]:
        names = ("rx tx rx_drop_icrc rx_drop_qp rx_drop_state rx_drop_len rx_drop_op rx_dup rx_oos tx_ack tx_nak "
                 "tx_rnr tx_no_frame tx_ring_full kicks retransmits timeouts acks_seen naks_seen rnr_seen "
                 "rx_rsp_stale rounds idle_polls wakeups cqe_out rx_bytes tx_bytes last_to_comp last_to_max "
                 "last_to_kack last_to_kseq last_to_head last_to_next last_to_tail "
                 "tx_cnp rx_cnp rx_ce rx_dup_atomic rx_sg rx_sg_long "
                 "rx_sack_kern rx_sack_kern_drop yields ev_drop rx_dup_rd_drop rx_rd_defer rx_cnp_coalesced "
                 "rx_rkey rx_ghost_rsp late_recvs").split()
        return {n: int(self.A[getattr(L, "P_" + n.upper())]) for n in names}

    def queue_stats(self) -> list[dict[str, int]]:
        """Per RX queue: its queue id, the frames received on it, the frames its fill ring is owed."""
        return [{"queue": int(r[L.XR_QUEUE]), "rx": int(r[L.XR_RX]), "fill_owed": int(r[L.XR_OWED])} for r in self.XR]

    def close(self) -> None:
        self.stop()
        self.A[L.P_MAGIC] = 0
        os.close(self.efd)


# ============================================================================ verbs objects
class PD:
    def __init__(self, ctx: "Context", handle: int) -> None:
        self.ctx, self.handle = ctx, handle
        self.mrs: set[int] = set()
        self.qps: set[int] = set()
        self.valid = True                 # until dealloc_pd

    def reg_mr(self, buf: Any, access: Access = Access.LOCAL_WRITE, **kw) -> "MR":
        return self.ctx.reg_mr(self, buf, access, **kw)

    def dealloc(self) -> None:
        self.ctx.dealloc_pd(self)

    def __repr__(self) -> str:
        return f"PD({self.handle})"


class MR:
    """A registered region: the MR table row (address, length, key, PD, access, valid, ref).  `ref`, the
    generation and key, is what posted work requests keep (MR-SEC-003, layout.M_REF)."""

    def __init__(self, ctx, pd, mem, access, index, key, ref=0) -> None:
        self.ctx, self.pd, self.mem, self.access, self.index = ctx, pd, mem, Access(access), index
        self.addr = int(mem.ctypes.data) if mem.size else 0
        self.length = int(mem.size)
        self.lkey = self.rkey = key
        self.ref = ref
        self.valid = True

    def sge(self, offset: int, length: int) -> SGE:
        """An SGE of `length` bytes at `offset` into the region (checked when posted)."""
        return SGE(self.addr + offset, length, self.lkey)

    def dereg(self) -> None:
        self.ctx.dereg_mr(self)

    def __repr__(self) -> str:
        return f"MR(addr={self.addr:#x}, len={self.length}, lkey={self.lkey:#x}, access={self.access!r})"


class CompChannel(CompChannelBase):
    """ibv_comp_channel: armed CQs report their completion events here.  A
    lock of its own guards the queue; a waiter without a progress thread runs the compiled loop until
    an event (a completion event is one) or 2 ms."""

    def __init__(self, ctx: "Context") -> None:
        super().__init__(ctx)
        self._mutex = threading.Lock()

    def _lock(self):
        return self._mutex

    def _threaded(self) -> bool:
        return self.ctx.plane.threaded

    def _progress(self) -> None:
        self.ctx.plane.progress()

    def _idle(self, left: float | None) -> None:
        self.ctx.plane.run(2_000_000 if left is None else max(1, min(int(left * 1e9), 2_000_000)), 0, 0)


class CQ:
    def __init__(self, ctx: "Context", index: int, depth: int, size: int, base: int, cq_context: Any,
                 channel: "CompChannel | None" = None) -> None:
        self.ctx, self.index, self.depth, self.size, self.base = ctx, index, depth, size, base
        self.cq_context = cq_context
        self.row = ctx.plane.CQT[index]
        # completion events: a CQ without a channel of its own gets a private one (CQ.get_event)
        self.private_channel = channel is None
        self.channel = channel if channel is not None else CompChannel(ctx)
        self.events = 0

    @property
    def armed(self) -> int:
        return int(self.row[L.C_ARMED])

    def req_notify(self, solicited_only: bool = False) -> None:
        """ibv_req_notify_cq: one completion event for the next completion added -- with solicited_only,
        for the next solicited (SE, MR-BTH-004) or unsuccessful one.  Arming for any completion outranks
        solicited_only until the event comes (as rxe)."""
        if int(self.row[L.C_ARMED]) != _NOTIFY_NEXT:
            self.row[L.C_ARMED] = _NOTIFY_SOLICITED if solicited_only else _NOTIFY_NEXT

    def get_event(self, timeout: float | None = 0.0) -> bool:
        """Wait up to `timeout` seconds for this CQ's completion event (CQs created without a channel);
        True when it came, which also disarms the CQ."""
        if not self.private_channel:
            raise InvalidState("this CQ reports to a completion channel: use channel.get_cq_event()")
        return self.channel.get_cq_event(timeout) is self

    def destroy(self) -> None:
        self.ctx.destroy_cq(self)

    def poll(self, num_entries: int = 16) -> list[WC]:
        """ibv_poll_cq: up to num_entries completions (drives a progress round when busy polling)."""
        pl = self.ctx.plane
        if not pl.threaded:
            pl.progress()
        return self._take(num_entries)

    def _take(self, num_entries: int) -> list[WC]:
        out = []
        CE = self.ctx.plane.CE
        mask = self.size - 1
        row, base = self.row, self.base
        head, tail = int(row[L.C_HEAD]), int(row[L.C_TAIL])
        while head != tail and len(out) < num_entries:
            wr_id, st, op, blen, qpn, imm, flags = CE[base + (head & mask)].tolist()
            wf = WCFlags(flags)
            out.append(WC(wr_id=wr_id & 0xFFFFFFFFFFFFFFFF, status=WCStatus(st), opcode=WCOpcode(op), byte_len=blen,
                          qp_num=qpn, imm_data=imm if wf & WCFlags.WITH_IMM else None, wc_flags=wf,
                          invalidated_rkey=imm if wf & WCFlags.WITH_INV else None))
            head += 1
        row[L.C_HEAD] = head
        return out

    def wait(self, n: int = 1, timeout: float = 10.0) -> list[WC]:
        """Poll until n completions arrived; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        out: list[WC] = []
        pl = self.ctx.plane
        while len(out) < n:
            if pl.threaded:
                out += self._take(n - len(out))
                if len(out) < n:
                    time.sleep(0.0001)
            else:
                if int(self.row[L.C_HEAD]) == int(self.row[L.C_TAIL]):
                    pl.run(2_000_000, 0, -2)
                out += self._take(n - len(out))
            if len(out) < n and time.monotonic() > deadline:
                raise TimeoutError(f"{len(out)} of {n} completions after {timeout}s")
        return out


class QP:
    def __init__(self, ctx: "Context", pd: PD, send_cq: CQ, recv_cq: CQ, cap: QPCap, qi: int, qpn: int,
                 sq_sig_all: bool) -> None:
        self.ctx, self.pd, self.send_cq, self.recv_cq, self.cap = ctx, pd, send_cq, recv_cq, cap
        self.qi, self.qp_num = qi, qpn
        pl = ctx.plane
        self.sq_size = _pow2(max(cap.max_send_wr, 1))
        self.rq_size = _pow2(max(cap.max_recv_wr, 1))
        self.sq_base = pl.sq_pool.alloc(self.sq_size)
        try:
            self.rq_base = pl.rq_pool.alloc(self.rq_size)
        except MemoryError:
            pl.sq_pool.release(self.sq_base, self.sq_size)
            raise
        self.row = pl.Q[qi]
        r = self.row
        r[:] = 0
        r[L.Q_QPN] = qpn
        r[L.Q_PD] = pd.handle
        r[L.Q_SEND_CQ] = send_cq.index
        r[L.Q_RECV_CQ] = recv_cq.index
        r[L.Q_SIG_ALL] = int(sq_sig_all)
        r[L.Q_SQ_BASE], r[L.Q_SQ_SIZE] = self.sq_base, self.sq_size
        r[L.Q_RQ_BASE], r[L.Q_RQ_SIZE] = self.rq_base, self.rq_size
        r[L.Q_MAX_RD] = r[L.Q_MAX_DEST] = L.MAX_RD
        r[L.Q_PMTU] = 1024
        self._dcqcn_init()
        self.state = QPState.RESET
        self.dgid: str | None = None
        self.dest_qp = 0
        self.pmtu = 1024
        self.error_reason: str | None = None
        self.installed = False
        self.profile = "compat"              # "native" from RTR when QPAttr.profile asks for it (native/plane.py)
        self.atomics: bool | None = None     # whether the connection agreed ATOMICS (None: set up by hand)
        self._sport = 0
        self._sg_sq: deque = deque()         # (WQE index, first SG row, rows) of posted SGE lists
        self._sg_rq: deque = deque()
        # routed paths (netinfo.PathWatch, through Context.paths): what PathWatch reads and writes
        self.dmac: str | None = None
        self.next_hop = None                 # netinfo.NextHop when the path was resolved, not given
        self.path_resolves = self.path_changes = 0
        self.path_error: str | None = None
        self._hop = None                     # the hop template_for resolved for the pending modify

    def _dcqcn_init(self) -> None:
        """The QP's DCQCN state (F row) at its start: line rate, alpha_init, a full
        token bucket, timers from a fresh clock (the loop's clock, CLOCK_MONOTONIC)."""
        pl = self.ctx.plane
        p, f, now = pl.dcqcn, pl.F[self.qi], time.monotonic_ns()
        f[:] = 0
        f[L.F_RC] = f[L.F_RT] = f[L.F_RATE_MIN] = p.r_line_bps
        f[L.F_ALPHA] = p.alpha_init
        f[L.F_TOKENS] = p.burst_bytes
        f[L.F_T_TOKENS] = now
        f[L.F_ALPHA_DUE] = now + p.k_ns
        f[L.F_RATE_DUE] = now + p.t_ns
        f[L.F_NP_LAST] = -1

    def refresh_cc(self, timeout: float = 1.0) -> None:
        """Bring the QP's reaction point up to now before it is read.  The loop applies the CNPs the XDP
        program counted into the QP's slot, and the DCQCN alpha and rate timers, when it runs the QP
        (dp/cc.py rp_cnps, rp_advance) -- the QPs on its active list, which an idle QP is not -- so what
        F holds for an idle QP is the state at its last packet.  The QP goes in the ready ring and the
        loop runs it once more (in its thread if it has one)."""
        pl = self.ctx.plane
        r0 = int(pl.A[L.P_ROUNDS])
        pl.mark_ready(self.qi)
        if not pl.threaded:
            pl.progress()
            return
        end = time.monotonic() + timeout
        while int(pl.A[L.P_ROUNDS]) < r0 + 2 and time.monotonic() < end:   # a round that began after the mark
            pl.wake()
            time.sleep(0.0002)

    def dcqcn_counters(self) -> dict:
        """The QP's DCQCN rate, alpha and CNP/CE counters (MR-CNP-010), as the loop last left them (an idle
        QP's: refresh_cc first, which runs the loop)."""
        f = self.ctx.plane.F[self.qi]
        return {"rate_bps": float(f[L.F_RC]), "rate_target_bps": float(f[L.F_RT]),
                "rate_min_bps": float(f[L.F_RATE_MIN]), "alpha": float(f[L.F_ALPHA]),
                "rate_cuts": int(f[L.F_RATE_CUTS]), "rx_cnp": int(f[L.F_RX_CNP]), "tx_cnp": int(f[L.F_NP_TX]),
                "rx_ce_marked": int(f[L.F_NP_CE])}

    # ---- state --------------------------------------------------------------------------
    def modify(self, attr: QPAttr) -> None:
        """ibv_modify_qp.  RESET -> INIT -> RTR -> RTS, any -> ERR or RESET; a failed modify changes nothing."""
        g = attr.given()
        new = attr.qp_state if attr.qp_state is not None else self.state
        allowed = {QPState.RESET: {QPState.RESET, QPState.INIT, QPState.ERR},
                   QPState.INIT: {QPState.INIT, QPState.RTR, QPState.RESET, QPState.ERR},
                   QPState.RTR: {QPState.RTS, QPState.RESET, QPState.ERR},
                   QPState.RTS: {QPState.RTS, QPState.SQD, QPState.RESET, QPState.ERR},
                   QPState.SQD: {QPState.SQD, QPState.RTS, QPState.RESET, QPState.ERR},
                   QPState.SQE: {QPState.RTS, QPState.RESET, QPState.ERR},
                   QPState.ERR: {QPState.RESET, QPState.ERR}}
        cur = self.query_state()
        if "cur_qp_state" in g and g["cur_qp_state"] != cur:
            raise InvalidArgument(f"QP {self.qp_num:#x}: cur_qp_state {QPState(g['cur_qp_state']).name} is not its "
                                  f"state {cur.name} (MR-QP-006)")
        if "alt_path" in g:
            raise InvalidArgument(f"QP {self.qp_num:#x}: no alternate path (IBV_QP_ALT_PATH, MR-QP-008)")
        if g.get("path_mig_state", "MIGRATED") != "MIGRATED":
            raise InvalidArgument(f"QP {self.qp_num:#x}: path_mig_state {g['path_mig_state']!r}: only MIGRATED "
                                  "(MR-QP-008)")
        if new not in allowed[cur]:
            raise InvalidState(f"QP {self.qp_num:#x}: {cur.name} -> {QPState(new).name} is not a valid transition")
        if new not in (QPState.RESET, QPState.ERR):
            # MR-QP-005: "the mask contains an attribute that is neither required nor optional for the
            # transition" (Table 7-2), or one out of the range of Table 7-3: EINVAL, the QP unchanged
            extra = sorted(set(g) - _TAKES.get((cur, QPState(new)), set()) - _OWN_CHECKS)
            if extra:
                raise InvalidArgument(f"QP {self.qp_num:#x}: {cur.name} -> {QPState(new).name} does not take "
                                      f"{extra} (MR-QP-005)")
            for k, (lo, hi) in _RANGES.items():
                if k in g and not lo <= g[k] <= hi:
                    raise InvalidArgument(f"QP {self.qp_num:#x}: {k} {g[k]} must be {lo}..{hi} (MR-QP-005)")
        if cur == new == QPState.SQD and int(self.row[L.Q_SQD_DRAIN]):
            # EBUSY (MR-QP-014): wait for IBV_EVENT_SQ_DRAINED or until nothing is outstanding
            raise Busy(f"QP {self.qp_num:#x}: SQD -> SQD while the send queue is still draining (EBUSY); wait "
                       "until it is drained")
        if new != QPState.RTR and g.get("profile") is not None and g["profile"] != self.profile:
            # MR-NAT-003: the profile is chosen at RTR and kept until RESET; another needs a new set-up
            raise InvalidArgument(f"QP {self.qp_num:#x}: profile {g['profile']!r} at {cur.name} -> "
                                  f"{QPState(new).name}; the {self.profile} profile holds until RESET (MR-NAT-003)")
        ctx = self.ctx
        if new == QPState.RTR:
            for k in ("dest_qp_num", "rq_psn", "dgid"):
                if k not in g:
                    raise InvalidArgument(f"INIT -> RTR needs {k}")
            mtu = g.get("path_mtu", 1024)
            if mtu not in PATH_MTUS:
                raise InvalidArgument(f"path_mtu {mtu}: use one of {PATH_MTUS}")
            if mtu > ctx.max_pmtu:
                raise InvalidArgument(f"path_mtu {mtu} exceeds what {ctx.ifname} carries ({ctx.max_pmtu})")
            profile = g.get("profile", "compat")
            if profile not in ("compat", "native"):
                raise InvalidArgument(f"profile {profile!r}: the agreed profile is 'compat' or 'native' (MR-NAT-001)")
            tmpl = ctx.template_for(self, g["dgid"], g.get("dmac"), g.get("sport"), g.get("dscp", DEFAULT_DSCP),
                                    g["dest_qp_num"], ecn=bool(g.get("ecn", True)))
        pl = ctx.plane
        with pl.paused():
            r = self.row
            if "qp_access_flags" in g:
                r[L.Q_ACCESS] = int(g["qp_access_flags"])
            if new == QPState.RESET:
                self.ctx._retire_counts(self)
                self._reset()
                return
            if new == QPState.ERR:
                self._to_err(Why.MODIFIED_TO_ERR)
                return
            if new == QPState.RTR:
                self.dgid, self.dest_qp, self.pmtu = g["dgid"], g["dest_qp_num"], mtu
                buf, l3, v6 = tmpl
                pl.TM[self.qi, :] = 0
                pl.TM[self.qi, :len(buf)] = buf
                pl.TM[self.qi, L.TM_CNP:L.TM_CNP + len(buf)] = self._cnp_template(buf, l3, v6)
                r[L.Q_TMPL_LEN], r[L.Q_L3_OFF], r[L.Q_IPV6] = len(buf), l3, int(v6)
                r[L.Q_ECN_OFF] = 0 if g.get("ecn", True) else 1        # MR-ECN-011 (dp/cc.py np_on_ce)
                ctx._track_path(self, g.get("dmac"))
                r[L.Q_DEST_QP] = g["dest_qp_num"]
                r[L.Q_PMTU] = mtu
                r[L.Q_EPSN] = g["rq_psn"] & L.PSN_MASK
                r[L.Q_READ_RUN] = 0                     # no READ executed yet (MR-DUP-002)
                r[L.Q_MIN_RNR] = g.get("min_rnr_timer", 1) & 0x1F
                if "max_dest_rd_atomic" in g:          # resources[] (MR-DUP-007); 0: READ/ATOMIC NAKed code 1
                    r[L.Q_MAX_DEST] = max(0, min(L.MAX_RD, g["max_dest_rd_atomic"]))
                pl.nat.detach(self.qi)
                self.profile = profile
                self._sport = g.get("sport") if g.get("sport") is not None else 0xC000 | (self.qp_num & 0x3FFF)
                if profile == "native":                 # MR-NAT-003: fixed from RTR to the next RESET
                    pl.nat.attach(self.qi, g["rq_psn"], **g.get("native_params", {}))
                r[L.Q_STATE] = QPState.RTR
                self._install(QPState.RTR)
            elif new == QPState.RTS:
                if cur == QPState.RTR:
                    psn = g.get("sq_psn", 0) & L.PSN_MASK
                    r[L.Q_SND_PSN] = r[L.Q_SND_MAX] = r[L.Q_COMP_PSN] = psn
                    r[L.Q_SQ_PSN0] = psn
                    r[L.Q_PUB_COMP] = -1
                    r[L.Q_PUB_NAKR] = L.PSN_NONE                     # install_qp wrote it so
                t = g.get("timeout", 14 if cur == QPState.RTR else None)
                if t is not None:
                    r[L.Q_TIMEOUT_NS] = local_ack_timeout_ns(t) or 0
                if "retry_cnt" in g or cur == QPState.RTR:
                    r[L.Q_RETRY_CNT] = r[L.Q_RETRY_LEFT] = min(7, g.get("retry_cnt", 7))
                if cur == QPState.RTR:
                    r[L.Q_RETRY_FROM] = 0                   # no retry in progress (MR-NAK-005)
                if "rnr_retry" in g or cur == QPState.RTR:
                    r[L.Q_RNR_RETRY] = r[L.Q_RNR_LEFT] = min(7, g.get("rnr_retry", 7))
                if "max_rd_atomic" in g:          # 0: a READ or ATOMIC fails LOC_QP_OP_ERR (MR-RC-009)
                    r[L.Q_MAX_RD] = max(0, min(L.MAX_RD, g["max_rd_atomic"]))
                if self.profile == "native":      # rto_max, retry_cnt, rnr_retry (MR-LOSS-005/009, MR-SACK-036)
                    first = cur == QPState.RTR
                    pl.nat.qp_attrs(self.qi, t, g.get("retry_cnt", 7) if "retry_cnt" in g or first else None,
                                    g.get("rnr_retry", 7) if "rnr_retry" in g or first else None)
                if cur == QPState.RTR:
                    self._kernel_rts(int(r[L.Q_SND_PSN]))
                    if self.profile == "native":
                        pl.nat.start(self.qi, int(r[L.Q_SND_PSN]), self._sport, time.monotonic_ns(),
                                     pl.TM[self.qi], int(r[L.Q_L3_OFF]) if r[L.Q_IPV6] else -1)
                r[L.Q_SQD_DRAIN] = 0                       # SQD -> RTS resumes where it stopped (MR-QP-014)
                r[L.Q_STATE] = QPState.RTS
                self._kernel_state(QPState.RTS)
                if cur == QPState.SQD:
                    pl.mark_ready(self.qi)
            elif new == QPState.SQD:
                if cur == QPState.RTS:
                    # no new WQE starts; the loop raises SQ_DRAINED once nothing started is outstanding
                    r[L.Q_SQD_NOTIFY] = int(bool(g.get("en_sqd_async_notify", False)))
                    r[L.Q_SQD_DRAIN] = 1
                r[L.Q_STATE] = QPState.SQD
                self._kernel_state(QPState.SQD)
                pl.mark_ready(self.qi)
            else:
                r[L.Q_STATE] = int(new)
            self.state = QPState(new)

    def _cnp_template(self, buf, l3: int, v6: bool):
        """The QP's template for CNPs: DSCP cnp_dscp, Not-ECT (MR-ECN-005), BECN 1
        (MR-BTH-012); the path, UDP source port and P_Key are the QP's."""
        from ..wire.hdr import BTH_SIZE, put_field
        from ..wire.headers import BTH, IPv4, IPv6
        tb = np.array(buf, np.uint8)
        tos = (self.ctx.plane.dcqcn.cnp_dscp << 2) & 0xFC          # DSCP, ECN 0 (Not-ECT)
        if v6:
            put_field(tb, l3, IPv6, "traffic_class", tos)
        else:
            put_field(tb, l3, IPv4, "dscp", tos >> 2)
            put_field(tb, l3, IPv4, "ecn", 0)
        b = len(tb) - BTH_SIZE                                     # the template ends with the BTH
        put_field(tb, b, BTH, "fecn", 0)
        put_field(tb, b, BTH, "becn", 1)
        return tb

    def _install(self, state: QPState) -> None:
        ld = self.ctx.loader
        if ld is None:
            return
        from ..kern.layout import Profile
        ld.install_qp(self.qp_num, peer_ip=self.dgid, dest_qpn=self.dest_qp, state=int(state), pmtu=self.pmtu,
                      init_psn=0, profile=Profile.NATIVE if self.profile == "native" else Profile.COMPAT)
        self.installed = True

    def _kernel_rts(self, psn: int) -> None:
        ld = self.ctx.loader
        if ld is None:
            return
        slot = ld.qp(self.qp_num)
        slot["snd_nxt"] = psn
        slot["comp_psn"] = psn
        slot["ack_psn"] = (psn - 1) & L.PSN_MASK
        r = self.row
        r[L.Q_K_SEQ] = int(slot["ack_seq"])
        r[L.Q_K_ACK] = (psn - 1) & L.PSN_MASK
        r[L.Q_K_NAK_SEQ] = int(slot["nak_seq"])
        r[L.Q_K_RNR_SEQ] = int(slot["rnr_seq"])
        r[L.Q_K_CNP] = int(slot["cnp_count"])

    def _kernel_state(self, state: QPState) -> None:
        if self.installed:
            self.ctx.loader.set_qp_state(self.qp_num, int(state))

    def _to_err(self, why: int) -> None:
        r = self.row
        if int(r[L.Q_STATE]) != QPState.ERR:
            r[L.Q_ERR] = why
            r[L.Q_STATE] = QPState.ERR
            self._kernel_state(QPState.ERR)
            self.error_reason = reasons.text(why)
        self.state = QPState.ERR
        self.ctx.plane.mark_ready(self.qi)          # the loop flushes the queues

    def _reset(self) -> None:
        r = self.row
        keep = {k: int(r[k]) for k in (L.Q_QPN, L.Q_PD, L.Q_SEND_CQ, L.Q_RECV_CQ, L.Q_SIG_ALL, L.Q_SQ_BASE,
                                       L.Q_SQ_SIZE, L.Q_RQ_BASE, L.Q_RQ_SIZE, L.Q_ACTIVE,
                                       L.Q_CRQ, L.Q_CRQ_OFF, L.Q_CRQ_SIZE, L.Q_CRQ_TAKEN)}   # metaroced's ring
        r[:] = 0
        for k, v in keep.items():
            r[k] = v
        r[L.Q_MAX_RD] = r[L.Q_MAX_DEST] = L.MAX_RD
        r[L.Q_PMTU] = 1024
        self._sg_release(None, None)
        self.ctx.plane.nat.detach(self.qi)
        self.profile = "compat"
        self.atomics = None
        if self.installed:
            self.ctx.loader.clear_qp(self.qp_num)
            self.installed = False
        self.state = QPState.RESET
        self.error_reason = None

    def destroy(self) -> None:
        self.ctx.destroy_qp(self)

    def query_state(self) -> QPState:
        return QPState(int(self.row[L.Q_STATE]))

    def query(self) -> dict:
        r = self.row
        st = self.query_state()
        why = int(r[L.Q_ERR])
        return {"qp_num": self.qp_num, "state": st,
                "error": self.ctx._invalid_why(self.qi, why) if st == QPState.ERR and why else None,
                "sq_psn": int(r[L.Q_SND_PSN]), "snd_max": int(r[L.Q_SND_MAX]), "comp_psn": int(r[L.Q_COMP_PSN]),
                "rq_psn": int(r[L.Q_EPSN]), "msn": int(r[L.Q_MSN]), "retry_left": int(r[L.Q_RETRY_LEFT]),
                "rnr_left": int(r[L.Q_RNR_LEFT]), "path_mtu": int(r[L.Q_PMTU]), "dest_qp_num": self.dest_qp,
                "sq_outstanding": int(r[L.Q_SQ_TAIL] - r[L.Q_SQ_HEAD]),
                "rq_posted": int(r[L.Q_RQ_TAIL] - r[L.Q_RQ_HEAD]), "dmac": self.dmac,
                "next_hop": self.next_hop.hop if self.next_hop else None, "path_resolves": self.path_resolves,
                "path_changes": self.path_changes, "path_error": self.path_error,
                "retransmits": int(r[L.Q_N_RETX]), "ecn": not r[L.Q_ECN_OFF],
                "profile": self.profile, **self.dcqcn_counters(), **self.rx_counters()}

    def rx_counters(self) -> dict:
        """The QP's receive counters (QP_RX_COUNTERS): duplicates (MR-DUP-010), requests after the expected PSN
        (each one), remote access errors (MR-MEM-019), RNR NAKs sent, stale and ghost responses the loop or
        the XDP program discarded (MR-ACK-015), and the bad response that ended the QP (MR-NAK-012)."""
        r = self.row
        ghost, stale = int(r[L.Q_N_GHOST]), int(r[L.Q_N_STALE])
        if self.installed and self.ctx.loader is not None:
            slot = self.ctx.loader.qp(self.qp_num)
            ghost, stale = ghost + int(slot["ghost_acks"]), stale + int(slot["stale_acks"])
        return {"rx_dup_req": int(r[L.Q_N_DUP_REQ]), "rx_drop_out_of_seq": int(r[L.Q_N_OOS]),
                "rx_rkey_violation": int(r[L.Q_N_RKEY]), "rnr_naks_sent": int(r[L.Q_N_RNR_TX]),
                "rx_stale_rsp": stale, "rx_ghost_rsp": ghost,
                "rx_bad_rsp": int(int(r[L.Q_ERR]) == reasons.Why.BAD_RESPONSE)}

    def native_counters(self) -> dict:
        """The native profile's counters and state (MR-LOSS-014): retransmissions by cause, SACKs sent and
        received, out-of-order placements, srtt/rto/cwnd ({} for a compat QP)."""
        return self.ctx.plane.nat.counters(self.qi)

    # ---- routed paths (netinfo.PathWatch.apply sets these) ------------------------
    @property
    def template(self) -> np.ndarray:
        """The QP's TM row: frame template | CNP template."""
        return self.ctx.plane.TM[self.qi].copy()

    @template.setter
    def template(self, row: np.ndarray) -> None:
        # the loop reads the row for every frame it builds: it changes between rounds, never mid-frame
        pl = self.ctx.plane
        with pl.paused():
            pl.TM[self.qi, :] = row

    # ---- work requests ------------------------------------------------------------------
    def _sge(self, sg_list, need: Access) -> tuple[int, int, int, list]:
        """(addr, total length, MR index, pieces) of an SGE list verbs.check_sg_list passed: one SGE is
        (addr, length, mr) itself; a list of more goes to the SG table (pieces [(addr, length, mr)], the WQE
        names its rows).  A zero-length SGE is skipped, its lkey unchecked (MR-MEM-032)."""
        pieces = []
        MRT = self.ctx.plane.MRT
        bad = False
        for s in sg_list:
            if s.length == 0:
                continue
            mr = self.ctx.mrs.get(L.key_slot(s.lkey))
            if (mr is None or mr.lkey != s.lkey or not mr.valid or not MRT[mr.index, L.M_VALID]
                    or mr.pd is not self.pd or s.addr < mr.addr or s.addr + s.length > mr.addr + mr.length
                    or (need and not mr.access & need)):
                bad = True
                continue
            pieces.append((s.addr, s.length, mr.ref))      # the reference, checked on each use (MR-SEC-003)
        total = sum(s.length for s in sg_list)
        if total > 1 << 31 and not bad:
            # MR-RC-008: a message of more than 2^31 bytes "MUST complete with IBV_WC_LOC_LEN_ERR without
            # sending any packet": accepted, and failed by the loop when it is the oldest (dp/requester.py loc_why)
            return 0, total, L.MR_LEN, []
        if bad:
            # an lkey, PD, bound or LOCAL_WRITE check failed (MR-MEM-020): accepted, and reported by a
            # completion, not here (MR-RC-022): a send WQE fails LOC_PROT_ERR when it is the oldest, nothing
            # of it sent; a receive WQE fails LOC_PROT_ERR when a SEND comes for it (NAK code 3)
            return 0, total, L.MR_BAD, []
        if not pieces:
            return 0, 0, 0, []
        if len(pieces) == 1:
            return pieces[0][0], pieces[0][1], pieces[0][2], []
        return pieces[0][0], total, 0, pieces    # the loop checks each MR reference before each access

    def _sg_release(self, sq_head: int | None, rq_head: int | None) -> None:
        """SG rows of WQEs the loop has finished with (index before the queue's head) go back to the
        pool; both heads None: all of them (RESET, destroy)."""
        pool = self.ctx.plane.sg_pool
        for dq, head in ((self._sg_sq, sq_head), (self._sg_rq, rq_head)):
            while dq and (sq_head is None and rq_head is None or head is not None and dq[0][0] < head):
                _, start, n = dq.popleft()
                pool.release(start, n)

    def _sg_alloc(self, pieces: list) -> int:
        pl = self.ctx.plane
        try:
            start = pl.sg_pool.alloc(len(pieces))
        except MemoryError:
            for q in list(self.ctx.qps.values()):
                q._sg_release(int(q.row[L.Q_SQ_HEAD]), int(q.row[L.Q_RQ_HEAD]))
            try:
                start = pl.sg_pool.alloc(len(pieces))
            except MemoryError:
                raise QueueFull(f"no room for {len(pieces)} more SGEs in the port's SG table ({L.SG_ROWS} rows): "
                                "poll the CQs, then post again") from None
        pl.SG[start:start + len(pieces)] = pieces
        return start

    def _send_row(self, wr: SendWR) -> list:
        """The send-queue row of wr (its first L.NW words) + its SGE pieces, validated (verbs.check_send_wr)."""
        check_send_wr(wr, COMPILED_POST, self.cap.max_send_sge, self.profile, self.atomics)
        op = WROpcode(wr.opcode)
        atomic = op in ATOMIC_OPCODES
        addr, length, lmr, pieces = self._sge(wr.sg_list, Access.LOCAL_WRITE if atomic or op == WROpcode.RDMA_READ
                                              else Access(0))
        imm = wr.imm_data & 0xFFFFFFFF
        swap = 0
        if atomic:
            imm, swap = _i64(wr.compare_add), _i64(wr.swap)
        elif op == WROpcode.SEND_WITH_INV:
            imm = wr.invalidate_rkey & 0xFFFFFFFF            # the IETH
        return [_i64(wr.wr_id), int(op), int(wr.send_flags), addr, length, _i64(wr.remote_addr),
                wr.rkey & 0xFFFFFFFF, imm, 0, 0, 0, 0, 0, 0, lmr if length else 0, swap, 0, 0, pieces]

    def post_send(self, wrs: SendWR | list[SendWR]) -> None:
        """ibv_post_send; a list is posted whole or not at all."""
        wrs = [wrs] if isinstance(wrs, SendWR) else list(wrs)
        check_post_state(int(self.row[L.Q_STATE]), COMPILED_POST)
        rows = [self._send_row(wr) for wr in wrs]
        pl = self.ctx.plane
        with pl.post_lock:
            r = self.row
            tail = int(r[L.Q_SQ_TAIL])
            if tail - int(r[L.Q_SQ_HEAD]) + len(rows) > self.sq_size:
                raise QueueFull(f"send queue full ({self.sq_size} WQEs): poll the CQ, then post again")
            if any(row[-1] for row in rows):
                self._sg_release(int(r[L.Q_SQ_HEAD]), int(r[L.Q_RQ_HEAD]))
                taken = []
                try:
                    for i, row in enumerate(rows):
                        if row[-1]:
                            row[L.W_SG], row[L.W_NSGE] = self._sg_alloc(row[-1]), len(row[-1])
                            taken.append((tail + i, row[L.W_SG], len(row[-1])))
                except QueueFull:
                    for _, start, n in taken:
                        pl.sg_pool.release(start, n)
                    raise
                self._sg_sq.extend(taken)
            SW, base, mask = pl.SW, self.sq_base, self.sq_size - 1
            for i, row in enumerate(rows):
                SW[base + ((tail + i) & mask)] = row[:L.NW]
            r[L.Q_SQ_TAIL] = tail + len(rows)          # published after the WQEs (x86 keeps store order)
            pl.mark_ready(self.qi)

    def post_recv(self, wrs: RecvWR | list[RecvWR]) -> None:
        wrs = [wrs] if isinstance(wrs, RecvWR) else list(wrs)
        if self.query_state() == QPState.RESET:
            raise InvalidState("post_recv on a QP in RESET: move it to INIT first")
        for wr in wrs:
            check_sg_list(wr.sg_list, "RECV", self.cap.max_recv_sge, COMPILED_POST)
        rows = [(wr.wr_id & 0xFFFFFFFFFFFFFFFF, *self._sge(wr.sg_list, Access.LOCAL_WRITE)) for wr in wrs]
        pl = self.ctx.plane
        with pl.post_lock:
            r = self.row
            tail = int(r[L.Q_RQ_TAIL])
            if tail - int(r[L.Q_RQ_HEAD]) + len(rows) > self.rq_size:
                raise QueueFull(f"receive queue full ({self.rq_size} WQEs)")
            sgs = [(0, 0)] * len(rows)
            if any(row[-1] for row in rows):
                self._sg_release(int(r[L.Q_SQ_HEAD]), int(r[L.Q_RQ_HEAD]))
                taken = []
                try:
                    for i, row in enumerate(rows):
                        if row[-1]:
                            sgs[i] = (self._sg_alloc(row[-1]), len(row[-1]))
                            taken.append((tail + i, *sgs[i]))
                except QueueFull:
                    for _, start, n in taken:
                        pl.sg_pool.release(start, n)
                    raise
                self._sg_rq.extend(taken)
            for i, (wr_id, addr, length, lmr, _) in enumerate(rows):
                pl.RW[self.rq_base + ((tail + i) & (self.rq_size - 1))] = (_i64(wr_id), addr, length,
                                                                            lmr if length else 0, *sgs[i])
            r[L.Q_RQ_TAIL] = tail + len(rows)
            if int(r[L.Q_STATE]) == QPState.ERR:
                pl.mark_ready(self.qi)

    def __repr__(self) -> str:
        return f"QP({self.qp_num:#x}, {self.query_state().name})"

    # ---- compiled posting (dp/drive.py) ----------------------------------------------------
    def send_wqe(self, wr: SendWR) -> np.ndarray:
        """The send-queue row post_send would write for wr, validated as post_send validates it (any
        opcode, at most one SGE): for posting many
        copies at once from compiled code (post_send_n, dp.drive)."""
        row = self._send_row(wr)
        if row[-1]:
            raise Unsupported("compiled posting (post_send_n) takes WRs with at most one SGE: an SGE list "
                              "occupies rows of the SG table per WQE")
        return np.array(row[:L.NW], np.int64)

    def post_send_n(self, wqe: np.ndarray, n: int) -> int:
        """Post n copies of a row from send_wqe in one compiled call (no per-WR Python work); returns
        how many fitted in the send queue."""
        st = int(self.row[L.Q_STATE])
        if st != QPState.RTS and st != QPState.ERR:
            raise InvalidState(f"post_send on a QP in {QPState(st).name}: move it to RTS first")
        pl = self.ctx.plane
        from . import drive
        with pl.post_lock:
            k = drive.sq_post_n(pl.A, pl.TM, self.qi, wqe, n)
        pl.wake()
        return int(k)


# ============================================================================ the context

def qpn_for(maxq: int, qi: int) -> int:
    """A fresh QPN for row qi: 24 bits (BTH.DestQP) whose residue modulo maxq is the row (the XDP
    program's mr_qps slot, qpn % MR_MAX_QPS), the bits above it random -- 14 of them with 1024 rows.  A
    CNP carries nothing else a forger must guess (MR-SEC-032, MR-CC-035), and a SACK or request only a
    PSN in the window besides.  Never 0 or 1 (the multiplier is at least 1) nor 0xFFFFFF."""
    hi = (0xFFFFFE - qi) // maxq               # the largest multiplier that stays below 0xFFFFFF
    return maxq * (1 + secrets.randbelow(hi)) + qi

class Context:
    """ibv_context over the compiled data plane: one port (an interface, a socket per RX queue), one loop."""

    def __init__(self, port: Any, loader: Any, ifname: str, tunables: Tunables | None = None) -> None:
        self.port, self.loader, self.ifname = port, loader, ifname
        self.plane = Plane(port, loader, tunables=tunables)
        self.plane.on_event = self._event
        self.max_pmtu = port.max_pmtu
        self.local_ip, self.local_mac = port.ip, port.mac
        self.async_events = AsyncEventQueue()
        self.mrs: dict[int, MR] = {}
        self.cqs: dict[int, CQ] = {}
        self.qps: dict[int, QP] = {}
        self._retired: dict[str, dict] = {}      # peer address -> receive counters of QPs reset or destroyed
        self._pd_next = 1
        self._cq_next = 0
        self._cq_free: list[int] = []                   # first rows of destroyed CQs, reused by create_cq
        # MR rows free for registration, least recently freed first; the MR_QUARANTINE most recently freed
        # wait (MR-MEM-011), the rest are drawn at random (MR-MEM-012).  Row 0 and MR_BAD_SLOT never.
        self._mr_free = list(range(1, L.MR_BAD_SLOT))
        secrets.SystemRandom().shuffle(self._mr_free)
        self._mr_tag: dict[int, int] = {}               # row -> the tag it last carried (MR-MEM-011)
        self._mr_gen = 0                                # registrations so far: the generation of M_REF
        self.closed = False
        # routed paths: netinfo.PathWatch re-resolves running QPs' next hops on route/neighbour
        # events and local ACK timeouts and rewrites their TM rows (_Paths)
        res = getattr(port, "paths", None)
        self.paths = _Paths(self, res) if res is not None else None

    @classmethod
    def open(cls, ifname: str, *, queue: int = 0, progress_thread: bool = False, busy_poll: bool = True,
             ipv6: bool = False, frame_size: int = 4096, xdp_mode: str = "auto", pin: bool = True,
             queues: int | None = None, inproc: bool = True, tunables: Tunables | None = None) -> "Context":
        """An endpoint on a real interface: the XDP program attached, an AF_XDP socket on each RX queue
        from `queue` on (queues: how many; None, the default: every one the interface has, netinfo.rx_queues),
        all on one UMEM and served by one loop, so a QP's packets are handled whichever queue the NIC's RSS
        puts them on; ACKs consumed by the kernel into the QP slots the loop reads.  inproc=False: the
        caller runs the plane's loop itself (metaroced, dp/serve.py), so dp/inproc.py's entry points are
        not loaded.  tunables: metaroce_xdp/tunables.py (default: its defaults with the environment's
        overrides).  xdp_mode "auto" (the default): native XDP, generic where the driver refuses it;
        "drv" / "skb" force one.  What the kernel and driver would not do is given up with a warning,
        never a crash: `features()` says what this endpoint runs with."""
        from ..netinfo import rx_queues
        have = rx_queues(ifname)
        if queues is None:
            queues = max(1, have - queue)
        if queues < 1 or queue < 0 or queue + queues > have:
            raise InvalidArgument(f"queues {queue}..{queue + queues - 1}: {ifname} has RX queues 0..{have - 1}")
        if queues > L.MAX_XR:
            raise InvalidArgument(f"{queues} RX queues: at most {L.MAX_XR} (the XDP program's socket map)")
        from ..jitwarm import warm_up
        from ..kern.loader import XdpMode, check_interface_free
        from ..afxdp.port import XskPort
        check_interface_free(ifname)   # XdpBusy before any compiling when another owner lives
        from . import round as _round  # noqa: F401  (compiled or loaded from the cache before any socket exists)
        if inproc:
            # the in-process plane's compiled code (dp_round, dp_run and the rest), loaded from numba's cache
            # (or compiled, saying so on stderr) before any socket exists; its entry points have explicit
            # signatures and compile nothing afterwards.  metaroced (inproc=False) loads only what it serves.
            warm_up(planes=("compiled",))
            from . import inproc as _entries  # noqa: F401
        loader = _loader_for(ifname)
        port = None
        try:
            # multi-buffer (XDP_USE_SG) when the interface's MTU carries path MTU 4096 (MTU >= 4178)
            port = XskPort(ifname, queue=queue, frame_size=frame_size, ipv6=ipv6, multibuffer=None, queues=queues)
            loader.set_config(local_ip4=None if ipv6 else port.ip, local_ip6=port.ip if ipv6 else None,
                              local_mac=port.mac)
            for x in port.rx_socks:
                loader.set_xsk(x.queue_id, x.fileno())
            if xdp_mode == "auto":             # native mode, generic where the driver refuses it (a warning)
                loader.attach_best(ifname, pin=pin)
            else:
                loader.attach(ifname, mode=XdpMode.DRV if xdp_mode == "drv" else XdpMode.SKB, pin=pin)
            ctx = cls(port, loader, ifname, tunables=tunables)
        except BaseException:
            if port is not None:
                port.close()
            loader.close()
            raise
        if progress_thread:
            ctx.plane.start(busy=busy_poll)
        return ctx

    @property
    def gid(self) -> str:
        return self.local_ip

    def features(self) -> dict:
        """What the kernel and driver let this endpoint use: multi-buffer AF_XDP (path MTU 4096; off, and
        why, when refused), the XDP mode (native, or generic when refused, and why), the kernel release."""
        ld = self.loader
        mode = getattr(getattr(ld, "_mode", None), "value", None)
        return {"kernel": os.uname().release, "xdp_mode": mode, "xdp_native_refused": getattr(ld, "drv_refused", "") or None,
                "multibuffer": bool(self.port.sg), "multibuffer_off": self.port.multibuffer_off or None,
                "max_pmtu": self.max_pmtu, "rx_queues": list(self.port.queues)}

    # ---- events -------------------------------------------------------------------------
    def _event(self, typ: int, qi: int, arg: int, arg2: int) -> None:
        if typ == L.EV_QP_FATAL and arg == Why.SGE_LOCAL_CHECK:
            # a WQE whose local checks failed moved the QP to ERR: its completion says so, no async event
            qp = self.qps.get(qi)
            if qp is not None:
                qp.state = QPState.ERR
                qp.error_reason = reasons.text(Why.SGE_LOCAL_CHECK)
                if qp.installed:
                    self.loader.set_qp_state(qp.qp_num, int(QPState.ERR))
            return
        if typ == L.EV_CQ_NOTIFY:
            cq = self.cqs.get(arg)
            if cq is not None:
                cq.row[L.C_ARMED] = 0
                cq.channel._notify(cq)
            return
        if typ == L.EV_COMM_EST:
            qp = self.qps.get(qi)
            self.async_events.put(AsyncEvent(EventType.COMM_EST, qp=qp, reason="first request accepted in RTR"))
            return
        if typ == L.EV_SQ_DRAINED:
            qp = self.qps.get(qi)
            self.async_events.put(AsyncEvent(EventType.SQ_DRAINED, qp=qp, reason="send queue drained"))
            return
        if typ == L.EV_CQ_ERR:
            cq = self.cqs.get(arg)
            self.async_events.put(AsyncEvent(EventType.CQ_ERR, cq=cq, reason="CQ overflowed"))
            for qp in list(self.qps.values()):             # every QP using it moves to ERR (MR-QP-036)
                if (qp.send_cq is cq or qp.recv_cq is cq) and qp.query_state() != QPState.ERR:
                    with self.plane.paused():
                        qp._to_err(Why.CQ_OVERFLOW)
                    self.async_events.put(AsyncEvent(EventType.QP_FATAL, qp=qp, reason="its CQ overflowed"))
            return
        qp = self.qps.get(qi)
        why = self._invalid_why(qi, arg)
        if qp is not None:
            qp.state = QPState.ERR
            qp.error_reason = why
            if qp.installed:
                self.loader.set_qp_state(qp.qp_num, int(QPState.ERR))
        self.async_events.put(AsyncEvent(_EV_TYPE.get(typ, EventType.QP_FATAL), qp=qp, reason=why))

    def _invalid_why(self, qi: int, why: int) -> str:
        """The reason text of code `why`; for an invalid request the responder NAKed (opcode sequence, payload
        length), what the
        packet was (dp/responder.py note_invalid): the other end is told what it sent."""
        text = reasons.text(why)
        if why not in (Why.OPCODE_SEQUENCE, Why.PAYLOAD_LENGTH):
            return text
        A = self.plane.A
        if int(A[L.P_INV_QP]) == qi + 1:
            kind = _MESSAGE_IN_PROGRESS.get(int(A[L.P_INV_KIND]), "?")
            return (f"{text} (opcode 0x{int(A[L.P_INV_OP]):02x} at PSN 0x{int(A[L.P_INV_PSN]):06x}, "
                    f"{int(A[L.P_INV_LEN])} B of payload; expected PSN 0x{int(A[L.P_INV_EPSN]):06x}, {kind})")
        return text

    def get_async_event(self, timeout: float | None = 0.0) -> AsyncEvent | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if not self.plane.threaded:
                self.plane.progress()
            ev = self.async_events.get()
            if ev is not None:
                return ev
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.0005)

    # ---- resources ----------------------------------------------------------------------
    def alloc_pd(self) -> PD:
        pd = PD(self, self._pd_next)
        self._pd_next += 1
        return pd

    def reg_mr(self, pd: PD, buf: Any, access: Access = Access.LOCAL_WRITE, *, remote_invalidate: bool = False) -> MR:
        self._own_pd(pd)
        access = Access(access)
        if access & (Access.REMOTE_WRITE | Access.REMOTE_ATOMIC) and not access & Access.LOCAL_WRITE:
            raise InvalidArgument("REMOTE_WRITE/REMOTE_ATOMIC need LOCAL_WRITE too (as in ibv_reg_mr)")
        mem = as_u8(buf)
        if mem.size == 0:
            raise InvalidArgument("an MR of 0 bytes (MR-MEM-004)")
        idx = self._mr_row()
        key = self._mr_key(idx)
        # the generation counts registrations, 1 .. 2^31 - 1 (the reference stays a positive int64); the
        # count comes round after 2^31 - 1 registrations, when the row's key must also repeat to matter
        self._mr_gen = self._mr_gen % 0x7FFF_FFFF + 1
        mr = MR(self, pd, mem, access, idx, key, (self._mr_gen << 32) | key)
        mr.remote_invalidate = remote_invalidate
        row = self.plane.MRT[idx]
        row[L.M_VALID] = 0
        row[L.M_ADDR], row[L.M_LENGTH], row[L.M_KEY] = mr.addr, mr.length, key
        row[L.M_PD], row[L.M_ACCESS] = pd.handle, int(access) | (L.ACC_REMOTE_INV if remote_invalidate else 0)
        row[L.M_REF] = mr.ref
        row[L.M_VALID] = 1
        self.mrs[idx] = mr
        pd.mrs.add(idx)
        return mr

    MR_QUARANTINE = 1024        # rows freed after this one before it is drawn again (MR-MEM-011)

    def _mr_row(self) -> int:
        """A free MR row, at random among those out of quarantine (MR-MEM-011, MR-MEM-012)."""
        n = len(self._mr_free)
        if n == 0:
            raise ResourceError(f"at most {L.MR_BAD_SLOT - 1} MRs")
        eligible = n - min(self.MR_QUARANTINE, n - 1)
        return self._mr_free.pop(secrets.randbelow(eligible))

    def _mr_key(self, idx: int) -> int:
        """(index << 8) | tag (MR-MEM-008): the index's low 12 bits the row, its upper 12 bits and the tag
        random (MR-MEM-010), the tag not the row's last (MR-MEM-011, MR-SEC-002).  20 random bits in all."""
        tag = secrets.randbelow(256)
        last = self._mr_tag.get(idx)
        if last is not None and tag == last:
            tag = (tag + 1 + secrets.randbelow(255)) & 0xFF
        self._mr_tag[idx] = tag
        index = (secrets.randbits(12) << 12) | idx
        key = (index << 8) | tag
        assert L.key_slot(key) == idx
        return key

    def dereg_mr(self, mr: MR) -> None:
        """From now on no packet reaches the memory (MR-SEC-003): the valid bit is cleared, then the loop
        (which serves every RX queue) is paused once, so a round that checked the MR before finishes first;
        every later use compares the reference it kept with the row's (dp/core.py mr_live: the valid bit,
        and a generation a re-registration of the row changes), so nothing reaches the memory after this
        returns, whatever registers the row next.  The row is free again, last in line (quarantine,
        MR-MEM-011).  (M_REF stays: a check racing this one must not read 0, "no MR".)"""
        if not mr.valid:
            return
        self.plane.MRT[mr.index, L.M_VALID] = 0
        with self.plane.paused():                        # a placement in progress finishes first
            pass
        mr.valid = False
        if self.mrs.get(mr.index) is mr:
            self.mrs.pop(mr.index)
            self._mr_free.append(mr.index)
        mr.pd.mrs.discard(mr.index)

    def create_comp_channel(self) -> CompChannel:
        """ibv_create_comp_channel (completion events: CQ.req_notify)."""
        return CompChannel(self)

    def create_cq(self, depth: int = 1024, cq_context: Any = None, channel: Any = None) -> CQ:
        if depth <= 0:
            raise InvalidArgument("CQ depth must be positive")
        if channel is not None and channel.ctx is not self:
            raise InvalidArgument("the completion channel belongs to another context")
        size = _pow2(depth)
        if self._cq_free:
            idx = self._cq_free[-1]
        elif self._cq_next < L.MAX_CQS:
            idx = self._cq_next
        else:
            raise ResourceError(f"at most {L.MAX_CQS} CQs at once on this interface")
        try:
            base = self.plane.ce_pool.alloc(size)
        except MemoryError:
            raise ResourceError(f"no room for a CQ of {size} entries on this interface") from None
        if self._cq_free:
            self._cq_free.pop()
        else:
            self._cq_next += 1
        row = self.plane.CQT[idx]
        row[:] = 0
        row[L.C_BASE], row[L.C_SIZE] = base, size
        cq = CQ(self, idx, depth, size, base, cq_context, channel)
        self.cqs[idx] = cq
        return cq

    def create_qp(self, pd: PD, send_cq: CQ, recv_cq: CQ, cap: QPCap | None = None, sq_sig_all: bool = False) -> QP:
        cap = cap or QPCap()
        self._own_pd(pd)
        for q in (send_cq, recv_cq):
            if q.ctx is not self:
                raise InvalidArgument("the CQ belongs to another context")
            if self.cqs.get(q.index) is not q:
                raise InvalidState("the CQ was destroyed")
        with self.plane.paused():
            qi = next((i for i in range(1, self.plane.maxq) if i not in self.qps), None)
            if qi is None:
                raise ResourceError(f"at most {self.plane.maxq - 1} QPs per context")
            qpn = qpn_for(self.plane.maxq, qi)
            qp = QP(self, pd, send_cq, recv_cq, cap, qi, qpn, sq_sig_all)
            self.qps[qi] = qp
        pd.qps.add(qi)
        return qp

    def destroy_qp(self, qp: QP) -> None:
        if qp.ctx is not self:
            raise InvalidArgument("the QP belongs to another context")
        if self.qps.get(qp.qi) is not qp:
            raise InvalidState("the QP was destroyed already")
        with self.plane.paused():
            qp.row[L.Q_STATE] = QPState.RESET
            self._retire_counts(qp)
            qp._reset()
            qp.row[L.Q_QPN] = 0
            pl = self.plane
            pl.sq_pool.release(qp.sq_base, qp.sq_size)
            pl.rq_pool.release(qp.rq_base, qp.rq_size)
            self.qps.pop(qp.qi, None)
            qp.pd.qps.discard(qp.qi)

    def _retire_counts(self, qp: QP) -> None:
        """Before a QP's row is cleared (RESET, destroy): its receive counters join its peer's total."""
        if qp.dgid is None:
            return
        src = str(ipaddress.ip_address(qp.dgid))
        tot = self._retired.setdefault(src, dict.fromkeys(QP_RX_COUNTERS, 0))
        for k, v in qp.rx_counters().items():
            tot[k] += v

    def counters_by_source(self) -> dict[str, dict]:
        """source_counters of every peer address a QP of this Context was connected to (MR-SEC-006)."""
        addrs = set(self._retired) | {str(ipaddress.ip_address(q.dgid)) for q in list(self.qps.values())
                                      if q.dgid is not None}
        return {a: self.source_counters(a) for a in sorted(addrs)}

    def source_counters(self, ip: str) -> dict:
        """The receive counters (QP_RX_COUNTERS) of every QP connected to the peer address `ip`, the live
        ones and those reset or destroyed since the Context opened (MR-SEC-006: per source address)."""
        try:
            src = str(ipaddress.ip_address(ip))
        except ValueError:
            raise InvalidArgument(f"{ip!r} is not an IP address") from None
        out = dict(self._retired.get(src) or dict.fromkeys(QP_RX_COUNTERS, 0))
        for qp in list(self.qps.values()):
            if qp.dgid is not None and str(ipaddress.ip_address(qp.dgid)) == src:
                for k, v in qp.rx_counters().items():
                    out[k] += v
        return out

    def destroy_cq(self, cq: CQ) -> None:
        """ibv_destroy_cq: refused (ResourceError, EBUSY) while a QP uses the CQ; its rows and rings are
        reused by later CQs."""
        if cq.ctx is not self:
            raise InvalidArgument("the CQ belongs to another context")
        if self.cqs.get(cq.index) is not cq:
            raise InvalidState("the CQ was destroyed already")
        if any(q.send_cq is cq or q.recv_cq is cq for q in self.qps.values()):
            raise ResourceError("the CQ is still used by a QP: destroy the QP first")
        with self.plane.paused():
            cq.row[:] = 0
        self.plane.ce_pool.release(cq.base, cq.size)
        del self.cqs[cq.index]
        self._cq_free.append(cq.index)

    def _own_pd(self, pd: PD) -> None:
        if getattr(pd, "ctx", None) is not self:
            raise InvalidArgument("the PD belongs to another context")
        if not pd.valid:
            raise InvalidState(f"PD {pd.handle} was deallocated")

    def dealloc_pd(self, pd: PD) -> None:
        """ibv_dealloc_pd: refused (ResourceError, EBUSY) while MRs or QPs use it."""
        self._own_pd(pd)
        if pd.mrs or pd.qps:
            raise ResourceError(f"PD {pd.handle} still has {len(pd.mrs)} MRs and {len(pd.qps)} QPs")
        pd.valid = False

    def template_for(self, qp: QP, dgid: str, dmac: str | None, sport: int | None, dscp: int, dest_qp: int,
                     ecn: bool = True):
        """The QP's frame template: its path, UDP source port, DSCP and ECN field -- ECT(0), or Not-ECT for a QP
        with ECN disabled (MR-ECN-011)."""
        from ..wire.fastpath import make_template
        try:
            ipaddress.ip_address(dgid)
        except ValueError:
            raise InvalidArgument(f"dgid {dgid!r} is not an IP address") from None
        qp._hop = None
        if dmac is None:
            hop = self.port.paths.resolve(dgid)
            if ipaddress.ip_address(hop.src) != ipaddress.ip_address(self.local_ip) if hop.src else False:
                raise InvalidArgument(f"the route to {dgid} uses source {hop.src}, not this endpoint's {self.local_ip}")
            dmac = hop.mac
            qp._hop = hop
        sport = sport if sport is not None else 0xC000 | (qp.qp_num & 0x3FFF)
        t = make_template(src_mac=self.local_mac, dst_mac=dmac, src_ip=self.local_ip, dst_ip=dgid, sport=sport,
                          dest_qp=dest_qp, dscp=dscp, ecn=2 if ecn else 0)
        if t.length > 128:
            raise InvalidArgument("header template longer than 128 bytes")
        return t.buf, t.l3_off, t.ipv6

    def _track_path(self, qp: QP, given_dmac: str | None) -> None:
        """At RTR: a resolved path is kept current by PathWatch; a given dmac is the application's."""
        hop, qp._hop = qp._hop, None
        qp.dmac, qp.next_hop, qp.path_error = (hop.mac if hop else given_dmac), hop, None
        if self.paths is None:
            return
        if hop is not None:
            self.paths.watch.track(qp.qp_num, qp.dgid)
        else:
            self.paths.watch.tracked.pop(qp.qp_num, None)

    def set_read_rate(self, bps: float) -> None:
        """The link rate this port's native READ responses share (MR-CC-021), bits/s, from now on (0: not
        paced); at open it is METAROCE_READ_RATE_MBPS or the interface's speed (native/plane.py read_rate_bps)."""
        self.plane.nat.set_read_rate(bps)

    # ---- driving ------------------------------------------------------------------------
    def progress(self) -> int:
        return self.plane.progress()

    def stats(self) -> dict[str, int]:
        st = self.plane.stats()
        if self.paths is not None:
            st.update(self.paths.stats)
        return st

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.plane.close()
        self.port.close()
        if self.loader is not None:
            self.loader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Paths:
    """netinfo.PathWatch drives the compiled plane's QPs through this: the plane side of it
    (qps by number, stats, build_template, kick).  The resolver thread queues results and calls kick();
    kick applies them at once (the compiled loop has no Python round to do it in): a QP whose next hop
    moved gets its TM row's destination MAC rewritten while the loop is paused (QP.template)."""

    def __init__(self, ctx: "Context", resolver: Any) -> None:
        self.ctx = ctx
        self.stats = {"path_resolves": 0, "path_changes": 0, "path_errors": 0}
        self.lock = threading.Lock()         # one apply() at a time (resolver thread, timeout hook)
        self.watch = PathWatch(self, resolver)
        ctx.plane.on_timeout = self.on_timeout

    @property
    def qps(self) -> dict[int, QP]:
        return {q.qp_num: q for q in self.ctx.qps.values()}

    @property
    def now(self) -> int:
        return time.monotonic_ns()

    def build_template(self, qp: QP, dmac: str, src: str | None = None) -> np.ndarray:
        """The QP's TM row with the frame and CNP templates sent to `dmac`.  The source MAC is the
        port's and the source address the endpoint's GID: a route using another source is refused, as
        (NetInfoError)."""
        if src is not None and ipaddress.ip_address(src) != ipaddress.ip_address(self.ctx.local_ip):
            raise NetInfoError(f"the route to {qp.dgid} uses source {src}, but this endpoint's address (its GID) "
                               f"is {self.ctx.local_ip}: make the route use it (ip route change <prefix> via "
                               f"<gateway> src {self.ctx.local_ip})")
        mac = np.frombuffer(bytes.fromhex(dmac.replace(":", "")), np.uint8)
        row = qp.template
        row[0:6] = mac
        row[L.TM_CNP:L.TM_CNP + 6] = mac
        return row

    def kick(self) -> None:
        if self.ctx.closed:
            return
        with self.lock:
            self.watch.apply()

    def on_timeout(self) -> None:
        """The loop's local ACK timer fired on some QP: re-resolve running QPs' paths, in case a
        route or neighbour event was missed."""
        for qp in list(self.ctx.qps.values()):
            dgid = self.watch.tracked.get(qp.qp_num)
            if dgid is not None and qp.state in (QPState.RTS, QPState.SQD):
                self.watch.recheck(qp.qp_num, dgid)


__all__ = ["Context", "CQ", "MR", "PD", "Plane", "QP", "Unsupported", "VerbsError"]
_ = struct
