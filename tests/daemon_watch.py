"""metaroced under a numba compile watch, for the tests that carry traffic through it.

    python tests/daemon_watch.py LOG -m metaroce_xdp.daemon.server --config FILE

runs metaroced (the same module and arguments `python -m` would) with a listener on numba's
"numba:compile" event: every compilation that starts while a device's driver thread is alive
(metaroced-IFNAME, the thread that runs dp_serve; not the metaroced-build-IFNAME threads that build the XDP
program at start) -- the daemon is serving -- is appended to LOG as one line.  What compiles before that
is the daemon's start (where a cold numba cache compiles).

`serving()` starts one in a namespace the way tests/daemon_procs.py's `serving` does (own bpffs, socket in a
fresh directory, sleep mode, dies with the test) and, once it is stopped, fails if it compiled while serving.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def serving(topo, ns: str, ifname: str, *, tag: str = "mrd", extra: str = "", env: dict | None = None,
            ready_timeout: float | None = None):
    """A watched metaroced in `ns` on `ifname`; yields (socket path, its directory, the Popen) once ready (its
    log: DIR/B.log).  On the way out: stopped (daemon_procs.reap), bpffs unmounted, and an AssertionError if
    numba compiled anything while it served."""
    import daemon_procs
    tmp = tempfile.mkdtemp(prefix=f"{tag}-")
    bpffs = os.path.join(tmp, "bpf")
    os.mkdir(bpffs)
    subprocess.run(["mount", "-t", "bpf", "bpf", bpffs], check=True)
    sock, conf, watch = (os.path.join(tmp, n) for n in ("B.sock", "B.toml", "compiled.log"))
    Path(conf).write_text(f'interfaces = ["{ifname}"]\nsocket_path = "{sock}"\nprogress = "sleep"\n'
                          f'bpffs_prefix = "{bpffs}/metaroce"\n{extra}')
    err = open(os.path.join(tmp, "B.log"), "a")
    d = topo.popen(ns, [sys.executable, str(Path(__file__).resolve()), watch, "-m", "metaroce_xdp.daemon.server",
                        "--config", conf], stdout=subprocess.PIPE, stderr=err, text=True, cwd=str(ROOT),
                   env=env, preexec_fn=daemon_procs.die_with_parent)
    try:
        if ready_timeout is not None:
            timer = threading.Timer(ready_timeout, d.kill)
            timer.start()
        line = d.stdout.readline()
        if ready_timeout is not None:
            timer.cancel()
        assert line and json.loads(line).get("ready"), Path(tmp, "B.log").read_text()[-3000:]
        yield sock, tmp, d
    finally:
        daemon_procs.reap(d)
        err.close()
        subprocess.run(["umount", bpffs], check=False)
    compiled = Path(watch).read_text() if os.path.exists(watch) else ""
    assert not compiled, f"metaroced ({ifname}) compiled with numba while serving:\n{compiled}"


def _watch(log: str) -> None:
    from numba.core import event

    class Watch(event.Listener):
        def on_start(self, ev):
            if any(t.name.startswith("metaroced-") and not t.name.startswith("metaroced-build")
                   for t in threading.enumerate()):
                d = ev.data.get("dispatcher")
                fn = getattr(d, "py_func", None)
                name = f"{fn.__module__}.{fn.__qualname__}" if fn is not None else repr(d)
                with open(log, "a") as f:
                    f.write(f"{name}{tuple(ev.data.get('args', ()))} in {threading.current_thread().name}\n")

        def on_end(self, ev):
            pass

    event.register("numba:compile", Watch())


if __name__ == "__main__":
    import runpy
    log, flag, module, *rest = sys.argv[1:]
    assert flag == "-m", sys.argv
    _watch(log)
    sys.path.insert(0, str(ROOT))
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
