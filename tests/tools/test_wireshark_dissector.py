"""The shipped Wireshark dissector for the native profile (tools/wireshark/metaroce.lua) read by tshark.

* A real capture: a native transfer between hosts A and B through the switch namespace (compiled data plane,
  XDP and AF_XDP on both hosts), every native opcode (SEND, SEND with immediate, WRITE, WRITE with immediate,
  READ request and responses, SACK) and an atomic (compat opcodes on a native QP), with two request PSNs
  dropped once by the seeded fault injector so that SACKs carry bitmaps and retransmissions carry RETX; then
  a compat transfer on fresh QPs.  An AF_PACKET tap on the switch port towards A holds every frame both ways
  (before the drop); the test writes them to a pcap and runs tshark with the dissector.  Every native frame's
  BTH, RETH, AETH, NETH, RSNETH, ImmDt and SACKETH fields, the bitmap words, the PSNs the bitmap reports and
  the ICRC verdict as tshark prints them equal what the project's codec (metaroce_xdp.wire.decode) reads
  from the same bytes; every compat frame is still decoded by Wireshark's InfiniBand dissector
  (infiniband.bth.*) and has no metaroce.* field.
* Frames built by the codec: IPv6, a bitmap crossing PSN 2^24, reserved bits set, a corrupted ICRC, the
  N flag, a NAK-type SACK, a reserved native opcode and a truncated packet: decoded (or flagged) as the spec
  says.
"""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from dp_players import collect, connected
from metaroce_xdp.verbs_types import RecvWR, SendWR, WCStatus, WROpcode
from metaroce_xdp.wire import AETH, NETH, RETH, RSNETH, SACKETH, AtomicETH, ImmDt, Op, decode, encode
from wire_players import PortTap, is_roce_v4

pytestmark = [pytest.mark.fabric(prefix="mrwsh"),
              pytest.mark.skipif(shutil.which("tshark") is None, reason="tshark not installed")]

LUA = Path(__file__).resolve().parents[2] / "tools" / "wireshark" / "metaroce.lua"
MASK = 0xFFFFFF
PMTU = 1024
NATIVE = range(0xC0, 0xC7)

# tshark -T fields columns: (name, what the codec's RocePacket says, or None: checked by the test itself)
BTH_F = [("metaroce.bth.opcode", lambda p: p.bth.opcode), ("metaroce.bth.destqp", lambda p: p.bth.dest_qp),
         ("metaroce.bth.psn", lambda p: p.bth.psn), ("metaroce.bth.pkey", lambda p: p.bth.pkey),
         ("metaroce.bth.padcnt", lambda p: p.bth.pad), ("metaroce.bth.tver", lambda p: p.bth.tver),
         ("metaroce.bth.se", lambda p: p.bth.se), ("metaroce.bth.ackreq", lambda p: p.bth.ack_req)]
EXT_F = {
    "reth": [("metaroce.reth.va", "va"), ("metaroce.reth.rkey", "rkey"), ("metaroce.reth.dmalen", "dma_len")],
    "aeth": [("metaroce.aeth.syndrome", "syndrome"), ("metaroce.aeth.msn", "msn")],
    "neth": [("metaroce.neth.flags", "flags"), ("metaroce.neth.msn", "msn"), ("metaroce.neth.offset", "offset"),
             ("metaroce.neth.msglen", "msg_len"), ("metaroce.neth.tsval", "tsval")],
    "rsneth": [("metaroce.rsneth.rsn", "rsn")],
    "immdt": [("metaroce.immdt", "imm")],
    "sacketh": [("metaroce.sacketh.tsecr", "tsecr"), ("metaroce.sacketh.credit", "credit"),
                ("metaroce.sacketh.cecount", "ce_count"), ("metaroce.sacketh.echosport", "echo_sport"),
                ("metaroce.sacketh.bitmapwords", "bitmap_words"), ("metaroce.sacketh.flags", "flags")],
}
FLAG_F = ["metaroce.neth.first", "metaroce.neth.last", "metaroce.neth.retx", "metaroce.sacketh.flags.ce",
          "metaroce.sacketh.flags.nots"]
MORE_F = ["metaroce.sacketh.bitmap.word", "metaroce.sacketh.sacked_psn", "metaroce.sacketh.cumpsn",
          "metaroce.icrc", "metaroce.icrc.status", "infiniband.bth.opcode", "infiniband.bth.destqp",
          "infiniband.bth.psn", "_ws.col.Protocol", "_ws.col.Info", "_ws.expert.message"]
COLUMNS = ["frame.number"] + [n for n, _ in BTH_F] + [n for v in EXT_F.values() for n, _ in v] + FLAG_F + MORE_F


