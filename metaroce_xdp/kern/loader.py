"""Load, attach and share the MetaRoCE XDP program (bpf/metaroce_xdp.c).

    ld = XdpLoader(max_qps=1024)              # compile with BCC, -D flags only; frags-aware
    ld.set_config(local_ip4="10.55.0.2")
    ld.install_qp(0x11, peer_ip="10.55.0.1", dest_qpn=0x22, state=QpState.RTS, init_psn=100)
    ld.attach("veth0")                         # driver mode, through a bpf_link; pins maps for the CLI
    ld.qps[0x11 % ld.max_qps]["ack_psn"]       # mmapped mr_qps, a numpy structured array
    ld.sacks[ring]                             # mmapped mr_sacks: native QPs' SACK rings (set_sack_ring)
    ld.drops(), ld.events()                    # per-CPU counters summed, by name
    ld.close()                                 # unpin, detach, unmap (idempotent)

Ownership.  The program is attached through a bpf_link (BPF_LINK_CREATE, BPF_XDP), not
netlink: the link's file descriptor owns the attachment, so when the owning process dies
(even SIGKILLed) the kernel detaches the program and the interface carries RoCE traffic
to the normal stack again instead of black-holing it.  The link is also the lock: an
interface takes one XDP link per mode and refuses a link while any XDP program is
attached, so a second owner's attach() fails with `XdpBusy` (typed, naming the holding
process when it can find it) and touches nothing of the first owner's.

Pinned maps (read by the CLI): /sys/fs/bpf/metaroce/<pin_name(ifname)>/{mr_qps,mr_drops,
mr_events,mr_cfg}.  Pins do not keep a program attached, so a SIGKILLed owner leaves them
behind.  They are only ever written by the holder of the interface's link: attach() pins
after the link exists, so pins it finds there are a dead owner's leftovers, which it
replaces (counted in `stale_pins_removed`); detach() unpins (only pins that are still its
own maps) before it releases the link.  A live owner's pins are therefore never unlinked.

Multi-buffer (frags=True, the default): the program is loaded with BPF_F_XDP_HAS_FRAGS
(BCC 0.26's Python load_func cannot pass prog_flags, so the instructions BCC compiled are
loaded with bpfsys.prog_load), which lets veth and drivers run it on frames larger than a
page (MTU 9000; path MTU 4096).  It parses the headers in the first buffer and reads the
ACK/CNP ICRC input with bpf_xdp_load_bytes, which spans fragments.  frags=False loads it
through BCC as before.

Neighbours: layout.py (dtypes, enums), bpfsys.py (test run, pin, load, link),
metaroce_xdp/afxdp (sockets whose fds go into mr_xsks via set_xsk()).
"""
from __future__ import annotations

import enum
import errno
import ipaddress
import logging
import mmap
import os
import socket
import time

from pathlib import Path

import numpy as np

from . import bccbuild, bpfsys
from .layout import (CONFIG_DTYPE, MR_MAX_RXQ, MR_SACK_RINGS, PSN_MASK, PSN_NONE, QP_STATE_DTYPE, QP_STATE_SIZE,
                     SACK_RING_DTYPE, CfgFlag, DropReason, Event, Profile, QpState, peer_ip_bytes)

log = logging.getLogger("metaroce.kern")

BPF_DIR = bccbuild.BPF_DIR
PROG_SRC = bccbuild.PROG_SRC
PROG_FUNC = b"xdp_metaroce"
PIN_ROOT = "/sys/fs/bpf/metaroce"
PINNED_MAPS = ("mr_qps", "mr_drops", "mr_events", "mr_cfg")

XDP_FLAGS_SKB_MODE = 1 << 1
XDP_FLAGS_DRV_MODE = 1 << 2



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


def pinned_map_id(path) -> int | None:
    """Id of the map pinned at path, None when nothing (readable) is pinned there."""
    try:
        fd = bpfsys.obj_get(str(path))
    except OSError:
        return None
    try:
        return bpfsys.map_info(fd).id
    finally:
        os.close(fd)


def busy_error(ifname: str, prog_id: int | None) -> XdpBusy:
    """The XdpBusy for an interface whose XDP program is prog_id, naming who holds it."""
    holders = bpfsys.xdp_link_holders(prog_id) if prog_id else []
    if holders:
        who = f"held through a bpf_link by pid {', '.join(map(str, holders))}"
    elif prog_id:
        who = f"attached through netlink (`ip link set dev {ifname} xdp off` removes it)"
    else:
        who = "held by another owner"
    return XdpBusy(f"{ifname} already has an XDP program (id {prog_id}), {who}: another MetaRoCE "
                   f"endpoint or tool owns this interface; close it first or use another interface",
                   ifname, prog_id, holders)


