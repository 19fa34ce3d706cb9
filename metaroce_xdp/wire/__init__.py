"""The MetaRoCE wire codec (spec docs/spec/01-encapsulation.md, 02-headers.md).

    from metaroce_xdp.wire import encode, decode, Op, RETH
    frame = encode(Op.RDMA_WRITE_ONLY, dest_qp=0x11, psn=5,
                   headers={"reth": RETH(va=0x1000, rkey=0x1234, dma_len=8)}, payload=b"8 bytes!")
    pkt = decode(frame)      # RocePacket; pkt.icrc_ok is True

Neighbours: `icrc` (reference and compiled ICRC), `fastpath` (compiled frame
builder for the data path), `hdr` (compiled field accessors, the opcode table as
an array and the data path's frame parser), `psn` (24-bit serial arithmetic).
"""
from .errors import CodecError, DecodeReason, EncodeError, MalformedPacket, NotMetaRoCE
from .headers import (AETH, BTH, CNPPad, ETH_P_IP, ETH_P_IPV6, IETH, NETH, RETH, ROCE_UDP_PORT,
                      RSNETH, SACKETH, UDP, AtomicAckETH, AtomicETH, Ethernet, ImmDt, IPv4, IPv6, Vlan)
from .icrc import icrc_ref
from .opcodes import BY_NAME, OPCODES, Op, OpInfo, OpMask, opcode_name, opinfo
from .packet import RocePacket, decode, encode, encode_packet, mac_str, mac_to_int
from .psn import PSN_MASK, psn_add, psn_diff, psn_in_window, psn_le, psn_lt

__all__ = [n for n in dir() if not n.startswith("_")]
