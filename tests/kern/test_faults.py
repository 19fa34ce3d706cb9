"""The seeded fault injector (bpf/fault_inject.c, metaroce_xdp/faults.py).

Player pair: namespaces A and B joined by one veth; the injector sits on A's
egress; A sends codec-built UDP/4791 frames with raw AF_PACKET, one PSN each,
and B captures them with AF_PACKET.  Because the injector's coins are a pure
function of (seed, packet index), each test predicts with `faults.plan()`
exactly which PSNs are hit and checks the capture against that, besides the
coarse rate bounds.
"""
from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from metaroce_xdp import faults
from metaroce_xdp.faults import FaultInjector, in_netns, plan
from metaroce_xdp.wire import AETH, Op, OpMask, Vlan, decode, encode
from metaroce_xdp.wire.errors import MalformedPacket
from metaroce_xdp.wire.packet import inet_checksum, udp_checksum_v6

REPO = Path(__file__).resolve().parents[2]
C_SOURCE = REPO / "bpf" / "fault_inject.c"
PACKET_OUTGOING = 4
ETH_P_ALL = 0x0003
SO_RCVBUFFORCE = 33             # <asm-generic/socket.h>; not exported by the socket module


# ---- one place per fact: the C and Python sides agree -------------------------
def _c_enum(name: str) -> list[str]:
    body = re.search(r"enum %s \{(.*?)\};" % name, C_SOURCE.read_text(), re.S).group(1)
    return [m.group(1) for m in re.finditer(r"^\s*(FI_C_\w+)", body, re.M)]


def _c_define(name: str) -> int:
    m = re.search(r"#define %s\s+\(?([0-9xXa-fA-F]+)U?(?:\s*<<\s*(\d+)\))?" % name, C_SOURCE.read_text())
    v = int(m.group(1), 0)
    return v << int(m.group(2)) if m.group(2) else v


def test_counter_names_agree_with_c():
    names = _c_enum("fi_counter")
    assert names[-1] == "FI_C__MAX"
    assert [n[len("FI_C_"):].lower() for n in names[:-1]] == list(faults.COUNTERS)


def test_constants_agree_with_c():
    for py, c in [(faults.SALT_DROP, "FI_SALT_DROP"), (faults.SALT_CORRUPT, "FI_SALT_CORRUPT"),
                  (faults.SALT_CORRUPT_OFF, "FI_SALT_CORRUPT_OFF"), (faults.SALT_DUP, "FI_SALT_DUP"),
                  (faults.SALT_DELAY, "FI_SALT_DELAY"), (faults.F_ENABLED, "FI_F_ENABLED"),
                  (faults.F_OPCODE_FILTER, "FI_F_OPCODE_FILTER"), (faults.F_FIX_UDP_CSUM, "FI_F_FIX_UDP_CSUM"),
                  (faults.F_SPREAD_FLOW, "FI_F_SPREAD_FLOW"),
                  (faults.FI_MARK, "FI_MARK"), (faults.PPM_SCALE, "FI_PPM_SCALE"),
                  (faults.BTH_SIZE, "FI_BTH_SIZE")]:
        assert py == _c_define(c), c


def test_plan_rates_and_determinism():
    a = plan(1, 20000, drop_ppm=50_000, dup_ppm=20_000)
    assert a == plan(1, 20000, drop_ppm=50_000, dup_ppm=20_000)
    assert a != plan(2, 20000, drop_ppm=50_000, dup_ppm=20_000)
    drops = sum("drop" in x for x in a)
    assert 800 <= drops <= 1200                    # 5 % of 20000, about 7 sigma either side
    assert all(x == {"drop"} for x in a if "drop" in x)


def test_opcode_bitmap_from_mask():
    words = faults.opcode_bitmap(OpMask.ACK)
    on = {w * 64 + b for w in range(4) for b in range(64) if words[w] >> b & 1}
    assert Op.ACKNOWLEDGE in on and Op.NATIVE_SACK in on and Op.RDMA_READ_RESPONSE_ONLY in on
    assert Op.SEND_ONLY not in on and Op.CNP not in on


