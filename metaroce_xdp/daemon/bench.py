"""Through the daemon vs in process, same run: 8-byte WRITE latency and 64 KiB WRITE bandwidth.

    python -m metaroce_xdp.daemon.bench [--rounds 3] [--lat-iters 2000] [--bw-iters 2000] [--progress busy]
                                        [--pin sides|cross|none] [--trace]

Builds two namespaces on a veth.  In-process bar: `metaroce perf write-lat / write-bw --plane compiled`
(client in A, server in B).  Through the daemon: one metaroced per namespace (this package's server
runner) and two client processes (tests/daemon_players.py: perftest-style write-lat, and a 64 KiB WRITE
stream with 32 outstanding).  The two alternate `--rounds` times; prints each figure and the ratios
(daemon / in-process) as JSON lines.  Not a test: run it on a quiet machine and compare ratios.

Placement (--pin, taskset): `sides` (default) puts everything of host A on CPU 0 and of host B on CPU 1 --
the in-process perf client on 0 and its server on 1; daemon A and client A on 0, daemon B and client B
on 1; `cross` puts daemon A with client B (CPU 0) and daemon B with client A (CPU 1), in-process as
`sides`; `none` leaves it to the scheduler.

--trace splits the daemon path's one-way trip (A's write seen by B, and B's answer seen by A), from
timestamps (CLOCK_MONOTONIC, one clock for every process): the client's post (start, end), the daemon's
loop taking the entry, its round that sent the packet (after the kick), the peer daemon's round that
placed the payload, the peer client seeing it (dp/serve.py trace; tests/daemon_players.py lat trace).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from .. import shm

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "metaroce_xdp.cli", "perf"]


PLACEMENTS = {"sides": {"perf_a": "0", "perf_b": "1", "daemon_a": "0", "client_a": "0", "daemon_b": "1",
                         "client_b": "1"},
              "cross": {"perf_a": "0", "perf_b": "1", "daemon_a": "0", "client_b": "0", "daemon_b": "1",
                        "client_a": "1"},
              "none": {}}


def _on(pin: dict, who: str) -> list[str]:
    """The argv prefix placing `who` (perf_a, daemon_b, ...) on its CPU (taskset), or nothing."""
    cpu = pin.get(who)
    return ["taskset", "-c", cpu] if cpu is not None else []


def _perf(topo, test: str, args: list[str], port: int, pin: dict | None = None) -> dict:
    pin = pin or {}
    srv = topo.popen(topo[1], [*_on(pin, "perf_b"), *CLI, test, "-d", "mr1", "--plane", "compiled", "--json", "-p",
                               str(port), "--no-daemon"],
                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(120):
        cli = topo.run(topo[0], [*_on(pin, "perf_a"), *CLI, test, "-d", "mr0", "--plane", "compiled", "--json", "-p",
                                 str(port), *args,
                                 "--no-daemon", "10.77.0.2"], timeout=300, check=False)
        if "start `metaroce perf" not in cli.stderr:
            break
        time.sleep(0.5)
    srv.communicate(timeout=60)
    if cli.returncode:
        raise RuntimeError(cli.stderr[-2000:])
    return json.loads(cli.stdout.strip().splitlines()[-1])


class Proc:
    """A child speaking JSON lines on stdout (and stdin): the daemon runner and tests/daemon_players.py."""

    def __init__(self, p: subprocess.Popen, name: str) -> None:
        self.p, self.name = p, name
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            self.q.put(line)
        self.q.put(None)

    def line(self, timeout: float = 60) -> dict:
        while True:
            try:
                s = self.q.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"{self.name}: no answer within {timeout}s") from None
            if s is None:
                raise EOFError(f"{self.name} exited ({self.p.poll()})")
            s = s.strip()
            if s.startswith("{"):
                d = json.loads(s)
                if "progress" not in d:                # a key of progress reports, not a word in a reply
                    return d

    def send(self, **c) -> None:
        self.p.stdin.write(json.dumps(c) + "\n")
        self.p.stdin.flush()

    def ok(self, _wait: float = 60, **c) -> dict:
        self.send(**c)
        r = self.line(_wait)
        if not r.get("ok"):
            raise RuntimeError(f"{self.name}: {c} -> {r}")
        return r


def _daemon_run(topo, tmp: str, progress: str, lat_iters: int, bw_iters: int, port: int, pin: dict | None = None,
                trace: bool = False) -> dict:
    """Latency and bandwidth through two daemons; with trace, "split": the one-way trip's parts (_split)."""
    procs = []
    pin = pin or {}
    tpath = os.path.join(tmp, f"trace{port}")
    try:
        dprocs, socks, _ = _start_daemons(topo, tmp, progress, pin=pin, trace=tpath if trace else None)
        procs += dprocs
        pl = []
        for ns, ifname, who in ((topo[0], "mr0", "client_a"), (topo[1], "mr1", "client_b")):
            p = Proc(topo.popen(ns, [*_on(pin, who), sys.executable, str(ROOT / "tests" / "daemon_players.py"),
                                     socks[ifname], ifname],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, cwd=str(ROOT)),
                     ifname)
            assert p.line(60)["ready"]
            procs.append(p)
            pl.append(p)
        a, b = pl
        a.ok(cmd="setup", size=1 << 20, seed=1), b.ok(cmd="setup", size=1 << 20, seed=2)
        b.ok(cmd="listen", port=port)
        b.send(cmd="accept")
        a.ok(cmd="connect", host="10.77.0.2", port=port)
        assert b.line()["ok"]
        b.send(cmd="lat", iters=lat_iters, active=False, trace=trace)
        lat = a.ok(300, cmd="lat", iters=lat_iters, active=True, trace=trace)
        blat = b.line(60)
        bw = a.ok(300, cmd="stream", n=bw_iters, size=65536, window=32, timeout=240)
        if "median_us" not in lat:
            raise RuntimeError(f"write-lat through the daemon: {lat}")
        out = {"lat_median_us": lat["median_us"], "lat_p99_us": lat["p99_us"], "lat_min_us": lat.get("min_us"),
               "lat_p10_us": lat.get("p10_us"), "gbps": bw_iters * 65536 * 8 / bw["seconds"] / 1e9}
    finally:
        _stop(procs)
    if trace:
        import numpy as np
        out["split"] = _split(lat, blat, np.load(f"{tpath}.mr0.npy"), np.load(f"{tpath}.mr1.npy"))
    return out


