"""`make bench`, the fabric part (issue 9): WRITE goodput against random loss on the emulated
fabric (`metaroce fabric`), for each profile the endpoint offers, side by side in one run.

    python -m tools.bench_fabric                     # full run: table, docs/bench/fabric.json, goodput_loss.png
    python -m tools.bench_fabric --quick --no-plots  # a short run (fewer bytes, 0 and 1 % loss only)

One fabric (2 hosts, 4 parallel links per hop, docs/fabric.md) serves the run.  For each message
size (64 KiB, 1 MiB), each loss rate (0, 0.1 %, 1 %, 5 %) and each profile, `metaroce perf
write-bw` runs from h1 to h2 -- the server in h2, the client in h1, each in its own namespace
and process, through the fabric's routers -- while the impairment program drops that share of
the frames on the last hop toward h2 (port l2:h2: every data packet crosses it exactly once,
the ACKs going back do not), with one fixed seed, so every profile meets the same coin
sequence.  Each point reports:

  goodput      bytes the application wrote per second (perf's own figure, the client's);
  retained     goodput / the same profile's and size's goodput without loss -- issue 9's target
               is native >= 0.8 at 1 % loss;
  sent/needed  data frames the sender put on the wire (the fabric's counters on h1's leaf
               uplinks) over the frames the messages need: 1.0 is no retransmission; go-back-N
               resends the whole window behind each loss;
  dropped      frames the impairment program dropped.

Then multipath: 64 KiB WRITEs over the 4 links out of leaf 1, healthy and with one link at 5 %
loss -- for compat the link its single flow hashes onto, from its 200th frame on (pinned to the
bad path, for contrast),
for native link 0 (issue 9's target: a sprayed native flow keeps >= 0.7 of the healthy goodput).

Last, incast (also alone: `--incast`): 4 senders (h1..h4) into h5 through one 200 Mb/s bottleneck
that CE-marks above 30 KB and drops above 200 KB; h5's four perf servers share one engine through
metaroced.  Four runs: native with its congestion control and the daemon's receiver credits
(credit_budget INCAST_BUDGET), native with CC off (no credits, a window fixed at W: NATIVE_CC_OFF
through METAROCE_NATIVE_PARAMS), compat with DCQCN on and off (METAROCE_DCQCN_ENABLED).  The senders
connect, then start at one instant (perf --start-at @FILE, written once the daemon lists all four
QPs in RTS), so process start-up is not measured; the bottleneck's and each sender's uplink byte
counters are sampled every 5 ms and the aggregate and the per-flow rates (Jain's index) are taken
over the interval in which all four run (last start to first end).  Reported: aggregate against the
bottleneck, Jain fairness, queue drops and marks, the senders' retransmissions and timeouts, and the
queue over time (incast_queue.png).  METAROCE_INCAST_TRACE=FILE (experiments) also writes, per case,
FILE.<profile>-<on|off>.json: the bottleneck queue and each native sender's requester row (cwnd, srtt,
in flight, credits, counters) every 5 ms.  Each row also reports the senders' CPU share and the share
of their run spent waiting for a CPU (`sender_cpu`, `sender_runq_wait`): on a host shared with other
sessions (the kernel's autogroup shares the CPU between sessions, not processes) that wait is the round
trip.  `--incast-progress sleep` runs the senders with `metaroce perf --progress sleep`.

Both profiles are measured (`metaroce perf --profile compat|native`); a perf without that option
would leave the native rows "not available" with the reason, not drop them.  The data plane is
the compiled one (`--plane compiled`).

JSON (schema "metaroce-bench-fabric/1"; keys are only added, never renamed):

    {"schema", "when", "host": {"kernel", "cpus", "load_avg"}, "options": {"quick", "plane", "seed",
     "bytes_per_point"}, "fabric": {"hosts", "paths", "loss_port"},
     "points": [{"profile", "size", "loss_ppm", "gbps"|null, "retained"|null, "sent_over_needed"|null,
                 "dropped", "seconds", "not_available"|null}],
     "multipath": [{"profile", "healthy_gbps", "degraded_gbps", "kept", "bad_link", "links_used",
                    "not_available"}],               # full runs only
     "incast": [{"profile", "cc", "senders", "bottleneck_bps", "flows_gbps", "goodput_gbps", "aggregate_gbps",
                 "of_bottleneck", "jain", "aggregate_goodput_gbps", "goodput_of_bottleneck", "goodput_jain",
                 "interval_s", "start_spread_s", "q_dropped", "marked", "retransmits",
                 "timeouts", "native": [per sender: its QP's native counters] | [null ...],
                 "queue": [[t_s, backlog_bytes], ...], "not_available"}],   # full and --incast runs
     "targets": [{"id", "label", "value"|null, "target", "meets"|null}], "plots": [path, ...]}
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "docs" / "bench"
SCHEMA = "metaroce-bench-fabric/1"
SIZES = (65536, 1 << 20)
LOSSES = (0, 1_000, 10_000, 50_000)            # ppm: 0, 0.1 %, 1 %, 5 %
QUICK_LOSSES = (0, 10_000)
PROFILES = ("compat", "native")
LOSS_PORT = "l2:h2"
SEED = 7
PMTU = 1024
PERF_PORT = 18515
IN_FLIGHT = 8 << 20                            # outstanding bytes per QP: tx depth = this / size, at most 128


class BenchError(RuntimeError):
    pass


def perf_profiles(plane: str) -> tuple[tuple[str, ...], str | None]:
    """The profiles `metaroce perf write-bw` can be asked for, and why the others cannot."""
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    cp = subprocess.run([sys.executable, "-m", "metaroce_xdp.cli", "perf", "write-bw", "--help"], cwd=ROOT,
                        capture_output=True, text=True, env=env, timeout=60)
    if "--profile" not in set(re.findall(r"--[a-z][a-z0-9-]*", cp.stdout)):
        return ("compat",), "metaroce perf has no --profile option: the native profile is not yet wired into " \
                            "the data plane (issue 9)"
    return PROFILES, None


def _listening(ns: str, port: int) -> bool:
    cp = subprocess.run(["ip", "netns", "exec", ns, "ss", "-Hltn", f"sport = :{port}"], capture_output=True,
                        text=True, timeout=10)
    return bool(cp.stdout.strip())


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def perf_once(fab, size: int, total: int, plane: str, profile: str | None, timeout: float, watch=None) -> dict:
    """One `metaroce perf write-bw` from h1 to h2 across the fabric; the client's JSON result.
    `watch()`, if given, is called every 10 ms while the client runs until it returns True."""
    h1, h2 = fab.plan.host("h1"), fab.plan.host("h2")
    iters = max(4, total // size)
    depth = max(1, min(128, IN_FLIGHT // size))
    base = [sys.executable, "-m", "metaroce_xdp.cli", "perf", "write-bw", "-d", h2.ifname, "-s", str(size),
            "-n", str(iters), "-t", str(depth), "-m", str(PMTU), "--json", "--no-daemon", "--timeout", "20"]
    base += ["--plane", plane]
    if profile is not None:
        base += ["--profile", profile]
    srv = subprocess.Popen(["ip", "netns", "exec", h2.ns, *base], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not _listening(h2.ns, PERF_PORT):
            if srv.poll() is not None:
                raise BenchError(f"perf server exited ({srv.returncode}): {srv.stderr.read().strip()[-400:]}")
            if time.monotonic() > deadline:
                raise BenchError("perf server not listening after 90 s")
            time.sleep(0.2)
        cli = subprocess.Popen(["ip", "netns", "exec", h1.ns, *base, h2.ipv4], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        try:
            end = time.monotonic() + timeout
            while watch is not None and cli.poll() is None and time.monotonic() < end and not watch():
                time.sleep(0.01)
            out, err = cli.communicate(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired as e:
            raise BenchError(f"perf client still running after {timeout:.0f} s") from e
        finally:
            _stop(cli)
        res = None
        for line in reversed(out.strip().splitlines()):
            if line.lstrip().startswith("{"):
                res = json.loads(line)
                break
        if res is None:
            raise BenchError(f"perf client failed ({cli.returncode}): {err.strip()[-400:]}")
        return res
    finally:
        _stop(srv)


def _sent_frames(fab) -> int:
    return sum(c["tx_pkts"] for c in (fab.maps.counters(p.id) for p in fab.select("l1:sp*")))


def measure(fab, sizes, losses, profiles, missing: str | None, plane: str, total: int, log) -> list[dict]:
    points = []
    for size in sizes:
        for profile in PROFILES:
            base_gbps = None
            for loss in losses:
                pt = {"profile": profile, "size": size, "loss_ppm": loss, "gbps": None, "retained": None,
                      "sent_over_needed": None, "dropped": None, "seconds": None, "not_available": None}
                points.append(pt)
                if profile not in profiles:
                    pt["not_available"] = missing
                    continue
                fab.set(LOSS_PORT, clear=True, loss_ppm=loss, seed=SEED, reset=True)
                fab.set("l1:sp*", reset=True)
                log(f"{profile} {size} B at {loss / 1e4:g} % loss")
                try:
                    # go-back-N at 5 % loss crawls: allow ~2 minutes a point
                    res = perf_once(fab, size, total, plane, profile if missing is None else None, timeout=150)
                except BenchError as e:
                    pt["not_available"] = str(e)
                    continue
                needed = -(-size // PMTU) * res["iterations"]
                pt.update(gbps=res["gbps"], seconds=res.get("seconds"),
                          sent_over_needed=round(_sent_frames(fab) / needed, 3),
                          dropped=fab.maps.counters(fab.plan.port(LOSS_PORT).id)["dropped"])
                if loss == 0:
                    base_gbps = res["gbps"]
                if base_gbps:
                    pt["retained"] = round(res["gbps"] / base_gbps, 3)
    fab.set(LOSS_PORT, clear=True, reset=True)
    return points


def multipath(fab, profiles, missing: str | None, plane: str, total: int, log) -> list[dict]:
    """64 KiB WRITEs over the 4 parallel links out of leaf 1, healthy and then with one link at
    5 % loss: for compat the link its one flow hashes onto (a compat QP keeps one UDP source
    port, so it is pinned to the bad path); for native, link 0 (a sprayed flow uses them all)."""
    rows = []
    for profile in PROFILES:
        row = {"profile": profile, "healthy_gbps": None, "degraded_gbps": None, "kept": None, "bad_link": None,
               "links_used": None, "not_available": None}
        rows.append(row)
        if profile not in profiles:
            row["not_available"] = missing
            continue
        prof = profile if missing is None else None
        try:
            fab.set("all", clear=True, reset=True)
            log(f"multipath: {profile}, 4 healthy links")
            healthy = perf_once(fab, 65536, total, plane, prof, timeout=150)
            use = {p.name: fab.maps.counters(p.id)["tx_pkts"] for p in fab.select("l1:sp*")}
            if profile == "compat":
                # A compat QP's source port follows its QPN, which perf does not fix: the flow's
                # link is known once it carries traffic, and the loss starts there and then.
                fab.set("all", reset=True)
                bad = []

                def watch() -> bool:
                    now = {p.name: fab.maps.counters(p.id)["tx_pkts"] for p in fab.select("l1:sp*")}
                    top = max(now, key=now.get)
                    if now[top] >= 200:
                        fab.set(top, loss_ppm=50_000, seed=SEED, reset=True)
                        bad.append(top)
                        return True
                    return False
                log(f"multipath: {profile}, its flow's link at 5 % loss")
                degraded = perf_once(fab, 65536, total, plane, prof, timeout=150, watch=watch)
                bad = bad[0] if bad else None
            else:
                bad = "l1:sp0"
                fab.set(bad, loss_ppm=50_000, seed=SEED, reset=True)
                log(f"multipath: {profile}, {bad} at 5 % loss")
                degraded = perf_once(fab, 65536, total, plane, prof, timeout=150)
        except BenchError as e:
            row["not_available"] = str(e)
            continue
        finally:
            fab.set("all", clear=True, reset=True)
        row.update(healthy_gbps=healthy["gbps"], degraded_gbps=degraded["gbps"], bad_link=bad,
                   kept=round(degraded["gbps"] / healthy["gbps"], 3) if healthy["gbps"] else None,
                   links_used=sum(1 for v in use.values() if v > 0.05 * sum(use.values())))
    return rows


INCAST_SENDERS = 4
INCAST_RATE = 200_000_000                      # the bottleneck: l5:h5 at 200 Mb/s, DCTCP-like marking
INCAST_MARK, INCAST_DROP = 30_000, 200_000
INCAST_START_S = 2.0                           # the senders start together this long after all are connected
INCAST_BUDGET = 1024                           # metaroced's credit_budget (packets) for the native runs with CC
# native "CC off": no credits (the daemon grants none), and a window that never shrinks -- W from the start,
# no cut on ECN (alpha 0, gain 0), loss or RTO (max_mdf 0, rto_cwnd_reset never), no pacing below line rate
NATIVE_CC_OFF = {"init_cwnd": 256, "alpha_init": 0, "g_ecn": 0, "max_mdf": 0, "rto_cwnd_reset": 1 << 20,
                 "pacing_gain": 64}
INCAST_CASES = (("native", True), ("native", False), ("compat", True), ("compat", False))
if os.environ.get("METAROCE_INCAST_CASES"):                 # e.g. "native:1,compat:0" (experiments)
    INCAST_CASES = tuple((c.split(":")[0], c.split(":")[1] == "1") for c in os.environ["METAROCE_INCAST_CASES"].split(","))


def _jain(xs: list[float]) -> float | None:
    return round(sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)), 3) if xs and any(xs) else None


def incast(plane: str, cc: bool, total: int, log, profile: str = "compat", budget: int = INCAST_BUDGET,
           progress: str = "spin") -> dict:
    """4 senders (h1..h4, each its own `metaroce perf` process and engine) WRITE 64 KiB messages
    into h5 at once, through one bottleneck (the port toward h5: 200 Mb/s, CE mark above 30 KB,
    drop above 200 KB).  h5's four perf servers share one engine through metaroced (one
    program owns an interface).  `profile` compat: `cc` is DCQCN (METAROCE_DCQCN_ENABLED on every
    side); native: `cc` is the native window (delay/ECN/loss, MR-CC-008..023) with the daemon's
    receiver credits (credit_budget INCAST_BUDGET, MR-CC-018), off is NATIVE_CC_OFF without credits.

    Measurement: every sender connects, then waits for the same wall-clock instant (perf --start-at),
    so process start-up (numba's load, connection set-up) is outside the measurement.  The bottleneck's
    and each sender's leaf-uplink byte counters are sampled every 5 ms; `aggregate_gbps` is the bytes
    the bottleneck forwarded while all four senders ran (from the last start to the first end), over
    that time, and `flows_gbps` each sender's uplink bytes over the same interval (Jain's index is taken
    over those) -- wire bytes, retransmissions included; `goodput_gbps` is perf's own figure per sender
    (its bytes over its own run), `aggregate_goodput_gbps` every sender's bytes from the common start to
    the last end (`goodput_of_bottleneck`, `goodput_jain` over the senders' goodputs).

    `progress`: the senders' `metaroce perf --progress` -- spin (the default, perf's): busy polling,
    sched_yield when idle; sleep: idle, each sender's loop sleeps in ppoll() until a SACK, a timer or
    its pacing deadline.  `sender_cpu` and `sender_runq_wait` are each sender's share of its run spent
    on a CPU and runnable but waiting for one (/proc schedstat): the host delay of README's analysis."""
    from metaroce_xdp import fabric
    env = {**os.environ, "METAROCE_DCQCN_ENABLED": "1" if cc or profile != "compat" else "0"}
    if profile == "native" and not cc:
        env["METAROCE_NATIVE_PARAMS"] = json.dumps(NATIVE_CC_OFF)
    trace_to = os.environ.get("METAROCE_INCAST_TRACE")      # experiments: the senders' rows over time, to FILE
    name = f"inc{os.getpid() % 10000}"
    log(f"incast: building the fabric for {profile}, CC {'on' if cc else 'off'}")
    fab = fabric.up(name, hosts=INCAST_SENDERS + 1, paths=2)
    dst = fab.plan.host(f"h{INCAST_SENDERS + 1}")
    port = fab.plan.port(f"l{INCAST_SENDERS + 1}:h{INCAST_SENDERS + 1}")
    ups = [[p.id for p in fab.select(f"l{i + 1}:sp*")] for i in range(INCAST_SENDERS)]
    sock, pins = f"/run/metaroce/{name}.sock", f"/sys/fs/bpf/metaroce-{name}"
    gofile = f"/run/metaroce/{name}.start"
    procs: list[subprocess.Popen] = []
    out = {"profile": profile, "cc": cc, "credit_budget": budget if profile == "native" and cc else None,
           "sender_progress": progress,
           "senders": INCAST_SENDERS, "bottleneck_bps": INCAST_RATE,
           "flows_gbps": None, "goodput_gbps": None, "aggregate_gbps": None, "of_bottleneck": None, "jain": None,
           "interval_s": None, "start_spread_s": None, "q_dropped": None, "marked": None, "retransmits": None,
           "timeouts": None, "queue": [], "not_available": None}
    try:
        fab.set(port.name, rate_bps=INCAST_RATE, mark_depth=INCAST_MARK, drop_depth=INCAST_DROP, reset=True)
        os.makedirs("/run/metaroce", exist_ok=True)
        # progress sleep: the daemon's loop waits in poll() when idle, leaving the shared cores to the senders
        dflags = ["--credit-budget", str(budget if profile == "native" and cc else 0), "--progress", "sleep"]
        # its log to a file: a pipe nobody reads would fill (a line per client, the status polls below) and stop it
        dlog = open(f"/run/metaroce/{name}.log", "w+")
        d = subprocess.Popen(["ip", "netns", "exec", dst.ns, sys.executable, "-m", "metaroce_xdp.daemon", "-i", dst.ifname,
                              "--socket-path", sock, "--bpffs-prefix", pins, "--log-level", "warning", *dflags],
                             cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=dlog, text=True)
        procs.append(d)
        deadline = time.monotonic() + 60
        while not os.path.exists(sock):
            if d.poll() is not None or time.monotonic() > deadline:
                dlog.seek(0)
                raise BenchError(f"metaroced did not start: {dlog.read()[-400:] if d.poll() is not None else 'no socket after 60 s'}")
            time.sleep(0.1)
        iters = max(4, total // 65536)
        opts = ["-s", "65536", "-n", str(iters), "-t", "16", "-m", str(PMTU), "--json", "--timeout", "30"]
        opts += ["--plane", plane]
        if profile != "compat":
            opts += ["--profile", profile]
        perf = [sys.executable, "-m", "metaroce_xdp.cli", "perf", "write-bw", "-d", dst.ifname]
        for i in range(INCAST_SENDERS):
            procs.append(subprocess.Popen(["ip", "netns", "exec", dst.ns, *perf, *opts, "-p", str(18600 + i),
                                           "--socket", sock], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 90
        while not all(_listening(dst.ns, 18600 + i) for i in range(INCAST_SENDERS)):
            if time.monotonic() > deadline:
                raise BenchError("incast: perf servers not listening after 90 s")
            time.sleep(0.2)
        log(f"incast: {INCAST_SENDERS} {profile} senders into h{INCAST_SENDERS + 1}, "
            f"{'DCQCN' if profile == 'compat' else 'native CC + credits'} {'on' if cc else 'off'}")
        fab.set("all", reset=True)
        with contextlib.suppress(OSError):
            os.unlink(gofile)
        clients = [subprocess.Popen(["ip", "netns", "exec", fab.plan.host(f"h{i + 1}").ns, *perf, *opts, "--no-daemon",
                                     "--progress", progress,
                                     "--start-at", "@" + gofile, "-p", str(18600 + i), dst.ipv4], cwd=ROOT,
                                    env={**env, "METAROCE_PERF_TRACE": f"{trace_to}.h{i + 1}"} if trace_to else env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for i in range(INCAST_SENDERS)]
        procs += clients
        # every sender connected (the daemon lists 4 QPs in RTS) and past its barrier: the start, for all at once
        from metaroce_xdp.daemon import client as dclient
        deadline = time.monotonic() + 120
        while sum(q["state"] == "RTS" for q in dclient.status(sock)["qps"]) < INCAST_SENDERS:
            if time.monotonic() > deadline or any(c.poll() is not None for c in clients):
                raise BenchError("incast: the senders did not all connect within 120 s")
            time.sleep(0.25)
        start_at = time.time() + INCAST_START_S
        Path(gofile + ".tmp").write_text(f"{start_at:.3f}\n")
        os.rename(gofile + ".tmp", gofile)
        samples = []                            # (wall time, bottleneck tx bytes, [sender uplink tx bytes])
        t0 = time.monotonic()
        while any(c.poll() is None for c in clients) and time.monotonic() - t0 < 300:
            if time.time() >= start_at - 0.5:
                now = time.time()
                samples.append((now, fab.maps.counters(port.id)["tx_bytes"],
                                [sum(fab.maps.counters(p)["tx_bytes"] for p in u) for u in ups]))
                out["queue"].append([round(now - start_at, 4), fab.maps.backlog(port.id)])
                time.sleep(0.005)
            else:
                time.sleep(0.05)
        res = []
        for i, c in enumerate(clients):
            o, e = c.communicate(timeout=30)
            r = next((json.loads(x) for x in reversed(o.splitlines()) if x.startswith("{")), None)
            if r is None:
                raise BenchError(f"incast sender h{i + 1} failed ({c.returncode}): {e.strip()[-300:]}")
            res.append(r)
        lo, hi = max(r["start_epoch"] for r in res), min(r["end_epoch"] for r in res)
        if trace_to:
            Path(f"{trace_to}.{profile}-{'on' if cc else 'off'}.json").write_text(json.dumps(
                {"start_at": start_at, "bottleneck": [(t, b) for t, b, _ in samples], "queue": out["queue"],
                 "senders": [(r["start_epoch"], r["end_epoch"]) for r in res],
                 "traces": [json.loads(Path(f"{trace_to}.h{i + 1}").read_text()) for i in range(len(res))]}))
        win = [x for x in samples if lo <= x[0] <= hi]
        if len(win) < 2 or win[-1][0] - win[0][0] < 0.05:
            raise BenchError(f"incast: the senders ran together for {max(0.0, hi - lo):.3f} s only "
                             f"(starts spread over {max(r['start_epoch'] for r in res) - min(r['start_epoch'] for r in res):.2f} s)")
        dt = win[-1][0] - win[0][0]
        flows = [(win[-1][2][i] - win[0][2][i]) * 8 / dt / 1e9 for i in range(INCAST_SENDERS)]
        agg = (win[-1][1] - win[0][1]) * 8 / dt / 1e9
        c = fab.maps.counters(port.id)
        st = [r.get("dp_stats") or {} for r in res]
        out["native"] = [r.get("native") for r in res]
        t_lo, t_hi = min(r["start_epoch"] for r in res), max(r["end_epoch"] for r in res)
        good = sum(r["total_bytes"] for r in res) * 8 / (t_hi - t_lo) / 1e9
        out.update(aggregate_goodput_gbps=round(good, 4), goodput_of_bottleneck=round(good * 1e9 / INCAST_RATE, 3),
                   goodput_jain=_jain([r["gbps"] for r in res]))
        out.update(flows_gbps=[round(x, 4) for x in flows], goodput_gbps=[round(r["gbps"], 4) for r in res],
                   aggregate_gbps=round(agg, 4), of_bottleneck=round(agg * 1e9 / INCAST_RATE, 3), jain=_jain(flows),
                   interval_s=round(dt, 3), start_spread_s=round(lo - min(r["start_epoch"] for r in res), 3),
                   q_dropped=c["q_dropped"], marked=c["marked"],
                   retransmits=sum(x.get("retransmits", 0) for x in st), timeouts=sum(x.get("timeouts", 0) for x in st),
                   # each sender's CPU share over its run, and how its loop waited (sleeps in ppoll, sched_yields)
                   sender_cpu=[round(r["cpu_seconds"] / r["seconds"], 3) if r.get("cpu_seconds") is not None
                               and r.get("seconds") else None for r in res],
                   sender_wakeups=[x.get("wakeups", 0) for x in st], sender_yields=[x.get("yields", 0) for x in st],
                   sender_runq_wait=[round(r["runq_wait_seconds"] / r["seconds"], 3) if r.get("runq_wait_seconds")
                                     is not None and r.get("seconds") else None for r in res],
                   queue=[q for q in out["queue"] if lo - start_at <= q[0] <= max(r["end_epoch"] for r in res) - start_at])
    except BenchError as e:
        out["not_available"] = str(e)
        out["queue"] = []
    finally:
        for p in reversed(procs):
            _stop(p)
        fab.down()
        with contextlib.suppress(NameError):
            dlog.close()
        for f in (sock, gofile, f"/run/metaroce/{name}.log"):
            with contextlib.suppress(OSError):
                os.unlink(f)
    return out


def targets(points: list[dict], mp: list[dict], inc: list[dict] = ()) -> list[dict]:
    out = []
    for prof, what in (("native", "native CC + credits"), ("compat", "compat with DCQCN")):
        on = next((r for r in inc if r["cc"] and r.get("profile", "compat") == prof), None)
        off = next((r for r in inc if not r["cc"] and r.get("profile", "compat") == prof), None)
        if on is None:
            continue
        na = on["not_available"]
        ratio = (lambda k: round(on[k] / off[k], 3) if off and off.get(k) and on.get(k) is not None else
                 (0.0 if off and off.get(k) and on.get(k) == 0 else None))
        for rid, label, val, tgt, ok in (
                (f"incast.{prof}.goodput_of_bottleneck", f"incast, {what}: aggregate goodput (all bytes from the "
                 "common start to the last end) / bottleneck", on.get("goodput_of_bottleneck"), ">= 0.9",
                 lambda v: v >= 0.9),
                (f"incast.{prof}.of_bottleneck", f"incast, {what}: bottleneck wire bytes while all send / bottleneck",
                 on["of_bottleneck"], ">= 0.9", lambda v: v >= 0.9),
                (f"incast.{prof}.jain", f"incast, {what}: Jain fairness of the 4 senders", on["jain"], ">= 0.9",
                 lambda v: v >= 0.9),
                (f"incast.{prof}.drops_vs_off", f"incast, {what}: bottleneck drops / with CC off",
                 ratio("q_dropped"), "< 1", lambda v: v < 1),
                (f"incast.{prof}.retx_vs_off", f"incast, {what}: retransmissions / with CC off",
                 ratio("retransmits"), "< 1", lambda v: v < 1)):
            out.append({"id": rid, "label": label, "value": val, "target": tgt,
                        "meets": None if val is None else ok(val), "not_available": na})
    for row in mp:
        if row["profile"] == "native":
            val = row["kept"]
            out.append({"id": "native.multipath_kept", "label": "native 64 KiB WRITE: goodput kept with one of 4 "
                        "links at 5 % loss", "value": val, "target": ">= 0.7",
                        "meets": None if val is None else val >= 0.7, "not_available": row["not_available"]})
    for size in SIZES:
        pt = next((p for p in points if p["profile"] == "native" and p["size"] == size and p["loss_ppm"] == 10_000),
                  None)
        if pt is None:
            continue
        val = pt["retained"]
        out.append({"id": f"native.retained_1pct.{size}", "label": f"native {size} B WRITE: goodput kept at 1 % loss",
                    "value": val, "target": ">= 0.8", "meets": None if val is None else val >= 0.8,
                    "not_available": pt["not_available"]})
    return out


def _save(plt, fig, path: Path) -> str:
    """Lay out, write and close one figure; its path as a string."""
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def plot(report: dict, out_dir: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    if report["points"]:
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
        for profile in PROFILES:
            for size in SIZES:
                xs = [(p["loss_ppm"] / 1e4, p["gbps"]) for p in report["points"]
                      if p["profile"] == profile and p["size"] == size and p["gbps"]]
                if xs:
                    ax.plot([max(x, 0.01) for x, _ in xs], [y for _, y in xs], marker="o",
                            ls="-" if profile == "native" else "--", label=f"{profile}, {size // 1024} KiB WRITE")
        ax.set_xscale("log")
        ax.set_xlabel("random loss on the last hop [%] (0 plotted at 0.01)")
        ax.set_ylabel("goodput [Gb/s]")
        ax.set_title(f"MetaRoCE on the emulated fabric: goodput vs loss ({report['options']['plane']} plane)", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(_save(plt, fig, out_dir / "goodput_loss.png"))
    if any(r["queue"] and not r["not_available"] for r in report.get("incast", [])):
        fig, ax = plt.subplots(figsize=(7, 3.5), dpi=110)
        for r in report["incast"]:
            if r["queue"] and not r["not_available"]:
                t0 = r["queue"][0][0]
                ax.plot([t - t0 for t, _ in r["queue"]], [b / 1000 for _, b in r["queue"]], lw=0.8,
                        label=f"{_cc_name(r)}: {r['aggregate_gbps']:.3f} Gb/s, {r['q_dropped']} drops")
        ax.axhline(INCAST_MARK / 1000, ls=":", color="grey", label="mark depth")
        ax.axhline(INCAST_DROP / 1000, ls="--", color="grey", label="drop depth")
        ax.set_xlabel("time [s]")
        ax.set_ylabel("bottleneck queue [KB]")
        ax.set_title("incast: 4 senders into one host through a 200 Mb/s bottleneck", fontsize=9)
        ax.legend(fontsize=7)
        paths.append(_save(plt, fig, out_dir / "incast_queue.png"))
    return paths


def _cc_name(r: dict) -> str:
    if r.get("profile", "compat") == "native":
        return f"native, CC + credits {'on' if r['cc'] else 'off'}"
    return f"compat, DCQCN {'on' if r['cc'] else 'off'}"


def render(report: dict) -> str:
    lines = [f"{'profile':8} {'size':>8} {'loss':>6} {'goodput Gb/s':>13} {'retained':>9} {'sent/needed':>12} "
             f"{'dropped':>8}"]
    for p in report["points"]:
        if p["not_available"]:
            lines.append(f"{p['profile']:8} {p['size']:>8} {p['loss_ppm'] / 1e4:>5g}% not available: "
                         f"{p['not_available']}")
            continue
        lines.append(f"{p['profile']:8} {p['size']:>8} {p['loss_ppm'] / 1e4:>5g}% {p['gbps']:>13.3f} "
                     f"{p['retained'] if p['retained'] is not None else '-':>9} {p['sent_over_needed']:>12} "
                     f"{p['dropped']:>8}")
    for m in report["multipath"]:
        if m["not_available"]:
            lines.append(f"multipath {m['profile']}: not available: {m['not_available']}")
        else:
            lines.append(f"multipath {m['profile']}: {m['healthy_gbps']:.3f} Gb/s on 4 healthy links ({m['links_used']} "
                         f"used), {m['degraded_gbps']:.3f} Gb/s with {m['bad_link']} at 5 % loss: kept {m['kept']}")
    for r in report["incast"]:
        head = f"incast, 4 senders, {_cc_name(r)}"
        if r["not_available"]:
            lines.append(f"{head}: not available: {r['not_available']}")
        else:
            lines.append(f"{head}: goodput {r.get('aggregate_goodput_gbps')} Gb/s ({r.get('goodput_of_bottleneck')} of "
                         f"the bottleneck, Jain {r.get('goodput_jain')}); on the wire {r['aggregate_gbps']:.3f} Gb/s "
                         f"({r['of_bottleneck']} of the bottleneck over the {r.get('interval_s')} s all four ran), "
                         f"flows {r['flows_gbps']} Gb/s, "
                         f"Jain {r['jain']}, queue drops {r['q_dropped']}, CE marks {r['marked']}, "
                         f"retransmissions {r.get('retransmits')}, timeouts {r.get('timeouts')}, "
                         f"goodput per sender {r.get('goodput_gbps')} Gb/s, senders {r.get('sender_progress')} "
                         f"(CPU share {r.get('sender_cpu')}, waiting for a CPU {r.get('sender_runq_wait')}, "
                         f"sleeps {r.get('sender_wakeups')})")
    for t in report["targets"]:
        val = "n/a" if t["value"] is None else f"{t['value']:.3f}"
        verdict = "not measured" if t["meets"] is None else "met" if t["meets"] else "NOT met"
        lines.append(f"target {t['label']}: {val} ({t['target']}): {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_fabric", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64 KiB only, 0 and 1 %% loss, fewer bytes")
    ap.add_argument("--plane", choices=("compiled",), default="compiled", help="data plane: compiled (the only one)")
    ap.add_argument("--json", metavar="FILE", help=f"write the report here (default {OUT_DIR.relative_to(ROOT)}/"
                    "fabric.json for a full run)")
    ap.add_argument("--plots", metavar="DIR", help=f"PNG directory (default {OUT_DIR.relative_to(ROOT)})")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--incast", action="store_true", help="the incast part only (native with CC and credits, "
                    "native with CC off, compat with DCQCN on and off)")
    ap.add_argument("--incast-bytes", type=int, default=8 << 20, metavar="N", help="bytes each incast sender "
                    "writes (default 8 MiB)")
    ap.add_argument("--incast-progress", choices=("spin", "sleep"), default="spin", help="the incast senders' "
                    "`metaroce perf --progress` (default spin: busy polling; sleep: idle, a sender's loop sleeps "
                    "until a SACK, a timer or its pacing deadline)")
    ap.add_argument("--incast-budget", type=int, default=INCAST_BUDGET, metavar="PKTS", help="metaroced's "
                    f"credit_budget for the native run with CC (default {INCAST_BUDGET})")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_fabric: needs root (network namespaces, BPF)", file=sys.stderr)
        return 2
    from metaroce_xdp import fabric

    def log(m: str) -> None:
        print(f"bench_fabric: {m}", file=sys.stderr, flush=True)

    sizes = SIZES[:1] if args.quick else SIZES
    losses = QUICK_LOSSES if args.quick else LOSSES
    total = (8 << 20) if args.quick else (32 << 20)
    profiles, missing = perf_profiles(args.plane)
    points, mp = [], []
    if not args.incast:
        name = f"bench{os.getpid() % 10000}"
        fab = fabric.up(name, hosts=2, paths=4)
        try:
            points = measure(fab, sizes, losses, profiles, missing, args.plane, total, log)
            mp = [] if args.quick else multipath(fab, profiles, missing, args.plane, total, log)
        except KeyboardInterrupt:
            print("bench_fabric: interrupted; fabric removed", file=sys.stderr)
            return 130
        finally:
            fab.down()
    inc = [] if args.quick and not args.incast else \
        [incast(args.plane, cc, args.incast_bytes, log, prof, args.incast_budget, args.incast_progress)
         for prof, cc in INCAST_CASES
         if prof in profiles or prof == "compat"]
    report = {"schema": SCHEMA, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "host": {"kernel": os.uname().release, "cpus": os.cpu_count(), "load_avg": os.getloadavg()},
              "options": {"quick": args.quick, "plane": args.plane, "seed": SEED, "bytes_per_point": total},
              "fabric": {"hosts": 2, "paths": 4, "loss_port": LOSS_PORT}, "points": points,
              "multipath": mp, "incast": inc, "targets": targets(points, mp, inc), "plots": []}
    out = args.json or (None if args.quick or args.incast else str(OUT_DIR / "fabric.json"))
    if not args.no_plots:
        try:
            report["plots"] = plot(report, Path(args.plots) if args.plots else OUT_DIR)
        except Exception as e:  # noqa: BLE001 - the measurements matter more than their picture
            print(f"bench_fabric: no plots ({type(e).__name__}: {e})", file=sys.stderr)
    if out:
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
    print(render(report))
    failed = [p for p in points if p["not_available"] and p["profile"] in profiles]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
