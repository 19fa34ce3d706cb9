"""The lower tester's native packets: scapy layers NETH, RSNETH, SACKETH and the native opcodes, from the spec.

Written from docs/spec/02-headers.md sections 3.7 to 3.9 and 04-native.md section 4.2.2
(Table 2-1's native rows), never from metaroce_xdp.wire or metaroce_xdp.native (the
reference implementation): like packets.py, an independent oracle.  Frames are built
through packets.build (Ethernet, IP, UDP, BTH, ICRC of MR-ICRC-003) with the native
extension headers given as bytes of the layers below.

    neth(msn, offset, msg_len, tsval, first=None, last=None, retx=False)   -> NETH layer
    build(op, ..., reth=, neth=, rsn=, imm=, aeth=, sack=, payload=)        -> frame bytes
    sack_layer(tsecr, credit, ce_count, echo_sport, received=..., base=, ...) -> SACKETH with its bitmap
    parse(frame) -> NativeView (the RoceView of packets.parse plus .neth, .rsneth, .imm, .reth, .aeth, .sack)

Bitmap numbering (MR-XH-029, MR-SACK-004): bit i, counted from bit 31 of word 0 downwards and on through
the next words, stands for PSN (BTH.PSN + 2 + i) mod 2^24; BTH.PSN + 1 (the ePSN) has no bit.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from scapy.fields import BitField, ByteField, FieldListField, IntField, ShortField, X3BytesField, XByteField, \
    XIntField, XShortField
from scapy.packet import Packet

from . import packets as P


# ---- the native extension headers ------------------------------------------------------------
class NETH(Packet):
    """MR-XH-017: 16 bytes.  Byte 0: F (bit 7), L (bit 6), R (bit 5), reserved bits 4-0; MSN (24 bits);
    Offset; Message Length; TSval (us, modulo 2^32)."""
    name = "NETH"
    fields_desc = [BitField("first", 0, 1), BitField("last", 0, 1), BitField("retx", 0, 1), BitField("resv5", 0, 5),
                   X3BytesField("msn", 0), IntField("offset", 0), IntField("msg_len", 0), XIntField("tsval", 0)]

    def extract_padding(self, s):
        return b"", s


class RSNETH(Packet):
    """MR-XH-037: 4 bytes, a reserved byte and the 24-bit RSN."""
    name = "RSNETH"
    fields_desc = [XByteField("resv", 0), X3BytesField("rsn", 0)]

    def extract_padding(self, s):
        return b"", s


class SACKETH(Packet):
    """MR-XH-026: 12 bytes -- TSecr; Credit; CE Count; Echo Sport; Bitmap Words; flags C (bit 7), N (bit 6),
    reserved bits 5-0 -- then Bitmap Words big-endian 32-bit words."""
    name = "SACKETH"
    fields_desc = [XIntField("tsecr", 0), ShortField("credit", 0xFFFF), ShortField("ce_count", 0),
                   XShortField("echo_sport", 0), ByteField("bitmap_words", 0), BitField("ce", 0, 1),
                   BitField("n", 0, 1), BitField("resv6", 0, 6),
                   FieldListField("bitmap", [], XIntField("word", 0), count_from=lambda p: p.bitmap_words)]

    def extract_padding(self, s):
        return b"", s

    def received(self, psn: int) -> list[int]:
        """The PSNs the bitmap reports received, for BTH.PSN `psn` (MR-SACK-004)."""
        out = []
        for w, word in enumerate(self.bitmap):
            for b in range(32):
                if word >> (31 - b) & 1:
                    out.append((psn + 2 + 32 * w + b) & 0xFFFFFF)
        return out


# ---- Table 2-1's native rows (04-native.md 4.2.2) ------------------------------------------------
NATIVE_SEND, NATIVE_SEND_IMM, NATIVE_WRITE, NATIVE_WRITE_IMM = 0xC0, 0xC1, 0xC2, 0xC3
NATIVE_READ_REQ, NATIVE_READ_RESP, NATIVE_SACK = 0xC4, 0xC5, 0xC6
FETCH_ADD, COMPARE_SWAP, ATOMIC_ACKNOWLEDGE = 0x14, 0x13, 0x12
NATIVE_OPS: dict[int, tuple[str, tuple[str, ...], str]] = {
    0xC0: ("NATIVE_SEND", ("NETH", "RSNETH"), "0..pmtu"),
    0xC1: ("NATIVE_SEND_IMM", ("NETH", "RSNETH", "ImmDt"), "0..pmtu"),
    0xC2: ("NATIVE_WRITE", ("RETH", "NETH"), "0..pmtu"),
    0xC3: ("NATIVE_WRITE_IMM", ("RETH", "NETH", "RSNETH", "ImmDt"), "0..pmtu"),
    0xC4: ("NATIVE_READ_REQ", ("RETH", "NETH"), "none"),
    0xC5: ("NATIVE_READ_RESP", ("NETH",), "0..pmtu"),
    0xC6: ("NATIVE_SACK", ("AETH", "SACKETH"), "none"),
}
BY_NAME = {v[0]: k for k, v in NATIVE_OPS.items()}
# the fixed header length, BTH to payload (04-native.md 4.2.2; MR-XH-039); NATIVE_SACK: + 4 x Bitmap Words
FIXED_LEN = {0xC0: 32, 0xC1: 36, 0xC2: 44, 0xC3: 52, 0xC4: 44, 0xC5: 28, 0xC6: 28}
HEADER_LEN = {"RETH": 16, "NETH": 16, "RSNETH": 4, "ImmDt": 4, "AETH": 4, "SACKETH": 12}
RECV_CONSUMING = (NATIVE_SEND, NATIVE_SEND_IMM, NATIVE_WRITE_IMM)
for _c, (_n, _h, _p) in NATIVE_OPS.items():          # sanity of the table against the spec's fixed lengths
    assert 12 + sum(HEADER_LEN[h] for h in _h) == FIXED_LEN[_c], _n


def opcode(op: int | str) -> int:
    if isinstance(op, str):
        return BY_NAME[op] if op in BY_NAME else P.opcode(op)
    return int(op)


def neth(msn: int, offset: int = 0, msg_len: int = 0, tsval: int = 0, *, payload_len: int | None = None,
         first: bool | None = None, last: bool | None = None, retx: bool = False, resv5: int = 0) -> NETH:
    """A NETH; first/last default to MR-XH-018 (F exactly at offset 0, L exactly when offset + payload
    length = Message Length, payload_len needed for L)."""
    if first is None:
        first = offset == 0
    if last is None:
        last = payload_len is not None and offset + payload_len == msg_len
    return NETH(first=int(first), last=int(last), retx=int(retx), resv5=resv5, msn=msn & 0xFFFFFF,
                offset=offset & 0xFFFFFFFF, msg_len=msg_len & 0xFFFFFFFF, tsval=tsval & 0xFFFFFFFF)


def bitmap_words(received, psn: int, words: int | None = None) -> list[int]:
    """The bitmap words of an ACK-type SACK with BTH.PSN `psn` that reports the PSNs in `received` (those
    from psn + 2 on; others are left out), in the smallest number of words unless `words` says."""
    bits = []
    for q in received:
        i = (q - psn - 2) & 0xFFFFFF
        if i < 32 * 32:
            bits.append(i)
    n = words if words is not None else (max(bits) // 32 + 1 if bits else 0)
    out = [0] * n
    for i in bits:
        if i // 32 < n:
            out[i // 32] |= 1 << (31 - i % 32)
    return out


def sack_layer(*, tsecr: int = 0, credit: int = 0xFFFF, ce_count: int = 0, echo_sport: int = 0,
               words: list[int] = (), bitmap_words_field: int | None = None, ce: bool = False, n: bool = False,
               resv6: int = 0) -> SACKETH:
    """A SACKETH with its bitmap; bitmap_words_field overrides the count (a malformed SACK)."""
    words = list(words)
    return SACKETH(tsecr=tsecr & 0xFFFFFFFF, credit=credit, ce_count=ce_count & 0xFFFF, echo_sport=echo_sport,
                   bitmap_words=len(words) if bitmap_words_field is None else bitmap_words_field,
                   ce=int(ce), n=int(n), resv6=resv6, bitmap=words)


def build(op, *, reth: tuple | None = None, neth_: NETH | None = None, rsn: int | None = None,
          imm: int | None = None, aeth: tuple | None = None, sack: SACKETH | None = None,
          atomic: tuple | None = None, headers: bytes | None = None, payload: bytes = b"", **kw) -> bytes:
    """One frame of a native opcode (or a compat one, passed to packets.build unchanged): the extension
    headers of its Table 2-1 row, in order, from reth=(va, rkey, dlen), neth_=NETH, rsn=, imm=,
    aeth=(syndrome, msn), sack=SACKETH; `headers` gives raw bytes instead.  kw: packets.build's
    (addresses, dqpn, psn, sport, ackreq, se, tos, padcount, pad, bad_icrc ...)."""
    code = opcode(op)
    if code not in NATIVE_OPS:
        return P.build(code, reth=reth, imm=imm, aeth=aeth, atomic=atomic, headers=headers, payload=payload, **kw)
    if headers is None:
        hb = b""
        for h in NATIVE_OPS[code][1]:
            if h == "RETH":
                va, rkey, dlen = reth if reth is not None else (0, 0, 0)
                hb += bytes(P.RETH(va=va, rkey=rkey, dlen=dlen))
            elif h == "NETH":
                hb += bytes(neth_ if neth_ is not None else NETH())
            elif h == "RSNETH":
                hb += bytes(RSNETH(rsn=(rsn or 0) & 0xFFFFFF))
            elif h == "ImmDt":
                hb += bytes(P.ImmDt(imm=imm or 0))
            elif h == "AETH":
                syn, msn = aeth if aeth is not None else (0x1F, 0)
                hb += bytes(P.AETHx(syndrome=syn, msn=msn))
            elif h == "SACKETH":
                hb += bytes(sack if sack is not None else SACKETH())
        headers = hb
    return P.build(code, headers=headers, payload=payload, **kw)


class FastBuilder:
    """build() for a tester that must answer within a round trip (the IUT's RTO before its first RTT sample is
    4 ms): IPv4 frames packed with struct from the layouts of 01-encapsulation.md (Ethernet II, IPv4 without
    options, DF, identification 0, UDP checksum 0, MR-ENC-023) and 02-headers.md (BTH), the ICRC from
    packets.icrc.  The same bytes as build() -- scapy's -- for every frame it makes (checked in
    tests/conformance/test_conformance_native.py); IPv6, VLAN, a wrong ICRC or an explicit pad go to build()."""

    def build(self, op, *, psn: int, ackreq: bool = False, se: bool = False, payload: bytes = b"",
              headers: bytes | None = None, **kw) -> bytes:
        code = opcode(op)
        if headers is None or ":" in kw.get("dst_ip", "") or kw.get("bad_icrc") or kw.get("pad") is not None \
                or kw.get("padcount") is not None or kw.get("vlan") is not None:
            return build(code, psn=psn, ackreq=ackreq, se=se, payload=payload, headers=headers, **kw)
        import socket as _s
        npad = (-len(payload)) & 3
        body = headers + payload + bytes(npad)
        bth = struct.pack("!BBHB3sB3s", code, (int(se) << 7) | (int(kw.get("migreq", 0)) << 6) | (npad << 4)
                          | (kw.get("tver", 0) & 0xF), kw.get("pkey", 0xFFFF),
                          (int(kw.get("fecn", 0)) << 7) | (int(kw.get("becn", 0)) << 6) | (kw.get("resv6", 0) & 0x3F),
                          (kw["dqpn"] & 0xFFFFFF).to_bytes(3, "big"), (int(ackreq) << 7) | (kw.get("resv7", 0) & 0x7F),
                          (psn & 0xFFFFFF).to_bytes(3, "big"))
        udp_len = 8 + len(bth) + len(body) + 4
        ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, kw.get("tos", 0x6A), 20 + udp_len, kw.get("ip_id", 0),
                                   0x4000, kw.get("ttl", 64), 17, 0, _s.inet_aton(kw["src_ip"]),
                                   _s.inet_aton(kw["dst_ip"])))
        ip[10:12] = struct.pack("!H", P.ipv4_checksum(bytes(ip)))
        udp = struct.pack("!HHHH", kw.get("sport", 0xC000), P.ROCE_PORT, udp_len, 0)
        eth = bytes.fromhex(kw["dst_mac"].replace(":", "")) + bytes.fromhex(kw["src_mac"].replace(":", "")) + \
            b"\x08\x00"
        frame = eth + bytes(ip) + udp + bth + body + b"\0\0\0\0"
        return frame[:-4] + P.icrc_bytes(P.icrc(frame))


def headers_of(code: int, *, reth: tuple | None = None, neth_: NETH | None = None, rsn: int | None = None,
               imm: int | None = None, aeth: tuple | None = None, sack: SACKETH | None = None) -> bytes:
    """The extension header bytes of a native opcode's Table 2-1 row (as build() lays them out)."""
    hb = b""
    for h in NATIVE_OPS[code][1]:
        if h == "RETH":
            va, rkey, dlen = reth if reth is not None else (0, 0, 0)
            hb += struct.pack("!QII", va & (2**64 - 1), rkey & 0xFFFFFFFF, dlen & 0xFFFFFFFF)
        elif h == "NETH":
            hb += bytes(neth_ if neth_ is not None else NETH())
        elif h == "RSNETH":
            hb += bytes(RSNETH(rsn=(rsn or 0) & 0xFFFFFF))
        elif h == "ImmDt":
            hb += struct.pack("!I", (imm or 0) & 0xFFFFFFFF)
        elif h == "AETH":
            syn, msn = aeth if aeth is not None else (0x1F, 0)
            hb += struct.pack("!I", (syn & 0xFF) << 24 | (msn & 0xFFFFFF))
        elif h == "SACKETH":
            hb += bytes(sack if sack is not None else SACKETH())
    return hb


