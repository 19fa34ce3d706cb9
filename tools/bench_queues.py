"""WRITE goodput against the number of RX queues a QP's packets are spread over (issue 22: every RX
queue under RSS).

    python -m tools.bench_queues                      # 1, 2 and 4 queues, compat and native, a table
    python -m tools.bench_queues --json FILE --queues 1,4 --iters 2000

For each queue count N, hosts A and B in two subnets behind a router (metaroce_xdp.topo.routed_hosts),
every veth end with N RX and TX queues; the router's egress ports spread MetaRoCE frames over the N TX
queues (faults.FaultInjector spread_queues=N; on veth a frame is received on the RX queue of the number
it left on), either as a NIC's RSS over UDP ports does (spread "flow": a compat QP's packets on one
queue, the native profile's sprayed paths on several) or round robin per packet (spread "packet": one
QP's consecutive packets on every queue, the worst case).  Then `metaroce perf write-bw` (64 KiB, path
MTU 1024, --qps QP pairs, in process on both hosts: each opens every queue, one loop serving them all)
from A to B, per profile, and the client's goodput.  N = 1 is the baseline with the same topology and
spreader (which then leaves every frame on queue 0), so the ratio is the cost of N queues.  Absolute
figures depend on the host; compare the rows of one run."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PORT = 19581


def _result(out: str) -> dict | None:
    for line in reversed(out.strip().splitlines()):
        if line.lstrip().startswith("{"):
            return json.loads(line)
    return None


def once(nq: int, profile: str, iters: int, size: int, spread: str, qps: int, timeout: float = 120) -> dict:
    from metaroce_xdp.faults import FaultInjector
    from metaroce_xdp.topo import routed_hosts
    r = routed_hosts(ipv6=False, queues=nq, prefix="mrbq")
    try:
        base = [sys.executable, "-m", "metaroce_xdp.cli", "perf", "write-bw", "-s", str(size), "-n", str(iters),
                "-t", "32", "-m", "1024", "--json", "--no-daemon", "--profile", profile, "-p", str(PORT)]
        with FaultInjector(r.toward_b.ifname, netns=r.toward_b.ns, spread_queues=nq, spread_by=spread), \
                FaultInjector(r.toward_a.ifname, netns=r.toward_a.ns, spread_queues=nq, spread_by=spread):
            srv = r.topo.popen(r.b.ns, [*base, "-d", r.b.ifname], cwd=str(ROOT), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
            try:
                for _ in range(240):
                    cli = r.topo.popen(r.a.ns, [*base, "-d", r.a.ifname, "--qps", str(qps), r.b.ipv4], cwd=str(ROOT),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    out, err = cli.communicate(timeout=timeout)
                    if "start `metaroce perf" not in err:
                        break
                    time.sleep(0.25)                      # the server is still starting
                srv.communicate(timeout=60)
            finally:
                if srv.poll() is None:
                    srv.kill()
                    srv.wait()
        res = _result(out)
        row = {"queues": nq, "profile": profile, "spread": spread, "qps": qps}
        if cli.returncode != 0 or res is None:
            return row | {"gbps": None, "error": err.strip()[-300:]}
        return row | {"gbps": res.get("gbps"), "verified": res.get("peer_verified")}
    finally:
        r.topo.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queues", default="1,2,4", help="queue counts, comma-separated (default 1,2,4)")
    ap.add_argument("--profiles", default="compat,native")
    ap.add_argument("--iters", type=int, default=3000, help="64 KiB WRITEs per run (default 3000)")
    ap.add_argument("--size", type=int, default=65536)
    ap.add_argument("--spread", default="flow,packet", help="flow (RSS over UDP ports), packet (round robin) or both")
    ap.add_argument("--qps", type=int, default=4, help="QP pairs (default 4: compat QPs on several queues under flow)")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    a = ap.parse_args(argv)
    rows = []
    for spread in a.spread.split(","):
        for profile in a.profiles.split(","):
            for nq in (int(q) for q in a.queues.split(",")):
                row = once(nq, profile, a.iters, a.size, spread, a.qps)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    print(f"{'spread':7} {'profile':8} {'queues':>6} {'Gb/s':>8} {'vs 1 queue':>10}")
    for row in rows:
        one = next((x["gbps"] for x in rows if (x["profile"], x["spread"]) == (row["profile"], row["spread"])
                    and x["queues"] == 1), None)
        g = row["gbps"]
        ratio = f"{g / one:.2f}" if g and one else "-"
        print(f"{row['spread']:7} {row['profile']:8} {row['queues']:>6} {g if g is None else round(g, 3):>8} "
              f"{ratio:>10}")
    if a.json:
        Path(a.json).write_text(json.dumps({"schema": "metaroce-bench-queues/1", "rows": rows}, indent=1))
    return 0 if all(r["gbps"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
