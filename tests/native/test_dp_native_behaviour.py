"""Native rules seen on the wire between two compiled-plane hosts (A <-> switch <-> B over veth, real XDP and
AF_XDP), with a capture on the switch port towards A that sees, in order, what A sends and what reaches it:

* MR-NAT-024: a fenced work request's first packet leaves only after every earlier one completed (a WRITE
  included, unlike compat's fence).
* MR-CC-020: a READ request leaves only while the response PSNs asked for and not yet received, plus its
  span, fit the READ window (or none is outstanding).
* MR-NAT-003: the profile chosen at RTR holds until RESET; another one needs a new set-up.
* MR-NAT-004, MR-MP-001, MR-MP-003, MR-MP-015, MR-CC-040 through the MRC1 exchange of dp/cmconnect.py,
  against a peer that offers other capabilities than this endpoint (NATIVE without SACK or OOO_PLACEMENT,
  no MULTIPATH, another entropy count, a NATIVE_TIMING TLV): the profile, K and T_peer the QP runs with,
  and the UDP source ports its packets use.
"""
from __future__ import annotations


import pytest

from dp_players import FULL, collect, connected
from wire_players import PortTap
from metaroce_xdp import cm
from metaroce_xdp.native import layout as NL
from metaroce_xdp.verbs_types import (InvalidArgument, QPAttr, QPState, SendFlags, SendWR, WCStatus, WROpcode)
from metaroce_xdp.wire import MalformedPacket, NotMetaRoCE, Op, decode

pytestmark = pytest.mark.netns

PSN_MASK = 0xFFFFFF
REQUESTS = (Op.NATIVE_SEND, Op.NATIVE_SEND_IMM, Op.NATIVE_WRITE, Op.NATIVE_WRITE_IMM, Op.NATIVE_READ_REQ)


def _pkts(tap: PortTap) -> list:
    """(sent by the switch port, decoded) of each MetaRoCE frame the tap holds, in the order the port saw
    them; other traffic (ARP, IPv6) skipped."""
    out = []
    for f, sent in tap.raw():
        try:
            out.append((sent, decode(f)))
        except (NotMetaRoCE, MalformedPacket):
            continue
    return out


@pytest.fixture
def tap_a(fabric):
    t = PortTap(fabric.topo, fabric.topo[1], "swA")
    yield t
    t.close()


def _connect(side, peer, profile, psn, params=None):
    side.connect(peer, sq_psn=psn, rq_psn=psn, min_rnr_timer=None, profile=profile, native_params=params)


def _fresh(a, b, profile="native", psn=0x100, params=None):
    connected(a, b, seeds=(11, 12), sq_psn=psn, rq_psn=psn, min_rnr_timer=None, profile=profile,
              native_params=params)


def _write(a, b, wr_id, off, n, flags=SendFlags.SIGNALED):
    return SendWR(wr_id=wr_id, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(off, n)], remote_addr=b.mr.addr + off,
                  rkey=b.mr.rkey, send_flags=flags)


def _covers(cum, psn):
    """An ACK-type SACK with cumulative PSN cum acknowledges psn."""
    return ((cum - psn) & PSN_MASK) < 0x800000


def _fence_run(fabric, tap, fenced):
    """A: a WRITE of 8 packets (PSNs 0x100..0x107), then a one-packet WRITE at 0x108, fenced or not.  The
    capture's index of that packet's first transmission and of the first SACK acknowledging 0x107."""
    topo, a, b = fabric
    _fresh(a, b)
    _pkts(tap)
    a.qp.post_send([_write(a, b, 1, 0, 8 * 1024),
                    _write(a, b, 2, 100_000, 100, SendFlags.SIGNALED | (SendFlags.FENCE if fenced else 0))])
    got = collect(a, 2, [b])
    assert [(w.wr_id, w.status) for w in got] == [(1, WCStatus.SUCCESS), (2, WCStatus.SUCCESS)]
    assert (b.buf[:8 * 1024] == a.buf[:8 * 1024]).all() and (b.buf[100_000:100_100] == a.buf[100_000:100_100]).all()
    fr = _pkts(tap)
    first = next(i for i, (out, p) in enumerate(fr) if not out and p.bth.dest_qp == b.qp.qp_num
                 and p.bth.opcode in REQUESTS and p.bth.psn == 0x108)
    acked = next(i for i, (out, p) in enumerate(fr) if out and p.bth.dest_qp == a.qp.qp_num
                 and p.bth.opcode == Op.NATIVE_SACK and not p.aeth.syndrome & 0x60 and _covers(p.bth.psn, 0x107))
    return first, acked


