"""metaroced's Linux capabilities: what it needs to start, and what it gives up once its interfaces are attached.

Start (docs/daemon.md, "The service (systemd)"; each one measured: without it start fails as said):
  CAP_BPF        maps and the program (kernel.unprivileged_bpf_disabled: every bpf() call), pins
  CAP_PERFMON    the verifier refuses the program's variable-offset packet-pointer arithmetic without it
  CAP_NET_ADMIN  the XDP link and the XSKMAP
  CAP_NET_RAW    AF_XDP sockets
  CAP_IPC_LOCK   AF_XDP UMEM registration (charged to RLIMIT_MEMLOCK otherwise: ENOBUFS)
  CAP_CHOWN      the control socket to socket_group (start, and reload when socket_group changes)

After start the daemon still reads its maps' counters and writes their configuration through bpf() (CAP_BPF:
with unprivileged bpf disabled every bpf() call needs it) and may chown the socket on reload (CAP_CHOWN); it
creates no program, link, AF_XDP socket or UMEM again (interfaces cannot change without a restart), so it
drops DROP_AFTER_START from every set.  Capabilities are per thread: drop() runs in the main thread before the
driver threads start, which inherit the smaller sets.
"""
from __future__ import annotations

import ctypes
import logging
import threading

log = logging.getLogger("metaroced")

CAP = {"chown": 0, "net_admin": 12, "net_raw": 13, "ipc_lock": 14, "sys_admin": 21, "perfmon": 38, "bpf": 39}
NEEDED_AT_START = ("bpf", "perfmon", "net_admin", "net_raw", "ipc_lock", "chown")
DROP_AFTER_START = ("perfmon", "net_admin", "net_raw", "ipc_lock")

_V3 = 0x20080522                    # _LINUX_CAPABILITY_VERSION_3: two 32-bit words per set
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def effective() -> list[str]:
    """The calling thread's effective capabilities among CAP's names."""
    libc = _libc()
    hdr, data = _Header(_V3, 0), (_Data * 2)()
    if libc.capget(ctypes.byref(hdr), data) != 0:
        return []
    mask = data[0].effective | data[1].effective << 32
    return [n for n, b in CAP.items() if mask >> b & 1]


def drop(names=DROP_AFTER_START) -> list[str]:
    """Remove `names` from the calling thread's effective, permitted and inheritable sets, and clear its ambient
    set; threads it starts afterwards inherit that.  Returns the names it held and dropped."""
    libc = _libc()
    hdr, data = _Header(_V3, 0), (_Data * 2)()
    if libc.capget(ctypes.byref(hdr), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    held = data[0].permitted | data[1].permitted << 32
    gone = [n for n in names if held >> CAP[n] & 1]
    mask = 0
    for n in names:
        mask |= 1 << CAP[n]
    for i in (0, 1):
        m = ~(mask >> 32 * i) & 0xFFFFFFFF
        data[i].effective &= m
        data[i].permitted &= m
        data[i].inheritable &= m
    if libc.capset(ctypes.byref(hdr), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread() and t.is_alive()]
    if others:
        log.warning("capabilities dropped in the main thread only; these threads keep theirs: %s", ", ".join(others))
    return gone
