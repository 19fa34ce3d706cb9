"""`metaroce perf` as real processes in the two namespaces of metaroce_xdp.topo.two_hosts: the server
in host 1 (mr1), the client in host 0 (mr0, to 10.77.0.2) -- what the perf tests share."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PERF = [sys.executable, "-m", "metaroce_xdp.cli", "perf"]


def _last_json(text: str) -> dict | None:
    lines = text.strip().splitlines()
    return json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None


def perf_run(topo, test: str, port: int, server_args: list[str], client_args: list[str], *,
             timeout: float = 120, prefix: tuple[str, ...] = (), ns: tuple[str, str] | None = None,
             devs: tuple[str, str] = ("mr0", "mr1"), server_ip: str = "10.77.0.2") -> tuple[dict, dict | None]:
    """Start `metaroce perf TEST` as the server, run the client (again while the server is still
    starting), wait for both, check both exited 0; the client's and the server's JSON (--json is
    given to both).  `prefix` goes before the command (e.g. env VAR=value); `ns` is (client's,
    server's) namespace, topo[0] and topo[1] by default; `devs` their interfaces; `server_ip` what the
    client connects to."""
    common = ["--json", "-p", str(port)]
    cns, sns = ns or (topo[0], topo[1])
    srv = topo.popen(sns, [*prefix, *PERF, test, "-d", devs[1], *common, *server_args], cwd=ROOT,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(60):
            cli = topo.run(cns, [*prefix, *PERF, test, "-d", devs[0], *common, *client_args, server_ip],
                           timeout=timeout, check=False)
            if "start `metaroce perf" not in cli.stderr:
                break
            time.sleep(0.5)                       # the server is still starting
        out, err = srv.communicate(timeout=60)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert srv.returncode == 0, err[-2000:]
    return json.loads(cli.stdout.strip().splitlines()[-1]), _last_json(out)
