"""Every worked example in the specification decodes, and its ICRC verdict is
what the spec says (`hex` blocks valid, `hex bad-icrc` blocks invalid):
MR-ICRC-003, MR-ICRC-010, MR-ICRC-013 on the spec's own bytes.

So the spec's bytes and the codec cannot drift apart.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from metaroce_xdp.wire import decode, encode_packet

SPEC = Path(__file__).resolve().parents[2] / "docs" / "spec"
BLOCK = re.compile(r"^(?:Example (?P<id>[^:\n]+):[^\n]*\n+)?```(?P<info>hex(?: bad-icrc)?)\n(?P<body>.*?)\n```",
                   re.S | re.M)


def examples():
    out = []
    for f in sorted(SPEC.glob("*.md")):
        text = f.read_text()
        for i, m in enumerate(BLOCK.finditer(text)):
            ident = (m.group("id") or f"block{i}").strip()
            out.append(pytest.param(m.group("info"), m.group("body"), id=f"{f.stem}:{ident}"))
    return out


ALL = examples()


def test_spec_has_examples():
    assert len(ALL) >= 15


@pytest.mark.parametrize("info,body", ALL)
def test_example_decodes(info, body):
    frame = bytes.fromhex(re.sub(r"\s+", "", body))
    pkt = decode(frame)
    if info == "hex":
        assert pkt.icrc_ok, "spec example has a wrong ICRC"
        assert encode_packet(pkt, recompute=False) == frame
    else:
        assert pkt.icrc_ok is False
