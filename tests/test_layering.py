"""The package's layering, read from the source with ast (nothing imported, no numba): fast.

* metaroce_xdp.rc, the old pure-Python engine, is gone (issue 20): the compiled plane is the one
  implementation; no module imports metaroce_xdp.rc.
* dp/ (the data plane) imports nothing from daemon/ (metaroced, which hosts it) or tools/.
* The package imports nothing from the checkout's top-level tools/ or daemon/ (neither is in the wheel).
* dp/ is split by role, as rxe is: core (and ring) import no role; the roles import down the order
  ring < core < cc < requester < completer < responder < atomics < round, never up; the native
  profile's glue (native/plane_slot.py < plane_read.py < plane_tx.py < plane.py) sits between the roles and the round.  No import circle in the package,
  no import statement after the first definition of a module, no sys.modules guard.
* One place for the wire (issue 20): dp/ and native/plane*.py know no header byte offset -- no frame
  buffer indexed at a literal offset or a literal added to an offset, no received byte read directly,
  no get_be/put_be outside wire/ (wire/hdr.py's accessors, writers and opcode table do it).
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


def test_the_package_imports_nothing_the_wheel_lacks():
    bad = {}
    for path in sorted(PKG.rglob("*.py")):
        hits = sorted(n for n in imports(path) if _under(n, "tools") or _under(n, "daemon") or _under(n, "tests"))
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


# ---- one place for the wire -----------------------------------------------------------------------------
# Frame bytes as the plane's code names them: received frames (the UMEM, a kernel SACK record), the extension
# header scratch, the QPs' header templates (TM compiled; tm, tb in Python), and generic frame buffers.
RECEIVED = {"umem", "raw"}
FRAME_BUFFERS = RECEIVED | {"ext", "TM", "tm", "tb", "buf", "frame"}
# (file, function) -> why it may index frame bytes at a literal offset.  Empty: nothing has to.
OFFSET_ALLOW: dict[tuple[str, str], str] = {}


def _literal_offset(index: ast.AST) -> bool:
    """The index is an integer literal or adds or subtracts one: buf[14], buf[b + 12], tm[o + 8:o + 40]."""
    parts = index.elts if isinstance(index, ast.Tuple) else [index]
    for part in parts:
        bounds = [part.lower, part.upper] if isinstance(part, ast.Slice) else [part]
        for node in bounds:
            if node is None:
                continue
            if isinstance(node, ast.Constant) and type(node.value) is int:
                return True
            for n in ast.walk(node):
                if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Add, ast.Sub)) and any(
                        isinstance(o, ast.Constant) and type(o.value) is int for o in (n.left, n.right)):
                    return True
    return False


def _buffer_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def wire_offenders(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, enclosing function, what) for each header offset the code knows by number."""
    out = []

    def visit(node, fn):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            fn = node.name
            if node.name in ("get_be", "put_be"):
                out.append((node.lineno, fn, f"defines {node.name}"))
        if isinstance(node, ast.Subscript):
            name = _buffer_name(node.value)
            if name in RECEIVED:
                out.append((node.lineno, fn, f"reads {name}[...] (a header accessor of wire/hdr.py does)"))
            elif name in FRAME_BUFFERS and _literal_offset(node.slice):
                out.append((node.lineno, fn, f"{name}[...] at a literal offset"))
        if isinstance(node, ast.Call) and _buffer_name(node.func) in ("get_be", "put_be"):
            out.append((node.lineno, fn, f"calls {_buffer_name(node.func)}"))
        for child in ast.iter_child_nodes(node):
            visit(child, fn)

    visit(tree, "<module>")
    return out


def test_the_wire_scan_sees_offsets():
    """The scan below would pass vacuously if it missed the forms the plane used to have."""
    bad = ["x = umem[b + 12]", "ext[14] = nw", "v = get_be(umem, h, 8)", "put_be(ext, 0, v, 4)",
           "TM[qi, o + 1] = 0", "g = tm[o + 8:o + 40]", "tb[len(tb) - 12 + 4] = 0x40", "p = raw[i]",
           "def get_be(umem, off, n):\n    return 0"]
    good = ["ext[k] = (orig >> (8 * k)) & 0xFF", "t = TM[qi, TM_CNP:]", "put_reth(ext, 0, va, rkey, n)",
            "A[b + O_WD:b + O_WD + 32] = 0", "pl.TM[self.qi, :len(buf)] = buf"]
    for src in bad:
        assert wire_offenders(ast.parse(src)), src
    for src in good:
        assert not wire_offenders(ast.parse(src)), src


def test_the_plane_knows_no_header_offset():
    """dp/ and native/plane*.py read and write headers only through wire/hdr.py."""
    bad = {}
    for path in sorted([*(PKG / "dp").glob("*.py"), *(PKG / "native").glob("plane*.py")]):
        rel = str(path.relative_to(ROOT))
        hits = [h for h in wire_offenders(ast.parse(path.read_text(), rel)) if (rel, h[1]) not in OFFSET_ALLOW]
        if hits:
            bad[rel] = hits
    assert not bad, bad


def test_get_be_and_put_be_stay_in_wire():
    bad = {}
    for path in sorted(PKG.rglob("*.py")):
        if (PKG / "wire") in path.parents:
            continue
        tree = ast.parse(path.read_text(), str(path))
        hits = [h for h in wire_offenders(tree) if "get_be" in h[2] or "put_be" in h[2]]
        if hits:
            bad[str(path.relative_to(ROOT))] = hits
    assert not bad, bad
