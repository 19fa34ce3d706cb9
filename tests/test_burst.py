"""The compiled bursts (rc/burst.py) against the per-packet Python path.

Same work requests, two engines: one segments and places with the compiled
bursts, the other packet by packet.  The frames on the wire must be the same
field for field (the target VA and rkey differ between the two runs, so RETH
is compared relative to the target MR) with valid ICRCs, and the target
memory must end up identical -- also with NUMBA_DISABLE_JIT.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from metaroce_xdp.wire import decode
from rc_players import RecvWR, SendFlags, SendWR, WROpcode, loop_pair, wait_wcs


def _record(port):
    frames = []
    orig = port.tx_commit

    def tx_commit(off, length):
        frames.append(bytes(port._scratch[off:off + length]))
        orig(off, length)

    port.tx_commit = tx_commit
    return frames


def _run(burst: bool, mtu: int):
    a, b = loop_pair(mtu=mtu, burst=burst)
    rec = _record(a.ctx.port)
    a.buf[:] = np.arange(a.buf.size, dtype=np.uint64).astype(np.uint8)
    b.buf[:] = 0
    b.qp.post_recv([RecvWR(wr_id=i, sg_list=[b.sge(700_000, 100_000)]) for i in range(4)])
    wrs = [
        SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(3, 70_001)], remote_addr=b.mr.addr + 5, rkey=b.mr.rkey),
        SendWR(wr_id=2, opcode=WROpcode.RDMA_WRITE_WITH_IMM, sg_list=[a.sge(0, 5000)], remote_addr=b.mr.addr + 100_000,
               rkey=b.mr.rkey, imm_data=0xABCD),
        SendWR(wr_id=3, opcode=WROpcode.SEND, sg_list=[a.sge(11, 9999)], send_flags=SendFlags.SIGNALED | SendFlags.SOLICITED),
        SendWR(wr_id=4, opcode=WROpcode.SEND_WITH_IMM, sg_list=[a.sge(0, 0)], imm_data=7),
        SendWR(wr_id=5, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, mtu)], remote_addr=b.mr.addr + 200_000, rkey=b.mr.rkey),
        SendWR(wr_id=6, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 0)], remote_addr=b.mr.addr, rkey=b.mr.rkey),
    ]
    a.qp.post_send(wrs)
    wcs = wait_wcs([a, b], a, len(wrs))
    rwcs = wait_wcs([a, b], b, 3)
    norm = []
    for f in rec:
        p = decode(f)
        assert p.icrc_ok
        d = p.to_dict()
        d.pop("icrc")
        d["eth"] = d["ip"] = None                 # same topology, nothing to compare
        if "reth" in d:
            d["reth"]["va"] -= b.mr.addr
            d["reth"]["rkey"] = b.mr.rkey - d["reth"]["rkey"]
        norm.append((d, p.payload))
    return norm, [(w.wr_id, w.status) for w in wcs], [(w.wr_id, w.byte_len, w.imm_data) for w in rwcs], b.buf.copy(), \
        b.ctx.engine.stats["rx_burst"]


@pytest.mark.parametrize("mtu", [256, 1024, 4096])
def test_burst_matches_per_packet(mtu):
    f1, c1, r1, m1, fast = _run(True, mtu)
    f0, c0, r0, m0, slow = _run(False, mtu)
    assert len(f1) == len(f0)
    for i, (x, y) in enumerate(zip(f1, f0)):
        assert x == y, f"frame {i} differs: {x[0]} != {y[0]}"
    assert c1 == c0 and r1 == r0
    assert np.array_equal(m1, m0)
    assert fast > 0 and slow == 0          # the compiled placer really ran, and only there


def test_burst_without_jit():
    env = dict(os.environ, NUMBA_DISABLE_JIT="1")
    here = os.path.dirname(__file__)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "matches and 256",
                        os.path.join(here, "test_burst.py")], env=env, capture_output=True, text=True,
                       timeout=600, cwd=os.path.dirname(here))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
