"""The responder's compat rules checked packet by packet (spec 03 Table 3-4, MR-DUP, MR-MEM-033), on the
compiled plane.

Crafted request packets (the reference codec) come from a scripted requester -- a raw socket in the other
namespace, nothing there answers but the script (tests/scripted_players.py) -- to a responder QP of the
compiled plane (real XDP program, AF_XDP socket); what it answers is read off the wire in the order it left:
with which PSN and syndrome, and whether any byte of memory left the responder.  Rules that need a real
requester use the dp_loop pairs of tests/dp_players.py.

Elsewhere on the compiled plane: the READ stream cut by a deregistration (MR-MEM-033) is
tests/dp/test_dp_threads.py::test_mr_deregistered_in_the_middle_of_a_read_stream; responses in PSN order
(MR-RC-025) are tests/dp/test_dp_response_order.py.
"""
from __future__ import annotations

import mmap

import numpy as np
import pytest

from dp_players import FULL, wait_wcs
from metaroce_xdp.verbs_types import (InvalidArgument, QPAttr, QPState, RecvWR, SendWR, WCFlags, WCOpcode, WCStatus,
                                      WROpcode)
from metaroce_xdp.wire import AETH, RETH, Op
from metaroce_xdp.wire.headers import IETH, NETH, SACKETH, AtomicETH, ImmDt
from scripted_players import Peer, nak_of, order_of, read_responses
from wire_players import PortTap, is_roce_v4
from metaroce_xdp.wire import decode

pytestmark = [pytest.mark.netns, pytest.mark.fabric(prefix="mrrsp")]

MTU = 1024


@pytest.fixture
def peer(wire):
    """peer(**kw): a fresh responder QP (ePSN 100) facing the scripted requester; closed after the test."""
    made = []

    def make(**kw):
        kw.setdefault("rd_atomic", 4)
        q = Peer(wire, rq_psn=100, sq_psn=0x100, mtu=MTU, **kw)
        made.append(q)
        return q

    yield make
    for q in made:
        q.close()


def _read_once(q, n=3000):
    """The script reads n bytes of q's MR once (PSN 100..102); q keeps the READ among its resources."""
    q.buf[:n] = np.arange(n, dtype=np.uint32).astype(np.uint8) ^ 0x5A
    out = q.inject(Op.RDMA_READ_REQUEST, 100, reth=RETH(va=q.mr.addr, rkey=q.mr.rkey, dma_len=n))
    rr = read_responses(out)
    assert [p.bth.psn for p in rr] == [100, 101, 102]
    assert b"".join(p.payload for p in rr) == bytes(q.buf[:n])
    return n


def _first_responses(q):
    """Rounds until the QP sends something (bounded); what it sent."""
    for _ in range(200):
        got = q.rounds(1)
        if got:
            return got
    return []


def test_duplicate_read_after_dereg_returns_no_memory(peer):
    """MR-MEM-033, MR-DUP-003, MR-MEM-021: a duplicate READ replayed after ibv_dereg_mr is checked again:
    no READ RESPONSE, no byte of the old MR; NAK code 2 with the duplicate's PSN and the QP in ERR."""
    q = peer()
    n = _read_once(q)
    va, rkey = q.mr.addr, q.mr.rkey
    q.mr.dereg()
    for psn, off in ((100, 0), (102, 2 * MTU)):       # from the start, and the re-request of the rest
        out = q.inject(Op.RDMA_READ_REQUEST, psn, reth=RETH(va=va + off, rkey=rkey, dma_len=n - off))
        if psn == 100:
            assert read_responses(out) == [] and not any(p.payload for p in out)
            assert nak_of(out) == [(100, 0x62)]        # NAK code 2, the duplicate's PSN
            assert q.qp.query_state() == QPState.ERR
        else:
            assert out == []                          # in ERR: silent (MR-QP-025)


def test_duplicate_read_after_dereg_with_a_new_mr_at_the_same_place(peer):
    """MR-MEM-033, MR-DUP-003: the saved READ's R_Key is gone; a new MR over the same memory has another
    key, and the duplicate (carrying the old key) still gets no data."""
    q = peer()
    n = _read_once(q)
    old_rkey = q.mr.rkey
    q.mr.dereg()
    q.mr = q.pd.reg_mr(q.buf, FULL)
    assert q.mr.rkey != old_rkey                      # MR-MEM-011: the row's last key never comes again
    out = q.inject(Op.RDMA_READ_REQUEST, 100, reth=RETH(va=q.buf.ctypes.data, rkey=old_rkey, dma_len=n))
    assert read_responses(out) == [] and nak_of(out) == [(100, 0x62)]


