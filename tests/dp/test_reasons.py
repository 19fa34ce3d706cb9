"""Why a QP went to ERR is a named code (dp/reasons.py: Why, one text table): the compiled plane passes names,
never bare integers, to the functions that fail a QP; metaroced's own codes are the same enum."""
from __future__ import annotations

import re
from pathlib import Path

from metaroce_xdp.dp import reasons
from metaroce_xdp.dp.reasons import Why

DP = Path(__file__).resolve().parents[2] / "metaroce_xdp" / "dp"
FAILS = re.compile(r"\b(qp_error|responder_error|nat_error|nat_fail|nat_nak_error)\(")


def _calls(text: str):
    for m in FAILS.finditer(text):
        if text[max(0, m.start() - 4):m.start()] == "def ":
            continue
        j, depth = m.end(), 1
        while depth:
            depth += {"(": 1, ")": -1}.get(text[j], 0)
            j += 1
        yield text[m.start():j]


def test_every_code_has_words():
    for w in Why:
        assert reasons.text(w) and not reasons.text(w).startswith("code ")
    assert reasons.text(9999) == "code 9999"


def test_no_bare_reason_numbers_in_the_compiled_plane():
    bad = []
    for path in DP.glob("*.py"):
        for call in _calls(path.read_text()):
            last = call.rsplit(",", 1)[-1].strip(" )\n")
            if re.fullmatch(r"\d+", last):
                bad.append(f"{path.name}: {' '.join(call.split())}")
    assert bad == []


def test_the_daemon_uses_the_same_codes():
    from metaroce_xdp.daemon import server
    from metaroce_xdp.dp import serve
    assert serve.WHY_BAD_WR == server.WHY_BAD_WR == Why.BAD_WORK_REQUEST
    assert (server.WHY_CLIENT_GONE, server.WHY_DRAIN, server.WHY_ASKED) == \
        (Why.CLIENT_GONE, Why.DAEMON_STOPPING, Why.MODIFIED_TO_ERR)
