"""Known, decided divergences between implementations and the spec (spec 9.7.1, Table 9-3).

Where another implementation (Linux Soft-RoCE today) fails a case, the failure is
examined against the rule and the implementation's source, and decided: the spec is
right and the implementation deviates, the spec was revised, the spec allows both,
the check cannot run on that implementation, or the failure comes from the test
environment.  The decisions live in one place, Table 9-3 of docs/spec/09-conformance.md;
this module reads that table, so the report and the spec cannot disagree:

    divs = load(cat.dir)                       # every row of Table 9-3
    d = explain(divs, res.iut, "TC-RC-012-a", "MR-RC-012")
    d.note() -> "known divergence (rxe): a SEND too long ...; decided: deviates (...); see spec 9.7.1, Table 9-3"

A FAIL or ERROR verdict that no row explains is *unexplained*; the report counts them
(the summary's "unexplained"), and for Linux Soft-RoCE that count must be 0.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path

TABLE = "Table 9-3"

# The Decision column's first words (the rest of the cell may say more).
DECISIONS = {
    "deviates": "the spec is right; the implementation deviates",
    "spec revised": "the spec was revised to allow the implementation's behaviour; the case accepts it",
    "both allowed": "the spec allows both behaviours; the case accepts both",
    "untestable": "the implementation or its agent cannot run the check; the verdict stays ERROR",
    "environment": "the failure comes from the test set-up, not from the implementation",
    "case fixed": "the case demanded more than the rule; it was corrected, and the implementation passes it",
}

# Implementation keys of the first column, and how an IUT is recognised from its agent's hello
# (the report's iut member: name = hello.impl, version = hello.version).
IMPLEMENTATIONS = {
    "rxe": ("Linux Soft-RoCE (rdma_rxe) through the rdma-core agent",
            lambda iut: "rdma_rxe" in str(iut.get("version", "")) or str(iut.get("name", "")).startswith(
                "rdma-core:rxe")),
}

_RULE = re.compile(r"MR-[A-Z]+-\d{3}")
_CASE = re.compile(r"TC-[A-Z0-9]+-\d{3}-[a-z*]|TC-[A-Z0-9]+-\*")


class InteropTableError(ValueError):
    """Table 9-3 is missing or a row of it cannot be read; the message names the row."""


@dataclass(frozen=True)
class Divergence:
    impl: str                  # a key of IMPLEMENTATIONS
    rules: tuple[str, ...]     # the rules whose FAIL/ERROR verdicts the row explains
    cases: tuple[str, ...]     # case IDs (fnmatch patterns allowed, e.g. "TC-MEM-041-*")
    observed: str
    decision: str              # a key of DECISIONS
    why: str

    def covers(self, iut: dict, test: str, rule: str) -> bool:
        ident = IMPLEMENTATIONS.get(self.impl)
        return (ident is not None and ident[1](iut) and rule in self.rules
                and any(fnmatch.fnmatchcase(test, c) for c in self.cases))

    def note(self) -> str:
        return (f"known divergence ({self.impl}): {self.observed.rstrip('.')}; decided: {self.decision} "
                f"({DECISIONS[self.decision]}); see spec 9.7.1, {TABLE}")


def _decision(cell: str) -> str:
    c = cell.strip().strip("*").strip().lower()
    for d in DECISIONS:
        if c.startswith(d):
            return d
    raise InteropTableError(f"{TABLE}: decision {cell!r} is not one of {', '.join(DECISIONS)}")


def parse(text: str) -> list[Divergence]:
    """The rows of Table 9-3 in the text of 09-conformance.md."""
    i = text.find(f"{TABLE}:")
    if i < 0:
        raise InteropTableError(f"{TABLE} not found")
    rows, started = [], False
    for line in text[i:].splitlines()[1:]:
        if line.startswith("|"):
            started = True
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not set("".join(cells)) <= set("-: "):
                rows.append(cells)
        elif started:
            break
    out = []
    for cells in rows[1:]:
        if len(cells) != 6:
            raise InteropTableError(f"{TABLE}: row {cells[:3]} has {len(cells)} cells, expected 6")
        impl, rules, cases, observed, decision, why = cells
        impl = impl.strip("`* ")
        if impl not in IMPLEMENTATIONS:
            raise InteropTableError(f"{TABLE}: unknown implementation {impl!r}")
        rs, cs = tuple(_RULE.findall(rules)), tuple(_CASE.findall(cases))
        if not rs or not cs:
            raise InteropTableError(f"{TABLE}: row {impl} {rules} {cases}: no rule or no case")
        out.append(Divergence(impl, rs, cs, observed, _decision(decision), why))
    return out


def load(spec_dir: Path | str) -> list[Divergence]:
    return parse((Path(spec_dir) / "09-conformance.md").read_text())


def explain(divs: list[Divergence], iut: dict, test: str, rule: str) -> Divergence | None:
    """The row of Table 9-3 that explains a FAIL or ERROR of (test, rule) for this IUT, or None."""
    return next((d for d in divs if d.covers(iut, test, rule)), None)


__all__ = ["DECISIONS", "IMPLEMENTATIONS", "Divergence", "InteropTableError", "explain", "load", "parse"]
