"""The native profile in the compiled data plane (native/plane.py) between two hosts over veth, through the
real XDP program and AF_XDP: native requests (NETH, RSNETH) and NATIVE_SACK instead of ACKNOWLEDGE,
out-of-order placement with completions in work-request order, selective retransmission under the
seeded fault injector of tests/dp/test_dp_loss.py, and fewer retransmitted packets than compat
go-back-N on the same seed."""
from __future__ import annotations

import time

import numpy as np
import pytest

from dp_players import FULL, collect, connected, run_until
from metaroce_xdp.verbs_types import QPAttr, QPState, RecvWR, SendWR, WCOpcode, WCStatus, WROpcode

pytestmark = pytest.mark.netns


def _fresh(a, b, profile="native", psn=0x100, params=None):
    connected(a, b, seeds=(11, None), sq_psn=psn, rq_psn=psn, min_rnr_timer=None, profile=profile,
              native_params=params)


def _write(a, b, wr_id, src, dst, n, op=WROpcode.RDMA_WRITE, imm=0):
    return SendWR(wr_id=wr_id, opcode=op, sg_list=[a.sge(src, n)], remote_addr=b.mr.addr + dst, rkey=b.mr.rkey,
                  imm_data=imm)


def test_native_write_send_and_imm_complete_intact_across_psn_wrap(fabric):
    """MR-NAT-005, MR-SACK-001: a native pair exchanges only native requests and NATIVE_SACKs (no
    ACKNOWLEDGE leaves the responder); WRITE, WRITE with immediate and SEND complete with their data,
    PSNs crossing 2^24 (MR-NAT-016); receive completions carry length and immediate (MR-OOO-013)."""
    topo, a, b = fabric
    _fresh(a, b, psn=0xFFFFA0)
    assert a.qp.query()["profile"] == "native"
    b.qp.post_recv([RecvWR(wr_id=500, sg_list=[b.sge(3_000_000, 5000)]),
                    RecvWR(wr_id=501, sg_list=[b.sge(3_100_000, 64)])])
    a.qp.post_send([_write(a, b, 1, 0, 0, 200_000),
                    SendWR(wr_id=2, opcode=WROpcode.SEND, sg_list=[a.sge(300_000, 4097)]),
                    _write(a, b, 3, 400_000, 1_000_000, 3000, WROpcode.RDMA_WRITE_WITH_IMM, imm=0xABCD),
                    _write(a, b, 4, 500_000, 2_000_000, 0)])
    got = collect(a, 4, [b])
    assert [(w.wr_id, w.status) for w in got] == [(i, WCStatus.SUCCESS) for i in (1, 2, 3, 4)]
    rcv = collect(b, 2, [a])
    assert [(w.wr_id, w.status, w.opcode, w.byte_len) for w in rcv] == [
        (500, WCStatus.SUCCESS, WCOpcode.RECV, 4097), (501, WCStatus.SUCCESS, WCOpcode.RECV_RDMA_WITH_IMM, 3000)]
    assert rcv[1].imm_data == 0xABCD
    assert (b.buf[:200_000] == a.buf[:200_000]).all()
    assert (b.buf[3_000_000:3_004_097] == a.buf[300_000:304_097]).all()
    assert (b.buf[1_000_000:1_003_000] == a.buf[400_000:403_000]).all()
    na, nb = a.qp.native_counters(), b.qp.native_counters()
    assert na["c_tx"] - na["c_retx"] == 196 + 5 + 3 + 1, na
    assert nb["c_sack_tx"] >= 1 and na["c_sack_rx"] >= 1 and na["c_sack_inv"] == 0
    assert b.ctx.stats()["tx_ack"] == 0 and b.ctx.stats()["tx_nak"] == 0      # MR-SACK-001
    assert a.qp.query()["sq_psn"] == (0xFFFFA0 + 205) & 0xFFFFFF
    assert b.ctx.loader.drops().get("WRONG_PROFILE", 0) == 0


