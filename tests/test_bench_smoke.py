"""`make bench` works: the raw AF_XDP loop moves frames between namespaces, and the bench
driver produces its JSON report.  Speed is never asserted -- only that the measurement works.

Players: A (afxdp_rawloop tx on its veth end) and B (bpf/xsk_redirect_test.c attached,
afxdp_rawloop rx on queue 0, its socket inserted into the XSKMAP through an inherited map fd).
The whole module stays under a minute: the full `--quick` run is bounded and skipped, not
failed, when the host is too slow or too busy to finish it in time.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.netns

if os.geteuid() != 0:
    pytest.skip("needs root: network namespaces, XDP and AF_XDP", allow_module_level=True)
pytest.importorskip("bcc")
if shutil.which("gcc") is None and shutil.which("cc") is None:
    pytest.skip("needs a C compiler for tools/afxdp_rawloop.c", allow_module_level=True)

from metaroce_xdp.topo import two_hosts  # noqa: E402
from tools import bench  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BENCH_BUDGET_S = 45  # the quick bench's share of the module's minute


def test_rawloop_moves_frames_between_namespaces(tmp_path):
    binary = bench.build_rawloop(tmp_path)
    frame = bench.frame_bytes(1024)
    assert frame == 1082  # Eth 14 + IPv4 20 + UDP 8 + BTH 12 + 1024 + ICRC 4
    topo, pair = two_hosts(mtu=1500, prefix="mrbsm")
    with topo:
        prog = bench.RedirectProgram(topo, pair.b)
        try:
            res = bench.run_rawloop(topo, pair, binary, prog, frame, 1.0, bench._cpus())
            redirected = prog.redirected()
        finally:
            prog.close()
        assert not topo.link_xdp_attached(pair.b.ns, pair.b.ifname)
    tx, rx = res["tx"], res["rx"]
    for r in (tx, rx):
        assert {"frames", "bytes", "seconds", "fps", "gbps"} <= r.keys()
        json.dumps(r)
    assert tx["mode"] == "tx" and rx["mode"] == "rx"
    assert tx["frames"] > 0 and tx["tx_invalid_descs"] == 0
    assert rx["frames"] > 0, rx
    assert rx["bytes"] == rx["frames"] * frame  # every frame whole, none truncated
    assert rx["seconds"] > 0 and rx["rx_invalid_descs"] == 0
    assert redirected >= rx["frames"]  # they came through the XSKMAP, not some other path


def test_rawloop_rejects_bad_arguments(tmp_path):
    binary = bench.build_rawloop(tmp_path)
    cp = subprocess.run([str(binary), "tx", "-i", "lo", "-s", "100"], capture_output=True, text=True)
    assert cp.returncode == 2 and "--src-mac" in cp.stderr
    cp = subprocess.run([str(binary), "fly"], capture_output=True, text=True)
    assert cp.returncode == 2 and "usage" in cp.stderr


def test_qperf_output_parses():
    text = "tcp_bw:\n    bw  =  1.23 GB/sec\ntcp_lat:\n    latency  =  4.5 us\n"
    assert bench.parse_qperf(text) == pytest.approx({"tcp_bw_gbps": 9.84, "tcp_lat_us": 4.5})
    assert bench.parse_qperf("latency = 2 ms") == {"tcp_lat_us": 2000.0}


def test_bench_quick_json_when_it_fits_the_budget():
    cmd = [sys.executable, "-m", "tools.bench", "--quick", "--json", "--case", "pmtu1024"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    t0 = time.monotonic()
    try:
        out, err = p.communicate(timeout=BENCH_BUDGET_S)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGINT)  # the bench removes its namespaces on the way out
        try:
            p.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
        pytest.skip(f"bench --quick did not finish within {BENCH_BUDGET_S}s on this host")
    assert p.returncode == 0, err[-2000:]
    report = json.loads(out)
    (case,) = report["cases"]
    assert case["case"] == "pmtu1024" and case["frame_bytes"] == 1082 and case["veth_mtu"] == 1500
    assert case["raw"]["rx"]["frames"] > 0, case["raw"]
    assert "tcp_bw_gbps" in case["qperf"] or "error" in case["qperf"] or not shutil.which("qperf")
    assert {"write_bw_over_raw_afxdp", "write_bw_over_tcp_bw", "write_lat_over_tcp_lat"} <= case["ratios"].keys()
    assert isinstance(case["metaroce"]["available"], bool)
    assert time.monotonic() - t0 < BENCH_BUDGET_S
