"""perftest's out-of-band exchange (its TCP "Ethernet" data exchange method), so that `metaroce perf` and
Debian's perftest (ib_write_bw, ib_read_bw, ib_send_bw, ib_write_lat; 4.5+0.17) can face each other.

What perftest sends, in lockstep over one TCP connection (the client writes a message, the server reads
it and answers with its own of the same size; perftest_communication.c of perftest 4.5-0.17):

    M1  version     16 bytes: "6.06" and NULs; a peer older than 5.70 is refused
    M2  sys data    4 + 4 bytes: page size and cache line size, big-endian (each side keeps the larger)
    M3  MTU         2 bytes: enum ibv_mtu as one ASCII digit and a NUL (each side keeps the smaller)
    M4  key         108 bytes: "%04x:%04x:%06x:%06x:%08x:%016x:" lid, out_reads, qpn, psn, rkey, vaddr,
                    then the 16 GID bytes each "%02x:", then "%08x:" srqn, then a NUL
    M5  reports     5 x 8 bytes: size, iterations (big-endian integers), peak, average bandwidth and
                    message rate (big-endian doubles) -- bw tests, after the run
    done            5 bytes "done\\0", after a last key exchange; nobody reads them

The order of key exchanges (rounds) per test is in ROUNDS_*; the test's parameters (-s, -n, -q, -a) are
never exchanged, so both sides must be given the same ones (perftest's own rule).  Every byte read
here is the peer's: a message that does not parse is refused with PerftestError naming it."""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from .. import cm

VERSION = b"6.06"
MIN_VERSION = 5.70
VERSION_LEN = 16
KEY_LEN = 108
REPORT_LEN = 8
DONE = b"done\0"
PAGE_SIZE = 4096
CACHE_LINE = 64
MAX_PAGE = 1 << 20                  # 64 KiB pages exist (ppc64, arm64); nothing sends more
MAX_CACHE_LINE = 4096
# enum ibv_mtu
MTU_ENUM = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}
ENUM_MTU = {v: k for k, v in MTU_ENUM.items()}
KEY_FMT = "{:04x}:{:04x}:{:06x}:{:06x}:{:08x}:{:016x}:" + "{:02x}:" * 16 + "{:08x}:"
_KEY_RE = re.compile(rb"([0-9a-f]{4}):([0-9a-f]{4}):([0-9a-f]{6}):([0-9a-f]{6}):([0-9a-f]{8}):([0-9a-f]{16}):"
                     + rb"([0-9a-f]{2}):" * 16 + rb"([0-9a-f]{8}):\0")


class PerftestError(cm.CMError):
    """The perftest peer sent what perftest does not send, or left."""


@dataclass(frozen=True)
class Key:
    """One QP's key message (struct pingpong_dest of perftest)."""
    qpn: int
    psn: int
    rkey: int
    vaddr: int
    gid: bytes
    out_reads: int = 1
    lid: int = 0
    srqn: int = 0

    def encode(self) -> bytes:
        if len(self.gid) != 16:
            raise ValueError("a GID is 16 bytes")
        text = KEY_FMT.format(self.lid & 0xFFFF, self.out_reads & 0xFFFF, self.qpn & 0xFFFFFF, self.psn & 0xFFFFFF,
                              self.rkey & 0xFFFFFFFF, self.vaddr & 0xFFFFFFFFFFFFFFFF, *self.gid,
                              self.srqn & 0xFFFFFFFF)
        b = text.encode() + b"\0"
        assert len(b) == KEY_LEN
        return b

    @classmethod
    def decode(cls, b: bytes) -> "Key":
        m = _KEY_RE.fullmatch(bytes(b))
        if m is None:
            raise PerftestError(f"not a perftest key message (108 bytes of hex fields): {bytes(b)[:40]!r}...")
        g = [int(x, 16) for x in m.groups()]
        return cls(lid=g[0], out_reads=g[1], qpn=g[2], psn=g[3], rkey=g[4], vaddr=g[5], gid=bytes(g[6:22]),
                   srqn=g[22])


