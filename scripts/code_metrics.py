#!/usr/bin/env python3
"""Size and shape of the metaroce_xdp package, from its source alone (ast; nothing is imported).

Prints: lines of Python, number of modules, functions longer than 80 lines, and the strongly
connected components (import circles) of the intra-package import graph -- every import counts,
at module level or inside a function.  Issue 20 asks for these before and after a change.

    python scripts/code_metrics.py [--long] [--with-init] [package_dir]
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

LONG = 80


def module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative imports resolved against mod)."""
    if not node.level:
        return node.module or ""
    base = mod.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(root: Path, mods: dict[str, Path], with_init: bool = False) -> dict[str, set[str]]:
    """Edges module -> modules of the package it imports (a package's __init__ only when its own
    names are imported, not for each submodule taken from it)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                # "from pkg import sub" depends on the submodule; "from mod import name" on mod
                base = resolve(mod, is_pkg, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
                if with_init:       # importing a submodule runs its package's __init__ too
                    targets.append(base)
            for t in targets:
                # the longest package module the name starts with ("from .x import f" -> x)
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one member (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def long_functions(mods: dict[str, Path], limit: int) -> list[tuple[int, str]]:
    found = []
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    found.append((n, f"{mod}:{node.name}"))
    return sorted(found, reverse=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("package", nargs="?", default=str(Path(__file__).resolve().parent.parent / "metaroce_xdp"))
    ap.add_argument("--long", action="store_true", help="list the long functions")
    ap.add_argument("--with-init", action="store_true",
                    help="count 'from pkg import sub' as importing pkg/__init__ too (larger circles)")
    args = ap.parse_args()
    root = Path(args.package).resolve()
    mods = {module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    loc = sum(len(p.read_text().splitlines()) for p in mods.values())
    longs = long_functions(mods, LONG)
    comps = sccs(imports(root, mods, args.with_init))
    print(f"package: {root.name}")
    print(f"lines of Python: {loc}")
    print(f"modules: {len(mods)}")
    print(f"functions over {LONG} lines: {len(longs)}")
    if args.long:
        for n, name in longs:
            print(f"  {n:5d}  {name}")
    print(f"import circles (SCCs > 1 module): {len(comps)}")
    for c in comps:
        print(f"  {len(c)} modules: {' '.join(c)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
