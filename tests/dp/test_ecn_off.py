"""MR-ECN-011: a QP sends ECT(0) while ECN is on, Not-ECT (and answers no CE mark with a CNP) when it is off.
On the compiled plane (dp_loop pairs), the ECN field of every frame a QP sends, read on the switch port."""
from __future__ import annotations

import pytest

from dp_players import wait_wcs
from metaroce_xdp.verbs_types import SendWR, WCStatus, WROpcode
from wire_players import PortTap, is_roce_v4

pytestmark = [pytest.mark.netns]


def test_frames_of_a_qp_with_ecn_on_are_ect0(dp_loop):
    """Every RoCE frame of the WRITE (A's requests) and of B's ACKs carries ECT(0) and the default DSCP 26 (MR-ECN-004): TOS 0x6A."""
    a, b = dp_loop()
    tap = PortTap(a.topo, a.topo[1], "swA")
    try:
        a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 5000)],
                              remote_addr=b.mr.addr, rkey=b.mr.rkey))
        (wc,) = wait_wcs([a, b], a, 1)
        assert wc.status == WCStatus.SUCCESS
        frames = tap.frames(is_roce_v4)
    finally:
        tap.close()
    assert len(frames) >= 6                               # five requests, at least one ACK
    assert {f[15] & 3 for f in frames} == {2}             # IPv4 TOS: ECN bits ECT(0)
    assert {f[15] >> 2 for f in frames} == {26}
