"""Which engine a tool (`metaroce pingpong`, `metaroce perf`, the demo) runs on: metaroced when one serves
the interface, the tool's own in-process engine otherwise.

"A daemon serves the interface" means: the control socket (`--socket`, else $METAROCE_SOCKET, else
socket_path of /etc/metaroce/metaroced.toml, else /run/metaroce/metaroced.sock) answers one `status`
request within a second, its devices include the interface, and the daemon runs in this network
namespace (interface names are per namespace; the socket path is not).  Anything else -- no socket,
nobody listening, no answer, another interface, another namespace -- means the tool's own engine, and
the reason is printed.  `--no-daemon` skips the question.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

ASK_TIMEOUT_S = 1.0


@dataclass
class Choice:
    socket: str | None            # the daemon's control socket, or None: the in-process engine
    why: str                      # one line: which engine and why

    @property
    def daemon(self) -> bool:
        return self.socket is not None


def _same_netns(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return True               # not visible from here (another PID namespace): trust the socket


def choose(ifname: str, socket_path: str | None = None, no_daemon: bool = False) -> Choice:
    if no_daemon:
        return Choice(None, "in-process engine (--no-daemon)")
    from metaroce_xdp.daemon import status as st

    from .daemon_cli import default_socket
    path = socket_path or default_socket()
    try:
        snap = st.query_status(path, ASK_TIMEOUT_S)
    except st.DaemonNotRunning:
        return Choice(None, f"in-process engine (no metaroced on {path})")
    except st.StatusError as e:
        return Choice(None, f"in-process engine ({e})")
    pid = (snap.get("daemon") or {}).get("pid")
    names = [d.get("ifname") for d in snap.get("devices", [])]
    if ifname not in names:
        return Choice(None, f"in-process engine (metaroced on {path} serves {', '.join(map(str, names)) or 'nothing'}, "
                            f"not {ifname})")
    if pid and not _same_netns(int(pid)):
        return Choice(None, f"in-process engine (metaroced on {path} serves an {ifname} of another network namespace)")
    return Choice(path, f"metaroced (pid {pid}) on {path}")


def open_daemon_context(choice: Choice, ifname: str) -> Any:
    from metaroce_xdp.daemon import client
    return client.connect(choice.socket, ifname)


def say(tool: str, choice: Choice) -> None:
    print(f"{tool}: engine: {choice.why}", file=sys.stderr, flush=True)


class DaemonEngine:
    """What the tools' loops use of an in-process engine (`progress()`, `stats`, `local_mac`, `max_pmtu`), for a
    client of metaroced: the daemon makes progress by itself, so progress() only yields the CPU to it (on a
    host with few cores the daemon's threads need it to deliver what this process waits for); `stats` are the
    device's counters through the daemon's `stats` op (a control round trip: the loops read it rarely)."""

    threaded = True

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.local_mac, self.max_pmtu = ctx.local_mac, ctx.max_pmtu

    def progress(self) -> int:
        os.sched_yield()
        return 0

    @property
    def stats(self) -> dict:
        return self.ctx.stats()
