"""`make bench` works: the raw AF_XDP loop moves frames between namespaces in the
configurations its sweep tries, and `python -m tools.bench --quick` writes a report that keeps
its JSON schema, in which every row carries a number or an explicit "not available: why".
Speed is never asserted -- only that each measurement is taken and reported.

Players: A (afxdp_rawloop tx on its veth end) and B (bpf/xsk_redirect_test.c attached,
afxdp_rawloop rx on queue 0, its socket inserted into the XSKMAP through an inherited map fd);
for the quick run, tools.bench itself with qperf and `metaroce perf` in two namespaces.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.netns

pytest.importorskip("bcc")
if shutil.which("gcc") is None and shutil.which("cc") is None:
    pytest.skip("needs a C compiler for tools/afxdp_rawloop.c", allow_module_level=True)

from metaroce_xdp.topo import two_hosts  # noqa: E402
from tools import bench  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
QUICK_LIMIT_S = 400  # about 2.5 minutes on this 2-CPU host under other tests' load (4 perf runs)
ROW_KEYS = {"id", "group", "label", "value", "unit", "config", "not_available", "target", "meets"}
REQUIRED_ROWS = (
    "tcp.lat_us", "tcp.bw_gbps", "cpu.tcp.bytes_per_cpu_s",
    "raw.64B.mfps", "raw.pmtu1024.mfps", "raw.pmtu1024.payload_gbps", "raw.pmtu4096.mfps",
    *(f"metaroce.{p}.{k}" for p in bench.PLANES for k in (
        "lat_p50_us", "lat_p99_us", "rate_8B_1qp_mmsgs", "rate_8B_16qp_mmsgs", "bw_64K_1qp_pmtu1024_gbps",
        "bw_64K_1qp_pmtu4096_gbps", "bw_64K_4qp_bidir_gbps", "bw_64K_16qp_bidir_gbps")),
    *(f"cpu.{p}.bytes_per_cpu_s" for p in bench.PLANES),
    *(f"ratio.{p}.{k}" for p in bench.PLANES for k in (
        "lat_p50_over_tcp_lat", "lat_p99_over_tcp_lat", "rate_1qp_over_raw64", "rate_16qp_over_raw64",
        "bw_1qp_pmtu1024_over_raw", "bw_1qp_pmtu4096_over_raw", "bw_4qp_bidir_over_raw", "bw_16qp_bidir_over_raw",
        "cpu_over_tcp")),
)


def test_rawloop_moves_frames_in_every_wakeup_mode(tmp_path):
    """The default loop and the sweep's other wake-up policies (no need_wakeup, spinning rx,
    busy-polling rx with threaded NAPI pinned) all deliver whole frames through the XSKMAP."""
    binary = bench.build_rawloop(tmp_path)
    frame = bench.frame_bytes(1024)
    assert frame == 1082  # Eth 14 + IPv4 20 + UDP 8 + BTH 12 + 1024 + ICRC 4
    c0, c1 = bench._cpus()
    configs = (bench.RawConfig(c0, c1),
               bench.RawConfig(c0, c0, True, c1, batch=32, budget=128, need_wakeup=False, wait="spin"),
               bench.RawConfig(None, None, True, None, wait="busy-poll"))
    topo, pair = two_hosts(mtu=1500, prefix="mrbsm")
    with topo:
        prog = bench.RedirectProgram(topo, pair.b)
        napi = bench.NapiControl(topo, pair.b, False)
        try:
            runs = []
            for cfg in configs:
                napi.set(cfg.napi_threaded, cfg.napi_cpu)
                if cfg.napi_threaded:
                    assert napi.kthreads, "threaded NAPI on but no napi/<if> kthread appeared"
                before = prog.redirected()
                runs.append((cfg, bench.run_rawloop(topo, pair, binary, prog, frame, 0.5, cfg),
                             prog.redirected() - before))
            napi.restore()
            threaded = topo.run(pair.b.ns, ["cat", f"/sys/class/net/{pair.b.ifname}/threaded"]).stdout.strip()
        finally:
            prog.close()
        assert not topo.link_xdp_attached(pair.b.ns, pair.b.ifname)
    assert threaded == "0"
    for cfg, res, redirected in runs:
        tx, rx = res["tx"], res["rx"]
        for r in (tx, rx):
            assert {"frames", "bytes", "seconds", "fps", "gbps", "cpu_s"} <= r.keys(), cfg.label
            json.dumps(r)
        assert tx["mode"] == "tx" and rx["mode"] == "rx"
        assert tx["frames"] > 0 and tx["tx_invalid_descs"] == 0, (cfg.label, tx)
        assert rx["frames"] > 0, (cfg.label, rx)
        assert rx["bytes"] == rx["frames"] * frame, cfg.label  # every frame whole, none truncated
        assert rx["seconds"] > 0 and rx["rx_invalid_descs"] == 0, cfg.label
        assert redirected >= rx["frames"], cfg.label  # through the XSKMAP, not some other path
        if cfg.wait == "busy-poll":
            assert rx["busy_polls"] > 0, rx


def test_rawloop_sg_frames_through_a_frags_aware_program(tmp_path):
    """Path MTU 4096: a 4154-byte frame is two descriptors (XDP_USE_SG) on both sockets, the
    redirect program is loaded with BPF_F_XDP_HAS_FRAGS so veth takes it at MTU 4200."""
    binary = bench.build_rawloop(tmp_path)
    frame = bench.frame_bytes(4096)
    topo, pair = two_hosts(mtu=bench.MTU_FOR_PMTU[4096], prefix="mrbsg")
    with topo:
        prog = bench.RedirectProgram(topo, pair.b, frags=True)
        try:
            res = bench.run_rawloop(topo, pair, binary, prog, frame, 0.5, bench.RawConfig(*bench._cpus()))
            redirected = prog.redirected()
        finally:
            prog.close()
    rx = res["rx"]
    assert rx["frames"] > 0 and res["tx"]["frames"] > 0, res
    assert rx["descs"] == 2 * rx["frames"]  # 4096 + 58 bytes
    assert rx["bytes"] == rx["frames"] * frame and rx["rx_invalid_descs"] == 0
    assert res["tx"]["tx_invalid_descs"] == 0
    assert redirected >= rx["frames"]


def test_rawloop_rejects_bad_arguments(tmp_path):
    binary = bench.build_rawloop(tmp_path)
    cp = subprocess.run([str(binary), "tx", "-i", "lo", "-s", "100"], capture_output=True, text=True)
    assert cp.returncode == 2 and "--src-mac" in cp.stderr
    cp = subprocess.run([str(binary), "rx", "-i", "lo", "--wait", "nap"], capture_output=True, text=True)
    assert cp.returncode == 2 and "--wait must be" in cp.stderr
    cp = subprocess.run([str(binary), "fly"], capture_output=True, text=True)
    assert cp.returncode == 2 and "usage" in cp.stderr


def test_qperf_output_parses():
    text = "tcp_bw:\n    bw  =  1.23 GB/sec\ntcp_lat:\n    latency  =  4.5 us\n"
    assert bench.parse_qperf(text) == pytest.approx({"tcp_bw_gbps": 9.84, "tcp_lat_us": 4.5})
    assert bench.parse_qperf("latency = 2 ms") == {"tcp_lat_us": 2000.0}


def test_rows_carry_a_number_or_a_reason():
    assert bench.row("x", "tcp", "x", 3, "us")["not_available"] is None
    assert bench.row("x", "tcp", "x")["not_available"] == "not measured"
    num, den = bench.row("n", "metaroce", "n", 2.0, "us"), bench.row("d", "tcp", "d", 8.0, "us")
    r = bench.ratio_row("r", "r", num, den, 0.5, higher_better=False)
    assert r["value"] == 0.25 and r["meets"] is True and r["target"] == "<= 0.5"
    r = bench.ratio_row("r", "r", bench.row("n", "metaroce", "n", na="not available: no --qps"), den, 0.8, True)
    assert r["value"] is None and r["not_available"] == "not available: no n" and r["meets"] is None


@pytest.mark.timeout(QUICK_LIMIT_S + 60)
def test_bench_quick_report_schema(tmp_path):
    """The whole pipeline, short: table, JSON file, plots; the compiled plane's rows are measured when
    perf has --plane and say why not when it has not."""
    out, plots = tmp_path / "bench.json", tmp_path / "plots"
    cmd = [sys.executable, "-m", "tools.bench", "--quick", "--json", str(out),
           "--plots", str(plots)]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=QUICK_LIMIT_S)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGINT)  # the bench removes its namespaces on the way out
        try:
            p.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
        pytest.fail(f"bench --quick did not finish within {QUICK_LIMIT_S}s")
    assert p.returncode == 0, stderr[-2000:]
    assert "raw AF_XDP loop" in stdout and "placement" in stdout  # the table was printed
    report = json.loads(out.read_text())
    assert report["schema"] == bench.SCHEMA
    assert {"host", "options", "placement", "rows", "raw_sweep", "series", "perf_options", "plots"} <= report.keys()
    assert report["options"]["planes"] == list(bench.PLANES)
    rows = {r["id"]: r for r in report["rows"]}
    assert len(rows) == len(report["rows"]), "row ids are unique"
    for r in report["rows"]:
        assert set(r) == ROW_KEYS, r
        assert (r["value"] is None) != (r["not_available"] is None), r  # a number xor a reason
        assert r["value"] is not None or r["not_available"].strip(), r
    missing = [k for k in REQUIRED_ROWS if k not in rows]
    assert not missing, missing
    # the measurements this host can always take carry numbers
    for k in ("raw.64B.mfps", "raw.pmtu1024.mfps", "metaroce.compiled.lat_p50_us",
              "metaroce.compiled.bw_64K_1qp_pmtu1024_gbps", "ratio.compiled.bw_1qp_pmtu1024_over_raw"):
        assert rows[k]["value"] is not None and rows[k]["value"] > 0, rows[k]
    if shutil.which("qperf"):
        assert rows["tcp.lat_us"]["value"] > 0 and rows["tcp.bw_gbps"]["value"] > 0
    assert rows["raw.pmtu1024.mfps"]["config"], "the winning configuration is printed beside the figure"
    if not report["perf_options"]["plane"]:
        assert "--plane" in rows["metaroce.compiled.lat_p50_us"]["not_available"]
    for frame in ("64", "1082"):
        trials = report["raw_sweep"][frame]
        assert len({t["label"] for t in trials}) >= 2 and any(t["stage"] == "final" for t in trials)
    assert {"throughput", "latency"} <= report["series"].keys()
    assert sorted(Path(x).name for x in report["plots"]) == ["latency.png", "throughput.png"]
    for x in report["plots"]:
        assert Path(x).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (plots / "RESULTS.md").read_text()
    assert md.count("\n| ") == len(report["rows"]) + 1  # header and one line a row
