"""The test agent of spec 9.4 (MR-CONF-013 to MR-CONF-023), driven only through AgentClient.

Two agents in one process, each on its own compiled plane (dp.Context with its
progress thread, XDP + AF_XDP) in a namespace of a veth pair (topo.two_hosts),
served on 127.0.0.1 on ephemeral ports: the upper
tester connects QPs with modify_qp, runs each operation and checks the
target's memory with mem_read; then the error paths, the framing rules and
session clean-up.
"""
from __future__ import annotations

import json
import socket
import struct
import time

import pytest

from metaroce_xdp.agent import AgentClient, AgentError, AgentServer, gid_of, ip_of_gid
from metaroce_xdp.agent_iut import CompiledIUT
from metaroce_xdp.topo import two_hosts

pytestmark = [pytest.mark.timeout(120), pytest.mark.netns]

FULL = ["LOCAL_WRITE", "REMOTE_WRITE", "REMOTE_READ", "REMOTE_ATOMIC"]
MR_LEN = 65536
WAIT_MS = 5000
# Local ACK timeout 4.096 us * 2^16 = 268 ms: no test here loses a packet, but the first
# packets of a process wait ~200 ms for numba in the progress threads, and with a 1 ms
# timeout the requester would exhaust retry_cnt before the peer's first ACK.
TIMEOUT = 16


class Side:
    """One IUT as the upper tester sees it: a client, hello's answer, and its resource handles."""

    def __init__(self, server: AgentServer, ctx: CompiledIUT) -> None:
        self.server, self.ctx = server, ctx
        with server_ns(server):
            self.c = AgentClient(*server.address, timeout=10)
        self.hello = self.c.call("hello", proto=1)
        self.pd = self.mr = self.cq = self.qp = self.qpn = None

    def setup(self, access=FULL, cqe=256) -> "Side":
        self.pd = self.c.call("create_pd")["pd"]
        self.mr_info = self.c.call("reg_mr", pd=self.pd, len=MR_LEN, access=access)
        self.mr = self.mr_info["mr"]
        self.cq = self.c.call("create_cq", cqe=cqe)["cq"]
        r = self.c.call("create_qp", pd=self.pd, send_cq=self.cq, recv_cq=self.cq, type="RC",
                        cap={"max_send_wr": 64, "max_recv_wr": 64, "max_send_sge": 2, "max_recv_sge": 2,
                             "max_inline_data": 0})
        self.qp, self.qpn = r["qp"], r["qpn"]
        return self

    def connect(self, peer: "Side", psn=0x100, peer_psn=0x200, mtu=1024) -> None:
        c = self.c
        c.call("modify_qp", qp=self.qp, state="INIT", attrs={"access": FULL, "pkey": 0xFFFF})
        c.call("modify_qp", qp=self.qp, state="RTR",
               attrs={"dest_qpn": peer.qpn, "rq_psn": peer_psn, "path_mtu": mtu, "dgid": peer.hello["gid"],
                      "dmac": peer.hello["mac"], "max_dest_rd_atomic": 4, "min_rnr_timer": 1, "profile": "compat"})
        c.call("modify_qp", qp=self.qp, state="RTS",
               attrs={"sq_psn": psn, "timeout": TIMEOUT, "retry_cnt": 7, "rnr_retry": 7, "max_rd_atomic": 4})

    def va(self, off: int) -> str:
        return hex(int(self.mr_info["va"], 16) + off)

    def poll(self, n: int = 1, timeout_ms: int = WAIT_MS) -> list[dict]:
        """n completions, each poll_cq bounded by timeout_ms."""
        out: list[dict] = []
        deadline = time.monotonic() + timeout_ms / 1000
        while len(out) < n and time.monotonic() < deadline:
            out += self.c.call("poll_cq", cq=self.cq, max=n - len(out), timeout_ms=200)["completions"]
        assert len(out) == n, f"{len(out)} of {n} completions"
        return out

    def read(self, off: int, n: int) -> bytes:
        return bytes.fromhex(self.c.call("mem_read", mr=self.mr, offset=off, len=n)["hex"])

    def write(self, off: int, data: bytes) -> None:
        self.c.call("mem_write", mr=self.mr, offset=off, hex=data.hex())


