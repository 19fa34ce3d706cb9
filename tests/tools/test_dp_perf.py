"""`metaroce perf --plane compiled`: the benchmark tool on the compiled data plane, server and client as real
processes in two namespaces over a veth (short runs: this checks that the tool works and reports, not speed)."""
from __future__ import annotations


import pytest

from metaroce_xdp.topo import two_hosts
from perf_players import PERF, perf_run

pytestmark = pytest.mark.netns


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


@pytest.mark.parametrize("profile", ["native", "compat"])
def test_perf_write_bw_with_sleeping_progress(profile):
    """`metaroce perf --progress sleep` on both sides (tools/bench_fabric's incast senders): idle, the client's
    bw loop sleeps in ppoll() -- woken by the SACKs the XDP program steers to its socket while it sleeps
    (MR-SACK-043), by its timers and pacing deadline (MR-CC-004) -- and the server's waits sleep in poll().
    The run completes with every byte where it belongs (both sides check the pattern) and the client's loop
    slept (its wakeups counted; --progress spin never sleeps).  A compat QP's bw loop keeps spinning (its
    ACKs never reach the socket to wake it), its waits for the peer sleep."""
    topo, _ = two_hosts()
    try:
        args = ["--plane", "compiled", "--profile", profile, "--progress", "sleep"]
        r, s = perf_run(topo, "write-bw", 18596, args, [*args, "-s", "65536", "-n", "300"])
        assert r["profile"] == s["profile"] == profile and r["iterations"] == 300 and r["gbps"] > 0
        assert r["peer_verified"] is True and s["verified"] is True       # the server's buffer: the client's pattern
        assert r["peer_dp_stats"]["rx_bytes"] == 300 * 65536
        assert r["dp_stats"].get("wakeups", 0) > 0, r["dp_stats"]
    finally:
        topo.close()


def test_perf_progress_mode_is_checked():
    """--progress accepts spin or sleep only, with one clear line."""
    topo, _ = two_hosts()
    try:
        cli = topo.run(topo[0], [*PERF, "write-bw", "-d", "mr0", "--progress", "nap", "10.77.0.2"], check=False)
        assert cli.returncode == 1 and "--progress nap: use one of spin, sleep" in cli.stderr
    finally:
        topo.close()
