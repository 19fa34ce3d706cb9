"""READ response pacing at the native responder (MR-CC-021, native/plane_read.py nat_rd_send, native/rdpace.py)
between two hosts through a switch namespace, real XDP and AF_XDP: several QPs READing large buffers
from one responder whose READ response rate is set low (200 Mb/s) complete intact, each QP's responses
leave in PSN order (MR-OOO-017, seen by a capture on the switch port), and the responder's counters show
that the responses waited for their QP's share of the link, shared among the QPs with responses pending.
Behaviour is asserted through counters and packet order, never through elapsed time."""
from __future__ import annotations

import time

import numpy as np
import pytest

from dp_players import to_rts
from wire_players import PortTap
from metaroce_xdp.verbs_types import SendWR, WCStatus, WROpcode

pytestmark = pytest.mark.netns

RATE = 200_000_000
NQP = 3
SIZE = 256 * 1024


def _connect(side, q, peer_q, peer_side, psn, params=None):
    # the default rto_min (500 us): a QP's responses come at R/N = 67 Mb/s, one every ~130 us, and a test
    # loop descheduled for longer on a loaded host can still take the READ's tail for lost (MR-LOSS-013);
    # the re-request then queues no copy of the responses still queued (MR-OOO-022, c_rereq_queued)
    with side.topo.enter(side.ns):
        to_rts(q, peer_q.qp_num, peer_side.ctx.gid, rq_psn=psn, sq_psn=psn, timeout=14, rd_atomic=16,
               profile="native", native_params=params or {})


def _responses(frames: list[bytes]) -> list[tuple[int, int, int]]:
    """(destination QP, PSN, NETH flags) of every NATIVE_READ_RESP (opcode 0xC5) among captured frames."""
    out = []
    for f in frames:
        if len(f) < 14 + 20 + 8 + 12 + 16:
            continue
        et = int.from_bytes(f[12:14], "big")
        if et == 0x0800:
            l4 = 14 + (f[14] & 0x0F) * 4
            proto = f[14 + 9]
        elif et == 0x86DD:
            l4, proto = 14 + 40, f[14 + 6]
        else:
            continue
        if proto != 17 or int.from_bytes(f[l4 + 2:l4 + 4], "big") != 4791:
            continue
        bth = l4 + 8
        if f[bth] != 0xC5:
            continue
        out.append((int.from_bytes(f[bth + 5:bth + 8], "big"), int.from_bytes(f[bth + 9:bth + 12], "big"),
                    f[bth + 12]))
    return out



def test_read_responses_share_a_low_link_rate_in_psn_order_mr_cc_021(fabric):
    """MR-CC-021 (READ responses of one QP at no more than the link rate divided by the QPs with responses
    pending, sent in PSN order), MR-OOO-017: three QPs READ 256 KB each at once from one responder paced at
    200 Mb/s, with the default rto_min.  Every byte arrives, no RETRY_EXC_ERR; on the wire each QP's
    responses have consecutive PSNs in order, and any answer to a re-request (a spurious READ RTO,
    MR-LOSS-013) repeats only a few responses already sent (MR-OOO-022); the responder's counters show
    every response sent under pacing, packets that waited for their QP's clock, packets sent while the
    link was shared by two or more QPs at R/N <= R/2, and no QP left counted as pending."""
    topo, a, b = fabric
    b.ctx.set_read_rate(RATE)
    assert b.ctx.plane.nat.read_rate == RATE
    qa = [a.ctx.create_qp(a.pd, a.cq, a.cq) for _ in range(NQP)]
    qb = [b.ctx.create_qp(b.pd, b.cq, b.cq) for _ in range(NQP)]
    cap = None
    try:
        psn0 = [0x100 + 0x10000 * i for i in range(NQP)]
        for i in range(NQP):
            _connect(a, qa[i], qb[i], b, psn0[i])
            _connect(b, qb[i], qa[i], a, psn0[i])
        a.buf[:] = 0
        b.buf[:] = np.random.default_rng(21).integers(0, 256, b.buf.size, dtype=np.uint8)
        cap, frames = PortTap(topo, topo[1], "swB"), []       # both directions, in order

        for i in range(NQP):
            qa[i].post_send([SendWR(wr_id=i, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(i * SIZE, SIZE)],
                                    remote_addr=b.mr.addr + 1_000_000 + i * SIZE, rkey=b.mr.rkey)])
        got = []
        t0 = time.monotonic()
        while len(got) < NQP:
            a.ctx.progress()
            b.ctx.progress()
            got.extend(a.cq.poll(NQP - len(got)))
            frames += cap.frames()
            assert time.monotonic() - t0 < 60, ("READs did not complete", [q.native_counters() for q in qb])
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            frames += cap.frames()
        assert sorted((w.wr_id, w.status) for w in got) == [(i, WCStatus.SUCCESS) for i in range(NQP)], \
            [{k: v for k, v in q.native_counters().items() if v} for q in qa + qb]
        assert (a.buf[:NQP * SIZE] == b.buf[1_000_000:1_000_000 + NQP * SIZE]).all()

        npk = SIZE // 1024
        seen = _responses(frames)
        for i in range(NQP):
            mine = [(psn, fl) for qpn, psn, fl in seen if qpn == qa[i].qp_num]
            first = [psn for psn, fl in mine if not fl & 0x20]
            assert first == [psn0[i] + k for k in range(npk)], \
                (i, len(first), next((k, psn - psn0[i]) for k, psn in enumerate(first + [-1])
                                     if psn != psn0[i] + k))                                # MR-OOO-017
            # a spurious READ RTO (a loop descheduled past the default rto_min) may re-request the tail: only
            # responses already sent go again (RETX), never a copy of those still queued (MR-OOO-022)
            sent, again = set(), 0
            for psn, fl in mine:
                if fl & 0x20:
                    assert psn in sent, (i, psn - psn0[i])
                    again += 1
                sent.add(psn)
            nb, na = qb[i].native_counters(), qa[i].native_counters()
            assert nb["c_rd_resp_tx"] == npk + again and na["c_rd_resp_rx"] == npk, (na, nb)
            assert again == 0 or na["c_rereq"] > 0, (again, na)
            assert again <= npk // 4, (again, na, nb)
            assert nb["c_rd_paced"] == npk + again, nb              # every response went through the pacer
            assert nb["c_rd_pace_wait"] > 0, nb                     # ... and some waited for the QP's clock
            assert nb["c_rd_paced_shared"] > 0, nb                  # ... while other QPs had responses pending
            assert RATE // NQP <= nb["rd_pace_min_bps"] <= RATE // 2, nb
            assert nb["rd_pace_link_bps"] == RATE and nb["rd_pace_pending_qps"] == 0, nb
        order = [qpn for qpn, _, _ in seen]
        assert sum(x != y for x, y in zip(order, order[1:])) >= NQP, "the QPs' responses interleave"
    finally:
        if cap is not None:
            cap.close()
        for q in qa:
            a.ctx.destroy_qp(q)
        for q in qb:
            b.ctx.destroy_qp(q)
        b.ctx.set_read_rate(0)


