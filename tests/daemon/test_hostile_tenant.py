"""Hostile tenants of metaroced (issue 19): a second client process attacks, the daemon and the other clients
go on.  Real daemons on the two ends of a veth pair (as tests/daemon/test_daemon.py), real client processes, some of
them as an unprivileged user (nobody, let in by socket_group = "nogroup").

Each case is one finding of issue 19 and failed on the code before its fix (d96aa28):
  3   a deeply nested or oversized control message, from a client or a refused connection; a client that
      makes QPs and CQs until the daemon runs out of file descriptors while another client keeps working
  4   status shows a non-root client only its own user's QPs; a second QP aimed at a remote QP another live
      QP of the interface is connected to is refused (PathInUse)
  8   a TCP client whose REQ claims another host's GID gets REJ ADDRESS_MISMATCH (MR-SEC-019)
  9   a hugetlb memfd is refused at reg_mr (a punched hole faults under the daemon's mapping once the huge page
      pool is empty: SIGBUS); a hole punched in a plain memfd MR refaults as zeros and harms nobody else
  N1  an RTR towards an address that never answers ARP held the serving thread for 2 s (failed on 71acc19)
  N2  (found by the control fuzzer) a request whose id nearly fills MAX_MSG: the error reply echoing it was
      too large too, and its MalformedRequest escaped; the daemon exited (failed on 2ef1220)
  N3  a client that sends requests and reads no reply held the serving thread 0.5 s, then was dropped
      (failed on 3bbf04e); 10: with it, events beyond the per-client limit are counted and told (EVENTS_LOST)
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import test_daemon
from test_daemon import ROOT, _ask, _raw, _wait_for

pytestmark = pytest.mark.netns

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
STRANGER = ["setpriv", "--reuid=65533", "--regid=65533", "--clear-groups"]     # neither root nor in the group
VICTIM = "10.77.0.3"
NOFILE_SOFT, NOFILE_HARD = 256, 1024      # the daemon starts with the soft limit a plain shell gives it
MAX_PENDING_EVENTS = 8                    # of 1024: reached with a few QPs


class Env(test_daemon.Env):
    # RLIMIT_NOFILE soft < hard, as a daemon started from a shell has
    DAEMON_PREFIX = ("prlimit", f"--nofile={NOFILE_SOFT}:{NOFILE_HARD}", "--",
                     "env", f"METAROCE_MAX_PENDING_EVENTS={MAX_PENDING_EVENTS}")

    def config_text(self, h: str) -> str:
        return (super().config_text(h).replace("max_qps_per_client = 4", "max_qps_per_client = 256")
                + 'socket_group = "nogroup"\n')

    def daemon_alive(self, h: str) -> bool:
        return self.daemons[h].p.poll() is None


@pytest.fixture(scope="module")
def env():
    with Env.running("A", "B") as e:
        yield e


def _run_as(who: list[str], env: Env, ns_host: str, code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """A client process as another user, in host ns_host's namespace, running `code` (sock, ifname given)."""
    ns, ep = env.hosts[ns_host]
    pre = f"import sys; sys.path.insert(0, {str(ROOT)!r}); sock, ifname = {env.sock(ns_host)!r}, {ep.ifname!r}\n"
    p = env.topo.popen(ns, who + [sys.executable, "-c", pre + code], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, cwd="/")
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _transfer_works(env: Env) -> None:
    """A fresh pair of clients connects and a verified WRITE goes from A to B."""
    a, b, sa, sb = env.connected()
    a.ok(cmd="post", ops=[{"op": "write", "len": 4096}])
    assert a.ok(cmd="wait", n=1)["wcs"][0]["status"] == "SUCCESS"
    assert a.ok(cmd="digest", off=0, len=4096)["sha"] == b.ok(cmd="digest", off=0, len=4096)["sha"]
    a.close(), b.close()