def write_pcap(path: Path, frames: list[bytes], t0: float) -> None:
    """Classic pcap, Ethernet, microsecond stamps: frame i at t0 + i us (the tap keeps the order, not times)."""
    from scapy.utils import RawPcapWriter
    w = RawPcapWriter(str(path), linktype=1, sync=False)
    try:
        w._write_header(None)
        for i, f in enumerate(frames):
            us = int(t0 * 1e6) + i
            w.write_packet(f, sec=us // 1_000_000, usec=us % 1_000_000)
    finally:
        w.close()


def tshark_rows(pcap: Path) -> list[dict]:
    """One dict per frame: field name -> list of values (several occurrences: several values)."""
    cmd = ["tshark", "-n", "-X", f"lua_script:{LUA}", "-r", str(pcap), "-T", "fields",
           "-E", "separator=/t", "-E", "aggregator=|", "-E", "occurrence=a"]
    for c in COLUMNS:
        cmd += ["-e", c]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Lua" not in r.stderr and "rror" not in r.stderr, r.stderr
    rows = []
    for line in r.stdout.splitlines():
        vals = line.split("\t")
        assert len(vals) == len(COLUMNS), line
        rows.append({c: (v.split("|") if v else []) for c, v in zip(COLUMNS, vals)})
    return rows


def num(v: str) -> int:
    """A value as tshark prints it: decimal, 0x-hex, or a boolean."""
    return {"True": 1, "False": 0}[v] if v in ("True", "False") else int(v, 0)


def one(row: dict, name: str) -> int | None:
    vals = row[name]
    assert len(vals) <= 1, (name, vals)
    return num(vals[0]) if vals else None


def check_native(row: dict, p) -> None:
    """Every metaroce.* field tshark printed for a native frame equals the codec's reading of its bytes."""
    where = (row["frame.number"], hex(p.bth.opcode), p.bth.psn)
    assert not row["infiniband.bth.opcode"], where
    assert row["_ws.col.Protocol"] == ["MetaRoCE"], where
    for name, get in BTH_F:
        assert one(row, name) == get(p), (where, name)
    for hdr, fields in EXT_F.items():
        h = p.ext.get(hdr)
        for name, attr in fields:
            assert one(row, name) == (None if h is None else getattr(h, attr)), (where, name)
    if p.neth is not None:
        got = [one(row, f"metaroce.neth.{f}") for f in ("first", "last", "retx")]
        assert got == [int(bool(p.neth.flags & m)) for m in (0x80, 0x40, 0x20)], where
    if p.sacketh is not None:
        assert [num(v) for v in row["metaroce.sacketh.bitmap.word"]] == list(p.sack_bitmap), where
        assert [num(v) for v in row["metaroce.sacketh.sacked_psn"]] == p.sack_received_psns(), where
        ack = p.aeth.syndrome & 0x60 == 0
        assert one(row, "metaroce.sacketh.cumpsn") == (p.bth.psn if ack else None), where
        assert [one(row, "metaroce.sacketh.flags.ce"), one(row, "metaroce.sacketh.flags.nots")] == \
            [int(bool(p.sacketh.flags & 0x80)), int(bool(p.sacketh.flags & 0x40))], where
    assert one(row, "metaroce.icrc") == p.icrc, where
    assert one(row, "metaroce.icrc.status") == (1 if p.icrc_ok else 2), where


def check_compat(row: dict, p) -> None:
    """A compat frame goes to Wireshark's InfiniBand dissector, which reads its BTH as the codec does."""
    where = (row["frame.number"], hex(p.bth.opcode), p.bth.psn)
    assert one(row, "infiniband.bth.opcode") == p.bth.opcode, where
    assert one(row, "infiniband.bth.destqp") == p.bth.dest_qp, where
    assert one(row, "infiniband.bth.psn") == p.bth.psn, where
    assert not any(row[c] for c in COLUMNS if c.startswith("metaroce.")), where
    assert row["_ws.col.Protocol"] != ["MetaRoCE"], where


# ============================================================================ a captured transfer
PSN0 = 0xFFFFF8                       # the transfer crosses 2^24 (bitmaps included)
# (kind, bytes), PSNs from PSN0: WRITE 0-4, SEND 5-7, WRITE_IMM 8-9, SEND_IMM 10, READ 11 (responses 11-14),
# FETCH_ADD 15, one-byte WRITE 16
BATCH = (("write", 5000), ("send", 3000), ("write_imm", 2000), ("send_imm", 100), ("read", 4096), ("faa", 8),
         ("write", 1))
DROPS = [(PSN0 + d) & MASK for d in (1, 6)]       # a middle WRITE packet and a SEND packet (RSNETH), once


def _wrs(a, b, batch, src, dst):
    wrs = []
    for i, (kind, n) in enumerate(batch):
        if kind in ("write", "write_imm"):
            op = WROpcode.RDMA_WRITE if kind == "write" else WROpcode.RDMA_WRITE_WITH_IMM
            wrs.append(SendWR(wr_id=i, opcode=op, sg_list=[a.sge(src, n)], remote_addr=b.mr.addr + dst,
                              rkey=b.mr.rkey, imm_data=0x5EED0000 + i))
        elif kind in ("send", "send_imm"):
            op = WROpcode.SEND if kind == "send" else WROpcode.SEND_WITH_IMM
            wrs.append(SendWR(wr_id=i, opcode=op, sg_list=[a.sge(src, n)], imm_data=0xABC00 + i))
        elif kind == "read":
            wrs.append(SendWR(wr_id=i, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(dst, n)],
                              remote_addr=b.mr.addr + src, rkey=b.mr.rkey))
        else:
            cell = (dst + 7) & ~7
            wrs.append(SendWR(wr_id=i, opcode=WROpcode.ATOMIC_FETCH_AND_ADD, sg_list=[a.sge(cell, 8)],
                              remote_addr=b.mr.addr + cell, rkey=b.mr.rkey, compare_add=3))
        src += n + 64
        dst += n + 64
    return wrs


