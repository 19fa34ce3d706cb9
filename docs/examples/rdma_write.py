#!/usr/bin/env python3
"""An application of metaroced in a few lines: one RDMA WRITE with immediate between two hosts.

    B$ python3 rdma_write.py --ifname eth1 server            # listens on port 18515, waits for the write
    A$ python3 rdma_write.py --ifname eth1 client 10.0.0.2   # writes 1 MiB into B's buffer

Both print a JSON line (the server one more before, once it listens): the bytes' SHA-256 (the same
on both sides when the write arrived whole), the QP number and where metaroce_xdp was imported from.
Each talks to the metaroced serving its interface (the socket: --socket, else METAROCE_SOCKET, else
/run/metaroce/metaroced.sock; the user must be in the socket's group, `metaroce` after `make
install`).  The client library needs numpy only (`pip install 'metaroce-xdp[client]'`).  `--hold`
keeps the server's QP until a line on stdin, to look at it with `metaroce qp list`.
tests/tools/test_wheel_install.py runs this file from an installed wheel."""
import argparse
import hashlib
import json
import sys

import numpy as np

import metaroce_xdp
from metaroce_xdp.daemon.client import connect
from metaroce_xdp.verbs_types import Access, QPAttr, QPState, RecvWR, SendWR, WCStatus, WROpcode

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--ifname", required=True)
p.add_argument("--socket", default=None)
p.add_argument("--port", type=int, default=18515)
p.add_argument("--size", type=int, default=1 << 20)
p.add_argument("--hold", action="store_true", help="server: keep the QP until a line arrives on stdin")
p.add_argument("role", choices=("server", "client"))
p.add_argument("host", nargs="?", help="client: the server's address")
a = p.parse_args()

ctx = connect(a.socket, a.ifname)
pd = ctx.alloc_pd()
buf = ctx.alloc_buf(a.size)                           # memory the daemon can map (a sealed memfd)
mr = pd.reg_mr(buf, Access.LOCAL_WRITE | Access.REMOTE_WRITE)
cq = ctx.create_cq(16)
qp = ctx.create_qp(pd, cq, cq)
mine = {"va": mr.addr, "rkey": mr.rkey}

if a.role == "server":
    qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=Access.REMOTE_WRITE))
    qp.post_recv(RecvWR(wr_id=1))          # a WRITE with immediate consumes a receive (its bytes go to the MR)
    lst = ctx.listen(a.port)
    print(json.dumps({"listening": a.port}), flush=True)
    conn = lst.accept(qp, mine, timeout=60)
    wc = cq.wait(1, 60)[0]
    ok = wc.status == WCStatus.SUCCESS and wc.imm_data == 0x600D
else:
    buf[:] = np.random.default_rng(1).integers(0, 256, a.size, dtype=np.uint8)
    conn = ctx.connect_qp(qp, a.host, a.port, mine)
    qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE_WITH_IMM, sg_list=[mr.sge(0, a.size)],
                        remote_addr=conn.private["va"], rkey=conn.private["rkey"], imm_data=0x600D))
    wc = cq.wait(1, 60)[0]
    ok = wc.status == WCStatus.SUCCESS

print(json.dumps({"role": a.role, "ok": ok, "status": wc.status.name, "qpn": qp.qp_num,
                  "sha256": hashlib.sha256(buf.tobytes()).hexdigest(), "package": metaroce_xdp.__file__}),
      flush=True)
if a.hold:
    sys.stdin.readline()
ctx.close()
sys.exit(0 if ok else 1)
