"""The lower tester's packets: scapy layers, the opcode table and the ICRC, written from the spec.

Deliberately independent of metaroce_xdp.wire (the reference implementation's
codec): a bug there must not be able to hide on both sides of the link.  The
layers scapy.contrib.roce lacks (RETH, ImmDt, IETH, AtomicETH, AtomicAckETH) are
declared here from 02-headers.md; the ICRC is computed here from MR-ICRC-002 to
MR-ICRC-010 (scapy's own BTH.compute_icrc is not used, so that the tester's ICRC
is a third opinion, checked against both in tests/conformance/test_conformance.py).

    build(op, src_mac=..., dst_mac=..., src_ip=..., dst_ip=..., dqpn=..., psn=...,
          reth=(va, rkey, dlen), payload=b"...")        -> bytes, ICRC correct
    parse(frame)                                        -> RoceView or None
    icrc(frame) / refresh(frame)                        -> the ICRC of MR-ICRC-003 / frame with it (and the
                                                           IPv4 header checksum) recomputed after an edit
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

from scapy.contrib.roce import AETH, BTH
from scapy.fields import IntField, XIntField, XLongField
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Dot1Q, Ether
from scapy.packet import Packet, Raw

ROCE_PORT = 4791


# ---- the extension headers scapy.contrib.roce lacks (02-headers.md) ------------------------
class RETH(Packet):
    """MR-XH-001: 16 bytes, VA, R_Key, DMA Length."""
    name = "RETH"
    fields_desc = [XLongField("va", 0), XIntField("rkey", 0), IntField("dlen", 0)]

    def extract_padding(self, s):
        return b"", s


class ImmDt(Packet):
    """MR-XH-014: 4 bytes of immediate data."""
    name = "ImmDt"
    fields_desc = [XIntField("imm", 0)]

    def extract_padding(self, s):
        return b"", s


class IETH(Packet):
    """MR-XH-015: the R_Key to invalidate."""
    name = "IETH"
    fields_desc = [XIntField("rkey", 0)]

    def extract_padding(self, s):
        return b"", s


class AtomicETH(Packet):
    """MR-XH-010: 28 bytes, VA, R_Key, Swap/Add, Compare."""
    name = "AtomicETH"
    fields_desc = [XLongField("va", 0), XIntField("rkey", 0), XLongField("swap_add", 0), XLongField("compare", 0)]

    def extract_padding(self, s):
        return b"", s


class AtomicAckETH(Packet):
    """MR-XH-013: the original value, 8 bytes."""
    name = "AtomicAckETH"
    fields_desc = [XLongField("orig", 0)]

    def extract_padding(self, s):
        return b"", s


class AETHx(Packet):
    """AETH as an extension header inside a chain (scapy's AETH binds only to ACKNOWLEDGE)."""
    name = "AETH"
    fields_desc = AETH.fields_desc

    def extract_padding(self, s):
        return b"", s


HEADER_CLASSES = {"RETH": RETH, "ImmDt": ImmDt, "IETH": IETH, "AtomicETH": AtomicETH,
                  "AtomicAckETH": AtomicAckETH, "AETH": AETHx}
HEADER_LEN = {"RETH": 16, "ImmDt": 4, "IETH": 4, "AtomicETH": 28, "AtomicAckETH": 8, "AETH": 4, "CNPPAD": 16}


# ---- Table 2-1, compat opcodes (written from the spec text, not imported) -------------------
@dataclass(frozen=True)
class OpInfo:
    code: int
    name: str
    headers: tuple[str, ...]
    payload: str            # "none", "pmtu" (= PMTU), "1..pmtu", "0..pmtu"
    pos: str                # F M L O or -
    kind: str               # Req Rsp CNP


def _op(code, name, headers, payload, pos, kind):
    return code, OpInfo(code, name, tuple(headers), payload, pos, kind)


OPS: dict[int, OpInfo] = dict([
    _op(0x00, "SEND_FIRST", [], "pmtu", "F", "Req"),
    _op(0x01, "SEND_MIDDLE", [], "pmtu", "M", "Req"),
    _op(0x02, "SEND_LAST", [], "1..pmtu", "L", "Req"),
    _op(0x03, "SEND_LAST_WITH_IMMEDIATE", ["ImmDt"], "1..pmtu", "L", "Req"),
    _op(0x04, "SEND_ONLY", [], "0..pmtu", "O", "Req"),
    _op(0x05, "SEND_ONLY_WITH_IMMEDIATE", ["ImmDt"], "0..pmtu", "O", "Req"),
    _op(0x06, "RDMA_WRITE_FIRST", ["RETH"], "pmtu", "F", "Req"),
    _op(0x07, "RDMA_WRITE_MIDDLE", [], "pmtu", "M", "Req"),
    _op(0x08, "RDMA_WRITE_LAST", [], "1..pmtu", "L", "Req"),
    _op(0x09, "RDMA_WRITE_LAST_WITH_IMMEDIATE", ["ImmDt"], "1..pmtu", "L", "Req"),
    _op(0x0A, "RDMA_WRITE_ONLY", ["RETH"], "0..pmtu", "O", "Req"),
    _op(0x0B, "RDMA_WRITE_ONLY_WITH_IMMEDIATE", ["RETH", "ImmDt"], "0..pmtu", "O", "Req"),
    _op(0x0C, "RDMA_READ_REQUEST", ["RETH"], "none", "O", "Req"),
    _op(0x0D, "RDMA_READ_RESPONSE_FIRST", ["AETH"], "pmtu", "F", "Rsp"),
    _op(0x0E, "RDMA_READ_RESPONSE_MIDDLE", [], "pmtu", "M", "Rsp"),
    _op(0x0F, "RDMA_READ_RESPONSE_LAST", ["AETH"], "1..pmtu", "L", "Rsp"),
    _op(0x10, "RDMA_READ_RESPONSE_ONLY", ["AETH"], "0..pmtu", "O", "Rsp"),
    _op(0x11, "ACKNOWLEDGE", ["AETH"], "none", "O", "Rsp"),
    _op(0x12, "ATOMIC_ACKNOWLEDGE", ["AETH", "AtomicAckETH"], "none", "O", "Rsp"),
    _op(0x13, "COMPARE_SWAP", ["AtomicETH"], "none", "O", "Req"),
    _op(0x14, "FETCH_ADD", ["AtomicETH"], "none", "O", "Req"),
    _op(0x16, "SEND_LAST_WITH_INVALIDATE", ["IETH"], "1..pmtu", "L", "Req"),
    _op(0x17, "SEND_ONLY_WITH_INVALIDATE", ["IETH"], "0..pmtu", "O", "Req"),
    _op(0x81, "CNP", ["CNPPAD"], "none", "-", "CNP"),
])
BY_NAME = {o.name: o.code for o in OPS.values()}
# Opcodes of no table row of the compat profile (MR-OPC-003 / MR-OPC-004 material).
UNKNOWN_OPCODES = (0x15, 0x18, 0x1F, 0x20, 0x64, 0x80, 0xFF)
NATIVE_OPCODES = tuple(range(0xC0, 0xC7))


def opcode(op: int | str) -> int:
    return BY_NAME[op] if isinstance(op, str) else int(op)


def op_name(code: int) -> str:
    o = OPS.get(code)
    if o is not None:
        return o.name
    if 0xC0 <= code <= 0xC6:
        return ("NATIVE_SEND", "NATIVE_SEND_IMM", "NATIVE_WRITE", "NATIVE_WRITE_IMM", "NATIVE_READ_REQ",
                "NATIVE_READ_RESP", "NATIVE_SACK")[code - 0xC0]
    return f"OPCODE_{code:#04x}"


# ---- the ICRC (01-encapsulation.md section 8) -------------------------------------------
def _ip_offset(frame: bytes) -> tuple[int, int]:
    """(offset of the IP header, IP version) of an Ethernet frame, one 802.1Q tag allowed."""
    off, etype = 12, struct.unpack_from("!H", frame, 12)[0]
    if etype == 0x8100:
        off, etype = 16, struct.unpack_from("!H", frame, 16)[0]
    if etype == 0x0800:
        return off + 2, 4
    if etype == 0x86DD:
        return off + 2, 6
    raise ValueError(f"EtherType {etype:#06x} is neither IPv4 nor IPv6")


def icrc(frame: bytes) -> int:
    """The ICRC of a RoCEv2 frame as MR-ICRC-003 defines it (the frame's own ICRC bytes are not read).

    Covered: 8 bytes 0xFF; the IP header with TOS/Traffic Class, TTL/Hop Limit, the IPv4 header
    checksum and the IPv6 Flow Label set to ones; the UDP header with checksum 0xFFFF; the BTH
    with byte 4 (FECN, BECN, Resv6) 0xFF; the rest up to the ICRC as sent.  The end is found
    from the IP length (MR-ENC-007), so Ethernet padding is not covered (MR-ICRC-009).
    """
    ip, ver = _ip_offset(frame)
    if ver == 4:
        hdr = bytearray(frame[ip:ip + 20])
        total = struct.unpack_from("!H", hdr, 2)[0]
        hdr[1] = 0xFF                       # TOS
        hdr[8] = 0xFF                       # TTL
        hdr[10:12] = b"\xff\xff"            # header checksum
        end = ip + total
        udp = ip + 20
    else:
        hdr = bytearray(frame[ip:ip + 40])
        plen = struct.unpack_from("!H", hdr, 4)[0]
        hdr[0] |= 0x0F                      # traffic class (low nibble of byte 0, high of byte 1)
        hdr[1] = 0xFF
        hdr[2:4] = b"\xff\xff"              # rest of the flow label
        hdr[7] = 0xFF                       # hop limit
        end = ip + 40 + plen
        udp = ip + 40
    u = bytearray(frame[udp:udp + 8])
    u[6:8] = b"\xff\xff"
    bth = bytearray(frame[udp + 8:udp + 20])
    bth[4] = 0xFF
    data = b"\xff" * 8 + bytes(hdr) + bytes(u) + bytes(bth) + frame[udp + 20:end - 4]
    return zlib.crc32(data) & 0xFFFFFFFF


def icrc_bytes(value: int) -> bytes:
    """MR-ICRC-010: least significant byte first."""
    return struct.pack("<I", value)


def _ip_end(frame: bytes) -> int:
    ip, ver = _ip_offset(frame)
    if ver == 4:
        return ip + struct.unpack_from("!H", frame, ip + 2)[0]
    return ip + 40 + struct.unpack_from("!H", frame, ip + 4)[0]


def ipv4_checksum(hdr: bytes) -> int:
    s = sum(struct.unpack("!10H", hdr[:10] + b"\0\0" + hdr[12:20]))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def refresh(frame: bytes, *, ip_csum: bool = True, icrc_: bool = True) -> bytes:
    """The frame with its IPv4 header checksum and its ICRC recomputed, after a byte-level edit
    (so that a case tests the field it changed, not a checksum it broke on the way)."""
    b = bytearray(frame)
    ip, ver = _ip_offset(frame)
    if ver == 4 and ip_csum:
        struct.pack_into("!H", b, ip + 10, ipv4_checksum(bytes(b[ip:ip + 20])))
    if icrc_:
        end = min(_ip_end(bytes(b)), len(b))
        if end >= 4:
            b[end - 4:end] = icrc_bytes(icrc(bytes(b)))
    return bytes(b)


# ---- building --------------------------------------------------------------------------
def build(op: int | str, *, src_mac: str, dst_mac: str, src_ip: str, dst_ip: str, dqpn: int, psn: int,
          sport: int = 0xC000, ackreq: bool = False, se: bool = False, migreq: bool = False, pkey: int = 0xFFFF,
          tver: int = 0, fecn: bool = False, becn: bool = False, resv6: int = 0, resv7: int = 0,
          padcount: int | None = None, tos: int = 0x6A, ttl: int = 64, ip_id: int = 0, vlan: int | None = None,
          reth: tuple | None = None, imm: int | None = None, ieth: int | None = None, aeth: tuple | None = None,
          atomic: tuple | None = None, atomic_ack: int | None = None, headers: bytes | None = None,
          payload: bytes = b"", pad: bytes | None = None, bad_icrc: bool = False) -> bytes:
    """One RoCEv2 frame.  Extension headers follow the opcode's Table 2-1 row from the keyword
    arguments (reth=(va, rkey, dlen), imm=, ieth=rkey, aeth=(syndrome, msn),
    atomic=(va, rkey, swap_add, compare), atomic_ack=orig); `headers` gives raw bytes instead
    (for malformed cases, or an opcode the table does not know).  PadCnt and the pad follow
    MR-ENC-026 unless `padcount` / `pad` say otherwise.  The ICRC is computed here (MR-ICRC-003);
    bad_icrc flips its lowest bit."""
    code = opcode(op)
    info = OPS.get(code)
    if headers is None:
        hb = b""
        for h in (info.headers if info else ()):
            if h == "RETH":
                va, rkey, dlen = reth if reth is not None else (0, 0, 0)
                hb += bytes(RETH(va=va, rkey=rkey, dlen=dlen))
            elif h == "ImmDt":
                hb += bytes(ImmDt(imm=imm or 0))
            elif h == "IETH":
                hb += bytes(IETH(rkey=ieth or 0))
            elif h == "AETH":
                syn, msn = aeth if aeth is not None else (0x1F, 0)
                hb += bytes(AETHx(syndrome=syn, msn=msn))
            elif h == "AtomicETH":
                va, rkey, sa, cmp_ = atomic if atomic is not None else (0, 0, 0, 0)
                hb += bytes(AtomicETH(va=va, rkey=rkey, swap_add=sa, compare=cmp_))
            elif h == "AtomicAckETH":
                hb += bytes(AtomicAckETH(orig=atomic_ack or 0))
            elif h == "CNPPAD":
                hb += bytes(16)
        headers = hb
    npad = (-len(payload)) & 3
    if pad is None:
        pad = bytes(npad)
    if padcount is None:
        padcount = len(pad)
    eth = Ether(src=src_mac, dst=dst_mac)
    if vlan is not None:
        eth = eth / Dot1Q(vlan=vlan)
    if ":" in dst_ip:
        ipl = IPv6(src=src_ip, dst=dst_ip, tc=tos, hlim=ttl)
        udp = UDP(sport=sport, dport=ROCE_PORT)
    else:
        ipl = IP(src=src_ip, dst=dst_ip, tos=tos, ttl=ttl, id=ip_id, flags="DF")
        udp = UDP(sport=sport, dport=ROCE_PORT, chksum=0)       # MR-ENC-023
    bth = BTH(opcode=code, solicited=int(se), migreq=int(migreq), padcount=padcount, version=tver, pkey=pkey,
              fecn=int(fecn), becn=int(becn), resv6=resv6, dqpn=dqpn, ackreq=int(ackreq), resv7=resv7,
              psn=psn & 0xFFFFFF, icrc=0)
    body = headers + payload + pad
    pkt = eth / ipl / udp / bth
    if body:
        pkt = pkt / Raw(body)
    frame = bytes(pkt)
    if ":" in dst_ip:                    # the UDP checksum covers the ICRC (MR-ICRC-012): redo it after
        frame = refresh(frame)
        p6 = Ether(frame)
        p6[UDP].chksum = None
        frame = bytes(p6)
        return frame
    frame = refresh(frame, ip_csum=False)
    if bad_icrc:
        b = bytearray(frame)
        b[-4] ^= 0x01
        frame = bytes(b)
    return frame


# ---- parsing ---------------------------------------------------------------------------
@dataclass
class RoceView:
    """One RoCEv2 packet as the tester reads it (fields named as in 02-headers.md)."""
    pkt: Any                                  # the scapy Ether
    src_mac: str
    dst_mac: str
    src_ip: str
    dst_ip: str
    sport: int
    tos: int
    op: int
    se: int
    migreq: int
    pad: int
    tver: int
    pkey: int
    fecn: int
    becn: int
    resv6: int
    dqpn: int
    ackreq: int
    resv7: int
    psn: int
    icrc: int
    icrc_ok: bool
    headers: dict = field(default_factory=dict)   # "RETH" -> scapy layer ...
    payload: bytes = b""
    malformed: str = ""                           # why the extension headers did not fit, if they did not

    @property
    def name(self) -> str:
        return op_name(self.op)

    @property
    def ecn(self) -> int:
        return self.tos & 3

    @property
    def aeth(self):
        return self.headers.get("AETH")

    @property
    def syndrome(self) -> int | None:
        a = self.aeth
        return None if a is None else int(a.syndrome)

    @property
    def msn(self) -> int | None:
        a = self.aeth
        return None if a is None else int(a.msn)

    @property
    def ack_kind(self) -> str | None:
        """"ACK", "RNR", "NAK" or "RESERVED" from the AETH syndrome's type bits (MR-XH-007)."""
        s = self.syndrome
        if s is None:
            return None
        if s & 0x80:
            return "RESERVED"
        return ("ACK", "RNR", "RESERVED", "NAK")[(s >> 5) & 3]

    @property
    def nak_code(self) -> int | None:
        return (self.syndrome & 0x1F) if self.ack_kind == "NAK" else None

    def summary(self) -> str:
        s = f"{self.name} dqpn={self.dqpn:#08x} psn={self.psn:#08x}"
        if self.ackreq:
            s += " A"
        if self.se:
            s += " SE"
        a = self.aeth
        if a is not None:
            kind = self.ack_kind
            s += f" AETH {kind}({self.syndrome:#04x}) msn={self.msn}"
        r = self.headers.get("RETH")
        if r is not None:
            s += f" RETH va={int(r.va):#x} rkey={int(r.rkey):#x} len={int(r.dlen)}"
        if "ImmDt" in self.headers:
            s += f" imm={int(self.headers['ImmDt'].imm):#x}"
        if "AtomicAckETH" in self.headers:
            s += f" orig={int(self.headers['AtomicAckETH'].orig):#x}"
        if self.payload:
            s += f" payload={len(self.payload)}B"
        if not self.icrc_ok:
            s += " BAD-ICRC"
        if self.malformed:
            s += f" MALFORMED({self.malformed})"
        return s


def parse(frame: bytes) -> RoceView | None:
    """A RoCEv2 packet (UDP destination port 4791) read from a frame; None for anything else."""
    try:
        pkt = Ether(frame)
    except Exception:           # noqa: BLE001 - a frame scapy cannot read is not ours to judge
        return None
    if UDP not in pkt or pkt[UDP].dport != ROCE_PORT or BTH not in pkt:
        return None
    ipl = pkt[IP] if IP in pkt else pkt[IPv6]
    tos = int(ipl.tos) if IP in pkt else int(ipl.tc)
    b = pkt[BTH]
    code = int(b.opcode)
    rest = bytes(b.payload)
    if b.payload.__class__.__name__ == "Padding":
        rest = b""
    info = OPS.get(code)
    headers: dict = {}
    malformed = ""
    if info is not None:
        for h in info.headers:
            n = HEADER_LEN[h]
            if len(rest) < n:
                malformed = f"{h} truncated"
                break
            if h != "CNPPAD":
                headers[h] = HEADER_CLASSES[h](rest[:n])
            rest = rest[n:]
    pad = int(b.padcount)
    payload = rest[:len(rest) - pad] if pad <= len(rest) else b""
    try:
        end = _ip_end(frame)
        got = struct.unpack("<I", frame[end - 4:end])[0]        # MR-ICRC-010: LSB first
        ok = len(frame) >= end and icrc(frame) == got
    except Exception:           # noqa: BLE001
        got, ok = 0, False
    return RoceView(pkt=pkt, src_mac=pkt[Ether].src, dst_mac=pkt[Ether].dst, src_ip=ipl.src, dst_ip=ipl.dst,
                    sport=int(pkt[UDP].sport), tos=tos, op=code, se=int(b.solicited), migreq=int(b.migreq),
                    pad=pad, tver=int(b.version), pkey=int(b.pkey), fecn=int(b.fecn), becn=int(b.becn),
                    resv6=int(b.resv6), dqpn=int(b.dqpn), ackreq=int(b.ackreq), resv7=int(b.resv7),
                    psn=int(b.psn), icrc=got, icrc_ok=ok, headers=headers, payload=payload,
                    malformed=malformed)


def psn_add(a: int, n: int) -> int:
    return (a + n) & 0xFFFFFF


def psn_before(a: int, b: int) -> bool:
    """README section 4: a is before b when (b - a) mod 2^24 is in [1, 2^23)."""
    return 1 <= ((b - a) & 0xFFFFFF) < (1 << 23)


__all__ = ["AETHx", "AtomicAckETH", "AtomicETH", "IETH", "ImmDt", "NATIVE_OPCODES", "OPS", "OpInfo", "RETH",
           "RoceView", "UNKNOWN_OPCODES", "build", "icrc", "icrc_bytes", "op_name", "opcode", "parse", "psn_add",
           "psn_before", "refresh"]
