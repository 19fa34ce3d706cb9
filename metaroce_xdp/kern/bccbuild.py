"""BCC's compile of the XDP program (bpf/metaroce_xdp.c), importing nothing but BCC.

    c = compile_program(cflags(max_qps=1024))     # clang, in the calling thread (outside the GIL: ctypes)
    ld = XdpLoader(max_qps=1024, compiled=c)      # loader.py: loads it (verifier), maps, pins ...

metaroced starts this first thing, in a thread per interface, so that clang runs while the main thread
imports numpy and numba and loads the compiled loops (docs/daemon.md, "Start to READY"); loader.py's
own import pulls in numpy and the wire package (numba), which would delay the compile by their import
time.  XdpLoader uses a compiled program only when its flags are the ones it would compile with
(`cflags` here is what it computes them with), otherwise it compiles again and closes this one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# the C sources: package data in a wheel; in a checkout metaroce_xdp/bpf links to the top-level bpf/
BPF_DIR = Path(__file__).resolve().parents[1] / "bpf"
PROG_SRC = "metaroce_xdp.c"
# kern/layout.py's MR_MAX_RXQ and MR_SACK_RINGS (the loader's defaults), here without importing layout.py
# (numpy, the wire package); tests/daemon/test_daemon_startup.py checks that they agree
MAX_RXQ = 64
SACK_RINGS = 32


def cflags(max_qps: int, max_rxq: int = MAX_RXQ, sack_rings: int = SACK_RINGS, verify_ack_icrc: bool = True,
           defines: dict[str, int] | None = None, bpf_dir: Path | str = BPF_DIR) -> list[str]:
    """The clang flags of the program for these parameters (-I the source directory, -D each one)."""
    params = {"MR_MAX_QPS": max_qps, "MR_MAX_RXQ": max_rxq, "MR_SACK_RINGS": sack_rings,
              "MR_VERIFY_ACK_ICRC": int(verify_ack_icrc), **(defines or {})}
    return [f"-I{Path(bpf_dir).resolve()}"] + [f"-D{k}={int(v)}" for k, v in params.items()]


@dataclass
class Compiled:
    """A BCC module compiled with `cflags` (its maps created, the program not loaded yet)."""
    bpf: Any
    cflags: list[str]
    seconds: tuple[float, float] = (0.0, 0.0)      # (wall, CPU) of the compile
    used: bool = field(default=False, repr=False)

    def close(self) -> None:
        """Free the module and its maps (when no loader took it)."""
        if not self.used:
            self.used = True
            self.bpf.cleanup()


def compile_program(flags: list[str], bpf_dir: Path | str = BPF_DIR) -> Compiled:
    """BCC's BPF(src_file=..., cflags=flags): clang compiles the program and BCC creates its maps."""
    from bcc import BPF
    t0, c0 = time.monotonic(), time.thread_time()
    bpf = BPF(src_file=str(Path(bpf_dir).resolve() / PROG_SRC).encode(), cflags=flags)
    return Compiled(bpf, list(flags), (time.monotonic() - t0, time.thread_time() - c0))
