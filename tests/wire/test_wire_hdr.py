"""wire/hdr.py: the compiled header accessors and writers, the opcode table as an array, parse_frame.

Every accessor is checked against frames built by scapy (the conformance suite's builder and layers,
metaroce_xdp/conformance/packets.py, plus NETH, RSNETH and SACKETH declared here from 02-headers.md)
and by the reference encoder (wire/packet.py), for every opcode, with hypothesis drawing the field
values.  parse_frame is checked against the reference decoder on damaged frames (same verdict, same
DecodeReason) and, run as plain Python over a buffer that refuses out-of-range reads, never reads
outside buf[a:a+ln).  Each test runs compiled and as plain Python (`pure`: every function of hdr
replaced by its .py_func, so the callees run uncompiled too).
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numba.core.registry import CPUDispatcher
from scapy.fields import BitField, ByteField, ShortField, X3BytesField, XIntField
from scapy.packet import Packet

from metaroce_xdp.conformance import packets as cp
from metaroce_xdp.wire import OPCODES, MalformedPacket, OpMask, decode, encode, hdr
from metaroce_xdp.wire.fastpath import TABLES, icrc_ok_at
from metaroce_xdp.wire.headers import (AETH, BTH, EXT_CLASSES, IETH, NETH, RETH, RSNETH, SACKETH, AtomicAckETH,
                                       AtomicETH, CNPPad, ImmDt, IPv4, IPv6, Vlan)
from strategies import ALL_OPCODES, packet_args

pytestmark = pytest.mark.compiles      # its own argument types (conftest: jitwarm.unsealed)

M64 = (1 << 64) - 1
FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def s64(v: int) -> int:
    """A 64-bit field value as the int64 the data plane passes."""
    return v - (1 << 64) if v >> 63 else v


@contextlib.contextmanager
def accessors(pure: bool):
    """hdr, compiled; or with every compiled function swapped for its Python original (they call each
    other through the module's globals, so a .py_func calls the .py_func of its callees)."""
    if not pure:
        yield hdr
        return
    compiled = {n: f for n, f in vars(hdr).items() if isinstance(f, CPUDispatcher)}
    try:
        for n, f in compiled.items():
            setattr(hdr, n, f.py_func)
        yield hdr
    finally:
        for n, f in compiled.items():
            setattr(hdr, n, f)


MODES = pytest.mark.parametrize("pure", [False, True], ids=["compiled", "python"])

# extension-header field -> accessor (every field but the reserved ones: test_every_field_has_an_accessor)
READERS = {
    "reth": {"va": "reth_va", "rkey": "reth_rkey", "dma_len": "reth_dlen"},
    "aeth": {"syndrome": "aeth_syndrome", "msn": "aeth_msn"},
    "atomiceth": {"va": "atomiceth_va", "rkey": "atomiceth_rkey", "swap_add": "atomiceth_swap_add",
                  "compare": "atomiceth_compare"},
    "atomicacketh": {"orig": "atomicacketh_orig"},
    "immdt": {"imm": "immdt_imm"},
    "ieth": {"rkey": "ieth_rkey"},
    "neth": {"flags": "neth_flags", "msn": "neth_msn", "offset": "neth_offset", "msg_len": "neth_msg_len",
             "tsval": "neth_tsval"},
    "rsneth": {"rsn": "rsneth_rsn"},
    "sacketh": {"tsecr": "sacketh_tsecr", "credit": "sacketh_credit", "ce_count": "sacketh_ce_count",
                "echo_sport": "sacketh_echo_sport", "bitmap_words": "sacketh_words", "flags": "sacketh_flags"},
    "cnp": {},
}
BTH_READERS = {"opcode": "bth_opcode", "se": "bth_se", "m": "bth_mig", "pad": "bth_pad", "tver": "bth_tver",
               "pkey": "bth_pkey", "fecn": "bth_fecn", "becn": "bth_becn", "dest_qp": "bth_qpn",
               "ack_req": "bth_ackreq", "psn": "bth_psn"}


def test_every_field_has_an_accessor():
    for name, cls in EXT_CLASSES.items():
        assert set(READERS[name]) == {n for n, _ in cls.FIELDS if not n.startswith("resv")}, name
        for fn in READERS[name].values():
            assert isinstance(getattr(hdr, fn), CPUDispatcher) and getattr(hdr, fn).__doc__
    assert set(BTH_READERS) == {n for n, _ in BTH.FIELDS if not n.startswith("resv")}


# ---- the opcode table ----------------------------------------------------------------------------------
def test_opcode_table_is_opcodes_py():
    """One row per opcode value: its mask, extension length, payload offset and header offsets as
    opcodes.py derives them; rows of opcodes outside the table are empty."""
    assert hdr.OPT.shape == (256, hdr.OT_NCOL) and not hdr.OPT.flags.writeable
    for v in range(256):
        row = hdr.OPT[v]
        op = OPCODES.get(v)
        if op is None:
            assert row[hdr.OT_MASK] == 0 and (row[1:] == -1).all(), hex(v)
            continue
        assert row[hdr.OT_MASK] == op.mask
        assert row[hdr.OT_EXT] == op.hdr_len - BTH.SIZE == sum(EXT_CLASSES[h].SIZE for h in op.headers)
        assert row[hdr.OT_PAY] == op.hdr_len
        for name, col in hdr.OT_COL.items():
            want = op.offsets[name] - BTH.SIZE if name in op.headers else -1
            assert row[col] == want, (op.name, name)


def test_rxe_lengths():
    """Spot checks against Linux rxe's opcode table (rxe_opcode.c: length = BTH + extension headers)."""
    t = hdr.OPT
    assert t[0x0B, hdr.OT_PAY] == 12 + 16 + 4 and t[0x0B, hdr.OT_IMMDT] == 16     # WRITE ONLY WITH IMM
    assert t[0x12, hdr.OT_PAY] == 12 + 4 + 8 and t[0x12, hdr.OT_ATOMICACKETH] == 4  # ATOMIC ACKNOWLEDGE
    assert t[0x13, hdr.OT_PAY] == 12 + 28                                           # COMPARE SWAP
    assert t[0x17, hdr.OT_IETH] == 0 and t[0x0E, hdr.OT_EXT] == 0
    # the native fixed header lengths of MR-XH-039
    assert (t[0xC0, hdr.OT_PAY], t[0xC1, hdr.OT_PAY], t[0xC3, hdr.OT_PAY]) == (32, 36, 52)


# ---- frames from the reference encoder --------------------------------------------------------------
def _check_fields(H, buf, r, opcode, bth: dict, headers: dict, bitmap, payload: bytes, l3: int):
    op, qpn, rl3, b, pay, icrc, pad = (int(x) for x in r)
    assert op == opcode and qpn == bth["dest_qp"] and rl3 == l3
    for field, fn in BTH_READERS.items():
        assert getattr(H, fn)(buf, b) == bth[field], field
    for name in OPCODES[opcode].headers:
        h = H.ext_at(b, op, hdr.OT_COL[name])
        assert h == b + OPCODES[opcode].offsets[name]
        for field, fn in READERS[name].items():
            assert int(getattr(H, fn)(buf, h)) & M64 == getattr(headers[name], field), (name, field)
        if name == "sacketh":
            assert [int(H.sacketh_word(buf, h, i)) for i in range(len(bitmap))] == list(bitmap)
            assert H.sacketh_end(buf, h) == pay         # the bitmap is the SACK's last header
    for name in set(EXT_CLASSES) - set(OPCODES[opcode].headers):
        assert H.ext_at(b, op, hdr.OT_COL[name]) == -1
    assert pad == (-len(payload)) & 3 and bytes(buf[pay:icrc - pad]) == payload
    assert bytes(buf[icrc - pad:icrc]) == bytes(pad)


def _place(frame: bytes, a: int, tail: int = 0) -> np.ndarray:
    buf = np.full(a + len(frame) + tail, 0xA5, np.uint8)
    buf[a:a + len(frame)] = np.frombuffer(frame, np.uint8)
    return buf


@MODES
@FAST
@given(packet_args(), st.integers(0, 40), st.integers(0, 30))
def test_accessors_on_reference_frames(pure, case, a, tail):
    opcode, kw = case
    frame = encode(opcode, **kw)
    buf = _place(frame, a, tail)
    with accessors(pure) as H:
        r = H.parse_frame(buf, a, len(frame))
        l3 = a + 14 + (4 if kw.get("vlan") is not None else 0)
        bth = {f: kw.get(f, 0) for f in BTH_READERS} | {"opcode": opcode, "tver": 0,
                                                        "pad": (-len(kw["payload"])) & 3}
        headers = dict(kw["headers"])
        _check_fields(H, buf, r, opcode, bth, headers, kw.get("sack_bitmap", ()), kw["payload"], l3)
        u = H.udp_of(buf, l3)
        assert H.udp_sport(buf, u) == kw["sport"] and H.udp_dport(buf, u) == 4791
        assert H.udp_len(buf, u) == H.ip_end(buf, l3) - u and H.ip_end(buf, l3) == a + len(frame)
        assert H.ip_version(buf, l3) == (6 if ":" in kw["src_ip"] else 4)
        assert H.ip_ecn(buf, l3) == kw["ecn"]
        assert int(H.icrc_field(buf, int(r[5]))) == decode(frame).icrc
        assert H.l3_of(buf, a, len(frame))[1] == l3
    op, qpn, l3_, b, pay, icrc, pad = r
    assert (op, qpn) == (opcode, H.bth_qpn(buf, b)) and H.bth_opcode(buf, b) == opcode
    assert icrc_ok_at(TABLES, buf, l3_, icrc)
    buf[icrc - 1] ^= 0x01                            # the last byte before the ICRC
    assert not icrc_ok_at(TABLES, buf, l3_, icrc)


# ---- frames from scapy (the conformance suite's builder) ------------------------------------------
class S_NETH(Packet):
    """02-headers.md 3.7, written from the spec (MR-XH-017)."""
    name = "NETH"
    fields_desc = [ByteField("flags", 0), X3BytesField("msn", 0), XIntField("offset", 0), XIntField("msg_len", 0),
                   XIntField("tsval", 0)]


class S_RSNETH(Packet):
    """02-headers.md 3.9 (MR-XH-037)."""
    name = "RSNETH"
    fields_desc = [ByteField("resv", 0), X3BytesField("rsn", 0)]


class S_SACKETH(Packet):
    """02-headers.md 3.8 (MR-XH-026); the bitmap words follow."""
    name = "SACKETH"
    fields_desc = [XIntField("tsecr", 0), ShortField("credit", 0), ShortField("ce_count", 0),
                   ShortField("echo_sport", 0), ByteField("bitmap_words", 0), BitField("c", 0, 1),
                   BitField("n", 0, 1), BitField("resv", 0, 6)]


u8, u16, u24, u32, u64 = (st.integers(0, (1 << n) - 1) for n in (8, 16, 24, 32, 64))


@st.composite
def scapy_case(draw):
    """(opcode, frame, expected BTH fields, expected headers as our Header objects, bitmap, payload, l3)."""
    opcode = draw(st.sampled_from(ALL_OPCODES))
    op = OPCODES[opcode]
    raw, headers, bitmap = b"", {}, ()
    for name in op.headers:
        if name == "reth":
            va, rkey, dlen = draw(u64), draw(u32), draw(u32)
            raw += bytes(cp.RETH(va=va, rkey=rkey, dlen=dlen))
            headers[name] = RETH(va=va, rkey=rkey, dma_len=dlen)
        elif name == "aeth":
            syn, msn = draw(u8), draw(u24)
            raw += bytes(cp.AETHx(syndrome=syn, msn=msn))
            headers[name] = AETH(syndrome=syn, msn=msn)
        elif name == "atomiceth":
            v = [draw(u64), draw(u32), draw(u64), draw(u64)]
            raw += bytes(cp.AtomicETH(va=v[0], rkey=v[1], swap_add=v[2], compare=v[3]))
            headers[name] = AtomicETH(va=v[0], rkey=v[1], swap_add=v[2], compare=v[3])
        elif name == "atomicacketh":
            orig = draw(u64)
            raw += bytes(cp.AtomicAckETH(orig=orig))
            headers[name] = AtomicAckETH(orig=orig)
        elif name == "immdt":
            imm = draw(u32)
            raw += bytes(cp.ImmDt(imm=imm))
            headers[name] = ImmDt(imm=imm)
        elif name == "ieth":
            rkey = draw(u32)
            raw += bytes(cp.IETH(rkey=rkey))
            headers[name] = IETH(rkey=rkey)
        elif name == "neth":
            f = dict(flags=draw(u8), msn=draw(u24), offset=draw(u32), msg_len=draw(u32), tsval=draw(u32))
            raw += bytes(S_NETH(**f))
            headers[name] = NETH(**f)
        elif name == "rsneth":
            rsn = draw(u24)
            raw += bytes(S_RSNETH(rsn=rsn, resv=draw(u8)))       # Rsvd is ignored (MR-XH-037)
            headers[name] = RSNETH(rsn=rsn)
        elif name == "sacketh":
            bitmap = tuple(draw(st.lists(u32, max_size=4)))
            c, n = draw(st.integers(0, 1)), draw(st.integers(0, 1))
            f = dict(tsecr=draw(u32), credit=draw(u16), ce_count=draw(u16), echo_sport=draw(u16))
            raw += bytes(S_SACKETH(bitmap_words=len(bitmap), c=c, n=n, **f))
            raw += b"".join(w.to_bytes(4, "big") for w in bitmap)
            headers[name] = SACKETH(bitmap_words=len(bitmap), flags=(c << 7) | (n << 6), **f)
        elif name == "cnp":
            raw += bytes(16)
    payload = draw(st.binary(max_size=70)) if op.has(OpMask.PAYLOAD) else b""
    bth = dict(opcode=opcode, se=draw(st.integers(0, 1)), m=draw(st.integers(0, 1)), pad=(-len(payload)) & 3,
               tver=0, pkey=draw(u16), fecn=draw(st.integers(0, 1)), becn=draw(st.integers(0, 1)),
               dest_qp=draw(u24), ack_req=draw(st.integers(0, 1)), psn=draw(u24))
    v6 = draw(st.booleans())
    vlan = draw(st.none() | st.integers(1, 4094))
    frame = cp.build(opcode, src_mac="02:00:00:00:00:01", dst_mac="02:00:00:00:00:02",
                     src_ip="fd00::1" if v6 else "10.0.0.1", dst_ip="fd00::2" if v6 else "10.0.0.2",
                     dqpn=bth["dest_qp"], psn=bth["psn"], sport=draw(u16), ackreq=bool(bth["ack_req"]),
                     se=bool(bth["se"]), migreq=bool(bth["m"]), pkey=bth["pkey"], fecn=bool(bth["fecn"]),
                     becn=bool(bth["becn"]), resv6=draw(st.integers(0, 63)), resv7=draw(st.integers(0, 127)),
                     tos=draw(u8), vlan=vlan, headers=raw, payload=payload)
    return opcode, frame, bth, headers, bitmap, payload, 14 + (4 if vlan else 0)


@MODES
@FAST
@given(scapy_case(), st.integers(0, 24))
def test_accessors_on_scapy_frames(pure, case, a):
    opcode, frame, bth, headers, bitmap, payload, l3 = case
    buf = _place(frame, a, 8)
    with accessors(pure) as H:
        r = H.parse_frame(buf, a, len(frame))
        _check_fields(H, buf, r, opcode, bth, headers, bitmap, payload, a + l3)
    assert decode(frame).icrc_ok                     # scapy's frame is a good one: the reference agrees


# ---- writers against the reference packer ---------------------------------------------------------
def _writes(H, buf, h, name, v: dict):
    if name == "reth":
        return H.put_reth(buf, h, s64(v["va"]), v["rkey"], v["dma_len"])
    if name == "aeth":
        return H.put_aeth(buf, h, v["syndrome"], v["msn"])
    if name == "atomiceth":
        return H.put_atomiceth(buf, h, s64(v["va"]), v["rkey"], s64(v["swap_add"]), s64(v["compare"]))
    if name == "atomicacketh":
        return H.put_atomicacketh(buf, h, s64(v["orig"]))
    if name == "immdt":
        return H.put_immdt(buf, h, v["imm"])
    if name == "ieth":
        return H.put_ieth(buf, h, v["rkey"])
    if name == "neth":
        return H.put_neth(buf, h, v["flags"], v["msn"], v["offset"], v["msg_len"], v["tsval"])
    if name == "rsneth":
        return H.put_rsneth(buf, h, v["rsn"])
    if name == "sacketh":
        return H.put_sacketh(buf, h, v["tsecr"], v["credit"], v["ce_count"], v["echo_sport"], v["bitmap_words"],
                             v["flags"])
    raise AssertionError(name)


@st.composite
def header_values(draw):
    name = draw(st.sampled_from(sorted(set(EXT_CLASSES) - {"cnp"})))
    cls = EXT_CLASSES[name]
    v = {f: draw(st.integers(0, (1 << w) - 1)) for f, w in cls.FIELDS if not f.startswith("resv")}
    return name, cls(**v)


@MODES
@FAST
@given(header_values(), st.integers(0, 40))
def test_writers_pack_as_the_reference(pure, case, h):
    name, ref = case
    buf = np.full(h + 64, 0x77, np.uint8)             # stale bytes under the header: a writer writes every bit
    with accessors(pure) as H:
        end = _writes(H, buf, h, name, ref.as_dict())
        assert end == h + ref.SIZE
        assert bytes(buf[h:end]) == ref.pack()
        assert (buf[end:] == 0x77).all() and (buf[:h] == 0x77).all()
        if name == "sacketh":
            for i in range(3):
                H.put_sacketh_word(buf, h, i, 0xDEADBEEF - i)
                assert H.sacketh_word(buf, h, i) == 0xDEADBEEF - i


@MODES
@FAST
@given(packet_args(), st.integers(0, 255), st.integers(0, 1), st.integers(0, 1), st.integers(0, 3),
       st.integers(0, 1), st.integers(0, 0xFFFFFF))
def test_put_bth_packet_keeps_the_template_fields(pure, case, opcode, se, mig, pad, ackreq, psn):
    _, kw = case
    frame = bytearray(encode(0x11, **(kw | {"headers": {"aeth": AETH()}, "payload": b"", "sack_bitmap": ()})))
    b = len(frame) - 4 - 4 - 12                       # ACKNOWLEDGE: BTH, AETH, ICRC
    frame[b + 8] |= 0x7F                              # Resv7: put_bth_packet sends it as 0 (MR-BTH-013)
    buf = np.frombuffer(bytes(frame), np.uint8).copy()
    before = BTH.unpack(bytes(buf), b)
    with accessors(pure) as H:
        H.put_bth_packet(buf, b, opcode, se, mig, pad, ackreq, psn)
    want = before.replace(opcode=opcode, se=se, m=mig, pad=pad, ack_req=ackreq, psn=psn, resv7=0)
    assert bytes(buf[b:b + 12]) == want.pack()


def test_put_cnp_zeroes_the_reserved_bytes():
    for pure in (False, True):
        buf = np.full(40, 0x77, np.uint8)
        with accessors(pure) as H:
            assert H.put_cnp(buf, 5) == 5 + CNPPad.SIZE
        assert (buf[5:5 + CNPPad.SIZE] == 0).all() and (buf[:5] == 0x77).all() and (buf[5 + CNPPad.SIZE:] == 0x77).all()


@MODES
@FAST
@given(packet_args(), st.integers(0, 0xFFFF), st.integers(0, 2**20 - 1))
def test_template_writers_as_the_reference(pure, case, sport, label):
    """put_udp_sport and put_ip6_flow_label (the native plane's entropy, MR-MP-004, MR-MP-016) change what the
    reference encoder would have built with the other port and label, and nothing else of the headers."""
    opcode, kw = case
    frame = encode(opcode, **kw)
    v6 = ":" in kw["src_ip"]
    want = encode(opcode, **(kw | {"sport": sport} | ({"flow_label": label} if v6 else {})))
    buf = np.frombuffer(frame, np.uint8).copy()
    l3 = 14 + (4 if kw.get("vlan") is not None else 0)
    with accessors(pure) as H:
        u = H.udp_of(buf, l3)
        H.put_udp_sport(buf, u, sport)
        if v6:
            H.put_ip6_flow_label(buf, l3, label)
    b = u + hdr.UDP_SIZE
    assert bytes(buf[:u + hdr.O_UDP_CSUM]) == want[:u + hdr.O_UDP_CSUM]     # the checksum and ICRC are not theirs
    assert bytes(buf[b:b + BTH.SIZE]) == want[b:b + BTH.SIZE]


@FAST
@given(packet_args(), st.integers(0, 63), st.integers(0, 3), st.integers(0, 1), st.integers(0, 1))
def test_put_field_as_the_reference(case, dscp, ecn, fecn, becn):
    """The Python-side writer (templates: dp/context.py's CNP template) against the reference encoder."""
    opcode, kw = case
    v6 = ":" in kw["src_ip"]
    buf = np.frombuffer(encode(opcode, **kw), np.uint8).copy()
    want = encode(opcode, **(kw | dict(dscp=dscp, ecn=ecn, fecn=fecn, becn=becn)))
    l3 = 14 + (4 if kw.get("vlan") is not None else 0)
    b = l3 + (hdr.IP6_SIZE if v6 else hdr.IP4_SIZE) + hdr.UDP_SIZE
    if v6:
        hdr.put_field(buf, l3, IPv6, "traffic_class", (dscp << 2) | ecn)
        assert bytes(buf[l3:l3 + hdr.IP6_SIZE]) == want[l3:l3 + hdr.IP6_SIZE]
    else:
        hdr.put_field(buf, l3, IPv4, "dscp", dscp)
        hdr.put_field(buf, l3, IPv4, "ecn", ecn)
        assert buf[l3 + hdr.O_IP4_TOS] == want[l3 + hdr.O_IP4_TOS]        # (the header checksum is not its)
    hdr.put_field(buf, b, BTH, "fecn", fecn)
    hdr.put_field(buf, b, BTH, "becn", becn)
    assert bytes(buf[b:b + BTH.SIZE]) == want[b:b + BTH.SIZE]


# ---- parse_frame refuses what the reference decoder refuses ---------------------------------------
class Guard:
    """A read-only byte buffer that fails the test on a read outside [lo, hi)."""

    def __init__(self, arr: np.ndarray, lo: int, hi: int):
        self.arr, self.lo, self.hi = arr, lo, hi

    def __getitem__(self, i):
        assert self.lo <= i < self.hi, f"read at {i}, outside the frame [{self.lo}, {self.hi})"
        return self.arr[i]


def _verdict(frame: bytes):
    """(status, dest_qp, payload, pad) as the reference decoder sees the frame."""
    try:
        p = decode(frame, verify_icrc=False)
    except MalformedPacket as e:
        return -int(e.reason), None, None, None
    return p.bth.opcode, p.bth.dest_qp, p.payload, p.bth.pad


def _parse_both(frame: bytes, a: int):
    """parse_frame compiled (frame inside junk) and as plain Python over a Guard; both must agree."""
    buf = _place(frame, a, 16)
    r = tuple(int(x) for x in hdr.parse_frame(buf, a, len(frame)))
    with accessors(True) as H:
        r2 = tuple(int(x) for x in H.parse_frame(Guard(buf, a, a + len(frame)), a, len(frame)))
    assert r == r2
    return buf, r


def _agrees_with_decode(frame: bytes, a: int = 3):
    buf, r = _parse_both(frame, a)
    status, qpn, payload, pad = _verdict(frame)
    assert r[0] == status, (r, status)
    if status >= 0:
        op, rq, l3, b, pay, icrc, rpad = r
        assert (rq, rpad, bytes(buf[pay:icrc - rpad])) == (qpn, pad, payload)
    else:
        assert r[1:] == (-1,) * 6
    return r[0]


@st.composite
def damaged_frames(draw):
    """A valid frame, then some of: cut short, bytes overwritten, a 16-bit length or type field set,
    Ethernet padding appended."""
    opcode, kw = draw(packet_args())
    f = bytearray(encode(opcode, **kw))
    l3 = 18 if kw.get("vlan") is not None else 14
    u = l3 + (40 if ":" in kw["src_ip"] else 20)
    for _ in range(draw(st.integers(0, 2))):
        what = draw(st.sampled_from(["bytes", "ip_len", "udp_len", "byte_at", "ethertype", "bth1", "words"]))
        if what == "bytes":
            at = draw(st.integers(0, len(f) - 1))
            f[at:at + 4] = draw(st.binary(min_size=1, max_size=4))[:len(f) - at]
        elif what == "ip_len":
            o = l3 + (4 if ":" in kw["src_ip"] else 2)
            f[o:o + 2] = (int.from_bytes(f[o:o + 2], "big") + draw(st.integers(-12, 12)) & 0xFFFF).to_bytes(2, "big")
        elif what == "udp_len":
            f[u + 4:u + 6] = (int.from_bytes(f[u + 4:u + 6], "big") + draw(st.integers(-12, 12)) & 0xFFFF
                              ).to_bytes(2, "big")
        elif what == "byte_at":                    # IP version/IHL, protocol, flags, port, opcode, SACK words
            o = draw(st.sampled_from([l3, l3 + 6, l3 + 9, u + 2, u + 8, u + 8 + 16 + 10]))
            if o < len(f):
                f[o] = draw(st.integers(0, 255))
        elif what == "ethertype":
            o = draw(st.sampled_from([12, 16]))
            f[o:o + 2] = draw(st.sampled_from([0x0800, 0x86DD, 0x8100, 0x88A8, 0x0806, 0x88CC])).to_bytes(2, "big")
        elif what == "bth1":                       # SE, M, PadCnt, TVer
            f[u + 9] = draw(st.integers(0, 255))
        elif what == "words" and opcode == 0xC6:
            f[u + 8 + 16 + 10] = draw(st.integers(0, 40))
    if draw(st.booleans()):
        f = f[:draw(st.integers(0, len(f)))]
    if draw(st.integers(0, 3)) == 0:
        f += bytes(draw(st.integers(1, 30)))       # Ethernet padding: after the IP packet, ignored
    return bytes(f)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(damaged_frames(), st.integers(0, 9))
def test_parse_frame_agrees_with_the_reference_decoder(frame, a):
    _agrees_with_decode(frame, a)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=120), st.integers(0, 9))
