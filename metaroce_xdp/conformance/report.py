"""Reports of a run: JSON Lines (9.6.1), JUnit XML, Markdown and HTML (9.6.2 and the rule matrix), console.

The matrix lists every rule of the spec: level, whether it applies to the claim,
whether it is observable, the cases that check it and their verdicts, and the
rule's overall verdict; rules no case checks are listed as uncovered.  Every
failure shows the expected and the observed packets and links its capture.
"""
from __future__ import annotations

import html
import json
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from . import interop
from .runner import VERDICTS, RunResult, Verdict
from .spec import Catalogue


@dataclass
class RuleRow:
    id: str
    level: str
    applicable: bool
    why_na: str
    observable: str
    verdicts: list[Verdict]
    effective: list[str] = field(default_factory=list)   # the verdicts as they count (see effective())

    @property
    def overall(self) -> str:
        """The rule's verdict over the run: NOT-APPLICABLE (claim), NOT-OBSERVABLE (Table 9-2), else
        FAIL > ERROR > PASS > BLOCKED > CANNOT-DRIVE > UNCOVERED.  A rule whose only cases were skipped
        for a capability the IUT does not claim is UNCOVERED: no case of this claim checked it."""
        vs = set(self.effective or (v.verdict for v in self.verdicts))
        if not self.applicable:
            return "NOT-APPLICABLE"
        if self.observable == "no":
            return "NOT-OBSERVABLE"
        for v in ("FAIL", "ERROR", "PASS", "BLOCKED", "CANNOT-DRIVE"):
            if v in vs:
                return v
        return "UNCOVERED"

    def why_open(self) -> str:
        """For an applicable MUST rule without a PASS: why (the report's INCONCLUSIVE list)."""
        o = self.overall
        if o == "UNCOVERED":
            skipped = [v for v in self.verdicts if v.verdict == "NOT-APPLICABLE"]
            return ("UNCOVERED: its cases did not run (" + "; ".join(dict.fromkeys(v.detail for v in skipped)) + ")"
                    if skipped else "UNCOVERED: no case checks it")
        picked = [v for v, e in zip(self.verdicts, self.effective) if e == o]
        return f"{o}: " + "; ".join(dict.fromkeys(f"{v.test} {v.detail}" for v in picked[:3]))


def effective(res: RunResult, cat: Catalogue, v: Verdict) -> str:
    """The verdict as it counts: a FAIL that Table 9-3 puts down to the test set-up ("environment") or to
    a check the implementation's agent cannot run ("untestable") is ERROR, not a failure of the IUT."""
    if v.verdict == "FAIL":
        d = interop.explain(_divs(cat), res.iut, v.test, v.rule)
        if d is not None and d.decision in ("environment", "untestable"):
            return "ERROR"
    return v.verdict


def matrix(res: RunResult, cat: Catalogue) -> list[RuleRow]:
    by_rule: dict[str, list[Verdict]] = {}
    for v in res.verdicts():
        by_rule.setdefault(v.rule, []).append(v)
    rows = []
    for r in cat:
        ok, why = cat.applicable(r.id, res.claim)
        vs = by_rule.get(r.id, [])
        rows.append(RuleRow(r.id, r.level, ok, why, r.observable, vs, [effective(res, cat, v) for v in vs]))
    return rows


def _divs(cat: Catalogue) -> list:
    """Table 9-3 (spec 9.7.1), read once per catalogue; none when the spec has no such table."""
    if not hasattr(cat, "_interop"):
        try:
            cat._interop = interop.load(cat.dir)
        except (OSError, interop.InteropTableError):
            cat._interop = []
    return cat._interop


def known(res: RunResult, cat: Catalogue, v: Verdict) -> str:
    """The known-divergence note for a FAIL or ERROR verdict that Table 9-3 explains, else ""."""
    if v.verdict not in ("FAIL", "ERROR"):
        return ""
    d = interop.explain(_divs(cat), res.iut, v.test, v.rule)
    return d.note() if d else ""


MUST = ("must", "must not")


