"""The few bpf(2) commands BCC does not wrap for us, through ctypes.

BPF_PROG_TEST_RUN (golden-packet tests) and BPF_OBJ_PIN (pinning maps for
the CLI).  Attribute layouts are those of union bpf_attr in
include/uapi/linux/bpf.h; only the fields we use are spelled out, the rest
of the structure is zero.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

_libc = ctypes.CDLL(None, use_errno=True)
SYS_bpf = 321                    # x86_64
BPF_OBJ_PIN = 6
BPF_PROG_TEST_RUN = 10

XDP_ABORTED, XDP_DROP, XDP_PASS, XDP_TX, XDP_REDIRECT = range(5)
XDP_ACTIONS = {0: "XDP_ABORTED", 1: "XDP_DROP", 2: "XDP_PASS", 3: "XDP_TX", 4: "XDP_REDIRECT"}


class _TestRunAttr(ctypes.Structure):
    # union bpf_attr, the `test` member (BPF_PROG_TEST_RUN)
    _fields_ = [("prog_fd", ctypes.c_uint32), ("retval", ctypes.c_uint32),
                ("data_size_in", ctypes.c_uint32), ("data_size_out", ctypes.c_uint32),
                ("data_in", ctypes.c_uint64), ("data_out", ctypes.c_uint64),
                ("repeat", ctypes.c_uint32), ("duration", ctypes.c_uint32),
                ("ctx_size_in", ctypes.c_uint32), ("ctx_size_out", ctypes.c_uint32),
                ("ctx_in", ctypes.c_uint64), ("ctx_out", ctypes.c_uint64),
                ("flags", ctypes.c_uint32), ("cpu", ctypes.c_uint32),
                ("batch_size", ctypes.c_uint32), ("_pad", ctypes.c_uint32)]


class _ObjAttr(ctypes.Structure):
    # union bpf_attr, BPF_OBJ_PIN / BPF_OBJ_GET
    _fields_ = [("pathname", ctypes.c_uint64), ("bpf_fd", ctypes.c_uint32),
                ("file_flags", ctypes.c_uint32), ("path_fd", ctypes.c_int32), ("_pad", ctypes.c_uint32)]


def _bpf(cmd: int, attr: ctypes.Structure) -> int:
    r = _libc.syscall(SYS_bpf, cmd, ctypes.byref(attr), ctypes.sizeof(attr))
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"bpf(cmd={cmd}): {os.strerror(e)}")
    return r


@dataclass
class TestRunResult:
    retval: int
    data: bytes
    duration_ns: int

    @property
    def action(self) -> str:
        return XDP_ACTIONS.get(self.retval, f"XDP_{self.retval}")


def prog_test_run(prog_fd: int, data: bytes, repeat: int = 1) -> TestRunResult:
    """Run an XDP program once on `data` (BPF_PROG_TEST_RUN, no live frames: a
    redirect is only reported in retval, nothing is transmitted)."""
    inb = ctypes.create_string_buffer(bytes(data), len(data))
    out_size = len(data) + 256
    outb = ctypes.create_string_buffer(out_size)
    a = _TestRunAttr(prog_fd=prog_fd, data_size_in=len(data), data_in=ctypes.addressof(inb),
                     data_out=ctypes.addressof(outb), data_size_out=out_size, repeat=repeat)
    _bpf(BPF_PROG_TEST_RUN, a)
    return TestRunResult(a.retval, outb.raw[:a.data_size_out], a.duration)


def obj_pin(fd: int, path: str) -> None:
    p = ctypes.create_string_buffer(os.fsencode(path))
    _bpf(BPF_OBJ_PIN, _ObjAttr(pathname=ctypes.addressof(p), bpf_fd=fd))


BPF_MAP_LOOKUP_ELEM = 1
BPF_OBJ_GET = 7
BPF_OBJ_GET_INFO_BY_FD = 15


class _MapElemAttr(ctypes.Structure):
    # union bpf_attr, BPF_MAP_*_ELEM
    _fields_ = [("map_fd", ctypes.c_uint32), ("_pad", ctypes.c_uint32), ("key", ctypes.c_uint64),
                ("value", ctypes.c_uint64), ("flags", ctypes.c_uint64)]


class _InfoAttr(ctypes.Structure):
    # union bpf_attr, `info` member (BPF_OBJ_GET_INFO_BY_FD)
    _fields_ = [("bpf_fd", ctypes.c_uint32), ("info_len", ctypes.c_uint32), ("info", ctypes.c_uint64)]


class MapInfo(ctypes.Structure):
    # struct bpf_map_info, leading fields
    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32), ("key_size", ctypes.c_uint32),
                ("value_size", ctypes.c_uint32), ("max_entries", ctypes.c_uint32),
                ("map_flags", ctypes.c_uint32), ("name", ctypes.c_char * 16)]


def obj_get(path: str) -> int:
    """fd of a pinned object (BPF_OBJ_GET); the caller closes it."""
    p = ctypes.create_string_buffer(os.fsencode(path))
    return _bpf(BPF_OBJ_GET, _ObjAttr(pathname=ctypes.addressof(p)))


def map_info(fd: int) -> MapInfo:
    info = MapInfo()
    _bpf(BPF_OBJ_GET_INFO_BY_FD, _InfoAttr(bpf_fd=fd, info_len=ctypes.sizeof(info), info=ctypes.addressof(info)))
    return info


def possible_cpus() -> int:
    """Number of possible CPUs (per-CPU map values come in this many slots)."""
    with open("/sys/devices/system/cpu/possible") as f:
        text = f.read().strip()
    n = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        n = max(n, int(hi or lo) + 1)
    return n


def percpu_u64_sum(fd: int, key: int) -> int:
    """Sum over CPUs of a per-CPU array's u64 value at `key`."""
    ncpu = possible_cpus()
    k = ctypes.c_uint32(key)
    vals = (ctypes.c_uint64 * ncpu)()
    _bpf(BPF_MAP_LOOKUP_ELEM, _MapElemAttr(map_fd=fd, key=ctypes.addressof(k), value=ctypes.addressof(vals)))
    return int(sum(vals))
