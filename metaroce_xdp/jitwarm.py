"""Compile the data path ahead of traffic: every numba function, with the argument types it gets at run time.

A numba function compiles on its first call for each new combination of argument types
(a readonly array, a uint64 scalar or a 2-D array each make a different one).  Cold, the
data path takes about a minute to compile; if that happens while QPs are live, the peer's
local ACK timer fires and its retries run out (issue 6, "first run").  So:

* `warm_up()` calls each function that Python code calls at run time once, with arguments
  built the way the run-time callers build them (`afxdp/xsk.py`'s socket wrappers, dp/'s and
  native/'s entry points), on scratch buffers.  Functions only called from compiled code
  (`build_frame`, `icrc_numba`, `psn_diff`, the ring primitives ...) compile with their callers.
  With `cache=True` the result lands in numba's on-disk cache, so a warm start only loads it.
* Two groups (`PLANES`): "compiled" (dp/ and native/, whose explicit signatures compile at import --
  native/'s at first use, jitcache.lazy_njit -- about two minutes of CPU cold), which `Context.open`
  warms before any socket exists; and "helpers" (wire/'s and afxdp/rings.py's functions: compiled
  into the plane's loops, and the ring bursts afxdp/xsk.py calls from Python).  `metaroce warmup`
  (run by `make setup`) warms both ahead of time and says what it did, import-time compilation
  included.
* `cache_is_warm()` tells, before compiling, whether the cache holds every entry, so a cold
  start can say why it is slow.
* `seal()` ends compilation for the process: every dispatcher of `MODULES` and every `plan()`
  entry refuses new signatures from then on (numba's `Dispatcher.disable_compile`; also those only
  compiled into their callers).  In a process that calls it after its warm-up, a call with a type
  the warm-up missed raises numba's TypeError ("No matching definition") at once -- a failed
  test, not a transfer stalled for a minute behind the compiler.  Loading from
  the on-disk cache counts as compiling: everything must be in memory before the seal.
  `unsealed()` lifts it for a block (a test that calls a compiled function with its own types).

Registering new compiled code: put the module in `MODULES` (tests/dp/test_first_run.py fails while a
module with numba functions is missing) and one `Entry` per run-time call in `plan()`; `warm_up()` then
compiles it and `seal()` covers it -- nothing else to call.

tests/dp/test_first_run.py checks that after `warm_up()` a real transfer over veth adds no
specialisation to any dispatcher of `MODULES`: a missed type here would be a compile on
the live path.

Neighbours: dp/, native/, wire/icrc.py, wire/fastpath.py, wire/psn.py, afxdp/rings.py (the compiled
functions); dp/context.py (Context.open calls warm_up); metaroce_xdp/cli/main.py (`metaroce warmup`).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import mmap
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from numba import config as numba_config

from .jitcache import LazySigDispatcher

# Modules whose numba functions make up the data path, in two groups: "compiled" (dp/, native/: explicit
# signatures compiled at import, about two minutes of CPU cold; Context.open warms it) and "helpers" (wire/ and
# afxdp/rings.py: compiled into the plane's loops, and the ring bursts afxdp/xsk.py calls from Python).
# `metaroce warmup` (make setup) warms both.
PLANES: dict[str, tuple[str, ...]] = {
    "helpers": ("metaroce_xdp.wire.icrc", "metaroce_xdp.wire.hdr", "metaroce_xdp.wire.fastpath", "metaroce_xdp.wire.psn",
                "metaroce_xdp.afxdp.rings"),
    "compiled": ("metaroce_xdp.dp.ring", "metaroce_xdp.dp.core", "metaroce_xdp.dp.cc", "metaroce_xdp.dp.clientq",
                 "metaroce_xdp.dp.requester", "metaroce_xdp.dp.completer", "metaroce_xdp.dp.responder", "metaroce_xdp.dp.atomics",
                 "metaroce_xdp.dp.round", "metaroce_xdp.dp.inproc", "metaroce_xdp.dp.drive", "metaroce_xdp.dp.serve",
                 "metaroce_xdp.native.multipath", "metaroce_xdp.native.receiver", "metaroce_xdp.native.sender",
                 "metaroce_xdp.native.rdpace", "metaroce_xdp.native.plane_slot",
                 "metaroce_xdp.native.plane_read", "metaroce_xdp.native.plane_tx", "metaroce_xdp.native.plane"),
}
ALL_PLANES = tuple(PLANES)
MODULES = tuple(m for ms in PLANES.values() for m in ms)

# Compiled modules not on any data path (nothing in MODULES imports them), excused from warm-up.  The native
# profile's logic (native/*.py) was here until native/plane*.py wired it into the data plane
# (tests/dp/test_first_run.py checks both ways).
NOT_ON_THE_DATA_PATH: tuple[str, ...] = ()

COLD_MESSAGE = ("metaroce: compiling the data path with numba (first run with an empty cache: a few minutes; "
                "`metaroce warmup` does this ahead)")

JIT_ENABLED = not numba_config.DISABLE_JIT
_lock = threading.Lock()
_done: dict[str, "WarmupReport"] = {}      # plane -> its report
_sealed = False
_sealed_count = 0


@dataclass
class Entry:
    """One call that warm_up makes: a dispatcher and the run-time-typed arguments for it."""
    module: str
    name: str
    why: str                      # which run-time caller passes these types
    fn: Any
    args: tuple
    seconds: float = 0.0
    source: str = ""              # "cache" (loaded), "compiled", "present" (already in memory), "nojit"


@dataclass
class WarmupReport:
    entries: list[Entry] = field(default_factory=list)
    seconds: float = 0.0
    was_warm: bool | None = None   # the on-disk cache held every entry before we started (None: unknown)
    jit: bool = True
    cache_dir: str = ""
    import_seconds: dict[str, float] = field(default_factory=dict)   # module -> import (compile at import)
    compiled_at_import: list[str] = field(default_factory=list)       # modules whose import compiled

    @property
    def compiled(self) -> int:
        return sum(e.source == "compiled" for e in self.entries)

    def per_module(self) -> dict[str, float]:
        out: dict[str, float] = dict(self.import_seconds)
        for e in self.entries:
            out[e.module] = out.get(e.module, 0.0) + e.seconds
        return out


def dispatchers(modules: tuple[str, ...] | None = None) -> list[tuple[str, str, Any]]:
    """(module, name, dispatcher) for every numba function defined in `modules` (default MODULES;
    importing a module of the compiled plane compiles it).

    inline="always" functions are left out: numba inlines their IR into callers and never
    compiles them on their own."""
    from numba.core.dispatcher import Dispatcher
    out = []
    for modname in MODULES if modules is None else modules:
        mod = importlib.import_module(modname)
        for name, obj in sorted(vars(mod).items()):
            if (isinstance(obj, Dispatcher) and obj.py_func.__module__ == modname
                    and obj.targetoptions.get("inline", "never") != "always"):
                out.append((modname, name, obj))
    return out


def _anon_u8(n: int) -> np.ndarray:
    """n bytes of anonymous shared memory as uint8, made like the UMEM (afxdp/xsk.py Umem)."""
    mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return np.frombuffer(mm, dtype=np.uint8)


def _ring(size: int, is_desc: bool):
    """A ring's numpy views, made like afxdp/xsk.py _map_ring (index words, then descriptors)."""
    entry = 16 if is_desc else 8
    mm = mmap.mmap(-1, 64 * 3 + size * entry, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
    u32 = lambda o: np.frombuffer(mm, dtype=np.uint32, count=1, offset=o)  # noqa: E731
    prod, cons, flags = u32(0), u32(64), u32(128)
    if is_desc:
        body = np.frombuffer(mm, dtype=np.uint64, count=2 * size, offset=192).reshape(size, 2)
    else:
        body = np.frombuffer(mm, dtype=np.uint64, count=size, offset=192)
    return prod, cons, flags, body


def plan(planes: tuple[str, ...] = ALL_PLANES) -> list[Entry]:
    """The calls warm_up makes for `planes`, each typed as its run-time caller types it (see `why`)."""
    want = set(planes) - set(PLANES)
    if want:
        raise ValueError(f"unknown plane(s) {sorted(want)}: use {', '.join(PLANES)}")
    return [en for en in _plan_all(planes) if en.module in {m for p in planes for m in PLANES[p]}]


def _plan_all(planes: tuple[str, ...]) -> list[Entry]:
    from .afxdp import rings

    frame_size, nframes = 4096, 16
    frames = _anon_u8(frame_size * nframes)                       # Umem.frames
    pool = rings.FramePool(nframes, frame_size)
    addrs = np.empty(4, np.uint64)[:4]                            # frames of the pool
    addrs[:] = np.arange(4, dtype=np.uint64) * np.uint64(frame_size)
    rx_a, rx_l = np.zeros(2048, np.uint64), np.zeros(2048, np.uint32)   # XskSocket.rx_burst's arrays
    fp, fc, _, faddrs = _ring(64, False)
    rp, rc, _, rdescs = _ring(64, True)
    tp, tc, tflags, tdescs = _ring(64, True)
    cp, cc, _, caddrs = _ring(64, False)

    def e(module, name, why, *args):
        mod = importlib.import_module(module)
        return Entry(module, name, why, getattr(mod, name), args)

    R = "metaroce_xdp.afxdp.rings"
    hbuf = np.zeros(128, np.uint8)
    return [
        # afxdp/rings.py: the four rings and the frame pool, called from Python by xsk.XskSocket and FramePool
        # (socket set-up: the fill ring's prefill; tests and tools drive sockets with them).  wire/'s functions
        # (build_frame, icrc_ok_at, segment_opcode, psn_diff, the ICRC, hdr's accessors and parse_frame) are
        # compiled into the plane's loops: no Python caller, no entry -- but for hdr's readers of fields the
        # plane does not read (P_Key, MigReq, FECN/BECN, an ACK's MSN, the IP packet's end), which tools and
        # tests call: warmed here so that no first call compiles.
        e(R, "fill_ring_refill", "XskSocket.refill", fp, fc, faddrs, pool.stack, pool.top, 64),
        e(R, "rx_burst", "XskSocket.rx_burst", rp, rc, rdescs, rx_a, rx_l, 64),
        e(R, "tx_burst", "XskSocket.tx_burst", tp, tc, tdescs, np.zeros(4, np.uint64), np.zeros(4, np.uint32), 4),
        e(R, "comp_reap", "XskSocket.reap", cp, cc, caddrs, pool.stack, pool.top, pool.frame_mask, 64),
        e(R, "frame_alloc", "FramePool.alloc", pool.stack, pool.top, np.empty(4, np.uint64), 4),
        e(R, "frame_free", "FramePool.free", pool.stack, pool.top, addrs, len(addrs), pool.frame_mask),
        e(R, "needs_wakeup", "the rings API (compiled callers)", tflags),
        *[e("metaroce_xdp.wire.hdr", n, "a header field for tools and tests", hbuf, 14)
          for n in ("bth_pkey", "bth_mig", "bth_fecn", "bth_becn", "aeth_msn", "ip_end")],
        # multi-buffer sockets (XDP_USE_SG, path MTU 4096): XskSocket(sg=True)
        e(R, "rx_burst_sg", "XskSocket.rx_burst with sg", rp, rc, rdescs, frames, rx_a, rx_l,
          pool.stack, pool.top, pool.frame_mask, np.zeros(2, np.int64), 64),
        e(R, "tx_burst_sg", "XskSocket.tx_burst with sg", tp, tc, tdescs, np.zeros(4, np.uint64),
          np.zeros(4, np.uint32), 4, 4096),
        e(R, "comp_reap_sg", "XskSocket.reap with sg", cp, cc, caddrs, pool.stack, pool.top, pool.frame_mask, 4096, 64),
        # the compiled data plane (metaroce_xdp/dp): explicit signatures, compiled at import
        *(_compiled_plan(e) if "compiled" in planes else []),
    ]


def _compiled_plan(e) -> list[Entry]:
    return [
        *[e("metaroce_xdp.dp.inproc", n, why, *a) for n, why, a in importlib.import_module("metaroce_xdp.dp.inproc").warm_plan()],
        *[e("metaroce_xdp.dp.drive", n, why, *a) for n, why, a in importlib.import_module("metaroce_xdp.dp.drive").warm_plan()],
        *[e("metaroce_xdp.dp.serve", n, why, *a) for n, why, a in importlib.import_module("metaroce_xdp.dp.serve").warm_plan()],
        *[e(m, n, why, *a) for m, n, why, a in _native_plan()],
    ]


def _native_plan() -> list[tuple[str, str, str, tuple]]:
    """The native profile's functions Python calls (native/plane.py NativeSlots, at RTR and RTS) or that only
    tests and the simulation call so far (credits, the coalescing timer), on rows of their run-time types."""
    from .native import layout as NL
    par = NL.params()
    rxs, s, pt = NL.new_rx(2), NL.new_tx(), NL.new_pt()
    sports = np.arange(NL.KMAX, dtype=np.int64) | 0xC000
    RX, TX, MP = "metaroce_xdp.native.receiver", "metaroce_xdp.native.sender", "metaroce_xdp.native.multipath"
    return [(RX, "rx_init", "native.plane.NativeSlots.attach (INIT -> RTR)", (rxs[0], par, 0)),
            (TX, "tx_init", "native.plane.NativeSlots.start (RTR -> RTS)", (s[0], par, 0, 0)),
            (MP, "mp_init", "native.plane.NativeSlots.start (RTR -> RTS)", (pt, par, sports)),
            (RX, "rx_credit_alloc", "credits (MR-CC-018): native/sim.py and tests, not the data plane yet",
             (rxs, par, 0)),
            (RX, "rx_sack_due", "native/sim.py and tests (the data plane sends a coalesced SACK at the end of "
             "the round that received the packets, MR-NAT-023)", (rxs[0], par, 0)),
            (RX, "rx_sack_deadline", "native/sim.py and tests", (rxs[0], par))]


def _index_has(fn, args) -> bool | None:
    """Whether numba's on-disk cache holds fn for these argument types (None: cannot tell).

    Uses numba's cache internals (numba.core.caching.Cache): the same key the dispatcher
    looks up when it compiles."""
    try:
        sig = tuple(fn.typeof_pyval(a) for a in args)
        cache = fn._cache
        key = cache._index_key(sig, fn.targetctx.codegen())
        index = cache._cache_file._load_index()
        if key in index:
            return True
        # compiled from an explicit signature (lazy_njit's compile("ret(args)")): numba keys the overload
        # by that signature as given, return type included, not by the argument types
        from numba.core import sigutils
        for k in index:
            if k[1:] == key[1:] and isinstance(k[0], str) and tuple(sigutils.normalize_signature(k[0])[0]) == sig:
                return True
        return False
    except Exception:
        return None


def cache_is_warm(entries: list[Entry] | None = None) -> bool | None:
    """True when every warm-up entry is in memory or in the on-disk cache; None if unknown."""
    if numba_config.DISABLE_JIT:
        return True
    entries = plan() if entries is None else entries
    verdict: bool | None = True
    for en in entries:
        if _has_in_memory(en):
            continue
        has = _index_has(en.fn, en.args)
        if has is False:
            return False
        if has is None:
            verdict = None
    return verdict


def _has_in_memory(en: Entry) -> bool:
    try:
        sig = tuple(en.fn.typeof_pyval(a) for a in en.args)
        return sig in en.fn.overloads
    except Exception:
        return False


def warm_up(report: Callable[[str], None] | None = None, *, cold_notice: Callable[[str], None] | None = None,
            force: bool = False, planes: tuple[str, ...] = ALL_PLANES) -> WarmupReport:
    """Compile (or load) every data-path function of `planes` (PLANES); idempotent and thread-safe.

    `report(line)` gets one line per entry; `cold_notice(msg)` is called once before
    compiling when the cache is cold (default: a line on stderr).  The compiled plane's
    modules compile at import: that time is counted too (`WarmupReport.import_seconds`).
    In a sealed process (seal() was called) what this warms is sealed as well."""
    unknown = set(planes) - set(PLANES)
    if unknown:
        raise ValueError(f"unknown plane(s) {sorted(unknown)}: use {', '.join(PLANES)}")
    with _lock:
        todo = tuple(p for p in planes if force or p not in _done)
        if todo:
            _warm(todo, report, cold_notice)
        reps = [_done[p] for p in planes]
    if _sealed and todo:
        seal()
    return _merge(reps)


def _merge(reps: list[WarmupReport]) -> WarmupReport:
    reps = list({id(r): r for r in reps}.values())          # planes warmed together share one report
    if len(reps) == 1:
        return reps[0]
    out = WarmupReport(jit=reps[0].jit, cache_dir=reps[0].cache_dir)
    for r in reps:
        out.entries += r.entries
        out.seconds += r.seconds
        out.import_seconds.update(r.import_seconds)
        out.compiled_at_import += r.compiled_at_import
    ws = [r.was_warm for r in reps]
    out.was_warm = False if False in ws else (None if None in ws else True)
    return out


def _warm(planes: tuple[str, ...], report, cold_notice) -> None:
    rep = WarmupReport(jit=not numba_config.DISABLE_JIT)
    t0 = time.monotonic()
    if not rep.jit:
        rep.was_warm = True
        if report:
            report("NUMBA_DISABLE_JIT is set: nothing to compile")
        _done.update({p: rep for p in planes})
        return
    cold = _cold_modules(planes)
    if cold:
        (cold_notice or _stderr)(COLD_MESSAGE)
    for m in (m for p in planes for m in PLANES[p]):            # compiled at import where signatures are explicit
        if m not in sys.modules:
            t1 = time.monotonic()
            importlib.import_module(m)
            rep.import_seconds[m] = time.monotonic() - t1
            if any(sum(d.stats.cache_misses.values()) for _, _, d in dispatchers((m,))):
                rep.compiled_at_import.append(m)
            if report and rep.import_seconds[m] >= 0.5:
                report(f"  {m.removeprefix('metaroce_xdp.'):<30} {'import':<8} {rep.import_seconds[m]:7.2f} s   "
                       "(explicit signatures: compiled or loaded at import)")
    entries = plan(planes)
    rep.entries = entries
    rep.was_warm = False if (cold or rep.compiled_at_import) else cache_is_warm(entries)
    if rep.was_warm is False and not cold:
        (cold_notice or _stderr)(COLD_MESSAGE)
    for en in entries:
        present = _has_in_memory(en)
        hits0, miss0 = sum(en.fn.stats.cache_hits.values()), sum(en.fn.stats.cache_misses.values())
        t1 = time.monotonic()
        en.fn(*en.args)
        en.seconds = time.monotonic() - t1
        if present:
            en.source = "present"
        elif sum(en.fn.stats.cache_misses.values()) > miss0:
            en.source = "compiled"
        elif sum(en.fn.stats.cache_hits.values()) > hits0:
            en.source = "cache"
        else:
            en.source = "present"
        if report:
            name = f"{en.module.removeprefix('metaroce_xdp.')}.{en.name}"
            report(f"  {name:<30} {en.source:<8} {en.seconds:7.2f} s   ({en.why})")
    rep.seconds = time.monotonic() - t0
    rep.cache_dir = numba_config.CACHE_DIR or "__pycache__ next to each module"
    _done.update({p: rep for p in planes})


def _cold_modules(planes: tuple[str, ...]) -> list[str]:
    """Modules of `planes` not imported yet whose numba cache has no index at all: importing them
    compiles (a cheap look at numba's cache folder before the import that would compile)."""
    out = []
    for m in (m for p in planes for m in PLANES[p]):
        if m in sys.modules:
            continue
        spec = importlib.util.find_spec(m)
        if spec is None or spec.origin is None:
            continue
        stem = Path(spec.origin).stem
        where = Path(numba_config.CACHE_DIR) if numba_config.CACHE_DIR else Path(spec.origin).parent / "__pycache__"
        if not any(where.rglob(f"{stem}.*.nbi")):
            out.append(m)
    return out


def sealable() -> list[Any]:
    """Every dispatcher seal() covers: those defined in the modules of the planes warmed so far
    and in any other module of MODULES already imported, and those plan() calls (once each)."""
    warmed = tuple(p for p in PLANES if p in _done)
    mods = tuple(m for m in MODULES if m in sys.modules or any(m in PLANES[p] for p in warmed))
    out: dict[int, Any] = {}
    for _, _, d in dispatchers(mods):
        out[id(d)] = d
    for en in plan(warmed):
        out.setdefault(id(en.fn), en.fn)
    return list(out.values())


def seal() -> int:
    """No numba compilation from now on: each dispatcher of `sealable()` stops compiling new
    signatures (calls with types it has compiled still run; any other type raises TypeError at the
    call, where numba would have compiled).  Idempotent; returns how many dispatchers are sealed.
    A plane warmed later in a sealed process is sealed as it is warmed (warm_up calls this again).
    Does nothing under NUMBA_DISABLE_JIT (there is no compiler to stop)."""
    global _sealed, _sealed_count
    if numba_config.DISABLE_JIT:
        return 0
    with _lock:
        ds = sealable()
        for d in ds:
            if isinstance(d, LazySigDispatcher):
                d.ensure()                  # its declared signatures, in memory before the seal (jitcache.lazy_njit)
            if d.signatures:
                d.disable_compile()
            else:
                # disable_compile() insists on a signature; functions compiled only into their callers
                # have none of their own, and must not start compiling either (the same flag)
                d._can_compile = False
        _sealed = True
        _sealed_count = len(ds)
        return len(ds)


def is_sealed() -> bool:
    """True after seal() (and outside any unsealed() block)."""
    return _sealed


@contextlib.contextmanager
def unsealed():
    """Allow compilation inside the block, then seal again if the process was sealed (tests that call
    compiled functions with types of their own, e.g. the codec cross-checks)."""
    global _sealed
    was = _sealed
    if was and not numba_config.DISABLE_JIT:
        with _lock:
            for d in sealable():
                d.disable_compile(False)
            _sealed = False
    try:
        yield
    finally:
        if was:
            seal()


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


__all__ = ["JIT_ENABLED", "MODULES", "COLD_MESSAGE", "Entry", "WarmupReport", "cache_is_warm", "dispatchers",
           "is_sealed", "plan", "seal", "sealable", "unsealed", "warm_up"]
