"""The emulated fabric's shape: hosts behind leaf routers, a spine, K parallel links per hop.

    h1 eth0 -- h1 [l1] sp0..sp{K-1} ==K links== l1.0..l1.{K-1} [sp] l2.0..l2.{K-1} ==K links== sp0.. [l2] h2 -- eth0 h2

Every host hI sits alone in its subnet 10.90.I.0/24 (fd90:I::/64) behind its leaf router lI
(gateway .1, the host .2), as hosts in a data centre sit behind their top-of-rack switch.  Each
leaf joins the spine through `paths` parallel links (link k: 10.91.I.4k+1/30 on the leaf,
.4k+2 on the spine; fd91:I:k::1 and ::2).  Leaves route the other hosts' subnets, and the spine
each host's subnet, over multipath routes with one next hop per parallel link; the routers hash
flows on the L4 five-tuple (net.ipv4/ipv6.fib_multipath_hash_policy=1), so UDP flows that
differ only in their source port -- RoCEv2 entropy -- take different links.

A *port* is the switch-side end of a link, named `<switch>:<ifname>`: its egress leads across
the link, and that is where the impairment program sits (frames an AF_XDP socket transmits
skip the sender's own tc hook, so faults belong on switches).  Ports: lI:hI (leaf to host),
lI:sp<k> (leaf to spine over link k), sp:lI.<k> (spine to leaf I over link k).  Port number p
has ifindex IFINDEX_BASE + p, fabric-wide (ifindexes are per namespace, so we choose them), which
is how the one BPF program tells the ports apart.  Each switch namespace also holds the delay
line dl0 <-> dl1 (ifindexes DL0_IFINDEX, DL1_IFINDEX) for reordering.

Namespaces are `mrf-<name>-h<I>`, `mrf-<name>-l<I>`, `mrf-<name>-sp`; `down` removes every
namespace with the fabric's prefix, so a fabric half built by a crashed `up` goes too.

Neighbours: manage.py (up/set/show/down), impair.py (the BPF side), metaroce_xdp/topo.py
(the same care for test topologies: thread_in_netns, NODAD addresses).
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import time
from dataclasses import asdict, dataclass, field
from ipaddress import ip_interface

from pyroute2 import IPRoute, netns

from ..topo import thread_in_netns

NS_PREFIX = "mrf-"
IFINDEX_BASE = 1000
DL0_IFINDEX, DL1_IFINDEX = 990, 991
MAX_PORTS = 256
HOST_IFNAME = "eth0"
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_]{0,15}$")
IFA_F_NODAD = 0x02
IFA_F_TENTATIVE = 0x40
READY_TIMEOUT = 10.0


class FabricError(RuntimeError):
    """Building, changing or removing a fabric failed; the message says what and what to do."""


@dataclass
class Port:
    """One direction of a link: the switch-side veth end whose egress crosses it."""

    id: int
    name: str               # "<switch>:<ifname>"
    switch: str             # l1, sp, ...
    ns: str
    ifname: str
    ifindex: int
    toward: str             # the node at the other end: h1, sp, l2
    link: str               # the undirected link: "h1-l1", "l1-sp.0"


@dataclass
class Host:
    name: str               # h1
    ns: str
    ifname: str
    ipv4: str
    ipv6: str | None
    gw4: str
    gw6: str | None
    leaf: str


@dataclass
class Plan:
    """Everything `up` builds, computed before anything is built (and saved in the state file)."""

    name: str
    hosts: int
    paths: int
    mtu: int
    ipv6: bool
    namespaces: list[str] = field(default_factory=list)
    switches: list[str] = field(default_factory=list)       # switch namespaces (leaves, spine)
    host_list: list[Host] = field(default_factory=list)
    ports: list[Port] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        p = cls(d["name"], d["hosts"], d["paths"], d["mtu"], d["ipv6"], list(d["namespaces"]),
                list(d["switches"]))
        p.host_list = [Host(**h) for h in d["host_list"]]
        p.ports = [Port(**q) for q in d["ports"]]
        return p

    def host(self, name: str) -> Host:
        for h in self.host_list:
            if h.name == name:
                return h
        raise FabricError(f"fabric {self.name} has no host {name!r} (hosts: "
                          f"{', '.join(h.name for h in self.host_list)})")

    def port(self, name: str) -> Port:
        for p in self.ports:
            if p.name == name:
                return p
        raise FabricError(f"fabric {self.name} has no port {name!r}")


def ns_name(fabric: str, node: str) -> str:
    return f"{NS_PREFIX}{fabric}-{node}"


def check_name(name: str) -> str:
    if not NAME_RE.match(name or ""):
        raise FabricError(f"fabric name {name!r}: use 1-16 of a-z 0-9 _ (starting with a letter or digit)")
    return name


def make_plan(name: str, hosts: int = 2, paths: int = 4, *, mtu: int = 1500, ipv6: bool = True) -> Plan:
    check_name(name)
    if not 2 <= hosts <= 64:
        raise FabricError(f"--hosts {hosts}: a fabric has 2 to 64 hosts")
    if not 1 <= paths <= 32:
        raise FabricError(f"--paths {paths}: 1 to 32 parallel links per hop")
    if not 1280 <= mtu <= 9000:
        raise FabricError(f"--mtu {mtu}: 1280 to 9000 (IPv6 needs 1280)")
    if hosts * (1 + 2 * paths) > MAX_PORTS:
        raise FabricError(f"{hosts} hosts x {paths} paths need {hosts * (1 + 2 * paths)} ports; "
                          f"the program holds {MAX_PORTS}")
    p = Plan(name, hosts, paths, mtu, ipv6)
    spine = ns_name(name, "sp")
    for i in range(1, hosts + 1):
        hns, lns = ns_name(name, f"h{i}"), ns_name(name, f"l{i}")
        p.namespaces += [hns, lns]
        p.switches.append(lns)
        p.host_list.append(Host(f"h{i}", hns, HOST_IFNAME, f"10.90.{i}.2", f"fd90:{i:x}::2" if ipv6 else None,
                                f"10.90.{i}.1", f"fd90:{i:x}::1" if ipv6 else None, f"l{i}"))
    p.namespaces.append(spine)
    p.switches.append(spine)

    def add(switch: str, ns: str, ifname: str, toward: str, link: str) -> None:
        pid = len(p.ports)
        p.ports.append(Port(pid, f"{switch}:{ifname}", switch, ns, ifname, IFINDEX_BASE + pid, toward, link))

    for i in range(1, hosts + 1):
        lns = ns_name(name, f"l{i}")
        add(f"l{i}", lns, f"h{i}", f"h{i}", f"h{i}-l{i}")
        for k in range(paths):
            add(f"l{i}", lns, f"sp{k}", "sp", f"l{i}-sp.{k}")
    for i in range(1, hosts + 1):
        for k in range(paths):
            add("sp", spine, f"l{i}.{k}", f"l{i}", f"l{i}-sp.{k}")
    return p


def leaf_spine_addrs(i: int, k: int, v6: bool) -> tuple[str, str]:
    """(leaf end, spine end) of link k between leaf i and the spine, with prefix length."""
    if v6:
        return f"fd91:{i:x}:{k:x}::1/64", f"fd91:{i:x}:{k:x}::2/64"
    return f"10.91.{i}.{4 * k + 1}/30", f"10.91.{i}.{4 * k + 2}/30"


# ---------------------------------------------------------------------------- building
def _run(argv: list[str], what: str) -> None:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FabricError(f"{what}: `{' '.join(argv)}`: {e}") from e
    if r.returncode != 0:
        raise FabricError(f"{what}: `{' '.join(argv)}` failed: {r.stderr.strip()}")


def veth(ns_a: str, if_a: str, idx_a: int | None, ns_b: str, if_b: str, idx_b: int | None, mtu: int) -> None:
    """A veth pair with chosen ifindexes.  iproute2, because pyroute2 cannot set the peer's
    ifindex (its veth peer spec carries attributes only, not the ifinfomsg header)."""
    argv = ["ip", "-n", ns_a, "link", "add", if_a]
    if idx_a:
        argv += ["index", str(idx_a)]
    argv += ["mtu", str(mtu), "type", "veth", "peer", "name", if_b]
    if idx_b:
        argv += ["index", str(idx_b)]
    argv += ["mtu", str(mtu)]
    if ns_b != ns_a:
        argv += ["netns", ns_b]
    _run(argv, f"veth {ns_a}/{if_a} <-> {ns_b}/{if_b}")


def sysctls(ns: str, values: dict[str, str]) -> None:
    """Write /proc/sys/net values from a thread inside ns (/proc/sys/net resolves per network
    namespace of the calling thread), and read each back."""
    with thread_in_netns(ns):
        for key, val in values.items():
            path = "/proc/sys/" + key.replace(".", "/")
            try:
                with open(path, "w") as f:
                    f.write(val)
                with open(path) as f:
                    got = f.read().strip()
            except OSError as e:
                raise FabricError(f"sysctl {key}={val} in {ns}: {e}") from e
            if got != val:
                raise FabricError(f"sysctl {key}={val} in {ns} reads back {got}")


ROUTER_SYSCTLS = {
    "net.ipv4.ip_forward": "1",
    "net.ipv4.fib_multipath_hash_policy": "1",      # L4: source and destination ports in the hash
    "net.ipv4.conf.all.rp_filter": "0",             # paths are asymmetric by design
    "net.ipv4.conf.default.rp_filter": "0",
    "net.ipv4.conf.all.ignore_routes_with_linkdown": "1",   # a link set down: its next hops are skipped
}
ROUTER_SYSCTLS_V6 = {
    "net.ipv6.conf.all.forwarding": "1",
    "net.ipv6.fib_multipath_hash_policy": "1",
    "net.ipv6.conf.all.ignore_routes_with_linkdown": "1",
    "net.ipv6.conf.all.keep_addr_on_down": "1",             # so a link comes back up with its addresses
}


NO_DAD = {"net.ipv6.conf.all.accept_dad": "0", "net.ipv6.conf.default.accept_dad": "0"}


def _addr(ipr: IPRoute, idx: int, cidr: str) -> None:
    itf = ip_interface(cidr)
    kw = {"flags": IFA_F_NODAD} if itf.version == 6 else {}
    ipr.addr("add", index=idx, address=str(itf.ip), prefixlen=itf.network.prefixlen, **kw)


def _route(ipr: IPRoute, dst: str, gateways: list[str], what: str) -> None:
    net = ip_interface(dst).network
    kw = {"dst": str(net.network_address), "dst_len": net.prefixlen}
    if net.version == 6:
        kw["family"] = socket.AF_INET6
    if len(gateways) == 1:
        kw["gateway"] = gateways[0]
    else:
        kw["multipath"] = [{"gateway": g} for g in gateways]
    try:
        ipr.route("add", **kw)
    except Exception as e:  # noqa: BLE001 - pyroute2 raises NetlinkError and others
        raise FabricError(f"route {dst} via {', '.join(gateways)} in {what}: {e}") from e


def build(plan: Plan) -> None:
    """Create the namespaces, links, addresses and routes of `plan` (no BPF: see impair.py).
    On failure the caller removes the namespaces (destroy)."""
    existing = set(netns.listnetns())
    clash = [n for n in plan.namespaces if n in existing]
    if clash:
        raise FabricError(f"namespaces of fabric {plan.name} exist already ({', '.join(clash)}): "
                          f"`metaroce fabric down --name {plan.name}` first")
    for ns in plan.namespaces:
        netns.create(ns)
        with thread_in_netns(ns), IPRoute() as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
        if plan.ipv6:
            # No duplicate address detection, for link-local addresses either: the fabric chooses
            # every address, and a tentative one would hold back neighbour discovery for a second.
            sysctls(ns, NO_DAD)
    spine = ns_name(plan.name, "sp")
    n, k_paths = plan.hosts, plan.paths
    for h in plan.host_list:
        i = int(h.name[1:])
        edge = plan.port(f"l{i}:h{i}")
        veth(edge.ns, edge.ifname, edge.ifindex, h.ns, h.ifname, None, plan.mtu)
        for k in range(k_paths):
            up, down = plan.port(f"l{i}:sp{k}"), plan.port(f"sp:l{i}.{k}")
            veth(up.ns, up.ifname, up.ifindex, down.ns, down.ifname, down.ifindex, plan.mtu)
    for sw in plan.switches:
        veth(sw, "dl0", DL0_IFINDEX, sw, "dl1", DL1_IFINDEX, plan.mtu)
        sysctls(sw, ROUTER_SYSCTLS | (ROUTER_SYSCTLS_V6 if plan.ipv6 else {}))
    fams = [False, True] if plan.ipv6 else [False]
    # Addresses, links up.
    for h in plan.host_list:
        i = int(h.name[1:])
        with thread_in_netns(h.ns), IPRoute() as ipr:
            idx = ipr.link_lookup(ifname=h.ifname)[0]
            _addr(ipr, idx, f"{h.ipv4}/24")
            if h.ipv6:
                _addr(ipr, idx, f"{h.ipv6}/64")
            ipr.link("set", index=idx, state="up")
            _route(ipr, "0.0.0.0/0", [h.gw4], h.ns)
            if h.gw6:
                _route(ipr, "::/0", [h.gw6], h.ns)
        with thread_in_netns(ns_name(plan.name, f"l{i}")), IPRoute() as ipr:
            idx = ipr.link_lookup(ifname=f"h{i}")[0]
            _addr(ipr, idx, f"{h.gw4}/24")
            if h.gw6:
                _addr(ipr, idx, f"{h.gw6}/64")
            for k in range(k_paths):
                j = ipr.link_lookup(ifname=f"sp{k}")[0]
                for v6 in fams:
                    _addr(ipr, j, leaf_spine_addrs(i, k, v6)[0])
            for name in ("dl0", "dl1", f"h{i}", *[f"sp{k}" for k in range(k_paths)]):
                ipr.link("set", index=ipr.link_lookup(ifname=name)[0], state="up")
            # Every other host's subnet lies beyond the spine: one next hop per parallel link.
            _route(ipr, "10.90.0.0/16", [str(ip_interface(leaf_spine_addrs(i, k, False)[1]).ip)
                                         for k in range(k_paths)], f"l{i}")
            if plan.ipv6:
                _route(ipr, "fd90::/16", [str(ip_interface(leaf_spine_addrs(i, k, True)[1]).ip)
                                          for k in range(k_paths)], f"l{i}")
    with thread_in_netns(spine), IPRoute() as ipr:
        for i in range(1, n + 1):
            for k in range(k_paths):
                j = ipr.link_lookup(ifname=f"l{i}.{k}")[0]
                for v6 in fams:
                    _addr(ipr, j, leaf_spine_addrs(i, k, v6)[1])
                ipr.link("set", index=j, state="up")
        for name in ("dl0", "dl1"):
            ipr.link("set", index=ipr.link_lookup(ifname=name)[0], state="up")
        for i in range(1, n + 1):
            _route(ipr, f"10.90.{i}.0/24", [str(ip_interface(leaf_spine_addrs(i, k, False)[0]).ip)
                                            for k in range(k_paths)], "sp")
            if plan.ipv6:
                _route(ipr, f"fd90:{i:x}::/64", [str(ip_interface(leaf_spine_addrs(i, k, True)[0]).ip)
                                                 for k in range(k_paths)], "sp")
    wait_ready(plan.namespaces)


def set_link(port: Port, up: bool) -> None:
    """Take the port's link down or up, as a pulled or replugged cable: the port's end goes
    administratively down, so the other end loses its carrier; both routers' multipath routes
    skip the link's next hops (ignore_routes_with_linkdown) until it is up again."""
    with thread_in_netns(port.ns), IPRoute() as ipr:
        ipr.link("set", index=port.ifindex, state="up" if up else "down")
    if up:
        wait_ready([port.ns, f"{port.ns.rsplit('-', 1)[0]}-{port.toward}"])      # both ends of the link