def test_parse_frame_on_any_bytes(frame, a):
    _agrees_with_decode(frame, a)


# ---- the refusals, one by one ---------------------------------------------------------------------
_V4 = dict(dest_qp=0x11, psn=7, payload=b"abcde")
_V6 = dict(_V4, src_ip="fd00::1", dst_ip="fd00::2")


def _set(frame: bytes, off: int, value: int, n: int = 1) -> bytes:
    f = bytearray(frame)
    f[off:off + n] = value.to_bytes(n, "big")
    return bytes(f)


@pytest.mark.parametrize("kw", [_V4, _V6, dict(_V4, vlan=Vlan(vid=100))], ids=["ipv4", "ipv6", "vlan"])
def test_every_truncation_is_refused(kw):
    frame = encode(0x04, **kw)
    assert _agrees_with_decode(frame) == 0x04
    for n in range(len(frame)):
        assert _agrees_with_decode(frame[:n]) < 0, n


def test_ethernet_padding_is_not_payload():
    frame = encode(0x04, **_V4)
    _, r = _parse_both(frame + bytes(20), 0)
    assert r[0] == 0x04 and r[5] == len(frame) - 4


def test_ip_lengths_must_match_the_frame():
    f4, f6 = encode(0x04, **_V4), encode(0x04, **_V6)
    n4 = int.from_bytes(f4[14 + hdr.O_IP4_TOTLEN:][:2], "big")
    assert _agrees_with_decode(_set(f4, 14 + hdr.O_IP4_TOTLEN, n4 + 1, 2)) == -hdr.R_BAD_IP_HEADER
    assert _agrees_with_decode(_set(f4, 14 + hdr.O_IP4_TOTLEN, 19, 2)) == -hdr.R_BAD_IP_HEADER
    assert _agrees_with_decode(_set(f4, 14 + hdr.O_IP4_TOTLEN, n4 - 4, 2)) == -hdr.R_BAD_UDP_LENGTH
    n6 = int.from_bytes(f6[14 + hdr.O_IP6_PLEN:][:2], "big")
    assert _agrees_with_decode(_set(f6, 14 + hdr.O_IP6_PLEN, n6 + 1, 2)) == -hdr.R_BAD_IP_HEADER
    assert _agrees_with_decode(_set(f6, 14 + hdr.O_IP6_PLEN, n6 - 4, 2)) == -hdr.R_BAD_UDP_LENGTH
    assert _agrees_with_decode(_set(f4, 34 + hdr.O_UDP_LEN, 8 + 12 + 4 + 8 - 1, 2)) == -hdr.R_BAD_UDP_LENGTH


