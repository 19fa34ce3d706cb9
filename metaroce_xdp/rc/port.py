"""Packet I/O for the engine.

A port hands out TX slots (a buffer and an offset where one frame may be
built), takes them back with the frame's length, and yields received frames
as uint8 views that stay valid until `rx_done()`.  `XskPort` (engine.py's
neighbour, in xskport.py) does this over AF_XDP; `LoopPort.pair()` joins two
engines in one process, with seeded faults, for tests of the transport logic.
"""
from __future__ import annotations

import random
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass
class Faults:
    """Seeded impairments for LoopPort (the veth tests use bpf/fault_inject.c instead)."""
    seed: int = 1
    drop: float = 0.0
    dup: float = 0.0
    corrupt: float = 0.0
    reorder: float = 0.0      # probability a frame is held back and sent after the next one
    ce: float = 0.0           # probability an ECN-capable frame is marked CE, as a congested switch does


def mark_ce(frame: bytes) -> bytes:
    """ECN CE on an ECT IPv4/IPv6 frame, the IPv4 header checksum recomputed (RFC 3168; the ICRC
    masks both, MR-ICRC-004).  Not-ECT frames are returned unchanged."""
    b = bytearray(frame)
    l3 = 18 if b[12:14] == b"\x81\x00" else 14
    if b[l3] >> 4 == 4:
        if b[l3 + 1] & 3 == 0:
            return frame
        b[l3 + 1] |= 3
        b[l3 + 10:l3 + 12] = b"\0\0"
        s = sum(int.from_bytes(b[i:i + 2], "big") for i in range(l3, l3 + 20, 2))
        while s >> 16:
            s = (s & 0xFFFF) + (s >> 16)
        b[l3 + 10:l3 + 12] = (~s & 0xFFFF).to_bytes(2, "big")
    else:
        if (b[l3 + 1] >> 4) & 3 == 0:
            return frame
        b[l3 + 1] |= 0x30
    return bytes(b)


class LoopPort:
    frame_size = 4096 + 128
    BATCH = 64

    def __init__(self, name: str, faults: Faults | None = None) -> None:
        self.name = name
        self.peer: LoopPort | None = None
        self.inbox: deque[bytes] = deque()
        self.faults = faults or Faults(drop=0)
        self.rng = random.Random(self.faults.seed)
        self.held: bytes | None = None
        self._scratch = self._scratch0 = np.zeros(self.frame_size, np.uint8)
        self._tx_umem = np.zeros(self.BATCH * self.frame_size, np.uint8)
        self._rx_umem = np.zeros(self.BATCH * self.frame_size, np.uint8)
        self._addrs = np.arange(self.BATCH, dtype=np.uint64) * np.uint64(self.frame_size)
        self._rx_lens = np.zeros(self.BATCH, np.uint32)
        self._rx_cur: list[np.ndarray] = []
        self.event = threading.Event()
        self.tx_frames = 0
        self.max_pmtu = 4096
        self.mac = "02:00:00:00:00:01"
        self.ip = "10.55.0.1"
        self.closed = False

    @classmethod
    def pair(cls, faults_ab: Faults | None = None, faults_ba: Faults | None = None) -> tuple["LoopPort", "LoopPort"]:
        a, b = cls("a", faults_ab), cls("b", faults_ba)
        a.peer, b.peer = b, a
        a.mac, b.mac = "02:00:00:00:00:01", "02:00:00:00:00:02"
        a.ip, b.ip = "10.55.0.1", "10.55.0.2"
        return a, b

    # -- TX --------------------------------------------------------------------
    def tx_slot(self) -> tuple[np.ndarray, int] | None:
        return self._scratch, 0

    def tx_commit(self, off: int, length: int) -> None:
        frame = bytes(self._scratch[off:off + length])
        self.tx_frames += 1
        f, rng = self.faults, self.rng
        if f.drop and rng.random() < f.drop:
            return
        if f.corrupt and rng.random() < f.corrupt:
            b = bytearray(frame)
            b[rng.randrange(42, len(b))] ^= 1 << rng.randrange(8)
            frame = bytes(b)
        if f.ce and rng.random() < f.ce:
            frame = mark_ce(frame)
        copies = 2 if (f.dup and rng.random() < f.dup) else 1
        for _ in range(copies):
            if self.held is None and f.reorder and rng.random() < f.reorder:
                self.held = frame
                continue
            self._deliver(frame)
            if self.held is not None:
                self._deliver(self.held)
                self.held = None

    def _deliver(self, frame: bytes) -> None:
        assert self.peer is not None
        self.peer.inbox.append(frame)
        self.peer.event.set()

    def flush(self) -> None:
        pass

    def idle_flush(self) -> None:
        """Release a held-back frame when nothing else is coming (so reordering never loses it)."""
        if self.held is not None:
            self._deliver(self.held)
            self.held = None

    # batched slots, the interface burst.py uses (AF_XDP-shaped: one buffer, frame addresses)
    def tx_slots(self, n: int):
        n = min(n, self.BATCH)
        return self._tx_umem, self._addrs[:n]

    def tx_commit_batch(self, addrs, lens, k: int) -> None:
        for j in range(k):
            a = int(addrs[j])
            self._scratch = self._tx_umem[a:a + self.frame_size]
            self.tx_commit(0, int(lens[j]))
        self._scratch = self._scratch0

    def rx_burst_raw(self, max_n: int):
        n = 0
        fs = self.frame_size
        while self.inbox and n < min(max_n, self.BATCH):
            f = self.inbox.popleft()
            self._rx_umem[n * fs:n * fs + len(f)] = np.frombuffer(f, np.uint8)
            self._rx_lens[n] = len(f)
            n += 1
        return self._rx_umem, self._addrs[:n], self._rx_lens[:n]

    # -- RX --------------------------------------------------------------------
    def rx_burst(self, max_n: int) -> list[np.ndarray]:
        out = []
        while self.inbox and len(out) < max_n:
            out.append(np.frombuffer(self.inbox.popleft(), dtype=np.uint8))
        return out

    def rx_done(self) -> None:
        pass

    def wait(self, timeout: float) -> None:
        self.event.wait(timeout)
        self.event.clear()

    def close(self) -> None:
        self.closed = True
