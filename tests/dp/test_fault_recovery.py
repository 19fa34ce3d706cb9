"""Recovery under loss, reordering, duplication and corruption (MR-RETRY, MR-DUP, MR-NAK, MR-ICRC).

Two compiled-plane endpoints (dp_loop) with seeded faults in both directions, injected on the switch
namespace between them: every transfer completes intact, or fails with the documented error once its
retry budget is spent -- never a hang, never corrupt data.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from dp_players import Faults, wait_wcs
from metaroce_xdp.verbs_types import RecvWR, SendWR, WCStatus, WROpcode

pytestmark = pytest.mark.netns

SEEDS = [1, 2, 3, 4, 5, 6]


def _workload(a, b, n_ops=24):
    rng = np.random.default_rng(9)
    a.buf[:] = rng.integers(0, 256, a.buf.size, dtype=np.uint8)
    b.buf[:] = rng.integers(0, 256, b.buf.size, dtype=np.uint8)
    b.buf[900_000:900_008] = 0
    for i in range(n_ops):
        b.qp.post_recv(RecvWR(wr_id=500 + i, sg_list=[b.sge(600_000 + i * 5000, 5000)]))
    wrs, expect = [], []
    for i in range(n_ops):
        k = i % 4
        if k == 0:
            wrs.append(SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(i * 9000, 9000)],
                              remote_addr=b.mr.addr + i * 9000, rkey=b.mr.rkey))
            expect.append(("w", i * 9000, i * 9000, 9000))
        elif k == 1:
            wrs.append(SendWR(wr_id=i, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(300_000 + i * 7000, 7000)],
                              remote_addr=b.mr.addr + 400_000 + i * 7000, rkey=b.mr.rkey))
            expect.append(("r", 300_000 + i * 7000, 400_000 + i * 7000, 7000))
        elif k == 2:
            wrs.append(SendWR(wr_id=i, opcode=WROpcode.SEND, sg_list=[a.sge(i * 100, 4100)]))
        else:
            wrs.append(SendWR(wr_id=i, opcode=WROpcode.ATOMIC_FETCH_AND_ADD, sg_list=[a.sge(800_000 + i * 8, 8)],
                              remote_addr=b.mr.addr + 900_000, rkey=b.mr.rkey, compare_add=1))
    return wrs, expect


def _counts(*players) -> dict:
    """Retransmissions, sequence NAKs seen and frames dropped for a bad ICRC (in user space or by the XDP
    program), summed over the players' Contexts: diffed around a test (the Contexts are the module's)."""
    out = dict(retransmits=0, naks_seen=0, icrc=0)
    for p in players:
        st = p.ctx.stats()
        out["retransmits"] += st["retransmits"]
        out["naks_seen"] += st["naks_seen"]
        out["icrc"] += st["rx_drop_icrc"] + p.ctx.loader.drops().get("BAD_ICRC", 0)
    return out


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["drop", "reorder", "dup", "corrupt", "all"])
def test_transfers_survive_faults(dp_loop, kind, seed):
    """MR-RETRY-004, MR-RETRY-006, MR-RETRY-012, MR-NAK-002, MR-NAK-004, MR-DUP-002, MR-DUP-003, MR-DUP-005,
    MR-ICRC-014: every WR completes intact, in order, under each fault."""
    rates = {"drop": Faults(seed=seed, drop=0.05), "reorder": Faults(seed=seed, reorder=0.2),
             "dup": Faults(seed=seed, dup=0.1), "corrupt": Faults(seed=seed, corrupt=0.05),
             "all": Faults(seed=seed, drop=0.03, reorder=0.1, dup=0.05, corrupt=0.03)}[kind]
    back = Faults(seed=seed + 100, drop=rates.drop, reorder=rates.reorder, dup=rates.dup, corrupt=rates.corrupt)
    a, b = dp_loop(rates, back, mtu=1024, timeout=6, retry_cnt=7)
    wrs, expect = _workload(a, b)
    c0 = _counts(a, b)
    a.qp.post_send(wrs)
    wcs = wait_wcs([a, b], a, len(wrs), timeout=60)
    assert [w.wr_id for w in wcs] == list(range(len(wrs)))
    assert all(w.status == WCStatus.SUCCESS for w in wcs), [w for w in wcs if w.status]
    for kind_, src, dst, n in expect:
        if kind_ == "w":
            assert zlib.crc32(b.buf[dst:dst + n]) == zlib.crc32(a.buf[src:src + n])
        else:
            assert zlib.crc32(a.buf[src:src + n]) == zlib.crc32(b.buf[dst:dst + n])
    rwcs = wait_wcs([a, b], b, 6)
    assert [w.wr_id for w in rwcs] == [500 + i for i in range(6)]
    for j, i in enumerate(range(2, 24, 4)):
        assert bytes(b.buf[600_000 + j * 5000:600_000 + j * 5000 + 4100]) == bytes(a.buf[i * 100:i * 100 + 4100])
    # atomics applied exactly once despite duplicates and retries (MR-DUP-005, MR-ATOM-007)
    assert b.buf[900_000:900_008].view(np.uint64)[0] == 6
    d = _delta(_counts(a, b), c0)
    if kind in ("drop", "corrupt", "all"):
        assert d["retransmits"] > 0, d
    if kind == "corrupt":
        assert d["icrc"] > 0, d


def test_heavy_loss_fails_cleanly_or_completes(dp_loop):
    """30 % loss each way with a small retry budget: each WR ends SUCCESS or RETRY_EXC_ERR, nothing hangs
    (MR-RETRY-004, MR-RETRY-010)."""
    a, b = dp_loop(Faults(seed=11, drop=0.3), Faults(seed=12, drop=0.3), timeout=4, retry_cnt=2)
    a.buf[:] = 7
    wrs = [SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 20_000)],
                  remote_addr=b.mr.addr, rkey=b.mr.rkey) for i in range(10)]
    a.qp.post_send(wrs)
    wcs = wait_wcs([a, b], a, 10, timeout=60)
    statuses = {w.status for w in wcs}
    assert statuses <= {WCStatus.SUCCESS, WCStatus.RETRY_EXC_ERR, WCStatus.WR_FLUSH_ERR}
    ok = [w for w in wcs if w.status == WCStatus.SUCCESS]
    assert [w.wr_id for w in wcs] == list(range(10))
    if ok:
        assert not (b.buf[:20_000] != 7).any()


def test_long_message_at_5_percent_loss_keeps_its_retry_budget(dp_loop):
    """MR-RETRY-005, MR-RNR-008, MR-NAK-004: each sequence-error NAK acknowledges the packets
    before its gap; that is forward progress and resets the retry budget, so a long message
    on a lossy path completes rather than running out of retries while it moves."""
    a, b = dp_loop(Faults(seed=11, drop=0.05), Faults(seed=12, drop=0.05), size=4 << 20, retry_cnt=3, timeout=14)
    a.buf[:] = np.random.default_rng(5).integers(0, 256, a.buf.size, dtype=np.uint8)
    c0 = _counts(a)
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 2 << 20)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    (wc,) = wait_wcs([a, b], a, 1, timeout=120)
    assert wc.status == WCStatus.SUCCESS, a.qp.query()
    assert _delta(_counts(a), c0)["naks_seen"] > 3 * 4      # many more NAKs than retries allowed
    assert zlib.crc32(b.buf[:2 << 20]) == zlib.crc32(a.buf[:2 << 20])
