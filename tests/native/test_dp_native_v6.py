"""The native profile over IPv6 in the compiled data plane: the flow label follows the entropy value
(MR-MP-016, MR-ENC-017).  Hosts A and B through a switch namespace (a bridge), IPv6 addresses on both;
an AF_PACKET socket on the switch port towards A sees every frame both ways.  A native transfer sprays
over several UDP source ports and each port's frames carry one non-zero flow label, distinct ports
distinct labels, retransmissions and SACKs included; every frame's ICRC checks (the label is outside
it, MR-ICRC-005); receivers do not care (MR-MP-017: the data arrives intact).  A compat transfer on the
same hosts keeps the one port and the flow label 0 it always had (compat bytes unchanged)."""
from __future__ import annotations

import contextlib
import ipaddress
from collections import defaultdict

import pytest

from dp_players import collect
from wire_players import PortTap, is_roce_v6
from metaroce_xdp.native import layout as NL
from metaroce_xdp.verbs_types import QPAttr, QPState, SendWR, WCStatus, WROpcode
from metaroce_xdp.wire.packet import decode

A6, B6 = "fd79::1", "fd79::2"
A6I, B6I = int(ipaddress.ip_address(A6)), int(ipaddress.ip_address(B6))
# the module's `fabric` (tests/conftest.py): A and B through a switch, A6 and B6 on their links
pytestmark = [pytest.mark.netns, pytest.mark.fabric(prefix="mr6", addr6=(A6, B6), ipv6=True)]


@pytest.fixture(scope="module")
def v6(fabric):
    """The module's fabric: A and B through a switch, A6 and B6 on their links, both Contexts on IPv6."""
    assert fabric.a.ctx.gid == A6 and fabric.b.ctx.gid == B6
    return fabric


def _connect(a, b, profile, fresh=True, params=None):
    if fresh:
        a.new_qp(), b.new_qp()
    for s, p in ((a, b), (b, a)):
        if not fresh:
            with s.topo.enter(s.ns):
                s.qp.modify(QPAttr(qp_state=QPState.RESET))         # the same QPs (QPNs, GIDs) again
        s.connect(p, min_rnr_timer=None, profile=profile, native_params=params)


def _transfer(fab, profile, fault=None, fresh=True, params=None):
    topo, a, b = fab
    if fresh is not None:
        _connect(a, b, profile, fresh, params)
    a.fill(7)
    b.buf[:] = 0
    tap = PortTap(topo, topo[1], "swA")
    try:
        with (fab.impair("b", **fault) if fault else contextlib.nullcontext()):
            a.qp.post_send([SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(i * 100_000, 100_000)],
                                   remote_addr=b.mr.addr + i * 100_000, rkey=b.mr.rkey) for i in range(4)])
            got = collect(a, 4, [b], timeout=30)
        pkts = [decode(f) for f in tap.frames(is_roce_v6)]
    finally:
        tap.close()
    assert [(w.wr_id, w.status) for w in got] == [(i, WCStatus.SUCCESS) for i in range(4)]
    assert (b.buf[:400_000] == a.buf[:400_000]).all()
    assert pkts and all(p.ipv6 and p.icrc_ok for p in pkts)
    return pkts


def _labels_by_port(pkts):
    by = defaultdict(set)
    for p in pkts:
        by[p.udp.sport].add(p.ip.flow_label)
    return by


def test_native_flow_label_follows_the_entropy_value(v6):
    """MR-MP-016: every native frame's flow label is its entropy value's (one non-zero label per UDP source
    port, distinct ports distinct labels) -- new packets, retransmissions (1 % seeded loss towards B) and
    SACKs; the spraying shows in the labels too.  MR-MP-017, MR-ICRC-005: the labels are outside the
    ICRC, which checks on every frame, and the receiver places every byte."""
    topo, a, b = v6
    pkts = _transfer(v6, "native", fault=dict(seed=5, drop_ppm=10_000))
    data = [p for p in pkts if p.ip.src == A6I and p.bth.opcode in (0xC0, 0xC1, 0xC2, 0xC3)]
    sacks = [p for p in pkts if p.ip.src == B6I and p.bth.opcode == 0xC6]
    assert len(data) >= 4 * 98 and sacks                           # every PSN (4 x 98 at 1 KiB) at least once
    assert any(p.neth.flags & 0x20 for p in data)                  # retransmissions (NETH.RETX) among them
    for group in (data, sacks):
        by = _labels_by_port(group)
        assert all(len(ls) == 1 for ls in by.values()), {k: sorted(v) for k, v in by.items() if len(v) > 1}
        labels = [next(iter(ls)) for ls in by.values()]
        assert 0 not in labels and all(0 < fl < 1 << 20 for fl in labels)
        assert len(set(labels)) == len(labels)                     # distinct values, distinct labels
    assert len(_labels_by_port(data)) >= 8                         # K = 16 values sprayed: labels vary
    assert a.qp.native_counters()["c_retx"] >= 1


