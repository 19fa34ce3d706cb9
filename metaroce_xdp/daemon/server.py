"""metaroced's core: the compiled data plane of each owned interface, served over a Unix socket.

    d = Daemon(cfg)          # cfg: metaroce_xdp.daemon.config.DaemonConfig
    d.start()                # clean a crashed instance's leftovers, open the interfaces, bind the socket
    d.run(stop, tick)        # serve until stop (a threading.Event) is set; tick() about every 100 ms
    d.drain_and_stop(5.0)    # finish or flush outstanding work, detach XDP, remove the socket
    d.reload(new_cfg)        # what can change at run time; ConfigError for the rest
    d.snapshot()             # live state (docs/daemon.md, "snapshot() schema")

Threads: the caller's thread runs `run()` (accepts, control requests, client exits, tick); each
interface has one driver thread (`Device._drive`) that runs the GIL-free compiled loop
`dp.serve.dp_serve`: it takes the work requests clients wrote into their shared rings (validated:
opcode, flags, lkey of the QP's own PD, bounds, access) into the data plane's queues, runs the data
plane's rounds and copies completions into the clients' CQ rings -- no Python per work request; it
returns to Python only for data-plane events, a pause or every SERVE_SLICE_NS.  Clients never see
the data plane's arena.  The client objects' rows the loop reads (Device.QX/CX/SX) are written with
the loop paused.

Locks, always taken in this order: Device.reg_lock (the maps of clients' objects), then the plane's
lock (held by the driver around dp_serve; control operations take it via plane.paused()).

Neighbours: shm.py (ring layouts), proto.py (messages, typed errors), client.py (the other end),
metaroce_xdp/dp (the data plane), metaroce_xdp/kern/loader.py (XDP program, pins).
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import grp
import ipaddress
import json
import logging
import os
import resource
import selectors
import socket
import stat
import struct
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .. import __version__, cm
from ..verbs_types import (Access, InvalidArgument, InvalidState, QPAttr, QPCap, QPState, ResourceError, VerbsError)
from ..dp.reasons import Why
from ..dp.reasons import text as reasons_text
from ..tunables import Tunables
from ..tunables import load as load_tunables
from .. import shm
from . import caps, proto
from .config import ConfigError, DaemonConfig
from .proto import DaemonError, LimitExceeded, MalformedRequest, PermissionDenied, UnknownHandle
from .startup import LOADER_MAX_QPS, Build, StartClock, prebuild_xdp

log = logging.getLogger("metaroced")

SCAN_EVERY_S = 0.01           # fallback scan of every QP ring (a doorbell lost to a full ring)
SERVE_SLICE_NS = 50_000_000   # dp_serve returns to Python at least this often (progress mode, stop)
SLEEP_SLICE_NS = 20_000_000   # poll() timeout while the loop sleeps (bounds a wake-up lost to a race)
MAX_SESSIONS = 1024           # rows of the loop's session table (clients with a device open)
# Q_ERR codes of the daemon's own (dp/reasons.py): an invalid work request in the client's ring (dp/serve.py), the
# owning client exited, the daemon is stopping; the client itself moved the QP to ERR (no event owed)
WHY_BAD_WR, WHY_CLIENT_GONE, WHY_DRAIN, WHY_ASKED = (Why.BAD_WORK_REQUEST, Why.CLIENT_GONE, Why.DAEMON_STOPPING,
                                                     Why.MODIFIED_TO_ERR)
PATH_WAIT_S = 2.0             # how long an RTR waits for its next hop's MAC (ARP/ND), on a thread of its own
EVENT_CHECK_S = 0.5           # how often QPs in ERR without their QP_FATAL sent are looked for (Daemon._owed_events)
CREDIT_ACTIVE_WINDOW_US = 50_000  # MR-CC-018's active_window here: a sender counts as active for 50 ms after its
                                # last packet (its process may be descheduled for ms on shared cores, MR-CC-042)

# per-client shares of an interface's fixed tables (beside the configured limits), so that no client can take
# the queue rows, CQ slots or MR slots every other client needs
MAX_WQES_PER_CLIENT = 8192      # send + receive queue entries over all its QPs (the plane has 32768 of each)
MAX_CQES_PER_CLIENT = 16384     # CQ entries over all its CQs (the plane has 131072)
MAX_CQS_PER_CLIENT = 32         # of the plane's 256
MAX_MRS_PER_CLIENT = 512        # of the plane's 4095
MAX_PDS_PER_CLIENT = 64         # a PD costs the daemon a dict entry and the plane a number: bounded all the same
# file descriptors: every QP and CQ holds its ring's memfd, every client its socket, session header and wake-up
# eventfd.  The daemon
# raises RLIMIT_NOFILE to its hard limit at start; what is left after its own descriptors (FD_SLACK kept for
# sockets being answered, memfds in flight, the metrics server) is shared out so that max_clients clients each
# get the same budget: one client cannot run the daemon out of descriptors (EMFILE) for the others
FD_SLACK = 128
FDS_PER_SESSION = 4             # the client's socket, its session header's memfd, its wake-up eventfd and its event eventfd
MAX_REFUSED_PENDING = 32        # refused connections waiting to read why; more are closed without an answer

RUNTIME_OPTIONS = ("max_clients", "max_qps_per_client", "max_native_qps_per_client", "max_mr_bytes_per_client",
                   "log_level", "drain_timeout_s",
                   "progress", "busy_idle_ms", "socket_mode", "socket_group", "watchdog", "metrics_listen",
                   "metrics_per_qp", "profile", "read_rate_mbps")
FIXED_OPTIONS = ("interfaces", "rx_queues", "socket_path", "bpffs_prefix", "cm_port", "credit_budget")

_ATTR_FIELDS = {f.name for f in dataclasses.fields(QPAttr)} - {"alt_path"}


def _copy(view) -> list:
    """list(view) of a dict or set another thread may change meanwhile (snapshot() takes no lock)."""
    for _ in range(10):
        try:
            return list(view)
        except RuntimeError:            # changed size during iteration: try again
            continue
    return []


def raise_fd_limit() -> int:
    """RLIMIT_NOFILE's soft limit raised to its hard limit (the unit's LimitNOFILE; 1024 soft is the default, which
    256 QPs of four clients would exhaust); returns the limit in effect."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:
            log.warning("cannot raise RLIMIT_NOFILE from %d to %d: %s", soft, hard, e)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


HUGETLBFS_MAGIC = 0x958458F6     # linux/magic.h


def fs_magic(fd: int) -> int:
    """f_type of fstatfs(fd): which file system the descriptor's file lives on."""
    import ctypes
    buf = ctypes.create_string_buffer(256)          # struct statfs is 120 bytes on 64-bit Linux
    if ctypes.CDLL(None, use_errno=True).fstatfs(fd, buf) != 0:
        raise OSError(ctypes.get_errno(), "fstatfs")
    return struct.unpack_from("l", buf.raw)[0] & 0xFFFFFFFF


def placeable_size(fd: int) -> int:
    """The size of a client's memfd the data plane may place bytes into for as long as it is registered;
    ValueError with what to do otherwise.  Sealed against shrinking (shm.sealed_size): a truncated file would
    fault under the daemon's mapping.  Not on hugetlbfs: no seal stops fallocate(PUNCH_HOLE) short of forbidding
    writes; a hole in shmem (a plain memfd) refaults as a zero page, but a hole in a hugetlb file needs a free huge
    page at the next access and, with the pool empty, the daemon's access is SIGBUS -- every tenant's daemon
    killed by one client (measured: punch, take the pool, touch the mapping: SIGBUS)."""
    size = shm.sealed_size(fd)
    try:
        magic = fs_magic(fd)
    except OSError as e:
        raise ValueError(f"cannot tell which file system the memfd is on ({e})") from None
    if magic == HUGETLBFS_MAGIC:
        raise ValueError("a hugetlb memfd (MFD_HUGETLB) cannot be registered: a hole punched in it would make the "
                         "daemon's next access fault (SIGBUS) once the huge page pool is empty; use "
                         "Context.alloc_buf(hugepages=True), which asks for transparent huge pages of shared memory")
    return size


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


# ================================================================================ per-client objects
class SQP:
    """A client's QP: the data plane's QP and the shared rings the client posts into."""

    def __init__(self, h: int, sess: "Session", dev: "Device", dpqp: Any, fd: int, mm: Any) -> None:
        self.h, self.sess, self.dev, self.dpqp, self.fd, self.mm = h, sess, dev, dpqp, fd, mm
        self.W = shm.words(mm)
        self.qi = dpqp.qi
        self.sq_size, self.rq_size = dpqp.sq_size, dpqp.rq_size
        self.rate_bps = 0.0
        self._rate_t, self._rate_b = time.monotonic(), 0
        self.destroyed = False
        self.err_told = False                   # QP_FATAL sent to the client (or owed none)
        self.err_seen = False                   # in ERR at the last check without it (Daemon._owed_events)

    # the loop's own counts (dp/serve.py QX row; the shm copies are for the client)
    def _x(self, col: int) -> int:
        return int(self.dev.QX[self.qi, col])

    sq_taken = property(lambda self: self._x(self.dev.serve.QX_SQ_TAKEN))
    rq_taken = property(lambda self: int(self.dpqp.row[self.dev.L.Q_CRQ_TAKEN]))    # dp/clientq.py
    bytes_tx = property(lambda self: self._x(self.dev.serve.QX_BYTES_TX))
    bytes_rx = property(lambda self: self._x(self.dev.serve.QX_BYTES_RX))

    @property
    def dead(self) -> bool:
        """Destroyed, or its rings are no longer read (it wrote an invalid work request)."""
        return self.destroyed or bool(self._x(self.dev.serve.QX_DEAD))

    def mirror_state(self) -> None:
        r = self.dpqp.row
        self.W[shm.QH_ERR] = int(r[self.dev.L.Q_ERR])
        self.W[shm.QH_STATE] = int(r[self.dev.L.Q_STATE])


class SCQ:
    def __init__(self, h: int, sess: "Session", dpcq: Any, fd: int, mm: Any) -> None:
        self.h, self.sess, self.dpcq, self.fd, self.mm = h, sess, dpcq, fd, mm
        self.W = shm.words(mm)
        self.size = dpcq.size
        self.tail = 0                           # the daemon's own count of completions delivered


class SMR:
    def __init__(self, h: int, dpmr: Any, mm: Any, length: int, pd_h: int) -> None:
        self.h, self.dpmr, self.mm, self.length, self.pd_h = h, dpmr, mm, length, pd_h


class _Wait(Exception):
    """Raised by an op whose reply waits for something slow (a peer's MAC, resolved by ARP/ND): `work()` runs
    on a thread of its own while the serving thread serves the other clients; then the op runs again on the
    serving thread (or its error, if work raised, is the reply).  Until then the client's socket is not read:
    one request of a client waits at a time, and its replies stay in order."""

    def __init__(self, what: str, work: Callable[[], None]) -> None:
        super().__init__(what)
        self.what, self.work = what, work


