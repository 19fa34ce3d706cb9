"""A peer that disappears: its process killed with SIGKILL, or its whole namespace deleted,
in the middle of a transfer.

Host A runs an endpoint in this process with two QPs: one to B, whose endpoint is another
process (the test agent, metaroce_xdp/agent.py, as an application would be), and one to C.
When B vanishes, A's QP to B must fail with IBV_WC_RETRY_EXC_ERR within its documented
time -- retry_cnt + 1 expiries of the local ACK timer, each between T and 2T (MR-RETRY-003,
MR-RETRY-004, MR-RETRY-005), so at most 16 T after the last progress with retry_cnt 7 --
its other WQEs flush (MR-QP-017), and A's QP to C keeps moving intact data throughout.
"""
from __future__ import annotations

import os
import socket
import sys
import time

import numpy as np
import pytest

from metaroce_xdp.agent import AgentClient, gid_of
from metaroce_xdp.stress import FULL
from metaroce_xdp.rc.engine import Context
from metaroce_xdp.topo import switched_hosts
from metaroce_xdp.verbs_types import (SGE, QPAttr, QPState, SendWR, WCStatus, WROpcode, local_ack_timeout_ns)

pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces, XDP and AF_XDP")]

TIMEOUT = 12                 # T = 16.8 ms
RETRY_CNT = 7
MB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Local:
    """An endpoint in this process (A or C)."""

    def __init__(self, topo, ns, ifname):
        self.topo, self.ns = topo, ns
        with topo.enter(ns):
            self.ctx = Context.open(ifname, progress_thread=True)
        self.pd = self.ctx.alloc_pd()
        self.buf = np.zeros(16 * MB, np.uint8)
        self.mr = self.pd.reg_mr(self.buf, FULL)
        self.cq = self.ctx.create_cq(1 << 14)

    def qp(self):
        return self.ctx.create_qp(self.pd, self.cq, self.cq)

    def connect(self, qp, dest_qpn, dgid, psn=0x100, peer_psn=0x200):
        with self.topo.enter(self.ns):
            qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
            qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=dest_qpn, rq_psn=peer_psn, path_mtu=1024,
                             dgid=dgid, max_dest_rd_atomic=4, min_rnr_timer=1))
            qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=psn, timeout=TIMEOUT, retry_cnt=RETRY_CNT, rnr_retry=7,
                             max_rd_atomic=4))

    def sge(self, off, n):
        return SGE(self.mr.addr + off, n, self.mr.lkey)


def _agent_client(topo, ns, host, deadline):
    """Connect to B's agent from A's namespace (its first boot compiles nothing: warm cache)."""
    while True:
        with topo.enter(ns):
            s = socket.socket()
        try:
            s.settimeout(2)
            s.connect((host, 18516))
            s.close()
            break
        except OSError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    with topo.enter(ns):
        return AgentClient(host, 18516, timeout=10)


