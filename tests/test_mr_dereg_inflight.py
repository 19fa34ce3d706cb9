"""MR deregistration while a WRITE, a READ or a duplicate READ is in flight (MR-MEM-033, MR-MEM-034).

After `ibv_dereg_mr` returns, no packet reads or writes the MR's memory: the next packet of a
multi-packet WRITE, the rest of a READ response stream and a duplicate READ replayed after the
deregistration all end in NAK code 2 (remote access error) and the responder's QP in ERR; the
requester completes the WR with IBV_WC_REM_ACCESS_ERR.  dereg_mr takes the engine lock, so it cannot
return while a packet is being placed or read (MR-MEM-034) -- over veth the responder runs its
progress thread while the test deregisters from its own thread.

Each case checks memory byte for byte:
* WRITE: the responder's buffer after the transfer ended equals its snapshot taken when dereg_mr
  returned; that snapshot is whole path-MTU chunks of the requester's data from the start (exactly
  what the responder had placed) followed by the original bytes;
* READ: the responder's source is overwritten right after the deregistration; the requester's
  buffer holds a prefix of whole chunks of the *old* data (no more than was sent before the
  deregistration) and its original bytes after -- never a byte read after the deregistration;
* duplicate READ: every response of the first execution is lost, the MR is deregistered, the
  requester's retry is a duplicate READ: NAK code 2 with the duplicate's PSN, no response, the
  requester's buffer untouched.

In process (LoopPort pairs, both the burst and the per-packet path, frames B sent recorded and
decoded; also with a new MR registered over the same memory right after the deregistration: its
new key does not revive the old one) and over veth through the real XDP program and AF_XDP sockets (a switch namespace whose
fault injector loses the READ responses for the duplicate case).
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from metaroce_xdp.verbs_types import QPState
from metaroce_xdp.wire import Op, decode
from rc_players import FULL, Faults, SendWR, VethPlayer, WCStatus, WROpcode, loop_pair, run_until, wait_wcs

MTU = 1024
NAK_REM_ACCESS = 0x62                    # AETH: NAK, code 2 (MR-NAK-007)
MODES = {"burst": True, "per-packet": False}


def chunks_prefix(got: np.ndarray, new: np.ndarray, old: np.ndarray, mtu: int = MTU) -> int:
    """`got` must be whole mtu-sized chunks of `new` from the start, then `old` up to the end (chunks
    of random data never match both).  Returns the number of bytes taken from `new`."""
    n = got.size
    k = 0
    while k < n and np.array_equal(got[k:k + mtu], new[k:k + mtu]):
        k += min(mtu, n - k)
    assert np.array_equal(got[k:], old[k:]), f"bytes at {k + np.flatnonzero(got[k:] != old[k:])[:8]} are neither"
    return k


def _record_tx(port):
    """Frames `port` sends from now on (LoopPort: every frame passes tx_commit)."""
    frames = []
    orig = port.tx_commit

    def tx_commit(off, length):
        frames.append(bytes(port._scratch[off:off + length]))
        orig(off, length)

    port.tx_commit = tx_commit
    return frames


def _acks(frames):
    pkts = [decode(f) for f in frames]
    return ([(p.bth.psn, p.ext["aeth"].syndrome) for p in pkts if p.bth.opcode == Op.ACKNOWLEDGE],
            [p for p in pkts if Op.RDMA_READ_RESPONSE_FIRST <= p.bth.opcode <= Op.RDMA_READ_RESPONSE_ONLY])


def _fill(a, b, seed):
    rng = np.random.default_rng(seed)
    a.buf[:] = rng.integers(0, 256, a.buf.size, dtype=np.uint8)
    b.buf[:] = rng.integers(0, 256, b.buf.size, dtype=np.uint8)
    return a.buf.copy(), b.buf.copy()


# ------------------------------------------------------------------------------------------ in process

AFTER = ["dereg", "dereg-then-reg"]       # and a new MR over the same memory at once (MR-MEM-011: a new key)


@pytest.mark.parametrize("after", AFTER)
@pytest.mark.parametrize("mode", MODES)
def test_write_in_flight(mode, after):
    a, b = loop_pair(size=1 << 20, mtu=MTU, burst=MODES[mode])
    n = 64 * MTU
    a0, b0 = _fill(a, b, 1)
    b.ctx.engine.budget, b.ctx.engine.rx_bursts = 16, 1    # B takes 16 frames a round
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, n)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    a.ctx.engine.progress()                            # the whole window leaves A
    b.ctx.engine.progress()                            # B places the first 16 packets
    r = b.qp.responder
    assert r.bytes_received == 16 * MTU and r.in_progress
    epsn = r.epsn
    sent = _record_tx(b.ctx.port)
    old_rkey = b.mr.rkey
    b.ctx.dereg_mr(b.mr)
    if after == "dereg-then-reg":
        assert b.pd.reg_mr(b.buf, FULL).rkey != old_rkey
    snap = b.buf.copy()
    (wc,) = wait_wcs([a, b], a, 1)
    assert wc.status == WCStatus.REM_ACCESS_ERR
    assert np.array_equal(b.buf, snap)                 # nothing written after dereg_mr returned
    assert chunks_prefix(b.buf[:n], a0[:n], b0[:n]) == 16 * MTU and np.array_equal(b.buf[n:], b0[n:])
    assert r.bytes_received == 16 * MTU
    naks, _ = _acks(sent)
    assert naks[-1:] == [(epsn, NAK_REM_ACCESS)]       # at the first packet after the deregistration
    assert b.qp.state == QPState.ERR and a.qp.state == QPState.ERR
    if MODES[mode]:
        assert b.ctx.engine.stats["rx_burst"] > 0      # the compiled placer ran before, and stood aside after


@pytest.mark.parametrize("after", AFTER)
@pytest.mark.parametrize("mode", MODES)
def test_read_in_flight(mode, after):
    a, b = loop_pair(size=1 << 20, mtu=MTU, burst=MODES[mode])
    n = 64 * MTU
    a0, b0 = _fill(a, b, 2)
    b.ctx.engine.budget = 8                            # eight responses a round
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(4096, n)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    a.ctx.engine.progress()                            # the READ REQUEST leaves (PSN 100)
    b.ctx.engine.progress()                            # the first responses leave
    r = b.qp.responder
    before = r.bytes_sent
    assert 0 < before < n
    sent = _record_tx(b.ctx.port)
    old_rkey = b.mr.rkey
    b.ctx.dereg_mr(b.mr)
    if after == "dereg-then-reg":
        assert b.pd.reg_mr(b.buf, FULL).rkey != old_rkey
    b.buf[:n] = 0xA5                                   # what a later response would now carry
    (wc,) = wait_wcs([a, b], a, 1)
    assert wc.status == WCStatus.REM_ACCESS_ERR
    assert r.bytes_sent == before
    naks, rsps = _acks(sent)
    assert rsps == [] and naks == [(100, NAK_REM_ACCESS)]     # the READ REQUEST's PSN (MR-MEM-033)
    k = chunks_prefix(a.buf[4096:4096 + n], b0[:n], a0[4096:4096 + n])
    assert k <= before
    assert np.array_equal(a.buf[:4096], a0[:4096]) and np.array_equal(a.buf[4096 + n:], a0[4096 + n:])
    assert b.qp.state == QPState.ERR and a.qp.state == QPState.ERR


@pytest.mark.parametrize("mode", MODES)
def test_duplicate_read_in_flight(mode):
    """Every response of the first execution is lost; the MR goes; the retried READ is a duplicate."""
    lose = Faults(drop=1.0)
    a, b = loop_pair(None, lose, size=1 << 20, mtu=MTU, burst=MODES[mode], timeout=8)
    n = 8 * MTU + 100
    a0, b0 = _fill(a, b, 3)
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(0, n)],
                          remote_addr=b.mr.addr + 512, rkey=b.mr.rkey))
    r = b.qp.responder
    run_until([a, b], lambda: r.bytes_sent == n)       # answered once, every response lost
    dups = r.dup_requests
    b.ctx.dereg_mr(b.mr)
    lose.drop = 0.0                                    # from now on B's frames arrive
    sent = _record_tx(b.ctx.port)
    (wc,) = wait_wcs([a, b], a, 1)
    assert wc.status == WCStatus.REM_ACCESS_ERR
    assert r.dup_requests > dups and r.bytes_sent == n  # the duplicate read nothing
    naks, rsps = _acks(sent)
    assert rsps == [] and naks == [(100, NAK_REM_ACCESS)]     # the duplicate's PSN
    assert np.array_equal(a.buf, a0) and np.array_equal(b.buf, b0)
    assert b.qp.state == QPState.ERR and a.qp.state == QPState.ERR


# ------------------------------------------------------------------------------------------ over veth

@pytest.fixture(scope="module")
def fabric():
    if os.geteuid() != 0:
        pytest.fail("needs root for namespaces, XDP and AF_XDP")
    from metaroce_xdp.rc.engine import Context
    from metaroce_xdp.topo import switched_hosts
    topo, _, _ = switched_hosts(prefix="mrdereg")
    ps = []
    try:
        with topo.enter(topo[0]):
            ps.append(VethPlayer(topo, topo[0], Context.open("mr0"), size=8 << 20))
        with topo.enter(topo[2]):
            # B on its progress thread: dereg_mr from the test's thread races real packet handling (MR-MEM-034)
            ps.append(VethPlayer(topo, topo[2], Context.open("mr1", progress_thread=True), size=8 << 20))
        yield topo, ps[0], ps[1]
    finally:
        for p in ps:
            p.ctx.close()
        topo.close()


def _fresh(fabric, timeout=14):
    topo, a, b = fabric
    for p in (a, b):
        with p.ctx.engine.lock:
            if p.mr is not None and not p.mr.valid:
                p.mr = p.pd.reg_mr(p.buf, FULL)        # the last case deregistered it
            p.cq.q.clear()
            p.new_qp()
    a.connect(b, timeout=timeout)
    b.connect(a, timeout=timeout)
    return a, b


def _drive_until(a, cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        a.ctx.engine.progress()
        assert time.monotonic() < deadline, (a.qp.query(), )


@pytest.mark.netns
def test_write_in_flight_over_veth(fabric):
    a, b = _fresh(fabric)
    n = 6 << 20
    a0, b0 = _fill(a, b, 4)
    r = b.qp.responder
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, n)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    state = {}

    def dereg_mid_stream():
        if 0 < r.bytes_received < n // 2:
            with b.ctx.engine.lock:                    # B's thread is between packets here
                if 0 < r.bytes_received < n:
                    state["placed"] = r.bytes_received
                    b.ctx.dereg_mr(b.mr)
                    state["snap"] = b.buf.copy()
                    return True
        return r.bytes_received >= n // 2               # too late: reported below

    _drive_until(a, dereg_mid_stream)
    assert "placed" in state, "the WRITE was past half way before the test could deregister"
    print("placed before dereg_mr:", state["placed"])
    (wc,) = wait_wcs([a], a, 1, timeout=30)
    assert wc.status == WCStatus.REM_ACCESS_ERR
    time.sleep(0.05)                                   # anything still on the wire reaches B's thread
    assert np.array_equal(b.buf, state["snap"])        # not one byte after dereg_mr returned
    assert chunks_prefix(b.buf[:n], a0[:n], b0[:n]) == state["placed"] == r.bytes_received
    assert np.array_equal(b.buf[n:], b0[n:])
    assert b.qp.state == QPState.ERR and a.qp.state == QPState.ERR


@pytest.mark.netns
def test_read_in_flight_over_veth(fabric):
    a, b = _fresh(fabric)
    n = 6 << 20
    a0, b0 = _fill(a, b, 5)
    r = b.qp.responder
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(1 << 20, n)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    state = {}

    def dereg_mid_stream():
        if 0 < r.bytes_sent < n // 2:
            with b.ctx.engine.lock:
                if 0 < r.bytes_sent < n:
                    state["sent"] = r.bytes_sent
                    b.ctx.dereg_mr(b.mr)
                    b.buf[:n] = 0xA5                   # what a response read now would carry
                    return True
        return r.bytes_sent >= n // 2

    budget, b.ctx.engine.budget = b.ctx.engine.budget, 64     # a slower stream: the test's thread sees it start
    try:
        _drive_until(a, dereg_mid_stream)
    finally:
        b.ctx.engine.budget = budget
    assert "sent" in state, "the READ was past half way before the test could deregister"
    print("sent before dereg_mr:", state["sent"])
    (wc,) = wait_wcs([a], a, 1, timeout=30)
    assert wc.status == WCStatus.REM_ACCESS_ERR
    assert r.bytes_sent == state["sent"]
    k = chunks_prefix(a.buf[1 << 20:(1 << 20) + n], b0[:n], a0[1 << 20:(1 << 20) + n])
    assert k <= state["sent"]
    assert np.array_equal(a.buf[:1 << 20], a0[:1 << 20]) and np.array_equal(a.buf[(1 << 20) + n:], a0[(1 << 20) + n:])
    assert b.qp.state == QPState.ERR and a.qp.state == QPState.ERR


@pytest.mark.netns
def test_duplicate_read_in_flight_over_veth(fabric):
    """The switch loses every READ RESPONSE towards A (tc fault injector on its port swA); once B has
    answered, its MR goes and the switch stops losing: A's retried READ is a duplicate at B."""
    from metaroce_xdp.faults import FaultInjector
    topo = fabric[0]
    a, b = _fresh(fabric, timeout=12)                  # 16.8 ms local ACK timeout
    n = 8 * MTU + 100
    a0, b0 = _fill(a, b, 6)
    r = b.qp.responder
    rsp_ops = [Op.RDMA_READ_RESPONSE_FIRST, Op.RDMA_READ_RESPONSE_MIDDLE, Op.RDMA_READ_RESPONSE_LAST,
               Op.RDMA_READ_RESPONSE_ONLY]
    with FaultInjector("swA", netns=topo[1], drop_ppm=1_000_000, opcode_filter=[int(o) for o in rsp_ops]) as fi:
        a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(0, n)],
                              remote_addr=b.mr.addr + 512, rkey=b.mr.rkey))
        _drive_until(a, lambda: r.bytes_sent >= n)
        with b.ctx.engine.lock:
            sent, dups = r.bytes_sent, r.dup_requests
            b.ctx.dereg_mr(b.mr)
            fi.update(drop_ppm=0)
        (wc,) = wait_wcs([a], a, 1, timeout=30)
        dropped = fi.stats()
    print("fault injector:", dropped["dropped"], "dropped; duplicates at B:", r.dup_requests - dups)
    assert wc.status == WCStatus.REM_ACCESS_ERR
    assert dropped["dropped"] >= 9, dropped           # at least the first execution's nine responses
    assert r.dup_requests > dups and r.bytes_sent == sent     # the duplicate read nothing
    assert np.array_equal(a.buf, a0)                    # no response reached A
    assert b.qp.state == QPState.ERR and a.qp.state == QPState.ERR
