"""The agent's cm_connect (spec 9.4.2, 6.5.1, MRC1 format): the active side of the connection set-up
through metaroce_xdp/cm.py, which the conformance case TC-SEC-020-a uses to see the IUT's starting PSNs.
The test plays the passive side on a local TCP socket with the reference CM codec."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from metaroce_xdp import cm
from metaroce_xdp.agent import AgentError
from test_agent import A_IP, FULL, Side, iuts, planes, server_ns  # noqa: F401 - pytest fixtures

pytestmark = [pytest.mark.timeout(120), pytest.mark.netns]


@pytest.fixture(scope="module")
def _plane():
    """test_agent's two planes, each agent serving in its plane's namespace: connection set-up runs over
    TCP between the RoCE addresses, so a REQ's GID is its TCP source address (MR-SEC-019)."""
    yield from planes(in_ns=True)


def _listen(side):
    """A TCP listener on loopback in the namespace of side's agent (where its cm_connect runs)."""
    with server_ns(side.server):
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(10)
    return srv


def _connect_in_thread(side, port, out):
    def run():
        try:
            out["result"] = side.c.call("cm_connect", qp=side.qp, host="127.0.0.1", port=port, format="mrc1",
                                        caps=0, flags=cm.FLAG_COMPAT_OK, timeout_ms=5000)
        except AgentError as e:
            out["error"] = e.code
    th = threading.Thread(target=run)
    th.start()
    return th


def _from(side, make):
    """make() in the namespace of side's agent: a connection to A's RoCE address from side's."""
    with server_ns(side.server):
        return make()


def _init(side):
    side.c.call("modify_qp", qp=side.qp, state="INIT", attrs={"access": FULL, "pkey": 0xFFFF})


def test_cm_connect_rejected_leaves_the_qp_in_err(iuts):  # noqa: F811
    srv_a, ctx_a, _, _ = iuts
    a = Side(srv_a, ctx_a).setup()
    _init(a)
    psns = []
    with _listen(a) as srv:
        for _ in range(3):
            out: dict = {}
            th = _connect_in_thread(a, srv.getsockname()[1], out)
            conn, _ = srv.accept()
            with cm.Channel(conn, "agent") as ch:
                req = cm.read_msg(ch)
                assert req.msg_type == cm.MsgType.REQ and req.qpn == a.qpn
                psns.append(req.psn)
                cm.reject(ch, req.cookie, cm.Reason.CONSUMER_REJECT, "test")
            th.join(10)
            assert out.get("error") == "EACCES"
            assert a.c.call("query_qp", qp=a.qp)["state"] == "ERR"                 # 6.5.1, MR-CM-030
            a.c.call("modify_qp", qp=a.qp, state="RESET", attrs={})                  # a retry starts in INIT
            _init(a)
    assert len(set(psns)) == 3 and all(0 <= p < 1 << 24 for p in psns)          # MR-CM-007


def test_cm_connect_completes_the_exchange(iuts):  # noqa: F811
    srv_a, ctx_a, srv_b, ctx_b = iuts
    a, b = Side(srv_a, ctx_a).setup(), Side(srv_b, ctx_b).setup()
    _init(a)
    out: dict = {}
    with _listen(a) as srv:
        th = _connect_in_thread(a, srv.getsockname()[1], out)
        conn, _ = srv.accept()
        with cm.Channel(conn, "agent") as ch:
            def make_rep(req):
                return cm.CMMsg(cm.MsgType.REP, qpn=b.qpn, psn=0x4242, gid=cm.ip_to_gid(ctx_b.local_ip),
                                mac=cm.mac_bytes(ctx_b.local_mac), path_mtu=req.path_mtu)
            req, rep = cm.passive_exchange(ch, 0, make_rep)
        th.join(10)
    assert "error" not in out, out
    r = out["result"]
    assert r["peer"]["qpn"] == b.qpn and r["peer"]["psn"] == 0x4242 and r["profile"] == "compat"
    q = a.c.call("query_qp", qp=a.qp)
    assert q["state"] == "RTS" and q["attrs"]["dest_qpn"] == b.qpn and q["attrs"]["rq_psn"] == 0x4242
    assert q["attrs"]["sq_psn"] == req.psn


# ---- cm_listen / cm_wait: the passive side (MR-SEC-017, MR-SEC-018, MR-SEC-019) ----------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _req(b, ctx_b, gid_ip=None):
    return cm.CMMsg(cm.MsgType.REQ, cookie=cm.new_cookie(), qpn=b.qpn, psn=0x1234,
                    gid=cm.ip_to_gid(gid_ip or ctx_b.local_ip), mac=cm.mac_bytes(ctx_b.local_mac))


def test_cm_listen_bounds_set_ups_per_source(iuts):  # noqa: F811
    srv_a, ctx_a, srv_b, ctx_b = iuts
    a, b = Side(srv_a, ctx_a).setup(), Side(srv_b, ctx_b)
    _init(a)
    port = _free_port()
    a.c.call("cm_listen", qp=a.qp, port=port, format="mrc1")
    held = [_from(b, lambda: socket.create_connection((A_IP, port), timeout=2)) for _ in range(8)]
    try:
        ninth = _from(b, lambda: socket.create_connection((A_IP, port), timeout=2))
        assert ninth.recv(16) == b""                     # closed at once, nothing read
        ninth.close()
        for s in held:
            s.settimeout(0.1)
            with pytest.raises(socket.timeout):           # still open, waiting for a REQ
                s.recv(16)
        assert a.c.call("query_qp", qp=a.qp)["state"] == "INIT"
        assert a.c.call("get_counters")["counters"]["cm_drop_setup_limit"] >= 1
    finally:
        for s in held:
            s.close()


def test_cm_listen_checks_before_the_qp_and_releases_abandoned_exchanges(iuts):  # noqa: F811
    srv_a, ctx_a, srv_b, ctx_b = iuts
    a, b = Side(srv_a, ctx_a).setup(), Side(srv_b, ctx_b).setup()
    _init(a)
    port = _free_port()
    a.c.call("cm_listen", qp=a.qp, port=port, format="mrc1", check_address=True)
    with _from(b, lambda: cm.connect(A_IP, port)) as ch:                     # GID of another address: REJ
        with pytest.raises(cm.Rejected) as e:
            cm.active_exchange(ch, _req(b, ctx_b, "10.9.9.9"), lambda rep: None)
        assert e.value.reason == cm.Reason.ADDRESS_MISMATCH and e.value.by_peer
    assert a.c.call("query_qp", qp=a.qp)["state"] == "INIT"
    with _from(b, lambda: cm.connect(A_IP, port)) as ch:                     # REP, then the TCP connection closes
        ch.send(_req(b, ctx_b).encode())
        rep = cm.read_msg(ch)
        assert rep.msg_type == cm.MsgType.REP and rep.qpn == a.qpn
    deadline = time.monotonic() + 5
    while a.c.call("query_qp", qp=a.qp)["state"] != "INIT" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert a.c.call("query_qp", qp=a.qp)["state"] == "INIT"        # released (MR-SEC-018)
    with _from(b, lambda: cm.connect(A_IP, port)) as ch:
        rep = cm.active_exchange(ch, _req(b, ctx_b), lambda rep: None)
    r = a.c.call("cm_wait", qp=a.qp, timeout_ms=5000)
    assert r["peer"]["qpn"] == b.qpn and r["peer"]["psn"] == 0x1234
    q = a.c.call("query_qp", qp=a.qp)
    assert q["state"] == "RTS" and q["attrs"]["sq_psn"] == rep.psn and q["attrs"]["rq_psn"] == 0x1234
