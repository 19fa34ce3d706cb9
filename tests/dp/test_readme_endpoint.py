"""docs/endpoint.md's "Using the endpoint", run as written: the ```python block itself, taken from the page,
executed in two namespaces joined by a veth -- each side runs it with its own interface, the other's
address as dgid and the other's QPN, PSN, buffer address and rkey as peer_* -- so the example an
application copies is the one tested, unchanged.  `from metaroce_xdp import Context` must give the
compiled data plane (metaroce_xdp.dp.Context), what applications get.  Then the completion events the page describes after the block (req_notify(solicited_only=True) + get_event,
a completion channel serving a CQ) on the same contexts."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from metaroce_xdp.topo import two_hosts

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
IMPORT = "from metaroce_xdp import Context"


def readme_block() -> str:
    text = (ROOT / "docs" / "endpoint.md").read_text()
    section = text.split("## Using the endpoint", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def _once(code: str, old: str, new: str) -> str:
    assert code.count(old) == 1, f"the example of docs/endpoint.md no longer has exactly one {old!r}"
    return code.replace(old, new)


def readme_parts(threaded: bool) -> tuple[str, str, str]:
    """The block in three parts -- set-up (to create_qp), connection (the modify calls), traffic (from
    post_send) -- with the interface, the peer address and, for the threaded variant, progress_thread
    substituted (each where the page has it exactly once)."""
    code = readme_block()
    assert IMPORT in code
    code = _once(code, '"eth1"', "IFNAME")
    code = _once(code, '"10.0.0.2"', "PEER_IP")
    if threaded:
        code = _once(code, "Context.open(IFNAME)", "Context.open(IFNAME, progress_thread=True)")
    lines = code.splitlines(keepends=True)
    i = next(k for k, ln in enumerate(lines) if ln.startswith("qp.modify("))
    j = next(k for k, ln in enumerate(lines) if ln.startswith("qp.post_send("))
    return "".join(lines[:i]), "".join(lines[i:j]), "".join(lines[j:])


class Host:
    def __init__(self, topo, ns: str, ifname: str, ip: str) -> None:
        self.topo, self.ns = topo, ns
        self.g: dict = {"IFNAME": ifname, "__name__": "readme"}
        self.ip = ip

    def run(self, code: str) -> None:
        with self.topo.enter(self.ns):
            exec(compile(code, "docs/endpoint.md", "exec"), self.g)

    def __getattr__(self, name):
        try:
            return self.__dict__["g"][name]
        except KeyError:
            raise AttributeError(name) from None

    def close(self) -> None:
        if "ctx" in self.g:
            self.g["ctx"].close()


def _poll_until(hosts_wanted: list[tuple[Host, int]], timeout: float = 30.0) -> dict:
    """Each host's cq.poll() (which drives its plane when there is no progress thread) until each
    has its count of completions."""
    got: dict = {id(h): [] for h, _ in hosts_wanted}
    deadline = time.monotonic() + timeout
    while any(len(got[id(h)]) < n for h, n in hosts_wanted):
        for h, _ in hosts_wanted:
            got[id(h)] += h.cq.poll()
        if time.monotonic() > deadline:
            raise AssertionError(f"completions after {timeout}s: {[len(v) for v in got.values()]}")
    return got


class _Pump:
    """Without a progress thread a side only moves when it is polled: while the test waits on the other
    side's completion event, a thread polls this side (it alone touches this side meanwhile)."""

    def __init__(self, host: Host, threaded: bool) -> None:
        self.host, self.wcs, self.stop = host, [], threading.Event()
        self.t = None if threaded else threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.wcs += self.host.cq.poll()

    def __enter__(self):
        if self.t is not None:
            self.t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.t is not None:
            self.t.join(10)


