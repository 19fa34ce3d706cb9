"""A hostile peer on the wire (issue 19): forged or abusive packets from the far end of a QP, or from a
host that only guesses its QPN, against the compiled data plane.  Each finding is a case; each case
failed on the code before its fix (the commit that fixed it says what it did before).

* NATIVE_SACK (MR-SACK-019, MR-SACK-037, MR-LOSS-001, MR-SACK-007, MR-CC-011): a SACK outside
  [snd_una - W, snd_nxt) changes nothing and is counted; an RTT sample only from a SACK that newly
  delivers PSNs, with a tsecr no earlier than their transmission and not in the future; ce_count is
  a running count, so a duplicated SACK adds no mark and a lost one loses none.  The requester logic
  (native/sender.py tx_on_sack) is the one both SACK paths use: nat_rx for the socket's and
  nat_kern_sacks for those the XDP program consumed (native/plane.py).
* READ responses before an overlapping request (MR-RC-025): at most a round's budget of them leave
  for it; the request waits (dropped, counted, retransmitted), and the READs answer with the data
  from before the WRITE.
* Duplicate READ (MR-DUP-003, MR-DUP-007): re-executed only while it is one of the READs the
  responder keeps; an older one is discarded and counted.
* CNP (MR-CC-035): a burst of forged CNPs in one cnp_interval cuts the rate once; QPNs carry 14 random
  bits (MR-SEC-032).
* The event ring (dp/core.py push_event): an event that finds it full is counted.
"""
from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest

from metaroce_xdp.native import layout as NL
from metaroce_xdp.native.multipath import mp_init
from metaroce_xdp.native.receiver import rx_build_sack, rx_init, rx_on_packet
from metaroce_xdp.native.sender import SACK_INVALID, TK_NEW, tsval_of, tx_init, tx_on_sack, tx_on_transmit

US = 1000


def netns(f):
    """A case on the wire: namespaces, XDP and AF_XDP."""
    return pytest.mark.netns(f)


# ============================================================================ NATIVE_SACK (requester logic)
def tx(isn=0x100, k=4, **kw):
    par = NL.params(k=k, **kw)
    s, sb, pt = NL.new_tx()[0], NL.new_sb(), NL.new_pt()
    tx_init(s, par, isn, 0)
    mp_init(pt, par, np.arange(0xC000, 0xC000 + NL.KMAX, dtype=np.int64))
    return s, sb, pt, par


def send(s, sb, par, n, now):
    for _ in range(n):
        tx_on_transmit(s, sb, par, int(s[NL.S_SND_NXT]), 0, TK_NEW, now)


NO_WORDS = np.zeros(1, np.int64)


def test_forged_sack_outside_the_window_changes_nothing():
    """MR-SACK-019, MR-SEC-032: 10 PSNs out (0x100-0x109), srtt from a real SACK; then SACKs whose BTH.PSN
    lies outside [snd_una - 1 - W, snd_nxt - 1] -- far behind (a blind guess in the half of the PSN
    space before snd_nxt, which used to pass as 'stale' and feed the RTT: a tsecr 18 minutes back), and
    at snd_nxt -- change no requester state (RTT, cwnd, pacing, snd_una, scoreboard, paths) and are
    counted.  One at snd_una - 1 - W is still taken (stale: feedback only)."""
    s, sb, pt, par = tx()
    send(s, sb, par, 10, 0)
    assert tx_on_sack(s, sb, pt, par, 0x101, 0, NO_WORDS, tsval_of(0), 0, 0, 0xFFFF, 0xC000, 20 * US) == 2
    srtt = int(s[NL.S_SRTT])
    assert srtt == 20 * US
    before = s.copy(), sb.copy(), pt.copy()
    w = int(par[NL.P_W])
    now = 30 * US
    forged = [(0x101 - w - 1) & NL.PSN_MASK, 0x800000 + 0x100, 0x10A, 0x200]
    for cum in forged:
        tsecr = (tsval_of(now) - (1 << 30)) & 0xFFFFFFFF          # ~18 minutes ago
        assert tx_on_sack(s, sb, pt, par, cum, 0, NO_WORDS, tsecr, 0x80, 7, 0xFFFF, 0xC000, now) == SACK_INVALID
    assert s[NL.S_C_SACK_INV] == before[0][NL.S_C_SACK_INV] + len(forged)
    s2 = s.copy()
    s2[NL.S_C_SACK_INV] = before[0][NL.S_C_SACK_INV]
    assert (s2 == before[0]).all() and (sb == before[1]).all() and (pt == before[2]).all()
    assert s[NL.S_SRTT] == srtt and s[NL.S_SND_UNA] == 0x102
    # the oldest BTH.PSN still in the window: stale, feedback only, and it gives no RTT sample
    tsecr = (tsval_of(now) - (1 << 30)) & 0xFFFFFFFF
    assert tx_on_sack(s, sb, pt, par, (0x101 - w) & NL.PSN_MASK, 0, NO_WORDS, tsecr, 0, 0, 0xFFFF, 0xC000,
                      now) == -2
    assert s[NL.S_SRTT] == srtt and s[NL.S_SND_UNA] == 0x102