def test_fence_waits_for_every_earlier_work_request_mr_nat_024(fabric, tap_a):
    """MR-NAT-024: the first packet of a WRITE posted with IBV_SEND_FENCE behind an 8-packet WRITE leaves A only
    after the SACK that acknowledges the whole earlier WRITE reached A (a WRITE: compat's fence would not wait
    for it).  Without the fence the same WRITE leaves right behind the first one, before any SACK covers it
    (the initial window of 16 holds both and nothing paces before an RTT sample, MR-CC-005)."""
    first, acked = _fence_run(fabric, tap_a, fenced=True)
    assert acked < first, (acked, first)
    first, acked = _fence_run(fabric, tap_a, fenced=False)
    assert first < acked, (first, acked)


def test_read_requests_wait_for_the_read_window_mr_cc_020(fabric, tap_a):
    """MR-CC-020: eight READs of 4 packets each, with a READ window of 4 (init_cwnd 4; no delay or loss cuts
    here): every READ request leaves A when no response PSN is outstanding, or when the outstanding ones and
    its span fit max(read_cwnd, 1) -- as the capture sees them, the responses counted when they reach A's
    port.  The request window (cwnd 4, one packet per READ request) would let four READs out at once: 16
    response PSNs outstanding.  Every READ completes with its bytes."""
    topo, a, b = fabric
    # no cut of the READ window: no delay signal (cc_delay 0), and timers far above this host's delays
    _fresh(a, b, params={"init_cwnd": 4, "cc_delay": 0, "rto_initial": 50, "rto_min": 20_000})
    _pkts(tap_a)
    n, size = 8, 4096
    a.qp.post_send([SendWR(wr_id=i, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(500_000 + i * size, size)],
                           remote_addr=b.mr.addr + 200_000 + i * size, rkey=b.mr.rkey) for i in range(n)])
    got = collect(a, n, [b])
    assert [(w.wr_id, w.status) for w in got] == [(i, WCStatus.SUCCESS) for i in range(n)]
    assert (a.buf[500_000:500_000 + n * size] == b.buf[200_000:200_000 + n * size]).all()
    c = a.qp.native_counters()
    rd_cwnd = c["rd_cwnd"]                           # grew from 4, never cut: the largest it ever was
    assert rd_cwnd >= 4 and c["c_rd_dec_loss"] == c["c_rd_dec_ecn"] == c["c_rd_dec_delay"] == 0, c
    asked, seen, reqs = set(), set(), []
    for out, p in _pkts(tap_a):
        if p.bth.dest_qp not in (a.qp.qp_num, b.qp.qp_num):
            continue
        if not out and p.bth.opcode == Op.NATIVE_READ_REQ and not p.neth.flags & 0x20:      # a new request
            span = (p.reth.dma_len + 1023) // 1024
            outstanding = len(asked - seen)
            reqs.append((outstanding, span))
            assert outstanding == 0 or outstanding + span <= max(int(rd_cwnd), 1), reqs
            asked |= {(p.bth.psn + i) & PSN_MASK for i in range(span)}
        elif out and p.bth.opcode == Op.NATIVE_READ_RESP:
            seen.add(p.bth.psn)
    assert len(reqs) == n and asked <= seen, reqs


