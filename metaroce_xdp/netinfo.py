"""What the endpoint needs from the kernel's network configuration, via pyroute2:
an interface's MAC, MTU and addresses, and the path to a peer: the route the
kernel's forwarding table picks for it (gateway or on-link, output interface,
preferred source) and the MAC of that next hop from the neighbour table
(resolved through the kernel's ARP/ND when absent).  RoCEv2 is routed: the
destination MAC of a frame is the next hop's, never the peer's own unless the
peer is on-link.

PathWatch keeps running QPs on the kernel's current path: it re-resolves them on
netlink route/neighbour events and on local ACK timeouts.

Neighbours: afxdp/port.py (one PathResolver per port), dp/context.py (_Paths: the
compiled plane's side of PathWatch)."""
from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import logging
import os
import queue
import select
import socket
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from pyroute2 import IPRoute
from pyroute2.netlink import NETLINK_ROUTE
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl import (RTM_DELADDR, RTM_DELNEIGH, RTM_DELROUTE, RTM_NEWADDR, RTM_NEWNEIGH, RTM_NEWROUTE,
                                   RTMGRP_IPV4_IFADDR, RTMGRP_IPV4_ROUTE, RTMGRP_IPV6_IFADDR, RTMGRP_IPV6_ROUTE,
                                   RTMGRP_NEIGH)
from pyroute2.netlink.rtnl.marshal import MarshalRtnl

from .verbs_types import QPState, VerbsError

NUD_VALID = 0x02 | 0x04 | 0x08 | 0x10 | 0x40 | 0x80   # REACHABLE STALE DELAY PROBE NOARP PERMANENT
RTN_UNICAST, RTN_LOCAL = 1, 2
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
log = logging.getLogger("metaroce.netinfo")
DISCARD_PORT = 9                                        # where neighbour probes go (RFC 863)


class NetInfoError(VerbsError):
    pass


@dataclass
class IfaceInfo:
    name: str
    index: int
    mac: str
    mtu: int
    ipv4: list[str]
    ipv6: list[str]


def iface_info(ifname: str) -> IfaceInfo:
    with IPRoute() as ipr:
        idx = ipr.link_lookup(ifname=ifname)
        if not idx:
            raise NetInfoError(f"no interface {ifname!r} in this network namespace (see `ip link`)")
        link = ipr.get_links(idx[0])[0]
        v4, v6 = [], []
        for a in ipr.get_addr(index=idx[0]):
            addr = a.get_attr("IFA_ADDRESS")
            if a["family"] == socket.AF_INET:
                v4.append(addr)
            elif a["family"] == socket.AF_INET6 and not addr.startswith("fe80"):
                v6.append(addr)
        return IfaceInfo(ifname, idx[0], link.get_attr("IFLA_ADDRESS"), link.get_attr("IFLA_MTU"), v4, v6)


def rx_queues(ifname: str) -> int:
    """The interface's active RX queues, as `ethtool -l` counts them (rx + combined channels); where the
    driver reports no channels, the RX queues the device was made with (IFLA_NUM_RX_QUEUES).  An AF_XDP
    socket can bind to queue ids below this number."""
    from pyroute2.ethtool.ioctl import IoctlEthtool
    try:
        e = IoctlEthtool(ifname)
        try:
            ch = e.get_channels()
            n = int(ch.rx_count) + int(ch.combined_count)
        finally:
            e.close()
        if n > 0:
            return n
    except Exception:  # noqa: BLE001 -- no ETHTOOL_GCHANNELS in this driver (lo, dummy, tun...)
        pass
    with IPRoute() as ipr:
        idx = ipr.link_lookup(ifname=ifname)
        if not idx:
            raise NetInfoError(f"no interface {ifname!r} in this network namespace (see `ip link`)")
        return max(1, int(ipr.get_links(idx[0])[0].get_attr("IFLA_NUM_RX_QUEUES") or 1))


def _norm(ip: str) -> str:
    return str(ipaddress.ip_address(ip))


@dataclass(frozen=True)
class NextHop:
    """The path to `dst` as the kernel's forwarding table gives it."""

    dst: str
    via: str | None        # the gateway; None when dst is on-link
    ifname: str
    ifindex: int
    src: str | None        # the route's preferred source (RTA_PREFSRC), one of the interface's addresses
    mac: str               # the next hop's MAC (the gateway's, or dst's own when on-link)

    @property
    def hop(self) -> str:
        return self.via or self.dst