# ================================================================================ finding 3
def test_nested_and_oversized_messages_cost_their_sender_only(env):
    """Before: json.loads raised RecursionError out of _serve, and the daemon exited."""
    path = env.sock("A")
    for data in (b"[" * 60_000, b'{"op": "hello", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                 b'{"op": "hello", "id": ' + b"{\"a\":" * 900 + b"1" + b"}" * 900 + b"}",
                 b"{" + b" " * 70_000 + b"}"):
        s = _raw(path)
        r = _ask(s, data)
        assert not r["ok"] and r["error"] == "MalformedRequest", (data[:30], r)
        assert _ask(s, b'{"op": "hello", "id": 7}')["ok"]          # the connection itself goes on
        s.close()
    # a refused connection (a uid neither root nor in socket_group) sending the same
    out = _run_as(STRANGER, env, "A", (
        "import socket\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); s.connect(sock); s.settimeout(10)\n"
        "s.send(b'[' * 60000)\n"
        "print(s.recv(65536).decode())\n"))
    assert "PermissionDenied" in out.stdout, out
    assert env.daemon_alive("A")
    st = env.status("A")["daemon"]
    assert st["refused"].get("MalformedRequest", 0) >= 4 and st["refused"].get("PermissionDenied", 0) >= 1, st
    _transfer_works(env)


def test_a_request_id_too_large_to_echo_costs_nothing(env):
    """N2, found by the control fuzzer (metaroce_xdp/fuzz/ctl.py): the reply echoes the request's id, so a 65,500
    byte id made the reply too large, and the error reply that echoed the same id raised outside any handler.
    Before: the client's connection was dropped (2ef1220) or the daemon exited (d96aa28)."""
    path = env.sock("A")
    s = _raw(path)
    r = _ask(s, json.dumps({"op": "nope", "id": "x" * 65500}).encode())
    assert not r["ok"] and r["error"] == "MalformedRequest" and r["id"] is None, {k: str(v)[:80] for k, v in r.items()}
    assert _ask(s, b'{"op": "hello", "id": 7}')["ok"]          # the connection itself goes on
    s.close()
    assert env.daemon_alive("A")
    _transfer_works(env)


def test_one_client_cannot_run_the_daemon_out_of_file_descriptors(env):
    """Before: the daemon kept its soft RLIMIT_NOFILE (256 here) and gave no client a share, so one client's QPs
    took every descriptor; the next client's session header failed with EMFILE out of run() and the daemon
    exited (with a higher limit, a client that makes ~1,000 QPs and reconnects does the same)."""
    from metaroce_xdp.daemon import client as C
    from metaroce_xdp.verbs_types import QPCap
    path = env.sock("A")
    hogs = []

    def hog() -> None:
        ctx = C.connect(path, env.pair.a.ifname)
        hogs.append(ctx)
        pd = ctx.alloc_pd()
        cq = ctx.create_cq(16)
        with pytest.raises(C.LimitExceeded, match="file descriptors"):
            for _ in range(300):
                ctx.create_qp(pd, cq, cq, QPCap(max_send_wr=1, max_recv_wr=1))
    try:
        for _ in range(3):                                        # three connections of the same attacker
            hog()
        hogs.pop(0).close()                                       # and it reconnects: the old ones come back
        hog()
        # meanwhile another client connects, makes its objects and transfers
        assert env.daemon_alive("A")
        _transfer_works(env)
        st = env.status("A")["daemon"]
        assert st["fd_limit"] == NOFILE_HARD                     # raised to the hard limit at start
        for ctx in hogs:          # QPs + its CQ + socket, session header, wake-up and event eventfds
            assert len(ctx.qps) + 1 + 4 == st["fd_budget_per_client"]
        assert st["refused"].get("LimitExceeded", 0) >= 4
    finally:
        for c in hogs:
            c.close()


# ================================================================================ finding 4
def test_status_shows_a_user_only_its_own_qps(env):
    """Before: status needed no open device and returned every tenant's QPN, peer, PSNs and owner."""
    a, b, sa, sb = env.connected()
    try:
        out = _run_as(NOBODY, env, "A", (
            "import json, os\n"
            "from metaroce_xdp.daemon import client\n"
            "from metaroce_xdp.verbs_types import QPCap\n"
            "ctx = client.connect(sock, ifname)\n"
            "pd = ctx.alloc_pd(); cq = ctx.create_cq(16); qp = ctx.create_qp(pd, cq, cq, QPCap(4, 4))\n"
            "st = client.status(sock)\n"
            "import subprocess\n"
            f"cli = subprocess.run([sys.executable, '-m', 'metaroce_xdp.cli', 'qp', 'list', '-j', '--socket', sock],\n"
            f"                     capture_output=True, text=True, cwd={str(ROOT)!r}, timeout=60)\n"
            "print(json.dumps({'mine': qp.qp_num, 'qps': [q['qpn'] for q in st['qps']],\n"
            "                  'cli': [q['qpn'] for q in json.loads(cli.stdout)['qps']],\n"
            "                  'uids': sorted({c['uid'] for c in st['clients']})}))\n"))
        assert out.returncode == 0, out
        r = json.loads(out.stdout.splitlines()[-1])
        assert r["qps"] == [r["mine"]] and r["uids"] == [65534], r       # not sa["qpn"], root's QP
        assert r["cli"] == [r["mine"]], r                                 # `metaroce qp list` as that user
        # the CLI as that user with no QP of its own (the process exited): nothing, never root's
        cli = subprocess.run(NOBODY + [sys.executable, "-m", "metaroce_xdp.cli", "qp", "list", "-j", "--socket",
                                       env.sock("A")], capture_output=True, text=True, cwd=str(ROOT), timeout=60)
        assert cli.returncode == 0, cli
        assert json.loads(cli.stdout)["qps"] == []
        # root sees every QP
        assert sa["qpn"] in [q["qpn"] for q in env.status("A")["qps"]]
    finally:
        a.close(), b.close()


def test_a_second_qp_aimed_at_a_connected_remote_qp_is_refused(env):
    """Before: any client could take another's (dgid, dest_qp) and inject into its stream."""
    from metaroce_xdp.daemon import client as C
    from metaroce_xdp.verbs_types import InvalidArgument, QPAttr, QPCap, QPState
    a, b, sa, sb = env.connected()
    ctx = C.connect(env.sock("A"), env.pair.a.ifname)
    try:
        pd = ctx.alloc_pd()
        cq = ctx.create_cq(16)
        qp = ctx.create_qp(pd, cq, cq, QPCap(max_send_wr=4, max_recv_wr=4))
        qp.modify(QPAttr(qp_state=QPState.INIT))
        before = env.status("A")["daemon"].get("refused", {}).get("PathInUse", 0)
        for dgid in (env.pair.b.ipv4, "::ffff:" + env.pair.b.ipv4):         # either spelling of the address
            with pytest.raises(InvalidArgument, match="one remote QP takes one local QP") as e:
                qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=sb["qpn"], rq_psn=0, path_mtu=1024, dgid=dgid))
            assert type(e.value).__name__ == "PathInUse"
        assert env.status("A")["daemon"]["refused"]["PathInUse"] == before + 2
        assert qp.state == QPState.INIT
        # another remote QP is fine
        qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=(sb["qpn"] + 1) & 0xFFFFFF, rq_psn=0, path_mtu=1024,
                         dgid=env.pair.b.ipv4))
        # the victim's connection still carries its data
        a.ok(cmd="post", ops=[{"op": "write", "len": 4096}])
        assert a.ok(cmd="wait", n=1)["wcs"][0]["status"] == "SUCCESS"
    finally:
        ctx.close()
        a.close(), b.close()