def test_profile_holds_from_rtr_until_reset_mr_nat_003(fabric):
    """MR-NAT-003: a native QP refuses another profile at RTS -> RTS (a failed modify changes nothing: still
    native, still RTS, its next WRITE goes native); after RESET a new set-up (INIT, RTR with profile compat)
    makes the same QP a compat QP, whose WRITE is acknowledged the compat way."""
    topo, a, b = fabric
    _fresh(a, b)
    with pytest.raises(InvalidArgument):
        a.qp.modify(QPAttr(qp_state=QPState.RTS, profile="compat"))
    with pytest.raises(InvalidArgument):
        a.qp.modify(QPAttr(profile="compat", timeout=14))
    assert a.qp.query_state() == QPState.RTS and a.qp.query()["profile"] == "native"
    ack0 = b.ctx.stats()["tx_ack"]
    a.qp.post_send(_write(a, b, 1, 0, 5000))
    assert [(w.wr_id, w.status) for w in collect(a, 1, [b])] == [(1, WCStatus.SUCCESS)]
    c = a.qp.native_counters()
    assert c["c_tx"] - c["c_retx"] == 5 and b.ctx.stats()["tx_ack"] == ack0          # SACKs, no ACKNOWLEDGE
    for s, peer in ((a, b), (b, a)):
        s.qp.modify(QPAttr(qp_state=QPState.RESET))
    for s, peer in ((a, b), (b, a)):
        _connect(s, peer, "compat", 0x500)
    assert a.qp.query()["profile"] == b.qp.query()["profile"] == "compat" and a.qp.native_counters() == {}
    a.qp.post_send(_write(a, b, 2, 10_000, 5000))
    assert [(w.wr_id, w.status) for w in collect(a, 1, [b])] == [(2, WCStatus.SUCCESS)]
    assert (b.buf[:5000] == a.buf[:5000]).all() and (b.buf[10_000:15_000] == a.buf[10_000:15_000]).all()
    assert b.ctx.stats()["tx_ack"] > ack0


# ---------------------------------------------------------------------------- negotiation
def _peer_connects(topo, a, b, port, caps, entropy_count=16, sack_window=256, tlvs=()):
    """A, playing another implementation, connects to B's accept_qp (profile auto) with a REQ offering `caps`,
    `entropy_count`, `sack_window` and `tlvs`; A's QP takes the agreed profile as connect_qp would.  Returns
    (A's REQ, B's accept_qp result)."""
    from metaroce_xdp.dp.cmconnect import QP_RD, agreed_profile, with_acceptor
    a.new_qp(), b.new_qp()
    for s in (a, b):
        s.qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
    psn = cm.random_psn()
    req = cm.CMMsg(cm.MsgType.REQ, cookie=cm.new_cookie(), flags=cm.FLAG_COMPAT_OK, capabilities=int(caps),
                   gid=cm.ip_to_gid(a.ctx.local_ip), qpn=a.qp.qp_num, psn=psn, path_mtu=cm.MTU_ENUM[1024],
                   mac=cm.mac_bytes(a.ctx.local_mac), max_rd_atomic=QP_RD, max_dest_rd_atomic=QP_RD,
                   sack_window=sack_window, entropy_count=entropy_count, tlvs=list(tlvs))

    def to_rts(rep):
        prof, params = agreed_profile(rep.capabilities, rep.sack_window, rep.entropy_count, cm.peer_timing(rep))
        a.qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=rep.qpn, rq_psn=rep.psn, path_mtu=1024,
                           dgid=cm.gid_to_ip(rep.gid), max_dest_rd_atomic=QP_RD, profile=prof, native_params=params))
        a.qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=psn, max_rd_atomic=QP_RD))

    def active():
        with topo.enter(a.ns):
            with cm.connect(b.ctx.gid, port, 10) as ch:
                cm.active_exchange(ch, req, to_rts, 10)
    _, rb = with_acceptor(active, b.qp, port, enter=lambda: topo.enter(b.ns))
    return req, rb


def _par(side):
    return side.ctx.plane.nat.rows(side.qp.qi)[0]


