"""tools/bench_queues.py (in `make bench`): a short run gives a verified goodput for each queue count."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.netns


def test_bench_queues_short_run(tmp_path, capsys):
    from tools import bench_queues
    out = tmp_path / "queues.json"
    rc = bench_queues.main(["--queues", "1,2", "--profiles", "compat", "--spread", "packet", "--iters", "40",
                            "--qps", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rc == 0, rows
    assert [(r["queues"], r["profile"], r["spread"]) for r in rows] == [(1, "compat", "packet"), (2, "compat", "packet")]
    assert all(r["gbps"] > 0 and r["verified"] is True for r in rows), rows
    assert "vs 1 queue" in capsys.readouterr().out