@pytest.mark.parametrize("case", ["other_rkey", "before_va", "past_end", "longer", "psn_overflow"])
def test_inconsistent_duplicate_read_is_discarded(peer, case):
    """MR-DUP-003: a duplicate READ must carry the saved R_Key and ask for a range inside the saved one
    (and its responses must fit the saved PSNs); otherwise it is silently discarded -- even when its own
    R_Key is valid for the QP -- counted, and the QP stays in RTS (MR-DUP-001)."""
    q = peer()
    n = _read_once(q)
    other = q.pd.reg_mr(np.full(8192, 0xEE, np.uint8), FULL)   # a valid key the READ never named
    q.extra_mrs = [other]
    va, rkey, psn, ln = q.mr.addr, q.mr.rkey, 100, n
    if case == "other_rkey":
        va, rkey = other.addr, other.rkey
    elif case == "before_va":
        va -= 8
    elif case == "past_end":
        va += 8
    elif case == "longer":
        ln = n + 1
    elif case == "psn_overflow":
        psn = 102                                     # the whole range, but starting at the last PSN
    s0 = q.ctx.stats()
    out = q.inject(Op.RDMA_READ_REQUEST, psn, reth=RETH(va=va, rkey=rkey, dma_len=ln))
    s1 = q.ctx.stats()
    assert out == []
    assert s1["rx_dup_rd_drop"] - s0["rx_dup_rd_drop"] == 1 and s1["rx_dup"] - s0["rx_dup"] == 1
    assert q.qp.query_state() == QPState.RTS


def test_consistent_duplicate_read_is_reexecuted_with_current_memory(peer):
    """MR-DUP-003, MR-DUP-004, MR-ACK-008: a consistent duplicate READ is read again as memory is now,
    from the duplicate's PSN (FIRST ... LAST), the AETHs carrying the current msn."""
    q = peer()
    n = _read_once(q)
    q.buf[:n] = 0x33
    msn = q.qp.query()["msn"]
    s0 = q.ctx.stats()
    out = q.inject(Op.RDMA_READ_REQUEST, 101, reth=RETH(va=q.mr.addr + MTU, rkey=q.mr.rkey, dma_len=n - MTU))
    rr = read_responses(out)
    assert [p.bth.psn for p in rr] == [101, 102]
    assert [p.bth.opcode for p in rr] == [Op.RDMA_READ_RESPONSE_FIRST, Op.RDMA_READ_RESPONSE_LAST]
    assert b"".join(p.payload for p in rr) == b"\x33" * (n - MTU)
    assert all(p.ext["aeth"].msn == msn for p in rr)
    assert q.ctx.stats()["rx_dup"] - s0["rx_dup"] == 1 and q.qp.query_state() == QPState.RTS


def test_write_stream_ends_when_its_mr_is_deregistered(peer):
    """MR-MEM-033: a multi-packet WRITE whose MR is deregistered between packets gets NAK code 2 at the
    next packet and writes nothing more."""
    q = peer()
    out = q.inject(Op.RDMA_WRITE_FIRST, 100, b"\x11" * MTU, reth=RETH(va=q.mr.addr, rkey=q.mr.rkey, dma_len=3 * MTU))
    assert nak_of(out) in ([], [(100, 0x1F)])
    q.mr.dereg()
    out = q.inject(Op.RDMA_WRITE_MIDDLE, 101, b"\x22" * MTU)
    assert nak_of(out) == [(101, 0x62)] and q.qp.query_state() == QPState.ERR
    assert (q.buf[:MTU] == 0x11).all() and not q.buf[MTU:].any()


# ---- Table 3-4: the order of the checks (MR-NAK-014) -------------------------------------------

