"""Rule IDs: every one the spec defines is defined once, and every one cited exists.

The spec (docs/spec/README.md section 2.2) defines each rule as a paragraph
that starts with its bold identifier.  Code and tests cite rules by ID (STYLE
habit 3); this test makes sure a citation cannot point at nothing, e.g. after a
typo or a renumbering.  It also prints how many compat-profile rules (files
01, 02, 03, 07 and 08, README section 1) are cited somewhere in the code.
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "docs" / "spec"
CITING_DIRS = ("metaroce_xdp", "bpf", "tools", "daemon", "tests")
CODE_DIRS = ("metaroce_xdp", "bpf", "tools", "daemon")
COMPAT_FILES = ("01-encapsulation.md", "02-headers.md", "03-compat-rc.md", "07-qp-state.md", "08-memory.md")
SKIP_DIRS = {"__pycache__", ".git", ".venv", ".pytest_cache", ".hypothesis", "node_modules"}

DEFINITION = re.compile(r"^\*\*(MR-[A-Z]+-\d{3})\*\*", re.MULTILINE)
CITATION = re.compile(r"\bMR-[A-Z]+-\d{3}\b")


def _definitions() -> dict[str, list[str]]:
    """Rule ID -> the spec files that define it (a bold ID at the start of a paragraph)."""
    defs: dict[str, list[str]] = {}
    for md in sorted(SPEC.glob("*.md")):
        for rid in DEFINITION.findall(md.read_text()):
            defs.setdefault(rid, []).append(md.name)
    return defs


def _text_files(dirs):
    for d in dirs:
        base = ROOT / d
        if not base.is_dir():
            continue
        for p in sorted(base.rglob("*")):
            if not p.is_file() or SKIP_DIRS.intersection(p.relative_to(ROOT).parts):
                continue
            data = p.read_bytes()
            if b"\0" in data:                       # binary (captures, objects)
                continue
            yield p, data.decode("utf-8", errors="replace")


def _citations(dirs) -> dict[str, list[str]]:
    """Rule ID -> "path:line" of each place that cites it."""
    cites: dict[str, list[str]] = {}
    for p, text in _text_files(dirs):
        rel = p.relative_to(ROOT)
        for n, line in enumerate(text.splitlines(), 1):
            for rid in CITATION.findall(line):
                cites.setdefault(rid, []).append(f"{rel}:{n}")
    return cites


def test_spec_defines_rules_once():
    defs = _definitions()
    assert len(defs) > 500, f"only {len(defs)} rules found: has the rule format changed?"
    dups = {rid: files for rid, files in defs.items() if len(files) > 1}
    assert not dups, f"rules defined more than once: {dups}"


def test_bold_ids_have_the_rule_shape():
    # A bold ID outside the MR-<AREA>-<NNN> shape would escape the other checks.
    for md in SPEC.glob("*.md"):
        for m in re.finditer(r"^\*\*(MR-[^*]+)\*\*", md.read_text(), re.MULTILINE):
            assert re.fullmatch(r"MR-[A-Z]+-\d{3}", m.group(1)), f"{md.name}: odd rule ID {m.group(1)!r}"


def test_every_cited_rule_exists():
    defs = _definitions()
    unknown = {rid: where for rid, where in _citations(CITING_DIRS).items() if rid not in defs}
    assert not unknown, "citations of rules the spec does not define:\n" + "\n".join(
        f"  {rid}: {', '.join(where[:5])}" for rid, where in sorted(unknown.items()))


def test_report_compat_coverage():
    """Informative: how many compat-profile rules the code cites (printed, not asserted)."""
    defs = _definitions()
    compat = {rid for rid, files in defs.items() if files[0] in COMPAT_FILES}
    cited = set(_citations(CODE_DIRS)) & compat
    by_area = Counter(rid.rsplit("-", 1)[0] for rid in cited)
    print(f"\ncompat-profile rules cited in code: {len(cited)} of {len(compat)}")
    print("  " + ", ".join(f"{a} {n}" for a, n in sorted(by_area.items())))


def test_traceability_names_tests_and_files_that_exist():
    """docs/spec/traceability.md names tests as `test_file::test_name` (or a whole `test_file`) and code
    by path: each must exist, so that the table cannot cite a test that was renamed or never written."""
    import ast
    text = (SPEC / "traceability.md").read_text()
    defined: dict[str, set[str]] = {}

    def functions(module: str) -> set[str]:
        if module not in defined:
            found = sorted((ROOT / "tests").rglob(f"{module}.py"))
            tree = ast.parse(found[0].read_text()) if found else None
            defined[module] = set() if tree is None else {
                n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        return defined[module]

    missing = []
    for row in re.findall(r"^\| (MR-[A-Z]+-\d{3}) \|.*\| (.*) \|$", text, re.MULTILINE):
        rid, tested = row
        for mod, fn in re.findall(r"\b(test_\w+)::(test_\w+)", tested):
            if fn not in functions(mod):
                missing.append(f"{rid}: {mod}::{fn}")
        for mod in re.findall(r"(?<![:\w])(test_\w+)\b(?!::)", tested):
            if not any((ROOT / "tests").rglob(f"{mod}.py")):
                missing.append(f"{rid}: {mod} (no tests/*/{mod}.py)")
    for path in set(re.findall(r"\b((?:metaroce_xdp|bpf|tools|daemon|tests)/[\w./-]*\w)", text)):
        if not (ROOT / path).exists():
            missing.append(f"no file {path}")
    assert not missing, "traceability.md names what does not exist:\n  " + "\n  ".join(sorted(missing))
