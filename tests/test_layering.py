"""The package's layering, read from the source with ast (nothing imported, no numba): fast.

* metaroce_xdp.rc, the old pure-Python engine, is gone (issue 20): the compiled plane is the one
  implementation; no module imports metaroce_xdp.rc.
* dp/ (the data plane) imports nothing from daemon/ (metaroced, which hosts it) or tools/.
* dp/ is split by role, as rxe is: core (and ring) import no role; the roles import down the order
  ring < core < cc < requester < completer < responder < atomics < round, never up; the native
  profile's glue (native/plane_slot.py < plane_read.py < plane_tx.py < plane.py) sits between the roles and the round.  No import circle in the package,
  no import statement after the first definition of a module, no sys.modules guard.
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


# the compiled plane's modules, lowest first: a module may import only modules before it
ROLE_ORDER = ["dp.ring", "dp.core", "dp.cc", "dp.requester", "dp.completer", "dp.responder", "dp.atomics",
              "native.plane_slot", "native.plane_read", "native.plane_tx", "native.plane", "dp.round", "dp.inproc", "dp.drive", "dp.serve"]


def test_roles_import_down_the_order_only():
    full = ["metaroce_xdp." + m for m in ROLE_ORDER]
    bad = {}
    for i, mod in enumerate(ROLE_ORDER):
        got = imports(PKG / (mod.replace(".", "/") + ".py"))
        up = sorted(m for m in full[i:] if m in got)
        if up:
            bad[mod] = up
    assert not bad, bad


def test_core_imports_no_role():
    got = imports(PKG / "dp" / "core.py")
    roles = {"metaroce_xdp.dp." + r for r in ("cc", "requester", "completer", "responder", "atomics", "round")}
    assert not got & roles, got & roles


def _import_graph() -> dict[str, set[str]]:
    mods = {_module(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for m, p in mods.items():
        graph[m] = {n for n in imports(p) if n in mods and n != m and not p.name == "__init__.py"}
    return graph


def test_no_import_circle_in_the_package():
    """Tarjan's strongly connected components of the module graph (a package's __init__ left out: importing
    a submodule runs it, but it is not what imports what)."""
    graph = _import_graph()
    index, low, stack, on, sccs = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not sccs, sccs


def test_compiled_modules_import_at_the_top_without_guards():
    """In dp/ and native/: every module-level import comes before the first def or class, and no module
    checks sys.modules to find out who imported it."""
    bad = {}
    for path in sorted([*(PKG / "dp").glob("*.py"), *(PKG / "native").glob("*.py")]):
        text = path.read_text()
        seen_def = False
        for node in ast.parse(text).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                seen_def = True
            elif seen_def and isinstance(node, (ast.Import, ast.ImportFrom)):
                bad.setdefault(str(path.relative_to(ROOT)), []).append(node.lineno)
        if "sys.modules" in text:
            bad.setdefault(str(path.relative_to(ROOT)), []).append("sys.modules")
    assert not bad, bad
