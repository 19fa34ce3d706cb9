"""The few bpf(2) commands BCC does not wrap for us, through ctypes.

BPF_PROG_TEST_RUN (golden-packet tests), BPF_OBJ_PIN / BPF_OBJ_GET (pinning
maps for the CLI), BPF_PROG_LOAD with prog_flags (BCC 0.26's Python
`load_func` cannot pass BPF_F_XDP_HAS_FRAGS, so the loader hands the
instructions BCC compiled to `prog_load` itself), BPF_LINK_CREATE (an XDP
attachment owned by a file descriptor: it goes away with the process that
holds it) and BPF_OBJ_GET_INFO_BY_FD for maps, programs and links.
Attribute layouts are those of union bpf_attr in include/uapi/linux/bpf.h;
only the fields we use are spelled out, the rest of the structure is zero.

Public API used by others (metaroce_xdp/dp may use it too): prog_test_run,
obj_pin, obj_get, map_info, prog_info, link_info, prog_load, link_create,
xdp_link_holders, percpu_u64_sum, possible_cpus.
"""
from __future__ import annotations

import ctypes
import os
import platform
from dataclasses import dataclass

_libc = ctypes.CDLL(None, use_errno=True)
# __NR_bpf by machine (the kernel's syscall tables: arch/x86/entry/syscalls, include/uapi/asm-generic/unistd.h
# for the architectures that use the generic table, arch/*/kernel/syscalls for the others)
SYS_BPF_BY_MACHINE = {"x86_64": 321, "aarch64": 280, "arm64": 280, "riscv64": 280, "loongarch64": 280,
                      "ppc64le": 361, "ppc64": 361, "s390x": 351, "i686": 357, "i386": 357, "armv7l": 386}


class UnsupportedMachine(OSError):
    """This machine's bpf(2) syscall number is not known here."""


def sys_bpf_number(machine: str | None = None) -> int:
    m = machine or platform.machine()
    try:
        return SYS_BPF_BY_MACHINE[m]
    except KeyError:
        raise UnsupportedMachine(f"bpf(2): no syscall number known for machine {m!r} "
                                 f"(known: {', '.join(sorted(SYS_BPF_BY_MACHINE))})") from None


SYS_bpf = SYS_BPF_BY_MACHINE.get(platform.machine(), -1)    # -1: _bpf raises UnsupportedMachine
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
    if SYS_bpf < 0:
        sys_bpf_number()                                     # raises, naming the machine
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
BPF_MAP_UPDATE_ELEM = 2
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


def array_lookup(fd: int, key: int, buf) -> None:
    """Read an array map's value at u32 `key` into the ctypes buffer `buf` (for a per-CPU map,
    one value per possible CPU)."""
    k = ctypes.c_uint32(key)
    _bpf(BPF_MAP_LOOKUP_ELEM, _MapElemAttr(map_fd=fd, key=ctypes.addressof(k), value=ctypes.addressof(buf)))


def array_update(fd: int, key: int, buf) -> None:
    """Write the ctypes buffer `buf` as an array map's value at u32 `key`."""
    k = ctypes.c_uint32(key)
    _bpf(BPF_MAP_UPDATE_ELEM, _MapElemAttr(map_fd=fd, key=ctypes.addressof(k), value=ctypes.addressof(buf)))


def percpu_u64_sum(fd: int, key: int) -> int:
    """Sum over CPUs of a per-CPU array's u64 value at `key`."""
    vals = (ctypes.c_uint64 * possible_cpus())()
    array_lookup(fd, key, vals)
    return int(sum(vals))


# ---- loading and attaching ---------------------------------------------------------------
BPF_PROG_LOAD = 5
BPF_LINK_CREATE = 28
BPF_PROG_TYPE_XDP = 6
BPF_XDP = 37                     # enum bpf_attach_type
BPF_F_XDP_HAS_FRAGS = 1 << 5     # the program understands multi-buffer frames (Linux 5.18)


class _ProgLoadAttr(ctypes.Structure):
    # union bpf_attr, BPF_PROG_LOAD (up to expected_attach_type)
    _fields_ = [("prog_type", ctypes.c_uint32), ("insn_cnt", ctypes.c_uint32), ("insns", ctypes.c_uint64),
                ("license", ctypes.c_uint64), ("log_level", ctypes.c_uint32), ("log_size", ctypes.c_uint32),
                ("log_buf", ctypes.c_uint64), ("kern_version", ctypes.c_uint32), ("prog_flags", ctypes.c_uint32),
                ("prog_name", ctypes.c_char * 16), ("prog_ifindex", ctypes.c_uint32),
                ("expected_attach_type", ctypes.c_uint32)]


