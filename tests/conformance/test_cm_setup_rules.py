"""Regression tests for the connection set-up fixes found by the conformance cases of
metaroce_xdp/conformance/cases/cm.py: GID families (MR-CM-018), the REQ's p_key (MR-CM-023), the
passive QP taking its own timers rather than the REQ's (MR-CM-021, MR-CM-022), a failed active
exchange leaving the QP in ERR (MR-CM-030) and no atomics without ATOMICS agreed (MR-CM-019)."""
from __future__ import annotations

import socket
import threading

import pytest

from metaroce_xdp import cm
from metaroce_xdp.agent import AgentError
from test_agent import A_IP, Side, iuts  # noqa: F401 - pytest fixtures
from test_agent_cm_connect import _free_port, _from, _init, _listen, _plane, _req  # noqa: F401

pytestmark = [pytest.mark.timeout(120), pytest.mark.netns]


def test_passive_exchange_rejects_an_ipv6_gid_without_ipv6():
    a, b = socket.socketpair()
    with cm.Channel(a, "active") as act, cm.Channel(b, "passive") as pas:
        req = cm.CMMsg(cm.MsgType.REQ, cookie=5, qpn=0x22, psn=1, gid=cm.ip_to_gid("fd00::42"))
        act.send(req.encode())
        with pytest.raises(cm.Rejected) as e:
            cm.passive_exchange(pas, 0, lambda r: pytest.fail("make_rep called for an invalid REQ"))
        assert e.value.reason == cm.Reason.INVALID_PARAM
        rej = cm.read_msg(act, 2.0)
        assert rej.msg_type == cm.MsgType.REJ and rej.reason == cm.Reason.INVALID_PARAM and rej.cookie == 5


def test_passive_checks_p_key_and_keeps_its_own_timers(iuts):  # noqa: F811
    srv_a, ctx_a, srv_b, ctx_b = iuts
    a, b = Side(srv_a, ctx_a).setup(), Side(srv_b, ctx_b).setup()
    _init(a)
    port = _free_port()
    a.c.call("cm_listen", qp=a.qp, port=port, format="mrc1")
    bad = _req(b, ctx_b)
    bad.p_key = 0x7FFF
    with _from(b, lambda: cm.connect(A_IP, port)) as ch:
        with pytest.raises(cm.Rejected) as e:
            cm.active_exchange(ch, bad, lambda rep: None)
        assert e.value.reason == cm.Reason.INVALID_PARAM and e.value.by_peer
    assert a.c.call("query_qp", qp=a.qp)["state"] == "INIT"
    req = _req(b, ctx_b)
    req.timeout, req.retry_cnt, req.rnr_retry, req.min_rnr_timer, req.max_dest_rd_atomic = 20, 2, 1, 3, 2
    with _from(b, lambda: cm.connect(A_IP, port)) as ch:
        rep = cm.active_exchange(ch, req, lambda rep: None)
    a.c.call("cm_wait", qp=a.qp, timeout_ms=5000)
    at = a.c.call("query_qp", qp=a.qp)["attrs"]
    assert (at["timeout"], at["retry_cnt"], at["rnr_retry"], at["min_rnr_timer"]) == \
        (rep.timeout, rep.retry_cnt, rep.rnr_retry, rep.min_rnr_timer) != (20, 2, 1, 3)
    assert at["max_rd_atomic"] == min(rep.max_rd_atomic, 2)


def test_active_without_atomics_refuses_atomic_wrs(iuts):  # noqa: F811
    srv_a, ctx_a, srv_b, ctx_b = iuts
    a, b = Side(srv_a, ctx_a).setup(), Side(srv_b, ctx_b).setup()
    _init(a)
    out: dict = {}
    with _listen(a) as srv:
        th = threading.Thread(target=lambda: out.update(a.c.call(
            "cm_connect", qp=a.qp, host="127.0.0.1", port=srv.getsockname()[1], format="mrc1", caps=0,
            flags=cm.FLAG_COMPAT_OK, timeout_ms=5000)))
        th.start()
        conn, _ = srv.accept()
        with cm.Channel(conn, "agent") as ch:
            cm.passive_exchange(ch, 0, lambda r: cm.CMMsg(
                cm.MsgType.REP, qpn=b.qpn, psn=7, gid=cm.ip_to_gid(ctx_b.local_ip),
                mac=cm.mac_bytes(ctx_b.local_mac), path_mtu=r.path_mtu))
        th.join(10)
    assert out["agreed_caps"] == 0
    with pytest.raises(AgentError) as e:
        a.c.call("post_send", qp=a.qp, wr={"wr_id": "0x1", "opcode": "ATOMIC_FETCH_AND_ADD",
                                           "sg_list": [{"mr": a.mr, "offset": 0, "len": 8}],
                                           "remote": {"va": "0x1000", "rkey": 1}, "swap_add": "0x1"})
    assert e.value.code == "EINVAL"

