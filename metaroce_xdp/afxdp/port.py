"""One AF_XDP port of the compiled plane: the interface's addresses, a UMEM, an AF_XDP socket bound
to one RX queue, and a path resolver.  dp/context.py's Plane takes it over: the rings by address,
the frame pool's free frames into its own stack (Plane._bind_port); from then on only the compiled
loop moves frames.

Multi-buffer (path MTU 4096).  A UMEM chunk is at most 4 KiB on this kernel, and a frame with 4096
bytes of payload is ~4.2 KB.  When the interface's MTU carries a path MTU that one chunk cannot hold
(MTU >= 4178 for 4096, e.g. a veth at MTU 9000), the port binds its socket with XDP_USE_SG (`sg`)
and its UMEM pool hands out 8 KiB slots (two adjacent chunks): the loop builds each frame
contiguously in a slot and chains or joins descriptors at the chunk boundary.  On smaller MTUs
(1500) the port has no XDP_USE_SG and 4 KiB frames.  `multibuffer=None` decides from the MTU (what
dp.Context.open asks for); the default False keeps the single-buffer layout.  `max_pmtu` is what the
interface and the UMEM layout carry; QP.modify refuses larger path MTUs.

Attributes the plane reads: ifname, info, mac, ip, sg, frame_limit, max_pmtu, paths (a
netinfo.PathResolver), umem, xsk, frames, pool, ring; fileno(), close().

Neighbours: afxdp/xsk.py (socket, UMEM, rings), kern/ (the XDP program and its shared maps),
netinfo.py (addresses, MTU, next hops), dp/context.py (Context.open makes one, with a socket per RX queue).
"""
from __future__ import annotations

import errno
import logging
import os

from ..netinfo import PathResolver, iface_info
from ..verbs_types import PATH_MTUS
from .xsk import Umem, XskError, XskSocket

log = logging.getLogger("metaroce.afxdp")

# Largest header stack a data packet carries (MR-ENC-029): Ethernet + VLAN + IPv6 + UDP + BTH + the native
# NATIVE_WRITE_IMM's RETH + NETH + RSNETH + ImmDt (40 B; compat's largest, RETH + ImmDt, is 20 B) + ICRC
MAX_OVERHEAD_L2 = 14 + 4 + 40 + 8 + 12 + 40 + 4
MAX_OVERHEAD_L3 = MAX_OVERHEAD_L2 - 18


def max_path_mtu(if_mtu: int, chunk: int, slot: int | None = None) -> int:
    """Largest path MTU whose frames fit the interface's MTU and one UMEM frame of `slot`
    bytes (a chunk; with multi-buffer, a slot of adjacent chunks)."""
    best = 0
    limit = chunk if slot is None else slot
    for m in PATH_MTUS:
        if m + MAX_OVERHEAD_L3 <= if_mtu and m + MAX_OVERHEAD_L2 <= limit:
            best = m
    if not best:
        raise ValueError(f"interface MTU {if_mtu} is too small for the smallest path MTU (256)")
    return best


def queue_ring(ring: int, queues: int) -> int:
    """RX and fill ring size of each further queue's socket: the first socket's `ring` for up to 4
    queues, then smaller (a power of two, at least 256) so that the UMEM stays near 4 rings' frames."""
    if queues <= 4:
        return ring
    n = ring * 4 // queues
    size = 256
    while size * 2 <= n:
        size *= 2
    return size