def _split(a: dict, b: dict, ta, tb) -> dict:
    """Median (and 10th percentile: the path without the scheduler's delays, mostly) µs of each part of the
    one-way trip through the daemons, both directions pooled, from the
    clients' times (a, b: lat's t_post0 / t_post1 / t_seen) and the daemons' traces (ta, tb: dp/serve.py
    traced(), rows (ns, kind, count)):

      post        client's post_send (start to return)
      to_take     post's start -> its daemon's loop took the entry
      take_to_tx  taken -> the end of the round that sent it (after the kick: the frame is in the peer's
                  AF_XDP ring, veth delivers it in the sender's system call)
      tx_to_rx    sent -> the end of the peer daemon's round that placed the payload
      rx_to_seen  that round's end -> the peer client saw the bytes change
      one_way     post's start -> seen (the sum)

    The A->B trip of iteration i starts at A's post i; the B->A trip at B's post i (after B saw i)."""
    import numpy as np
    from ..dp import serve as sv

    def times(t, kind):
        return t[t[:, 1] == kind, 0]

    def after(ts, x):
        """The first time in the sorted ts at or after each x (NaN past the end)."""
        j = np.searchsorted(ts, x)
        out = np.full(len(x), np.nan)
        ok = j < len(ts)
        out[ok] = ts[j[ok]]
        return out

    parts: dict[str, list] = {k: [] for k in ("post", "to_take", "take_to_tx", "tx_to_rx", "rx_to_seen", "one_way")}
    for src, dst, ts, td in ((a, b, ta, tb), (b, a, tb, ta)):
        p0 = np.array(src["t_post0"], np.float64)
        p1 = np.array(src["t_post1"], np.float64)
        seen = np.array(dst["t_seen"], np.float64)
        n = min(len(p0), len(seen))
        p0, p1, seen = p0[:n], p1[:n], seen[:n]
        take = after(times(ts, sv.T_TAKE), p0)
        tx = after(times(ts, sv.T_TX), take)
        rx = after(times(td, sv.T_RX), take)
        k = slice(n // 10, n)            # as lat's median: the first tenth is warm-up
        for name, v in (("post", p1 - p0), ("to_take", take - p0), ("take_to_tx", tx - take), ("tx_to_rx", rx - tx),
                        ("rx_to_seen", seen - rx), ("one_way", seen - p0)):
            parts[name].append(v[k])
    return {name: [round(float(np.nanmedian(np.concatenate(v))) / 1000, 2),
                   round(float(np.nanpercentile(np.concatenate(v), 10)) / 1000, 2)] for name, v in parts.items()}


def _start_daemons(topo, tmp: str, progress: str, extra: str = "", pin: dict | None = None,
                   trace: str | None = None) -> tuple[list[Proc], dict, list[float]]:
    """One metaroced (this package's runner) per namespace: (their Procs, socket by interface, seconds to ready).
    pin: PLACEMENTS' daemon_a / daemon_b; trace: each daemon's loop traced into <trace>.<ifname>.npy."""
    procs, socks, t0 = [], {}, time.monotonic()
    env = {**os.environ, "METAROCE_DP_TRACE": trace} if trace else None
    for ns, ifname, who in ((topo[0], "mr0", "daemon_a"), (topo[1], "mr1", "daemon_b")):
        sock = os.path.join(tmp, f"{ifname}.sock")
        cfg = os.path.join(tmp, f"{ifname}.toml")
        Path(cfg).write_text(f'interfaces = ["{ifname}"]\nsocket_path = "{sock}"\nprogress = "{progress}"\n'
                             f'bpffs_prefix = "{tmp}/bpf/metaroce"\n{extra}')
        procs.append(Proc(topo.popen(ns, [*_on(pin or {}, who), sys.executable, "-m", "metaroce_xdp.daemon.server",
                                          "--config", cfg],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
                                     cwd=str(ROOT), preexec_fn=_die_with_parent, env=env), ifname))
        socks[ifname] = sock
    ready = []
    for p in procs:
        r = p.line(180)
        assert r.get("ready"), r
        p.pid = r["pid"]
        ready.append(time.monotonic() - t0)
    return procs, socks, ready


def _die_with_parent() -> None:
    """Popen preexec_fn: the daemon is SIGKILLed if this process dies (no orphan left spinning)."""
    import ctypes
    import signal
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)         # PR_SET_PDEATHSIG


