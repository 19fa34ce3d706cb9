"""Recovery from RX-ring overflow on the compiled data plane: `metaroce perf write-bw --bidirectional` with 16
QP pairs and no port in-flight cap (METAROCE_PORT_INFLIGHT=0), so each side has up to 16 x 1024 packets in
flight towards a peer whose RX and fill rings hold 2048 frames.  Overflow is certain (no PFC on veth), every
QP loses packets and recovers by local ACK timeouts.  Before, a timed-out QP resent its whole window at
once, on top of the other QPs' resends: the ring overflowed again and the packet at comp_psn could be lost
at every retry until RETRY_EXC_ERR (seen under CPU load with the cap on, and here without it).  Now a
timeout reopens the window from TO_WIN_START packets (dp/round.py timers/advance, MR-RETRY-016).  Rarer, under CPU load: an ACK that
came late, while a timed-out QP was resending, left the next WRITE starting at PSNs already used and the
peer answered "opcode out of sequence" (REM_INV_REQ_ERR; dp/core.py complete_head,
tests/dp/test_dp_requester_resume.py).  Not a timed test: it checks the outcome (verified data, no error) and
that the overflow really happened."""
from __future__ import annotations


import pytest

from metaroce_xdp.topo import two_hosts
from perf_players import perf_run

pytestmark = pytest.mark.netns

NO_PORT_CAP = ("env", "METAROCE_PORT_INFLIGHT=0")


def test_bidirectional_many_qps_recover_from_rx_ring_overflow():
    topo, _ = two_hosts()
    try:
        r, s = perf_run(topo, "write-bw", 18597, ["--plane", "compiled", "--profile", "compat"],   # go-back-N
                        ["--plane", "compiled", "--profile", "compat", "-s", "65536", "-n", "300", "--qps", "16",
                         "--bidirectional"],
                        timeout=180, prefix=NO_PORT_CAP)
        assert r["verified"] is True and r["peer_verified"] is True and s["verified"] is True
        assert r["total_bytes"] == 2 * 16 * 300 * 65536
        both = (r["dp_stats"], r["peer_dp_stats"])
        # the condition was there: frames dropped at an RX ring and QPs recovering by timeouts
        assert sum(d.get("xsk_rx_dropped", 0) for d in both) > 0
        assert sum(d.get("timeouts", 0) for d in both) > 0
    finally:
        topo.close()
