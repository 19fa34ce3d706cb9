"""metaroced's owed events (issue 19, finding 10): a QP the data plane moved to ERR whose event was dropped
because the plane's event ring (1024 entries, shared by every client of the interface) was full gets its
QP_FATAL from the serving thread's check every 0.5 s (Daemon._owed_events, events_recovered).

For real: one client with 1010 QPs on 32 small CQs writes a receive of 2^31 bytes (an SGE length no library
writes: an invalid work request) into every QP's ring while the compiled loop sleeps (progress = "sleep", no doorbell), so one scan takes all of them in one
round: 1010 QP_FATALs and 32 CQ_ERRs (each CQ overflows) for 1024 places.  A real daemon in a namespace
(as tests/daemon/test_daemon.py), with limits raised for that many QPs."""
from __future__ import annotations

import resource

import pytest
import test_daemon
from test_daemon import _wait_for

pytestmark = pytest.mark.netns

NQ, NCQ = 1010, 32                      # 1010 + 32 events > the ring's 1024; the plane has 1023 QPs


class Env(test_daemon.Env):
    DAEMON_PREFIX = ("prlimit", "--nofile=8192:8192", "--")          # a descriptor per QP and CQ

    def config_text(self, h: str) -> str:
        return (super().config_text(h).replace("max_qps_per_client = 4", f"max_qps_per_client = {NQ}")
                .replace("max_clients = 8", "max_clients = 2"))


@pytest.fixture(scope="module")
def env():
    with Env.running("A") as e:
        yield e


@pytest.fixture
def nofile():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_qp_error_whose_event_the_full_ring_dropped_gets_its_qp_fatal(env, nofile):
    from metaroce_xdp import shm
    from metaroce_xdp.daemon import client as C
    from metaroce_xdp.verbs_types import EventType, QPAttr, QPCap, QPState
    ctx = C.connect(env.sock("A"), env.pair.a.ifname)
    try:
        pd = ctx.alloc_pd()
        cqs = [ctx.create_cq(1) for _ in range(NCQ)]
        qps = [ctx.create_qp(pd, cqs[i % NCQ], cqs[i % NCQ], QPCap(max_send_wr=1, max_recv_wr=1))
               for i in range(NQ)]
        for qp in qps:
            qp.modify(QPAttr(qp_state=QPState.INIT))
        before = env.status("A")["daemon"]["events_recovered"]
        for qp in qps:                      # the entry first (2^31 bytes), then every tail at once
            qp._rq[0, :4] = (7, 0x1000, 1 << 31, 0x7FFFFF00)
        for qp in qps:
            qp.W[shm.QH_RQ_TAIL] = 1
        _wait_for(lambda: all(qp.state == QPState.ERR for qp in qps), 20, "every QP in ERR")
        told: set[int] = set()
        lost = 0
        while len(told) < NQ and not lost:
            ev = ctx.get_async_event(10)
            assert ev is not None, f"{NQ - len(told)} QPs in ERR without their QP_FATAL"
            if ev.event_type == EventType.QP_FATAL:
                assert "invalid work request" in ev.reason, ev
                told.add(ev.qp.qp_num)
            elif ev.event_type == EventType.EVENTS_LOST:
                lost = 1                    # the client's own queue (1024) overflowed: no promise per QP
        st = env.status("A")["daemon"]
        assert st["events_recovered"] > before, st          # some QP_FATALs came from the 0.5 s check
        assert lost or told == {qp.qp_num for qp in qps}
        ctx.alloc_pd()
    finally:
        ctx.close()
