"""XDP attachment through a bpf_link: the program belongs to the process that attached it.

A subprocess opens an endpoint (Context.open) in a namespace and connects a QP to an
endpoint in this process.  While it lives, a second Context.open on its interface fails
with XdpBusy naming it, touches neither its program nor its pinned maps, and a WRITE to
it still lands.  A UDP/4791 datagram to its address is then taken by its XDP program.
After a SIGKILL the interface has no XDP program left and the same datagram reaches an
ordinary socket; a new owner finds the dead owner's pins and replaces them, and its own
close() removes its pins.  (A second Context.open fails before compiling anything; the
generic-mode attempt and the new owner use a bare XdpLoader, one BCC compile for both.)
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import zlib
from types import SimpleNamespace

import numpy as np
import pytest

from metaroce_xdp.kern import XdpBusy, XdpLoader, XdpMode
from metaroce_xdp.kern.loader import PIN_ROOT, PINNED_MAPS, attached_xdp_prog_id, pinned_map_id
from metaroce_xdp.dp import Context
from metaroce_xdp.topo import two_hosts
from metaroce_xdp.verbs_types import SGE, QPAttr, QPState
from dp_players import FULL, wait_wcs
from metaroce_xdp.verbs_types import SendWR, WCStatus, WROpcode

pytestmark = pytest.mark.netns

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The owner: an endpoint on mr0 with a progress thread and one QP; prints what the peer
# needs, connects to the peer it reads from stdin, then answers "crc" with its buffer's CRC.
OWNER = r"""
import json, sys, zlib
import numpy as np
from metaroce_xdp.dp import Context
from metaroce_xdp.verbs_types import Access, QPAttr, QPState
FULL = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC
ctx = Context.open("mr0", progress_thread=True)
pd = ctx.alloc_pd()
buf = np.zeros(1 << 16, np.uint8)
mr = pd.reg_mr(buf, FULL)
cq = ctx.create_cq(64)
qp = ctx.create_qp(pd, cq, cq)
pin = ctx.loader._pin_dir
print(json.dumps({"qpn": qp.qp_num, "addr": mr.addr, "rkey": mr.rkey, "gid": ctx.gid,
                  "pin": str(pin) if pin else None}), flush=True)
peer = json.loads(sys.stdin.readline())
qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=peer["qpn"], rq_psn=0x100, path_mtu=1024, dgid=peer["gid"],
                 max_dest_rd_atomic=4, min_rnr_timer=1))
qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0x100, timeout=12, retry_cnt=7, rnr_retry=7, max_rd_atomic=4))
print("rts", flush=True)
for line in sys.stdin:
    print(zlib.crc32(buf), flush=True)
