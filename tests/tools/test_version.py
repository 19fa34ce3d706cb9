"""`--version` on every command: the program, the package version and the git revision it runs from."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from metaroce_xdp import __version__

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("prog,argv", [("metaroce", ["-m", "metaroce_xdp.cli"]),
                                       ("metaroced", ["-m", "metaroce_xdp.daemon.main"]),
                                       ("metaroced", ["-m", "metaroce_xdp.daemon"]),
                                       ("metaroced", ["daemon/metaroced"]),
                                       ("metaroce-conformance", ["-m", "metaroce_xdp.conformance.cli"])])
def test_version_names_the_program_version_and_revision(prog, argv):
    r = subprocess.run([sys.executable, *argv, "--version"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    m = re.fullmatch(rf"{re.escape(prog)} {re.escape(__version__)} \(revision ([0-9a-f]{{12}})(\+dirty)?\)\n",
                     r.stdout)
    assert m and m.group(1) == head, (r.stdout, head)
