"""The compiled data plane against its oracle, the Python engine (metaroce_xdp.rc): the same seeded work
request sequence runs on each, between the same two namespaces through the same switch, with seeded
loss, duplication and reordering on both switch ports; the completions on both
sides (wr_id, status, opcode, byte_len, imm, WITH_INV and the invalidated key) and the target memory
must be the same.  The extended plan adds ATOMICs (their duplicates under the fault schedule are
answered from the saved result, never executed twice), SEND WITH INVALIDATE, gather/scatter lists of
up to three SGEs and FENCE."""
from __future__ import annotations

import os

import numpy as np
import pytest

from dp_players import collect, make_switched
from metaroce_xdp.dp import Context as DpContext
from metaroce_xdp.faults import FaultInjector
from metaroce_xdp.rc.engine import Context as PyContext
from metaroce_xdp.topo import switched_hosts
from metaroce_xdp.verbs_types import Access, RecvWR, SendFlags, SendWR, WCFlags, WROpcode

pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces, XDP and AF_XDP")]

OPS = (WROpcode.RDMA_WRITE, WROpcode.RDMA_WRITE_WITH_IMM, WROpcode.SEND, WROpcode.SEND_WITH_IMM, WROpcode.RDMA_READ)
SIZES = (0, 1, 8, 1023, 1024, 1025, 4096, 20_000, 65_536)
N = 40
EXT_OPS = OPS + (WROpcode.ATOMIC_FETCH_AND_ADD, WROpcode.ATOMIC_CMP_AND_SWP, WROpcode.SEND_WITH_INV)
ATOMICS = (WROpcode.ATOMIC_FETCH_AND_ADD, WROpcode.ATOMIC_CMP_AND_SWP)
CELLS = 7_000_000          # B's ATOMIC targets: 4 cells of 8 bytes, zeroed
N_INV = 8                  # B's remotely invalidatable MRs


def plan(seed, extended=False):
    """(op, size, signaled, imm, pieces, fence, arg) for each WR; the last one names a bad rkey
    (REM_ACCESS_ERR, then flush).  extended: ATOMICs (arg: the cell and the compare value), SEND WITH
    INVALIDATE, SGE lists (pieces > 1) and FENCE too."""
    rng = np.random.default_rng(seed)
    ops = EXT_OPS if extended else OPS
    wrs = []
    for i in range(N):
        op = ops[int(rng.integers(len(ops)))]
        n = 8 if op in ATOMICS else int(rng.choice(SIZES))
        if op == WROpcode.RDMA_READ and n == 0:
            n = 1
        signaled = bool(rng.integers(4)) or op in (WROpcode.SEND, WROpcode.SEND_WITH_IMM, WROpcode.SEND_WITH_INV)
        pieces = int(rng.integers(1, 4)) if extended and n >= 3 else 1
        fence = extended and not rng.integers(4)
        arg = (int(rng.integers(4)), int(rng.integers(3)))
        wrs.append((op, n, signaled, int(rng.integers(1 << 32)), pieces, fence, arg))
    return wrs


def _sgl(side, off, n, pieces):
    """n bytes from `off` as `pieces` SGEs, 22,000 bytes apart (inside the WR's 70,000-byte window)."""
    if n == 0:
        return []
    if pieces == 1:
        return [side.sge(off, n)]
    cut = [n // pieces] * (pieces - 1)
    cut.append(n - sum(cut))
    return [side.sge(off + j * 22_000, k) for j, k in enumerate(cut)]


def run(topo, ctx_cls, seed, faults, extended=False):
    _, a, b = make_switched(topo=topo, ctx_cls=ctx_cls, size=1 << 23)
    inv = []
    try:
        a.new_qp(), b.new_qp()
        a.connect(b, timeout=12), b.connect(a, timeout=12)
        a.buf[:] = np.random.default_rng(seed).integers(0, 256, a.buf.size, dtype=np.uint8)
        b.buf[:] = np.random.default_rng(seed + 1).integers(0, 256, b.buf.size, dtype=np.uint8)
        b.buf[CELLS:CELLS + 32] = 0
        inv = [b.pd.reg_mr(np.zeros(64, np.uint8), Access.LOCAL_WRITE | Access.REMOTE_WRITE, remote_invalidate=True)
               for _ in range(N_INV)]
        n_inv = 0
        wrs, recvs = [], 0
        for i, (op, n, signaled, imm, pieces, fence, (cell, cmp)) in enumerate(plan(seed, extended)):
            src, dst = i * 70_000, 4_000_000 + i * 70_000
            if op in (WROpcode.SEND, WROpcode.SEND_WITH_IMM, WROpcode.RDMA_WRITE_WITH_IMM, WROpcode.SEND_WITH_INV):
                b.qp.post_recv(RecvWR(wr_id=1000 + i, sg_list=_sgl(b, dst, 70_000 if pieces == 1 else 66_000, pieces)
                                      if op != WROpcode.RDMA_WRITE_WITH_IMM else []))
                recvs += 1
            flags = (SendFlags.SIGNALED if signaled else SendFlags(0)) | (SendFlags.FENCE if fence else SendFlags(0))
            kw = dict(remote_addr=b.mr.addr + dst, rkey=b.mr.rkey, imm_data=imm)
            if op in ATOMICS:
                kw.update(remote_addr=b.mr.addr + CELLS + 8 * cell, compare_add=cmp if op == WROpcode.ATOMIC_CMP_AND_SWP
                          else 1 + cmp, swap=100 + i)
            elif op == WROpcode.SEND_WITH_INV:
                kw.update(invalidate_rkey=inv[n_inv % N_INV].rkey)      # the ninth names an invalidated key
                n_inv += 1
            wrs.append(SendWR(wr_id=i, opcode=op, sg_list=_sgl(a, src, n, pieces), send_flags=flags, **kw))
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
        keys = [m.rkey for m in inv]
        key = lambda w: (w.wr_id, int(w.status), int(w.opcode), w.byte_len if not int(w.status) else 0,  # noqa: E731
                         w.imm_data, bool(w.wc_flags & WCFlags.WITH_INV),
                         keys.index(w.invalidated_rkey) if w.invalidated_rkey is not None else None)
        return [key(w) for w in got_a], [key(w) for w in got_b], a.buf.copy(), b.buf.copy()
    finally:
        for m in inv:
            m.dereg()
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


def test_atomics_invalidate_sge_lists_and_fence_as_the_python_engine():
    """The extended plan under the same fault schedule: every completion field and both memories equal."""
    topo, _, _ = switched_hosts()
    try:
        seed = 33
        ref = run(topo, PyContext, seed, True, extended=True)
        got = run(topo, DpContext, seed, True, extended=True)
    finally:
        topo.close()
    ops = {op for op, *_ in plan(seed, True)}
    assert set(EXT_OPS) <= ops                  # every operation is in the plan
    assert any(p > 1 for _, _, _, _, p, _, _ in plan(seed, True)) and any(f for *_, f, _ in plan(seed, True))
    assert got[0] == ref[0]
    assert got[1] == ref[1]
    assert any(k[5] for k in ref[1])            # a receive completion WITH_INV
    assert (got[2] == ref[2]).all()             # READ targets and ATOMIC originals
    assert (got[3] == ref[3]).all()             # WRITE / SEND targets and ATOMIC cells