def summary(res: RunResult, cat: Catalogue) -> dict:
    """The summary line of 9.6.1, with the conformance statement of MR-CONF-025: CONFORMANT only when every
    applicable, observable MUST rule has a PASS and none a FAIL; a MUST FAIL is NOT-CONFORMANT; otherwise
    INCONCLUSIVE, with every MUST rule that has no PASS listed by rule and why (ERROR, BLOCKED,
    CANNOT-DRIVE, UNCOVERED)."""
    vs = res.verdicts()
    counts = {k: 0 for k in VERDICTS}
    counts.update(Counter(v.verdict for v in vs))
    rows = matrix(res, cat)
    must = [r for r in rows if r.applicable and r.observable != "no" and r.level in MUST]
    must_fail = sorted(r.id for r in must if r.overall == "FAIL")
    should_fail = sorted(r.id for r in rows if r.applicable and r.level in ("should", "should not")
                         and r.overall == "FAIL")
    open_ = {r.id: r.why_open() for r in must if r.overall not in ("PASS", "FAIL")}
    by = Counter(r.overall for r in must)
    if must_fail:
        conf = "NOT-CONFORMANT"
    elif open_:
        conf = "INCONCLUSIVE"
    else:
        conf = "CONFORMANT"
    return {"run_id": res.run_id, "iut": res.iut, "claim": res.claim.text(), "spec_version": res.spec_version,
            "counts": counts, "must_fail": must_fail, "should_fail": should_fail, "conformance": conf,
            "must_rules": len(must), "must_passed": by["PASS"],
            "must_error": sorted(r.id for r in must if r.overall == "ERROR"),
            "must_blocked": by["BLOCKED"], "must_cannot_drive": by["CANNOT-DRIVE"],
            "must_uncovered": by["UNCOVERED"], "inconclusive": dict(sorted(open_.items())),
            "not_applicable": sorted(r.id for r in rows if not r.applicable and r.level in MUST),
            "explained": sum(1 for v in vs if known(res, cat, v)),
            "unexplained": sum(1 for v in vs if v.verdict in ("FAIL", "ERROR") and not known(res, cat, v))}


def _must_line(s: dict) -> str:
    return (f"applicable observable MUST rules: {s['must_rules']}, passed {s['must_passed']}, failed "
            f"{len(s['must_fail'])}, error {len(s['must_error'])}, blocked {s['must_blocked']}, agent cannot "
            f"drive {s['must_cannot_drive']}, uncovered {s['must_uncovered']}")


def _evidence(res: RunResult, v: Verdict) -> dict:
    run = next(r for r in res.runs if r.case.id == v.test)
    return {"pcap": run.pcap or None, "frames": v.frames, "agent_log": run.agent_log or None,
            "agent_lines": v.agent_lines, "counters": run.counters}


def write_jsonl(res: RunResult, cat: Catalogue, path: Path) -> None:
    """MR-CONF-026: one line per (case, rule) verdict, then the summary line."""
    with open(path, "w") as f:
        for v in res.verdicts():
            f.write(json.dumps({"run_id": res.run_id, "ts": v.ts, "test": v.test, "rule": v.rule, "level": v.level,
                                "profile": v.profile, "verdict": v.verdict, "iut": res.iut, "peer": res.peer,
                                "evidence": _evidence(res, v), "detail": v.detail,
                                "duration_ms": v.duration_ms}, separators=(",", ":")) + "\n")
        f.write(json.dumps({"summary": summary(res, cat)}, separators=(",", ":")) + "\n")


def write_junit(res: RunResult, path: Path) -> None:
    """One <testcase> per case; FAIL -> <failure>, ERROR -> <error>, no rule passed -> <skipped>."""
    suite = ET.Element("testsuite", name="metaroce-conformance", timestamp=res.started)
    props = ET.SubElement(suite, "properties")
    for k, v in (("iut.name", res.iut.get("name", "")), ("iut.version", res.iut.get("version", "")),
                 ("iut.under_test", res.iut.get("under_test", "")), ("iut.claim", res.iut.get("claim", ""))):
        ET.SubElement(props, "property", name=k, value=str(v))
    n = Counter()
    for run in res.runs:
        tc = ET.SubElement(suite, "testcase", classname=f"conformance.{run.case.module}", name=run.case.id,
                           time=f"{run.duration_ms / 1000:.3f}")
        n["tests"] += 1
        fails = [v for v in run.verdicts if v.verdict == "FAIL"]
        errs = [v for v in run.verdicts if v.verdict == "ERROR"]
        if fails:
            n["failures"] += 1
            el = ET.SubElement(tc, "failure", message="; ".join(f"{v.rule}: {v.detail}" for v in fails)[:2000])
            el.text = "\n".join(f"{v.rule}: expected {v.expected}\n  observed: " + "\n  ".join(v.observed or ["-"])
                                for v in fails)
        elif errs:
            n["errors"] += 1
            ET.SubElement(tc, "error", message="; ".join(f"{v.rule}: {v.detail}" for v in errs)[:2000]).text = \
                run.error
        elif all(v.verdict != "PASS" for v in run.verdicts):
            n["skipped"] += 1                 # nothing decided: not claimed, not observable, blocked, not driven
            ET.SubElement(tc, "skipped", message=run.skipped or "; ".join(
                dict.fromkeys(f"{v.verdict}: {v.detail}" for v in run.verdicts))[:2000])
        out = ET.SubElement(tc, "system-out")
        out.text = "\n".join(f"{v.rule} {v.verdict}: {v.detail}" for v in run.verdicts)
    for k in ("tests", "failures", "errors", "skipped"):
        suite.set(k, str(n[k]))
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)


