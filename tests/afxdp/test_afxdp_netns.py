"""AF_XDP end to end between two network namespaces, and the topology helper itself.

Players: A (sender / capture, AF_PACKET on its veth end) and B (AF_XDP socket on queue 0
of its veth end, with the bpf/xsk_redirect_test.c fixture steering UDP/4791 into it).
Both are driven from this one process: topo.enter() creates each socket inside its
namespace.  Every wait is bounded by a deadline; nothing is sent outside the namespaces.
"""
from __future__ import annotations

import gc
import os
import socket
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from metaroce_xdp.afxdp import Umem, XskSocket, xskmap_set
from metaroce_xdp.topo import Topology, TopologyError, two_hosts

pytestmark = pytest.mark.netns

bcc = pytest.importorskip("bcc")

ROOT = Path(__file__).resolve().parents[2]
BPF_SRC = ROOT / "bpf" / "xsk_redirect_test.c"
ROCE_PORT = 4791
ETH_P_ALL = 0x0003
PACKET_HOST = 0
REDIRECTED, NOT_IP_UDP, OTHER_PORT, TRUNCATED, NO_SOCKET = range(5)  # enum xsk_test_reason


# --------------------------------------------------------------------------- frames


def _csum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def _mac(m: str) -> bytes:
    return bytes.fromhex(m.replace(":", ""))


def udp_frame(src, dst, dport: int, payload: bytes, v6: bool = False, sport: int = 49152) -> bytes:
    """Ethernet + IPv4/IPv6 + UDP.  src/dst are topo Endpoints."""
    udp = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload
    if v6:
        ip = struct.pack("!IHBB16s16s", 6 << 28, len(udp), 17, 64,
                         socket.inet_pton(socket.AF_INET6, src.ipv6),
                         socket.inet_pton(socket.AF_INET6, dst.ipv6))
        # UDP over IPv6 needs a checksum; the receiver here never checks it, the stack would.
        ethertype = b"\x86\xdd"
    else:
        hdr = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0x4000, 64, 17, 0,
                          socket.inet_aton(src.ipv4), socket.inet_aton(dst.ipv4))
        ip = hdr[:10] + struct.pack("!H", _csum(hdr)) + hdr[12:]
        ethertype = b"\x08\x00"
    return _mac(dst.mac) + _mac(src.mac) + ethertype + ip + udp


def numbered_payload(seq: int, size: int) -> bytes:
    rng = np.random.default_rng(seq)
    return struct.pack("!II", seq, size) + rng.integers(0, 256, size - 8, dtype=np.uint8).tobytes()


# --------------------------------------------------------------------------- players


