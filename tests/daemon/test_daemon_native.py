"""metaroced serves native QPs (issue 9): a real daemon (metaroce_xdp.daemon.server) in host B of two
namespaces, `metaroce perf` through it as the server (the daemon's client library, --profile native), and
an in-process compiled-plane perf client in host A (--profile native): the connection agrees the native
profile with CREDITS (the daemon's receiver grants them, dp/serve.credits), the WRITEs arrive intact
(the server compares its buffer with the client's pattern), and the daemon's snapshot shows the QP
native and its credit allocation running."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import daemon_procs
import pytest

from metaroce_xdp import cm
from metaroce_xdp.topo import two_hosts

pytestmark = pytest.mark.netns

ROOT = Path(__file__).resolve().parents[2]
PERF = [sys.executable, "-m", "metaroce_xdp.cli", "perf", "write-bw"]


@pytest.fixture(scope="module")
def daemon_b():
    topo, pair = two_hosts()
    try:
        with daemon_procs.serving(topo, topo[1], pair.b.ifname, tag="mrdnat",
                                  extra="credit_budget = 32\n") as (sock, tmp):
            yield topo, pair, sock, tmp
    finally:
        topo.close()


def _status(sock: str) -> dict:
    from metaroce_xdp.daemon import client              # the daemon's socket is a file: any namespace reaches it
    return client.status(sock)


def test_native_write_through_metaroced_is_intact_with_credits(daemon_b):
    topo, pair, sock, tmp = daemon_b
    port = 19561
    srv = topo.popen(topo[1], [*PERF, "-d", pair.b.ifname, "--socket", sock, "--profile", "native", "--json",
                               "-p", str(port)], cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     text=True)
    snap = None
    try:
        for _ in range(120):
            cli = topo.popen(topo[0], [*PERF, "-d", pair.a.ifname, "--no-daemon", "--plane", "compiled", "--profile",
                                       "native", "-s", "65536", "-n", "1000", "-t", "16", "-m", "1024", "--json",
                                       "-p", str(port), pair.b.ipv4], cwd=str(ROOT), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            # the daemon's view while the transfer runs (the QPs are gone once perf exits); a view
            # taken while the server was still connecting (RTR, not yet RTS) is kept only until one
            # taken during the transfer replaces it
            while cli.poll() is None:
                s = _status(sock)
                nat = [q for q in s["qps"] if q.get("profile") == "native"]
                if nat and (snap is None or any(q["state"] == "RTS" for q in nat)):
                    snap = s
                time.sleep(0.05)
            out, err = cli.communicate()
            if "start `metaroce perf" not in err:
                break
            time.sleep(0.5)                       # the server is still starting
        sout, serr = srv.communicate(timeout=60)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    assert cli.returncode == 0, err[-2000:]
    assert srv.returncode == 0, serr[-2000:]
    r = json.loads(out.strip().splitlines()[-1])
    assert r["profile"] == "native", r
    assert r["peer_verified"] is True and r["total_bytes"] == 65536 * 1000
    s = json.loads(sout.strip().splitlines()[-1])
    assert s["verified"] is True and s.get("profile") == "native", s
    assert snap is not None, "the daemon never listed a native QP"
    q = max((q for q in snap["qps"] if q.get("profile") == "native"), key=lambda q: q["state"] == "RTS")
    assert q["state"] == "RTS" and q["remote_addr"] == pair.a.ipv4
    dev = snap["devices"][0]
    assert "native" in dev["caps"]["profiles"] and dev["caps"]["credits"] is True
    assert dev["counters"]["credit_runs"] > 0           # the receiver's allocation ran over the native QP
    assert q["native"]["credits"] == 1 and q["native"]["rx_credit"] >= 1   # CREDITS agreed, a grant set


def test_client_library_offers_the_daemons_profiles(daemon_b):
    """The client library's offer (connect_qp/accept): compat with ATOMICS only (MR-CM-013: the daemon
    executes atomics), native with the daemon's native capabilities, CREDITS and ATOMICS, auto with
    COMPAT_OK; a READ and an atomic on a native QP go into the ring and the daemon's loop takes them (no
    longer refused: tests/daemon/test_daemon_native_read.py runs them end to end)."""
    topo, pair, sock, tmp = daemon_b
    from metaroce_xdp.daemon import client
    from metaroce_xdp.verbs_types import (Access, InvalidArgument, QPAttr, QPCap, QPState, SendFlags, SendWR,
                                          WROpcode)
    with client.connect(sock, pair.b.ifname) as ctx:
        o = {"profiles": ctx.profiles}
        for p in ("compat", "native", "auto"):
            o[p] = ctx.offer(p)
        with pytest.raises(InvalidArgument, match="fast"):
            ctx.offer("fast")
        o["agreed"] = ctx.agreed_profile(int(cm.Cap.NATIVE | cm.Cap.SACK | cm.Cap.OOO_PLACEMENT | cm.Cap.CREDITS),
                                         256, 16)
        pd = ctx.alloc_pd()
        mr = pd.reg_mr(ctx.alloc_buf(4096), Access.LOCAL_WRITE)
        cq = ctx.create_cq(16)
        qp = ctx.create_qp(pd, cq, cq, QPCap(max_send_wr=16, max_recv_wr=16))
        qp.modify(QPAttr(qp_state=QPState.INIT))
        qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=0x777, rq_psn=0, path_mtu=1024, dgid=pair.a.ipv4,
                         max_dest_rd_atomic=16, profile="native", native_params=o["agreed"][1]))
        qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0, max_rd_atomic=16))
        qp.profile = "native"
        dev0 = _status(sock)["devices"][0]["counters"]
        qp.post_send([SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[mr.sge(0, 64)], remote_addr=0x1000, rkey=1,
                             send_flags=SendFlags.SIGNALED),
                      SendWR(wr_id=2, opcode=WROpcode.ATOMIC_FETCH_AND_ADD, sg_list=[mr.sge(64, 8)],
                             remote_addr=0x2000, rkey=1, compare_add=1, send_flags=SendFlags.SIGNALED)])
        for _ in range(100):
            dev1 = _status(sock)["devices"][0]["counters"]
            if dev1["wrs_taken"] >= dev0["wrs_taken"] + 2:
                break
            time.sleep(0.05)
        o["taken"] = (dev1["wrs_taken"] - dev0["wrs_taken"], dev1["bad_wrs"] - dev0["bad_wrs"])
        q = qp.query()
        o["qp"] = (q["profile"], q["state"])
    assert o["profiles"] == ["compat", "native"]
    assert o["compat"] == (int(cm.Cap.ATOMICS), cm.FLAG_COMPAT_OK)
    caps, flags = o["native"]
    assert flags == 0 and caps & cm.Cap.NATIVE and caps & cm.Cap.SACK and caps & cm.Cap.CREDITS
    assert caps & cm.Cap.ATOMICS
    assert o["auto"] == (caps, cm.FLAG_COMPAT_OK)
    assert o["agreed"] == ("native", {"w": 256, "k": 1, "cc_delay": 0, "credits": 1})
    assert o["taken"] == (2, 0) and o["qp"] == ("native", QPState.RTS), o      # taken, not refused
