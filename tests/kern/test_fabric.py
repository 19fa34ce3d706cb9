"""The emulated fabric (`metaroce fabric`, issue 9): namespaces, ECMP over parallel links, and the
impairment program on switch ports, checked with real traffic.

One fabric (2 hosts, 4 parallel links per hop) serves the module; each test sets the ports it
uses and starts them from zero (`reset`).  Traffic is plain UDP from sockets in the host
namespaces, tagged with sequence numbers so the receiver can say which frames were lost,
duplicated, held back or damaged -- and the program's coins are replayed in Python
(`metaroce_xdp.fabric.plan`), so the tests know in advance exactly which frames a seed hits.
The last test runs the compat endpoint (XDP + AF_XDP + the compiled data plane) across the
fabric with 1 % loss.  The CLI builds and removes a fabric of its own, also after a killed `up`.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from metaroce_xdp import fabric
from metaroce_xdp.fabric import impair, units
from metaroce_xdp.fabric.topology import FabricError, fabric_namespaces, make_plan
from metaroce_xdp.topo import thread_in_netns

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "metaroce_xdp.cli", "fabric"]

pytestmark = pytest.mark.netns

PAYLOAD = 200


@pytest.fixture(scope="module")
def fab():
    name = f"t{os.getpid() % 100000}"
    fabric.down(name, kill=True)                 # remains of an earlier run with the same pid, if any
    f = fabric.up(name, hosts=2, paths=4)
    try:
        yield f
    finally:
        f.down()


# ------------------------------------------------------------------------ traffic helpers
class Flow:
    """UDP from h1 to h2: sender sockets in h1, one receiver in h2 draining in a thread."""

    def __init__(self, f: fabric.Fabric, v6: bool = False, tos: int = 0, port: int = 5000):
        self.f, self.v6 = f, v6
        h1, h2 = f.plan.host("h1"), f.plan.host("h2")
        self.fam = socket.AF_INET6 if v6 else socket.AF_INET
        self.dst = ((h2.ipv6 if v6 else h2.ipv4), port)
        self.src = h1.ipv6 if v6 else h1.ipv4
        with thread_in_netns(h2.ns):
            self.rx = socket.socket(self.fam, socket.SOCK_DGRAM)
            self.rx.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)      # SO_RCVBUFFORCE: rmem_max is 208 KiB
            if v6:
                self.rx.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVTCLASS, 1)
            else:
                self.rx.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
            self.rx.bind(self.dst)
        # the kernel's receive time of each frame (SO_TIMESTAMPNS) and the time each was handed to sendto
        self.rx.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self.arrived: list[tuple[int, int]] = []              # (seq, ns)
        self.sent_at: dict[int, int] = {}
        self.tos = tos
        self.got: list[tuple[int, int, bytes]] = []           # (seq, ecn bits, payload)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._drain, daemon=True)
        self._t.start()

    def _drain(self) -> None:
        self.rx.settimeout(0.05)
        while not self._stop.is_set():
            try:
                data, anc, _, _ = self.rx.recvmsg(4096, 128)
            except socket.timeout:
                continue
            tos, seq = 0, struct.unpack("!I", data[:4])[0]
            for level, kind, cdata in anc:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    sec, nsec = struct.unpack("qq", cdata[:16])
                    self.arrived.append((seq, sec * 1_000_000_000 + nsec))
                else:
                    tos = cdata[0]
            self.got.append((seq, tos & 3, data))

    def sender(self, sport: int = 0) -> socket.socket:
        with thread_in_netns(self.f.plan.host("h1").ns):
            s = socket.socket(self.fam, socket.SOCK_DGRAM)
            if self.tos:
                if self.v6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, self.tos)
                else:
                    s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, self.tos)
            s.bind((self.src, sport))
        return s

    def send(self, n: int, size: int = PAYLOAD, sport: int = 0, first: int = 0, gap_every: int = 0) -> None:
        s = self.sender(sport)
        # One CPU for the whole burst: frames sent from two CPUs go through two backlogs and may
        # overtake each other, which would change which frame each coin falls on.
        cpus = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {min(cpus)})
        try:
            for i in range(first, first + n):
                self.sent_at[i] = time.time_ns()
                s.sendto(payload(i, size), self.dst)
                if gap_every and i % gap_every == gap_every - 1:
                    time.sleep(0.001)
        finally:
            os.sched_setaffinity(0, cpus)
            s.close()

    def settle(self, expect: int | None = None, timeout: float = 5.0) -> list[tuple[int, int, bytes]]:
        """Wait until `expect` frames arrived or `timeout` passed (without `expect`, until 0.3 s pass
        without a frame)."""
        deadline, last, seen = time.monotonic() + timeout, time.monotonic(), -1
        while time.monotonic() < deadline:
            if expect is not None and len(self.got) >= expect:
                break
            if len(self.got) != seen:
                seen, last = len(self.got), time.monotonic()
            elif expect is None and time.monotonic() - last > 0.3:
                break
            time.sleep(0.02)
        time.sleep(0.05)
        return list(self.got)

    def close(self) -> None:
        self._stop.set()
        self._t.join(timeout=2)
        self.rx.close()


SO_TIMESTAMPNS = 35                                           # asm-generic/socket.h (SCM_TIMESTAMPNS)


def payload(seq: int, size: int = PAYLOAD) -> bytes:
    body = (seq.to_bytes(4, "big") * (size // 4 + 1))[:size - 4]
    return struct.pack("!I", seq) + body


def counters(f: fabric.Fabric, pattern: str) -> dict[str, dict[str, int]]:
    return {p.name: f.maps.counters(p.id) for p in f.select(pattern)}


# ------------------------------------------------------------------------ layout, units
def test_layouts_match_the_c():
    """The Python declarations of fab_cfg, fab_state and fab_counters equal what BCC derives from the C."""
    from bcc import BPF
    b = BPF(src_file=str(impair.BPF_SOURCE).encode(),
            cflags=[f"-I{impair.BPF_SOURCE.parent}", f"-DFAB_MAX_PORTS={impair.MAX_PORTS}"])
    try:
        for name, dt in (("fab_cfg", impair.CFG_DTYPE), ("fab_state", impair.STATE_DTYPE)):
            leaf = b[name.encode()].Leaf
            assert ctypes.sizeof(leaf) == dt.itemsize, name
            c_fields = [(f[0], getattr(leaf, f[0]).offset) for f in leaf._fields_]
            assert c_fields == [(n, dt.fields[n][1]) for n in dt.names], name
        scopes = re.findall(r"#define FAB_SCOPE_(\w+) (\d+)", impair.BPF_SOURCE.read_text())
        assert {k.lower(): int(v) for k, v in scopes} == impair.SCOPES
        leaf = b[b"fab_counters"].Leaf._type_                     # per-CPU: an array of the struct
        assert [f[0] for f in leaf._fields_] == list(impair.COUNTERS)
        assert ctypes.sizeof(leaf) == impair.COUNTERS_DTYPE.itemsize
    finally:
        b.cleanup()


def test_coins_are_fault_injects():
    """fabric_impair.c draws its coins as fault_inject.c does (the same generator and salts), which is
    what lets faults.plan replay both."""
    from metaroce_xdp import faults
    src = impair.BPF_SOURCE.read_text()
    salts = dict(re.findall(r"#define FAB_SALT_(\w+) (\d+)", src))
    assert {k: int(v) for k, v in salts.items()} == {
        "LOSS": faults.SALT_DROP, "CORRUPT": faults.SALT_CORRUPT, "CORRUPT_OFF": faults.SALT_CORRUPT_OFF,
        "DUP": faults.SALT_DUP, "REORDER": faults.SALT_DELAY}
    fi = Path(faults.BPF_SOURCE).read_text()
    for c in (src, fi):                                           # one generator, in the shared header
        assert '#include "tc_impair_common.h"' in c and "impair_mix(seed" in c.replace("cfg->seed", "seed")
    common = (impair.BPF_SOURCE.parent / "tc_impair_common.h").read_text()
    consts = [int(h, 16) for h in re.findall(r"(0x[0-9A-F]{16})ULL", common)]
    assert consts and all(f"{c:#x}".lower() in Path(faults.__file__).read_text().lower() for c in consts)


def test_units_and_plan_errors():
    assert units.parse_rate("10gbit") == 10**10 and units.parse_rate("off") == 0
    assert units.parse_size("30kb") == 30720 and units.parse_size("1500") == 1500
    assert units.parse_ratio("1%") == 10_000 == units.parse_ratio("0.01") == units.parse_ratio("10000ppm")
    assert units.parse_duration("1ms") == 1000
    for bad, fn in (("5x", units.parse_rate), ("2", units.parse_ratio), ("101%", units.parse_ratio),
                    ("ms", units.parse_duration)):
        with pytest.raises(units.UnitError):
            fn(bad)
    with pytest.raises(FabricError, match="name"):
        make_plan("Bad-Name")
    with pytest.raises(FabricError, match="ports"):
        make_plan("big", hosts=64, paths=32)
    p = make_plan("x", hosts=3, paths=2)
    assert len(p.ports) == 3 * (1 + 2 * 2) and len({q.ifindex for q in p.ports}) == len(p.ports)


# ------------------------------------------------------------------------ the CLI, up and down
def _leftovers(name: str) -> list[str]:
    out = fabric_namespaces(name)
    for path in (fabric.state_path(name), fabric.pin_dir(name),
                 fabric.state_path(name).with_name(f"fabric-{name}.lock")):
        if path.exists():
            out.append(str(path))
    return out


def _cli(*args, check=True, timeout=120):
    r = subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def test_cli_up_set_show_down_leaves_nothing():
    """`metaroce fabric up`, `set`, `show -j`, `down` through the real CLI: down removes every
    namespace, the pinned maps, the record and the lock -- also after an `up` that was killed."""
    name = f"c{os.getpid() % 100000}"
    try:
        _cli("up", "--name", name, "--hosts", "2", "--paths", "2", "--no-ipv6")
        assert len(fabric_namespaces(name)) == 5
        r = _cli("set", "--name", name, "l*:h*", "--loss", "1%", "--seed", "3", "-j")
        assert [row["port"] for row in json.loads(r.stdout)] == ["l1:h1", "l2:h2"]
        doc = json.loads(_cli("show", "--name", name, "-j").stdout)
        assert len(doc["ports"]) == 2 * (1 + 2 * 2)
        edge = {p["port"]: p["settings"] for p in doc["ports"]}
        assert edge["l2:h2"]["loss_ppm"] == 10_000 and edge["l1:sp0"]["loss_ppm"] == 0
        assert edge["l2:h2"]["seed"] != edge["l1:h1"]["seed"]          # one user seed, a pattern per link
        with fabric.Fabric.load(name) as f, pytest.raises(FabricError, match="no port"):
            f.set("nope", loss_ppm=1)
        rows = [json.loads(line) for line in _cli("watch", "--name", name, "l*:h*", "-c", "2", "-i", "0.1",
                                                  "-j").stdout.splitlines()]
        assert [r["port"] for r in rows] == ["l1:h1", "l2:h2"] * 2 and all("q_dropped" in r for r in rows)
        _cli("down", "--name", name)
        assert _leftovers(name) == []
        # A crash: `up` killed while it builds.  Whatever it got to, down removes it.
        p = subprocess.Popen([*CLI, "up", "--name", name, "--hosts", "3", "--paths", "4"], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not fabric_namespaces(name) and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.02)
        time.sleep(0.2)
        p.kill()
        p.wait()
        assert _leftovers(name), "the killed up left nothing to clean: it did not start building"
        with pytest.raises(FabricError, match="down"):                # refuses to build over the remains
            fabric.up(name)
        _cli("down", "--name", name)
        assert _leftovers(name) == []
    finally:
        fabric.down(name, kill=True)


# ------------------------------------------------------------------------ ECMP
def _flows(fab, flow: Flow, sports, per: int = 10) -> dict[int, str]:
    """Send `per` frames from each source port, one flow after the other; return the leaf-1 uplink
    each flow took, checking that all its frames took that one."""
    out = {}
    for sport in sports:
        before = counters(fab, "l1:sp*")
        flow.send(per, sport=sport)
        deadline = time.monotonic() + 5                # a neighbour resolution may hold the first frames
        while True:
            after = counters(fab, "l1:sp*")
            delta = {k: after[k]["matched"] - before[k]["matched"] for k in after}
            if sum(delta.values()) >= per or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert sorted(delta.values()) == [0] * (len(delta) - 1) + [per], (sport, delta)
        out[sport] = max(delta, key=delta.get)
    return out


@pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
def test_source_ports_spread_over_parallel_links(fab, v6):
    """Flows that differ only in their UDP source port take different parallel links (L4 multipath
    hash), and each flow sticks to one link; the spine's downlinks carry the same frames."""
    fab.set("all", clear=True, reset=True)
    flow = Flow(fab, v6=v6)
    try:
        used = Counter(_flows(fab, flow, range(41000, 41016)).values())
        got = flow.settle(160)
    finally:
        flow.close()
    assert len(got) == 160
    assert len(used) >= 3, used                                      # 16 flows over 4 links: at least 3 used
    down = counters(fab, "sp:l2.*")
    assert sum(c["matched"] for c in down.values()) == 160
    assert sum(1 for c in down.values() if c["matched"]) == len(used)


