"""AF_XDP sockets and UMEM: the control path, through ctypes and libc only.

Role: create an AF_XDP socket, register its UMEM, size and mmap the four rings with the
offsets the kernel reports, bind to (ifindex, queue), and tear all of it down.  Each ring
comes out as numpy views (`Ring`) that the jitted functions in `rings.py` operate on; the
ABI numbers come from `uapi.py`.  The XDP program that steers packets into the socket is
someone else's (bpf/, loaded through BCC); `xskmap_set()` only writes our fd into its
XSKMAP.  No libbpf/libxdp: their Python bindings are not available here.

Lifetime.  The kernel releases an AF_XDP socket (and drops it from every XSKMAP) only when
its fd *and every mapping of its rings* are gone.  `close()` therefore drops the views it
made, unmaps, then closes the fd.  If the caller still holds a view of a ring, Python's
mmap refuses to unmap (BufferError): close() then warns and leaves the unmap to the garbage
collector, so a stale view can never touch unmapped memory.

Multi-buffer (sg=True): the socket is bound with XDP_USE_SG, so a frame larger than a chunk
comes in (and goes out as) several descriptors chained by XDP_PKT_CONTD.  Its Umem must be
built with slot_frames > 1: the pool then hands out slots of slot_frames adjacent chunks, only
slot starts go on the fill ring, and rx_burst/tx_burst/reap use the *_sg ring functions, so a
caller still sees one contiguous frame per packet (rings.py explains the layout).

Threads and namespaces: the socket belongs to the network namespace of the thread that
creates it; create it inside the namespace that owns the interface (topo.Topology.enter).
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import select
import socket
import warnings
from dataclasses import dataclass, field

import numpy as np

from . import rings
from . import uapi
from .rings import FramePool

__all__ = ["XskError", "Umem", "Ring", "XskSocket", "xskmap_set"]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.socket.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
_libc.setsockopt.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32]
_libc.getsockopt.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                             ctypes.POINTER(ctypes.c_uint32)]
_libc.bind.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32]
_libc.sendto.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                         ctypes.c_void_p, ctypes.c_uint32]
_libc.sendto.restype = ctypes.c_ssize_t
_libc.recvfrom.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                           ctypes.c_void_p, ctypes.c_void_p]
_libc.recvfrom.restype = ctypes.c_ssize_t

MSG_DONTWAIT = socket.MSG_DONTWAIT
# sendto()/recvfrom() kicks may fail with these while the driver is busy; the ring state is
# intact and the next kick retries (libxdp ignores the same set).
_KICK_TRANSIENT = {errno.EAGAIN, errno.EBUSY, errno.ENOBUFS, errno.ENETDOWN}

CHUNK_SIZES = (2048, 4096)  # aligned mode: power of two, >= 2048, <= PAGE_SIZE


class XskError(OSError):
    """An AF_XDP set-up step failed; the message names the step and what to try."""


def _raise(step: str, hint: str = "") -> None:
    e = ctypes.get_errno()
    msg = f"AF_XDP {step} failed: {os.strerror(e)}"
    raise XskError(e, msg + (f" ({hint})" if hint else ""))


def _setsockopt(fd: int, opt: int, value: ctypes.Structure | ctypes._SimpleCData, size: int | None = None):
    size = ctypes.sizeof(value) if size is None else size
    return _libc.setsockopt(fd, uapi.SOL_XDP, opt, ctypes.byref(value), size)


def _getsockopt(fd: int, opt: int, value) -> int:
    optlen = ctypes.c_uint32(ctypes.sizeof(value))
    if _libc.getsockopt(fd, uapi.SOL_XDP, opt, ctypes.byref(value), ctypes.byref(optlen)) != 0:
        return -1
    return optlen.value


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class Umem:
    """Packet memory shared with the kernel: `nframes` chunks of `frame_size` bytes.

    `frames` is the whole area as a numpy uint8 array (frame at byte offset addr); `pool`
    is the free list of chunk addresses.  The area is anonymous, page aligned, populated
    up front (the kernel pins it at registration anyway).  A Umem is registered by the
    first XskSocket built on it; its fill and completion rings live on that socket.

    slot_frames > 1 (multi-buffer sockets): the pool holds slots of slot_frames adjacent
    chunks (`slot` bytes, aligned), so a frame up to `slot` bytes is contiguous in memory;
    the kernel still sees `frame_size` chunks."""

    def __init__(self, nframes: int = 4096, frame_size: int = 2048, headroom: int = 0, slot_frames: int = 1):
        if frame_size not in CHUNK_SIZES:
            raise ValueError(
                f"frame_size {frame_size} unsupported: use 2048 (frames up to ~1.8 KB) or "
                "4096 (up to ~3.8 KB); larger chunks are rejected by the kernel"
            )
        if nframes <= 0:
            raise ValueError("nframes must be positive")
        if not _is_pow2(slot_frames) or nframes % slot_frames:
            raise ValueError(f"slot_frames {slot_frames} must be a power of two dividing nframes {nframes}")
        self.nframes = nframes
        self.frame_size = frame_size
        self.headroom = headroom
        self.size = nframes * frame_size  # multiple of the page size: chunks are 2K/4K
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self._mm = mmap.mmap(-1, self.size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.frames = np.frombuffer(self._mm, dtype=np.uint8)
        self.addr = self.frames.ctypes.data
        self.slot = frame_size * slot_frames
        self.pool = FramePool(nframes // slot_frames, self.slot)
        self.owner_fd = -1  # fd of the socket that registered this area with the kernel
        self.closed = False

    def frame(self, addr: int, length: int) -> np.ndarray:
        """View of `length` bytes at UMEM address `addr` (as found in a descriptor)."""
        return self.frames[addr:addr + length]

    def close(self) -> None:
        """Unmap the area.  Idempotent.  The kernel keeps its own pin until the socket
        that registered it is released, so order relative to XskSocket.close() is free."""
        if self.closed:
            return
        self.closed = True
        self.frames = None
        _close_mmap(self._mm, "UMEM")
        self._mm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _close_mmap(mm: mmap.mmap | None, what: str) -> None:
    if mm is None:
        return
    try:
        mm.close()
    except BufferError:
        warnings.warn(
            f"{what} mapping still has numpy views outside XskSocket/Umem; it is unmapped "
            "when they are garbage-collected (and the kernel keeps the socket until then)",
            ResourceWarning,
            stacklevel=3,
        )


@dataclass
class Ring:
    """One mapped AF_XDP ring as numpy views (layout: see rings.py docstring).

    fill/completion rings have `addrs` (uint64[size]); RX/TX rings have `descs`
    (uint64[size, 2]); the other is None."""

    name: str
    size: int
    producer: np.ndarray
    consumer: np.ndarray
    flags: np.ndarray
    addrs: np.ndarray | None = None
    descs: np.ndarray | None = None
    _mm: mmap.mmap | None = field(default=None, repr=False)

    @property
    def records(self) -> np.ndarray:
        """RX/TX descriptors as xdp_desc records (addr, len, options), for inspection."""
        return self.descs.view(uapi.XDP_DESC_DTYPE).reshape(-1)

    def needs_wakeup(self) -> bool:
        return bool(self.flags[0] & uapi.XDP_RING_NEED_WAKEUP)

    def unmap(self) -> None:
        self.producer = self.consumer = self.flags = self.addrs = self.descs = None
        _close_mmap(self._mm, f"{self.name} ring")
        self._mm = None


def _map_ring(fd: int, name: str, off: uapi.xdp_ring_offset, size: int, pgoff: int, is_desc: bool) -> Ring:
    entry = ctypes.sizeof(uapi.xdp_desc) if is_desc else 8
    length = off.desc + size * entry
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    try:
        mm = mmap.mmap(fd, length, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=pgoff)
    except OSError as e:
        raise XskError(e.errno, f"AF_XDP mmap of the {name} ring failed: {e.strerror}") from e
    u32 = lambda o: np.frombuffer(mm, dtype=np.uint32, count=1, offset=o)  # noqa: E731
    ring = Ring(name, size, u32(off.producer), u32(off.consumer), u32(off.flags), _mm=mm)
    if is_desc:
        ring.descs = np.frombuffer(mm, dtype=np.uint64, count=2 * size, offset=off.desc).reshape(size, 2)
    else:
        ring.addrs = np.frombuffer(mm, dtype=np.uint64, count=size, offset=off.desc)
    return ring


class XskSocket:
    """An AF_XDP socket bound to one (interface, queue) with its UMEM and rings.

    mode: "copy" (XDP_COPY, the default: what veth supports), "zerocopy" (XDP_ZEROCOPY,
    fails if the driver lacks it) or "auto" (zero-copy, falling back to copy).
    need_wakeup: bind with XDP_USE_NEED_WAKEUP; then kick_tx() / wake_rx() only enter the
    kernel when the ring's flags ask for it.
    prefill: frames put on the fill ring at start (default: fill_size, at most half the
    pool so TX has frames too).  rx_size / tx_size of 0 omit that ring.
    sg: bind with XDP_USE_SG (multi-buffer RX and TX); needs a Umem with slot_frames > 1.
    share: a socket (usually on another queue of the same interface) whose Umem this one shares
    (XDP_SHARED_UMEM): no registration of its own, but its own fill and completion rings (the
    kernel needs them when the queue differs); mode, need_wakeup and sg are the first socket's
    (the kernel refuses them as bind flags of a sharing socket).  A frame received on any of the
    sockets is an address in the one Umem, so it can go back to any of their fill rings."""

    def __init__(
        self,
        ifname: str | int,
        queue_id: int = 0,
        umem: Umem | None = None,
        *,
        rx_size: int = 2048,
        tx_size: int = 2048,
        fill_size: int = 2048,
        comp_size: int = 2048,
        mode: str = "copy",
        need_wakeup: bool = True,
        prefill: int | None = None,
        sg: bool = False,
        share: "XskSocket | None" = None,
    ):
        if share is not None:
            if share.closed or umem not in (None, share.umem):
                raise ValueError("share: an open socket whose Umem this one uses (umem None or the same)")
            umem, mode, need_wakeup, sg = share.umem, "copy", share.need_wakeup, share.sg
        if mode not in ("copy", "zerocopy", "auto"):
            raise ValueError(f"mode {mode!r}: use 'copy', 'zerocopy' or 'auto'")
        for label, n in (("rx_size", rx_size), ("tx_size", tx_size)):
            if n and not _is_pow2(n):
                raise ValueError(f"{label} {n} must be a power of two (or 0 for no ring)")
        for label, n in (("fill_size", fill_size), ("comp_size", comp_size)):
            if not _is_pow2(n):
                raise ValueError(f"{label} {n} must be a power of two")
        if not rx_size and not tx_size:
            raise ValueError("an AF_XDP socket needs an RX or a TX ring")
        if umem is not None and umem.owner_fd != -1 and share is None:
            raise XskError(errno.EBUSY, "this Umem is already registered by another XskSocket: "
                           "give this one its own Umem, or share=that socket (XDP_SHARED_UMEM)")
        # Resolved in the calling thread's network namespace, like the socket itself.
        self.ifindex = ifname if isinstance(ifname, int) else socket.if_nametoindex(ifname)
        self.ifname = ifname if isinstance(ifname, str) else socket.if_indextoname(ifname)
        self.queue_id = queue_id
        self.need_wakeup = need_wakeup
        self.sg = sg
        #: multi-buffer RX: [packets dropped as too long for a slot, packets reassembled]
        self.sg_stats = np.zeros(2, np.int64)
        self.bind_flags = 0
        self.zerocopy = False
        self.fd = -1
        self.rx = self.tx = self.fill = self.comp = None
        self.closed = False
        self.share = share
        self._own_umem = umem is None
        self.umem = umem if umem is not None else (Umem(slot_frames=2) if sg else Umem())
        if sg and self.umem.slot <= self.umem.frame_size:
            raise ValueError("sg=True needs a Umem with slot_frames > 1 (frames span adjacent chunks)")
        try:
            self._setup(rx_size, tx_size, fill_size, comp_size, mode, prefill)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ set-up steps
    def _setup(self, rx_size, tx_size, fill_size, comp_size, mode, prefill):
        fd = _libc.socket(uapi.AF_XDP, socket.SOCK_RAW | socket.SOCK_CLOEXEC, 0)
        if fd < 0:
            _raise("socket()", "needs root/CAP_NET_RAW and a kernel with CONFIG_XDP_SOCKETS")
        self.fd = fd
        u = self.umem
        if self.share is None:
            reg = uapi.xdp_umem_reg(addr=u.addr, len=u.size, chunk_size=u.frame_size, headroom=u.headroom)
            if _setsockopt(fd, uapi.XDP_UMEM_REG, reg) != 0:
                if (ctypes.get_errno() != errno.EINVAL
                        or _setsockopt(fd, uapi.XDP_UMEM_REG, reg, uapi.XDP_UMEM_REG_V1_SIZE) != 0):
                    _raise("XDP_UMEM_REG", "chunk size must be 2048 or 4096, area page aligned, "
                           "RLIMIT_MEMLOCK large enough")
            u.owner_fd = fd
        sizes = ((uapi.XDP_UMEM_FILL_RING, fill_size), (uapi.XDP_UMEM_COMPLETION_RING, comp_size),
                 (uapi.XDP_RX_RING, rx_size), (uapi.XDP_TX_RING, tx_size))
        for opt, n in sizes:
            if n and _setsockopt(fd, opt, ctypes.c_int(n)) != 0:
                _raise(f"ring size option {opt} = {n}")
        off = uapi.xdp_mmap_offsets()
        if _getsockopt(fd, uapi.XDP_MMAP_OFFSETS, off) != ctypes.sizeof(off):
            _raise("getsockopt(XDP_MMAP_OFFSETS)", "kernel older than 5.4 lacks the flags word")
        self.fill = _map_ring(fd, "fill", off.fr, fill_size, uapi.XDP_UMEM_PGOFF_FILL_RING, False)
        self.comp = _map_ring(fd, "completion", off.cr, comp_size, uapi.XDP_UMEM_PGOFF_COMPLETION_RING, False)
        if rx_size:
            self.rx = _map_ring(fd, "rx", off.rx, rx_size, uapi.XDP_PGOFF_RX_RING, True)
        if tx_size:
            self.tx = _map_ring(fd, "tx", off.tx, tx_size, uapi.XDP_PGOFF_TX_RING, True)
        self._bind(mode)
        opts = uapi.xdp_options()
        self.zerocopy = (_getsockopt(fd, uapi.XDP_OPTIONS, opts) > 0
                         and bool(opts.flags & uapi.XDP_OPTIONS_ZEROCOPY))
        if prefill is None:
            prefill = min(fill_size, u.pool.nframes // 2) if rx_size else 0     # pool: chunks or slots
        if prefill:
            self.refill(prefill)

    def _bind(self, mode: str) -> None:
        if self.share is not None:
            sa = uapi.sockaddr_xdp(sxdp_family=uapi.AF_XDP, sxdp_flags=uapi.XDP_SHARED_UMEM,
                                   sxdp_ifindex=self.ifindex, sxdp_queue_id=self.queue_id,
                                   sxdp_shared_umem_fd=self.share.fileno())
            if _libc.bind(self.fd, ctypes.byref(sa), ctypes.sizeof(sa)) == 0:
                self.bind_flags = self.share.bind_flags
                return
            _raise(f"bind({self.ifname} queue {self.queue_id}, sharing the Umem of fd {self.share.fileno()})",
                   "EBUSY: another socket owns this queue; EINVAL: queue id beyond the device's channels, "
                   "or a kernel older than 5.10 (no shared Umem across queues)")
        wake = uapi.XDP_USE_NEED_WAKEUP if self.need_wakeup else 0
        if self.sg:
            wake |= uapi.XDP_USE_SG
        tries = {"copy": [uapi.XDP_COPY], "zerocopy": [uapi.XDP_ZEROCOPY],
                 "auto": [uapi.XDP_ZEROCOPY, uapi.XDP_COPY]}[mode]
        for flag in tries:
            sa = uapi.sockaddr_xdp(sxdp_family=uapi.AF_XDP, sxdp_flags=flag | wake,
                                   sxdp_ifindex=self.ifindex, sxdp_queue_id=self.queue_id)
            if _libc.bind(self.fd, ctypes.byref(sa), ctypes.sizeof(sa)) == 0:
                self.bind_flags = flag | wake
                return
        _raise(f"bind({self.ifname} queue {self.queue_id}, {mode})",
               "EBUSY: another socket owns this queue; EOPNOTSUPP: no zero-copy in this driver, "
               "use mode='copy'; EINVAL: queue id beyond the device's channels"
               + ("; EOPNOTSUPP with XDP_USE_SG: no multi-buffer AF_XDP in this kernel/driver" if self.sg else ""))

    # ------------------------------------------------------------------ data path (Python)
    # Engine code calls rings.* on self.rx/tx/fill/comp arrays from its own jitted loops;
    # these wrappers are for control code and tests.

    def fileno(self) -> int:
        return self.fd

    def refill(self, max_n: int | None = None) -> int:
        """Move free frames from the UMEM pool to the fill ring; return count."""
        f, p = self.fill, self.umem.pool
        n = rings.fill_ring_refill(f.producer, f.consumer, f.addrs, p.stack, p.top,
                                   f.size if max_n is None else max_n)
        return int(n)

    def rx_burst(self, max_n: int = 64) -> tuple[np.ndarray, np.ndarray]:
        """Received frames as (addrs, lens) arrays; the caller owns the frames until it
        returns them with umem.pool.free() (and refill())."""
        addrs = np.empty(max_n, np.uint64)
        lens = np.empty(max_n, np.uint32)
        r = self.rx
        if self.sg:
            p = self.umem.pool
            n = rings.rx_burst_sg(r.producer, r.consumer, r.descs, self.umem.frames, addrs, lens, p.stack, p.top,
                                  p.frame_mask, self.sg_stats, max_n)
        else:
            n = rings.rx_burst(r.producer, r.consumer, r.descs, addrs, lens, max_n)
        return addrs[:n], lens[:n]

    def tx_burst(self, addrs, lens, kick: bool = True) -> int:
        """Queue frames for transmission; return count queued (may be fewer: ring full).

        Queued frames come back through the completion ring: call reap()."""
        addrs = np.ascontiguousarray(addrs, dtype=np.uint64)
        lens = np.ascontiguousarray(lens, dtype=np.uint32)
        t = self.tx
        if self.sg:
            n = int(rings.tx_burst_sg(t.producer, t.consumer, t.descs, addrs, lens, addrs.shape[0],
                                      self.umem.frame_size))
        else:
            n = int(rings.tx_burst(t.producer, t.consumer, t.descs, addrs, lens, addrs.shape[0]))
        if kick and n:
            self.kick_tx()
        return n

    def reap(self, max_n: int | None = None) -> int:
        """Return completed TX frames to the UMEM pool; return count (completion entries:
        with sg, a chained frame's descriptors count one each)."""
        c, p = self.comp, self.umem.pool
        if self.umem.slot != self.umem.frame_size:
            return int(rings.comp_reap_sg(c.producer, c.consumer, c.addrs, p.stack, p.top, p.frame_mask,
                                          self.umem.frame_size, c.size if max_n is None else max_n))
        return int(rings.comp_reap(c.producer, c.consumer, c.addrs, p.stack, p.top,
                                   p.frame_mask, c.size if max_n is None else max_n))

    def kick_tx(self, force: bool = False) -> bool:
        """sendto(fd, NULL, 0, MSG_DONTWAIT) if the TX ring asks for it (or need_wakeup is
        off, or force).  Returns whether a syscall was made.  In copy mode one kick sends
        at most a budget of descriptors (32 by default), so loop kick/reap while the TX
        ring is not empty."""
        if not (force or not self.need_wakeup or self.tx.needs_wakeup()):
            return False
        if _libc.sendto(self.fd, None, 0, MSG_DONTWAIT, None, 0) < 0:
            e = ctypes.get_errno()
            if e not in _KICK_TRANSIENT:
                _raise("sendto() TX kick")
        return True

    def wake_rx(self) -> bool:
        """recvfrom(fd, NULL, 0, MSG_DONTWAIT) if the fill ring asks for it: lets a sleeping
        driver see new fill entries (zero-copy drivers; copy mode never needs it)."""
        if self.need_wakeup and not self.fill.needs_wakeup():
            return False
        if _libc.recvfrom(self.fd, None, 0, MSG_DONTWAIT, None, None) < 0:
            e = ctypes.get_errno()
            if e not in _KICK_TRANSIENT:
                _raise("recvfrom() RX wakeup")
        return True

    def poll(self, timeout_ms: int, events: int = select.POLLIN) -> int:
        """poll() on the socket: POLLIN when RX has entries, POLLOUT when TX has room.
        Returns the events that fired (0 on timeout).  The kernel's poll also drives the
        device: it wakes a sleeping zero-copy driver, and in copy mode sends pending TX."""
        p = select.poll()
        p.register(self.fd, events)
        ready = p.poll(timeout_ms)
        return ready[0][1] if ready else 0

    def statistics(self) -> dict[str, int]:
        """The kernel's XDP_STATISTICS counters (drops, invalid descriptors, ring full ...)."""
        st = uapi.xdp_statistics()
        n = _getsockopt(self.fd, uapi.XDP_STATISTICS, st)
        if n < 0:
            _raise("getsockopt(XDP_STATISTICS)")
        # Older kernels return only the first three counters; report what was written.
        out = {}
        for name, _ in uapi.xdp_statistics._fields_:
            if getattr(uapi.xdp_statistics, name).offset + 8 <= n:
                out[name] = int(getattr(st, name))
        return out

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Unmap every ring, close the fd, and close the Umem if this socket created it.
        Idempotent; also safe after a failed constructor.  Once the fd and all mappings are
        gone the kernel releases the socket and removes it from every XSKMAP."""
        if self.closed:
            return
        self.closed = True
        for name in ("rx", "tx", "fill", "comp"):
            ring = getattr(self, name)
            if ring is not None:
                ring.unmap()
                setattr(self, name, None)
        if self.fd >= 0:
            if self.umem.owner_fd == self.fd:
                self.umem.owner_fd = -1
            os.close(self.fd)
            self.fd = -1
        if self._own_umem:
            self.umem.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # Best effort only: the fd must not leak if a test forgets close().
        if not getattr(self, "closed", True):
            self.close()

    def __repr__(self):
        state = "closed" if self.closed else f"fd={self.fd}"
        return f"<XskSocket {self.ifname}:{self.queue_id} {state}>"


def xskmap_set(table, key: int, xsk: XskSocket) -> None:
    """Point entry `key` (normally the queue id) of a BCC XSKMAP table at this socket."""
    table[ctypes.c_int(key)] = ctypes.c_int(xsk.fileno())
