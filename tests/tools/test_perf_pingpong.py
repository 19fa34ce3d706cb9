"""`metaroce perf` and `metaroce pingpong` (spec 06-connection.md, MR-CM).

Codec tests first (no privileges): the pingpong text message against section 6.7
and example CM-4, the MetaRoCE Connection Message against examples CM-1..CM-3,
rc_pingpong's closing lines.  Then the tools as real processes, server in one
namespace and client in the other, over a veth (two_hosts): each perf test,
pingpong, and the errors a user meets first (no server, no such interface).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from metaroce_xdp import cm
from metaroce_xdp.cli import perf, pingpong

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "metaroce_xdp.cli"]


def hexdump(text: str) -> bytes:
    """The spec's offset-prefixed hex dumps -> bytes."""
    return bytes.fromhex("".join(line[4:] for line in text.strip().splitlines()))


# =========================================================================== pingpong format (6.7)


def test_pingpong_message_is_52_bytes_as_in_example_cm4():
    """MR-CM-041, example CM-4."""
    d = cm.PingpongDest(0, 0x11, 0x100, cm.ip_to_gid("10.55.0.1"))
    msg = cm.pp_encode(d)
    assert msg == b"0000:000011:000100:00000000000000000000ffff0a370001\x00"
    assert len(msg) == cm.PP_MSG_LEN == 52
    assert cm.pp_decode(msg) == d


@pytest.mark.parametrize("ip", ["10.77.0.2", "fd77::2", "fe80::1234:56ff:fe78:9abc"])
def test_pingpong_message_round_trip(ip):
    d = cm.PingpongDest(0, 0xABCDEF, 0x123456, cm.ip_to_gid(ip))
    back = cm.pp_decode(cm.pp_encode(d))
    assert back == d and cm.gid_to_ip(back.gid) == ip


def test_wire_gid_is_the_16_bytes_in_order():
    """pingpong.c gid_to_wire_gid: htonl per 32-bit word, so on the wire the bytes keep their order."""
    gid = bytes(range(16))
    assert cm.gid_to_wire(gid) == "000102030405060708090a0b0c0d0e0f"
    assert cm.wire_to_gid(cm.gid_to_wire(gid)) == gid
    assert cm.gid_text(cm.ip_to_gid("10.77.0.1")) == "::ffff:10.77.0.1"     # as inet_ntop prints it


def test_pingpong_message_rejects_garbage():
    with pytest.raises(cm.CMError):
        cm.pp_decode(b"0000:000011:000100:zz\x00".ljust(52, b"\x00"))
    with pytest.raises(cm.CMError):
        cm.pp_decode(b"hello")


def test_pingpong_closing_lines_match_rc_pingpong():
    assert pingpong.closing_lines(4096, 1000, 120000.0) == [
        "8192000 bytes in 0.12 seconds = 546.13 Mbit/sec",
        "1000 iters in 0.12 seconds = 120.00 usec/iter"]
    line = pingpong.address_line("local address: ", cm.PingpongDest(0, 0x11, 0xABC, cm.ip_to_gid("10.77.0.1")))
    assert line == "  local address:  LID 0x0000, QPN 0x000011, PSN 0x000abc, GID ::ffff:10.77.0.1"


# =========================================================================== MetaRoCE Connection Message (6.2)

CM1 = """
0000  4d 52 43 31 01 01 00 01 00 50 00 00 00 00 00 bf
0010  00 00 00 00 00 00 00 00 00 00 ff ff 0a 37 00 01
0020  00 00 00 11 00 00 01 00 03 10 10 0c 0e 07 07 10
0030  01 00 02 00 00 00 00 01 ff ff 1a 00 5e ed 12 34
0040  00 01 00 0c 6d 65 74 61 72 6f 63 65 2d 72 65 66
"""
CM2 = """
0000  4d 52 43 31 01 02 00 01 00 40 00 00 00 00 00 9f
0010  00 00 00 00 00 00 00 00 00 00 ff ff 0a 37 00 02
0020  00 00 00 11 00 00 0a 00 03 10 10 0c 0e 07 07 10
0030  01 00 02 00 00 00 00 02 ff ff 1a 00 5e ed 12 34
"""
CM3 = """
0000  4d 52 43 31 01 04 00 00 00 45 00 01 00 00 00 00
0010  00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00
0020  00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00
0030  00 00 00 00 00 00 00 00 00 00 00 00 5e ed 12 34
0040  00 02 00 01 01
"""
NATIVE_OFFER = dict(max_rd_atomic=16, max_dest_rd_atomic=16, min_rnr_timer=12, timeout=14, retry_cnt=7,
                    rnr_retry=7, entropy_count=16, sack_window=256)


