"""`metaroce perf --plane compiled`: the benchmark tool on the compiled data plane, server and client as real
processes in two namespaces over a veth (short runs: this checks that the tool works and reports, not speed)."""
from __future__ import annotations

import os

import pytest

from metaroce_xdp.topo import two_hosts
from perf_players import perf_run

pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces, XDP and AF_XDP")]


@pytest.mark.parametrize("test,args", [("write-lat", ["-s", "8", "-n", "200"]),
                                       ("write-bw", ["-s", "65536", "-n", "200"]),
                                       ("read-bw", ["-s", "4096", "-n", "200"])])
def test_perf_runs_on_the_compiled_plane(test, args):
    topo, _ = two_hosts()
    try:
        r, _ = perf_run(topo, test, 18599, ["--plane", "compiled"], ["--plane", "compiled", *args])
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
        r, s = perf_run(topo, "write-bw", 18598, ["--plane", "compiled"],
                        ["--plane", "compiled", "-s", "65536", "-n", "100", "--qps", "4", "--bidirectional"])
        assert r["qps"] == 4 and r["bidirectional"] and r["iterations"] == 100
        assert r["verified"] is True and r["peer_verified"] is True and s["verified"] is True
        assert r["reverse"]["total_bytes"] == 4 * 100 * 65536 and r["total_bytes"] == 2 * 4 * 100 * 65536
        assert r["dp_stats"]["rx_bytes"] == 4 * 100 * 65536 == r["peer_dp_stats"]["rx_bytes"]
        assert r["gbps"] > 0
    finally:
        topo.close()