def test_rnr_before_length_for_send_with_empty_rq(peer):
    """MR-NAK-014, MR-RNR-001: SEND ONLY longer than the path MTU with no receive WQE posted: the receive
    WQE check (row 4) comes before the length check (row 5), so RNR NAK and the QP stays in RTR/RTS."""
    q = peer(min_rnr_timer=3)
    out = q.inject(Op.SEND_ONLY, 100, b"x" * (MTU + 4))
    assert nak_of(out) == [(100, 0x20 | 3)]
    assert q.qp.query_state() == QPState.RTS and q.qp.query()["rq_psn"] == 100
    q.qp.post_recv(RecvWR(wr_id=5, sg_list=[q.sge(0, 4 * MTU)]))
    out = q.inject(Op.SEND_ONLY, 100, b"x" * (MTU + 4))
    assert nak_of(out) == [(100, 0x61)]               # now the length: invalid request
    (wc,) = q.cq.poll(4)
    assert (wc.wr_id, wc.status) == (5, WCStatus.REM_INV_REQ_ERR)   # the receive WQE in use (Table 7-6)


@pytest.mark.parametrize("bad", ["rkey", "length"])
def test_write_with_imm_rnr_first(peer, bad):
    """MR-NAK-014: RDMA WRITE ONLY WITH IMMEDIATE with an empty receive queue gets an RNR NAK even when its
    R_Key or its length is bad (row 4 before rows 5 and 6); with a receive WQE posted the bad length is an
    invalid request and the bad R_Key a remote access error, the WQE completing with
    IBV_WC_LOC_ACCESS_ERR (Table 7-6) and no memory written."""
    q = peer(min_rnr_timer=2)
    rkey = q.mr.rkey ^ 1 if bad == "rkey" else q.mr.rkey
    dma_len = 8 if bad == "rkey" else 16
    hdr = dict(reth=RETH(va=q.mr.addr, rkey=rkey, dma_len=dma_len), immdt=ImmDt(imm=7))
    out = q.inject(Op.RDMA_WRITE_ONLY_WITH_IMMEDIATE, 100, b"y" * 8, **hdr)
    assert nak_of(out) == [(100, 0x22)] and q.qp.query_state() == QPState.RTS
    q.qp.post_recv(RecvWR(wr_id=6, sg_list=[q.sge(0, 8)]))
    out = q.inject(Op.RDMA_WRITE_ONLY_WITH_IMMEDIATE, 100, b"y" * 8, **hdr)
    assert nak_of(out) == [(100, 0x62 if bad == "rkey" else 0x61)]
    (wc,) = q.cq.poll(4)
    assert wc.wr_id == 6
    assert wc.status == (WCStatus.LOC_ACCESS_ERR if bad == "rkey" else WCStatus.REM_INV_REQ_ERR)
    assert not q.buf.any()


def test_write_length_before_rkey(peer):
    """MR-NAK-014: a WRITE ONLY whose payload does not match its DMA Length (row 5, MR-RC-011) and whose R_Key
    is bad (row 6) fails both checks, the one exception to the order: NAK code 1 or code 2, the QP in ERR
    either way, and nothing written."""
    q = peer()
    out = q.inject(Op.RDMA_WRITE_ONLY, 100, b"z" * 8, reth=RETH(va=q.mr.addr, rkey=q.mr.rkey ^ 1, dma_len=12))
    assert nak_of(out) in ([(100, 0x61)], [(100, 0x62)]) and not q.buf.any()
    assert q.qp.query_state() == QPState.ERR


@pytest.mark.parametrize("op", [Op.RDMA_READ_REQUEST, Op.RDMA_WRITE_FIRST])
def test_dma_length_above_2_31_is_invalid_request(peer, op):
    """MR-XH-004, MR-NAK-006 (d), MR-SEC-013: a DMA Length above 2^31 is an invalid request on its own,
    even for an R_Key whose MR would cover it (NAK code 1, not 2), and nothing is read or written."""
    q = peer()
    # an MR larger than 2^31 bytes (anonymous memory: untouched pages cost nothing)
    huge = np.frombuffer(mmap.mmap(-1, (1 << 31) + 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), np.uint8)
    big = q.pd.reg_mr(huge, FULL)
    q.extra_mrs = [big]
    payload = b"w" * MTU if op == Op.RDMA_WRITE_FIRST else b""
    out = q.inject(op, 100, payload, reth=RETH(va=big.addr, rkey=big.rkey, dma_len=(1 << 31) + 1))
    assert read_responses(out) == []
    assert nak_of(out) == [(100, 0x61)] and q.qp.query_state() == QPState.ERR
    assert not huge[:2 * MTU].any()


