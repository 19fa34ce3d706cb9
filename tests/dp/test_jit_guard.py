"""The session-wide guard against numba compiling during a transfer (tests/conftest.py, "no numba
compilation during a transfer"), proven on a real transfer: a pytest run in a subprocess, on a compiled-plane
loop pair (the `dp_loop` fixture: XDP + AF_XDP in two namespaces), of four tests --

* a function compiled before any compiled-plane Context is open: allowed, the test passes;
* a transfer during which nothing compiles: passes;
* a transfer during which a numba function is compiled (from the test's thread, and from another thread):
  fails, and the report names the function;
* the same compilation in a test with the `compiles` mark: passes.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.netns

INNER = r'''
import threading

import numpy as np
import pytest
from numba import njit

from dp_players import wait_wcs
from metaroce_xdp.verbs_types import SendWR, WCStatus, WROpcode


def _write(dp_loop, during=None):
    """A 1 MiB WRITE from A to B; `during` runs while its packets are on the way."""
    a, b = dp_loop()
    a.buf[:] = 7
    a.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(0, 1 << 20)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    a.ctx.progress()
    if during is not None:
        during()
    wcs = wait_wcs([a, b], a, 1, timeout=20)
    assert [w.status for w in wcs] == [WCStatus.SUCCESS]
    assert (b.buf == 7).all()


def test_a_compile_before_any_plane_is_open():
    @njit
    def probe_before_the_plane(x):
        return x + 1
    assert probe_before_the_plane(np.int64(1)) == 2


def test_a_transfer_that_compiles_nothing(dp_loop):
    _write(dp_loop)


def test_a_transfer_during_which_numba_compiles(dp_loop):
    @njit
    def probe_compiled_mid_transfer(x):
        return x * 3

    @njit
    def probe_compiled_in_another_thread(x):
        return x - 1

    def during():
        assert probe_compiled_mid_transfer(np.int64(2)) == 6
        t = threading.Thread(target=probe_compiled_in_another_thread, args=(np.float64(2.0),))
        t.start()
        t.join()
    _write(dp_loop, during)


@pytest.mark.compiles
def test_a_marked_test_may_compile(dp_loop):
    @njit
    def probe_in_a_marked_test(x):
        return x + 2
    _write(dp_loop, lambda: probe_in_a_marked_test(np.int64(1)))
'''


def test_a_compilation_during_a_transfer_fails_the_test_and_names_the_function(tmp_path):
    (tmp_path / "test_inner_guard.py").write_text(INNER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    env.pop("NUMBA_DISABLE_JIT", None)
    # tests/conftest.py as a plugin (the run is outside tests/): the guard and the dp_loop fixture
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-v", "-p", "no:cacheprovider",
                        "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_inner_guard.py")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    outcome = {}
    for line in r.stdout.splitlines():
        for verdict in ("PASSED", "FAILED", "ERROR"):
            if "::test_" in line and f" {verdict}" in line:
                outcome[line.split("::")[1].split()[0]] = verdict
    assert outcome == {"test_a_compile_before_any_plane_is_open": "PASSED",
                       "test_a_transfer_that_compiles_nothing": "PASSED",
                       "test_a_transfer_during_which_numba_compiles": "FAILED",
                       "test_a_marked_test_may_compile": "PASSED"}, out[-6000:]
    assert r.returncode == 1, out[-3000:]
    assert "numba compiled during a transfer" in out, out[-4000:]
    assert "probe_compiled_mid_transfer" in out and "probe_compiled_in_another_thread" in out, out[-4000:]
    assert "probe_in_a_marked_test" not in out.split("short test summary")[0].split("FAILURES")[-1], out[-4000:]
