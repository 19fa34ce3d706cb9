"""metaroced end to end: real daemon processes (metaroce_xdp.daemon.server) on the two ends of a veth
pair in two namespaces, real client processes (tests/daemon_players.py, the client library only)
connecting through them by address and port (spec 06), with the real XDP program and AF_XDP sockets.

Covers: verified WRITE / SEND / READ between applications on two hosts; a client SIGKILLed in the
middle of a transfer (its QPs gone from the daemon, its peer's QP failing with RETRY_EXC_ERR, another
client's transfer on the same daemon completing); another client's rkey used through a connected QP
(remote access error, memory untouched); bad requests and bad ring entries (typed errors, the daemon
unharmed); a client that never polls its CQ (overflow on its QP only); restart after SIGKILL of the
daemon (stale socket and pins cleaned); SIGTERM's drain (outstanding receives flushed with
WR_FLUSH_ERR into the client's CQ, XDP detached, socket removed)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from daemon_players import Daemons, PlayerProc
from metaroce_xdp.verbs_types import EventType, InvalidState
from metaroce_xdp.cli.qpstat import read_qps

pytestmark = pytest.mark.netns

ROOT = Path(__file__).resolve().parents[2]


class Env(Daemons):
    """metaroced on the two ends of a veth (`pair`), with the limits these tests run into; any uid reaches its
    socket (SO_PEERCRED is what refuses)."""

    def __init__(self) -> None:
        super().__init__("flat")
        self.pair = self.fabric.pair

    def config_text(self, h: str) -> str:
        return super().config_text(h) + (
            f'max_clients = 8\nmax_qps_per_client = 4\nmax_mr_bytes_per_client = {32 << 20}\ndrain_timeout_s = 1.0\n'
            'socket_mode = "0666"\n')

    def connected(self, size: int = 1 << 20, seeds=(1, 2)) -> tuple[PlayerProc, PlayerProc, dict, dict]:
        """A client on A connected (spec 06) to a client on B, each with a buffer of random bytes."""
        a, b, sa, sb, ra, rb = self.connect(size, seeds)
        assert ra["state"] == "RTS" and rb["state"] == "RTS"
        assert ra["peer"]["qpn"] == sb["qpn"] and rb["peer"]["qpn"] == sa["qpn"]
        return a, b, sa, sb


@pytest.fixture(scope="module")
def env():
    with Env.running("A", "B") as e:
        yield e


def _wait_for(pred, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout}s: {what}")


def _both_to_rtr(env, qa, qb, access, **rtr) -> None:
    """Client QPs qa (on A) and qb (on B) to INIT with `access`, then to RTR facing each other (PSN 0, MTU 1024)."""
    from metaroce_xdp.verbs_types import QPAttr, QPState
    for qp, peer, ip in ((qa, qb, env.pair.b.ipv4), (qb, qa, env.pair.a.ipv4)):
        qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=access))
        qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=peer.qp_num, rq_psn=0, path_mtu=1024, dgid=ip, **rtr))


# ================================================================================ tests
def test_write_send_read_between_applications_on_two_hosts(env):
    a, b, sa, sb = env.connected()
    # WRITE 100 kB (98 packets) into B's buffer at 8192
    a.ok(cmd="post", ops=[{"op": "write", "off": 0, "len": 100_000, "roff": 8192, "wr_id": 11}])
    w = a.ok(cmd="wait", n=1)["wcs"][0]
    assert (w["wr_id"], w["status"], w["opcode"], w["byte_len"]) == (11, "SUCCESS", "RDMA_WRITE", 100_000)
    assert a.ok(cmd="digest", off=0, len=100_000)["sha"] == b.ok(cmd="digest", off=8192, len=100_000)["sha"]
    # SEND WITH IMM into a posted receive
    b.ok(cmd="post", ops=[{"op": "recv", "off": 300_000, "len": 70_000, "wr_id": 21}])
    a.ok(cmd="post", ops=[{"op": "send_imm", "off": 200_000, "len": 5000, "imm": 0x1234, "wr_id": 22}])
    assert a.ok(cmd="wait", n=1)["wcs"][0]["status"] == "SUCCESS"
    r = b.ok(cmd="wait", n=1)["wcs"][0]
    assert (r["wr_id"], r["status"], r["opcode"], r["byte_len"], r["imm"]) == (21, "SUCCESS", "RECV", 5000, 0x1234)
    assert a.ok(cmd="digest", off=200_000, len=5000)["sha"] == b.ok(cmd="digest", off=300_000, len=5000)["sha"]
    # READ 64 KiB of B's buffer
    a.ok(cmd="post", ops=[{"op": "read", "off": 700_000, "len": 65_536, "roff": 500_000, "wr_id": 31}])
    w = a.ok(cmd="wait", n=1)["wcs"][0]
    assert (w["status"], w["opcode"], w["byte_len"]) == ("SUCCESS", "RDMA_READ", 65_536)
    assert a.ok(cmd="digest", off=700_000, len=65_536)["sha"] == b.ok(cmd="digest", off=500_000, len=65_536)["sha"]
    # the daemon's view: the QP, its peer, its owner, its bytes
    snap = env.status("A")
    json.dumps(snap)
    q = next(q for q in snap["qps"] if q["qpn"] == sa["qpn"])
    assert q["state"] == "RTS" and q["type"] == "RC" and q["remote_qpn"] == sb["qpn"]
    assert q["remote_addr"] == env.pair.b.ipv4 and q["owner"]["pid"] == sa["pid"]
    assert q["bytes_tx"] >= 105_000 and q["bytes_rx"] >= 65_536 and q["outstanding_send"] == 0
    assert "srtt_us" in q       # null on a compat QP: the compiled plane's requester posts no RTT probe yet
    c = next(c for c in snap["clients"] if c["pid"] == sa["pid"])
    assert c["qps"] == 1 and c["mrs"] == 1 and c["mr_bytes"] == 1 << 20
    dev = snap["devices"][0]
    assert dev["ifname"] == env.pair.a.ifname and dev["gids"] == [f"::ffff:{env.pair.a.ipv4}"]
    assert dev["counters"]["xdp_drops"]["UNKNOWN_QP"] == 0
    # a client that exits normally: everything it had is reclaimed
    a.close()
    _wait_for(lambda: not any(q["owner"]["pid"] == sa["pid"] for q in env.status("A")["qps"]), 10, "reclaim")
    assert not any(c["pid"] == sa["pid"] for c in env.status("A")["clients"])
    b.close()


def test_pingpong_uses_the_daemon_that_serves_the_interface(env):
    """`metaroce pingpong` on both hosts: each finds the daemon serving its interface (a `status` request on
    --socket), says so on stderr, and the exchange runs through the daemons (their clients list it); with the
    socket of a daemon serving another interface it would fall back to its own engine, which says why."""
    cli = [sys.executable, "-m", "metaroce_xdp.cli", "pingpong", "-n", "40", "-s", "1024", "-r", "16"]
    env.port += 1
    srv = env.topo.popen(env.topo[1], [*cli, "-d", env.pair.b.ifname, "-p", str(env.port), "--socket",
                                       env.sock("B")], cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        first = srv.stdout.readline()               # "  local address: ..." once it listens (or EOF: it failed)
        assert "local address" in first, (first, srv.stderr.read() if srv.poll() is not None else "")
        c = env.topo.run(env.topo[0], [*cli, "-d", env.pair.a.ifname, "-p", str(env.port), "--socket",
                                       env.sock("A"), env.pair.b.ipv4], timeout=120, check=False)
        out, err = srv.communicate(timeout=60)
        out = first + out
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    assert c.returncode == 0 and srv.returncode == 0, (c.stdout, c.stderr, out, err)
    for o, e, h in ((c.stdout, c.stderr, "A"), (out, err, "B")):
        assert f"engine: metaroced (pid {env.status(h)['daemon']['pid']}) on {env.sock(h)}" in e, e
        assert "81920 bytes in" in o and "40 iters in" in o, o                 # rc_pingpong's closing lines
    # a socket whose daemon serves another interface: not used, and the reason is given
    from metaroce_xdp.cli import engine_choice
    ch = engine_choice.choose("no-such-if0", env.sock("A"))
    assert not ch.daemon and f"serves {env.pair.a.ifname}, not no-such-if0" in ch.why
    assert not engine_choice.choose(env.pair.a.ifname, env.sock("A") + ".none").daemon
    assert "--no-daemon" in engine_choice.choose(env.pair.a.ifname, env.sock("A"), no_daemon=True).why


def test_perf_write_bw_through_the_daemons(env):
    """`metaroce perf write-bw` on both hosts finds the daemon serving its interface and runs through it: the
    server's buffer holds what the client wrote (peer_verified), and the header names the engine."""
    cli = [sys.executable, "-m", "metaroce_xdp.cli", "perf", "write-bw", "--json", "-n", "200", "-s", "16384"]
    env.port += 1
    srv = env.topo.popen(env.topo[1], [*cli, "-d", env.pair.b.ifname, "-p", str(env.port), "--socket",
                                       env.sock("B")], cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        for _ in range(60):                                  # until the server listens (its first line)
            c = env.topo.run(env.topo[0], [*cli, "-d", env.pair.a.ifname, "-p", str(env.port), "--socket",
                                           env.sock("A"), env.pair.b.ipv4], timeout=120, check=False)
            if "start `metaroce perf" not in c.stderr or srv.poll() is not None:
                break
            time.sleep(0.5)
        out, err = srv.communicate(timeout=60)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    assert c.returncode == 0 and srv.returncode == 0, (c.stdout, c.stderr, out, err)
    r = json.loads(c.stdout.strip().splitlines()[-1])
    assert r["peer_verified"] is True and r["gbps"] > 0, r
    for e, h in ((c.stderr, "A"), (err, "B")):
        assert f"metaroce perf: engine: metaroced (pid {env.status(h)['daemon']['pid']})" in e, e


def test_another_clients_rkey_gets_remote_access_error_and_memory_is_untouched(env):
    victim = env.player("B")
    sv = victim.ok(cmd="setup", size=1 << 16, seed=7)
    before = victim.ok(cmd="digest", off=0, len=1 << 16)["sha"]
    a, b, sa, sb = env.connected(size=1 << 16, seeds=(3, 4))
    nak0 = env.status("B")["devices"][0]["counters"]["plane"]["tx_nak"]
    # A's client writes to the victim's memory with the victim's exact rkey, over its QP to B's other client
    a.ok(cmd="post", ops=[{"op": "write", "off": 0, "len": 4096, "va": sv["va"], "rkey": sv["rkey"], "wr_id": 1}])
    w = a.ok(cmd="wait", n=1)["wcs"][0]
    assert w["status"] == "REM_ACCESS_ERR", w
    assert a.ok(cmd="state")["state"] == "ERR"
    assert victim.ok(cmd="digest", off=0, len=1 << 16)["sha"] == before
    assert env.status("B")["devices"][0]["counters"]["plane"]["tx_nak"] > nak0
    # a READ of it through a fresh connection fails the same way
    a2, b2, _, _ = env.connected(size=1 << 16, seeds=(5, 6))
    a2.ok(cmd="post", ops=[{"op": "read", "off": 0, "len": 4096, "va": sv["va"], "rkey": sv["rkey"], "wr_id": 2}])
    assert a2.ok(cmd="wait", n=1)["wcs"][0]["status"] == "REM_ACCESS_ERR"
    assert victim.ok(cmd="digest", off=0, len=1 << 16)["sha"] == before
    for p in (a, b, a2, b2, victim):
        p.close()


def _raw(path: str):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    s.settimeout(10)
    return s


def _ask(s, data: bytes, fds=()) -> dict:
    from metaroce_xdp.daemon import proto
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, np.array(fds, np.int32).tobytes())] if fds else []
    s.sendmsg([data], anc)
    while True:
        msg, rfds, problem = proto.recv(s, proto.MAX_REPLY)
        for fd in rfds:
            os.close(fd)
        assert problem is None and msg is not None
        if "event" not in msg:
            return msg