def test_dma_length_of_exactly_2_31_is_not_a_length_error(peer):
    """MR-XH-004: 2^31 itself is allowed; a READ of 2^31 bytes from a small MR fails the bounds (code 2)."""
    q = peer()
    out = q.inject(Op.RDMA_READ_REQUEST, 100, reth=RETH(va=q.mr.addr, rkey=q.mr.rkey, dma_len=1 << 31))
    assert nak_of(out) == [(100, 0x62)]


@pytest.mark.parametrize("op", [Op.RDMA_READ_REQUEST, Op.FETCH_ADD])
def test_read_or_atomic_with_max_dest_rd_atomic_0_is_invalid_request(peer, op):
    """MR-DUP-007, MR-NAK-006 (f), MR-SEC-012: with max_dest_rd_atomic 0 a READ or an ATOMIC is an invalid
    request, and nothing is written."""
    q = peer(rd_atomic=0)
    hdr = (dict(reth=RETH(va=q.mr.addr, rkey=q.mr.rkey, dma_len=8)) if op == Op.RDMA_READ_REQUEST
           else dict(atomiceth=AtomicETH(va=q.mr.addr, rkey=q.mr.rkey, swap_add=1, compare=0)))
    out = q.inject(op, 100, **hdr)
    assert nak_of(out) == [(100, 0x61)] and not q.buf.any()


def test_read_beyond_responder_resources(peer):
    """MR-DUP-007, MR-NAK-006 (f), MR-RC-025: with max_dest_rd_atomic 1, a second READ while the first one's
    responses are still queued is an invalid request; its NAK leaves after the first READ's responses."""
    q = peer(rd_atomic=1, budget=2)
    q.send([(Op.RDMA_READ_REQUEST, 100, b"", dict(reth=RETH(va=q.mr.addr, rkey=q.mr.rkey, dma_len=8 * MTU)))])
    out = _first_responses(q)
    assert len(read_responses(out)) == 2                # six responses still to send
    q.send([(Op.RDMA_READ_REQUEST, 108, b"", dict(reth=RETH(va=q.mr.addr, rkey=q.mr.rkey, dma_len=8)))])
    out += q.rounds()
    assert q.qp.query_state() == QPState.ERR
    assert len(read_responses(out)) == 8 and nak_of(out) == [(108, 0x61)] and out[-1].bth.psn == 108


def test_read_response_aeth_carries_the_current_msn(peer):
    """MR-ACK-008: READ RESPONSE FIRST/LAST carry the current msn, which a SEND accepted while the
    responses are still queued has already advanced."""
    q = peer(budget=1)
    q.qp.post_recv(RecvWR(wr_id=1, sg_list=[q.sge(0, 64)]))
    q.send([(Op.RDMA_READ_REQUEST, 100, b"", dict(reth=RETH(va=q.mr.addr, rkey=q.mr.rkey, dma_len=2 * MTU)))])
    out = _first_responses(q)
    assert [p.ext["aeth"].msn for p in read_responses(out)] == [1]
    q.send([(Op.SEND_ONLY, 102, b"s" * 4, {})])
    out = q.rounds()
    last = [p for p in read_responses(out) if p.bth.opcode == Op.RDMA_READ_RESPONSE_LAST]
    assert q.qp.query()["msn"] == 2 and [p.ext["aeth"].msn for p in last] == [2]


def test_full_read_and_write_paths_still_complete(dp_loop):
    """MR-DUP-003, MR-NAK-014: the ordered checks leave normal traffic intact (WRITE WITH IMM, READ, SEND)."""
    a, b = dp_loop(mtu=MTU)
    a.buf[:5000] = 9
    b.qp.post_recv([RecvWR(wr_id=i, sg_list=[b.sge(60000, 8000)]) for i in range(2)])
    a.qp.post_send([SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE_WITH_IMM, sg_list=[a.sge(0, 5000)],
                           remote_addr=b.mr.addr, rkey=b.mr.rkey, imm_data=3),
                    SendWR(wr_id=2, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(10000, 5000)],
                           remote_addr=b.mr.addr, rkey=b.mr.rkey),
                    SendWR(wr_id=3, opcode=WROpcode.SEND, sg_list=[a.sge(0, 3000)])])
    wcs = wait_wcs([a, b], a, 3)
    assert [(w.wr_id, w.status) for w in wcs] == [(1, WCStatus.SUCCESS), (2, WCStatus.SUCCESS), (3, WCStatus.SUCCESS)]
    rw = wait_wcs([a, b], b, 2)
    assert [w.status for w in rw] == [WCStatus.SUCCESS] * 2
    assert (a.buf[10000:15000] == 9).all()