class Players:
    """A and B joined by veth; B has the redirect fixture and an XskSocket on queue 0."""

    def __init__(self, frame_size=2048, mtu=1500, nframes=2048, ring=512):
        self.topo, self.pair = two_hosts(mtu=mtu, ipv6=True, prefix="mrxsk")
        self.a, self.b = self.pair.a, self.pair.b
        self.bpf = self.xsk = self.cap = None
        try:
            with self.topo.enter(self.b.ns):
                self.bpf = bcc.BPF(src_file=str(BPF_SRC).encode(),
                                   cflags=[f"-DXSK_TEST_UDP_PORT={ROCE_PORT}"])
                fn = self.bpf.load_func(b"xsk_redirect_test", bcc.BPF.XDP)
                self.bpf.attach_xdp(self.b.ifname.encode(), fn, 0)
                self.xsk = XskSocket(self.b.ifname, 0, Umem(nframes, frame_size), rx_size=ring,
                                     tx_size=ring, fill_size=ring, comp_size=ring)
                xskmap_set(self.bpf.get_table(b"xsks_map"), 0, self.xsk)
            with self.topo.enter(self.a.ns):
                self.cap = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
                self.cap.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE: no capture drops
                self.cap.bind((self.a.ifname, ETH_P_ALL))
                self.cap.setblocking(False)
        except BaseException:
            self.close()
            raise

    def verdicts(self) -> dict[int, int]:
        t = self.bpf.get_table(b"verdicts")
        return {k.value: t.sum(k).value for k in t.keys()}

    def xskmap_has_socket(self, timeout: float = 3.0) -> bool:
        """Probe with one UDP/4791 frame: REDIRECTED means xsks_map[0] holds a live socket,
        NO_SOCKET means the kernel removed it (user space cannot read an XSKMAP)."""
        before = self.verdicts()
        self.cap.send(udp_frame(self.a, self.b, ROCE_PORT, b"probe" * 4))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            now = self.verdicts()
            if now[REDIRECTED] > before[REDIRECTED]:
                return True
            if now[NO_SOCKET] > before[NO_SOCKET]:
                return False
            time.sleep(0.01)
        raise AssertionError("probe frame never reached the XDP program")

    def drain_capture(self, want, deadline) -> list[bytes]:
        """Frames A's stack received (PACKET_HOST) that satisfy want(frame)."""
        got = []
        while time.monotonic() < deadline:
            try:
                data, addr = self.cap.recvfrom(65536)
            except BlockingIOError:
                return got
            if addr[2] == PACKET_HOST and want(data):
                got.append(data)
        return got

    def detach(self):
        if self.bpf is not None:
            with self.topo.enter(self.b.ns):
                self.bpf.remove_xdp(self.b.ifname.encode(), 0)

    def close(self):
        if self.cap is not None:
            self.cap.close()
        if self.xsk is not None:
            self.xsk.close()
        try:
            self.detach()
        finally:
            if self.bpf is not None:
                self.bpf.cleanup()
                self.bpf = None
            self.topo.close()


@pytest.fixture
def players():
    p = Players()
    yield p
    p.close()


def receive(p: Players, n: int, timeout: float = 5.0) -> list[bytes]:
    """Pull n frames from B's RX ring (bounded), returning copies and recycling the frames."""
    xsk, out = p.xsk, []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        addrs, lens = xsk.rx_burst(64)
        if len(addrs) == 0:
            xsk.poll(20)
            continue
        out += [xsk.umem.frame(int(a), int(l)).tobytes() for a, l in zip(addrs, lens)]
        xsk.umem.pool.free(addrs)
        xsk.refill()
    return out


# --------------------------------------------------------------------------- AF_XDP tests


@pytest.mark.parametrize("frame_size,mtu,max_payload", [(2048, 1500, 1400), (4096, 3000, 2900)])
def test_udp_4791_frames_arrive_intact_in_umem(frame_size, mtu, max_payload):
    p = Players(frame_size=frame_size, mtu=mtu)
    try:
        sizes = np.random.default_rng(7).integers(16, max_payload, 300)
        sent = {}
        got = []
        for start in range(0, len(sizes), 32):  # bursts below veth's 256-entry XDP ring
            for seq in range(start, min(start + 32, len(sizes))):
                f = udp_frame(p.a, p.b, ROCE_PORT, numbered_payload(seq, int(sizes[seq])), v6=seq % 3 == 0)
                sent[seq] = f
                p.cap.send(f)
            got += receive(p, min(start + 32, len(sizes)) - len(got))
        assert len(got) == len(sent), p.xsk.statistics()
        for f in got:
            off = 14 + (40 if f[12:14] == b"\x86\xdd" else 20) + 8
            seq = struct.unpack("!I", f[off:off + 4])[0]
            assert zlib.crc32(f) == zlib.crc32(sent.pop(seq)), f"frame {seq} corrupted"
        assert not sent
        assert p.verdicts()[REDIRECTED] == len(got)
        st = p.xsk.statistics()
        assert st["rx_dropped"] == st["rx_invalid_descs"] == st["rx_ring_full"] == 0
        fill = p.xsk.fill
        on_fill = (int(fill.producer[0]) - int(fill.consumer[0])) % (1 << 32)
        assert p.xsk.umem.pool.free_count + on_fill == p.xsk.umem.nframes  # no frame lost
    finally:
        p.close()


