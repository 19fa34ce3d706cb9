"""The version of this copy of MetaRoCE and the git revision it was built from, for `--version`.

    metaroce --version       ->  metaroce 0.1.0 (revision 2cd1781b0c4e)
    metaroced --version      ->  metaroced 0.1.0 (revision 2cd1781b0c4e+dirty)

`__version__` here is the one place the version is written: pyproject.toml reads it (`dynamic`), and
the package re-exports it.  The revision comes from `_revision.txt` beside this module, which building a
wheel writes (setup.py), else from git when this is a checkout (`+dirty` when tracked files differ from
it), else "unknown".  Nothing here imports numpy, numba or BCC (nor anything of this package: setup.py
loads this file alone): `--version` answers at once."""
from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

__version__ = "0.1.0"

_HERE = Path(__file__).resolve().parent
STAMP = "_revision.txt"


def revision() -> str:
    """The revision this copy was built from (the stamp), else git_revision(), else "unknown"."""
    stamp = _HERE / STAMP
    if stamp.is_file():
        return stamp.read_text().strip() or "unknown"
    return git_revision(_HERE.parent) or "unknown"


def git_revision(tree: Path | str) -> str | None:
    """The checkout at `tree`'s HEAD (12 hex digits, `+dirty` if tracked files were changed), or None when
    `tree` is not the top of a git checkout (an install inside someone's repository is not one) or git is
    missing."""
    if not (Path(tree) / ".git").exists():
        return None
    try:
        git = ["git", "-C", str(tree)]
        rev = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("+dirty" if dirty else "") if rev else None


def version_text(prog: str) -> str:
    """One line: the program, the version, the revision."""
    return f"{prog} {__version__} (revision {revision()})"


class VersionAction(argparse.Action):
    """argparse's --version, the revision looked up only when asked (not at every start)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="print the version and the git revision, then exit"):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text(parser.prog))
        parser.exit()
