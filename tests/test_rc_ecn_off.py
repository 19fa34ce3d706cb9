"""MR-ECN-011: a QP created while ECN is off (Engine.ecn False, the agent's set_param ecn 0) sends Not-ECT
frames and answers no CE mark with a CNP; a QP created with ECN on sends ECT(0)."""
from metaroce_xdp.rc.qp import QP
from rc_players import loop_pair


def test_template_ecn_bits_follow_the_qp():
    a, _ = loop_pair()
    eng = a.ctx.engine
    assert a.qp.ecn is True
    on = eng.build_template(a.qp, "02:00:00:00:00:01")
    assert on.buf[on.l3_off + 1] & 3 == 2                       # ECT(0)
    a.qp.ecn = False
    off = eng.build_template(a.qp, "02:00:00:00:00:01")
    assert off.buf[off.l3_off + 1] & 3 == 0                     # Not-ECT
    assert off.buf[off.l3_off + 1] >> 2 == on.buf[on.l3_off + 1] >> 2   # DSCP unchanged


def test_engine_setting_is_taken_at_qp_creation():
    a, _ = loop_pair()
    a.ctx.engine.ecn = False
    qp = a.ctx.create_qp(a.pd, a.cq, a.cq, a.qp.cap)
    assert isinstance(qp, QP) and qp.ecn is False and a.qp.ecn is True