# ================================================================================ finding 8
def test_a_req_claiming_another_address_is_rejected_mr_sec_019(env):
    """Before: Listener.accept moved the QP to RTR towards whatever GID the REQ claimed and answered REP, so any
    TCP client could aim a listening QP at a third host (here 10.77.0.3, a second address on host A, which
    answers ARP: the QP would have sent to it)."""
    ns_a, ep_a = env.hosts["A"]
    env.topo.run(ns_a, ["ip", "addr", "replace", f"{VICTIM}/24", "dev", ep_a.ifname])
    b = env.player("B")
    b.ok(cmd="setup", size=1 << 16, seed=3)
    env.port += 1
    b.ok(cmd="listen", port=env.port)
    b.send(cmd="accept", timeout=20)
    # from host A's namespace (TCP source 10.77.0.1), a REQ claiming the victim's address
    out = _run_as([], env, "A", (
        "from metaroce_xdp import cm\n"
        f"ch = cm.connect({env.pair.b.ipv4!r}, {env.port})\n"
        f"req = cm.CMMsg(cm.MsgType.REQ, cookie=cm.new_cookie(), gid=cm.ip_to_gid({VICTIM!r}), qpn=0x1234,\n"
        "               psn=1, path_mtu=cm.MTU_ENUM[1024], max_dest_rd_atomic=16)\n"
        "ch.send(req.encode())\n"
        "m = cm.read_msg(ch, 10)\n"
        "print(m.msg_type.name, m.reason.name)\n"))
    assert out.stdout.split() == ["REJ", "ADDRESS_MISMATCH"], out
    r = b.line()
    assert not r["ok"] and "MR-SEC-019" in r["message"], r
    assert b.ok(cmd="state")["state"] != "RTR"
    b.close()
    _transfer_works(env)                    # the honest set-up (GID = TCP source) still connects