# ---- parsing -------------------------------------------------------------------------------------
@dataclass
class NativeView:
    """A RoCEv2 packet read by packets.parse, with the native headers of its opcode decoded."""
    base: Any                                 # packets.RoceView
    neth: NETH | None = None
    rsneth: RSNETH | None = None
    imm: int | None = None
    reth: Any = None                          # packets.RETH
    aeth: Any = None                          # packets.AETHx
    sack: SACKETH | None = None
    atomic_ack: int | None = None
    payload: bytes = b""
    malformed: str = ""
    hdr_len: int = 0                          # bytes of extension headers after the BTH

    def __getattr__(self, name):              # BTH and IP fields: the RoceView's
        return getattr(self.__dict__["base"], name)

    @property
    def name(self) -> str:
        return NATIVE_OPS[self.op][0] if self.op in NATIVE_OPS else self.base.name

    @property
    def syndrome(self) -> int | None:
        return None if self.aeth is None else int(self.aeth.syndrome)

    @property
    def msn(self) -> int | None:
        """AETH.MSN (a SACK or an ATOMIC_ACKNOWLEDGE)."""
        return None if self.aeth is None else int(self.aeth.msn)

    @property
    def sack_kind(self) -> str | None:
        """"ACK", "RNR", "NAK" (MR-SACK-038: bits 6-5 of the syndrome; bit 7 ignored)."""
        s = self.syndrome
        if s is None:
            return None
        return ("ACK", "RNR", "RESERVED", "NAK")[(s >> 5) & 3]

    def received(self) -> set[int]:
        """A SACK's PSNs reported received by its bitmap (not the cumulative part)."""
        return set(self.sack.received(self.psn)) if self.sack is not None else set()

    def summary(self) -> str:
        s = f"{self.name} dqpn={self.dqpn:#08x} psn={self.psn:#08x} sport={self.sport:#06x}"
        if self.ackreq:
            s += " A"
        if self.neth is not None:
            n = self.neth
            fl = "".join(c for c, v in (("F", n.first), ("L", n.last), ("R", n.retx)) if v)
            s += f" NETH[{fl or '-'}] msn={int(n.msn)} off={int(n.offset)} len={int(n.msg_len)} ts={int(n.tsval):#x}"
        if self.rsneth is not None:
            s += f" RSN={int(self.rsneth.rsn)}"
        if self.aeth is not None:
            s += f" AETH {self.sack_kind}({self.syndrome:#04x}) msn={self.msn}"
        if self.sack is not None:
            k = self.sack
            s += (f" SACK tsecr={int(k.tsecr):#x} credit={int(k.credit):#x} ce={int(k.ce_count)} "
                  f"echo={int(k.echo_sport):#06x} words={int(k.bitmap_words)}"
                  + (" [" + " ".join(f"{int(w):08x}" for w in k.bitmap) + "]" if k.bitmap else "")
                  + (" C" if k.ce else "") + (" N" if k.n else ""))
        if self.atomic_ack is not None:
            s += f" orig={self.atomic_ack:#x}"
        if self.payload:
            s += f" payload={len(self.payload)}B"
        if not self.icrc_ok:
            s += " BAD-ICRC"
        if self.malformed:
            s += f" MALFORMED({self.malformed})"
        return s


