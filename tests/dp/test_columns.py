"""The compiled plane's column numbers are written out (scripts/gen_columns.py): every block matches its list,
the imported modules agree, and no module makes names with globals() any more (grep finds each column)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gen_columns  # noqa: E402


def test_blocks_are_up_to_date():
    assert gen_columns.stale() == [], "run scripts/gen_columns.py"


def test_modules_agree_with_their_lists():
    from metaroce_xdp.dp import layout as L
    from metaroce_xdp.native import layout as NL
    for mod, rel in ((L, "metaroce_xdp/dp/layout.py"), (NL, "metaroce_xdp/native/layout.py")):
        text = (ROOT / rel).read_text()
        blocks = list(gen_columns.BLOCK.finditer(text))
        assert blocks
        for m in blocks:
            for i, f in enumerate(getattr(mod, m["name"])):
                assert getattr(mod, m["prefix"] + f.upper()) == i, (rel, m["name"], f)


def test_no_names_made_with_globals():
    pkg = ROOT / "metaroce_xdp"
    bad = [str(p.relative_to(ROOT)) for p in pkg.rglob("*.py") if re.search(r"globals\(\)\[", p.read_text())]
    assert bad == []