def test_rtt_sample_only_from_newly_delivered_psns_and_a_plausible_tsecr():
    """MR-LOSS-001 (RFC 7323 section 4.3): PSNs 0x100-0x103 sent at 10 us.  A SACK that newly
    acknowledges 0x100 but echoes a tsecr from before it was sent (5 us) gives no RTT sample, nor does
    one for 0x101 whose tsecr is in the future; both are counted (c_rtt_bad) and still acknowledge.  A
    duplicate SACK (nothing newly delivered) gives none either, whatever its tsecr.  A SACK for 0x102
    echoing its own transmission gives the sample."""
    s, sb, pt, par = tx()
    send(s, sb, par, 4, 10 * US)
    assert tx_on_sack(s, sb, pt, par, 0x100, 0, NO_WORDS, tsval_of(5 * US), 0, 0, 0xFFFF, 0xC000, 50 * US) == 1
    assert s[NL.S_SRTT] == NL.NONE and s[NL.S_LAST_RTT] == NL.NONE and s[NL.S_SND_UNA] == 0x101
    assert tx_on_sack(s, sb, pt, par, 0x101, 0, NO_WORDS, tsval_of(900 * US), 0, 0, 0xFFFF, 0xC000, 60 * US) == 1
    assert s[NL.S_SRTT] == NL.NONE and s[NL.S_SND_UNA] == 0x102 and s[NL.S_C_RTT_BAD] == 2
    assert tx_on_sack(s, sb, pt, par, 0x101, 0, NO_WORDS, tsval_of(10 * US), 0, 0, 0xFFFF, 0xC000, 70 * US) == 0
    assert s[NL.S_SRTT] == NL.NONE
    assert tx_on_sack(s, sb, pt, par, 0x102, 0, NO_WORDS, tsval_of(10 * US), 0, 0, 0xFFFF, 0xC000, 80 * US) == 1
    assert s[NL.S_SRTT] == 70 * US


def test_ce_count_is_cumulative_duplicates_add_nothing_losses_lose_nothing():
    """MR-SACK-007, MR-CC-011: the responder reports its running CE count; the requester takes what is new.
    A duplicated SACK does not double the marks; after a lost SACK the next one still carries its marks;
    a reordered older SACK adds nothing."""
    r = NL.new_rx()[0]
    par = NL.params(k=4)
    rx_init(r, par, 0x100)
    s, sb, pt, _ = tx()
    send(s, sb, par, 6, 0)
    hdr = np.zeros(8, np.int64)
    words = np.zeros(32, np.int64)

    def deliver(psn, ce):
        rx_on_packet(r, par, psn, 0, ce, 0, 0, 0xC000, 0)         # no NETH (flags.N): no RTT, no epoch end
        nw = rx_build_sack(r, par, hdr, words)
        return int(hdr[0]), nw, int(hdr[4]), int(hdr[6])

    def apply(sk, now):
        cum, nw, ce_count, flags = sk
        return tx_on_sack(s, sb, pt, par, cum, nw, words[:max(nw, 1)].copy(), 0, flags, ce_count, 0xFFFF,
                          0xC000, now)

    a = deliver(0x100, 1)
    apply(a, 10 * US)
    apply(a, 11 * US)                                                 # duplicated on the way
    assert s[NL.S_EPOCH_CE] == 1
    deliver(0x101, 1)                                                 # this SACK is lost
    b = deliver(0x102, 1)
    apply(b, 12 * US)
    assert s[NL.S_EPOCH_CE] == 3
    apply(a, 13 * US)                                                 # the first one again, late
    assert s[NL.S_EPOCH_CE] == 3


