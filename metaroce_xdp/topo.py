"""Network-namespace topologies for tests and demos: namespaces, veth pairs, teardown.

Role: build small throw-away topologies (N namespaces, veth pairs between them, addresses,
MTU, threaded NAPI) with pyroute2, run commands or Python code inside them, and always
remove what was built.  Neighbours: tests/afxdp/test_afxdp_netns.py (players in two
namespaces), the XDP loaders in bpf/ and the AF_XDP layer in metaroce_xdp/afxdp/.

Safety rules this module keeps:
  * it only ever deletes namespaces and veth pairs it created itself (tracked by name);
    it never touches the root namespace's interfaces (veths are created inside a
    namespace with their peer placed straight into the other one);
  * namespace names carry a prefix, the pid and random bytes, so parallel test runs
    never collide;
  * teardown runs on context exit, on constructor failure, and at interpreter exit
    (weakref.finalize), and it carries on past individual failures.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import secrets
import select
import signal
import socket
import struct
import subprocess
import time
import weakref
from dataclasses import dataclass, field
from ipaddress import ip_interface

from pyroute2 import NetNS, netns

__all__ = ["TopologyError", "Endpoint", "VethPair", "Topology", "two_hosts", "switched_hosts", "RoutedHosts",
           "routed_hosts", "TwoGateways", "two_gateway_hosts", "unique_ns_name"]

CLONE_NEWNET = 0x40000000
IFA_F_NODAD = 0x02
NETNS_RUN_DIR = "/var/run/netns"

_libc = ctypes.CDLL(None, use_errno=True)


class TopologyError(RuntimeError):
    """Building or tearing down a topology failed; the message names the object."""


def unique_ns_name(prefix: str = "mr", index: int = 0) -> str:
    """`<prefix><pid>-<6 hex>-<index>`: unique across parallel runs and easy to trace back."""
    return f"{prefix}{os.getpid()}-{secrets.token_hex(3)}-{index}"


def _setns_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"setns({path}): {os.strerror(e)}")
    finally:
        os.close(fd)


@contextlib.contextmanager
def thread_in_netns(ns: str):
    """Move the *calling thread* into the named network namespace for the block, then back.

    Sockets (AF_XDP, AF_PACKET, netlink, TCP) created inside stay in ns after the block, so
    one process can drive several namespaces.  Other threads are unaffected."""
    saved = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _setns_path(os.path.join(NETNS_RUN_DIR, ns))
        yield ns
    finally:
        try:
            if _libc.setns(saved, CLONE_NEWNET) != 0:
                e = ctypes.get_errno()
                # Staying in a test namespace would silently misdirect everything after.
                raise OSError(e, f"could not return from {ns}: {os.strerror(e)}")
        finally:
            os.close(saved)


@dataclass
class Endpoint:
    """One end of a veth pair as seen from inside its namespace."""

    ns: str
    ifname: str
    ifindex: int
    mac: str
    ipv4: str | None = None  # address only, no prefix
    ipv6: str | None = None


@dataclass
class VethPair:
    a: Endpoint
    b: Endpoint
    mtu: int


@dataclass
class _State:
    """Everything teardown needs, kept apart from Topology so weakref.finalize can hold it."""

    namespaces: list[str] = field(default_factory=list)
    veths: list[tuple[str, str]] = field(default_factory=list)  # (ns, ifname) of side A
    handles: dict[str, NetNS] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)
    done: bool = False


def _teardown(st: _State) -> list[str]:
    """Remove everything in st; never raises; returns the failures."""
    if st.done:
        return []
    st.done = True
    errors = []
    for p in st.procs:  # processes keep their namespace alive: stop them first
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                if _is_group_leader(p):  # popen() starts a session: reach `ip netns exec`'s child too
                    os.killpg(p.pid, signal.SIGKILL)
                else:
                    p.kill()
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            errors.append(f"process {p.pid} did not exit")
    for ns, ifname in st.veths:
        h = st.handles.get(ns)
        try:
            if h is not None:
                idx = h.link_lookup(ifname=ifname)
                if idx:
                    h.link("del", index=idx[0])  # deletes the peer with it
        except Exception as e:  # noqa: BLE001 - teardown must go on
            errors.append(f"veth {ns}/{ifname}: {e}")
    for h in st.handles.values():
        with contextlib.suppress(Exception):
            h.close()
    st.handles.clear()
    for ns in st.namespaces:
        try:
            if ns in netns.listnetns():
                netns.remove(ns)
        except Exception as e:  # noqa: BLE001
            errors.append(f"namespace {ns}: {e}")
    return errors


def _is_group_leader(p: subprocess.Popen) -> bool:
    try:
        return os.getpgid(p.pid) == p.pid
    except ProcessLookupError:
        return False


def _no_dad(ns: str) -> None:
    """Turn IPv6 duplicate address detection off in a fresh namespace, before any interface exists.

    Global addresses are added with IFA_F_NODAD, but every interface's link-local address would
    otherwise stay tentative for about 1.5 s after it comes up.  A router whose link-local is
    tentative sends no neighbour solicitation for packets it forwards (the kernel has no source
    for it), so the first IPv6 packets across a chain of routers vanish for that long: longer than
    a short retry budget."""
    with thread_in_netns(ns):
        for scope in ("all", "default"):
            with contextlib.suppress(FileNotFoundError), \
                    open(f"/proc/sys/net/ipv6/conf/{scope}/accept_dad", "w") as f:   # no IPv6: nothing to do
                f.write("0")


class Topology:
    """N fresh network namespaces, plus the veth pairs added with add_veth().

    Use as a context manager; close() is idempotent.  `names[i]` is namespace i."""

    def __init__(self, n: int = 2, prefix: str = "mr"):
        self._st = _State()
        self._finalizer = weakref.finalize(self, _teardown, self._st)
        self.names: list[str] = []
        try:
            for i in range(n):
                name = unique_ns_name(prefix, i)
                netns.create(name)
                self._st.namespaces.append(name)
                self.names.append(name)
                self._st.handles[name] = NetNS(name, flags=0)  # flags=0: never create by accident
                h = self._st.handles[name]
                lo = h.link_lookup(ifname="lo")
                if lo:
                    h.link("set", index=lo[0], state="up")
                _no_dad(name)
        except BaseException:
            self.close()
            raise

    def __getitem__(self, i: int) -> str:
        return self.names[i]

    def ipr(self, ns: str) -> NetNS:
        """pyroute2 handle (IPRoute API) for a namespace of this topology."""
        if ns not in self._st.handles:
            raise TopologyError(f"{ns} is not a namespace of this topology")
        return self._st.handles[ns]

    # ------------------------------------------------------------------ building
    def add_veth(
        self,
        ns_a: str,
        ns_b: str,
        ifname_a: str = "mr0",
        ifname_b: str = "mr1",
        *,
        ipv4: tuple[str, str] | None = ("10.77.0.1/24", "10.77.0.2/24"),
        ipv6: tuple[str, str] | None = None,
        mtu: int = 1500,
        threaded_napi: bool = False,
        macs: tuple[str, str] | None = None,
        queues: int = 1,
    ) -> VethPair:
        """A veth pair from ns_a to ns_b, configured and up.

        IPv6 addresses are added with IFA_F_NODAD so they are usable at once.
        threaded_napi turns GRO on (so veth has NAPI) and writes /sys/class/net/<if>/threaded
        inside each namespace: NAPI then runs in a kthread rather than softirq.
        queues > 1: both ends with that many RX and TX queues (numrxqueues/numtxqueues)."""
        ha, hb = self.ipr(ns_a), self.ipr(ns_b)
        nq = {"num_rx_queues": queues, "num_tx_queues": queues} if queues > 1 else {}
        try:
            ha.link("add", ifname=ifname_a, kind="veth", peer={"ifname": ifname_b, "net_ns_fd": ns_b, **nq}, **nq)
        except Exception as e:
            raise TopologyError(f"creating veth {ns_a}/{ifname_a} <-> {ns_b}/{ifname_b}: {e}") from e
        self._st.veths.append((ns_a, ifname_a))
        ends = []
        for side, (h, ns, ifname) in enumerate(((ha, ns_a, ifname_a), (hb, ns_b, ifname_b))):
            idx = h.link_lookup(ifname=ifname)[0]
            kw = {"mtu": mtu}
            if macs:
                kw["address"] = macs[side]
            h.link("set", index=idx, **kw)
            v4 = v6 = None
            if ipv4:
                itf = ip_interface(ipv4[side])
                h.addr("add", index=idx, address=str(itf.ip), prefixlen=itf.network.prefixlen)
                v4 = str(itf.ip)
            if ipv6:
                itf = ip_interface(ipv6[side])
                h.addr("add", index=idx, address=str(itf.ip), prefixlen=itf.network.prefixlen,
                       flags=IFA_F_NODAD)
                v6 = str(itf.ip)
            h.link("set", index=idx, state="up")
            mac = h.get_links(idx)[0].get_attr("IFLA_ADDRESS")
            ends.append(Endpoint(ns, ifname, idx, mac, v4, v6))
        if threaded_napi:
            for ep in ends:
                # veth has NAPI instances only while GRO or XDP is on; without them the
                # sysfs write fails with EIO.  iproute2 6.1 has no `threaded` keyword.
                self.run(ep.ns, ["ethtool", "-K", ep.ifname, "gro", "on"], timeout=10)
                self.run(ep.ns, ["sh", "-c", f"echo 1 > /sys/class/net/{ep.ifname}/threaded"], timeout=10)
        return VethPair(ends[0], ends[1], mtu)

    def link_xdp_attached(self, ns: str, ifname: str) -> bool:
        """Whether an XDP program is attached to the interface (any mode)."""
        h = self.ipr(ns)
        link = h.get_links(h.link_lookup(ifname=ifname)[0])[0]
        xdp = link.get_attr("IFLA_XDP")
        if xdp is None:
            return False
        mode = dict(xdp.get("attrs", [])).get("IFLA_XDP_ATTACHED") if isinstance(xdp, dict) \
            else xdp.get_attr("IFLA_XDP_ATTACHED")
        return bool(mode)

    # ------------------------------------------------------------------ running code inside
    def popen(self, ns: str, argv: list[str], **kw) -> subprocess.Popen:
        """Start `ip netns exec <ns> argv...` in its own process group; killed at teardown."""
        self.ipr(ns)  # only our namespaces
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(["ip", "netns", "exec", ns, *argv], **kw)
        p._mr_ns = ns                      # for remove(ns)
        self._st.procs.append(p)
        return p

    def run(self, ns: str, argv: list[str], timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        """Run a command inside ns to completion (bounded by timeout); capture output."""
        p = self.popen(ns, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            raise TopologyError(f"`{' '.join(argv)}` in {ns} exceeded {timeout}s") from None
        cp = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if check and p.returncode != 0:
            raise TopologyError(f"`{' '.join(argv)}` in {ns} failed ({p.returncode}): {err.strip()}")
        return cp

    @contextlib.contextmanager
    def enter(self, ns: str):
        """Move the *calling thread* into ns for the block, then back.

        Sockets (AF_XDP, AF_PACKET, netlink) created inside stay in ns after the block, so
        one test process can drive both players.  Other threads are unaffected."""
        self.ipr(ns)
        with thread_in_netns(ns):
            yield ns

    def call(self, ns: str, fn, *args, timeout: float = 30, **kwargs):
        """Run fn(*args, **kwargs) in a forked child inside ns; return its (pickled) result.

        The child is killed after `timeout` seconds; exceptions are re-raised here.  fork()
        copies this process as it is, so keep fn simple (no threads of its own required)."""
        self.ipr(ns)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            os.close(r)
            code = 0
            try:
                _setns_path(os.path.join(NETNS_RUN_DIR, ns))
                payload = pickle.dumps((True, fn(*args, **kwargs)))
            except BaseException as e:  # noqa: BLE001 - report everything to the parent
                code = 1
                try:
                    payload = pickle.dumps((False, e))
                except Exception:  # noqa: BLE001
                    payload = pickle.dumps((False, RuntimeError(repr(e))))
            with contextlib.suppress(Exception):
                os.write(w, payload)
            os._exit(code)
        os.close(w)
        chunks, deadline = [], time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([r], [], [], left)[0]:
                    os.kill(pid, signal.SIGKILL)
                    raise TopologyError(f"{getattr(fn, '__name__', fn)} in {ns} exceeded {timeout}s")
                data = os.read(r, 1 << 16)
                if not data:
                    break
                chunks.append(data)
        finally:
            os.close(r)
            os.waitpid(pid, 0)
        if not chunks:
            raise TopologyError(f"{getattr(fn, '__name__', fn)} in {ns} died without a result")
        ok, value = pickle.loads(b"".join(chunks))
        if not ok:
            raise value
        return value

    def announce(self, ns: str, ifname: str, ip: str) -> None:
        """Tell the link that `ip` is at `ifname`'s current MAC, as a router does after a failover:
        a gratuitous ARP (request and reply) for IPv4, an unsolicited neighbour advertisement with
        the Override flag for IPv6.  Neighbours update existing entries for ip."""
        h = self.ipr(ns)
        idx = h.link_lookup(ifname=ifname)[0]
        mac = bytes.fromhex(h.get_links(idx)[0].get_attr("IFLA_ADDRESS").replace(":", ""))
        with self.enter(ns):
            if ":" not in ip:
                a = socket.inet_aton(ip)
                with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:
                    s.bind((ifname, 0))
                    for op in (1, 2):
                        arp = struct.pack("!HHBBH6s4s6s4s", 1, 0x0800, 6, 4, op, mac, a, bytes(6), a)
                        s.send(b"\xff" * 6 + mac + b"\x08\x06" + arp)
            else:
                target = socket.inet_pton(socket.AF_INET6, ip)
                na = struct.pack("!BBHI16sBB6s", 136, 0, 0, 0xA0000000, target, 2, 1, mac)   # R|O, target LL addr
                with socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6) as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, ifname.encode())
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_HOPS, 255)   # RFC 4861 7.1.2
                    s.bind((ip, 0))
                    s.sendto(na, ("ff02::1", 0, 0, idx))       # the kernel fills in the checksum

    def set_mac(self, ns: str, ifname: str, mac: str) -> None:
        """Change an interface's MAC (a failover to another router box, seen from the link)."""
        h = self.ipr(ns)
        h.link("set", index=h.link_lookup(ifname=ifname)[0], address=mac)

    # ------------------------------------------------------------------ teardown
    def remove(self, ns: str) -> None:
        """Take one namespace away while the rest runs (a host that vanishes): kill the
        processes started in it, close its handle, delete it.  Its veths go with it (the
        kernel destroys a namespace's devices and their peers once nothing holds it)."""
        self.ipr(ns)
        st = self._st
        for p in [p for p in st.procs if getattr(p, "_mr_ns", None) == ns]:
            with contextlib.suppress(ProcessLookupError):
                if _is_group_leader(p):
                    os.killpg(p.pid, signal.SIGKILL)
                else:
                    p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
            st.procs.remove(p)
        st.veths = [(n, i) for n, i in st.veths if n != ns]
        with contextlib.suppress(Exception):
            st.handles.pop(ns).close()
        if ns in netns.listnetns():
            netns.remove(ns)
        st.namespaces.remove(ns)

    def close(self) -> None:
        """Remove every process, veth and namespace this topology made.  Idempotent."""
        errors = _teardown(self._st)
        self._finalizer.detach()
        if errors:
            raise TopologyError("teardown incomplete: " + "; ".join(errors))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def two_hosts(*, mtu: int = 1500, ipv6: bool = False, threaded_napi: bool = False,
              prefix: str = "mr", queues: int = 1) -> tuple[Topology, VethPair]:
    """Two namespaces joined by one veth: 10.77.0.1/24 (and fd77::1/64) in A, .2 (::2) in B
    (queues: RX/TX queues of each end)."""
    topo = Topology(2, prefix=prefix)
    try:
        pair = topo.add_veth(
            topo[0], topo[1], mtu=mtu, threaded_napi=threaded_napi, queues=queues,
            ipv6=("fd77::1/64", "fd77::2/64") if ipv6 else None,
        )
    except BaseException:
        topo.close()
        raise
    return topo, pair


