"""`make soak`: the long checks that do not fit in `make test`.

Two parts, both on real endpoints (XDP + AF_XDP) between network namespaces, every work request
checked for status, order and bytes (metaroce_xdp/stress.py), on each plane that ships (--plane):
the compiled data plane in this process (a progress thread, as users run it) and metaroced (a
daemon per host namespace, progress as --daemon-progress, driven through its client library):

  matrix   loss 0.1 %, 1 %, 5 %, reordering, duplication and corruption, each on a switch and
           on a router between the hosts, x WRITE / READ / SEND / ATOMIC x 0 B, 1 B, path
           MTU +- 1, 64 KiB, 8 MiB, at least --case-packets packets a case (default 200,000),
           PSNs starting just below 2^24 so they wrap;
  soak     --minutes of traffic at full rate through a router with --loss % loss: resident
           memory of the process that owns the plane (this one, or A's metaroced) sampled every
           10 s (flat within 5 % after the first minute), UMEM frames accounted for, packets
           conserved on the wire and inside each host.

    python -m tools.soak                       # both parts on both planes, defaults (about 40 minutes)
    python -m tools.soak --plane daemon --part soak --minutes 10 --loss 1
    python -m tools.soak --part matrix --case-packets 200000 --json out.json

Prints one line per case (named plane/path/fault) and a summary per plane; `--json FILE` writes
everything measured, by plane.  Exits 1 if any check failed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from metaroce_xdp.stress import (MATRIX_FAULTS as FAULTS, MATRIX_PMTU as PMTU, MATRIX_SIZES as SIZES,
                                  MATRIX_WRAP as WRAP, PLANES, Fabric, StressError, Workload,
                                  connect_near_wrap as _connect)

SOAK_SIZES = (0, 1, PMTU - 1, PMTU, PMTU + 1, 64 << 10, 1 << 20)


def _checks(fab, a, b, base) -> dict:
    to_a, to_b = fab.fault_stats
    out = {**fab.conservation(a, b, base),
           "delivery_a": a.delivery(), "delivery_b": b.delivery(),
           "umem_a": a.umem_frames(), "umem_b": b.umem_frames(),
           "faults": {k: to_a.get(k, 0) + to_b.get(k, 0) for k in ("dropped", "duplicated", "corrupted", "delayed")}}
    bad = []
    for k in ("a_to_b", "b_to_a", "delivery_a", "delivery_b"):
        if out[k]["residual"]:
            bad.append(f"{k} residual {out[k]['residual']}")
    for k in ("umem_a", "umem_b"):
        if out[k]["leaked"]:
            bad.append(f"{k} leaked {out[k]['leaked']} frames")
    out["problems"] = bad
    return out


def matrix(plane: str, case_packets: int, paths: list[str], faults: list[str], log, **fab_kw) -> list[dict]:
    results = []
    for path in paths:
        with Fabric(path, plane=plane, **fab_kw) as fab:
            a, b = fab.endpoints(64 << 20)
            for name in faults:
                _connect(a, b)
                wl = Workload(a, b, sizes=SIZES, depth=16, seed=len(results) + 1)
                base = fab.mark(a, b)
                row = {"case": f"{plane}/{path}/{name}", "ok": False}
                t0 = time.monotonic()
                try:
                    with fab.faults(seed=11 + len(results), **FAULTS[name]):
                        rep = wl.run(packets=case_packets)
                        fab.quiesce(a, b)
                    row.update(rep.as_dict())
                    row.update(_checks(fab, a, b, base))
                    q = a.qp_counters()
                    row["psn_wrapped"] = q["sq_psn"] < WRAP
                    row["retransmits"] = q["retransmits"]
                    row["ok"] = not row["problems"] and row["psn_wrapped"]
                except StressError as e:
                    row["error"] = str(e)
                row["wall_s"] = round(time.monotonic() - t0, 1)
                results.append(row)
                log(f"{row['case']:<31} {'ok  ' if row['ok'] else 'FAIL'} {row.get('packets_sent_by_a', 0):>9,} pkts "
                    f"{row.get('wrs', 0):>5} WRs {row.get('retransmits', 0):>6} go-back-N  {row['wall_s']:>6} s"
                    + (f"  {row.get('error') or row.get('problems')}" if not row["ok"] else ""))
    return results


def soak(plane: str, minutes: float, loss_pct: float, path: str, log, **fab_kw) -> dict:
    with Fabric(path, plane=plane, **fab_kw) as fab:
        a, b = fab.endpoints(64 << 20)
        _connect(a, b)
        wl = Workload(a, b, sizes=SOAK_SIZES, depth=16, seed=99)
        base = fab.mark(a, b)
        row = {"case": f"soak/{plane}/{path}/loss-{loss_pct}%", "minutes": minutes, "ok": False,
               "rss_of": "this process" if plane == "compiled" else f"metaroced (pid {a.plane.pid})"}
        try:
            with fab.faults(seed=5, drop_ppm=int(loss_pct * 10_000)):
                rep = wl.run(seconds=minutes * 60, rss_every=10.0, stall=60.0)
                fab.quiesce(a, b)
            row.update(rep.as_dict())
            row.update(_checks(fab, a, b, base))
            samples = rep.rss_samples
            settled = [r for t, r in samples if t >= min(60.0, minutes * 60 / 4)] or [samples[-1][1]]
            row["rss_samples"] = samples
            row["rss_after_warmup"] = settled[0]
            row["rss_end"] = samples[-1][1]
            row["rss_growth_pct"] = round(100.0 * (samples[-1][1] - settled[0]) / settled[0], 2)
            q = a.qp_counters()
            row["retransmits"] = q["retransmits"]
            row["timeouts"] = a.counters()["plane"]["timeouts"]
            row["psn_wraps"] = (WRAP + rep.packets_a) >> 24
            if abs(row["rss_growth_pct"]) > 5:
                row["problems"].append(f"RSS grew {row['rss_growth_pct']} % after warm-up")
            row["ok"] = not row["problems"]
        except StressError as e:
            row["error"] = str(e)
        log(f"{row['case']}: {'ok' if row['ok'] else 'FAIL'}  {row.get('seconds', 0):.0f} s, "
            f"{row.get('packets_sent_by_a', 0):,} packets from A, {row.get('wrs', 0):,} WRs, "
            f"{row.get('bytes', 0) / 1e9:.2f} GB checked, dropped {row.get('faults', {}).get('dropped', 0):,}, "
            f"RSS of {row['rss_of']} {row.get('rss_after_warmup', 0) / 2**20:.1f} -> "
            f"{row.get('rss_end', 0) / 2**20:.1f} MiB "
            f"({row.get('rss_growth_pct', 0):+.2f} %)"
            + (f"  {row.get('error') or row.get('problems')}" if not row["ok"] else ""))
        return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--plane", choices=("both", *PLANES), default="both",
                    help="the compiled plane in this process, metaroced, or both in turn (default)")
    ap.add_argument("--daemon-progress", choices=("busy", "sleep"), default="busy",
                    help="metaroced's progress option (default busy, the daemon's default)")
    ap.add_argument("--part", choices=("all", "matrix", "soak"), default="all")
    ap.add_argument("--case-packets", type=int, default=200_000, help="packets from A per matrix case")
    ap.add_argument("--paths", default="switch,router", help="matrix placements (switch, router, routers2)")
    ap.add_argument("--faults", default=",".join(FAULTS), help="matrix faults: " + ", ".join(FAULTS).replace("%", "%%"))
    ap.add_argument("--minutes", type=float, default=10.0, help="soak duration (default 10)")
    ap.add_argument("--loss", type=float, default=1.0, help="soak loss in percent (default 1)")
    ap.add_argument("--soak-path", default="router", help="soak placement (default router)")
    ap.add_argument("--json", help="write all results to this file")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("the soak needs root (network namespaces, XDP, AF_XDP): run `sudo make soak`", file=sys.stderr)
        return 2
    for f in args.faults.split(","):
        if f not in FAULTS:
            ap.error(f"unknown fault {f!r}; choose from {', '.join(FAULTS)}")

    def log(msg: str) -> None:
        print(msg, flush=True)

    out: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "planes": {}}
    verdict = {}
    for plane in (PLANES if args.plane == "both" else (args.plane,)):
        kw = {"daemon_progress": args.daemon_progress} if plane == "daemon" else {}
        res: dict = out["planes"].setdefault(plane, {})
        ok = True
        if args.part in ("all", "matrix"):
            log(f"== {plane} plane, fault matrix: {args.case_packets:,} packets a case, PSNs from {WRAP:#x} "
                "(wrap at 2^24)")
            res["matrix"] = matrix(plane, args.case_packets, args.paths.split(","), args.faults.split(","), log, **kw)
            ok &= all(r["ok"] for r in res["matrix"])
        if args.part in ("all", "soak"):
            log(f"== {plane} plane, soak: {args.minutes} min at full rate, {args.loss} % loss on the {args.soak_path}")
            res["soak"] = soak(plane, args.minutes, args.loss, args.soak_path, log, **kw)
            ok &= res["soak"]["ok"]
        verdict[plane] = ok
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    log("== soak: " + ", ".join(f"{p} plane {'passed' if v else 'FAILED'}" for p, v in verdict.items()))
    return 0 if all(verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
