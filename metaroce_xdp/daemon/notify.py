"""The systemd notification protocol (sd_notify(3)) without libsystemd.

A service of `Type=notify` tells the service manager how it is doing by sending datagrams of
newline-separated `KEY=VALUE` lines to the AF_UNIX socket named in `$NOTIFY_SOCKET`: a path, or
an abstract name written with a leading '@' (sent as a leading NUL byte).  metaroced sends

    READY=1                              start-up finished (systemd then starts the units that wait for it)
    STATUS=<one line>                    what `systemctl status metaroced` shows
    WATCHDOG=1                           alive; sent every WATCHDOG_USEC/2 when systemd asks for pings
    RELOADING=1 + MONOTONIC_USEC=<us>    a reload (SIGHUP) started; READY=1 again when it is done
    STOPPING=1                           shutdown (SIGTERM) started

Without `$NOTIFY_SOCKET` (not run by systemd) every call does nothing and returns False, so the
daemon never has to ask whether it runs under systemd.  `$WATCHDOG_PID`, when set, must name this
process for the watchdog to apply to it (sd_watchdog_enabled(3)).
"""
from __future__ import annotations

import os
import socket
import threading
import time
from typing import Mapping

__all__ = ["Notifier", "NotifyError", "watchdog_interval", "socket_address"]


class NotifyError(OSError):
    """$NOTIFY_SOCKET is set but unusable (not an AF_UNIX path or abstract name)."""


def socket_address(value: str) -> str | bytes:
    """The sendto() address of a $NOTIFY_SOCKET value: a filesystem path, or an abstract name
    ('@name' -> b'\\0name')."""
    if not value:
        raise NotifyError("NOTIFY_SOCKET is empty")
    if value[0] == "@":
        return b"\0" + value[1:].encode()
    if value[0] == "/":
        return value
    raise NotifyError(f"NOTIFY_SOCKET={value!r}: only AF_UNIX paths and '@abstract' names are supported")


def watchdog_interval(env: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings: half of $WATCHDOG_USEC, as sd_watchdog_enabled(3)
    recommends; None when systemd asks for none (unset, 0, malformed, or meant for another PID)."""
    env = os.environ if env is None else env
    usec = env.get("WATCHDOG_USEC")
    if not usec:
        return None
    try:
        us = int(usec)
    except ValueError:
        return None
    if us <= 0:
        return None
    wpid = env.get("WATCHDOG_PID")
    if wpid:
        try:
            if int(wpid) != (os.getpid() if pid is None else pid):
                return None
        except ValueError:
            return None
    return us / 2e6


class Notifier:
    """Sends sd_notify messages.  `env` defaults to os.environ; with `unset_environment` the
    NOTIFY_SOCKET/WATCHDOG_* variables are removed from os.environ after they are read, so child
    processes do not talk to systemd in the daemon's name."""

    def __init__(self, env: Mapping[str, str] | None = None, unset_environment: bool = False):
        env = dict(os.environ if env is None else env)
        value = env.get("NOTIFY_SOCKET")
        self.address = socket_address(value) if value else None
        self.interval = watchdog_interval(env)
        self._last_ping = 0.0
        self._last_status: str | None = None
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.dropped = 0                       # messages not sent (manager's queue full or gone)
        if unset_environment:
            for k in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                os.environ.pop(k, None)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, **fields: object) -> bool:
        """Send one message of KEY=VALUE lines (keyword names are the keys).  True when sent."""
        return self.send("\n".join(f"{k}={v}" for k, v in fields.items()))

    def send(self, message: str) -> bool:
        if self.address is None:
            return False
        data = message.encode()
        with self._lock:
            # Non-blocking: a manager that does not read (its queue holds net.unix.max_dgram_qlen
            # datagrams) must never stall the daemon's control loop; that message is dropped instead.
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
            try:
                self._sock.sendto(data, self.address)
            except BlockingIOError:
                self.dropped += 1
                return False
            except OSError:
                # The manager went away or the socket was replaced: one fresh try, then give up (a
                # lost notification must never take the daemon down).
                self._sock.close()
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
                try:
                    self._sock.sendto(data, self.address)
                except OSError:
                    self.dropped += 1
                    return False
        return True

    @staticmethod
    def _one_line(text: str) -> str:
        return " ".join(str(text).split("\n"))

    def ready(self, status: str | None = None) -> bool:
        if status is not None:
            self._last_status = self._one_line(status)
            return self.send(f"READY=1\nSTATUS={self._last_status}")
        return self.send("READY=1")

    def status(self, text: str, force: bool = False) -> bool:
        """STATUS=text; not resent when it equals the last one (unless force)."""
        text = self._one_line(text)
        if text == self._last_status and not force:
            return False
        self._last_status = text
        return self.send(f"STATUS={text}")

    def reloading(self, status: str | None = None) -> bool:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        msg = f"RELOADING=1\nMONOTONIC_USEC={usec}"
        if status is not None:
            self._last_status = self._one_line(status)
            msg += f"\nSTATUS={self._last_status}"
        return self.send(msg)

    def stopping(self, status: str | None = None) -> bool:
        msg = "STOPPING=1"
        if status is not None:
            self._last_status = self._one_line(status)
            msg += f"\nSTATUS={self._last_status}"
        return self.send(msg)

    def watchdog(self) -> bool:
        self._last_ping = time.monotonic()
        return self.send("WATCHDOG=1")

    def watchdog_due(self, now: float | None = None) -> bool:
        """True when a WATCHDOG=1 ping is due (the watchdog is on and half its period has passed)."""
        if self.interval is None or self.address is None:
            return False
        now = time.monotonic() if now is None else now
        return now - self._last_ping >= self.interval

    def ping_if_due(self) -> bool:
        return self.watchdog() if self.watchdog_due() else False

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