def test_receive_completion_of_write_with_imm_and_send_with_inv(dp_loop):
    """MR-RC-019: the receive completion of an RDMA WRITE WITH IMMEDIATE has byte_len the message length;
    that of a SEND WITH INVALIDATE has IBV_WC_WITH_INV and invalidated_rkey (and the key is invalidated,
    MR-MEM-040)."""
    from metaroce_xdp.dp import layout as L
    a, b = dp_loop(mtu=MTU)
    b.qp.post_recv([RecvWR(wr_id=1, sg_list=[b.sge(0, 64)]), RecvWR(wr_id=2, sg_list=[b.sge(0, 64)])])
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE_WITH_IMM, sg_list=[a.sge(0, 3000)],
                          remote_addr=b.mr.addr + 4096, rkey=b.mr.rkey, imm_data=0x1234))
    (rwc,) = wait_wcs([a, b], b, 1)
    assert (rwc.wr_id, rwc.opcode, rwc.byte_len, rwc.imm_data) == (1, WCOpcode.RECV_RDMA_WITH_IMM, 3000, 0x1234)
    victim = b.pd.reg_mr(np.zeros(64, np.uint8), FULL, remote_invalidate=True)
    try:
        a.qp.post_send(SendWR(wr_id=2, opcode=WROpcode.SEND_WITH_INV, sg_list=[a.sge(0, 12)],
                              invalidate_rkey=victim.rkey))
        (rwc,) = wait_wcs([a, b], b, 1)
        assert (rwc.wr_id, rwc.byte_len, rwc.invalidated_rkey) == (2, 12, victim.rkey)
        assert rwc.wc_flags & WCFlags.WITH_INV and b.ctx.plane.MRT[victim.index, L.M_VALID] == 0
    finally:
        victim.dereg()


def test_reexecuted_read_does_not_pin_its_resource(peer):
    """MR-DUP-007, MR-ATOM-007: a new READ takes the oldest entry even while a re-execution of that old
    READ is queued (a duplicate says nothing about the requester not having completed it); a younger ATOMIC
    stays remembered and its duplicate is answered from the saved result, not executed again."""
    q = peer(rd_atomic=2)
    q.buf[:8] = 0
    ra = dict(reth=RETH(va=q.mr.addr + 64, rkey=q.mr.rkey, dma_len=8))
    at = dict(atomiceth=AtomicETH(va=q.mr.addr, rkey=q.mr.rkey, swap_add=5, compare=0))
    q.inject(Op.RDMA_READ_REQUEST, 100, **ra)
    q.inject(Op.FETCH_ADD, 101, **at)
    q.inject_burst([(Op.RDMA_READ_REQUEST, 100, b"", ra), (Op.RDMA_READ_REQUEST, 102, b"", ra)])
    out = q.inject(Op.FETCH_ADD, 101, **at)
    acks = [p for p in out if p.bth.opcode == Op.ATOMIC_ACKNOWLEDGE]
    assert [(p.bth.psn, p.ext["atomicacketh"].orig) for p in acks] == [(101, 0)]
    assert int(q.buf[:8].view(np.uint64)[0]) == 5  # executed once (MR-ATOM-007)


def test_fatal_nak_after_a_read_leaves_after_its_responses(peer):
    """MR-RC-025, MR-NAK-007: a WRITE with a bad R_Key right after a READ moves the QP to ERR at once, yet
    the READ's responses still leave first and the NAK (code 2, the WRITE's PSN) after them; then nothing."""
    q = peer()
    q.buf[:2 * MTU] = 0x42
    out = q.inject_burst([
        (Op.RDMA_READ_REQUEST, 100, b"", dict(reth=RETH(va=q.mr.addr, rkey=q.mr.rkey, dma_len=2 * MTU))),
        (Op.RDMA_WRITE_ONLY, 102, b"w" * 8, dict(reth=RETH(va=q.mr.addr, rkey=q.mr.rkey ^ 1, dma_len=8)))],
        budget=1)
    assert order_of(out) == [("RR", 100), ("RR", 101), ("ACK", 102)]
    assert out[-1].ext["aeth"].syndrome == 0x62 and q.qp.query_state() == QPState.ERR
    assert b"".join(p.payload for p in out[:2]) == b"\x42" * (2 * MTU)
    assert q.rounds() == []