def switched_hosts(*, mtu: int = 1500, prefix: str = "mr",
                   extra_hosts: int = 0) -> tuple[Topology, VethPair, VethPair]:
    """Hosts A and B joined through a third namespace M acting as a switch (a Linux bridge).

    A (10.77.0.1, mr0) <-> M (swA, swB in bridge sw0) <-> B (10.77.0.2, mr1).
    Frames an AF_XDP socket transmits skip the sender's qdisc and tc egress
    hook, so faults must be injected where the kernel forwards them: on M's
    egress ports swB (towards B) and swA (towards A).  A capture on sw0 or
    on either port sees every frame.  Returns (topology, A<->M pair, M<->B pair).

    extra_hosts adds hosts C, D, ... on the same switch: namespace topo[3 + i], interface
    mr<2 + i>, address 10.77.0.<3 + i>, switch port sw<C, D, ...>.
    """
    topo = Topology(3 + extra_hosts, prefix=prefix)
    try:
        a, m, b = topo[0], topo[1], topo[2]
        left = topo.add_veth(a, m, "mr0", "swA", ipv4=None, mtu=mtu)
        right = topo.add_veth(m, b, "swB", "mr1", ipv4=None, mtu=mtu)
        ports = ["swA", "swB"]
        for i in range(extra_hosts):
            port = "sw" + chr(ord("C") + i)
            topo.add_veth(m, topo[3 + i], port, f"mr{2 + i}", ipv4=None, mtu=mtu)
            hx = topo.ipr(topo[3 + i])
            hx.addr("add", index=hx.link_lookup(ifname=f"mr{2 + i}")[0], address=f"10.77.0.{3 + i}", prefixlen=24)
            ports.append(port)
        ha, hm, hb = topo.ipr(a), topo.ipr(m), topo.ipr(b)
        ia = ha.link_lookup(ifname="mr0")[0]
        ib = hb.link_lookup(ifname="mr1")[0]
        ha.addr("add", index=ia, address="10.77.0.1", prefixlen=24)
        hb.addr("add", index=ib, address="10.77.0.2", prefixlen=24)
        left.a.ipv4, right.b.ipv4 = "10.77.0.1", "10.77.0.2"
        hm.link("add", ifname="sw0", kind="bridge")
        br = hm.link_lookup(ifname="sw0")[0]
        hm.link("set", index=br, mtu=mtu)
        for port in ports:
            hm.link("set", index=hm.link_lookup(ifname=port)[0], master=br)
        hm.link("set", index=br, state="up")
        return topo, left, right
    except BaseException:
        topo.close()
        raise


