"""`make bench`: MetaRoCE beside its two bars -- kernel TCP and the fastest raw AF_XDP loop this
machine allows -- on one veth pair, in one run, with the ratios the targets of issue 7 are
stated in.

    python -m tools.bench                            # full run: table on stdout, plots and RESULTS.md
                                                     # (the table in Markdown) in docs/bench/
    python -m tools.bench --json FILE                # ... and the report as JSON (schema below)
    python -m tools.bench --quick --json FILE --no-plots   # short smoke run (tests/tools/test_bench_smoke.py)

What one run measures, in this order, on namespaces A and B joined by one veth pair:

  1. qperf (no XDP program on the link, so the peer keeps TSO): tcp_lat (8 B) and tcp_bw
     (64 KiB) with the SAME CPU placement as MetaRoCE's run (--placement), tcp_lat also with
     both ends on one core (for information), the message-size series for the plots, and
     kernel TCP's bytes per CPU-second during tcp_bw.
  2. The raw AF_XDP loop (tools/afxdp_rawloop.c, bpf/xsk_redirect_test.c steering UDP/4791
     into its socket), swept to find the fastest configuration: placement (tx/rx unpinned,
     pinned apart, on one core), threaded NAPI on the receiving veth (its kthread pinned to
     the other core or left to the scheduler), batch size, XDP_MAX_TX_SKB_BUDGET, wake-up
     policy (need_wakeup on/off; rx sleeping in poll(), spinning, or busy-polling).  The sweep
     is coordinate descent -- one knob at a time from the best so far, each candidate tried
     twice, interleaved -- and the winner is re-run REPS times; its best run is the figure
     (other load on the host only ever slows a run, and a baseline set too low would
     inflate every ratio), printed beside its configuration, the repetitions and their
     median.  Frame sizes: 64 B (the small-message bar) and MetaRoCE's full data packet at
     path MTU 1024 (1082 B, veth MTU 1500) and 4096 (4154 B, veth MTU 4200: two UMEM chunks a
     frame, so XDP_USE_SG and the redirect program loaded frags-aware, BPF_F_XDP_HAS_FRAGS).
  3. MetaRoCE through `metaroce perf` (metaroce_xdp/cli/perf.py, called through the CLI, on the compiled
     data plane: `--plane compiled`): 8-byte WRITE latency median and p99, 8-byte WRITE message
     rate on 1 and 16 QPs, 64 KiB WRITE bandwidth on one QP at path MTU 1024 and 4096, 4 and 16
     QPs in both directions at once (aggregate), the size series for the plots, and bytes per
     CPU-second.  A measurement perf cannot take yet (no option for several QPs, no path MTU
     4096) is a row with "not available: why".

CPU cost: psutil samples the user+system CPU time of both sides' processes (and their
children) every 20 ms; the rate over the middle half of the test window, divided into the
bytes moved per second, gives bytes per CPU-second.  This kernel has no IRQ time accounting, so
softirq work (veth transmit, XDP, NAPI) done in a process's context is charged to it; work in
threaded-NAPI kthreads is not.

JSON report (schema "metaroce-bench/1"; keys are only ever added, never renamed):

    {"schema": "metaroce-bench/1", "when": "YYYY-MM-DD HH:MM UTC",
     "host": {"kernel", "cpus", "busy_before_pct", "load_avg", "load_avg_after"},
     "options": {"quick", "planes", "placement", "threaded_napi", "durations"},
     "placement": {"a_cpu", "b_cpu", "text"},        # MetaRoCE client/server and qperf alike
     "rows": [ROW, ...],                              # the table, in order
     "raw_sweep": {"64": [TRIAL, ...], "1082": [...]},   # every raw-loop trial, stage by stage
     "series": {"throughput": [PT, ...], "latency": [PT, ...]},  # what the plots show
     "perf_options": {"qps": str|null, "bidir": str|null, "plane": str|null},
     "plots": [path, ...]}
    ROW   = {"id": stable key, "group": "tcp"|"raw"|"metaroce"|"cpu"|"ratio", "label": str,
             "value": number|null, "unit": str, "config": str|null,
             "not_available": str|null,                # exactly one of value / not_available
             "target": str|null, "meets": bool|null}   # ratios only
    TRIAL = {"stage", "config": {...}, "label", "rx_fps", "tx_fps", "rx_dropped", "error",
             "load1" (the host's 1-minute load average as the trial began; sweep trials only)}
    PT    = {"who", "size", "value", "unit"}

Neighbours: metaroce_xdp/topo.py (namespaces, veth, cleanup), metaroce_xdp/cli/perf.py (owned elsewhere;
only called), tests/tools/test_bench_smoke.py, docs/bench/ (plots, README section).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rich.markup import escape

ROOT = Path(__file__).resolve().parents[1]
RAWLOOP_SRC = ROOT / "tools" / "afxdp_rawloop.c"
BUILD_DIR = ROOT / "build"
REDIRECT_SRC = ROOT / "bpf" / "xsk_redirect_test.c"
PLOTS_DIR = ROOT / "docs" / "bench"
ROCE_PORT = 4791
SCHEMA = "metaroce-bench/1"

# Bytes a MetaRoCE data packet adds around its payload: Ethernet, IPv4, UDP, BTH, ICRC.
WIRE_OVERHEAD = 14 + 20 + 8 + 12 + 4
SMALL_FRAME = 64                # the small-message bar: minimum Ethernet frame (no FCS)
XDP_FLAGS_DRV_MODE = 1 << 2
BW_MSG = 65536
LAT_MSG = 8
TARGET_LAT = 0.5                # MetaRoCE latency / TCP latency, at most
TARGET_RATE = 0.8               # MetaRoCE rate / raw AF_XDP rate, at least
PERF_PORT = 18515               # `metaroce perf` connection set-up (TCP), its default
MTU_FOR_PMTU = {1024: 1500, 4096: 4200}
# perf failures worth a second attempt: a side starved past its peer's timers on a loaded host
TRANSIENT = re.compile(r"RETRY_EXC_ERR|RNR_RETRY_EXC|no traffic|timed? ?out|timeout|not listening", re.I)
PLANES = ("compiled",)          # the MetaRoCE data plane(s) measured: the compiled one, what applications get


def frame_bytes(pmtu: int) -> int:
    """Size of a full-payload RDMA WRITE Middle packet at this path MTU."""
    return pmtu + WIRE_OVERHEAD


@dataclass(frozen=True)
class Durations:
    qperf_s: float          # headline qperf runs
    series_s: float         # qperf runs of the size series
    raw_trial_s: float      # one raw-loop trial of the sweep
    raw_reps: int           # repetitions of the winning raw configuration
    sweep_passes: int       # times each candidate of a sweep stage is tried
    lat_iters: int
    rate_iters: int         # 8-byte WRITEs for the message rate (0: not measured)
    bw_iters: int           # 64 KiB WRITEs
    series_sizes: tuple[int, ...]
    perf_timeout_s: float
    full_sweep: bool


FULL = Durations(qperf_s=3, series_s=1, raw_trial_s=0.8, raw_reps=3, sweep_passes=2, lat_iters=2000, rate_iters=50000,
                 bw_iters=10000, series_sizes=(8, 512, 8192, 65536), perf_timeout_s=180, full_sweep=True)
QUICK = Durations(qperf_s=1, series_s=1, raw_trial_s=0.4, raw_reps=1, sweep_passes=1, lat_iters=300, rate_iters=0,
                  bw_iters=300, series_sizes=(), perf_timeout_s=60, full_sweep=False)


class BenchError(RuntimeError):
    """A measurement could not be taken; the message names the step."""


# --------------------------------------------------------------------------- rows


def row(rid: str, group: str, label: str, value=None, unit: str = "", config: str | None = None,
        na: str | None = None, target: str | None = None, meets: bool | None = None) -> dict:
    """One line of the table.  A row has a number or says why not; never both, never neither."""
    if value is None and not na:
        na = "not measured"
    if value is not None:
        value, na = float(value), None
    return {"id": rid, "group": group, "label": label, "value": value, "unit": unit, "config": config,
            "not_available": na, "target": target, "meets": meets}


def ratio_row(rid: str, label: str, num: dict, den: dict, target: float | None, higher_better: bool) -> dict:
    """num.value / den.value as a row; not available (naming the missing side) when either is."""
    tgt = None if target is None else (f">= {target}" if higher_better else f"<= {target}")
    for side in (num, den):
        if side["value"] is None:  # the row itself says why; name it
            return row(rid, "ratio", label, na=f"not available: no {side['id']}", target=tgt)
    if not den["value"]:
        return row(rid, "ratio", label, na=f"{den['label']} is zero", target=tgt)
    r = num["value"] / den["value"]
    meets = None if target is None else (r >= target if higher_better else r <= target)
    return row(rid, "ratio", label, r, "x", target=tgt, meets=meets)


# --------------------------------------------------------------------------- build


def build_rawloop(build_dir: Path = BUILD_DIR) -> Path:
    """Compile tools/afxdp_rawloop.c with gcc into build_dir (rebuilt when the source is newer)."""
    out = build_dir / "afxdp_rawloop"
    if out.exists() and out.stat().st_mtime >= RAWLOOP_SRC.stat().st_mtime:
        return out
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise BenchError("no C compiler: install gcc to build tools/afxdp_rawloop.c")
    build_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    cp = subprocess.run([gcc, "-O2", "-Wall", "-o", str(tmp), str(RAWLOOP_SRC)],
                        capture_output=True, text=True)
    if cp.returncode != 0:
        raise BenchError(f"building afxdp_rawloop failed:\n{cp.stderr}")
    tmp.replace(out)  # atomic: a parallel run never executes a half-written binary
    return out


# --------------------------------------------------------------------------- helpers


def _last_json(text: str) -> dict | None:
    """The last line of text that is a JSON object (tools print logs before their result)."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def _cpus() -> tuple[int, int] | tuple[None, None]:
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[0], cpus[1]) if len(cpus) >= 2 else (None, None)


