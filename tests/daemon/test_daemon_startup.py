"""metaroced's start to ready (docs/daemon.md, "Start to READY"): where the time goes, and what it skips.

* StartClock's phases add up to its total, repeated marks add up, CPU time is kept per phase, and the
  text of the log line parses back (daemon/bench.py reads it from metaroced's log);
* kern/bccbuild.py (imported first thing, without layout.py) compiles with the flags XdpLoader would
  use, and its defaults are layout.py's; importing it imports neither numpy nor numba;
* XdpLoader takes a program compiled beforehand when the flags match, and compiles again (closing the
  other) when they do not;
* a real start in a namespace: the phases are reported (the BCC thread's compile and load among them),
  ready means serving (the driver thread runs dp_serve, the socket answers `status`), nothing is
  compiled by numba, dp/inproc.py's entry points (the in-process plane's) are not loaded, and of the
  native profile's functions only the three Python calls, and only when the profile allows native QPs.
No timing is asserted: the machine is shared.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from metaroce_xdp.daemon.bench import parse_phases
from metaroce_xdp.daemon.startup import StartClock, process_age

ROOT = Path(__file__).resolve().parents[2]


def test_phases_add_up_to_the_total_and_parse_back():
    c = StartClock()
    assert c.phases[0][0] == "python"                    # from the process's start
    age = process_age()
    assert age is not None and 0 <= c.phases[0][1] <= age + 0.02
    sum(range(20000))
    c.mark("a")
    c.mark("b")
    c.mark("a")                                          # the same phase again: added
    assert [n for n, _ in c.phases] == ["python", "a", "b"]
    assert abs(sum(s for _, s in c.phases) - c.total()) < 1e-9
    assert set(c.cpu) == {"python", "a", "b"} and all(v >= 0 for v in c.cpu.values())
    c.side("xdp compile", 1.25, 0.5)
    d = c.as_dict()
    assert d["threads"] == {"xdp compile": 1.25} and d["threads_cpu"] == {"xdp compile": 0.5}
    back = parse_phases(c.text())
    assert list(back["phases"]) == ["python", "a", "b"] and back["threads"] == {"xdp compile": 1.25}
    fresh = StartClock(from_exec=False)                  # a clock that starts now has no "python" phase
    fresh.mark("x")
    assert [n for n, _ in fresh.phases] == ["x"] and fresh.total() < 1.0


def test_bccbuild_is_light_and_agrees_with_layout():
    code = ("import sys; from metaroce_xdp.kern import bccbuild; "
            "print(sorted(m for m in ('numpy', 'numba', 'metaroce_xdp.kern.layout', 'metaroce_xdp.wire') "
            "if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)
    from metaroce_xdp.kern import bccbuild, layout
    assert (bccbuild.MAX_RXQ, bccbuild.SACK_RINGS) == (layout.MR_MAX_RXQ, layout.MR_SACK_RINGS)
    assert bccbuild.cflags(1024)[1:] == ["-DMR_MAX_QPS=1024", "-DMR_MAX_RXQ=64", "-DMR_SACK_RINGS=32",
                                         "-DMR_VERIFY_ACK_ICRC=1"]


@pytest.mark.root
def test_loader_takes_a_matching_compiled_program_and_recompiles_otherwise():
    from metaroce_xdp.kern import bccbuild
    from metaroce_xdp.kern.loader import XdpLoader
    c = bccbuild.compile_program(bccbuild.cflags(1024))
    ld = XdpLoader(max_qps=1024, compiled=c)
    try:
        assert ld.bpf is c.bpf and c.used
        assert ld.timings["compile"] == c.seconds and set(ld.timings) == {"compile", "load"}
        assert ld.prog_fd >= 0
    finally:
        ld.close()
    other = bccbuild.compile_program(bccbuild.cflags(1024))
    ld = XdpLoader(max_qps=512, compiled=other)          # other flags: compiled again, the given one closed
    try:
        assert ld.bpf is not other.bpf and other.used
        assert "-DMR_MAX_QPS=512" in ld.cflags and ld.max_qps == 512
    finally:
        ld.close()


START = r"""
import json, sys, threading
from numba.core import event as nb_event
compiled = []
class Watch(nb_event.Listener):
    def on_start(self, ev):
        compiled.append(str(ev.data.get("dispatcher")))
    def on_end(self, ev):
        pass
nb_event.install_listener("numba:compile", Watch())          # every compilation from here on
from metaroce_xdp.daemon.startup import StartClock, prebuild_xdp
from metaroce_xdp.daemon.config import load_config
clock = StartClock()
cfg = load_config(sys.argv[1])
builds = prebuild_xdp(cfg.interfaces, clock)
from metaroce_xdp.daemon.server import Daemon
from metaroce_xdp.daemon import client
d = Daemon(cfg)
d.start(clock, builds)
dev = d.devices["mr0"]
alive = dev._thread is not None and dev._thread.is_alive()
stop = threading.Event()
t = threading.Thread(target=d.run, args=(stop,), daemon=True)
t.start()
snap = client.status(cfg.socket_path)                        # the socket answers
stop.set()
t.join(10)
d.drain_and_stop(1.0)
from metaroce_xdp.native import multipath, receiver, sender
native = sorted(n for m in (multipath, receiver, sender) for n, f in vars(m).items()
                if hasattr(f, "signatures") and getattr(f, "py_func", None) is not None
                and f.py_func.__module__ == m.__name__ and f.signatures)
print(json.dumps({"startup": clock.as_dict(), "alive": alive, "iterations": dev.iterations, "native": native,
                  "status_devices": [x["ifname"] for x in snap["devices"]], "compiled": compiled,
                  "inproc": "metaroce_xdp.dp.inproc" in sys.modules,
                  "serve": "metaroce_xdp.dp.serve" in sys.modules}), flush=True)
"""


@pytest.mark.netns
@pytest.mark.parametrize("profile", ["auto", "compat"])
def test_a_real_start_reports_its_phases_serves_and_compiles_nothing(tmp_path, profile):
    from metaroce_xdp.topo import two_hosts
    topo, _ = two_hosts(prefix="mrstart")
    try:
        conf = tmp_path / "d.toml"
        conf.write_text(f'interfaces = ["mr0"]\nsocket_path = "{tmp_path}/d.sock"\n'
                        f'bpffs_prefix = "{tmp_path}/bpf"\nprogress = "sleep"\nprofile = "{profile}"\n')
        p = topo.popen(topo[0], [sys.executable, "-c", START, str(conf)], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        r = json.loads(out.strip().splitlines()[-1])
    finally:
        topo.close()
    s = r["startup"]
    for phase in ("python", "compiled loops (numba cache)", "xdp wait", "af_xdp + attach", "control socket",
                  "loop start"):
        assert phase in s["phases"], s
    assert {"bcc import", "xdp compile", "xdp load"} <= set(s["threads"]), s
    assert abs(sum(s["phases"].values()) - s["total_s"]) < 0.01
    assert r["alive"] and r["iterations"] >= 1               # ready: the driver thread ran dp_serve
    assert r["status_devices"] == ["mr0"]
    assert r["compiled"] == []                               # numba loaded from its cache, compiled nothing
    assert r["serve"] and not r["inproc"]                    # dp_serve only: dp_round / dp_run never loaded
    # the native profile's functions: only those Python calls at a native QP's RTR/RTS, and only when the
    # profile allows native QPs (the rest are compiled into dp_serve: jitcache.lazy_njit)
    assert r["native"] == (["mp_init", "rx_init", "tx_init"] if profile == "auto" else []), r["native"]
