"""Native READ and atomics in the compiled data plane (native/plane.py) between two hosts over veth, through
the real XDP program and AF_XDP: NATIVE_READ_REQ / NATIVE_READ_RESP placed at their offset in any order,
lost responses re-requested (MR-OOO-020/021), READs split into request messages of at most W PSNs
(MR-NAT-022), completions in work-request order among WRITEs (MR-SACK-026), atomics executed once in PSN
order and answered with ATOMIC_ACKNOWLEDGE (MR-NAT-006, MR-OOO-023..028), under the seeded fault injector
of the switch namespace."""
from __future__ import annotations


import numpy as np
import pytest

from dp_players import collect, connected
from metaroce_xdp.verbs_types import SendWR, WCOpcode, WCStatus, WROpcode

pytestmark = pytest.mark.netns


def _fresh(a, b, psn=0x100, params=None):
    """A native pair; b's buffer (the READ source) random, a's (the READ destination) zero."""
    connected(a, b, seeds=(None, psn), sq_psn=psn, rq_psn=psn, min_rnr_timer=None, profile="native",
              native_params=params)


def _read(a, b, wr_id, dst, src, n):
    return SendWR(wr_id=wr_id, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(dst, n)], remote_addr=b.mr.addr + src,
                  rkey=b.mr.rkey)


def _write(a, b, wr_id, src, dst, n):
    return SendWR(wr_id=wr_id, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(src, n)], remote_addr=b.mr.addr + dst,
                  rkey=b.mr.rkey)


SIZES = [0, 1, 1023, 1024, 1025, 4096, 65_536, 300_001]