def test_link_down_moves_flows_to_the_other_links(fab):
    """`set PORT --link down` pulls a cable: both ends see it, the flows that took the link move to
    the others and nothing is lost; once it is up again every flow is back on its first link."""
    fab.set("all", clear=True, reset=True)
    flow = Flow(fab)
    sports = range(42000, 42032)
    try:
        first = _flows(fab, flow, sports)
        assert "l1:sp0" in first.values()                             # 32 flows over 4 links
        fab.set("l1:sp0", link="down")
        states = {p["port"]: p["state"] for p in fab.show(tbf=False)["ports"]}
        assert states["l1:sp0"] == "down" and states["sp:l1.0"] == "no-carrier" and states["l1:sp1"] == "up"
        moved = _flows(fab, flow, sports)
        assert "l1:sp0" not in moved.values() and len(set(moved.values())) >= 2
        fab.set("l1:sp0", link="up")
        assert _flows(fab, flow, sports) == first
        got = flow.settle(3 * 320)
    finally:
        fab.set("l1:sp0", link="up")
        flow.close()
    assert len(got) == 3 * 320


# ------------------------------------------------------------------------ seeded loss
def _lost(fab, seed: int, n: int) -> tuple[set[int], dict]:
    fab.set("l2:h2", clear=True, loss_ppm=10_000, seed=seed, reset=True)
    flow = Flow(fab)
    try:
        flow.send(n, gap_every=500)
        got = flow.settle()
    finally:
        flow.close()
    return set(range(n)) - {g[0] for g in got}, fab.maps.counters(fab.plan.port("l2:h2").id)


