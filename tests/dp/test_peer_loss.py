"""A peer that disappears: its process killed with SIGKILL, or its whole namespace deleted,
in the middle of a transfer -- on what ships, the compiled plane in process and metaroced.

Host A (the survivor) has two QPs: one to B, one to C.  B's endpoint is another process: an application
running the compiled plane (tests/dp_peer.py) when A runs it in this process, or B's metaroced when A is a
client of its own metaroced (C too is then served by a metaroced).  When B vanishes, A's QP to B must fail
with IBV_WC_RETRY_EXC_ERR within its documented time -- retry_cnt + 1 expiries of the local ACK timer,
each between T and 2T (MR-RETRY-003, MR-RETRY-004, MR-RETRY-005), so at most 16 T after the last progress
with retry_cnt 7 -- its other WQEs flush (MR-QP-017), and A's QP to C keeps moving intact data throughout.

And nothing leaks on the survivor: after the failure, with C's traffic going on,
* packets are conserved both ways between A and C (what one side's plane transmitted is what the other's
  XDP program saw: the failed QP sends nothing more, the healthy one loses nothing);
* every UMEM frame of A's socket is accounted for (free, with the kernel for RX or TX, or queued);
* the survivor's resident memory (this process, or A's metaroced) does not grow with the retries.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from metaroce_xdp.verbs import QUERY_KEYS
from metaroce_xdp.verbs_types import (SGE, Access, QPAttr, QPCap, QPState, SendWR, WCStatus, WROpcode,
                                      local_ack_timeout_ns)

pytestmark = pytest.mark.netns

TIMEOUT = 12                 # T = 16.8 ms
RETRY_CNT = 7
MB = 1 << 20
SIZE = 16 * MB
ACCESS = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
ROOT = Path(__file__).resolve().parents[2]
RSS_SLACK = 16 * MB          # allocator and Python noise; a leak per retry or per WR would pass it
IPS = {"mr0": "10.77.0.1", "mr1": "10.77.0.2", "mr2": "10.77.0.3"}


def _seen(events: dict) -> int:
    """MetaRoCE frames an XDP program handled (steered to the socket, consumed, dropped)."""
    return sum(int(events.get(k, 0)) for k in ("STEERED", "ACK_CONSUMED", "NAK_CONSUMED", "RNR_CONSUMED",
                                               "CNP_CONSUMED", "DROPPED"))


def fabric_drops(topo) -> tuple[int, int]:
    """Frames the veths between A and C dropped themselves (a full ring or backlog: the fabric's own loss,
    which no endpoint counter sees), (A -> C, C -> A): on A's port, the switch's ports swA and swC, C's port."""
    def drops(ns, ifname):
        ipr = topo.ipr(ns)
        st = ipr.get_links(ipr.link_lookup(ifname=ifname)[0])[0].get_attr("IFLA_STATS64")
        return int(st["tx_dropped"]), int(st["rx_dropped"])
    (a_tx, a_rx), (sa_tx, sa_rx) = drops(topo[0], "mr0"), drops(topo[1], "swA")
    (sc_tx, sc_rx), (c_tx, c_rx) = drops(topo[1], "swC"), drops(topo[3], "mr2")
    return a_tx + sa_rx + sc_tx + c_rx, c_tx + sc_rx + sa_tx + a_rx


class Local:
    """An endpoint on the compiled plane in this process, with its progress thread (as users run it)."""

    def __init__(self, topo, ns, ifname):
        from metaroce_xdp.dp import Context
        self.topo, self.ns, self.ip = topo, ns, IPS[ifname]
        with topo.enter(ns):
            self.ctx = Context.open(ifname, progress_thread=True)
        self.pd = self.ctx.alloc_pd()
        self.buf = np.empty(SIZE, np.uint8)
        self.buf.fill(0)                       # every page touched now: RSS compares like with like
        self.mr = self.pd.reg_mr(self.buf, ACCESS)
        self.cq = self.ctx.create_cq(1 << 14)

    def qp(self):
        return self.ctx.create_qp(self.pd, self.cq, self.cq)

    def sent(self) -> int:
        st = self.ctx.stats()
        return st["tx"] - st["tx_ring_full"]

    def seen(self) -> int:
        return _seen(self.ctx.loader.events())

    def frames(self) -> dict:
        with self.ctx.plane.paused():
            return self.ctx.plane.frames()

    def rss(self) -> int:
        return psutil.Process().memory_info().rss

    def close(self):
        self.ctx.close()