def test_bad_requests_get_typed_errors_and_harm_nothing(env):
    from metaroce_xdp.daemon import client as C
    from metaroce_xdp import shm
    from metaroce_xdp.verbs_types import (SGE, Access, InvalidArgument, InvalidState, QPAttr, QPCap, QPState,
                                          SendFlags, SendWR, WROpcode)
    path = env.sock("A")
    s = _raw(path)
    for data, want in ((b"\xff\x00garbage", "MalformedRequest"), (b"[1, 2]", "MalformedRequest"),
                       (b'{"op": "no_such_op", "id": 1}', "MalformedRequest"),
                       (b'{"op": "__init__", "id": 1}', "MalformedRequest"),
                       (b'{"op": "alloc_pd", "id": 2}', "InvalidState"),
                       (b'{"op": "open_device", "ifname": 5}', "MalformedRequest"),
                       (b'{"op": "open_device", "ifname": "nope0"}', "InvalidArgument"),
                       (b"{" + b" " * 70_000 + b"}", "MalformedRequest"),
                       (b'{"op": "open_device"', "MalformedRequest")):
        r = _ask(s, data)
        assert not r["ok"] and r["error"] == want, (data[:40], r)
    assert _ask(s, b'{"op": "open_device", "id": 3}')["ok"]
    for req, want in (({"op": "destroy_qp", "qp": 999}, "UnknownHandle"),
                      ({"op": "create_qp", "pd": "x"}, "MalformedRequest"),
                      ({"op": "create_cq", "depth": -1}, "MalformedRequest"),
                      ({"op": "create_cq", "depth": 1 << 30}, "MalformedRequest"),
                      ({"op": "create_cq", "depth": 1 << 16}, "LimitExceeded"),   # this client's CQ entries
                      ({"op": "reg_mr", "pd": 1, "length": 10}, "UnknownHandle")):
        r = _ask(s, json.dumps(req).encode())
        assert not r["ok"] and r["error"] == want, (req, r)
    pd = _ask(s, b'{"op": "alloc_pd"}')["pd"]
    r = _ask(s, json.dumps({"op": "reg_mr", "pd": pd, "length": 4096}).encode())
    assert r["error"] == "MalformedRequest"                                # no memfd
    unsealed = os.memfd_create("x")
    os.ftruncate(unsealed, 8192)
    r = _ask(s, json.dumps({"op": "reg_mr", "pd": pd, "length": 4096}).encode(), [unsealed])
    assert r["error"] == "InvalidArgument" and "sealed" in r["message"]
    sealed = shm.create(8192)
    r = _ask(s, json.dumps({"op": "reg_mr", "pd": pd, "length": 4096, "offset": 8000}).encode(), [sealed])
    assert r["error"] == "InvalidArgument" and "beyond" in r["message"]
    os.close(unsealed), os.close(sealed)
    s.close()

    # through the client library
    ctx = C.connect(path, env.pair.a.ifname)
    try:
        pd = ctx.alloc_pd()
        with pytest.raises(InvalidArgument, match="alloc_buf"):
            pd.reg_mr(np.zeros(4096, np.uint8), Access.LOCAL_WRITE)
        with pytest.raises(C.LimitExceeded, match="max_mr_bytes_per_client"):
            pd.reg_mr(ctx.alloc_buf(33 << 20), Access.LOCAL_WRITE)
        buf = ctx.alloc_buf(1 << 16)
        mr = pd.reg_mr(buf, Access.LOCAL_WRITE | Access.REMOTE_WRITE)
        cq = ctx.create_cq(16)
        qps = [ctx.create_qp(pd, cq, cq, QPCap(max_send_wr=16, max_recv_wr=16)) for _ in range(4)]
        with pytest.raises(C.LimitExceeded, match="max_qps_per_client"):
            ctx.create_qp(pd, cq, cq)
        qp = qps[0]
        with pytest.raises(InvalidState, match="RTS"):
            qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[mr.sge(0, 8)], remote_addr=0, rkey=1))
        with pytest.raises(C.MalformedRequest, match="unknown QP attributes"):
            ctx._call("modify_qp", qp=qp.handle, attr={"qp_state": 1, "bogus": 1})
        with pytest.raises(InvalidState, match="not a valid transition"):
            qp.modify(QPAttr(qp_state=QPState.RTS))
        qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=Access.REMOTE_WRITE))
        qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=0x777, rq_psn=0, path_mtu=1024, dgid=env.pair.b.ipv4))
        qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0))
        with pytest.raises(C.Unsupported):                                # one SGE per WR
            qp.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND, sg_list=[mr.sge(0, 8)] * 2))
        # an SGE outside the MR (or an oversized one) is the WR's error completion, not a refusal at post
        # (MR-MEM-020, MR-RC-022): the daemon's loop checks it when the WQE is the oldest; the WR behind it flushes
        qp.post_send([SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, send_flags=SendFlags.SIGNALED,
                             sg_list=[SGE(mr.addr + 65_000, 1000, mr.lkey)]),
                      SendWR(wr_id=2, opcode=WROpcode.RDMA_WRITE, send_flags=SendFlags.SIGNALED,
                             sg_list=[mr.sge(0, 1 << 20)])])
        w = cq.wait(2, 10)
        assert [(x.wr_id, x.status.name) for x in w] == [(1, "LOC_PROT_ERR"), (2, "WR_FLUSH_ERR")], w
        _wait_for(lambda: qp.state == QPState.ERR, 5, "QP to ERR")
        assert ctx.get_async_event(0.3) is None                          # the completion says it (MR-RC-022)
        # a client bypassing the library: an opcode the loop does not serve, straight into the shared ring
        qp = qps[3]
        qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=Access.REMOTE_WRITE))
        qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=0x778, rq_psn=0, path_mtu=1024, dgid=env.pair.b.ipv4))
        qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0))
        e = qp._sq[int(qp.W[shm.QH_SQ_TAIL]) & (qp.sq_size - 1)]
        e[:9] = (77, 8, 2, mr.addr, 8, mr.lkey, 0, 0, 0)
        qp.W[shm.QH_SQ_TAIL] += 1
        ctx._doorbell(qp.qp_num)
        w = cq.wait(1, 10)[0]
        assert (w.wr_id, w.status.name) == (77, "LOC_QP_OP_ERR")
        _wait_for(lambda: qp.state == QPState.ERR, 5, "QP to ERR")
        ev = ctx.get_async_event(5)
        assert ev.event_type == EventType.QP_FATAL and ev.qp is qp and "invalid work request" in ev.reason
        # a nonsense tail on another QP moves only that QP to ERR
        q2 = qps[1]
        q2.modify(QPAttr(qp_state=QPState.INIT))
        q2.W[shm.QH_RQ_TAIL] = 1 << 40
        ctx._doorbell(q2.qp_num)
        _wait_for(lambda: q2.state == QPState.ERR, 5, "QP with a nonsense tail to ERR")
        assert qps[2].state == QPState.RESET
        assert ctx.status()["daemon"]["clients"] >= 1                   # the daemon serves on
    finally:
        ctx.close()
    # max_clients (8): the ninth connection is refused with a typed error
    conns = []
    try:
        with pytest.raises(C.LimitExceeded, match="max_clients"):
            for _ in range(9):
                conns.append(C.connect(path))
        assert 1 <= len(conns) <= 8          # 8 minus the connections still open (this test's own: none)
    finally:
        for c in conns:
            c.close()
    # a process that is neither root nor in socket_group (none configured) is refused by SO_PEERCRED
    out = subprocess.run([sys.executable, "-c", (
        "import os, sys; sys.path.insert(0, %r); os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
        "from metaroce_xdp.daemon import client\n"
        "try:\n    client.connect(%r)\nexcept client.PermissionDenied as e:\n    print('denied', e)\n") %
        (str(ROOT), path)], capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("denied uid 65534"), out
    _wait_for(lambda: env.status("A")["daemon"]["clients"] == 1, 10, "the bad clients reclaimed (1: this query)")


def test_bad_ring_entries_fail_in_the_compiled_loop_on_their_own_qp_only(env):
    """The daemon's loop (dp/serve.py) checks every ring entry itself: another client's MR, even named by
    its exact lkey and address, fails the WQE's local checks -- a READ completes LOC_PROT_ERR when it is the
    oldest (MR-RC-022, no async event: the completion says it), a receive WQE is taken and would fail when a
    SEND came for it (MR-MEM-020) -- and an unknown opcode or flags are refused (LOC_QP_OP_ERR, QP_FATAL);
    each only moves its own QP to ERR, and the other client's memory is untouched."""
    from metaroce_xdp.daemon import client as C
    from metaroce_xdp import shm
    from metaroce_xdp.verbs_types import Access, QPAttr, QPCap, QPState, WROpcode
    path = env.sock("A")
    c1, c2 = C.connect(path, env.pair.a.ifname), C.connect(path, env.pair.a.ifname)
    try:
        pd2 = c2.alloc_pd()
        buf2 = c2.alloc_buf(1 << 16)
        buf2[:] = 7
        mr2 = pd2.reg_mr(buf2, Access.LOCAL_WRITE | Access.REMOTE_WRITE)
        cq2 = c2.create_cq(16)
        qp2 = c2.create_qp(pd2, cq2, cq2, QPCap(max_send_wr=16, max_recv_wr=16))
        qp2.modify(QPAttr(qp_state=QPState.INIT))
        pd1 = c1.alloc_pd()
        mr1 = pd1.reg_mr(c1.alloc_buf(1 << 16), Access.LOCAL_WRITE)
        cq1 = c1.create_cq(16)
        qps = [c1.create_qp(pd1, cq1, cq1, QPCap(max_send_wr=16, max_recv_wr=16)) for _ in range(4)]
        for i, q in enumerate(qps[1:]):         # each to a remote QP of its own (PathInUse otherwise)
            q.modify(QPAttr(qp_state=QPState.INIT))
            q.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=0x777 + i, rq_psn=0, path_mtu=1024,
                            dgid=env.pair.b.ipv4))
            q.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0))
        qps[0].modify(QPAttr(qp_state=QPState.INIT))

        def raw(qp, recv: bool, entry: tuple) -> None:       # what a client bypassing the library writes
            ring, col = (qp._rq, shm.QH_RQ_TAIL) if recv else (qp._sq, shm.QH_SQ_TAIL)
            ring[int(qp.W[col]) & (len(ring) - 1), :len(entry)] = entry
            qp.W[col] += 1
            c1._doorbell(qp.qp_num)

        # a receive WQE in another client's MR: taken, failed only when a SEND comes for it (none does here)
        raw(qps[0], True, (11, mr2.addr, 4096, mr2.lkey))
        _wait_for(lambda: int(qps[0].W[shm.QH_RQ_HEAD]) == 1, 5, "the receive WQE taken")
        assert not cq1.poll(1) and qps[0].state == QPState.INIT
        cases = ((qps[1], (12, int(WROpcode.RDMA_READ), 2, mr2.addr, 64, mr2.lkey, 0, 0, 0), "LOC_PROT_ERR",
                  "RDMA_READ", None),
                 (qps[2], (13, 8, 2, mr1.addr, 8, mr1.lkey, 0, 0, 0), "LOC_QP_OP_ERR", "SEND", "opcode 8"),
                 (qps[3], (14, int(WROpcode.RDMA_WRITE), 0x100, mr1.addr, 8, mr1.lkey, 0, 0, 0),
                  "LOC_QP_OP_ERR", "RDMA_WRITE", "send_flags 0x100"))
        for i, (qp, entry, status, opcode, why) in enumerate(cases):
            raw(qp, False, entry)
            w = cq1.wait(1, 10)[0]
            assert (w.wr_id, w.status.name, w.opcode.name, w.qp_num) == (entry[0], status, opcode, qp.qp_num), w
            _wait_for(lambda: qp.state == QPState.ERR, 5, "the QP to ERR")
            ev = c1.get_async_event(5 if why else 0.3)
            if why is None:
                assert ev is None, ev
            else:
                assert ev.event_type == EventType.QP_FATAL and ev.qp is qp and "invalid work request" in ev.reason and why in ev.reason, ev
            assert all(q.state != QPState.ERR for q in qps[i + 2:])          # only that QP
        assert qps[0].state == QPState.INIT
        assert qp2.state == QPState.INIT and not cq2.poll() and (buf2 == 7).all()
        dev = next(d for d in c1.status()["devices"] if d["ifname"] == env.pair.a.ifname)
        assert dev["counters"]["bad_wrs"] >= 2
    finally:
        c1.close()
        c2.close()


