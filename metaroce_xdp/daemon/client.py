"""The client library of metaroced: the README's verbs API, from any process, through the daemon.

    from metaroce_xdp.daemon.client import connect
    ctx = connect()                          # the daemon's socket (METAROCE_SOCKET or the configured default)
    ctx.open_device("eth1")                  # one of the interfaces the daemon owns
    pd = ctx.alloc_pd()
    buf = ctx.alloc_buf(1 << 20)             # shared memory (a sealed memfd): the daemon reads/writes it in place
    mr = pd.reg_mr(buf, Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ)
    cq = ctx.create_cq(256)
    qp = ctx.create_qp(pd, cq, cq)
    conn = ctx.connect_qp(qp, "10.0.0.2", 18515, private={"va": mr.addr, "rkey": mr.rkey})   # spec 06, as rdma_cm
    qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[SGE(mr.addr, 4096, mr.lkey)],
                        remote_addr=conn.private["va"], rkey=conn.private["rkey"]))
    wc = cq.poll()

Control operations (open, register, create, modify, connect) are messages on the Unix socket.  Posting
and polling are not: a post writes the WR into the QP's send/receive ring and its number into this
client's doorbell ring, both shared memory the daemon's loop reads; a poll reads the CQ ring the
daemon's loop writes.  Neither makes a system call (when the daemon runs with progress = "sleep" and
its loop is asleep, a post writes one eventfd to wake it: docs/daemon.md).

Addresses: an MR's `addr` is the address of the memory in the daemon (an I/O virtual address, as with
ibv_reg_mr_iova); SGEs and remote addresses use it (`mr.addr + offset`), and `mr.buf` is the local view
of the same bytes.  Only memory from `alloc_buf` (or another memfd sealed against shrinking) can be
registered.  This module needs numpy and the standard library only (no numba, no BCC).
"""
from __future__ import annotations

import mmap
import os
import socket
import struct
import threading
import time
from typing import Any

import numpy as np

from .. import cm
from ..verbs import ATOMIC_OPCODES, MAX_MESSAGE, PostRules, check_post_state, check_send_wr, check_sg_list
from ..verbs_types import (SGE, Access, AsyncEvent, EventType, InvalidArgument, InvalidState, QPAttr, QPCap, QPState,
                           QueueFull, RecvWR, SendFlags, SendWR, WC, WCFlags, WCOpcode, WCStatus, WROpcode)
from .. import shm
from . import proto
from .proto import (DaemonError, DaemonUnavailable, LimitExceeded, MalformedRequest, PathInUse, PermissionDenied,
                    UnknownHandle, Unsupported)

DEFAULT_SOCKET = "/run/metaroce/metaroced.sock"
PROFILES = ("native", "compat", "auto")         # connect_qp / accept (dp/cmconnect.py's names)
# What post_send takes through metaroced (verbs.check_send_wr): its ring entry has one SGE, of at most 2^31 - 1
# bytes (SEND_WITH_INV's invalidate key rides in the immediate's word, as the IETH in the compiled plane's WQE);
# its loop honours FENCE, SIGNALED and SOLICITED (no INLINE), and takes sends in RTS, SQD (queued, not started:
# MR-QP-018) and ERR (dp/serve.pump_qp, which checks every entry again)
DAEMON_POST = PostRules("the daemon's data plane",
                        states=frozenset({int(QPState.RTS), int(QPState.SQD), int(QPState.ERR)}),
                        flags=int(SendFlags.FENCE | SendFlags.SIGNALED | SendFlags.SOLICITED), max_sge=1,
                        max_sge_length=MAX_MESSAGE)     # the loop's bound (dp/serve.py local_mr)
# the post and poll paths in plain ints (an enum's constructor or a Flag operation costs ~1 us of Python each),
# rings read and written through memoryviews and struct (no numpy scalars)
# the access connect_qp and accept grant a QP they move out of RESET
_CONN_ACCESS = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC
_SEND_INV = int(WROpcode.SEND_WITH_INV)
_RESET = int(QPState.RESET)
_WITH_IMM = int(WCFlags.WITH_IMM)
_WITH_INV = int(WCFlags.WITH_INV)
_WC_STATUS = {int(v): v for v in WCStatus}
_WC_OPCODE = {int(v): v for v in WCOpcode}
_WC_FLAGS: dict[int, WCFlags] = {}
_SQE = struct.Struct(f"<{shm.S_SWAP + 1}q")  # wr_id opcode flags laddr length lkey raddr rkey imm compare_add swap
_RQE = struct.Struct(f"<{shm.RQE_WORDS}q")
_CQE = struct.Struct("<7q")                           # wr_id status opcode byte_len qp_num imm flags


def default_socket() -> str:
    return os.environ.get("METAROCE_SOCKET", DEFAULT_SOCKET)


def connect(socket_path: str | None = None, ifname: str | None = None) -> "Context":
    """A Context on the daemon at socket_path; with ifname, the device opened too."""
    ctx = Context(socket_path or default_socket())
    if ifname is not None:
        ctx.open_device(ifname)
    return ctx


def status(socket_path: str | None = None) -> dict:
    """The daemon's snapshot() (docs/daemon.md): one request, no device needed."""
    with Context(socket_path or default_socket()) as ctx:
        return ctx.status()


