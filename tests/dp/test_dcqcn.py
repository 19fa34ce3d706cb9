"""DCQCN on compat QPs of the compiled plane (dp/cc.py): the parameters the plane runs with; the
reaction point's rules through dp/cc.py's own compiled functions (rp_cnps, rp_advance, rp_allowance,
rp_on_sent) on a QP row of their own; and the whole chain end to end between two compiled-plane
endpoints (dp_loop): a switch port marks CE on A's requests (Faults(ce=...)), B's notification point
counts the marks and answers with CNPs (at most one per cnp_interval), A's XDP program verifies and
counts them, A's reaction point cuts its rate; the CNP on the wire is the codec's CNP.

The XDP program's header checks (IPv4 header checksum, IPv6 extension headers, P_Key matching, a CNP
for a QP not in RTS) are tests/kern/test_xdp_golden.py's;
CE marking that keeps the ICRC valid is checked end to end in tests/dp/test_dcqcn_veth.py.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from dp_players import Faults, run_until
from metaroce_xdp.dp import layout as L
from metaroce_xdp.verbs_types import QPState, SendFlags, SendWR, WCStatus, WROpcode
from metaroce_xdp.wire import Op, decode, encode
from wire_players import PortTap, is_roce_v4

from metaroce_xdp.congestion import DcqcnParams

pytestmark = pytest.mark.netns

P = DcqcnParams()                 # the defaults of 05-congestion.md Table 5.7.2
LINE = P.r_line_bps
US = 1000


def test_defaults_are_the_spec_table(dp_loop):
    """MR-CNP-003, MR-CNP-006, MR-CC-030: N 50 us, g 1/256, K = T = 55 us, B 10 MiB, F 5, DSCP 48 -- in the
    parameters and in the table the compiled loop reads (F row 0)."""
    assert (P.cnp_interval_ns, P.g, P.k_ns, P.t_ns, P.b_bytes, P.f) == (50_000, 1 / 256, 55_000, 55_000, 10 << 20, 5)
    assert (P.r_ai_bps, P.r_hai_bps, P.r_min_bps, P.alpha_init, P.cnp_dscp) == (40e6, 400e6, 10e6, 1.0, 48)
    a, b = dp_loop()
    pl = a.ctx.plane
    row = pl.F[0]
    assert (row[L.D_CNP_INTERVAL_NS], row[L.D_G], row[L.D_K_NS], row[L.D_T_NS], row[L.D_B_BYTES], row[L.D_F]) == \
        (50_000, 1 / 256, 55_000, 55_000, 10 << 20, 5)
    assert (row[L.D_R_AI_BPS], row[L.D_R_HAI_BPS], row[L.D_R_MIN_BPS], row[L.D_ALPHA_INIT], row[L.D_CNP_DSCP]) == \
        (40e6, 400e6, 10e6, 1.0, 48)
    assert row[L.D_ENABLED] == 1 and row[L.D_R_LINE_BPS] == pl.dcqcn.r_line_bps
    q = a.qp.query()                    # a new QP starts at line rate with alpha_init (MR-CC-035)
    assert q["rate_bps"] == q["rate_target_bps"] == pl.dcqcn.r_line_bps and q["rate_cuts"] == 0


def test_env_overrides(monkeypatch):
    monkeypatch.setenv("METAROCE_DCQCN_CNP_INTERVAL_NS", "100000")
    monkeypatch.setenv("METAROCE_DCQCN_ENABLED", "0")
    p = DcqcnParams.from_env(r_line_bps=25e9)
    assert p.cnp_interval_ns == 100_000 and p.enabled is False and p.r_line_bps == 25e9
    with pytest.raises(ValueError):
        DcqcnParams.from_env(r_min_bps=0)


# ---------------------------------------------------------------- the reaction point (dp/cc.py)
class RP:
    """One QP row (qi 1) of dp/cc.py's reaction point, with the port table, parameter row and kernel
    QP slot (cnp_count) it reads, driven through the compiled functions the loop calls."""

    QI, KS_SIZE, F_OFF = 1, 256, 1024

    def __init__(self, p: DcqcnParams, now: int = 0) -> None:
        from metaroce_xdp.dp import cc
        self.cc = cc
        self.A = np.zeros(self.F_OFF + 2 * L.NF, np.int64)
        self.ks = np.zeros(2 * self.KS_SIZE, np.uint8)
        self.A[L.P_F_OFF], self.A[L.P_MAXQ] = self.F_OFF, 2
        self.A[L.P_KS_ADDR], self.A[L.P_KS_SIZE] = self.ks.ctypes.data, self.KS_SIZE
        self.Q = np.zeros((2, L.NQ), np.int64)
        self.F = cc.f_rows(self.A)
        for i, name in enumerate(L.D_FIELDS):
            self.F[0, i] = float(getattr(p, name))
        s = self.F[self.QI]                     # as QP._dcqcn_init
        s[L.F_RC] = s[L.F_RT] = s[L.F_RATE_MIN] = p.r_line_bps
        s[L.F_ALPHA] = p.alpha_init
        s[L.F_TOKENS] = p.burst_bytes
        s[L.F_T_TOKENS] = now
        s[L.F_ALPHA_DUE] = now + p.k_ns
        s[L.F_RATE_DUE] = now + p.t_ns
        s[L.F_NP_LAST] = -1
        self.cnps = 0

    def __getattr__(self, name):
        return float(self.F[self.QI][getattr(L, "F_" + name.upper())])

    def on_cnp(self, now: int, count: int = 1) -> None:
        """`count` CNPs verified by the XDP program (its per-QP cnp_count), then the loop's look at them."""
        self.cnps += count
        off = self.QI * self.KS_SIZE + self.cc.KS_CNP_COUNT
        self.ks[off:off + 8] = np.frombuffer(np.uint64(self.cnps).tobytes(), np.uint8)
        self.cc.rp_cnps(self.A, self.Q, self.QI, np.int64(now))

    def advance(self, now: int) -> None:
        self.cc.rp_advance(self.F, self.QI, np.int64(now))

    def on_sent(self, nbytes: int) -> None:
        self.cc.rp_on_sent(self.A, self.QI, np.int64(nbytes))

    def allowance(self, now: int, budget: int, packet_bytes: int) -> int:
        return int(self.cc.rp_allowance(self.A, self.QI, np.int64(now), np.int64(budget), np.int64(packet_bytes)))


