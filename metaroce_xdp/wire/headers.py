"""MetaRoCE headers as field tables (spec 02-headers.md, 01-encapsulation.md).

The same layouts are declared once in C in bpf/metaroce_hdr.h; a test checks
that the two agree.
"""
from __future__ import annotations

from .fields import Header

ROCE_UDP_PORT = 4791
ETH_P_IP = 0x0800
ETH_P_IPV6 = 0x86DD
ETH_P_8021Q = 0x8100
ETH_P_8021AD = 0x88A8
IPPROTO_UDP = 17
ICRC_SIZE = 4


# ---- L2 / L3 / L4 -------------------------------------------------------
class Ethernet(Header):
    FIELDS = (("dst", 48), ("src", 48), ("ethertype", 16))


class Vlan(Header):
    """The 4 bytes after the outer ethertype 0x8100: TCI then inner ethertype."""
    FIELDS = (("pcp", 3), ("dei", 1), ("vid", 12), ("ethertype", 16))


class IPv4(Header):
    FIELDS = (("version", 4), ("ihl", 4), ("dscp", 6), ("ecn", 2), ("total_length", 16),
              ("ident", 16), ("flags", 3), ("frag_offset", 13), ("ttl", 8), ("protocol", 8),
              ("checksum", 16), ("src", 32), ("dst", 32))
    _DEFAULTS = {"version": 4, "ihl": 5, "ttl": 64, "protocol": IPPROTO_UDP}


class IPv6(Header):
    FIELDS = (("version", 4), ("traffic_class", 8), ("flow_label", 20), ("payload_length", 16),
              ("next_header", 8), ("hop_limit", 8), ("src", 128), ("dst", 128))
    _DEFAULTS = {"version": 6, "next_header": IPPROTO_UDP, "hop_limit": 64}


class UDP(Header):
    FIELDS = (("sport", 16), ("dport", 16), ("length", 16), ("checksum", 16))
    _DEFAULTS = {"dport": ROCE_UDP_PORT}


# ---- IBTA transport headers (compat) -----------------------------------
class BTH(Header):
    """Base Transport Header, 12 bytes (MR-BTH-001); default P_Key 0xFFFF (MR-BTH-009)."""
    FIELDS = (("opcode", 8), ("se", 1), ("m", 1), ("pad", 2), ("tver", 4), ("pkey", 16),
              ("fecn", 1), ("becn", 1), ("resv6", 6), ("dest_qp", 24),
              ("ack_req", 1), ("resv7", 7), ("psn", 24))
    _DEFAULTS = {"pkey": 0xFFFF}


class RETH(Header):
    """RDMA Extended Transport Header: target of a WRITE or READ (MR-XH-001)."""
    FIELDS = (("va", 64), ("rkey", 32), ("dma_len", 32))


class AETH(Header):
    """ACK Extended Transport Header: syndrome (ACK/RNR NAK/NAK) and MSN (MR-XH-006)."""
    FIELDS = (("syndrome", 8), ("msn", 24))


class AtomicETH(Header):
    FIELDS = (("va", 64), ("rkey", 32), ("swap_add", 64), ("compare", 64))


class AtomicAckETH(Header):
    FIELDS = (("orig", 64),)


class ImmDt(Header):
    FIELDS = (("imm", 32),)


class IETH(Header):
    FIELDS = (("rkey", 32),)


class CNPPad(Header):
    """The 16 reserved bytes that follow the BTH of a CNP (MR-XH-016)."""
    NAME = "CNP"
    FIELDS = (("resv", 128),)


# ---- native profile ----------------------------------------------------
NETH_FIRST = 0x80
NETH_LAST = 0x40
NETH_RETX = 0x20


class NETH(Header):
    """Native Extended Transport Header (MR-XH-017): placement and timing of a native data packet."""
    FIELDS = (("flags", 8), ("msn", 24), ("offset", 32), ("msg_len", 32), ("tsval", 32))


class RSNETH(Header):
    """Receive Sequence Number header of the recv-consuming native opcodes (MR-XH-037): which receive WQE."""
    FIELDS = (("resv", 8), ("rsn", 24))


SACK_FLAG_CE = 0x80
SACK_MAX_WORDS = 32


class SACKETH(Header):
    """Fixed part of the native SACK header; `bitmap_words` 32-bit words follow (MR-XH-026, MR-XH-027)."""
    FIELDS = (("tsecr", 32), ("credit", 16), ("ce_count", 16), ("echo_sport", 16),
              ("bitmap_words", 8), ("flags", 8))
    _DEFAULTS = {"credit": 0xFFFF}


# ---- AETH syndrome (MR-XH-007) ------------------------------------------
AETH_TYPE_MASK = 0x60
AETH_ACK = 0x00
AETH_RNR_NAK = 0x20
AETH_NAK = 0x60
AETH_VALUE_MASK = 0x1F
AETH_CREDIT_INVALID = 0x1F

NAK_PSN_SEQ_ERR = 0
NAK_INVALID_REQUEST = 1
NAK_REMOTE_ACCESS_ERR = 2
NAK_REMOTE_OP_ERR = 3
NAK_INVALID_RD_REQUEST = 4

NAK_NAMES = {
    NAK_PSN_SEQ_ERR: "psn_sequence_error",
    NAK_INVALID_REQUEST: "invalid_request",
    NAK_REMOTE_ACCESS_ERR: "remote_access_error",
    NAK_REMOTE_OP_ERR: "remote_operational_error",
    NAK_INVALID_RD_REQUEST: "invalid_rd_request",
}


def aeth_syndrome_kind(syndrome: int) -> str:
    t = syndrome & AETH_TYPE_MASK
    if t == AETH_ACK:
        return "ack"
    if t == AETH_RNR_NAK:
        return "rnr_nak"
    if t == AETH_NAK:
        return "nak"
    return "reserved"


def describe_syndrome(syndrome: int) -> str:
    kind = aeth_syndrome_kind(syndrome)
    v = syndrome & AETH_VALUE_MASK
    if kind == "ack":
        return "ACK credits=" + ("invalid" if v == AETH_CREDIT_INVALID else str(v))
    if kind == "rnr_nak":
        return f"RNR NAK timer={v}"
    if kind == "nak":
        return "NAK " + NAK_NAMES.get(v, f"reserved({v})")
    return f"reserved syndrome {syndrome:#04x}"


# Order of extension headers after the BTH; a packet carries a subset of these
# in this order (IBTA order for compat; native headers slot in before ImmDt).
EXT_ORDER = ("reth", "atomiceth", "aeth", "atomicacketh", "neth", "rsneth", "sacketh", "immdt", "ieth", "cnp")
EXT_CLASSES: dict[str, type[Header]] = {
    "reth": RETH, "atomiceth": AtomicETH, "aeth": AETH, "atomicacketh": AtomicAckETH,
    "neth": NETH, "rsneth": RSNETH, "sacketh": SACKETH, "immdt": ImmDt, "ieth": IETH, "cnp": CNPPad,
}