def test_seeded_loss_one_percent_reproducible(fab):
    """1 % loss on one port drops ~1 % of the frames, exactly those the seed's coins name, and the
    same seed drops the same frames again; another seed drops others."""
    n = 5000
    port = fab.plan.port("l2:h2")
    lost, c = _lost(fab, 11, n)
    expect = {i for i, acts in enumerate(fabric.plan(fabric.port_seed(11, port.id), n, loss_ppm=10_000))
              if "loss" in acts}
    assert lost == expect
    assert c["dropped"] == len(lost) and c["matched"] == n
    assert 0.005 * n <= len(lost) <= 0.015 * n
    again, _ = _lost(fab, 11, n)
    assert again == lost
    other, _ = _lost(fab, 12, n)
    assert other != lost and 0.005 * n <= len(other) <= 0.015 * n


# ------------------------------------------------------------------------ the bottleneck queue
def test_queue_marks_above_mark_depth_and_drops_above_drop_depth(fab):
    """A 20 Mbit/s bottleneck with mark depth 20 KB and drop depth 60 KB, hit by a burst of ECT(0)
    frames: frames that find more than 20 KB queued arrive CE-marked, frames beyond 60 KB are
    dropped by the model (tbf, the real queue behind it, drops nothing); Not-ECT frames above the
    mark depth pass unmarked."""
    size, n = 1000, 300                          # 1046-byte frames: 19 fit under the mark depth
    port = fab.plan.port("l2:h2")
    fab.set("l2:h2", clear=True, rate_bps=20_000_000, mark_depth=20_000, drop_depth=60_000, reset=True)
    flow = Flow(fab, tos=2)                      # ECT(0)
    try:
        flow.send(n, size=size)
        got = flow.settle()
    finally:
        flow.close()
    c = fab.maps.counters(port.id)
    ce = [seq for seq, ecn, _ in got if ecn == 3]
    assert c["q_dropped"] > 0 and c["marked"] > 0
    assert len(got) == n - c["q_dropped"]
    assert len(ce) == c["marked"]
    assert min(ce) >= 19                         # the first 19 frames cannot find 20 KB queued
    assert all(ecn == 2 for seq, ecn, _ in got if seq not in ce)
    st = fab.maps.state(port.id)
    assert st["q_peak"] <= 60_000
    assert impair.tbf_stats(port.ns, port.ifname)["drops"] == 0
    # Not-ECT: marked nothing, counted
    time.sleep(0.05)                             # the real queue drains (60 KB at 20 Mbit/s: 24 ms)
    fab.set("l2:h2", reset=True)
    flow = Flow(fab, tos=0)
    try:
        flow.send(60, size=size)
        got = flow.settle()
    finally:
        flow.close()
    c = fab.maps.counters(port.id)
    assert c["marked"] == 0 and c["not_ect"] > 0 and all(ecn == 0 for _, ecn, _ in got)
    fab.set("l2:h2", rate_bps=0)                 # the queue off: the tbf goes with it
    assert impair.tbf_stats(port.ns, port.ifname) is None and fab.maps.backlog(port.id) == 0