def _b_sports(fabric, n_pkts=64):
    """A writes 16 packets to B -- B SACKs them before it sent any request -- then B writes n_pkts packets to
    A; the UDP source ports of B's native frames (requests, SACKs) as they reach the switch, the data
    checked."""
    topo, a, b = fabric
    tap = PortTap(topo, topo[1], "swB")
    try:
        a.buf[:] = 1
        b.buf[:] = 2
        a.qp.post_send(_write(a, b, 2, 1 << 20, 16 * 1024))
        assert [(w.wr_id, w.status) for w in collect(a, 1, [b])] == [(2, WCStatus.SUCCESS)]
        b.qp.post_send(_write(b, a, 1, 0, n_pkts * 1024))
        assert [(w.wr_id, w.status) for w in collect(b, 1, [a])] == [(1, WCStatus.SUCCESS)]
        assert (a.buf[:n_pkts * 1024] == 2).all() and (b.buf[1 << 20:(1 << 20) + 16 * 1024] == 1).all()
        fr = [p for out, p in _pkts(tap) if not out and p.bth.dest_qp == a.qp.qp_num]
    finally:
        tap.close()
    reqs = {p.udp.sport for p in fr if p.bth.opcode in REQUESTS}
    sacks = {p.udp.sport for p in fr if p.bth.opcode == Op.NATIVE_SACK}
    assert sum(p.bth.opcode in REQUESTS for p in fr) >= n_pkts and sacks
    return reqs, sacks


NATIVE = cm.Cap.NATIVE | cm.Cap.SACK | cm.Cap.OOO_PLACEMENT


@pytest.mark.parametrize("caps", [cm.Cap.NATIVE | cm.Cap.OOO_PLACEMENT | cm.Cap.MULTIPATH,
                                  cm.Cap.NATIVE | cm.Cap.SACK | cm.Cap.MULTIPATH], ids=["no-sack", "no-ooo"])
def test_native_without_sack_or_ooo_placement_is_compat_mr_nat_004(fabric, caps):
    """MR-NAT-004: a peer whose REQ sets NATIVE but not SACK (or not OOO_PLACEMENT) is treated as offering no
    NATIVE: the REP's agreed set has none of the native bits, both QPs run compat and a WRITE completes
    intact the compat way."""
    topo, a, b = fabric
    req, rb = _peer_connects(topo, a, b, 18700 + int(caps), caps | cm.Cap.ATOMICS)
    assert rb["profile"] == "compat" and rb["agreed_caps"] & int(cm.NATIVE_SET) == 0
    assert a.qp.query()["profile"] == b.qp.query()["profile"] == "compat"
    a.buf[:] = 7
    a.qp.post_send(_write(a, b, 1, 0, 20_000))
    assert [(w.wr_id, w.status) for w in collect(a, 1, [b])] == [(1, WCStatus.SUCCESS)]
    assert (b.buf[:20_000] == 7).all() and b.qp.native_counters() == {} and b.ctx.stats()["tx_ack"] > 0


def test_without_multipath_k_is_1_and_one_port_carries_everything_mr_mp_001_003(fabric):
    """MR-MP-001: a peer offering NATIVE, SACK and OOO_PLACEMENT but not MULTIPATH (entropy_count 16 all the
    same): the agreed set has no MULTIPATH, B's QP runs native with K = 1.  MR-MP-003: every native packet
    of B's QP -- 64 WRITE packets, and its SACKs, those sent before its first request included -- carries
    that single entropy value as UDP source port."""
    topo, a, b = fabric
    req, rb = _peer_connects(topo, a, b, 18710, NATIVE, entropy_count=16)
    assert rb["profile"] == "native" and not rb["agreed_caps"] & cm.Cap.MULTIPATH
    assert int(_par(b)[NL.P_K]) == int(_par(a)[NL.P_K]) == 1
    sp0 = int(b.ctx.plane.nat.rows(b.qp.qi)[5][0])
    reqs, sacks = _b_sports(fabric)
    assert reqs == sacks == {sp0}, (reqs, sacks, hex(sp0))
    assert 0xC000 <= sp0 <= 0xFFFF