def _connected_clients(env, remote_invalidate: bool = False):
    """Two clients, one per host's daemon, each with a 64 KiB MR, a 16-entry CQ and a QP; A's QP in RTS,
    B's in RTR (its first request raises COMM_EST).  Returns a namespace: ca, cb, ma, mb, qa, qb, qa_cq,
    qb_cq, full (the access flags); the caller closes ca and cb."""
    from types import SimpleNamespace

    from metaroce_xdp.daemon import client as C
    from metaroce_xdp.verbs_types import Access, QPAttr, QPCap, QPState
    full = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
    ca, cb = C.connect(env.sock("A"), env.pair.a.ifname), C.connect(env.sock("B"), env.pair.b.ifname)
    try:
        pa, pb = ca.alloc_pd(), cb.alloc_pd()
        ma = pa.reg_mr(ca.alloc_buf(1 << 16), full)
        mb = pb.reg_mr(cb.alloc_buf(1 << 16), full, remote_invalidate=remote_invalidate)
        qa_cq, qb_cq = ca.create_cq(16), cb.create_cq(16)
        qa = ca.create_qp(pa, qa_cq, qa_cq, QPCap(max_send_wr=16, max_recv_wr=16))
        qb = cb.create_qp(pb, qb_cq, qb_cq, QPCap(max_send_wr=16, max_recv_wr=16))
        _both_to_rtr(env, qa, qb, full, max_dest_rd_atomic=4, min_rnr_timer=1)
        qa.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0, timeout=14, retry_cnt=7, rnr_retry=7, max_rd_atomic=4))
    except BaseException:
        ca.close()
        cb.close()
        raise
    return SimpleNamespace(ca=ca, cb=cb, ma=ma, mb=mb, qa=qa, qb=qb, qa_cq=qa_cq, qb_cq=qb_cq, full=full)


