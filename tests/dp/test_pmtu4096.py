"""Path MTU 4096 end to end: a frags-aware XDP program (BPF_F_XDP_HAS_FRAGS) and
multi-buffer AF_XDP (XDP_USE_SG) between two namespaces whose veths run at MTU 9000,
through a switch namespace where tcpdump captures what goes by.

A frame with 4096 bytes of payload is ~4.2 KB, more than a 4 KiB UMEM chunk: it leaves
as two chained TX descriptors and arrives as two RX descriptors that the compiled plane's loop
joins (afxdp/rings.py *_sg).  Checked here, on the compiled plane's endpoints: an 8000-byte
datagram that is not RoCE still passes the program to the stack; the capture decodes with
good ICRCs in `metaroce decode` and in tshark; at MTU 1500 the port keeps the single-buffer
path and refuses path MTU 4096.  The ring functions are also checked on plain arrays against
a simulated kernel.  WRITE, READ and SEND of 1 B to 1 MiB at path MTU 4096 (multi-buffer frames
joined, ACKs consumed by the XDP program) are tests/dp/test_dp_pmtu4096.py.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from metaroce_xdp.afxdp import rings
from dp_players import FULL, Side, wait_wcs
from metaroce_xdp.dp import layout as L
from metaroce_xdp.verbs_types import InvalidArgument, QPAttr, QPState, SendWR, WCStatus, WROpcode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = [1, 4095, 4096, 4097, 64 << 10, 1 << 20]

needs_root = pytest.mark.netns


# ---------------------------------------------------------------- ring functions on plain arrays

def _ring(size, desc):
    prod, cons, flags = (np.zeros(1, np.uint32) for _ in range(3))
    body = np.zeros((size, 2), np.uint64) if desc else np.zeros(size, np.uint64)
    return prod, cons, flags, body


def test_sg_rings_split_reassemble_and_reap():
    """tx_burst_sg chains a frame longer than a chunk (XDP_PKT_CONTD), rx_burst_sg joins a
    chained packet into its first slot and returns the other slot, an incomplete packet
    waits, an over-long one is dropped, comp_reap_sg returns each slot once."""
    chunk, slot = 4096, 8192
    umem = np.zeros(16 * slot, np.uint8)
    pool = rings.FramePool(16, slot)
    # TX: frames of 100 B, 4096 B (one chunk exactly) and 4170 B (two descriptors)
    tp, tc, _, td = _ring(8, True)
    addrs = pool.alloc(3)
    lens = np.array([100, 4096, 4170], np.uint32)
    assert rings.tx_burst_sg(tp, tc, td, addrs, lens, 3, chunk) == 3
    assert tp[0] == 4
    opts = td[:4, 1] >> np.uint64(32)
    assert list(td[:4, 1] & np.uint64(0xFFFFFFFF)) == [100, 4096, 4096, 74]
    assert list(opts) == [0, 0, 1, 0]
    assert td[3, 0] == addrs[2] + chunk
    # only whole frames are queued: 4 slots left, the next two frames need 2 + 2, then 1 more
    more = pool.alloc(3)
    assert rings.tx_burst_sg(tp, tc, td, more, np.array([5000, 5000, 60], np.uint32), 3, chunk) == 2
    assert tp[0] == 8
    # the kernel completes every descriptor: each slot comes back once
    cp, cc, _, ca = _ring(16, False)
    ca[:8] = td[:8, 0]
    cp[0] = 8
    free0 = pool.free_count
    assert rings.comp_reap_sg(cp, cc, ca, pool.stack, pool.top, pool.frame_mask, chunk, 16) == 8
    assert pool.free_count == free0 + 5 and cc[0] == 8
    # RX: a single-buffer packet, a packet in two descriptors, then one whose end is not published
    rp, rc, _, rd = _ring(8, True)
    s = pool.alloc(6)
    head, tail = int(s[1]) + 256, int(s[2]) + 256
    umem[head:head + 3840] = 1
    umem[tail:tail + 330] = 2
    rd[0] = (int(s[0]) + 256, 60)
    rd[1] = (head, 3840 | (1 << 32))
    rd[2] = (tail, 330)
    rd[3] = (int(s[3]) + 256, 3840 | (1 << 32))
    rp[0] = 4
    out_a, out_l = np.zeros(8, np.uint64), np.zeros(8, np.uint32)
    st = np.zeros(2, np.int64)
    free1 = pool.free_count
    n = rings.rx_burst_sg(rp, rc, rd, umem, out_a, out_l, pool.stack, pool.top, pool.frame_mask, st, 8)
    assert n == 2 and rc[0] == 3                     # the incomplete one stays in the ring
    assert list(out_a[:2]) == [int(s[0]) + 256, head] and list(out_l[:2]) == [60, 4170]
    assert (umem[head:head + 3840] == 1).all() and (umem[head + 3840:head + 4170] == 2).all()
    assert pool.free_count == free1 + 1 and st[1] == 1   # the tail's slot went back
    # its end arrives, too long for a slot (7936 B of room after the 256 B headroom): dropped
    rd[4] = (int(s[4]) + 256, 3840 | (1 << 32))
    rd[5] = (int(s[5]) + 256, 3840)
    rp[0] = 6
    free2 = pool.free_count
    n = rings.rx_burst_sg(rp, rc, rd, umem, out_a, out_l, pool.stack, pool.top, pool.frame_mask, st, 8)
    assert n == 0 and rc[0] == 6 and st[0] == 1
    assert pool.free_count == free2 + 3                 # all three slots of the dropped packet


# ---------------------------------------------------------------- the XDP program on multi-buffer frames

@needs_root
def test_xdp_program_on_multi_buffer_frames():
    """BPF_PROG_TEST_RUN puts what does not fit one page of a frags-aware program's input in
    fragments: a 4096-byte-payload WRITE passes every check (reaches the redirect: NO_XSK
    without a socket); one whose IP length claims more than the frame holds is BAD_IP_HEADER.

    The ICRC input of an ACK or CNP that does not lie whole in the first buffer is read with
    bpf_xdp_load_bytes.  No real ACK meets so small a first buffer, so the program is built
    with MR_ICRC_VIA_LOAD_BYTES=1 (that path for every frame; tests/kern/test_xdp_golden.py covers
    the direct one): good ACKs and CNPs are consumed, IPv4 and IPv6, corrupt ones BAD_ICRC."""
    from metaroce_xdp.kern import QpState, XdpLoader
    from metaroce_xdp.wire import AETH, RETH, Op, encode
    cases = (("10.57.0.2", "10.57.0.1", 0x11), ("fd57::2", "fd57::1", 0x12))
    with XdpLoader(max_qps=64, defines={"MR_ICRC_VIA_LOAD_BYTES": 1}) as ld:
        assert ld.frags
        ld.set_config(local_ip4=cases[0][0], local_ip6=cases[1][0])
        for local, peer, qpn in cases:
            ld.install_qp(qpn, peer_ip=peer, dest_qpn=0x22, state=QpState.RTS, pmtu=4096, init_psn=100)
            ld.qp(qpn)["snd_nxt"] = 110
            big = encode(Op.RDMA_WRITE_ONLY, dest_qp=qpn, psn=5, src_ip=peer, dst_ip=local,
                         headers={"reth": RETH(va=0x1000, rkey=0x1234, dma_len=4096)},
                         payload=bytes(range(256)) * 16)
            assert len(big) > 4096 + 58
            d0 = ld.drops()
            assert ld.test_run(big).action == "XDP_DROP"
            d1 = ld.drops()
            assert d1["NO_XSK"] == d0["NO_XSK"] + 1 and d1["BAD_IP_HEADER"] == d0["BAD_IP_HEADER"]
            assert ld.test_run(big[:-100]).action == "XDP_DROP"          # IP length beyond the frame's end
            assert ld.drops()["BAD_IP_HEADER"] == d1["BAD_IP_HEADER"] + 1
            a = encode(Op.ACKNOWLEDGE, dest_qp=qpn, psn=104, src_ip=peer, dst_ip=local,
                       headers={"aeth": AETH(syndrome=0x1F, msn=3)})
            cnp = encode(Op.CNP, dest_qp=qpn, psn=0, src_ip=peer, dst_ip=local)
            for frame, event in ((a, "ACK_CONSUMED"), (cnp, "CNP_CONSUMED")):
                bad = frame[:-2] + bytes([frame[-2] ^ 0x40]) + frame[-1:]
                b0 = ld.drops()["BAD_ICRC"]
                assert ld.test_run(bad).action == "XDP_DROP" and ld.drops()["BAD_ICRC"] == b0 + 1
                e0 = ld.events()[event]
                assert ld.test_run(frame).action == "XDP_DROP" and ld.events()[event] == e0 + 1, (local, event)
            assert int(ld.qp(qpn)["ack_psn"]) == 104 and int(ld.qp(qpn)["cnp_count"]) == 1


# ---------------------------------------------------------------- over veth at MTU 9000

# the module's `fabric` (tests/conftest.py): veths at MTU 9000 through a switch namespace, tcpdump capturing
# every byte of each frame on its bridge
pytestmark = pytest.mark.fabric(mtu=9000, size=4 << 20, qp=True,
                                capture=dict(tag="pmtu4096", args=["-B", "262144", "-s", "0"]))


@pytest.fixture(scope="module")
def jumbo(fabric):
    """The module's fabric, A's and B's QPs connected at path MTU 4096."""
    _, a, b = fabric
    a.connect(b, mtu=4096, rd_atomic=4)
    b.connect(a, mtu=4096, rd_atomic=4)
    return fabric


