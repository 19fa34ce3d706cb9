"""The responder's compat rules checked packet by packet (spec 03 Table 3-4, MR-DUP, MR-MEM-033).

Crafted request packets (the reference codec) are put into the responder's
LoopPort inbox and only the responder's engine runs, so the frames it answers
with can be read from the requester's inbox before anyone consumes them:
what was sent, with which PSN and syndrome, and whether any byte of memory
left the responder.
"""
from __future__ import annotations

import mmap

import numpy as np
import pytest

from metaroce_xdp.rc import responder as responder_mod
from metaroce_xdp.wire import AETH, RETH, Op, decode, encode
from metaroce_xdp.wire.headers import IETH, AtomicETH, ImmDt
from metaroce_xdp.verbs_types import Access, QPAttr, QPState, WCFlags, WCOpcode
from rc_players import FULL, RecvWR, SendWR, WCStatus, WROpcode, loop_pair, run_until, wait_wcs

MTU = 1024


def inject(req, resp, opcode, psn, payload=b"", **headers) -> list:
    """Hand one request frame from `req` to `resp`, run resp's engine alone, return what resp sent."""
    rp, sp = req.ctx.port, resp.ctx.port
    sp.inbox.append(encode(opcode, src_mac=rp.mac, dst_mac=sp.mac, src_ip=rp.ip, dst_ip=sp.ip,
                           sport=req.qp.sport, dest_qp=resp.qp.qp_num, psn=psn, ack_req=1,
                           headers=headers, payload=payload))
    resp.ctx.engine.progress()
    out = [decode(f) for f in rp.inbox]
    rp.inbox.clear()
    return out


def nak_of(pkts) -> list[tuple[int, int]]:
    """(PSN, syndrome) of the ACKNOWLEDGE packets among pkts."""
    return [(p.bth.psn, p.ext["aeth"].syndrome) for p in pkts if p.bth.opcode == Op.ACKNOWLEDGE]


def read_responses(pkts) -> list:
    return [p for p in pkts if Op.RDMA_READ_RESPONSE_FIRST <= p.bth.opcode <= Op.RDMA_READ_RESPONSE_ONLY]


def _read_once(a, b, n=3000):
    """A reads n bytes of B's MR once (PSN 100..), both sides then idle; B keeps the READ in resources[]."""
    b.buf[:n] = np.arange(n, dtype=np.uint32).astype(np.uint8) ^ 0x5A
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(0, n)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    (wc,) = wait_wcs([a, b], a, 1)
    assert wc.status == WCStatus.SUCCESS and np.array_equal(a.buf[:n], b.buf[:n])
    run_until([a, b], lambda: not a.ctx.port.inbox and not b.ctx.port.inbox)
    return n


def test_duplicate_read_after_dereg_returns_no_memory():
    """MR-MEM-033, MR-DUP-003, MR-MEM-021: a duplicate READ replayed after ibv_dereg_mr is checked again:
    no READ RESPONSE, no byte of the old MR; NAK code 2 with the duplicate's PSN and the QP in ERR."""
    a, b = loop_pair(mtu=MTU)
    n = _read_once(a, b)
    va, rkey = b.mr.addr, b.mr.rkey
    b.ctx.dereg_mr(b.mr)
    for psn, off in ((100, 0), (102, 2 * MTU)):       # from the start, and the re-request of the rest
        out = inject(a, b, Op.RDMA_READ_REQUEST, psn, reth=RETH(va=va + off, rkey=rkey, dma_len=n - off))
        if psn == 100:
            assert read_responses(out) == [] and not any(p.payload for p in out)
            assert nak_of(out) == [(100, 0x62)]        # NAK code 2, the duplicate's PSN
            assert b.qp.state == QPState.ERR
        else:
            assert out == []                          # in ERR: silent (MR-QP-025)


def test_duplicate_read_after_dereg_with_a_new_mr_at_the_same_place():
    """MR-MEM-033, MR-DUP-003: the saved READ's R_Key is gone; a new MR over the same memory has another
    key, and the duplicate (carrying the old key) still gets no data."""
    a, b = loop_pair(mtu=MTU)
    n = _read_once(a, b)
    old_rkey = b.mr.rkey
    b.ctx.dereg_mr(b.mr)
    mr2 = b.pd.reg_mr(b.buf, FULL)
    out = inject(a, b, Op.RDMA_READ_REQUEST, 100, reth=RETH(va=b.buf.ctypes.data, rkey=old_rkey, dma_len=n))
    if mr2.rkey == old_rkey:                          # same index and tag drawn again: MR-MEM-011 divergence
        pytest.skip("the new MR drew the old key (MR-MEM-011 is open)")
    assert read_responses(out) == [] and nak_of(out) == [(100, 0x62)]