def _transfer(a, b, wrs, recvs, timeout=30):
    b.qp.post_recv([RecvWR(wr_id=900 + i, sg_list=[b.sge(3_500_000 + i * 8192, 8192)]) for i in range(recvs)])
    a.qp.post_send(wrs)
    got = collect(a, len(wrs), [b], timeout=timeout)
    assert [(w.wr_id, w.status) for w in got] == [(w.wr_id, WCStatus.SUCCESS) for w in wrs]
    got = collect(b, recvs, [a], timeout=5)
    assert [w.status for w in got] == [WCStatus.SUCCESS] * recvs


@pytest.mark.netns
def test_tshark_decodes_a_captured_native_transfer_with_sacks(fabric, tmp_path):
    """A native transfer with two requests dropped once, then a compat one, captured on the switch: tshark with
    tools/wireshark/metaroce.lua decodes every native frame (all seven native opcodes, SACKs with bitmaps,
    retransmissions with RETX) field for field as the codec does, with a correct ICRC; the atomic of the
    native QP and the compat QP's frames still decode as InfiniBand."""
    topo, a, b = fabric
    tap = PortTap(topo, topo[1], "swA")
    t0 = time.time()
    try:
        connected(a, b, seeds=(3, 4), mtu=PMTU, sq_psn=PSN0, rq_psn=PSN0, min_rnr_timer=None, profile="native",
                  native_params={"reo_floor": 5000, "rto_min": 20000})
        with fabric.impair("b", psn_drop_once=DROPS) as fb:
            _transfer(a, b, _wrs(a, b, BATCH, 0, 1_000_000), recvs=3)
            time.sleep(0.05)                                 # the last frames cross the bridge
            assert fb.stats()["psn_dropped"] == len(DROPS)
        connected(a, b, seeds=(5, 6), mtu=PMTU, sq_psn=0x200, rq_psn=0x200)
        _transfer(a, b, _wrs(a, b, (("write", 3000), ("send", 1500)), 0, 1_000_000), recvs=1)
        time.sleep(0.05)
        frames = tap.frames(is_roce_v4)
    finally:
        tap.close()
    pcap = tmp_path / "native.pcap"
    write_pcap(pcap, frames, t0)
    rows = tshark_rows(pcap)
    assert len(rows) == len(frames)

    native, compat, sack_words, retx = set(), set(), [], 0
    for row, raw in zip(rows, frames):
        p = decode(raw)
        assert p.icrc_ok, hex(p.bth.opcode)
        if p.bth.opcode in NATIVE:
            check_native(row, p)
            native.add(p.bth.opcode)
            if p.bth.opcode == Op.NATIVE_SACK:
                sack_words.append(p.sacketh.bitmap_words)
            elif p.neth.flags & 0x20:
                retx += 1
        else:
            check_compat(row, p)
            compat.add(p.bth.opcode)
    assert native == set(NATIVE), sorted(map(hex, native))
    # the atomic of the native QP and its acknowledgement; the compat QP's WRITE, SEND and ACKs
    assert {Op.FETCH_ADD, Op.ATOMIC_ACKNOWLEDGE, Op.RDMA_WRITE_FIRST, Op.RDMA_WRITE_LAST, Op.SEND_FIRST,
            Op.SEND_LAST, Op.ACKNOWLEDGE} <= compat, sorted(map(hex, compat))
    assert max(sack_words) >= 1 and 0 in sack_words, sack_words      # SACKs with and without a bitmap
    assert retx >= len(DROPS)