def test_small_messages_are_acknowledged_by_coalescing_mr_nat_023_mr_sack_015(fabric):
    """MR-NAT-023 (as revised), MR-SACK-014 (3), MR-SACK-015: a steady stream of single-packet WRITEs
    (1,000 8-byte messages queued at once) carries AckReq only on the last packet of each burst, so the
    responder coalesces: fewer SACKs than data packets (with AckReq on every message's last packet it
    sent one per packet), every message completes in order with its data."""
    topo, a, b = fabric
    _fresh(a, b, psn=0x300)
    n = 1000
    a.qp.post_send([_write(a, b, i, 8 * i, 8 * i, 8) for i in range(n)])
    got = collect(a, n, [b], timeout=30.0)
    assert [(w.wr_id, w.status) for w in got] == [(i, WCStatus.SUCCESS) for i in range(n)]
    assert (b.buf[:8 * n] == a.buf[:8 * n]).all()
    na, nb = a.qp.native_counters(), b.qp.native_counters()
    data = na["c_tx"]
    assert data >= n and nb["c_sack_tx"] >= 1 and na["c_sack_inv"] == 0
    assert nb["c_sack_tx"] < 0.75 * data, (nb["c_sack_tx"], data, na, nb)


def test_native_refuses_what_it_does_not_carry(fabric):
    """MR-NAT-010: SEND with invalidate has no native opcode (EINVAL at post time), for post_send and for
    compiled posting alike; nothing is queued.  (READ and atomics: tests/native/test_dp_native_read.py.)"""
    topo, a, b = fabric
    _fresh(a, b)
    with pytest.raises(ValueError):
        a.qp.post_send(SendWR(wr_id=2, opcode=WROpcode.SEND_WITH_INV, sg_list=[a.sge(0, 8)], invalidate_rkey=1))
    with pytest.raises(ValueError):             # compiled posting (perf, dp.drive) is checked the same way
        a.qp.send_wqe(SendWR(wr_id=3, opcode=WROpcode.SEND_WITH_INV, sg_list=[a.sge(0, 8)], invalidate_rkey=1))
    assert a.qp.query()["sq_outstanding"] == 0


def test_sack_retransmits_only_the_dropped_packets_and_places_out_of_order(fabric):
    """MR-SACK-014 (a gap triggers a SACK), MR-SACK-020/021/023 (the sender retransmits exactly the PSNs no
    SACK reported), MR-OOO-001 (packets after a gap are placed at once, not discarded as go-back-N does),
    MR-OOO-013 (receive completions in WQE order although a later SEND arrived whole first)."""
    topo, a, b = fabric
    # the reordering window at its floor, above this host's scheduling delay between the two players (MR-CC-042):
    # the test is about what SACKs make the sender resend, not about RACK's timing (c_spurious counts that)
    _fresh(a, b, params={"reo_floor": 5000, "rto_min": 20000})
    # PSNs 0x100 + 5, + 17, + 40 of the WRITE and the first packet of the first SEND (PSN 0x100 + 64)
    drops = [0x105, 0x111, 0x128, 0x140]
    b.qp.post_recv([RecvWR(wr_id=600 + i, sg_list=[b.sge(3_000_000 + i * 8192, 8192)]) for i in range(3)])
    with fabric.impair("b", psn_drop_once=drops) as fb:
        a.qp.post_send([_write(a, b, 1, 0, 0, 64 * 1024)] +
                       [SendWR(wr_id=10 + i, opcode=WROpcode.SEND, sg_list=[a.sge(100_000 + i * 8192, 2048 + i)])
                        for i in range(3)])
        got = collect(a, 4, [b], timeout=20)
        rcv = collect(b, 3, [a], timeout=5)
        assert fb.stats()["psn_dropped"] == len(drops)
    assert [(w.wr_id, w.status) for w in got] == [(1, WCStatus.SUCCESS), (10, WCStatus.SUCCESS),
                                                  (11, WCStatus.SUCCESS), (12, WCStatus.SUCCESS)]
    assert [(w.wr_id, w.byte_len) for w in rcv] == [(600, 2048), (601, 2049), (602, 2050)]
    assert (b.buf[:64 * 1024] == a.buf[:64 * 1024]).all()
    for i in range(3):
        o = 3_000_000 + i * 8192
        assert (b.buf[o:o + 2048 + i] == a.buf[100_000 + i * 8192:100_000 + i * 8192 + 2048 + i]).all()
    na, nb = a.qp.native_counters(), b.qp.native_counters()
    assert na["c_retx"] == len(drops), na                  # only what was missing
    assert nb["c_ooo"] >= 1 and nb["c_dup"] == 0, nb
    assert b.ctx.stats()["rx_oos"] == 0                    # nothing discarded for being out of sequence