def test_event_loop_waits_on_the_clients_file_descriptor(env):
    """ctx.fileno() (issue 22): an event loop waits on it instead of spinning -- not readable while nothing
    happened; readable once the daemon sent a CQ's completion event (and the COMM_EST of the peer's first
    request); cq.get_event(0) and get_async_event(0) hand them out, and it is quiet again after.  Also
    through asyncio's add_reader, as an application's loop would."""
    import asyncio
    import select

    from metaroce_xdp.verbs_types import RecvWR, SendFlags, SendWR, WROpcode
    t = _connected_clients(env)
    ca, cb, ma, mb, qa, qb, qa_cq, qb_cq = t.ca, t.cb, t.ma, t.mb, t.qa, t.qb, t.qa_cq, t.qb_cq
    try:
        qb.post_recv([RecvWR(wr_id=30 + i, sg_list=[mb.sge(4096 * i, 4096)]) for i in range(2)])
        fd = cb.fileno()
        assert not select.select([fd], [], [], 0.3)[0]                    # nothing happened: quiet
        qb_cq.req_notify()
        qa.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND, sg_list=[ma.sge(0, 64)], send_flags=SendFlags.SIGNALED))
        assert select.select([fd], [], [], 10)[0]                         # the CQ's event
        assert qb_cq.get_event(0) and qb_cq.poll(1)[0].wr_id == 30
        # COMM_EST (the RTR QP's first request) comes on its own path, maybe just after: the fd wakes for it too
        ev = cb.get_async_event(0)
        if ev is None:
            assert select.select([fd], [], [], 10)[0]
            ev = cb.get_async_event(0)
        assert ev is not None and ev.event_type == EventType.COMM_EST, ev
        assert cb.get_async_event(0) is None and not qb_cq.get_event(0)
        assert not select.select([fd], [], [], 0.3)[0]                    # all handed out: quiet again
        # an asyncio loop, as an application waits
        qb_cq.req_notify()

        async def wait_one() -> bool:
            loop, got = asyncio.get_running_loop(), asyncio.Event()
            loop.add_reader(fd, got.set)
            try:
                qa.post_send(SendWR(wr_id=2, opcode=WROpcode.SEND, sg_list=[ma.sge(0, 64)],
                                    send_flags=SendFlags.SIGNALED))
                await asyncio.wait_for(got.wait(), 10)
                return qb_cq.get_event(0)
            finally:
                loop.remove_reader(fd)
        assert asyncio.run(wait_one()) and qb_cq.poll(1)[0].wr_id == 31
        assert [w.wr_id for w in qa_cq.wait(2, 10)] == [1, 2]
    finally:
        ca.close()
        cb.close()
    with pytest.raises(InvalidState):
        cb.fileno()