@pytest.mark.parametrize("case", ["other_rkey", "before_va", "past_end", "longer", "psn_overflow"])
def test_inconsistent_duplicate_read_is_discarded(case):
    """MR-DUP-003: a duplicate READ must carry the saved R_Key and ask for a range inside the saved one
    (and its responses must fit the saved PSNs); otherwise it is silently discarded -- even when its own
    R_Key is valid for the QP -- counted, and the QP stays in RTS (MR-DUP-001)."""
    a, b = loop_pair(mtu=MTU)
    n = _read_once(a, b)
    other = b.pd.reg_mr(np.full(8192, 0xEE, np.uint8), FULL)   # a valid key the READ never named
    va, rkey, psn, ln = b.mr.addr, b.mr.rkey, 100, n
    if case == "other_rkey":
        va, rkey = other.addr, other.rkey
    elif case == "before_va":
        va -= 8
    elif case == "past_end":
        va += 8
    elif case == "longer":
        ln = n + 1
    elif case == "psn_overflow":
        psn, va, ln = 102, va, n                      # the whole range, but starting at the last PSN
    out = inject(a, b, Op.RDMA_READ_REQUEST, psn, reth=RETH(va=va, rkey=rkey, dma_len=ln))
    assert out == []
    assert b.qp.responder.dup_read_discards == 1 and b.qp.responder.dup_requests == 1
    assert b.qp.state == QPState.RTS


def test_consistent_duplicate_read_is_reexecuted_with_current_memory():
    """MR-DUP-003, MR-DUP-004, MR-ACK-008: a consistent duplicate READ is read again as memory is now,
    from the duplicate's PSN (FIRST ... LAST), the AETHs carrying the current msn."""
    a, b = loop_pair(mtu=MTU)
    n = _read_once(a, b)
    b.buf[:n] = 0x33
    msn = b.qp.responder.msn
    out = inject(a, b, Op.RDMA_READ_REQUEST, 101, reth=RETH(va=b.mr.addr + MTU, rkey=b.mr.rkey, dma_len=n - MTU))
    rr = read_responses(out)
    assert [p.bth.psn for p in rr] == [101, 102]
    assert [p.bth.opcode for p in rr] == [Op.RDMA_READ_RESPONSE_FIRST, Op.RDMA_READ_RESPONSE_LAST]
    assert b"".join(p.payload for p in rr) == b"\x33" * (n - MTU)
    assert all(p.ext["aeth"].msn == msn for p in rr)
    assert b.qp.responder.dup_read_replays == 1 and b.qp.state == QPState.RTS


def test_read_stream_ends_when_its_mr_is_deregistered():
    """MR-MEM-033: a READ response stream in progress when its MR is deregistered ends with NAK code 2
    carrying the READ REQUEST's PSN; no later packet reads the MR; the requester completes the READ with
    IBV_WC_REM_ACCESS_ERR (MR-NAK-010)."""
    a, b = loop_pair(mtu=MTU)
    n = 16 * MTU
    b.buf[:n] = 0x77
    b.ctx.engine.budget = 4                           # four responses per progress round
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(0, n)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    a.ctx.engine.progress()                           # the READ REQUEST leaves
    b.ctx.engine.progress()                           # accepted; the first responses leave
    sent_before = b.qp.responder.bytes_sent
    assert 0 < sent_before < n
    b.ctx.dereg_mr(b.mr)
    (wc,) = wait_wcs([a, b], a, 1)
    assert wc.status == WCStatus.REM_ACCESS_ERR
    assert b.qp.responder.bytes_sent == sent_before
    assert not a.buf[sent_before:n].any()             # nothing after the deregistration arrived
    assert b.qp.state == QPState.ERR and a.qp.state == QPState.ERR


def test_write_stream_ends_when_its_mr_is_deregistered():
    """MR-MEM-033: a multi-packet WRITE whose MR is deregistered between packets gets NAK code 2 at the
    next packet and writes nothing more (the compiled placer stands aside too)."""
    a, b = loop_pair(mtu=MTU)
    out = inject(a, b, Op.RDMA_WRITE_FIRST, 100, payload=b"\x11" * MTU,
                 reth=RETH(va=b.mr.addr, rkey=b.mr.rkey, dma_len=3 * MTU))
    assert nak_of(out) in ([], [(100, 0x1F)])
    b.ctx.dereg_mr(b.mr)
    out = inject(a, b, Op.RDMA_WRITE_MIDDLE, 101, payload=b"\x22" * MTU)
    assert nak_of(out) == [(101, 0x62)] and b.qp.state == QPState.ERR
    assert (b.buf[:MTU] == 0x11).all() and not b.buf[MTU:].any()


# ---- Table 3-4: the order of the checks (MR-NAK-014) -------------------------------------------