class _OwnsTopology:
    """Built topologies that are context managers: closing one closes its Topology."""

    topo: Topology

    def close(self) -> None:
        self.topo.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass
class RoutedHosts(_OwnsTopology):
    """Hosts A and B in different subnets, joined by a chain of IP routers (see routed_hosts).

    Fields, in path order from A to B:
      topo       the Topology (close it, or use this object as a context manager)
      a, b       the hosts' interfaces (Endpoint: ns, ifname "mr0" / "mr1", mac, ipv4, ipv6)
      routers    router namespaces, routers[0] next to A
      links      the veth pairs: links[k] joins segment k (A-R1, R1-R2, ..., Rn-B); links[k].a is the
                 left (A-side) end, links[k].b the right end
      toward_a   the router-side Endpoint whose egress leads to A (routers[0], ifname "rA"):
                 attach a tc fault injector here to disturb B->A traffic
      toward_b   the router-side Endpoint whose egress leads to B (routers[-1], ifname "rB")
      gw_a, gw_b the gateways A and B route through: {"ipv4": ..., "ipv6": ...}
    """

    topo: Topology
    a: Endpoint
    b: Endpoint
    routers: list[str]
    links: list[VethPair]
    toward_a: Endpoint
    toward_b: Endpoint
    gw_a: dict
    gw_b: dict

    def ip(self, host: str, ipv6: bool = False) -> str:
        """Address of host "a" or "b" in the given family."""
        ep = self.a if host == "a" else self.b
        return ep.ipv6 if ipv6 else ep.ipv4