def test_completion_events_comm_est_cnp_counters_sqd_and_send_with_inv_through_the_client(env):
    """Issue 21, what the conformance agent drives through metaroced: a CQ armed with solicited_only gets its
    event for a SEND with SE only (MR-BTH-004), the completion already in the ring; a QP in RTR raises COMM_EST
    at its first request (MR-QP-021); query_qp reports the per-QP CNP counters (MR-CC-039); a WRITE posted in
    SQD waits for RTS (MR-QP-018); a SEND WITH INVALIDATE invalidates the peer's remote-invalidatable MR
    (MR-MEM-040), its receive completion carries the key, and a WRITE with that rkey then fails."""
    from metaroce_xdp.verbs_types import (InvalidArgument, QPAttr, QPState, RecvWR, SendFlags, SendWR, WCFlags,
                                          WCStatus, WROpcode)
    t = _connected_clients(env, remote_invalidate=True)
    ca, cb, ma, mb, qa, qb, qa_cq, qb_cq = t.ca, t.cb, t.ma, t.mb, t.qa, t.qb, t.qa_cq, t.qb_cq
    try:
        qb.post_recv([RecvWR(wr_id=20 + i, sg_list=[mb.sge(4096 * i, 4096)]) for i in range(3)])
        qb_cq.req_notify(solicited_only=True)
        with pytest.raises(InvalidArgument):
            qb_cq.req_notify(solicited_only=1)
        sig = SendFlags.SIGNALED
        qa.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND, sg_list=[ma.sge(0, 64)], send_flags=sig))
        assert qb_cq.wait(1, 10)[0].status == WCStatus.SUCCESS and not qb_cq.get_event(0.3)   # no SE: no event
        ev = cb.get_async_event(5)
        assert ev.event_type == EventType.COMM_EST and ev.qp is qb, ev                           # MR-QP-021
        qa.post_send(SendWR(wr_id=2, opcode=WROpcode.SEND, sg_list=[ma.sge(0, 64)], send_flags=sig | SendFlags.SOLICITED))
        assert qb_cq.get_event(10) and qb_cq.poll(1)[0].wr_id == 21       # the event, its completion in the ring
        assert not qb_cq.get_event(0.1)                                   # disarmed: one event per arming
        assert [w.status for w in qa_cq.wait(2, 10)] == [WCStatus.SUCCESS] * 2
        q = qa.query()
        assert all(isinstance(q[k], int) and q[k] >= 0 for k in ("tx_cnp", "rx_cnp", "rx_ce_marked",
                                                                 "rx_cnp_discarded")), q
        assert ("dcqcn_rate_bps" in q) == (ca.dcqcn is not None), q
        # SQD: the WRITE is queued, and sent once the QP is back in RTS (MR-QP-018)
        qb.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0))
        qa.modify(QPAttr(qp_state=QPState.SQD))
        _wait_for(lambda: qa.state == QPState.SQD, 5, "SQD")
        qa.post_send(SendWR(wr_id=3, opcode=WROpcode.RDMA_WRITE, sg_list=[ma.sge(0, 8)], send_flags=sig,
                            remote_addr=mb.addr + 32768, rkey=mb.rkey))
        assert not qa_cq.poll(1)
        qa.modify(QPAttr(qp_state=QPState.RTS))
        assert [(w.wr_id, w.status) for w in qa_cq.wait(1, 10)] == [(3, WCStatus.SUCCESS)]
        # SEND WITH INVALIDATE: the peer's MR invalidated, the key in its receive completion (MR-MEM-040)
        qb_cq.req_notify()
        qa.post_send(SendWR(wr_id=4, opcode=WROpcode.SEND_WITH_INV, sg_list=[ma.sge(0, 64)], send_flags=sig,
                            invalidate_rkey=mb.rkey))
        assert qb_cq.get_event(10)
        r = qb_cq.poll(1)[0]
        assert (r.wr_id, r.status, r.invalidated_rkey) == (22, WCStatus.SUCCESS, mb.rkey) and r.wc_flags & WCFlags.WITH_INV
        assert qa_cq.wait(1, 10)[0].status == WCStatus.SUCCESS
        qa.post_send(SendWR(wr_id=5, opcode=WROpcode.RDMA_WRITE, sg_list=[ma.sge(0, 8)], send_flags=sig,
                            remote_addr=mb.addr, rkey=mb.rkey))
        assert qa_cq.wait(1, 10)[0].status == WCStatus.REM_ACCESS_ERR
    finally:
        ca.close()
        cb.close()


