"""NATIVE_SACKs consumed by the XDP program (MR-SACK-043) in a native transfer between two compiled-plane
hosts over veth, through the switch namespace's seeded fault injectors: every SACK the requester acts on
came through its QP's mr_sacks ring, none through its AF_XDP socket; a full ring sends the rest through
the socket, and what waited in the ring is stale by the time it is read and changes nothing."""
from __future__ import annotations

import time

import pytest

from dp_players import collect, connected
from metaroce_xdp.verbs_types import QPState, SendWR, WCStatus, WROpcode

pytestmark = pytest.mark.netns

OP_NATIVE_SACK = 0xC6
TSECR_BYTE = 12 + 4 + 1          # from the BTH: a byte of SACKETH.tsecr (the frame stays a well-formed SACK)


def _native_pair(a, b, psn=0xFFFF00):
    connected(a, b, seeds=(7, None), sq_psn=psn, rq_psn=psn, rd_atomic=None, min_rnr_timer=None, profile="native")


def _writes(a, b, n_wr, size):
    return [SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(i * size, size)],
                   remote_addr=b.mr.addr + i * size, rkey=b.mr.rkey) for i in range(n_wr)]


def _ring(side):
    nat = side.ctx.plane.nat
    return side.ctx.loader.sacks[int(nat.natq[side.qp.qi]) - 1]


def test_sacks_reach_the_requester_through_the_kernel_ring_under_loss(fabric):
    """MR-SACK-043: 2 MiB of native WRITEs with 1 % loss each way, and duplicated, reordered and corrupted
    SACKs toward the requester: intact, in order; the requester's AF_XDP socket receives nothing (all it
    gets are SACKs), every SACK it applied came from the ring (c_sack_rx == c_sack_kern == what the kernel
    pushed == SACK_CONSUMED), and each corrupted SACK was dropped by the kernel's ICRC check (MR-ICRC-014)
    before any state moved."""
    topo, a, b = fabric
    _native_pair(a, b)
    n_wr, size = 16, 128 * 1024
    rx0, st0 = a.ctx.stats(), (a.ctx.loader.events(), a.ctx.loader.drops())
    with fabric.impair("b", seed=31, drop_ppm=10_000) as fb, \
            fabric.impair("a", seed=32, drop_ppm=10_000, dup_ppm=20_000, reorder_ppm=20_000,
                          reorder_delay_us=300, corrupt_ppm=30_000, corrupt_offset=TSECR_BYTE,
                          opcode_filter=[OP_NATIVE_SACK]) as fa:
        a.qp.post_send(_writes(a, b, n_wr, size))
        got = collect(a, n_wr, [b], timeout=60)
    hit_a, hit_b = fa.final_stats, fb.final_stats  # as of close: nothing is touched after
    time.sleep(0.05)                     # SACKs the injector delayed or duplicated arrive late: let them,
    ring = _ring(a)                      # and let the loop read them, before counting
    for _ in range(200):
        a.ctx.progress(), b.ctx.progress()
        if int(ring["cons"]) == int(ring["prod"]):
            break
    assert [(w.wr_id, w.status) for w in got] == [(i, WCStatus.SUCCESS) for i in range(n_wr)]
    assert (b.buf[:n_wr * size] == a.buf[:n_wr * size]).all()
    assert hit_b["dropped"] > 0 and hit_a["dropped"] > 0 and hit_a["duplicated"] > 0 and hit_a["corrupted"] > 0
    st = a.ctx.stats()
    assert st["rx"] - rx0["rx"] == 0, "a SACK reached the requester's AF_XDP socket"
    na = a.qp.native_counters()
    ev = {k: v - st0[0][k] for k, v in a.ctx.loader.events().items()}
    drops = {k: v - st0[1][k] for k, v in a.ctx.loader.drops().items()}
    assert na["c_sack_rx"] == na["c_sack_kern"] == na["k_sack_pushed"] == ev["SACK_CONSUMED"] > 0, (na, ev)
    assert st["rx_sack_kern"] - rx0["rx_sack_kern"] == na["c_sack_kern"]
    assert na["k_sack_full"] == na["k_sack_busy"] == na["c_sack_kern_discarded"] == 0, na
    assert ev["SACK_RING_FULL"] == 0 and ev["STEERED"] == 0
    assert hit_a["corrupted"] <= drops["BAD_ICRC"] <= hit_a["corrupted"] + hit_a["duplicated"], (drops, hit_a)
    # lost data resent; a SACK refused only when it came more than W after snd_una (MR-SACK-019): one the
    # injector held back 300 us or sent twice
    assert na["c_sack_inv"] <= hit_a["delayed"] + hit_a["duplicated"] and na["c_retx"] >= 1


