"""perftest's out-of-band exchange (metaroce_xdp/cli/perftest_oob.py): the key message byte for byte, hostile
messages refused, and `metaroce perf --perftest` against a `metaroce perf` server, which recognises the
exchange by itself -- every test, several QPs, -a and -D.  The same flows against Debian's real perftest on
Soft-RoCE: tests/conformance/test_rxe_agent.py (test_perftest_*)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metaroce_xdp.cli import perftest_oob as pt

ROOT = Path(__file__).resolve().parents[2]


def test_key_message_is_perftests_format():
    k = pt.Key(qpn=0x108, psn=0x9D3B6B, rkey=0x1FFFBD, vaddr=0x7F5B1E5F9000, out_reads=1,
               gid=bytes(10) + b"\xff\xff\xc0\xa8\x01\x01")
    assert k.encode() == (b"0000:0001:000108:9d3b6b:001fffbd:00007f5b1e5f9000:"
                          b"00:00:00:00:00:00:00:00:00:00:ff:ff:c0:a8:01:01:00000000:\0")
    assert len(k.encode()) == pt.KEY_LEN == 108


@given(st.integers(0, 0xFFFFFF), st.integers(0, 0xFFFFFF), st.integers(0, 0xFFFFFFFF), st.integers(0, 2**64 - 1),
       st.binary(min_size=16, max_size=16), st.integers(0, 0xFFFF), st.integers(0, 0xFFFF))
def test_key_round_trip(qpn, psn, rkey, va, gid, out_reads, lid):
    k = pt.Key(qpn=qpn, psn=psn, rkey=rkey, vaddr=va, gid=gid, out_reads=out_reads, lid=lid)
    assert pt.Key.decode(k.encode()) == k


@given(st.binary(min_size=0, max_size=120))
def test_key_decode_refuses_what_perftest_does_not_send(b):
    try:
        k = pt.Key.decode(b)
    except pt.PerftestError:
        return
    assert k.encode() == b                          # only the exact canonical form is taken


def test_near_misses_are_refused():
    good = pt.Key(qpn=0xabc, psn=2, rkey=3, vaddr=4, gid=bytes(16)).encode()
    for bad in (good[:-1], good + b"\0", good.upper(), good[:-1] + b"x", good.replace(b":", b";", 1),
                good[:10] + b"g" + good[11:]):
        with pytest.raises(pt.PerftestError):
            pt.Key.decode(bad)


def test_versions_and_detection():
    assert pt.version_ok(b"6.06" + bytes(12)) == pytest.approx(6.06)
    for old in (b"5.60" + bytes(12), bytes(16), b"MRC1" + bytes(12), b"x.yz" + bytes(12)):
        with pytest.raises(pt.PerftestError):
            pt.version_ok(old)
    assert pt.looks_like_perftest(b"6.06") and not pt.looks_like_perftest(b"MRC1")


@pytest.mark.parametrize("page,line", [(1 << 31, 64), (0, 64), (4097, 64), (4096, 1 << 20), (4096, 48)])
def test_hostile_page_or_cache_line_size_is_refused(page, line):
    """Our buffers are sized from the larger page size: a peer's 2 GiB "page" must be refused, not allocated."""
    import socket
    import struct
    from metaroce_xdp import cm
    a, b = socket.socketpair()
    try:
        b.sendall(b"6.06" + bytes(12) + struct.pack(">I", page) + struct.pack(">I", line))
        ex = pt.Exchange(cm.Channel(a, "peer"), client=False, timeout=5)
        with pytest.raises(pt.PerftestError, match="power of two"):
            ex.hello(1024)
    finally:
        a.close()
        b.close()


CASES = [("write-bw", ["-n", "200", "-q", "3"]), ("read-bw", ["-n", "200"]), ("send-bw", ["-n", "200"]),
         ("write-lat", ["-n", "200"]), ("write-bw", ["-n", "3", "-a"]), ("send-bw", ["-n", "3", "-a"]),
         ("write-lat", ["-n", "5", "-a"]), ("read-bw", ["-n", "50", "-D", "1"])]


@pytest.mark.netns
@pytest.mark.timeout(600)
def test_perftest_exchange_between_two_metaroce_perfs():
    """Our perftest client against our server (which takes it for perftest by its first bytes): each test
    completes on both sides with rows for every size (-a), every QP (-q 3) and a duration (-D)."""
    from metaroce_xdp.topo import two_hosts
    topo, pair = two_hosts(prefix="mrpt")
    cli = [sys.executable, "-m", "metaroce_xdp.cli", "perf"]
    try:
        for test, extra in CASES:
            srv = topo.popen(topo[1], [*cli, test, "-d", pair.b.ifname, "-j", *extra], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
            for line in srv.stderr:
                if "Waiting for client" in line:
                    break
            c = topo.popen(topo[0], [*cli, test, "-d", pair.a.ifname, "--perftest", "-j", *extra, pair.b.ipv4],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
            try:
                cout, cerr = c.communicate(timeout=240)
                sout, serr = srv.communicate(timeout=60)
            finally:
                for p in (c, srv):
                    if p.poll() is None:
                        p.kill()
                        p.wait()
            assert c.returncode == 0 and srv.returncode == 0, (test, extra, cerr[-2000:], serr[-2000:])
            assert "using perftest's exchange" in serr, serr
            crs = [json.loads(ln) for ln in cout.splitlines() if ln.startswith("{")]     # a row per size
            srs = [json.loads(ln) for ln in sout.splitlines() if ln.startswith("{")]
            cr, sr = crs[-1], srs[-1]
            assert cr["peer"] == sr["peer"] == "perftest", (cr, sr)
            if "-a" in extra:
                assert [r["bytes"] for r in crs] == [1 << k for k in range(1, 24)], crs
                if test in ("send-bw", "write-lat"):  # each side measures each size
                    assert [r["bytes"] for r in srs] == [1 << k for k in range(1, 24)], srs
            if "-q" in extra:
                assert sr["qps"] == 3 and sr["client_report"]["iterations"] == 600, sr
            if "-D" in extra:
                assert cr["duration"] == 1.0 and cr["iterations"] > 50 and cr["batches"] >= 1, cr
            if test in ("write-bw", "read-bw"):        # the bw server prints the client's report
                assert sr["client_report"]["bytes"] == cr["bytes"], (cr, sr)
                assert sr["client_report"]["bw_average"] == pytest.approx(cr["mb_per_s"], rel=1e-6), (cr, sr)
            if test == "write-lat":
                assert cr["lat_us"]["typical"] > 0 and sr["lat_us"]["typical"] > 0
            time.sleep(0.2)
    finally:
        topo.close()
