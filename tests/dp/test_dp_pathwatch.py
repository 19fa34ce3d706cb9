"""Path re-resolution on the compiled data plane (dp/context.py _Paths, driving netinfo.PathWatch).

Hosts A and B in two subnets behind one IP router (metaroce_xdp.topo.routed_hosts), both endpoints
on the compiled plane with its progress thread running.  In the middle of a 16 MiB WRITE the
router's interface towards one host takes a new MAC and announces it (a failover): the old MAC no
longer exists on that link, so the transfer can only finish if the QP's TM row now carries the new
next hop's MAC.  Side "a": the requester's gateway moves; side "b": the responder's, whose ACKs
would go to a dead MAC.  The data is verified, and the QP reports the new next hop.
"""
from __future__ import annotations

import os
import time
import zlib

import numpy as np
import pytest

from metaroce_xdp.dp import layout as L
from metaroce_xdp.verbs_types import QPState, SendWR, WCStatus, WROpcode

TOTAL, CHUNK = 16 << 20, 1 << 20

# the module's `fabric` (tests/conftest.py): A and B behind one IPv4 router, each Side with its progress thread
pytestmark = [pytest.mark.netns, pytest.mark.fabric("routed", size=TOTAL, progress_thread=True)]


@pytest.mark.parametrize("side", ["a", "b"])
def test_gateway_mac_change_mid_transfer_compiled_plane(fabric, side):
    r = fabric.routed
    _, a, b = fabric
    for s in (a, b):
        s.new_qp()
    a.connect(b, timeout=14), b.connect(a, timeout=14)
    assert a.qp.query_state() == QPState.RTS
    router_if = r.toward_a if side == "a" else r.toward_b
    who = a if side == "a" else b
    gw = (r.gw_a if side == "a" else r.gw_b)["ipv4"]
    q0 = who.qp.query()
    assert q0["dmac"] == router_if.mac and q0["next_hop"] == gw
    assert who.ctx.paths.watch.tracked[who.qp.qp_num] == who.qp.dgid
    a.buf[:] = np.random.default_rng(7).integers(0, 256, TOTAL, dtype=np.uint8)
    b.buf[:] = 0
    n = TOTAL // CHUNK
    a.qp.post_send([SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(i * CHUNK, CHUNK)],
                           remote_addr=b.mr.addr + i * CHUNK, rkey=b.mr.rkey) for i in range(n)])
    new_mac = "02:00:5e:%02x:%02x:%02x" % tuple(os.urandom(3))
    done: list = []
    at_event = None
    deadline = time.monotonic() + 60
    try:
        while len(done) < n:
            done += a.cq.poll(n)
            if at_event is None and len(done) >= 2:
                r.topo.set_mac(router_if.ns, router_if.ifname, new_mac)
                r.topo.announce(router_if.ns, router_if.ifname, gw)
                at_event = len(done)
            assert time.monotonic() < deadline, (len(done), who.qp.query(), who.ctx.stats())
            time.sleep(0.0005)
        assert at_event is not None and at_event < n, "the transfer ended before the path changed"
        assert all(w.status == WCStatus.SUCCESS for w in done), [w for w in done if w.status][:3]
        assert zlib.crc32(a.buf) == zlib.crc32(b.buf)
        q = who.qp.query()
        assert q["dmac"] == new_mac and q["next_hop"] == gw, q
        assert q["path_changes"] == q0["path_changes"] + 1 and q["path_error"] is None
        st = who.ctx.stats()
        assert st["path_changes"] >= 1 and st["path_resolves"] >= 1
        tm = who.ctx.plane.TM[who.qp.qi]
        mac = bytes.fromhex(new_mac.replace(":", ""))
        assert bytes(tm[0:6]) == mac and bytes(tm[L.TM_CNP:L.TM_CNP + 6]) == mac
    finally:
        r.topo.set_mac(router_if.ns, router_if.ifname, router_if.mac)      # leave the fixture as found
        r.topo.announce(router_if.ns, router_if.ifname, gw)
