"""1,000 connected QPs on one metaroced, all carrying traffic at once (issue 8's scale item).

Two real daemons (one per namespace, real XDP program and AF_XDP socket), four real client processes
per daemon (tests/daemon_players.py, the client library only) with 250 QPs each: every QP of client i
on A is connected to the QP of the same index of client i on B.  Then every one of the 2,000 QPs
posts a 1 KiB WRITE (one packet) before any completion is polled, twice (ACK timeout 1 s: see scale_run).  Every completion must be SUCCESS, every
destination range must hold exactly its source's bytes (sha256), and every QP must still be in RTS.
The memory per QP (daemon RSS growth / QPs, ring and data-plane bytes) is printed; `make bench`
reports it (metaroce_xdp.daemon.bench.scale_run, which this test runs).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest

from metaroce_xdp.daemon import bench
from metaroce_xdp.topo import two_hosts

pytestmark = pytest.mark.netns


def test_1000_qps_on_one_daemon_all_carrying_traffic_at_once():
    topo, _pair = two_hosts()
    tmp = tempfile.mkdtemp(prefix="mrscale-")
    os.mkdir(os.path.join(tmp, "bpf"))
    try:
        r = bench.scale_run(topo, tmp, nqps=1000, clients=4, size=1024, rounds=2)
    finally:
        topo.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(r))
    assert r["qps_per_daemon"] == 1000 and r["rts"] == 2000, r
    assert r["statuses"] == {"SUCCESS": r["writes"]} and r["writes"] == 4000, r
    assert r["intact_pairs"] == r["pairs"] == 8, r
    assert r["states"].get("RTS") == 2000 and r["states"].get("ERR", 0) == 0, r      # + the 8 unconnected setup QPs
    assert all(b > 0 for b in r["rss_per_qp_bytes"]), r


def test_demo_runs_through_daemons():
    """`python -m tools.demo --daemon`: a metaroced in each host's namespace, the demo's hosts are their clients;
    WRITE, READ and SEND arrive intact, the summary comes from the daemons, and nothing is left running."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-m", "tools.demo", "--daemon", "--size-mib", "4", "--no-faults"], cwd=root,
                       capture_output=True, text=True, timeout=240, env=dict(os.environ, COLUMNS="160"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "engine: metaroced in each host's namespace" in r.stdout
    assert "summary (through metaroced: pids" in r.stdout
    assert "clean link: WRITE intact  READ intact  SEND intact" in r.stdout
    assert "integrity verified" in r.stdout