@pytest.mark.parametrize("threaded", [False, True], ids=["busy-polling", "progress-thread"])
def test_readme_example_between_two_namespaces(threaded):
    from metaroce_xdp.verbs_types import (SGE, Access, QPAttr, QPState, RecvWR, SendFlags, SendWR, WCOpcode,
                                          WCStatus, WROpcode)
    setup, connect, traffic = readme_parts(threaded)
    topo, _ = two_hosts()
    a = Host(topo, topo[0], "mr0", "10.77.0.1")
    b = Host(topo, topo[1], "mr1", "10.77.0.2")
    try:
        for h in (a, b):
            h.run(setup)
        import metaroce_xdp
        from metaroce_xdp.dp import Context as DpContext
        assert metaroce_xdp.Context is DpContext
        assert type(a.ctx) is DpContext
        pattern = {}
        for h, peer, seed, psn in ((a, b, 1, 0x1234), (b, a, 2, 0xFFFFF0)):
            pattern[id(h)] = np.random.default_rng(seed).integers(0, 256, h.buf.size, dtype=np.uint8)
            h.buf[:] = pattern[id(h)]
            h.g["my_psn"] = psn
        for h, peer in ((a, b), (b, a)):
            h.g.update(PEER_IP=peer.ip, peer_qpn=peer.qp.qp_num, peer_psn=peer.my_psn, peer_va=peer.mr.addr,
                       peer_rkey=peer.mr.rkey)
        for h in (a, b):
            h.run(connect)
            assert h.qp.state == QPState.RTS
        # the traffic: post_send of a 4096-byte WRITE of buf[:4096] to the peer's buffer, then one
        # cq.poll(); one side after the other (the WRITE reads buf[:4096], where the other side's lands)
        for h, peer in ((a, b), (b, a)):
            h.buf[:4096] = pattern[id(h)][:4096]
            h.run(traffic)
            got = _poll_until([(h, 1 - len(h.wc)), (peer, 0)])
            wcs = list(h.wc) + got[id(h)]
            assert [(w.wr_id, w.status, w.opcode, w.byte_len) for w in wcs] == [
                (1, WCStatus.SUCCESS, WCOpcode.RDMA_WRITE, 4096)]
            assert (peer.buf[:4096] == pattern[id(h)][:4096]).all()
        for h in (a, b):                       # nothing else changed
            assert (h.buf[4096:] == pattern[id(h)][4096:]).all()

        # completion events as the page describes them: a CQ armed for solicited completions
        b.cq.req_notify(solicited_only=True)
        b.qp.post_recv(RecvWR(wr_id=7, sg_list=[SGE(b.mr.addr + 8192, 64, b.mr.lkey)]))
        a.qp.post_send(SendWR(wr_id=8, opcode=WROpcode.SEND, sg_list=[SGE(a.mr.addr + 8192, 64, a.mr.lkey)],
                              send_flags=SendFlags.SIGNALED | SendFlags.SOLICITED))
        with _Pump(a, threaded) as pump:
            assert b.cq.get_event(10) is True
        rx = _poll_until([(b, 1)])[id(b)]
        assert [(w.wr_id, w.status, w.opcode, w.byte_len) for w in rx] == [(7, WCStatus.SUCCESS, WCOpcode.RECV, 64)]
        assert (b.buf[8192:8256] == a.buf[8192:8256]).all()
        tx = pump.wcs + (_poll_until([(a, 1)])[id(a)] if not pump.wcs else [])
        assert [(w.wr_id, w.status) for w in tx] == [(8, WCStatus.SUCCESS)]

        # ... and a completion channel serving a CQ: a second QP pair, B's on a CQ of the channel
        ch = b.ctx.create_comp_channel()
        cq2 = b.ctx.create_cq(16, channel=ch)
        qps = {}
        for h, cq in ((a, a.cq), (b, cq2)):
            with topo.enter(h.ns):
                qps[id(h)] = h.ctx.create_qp(h.pd, cq, cq)
        for h, peer in ((a, b), (b, a)):
            with topo.enter(h.ns):
                q = qps[id(h)]
                q.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=Access.REMOTE_WRITE | Access.REMOTE_READ))
                q.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=qps[id(peer)].qp_num, rq_psn=0x77, path_mtu=1024,
                                dgid=peer.ip))
                q.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0x77, timeout=14, retry_cnt=7, rnr_retry=7))
        cq2.req_notify()
        qps[id(b)].post_recv(RecvWR(wr_id=9, sg_list=[SGE(b.mr.addr + 16384, 100, b.mr.lkey)]))
        qps[id(a)].post_send(SendWR(wr_id=10, opcode=WROpcode.SEND_WITH_IMM, imm_data=0xABCD,
                                    sg_list=[SGE(a.mr.addr + 16384, 100, a.mr.lkey)]))
        with _Pump(a, threaded) as pump:
            assert ch.get_cq_event(10) is cq2
        rx = []
        deadline = time.monotonic() + 10
        while not rx and time.monotonic() < deadline:
            rx = cq2.poll()
        assert [(w.wr_id, w.status, w.opcode, w.byte_len, w.imm_data) for w in rx] == [
            (9, WCStatus.SUCCESS, WCOpcode.RECV, 100, 0xABCD)]                  # SEND with immediate: IBV_WC_RECV
        tx = pump.wcs + (_poll_until([(a, 1)])[id(a)] if not pump.wcs else [])
        assert [(w.wr_id, w.status) for w in tx] == [(10, WCStatus.SUCCESS)]
        assert (b.buf[16384:16484] == a.buf[16384:16484]).all()
    finally:
        for h in (a, b):
            h.close()
        topo.close()