def wait_ready(namespaces: list[str], timeout: float = READY_TIMEOUT) -> None:
    """Return once every link in `namespaces` that is up with a carrier is also operationally up
    and no address is tentative.  A veth has its carrier at once, but the kernel's link watch
    (which may wait up to a second) activates its queue: until then every frame routed to it
    is dropped, neighbour solicitations with them, and the first flows over a new fabric would
    lose frames for a second or more.  Links set down (and their peers) are not waited for."""
    deadline = time.monotonic() + timeout
    while True:
        waiting = []
        for ns in namespaces:
            with thread_in_netns(ns), IPRoute() as ipr:
                links, addrs = ipr.get_links(), ipr.get_addr()
            names = {}
            for ln in links:
                name = names[ln["index"]] = ln.get_attr("IFLA_IFNAME")
                oper = ln.get_attr("IFLA_OPERSTATE")
                if name != "lo" and ln["flags"] & 1 and ln.get_attr("IFLA_CARRIER") and oper not in ("UP", 6):
                    waiting.append(f"{ns}/{name} operstate {oper}")
            for a in addrs:
                if (a.get_attr("IFA_FLAGS") or a["flags"]) & IFA_F_TENTATIVE:
                    waiting.append(f"{ns}/{names.get(a['index'], a['index'])} {a.get_attr('IFA_ADDRESS')} tentative")
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise FabricError(f"links not ready after {timeout:g} s: {', '.join(waiting[:6])}"
                              f"{' ...' if len(waiting) > 6 else ''}")
        time.sleep(0.02)