def _entropy_table(side):
    """The K entropy values the QP's data plane holds (native/plane.py NativeSlots.start wrote them at RTS)."""
    pl = side.ctx.plane
    par, rx, s, nx, pt, sp = pl.nat.rows(side.qp.qi)
    return [int(v) for v in sp[:int(par[NL.P_K])]]


def test_native_entropy_values_distinct_in_range_fixed_and_keyed_per_qp(v6):
    """MR-MP-002 on the wire: A's native data frames and B's SACKs use at most K = 16 distinct UDP source ports,
    all in 0xC000-0xFFFF, each side's among its QP's 16 values; a second transfer on the same QP uses the same
    set (fixed at RTS).  The same two QPs, reset and connected again (same QPNs, same GIDs: only the per-QP
    secret drawn at RTS differs), spray over a new set.  MR-MP-016: each new value has its own label."""
    topo, a, b = v6
    runs = []
    for fresh in (True, None, False):                  # new QPs; the same QPs again; the same QPs after RESET
        pkts = _transfer(v6, "native", fresh=fresh)
        data = {p.udp.sport for p in pkts if p.ip.src == A6I and p.bth.opcode in (0xC0, 0xC1, 0xC2, 0xC3)}
        sacks = {p.udp.sport for p in pkts if p.ip.src == B6I and p.bth.opcode == 0xC6}
        ta, tb = _entropy_table(a), _entropy_table(b)
        assert len(ta) == len(set(ta)) == 16 and len(tb) == len(set(tb)) == 16
        assert all(0xC000 <= v <= 0xFFFF for v in ta + tb)
        assert 8 <= len(data) <= 16 and data <= set(ta) and sacks and sacks <= set(tb)
        assert len({p.ip.flow_label for p in pkts if p.ip.src == A6I and p.udp.sport in data}) == len(data)
        runs.append((a.qp.qp_num, b.qp.qp_num, ta, tb, data))
    (qa0, qb0, ta0, tb0, d0), (qa1, qb1, ta1, tb1, d1), (qa2, qb2, ta2, tb2, d2) = runs
    assert (ta1, tb1) == (ta0, tb0) and d1 <= set(ta0)                 # fixed for the QP's life
    assert (qa2, qb2) == (qa1, qb1)                                    # the same QPNs (and GIDs)...
    assert len(set(ta2) & set(ta0)) <= 2 and len(set(tb2) & set(tb0)) <= 2   # ...a new secret, new values
    assert len(d2 - set(ta0)) >= len(d2) - 2


def test_native_evicted_values_are_replaced_by_fresh_ones(v6):
    """MR-MP-011 (mp_replace = 1 on A): under 5 % seeded loss towards B some of A's entropy values are evicted
    (MR-MP-009: two losses within mp_evict_window, 20 ms here so that a slow machine evicts too) and each is
    replaced at once by a fresh value of the QP's keyed function (MR-MP-002): A's data frames then use more
    than K = 16 distinct UDP source ports, all in 0xC000-0xFFFF, the QP's table holds 16 distinct values
    again, and every port, a fresh one too, has its own non-zero flow label (MR-MP-016).  The transfer
    completes intact."""
    topo, a, b = v6
    pkts = _transfer(v6, "native", fault=dict(seed=11, drop_ppm=50_000),
                     params=dict(mp_replace=1, mp_evict_window=20))
    data = [p for p in pkts if p.ip.src == A6I and p.bth.opcode in (0xC0, 0xC1, 0xC2, 0xC3)]
    c = a.qp.native_counters()
    assert c["mp_evicted"] >= 1 and c["mp_replaced"] == c["mp_evicted"], c
    ports = {p.udp.sport for p in data}
    table = _entropy_table(a)
    assert len(table) == len(set(table)) == 16 and all(0xC000 <= v <= 0xFFFF for v in table)
    assert len(ports) > 16 and all(0xC000 <= v <= 0xFFFF for v in ports)
    assert ports - set(table)                                          # evicted values, seen, now gone
    by = _labels_by_port(data)
    assert all(len(ls) == 1 for ls in by.values())
    labels = [next(iter(ls)) for ls in by.values()]
    assert 0 not in labels and len(set(labels)) == len(labels)


def test_compat_over_ipv6_keeps_one_port_and_flow_label_zero(v6):
    """MR-ENC-017: the compat profile is unchanged by the native flow label: one UDP source port for the
    QP and the constant flow label 0 it always carried, in both directions."""
    topo, a, b = v6
    pkts = _transfer(v6, "compat")
    assert {p.bth.opcode for p in pkts} <= set(range(0x00, 0x20))  # RC opcodes only
    assert {p.ip.flow_label for p in pkts} == {0}
    assert len({p.udp.sport for p in pkts if p.ip.src == A6I}) == 1