class Context:
    """A connection to metaroced; after open_device, the verbs of one device (an ibv_context)."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            s.connect(socket_path)
        except OSError as e:
            s.close()
            raise DaemonUnavailable(f"cannot connect to metaroced at {socket_path}: {e.strerror} -- is it running "
                                    "(systemctl status metaroced), and is this the socket_path of its configuration?"
                                    ) from None
        self.sock = s
        self._lock = threading.RLock()
        self._id = 0
        self._events: list[dict] = []
        self._bufs: list[tuple[int, int, int, Any]] = []          # (start, end, fd, mmap) of alloc_buf memory
        self.mrs: dict[int, MR] = {}                              # lkey -> MR
        self.qps: dict[int, QP] = {}
        self.cqs: dict[int, CQ] = {}
        self.ifname: str | None = None
        self.closed = False
        self._eof = False                                         # the daemon closed the connection
        self._efd = -1
        self._bell = None
        hello, fds = self._call("hello")
        self.daemon_pid = hello["daemon_pid"]
        self.interfaces = hello["interfaces"]
        self.cm_port = int(hello.get("cm_port", cm.CM_PORT))      # the default port of connect_qp / listen
        self._hdr_fd = fds[0]
        # written by the daemon after each event it sent us: what fileno() gives an event loop (-1: an older
        # daemon that sends none)
        self._event_fd = fds[1] if len(fds) > 1 else -1
        for fd in fds[2:]:
            os.close(fd)
        self._hdr_mm = shm.map_fd(fds[0], shm.round_page(shm.H_WORDS * 8))
        self.H = shm.words(self._hdr_mm)
        self._Hv = memoryview(self._hdr_mm).cast("q")          # the doorbell's words as plain ints
        if int(self.H[shm.H_MAGIC]) != shm.MAGIC:
            raise DaemonError("the daemon's session memory has the wrong magic (a different version?)")
        self._rdy_lock = threading.Lock()

    # ---- the socket ---------------------------------------------------------------------------
    def _call(self, op: str, fds: list[int] | tuple = (), **args) -> tuple[dict, list[int]]:
        if self.closed:
            raise InvalidState("the context is closed")
        with self._lock:
            self._id += 1
            rid = self._id
            try:
                proto.send(self.sock, {"op": op, "id": rid, **args}, fds)
            except OSError as e:
                self._refusal()          # refused at accept (SO_PEERCRED, max_clients): the daemon said why
                raise DaemonUnavailable(f"metaroced closed the connection ({e.strerror})") from None
            while True:
                try:
                    msg, rfds, problem = proto.recv(self.sock, proto.MAX_REPLY)
                except OSError as e:
                    raise DaemonUnavailable(f"metaroced closed the connection ({e.strerror})") from None
                if msg is None:
                    raise DaemonUnavailable("metaroced closed the connection (stopped or restarted)")
                if problem:
                    for fd in rfds:
                        os.close(fd)
                    raise DaemonError(f"unreadable reply from metaroced: {problem}")
                if "event" in msg:
                    self._event_msg(msg)
                    continue
                if not msg.get("ok"):
                    for fd in rfds:
                        os.close(fd)
                    proto.raise_error(msg)
                return msg, rfds

    def _event_msg(self, msg: dict) -> None:
        """An unsolicited message: a CQ's completion event (CQ_NOTIFY) is counted on its CQ (CQ.get_event), the
        rest queue for get_async_event."""
        if msg.get("event") == "CQ_NOTIFY":
            cq = self.cqs.get(msg.get("cq"))
            if cq is not None:
                cq._notified += 1
            return
        self._events.append(msg)

    def _read_event(self, timeout: float | None) -> bool:
        """One unsolicited message from the socket within timeout (under self._lock); False when none came.  The
        daemon gone: DEVICE_FATAL queued for get_async_event."""
        self.sock.settimeout(timeout)
        try:
            msg, fds, problem = proto.recv(self.sock, proto.MAX_REPLY)
        except (socket.timeout, BlockingIOError):
            return False
        except OSError:
            msg = None
        finally:
            self.sock.settimeout(None)
        if msg is None:
            self._eof = True
            self._events.append({"event": "DEVICE_FATAL", "reason": "metaroced closed the connection"})
            return True
        for fd in fds:
            os.close(fd)
        if "event" in msg:
            self._event_msg(msg)
        return True

    def _refusal(self) -> None:
        self.sock.settimeout(0.5)
        try:
            msg, fds, _ = proto.recv(self.sock)
        except OSError:
            return
        finally:
            self.sock.settimeout(None)
        for fd in fds:
            os.close(fd)
        if msg and not msg.get("ok", True):
            proto.raise_error(msg)

    def status(self) -> dict:
        r = self._call("status")[0]
        return {k: r[k] for k in ("daemon", "devices", "qps", "clients")}

    # ---- device -------------------------------------------------------------------------------------
    def open_device(self, ifname: str | None = None) -> "Context":
        r, fds = self._call("open_device", ifname=ifname)
        if self._efd >= 0:
            os.close(self._efd)
        self._efd = fds[0]
        self._bell_mm = shm.map_fd(fds[1], shm.PAGE)
        os.close(fds[1])
        self._bell = np.frombuffer(self._bell_mm, np.uint8)
        self.ifname, self.gid, self.local_mac, self.max_pmtu = r["ifname"], r["gid"], r["mac"], r["max_pmtu"]
        self.profiles = r.get("profiles", ["compat"])
        self.native_offer = r.get("native_offer") or {"caps": 0, "w": 0, "k": 1}
        self.dcqcn = r.get("dcqcn")          # the reaction point's parameters (congestion.DcqcnParams), None: off
        return self

    @classmethod
    def open(cls, ifname: str, socket_path: str | None = None) -> "Context":
        """As metaroce_xdp.dp.Context.open, through the daemon that owns ifname."""
        return connect(socket_path, ifname)

    # ---- memory -----------------------------------------------------------------------------------
    def alloc_buf(self, nbytes: int, hugepages: bool = False) -> np.ndarray:
        """nbytes of zeroed shared memory (a sealed memfd) that reg_mr can register without copying.
        hugepages=True asks for transparent huge pages (2 MiB-aligned size, MADV_HUGEPAGE; the kernel gives them
        when /sys/kernel/mm/transparent_hugepage/shmem_enabled allows): the daemon refuses hugetlb memfds
        (MFD_HUGETLB), whose punched holes would fault under its mapping."""
        if not 0 < nbytes <= 1 << 40:
            raise InvalidArgument(f"buffer size {nbytes} out of range")
        if hugepages:
            nbytes = (nbytes + (2 << 20) - 1) // (2 << 20) * (2 << 20)
        fd = shm.create(nbytes, "metaroce-buf")
        size = os.fstat(fd).st_size
        mm = shm.map_fd(fd, size)
        if hugepages and hasattr(mm, "madvise"):
            try:
                mm.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass                        # no THP for shared memory here: small pages
        a = np.frombuffer(mm, np.uint8, count=nbytes)
        start = int(a.ctypes.data)
        self._bufs.append((start, start + size, fd, mm))
        return a

    def alloc_pd(self) -> "PD":
        return PD(self, self._call("alloc_pd")[0]["pd"])

    def reg_mr(self, pd: "PD", buf: Any, access: Access = Access.LOCAL_WRITE, *,
               remote_invalidate: bool = False) -> "MR":
        """ibv_reg_mr; remote_invalidate: a SEND WITH INVALIDATE naming its rkey may invalidate it (MR-MEM-040)."""
        if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
            raise InvalidArgument("register a contiguous numpy array from ctx.alloc_buf() (or a slice of one)")
        mem = buf.reshape(-1).view(np.uint8)
        a, n = int(mem.ctypes.data), int(mem.size)
        if n == 0:
            raise InvalidArgument("cannot register an empty region")
        for start, end, fd, _ in self._bufs:
            if start <= a and a + n <= end:
                break
        else:
            raise InvalidArgument("this memory is not shared with the daemon: allocate it with ctx.alloc_buf() "
                                  "(anonymous private memory such as np.zeros cannot be registered; see "
                                  "docs/daemon.md, 'Which memory can be registered')")
        r, _ = self._call("reg_mr", [fd], pd=pd.handle, access=int(Access(access)), offset=a - start, length=n,
                          remote_invalidate=bool(remote_invalidate))
        mr = MR(self, pd, r["mr"], r["addr"], r["length"], r["lkey"], r["rkey"], Access(access), mem)
        self.mrs[mr.lkey] = mr
        return mr

    def dereg_mr(self, mr: "MR") -> None:
        self._call("dereg_mr", mr=mr.handle)
        self.mrs.pop(mr.lkey, None)
        mr.valid = False

    def dealloc_pd(self, pd: "PD") -> None:
        pd.dealloc()

    # ---- queues -----------------------------------------------------------------------------------
    def create_cq(self, depth: int = 1024, cq_context: Any = None, channel: Any = None) -> "CQ":
        if channel is not None:
            raise Unsupported("completion channels: a CQ of metaroced's has its own (CQ.req_notify, CQ.get_event)")
        r, fds = self._call("create_cq", depth=depth)
        cq = CQ(self, r["cq"], r["size"], fds[0], cq_context)
        self.cqs[cq.handle] = cq
        return cq

    def create_qp(self, pd: "PD", send_cq: "CQ", recv_cq: "CQ", cap: QPCap | None = None,
                  sq_sig_all: bool = False) -> "QP":
        cap = cap or QPCap(max_send_wr=256, max_recv_wr=256)
        r, fds = self._call("create_qp", pd=pd.handle, send_cq=send_cq.handle, recv_cq=recv_cq.handle,
                            max_send_wr=cap.max_send_wr, max_recv_wr=cap.max_recv_wr, sq_sig_all=bool(sq_sig_all))
        qp = QP(self, pd, r["qp"], r["qp_num"], r["sq_size"], r["rq_size"], fds[0], send_cq, recv_cq, cap)
        self.qps[qp.handle] = qp
        return qp

    def destroy_qp(self, qp: "QP") -> None:
        qp.destroy()

    def destroy_cq(self, cq: "CQ") -> None:
        cq.destroy()

    def _doorbell(self, qpn: int) -> None:
        """After a post: the QP's number into this client's doorbell ring, which the daemon's compiled loop
        reads every round (it takes only QPs of this client)."""
        H = self._Hv
        with self._rdy_lock:
            t = H[shm.H_RDY_TAIL]
            if t - H[shm.H_RDY_HEAD] < shm.N_RDY:          # full: the daemon's periodic scan finds it
                H[shm.H_RDY_OFF + (t & (shm.N_RDY - 1))] = qpn
                H[shm.H_RDY_TAIL] = t + 1
        if H[shm.H_SLEEPING] and self._efd >= 0:
            os.eventfd_write(self._efd, 1)             # only when the daemon's loop sleeps

    # ---- connection management (spec 06) ----------------------------------------------------------
    def offer(self, profile: str = "compat") -> tuple[int, int]:
        """(capabilities, flags) of this client's REQ or REP for `profile` (as dp/cmconnect.offer, with what the
        daemon serves: native_offer, CREDITS when it allocates credits): "compat" offers no native capability,
        "native" offers them without COMPAT_OK (a compat-only peer is refused, MR-CM-017), "auto" with it.
        ATOMICS with every profile: the daemon's loop executes them, compat and native (MR-NAT-006)."""
        if profile not in PROFILES:
            raise InvalidArgument(f"profile {profile!r}: one of {', '.join(PROFILES)}")
        base = (int(cm.Cap.IPV6) if ":" in self.gid else 0) | int(cm.Cap.ATOMICS)
        if profile == "compat":
            return base, cm.FLAG_COMPAT_OK
        if "native" not in self.profiles:
            if profile == "native":
                raise Unsupported(f"this daemon serves the {' and '.join(self.profiles)} profile only "
                                  "(its profile option)")
            return base, cm.FLAG_COMPAT_OK
        return base | int(self.native_offer["caps"]), 0 if profile == "native" else cm.FLAG_COMPAT_OK

    @staticmethod
    def agreed_profile(agreed: int, w: int, k: int, t_peer: int | None = None) -> tuple[str, dict | None]:
        """The QP's profile and native parameters from the agreed set (MR-CM-016, 6.4), as
        dp/cmconnect.agreed_profile (the daemon adds rto_min and the receiver's parameters); t_peer: the
        ack_coalesce_us of the peer's NATIVE_TIMING TLV, None for the default (MR-CC-040)."""
        if not (agreed & cm.Cap.NATIVE and agreed & cm.Cap.SACK and agreed & cm.Cap.OOO_PLACEMENT):
            return "compat", None
        out = {"w": w, "k": k if agreed & cm.Cap.MULTIPATH else 1, "cc_delay": 1 if agreed & cm.Cap.CC_DELAY else 0,
               "credits": 1 if agreed & cm.Cap.CREDITS else 0}
        if t_peer is not None:
            out["t_peer"] = t_peer
        return "native", out

    def _cm_msg(self, qp: "QP", psn: int, mtu: int, private: dict | None, profile: str = "compat") -> cm.CMMsg:
        import json
        gid = cm.ip_to_gid(self.gid)
        caps, flags = self.offer(profile)
        tl = [(cm.TLV_IMPL_NAME, cm.IMPL_NAME.encode())]
        if private is not None:
            tl.append((cm.TLV_PERF_PARAMS, json.dumps(private, separators=(",", ":")).encode()))
        native = caps & cm.Cap.SACK
        return cm.CMMsg(cm.MsgType.REQ, cookie=cm.new_cookie(), gid=gid, qpn=qp.qp_num, capabilities=int(caps),
                        flags=flags, sack_window=self.native_offer["w"] if native else 0,
                        entropy_count=self.native_offer["k"] if caps & cm.Cap.MULTIPATH else 1,
                        psn=psn, path_mtu=cm.MTU_ENUM[mtu], max_rd_atomic=16, max_dest_rd_atomic=16,
                        min_rnr_timer=12, mac=cm.mac_bytes(self.local_mac), tlvs=tl)

    def _mtu(self, mtu: int | None) -> int:
        m = min(mtu or self.max_pmtu, self.max_pmtu, 4096)
        return max(v for v in cm.MTU_ENUM if v <= m)

    def connect_qp(self, qp: "QP", host: str, port: int | None = None, private: dict | None = None,
                   mtu: int | None = None, timeout: float = cm.CM_TIMEOUT, profile: str = "compat") -> "Connection":
        """Active side of 6.5.1: TCP to host:port, REQ/REP/RTU, the QP through INIT/RTR/RTS.  `private` (a
        JSON object, e.g. a buffer's address and rkey) reaches the peer; its own comes back in .private.
        `profile` native|compat|auto: what the REQ offers (offer()); the agreed set chooses the QP's profile
        (Connection.profile, QP.profile)."""
        caps, _ = self.offer(profile)
        ch = cm.connect(host, port or self.cm_port, timeout)
        try:
            if qp.state == QPState.RESET:
                qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=_CONN_ACCESS))
            psn = cm.random_psn()
            req = self._cm_msg(qp, psn, self._mtu(mtu), private, profile)

            def to_rts(rep: cm.CMMsg) -> None:
                prof, params = self.agreed_profile(rep.capabilities & caps, min(rep.sack_window, req.sack_window),
                                                   min(rep.entropy_count, req.entropy_count), cm.peer_timing(rep))
                extra = {"profile": prof, "native_params": params} if prof == "native" else {}
                qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=rep.qpn, rq_psn=rep.psn, path_mtu=rep.mtu_bytes,
                                 dgid=cm.gid_to_ip(rep.gid), max_dest_rd_atomic=16, min_rnr_timer=12, **extra))
                qp.profile = prof
                qp.atomics = bool(rep.capabilities & caps & cm.Cap.ATOMICS)                 # MR-CM-019
                qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=psn, timeout=14, retry_cnt=7, rnr_retry=7,
                                 max_rd_atomic=min(16, rep.max_dest_rd_atomic)))          # MR-CM-021
            rep = cm.active_exchange(ch, req, to_rts, timeout)
        except BaseException:
            ch.close()
            try:
                qp.modify(QPAttr(qp_state=QPState.ERR))                             # MR-CM-030
            except Exception:                    # noqa: BLE001
                pass
            raise
        return Connection(ch, qp, rep, req)

    def listen(self, port: int | None = None) -> "Listener":
        """Passive side (6.5.2): accept() connections on TCP port `port` of this host (default: the daemon's
        cm_port)."""
        return Listener(self, port or self.cm_port)

    # ---- events, stats, close ----------------------------------------------------------------------
    def fileno(self) -> int:
        """A file descriptor an event loop waits on (select, poll, epoll, asyncio's add_reader): readable when
        the daemon has sent an event -- a CQ's completion event (after cq.req_notify) or an asynchronous
        event.  Then call cq.get_event(0) for each armed CQ and get_async_event(0) until None; those read
        it back, and leave it readable while events they did not hand out remain (level-triggered, with at
        most a spurious wake-up).  Like ibv_comp_channel's and ibv_context's async_fd."""
        if self.closed:
            raise InvalidState("the context is closed")
        if self._event_fd < 0:
            raise Unsupported("this metaroced sends no event descriptor (an older version): poll get_event")
        return self._event_fd

    def _drain_events(self) -> None:
        """(Under self._lock.)  The event descriptor read back first, then every message already in the socket
        taken; readable again if events remain for get_event/get_async_event to hand out."""
        if self._event_fd < 0 or self.closed:
            return
        try:
            os.eventfd_read(self._event_fd)
        except BlockingIOError:
            pass
        while not self._eof and self._read_event(0):
            pass
        if self._events or any(c._notified for c in self.cqs.values()):
            os.eventfd_write(self._event_fd, 1)

    def get_async_event(self, timeout: float | None = 0.0) -> AsyncEvent | None:
        """The next event the daemon reported (QP_FATAL, CQ_ERR, EVENTS_LOST, DEVICE_FATAL), waiting up to
        timeout: a verbs_types.AsyncEvent, as the compiled plane in process returns."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._drain_events()
            while not self._events:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                if not self._read_event(left):
                    return None
            m = self._events.pop(0)
            self._drain_events()
        qp = next((q for q in self.qps.values() if q.handle == m.get("qp")), None)
        cq = self.cqs.get(m.get("cq")) if "cq" in m else None
        return AsyncEvent(EventType[str(m["event"])], qp, cq, m.get("reason", ""), int(m.get("count", 0)))

    def stats(self) -> dict:
        return self._call("stats")[0]["stats"]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass
        if self._event_fd >= 0:
            os.close(self._event_fd)
            self._event_fd = -1
        for o in list(self.qps.values()) + list(self.cqs.values()):
            o._unmap()
        if self._efd >= 0:
            os.close(self._efd)
        if self._bell is not None:
            self._bell = None
            shm.close_map(self._bell_mm)
        os.close(self._hdr_fd)
        self.H = None
        self._Hv.release()
        shm.close_map(self._hdr_mm)
        for _, _, fd, mm in self._bufs:
            os.close(fd)            # the mapping (and views of it) stays valid until the last view goes

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class PD:
    def __init__(self, ctx: Context, handle: int) -> None:
        self.ctx, self.handle = ctx, handle

    def reg_mr(self, buf: Any, access: Access = Access.LOCAL_WRITE, **kw) -> "MR":
        return self.ctx.reg_mr(self, buf, access, **kw)

    def dealloc(self) -> None:
        self.ctx._call("dealloc_pd", pd=self.handle)

    def __repr__(self) -> str:
        return f"PD({self.handle})"


class MR:
    """addr: the region's address in the daemon (use it in SGEs and hand it to peers); buf: the local view."""

    def __init__(self, ctx, pd, handle, addr, length, lkey, rkey, access, buf) -> None:
        self.ctx, self.pd, self.handle, self.addr, self.length = ctx, pd, handle, addr, length
        self.lkey, self.rkey, self.access, self.buf = lkey, rkey, access, buf
        self._access = int(access)          # for the post path's check (no Flag arithmetic per WR)
        self.valid = True

    def sge(self, offset: int, length: int):
        return SGE(self.addr + offset, length, self.lkey)

    def dereg(self) -> None:
        self.ctx.dereg_mr(self)

    def __repr__(self) -> str:
        return f"MR(addr={self.addr:#x}, len={self.length}, lkey={self.lkey:#x}, access={self.access!r})"