def _segment(k: int, v6: bool) -> tuple[str, str, str]:
    """Addresses of segment k (left end, right end, network): 10.78.k.0/24 and fd78:k::/64."""
    if v6:
        net = ip_interface(f"fd78:{k:x}::/64").network
        return str(net[1]), str(net[2]), str(net)
    return f"10.78.{k}.1", f"10.78.{k}.2", f"10.78.{k}.0/24"


def routed_hosts(*, routers: int = 1, ipv6: bool = True, mtu: int = 1500, default_route: bool = True,
                 prefix: str = "mr", queues: int = 1) -> RoutedHosts:
    """Hosts A and B in two subnets, joined by a chain of `routers` IP routers (namespaces with
    net.ipv4.ip_forward=1 and net.ipv6.conf.all.forwarding=1).

        A mr0 ==seg 0== rA R1 [r1b ==seg 1== r2a R2 ...] rB ==seg n== mr1 B

    Segment k is 10.78.k.0/24 (and fd78:k::/64 when ipv6): its left end is .1 (::1), its right
    end .2 (::2).  So A is 10.78.0.1 with gateway 10.78.0.2 (R1), B is 10.78.<n>.2 with gateway
    10.78.<n>.1 (the last router).  Hosts get a default route via their router (default_route=True)
    or a route to the other host's subnet only; routers get routes to every segment they are not
    on, through their neighbour.  Every route is set with pyroute2; IPv6 addresses use IFA_F_NODAD.

    Router interfaces: the first router's interface towards A is "rA", the last router's towards B
    is "rB"; between routers i and i+1 (1-based) they are "r<i>b" and "r<i+1>a".  Frames an AF_XDP
    socket sends skip the sender's tc egress hook, so inject faults on router egress:
    `toward_b` (B-bound traffic) and `toward_a` (A-bound traffic) of the result.  queues: RX and TX
    queues of every veth end (the router's egress picks the TX queue, which on veth is the RX queue the
    host receives on: faults.FaultInjector(spread_queues=...) there spreads frames as RSS would)."""
    if routers < 1:
        raise TopologyError("routed_hosts needs at least one router")
    n = routers
    topo = Topology(n + 2, prefix=prefix)
    try:
        names = topo.names
        host_a, host_b, rns = names[0], names[n + 1], names[1:n + 1]
        chain = [host_a, *rns, host_b]
        links: list[VethPair] = []
        for k in range(n + 1):                     # segment k joins chain[k] and chain[k+1]
            left = "mr0" if k == 0 else "rB" if k == n else f"r{k}b"
            right = "mr1" if k == n else "rA" if k == 0 else f"r{k + 1}a"
            l4, r4, _ = _segment(k, False)
            l6, r6, _ = _segment(k, True)
            links.append(topo.add_veth(chain[k], chain[k + 1], left, right, mtu=mtu, queues=queues,
                                       ipv4=(f"{l4}/24", f"{r4}/24"),
                                       ipv6=(f"{l6}/64", f"{r6}/64") if ipv6 else None))
        for ns in rns:
            topo.run(ns, ["sysctl", "-qw", "net.ipv4.ip_forward=1"], timeout=10)
            if ipv6:
                topo.run(ns, ["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"], timeout=10)
        fams = [False, True] if ipv6 else [False]
        for v6 in fams:
            dflt = "::/0" if v6 else "0.0.0.0/0"
            # A: via R1 (right end of segment 0); B: via Rn (left end of segment n)
            for host, seg, gw_side, other in ((host_a, 0, 1, n), (host_b, n, 0, 0)):
                gw = _segment(seg, v6)[gw_side]
                _add_route(topo, host, dflt if default_route else _segment(other, v6)[2], gw)
            for i, ns in enumerate(rns, start=1):    # router i sits between segments i-1 and i
                for k in range(n + 1):
                    if k in (i - 1, i):
                        continue
                    gw = _segment(i - 1, v6)[0] if k < i - 1 else _segment(i, v6)[1]
                    _add_route(topo, ns, _segment(k, v6)[2], gw)
        gw_a = {"ipv4": _segment(0, False)[1], "ipv6": _segment(0, True)[1] if ipv6 else None}
        gw_b = {"ipv4": _segment(n, False)[0], "ipv6": _segment(n, True)[0] if ipv6 else None}
        return RoutedHosts(topo, links[0].a, links[-1].b, list(rns), links, links[0].b, links[-1].a, gw_a, gw_b)
    except BaseException:
        topo.close()
        raise