A_IP, B_IP = "10.77.0.1", "10.77.0.2"            # topo.two_hosts


def server_ns(server):
    """The namespace an agent serves in (planes(in_ns=True)), entered; none for one in the test's own."""
    import contextlib
    enter = getattr(server, "enter", None)
    return enter() if enter is not None else contextlib.nullcontext()


@pytest.fixture(scope="module")
def _plane():
    """Two compiled planes (dp.Context with its progress thread, XDP + AF_XDP) in two namespaces joined by a
    veth, each served by an agent on loopback; shared by the module (every session resets what it made)."""
    yield from planes(in_ns=False)


def planes(in_ns: bool):
    """in_ns: each agent serves in its plane's namespace (its TCP connection set-up too, from the RoCE
    addresses); the server's .enter() enters it."""
    import functools
    topo, _ = two_hosts()
    iut_a = iut_b = None
    try:
        with topo.enter(topo[0]):
            iut_a = CompiledIUT.open("mr0")
        with topo.enter(topo[1]):
            iut_b = CompiledIUT.open("mr1")
        srvs = []
        for ns, iut in ((topo[0], iut_a), (topo[1], iut_b)):
            if in_ns:
                with topo.enter(ns):
                    srvs.append(AgentServer(iut, "127.0.0.1", 0).start())
                srvs[-1].enter = functools.partial(topo.enter, ns)
            else:
                srvs.append(AgentServer(iut, "127.0.0.1", 0).start())
        srv_a, srv_b = srvs
        try:
            yield srv_a, iut_a, srv_b, iut_b
        finally:
            srv_a.close()
            srv_b.close()
    finally:
        for i in (iut_a, iut_b):
            if i is not None:
                i.close()
        topo.close()


@pytest.fixture
def iuts(_plane):
    """(server_a, iut_a, server_b, iut_b); no session of an earlier test is left (each reset on close)."""
    srv_a, iut_a, srv_b, iut_b = _plane
    import gc
    gc.collect()                        # an earlier test's Sides close their sessions when collected
    _wait_for(lambda: srv_a.sessions() == 0 and srv_b.sessions() == 0, 20.0)
    yield _plane


@pytest.fixture
def pair(iuts):
    """Two connected sides: A's QP and B's QP in RTS, each with a 64 KiB MR of full access."""
    srv_a, ctx_a, srv_b, ctx_b = iuts
    a, b = Side(srv_a, ctx_a).setup(), Side(srv_b, ctx_b).setup()
    a.connect(b, psn=0x100, peer_psn=0x200)
    b.connect(a, psn=0x200, peer_psn=0x100)
    yield a, b
    a.c.close()
    b.c.close()


def _wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


# ---- hello and caps -------------------------------------------------------------------
def test_hello_reports_the_endpoint(iuts):
    srv_a, ctx_a, srv_b, ctx_b = iuts
    h = Side(srv_b, ctx_b).hello
    assert h["proto"] == 1 and h["impl"] == "metaroce-ref" and "compat" in h["profiles"]
    assert h["ip"] == B_IP and h["mac"] == ctx_b.local_mac and "compiled plane in process" in h["iut"]
    assert h["gid"] == "00000000000000000000ffff0a4d0002"            # MR-CONF-018: 32 hex digits
    assert h["mtus"] == [m for m in (256, 512, 1024, 2048, 4096) if m <= ctx_b.max_pmtu]
    assert set(h["limits"]) == {"max_qp", "max_cq", "max_mr", "max_sge", "max_inline", "max_rd_atomic"}
    assert isinstance(h["caps"], int) and isinstance(h["timer_granularity_us"], int)
    assert ip_of_gid(h["gid"]) == B_IP and gid_of(B_IP) == h["gid"]