def check_interface_free(ifname: str) -> None:
    """Raise XdpBusy at once when ifname already has an XDP program: a cheap look before
    compiling one (seconds).  Only attach() takes the interface; this is no lock."""
    prog_id = attached_xdp_prog_id(ifname)
    if prog_id:
        raise busy_error(ifname, prog_id)


class XdpMode(enum.Enum):
    DRV = "drv"      # native driver mode (veth supports it; the default)
    SKB = "skb"      # generic mode: any interface, slower, no zero-copy AF_XDP

    @property
    def flags(self) -> int:
        return XDP_FLAGS_DRV_MODE if self is XdpMode.DRV else XDP_FLAGS_SKB_MODE


class LoaderError(RuntimeError):
    """Loading, attaching or pinning failed; the message says what to check."""


class XdpBusy(LoaderError):
    """The interface already has an XDP program: another endpoint (a live owner) or a tool
    holds it.  `holders` lists the PIDs holding its bpf_link, when they could be found."""

    def __init__(self, msg: str, ifname: str, prog_id: int | None, holders: list[int]):
        super().__init__(msg)
        self.ifname, self.prog_id, self.holders = ifname, prog_id, holders


XDP_FLAGS_SKB_MODE, XDP_FLAGS_DRV_MODE, XDP_FLAGS_HW_MODE = 1 << 1, 1 << 2, 1 << 3
# the per-mode program ids IFLA_XDP reports -> the flags that name the mode
_MODE_FLAGS = {"IFLA_XDP_DRV_PROG_ID": XDP_FLAGS_DRV_MODE, "IFLA_XDP_SKB_PROG_ID": XDP_FLAGS_SKB_MODE,
               "IFLA_XDP_HW_PROG_ID": XDP_FLAGS_HW_MODE}


