"""Every operation and size class between two compiled-plane endpoints (dp_loop: two namespaces through a
switch namespace, real XDP and AF_XDP; veths at MTU 9000 so that path MTU 4096 fits).

MR-RC segmentation (MR-RC-002, MR-RC-003), completion order (MR-RC-020),
MR-ATOM semantics (MR-ATOM-001): the right bytes arrive (checksums over whole buffers) and completions come in WR order
with the right status, opcode and length.  FETCH_ADD / COMPARE_SWAP results and scatter/gather lists are
tests/dp/test_dp_ops.py's test_fetch_add_and_compare_swap and test_scatter_gather_lists.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from dp_players import wait_wcs
from metaroce_xdp.verbs_types import RecvWR, SendFlags, SendWR, WCFlags, WCOpcode, WCStatus, WROpcode

# dp_loop's switched fabric (tests/conftest.py) with links at MTU 9000: path MTU 4096 needs more than 1500
pytestmark = [pytest.mark.netns, pytest.mark.fabric(mtu=9000)]

SIZES = [0, 1, 3, 255, 256, 1023, 1024, 1025, 4096, 65536, 300_001]


@pytest.mark.parametrize("mtu", [256, 1024, 4096])
@pytest.mark.parametrize("size", SIZES)
def test_write_sizes(dp_loop, mtu, size):
    """MR-RC-002, MR-RC-011, MR-RC-018, MR-MEM-028: every size lands at [va, va + len), nothing outside."""
    a, b = dp_loop(mtu=mtu)
    a.fill(size)
    a.qp.post_send(SendWR(wr_id=7, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(10, size)],
                          remote_addr=b.mr.addr + 20, rkey=b.mr.rkey))
    (wc,) = wait_wcs([a, b], a, 1)
    assert (wc.wr_id, wc.status, wc.opcode, wc.byte_len) == (7, WCStatus.SUCCESS, WCOpcode.RDMA_WRITE, size)
    assert zlib.crc32(b.buf[20:20 + size]) == zlib.crc32(a.buf[10:10 + size])
    assert not b.buf[:20].any() and not b.buf[20 + size:].any()      # nothing outside the target


@pytest.mark.parametrize("mtu", [256, 4096])
@pytest.mark.parametrize("size", SIZES)
def test_read_sizes(dp_loop, mtu, size):
    """MR-RC-004, MR-RC-021, MR-QP-034: READ responses place every byte; byte_len is the bytes read."""
    a, b = dp_loop(mtu=mtu)
    b.fill(size + 1)
    a.qp.post_send(SendWR(wr_id=8, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(0, size)],
                          remote_addr=b.mr.addr + 5, rkey=b.mr.rkey))
    (wc,) = wait_wcs([a, b], a, 1)
    assert (wc.status, wc.opcode, wc.byte_len) == (WCStatus.SUCCESS, WCOpcode.RDMA_READ, size)
    assert bytes(a.buf[:size]) == bytes(b.buf[5:5 + size])


@pytest.mark.parametrize("size", [0, 1, 1024, 5000, 100_000])
@pytest.mark.parametrize("imm", [False, True])
def test_send_recv(dp_loop, size, imm):
    """MR-RC-019, MR-XH-014, MR-MEM-031: SEND (zero length too) completes the receive WQE with byte_len, imm."""
    a, b = dp_loop()
    a.fill(3)
    b.qp.post_recv(RecvWR(wr_id=99, sg_list=[b.sge(0, 200_000)]))
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND_WITH_IMM if imm else WROpcode.SEND,
                          sg_list=[a.sge(0, size)], imm_data=0xDEADBEEF, send_flags=SendFlags.SIGNALED | SendFlags.SOLICITED))
    (rwc,) = wait_wcs([a, b], b, 1)
    (swc,) = wait_wcs([a, b], a, 1)
    assert swc.status == WCStatus.SUCCESS and swc.opcode == WCOpcode.SEND
    assert (rwc.wr_id, rwc.status, rwc.opcode, rwc.byte_len) == (99, WCStatus.SUCCESS, WCOpcode.RECV, size)
    assert rwc.imm_data == (0xDEADBEEF if imm else None)
    assert bool(rwc.wc_flags & WCFlags.WITH_IMM) == imm
    assert bytes(b.buf[:size]) == bytes(a.buf[:size])


def test_write_with_imm_consumes_a_receive(dp_loop):
    """MR-OPC-008, MR-RC-019: WRITE WITH IMMEDIATE consumes a receive WQE (one without SGEs is fine)."""
    a, b = dp_loop()
    a.fill(4)
    b.qp.post_recv(RecvWR(wr_id=5, sg_list=[]))
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE_WITH_IMM, sg_list=[a.sge(0, 3000)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey, imm_data=0x1234))
    (rwc,) = wait_wcs([a, b], b, 1)
    assert rwc.opcode == WCOpcode.RECV_RDMA_WITH_IMM and rwc.imm_data == 0x1234 and rwc.wr_id == 5
    assert bytes(b.buf[:3000]) == bytes(a.buf[:3000])


def test_mixed_stream_completes_in_order(dp_loop):
    """MR-RC-006, MR-RC-009, MR-RC-020, MR-ACK-006: a mixed stream completes in posting order."""
    a, b = dp_loop(mtu=512)
    a.fill(6)
    b.fill(7)
    b.buf[900_000:900_008] = 0
    for i in range(20):
        b.qp.post_recv(RecvWR(wr_id=1000 + i, sg_list=[b.sge(500_000 + i * 2000, 2000)]))
    wrs = []
    for i in range(60):
        kind = i % 4
        if kind == 0:
            wrs.append(SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(i * 1000, 1000 + i)],
                              remote_addr=b.mr.addr + i * 3000, rkey=b.mr.rkey))
        elif kind == 1:
            wrs.append(SendWR(wr_id=i, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(300_000 + i * 3000, 2500)],
                              remote_addr=b.mr.addr + 800_000 + i, rkey=b.mr.rkey))
        elif kind == 2:
            wrs.append(SendWR(wr_id=i, opcode=WROpcode.SEND, sg_list=[a.sge(i * 7, 1999)]))
        else:
            wrs.append(SendWR(wr_id=i, opcode=WROpcode.ATOMIC_FETCH_AND_ADD, sg_list=[a.sge(600_000 + i * 8, 8)],
                              remote_addr=b.mr.addr + 900_000, rkey=b.mr.rkey, compare_add=1))
    a.qp.post_send(wrs)
    wcs = wait_wcs([a, b], a, 60, timeout=30)
    assert [w.wr_id for w in wcs] == list(range(60))
    assert all(w.status == WCStatus.SUCCESS for w in wcs)
    assert b.buf[900_000:900_008].view(np.uint64)[0] == 15
    for i in range(1, 60, 4):
        assert bytes(a.buf[300_000 + i * 3000:300_000 + i * 3000 + 2500]) == bytes(b.buf[800_000 + i:800_000 + i + 2500])


def test_64mib_write(dp_loop):
    """The issue's upper size class: a 64 MiB message, one WR, at 4 KiB path MTU (MR-RC-002)."""
    n = 64 << 20
    a, b = dp_loop(mtu=4096, size=n)
    a.buf[::4096] = np.arange(n // 4096, dtype=np.uint64).astype(np.uint8)
    a.buf[-1] = 0xAB
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, n)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    (wc,) = wait_wcs([a, b], a, 1, timeout=300)
    assert wc.status == WCStatus.SUCCESS and wc.byte_len == n
    assert zlib.crc32(b.buf) == zlib.crc32(a.buf)
