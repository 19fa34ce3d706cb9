"""MR deregistration while a WRITE, a READ or a duplicate READ is in flight (MR-MEM-033, MR-MEM-034), on
two compiled-plane endpoints (dp_loop: A mr0 -- switch -- B mr1, real XDP and AF_XDP).

After `ibv_dereg_mr` returns, no packet reads or writes the MR's memory: the next packet of a
multi-packet WRITE, the rest of a READ response stream and a duplicate READ replayed after the
deregistration all end in NAK code 2 (remote access error) and the responder's QP in ERR; the
requester completes the WR with IBV_WC_REM_ACCESS_ERR.  dereg_mr pauses the responder's loop, so it
cannot return while a packet is being placed or read (MR-MEM-034) -- the last cases run B's loop on
its progress thread while the test deregisters from its own thread.

Each case checks memory byte for byte:
* WRITE: the responder's buffer after the transfer ended equals its snapshot taken when dereg_mr
  returned; that snapshot is whole path-MTU chunks of the requester's data from the start (exactly
  what the responder had placed) followed by the original bytes;
* READ: the responder's source is overwritten right after the deregistration; the requester's
  buffer holds a prefix of whole chunks of the *old* data (no more than was sent before the
  deregistration) and its original bytes after -- never a byte read after the deregistration;
* duplicate READ: every response of the first execution is lost (the switch drops READ RESPONSEs
  towards A), the MR is deregistered, the requester's retry is a duplicate READ: NAK code 2 with the
  duplicate's PSN, no response, the requester's buffer untouched.

Rounds driven by the test, B taking a few packets a round (its loop's budget), the frames B sent captured
on the switch and decoded; also with a new MR registered over the same memory right after the
deregistration: its new key does not revive the old one.
"""
from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest

from dp_players import FULL, run_until, wait_wcs
from metaroce_xdp.dp import layout as L
from metaroce_xdp.faults import FaultInjector
from metaroce_xdp.verbs_types import QPState, SendWR, WCStatus, WROpcode
from metaroce_xdp.wire import Op, decode
from wire_players import PortTap, is_roce_v4

pytestmark = pytest.mark.netns

MTU = 1024
PSN = 100                                # dp_loop's first PSN
NAK_REM_ACCESS = 0x62                    # AETH: NAK, code 2 (MR-NAK-007)
RSP_OPS = (Op.RDMA_READ_RESPONSE_FIRST, Op.RDMA_READ_RESPONSE_MIDDLE, Op.RDMA_READ_RESPONSE_LAST,
           Op.RDMA_READ_RESPONSE_ONLY)


def chunks_prefix(got: np.ndarray, new: np.ndarray, old: np.ndarray, mtu: int = MTU) -> int:
    """`got` must be whole mtu-sized chunks of `new` from the start, then `old` up to the end (chunks
    of random data never match both).  Returns the number of bytes taken from `new`."""
    n = got.size
    k = 0
    while k < n and np.array_equal(got[k:k + mtu], new[k:k + mtu]):
        k += min(mtu, n - k)
    assert np.array_equal(got[k:], old[k:]), f"bytes at {k + np.flatnonzero(got[k:] != old[k:])[:8]} are neither"
    return k


@contextlib.contextmanager
def budget(side, n: int):
    """`side`'s loop handles at most n packets a round (received, and READ responses sent)."""
    A = side.ctx.plane.A
    old = int(A[L.P_BUDGET])
    A[L.P_BUDGET] = n
    try:
        yield
    finally:
        A[L.P_BUDGET] = old


def _from_b(tap, a):
    """B's frames to A's QP the tap saw since the last call: (ACK PSN, syndrome) list, READ RESPONSEs."""
    pkts = [decode(f) for f, towards_a in tap.raw(is_roce_v4) if towards_a]
    pkts = [p for p in pkts if p.bth.dest_qp == a.qp.qp_num]
    return ([(p.bth.psn, p.ext["aeth"].syndrome) for p in pkts if p.bth.opcode == Op.ACKNOWLEDGE],
            [p for p in pkts if p.bth.opcode in RSP_OPS])


def _fill(a, b, seed):
    rng = np.random.default_rng(seed)
    a.buf[:] = rng.integers(0, 256, a.buf.size, dtype=np.uint8)
    b.buf[:] = rng.integers(0, 256, b.buf.size, dtype=np.uint8)
    return a.buf.copy(), b.buf.copy()


@pytest.fixture
def tap(dp_loop):
    """A capture on the switch's port towards A: what B sends."""
    topo = dp_loop._open().topo
    t = PortTap(topo, topo[1], "swA")
    yield t
    t.close()