def _stop(procs: list[Proc]) -> None:
    for p in procs:
        try:
            p.p.terminate()
            p.p.wait(timeout=20)
        except Exception:   # noqa: BLE001
            p.p.kill()


def _rss(pid: int) -> int:
    import psutil
    return psutil.Process(pid).memory_info().rss


def scale_run(topo, tmp: str, nqps: int = 1000, clients: int = 4, size: int = 1024, rounds: int = 2,
              progress: str = "sleep", port: int = 19900) -> dict:
    """`nqps` connected QPs on each of two daemons (`clients` client processes per daemon, `nqps/clients` QPs
    each, client i of A connected QP by QP to client i of B), then every QP WRITEs at once in both directions,
    `rounds` times.  Returns the completions by status, whether every byte arrived (sha256 of each
    destination range against its source), the daemons' snapshots' QP states, and the memory per QP: the
    daemon's RSS growth over the QPs' creation and connection / nqps, and the shared memory per QP.

    The QPs' ACK timeout is 18 (1.07 s): all QPs post at once, so their go-back-N timers would fire together,
    and with 4.096 us x 2^14 = 67 ms (a loaded 2-CPU host takes longer than that to pump a 2,000-WR burst)
    every retransmission round repeats the burst that overflowed the AF_XDP rings, until RETRY_EXC_ERR.
    Writes of one packet (1 KiB at path MTU 1024) keep a burst within the rings."""
    from ..dp import layout as L
    per = nqps // clients
    procs: list[Proc] = []
    try:
        dprocs, socks, ready = _start_daemons(topo, tmp, progress, f"max_clients = {clients + 2}\n"
                                              f"max_qps_per_client = {per + 1}\n")
        procs += dprocs
        side: dict[str, list[Proc]] = {"mr0": [], "mr1": []}
        for ns, ifname in ((topo[0], "mr0"), (topo[1], "mr1")):
            for i in range(clients):
                p = Proc(topo.popen(ns, [sys.executable, str(ROOT / "tests" / "daemon_players.py"), socks[ifname],
                                         ifname], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                    cwd=str(ROOT)), f"{ifname} client {i}")
                procs.append(p)
                side[ifname].append(p)
        for p in side["mr0"] + side["mr1"]:
            assert p.line(120)["ready"]
        setups = {}
        for k, p in enumerate(side["mr0"] + side["mr1"]):
            setups[p.name] = p.ok(cmd="setup", size=2 * per * size, seed=100 + k)
        rss0 = [_rss(d.pid) for d in dprocs]
        t0 = time.monotonic()
        for p in side["mr0"] + side["mr1"]:
            p.send(cmd="many", n=per)
        qpns = {p.name: p.line(600)["qpns"] for p in side["mr0"] + side["mr1"]}
        ips = {"mr0": "10.77.0.2", "mr1": "10.77.0.1"}                  # the peer's address, seen from each side
        for ifname, other in (("mr0", "mr1"), ("mr1", "mr0")):
            for a, b in zip(side[ifname], side[other]):
                a.send(cmd="many_connect", qpns=qpns[b.name], ip=ips[ifname], va=setups[b.name]["va"],
                       rkey=setups[b.name]["rkey"])
        rts = sum(p.line(600)["rts"] for p in side["mr0"] + side["mr1"])
        setup_s = time.monotonic() - t0
        rss1 = [_rss(d.pid) for d in dprocs]
        for p in side["mr0"] + side["mr1"]:
            p.send(cmd="many_write", size=size, rounds=rounds, timeout=120)
        statuses: dict[str, int] = {}
        secs = []
        for p in side["mr0"] + side["mr1"]:
            r = p.line(300)
            assert r.get("ok"), r
            secs.append(r["seconds"])
            for k, v in r["statuses"].items():
                statuses[k] = statuses.get(k, 0) + v
        intact = 0
        for ifname, other in (("mr0", "mr1"), ("mr1", "mr0")):
            for a, b in zip(side[ifname], side[other]):
                src = a.ok(cmd="digest", off=0, len=per * size)["sha"]
                dst = b.ok(cmd="digest", off=per * size, len=per * size)["sha"]
                intact += src == dst
        from .client import status
        states: dict[str, int] = {}
        resent = 0
        for ifname in ("mr0", "mr1"):
            snap = status(socks[ifname])
            for q in snap["qps"]:
                states[q["state"]] = states.get(q["state"], 0) + 1
            resent += int(snap["devices"][0]["counters"]["plane"].get("retransmits") or 0)
        ring = shm.round_page(shm.qp_words(2, 1) * 8)
        arena = (L.NQ + L.MAX_RD * L.NJ + 1) * 8 + 128
        return {"size": size, "qps_per_daemon": per * clients, "clients_per_daemon": clients, "rts": rts, "setup_s": setup_s,
                "statuses": statuses, "writes": 2 * per * clients * rounds, "write_s_max": max(secs),
                "intact_pairs": intact, "pairs": 2 * clients, "states": states, "retransmits": resent,
                "rss_per_qp_bytes": [round((b - a) / (per * clients)) for a, b in zip(rss0, rss1)],
                "ring_bytes_per_qp": ring, "plane_row_bytes_per_qp": arena, "ready_s": ready}
    finally:
        _stop(procs)


