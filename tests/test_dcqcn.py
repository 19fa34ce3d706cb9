"""DCQCN on compat QPs: the reaction point as a unit, the notification point and the
whole chain (CE mark -> CNP -> rate cut) between two in-process engines, the CNP's
bytes, and the user-space twins of the XDP program's header checks (IPv4 header
checksum, P_Key) on the in-process path.  The veth version, with the XDP program
consuming CNPs, is tests/test_endpoint_veth.py::test_ecn_ce_marks_slow_the_sender.
"""
from __future__ import annotations

import numpy as np
import pytest

from metaroce_xdp.rc.dcqcn import Dcqcn, DcqcnParams, NotificationPoint, ReactionPoint
from metaroce_xdp.rc.port import Faults, mark_ce
from metaroce_xdp.rc.rxparse import parse, pkey_match
from metaroce_xdp.verbs_types import QPAttr, QPState, SendFlags, SendWR, WCStatus, WROpcode
from metaroce_xdp.wire import Op, decode, encode
from metaroce_xdp.wire.errors import DecodeReason, MalformedPacket

from rc_players import loop_pair, run_until

P = DcqcnParams()                 # the defaults of 05-congestion.md Table 5.7.2
LINE = P.r_line_bps
US = 1000


def test_defaults_are_the_spec_table():
    """MR-CNP-003, MR-CNP-006, MR-CC-030: N 50 us, g 1/256, K = T = 55 us, B 10 MiB, F 5, DSCP 48."""
    assert (P.cnp_interval_ns, P.g, P.k_ns, P.t_ns, P.b_bytes, P.f) == (50_000, 1 / 256, 55_000, 55_000, 10 << 20, 5)
    assert (P.r_ai_bps, P.r_hai_bps, P.r_min_bps, P.alpha_init, P.cnp_dscp) == (40e6, 400e6, 10e6, 1.0, 48)


def test_env_overrides(monkeypatch):
    monkeypatch.setenv("METAROCE_DCQCN_CNP_INTERVAL_NS", "100000")
    monkeypatch.setenv("METAROCE_DCQCN_ENABLED", "0")
    p = DcqcnParams.from_env(r_line_bps=25e9)
    assert p.cnp_interval_ns == 100_000 and p.enabled is False and p.r_line_bps == 25e9
    with pytest.raises(ValueError):
        DcqcnParams.from_env(r_min_bps=0)


def test_rate_falls_on_cnp():
    """MR-CNP-006, MR-CC-035, MR-CC-038: start at R_line with alpha 1; each CNP sets Rt = Rc,
    Rc = Rc (1 - alpha / 2), alpha = (1 - g) alpha + g."""
    rp = ReactionPoint(P, now=0)
    assert rp.rc == rp.rt == LINE and rp.alpha == 1.0
    rp.on_cnp(1 * US)
    assert rp.rt == LINE and rp.rc == pytest.approx(LINE / 2) and rp.alpha == pytest.approx(1.0)
    rp.on_cnp(51 * US)                              # the next cnp_interval (the rate timer is not due)
    assert rp.rt == pytest.approx(LINE / 2) and rp.rc == pytest.approx(LINE / 4)
    assert rp.rx_cnp == 2 and rp.rate_cuts == 2 and rp.rate_min == pytest.approx(LINE / 4)


def test_rate_never_below_r_min():
    """MR-CNP-008, MR-CC-038."""
    rp = ReactionPoint(P, now=0)
    for i in range(200):
        rp.on_cnp(i * P.cnp_interval_ns)
    assert rp.rc == P.r_min_bps