def parse(frame: bytes) -> NativeView | None:
    """packets.parse plus the native headers (and, for ATOMIC_ACKNOWLEDGE, its AETH and original value)."""
    v = P.parse(frame)
    if v is None:
        return None
    out = NativeView(v)
    if v.op not in NATIVE_OPS:
        out.aeth = v.headers.get("AETH")
        out.reth = v.headers.get("RETH")
        if "AtomicAckETH" in v.headers:
            out.atomic_ack = int(v.headers["AtomicAckETH"].orig)
        out.payload = v.payload
        return out
    from scapy.contrib.roce import BTH
    b = v.pkt[BTH]
    rest = bytes(b.payload) if b.payload.__class__.__name__ != "Padding" else b""
    pos = 0
    for h in NATIVE_OPS[v.op][1]:
        n = HEADER_LEN[h]
        if len(rest) - pos < n:
            out.malformed = f"{h} truncated"
            break
        chunk = rest[pos:pos + n]
        if h == "RETH":
            out.reth = P.RETH(chunk)
        elif h == "NETH":
            out.neth = NETH(chunk)
        elif h == "RSNETH":
            out.rsneth = RSNETH(chunk)
        elif h == "ImmDt":
            out.imm = struct.unpack("!I", chunk)[0]
        elif h == "AETH":
            out.aeth = P.AETHx(chunk)
        elif h == "SACKETH":
            nw = chunk[10]
            if len(rest) - pos < n + 4 * nw:
                out.malformed = f"bitmap of {nw} words truncated"
                out.sack = SACKETH(chunk[:10] + b"\0" + chunk[11:])
                out.sack.bitmap_words = nw
                pos += n
                break
            out.sack = SACKETH(rest[pos:pos + n + 4 * nw])
            n += 4 * nw
        pos += n
    out.hdr_len = pos
    body = rest[pos:]
    pad = int(b.padcount)
    out.payload = body[:len(body) - pad] if pad <= len(body) else b""
    return out


def psn_add(a: int, n: int) -> int:
    return (a + n) & 0xFFFFFF


__all__ = ["ATOMIC_ACKNOWLEDGE", "COMPARE_SWAP", "FETCH_ADD", "FIXED_LEN", "FastBuilder", "NATIVE_OPS",
           "NATIVE_READ_REQ", "NATIVE_READ_RESP", "NATIVE_SACK", "NATIVE_SEND", "NATIVE_SEND_IMM", "NATIVE_WRITE",
           "NATIVE_WRITE_IMM", "NETH", "NativeView", "RECV_CONSUMING", "RSNETH", "SACKETH", "bitmap_words", "build",
           "headers_of", "neth", "opcode", "parse", "psn_add", "sack_layer"]
