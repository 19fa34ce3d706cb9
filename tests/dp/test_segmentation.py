"""Segmentation on the wire (MR-RC-002, MR-RC-003, MR-BTH-004, MR-XH-001, MR-XH-014): the request frames
the compiled plane sends, captured on the switch port towards B (dp_loop at link MTU 9000), for WRITEs,
WRITE WITH IMMEDIATE, SENDs and SEND WITH IMMEDIATE of sizes around the path MTU, at path MTU 256, 1024
and 4096 (multi-buffer frames): per message FIRST / MIDDLE* / LAST or ONLY, full-MTU payloads but the
last, consecutive PSNs, RETH (target, R_Key, whole length) on the first packet only, ImmDt on the last,
SE on the last packet of a solicited SEND only, the payloads the source bytes, every ICRC valid; and
the target memory what the operations must leave.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from dp_players import wait_wcs
from metaroce_xdp.verbs_types import RecvWR, SendFlags, SendWR, WCStatus, WROpcode
from metaroce_xdp.wire import Op, decode
from wire_players import PortTap, is_roce_v4

# dp_loop's switched fabric (tests/conftest.py) with links at MTU 9000: path MTU 4096 needs more than 1500
pytestmark = [pytest.mark.netns, pytest.mark.fabric(mtu=9000)]

PSN = 100


def _expected(wr: SendWR, mtu: int):
    """(opcode, payload length) of each packet of `wr`'s message."""
    n = sum(s.length for s in wr.sg_list)
    npk = max(1, -(-n // mtu))
    write = wr.opcode in (WROpcode.RDMA_WRITE, WROpcode.RDMA_WRITE_WITH_IMM)
    imm = wr.opcode in (WROpcode.RDMA_WRITE_WITH_IMM, WROpcode.SEND_WITH_IMM)
    if write:
        first, mid, last, only = Op.RDMA_WRITE_FIRST, Op.RDMA_WRITE_MIDDLE, Op.RDMA_WRITE_LAST, Op.RDMA_WRITE_ONLY
        if imm:
            last, only = Op.RDMA_WRITE_LAST_WITH_IMMEDIATE, Op.RDMA_WRITE_ONLY_WITH_IMMEDIATE
    else:
        first, mid, last, only = Op.SEND_FIRST, Op.SEND_MIDDLE, Op.SEND_LAST, Op.SEND_ONLY
        if imm:
            last, only = Op.SEND_LAST_WITH_IMMEDIATE, Op.SEND_ONLY_WITH_IMMEDIATE
    if npk == 1:
        return [(only, n)]
    return [(first, mtu)] + [(mid, mtu)] * (npk - 2) + [(last, n - (npk - 1) * mtu)]


@pytest.mark.parametrize("mtu", [256, 1024, 4096])
def test_segmentation_on_the_wire(dp_loop, mtu):
    a, b = dp_loop(mtu=mtu, timeout=14)               # 67 ms: no local ACK timeout on a loaded host
    topo = a.topo
    tap = PortTap(topo, topo[1], "swB")                 # what A sends towards B
    try:
        a.buf[:] = np.arange(a.buf.size, dtype=np.uint64).astype(np.uint8)
        b.buf[:] = 0
        b.qp.post_recv([RecvWR(wr_id=i, sg_list=[b.sge(700_000, 100_000)]) for i in range(4)])
        wrs = [
            SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(3, 70_001)], remote_addr=b.mr.addr + 5,
                   rkey=b.mr.rkey),
            SendWR(wr_id=2, opcode=WROpcode.RDMA_WRITE_WITH_IMM, sg_list=[a.sge(0, 5000)],
                   remote_addr=b.mr.addr + 100_000, rkey=b.mr.rkey, imm_data=0xABCD),
            SendWR(wr_id=3, opcode=WROpcode.SEND, sg_list=[a.sge(11, 9999)],
                   send_flags=SendFlags.SIGNALED | SendFlags.SOLICITED),
            SendWR(wr_id=4, opcode=WROpcode.SEND_WITH_IMM, sg_list=[a.sge(0, 0)], imm_data=7),
            SendWR(wr_id=5, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, mtu)], remote_addr=b.mr.addr + 200_000,
                   rkey=b.mr.rkey),
            SendWR(wr_id=6, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 0)], remote_addr=b.mr.addr,
                   rkey=b.mr.rkey),
        ]
        a.qp.post_send(wrs)
        wcs = wait_wcs([a, b], a, len(wrs))
        rwcs = wait_wcs([a, b], b, 3)
        time.sleep(0.05)
        frames = [f for f, towards_b in tap.raw(is_roce_v4) if towards_b]
    finally:
        tap.close()
    assert [(w.wr_id, w.status) for w in wcs] == [(i, WCStatus.SUCCESS) for i in range(1, 7)]
    assert [(w.wr_id, w.byte_len, w.imm_data) for w in rwcs] == [(0, 5000, 0xABCD), (1, 9999, None), (2, 0, 7)]
    pkts = [decode(f) for f in frames]
    pkts = [p for p in pkts if p.bth.dest_qp == b.qp.qp_num]
    assert all(p.icrc_ok for p in pkts)
    first: dict[int, object] = {}                        # a retransmission (spurious, on a loaded host)
    for p in pkts:                                       # repeats the original packet
        o = first.setdefault(p.bth.psn, p)
        assert (o.bth.opcode, o.bth.se, o.ext, o.payload) == (p.bth.opcode, p.bth.se, p.ext, p.payload)
    pkts = [first[k] for k in sorted(first)]
    psn = PSN
    for wr in wrs:
        want = _expected(wr, mtu)
        got, pkts = pkts[:len(want)], pkts[len(want):]
        assert [(p.bth.opcode, len(p.payload)) for p in got] == want, wr.wr_id
        assert [p.bth.psn for p in got] == list(range(psn, psn + len(want)))          # consecutive
        psn += len(want)
        src = a.buf[wr.sg_list[0].addr - a.mr.addr:][:wr.sg_list[0].length]
        assert b"".join(p.payload for p in got) == bytes(src)
        for k, p in enumerate(got):
            if wr.opcode in (WROpcode.RDMA_WRITE, WROpcode.RDMA_WRITE_WITH_IMM) and k == 0:
                r = p.ext["reth"]
                assert (r.va, r.rkey, r.dma_len) == (wr.remote_addr, wr.rkey, wr.sg_list[0].length)
            else:
                assert "reth" not in p.ext
            last = k == len(got) - 1
            assert ("immdt" in p.ext) == (last and wr.imm_data is not None and wr.opcode in (
                WROpcode.RDMA_WRITE_WITH_IMM, WROpcode.SEND_WITH_IMM))
            if "immdt" in p.ext:
                assert p.ext["immdt"].imm == wr.imm_data
            assert p.bth.se == int(last and bool(wr.send_flags & SendFlags.SOLICITED))
    assert pkts == []
    # the target memory
    expect = np.zeros_like(b.buf)
    expect[5:5 + 70_001] = a.buf[3:3 + 70_001]
    expect[100_000:105_000] = a.buf[:5000]
    expect[700_000:700_000 + 9999] = a.buf[11:11 + 9999]
    expect[200_000:200_000 + mtu] = a.buf[:mtu]
    assert np.array_equal(b.buf, expect)
