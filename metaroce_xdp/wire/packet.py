"""Whole MetaRoCE frames: encode and decode (spec 01-encapsulation, 02-headers).

`RocePacket` is the decoded view of one frame.  `decode(frame)` returns one or
raises `MalformedPacket` (or its subclass `NotMetaRoCE` for frames that are
well-formed but not UDP/4791).  `encode(...)` builds a frame and fills every
derived field: lengths, pad count, IPv4 header checksum, UDP checksum (IPv6;
IPv4 when asked) and the ICRC.

This is the reference codec: clear rather than fast.  The data path builds
frames with the compiled builder in `fastpath.py`, which tests check against
this module byte for byte.
"""
from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass, field
from typing import Any

from .errors import DecodeReason as R
from .errors import EncodeError, MalformedPacket, NotMetaRoCE
from .fields import Header
from .headers import (AETH, BTH, ETH_P_8021Q, ETH_P_IP, ETH_P_IPV6, EXT_CLASSES, ICRC_SIZE,
                      IPPROTO_UDP, ROCE_UDP_PORT, SACK_MAX_WORDS, SACKETH, UDP, Ethernet,
                      IPv4, IPv6, Vlan, aeth_syndrome_kind, describe_syndrome)
from .icrc import icrc_bytes, icrc_ref
from .opcodes import OPCODES, OpInfo, OpMask, opcode_name


# ---- small helpers --------------------------------------------------------
def mac_to_int(mac: str | int | bytes) -> int:
    if isinstance(mac, int):
        return mac
    if isinstance(mac, (bytes, bytearray)):
        if len(mac) != 6:
            raise EncodeError(f"MAC must be 6 bytes, got {len(mac)}")
        return int.from_bytes(mac, "big")
    parts = mac.replace("-", ":").split(":")
    if len(parts) != 6:
        raise EncodeError(f"bad MAC address {mac!r}")
    try:
        return int("".join(f"{int(p, 16):02x}" for p in parts), 16)
    except ValueError:
        raise EncodeError(f"bad MAC address {mac!r}") from None


def mac_str(v: int) -> str:
    return ":".join(f"{b:02x}" for b in v.to_bytes(6, "big"))


def inet_checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def udp_checksum_v6(src: int, dst: int, udp_bytes: bytes) -> int:
    pseudo = src.to_bytes(16, "big") + dst.to_bytes(16, "big") + struct.pack("!IxxxB", len(udp_bytes), IPPROTO_UDP)
    c = inet_checksum(pseudo + udp_bytes)
    return c or 0xFFFF


def udp_checksum_v4(src: int, dst: int, udp_bytes: bytes) -> int:
    pseudo = struct.pack("!IIxBH", src, dst, IPPROTO_UDP, len(udp_bytes))
    c = inet_checksum(pseudo + udp_bytes)
    return c or 0xFFFF


