"""The package's layering, read from the source with ast (nothing imported, no numba): fast.

* metaroce_xdp.rc, the old pure-Python engine, is gone (issue 20): the compiled plane is the one
  implementation; no module imports metaroce_xdp.rc.
* dp/ (the data plane) imports nothing from daemon/ (metaroced, which hosts it) or tools/.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "metaroce_xdp"


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Every module path.py imports (absolute names; relative ones resolved), anywhere in the file."""
    mod = _module(path)
    pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(pkg[:len(pkg) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_the_python_engine_is_gone():
    assert not (PKG / "rc").exists(), "metaroce_xdp/rc/ is back: the compiled plane is the one implementation"
    assert not (ROOT / "tests" / "rc_players.py").exists()


def test_no_module_imports_rc():
    bad = {}
    for path in sorted([*PKG.rglob("*.py"), *(ROOT / "tools").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]):
        hits = sorted(n for n in imports(path) if _under(n, "metaroce_xdp.rc"))
        if hits:
            bad[str(path.relative_to(ROOT))] = hits
    assert not bad, bad


def test_dp_does_not_import_daemon_or_tools():
    bad = {}
    for path in sorted((PKG / "dp").rglob("*.py")):
        hits = sorted(n for n in imports(path) if _under(n, "metaroce_xdp.daemon") or _under(n, "tools")
                      or _under(n, "daemon"))
        if hits:
            bad[str(path.relative_to(ROOT))] = hits
    assert not bad, bad


def test_the_import_reader_sees_relative_imports():
    """The checks above would pass vacuously if relative imports were misread."""
    got = imports(PKG / "dp" / "context.py")
    assert "metaroce_xdp.dp.layout" in got and "metaroce_xdp.netinfo" in got