def start_to_ready(topo, tmp: str, progress: str = "sleep", entry: str = "server") -> dict:
    """One daemon alone, exec to ready (numba's cache warm from the runs before it): {"ready_s": seconds
    measured here, "startup": the daemon's own phase times (startup.StartClock.as_dict)}.
    entry "server": `python -m metaroce_xdp.daemon.server`, ready when it prints its ready line (the tests'
    runner); "metaroced": `python -m metaroce_xdp.daemon` with $NOTIFY_SOCKET, ready at READY=1 (the systemd service)."""
    import re
    import socket
    sub = os.path.join(tmp, "ready")
    os.makedirs(os.path.join(sub, "bpf"), exist_ok=True)
    sock = os.path.join(sub, "mr0.sock")
    cfg = os.path.join(sub, "mr0.toml")
    Path(cfg).write_text(f'interfaces = ["mr0"]\nsocket_path = "{sock}"\nprogress = "{progress}"\n'
                         f'bpffs_prefix = "{sub}/bpf/metaroce"\n')
    if entry == "server":
        t0 = time.monotonic()
        p = Proc(topo.popen(topo[0], [sys.executable, "-m", "metaroce_xdp.daemon.server", "--config", cfg],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1, cwd=str(ROOT),
                            preexec_fn=_die_with_parent), "mr0")
        try:
            r = p.line(180)
            assert r.get("ready"), r
            return {"ready_s": time.monotonic() - t0, "startup": r.get("startup")}
        finally:
            _stop([p])
    if entry != "metaroced":
        raise ValueError(f"entry {entry!r}: server or metaroced")
    nsock = os.path.join(sub, "notify.sock")
    if os.path.exists(nsock):
        os.unlink(nsock)
    ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ns.bind(nsock)
    log_path = os.path.join(sub, "metaroced.log")
    env = dict(os.environ, NOTIFY_SOCKET=nsock)
    env.pop("JOURNAL_STREAM", None)
    try:
        with open(log_path, "w") as err:
            t0 = time.monotonic()
            p = Proc(topo.popen(topo[0], [sys.executable, "-m", "metaroce_xdp.daemon", "--config", cfg, "--no-watchdog"],
                                stdout=subprocess.PIPE, stderr=err, text=True, cwd=str(ROOT), env=env,
                                preexec_fn=_die_with_parent), "mr0")
        try:
            ns.settimeout(1.0)
            while True:
                try:
                    msg = ns.recv(4096).decode()
                except socket.timeout:
                    if p.p.poll() is not None or time.monotonic() - t0 > 180:
                        raise RuntimeError(f"metaroced: no READY=1 ({Path(log_path).read_text()[-500:]})")
                    continue
                if msg.startswith("READY=1"):
                    ready_s = time.monotonic() - t0
                    break
            out = {"ready_s": ready_s, "startup": None}
            for _ in range(50):
                m = re.search(r"start-up phases \(s\): (.*)", Path(log_path).read_text())
                if m:
                    out["startup"] = parse_phases(m.group(1))
                    break
                time.sleep(0.02)
            return out
        finally:
            _stop([p])
    finally:
        ns.close()