# ============================================================================ frames built by the codec
def _frames() -> list[bytes]:
    n = lambda **kw: NETH(**{"flags": 0xC0, "msn": 1, "offset": 0, "msg_len": 4, "tsval": 77, **kw})  # noqa: E731
    v6 = dict(src_ip="fd00::1", dst_ip="fd00::2")
    good = [
        encode(Op.NATIVE_SEND, dest_qp=0x11, psn=5, ack_req=1, headers={"neth": n(), "rsneth": RSNETH(rsn=9)},
               payload=b"abcd"),
        encode(Op.NATIVE_WRITE_IMM, dest_qp=0x12, psn=6, se=1, headers={
            "reth": RETH(va=0x1122334455667788, rkey=0xABCD, dma_len=3), "neth": n(flags=0xE0, offset=0, msg_len=3),
            "rsneth": RSNETH(rsn=0xFFFFFF), "immdt": ImmDt(imm=0xCAFEBABE)}, payload=b"xyz", **v6),
        encode(Op.NATIVE_READ_RESP, dest_qp=0x13, psn=7, headers={"neth": n(flags=0x5F, msg_len=1)}, payload=b"q"),
        # a bitmap crossing 2^24, C set, CE count, credits
        encode(Op.NATIVE_SACK, dest_qp=0x14, psn=0xFFFFFD, headers={
            "aeth": AETH(syndrome=0x1F, msn=0xFFFFFF), "sacketh": SACKETH(tsecr=0xFFFFFFFF, credit=16, ce_count=3,
                                                                        echo_sport=0xC123, bitmap_words=3, flags=0x80)},
               sack_bitmap=(0xC0000001, 0, 0x00000003), **v6),
        # a NAK-type SACK, N set (no TSval), reserved flag bits set
        encode(Op.NATIVE_SACK, dest_qp=0x15, psn=8, headers={
            "aeth": AETH(syndrome=0x61, msn=2), "sacketh": SACKETH(tsecr=0, bitmap_words=0, flags=0x41)}),
        encode(Op.COMPARE_SWAP, dest_qp=0x16, psn=9, headers={
            "atomiceth": AtomicETH(va=0x1000, rkey=7, swap_add=1, compare=2)}),
    ]
    bad = bytearray(good[0])
    bad[-6] ^= 0x01                                  # a payload bit: the ICRC no longer matches
    return good + [bytes(bad)]


def test_tshark_decodes_codec_built_native_frames(tmp_path):
    """IPv6 and IPv4 native frames, a SACK bitmap crossing PSN 2^24, a NAK-type SACK with the N flag and
    reserved bits, reserved NETH bits, RSN 2^24 - 1: tshark's fields equal the codec's; a frame with a flipped
    payload bit has ICRC status Bad and the expert message says so; a reserved native opcode (0xC7) and a
    truncated NATIVE_SACK are flagged, not decoded as something else; the atomic decodes as InfiniBand."""
    frames = _frames()
    reserved = bytearray(frames[0])
    reserved[42] = 0xC7                              # BTH opcode byte after Ethernet, IPv4, UDP
    # BTH, AETH, half a SACKETH and four bytes of ICRC, the IPv4 and UDP lengths made to agree
    short = bytearray(frames[4][:42 + 12 + 4 + 6] + frames[4][-4:])
    short[16:18] = (len(short) - 14).to_bytes(2, "big")
    short[38:40] = (len(short) - 34).to_bytes(2, "big")
    pcap = tmp_path / "built.pcap"
    write_pcap(pcap, frames + [bytes(reserved), short], time.time())
    rows = tshark_rows(pcap)
    assert len(rows) == len(frames) + 2
    for row, raw in zip(rows, frames):
        p = decode(raw)
        if p.bth.opcode in NATIVE:
            check_native(row, p)
        else:
            check_compat(row, p)
    sack = rows[3]
    assert [num(v) for v in sack["metaroce.sacketh.sacked_psn"]] == [0xFFFFFF, 0, 30, 93, 94]
    assert "Reserved bits set" in rows[2]["_ws.expert.message"]        # NETH flags 0x5F, F clear at offset 0
    assert any("FIRST/LAST contradict" in m for m in rows[2]["_ws.expert.message"])
    assert not any("FIRST/LAST" in m for r in rows[:2] + rows[3:] for m in r["_ws.expert.message"])
    assert "Reserved bits set" in rows[4]["_ws.expert.message"]        # SACKETH flags 0x41
    assert one(rows[6], "metaroce.icrc.status") == 2 and "Bad ICRC" in rows[6]["_ws.expert.message"]
    assert one(rows[7], "metaroce.bth.opcode") == 0xC7 and not rows[7]["metaroce.neth.msn"]
    assert any("Reserved native opcode" in m for m in rows[7]["_ws.expert.message"])
    assert one(rows[8], "metaroce.bth.opcode") == Op.NATIVE_SACK and not rows[8]["metaroce.sacketh.tsecr"]
    assert any("shorter" in m for m in rows[8]["_ws.expert.message"])
