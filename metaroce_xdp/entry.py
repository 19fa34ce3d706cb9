"""The installed commands' entry points (pyproject.toml [project.scripts]): each runs its `main`, and
when a module of the endpoint's dependencies is missing -- an install of the package alone, or with
the [client] extra, which is the client library and needs only numpy -- says which and how to get
it in one line (exit 1), not with a traceback.

    metaroce              -> metaroce_xdp.cli.main:main
    metaroced             -> metaroce_xdp.daemon.main:main
    metaroce-conformance  -> metaroce_xdp.conformance.cli:main
"""
from __future__ import annotations

import importlib
import sys

# what the [daemon] extra brings, and BCC (Debian's python3-bpfcc: not on PyPI)
ENDPOINT_MODULES = ("numba", "llvmlite", "pyroute2", "psutil", "typer", "click", "rich", "scapy",
                    "prometheus_client", "bcc")


def missing_dependency_text(prog: str, name: str) -> str:
    if name == "bcc":
        how = ("install Debian's python3-bpfcc and make the venv with --system-site-packages "
               "(`make install` does both)")
    else:
        how = "install the endpoint's dependencies: pip install 'metaroce-xdp[daemon]'"
    return f"{prog}: this install has no module {name!r}; {how}"


def _run(prog: str, module: str) -> int:
    try:
        rc = importlib.import_module(module).main()
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top not in ENDPOINT_MODULES:
            raise
        print(missing_dependency_text(prog, top), file=sys.stderr)
        return 1
    return rc or 0


def metaroce() -> int:
    return _run("metaroce", "metaroce_xdp.cli.main")


def metaroced() -> int:
    return _run("metaroced", "metaroce_xdp.daemon.main")


def metaroce_conformance() -> int:
    return _run("metaroce-conformance", "metaroce_xdp.conformance.cli")
