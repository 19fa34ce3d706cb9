"""The fault matrix: every operation and size class under loss, reordering, duplication and
corruption placed on a switch and on a router between the hosts, with PSNs that wrap past
2^24, on real endpoints (XDP + AF_XDP, progress threads, the kernel ACK fast path).

Each case runs the checked workload of metaroce_xdp/stress.py: WRITE, READ, SEND with
immediate and ATOMIC FetchAdd at 0 B, 1 B, path MTU - 1, path MTU, path MTU + 1, 64 KiB
and 2 MiB (twice the requester's window of 1024 packets, so a message outlasts its window
and a go-back-N restarts inside it; `make soak` runs the matrix's 8 MiB).  Every WR must complete SUCCESS with intact bytes, in order, within its retry
budget (a hang fails after 30 s without a completion); afterwards the packets each way are
conserved (sent + duplicated - dropped = seen by the other side's XDP program) and no
UMEM frame is unaccounted for.  The long versions (>= 200,000 packets a case, a 10-minute
soak) are `make soak` (tools/soak.py).
"""
from __future__ import annotations

import os

import pytest

from metaroce_xdp.stress import (MATRIX_FAULTS as FAULTS, MATRIX_SIZES, MATRIX_WRAP as WRAP, Fabric, Workload,
                                  connect_near_wrap as _connect)

# make soak's sizes with 2 MiB for 8 MiB: under go-back-N an 8 MiB WR resent from each reordered or lost
# packet made a case 15-30 s, the matrix four minutes of make test
SIZES = MATRIX_SIZES[:-1] + (2 << 20,)

pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces, XDP and AF_XDP")]


@pytest.fixture(scope="module", params=["switch", "router"])
def fabric(request):
    with Fabric(request.param) as fab:
        a, b = fab.endpoints(64 << 20)
        yield fab, a, b


@pytest.mark.parametrize("fault", list(FAULTS))
def test_every_op_and_size_survives(fabric, fault):
    """MR-RETRY-004, MR-RETRY-006, MR-NAK-004, MR-DUP-003, MR-DUP-005, MR-ICRC-014, MR-BTH-020 (PSN wrap),
    MR-RC-020 (completion order), MR-ATOM-001 (exactly once)."""
    fab, a, b = fabric
    _connect(a, b)
    wl = Workload(a, b, sizes=SIZES, depth=16, seed=hash(fault) & 0xFFFF)
    base = fab.mark(a, b)
    with fab.faults(seed=7, **FAULTS[fault]):
        rep = wl.run(wrs=2 * len(wl.plan))
        fab.quiesce(a, b)
    to_a, to_b = fab.fault_stats
    assert rep.wrs == 2 * len(wl.plan) and not rep.failures
    assert all(rep.ops[o] >= 2 for o in ("write", "read", "send", "atomic")), rep.ops
    q = a.qp.query()
    assert q["state"] == "RTS" and q["sq_psn"] < WRAP, q            # the requester's PSNs wrapped
    acted = {k: to_a[k] + to_b[k] for k in ("dropped", "duplicated", "corrupted", "delayed")}
    assert sum(acted.values()) > 0, acted                              # the impairment really acted
    if "loss" in fault or "corrupt" in fault:
        assert q["retransmits"] > 0
    cons = fab.conservation(a, b, base)
    assert cons["a_to_b"]["residual"] == 0 and cons["b_to_a"]["residual"] == 0, cons
    assert a.umem_frames()["leaked"] == 0 and b.umem_frames()["leaked"] == 0


def test_ipv6_through_a_router_at_1_percent_loss():
    """MR-ENC-015, MR-ENC-024 routed over IPv6 with loss; PSNs wrap (MR-BTH-020)."""
    with Fabric("router", ipv6=True) as fab:
        a, b = fab.endpoints(32 << 20)
        _connect(a, b)
        wl = Workload(a, b, sizes=SIZES[:-1] + (1 << 20,), depth=16, seed=5)
        with fab.faults(seed=9, drop_ppm=10_000):
            rep = wl.run(wrs=3 * len(wl.plan))
            fab.quiesce(a, b)
        assert not rep.failures and rep.wrs == 3 * len(wl.plan)
        assert a.qp.query()["retransmits"] > 0
        assert a.umem_frames()["leaked"] == 0 and b.umem_frames()["leaked"] == 0