# ------------------------------------------------------------------------ dup, reorder, corrupt
def test_duplicate_reorder_corrupt_counted(fab):
    """Seeded duplication, reordering and corruption on one port: the counters equal the coins'
    plan, the receiver sees exactly the planned duplicates and damaged payloads, every frame held
    back spent at least the hold on the way (the kernel's receive time against the send), and frames
    that arrive after a later one are all held ones.  Whether a later frame overtakes a held one
    depends on the sender's pace (a loaded machine may send the next frame after the hold is over),
    so the hold is checked by time and the overtaking only where it happened."""
    n, seed = 2000, 3
    port = fab.plan.port("l2:h2")
    knobs = dict(dup_ppm=50_000, reorder_ppm=50_000, corrupt_ppm=50_000)
    fab.set("l2:h2", clear=True, reorder_us=500, seed=seed, reset=True, **knobs)
    flow = Flow(fab)
    try:
        flow.send(n)
        got = flow.settle()
    finally:
        flow.close()
    pl = fabric.plan(fabric.port_seed(seed, port.id), n, **knobs)
    want = {k: {i for i, a in enumerate(pl) if k in a} for k in ("dup", "reorder", "corrupt")}
    c = fab.maps.counters(port.id)
    assert (c["duplicated"], c["reordered"], c["corrupted"]) == tuple(len(want[k]) for k in ("dup", "reorder", "corrupt"))
    assert c["released"] == c["reordered"] and c["bounces"] >= c["reordered"] and c["failed"] == 0
    seen = Counter(seq for seq, _, _ in got)
    assert set(seen) == set(range(n))
    assert {s for s, k in seen.items() if k == 2} == want["dup"] and max(seen.values()) == 2
    damaged = {seq for seq, _, data in got if data != payload(seq)}
    assert damaged == want["corrupt"]
    order = [seq for seq, _, _ in got]
    late = {s for i, s in enumerate(order) if i and s < max(order[:i])}
    assert late <= want["reorder"], late - want["reorder"]
    last_arrival = dict(flow.arrived)                     # a duplicated frame's held copy is its later one
    assert set(last_arrival) == set(range(n))
    transit = {seq: last_arrival[seq] - flow.sent_at[seq] for seq in range(n)}
    held_short = {seq: transit[seq] for seq in want["reorder"] if transit[seq] < 500_000}
    assert not held_short, held_short                     # each held frame waited the 500 us hold