class Served:
    """An endpoint through its host's metaroced: this process is the daemon's client (client library only)."""

    def __init__(self, topo, ns, ifname, sock, daemon):
        from metaroce_xdp.daemon import client
        self.topo, self.ns, self.ip, self.sock, self.daemon = topo, ns, IPS[ifname], sock, daemon
        self.ctx = client.connect(sock, ifname)
        self.pd = self.ctx.alloc_pd()
        self.buf = self.ctx.alloc_buf(SIZE)
        self.mr = self.pd.reg_mr(self.buf, ACCESS)
        self.cq = self.ctx.create_cq(1 << 13)

    def qp(self):
        return self.ctx.create_qp(self.pd, self.cq, self.cq, QPCap(max_send_wr=64, max_recv_wr=1))

    def _counters(self) -> dict:
        from metaroce_xdp.daemon import client
        return client.status(self.sock)["devices"][0]["counters"]

    def sent(self) -> int:
        st = self._counters()["plane"]
        return st["tx"] - st["tx_ring_full"]

    def seen(self) -> int:
        return _seen(self._counters()["xdp_events"])

    def frames(self) -> dict:
        return self._counters()["umem"]

    def rss(self) -> int:
        return psutil.Process(self.daemon.pid).memory_info().rss

    def close(self):
        self.ctx.close()


def connect(e, qp, dest_qpn, dgid, psn, peer_psn):
    with e.topo.enter(e.ns):
        qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=ACCESS))
        qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=dest_qpn, rq_psn=peer_psn, path_mtu=1024,
                         dgid=dgid, max_dest_rd_atomic=4, min_rnr_timer=1))
        qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=psn, timeout=TIMEOUT, retry_cnt=RETRY_CNT, rnr_retry=7,
                         max_rd_atomic=4))


def _peer_process(topo, ns):
    """B on the compiled plane in a process of its own (tests/dp_peer.py); returns (Popen, its QP, MR)."""
    import daemon_procs
    p = topo.popen(ns, [sys.executable, str(ROOT / "tests" / "dp_peer.py"), "mr1", str(SIZE)], cwd=str(ROOT),
                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                   preexec_fn=daemon_procs.die_with_parent)
    line = p.stdout.readline()
    assert line, "the peer process did not start"
    return p, json.loads(line)


@pytest.fixture
def hosts(request, make_fabric):
    """(topology, A, B as (QPN, MR address, rkey, connect(A's QPN)), C, the process that is B's endpoint) on the
    IUT of the test's parameter: in process, B is tests/dp_peer.py; through metaroced, B's daemon."""
    import daemon_watch
    iut = request.node.callspec.params["iut"]
    topo = make_fabric(hosts=3, side=None).topo
    ns_a, ns_b, ns_c = topo[0], topo[2], topo[3]
    stack = []
    try:
        if iut == "inproc":
            a, c = Local(topo, ns_a, "mr0"), Local(topo, ns_c, "mr2")
            stack += [a, c]
            proc, b = _peer_process(topo, ns_b)

            def b_connect(qpn):
                proc.stdin.write(json.dumps({"dest_qpn": qpn, "dgid": IPS["mr0"], "rq_psn": 0x100, "sq_psn": 0x200,
                                             "timeout": 14}) + "\n")
                assert json.loads(proc.stdout.readline())["state"] == "RTS"
            yield topo, a, (b["qpn"], b["va"], b["rkey"], b_connect), c, proc
        else:
            from contextlib import ExitStack
            with ExitStack() as ds:
                d = {ifname: ds.enter_context(daemon_watch.serving(topo, ns, ifname, tag=f"mrloss-{ifname}"))
                     for ns, ifname in ((ns_a, "mr0"), (ns_b, "mr1"), (ns_c, "mr2"))}
                a = Served(topo, ns_a, "mr0", d["mr0"][0], d["mr0"][2])
                c = Served(topo, ns_c, "mr2", d["mr2"][0], d["mr2"][2])
                b = Served(topo, ns_b, "mr1", d["mr1"][0], d["mr1"][2])
                stack += [a, c, b]
                qp_b = b.qp()

                def b_connect(qpn):
                    connect(b, qp_b, qpn, IPS["mr0"], psn=0x200, peer_psn=0x100)
                yield topo, a, (qp_b.qp_num, b.mr.addr, b.mr.rkey, b_connect), c, d["mr1"][2]
                for e in stack:
                    e.close()
                stack.clear()
    finally:
        for e in stack:
            try:
                e.close()
            except Exception:                  # noqa: BLE001 -- B's daemon is gone
                pass