# ============================================================================ compat responder on the wire
PEER_QPN = 0x778
MTU = 1024
# the `wire` fixture's namespaces (tests/conftest.py) are named after the module's fabric mark
pytestmark = pytest.mark.fabric(prefix="mrhst")


@contextlib.contextmanager
def scripted(wire, budget=None, rd_atomic=16):
    from wire_players import ScriptedQP
    from metaroce_xdp.dp import layout as L
    topo, pair, sock, ctx = wire
    q = ScriptedQP(ctx, topo, pair, PEER_QPN, rq_psn=100, sq_psn=0x100, rd_atomic=rd_atomic, mtu=MTU)
    q.sock = sock
    A = ctx.plane.A
    b0 = int(A[L.P_BUDGET])
    if budget is not None:
        A[L.P_BUDGET] = budget
    q.drain()
    try:
        yield q
    finally:
        A[L.P_BUDGET] = b0
        ctx.destroy_qp(q.qp)


def port_counter(A, name):
    """A port counter of the compiled plane (dp/layout.py P_*); 0 where the plane has none, so that on a
    plane without it a case fails on what the peer saw, not on the name."""
    from metaroce_xdp.dp import layout as L
    i = getattr(L, "P_" + name.upper(), None)
    return 0 if i is None else int(A[i])


def rounds(q, n=None, per_round=None):
    """n rounds (or until quiet); what the QP sent; per_round collects the packets each round put out
    (the port's TX counter)."""
    from metaroce_xdp.dp import layout as L
    A = q.ctx.plane.A
    out, quiet = [], 0
    for _ in range(n if n is not None else 2000):
        tx0 = int(A[L.P_TX])
        q.round()
        if per_round is not None:
            per_round.append(int(A[L.P_TX]) - tx0)
        time.sleep(0.002)
        got = q.drain()
        out += got
        quiet = 0 if got else quiet + 1
        if n is None and quiet >= 25:
            break
    return out


def read_req(q, psn, n, off=0):
    from metaroce_xdp.wire import RETH, Op
    return (Op.RDMA_READ_REQUEST, psn, b"", dict(reth=RETH(va=q.mr.addr + off, rkey=q.mr.rkey, dma_len=n)))


def write_req(q, psn, data, off=0):
    from metaroce_xdp.wire import RETH, Op
    return (Op.RDMA_WRITE_ONLY, psn, data, dict(reth=RETH(va=q.mr.addr + off, rkey=q.mr.rkey, dma_len=len(data))))


def responses(pkts):
    from metaroce_xdp.wire import Op
    return [p for p in pkts if Op.RDMA_READ_RESPONSE_FIRST <= p.bth.opcode <= Op.RDMA_READ_RESPONSE_ONLY]


@netns
def test_overlapping_write_behind_large_reads_does_not_stall_the_port(wire):
    """MR-RC-025 (issue 19 finding 7): the peer queues MAX_RD READs of 16 KiB each (256 responses) over the
    MR, then a one-packet WRITE into it.  The responses the WRITE must wait for leave at most a round's budget at a
    time (budget 16: no round sends more than the READ responses of the QP's own turn and of the WRITE's
    protection, 32, plus ACKs) -- they used to leave all at once, in the round that took the WRITE.  The
    WRITE is dropped meanwhile (counted, rx_rd_defer) and taken when the peer sends it again; every READ
    response carries the data from before the WRITE."""
    from metaroce_xdp.dp import layout as L
    with scripted(wire, budget=16) as q:
        q.buf[:] = 0x11
        A = q.ctx.plane.A
        d0 = port_counter(A, "rx_rd_defer")
        n = L.MAX_RD
        q.send([read_req(q, 100 + 16 * i, 16 * MTU, (i % 4) * 16 * MTU) for i in range(n)])
        per_round: list[int] = []
        out = rounds(q, 1, per_round)
        q.send([write_req(q, 100 + 16 * n, b"\x22" * MTU, 60000 - MTU)])
        out += rounds(q, 3, per_round)
        assert max(per_round) <= 2 * 16 + 4, per_round
        assert port_counter(A, "rx_rd_defer") > d0
        out += rounds(q)                                              # the READs finish, paced
        q.send([write_req(q, 100 + 16 * n, b"\x22" * MTU, 60000 - MTU)])   # the requester's retry
        out += rounds(q)
        rr = responses(out)
        assert len(rr) == 16 * n and {p.bth.psn for p in rr} == set(range(100, 100 + 16 * n))
        assert all(set(p.payload) == {0x11} for p in rr)
        assert bytes(q.buf[60000 - MTU:60000]) == b"\x22" * MTU


