"""The compiled data plane against its oracle, the Python engine (metaroce_xdp.rc): the same seeded work
request sequence runs on each, between the same two namespaces through the same switch, with seeded
loss, duplication and reordering on both switch ports; the completions on both
sides (wr_id, status, opcode, byte_len, imm) and the target memory must be the same."""
from __future__ import annotations

import os

import numpy as np
import pytest

from dp_players import collect, make_switched
from metaroce_xdp.dp import Context as DpContext
from metaroce_xdp.faults import FaultInjector
from metaroce_xdp.rc.engine import Context as PyContext
from metaroce_xdp.topo import switched_hosts
from metaroce_xdp.verbs_types import RecvWR, SendFlags, SendWR, WROpcode

pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces, XDP and AF_XDP")]

OPS = (WROpcode.RDMA_WRITE, WROpcode.RDMA_WRITE_WITH_IMM, WROpcode.SEND, WROpcode.SEND_WITH_IMM, WROpcode.RDMA_READ)
SIZES = (0, 1, 8, 1023, 1024, 1025, 4096, 20_000, 65_536)
N = 40


def plan(seed):
    """(op, size, signaled, imm) for each WR; the last one names a bad rkey (REM_ACCESS_ERR, then flush)."""
    rng = np.random.default_rng(seed)
    wrs = []
    for i in range(N):
        op = OPS[int(rng.integers(len(OPS)))]
        n = int(rng.choice(SIZES))
        if op == WROpcode.RDMA_READ and n == 0:
            n = 1
        signaled = bool(rng.integers(4)) or op in (WROpcode.SEND, WROpcode.SEND_WITH_IMM)
        wrs.append((op, n, signaled, int(rng.integers(1 << 32))))
    return wrs


def run(topo, ctx_cls, seed, faults):
    _, a, b = make_switched(topo=topo, ctx_cls=ctx_cls, size=1 << 23)
    try:
        a.new_qp(), b.new_qp()
        a.connect(b, timeout=12), b.connect(a, timeout=12)
        a.buf[:] = np.random.default_rng(seed).integers(0, 256, a.buf.size, dtype=np.uint8)
        b.buf[:] = np.random.default_rng(seed + 1).integers(0, 256, b.buf.size, dtype=np.uint8)
        wrs, recvs = [], 0
        for i, (op, n, signaled, imm) in enumerate(plan(seed)):
            src, dst = i * 70_000, 4_000_000 + i * 70_000
            if op in (WROpcode.SEND, WROpcode.SEND_WITH_IMM, WROpcode.RDMA_WRITE_WITH_IMM):
                b.qp.post_recv(RecvWR(wr_id=1000 + i, sg_list=[b.sge(dst, 70_000)] if op != WROpcode.RDMA_WRITE_WITH_IMM
                                      else []))
                recvs += 1
            wrs.append(SendWR(wr_id=i, opcode=op, sg_list=[a.sge(src, n)] if n else [],
                              send_flags=SendFlags.SIGNALED if signaled else SendFlags(0),
                              remote_addr=b.mr.addr + dst, rkey=b.mr.rkey, imm_data=imm))
        wrs.append(SendWR(wr_id=N, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 100)], remote_addr=b.mr.addr,
                          rkey=b.mr.rkey ^ 0x80))
        wrs.append(SendWR(wr_id=N + 1, opcode=WROpcode.SEND, sg_list=[a.sge(0, 10)]))
        expect_a = sum(1 for w in wrs if w.send_flags & SendFlags.SIGNALED) + 0
        knobs = dict(drop_ppm=10_000, dup_ppm=10_000, reorder_ppm=10_000, reorder_delay_us=500) if faults else {}
        fis = [FaultInjector(p, netns=topo[1], seed=seed + k, **knobs) for k, p in enumerate(("swA", "swB"))] \
            if faults else []
        try:
            a.qp.post_send(wrs)
            got_a = collect(a, expect_a, [b], timeout=60)
            got_b = collect(b, recvs, [a], timeout=20)
        finally:
            for f in fis:
                f.close()
        key = lambda w: (w.wr_id, int(w.status), int(w.opcode), w.byte_len if not int(w.status) else 0,  # noqa: E731
                         w.imm_data)
        return [key(w) for w in got_a], [key(w) for w in got_b], a.buf.copy(), b.buf.copy()
    finally:
        a.close()
        b.close()


def test_same_completions_and_memory_as_the_python_engine():
    """Under seeded loss, duplication and reordering (the clean path is what most of it sees anyway)."""
    faults = True
    topo, _, _ = switched_hosts()
    try:
        seed = 21
        ref = run(topo, PyContext, seed, faults)
        got = run(topo, DpContext, seed, faults)
    finally:
        topo.close()
    assert got[0] == ref[0]                     # requester completions, field for field
    assert got[1] == ref[1]                     # receive completions
    assert ref[0][-2][1] == 10 and ref[0][-1][1] == 5     # the bad key: REM_ACCESS_ERR, then WR_FLUSH_ERR
    assert (got[2] == ref[2]).all()             # READ targets
    assert (got[3] == ref[3]).all()             # WRITE / SEND targets