def test_a_receive_posted_before_the_send_meets_no_rnr_nak_though_the_loop_has_not_taken_it(env):
    """post_recv through metaroced returns once the WR is in the client's ring; the loop takes it at its next
    doorbell or scan.  A SEND the peer was told to send (the receive was posted) can come first: the responder
    then takes what the ring holds before it would NAK (dp/clientq.py), as a NIC reads the RQ's doorbell
    record -- no RNR NAK (the sender's rnr_retry is 0, so one would fail its SEND with RNR_RETRY_EXC_ERR).
    The WR is written into the ring with no doorbell (the loop sees it only at its 10 ms scan) and the SEND
    posted at once, until one SEND got there before the scan (late_recvs counts those)."""
    from metaroce_xdp import shm
    from metaroce_xdp.daemon import client as C
    from metaroce_xdp.verbs_types import Access, QPAttr, QPCap, QPState, SendFlags, SendWR, WCStatus, WROpcode
    full = Access.LOCAL_WRITE | Access.REMOTE_WRITE
    ca, cb = C.connect(env.sock("A"), env.pair.a.ifname), C.connect(env.sock("B"), env.pair.b.ifname)

    def plane_b() -> dict:
        return next(d for d in cb.status()["devices"] if d["ifname"] == env.pair.b.ifname)["counters"]["plane"]
    try:
        pa, pb = ca.alloc_pd(), cb.alloc_pd()
        ma, mb = pa.reg_mr(ca.alloc_buf(1 << 16), full), pb.reg_mr(cb.alloc_buf(1 << 16), full)
        qa_cq, qb_cq = ca.create_cq(64), cb.create_cq(64)
        qa = ca.create_qp(pa, qa_cq, qa_cq, QPCap(max_send_wr=64, max_recv_wr=4))
        qb = cb.create_qp(pb, qb_cq, qb_cq, QPCap(max_send_wr=4, max_recv_wr=64))
        _both_to_rtr(env, qa, qb, full, min_rnr_timer=1)
        qa.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0, timeout=14, retry_cnt=7, rnr_retry=0))
        p0 = plane_b()
        got = 0
        for i in range(40):
            ring = qb._rq
            ring[int(qb.W[shm.QH_RQ_TAIL]) & (len(ring) - 1), :4] = (100 + i, mb.addr + 64 * i, 64, mb.lkey)
            qb.W[shm.QH_RQ_TAIL] += 1                   # as post_recv writes it, the doorbell left out
            qa.post_send(SendWR(wr_id=i, opcode=WROpcode.SEND, sg_list=[ma.sge(64 * i, 64)],
                                send_flags=SendFlags.SIGNALED))
            w = qa_cq.wait(1, 10)[0]
            assert (w.wr_id, w.status) == (i, WCStatus.SUCCESS), w
            r = qb_cq.wait(1, 10)[0]
            assert (r.wr_id, r.status, r.byte_len) == (100 + i, WCStatus.SUCCESS, 64), r
            got = plane_b()["late_recvs"] - p0["late_recvs"]
            if got >= 3:
                break
        p1 = plane_b()
        assert got >= 1 and p1["tx_rnr"] == p0["tx_rnr"], (got, p0["tx_rnr"], p1["tx_rnr"])
        assert qb.state == QPState.RTR and bytes(mb.buf[:64 * (i + 1)]) == bytes(ma.buf[:64 * (i + 1)])
    finally:
        ca.close()
        cb.close()