def test_rnr_before_length_for_send_with_empty_rq():
    """MR-NAK-014, MR-RNR-001: SEND ONLY longer than the path MTU with no receive WQE posted: the receive
    WQE check (row 4) comes before the length check (row 5), so RNR NAK and the QP stays in RTR/RTS."""
    a, b = loop_pair(mtu=MTU, min_rnr_timer=3)
    out = inject(a, b, Op.SEND_ONLY, 100, payload=b"x" * (MTU + 4))
    assert nak_of(out) == [(100, 0x20 | 3)]
    assert b.qp.state == QPState.RTS and b.qp.responder.epsn == 100
    b.qp.post_recv(RecvWR(wr_id=5, sg_list=[b.sge(0, 4 * MTU)]))
    out = inject(a, b, Op.SEND_ONLY, 100, payload=b"x" * (MTU + 4))
    assert nak_of(out) == [(100, 0x61)]               # now the length: invalid request
    (wc,) = b.cq.poll(4)
    assert (wc.wr_id, wc.status) == (5, WCStatus.REM_INV_REQ_ERR)   # the receive WQE in use (Table 7-6)


@pytest.mark.parametrize("bad", ["rkey", "length"])
def test_write_with_imm_rnr_first(bad):
    """MR-NAK-014: RDMA WRITE ONLY WITH IMMEDIATE with an empty receive queue gets an RNR NAK even when its
    R_Key or its length is bad (row 4 before rows 5 and 6); with a receive WQE posted the bad length is an
    invalid request and the bad R_Key a remote access error, the WQE completing with
    IBV_WC_LOC_ACCESS_ERR (Table 7-6) and no memory written."""
    a, b = loop_pair(mtu=MTU, min_rnr_timer=2)
    rkey = b.mr.rkey ^ 1 if bad == "rkey" else b.mr.rkey
    dma_len = 8 if bad == "rkey" else 16
    hdr = dict(reth=RETH(va=b.mr.addr, rkey=rkey, dma_len=dma_len), immdt=ImmDt(imm=7))
    out = inject(a, b, Op.RDMA_WRITE_ONLY_WITH_IMMEDIATE, 100, payload=b"y" * 8, **hdr)
    assert nak_of(out) == [(100, 0x22)] and b.qp.state == QPState.RTS
    b.qp.post_recv(RecvWR(wr_id=6, sg_list=[b.sge(0, 8)]))
    out = inject(a, b, Op.RDMA_WRITE_ONLY_WITH_IMMEDIATE, 100, payload=b"y" * 8, **hdr)
    assert nak_of(out) == [(100, 0x62 if bad == "rkey" else 0x61)]
    (wc,) = b.cq.poll(4)
    assert wc.wr_id == 6
    assert wc.status == (WCStatus.LOC_ACCESS_ERR if bad == "rkey" else WCStatus.REM_INV_REQ_ERR)
    assert not b.buf.any()


def test_write_length_before_rkey():
    """MR-NAK-014: a WRITE ONLY whose payload does not match its DMA Length and whose R_Key is bad is an
    invalid request (row 5, MR-RC-011) rather than a remote access error (row 6)."""
    a, b = loop_pair(mtu=MTU)
    out = inject(a, b, Op.RDMA_WRITE_ONLY, 100, payload=b"z" * 8,
                 reth=RETH(va=b.mr.addr, rkey=b.mr.rkey ^ 1, dma_len=12))
    assert nak_of(out) == [(100, 0x61)] and not b.buf.any()


@pytest.mark.parametrize("op", [Op.RDMA_READ_REQUEST, Op.RDMA_WRITE_FIRST])
def test_dma_length_above_2_31_is_invalid_request(op):
    """MR-XH-004, MR-NAK-006 (d), MR-SEC-013: a DMA Length above 2^31 is an invalid request on its own,
    even for an R_Key whose MR would cover it (NAK code 1, not 2), and nothing is read or written."""
    a, b = loop_pair(mtu=MTU)
    # an MR larger than 2^31 bytes (anonymous memory: untouched pages cost nothing)
    huge = np.frombuffer(mmap.mmap(-1, (1 << 31) + 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), np.uint8)
    big = b.pd.reg_mr(huge, FULL)
    payload = b"w" * MTU if op == Op.RDMA_WRITE_FIRST else b""
    out = inject(a, b, op, 100, payload=payload, reth=RETH(va=big.addr, rkey=big.rkey, dma_len=(1 << 31) + 1))
    assert read_responses(out) == []
    assert nak_of(out) == [(100, 0x61)] and b.qp.state == QPState.ERR
    assert not huge[:2 * MTU].any()


def test_dma_length_of_exactly_2_31_is_not_a_length_error():
    """MR-XH-004: 2^31 itself is allowed; a READ of 2^31 bytes from a small MR fails the bounds (code 2)."""
    a, b = loop_pair(mtu=MTU)
    out = inject(a, b, Op.RDMA_READ_REQUEST, 100, reth=RETH(va=b.mr.addr, rkey=b.mr.rkey, dma_len=1 << 31))
    assert nak_of(out) == [(100, 0x62)]