def test_a_full_ring_falls_back_to_the_socket_and_late_sacks_are_stale(fabric):
    """MR-SACK-043: a ring its loop does not read fills up, and the kernel steers the QP's further SACKs to
    the AF_XDP socket: a transfer completes through them alone.  The ring is made full with the last
    MR_SACK_RING_LEN SACKs of an earlier transfer (the loop's read index moved back over them), so when the
    loop reads it again they arrive late: tx_on_sack treats them as any late SACK -- stale (MR-SACK-037) or,
    more than W behind snd_una, refused (MR-SACK-019); nothing acknowledged twice, no completion, no
    retransmission."""
    from metaroce_xdp.kern.layout import MR_SACK_RING_LEN as LEN
    topo, a, b = fabric
    _native_pair(a, b, psn=0x200)
    ring = _ring(a)
    p0 = int(ring["prod"])
    a.qp.post_send(_writes(a, b, 4, 256 * 1024))
    assert [w.status for w in collect(a, 4, [b], timeout=30)] == [WCStatus.SUCCESS] * 4
    assert int(ring["prod"]) - p0 >= LEN and int(ring["cons"]) == int(ring["prod"])
    owner = int(ring["owner"])
    with a.ctx.plane.paused():
        ring["owner"] = 0                                  # the loop leaves the ring alone ...
        ring["cons"] = int(ring["prod"]) - LEN             # ... holding the last LEN SACKs, unread: full
    rx0, na0 = a.ctx.stats()["rx"], a.qp.native_counters()
    try:
        a.qp.post_send(_writes(a, b, 8, 64 * 1024))
        got = collect(a, 8, [b], timeout=30)
    finally:
        with a.ctx.plane.paused():
            ring["owner"] = owner
    assert [(w.wr_id, w.status) for w in got] == [(i, WCStatus.SUCCESS) for i in range(8)]
    assert (b.buf[:8 * 64 * 1024] == a.buf[:8 * 64 * 1024]).all()
    before = a.qp.native_counters()
    steered = before["k_sack_full"] + before["k_sack_busy"] - na0["k_sack_full"] - na0["k_sack_busy"]
    assert before["k_sack_full"] > na0["k_sack_full"] and before["k_sack_pushed"] == na0["k_sack_pushed"]
    assert a.ctx.stats()["rx"] - rx0 == before["c_sack_rx"] - na0["c_sack_rx"] == steered > 0
    for _ in range(20):                  # the loop reads the ring again: the LEN late SACKs
        a.ctx.progress()
    after = a.qp.native_counters()
    assert after["c_sack_kern"] - before["c_sack_kern"] == LEN and after["c_sack_kern_discarded"] == 0
    assert after["c_sack_rx"] - before["c_sack_rx"] == LEN
    # each is stale (MR-SACK-037: valid, feedback only) or, named more than W before snd_una -- the second
    # transfer moved snd_una on by more than W -- refused (MR-SACK-019)
    stale = after["c_sack_stale"] - before["c_sack_stale"]
    refused = after["c_sack_inv"] - before["c_sack_inv"]
    assert after["c_sack"] - before["c_sack"] == stale and stale + refused == LEN
    assert (after["snd_una"], after["c_retx"]) == (before["snd_una"], before["c_retx"])
    assert a.cq.poll(10) == []


