"""Known, decided divergences (spec 9.7.1, Table 9-3): the table is well formed and names real cases
and rules, the report renders each row beside the failures it explains and counts the rest as
unexplained, and the committed Linux Soft-RoCE report (docs/conformance/rxe/) has no unexplained
failure under the current table."""
from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import pytest

from metaroce_xdp.conformance import interop, report
from metaroce_xdp.conformance.registry import load_all
from metaroce_xdp.conformance.runner import CaseRun, RunResult, Verdict
from metaroce_xdp.conformance.spec import Catalogue, Claim

ROOT = Path(__file__).resolve().parents[2]
RXE_REPORT = ROOT / "docs" / "conformance" / "rxe" / "report.jsonl"
RXE_IUT = {"name": "rdma-core:rxe0", "version": "rdma_rxe on Linux 6.1.0-57-amd64, fw 0.0.0", "claim": "compat"}
REF_IUT = {"name": "metaroce-ref", "version": "0.1.0", "claim": "compat"}


@pytest.fixture(scope="module")
def cat():
    return Catalogue()


@pytest.fixture(scope="module")
def divs(cat):
    return interop.load(cat.dir)


def test_table_names_real_cases_and_rules(cat, divs):
    cases = load_all()
    assert divs, "Table 9-3 has no rows"
    for d in divs:
        assert d.impl in interop.IMPLEMENTATIONS and d.decision in interop.DECISIONS
        assert d.observed and d.why, d
        matched = [c for pat in d.cases for c in cases if fnmatch.fnmatchcase(c, pat)]
        assert matched, f"{d.cases}: no such case"
        for r in d.rules:
            assert r in cat, f"{r} is not a rule of the spec"
            assert any(r in cases[c].rules for c in matched), f"{r} is not checked by {d.cases}"


def test_table_rows_are_distinct(divs):
    seen = {}
    for d in divs:
        for c in d.cases:
            for r in d.rules:
                assert (d.impl, c, r) not in seen, f"{d.impl} {c} {r} decided twice"
                seen[(d.impl, c, r)] = d


def test_parse_refuses_a_bad_row():
    text = ("Table 9-3: x\n\n| Implementation | Rule | Case | Observed | Decision | Why |\n|---|---|---|---|---|---|\n"
            "| rxe | MR-RC-012 | TC-RC-012-a | NAK code 3 | maybe | - |\n")
    with pytest.raises(interop.InteropTableError, match="decision"):
        interop.parse(text)
    with pytest.raises(interop.InteropTableError, match="unknown implementation"):
        interop.parse(text.replace("| rxe |", "| foo |").replace("maybe", "deviates"))
    with pytest.raises(interop.InteropTableError, match="not found"):
        interop.parse("no table here")


def _result(iut: dict, verdicts: list[Verdict]) -> RunResult:
    res = RunResult(run_id="r", iut=iut, claim=Claim(), hello={}, caps={}, peer="LT", spec_version="v1",
                    started="2026-12-03T00:00:00Z")
    by_case = {}
    for v in verdicts:
        by_case.setdefault(v.test, []).append(v)
    for test, vs in by_case.items():
        res.runs.append(CaseRun(case=load_all()[test], verdicts=vs, duration_ms=1.0, pcap=f"captures/{test}.pcap",
                                agent_log=f"agent/{test}.jsonl"))
    return res


def test_report_renders_known_divergences_and_counts_the_rest(cat, divs, tmp_path):
    d = next(x for x in divs if x.impl == "rxe" and x.decision == "deviates")
    test = next(c for c in load_all() if any(fnmatch.fnmatchcase(c, p) for p in d.cases))
    known = Verdict(test, d.rules[0], "FAIL", "observed something else")
    # a FAIL of a rule no row names for that case stays unexplained
    other_rule = next(r for r in cat if not any(x.covers(RXE_IUT, test, r.id) for x in divs)).id
    unknown = Verdict(test, other_rule, "FAIL", "a failure nobody decided")
    res = _result(RXE_IUT, [known, unknown, Verdict(test, "MR-RC-001", "PASS", "fine")])
    s = report.summary(res, cat)
    assert (s["explained"], s["unexplained"]) == (1, 1)
    report.write_all(res, cat, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert f"known divergence (rxe): {d.observed.rstrip('.')}" in md and "unexplained: 1" in md
    assert "unexplained: no row of Table 9-3" in md
    assert "known divergence (rxe)" in (tmp_path / "report.html").read_text()
    summ = json.loads((tmp_path / "report.jsonl").read_text().splitlines()[-1])["summary"]
    assert summ["unexplained"] == 1
    assert "known divergence" in report.console(res, cat)
    # the same failure of another implementation is not explained by an rxe row
    s = report.summary(_result(REF_IUT, [known]), cat)
    assert (s["explained"], s["unexplained"]) == (0, 1)


def test_committed_rxe_report_has_no_unexplained_failure(divs):
    lines = [json.loads(x) for x in RXE_REPORT.read_text().splitlines()]
    verdicts = [x for x in lines if "verdict" in x]
    assert verdicts and "rdma_rxe" in verdicts[0]["iut"]["version"]
    bad = [(x["test"], x["rule"], x["verdict"]) for x in verdicts if x["verdict"] in ("FAIL", "ERROR")
           and interop.explain(divs, x["iut"], x["test"], x["rule"]) is None]
    assert not bad, f"unexplained FAIL/ERROR verdicts in {RXE_REPORT}: {bad}"
    assert lines[-1]["summary"]["unexplained"] == 0


def test_publish_copies_the_reports_and_the_failing_cases_evidence(tmp_path):
    """tools/rxe_conformance.py --publish: the four reports, and the capture and agent log of each case with a
    FAIL or ERROR verdict only (a capture above 256 KiB stays out); older evidence in the destination goes."""
    from tools.rxe_conformance import PUBLISH_MAX_PCAP, publish
    rep, dest = tmp_path / "rep", tmp_path / "dest"
    for d in (rep / "captures", rep / "agent", dest / "captures"):
        d.mkdir(parents=True)
    (dest / "captures" / "OLD.pcap").write_bytes(b"old")
    rows = [{"test": "TC-A", "verdict": "FAIL"}, {"test": "TC-B", "verdict": "PASS"},
            {"test": "TC-C", "verdict": "ERROR"}, {"summary": {}}]
    (rep / "report.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    for name in ("report.md", "report.html", "junit.xml"):
        (rep / name).write_text(name)
    for t, size in (("TC-A", 10), ("TC-B", 10), ("TC-C", PUBLISH_MAX_PCAP + 1)):
        (rep / "captures" / f"{t}.pcap").write_bytes(bytes(size))
        (rep / "agent" / f"{t}.jsonl").write_text("{}\n")
    out = publish(rep, dest)
    assert sorted(p.name for p in (dest / "captures").iterdir()) == ["TC-A.pcap"]
    assert sorted(p.name for p in (dest / "agent").iterdir()) == ["TC-A.jsonl", "TC-C.jsonl"]
    assert {"report.md", "report.html", "report.jsonl", "junit.xml"} <= set(out)
    assert (dest / "report.md").read_text() == "report.md"