class _LinkCreateAttr(ctypes.Structure):
    # union bpf_attr, BPF_LINK_CREATE (the leading fields; the per-type union stays zero)
    _fields_ = [("prog_fd", ctypes.c_uint32), ("target_ifindex", ctypes.c_uint32),
                ("attach_type", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("_union", ctypes.c_uint64 * 4)]


def prog_load(prog_type: int, insns: int, insn_bytes: int, license: bytes, *, kern_version: int = 0,
              prog_flags: int = 0, name: bytes = b"", expected_attach_type: int = 0) -> int:
    """BPF_PROG_LOAD of `insn_bytes` bytes of instructions at address `insns`; returns the
    program's fd.  On a verifier refusal the OSError's message ends with the verifier log."""
    lic = ctypes.create_string_buffer(license)
    a = _ProgLoadAttr(prog_type=prog_type, insn_cnt=insn_bytes // 8, insns=insns,
                      license=ctypes.addressof(lic), kern_version=kern_version, prog_flags=prog_flags,
                      prog_name=name[:15], expected_attach_type=expected_attach_type)
    try:
        return _bpf(BPF_PROG_LOAD, a)
    except OSError as e:
        if e.errno not in (13, 22):          # EACCES / EINVAL: the verifier has something to say
            raise
    log = ctypes.create_string_buffer(1 << 22)
    a.log_level, a.log_size, a.log_buf = 1, len(log), ctypes.addressof(log)
    try:
        return _bpf(BPF_PROG_LOAD, a)
    except OSError as e:
        tail = log.value.decode(errors="replace")[-3000:]
        raise OSError(e.errno, f"{e.strerror}; verifier log (end):\n{tail}") from None


def link_create(prog_fd: int, ifindex: int, attach_type: int = BPF_XDP, flags: int = 0) -> int:
    """BPF_LINK_CREATE: attach prog_fd to the interface (XDP: flags are XDP_FLAGS_SKB_MODE /
    XDP_FLAGS_DRV_MODE).  The returned fd owns the attachment: closing it (or the death of
    every process holding it) detaches the program.  EBUSY / EEXIST: the interface already
    has an XDP program (another link, or one attached through netlink)."""
    return _bpf(BPF_LINK_CREATE, _LinkCreateAttr(prog_fd=prog_fd, target_ifindex=ifindex,
                                                 attach_type=attach_type, flags=flags))


class ProgInfo(ctypes.Structure):
    # struct bpf_prog_info, leading fields
    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32), ("tag", ctypes.c_uint8 * 8),
                ("jited_prog_len", ctypes.c_uint32), ("xlated_prog_len", ctypes.c_uint32),
                ("jited_prog_insns", ctypes.c_uint64), ("xlated_prog_insns", ctypes.c_uint64),
                ("load_time", ctypes.c_uint64), ("created_by_uid", ctypes.c_uint32),
                ("nr_map_ids", ctypes.c_uint32), ("map_ids", ctypes.c_uint64), ("name", ctypes.c_char * 16)]


class LinkInfo(ctypes.Structure):
    # struct bpf_link_info: type, id, prog_id, then the per-type union (xdp: ifindex first)
    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32), ("prog_id", ctypes.c_uint32),
                ("_pad", ctypes.c_uint32), ("ifindex", ctypes.c_uint32), ("_rest", ctypes.c_uint32 * 7)]


def _info(fd: int, info: ctypes.Structure) -> ctypes.Structure:
    _bpf(BPF_OBJ_GET_INFO_BY_FD, _InfoAttr(bpf_fd=fd, info_len=ctypes.sizeof(info), info=ctypes.addressof(info)))
    return info


def prog_info(fd: int) -> ProgInfo:
    return _info(fd, ProgInfo())


BPF_PROG_GET_FD_BY_ID = 13


class _IdAttr(ctypes.Structure):
    # union bpf_attr, BPF_*_GET_FD_BY_ID
    _fields_ = [("id", ctypes.c_uint32), ("next_id", ctypes.c_uint32), ("open_flags", ctypes.c_uint32)]


def prog_name_by_id(prog_id: int) -> str | None:
    """The name of program `prog_id` (bpf_prog_info.name), None where it cannot be read: the program is
    gone, or BPF_PROG_GET_FD_BY_ID is refused (it needs CAP_SYS_ADMIN, which metaroced's unit does not
    grant)."""
    try:
        fd = _bpf(BPF_PROG_GET_FD_BY_ID, _IdAttr(id=prog_id))
    except OSError:
        return None
    try:
        return prog_info(fd).name.decode(errors="replace")
    finally:
        os.close(fd)


def link_info(fd: int) -> LinkInfo:
    return _info(fd, LinkInfo())


def xdp_link_holders(prog_id: int) -> list[int]:
    """PIDs of processes holding an XDP bpf_link fd of program `prog_id` (read from
    /proc/*/fdinfo, best effort: for error messages).  Program ids are unique machine-wide,
    unlike ifindexes, which repeat across network namespaces."""
    out = []
    want = f"prog_id:\t{prog_id}\n"
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fdinfo")
        except OSError:
            continue
        for fd in fds:
            try:
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    text = f.read()
            except OSError:
                continue
            if "link_type:\txdp" in text and want in text:
                out.append(int(pid))
                break
    return out
