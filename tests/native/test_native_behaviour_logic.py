"""Native rules that are computations of the requester and responder logic (metaroce_xdp/native), checked
on the compiled functions the data plane calls: the initial window and no pacing before the first RTT
sample (MR-CC-005), retransmissions under the window and paced (MR-CC-003), the queueing allowance from the
peer's T (MR-CC-040), which deliveries feed RACK (MR-SACK-027), and a responder never taking back what it
reported received (MR-SACK-012).  (tests/native/test_dp_native_behaviour.py checks the rules seen on the wire.)"""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from metaroce_xdp import cm
from metaroce_xdp.dp.cmconnect import NATIVE_OFFER, agreed_profile, offer
from metaroce_xdp.native import layout as L
from metaroce_xdp.native.multipath import mp_init
from metaroce_xdp.native.receiver import rx_build_sack, rx_init, rx_on_packet
from metaroce_xdp.native.sender import (ACT_TLP, TK_NEW, TK_RETX, TXB_CWND, TXB_PACE, cc_target, tsval_of,
                                        tx_can_send, tx_init, tx_next_lost, tx_on_sack, tx_on_timer,
                                        tx_on_transmit)

US, MS = 1000, 1_000_000
FLAG_N = 0x40                       # SACKETH flags.N: tsecr is no echo of the acknowledged PSNs' tsval


def tx(isn=0x100, k=1, **kw):
    par = L.params(k=k, **kw)
    s, sb, pt = L.new_tx()[0], L.new_sb(), L.new_pt()
    tx_init(s, par, isn, 0)
    mp_init(pt, par, np.arange(0xC000, 0xC000 + L.KMAX, dtype=np.int64))
    return s, sb, pt, par


def words_for(cum, psns):
    w = np.zeros(32, np.int64)
    nw = 0
    for p in psns:
        i = (p - cum - 2) & L.PSN_MASK
        w[i >> 5] |= 1 << (31 - (i & 31))
        nw = max(nw, (i >> 5) + 1)
    return w, nw


def sack(s, sb, pt, par, cum, psns, now, tsecr=0, flags=FLAG_N):
    w, nw = words_for(cum, psns)
    return tx_on_sack(s, sb, pt, par, cum & L.PSN_MASK, nw, w, tsecr, flags, 0, 0xFFFF, 0xC000, now)


# ------------------------------------------------------------------ MR-CC-005
def test_initial_window_is_min_of_init_cwnd_and_w_mr_cc_005():
    """MR-CC-005: before the first RTT sample cwnd = min(init_cwnd, W) -- 16 with the defaults, W when
    init_cwnd is larger -- and, with no srtt, nothing paces: a whole window leaves at one instant, the
    packet after it waits for the window (TXB_CWND), not for the pacing clock.  The first RTT sample
    starts the pacing (MR-CC-004): then a packet sent holds the next one back."""
    s, sb, pt, par = tx()
    assert s[L.S_CWND] == 16 * L.FP
    s2, _, _, _ = tx(w=32, init_cwnd=64)
    assert s2[L.S_CWND] == 32 * L.FP
    now = 5 * MS
    for i in range(16):
        assert tx_can_send(s, par, now, 1) == 0, i
        tx_on_transmit(s, sb, par, int(s[L.S_SND_NXT]), 0, TK_NEW, now)
        assert s[L.S_NEXT_SEND] <= now                     # line rate: no gap before srtt has a value
    assert tx_can_send(s, par, now, 1) == TXB_CWND
    assert s[L.S_C_BLK_PACE] == 0 and s[L.S_SRTT] == L.NONE
    # an RTT sample (flags.N clear, tsecr = the packets' tsval) acknowledging 8: pacing from now on
    t = now + 50 * US
    assert sack(s, sb, pt, par, 0x107, [], t, tsecr=tsval_of(now), flags=0) == 8
    assert s[L.S_SRTT] != L.NONE
    assert tx_can_send(s, par, t, 1) == 0
    tx_on_transmit(s, sb, par, int(s[L.S_SND_NXT]), 0, TK_NEW, t)
    assert s[L.S_NEXT_SEND] > t and tx_can_send(s, par, t, 1) == TXB_PACE