def test_req_encodes_as_example_cm1():
    m = cm.CMMsg(cm.MsgType.REQ, cookie=0x5EED1234, capabilities=0xBF, gid=cm.ip_to_gid("10.55.0.1"), qpn=0x11,
                 psn=0x100, path_mtu=3, mac=cm.mac_bytes("02:00:00:00:00:01"),
                 tlvs=[(cm.TLV_IMPL_NAME, b"metaroce-ref")], **NATIVE_OFFER)
    assert m.encode() == hexdump(CM1)
    assert cm.CMMsg.decode(hexdump(CM1)) == m


def test_rep_agrees_caps_as_example_cm2():
    """MR-CM-014: B lacks CREDITS, so 0xbf & local -> 0x9f."""
    local = 0xFF & ~int(cm.Cap.CREDITS)
    assert cm.agree_caps(0xBF, local) == 0x9F
    assert cm.agree_caps(0xBF, int(cm.Cap.ATOMICS)) == 0x80          # no NATIVE: the native bits go
    m = cm.CMMsg(cm.MsgType.REP, cookie=0x5EED1234, capabilities=0x9F, gid=cm.ip_to_gid("10.55.0.2"), qpn=0x11,
                 psn=0xA00, path_mtu=3, mac=cm.mac_bytes("02:00:00:00:00:02"), **NATIVE_OFFER)
    assert m.encode() == hexdump(CM2)


def test_rej_unsupported_version_as_example_cm3():
    m = cm.CMMsg(cm.MsgType.REJ, cookie=0x5EED1234, reason=cm.Reason.UNSUPPORTED_VERSION,
                 tlvs=[(cm.TLV_SUPPORTED_VERSIONS, b"\x01")])
    assert m.encode() == hexdump(CM3)


@pytest.mark.parametrize("mutate,reason", [
    (lambda b: b[:8] + b"\x00\x20" + b[10:], cm.Reason.MALFORMED),                 # total_len < 64
    (lambda b: b[:4] + b"\x02" + b[5:], cm.Reason.UNSUPPORTED_VERSION),
    (lambda b: b[:32] + b"\x01\x00\x00\x11" + b[36:], cm.Reason.MALFORMED),         # qpn bits 31-24
    (lambda b: b[:40] + b"\x07" + b[41:], cm.Reason.INVALID_PARAM),                 # path_mtu 7
    (lambda b: b[:64] + b"\x00\x01\x00\x40" + b[68:], cm.Reason.MALFORMED),         # TLV past total_len
    (lambda b: b[:64] + b"\x80\x77" + b[66:], cm.Reason.UNSUPPORTED_TLV),           # unknown critical TLV
])
def test_bad_messages_get_the_right_rej_reason(mutate, reason):
    with pytest.raises(cm.Rejected) as e:
        cm.CMMsg.decode(mutate(hexdump(CM1)))
    assert e.value.reason == reason


# =========================================================================== statistics


def test_latency_statistics_follow_perftest():
    """Half of each interval between consecutive posts, sorted; typical = the median sample."""
    posted = np.cumsum([0] + [200_000] * 198 + [2_000_000]).astype(np.int64)     # ns
    s = perf.lat_stats(posted)
    assert s["min"] == 100.0 and s["typical"] == 100.0 and s["max"] == 1000.0
    assert s["p99"] == 100.0 and s["p999"] == 1000.0
    assert s["avg"] == pytest.approx((198 * 100 + 1000) / 199)


def test_bandwidth_statistics():
    done = np.arange(1, 101, dtype=np.int64) * 1_000_000          # one 1 MB message per ms
    r = perf.bw_stats(1_000_000, 100, 0.1, done, 10)
    assert r["gbps"] == pytest.approx(8.0) and r["gbps_peak"] == pytest.approx(8.0)
    assert r["msg_rate"] == pytest.approx(0.001) and r["total_bytes"] == 100_000_000


# =========================================================================== the tools in namespaces

netns = pytest.mark.netns
needs_root = pytest.mark.netns


