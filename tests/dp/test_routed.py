"""Routed paths (issue 6): RoCEv2 is routable, so hosts in different subnets talk through IP routers.

The next hop's MAC comes from the kernel's forwarding table (route, then neighbour entry of the
gateway), never from the peer (MR-CM-024); a next hop that changes under running QPs (a router's
MAC moves, a route switches to another gateway) is picked up at once.  Everything runs in
namespaces this file builds (metaroce_xdp.topo.routed_hosts / two_gateway_hosts): every operation
across one and two routers, IPv4 and IPv6; `metaroce perf` and `metaroce pingpong` across a router;
a capture on the router's far side that decodes as RoCEv2 with valid ICRCs after the router
decremented the TTL; a gateway MAC change and a gateway switch in the middle of a transfer.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from metaroce_xdp.netinfo import NetInfoError
from dp_players import FULL, Fabric, FreshSide, connected, run_until, wait_wcs
from metaroce_xdp.dp import layout as L
from metaroce_xdp.topo import two_gateway_hosts
from metaroce_xdp.verbs_types import QPAttr, QPState, RecvWR, SendWR, WCStatus, WROpcode, local_ack_timeout_ns

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "metaroce_xdp.cli"]

pytestmark = pytest.mark.netns


TIMEOUT = 14        # local ACK timeout exponent: 67 ms, as metaroce perf and pingpong use


def _pair(a: FreshSide, b: FreshSide) -> None:
    connected(a, b, timeout=TIMEOUT)


@pytest.fixture(scope="module", params=[(1, False), (1, True), (2, False), (2, True)],
                ids=["1router-v4", "1router-v6", "2routers-v4", "2routers-v6"])
def routed(request):
    routers, v6 = request.param
    yield from _routed_pair(routers, v6)


def _routed_pair(routers: int, v6: bool):
    """(routed_hosts with IPv6 segments too, v6, host A, host B: 16 MiB each, their Contexts on IPv6 if v6)
    through `routers` routers; everything closed afterwards."""
    with Fabric("routed", routers=routers, addr6=True, side=FreshSide, size=1 << 24, ipv6=v6) as f:
        yield f.routed, v6, f.a, f.b


def test_every_operation_across_routers(routed):
    """WRITE, READ, SEND/RECV and WRITE with immediate, ATOMIC fetch-add and compare-swap, data checked,
    with the next hop resolved through the route (MR-CM-024): the gateway's MAC, not the peer's."""
    r, v6, a, b = routed
    _pair(a, b)
    gw = r.gw_a["ipv6" if v6 else "ipv4"]
    qa = a.qp.query()
    assert qa["next_hop"] == gw and qa["dmac"] == r.toward_a.mac != r.b.mac
    assert b.qp.query()["dmac"] == r.toward_b.mac
    sizes = [0, 1, 1023, 1025, 65536, 1 << 20]
    wrs, checks, off = [], [], 0
    for i, n in enumerate(sizes):
        wrs.append(SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(off, n)],
                          remote_addr=b.mr.addr + off, rkey=b.mr.rkey))
        checks.append(("write", off, n))
        off += n + 3
    base = 4 << 20
    for j, n in enumerate(sizes):
        dst = base + j * (1 << 20)
        wrs.append(SendWR(wr_id=100 + j, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(dst, n)],
                          remote_addr=b.mr.addr + (12 << 20) + 7, rkey=b.mr.rkey))
        checks.append(("read", dst, n))
    b.qp.post_recv([RecvWR(wr_id=900 + k, sg_list=[b.sge(11 << 20, 1 << 20)]) for k in range(3)])
    for k, n in enumerate([0, 5000, 100000]):
        wrs.append(SendWR(wr_id=200 + k, opcode=WROpcode.SEND_WITH_IMM, sg_list=[a.sge(0, n)], imm_data=k + 1))
    wrs.append(SendWR(wr_id=250, opcode=WROpcode.RDMA_WRITE_WITH_IMM, sg_list=[a.sge(0, 3000)],
                      remote_addr=b.mr.addr + (13 << 20), rkey=b.mr.rkey, imm_data=0xBEEF))
    b.qp.post_recv(RecvWR(wr_id=950, sg_list=[]))
    cell, res = (16 << 20) - 8, (16 << 20) - 64
    b.buf[cell:cell + 8] = 0
    wrs.append(SendWR(wr_id=300, opcode=WROpcode.ATOMIC_FETCH_AND_ADD, sg_list=[a.sge(res, 8)],
                      remote_addr=b.mr.addr + cell, rkey=b.mr.rkey, compare_add=5))
    wrs.append(SendWR(wr_id=301, opcode=WROpcode.ATOMIC_CMP_AND_SWP, sg_list=[a.sge(res + 8, 8)],
                      remote_addr=b.mr.addr + cell, rkey=b.mr.rkey, compare_add=5, swap=77))
    # The 1 MiB READ's last 7 bytes lie under the later WRITE WITH IMMEDIATE at 13 MiB: the READ is
    # executed first and must return the memory as it was then (MR-RC-025), so its data is taken now.
    src = (12 << 20) + 7
    read_src = b.buf[src:src + max(sizes)].copy()
    a.qp.post_send(wrs)
    wcs = wait_wcs([a, b], a, len(wrs), timeout=120)
    assert [w.wr_id for w in wcs] == [w.wr_id for w in wrs]
    assert all(w.status == WCStatus.SUCCESS for w in wcs), [w for w in wcs if w.status]
    for kind, o, n in checks:
        if kind == "write":
            assert zlib.crc32(b.buf[o:o + n]) == zlib.crc32(a.buf[o:o + n])
        else:
            assert zlib.crc32(a.buf[o:o + n]) == zlib.crc32(read_src[:n])
    rwcs = wait_wcs([a, b], b, 4)
    assert [(w.wr_id, w.byte_len, w.imm_data) for w in rwcs] == [
        (900, 0, 1), (901, 5000, 2), (902, 100000, 3), (950, 3000, 0xBEEF)]
    assert np.array_equal(b.buf[(11 << 20):(11 << 20) + 100000], a.buf[:100000])
    assert np.array_equal(b.buf[(13 << 20):(13 << 20) + 3000], a.buf[:3000])
    assert int(a.buf[res:res + 8].view(np.uint64)[0]) == 0          # FetchAdd saw 0
    assert int(a.buf[res + 8:res + 16].view(np.uint64)[0]) == 5     # CAS saw 5, swapped in 77
    assert int(b.buf[cell:cell + 8].view(np.uint64)[0]) == 77


def _transfer_with(a: FreshSide, b: FreshSide, event, at_bytes: int, total: int = 16 << 20, chunk: int = 1 << 20,
                   timeout: float = 120, watch: list | None = None):
    """WRITE `total` bytes A -> B in `chunk` WRs; call event() once A has sent `at_bytes`.
    Returns (completions, time event() returned, time every QP in `watch` had changed its path)."""
    wrs = [SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(i * chunk, chunk)],
                  remote_addr=b.mr.addr + i * chunk, rkey=b.mr.rkey) for i in range(total // chunk)]
    a.qp.post_send(wrs)
    done: list = []
    fired: list = []
    moved: list = []
    base = [h.qp.path_changes for h in watch or ()]
    psn0 = int(a.qp.row[L.Q_SND_MAX])
    mtu = a.qp.query()["path_mtu"]

    def cond():
        if not fired and ((int(a.qp.row[L.Q_SND_MAX]) - psn0) & 0xFFFFFF) * mtu >= at_bytes:   # A's bytes sent
            event()
            fired.append(time.monotonic())
        if fired and not moved and watch and all(h.qp.path_changes > n for h, n in zip(watch, base)):
            moved.append(time.monotonic())
        done.extend(a.cq.poll(1 << 10))
        return len(done) >= len(wrs)

    run_until([a, b], cond, timeout)
    assert fired, "the transfer ended before the event"
    assert all(w.status == WCStatus.SUCCESS for w in done), [w for w in done if w.status][:3]
    assert zlib.crc32(a.buf[:total]) == zlib.crc32(b.buf[:total])
    return done, fired[0], moved[0] if moved else None


@pytest.fixture(scope="module", params=[False, True], ids=["v4", "v6"])
def one_router(request):
    yield from _routed_pair(1, request.param)


@pytest.mark.parametrize("side", ["a", "b"])
def test_gateway_mac_change_mid_transfer(one_router, side):
    """The gateway's MAC moves (a router failover) in the middle of a 16 MiB WRITE and the router
    announces it (gratuitous ARP / unsolicited NA).  Side "a": the requester's gateway moves; side
    "b": the responder's, whose ACKs would go to a dead MAC.  The transfer completes intact and the
    QP took the new next hop, counted in qp.query() and the context's stats()."""
    r, v6, a, b = one_router
    _pair(a, b)
    fam = "ipv6" if v6 else "ipv4"
    router_if = r.toward_a if side == "a" else r.toward_b
    who = a if side == "a" else b
    gw = (r.gw_a if side == "a" else r.gw_b)[fam]
    new_mac = "02:00:5e:%02x:%02x:%02x" % tuple(os.urandom(3))
    before = dict(who.qp.query())

    def failover():
        r.topo.set_mac(router_if.ns, router_if.ifname, new_mac)
        r.topo.announce(router_if.ns, router_if.ifname, gw)

    _, t_event, t_moved = _transfer_with(a, b, failover, at_bytes=4 << 20, watch=[who])
    # picked up within one local ACK timeout of the announcement (about 2 ms for IPv4 and 10 ms
    # for IPv6 here: the resolver thread shares the GIL with this busy-polling test)
    assert t_moved is not None and t_moved - t_event < local_ack_timeout_ns(TIMEOUT) / 1e9, t_moved - t_event
    q = who.qp.query()
    assert q["dmac"] == new_mac and q["next_hop"] == gw
    assert q["path_changes"] == before["path_changes"] + 1
    st = who.ctx.stats()
    assert st["path_changes"] >= 1 and st["path_resolves"] >= 1
    r.topo.set_mac(router_if.ns, router_if.ifname, router_if.mac)      # leave the fixture as found
    r.topo.announce(router_if.ns, router_if.ifname, gw)


