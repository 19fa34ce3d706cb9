"""The lower tester (spec 9.1): raw frames out, every frame of the link captured.

Two AF_PACKET sockets on the tester's interface: one sends, one captures
(ETH_P_ALL, kernel receive timestamps, MR-CONF-011) in a thread.  The capture
socket sees both directions: frames the IUT sends (incoming) and the frames
this tester sent (outgoing, since they come from the other socket).  A test
case's frames are numbered from 1 in capture order (MR-CONF-008) between
begin_case() and end_case(), and written to a pcap with microsecond stamps.
"""
from __future__ import annotations

import fcntl
import socket
import struct
import termios
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .packets import RoceView, parse

ETH_P_ALL = 0x0003
SO_TIMESTAMPNS = 35
PACKET_OUTGOING = 4


@dataclass
class Frame:
    """One captured frame: number in its test case's capture, kernel time stamp, direction, bytes."""
    num: int
    ts: float
    outgoing: bool                         # sent by the tester (LT -> IUT)
    data: bytes
    _view: object = field(default=None, repr=False)
    _parsed: bool = field(default=False, repr=False)

    @property
    def roce(self) -> RoceView | None:
        if not self._parsed:
            self._view = parse(self.data)
            self._parsed = True
        return self._view

    def summary(self) -> str:
        d = "LT>IUT" if self.outgoing else "IUT>LT"
        v = self.roce
        return f"#{self.num} {d} " + (v.summary() if v is not None else f"non-RoCE frame, {len(self.data)} B")


class LowerTester:
    """Send and capture raw Ethernet frames on one interface (in the caller's network namespace)."""

    def __init__(self, ifname: str, snaplen: int = 65535) -> None:
        self.ifname = ifname
        self.snaplen = snaplen
        # protocol 0: the sending socket receives nothing (the capture socket sees what it sends)
        self.tx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
        self.tx.bind((ifname, 0))
        self.rx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self.rx.bind((ifname, ETH_P_ALL))
        self.rx.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self.rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.rx.settimeout(0.05)
        self.mac = ":".join(f"{b:02x}" for b in self.rx.getsockname()[4][:6])
        self._cv = threading.Condition()
        self._frames: list[Frame] = []
        self._base = 0                     # index of the current case's first frame
        self._stop = False
        self._got = self._stored = 0       # frames the capture thread received / stored (settle)
        self._thread = threading.Thread(target=self._capture, name="lt-capture", daemon=True)
        self._thread.start()

    # -- capture ---------------------------------------------------------------------------
    def _capture(self) -> None:
        while not self._stop:
            try:
                data, anc, _flags, addr = self.rx.recvmsg(self.snaplen, 64)
            except socket.timeout:
                continue
            except OSError:
                if self._stop:
                    return
                raise
            self._got += 1                  # received, not yet stored (settle waits for it)
            ts = time.time()
            for level, typ, val in anc:
                if level == socket.SOL_SOCKET and typ == SO_TIMESTAMPNS and len(val) >= 16:
                    sec, nsec = struct.unpack("qq", val[:16])
                    ts = sec + nsec / 1e9
            outgoing = addr[2] == PACKET_OUTGOING
            with self._cv:
                f = Frame(len(self._frames) - self._base + 1, ts, outgoing, data)
                self._frames.append(f)
                self._stored += 1
                self._cv.notify_all()

    def begin_case(self) -> None:
        """Frames from now on belong to a new test case, numbered from 1."""
        with self._cv:
            self._base = len(self._frames)

    def case_frames(self) -> list[Frame]:
        with self._cv:
            return list(self._frames[self._base:])

    def end_case(self, settle: float = 0.02) -> list[Frame]:
        """The current case's frames (after a short settle so the last ones are in); the store is trimmed."""
        time.sleep(settle)
        with self._cv:
            frames = list(self._frames[self._base:])
            self._frames = []
            self._base = 0
        return frames

    # -- send ------------------------------------------------------------------------------
    def send(self, *frames: bytes) -> None:
        for f in frames:
            self.tx.send(f)

    # -- wait and collect ------------------------------------------------------------------
    def wait(self, match: Callable[[Frame], bool], timeout: float, after: int = 0) -> Frame | None:
        """The first frame of this case numbered above `after` that matches, waiting up to timeout s."""
        deadline = time.monotonic() + timeout
        seen = after
        with self._cv:
            while True:
                frames = self._frames[self._base + seen:]
                for f in frames:
                    seen = f.num
                    if match(f):
                        return f
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(min(left, 0.05))

    def collect(self, match: Callable[[Frame], bool], duration: float, after: int = 0,
                until: Callable[[list[Frame]], bool] | None = None) -> list[Frame]:
        """Every matching frame of this case numbered above `after`, over `duration` seconds
        (or until `until(frames)` holds)."""
        if duration <= 0:
            self.settle()          # "captured so far": first everything the socket holds already
        deadline = time.monotonic() + duration
        out: list[Frame] = []
        seen = after
        with self._cv:
            while True:
                for f in self._frames[self._base + seen:]:
                    seen = f.num
                    if match(f):
                        out.append(f)
                if until is not None and until(out):
                    return out
                left = deadline - time.monotonic()
                if left <= 0:
                    return out
                self._cv.wait(min(left, 0.05))

    def settle(self, bound: float = 1.0) -> None:
        """Wait until the capture thread has stored every frame already queued on its socket.  A frame the
        IUT sent before a completion it reported can still sit in the socket (or in the thread, waiting for
        the GIL an in-process IUT holds) when the completion arrives through the agent: a count of "what was
        sent" read then came up short (TC-RETRY-005-a saw [2, 2, 1] transmissions of 9 on the wire).
        Done when the socket is empty and every frame the thread received is stored (at once, in the common
        case: timing cases read the capture between the IUT's packets)."""
        deadline = time.monotonic() + bound
        buf = bytearray(4)
        while True:
            fcntl.ioctl(self.rx.fileno(), termios.FIONREAD, buf)
            if int.from_bytes(buf, "little") == 0 and self._got == self._stored:
                return                      # nothing queued, nothing received and not yet stored
            if time.monotonic() >= deadline:
                return
            time.sleep(0.0002)

    def last_num(self) -> int:
        with self._cv:
            return len(self._frames) - self._base

    # -- pcap --------------------------------------------------------------------------------
    @staticmethod
    def write_pcap(path, frames: list[Frame]) -> None:
        """Classic pcap, Ethernet link type, microsecond stamps (MR-CONF-008)."""
        from scapy.utils import RawPcapWriter
        w = RawPcapWriter(str(path), linktype=1, sync=False)
        try:
            w._write_header(None)
            for f in frames:
                sec = int(f.ts)
                w.write_packet(f.data, sec=sec, usec=int(round((f.ts - sec) * 1e6)) % 1000000)
        finally:
            w.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=1)
        for s in (self.tx, self.rx):
            try:
                s.close()
            except OSError:
                pass

    def __enter__(self) -> "LowerTester":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Frame", "LowerTester"]