@pytest.mark.compiles
def test_rate_falls_on_cnp():
    """MR-CNP-006, MR-CC-035, MR-CC-038: start at R_line with alpha 1; each CNP sets Rt = Rc,
    Rc = Rc (1 - alpha / 2), alpha = (1 - g) alpha + g."""
    rp = RP(P, now=0)
    assert rp.rc == rp.rt == LINE and rp.alpha == 1.0
    rp.on_cnp(1 * US)
    assert rp.rt == LINE and rp.rc == pytest.approx(LINE / 2) and rp.alpha == pytest.approx(1.0)
    rp.on_cnp(51 * US)                              # the next cnp_interval (the rate timer is not due)
    assert rp.rt == pytest.approx(LINE / 2) and rp.rc == pytest.approx(LINE / 4)
    assert rp.rx_cnp == 2 and rp.rate_cuts == 2 and rp.rate_min == pytest.approx(LINE / 4)


@pytest.mark.compiles
def test_rate_never_below_r_min():
    """MR-CNP-008, MR-CC-038."""
    rp = RP(P, now=0)
    for i in range(200):
        rp.on_cnp(i * P.cnp_interval_ns)
    assert rp.rc == P.r_min_bps


@pytest.mark.compiles
def test_one_cut_per_cnp_interval():
    """MR-CC-035: 20 CNPs within one cnp_interval (copies or forgeries: a notification point sends no more,
    MR-CNP-003) cut the rate once, the rest counted; the next interval's CNP cuts again.  With
    cnp_interval 0 each CNP cuts."""
    rp = RP(P, now=0)
    for i in range(20):
        rp.on_cnp(1 * US + i)
    rp.on_cnp(2 * US, count=5)
    assert rp.rx_cnp == 25 and rp.rate_cuts == 1 and rp.cnp_coalesced == 24
    assert rp.rc == pytest.approx(LINE / 2)
    rp.on_cnp(1 * US + P.cnp_interval_ns)
    assert rp.rate_cuts == 2 and rp.rc == pytest.approx(LINE / 4)
    rp0 = RP(DcqcnParams(cnp_interval_ns=0), now=0)
    rp0.on_cnp(1 * US, count=3)
    assert rp0.rc == pytest.approx(LINE / 8)


@pytest.mark.compiles
def test_rate_recovers_without_cnps():
    """MR-CNP-007, MR-CC-036, MR-CC-037: alpha decays once per K without a CNP; the rate timer
    gives F fast-recovery steps (Rc halfway to Rt each), then additive increase of Rt, until
    R_line."""
    rp = RP(P, now=0)
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


@pytest.mark.compiles
def test_additive_and_hyper_increase():
    """MR-CC-037: after F steps Rt grows by R_AI per step; when both counters exceed F, by R_HAI."""
    p = DcqcnParams(r_line_bps=100e9, b_bytes=1000, cnp_interval_ns=0)     # 8 cuts at once
    rp = RP(p, now=0)
    for _ in range(8):
        rp.on_cnp(0)
    rt = rp.rt
    rp.advance(6 * p.t_ns)                          # T_cnt 1..4: fast recovery; 5, 6: additive
    assert rp.t_cnt == 6 and rp.rt == pytest.approx(rt + 2 * p.r_ai_bps)
    rp.on_sent(7 * 1000)                            # B_cnt 1..5: additive; 6, 7: min(6, B_cnt) - F = 1 x R_HAI
    assert rp.b_cnt == 7
    assert rp.rt == pytest.approx(rt + 7 * p.r_ai_bps + 2 * p.r_hai_bps)
    assert rp.rc <= rp.rt