def test_read_beyond_responder_resources():
    """MR-DUP-007, MR-NAK-006 (f), MR-SEC-012: with max_dest_rd_atomic 0 a READ or an ATOMIC is an
    invalid request; with 1, a second READ while the first one's responses are still queued is too."""
    for op in (Op.RDMA_READ_REQUEST, Op.FETCH_ADD):
        a, b = loop_pair(mtu=MTU, rd_atomic=0)
        hdr = (dict(reth=RETH(va=b.mr.addr, rkey=b.mr.rkey, dma_len=8)) if op == Op.RDMA_READ_REQUEST
               else dict(atomiceth=AtomicETH(va=b.mr.addr, rkey=b.mr.rkey, swap_add=1, compare=0)))
        out = inject(a, b, op, 100, **hdr)
        assert nak_of(out) == [(100, 0x61)] and not b.buf.any()
    a, b = loop_pair(mtu=MTU, rd_atomic=1)
    b.ctx.engine.budget = 2
    out = inject(a, b, Op.RDMA_READ_REQUEST, 100, reth=RETH(va=b.mr.addr, rkey=b.mr.rkey, dma_len=8 * MTU))
    assert len(read_responses(out)) == 2                # six responses still to send
    out = inject(a, b, Op.RDMA_READ_REQUEST, 108, reth=RETH(va=b.mr.addr, rkey=b.mr.rkey, dma_len=8))
    assert b.qp.state == QPState.ERR
    out += inject_burst(a, b, [], budget=2)            # the NAK leaves after the first READ's responses (MR-RC-025)
    assert len(read_responses(out)) == 6 and nak_of(out) == [(108, 0x61)] and out[-1].bth.psn == 108


def test_read_response_aeth_carries_the_current_msn():
    """MR-ACK-008: READ RESPONSE FIRST/LAST carry the current msn, which a SEND accepted while the
    responses are still queued has already advanced."""
    a, b = loop_pair(mtu=MTU)
    b.ctx.engine.budget = 1
    b.qp.post_recv(RecvWR(wr_id=1, sg_list=[b.sge(0, 64)]))
    out = inject(a, b, Op.RDMA_READ_REQUEST, 100, reth=RETH(va=b.mr.addr, rkey=b.mr.rkey, dma_len=2 * MTU))
    assert [p.ext["aeth"].msn for p in read_responses(out)] == [1]
    out = inject(a, b, Op.SEND_ONLY, 102, payload=b"s" * 4)
    last = [p for p in read_responses(out) if p.bth.opcode == Op.RDMA_READ_RESPONSE_LAST]
    assert b.qp.responder.msn == 2 and [p.ext["aeth"].msn for p in last] == [2]


def test_full_read_and_write_paths_still_complete():
    """MR-DUP-003, MR-NAK-014: the reordered checks leave normal traffic intact (WRITE WITH IMM, READ, SEND)."""
    a, b = loop_pair(mtu=MTU)
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


def test_receive_completion_of_write_with_imm_and_send_with_inv():
    """MR-RC-019: the receive completion of an RDMA WRITE WITH IMMEDIATE has byte_len the message length;
    that of a SEND WITH INVALIDATE has IBV_WC_WITH_INV and invalidated_rkey (and the key is invalidated,
    MR-MEM-040)."""
    a, b = loop_pair(mtu=MTU)
    b.qp.post_recv([RecvWR(wr_id=1, sg_list=[b.sge(0, 64)]), RecvWR(wr_id=2, sg_list=[b.sge(0, 64)])])
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE_WITH_IMM, sg_list=[a.sge(0, 3000)],
                          remote_addr=b.mr.addr + 4096, rkey=b.mr.rkey, imm_data=0x1234))
    (rwc,) = wait_wcs([a, b], b, 1)
    assert (rwc.wr_id, rwc.opcode, rwc.byte_len, rwc.imm_data) == (1, WCOpcode.RECV_RDMA_WITH_IMM, 3000, 0x1234)
    victim = b.pd.reg_mr(np.zeros(64, np.uint8), FULL, remote_invalidate=True)
    inject(a, b, Op.SEND_ONLY_WITH_INVALIDATE, 103, payload=b"i" * 12, ieth=IETH(rkey=victim.rkey))
    (rwc,) = b.cq.poll(4)
    assert (rwc.wr_id, rwc.byte_len, rwc.invalidated_rkey) == (2, 12, victim.rkey)
    assert rwc.wc_flags & WCFlags.WITH_INV and not victim.valid