def test_af_xdp_tx_arrives_in_a(players):
    p, xsk = players, players.xsk
    n = 200
    frames = [udp_frame(p.b, p.a, 9000, numbered_payload(i, 64 + 5 * i)) for i in range(n)]
    addrs = xsk.umem.pool.alloc(n)
    assert len(addrs) == n
    for a, f in zip(addrs, frames):
        xsk.umem.frames[int(a):int(a) + len(f)] = np.frombuffer(f, np.uint8)
    lens = np.array([len(f) for f in frames], np.uint32)
    want = lambda d: d[12:14] == b"\x08\x00" and d[36:38] == b"\x23\x28"  # noqa: E731 udp/9000
    queued = reaped = 0
    got = []
    deadline = time.monotonic() + 10
    while (reaped < n or len(got) < n) and time.monotonic() < deadline:
        if queued < n:
            queued += xsk.tx_burst(addrs[queued:], lens[queued:], kick=False)
        xsk.kick_tx()  # copy mode sends a bounded batch per kick
        reaped += xsk.reap()
        got += p.drain_capture(want, deadline)
    assert reaped == n and xsk.umem.pool.free_count == xsk.umem.nframes - xsk.fill.size
    assert got == frames  # same bytes, same order
    assert xsk.statistics()["tx_invalid_descs"] == 0


def test_other_traffic_still_reaches_the_stack(players):
    """ICMP echo and UDP to another port pass through the attached program."""
    p = players
    with p.topo.enter(p.b.ns):
        srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        srv.bind((p.b.ipv4, 5000))
        srv.settimeout(3)
    with p.topo.enter(p.a.ns):
        cli = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        icmp = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
        icmp.settimeout(3)
    try:
        cli.sendto(b"not roce", (p.b.ipv4, 5000))
        assert srv.recvfrom(100)[0] == b"not roce"
        body = struct.pack("!HH", 0x4D52, 1) + b"metaroce-ping"
        echo = struct.pack("!BBH", 8, 0, 0) + body
        icmp.sendto(echo[:2] + struct.pack("!H", _csum(echo)) + echo[4:], (p.b.ipv4, 0))
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            reply = icmp.recv(1500)
            ihl = (reply[0] & 0xF) * 4
            if reply[ihl] == 0 and reply[ihl + 4:] == body:  # echo reply, our id/seq/data
                break
        else:
            pytest.fail("no ICMP echo reply while the XDP program is attached")
    finally:
        srv.close(), cli.close(), icmp.close()
    v = p.verdicts()
    assert v[OTHER_PORT] >= 1 and v[NOT_IP_UDP] >= 1 and v[REDIRECTED] == 0
    assert p.xsk.rx_burst(64)[0].size == 0  # nothing leaked into the AF_XDP socket


def test_close_releases_socket_detaches_and_removes_namespaces():
    p = Players()
    names = list(p.topo.names)
    ring = p.xsk.rx
    assert p.xskmap_has_socket()
    p.xsk.close()
    p.xsk.close()  # idempotent
    assert ring.descs is None and p.xsk.fd == -1
    # The kernel drops a socket from its XSKMAP only once fd and every ring mapping are gone.
    assert not p.xskmap_has_socket()
    assert p.topo.link_xdp_attached(p.b.ns, p.b.ifname)
    p.detach()
    assert not p.topo.link_xdp_attached(p.b.ns, p.b.ifname)
    p.xsk = None
    p.close()
    from pyroute2 import netns
    assert not set(names) & set(netns.listnetns())