# ------------------------------------------------------------------ MR-CC-003
def test_retransmission_waits_for_the_window_and_is_paced_mr_cc_003():
    """MR-CC-003: a PSN marked lost (the count rule, K = 1) is not retransmitted while the PSNs in flight
    are at least max(cwnd, 1): with the window cut to 8.09 by the loss (MR-CC-022) and 12 in flight the
    retransmission is blocked (TXB_CWND); once SACKs bring the flight below the window it may leave, and then
    counts in flight.  Once srtt has a value a retransmission moves the pacing clock exactly as a new
    packet does (MR-CC-004).  A tail-loss probe is asked for although the window is full (exempt)."""
    s, sb, pt, par = tx()
    for i in range(16):
        tx_on_transmit(s, sb, par, int(s[L.S_SND_NXT]), 0, TK_NEW, (i + 1) * US)
    assert sack(s, sb, pt, par, 0xFF, [0x101, 0x102, 0x103], 20 * US) == 3
    assert tx_next_lost(s, sb) == 0x100 and s[L.S_N_LOST] == 1
    # cwnd: 16 grown by 3 / 16 (MR-CC-008), then halved by the loss (MR-CC-022): 8.09
    assert 8 * L.FP < s[L.S_CWND] < 9 * L.FP and s[L.S_IN_FLIGHT] == 12
    assert tx_can_send(s, par, 20 * US, 0) == TXB_CWND
    assert sack(s, sb, pt, par, 0xFF, list(range(0x101, 0x108)), 21 * US) == 4
    assert s[L.S_IN_FLIGHT] == 8 and 8 * L.FP < s[L.S_CWND] < 9 * L.FP        # 8.09 + 4 / 8.09
    assert tx_can_send(s, par, 21 * US, 0) == 0
    tx_on_transmit(s, sb, par, 0x100, 0, TK_RETX, 21 * US)
    assert s[L.S_IN_FLIGHT] == 9 and tx_can_send(s, par, 21 * US, 0) == TXB_CWND
    assert tx_can_send(s, par, 21 * US, 1) == TXB_CWND

    # pacing: the same gap after a retransmission as after a new packet
    s, sb, pt, par = tx(k=4)
    now = 1 * MS
    for _ in range(4):
        tx_on_transmit(s, sb, par, int(s[L.S_SND_NXT]), 0, TK_NEW, now)
    t = now + 40 * US
    sack(s, sb, pt, par, 0x100, [0x102], t, tsecr=tsval_of(now), flags=0)        # srtt 40 us; 0x101 a hole
    assert s[L.S_SRTT] == 40 * US
    a, b = s.copy(), s.copy()
    sba, sbb = sb.copy(), sb.copy()
    t2 = t + 100 * US
    tx_on_transmit(a, sba, par, 0x101, 0, TK_RETX, t2)
    tx_on_transmit(b, sbb, par, int(b[L.S_SND_NXT]), 0, TK_NEW, t2)
    assert a[L.S_NEXT_SEND] == b[L.S_NEXT_SEND] > t2
    assert tx_can_send(a, par, t2, 0) == TXB_PACE

    # the tail-loss probe: the window full, the PTO still fires a probe (MR-LOSS-010 exempt from MR-CC-001)
    s, sb, pt, par = tx(k=4, init_cwnd=4)
    now = 1 * MS
    tx_on_transmit(s, sb, par, 0x100, 0, TK_NEW, now)
    sack(s, sb, pt, par, 0x100, [], now + 40 * US, tsecr=tsval_of(now), flags=0)
    while s[L.S_IN_FLIGHT] * L.FP < s[L.S_CWND]:
        tx_on_transmit(s, sb, par, int(s[L.S_SND_NXT]), 0, TK_NEW, now + 50 * US)
    assert tx_can_send(s, par, now + 50 * US, 0) == TXB_CWND
    a = tx_on_timer(s, sb, pt, par, int(s[L.S_PTO_AT]))
    assert a >> 32 == ACT_TLP and a & 0xFFFFFFFF == (s[L.S_SND_NXT] - 1) & L.PSN_MASK


# ------------------------------------------------------------------ MR-CC-040
def test_queueing_allowance_from_the_peers_t_mr_cc_040():
    """MR-CC-040: q_eff = max(q_target, 4 * T_peer): with the defaults (25 us, T 5 us) the delay target is
    min_rtt + 25 us; a peer's T of 6 us still gives 25 us, 7 us gives 28 us, 20 us gives 80 us.  T_peer
    comes from the peer's NATIVE_TIMING TLV (cm.peer_timing), the default when it sent none."""
    def target(**kw):
        s, sb, pt, par = tx(**kw)
        s[L.S_MIN_RTT] = 100 * US
        return cc_target(s, par)
    assert target() == 125 * US
    assert target(t_peer=6) == 125 * US
    assert target(t_peer=7) == 128 * US
    assert target(t_peer=20) == 180 * US
    assert target(t_peer=20, q_target=100) == 200 * US
    timing = cm.CMMsg(cm.MsgType.REQ, tlvs=[(cm.TLV_NATIVE_TIMING, (20).to_bytes(2, "big") + (8).to_bytes(2, "big")
                                              + (500).to_bytes(4, "big"))])
    assert cm.peer_timing(timing) == 20 and cm.peer_timing(cm.CMMsg(cm.MsgType.REQ)) is None
    native = int(cm.Cap.NATIVE | cm.Cap.SACK | cm.Cap.OOO_PLACEMENT)
    assert agreed_profile(native, 256, 1, cm.peer_timing(timing))[1]["t_peer"] == 20
    assert "t_peer" not in agreed_profile(native, 256, 1)[1]                     # the default, 5 us


