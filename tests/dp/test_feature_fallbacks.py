"""What the kernel or driver will not do is given up with a warning, never a crash (issue 22, stock kernels):

* multi-buffer AF_XDP (XDP_USE_SG, Linux 6.6; path MTU 4096): refused (a kernel before 6.6 answers EINVAL, a
  driver without it EOPNOTSUPP) or switched off (METAROCE_NO_MULTIBUFFER), the port takes the single-buffer
  layout and a path MTU within one chunk, says why, and carries traffic;
* native (driver) XDP: refused by a driver without it (a bridge: EOPNOTSUPP), Context.open's default
  xdp_mode "auto" attaches in generic mode and says why;
* `Context.features()` and metaroced's `dev show` report what the endpoint runs with.

On this kernel (6.18) XDP_USE_SG is never refused, so the multi-buffer case is driven by the switch; the code
after it -- closing the sockets, reopening single-buffer, the MTU cap, the message -- is the same."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest

from dp_players import Side, wait_wcs
from metaroce_xdp.topo import two_hosts
from metaroce_xdp.verbs_types import SendWR, WCStatus, WROpcode

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]


def test_multibuffer_off_gives_single_buffer_and_a_smaller_path_mtu(monkeypatch, caplog):
    topo, pair = two_hosts(mtu=9000, prefix="mrfb")
    a = b = None
    try:
        monkeypatch.setenv("METAROCE_NO_MULTIBUFFER", "1")
        with caplog.at_level(logging.WARNING, logger="metaroce.afxdp"):
            a = Side(topo, topo[0], "mr0", 1 << 17, qp=True)
        monkeypatch.delenv("METAROCE_NO_MULTIBUFFER")
        b = Side(topo, topo[1], "mr1", 1 << 17, qp=True)
        fa, fb = a.ctx.features(), b.ctx.features()
        assert not fa["multibuffer"] and "METAROCE_NO_MULTIBUFFER" in fa["multibuffer_off"], fa
        assert fa["max_pmtu"] == 2048 and a.ctx.port.frame_limit == 4096, fa
        assert fb["multibuffer"] and fb["multibuffer_off"] is None and fb["max_pmtu"] == 4096, fb
        assert fa["xdp_mode"] == "drv" and fa["xdp_native_refused"] is None and fa["kernel"], fa
        assert any("path MTU at most 2048 on mr0" in r.getMessage() for r in caplog.records), caplog.text
        a.connect(b, mtu=2048, rd_atomic=4)
        b.connect(a, mtu=2048, rd_atomic=4)
        a.fill(5)
        a.qp.post_send([SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 1 << 16)],
                               remote_addr=b.mr.addr, rkey=b.mr.rkey)])
        wcs = wait_wcs([a, b], a, 1, timeout=30)
        assert [w.status for w in wcs] == [WCStatus.SUCCESS]
        assert np.array_equal(a.buf[:1 << 16], b.buf[:1 << 16])
    finally:
        for p in (a, b):
            if p is not None:
                p.close()
        topo.close()


def test_native_xdp_refused_attaches_generic():
    """A bridge has no native XDP: attach_best (Context.open's default) falls back to generic mode."""
    topo, _ = two_hosts(prefix="mrfb")
    try:
        topo.run(topo[0], ["ip", "link", "add", "mrbr0", "type", "bridge"])
        topo.run(topo[0], ["ip", "link", "set", "mrbr0", "up"])
        code = ("import logging, sys; sys.path.insert(0, %r)\n"
                "logging.basicConfig(level=logging.WARNING, format='%%(message)s')\n"
                "from metaroce_xdp.kern.loader import XdpLoader, attached_xdp_prog_id\n"
                "ld = XdpLoader(max_qps=64)\n"
                "mode = ld.attach_best('mrbr0', pin=False)\n"
                "print(mode.value, bool(attached_xdp_prog_id('mrbr0')), ld.drv_refused)\n"
                "ld.close()\n") % str(ROOT)
        r = topo.run(topo[0], [sys.executable, "-c", code], timeout=180, check=False)
    finally:
        topo.close()
    assert r.returncode == 0, r.stderr[-3000:]
    mode, attached, why = r.stdout.split(" ", 2)
    assert mode == "skb" and attached == "True", r.stdout
    assert why.startswith("native XDP refused on mrbr0:"), r.stdout
    assert "attaching in generic mode" in r.stderr, r.stderr