def busy_pct(seconds: float = 0.5) -> float:
    """Share of all CPUs busy over a short idle wait: other load disturbs every number here."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait
    t0, i0 = sample()
    time.sleep(seconds)
    t1, i1 = sample()
    return 100.0 * (1 - (i1 - i0) / (t1 - t0)) if t1 > t0 else 0.0


def _readline(p: subprocess.Popen, timeout: float) -> str:
    """One line of p's stdout within timeout ('' on EOF or timeout)."""
    r, _, _ = select.select([p.stdout], [], [], timeout)
    return p.stdout.readline() if r else ""


def _stop(p: subprocess.Popen) -> tuple[str, str]:
    """Terminate a process started by topo.popen (its own session) and collect output."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        return p.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        return p.communicate()


def set_mtu(topo, pair, mtu: int) -> None:
    for ep in (pair.a, pair.b):
        topo.ipr(ep.ns).link("set", index=ep.ifindex, mtu=mtu)


def tso_on(topo, ep) -> bool | None:
    cp = topo.run(ep.ns, ["ethtool", "-k", ep.ifname], check=False, timeout=10)
    m = re.search(r"^tcp-segmentation-offload:\s+(\w+)", cp.stdout, re.M)
    return None if m is None else m.group(1) == "on"


def _pinned(argv: list[str], cpu: int | None) -> list[str]:
    return argv if cpu is None else ["taskset", "-c", str(cpu), *argv]


# --------------------------------------------------------------------------- CPU sampling


class CpuSampler:
    """psutil user+system CPU seconds of some process trees, sampled every `period` seconds
    on a thread; rate(t0, t1) is CPU-seconds per wall-second between two instants."""

    def __init__(self, pids: list[int], period: float = 0.02):
        import psutil
        self._psutil, self.period = psutil, period
        self.procs = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                self.procs.append(psutil.Process(pid))
        self.samples: list[tuple[float, float]] = []
        self._seen: dict[int, float] = {}   # last CPU time of every process ever seen (exited ones keep theirs)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _total(self) -> float:
        ps = self._psutil
        for root in self.procs:
            try:
                tree = [root, *root.children(recursive=True)]
            except ps.Error:
                continue
            for p in tree:
                with contextlib.suppress(ps.Error):
                    c = p.cpu_times()
                    self._seen[p.pid] = c.user + c.system
        return sum(self._seen.values())

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), self._total()))
            self._stop.wait(self.period)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    def rate(self, t0: float, t1: float) -> float | None:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 3 or inside[-1][0] - inside[0][0] <= 0:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


# --------------------------------------------------------------------------- placement


@dataclass(frozen=True)
class Placement:
    """Where host A's process (perf/qperf client, raw tx) and host B's (server, raw rx) run."""
    name: str
    a_cpu: int | None
    b_cpu: int | None

    @property
    def text(self) -> str:
        def at(c):
            return "unpinned" if c is None else f"CPU {c}"
        return f"{self.name}: client (A) {at(self.a_cpu)}, server (B) {at(self.b_cpu)}"


def placement_for(name: str) -> Placement:
    c0, c1 = _cpus()
    if name == "split" and c1 is not None:
        return Placement("split", c0, c1)
    if name == "same" and c0 is not None:
        return Placement("same", c0, c0)
    return Placement("unpinned", None, None)


# --------------------------------------------------------------------------- qperf

_UNITS_BW = {"bytes/sec": 1, "KB/sec": 1e3, "MB/sec": 1e6, "GB/sec": 1e9, "TB/sec": 1e12}
_UNITS_LAT = {"ns": 1e-3, "us": 1, "ms": 1e3, "sec": 1e6, "s": 1e6}


def parse_qperf(text: str) -> dict:
    """{'tcp_bw_gbps', 'tcp_lat_us'} from qperf's report (decimal units, one-way latency)."""
    out = {}
    m = re.search(r"^\s*bw\s*=\s*([\d.]+)\s*(\S+)", text, re.M)
    if m and m.group(2) in _UNITS_BW:
        out["tcp_bw_gbps"] = float(m.group(1)) * _UNITS_BW[m.group(2)] * 8 / 1e9
    m = re.search(r"^\s*latency\s*=\s*([\d.]+)\s*(\S+)", text, re.M)
    if m and m.group(2) in _UNITS_LAT:
        out["tcp_lat_us"] = float(m.group(1)) * _UNITS_LAT[m.group(2)]
    return out


