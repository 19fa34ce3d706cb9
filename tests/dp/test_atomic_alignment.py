"""MR-XH-011: the requester never sends an AtomicETH whose VA is not a multiple of 8; it refuses such a
work request at post (EINVAL), queues nothing and sends nothing.  On the compiled plane (dp_loop pairs)."""
import pytest

from dp_players import wait_wcs
from metaroce_xdp.verbs_types import InvalidArgument, SendWR, WCStatus, WROpcode

pytestmark = [pytest.mark.netns]


@pytest.mark.parametrize("op", [WROpcode.ATOMIC_FETCH_AND_ADD, WROpcode.ATOMIC_CMP_AND_SWP])
def test_misaligned_atomic_is_refused_at_post(dp_loop, op):
    a, b = dp_loop()
    a.ctx.progress()
    tx0 = a.ctx.stats()["tx"]
    for off in (1, 4, 7):
        with pytest.raises(InvalidArgument):
            a.qp.post_send(SendWR(wr_id=off, opcode=op, sg_list=[a.sge(0, 8)], remote_addr=b.mr.addr + off,
                                  rkey=b.mr.rkey, compare_add=1))
    a.ctx.progress()
    assert a.qp.query()["sq_outstanding"] == 0 and a.ctx.stats()["tx"] == tx0
    b.buf[8:16] = 0
    a.qp.post_send(SendWR(wr_id=9, opcode=op, sg_list=[a.sge(0, 8)], remote_addr=b.mr.addr + 8, rkey=b.mr.rkey,
                          compare_add=0, swap=0))
    (wc,) = wait_wcs([a, b], a, 1)
    assert (wc.wr_id, wc.status) == (9, WCStatus.SUCCESS)