def test_ip_header_rules():
    f = encode(0x04, **_V4)
    assert _agrees_with_decode(_set(f, 14, 0x46)) == -hdr.R_IP_OPTIONS             # MR-ENC-009
    assert _agrees_with_decode(_set(f, 14, 0x44)) == -hdr.R_BAD_IP_HEADER
    assert _agrees_with_decode(_set(f, 14 + 6, 0x20)) == -hdr.R_IP_FRAGMENT         # MF
    assert _agrees_with_decode(_set(f, 14 + 7, 0x01)) == -hdr.R_IP_FRAGMENT         # offset 8
    assert _agrees_with_decode(_set(f, 14 + 9, 6)) == -hdr.R_NOT_UDP
    assert _agrees_with_decode(_set(f, 34 + 2, 4792, 2)) == -hdr.R_NOT_ROCE_PORT
    assert _agrees_with_decode(_set(encode(0x04, **_V6), 14 + 6, 0)) == -hdr.R_NOT_UDP  # an IPv6 extension header


@pytest.mark.parametrize("ethertype", [0x0806, 0x88CC, 0x88A8, 0x8100, 0x0000, 0xFFFF])
def test_unknown_ethertypes_are_not_ip(ethertype):
    f = encode(0x04, **dict(_V4, vlan=Vlan(vid=5)))
    assert _agrees_with_decode(_set(f, 16, ethertype, 2)) == -hdr.R_NOT_IP          # inner type (0x8100: two tags)
    if ethertype != 0x8100:
        assert _agrees_with_decode(_set(encode(0x04, **_V4), 12, ethertype, 2)) == -hdr.R_NOT_IP


