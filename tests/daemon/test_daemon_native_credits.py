"""metaroced's receiver credits on the wire (MR-CC-015, MR-CC-016): a real daemon in host B of switched_hosts
(A, B and C through a bridge in M) with a credit budget of 32 packets, two `metaroce perf` servers through
it, and two in-process compiled-plane clients writing over native QPs: A's one QP first, then C's three,
so the daemon's allocation (dp/serve.credits, native/receiver.rx_credit_alloc) lowers A's share from 32 to
16, 10 or 8 while A runs.  An AF_PACKET socket on the switch port towards A sees every NATIVE_SACK B sends A:
cum + credit never moves backwards."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import daemon_procs
import pytest

from dp_players import Fabric
from metaroce_xdp.wire.packet import decode
from wire_players import PortTap, is_roce_v4

pytestmark = pytest.mark.netns

ROOT = Path(__file__).resolve().parents[2]
PERF = [sys.executable, "-m", "metaroce_xdp.cli", "perf", "write-bw"]
PSN_MASK, PSN_HALF = 0xFFFFFF, 0x800000
BUDGET = 32


@pytest.fixture(scope="module")
def daemon_b():
    with Fabric("switched", hosts=3, prefix="mrcr", side=None) as f, \
            daemon_procs.serving(f.topo, f.topo[2], "mr1", tag="mrdcr", extra=f"credit_budget = {BUDGET}\n") as (sock, _):
        yield f.topo, sock                                              # A, the switch, B (the daemon), C


def _is_sack_from_b(f: bytes) -> bool:
    """IPv4 from 10.77.0.2, UDP to 4791, BTH opcode NATIVE_SACK."""
    return is_roce_v4(f) and f[26:30] == bytes((10, 77, 0, 2)) and f[42] == 0xC6


def _sacks(tap: PortTap, limit: int = 1 << 30) -> list:
    """The NATIVE_SACKs from B among the frames the tap holds, in the order they crossed the switch (at most
    `limit` of them: the rest stay in the socket for the next call)."""
    return [decode(f) for f in tap.frames(_is_sack_from_b, limit)]


def _wait(proc, seconds: float) -> None:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        pass


def _client(topo, ns, ifname, port, qps, iters):
    return topo.popen(ns, [*PERF, "-d", ifname, "--no-daemon", "--plane", "compiled", "--profile", "native",
                           "--qps", str(qps), "-s", "65536", "-n", str(iters), "-t", "8", "-m", "1024", "--json",
                           "-p", str(port), "10.77.0.2"], cwd=str(ROOT),
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_credits_never_move_the_right_edge_backwards_through_metaroced(daemon_b):
    """MR-CC-016: host A writes over one native QP alone (its share of the daemon's 32-packet budget: 32), and
    once A's SACKs grant 32 host C starts three more, so A's share goes down (to 8 with all four active) while
    it runs.  Over every ACK-type NATIVE_SACK the daemon sends A, cum + credit never moves backwards (24-bit
    serial order), and A's credit goes from 32 to a lower share.  MR-CC-015: every credit is in [1, W].  Both
    transfers complete intact (perf verifies the servers' buffers).  Whether a held edge shows as a credit no
    share gives (what is left of the last edge) depends on how far cum moves between two SACKs: coalesced
    SACKs (MR-NAT-023, MR-SACK-015) often pass the old edge in one step, so that is checked exactly in
    test_native_logic::test_lowered_credit_keeps_the_right_edge_mr_cc_016, not here."""
    topo, sock = daemon_b
    port = 19571
    sk = PortTap(topo, topo[1], "swA")                  # host A's traffic only
    srvs = [topo.popen(topo[2], [*PERF, "-d", "mr1", "--socket", sock, "--profile", "native", "--json",
                                 "-p", str(port + i)], cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True) for i in range(2)]
    sacks: list = []
    try:
        for _ in range(600):                               # both servers listening before any client starts
            ss = topo.popen(topo[2], ["ss", "-Hltn"], stdout=subprocess.PIPE, text=True).communicate()[0]
            if all(f":{port + i} " in ss for i in range(2)):
                break
            time.sleep(0.1)
        clis = [_client(topo, topo[0], "mr0", port, 1, 4000)]
        while clis[0].poll() is None and not any(p.sacketh.credit == BUDGET for p in sacks):
            sacks += _sacks(sk, 64)                      # A runs alone: its share is the whole budget (a few at a
            #                                              time: decoding all A's SACKs at once can outlast A)
            _wait(clis[0], 0.02)
        if clis[0].poll() is None:
            clis.append(_client(topo, topo[3], "mr2", port + 1, 3, 200))
        while any(c.poll() is None for c in clis):
            sacks += _sacks(sk)                          # drained as they come: the socket buffer is finite
            _wait(clis[0], 0.02)
        outs = [c.communicate() for c in clis]
        sacks += _sacks(sk)
        srv_out = [s.communicate(timeout=60) for s in srvs[:len(clis)]]   # C's server waits forever if C never ran
    finally:
        sk.close()
        for s in srvs:
            if s.poll() is None:
                s.kill()
                s.wait()
    for c, (out, err) in zip(clis, outs):
        assert c.returncode == 0, err[-2000:]
        r = json.loads(out.strip().splitlines()[-1])
        assert r["profile"] == "native" and r["peer_verified"] is True, r
    for s, (out, err) in zip(srvs, srv_out):
        assert s.returncode == 0, err[-2000:]
    v = [(p.bth.psn, p.sacketh.credit) for p in sacks if p.aeth.syndrome == 0x1F]   # ACK-type (A's one QP)
    assert len({p.bth.dest_qp for p in sacks}) == 1 and len(v) >= 50 and len(clis) == 2, "C started after A ended"
    credits = [c for _, c in v]
    assert all(1 <= c <= 256 for c in credits)           # MR-CC-015 (W = 256)
    edges = [(cum + c) & PSN_MASK for cum, c in v]
    back = [(i, v[i - 1], v[i]) for i in range(1, len(v)) if ((edges[i] - edges[i - 1]) & PSN_MASK) >= PSN_HALF]
    assert not back, back[:5]                            # MR-CC-016: never backwards
    assert BUDGET in credits and min(credits) <= BUDGET // 2   # alone, then one of two to four