"""


def _readline(p, timeout=120.0) -> str:
    import select
    if not select.select([p.stdout], [], [], timeout)[0]:
        raise TimeoutError("the owner process said nothing in time")
    line = p.stdout.readline()
    assert line, f"the owner process exited ({p.poll()}): {p.stderr.read()[-3000:]}"
    return line


def _udp_4791_arrives(topo, ns_rx, ns_tx, ip) -> bool:
    """Send one datagram to ip:4791 from ns_tx; whether a plain socket in ns_rx gets it."""
    with topo.enter(ns_rx):
        rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.bind((ip, 4791))
        rx.settimeout(1.0)
        with topo.enter(ns_tx):
            tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with tx:
            tx.sendto(b"plain udp/4791 " + bytes(32), (ip, 4791))
        try:
            data, _ = rx.recvfrom(2048)
        except socket.timeout:
            return False
        return data.startswith(b"plain udp/4791")
    finally:
        rx.close()


def test_sigkilled_owner_releases_the_interface():
    topo, pair = two_hosts()
    ns_a, ns_b = topo[0], topo[1]
    owner = other = None
    ctx_b = None
    assert os.path.ismount(os.path.dirname(PIN_ROOT)), "make setup mounts bpffs at /sys/fs/bpf"
    try:
        owner = subprocess.Popen(["nsenter", f"--net=/run/netns/{ns_a}", sys.executable, "-c", OWNER],
                                 cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, start_new_session=True,
                                 env={**os.environ, "PYTHONPATH": ROOT})
        info = json.loads(_readline(owner))
        pin = info["pin"]
        assert pin and pin.startswith(PIN_ROOT + "/mr0@netns")
        with topo.enter(ns_a):
            prog = attached_xdp_prog_id("mr0")
        assert prog
        ids = {n: pinned_map_id(os.path.join(pin, n)) for n in PINNED_MAPS}
        assert all(ids.values())

        # the peer, in this process
        with topo.enter(ns_b):
            ctx_b = Context.open("mr1")
        pd = ctx_b.alloc_pd()
        buf = np.random.default_rng(5).integers(0, 256, 1 << 16, dtype=np.uint8)
        mr = pd.reg_mr(buf, FULL)
        cq = ctx_b.create_cq(64)
        qp = ctx_b.create_qp(pd, cq, cq)
        owner.stdin.write(json.dumps({"qpn": qp.qp_num, "gid": ctx_b.gid}) + "\n")
        owner.stdin.flush()
        with topo.enter(ns_b):
            qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
            qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=info["qpn"], rq_psn=0x100, path_mtu=1024,
                             dgid=info["gid"], max_dest_rd_atomic=4, min_rnr_timer=1))
            qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0x100, timeout=12, retry_cnt=7, rnr_retry=7,
                             max_rd_atomic=4))
        assert _readline(owner).strip() == "rts"

        # a second owner on mr0 while the first lives: a typed error naming it, nothing touched
        with topo.enter(ns_a):
            with pytest.raises(XdpBusy) as ei:
                Context.open("mr0")
            assert attached_xdp_prog_id("mr0") == prog
        e = ei.value
        assert e.ifname == "mr0" and e.prog_id == prog and owner.pid in e.holders
        assert f"pid {owner.pid}" in str(e)
        other = XdpLoader(max_qps=64)                # generic mode is refused too (EEXIST, not EBUSY)
        with topo.enter(ns_a):
            with pytest.raises(XdpBusy, match=f"pid {owner.pid}"):
                other.attach("mr0", mode=XdpMode.SKB)
            assert attached_xdp_prog_id("mr0") == prog
        assert {n: pinned_map_id(os.path.join(pin, n)) for n in PINNED_MAPS} == ids

        # ... and the first still works: a WRITE lands in its memory
        side_b = SimpleNamespace(ctx=ctx_b, cq=cq, qp=qp)    # what wait_wcs drives (the owner has its own thread)
        qp.post_send([SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[SGE(mr.addr, 1 << 16, mr.lkey)],
                             remote_addr=info["addr"], rkey=info["rkey"])])
        (wc,) = wait_wcs([side_b], side_b, 1, timeout=30)
        assert wc.status == WCStatus.SUCCESS
        owner.stdin.write("crc\n")
        owner.stdin.flush()
        assert int(_readline(owner)) == zlib.crc32(buf)

        # the owner's XDP program takes UDP/4791 for its address
        assert not _udp_4791_arrives(topo, ns_a, ns_b, "10.77.0.1")

        # SIGKILL: no cleanup code runs in the owner
        os.killpg(owner.pid, signal.SIGKILL)
        owner.wait(timeout=30)
        with topo.enter(ns_a):
            deadline = time.monotonic() + 5
            while attached_xdp_prog_id("mr0") is not None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert attached_xdp_prog_id("mr0") is None
        assert _udp_4791_arrives(topo, ns_a, ns_b, "10.77.0.1")
        assert {n: pinned_map_id(os.path.join(pin, n)) for n in PINNED_MAPS} == ids   # its leftovers

        # a new owner (here in generic mode): the stale pins are replaced by its own, and go with its close()
        with topo.enter(ns_a):
            other.attach("mr0", mode=XdpMode.SKB)
            assert attached_xdp_prog_id("mr0") not in (None, prog)
        assert str(other._pin_dir) == pin and other.stale_pins_removed == len(PINNED_MAPS)
        now = {n: pinned_map_id(os.path.join(pin, n)) for n in PINNED_MAPS}
        assert now == {n: _map_id(other, n) for n in PINNED_MAPS}
        assert not set(now.values()) & set(ids.values())
        other.close()
        assert not os.path.exists(pin)
        with topo.enter(ns_a):
            assert attached_xdp_prog_id("mr0") is None
    finally:
        if owner is not None and owner.poll() is None:
            os.killpg(owner.pid, signal.SIGKILL)
            owner.wait(timeout=30)
        for c in (other, ctx_b):
            if c is not None:
                c.close()
        topo.close()


def _map_id(ld, name):
    from metaroce_xdp.kern import bpfsys
    return bpfsys.map_info(ld.bpf[name.encode()].map_fd).id


def test_detach_xdp_removes_a_netlink_attached_program_in_each_mode():
    """kern.loader.detach_xdp (metaroced's clean-up of a dead instance's netlink-attached program, pyroute2 in
    place of `ip link set xdp off`): a program attached through netlink in native mode and one in generic mode
    (the two modes a veth takes) are each detached; bpfsys.prog_name_by_id names it first."""
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from bcc import BPF\nfrom metaroce_xdp.kern import bpfsys, loader\n"
            "b = BPF(text='int xdp_pass_all(struct xdp_md *ctx) { return XDP_PASS; }')\n"
            "fn = b.load_func('xdp_pass_all', BPF.XDP)\n"
            "for flags in (0, 1 << 1):\n"
            "    BPF.attach_xdp('mr0', fn, flags)\n"
            "    pid = loader.attached_xdp_prog_id('mr0')\n"
            "    print(flags, pid is not None, bpfsys.prog_name_by_id(pid), loader.detach_xdp('mr0'),\n"
            "          loader.attached_xdp_prog_id('mr0'), loader.detach_xdp('mr0'))\n") % ROOT
    topo, _ = two_hosts()
    try:
        r = topo.run(topo[0], [sys.executable, "-c", code], timeout=120, check=False)
    finally:
        topo.close()
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["0 True xdp_pass_all True None False", "2 True xdp_pass_all True None False"], \
        r.stdout
