"""Where metaroced's start-up goes: the time of each phase from the process's start to ready.

    clock = StartClock()            # at the entry point: time before it counts as "python" (interpreter, imports)
    clock.mark("config")            # the phase that just ended, on the starting thread
    clock.side("xdp compile", 1.1)  # work another thread did meanwhile (overlapped, not on the critical path)
    clock.total(); clock.text(); clock.as_dict()

Phases are what the starting thread spent, in order, so they add up to `total()` (the time since the
process started, from /proc/self/stat; 10 ms resolution); `cpu` has the CPU seconds of each (what a
loaded machine does not inflate).  A phase that only waits for another thread
(`xdp wait`) shows what of that thread's work the rest did not hide.  metaroced logs `text()` in its
"ready in" line; `python -m metaroce_xdp.daemon.server` prints `as_dict()` in its ready message and
`python -m metaroce_xdp.daemon.bench --ready N` reports best and median per phase over N starts.

`prebuild_xdp()` starts BCC's compile of the XDP program, one thread per interface, as the first thing
after the configuration is read (kern/bccbuild.py imports nothing else): clang runs outside the GIL
while the starting thread imports numpy and numba and loads the compiled loops; Daemon.start takes the
loaders from these threads.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

LOADER_MAX_QPS = 1024                 # dp.layout.MAX_QPS (checked at start; known before numba is imported)


def process_age() -> float | None:
    """Seconds since this process started (fork), None when /proc cannot tell."""
    try:
        with open("/proc/self/stat", "rb") as f:
            data = f.read()
        fields = data[data.rindex(b")") + 2:].split()         # fields from 3 (state) on; starttime is 22
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError):
        return None


class StartClock:
    """Phase times of one start (see the module docstring).  from_exec: the first phase ("python")
    runs from the process's start; otherwise the clock starts now."""

    def __init__(self, from_exec: bool = True) -> None:
        now = time.monotonic()
        age = process_age() if from_exec else None
        self.origin = now - (age or 0.0)
        self.phases: list[tuple[str, float]] = []
        self.cpu: dict[str, float] = {}          # CPU seconds of the starting thread per phase (load-independent)
        self.sides: list[tuple[str, float]] = []
        self.side_cpu: dict[str, float] = {}
        self._last = self.origin
        self._last_cpu = 0.0 if age is not None else time.thread_time()
        self._lock = threading.Lock()
        if age is not None:
            self.mark("python")          # interpreter start-up and the entry point's imports

    def mark(self, name: str) -> float:
        """End the current phase of the starting thread under `name`; returns its seconds.  Marking the
        same name again adds to it."""
        now, cpu = time.monotonic(), time.thread_time()
        dt = now - self._last
        self._last = now
        self.cpu[name] = self.cpu.get(name, 0.0) + cpu - self._last_cpu
        self._last_cpu = cpu
        for i, (n, s) in enumerate(self.phases):
            if n == name:
                self.phases[i] = (n, s + dt)
                break
        else:
            self.phases.append((name, dt))
        return dt

    def side(self, name: str, seconds: float, cpu: float | None = None) -> None:
        """Work of another thread during start-up (thread-safe): wall seconds, and CPU seconds when known."""
        with self._lock:
            self.sides.append((name, seconds))
            if cpu is not None:
                self.side_cpu[name] = cpu

    def total(self) -> float:
        return self._last - self.origin

    def as_dict(self) -> dict:
        return {"total_s": round(self.total(), 4), "phases": {n: round(s, 4) for n, s in self.phases},
                "threads": {n: round(s, 4) for n, s in self.sides},
                "cpu": {n: round(s, 4) for n, s in self.cpu.items()},
                "threads_cpu": {n: round(s, 4) for n, s in self.side_cpu.items()}}

    def text(self) -> str:
        out = ", ".join(f"{n} {s:.2f}" for n, s in self.phases)
        out += f" (cpu {sum(self.cpu.values()):.2f})"
        if self.sides:
            out += "; meanwhile in threads: " + ", ".join(f"{n} {s:.2f}" for n, s in self.sides)
        return out


class Build:
    """fn() in a thread; result() waits for it (and raises what it raised); discard() closes what it made."""

    def __init__(self, fn: Callable[[], Any], name: str = "metaroced-build") -> None:
        self._fn, self._value, self._error = fn, None, None
        self._t = threading.Thread(target=self._run, name=name, daemon=True)
        self._t.start()

    def _run(self) -> None:
        try:
            self._value = self._fn()
        except BaseException as e:         # noqa: BLE001 - handed to result()
            self._error = e

    def result(self) -> Any:
        self._t.join()
        if self._error is not None:
            raise self._error
        return self._value

    def discard(self) -> None:
        self._t.join()
        if self._value is not None:
            self._value.close()


def build_loader(clock: StartClock | None = None) -> Any:
    """One interface's XDP program: BCC's compile first (importing only BCC), then kern.loader's XdpLoader
    around it (the kernel's verifier loads it; the maps are mapped).  Its times go to clock's threads."""
    t0, c0 = time.monotonic(), time.thread_time()
    import bcc  # noqa: F401  (libbcc: a large library to map and link)
    from ..kern import bccbuild
    t1, c1 = time.monotonic(), time.thread_time()
    compiled = bccbuild.compile_program(bccbuild.cflags(LOADER_MAX_QPS))
    try:
        from ..kern import loader as kl     # numpy, the wire package (numba): the main thread imports them meanwhile
        loader = kl.XdpLoader(max_qps=LOADER_MAX_QPS, compiled=compiled)
    except BaseException:
        compiled.close()
        raise
    if clock is not None:
        clock.side("bcc import", t1 - t0, c1 - c0)
        for k, (wall, cpu) in loader.timings.items():
            clock.side(f"xdp {k}", wall, cpu)
    return loader


def prebuild_xdp(interfaces: list[str], clock: StartClock | None = None) -> dict[str, Build]:
    """BCC's compile and load of the XDP program for each interface, each in a thread (Daemon.start(builds=))."""
    return {ifname: Build(lambda: build_loader(clock), name=f"metaroced-build-{ifname}") for ifname in interfaces}