@pytest.mark.parametrize("budget", [256, pytest.param(1, marks=pytest.mark.xfail(strict=True, reason=(
    "issue 20: with the READ's responses queued over several rounds, the compiled responder drops the FETCH_ADD "
    "that lands in the READ's range (dp/responder.py protect_reads: left for the requester to send again) and the "
    "SEND after it: no ATOMIC ACKNOWLEDGE, no ACK until a retransmission (MR-RC-025, MR-ATOM-009)")))])
def test_later_requests_do_not_change_an_earlier_reads_data(peer, budget):
    """MR-RC-025, MR-RC-014, MR-ATOM-009: a WRITE, a FETCH_ADD and a SEND that land inside the range of an
    earlier READ whose responses are still queued do not show in those responses: the READ returns the
    memory as it was when it was executed, the later requests' effects are all in memory afterwards
    (conformance TC-RC-025-a)."""
    q = peer(rd_atomic=16)
    q.buf[:4 * MTU] = 0x42
    q.qp.post_recv(RecvWR(wr_id=7, sg_list=[q.sge(3 * MTU, 64)]))
    rk = q.mr.rkey
    out = q.inject_burst([
        (Op.RDMA_READ_REQUEST, 100, b"", dict(reth=RETH(va=q.mr.addr, rkey=rk, dma_len=4 * MTU))),
        (Op.RDMA_WRITE_ONLY, 104, b"w" * 16, dict(reth=RETH(va=q.mr.addr + 2 * MTU - 8, rkey=rk, dma_len=16))),
        (Op.FETCH_ADD, 105, b"", dict(atomiceth=AtomicETH(va=q.mr.addr + MTU + 8, rkey=rk, swap_add=1, compare=0))),
        (Op.SEND_ONLY, 106, b"s" * 32, {})], budget)
    assert order_of(out) == [("RR", 100), ("RR", 101), ("RR", 102), ("RR", 103), ("ACK", 104), ("ATOMIC_ACK", 105),
                             ("ACK", 106)]
    assert b"".join(p.payload for p in out[:4]) == b"\x42" * (4 * MTU)
    assert out[5].ext["atomicacketh"].orig == 0x4242424242424242
    assert bytes(q.buf[2 * MTU - 8:2 * MTU + 8]) == b"w" * 16 and bytes(q.buf[3 * MTU:3 * MTU + 32]) == b"s" * 32
    assert int(q.buf[MTU + 8:MTU + 16].view(np.uint64)[0]) == 0x4242424242424243
    assert q.qp.query_state() == QPState.RTS


def test_remote_key_failures_are_counted(peer):
    """MR-MEM-019: each failed remote key check (NAK code 2) counts in the QP's rx_rkey_violation; an
    invalid request (code 1) does not."""
    q = peer()
    assert q.qp.query()["rx_rkey_violation"] == 0
    out = q.inject(Op.RDMA_WRITE_ONLY, 100, b"w" * 8, reth=RETH(va=q.mr.addr, rkey=q.mr.rkey ^ 1, dma_len=8))
    assert nak_of(out) == [(100, 0x62)] and q.qp.query()["rx_rkey_violation"] == 1
    q = peer()
    out = q.inject(Op.FETCH_ADD, 100, atomiceth=AtomicETH(va=q.mr.addr + 4, rkey=q.mr.rkey, swap_add=1, compare=0))
    assert nak_of(out) == [(100, 0x61)] and q.qp.query()["rx_rkey_violation"] == 0


def test_requester_completes_read_then_write_without_a_retry(dp_loop):
    """MR-RC-025, MR-RETRY-012: READ, WRITE and SEND posted together complete in order with no
    retransmission -- an ACK of the WRITE arriving before the READ's responses would be an implied NAK for
    the READ (a spurious go-back-N)."""
    a, b = dp_loop(mtu=MTU)
    b.buf[:5000] = 0x17
    b.qp.post_recv(RecvWR(wr_id=9, sg_list=[b.sge(60000, 4096)]))
    s0 = a.ctx.stats()
    a.qp.post_send([SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(0, 5000)],
                           remote_addr=b.mr.addr, rkey=b.mr.rkey),
                    SendWR(wr_id=2, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(8000, 3000)],
                           remote_addr=b.mr.addr + 20000, rkey=b.mr.rkey),
                    SendWR(wr_id=3, opcode=WROpcode.SEND, sg_list=[a.sge(8000, 100)])])
    wcs = wait_wcs([a, b], a, 3)
    assert [(w.wr_id, w.status) for w in wcs] == [(i, WCStatus.SUCCESS) for i in (1, 2, 3)]
    assert (a.buf[:5000] == 0x17).all()
    s1 = a.ctx.stats()
    assert [s1[k] - s0[k] for k in ("retransmits", "timeouts", "naks_seen")] == [0, 0, 0]


