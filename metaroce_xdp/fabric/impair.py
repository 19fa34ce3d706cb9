"""The fabric's impairment program (bpf/fabric_impair.c): load once, attach on every port, and
read/write its maps afterwards from any process.

`load_and_attach(plan, pin_dir)` compiles the program with BCC, attaches `fab_egress` as a tc
clsact egress filter on every switch port and `fab_delay` on the ingress of each switch's delay
line, and pins the three maps under `pin_dir`.  The tc filters hold the program (and it its
maps) after the loading process exits; the pins let `metaroce fabric set/show` reach the maps:

    m = PortMaps.open(pin_dir)
    m.cfg[port_id]["loss_ppm"] = 10_000       # mmapped array: takes effect with the next frame
    m.counters(port_id)                       # per-CPU counters summed, by name
    m.state(port_id)                          # coin index, virtual queue

The layouts below are declared once more here (tests/kern/test_fabric.py compares them with the ones
BCC derives from the C).  `plan()` replays the program's coins so a test can say in advance
which frames a seed hits.

Neighbours: bpf/fabric_impair.c, topology.py (ports, ifindexes), kern/bpfsys.py (pin, get).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import subprocess
import time
from pathlib import Path

import numpy as np

from ..faults import fi_mix
from ..faults import plan as faults_plan
from ..kern import bccbuild, bpfsys
from ..topo import thread_in_netns
from .topology import DL0_IFINDEX, DL1_IFINDEX, IFINDEX_BASE, MAX_PORTS, FabricError, Plan

BPF_SOURCE = bccbuild.BPF_DIR / "fabric_impair.c"
PIN_ROOT = "/sys/fs/bpf/metaroce"
MAPS = ("fab_cfg", "fab_state", "fab_counters")

CFG_DTYPE = np.dtype([
    ("seed", "<u8"), ("rate_bps", "<u8"), ("ps_per_byte", "<u4"), ("mark_depth", "<u4"),
    ("drop_depth", "<u4"), ("loss_ppm", "<u4"), ("dup_ppm", "<u4"), ("reorder_ppm", "<u4"),
    ("corrupt_ppm", "<u4"), ("reorder_us", "<u4"), ("scope", "<u4"), ("enabled", "<u4")])
STATE_DTYPE = np.dtype([("lock", "<u4"), ("pad", "<u4"), ("index", "<u8"), ("q_empty_ns", "<u8"),
                        ("q_peak", "<u8")])
# struct fab_counters, in order: never renumber.
COUNTERS = ("pkts", "bytes", "matched", "q_dropped", "marked", "not_ect", "dropped", "corrupted", "duplicated",
            "reordered", "released", "bounces", "failed", "tx_pkts", "tx_bytes")
COUNTERS_DTYPE = np.dtype([(n, "<u8") for n in COUNTERS])

SCOPES = {"ip": 0, "udp": 1, "roce": 2}
SEED_SALT = 0x5EED              # per-port seed = fab_mix(user seed, port, SEED_SALT)
PPM = 1_000_000
MAX_RATE = 100 * 10**9          # (q_empty - now) * 1000 / ps_per_byte must not overflow; ps_per_byte >= 80
MIN_RATE = 10_000               # ps_per_byte fits in 32 bits
TC_EGRESS, TC_INGRESS = "ffff:fff3", "ffff:fff2"
TC_PRIO = 0xFAB


# ---------------------------------------------------------------------- the coins, mirrored
# The program's PRNG is fault_inject.c's (splitmix64 over seed, index, salt): faults.py's
# mirror (fi_mix, coin) serves both.
fab_mix = fi_mix


def port_seed(seed: int, port: int) -> int:
    """The seed a port's coins use: links draw independent patterns from one user seed."""
    return fab_mix(seed & ((1 << 64) - 1), port, SEED_SALT)


def plan(seed: int, count: int, *, loss_ppm: int = 0, dup_ppm: int = 0, reorder_ppm: int = 0,
         corrupt_ppm: int = 0, first_index: int = 0) -> list[frozenset[str]]:
    """What a port with this (per-port) seed does to matched frames first_index.. when no queue
    drops them: a set from {"loss", "corrupt", "dup", "reorder"}; a loss excludes the rest.
    The program draws the coins of fault_inject.c with the same salts (FAB_SALT_* = FI_SALT_*,
    a test compares them), so faults.plan replays both; only the names differ."""
    names = {"drop": "loss", "delay": "reorder"}
    return [frozenset(names.get(a, a) for a in acts)
            for acts in faults_plan(seed, count, drop_ppm=loss_ppm, dup_ppm=dup_ppm, corrupt_ppm=corrupt_ppm,
                                    reorder_ppm=reorder_ppm, first_index=first_index)]


def ps_per_byte(rate_bps: int) -> int:
    return max(1, round(8e12 / rate_bps)) if rate_bps else 0