def parse_phases(text: str) -> dict:
    """StartClock.text() back into the shape of as_dict() (metaroced's log line; wall times only)."""
    import re
    main, _, side = text.partition("; meanwhile in threads: ")
    main = re.sub(r" \(cpu [0-9.]+\)$", "", main)
    def pairs(s: str) -> dict:
        out = {}
        for item in filter(None, (x.strip() for x in s.split(","))):
            name, _, v = item.rpartition(" ")
            out[name] = float(v)
        return out
    phases = pairs(main)
    return {"total_s": round(sum(phases.values()), 4), "phases": phases, "threads": pairs(side)}


def ready_runs(n: int, entry: str = "server", log: Callable[[str], None] = print) -> dict:
    """n starts (one topology): best and median of exec to ready and of each phase."""
    import statistics
    from metaroce_xdp.topo import two_hosts
    topo, _ = two_hosts(prefix="mrready")
    tmp = tempfile.mkdtemp(prefix="mrbench-ready-")
    runs = []
    try:
        for i in range(n):
            r = start_to_ready(topo, tmp, entry=entry)
            r["load"] = round(os.getloadavg()[0], 2)
            runs.append(r)
            log(json.dumps({"run": i, **r}))
    finally:
        topo.close()
        subprocess.run(["rm", "-rf", tmp], check=False)
    def stats(vals: list[float]) -> dict:
        return {"best": round(min(vals), 3), "median": round(statistics.median(vals), 3)}
    out = {"entry": entry, "n": n, "ready_s": stats([r["ready_s"] for r in runs]), "phases": {}, "threads": {},
           "cpu": {}, "threads_cpu": {}}
    for key in ("phases", "threads", "cpu", "threads_cpu"):
        names = [k for r in runs if r["startup"] for k in r["startup"].get(key, {})]
        for name in dict.fromkeys(names):
            out[key][name] = stats([r["startup"].get(key, {}).get(name, 0.0) for r in runs if r["startup"]])
    return out


ROW_IDS = {"daemon.lat8.ratio": "8 B WRITE latency: through metaroced / in process",
           "daemon.bw64k.ratio": "64 KiB WRITE bandwidth: through metaroced / in process",
           "daemon.qps1000.rss_per_qp": "1,000 QPs on one daemon: daemon RSS growth per QP",
           "daemon.qps1000.writes": "1,000 QPs per daemon, all WRITEing at once: completions OK",
           "daemon.ready_s": "metaroced start to ready (numba cache warm)"}