def test_caps_lists_counters(iuts):
    srv_a, ctx_a, _, _ = iuts
    caps = Side(srv_a, ctx_a).c.call("caps")
    assert set(caps["defaults"]) == {"sack_window", "entropy_count", "ack_coalesce_us", "ack_coalesce_pkts",
                                     "rto_min_us"}
    assert caps["dcqcn"] is False and "tx" in caps["counters"] and "retransmits" in caps["counters"]


def test_value_encodings(pair):
    """MR-CONF-018: va and wr_id as "0x" lowercase hex; keys, QPNs and lengths as numbers."""
    a, b = pair
    assert a.mr_info["va"].startswith("0x") and a.mr_info["va"] == a.mr_info["va"].lower()
    assert isinstance(a.mr_info["rkey"], int) and isinstance(a.qpn, int) and a.mr_info["len"] == MR_LEN
    a.c.call("post_send", qp=a.qp, wr={"wr_id": "0xfedcba9876543210", "opcode": "RDMA_WRITE",
                                       "sg_list": [{"mr": a.mr, "offset": 0, "len": 1}],
                                       "remote": {"va": b.va(0), "rkey": b.mr_info["rkey"]}})
    (wc,) = a.poll()
    assert wc["wr_id"] == "0xfedcba9876543210" and wc["qp_num"] == a.qpn


# ---- operations between two agents ---------------------------------------------------
def test_rdma_write(pair):
    a, b = pair
    data = bytes(range(256)) * 12
    a.write(100, data)
    a.c.call("post_send", qp=a.qp, wr={"wr_id": "0x7", "opcode": "RDMA_WRITE",
                                       "sg_list": [{"mr": a.mr, "offset": 100, "len": len(data)}],
                                       "remote": {"va": b.va(1000), "rkey": b.mr_info["rkey"]},
                                       "flags": ["SIGNALED"]})
    (wc,) = a.poll()
    assert wc == {"wr_id": "0x7", "status": "IBV_WC_SUCCESS", "opcode": "IBV_WC_RDMA_WRITE",
                  "byte_len": len(data), "qp_num": a.qpn}
    assert b.read(1000, len(data)) == data
    assert b.read(0, 1000) == bytes(1000) and b.read(1000 + len(data), 8) == bytes(8)   # nothing outside


def test_rdma_read(pair):
    a, b = pair
    data = bytes((i * 7) & 0xFF for i in range(5000))
    b.write(300, data)
    a.c.call("post_send", qp=a.qp, wr={"wr_id": "0x8", "opcode": "RDMA_READ",
                                       "sg_list": [{"mr": a.mr, "offset": 0, "len": 5000}],
                                       "remote": {"va": b.va(300), "rkey": b.mr_info["rkey"]}})
    (wc,) = a.poll()
    assert (wc["status"], wc["opcode"], wc["byte_len"]) == ("IBV_WC_SUCCESS", "IBV_WC_RDMA_READ", 5000)
    assert a.read(0, 5000) == data


def test_send_recv_with_imm(pair):
    a, b = pair
    msg = b"metaroce agent " * 100
    a.write(0, msg)
    b.c.call("post_recv", qp=b.qp, wrs=[{"wr_id": "0x99", "sg_list": [{"mr": b.mr, "offset": 4096, "len": 4096}]}])
    a.c.call("post_send", qp=a.qp, wr={"wr_id": "0x1", "opcode": "SEND_WITH_IMM", "imm": 0xDEADBEEF,
                                       "sg_list": [{"mr": a.mr, "offset": 0, "len": len(msg)}],
                                       "flags": ["SIGNALED", "SOLICITED"]})
    (rwc,) = b.poll()
    (swc,) = a.poll()
    assert (swc["status"], swc["opcode"]) == ("IBV_WC_SUCCESS", "IBV_WC_SEND")
    assert rwc == {"wr_id": "0x99", "status": "IBV_WC_SUCCESS", "opcode": "IBV_WC_RECV", "byte_len": len(msg),
                   "qp_num": b.qpn, "imm": 0xDEADBEEF}
    assert b.read(4096, len(msg)) == msg