# ---- the player pair ----------------------------------------------------------------
def _have_bcc() -> bool:
    try:
        import bcc  # noqa: F401
    except ImportError:
        return False
    return True


needs_root = pytest.mark.skipif(os.geteuid() != 0 or not _have_bcc(), reason="needs root and BCC")


def _sh(cmd: str) -> None:
    subprocess.run(cmd, shell=True, check=True, capture_output=True, timeout=20)


class VethPair:
    """Namespaces A and B, veth a<->b, 10.77.<n>.1/24 and .2/24."""

    def __init__(self, tag: str):
        pid = os.getpid()
        self.ns_a, self.ns_b = f"fi{pid}{tag}a", f"fi{pid}{tag}b"
        self.dev_a, self.dev_b = f"fi{pid}{tag}a"[:15], f"fi{pid}{tag}b"[:15]
        self.net = 1 + pid % 250
        self.ip_a, self.ip_b = f"10.77.{self.net}.1", f"10.77.{self.net}.2"
        self.mac_a, self.mac_b = "02:77:00:00:00:0a", "02:77:00:00:00:0b"
        self._tx = self._rx = None

    def up(self) -> VethPair:
        _sh(f"ip netns add {self.ns_a} && ip netns add {self.ns_b}")
        _sh(f"ip link add {self.dev_a} netns {self.ns_a} address {self.mac_a} type veth "
            f"peer name {self.dev_b} netns {self.ns_b} address {self.mac_b}")
        for ns, dev, ip in ((self.ns_a, self.dev_a, self.ip_a), (self.ns_b, self.dev_b, self.ip_b)):
            _sh(f"ip -n {ns} addr add {ip}/24 dev {dev} && ip -n {ns} link set {dev} up "
                f"&& ip -n {ns} link set lo up")
        with in_netns(self.ns_a):
            self._tx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
            self._tx.bind((self.dev_a, 0))
        with in_netns(self.ns_b):
            self._rx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            self._rx.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 16 << 20)
            self._rx.bind((self.dev_b, 0))
        return self

    def down(self) -> None:
        for s in (self._tx, self._rx):
            if s is not None:
                s.close()
        for ns in (self.ns_a, self.ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)

    def injector(self, **kw) -> FaultInjector:
        return FaultInjector(self.dev_a, netns=self.ns_a, **kw)

    def frame(self, psn: int, op: int = Op.SEND_ONLY, v6: bool = False, **kw) -> bytes:
        ips = dict(src_ip="fd77::1", dst_ip="fd77::2") if v6 else dict(src_ip=self.ip_a, dst_ip=self.ip_b)
        if op == Op.ACKNOWLEDGE:
            kw.setdefault("headers", {"aeth": AETH(syndrome=0x1F, msn=psn)})
        else:
            kw.setdefault("payload", psn.to_bytes(4, "big") * 16)
        return encode(op, src_mac=self.mac_a, dst_mac=self.mac_b, dest_qp=0x12, psn=psn, **ips, **kw)

    def send(self, frames, burst: int = 64) -> None:
        """Paced in bursts so neither B's backlog nor its socket overflows."""
        for i, f in enumerate(frames):
            self._tx.send(f)
            if i % burst == burst - 1:
                time.sleep(0.002)

    def capture(self, quiet: float = 0.3, deadline: float = 5.0, raw: bool = False) -> list:
        """Decoded UDP/4791 frames B received, in arrival order, until `quiet`
        seconds pass without one (bounded by `deadline`); (bytes, packet)
        pairs with raw=True."""
        out = []
        end = time.monotonic() + deadline
        last = time.monotonic()
        while time.monotonic() < end and time.monotonic() - last < quiet:
            r, _, _ = select.select([self._rx], [], [], 0.05)
            if not r:
                continue
            data, addr = self._rx.recvfrom(65536)
            if addr[2] == PACKET_OUTGOING:
                continue
            try:
                pkt = decode(data)
            except MalformedPacket:   # NotMetaRoCE included: ARP, ND, ICMP
                continue
            out.append((data, pkt) if raw else pkt)
            last = time.monotonic()
        return out