def test_work_requests_are_taken_without_python_in_the_daemon(env):
    """Posting through the daemon wakes no Python there: the driver thread's returns from the compiled loop
    (driver_iterations) follow the clock -- one per time slice -- not the work requests (wrs_taken)."""
    from metaroce_xdp.daemon.server import SERVE_SLICE_NS
    a, b, _, _ = env.connected(size=1 << 16, seeds=(30, 31))

    def counters() -> dict:
        return env.status("A")["devices"][0]["counters"]
    c0, t0 = counters(), time.monotonic()
    r = a.ok(cmd="stream", n=3000, size=64)
    c1, el = counters(), time.monotonic() - t0
    assert r["error"] is None and r["done"] == 3000, r
    taken = c1["wrs_taken"] - c0["wrs_taken"]
    returns = c1["driver_iterations"] - c0["driver_iterations"]
    assert taken >= 3000 and c1["cqes_delivered"] - c0["cqes_delivered"] >= 3000
    assert returns <= el / (SERVE_SLICE_NS / 1e9) + 10, (returns, el)
    for p in (a, b):
        p.close()


def test_client_that_never_polls_overflows_its_own_cq_only(env):
    a, b, sa, sb = env.connected(size=1 << 16, seeds=(8, 9))
    a2, b2, _, _ = env.connected(size=1 << 16, seeds=(10, 11))
    # setup made a CQ of 256: 32 WRs at a time, never polled, overflow it (256 + the client ring's 256)
    end = time.monotonic() + 60
    i = 0
    while time.monotonic() < end:
        r = a(cmd="post", ops=[{"op": "write", "off": 0, "len": 8, "wr_id": 32 * i + k} for k in range(32)])
        assert r["ok"] or r["error"] == "QueueFull", r              # the daemon has not taken the last ones yet
        i += 1
        time.sleep(0.1)
        if a.ok(cmd="state")["state"] == "ERR":
            break
    assert a.ok(cmd="state")["state"] == "ERR"
    ev = a.ok(cmd="event", timeout=5)
    assert ev["event"] in ("CQ_ERR", "QP_FATAL"), ev
    # the other client on the same daemon is unaffected
    r = a2.ok(cmd="stream", n=50, size=4096)
    assert r["error"] is None and r["done"] == 50
    for p in (a, b, a2, b2):
        p.close()


def test_sigkill_of_a_client_mid_transfer(env):
    a1, b1, s1a, s1b = env.connected(size=1 << 20, seeds=(12, 13))
    a2, b2, s2a, s2b = env.connected(size=1 << 20, seeds=(14, 15))
    a1.send(cmd="stream", n=10 ** 6, size=65_536, timeout=60)        # the victim, never finishing
    b1.send(cmd="stream", n=10 ** 6, size=65_536, timeout=60)        # its peer, writing back to it
    _wait_for(lambda: next((q["bytes_tx"] for q in env.status("A")["qps"] if q["qpn"] == s1a["qpn"]), 0) > 1 << 20,
              20, "the victim's transfer under way")
    a2.send(cmd="stream", n=1500, size=65_536, timeout=90)           # another client on the same daemon
    _wait_for(lambda: next((q["bytes_tx"] for q in env.status("A")["qps"] if q["qpn"] == s2a["qpn"]), 0) > 0,
              20, "the other transfer under way")
    pin = next(Path(env.prefix).glob(f"{env.pair.a.ifname}@netns*"))
    assert s1a["qpn"] in {r["qpn"] for r in read_qps(env.pair.a.ifname, str(pin))}      # the kernel's view
    os.kill(s1a["pid"], signal.SIGKILL)
    # its QPs moved to ERR and destroyed, its MRs, CQs and session gone from the daemon
    _wait_for(lambda: not any(q["owner"]["pid"] == s1a["pid"] for q in env.status("A")["qps"]), 10, "reclaim")
    snap = env.status("A")
    assert not any(c["pid"] == s1a["pid"] for c in snap["clients"])
    kernel = {r["qpn"] for r in read_qps(env.pair.a.ifname, str(pin))}                  # the pinned QP table
    assert s1a["qpn"] not in kernel and s2a["qpn"] in kernel
    # its peer is told the RC way: its writes go unanswered, RETRY_EXC_ERR, its QP in ERR
    r = b1.line(timeout=60)
    assert r["ok"] and r["error"] == "RETRY_EXC_ERR", r
    assert b1.ok(cmd="state")["state"] == "ERR"
    # the other client's transfer completed, every byte
    r = a2.line(timeout=90)
    assert r["ok"] and r["error"] is None and r["done"] == 1500, r
    assert a2.ok(cmd="digest", off=0, len=65_536)["sha"] == b2.ok(cmd="digest", off=0, len=65_536)["sha"]
    # and the daemon goes on serving new clients
    a3, b3, _, _ = env.connected(size=1 << 16, seeds=(16, 17))
    assert a3.ok(cmd="stream", n=20, size=8192)["error"] is None
    for p in (b1, a2, b2, a3, b3):
        p.close()