class Session:
    """One client connection: its credentials, its objects (handles are per client), its header ring."""

    def __init__(self, sid: int, sock: socket.socket, pid: int, uid: int, gid: int,
                 max_pending_events: int = 1024) -> None:
        self.max_pending_events = max_pending_events
        self.id, self.sock, self.pid, self.uid, self.gid = sid, sock, pid, uid, gid
        try:
            self.comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            self.comm = "?"
        self.dev: Device | None = None
        self.pds: dict[int, Any] = {}
        self.mrs: dict[int, SMR] = {}
        self.cqs: dict[int, SCQ] = {}
        self.qps: dict[int, SQP] = {}
        self.mr_bytes = 0
        self._next = 1
        self.fds = FDS_PER_SESSION               # descriptors the daemon holds for this client
        self.send_lock = threading.Lock()
        self.hdr_fd = shm.create(shm.H_WORDS * 8, "metaroce-session")
        self.hdr_mm = shm.map_fd(self.hdr_fd, shm.round_page(shm.H_WORDS * 8))
        self.H = shm.words(self.hdr_mm)
        self.H[shm.H_MAGIC] = shm.MAGIC
        self.H[shm.H_SESSION] = sid
        self.slot = -1                           # its row in Device.SX (dp/serve.py), from open_device
        # the eventfd this client writes when the loop sleeps (its own: the plane's, shared by every client, could
        # be drained by one to steal the others' wake-ups or written in a loop to keep the loop awake); the
        # serving thread forwards it to the plane only while the loop sleeps (Daemon._wake)
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # the other way: written after each event message went into the client's socket, so that an event loop
        # can wait on it (client Context.fileno()); the client reads it before draining its socket
        self.event_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.wakes = self.wakes_forwarded = 0
        self.events_pending = 0                  # queued in Daemon._events, not yet sent
        self.events_lost = 0                     # not queued: more than max_pending_events were pending
        self.events_lost_told = 0
        self.gone = False                        # set by any thread; the serving thread reclaims
        self.waiting: str | None = None          # what its request waits for (_Wait), its socket unread meanwhile
        # not yet taken by its socket: (message, descriptors, whether it is an event)
        self.outbox: collections.deque[tuple[bytes, list[int], bool]] = collections.deque()
        self.watch: Callable[[], None] | None = None      # Daemon._watch: what the serving thread waits for on it

    def handle(self) -> int:
        h = self._next
        self._next += 1
        return h

    def owner(self) -> dict:
        return {"pid": self.pid, "uid": self.uid, "comm": self.comm}

    def push(self, obj: dict, fds: list[int] | tuple = (), limit: int = proto.MAX_MSG, event: bool = False) -> bool:
        """Send a reply or an event without waiting: what the client's full socket does not take waits in its
        outbox (the serving thread sends it when the socket is writable, and reads no request of that client
        meanwhile), so a client that does not read costs itself only.  An event finding max_pending_events
        messages in the outbox is not queued (False: the caller counts it lost); a reply always is."""
        if self.gone:
            return False
        try:
            data = proto.encode(obj, limit)
        except proto.MalformedRequest as e:             # our reply too large: say so instead
            try:
                data = proto.encode(proto.error_reply(e, obj.get("id")))
            except proto.MalformedRequest:              # the id itself nearly fills MAX_MSG (fuzzer N2): not echoed
                data = proto.encode(proto.error_reply(e, None))
            fds = ()
        with self.send_lock:
            if self.outbox:
                if event and len(self.outbox) >= self.max_pending_events:
                    return False
                self.outbox.append((data, [os.dup(fd) for fd in fds], event))   # later: the fds may close meanwhile
                return True
            try:
                proto.send_bytes(self.sock, data, fds)
                if event:
                    self._signal_event()
                return True
            except BlockingIOError:
                self.outbox.append((data, [os.dup(fd) for fd in fds], event))
            except OSError as e:
                log.warning("client pid %d: cannot send (%s); dropping it", self.pid, e)
                self.gone = True
                return False
        if self.watch is not None:
            self.watch()                                # write-ready, not read-ready, until the outbox is empty
        return True

    def flush(self) -> None:
        """The socket is writable: send what the outbox holds, in order, until it is empty or full again."""
        with self.send_lock:
            while self.outbox and not self.gone:
                data, fds, event = self.outbox[0]
                try:
                    proto.send_bytes(self.sock, data, fds)
                except BlockingIOError:
                    return
                except OSError as e:
                    log.warning("client pid %d: cannot send (%s); dropping it", self.pid, e)
                    self.gone = True
                    return
                self.outbox.popleft()
                for fd in fds:
                    os.close(fd)
                if event:
                    self._signal_event()

    def _signal_event(self) -> None:
        if self.event_fd < 0:
            return
        try:
            os.eventfd_write(self.event_fd, 1)
        except OSError:
            pass                                        # closed by the reclaim meanwhile, or at its maximum

    def drop_outbox(self) -> None:
        with self.send_lock:
            for _, fds, _ in self.outbox:
                for fd in fds:
                    os.close(fd)
            self.outbox.clear()


# ================================================================================ one interface
def _dp():
    """The data plane modules (numba): imported by the daemon only, never by clients."""
    from ..dp import context as dpc
    from ..dp import layout as L
    return dpc, L


def load_native_entries() -> None:
    """The native profile's functions Python calls at a native QP's RTR and RTS (native/plane.py NativeSlots:
    rx_init, tx_init, mp_init), loaded from numba's cache now instead of at the first native RTR.  The rest of
    native/ is compiled into dp_serve and never loaded on its own (jitcache.lazy_njit)."""
    from ..native import multipath, receiver, sender
    for fn in (receiver.rx_init, sender.tx_init, multipath.mp_init):
        fn.ensure()


def _preload_loops() -> None:
    try:
        from ..dp import round, serve  # noqa: F401  (numba's cache loaded; Context.open then finds them imported)
    except Exception:                 # noqa: BLE001 - Context.open imports them again and says what is wrong
        log.debug("preloading the compiled loops failed", exc_info=True)


def _make_context_class():
    dpc, L = _dp()

    class DaemonContext(dpc.Context):
        """dp.Context with the daemon's limits on CQs (no completion channels in the daemon: an armed CQ's
        completion event goes to its client as a CQ_NOTIFY message) and event hooks."""

        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self.on_qp_event: Callable[[Any, int, int], None] | None = None
            self.on_cq_event: Callable[[Any], None] | None = None
            self.on_cq_notify: Callable[[Any], None] | None = None

        def create_cq(self, depth: int = 1024, cq_context: Any = None, channel: Any = None):
            if not 0 < depth <= 1 << 16:
                raise InvalidArgument(f"CQ depth {depth}: use 1 .. 65536")
            if channel is not None:
                raise dpc.Unsupported("completion channels are not implemented by the compiled data plane")
            return super().create_cq(depth, cq_context)

        def _event(self, typ: int, qi: int, arg: int, arg2: int) -> None:
            if typ == L.EV_CQ_NOTIFY:                   # the loop disarmed the CQ (dp/core.py cq_notify)
                cq = self.cqs.get(arg)
                if cq is not None and self.on_cq_notify is not None:
                    self.on_cq_notify(cq)
                return
            super()._event(typ, qi, arg, arg2)
            if typ == L.EV_CQ_ERR:
                if self.on_cq_event is not None:
                    self.on_cq_event(self.cqs.get(arg))
            elif self.on_qp_event is not None:
                self.on_qp_event(self.qps.get(qi), typ, arg)

    return DaemonContext


def umem_frames(ctx: Any) -> dict:
    """Where the UMEM frames of a data-plane context's socket are (dp Plane.frames), read with its loop paused."""
    with ctx.plane.paused():
        return ctx.plane.frames()


