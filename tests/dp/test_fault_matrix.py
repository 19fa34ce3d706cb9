"""The fault matrix: every operation and size class under loss, reordering, duplication and
corruption placed on a switch and on a router between the hosts, with PSNs that wrap past
2^24, on real endpoints (XDP + AF_XDP, the kernel ACK fast path) on both planes that ship:
the compiled data plane in this process (dp.Context with a progress thread) and metaroced
(a daemon process per host namespace, the workload driving its QPs through the client library).

Each case runs the checked workload of metaroce_xdp/stress.py: WRITE, READ, SEND with
immediate and ATOMIC FetchAdd at 0 B, 1 B, path MTU - 1, path MTU, path MTU + 1, 64 KiB
and 2 MiB (twice the requester's window of 1024 packets, so a message outlasts its window
and a go-back-N restarts inside it; `make soak` runs the matrix's 8 MiB), two passes of that
plan a case.  Every WR must complete SUCCESS with intact bytes, in order, within its retry
budget (a hang fails after 30 s without a completion); afterwards the packets each way are
conserved (sent + duplicated - dropped = seen by the other side's XDP program) and no
UMEM frame is unaccounted for -- the same checks on both planes, from each plane's counters
(dp stats in process, metaroced's `status` for the daemon).

Which cases run where: the compiled plane runs the whole matrix (six faults x switch and
router, and IPv6 through a router at 1 % loss); metaroced runs one case of each fault kind --
loss 1 % and duplication 2 % on the switch, reordering 2 % and corruption 1 % on the router --
so the daemon's startup and cases add about half of the compiled plane's time, not as much
again.  The long versions (>= 200,000 packets a case on both planes, a 10-minute soak) are
`make soak` (tools/soak.py).
"""
from __future__ import annotations


import pytest

from metaroce_xdp.stress import (MATRIX_FAULTS as FAULTS, MATRIX_SIZES, MATRIX_WRAP as WRAP, Fabric, Workload,
                                  connect_near_wrap as _connect)
from metaroce_xdp.verbs_types import QPState

# make soak's sizes with 2 MiB for 8 MiB: under go-back-N an 8 MiB WR resent from each reordered or lost
# packet makes a case many seconds, the matrix minutes of make test
SIZES = MATRIX_SIZES[:-1] + (2 << 20,)
DAEMON_CASES = (("switch", "loss-1%"), ("switch", "dup-2%"), ("router", "reorder-2%"), ("router", "corrupt-1%"))
CASES = ([pytest.param("compiled", path, fault, id=f"compiled-{path}-{fault}")
          for path in ("switch", "router") for fault in FAULTS]
         + [pytest.param("daemon", path, fault, id=f"daemon-{path}-{fault}")
            for path in ("switch", "router") for p, fault in DAEMON_CASES if p == path])

pytestmark = pytest.mark.netns


@pytest.fixture(scope="module")
def fabrics():
    """get(plane, path): the endpoints of that plane on that fabric, kept open while consecutive cases
    use them (CASES is ordered by plane and path), closed when another is asked for."""
    open_ = {}

    def get(plane: str, path: str):
        if (plane, path) not in open_:
            for fab in open_.values():
                fab.close()
            open_.clear()
            fab = Fabric(path, plane=plane)
            try:
                a, b = fab.endpoints(64 << 20)
            except BaseException:
                fab.close()
                raise
            open_[(plane, path)] = fab
            fab.pair = (a, b)
        fab = open_[(plane, path)]
        return (fab, *fab.pair)

    yield get
    for fab in open_.values():
        fab.close()


@pytest.mark.parametrize("plane,path,fault", CASES)
def test_every_op_and_size_survives(fabrics, plane, path, fault):
    """MR-RETRY-004, MR-RETRY-006, MR-NAK-004, MR-DUP-003, MR-DUP-005, MR-ICRC-014, MR-BTH-020 (PSN wrap),
    MR-RC-020 (completion order), MR-ATOM-001 (exactly once)."""
    fab, a, b = fabrics(plane, path)
    _connect(a, b)
    wl = Workload(a, b, sizes=SIZES, depth=16, seed=hash(fault) & 0xFFFF)
    base = fab.mark(a, b)
    with fab.faults(seed=7, **FAULTS[fault]):
        rep = wl.run(wrs=2 * len(wl.plan))
        fab.quiesce(a, b)
    to_a, to_b = fab.fault_stats
    assert rep.wrs == 2 * len(wl.plan) and not rep.failures
    assert all(rep.ops[o] >= 2 for o in ("write", "read", "send", "atomic")), rep.ops
    q = a.qp_counters()
    assert q["state"] == QPState.RTS and q["sq_psn"] < WRAP, q        # the requester's PSNs wrapped
    acted = {k: to_a[k] + to_b[k] for k in ("dropped", "duplicated", "corrupted", "delayed")}
    assert sum(acted.values()) > 0, acted                              # the impairment really acted
    if "loss" in fault or "corrupt" in fault:
        assert q["retransmits"] > 0
    cons = fab.conservation(a, b, base)
    assert cons["a_to_b"]["residual"] == 0 and cons["b_to_a"]["residual"] == 0, cons
    assert a.umem_frames()["leaked"] == 0 and b.umem_frames()["leaked"] == 0, (a.umem_frames(), b.umem_frames())


def test_ipv6_through_a_router_at_1_percent_loss():
    """MR-ENC-015, MR-ENC-024 routed over IPv6 with loss; PSNs wrap (MR-BTH-020).  Compiled plane."""
    with Fabric("router", ipv6=True) as fab:
        a, b = fab.endpoints(32 << 20)
        _connect(a, b)
        wl = Workload(a, b, sizes=SIZES[:-1] + (1 << 20,), depth=16, seed=5)
        with fab.faults(seed=9, drop_ppm=10_000):
            rep = wl.run(wrs=3 * len(wl.plan))
            fab.quiesce(a, b)
        assert not rep.failures and rep.wrs == 3 * len(wl.plan)
        assert a.qp_counters()["retransmits"] > 0
        assert a.umem_frames()["leaked"] == 0 and b.umem_frames()["leaked"] == 0