def _dereg(b, after):
    old_rkey = b.mr.rkey
    b.ctx.dereg_mr(b.mr)
    if after == "dereg-then-reg":
        assert b.pd.reg_mr(b.buf, FULL).rkey != old_rkey       # MR-MEM-011: a new key


AFTER = ["dereg", "dereg-then-reg"]       # and a new MR over the same memory at once


@pytest.mark.parametrize("after", AFTER)
def test_write_in_flight(dp_loop, tap, after):
    a, b = dp_loop(size=1 << 20, mtu=MTU)
    n = 64 * MTU
    a0, b0 = _fill(a, b, 1)
    rx0 = b.ctx.stats()["rx"]
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, n)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    a.ctx.progress()                                   # the whole message leaves A
    with budget(b, 16):
        run_until([b], lambda: b.ctx.stats()["rx"] > rx0)      # B places the first packets, 16 at most
    placed = chunks_prefix(b.buf[:n], a0[:n], b0[:n])
    assert 0 < placed <= 16 * MTU
    epsn = b.qp.query()["rq_psn"]
    assert epsn == PSN + placed // MTU
    _from_b(tap, a)
    _dereg(b, after)
    snap = b.buf.copy()
    (wc,) = wait_wcs([a, b], a, 1)
    assert wc.status == WCStatus.REM_ACCESS_ERR
    assert np.array_equal(b.buf, snap)                 # nothing written after dereg_mr returned
    assert chunks_prefix(b.buf[:n], a0[:n], b0[:n]) == placed and np.array_equal(b.buf[n:], b0[n:])
    naks, _ = _from_b(tap, a)
    assert naks[-1:] == [(epsn, NAK_REM_ACCESS)]       # at the first packet after the deregistration
    assert b.qp.query_state() == QPState.ERR and a.qp.query_state() == QPState.ERR


@pytest.mark.parametrize("after", AFTER)
def test_read_in_flight(dp_loop, tap, after):
    a, b = dp_loop(size=1 << 20, mtu=MTU)
    n = 64 * MTU
    a0, b0 = _fill(a, b, 2)
    tx0 = b.ctx.stats()["tx"]
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(4096, n)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    a.ctx.progress()                                   # the READ REQUEST leaves (PSN 100)
    with budget(b, 8):
        run_until([b], lambda: b.ctx.stats()["tx"] > tx0)      # the first responses leave, 8 at most
    before = b.ctx.stats()["tx"] - tx0
    assert 0 < before < 64
    time.sleep(0.05)                                   # they reach the switch before the tap is read
    _, rsps = _from_b(tap, a)
    assert len(rsps) == before
    _dereg(b, after)
    b.buf[:n] = 0xA5                                   # what a later response would now carry
    (wc,) = wait_wcs([a, b], a, 1)
    assert wc.status == WCStatus.REM_ACCESS_ERR
    assert b.ctx.stats()["tx"] - tx0 == before + 1     # the NAK, no more responses
    naks, rsps = _from_b(tap, a)
    assert rsps == [] and naks == [(PSN, NAK_REM_ACCESS)]     # the READ REQUEST's PSN (MR-MEM-033)
    k = chunks_prefix(a.buf[4096:4096 + n], b0[:n], a0[4096:4096 + n])
    assert k <= before * MTU
    assert np.array_equal(a.buf[:4096], a0[:4096]) and np.array_equal(a.buf[4096 + n:], a0[4096 + n:])
    assert b.qp.query_state() == QPState.ERR and a.qp.query_state() == QPState.ERR


def test_duplicate_read_in_flight(dp_loop, tap):
    """The switch loses every READ RESPONSE towards A; once B has answered, its MR goes and the switch
    stops losing: A's retried READ is a duplicate at B, answered by NAK code 2 with its PSN, no response."""
    a, b = dp_loop(size=1 << 20, mtu=MTU, timeout=8)
    n = 8 * MTU + 100
    a0, b0 = _fill(a, b, 3)
    topo = a.topo
    st0 = b.ctx.stats()
    with FaultInjector("swA", netns=topo[1], drop_ppm=1_000_000, opcode_filter=[int(o) for o in RSP_OPS]) as fi:
        a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(0, n)],
                              remote_addr=b.mr.addr + 512, rkey=b.mr.rkey))
        run_until([a, b], lambda: b.ctx.stats()["tx"] - st0["tx"] >= 9)     # answered once: nine responses
        b.ctx.dereg_mr(b.mr)
        sent, dups = b.ctx.stats()["tx"], b.ctx.stats()["rx_dup"]
        fi.update(drop_ppm=0)
        time.sleep(0.05)
        _from_b(tap, a)
        (wc,) = wait_wcs([a, b], a, 1, timeout=30)
        dropped = fi.stats()["dropped"]
    assert wc.status == WCStatus.REM_ACCESS_ERR
    assert dropped >= 9                                # the first execution's nine responses
    assert b.ctx.stats()["rx_dup"] > dups and b.ctx.stats()["tx"] == sent + 1     # the duplicate read nothing
    naks, rsps = _from_b(tap, a)
    assert rsps == [] and naks == [(PSN, NAK_REM_ACCESS)]     # the duplicate's PSN
    assert np.array_equal(a.buf, a0) and np.array_equal(b.buf, b0)
    assert b.qp.query_state() == QPState.ERR and a.qp.query_state() == QPState.ERR


