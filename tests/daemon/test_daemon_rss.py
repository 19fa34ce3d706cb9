"""metaroced serves every RX queue of its interface: one QP's packets spread over all of them are handled.

Hosts A and B in two subnets behind a router, every veth end with 4 RX and TX queues; the router's two
egress ports spread MetaRoCE frames round robin over the 4 TX queues (faults.FaultInjector
spread_queues=4), so on veth each host receives one QP's consecutive packets on queues 0, 1, 2, 3 in turn
-- what a NIC's RSS does to the native profile's sprayed paths, and to compat QPs hashed to different
queues.  metaroced on B (its default rx_queues = 0: every queue) hosts `metaroce perf`'s server; an
in-process compiled-plane perf client on A (every queue too) writes to it, compat and native.  Checked:
the transfer completes and the server verifies every byte, the daemon reports all four queues and
frames received on each, and its XDP program dropped nothing as NO_XSK (a queue without a socket)."""
from __future__ import annotations

import daemon_procs
import pytest
from perf_players import perf_run

from metaroce_xdp.faults import FaultInjector
from metaroce_xdp.topo import routed_hosts

pytestmark = pytest.mark.netns

NQ = 4


@pytest.fixture(scope="module")
def daemon_b():
    r = routed_hosts(ipv6=False, queues=NQ, prefix="mrdq")
    try:
        with daemon_procs.serving(r.topo, r.b.ns, r.b.ifname, tag="mrdrss") as (sock, tmp):
            yield r, sock, tmp
    finally:
        r.topo.close()


def _device(sock: str) -> dict:
    from metaroce_xdp.daemon import client
    return client.status(sock)["devices"][0]


@pytest.mark.parametrize("profile", ["compat", "native"])
def test_metaroced_serves_a_qp_whose_packets_arrive_on_every_rx_queue(daemon_b, profile):
    r, sock, _ = daemon_b
    port = 19571 + (profile == "native")
    before = _device(sock)
    assert before["queues"] == list(range(NQ)), before["queues"]
    rx0 = [q["rx"] for q in before["counters"]["rx_queues"]]
    no_xsk0 = before["counters"]["xdp_drops"].get("NO_XSK", 0)
    with FaultInjector(r.toward_b.ifname, netns=r.toward_b.ns, spread_queues=NQ) as to_b, \
            FaultInjector(r.toward_a.ifname, netns=r.toward_a.ns, spread_queues=NQ):
        res, srv = perf_run(r.topo, "write-bw", port, ["--socket", sock, "--profile", profile],
                            ["--no-daemon", "--profile", profile, "-s", "65536", "-n", "400", "-t", "16", "-m", "1024"],
                            ns=(r.a.ns, r.b.ns), devs=(r.a.ifname, r.b.ifname), server_ip=r.b.ipv4)
        spread = to_b.stats()
    assert res["profile"] == profile and res["peer_verified"] is True, res
    assert srv["verified"] is True, srv
    assert spread["roce"] >= 400 * 64, spread                # every WRITE packet went through the spreader
    after = _device(sock)
    per_q = [q["rx"] - q0 for q, q0 in zip(after["counters"]["rx_queues"], rx0)]
    assert min(per_q) >= 400 * 64 // NQ // 2, per_q           # each queue a share of the 25,600 packets
    assert after["counters"]["xdp_drops"].get("NO_XSK", 0) == no_xsk0, after["counters"]["xdp_drops"]
