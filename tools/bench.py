"""`make bench`: MetaRoCE against its two bars, on one veth pair, in one run.

For each frame-size case (path MTU 1024 on a 1500-byte veth; path MTU 2048 on the largest
veth MTU that still takes a non-frags XDP program) this measures, side by side:

  * qperf tcp_bw (64 KiB messages) and tcp_lat (8-byte messages): the kernel TCP bar,
    taken before any XDP program is attached (an XDP program on a veth turns off the
    peer's TSO, which would handicap TCP);
  * the raw AF_XDP loop (tools/afxdp_rawloop.c): frames of MetaRoCE's data-packet size
    moved through one AF_XDP socket in copy mode with no protocol work -- the substrate's
    limit;
  * MetaRoCE itself: `metaroce perf write-bw` (64 KiB RDMA WRITE) and `write-lat`
    (8-byte RDMA WRITE), when tools/perf.py exists.

and prints the ratios the performance targets are stated in:
    MetaRoCE WRITE bw / raw AF_XDP goodput at the same frame size   (target >= 0.5)
    MetaRoCE WRITE bw / qperf tcp_bw
    MetaRoCE 8-byte WRITE latency / qperf tcp_lat                  (target <= 0.5)

    python -m tools.bench                  # full run, table
    python -m tools.bench --quick --json   # short durations, one JSON document on stdout
    python -m tools.bench --threaded-napi  # veth receive half on the other core
    python -m tools.bench --case pmtu1024  # one case only

Neighbours: metaroce_xdp/topo.py (namespaces, veth, process cleanup), bpf/xsk_redirect_test.c
(steers UDP/4791 into the raw loop's socket), tools/perf.py (MetaRoCE's own perf tool, run
through tools.metaroce_cli), tests/test_bench_smoke.py.
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
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.markup import escape

ROOT = Path(__file__).resolve().parents[1]
RAWLOOP_SRC = ROOT / "tools" / "afxdp_rawloop.c"
BUILD_DIR = ROOT / "build"
REDIRECT_SRC = ROOT / "bpf" / "xsk_redirect_test.c"
ROCE_PORT = 4791

# Bytes a MetaRoCE data packet adds around its payload: Ethernet, IPv4, UDP, BTH, ICRC.
WIRE_OVERHEAD = 14 + 20 + 8 + 12 + 4
XDP_FLAGS_DRV_MODE = 1 << 2
BW_MSG = 65536
LAT_MSG = 8
TARGET_RAW_RATIO = 0.5
TARGET_LAT_RATIO = 0.5
PERF_PORT = 18515  # `metaroce perf` connection set-up (TCP), its default


def frame_bytes(pmtu: int) -> int:
    """Size of a full-payload RDMA WRITE Middle packet at this path MTU."""
    return pmtu + WIRE_OVERHEAD


@dataclass(frozen=True)
class Case:
    name: str
    pmtu: int
    veth_mtus: tuple[int, ...]  # tried in order until an XDP program attaches


# veth in native XDP mode takes a program without frags support only while the peer's MTU
# fits one page (about 3500 bytes), so 9000 is tried first and expected to fall back.
CASES = (
    Case("pmtu1024", 1024, (1500,)),
    Case("pmtu2048", 2048, (9000, 3500, 3000, 2200)),
)


@dataclass(frozen=True)
class Durations:
    qperf_s: float
    raw_s: float
    bw_iters: int
    lat_iters: int
    perf_timeout_s: float


FULL = Durations(qperf_s=5, raw_s=5, bw_iters=4000, lat_iters=2000, perf_timeout_s=180)
QUICK = Durations(qperf_s=1, raw_s=1, bw_iters=200, lat_iters=200, perf_timeout_s=40)


class BenchError(RuntimeError):
    """A measurement could not be taken; the message names the step."""


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
    tmp = out.with_suffix(".tmp")
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
        h = topo.ipr(ep.ns)
        h.link("set", index=ep.ifindex, mtu=mtu)


def tso_on(topo, ep) -> bool | None:
    cp = topo.run(ep.ns, ["ethtool", "-k", ep.ifname], check=False, timeout=10)
    m = re.search(r"^tcp-segmentation-offload:\s+(\w+)", cp.stdout, re.M)
    return None if m is None else m.group(1) == "on"


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


def _pinned(argv: list[str], cpu: int | None) -> list[str]:
    return argv if cpu is None else ["taskset", "-c", str(cpu), *argv]


def qperf_once(topo, pair, test: str, size: int, seconds: float, cpus=(None, None)) -> dict:
    """One qperf test A -> B with a fresh server; cpus = (server, client) or None for unpinned."""
    srv = topo.popen(pair.b.ns, _pinned(["qperf"], cpus[0]), stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    argv = _pinned(["qperf", pair.b.ipv4, "-t", str(max(1, round(seconds))), "-m", str(size), test], cpus[1])
    try:
        text = err = ""
        for _ in range(40):  # the server may still be starting: qperf then fails to connect
            cp = topo.run(pair.a.ns, argv, timeout=seconds + 30, check=False)
            text, err = cp.stdout, cp.stderr
            if cp.returncode == 0 and "=" in text:
                break
            time.sleep(0.1)
    finally:
        _stop(srv)
    parsed = parse_qperf(text)
    return parsed or {f"{test}_error": (text + err).strip()[-300:] or "no output"}


def run_qperf(topo, pair, seconds: float) -> dict:
    """tcp_bw (64 KiB messages, placement left to the scheduler) and tcp_lat (8-byte
    messages) with both ends on one core and with the ends on two cores.

    Placement matters more than anything else for latency here: on this VM a wakeup
    across cores costs tens of microseconds, on the same core a few."""
    if shutil.which("qperf") is None:
        return {"error": "qperf not installed"}
    res: dict = {"tso": tso_on(topo, pair.a)}
    res.update(qperf_once(topo, pair, "tcp_bw", BW_MSG, seconds))
    c0, c1 = _cpus()
    res.update(qperf_once(topo, pair, "tcp_lat", LAT_MSG, seconds, (c0, c0)))
    if c1 is not None:
        split = qperf_once(topo, pair, "tcp_lat", LAT_MSG, seconds, (c0, c1))
        if "tcp_lat_us" in split:
            res["tcp_lat_split_us"] = split["tcp_lat_us"]
    return res


# --------------------------------------------------------------------------- raw AF_XDP


class RedirectProgram:
    """bpf/xsk_redirect_test.c on B's veth end, through BCC: compiled once, attached in
    native mode only while the raw loop runs (detach() leaves it loaded for the next case)."""

    def __init__(self, topo, ep, attach: bool = True):
        import bcc  # system package (python3-bpfcc); imported late so --help works without it
        self.topo, self.ep, self.attached = topo, ep, False
        with topo.enter(ep.ns):
            self.bpf = bcc.BPF(src_file=str(REDIRECT_SRC).encode(),
                               cflags=[f"-DXSK_TEST_UDP_PORT={ROCE_PORT}"])
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


@contextlib.contextmanager
def _quiet_stderr(on: bool):
    """Silence fd 2 (C libraries write there directly) for the block."""
    if not on:
        yield
        return
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def attach_with_mtu(topo, pair, prog: RedirectProgram, mtus) -> tuple[int, list[str]]:
    """Set the veth MTU to the first of mtus with which the XDP program attaches (and
    leave it attached); also return why the larger ones were refused."""
    errors = []
    for i, mtu in enumerate(mtus):
        set_mtu(topo, pair, mtu)
        try:
            # libbcc prints its own attach error; refusals before the last are expected
            with _quiet_stderr(i < len(mtus) - 1):
                prog.attach()
            return mtu, errors
        except Exception as e:  # noqa: BLE001 - BCC raises plain Exception on attach
            errors.append(f"veth MTU {mtu}: {str(e).strip()[:120]}")
    raise BenchError("XDP program would not attach: " + "; ".join(errors))


def run_rawloop(topo, pair, binary: Path, prog: RedirectProgram, frame: int, seconds: float,
                cpus=(None, None), spin_us: float | None = None, batch: int | None = None) -> dict:
    """tx in A and rx in B for `seconds`; returns {'tx': {...}, 'rx': {...}}."""
    tx_cpu, rx_cpu = cpus
    rx_argv = [str(binary), "rx", "-i", pair.b.ifname, "-s", str(frame), "-t", str(seconds),
               "--idle", "5", "--xskmap-fd", str(prog.map_fd)]
    if rx_cpu is not None:
        rx_argv += ["-c", str(rx_cpu)]
    if spin_us is not None:
        rx_argv += ["--spin-us", str(spin_us)]
    rx = topo.popen(pair.b.ns, rx_argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    pass_fds=(prog.map_fd,))
    try:
        line = _readline(rx, 10)
        if line.strip() != "ready":
            out, err = _stop(rx)
            raise BenchError(f"raw rx did not start: {(line + out + err).strip()[-300:]}")
        tx_argv = [str(binary), "tx", "-i", pair.a.ifname, "-s", str(frame),
                   "-t", str(seconds + 1.0),  # outlasts rx's window, which opens at its first frame
                   "--src-mac", pair.a.mac, "--dst-mac", pair.b.mac,
                   "--src-ip", pair.a.ipv4, "--dst-ip", pair.b.ipv4]
        if tx_cpu is not None:
            tx_argv += ["-c", str(tx_cpu)]
        if batch is not None:
            tx_argv += ["-b", str(batch)]
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


# --------------------------------------------------------------------------- MetaRoCE


def metaroce_perf_available() -> bool:
    """tools/perf.py exists and the `metaroce` CLI has the `perf` command group."""
    if not (ROOT / "tools" / "perf.py").exists():
        return False
    try:
        from tools import metaroce_cli
    except Exception:  # noqa: BLE001 - a half-written tool is simply "not available"
        return False
    return any(g.name == "perf" for g in metaroce_cli.app.registered_groups)


def _listening(topo, ns: str, port: int) -> bool:
    cp = topo.run(ns, ["ss", "-Hltn", f"sport = :{port}"], check=False, timeout=10)
    return bool(cp.stdout.strip())


def run_metaroce(topo, pair, test: str, size: int, iters: int, pmtu: int, timeout: float) -> dict:
    """`metaroce perf <test>`: server in B, client in A; the client's JSON (server's as a spare)."""
    base = [sys.executable, "-m", "tools.metaroce_cli", "perf", test, "-s", str(size),
            "-n", str(iters), "-m", str(pmtu), "--json"]
    srv = topo.popen(pair.b.ns, [*base[:5], "-d", pair.b.ifname, *base[5:]], cwd=ROOT,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # The server imports numba and compiles its XDP program before it listens.
        deadline = time.monotonic() + min(60.0, timeout)
        while not _listening(topo, pair.b.ns, PERF_PORT):
            if srv.poll() is not None:
                out, err = srv.communicate()
                raise BenchError(f"perf {test} server exited ({srv.returncode}): {(err or out).strip()[-400:]}")
            if time.monotonic() > deadline:
                raise BenchError(f"perf {test} server not listening on TCP {PERF_PORT} after 60 s")
            time.sleep(0.2)
        cli = topo.run(pair.a.ns, [*base[:5], "-d", pair.a.ifname, *base[5:], pair.b.ipv4],
                       timeout=timeout, check=False)
        try:
            s_out, s_err = srv.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            s_out, s_err = _stop(srv)
    finally:
        if srv.poll() is None:
            _stop(srv)
    res = _last_json(cli.stdout) or _last_json(s_out)
    if res is None:
        raise BenchError(f"perf {test} client failed ({cli.returncode}): "
                         f"{(cli.stderr or s_err).strip()[-400:]}")
    return res


def latency_of(lat: dict) -> tuple[str, float] | None:
    """The typical latency from a lat_us dict, preferring the median."""
    if not isinstance(lat, dict):
        return None
    for key in ("p50", "median", "typical", "avg", "mean", "t_typical"):
        if isinstance(lat.get(key), (int, float)):
            return key, float(lat[key])
    return None


# --------------------------------------------------------------------------- one case


def _ratio(a, b):
    return a / b if a is not None and b else None


def run_case(topo, pair, prog: RedirectProgram, case: Case, d: Durations, binary: Path,
             perf_ok: bool, cpus, log) -> dict:
    res: dict = {"case": case.name, "pmtu": case.pmtu, "frame_bytes": frame_bytes(case.pmtu)}

    # 1. The MTU first: qperf must run on the same link the others use.  Probe which
    #    veth MTU takes the XDP program, then detach so TCP runs with TSO.
    log(f"[{case.name}] choosing veth MTU")
    try:
        mtu, refused = attach_with_mtu(topo, pair, prog, case.veth_mtus)
        prog.detach()
    except BenchError as e:
        res["error"] = str(e)
        return res
    res["veth_mtu"] = mtu
    if refused:
        res["veth_mtu_refused"] = refused

    # 2. qperf, no XDP program on the link
    log(f"[{case.name}] qperf on veth MTU {mtu}")
    try:
        res["qperf"] = run_qperf(topo, pair, d.qperf_s)
    except Exception as e:  # noqa: BLE001 - one missing baseline must not lose the others
        res["qperf"] = {"error": str(e)}

    # 3. raw AF_XDP
    log(f"[{case.name}] raw AF_XDP loop, {frame_bytes(case.pmtu)}-byte frames")
    try:
        before = prog.redirected()
        prog.attach()
        raw = run_rawloop(topo, pair, binary, prog, frame_bytes(case.pmtu), d.raw_s, cpus)
        raw["redirected"] = prog.redirected() - before
        raw["payload_gbps"] = raw["rx"]["fps"] * case.pmtu * 8 / 1e9
        raw["rx_over_tx"] = _ratio(raw["rx"]["fps"], raw["tx"]["fps"])
        res["raw"] = raw
    except Exception as e:  # noqa: BLE001
        res["raw"] = {"error": str(e)}
    finally:
        prog.detach()  # MetaRoCE attaches its own program

    # 4. MetaRoCE
    mr: dict = {"available": perf_ok}
    if perf_ok:
        for key, test, size, iters in (("write_bw", "write-bw", BW_MSG, d.bw_iters),
                                       ("write_lat", "write-lat", LAT_MSG, d.lat_iters)):
            log(f"[{case.name}] metaroce perf {test} -s {size} -n {iters} -m {case.pmtu}")
            try:
                mr[key] = run_metaroce(topo, pair, test, size, iters, case.pmtu, d.perf_timeout_s)
            except Exception as e:  # noqa: BLE001
                mr[key] = {"error": str(e)}
    res["metaroce"] = mr

    # 5. ratios
    q = res.get("qperf", {})
    raw_payload = res.get("raw", {}).get("payload_gbps")
    mr_bw = mr.get("write_bw", {}).get("gbps")
    lat = latency_of(mr.get("write_lat", {}).get("lat_us"))
    res["ratios"] = {
        "write_bw_over_raw_afxdp": _ratio(mr_bw, raw_payload),
        "write_bw_over_tcp_bw": _ratio(mr_bw, q.get("tcp_bw_gbps")),
        "write_lat_over_tcp_lat": _ratio(lat[1] if lat else None, q.get("tcp_lat_us")),
        "write_lat_over_tcp_lat_split": _ratio(lat[1] if lat else None, q.get("tcp_lat_split_us")),
        "write_lat_stat": lat[0] if lat else None,
    }
    return res


# --------------------------------------------------------------------------- output


def _fmt(v, spec=".2f", unit=""):
    return "-" if v is None else f"{v:{spec}}{unit}"


def _verdict(r, target, higher_better):
    if r is None:
        return ""
    ok = r >= target if higher_better else r <= target
    return "[green]meets[/]" if ok else "[red]below[/]" if higher_better else "[red]above[/]"


def _raw_cells(raw: dict) -> tuple[str, str, str]:
    if not raw:
        return "-", "-", "-"
    if "error" in raw:
        e = f"[red]{escape(raw['error'][:80])}[/]"
        return e, e, e
    tx, rx = raw["tx"], raw["rx"]
    return (f"{tx['fps'] / 1e6:.3f} Mfps  {tx['gbps']:.2f} Gb/s",
            f"{rx['fps'] / 1e6:.3f} Mfps  {rx['gbps']:.2f} Gb/s",
            f"{raw['payload_gbps']:.2f} Gb/s")


def _mr_cells(mr: dict) -> tuple[str, str]:
    if not mr.get("available"):
        return "not available", "not available"
    bw, lat = mr.get("write_bw", {}), mr.get("write_lat", {})
    if "error" in bw:
        bw_s = f"[red]{escape(bw['error'][:80])}[/]"
    else:
        rate = bw.get("msg_rate")  # Mmsg/s, perftest's MsgRate[Mpps]
        bw_s = f"{_fmt(bw.get('gbps'), unit=' Gb/s')}  {_fmt(rate and rate * 1e3, '.1f', ' Kmsg/s')}"
    if "error" in lat:
        lat_s = f"[red]{escape(lat['error'][:80])}[/]"
    else:
        tl = latency_of(lat.get("lat_us"))
        lat_s = f"{tl[1]:.1f} us ({tl[0]})" if tl else "-"
    return bw_s, lat_s


def render(report: dict, console) -> None:
    """One column per case, one row per measurement, then the ratios against the targets."""
    from rich.table import Table

    cases = report["cases"]
    t = Table(title="MetaRoCE bench: baselines and MetaRoCE on one veth pair")
    t.add_column("measurement")
    for c in cases:
        t.add_column(f"{c['case']} ({c['frame_bytes']} B frames)", justify="right")
    rows: dict[str, list[str]] = {k: [] for k in (
        "veth MTU", "qperf tcp_bw (64 KiB)", "qperf tcp_lat (8 B), 1 core", "qperf tcp_lat (8 B), 2 cores",
        "raw AF_XDP tx", "raw AF_XDP rx", "raw AF_XDP rx goodput", "MetaRoCE WRITE bw (64 KiB)",
        "MetaRoCE WRITE lat (8 B)")}
    ratio_rows: dict[str, list[str]] = {k: [] for k in (
        f"WRITE bw / raw AF_XDP goodput (target >= {TARGET_RAW_RATIO})", "WRITE bw / TCP bw",
        f"WRITE lat / TCP lat, 1 core (target <= {TARGET_LAT_RATIO})", "WRITE lat / TCP lat, 2 cores")}
    for c in cases:
        q, ra = c.get("qperf", {}), c.get("ratios", {})
        cells = [str(c.get("veth_mtu", c.get("error", "-"))),
                 _fmt(q.get("tcp_bw_gbps"), unit=" Gb/s") + ("" if q.get("tso", True) else " (TSO off)"),
                 _fmt(q.get("tcp_lat_us"), ".1f", " us"), _fmt(q.get("tcp_lat_split_us"), ".1f", " us"),
                 *_raw_cells(c.get("raw", {})), *_mr_cells(c.get("metaroce", {}))]
        for k, v in zip(rows, cells):
            rows[k].append(v)
        vals = (ra.get("write_bw_over_raw_afxdp"), ra.get("write_bw_over_tcp_bw"),
                ra.get("write_lat_over_tcp_lat"), ra.get("write_lat_over_tcp_lat_split"))
        checks = ((TARGET_RAW_RATIO, True), None, (TARGET_LAT_RATIO, False), (TARGET_LAT_RATIO, False))
        for k, v, chk in zip(ratio_rows, vals, checks):
            ratio_rows[k].append(f"{_fmt(v, '.3f')} {_verdict(v, *chk) if chk else ''}".strip())
    for k, v in rows.items():
        t.add_row(k, *v)
    t.add_section()
    for k, v in ratio_rows.items():
        t.add_row(k, *v)
    console.print(t)
    notes = ["raw goodput = received frames/s x path MTU (payload bits), the quantity MetaRoCE's "
             "WRITE bandwidth counts; raw Gb/s counts whole Ethernet frames.",
             "qperf tcp_lat is one-way (half a round trip), client and server pinned to one core "
             "and to two cores; qperf runs with no XDP program attached, so the peer keeps TSO.",
             f"threaded NAPI: {'on' if report['threaded_napi'] else 'off'}; raw tx pinned to CPU "
             f"{report['pin_cpus']['tx']}, rx to CPU {report['pin_cpus']['rx']}."]
    busy = report["host"].get("busy_before_pct")
    if busy is not None and busy > 10:
        notes.insert(0, f"[yellow]the host was {busy:.0f}% busy before the run: numbers are "
                        f"disturbed by other load[/]")
    if not any(c.get("metaroce", {}).get("available") for c in cases):
        notes.insert(0, "MetaRoCE: perf tool not available (tools/perf.py / `metaroce perf`)")
    for n in notes:
        console.print(f"[dim]{n}[/]")


# --------------------------------------------------------------------------- main


def run(cases, d: Durations, threaded_napi: bool, log) -> dict:
    from metaroce_xdp.topo import two_hosts

    binary = build_rawloop()
    perf_ok = metaroce_perf_available()
    if not perf_ok:
        log("MetaRoCE: perf tool not available")
    cpus = _cpus()
    report = {"host": {"kernel": os.uname().release, "cpus": os.cpu_count(),
                       "busy_before_pct": busy_pct()},
              "threaded_napi": threaded_napi, "durations": d.__dict__, "rawloop": str(binary),
              "pin_cpus": {"tx": cpus[0], "rx": cpus[1]}, "cases": []}
    topo, pair = two_hosts(mtu=1500, threaded_napi=threaded_napi, prefix="mrbench")
    with topo:
        prog = RedirectProgram(topo, pair.b, attach=False)
        try:
            for case in cases:
                report["cases"].append(run_case(topo, pair, prog, case, d, binary, perf_ok, cpus, log))
        finally:
            prog.close()
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON document (everything measured)")
    ap.add_argument("--quick", action="store_true", help="short durations (smoke test)")
    ap.add_argument("--threaded-napi", action="store_true",
                    help="veth NAPI in a kthread: the receive half runs on the other core")
    ap.add_argument("--case", action="append", choices=[c.name for c in CASES],
                    help="run only this case (repeatable)")
    ap.add_argument("--seconds", type=float, help="override qperf and raw-loop durations")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench: needs root (network namespaces, XDP, AF_XDP)", file=sys.stderr)
        return 2
    from rich.console import Console

    d = QUICK if args.quick else FULL
    if args.seconds:
        d = Durations(args.seconds, args.seconds, d.bw_iters, d.lat_iters, d.perf_timeout_s)
    err = Console(stderr=True)
    log = (lambda m: err.print(f"[dim]{escape(m)}[/]")) if not args.json or sys.stderr.isatty() else (lambda m: None)
    cases = [c for c in CASES if not args.case or c.name in args.case]

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
        report = run(cases, d, args.threaded_napi, log)
    except BenchError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench: interrupted; namespaces and processes removed", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        render(report, Console())
    return 0


if __name__ == "__main__":
    sys.exit(main())
