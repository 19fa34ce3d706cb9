"""`metaroce decode` on captures (issue 2's done-when): scapy-built RoCEv2
packets, valid and with a corrupted ICRC, plus foreign and malformed frames.
tshark is a second, independent reader of the same capture's fields."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from scapy.contrib.roce import AETH as S_AETH
from scapy.contrib.roce import BTH as S_BTH
from scapy.contrib.roce import cnp as s_cnp
from scapy.layers.inet import ICMP, IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import ARP, Ether
from scapy.packet import Raw
from scapy.utils import wrpcap

from metaroce_xdp.wire import NETH, RETH, Op, encode

ROOT = Path(__file__).resolve().parents[2]
E = dict(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")
V4 = dict(src="10.55.0.1", dst="10.55.0.2")


def metaroce(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "metaroce_xdp.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def roce(bth, *rest, v6=False):
    ip = IPv6(src="fd00:55::1", dst="fd00:55::2") if v6 else IP(**V4)
    p = Ether(**E) / ip / UDP(sport=49152, dport=4791, chksum=0 if not v6 else None) / bth
    for r in rest:
        p = p / r
    return p


def reth(va, rkey, n):
    return Raw(va.to_bytes(8, "big") + rkey.to_bytes(4, "big") + n.to_bytes(4, "big"))


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    pkts = [
        # 1 WRITE ONLY with RETH, 8-byte payload
        roce(S_BTH(opcode=0x0A, dqpn=0x11, psn=0x100, ackreq=1), reth(0x7F0000001000, 0xA5A50102, 8), Raw(b"ABCDEFGH")),
        # 2 ACK
        roce(S_BTH(opcode=0x11, dqpn=0x22, psn=0x100), S_AETH(syndrome=0x1F, msn=7)),
        # 3 NAK: PSN sequence error
        roce(S_BTH(opcode=0x11, dqpn=0x22, psn=0x101), S_AETH(syndrome=0x60, msn=7)),
        # 4 SEND ONLY, 5 bytes (pad 3), IPv6
        roce(S_BTH(opcode=0x04, dqpn=0x11, psn=0x102, padcount=3, solicited=1), Raw(b"hello\0\0\0"), v6=True),
        # 5 CNP
        roce(s_cnp(0x11)),
        # 6 SEND ONLY with a corrupted ICRC
        roce(S_BTH(opcode=0x04, dqpn=0x11, psn=0x103, icrc=0xDEADBEEF), Raw(b"abcd")),
        # 7 not MetaRoCE: ARP, 8 ICMP, 9 DNS
        Ether(**E) / ARP(),
        Ether(**E) / IP(**V4) / ICMP(),
        Ether(**E) / IP(**V4) / UDP(sport=5353, dport=53) / Raw(b"x" * 12),
        # 10 truncated MetaRoCE (BTH cut short)
        Ether(**E) / IP(**V4) / UDP(sport=49152, dport=4791) / Raw(b"\x0a\x00\xff"),
    ]
    path = tmp_path_factory.mktemp("pcap") / "scapy_roce.pcap"
    wrpcap(str(path), pkts)
    # and a native-profile packet from our own encoder
    native = encode(Op.NATIVE_WRITE, dest_qp=0x11, psn=0x104,
                    headers={"reth": RETH(va=0x1000, rkey=9, dma_len=4096),
                             "neth": NETH(flags=0x40, msn=3, offset=4092, msg_len=4096, tsval=77)},
                    payload=b"tail")
    path2 = tmp_path_factory.mktemp("pcap") / "native.pcap"
    wrpcap(str(path2), [Ether(native)])
    return path, path2


def test_decode_json_fields_and_icrc(capture):
    r = metaroce("decode", "--json", str(capture[0]))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    by = {row["frame"]: row for row in rows}
    assert sorted(by) == [1, 2, 3, 4, 5, 6, 10]          # ARP/ICMP/DNS skipped
    w = by[1]
    assert (w["opcode"], w["opcode_name"], w["dest_qp"], w["psn"], w["ack_req"], w["icrc_ok"],
            w["payload_len"]) == (10, "RDMA_WRITE_ONLY", 0x11, 0x100, 1, True, 8)
    assert w["reth"] == {"va": 0x7F0000001000, "rkey": 0xA5A50102, "dma_len": 8}
    assert by[2]["aeth"]["syndrome"] == 0x1F and by[2]["aeth"]["msn"] == 7 and by[2]["aeth"]["kind"] == "ack"
    assert by[3]["aeth"]["kind"] == "nak" and by[3]["aeth"]["value"] == 0
    assert by[4]["ip"]["version"] == 6 and by[4]["payload_len"] == 5 and by[4]["pad"] == 3 and by[4]["se"] == 1
    assert by[4]["icrc_ok"] is True
    assert by[5]["opcode"] == 0x81 and by[5]["becn"] == 1 and by[5]["icrc_ok"] is True
    assert by[6]["icrc_ok"] is False and by[6]["opcode_name"] == "SEND_ONLY"
    assert by[10]["error"] == "malformed" and by[10]["reason"] == "truncated_bth"
    assert all(row["icrc_ok"] for f, row in by.items() if f not in (6, 10))


def test_decode_readable_and_summary(capture):
    r = metaroce("decode", str(capture[0]))
    assert r.returncode == 0
    assert "RDMA_WRITE_ONLY" in r.stdout and "RETH va=0x7f0000001000" in r.stdout
    assert "ICRC BAD" in r.stdout and "MALFORMED" in r.stdout
    assert "10 frames: 6 MetaRoCE (1 with bad ICRC), 1 malformed, 3 not MetaRoCE" in r.stderr
    assert metaroce("decode", "--strict", str(capture[0])).returncode == 1


def test_decode_native(capture):
    r = metaroce("decode", "--json", str(capture[1]))
    row = json.loads(r.stdout)
    assert row["opcode_name"] == "NATIVE_WRITE" and row["profile"] == "native"
    assert row["neth"]["offset"] == 4092 and row["neth"]["last"] is True and row["icrc_ok"]


def test_decode_hex_and_bad_input(tmp_path):
    frame = encode(Op.ACKNOWLEDGE, dest_qp=5, psn=9, headers={"aeth": __import__("metaroce_xdp.wire", fromlist=["AETH"]).AETH(msn=1)})
    spaced = " ".join(f"{b:02x}" for b in frame)
    r = metaroce("decode", "--json", "--hex", spaced)
    assert json.loads(r.stdout)["psn"] == 9
    assert metaroce("decode", "--hex", "zz").returncode == 2
    assert metaroce("decode", str(tmp_path / "missing.pcap")).returncode == 2
    junk = tmp_path / "junk.pcap"
    junk.write_bytes(b"this is not a capture file at all")
    r = metaroce("decode", str(junk))
    assert r.returncode == 2 and "error:" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(shutil.which("tshark") is None, reason="tshark not installed")
def test_tshark_reads_our_frames_the_same(tmp_path):
    """A second independent reader: Wireshark's InfiniBand dissector sees the same fields."""
    frames = [
        encode(Op.RDMA_WRITE_FIRST, dest_qp=0x123456, psn=0xABCDEF, ack_req=0,
               headers={"reth": RETH(va=0x1122334455667788, rkey=0x99AABBCC, dma_len=65536)}, payload=b"z" * 1024),
        encode(Op.RDMA_READ_REQUEST, dest_qp=0x11, psn=1, ack_req=1,
               headers={"reth": RETH(va=0x1000, rkey=0x42, dma_len=300)}),
        encode(Op.SEND_ONLY_WITH_IMMEDIATE, dest_qp=0x11, psn=2, headers={"immdt": __import__(
            "metaroce_xdp.wire", fromlist=["ImmDt"]).ImmDt(imm=0xCAFEBABE)}, payload=b"hi", src_ip="fd00::1", dst_ip="fd00::2"),
    ]
    p = tmp_path / "ours.pcap"
    wrpcap(str(p), [Ether(f) for f in frames])
    r = subprocess.run(["tshark", "-r", str(p), "-T", "fields", "-E", "separator=,",
                        "-e", "infiniband.bth.opcode", "-e", "infiniband.bth.destqp", "-e", "infiniband.bth.psn",
                        "-e", "infiniband.bth.a", "-e", "infiniband.reth.va", "-e", "infiniband.reth.dmalen"],
                       capture_output=True, text=True, timeout=120)
    rows = [line.split(",") for line in r.stdout.strip().splitlines()]
    assert [int(x[0]) for x in rows] == [6, 12, 5]
    assert int(rows[0][1], 0) == 0x123456 and int(rows[0][2]) == 0xABCDEF
    assert int(rows[0][4], 0) == 0x1122334455667788 and int(rows[0][5]) == 65536
    assert rows[1][3] in ("1", "True")
