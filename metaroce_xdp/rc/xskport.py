"""An engine port over AF_XDP: the XDP program steers MetaRoCE frames of this
interface's queue into an AF_XDP socket; frames are built straight into UMEM
chunks and handed to the TX ring in batches.

Multi-buffer (path MTU 4096).  A UMEM chunk is at most 4 KiB on this kernel,
and a frame with 4096 bytes of payload is ~4.2 KB.  When the interface's MTU
carries a path MTU that one chunk cannot hold (MTU >= 4178 for 4096, e.g. a
veth at MTU 9000), the port binds its socket with XDP_USE_SG (`self.sg`) and
its UMEM pool hands out 8 KiB slots (two adjacent chunks):
  * TX: the engine still builds each frame contiguously at a slot address;
    flush() queues a frame longer than a chunk as two chained descriptors
    (rings.tx_burst_sg), and completions return the slot once (comp_reap_sg);
  * RX: a packet that arrives in several descriptors (XDP_PKT_CONTD) is
    reassembled in its first buffer's slot (rings.rx_burst_sg), so the
    engine sees one contiguous frame per packet, as before;
  * frames of one descriptor take the same path as without sg, apart from a
    flag test per descriptor.
On smaller MTUs (1500) the port is unchanged: no XDP_USE_SG, 4 KiB frames,
the single-buffer ring functions.  Multi-buffer is opt-in (multibuffer=None:
automatic, as rc.engine.Context.open asks; the default False keeps the
single-buffer layout for callers that drive the rings themselves).  `max_pmtu` is what the interface and the
UMEM layout carry; QP.modify refuses larger path MTUs.

Public API (engine, tests, metaroce_xdp/dp): tx_slot/tx_commit, tx_slots/
tx_commit_batch (frames up to `frame_limit` bytes from the slot address),
flush, rx_burst_raw/rx_burst/rx_done, max_pmtu, sg, frame_limit, stats,
sg_stats() (multi-buffer counters), fileno, wait, close.

Neighbours: afxdp/xsk.py (socket, UMEM, rings), kern/ (the XDP program and
its shared maps), netinfo.py (addresses, MTU, neighbour MACs).
"""
from __future__ import annotations

import numpy as np

from ..afxdp import rings
from ..afxdp.xsk import Umem, XskSocket
from ..netinfo import PathResolver, iface_info
from ..verbs_types import PATH_MTUS

# Largest header stack a data packet carries: Ethernet + VLAN + IPv6 + UDP + BTH + RETH + ImmDt + ICRC
MAX_OVERHEAD_L2 = 14 + 4 + 40 + 8 + 12 + 16 + 4 + 4
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