class XskPort:
    def __init__(self, ifname: str, queue: int = 0, frame_size: int = 4096, nframes: int = 8192,
                 ring: int = 2048, ipv6: bool = False, multibuffer: bool | None = False, queues: int = 1) -> None:
        """multibuffer: None = XDP_USE_SG exactly when the interface's MTU carries a larger path
        MTU than one chunk holds; True forces it on; False (the default) keeps the single-buffer
        layout (4 KiB frames, one descriptor each), max_pmtu then at most 2048.
        queues > 1: sockets on RX queues queue .. queue + queues - 1, all on the first socket's UMEM
        (XDP_SHARED_UMEM), which grows by the further queues' fill rings.  The first socket (`xsk`)
        sends; every socket receives (`rx_socks`): one loop serves them all, so a QP's packets are
        handled whichever queue RSS puts them on (docs/design-dataplane.md, "Several RX queues")."""
        if queues < 1:
            raise ValueError(f"queues {queues}: at least 1")
        info = iface_info(ifname)
        self.ifname = ifname
        self.info = info
        self.mac = info.mac
        addrs = info.ipv6 if ipv6 else info.ipv4
        if not addrs:
            raise ValueError(f"{ifname} has no {'IPv6' if ipv6 else 'IPv4'} address")
        self.ip = addrs[0]
        auto = multibuffer is None
        if auto:
            multibuffer = max_path_mtu(info.mtu, frame_size, 2 * frame_size) > max_path_mtu(info.mtu, frame_size)
        #: why multi-buffer is off though the MTU would carry a larger path MTU ("" when it is not)
        self.multibuffer_off = ""
        if auto and multibuffer and os.environ.get("METAROCE_NO_MULTIBUFFER"):
            multibuffer, self.multibuffer_off = False, "METAROCE_NO_MULTIBUFFER is set"
        self.paths = PathResolver(ifname)       # next hops, looked up in this (the caller's) namespace
        self.umem = self.xsk = None
        self.rx_socks: list[XskSocket] = []
        try:
            try:
                self._open(ifname, queue, frame_size, nframes, ring, queues, bool(multibuffer))
            except XskError as e:
                # a kernel before 6.6 refuses XDP_USE_SG (EINVAL), a driver without multi-buffer AF_XDP
                # EOPNOTSUPP: the single-buffer layout then, path MTU within one chunk (never a crash)
                if not (auto and multibuffer and e.errno in (errno.EINVAL, errno.EOPNOTSUPP)):
                    raise
                self._close_sockets()
                self.multibuffer_off = (f"multi-buffer AF_XDP (XDP_USE_SG, Linux 6.6) refused on {ifname}: "
                                        f"{os.strerror(e.errno)}")
                self._open(ifname, queue, frame_size, nframes, ring, queues, False)
        except BaseException:
            self._close_sockets()
            self.paths.close()
            raise
        if self.multibuffer_off:
            log.warning("%s; path MTU at most %d on %s (its MTU %d would carry more)", self.multibuffer_off,
                        self.max_pmtu, ifname, info.mtu)
        self.queues = list(range(queue, queue + queues))
        self.frames = self.umem.frames
        self.pool = self.umem.pool
        self.ring = ring                                 # RX/TX/fill/completion ring size (frames)
        self.closed = False

    def _open(self, ifname: str, queue: int, frame_size: int, nframes: int, ring: int, queues: int,
              sg: bool) -> None:
        """The UMEM and the sockets: multi-buffer (sg: XDP_USE_SG, slots of two chunks) or not."""
        self.sg = sg
        slot_frames = 2 if sg else 1
        self.frame_limit = frame_size * slot_frames        # bytes a frame may take from its slot address
        self.max_pmtu = max_path_mtu(self.info.mtu, frame_size, self.frame_limit)
        qring = queue_ring(ring, queues)
        nframes += (queues - 1) * qring * slot_frames     # the further queues' fill rings
        self.umem = Umem(nframes, frame_size, slot_frames=slot_frames)
        self.xsk = XskSocket(ifname, queue, self.umem, rx_size=ring, tx_size=ring, fill_size=ring,
                             comp_size=ring, prefill=min(ring, (nframes // slot_frames - (queues - 1) * qring) // 2),
                             sg=sg)
        self.rx_socks.append(self.xsk)
        for q in range(queue + 1, queue + queues):
            # RX only; the completion ring is one the kernel asks for and nothing uses (no TX ring)
            self.rx_socks.append(XskSocket(ifname, q, rx_size=qring, tx_size=0, fill_size=qring,
                                           comp_size=64, prefill=qring, share=self.xsk))

    def _close_sockets(self) -> None:
        for x in reversed(self.rx_socks[1:]):
            x.close()
        if self.xsk is not None:
            self.xsk.close()
        if self.umem is not None:
            self.umem.close()
        self.rx_socks, self.xsk, self.umem = [], None, None

    def fileno(self) -> int:
        return self.xsk.fileno()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.paths.close()
        self.frames = None
        self._close_sockets()


__all__ = ["MAX_OVERHEAD_L2", "MAX_OVERHEAD_L3", "XskPort", "max_path_mtu", "queue_ring"]