class PortMaps:
    """The pinned maps of one fabric: `cfg` mmapped (numpy, one record per port), state and
    counters through bpf(2)."""

    def __init__(self, fds: dict[str, int]):
        self.fds = fds
        info = bpfsys.map_info(fds["fab_cfg"])
        if info.value_size != CFG_DTYPE.itemsize or info.max_entries != MAX_PORTS:
            raise FabricError(f"pinned fab_cfg has {info.max_entries} x {info.value_size} B, expected "
                              f"{MAX_PORTS} x {CFG_DTYPE.itemsize}: a fabric built by another version; "
                              "take it down and up again")
        size = -(-MAX_PORTS * CFG_DTYPE.itemsize // mmap.PAGESIZE) * mmap.PAGESIZE
        self._mm = mmap.mmap(fds["fab_cfg"], size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.cfg = np.frombuffer(self._mm, dtype=CFG_DTYPE, count=MAX_PORTS)
        self._ncpu = bpfsys.possible_cpus()

    @classmethod
    def open(cls, pin_dir: str | Path) -> "PortMaps":
        fds = {}
        try:
            for m in MAPS:
                fds[m] = bpfsys.obj_get(str(Path(pin_dir) / m))
        except OSError as e:
            for fd in fds.values():
                os.close(fd)
            raise FabricError(f"the fabric's maps are not pinned under {pin_dir} ({e.strerror}); "
                              "is bpffs mounted at /sys/fs/bpf and the fabric up?") from None
        return cls(fds)

    def counters(self, port: int) -> dict[str, int]:
        buf = (ctypes.c_uint8 * (COUNTERS_DTYPE.itemsize * self._ncpu))()
        bpfsys.array_lookup(self.fds["fab_counters"], port, buf)
        arr = np.frombuffer(bytes(buf), dtype=COUNTERS_DTYPE)
        return {n: int(arr[n].sum()) for n in COUNTERS}

    def state(self, port: int) -> dict[str, int]:
        buf = (ctypes.c_uint8 * STATE_DTYPE.itemsize)()
        bpfsys.array_lookup(self.fds["fab_state"], port, buf)
        rec = np.frombuffer(bytes(buf), dtype=STATE_DTYPE)[0]
        return {"index": int(rec["index"]), "q_empty_ns": int(rec["q_empty_ns"]), "q_peak": int(rec["q_peak"])}

    def reset_state(self, port: int) -> None:
        """Coin index back to 0 (same seed, same pattern again), queue empty, peak 0."""
        buf = (ctypes.c_uint8 * STATE_DTYPE.itemsize)()
        bpfsys.array_update(self.fds["fab_state"], port, buf)

    def reset_counters(self, port: int) -> None:
        buf = (ctypes.c_uint8 * (COUNTERS_DTYPE.itemsize * self._ncpu))()
        bpfsys.array_update(self.fds["fab_counters"], port, buf)

    def backlog(self, port: int) -> int:
        """Bytes in the port's virtual queue now."""
        c = self.cfg[port]
        if not c["rate_bps"] or not c["ps_per_byte"]:
            return 0
        left = self.state(port)["q_empty_ns"] - time_ns()
        return max(0, left) * 1000 // int(c["ps_per_byte"])

    def close(self) -> None:
        self.cfg = None
        with contextlib.suppress(BufferError):
            self._mm.close()
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def time_ns() -> int:
    """bpf_ktime_get_ns()'s clock (CLOCK_MONOTONIC)."""
    return time.monotonic_ns()


# ---------------------------------------------------------------------- loading, attaching
def _tc_attach(ifindex: int, fd: int, name: str, parent: str) -> None:
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError
    with IPRoute() as ipr:
        try:
            ipr.tc("add", "clsact", ifindex)
        except NetlinkError as e:
            if e.code != errno.EEXIST:
                raise
        ipr.tc("add-filter", "bpf", ifindex, ":1", fd=fd, name=name, parent=parent, classid=1,
               direct_action=True, prio=TC_PRIO)


def load_and_attach(plan_: Plan, pin_dir: str | Path) -> int:
    """Compile bpf/fabric_impair.c, attach it on every port and delay line of `plan_`, pin its maps
    under pin_dir (made here).  Every port starts enabled with nothing set.  Returns the program id
    of fab_egress."""
    try:
        from bcc import BPF
    except ImportError as e:
        raise FabricError("BCC (python3-bpfcc) is not importable; create the venv with --system-site-packages "
                          "(make setup)") from e
    if not os.path.ismount("/sys/fs/bpf"):
        raise FabricError("bpffs is not mounted at /sys/fs/bpf (`mount -t bpf bpf /sys/fs/bpf`; make setup does); "
                          "the fabric's maps are pinned there for `metaroce fabric set/show`")
    cflags = [f"-I{BPF_SOURCE.parent}", f"-DFAB_MAX_PORTS={MAX_PORTS}", f"-DFAB_IFINDEX_BASE={IFINDEX_BASE}",
              f"-DFAB_DL0_IFINDEX={DL0_IFINDEX}", f"-DFAB_DL1_IFINDEX={DL1_IFINDEX}"]
    b = BPF(src_file=str(BPF_SOURCE).encode(), cflags=cflags)
    try:
        egress = b.load_func(b"fab_egress", BPF.SCHED_CLS)
        delay = b.load_func(b"fab_delay", BPF.SCHED_CLS)
        cfg = b[b"fab_cfg"]
        for port in plan_.ports:
            v = cfg.Leaf()
            v.enabled = 1
            v.scope = SCOPES["udp"]
            v.seed = port_seed(0, port.id)
            cfg[cfg.Key(port.id)] = v
        for sw in plan_.switches:
            with thread_in_netns(sw):
                for idx in (DL0_IFINDEX, DL1_IFINDEX):
                    _tc_attach(idx, delay.fd, "fab_delay", TC_INGRESS)
        for port in plan_.ports:
            with thread_in_netns(port.ns):
                _tc_attach(port.ifindex, egress.fd, "fab_egress", TC_EGRESS)
        os.makedirs(pin_dir, exist_ok=True)
        for m in MAPS:
            path = Path(pin_dir) / m
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            bpfsys.obj_pin(b[m.encode()].map_fd, str(path))
        return int(bpfsys.prog_info(egress.fd).id)
    finally:
        b.cleanup()         # the tc filters and pins keep what they need


def unpin(pin_dir: str | Path) -> list[str]:
    errors = []
    d = Path(pin_dir)
    if d.is_dir():
        for f in d.iterdir():
            try:
                f.unlink()
            except OSError as e:
                errors.append(f"{f}: {e.strerror}")
        with contextlib.suppress(OSError):
            d.rmdir()
    return errors


# ---------------------------------------------------------------------- the real queue (tbf)
def tbf_params(rate_bps: int, drop_depth: int, mtu: int) -> dict:
    """A tbf that waits like the modelled queue: the same rate; a bucket of 100 µs at that rate
    but at least two frames -- tbf refills its bucket only when its timer runs, and a timer
    that runs late by more than the bucket's worth loses link time for good, which a loaded
    machine would turn into a slower link than asked; the model counts a full bucket's frames
    as queued, so it runs at most one bucket ahead of the real queue, at the start of a burst --
    and a limit above drop_depth, so the model's drops are the only ones (tbf's own show in
    `show`)."""
    burst = max(2 * (mtu + 18), rate_bps // 80_000)
    limit = (drop_depth or 16 << 20) + burst + 64 * 1024
    return {"rate": rate_bps, "burst": burst, "limit": limit}


def set_tbf(ns: str, ifname: str, rate_bps: int, drop_depth: int, mtu: int) -> None:
    """Replace the port's root qdisc with the tbf for rate_bps, or go back to none (rate 0).
    `tc` rather than pyroute2: pyroute2's tbf has no 64-bit rate (it stops at 34 Gbit/s)."""
    if rate_bps:
        p = tbf_params(rate_bps, drop_depth, mtu)
        argv = ["tc", "-n", ns, "qdisc", "replace", "dev", ifname, "root", "tbf", "rate", f"{p['rate']}bit",
                "burst", str(p["burst"]), "limit", str(p["limit"])]
    else:
        argv = ["tc", "-n", ns, "qdisc", "del", "dev", ifname, "root"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if r.returncode != 0 and not (not rate_bps and ("No such file" in r.stderr or "Cannot delete" in r.stderr
                                                    or "Invalid handle" in r.stderr)):
        raise FabricError(f"`{' '.join(argv)}` failed: {r.stderr.strip()}")


def tbf_stats(ns: str, ifname: str) -> dict | None:
    """The port's tbf: {"drops", "backlog", "sent_pkts"} or None when there is none."""
    from pyroute2 import IPRoute
    with thread_in_netns(ns), IPRoute() as ipr:
        idx = ipr.link_lookup(ifname=ifname)
        if not idx:
            return None
        for q in ipr.get_qdiscs(idx[0]):
            if q.get_attr("TCA_KIND") == "tbf":
                st = q.get_attr("TCA_STATS") or {}
                st2 = q.get_attr("TCA_STATS2")
                basic = st2.get_attr("TCA_STATS_BASIC") if st2 is not None else None
                queue = st2.get_attr("TCA_STATS_QUEUE") if st2 is not None else None
                return {"drops": int((queue or st).get("drops", 0)),
                        "backlog": int((queue or st).get("backlog", 0)),
                        "sent_pkts": int((basic or st).get("packets", 0))}
    return None