def test_write_with_imm_and_unsignaled_send(pair):
    a, b = pair
    b.c.call("post_recv", qp=b.qp, wr={"wr_id": "0x5", "sg_list": []})
    a.write(0, b"\x11" * 64)
    a.c.call("post_send", qp=a.qp, wrs=[
        {"wr_id": "0x1", "opcode": "RDMA_WRITE_WITH_IMM", "imm": 0x1234, "flags": [],
         "sg_list": [{"mr": a.mr, "offset": 0, "len": 64}], "remote": {"va": b.va(0), "rkey": b.mr_info["rkey"]}},
        {"wr_id": "0x2", "opcode": "RDMA_WRITE", "sg_list": [{"mr": a.mr, "offset": 0, "len": 8}],
         "remote": {"va": b.va(128), "rkey": b.mr_info["rkey"]}}])
    (rwc,) = b.poll()
    assert (rwc["opcode"], rwc["imm"], rwc["wr_id"]) == ("IBV_WC_RECV_RDMA_WITH_IMM", 0x1234, "0x5")
    (swc,) = a.poll()
    assert swc["wr_id"] == "0x2"                       # the unsignaled WR produced no completion
    assert b.read(0, 64) == b"\x11" * 64


def test_atomics(pair):
    a, b = pair
    b.write(64, struct.pack("<Q", 41))
    a.c.call("post_send", qp=a.qp, wrs=[
        {"wr_id": "0x1", "opcode": "ATOMIC_FETCH_AND_ADD", "swap_add": "0x1",
         "sg_list": [{"mr": a.mr, "offset": 0, "len": 8}], "remote": {"va": b.va(64), "rkey": b.mr_info["rkey"]}},
        {"wr_id": "0x2", "opcode": "ATOMIC_CMP_AND_SWP", "compare": "0x2a", "swap_add": "0xffffffffffffff07",
         "sg_list": [{"mr": a.mr, "offset": 8, "len": 8}], "remote": {"va": b.va(64), "rkey": b.mr_info["rkey"]}}])
    w1, w2 = a.poll(2)
    assert (w1["opcode"], w2["opcode"]) == ("IBV_WC_FETCH_ADD", "IBV_WC_COMP_SWAP")
    assert w1["status"] == w2["status"] == "IBV_WC_SUCCESS"
    assert struct.unpack("<QQ", a.read(0, 16)) == (41, 42)        # originals: before the add, before the swap
    assert struct.unpack("<Q", b.read(64, 8)) == (0xFFFFFFFFFFFFFF07,)


def test_bad_rkey_is_a_remote_access_error(pair):
    a, b = pair
    b.write(0, b"\x5a" * 512)
    a.write(0, b"\xa5" * 512)
    bad = b.mr_info["rkey"] ^ 0x1
    a.c.call("post_send", qp=a.qp, wr={"wr_id": "0x3", "opcode": "RDMA_WRITE",
                                       "sg_list": [{"mr": a.mr, "offset": 0, "len": 512}],
                                       "remote": {"va": b.va(0), "rkey": bad}})
    (wc,) = a.poll()
    assert (wc["wr_id"], wc["status"]) == ("0x3", "IBV_WC_REM_ACCESS_ERR")
    assert b.read(0, 512) == b"\x5a" * 512                         # target untouched
    assert a.c.call("query_qp", qp=a.qp)["state"] == "ERR"
    assert a.c.call("get_counters", qp=a.qp)["counters"]["naks_received"] >= 1
    # a QP in ERR accepts a send and flushes it (MR-QP-018, MR-QP-028)
    a.c.call("post_send", qp=a.qp, wr={"wr_id": "0x4", "opcode": "SEND"})
    (wc,) = a.poll()
    assert (wc["wr_id"], wc["status"]) == ("0x4", "IBV_WC_WR_FLUSH_ERR")