@netns
def test_duplicate_read_is_answered_only_while_kept(wire):
    """MR-DUP-003, MR-DUP-007 (issue 19 finding 10): MAX_RD + 4 one-packet READs, all answered; a duplicate of
    the first (no longer among the MAX_RD the responder keeps) is discarded and counted (rx_dup_rd_drop)
    -- it used to be executed again, like any duplicate READ at any past PSN; a duplicate of the last
    is answered again; one asking for more than the saved READ is discarded."""
    from metaroce_xdp.dp import layout as L
    with scripted(wire) as q:
        A = q.ctx.plane.A
        n = L.MAX_RD + 4
        q.buf[:n * 64] = np.repeat(np.arange(n, dtype=np.uint8), 64)
        for k in range(0, n, 4):                                      # no more than MAX_RD outstanding
            q.send([read_req(q, 100 + i, 64, 64 * i) for i in range(k, k + 4)])
            assert len(responses(rounds(q))) == 4
        k0 = port_counter(A, "rx_dup_rd_drop")
        q.send([read_req(q, 100, 64, 0)])
        assert responses(rounds(q)) == []
        assert port_counter(A, "rx_dup_rd_drop") == k0 + 1
        q.send([read_req(q, 100 + n - 1, 64, 64 * (n - 1))])
        got = responses(rounds(q))
        assert [(p.bth.psn, bytes(p.payload)) for p in got] == [(100 + n - 1, bytes([n - 1]) * 64)]
        q.send([read_req(q, 100 + n - 1, 128, 64 * (n - 1))])       # beyond what that READ asked for
        assert responses(rounds(q)) == []
        assert port_counter(A, "rx_dup_rd_drop") == k0 + 2


@netns
def test_forged_native_sack_on_the_wire_changes_nothing(wire):
    """MR-SACK-019, MR-LOSS-001 through the plane's receive path (the XDP program's SACK ring, nat_kern_sacks,
    or the AF_XDP socket, nat_rx: both end in tx_on_sack): a native requester with one WRITE acknowledged
    (srtt from its SACK) and one outstanding gets a SACK from the peer's address whose BTH.PSN lies W + 5
    before snd_una and whose tsecr is 2^30 us old.  It is refused and counted (c_sack_inv): srtt, snd_una
    and the outstanding WRITE stay as they were (d96aa28 took it as stale and set srtt to about 18 minutes);
    the real SACK then completes the WRITE."""
    from test_dp_native_wire import SQ_PSN, Native, _post_write
    q = Native(wire)
    try:
        p = _post_write(q, 1)
        q.sack(SQ_PSN, 0x1F, 1, tsecr=p.neth.tsval)
        q.rounds()
        assert [w.wr_id for w in q.cq.poll(4)] == [1]
        p2 = _post_write(q, 2)
        c0 = q.qp.native_counters()
        assert c0["snd_una"] == SQ_PSN + 1 and c0["srtt_ns"] > 0
        w = 256
        q.sack((SQ_PSN + 1 - w - 5) & 0xFFFFFF, 0x1F, 1, tsecr=(p2.neth.tsval - (1 << 30)) & 0xFFFFFFFF, flags=0x80)
        q.rounds()
        c = q.qp.native_counters()
        assert c["c_sack_rx"] == c0["c_sack_rx"] + 1                  # it arrived and was judged
        assert (c["srtt_ns"], c["snd_una"], c["cwnd"]) == (c0["srtt_ns"], c0["snd_una"], c0["cwnd"])
        assert c["c_sack_inv"] == c0["c_sack_inv"] + 1 and q.cq.poll(4) == []
        q.sack(SQ_PSN + 1, 0x1F, 2, tsecr=p2.neth.tsval)
        q.rounds()
        assert [w.wr_id for w in q.cq.poll(4)] == [2]
    finally:
        q.close()