# ------------------------------------------------------------------ MR-NAT-004, MR-MP-001
def test_native_only_with_sack_and_ooo_placement_mr_nat_004_mr_mp_001():
    """MR-NAT-004: this endpoint never offers NATIVE without SACK and OOO_PLACEMENT; an agreed set with
    NATIVE but either of them clear is compat.  MR-MP-001: K is the agreed entropy count with MULTIPATH,
    1 without it."""
    for prof in ("auto", "native"):
        caps, _ = offer(prof, "10.0.0.1")
        assert caps & NATIVE_OFFER == NATIVE_OFFER
    assert offer("compat", "10.0.0.1")[0] & (cm.Cap.NATIVE | cm.Cap.SACK | cm.Cap.OOO_PLACEMENT) == 0
    n, s, o, m = cm.Cap.NATIVE, cm.Cap.SACK, cm.Cap.OOO_PLACEMENT, cm.Cap.MULTIPATH
    assert agreed_profile(int(n | o | m), 256, 16) == ("compat", None)
    assert agreed_profile(int(n | s | m), 256, 16) == ("compat", None)
    assert cm.agree_caps(int(n | o | m | cm.Cap.ATOMICS), int(NATIVE_OFFER | cm.Cap.ATOMICS)) == int(cm.Cap.ATOMICS)
    assert agreed_profile(int(n | s | o | m), 256, 8)[1]["k"] == 8
    assert agreed_profile(int(n | s | o), 256, 8)[1]["k"] == 1


# ------------------------------------------------------------------ MR-SACK-027
def _rack_case(tsecr, flags):
    """PSNs 0x100..0x103 sent at 1, 2, 3, 4 us, 0x101 sent again at 10 ms; at 11 ms a SACK acknowledges
    0x100 and 0x101 (cumulative) with the given tsecr and flags."""
    s, sb, pt, par = tx(k=4)
    for i in range(4):
        tx_on_transmit(s, sb, par, 0x100 + i, 0, TK_NEW, (i + 1) * US)
    tx_on_transmit(s, sb, par, 0x101, 0, TK_RETX, 10 * MS)
    assert sb[0x101 & L.WMASK, L.B_TX_COUNT] == 2
    assert sack(s, sb, pt, par, 0x101, [], 11 * MS, tsecr=tsecr, flags=flags) == 2
    return s


def test_rack_updated_only_from_unambiguous_deliveries_mr_sack_027():
    """MR-SACK-027: a delivery updates rack_xmit_ts and rack_rtt only when the PSN was sent once, or when
    flags.N is clear and tsecr equals the tsval of its latest transmission.  PSN 0x101, sent twice, is
    acknowledged with flags.N set, or with the tsval of its first transmission: RACK keeps 0x100's
    send time (1 us), so 0x102 and 0x103, sent later, are not declared lost (MR-SACK-028); with the
    tsval of the retransmission RACK takes its send time (10 ms) and 0x102, 0x103 are lost at once."""
    for tsecr, flags in ((tsval_of(10 * MS), FLAG_N), (tsval_of(2 * US), 0)):
        s = _rack_case(tsecr, flags)
        assert s[L.S_RACK_XMIT_TS] == 1 * US and s[L.S_RACK_RTT] == 11 * MS - 1 * US
        assert s[L.S_N_LOST] == 0
    s = _rack_case(tsval_of(10 * MS), 0)
    assert s[L.S_RACK_XMIT_TS] == 10 * MS and s[L.S_RACK_RTT] == 1 * MS
    assert s[L.S_N_LOST] == 2


# ------------------------------------------------------------------ MR-SACK-012
def _reported(hdr, words):
    """(PSNs reported received, PSNs reported missing) by one ACK-type SACK, up to 64 before its cum."""
    cum, nw = int(hdr[0]), int(hdr[1])
    got = {(cum - i) & L.PSN_MASK for i in range(64)}
    missing = {(cum + 1) & L.PSN_MASK}
    for i in range(32 * nw):
        p = (cum + 2 + i) & L.PSN_MASK
        (got if (int(words[i >> 5]) >> (31 - (i & 31))) & 1 else missing).add(p)
    return got, missing


@settings(max_examples=60, deadline=None)
@given(isn=st.sampled_from([0, 0x100, 0xFFFFC0]), w=st.sampled_from([32, 64, 256]),
       arrivals=st.lists(st.integers(0, 300), min_size=1, max_size=120))
def test_prop_a_psn_reported_received_is_never_reported_missing_mr_sack_012(isn, w, arrivals):
    """MR-SACK-012: whatever order packets arrive in (duplicates, out of order, beyond the window), a PSN
    once reported received -- at or before the cumulative PSN, or by a bitmap bit -- is never reported
    missing by a later SACK (a bit that only falls off a shorter bitmap is not a report)."""
    par = L.params(w=w)
    r = L.new_rx()[0]
    rx_init(r, par, isn)
    hdr, words = np.zeros(8, np.int64), np.zeros(32, np.int64)
    ever = set()
    for k, off in enumerate(arrivals):
        rx_on_packet(r, par, (isn + off) & L.PSN_MASK, 0, 0, 1, k, 0xC000, k)
        rx_build_sack(r, par, hdr, words)
        got, missing = _reported(hdr, words)
        assert not (ever & missing), sorted(ever & missing)
        ever |= {p for p in got if ((p - isn) & L.PSN_MASK) <= 300}    # only PSNs that were sent