class XskPort:
    def __init__(self, ifname: str, queue: int = 0, frame_size: int = 4096, nframes: int = 8192,
                 ring: int = 2048, ipv6: bool = False, multibuffer: bool | None = False) -> None:
        """multibuffer: None = XDP_USE_SG exactly when the interface's MTU carries a larger path
        MTU than one chunk holds (what rc.engine.Context.open asks for); True forces it on.  The
        default, False, keeps the single-buffer layout (4 KiB frames, one descriptor each, a
        per-chunk pool) that code reading the rings and the pool directly expects
        (metaroce_xdp/dp until it handles XDP_PKT_CONTD); max_pmtu is then at most 2048."""
        info = iface_info(ifname)
        self.ifname = ifname
        self.info = info
        self.mac = info.mac
        addrs = info.ipv6 if ipv6 else info.ipv4
        if not addrs:
            raise ValueError(f"{ifname} has no {'IPv6' if ipv6 else 'IPv4'} address")
        self.ip = addrs[0]
        if multibuffer is None:
            multibuffer = max_path_mtu(info.mtu, frame_size, 2 * frame_size) > max_path_mtu(info.mtu, frame_size)
        self.sg = bool(multibuffer)
        slot_frames = 2 if self.sg else 1
        self.frame_limit = frame_size * slot_frames        # bytes a frame may take from its slot address
        self.max_pmtu = max_path_mtu(info.mtu, frame_size, self.frame_limit)
        self.paths = PathResolver(ifname)       # next hops, looked up in this (the caller's) namespace
        try:
            self.umem = Umem(nframes, frame_size, slot_frames=slot_frames)
            nslots = nframes // slot_frames
            self.xsk = XskSocket(ifname, queue, self.umem, rx_size=ring, tx_size=ring, fill_size=ring,
                                 comp_size=ring, prefill=min(ring, nslots // 2), sg=self.sg)
        except BaseException:
            self.paths.close()
            raise
        self.frames = self.umem.frames
        self.pool = self.umem.pool
        self._cache = np.empty(0, np.uint64)
        self._ci = 0
        self.ring = ring                                 # RX/TX/fill/completion ring size (frames)
        self.tx_addrs = np.empty(ring, np.uint64)
        self.tx_lens = np.empty(ring, np.uint32)
        self.tx_n = 0
        self._rx_addrs = None
        self._rx_a = np.empty(ring, np.uint64)           # reused by every rx_burst_raw
        self._rx_l = np.empty(ring, np.uint32)
        self.stats = {"tx_ring_full": 0, "tx_no_frame": 0}
        self.closed = False

    def resolve_mac(self, ip: str) -> str:
        """The MAC frames to ip are sent to: its route's next hop (netinfo.PathResolver)."""
        return self.paths.resolve(ip).mac

    def fileno(self) -> int:
        return self.xsk.fileno()

    # -- TX ----------------------------------------------------------------------
    def tx_slot(self):
        if self._ci >= len(self._cache):
            self.xsk.reap()
            self._cache = self.pool.alloc(64)
            self._ci = 0
            if len(self._cache) == 0:
                self.stats["tx_no_frame"] += 1
                return None
        if self.tx_n >= len(self.tx_addrs):
            self.flush()
            if self.tx_n >= len(self.tx_addrs):
                return None
        addr = int(self._cache[self._ci])
        self._ci += 1
        return self.frames, addr

    def tx_commit(self, off: int, length: int) -> None:
        self.tx_addrs[self.tx_n] = off
        self.tx_lens[self.tx_n] = length
        self.tx_n += 1
        if self.tx_n >= 64:
            self.flush()

    def flush(self) -> None:
        if self.tx_n:
            n = self.xsk.tx_burst(self.tx_addrs[:self.tx_n], self.tx_lens[:self.tx_n], kick=False)
            if n < self.tx_n:
                self.stats["tx_ring_full"] += 1
                rest = self.tx_n - n
                self.tx_addrs[:rest] = self.tx_addrs[n:self.tx_n]
                self.tx_lens[:rest] = self.tx_lens[n:self.tx_n]
                self.tx_n = rest
            else:
                self.tx_n = 0
        # Copy mode sends at most 32 descriptors per kick: kick until the kernel has
        # taken what we queued (bounded), so a burst is not left waiting for the next round.
        tx = self.xsk.tx
        for _ in range(16):
            if int(tx.producer[0]) == int(tx.consumer[0]):
                break
            if not self.xsk.kick_tx():
                break
        self.xsk.reap()

    # batched slots for burst.py
    def tx_slots(self, n: int):
        room = len(self.tx_addrs) - self.tx_n
        if room < n:
            self.flush()
            room = len(self.tx_addrs) - self.tx_n
        n = min(n, room)
        if n <= 0:
            return None
        addrs = self.pool.alloc(n)
        if len(addrs) < n:
            self.xsk.reap()
            if len(addrs) == 0:
                addrs = self.pool.alloc(n)
        if len(addrs) == 0:
            self.stats["tx_no_frame"] += 1
            return None
        return self.frames, addrs

    def tx_commit_batch(self, addrs, lens, k: int) -> None:
        if k < len(addrs):
            self.pool.free(addrs[k:])
        self.tx_addrs[self.tx_n:self.tx_n + k] = addrs[:k]
        self.tx_lens[self.tx_n:self.tx_n + k] = lens[:k]
        self.tx_n += k
        if self.tx_n >= 64:
            self.flush()

    def rx_burst_raw(self, max_n: int):
        max_n = min(max_n, len(self._rx_a))
        r = self.xsk.rx
        if self.sg:
            p = self.pool
            n = int(rings.rx_burst_sg(r.producer, r.consumer, r.descs, self.frames, self._rx_a, self._rx_l,
                                      p.stack, p.top, p.frame_mask, self.xsk.sg_stats, max_n))
        else:
            n = int(rings.rx_burst(r.producer, r.consumer, r.descs, self._rx_a, self._rx_l, max_n))
        if n == 0:
            self.xsk.wake_rx()
            return self.frames, self._rx_a[:0], self._rx_l[:0]
        self._rx_addrs = self._rx_a[:n].copy()      # freed in rx_done, after the engine is through
        return self.frames, self._rx_a[:n], self._rx_l[:n]

    # -- RX ----------------------------------------------------------------------
    def rx_burst(self, max_n: int):
        addrs, lens = self.xsk.rx_burst(max_n)
        if len(addrs) == 0:
            self.xsk.wake_rx()
            return []
        self._rx_addrs = addrs
        fr = self.frames
        return [fr[int(a):int(a) + int(n)] for a, n in zip(addrs, lens)]

    def rx_done(self) -> None:
        if self._rx_addrs is not None:
            self.pool.free(self._rx_addrs)
            self._rx_addrs = None
            self.xsk.refill()

    def sg_stats(self) -> dict[str, int]:
        """Multi-buffer counters: packets reassembled from several descriptors, and packets
        dropped because they did not fit in a slot (both 0 without sg)."""
        st = self.xsk.sg_stats
        return {"rx_sg_reassembled": int(st[1]), "rx_sg_too_long": int(st[0])}

    def wait(self, timeout: float) -> None:
        self.xsk.poll(int(timeout * 1000))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.paths.close()
        self._cache = None
        self.frames = None
        self.xsk.close()
        self.umem.close()
