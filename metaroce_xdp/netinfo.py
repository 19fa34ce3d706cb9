"""What the endpoint needs from the kernel's network configuration, via pyroute2:
an interface's MAC, MTU and addresses, and a neighbour's MAC (resolved through
the kernel's ARP/ND when absent)."""
from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass

from pyroute2 import IPRoute

from .verbs_types import VerbsError

NUD_VALID = 0x02 | 0x04 | 0x08 | 0x10 | 0x40 | 0x80   # REACHABLE STALE DELAY PROBE NOARP PERMANENT


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


def _lookup(ipr: IPRoute, ip: str, index: int) -> str | None:
    fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
    for n in ipr.get_neighbours(family=fam, ifindex=index):
        if n.get_attr("NDA_DST") == ip and n["state"] & NUD_VALID and n.get_attr("NDA_LLADDR"):
            return n.get_attr("NDA_LLADDR")
    return None


def resolve_mac(ip: str, ifname: str, timeout: float = 2.0) -> str:
    """The next hop's MAC for `ip` (on-link peers only), asking the kernel to resolve it if needed."""
    ipaddress.ip_address(ip)
    with IPRoute() as ipr:
        idx = ipr.link_lookup(ifname=ifname)
        if not idx:
            raise NetInfoError(f"no interface {ifname!r}")
        mac = _lookup(ipr, ip, idx[0])
        if mac:
            return mac
        # Make the kernel resolve it: one UDP datagram to the discard port of that peer.
        fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, ifname.encode())
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    s.sendto(b"metaroce neighbour probe", (ip, 9))
                except OSError:
                    pass
                time.sleep(0.02)
                mac = _lookup(ipr, ip, idx[0])
                if mac:
                    return mac
    raise NetInfoError(f"could not resolve the MAC of {ip} on {ifname} within {timeout}s: is the peer up?")