# ============================================================================ CNP and QPN
@netns
def test_forged_cnp_burst_cuts_the_rate_once(wire):
    """MR-CC-035 (issue 19 finding 5): 20 CNPs for the QP from the peer's address in one cnp_interval (a
    forger needs only the QPN): the XDP program verifies and counts all 20, the reaction point cuts the
    rate once (it used to cut once per CNP, up to 64 a round: with alpha 1, down to R_min)."""
    from metaroce_xdp.verbs_types import SendWR, WROpcode
    from metaroce_xdp.wire import Op, encode
    topo, pair, sock, ctx = wire
    with scripted(wire) as q:
        # an RDMA WRITE the scripted peer never acknowledges keeps the QP on the loop's active list
        q.qp.post_send([SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[_sge(q, 0, 64)], remote_addr=0x1000,
                               rkey=1)])
        rounds(q, 3)
        # alpha 1, as after a congestion episode, kept from decaying while the case runs: each cut halves
        from metaroce_xdp.dp import layout as L
        f = ctx.plane.F[q.qp.qi]
        f[L.F_ALPHA] = 1.0
        f[L.F_ALPHA_DUE] = time.monotonic_ns() + 10**12
        c0 = q.qp.query()
        a, b = pair.a, pair.b
        cnp = encode(Op.CNP, src_mac=b.mac, dst_mac=a.mac, src_ip=b.ipv4, dst_ip=a.ipv4, sport=0xC123,
                     dest_qp=q.qp.qp_num, psn=0, becn=1)
        for _ in range(20):
            sock.send(cnp)
        time.sleep(0.1)
        rounds(q, 3)
        c = q.qp.query()
        assert c0["rate_bps"] == c0["rate_min_bps"]                   # at line rate, never cut
        assert c["rx_cnp"] - c0["rx_cnp"] == 20
        assert c["rate_min_bps"] == pytest.approx(c0["rate_bps"] / 2, rel=0.01)      # one halving, not 20
        assert c["rate_cuts"] - c0["rate_cuts"] == 1
        assert q.ctx.stats()["rx_cnp_coalesced"] >= 19


def _sge(q, off, n):
    from metaroce_xdp.verbs_types import SGE
    return SGE(addr=q.mr.addr + off, length=n, lkey=q.mr.lkey)


@netns
def test_qpns_carry_fourteen_random_bits(wire):
    """MR-SEC-032 (issue 19 finding 5): 300 QPs made and destroyed on one row: the QPN keeps the row in its
    low bits (qpn % maxq, the XDP program's slot) and draws the 14 bits above it at random -- they
    were 8 (1 + randbelow(255)), so a forger needed at most 255 guesses per row; never 0, 1, 0xFFFFFF."""
    topo, pair, sock, ctx = wire
    pd = ctx.alloc_pd()
    cq = ctx.create_cq(4)
    maxq = ctx.plane.maxq
    qpns = []
    for _ in range(300):
        qp = ctx.create_qp(pd, cq, cq)
        qpns.append(qp.qp_num)
        ctx.destroy_qp(qp)
    assert all(0 < p < 0xFFFFFF and p not in (0, 1) and p % maxq == qpns[0] % maxq for p in qpns)
    high = [p // maxq for p in qpns]
    assert len(set(high)) >= 290 and max(high) >= 1 << 13
    from metaroce_xdp.dp.context import qpn_for
    draws = [qpn_for(1024, 1023) for _ in range(20000)]
    assert max(draws) <= 0xFFFFFE and min(draws) >= 1024 + 1023
    assert np.log2(len(set(d >> 10 for d in draws))) >= 13


# ============================================================================ event ring
@pytest.mark.compiles
def test_full_event_ring_counts_what_it_drops():
    """dp/core.py push_event (issue 19 finding 10): an event that finds the ring full (nobody drains it) is
    counted in the port's ev_drop, which stats() shows -- it used to vanish."""
    from metaroce_xdp import jitwarm
    from metaroce_xdp.dp import layout as L
    from metaroce_xdp.dp.core import push_event
    A = np.zeros(L.N_P + 1024 * L.NEVF + 8, np.int64)
    A[L.P_EV_OFF] = L.N_P
    with jitwarm.unsealed():                    # a plane started earlier in the process sealed the compiler
        for i in range(1024 + 5):
            push_event(A, 1, 2, i, 0)
    assert A[L.P_EV_TAIL] - A[L.P_EV_HEAD] == 1024 and A[L.P_EV_DROP] == 5