class Device:
    """One owned interface: its data-plane context, the clients' objects on it, the driver thread."""

    def __init__(self, daemon: "Daemon", ifname: str, ctx: Any) -> None:
        self.daemon, self.ifname, self.ctx = daemon, ifname, ctx
        self.dpc, self.L = _dp()
        from ..dp import serve
        self.serve = serve
        assert serve.WHY_BAD_WR == WHY_BAD_WR
        self.plane = ctx.plane
        # tunable trace (METAROCE_DP_TRACE=PATH): the loop records when it takes ring entries, receives and sends
        # packets and delivers completions (dp/serve.py trace); written to PATH.<ifname>.npy at close
        # (daemon/bench.py --trace)
        self.trace_path = ctx.plane.tunables.trace
        # what the compiled loop knows of the clients' objects (dp/serve.py): rows written with the loop paused
        self.QX, self.CX, self.SX, self.G = serve.tables(self.plane.maxq, self.L.MAX_CQS, MAX_SESSIONS,
                                                         int(SCAN_EVERY_S * 1e9), daemon.cfg.busy_idle_ms * 1_000_000,
                                                         1 << 18 if self.trace_path else 0)
        # the receiver's credit allocation over every client's native QPs (MR-CC-018, dp/serve.credits)
        self.CPAR, self.CRX = serve.credit_tables(self.G, **daemon.receiver_params())
        self.plane.threaded = True          # posts never drive rounds from the calling thread
        self.plane.A[self.L.P_POLL_MS] = SLEEP_SLICE_NS // 1_000_000
        self.reg_lock = threading.RLock()
        self.sessions: set[Session] = set()
        self.qp_by_qi: dict[int, SQP] = {}
        self.cq_by_idx: dict[int, SCQ] = {}
        self.stopping = False
        self._thread: threading.Thread | None = None
        self._running = threading.Event()   # set by the driver thread as it enters dp_serve the first time
        self.iterations = 0                 # driver loop iterations (returns of dp_serve)
        # the doorbell byte clients set after a post (protocol version 1); the compiled loop reads the
        # clients' doorbell rings directly every round, so nothing waits for it
        self.bell_fd = shm.create(shm.PAGE, "metaroce-bell")
        self.bell_mm = shm.map_fd(self.bell_fd, shm.PAGE)
        self.bell = np.frombuffer(self.bell_mm, np.uint8)
        self.bell_addr = int(self.bell.ctypes.data)
        ctx.on_qp_event = self._qp_event
        ctx.on_cq_event = self._cq_event
        ctx.on_cq_notify = self._cq_notify

    # ---- the loop's tables (dp/serve.py) ------------------------------------------------------
    def attach_session(self, s: "Session") -> None:
        SX, sv = self.SX, self.serve
        free = np.nonzero(SX[:, sv.SX_ADDR] == 0)[0]
        if not len(free):
            raise LimitExceeded(f"{MAX_SESSIONS} clients already use {self.ifname}")
        slot = int(free[0])
        with self.plane.paused():
            SX[slot, sv.SX_RDY_HEAD] = int(s.H[shm.H_RDY_TAIL])
            SX[slot, sv.SX_ADDR] = int(s.H.ctypes.data)
            self.G[sv.G_NSX] = max(int(self.G[sv.G_NSX]), slot + 1)
        s.slot = slot

    def detach_session(self, s: "Session") -> None:
        if s.slot < 0:
            return
        with self.plane.paused():
            self.SX[s.slot] = 0
        s.slot = -1

    def attach_qp(self, q: SQP) -> None:
        sv = self.serve
        with self.plane.paused():
            row = self.QX[q.qi]
            row[:] = 0
            row[sv.QX_SESS], row[sv.QX_QPN] = q.sess.slot, q.dpqp.qp_num
            row[sv.QX_SQ_SIZE] = q.sq_size
            row[sv.QX_ADDR] = int(q.W.ctypes.data)
            # the receive ring, which the responder reads too (dp/clientq.py)
            L, r = self.L, q.dpqp.row
            r[L.Q_CRQ_OFF] = 8 * (shm.QH_WORDS + q.sq_size * shm.SQE_WORDS)
            r[L.Q_CRQ_SIZE], r[L.Q_CRQ_TAKEN] = q.rq_size, 0
            r[L.Q_CRQ] = int(q.W.ctypes.data)

    def detach_qp(self, q: SQP) -> None:
        with self.plane.paused():
            self.QX[q.qi] = 0
            q.dpqp.row[self.L.Q_CRQ] = 0     # before its mapping goes: the loop never reads it again

    def attach_cq(self, c: SCQ) -> None:
        sv = self.serve
        with self.plane.paused():
            row = self.CX[c.dpcq.index]
            row[:] = 0
            row[sv.CX_SIZE] = c.size
            row[sv.CX_ADDR] = int(c.W.ctypes.data)

    def detach_cq(self, c: SCQ) -> None:
        with self.plane.paused():
            self.CX[c.dpcq.index] = 0

    def bad_wr_text(self, qi: int) -> str:
        """Why the loop refused a work request of QP qi (its QX row)."""
        sv = self.serve
        x = [int(v) for v in self.QX[qi]]
        code, op, a, b, c = x[sv.QX_BAD], x[sv.QX_BAD_OP], x[sv.QX_BAD_A], x[sv.QX_BAD_B], x[sv.QX_BAD_C]
        if code in (sv.BAD_SQ_TAIL, sv.BAD_RQ_TAIL):
            return f"{'send' if code == sv.BAD_SQ_TAIL else 'receive'} ring tail {a} is not within {c} of head {b}"
        if code == sv.BAD_SEND_STATE:
            return f"a send posted in {QPState(a).name if 0 <= a <= 6 else a}"
        if code == sv.BAD_OPCODE:
            return f"opcode {op} is not one the data plane implements"
        if code == sv.BAD_FLAGS:
            return f"send_flags {a:#x}: only FENCE, SIGNALED and SOLICITED"
        if code == sv.BAD_SGE_LEN:
            return f"SGE length {b} out of range"
        if code == sv.BAD_ATOMIC:
            return (f"atomic with an SGE of {b} bytes (one of 8 holds the original value) and remote address "
                    f"{a:#x} (a multiple of 8, MR-XH-011)")
        return (f"SGE (addr {a:#x}, length {b}, lkey {c:#x}) is not inside a valid MR of the QP's PD"
                + (" with LOCAL_WRITE" if sv.OP_READ <= op <= sv.OP_LAST or op == sv.OP_RECV else ""))

    # ---- events from the data plane --------------------------------------------------------
    def _qp_event(self, dpqp: Any, typ: int, why: int) -> None:
        q = self.qp_by_qi.get(dpqp.qi) if dpqp is not None else None
        if q is None:
            return
        if typ in (self.L.EV_COMM_EST, self.L.EV_SQ_DRAINED):          # MR-QP-021, MR-QP-013: not errors
            name = "COMM_EST" if typ == self.L.EV_COMM_EST else "SQ_DRAINED"
            self.daemon.post_event(q.sess, {"event": name, "qp": q.h, "qp_num": dpqp.qp_num})
            return
        if typ not in (self.L.EV_QP_FATAL, self.L.EV_QP_REQ_ERR, self.L.EV_QP_ACCESS_ERR):
            return
        if typ == self.L.EV_QP_FATAL and why == Why.SGE_LOCAL_CHECK:
            # a WQE whose local checks failed moved the QP to ERR: its completion says so, no async event
            # (MR-RC-022, as the compiled plane in process)
            q.mirror_state()
            q.err_told = True
            return
        q.mirror_state()
        self.note_bad_wr(q, why)
        log.info("qpn %#x (pid %d): QP error: %s", dpqp.qp_num, q.sess.pid, dpqp.error_reason)
        q.err_told = True
        self.daemon.post_event(q.sess, {"event": "QP_FATAL", "qp": q.h, "qp_num": dpqp.qp_num,
                                        "reason": dpqp.error_reason})

    def note_bad_wr(self, q: SQP, why: int) -> None:
        """The QP went to ERR on an invalid entry in its shared ring: its error_reason says which (the event's
        or, when the plane's event ring dropped it, Daemon._owed_events's QP_FATAL carries it)."""
        if why != WHY_BAD_WR:
            return
        text = self.bad_wr_text(q.dpqp.qi)
        q.dpqp.error_reason = "the client wrote an invalid work request into its ring: " + text
        log.warning("qpn %#x (pid %d): invalid work request in the shared ring: %s", q.dpqp.qp_num, q.sess.pid,
                    text)

    def _cq_event(self, dpcq: Any) -> None:
        c = self.cq_by_idx.get(dpcq.index) if dpcq is not None else None
        if c is None:
            return
        c.W[shm.CH_OVERFLOW] = 1
        log.info("cq %d (pid %d): overflowed; its QPs moved to ERR", c.h, c.sess.pid)
        self.daemon.post_event(c.sess, {"event": "CQ_ERR", "cq": c.h,
                                        "reason": "CQ overflowed: poll it faster or make it deeper"})
        for q in list(c.sess.qps.values()):
            q.mirror_state()

    def _cq_notify(self, dpcq: Any) -> None:
        """An armed CQ got the completion it waited for (ibv_req_notify_cq, MR-BTH-004): its client hears of it,
        once per arming.  The loop delivered the completion into the client's ring before it raised the event."""
        c = self.cq_by_idx.get(dpcq.index)
        if c is not None:
            self.daemon.post_event(c.sess, {"event": "CQ_NOTIFY", "cq": c.h})

    # ---- the driver thread --------------------------------------------------------------------
    def start(self, timeout_s: float = 10.0) -> None:
        """The driver thread; returns once its loop runs (it entered dp_serve), so that ready means serving."""
        self._thread = threading.Thread(target=self._drive, name=f"metaroced-{self.ifname}", daemon=True)
        self._thread.start()
        if not self._running.wait(timeout_s):
            log.warning("%s: the driver loop has not started within %.0f s", self.ifname, timeout_s)

    def _drive(self) -> None:
        errors = 0
        while not self.stopping:
            try:
                self._drive_loop()
            except Exception:               # noqa: BLE001 - the data plane of every client must go on
                errors += 1
                if errors <= 10 or errors % 1000 == 0:
                    log.exception("%s: driver loop error %d (continuing)", self.ifname, errors)
                time.sleep(0.001)

    def _drive_loop(self) -> None:
        pl, L, A = self.plane, self.L, self.plane.A
        dp_serve = self.serve.dp_serve
        QX, CX, SX, G = self.QX, self.CX, self.SX, self.G
        while not self.stopping:
            self.iterations += 1
            # busy mode spins only while the interface has QPs: with none there is nothing to wait for
            sleepy = self.daemon.cfg.progress == "sleep" or not self.qp_by_qi
            with pl.lock:
                if self.stopping:
                    break
                if not self._running.is_set():
                    self._running.set()
                rc = dp_serve(A, pl.TM, pl.umem, pl.tables, QX, CX, SX, G, self.CPAR, self.CRX, SERVE_SLICE_NS,
                              1 if sleepy else 0)
            if A[L.P_EV_TAIL] != A[L.P_EV_HEAD]:
                try:
                    pl.drain_events()
                except Exception:           # noqa: BLE001 - an event hook must not stop the data plane
                    log.exception("%s: handling a data-plane event failed", self.ifname)
            if rc == 2:
                time.sleep(0)               # a control operation paused us: let it take the lock

    def stop(self) -> None:
        self.stopping = True
        self.plane.A[self.L.P_STOP] = 1
        try:
            os.eventfd_write(self.plane.efd, 1)
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # ---- state for snapshot() -------------------------------------------------------------------
    def info(self) -> dict:
        from .. import cm
        port = self.ctx.port
        ld = self.ctx.loader
        try:
            mtu = int(Path(f"/sys/class/net/{self.ifname}/mtu").read_text())
        except (OSError, ValueError):
            mtu = None
        G, sv = self.G, self.serve
        plane = self.ctx.stats()
        counters = {"plane": plane, "driver_iterations": self.iterations,
                    # receive WRs the responder took before an RNR NAK (dp/clientq.py) are taken too
                    "wrs_taken": int(G[sv.G_TAKEN]) + plane.get("late_recvs", 0),
                    "cqes_delivered": int(G[sv.G_DELIVERED]),
                    "bad_wrs": int(G[sv.G_BAD]), "ring_scans": int(G[sv.G_SCANS]),
                    "credit_runs": int(G[sv.G_CREDIT_RUNS])}
        try:
            counters["xdp_drops"] = ld.drops()
            counters["xdp_events"] = ld.events()
            counters["xsk"] = port.xsk.statistics()
            # per RX queue: frames received, owed to its fill ring, and its socket's kernel counters
            counters["rx_queues"] = [dict(q, xsk=s.statistics())
                                     for q, s in zip(self.ctx.plane.queue_stats(), port.rx_socks)]
            counters["umem"] = umem_frames(self.ctx)
        except Exception:                           # noqa: BLE001 - the maps may be gone while stopping
            pass
        return {"ifname": self.ifname, "mtu": mtu, "mac": port.mac, "gids": [cm.gid_text(cm.ip_to_gid(port.ip))],
                "ip": port.ip, "queues": list(port.queues),
                "caps": {"plane": "compiled", "max_pmtu": self.ctx.max_pmtu, "max_qps": self.plane.maxq - 1,
                         "max_cqs": self.L.MAX_CQS, "max_mrs": self.L.MAX_MRS - 1, "max_sge": 1,
                         "opcodes": ["RDMA_WRITE", "RDMA_WRITE_WITH_IMM", "SEND", "SEND_WITH_IMM", "RDMA_READ",
                                     "ATOMIC_CMP_AND_SWP", "ATOMIC_FETCH_AND_ADD", "SEND_WITH_INV"],
                         "cm_caps": ["IPV6"] if ":" in port.ip else [],
                         "profiles": self.daemon.profiles(), "credits": self.daemon.cfg.credit_budget > 0,
                         "read_rate_bps": self.ctx.plane.nat.read_rate},
                "features": self.ctx.features(),
                "counters": counters, "pins": str(ld._pin_dir) if getattr(ld, "_pin_dir", None) else None}

    def apply_read_rate(self, cfg: DaemonConfig) -> None:
        """read_rate_mbps for this interface (MR-CC-021); unset: what the data plane chose at open
        (METAROCE_READ_RATE_MBPS, else the interface's speed)."""
        bps = cfg.read_rate_bps(self.ifname)
        if bps is None:
            from ..native import plane
            bps = plane.read_rate_bps(self.ifname)
        self.ctx.set_read_rate(bps)
        log.info("%s: native READ responses paced at %.0f Mb/s in all (MR-CC-021)%s", self.ifname, bps / 1e6,
                 "" if bps else ": not paced")

    def qp_info(self, q: SQP) -> dict:
        L = self.L
        r = q.dpqp.row
        now = time.monotonic()
        if now - q._rate_t >= 0.5:
            q.rate_bps = 8.0 * (q.bytes_tx - q._rate_b) / (now - q._rate_t)
            q._rate_t, q._rate_b = now, q.bytes_tx
        naks_rx = rnr = srtt_ns = None
        if q.dpqp.installed and self.ctx.loader is not None:
            try:
                slot = self.ctx.loader.qp(q.dpqp.qp_num)
                naks_rx, rnr = int(slot["naks"]), int(slot["rnr_naks"])
                # compat: the XDP program's, from the ACKs covering an RTT probe (none while the compiled
                # plane's requester posts no probe: then 0, reported as null)
                srtt_ns = int(slot["srtt_ns"]) or None
            except Exception:                       # noqa: BLE001
                pass
        cnp = self.cnp_counters(q)
        st = QPState(int(r[L.Q_STATE]))
        nat = None
        if q.dpqp.profile == "native":
            from ..native import layout as NL
            rows = self.plane.nat.rows(q.qi)
            if rows is not None:
                nat = {**q.dpqp.native_counters(), "credits": int(rows[0][NL.P_CREDITS]),
                       "rx_credit": int(rows[1][NL.R_CREDIT])}
                srtt_ns = nat.get("srtt_ns") or srtt_ns     # native: the sender's, from SACK timestamps
        return {"native": nat, "dev": self.ifname, "qpn": q.dpqp.qp_num, "handle": q.h, "state": st.name, "type": "RC",
                "remote_qpn": q.dpqp.dest_qp or None, "remote_addr": q.dpqp.dgid,
                "sq_psn": int(r[L.Q_SND_PSN]), "rq_psn": int(r[L.Q_EPSN]), "path_mtu": int(r[L.Q_PMTU]),
                "outstanding_send": int(q.W[shm.QH_SQ_TAIL]) - q.sq_taken + int(r[L.Q_SQ_TAIL] - r[L.Q_SQ_HEAD]),
                "outstanding_recv": int(q.W[shm.QH_RQ_TAIL]) - q.rq_taken + int(r[L.Q_RQ_TAIL] - r[L.Q_RQ_HEAD]),
                "profile": q.dpqp.profile, "retransmits": int(r[L.Q_N_RETX]), "naks_rx": naks_rx, "naks_tx": int(r[L.Q_N_NAKS_TX]), "rnr": rnr,
                "rate_bps": round(q.rate_bps), "srtt_us": round(srtt_ns / 1000, 1) if srtt_ns else None,
                "bytes_tx": q.bytes_tx, "bytes_rx": q.bytes_rx, **cnp, **q.dpqp.rx_counters(),
                "error": q.dpqp.error_reason if st == QPState.ERR else None, "owner": q.sess.owner()}

    def cnp_counters(self, q: SQP) -> dict:
        """The QP's CNP and ECN counters (MR-CC-039, MR-CNP-010, MR-ECN-012) as agent_iut.CompiledSession reads
        them: CNPs sent (tx_cnp), CE-marked packets received (rx_ce_marked), CNPs acted on (rx_cnp: the loop's
        count, or the XDP program's when the loop has not yet run the idle QP), CNPs discarded for the QP
        (rx_cnp_discarded); with DCQCN on, the reaction point's rate, target and alpha (5.6)."""
        L = self.L
        f = self.plane.F[q.qi]
        out = {"tx_cnp": int(f[L.F_NP_TX]), "rx_cnp": int(f[L.F_RX_CNP]), "rx_ce_marked": int(f[L.F_NP_CE]),
               "rx_cnp_discarded": 0}
        if q.dpqp.installed and self.ctx.loader is not None:
            try:
                slot = self.ctx.loader.qp(q.dpqp.qp_num)
                out["rx_cnp_discarded"] = int(slot["cnp_discarded"])
                out["rx_cnp"] = max(out["rx_cnp"], int(slot["cnp_count"]))
            except Exception:                       # noqa: BLE001 - the maps may be closing
                pass
        if self.plane.dcqcn.enabled:
            out.update({"dcqcn_rate_bps": int(f[L.F_RC]), "dcqcn_target_bps": int(f[L.F_RT]),
                        "dcqcn_alpha_ppm": round(float(f[L.F_ALPHA]) * 1e6)})
        return out

    def flushing(self) -> bool:
        """Work still on its way to the clients' CQ rings: ring entries not taken, queues not flushed,
        completions not delivered."""
        L, A, CQT = self.L, self.plane.A, self.plane.CQT
        if A[L.P_N_ACT] or A[L.P_RDY_TAIL] != A[L.P_RDY_HEAD] or (CQT[:, L.C_TAIL] != CQT[:, L.C_HEAD]).any():
            return True
        for q in list(self.qp_by_qi.values()):
            r = q.dpqp.row
            if r[L.Q_SQ_HEAD] != r[L.Q_SQ_TAIL] or r[L.Q_RQ_HEAD] != r[L.Q_RQ_TAIL]:
                return True
            if not q.dead and (int(q.W[shm.QH_SQ_TAIL]) != q.sq_taken or int(q.W[shm.QH_RQ_TAIL]) != q.rq_taken):
                return True
        return False

    def close(self) -> None:
        self.stop()
        if self.trace_path:
            try:
                np.save(f"{self.trace_path}.{self.ifname}.npy", self.serve.traced(self.G))
            except OSError as e:
                log.warning("%s: cannot write the trace: %s", self.ifname, e)
        self.ctx.close()
        self.bell = None
        os.close(self.bell_fd)
        shm.close_map(self.bell_mm)