@pytest.fixture
def pair(request):
    p = VethPair(str(abs(hash(request.node.name)) % 1000))
    try:
        yield p.up()
    finally:
        p.down()


def _psns(pkts) -> list[int]:
    return [p.bth.psn for p in pkts]


N = 400


# ---- behaviour ------------------------------------------------------------------------
@needs_root
@pytest.mark.netns
def test_clean_path_loses_nothing(pair):
    with pair.injector(seed=1) as fi:
        pair.send(pair.frame(i) for i in range(N))
        got = pair.capture()
        st = fi.stats()
    assert _psns(got) == list(range(N))
    assert all(p.icrc_ok for p in got)
    assert st["roce"] == N and st["matched"] == N and st["dropped"] == 0


@needs_root
@pytest.mark.netns
def test_drop_rate_is_seeded(pair):
    ppm = 100_000
    lost_runs = []
    for _ in range(2):
        with pair.injector(seed=7, drop_ppm=ppm) as fi:
            pair.send(pair.frame(i) for i in range(N))
            got = pair.capture()
            st = fi.stats()
        lost = set(range(N)) - set(_psns(got))
        lost_runs.append(lost)
        assert st["dropped"] == len(lost)
        assert 0.05 * N <= len(lost) <= 0.15 * N
    assert lost_runs[0] == lost_runs[1]
    assert lost_runs[0] == {i for i, a in enumerate(plan(7, N, drop_ppm=ppm)) if "drop" in a}
    assert lost_runs[0] != {i for i, a in enumerate(plan(8, N, drop_ppm=ppm)) if "drop" in a}


@needs_root
@pytest.mark.netns
def test_duplicates_arrive_twice(pair):
    ppm = 100_000
    want = {i for i, a in enumerate(plan(3, N, dup_ppm=ppm)) if "dup" in a}
    with pair.injector(seed=3, dup_ppm=ppm) as fi:
        pair.send(pair.frame(i) for i in range(N))
        got = pair.capture()
        st = fi.stats()
    psns = _psns(got)
    twice = {p for p in set(psns) if psns.count(p) == 2}
    assert set(psns) == set(range(N))
    assert twice == want and len(psns) == N + len(want)
    assert st["duplicated"] == len(want) and st["own"] == len(want) and st["dup_failed"] == 0


@needs_root
@pytest.mark.netns
def test_corrupted_frames_fail_icrc(pair):
    ppm = 150_000
    want = {i for i, a in enumerate(plan(11, N, corrupt_ppm=ppm)) if "corrupt" in a}
    with pair.injector(seed=11, corrupt_ppm=ppm) as fi:
        pair.send(pair.frame(i) for i in range(N))
        got = pair.capture()
        st = fi.stats()
    assert sorted(_psns(got)) == list(range(N))        # corrupted past the BTH: PSN still readable
    assert {p.bth.psn for p in got if p.icrc_ok is False} == want
    assert st["corrupted"] == len(want) > 0


@needs_root
@pytest.mark.netns
def test_ecn_ce_marks_ect_frames_and_keeps_them_valid(pair):
    """The congested-switch knob for DCQCN tests: ECT frames chosen by the seed get ECN CE with a
    correct IPv4 header checksum (MR-ENC-013) and an unchanged, still valid ICRC (MR-ICRC-004,
    MR-ECN-006); Not-ECT frames are left alone; IPv6 Traffic Class likewise."""
    ppm = 300_000
    want = {i for i, a in enumerate(plan(21, N, ecn_ce_ppm=ppm)) if "ce" in a}
    with pair.injector(seed=21, ecn_ce_ppm=ppm) as fi:
        pair.send(pair.frame(i, dscp=26, ecn=2) for i in range(N))
        got = pair.capture(raw=True)
        st = fi.stats()
    assert [p.bth.psn for _, p in got] == list(range(N))
    assert {p.bth.psn for _, p in got if p.ip.ecn == 3} == want and st["ce_marked"] == len(want) > 0
    for raw, p in got:
        assert p.icrc_ok and p.ip.dscp == 26 and p.ip.ecn in (2, 3)
        assert inet_checksum(raw[14:34]) == 0                    # header checksum still right
    with pair.injector(seed=21, ecn_ce_ppm=1_000_000) as fi:
        pair.send([pair.frame(0, ecn=0), pair.frame(1, v6=True, dscp=26, ecn=2)])
        got = pair.capture()
        st = fi.stats()
    assert [(p.bth.psn, p.ip.ecn if p.bth.psn == 0 else p.ip.traffic_class & 3) for p in got] == [(0, 0), (1, 3)]
    assert all(p.icrc_ok for p in got) and st["ce_not_ect"] == 1 and st["ce_marked"] == 1