def version_ok(b: bytes) -> float:
    """The peer's version (the leading decimal of its 16 bytes, as atof reads it); PerftestError if below 5.70."""
    m = re.match(rb"\s*([0-9]+(?:\.[0-9]*)?)", bytes(b))
    v = float(m.group(1)) if m else 0.0
    if v < MIN_VERSION:
        text = bytes(b).split(b"\0")[0][:16]
        raise PerftestError(f"the peer's perftest version {text!r} is older than 5.70 (or this is not perftest)")
    return v


def _pow2(b: bytes, most: int, what: str) -> int:
    """The peer's page or cache-line size: a power of two up to `most` (our buffers are sized from the
    larger page: a hostile value must not make us allocate gigabytes)."""
    v = struct.unpack(">I", b)[0]
    if v == 0 or v & (v - 1) or v > most:
        raise PerftestError(f"the peer's {what} {v} is not a power of two up to {most}")
    return v


def looks_like_perftest(first: bytes) -> bool:
    """The first bytes a client sent: perftest's version string ("6.06...") rather than our CM message."""
    return bool(re.match(rb"[0-9]\.[0-9]", bytes(first[:3]))) and not bytes(first).startswith(cm.MAGIC)


class Exchange:
    """The lockstep exchange over a connected cm.Channel, as `role` ("client" writes first)."""

    def __init__(self, ch: cm.Channel, client: bool, timeout: float) -> None:
        self.ch, self.client, self.timeout = ch, client, timeout

    def xchg(self, mine: bytes, n: int | None = None) -> bytes:
        n = len(mine) if n is None else n
        try:
            if self.client:
                self.ch.send(mine)
                return self.ch.recv_exact(n, self.timeout)
            theirs = self.ch.recv_exact(n, self.timeout)
            self.ch.send(mine)
            return theirs
        except cm.PeerClosed:
            raise PerftestError(f"the perftest peer ({self.ch.peer}) closed the connection") from None

    def hello(self, mtu: int) -> tuple[int, int, int]:
        """M1-M3: (page size, cache line, agreed MTU in bytes)."""
        version_ok(self.xchg(VERSION.ljust(VERSION_LEN, b"\0")))
        page = max(PAGE_SIZE, _pow2(self.xchg(struct.pack(">I", PAGE_SIZE)), MAX_PAGE, "page size"))
        line = max(CACHE_LINE, _pow2(self.xchg(struct.pack(">I", CACHE_LINE)), MAX_CACHE_LINE, "cache line size"))
        theirs = self.xchg(str(MTU_ENUM[mtu]).encode() + b"\0")
        if len(theirs) != 2 or theirs[1:] != b"\0" or not theirs[:1].isdigit() or int(theirs[:1]) not in ENUM_MTU:
            raise PerftestError(f"not a perftest MTU message: {theirs!r}")
        return page, line, min(mtu, ENUM_MTU[int(theirs[:1])])

    def key(self, mine: Key) -> Key:
        return Key.decode(self.xchg(mine.encode()))

    def reports(self, size: int, iters: int, peak: float, avg: float, rate: float) -> tuple:
        """M5 (bw tests): ours out, theirs in -- (size, iterations, peak, average, message rate)."""
        out = []
        for fmt, v in ((">Q", size), (">Q", iters), (">d", peak), (">d", avg), (">d", rate)):
            out.append(struct.unpack(fmt, self.xchg(struct.pack(fmt, v)))[0])
        return tuple(out)

    def close(self, last: Key) -> None:
        """perftest's ctx_close_connection: one more key exchange, then "done" each way (not read back by
        perftest; we read what comes, if anything, so that closing does not reset the connection)."""
        self.key(last)
        try:
            self.ch.send(DONE)
            self.ch.recv_some(len(DONE), 2.0)
        except cm.CMError:
            pass


__all__ = ["Exchange", "Key", "PerftestError", "looks_like_perftest", "version_ok", "MTU_ENUM", "PAGE_SIZE"]