def test_reexecuted_read_does_not_pin_its_resource():
    """MR-DUP-007, MR-ATOM-007: a new READ takes the oldest entry even while a re-execution of that old
    READ is queued (a duplicate says nothing about the requester not having completed it); a younger ATOMIC
    stays remembered and its duplicate is answered from resources[], not executed again."""
    a, b = loop_pair(mtu=MTU, rd_atomic=2)
    b.buf[:8] = 0
    ra = dict(reth=RETH(va=b.mr.addr + 64, rkey=b.mr.rkey, dma_len=8))
    at = dict(atomiceth=AtomicETH(va=b.mr.addr, rkey=b.mr.rkey, swap_add=5, compare=0))
    inject(a, b, Op.RDMA_READ_REQUEST, 100, **ra)
    inject(a, b, Op.FETCH_ADD, 101, **at)
    rp, sp = a.ctx.port, b.ctx.port
    for op, psn, hdr in ((Op.RDMA_READ_REQUEST, 100, ra), (Op.RDMA_READ_REQUEST, 102, ra)):
        sp.inbox.append(encode(op, src_mac=rp.mac, dst_mac=sp.mac, src_ip=rp.ip, dst_ip=sp.ip, sport=a.qp.sport,
                               dest_qp=b.qp.qp_num, psn=psn, ack_req=1, headers=hdr))
    b.ctx.engine.progress()                       # both taken in one burst: the replay is still queued
    rp.inbox.clear()
    assert [r.psn for r in b.qp.responder.resources] == [101, 102]
    out = inject(a, b, Op.FETCH_ADD, 101, **at)
    acks = [p for p in out if p.bth.opcode == Op.ATOMIC_ACKNOWLEDGE]
    assert [(p.bth.psn, p.ext["atomicacketh"].orig) for p in acks] == [(101, 0)]
    assert int(b.buf[:8].view(np.uint64)[0]) == 5  # executed once (MR-ATOM-007)


# ---- responses in PSN order (MR-RC-025) --------------------------------------------------------

def inject_burst(req, resp, reqs, budget: int = 256) -> list:
    """Hand several request frames (opcode, psn, payload, headers) to `resp` at once, run resp's engine
    until it has nothing queued, return what it sent in order."""
    rp, sp = req.ctx.port, resp.ctx.port
    for opcode, psn, payload, headers in reqs:
        sp.inbox.append(encode(opcode, src_mac=rp.mac, dst_mac=sp.mac, src_ip=rp.ip, dst_ip=sp.ip,
                               sport=req.qp.sport, dest_qp=resp.qp.qp_num, psn=psn, ack_req=1,
                               headers=headers, payload=payload))
    resp.ctx.engine.budget = budget
    for _ in range(64):
        resp.ctx.engine.progress()
        if not sp.inbox and not resp.ctx.engine.busy():
            break
    out = [decode(f) for f in rp.inbox]
    rp.inbox.clear()
    return out


def order_of(pkts) -> list[tuple[str, int]]:
    names = {Op.ACKNOWLEDGE: "ACK", Op.ATOMIC_ACKNOWLEDGE: "ATOMIC_ACK"}
    return [(names.get(p.bth.opcode, "RR"), p.bth.psn) for p in pkts]


@pytest.mark.parametrize("budget", [256, 1])
def test_ack_of_a_later_request_waits_for_read_responses(budget):
    """MR-RC-025, MR-ACK-003: READ REQUEST 100 (three responses, PSNs 100-102), WRITE 103, READ 104, WRITE
    105 arriving together: the coalesced ACKs leave after the responses of the READs before them and
    before those of the READs after them -- responses in PSN order -- also when the responses trickle out
    one per round."""
    a, b = loop_pair(mtu=MTU)
    rk = b.mr.rkey
    reqs = [(Op.RDMA_READ_REQUEST, 100, b"", dict(reth=RETH(va=b.mr.addr, rkey=rk, dma_len=3000))),
            (Op.RDMA_WRITE_ONLY, 103, b"w" * 8, dict(reth=RETH(va=b.mr.addr + 8192, rkey=rk, dma_len=8))),
            (Op.RDMA_READ_REQUEST, 104, b"", dict(reth=RETH(va=b.mr.addr, rkey=rk, dma_len=8))),
            (Op.RDMA_WRITE_ONLY, 105, b"v" * 8, dict(reth=RETH(va=b.mr.addr + 9000, rkey=rk, dma_len=8)))]
    out = inject_burst(a, b, reqs, budget)
    assert order_of(out) == [("RR", 100), ("RR", 101), ("RR", 102), ("ACK", 103), ("RR", 104), ("ACK", 105)]
    assert [p.ext["aeth"].msn for p in out if p.bth.opcode == Op.ACKNOWLEDGE] == [2, 4]
    assert b.qp.responder.held == [] and b.qp.state == QPState.RTS


