"""`make bench`'s fabric part works: `python -m tools.bench_fabric --quick` builds a fabric, runs
`metaroce perf write-bw` from h1 to h2 through its routers without loss and at 1 % seeded loss on
the last hop, and reports each point with the fabric's own counts; a profile perf cannot run is
a point that says why.  Speed is never asserted -- only that each measurement is taken, and that
the counters agree with what loss means (drops at 1 %, none without; no resends without loss,
resends with it)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools import bench_fabric

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.netns


def test_quick_fabric_bench_reports_every_point(tmp_path):
    out = tmp_path / "fabric.json"
    cp = subprocess.run([sys.executable, "-m", "tools.bench_fabric", "--quick", "--no-plots", "--json", str(out)],
                        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert cp.returncode == 0, cp.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["schema"] == bench_fabric.SCHEMA
    pts = {(p["profile"], p["loss_ppm"]): p for p in rep["points"]}
    assert set(pts) == {(pr, loss) for pr in bench_fabric.PROFILES for loss in bench_fabric.QUICK_LOSSES}
    clean, lossy = pts[("compat", 0)], pts[("compat", 10_000)]
    for p in (clean, lossy):
        assert p["not_available"] is None and p["gbps"] > 0
    assert clean["dropped"] == 0 and clean["retained"] == 1.0 and 1.0 <= clean["sent_over_needed"] < 1.05
    assert lossy["dropped"] > 0 and lossy["sent_over_needed"] > 1.0         # go-back-N resends what was lost
    for loss in bench_fabric.QUICK_LOSSES:
        p = pts[("native", loss)]
        assert (p["gbps"] is None) == bool(p["not_available"])
    assert "goodput" in cp.stdout and "compat" in cp.stdout