# ================================================================================ the daemon
class Daemon:
    """See the module docstring.  Not thread-safe itself: start/run/drain_and_stop/reload from one thread
    (snapshot() from any)."""

    def __init__(self, cfg: DaemonConfig) -> None:
        self.cfg = cfg.validate()
        # the data plane's tunables (metaroce_xdp/tunables.py): the config's, then the environment's overrides
        self.tunables = load_tunables(Tunables(spin_idle=cfg.spin_idle, max_pending_events=cfg.max_pending_events))
        # events queued for one client before the serving thread sends them; more are counted and reported as
        # one EVENTS_LOST event
        self.max_pending_events = self.tunables.max_pending_events
        self.devices: dict[str, Device] = {}
        self.sessions: dict[int, Session] = {}
        self.started: float | None = None
        self.startup: StartClock | None = None      # start()'s phase times (startup.py)
        self.cleaned: list[str] = []
        self._lsock: socket.socket | None = None
        self._sel: selectors.BaseSelector | None = None
        self._sid = 0
        self._stopped = False
        self._draining = False
        self._sock_bound = False
        self._refused: dict[socket.socket, tuple[dict, float]] = {}
        # events from the driver threads: queued, sent by the serving thread (a client slow to read its
        # socket must never hold up a data plane); the eventfd wakes the serving thread's select
        self._events: list[tuple[Session, dict]] = []
        self._events_lock = threading.Lock()
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # what clients were refused and why: every error reply by its typed error, every client dropped by
        # reason (snapshot()["daemon"], metaroce dev show, /metrics)
        self.refusals: collections.Counter[str] = collections.Counter()
        self.drops: collections.Counter[str] = collections.Counter()
        # requests waiting off the serving thread (_Wait): (session, request, result) when done
        self._waited: list[tuple[Session, dict, BaseException | None]] = []
        self.requests_waited = 0
        self.events_recovered = 0                   # QP_FATALs sent for QPs whose plane event was lost
        self.events_lost = 0                        # events not queued for a client (max_pending_events)
        self.fd_limit = raise_fd_limit()
        self.fd_budget = 0                          # per client; set once the daemon's own descriptors are open
        self._fd_base = 0
        self._spare_fd = -1                         # closed to accept (and close) a connection at EMFILE

    # ---- file descriptors ----------------------------------------------------------------------
    def _set_fd_budget(self) -> None:
        """Each client's share of the descriptors left after the daemon's own (FD_SLACK kept back): at most
        what max_qps_per_client QPs and MAX_CQS_PER_CLIENT CQs need."""
        want = FDS_PER_SESSION + self.cfg.max_qps_per_client + MAX_CQS_PER_CLIENT
        share = (self.fd_limit - self._fd_base - FD_SLACK) // self.cfg.max_clients
        self.fd_budget = max(FDS_PER_SESSION, min(want, share))
        if share < want:
            log.warning("RLIMIT_NOFILE %d leaves %d descriptors to each of max_clients (%d) clients: fewer than "
                        "the %d that max_qps_per_client QPs and %d CQs take; raise LimitNOFILE (the unit) or lower "
                        "max_clients", self.fd_limit, self.fd_budget, self.cfg.max_clients, want, MAX_CQS_PER_CLIENT)

    def _need_fds(self, s: Session, n: int, what: str) -> None:
        if s.fds + n > self.fd_budget:
            raise LimitExceeded(f"{what} would take this client past its {self.fd_budget} file descriptors in the "
                                f"daemon (each QP and CQ holds one; the daemon's RLIMIT_NOFILE {self.fd_limit} "
                                f"shared by max_clients {self.cfg.max_clients}): destroy QPs or CQs first")

    # ---- start --------------------------------------------------------------------------------
    def start(self, clock: StartClock | None = None, builds: dict[str, Build] | None = None) -> None:
        """clock (or `self.startup` when set before): the process's StartClock (metaroced's entry point makes one
        at exec); the phases of this start are marked on it and kept in `self.startup` (docs/daemon.md,
        "Start to READY").  builds: startup.prebuild_xdp()'s threads, started before the imports (the interfaces
        without one get theirs here); unused ones are closed."""
        cfg = self.cfg
        clock = self.startup = clock or self.startup or StartClock(from_exec=False)
        log.setLevel(cfg.log_level.upper())
        self._clean_socket()
        clock.mark("socket check")
        from ..kern import loader as kl               # numpy, the wire package: numba
        kl.PIN_ROOT = cfg.bpffs_prefix                # pins: <bpffs_prefix>/<ifname>[@netns<inode>]/
        # start to READY is mostly BCC's clang compiling the XDP program (~1-3 s): it runs in threads, one per
        # interface (outside the GIL: ctypes), while this thread imports numba and loads the compiled loops
        loaders = dict(builds or {})
        for ifname in cfg.interfaces:
            if ifname not in loaders:
                loaders[ifname] = prebuild_xdp([ifname], clock)[ifname]
        try:
            import numba  # noqa: F401  (kern.loader imported it: this phase is numba's import)
            clock.mark("import numba")
            from ..jitwarm import COLD_MESSAGE, _cold_modules
            if {"metaroce_xdp.dp.round", "metaroce_xdp.dp.serve"} & set(_cold_modules(("compiled",))):
                log.warning("%s", COLD_MESSAGE)        # numba's cache lacks the loops it loads: minutes, not seconds
            ctx_cls = _make_context_class()
            from ..dp import context as dpc
            from ..dp import layout as dp_layout
            assert dp_layout.MAX_QPS == LOADER_MAX_QPS
            _preload_loops()
            if cfg.profile != "compat":
                load_native_entries()                 # a native QP's RTR and RTS call them (profile auto / native)
            clock.mark("compiled loops (numba cache)")
            for ifname in cfg.interfaces:
                self._clean_interface(ifname, kl)
                clock.mark("interface check")
                loader = loaders.pop(ifname).result()
                clock.mark("xdp wait")
                dpc.PREBUILT_LOADERS[ifname] = loader
                try:
                    ctx = ctx_cls.open(ifname, progress_thread=False, pin=True, inproc=False,   # dp_serve drives it
                                       queues=cfg.rx_queues or None, tunables=self.tunables)
                except BaseException:
                    dpc.PREBUILT_LOADERS.pop(ifname, None)
                    loader.close()
                    raise
                if ctx.loader.stale_pins_removed:
                    self.cleaned.append(f"{ifname}: {ctx.loader.stale_pins_removed} stale pins replaced")
                clock.mark("af_xdp + attach")
                dev = Device(self, ifname, ctx)
                self.devices[ifname] = dev
                dev.apply_read_rate(cfg)
                clock.mark("device tables")
                log.info("%s: data plane up (gid %s, max path MTU %d)", ifname, ctx.gid, ctx.max_pmtu)
            self._bind()
            clock.mark("control socket")
        except BaseException:
            for b in loaders.values():
                b.discard()
            for dev in self.devices.values():
                dev.close()
            self.devices.clear()
            raise
        for b in loaders.values():          # built for an interface the configuration does not name
            b.discard()
        # attached: what only attaching needed goes before the driver threads start (they inherit the rest)
        try:
            gone = caps.drop()
            if gone:
                log.info("capabilities dropped after attach: %s (kept: %s)", ", ".join(gone),
                         ", ".join(caps.effective()) or "none")
        except OSError as e:
            log.warning("could not drop capabilities after attach: %s", e)
        for dev in self.devices.values():
            dev.start()
        clock.mark("loop start")
        self._spare_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self._fd_base = open_fds()
        self._set_fd_budget()
        self.started = time.time()

    def _clean_socket(self) -> None:
        p = self.cfg.socket_path
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise DaemonError(f"{p} exists and is not a socket: remove it or choose another socket_path")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.settimeout(1.0)
            s.connect(p)
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(p)
            self.cleaned.append(f"stale socket {p}")
            log.info("removed the stale socket %s (no daemon behind it)", p)
            return
        except OSError:
            pass
        finally:
            s.close()
        raise DaemonError(f"another metaroced serves {p}: stop it first")

    def _clean_interface(self, ifname: str, kl: Any) -> None:
        """A dead instance's leftovers on ifname: an XDP program nobody holds, pins under the prefix."""
        from ..kern import bpfsys
        prog_id = kl.attached_xdp_prog_id(ifname)
        if prog_id:
            holders = [p for p in bpfsys.xdp_link_holders(prog_id) if p != os.getpid()]
            name = self._xdp_prog_name(ifname)
            if holders or name != "xdp_metaroce":
                raise kl.busy_error(ifname, prog_id)
            # attached through netlink (or a pinned link) by a dead MetaRoCE instance: nobody owns it
            for p in (Path(self.cfg.bpffs_prefix) / kl.pin_name(ifname)).glob("link*"):
                p.unlink()
            kl.detach_xdp(ifname)
            self.cleaned.append(f"{ifname}: stale XDP program {prog_id} detached")
            log.info("%s: detached the stale XDP program %d (no owner)", ifname, prog_id)
        d = Path(self.cfg.bpffs_prefix) / kl.pin_name(ifname)
        if d.is_dir():
            n = 0
            for p in d.iterdir():
                try:
                    p.unlink()
                    n += 1
                except OSError:
                    pass
            if n:
                self.cleaned.append(f"{ifname}: {n} stale pins under {d}")
                log.info("%s: removed %d stale pins under %s", ifname, n, d)

    @staticmethod
    def _xdp_prog_name(ifname: str) -> str | None:
        from ..kern import bpfsys, loader
        prog_id = loader.attached_xdp_prog_id(ifname)
        return bpfsys.prog_name_by_id(prog_id) if prog_id else None

    def _bind(self) -> None:
        cfg = self.cfg
        os.makedirs(os.path.dirname(cfg.socket_path) or ".", mode=0o755, exist_ok=True)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            s.bind(cfg.socket_path)
        finally:
            os.umask(old)
        self._sock_bound = True
        self._apply_socket_perms()
        s.listen(64)
        s.setblocking(False)
        self._lsock = s
        self._sel = selectors.DefaultSelector()
        self._sel.register(s, selectors.EVENT_READ, None)
        self._sel.register(self._efd, selectors.EVENT_READ, "events")
        log.info("serving on %s (mode %o, group %s)", cfg.socket_path, cfg.socket_mode, cfg.socket_group or "-")

    def _group_gid(self) -> int | None:
        g = self.cfg.socket_group
        if g is None:
            return None
        try:
            return grp.getgrnam(g).gr_gid
        except KeyError:
            if g.isdigit():
                return int(g)
            raise ConfigError(f"socket_group {g!r}: no such group") from None

    def _apply_socket_perms(self) -> None:
        gid = self._group_gid()
        os.chmod(self.cfg.socket_path, self.cfg.socket_mode)
        if gid is not None:
            os.chown(self.cfg.socket_path, -1, gid)

    def post_event(self, s: Session, ev: dict) -> None:
        """From any thread: send ev to the client s soon (the serving thread sends it).  A client whose events
        pile up (it does not read its socket, its QPs fail by the thousand) loses the excess, counted and told."""
        with self._events_lock:
            if s.events_pending >= self.max_pending_events:
                s.events_lost += 1
                self.events_lost += 1
                return
            s.events_pending += 1
            self._events.append((s, ev))
        try:
            os.eventfd_write(self._efd, 1)
        except OSError:
            pass

    def _send_events(self) -> None:
        try:
            os.eventfd_read(self._efd)
        except OSError:
            pass
        with self._events_lock:
            evs, self._events = self._events, []
            for s, _ in evs:
                s.events_pending -= 1
        for s, ev in evs:
            if not s.push(ev, event=True) and not s.gone:
                with self._events_lock:
                    s.events_lost += 1
                    self.events_lost += 1
        for s in {s for s, _ in evs}:
            self._tell_lost(s)

    # ---- serving --------------------------------------------------------------------------------
    def run(self, stop: threading.Event, tick: Callable[[], None] | None = None) -> None:
        if self._sel is None:
            raise DaemonError("start() first")
        last_tick = last_check = 0.0
        while not stop.is_set() and not self._stopped:
            for key, mask in self._sel.select(timeout=0.1):
                try:
                    if key.data is None:
                        self._accept()
                    elif key.data == "events":
                        self._send_events()
                    elif isinstance(key.data, tuple) and key.data[0] == "wake":
                        self._wake(key.data[1])
                    elif isinstance(key.data, tuple):
                        self._answer_refused(key.fileobj)
                    elif mask & selectors.EVENT_WRITE:
                        self._flush(key.data)
                    else:
                        self._serve(key.data)
                except Exception:                   # noqa: BLE001 - what one client sent costs that client only
                    self._fail(key)
            if self._waited:
                self._finish_waits()
            now = time.monotonic()
            for sock in [k for k, (_, t) in self._refused.items() if t < now]:
                self._drop_refused(sock)
            for s in [s for s in self.sessions.values() if s.gone]:
                self._reclaim(s)
            now = time.monotonic()
            if now - last_check >= EVENT_CHECK_S:
                last_check = now
                self._owed_events()
            if tick is not None and now - last_tick >= 0.1:
                last_tick = now
                try:
                    tick()
                except Exception:                   # noqa: BLE001 - the caller's hook must not stop serving
                    log.exception("tick failed")

    def _owed_events(self) -> None:
        """QPs the data plane moved to ERR whose event never reached us (its event ring holds 1024 and drops the
        rest when full): their QP_FATAL now, counted in events_recovered."""
        for dev in _copy(self.devices.values()):
            L = dev.L
            for q in _copy(dev.qp_by_qi.values()):
                if q.err_told or q.destroyed:
                    continue
                r = q.dpqp.row
                if int(r[L.Q_STATE]) != QPState.ERR:
                    continue
                if not q.err_seen:              # its event may still be on its way (drained within a slice)
                    q.err_seen = True
                    continue
                why = int(r[L.Q_ERR])
                q.err_told = True
                if why in (0, WHY_ASKED, WHY_CLIENT_GONE, WHY_DRAIN):
                    continue
                q.mirror_state()
                dev.note_bad_wr(q, why)
                self.events_recovered += 1
                reason = q.dpqp.error_reason or reasons_text(why)
                log.info("qpn %#x (pid %d): QP error without its event (the plane's event ring was full): %s",
                         q.dpqp.qp_num, q.sess.pid, reason)
                self.post_event(q.sess, {"event": "QP_FATAL", "qp": q.h, "qp_num": q.dpqp.qp_num, "reason": reason})

    def _wake(self, s: Session) -> None:
        """A client wrote its wake-up eventfd after a post: wake its device's loop if that sleeps.  A client
        writing it in a loop costs this thread a read per write and the loop no extra round while it runs."""
        try:
            os.eventfd_read(s.wake_fd)
        except OSError:
            return
        s.wakes += 1
        dev = s.dev
        if dev is not None and dev.plane.A[dev.L.P_SLEEPING]:
            s.wakes_forwarded += 1
            try:
                os.eventfd_write(dev.plane.efd, 1)
            except OSError:
                pass

    def _fail(self, key: selectors.SelectorKey) -> None:
        """Serving one socket raised what the handlers do not catch: drop that client, keep the daemon."""
        if isinstance(key.data, Session):
            log.exception("client pid %d: dropped after an unexpected error", key.data.pid)
            self.drops["unexpected_error"] += 1
            key.data.gone = True
            self._reclaim(key.data)
        elif isinstance(key.data, tuple) and key.data[0] == "wake":
            log.exception("client pid %d: wake-up", key.data[1].pid)
        elif isinstance(key.data, tuple):
            log.exception("a refused connection: unexpected error")
            self._drop_refused(key.fileobj)
        else:
            log.exception("serving the control socket")

    def _accept(self) -> None:
        try:
            sock, _ = self._lsock.accept()
        except BlockingIOError:
            return
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                self._shed_connection()
            return
        try:
            self._admit(sock)
        except OSError as e:                    # EMFILE making its session header: this connection only
            log.warning("cannot take a client: %s", e)
            self.drops["no_descriptors"] += 1
            sock.close()

    def _shed_connection(self) -> None:
        """Out of descriptors: the pending connection would make the listening socket readable forever.  Close
        the spare descriptor, accept it, close it (the client reads EOF: DaemonUnavailable), take the spare back."""
        self.drops["no_descriptors"] += 1
        log.warning("out of file descriptors (RLIMIT_NOFILE %d): closing a new connection unanswered",
                    self.fd_limit)
        if self._spare_fd >= 0:
            os.close(self._spare_fd)
            self._spare_fd = -1
        try:
            sock, _ = self._lsock.accept()
            sock.close()
        except OSError:
            pass
        try:
            self._spare_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._spare_fd = -1

    def _admit(self, sock: socket.socket) -> None:
        pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        why = None
        if not self._allowed(pid, uid, gid):
            why = proto.error_reply(PermissionDenied(
                f"uid {uid} is neither root nor in group {self.cfg.socket_group or '(none configured)'}"))
        elif len(self.sessions) >= self.cfg.max_clients:
            why = proto.error_reply(LimitExceeded(f"max_clients ({self.cfg.max_clients}) clients are connected"))
        elif self._draining:
            why = proto.error_reply(proto.DaemonUnavailable("the daemon is stopping"))
        if why is not None:
            # answered on its first request (closing with that request unread would reset the connection,
            # and the client would never read why); dropped after 2 s
            self.refusals[why["error"]] += 1
            log.warning("refused pid %d uid %d: %s", pid, uid, why["message"])
            if len(self._refused) >= MAX_REFUSED_PENDING:
                self.drops["refused_unanswered"] += 1   # a flood of refused connections holds no descriptors
                sock.close()
                return
            sock.setblocking(False)
            self._refused[sock] = (why, time.monotonic() + 2.0)
            self._sel.register(sock, selectors.EVENT_READ, ("refused", why))
            return
        self._sid += 1
        sock.setblocking(False)                 # replies and events never wait for a client (Session.push)
        s = Session(self._sid, sock, pid, uid, gid, self.max_pending_events)
        s.watch = lambda: self._watch(s)
        self.sessions[s.id] = s
        self._sel.register(sock, selectors.EVENT_READ, s)
        self._sel.register(s.wake_fd, selectors.EVENT_READ, ("wake", s))
        log.info("client pid %d uid %d (%s) connected", pid, uid, s.comm)

    def _answer_refused(self, sock: socket.socket) -> None:
        why, _ = self._refused[sock]
        try:
            msg, fds, _ = proto.recv(sock)
            for fd in fds:
                os.close(fd)
            if msg is not None:
                rid = msg.get("id") if isinstance(msg, dict) else None
                proto.send(sock, {**why, "id": rid if isinstance(rid, (int, str)) or rid is None else None})
        except (OSError, ValueError, TypeError, RecursionError):
            pass                            # whatever it sent, it is closed now
        finally:
            self._drop_refused(sock)

    def _drop_refused(self, sock: socket.socket) -> None:
        self._refused.pop(sock, None)
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    def _allowed(self, pid: int, uid: int, gid: int) -> bool:
        if uid == 0:
            return True
        want = self._group_gid()
        if want is None:
            return False
        if gid == want:
            return True
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("Groups:"):
                    return want in {int(x) for x in line.split()[1:]}
        except OSError:
            pass
        return False

    def _serve(self, s: Session) -> None:
        try:
            msg, fds, problem = proto.recv(s.sock)
        except (BlockingIOError, socket.timeout):
            return
        except OSError:
            msg, fds, problem = None, [], None
        if msg is None:
            self._reclaim(s)
            return
        self._answer(s, msg, fds, problem)

    def _answer(self, s: Session, msg: dict, fds: list[int], problem: str | None) -> None:
        rid = msg.get("id")
        if not (rid is None or isinstance(rid, (int, str))):
            rid = None                       # echoed: an id is a number or a string, nothing to nest
        try:
            if problem:
                raise MalformedRequest(problem)
            op = msg.get("op")
            fn = getattr(self, f"_op_{op}", None) if isinstance(op, str) and op.isidentifier() else None
            if fn is None:
                raise MalformedRequest(f"unknown op {op!r}")
            reply, out_fds = fn(s, msg, fds)
            reply = {"ok": True, "id": rid, **reply}
        except _Wait as w:
            self._wait(s, msg, w)
            return
        except VerbsError as e:
            reply, out_fds = proto.error_reply(e, rid), []
        except (KeyError, TypeError, ValueError, RecursionError) as e:
            reply, out_fds = proto.error_reply(MalformedRequest(f"bad request: {type(e).__name__}: {e}"), rid), []
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOSPC):
                log.exception("client pid %d: op %r failed", s.pid, msg.get("op"))
            reply, out_fds = proto.error_reply(ResourceError(f"the daemon is short of resources: {e}"), rid), []
        except Exception as e:                       # noqa: BLE001 - one bad request never stops the daemon
            log.exception("client pid %d: op %r failed", s.pid, msg.get("op"))
            reply, out_fds = proto.error_reply(proto.InternalError(f"{type(e).__name__}: {e}"), rid), []
        finally:
            for fd in fds:
                os.close(fd)
        if not reply["ok"]:
            self.refusals[reply["error"]] += 1
        s.push(reply, out_fds, proto.MAX_REPLY if msg.get("op") == "status" else proto.MAX_MSG)

    def _watch(self, s: Session) -> None:
        """Register what s's socket is waited for: writable while its outbox holds messages, readable (its next
        request) when it holds none and no request of it waits (_Wait), else nothing."""
        if s.gone or self.sessions.get(s.id) is not s or self._sel is None:
            return
        ev = selectors.EVENT_WRITE if s.outbox else selectors.EVENT_READ if s.waiting is None else 0
        try:
            key = self._sel.get_key(s.sock)
        except (KeyError, ValueError):
            key = None
        if ev == 0:
            if key is not None:
                self._sel.unregister(s.sock)
        elif key is None:
            self._sel.register(s.sock, ev, s)
        elif key.events != ev:
            self._sel.modify(s.sock, ev, s)

    def _flush(self, s: Session) -> None:
        s.flush()
        if s.gone:
            self._reclaim(s)
            return
        if not s.outbox:
            self._tell_lost(s)
        self._watch(s)

    def _tell_lost(self, s: Session) -> None:
        """One EVENTS_LOST for the events lost since the last one, once the client reads again."""
        if s.events_lost > s.events_lost_told and not s.outbox:
            n = s.events_lost - s.events_lost_told
            s.events_lost_told = s.events_lost
            s.push({"event": "EVENTS_LOST", "count": n,
                    "reason": f"{n} events were not queued: more than {self.max_pending_events} were waiting to be "
                              f"sent; query the QPs' state"})

    def _wait(self, s: Session, msg: dict, w: _Wait) -> None:
        """Run w.work on a thread of its own; the request is answered (run again) by _finish_waits."""
        s.waiting = w.what
        self._watch(s)
        self.requests_waited += 1

        def work() -> None:
            err: BaseException | None = None
            try:
                w.work()
            except BaseException as e:              # noqa: BLE001 - the client's reply
                err = e
            with self._events_lock:
                if self._stopped:
                    return                          # the client was told DEVICE_FATAL; the eventfd is closed
                self._waited.append((s, msg, err))
                try:
                    os.eventfd_write(self._efd, 1)
                except OSError:
                    pass
        threading.Thread(target=work, name=f"metaroce-wait-{s.pid}", daemon=True).start()

    def _finish_waits(self) -> None:
        with self._events_lock:
            done, self._waited = self._waited, []
        for s, msg, err in done:
            s.waiting = None
            if s.gone or self.sessions.get(s.id) is not s:
                continue
            try:
                self._watch(s)
                if err is None:
                    self._answer(s, msg, [], None)
                else:
                    e = err if isinstance(err, VerbsError) else proto.InternalError(f"{type(err).__name__}: {err}")
                    reply = proto.error_reply(e, msg.get("id"))
                    self.refusals[reply["error"]] += 1
                    s.push(reply)
            except Exception:                       # noqa: BLE001 - what one client sent costs that client only
                log.exception("client pid %d: dropped after an unexpected error", s.pid)
                self.drops["unexpected_error"] += 1
                s.gone = True
                self._reclaim(s)

    # ---- ops ------------------------------------------------------------------------------------
    @staticmethod
    def _int(msg: dict, k: str, default: int | None = None, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
        v = msg.get(k, default)
        if v is None:
            raise MalformedRequest(f"missing {k!r}")
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise MalformedRequest(f"{k!r} must be an integer in {lo}..{hi}, not {v!r}")
        return v

    def _dev(self, s: Session) -> Device:
        if s.dev is None:
            raise InvalidState("open a device first (op open_device)")
        return s.dev

    def _get(self, table: dict, msg: dict, k: str, what: str):
        h = self._int(msg, k)
        o = table.get(h)
        if o is None:
            raise UnknownHandle(f"{k} {h} is not a {what} of this client")
        return o

    def _op_hello(self, s: Session, msg: dict, fds: list[int]):
        return {"version": proto.VERSION, "daemon_pid": os.getpid(), "daemon_version": __version__,
                "interfaces": list(self.devices), "session": s.id, "cm_port": self.cfg.cm_port}, [s.hdr_fd, s.event_fd]

    def _op_status(self, s: Session, msg: dict, fds: list[int]):
        # the reply's keys: daemon, devices, qps, clients; a QP's peer, PSNs and owner are what another tenant
        # would need to inject into its stream: root sees every client's, any other user its own uid's
        return self.snapshot(None if s.uid == 0 else s.uid), []

    def _op_open_device(self, s: Session, msg: dict, fds: list[int]):
        ifname = msg.get("ifname")
        if ifname is None and len(self.devices) == 1:
            ifname = next(iter(self.devices))
        if not isinstance(ifname, str):
            raise MalformedRequest("open_device needs an interface name (ifname)")
        dev = self.devices.get(ifname)
        if dev is None:
            raise InvalidArgument(f"this daemon does not own {ifname!r} (it owns {', '.join(self.devices) or '-'})")
        if s.dev is not None and s.dev is not dev:
            raise InvalidState(f"this connection already uses {s.dev.ifname}: connect again for another device")
        if s.dev is None:
            with dev.reg_lock:
                dev.attach_session(s)
                s.dev = dev
                dev.sessions.add(s)
        ctx = dev.ctx
        p = ctx.plane.dcqcn
        return ({"ifname": ifname, "gid": ctx.gid, "mac": ctx.local_mac, "max_pmtu": ctx.max_pmtu,
                 "profiles": self.profiles(), "native_offer": self.native_offer(),
                 "dcqcn": dataclasses.asdict(p) if p.enabled else None},      # the reaction point's (5.6)
                [s.wake_fd, dev.bell_fd])

    def native_offer(self) -> dict:
        """What a client offers in its REQ/REP for a native QP on this daemon (dp/cmconnect.py's offer, with
        CREDITS when the daemon allocates credits): capabilities, sack_window, entropy_count."""
        from ..dp import cmconnect
        caps = int(cmconnect.NATIVE_OFFER) | (int(cm.Cap.CREDITS) if self.cfg.credit_budget > 0 else 0)
        return {"caps": caps, "w": cmconnect.W_OFFER, "k": cmconnect.K_OFFER}

    def _op_alloc_pd(self, s: Session, msg: dict, fds: list[int]):
        dev = self._dev(s)
        if len(s.pds) >= MAX_PDS_PER_CLIENT:
            raise LimitExceeded(f"at most {MAX_PDS_PER_CLIENT} PDs per client")
        h = s.handle()
        s.pds[h] = dev.ctx.alloc_pd()
        return {"pd": h}, []

    def _op_dealloc_pd(self, s: Session, msg: dict, fds: list[int]):
        pd = self._get(s.pds, msg, "pd", "PD")
        self._dev(s).ctx.dealloc_pd(pd)
        s.pds.pop(msg["pd"])
        return {}, []

    def _op_reg_mr(self, s: Session, msg: dict, fds: list[int]):
        dev = self._dev(s)
        pd = self._get(s.pds, msg, "pd", "PD")
        access = self._int(msg, "access", 0, 0, 0xF)
        offset = self._int(msg, "offset", 0)
        length = self._int(msg, "length", None, 1, 1 << 40)
        inv = msg.get("remote_invalidate", False)
        if not isinstance(inv, bool):
            raise MalformedRequest(f"'remote_invalidate' must be true or false, not {inv!r}")
        if len(fds) != 1:
            raise MalformedRequest("reg_mr carries exactly one file descriptor (the memfd) as SCM_RIGHTS")
        try:
            size = placeable_size(fds[0])
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        if offset + length > size:
            raise InvalidArgument(f"offset {offset} + length {length} is beyond the memfd's {size} bytes")
        if s.mr_bytes + length > self.cfg.max_mr_bytes_per_client:
            raise LimitExceeded(f"registering {length} bytes would exceed max_mr_bytes_per_client "
                                f"({self.cfg.max_mr_bytes_per_client}; this client has {s.mr_bytes})")
        if len(s.mrs) >= MAX_MRS_PER_CLIENT:
            raise LimitExceeded(f"at most {MAX_MRS_PER_CLIENT} MRs per client")
        start = offset // shm.PAGE * shm.PAGE
        mm = shm.map_fd(fds[0], offset + length - start, start)
        try:
            view = np.frombuffer(mm, np.uint8, count=length, offset=offset - start)
            with dev.reg_lock:
                mr = dev.ctx.reg_mr(pd, view, Access(access), remote_invalidate=inv)    # MR-MEM-040
        except BaseException:
            view = None
            shm.close_map(mm)
            raise
        h = s.handle()
        s.mrs[h] = SMR(h, mr, mm, length, msg["pd"])
        s.mr_bytes += length
        return {"mr": h, "addr": mr.addr, "length": mr.length, "lkey": mr.lkey, "rkey": mr.rkey}, []

    def _dereg(self, dev: Device, s: Session, m: SMR) -> None:
        dev.ctx.dereg_mr(m.dpmr)          # the valid bit cleared, then a pause: no placement is in flight
        m.dpmr.mem = None
        m.dpmr = None
        shm.close_map(m.mm)
        s.mr_bytes -= m.length

    def _op_dereg_mr(self, s: Session, msg: dict, fds: list[int]):
        dev = self._dev(s)
        m = self._get(s.mrs, msg, "mr", "MR")
        with dev.reg_lock:
            s.mrs.pop(m.h)
            self._dereg(dev, s, m)
        return {}, []

    def _op_create_cq(self, s: Session, msg: dict, fds: list[int]):
        dev = self._dev(s)
        depth = self._int(msg, "depth", 1024, 1, 1 << 16)
        if len(s.cqs) >= MAX_CQS_PER_CLIENT:
            raise LimitExceeded(f"at most {MAX_CQS_PER_CLIENT} CQs per client")
        self._need_fds(s, 1, "a CQ")
        used = sum(c.size for c in s.cqs.values())
        if used + depth > MAX_CQES_PER_CLIENT:
            raise LimitExceeded(f"a CQ of {depth} entries would exceed {MAX_CQES_PER_CLIENT} CQ entries per client "
                                f"({used} used)")
        with dev.reg_lock:
            cq = dev.ctx.create_cq(depth)
            try:
                fd = shm.create(shm.cq_words(cq.size) * 8, "metaroce-cq")
                mm = shm.map_fd(fd, shm.round_page(shm.cq_words(cq.size) * 8))
            except BaseException:
                dev.ctx.destroy_cq(cq)
                raise
            h = s.handle()
            c = SCQ(h, s, cq, fd, mm)
            c.W[shm.CH_SIZE] = cq.size
            s.cqs[h] = c
            s.fds += 1
            dev.cq_by_idx[cq.index] = c
            dev.attach_cq(c)
        return {"cq": h, "size": cq.size}, [fd]

    def _op_req_notify_cq(self, s: Session, msg: dict, fds: list[int]):
        """ibv_req_notify_cq: one CQ_NOTIFY message for the CQ's next completion, or with solicited_only its next
        solicited or unsuccessful one (MR-BTH-004); arming for any completion outranks solicited_only."""
        self._dev(s)
        c = self._get(s.cqs, msg, "cq", "CQ")
        sol = msg.get("solicited_only", False)
        if not isinstance(sol, bool):
            raise MalformedRequest(f"'solicited_only' must be true or false, not {sol!r}")
        c.dpcq.req_notify(solicited_only=sol)
        return {}, []

    def _op_destroy_cq(self, s: Session, msg: dict, fds: list[int]):
        dev = self._dev(s)
        c = self._get(s.cqs, msg, "cq", "CQ")
        with dev.reg_lock:
            dev.ctx.destroy_cq(c.dpcq)
            self._forget_cq(dev, s, c)
        return {}, []

    def _forget_cq(self, dev: Device, s: Session, c: SCQ) -> None:
        dev.detach_cq(c)
        if s.cqs.pop(c.h, None) is not None:
            s.fds -= 1
        dev.cq_by_idx.pop(c.dpcq.index, None)
        c.W = None
        os.close(c.fd)
        shm.close_map(c.mm)

    def _op_create_qp(self, s: Session, msg: dict, fds: list[int]):
        dev = self._dev(s)
        pd = self._get(s.pds, msg, "pd", "PD")
        scq = self._get(s.cqs, msg, "send_cq", "CQ")
        rcq = self._get(s.cqs, msg, "recv_cq", "CQ")
        cap = QPCap(max_send_wr=self._int(msg, "max_send_wr", 256, 1, 1 << 14),
                    max_recv_wr=self._int(msg, "max_recv_wr", 256, 1, 1 << 14))
        if len(s.qps) >= self.cfg.max_qps_per_client:
            raise LimitExceeded(f"max_qps_per_client ({self.cfg.max_qps_per_client}) QPs already")
        self._need_fds(s, 1, "a QP")
        used = sum(q.sq_size + q.rq_size for q in s.qps.values())
        if used + cap.max_send_wr + cap.max_recv_wr > MAX_WQES_PER_CLIENT:
            raise LimitExceeded(f"queues of {cap.max_send_wr} + {cap.max_recv_wr} entries would exceed "
                                f"{MAX_WQES_PER_CLIENT} queue entries per client ({used} used)")
        with dev.reg_lock:
            try:
                qp = dev.ctx.create_qp(pd, scq.dpcq, rcq.dpcq, cap, bool(msg.get("sq_sig_all", False)))
            except MemoryError as e:
                raise ResourceError(f"no room for the QP's queues: {e}") from None
            nb = shm.qp_words(qp.sq_size, qp.rq_size) * 8
            try:
                fd = shm.create(nb, "metaroce-qp")
                mm = shm.map_fd(fd, shm.round_page(nb))
            except BaseException:
                dev.ctx.destroy_qp(qp)
                raise
            h = s.handle()
            q = SQP(h, s, dev, qp, fd, mm)
            W = q.W
            W[shm.QH_SQ_SIZE], W[shm.QH_RQ_SIZE], W[shm.QH_QPN] = qp.sq_size, qp.rq_size, qp.qp_num
            q.mirror_state()
            s.qps[h] = q
            s.fds += 1
            dev.qp_by_qi[qp.qi] = q
            dev.attach_qp(q)
        log.info("qpn %#x created for pid %d", qp.qp_num, s.pid)
        return {"qp": h, "qp_num": qp.qp_num, "sq_size": qp.sq_size, "rq_size": qp.rq_size}, [fd]

    def _op_modify_qp(self, s: Session, msg: dict, fds: list[int]):
        dev = self._dev(s)
        q = self._get(s.qps, msg, "qp", "QP")
        a = msg.get("attr")
        if not isinstance(a, dict):
            raise MalformedRequest("modify_qp needs attr: an object of QPAttr fields")
        a = dict(a)                             # msg unchanged: a request that waited (_Wait) runs again
        bad = set(a) - _ATTR_FIELDS
        if bad:
            raise MalformedRequest(f"unknown QP attributes {sorted(bad)} (known: {sorted(_ATTR_FIELDS)})")
        for k, v in a.items():
            ok = (isinstance(v, str) if k in ("dgid", "dmac", "path_mig_state", "profile") else
                  isinstance(v, bool) if k in ("en_sqd_async_notify", "ecn") else
                  v is None or isinstance(v, dict) if k == "native_params" else
                  v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 32))
            if not ok:
                raise MalformedRequest(f"QP attribute {k}={v!r} has the wrong type")
        if a.get("profile") is not None or a.get("native_params") is not None or a.get("qp_state") == QPState.RTR:
            a["native_params"] = self._native_params(a.get("profile"), a.get("native_params"))
        if "qp_state" in a:
            a["qp_state"] = QPState(a["qp_state"])
        if a.get("qp_state") == QPState.RTR:
            self._check_path_free(dev, q, a.get("dgid"), a.get("dest_qp_num"))
            if a.get("profile") == "native":
                native = sum(1 for o in s.qps.values() if o is not q and o.dpqp.profile == "native")
                if native >= self.cfg.max_native_qps_per_client:
                    raise LimitExceeded(f"max_native_qps_per_client ({self.cfg.max_native_qps_per_client}) native QPs "
                                        f"already (the interface has {self.native_slots()} native slots for every "
                                        f"client): connect with profile compat, or destroy a native QP")
        if "cur_qp_state" in a:
            a["cur_qp_state"] = QPState(a["cur_qp_state"])
        if "qp_access_flags" in a:
            a["qp_access_flags"] = Access(a["qp_access_flags"])
        if a.get("qp_state") == QPState.RTR and a.get("dmac") is None:
            self._path_known(dev, a.get("dgid"))
        q.dpqp.modify(QPAttr(**a))
        q.mirror_state()
        st = q.dpqp.query_state()
        log.info("qpn %#x (pid %d): -> %s", q.dpqp.qp_num, s.pid, st.name)
        return {"state": int(st)}, []

    LIVE_STATES = (QPState.RTR, QPState.RTS, QPState.SQD, QPState.SQE)

    @staticmethod
    def _path_known(dev: Device, dgid: Any) -> None:
        """An RTR resolves its peer's next hop (the data plane's template_for, waiting up to 2 s for ARP/ND):
        only once the kernel knows that MAC does it run here, on the serving thread; until then the request
        waits on a thread of its own (_Wait), so an address that never answers costs its client only."""
        paths = getattr(getattr(dev.ctx, "port", None), "paths", None)
        if paths is None or not isinstance(dgid, str):
            return
        try:
            ipaddress.ip_address(dgid)
        except ValueError:
            return                              # not an address: the data plane says so
        if paths.lookup(dgid) is not None:      # never waits for ARP/ND; sends one probe when the MAC is unknown
            return

        raise _Wait(f"the MAC of {dgid}", lambda: paths.wait(dgid, PATH_WAIT_S))

    def _check_path_free(self, dev: Device, q: SQP, dgid: Any, dest_qp: Any) -> None:
        """No two live QPs of an interface aimed at the same remote QP: BTH carries no source QPN and the peer
        checks only the source address, so a second QP with another tenant's (dgid, dest_qp_num) -- both shown
        by status, or guessed -- would inject into that tenant's stream (its own packets then dropped as
        duplicates).  PathInUse, counted in refused."""
        if not isinstance(dgid, str) or not isinstance(dest_qp, int):
            return                              # the data plane refuses an RTR without them
        try:
            want = (cm.gid_to_ip(cm.ip_to_gid(dgid)), dest_qp & 0xFFFFFF)
        except ValueError:
            return                              # not an address: the data plane says so
        with dev.reg_lock:
            for o in _copy(dev.qp_by_qi.values()):
                if o is q or o.destroyed or o.dpqp.dgid is None:
                    continue
                try:
                    theirs = (cm.gid_to_ip(cm.ip_to_gid(o.dpqp.dgid)), o.dpqp.dest_qp & 0xFFFFFF)
                except ValueError:
                    continue
                if theirs == want and o.dpqp.query_state() in self.LIVE_STATES:
                    log.warning("pid %d: RTR towards QP %#x at %s refused: QP %#x (pid %d) is connected to it",
                                q.sess.pid, want[1], want[0], o.dpqp.qp_num, o.sess.pid)
                    raise proto.PathInUse(f"another live QP on {dev.ifname} is connected to QP {want[1]:#x} at "
                                          f"{want[0]}: one remote QP takes one local QP (the packets carry no source "
                                          f"QPN); connect through connection set-up to a QP of your own")

    # the parameters a client may choose for its native QP (those of the connection: the agreed W, K and
    # capabilities, its timers); the receiver's credit allocation is the daemon's, over all its QPs
    CLIENT_NATIVE_PARAMS = ("w", "k", "credits", "cc_delay", "rto_min", "ack_n", "ack_t", "dup_thresh", "pto_min",
                            "init_cwnd", "min_cwnd", "delay_floor", "ai", "beta", "max_mdf", "q_target", "g_ecn",
                            "pacing_gain", "max_burst", "t_peer")

    @staticmethod
    def native_slots() -> int:
        from ..native.plane_slot import NSLOT
        return NSLOT

    def profiles(self) -> list[str]:
        """The profiles this daemon's QPs may run (the `profile` option)."""
        return {"auto": ["compat", "native"], "compat": ["compat"], "native": ["native"]}[self.cfg.profile]

    def receiver_params(self) -> dict:
        """The receiver side of MR-CC-018 (dp/serve.credits): rx_budget from credit_budget (0: the spec's
        default), an activity window that outlasts this host's scheduling delay (MR-CC-042)."""
        kw = {"active_window": CREDIT_ACTIVE_WINDOW_US}
        if self.cfg.credit_budget > 0:
            kw["rx_budget"] = self.cfg.credit_budget
        return kw

    def _native_params(self, profile: Any, params: Any) -> dict | None:
        """A client's RTR profile and native parameters, checked: the profile one the daemon serves, only
        the connection's parameters (CLIENT_NATIVE_PARAMS) numbers within 04 4.7 / 05 5.7.1's ranges; the
        receiver's are the daemon's.  Without CREDITS agreed the QP's credit fields do not matter."""
        profile = profile or "compat"
        if profile not in ("compat", "native"):
            raise InvalidArgument(f"profile {profile!r}: the agreed profile is 'compat' or 'native' (MR-NAT-001)")
        if profile not in self.profiles():
            raise InvalidArgument(f"profile {profile!r}: this daemon serves {' and '.join(self.profiles())} only "
                                  f"(its profile option is {self.cfg.profile!r})")
        if profile == "compat":
            if params:
                raise InvalidArgument("native_params given for a compat QP")
            return None
        params = dict(params or {})
        if "rto_min" not in params:
            from ..dp.cmconnect import RTO_MIN_US
            params["rto_min"] = RTO_MIN_US               # MR-CC-042, as dp/cmconnect.agreed_profile
        bad = sorted(set(params) - set(self.CLIENT_NATIVE_PARAMS))
        if bad:
            raise InvalidArgument(f"native parameters {bad}: a client may set {', '.join(self.CLIENT_NATIVE_PARAMS)}")
        for k, v in params.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise InvalidArgument(f"native parameter {k}={v!r} is not a number")
        params.update(self.receiver_params())
        from ..native.layout import ParamError, params as check
        try:
            check(**params)
        except ParamError as e:
            raise InvalidArgument(str(e)) from None
        return params

    def _op_query_qp(self, s: Session, msg: dict, fds: list[int]):
        dev = self._dev(s)
        q = self._get(s.qps, msg, "qp", "QP")
        # the loop applies CNPs and the DCQCN timers to an idle QP only when it runs it: once more now, so the
        # counters are current (bounded: a loop that does not run costs this request 50 ms, no more)
        q.dpqp.refresh_cc(timeout=0.05)
        d = dev.qp_info(q)
        d["state"] = int(QPState[d["state"]])
        return {"qp_info": d}, []

    def _op_destroy_qp(self, s: Session, msg: dict, fds: list[int]):
        dev = self._dev(s)
        q = self._get(s.qps, msg, "qp", "QP")
        with dev.reg_lock:
            self._destroy_qp(dev, s, q)
        return {}, []

    def _destroy_qp(self, dev: Device, s: Session, q: SQP) -> None:
        q.destroyed = True
        dev.detach_qp(q)                  # the loop no longer reads its rings
        dev.ctx.destroy_qp(q.dpqp)
        if s.qps.pop(q.h, None) is not None:
            s.fds -= 1
        dev.qp_by_qi.pop(q.dpqp.qi, None)
        q.W = None
        os.close(q.fd)
        shm.close_map(q.mm)
        log.info("qpn %#x (pid %d) destroyed", q.dpqp.qp_num, s.pid)

    def _op_stats(self, s: Session, msg: dict, fds: list[int]):
        return {"stats": self._dev(s).ctx.stats()}, []

    # ---- a client leaves ---------------------------------------------------------------------------
    def _reclaim(self, s: Session) -> None:
        """The client exited (or was killed, or stopped reading): its QPs to ERR, then everything it had freed.
        Its peers see their QPs' requests go unanswered and complete with RETRY_EXC_ERR."""
        if self.sessions.pop(s.id, None) is None:
            return
        s.gone = True
        try:
            self._sel.unregister(s.sock)
        except (KeyError, ValueError):
            pass
        s.sock.close()
        s.drop_outbox()
        dev = s.dev
        nq, nm = len(s.qps), len(s.mrs)
        if dev is not None:
            with dev.reg_lock:
                dev.sessions.discard(s)
                for q in list(s.qps.values()):
                    if q.dpqp.query_state() != QPState.ERR:
                        with dev.plane.paused():
                            q.dpqp._to_err(WHY_CLIENT_GONE)
                    self._destroy_qp(dev, s, q)
                for c in list(s.cqs.values()):
                    try:
                        dev.ctx.destroy_cq(c.dpcq)
                    except ResourceError:
                        log.exception("cq of pid %d", s.pid)
                    self._forget_cq(dev, s, c)
                for m in list(s.mrs.values()):
                    self._dereg(dev, s, m)
                s.mrs.clear()
                s.pds.clear()
                dev.detach_session(s)
        try:
            self._sel.unregister(s.wake_fd)
        except (KeyError, ValueError):
            pass
        os.close(s.wake_fd)
        with s.send_lock:
            os.close(s.event_fd)
            s.event_fd = -1
        os.close(s.hdr_fd)
        s.H = None
        shm.close_map(s.hdr_mm)
        log.info("client pid %d left: %d QPs moved to ERR and destroyed, %d MRs deregistered", s.pid, nq, nm)

    # ---- stop -----------------------------------------------------------------------------------------
    def _outstanding_sends(self) -> int:
        n = 0
        for dev in self.devices.values():
            L = dev.L
            for q in list(dev.qp_by_qi.values()):
                r = q.dpqp.row
                if int(r[L.Q_STATE]) == QPState.RTS:
                    n += int(q.W[shm.QH_SQ_TAIL]) - q.sq_taken + int(r[L.Q_SQ_TAIL] - r[L.Q_SQ_HEAD])
        return n

    def drain_and_stop(self, timeout_s: float) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._draining = True
        if self._lsock is not None:
            try:
                self._sel.unregister(self._lsock)
            except (KeyError, ValueError):
                pass
            self._lsock.close()
            self._lsock = None
        deadline = time.monotonic() + max(0.0, timeout_s)
        while time.monotonic() < deadline and self._outstanding_sends():
            time.sleep(0.005)
        left = self._outstanding_sends()
        flushed = 0
        for dev in self.devices.values():
            with dev.reg_lock:
                for q in list(dev.qp_by_qi.values()):
                    if q.dpqp.query_state() != QPState.ERR:
                        with dev.plane.paused():
                            q.dpqp._to_err(WHY_DRAIN)
                        q.mirror_state()
                        flushed += 1
        # let the loop flush the queues and hand the flush completions to the clients
        end = time.monotonic() + 1.0
        while time.monotonic() < end and any(dev.flushing() for dev in self.devices.values()):
            time.sleep(0.005)
        log.info("draining: %d send WRs still outstanding after %.1fs, %d QPs flushed", left, timeout_s, flushed)
        self._send_events()
        for s in list(self.sessions.values()):
            s.flush()                            # what a slow reader still has queued, as far as it takes it
            s.push({"event": "DEVICE_FATAL", "reason": "the daemon is stopping"})
        for s in list(self.sessions.values()):
            self._reclaim(s)
        for sock in list(self._refused):
            self._drop_refused(sock)
        for dev in self.devices.values():
            try:
                dev.close()                  # detaches XDP (the link), unpins
            except Exception:                # noqa: BLE001
                log.exception("%s: closing", dev.ifname)
        if self._sel is not None:
            self._sel.close()
        os.close(self._efd)
        if self._spare_fd >= 0:
            os.close(self._spare_fd)
            self._spare_fd = -1
        if self._sock_bound:
            try:
                os.unlink(self.cfg.socket_path)
            except FileNotFoundError:
                pass
            self._sock_bound = False
        log.info("stopped")

    # ---- reload -----------------------------------------------------------------------------------
    def reload(self, cfg: DaemonConfig) -> list[str]:
        cfg = cfg.validate()
        fixed = [k for k in FIXED_OPTIONS if getattr(cfg, k) != getattr(self.cfg, k)]
        if fixed:
            raise ConfigError(f"{', '.join(fixed)} cannot change at run time: restart metaroced to apply")
        changed = [k for k in RUNTIME_OPTIONS if getattr(cfg, k) != getattr(self.cfg, k)]
        old = self.cfg
        self.cfg = cfg
        if ("socket_mode" in changed or "socket_group" in changed) and self._sock_bound:
            try:
                self._apply_socket_perms()
            except BaseException:
                self.cfg = old
                raise
        if "log_level" in changed:
            log.setLevel(cfg.log_level.upper())
        if ("max_clients" in changed or "max_qps_per_client" in changed) and self.started is not None:
            self._set_fd_budget()                    # for QPs and CQs made from now on
        for dev in self.devices.values():
            dev.G[dev.serve.G_BUSY_IDLE_NS] = cfg.busy_idle_ms * 1_000_000
            if "read_rate_mbps" in changed:
                dev.apply_read_rate(cfg)
            os.eventfd_write(dev.plane.efd, 1)       # a sleeping loop sees the new progress mode
        if "profile" in changed and cfg.profile != "compat" and self.devices:
            load_native_entries()                    # native QPs may come now: loaded before the first RTR
        if changed:
            log.info("reloaded: %s", ", ".join(changed))
        return changed

    # ---- snapshot ---------------------------------------------------------------------------------
    def snapshot(self, uid: int | None = None) -> dict:
        """Everything, or (uid given) only the QPs and clients of that user's processes."""
        devices, qps = [], []
        for dev in _copy(self.devices.values()):
            try:
                d = dev.info()
                if uid is None:               # the administrator's view: receive counts by peer address (MR-SEC-006)
                    d["rx_by_source"] = dev.ctx.counters_by_source()
                devices.append(d)
            except Exception as e:            # noqa: BLE001 - a stopping device: say so, keep the rest
                devices.append({"ifname": dev.ifname, "error": str(e)})
            for q in _copy(dev.qp_by_qi.values()):
                if uid is not None and q.sess.uid != uid:
                    continue
                try:
                    qps.append(dev.qp_info(q))
                except Exception:             # noqa: BLE001 - destroyed meanwhile
                    pass
        clients = [{**s.owner(), "dev": s.dev.ifname if s.dev else None, "qps": len(s.qps), "cqs": len(s.cqs),
                    "pds": len(s.pds), "mrs": len(s.mrs), "mr_bytes": s.mr_bytes, "fds": s.fds, "wakes": s.wakes,
                    "wakes_forwarded": s.wakes_forwarded, "events_lost": s.events_lost,
                    "waiting": s.waiting, "outbox": len(s.outbox)}
                   for s in _copy(self.sessions.values()) if uid is None or s.uid == uid]
        return {"daemon": {"pid": os.getpid(), "started": self.started, "clients": len(clients),
                           "version": __version__, "socket": self.cfg.socket_path, "cleaned": list(self.cleaned),
                           "refused": dict(self.refusals), "clients_dropped": dict(self.drops),
                           "requests_waited": self.requests_waited, "events_recovered": self.events_recovered,
                           "events_lost": self.events_lost,
                           "fd_limit": self.fd_limit, "fd_budget_per_client": self.fd_budget,
                           "fds_open": open_fds(), "capabilities": caps.effective()},
                "devices": devices, "qps": qps, "clients": clients}