def test_naks_and_atomic_acks_do_not_overtake_read_responses():
    """MR-RC-025: a PSN sequence error NAK, an RNR NAK and an ATOMIC ACKNOWLEDGE caused by requests after a
    READ leave after its responses."""
    def read(b):
        return (Op.RDMA_READ_REQUEST, 100, b"", dict(reth=RETH(va=b.mr.addr, rkey=b.mr.rkey, dma_len=2 * MTU)))

    a, b = loop_pair(mtu=MTU, min_rnr_timer=4)
    out = inject_burst(a, b, [read(b), (Op.SEND_ONLY, 110, b"s", {})])
    assert order_of(out) == [("RR", 100), ("RR", 101), ("ACK", 102)]
    assert out[-1].ext["aeth"].syndrome == 0x60                       # PSN sequence error at ePSN 102
    a, b = loop_pair(mtu=MTU, min_rnr_timer=4)
    out = inject_burst(a, b, [read(b), (Op.SEND_ONLY, 102, b"s", {})])   # no receive WQE posted
    assert order_of(out) == [("RR", 100), ("RR", 101), ("ACK", 102)]
    assert out[-1].ext["aeth"].syndrome == 0x24                       # RNR NAK
    a, b = loop_pair(mtu=MTU)
    out = inject_burst(a, b, [read(b), (Op.FETCH_ADD, 102, b"", dict(
        atomiceth=AtomicETH(va=b.mr.addr + 4096, rkey=b.mr.rkey, swap_add=1, compare=0)))])
    assert order_of(out) == [("RR", 100), ("RR", 101), ("ATOMIC_ACK", 102)]


def test_fatal_nak_after_a_read_leaves_after_its_responses():
    """MR-RC-025, MR-NAK-007: a WRITE with a bad R_Key right after a READ moves the QP to ERR at once, yet
    the READ's responses still leave first and the NAK (code 2, the WRITE's PSN) after them; then nothing."""
    a, b = loop_pair(mtu=MTU)
    b.buf[:2 * MTU] = 0x42
    out = inject_burst(a, b, [
        (Op.RDMA_READ_REQUEST, 100, b"", dict(reth=RETH(va=b.mr.addr, rkey=b.mr.rkey, dma_len=2 * MTU))),
        (Op.RDMA_WRITE_ONLY, 102, b"w" * 8, dict(reth=RETH(va=b.mr.addr, rkey=b.mr.rkey ^ 1, dma_len=8)))],
        budget=1)
    assert order_of(out) == [("RR", 100), ("RR", 101), ("ACK", 102)]
    assert out[-1].ext["aeth"].syndrome == 0x62 and b.qp.state == QPState.ERR
    assert b"".join(p.payload for p in out[:2]) == b"\x42" * (2 * MTU)
    assert not b.qp.responder.drain_in_err
    b.ctx.engine.progress()
    assert a.ctx.port.inbox == type(a.ctx.port.inbox)()


@pytest.mark.parametrize("budget,copy", [(256, True), (1, True), (1, False)])
def test_later_requests_do_not_change_an_earlier_reads_data(budget, copy, monkeypatch):
    """MR-RC-025, MR-RC-014, MR-ATOM-009: a WRITE, a FETCH_ADD and a SEND that land inside the range of an
    earlier READ whose responses are still queued do not show in those responses: the READ returns the
    memory as it was when it was executed, the later requests' effects are all in memory afterwards.
    (Before, responses were built from memory as they left; conformance TC-RC-025-a.)  copy=False: a READ
    too large to copy aside is sent at once instead."""
    if not copy:
        monkeypatch.setattr(responder_mod, "SNAPSHOT_MAX", 0)
    a, b = loop_pair(mtu=MTU)
    b.buf[:4 * MTU] = 0x42
    b.qp.post_recv(RecvWR(wr_id=7, sg_list=[b.sge(3 * MTU, 64)]))
    rk = b.mr.rkey
    out = inject_burst(a, b, [
        (Op.RDMA_READ_REQUEST, 100, b"", dict(reth=RETH(va=b.mr.addr, rkey=rk, dma_len=4 * MTU))),
        (Op.RDMA_WRITE_ONLY, 104, b"w" * 16, dict(reth=RETH(va=b.mr.addr + 2 * MTU - 8, rkey=rk, dma_len=16))),
        (Op.FETCH_ADD, 105, b"", dict(atomiceth=AtomicETH(va=b.mr.addr + MTU + 8, rkey=rk, swap_add=1, compare=0))),
        (Op.SEND_ONLY, 106, b"s" * 32, {})], budget)
    assert order_of(out) == [("RR", 100), ("RR", 101), ("RR", 102), ("RR", 103), ("ACK", 104), ("ATOMIC_ACK", 105),
                             ("ACK", 106)]
    assert b"".join(p.payload for p in out[:4]) == b"\x42" * (4 * MTU)
    assert out[5].ext["atomicacketh"].orig == 0x4242424242424242
    assert bytes(b.buf[2 * MTU - 8:2 * MTU + 8]) == b"w" * 16 and bytes(b.buf[3 * MTU:3 * MTU + 32]) == b"s" * 32
    assert int(b.buf[MTU + 8:MTU + 16].view(np.uint64)[0]) == 0x4242424242424243
    assert b.qp.responder.read_queue == [] and b.qp.state == QPState.RTS