@needs_root
@pytest.mark.netns
def test_corrupt_with_fixed_udp_checksum_fails_only_icrc(pair):
    frames = [pair.frame(i, v6=True) for i in range(20)]
    with pair.injector(seed=5, corrupt_ppm=1_000_000, corrupt_offset=20, fix_udp_csum=True):
        pair.send(frames)
        got = pair.capture(raw=True)
    assert [p.bth.psn for _, p in got] == list(range(20))
    udp_off = 14 + 40
    for (raw, p), sent in zip(got, frames):
        assert p.icrc_ok is False
        udp = raw[udp_off:udp_off + p.udp.length]
        assert udp_checksum_v6(p.ip.src, p.ip.dst, udp[:6] + b"\0\0" + udp[8:]) == p.udp.checksum
        # one payload byte differs, 20 bytes into the BTH; otherwise only the UDP checksum
        diff = {i for i, (x, y) in enumerate(zip(sent, raw)) if x != y}
        assert diff - {udp_off + 6, udp_off + 7} == {udp_off + 8 + 20}


@needs_root
@pytest.mark.netns
def test_reorder_without_loss(pair):
    ppm, n = 100_000, 200
    want = {i for i, a in enumerate(plan(5, n, reorder_ppm=ppm)) if "delay" in a}
    with pair.injector(seed=5, reorder_ppm=ppm, reorder_delay_us=20_000) as fi:
        pair.send((pair.frame(i) for i in range(n)), burst=16)
        got = pair.capture(quiet=0.5)
        st = fi.stats()
    psns = _psns(got)
    assert sorted(psns) == list(range(n))                       # nothing lost, nothing doubled
    assert psns != sorted(psns)
    # frames not delayed keep their order; a delayed frame arrives after a later
    # one (unless no undelayed frame was sent after it)
    on_time = [p for p in psns if p not in want]
    assert on_time == sorted(on_time)
    late = {p for i, p in enumerate(psns) if any(q > p for q in psns[:i])}
    assert late <= want
    assert {p for p in want if p < max(on_time)} <= late
    assert st["delayed"] == st["reinjected"] == len(want) and st["delay_lost"] == 0


@needs_root
@pytest.mark.netns
def test_psn_drop_once(pair):
    with pair.injector(psn_drop_once=[5]) as fi:
        pair.send(pair.frame(i) for i in range(20))
        pair.send([pair.frame(5)])                               # the retransmission
        got = pair.capture()
        st = fi.stats()
    assert _psns(got) == [i for i in range(20) if i != 5] + [5]
    assert st["psn_dropped"] == 1 and st["dropped"] == 0


@needs_root
@pytest.mark.netns
def test_drop_first_ack_only(pair):
    seq = []
    for i in range(10):
        seq.append(pair.frame(i))
        seq.append(pair.frame(i, op=Op.ACKNOWLEDGE))
    with pair.injector(drop_ppm=1_000_000, opcode_filter=OpMask.ACK, action_limit=1) as fi:
        pair.send(seq)
        got = pair.capture()
        st = fi.stats()
    acks = [p.bth.psn for p in got if p.bth.opcode == Op.ACKNOWLEDGE]
    data = [p.bth.psn for p in got if p.bth.opcode == Op.SEND_ONLY]
    assert data == list(range(10)) and acks == list(range(1, 10))
    assert st["dropped"] == 1 and st["matched"] == 10 and st["limited"] == 9