def bench_rows(row: Callable[..., dict], log: Callable[[str], None], quick: bool = False,
               skip: str | None = None) -> list[dict]:
    """The daemon's section of `make bench` (tools/bench.py calls this with its `row` maker and log): in
    process vs through metaroced, same run and topology (8-byte WRITE latency, 64 KiB WRITE bandwidth and
    their ratios), 1,000 QPs on one daemon (memory per QP; every WRITE's status) and start to ready with
    numba's cache warm.  Its own namespaces; a part that fails is a row saying why, the others still count."""
    if skip:                      # e.g. `make bench --quick`: one row per figure, saying why not
        return [row(rid, "daemon", label, na=skip) for rid, label in ROW_IDS.items()]
    from metaroce_xdp.topo import two_hosts
    lat_n, bw_n = (300, 400) if quick else (2000, 2000)
    rows: list[dict] = []
    g = "daemon"
    topo, _ = two_hosts()
    tmp = tempfile.mkdtemp(prefix="mrbench-daemon-")
    os.mkdir(os.path.join(tmp, "bpf"))
    try:
        try:
            pin = PLACEMENTS["sides"]
            lat = _perf(topo, "write-lat", ["-s", "8", "-n", str(lat_n)], 19800, pin)
            bw = _perf(topo, "write-bw", ["-s", "65536", "-n", str(bw_n)], 19801, pin)
            inp = {"lat": lat["lat_us"].get("median", lat["lat_us"].get("typical")), "gbps": bw["gbps"]}
            log(f"daemon section: in process {inp}")
            d = _daemon_run(topo, tmp, "busy", lat_n, bw_n, 19850, pin)
            log(f"daemon section: through metaroced {d}")
            cfg = (f"compiled plane; {lat_n} / {bw_n} iterations; daemons in busy mode; client processes; host A's "
                   "processes on CPU 0, host B's on CPU 1 (taskset)")
            rows += [row("daemon.lat8.inproc_us", g, "8 B WRITE latency, in-process compiled engine (median)",
                         inp["lat"], "us", cfg),
                     row("daemon.lat8.daemon_us", g, "8 B WRITE latency, through metaroced from another process",
                         d["lat_median_us"], "us", cfg),
                     row("daemon.lat8.ratio", g, "latency: through metaroced / in process",
                         d["lat_median_us"] / inp["lat"], "x", target="<= 1.1",
                         meets=d["lat_median_us"] / inp["lat"] <= 1.1),
                     row("daemon.bw64k.inproc_gbps", g, "64 KiB WRITE bandwidth, in-process compiled engine",
                         inp["gbps"], "Gb/s", cfg),
                     row("daemon.bw64k.daemon_gbps", g, "64 KiB WRITE bandwidth, through metaroced (32 outstanding)",
                         d["gbps"], "Gb/s", cfg),
                     row("daemon.bw64k.ratio", g, "bandwidth: through metaroced / in process", d["gbps"] / inp["gbps"],
                         "x", target=">= 0.9", meets=d["gbps"] / inp["gbps"] >= 0.9)]
        except Exception as e:   # noqa: BLE001 - the section's other parts still count
            log(f"daemon section: latency/bandwidth failed: {e}")
            rows.append(row("daemon.lat8.ratio", g, "through metaroced vs in process", na=f"failed: {str(e)[:300]}"))
        try:
            sc = scale_run(topo, tmp)
            log(f"daemon section: 1000 QPs {sc}")
            ok = sc["statuses"] == {"SUCCESS": sc["writes"]} and sc["intact_pairs"] == sc["pairs"]
            rows += [row("daemon.qps1000.rss_per_qp", g, "1,000 QPs on one daemon: daemon RSS growth per QP",
                         max(sc["rss_per_qp_bytes"]) / 1024, "KiB",
                         f"creation + connection of {sc['qps_per_daemon']} QPs (4 clients), psutil RSS, larger of "
                         f"2 daemons; plus {sc['ring_bytes_per_qp']} B shared rings (memfd) and "
                         f"{sc['plane_row_bytes_per_qp']} B preallocated data-plane row per QP"),
                     row("daemon.qps1000.writes", g, "1,000 QPs per daemon, all WRITEing at once: completions OK",
                         sc["statuses"].get("SUCCESS", 0), "WRs",
                         f"of {sc['writes']} of {sc['size']} B ({sc['statuses']}, {sc['retransmits']} retransmitted); data intact in {sc['intact_pairs']}/{sc['pairs']} "
                         f"client pairs; set-up of 2,000 QPs {sc['setup_s']:.1f} s",
                         target=f"= {sc['writes']}", meets=ok)]
        except Exception as e:   # noqa: BLE001
            log(f"daemon section: 1000 QPs failed: {e}")
            rows.append(row("daemon.qps1000.rss_per_qp", g, "1,000 QPs on one daemon", na=f"failed: {str(e)[:300]}"))
        try:
            r = start_to_ready(topo, tmp)
            t = r["ready_s"]
            phases = ", ".join(f"{k} {v:.2f}" for k, v in (r["startup"] or {}).get("phases", {}).items())
            rows.append(row("daemon.ready_s", g, "metaroced start to ready (numba cache warm)", t, "s",
                            "one daemon, one interface; BCC compiles the XDP program at every start; phases (s): "
                            + (phases or "not reported"), target="< 3", meets=t < 3))
        except Exception as e:   # noqa: BLE001
            rows.append(row("daemon.ready_s", g, "metaroced start to ready", na=f"failed: {str(e)[:300]}"))
    finally:
        topo.close()
        subprocess.run(["rm", "-rf", tmp], check=False)
    return rows