@pytest.mark.parametrize("how", ["sigkill", "netns-deleted"])
@pytest.mark.parametrize("iut", ["inproc", "metaroced"])
def test_vanished_peer_fails_its_qp_in_time_and_spares_the_others(hosts, iut, how):
    """MR-RETRY-003, MR-RETRY-004, MR-RETRY-005, MR-QP-017."""
    topo, a, (b_qpn, b_va, b_rkey, b_connect), c, b_proc = hosts
    ns_b = topo[2]
    qp_ab, qp_ac, qp_ca = a.qp(), a.qp(), c.qp()
    b_connect(qp_ab.qp_num)
    connect(a, qp_ab, b_qpn, IPS["mr1"], psn=0x100, peer_psn=0x200)
    connect(a, qp_ac, qp_ca.qp_num, c.ip, psn=0x100, peer_psn=0x200)
    connect(c, qp_ca, qp_ac.qp_num, a.ip, psn=0x200, peer_psn=0x100)
    a.buf[:] = np.random.default_rng(4).integers(0, 256, SIZE, dtype=np.uint8)

    n_b = n_c = 0
    wc_b: list = []
    wc_c: list = []
    t_gone = last_b_success = t_failed = rss_before = None

    def pump(allow_b: bool) -> None:
        nonlocal n_b, n_c, t_failed, last_b_success
        if allow_b and n_b - len(wc_b) < 8 and not any(w.status != WCStatus.SUCCESS for w in wc_b):
            qp_ab.post_send(SendWR(wr_id=(1 << 32) | n_b, opcode=WROpcode.RDMA_WRITE,
                                   sg_list=[SGE(a.mr.addr + (n_b % 8) * MB, MB, a.mr.lkey)],
                                   remote_addr=b_va + (n_b % 8) * MB, rkey=b_rkey))
            n_b += 1
        if n_c - len(wc_c) < 8:
            qp_ac.post_send(SendWR(wr_id=(2 << 32) | n_c, opcode=WROpcode.RDMA_WRITE,
                                   sg_list=[SGE(a.mr.addr + (8 + n_c % 8) * MB, MB, a.mr.lkey)],
                                   remote_addr=c.mr.addr + (n_c % 8) * MB, rkey=c.mr.rkey))
            n_c += 1
        for w in a.cq.poll(64):
            if w.qp_num == qp_ab.qp_num:
                if w.status != WCStatus.SUCCESS and t_failed is None:
                    t_failed = time.monotonic()
                wc_b.append(w)
                if w.status == WCStatus.SUCCESS:
                    last_b_success = time.monotonic()
            else:
                wc_c.append(w)
        time.sleep(0.0005)

    # Traffic on both QPs; B vanishes while both are busy.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if t_gone is None and len([w for w in wc_b if w.status == WCStatus.SUCCESS]) >= 20:
            rss_before = a.rss()
            t_gone = time.monotonic()
            if how == "sigkill":
                os.kill(b_proc.pid, signal.SIGKILL)
            else:
                topo.remove(ns_b)
        pump(True)
        failed = [w for w in wc_b if w.status != WCStatus.SUCCESS]
        if failed and len(wc_b) == n_b and t_gone is not None and time.monotonic() - t_gone > 1.0:
            break
    assert t_gone is not None, f"B never completed 20 WRITEs: {wc_b[:3]}"
    failed = [w for w in wc_b if w.status != WCStatus.SUCCESS]
    assert failed, "A's QP to B never failed"
    assert failed[0].status == WCStatus.RETRY_EXC_ERR, failed[0]
    assert all(w.status == WCStatus.WR_FLUSH_ERR for w in failed[1:]), failed[:4]
    q = qp_ab.query()
    assert q["state"] == QPState.ERR and "retries exhausted" in q["error"], q
    assert QUERY_KEYS <= set(q), QUERY_KEYS - set(q)          # one schema, in process and through metaroced
    # in time: retry_cnt + 1 expiries, each at most 2 T after the timer started (MR-RETRY-003),
    # counted from B's disappearance (slack: two busy cores, progress threads, Python)
    limit = (RETRY_CNT + 1) * 2 * local_ack_timeout_ns(TIMEOUT) / 1e9
    assert t_failed - t_gone <= limit + 1.0, (t_failed - t_gone, limit)
    assert t_failed - last_b_success >= (RETRY_CNT + 1) * local_ack_timeout_ns(TIMEOUT) / 1e9 * 0.9
    # an asynchronous event, if one came, is about the failed QP only
    while (ev := a.ctx.get_async_event(0)) is not None:
        assert ev.qp is not None and ev.qp.qp_num == qp_ab.qp_num, ev

    # The survivor after the failure: C's traffic goes on; packets, frames and memory are conserved.
    def drained_and_quiet() -> tuple:
        end = time.monotonic() + 60
        while len(wc_c) < n_c and time.monotonic() < end:       # every C WRITE posted has completed
            wc_c.extend(w for w in a.cq.poll(64))
            time.sleep(0.001)
        assert len(wc_c) == n_c, (len(wc_c), n_c)
        now = None
        for _ in range(100):                   # nothing sent, seen or dropped for a sample
            time.sleep(0.05)
            last, now = now, (a.sent(), a.seen(), c.sent(), c.seen(), *fabric_drops(topo))
            if last == now:
                return now
        raise AssertionError(f"A and C never went quiet: {now}")

    base = drained_and_quiet()
    more = n_c + 40
    deadline = time.monotonic() + 60
    while len(wc_c) < more and time.monotonic() < deadline:
        pump(False)
    a_tx, a_seen, c_tx, c_seen, lost_ac, lost_ca = (x - y for x, y in zip(drained_and_quiet(), base))
    assert a_tx > 0 and c_tx > 0
    assert a_tx == c_seen + lost_ac and c_tx == a_seen + lost_ca, \
        {"A sent": a_tx, "C saw": c_seen, "veths dropped A->C": lost_ac, "C sent": c_tx, "A saw": a_seen,
         "veths dropped C->A": lost_ca}
    fr = a.frames()
    assert fr["leaked"] == 0, fr
    rss_after = a.rss()
    assert rss_after - rss_before < RSS_SLACK, (rss_before, rss_after)

    # C's QP was never disturbed: every WRITE succeeded, in order, and kept going after B vanished
    assert all(w.status == WCStatus.SUCCESS for w in wc_c), [w for w in wc_c if w.status][:3]
    assert [w.wr_id & 0xFFFFFFFF for w in wc_c] == list(range(len(wc_c)))
    assert len(wc_c) >= 80
    assert qp_ac.query()["state"] == QPState.RTS
    for k in range(8):
        assert np.array_equal(c.buf[k * MB:(k + 1) * MB], a.buf[(8 + k) * MB:(9 + k) * MB]), k