def _transfer(fabric, profile, seed, ppm, n_wr=16, size=128 * 1024):
    _, a, b = fabric
    _fresh(a, b, profile=profile)
    pk0 = a.ctx.stats()["tx"]
    wrs = [_write(a, b, i, i * size, i * size, size) for i in range(n_wr)]
    with fabric.impair("b", seed=seed, drop_ppm=ppm) as fb, \
            fabric.impair("a", seed=seed + 1, drop_ppm=ppm) as fa:
        t0 = time.monotonic()
        a.qp.post_send(wrs)
        got = collect(a, n_wr, [b], timeout=60)
        dt = time.monotonic() - t0
        dropped = fb.stats()["dropped"] + fa.stats()["dropped"]
    assert [(w.wr_id, w.status) for w in got] == [(i, WCStatus.SUCCESS) for i in range(n_wr)]
    assert (b.buf[:n_wr * size] == a.buf[:n_wr * size]).all()
    sent = a.ctx.stats()["tx"] - pk0
    return sent - n_wr * size // 1024, dropped, n_wr * size / dt


def test_native_retransmits_fewer_packets_than_go_back_n_on_the_same_seed(fabric):
    """MR-SACK-023, MR-LOSS-007: 2 MiB of WRITEs at 1 % seeded loss each way (data and acknowledgements),
    intact either way; the native profile resends fewer packets than compat go-back-N (MR-NAK-003) on the
    same fault seed.  (Goodput is measured by the benchmark, not asserted.)"""
    retx_c, drop_c, _ = _transfer(fabric, "compat", seed=21, ppm=10_000)
    retx_n, drop_n, _ = _transfer(fabric, "native", seed=21, ppm=10_000)
    assert drop_c > 0 and drop_n > 0
    assert retx_n < retx_c, (retx_n, retx_c)


def test_native_every_fault_kind_every_operation_intact(fabric):
    """MR-SACK-013 (duplicates are not placed again), MR-OOO-001/013 (reordered packets placed where they
    belong, receive completions in order), MR-SACK-019 (corrupt SACKs never reach the logic: the ICRC
    drops them), MR-LOSS-007 (lost SACKs recovered): seeded drop, duplication, corruption and reordering
    each way; every WRITE and SEND completes in order with its bytes."""
    topo, a, b = fabric
    _fresh(a, b)
    rng = np.random.default_rng(5)
    wrs, checks, recvs = [], [], 0
    off = 0
    for i in range(30):
        n = int(rng.choice([1, 8, 1000, 1024, 1025, 4096, 30_000, 65_536]))
        src, dst = off, 2_000_000 + off
        off += n + 64
        if i % 2:
            b.qp.post_recv(RecvWR(wr_id=1000 + i, sg_list=[b.sge(dst, n)]))
            recvs += 1
            wrs.append(SendWR(wr_id=i, opcode=WROpcode.SEND, sg_list=[a.sge(src, n)]))
        else:
            wrs.append(_write(a, b, i, src, dst, n))
        checks.append((src, dst, n))
    knobs = dict(drop_ppm=20_000, dup_ppm=10_000, corrupt_ppm=10_000, reorder_ppm=10_000, reorder_delay_us=500)
    with fabric.impair("b", seed=3, **knobs) as fb, \
            fabric.impair("a", seed=4, **knobs) as fa:
        a.qp.post_send(wrs)
        got = collect(a, len(wrs), [b], timeout=60)
        rcv = collect(b, recvs, [a], timeout=10)
        hit = {k: sum(f.stats()[k] for f in (fa, fb)) for k in ("dropped", "duplicated", "corrupted")}
    assert [(w.wr_id, w.status) for w in got] == [(w.wr_id, WCStatus.SUCCESS) for w in wrs]
    assert [w.wr_id for w in rcv] == [1000 + i for i in range(1, 30, 2)]
    assert all(w.status == WCStatus.SUCCESS and w.opcode == WCOpcode.RECV for w in rcv)
    for src, dst, n in checks:
        assert (a.buf[src:src + n] == b.buf[dst:dst + n]).all(), (src, dst, n)
    assert all(hit.values()), hit
    nb = b.qp.native_counters()
    assert nb["c_dup"] >= 1 and a.qp.native_counters()["c_retx"] >= 1


def _negotiate(topo, a, b, prof_a, prof_b, port):
    """a connects to b over the MRC1 exchange (dp/cmconnect.py); returns (a's result, b's result)."""
    from metaroce_xdp.dp.cmconnect import connect_qp, with_acceptor
    a.new_qp(), b.new_qp()
    for s in (a, b):
        s.qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))

    def active():
        with topo.enter(a.ns):
            return connect_qp(a.qp, b.ctx.gid, port=port, profile=prof_a, timeout=10)
    return with_acceptor(active, b.qp, port, profile=prof_b, enter=lambda: topo.enter(b.ns))


