"""Round trips and malformed input for the codec (MR-BTH-001, MR-XH, MR-OPC-001).

Every header encodes and decodes back to itself; every packet of both
profiles decodes back to the arguments that built it and re-encodes to the
same bytes; and any byte string either decodes or raises MalformedPacket --
never another exception (the fuzz property).
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metaroce_xdp.wire import (BTH, OPCODES, DecodeReason, EncodeError, MalformedPacket, NotMetaRoCE,
                               Op, OpMask, RETH, decode, encode, encode_packet)
from metaroce_xdp.wire.fields import Header
from metaroce_xdp.wire.headers import (AETH, NETH, SACKETH, EXT_CLASSES, Ethernet, IPv4, IPv6,
                                       UDP, Vlan)
from metaroce_xdp.wire.psn import psn_add, psn_diff, psn_in_window, psn_le, psn_lt
from strategies import ALL_OPCODES, packet_args

ALL_HEADERS = [BTH, Ethernet, Vlan, IPv4, IPv6, UDP, *EXT_CLASSES.values()]


@pytest.mark.parametrize("cls", ALL_HEADERS, ids=lambda c: c.NAME)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_header_roundtrip(cls: type[Header], data):
    vals = {n: data.draw(st.integers(0, (1 << b) - 1), label=n) for n, b in cls.FIELDS}
    h = cls(**vals)
    raw = h.pack()
    assert len(raw) == cls.SIZE
    assert cls.unpack(raw) == h
    assert cls.unpack(b"\xAA" + raw, 1).as_dict() == vals


def test_header_sizes_match_spec():
    """MR-BTH-001, MR-XH-001, MR-XH-006, MR-XH-010, MR-XH-013, MR-XH-014, MR-XH-015, MR-XH-016, MR-XH-017,
    MR-XH-026, MR-XH-037: every header has the size the spec gives; MR-XH-039: the recv-consuming native
    opcodes, and only they, carry the RSNETH, so their fixed headers are 32, 36 and 52 bytes."""
    sizes = {"BTH": 12, "RETH": 16, "AETH": 4, "AtomicETH": 28, "AtomicAckETH": 8, "ImmDt": 4,
             "IETH": 4, "CNP": 16, "NETH": 16, "SACKETH": 12, "RSNETH": 4}
    for cls in ALL_HEADERS:
        if cls.NAME in sizes:
            assert cls.SIZE == sizes[cls.NAME], cls.NAME
    with_rsn = {o.name: o.hdr_len for o in OPCODES.values() if "rsneth" in o.headers}
    assert with_rsn == {"NATIVE_SEND": 32, "NATIVE_SEND_IMM": 36, "NATIVE_WRITE_IMM": 52}


def test_field_out_of_range_is_a_typed_error():
    with pytest.raises(EncodeError, match="psn"):
        BTH(psn=1 << 24)
    with pytest.raises(EncodeError, match="unknown field"):
        RETH(vaddr=1)
    with pytest.raises(EncodeError, match="takes headers"):
        encode(Op.RDMA_WRITE_ONLY, payload=b"x")
    with pytest.raises(EncodeError, match="no payload"):
        encode(Op.ACKNOWLEDGE, headers={"aeth": AETH()}, payload=b"x")
    with pytest.raises(EncodeError, match="unknown opcode"):
        encode(0x55)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packet_args())
def test_packet_roundtrip_all_profiles(case):
    opcode, kw = case
    frame = encode(opcode, **kw)
    pkt = decode(frame)
    assert pkt.icrc_ok
    assert pkt.bth.opcode == opcode and pkt.bth.psn == kw["psn"] and pkt.bth.dest_qp == kw["dest_qp"]
    assert pkt.payload == kw["payload"]
    assert pkt.bth.pad == (-len(kw["payload"])) & 3
    for name, h in kw["headers"].items():
        assert pkt.ext[name] == h
    assert pkt.sack_bitmap == tuple(kw["sack_bitmap"])
    assert encode_packet(pkt) == frame
    assert encode_packet(pkt, recompute=False) == frame
    d = pkt.to_dict()
    assert d["opcode"] == opcode and d["opcode_name"] == OPCODES[opcode].name
    assert d["payload_len"] == len(kw["payload"]) and d["icrc_ok"] is True


def test_sack_bitmap_semantics():
    """MR-XH-028, MR-XH-029: bit i of the bitmap <-> PSN (BTH.PSN + 2 + i); BTH.PSN is cumulative,
    BTH.PSN + 1 the first missing PSN, which no bit stands for."""
    bitmap = (0xC0000000, 0x00000001)          # bits 0, 1 and 63
    f = encode(Op.NATIVE_SACK, psn=0xFFFFFE, headers={"aeth": AETH(syndrome=0x1F, msn=3),
               "sacketh": SACKETH(tsecr=99, bitmap_words=2)}, sack_bitmap=bitmap)
    pkt = decode(f)
    assert pkt.sack_received_psns() == [0x000000, 0x000001, (0xFFFFFE + 65) & 0xFFFFFF]


def test_truncations_raise_typed_errors():
    frame = encode(Op.RDMA_WRITE_FIRST, dest_qp=1, psn=2, headers={"reth": RETH(va=1, rkey=2, dma_len=3)},
                   payload=b"x" * 64)
    for cut in range(len(frame)):
        with pytest.raises(MalformedPacket):
            decode(frame[:cut])


def test_reason_codes():
    ok = encode(Op.SEND_ONLY, payload=b"abcd")
    cases = {
        DecodeReason.NOT_IP: ok[:12] + b"\x08\x06" + ok[14:],
        DecodeReason.NOT_ROCE_PORT: ok[:36] + b"\x00\x35" + ok[38:],
        DecodeReason.BAD_TVER: ok[:43] + bytes([ok[43] | 1]) + ok[44:],
        DecodeReason.UNKNOWN_OPCODE: ok[:42] + b"\x55" + ok[43:],
        DecodeReason.BAD_UDP_LENGTH: ok[:38] + b"\x00\x09" + ok[40:],
        DecodeReason.IP_FRAGMENT: ok[:20] + b"\x20\x00" + ok[22:],
    }
    for reason, frame in cases.items():
        with pytest.raises(MalformedPacket) as ei:
            decode(frame)
        assert ei.value.reason == reason, reason.name
    with pytest.raises(NotMetaRoCE):
        decode(cases[DecodeReason.NOT_IP])
    # IPv4 with options (IHL 6) is MetaRoCE-shaped but forbidden (MR-ENC-009)
    opt = bytearray(ok[:14] + bytes([0x46]) + ok[15:34] + b"\x01\x01\x01\x01" + ok[34:])
    opt[16:18] = (int.from_bytes(opt[16:18], "big") + 4).to_bytes(2, "big")
    with pytest.raises(MalformedPacket) as ei:
        decode(bytes(opt))
    assert ei.value.reason == DecodeReason.IP_OPTIONS
    # payload on an opcode that carries none
    ack = bytearray(encode(Op.ACKNOWLEDGE, headers={"aeth": AETH()}))
    ack = ack[:-4] + b"\0\0\0\0" + ack[-4:]
    ack[16:18] = (int.from_bytes(ack[16:18], "big") + 4).to_bytes(2, "big")
    ack[38:40] = (int.from_bytes(ack[38:40], "big") + 4).to_bytes(2, "big")
    with pytest.raises(MalformedPacket) as ei:
        decode(bytes(ack))
    assert ei.value.reason == DecodeReason.BAD_PAD


def test_ethernet_padding_is_ignored():
    """Short frames padded to 60 bytes by the link still decode: IP length rules (MR-ENC-007)."""
    f = encode(Op.ACKNOWLEDGE, headers={"aeth": AETH()})
    assert decode(f + b"\0" * 8).icrc_ok


@settings(max_examples=1500, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_any_bytes(data):
    try:
        pkt = decode(data)
    except MalformedPacket:
        return
    pkt.to_dict()


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packet_args(), st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), min_size=1, max_size=6),
       st.integers(0, 420))
def test_fuzz_mutated_frames(case, flips, cut):
    """Mutations of valid frames reach the deep paths of the decoder."""
    frame = bytearray(encode(case[0], **case[1]))
    for pos, val in flips:
        if pos < len(frame):
            frame[pos] = val
    frame = bytes(frame[:max(cut, len(frame) // 2)])
    try:
        pkt = decode(frame)
    except MalformedPacket:
        return
    pkt.to_dict()


@pytest.mark.compiles                   # psn_diff is compiled (wire/psn.py): called here with Python ints
def test_psn_arithmetic():
    """MR-BTH-020: PSN order modulo 2^24."""
    assert psn_add(0xFFFFFF, 1) == 0
    assert psn_diff(0, 0xFFFFFF) == 1 and psn_diff(0xFFFFFF, 0) == -1
    assert psn_lt(0xFFFFFF, 0) and not psn_lt(0, 0xFFFFFF)
    assert psn_le(5, 5) and not psn_lt(5, 5)
    assert psn_in_window(2, 0xFFFFFE, 8) and not psn_in_window(0xFFFFFD, 0xFFFFFE, 8)
    rnd = random.Random(7)
    for _ in range(2000):
        a, n = rnd.randrange(1 << 24), rnd.randrange(1, 1 << 23)
        b = psn_add(a, n)
        assert psn_lt(a, b) and not psn_lt(b, a) and psn_diff(b, a) == n


def test_opcode_table_is_consistent():
    """MR-OPC-001: header lengths follow from the opcode table."""
    for code, op in OPCODES.items():
        assert op.hdr_len == 12 + sum(EXT_CLASSES[h].SIZE for h in op.headers)
        assert bool(op.mask & OpMask.REQ) != bool(op.mask & OpMask.ACK) or op.has(OpMask.CONTROL)
        if 0xC0 <= code <= 0xFF:
            assert op.has(OpMask.NATIVE)
        else:
            assert not op.has(OpMask.NATIVE)