# ---- the decoded packet ----------------------------------------------------
@dataclass
class RocePacket:
    eth: Ethernet
    ip: IPv4 | IPv6
    udp: UDP
    bth: BTH
    ext: dict[str, Header] = field(default_factory=dict)   # extension headers in wire order
    payload: bytes = b""
    vlan: Vlan | None = None
    sack_bitmap: tuple[int, ...] = ()                       # 32-bit words after SACKETH
    icrc: int = 0                                           # as carried on the wire
    icrc_ok: bool | None = None                             # None: not verified
    pad_bytes: bytes = b""
    frame_len: int = 0

    @property
    def ipv6(self) -> bool:
        return isinstance(self.ip, IPv6)

    @property
    def op(self) -> OpInfo:
        return OPCODES[self.bth.opcode]

    def __getattr__(self, name: str) -> Any:
        # pkt.reth, pkt.aeth ... -> the extension header or None
        if name in EXT_CLASSES:
            return self.ext.get(name)
        raise AttributeError(name)

    def sack_received_psns(self) -> list[int]:
        """PSNs the SACK bitmap reports received (MR-XH-029): bit i <-> BTH.PSN + 2 + i.

        BTH.PSN is the cumulative PSN and BTH.PSN + 1 the first missing one, so
        bit 0 stands for the PSN after that."""
        out = []
        base = self.bth.psn
        for w, word in enumerate(self.sack_bitmap):
            for b in range(32):
                if word & (1 << (31 - b)):
                    out.append((base + 2 + w * 32 + b) & 0xFFFFFF)
        return out

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (the `metaroce decode --json` schema)."""
        b = self.bth
        d: dict[str, Any] = {
            "opcode": b.opcode,
            "opcode_name": opcode_name(b.opcode),
            "profile": "native" if self.op.has(OpMask.NATIVE) else "compat",
            "dest_qp": b.dest_qp,
            "psn": b.psn,
            "ack_req": b.ack_req,
            "se": b.se,
            "m": b.m,
            "pad": b.pad,
            "tver": b.tver,
            "pkey": b.pkey,
            "fecn": b.fecn,
            "becn": b.becn,
            "icrc": f"{self.icrc:08x}",
            "icrc_ok": self.icrc_ok,
            "payload_len": len(self.payload),
            "frame_len": self.frame_len,
            "eth": {"src": mac_str(self.eth.src), "dst": mac_str(self.eth.dst)},
            "udp": {"sport": self.udp.sport, "dport": self.udp.dport, "length": self.udp.length,
                    "checksum": self.udp.checksum},
        }
        if self.vlan is not None:
            d["vlan"] = {"vid": self.vlan.vid, "pcp": self.vlan.pcp, "dei": self.vlan.dei}
        if self.ipv6:
            ip = self.ip
            d["ip"] = {"version": 6, "src": str(ipaddress.IPv6Address(ip.src)),
                       "dst": str(ipaddress.IPv6Address(ip.dst)),
                       "dscp": ip.traffic_class >> 2, "ecn": ip.traffic_class & 3,
                       "flow_label": ip.flow_label, "hop_limit": ip.hop_limit}
        else:
            ip = self.ip
            d["ip"] = {"version": 4, "src": str(ipaddress.IPv4Address(ip.src)),
                       "dst": str(ipaddress.IPv4Address(ip.dst)), "dscp": ip.dscp, "ecn": ip.ecn,
                       "ttl": ip.ttl, "ident": ip.ident, "df": (ip.flags >> 1) & 1}
        for name, h in self.ext.items():
            hd = h.as_dict()
            if name == "aeth":
                hd["kind"] = aeth_syndrome_kind(h.syndrome)
                hd["value"] = h.syndrome & 0x1F
                hd["text"] = describe_syndrome(h.syndrome)
            elif name == "cnp":
                hd = {"resv": f"{h.resv:032x}"}
            elif name == "sacketh":
                hd["bitmap"] = [f"{w:08x}" for w in self.sack_bitmap]
                hd["received_psns"] = self.sack_received_psns()
            elif name == "neth":
                hd["first"] = bool(h.flags & 0x80)
                hd["last"] = bool(h.flags & 0x40)
                hd["retx"] = bool(h.flags & 0x20)
            d[name] = hd
        return d


# ---- decode ----------------------------------------------------------------
def decode(frame: bytes | bytearray | memoryview, verify_icrc: bool = True) -> RocePacket:
    """Decode one Ethernet frame.  Raises NotMetaRoCE or MalformedPacket."""
    buf = bytes(frame)
    n = len(buf)
    if n < Ethernet.SIZE:
        raise NotMetaRoCE(R.TRUNCATED_ETH, f"{n} bytes", 0)
    eth = Ethernet.unpack(buf, 0)
    off = Ethernet.SIZE
    ethertype = eth.ethertype
    vlan = None
    if ethertype == ETH_P_8021Q:
        if n < off + Vlan.SIZE:
            raise NotMetaRoCE(R.TRUNCATED_ETH, "truncated VLAN tag", off)
        vlan = Vlan.unpack(buf, off)
        ethertype = vlan.ethertype
        off += Vlan.SIZE
    l3 = off
    if ethertype == ETH_P_IP:
        if n < off + IPv4.SIZE:
            raise NotMetaRoCE(R.TRUNCATED_IP, "truncated IPv4 header", off)
        ip = IPv4.unpack(buf, off)
        if ip.version != 4 or ip.ihl < 5:
            raise NotMetaRoCE(R.BAD_IP_HEADER, f"version {ip.version} ihl {ip.ihl}", off)
        if ip.protocol != IPPROTO_UDP:
            raise NotMetaRoCE(R.NOT_UDP, f"IP protocol {ip.protocol}", off)
        if ip.total_length < ip.ihl * 4 or l3 + ip.total_length > n:
            raise MalformedPacket(R.BAD_IP_HEADER, f"total length {ip.total_length}, {n - l3} bytes present", off)
        if ip.frag_offset or ip.flags & 1:
            raise MalformedPacket(R.IP_FRAGMENT, "fragmented IPv4", off)
        if ip.ihl != 5:
            # Options would shift the UDP header; RoCEv2 and MR-ENC-009 forbid them.
            raise MalformedPacket(R.IP_OPTIONS, f"ihl {ip.ihl}", off)
        end = l3 + ip.total_length          # drops Ethernet padding of short frames (MR-ENC-007)
        off += IPv4.SIZE
    elif ethertype == ETH_P_IPV6:
        if n < off + IPv6.SIZE:
            raise NotMetaRoCE(R.TRUNCATED_IP, "truncated IPv6 header", off)
        ip = IPv6.unpack(buf, off)
        if ip.version != 6:
            raise NotMetaRoCE(R.BAD_IP_HEADER, f"version {ip.version}", off)
        if ip.next_header != IPPROTO_UDP:
            raise NotMetaRoCE(R.NOT_UDP, f"next header {ip.next_header}", off)
        if l3 + IPv6.SIZE + ip.payload_length > n:
            raise MalformedPacket(R.BAD_IP_HEADER, f"payload length {ip.payload_length}, {n - l3 - 40} present", off)
        end = l3 + IPv6.SIZE + ip.payload_length
        off += IPv6.SIZE
    else:
        raise NotMetaRoCE(R.NOT_IP, f"ethertype {ethertype:#06x}", Ethernet.SIZE - 2)
    if end < off + UDP.SIZE:
        raise NotMetaRoCE(R.TRUNCATED_UDP, "truncated UDP header", off)
    udp = UDP.unpack(buf, off)
    if udp.dport != ROCE_UDP_PORT:
        raise NotMetaRoCE(R.NOT_ROCE_PORT, f"UDP port {udp.dport}", off)
    if udp.length != end - off:
        raise MalformedPacket(R.BAD_UDP_LENGTH, f"UDP length {udp.length}, IP says {end - off}", off)
    off += UDP.SIZE
    if end < off + BTH.SIZE + ICRC_SIZE:
        raise MalformedPacket(R.TRUNCATED_BTH, f"{end - off} bytes after UDP", off)
    bth = BTH.unpack(buf, off)
    if bth.tver != 0:
        raise MalformedPacket(R.BAD_TVER, f"TVer {bth.tver}", off)
    op = OPCODES.get(bth.opcode)
    if op is None:
        raise MalformedPacket(R.UNKNOWN_OPCODE, f"opcode {bth.opcode:#04x}", off)
    icrc_off = end - ICRC_SIZE
    bth_off = off
    off += BTH.SIZE
    ext: dict[str, Header] = {}
    bitmap: tuple[int, ...] = ()
    for name in op.headers:
        cls = EXT_CLASSES[name]
        if off + cls.SIZE > icrc_off:
            raise MalformedPacket(R.TRUNCATED_EXT, f"{op.name} needs {cls.NAME}", off)
        h = cls.unpack(buf, off)
        ext[name] = h
        off += cls.SIZE
        if name == "sacketh":
            if h.bitmap_words > SACK_MAX_WORDS:
                raise MalformedPacket(R.BAD_FIELD, f"SACK bitmap_words {h.bitmap_words} > {SACK_MAX_WORDS}", off)
            blen = 4 * h.bitmap_words
            if off + blen > icrc_off:
                raise MalformedPacket(R.TRUNCATED_EXT, "SACK bitmap", off)
            bitmap = struct.unpack_from(f"!{h.bitmap_words}I", buf, off)
            off += blen
    rest = icrc_off - off
    if not op.has(OpMask.PAYLOAD):
        if rest != 0 or bth.pad:
            raise MalformedPacket(R.BAD_PAD, f"{op.name} carries no payload, found {rest} bytes, pad {bth.pad}", off)
        payload, pad_bytes = b"", b""
    else:
        if rest % 4:
            raise MalformedPacket(R.BAD_PAD, f"payload + pad = {rest} bytes, not a multiple of 4", off)
        if bth.pad > rest:
            raise MalformedPacket(R.BAD_PAD, f"pad count {bth.pad} > {rest} bytes", off)
        payload = buf[off:icrc_off - bth.pad]
        pad_bytes = buf[icrc_off - bth.pad:icrc_off]
    icrc = int.from_bytes(buf[icrc_off:end], "little")
    ok = None
    if verify_icrc:
        ok = icrc_ref(memoryview(buf)[l3:icrc_off], isinstance(ip, IPv6)) == icrc
    del bth_off
    return RocePacket(eth=eth, ip=ip, udp=udp, bth=bth, ext=ext, payload=payload, vlan=vlan,
                      sack_bitmap=bitmap, icrc=icrc, icrc_ok=ok, pad_bytes=pad_bytes, frame_len=n)


# ---- encode ----------------------------------------------------------------
def _ip_int(addr: str | int | ipaddress.IPv4Address | ipaddress.IPv6Address) -> tuple[int, int]:
    if isinstance(addr, int):
        return addr, (6 if addr >> 32 else 4)
    a = ipaddress.ip_address(str(addr)) if not isinstance(addr, (ipaddress.IPv4Address, ipaddress.IPv6Address)) else addr
    return int(a), a.version


def encode(opcode: int, *, src_mac: Any = "02:00:00:00:00:01", dst_mac: Any = "02:00:00:00:00:02",
           src_ip: Any = "10.55.0.1", dst_ip: Any = "10.55.0.2", sport: int = 49152,
           dport: int = ROCE_UDP_PORT, dest_qp: int = 0, psn: int = 0, ack_req: int = 0, se: int = 0,
           m: int = 0, pkey: int = 0xFFFF, fecn: int = 0, becn: int = 0, tver: int = 0,
           payload: bytes = b"", headers: dict[str, Header] | None = None,
           sack_bitmap: tuple[int, ...] | list[int] = (), vlan: Vlan | None = None,
           dscp: int = 0, ecn: int = 0, ttl: int = 64, ident: int = 0, df: bool = True,
           flow_label: int = 0, udp_checksum: bool | None = None, pad: int | None = None,
           icrc: int | None = None) -> bytes:
    """Build one frame.  `headers` maps extension-header names (reth, aeth, ...)
    to Header objects; the opcode decides which are required.

    `udp_checksum`: None = compute on IPv6, zero on IPv4 (MR-ENC-023, MR-ENC-024); True/False force.
    `pad`: None = pad payload to a multiple of 4; `icrc`: None = compute.
    """
    op = OPCODES.get(opcode)
    if op is None:
        raise EncodeError(f"unknown opcode {opcode:#x}")
    headers = dict(headers or {})
    if op.has(OpMask.SACKETH) and "sacketh" not in headers:
        headers["sacketh"] = SACKETH(bitmap_words=len(sack_bitmap))
    if op.has(OpMask.RSNETH) and "rsneth" not in headers:
        headers["rsneth"] = EXT_CLASSES["rsneth"]()
    if op.has(OpMask.CNP) and "cnp" not in headers:
        headers["cnp"] = EXT_CLASSES["cnp"]()
    missing = [h for h in op.headers if h not in headers]
    extra = [h for h in headers if h not in op.headers]
    if missing or extra:
        raise EncodeError(f"{op.name} takes headers {list(op.headers)}; missing {missing}, unexpected {extra}")
    if payload and not op.has(OpMask.PAYLOAD):
        raise EncodeError(f"{op.name} carries no payload")
    if op.has(OpMask.SACKETH) and headers["sacketh"].bitmap_words != len(sack_bitmap):
        raise EncodeError("sacketh.bitmap_words must equal len(sack_bitmap)")
    if pad is None:
        pad = (-len(payload)) & 3
    src, v = _ip_int(src_ip)
    dst, v2 = _ip_int(dst_ip)
    if v != v2:
        raise EncodeError("source and destination IP versions differ")
    bth = BTH(opcode=opcode, se=se, m=m, pad=pad, tver=tver, pkey=pkey, fecn=fecn, becn=becn,
              dest_qp=dest_qp, ack_req=ack_req, psn=psn)
    l4 = bytearray(bth.pack())
    for name in op.headers:
        l4 += headers[name].pack()
        if name == "sacketh":
            l4 += b"".join(w.to_bytes(4, "big") for w in sack_bitmap)
    l4 += payload + b"\0" * pad
    udp_len = UDP.SIZE + len(l4) + ICRC_SIZE
    udp = UDP(sport=sport, dport=dport, length=udp_len, checksum=0)
    if v == 4:
        flags = 0b010 if df else 0
        ip = IPv4(dscp=dscp, ecn=ecn, total_length=IPv4.SIZE + udp_len, ident=ident, flags=flags,
                  ttl=ttl, src=src, dst=dst)
        ip = ip.replace(checksum=inet_checksum(ip.pack()))
        ethertype = ETH_P_IP
    else:
        ip = IPv6(traffic_class=(dscp << 2) | ecn, flow_label=flow_label, payload_length=udp_len,
                  hop_limit=ttl, src=src, dst=dst)
        ethertype = ETH_P_IPV6
    l3 = ip.pack() + udp.pack() + bytes(l4)
    if icrc is None:
        icrc = icrc_ref(l3, v == 6)
    udp_bytes = udp.pack() + bytes(l4) + icrc_bytes(icrc)
    # the UDP checksum covers the ICRC, so it comes second (MR-ENC-025, MR-ICRC-012)
    want_csum = (v == 6) if udp_checksum is None else udp_checksum
    if want_csum:
        csum = (udp_checksum_v6 if v == 6 else udp_checksum_v4)(src, dst, udp_bytes)
        udp_bytes = udp.replace(checksum=csum).pack() + udp_bytes[UDP.SIZE:]
    if vlan is not None:
        l2 = Ethernet(dst=mac_to_int(dst_mac), src=mac_to_int(src_mac), ethertype=ETH_P_8021Q).pack()
        l2 += vlan.replace(ethertype=ethertype).pack()
    else:
        l2 = Ethernet(dst=mac_to_int(dst_mac), src=mac_to_int(src_mac), ethertype=ethertype).pack()
    return l2 + ip.pack() + udp_bytes


def encode_packet(pkt: RocePacket, recompute: bool = True) -> bytes:
    """Re-encode a decoded packet (round trip).  With recompute=False the ICRC
    and UDP checksum are kept as carried, so a corrupt packet stays corrupt."""
    ip = pkt.ip
    v6 = pkt.ipv6
    kw: dict[str, Any] = dict(
        src_mac=pkt.eth.src, dst_mac=pkt.eth.dst, src_ip=ipaddress.ip_address(ip.src) if not v6 else ipaddress.IPv6Address(ip.src),
        dst_ip=ipaddress.ip_address(ip.dst) if not v6 else ipaddress.IPv6Address(ip.dst),
        sport=pkt.udp.sport, dport=pkt.udp.dport, dest_qp=pkt.bth.dest_qp, psn=pkt.bth.psn,
        ack_req=pkt.bth.ack_req, se=pkt.bth.se, m=pkt.bth.m, pkey=pkt.bth.pkey, fecn=pkt.bth.fecn,
        becn=pkt.bth.becn, tver=pkt.bth.tver, payload=pkt.payload, headers=dict(pkt.ext),
        sack_bitmap=pkt.sack_bitmap, vlan=pkt.vlan, pad=pkt.bth.pad,
        icrc=None if recompute else pkt.icrc)
    if v6:
        kw.update(dscp=ip.traffic_class >> 2, ecn=ip.traffic_class & 3, ttl=ip.hop_limit, flow_label=ip.flow_label,
                  udp_checksum=True if recompute else False)
    else:
        kw.update(dscp=ip.dscp, ecn=ip.ecn, ttl=ip.ttl, ident=ip.ident, df=bool(ip.flags & 2),
                  udp_checksum=bool(pkt.udp.checksum))
    out = encode(pkt.bth.opcode, **kw)
    if not recompute and v6 and pkt.udp.checksum:
        # keep the carried checksum byte for byte
        l4 = Ethernet.SIZE + (Vlan.SIZE if pkt.vlan else 0) + IPv6.SIZE
        out = out[:l4 + 6] + pkt.udp.checksum.to_bytes(2, "big") + out[l4 + 8:]
    if pkt.pad_bytes and pkt.pad_bytes != b"\0" * len(pkt.pad_bytes):
        raise EncodeError("non-zero pad bytes cannot be re-encoded")
    return out