def test_close_with_a_live_view_defers_unmap_safely():
    p = Players()
    try:
        view = p.xsk.rx.descs  # a caller keeping a ring view past close()
        with pytest.warns(ResourceWarning):
            p.xsk.close()
        assert view.shape[1] == 2 and int(view[0, 0]) >= 0  # still mapped: no crash
        assert p.xskmap_has_socket()  # the mapping keeps the kernel socket alive
        del view
        gc.collect()
        deadline = time.monotonic() + 3
        while p.xskmap_has_socket() and time.monotonic() < deadline:
            time.sleep(0.05)  # socket release is deferred to an RCU callback
        assert not p.xskmap_has_socket()
    finally:
        p.close()


def test_bind_errors_are_typed_and_cleaned_up(players):
    from metaroce_xdp.afxdp import XskError
    p = players
    with p.topo.enter(p.b.ns):
        umem = Umem(64, 2048)
        with pytest.raises(XskError, match="bind"):
            XskSocket(p.b.ifname, 0, umem, rx_size=64, tx_size=64, fill_size=64, comp_size=64)
        assert umem.owner_fd == -1  # failed socket left the Umem reusable
        with pytest.raises(XskError, match="bind"):
            XskSocket(p.b.ifname, 0, umem, mode="zerocopy", rx_size=64, tx_size=64,
                      fill_size=64, comp_size=64)
        umem.close()
    with pytest.raises(ValueError, match="4096"):
        Umem(4, 8192)


# --------------------------------------------------------------------------- topology


def test_topology_names_are_unique_and_teardown_is_complete():
    from pyroute2 import netns
    with Topology(3, prefix="mrtopo") as t1, Topology(1, prefix="mrtopo") as t2:
        names = t1.names + t2.names
        assert len(set(names)) == 4
        assert all(n.startswith(f"mrtopo{os.getpid()}-") for n in names)
        pair = t1.add_veth(t1[0], t1[2], ipv6=("fd78::1/64", "fd78::2/64"), mtu=2000)
        assert pair.a.ns == t1[0] and pair.b.ns == t1[2] and pair.mtu == 2000
        out = t1.run(t1[2], ["ip", "-o", "addr", "show", "dev", "mr1"]).stdout
        v6_line = next(line for line in out.splitlines() if "fd78::2/64" in line)
        assert "10.77.0.2/24" in out and "tentative" not in v6_line  # nodad: usable at once
        # A partial failure (name already taken) raises and leaves teardown intact.
        with pytest.raises(TopologyError):
            t1.add_veth(t1[0], t1[1])
        assert socket.if_nametoindex("lo")  # root namespace untouched
    assert not set(names) & set(netns.listnetns())


def test_topology_runs_functions_and_commands_inside(players):
    p = players
    names = p.topo.call(p.b.ns, lambda: [n for _, n in socket.if_nameindex()], timeout=10)
    assert p.b.ifname in names and p.a.ifname not in names
    with pytest.raises(ZeroDivisionError):
        p.topo.call(p.a.ns, lambda: 1 / 0, timeout=10)
    with pytest.raises(TopologyError, match="exceeded"):
        p.topo.call(p.a.ns, time.sleep, 5, timeout=0.5)
    proc = p.topo.popen(p.a.ns, ["ip", "-o", "link", "show", p.a.ifname], stdout=-1, text=True)
    assert p.a.ifname in proc.communicate(timeout=10)[0]
    with pytest.raises(TopologyError):
        p.topo.run("not-ours", ["true"])
    with p.topo.enter(p.a.ns):
        assert p.a.ifname in [n for _, n in socket.if_nameindex()]
    assert p.a.ifname not in [n for _, n in socket.if_nameindex()]


def test_threaded_napi_option():
    topo, pair = two_hosts(threaded_napi=True, prefix="mrnapi")
    with topo:
        out = topo.run(pair.b.ns, ["cat", f"/sys/class/net/{pair.b.ifname}/threaded"]).stdout
        assert out.strip() in ("1", "enabled")
