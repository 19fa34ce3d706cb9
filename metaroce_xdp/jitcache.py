"""Numba's on-disk cache, keyed on what the compiled code really depends on.

numba validates a cached function against the stamp of the one file that defines it.  Ours compile
code from other modules into theirs: `dp/loop.py`'s entry points inline `dp/ops.py`, `dp/prims.py`
and `wire/fastpath.py`, and the column numbers of `dp/layout.py` and `kern/layout.py` are constants
frozen into the machine code.  Edit only one of those (or upgrade a package in which only they
changed) and numba would load the old code -- with other column numbers, silently wrong memory
accesses.  `install()` puts cache locators first in numba's list that, for this package's files,
add to the stamp a digest of every module compiled code can depend on (DEPENDS), so any change to
one of them recompiles all.  Imported by every module that compiles with `cache=True`, before its
first decorator."""
from __future__ import annotations

import hashlib
import os

from numba.core import caching

PKG = os.path.dirname(os.path.abspath(__file__))
# what compiled code reads: every module of these directories, and these files
DEPENDS_DIRS = ("dp", "native", "wire", "afxdp")
DEPENDS_FILES = ("rc/burst.py", "kern/layout.py", "jitcache.py", "daemon/shm.py")

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
        def from_function(cls, py_func, py_file):
            if not _ours(py_file):
                return None          # numba's own locators handle everything else
            return super().from_function(py_func, py_file)

    Locator.__name__ = Locator.__qualname__ = "Depends" + base.__name__
    return Locator


_LOCATORS = tuple(_with_depends(b) for b in (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator,
                                               caching.UserWideCacheLocator))


def install() -> None:
    """Idempotent: our locators go first in numba's list."""
    classes = caching.CacheImpl._locator_classes
    if classes[:len(_LOCATORS)] != list(_LOCATORS):
        classes[:] = list(_LOCATORS) + [c for c in classes if c not in _LOCATORS]


install()
