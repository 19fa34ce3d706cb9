"""A compiled-plane endpoint in a process of its own, as an application runs it (tests/dp/test_peer_loss.py: the
peer that vanishes).

    python tests/dp_peer.py IFNAME SIZE

opens `metaroce_xdp.dp.Context` on IFNAME with its progress thread, a PD, an MR of SIZE bytes (local write,
remote write and read), a CQ and an RC QP, and prints one JSON line {"qpn", "va", "rkey", "pid"}.  Then it reads
one JSON line {"dest_qpn", "dgid", "rq_psn", "sq_psn", "timeout"}, takes the QP to RTS towards it, prints
{"state": "RTS"}, and serves (the progress thread answers) until its stdin closes.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from metaroce_xdp.dp import Context  # noqa: E402
from metaroce_xdp.verbs_types import Access  # noqa: E402
from players import Player, to_rts  # noqa: E402

ACCESS = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ


def main() -> int:
    ifname, size = sys.argv[1], int(sys.argv[2])
    ctx = Context.open(ifname, progress_thread=True)
    try:
        p = Player(ctx).resources(size, access=ACCESS, cq_depth=4096, qp=True)
        qp = p.qp
        print(json.dumps({"qpn": qp.qp_num, "va": p.mr.addr, "rkey": p.mr.rkey, "pid": os.getpid()}), flush=True)
        peer = json.loads(sys.stdin.readline())
        to_rts(qp, peer["dest_qpn"], peer["dgid"], access=ACCESS, rq_psn=peer["rq_psn"], sq_psn=peer["sq_psn"],
               timeout=peer["timeout"], rd_atomic=4, min_rnr_timer=1)
        print(json.dumps({"state": qp.query_state().name}), flush=True)
        for _ in sys.stdin:
            pass
    finally:
        ctx.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