def qperf_once(topo, pair, test: str, size: int, seconds: float, pl: Placement, cpu: bool = False) -> dict:
    """One qperf test A -> B with a fresh server (B at pl.b_cpu, client A at pl.a_cpu).  With
    cpu=True also 'cpu_per_s': both processes' CPU-seconds per second mid-run (psutil)."""
    srv = topo.popen(pair.b.ns, _pinned(["qperf"], pl.b_cpu), stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    argv = _pinned(["qperf", pair.b.ipv4, "-t", str(max(1, round(seconds))), "-m", str(size), test], pl.a_cpu)
    try:
        text = err = ""
        cpu_rate = None
        for _ in range(40):  # the server may still be starting: qperf then fails to connect
            cli = topo.popen(pair.a.ns, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            t0 = time.monotonic()
            with (CpuSampler([srv.pid, cli.pid]) if cpu else contextlib.nullcontext()) as smp:
                try:
                    text, err = cli.communicate(timeout=seconds + 30)
                except subprocess.TimeoutExpired:
                    text, err = _stop(cli)
            if cli.returncode == 0 and "=" in text:
                if smp is not None:  # middle of the run: connection set-up and teardown left out
                    cpu_rate = smp.rate(t0 + 0.3 * seconds, t0 + 0.8 * seconds)
                break
            time.sleep(0.1)
    finally:
        _stop(srv)
    parsed = parse_qperf(text)
    if not parsed:
        return {"error": f"qperf {test}: " + ((text + err).strip()[-300:] or "no output")}
    if cpu_rate:
        parsed["cpu_per_s"] = cpu_rate
    return parsed


# --------------------------------------------------------------------------- raw AF_XDP


def load_xdp_frags(bpf, name: bytes) -> int:
    """BPF_PROG_LOAD of a function BCC compiled (its map fds already in place) with
    BPF_F_XDP_HAS_FRAGS, which BCC 0.26's load_func cannot pass: veth takes such a program
    at an MTU above one page, and hands it frames in several buffers.  Returns the fd.
    (kern/bpfsys.prog_load does the loading, as for the endpoint's own program.)"""
    from bcc.libbcc import lib

    from metaroce_xdp.kern import bpfsys

    start = lib.bpf_function_start(bpf.module, name)
    size = lib.bpf_function_size(bpf.module, name)
    if not start or not size:
        raise BenchError(f"BCC compiled no function {name!r}")
    try:
        return bpfsys.prog_load(bpfsys.BPF_PROG_TYPE_XDP, start, size, lib.bpf_module_license(bpf.module),
                                kern_version=lib.bpf_module_kern_version(bpf.module),
                                prog_flags=bpfsys.BPF_F_XDP_HAS_FRAGS, name=name)
    except OSError as e:
        raise BenchError(f"loading {name.decode()} with BPF_F_XDP_HAS_FRAGS: {e}") from None


class RedirectProgram:
    """bpf/xsk_redirect_test.c on B's veth end, through BCC: compiled once, attached in
    native mode only while the raw loop runs (detach() leaves it loaded).  frags=True loads
    it as frags-aware (BPF_F_XDP_HAS_FRAGS), for frames larger than a page."""

    def __init__(self, topo, ep, attach: bool = True, frags: bool = False):
        import bcc  # system package (python3-bpfcc); imported late so --help works without it
        self.topo, self.ep, self.attached = topo, ep, False
        with topo.enter(ep.ns):
            self.bpf = bcc.BPF(src_file=str(REDIRECT_SRC).encode(),
                               cflags=[f"-DXSK_TEST_UDP_PORT={ROCE_PORT}"])
            if frags:
                try:
                    self.fn = bcc.BPF.Function(self.bpf, b"xsk_redirect_test",
                                               load_xdp_frags(self.bpf, b"xsk_redirect_test"))
                except BaseException:
                    self.bpf.cleanup()
                    raise
                self.bpf.funcs[b"xsk_redirect_test"] = self.fn  # closed with the module
            else:
                self.fn = self.bpf.load_func(b"xsk_redirect_test", bcc.BPF.XDP)
        self.map_fd = self.bpf.get_table(b"xsks_map").get_fd()
        if attach:
            try:
                self.attach()
            except BaseException:
                self.close()
                raise

    def attach(self) -> None:
        with self.topo.enter(self.ep.ns):
            self.bpf.attach_xdp(self.ep.ifname.encode(), self.fn, XDP_FLAGS_DRV_MODE)
        self.attached = True

    def detach(self) -> None:
        if self.attached:
            self.attached = False
            with self.topo.enter(self.ep.ns):
                self.bpf.remove_xdp(self.ep.ifname.encode(), XDP_FLAGS_DRV_MODE)

    def redirected(self) -> int:
        t = self.bpf.get_table(b"verdicts")
        return int(t.sum(t.Key(0)).value)

    def close(self) -> None:
        if self.bpf is None:
            return
        try:
            self.detach()
        finally:
            self.bpf.cleanup()
            self.bpf = None


@dataclass(frozen=True)
class RawConfig:
    """One configuration of the raw loop (see afxdp_rawloop.c for the knobs)."""
    tx_cpu: int | None = None
    rx_cpu: int | None = None
    napi_threaded: bool = False     # /sys/class/net/<B's veth>/threaded
    napi_cpu: int | None = None     # the NAPI kthread's CPU (threaded only)
    batch: int = 64
    budget: int | None = None       # XDP_MAX_TX_SKB_BUDGET (kernel default 32)
    need_wakeup: bool = True
    wait: str = "poll"              # rx with an empty ring: poll | spin | busy-poll

    @property
    def label(self) -> str:
        def at(c):
            return "unpinned" if c is None else f"CPU {c}"
        napi = (f"threaded NAPI {at(self.napi_cpu)}" if self.napi_threaded else "NAPI in softirq")
        return (f"tx {at(self.tx_cpu)}, rx {at(self.rx_cpu)}, {napi}, batch {self.batch}, "
                f"tx skb budget {self.budget or 'default'}, need_wakeup {'on' if self.need_wakeup else 'off'}, "
                f"rx {self.wait}")


class NapiControl:
    """Threaded NAPI on one veth end, and its kthreads' CPU.  The kthreads are told apart from
    other namespaces' (which may share the interface name) by appearing when we switch it on."""

    def __init__(self, topo, ep, initial: bool):
        self.topo, self.ep, self.initial = topo, ep, initial
        self.on: bool | None = None
        self.kthreads: list[int] = []

    @staticmethod
    def _napi_threads(ifname: str) -> set[int]:
        out = set()
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                with contextlib.suppress(OSError):
                    if (d / "comm").read_text().strip().startswith(f"napi/{ifname}-"):
                        out.add(int(d.name))
        return out

    def set(self, on: bool, cpu: int | None) -> None:
        if on != self.on:
            before = self._napi_threads(self.ep.ifname) if on else set()
            cp = self.topo.run(self.ep.ns, ["sh", "-c", f"echo {int(on)} > /sys/class/net/{self.ep.ifname}/threaded"],
                               check=False, timeout=10)
            if cp.returncode != 0:
                raise BenchError(f"threaded NAPI {'on' if on else 'off'}: {cp.stderr.strip()}")
            self.on = on
            self.kthreads = sorted(self._napi_threads(self.ep.ifname) - before) if on else []
        if on:
            cpus = set(os.sched_getaffinity(0)) if cpu is None else {cpu}
            for pid in self.kthreads:
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(pid, cpus)

    def restore(self) -> None:
        with contextlib.suppress(Exception):
            self.set(self.initial, None)


def run_rawloop(topo, pair, binary: Path, prog: RedirectProgram, frame: int, seconds: float,
                cfg: RawConfig = RawConfig()) -> dict:
    """tx in A and rx in B for `seconds`; returns {'tx': {...}, 'rx': {...}}."""
    rx_argv = [str(binary), "rx", "-i", pair.b.ifname, "-s", str(frame), "-t", str(seconds),
               "--idle", "5", "--xskmap-fd", str(prog.map_fd), "-b", str(cfg.batch), "--wait", cfg.wait]
    tx_argv = [str(binary), "tx", "-i", pair.a.ifname, "-s", str(frame),
               "-t", str(seconds + 0.5),  # outlasts rx's window, which opens at its first frame
               "--src-mac", pair.a.mac, "--dst-mac", pair.b.mac,
               "--src-ip", pair.a.ipv4, "--dst-ip", pair.b.ipv4, "-b", str(cfg.batch)]
    for argv, cpu in ((rx_argv, cfg.rx_cpu), (tx_argv, cfg.tx_cpu)):
        if cpu is not None:
            argv += ["-c", str(cpu)]
        if not cfg.need_wakeup:
            argv.append("--no-need-wakeup")
    if cfg.budget:
        tx_argv += ["--budget", str(cfg.budget)]
    rx = topo.popen(pair.b.ns, rx_argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    pass_fds=(prog.map_fd,))
    try:
        line = _readline(rx, 10)
        if line.strip() != "ready":
            out, err = _stop(rx)
            raise BenchError(f"raw rx did not start: {(line + out + err).strip()[-300:]}")
        tx = topo.run(pair.a.ns, tx_argv, timeout=seconds + 20, check=False)
        out, err = rx.communicate(timeout=seconds + 20)
    finally:
        if rx.poll() is None:
            _stop(rx)
    tx_res, rx_res = _last_json(tx.stdout), _last_json(out)
    if tx_res is None:
        raise BenchError(f"raw tx failed ({tx.returncode}): {tx.stderr.strip()[-300:]}")
    if rx_res is None:
        raise BenchError(f"raw rx failed ({rx.returncode}): {err.strip()[-300:]}")
    return {"tx": tx_res, "rx": rx_res}


def _sweep_stages(d: Durations) -> list[tuple[str, callable]]:
    """(stage, best -> candidate configs): coordinate descent over the loop's knobs."""
    c0, c1 = _cpus()
    if c1 is None:
        placements = [RawConfig()]
    else:
        placements = [RawConfig(), RawConfig(c0, c1), RawConfig(c0, c0), RawConfig(c1, c1),
                      RawConfig(c0, c0, True, c1), RawConfig(c1, c1, True, c0), RawConfig(c0, c1, True, c1),
                      RawConfig(c0, c1, True, None),
                      RawConfig(None, None, True, None)]
    if not d.full_sweep:  # --quick: today's default beside the usual winner, nothing else
        return [("placement", lambda best: [RawConfig(c0, c1)] + ([RawConfig(c0, c0, True, c1)] if c1 is not None
                                                                  else []))]
    return [
        ("placement", lambda best: placements),
        ("batch", lambda best: [replace(best, batch=b) for b in (16, 32, 128, 256)]),
        ("tx skb budget", lambda best: [replace(best, budget=b) for b in (128, 512)]),
        ("wake-up", lambda best: [replace(best, need_wakeup=False), replace(best, wait="spin"),
                                  replace(best, wait="busy-poll")]),
    ]


def sweep_rawloop(topo, pair, binary: Path, prog: RedirectProgram, napi: NapiControl, frame: int,
                  d: Durations, log) -> tuple[RawConfig | None, list[dict], list[dict]]:
    """Find the fastest configuration for `frame`-byte frames; (best, final runs, all trials)."""
    trials: list[dict] = []
    results: dict[RawConfig, list[float]] = {}   # every successful rx rate of a configuration

    def trial(stage: str, cfg: RawConfig) -> None:
        t = {"stage": stage, "config": asdict(cfg), "label": cfg.label, "rx_fps": None, "tx_fps": None,
             "rx_dropped": None, "error": None, "load1": os.getloadavg()[0]}
        results.setdefault(cfg, [])
        try:
            napi.set(cfg.napi_threaded, cfg.napi_cpu)
            r = run_rawloop(topo, pair, binary, prog, frame, d.raw_trial_s, cfg)
            t.update(rx_fps=r["rx"]["fps"], tx_fps=r["tx"]["fps"], rx_dropped=r["rx"].get("rx_dropped"),
                     cpu_s=r["rx"].get("cpu_s", 0) + r["tx"].get("cpu_s", 0))
            results[cfg].append(r["rx"]["fps"])
        except Exception as e:  # noqa: BLE001 - a configuration this host refuses is a result too
            t["error"] = str(e)[:300]
        trials.append(t)
        log(f"  raw {frame} B [{stage}] {cfg.label}: "
            + (f"{t['rx_fps'] / 1e6:.3f} Mfps" if t["rx_fps"] is not None else f"error {t['error']}"))

    # Other load on the host only ever slows a run down, so a configuration is judged by its
    # best trial, and every stage runs its candidates twice, interleaved, so that a burst of
    # load does not single one out.
    best: RawConfig | None = None
    for stage, candidates in _sweep_stages(d):
        todo = list(dict.fromkeys(([best] if best else []) + candidates(best)))
        for _ in range(d.sweep_passes):
            for cfg in todo:
                trial(stage, cfg)
        ok = {c: max(v) for c, v in results.items() if v}
        if ok:
            best = max(ok, key=ok.get)
    final: list[dict] = []
    if best is not None:
        napi.set(best.napi_threaded, best.napi_cpu)
        for i in range(d.raw_reps):
            try:
                r = run_rawloop(topo, pair, binary, prog, frame, max(d.raw_trial_s, 2 * d.raw_trial_s), best)
                final.append(r)
                trials.append({"stage": "final", "config": asdict(best), "label": best.label,
                               "rx_fps": r["rx"]["fps"], "tx_fps": r["tx"]["fps"],
                               "rx_dropped": r["rx"].get("rx_dropped"), "error": None})
            except Exception as e:  # noqa: BLE001
                trials.append({"stage": "final", "config": asdict(best), "label": best.label, "rx_fps": None,
                               "tx_fps": None, "rx_dropped": None, "error": str(e)[:300]})
    return best, final, trials


# --------------------------------------------------------------------------- MetaRoCE


def metaroce_perf_available() -> bool:
    """The `metaroce` CLI (metaroce_xdp/cli/main.py) has the `perf` command group."""
    try:
        from metaroce_xdp.cli import main as metaroce_cli
    except Exception:  # noqa: BLE001 - an install without the CLI's dependencies: "not available"
        return False
    return any(g.name == "perf" for g in metaroce_cli.app.registered_groups)


# Option names metaroce_xdp/cli/perf.py may grow; the first one its --help lists is used.
PERF_OPTION_NAMES = {"qps": ("--qps", "--num-qps", "--qp-count"),
                     "bidir": ("--bidirectional", "--bidir", "--duplex"),
                     "plane": ("--plane",)}


def perf_options() -> dict:
    """Which optional `metaroce perf write-bw` options exist: {'qps': '--qps' | None, ...}."""
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    cp = subprocess.run([sys.executable, "-m", "metaroce_xdp.cli", "perf", "write-bw", "--help"], cwd=ROOT,
                        capture_output=True, text=True, env=env, timeout=60)
    have = set(re.findall(r"--[a-z][a-z0-9-]*", cp.stdout))
    return {k: next((n for n in names if n in have), None) for k, names in PERF_OPTION_NAMES.items()}


def _listening(topo, ns: str, port: int) -> bool:
    cp = topo.run(ns, ["ss", "-Hltn", f"sport = :{port}"], check=False, timeout=10)
    return bool(cp.stdout.strip())


def run_metaroce(topo, pair, test: str, size: int, iters: int, pmtu: int, timeout: float,
                 pl: Placement = Placement("unpinned", None, None), extra: tuple[str, ...] = (),
                 cpu: bool = False) -> dict:
    """`metaroce perf <test>`: server in B, client in A; the client's JSON (the server's as a
    spare).  With cpu=True adds 'cpu_per_s': both processes' CPU-seconds per second over the
    middle half of the test window (the `seconds` before the result line appeared)."""
    base = [sys.executable, "-m", "metaroce_xdp.cli", "perf", test]
    opts = ["-s", str(size), "-n", str(iters), "-m", str(pmtu), "--json", *extra]
    srv = topo.popen(pair.b.ns, _pinned([*base, "-d", pair.b.ifname, *opts], pl.b_cpu), cwd=ROOT,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # The server imports numba and compiles its XDP program before it listens.
        deadline = time.monotonic() + min(90.0, timeout)
        while not _listening(topo, pair.b.ns, PERF_PORT):
            if srv.poll() is not None:
                out, err = srv.communicate()
                raise BenchError(f"perf {test} server exited ({srv.returncode}): {(err or out).strip()[-400:]}")
            if time.monotonic() > deadline:
                raise BenchError(f"perf {test} server not listening on TCP {PERF_PORT} after 90 s")
            time.sleep(0.2)
        cli = topo.popen(pair.a.ns, _pinned([*base, "-d", pair.a.ifname, *opts, pair.b.ipv4], pl.a_cpu),
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        res, t_res, lines = None, None, []
        with (CpuSampler([srv.pid, cli.pid]) if cpu else contextlib.nullcontext()) as smp:
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                line = _readline(cli, max(0.1, end - time.monotonic()))
                if not line:
                    break
                lines.append(line)
                if line.lstrip().startswith("{") and res is None:
                    with contextlib.suppress(json.JSONDecodeError):
                        res, t_res = json.loads(line), time.monotonic()
            if cli.poll() is None and res is None:
                _stop(cli)
        c_out, c_err = cli.communicate(timeout=30)
        try:
            s_out, s_err = srv.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            s_out, s_err = _stop(srv)
    finally:
        if srv.poll() is None:
            _stop(srv)
    res = res or _last_json("".join(lines) + c_out) or _last_json(s_out)
    if res is None:
        raise BenchError(f"perf {test} client failed ({cli.returncode}): {(c_err or s_err).strip()[-400:]}")
    if smp is not None and t_res is not None and res.get("seconds"):
        s = float(res["seconds"])
        rate = smp.rate(t_res - 0.75 * s, t_res - 0.25 * s)
        if rate:
            res["cpu_per_s"] = rate
    return res


# --------------------------------------------------------------------------- the run


class Bench:
    """One run: the topology, the report being built, and the steps that fill it."""

    def __init__(self, d: Durations, planes: tuple[str, ...], pl: Placement, threaded_napi: bool, log):
        self.d, self.planes, self.pl, self.threaded_napi, self.log = d, planes, pl, threaded_napi, log
        self.rows: list[dict] = []
        self.byid: dict[str, dict] = {}
        self.series = {"throughput": [], "latency": []}
        self.raw_sweep: dict[str, list] = {}

    def add(self, r: dict) -> dict:
        self.rows.append(r)
        self.byid[r["id"]] = r
        return r

    def point(self, kind: str, who: str, size: int, value, unit: str) -> None:
        if value is not None:
            self.series[kind].append({"who": who, "size": size, "value": float(value), "unit": unit})

    # ----- qperf
    def qperf(self, topo, pair) -> None:
        d, pl = self.d, self.pl
        if shutil.which("qperf") is None:
            for rid, group, label, unit in (("tcp.lat_us", "tcp", "qperf tcp_lat 8 B", "us"),
                                            ("tcp.bw_gbps", "tcp", "qperf tcp_bw 64 KiB", "Gb/s"),
                                            ("cpu.tcp.bytes_per_cpu_s", "cpu", "kernel TCP: bytes per CPU-second",
                                             "GB/CPU-s")):
                self.add(row(rid, group, label, unit=unit, na="qperf not installed (scripts/setup.sh installs it)"))
            return
        self.log(f"qperf tcp_lat / tcp_bw, {pl.text}")
        tso = tso_on(topo, pair.a)
        lat = qperf_once(topo, pair, "tcp_lat", LAT_MSG, d.qperf_s, pl)
        self.add(row("tcp.lat_us", "tcp", "qperf tcp_lat 8 B (one-way)", lat.get("tcp_lat_us"), "us", pl.text,
                     na=lat.get("error")))
        same = placement_for("same")
        if same != pl:
            s = qperf_once(topo, pair, "tcp_lat", LAT_MSG, d.qperf_s, same)
            self.add(row("tcp.lat_same_core_us", "tcp", "qperf tcp_lat 8 B, both ends on one core (information)",
                         s.get("tcp_lat_us"), "us", same.text, na=s.get("error")))
        bw = qperf_once(topo, pair, "tcp_bw", BW_MSG, d.qperf_s, pl, cpu=True)
        self.add(row("tcp.bw_gbps", "tcp", "qperf tcp_bw 64 KiB", bw.get("tcp_bw_gbps"), "Gb/s",
                     pl.text + ("" if tso is not False else ", TSO off"), na=bw.get("error")))
        bpc = (bw["tcp_bw_gbps"] * 1e9 / 8 / bw["cpu_per_s"]) if bw.get("cpu_per_s") and bw.get("tcp_bw_gbps") \
            else None
        self.add(row("cpu.tcp.bytes_per_cpu_s", "cpu", "kernel TCP: bytes moved per CPU-second (tcp_bw)",
                     bpc and bpc / 1e9, "GB/CPU-s",
                     f"{bw['cpu_per_s']:.2f} CPU-s/s, qperf client+server" if bw.get("cpu_per_s") else None,
                     na=bw.get("error") or (None if bpc else "CPU sampling got too few samples")))
        self.point("throughput", "kernel TCP (qperf tcp_bw)", BW_MSG, bw.get("tcp_bw_gbps"), "Gb/s")
        self.point("latency", "kernel TCP (qperf tcp_lat)", LAT_MSG, lat.get("tcp_lat_us"), "us")
        for size in d.series_sizes:
            if size != BW_MSG:
                r = qperf_once(topo, pair, "tcp_bw", size, d.series_s, pl)
                self.point("throughput", "kernel TCP (qperf tcp_bw)", size, r.get("tcp_bw_gbps"), "Gb/s")
            if size != LAT_MSG:
                r = qperf_once(topo, pair, "tcp_lat", size, d.series_s, pl)
                self.point("latency", "kernel TCP (qperf tcp_lat)", size, r.get("tcp_lat_us"), "us")

    # ----- raw AF_XDP
    def raw(self, topo, pair, binary: Path) -> None:
        # 64 B and 1082 B frames fit a page: the fixture as BCC loads it, veth MTU 1500.
        # 4154 B frames (path MTU 4096) need veth MTU 4200, a frags-aware program and XDP_USE_SG.
        phases = ((False, MTU_FOR_PMTU[1024], (("64B", SMALL_FRAME, None), ("pmtu1024", frame_bytes(1024), 1024))),
                  (True, MTU_FOR_PMTU[4096], (("pmtu4096", frame_bytes(4096), 4096),)))
        for frags, mtu, cases in phases:
            try:
                set_mtu(topo, pair, mtu)
                prog = RedirectProgram(topo, pair.b, attach=False, frags=frags)
            except Exception as e:  # noqa: BLE001 - the other phase still counts
                for key, frame, pmtu in cases:
                    self._raw_rows(key, frame, pmtu, None, [], [], f"not available yet: {str(e)[:300]}")
                continue
            napi = NapiControl(topo, pair.b, self.threaded_napi)  # kthreads are per attachment
            try:
                prog.attach()
                for key, frame, pmtu in cases:
                    self.log(f"raw AF_XDP loop, {frame}-byte frames on veth MTU {mtu}: sweeping")
                    best, final, trials = sweep_rawloop(topo, pair, binary, prog, napi, frame, self.d, self.log)
                    self.raw_sweep[str(frame)] = trials
                    self._raw_rows(key, frame, pmtu, best, final, trials, None)
            finally:
                napi.restore()
                prog.close()  # MetaRoCE attaches its own program
                set_mtu(topo, pair, MTU_FOR_PMTU[1024])

    def _raw_rows(self, key, frame, pmtu, best, final, trials, why) -> None:
        # The figure: the best run of the winning configuration, in the sweep or repeated after
        # it -- load on the host only ever slows a run, and a baseline set too low inflates
        # every ratio.  The repetitions' median is printed beside it.
        fps = [t["rx_fps"] for t in trials if best is not None and t["label"] == best.label and t["rx_fps"]]
        reps = [r["rx"]["fps"] for r in final]
        top = max(fps) if fps else None
        cfg = None if not fps else (f"{best.label}; best of {len(fps)} runs of it, "
                                    f"{len(reps)} repeated after the sweep: "
                                    f"{', '.join(f'{f / 1e6:.3f}' for f in reps)} Mfps"
                                    + (f" (median {statistics.median(reps) / 1e6:.3f})" if reps else "")
                                    + f"; {len(trials) - len(final)} trials in the sweep")
        if why is None and not top:
            why = "every configuration failed: " + "; ".join({t["error"] for t in trials if t["error"]})[:300]
        self.add(row(f"raw.{key}.mfps", "raw", f"raw AF_XDP loop, {frame} B frames", top and top / 1e6,
                     "Mframes/s", cfg, na=why))
        if pmtu:
            self.add(row(f"raw.{key}.payload_gbps", "raw", f"raw AF_XDP goodput at path MTU {pmtu} "
                         f"(frames/s x {pmtu} B)", top and top * pmtu * 8 / 1e9, "Gb/s", "the same runs", na=why))
            if top:
                self.point("throughput", f"raw AF_XDP (PMTU {pmtu} frames)", BW_MSG, top * pmtu * 8 / 1e9, "Gb/s")

    # ----- MetaRoCE
    def metaroce(self, topo, pair, perf_ok: bool, popts: dict) -> None:
        d, pl = self.d, self.pl
        for plane in self.planes:
            p = f"metaroce.{plane}"
            name = f"MetaRoCE ({plane} plane)"
            plane_na = None
            extra: tuple[str, ...] = ()
            if not perf_ok:
                plane_na = "metaroce_xdp/cli/perf.py / `metaroce perf` not available"
            elif popts.get("plane"):
                extra = (popts["plane"], plane)        # named always
            else:
                plane_na = f"not available: `metaroce perf` has no --plane option (for the {plane} plane)"

            def perf(test, size, iters, pmtu=1024, more=(), cpu=False):
                """One `metaroce perf` run, tried a second time if the first fails (a loaded
                host can starve a side past its peer's ACK timeout); the row says so."""
                if plane_na:
                    raise BenchError(plane_na)
                first = None
                for attempt in (1, 2):
                    self.log(f"[{plane}] metaroce perf {test} -s {size} -n {iters} -m {pmtu} {' '.join(more)}"
                             + (" (second attempt)" if first else ""))
                    try:
                        r = run_metaroce(topo, pair, test, size, iters, pmtu, d.perf_timeout_s, pl,
                                         (*extra, *more), cpu=cpu)
                    except BenchError as e:
                        if first is not None:
                            raise BenchError(f"{e} (first attempt: {first[:200]})") from None
                        if not TRANSIENT.search(str(e)):
                            raise      # a refusal (no such option, unsupported MTU) stays one
                        first = str(e)
                        continue
                    r["config"] = pl.text + (f"; the first attempt failed: {first[-160:]}" if first else "")
                    return r

            def na_of(e: Exception) -> str:
                return str(e)[:400]

            # latency
            try:
                r = perf("write-lat", LAT_MSG, d.lat_iters)
                lat = r.get("lat_us", {})
                self.add(row(f"{p}.lat_p50_us", "metaroce", f"{name} WRITE 8 B latency, median", lat.get("typical"),
                             "us", r["config"]))
                self.add(row(f"{p}.lat_p99_us", "metaroce", f"{name} WRITE 8 B latency, p99", lat.get("p99"),
                             "us", r["config"]))
                self.point("latency", name, LAT_MSG, lat.get("typical"), "us")
            except Exception as e:  # noqa: BLE001 - one failed measurement must not lose the others
                for k, what in (("lat_p50_us", "median"), ("lat_p99_us", "p99")):
                    self.add(row(f"{p}.{k}", "metaroce", f"{name} WRITE 8 B latency, {what}", unit="us", na=na_of(e)))
            # message rate
            try:
                if not d.rate_iters:
                    raise BenchError("not measured by --quick (the same write-bw path as the 64 KiB row)")
                r = perf("write-bw", LAT_MSG, d.rate_iters)
                self.add(row(f"{p}.rate_8B_1qp_mmsgs", "metaroce", f"{name} WRITE 8 B message rate, 1 QP",
                             r.get("msg_rate"), "Mmsg/s", r["config"]))
                self.point("throughput", name, LAT_MSG, r.get("gbps"), "Gb/s")
            except Exception as e:  # noqa: BLE001
                self.add(row(f"{p}.rate_8B_1qp_mmsgs", "metaroce", f"{name} WRITE 8 B message rate, 1 QP",
                             unit="Mmsg/s", na=na_of(e)))
            self._multi_qp(p, name, perf, popts, plane_na, "rate_8B_16qp_mmsgs",
                           f"{name} WRITE 8 B message rate, 16 QPs", LAT_MSG, d.rate_iters, 16, False, "msg_rate",
                           "Mmsg/s")
            # bandwidth, one QP
            try:
                r = perf("write-bw", BW_MSG, d.bw_iters, cpu=True)
                self.add(row(f"{p}.bw_64K_1qp_pmtu1024_gbps", "metaroce", f"{name} WRITE 64 KiB, 1 QP, PMTU 1024",
                             r.get("gbps"), "Gb/s", r["config"]))
                self.point("throughput", name, BW_MSG, r.get("gbps"), "Gb/s")
                cps = r.get("cpu_per_s")
                self.add(row(f"cpu.{plane}.bytes_per_cpu_s", "cpu",
                             f"{name}: bytes moved per CPU-second (WRITE 64 KiB)",
                             cps and r["gbps"] * 1e9 / 8 / cps / 1e9, "GB/CPU-s",
                             cps and f"{cps:.2f} CPU-s/s, perf client+server",
                             na=None if cps else "CPU sampling got too few samples (test window too short)"))
            except Exception as e:  # noqa: BLE001
                self.add(row(f"{p}.bw_64K_1qp_pmtu1024_gbps", "metaroce", f"{name} WRITE 64 KiB, 1 QP, PMTU 1024",
                             unit="Gb/s", na=na_of(e)))
                self.add(row(f"cpu.{plane}.bytes_per_cpu_s", "cpu", f"{name}: bytes moved per CPU-second",
                             unit="GB/CPU-s", na=na_of(e)))
            self.add(self._pmtu4096(topo, pair, p, name, perf, plane_na))
            for nq in (4, 16):
                self._multi_qp(p, name, perf, popts, plane_na, f"bw_64K_{nq}qp_bidir_gbps",
                               f"{name} WRITE 64 KiB, {nq} QPs, both directions (aggregate)", BW_MSG, d.bw_iters,
                               nq, True, "gbps", "Gb/s")
            # the size series for the plots
            for size in d.series_sizes:
                if size not in (LAT_MSG, BW_MSG):
                    with contextlib.suppress(Exception):
                        self.point("throughput", name, size, perf("write-bw", size, max(200, d.bw_iters // 4))
                                   .get("gbps"), "Gb/s")
                if size != LAT_MSG:
                    with contextlib.suppress(Exception):
                        self.point("latency", name, size, perf("write-lat", size, max(200, d.lat_iters // 5))
                                   .get("lat_us", {}).get("typical"), "us")

    def _multi_qp(self, p, name, perf, popts, plane_na, key, label, size, iters, nq, bidir, field, unit) -> None:
        missing = [o for o, need in (("qps", True), ("bidir", bidir)) if need and not popts.get(o)]
        if plane_na or missing:
            why = plane_na or ("not available: `metaroce perf` (metaroce_xdp/cli/perf.py) has no option for "
                               + " or ".join({"qps": "several QPs (e.g. --qps N)",
                                              "bidir": "both directions at once (e.g. --bidirectional)"}[m]
                                             for m in missing))
            self.add(row(f"{p}.{key}", "metaroce", label, unit=unit, na=why))
            return
        if not self.d.full_sweep:          # --quick stays a smoke run: one QP only
            self.add(row(f"{p}.{key}", "metaroce", label, unit=unit, na="not measured by --quick (one QP only)"))
            return
        more = (popts["qps"], str(nq)) + ((popts["bidir"],) if bidir else ())
        try:
            r = perf("write-bw", size, iters, more=more)
            self.add(row(f"{p}.{key}", "metaroce", label, r.get(field), unit, r["config"]))
        except Exception as e:  # noqa: BLE001
            self.add(row(f"{p}.{key}", "metaroce", label, unit=unit, na=str(e)[:400]))

    def _pmtu4096(self, topo, pair, p, name, perf, plane_na) -> dict:
        rid, label = f"{p}.bw_64K_1qp_pmtu4096_gbps", f"{name} WRITE 64 KiB, 1 QP, PMTU 4096"
        if plane_na:
            return row(rid, "metaroce", label, unit="Gb/s", na=plane_na)
        if not self.d.full_sweep:
            return row(rid, "metaroce", label, unit="Gb/s", na="not measured by --quick (path MTU 1024 only)")
        set_mtu(topo, pair, MTU_FOR_PMTU[4096])
        try:
            r = perf("write-bw", BW_MSG, self.d.bw_iters, pmtu=4096)
            return row(rid, "metaroce", label, r.get("gbps"), "Gb/s", f"{r['config']}, veth MTU {MTU_FOR_PMTU[4096]}")
        except Exception as e:  # noqa: BLE001
            return row(rid, "metaroce", label, unit="Gb/s",
                       na=f"not available yet (veth MTU {MTU_FOR_PMTU[4096]}): {str(e)[-300:]}")
        finally:
            set_mtu(topo, pair, MTU_FOR_PMTU[1024])

    # ----- ratios
    def ratios(self) -> None:
        class _Rows(dict):  # a row an earlier step never produced reads as not measured
            def __missing__(self, rid):
                return row(rid, "", rid, na="not measured (an earlier step failed; see the log)")
        b = _Rows(self.byid)
        tcp_lat, raw64 = b["tcp.lat_us"], b["raw.64B.mfps"]
        for plane in self.planes:
            p, rp = f"metaroce.{plane}", f"ratio.{plane}"
            for stat in ("p50", "p99"):
                self.add(ratio_row(f"{rp}.lat_{stat}_over_tcp_lat", f"[{plane}] WRITE 8 B latency {stat} / TCP latency",
                                   b[f"{p}.lat_{stat}_us"], tcp_lat, TARGET_LAT, False))
            for nq in (1, 16):
                self.add(ratio_row(f"{rp}.rate_{nq}qp_over_raw64", f"[{plane}] 8 B WRITE rate, {nq} QP(s) / raw 64 B "
                                   "frame rate", b[f"{p}.rate_8B_{nq}qp_mmsgs"], raw64, TARGET_RATE, True))
            for pmtu in (1024, 4096):
                self.add(ratio_row(f"{rp}.bw_1qp_pmtu{pmtu}_over_raw", f"[{plane}] 64 KiB WRITE, 1 QP / raw goodput, "
                                   f"PMTU {pmtu}", b[f"{p}.bw_64K_1qp_pmtu{pmtu}_gbps"],
                                   b[f"raw.pmtu{pmtu}.payload_gbps"], TARGET_RATE, True))
            for nq in (4, 16):
                self.add(ratio_row(f"{rp}.bw_{nq}qp_bidir_over_raw", f"[{plane}] 64 KiB WRITE, {nq} QPs both ways / "
                                   "raw goodput, PMTU 1024", b[f"{p}.bw_64K_{nq}qp_bidir_gbps"],
                                   b["raw.pmtu1024.payload_gbps"], TARGET_RATE, True))
            self.add(ratio_row(f"{rp}.bw_over_tcp_bw", f"[{plane}] 64 KiB WRITE / TCP bw",
                               b[f"{p}.bw_64K_1qp_pmtu1024_gbps"], b["tcp.bw_gbps"], None, True))
            self.add(ratio_row(f"{rp}.cpu_over_tcp", f"[{plane}] bytes per CPU-second / kernel TCP's",
                               b[f"cpu.{plane}.bytes_per_cpu_s"], b["cpu.tcp.bytes_per_cpu_s"], None, True))


def run(d: Durations, planes: tuple[str, ...], placement: str, threaded_napi: bool, log) -> dict:
    from metaroce_xdp.topo import two_hosts

    binary = build_rawloop()
    perf_ok = metaroce_perf_available()
    popts = perf_options() if perf_ok else {k: None for k in PERF_OPTION_NAMES}
    pl = placement_for(placement)
    report = {"schema": SCHEMA, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "host": {"kernel": os.uname().release, "cpus": os.cpu_count(), "busy_before_pct": busy_pct(),
                       "load_avg": os.getloadavg()},
              "options": {"quick": not d.full_sweep, "planes": list(planes), "placement": placement,
                          "threaded_napi": threaded_napi, "durations": asdict(d)},
              "placement": {"a_cpu": pl.a_cpu, "b_cpu": pl.b_cpu, "text": pl.text},
              "perf_options": popts}
    b = Bench(d, planes, pl, threaded_napi, log)
    topo, pair = two_hosts(mtu=MTU_FOR_PMTU[1024], threaded_napi=threaded_napi, prefix="mrbench")
    with topo:
        b.qperf(topo, pair)          # first: no XDP program on the link yet, so TCP keeps TSO
        try:
            b.raw(topo, pair, binary)
        except Exception as e:  # noqa: BLE001 - e.g. BCC missing: the other columns still count
            log(f"raw AF_XDP loop failed: {e}")
            for rid in ("raw.64B.mfps", "raw.pmtu1024.mfps", "raw.pmtu1024.payload_gbps", "raw.pmtu4096.mfps",
                        "raw.pmtu4096.payload_gbps"):
                if rid not in b.byid:
                    b.add(row(rid, "raw", f"raw AF_XDP loop ({rid})", na=f"raw loop failed: {str(e)[:300]}"))
        b.metaroce(topo, pair, perf_ok, popts)
    from metaroce_xdp.daemon.bench import bench_rows     # the daemon's section: docs/daemon.md, "Numbers"
    for r in bench_rows(row, log, skip=None if d.full_sweep else "not in --quick: python -m "
                        "metaroce_xdp.daemon.bench --section"):
        b.add(r)
    b.ratios()
    report["host"]["load_avg_after"] = os.getloadavg()
    report.update(rows=b.rows, raw_sweep=b.raw_sweep, series=b.series, plots=[])
    return report


# --------------------------------------------------------------------------- output


def _value_text(r: dict) -> str:
    if r["value"] is None:
        return f"[yellow]{escape(r['not_available'] or '')}[/]"
    v, u = r["value"], r["unit"]
    txt = f"{v:.3f}" if u == "x" or abs(v) < 10 else f"{v:.1f}" if abs(v) < 1000 else f"{v:.0f}"
    txt = f"{txt} {u}" if u != "x" else f"{txt}x"
    if r.get("meets") is not None:
        txt += f"  [{'green' if r['meets'] else 'red'}]{'meets' if r['meets'] else 'misses'} {r['target']}[/]"
    return txt


def render(report: dict, console) -> None:
    from rich.table import Table

    t = Table(title="MetaRoCE bench: kernel TCP, the fastest raw AF_XDP loop, MetaRoCE -- one veth pair, one run",
              show_lines=False)
    t.add_column("measurement", overflow="fold")
    t.add_column("value", justify="right", overflow="fold")
    t.add_column("configuration", overflow="fold", style="dim")
    group = None
    for r in report["rows"]:
        if group is not None and r["group"] != group:
            t.add_section()
        group = r["group"]
        t.add_row(escape(r["label"]), _value_text(r), escape(r["config"] or ""))
    console.print(t)
    h = report["host"]
    notes = [f"placement: {report['placement']['text']} (MetaRoCE and qperf alike); threaded NAPI "
             f"{'on' if report['options']['threaded_napi'] else 'off'} for them",
             "raw goodput = received frames/s x path MTU (the payload bits MetaRoCE's WRITE bandwidth counts)",
             "qperf runs with no XDP program attached, so the veth keeps TSO; latencies are one-way",
             "bytes per CPU-second: psutil user+system time of both sides' processes over the middle of the "
             "test (softirq work in their context included; threaded-NAPI kthreads not)",
             f"host: {h['cpus']} CPUs, {h['busy_before_pct']:.0f}% busy before the run, load average "
             f"{', '.join(f'{x:.2f}' for x in h['load_avg'])} -- other load on the host disturbs every number"]
    if report.get("plots"):
        notes.append("plots: " + ", ".join(report["plots"]))
    for n in notes:
        console.print(f"[dim]{escape(n)}[/]")


def markdown(report: dict) -> str:
    """The table as Markdown (docs/bench/RESULTS.md beside the plots), with the run's context."""
    h, o = report["host"], report["options"]
    out = [f"# `make bench` results ({report['when']})", "",
           f"Host: {h['cpus']} CPUs, kernel {h['kernel']}, {h['busy_before_pct']:.0f}% busy before the run, load "
           f"average {', '.join(f'{x:.2f}' for x in h['load_avg'])} before and "
           f"{', '.join(f'{x:.2f}' for x in h.get('load_avg_after', ()))} after (other work on the host "
           "disturbs every figure). "
           f"Placement: {report['placement']['text']}, MetaRoCE and qperf alike; threaded NAPI "
           f"{'on' if o['threaded_napi'] else 'off'} for them. Planes: {', '.join(o['planes'])}."
           + (" Quick run." if o["quick"] else ""), "",
           "| measurement | value | configuration / why not |", "|---|---|---|"]
    for r in report["rows"]:
        if r["value"] is None:
            val, note = "n/a", r["not_available"]
        else:
            v = r["value"]
            val = (f"{v:.3f}x" if r["unit"] == "x" else f"{v:.3g} {r['unit']}")
            if r.get("meets") is not None:
                val += f" ({'meets' if r['meets'] else 'misses'} {r['target']})"
            note = r["config"] or ""
        out.append(f"| {r['label']} | {val} | {note.replace('|', '/')} |")
    return "\n".join(out) + "\n"


def plot(report: dict, out_dir: Path) -> list[str]:
    """throughput.png and latency.png against message size into out_dir (matplotlib, no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for kind, ylabel, fname in (("throughput", "throughput [Gb/s]", "throughput.png"),
                                ("latency", "one-way latency, median [us]", "latency.png")):
        pts = report["series"][kind]
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
        for who in dict.fromkeys(p["who"] for p in pts):
            xs = sorted((p["size"], p["value"]) for p in pts if p["who"] == who)
            if who.startswith("raw AF_XDP"):  # a ceiling, not a function of message size
                ax.axhline(xs[0][1], ls="--" if "1024" in who else ":", color="grey",
                           label=f"{who}: {xs[0][1]:.2f} Gb/s")
                continue
            ax.plot([x for x, _ in xs], [y for _, y in xs], marker="o", label=who)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size [bytes]")
        ax.set_ylabel(ylabel)
        ax.set_title(f"MetaRoCE bench: {kind} vs message size ({report['placement']['text']})", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path)
        plt.close(fig)
        paths.append(str(path))
    return paths


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE ('-': stdout, no table)")
    ap.add_argument("--quick", action="store_true", help="short durations, a two-configuration raw sweep, no size "
                    "series (smoke test)")
    ap.add_argument("--plane", choices=("compiled",), default="compiled",
                    help="MetaRoCE data plane to measure: compiled (metaroce_xdp.dp, the endpoint applications "
                         "get; the only one), passed to perf as --plane")
    ap.add_argument("--placement", choices=("split", "same", "unpinned"), default="split",
                    help="CPUs of host A's and B's processes, MetaRoCE and qperf alike (default split: A on the "
                         "first CPU, B on the second)")
    ap.add_argument("--threaded-napi", action="store_true",
                    help="veth NAPI in kthreads for the qperf and MetaRoCE runs (the raw sweep tries both)")
    ap.add_argument("--plots", metavar="DIR", help=f"write the PNG plots here (default: {PLOTS_DIR.relative_to(ROOT)} "
                    "for a full run, none for --quick)")
    ap.add_argument("--no-plots", action="store_true", help="write no plots")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench: needs root (network namespaces, XDP, AF_XDP)", file=sys.stderr)
        return 2
    from rich.console import Console

    d = QUICK if args.quick else FULL
    planes = (args.plane,)
    err = Console(stderr=True)
    log = (lambda m: err.print(f"[dim]{escape(m)}[/]")) if sys.stderr.isatty() or args.json != "-" \
        else (lambda m: None)

    main_pid = os.getpid()

    def _interrupt(signum, frame):  # SIGTERM: unwind like Ctrl-C so the topology is removed
        if os.getpid() != main_pid:
            # a forked helper (pyroute2 creates namespaces from one) must die as it would have
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        report = run(d, planes, args.placement, args.threaded_napi, log)
    except BenchError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench: interrupted; namespaces and processes removed", file=sys.stderr)
        return 130
    plots_dir = None if args.no_plots else Path(args.plots) if args.plots else None if args.quick else PLOTS_DIR
    if plots_dir is not None:
        try:
            report["plots"] = plot(report, plots_dir)
        except ImportError as e:
            print(f"bench: no plots ({e}); `make setup` installs matplotlib", file=sys.stderr)
        (plots_dir / "RESULTS.md").write_text(markdown(report))
    if args.json == "-":
        print(json.dumps(report, indent=2))
        return 0
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    render(report, Console(width=None if sys.stdout.isatty() else 160))
    return 0


if __name__ == "__main__":
    sys.exit(main())