@pytest.mark.parametrize("how", ["sigkill", "netns-deleted"])
def test_vanished_peer_fails_its_qp_in_time_and_spares_the_others(how):
    """MR-RETRY-003, MR-RETRY-004, MR-RETRY-005, MR-QP-017."""
    topo, _, _ = switched_hosts(extra_hosts=1)
    a = c = cli = None
    try:
        ns_a, ns_b, ns_c = topo[0], topo[2], topo[3]
        agent = topo.popen(ns_b, [sys.executable, "-m", "metaroce_xdp.agent", "--dev", "mr1", "--listen", "10.77.0.2"],
                           cwd=REPO, stdout=open(os.devnull, "w"), stderr=open(os.devnull, "w"))
        a = Local(topo, ns_a, "mr0")
        c = Local(topo, ns_c, "mr2")
        cli = _agent_client(topo, ns_a, "10.77.0.2", time.monotonic() + 60)
        assert cli.call("hello", proto=1)
        # B through its agent: PD, MR, CQ, QP, connected to A
        pd = cli.call("create_pd")["pd"]
        mr = cli.call("reg_mr", pd=pd, len=16 * MB, access=["LOCAL_WRITE", "REMOTE_WRITE", "REMOTE_READ"])
        cq = cli.call("create_cq", cqe=4096)["cq"]
        r = cli.call("create_qp", pd=pd, send_cq=cq, recv_cq=cq, type="RC",
                     cap={"max_send_wr": 64, "max_recv_wr": 64, "max_send_sge": 1, "max_recv_sge": 1,
                          "max_inline_data": 0})
        qp_ab, qp_ac, qp_ca = a.qp(), a.qp(), c.qp()
        cli.call("modify_qp", qp=r["qp"], state="INIT", attrs={"access": ["REMOTE_WRITE", "REMOTE_READ"]})
        cli.call("modify_qp", qp=r["qp"], state="RTR",
                 attrs={"dest_qpn": qp_ab.qp_num, "rq_psn": 0x100, "path_mtu": 1024, "dgid": gid_of("10.77.0.1"),
                        "max_dest_rd_atomic": 4, "min_rnr_timer": 1})
        cli.call("modify_qp", qp=r["qp"], state="RTS", attrs={"sq_psn": 0x200, "timeout": 14, "retry_cnt": 7,
                                                               "rnr_retry": 7, "max_rd_atomic": 4})
        a.connect(qp_ab, r["qpn"], "10.77.0.2")
        a.connect(qp_ac, qp_ca.qp_num, "10.77.0.3")
        c.connect(qp_ca, qp_ac.qp_num, "10.77.0.1", psn=0x200, peer_psn=0x100)
        b_va, b_rkey = int(mr["va"], 16), int(mr["rkey"], 16) if isinstance(mr["rkey"], str) else mr["rkey"]
        a.buf[:] = np.random.default_rng(4).integers(0, 256, a.buf.size, dtype=np.uint8)

        # Traffic on both QPs; B vanishes while both are busy.
        n_b = n_c = 0
        wc_b: list = []
        wc_c: list = []
        t_gone = last_b_success = t_failed = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if t_gone is None and len([w for w in wc_b if w.status == WCStatus.SUCCESS]) >= 20:
                t_gone = time.monotonic()
                if how == "sigkill":
                    os.killpg(agent.pid, 9)
                else:
                    topo.remove(ns_b)
            if n_b - len(wc_b) < 8 and not any(w.status != WCStatus.SUCCESS for w in wc_b):
                qp_ab.post_send(SendWR(wr_id=(1 << 32) | n_b, opcode=WROpcode.RDMA_WRITE,
                                       sg_list=[a.sge((n_b % 8) * MB, MB)], remote_addr=b_va + (n_b % 8) * MB,
                                       rkey=b_rkey))
                n_b += 1
            if n_c - len(wc_c) < 8:
                qp_ac.post_send(SendWR(wr_id=(2 << 32) | n_c, opcode=WROpcode.RDMA_WRITE,
                                       sg_list=[a.sge((8 + n_c % 8) * MB, MB)], remote_addr=c.mr.addr + (n_c % 8) * MB,
                                       rkey=c.mr.rkey))
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
            failed = [w for w in wc_b if w.status != WCStatus.SUCCESS]
            if failed and len(wc_b) == n_b and t_gone is not None and time.monotonic() - t_gone > 1.0:
                break
            time.sleep(0.0005)
        assert t_gone is not None, f"B never completed 20 WRITEs: {wc_b[:3]}"
        failed = [w for w in wc_b if w.status != WCStatus.SUCCESS]
        assert failed, "A's QP to B never failed"
        assert failed[0].status == WCStatus.RETRY_EXC_ERR, failed[0]
        assert all(w.status == WCStatus.WR_FLUSH_ERR for w in failed[1:]), failed[:4]
        assert qp_ab.query()["state"] == "ERR" and "retries exhausted" in qp_ab.query()["error"]
        # in time: retry_cnt + 1 expiries, each at most 2 T after the timer started (MR-RETRY-003),
        # counted from B's disappearance (slack: two busy cores, progress threads, Python)
        limit = (RETRY_CNT + 1) * 2 * local_ack_timeout_ns(TIMEOUT) / 1e9
        assert t_failed - t_gone <= limit + 1.0, (t_failed - t_gone, limit)
        assert t_failed - last_b_success >= (RETRY_CNT + 1) * local_ack_timeout_ns(TIMEOUT) / 1e9 * 0.9
        # C's QP was never disturbed: every WRITE succeeded, in order, and kept going after B vanished
        assert all(w.status == WCStatus.SUCCESS for w in wc_c), [w for w in wc_c if w.status][:3]
        assert [w.wr_id & 0xFFFFFFFF for w in wc_c] == list(range(len(wc_c)))
        assert len(wc_c) >= 40
        assert qp_ac.query()["state"] == "RTS"
        k = (len(wc_c) - 1) % 8
        assert np.array_equal(c.buf[k * MB:(k + 1) * MB], a.buf[(8 + k) * MB:(9 + k) * MB])
    finally:
        if cli is not None:
            cli.close()
        for e in (a, c):
            if e is not None:
                e.ctx.close()
        topo.close()
