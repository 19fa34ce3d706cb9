"""The agent-protocol additions the conformance catalogue needs (spec 9.4.2, issue 10):
reg_mr remote_invalidate, post_send SEND_WITH_INV with invalidate_rkey, invalidated_rkey in the
receive completion, caps.params naming the set_param parameters.  Two agents on compiled planes in two
namespaces, as in tests/conformance/test_agent.py (its fixtures)."""
from __future__ import annotations

import pytest

from test_agent import FULL, MR_LEN, Side, _plane, iuts, pair  # noqa: F401 - pytest fixtures

pytestmark = [pytest.mark.timeout(120), pytest.mark.netns]


def test_send_with_invalidate_through_the_agent(pair):  # noqa: F811
    a, b = pair
    inv = b.c.call("reg_mr", pd=b.pd, len=4096, access=FULL, remote_invalidate=True)
    plain = b.c.call("reg_mr", pd=b.pd, len=4096, access=FULL)
    b.c.call("post_recv", qp=b.qp, wr={"wr_id": "0x21", "sg_list": [{"mr": b.mr, "offset": 0, "len": 256}]})
    a.write(0, b"invalidate me")
    a.c.call("post_send", qp=a.qp, wr={"wr_id": "0x11", "opcode": "SEND_WITH_INV", "invalidate_rkey": inv["rkey"],
                                       "sg_list": [{"mr": a.mr, "offset": 0, "len": 13}]})
    (rwc,) = b.poll()
    (swc,) = a.poll()
    assert swc["status"] == "IBV_WC_SUCCESS"
    assert rwc["status"] == "IBV_WC_SUCCESS" and rwc["invalidated_rkey"] == inv["rkey"] and rwc["byte_len"] == 13
    assert b.read(0, 13) == b"invalidate me"
    # the invalidated key no longer grants access (MR-MEM-040): a WRITE with it fails remotely
    a.c.call("post_send", qp=a.qp, wr={"wr_id": "0x12", "opcode": "RDMA_WRITE",
                                       "sg_list": [{"mr": a.mr, "offset": 0, "len": 4}],
                                       "remote": {"va": inv["va"], "rkey": inv["rkey"]}})
    (wc,) = a.poll()
    assert wc["status"] == "IBV_WC_REM_ACCESS_ERR"
    assert plain["rkey"] != inv["rkey"]


def test_reg_mr_remote_invalidate_is_a_bool_and_caps_lists_params(pair):  # noqa: F811
    a, _ = pair
    from metaroce_xdp.agent import AgentError
    with pytest.raises(AgentError) as e:
        a.c.call("reg_mr", pd=a.pd, len=16, access=FULL, remote_invalidate=1)
    assert e.value.code == "EINVAL"
    caps = a.c.call("caps")
    assert "budget" in caps["params"]
    # 9.4.2: the commands the agent implements and its per-QP counters, which the cases check first
    assert {"cm_listen", "cm_connect", "cm_wait", "get_async_events", "post_send"} <= set(caps["commands"])
    assert {"tx_cnp", "rx_cnp", "rx_cnp_discarded"} <= set(caps["qp_counters"])
    # the per-QP receive counters the cases of MR-DUP-010, MR-MEM-019, MR-ACK-015 and MR-SEC-031 read
    assert {"rx_dup_req", "rx_rkey_violation", "rx_ghost_rsp", "rx_stale_rsp", "rx_drop_out_of_seq",
            "rnr_naks_sent"} <= set(caps["qp_counters"])
    assert {"budget", "ecn"} <= set(caps["params"])
    assert MR_LEN == 65536