def detach_xdp(ifname: str) -> bool:
    """Detach the XDP program that netlink attached to `ifname`, in whatever mode it was (`ip link set dev
    IF xdp off`, through pyroute2); True when there was one.  A program attached through a bpf_link is
    not detached this way (the kernel refuses): its link's owner holds it.  In the calling thread's
    network namespace."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError
    with IPRoute() as ipr:
        idx = ipr.link_lookup(ifname=ifname)
        if not idx:
            return False
        xdp = ipr.get_links(idx[0])[0].get_attr("IFLA_XDP")
        attrs = dict(xdp.get("attrs", [])) if xdp is not None else {}
        done = False
        for attr, flags in _MODE_FLAGS.items():
            if not attrs.get(attr):
                continue
            try:
                ipr.link("set", index=idx[0], xdp={"attrs": [("IFLA_XDP_FD", -1), ("IFLA_XDP_FLAGS", flags)]})
                done = True
            except NetlinkError:
                pass                               # held by a bpf_link: its owner detaches it
        return done


def attached_xdp_prog_id(ifname: str) -> int | None:
    """Id of the XDP program attached to `ifname` (any mode), None when there is none.
    Looked up in the calling thread's network namespace."""
    from pyroute2 import IPRoute
    with IPRoute() as ipr:
        idx = ipr.link_lookup(ifname=ifname)
        if not idx:
            return None
        xdp = ipr.get_links(idx[0])[0].get_attr("IFLA_XDP")
    if xdp is None:
        return None
    attrs = dict(xdp.get("attrs", [])) if isinstance(xdp, dict) else {k: v for k, v in xdp["attrs"]}
    if not attrs.get("IFLA_XDP_ATTACHED"):
        return None
    return attrs.get("IFLA_XDP_PROG_ID") or None


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class XdpLoader:
    def __init__(self, max_qps: int = 1024, max_rxq: int = MR_MAX_RXQ, verify_ack_icrc: bool = True,
                 defines: dict[str, int] | None = None, bpf_dir: Path | str = BPF_DIR, frags: bool = True,
                 sack_rings: int = MR_SACK_RINGS, compiled: bccbuild.Compiled | None = None):
        """compiled: the program compiled beforehand (bccbuild.compile_program, metaroced's start); used when
        its flags are these, else closed and compiled again."""
        if not _pow2(max_qps):
            raise ValueError(f"max_qps must be a power of two, got {max_qps}")
        from bcc import BPF      # imported late: layout/bpfsys stay usable without BCC
        self._BPF = BPF
        self.max_qps = max_qps
        self.sack_rings = sack_rings
        self.bpf_dir = Path(bpf_dir).resolve()
        self.cflags = bccbuild.cflags(max_qps, max_rxq, sack_rings, verify_ack_icrc, defines, self.bpf_dir)
        if compiled is not None and (compiled.used or compiled.cflags != self.cflags):
            compiled.close()
            compiled = None
        self.frags = frags
        self._own_prog_fd = -1
        self._link_fd = -1
        self.fn = None
        #: (wall, CPU) seconds of BCC compiling the program (clang; the maps created) and of the kernel loading
        #: it (verifier): {"compile": (w, c), "load": (w, c)}
        self.timings: dict[str, tuple[float, float]] = {}
        try:
            if compiled is not None:
                compiled.used = True
                self.bpf = compiled.bpf
                self.timings["compile"] = compiled.seconds
            else:
                c = bccbuild.compile_program(self.cflags, self.bpf_dir)
                c.used = True
                self.bpf = c.bpf
                self.timings["compile"] = c.seconds
            t1, c1 = time.monotonic(), time.thread_time()
            if frags:
                self.prog_fd = self._own_prog_fd = self._load_frags()
            else:
                self.fn = self.bpf.load_func(PROG_FUNC, BPF.XDP)
                self.prog_fd = self.fn.fd
            self.timings["load"] = (time.monotonic() - t1, time.thread_time() - c1)
        except Exception as e:
            raise LoaderError(f"could not compile/load {PROG_SRC} ({e}); run as root with BCC "
                              f"and kernel headers installed; the program needs Linux 5.18 or later "
                              f"(bpf_xdp_load_bytes, XDP frags), this kernel is {os.uname().release}") from e
        self._ifname: str | None = None
        self._mode: XdpMode | None = None
        self.drv_refused = ""             # attach_best: why native mode was refused ("" when it was not)
        self._pin_dir: Path | None = None
        self._pinned_ids: dict[str, int] = {}
        #: pins of a dead owner that attach() found and replaced (0 when the place was clean)
        self.stale_pins_removed = 0
        self._closed = False
        self._map_qps()
        self._map_sacks()

    def _load_frags(self) -> int:
        """BPF_PROG_LOAD of the instructions BCC compiled (map fds already in them), with
        BPF_F_XDP_HAS_FRAGS, which BCC 0.26's Python API cannot pass."""
        from bcc.libbcc import lib
        mod = self.bpf.module
        start = lib.bpf_function_start(mod, PROG_FUNC)
        size = lib.bpf_function_size(mod, PROG_FUNC)
        if not start or not size:
            raise LoaderError(f"BCC compiled no function {PROG_FUNC.decode()} in {PROG_SRC}")
        return bpfsys.prog_load(bpfsys.BPF_PROG_TYPE_XDP, start, size, lib.bpf_module_license(mod),
                                kern_version=lib.bpf_module_kern_version(mod),
                                prog_flags=bpfsys.BPF_F_XDP_HAS_FRAGS, name=PROG_FUNC)

    # ---- shared QP table --------------------------------------------------
    def _map_qps(self) -> None:
        fd = self.bpf[b"mr_qps"].map_fd
        size = self.max_qps * QP_STATE_SIZE
        size = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        self._qps_mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        #: the mr_qps array as numpy records, one per slot (shared with the kernel)
        self.qps = np.frombuffer(self._qps_mm, dtype=QP_STATE_DTYPE, count=self.max_qps)

    # ---- NATIVE_SACK rings (MR-SACK-043) -------------------------------------
    def _map_sacks(self) -> None:
        fd = self.bpf[b"mr_sacks"].map_fd
        size = self.sack_rings * SACK_RING_DTYPE.itemsize
        size = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        self._sacks_mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        #: the mr_sacks rings as numpy records (shared with the kernel; struct mr_sack_ring)
        self.sacks = np.frombuffer(self._sacks_mm, dtype=SACK_RING_DTYPE, count=self.sack_rings)

    def set_sack_ring(self, qpn: int, ring: int | None, owner: int = 0) -> None:
        """Native QP qpn's NATIVE_SACKs go to ring `ring` of mr_sacks from now on (None: to the AF_XDP
        socket again).  What the ring still holds is skipped (cons = prod), and `owner` (the consumer's
        QP row + 1) recorded, before the kernel is told of the ring."""
        s = self.qps[self.slot_of(qpn)]
        if ring is None:
            s["sack_ring"] = 0
            return
        if not 0 <= ring < self.sack_rings:
            raise ValueError(f"SACK ring {ring} out of range (the program has {self.sack_rings})")
        r = self.sacks[ring]
        r["owner"] = owner
        r["cons"] = int(r["prod"])
        s["sack_ring"] = ring + 1

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
    @property
    def attached(self) -> bool:
        return self._link_fd >= 0

    def attach_best(self, ifname: str, pin: bool = True) -> XdpMode:
        """Native (driver) mode, else generic mode where the driver refuses native XDP (no ndo_bpf:
        EOPNOTSUPP; this program or MTU in its native mode: EINVAL, ERANGE), with a warning -- never a
        crash for want of driver support.  Returns the mode attached."""
        try:
            self.attach(ifname, XdpMode.DRV, pin)
            return XdpMode.DRV
        except XdpBusy:
            raise
        except LoaderError as e:
            cause = e.__cause__
            if not (isinstance(cause, OSError) and cause.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ERANGE)):
                raise
            self.drv_refused = f"native XDP refused on {ifname}: {os.strerror(cause.errno)}"
        log.warning("%s; attaching in generic mode (slower: the kernel builds an skb per frame)", self.drv_refused)
        self.attach(ifname, XdpMode.SKB, pin)
        return XdpMode.SKB

    def attach(self, ifname: str, mode: XdpMode = XdpMode.DRV, pin: bool = True) -> None:
        """Attach through a bpf_link owned by this process (see the module docstring), in the
        calling thread's network namespace.  XdpBusy when the interface already has an XDP
        program; LoaderError for anything else."""
        if self._ifname is not None:
            raise LoaderError(f"already attached to {self._ifname}; detach() first")
        try:
            ifindex = socket.if_nametoindex(ifname)
        except OSError as e:
            raise LoaderError(f"no interface {ifname!r} in this network namespace") from e
        try:
            link = bpfsys.link_create(self.prog_fd, ifindex, bpfsys.BPF_XDP, mode.flags)
        except OSError as e:
            if e.errno in (errno.EBUSY, errno.EEXIST):
                raise self._busy(ifname) from e
            hint = " (try mode=XdpMode.SKB)" if mode is XdpMode.DRV else ""
            if e.errno == errno.ERANGE or (self.frags is False and e.errno == errno.EINVAL):
                hint += "; the interface MTU may be too large for a program without frags support"
            raise LoaderError(f"attaching XDP to {ifname} in {mode.value} mode failed: {e}{hint}") from e
        os.set_inheritable(link, False)
        self._link_fd = link
        self._ifname, self._mode = ifname, mode
        if pin:
            try:
                self.pin(ifname)
            except BaseException:
                self.detach()
                raise

    def _busy(self, ifname: str) -> XdpBusy:
        try:
            prog_id = attached_xdp_prog_id(ifname)
        except Exception:
            prog_id = None
        return busy_error(ifname, prog_id)

    def detach(self) -> None:
        """Unpin (our own pins only), then release the link, which detaches the program; safe
        to call twice, from any thread, and after the interface is gone."""
        self.unpin()
        link, self._link_fd = self._link_fd, -1
        self._ifname = self._mode = None
        if link >= 0:
            os.close(link)

    def pin(self, ifname: str) -> Path | None:
        """Pin the maps the CLI reads under PIN_ROOT/<pin_name(ifname)>/; skipped (None)
        when bpffs is not mounted, e.g. under `ip netns exec`, which remounts /sys.
        Only the holder of the interface's link pins (attach() calls this), so a pin
        already there is a dead owner's and is replaced."""
        if not os.path.ismount(os.path.dirname(PIN_ROOT)):
            self._pin_dir = None
            return None
        if self._link_fd < 0:
            raise LoaderError("pin() before attach(): only the owner of the interface's XDP link pins")
        d = Path(PIN_ROOT) / pin_name(ifname)
        d.mkdir(parents=True, exist_ok=True)
        self._pin_dir = d
        for name in PINNED_MAPS:
            p = d / name
            fd = self.bpf[name.encode()].map_fd
            if p.exists():
                p.unlink()           # a dead owner's (we hold the link): see the module docstring
                self.stale_pins_removed += 1
            bpfsys.obj_pin(fd, str(p))
            self._pinned_ids[name] = bpfsys.map_info(fd).id
        return d

    def unpin(self) -> None:
        d, self._pin_dir = self._pin_dir, None
        ids, self._pinned_ids = self._pinned_ids, {}
        if d is None:
            return
        for name in PINNED_MAPS:
            if name in ids and pinned_map_id(d / name) == ids[name]:
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
        self.sacks = None
        for mm in (self._qps_mm, self._sacks_mm):
            try:
                mm.close()
            except BufferError:
                pass                 # a caller still holds a view: the GC unmaps it later
        if self._own_prog_fd >= 0:
            os.close(self._own_prog_fd)
            self._own_prog_fd = -1
        self.bpf.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
