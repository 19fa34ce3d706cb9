"""Load, attach and share the MetaRoCE XDP program (bpf/metaroce_xdp.c).

    ld = XdpLoader(max_qps=1024)              # compile with BCC, -D flags only
    ld.set_config(local_ip4="10.55.0.2")
    ld.install_qp(0x11, peer_ip="10.55.0.1", dest_qpn=0x22, state=QpState.RTS, init_psn=100)
    ld.attach("veth0")                         # driver mode; pins maps for the CLI
    ld.qps[0x11 % ld.max_qps]["ack_psn"]       # mmapped mr_qps, a numpy structured array
    ld.drops(), ld.events()                    # per-CPU counters summed, by name
    ld.close()                                 # detach, unpin, unmap (idempotent)

Pinned maps (read by the CLI): /sys/fs/bpf/metaroce/<ifname>/{mr_qps,mr_drops,
mr_events,mr_cfg}; removed by detach()/close().

Neighbours: layout.py (dtypes, enums), bpfsys.py (test run, pin),
metaroce_xdp/afxdp (sockets whose fds go into mr_xsks via set_xsk()).
"""
from __future__ import annotations

import ctypes as ct
import enum
import ipaddress
import mmap
import os
import threading

from pathlib import Path

import numpy as np

from . import bpfsys
from .layout import (CONFIG_DTYPE, MR_MAX_RXQ, PSN_MASK, PSN_NONE, QP_STATE_DTYPE, QP_STATE_SIZE, CfgFlag,
                     DropReason, Event, Profile, QpState, peer_ip_bytes)

BPF_DIR = Path(__file__).resolve().parents[2] / "bpf"
PROG_SRC = "metaroce_xdp.c"
PROG_FUNC = b"xdp_metaroce"
PIN_ROOT = "/sys/fs/bpf/metaroce"
PINNED_MAPS = ("mr_qps", "mr_drops", "mr_events", "mr_cfg")

XDP_FLAGS_SKB_MODE = 1 << 1
XDP_FLAGS_DRV_MODE = 1 << 2


_libc = ct.CDLL(None, use_errno=True)
_CLONE_NEWNET = 0x40000000


def pin_name(ifname: str) -> str:
    """The pin directory of an interface: its name in the initial network namespace,
    `<ifname>@netns<inode>` in any other (bpffs is shared by every namespace that
    mounts it, so names alone would collide)."""
    try:
        here = os.stat("/proc/thread-self/ns/net").st_ino
    except OSError:
        return ifname
    try:
        init = os.stat("/proc/1/ns/net").st_ino
    except OSError:
        init = None          # PID 1 not ours to inspect (a sandbox): always qualify the name
    return ifname if here == init else f"{ifname}@netns{here}"


class XdpMode(enum.Enum):
    DRV = "drv"      # native driver mode (veth supports it; the default)
    SKB = "skb"      # generic mode: any interface, slower, no zero-copy AF_XDP

    @property
    def flags(self) -> int:
        return XDP_FLAGS_DRV_MODE if self is XdpMode.DRV else XDP_FLAGS_SKB_MODE


