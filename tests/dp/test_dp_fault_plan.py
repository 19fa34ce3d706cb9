"""The compiled data plane under a seeded fault plan, checked against what the work must leave: a seeded
sequence of work requests runs between two namespaces through a switch, with seeded loss, duplication and
reordering on both switch ports, and the completions on both sides (wr_id, status, opcode, byte_len where
the rules define it, immediate data, WITH_INV and the invalidated key) and both memories must be exactly
what the operations, executed once each and in order, leave (MR-RC-019, MR-QP-033/034, MR-MEM-040,
MR-ATOM-*).  The extended plan adds ATOMICs (their duplicates under the fault plan are answered from the
saved result, never executed twice), SEND WITH INVALIDATE, gather/scatter lists of up to three SGEs and
FENCE.  tests/dp/test_dp_loss.py covers WRITE/SEND/READ under loss, corruption and retry exhaustion; this
file the rest of the verbs under loss, against an independent model of their effect."""
from __future__ import annotations


import numpy as np
import pytest

from dp_players import collect, connected
from metaroce_xdp.verbs_types import (Access, RecvWR, SendFlags, SendWR, WCFlags, WCOpcode, WCStatus,
                                      WROpcode)

pytestmark = pytest.mark.netns

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


def _pieces(off, n, pieces):
    """(offset, length) of each SGE _sgl makes for n bytes from off."""
    if n == 0:
        return []
    if pieces == 1:
        return [(off, n)]
    cut = [n // pieces] * (pieces - 1)
    cut.append(n - sum(cut))
    return [(off + j * 22_000, k) for j, k in enumerate(cut)]


def _gather(buf, sgl):
    return np.concatenate([buf[o:o + k] for o, k in sgl]) if sgl else np.zeros(0, np.uint8)


def _scatter(buf, sgl, data):
    """data into the SGEs in order (a later SGE overwrites where two overlap, as placement in order does)."""
    at = 0
    for o, k in sgl:
        take = min(k, len(data) - at)
        if take <= 0:
            break
        buf[o:o + take] = data[at:at + take]
        at += take


SEND_OPS = (WROpcode.SEND, WROpcode.SEND_WITH_IMM, WROpcode.SEND_WITH_INV)
WITH_IMM = (WROpcode.SEND_WITH_IMM, WROpcode.RDMA_WRITE_WITH_IMM)
WC_OPCODE = {WROpcode.RDMA_WRITE: WCOpcode.RDMA_WRITE, WROpcode.RDMA_WRITE_WITH_IMM: WCOpcode.RDMA_WRITE,
             WROpcode.SEND: WCOpcode.SEND, WROpcode.SEND_WITH_IMM: WCOpcode.SEND,
             WROpcode.SEND_WITH_INV: WCOpcode.SEND, WROpcode.RDMA_READ: WCOpcode.RDMA_READ,
             WROpcode.ATOMIC_FETCH_AND_ADD: WCOpcode.FETCH_ADD, WROpcode.ATOMIC_CMP_AND_SWP: WCOpcode.COMP_SWAP}


def expected(seed, extended, a0, b0):
    """What the plan must leave, each operation executed once and in order: (requester completions,
    receive completions, A's memory, B's memory), completions as key() makes them.  a0, b0: the memories
    before."""
    a, b = a0.copy(), b0.copy()
    req, rcv = [], []
    n_inv = 0
    for i, (op, n, signaled, imm, pieces, fence, (cell, cmp)) in enumerate(plan(seed, extended)):
        src, dst = i * 70_000, 4_000_000 + i * 70_000
        lsgl = _pieces(src, n, pieces)
        if op in (WROpcode.RDMA_WRITE, WROpcode.RDMA_WRITE_WITH_IMM):
            b[dst:dst + n] = _gather(a, lsgl)
        elif op in SEND_OPS:
            _scatter(b, _pieces(dst, 70_000 if pieces == 1 else 66_000, pieces), _gather(a, lsgl))
        elif op == WROpcode.RDMA_READ:
            _scatter(a, lsgl, b[dst:dst + n].copy())
        else:                                                   # an ATOMIC on B's cell
            at = CELLS + 8 * cell
            old = int(b[at:at + 8].view(np.uint64)[0])
            new = (old + 1 + cmp) % (1 << 64) if op == WROpcode.ATOMIC_FETCH_AND_ADD else \
                (100 + i if old == cmp else old)
            b[at:at + 8] = np.frombuffer(np.uint64(new).tobytes(), np.uint8)
            _scatter(a, lsgl, np.frombuffer(np.uint64(old).tobytes(), np.uint8))
        inv = None
        if op == WROpcode.SEND_WITH_INV:
            assert n_inv < N_INV, "the plan names an invalidated key: the model has no failure for it"
            inv, n_inv = n_inv, n_inv + 1
        if signaled:
            req.append((i, WCStatus.SUCCESS, WC_OPCODE[op], n if op == WROpcode.RDMA_READ else None, None, False, None))
        if op in SEND_OPS or op == WROpcode.RDMA_WRITE_WITH_IMM:
            rcv.append((1000 + i, WCStatus.SUCCESS, WCOpcode.RECV if op in SEND_OPS else WCOpcode.RECV_RDMA_WITH_IMM,
                        n, imm if op in WITH_IMM else None, inv is not None, inv))
    req.append((N, WCStatus.REM_ACCESS_ERR, None, None, None, False, None))      # the bad rkey (MR-MEM-021)
    req.append((N + 1, WCStatus.WR_FLUSH_ERR, None, None, None, False, None))    # then flushed (MR-QP-028)
    return req, rcv, a, b


def run(fab, seed, faults, extended=False):
    """The plan on the two compiled-plane endpoints of a switched Fabric; what it left and what it must have
    left."""
    _, a, b = fab
    connected(a, b, seeds=(seed, seed + 1), timeout=12)
    b.buf[CELLS:CELLS + 32] = 0
    inv = []
    try:
        want = expected(seed, extended, a.buf, b.buf)
        inv = [b.pd.reg_mr(np.zeros(64, np.uint8), Access.LOCAL_WRITE | Access.REMOTE_WRITE, remote_invalidate=True)
               for _ in range(N_INV)]
        n_inv = 0
        wrs, recvs = [], 0
        for i, (op, n, signaled, imm, pieces, fence, (cell, cmp)) in enumerate(plan(seed, extended)):
            src, dst = i * 70_000, 4_000_000 + i * 70_000
            if op in SEND_OPS or op == WROpcode.RDMA_WRITE_WITH_IMM:
                b.qp.post_recv(RecvWR(wr_id=1000 + i, sg_list=_sgl(b, dst, 70_000 if pieces == 1 else 66_000, pieces)
                                      if op != WROpcode.RDMA_WRITE_WITH_IMM else []))
                recvs += 1
            flags = (SendFlags.SIGNALED if signaled else SendFlags(0)) | (SendFlags.FENCE if fence else SendFlags(0))
            kw = dict(remote_addr=b.mr.addr + dst, rkey=b.mr.rkey, imm_data=imm)
            if op in ATOMICS:
                kw.update(remote_addr=b.mr.addr + CELLS + 8 * cell, compare_add=cmp if op == WROpcode.ATOMIC_CMP_AND_SWP
                          else 1 + cmp, swap=100 + i)
            elif op == WROpcode.SEND_WITH_INV:
                kw.update(invalidate_rkey=inv[n_inv % N_INV].rkey)
                n_inv += 1
            wrs.append(SendWR(wr_id=i, opcode=op, sg_list=_sgl(a, src, n, pieces), send_flags=flags, **kw))
        wrs.append(SendWR(wr_id=N, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 100)], remote_addr=b.mr.addr,
                          rkey=b.mr.rkey ^ 0x80))
        wrs.append(SendWR(wr_id=N + 1, opcode=WROpcode.SEND, sg_list=[a.sge(0, 10)]))
        expect_a = sum(1 for w in wrs if w.send_flags & SendFlags.SIGNALED)
        assert expect_a == len(want[0])
        knobs = dict(drop_ppm=10_000, dup_ppm=10_000, reorder_ppm=10_000, reorder_delay_us=500) if faults else {}
        fis = [fab.impair(toward, seed=seed + k, **knobs) for k, toward in enumerate("ab")] if faults else []
        try:
            a.qp.post_send(wrs)
            got_a = collect(a, expect_a, [b], timeout=60)
            got_b = collect(b, recvs, [a], timeout=20)
            hit = sum(f.stats()[k] for f in fis for k in ("dropped", "duplicated", "delayed"))
        finally:
            for f in fis:
                f.close()
        keys = [m.rkey for m in inv]

        def key(w, requester):
            ok = w.status == WCStatus.SUCCESS
            if not ok:                                          # MR-QP-029: only wr_id and status are defined
                return (w.wr_id, w.status, None, None, None, False, None)
            if requester:                                       # MR-QP-034: byte_len defined for a READ
                return (w.wr_id, w.status, w.opcode, w.byte_len if w.opcode == WCOpcode.RDMA_READ else None,
                        None, False, None)
            return (w.wr_id, w.status, w.opcode, w.byte_len,
                    w.imm_data if w.wc_flags & WCFlags.WITH_IMM else None, bool(w.wc_flags & WCFlags.WITH_INV),
                    keys.index(w.invalidated_rkey) if w.wc_flags & WCFlags.WITH_INV else None)

        got = ([key(w, True) for w in got_a], [key(w, False) for w in got_b], a.buf.copy(), b.buf.copy())
        return got, want, hit
    finally:
        for m in inv:
            m.dereg()