def test_remote_key_failures_are_counted():
    """MR-MEM-019: each failed remote key check (NAK code 2) counts in the QP's rx_rkey_violation; an
    invalid request (code 1) does not."""
    a, b = loop_pair(mtu=MTU)
    assert b.qp.query()["rx_rkey_violation"] == 0
    out = inject(a, b, Op.RDMA_WRITE_ONLY, 100, b"w" * 8, reth=RETH(va=b.mr.addr, rkey=b.mr.rkey ^ 1, dma_len=8))
    assert nak_of(out) == [(100, 0x62)] and b.qp.query()["rx_rkey_violation"] == 1
    a, b = loop_pair(mtu=MTU)
    out = inject(a, b, Op.FETCH_ADD, 100, atomiceth=AtomicETH(va=b.mr.addr + 4, rkey=b.mr.rkey, swap_add=1, compare=0))
    assert nak_of(out) == [(100, 0x61)] and b.qp.query()["rx_rkey_violation"] == 0


@pytest.mark.parametrize("burst", [True, False])
def test_requester_completes_read_then_write_without_a_retry(burst):
    """MR-RC-025, MR-RETRY-012: READ, WRITE and SEND posted together complete in order with no
    retransmission -- an ACK of the WRITE arriving before the READ's responses was an implied NAK for the
    READ (a spurious go-back-N here; rxe does the same)."""
    a, b = loop_pair(mtu=MTU, burst=burst)
    b.buf[:5000] = 0x17
    b.qp.post_recv(RecvWR(wr_id=9, sg_list=[b.sge(60000, 4096)]))
    a.qp.post_send([SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(0, 5000)],
                           remote_addr=b.mr.addr, rkey=b.mr.rkey),
                    SendWR(wr_id=2, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(8000, 3000)],
                           remote_addr=b.mr.addr + 20000, rkey=b.mr.rkey),
                    SendWR(wr_id=3, opcode=WROpcode.SEND, sg_list=[a.sge(8000, 100)])])
    wcs = wait_wcs([a, b], a, 3)
    assert [(w.wr_id, w.status) for w in wcs] == [(i, WCStatus.SUCCESS) for i in (1, 2, 3)]
    assert (a.buf[:5000] == 0x17).all()
    q = a.qp.query()
    assert q["retransmits"] == 0 and q["timeouts"] == 0 and q["naks_received"] == 0


def test_native_opcode_on_a_compat_qp_is_dropped_and_counted():
    """MR-OPC-004, MR-NAT-008, MR-ENC-032: on the in-process path too, a native request (NATIVE_SEND,
    NATIVE_WRITE) or response (NATIVE_SACK) sent to a compat QP is dropped without a NAK and counted as
    WRONG_PROFILE; the QP and its ePSN are unchanged.  To a QP whose state refuses it, the state drop
    (step 14) counts first, as in the XDP program."""
    from metaroce_xdp.wire.headers import NETH, SACKETH
    a, b = loop_pair(mtu=MTU)
    b.qp.post_recv(RecvWR(wr_id=1, sg_list=[b.sge(0, 64)]))
    stats = b.ctx.engine.stats
    out = inject(a, b, Op.NATIVE_SEND, 100, payload=b"abcd", neth=NETH(flags=0xC0, msg_len=4))
    out += inject(a, b, Op.NATIVE_WRITE, 100, payload=b"abcd",
                  reth=RETH(va=b.mr.addr, rkey=b.mr.rkey, dma_len=4), neth=NETH(flags=0xC0, msg_len=4))
    out += inject(a, b, Op.NATIVE_SACK, 100, aeth=AETH(syndrome=0, msn=0), sacketh=SACKETH())
    assert out == [] and stats["drop_wrong_profile"] == 3
    assert b.qp.state == QPState.RTS and b.qp.responder.epsn == 100 and not b.buf[:8].any()
    assert b.cq.poll(4) == []
    out = inject(a, b, Op.SEND_ONLY, 100, payload=b"ok")   # the QP works on
    assert nak_of(out) == [(100, 0x1F)] and b.cq.poll(4)[0].status == WCStatus.SUCCESS
    b.qp.modify(QPAttr(qp_state=QPState.ERR))
    inject(a, b, Op.NATIVE_SEND, 101, payload=b"abcd", neth=NETH(flags=0xC0, msg_len=4))
    assert stats["drop_wrong_profile"] == 3 and stats["drop_qp_state"] == 1


# ---- SEND WITH INVALIDATE (MR-RC-001, MR-MEM-040 to MR-MEM-043) -------------------------------

