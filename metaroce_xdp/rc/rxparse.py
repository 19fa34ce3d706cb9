"""Received frame -> RxPkt: the fields the transport needs, payload as a view.

The XDP program has already parsed and validated Ethernet/IP/UDP/BTH for
frames that reach an AF_XDP socket, and the engine checks the ICRC with the
compiled `frame_icrc_ok`, so this parser is lean.  It repeats the header
checks the XDP program makes before the BTH that the in-process ports (no XDP
program) would otherwise skip: one 802.1Q tag at most (802.1ad is not IP to
us, MR-ENC-005), IPv4 IHL 5 and header checksum (MR-ENC-009, MR-ENC-013),
IPv6 Next Header 17 (MR-ENC-015).  It reads the headers the
opcode table says are present and leaves the payload in place (a numpy view
into the receive buffer, valid until the frame is released).
"""
from __future__ import annotations

import struct

import numpy as np

from ..wire.errors import DecodeReason as R
from ..wire.errors import MalformedPacket
from ..wire.opcodes import OPCODES, OpInfo

_U32 = struct.Struct("!I")
_U64 = struct.Struct("!Q")
_RETH = struct.Struct("!QII")
_ATOM = struct.Struct("!QIQQ")
_NETH = struct.Struct("!IIII")
_IP4_WORDS = struct.Struct("!10H")


def ip4_csum_ok(hdr: bytes) -> bool:
    """MR-ENC-013: the one's complement sum of the 20-byte IPv4 header, its checksum
    included, is 0xFFFF (as mr_ip4_csum_ok() in bpf/metaroce_xdp.c)."""
    s = sum(_IP4_WORDS.unpack(hdr))
    s = (s & 0xFFFF) + (s >> 16)
    s = (s & 0xFFFF) + (s >> 16)
    return s == 0xFFFF


class RxPkt:
    __slots__ = ("op", "opcode", "psn", "dest_qp", "ack_req", "se", "becn", "fecn", "src_ip", "ipv6",
                 "sport", "ecn", "va", "rkey", "dma_len", "syndrome", "msn", "swap_add", "compare",
                 "orig", "imm", "ieth", "neth", "payload", "frame_len", "pkey")

    def __init__(self) -> None:
        self.imm = None
        self.ieth = None
        self.neth = None

    def __repr__(self) -> str:
        return f"RxPkt({self.op.name} qp={self.dest_qp:#x} psn={self.psn} len={len(self.payload)})"


def pkey_match(pkt: int, mine: int) -> bool:
    """MR-BTH-010 (as mr_pkey_ok() in bpf/metaroce_xdp.c): low 15 bits equal and one of the two
    keys a full member; a key with low 15 bits 0 (0x0000, 0x8000) is IBTA's invalid P_Key."""
    return bool(pkt & 0x7FFF) and not (pkt ^ mine) & 0x7FFF and bool((pkt | mine) & 0x8000)


def parse(frame: np.ndarray) -> RxPkt:
    """Parse one frame (uint8 array).  Raises MalformedPacket."""
    n = len(frame)
    head = bytes(frame[:min(n, 128)])
    off = 14
    et = (head[12] << 8) | head[13]
    if et == 0x8100:
        et = (head[16] << 8) | head[17]
        off = 18
    p = RxPkt()
    if et == 0x0800:
        if n < off + 20:
            raise MalformedPacket(R.TRUNCATED_IP)
        if head[off] != 0x45:
            raise MalformedPacket(R.IP_OPTIONS if head[off] >> 4 == 4 else R.BAD_IP_HEADER)
        if not ip4_csum_ok(head[off:off + 20]):
            raise MalformedPacket(R.BAD_IP_CSUM)      # MR-ENC-013, the XDP program's BAD_IP_CSUM
        end = off + ((head[off + 2] << 8) | head[off + 3])
        p.src_ip = int.from_bytes(head[off + 12:off + 16], "big")
        p.ecn = head[off + 1] & 3
        p.ipv6 = False
        off += 20
    elif et == 0x86DD:
        if n < off + 40:
            raise MalformedPacket(R.TRUNCATED_IP)
        if head[off + 6] != 17:
            raise MalformedPacket(R.IP_OPTIONS)       # MR-ENC-015: no extension headers
        end = off + 40 + ((head[off + 4] << 8) | head[off + 5])
        p.src_ip = int.from_bytes(bytes(frame[off + 8:off + 24]), "big")
        p.ecn = (head[off + 1] >> 4) & 3
        p.ipv6 = True
        off += 40
    else:
        raise MalformedPacket(R.NOT_IP)
    if end > n or end < off + 8 + 12 + 4:
        raise MalformedPacket(R.TRUNCATED_BTH)
    p.sport = (head[off] << 8) | head[off + 1]
    off += 8
    b = bytes(frame[off:off + 12]) if off + 12 > len(head) else head[off:off + 12]
    opcode = b[0]
    op: OpInfo | None = OPCODES.get(opcode)
    if op is None:
        raise MalformedPacket(R.UNKNOWN_OPCODE)
    p.op = op
    p.opcode = opcode
    p.se = b[1] >> 7
    pad = (b[1] >> 4) & 3
    p.pkey = (b[2] << 8) | b[3]
    p.fecn = b[4] >> 7
    p.becn = (b[4] >> 6) & 1
    p.dest_qp = (b[5] << 16) | (b[6] << 8) | b[7]
    p.ack_req = b[8] >> 7
    p.psn = (b[9] << 16) | (b[10] << 8) | b[11]
    icrc_off = end - 4
    hoff = off + op.hdr_len
    if hoff > icrc_off:
        raise MalformedPacket(R.TRUNCATED_EXT)
    hb = bytes(frame[off:hoff])
    offs = op.offsets
    if "reth" in offs:
        p.va, p.rkey, p.dma_len = _RETH.unpack_from(hb, offs["reth"])
    if "aeth" in offs:
        a = _U32.unpack_from(hb, offs["aeth"])[0]
        p.syndrome = a >> 24
        p.msn = a & 0xFFFFFF
    if "atomiceth" in offs:
        p.va, p.rkey, p.swap_add, p.compare = _ATOM.unpack_from(hb, offs["atomiceth"])
    if "atomicacketh" in offs:
        p.orig = _U64.unpack_from(hb, offs["atomicacketh"])[0]
    if "immdt" in offs:
        p.imm = _U32.unpack_from(hb, offs["immdt"])[0]
    if "ieth" in offs:
        p.ieth = _U32.unpack_from(hb, offs["ieth"])[0]
    if "neth" in offs:
        p.neth = _NETH.unpack_from(hb, offs["neth"])
    plen = icrc_off - hoff - pad
    if plen < 0:
        raise MalformedPacket(R.BAD_PAD)
    p.payload = frame[hoff:hoff + plen]
    p.frame_len = n
    return p