def test_one_cut_per_cnp_interval():
    """MR-CC-035: 20 CNPs within one cnp_interval (copies or forgeries: a notification point sends no more,
    MR-CNP-003) cut the rate once, the rest counted; the next interval's CNP cuts again.  With
    cnp_interval 0 each CNP cuts."""
    rp = ReactionPoint(P, now=0)
    for i in range(20):
        rp.on_cnp(1 * US + i)
    rp.on_cnp(2 * US, count=5)
    assert rp.rx_cnp == 25 and rp.rate_cuts == 1 and rp.cnp_coalesced == 24
    assert rp.rc == pytest.approx(LINE / 2)
    rp.on_cnp(1 * US + P.cnp_interval_ns)
    assert rp.rate_cuts == 2 and rp.rc == pytest.approx(LINE / 4)
    rp0 = ReactionPoint(DcqcnParams(cnp_interval_ns=0), now=0)
    rp0.on_cnp(1 * US, count=3)
    assert rp0.rc == pytest.approx(LINE / 8)


def test_rate_recovers_without_cnps():
    """MR-CNP-007, MR-CC-036, MR-CC-037: alpha decays once per K without a CNP; the rate timer
    gives F fast-recovery steps (Rc halfway to Rt each), then additive increase of Rt, until
    R_line."""
    rp = ReactionPoint(P, now=0)
    rp.on_cnp(0)
    alpha0, rc0 = rp.alpha, rp.rc
    rp.advance(P.t_ns)                              # one rate timer expiry: fast recovery
    assert rp.rt == LINE and rp.rc == pytest.approx((LINE + rc0) / 2)
    rp.advance(5 * P.t_ns)                          # F = 5 steps: still fast recovery, Rt unchanged
    assert rp.t_cnt == 5 and rp.rt == LINE
    assert LINE - rp.rc == pytest.approx((LINE - rc0) / 32)
    # the alpha period that saw the CNP does not decay alpha; the 4 after it do
    assert rp.alpha == pytest.approx(alpha0 * (1 - P.g) ** 4)
    rp.advance(10**9)                               # a second later: back at line rate
    assert rp.rc == LINE and rp.rt == LINE
    assert rp.alpha < 1e-6


def test_additive_and_hyper_increase():
    """MR-CC-037: after F steps Rt grows by R_AI per step; when both counters exceed F, by R_HAI."""
    p = DcqcnParams(r_line_bps=100e9, b_bytes=1000, cnp_interval_ns=0)     # 8 cuts at once
    rp = ReactionPoint(p, now=0)
    for _ in range(8):
        rp.on_cnp(0)
    rt = rp.rt
    rp.advance(6 * p.t_ns)                          # T_cnt 1..4: fast recovery; 5, 6: additive
    assert rp.t_cnt == 6 and rp.rt == pytest.approx(rt + 2 * p.r_ai_bps)
    rp.on_sent(7 * 1000)                            # B_cnt 1..5: additive; 6, 7: min(6, B_cnt) - F = 1 x R_HAI
    assert rp.b_cnt == 7
    assert rp.rt == pytest.approx(rt + 7 * p.r_ai_bps + 2 * p.r_hai_bps)
    assert rp.rc <= rp.rt


def test_pacing_follows_the_rate():
    """MR-CC-034: below R_line the QP's wire bytes follow Rc (token bucket of burst_bytes)."""
    # timers far away, so Rc stays where the CNPs put it during the measurement
    p = DcqcnParams(t_ns=10**12, k_ns=10**12, b_bytes=1 << 40, cnp_interval_ns=0)
    rp = ReactionPoint(p, now=0)
    assert rp.allowance(0, 256, 1100) == 256        # line rate: not paced
    for _ in range(7):
        rp.on_cnp(0)                                # Rc = R_line / 128 = 78 Mb/s
    rate = rp.rc
    assert rate == pytest.approx(LINE / 128, rel=0.05)
    now, sent = 0, 0
    for _ in range(2000):                           # 20 ms of 10 us polls
        now += 10 * US
        n = rp.allowance(now, 256, 1100)
        rp.on_sent(n * 1100)
        sent += n * 1100
    elapsed = now / 1e9
    # at most the rate plus the bucket, and one packet of debt
    assert rate * elapsed / 8 * 0.95 < sent <= rate * elapsed / 8 + p.burst_bytes + 1100
    # then recovery: with the default timers the same QP is back at line rate within a few ms
    rp2 = ReactionPoint(P, now=0)
    for _ in range(7):
        rp2.on_cnp(0)
    assert rp2.allowance(50_000_000, 256, 1100) == 256 and rp2.rc == LINE


