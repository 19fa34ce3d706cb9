"""Recovery from RX-ring overflow on the compiled data plane: `metaroce perf write-bw --bidirectional` with 16
QP pairs and no port in-flight cap (METAROCE_PORT_INFLIGHT=0), so each side has up to 16 x 1024 packets in
flight towards a peer whose RX and fill rings hold 2048 frames.  Overflow is certain (no PFC on veth), every
QP loses packets and recovers by local ACK timeouts.  Before, a timed-out QP resent its whole window at
once, on top of the other QPs' resends: the ring overflowed again and the packet at comp_psn could be lost
at every retry until RETRY_EXC_ERR (seen under CPU load with the cap on, and here without it).  Now a
timeout reopens the window from one packet (dp/loop.py timers/advance).  Not a timed test: it checks the
outcome (verified data, no error) and that the overflow really happened."""
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
CLI = ["env", "METAROCE_PORT_INFLIGHT=0", sys.executable, "-m", "tools.metaroce_cli", "perf"]


def test_bidirectional_many_qps_recover_from_rx_ring_overflow():
    topo, _ = two_hosts()
    try:
        srv = topo.popen(topo[1], [*CLI, "write-bw", "-d", "mr1", "--plane", "compiled", "--json", "-p", "18597"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(60):
            cli = topo.run(topo[0], [*CLI, "write-bw", "-d", "mr0", "--plane", "compiled", "--json", "-p", "18597",
                                     "-s", "65536", "-n", "300", "--qps", "16", "--bidirectional", "10.77.0.2"],
                           timeout=180, check=False)
            if "start `metaroce perf" not in cli.stderr:
                break
            time.sleep(0.5)                       # the server is still starting
        out, err = srv.communicate(timeout=60)
        assert cli.returncode == 0, cli.stderr[-2000:]
        assert srv.returncode == 0, err[-2000:]
        r = json.loads(cli.stdout.strip().splitlines()[-1])
        s = json.loads(out.strip().splitlines()[-1])
        assert r["verified"] is True and r["peer_verified"] is True and s["verified"] is True
        assert r["total_bytes"] == 2 * 16 * 300 * 65536
        both = (r["dp_stats"], r["peer_dp_stats"])
        # the condition was there: frames dropped at an RX ring and QPs recovering by timeouts
        assert sum(d.get("xsk_rx_dropped", 0) for d in both) > 0
        assert sum(d.get("timeouts", 0) for d in both) > 0
    finally:
        topo.close()