# ---- B's loop on its progress thread, dereg_mr from the test's thread (MR-MEM-034) ------------------

@contextlib.contextmanager
def threaded(side):
    side.ctx.plane.start(busy=True)
    try:
        yield
    finally:
        side.ctx.plane.stop()


def test_write_in_flight_racing_the_progress_thread(dp_loop):
    a, b = dp_loop(size=8 << 20, mtu=MTU, timeout=14)
    n = 6 << 20
    a0, b0 = _fill(a, b, 4)
    state = {}
    with threaded(b):
        a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, n)],
                              remote_addr=b.mr.addr, rkey=b.mr.rkey))

        def dereg_mid_stream():
            if int(b.qp.query()["rq_psn"]) - PSN > 0:       # B placed some of it: deregister now
                b.ctx.dereg_mr(b.mr)
                state["snap"] = b.buf.copy()
                return True
            return False

        run_until([a], dereg_mid_stream, timeout=30)
        (wc,) = wait_wcs([a], a, 1, timeout=30)
        time.sleep(0.05)                               # anything still on the wire reaches B's thread
    assert wc.status == WCStatus.REM_ACCESS_ERR
    assert np.array_equal(b.buf, state["snap"])        # not one byte after dereg_mr returned
    placed = chunks_prefix(b.buf[:n], a0[:n], b0[:n])
    print("placed before dereg_mr:", placed)
    assert 0 < placed < n, "the WRITE was not in flight when the test deregistered"
    assert np.array_equal(b.buf[n:], b0[n:])
    assert b.qp.query_state() == QPState.ERR and a.qp.query_state() == QPState.ERR


def test_read_in_flight_racing_the_progress_thread(dp_loop):
    a, b = dp_loop(size=8 << 20, mtu=MTU, timeout=14)
    n = 6 << 20
    a0, b0 = _fill(a, b, 5)
    state = {}
    st0 = b.ctx.stats()
    tx0, nak0 = st0["tx"], st0["tx_nak"]
    with budget(b, 64), threaded(b):                   # a slower stream: the test's thread sees it start
        a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(1 << 20, n)],
                              remote_addr=b.mr.addr, rkey=b.mr.rkey))

        def dereg_mid_stream():
            if b.ctx.stats()["tx"] > tx0:
                b.ctx.dereg_mr(b.mr)
                st = b.ctx.stats()                     # B's thread runs on: its NAK may already be counted
                state["sent"], state["nak"] = st["tx"] - tx0, st["tx_nak"]
                b.buf[:n] = 0xA5                       # what a response read now would carry
                return True
            return False

        run_until([a], dereg_mid_stream, timeout=30)
        (wc,) = wait_wcs([a], a, 1, timeout=30)
        st = b.ctx.stats()
        after = st["tx"] - tx0
    assert wc.status == WCStatus.REM_ACCESS_ERR
    assert st["tx_nak"] - nak0 == 1                    # one NAK (code 2) ...
    assert after - state["sent"] == st["tx_nak"] - state["nak"]   # ... and no response after dereg_mr returned
    k = chunks_prefix(a.buf[1 << 20:(1 << 20) + n], b0[:n], a0[1 << 20:(1 << 20) + n])
    print("sent before dereg_mr:", state["sent"], "placed at A:", k)
    assert k <= state["sent"] * MTU and state["sent"] < n // MTU
    assert np.array_equal(a.buf[:1 << 20], a0[:1 << 20]) and np.array_equal(a.buf[(1 << 20) + n:], a0[(1 << 20) + n:])
    assert b.qp.query_state() == QPState.ERR and a.qp.query_state() == QPState.ERR