class CQ:
    def __init__(self, ctx: Context, handle: int, size: int, fd: int, cq_context: Any) -> None:
        self.ctx, self.handle, self.size, self.cq_context = ctx, handle, size, cq_context
        self._fd = fd
        self._mm = shm.map_fd(fd, shm.round_page(shm.cq_words(size) * 8))
        self.W = shm.words(self._mm)
        self._ring = self.W[shm.CH_WORDS:shm.CH_WORDS + size * shm.CQE_WORDS].reshape(size, shm.CQE_WORDS)
        self._v = memoryview(self._mm).cast("q")            # CH_HEAD / CH_TAIL as plain ints
        self._notified = 0                                  # CQ_NOTIFY messages not yet taken by get_event
        self.events = 0

    def req_notify(self, solicited_only: bool = False) -> None:
        """ibv_req_notify_cq: one completion event for the next completion added -- with solicited_only, for
        the next solicited (SE, MR-BTH-004) or unsuccessful one.  Arming for any completion outranks
        solicited_only until the event comes.  The daemon arms the CQ and sends CQ_NOTIFY when it comes."""
        if not isinstance(solicited_only, bool):
            raise InvalidArgument(f"solicited_only must be True or False, not {solicited_only!r}")
        self.ctx._call("req_notify_cq", cq=self.handle, solicited_only=solicited_only)

    def get_event(self, timeout: float | None = 0.0) -> bool:
        """Wait up to `timeout` seconds (None: for ever) for this CQ's completion event (ibv_get_cq_event on its
        own channel); True when it came, its completion already in the CQ.  The CQ is disarmed: req_notify
        again for the next event."""
        ctx = self.ctx
        deadline = None if timeout is None else time.monotonic() + timeout
        with ctx._lock:
            ctx._drain_events()
            while not self._notified:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if ctx.closed:
                    raise InvalidState("the context is closed")
                if ctx._eof:
                    raise DaemonUnavailable("metaroced closed the connection (stopped or restarted)")
                ctx._read_event(left)
            self._notified -= 1
            self.events += 1
            ctx._drain_events()
        return True

    def poll(self, num_entries: int = 16) -> list[WC]:
        """ibv_poll_cq: up to num_entries completions, read from shared memory (no system call).  An empty
        poll reads one word and writes nothing (the head shares a cache line with the tail the daemon writes)."""
        v = self._v
        head, tail = v[shm.CH_HEAD], v[shm.CH_TAIL]
        if head == tail:
            return []
        out = []
        mask = self.size - 1
        mm, unpack = self._mm, _CQE.unpack_from
        while head != tail and len(out) < num_entries:
            wr_id, st, op, blen, qpn, imm, flags = unpack(mm, 8 * (shm.CH_WORDS + (head & mask) * shm.CQE_WORDS))
            wf = _WC_FLAGS.get(flags)
            if wf is None:
                wf = WCFlags(flags)
                if len(_WC_FLAGS) < 64:
                    _WC_FLAGS[flags] = wf
            status, opcode = _WC_STATUS.get(st), _WC_OPCODE.get(op)       # (SUCCESS is 0: falsy, so no `or`)
            out.append(WC(wr_id & 0xFFFFFFFFFFFFFFFF, WCStatus(st) if status is None else status,
                          WCOpcode(op) if opcode is None else opcode, blen, qpn,
                          imm if flags & _WITH_IMM else None, wf,
                          invalidated_rkey=imm & 0xFFFFFFFF if flags & _WITH_INV else None))
            head += 1
        v[shm.CH_HEAD] = head
        return out

    def wait(self, n: int = 1, timeout: float = 10.0) -> list[WC]:
        """Poll until n completions arrived; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        out: list[WC] = []
        spins = 0
        while len(out) < n:
            got = self.poll(n - len(out))
            out += got
            if len(out) >= n:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(out)} of {n} completions after {timeout}s")
            spins = 0 if got else spins + 1
            if spins > 200:
                time.sleep(0.0002)
            elif spins > 20:
                os.sched_yield()            # waiting, not polling: leave the CPU to the daemon's loop
        return out

    @property
    def overflowed(self) -> bool:
        return bool(self.W[shm.CH_OVERFLOW])

    def destroy(self) -> None:
        self.ctx._call("destroy_cq", cq=self.handle)
        self.ctx.cqs.pop(self.handle, None)
        self._unmap()

    def _unmap(self) -> None:
        if self.W is None:
            return
        self.W = self._ring = None
        self._v.release()
        os.close(self._fd)
        shm.close_map(self._mm)


class QP:
    def __init__(self, ctx: Context, pd: PD, handle: int, qp_num: int, sq_size: int, rq_size: int, fd: int,
                 send_cq: CQ, recv_cq: CQ, cap: QPCap | None = None) -> None:
        self.ctx, self.pd, self.handle, self.qp_num = ctx, pd, handle, qp_num
        self.sq_size, self.rq_size = sq_size, rq_size
        self.cap = cap or QPCap()            # max_send_sge, max_recv_sge: checked at post (verbs.check_sg_list)
        self.send_cq, self.recv_cq = send_cq, recv_cq
        self._fd = fd
        self._mm = shm.map_fd(fd, shm.round_page(shm.qp_words(sq_size, rq_size) * 8))
        W = self.W = shm.words(self._mm)
        o = shm.QH_WORDS
        self._sq = W[o:o + sq_size * shm.SQE_WORDS].reshape(sq_size, shm.SQE_WORDS)
        o += sq_size * shm.SQE_WORDS
        self._rq = W[o:o + rq_size * shm.RQE_WORDS].reshape(rq_size, shm.RQE_WORDS)
        self._v = memoryview(self._mm).cast("q")            # the header words as plain ints (post path)
        self._lock = threading.Lock()
        self.profile = "compat"              # "native" once a connection agreed it (connect_qp, accept)
        self.atomics: bool | None = None     # whether the connection agreed ATOMICS (None: set up by hand)

    @property
    def state(self) -> QPState:
        return QPState(int(self.W[shm.QH_STATE]))

    def query_state(self) -> QPState:
        return self.state

    def modify(self, attr: QPAttr) -> None:
        a = {k: (str(v) if k in ("dgid", "dmac") else v.value if hasattr(v, "value") else v)
             for k, v in attr.given().items()}
        self.ctx._call("modify_qp", qp=self.handle, attr=a)
        if attr.qp_state == QPState.RESET:              # what a connection agreed holds until RESET
            self.profile, self.atomics = "compat", None

    def query(self) -> dict:
        d = self.ctx._call("query_qp", qp=self.handle)[0]["qp_info"]
        d["state"] = QPState(d["state"])
        d["qp_num"] = d["qpn"]
        d["dest_qp_num"] = d.get("remote_qpn") or 0       # the compiled plane's name (verbs.QUERY_KEYS)
        return d

    def destroy(self) -> None:
        self.ctx._call("destroy_qp", qp=self.handle)
        self.ctx.qps.pop(self.handle, None)
        self._unmap()

    def _unmap(self) -> None:
        if self.W is None:
            return
        self.W = self._sq = self._rq = None
        self._v.release()
        os.close(self._fd)
        shm.close_map(self._mm)

    @staticmethod
    def _local_sge(sg_list) -> tuple[int, int, int]:
        """(addr, length, lkey) of the one SGE of a list verbs.check_sg_list passed, as given.  Whether it lies
        in a valid MR of this QP's PD with the access the WR needs is the daemon's loop's to check (it knows
        the MRs a SEND WITH INVALIDATE invalidated): a failure is the WR's error completion, LOC_PROT_ERR,
        not a refusal here (MR-MEM-020, MR-RC-022).  A zero-length SGE names no memory (MR-MEM-032)."""
        if not sg_list or sg_list[0].length == 0:
            return 0, 0, 0
        s = sg_list[0]
        return _i64(s.addr), s.length, s.lkey & 0xFFFFFFFF

    def post_send(self, wrs: SendWR | list[SendWR]) -> None:
        """ibv_post_send into shared memory (no system call); a list is posted whole or not at all."""
        wrs = (wrs,) if isinstance(wrs, SendWR) else list(wrs)
        v = self._v
        check_post_state(v[shm.QH_STATE], DAEMON_POST)
        rows = []
        max_sge, profile, atomics = self.cap.max_send_sge, self.profile, self.atomics
        for wr in wrs:
            check_send_wr(wr, DAEMON_POST, max_sge, profile, atomics)
            op, flags = int(wr.opcode), int(wr.send_flags)
            atomic = op in ATOMIC_OPCODES
            addr, length, lkey = self._local_sge(wr.sg_list)
            imm = (wr.invalidate_rkey if op == _SEND_INV else wr.imm_data) & 0xFFFFFFFF       # the IETH, or ImmDt
            rows.append((_i64(wr.wr_id), op, flags, addr, length, lkey,
                         _i64(wr.remote_addr), wr.rkey & 0xFFFFFFFF, imm,
                         _i64(wr.compare_add) if atomic else 0, _i64(wr.swap) if atomic else 0))
        mm, pack, base = self._mm, _SQE.pack_into, 8 * shm.QH_WORDS
        with self._lock:
            tail = v[shm.QH_SQ_TAIL]
            if tail - v[shm.QH_SQ_HEAD] + len(rows) > self.sq_size:
                raise QueueFull(f"send queue full ({self.sq_size} WRs waiting for the daemon): poll the CQ, "
                                "then post again")
            mask = self.sq_size - 1
            for i, row in enumerate(rows):
                pack(mm, base + 8 * shm.SQE_WORDS * ((tail + i) & mask), *row)
            v[shm.QH_SQ_TAIL] = tail + len(rows)         # published after the entries (x86-64: stores in order)
        self.ctx._doorbell(self.qp_num)

    def post_recv(self, wrs: RecvWR | list[RecvWR]) -> None:
        wrs = (wrs,) if isinstance(wrs, RecvWR) else list(wrs)
        v = self._v
        if v[shm.QH_STATE] == _RESET:
            raise InvalidState("post_recv on a QP in RESET: move it to INIT first")
        for wr in wrs:
            check_sg_list(wr.sg_list, "RECV", self.cap.max_recv_sge, DAEMON_POST)
        rows = [(_i64(wr.wr_id), *self._local_sge(wr.sg_list)) for wr in wrs]
        mm, pack, base = self._mm, _RQE.pack_into, 8 * (shm.QH_WORDS + self.sq_size * shm.SQE_WORDS)
        with self._lock:
            tail = v[shm.QH_RQ_TAIL]
            if tail - v[shm.QH_RQ_HEAD] + len(rows) > self.rq_size:
                raise QueueFull(f"receive queue full ({self.rq_size} WRs waiting for the daemon)")
            mask = self.rq_size - 1
            for i, row in enumerate(rows):
                pack(mm, base + 8 * shm.RQE_WORDS * ((tail + i) & mask), *row)
            v[shm.QH_RQ_TAIL] = tail + len(rows)
        self.ctx._doorbell(self.qp_num)

    def __repr__(self) -> str:
        return f"QP({self.qp_num:#x}, {self.state.name})"


def _i64(v: int) -> int:
    v &= 0xFFFFFFFFFFFFFFFF
    return v - (1 << 64) if v >= 1 << 63 else v


class Connection:
    """An established connection: .peer (QPN, GID, agreed capabilities) and .private (the peer's JSON);
    .channel is the TCP connection, which the application may keep using (closing it changes nothing)."""

    def __init__(self, ch: cm.Channel, qp: QP, theirs: cm.CMMsg, mine: cm.CMMsg) -> None:
        self.channel, self.qp = ch, qp
        self.private = theirs.perf
        self.peer = {"qpn": theirs.qpn, "gid": cm.gid_text(theirs.gid), "ip": cm.gid_to_ip(theirs.gid),
                     "path_mtu": theirs.mtu_bytes, "caps": int(theirs.capabilities)}
        self.caps = cm.Cap(theirs.capabilities & 0xFF)
        self.profile = qp.profile

    def close(self) -> None:
        self.channel.close()


class Listener:
    def __init__(self, ctx: Context, port: int) -> None:
        self.ctx, self.port = ctx, port
        self._lst = cm.Listener(port)

    def accept(self, qp: QP, private: dict | None = None, timeout: float | None = None,
               mtu: int | None = None, profile: str = "compat", check_address: bool = True) -> Connection:
        """Passive side of 6.5.2 for one connection onto qp (RESET or INIT); `profile` as in connect_qp.
        check_address (MR-SEC-019): a REQ whose GID is not the TCP connection's source address gets REJ
        ADDRESS_MISMATCH (cm.Rejected here); False only where set-up runs on another network than the RoCE
        traffic (the peer's TCP source is then not its GID)."""
        ctx = self.ctx
        ch = self._lst.accept(timeout)
        try:
            if qp.state == QPState.RESET:
                qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=_CONN_ACCESS))
            psn = cm.random_psn()
            mine = ctx._mtu(mtu)
            caps, flags = ctx.offer(profile)

            def make_rep(req: cm.CMMsg) -> cm.CMMsg:
                why = cm.address_problem(req.gid, ch.peer) if check_address else ""
                if why:                                                                  # MR-SEC-019
                    raise cm.Rejected(cm.Reason.ADDRESS_MISMATCH, why, by_peer=False)
                agreed = min(mine, req.mtu_bytes or 256)
                got = cm.agree_caps(req.capabilities, caps | int(cm.Cap.IPV6))
                if not got & cm.Cap.NATIVE and not flags & cm.FLAG_COMPAT_OK and profile == "native":
                    raise cm.Rejected(cm.Reason.NATIVE_REQUIRED, "", by_peer=False)      # MR-CM-017
                w = min(req.sack_window, ctx.native_offer["w"]) if got & cm.Cap.SACK else 0
                k = min(req.entropy_count, ctx.native_offer["k"]) if got & cm.Cap.MULTIPATH else 1
                prof, params = ctx.agreed_profile(got, w, k, cm.peer_timing(req))
                extra = {"profile": prof, "native_params": params} if prof == "native" else {}
                try:
                    qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=req.qpn, rq_psn=req.psn, path_mtu=agreed,
                                     dgid=cm.gid_to_ip(req.gid), max_dest_rd_atomic=16, min_rnr_timer=12, **extra))
                except Exception as e:          # noqa: BLE001 - becomes the REJ the peer reads
                    raise cm.Rejected(cm.Reason.NO_RESOURCES, str(e), by_peer=False) from None
                qp.profile = prof
                qp.atomics = bool(got & cm.Cap.ATOMICS)                                     # MR-CM-019
                rep = ctx._cm_msg(qp, psn, agreed, private, profile)
                rep.flags, rep.sack_window, rep.entropy_count = flags, w, k
                return rep
            req, rep = cm.passive_exchange(ch, caps | int(cm.Cap.IPV6), make_rep)          # MR-CM-014/018
            qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=psn, timeout=14, retry_cnt=7, rnr_retry=7,
                             max_rd_atomic=min(16, req.max_dest_rd_atomic)))           # MR-CM-028
        except BaseException:
            ch.close()
            try:
                qp.modify(QPAttr(qp_state=QPState.ERR))
            except Exception:                   # noqa: BLE001
                pass
            raise
        c = Connection(ch, qp, req, rep)
        c.peer["caps"] = int(rep.capabilities)           # the agreed set
        c.caps = cm.Cap(rep.capabilities & 0xFF)
        return c

    def close(self) -> None:
        self._lst.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["connect", "status", "PROFILES", "Context", "PD", "MR", "CQ", "QP", "Connection", "Listener", "AsyncEvent",
           "DaemonError", "DaemonUnavailable", "PermissionDenied", "MalformedRequest", "UnknownHandle",
           "LimitExceeded", "PathInUse", "Unsupported", "DEFAULT_SOCKET"]