def test_bth_reserved_bits():
    """TVer other than 0 is refused (MR-BTH-007); Resv6 and Resv7 are ignored (MR-BTH-013)."""
    b = 14 + 20 + 8
    f = encode(0x04, **_V4)
    for tver in range(1, 16):
        assert _agrees_with_decode(_set(f, b + 1, (f[b + 1] & 0xF0) | tver)) == -hdr.R_BAD_TVER
    g = _set(_set(f, b + 4, 0x3F), b + 8, f[b + 8] | 0x7F)
    assert _agrees_with_decode(g) == 0x04
    buf = _place(g, 0)
    assert (hdr.bth_qpn(buf, b), hdr.bth_psn(buf, b), hdr.bth_ackreq(buf, b)) == (0x11, 7, 0)


@pytest.mark.parametrize("opcode", [0x15, 0x18, 0x1F, 0x20, 0x64, 0x80, 0x82, 0xC7, 0xFF])
def test_unknown_opcodes(opcode):
    assert _agrees_with_decode(_set(encode(0x04, **_V4), 14 + 20 + 8, opcode)) == -hdr.R_UNKNOWN_OPCODE


def test_minimum_lengths_from_the_table():
    """An opcode's extension headers must fit before the ICRC (MR-ENC-027, MR-XH-039)."""
    b = 14 + 20 + 8
    for opcode, op in OPCODES.items():
        if not op.headers:
            continue
        # a SEND ONLY with a 0-byte payload relabelled: its UDP payload holds BTH + ICRC only
        f = _set(encode(0x04, **dict(_V4, payload=b"")), b, opcode)
        assert _agrees_with_decode(f) == -hdr.R_TRUNCATED_EXT, op.name