@pytest.mark.compiles
def test_pacing_follows_the_rate():
    """MR-CC-034: below R_line the QP's wire bytes follow Rc (token bucket of burst_bytes)."""
    # timers far away, so Rc stays where the CNPs put it during the measurement
    p = DcqcnParams(t_ns=10**12, k_ns=10**12, b_bytes=1 << 40, cnp_interval_ns=0)
    rp = RP(p, now=0)
    assert rp.allowance(0, 256, 1100) == 256        # line rate: not paced
    rp.on_cnp(0, count=7)                           # Rc = R_line / 128
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
    rp2 = RP(P, now=0)
    rp2.on_cnp(0, count=7)
    assert rp2.allowance(50_000_000, 256, 1100) == 256 and rp2.rc == LINE


@pytest.mark.compiles
def test_disabled_reaction_point_counts_but_does_not_pace():
    """MR-CC-032: the RP may be disabled; CNPs are still counted (MR-CNP-010)."""
    rp = RP(DcqcnParams(enabled=False), now=0)
    rp.on_cnp(0)
    assert rp.rx_cnp == 1 and rp.rc == LINE and rp.allowance(10, 64, 1100) == 64


# ---------------------------------------------------------------- the chain, end to end
def test_ce_marks_make_cnps_and_the_sender_slows_down(dp_loop):
    """MR-ECN-007, MR-ECN-009, MR-ECN-012, MR-CNP-002, MR-CNP-003, MR-CNP-005, MR-CNP-006, MR-CNP-010;
    MR-CNP-001, MR-CC-029, MR-ECN-005, MR-BTH-012, MR-BTH-019: A's WRITEs cross a switch port that marks
    5 % of them CE; B counts the marks and answers with CNPs (at most one per 50 us); A's reaction point
    cuts its rate; the data arrives intact.  Each CNP captured on the switch is the codec's CNP (DSCP 48,
    Not-ECT, BECN 1, PSN 0, the UDP source port of B's QP and its P_Key, DestQP = A's QPN)."""
    a, b = dp_loop(faults_ab=Faults(seed=3, ce=0.05), size=1 << 22, timeout=14)
    tap = PortTap(a.topo, a.topo[1], "swA")          # what B sends towards A
    try:
        a.buf[:] = np.random.default_rng(1).integers(0, 256, a.buf.size, dtype=np.uint8)
        sa0, sb0 = a.ctx.stats(), b.ctx.stats()
        t0 = time.monotonic_ns()
        a.qp.post_send(SendWR(wr_id=7, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 4 << 20)],
                              remote_addr=b.mr.addr, rkey=b.mr.rkey, send_flags=SendFlags.SIGNALED))
        wcs = []
        run_until([a, b], lambda: wcs.extend(a.cq.poll()) or wcs, timeout=60)
        elapsed = time.monotonic_ns() - t0
        frames = [f for f, towards_a in tap.raw(is_roce_v4) if towards_a]
    finally:
        tap.close()
    assert wcs[0].status == WCStatus.SUCCESS
    assert np.array_equal(a.buf[:4 << 20], b.buf[:4 << 20])
    qa, qb = a.qp.query(), b.qp.query()
    sa, sb = a.ctx.stats(), b.ctx.stats()
    assert qb["rx_ce_marked"] > 20
    assert 1 <= qb["tx_cnp"] <= qb["rx_ce_marked"]
    assert qb["tx_cnp"] <= elapsed // P.cnp_interval_ns + 1          # at most one per cnp_interval
    assert qa["rx_cnp"] == qb["tx_cnp"] == sb["tx_cnp"] - sb0["tx_cnp"]
    assert qa["rate_cuts"] >= 1 and qa["rate_min_bps"] < a.ctx.plane.dcqcn.r_line_bps
    assert qa["tx_cnp"] == 0 and qb["rx_cnp"] == 0          # CNPs flow one way: B -> A (no marks on B -> A)
    assert sa["rx_drop_state"] == sa0["rx_drop_state"]
    # the CNPs on the wire
    pkts = [decode(f) for f in frames]
    cnps = [(f, p) for f, p in zip(frames, pkts) if p.bth.opcode == Op.CNP]
    acks = [f for f, p in zip(frames, pkts) if p.bth.opcode == Op.ACKNOWLEDGE and p.bth.dest_qp == a.qp.qp_num]
    assert len(cnps) == qb["tx_cnp"] and acks
    ack = acks[0]                                           # B's QP's path: MACs and UDP source port
    mac = lambda m: ":".join(f"{x:02x}" for x in m)         # noqa: E731
    for f, p in cnps:
        want = encode(Op.CNP, src_mac=mac(ack[6:12]), dst_mac=mac(ack[0:6]), src_ip=b.ctx.gid, dst_ip=a.ctx.gid,
                      sport=int.from_bytes(ack[34:36], "big"), dest_qp=a.qp.qp_num, becn=1, pkey=0xFFFF, dscp=48,
                      ecn=0)
        assert f[:len(want)] == want and p.icrc_ok