SLOW = 500_000                   # 0.5 Mb/s: one ~1.1 KB response every ~18 ms after the first burst
SLOW_SIZE = 24 * 1024


def test_read_rto_while_responses_are_queued_queues_no_copy_mr_ooo_022_mr_loss_013(fabric):
    """MR-OOO-022 (a re-request's PSNs still queued at the responder are not queued again), MR-LOSS-013
    (a response received for the first time is progress; the READ timer runs for at least twice the
    interval between responses), MR-CC-021: one QP READs 24 KB from a responder paced at 0.5 Mb/s, a
    response every ~18 ms after the first burst, the requester's rto_min 2 ms (above a loaded host's
    round trip, well below the gap), so its READ RTO fires while most responses are still queued and
    re-requests the READ's tail; once the gap is observed the timer waits for it.  The responder queues none of them again
    (c_rereq_queued > 0): on the wire and in its counters the responses sent are the READ's 24 plus at
    most a few already sent (never a copy of the queued range); the READ completes intact, no
    RETRY_EXC_ERR."""
    topo, a, b = fabric
    b.ctx.set_read_rate(SLOW)
    qa, qb = a.ctx.create_qp(a.pd, a.cq, a.cq), b.ctx.create_qp(b.pd, b.cq, b.cq)
    cap = None
    try:
        psn = 0x7FFFF0
        _connect(a, qa, qb, b, psn, {"rto_min": 2000})
        _connect(b, qb, qa, a, psn)
        a.buf[:] = 0
        b.buf[:] = np.random.default_rng(22).integers(0, 256, b.buf.size, dtype=np.uint8)
        cap, frames = PortTap(topo, topo[1], "swB"), []       # both directions, in order

        qa.post_send([SendWR(wr_id=7, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(0, SLOW_SIZE)],
                             remote_addr=b.mr.addr + 2_000_000, rkey=b.mr.rkey)])
        got = []
        t0 = time.monotonic()
        while not got:
            a.ctx.progress()
            b.ctx.progress()
            got.extend(a.cq.poll(1))
            frames += cap.frames()
            assert time.monotonic() - t0 < 60, ("READ did not complete", qa.native_counters(), qb.native_counters())
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            b.ctx.progress()
            frames += cap.frames()
        na, nb = qa.native_counters(), qb.native_counters()
        assert [(w.wr_id, w.status) for w in got] == [(7, WCStatus.SUCCESS)], \
            ({k: v for k, v in na.items() if v}, {k: v for k, v in nb.items() if v})
        assert (a.buf[:SLOW_SIZE] == b.buf[2_000_000:2_000_000 + SLOW_SIZE]).all()

        npk = SLOW_SIZE // 1024
        mine = [(p, fl) for qpn, p, fl in _responses(frames) if qpn == qa.qp_num]
        assert [p for p, fl in mine if not fl & 0x20] == [(psn + k) & 0xFFFFFF for k in range(npk)]
        again = len(mine) - npk
        assert na["c_rd_rto"] > 0 and na["c_rereq"] > 0 and nb["c_rereq_rx"] > 0, (na, nb)   # the RTO fired
        assert nb["c_rereq_queued"] > 0, nb                          # ... and skipped the queued PSNs
        assert nb["c_rd_resp_tx"] == len(mine) == npk + again, (len(mine), nb)
        assert again < npk // 4, (again, na, nb)                     # no copy of the queued range
        assert na["c_rd_resp_rx"] == npk and nb["rd_pace_pending_qps"] == 0, (na, nb)
        assert na["rd_gap_ns"] > 0, na
    finally:
        if cap is not None:
            cap.close()
        a.ctx.destroy_qp(qa)
        b.ctx.destroy_qp(qb)
        b.ctx.set_read_rate(0)
