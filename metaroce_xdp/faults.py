"""Seeded fault injector for end-to-end tests of the reliable transport.

Loads bpf/fault_inject.c with BCC and attaches it as a tc clsact filter
(direct action) on one device, egress by default.  Only UDP/4791 frames are
touched: each one gets a packet index, and independent per-action coins are
drawn from `fi_mix(seed, index, salt)`, so for a given seed the pattern of
drops, duplicates, corruptions and delays depends only on the order in which
frames reach the hook.  `plan()` replays the same coins in Python, which lets
a test say in advance exactly which PSNs will be hit.

    with FaultInjector("veth0", netns="a", seed=7, drop_ppm=100_000) as fi:
        ...send traffic...
        print(fi.stats())           # {"roce": 400, "dropped": 41, ...}

Delay (reorder): this kernel has neither sch_fq nor sch_etf, so setting
skb->tstamp (EDT) delays nothing.  Instead the program copies a frame chosen
for delay into a perf buffer and steals it; a thread here sends it again on
the same device after `reorder_delay_us` through an AF_PACKET socket whose
SO_MARK makes the program pass it untouched.  Timer granularity is about a
millisecond, and delay is available on egress only.

Where to attach: on the *sender's* egress when the receiver is the XDP/AF_XDP
endpoint.  On ingress the tc hook runs after XDP (and after ETH_P_ALL packet
taps), so ingress faults are seen only by the kernel stack and by packet
sockets bound to a specific ethertype.

CLI (tests and `make demo` run it inside the namespace that holds the device):

    ip netns exec a python -m metaroce_xdp.faults --dev veth0 --seed 7 \\
        --drop-ppm 100000 --duration 30
    # prints {"event": "ready", ...} once attached, then on exit (duration
    # elapsed, SIGINT or SIGTERM) {"event": "stats", "counters": {...}}

Neighbours: `wire` (opcode table for opcode filters), bpf/fault_inject.c.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import heapq
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable, Iterator

from .kern import bccbuild
from .wire.opcodes import BY_NAME, OPCODES, OpMask

BPF_SOURCE = bccbuild.BPF_DIR / "fault_inject.c"

# ---- facts shared with bpf/fault_inject.c (tests/kern/test_faults.py checks them) ----
FI_MARK = 0x4D52FA17
PPM_SCALE = 1_000_000
BTH_SIZE = 12

# enum fi_counter, in order: never renumber.
COUNTERS = ("seen", "own", "roce", "matched", "psn_dropped", "dropped", "corrupted",
            "duplicated", "dup_failed", "delayed", "delay_failed", "limited", "short", "ce_marked",
            "ce_not_ect")

# FI_SALT_*: one independent coin per action.
SALT_DROP = 1
SALT_CORRUPT = 2
SALT_CORRUPT_OFF = 3
SALT_DUP = 4
SALT_DELAY = 5
SALT_ECN_CE = 6

# fi_config.flags
F_ENABLED = 1 << 0
F_OPCODE_FILTER = 1 << 1
F_FIX_UDP_CSUM = 1 << 2
F_SPREAD_FLOW = 1 << 3

TC_EGRESS_PARENT = "ffff:fff3"
TC_INGRESS_PARENT = "ffff:fff2"
TC_PRIO = 0xFA17          # our filter's preference: distinct from the endpoint's filters
TC_HANDLE = ":1"

_M64 = (1 << 64) - 1
_CLONE_NEWNET = 0x40000000


class FaultInjectorError(RuntimeError):
    """The injector could not be set up; the message says what to check."""


# ---- the PRNG, mirrored from impair_mix() (bpf/tc_impair_common.h) ------
def fi_mix(seed: int, index: int, salt: int) -> int:
    """splitmix64 finaliser over (seed, index, salt); equals impair_mix() in bpf/tc_impair_common.h."""
    z = (seed + index * 0x9E3779B97F4A7C15 + salt * 0xD1B54A32D192ED03) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def coin(seed: int, index: int, salt: int, ppm: int) -> bool:
    if ppm <= 0:
        return False
    if ppm >= PPM_SCALE:
        return True
    return fi_mix(seed, index, salt) % PPM_SCALE < ppm


def plan(seed: int, count: int, *, drop_ppm: int = 0, dup_ppm: int = 0, corrupt_ppm: int = 0,
         reorder_ppm: int = 0, ecn_ce_ppm: int = 0, first_index: int = 0) -> list[frozenset[str]]:
    """What the kernel does to UDP/4791 packets first_index .. first_index+count-1
    when every one is targeted (no opcode filter, every_nth, limit or PSN list).
    Each entry is a set drawn from {"drop", "corrupt", "dup", "delay", "ce"}; a drop
    excludes the rest, as in the program ("ce" marks only ECT frames)."""
    out = []
    for i in range(first_index, first_index + count):
        if coin(seed, i, SALT_DROP, drop_ppm):
            out.append(frozenset({"drop"}))
            continue
        acts = set()
        if coin(seed, i, SALT_CORRUPT, corrupt_ppm):
            acts.add("corrupt")
        if coin(seed, i, SALT_DUP, dup_ppm):
            acts.add("dup")
        if coin(seed, i, SALT_DELAY, reorder_ppm):
            acts.add("delay")
        if coin(seed, i, SALT_ECN_CE, ecn_ce_ppm):
            acts.add("ce")
        out.append(frozenset(acts))
    return out


def opcode_bitmap(opcodes: Iterable[int] | OpMask | int | None) -> tuple[int, int, int, int] | None:
    """256-bit opcode set as four u64 words.  An OpMask selects every opcode of
    the table whose mask shares a bit with it (OpMask.ACK: all responder ->
    requester opcodes); an iterable lists opcode numbers."""
    if opcodes is None:
        return None
    if isinstance(opcodes, OpMask):
        values = [v for v, info in OPCODES.items() if info.mask & opcodes]
    elif isinstance(opcodes, int):
        values = [opcodes]
    else:
        values = [int(v) for v in opcodes]
    words = [0, 0, 0, 0]
    for v in values:
        if not 0 <= v <= 255:
            raise ValueError(f"opcode {v} is not a byte")
        words[v >> 6] |= 1 << (v & 63)
    return tuple(words)


# ---- network namespaces ---------------------------------------------------------
@contextlib.contextmanager
def in_netns(name: str | None) -> Iterator[None]:
    """Run the body with the calling thread in network namespace `name`
    (an `ip netns` name or a path).  Sockets opened inside stay in it."""
    if name is None:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    path = name if "/" in name else f"/run/netns/{name}"
    here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        try:
            there = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise FaultInjectorError(f"network namespace {name!r} not found ({path})") from None
        try:
            if libc.setns(there, _CLONE_NEWNET) != 0:
                e = ctypes.get_errno()
                raise FaultInjectorError(f"setns({name}) failed: {os.strerror(e)}; are you root?")
        finally:
            os.close(there)
        try:
            yield
        finally:
            if libc.setns(here, _CLONE_NEWNET) != 0:  # pragma: no cover - would leave the thread stranded
                raise OSError(ctypes.get_errno(), "setns back to the original namespace failed")
    finally:
        os.close(here)


# ---- the injector ----------------------------------------------------------------
class _DelayMeta(ctypes.Structure):
    """struct fi_delay_meta, prepended to each delayed frame."""
    _fields_ = [("ktime_ns", ctypes.c_uint64), ("index", ctypes.c_uint64),
                ("len", ctypes.c_uint32), ("ifindex", ctypes.c_uint32)]


_CONFIG_KEYS = ("seed", "drop_ppm", "dup_ppm", "corrupt_ppm", "reorder_ppm", "reorder_delay_us", "ecn_ce_ppm",
                "corrupt_offset", "corrupt_xor", "fix_udp_csum", "opcode_filter", "every_nth",
                "action_limit", "enabled", "spread_queues", "spread_by")


class FaultInjector:
    """One fault-injecting tc filter on `ifname` (in `netns`, or the caller's
    namespace).  Rates are parts per million of targeted UDP/4791 frames.

    opcode_filter   None (all), an OpMask, or an iterable of opcode numbers
    every_nth       target only the Nth, 2Nth, ... frame passing the opcode filter
    action_limit    act on at most this many frames in total (0: no limit)
    psn_drop_once   PSNs to drop once each (a PSN listed k times is dropped k times)
    corrupt_offset  byte from the BTH start to corrupt; None: a seeded choice past the BTH
    fix_udp_csum    after corrupting, patch a non-zero UDP checksum so only the ICRC fails
    ecn_ce_ppm      mark CE on this share of ECN-capable (ECT) frames, IPv4 checksum fixed:
                    a congested switch for DCQCN tests (the ICRC masks ECN, MR-ICRC-004)
    spread_queues   N > 1 (egress): every UDP/4791 frame leaves on TX queue (packet index % N), so
                    on veth the peer receives consecutive packets on all its N RX queues in turn --
                    one QP's packets on every queue, the worst case for the receiver
    spread_by       "packet" (round robin, as above) or "flow": the queue the UDP source port hashes
                    to, as a NIC's RSS over ports does (a compat QP on one queue, the native profile's
                    sprayed paths on several)
    """

    def __init__(self, ifname: str, *, netns: str | None = None, direction: str = "egress",
                 seed: int = 0, drop_ppm: int = 0, dup_ppm: int = 0, corrupt_ppm: int = 0,
                 reorder_ppm: int = 0, reorder_delay_us: int = 2000, ecn_ce_ppm: int = 0,
                 corrupt_offset: int | None = None, corrupt_xor: int = 0xFF, fix_udp_csum: bool = False,
                 opcode_filter: Iterable[int] | OpMask | int | None = None, every_nth: int = 0,
                 action_limit: int = 0, psn_drop_once: Iterable[int] = (), mark: int = FI_MARK,
                 enabled: bool = True, spread_queues: int = 0, spread_by: str = "packet"):
        if direction not in ("egress", "ingress"):
            raise ValueError("direction must be 'egress' or 'ingress'")
        self.ifname, self.netns, self.direction, self.mark = ifname, netns, direction, mark
        self._cfg = dict(seed=seed, drop_ppm=drop_ppm, dup_ppm=dup_ppm, corrupt_ppm=corrupt_ppm,
                         reorder_ppm=reorder_ppm, reorder_delay_us=reorder_delay_us, ecn_ce_ppm=ecn_ce_ppm,
                         corrupt_offset=corrupt_offset, corrupt_xor=corrupt_xor,
                         fix_udp_csum=fix_udp_csum, opcode_filter=opcode_filter,
                         every_nth=every_nth, action_limit=action_limit, enabled=enabled,
                         spread_queues=spread_queues, spread_by=spread_by)
        self._check(self._cfg)
        if direction == "ingress" and spread_queues > 1:
            raise ValueError("spread_queues needs egress: the TX queue is chosen there")
        if direction == "ingress" and reorder_ppm:
            raise ValueError("reorder needs egress: delayed frames are re-sent with AF_PACKET")
        self._closed = False
        self.final_stats: dict[str, int] | None = None     # stats() as of close()
        self._attached = False
        self._created_clsact = False
        self._bpf = None
        self._tx: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._held: list[tuple[int, int, bytes]] = []      # (due ns, index, frame)
        self._held_lock = threading.Lock()
        self._user = {"reinjected": 0, "reinject_failed": 0, "delay_lost": 0, "flushed": 0}
        try:
            self._load()
            self._write_config()
            self.set_psn_drop_once(psn_drop_once)
            with in_netns(netns):
                self.ifindex = self._ifindex()
                if direction == "egress":
                    # The reinjection socket must live in the device's namespace.
                    self._tx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
                    self._tx.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
                    self._tx.bind((ifname, 0))
                self._attach()
            if direction == "egress":
                self._bpf[b"fi_delayed"].open_perf_buffer(self._on_delayed, page_cnt=256,
                                                         lost_cb=self._on_lost)
                self._thread = threading.Thread(target=self._reinject_loop, name=f"fi-reinject-{ifname}",
                                                daemon=True)
                self._thread.start()
        except BaseException:
            self.close()
            raise

    # -- setup ---------------------------------------------------------------
    @staticmethod
    def _check(cfg: dict) -> None:
        for k in ("drop_ppm", "dup_ppm", "corrupt_ppm", "reorder_ppm", "ecn_ce_ppm"):
            if not 0 <= int(cfg[k]) <= PPM_SCALE:
                raise ValueError(f"{k}={cfg[k]} is outside 0..{PPM_SCALE}")
        if int(cfg["reorder_delay_us"]) < 0:
            raise ValueError("reorder_delay_us must be >= 0")
        if not 0 <= int(cfg["spread_queues"]) <= 1024:
            raise ValueError(f"spread_queues={cfg['spread_queues']} is outside 0..1024")
        if cfg["spread_by"] not in ("packet", "flow"):
            raise ValueError(f"spread_by={cfg['spread_by']!r}: 'packet' or 'flow'")
        if not 0 <= int(cfg["seed"]) <= _M64:
            raise ValueError("seed must fit in 64 bits")

    def _load(self) -> None:
        try:
            from bcc import BPF
        except ImportError as e:
            raise FaultInjectorError("BCC (python3-bpfcc) is not importable; create the venv with "
                                     "--system-site-packages") from e
        cflags = [f"-I{BPF_SOURCE.parent}", f"-DFI_MARK={self.mark:#x}", f"-DFI_INGRESS={int(self.direction == 'ingress')}"]
        self._bpf = BPF(src_file=str(BPF_SOURCE).encode(), cflags=cflags)
        self._fn = self._bpf.load_func(b"fi_tc", BPF.SCHED_CLS)

    def _ifindex(self) -> int:
        try:
            return socket.if_nametoindex(self.ifname)
        except OSError:
            raise FaultInjectorError(f"no device {self.ifname!r} in namespace "
                                     f"{self.netns or 'of the caller'}") from None

    def _parent(self) -> str:
        return TC_EGRESS_PARENT if self.direction == "egress" else TC_INGRESS_PARENT

    def _attach(self) -> None:
        from pyroute2 import IPRoute
        from pyroute2.netlink.exceptions import NetlinkError
        with IPRoute() as ipr:
            try:
                ipr.tc("add", "clsact", self.ifindex)
                self._created_clsact = True
            except NetlinkError as e:
                if e.code != errno.EEXIST:
                    raise
            try:
                ipr.tc("add-filter", "bpf", self.ifindex, TC_HANDLE, fd=self._fn.fd, name=self._fn.name,
                       parent=self._parent(), classid=1, direct_action=True, prio=TC_PRIO)
            except NetlinkError as e:
                if e.code == errno.EEXIST:
                    raise FaultInjectorError(f"a fault injector is already attached to {self.ifname} "
                                             f"{self.direction} (tc prio {TC_PRIO:#x})") from e
                raise
        self._attached = True

    def _detach(self) -> None:
        from pyroute2 import IPRoute
        from pyroute2.netlink.exceptions import NetlinkError
        with in_netns(self.netns), IPRoute() as ipr:
            if self._attached:
                with contextlib.suppress(NetlinkError):
                    ipr.tc("del-filter", "bpf", self.ifindex, TC_HANDLE, parent=self._parent(),
                           prio=TC_PRIO)
                self._attached = False
            if self._created_clsact:
                # Remove the clsact we added unless someone else put filters on it since.
                with contextlib.suppress(NetlinkError):
                    others = [f for p in (TC_EGRESS_PARENT, TC_INGRESS_PARENT)
                              for f in ipr.get_filters(self.ifindex, parent=p)]
                    if not others:
                        ipr.tc("del", "clsact", self.ifindex)
                self._created_clsact = False

    # -- configuration ----------------------------------------------------------
    def _write_config(self) -> None:
        c = self._cfg
        t = self._bpf[b"fi_config"]
        v = t.Leaf()
        v.seed = int(c["seed"])
        v.drop_ppm = int(c["drop_ppm"])
        v.dup_ppm = int(c["dup_ppm"])
        v.corrupt_ppm = int(c["corrupt_ppm"])
        v.delay_ppm = int(c["reorder_ppm"]) if self.direction == "egress" else 0
        v.delay_us = int(c["reorder_delay_us"])
        v.ecn_ce_ppm = int(c["ecn_ce_ppm"])
        v.spread_queues = int(c["spread_queues"])
        v.every_nth = int(c["every_nth"])
        v.action_limit = int(c["action_limit"])
        v.corrupt_offset = -1 if c["corrupt_offset"] is None else int(c["corrupt_offset"])
        v.corrupt_xor = int(c["corrupt_xor"]) & 0xFF
        flags = F_ENABLED if c["enabled"] else 0
        bitmap = opcode_bitmap(c["opcode_filter"])
        if bitmap is not None:
            flags |= F_OPCODE_FILTER
            for i, w in enumerate(bitmap):
                v.opcode_bitmap[i] = w
        if c["fix_udp_csum"]:
            flags |= F_FIX_UDP_CSUM
        if c["spread_by"] == "flow":
            flags |= F_SPREAD_FLOW
        v.flags = flags
        t[t.Key(0)] = v

    def update(self, psn_drop_once: Iterable[int] | None = None, **changes) -> None:
        """Change knobs while attached (takes effect from the next frame).
        Accepts any constructor keyword except ifname/netns/direction/mark;
        `psn_drop_once` replaces the PSN list."""
        unknown = set(changes) - set(_CONFIG_KEYS)
        if unknown:
            raise TypeError(f"update() got unknown knobs {sorted(unknown)}")
        cfg = {**self._cfg, **changes}
        self._check(cfg)
        if self.direction == "ingress" and cfg["reorder_ppm"]:
            raise ValueError("reorder needs egress: delayed frames are re-sent with AF_PACKET")
        self._cfg = cfg
        self._write_config()
        if psn_drop_once is not None:
            self.set_psn_drop_once(psn_drop_once)

    def set_psn_drop_once(self, psns: Iterable[int]) -> None:
        t = self._bpf[b"fi_psn_once"]
        t.clear()
        counts: dict[int, int] = {}
        for p in psns:
            counts[int(p) & 0xFFFFFF] = counts.get(int(p) & 0xFFFFFF, 0) + 1
        for p, n in counts.items():
            t[t.Key(p)] = t.Leaf(n)

    def reset(self) -> None:
        """Zero the packet index, every_nth/limit state and all counters, so the
        next frame is packet index 0 again (same seed -> same pattern)."""
        st = self._bpf[b"fi_state"]
        st[st.Key(0)] = st.Leaf()
        cnt = self._bpf[b"fi_counters"]
        ncpu = len(cnt[cnt.Key(0)])
        for i in range(len(COUNTERS)):
            cnt[cnt.Key(i)] = cnt.Leaf(*([0] * ncpu))
        for k in self._user:
            self._user[k] = 0

    @property
    def config(self) -> dict:
        return dict(self._cfg)

    # -- counters ----------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Kernel counters (summed over CPUs) plus the reinjector's own:
        reinjected, reinject_failed, delay_lost (perf buffer overrun), flushed
        (still held at close and sent at once)."""
        if self._bpf is None:
            return dict(self.final_stats) if self.final_stats else dict.fromkeys(COUNTERS, 0) | dict(self._user)
        t = self._bpf[b"fi_counters"]
        out = {name: int(t.sum(t.Key(i)).value) for i, name in enumerate(COUNTERS)}
        out.update(self._user)
        out["held"] = len(self._held)
        return out

    def index(self) -> int:
        """Packet index the next UDP/4791 frame will get."""
        st = self._bpf[b"fi_state"]
        return int(st[st.Key(0)].index)

    # -- delayed frames --------------------------------------------------------------
    def _on_delayed(self, cpu, data, size) -> None:
        meta = ctypes.cast(data, ctypes.POINTER(_DelayMeta)).contents
        n = min(meta.len, size - ctypes.sizeof(_DelayMeta))
        frame = ctypes.string_at(data + ctypes.sizeof(_DelayMeta), n)
        due = meta.ktime_ns + int(self._cfg["reorder_delay_us"]) * 1000
        with self._held_lock:
            heapq.heappush(self._held, (due, meta.index, frame))

    def _on_lost(self, lost) -> None:
        self._user["delay_lost"] += int(lost)

    def _send_due(self, now_ns: int) -> None:
        while True:
            with self._held_lock:
                if not self._held or self._held[0][0] > now_ns:
                    return
                _, _, frame = heapq.heappop(self._held)
            try:
                self._tx.send(frame)
                self._user["reinjected"] += 1
            except OSError:
                self._user["reinject_failed"] += 1

    def _reinject_loop(self) -> None:
        while not self._stop.is_set():
            with self._held_lock:
                nxt = self._held[0][0] if self._held else None
            wait_ms = 20
            if nxt is not None:
                wait_ms = max(0, min(20, -(-(nxt - time.monotonic_ns()) // 1_000_000)))
            self._bpf.perf_buffer_poll(timeout=wait_ms)
            self._send_due(time.monotonic_ns())

    # -- teardown -------------------------------------------------------------------
    def close(self) -> None:
        """Detach and free everything; frames still held are sent at once.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            if self._attached or self._created_clsact:
                self._detach()
        finally:
            if self._tx is not None:
                with self._held_lock:
                    held, self._held = self._held, []
                for _, _, frame in sorted(held):
                    with contextlib.suppress(OSError):
                        self._tx.send(frame)
                        self._user["flushed"] += 1
                self._tx.close()
                self._tx = None
            if self._bpf is not None:
                self.final_stats = self.stats()
                self._bpf.cleanup()
                self._bpf = None

    def __enter__(self) -> FaultInjector:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()


# ---- CLI ------------------------------------------------------------------------------
def _parse_opcodes(text: str | None):
    """'ACKNOWLEDGE,0x0a' or 'mask:ACK' (every opcode with OpMask.ACK)."""
    if not text:
        return None
    if text.startswith("mask:"):
        m = OpMask(0)
        for name in text[5:].split("|"):
            m |= OpMask[name.strip().upper()]
        return m
    out = []
    for tok in text.split(","):
        tok = tok.strip()
        out.append(BY_NAME[tok.upper()].value if tok.upper() in BY_NAME else int(tok, 0))
    return out


def _parse_psns(text: str | None) -> list[int]:
    return [int(t, 0) for t in text.split(",")] if text else []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m metaroce_xdp.faults",
        description="Seeded fault injector on UDP/4791 (tc clsact + BPF).  Runs until --duration "
                    "elapses or SIGINT/SIGTERM, then prints the counters as JSON.",
        epilog="example: ip netns exec a python -m metaroce_xdp.faults --dev veth0 --seed 7 "
               "--drop-ppm 10000 --reorder-ppm 5000 --duration 30")
    ap.add_argument("--dev", required=True, help="device to attach to")
    ap.add_argument("--netns", help="ip netns name holding the device (default: the current one)")
    ap.add_argument("--ingress", action="store_true", help="attach on ingress instead of egress")
    ap.add_argument("--seed", type=lambda s: int(s, 0), default=0)
    ap.add_argument("--drop-ppm", type=int, default=0)
    ap.add_argument("--dup-ppm", type=int, default=0)
    ap.add_argument("--corrupt-ppm", type=int, default=0)
    ap.add_argument("--reorder-ppm", type=int, default=0)
    ap.add_argument("--reorder-delay-us", type=int, default=2000)
    ap.add_argument("--ecn-ce-ppm", type=int, default=0, help="mark CE on this share of ECT frames")
    ap.add_argument("--corrupt-offset", type=int, default=None, help="byte offset from the BTH start")
    ap.add_argument("--fix-udp-csum", action="store_true")
    ap.add_argument("--opcodes", help="e.g. 'ACKNOWLEDGE,NATIVE_SACK' or 'mask:ACK'")
    ap.add_argument("--every-nth", type=int, default=0)
    ap.add_argument("--limit", type=int, default=0, help="act on at most this many frames")
    ap.add_argument("--psn-drop-once", help="comma-separated PSNs to drop once each")
    ap.add_argument("--duration", type=float, default=0.0, help="seconds; 0 = until signalled")
    a = ap.parse_args(argv)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    fi = FaultInjector(a.dev, netns=a.netns, direction="ingress" if a.ingress else "egress",
                       seed=a.seed, drop_ppm=a.drop_ppm, dup_ppm=a.dup_ppm, corrupt_ppm=a.corrupt_ppm,
                       reorder_ppm=a.reorder_ppm, reorder_delay_us=a.reorder_delay_us,
                       ecn_ce_ppm=a.ecn_ce_ppm, corrupt_offset=a.corrupt_offset, fix_udp_csum=a.fix_udp_csum,
                       opcode_filter=_parse_opcodes(a.opcodes), every_nth=a.every_nth,
                       action_limit=a.limit, psn_drop_once=_parse_psns(a.psn_drop_once))
    try:
        print(json.dumps({"event": "ready", "dev": a.dev, "ifindex": fi.ifindex,
                          "direction": fi.direction, "seed": a.seed}), flush=True)
        deadline = time.monotonic() + a.duration if a.duration > 0 else None
        while not stop.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            stop.wait(0.2 if left is None else min(0.2, left))
    finally:
        fi.close()
    cfg = fi.config
    cfg["opcode_filter"] = a.opcodes
    print(json.dumps({"event": "stats", "dev": a.dev, "config": cfg, "counters": fi.final_stats}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
