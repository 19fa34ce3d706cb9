"""numba's disk cache is keyed on every module compiled code depends on (metaroce_xdp/jitcache.py):
a cached function is reused while nothing changed and compiled again when any dependency changed --
numba alone checks only the defining file, so an edit of dp/ops.py or dp/layout.py alone would have
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
print(json.dumps({"hits": sum(st.cache_hits.values()), "misses": sum(st.cache_misses.values())}))
"""


def _run(cache_dir, mode):
    r = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=300,
                       env={"NUMBA_CACHE_DIR": str(cache_dir), "PATH": "/usr/bin:/bin",
                            "PYTHONPATH": ":".join(p for p in sys.path if p)})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_locators_come_first_and_only_for_our_files():
    from numba.core import caching

    from metaroce_xdp import jitcache
    assert caching.CacheImpl._locator_classes[:3] == list(jitcache._LOCATORS)
    assert jitcache._LOCATORS[0].from_function(len, pytest.__file__) is None
    deps = {p.rsplit("metaroce_xdp/", 1)[1] for p in jitcache.depends()}
    assert {"dp/loop.py", "dp/ops.py", "dp/layout.py", "dp/prims.py", "wire/fastpath.py", "kern/layout.py"} <= deps


def test_cache_reused_while_unchanged_and_recompiled_when_a_dependency_changes(tmp_path):
    first = _run(tmp_path, "same")
    assert first["misses"] >= 1 and first["hits"] == 0          # empty cache: compiled
    again = _run(tmp_path, "same")
    assert again["hits"] >= 1 and again["misses"] == 0          # unchanged: loaded
    changed = _run(tmp_path, "changed")
    assert changed["misses"] >= 1 and changed["hits"] == 0      # a dependency changed: compiled again