# ================================================================================ a bare runner
def _main(argv: list[str] | None = None) -> int:
    """`python -m metaroce_xdp.daemon.server --config FILE [--opt value ...]`: start, serve until SIGTERM/SIGINT,
    drain and exit 0.  (The service's real entry point with systemd notify, SIGHUP and metrics is
    daemon/metaroced; this runner is what the tests start as the daemon process.)"""
    import argparse
    import signal
    from .config import load_config
    ap = argparse.ArgumentParser(prog="metaroced-core")
    ap.add_argument("--config")
    ap.add_argument("--set", action="append", default=[], metavar="OPTION=VALUE")
    clock = StartClock()
    a = ap.parse_args(argv)
    overrides = dict(kv.split("=", 1) for kv in a.set)
    cfg = load_config(a.config, overrides)
    builds = prebuild_xdp(cfg.interfaces, clock)       # BCC compiles while the rest loads (Daemon.start)
    logging.basicConfig(level=cfg.log_level.upper(), format="metaroced[%(process)d]: %(levelname)s %(message)s")
    clock.mark("config")
    d = Daemon(cfg)
    d.start(clock, builds)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info("ready in %.2f s since the process started: %s", clock.total(), clock.text())
    print(json.dumps({"ready": True, "pid": os.getpid(), "cleaned": d.cleaned, "startup": clock.as_dict()}), flush=True)
    try:
        d.run(stop)
    finally:
        d.drain_and_stop(cfg.drain_timeout_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