def _ok(wcs, n):
    assert len(wcs) == n, wcs
    assert all(w.status == WCStatus.SUCCESS for w in wcs), [(w.wr_id, w.status) for w in wcs]


@needs_root
def test_jumbo_frames_that_are_not_roce_pass(jumbo):
    """The frags-aware program passes what is not MetaRoCE whatever its size: an 8000-byte
    UDP datagram (one multi-buffer frame, not fragmented: DF set) reaches a plain socket."""
    import socket
    topo, a, b = jumbo
    passed0 = a.ctx.loader.events()["PASSED"]
    with topo.enter(topo[0]):
        rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with topo.enter(topo[2]):
        tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with rx, tx:
        rx.bind(("10.77.0.1", 5791))
        rx.settimeout(2.0)
        tx.setsockopt(socket.IPPROTO_IP, 10, 2)          # IP_MTU_DISCOVER = IP_PMTUDISC_DO: no IP fragments
        payload = bytes(range(250)) * 32
        tx.sendto(payload, ("10.77.0.1", 5791))
        data, _ = rx.recvfrom(9000)
    assert data == payload
    assert a.ctx.loader.events()["PASSED"] >= passed0 + 1


@needs_root
def test_capture_decodes_with_good_icrcs(jumbo):
    """What the switch saw decodes as RoCEv2 in `metaroce decode` and in tshark, with good
    ICRCs, 4096-byte payloads included."""
    topo, a, b = jumbo
    cap, cap_path = jumbo.capture.proc, jumbo.capture.path
    a.buf[:8192] = np.arange(8192, dtype=np.uint8)
    a.qp.post_send([SendWR(wr_id=7, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 8192)],
                           remote_addr=b.mr.addr, rkey=b.mr.rkey)])
    _ok(wait_wcs([a, b], a, 1, timeout=30), 1)
    cap.terminate()
    cap.wait(timeout=10)
    r = subprocess.run([sys.executable, "-m", "metaroce_xdp.cli", "decode", "--json", "--strict", cap_path],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    pkts = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    big = [p for p in pkts if p["payload_len"] == 4096]
    assert big and all(p["icrc_ok"] for p in pkts)
    tshark = shutil.which("tshark")
    assert tshark, "tshark is installed by make setup"
    t = subprocess.run([tshark, "-r", cap_path, "-T", "fields", "-e", "frame.len", "-e", "frame.protocols",
                        "-e", "infiniband.invariant.crc"], capture_output=True, text=True, timeout=120)
    assert t.returncode == 0, t.stderr
    rows = [ln.split("\t") for ln in t.stdout.splitlines() if ln.strip()]
    assert len(rows) == len(pkts)
    assert all(r[1].startswith("eth:ethertype:ip:udp:infiniband") for r in rows), {r[1] for r in rows}
    assert max(int(r[0]) for r in rows) > 4096 + 58
    # tshark reads the same ICRC field (as a big-endian number; the wire order is LSB first, MR-ICRC-010).
    # Its heuristic payload dissectors take a few tiny payloads for other protocols and then show no
    # ICRC; every full-size frame has one.
    same = [int(r[2], 16) == int.from_bytes(bytes.fromhex(p["icrc"]), "little") for r, p in zip(rows, pkts) if r[2]]
    assert all(same) and len(same) >= len(rows) - 8
    assert all(r[2] for r in rows if int(r[0]) > 4096)


@needs_root
def test_mtu_1500_keeps_single_buffer_path(make_fabric):
    """At MTU 1500 nothing changes: no XDP_USE_SG, one descriptor per frame, path MTU 4096
    refused as more than the interface carries, and a 64 KiB WRITE at 1024 works (one side's
    program in generic (SKB) mode: the bpf_link keeps the mode choice)."""
    topo = make_fabric("flat", side=None).topo
    a = b = None
    try:
        a = Side(topo, topo[0], "mr0", 1 << 17, qp=True, xdp_mode="skb")
        assert a.ctx.loader._mode.value == "skb"
        b = Side(topo, topo[1], "mr1", 1 << 17, qp=True)
        for p in (a, b):
            assert not p.ctx.port.sg and not p.ctx.port.xsk.bind_flags & 0x10
            assert p.ctx.port.max_pmtu == 1024 and p.ctx.port.frame_limit == 4096
        with topo.enter(a.ns):
            a.qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
            with pytest.raises(InvalidArgument, match="path_mtu 4096 exceeds what mr0 carries"):
                a.qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=b.qp.qp_num, rq_psn=0x100, path_mtu=4096,
                                   dgid=b.ctx.gid))
        a.new_qp()
        a.connect(b, rd_atomic=4)
        b.connect(a, rd_atomic=4)
        a.fill(3)
        a.qp.post_send([SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 1 << 16)],
                               remote_addr=b.mr.addr, rkey=b.mr.rkey)])
        _ok(wait_wcs([a, b], a, 1, timeout=30), 1)
        assert np.array_equal(a.buf[:1 << 16], b.buf[:1 << 16])
        assert all(p.ctx.plane.A[L.P_SG] == 0 for p in (a, b))       # the loop's single-buffer path
        assert b.ctx.stats()["rx_sg"] == 0 and b.ctx.stats()["rx_sg_long"] == 0
    finally:
        for p in (a, b):
            if p is not None:
                p.close()