class Proc:
    """A tool process with its stdout/stderr collected by threads (so waits are bounded)."""

    def __init__(self, topo, ns: str, argv: list[str]):
        self.p = topo.popen(ns, [*CLI, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.out: list[str] = []
        self.err: list[str] = []
        self._t = [threading.Thread(target=self._pump, args=(f, acc), daemon=True)
                   for f, acc in ((self.p.stdout, self.out), (self.p.stderr, self.err))]
        for t in self._t:
            t.start()

    @staticmethod
    def _pump(f, acc):
        for line in f:
            acc.append(line)

    def wait_for(self, pattern: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not any(re.search(pattern, line) for line in self.out + self.err):
            if self.p.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} from the server; stderr:\n{''.join(self.err)}")
            time.sleep(0.05)

    def finish(self, timeout: float = 90) -> tuple[int, str, str]:
        try:
            rc = self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            raise AssertionError(f"timed out; stdout:\n{''.join(self.out)}\nstderr:\n{''.join(self.err)}")
        for t in self._t:
            t.join(timeout=5)
        return rc, "".join(self.out), "".join(self.err)


@pytest.fixture
def hosts():
    from metaroce_xdp.topo import two_hosts
    topo, pair = two_hosts()
    try:
        yield topo, pair
    finally:
        topo.close()


def run_pair(topo, server_argv: list[str], client_argv: list[str], ready: str) -> tuple[tuple, tuple]:
    srv = Proc(topo, topo[1], server_argv)
    srv.wait_for(ready)
    cli = Proc(topo, topo[0], client_argv)
    c = cli.finish()
    s = srv.finish(30)
    return c, s


PERF_CASES = {
    "write-bw": ["-s", "65536", "-n", "200"],
    "read-bw": ["-s", "65536", "-n", "100"],
    "send-bw": ["-s", "4096", "-n", "500"],
    "write-lat": ["-s", "8", "-n", "300"],
}


@netns
@needs_root
@pytest.mark.timeout(180)
@pytest.mark.parametrize("test", list(PERF_CASES))
def test_perf(hosts, test):
    topo, _ = hosts
    args = ["perf", test, *PERF_CASES[test], "-p", "18515", "--json"]
    (crc, cout, cerr), (src, sout, serr) = run_pair(
        topo, [*args, "-d", "mr1"], [*args, "-d", "mr0", "10.77.0.2"], "Waiting for client")
    assert crc == 0, cerr
    assert src == 0, serr
    assert "Traceback" not in cerr + serr
    c, s = json.loads(cout), json.loads(sout)
    size, iters = int(PERF_CASES[test][1]), int(PERF_CASES[test][3])
    for r, role in ((c, "client"), (s, "server")):
        assert r["test"] == test and r["role"] == role
        assert r["bytes"] == size and r["iterations"] == iters and r["total_bytes"] == size * iters
        assert r["seconds"] > 0 and r["gbps"] > 0 and r["msg_rate"] > 0
        assert r["mtu"] == 1024
    assert c["plane"] == "compiled"            # the in-process data plane: the compiled one
    responder = s if test != "write-lat" else c
    if test in ("write-bw", "send-bw"):
        assert s["counters"]["bytes_received"] == size * iters        # every byte placed once
        assert c["counters"]["packets_sent"] >= iters * -(-size // 1024)
        assert s["verified"] is True and c["peer_verified"] is True   # the client's bytes, as sent
    elif test == "read-bw":
        # the compiled plane's counters are its port's (metaroce_xdp/cli/perf.py DP_COUNTERS): READ responses placed at the
        # client (+ any resent), and sent by the server
        assert c["counters"]["bytes_received"] >= size * iters
        assert s["counters"]["packets_sent"] >= iters * -(-size // 1024)
    else:
        for r in (c, s):
            lat = r["lat_us"]
            assert set(lat) == {"min", "max", "typical", "avg", "stdev", "p99", "p999"}
            assert 0 < lat["min"] <= lat["typical"] <= lat["p99"] <= lat["p999"] <= lat["max"]
            assert r["counters"]["bytes_received"] == size * iters
        assert responder["peer_lat_us"]


@netns
@needs_root
@pytest.mark.timeout(180)
def test_perf_table_output(hosts):
    """Without --json: perftest's header and one result row with the numbers of the run."""
    topo, _ = hosts
    args = ["perf", "write-bw", "-s", "16384", "-n", "100", "-p", "18516"]
    (crc, cout, cerr), (src, sout, serr) = run_pair(
        topo, [*args, "-d", "mr1"], [*args, "-d", "mr0", "10.77.0.2"], "Waiting for client")
    assert crc == 0 and src == 0, cerr + serr
    assert perf.BW_HEADER in cout and "RDMA_Write BW Test" in cout
    row = cout.split(perf.BW_HEADER + "\n", 1)[1].splitlines()[0].split()
    assert row[:2] == ["16384", "100"] and float(row[3]) > 0


@netns
@needs_root
@pytest.mark.timeout(180)
def test_pingpong(hosts):
    """Client and server on the compiled plane in process: rc_pingpong's exchange (compat RoCEv2)."""
    topo, _ = hosts
    args = ["pingpong", "-g", "1", "-s", "4096", "-n", "200", "-p", "18517"]
    (crc, cout, cerr), (src, sout, serr) = run_pair(
        topo, [*args, "-d", "mr1"],
        [*args, "-d", "mr0", "10.77.0.2"], r"local address:")
    assert crc == 0, cerr
    assert src == 0, serr
    assert "engine: in-process engine (" in cerr and "compiled plane" in cerr, cerr
    assert "compiled plane" in serr, serr
    addr = r"LID 0x0000, QPN 0x[0-9a-f]{6}, PSN 0x[0-9a-f]{6}, GID ::ffff:10\.77\.0\.%d"
    for out, me, peer in ((cout, 1, 2), (sout, 2, 1)):
        lines = out.splitlines()
        assert re.fullmatch(r"  local address:  " + addr % me, lines[0]), out
        assert re.fullmatch(r"  remote address: " + addr % peer, lines[1]), out
        assert re.fullmatch(r"1638400 bytes in \d+\.\d\d seconds = \d+\.\d\d Mbit/sec", lines[2]), out
        assert re.fullmatch(r"200 iters in \d+\.\d\d seconds = \d+\.\d\d usec/iter", lines[3]), out
    # each side's remote QPN/PSN is the other's local
    c_local = re.search(r"local address:  (LID .*?), GID", cout).group(1)
    assert re.search(r"remote address: " + re.escape(c_local), sout)


@netns
@needs_root
@pytest.mark.timeout(180)
def test_pingpong_json(hosts):
    """`-j`: one JSON summary on stdout (schema metaroce-pingpong/1), rc_pingpong's lines on stderr."""
    topo, _ = hosts
    args = ["pingpong", "-s", "1024", "-n", "50", "-p", "18519"]
    (crc, cout, cerr), (src, sout, serr) = run_pair(topo, [*args, "-d", "mr1"], [*args, "-d", "mr0", "-j", "10.77.0.2"],
                                                    r"local address:")
    assert crc == 0 and src == 0, (cerr, serr)
    doc = json.loads(cout)
    assert doc["schema"] == "metaroce-pingpong/1" and doc["iters"] == 50 and doc["bytes"] == 1024 * 50 * 2, doc
    assert doc["local"]["gid"] == "::ffff:10.77.0.1" and doc["remote"]["gid"] == "::ffff:10.77.0.2", doc
    assert doc["mbit_per_s"] > 0 and doc["usec_per_iter"] > 0 and doc["engine"] == "in-process", doc
    assert "local address:" in cerr and "iters in" in cerr, cerr
    assert re.search(rf"remote address: LID 0x0000, QPN {doc['local']['qpn']:#08x}", sout), sout


@netns
@needs_root
@pytest.mark.timeout(120)
def test_perf_server_rejects_a_req_claiming_another_address_mr_sec_019(hosts):
    """Before: the perf server moved its QP to RTR towards whatever GID the REQ claimed and answered REP, so any
    TCP client could aim it at a third host (here 10.77.0.3, a second address of host A, which answers ARP).
    Now REJ ADDRESS_MISMATCH, as client.Listener.accept and dp/cmconnect.accept_qp answer."""
    topo, pair = hosts
    topo.run(topo[0], ["ip", "addr", "add", "10.77.0.3/24", "dev", pair.a.ifname])
    srv = Proc(topo, topo[1], ["perf", "write-bw", "-d", "mr1", "-p", "18518", "--json"])
    srv.wait_for("Waiting for client")
    code = ("import sys; from metaroce_xdp import cm\n"
            "ch = cm.connect('10.77.0.2', 18518)\n"
            "req = cm.CMMsg(cm.MsgType.REQ, cookie=cm.new_cookie(), gid=cm.ip_to_gid('10.77.0.3'), qpn=0x1234,\n"
            "               psn=1, path_mtu=cm.MTU_ENUM[1024], max_dest_rd_atomic=16,\n"
            "               tlvs=[(cm.TLV_PERF_PARAMS, b'{\"test\":\"write-bw\",\"size\":4096,\"iters\":10}')])\n"
            "ch.send(req.encode())\n"
            "m = cm.read_msg(ch, 10)\n"
            "print(m.msg_type.name, m.reason.name if m.msg_type == cm.MsgType.REJ else '')\n")
    out = topo.run(topo[0], [sys.executable, "-c", code], check=False)
    assert out.stdout.split() == ["REJ", "ADDRESS_MISMATCH"], (out.stdout, out.stderr)
    rc, _, err = srv.finish(30)
    assert rc != 0 and "MR-SEC-019" in err and "Traceback" not in err, err


@netns
@needs_root
@pytest.mark.timeout(120)
def test_errors_are_one_clear_line(hosts):
    topo, _ = hosts
    rc, out, err = Proc(topo, topo[0], ["perf", "write-bw", "-d", "mr0", "-p", "18599", "10.77.0.2"]).finish()
    assert rc != 0 and "cannot connect to 10.77.0.2:18599" in err and "Traceback" not in err
    rc, out, err = Proc(topo, topo[0], ["pingpong", "-d", "mr0", "-p", "18599", "10.77.0.2"]).finish()
    assert rc != 0 and "Couldn't connect" in err and "Traceback" not in err
    rc, out, err = Proc(topo, topo[0], ["perf", "write-lat", "-d", "nosuch0", "10.77.0.2"]).finish()
    assert rc != 0 and "no interface 'nosuch0'" in err and "Traceback" not in err


@netns
@needs_root
@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("tshark") is None or shutil.which("tcpdump") is None,
                    reason="tshark and tcpdump needed")
def test_capture_of_a_perf_run_decodes_as_rocev2(tmp_path):
    """Issue 3's done-when: a capture of `metaroce perf` traffic decodes in tshark as
    RoCEv2 (InfiniBand over UDP 4791) and every ICRC verifies (MR-ICRC-011).  The
    capture is taken on the switch namespace between the hosts: frames an AF_XDP
    socket sends skip the sender's own packet taps, and the receiver's XDP program
    takes them before its taps."""
    from metaroce_xdp.topo import switched_hosts
    topo, _, _ = switched_hosts()
    pcap = tmp_path / "perf.pcap"
    try:
        cap = topo.popen(topo[1], ["tcpdump", "-q", "-U", "--immediate-mode", "-B", "131072", "-i", "sw0", "-w", str(pcap), "udp port 4791"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        # frames sent before tcpdump has attached would be missing from the capture
        assert "listening on" in cap.stderr.readline()
        # the compat profile: RoCEv2 (the default --profile auto agrees native between two compiled planes)
        args = ["perf", "write-bw", "-s", "65536", "-n", "40", "-p", "18515", "--json", "--profile", "compat"]
        srv = Proc(topo, topo[2], [*args, "-d", "mr1"])
        srv.wait_for("Waiting for client")
        cli = Proc(topo, topo[0], [*args, "-d", "mr0", "10.77.0.2"])
        (crc, _, cerr), (src, _, serr) = cli.finish(), srv.finish(30)
        assert crc == 0 and src == 0, cerr + serr
        time.sleep(0.5)
        cap.terminate()
        cap_stats = cap.stderr.read()
        cap.wait(timeout=10)
    finally:
        topo.close()
    r = subprocess.run([*CLI, "decode", "--json", str(pcap)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    names = {x["opcode_name"] for x in rows}
    assert len(rows) >= 40 * 64, cap_stats
    assert all(x["icrc_ok"] for x in rows)
    assert {"RDMA_WRITE_FIRST", "RDMA_WRITE_MIDDLE", "RDMA_WRITE_LAST", "ACKNOWLEDGE"} <= names
    t = subprocess.run(["tshark", "-r", str(pcap), "-T", "fields", "-e", "frame.protocols"],
                       capture_output=True, text=True, timeout=300)
    stacks = t.stdout.split()
    assert len(stacks) == len(rows)
    assert all(s.startswith("eth:ethertype:ip:udp:infiniband") for s in stacks)