def test_disabled_reaction_point_counts_but_does_not_pace():
    """MR-CC-032: the RP may be disabled; CNPs are still counted (MR-CNP-010)."""
    rp = ReactionPoint(DcqcnParams(enabled=False), now=0)
    rp.on_cnp(0)
    assert rp.rx_cnp == 1 and rp.rc == LINE and rp.allowance(10, 64, 1100) == 64


def test_notification_point_rate_limit():
    """MR-CNP-003, MR-ECN-012: at most one CNP per cnp_interval; every CE mark is counted."""
    np_ = NotificationPoint(P)
    assert np_.on_ce(0) is True
    assert np_.on_ce(49_999) is False
    assert np_.on_ce(50_000) is True
    assert (np_.rx_ce_marked, np_.tx_cnp) == (3, 2)


def test_mark_ce_keeps_the_icrc():
    """MR-ICRC-004, MR-ECN-006: a switch marking CE (and fixing the IPv4 checksum) leaves the ICRC valid."""
    f = encode(Op.SEND_ONLY, dest_qp=0x11, payload=b"abcd", dscp=26, ecn=2)
    m = mark_ce(f)
    assert m[15] == 0x6B and decode(m).icrc_ok and parse(np.frombuffer(m, np.uint8)).ecn == 3
    assert mark_ce(encode(Op.CNP, dest_qp=1)) == encode(Op.CNP, dest_qp=1)        # Not-ECT: left alone
    f6 = encode(Op.SEND_ONLY, dest_qp=0x11, payload=b"abcd", dscp=26, ecn=2, src_ip="fd00::1", dst_ip="fd00::2")
    assert decode(mark_ce(f6)).icrc_ok and parse(np.frombuffer(mark_ce(f6), np.uint8)).ecn == 3


# ---------------------------------------------------------------- user-space header checks
def test_rxparse_checks_the_ipv4_header_checksum():
    """MR-ENC-013: the in-process parser refuses what the XDP program drops as BAD_IP_CSUM."""
    f = bytearray(encode(Op.SEND_ONLY, dest_qp=0x11, payload=b"abcd"))
    parse(np.frombuffer(bytes(f), np.uint8))
    f[24] ^= 0x40
    with pytest.raises(MalformedPacket) as ei:
        parse(np.frombuffer(bytes(f), np.uint8))
    assert ei.value.reason == DecodeReason.BAD_IP_CSUM


def test_rxparse_refuses_ipv6_extension_headers_and_8021ad():
    """MR-ENC-015 (IPv6 Next Header 17 only), MR-ENC-005 (an 802.1ad tag is not ours)."""
    f6 = bytearray(encode(Op.SEND_ONLY, dest_qp=0x11, payload=b"abcd", src_ip="fd00::1", dst_ip="fd00::2"))
    f6[14 + 6] = 0
    with pytest.raises(MalformedPacket) as ei:
        parse(np.frombuffer(bytes(f6), np.uint8))
    assert ei.value.reason == DecodeReason.IP_OPTIONS
    f = encode(Op.SEND_ONLY, dest_qp=0x11, payload=b"abcd")
    ad = f[:12] + b"\x88\xa8\x00\x05" + f[12:]
    with pytest.raises(MalformedPacket) as ei:
        parse(np.frombuffer(ad, np.uint8))
    assert ei.value.reason == DecodeReason.NOT_IP


@pytest.mark.parametrize("pkt,mine,ok", [
    (0xFFFF, 0xFFFF, True), (0x7FFF, 0xFFFF, True), (0xFFFF, 0x7FFF, True), (0x7FFF, 0x7FFF, False),
    (0xFFFE, 0xFFFF, False), (0x0000, 0xFFFF, False), (0x8000, 0xFFFF, False), (0x8000, 0x8000, False),
    (0x8000, 0x0000, False), (0x8123, 0x0123, True)])
