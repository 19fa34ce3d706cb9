"""Daemon processes started by the tests never outlive them.

Three layers, because earlier runs left metaroced processes spinning on the CPUs:

* `die_with_parent` (a Popen preexec_fn): PR_SET_PDEATHSIG = SIGKILL, so a daemon dies with the pytest
  process even when that process is killed outright (a timeout, SIGKILL) and no finalizer runs.  It
  survives `exec` of ip netns exec, nsenter and setpriv (none is set-uid).
* `reap(p)`: the finalizer -- SIGCONT (it may be stopped), SIGTERM (it drains and unpins), and SIGKILL to
  its whole process group if it has not exited in time.
* `leftovers()`: every process carrying this session's tag (conftest.py puts TAG_ENV in the environment,
  which children inherit) whose command line is a metaroced; conftest fails the session if any is left.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

TAG_ENV = "METAROCE_TEST_SESSION"
_PR_SET_PDEATHSIG = 1
DAEMON_MARKS = ("metaroce_xdp.daemon.server", "daemon/metaroced", "-m\0metaroce_xdp.daemon\0")


@contextlib.contextmanager
def serving(topo, ns: str, ifname: str, *, tag: str = "mrd", extra: str = ""):
    """A metaroced in namespace `ns` on `ifname`, with a bpffs of its own and a socket in a fresh temporary
    directory, loop in sleep mode; `extra`: more TOML lines.  Yields (socket path, that directory; B.log is
    its log) once it says ready; stops it (reap) and unmounts on the way out."""
    root = Path(__file__).resolve().parents[1]
    tmp = tempfile.mkdtemp(prefix=f"{tag}-")
    bpffs = os.path.join(tmp, "bpf")
    os.mkdir(bpffs)
    subprocess.run(["mount", "-t", "bpf", "bpf", bpffs], check=True)
    sock = os.path.join(tmp, "B.sock")
    conf = os.path.join(tmp, "B.toml")
    Path(conf).write_text(f'interfaces = ["{ifname}"]\nsocket_path = "{sock}"\nprogress = "sleep"\n'
                          f'bpffs_prefix = "{bpffs}/metaroce"\n{extra}')
    err = open(os.path.join(tmp, "B.log"), "a")
    d = topo.popen(ns, [sys.executable, "-m", "metaroce_xdp.daemon.server", "--config", conf],
                   stdout=subprocess.PIPE, stderr=err, text=True, cwd=str(root), preexec_fn=die_with_parent)
    try:
        line = d.stdout.readline()
        assert line and json.loads(line).get("ready"), Path(tmp, "B.log").read_text()[-2000:]
        yield sock, tmp
    finally:
        reap(d)
        err.close()
        subprocess.run(["umount", bpffs], check=False)


def die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def reap(p: subprocess.Popen, term_timeout: float = 15.0) -> None:
    if p.poll() is not None:
        return
    for sig in (signal.SIGCONT, signal.SIGTERM):
        try:
            os.kill(p.pid, sig)
        except ProcessLookupError:
            return
    try:
        p.wait(term_timeout)
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(os.getpgid(p.pid), signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.kill(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(10)


def leftovers(tag: str | None = None) -> list[tuple[int, str]]:
    """(pid, command line) of every metaroced still running that carries the tag (default: this session's)."""
    tag = tag or os.environ.get(TAG_ENV)
    if not tag:
        return []
    want = f"{TAG_ENV}={tag}".encode()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
            if not any(m.encode() in cmd for m in DAEMON_MARKS):
                continue
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{d}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue                        # a zombie: exited, not yet waited for
        except OSError:
            continue
        if want in env:
            out.append((int(d), cmd.replace(b"\0", b" ").decode(errors="replace").strip()))
    return out