def test_a_sack_arriving_while_the_loop_sleeps_wakes_it_through_the_socket(fabric):
    """MR-SACK-043 (4): a requester whose progress thread sleeps in poll() (nothing outstanding) marks its
    ring `sleeping`; a SACK that arrives then (here a copy of the last one, sent by hand from B's side) is
    steered to the socket, wakes the loop and is applied at once -- it does not wait in the ring."""
    import json
    import socket
    import struct

    from metaroce_xdp.wire import AETH, SACKETH, Op, encode
    topo, a, b = fabric
    _native_pair(a, b, psn=0x300)
    a.qp.post_send(_writes(a, b, 2, 8192))
    assert [w.status for w in collect(a, 2, [b])] == [WCStatus.SUCCESS] * 2
    mac = {s: json.loads(topo.run(s.ns, ["ip", "-j", "link", "show", dev]).stdout)[0]["address"]
           for s, dev in ((a, "mr0"), (b, "mr1"))}
    ring, pl = _ring(a), a.ctx.plane
    na0, rx0 = a.qp.native_counters(), a.ctx.stats()["rx"]
    pl.start(busy=False)
    try:
        for _ in range(400):                               # idle: the thread goes to sleep in poll()
            if pl.A[pl.loop.P_SLEEPING] and int(ring["sleeping"]):
                break
            time.sleep(0.005)
        assert int(ring["sleeping"]) == 1
        una = na0["snd_una"]
        frame = encode(Op.NATIVE_SACK, src_mac=mac[b], dst_mac=mac[a], src_ip=b.ctx.gid, dst_ip=a.ctx.gid,
                       dest_qp=a.qp.qp_num, psn=(una - 1) & 0xFFFFFF,
                       headers={"aeth": AETH(syndrome=0x1F, msn=2), "sacketh": SACKETH(flags=0x40)})
        with topo.enter(b.ns):
            with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:
                s.bind(("mr1", 0))
                s.send(frame)
        for _ in range(400):
            if a.qp.native_counters()["c_sack_rx"] > na0["c_sack_rx"]:
                break
            time.sleep(0.005)
    finally:
        pl.stop()
    na = a.qp.native_counters()
    assert na["c_sack_rx"] - na0["c_sack_rx"] == 1 and na["k_sack_asleep"] - na0["k_sack_asleep"] == 1, na
    assert a.ctx.stats()["rx"] - rx0 == 1 and na["k_sack_pushed"] == na0["k_sack_pushed"]
    assert int(ring["sleeping"]) == 0 and int(ring["cons"]) == int(ring["prod"])
    assert (na["snd_una"], na["c_sack_inv"]) == (una, na0["c_sack_inv"])
    assert struct.unpack("!H", frame[12:14])[0] == 0x0800


def test_psn_sequence_error_naks_are_discarded_on_a_native_qp(fabric):
    """MR-SACK-033: a NAK-type SACK with syndrome 0x60 (PSN sequence error) or 0x64, which no native
    responder sends, is discarded and counted by the requester: the WRITE it names (its only packet
    dropped by the switch, so still outstanding) does not fail; it is retransmitted and completes."""
    import json
    import socket

    from metaroce_xdp.wire import AETH, SACKETH, Op, encode
    topo, a, b = fabric
    _native_pair(a, b, psn=0x500)
    mac = {s: json.loads(topo.run(s.ns, ["ip", "-j", "link", "show", dev]).stdout)[0]["address"]
           for s, dev in ((a, "mr0"), (b, "mr1"))}
    with fabric.impair("b", opcode_filter=[0xC2], psn_drop_once=[0x500]) as fb:
        a.qp.post_send(_writes(a, b, 1, 1000))
        for _ in range(2000):                              # transmitted (and dropped): outstanding
            a.ctx.progress()
            if fb.stats()["psn_dropped"]:
                break
        assert fb.stats()["psn_dropped"] == 1
        with topo.enter(b.ns):
            with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:
                s.bind(("mr1", 0))
                for syn in (0x60, 0x64):
                    s.send(encode(Op.NATIVE_SACK, src_mac=mac[b], dst_mac=mac[a], src_ip=b.ctx.gid,
                                  dst_ip=a.ctx.gid, dest_qp=a.qp.qp_num, psn=0x500,
                                  headers={"aeth": AETH(syndrome=syn, msn=0), "sacketh": SACKETH()}))
        for _ in range(2000):
            a.ctx.progress()
            if a.qp.native_counters()["c_sack_nak_seq"] == 2:
                break
        got = collect(a, 1, [b])
    assert [(w.wr_id, w.status) for w in got] == [(0, WCStatus.SUCCESS)]
    na = a.qp.native_counters()
    assert na["c_sack_nak_seq"] == 2 and na["c_retx"] + na["c_rto"] + na["c_tlp"] >= 1, na
    assert a.qp.query_state() == QPState.RTS
    assert (b.buf[:1000] == a.buf[:1000]).all()