def test_pkey_match(pkt, mine, ok):
    """MR-BTH-010: low 15 bits equal and one full member; 0x0000/0x8000 never match (IBTA invalid P_Key)."""
    assert pkey_match(pkt, mine) is ok


def test_pkey_mismatch_is_dropped_in_process():
    """MR-BTH-010 on the in-process path: B's QP in another partition drops A's packets."""
    a, b = loop_pair(size=1 << 16)
    b.qp.pkey = 0x8001
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 64)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey, send_flags=SendFlags.SIGNALED))
    run_until([a, b], lambda: b.ctx.engine.stats["drop_bad_pkey"] >= 1, timeout=5)
    assert b.ctx.engine.stats["rx"] >= 1 and b.qp.responder.bytes_received == 0


# ---------------------------------------------------------------- the chain, in process
def test_ce_marks_make_cnps_and_the_sender_slows_down():
    """MR-ECN-007, MR-ECN-009, MR-ECN-012, MR-CNP-002, MR-CNP-003, MR-CNP-005, MR-CNP-006, MR-CNP-010:
    A's WRITEs cross a 'switch' that marks 5 % of them CE; B counts the marks and answers with
    CNPs (at most one per 50 us); A's reaction point cuts its rate; the data arrives intact."""
    a, b = loop_pair(faults_ab=Faults(seed=3, ce=0.05), size=1 << 22, timeout=14)
    a.buf[:] = np.random.default_rng(1).integers(0, 256, a.buf.size, dtype=np.uint8)
    a.qp.post_send(SendWR(wr_id=7, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 4 << 20)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey, send_flags=SendFlags.SIGNALED))
    wcs = []
    run_until([a, b], lambda: wcs.extend(a.cq.poll()) or wcs, timeout=60)
    assert wcs[0].status == WCStatus.SUCCESS
    assert np.array_equal(a.buf[:4 << 20], b.buf[:4 << 20])
    qa, qb = a.qp.query(), b.qp.query()
    assert qb["rx_ce_marked"] > 20
    assert 1 <= qb["tx_cnp"] <= qb["rx_ce_marked"]
    assert qa["rx_cnp"] == qb["tx_cnp"] == b.ctx.engine.stats["tx_cnp"]
    assert qa["rate_cuts"] >= 1 and qa["rate_min_bps"] < LINE
    assert qa["tx_cnp"] == 0 and qb["rx_cnp"] == 0          # CNPs flow one way: B -> A (no marks on B -> A)
    assert a.ctx.engine.stats["drop_qp_state"] == 0


def test_cnp_bytes_match_the_reference_encoder():
    """MR-CNP-001, MR-CC-029, MR-ECN-005, MR-BTH-012, MR-BTH-019: the engine's CNP is the codec's CNP
    (DSCP 48, Not-ECT, BECN 1, PSN 0, the QP's UDP source port and P_Key, DestQP = peer QPN)."""
    a, b = loop_pair(size=1 << 16)
    a.ctx.port.inbox.clear()
    b.ctx.engine.send_cnp(b.qp)
    got = a.ctx.port.inbox.pop()
    want = encode(Op.CNP, src_mac=b.ctx.engine.local_mac, dst_mac=a.ctx.engine.local_mac, src_ip=b.ctx.gid,
                  dst_ip=a.ctx.gid, sport=b.qp.sport, dest_qp=a.qp.qp_num, becn=1, pkey=0xFFFF, dscp=48, ecn=0)
    assert got == want
    assert decode(got).icrc_ok


def test_cnp_for_a_qp_not_in_rts_is_dropped():
    """MR-CNP-005, MR-QP-020: a CNP for a QP that is not in RTS is discarded and counted."""
    a, b = loop_pair(size=1 << 16)
    a.qp.modify(QPAttr(qp_state=QPState.SQD))
    b.ctx.engine.send_cnp(b.qp)
    a.ctx.engine.progress()
    q = a.qp.query()
    assert a.ctx.engine.stats["drop_qp_state"] == 1 and q["rx_cnp"] == 0
    assert q["rx_cnp_discarded"] == 1                          # MR-CC-039: counted per QP too