@pytest.mark.parametrize("prof_a,prof_b,want", [("auto", "auto", "native"), ("auto", "compat", "compat"),
                                                 ("native", "auto", "native")])
def test_profile_negotiation_and_fallback_to_compat(fabric, prof_a, prof_b, want):
    """MR-NAT-001/002, MR-CM-013/014/016: the profile comes from the agreed capability set of the MRC1
    exchange -- native when both ends offer it, compat (and still working) when one end is compat-only;
    a WRITE then completes intact on the agreed profile."""
    topo, a, b = fabric
    ra, rb = _negotiate(topo, a, b, prof_a, prof_b, 18600 + len(prof_a) * 10 + len(prof_b))
    assert ra["profile"] == rb["profile"] == want == a.qp.query()["profile"] == b.qp.query()["profile"]
    a.buf[:] = 9
    b.buf[:] = 0
    a.qp.post_send(_write(a, b, 1, 0, 0, 20_000))
    assert [(w.wr_id, w.status) for w in collect(a, 1, [b])] == [(1, WCStatus.SUCCESS)]
    assert (b.buf[:20_000] == 9).all()
    assert (a.qp.native_counters().get("c_tx", 0) > 0) == (want == "native")


def test_native_only_endpoint_refuses_a_compat_only_peer(fabric):
    """MR-CM-017: an endpoint that requires the native profile (COMPAT_OK clear) rejects a peer that offers
    no native capability with NATIVE_REQUIRED; neither QP reaches RTS."""
    from metaroce_xdp import cm
    topo, a, b = fabric
    with pytest.raises(cm.Rejected) as ei:
        _negotiate(topo, a, b, "native", "compat", 18650)
    assert ei.value.reason == cm.Reason.NATIVE_REQUIRED
    assert a.qp.query_state() != QPState.RTS and b.qp.query_state() != QPState.RTS


def test_rnr_nak_sack_then_the_send_completes_once_a_receive_is_posted(fabric):
    """MR-OOO-012 (a SEND with no receive WQE is not recorded), MR-SACK-035 (an RNR NAK-type SACK names its
    first PSN), MR-SACK-036/039 (the requester waits the RNR timer, sends nothing of it meanwhile) and
    MR-SACK-042 (after the wait it resends): once the receive is posted the SEND completes intact, and a
    WRITE posted behind it completes after it (MR-SACK-026)."""
    topo, a, b = fabric
    _fresh(a, b)
    a.qp.post_send([SendWR(wr_id=1, opcode=WROpcode.SEND, sg_list=[a.sge(0, 3000)]),
                    _write(a, b, 2, 10_000, 10_000, 5000)])
    t0 = time.monotonic()
    run_until([a, b], lambda: a.qp.native_counters()["c_rnr"] >= 2 or time.monotonic() - t0 > 0.5, timeout=5)
    assert a.cq.poll(4) == []
    na, nb = a.qp.native_counters(), b.qp.native_counters()
    assert na["c_rnr"] >= 1 and nb["c_notready"] >= 1, (na, nb)
    b.qp.post_recv(RecvWR(wr_id=77, sg_list=[b.sge(100_000, 4096)]))
    got = collect(a, 2, [b])
    assert [(w.wr_id, w.status) for w in got] == [(1, WCStatus.SUCCESS), (2, WCStatus.SUCCESS)]
    rcv = collect(b, 1, [a])
    assert [(w.wr_id, w.status, w.byte_len) for w in rcv] == [(77, WCStatus.SUCCESS, 3000)]
    assert (b.buf[100_000:103_000] == a.buf[:3000]).all() and (b.buf[10_000:15_000] == a.buf[10_000:15_000]).all()


@pytest.mark.parametrize("srv_args,want", [(["--plane", "compiled"], "native"),
                                            (["--plane", "compiled", "--profile", "compat"], "compat")],
                         ids=["auto", "compat"])
def test_perf_profile_switch(make_fabric, srv_args, want):
    """`metaroce perf --plane compiled` with the default --profile auto (MR-NAT-001/002, MR-CM-016): write-bw
    runs native against an auto server and falls back to compat against a compat-only one, the data arriving
    intact each time; both sides report which."""
    from perf_players import perf_run
    fab = make_fabric("flat", side=None)
    r, s = perf_run(fab.topo, "write-bw", 18597, srv_args, ["--plane", "compiled", "-s", "65536", "-n", "100"])
    assert r["profile"] == s["profile"] == want and r["gbps"] > 0 and r["iterations"] == 100
    assert r["peer_verified"] is True and s["verified"] is True