# ---- modify_qp, query_qp ---------------------------------------------------------------
def test_query_qp_reports_the_connection(pair):
    a, b = pair
    q = a.c.call("query_qp", qp=a.qp)
    assert q["state"] == "RTS" and q["profile"] == "compat"
    at = q["attrs"]
    assert (at["dest_qpn"], at["dgid"], at["dmac"], at["path_mtu"]) == (b.qpn, b.hello["gid"], b.hello["mac"], 1024)
    assert at["sq_psn"] == 0x100 and at["rq_psn"] == 0x200 and at["access"] == FULL


def test_state_errors_change_nothing(iuts):
    srv_a, ctx_a, srv_b, ctx_b = iuts
    a, b = Side(srv_a, ctx_a).setup(), Side(srv_b, ctx_b).setup()
    with pytest.raises(AgentError) as e:
        a.c.call("modify_qp", qp=a.qp, state="RTS", attrs={"sq_psn": 256})
    assert e.value.code == "ESTATE"
    assert a.c.call("query_qp", qp=a.qp)["state"] == "RESET"
    a.c.call("modify_qp", qp=a.qp, state="INIT", attrs={"access": FULL})
    rtr = {"dest_qpn": b.qpn, "rq_psn": 1, "path_mtu": 1024, "dgid": b.hello["gid"], "dmac": b.hello["mac"]}
    for bad, code in (({"path_mtu": 1000}, "EINVAL"), ({"dgid": "10.55.0.2"}, "EINVAL"),
                      ({"dest_qpn": 1 << 24}, "EINVAL"), ({"dmac": "02:00:00:00:00"}, "EINVAL"),
                      ({"dgid": gid_of("10.77.0.9"), "dmac": None}, "EINVAL"),     # no neighbour answers
                      ({"profile": "native"}, "ENOTSUP")):
        attrs = {k: v for k, v in {**rtr, **bad}.items() if v is not None}
        with pytest.raises(AgentError) as e:
            a.c.call("modify_qp", qp=a.qp, state="RTR", attrs=attrs)
        assert e.value.code == code, bad
        q = a.c.call("query_qp", qp=a.qp)
        assert q["state"] == "INIT" and q["attrs"]["dest_qpn"] == 0 and q["attrs"]["dmac"] is None, bad
    with pytest.raises(AgentError) as e:
        a.c.call("post_send", qp=a.qp, wr={"wr_id": "0x1", "opcode": "SEND"})
    assert e.value.code == "ESTATE"
    a.c.call("modify_qp", qp=a.qp, state="RTR", attrs=rtr)
    assert a.c.call("query_qp", qp=a.qp)["state"] == "RTR"


def test_attributes_of_another_transition_are_refused(iuts):
    srv_a, ctx_a, srv_b, ctx_b = iuts
    a, b = Side(srv_a, ctx_a).setup(), Side(srv_b, ctx_b).setup()
    a.c.call("modify_qp", qp=a.qp, state="INIT", attrs={"access": FULL})
    rtr = {"dest_qpn": b.qpn, "rq_psn": 1, "path_mtu": 1024, "dgid": b.hello["gid"], "dmac": b.hello["mac"]}
    for bad in ({"sq_psn": 5}, {"timeout": 3}):
        with pytest.raises(AgentError) as e:
            a.c.call("modify_qp", qp=a.qp, state="RTR", attrs={**rtr, **bad})
        assert e.value.code == "EINVAL", bad
        assert a.c.call("query_qp", qp=a.qp)["state"] == "INIT", bad