def test_next_hop_follows_a_route_switch_mid_transfer():
    """Both hosts' default routes move from router R1 to R2 in the middle of a transfer, then R1
    stops forwarding: the QPs must have moved to R2 (route events through netlink)."""
    t = two_gateway_hosts(ipv6=False)
    hosts = []
    try:
        a, b = (FreshSide(t.topo, ep.ns, ep.ifname, 1 << 24, ipv6=False) for ep in (t.a, t.b))
        hosts += [a, b]
        _pair(a, b)
        assert a.qp.query()["dmac"] == t.toward_a[0].mac and b.qp.query()["dmac"] == t.toward_b[0].mac

        def switch():
            t.use("a", 1)
            t.use("b", 1)
            t.topo.run(t.routers[0], ["sysctl", "-qw", "net.ipv4.ip_forward=0"], timeout=10)

        _, t_event, t_moved = _transfer_with(a, b, switch, at_bytes=4 << 20, watch=[a, b])
        assert t_moved is not None
        qa, qb = a.qp.query(), b.qp.query()
        assert qa["next_hop"] == t.gateways_a[1]["ipv4"] and qa["dmac"] == t.toward_a[1].mac
        assert qb["next_hop"] == t.gateways_b[1]["ipv4"] and qb["dmac"] == t.toward_b[1].mac
        assert qa["path_changes"] == 1 and qb["path_changes"] == 1
    finally:
        for h in hosts:
            h.close()
        t.close()