def test_address_check_allows_the_same_host_and_mapped_forms():
    from metaroce_xdp import cm
    assert cm.address_problem(cm.ip_to_gid("10.1.2.3"), "10.1.2.3") == ""
    assert cm.address_problem(cm.ip_to_gid("10.1.2.3"), "::ffff:10.1.2.3") == ""
    assert cm.address_problem(cm.ip_to_gid("127.0.0.1"), "127.0.0.1") == ""
    assert "MR-SEC-019" in cm.address_problem(cm.ip_to_gid("192.0.2.7"), "198.51.100.1")
    # a client on this host connecting over loopback with one of this host's addresses
    assert cm.address_problem(cm.ip_to_gid("127.0.0.2"), "127.0.0.1") == ""
    assert "MR-SEC-019" in cm.address_problem(cm.ip_to_gid("192.0.2.7"), "127.0.0.1")


# ================================================================================ finding 9
@pytest.fixture
def huge_pages():
    """Two 2 MiB huge pages in the pool for the test (restored after); skip when the kernel has none to give."""
    path = "/proc/sys/vm/nr_hugepages"
    old = open(path).read().strip()
    try:
        with open(path, "w") as f:
            f.write("2")
        if int(open(path).read()) < 1:
            pytest.skip("no huge pages could be reserved")
        yield
    finally:
        with open(path, "w") as f:
            f.write(old)


def test_hugetlb_memfds_are_refused_and_punched_holes_harm_nobody_else(env, huge_pages):
    """Before: reg_mr took a hugetlb memfd; the client punched a hole in it, another process took the pool, and the
    next WRITE into the MR was SIGBUS in the daemon (the mechanism measured: docs/daemon.md, "Which memory can be
    registered")."""
    a, b, sa, sb = env.connected()
    try:
        r = b(cmd="hugetlb_mr")
        assert not r["ok"] and r["error"] == "InvalidArgument" and "hugetlb" in r["message"], r
        # a hole in a plain memfd MR: the daemon's next access refaults a zero page (shmem), nothing faults
        b.ok(cmd="punch", off=0, len=1 << 16)
        assert b.ok(cmd="digest", off=0, len=4096)["sha"] == __import__("hashlib").sha256(bytes(4096)).hexdigest()
        a.ok(cmd="post", ops=[{"op": "write", "len": 1 << 16}])
        assert a.ok(cmd="wait", n=1)["wcs"][0]["status"] == "SUCCESS"
        assert a.ok(cmd="digest", off=0, len=1 << 16)["sha"] == b.ok(cmd="digest", off=0, len=1 << 16)["sha"]
        assert env.daemon_alive("A") and env.daemon_alive("B")
    finally:
        a.close(), b.close()
    _transfer_works(env)


# ================================================================================ finding 10 (the daemon's parts)
def _same_file(fd1: int, fd2: int) -> bool:
    """kcmp(KCMP_FILE): whether two descriptors of this process are the same open file."""
    import ctypes
    pid = os.getpid()
    return ctypes.CDLL(None, use_errno=True).syscall(312, pid, pid, 0, fd1, fd2) == 0


def test_each_client_has_its_own_wake_up_eventfd_and_bounded_pds_and_native_qps(env):
    """Before: open_device handed every client the plane's eventfd (one could drain the others' wake-ups or
    write it in a loop), a client could allocate PDs without limit and take all 16 native slots."""
    from metaroce_xdp import cm
    from metaroce_xdp.daemon import client as C
    from metaroce_xdp.verbs_types import QPAttr, QPCap, QPState
    path = env.sock("A")
    c1, c2 = C.connect(path, env.pair.a.ifname), C.connect(path, env.pair.a.ifname)
    try:
        assert not _same_file(c1._efd, c2._efd)
        pds = [c1.alloc_pd() for _ in range(64)]
        with pytest.raises(C.LimitExceeded, match="PDs per client"):
            c1.alloc_pd()
        for pd in pds[1:]:
            pd.dealloc()
        cq = c1.create_cq(64)
        agreed = c1.agreed_profile(int(cm.Cap.NATIVE | cm.Cap.SACK | cm.Cap.OOO_PLACEMENT), 256, 1)
        limit = 4                                      # max_native_qps_per_client's default
        for i in range(limit + 1):
            qp = c1.create_qp(pds[0], cq, cq, QPCap(max_send_wr=4, max_recv_wr=4))
            qp.modify(QPAttr(qp_state=QPState.INIT))
            rtr = QPAttr(qp_state=QPState.RTR, dest_qp_num=0x900 + i, rq_psn=0, path_mtu=1024, dgid=env.pair.b.ipv4,
                         max_dest_rd_atomic=16, profile="native", native_params=agreed[1])
            if i < limit:
                qp.modify(rtr)
            else:
                with pytest.raises(C.LimitExceeded, match="max_native_qps_per_client"):
                    qp.modify(rtr)
        # the other client still gets native QPs
        pd2, cq2 = c2.alloc_pd(), c2.create_cq(16)
        qp2 = c2.create_qp(pd2, cq2, cq2, QPCap(max_send_wr=4, max_recv_wr=4))
        qp2.modify(QPAttr(qp_state=QPState.INIT))
        qp2.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=0x9FF, rq_psn=0, path_mtu=1024, dgid=env.pair.b.ipv4,
                          max_dest_rd_atomic=16, profile="native", native_params=agreed[1]))
    finally:
        c1.close(), c2.close()
    _transfer_works(env)


