"""Numba's on-disk cache, keyed on what the compiled code really depends on.

numba validates a cached function against the stamp of the one file that defines it.  Ours compile
code from other modules into theirs: the entry points (`dp/inproc.py`, `dp/serve.py`, `dp/drive.py`) inline
dp/'s role modules, `native/plane*.py`, `dp/prims.py` and `wire/fastpath.py`, and the column numbers of
`dp/layout.py` and `kern/layout.py` (and `congestion.py`'s WIRE_OVERHEAD) are constants frozen into the
machine code.  Edit only one of those (or upgrade a package in which only they
changed) and numba would load the old code -- with other column numbers, silently wrong memory
accesses.  `install()` puts cache locators first in numba's list that, for this package's files,
add to the stamp a digest of every module compiled code can depend on (DEPENDS), so any change to
one of them recompiles all.  Imported by every module that compiles with `cache=True`, before its
first decorator.

Under NUMBA_CACHE_DIR the cache of a file sits at its path inside the package (`metaroce_xdp/dp/...`), not
at numba's digest of its absolute path, and the stamp is contents only: a cache warmed once serves every
install of the same files.  With NUMBA_CPU_NAME=generic (at warm-up and at run time) the machine code
targets any x86-64, so a build host can warm the cache for a fleet -- or for a VM under TCG, where
compiling takes an hour (vm/endpoint).

`lazy_njit(sig, **opts)` is `njit(sig, **opts)` that compiles (or loads from the cache) its signature
at first use instead of at definition: a call from Python, or the typing of a compiled caller, or
`disable_compile()` (jitwarm.seal); from then on it behaves as an eager one (compiling disabled, other
types converted or refused).  The native profile's functions (native/*.py, ~50) use it, so that a
process that never runs a native QP -- metaroced with `profile = "compat"` -- does not load them, and
one that does loads them once (`ensure()`; metaroced at start when its profile allows native QPs)."""
from __future__ import annotations

import hashlib
import os

from numba import njit
from numba.core import caching
from numba.core.registry import CPUDispatcher

PKG = os.path.dirname(os.path.abspath(__file__))
# what compiled code reads: every module of these directories, and these files
DEPENDS_DIRS = ("dp", "native", "wire", "afxdp")
DEPENDS_FILES = ("congestion.py", "kern/layout.py", "jitcache.py", "shm.py")

_digest: bytes | None = None


def depends() -> list[str]:
    files = [os.path.join(PKG, f) for f in DEPENDS_FILES]
    for d in DEPENDS_DIRS:
        base = os.path.join(PKG, d)
        files += [os.path.join(base, f) for f in os.listdir(base) if f.endswith(".py")]
    return sorted(files)


def digest() -> bytes:
    """SHA-256 over the names and contents of depends(), computed once per process."""
    global _digest
    if _digest is None:
        h = hashlib.sha256()
        for path in depends():
            h.update(os.path.relpath(path, PKG).encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
        _digest = h.digest()
    return _digest


def _ours(py_file: str) -> bool:
    return os.path.abspath(py_file).startswith(PKG + os.sep)


def _with_depends(base: type) -> type:
    class Locator(base):
        def get_source_stamp(self):
            return (super().get_source_stamp(), digest())

        @classmethod
        def get_suitable_cache_subpath(cls, py_file):
            # under NUMBA_CACHE_DIR, by the path inside the package rather than numba's digest of the absolute
            # path: a cache warmed from one copy (a checkout, a build host's install) serves any install of the
            # same files.  Safe because the stamp is the files' contents (numba hashes the source; DEPENDS adds
            # the rest), never where they sit or when they were written.
            rel = os.path.relpath(os.path.dirname(os.path.abspath(py_file)), PKG)
            return os.path.normpath(os.path.join("metaroce_xdp", rel))

        @classmethod
        def from_function(cls, py_func, py_file):
            if not _ours(py_file):
                return None          # numba's own locators handle everything else
            return super().from_function(py_func, py_file)

    Locator.__name__ = Locator.__qualname__ = "Depends" + base.__name__
    return Locator


_LOCATORS = tuple(_with_depends(b) for b in (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator,
                                               caching.UserWideCacheLocator))
_UserDir = _LOCATORS[0]


def export_in_tree(dst: str) -> int:
    """Copy this copy's in-tree cache (`__pycache__` beside the sources, where numba writes without
    NUMBA_CACHE_DIR) into the NUMBA_CACHE_DIR layout under `dst`, which then serves any install of the same
    files; returns how many files were copied."""
    import shutil
    n = 0
    for d, _, files in os.walk(PKG):
        if os.path.basename(d) != "__pycache__":
            continue
        sub = os.path.join(dst, _UserDir.get_suitable_cache_subpath(os.path.join(os.path.dirname(d), "x.py")))
        for f in files:
            if f.endswith((".nbi", ".nbc")):
                os.makedirs(sub, exist_ok=True)
                shutil.copy2(os.path.join(d, f), sub)
                n += 1
    return n


def install() -> None:
    """Idempotent: our locators go first in numba's list."""
    classes = caching.CacheImpl._locator_classes
    if classes[:len(_LOCATORS)] != list(_LOCATORS):
        classes[:] = list(_LOCATORS) + [c for c in classes if c not in _LOCATORS]


install()


class LazySigDispatcher(CPUDispatcher):
    """A CPU dispatcher whose declared signatures are compiled at first use (see the module docstring)."""

    _lazy_sigs: tuple = ()

    def ensure(self) -> "LazySigDispatcher":
        """Compile (or load) the declared signatures now, then refuse new ones.  Idempotent."""
        if self._lazy_sigs:
            sigs, self._lazy_sigs = self._lazy_sigs, ()
            for sig in sigs:
                self.compile(sig)
            CPUDispatcher.disable_compile(self)
        return self

    def _compile_for_args(self, *args, **kws):
        # numba calls this when no compiled signature matches a Python call and calls what it returns
        if self._lazy_sigs:
            self.ensure()
            return lambda *a, **k: self(*a, **k)   # the declared signatures only: converted, or numba's TypeError
        return super()._compile_for_args(*args, **kws)

    def get_call_template(self, args, kws):
        self.ensure()                         # a compiled caller is typed against the declared signatures
        return super().get_call_template(args, kws)

    def disable_compile(self, val: bool = True) -> None:
        if val:
            self.ensure()
        super().disable_compile(val)


def lazy_njit(*sigs, **opts):
    """njit with explicit signatures, compiled at first use (LazySigDispatcher)."""
    if not sigs:
        raise TypeError("lazy_njit needs the signature(s)")

    def wrap(fn):
        disp = njit(**opts)(fn)
        disp.__class__ = LazySigDispatcher
        disp._lazy_sigs = tuple(sigs)
        return disp
    return wrap


def ensure_all(module) -> int:
    """ensure() every LazySigDispatcher defined in `module`; returns how many."""
    n = 0
    for obj in list(vars(module).values()):
        if isinstance(obj, LazySigDispatcher) and obj.py_func.__module__ == module.__name__:
            obj.ensure()
            n += 1
    return n