def _add_route(topo: Topology, ns: str, dst: str, gateway: str) -> None:
    net = ip_interface(dst).network
    kw = {"dst": str(net.network_address), "dst_len": net.prefixlen, "gateway": gateway}
    if net.version == 6:
        kw["family"] = 10
    try:
        topo.ipr(ns).route("add", **kw)
    except Exception as e:
        raise TopologyError(f"route {dst} via {gateway} in {ns}: {e}") from e


@dataclass
class TwoGateways(_OwnsTopology):
    """Hosts A and B in two subnets joined by two routers in parallel (see two_gateway_hosts).

      a, b            the hosts' interfaces (Endpoint)
      routers         [R1 ns, R2 ns]
      gateways_a[i]   router i's address on A's subnet: {"ipv4": ..., "ipv6": ...}
      gateways_b[i]   router i's address on B's subnet
      toward_a[i]     router i's Endpoint whose egress leads to A (ifname "r<i+1>a"; fault injection)
      toward_b[i]     router i's Endpoint whose egress leads to B (ifname "r<i+1>b")
    `use(host, i)` points a host's default routes (both families) at router i."""

    topo: Topology
    a: Endpoint
    b: Endpoint
    routers: list[str]
    gateways_a: list[dict]
    gateways_b: list[dict]
    toward_a: list[Endpoint]
    toward_b: list[Endpoint]
    ipv6: bool

    def use(self, host: str, i: int) -> None:
        ep, gws = (self.a, self.gateways_a) if host == "a" else (self.b, self.gateways_b)
        h = self.topo.ipr(ep.ns)
        for fam in (("ipv4", "ipv6") if self.ipv6 else ("ipv4",)):
            kw = {"dst": "::" if fam == "ipv6" else "0.0.0.0", "dst_len": 0, "gateway": gws[i][fam]}
            if fam == "ipv6":
                kw["family"] = socket.AF_INET6
            h.route("replace", **kw)


