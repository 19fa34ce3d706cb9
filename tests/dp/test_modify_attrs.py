"""MR-QP-006: IBV_QP_CUR_STATE must equal the QP's state; MR-QP-008: IBV_QP_ALT_PATH is refused in every
transition and IBV_QP_PATH_MIG_STATE is accepted only as MIGRATED.  A refused modify changes nothing.
On the compiled plane (dp_loop pairs)."""
import pytest

from metaroce_xdp.verbs_types import InvalidArgument, QPAttr, QPState

pytestmark = [pytest.mark.netns]


def test_cur_state_alt_path_and_path_mig_state(dp_loop):
    a, _ = dp_loop()
    qp = a.qp
    assert qp.query_state() == QPState.RTS
    bad = [QPAttr(qp_state=QPState.RTS, cur_qp_state=QPState.RTR),
           QPAttr(qp_state=QPState.ERR, cur_qp_state=QPState.INIT),
           QPAttr(qp_state=QPState.RTS, alt_path={"dgid": "10.0.0.9"}),
           QPAttr(qp_state=QPState.RTS, path_mig_state="REARM"),
           QPAttr(qp_state=QPState.RTS, path_mig_state="ARMED")]
    for attr in bad:
        with pytest.raises(InvalidArgument):
            qp.modify(attr)
        assert qp.query_state() == QPState.RTS
    qp.modify(QPAttr(qp_state=QPState.RTS, cur_qp_state=QPState.RTS, path_mig_state="MIGRATED", retry_cnt=3))
    assert qp.query_state() == QPState.RTS and qp.query()["retry_left"] == 3
    qp.modify(QPAttr(qp_state=QPState.ERR, cur_qp_state=QPState.RTS))
    assert qp.query_state() == QPState.ERR
