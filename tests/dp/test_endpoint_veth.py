"""End to end on real interfaces: XDP program, AF_XDP sockets, kernel ACK fast
path and the compiled plane's RC transport, between two network namespaces joined through a
third one that acts as a switch (where the BPF fault injector sits: frames an
AF_XDP socket sends skip the sender's own tc egress hook).

Checks the issue's list: every operation and size class moves the right bytes
and completes in order; access violations give the right NAK and error
completion and leave memory untouched; RNR is retried and then fails as
documented; under seeded loss, reordering, duplication and corruption every
transfer completes intact; ping and TCP keep working meanwhile; ACKs are
consumed in the kernel; a capture of the traffic decodes as RoCEv2 with valid
ICRCs.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import threading
import time
import zlib

import numpy as np
import pytest

from metaroce_xdp.verbs_types import Access, QPState, WCOpcode
from dp_players import FreshSide, connected, wait_wcs
from metaroce_xdp.verbs_types import RecvWR, SendWR, WCStatus, WROpcode

# the module's `fabric` (tests/conftest.py): A and B through a switch namespace, tcpdump capturing on its bridge
pytestmark = [pytest.mark.netns, pytest.mark.fabric(side=FreshSide, capture=dict(tag="e2e", args=["-B", "131072"]))]


@pytest.fixture
def pair(fabric):
    topo, a, b = fabric
    connected(a, b)
    return topo, a, b


def _players(a, b):
    return [a, b]


def test_every_operation_and_size(pair):
    """MR-RC-002, MR-RC-019, MR-RC-020, MR-ATOM-001 over XDP + AF_XDP; ACKs consumed in the kernel (MR-ACK-002)."""
    topo, a, b = pair
    ps = _players(a, b)
    rx0 = a.ctx.stats()["rx"]
    sizes = [0, 1, 1023, 1024, 1025, 65536, 1 << 20]
    wrs, checks, off = [], [], 0
    for i, n in enumerate(sizes):
        wrs.append(SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(off, n)],
                          remote_addr=b.mr.addr + off, rkey=b.mr.rkey))
        checks.append(("write", off, n))
        off += n + 3
    base = 4 << 20
    for j, n in enumerate(sizes):
        wrs.append(SendWR(wr_id=100 + j, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(base + j * (1 << 20) // 4, n)],
                          remote_addr=b.mr.addr + base + 7, rkey=b.mr.rkey))
        checks.append(("read", base + j * (1 << 20) // 4, n))
    b.qp.post_recv([RecvWR(wr_id=900 + k, sg_list=[b.sge(6 << 20, 1 << 20)]) for k in range(3)])
    for k, n in enumerate([0, 5000, 1 << 20]):
        wrs.append(SendWR(wr_id=200 + k, opcode=WROpcode.SEND_WITH_IMM, sg_list=[a.sge(0, n)], imm_data=k))
    cell = (8 << 20) - 8
    b.buf[cell:cell + 8] = 0
    res = (8 << 20) - 64                                   # where the atomics' original values land
    wrs.append(SendWR(wr_id=300, opcode=WROpcode.ATOMIC_FETCH_AND_ADD, sg_list=[a.sge(res, 8)],
                      remote_addr=b.mr.addr + cell, rkey=b.mr.rkey, compare_add=5))
    wrs.append(SendWR(wr_id=301, opcode=WROpcode.ATOMIC_CMP_AND_SWP, sg_list=[a.sge(res + 8, 8)],
                      remote_addr=b.mr.addr + cell, rkey=b.mr.rkey, compare_add=5, swap=77))
    a.qp.post_send(wrs)
    wcs = wait_wcs(ps, a, len(wrs), timeout=120)
    assert [w.wr_id for w in wcs] == [w.wr_id for w in wrs]
    assert all(w.status == WCStatus.SUCCESS for w in wcs), [w for w in wcs if w.status]
    for kind, o, n in checks:
        if kind == "write":
            assert zlib.crc32(b.buf[o:o + n]) == zlib.crc32(a.buf[o:o + n])
        else:
            assert zlib.crc32(a.buf[o:o + n]) == zlib.crc32(b.buf[base + 7:base + 7 + n])
    rwcs = wait_wcs(ps, b, 3)
    assert [(w.wr_id, w.byte_len, w.imm_data) for w in rwcs] == [(900, 0, 0), (901, 5000, 1), (902, 1 << 20, 2)]
    assert int(a.buf[res:res + 8].view(np.uint64)[0]) == 0          # FetchAdd saw 0
    assert int(a.buf[res + 8:res + 16].view(np.uint64)[0]) == 5     # CAS saw 5, swapped in 77
    assert int(b.buf[cell:cell + 8].view(np.uint64)[0]) == 77
    ev = a.ctx.loader.events()
    assert ev["ACK_CONSUMED"] > 0                       # ACKs never crossed to user space...
    assert a.ctx.stats()["rx"] > rx0                    # ...while READ responses and atomic ACKs did


def test_access_violation_leaves_memory_untouched(pair):
    """MR-NAK-007, MR-NAK-010, MR-MEM-024, MR-MEM-027 end to end, the NAK on the kernel fast path."""
    topo, a, b = pair
    before = b.buf.copy()
    naks = a.ctx.loader.events()["NAK_CONSUMED"]
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 20000)],
                          remote_addr=b.mr.addr + b.mr.length - 100, rkey=b.mr.rkey))
    (wc,) = wait_wcs(_players(a, b), a, 1)
    assert wc.status == WCStatus.REM_ACCESS_ERR
    assert np.array_equal(b.buf, before)
    assert a.qp.query_state() == QPState.ERR and b.qp.query_state() == QPState.ERR
    assert a.ctx.loader.events()["NAK_CONSUMED"] == naks + 1     # the NAK took the kernel fast path


def test_rnr_retried_then_exhausted(fabric):
    """MR-RNR-001, MR-RNR-005, MR-RNR-007 end to end."""
    topo, a, b = fabric
    a.new_qp(), b.new_qp()
    a.connect(b, rnr_retry=7, min_rnr_timer=1), b.connect(a, min_rnr_timer=1)
    rnr0 = a.ctx.stats()["rnr_seen"]
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND, sg_list=[a.sge(0, 100)]))
    deadline = time.monotonic() + 10
    while a.ctx.stats()["rnr_seen"] - rnr0 < 3 and time.monotonic() < deadline:
        a.ctx.progress(), b.ctx.progress()
    assert a.ctx.stats()["rnr_seen"] - rnr0 >= 3
    b.qp.post_recv(RecvWR(wr_id=5, sg_list=[b.sge(0, 100)]))
    (wc,) = wait_wcs(_players(a, b), a, 1)
    assert wc.status == WCStatus.SUCCESS
    a.new_qp(), b.new_qp()
    a.connect(b, rnr_retry=1, min_rnr_timer=1), b.connect(a, min_rnr_timer=1)
    a.qp.post_send(SendWR(wr_id=2, opcode=WROpcode.SEND, sg_list=[a.sge(0, 100)]))
    (wc,) = wait_wcs(_players(a, b), a, 1)
    assert wc.status == WCStatus.RNR_RETRY_EXC_ERR
    assert a.ctx.loader.events()["RNR_CONSUMED"] >= 2


@pytest.mark.parametrize("seed", [1, 2])
def test_faults_in_the_switch(fabric, pair, seed):
    """MR-RETRY-006, MR-DUP-003, MR-DUP-005, MR-ICRC-014 under loss, duplication, corruption, reordering."""
    topo, a, b = pair
    knobs = dict(drop_ppm=20000, dup_ppm=10000, corrupt_ppm=10000)
    with fabric.impair("b", seed=seed, reorder_ppm=20000, reorder_delay_us=500, **knobs) as fb, \
         fabric.impair("a", seed=seed + 50, **knobs) as fa:
        b.buf[7 << 20:(7 << 20) + 8] = 0
        retx0 = a.ctx.stats()["retransmits"]
        wrs = []
        for i in range(24):
            if i % 3 == 0:
                wrs.append(SendWR(wr_id=i, opcode=WROpcode.RDMA_READ, sg_list=[a.sge((4 << 20) + i * 40000, 40000)],
                                  remote_addr=b.mr.addr + (5 << 20) + i * 40000, rkey=b.mr.rkey))
            elif i % 3 == 1:
                wrs.append(SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(i * 65536, 65536)],
                                  remote_addr=b.mr.addr + i * 65536, rkey=b.mr.rkey))
            else:
                wrs.append(SendWR(wr_id=i, opcode=WROpcode.ATOMIC_FETCH_AND_ADD, sg_list=[a.sge((3 << 20) + i * 8, 8)],
                                  remote_addr=b.mr.addr + (7 << 20), rkey=b.mr.rkey, compare_add=1))
        a.qp.post_send(wrs)
        wcs = wait_wcs(_players(a, b), a, len(wrs), timeout=120)
        stats_b, stats_a = fb.stats(), fa.stats()
    assert [w.wr_id for w in wcs] == list(range(24))
    assert all(w.status == WCStatus.SUCCESS for w in wcs), [w for w in wcs if w.status]
    for i in range(24):
        if i % 3 == 0:
            lo = (4 << 20) + i * 40000
            assert zlib.crc32(a.buf[lo:lo + 40000]) == zlib.crc32(b.buf[(5 << 20) + i * 40000:(5 << 20) + i * 40000 + 40000])
        elif i % 3 == 1:
            assert zlib.crc32(b.buf[i * 65536:(i + 1) * 65536]) == zlib.crc32(a.buf[i * 65536:(i + 1) * 65536])
    assert int(b.buf[7 << 20:(7 << 20) + 8].view(np.uint64)[0]) == 8      # each atomic applied exactly once
    assert stats_b["dropped"] + stats_b["corrupted"] + stats_a["dropped"] > 0
    assert a.ctx.stats()["retransmits"] > retx0


def _icmp_echo(topo, ns, dst, timeout=2.0) -> bool:
    with topo.enter(ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    try:
        s.settimeout(timeout)
        hdr = struct.pack("!BBHHH", 8, 0, 0, 0x4D52, 1) + b"metaroce"
        csum = 0
        for i in range(0, len(hdr), 2):
            csum += (hdr[i] << 8) + hdr[i + 1]
        csum = (csum & 0xFFFF) + (csum >> 16)
        pkt = hdr[:2] + struct.pack("!H", ~csum & 0xFFFF) + hdr[4:]
        s.sendto(pkt, (dst, 0))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            data, addr = s.recvfrom(2048)
            if addr[0] == dst and data[20] == 0 and data[24:26] == b"\x4d\x52":
                return True
        return False
    finally:
        s.close()


def test_ping_and_tcp_keep_working(pair):
    """MR-ENC-005 / MR-ENC-032 step 1: what is not MetaRoCE goes to the host stack untouched."""
    topo, a, b = pair
    stop = threading.Event()

    def traffic():
        while not stop.is_set():
            a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 1 << 20)],
                                  remote_addr=b.mr.addr, rkey=b.mr.rkey))
            wait_wcs(_players(a, b), a, 1, timeout=30)

    t = threading.Thread(target=traffic)
    t.start()
    try:
        assert _icmp_echo(topo, topo[0], "10.77.0.2")
        assert _icmp_echo(topo, topo[2], "10.77.0.1")
        with topo.enter(topo[2]):
            srv = socket.create_server(("10.77.0.2", 0))
        port = srv.getsockname()[1]
        got = []

        def serve():
            c, _ = srv.accept()
            with c:
                data = b""
                while len(data) < 100_000:
                    chunk = c.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                got.append(data)
                c.sendall(b"ok")

        st = threading.Thread(target=serve)
        st.start()
        with topo.enter(topo[0]):
            cl = socket.create_connection(("10.77.0.2", port), timeout=10)
        payload = os.urandom(100_000)
        cl.sendall(payload)
        assert cl.recv(2) == b"ok"
        cl.close()
        st.join(10)
        srv.close()
        assert got and got[0] == payload
    finally:
        stop.set()
        t.join(60)
    assert a.ctx.loader.events()["PASSED"] > 0          # ARP/ICMP/TCP went to the kernel stack


@pytest.mark.skipif(shutil.which("tshark") is None, reason="tshark not installed")
def test_capture_decodes_as_rocev2_with_valid_icrc(fabric, pair):
    """MR-ICRC-003, MR-ICRC-010, MR-ENC-001: every captured frame is RoCEv2 with a valid ICRC."""
    topo, a, b = fabric
    cap_path = fabric.capture.path
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 300_000)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    wait_wcs(_players(a, b), a, 1)
    time.sleep(0.5)                                       # tcpdump -U flushes per packet
    r = subprocess.run([shutil.which("python3") and os.sys.executable, "-m", "metaroce_xdp.cli", "decode",
                        "--json", cap_path], capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(rows) > 290
    assert all(x.get("icrc_ok") for x in rows), [x for x in rows if not x.get("icrc_ok")][:3]
    # Wireshark's own dissector: every frame is eth:ip:udp:infiniband (its payload
    # heuristics may name a 1-byte WRITE payload something else; that is below the BTH)
    t = subprocess.run(["tshark", "-r", cap_path, "-T", "fields", "-e", "frame.protocols"],
                       capture_output=True, text=True, timeout=300)
    stacks = t.stdout.split()
    assert len(stacks) == len(rows)
    assert all(x.startswith("eth:ethertype:ip:udp:infiniband") for x in stacks), set(stacks)


@pytest.mark.parametrize("ipv6,mtu,pmtu", [(True, 1500, 1024), (False, 3000, 2048)], ids=["ipv6", "pmtu2048"])
def test_ipv6_and_the_largest_path_mtu(make_fabric, ipv6, mtu, pmtu):
    """MR-ENC-015, MR-ENC-024, MR-ENC-029: IPv6 encapsulation (UDP checksum filled), and the largest path MTU that
    4 KiB UMEM chunks carry with an XDP program that is not frags-aware (veth then caps
    its MTU near 3.5 KB; path MTU 4096 needs multi-buffer XDP and AF_XDP: not yet)."""
    _, a, b = make_fabric("flat", mtu=mtu, addr6=ipv6, side=FreshSide, size=1 << 21, ipv6=ipv6)
    assert a.ctx.max_pmtu == pmtu
    connected(a, b, seeds=(3,), mtu=pmtu)
    a.qp.post_send([SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 1 << 20)],
                           remote_addr=b.mr.addr, rkey=b.mr.rkey),
                    SendWR(wr_id=2, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(1 << 20, 500_000)],
                           remote_addr=b.mr.addr + 3, rkey=b.mr.rkey)])
    wcs = wait_wcs([a, b], a, 2)
    assert [w.status for w in wcs] == [WCStatus.SUCCESS] * 2
    assert zlib.crc32(b.buf[:1 << 20]) == zlib.crc32(a.buf[:1 << 20])
    assert bytes(a.buf[1 << 20:(1 << 20) + 500_000]) == bytes(b.buf[3:500_003])
    assert a.ctx.loader.events()["ACK_CONSUMED"] > 0


@pytest.mark.skipif(shutil.which("nsenter") is None, reason="nsenter (util-linux) needed")
def test_cli_reads_the_pinned_maps(pair):
    """`metaroce qp` / `metaroce stat` read what the kernel side holds, from another process,
    through the maps pinned under /sys/fs/bpf/metaroce/ (`rdma res show qp` habits)."""
    topo, a, b = pair
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 100_000)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    wait_wcs(_players(a, b), a, 1)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def cli(*args):
        r = subprocess.run(["nsenter", f"--net=/run/netns/{topo[0]}", os.sys.executable, "-m",
                            "metaroce_xdp.cli", *args], capture_output=True, text=True, timeout=120, cwd=root)
        assert r.returncode == 0, r.stderr
        return r.stdout

    pin = str(a.ctx.loader._pin_dir)              # where this endpoint pinned its maps
    rows = json.loads(cli("qp", "-d", "mr0", "--json", "--pin-dir", pin))
    mine = [r for r in rows if r["qpn"] == a.qp.qp_num]
    assert len(mine) == 1
    r = mine[0]
    assert r["state"] == "RTS" and r["peer"] == "10.77.0.2" and r["dest_qpn"] == b.qp.qp_num
    assert r["acks"] >= 1 and r["ack_psn"] == (r["snd_nxt"] - 1) & 0xFFFFFF    # everything acknowledged
    assert "RTS" in cli("qp", "-d", "mr0", "--pin-dir", pin)
    c = json.loads(cli("stat", "-d", "mr0", "--json", "--pin-dir", pin))
    assert c["events"]["ACK_CONSUMED"] >= 1 and "UNKNOWN_QP" in c["drops"]
    bad = subprocess.run(["nsenter", f"--net=/run/netns/{topo[0]}", os.sys.executable, "-m", "metaroce_xdp.cli",
                          "qp", "-d", "nosuch0"], capture_output=True, text=True, timeout=120, cwd=root)
    assert bad.returncode == 1 and "no MetaRoCE endpoint pinned" in bad.stderr      # an error, not usage (2)


def test_64mib_write_and_read_over_veth(fabric):
    """The issue's largest size class on real interfaces: one 64 MiB WRITE and one 64 MiB READ."""
    topo, a0, b0 = fabric
    n = 64 << 20
    a = FreshSide(topo, a0.ns, size=n, ctx=a0.ctx)
    b = FreshSide(topo, b0.ns, size=n, ctx=b0.ctx)
    a.new_qp(), b.new_qp()
    a.connect(b), b.connect(a)
    a.buf[::4096] = 7
    a.buf[-1] = 0xAB
    to0 = a.ctx.stats()["timeouts"]
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, n)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    (wc,) = wait_wcs(_players(a, b), a, 1, timeout=240)
    assert wc.status == WCStatus.SUCCESS and wc.byte_len == n
    assert zlib.crc32(b.buf) == zlib.crc32(a.buf)
    # nothing was lost, so nothing waits for the local ACK timer (the port's in-flight budget must count
    # only what is on the wire, not the whole WQE); a few spurious ones on a loaded host are allowed
    assert a.ctx.stats()["timeouts"] - to0 < 50, a.ctx.stats()
    b.buf[::8192] = 3
    a.qp.post_send(SendWR(wr_id=2, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(0, n)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    (wc,) = wait_wcs(_players(a, b), a, 1, timeout=240)
    assert wc.status == WCStatus.SUCCESS and zlib.crc32(b.buf) == zlib.crc32(a.buf)
    for p in (a, b):
        p.ctx.destroy_qp(p.qp)
        p.ctx.dereg_mr(p.mr)