@pytest.mark.parametrize("offered,want", [(4, 4), (255, 16)])
def test_k_is_the_agreed_entropy_count_mr_mp_001_015(fabric, offered, want):
    """MR-MP-001: with MULTIPATH agreed, K is the agreed entropy count -- the smaller of the REQ's and this
    endpoint's 16 -- and B's packets use exactly its K values (smooth round robin over 64 packets, MR-MP-006);
    MR-MP-015: the SACK window this endpoint offers and agrees (W 256) is at least 4 * K."""
    from metaroce_xdp.dp.cmconnect import K_OFFER, W_OFFER
    topo, a, b = fabric
    req, rb = _peer_connects(topo, a, b, 18720 + offered, NATIVE | cm.Cap.MULTIPATH, entropy_count=offered)
    assert rb["profile"] == "native" and rb["agreed_caps"] & cm.Cap.MULTIPATH
    par = _par(b)
    assert int(par[NL.P_K]) == int(_par(a)[NL.P_K]) == want
    assert int(par[NL.P_W]) == W_OFFER == 256 and W_OFFER >= 4 * K_OFFER and int(par[NL.P_W]) >= 4 * want
    values = {int(v) for v in b.ctx.plane.nat.rows(b.qp.qi)[5][:want]}
    reqs, sacks = _b_sports(fabric)
    assert reqs == values and sacks <= values, (reqs, sacks, values)


def test_default_negotiation_window_and_entropy_count_mr_mp_015(fabric):
    """MR-MP-015: two endpoints of this implementation (connect_qp, accept_qp) agree W = 256 and K = 16, so
    W >= 4 * K; a 1 MiB WRITE stream then never finds the SACK window full (c_blk_w 0): the window is no
    smaller than the packets in flight the path needs."""
    from metaroce_xdp.dp.cmconnect import connect_qp, with_acceptor
    topo, a, b = fabric
    a.new_qp(), b.new_qp()
    for s in (a, b):
        s.qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))

    def active():
        with topo.enter(a.ns):
            return connect_qp(a.qp, b.ctx.gid, port=18730, timeout=10)
    ra, rb = with_acceptor(active, b.qp, 18730, enter=lambda: topo.enter(b.ns))
    assert ra["profile"] == rb["profile"] == "native"
    for s in (a, b):
        par = _par(s)
        assert int(par[NL.P_W]) == 256 and int(par[NL.P_K]) == 16 and par[NL.P_W] >= 4 * par[NL.P_K]
    a.buf[:] = 3
    a.qp.post_send([_write(a, b, i, i * 65536, 65536) for i in range(16)])
    assert [(w.wr_id, w.status) for w in collect(a, 16, [b], timeout=30)] == [(i, WCStatus.SUCCESS) for i in range(16)]
    assert (b.buf[:1 << 20] == 3).all()
    c = a.qp.native_counters()
    assert c["c_blk_w"] == 0 and c["c_tx"] >= 1024, c


def test_t_peer_from_the_native_timing_tlv_mr_cc_040(fabric):
    """MR-CC-040: a peer that announces ack_coalesce_us 20 in its NATIVE_TIMING TLV gives B's QP T_peer = 20 us
    (its queueing allowance max(25 us, 4 * 20 us) = 80 us); a peer that announces none leaves the default
    5 us (MR-SACK-015)."""
    topo, a, b = fabric
    tlv = (cm.TLV_NATIVE_TIMING, (20).to_bytes(2, "big") + (8).to_bytes(2, "big") + (500).to_bytes(4, "big"))
    _peer_connects(topo, a, b, 18740, NATIVE | cm.Cap.MULTIPATH, tlvs=[tlv])
    assert int(_par(b)[NL.P_T_PEER]) == 20_000 and int(_par(a)[NL.P_T_PEER]) == 5_000
    _peer_connects(topo, a, b, 18741, NATIVE | cm.Cap.MULTIPATH)
    assert int(_par(b)[NL.P_T_PEER]) == 5_000