def test_native_read_sizes_intact_across_psn_wrap(fabric):
    """MR-NAT-016 (a READ of L bytes takes max(1, ceil(L / pmtu)) PSNs, across 2^24), MR-NAT-021/022
    (a READ longer than the request message limit goes as several messages, each its own MSN),
    MR-OOO-017/018 (responses with NETH, placed at their offset), MR-SACK-026 (in order): READs of 0 B
    to 300 KB complete with the responder's bytes, and the requester counted one response per PSN.
    Nothing is lost here, so the counts are exact only if no timer fires spuriously: on a loaded host a
    round trip can outlast the default 500 us RTO floor (a READ re-requested, its responses sent twice),
    so this pair's RTO floor is 100 ms (loss recovery is the subject of the tests below)."""
    topo, a, b = fabric
    _fresh(a, b, psn=0xFFFFC0, params={"rto_min": 100_000, "rto_initial": 200})
    assert a.qp.query()["profile"] == "native"
    wrs, off = [], 0
    for i, n in enumerate(SIZES):
        wrs.append(_read(a, b, i, off, 1_000_000 + off, n))
        off += n + 100
    a.qp.post_send(wrs)
    got = collect(a, len(wrs), [b], timeout=20)
    assert [(w.wr_id, w.status, w.opcode) for w in got] == [(i, WCStatus.SUCCESS, WCOpcode.RDMA_READ)
                                                             for i in range(len(SIZES))]
    off = 0
    for n in SIZES:
        assert (a.buf[off:off + n] == b.buf[1_000_000 + off:1_000_000 + off + n]).all(), n
        off += n + 100
    na, nb = a.qp.native_counters(), b.qp.native_counters()
    npk = sum(max(1, -(-n // 1024)) for n in SIZES)
    assert na["c_rd_resp_rx"] == npk == nb["c_rd_resp_tx"], (na, nb)
    assert na["c_rd_req"] == len(SIZES) + 2           # 300,001 B = 293 PSNs: three messages of <= 128 (W/2)
    assert na["c_rereq"] == 0 and nb["c_rd_exec"] == na["c_rd_req"]
    assert a.qp.query()["sq_psn"] == (0xFFFFC0 + npk) & 0xFFFFFF
    assert b.ctx.stats()["tx_ack"] == 0


def test_native_atomics_results_and_exactly_once(fabric):
    """MR-NAT-006 (compat atomic opcodes, ATOMIC_ACKNOWLEDGE), MR-OOO-023 (executed in PSN order, once),
    MR-OOO-025 (the original value, in order): FETCH_ADD and COMPARE_SWAP between WRITEs and READs return
    the values a sequential execution gives, the cell ends at the sum, and a READ after them sees it."""
    topo, a, b = fabric
    _fresh(a, b)
    cell = 2_000_000
    b.buf[cell:cell + 8] = np.frombuffer(np.uint64(1000).tobytes(), np.uint8)
    wrs = []
    for i in range(6):
        wrs.append(SendWR(wr_id=i, opcode=WROpcode.ATOMIC_FETCH_AND_ADD, sg_list=[a.sge(8 * i, 8)],
                          remote_addr=b.mr.addr + cell, rkey=b.mr.rkey, compare_add=7))
        wrs.append(_write(a, b, 100 + i, 10_000 + 4096 * i, 3_000_000 + 4096 * i, 4096))
    wrs.append(SendWR(wr_id=50, opcode=WROpcode.ATOMIC_CMP_AND_SWP, sg_list=[a.sge(64, 8)],
                      remote_addr=b.mr.addr + cell, rkey=b.mr.rkey, compare_add=1042, swap=5))
    wrs.append(SendWR(wr_id=51, opcode=WROpcode.ATOMIC_CMP_AND_SWP, sg_list=[a.sge(72, 8)],
                      remote_addr=b.mr.addr + cell, rkey=b.mr.rkey, compare_add=1042, swap=9))
    wrs.append(_read(a, b, 60, 80, cell, 8))
    a.buf[10_000:10_000 + 6 * 4096] = 7
    a.qp.post_send(wrs)
    got = collect(a, len(wrs), [b], timeout=20)
    assert [(w.wr_id, w.status) for w in got] == [(w.wr_id, WCStatus.SUCCESS) for w in wrs]
    vals = a.buf[:80].view(np.uint64)
    assert list(vals[:6]) == [1000 + 7 * i for i in range(6)]
    assert vals[8] == 1042 and vals[9] == 5            # the first CAS swapped, the second found 5
    assert a.buf[80:88].view(np.uint64)[0] == 5 == b.buf[cell:cell + 8].view(np.uint64)[0]
    assert (b.buf[3_000_000:3_000_000 + 6 * 4096] == 7).all()
    na, nb = a.qp.native_counters(), b.qp.native_counters()
    assert nb["c_at_exec"] == 8 and na["c_at_ack_rx"] == 8, (na, nb)


def test_lost_read_responses_and_requests_are_recovered_selectively(fabric):
    """MR-OOO-020/021 (a response missing while later ones arrived is re-requested for just its run, with
    RETX, the original MSN and offset), MR-OOO-022 (the responder answers the copy from its resource),
    MR-LOSS-013 (the tail of the last READ, which nothing later reveals, comes back at the RTO),
    MR-SACK-023 (a lost READ request is retransmitted): three READs with responses dropped in the middle,
    at the tail of the first READ, twice at the same PSN and at the tail of the last READ, and the second
    READ's request dropped once; every byte arrives, only the missing responses are sent again."""
    topo, a, b = fabric
    _fresh(a, b)
    sizes = [64 * 1024, 10_000, 4096]            # PSNs 0x100-0x13f, 0x140-0x149, 0x14a-0x14d
    rsp_drops = [0x105, 0x105, 0x120, 0x121, 0x13F, 0x14D]
    wrs, off = [], 0
    for i, n in enumerate(sizes):
        wrs.append(_read(a, b, i, off, 500_000 + off, n))
        off += n
    with fabric.impair("a", opcode_filter=[0xC5], psn_drop_once=rsp_drops) as fa, \
            fabric.impair("b", opcode_filter=[0xC4], psn_drop_once=[0x140]) as fb:
        a.qp.post_send(wrs)
        got = collect(a, len(wrs), [b], timeout=20)
        assert fa.stats()["psn_dropped"] == len(rsp_drops) and fb.stats()["psn_dropped"] == 1
    assert [(w.wr_id, w.status) for w in got] == [(i, WCStatus.SUCCESS) for i in range(len(sizes))]
    assert (a.buf[:off] == b.buf[500_000:500_000 + off]).all()
    na, nb = a.qp.native_counters(), b.qp.native_counters()
    assert na["c_rereq"] >= 4 and nb["c_rereq_rx"] >= 4, (na, nb)
    # selective: the responder sent each response once, plus only what was re-requested
    npk = 64 + 10 + 4
    assert npk + len(rsp_drops) <= nb["c_rd_resp_tx"] <= npk + 2 * len(rsp_drops) + 2, nb
    assert na["c_rd_resp_rx"] == npk and na["c_retx"] >= 1 and nb["c_rd_exec"] == 3


def test_read_window_follows_ce_marked_responses_and_its_own_rtt(fabric):
    """MR-CC-019 on the wire: the READ window takes its RTT samples from request to first response and its
    CE signals from the IP ECN field of READ responses (here marked by the switch on the way back, MR-CC-025's
    counterpart on the requester): unmarked, a 256 KiB READ only grows it; with every response marked it is
    cut (MR-CC-012) and the READ still completes intact (MR-CC-020 lets one request out when none is
    outstanding); the request window's counters see none of it."""
    topo, a, b = fabric
    n = 256 * 1024
    _fresh(a, b)
    a.qp.post_send([_read(a, b, 1, 0, 500_000, n)])
    assert [(w.wr_id, w.status) for w in collect(a, 1, [b], timeout=20)] == [(1, WCStatus.SUCCESS)]
    assert (a.buf[:n] == b.buf[500_000:500_000 + n]).all()
    na = a.qp.native_counters()
    assert na["rd_srtt_ns"] > 0 and na["c_rd_dec_ecn"] == 0 and na["rd_cwnd"] > 16, na
    _fresh(a, b, psn=0x2000)
    with fabric.impair("a", opcode_filter=[0xC5], ecn_ce_ppm=1_000_000) as fa:
        a.qp.post_send([_read(a, b, 2, 0, 500_000, n)])
        got = collect(a, 1, [b], timeout=20)
        st = fa.stats()
    assert [(w.wr_id, w.status) for w in got] == [(2, WCStatus.SUCCESS)]
    assert (a.buf[:n] == b.buf[500_000:500_000 + n]).all()
    assert st["ce_marked"] >= n // 1024 and st["ce_not_ect"] == 0, st       # READ responses are ECT
    na = a.qp.native_counters()
    assert na["c_rd_dec_ecn"] >= 1 and na["rd_cwnd"] < 16 and na["c_dec_ecn"] == 0, na


def test_lost_atomic_acknowledge_is_replayed_and_answered_from_the_saved_result(fabric):
    """MR-OOO-027 (an atomic whose PSN was acknowledged without its result is sent again), MR-OOO-024 (the
    copy is answered from the saved result, never executed twice), MR-OOO-025 (a second answer is not
    owed and is dropped): three FETCH_ADDs with the first ATOMIC_ACKNOWLEDGE dropped twice."""
    topo, a, b = fabric
    _fresh(a, b)
    cell = 2_000_000
    b.buf[cell:cell + 8] = np.frombuffer(np.uint64(50).tobytes(), np.uint8)
    wrs = [SendWR(wr_id=i, opcode=WROpcode.ATOMIC_FETCH_AND_ADD, sg_list=[a.sge(8 * i, 8)],
                  remote_addr=b.mr.addr + cell, rkey=b.mr.rkey, compare_add=3) for i in range(3)]
    with fabric.impair("a", opcode_filter=[0x12], psn_drop_once=[0x100, 0x100]) as fa:
        a.qp.post_send(wrs)
        got = collect(a, 3, [b], timeout=20)
        assert fa.stats()["psn_dropped"] == 2
    assert [(w.wr_id, w.status) for w in got] == [(i, WCStatus.SUCCESS) for i in range(3)]
    assert list(a.buf[:24].view(np.uint64)) == [50, 53, 56]
    assert b.buf[cell:cell + 8].view(np.uint64)[0] == 59          # executed exactly three times
    na, nb = a.qp.native_counters(), b.qp.native_counters()
    assert nb["c_at_exec"] == 3 and na["c_at_replay"] >= 2 and nb["c_rereq_rx"] >= 2, (na, nb)


def _faa_run(a, b, n, cell):
    """n FETCH_ADDs of i (wr_id i) on one cell of b, results at a.buf[8 * i]."""
    b.buf[cell:cell + 8] = 0
    return [SendWR(wr_id=i, opcode=WROpcode.ATOMIC_FETCH_AND_ADD, sg_list=[a.sge(8 * i, 8)],
                   remote_addr=b.mr.addr + cell, rkey=b.mr.rkey, compare_add=i) for i in range(n)]


def _faa_check(a, b, got, n, cell):
    keys = ("c_at_replay", "c_rd_rto", "c_at_ack_rx", "c_at_ack_bad", "c_at_exec", "c_rereq_rx", "c_rd_dup_drop")
    assert [(w.wr_id, w.status) for w in got] == [(i, WCStatus.SUCCESS) for i in range(n)], \
        " ".join(f"{k}={x.qp.native_counters()[k]}" for x in (a, b) for k in keys)
    assert list(a.buf[:8 * n].view(np.uint64)) == [i * (i - 1) // 2 for i in range(n)]     # in PSN order, once
    assert b.buf[cell:cell + 8].view(np.uint64)[0] == n * (n - 1) // 2
    na, nb = a.qp.native_counters(), b.qp.native_counters()
    assert nb["c_at_exec"] == n and nb["c_rd_dup_drop"] == 0, (na, nb)
    return na, nb


def test_atomic_result_owed_is_kept_while_later_atomics_are_answered(fabric):
    """MR-OOO-028 (max_rd_atomic counted from the oldest READ or atomic still owed its response), MR-OOO-027,
    MR-OOO-024: 48 FETCH_ADDs at max_rd_atomic 16 with the first one's ATOMIC_ACKNOWLEDGE dropped twice.  The
    later results arrive meanwhile; had each freed a place for a new atomic, the 16th new one would have taken
    the responder resource that holds the first result, the replays been dropped (c_rd_dup_drop) and the QP
    ended with RETRY_EXC_ERR (the demo's lossy round, 2026-12-04)."""
    topo, a, b = fabric
    _fresh(a, b)
    cell, n = 2_000_000, 48
    wrs = _faa_run(a, b, n, cell)
    with fabric.impair("a", opcode_filter=[0x12], psn_drop_once=[0x100, 0x100]) as fa:
        a.qp.post_send(wrs)
        got = collect(a, n, [b], timeout=30)
        dropped = fa.stats()["psn_dropped"]
    na, nb = _faa_check(a, b, got, n, cell)
    assert dropped == 2
    assert na["c_at_replay"] >= 2 and nb["c_rereq_rx"] >= 2, (na, nb)


def test_responder_reuses_the_resource_of_the_lowest_executed_psn(fabric):
    """MR-OOO-023 (a new READ or atomic takes a free resource, else the executed one of the lowest PSN),
    MR-OOO-024, MR-OOO-028: the first of 40 FETCH_ADDs (max_rd_atomic 16) is lost once, so the responder records
    it after the next 15; the second one's ATOMIC_ACKNOWLEDGE is dropped twice.  The next atomic the requester
    may send takes the first one's resource (recorded last, answered), not the second's, whose result is
    still owed: recycling resources in arrival order dropped its replays (RETRY_EXC_ERR)."""
    topo, a, b = fabric
    _fresh(a, b)
    cell, n = 2_000_000, 40
    wrs = _faa_run(a, b, n, cell)
    with fabric.impair("b", opcode_filter=[0x14], psn_drop_once=[0x100]) as fb, \
            fabric.impair("a", opcode_filter=[0x12], psn_drop_once=[0x101, 0x101]) as fa:
        a.qp.post_send(wrs)
        got = collect(a, n, [b], timeout=30)
        dropped = fb.stats()["psn_dropped"], fa.stats()["psn_dropped"]
    na, nb = _faa_check(a, b, got, n, cell)
    assert dropped == (1, 2)
    assert nb["c_ooo"] >= 15 and na["c_at_replay"] >= 2, (na, nb)


def test_reads_writes_atomics_under_every_fault_kind(fabric):
    """MR-OOO-018 (responses placed in any order, duplicates ignored), MR-SACK-013 (request copies not
    executed again), MR-OOO-023/024 (atomics exactly once), MR-SACK-026 (completions in posting order):
    a seeded mix of READs, WRITEs and FETCH_ADDs under drop, duplication, corruption and reordering both
    ways completes in order, every READ with the responder's bytes, every WRITE placed, and the
    FETCH_ADD results are the distinct partial sums of one sequential execution."""
    topo, a, b = fabric
    _fresh(a, b)
    a.buf[:1_000_000] = np.random.default_rng(9).integers(0, 256, 1_000_000, dtype=np.uint8)
    cell = 3_900_000
    b.buf[cell:cell + 8] = 0
    rng = np.random.default_rng(17)
    wrs, reads, writes, faa = [], [], [], []
    off = 0
    for i in range(36):
        n = int(rng.choice([1, 100, 1024, 1025, 4096, 20_000, 65_536]))
        kind = i % 3
        if kind == 0:
            wrs.append(_read(a, b, i, 1_000_000 + off, 1_000_000 + off, n))
            reads.append((1_000_000 + off, n))
        elif kind == 1:
            wrs.append(_write(a, b, i, off, 2_000_000 + off, n))
            writes.append((off, 2_000_000 + off, n))
        else:
            wrs.append(SendWR(wr_id=i, opcode=WROpcode.ATOMIC_FETCH_AND_ADD, sg_list=[a.sge(3_000_000 + 8 * i, 8)],
                              remote_addr=b.mr.addr + cell, rkey=b.mr.rkey, compare_add=i))
            faa.append(i)
        off += n + 64
    knobs = dict(drop_ppm=20_000, dup_ppm=10_000, corrupt_ppm=10_000, reorder_ppm=10_000, reorder_delay_us=500)
    with fabric.impair("b", seed=13, **knobs) as fb, \
            fabric.impair("a", seed=14, **knobs) as fa:
        a.qp.post_send(wrs)
        got = collect(a, len(wrs), [b], timeout=60)
        hit = {k: sum(f.stats()[k] for f in (fa, fb)) for k in ("dropped", "duplicated", "corrupted")}
    assert [(w.wr_id, w.status) for w in got] == [(w.wr_id, WCStatus.SUCCESS) for w in wrs]
    for o, n in reads:
        assert (a.buf[o:o + n] == b.buf[o:o + n]).all(), (o, n)
    for src, dst, n in writes:
        assert (a.buf[src:src + n] == b.buf[dst:dst + n]).all(), (src, dst, n)
    res = [int(a.buf[3_000_000 + 8 * i:3_000_008 + 8 * i].view(np.uint64)[0]) for i in faa]
    assert res == [sum(faa[:k]) for k in range(len(faa))]          # in PSN order, each once
    assert b.buf[cell:cell + 8].view(np.uint64)[0] == sum(faa)
    assert all(hit.values()), hit


def test_perf_read_bw_on_the_native_profile(make_fabric):
    """`metaroce perf read-bw --plane compiled --profile native` (MR-NAT-001, MR-CM-016): the compiled
    benchmark loop posts native READs (dp.drive through post_send_n) and every one completes."""
    from perf_players import perf_run
    fab = make_fabric("flat", side=None)
    r, _ = perf_run(fab.topo, "read-bw", 18598, ["--plane", "compiled", "--profile", "native"],
                    ["--plane", "compiled", "--profile", "native", "-s", "65536", "-n", "300"])
    assert r["profile"] == "native" and r["gbps"] > 0 and r["iterations"] == 300, r