def _same(got, want):
    assert got[0] == want[0]                    # requester completions, field for field
    assert got[1] == want[1]                    # receive completions
    for name, g, w in (("A (READ targets, ATOMIC originals)", got[2], want[2]),
                       ("B (WRITE / SEND targets, ATOMIC cells)", got[3], want[3])):
        assert np.array_equal(g, w), f"{name} differs at {np.flatnonzero(g != w)[:8]}"


def test_every_completion_and_byte_as_the_plan_must_leave_under_faults(make_fabric):
    """WRITE, WRITE WITH IMMEDIATE, SEND, SEND WITH IMMEDIATE and READ of 0 B to 64 KiB, some unsignaled,
    under seeded loss, duplication and reordering both ways; a bad rkey at the end: REM_ACCESS_ERR, then
    WR_FLUSH_ERR."""
    got, want, hit = run(make_fabric(size=1 << 23), 21, True)
    assert hit > 0                              # the fault plan touched the traffic
    _same(got, want)


def test_atomics_invalidate_sge_lists_and_fence_under_faults(make_fabric):
    """The extended plan under the same kind of fault plan: every completion field and both memories as the
    model says -- each ATOMIC executed once (a duplicate answered from the saved result), each SEND WITH
    INVALIDATE's key reported, gathers and scatters in SGE order."""
    seed = 33
    ops = {op for op, *_ in plan(seed, True)}
    assert set(EXT_OPS) <= ops                  # every operation is in the plan
    assert any(p > 1 for _, _, _, _, p, _, _ in plan(seed, True)) and any(f for *_, f, _ in plan(seed, True))
    got, want, hit = run(make_fabric(size=1 << 23), seed, True, extended=True)
    assert hit > 0
    assert any(k[5] for k in want[1])           # a receive completion WITH_INV
    _same(got, want)