def test_failed_post_list_posts_nothing(pair):
    """MR-CONF-016: the second WR is bad, so neither is posted (unlike ibv_post_send's bad_wr)."""
    a, b = pair
    good = {"wr_id": "0x1", "opcode": "RDMA_WRITE", "sg_list": [{"mr": a.mr, "offset": 0, "len": 8}],
            "remote": {"va": b.va(0), "rkey": b.mr_info["rkey"]}}
    bad_sge = {**good, "wr_id": "0x2", "sg_list": [{"mr": a.mr, "offset": MR_LEN - 4, "len": 8}]}
    bad_atomic = {**good, "wr_id": "0x3", "opcode": "ATOMIC_FETCH_AND_ADD", "swap_add": "0x1",
                  "sg_list": [{"mr": a.mr, "offset": 0, "len": 4}]}
    for wrs, code in (([good, bad_sge], "EINVAL"), ([good, bad_atomic], "EINVAL"), ([good] * 65, "EAGAIN"),
                      ([good, {**good, "opcode": "BIND_MW"}], "EINVAL"), ([good, {**good, "remote": None}], "EPROTO")):
        with pytest.raises(AgentError) as e:
            a.c.call("post_send", qp=a.qp, wrs=wrs)
        assert e.value.code == code
        assert a.c.call("get_counters", qp=a.qp)["counters"]["sq_depth"] == 0
    with pytest.raises(AgentError) as e:
        b.c.call("post_recv", qp=b.qp, wrs=[{"wr_id": "0x1", "sg_list": []}] * 65)
    assert e.value.code == "EAGAIN"
    assert b.c.call("get_counters", qp=b.qp)["counters"]["rq_depth"] == 0
    assert a.c.call("poll_cq", cq=a.cq)["completions"] == []
    a.c.call("post_send", qp=a.qp, wrs=[good])
    assert a.poll()[0]["status"] == "IBV_WC_SUCCESS"


# ---- errors and framing (9.4.1, 9.4.3) ------------------------------------------------
def test_command_before_hello_is_eproto(iuts):
    srv_a, *_ = iuts
    with AgentClient(*srv_a.address) as c:
        with pytest.raises(AgentError) as e:
            c.call("create_pd")
        assert e.value.code == "EPROTO"
        with pytest.raises(AgentError) as e:
            c.call("hello", proto=2)
        assert e.value.code == "EPROTO"
        c.call("hello", proto=1)
        assert c.call("create_pd") == {"pd": 1}


def test_error_codes(pair):
    a, b = pair
    cases = [
        (("frobnicate", {}), "ENOCMD"),
        (("create_qp", {"pd": 99, "send_cq": a.cq, "recv_cq": a.cq}), "ENOENT"),
        (("poll_cq", {"cq": 42}), "ENOENT"),
        (("mem_read", {"mr": a.mr, "offset": 0, "len": 65537}), "EINVAL"),
        (("mem_read", {"mr": a.mr, "offset": MR_LEN - 1, "len": 2}), "EINVAL"),
        (("mem_read", {"mr": a.mr, "offset": 0}), "EPROTO"),                       # missing member
        (("mem_write", {"mr": a.mr, "offset": 0, "hex": "abc"}), "EINVAL"),
        (("reg_mr", {"pd": a.pd, "len": 16, "access": ["REMOTE_WRITE"]}), "EINVAL"),   # needs LOCAL_WRITE
        (("reg_mr", {"pd": a.pd, "len": 16, "access": ["EXECUTE"]}), "EINVAL"),
        (("create_cq", {"cqe": 0}), "EINVAL"),
        (("create_qp", {"pd": a.pd, "send_cq": a.cq, "recv_cq": a.cq, "type": "UD"}), "ENOTSUP"),
        (("destroy_cq", {"cq": a.cq}), "EBUSY"),                                   # used by a QP
        (("dealloc_pd", {"pd": a.pd}), "EBUSY"),                                   # has an MR and a QP
        (("set_param", {"name": "budget", "value": 0}), "EINVAL"),
        (("set_param", {"name": "warp_speed", "value": 9}), "ENOTSUP"),
        (("cm_connect", {"qp": a.qp, "host": "127.0.0.1", "port": 18515}), "ESTATE"),    # QP in RTS, not INIT
        (("cm_connect", {"qp": a.qp, "host": "127.0.0.1", "format": "pingpong"}), "ESTATE"),
        (("cm_listen", {"qp": a.qp, "port": 18515}), "ESTATE"),                       # QP in RTS, not INIT
        (("cm_wait", {"qp": a.qp}), "ESTATE"),                                        # not listening
        (("post_send", {"qp": a.qp, "wr": {"wr_id": 7, "opcode": "SEND"}}), None),   # plain integer wr_id is fine
        (("post_send", {"qp": a.qp, "wr": {"wr_id": "7", "opcode": "SEND"}}), "EINVAL"),
    ]
    b.c.call("post_recv", qp=b.qp, wr={"wr_id": "0x0", "sg_list": []})
    for (cmd, args), code in cases:
        if code is None:
            a.c.call(cmd, **args)
            continue
        with pytest.raises(AgentError) as e:
            a.c.call(cmd, **args)
        assert e.value.code == code, (cmd, args, e.value)
    assert a.poll()[0]["status"] == "IBV_WC_SUCCESS"
    a.c.call("get_counters")                                                    # the session goes on


