"""Recommendations (SHOULD parts of MUST rules) the reference endpoint follows, shown on the wire by the
conformance cases that accept either behaviour and say in their verdict which one the IUT chose.

* MR-DUP-002: a duplicate WRITE that arrives when the last requests executed were READs is re-ACKed with
  the PSN before the first of those READs (r - 1, what Linux rxe sends), not epsn - 1 (TC-DUP-009-a,
  TC-RC-015-a): a requester whose READ responses were lost must not take the re-ACK for them.
"""
from __future__ import annotations

import json
import os

import pytest


@pytest.mark.netns
@pytest.mark.timeout(300)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces, XDP and AF_XDP")
def test_duplicate_after_reads_is_acked_before_the_reads(tmp_path, capsys):
    from metaroce_xdp.conformance.cli import main
    rc = main(["--self-test", "--no-timing", "--report", str(tmp_path), "--case", "TC-DUP-009-a",
               "--case", "TC-RC-015-a"])
    out = capsys.readouterr().out
    verdicts = [json.loads(x) for x in (tmp_path / "report.jsonl").read_text().splitlines()][:-1]
    assert rc == 0 and verdicts and all(v["verdict"] == "PASS" for v in verdicts), out
    det = {(v["test"], v["rule"]): v["detail"] for v in verdicts}
    for key in (("TC-DUP-009-a", "MR-DUP-002"), ("TC-RC-015-a", "MR-DUP-009")):
        assert "r - 1 (recommended)" in det[key], det[key]