def test_native_opcode_on_a_compat_qp_is_dropped_and_counted(peer):
    """MR-OPC-004, MR-NAT-008, MR-ENC-032: a native request (NATIVE_SEND, NATIVE_WRITE) or response
    (NATIVE_SACK) sent to a compat QP is dropped without a NAK and counted as WRONG_PROFILE; the QP and its
    ePSN are unchanged.  To a QP whose state refuses it, the state drop (step 14) counts first."""
    q = peer()
    q.qp.post_recv(RecvWR(wr_id=1, sg_list=[q.sge(0, 64)]))
    k0 = q.ctx.loader.drops()
    s0 = q.ctx.stats()

    def moved(name):
        k, s = q.ctx.loader.drops(), q.ctx.stats()
        loop = {"WRONG_PROFILE": "rx_drop_op", "QP_STATE": "rx_drop_state"}[name]
        return k[name] - k0[name] + s[loop] - s0[loop]

    out = q.inject(Op.NATIVE_SEND, 100, b"abcd", neth=NETH(flags=0xC0, msg_len=4))
    out += q.inject(Op.NATIVE_WRITE, 100, b"abcd", reth=RETH(va=q.mr.addr, rkey=q.mr.rkey, dma_len=4),
                    neth=NETH(flags=0xC0, msg_len=4))
    out += q.inject(Op.NATIVE_SACK, 100, aeth=AETH(syndrome=0, msn=0), sacketh=SACKETH())
    assert out == [] and moved("WRONG_PROFILE") == 3
    assert q.qp.query_state() == QPState.RTS and q.qp.query()["rq_psn"] == 100 and not q.buf[:8].any()
    assert q.cq.poll(4) == []
    out = q.inject(Op.SEND_ONLY, 100, b"ok")          # the QP works on
    assert nak_of(out) == [(100, 0x1F)] and q.cq.poll(4)[0].status == WCStatus.SUCCESS
    q.qp.modify(QPAttr(qp_state=QPState.ERR))
    q.inject(Op.NATIVE_SEND, 101, b"abcd", neth=NETH(flags=0xC0, msg_len=4))
    assert moved("WRONG_PROFILE") == 3 and moved("QP_STATE") == 1


# ---- SEND WITH INVALIDATE (MR-RC-001, MR-MEM-040 to MR-MEM-043) -------------------------------

def test_send_with_inv_work_request_invalidates_the_peers_key(dp_loop):
    """MR-RC-001, MR-RC-003, MR-MEM-040, MR-MEM-043: IBV_WR_SEND_WITH_INV (libibverbs value 9) is sent as
    SEND FIRST, MIDDLE, LAST WITH INVALIDATE with the key in the IETH of the last packet; the responder
    invalidates the remotely invalidatable MR (no access through the key succeeds, its row stays taken), the
    receive completion has IBV_WC_WITH_INV and invalidated_rkey, the send completion is IBV_WC_SEND."""
    from metaroce_xdp.dp import layout as L
    assert WROpcode.SEND_WITH_INV == 9
    a, b = dp_loop(mtu=MTU)
    victim = b.pd.reg_mr(np.zeros(4096, np.uint8), FULL, remote_invalidate=True)
    tap = PortTap(a.topo, a.topo[1], "swA")
    try:
        b.qp.post_recv(RecvWR(wr_id=5, sg_list=[b.sge(0, 4096)]))
        a.buf[:3000] = 0x3C
        a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND_WITH_INV, sg_list=[a.sge(0, 3000)],
                              invalidate_rkey=victim.rkey))
        (swc,) = wait_wcs([a, b], a, 1)
        sent = [p for p in (decode(f) for f, out in tap.raw(is_roce_v4) if not out)   # what A sent
                if p.bth.dest_qp == b.qp.qp_num]
        assert [p.bth.opcode for p in sent] == [Op.SEND_FIRST, Op.SEND_MIDDLE, Op.SEND_LAST_WITH_INVALIDATE]
        assert [p.ext.get("ieth") for p in sent[:2]] == [None, None] and sent[2].ext["ieth"].rkey == victim.rkey
        assert (swc.wr_id, swc.status, swc.opcode) == (1, WCStatus.SUCCESS, WCOpcode.SEND)
        (rwc,) = wait_wcs([a, b], b, 1)
        assert (rwc.wr_id, rwc.status, rwc.byte_len, rwc.invalidated_rkey) == (5, WCStatus.SUCCESS, 3000,
                                                                               victim.rkey)
        assert rwc.wc_flags & WCFlags.WITH_INV and (b.buf[:3000] == 0x3C).all()
        assert b.ctx.plane.MRT[victim.index, L.M_VALID] == 0
        assert b.ctx.mrs.get(victim.index) is victim           # still registered (MR-MEM-042, MR-MEM-043)
        a.qp.post_send(SendWR(wr_id=2, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 8)],
                              remote_addr=victim.addr, rkey=victim.rkey))
        (swc,) = wait_wcs([a, b], a, 1)
        assert swc.status == WCStatus.REM_ACCESS_ERR
    finally:
        tap.close()
        victim.dereg()