# ================================================================================ N1: a path that never resolves
SILENT = "10.77.0.222"      # in host A's connected subnet; nothing answers ARP for it


def test_a_path_that_never_resolves_stalls_only_its_client(env):
    """Before: modify_qp to RTR resolved the peer's MAC on the daemon's one serving thread, waiting up to 2 s for
    an address that never answers ARP, and every other client's request (and new connection) waited behind it,
    as often as one tenant liked.  Now the wait costs that client only: another client's requests, an RTR
    towards a reachable peer among them, are answered while the first is still waiting, which then gets its
    typed error."""
    import threading

    from metaroce_xdp.daemon import client as C
    from metaroce_xdp.verbs_types import QPAttr, QPCap, QPState, VerbsError
    ns_a, _ = env.hosts["A"]
    path, ifname = env.sock("A"), env.pair.a.ifname
    slow, quick = C.connect(path, ifname), C.connect(path, ifname)
    try:
        qps = []
        for ctx in (slow, quick):
            pd, cq = ctx.alloc_pd(), ctx.create_cq(16)
            qp = ctx.create_qp(pd, cq, cq, QPCap(max_send_wr=4, max_recv_wr=4))
            qp.modify(QPAttr(qp_state=QPState.INIT))
            qps.append(qp)
        got: list = []

        def to_silent() -> None:
            try:
                qps[0].modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=0x1234, rq_psn=0, path_mtu=1024,
                                     dgid=SILENT))
                got.append("RTR")
            except Exception as e:          # noqa: BLE001 - checked below
                got.append(e)
        t = threading.Thread(target=to_silent)
        t.start()
        # the daemon is resolving: the kernel holds an entry for SILENT (INCOMPLETE, then FAILED)
        _wait_for(lambda: SILENT in env.topo.run(ns_a, ["ip", "neigh", "show", "to", SILENT]).stdout, 5,
                  "the daemon probing the silent address")
        assert t.is_alive()
        # meanwhile the other client: a PD, a query, a status, a new connection, an RTR to a reachable peer
        quick.alloc_pd()
        assert qps[1].query_state() == QPState.INIT
        C.status(path)
        C.connect(path, ifname).close()
        qps[1].modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=0x1235, rq_psn=0, path_mtu=1024,
                             dgid=env.pair.b.ipv4))
        assert t.is_alive(), got            # all of it answered while the first client still waits
        t.join(30)
        assert len(got) == 1 and isinstance(got[0], VerbsError), got
        assert "could not resolve the MAC" in str(got[0])
        assert qps[0].query_state() == QPState.INIT
        slow.alloc_pd()                     # and that client goes on
    finally:
        slow.close(), quick.close()


# ================================================================================ N2: a client that does not read
def _fill_outbox(path: str, sock: socket.socket, who) -> int:
    """Send requests on sock and read no reply until the daemon holds replies for it (its socket full: the
    client `who(status client)` has an outbox); returns how many requests were sent."""
    from metaroce_xdp.daemon import client as C
    sent, timeout = 0, sock.gettimeout()
    sock.setblocking(False)
    try:
        while True:
            try:
                while True:
                    sock.send(b'{"op": "nosuch", "id": %d}' % sent)
                    sent += 1
            except BlockingIOError:
                pass
            if any(c.get("outbox", 0) > 0 for c in C.status(path)["clients"] if who(c)):
                return sent
            assert sent < 100_000, "the daemon never held a reply back"
            time.sleep(0.01)
    finally:
        sock.settimeout(timeout)