def two_gateway_hosts(*, ipv6: bool = True, mtu: int = 1500, prefix: str = "mr") -> TwoGateways:
    """Hosts A and B in two subnets, each on a switch (a bridge namespace) shared with two routers:

        A mr0 -- [SA bridge] --+-- r1a R1 r1b --+-- [SB bridge] -- mr1 B
                               +-- r2a R2 r2b --+

    A's subnet is 10.79.0.0/24 (fd79::/64): A .1, R1 .2, R2 .3; B's is 10.79.1.0/24
    (fd79:1::/64): B .1, R1 .2, R2 .3.  Both hosts start with default routes via R1;
    `use("a", 1)` moves A's to R2.  Routers forward (ip_forward, IPv6 forwarding)."""
    topo = Topology(6, prefix=prefix)
    try:
        ha, sa, r1, r2, sb, hb = topo.names
        links = {
            "a": topo.add_veth(ha, sa, "mr0", "sA", ipv4=None, mtu=mtu),
            "r1a": topo.add_veth(r1, sa, "r1a", "s1", ipv4=None, mtu=mtu),
            "r2a": topo.add_veth(r2, sa, "r2a", "s2", ipv4=None, mtu=mtu),
            "r1b": topo.add_veth(r1, sb, "r1b", "s1", ipv4=None, mtu=mtu),
            "r2b": topo.add_veth(r2, sb, "r2b", "s2", ipv4=None, mtu=mtu),
            "b": topo.add_veth(hb, sb, "mr1", "sB", ipv4=None, mtu=mtu),
        }
        for sw in (sa, sb):
            h = topo.ipr(sw)
            h.link("add", ifname="sw0", kind="bridge")
            br = h.link_lookup(ifname="sw0")[0]
            h.link("set", index=br, mtu=mtu)
            for port in h.get_links():
                name = port.get_attr("IFLA_IFNAME")
                if name not in ("lo", "sw0"):
                    h.link("set", index=port["index"], master=br)
            h.link("set", index=br, state="up")
        plan = {"a": (0, 1), "r1a": (0, 2), "r2a": (0, 3), "b": (1, 1), "r1b": (1, 2), "r2b": (1, 3)}
        for key, (seg, host) in plan.items():
            ep = links[key].a
            h = topo.ipr(ep.ns)
            ep.ipv4 = f"10.79.{seg}.{host}"
            h.addr("add", index=ep.ifindex, address=ep.ipv4, prefixlen=24)
            if ipv6:
                ep.ipv6 = str(ip_interface(f"fd79:{seg:x}::{host}/64").ip)
                h.addr("add", index=ep.ifindex, address=ep.ipv6, prefixlen=64, flags=IFA_F_NODAD)
        for ns in (r1, r2):
            topo.run(ns, ["sysctl", "-qw", "net.ipv4.ip_forward=1"], timeout=10)
            if ipv6:
                topo.run(ns, ["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"], timeout=10)
        gws_a = [{"ipv4": links[k].a.ipv4, "ipv6": links[k].a.ipv6} for k in ("r1a", "r2a")]
        gws_b = [{"ipv4": links[k].a.ipv4, "ipv6": links[k].a.ipv6} for k in ("r1b", "r2b")]
        tg = TwoGateways(topo, links["a"].a, links["b"].a, [r1, r2], gws_a, gws_b,
                         [links["r1a"].a, links["r2a"].a], [links["r1b"].a, links["r2b"].a], ipv6)
        for fam in (("ipv4", "ipv6") if ipv6 else ("ipv4",)):
            for host, gws in (("a", gws_a), ("b", gws_b)):
                ep = tg.a if host == "a" else tg.b
                net = "::/0" if fam == "ipv6" else "0.0.0.0/0"
                _add_route(topo, ep.ns, net, gws[0][fam])
        return tg
    except BaseException:
        topo.close()
        raise