def test_no_address_is_tentative_once_the_routers_are_built(make_fabric):
    """Every IPv6 address, link-local ones included, is usable as soon as routed_hosts returns.  A
    router whose link-local address is still tentative (duplicate address detection, ~1.5 s) sends
    no neighbour solicitation for packets it forwards: a first WRITE across two IPv6 routers then
    ran out of retries (RETRY_EXC_ERR)."""
    IFA_F_TENTATIVE = 0x40
    r = make_fabric("routed", routers=2, addr6=True, side=None).routed
    seen = 0
    for ns in r.topo.names:
        for a in r.topo.ipr(ns).get_addr(family=socket.AF_INET6):
            flags = a.get_attr("IFA_FLAGS") or a["flags"]
            assert not flags & IFA_F_TENTATIVE, (ns, a.get_attr("IFA_ADDRESS"))
            seen += 1
    assert seen >= 2 * 6          # a global and a link-local address on each of the 6 router/host ends


def test_path_errors_are_typed_and_say_what_to_do(make_fabric):
    """No route, a route through another interface: NetInfoError naming the fix; the QP stays in INIT."""
    r = make_fabric("routed", side=None).routed
    a = FreshSide(r.topo, r.a.ns, r.a.ifname, size=4096, ipv6=False)
    try:
        a.new_qp()
        a.qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
        h = r.topo.ipr(r.a.ns)
        h.route("del", dst="0.0.0.0", dst_len=0)
        with pytest.raises(NetInfoError, match=r"no route to 10\.78\.1\.2 from mr0 .*: add one \(ip route add"):
            a.qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=0x11, rq_psn=0, path_mtu=1024,
                               dgid=r.b.ipv4))
        assert a.qp.state == QPState.INIT
        h.link("add", ifname="other0", kind="veth", peer={"ifname": "other1"})
        idx = h.link_lookup(ifname="other0")[0]
        h.link("set", index=idx, state="up")
        h.route("add", dst="10.78.1.0", dst_len=24, oif=idx)
        with pytest.raises(NetInfoError, match=r"route to 10\.78\.1\.2 leaves through other0, not mr0"):
            a.qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=0x11, rq_psn=0, path_mtu=1024,
                               dgid=r.b.ipv4))
        assert a.qp.state == QPState.INIT
    finally:
        a.close()


# ============================================================================ tools across a router


def _proc(topo, ns, argv):
    from test_perf_pingpong import Proc
    return Proc(topo, ns, argv)


