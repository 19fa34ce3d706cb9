"""`metaroce perf --plane compiled`: the benchmark tool on the compiled data plane, server and client as real
processes in two namespaces over a veth (short runs: this checks that the tool works and reports, not speed)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from metaroce_xdp.topo import two_hosts

pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces, XDP and AF_XDP")]

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "tools.metaroce_cli", "perf"]


@pytest.mark.parametrize("test,args", [("write-lat", ["-s", "8", "-n", "200"]),
                                       ("write-bw", ["-s", "65536", "-n", "200"]),
                                       ("read-bw", ["-s", "4096", "-n", "200"])])
def test_perf_runs_on_the_compiled_plane(test, args):
    topo, _ = two_hosts()
    try:
        srv = topo.popen(topo[1], [*CLI, test, "-d", "mr1", "--plane", "compiled", "--json", "-p", "18599"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(60):
            cli = topo.run(topo[0], [*CLI, test, "-d", "mr0", "--plane", "compiled", "--json", "-p", "18599",
                                     *args, "10.77.0.2"], timeout=120, check=False)
            if "start `metaroce perf" not in cli.stderr:
                break
            time.sleep(0.5)                       # the server is still starting
        out, err = srv.communicate(timeout=60)
        assert cli.returncode == 0, cli.stderr[-2000:]
        assert srv.returncode == 0, err[-2000:]
        r = json.loads(cli.stdout.strip().splitlines()[-1])
        assert r["plane"] == "compiled" and r["iterations"] == int(args[3]) and r["bytes"] == int(args[1])
        if test == "write-lat":
            assert 0 < r["lat_us"]["min"] <= r["lat_us"]["typical"] <= r["lat_us"]["max"]
        else:
            assert r["gbps"] > 0
    finally:
        topo.close()


def test_perf_several_qps_both_directions_on_the_compiled_plane():
    """--qps 4 --bidirectional: four QP pairs, both sides writing at once; each side checks that its
    receive area holds exactly what the other wrote, and the client reports both directions."""
    topo, _ = two_hosts()
    try:
        srv = topo.popen(topo[1], [*CLI, "write-bw", "-d", "mr1", "--plane", "compiled", "--json", "-p", "18598"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(60):
            cli = topo.run(topo[0], [*CLI, "write-bw", "-d", "mr0", "--plane", "compiled", "--json", "-p", "18598",
                                     "-s", "65536", "-n", "100", "--qps", "4", "--bidirectional", "10.77.0.2"],
                           timeout=120, check=False)
            if "start `metaroce perf" not in cli.stderr:
                break
            time.sleep(0.5)                       # the server is still starting
        out, err = srv.communicate(timeout=60)
        assert cli.returncode == 0, cli.stderr[-2000:]
        assert srv.returncode == 0, err[-2000:]
        r = json.loads(cli.stdout.strip().splitlines()[-1])
        s = json.loads(out.strip().splitlines()[-1])
        assert r["qps"] == 4 and r["bidirectional"] and r["iterations"] == 100
        assert r["verified"] is True and r["peer_verified"] is True and s["verified"] is True
        assert r["reverse"]["total_bytes"] == 4 * 100 * 65536 and r["total_bytes"] == 2 * 4 * 100 * 65536
        assert r["dp_stats"]["rx_bytes"] == 4 * 100 * 65536 == r["peer_dp_stats"]["rx_bytes"]
        assert r["gbps"] > 0
    finally:
        topo.close()