def test_sack_bitmap_words():
    b = 14 + 20 + 8
    kw = dict(_V4, payload=b"", headers={"aeth": AETH(), "sacketh": SACKETH(bitmap_words=2)}, sack_bitmap=(1, 2))
    f = encode(0xC6, **kw)
    assert _agrees_with_decode(f) == 0xC6
    words = b + 12 + 4 + 10
    assert _agrees_with_decode(_set(f, words, 33)) == -hdr.R_BAD_FIELD             # MR-XH-027
    assert _agrees_with_decode(_set(f, words, 3)) == -hdr.R_TRUNCATED_EXT
    assert _agrees_with_decode(_set(f, words, 1)) == -hdr.R_BAD_PAD                # a word left over: not payload


def test_pad_rules():
    b = 14 + 20 + 8
    f = encode(0x04, **_V4)                                                        # 5 bytes, PadCnt 3
    assert _agrees_with_decode(_set(f, b + 1, 0x00)) == 0x04                       # PadCnt 0: 8 bytes of payload
    ack = encode(0x11, **dict(_V4, payload=b"", headers={"aeth": AETH()}))
    assert _agrees_with_decode(_set(ack, b + 1, 0x10)) == -hdr.R_BAD_PAD            # PadCnt on a no-payload opcode
    odd = encode(0x04, **dict(_V4, payload=b"abc"), pad=0)
    assert _agrees_with_decode(odd) == -hdr.R_BAD_PAD                             # payload + pad not 4-aligned