class PathResolver:
    """Route and neighbour lookups for one interface, served by one small thread.

    pyroute2 opens one netlink socket per calling thread, in whatever network namespace
    that thread is in; so every lookup runs on this resolver's own thread, which enters
    the namespace its creator was in (where the interface lives) and keeps its sockets
    there.  Calls from other threads are queued to it and waited for; `submit` queues
    work without waiting.  The same thread follows the kernel's route and neighbour
    events (rtnetlink multicast groups) and tells `watch` callbacks when something that
    may change a path happened.  Callbacks and submitted work run on this thread: they
    must not wait for anything that itself waits for this thread."""

    def __init__(self, ifname: str, start_timeout: float = 10.0) -> None:
        self.ifname = ifname
        self.index = 0
        self._nsfd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._listeners: list = []
        self._stop = False
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self.events = 0                               # relevant netlink events seen
        self._addr_cache: dict[int, set[str]] = {}
        self._marshal = MarshalRtnl()                   # parses the events of the monitor socket
        self._thread = threading.Thread(target=self._serve, name=f"metaroce-paths-{ifname}", daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout):
            self.close()
            raise NetInfoError(f"the path resolver for {ifname} did not start within {start_timeout}s")
        if self._error is not None:
            self.close()
            raise self._error

    # -- the thread ----------------------------------------------------------------
    def _serve(self) -> None:
        ipr = mon = None
        self._probe_socks: dict[int, socket.socket] = {}
        try:
            try:
                # setns only when this thread is elsewhere: it needs CAP_SYS_ADMIN, which metaroced lacks
                st, here = os.fstat(self._nsfd), os.stat("/proc/thread-self/ns/net")
                if (st.st_dev, st.st_ino) != (here.st_dev, here.st_ino) and _libc.setns(self._nsfd, CLONE_NEWNET) != 0:
                    e = ctypes.get_errno()
                    raise NetInfoError(f"cannot enter the network namespace of {self.ifname}: {os.strerror(e)}")
                ipr = self._ipr = IPRoute()
                idx = ipr.link_lookup(ifname=self.ifname)
                if not idx:
                    raise NetInfoError(f"no interface {self.ifname!r} in this network namespace (see `ip link`)")
                self.index = idx[0]
                # Neighbour probes: a datagram to the destination makes the kernel resolve the
                # next hop of its route (ARP for IPv4, neighbour solicitation for IPv6).
                for fam in (socket.AF_INET, socket.AF_INET6):
                    try:
                        s = socket.socket(fam, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, self.ifname.encode())
                        self._probe_socks[fam] = s
                    except OSError:
                        pass                           # no IPv6 here: asked for, it fails with a message
                mon = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK, NETLINK_ROUTE)
                mon.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
                mon.bind((0, RTMGRP_NEIGH | RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_ROUTE | RTMGRP_IPV4_IFADDR
                          | RTMGRP_IPV6_IFADDR))
            except BaseException as e:  # noqa: BLE001 - reported to the constructor
                self._error = e if isinstance(e, NetInfoError) else NetInfoError(f"path resolver for {self.ifname}: {e}")
                return
            finally:
                self._ready.set()
            while not self._stop:
                r, _, _ = select.select([mon, self._wake_r], [], [], 1.0)
                changed = mon in r and self._drain(mon)
                if self._wake_r in r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                self._run_jobs()
                if changed and not self._stop:
                    self.events += 1
                    for cb in list(self._listeners):
                        try:
                            cb()
                        except Exception:  # noqa: BLE001 - a listener's bug must not stop resolution
                            log.exception("path listener failed")
        finally:
            self._stop = True
            self._run_jobs()                           # fail whatever is still queued
            for s in self._probe_socks.values():
                s.close()
            if mon is not None:
                mon.close()
            if ipr is not None:
                ipr.close()

    def _drain(self, mon: socket.socket) -> bool:
        """Read the pending netlink events; True when one may change a path through us."""
        relevant = False
        for _ in range(256):                           # bounded: events keep coming under churn
            try:
                data = mon.recv(1 << 16)
            except BlockingIOError:
                break
            except OSError:                            # ENOBUFS: events were lost, assume the worst
                relevant = True
                continue
            try:
                msgs = list(self._marshal.parse(data))     # pyroute2's rtnetlink parser
            except Exception:  # noqa: BLE001 - a message it cannot read: assume the worst, as for a loss
                relevant = True
                continue
            for msg in msgs:
                typ = msg["header"]["type"]
                if typ in (RTM_NEWROUTE, RTM_DELROUTE):
                    relevant = True
                elif typ in (RTM_NEWADDR, RTM_DELADDR):
                    self._addr_cache.clear()
                    relevant = True
                elif typ in (RTM_NEWNEIGH, RTM_DELNEIGH):
                    relevant |= msg.get("ifindex") == self.index
        return relevant

    def _run_jobs(self) -> None:
        while True:
            try:
                fn, args, fut = self._jobs.get_nowait()
            except queue.Empty:
                return
            if self._stop and fut is not None:
                fut.set_exception(NetInfoError(f"the path resolver for {self.ifname} is closed"))
                continue
            try:
                res = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                if fut is not None:
                    fut.set_exception(e)
                else:
                    log.warning("path resolver job failed: %s", e)
            else:
                if fut is not None:
                    fut.set_result(res)

    def _call(self, fn, *args, timeout: float = 30.0):
        if threading.get_ident() == self._thread.ident:
            return fn(*args)
        if self._stop:
            raise NetInfoError(f"the path resolver for {self.ifname} is closed")
        fut: Future = Future()
        self._jobs.put((fn, args, fut))
        self._wake()
        return fut.result(timeout)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def submit(self, fn, *args) -> None:
        """Run fn(*args) on the resolver thread later; never waits."""
        if not self._stop:
            self._jobs.put((fn, args, None))
            self._wake()

    def watch(self, callback) -> None:
        """callback() runs on the resolver thread after route or neighbour events of this interface."""
        self._listeners.append(callback)

    def close(self) -> None:
        self._stop = True
        self._wake()
        if self._thread.is_alive() and threading.get_ident() != self._thread.ident:
            self._thread.join(timeout=5)
        for fd in (self._wake_r, self._wake_w, self._nsfd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = self._nsfd = -1

    # -- the pieces (run on the resolver thread) --------------------------------------
    def _addresses(self, fam: int) -> set[str]:
        got = self._addr_cache.get(fam)            # dropped on address events (_drain)
        if got is None:
            got = self._addr_cache[fam] = {_norm(a.get_attr("IFA_ADDRESS"))
                                           for a in self._ipr.get_addr(index=self.index, family=fam)}
        return got

    def _route(self, dst: str) -> tuple[str | None, str | None]:
        try:
            addr = ipaddress.ip_address(dst)
        except ValueError:
            raise NetInfoError(f"{dst!r} is not an IP address") from None
        fam = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
        kw = {"dst": str(addr), "family": fam}
        if addr.version == 6 and addr.is_link_local:
            kw["oif"] = self.index                   # link-local: only this interface's link is meant
        try:
            msgs = list(self._ipr.route("get", **kw))
        except NetlinkError as e:
            raise NetInfoError(f"no route to {dst} from {self.ifname} ({e.args[-1] if e.args else e}): "
                               f"add one (ip route add {dst} via <gateway> dev {self.ifname})") from None
        if not msgs:
            raise NetInfoError(f"no route to {dst} from {self.ifname}: add one "
                               f"(ip route add {dst} via <gateway> dev {self.ifname})")
        m = msgs[0]
        if m["type"] == RTN_LOCAL:
            raise NetInfoError(f"{dst} is an address of this host: the peer must be on another host")
        if m["type"] != RTN_UNICAST:
            raise NetInfoError(f"the route to {dst} is not a unicast route (type {m['type']}): "
                               f"replace it (ip route replace {dst} via <gateway> dev {self.ifname})")
        oif = m.get_attr("RTA_OIF")
        if oif != self.index:
            links = self._ipr.get_links(oif) if oif else []
            other = links[0].get_attr("IFLA_IFNAME") if links else f"ifindex {oif}"
            raise NetInfoError(f"route to {dst} leaves through {other}, not {self.ifname}: add a route "
                               f"through {self.ifname} (ip route add {dst} via <gateway> dev {self.ifname}) "
                               f"or open the endpoint on {other}")
        via = m.get_attr("RTA_GATEWAY")
        src = m.get_attr("RTA_PREFSRC")
        if src is not None:
            src = _norm(src)
            mine = self._addresses(fam)
            if src not in mine:
                raise NetInfoError(f"the route to {dst} prefers source {src}, which is not an address of "
                                   f"{self.ifname} ({', '.join(sorted(mine)) or 'none'}): set the route's "
                                   f"source (ip route change <prefix> via <gateway> dev {self.ifname} "
                                   f"src <address of {self.ifname}>)")
        return (_norm(via) if via else None), src

    def _neighbour(self, ip: str) -> str | None:
        want = ipaddress.ip_address(ip)
        fam = socket.AF_INET6 if want.version == 6 else socket.AF_INET
        for n in self._ipr.get_neighbours(family=fam, ifindex=self.index):
            d = n.get_attr("NDA_DST")
            if d and ipaddress.ip_address(d) == want and n["state"] & NUD_VALID and n.get_attr("NDA_LLADDR"):
                return n.get_attr("NDA_LLADDR")
        return None

    def _send_probe(self, dst: str) -> None:
        fam = socket.AF_INET6 if ":" in dst else socket.AF_INET
        s = self._probe_socks.get(fam)
        if s is None:
            raise NetInfoError(f"cannot send on {self.ifname} for {dst}: no "
                               f"{'IPv6' if fam == socket.AF_INET6 else 'IPv4'} socket in this network namespace")
        try:
            s.sendto(b"metaroce neighbour probe", (dst, DISCARD_PORT))
        except OSError:
            pass                 # EAGAIN, or an ICMP error reported from an earlier probe: try again later

    def _lookup(self, dst: str, probe: bool = True) -> NextHop | None:
        via, src = self._route(dst)
        hop = via or _norm(dst)
        mac = self._neighbour(hop)
        if mac is None:
            if probe:
                self._send_probe(dst)
            return None
        return NextHop(_norm(dst), via, self.ifname, self.index, src, mac)

    def _until_resolved(self, lookup, route, dst: str, timeout: float) -> NextHop:
        """Poll `lookup` (each call probes) until the next hop's MAC is known or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while True:
            hop = lookup(dst)
            if hop is not None:
                return hop
            if time.monotonic() >= deadline:
                via, _ = route(dst)
                what = f"the gateway {via} (next hop to {dst})" if via else dst
                raise NetInfoError(f"could not resolve the MAC of {what} on {self.ifname} within {timeout}s: "
                                   f"is it up? (see `ip neigh show dev {self.ifname}`)")
            time.sleep(0.02)

    def _resolve(self, dst: str, timeout: float) -> NextHop:
        return self._until_resolved(self._lookup, self._route, dst, timeout)

    # -- the API (any thread) ------------------------------------------------------------
    def route(self, dst: str) -> tuple[str | None, str | None]:
        """(gateway or None when on-link, preferred source or None) of the kernel's route to dst.

        NetInfoError when there is none, it is not a unicast route, it leaves through another
        interface, or its preferred source is not one of this interface's addresses."""
        return self._call(self._route, dst)

    def neighbour(self, ip: str) -> str | None:
        """The MAC of a valid (reachable, stale, probing, static) neighbour entry for ip, or None."""
        return self._call(self._neighbour, ip)

    def lookup(self, dst: str, probe: bool = True) -> NextHop | None:
        """The path to dst if its next hop's MAC is known; else None, after asking the kernel to
        resolve it (one probe datagram) when `probe`.  Never waits for ARP/ND."""
        return self._call(self._lookup, dst, probe)

    def resolve(self, dst: str, timeout: float = 2.0) -> NextHop:
        """The path to dst, waiting up to `timeout` seconds for the kernel to resolve the next hop."""
        return self._call(self._resolve, dst, timeout, timeout=timeout + 30)

    def wait(self, dst: str, timeout: float = 2.0) -> NextHop:
        """resolve() polled from the caller's thread, one lookup() at a time: the resolver's thread is never held
        for the wait (metaroced's RTR worker, issue 19 N1)."""
        return self._until_resolved(self.lookup, self.route, dst, timeout)


def resolve_next_hop(dst: str, ifname: str, timeout: float = 2.0) -> NextHop:
    """One-shot PathResolver(ifname).resolve(dst) in the calling thread's network namespace."""
    r = PathResolver(ifname)
    try:
        return r.resolve(dst, timeout)
    finally:
        r.close()


def resolve_mac(ip: str, ifname: str, timeout: float = 2.0) -> str:
    """The MAC to send frames for `ip` to: its route's next hop (the gateway, or ip itself when
    on-link), asking the kernel to resolve it if needed."""
    return resolve_next_hop(ip, ifname, timeout).mac


# ---- keeping running QPs on the current path ------------------------------------------------------------

LIVE = (QPState.RTR, QPState.RTS, QPState.SQD)
path_log = logging.getLogger("metaroce.path")


class PathWatch:
    """Re-resolves running QPs' next hops.  A QP's frame template carries the next hop's MAC (the
    gateway's when the peer is routed), and that next hop changes under running QPs: a router fails
    over and its MAC moves, or a route is switched to another gateway.  A QP's path is re-resolved

      * when the kernel reports a route or neighbour event on the interface (the resolver thread
        follows rtnetlink), which also covers a responder-only QP whose ACKs would otherwise go to a
        stale MAC with no timer of its own;
      * when its local ACK timeout fires (the plane calls `recheck`), in case an event was missed.

    Resolution runs on the resolver's thread and never waits for ARP/ND (it sends one probe; the
    neighbour event that follows brings the answer back).  Results go through a queue that `apply()`
    drains on the plane's side, so the resolver thread never takes the plane's locks.

    `plane` is the compiled plane's side (dp/context.py _Paths): `qps` (qpn -> QP with state, dgid,
    dmac, next_hop, template, path_resolves, path_changes, path_error), `stats` (path_resolves,
    path_changes, path_errors), `build_template(qp, mac, src)` and `kick()` (results are queued)."""

    def __init__(self, plane: Any, resolver: PathResolver) -> None:
        self.plane = plane
        self.resolver = resolver
        self.tracked: dict[int, str] = {}          # qpn -> dgid of QPs on a resolved (not given) path
        self.updates: deque = deque()              # (qpn, dgid, NextHop | None | NetInfoError)
        resolver.watch(self._on_event)
        # The resolver thread needs the GIL a few times per lookup; with the default 5 ms switch
        # interval a busy-polling application delays a path change by tens of ms, longer than a
        # short local ACK timeout.
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))

    # -- plane side ---------------------------------------------------------------------------------
    def track(self, qpn: int, dgid: str) -> None:
        self.tracked[qpn] = dgid

    def recheck(self, qpn: int, dgid: str) -> None:
        """Re-resolve one QP's path soon; never waits."""
        self.resolver.submit(self._check, {qpn: dgid})

    def apply(self) -> None:
        """Apply resolution results: a QP whose next hop changed gets a new template.  What left
        since the change went to the old next hop; the plane's local ACK timer resends it."""
        pl = self.plane
        while self.updates:
            qpn, dgid, hop = self.updates.popleft()
            qp = pl.qps.get(qpn)
            if qp is None or self.tracked.get(qpn) != dgid:
                if qp is None:
                    self.tracked.pop(qpn, None)
                continue
            if qp.state not in LIVE or qp.dgid != dgid:
                continue
            pl.stats["path_resolves"] += 1
            qp.path_resolves += 1
            if hop is None:
                continue                             # the kernel is resolving it: an event follows
            if isinstance(hop, Exception):
                pl.stats["path_errors"] += 1
                qp.path_error = str(hop)
                path_log.warning("QP %#x: path to %s: %s", qpn, dgid, hop)
                continue
            qp.path_error = None
            if qp.next_hop is not None and hop.mac == qp.dmac and hop.src == qp.next_hop.src:
                qp.next_hop = hop
                continue
            try:
                template = pl.build_template(qp, hop.mac, hop.src)
            except NetInfoError as e:
                pl.stats["path_errors"] += 1
                qp.path_error = str(e)
                path_log.warning("QP %#x: %s", qpn, e)
                continue
            old = qp.next_hop
            qp.template, qp.dmac, qp.next_hop = template, hop.mac, hop
            pl.stats["path_changes"] += 1
            qp.path_changes += 1
            path_log.info("QP %#x: next hop to %s now %s (%s), was %s (%s)", qpn, dgid, hop.hop, hop.mac,
                          old.hop if old else "?", old.mac if old else "?")

    # -- resolver thread ----------------------------------------------------------------------------
    def _on_event(self) -> None:
        self._check(dict(self.tracked))             # a C-level copy: safe against the plane's writes

    def _check(self, todo: dict[int, str]) -> None:
        by_dst: dict[str, list[int]] = {}
        for qpn, dgid in todo.items():
            by_dst.setdefault(dgid, []).append(qpn)
        for dgid, qpns in by_dst.items():
            try:
                hop: NextHop | None | NetInfoError = self.resolver.lookup(dgid)
            except NetInfoError as e:
                hop = e
            for qpn in qpns:
                self.updates.append((qpn, dgid, hop))
        if by_dst:
            self.plane.kick()