def _ev_text(res: RunResult, v: Verdict) -> str:
    run = next(r for r in res.runs if r.case.id == v.test)
    if not run.pcap or v.verdict in ("NOT-APPLICABLE", "NOT-OBSERVABLE"):
        return "-"
    name = Path(run.pcap).name
    return name + (" " + ",".join(f"#{n}" for n in v.frames) if v.frames else "")


def _md_cell(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def write_markdown(res: RunResult, cat: Catalogue, path: Path) -> None:
    s = summary(res, cat)
    rows = matrix(res, cat)
    L = [f"# MetaRoCE conformance report: {res.iut['name']} {res.iut['version']}", "",
         f"* implementation under test: {res.iut.get('under_test') or 'not named by the agent'}",
         f"* run: `{res.run_id}`, spec {res.spec_version}, peer {res.peer}",
         f"* claim: **{s['claim']}** (profiles {', '.join(res.claim.profiles)}; capabilities "
         f"{', '.join(sorted(res.claim.caps)) or 'none'})",
         f"* conformance (MR-CONF-025): **{s['conformance']}** - {_must_line(s)}",
         "* verdicts: " + "  ".join(f"{k} {v}" for k, v in s["counts"].items()),
         f"* FAIL and ERROR verdicts explained by a known, decided divergence (spec 9.7.1, Table 9-3): "
         f"{s['explained']}; **unexplained: {s['unexplained']}**", ""]
    if s["must_fail"]:
        L.append("MUST failures: " + ", ".join(s["must_fail"]))
        L.append("")
    if s["inconclusive"]:
        L += [f"## Inconclusive: applicable MUST rules without a PASS ({len(s['inconclusive'])})", "",
              "Each keeps the claim from CONFORMANT (MR-CONF-025).", "", "| Rule | Why |", "|---|---|"]
        L += [f"| {r} | {_md_cell(why)} |" for r, why in s["inconclusive"].items()]
        L.append("")
    L += ["## Verdicts (9.6.2)", "", "| Rule | Test | Level | Profile | Verdict | Evidence | Detail |",
          "|---|---|---|---|---|---|---|"]
    for v in sorted(res.verdicts(), key=lambda v: (v.rule, v.test)):
        L.append(f"| {v.rule} | {v.test} | {v.level} | {v.profile} | {v.verdict} | {_md_cell(_ev_text(res, v))} | "
                 f"{_md_cell(v.detail)}{_md_cell(' -- ' + known(res, cat, v) if known(res, cat, v) else '')} |")
    L.append("")
    fails = [v for v in res.verdicts() if v.verdict in ("FAIL", "ERROR")]
    if fails:
        L += ["## Failures and errors", ""]
        for v in fails:
            run = next(r for r in res.runs if r.case.id == v.test)
            L += [f"### {v.test} / {v.rule}: {v.verdict}", "", f"{v.detail}", "",
                  f"**{known(res, cat, v) or 'unexplained: no row of Table 9-3 (spec 9.7.1) covers it'}**", "",
                  f"capture: [{run.pcap}]({run.pcap}), agent log: [{run.agent_log}]({run.agent_log})", ""]
            if v.expected:
                L += ["expected:", "", "```", v.expected, "```", ""]
            L += ["observed:", "", "```", *(v.observed or ["(no frames)"]), "```", ""]
            if run.error and v.verdict == "ERROR":
                L += ["```", run.error, "```", ""]
    L += ["## Rule matrix", "", "Every rule of the spec, the cases that check it and the rule's verdict.", "",
          "| Rule | Level | Applies | Observable | Cases | Verdict |", "|---|---|---|---|---|---|"]
    for r in rows:
        cases = ", ".join(f"{v.test} {v.verdict}" for v in r.verdicts) or "-"
        L.append(f"| {r.id} | {r.level} | {'yes' if r.applicable else 'no'} | {r.observable} | {cases} | "
                 f"{r.overall} |")
    unc = [r for r in rows if r.overall == "UNCOVERED"]
    L += ["", f"## Uncovered rules ({len(unc)})", "",
          "Applicable rules that no case of this run checks.", "",
          ", ".join(r.id for r in unc) or "none", ""]
    unobs = [r for r in rows if r.observable != "yes"]
    L += ["## Rules not (fully) observable (MR-CONF-037, Table 9-2)", ""]
    for r in unobs:
        L.append(f"* {r.id} ({r.observable}): {cat[r.id].unobservable_what or 'marked in its text'}")
    L.append("")
    path.write_text("\n".join(L))


_CSS = """body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}
.PASS{background:#d8f5d0}.FAIL{background:#f7c6c6}.ERROR{background:#f7e0a6}
.NOT-APPLICABLE,.NOT-OBSERVABLE{background:#e8e8e8}.BLOCKED,.CANNOT-DRIVE,.INCONCLUSIVE{background:#e6dcf5}.UNCOVERED{background:#fff}pre{background:#f6f6f6;padding:6px}"""


def write_html(res: RunResult, cat: Catalogue, path: Path) -> None:
    e = html.escape
    s = summary(res, cat)
    rows = matrix(res, cat)
    H = [f"<!doctype html><html><head><meta charset='utf-8'><title>MetaRoCE conformance: {e(res.iut['name'])}"
         f"</title><style>{_CSS}</style></head><body>",
         f"<h1>MetaRoCE conformance report: {e(res.iut['name'])} {e(res.iut['version'])}</h1>",
         f"<p>implementation under test: <b>{e(res.iut.get('under_test') or 'not named by the agent')}</b><br>",
         f"run <code>{e(res.run_id)}</code>, spec {e(res.spec_version)}, peer {e(res.peer)}<br>",
         f"claim <b>{e(s['claim'])}</b><br>conformance (MR-CONF-025): <b class='{e(s['conformance'])}'>"
         f"{e(s['conformance'])}</b>: {e(_must_line(s))}<br>",
         "verdicts: " + " &nbsp; ".join(f"{k} {v}" for k, v in s["counts"].items()) + "<br>",
         f"FAIL and ERROR verdicts explained by a known, decided divergence (spec 9.7.1, Table 9-3): "
         f"{s['explained']}; <b>unexplained: {s['unexplained']}</b></p>",
         "<h2>Verdicts</h2><table><tr><th>Rule</th><th>Test</th><th>Level</th><th>Profile</th><th>Verdict</th>"
         "<th>Evidence</th><th>Detail</th></tr>"]
    for v in sorted(res.verdicts(), key=lambda v: (v.rule, v.test)):
        run = next(r for r in res.runs if r.case.id == v.test)
        ev = _ev_text(res, v)
        evh = f"<a href='{e(run.pcap)}'>{e(ev)}</a>" if ev != "-" else "-"
        H.append(f"<tr><td>{e(v.rule)}</td><td>{e(v.test)}</td><td>{e(v.level)}</td><td>{e(v.profile)}</td>"
                 f"<td class='{v.verdict}'>{v.verdict}</td><td>{evh}</td><td>{e(v.detail)}"
                 f"{'<br><i>' + e(known(res, cat, v)) + '</i>' if known(res, cat, v) else ''}</td></tr>")
    H.append("</table>")
    fails = [v for v in res.verdicts() if v.verdict in ("FAIL", "ERROR")]
    if fails:
        H.append("<h2>Failures and errors</h2>")
        for v in fails:
            run = next(r for r in res.runs if r.case.id == v.test)
            H.append(f"<h3 class='{v.verdict}'>{e(v.test)} / {e(v.rule)}: {v.verdict}</h3><p>{e(v.detail)}<br>"
                     f"capture <a href='{e(run.pcap)}'>{e(run.pcap)}</a>, agent log "
                     f"<a href='{e(run.agent_log)}'>{e(run.agent_log)}</a><br><b>"
                     f"{e(known(res, cat, v) or 'unexplained: no row of Table 9-3 (spec 9.7.1) covers it')}</b></p>")
            if v.expected:
                H.append(f"<p>expected</p><pre>{e(v.expected)}</pre>")
            H.append(f"<p>observed</p><pre>{e(chr(10).join(v.observed or ['(no frames)']))}</pre>")
            if run.error and v.verdict == "ERROR":
                H.append(f"<pre>{e(run.error)}</pre>")
    if s["inconclusive"]:
        H.append(f"<h2>Inconclusive: applicable MUST rules without a PASS ({len(s['inconclusive'])})</h2><table>"
                 "<tr><th>Rule</th><th>Why</th></tr>")
        H += [f"<tr><td>{e(r)}</td><td>{e(why)}</td></tr>" for r, why in s["inconclusive"].items()]
        H.append("</table>")
    H.append("<h2>Rule matrix</h2><table><tr><th>Rule</th><th>Level</th><th>Applies</th><th>Observable</th>"
             "<th>Cases</th><th>Verdict</th><th>Text</th></tr>")
    for r in rows:
        cases = "<br>".join(f"{e(v.test)} <span class='{v.verdict}'>{v.verdict}</span>" for v in r.verdicts) or "-"
        H.append(f"<tr><td>{r.id}</td><td>{r.level}</td><td>{'yes' if r.applicable else 'no'}</td>"
                 f"<td>{r.observable}</td><td>{cases}</td><td class='{r.overall}'>{r.overall}</td>"
                 f"<td>{e(cat[r.id].title)}</td></tr>")
    H.append("</table>")
    unc = [r.id for r in rows if r.overall == "UNCOVERED"]
    H.append(f"<h2>Uncovered rules ({len(unc)})</h2><p>{e(', '.join(unc) or 'none')}</p>")
    H.append("<h2>Rules not (fully) observable (MR-CONF-037)</h2><ul>")
    for r in rows:
        if r.observable != "yes":
            H.append(f"<li>{r.id} ({r.observable}): {e(cat[r.id].unobservable_what or 'marked in its text')}</li>")
    H.append("</ul></body></html>")
    path.write_text("\n".join(H))


def console(res: RunResult, cat: Catalogue) -> str:
    s = summary(res, cat)
    lines = []
    for v in sorted(res.verdicts(), key=lambda v: (v.rule, v.test)):
        if v.verdict in ("FAIL", "ERROR"):
            k = known(res, cat, v)
            lines.append(f"{v.verdict:<6} {v.rule:<13} {v.test:<15} {v.detail}"
                         + (f" [{k.split('; decided: ')[1].split(' (')[0]}: known divergence, 9.7.1]" if k else ""))
    lines.append("  ".join(f"{k} {n}" for k, n in s["counts"].items()))
    lines.append(f"Conformance ({s['claim']}): {s['conformance']}"
                 + (f" (MUST failures: {', '.join(s['must_fail'])})" if s["must_fail"] else "")
                 + f"; {_must_line(s)}")
    if s["conformance"] == "INCONCLUSIVE":
        rules = list(s["inconclusive"])
        lines.append("MUST rules without a PASS: " + ", ".join(rules[:24])
                     + (f", ... ({len(rules)} in all; the reports list each and why)" if len(rules) > 24 else ""))
    lines.append(f"FAIL/ERROR verdicts explained by known divergences (9.7.1): {s['explained']}, "
                 f"unexplained: {s['unexplained']}")
    return "\n".join(lines)


def write_all(res: RunResult, cat: Catalogue, report_dir: Path | str) -> dict[str, Path]:
    d = Path(report_dir)
    d.mkdir(parents=True, exist_ok=True)
    paths = {"jsonl": d / "report.jsonl", "junit": d / "junit.xml", "md": d / "report.md", "html": d / "report.html"}
    write_jsonl(res, cat, paths["jsonl"])
    write_junit(res, paths["junit"])
    write_markdown(res, cat, paths["md"])
    write_html(res, cat, paths["html"])
    return paths


__all__ = ["console", "known", "matrix", "summary", "write_all", "write_html", "write_jsonl", "write_junit",
           "write_markdown"]