@pytest.fixture
def router1(make_fabric):
    return make_fabric("routed", addr6=True, side=None).routed


@pytest.mark.timeout(240)
@pytest.mark.parametrize("test", ["write-bw", "read-bw", "send-bw", "write-lat"])
def test_perf_across_a_router(router1, test):
    """`metaroce perf` between two subnets (the issue's RETRY_EXC_ERR case)."""
    r = router1
    size, iters = ("65536", "200") if test != "write-lat" else ("8", "300")
    args = ["perf", test, "-s", size, "-n", iters, "-p", "18615", "--json"]
    srv = _proc(r.topo, r.b.ns, [*args, "-d", "mr1"])
    srv.wait_for("Waiting for client")
    cli = _proc(r.topo, r.a.ns, [*args, "-d", "mr0", r.b.ipv4])
    (crc, cout, cerr), (src, sout, serr) = cli.finish(), srv.finish(30)
    assert crc == 0 and src == 0, cerr + serr
    c, s = json.loads(cout), json.loads(sout)
    assert c["total_bytes"] == s["total_bytes"] == int(size) * int(iters)
    if test in ("write-bw", "send-bw"):
        assert s["counters"]["bytes_received"] == int(size) * int(iters)


@pytest.mark.timeout(240)
def test_pingpong_across_a_router(router1):
    r = router1
    args = ["pingpong", "-g", "1", "-s", "4096", "-n", "200", "-p", "18617"]
    srv = _proc(r.topo, r.b.ns, [*args, "-d", "mr1"])
    srv.wait_for("local address:")
    cli = _proc(r.topo, r.a.ns, [*args, "-d", "mr0", r.b.ipv4])
    (crc, cout, cerr), (src, sout, serr) = cli.finish(), srv.finish(30)
    assert crc == 0 and src == 0, cerr + serr
    for out in (cout, sout):
        assert "1638400 bytes in" in out and "200 iters in" in out


@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("tshark") is None or shutil.which("tcpdump") is None,
                    reason="tshark and tcpdump needed")
@pytest.mark.parametrize("v6", [False, True], ids=["v4", "v6"])
def test_capture_beyond_the_router_decodes_as_rocev2(router1, v6, tmp_path):
    """Frames captured on the router's interface towards B (after forwarding: TTL / hop limit
    decremented, IPv4 checksum rewritten, MACs replaced) decode as RoCEv2 in our decoder and in
    tshark, and every ICRC verifies: the ICRC masks TTL and checksum (MR-ICRC-011)."""
    r = router1
    pcap = tmp_path / "routed.pcap"
    cap = r.topo.popen(r.toward_b.ns, ["tcpdump", "-q", "-U", "--immediate-mode", "-B", "131072", "-i",
                                       r.toward_b.ifname, "-w", str(pcap), "udp port 4791"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert "listening on" in cap.stderr.readline()
    hosts = []
    try:
        a, b = (FreshSide(r.topo, ep.ns, ep.ifname, 1 << 21, ipv6=v6) for ep in (r.a, r.b))
        hosts += [a, b]
        _pair(a, b)
        a.qp.post_send([SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 1 << 20)],
                               remote_addr=b.mr.addr, rkey=b.mr.rkey),
                        SendWR(wr_id=2, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(1 << 20, 65536)],
                               remote_addr=b.mr.addr + 4096, rkey=b.mr.rkey)])
        wcs = wait_wcs([a, b], a, 2, timeout=60)
        assert all(w.status == WCStatus.SUCCESS for w in wcs)
        time.sleep(0.5)
    finally:
        for h in hosts:
            h.close()
        cap.terminate()
        cap.wait(timeout=10)
    d = subprocess.run([*CLI, "decode", "--json", str(pcap)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows = [json.loads(x) for x in d.stdout.splitlines()]
    assert len(rows) >= 1024, d.stderr
    assert all(x["icrc_ok"] for x in rows)
    names = {x["opcode_name"] for x in rows}
    assert {"RDMA_WRITE_FIRST", "RDMA_WRITE_LAST", "RDMA_READ_REQUEST"} <= names
    hop = {x["ip"]["hop_limit" if v6 else "ttl"] for x in rows if x["ip"]["src"] == r.ip("a", v6)}
    assert hop == {63}                                        # 64, less the router's one hop
    t = subprocess.run(["tshark", "-r", str(pcap), "-T", "fields", "-e", "frame.protocols"],
                       capture_output=True, text=True, timeout=300)
    stacks = t.stdout.split()
    assert len(stacks) == len(rows)
    assert all(s.startswith(f"eth:ethertype:{'ipv6' if v6 else 'ip'}:udp:infiniband") for s in stacks)
