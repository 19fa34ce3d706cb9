"""numba's disk cache is keyed on every module compiled code depends on (metaroce_xdp/jitcache.py):
a cached function is reused while nothing changed and compiled again when any dependency changed --
numba alone checks only the defining file, so an edit of dp/core.py or dp/layout.py alone would have
run stale machine code with old column numbers."""
import json
import subprocess
import sys

import pytest

PROBE = r"""
import json, sys
import numpy as np
from metaroce_xdp import jitcache
if sys.argv[1] == "changed":
    jitcache._digest = b"another version of a dependency"
from metaroce_xdp.wire import icrc
buf = np.zeros(64, np.uint8)
icrc.crc32_update(icrc.CRC_TABLES, np.uint32(0xFFFFFFFF), buf, 0, 64)
st = icrc.crc32_update.stats
print(json.dumps({"hits": sum(st.cache_hits.values()), "misses": sum(st.cache_misses.values()),
                  "file": icrc.__file__}))
"""


def _run(cache_dir, mode, first_path=None, **env):
    path = ([str(first_path)] if first_path else []) + [p for p in sys.path if p]
    r = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=300,
                       cwd=str(cache_dir.parent), env={"NUMBA_CACHE_DIR": str(cache_dir), "PATH": "/usr/bin:/bin",
                            "PYTHONPATH": ":".join(path), **env})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_locators_come_first_and_only_for_our_files():
    from numba.core import caching

    from metaroce_xdp import jitcache
    assert caching.CacheImpl._locator_classes[:3] == list(jitcache._LOCATORS)
    assert jitcache._LOCATORS[0].from_function(len, pytest.__file__) is None
    deps = {p.rsplit("metaroce_xdp/", 1)[1] for p in jitcache.depends()}
    assert {"dp/round.py", "dp/core.py", "native/plane.py",
            "dp/layout.py", "dp/prims.py", "wire/fastpath.py", "kern/layout.py"} <= deps


def test_cache_reused_while_unchanged_and_recompiled_when_a_dependency_changes(tmp_path):
    first = _run(tmp_path, "same")
    assert first["misses"] >= 1 and first["hits"] == 0          # empty cache: compiled
    again = _run(tmp_path, "same")
    assert again["hits"] >= 1 and again["misses"] == 0          # unchanged: loaded
    changed = _run(tmp_path, "changed")
    assert changed["misses"] >= 1 and changed["hits"] == 0      # a dependency changed: compiled again


def test_a_cache_warmed_from_one_copy_serves_another_elsewhere(tmp_path):
    """Under NUMBA_CACHE_DIR a file's cache sits at its path inside the package and its stamp is contents:
    a cache warmed from this checkout serves a copy of the package at another path, written later (an
    install from the wheel).  With NUMBA_CPU_NAME=generic the code is for any x86-64: vm/endpoint warms
    here what Debian 12's kernel in a TCG VM (another CPU model) then loads."""
    import os
    import shutil

    from metaroce_xdp import jitcache
    cache = tmp_path / "cache"
    first = _run(cache, "same", NUMBA_CPU_NAME="generic")
    assert first["misses"] >= 1 and first["file"].startswith(jitcache.PKG)
    assert (cache / "metaroce_xdp" / "wire").is_dir()
    copy = tmp_path / "site-packages"
    shutil.copytree(jitcache.PKG, copy / "metaroce_xdp", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    moved = _run(cache, "same", first_path=copy, NUMBA_CPU_NAME="generic")
    assert moved["file"] == os.path.join(copy, "metaroce_xdp", "wire", "icrc.py")
    assert moved["hits"] >= 1 and moved["misses"] == 0, moved
    host = _run(cache, "same", first_path=copy)                  # the host's own CPU: another target
    assert host["misses"] >= 1 and host["hits"] == 0, host


LAZY = r"""
import json
import numpy as np
from numba import njit
from metaroce_xdp.jitcache import LazySigDispatcher, ensure_all, lazy_njit

@lazy_njit("int64(int64, int64)")
def add(a, b):
    return a + b

@lazy_njit("boolean(int64, int64)")
def lt(a, b):
    return a < b

@lazy_njit("int64(int64)")
def sq(a):
    return a * a

@njit
def caller(x):
    return lt(x, 5)

out = {"defined": [len(f.signatures) for f in (add, lt, sq)]}        # nothing compiled at definition
out["py_call"] = add(2, 3)                                            # a call from Python compiles its signature
out["add"] = [str(s) for s in add.signatures] + [add._can_compile]
try:
    add(np.zeros(2), 2)
    out["array"] = "accepted"
except TypeError:
    out["array"] = "TypeError"                                        # not compiled for another type
out["caller"] = bool(caller(3))                                       # typing a compiled caller compiles it
out["lt"] = [str(s) for s in lt.signatures] + [lt._can_compile]
sq.disable_compile()                                                  # jitwarm.seal: compiled first, then sealed
out["sq"] = [str(s) for s in sq.signatures] + [sq._can_compile, sq(4)]
import sys
out["ensure_all"] = ensure_all(sys.modules[__name__])
out["lazy"] = isinstance(add, LazySigDispatcher)
print(json.dumps(out))
"""


def test_lazy_njit_compiles_its_signature_at_first_use_then_behaves_as_an_eager_one(tmp_path):
    """native/*.py's functions (lazy_njit): nothing at import; the declared signature -- and only it -- at the
    first call from Python, the first compiled caller, or seal()."""
    script = tmp_path / "lazy_probe.py"
    script.write_text(LAZY)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       env={"NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin",
                            "PYTHONPATH": ":".join(p for p in sys.path if p)})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["defined"] == [0, 0, 0]
    assert out["py_call"] == 5 and out["add"] == ["(int64, int64)", False] and out["array"] == "TypeError"
    assert out["caller"] is True and out["lt"] == ["(int64, int64)", False]
    assert out["sq"] == ["(int64,)", False, 16]
    assert out["ensure_all"] == 3 and out["lazy"] is True


def test_warmup_json_lists_every_entry_point_and_where_it_came_from():
    """`metaroce warmup -j` on this tree's warm cache: one JSON object, nothing compiled, every entry loaded."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "metaroce_xdp.cli", "warmup", "-j"], capture_output=True, text=True,
                       cwd=root, timeout=600)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "metaroce-warmup/1" and doc["entry_points"] == len(doc["entries"]) > 20, doc
    assert doc["compiled"] == 0 and doc["cache_was_warm"] is True, doc
    assert {e["source"] for e in doc["entries"]} <= {"cache", "present"}, doc["entries"]
