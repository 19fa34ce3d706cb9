"""Goodput and retransmitted packets, compat (go-back-N) against native (SACK), same seeded loss, same run.

    sudo .venv/bin/python tools/native_loss_bench.py [--size 262144] [--total 8388608] [--loss 0,1] [--reps 2]
        [--native-params '{"cc_delay": 0, "rto_min": 4000}']

Two hosts and a switch namespace (metaroce_xdp.topo.switched_hosts), the compiled data plane with a
progress thread per host, the fault injector (metaroce_xdp.faults) dropping the given share of frames
each way on the switch.  Per profile and loss: WRITEs of --size bytes, --total bytes in all, checked
byte for byte; retransmitted packets = data frames sent minus the packets the bytes need.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from dp_players import FULL, make_switched  # noqa: E402
from metaroce_xdp.faults import FaultInjector  # noqa: E402
from metaroce_xdp.verbs_types import QPAttr, QPState, SendWR, WCStatus, WROpcode  # noqa: E402


def connect(side, peer, profile, params):
    with side.topo.enter(side.ns):
        q = side.qp
        q.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
        q.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=peer.qp.qp_num, rq_psn=0x100, path_mtu=1024,
                        dgid=peer.ctx.gid, max_dest_rd_atomic=16, profile=profile,
                        native_params=params if profile == "native" else None))
        q.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0x100, timeout=12, retry_cnt=7, rnr_retry=7, max_rd_atomic=16))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=256 * 1024)
    ap.add_argument("--total", type=int, default=8 << 20)
    ap.add_argument("--loss", default="0,1", help="percent, comma separated")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--native-params", default="{}", help="JSON: native.layout.params overrides")
    a_ = ap.parse_args()
    params = json.loads(a_.native_params)
    n = a_.total // a_.size
    total = n * a_.size
    topo, a, b = make_switched(size=max(total, 1 << 20), progress_thread=True)
    try:
        for rep in range(a_.reps):
            for pct in (float(x) for x in a_.loss.split(",")):
                ppm = int(pct * 10_000)
                for prof in ("compat", "native"):
                    a.new_qp(), b.new_qp()
                    connect(a, b, prof, params), connect(b, a, prof, params)
                    a.buf[:] = 7
                    b.buf[:] = 0
                    tx0 = a.ctx.stats()["tx"]
                    with FaultInjector("swB", netns=topo[1], seed=31 + rep, drop_ppm=ppm), \
                            FaultInjector("swA", netns=topo[1], seed=41 + rep, drop_ppm=ppm):
                        t0 = time.monotonic()
                        a.qp.post_send([SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE,
                                               sg_list=[a.sge(i * a_.size, a_.size)],
                                               remote_addr=b.mr.addr + i * a_.size, rkey=b.mr.rkey) for i in range(n)])
                        got = a.cq.wait(n, timeout=120)
                        dt = time.monotonic() - t0
                    ok = all(w.status == WCStatus.SUCCESS for w in got) and bool((b.buf[:total] == 7).all())
                    retx = a.ctx.stats()["tx"] - tx0 - (total + 1023) // 1024
                    print(json.dumps({"rep": rep, "loss_pct": pct, "profile": prof, "size": a_.size, "intact": ok,
                                      "goodput_gbps": round(total * 8 / dt / 1e9, 3), "retx_packets": retx,
                                      **({k: v for k, v in a.qp.native_counters().items()
                                          if k in ("c_retx_sack", "c_retx_rto", "c_retx_tlp", "c_spurious")})}),
                          flush=True)
    finally:
        a.close()
        b.close()
        topo.close()


if __name__ == "__main__":
    main()