def test_malformed_lines(iuts):
    srv_a, *_ = iuts
    with AgentClient(*srv_a.address) as c:
        c.call("hello", proto=1)
        for raw in (b"{not json\n", b"[1,2]\n", b'{"id":1,"cmd":"caps"}\n', b'{"id":"x","cmd":"caps","args":{}}\n',
                    b'{"id":2,"cmd":7,"args":{}}\n', b"\xff\xfe\n"):
            r = c.send_raw(raw)
            assert r["ok"] is False and r["error"]["code"] == "EPROTO", raw
        assert c.send_raw(b'{"id":1,"cmd":"caps"}\n')["id"] == 1               # the id is echoed when it can be
        r = c.send_raw(b'{"id":5,"cmd":"create_pd","args":{"unknown":1}}\n')   # MR-CONF-017: ignore unknown args
        assert r == {"id": 5, "ok": True, "result": {"pd": 1}}


def test_responses_in_order_with_the_same_id(iuts):
    srv_a, *_ = iuts
    with AgentClient(*srv_a.address) as c:
        lines = [json.dumps({"id": 100 + i, "cmd": "hello" if i == 0 else "create_pd", "args": {"proto": 1}})
                 for i in range(20)]
        c.sock.sendall(("\n".join(lines) + "\n").encode())      # pipelined
        got = [json.loads(c.rfile.readline()) for _ in range(20)]
        assert [r["id"] for r in got] == list(range(100, 120))
        assert [r["result"]["pd"] for r in got[1:]] == list(range(1, 20))


def test_overlong_line_closes_the_session(iuts):
    srv_a, *_ = iuts
    with AgentClient(*srv_a.address) as c:
        c.call("hello", proto=1)
        c.sock.sendall(b'{"id":1,"cmd":"caps","args":{"pad":"' + b"a" * (1 << 20) + b'"}}\n')
        r = json.loads(c.rfile.readline())
        assert r["ok"] is False and r["error"]["code"] == "EPROTO"
        assert c.rfile.readline() == b""                         # closed
    with AgentClient(*srv_a.address) as c:                        # the agent serves on
        assert c.call("hello", proto=1)["proto"] == 1


def test_poll_cq_honours_timeout(pair):
    a, _ = pair
    t0 = time.monotonic()
    assert a.c.call("poll_cq", cq=a.cq, timeout_ms=150)["completions"] == []
    dt = time.monotonic() - t0
    assert 0.14 <= dt < 2.0
    t0 = time.monotonic()
    assert a.c.call("poll_cq", cq=a.cq)["completions"] == []      # default timeout 0
    assert time.monotonic() - t0 < 1.0


