"""Through the daemon vs in process, same run: 8-byte WRITE latency and 64 KiB WRITE bandwidth.

    python -m metaroce_xdp.daemon.bench [--rounds 3] [--lat-iters 2000] [--bw-iters 2000] [--progress busy]

Builds two namespaces on a veth.  In-process bar: `metaroce perf write-lat / write-bw --plane compiled`
(client in A, server in B).  Through the daemon: one metaroced per namespace (this package's server
runner) and two client processes (tests/daemon_players.py: perftest-style write-lat, and a 64 KiB WRITE
stream with 32 outstanding).  The two alternate `--rounds` times; prints each figure and the ratios
(daemon / in-process) as JSON lines.  Not a test: run it on a quiet machine and compare ratios.
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

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "tools.metaroce_cli", "perf"]


def _perf(topo, test: str, args: list[str], port: int) -> dict:
    srv = topo.popen(topo[1], [*CLI, test, "-d", "mr1", "--plane", "compiled", "--json", "-p", str(port)],
                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(120):
        cli = topo.run(topo[0], [*CLI, test, "-d", "mr0", "--plane", "compiled", "--json", "-p", str(port), *args,
                                 "10.77.0.2"], timeout=300, check=False)
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
            if s.startswith("{") and "progress" not in s:
                return json.loads(s)

    def send(self, **c) -> None:
        self.p.stdin.write(json.dumps(c) + "\n")
        self.p.stdin.flush()

    def ok(self, _wait: float = 60, **c) -> dict:
        self.send(**c)
        r = self.line(_wait)
        if not r.get("ok"):
            raise RuntimeError(f"{self.name}: {c} -> {r}")
        return r


def _daemon_run(topo, tmp: str, progress: str, lat_iters: int, bw_iters: int, port: int) -> dict:
    procs = []
    try:
        socks = {}
        for i, (ns, ifname) in enumerate(((topo[0], "mr0"), (topo[1], "mr1"))):
            sock = os.path.join(tmp, f"{ifname}.sock")
            cfg = os.path.join(tmp, f"{ifname}.toml")
            Path(cfg).write_text(f'interfaces = ["{ifname}"]\nsocket_path = "{sock}"\nprogress = "{progress}"\n'
                                 f'bpffs_prefix = "{tmp}/bpf/metaroce"\n')
            p = Proc(topo.popen(ns, [sys.executable, "-m", "metaroce_xdp.daemon.server", "--config", cfg],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
                                cwd=str(ROOT)), ifname)
            procs.append(p)
            socks[ifname] = sock
        for p in procs:
            assert p.line(180).get("ready")
        pl = []
        for ns, ifname in ((topo[0], "mr0"), (topo[1], "mr1")):
            p = Proc(topo.popen(ns, [sys.executable, str(ROOT / "tests" / "daemon_players.py"), socks[ifname], ifname],
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
        b.send(cmd="lat", iters=lat_iters, active=False)
        lat = a.ok(300, cmd="lat", iters=lat_iters, active=True)
        b.line(60)
        bw = a.ok(300, cmd="stream", n=bw_iters, size=65536, window=32, timeout=240)
        if "median_us" not in lat:
            raise RuntimeError(f"write-lat through the daemon: {lat}")
        return {"lat_median_us": lat["median_us"], "lat_p99_us": lat["p99_us"],
                "gbps": bw_iters * 65536 * 8 / bw["seconds"] / 1e9}
    finally:
        for p in procs:
            try:
                p.p.terminate()
                p.p.wait(timeout=20)
            except Exception:   # noqa: BLE001
                p.p.kill()


def main(argv: list[str] | None = None) -> int:
    from metaroce_xdp.topo import two_hosts
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lat-iters", type=int, default=2000)
    ap.add_argument("--bw-iters", type=int, default=2000)
    ap.add_argument("--progress", default="busy", choices=("busy", "sleep"))
    a = ap.parse_args(argv)
    topo, _ = two_hosts()
    tmp = tempfile.mkdtemp(prefix="mrbench-")
    os.mkdir(os.path.join(tmp, "bpf"))
    port = 19700
    try:
        for r in range(a.rounds):
            port += 2
            lat = _perf(topo, "write-lat", ["-s", "8", "-n", str(a.lat_iters)], port)
            bw = _perf(topo, "write-bw", ["-s", "65536", "-n", str(a.bw_iters)], port + 1)
            inproc = {"lat_median_us": lat["lat_us"].get("median", lat["lat_us"].get("typical")),
                      "gbps": bw["gbps"]}
            d = _daemon_run(topo, tmp, a.progress, a.lat_iters, a.bw_iters, port + 50)
            print(json.dumps({"round": r, "in_process": inproc, "daemon": d,
                              "lat_ratio": d["lat_median_us"] / inproc["lat_median_us"],
                              "bw_ratio": d["gbps"] / inproc["gbps"]}), flush=True)
    finally:
        topo.close()
        subprocess.run(["rm", "-rf", tmp], check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