def link_states(plan: Plan) -> dict[str, str]:
    """Port name -> "up", "down" (this end set down) or "no-carrier" (the other end is down)."""
    out = {}
    for ns in plan.switches:
        with thread_in_netns(ns), IPRoute() as ipr:
            flags = {ln.get_attr("IFLA_IFNAME"): (ln["flags"], ln.get_attr("IFLA_CARRIER")) for ln in ipr.get_links()}
        for p in plan.ports:
            if p.ns == ns and p.ifname in flags:
                f, carrier = flags[p.ifname]
                out[p.name] = "down" if not f & 1 else "up" if carrier else "no-carrier"     # IFF_UP
    return out


def fabric_namespaces(name: str) -> list[str]:
    """Every namespace named for fabric `name` (also those a crashed `up` left)."""
    pre = ns_name(name, "")
    return sorted(n for n in netns.listnetns() if n.startswith(pre))


def ns_pids(ns: str) -> list[int]:
    """Processes whose network namespace is ns (as `ip netns pids`)."""
    try:
        ino = os.stat(f"/run/netns/{ns}").st_ino
    except OSError:
        return []
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{pid}/ns/net").st_ino == ino:
                    out.append(int(pid))
    return out


def destroy(names: list[str]) -> list[str]:
    """Remove the namespaces (their veths, tc filters and qdiscs go with them); returns failures."""
    errors = []
    for ns in names:
        try:
            if ns in netns.listnetns():
                netns.remove(ns)
        except Exception as e:  # noqa: BLE001 - go on with the rest
            errors.append(f"namespace {ns}: {e}")
    return errors