def main(argv: list[str] | None = None) -> int:
    from metaroce_xdp.topo import two_hosts
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lat-iters", type=int, default=2000)
    ap.add_argument("--bw-iters", type=int, default=2000)
    ap.add_argument("--progress", default="busy", choices=("busy", "sleep"))
    ap.add_argument("--pin", default="sides", choices=tuple(PLACEMENTS), help="CPU placement (module docstring)")
    ap.add_argument("--trace", action="store_true", help="split the daemon path's one-way trip (module docstring)")
    ap.add_argument("--section", action="store_true", help="the rows `make bench` shows (bench_rows), as JSON lines")
    ap.add_argument("--quick", action="store_true", help="with --section: fewer iterations")
    ap.add_argument("--ready", type=int, metavar="N", help="only start to ready, N starts: best and median per phase")
    ap.add_argument("--entry", default="server", choices=("server", "metaroced"),
                    help="with --ready: the tests' runner (server) or the service (metaroced, READY=1)")
    a = ap.parse_args(argv)
    if a.ready:
        print(json.dumps(ready_runs(a.ready, a.entry, lambda m: print(m, file=sys.stderr, flush=True)), indent=1))
        return 0
    if a.section:
        def mkrow(rid, group, label, value=None, unit="", config=None, na=None, target=None, meets=None):
            return {"id": rid, "label": label, "value": value, "unit": unit, "config": config, "not_available": na,
                    "target": target, "meets": meets}
        for r in bench_rows(mkrow, lambda m: print(m, file=sys.stderr, flush=True), a.quick):
            print(json.dumps(r), flush=True)
        return 0
    topo, _ = two_hosts()
    tmp = tempfile.mkdtemp(prefix="mrbench-")
    os.mkdir(os.path.join(tmp, "bpf"))
    port = 19700
    try:
        for r in range(a.rounds):
            port += 2
            pin = PLACEMENTS[a.pin]
            lat = _perf(topo, "write-lat", ["-s", "8", "-n", str(a.lat_iters)], port, pin)
            bw = _perf(topo, "write-bw", ["-s", "65536", "-n", str(a.bw_iters)], port + 1, pin)
            inproc = {"lat_median_us": lat["lat_us"].get("median", lat["lat_us"].get("typical")),
                      "lat_min_us": lat["lat_us"].get("min"), "gbps": bw["gbps"]}
            d = _daemon_run(topo, tmp, a.progress, a.lat_iters, a.bw_iters, port + 50, pin, a.trace)
            print(json.dumps({"round": r, "pin": a.pin, "load": round(os.getloadavg()[0], 1),
                              "in_process": inproc, "daemon": d,
                              "lat_ratio": d["lat_median_us"] / inproc["lat_median_us"],
                              "bw_ratio": d["gbps"] / inproc["gbps"]}), flush=True)
    finally:
        topo.close()
        subprocess.run(["rm", "-rf", tmp], check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