class LoaderError(RuntimeError):
    """Loading, attaching or pinning failed; the message says what to check."""


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class XdpLoader:
    def __init__(self, max_qps: int = 1024, max_rxq: int = MR_MAX_RXQ, verify_ack_icrc: bool = True,
                 defines: dict[str, int] | None = None, bpf_dir: Path | str = BPF_DIR):
        if not _pow2(max_qps):
            raise ValueError(f"max_qps must be a power of two, got {max_qps}")
        from bcc import BPF      # imported late: layout/bpfsys stay usable without BCC
        self._BPF = BPF
        self.max_qps = max_qps
        self.bpf_dir = Path(bpf_dir).resolve()
        params = {"MR_MAX_QPS": max_qps, "MR_MAX_RXQ": max_rxq,
                  "MR_VERIFY_ACK_ICRC": int(verify_ack_icrc), **(defines or {})}
        self.cflags = [f"-I{self.bpf_dir}"] + [f"-D{k}={int(v)}" for k, v in params.items()]
        try:
            self.bpf = BPF(src_file=str(self.bpf_dir / PROG_SRC).encode(), cflags=self.cflags)
            self.fn = self.bpf.load_func(PROG_FUNC, BPF.XDP)
        except Exception as e:
            raise LoaderError(f"could not compile/load {PROG_SRC} ({e}); run as root with BCC "
                              f"and kernel headers installed") from e
        self.prog_fd = self.fn.fd
        self._ifname: str | None = None
        self._mode: XdpMode | None = None
        self._pin_dir: Path | None = None
        self._closed = False
        self._map_qps()

    # ---- shared QP table --------------------------------------------------
    def _map_qps(self) -> None:
        fd = self.bpf[b"mr_qps"].map_fd
        size = self.max_qps * QP_STATE_SIZE
        size = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        self._qps_mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        #: the mr_qps array as numpy records, one per slot (shared with the kernel)
        self.qps = np.frombuffer(self._qps_mm, dtype=QP_STATE_DTYPE, count=self.max_qps)

    def slot_of(self, qpn: int) -> int:
        return qpn % self.max_qps

    def qp(self, qpn: int) -> np.ndarray:
        """The 0-d record view of qpn's slot (live: reads see kernel writes)."""
        return self.qps[self.slot_of(qpn)]

    def install_qp(self, qpn: int, *, peer_ip, dest_qpn: int, state: QpState = QpState.RTS,
                   profile: Profile = Profile.COMPAT, pmtu: int = 1024, flags: int = 0,
                   init_psn: int = 0, pkey: int = 0xFFFF) -> np.ndarray:
        """Publish a QP (the slot protocol of metaroce_structs.h): qpn = 0, every field,
        then qpn.  On x86 stores are not reordered with stores, and numpy writes in
        program order, so the kernel never sees qpn before the rest."""
        if not 0 < qpn <= 0xFFFFFF:
            raise ValueError(f"qpn must be in 1..2^24-1 (0 marks an unused slot), got {qpn}")
        s = self.qps[self.slot_of(qpn):self.slot_of(qpn) + 1]
        if s["qpn"][0] not in (0, qpn):
            raise ValueError(f"slot {self.slot_of(qpn)} holds QP {int(s['qpn'][0]):#x}; "
                             f"choose a QPN that differs modulo {self.max_qps}")
        s["qpn"] = 0
        rec = np.zeros(1, dtype=QP_STATE_DTYPE)
        rec["state"] = int(state)
        rec["profile"] = int(profile)
        rec["flags"] = flags
        rec["dest_qpn"] = dest_qpn
        rec["pmtu"] = pmtu
        rec["pkey"] = pkey & 0xFFFF          # MR-BTH-010: the kernel compares BTH.P_Key with it
        rec["peer_ip"][0] = np.frombuffer(peer_ip_bytes(peer_ip), dtype=np.uint8)
        rec["snd_nxt"] = init_psn & PSN_MASK
        rec["comp_psn"] = init_psn & PSN_MASK
        rec["nak_read_psn"] = PSN_NONE
        rec["ack_psn"] = (init_psn - 1) & PSN_MASK
        rec["qpn"] = 0
        s[:] = rec                  # everything but the publication word
        s["qpn"] = qpn              # publish last
        return self.qps[self.slot_of(qpn)]

    def clear_qp(self, qpn: int) -> None:
        s = self.qps[self.slot_of(qpn):self.slot_of(qpn) + 1]
        if s["qpn"][0] != qpn:
            return
        s["qpn"] = 0                # unpublish first, then wipe
        s[:] = np.zeros(1, dtype=QP_STATE_DTYPE)

    def set_qp_state(self, qpn: int, state: QpState) -> None:
        self.qps[self.slot_of(qpn)]["state"] = int(state)

    # ---- endpoint configuration ---------------------------------------------
    def set_config(self, local_ip4=None, local_ip6=None, local_mac=None) -> None:
        rec = np.zeros(1, dtype=CONFIG_DTYPE)
        flags = 0
        if local_ip4 is not None:
            rec["local_ip4"][0] = np.frombuffer(ipaddress.IPv4Address(str(local_ip4)).packed, np.uint8)
            flags |= CfgFlag.HAVE_IP4
        if local_ip6 is not None:
            rec["local_ip6"][0] = np.frombuffer(ipaddress.IPv6Address(str(local_ip6)).packed, np.uint8)
            flags |= CfgFlag.HAVE_IP6
        if local_mac is not None:
            mac = bytes.fromhex(local_mac.replace(":", "")) if isinstance(local_mac, str) else bytes(local_mac)
            rec["local_mac"][0] = np.frombuffer(mac, np.uint8)
            flags |= CfgFlag.HAVE_MAC
        rec["flags"] = int(flags)
        t = self.bpf[b"mr_cfg"]
        t[t.Key(0)] = t.Leaf.from_buffer_copy(rec.tobytes())

    # ---- counters -----------------------------------------------------------
    def _percpu(self, name: str, enum_cls) -> dict[str, int]:
        t = self.bpf[name.encode()]
        return {m.name: int(t.sum(t.Key(int(m))).value) for m in enum_cls}

    def drops(self) -> dict[str, int]:
        """Per-CPU drop counters summed, by reason name (NONE excluded)."""
        d = self._percpu("mr_drops", DropReason)
        d.pop("NONE", None)
        return d

    def events(self) -> dict[str, int]:
        return self._percpu("mr_events", Event)

    # ---- AF_XDP sockets -------------------------------------------------------
    def set_xsk(self, queue: int, xsk_fd: int) -> None:
        t = self.bpf[b"mr_xsks"]
        t[t.Key(queue)] = t.Leaf(xsk_fd)

    def clear_xsk(self, queue: int) -> None:
        t = self.bpf[b"mr_xsks"]
        try:
            del t[t.Key(queue)]
        except KeyError:
            pass

    # ---- attach / pin -----------------------------------------------------------
    def attach(self, ifname: str, mode: XdpMode = XdpMode.DRV, pin: bool = True) -> None:
        if self._ifname is not None:
            raise LoaderError(f"already attached to {self._ifname}; detach() first")
        try:
            self._BPF.attach_xdp(ifname.encode(), self.fn, mode.flags)
        except Exception as e:
            hint = " (try mode=XdpMode.SKB)" if mode is XdpMode.DRV else ""
            raise LoaderError(f"attaching XDP to {ifname} in {mode.value} mode failed: {e}{hint}") from e
        self._ifname, self._mode = ifname, mode
        # Remember the network namespace: detach() may run from another thread
        # (or after the caller left the namespace) and must find the same device.
        self._netns_fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        if pin:
            self.pin(ifname)

    def detach(self) -> None:
        """Remove the program from the interface and unpin; safe to call twice, and
        after the interface is gone."""
        ifname, mode = self._ifname, self._mode
        self._ifname = self._mode = None
        nsfd, self._netns_fd = getattr(self, "_netns_fd", None), None
        if ifname is not None:
            def remove() -> None:
                try:
                    if nsfd is not None and _libc.setns(nsfd, _CLONE_NEWNET) != 0:
                        return       # namespace gone: the device (and program) went with it
                    self._BPF.remove_xdp(ifname.encode(), mode.flags)
                except Exception:
                    pass             # interface already deleted: nothing to detach
            # a throwaway thread, so setns never moves the caller's thread
            t = threading.Thread(target=remove, name="xdp-detach")
            t.start()
            t.join(timeout=10)
        if nsfd is not None:
            os.close(nsfd)
        self.unpin()

    def pin(self, ifname: str) -> Path | None:
        """Pin the maps the CLI reads under PIN_ROOT/<pin_name(ifname)>/; skipped (None)
        when bpffs is not mounted, e.g. under `ip netns exec`, which remounts /sys."""
        if not os.path.ismount(os.path.dirname(PIN_ROOT)):
            self._pin_dir = None
            return None
        d = Path(PIN_ROOT) / pin_name(ifname)
        d.mkdir(parents=True, exist_ok=True)
        for name in PINNED_MAPS:
            p = d / name
            if p.exists():
                p.unlink()           # stale pin of an earlier run
            bpfsys.obj_pin(self.bpf[name.encode()].map_fd, str(p))
        self._pin_dir = d
        return d

    def unpin(self) -> None:
        d, self._pin_dir = self._pin_dir, None
        if d is None:
            return
        for name in PINNED_MAPS:
            try:
                (d / name).unlink()
            except FileNotFoundError:
                pass
        for p in (d, d.parent):
            try:
                p.rmdir()
            except OSError:
                break                # not empty: another interface still pinned

    # ---- test hook ------------------------------------------------------------------
    def test_run(self, frame: bytes) -> bpfsys.TestRunResult:
        return bpfsys.prog_test_run(self.prog_fd, frame)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.detach()
        self.qps = None
        try:
            self._qps_mm.close()
        except BufferError:
            pass                     # a caller still holds a view: the GC unmaps it later
        self.bpf.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