def test_send_with_inv_work_request_invalidates_the_peers_key():
    """MR-RC-001, MR-RC-003, MR-MEM-040, MR-MEM-043: IBV_WR_SEND_WITH_INV (libibverbs value 9) is sent as
    SEND FIRST, MIDDLE, LAST WITH INVALIDATE with the key in the IETH of the last packet; the responder
    invalidates the remotely invalidatable MR (no lookup of the key succeeds, its index stays taken), the
    receive completion has IBV_WC_WITH_INV and invalidated_rkey, the send completion is IBV_WC_SEND."""
    assert WROpcode.SEND_WITH_INV == 9
    a, b = loop_pair(mtu=MTU)
    victim = b.pd.reg_mr(np.zeros(4096, np.uint8), FULL, remote_invalidate=True)
    b.qp.post_recv(RecvWR(wr_id=5, sg_list=[b.sge(0, 4096)]))
    a.buf[:3000] = 0x3C
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND_WITH_INV, sg_list=[a.sge(0, 3000)],
                          invalidate_rkey=victim.rkey))
    a.ctx.engine.progress()
    sent = [decode(f) for f in b.ctx.port.inbox]
    assert [p.bth.opcode for p in sent] == [Op.SEND_FIRST, Op.SEND_MIDDLE, Op.SEND_LAST_WITH_INVALIDATE]
    assert [p.ext.get("ieth") for p in sent[:2]] == [None, None] and sent[2].ext["ieth"].rkey == victim.rkey
    (swc,) = wait_wcs([a, b], a, 1)
    assert (swc.wr_id, swc.status, swc.opcode) == (1, WCStatus.SUCCESS, WCOpcode.SEND)
    (rwc,) = wait_wcs([a, b], b, 1)
    assert (rwc.wr_id, rwc.status, rwc.byte_len, rwc.invalidated_rkey) == (5, WCStatus.SUCCESS, 3000, victim.rkey)
    assert rwc.wc_flags & WCFlags.WITH_INV and (b.buf[:3000] == 0x3C).all()
    assert not victim.valid and b.ctx.keys.lookup(victim.rkey) is None
    assert b.ctx.keys.by_index[victim.index] is victim          # still registered (MR-MEM-042, MR-MEM-043)
    a.qp.post_send(SendWR(wr_id=2, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 8)],
                          remote_addr=victim.addr, rkey=victim.rkey))
    (swc,) = wait_wcs([a, b], a, 1)
    assert swc.status == WCStatus.REM_ACCESS_ERR


@pytest.mark.parametrize("case", ["plain_reg_mr", "other_pd", "unknown_key", "already_invalidated"])
def test_key_that_cannot_be_invalidated_is_invalid_request(case):
    """MR-MEM-041, MR-MEM-042, MR-NAK-006 (h), Table 3-4 row 9: a SEND WITH INVALIDATE whose IETH names an
    MR registered with plain reg_mr, an MR of another PD, no MR, or an MR already invalidated gets NAK code
    1 with its PSN; the receive WQE completes with IBV_WC_REM_INV_REQ_ERR, the QP moves to ERR and the MR
    is left as it was.  The requester's WR completes with IBV_WC_REM_INV_REQ_ERR."""
    a, b = loop_pair(mtu=MTU)
    mem = np.zeros(64, np.uint8)
    if case == "plain_reg_mr":
        mr = b.pd.reg_mr(mem, FULL)
    elif case == "other_pd":
        mr = b.ctx.alloc_pd().reg_mr(mem, FULL, remote_invalidate=True)
    else:
        mr = b.pd.reg_mr(mem, FULL, remote_invalidate=True)
    key = mr.rkey ^ 0x80 if case == "unknown_key" else mr.rkey
    if case == "already_invalidated":
        assert b.ctx.invalidate_rkey(key, b.pd)
    b.qp.post_recv(RecvWR(wr_id=5, sg_list=[b.sge(0, 64)]))
    out = inject(a, b, Op.SEND_ONLY_WITH_INVALIDATE, 100, payload=b"i" * 12, ieth=IETH(rkey=key))
    assert nak_of(out) == [(100, 0x61)] and b.qp.state == QPState.ERR
    (rwc,) = b.cq.poll(4)
    assert (rwc.wr_id, rwc.status) == (5, WCStatus.REM_INV_REQ_ERR)
    assert mr.valid == (case != "already_invalidated")
    a2, b2 = loop_pair(mtu=MTU)
    plain = b2.pd.reg_mr(mem, FULL)
    b2.qp.post_recv(RecvWR(wr_id=6, sg_list=[b2.sge(0, 64)]))
    a2.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND_WITH_INV, sg_list=[a2.sge(0, 12)],
                           invalidate_rkey=plain.rkey))
    (swc,) = wait_wcs([a2, b2], a2, 1)
    assert swc.status == WCStatus.REM_INV_REQ_ERR and plain.valid


@pytest.mark.parametrize("opcode", [7, 8, 10])
def test_other_work_request_opcodes_are_rejected_at_post_time(opcode):
    """MR-RC-001: opcodes outside the eight of the rule (LOCAL_INV 7, BIND_MW 8, TSO 10) are refused by
    post_send, and nothing is posted."""
    from metaroce_xdp.verbs_types import InvalidArgument
    a, b = loop_pair(mtu=MTU)
    with pytest.raises(InvalidArgument):
        a.qp.post_send([SendWR(wr_id=1, opcode=WROpcode.SEND, sg_list=[a.sge(0, 8)]),
                        SendWR(wr_id=2, opcode=opcode, sg_list=[a.sge(0, 8)])])
    assert a.qp.requester.sq == []
