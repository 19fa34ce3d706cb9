"""Native READ and atomics in the compiled data plane (dp/native.py) between two hosts over veth, through
the real XDP program and AF_XDP: NATIVE_READ_REQ / NATIVE_READ_RESP placed at their offset in any order,
lost responses re-requested (MR-OOO-020/021), READs split into request messages of at most W PSNs
(MR-NAT-022), completions in work-request order among WRITEs (MR-SACK-026), atomics executed once in PSN
order and answered with ATOMIC_ACKNOWLEDGE (MR-NAT-006, MR-OOO-023..028), under the seeded fault injector
of the switch namespace."""
from __future__ import annotations

import os

import numpy as np
import pytest

from dp_players import FULL, collect, make_switched, opened
from metaroce_xdp.faults import FaultInjector
from metaroce_xdp.verbs_types import QPAttr, QPState, SendWR, WCOpcode, WCStatus, WROpcode

pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces, XDP and AF_XDP")]


@pytest.fixture(scope="module")
def fabric():
    with opened(make_switched) as f:
        yield f


def _connect(side, peer, psn, params):
    with side.topo.enter(side.ns):
        q = side.qp
        q.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
        q.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=peer.qp.qp_num, rq_psn=psn, path_mtu=1024,
                        dgid=peer.ctx.gid, max_dest_rd_atomic=16, profile="native", native_params=params))
        q.modify(QPAttr(qp_state=QPState.RTS, sq_psn=psn, timeout=12, retry_cnt=7, rnr_retry=7, max_rd_atomic=16))


def _fresh(a, b, psn=0x100, params=None):
    """A native pair; b's buffer (the READ source) random, a's (the READ destination) zero."""
    a.new_qp(), b.new_qp()
    _connect(a, b, psn, params)
    _connect(b, a, psn, params)
    a.buf[:] = 0
    b.buf[:] = np.random.default_rng(psn).integers(0, 256, b.buf.size, dtype=np.uint8)


def _read(a, b, wr_id, dst, src, n):
    return SendWR(wr_id=wr_id, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(dst, n)], remote_addr=b.mr.addr + src,
                  rkey=b.mr.rkey)


def _write(a, b, wr_id, src, dst, n):
    return SendWR(wr_id=wr_id, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(src, n)], remote_addr=b.mr.addr + dst,
                  rkey=b.mr.rkey)


SIZES = [0, 1, 1023, 1024, 1025, 4096, 65_536, 300_001]


def test_native_read_sizes_intact_across_psn_wrap(fabric):
    """MR-NAT-016 (a READ of L bytes takes max(1, ceil(L / pmtu)) PSNs, across 2^24), MR-NAT-021/022
    (a READ longer than the request message limit goes as several messages, each its own MSN),
    MR-OOO-017/018 (responses with NETH, placed at their offset), MR-SACK-026 (in order): READs of 0 B
    to 300 KB complete with the responder's bytes, and the requester counted one response per PSN."""
    topo, a, b = fabric
    _fresh(a, b, psn=0xFFFFC0)
    assert a.qp.query()["profile"] == "native"
    wrs, off = [], 0
    for i, n in enumerate(SIZES):
        wrs.append(_read(a, b, i, off, 1_000_000 + off, n))
        off += n + 100
    a.qp.post_send(wrs)
    got = collect(a, len(wrs), [b], timeout=20)
    assert [(w.wr_id, w.status, w.opcode) for w in got] == [(i, WCStatus.SUCCESS, WCOpcode.RDMA_READ)
                                                             for i in range(len(SIZES))]
    off = 0
    for n in SIZES:
        assert (a.buf[off:off + n] == b.buf[1_000_000 + off:1_000_000 + off + n]).all(), n
        off += n + 100
    na, nb = a.qp.native_counters(), b.qp.native_counters()
    npk = sum(max(1, -(-n // 1024)) for n in SIZES)
    assert na["c_rd_resp_rx"] == npk == nb["c_rd_resp_tx"], (na, nb)
    assert na["c_rd_req"] == len(SIZES) + 2           # 300,001 B = 293 PSNs: three messages of <= 128 (W/2)
    assert na["c_rereq"] == 0 and nb["c_rd_exec"] == na["c_rd_req"]
    assert a.qp.query()["sq_psn"] == (0xFFFFC0 + npk) & 0xFFFFFF
    assert b.ctx.stats()["tx_ack"] == 0


def test_native_atomics_results_and_exactly_once(fabric):
    """MR-NAT-006 (compat atomic opcodes, ATOMIC_ACKNOWLEDGE), MR-OOO-023 (executed in PSN order, once),
    MR-OOO-025 (the original value, in order): FETCH_ADD and COMPARE_SWAP between WRITEs and READs return
    the values a sequential execution gives, the cell ends at the sum, and a READ after them sees it."""
    topo, a, b = fabric
    _fresh(a, b)
    cell = 2_000_000
    b.buf[cell:cell + 8] = np.frombuffer(np.uint64(1000).tobytes(), np.uint8)
    wrs = []
    for i in range(6):
        wrs.append(SendWR(wr_id=i, opcode=WROpcode.ATOMIC_FETCH_AND_ADD, sg_list=[a.sge(8 * i, 8)],
                          remote_addr=b.mr.addr + cell, rkey=b.mr.rkey, compare_add=7))
        wrs.append(_write(a, b, 100 + i, 10_000 + 4096 * i, 3_000_000 + 4096 * i, 4096))
    wrs.append(SendWR(wr_id=50, opcode=WROpcode.ATOMIC_CMP_AND_SWP, sg_list=[a.sge(64, 8)],
                      remote_addr=b.mr.addr + cell, rkey=b.mr.rkey, compare_add=1042, swap=5))
    wrs.append(SendWR(wr_id=51, opcode=WROpcode.ATOMIC_CMP_AND_SWP, sg_list=[a.sge(72, 8)],
                      remote_addr=b.mr.addr + cell, rkey=b.mr.rkey, compare_add=1042, swap=9))
    wrs.append(_read(a, b, 60, 80, cell, 8))
    a.buf[10_000:10_000 + 6 * 4096] = 7
    a.qp.post_send(wrs)
    got = collect(a, len(wrs), [b], timeout=20)
    assert [(w.wr_id, w.status) for w in got] == [(w.wr_id, WCStatus.SUCCESS) for w in wrs]
    vals = a.buf[:80].view(np.uint64)
    assert list(vals[:6]) == [1000 + 7 * i for i in range(6)]
    assert vals[8] == 1042 and vals[9] == 5            # the first CAS swapped, the second found 5
    assert a.buf[80:88].view(np.uint64)[0] == 5 == b.buf[cell:cell + 8].view(np.uint64)[0]
    assert (b.buf[3_000_000:3_000_000 + 6 * 4096] == 7).all()
    na, nb = a.qp.native_counters(), b.qp.native_counters()
    assert nb["c_at_exec"] == 8 and na["c_at_ack_rx"] == 8, (na, nb)