def test_a_client_that_does_not_read_its_socket_costs_itself_only(env):
    """Before: the serving thread sent with a 0.5 s timeout; a client whose socket was full (it sends requests
    and reads no reply) held every other client's requests and connections for 0.5 s, then was dropped, and
    could reconnect and do it again.  Now what its socket does not take waits in its outbox, its requests are
    not read meanwhile, the others are served, and it gets every reply, in order, once it reads."""
    from metaroce_xdp.daemon import client as C, proto
    path = env.sock("A")
    s = _raw(path)
    assert _ask(s, b'{"op": "hello", "id": 1}')["ok"]
    sent = _fill_outbox(path, s, lambda c: c["pid"] == os.getpid() and c["dev"] is None)
    other = C.connect(path, env.pair.a.ifname)          # meanwhile another client connects and works
    other.alloc_pd(), other.create_cq(16)
    other.close()
    mine = [c for c in C.status(path)["clients"] if c["pid"] == os.getpid() and c["dev"] is None]
    assert any(c["outbox"] > 0 for c in mine), mine     # still connected, still owed its replies
    s.settimeout(10)
    for i in range(sent):                                # then it reads: every reply, in order
        msg, fds, problem = proto.recv(s, proto.MAX_REPLY)
        assert problem is None and msg["id"] == i and msg["error"] == "MalformedRequest", (i, msg)
    assert _ask(s, b'{"op": "hello", "id": 7}')["ok"]
    s.close()


# ================================================================================ finding 10: events
def test_events_beyond_the_per_client_limit_are_counted_and_told(env):
    """The daemon keeps at most MAX_PENDING_EVENTS messages for a client that does not read (1024; 8 for this
    module's daemons); events beyond are counted (events_lost) and the client told once it reads (EVENTS_LOST).
    Here for real: a client fills its socket (requests, no reply read), then 24 of its QPs go to ERR (a bad
    SQ tail in each shared ring, as a client bypassing the library writes): 24 QP_FATALs for the 7 places
    beside the reply its outbox holds."""
    from metaroce_xdp import shm
    from metaroce_xdp.daemon import client as C, proto
    from metaroce_xdp.verbs_types import QPCap, QPState
    path = env.sock("A")
    ctx = C.connect(path, env.pair.a.ifname)
    try:
        pd, cq = ctx.alloc_pd(), ctx.create_cq(16)
        qps = [ctx.create_qp(pd, cq, cq, QPCap(max_send_wr=1, max_recv_wr=1)) for _ in range(24)]
        lost0 = env.status("A")["daemon"]["events_lost"]
        mine = lambda c: c["pid"] == os.getpid() and c["qps"] == 24        # noqa: E731
        sent = _fill_outbox(path, ctx.sock, mine)
        for qp in qps:
            qp.W[shm.QH_SQ_TAIL] = -1       # n < 0: BAD_SQ_TAIL, the QP to ERR, one QP_FATAL each
        _wait_for(lambda: all(qp.state == QPState.ERR for qp in qps), 10, "the QPs to ERR")
        _wait_for(lambda: next(c for c in C.status(path)["clients"] if mine(c))["events_lost"] > 0, 10,
                  "events lost")
        ctx.sock.settimeout(10)
        replies, fatal, told = 0, 0, None
        while told is None:                 # now it reads
            msg, _, problem = proto.recv(ctx.sock, proto.MAX_REPLY)
            assert problem is None and msg is not None
            if msg.get("event") == "QP_FATAL":
                fatal += 1
            elif msg.get("event") == "EVENTS_LOST":
                told = msg["count"]
            else:
                assert msg["id"] == replies and msg["error"] == "MalformedRequest", msg
                replies += 1
        assert fatal + told == 24 and told >= 24 - (MAX_PENDING_EVENTS - 1), (fatal, told)
        while replies < sent:               # the replies held back come first; the rest follow
            msg, _, _ = proto.recv(ctx.sock, proto.MAX_REPLY)
            assert "event" not in msg and msg["id"] == replies, msg
            replies += 1
        ctx.sock.settimeout(None)
        st = env.status("A")
        assert st["daemon"]["events_lost"] == lost0 + told
        assert next(c for c in st["clients"] if mine(c))["events_lost"] == told
        ctx.alloc_pd()                      # the client goes on
    finally:
        ctx.close()
