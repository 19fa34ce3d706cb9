"""python -m metaroce_xdp.fuzz {ctl,pkt,all,replay} -- see docs/fuzzing.md.

  --duration S    stop starting cases after S seconds (default 60; the long form: 1800 or more)
  --seed N        the run's seed (default: from the clock, printed); cases derive from (seed, case number)
  --cases A:B     exactly these case numbers instead of a duration (the short form, a replay of a range)
  --out DIR       where crashes are saved, one JSON file each (default fuzz-crashes/)
  --strict        every crash fails the run, known-open findings too (METAROCE_FUZZ_STRICT=1)
  --avoid-known   generate around the known-open findings (JSON nesting <= 800, no VA near 2^63), to look
                  past them on a branch where they are still open (METAROCE_FUZZ_AVOID_KNOWN=1)
  --json FILE     the summary (inputs tried, crashes, hangs, drops by reason) as JSON
  --target T      pkt: inproc (the compiled plane in a child process), daemon (through metaroced), both
  --boundscheck D pkt: the compiled plane with NUMBA_BOUNDSCHECK=1, its numba cache in D (cold: minutes)

Exit status: 0 when every finding was a known-open one (known.py), 1 when any was NEW (or any at all, strict).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from . import known, store


def _range(s: str) -> list[int]:
    a, _, b = s.partition(":")
    return list(range(int(a), int(b))) if b else [int(a)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m metaroce_xdp.fuzz", description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["ctl", "pkt", "all", "replay"])
    ap.add_argument("file", nargs="?", help="replay: a saved crash (fuzz-crashes/*.json)")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--cases", type=_range, default=None)
    ap.add_argument("--out", default=store.DEFAULT_DIR)
    ap.add_argument("--strict", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--avoid-known", action="store_true",
                    help="generate around the known-open findings (nesting <= 800, no VA near 2^63): look past them")
    ap.add_argument("--target", choices=["inproc", "daemon", "both"], default="both",
                    help="pkt: the compiled plane in process, through metaroced, or both (the time split)")
    ap.add_argument("--boundscheck", metavar="CACHE_DIR", default=None,
                    help="pkt: run the endpoint with NUMBA_BOUNDSCHECK=1 and numba's cache in CACHE_DIR")
    a = ap.parse_args(argv)
    if a.strict:
        os.environ["METAROCE_FUZZ_STRICT"] = "1"
    if a.avoid_known:
        os.environ["METAROCE_FUZZ_AVOID_KNOWN"] = "1"
    if a.what == "replay":
        return replay(a.file)
    seed = a.seed if a.seed is not None else int(time.time()) % 1_000_000
    print(f"fuzz: seed {seed}, {'cases ' + str(len(a.cases)) if a.cases else f'{a.duration:.0f} s'}, "
          f"crashes to {a.out}/, {'strict' if known.strict() else f'{len(known.KNOWN_OPEN)} known-open findings'}",
          flush=True)
    found: list[store.Finding] = []
    summary: dict = {"seed": seed}
    parts = ["ctl", "pkt"] if a.what == "all" else [a.what]
    share = a.duration / len(parts)
    for p in parts:
        deadline = time.monotonic() + share
        if p == "ctl":
            f, st = run_ctl(seed, a.cases, deadline)
        else:
            from . import pkt
            f, st = pkt.run_all(seed, a.cases, deadline, a.target, boundscheck=a.boundscheck)
        found += f
        summary[p] = st
    return report(found, summary, a.out, a.json)


def run_ctl(seed: int, cases: list[int] | None, deadline: float) -> tuple[list, dict]:
    from . import ctl
    from .harness import Daemons
    t0 = time.monotonic()
    with Daemons(prefix="fzc") as d:
        d.start("A")
        d.start("B")
        d.connect_good()
        f, st = ctl.run(d, seed, cases if cases is not None else range(10 ** 9),
                        deadline=None if cases is not None else deadline)
        st["restarts"] = d.restarts
    st["seconds"] = round(time.monotonic() - t0, 1)
    return f, st


def report(found: list, summary: dict, out: str, json_path: str | None) -> int:
    new = [f for f in found if f.new]
    summary["findings"] = [{"line": f.line(), "file": f.save(out)} for f in found]
    summary["new"] = len(new)
    for f in summary["findings"]:
        print(f"  {f['line']}\n      saved: {f['file']}")
    print(f"fuzz: {len(found)} findings, {len(new)} NEW; summary: "
          + json.dumps({k: v for k, v in summary.items() if k != "findings"}), flush=True)
    if json_path:
        os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
        with open(json_path, "w") as fh:
            json.dump(summary, fh, indent=1)
    return 1 if new else 0


def replay(path: str) -> int:
    rec = store.load(path)
    print(f"replay: {rec['fuzzer']} seed {rec['seed']} case {rec['case']}: {rec['kind']}: {rec['what']}")
    if rec["fuzzer"] == "ctl":
        from . import ctl
        from .harness import Daemons
        with Daemons(prefix="fzr") as d:
            d.start("A")
            d.start("B")
            d.connect_good()
            ctl.run_steps(d, rec["input"].get("steps") or ctl.gen_case(rec["seed"], rec["case"]))
            time.sleep(0.3)
            ok, why = d.alive("A")
            print("daemon A:", "alive" if ok else why)
            err = d.good_write() if ok else "daemon dead"
            print("well-behaved WRITE:", err or "completed")
            return 0 if ok and not err else 1
    from . import pkt
    return pkt.replay(rec)


if __name__ == "__main__":
    sys.exit(main())