@pytest.mark.parametrize("case", ["plain_reg_mr", "other_pd", "unknown_key", "already_invalidated"])
def test_key_that_cannot_be_invalidated_is_invalid_request(peer, case):
    """MR-MEM-041, MR-MEM-042, MR-NAK-006 (h), Table 3-4 row 9: a SEND WITH INVALIDATE whose IETH names an
    MR registered with plain reg_mr, an MR of another PD, no MR, or an MR already invalidated gets NAK code
    1 with its PSN; the receive WQE completes with IBV_WC_REM_INV_REQ_ERR, the QP moves to ERR and the MR
    is left as it was.  (The requester's side, IBV_WC_REM_INV_REQ_ERR for its WR: test_dp_ops.py::
    test_send_with_invalidate_of_a_plain_key_is_an_invalid_request.)"""
    from metaroce_xdp.dp import layout as L
    q = peer()
    mem = np.zeros(64, np.uint8)
    pd2 = None
    if case == "plain_reg_mr":
        mr = q.pd.reg_mr(mem, FULL)
    elif case == "other_pd":
        pd2 = q.ctx.alloc_pd()
        mr = pd2.reg_mr(mem, FULL, remote_invalidate=True)
    else:
        mr = q.pd.reg_mr(mem, FULL, remote_invalidate=True)
    q.extra_mrs = [mr]
    key = mr.rkey ^ 0x80 if case == "unknown_key" else mr.rkey
    psn = 100
    if case == "already_invalidated":
        q.qp.post_recv(RecvWR(wr_id=4, sg_list=[q.sge(0, 64)]))
        out = q.inject(Op.SEND_ONLY_WITH_INVALIDATE, psn, b"i" * 12, ieth=IETH(rkey=key))
        assert nak_of(out) == [(psn, 0x1F)] and q.cq.poll(4)[0].status == WCStatus.SUCCESS
        psn += 1
    q.qp.post_recv(RecvWR(wr_id=5, sg_list=[q.sge(0, 64)]))
    out = q.inject(Op.SEND_ONLY_WITH_INVALIDATE, psn, b"i" * 12, ieth=IETH(rkey=key))
    assert nak_of(out) == [(psn, 0x61)] and q.qp.query_state() == QPState.ERR
    (rwc,) = q.cq.poll(4)
    assert (rwc.wr_id, rwc.status) == (5, WCStatus.REM_INV_REQ_ERR)
    assert q.ctx.plane.MRT[mr.index, L.M_VALID] == (0 if case == "already_invalidated" else 1)
    if pd2 is not None:
        q.close()
        q.ctx.dealloc_pd(pd2)


@pytest.mark.parametrize("opcode", [7, 8, 10])
def test_other_work_request_opcodes_are_rejected_at_post_time(dp_loop, opcode):
    """MR-RC-001: opcodes outside the eight of the rule (LOCAL_INV 7, BIND_MW 8, TSO 10) are refused by
    post_send, and nothing is posted."""
    a, b = dp_loop()
    with pytest.raises(InvalidArgument):
        a.qp.post_send([SendWR(wr_id=1, opcode=WROpcode.SEND, sg_list=[a.sge(0, 8)]),
                        SendWR(wr_id=2, opcode=opcode, sg_list=[a.sge(0, 8)])])
    assert a.qp.query()["sq_outstanding"] == 0
