"""The fuzzers' own rules, without namespaces: cases derive from (seed, case) alone, every generated packet
builds, a crash is classified against the known-open findings and strict mode names none (metaroce_xdp/fuzz,
docs/fuzzing.md).  The short runs against a live daemon and the compiled plane: tests/dp/test_fuzz_live.py."""
from __future__ import annotations

import json

import pytest

from metaroce_xdp.fuzz import ctl, known, pkt, store
from metaroce_xdp.wire import decode


class _Ep:
    def __init__(self, mac, ip, ifname="x"):
        self.mac, self.ipv4, self.ifname = mac, ip, ifname


class _Pair:
    a = _Ep("02:00:00:00:00:01", "10.77.0.1")
    b = _Ep("02:00:00:00:00:02", "10.77.0.2")


INFO = {"qpn": {"victim": 0x10401, "legit": 0x20402}, "peer": {"victim": 0x5F0001, "legit": 0x5F0002},
        "psn": {"victim": 1000, "legit": 5000},
        "mr": {k: {"addr": 0x7F0000000000 + i * 0x100000, "len": 65536, "rkey": 0x100 * (i + 1) + 7, "lkey": i}
               for i, k in enumerate(("victim", "local", "foreign", "legit"))}}


def test_cases_are_a_function_of_seed_and_number():
    assert ctl.gen_case(7, 3) == ctl.gen_case(7, 3)
    assert pkt.gen_case(7, 3) == pkt.gen_case(7, 3)
    assert pkt.gen_case(7, 3) != pkt.gen_case(8, 3)
    json.dumps([ctl.gen_case(1, c) for c in range(50)])           # saved as JSON, replayed from it


def test_every_generated_packet_builds_and_clean_ones_decode():
    w = pkt.Wire(INFO, _Pair())
    clean = 0
    for c in range(300):
        for s in pkt.gen_case(1, c):
            f = pkt.build(s, w)
            assert len(f) >= 14
            if not any(k in s for k in ("flip", "truncate", "extend", "opcode_byte")) and s["icrc"] == "fix" \
                    and not s["bth"]:
                p = decode(f)
                assert p.icrc_ok and p.bth.opcode == s["op"]
                clean += 1
    assert clean > 100


def test_describe_tags_the_shape_of_finding_2():
    s = {"op": 0x0C, "h": {"reth": {"va": ["abs", (1 << 63) - 4096], "rkey": "victim", "dma_len": 65536}},
         "psn": ["epsn", 0], "dest": "victim"}
    d = pkt.describe([s], pkt.Wire(INFO, _Pair()))
    assert "near-2^63" in d and "wrap" in d


def test_known_open_and_strict(monkeypatch):
    """The signatures as written for today's findings (the list itself is emptied once the fixes are merged)."""
    monkeypatch.delenv("METAROCE_FUZZ_STRICT", raising=False)
    monkeypatch.setattr(known, "KNOWN_OPEN", (
        ("F2", r"SIGSEGV.*(near-2\^63|wrap)|(near-2\^63|wrap).*SIGSEGV", ""),
        ("F3", r"RecursionError|maximum recursion depth", "")))
    assert known.classify("endpoint died: SIGSEGV\nRDMA_READ_REQUEST reth va=0x7fffffffffff0000 near-2^63 wrap") == "F2"
    assert known.classify("metaroced A died: exit 1 RecursionError: maximum recursion depth exceeded") == "F3"
    assert known.classify("endpoint died: SIGSEGV\nRDMA_WRITE_ONLY reth va=0x7f0000001000 len=8") is None
    monkeypatch.setenv("METAROCE_FUZZ_STRICT", "1")
    assert known.classify("metaroced A died: exit 1 RecursionError: maximum recursion depth exceeded") is None
    f = store.Finding("ctl", 1, 2, "crash", "metaroced A died: exit 1 RecursionError")
    assert f.new


@pytest.mark.parametrize("kind", ctl.FD_KINDS)
def test_every_fd_kind_can_be_made(kind):
    import os
    fds = ctl.make_fds(kind)
    try:
        assert (kind == "none") == (not fds)
    finally:
        for fd in fds:
            os.close(fd)


def test_avoid_known_changes_only_the_known_shapes(monkeypatch):
    monkeypatch.setenv("METAROCE_FUZZ_AVOID_KNOWN", "1")
    avoided = [pkt.gen_case(1, c) for c in range(200)]
    for case in avoided:
        for s in case:
            for hn in ("reth", "atomiceth"):
                va = s["h"].get(hn, {}).get("va")
                assert not (va and va[0] == "abs" and known.near_2_63(va[1]))
    monkeypatch.delenv("METAROCE_FUZZ_AVOID_KNOWN")
    plain = [pkt.gen_case(1, c) for c in range(200)]
    assert [[s["op"] for s in c] for c in avoided] == [[s["op"] for s in c] for c in plain]