# ---- sessions, reset, counters, knobs -----------------------------------------------
def test_reset_destroys_everything(pair):
    a, b = pair
    assert len(a.ctx.ctx.qps) == 1
    a.c.call("reset")
    assert len(a.ctx.ctx.qps) == 0 and not a.ctx.ctx.mrs
    for cmd, args in (("query_qp", {"qp": a.qp}), ("mem_read", {"mr": a.mr, "offset": 0, "len": 1}),
                      ("poll_cq", {"cq": a.cq}), ("dealloc_pd", {"pd": a.pd})):
        with pytest.raises(AgentError) as e:
            a.c.call(cmd, **args)
        assert e.value.code == "ENOENT"
    Side.setup(a)                                                # ready for a new test case
    assert (a.pd, a.mr, a.cq, a.qp) == (1, 1, 1, 1)


def test_explicit_teardown(pair):
    a, _ = pair
    a.c.call("destroy_qp", qp=a.qp)
    a.c.call("destroy_cq", cq=a.cq)
    a.c.call("dereg_mr", mr=a.mr)
    a.c.call("dealloc_pd", pd=a.pd)
    assert len(a.ctx.ctx.qps) == 0 and not a.ctx.ctx.mrs


def test_disconnect_mid_session_cleans_up(iuts):
    srv_a, ctx_a, srv_b, ctx_b = iuts
    keep = Side(srv_a, ctx_a).setup()                            # another session, left alone
    s = socket.create_connection(srv_a.address, timeout=5)
    s.sendall(b'{"id":1,"cmd":"hello","args":{"proto":1}}\n{"id":2,"cmd":"create_pd","args":{}}\n'
              b'{"id":3,"cmd":"create_cq","args":{"cqe":8}}\n'
              b'{"id":4,"cmd":"create_qp","args":{"pd":1,"send_cq":1,"recv_cq":1}}\n'
              b'{"id":5,"cmd":"reg_mr","args":{"pd":1,"len":4096,"access":["LOCAL_WRITE"]}}\n'
              b'{"id":6,"cmd":"caps","args":{}}\n{"id":7,"cmd":"mem_')          # cut mid-line
    f = s.makefile("rb")
    assert [json.loads(f.readline())["id"] for _ in range(6)] == [1, 2, 3, 4, 5, 6]
    assert len(ctx_a.ctx.qps) == 2
    s.close()
    f.close()
    _wait_for(lambda: srv_a.sessions() == 1 and len(ctx_a.ctx.qps) == 1)
    assert len(ctx_a.ctx.mrs) == 1                                       # keep's MR only
    assert keep.c.call("query_qp", qp=keep.qp)["state"] == "RESET"
    with AgentClient(*srv_a.address) as c:                       # a new session is served
        c.call("hello", proto=1)
        assert c.call("create_pd") == {"pd": 1}


def test_bye_closes_after_the_reply(iuts):
    srv_a, ctx_a, *_ = iuts
    side = Side(srv_a, ctx_a).setup()
    assert side.c.call("bye") == {}
    assert side.c.rfile.readline() == b""
    _wait_for(lambda: len(ctx_a.ctx.qps) == 0 and srv_a.sessions() == 0)


def test_counters_and_set_param(pair):
    a, b = pair
    before = a.c.call("get_counters")["counters"]
    a.c.call("post_send", qp=a.qp, wr={"wr_id": "0x1", "opcode": "RDMA_WRITE",
                                       "sg_list": [{"mr": a.mr, "offset": 0, "len": 3000}],
                                       "remote": {"va": b.va(0), "rkey": b.mr_info["rkey"]}})
    a.poll()
    after = a.c.call("get_counters")["counters"]
    assert after["tx"] - before["tx"] >= 3        # 3 packets at MTU 1024 (the XDP program consumes the ACKs)
    q = a.c.call("get_counters", qp=a.qp)["counters"]
    assert q["retransmits"] == 0 and q["sq_depth"] == 0 and q["naks_received"] == 0   # the plane's own counts
    assert set(q) == set(a.c.call("caps")["qp_counters"])
    default = a.ctx.params['budget'][0]()
    a.c.call("set_param", name="budget", value=8)
    assert a.ctx.params['budget'][0]() == 8
    a.c.call("reset")                                             # the session's knobs go back with it
    assert a.ctx.params['budget'][0]() == default