def test_restart_after_sigkill_of_the_daemon(env):
    """What a dead instance left -- its socket, its pins, and (from an instance that attached through
    netlink) an XDP program nobody owns -- is cleaned, and the new one serves."""
    d = env.daemons["A"]
    pins = [p for p in Path(env.prefix).glob(f"{env.pair.a.ifname}@netns*")]
    assert pins and (pins[0] / "mr_qps").exists()
    d.p.send_signal(signal.SIGKILL)
    d.p.wait(timeout=10)
    # what the dead instance left: its socket and its pins (the kernel released its XDP link)
    assert os.path.exists(env.sock("A")) and (pins[0] / "mr_qps").exists()
    _wait_for(lambda: not env.topo.link_xdp_attached(env.topo[0], env.pair.a.ifname), 10, "XDP detached")
    # an older instance that attached through netlink leaves its program behind, owned by nobody: make one
    env.topo.run(env.topo[0], [sys.executable, "-c", (
        "import os, sys; sys.path.insert(0, %r)\n"
        "from bcc import BPF\nfrom metaroce_xdp.kern.loader import XdpLoader\n"
        "ld = XdpLoader(max_qps=1024)\nfn = ld.bpf.load_func(b'xdp_metaroce', BPF.XDP)\n"
        "BPF.attach_xdp(%r, fn, 0)\nos._exit(0)\n") % (str(ROOT), env.pair.a.ifname)], timeout=180)
    assert env.topo.link_xdp_attached(env.topo[0], env.pair.a.ifname)
    env.start_daemon("A")
    r = env.ready("A")
    assert any("stale socket" in c for c in r["cleaned"]), r
    assert any("stale pins" in c for c in r["cleaned"]), r
    assert any("stale XDP program" in c for c in r["cleaned"]), r
    a, b, _, _ = env.connected(size=1 << 16, seeds=(18, 19))
    a.ok(cmd="post", ops=[{"op": "write", "off": 0, "len": 60_000, "roff": 0}])
    assert a.ok(cmd="wait", n=1)["wcs"][0]["status"] == "SUCCESS"
    assert a.ok(cmd="digest", off=0, len=60_000)["sha"] == b.ok(cmd="digest", off=0, len=60_000)["sha"]
    a.close(), b.close()


def test_sigterm_drains_and_flushes_outstanding_work(env):
    a, b, _, _ = env.connected(size=1 << 16, seeds=(20, 21))
    b.ok(cmd="post", ops=[{"op": "recv", "off": 0, "len": 1024, "wr_id": 100 + i} for i in range(8)])
    a.ok(cmd="post", ops=[{"op": "write", "off": 0, "len": 30_000, "roff": 0, "wr_id": 5}])
    assert a.ok(cmd="wait", n=1)["wcs"][0]["status"] == "SUCCESS"
    d = env.daemons["B"]
    pins = list(Path(env.prefix).glob(f"{env.pair.b.ifname}@netns*"))
    assert pins
    d.p.send_signal(signal.SIGTERM)
    assert d.p.wait(timeout=30) == 0
    # the receives still posted complete with flush errors, in the client's CQ ring (still mapped)
    wcs = b.ok(30, cmd="wait", n=8, timeout=10)["wcs"]
    assert sorted(w["wr_id"] for w in wcs) == list(range(100, 108))
    assert {w["status"] for w in wcs} == {"WR_FLUSH_ERR"}
    assert b.ok(cmd="event", timeout=2)["event"] in ("DEVICE_FATAL", "QP_FATAL")
    assert not os.path.exists(env.sock("B"))
    assert not (pins[0] / "mr_qps").exists()
    assert not env.topo.link_xdp_attached(env.topo[1], env.pair.b.ifname)
    a.close(), b.close()


def test_reload_applies_run_time_options_and_refuses_the_others(tmp_path):
    from metaroce_xdp.daemon.config import ConfigError, DaemonConfig
    from metaroce_xdp.daemon.server import Daemon
    cfg = DaemonConfig(interfaces=["x0"], socket_path=str(tmp_path / "s.sock"))
    d = Daemon(cfg)
    new = DaemonConfig(interfaces=["x0"], socket_path=str(tmp_path / "s.sock"), max_qps_per_client=3,
                       progress="sleep", log_level="debug")
    assert sorted(d.reload(new)) == ["log_level", "max_qps_per_client", "progress"]
    assert d.cfg.max_qps_per_client == 3 and d.reload(new) == []
    with pytest.raises(ConfigError, match="interfaces, socket_path"):
        d.reload(DaemonConfig(interfaces=["y0"], socket_path=str(tmp_path / "t.sock"), max_clients=1))
    assert d.cfg.max_clients == 64 and d.cfg.interfaces == ["x0"]           # nothing applied
    d.drain_and_stop(0), d.drain_and_stop(0)                                  # idempotent, even unstarted