@needs_root
@pytest.mark.netns
def test_every_nth(pair):
    with pair.injector(drop_ppm=1_000_000, every_nth=5) as fi:
        pair.send(pair.frame(i) for i in range(30))
        got = pair.capture()
        st = fi.stats()
    assert _psns(got) == [i for i in range(30) if i % 5 != 4]
    assert st["dropped"] == 6 and st["matched"] == 6


@needs_root
@pytest.mark.netns
def test_ipv6_and_vlan_are_parsed(pair):
    frames = ([pair.frame(i, v6=True) for i in range(10)] +
              [pair.frame(10 + i, vlan=Vlan(vid=7)) for i in range(10)] +
              [pair.frame(20 + i, v6=True, vlan=Vlan(vid=7, pcp=3)) for i in range(10)])
    with pair.injector(drop_ppm=1_000_000) as fi:
        pair.send(frames)
        got = pair.capture()
        st = fi.stats()
    assert got == [] and st["roce"] == 30 and st["dropped"] == 30


def _qinq(frame: bytes) -> bytes:
    """An 802.1ad tag (vid 5) in front of the frame's 802.1Q tag."""
    return frame[:12] + b"\x88\xa8\x00\x05" + frame[12:]


def _ip4_variant(frame: bytes, options: bytes = b"", frag: int = 0) -> bytes:
    """The untagged IPv4 frame with `options` after its fixed header and flags/offset `frag`
    (header checksum recomputed)."""
    ip = bytearray(frame[14:34])
    ip[0] = 0x40 | (5 + len(options) // 4)
    ip[2:4] = struct.pack("!H", struct.unpack("!H", ip[2:4])[0] + len(options))
    ip[6:8] = struct.pack("!H", frag)
    ip[10:12] = b"\0\0"
    ip[10:12] = struct.pack("!H", inet_checksum(bytes(ip) + options))
    return frame[:14] + bytes(ip) + options + frame[34:]


@needs_root
@pytest.mark.netns
def test_qinq_options_and_first_fragments_are_parsed(pair):
    """The injector walks what the wire carries, more than the endpoint accepts (tc_impair_common.h
    impair_parse_eth, parsing_helpers.h parse_iphdr_any): two tags (802.1ad outside 802.1Q), IPv4
    options, a first fragment (MF set).  A later fragment has no UDP header and is not RoCE."""
    qinq = [_qinq(pair.frame(i, vlan=Vlan(vid=7))) for i in range(5)]
    opts = [_ip4_variant(pair.frame(10 + i), options=b"\x01\x01\x01\x00") for i in range(5)]
    first = [_ip4_variant(pair.frame(20 + i), frag=0x2000) for i in range(5)]
    later = [_ip4_variant(pair.frame(30 + i), frag=0x2001) for i in range(5)]
    with pair.injector(drop_ppm=1_000_000) as fi:
        pair.send(qinq + opts + first + later)
        st = fi.stats()
    assert st["roce"] == 15 and st["dropped"] == 15


@needs_root
@pytest.mark.netns
def _ping(pair, count: int = 3) -> int:
    """ICMP echo from A to B over a raw socket (no ping binary here); returns replies."""
    with in_netns(pair.ns_a):
        s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    replies = 0
    with s:
        for seq in range(count):
            hdr = struct.pack("!BBHHH", 8, 0, 0, 0x4D52, seq) + b"metaroce-ping"
            s.sendto(hdr[:2] + struct.pack("!H", _inet_csum(hdr)) + hdr[4:], (pair.ip_b, 0))
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                r, _, _ = select.select([s], [], [], 0.1)
                if not r:
                    continue
                data = s.recv(2048)
                icmp = data[(data[0] & 0xF) * 4:]
                if icmp[0] == 0 and struct.unpack("!HH", icmp[4:8]) == (0x4D52, seq):
                    replies += 1
                    break
    return replies


def _inet_csum(b: bytes) -> int:
    b += b"\0" * (len(b) % 2)
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


@needs_root
@pytest.mark.netns
def test_other_traffic_untouched(pair):
    other = [pair.frame(i, dport=4792) for i in range(10)]   # UDP, but not 4791
    with pair.injector(drop_ppm=1_000_000, corrupt_ppm=1_000_000) as fi:
        replies = _ping(pair)
        pair.send(other)
        got = _capture_raw_udp(pair, 4792)
        st = fi.stats()
    assert replies == 3
    assert got == other
    assert st["roce"] == 0 and st["dropped"] == 0 and st["corrupted"] == 0 and st["seen"] >= 13


def _capture_raw_udp(pair, dport: int, quiet: float = 0.3) -> list[bytes]:
    out, last = [], time.monotonic()
    while time.monotonic() - last < quiet:
        r, _, _ = select.select([pair._rx], [], [], 0.05)
        if r:
            data, addr = pair._rx.recvfrom(65536)
            if addr[2] != PACKET_OUTGOING and len(data) > 38 and data[12:14] == b"\x08\x00" \
                    and struct.unpack("!H", data[36:38])[0] == dport:
                out.append(data)
                last = time.monotonic()
    return out


@needs_root
@pytest.mark.netns
def test_update_live_and_reset(pair):
    with pair.injector(seed=9) as fi:
        pair.send(pair.frame(i) for i in range(20))
        fi.update(drop_ppm=1_000_000)
        pair.send(pair.frame(20 + i) for i in range(20))
        fi.update(drop_ppm=0)
        pair.send(pair.frame(40 + i) for i in range(20))
        got = pair.capture()
        assert _psns(got) == list(range(20)) + list(range(40, 60))
        assert fi.stats()["dropped"] == 20 and fi.index() == 60
        fi.reset()
        assert fi.index() == 0 and fi.stats()["roce"] == 0
    assert fi.stats()["dropped"] == 0            # final counters remain readable after close


@needs_root
@pytest.mark.netns
def test_close_is_idempotent_and_removes_filter(pair):
    fi = pair.injector(drop_ppm=1_000_000)
    fi.close()
    fi.close()
    out = subprocess.run(["ip", "netns", "exec", pair.ns_a, "tc", "filter", "show", "dev", pair.dev_a,
                          "egress"], capture_output=True, text=True, timeout=10).stdout
    assert "fi_tc" not in out
    pair.send(pair.frame(i) for i in range(5))
    assert _psns(pair.capture()) == list(range(5))


@needs_root
@pytest.mark.netns
def test_cli_reports_counters(pair):
    cmd = ["ip", "netns", "exec", pair.ns_a, sys.executable, "-m", "metaroce_xdp.faults",
           "--dev", pair.dev_a, "--seed", "7", "--drop-ppm", "100000", "--duration", "60"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        r, _, _ = select.select([proc.stdout], [], [], 30)
        assert r, "injector CLI did not report ready"
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready"
        pair.send(pair.frame(i) for i in range(N))
        got = pair.capture()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["event"] == "stats", err
    lost = set(range(N)) - set(_psns(got))
    assert stats["counters"]["dropped"] == len(lost)
    assert lost == {i for i, a in enumerate(plan(7, N, drop_ppm=100_000)) if "drop" in a}


@needs_root
@pytest.mark.netns
def test_ingress_attach(pair):
    """On ingress the hook runs after ETH_P_ALL taps (and after XDP, so an AF_XDP
    receiver never sees its effect); a socket bound to ETH_P_IP sees the result."""
    with in_netns(pair.ns_b):
        rx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))
        rx.bind((pair.dev_b, 0))
    want = plan(4, 100, drop_ppm=100_000, dup_ppm=100_000)
    with rx, FaultInjector(pair.dev_b, netns=pair.ns_b, direction="ingress", seed=4,
                           drop_ppm=100_000, dup_ppm=100_000) as fi:
        pair.send(pair.frame(i) for i in range(100))
        pair._rx, saved = rx, pair._rx
        try:
            got = _psns(pair.capture())
        finally:
            pair._rx = saved
        st = fi.stats()
    expect = [i for i, a in enumerate(want) if "drop" not in a for _ in range(2 if "dup" in a else 1)]
    assert sorted(got) == expect
    assert st["dropped"] == sum("drop" in a for a in want)
    assert st["duplicated"] == sum("dup" in a for a in want)
    with pytest.raises(ValueError):
        FaultInjector(pair.dev_b, netns=pair.ns_b, direction="ingress", reorder_ppm=1)