# ------------------------------------------------------------------------ the endpoint across the fabric
@pytest.mark.xfail(reason="known bug (issue 22's note, found by make vm-endpoint): under heavy loss the compat "
                          "requester stops sending -- no retransmission, no RETRY_EXC_ERR -- until the run's "
                          "no-traffic watchdog ends it", strict=False)
def test_compat_stream_survives_heavy_loss(fab):
    """`metaroce perf write-bw`, 2 QPs x 3000 x 64 KiB, compat, in process on both hosts, across the fabric with
    15 % seeded loss on h2's last hop (what a slow receiver whose RX ring overflows looks like: the VM of
    make vm-endpoint dropped that much): go-back-N must carry every byte through, or a WQE must fail with
    RETRY_EXC_ERR -- never a silent stop."""
    h1, h2 = fab.plan.host("h1"), fab.plan.host("h2")
    fab.set("all", clear=True, reset=True)
    fab.set("l2:h2", loss_ppm=150_000, seed=11)
    root = str(Path(__file__).resolve().parents[2])
    base = [sys.executable, "-m", "metaroce_xdp.cli", "perf", "write-bw", "-s", "65536", "-m", "1024", "-j",
            "--no-daemon", "--timeout", "20", "--profile", "compat", "-p", "18517"]
    srv = subprocess.Popen(["ip", "netns", "exec", h2.ns, *base, "-d", h2.ifname], cwd=root,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(300):
            ss = subprocess.run(["ip", "netns", "exec", h2.ns, "ss", "-Hltn", "sport = :18517"],
                                capture_output=True, text=True, timeout=10)
            if ss.stdout.strip() or srv.poll() is not None:
                break
            time.sleep(0.2)
        cli = subprocess.run(["ip", "netns", "exec", h1.ns, *base, "-d", h1.ifname, "-q", "2", "-n", "3000",
                              h2.ipv4], cwd=root, capture_output=True, text=True, timeout=300)
    finally:
        srv.kill()
        srv.communicate(timeout=30)
        fab.set("all", clear=True, reset=True)
    lines = [ln for ln in cli.stdout.splitlines() if ln.startswith("{")]
    assert cli.returncode == 0 and lines, cli.stderr[-1000:]
    assert json.loads(lines[-1]).get("peer_verified") is True


def test_compat_writes_verified_across_fabric_with_loss(fab):
    """The compat endpoint (XDP program + AF_XDP + the compiled data plane, no progress thread) in h1
    and h2 completes WRITEs across the fabric with 1 % seeded loss on each last hop: go-back-N recovers
    and every byte arrives."""
    from dp_players import FULL, wait_wcs
    from metaroce_xdp.dp import Context
    from metaroce_xdp.verbs_types import SGE, QPAttr, QPState, SendWR, WCStatus, WROpcode

    fab.set("all", clear=True, reset=True)
    fab.set("l*:h*", loss_ppm=10_000, seed=5)

    class P:
        def __init__(self, h):
            with thread_in_netns(h.ns):
                self.ctx = Context.open(h.ifname)
            self.pd = self.ctx.alloc_pd()
            self.buf = np.zeros(4 << 20, np.uint8)
            self.mr = self.pd.reg_mr(self.buf, FULL)
            self.cq = self.ctx.create_cq(4096)
            self.qp = self.ctx.create_qp(self.pd, self.cq, self.cq)

        def connect(self, peer):
            self.qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
            self.qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=peer.qp.qp_num, rq_psn=0x100, path_mtu=1024,
                                  dgid=peer.ctx.gid, max_dest_rd_atomic=4, min_rnr_timer=1))
            self.qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0x100, timeout=14, retry_cnt=7, rnr_retry=7,
                                  max_rd_atomic=4))

    a = b = None
    try:
        a, b = P(fab.plan.host("h1")), P(fab.plan.host("h2"))
        a.connect(b), b.connect(a)
        a.buf[:] = np.random.default_rng(1).integers(0, 256, a.buf.size, dtype=np.uint8)
        sizes = [1, 4095, 65536, 1 << 20, (1 << 20) + 7]
        wrs, regions, off = [], [], 0
        for i, n in enumerate(sizes):
            wrs.append(SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE, sg_list=[SGE(a.mr.addr + off, n, a.mr.lkey)],
                              remote_addr=b.mr.addr + off, rkey=b.mr.rkey))
            regions.append((off, n))
            off += n + 64
        a.qp.post_send(wrs)
        wcs = wait_wcs([a, b], a, len(wrs), timeout=120)
        assert [(w.wr_id, w.status) for w in wcs] == [(w.wr_id, WCStatus.SUCCESS) for w in wrs]
        for o, n in regions:
            assert zlib.crc32(b.buf[o:o + n]) == zlib.crc32(a.buf[o:o + n]), (o, n)
        assert not b.buf[off:].any()                                    # nothing written beyond
        assert a.ctx.stats()["retransmits"] > 0                          # A's context has this QP alone
    finally:
        for p in (a, b):
            if p is not None:
                p.ctx.close()
    edge = counters(fab, "l*:h*")
    assert edge["l2:h2"]["dropped"] > 0 and edge["l2:h2"]["matched"] > 2000
    spine = counters(fab, "sp:l2.*")
    assert sum(c["matched"] for c in spine.values()) >= edge["l2:h2"]["matched"]
