"""Header fields by name, compiled, and the one frame parser of the data path.

As Linux rxe reads headers only through the accessors of rxe_hdr.h and its opcode table
(rxe_opcode.c), the compiled code reads and writes header fields only through the functions here:
`<hdr>_<field>(buf, off)` reads a field of the header that starts at buf[off] (BTH, RETH, AETH,
AtomicETH, AtomicAckETH, ImmDt, IETH, NETH, RSNETH, SACKETH, and the Ethernet/IP/UDP fields the
plane needs); `put_<hdr>(buf, off, ...)` writes a whole extension header and returns the offset
after it.  `parse_frame` walks Ethernet [802.1Q] / IPv4 | IPv6 / UDP / BTH and checks what the
reference decoder (packet.decode) checks short of the ICRC, with the same DecodeReason numbers as the
XDP program (bpf/parsing_helpers.h).  `OPT` is the opcode table (opcodes.py) as an array: where each
extension header of an opcode sits.

Nothing here is typed twice: byte positions come from the field tables of headers.py, the opcode
rows from opcodes.py.  Everything is numba nopython over a uint8 array and int64 offsets; readers
return int64 (a 64-bit field as its two's complement bit pattern, as the plane stores VAs).
Neighbours: fastpath (frame builder, ICRC check), packet (the reference codec), dp/ (the plane).
"""
from __future__ import annotations

import numpy as np
from numba import njit
from .. import jitcache  # noqa: F401,E402  (cache keyed on every module compiled code depends on)

from .errors import DecodeReason
from .headers import (AETH, BTH, ETH_P_8021Q, ETH_P_IP, ETH_P_IPV6, EXT_ORDER, ICRC_SIZE, IETH,
                      IPPROTO_UDP, NETH, RETH, ROCE_UDP_PORT, RSNETH, SACK_MAX_WORDS, SACKETH, UDP, AtomicAckETH,
                      AtomicETH, CNPPad, Ethernet, ImmDt, IPv4, IPv6, Vlan)
from .opcodes import OPCODES, OpMask

_jit = dict(cache=True, nogil=True)


def _bits(cls, name: str) -> tuple[int, int]:
    """(first bit, width) of field `name` of header class `cls`, from its FIELDS."""
    bit = 0
    for n, width in cls.FIELDS:
        if n == name:
            return bit, width
        bit += width
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def _field(cls, name: str) -> tuple[int, int, int, int, int]:
    """(byte, nbytes, shift, mask, whole) of field `name` of header class `cls`: the field is
    (get_be(buf, off + byte, nbytes) >> shift) & mask; `whole` when it fills its bytes."""
    bit, width = _bits(cls, name)
    byte, end = bit // 8, bit + width
    nbytes = (end + 7) // 8 - byte
    if nbytes > 8:
        raise TypeError(f"{cls.__name__}.{name} spans {nbytes} bytes")
    shift = 8 * (byte + nbytes) - end
    mask = -1 if width == 64 else (1 << width) - 1
    return byte, nbytes, shift, mask, int(shift == 0 and width == 8 * nbytes)


# ---- sizes and the field positions Python-side code needs too ---------------------------------------
ETH_SIZE, VLAN_SIZE, IP4_SIZE, IP6_SIZE = Ethernet.SIZE, Vlan.SIZE, IPv4.SIZE, IPv6.SIZE
UDP_SIZE, BTH_SIZE = UDP.SIZE, BTH.SIZE
O_IP4_TOS = _field(IPv4, "dscp")[0]             # the byte of DSCP and ECN (ICRC-masked)
O_IP4_TOTLEN = _field(IPv4, "total_length")[0]
O_IP4_TTL = _field(IPv4, "ttl")[0]
O_IP4_CSUM = _field(IPv4, "checksum")[0]
O_IP6_PLEN = _field(IPv6, "payload_length")[0]
O_IP6_HOPS = _field(IPv6, "hop_limit")[0]
O_IP6_SRC = _bits(IPv6, "src")[0] // 8           # the addresses (the UDP checksum's pseudo-header)
O_UDP_LEN = _field(UDP, "length")[0]
O_UDP_CSUM = _field(UDP, "checksum")[0]
O_BTH_FECN = _field(BTH, "fecn")[0]              # byte 4: FECN, BECN, Resv6 (ICRC-masked)
O_IP4_SRC, O_IP4_DST = _bits(IPv4, "src")[0] // 8, _bits(IPv4, "dst")[0] // 8
O_IP6_DST = _bits(IPv6, "dst")[0] // 8
IP4_ADDR_SIZE, IP6_ADDR_SIZE = _bits(IPv4, "src")[1] // 8, _bits(IPv6, "src")[1] // 8


def put_field(buf, off, cls, name: str, v: int) -> None:
    """Python side (templates built outside compiled code): write field `name` of header class `cls`
    (headers.py) whose header starts at buf[off], leaving the other bits of its bytes as they are."""
    byte, nbytes, shift, mask, _ = _field(cls, name)
    lo = off + byte
    cur = int.from_bytes(bytes(buf[lo:lo + nbytes]), "big")
    cur = (cur & ~(mask << shift)) | ((int(v) & mask) << shift)
    buf[lo:lo + nbytes] = np.frombuffer(cur.to_bytes(nbytes, "big"), np.uint8)

# ---- why a frame is refused: DecodeReason as plain ints (parse_frame returns minus one of them) -------
R_TRUNCATED_ETH = int(DecodeReason.TRUNCATED_ETH)
R_NOT_IP = int(DecodeReason.NOT_IP)
R_TRUNCATED_IP = int(DecodeReason.TRUNCATED_IP)
R_BAD_IP_HEADER = int(DecodeReason.BAD_IP_HEADER)
R_IP_OPTIONS = int(DecodeReason.IP_OPTIONS)
R_IP_FRAGMENT = int(DecodeReason.IP_FRAGMENT)
R_NOT_UDP = int(DecodeReason.NOT_UDP)
R_TRUNCATED_UDP = int(DecodeReason.TRUNCATED_UDP)
R_BAD_UDP_LENGTH = int(DecodeReason.BAD_UDP_LENGTH)
R_NOT_ROCE_PORT = int(DecodeReason.NOT_ROCE_PORT)
R_TRUNCATED_BTH = int(DecodeReason.TRUNCATED_BTH)
R_BAD_TVER = int(DecodeReason.BAD_TVER)
R_UNKNOWN_OPCODE = int(DecodeReason.UNKNOWN_OPCODE)
R_TRUNCATED_EXT = int(DecodeReason.TRUNCATED_EXT)
R_BAD_PAD = int(DecodeReason.BAD_PAD)
R_BAD_FIELD = int(DecodeReason.BAD_FIELD)

# ---- the opcode table as an array (rxe_opcode.c: length and offset[] per opcode) --------------------
OT_MASK = 0          # OpMask bits; 0: no opcode of the table
OT_EXT = 1           # bytes of extension headers after the BTH (fixed part; a SACK bitmap follows); -1: unknown
OT_PAY = 2           # payload offset from the BTH start, BTH + OT_EXT (parse_frame adds a SACK bitmap); -1: unknown
# offset of each extension header from the end of the BTH, -1 when the opcode has none (EXT_ORDER)
(OT_RETH, OT_ATOMICETH, OT_AETH, OT_ATOMICACKETH, OT_NETH, OT_RSNETH, OT_SACKETH, OT_IMMDT, OT_IETH,
 OT_CNP) = range(3, 13)
OT_NCOL = 13
OT_COL = {"reth": OT_RETH, "atomiceth": OT_ATOMICETH, "aeth": OT_AETH, "atomicacketh": OT_ATOMICACKETH,
          "neth": OT_NETH, "rsneth": OT_RSNETH, "sacketh": OT_SACKETH, "immdt": OT_IMMDT, "ieth": OT_IETH,
          "cnp": OT_CNP}
assert tuple(OT_COL) == EXT_ORDER and list(OT_COL.values()) == list(range(3, OT_NCOL))


def _opcode_table() -> np.ndarray:
    t = np.full((256, OT_NCOL), -1, np.int64)
    t[:, OT_MASK] = 0
    for v, op in OPCODES.items():
        t[v, OT_MASK] = op.mask
        t[v, OT_EXT] = op.hdr_len - BTH.SIZE
        t[v, OT_PAY] = op.hdr_len
        for h in op.headers:
            t[v, OT_COL[h]] = op.offsets[h] - BTH.SIZE
        # parse_frame adds the SACK bitmap to the payload offset: SACKETH must be the last header
        assert "sacketh" not in op.headers or op.headers[-1] == "sacketh", op.name
    t.setflags(write=False)
    return t


OPT = _opcode_table()
M_PAYLOAD = int(OpMask.PAYLOAD)


# ---- bytes --------------------------------------------------------------------------------------------
@njit(**_jit)
def get_be(buf, off, n):
    """The n-byte (n <= 8) big-endian unsigned number at buf[off], as int64."""
    v = np.int64(0)
    for i in range(n):
        v = (v << 8) | np.int64(buf[off + i])
    return v


@njit(**_jit)
def put_be(buf, off, v, n):
    """Write the low n bytes of v (n <= 8) big-endian at buf[off]."""
    for i in range(n):
        buf[off + i] = (v >> (8 * (n - 1 - i))) & 0xFF


@njit(**_jit)
def _get(buf, off, f):
    return (get_be(buf, off + f[0], f[1]) >> f[2]) & f[3]


@njit(**_jit)
def _put(buf, off, f, v):
    if f[4]:
        put_be(buf, off + f[0], v, f[1])
    else:
        cur = get_be(buf, off + f[0], f[1])
        put_be(buf, off + f[0], (cur & ~(f[3] << f[2])) | ((v & f[3]) << f[2]), f[1])


# ---- Ethernet, 802.1Q, IP, UDP ------------------------------------------------------------------------
_ETH_TYPE = _field(Ethernet, "ethertype")
_VLAN_TYPE = _field(Vlan, "ethertype")
_IP_VER = _field(IPv4, "version")
assert _IP_VER == _field(IPv6, "version")
_IP4_IHL, _IP4_ECN, _IP4_LEN = _field(IPv4, "ihl"), _field(IPv4, "ecn"), _field(IPv4, "total_length")
_IP4_FLAGS, _IP4_FRAG, _IP4_PROTO = _field(IPv4, "flags"), _field(IPv4, "frag_offset"), _field(IPv4, "protocol")
_IP4_CSUM = _field(IPv4, "checksum")
_IP6_TC, _IP6_PLEN, _IP6_NH = _field(IPv6, "traffic_class"), _field(IPv6, "payload_length"), _field(IPv6, "next_header")
_IP6_FLOW = _field(IPv6, "flow_label")
_UDP_SPORT, _UDP_DPORT = _field(UDP, "sport"), _field(UDP, "dport")
_UDP_LEN, _UDP_CSUM = _field(UDP, "length"), _field(UDP, "checksum")


@njit(**_jit)
def eth_type(buf, a):
    """Ethernet type of the frame at buf[a], 16 bits."""
    return _get(buf, a, _ETH_TYPE)


@njit(**_jit)
def vlan_type(buf, t):
    """Inner ethertype of the 802.1Q tag at buf[t] (the 4 bytes after the outer ethertype), 16 bits."""
    return _get(buf, t, _VLAN_TYPE)


@njit(**_jit)
def l3_of(buf, a, ln):
    """(ethertype after at most one 802.1Q tag, offset of the header that follows) of the frame
    buf[a:a+ln]; (-R_TRUNCATED_ETH, -1) when the Ethernet header or the tag does not fit."""
    if ln < ETH_SIZE:
        return -R_TRUNCATED_ETH, np.int64(-1)
    et = eth_type(buf, a)
    l3 = a + ETH_SIZE
    if et == ETH_P_8021Q:
        if ln < ETH_SIZE + VLAN_SIZE:
            return -R_TRUNCATED_ETH, np.int64(-1)
        et = vlan_type(buf, l3)
        l3 += VLAN_SIZE
    return et, np.int64(l3)


@njit(**_jit)
def ip_version(buf, l3):
    """IP version (4 or 6) of the IP header at buf[l3], 4 bits."""
    return _get(buf, l3, _IP_VER)


@njit(**_jit)
def ip4_ihl(buf, l3):
    """IPv4 header length in 32-bit words, 4 bits."""
    return _get(buf, l3, _IP4_IHL)


@njit(**_jit)
def ip4_total_len(buf, l3):
    """IPv4 Total Length, 16 bits."""
    return _get(buf, l3, _IP4_LEN)


@njit(**_jit)
def ip4_flags(buf, l3):
    """IPv4 flags (reserved, DF, MF), 3 bits."""
    return _get(buf, l3, _IP4_FLAGS)


@njit(**_jit)
def ip4_frag_offset(buf, l3):
    """IPv4 fragment offset, 13 bits."""
    return _get(buf, l3, _IP4_FRAG)


@njit(**_jit)
def ip4_protocol(buf, l3):
    """IPv4 protocol, 8 bits."""
    return _get(buf, l3, _IP4_PROTO)


@njit(**_jit)
def ip6_payload_len(buf, l3):
    """IPv6 Payload Length, 16 bits."""
    return _get(buf, l3, _IP6_PLEN)


@njit(**_jit)
def ip6_next_header(buf, l3):
    """IPv6 Next Header, 8 bits."""
    return _get(buf, l3, _IP6_NH)


@njit(**_jit)
def ip_ecn(buf, l3):
    """ECN bits of the IPv4 TOS or IPv6 Traffic Class (3: CE), 2 bits."""
    if ip_version(buf, l3) == 6:
        return _get(buf, l3, _IP6_TC) & 3
    return _get(buf, l3, _IP4_ECN)


@njit(**_jit)
def ip_end(buf, l3):
    """Offset of the first byte after the IP packet at buf[l3], from its IPv4 or IPv6 length field."""
    if ip_version(buf, l3) == 6:
        return l3 + IP6_SIZE + ip6_payload_len(buf, l3)
    return l3 + ip4_total_len(buf, l3)


@njit(**_jit)
def udp_of(buf, l3):
    """Offset of the UDP header after the IP header at buf[l3] (IPv4 without options, or IPv6)."""
    return l3 + (IP6_SIZE if ip_version(buf, l3) == 6 else IP4_SIZE)


@njit(**_jit)
def put_ip4_total_len(buf, l3, n):
    """Write the IPv4 Total Length, 16 bits."""
    _put(buf, l3, _IP4_LEN, n)


@njit(**_jit)
def put_ip4_csum(buf, l3, c):
    """Write the IPv4 header checksum, 16 bits."""
    _put(buf, l3, _IP4_CSUM, c)


@njit(**_jit)
def put_ip6_payload_len(buf, l3, n):
    """Write the IPv6 Payload Length, 16 bits."""
    _put(buf, l3, _IP6_PLEN, n)


@njit(**_jit)
def udp_sport(buf, u):
    """UDP source port (the path entropy of the native profile), 16 bits."""
    return _get(buf, u, _UDP_SPORT)


@njit(**_jit)
def udp_dport(buf, u):
    """UDP destination port, 16 bits."""
    return _get(buf, u, _UDP_DPORT)


@njit(**_jit)
def udp_len(buf, u):
    """UDP Length (header and data), 16 bits."""
    return _get(buf, u, _UDP_LEN)


@njit(**_jit)
def put_udp_len(buf, u, n):
    """Write the UDP Length, 16 bits."""
    _put(buf, u, _UDP_LEN, n)


@njit(**_jit)
def put_udp_sport(buf, u, p):
    """Write the UDP source port, 16 bits."""
    _put(buf, u, _UDP_SPORT, p)


@njit(**_jit)
def put_ip6_flow_label(buf, l3, fl):
    """Write the IPv6 Flow Label (the path entropy of the native profile over IPv6), 20 bits."""
    _put(buf, l3, _IP6_FLOW, fl)


@njit(**_jit)
def put_udp_csum(buf, u, c):
    """Write the UDP checksum, 16 bits."""
    _put(buf, u, _UDP_CSUM, c)


# ---- BTH ----------------------------------------------------------------------------------------------
_OPCODE, _SE, _MIG, _PAD, _TVER = (_field(BTH, n) for n in ("opcode", "se", "m", "pad", "tver"))
_PKEY, _FECN, _BECN, _QPN = (_field(BTH, n) for n in ("pkey", "fecn", "becn", "dest_qp"))
_ACKREQ, _RESV7, _PSN = (_field(BTH, n) for n in ("ack_req", "resv7", "psn"))


@njit(**_jit)
def bth_opcode(buf, b):
    """BTH OpCode, 8 bits."""
    return _get(buf, b, _OPCODE)


@njit(**_jit)
def bth_se(buf, b):
    """BTH SE (solicited event), 1 bit."""
    return _get(buf, b, _SE)


@njit(**_jit)
def bth_mig(buf, b):
    """BTH M (MigReq), 1 bit."""
    return _get(buf, b, _MIG)


@njit(**_jit)
def bth_pad(buf, b):
    """BTH PadCnt, 2 bits."""
    return _get(buf, b, _PAD)


@njit(**_jit)
def bth_tver(buf, b):
    """BTH TVer, 4 bits."""
    return _get(buf, b, _TVER)


@njit(**_jit)
def bth_pkey(buf, b):
    """BTH P_Key, 16 bits."""
    return _get(buf, b, _PKEY)


@njit(**_jit)
def bth_fecn(buf, b):
    """BTH FECN, 1 bit."""
    return _get(buf, b, _FECN)


@njit(**_jit)
def bth_becn(buf, b):
    """BTH BECN, 1 bit."""
    return _get(buf, b, _BECN)


@njit(**_jit)
def bth_qpn(buf, b):
    """BTH DestQP, 24 bits."""
    return _get(buf, b, _QPN)


@njit(**_jit)
def bth_ackreq(buf, b):
    """BTH AckReq, 1 bit."""
    return _get(buf, b, _ACKREQ)


@njit(**_jit)
def bth_psn(buf, b):
    """BTH PSN, 24 bits."""
    return _get(buf, b, _PSN)


@njit(**_jit)
def put_bth_packet(buf, b, opcode, se, mig, pad, ackreq, psn):
    """Write the per-packet BTH fields -- OpCode, SE, M, PadCnt, AckReq (Resv7 0), PSN -- over a
    template's BTH, whose TVer, P_Key, FECN/BECN and DestQP stay."""
    _put(buf, b, _OPCODE, opcode)
    _put(buf, b, _SE, se)
    _put(buf, b, _MIG, mig)
    _put(buf, b, _PAD, pad)
    _put(buf, b, _ACKREQ, ackreq)
    _put(buf, b, _RESV7, 0)
    _put(buf, b, _PSN, psn)


# ---- the extension headers ----------------------------------------------------------------------------
_RETH_VA, _RETH_RKEY, _RETH_DLEN = (_field(RETH, n) for n in ("va", "rkey", "dma_len"))
_AETH_SYN, _AETH_MSN = _field(AETH, "syndrome"), _field(AETH, "msn")
_AT_VA, _AT_RKEY, _AT_SWAP, _AT_CMP = (_field(AtomicETH, n) for n in ("va", "rkey", "swap_add", "compare"))
_AACK_ORIG = _field(AtomicAckETH, "orig")
_IMM = _field(ImmDt, "imm")
_IETH_RKEY = _field(IETH, "rkey")
_NETH_FLAGS, _NETH_MSN, _NETH_OFF, _NETH_MLEN, _NETH_TSVAL = (
    _field(NETH, n) for n in ("flags", "msn", "offset", "msg_len", "tsval"))
_RSN_RESV, _RSN = _field(RSNETH, "resv"), _field(RSNETH, "rsn")
_SK_TSECR, _SK_CREDIT, _SK_CE, _SK_SPORT, _SK_WORDS, _SK_FLAGS = (
    _field(SACKETH, n) for n in ("tsecr", "credit", "ce_count", "echo_sport", "bitmap_words", "flags"))
RETH_SIZE, AETH_SIZE, ATOMICETH_SIZE, ATOMICACKETH_SIZE = RETH.SIZE, AETH.SIZE, AtomicETH.SIZE, AtomicAckETH.SIZE
IMMDT_SIZE, IETH_SIZE, NETH_SIZE = ImmDt.SIZE, IETH.SIZE, NETH.SIZE
RSNETH_SIZE, SACKETH_SIZE, CNP_SIZE = RSNETH.SIZE, SACKETH.SIZE, CNPPad.SIZE
SACK_WORD = 4                                     # bytes of one SACK bitmap word


@njit(**_jit)
def ext_at(b, op, col):
    """Offset of the extension header `col` (OT_RETH ...) of opcode op whose BTH is at b; -1 if it has none."""
    o = OPT[op, col]
    return b + BTH_SIZE + o if o >= 0 else np.int64(-1)


@njit(**_jit)
def reth_va(buf, h):
    """RETH Virtual Address, 64 bits (int64 bit pattern)."""
    return _get(buf, h, _RETH_VA)


@njit(**_jit)
def reth_rkey(buf, h):
    """RETH R_Key, 32 bits."""
    return _get(buf, h, _RETH_RKEY)


@njit(**_jit)
def reth_dlen(buf, h):
    """RETH DMA Length, 32 bits."""
    return _get(buf, h, _RETH_DLEN)


@njit(**_jit)
def put_reth(buf, h, va, rkey, dlen):
    """Write a RETH (VA 64, R_Key 32, DMA Length 32 bits); returns the offset after it."""
    _put(buf, h, _RETH_VA, va)
    _put(buf, h, _RETH_RKEY, rkey)
    _put(buf, h, _RETH_DLEN, dlen)
    return h + RETH_SIZE


@njit(**_jit)
def aeth_syndrome(buf, h):
    """AETH Syndrome, 8 bits."""
    return _get(buf, h, _AETH_SYN)


@njit(**_jit)
def aeth_msn(buf, h):
    """AETH MSN, 24 bits."""
    return _get(buf, h, _AETH_MSN)


@njit(**_jit)
def put_aeth(buf, h, syndrome, msn):
    """Write an AETH (Syndrome 8, MSN 24 bits); returns the offset after it."""
    _put(buf, h, _AETH_SYN, syndrome)
    _put(buf, h, _AETH_MSN, msn)
    return h + AETH_SIZE


@njit(**_jit)
def atomiceth_va(buf, h):
    """AtomicETH Virtual Address, 64 bits (int64 bit pattern)."""
    return _get(buf, h, _AT_VA)


@njit(**_jit)
def atomiceth_rkey(buf, h):
    """AtomicETH R_Key, 32 bits."""
    return _get(buf, h, _AT_RKEY)


@njit(**_jit)
def atomiceth_swap_add(buf, h):
    """AtomicETH Swap (CompareSwap) or Add (FetchAdd) Data, 64 bits (int64 bit pattern)."""
    return _get(buf, h, _AT_SWAP)


@njit(**_jit)
def atomiceth_compare(buf, h):
    """AtomicETH Compare Data, 64 bits (int64 bit pattern)."""
    return _get(buf, h, _AT_CMP)


@njit(**_jit)
def put_atomiceth(buf, h, va, rkey, swap_add, compare):
    """Write an AtomicETH (VA 64, R_Key 32, Swap/Add 64, Compare 64 bits); returns the offset after it."""
    _put(buf, h, _AT_VA, va)
    _put(buf, h, _AT_RKEY, rkey)
    _put(buf, h, _AT_SWAP, swap_add)
    _put(buf, h, _AT_CMP, compare)
    return h + ATOMICETH_SIZE


@njit(**_jit)
def atomicacketh_orig(buf, h):
    """AtomicAckETH Original Remote Data, 64 bits (int64 bit pattern)."""
    return _get(buf, h, _AACK_ORIG)


@njit(**_jit)
def put_atomicacketh(buf, h, orig):
    """Write an AtomicAckETH (Original Remote Data, 64 bits); returns the offset after it."""
    _put(buf, h, _AACK_ORIG, orig)
    return h + ATOMICACKETH_SIZE


@njit(**_jit)
def immdt_imm(buf, h):
    """ImmDt immediate data, 32 bits."""
    return _get(buf, h, _IMM)


@njit(**_jit)
def put_immdt(buf, h, imm):
    """Write an ImmDt (immediate data, 32 bits); returns the offset after it."""
    _put(buf, h, _IMM, imm)
    return h + IMMDT_SIZE


@njit(**_jit)
def ieth_rkey(buf, h):
    """IETH R_Key to invalidate, 32 bits."""
    return _get(buf, h, _IETH_RKEY)


@njit(**_jit)
def put_ieth(buf, h, rkey):
    """Write an IETH (R_Key, 32 bits); returns the offset after it."""
    _put(buf, h, _IETH_RKEY, rkey)
    return h + IETH_SIZE


@njit(**_jit)
def neth_flags(buf, h):
    """NETH flags byte: F 0x80, L 0x40, R 0x20 (headers.NETH_*), Rsvd; 8 bits."""
    return _get(buf, h, _NETH_FLAGS)


@njit(**_jit)
def neth_msn(buf, h):
    """NETH MSN, 24 bits."""
    return _get(buf, h, _NETH_MSN)


@njit(**_jit)
def neth_offset(buf, h):
    """NETH Offset of the payload in the message, 32 bits."""
    return _get(buf, h, _NETH_OFF)


@njit(**_jit)
def neth_msg_len(buf, h):
    """NETH Message Length, 32 bits."""
    return _get(buf, h, _NETH_MLEN)


@njit(**_jit)
def neth_tsval(buf, h):
    """NETH TSval (sender clock, us), 32 bits."""
    return _get(buf, h, _NETH_TSVAL)


@njit(**_jit)
def put_neth(buf, h, flags, msn, offset, msg_len, tsval):
    """Write a NETH (flags 8, MSN 24, Offset 32, Message Length 32, TSval 32 bits); returns the offset after it."""
    _put(buf, h, _NETH_FLAGS, flags)
    _put(buf, h, _NETH_MSN, msn)
    _put(buf, h, _NETH_OFF, offset)
    _put(buf, h, _NETH_MLEN, msg_len)
    _put(buf, h, _NETH_TSVAL, tsval)
    return h + NETH_SIZE


@njit(**_jit)
def rsneth_rsn(buf, h):
    """RSNETH RSN (receive sequence number), 24 bits."""
    return _get(buf, h, _RSN)


@njit(**_jit)
def put_rsneth(buf, h, rsn):
    """Write an RSNETH (Rsvd 0, RSN 24 bits); returns the offset after it."""
    _put(buf, h, _RSN_RESV, 0)
    _put(buf, h, _RSN, rsn)
    return h + RSNETH_SIZE


@njit(**_jit)
def sacketh_tsecr(buf, h):
    """SACKETH TSecr, 32 bits."""
    return _get(buf, h, _SK_TSECR)


@njit(**_jit)
def sacketh_credit(buf, h):
    """SACKETH Credit, 16 bits."""
    return _get(buf, h, _SK_CREDIT)


@njit(**_jit)
def sacketh_ce_count(buf, h):
    """SACKETH CE Count, 16 bits."""
    return _get(buf, h, _SK_CE)


@njit(**_jit)
def sacketh_echo_sport(buf, h):
    """SACKETH Echo Sport, 16 bits."""
    return _get(buf, h, _SK_SPORT)


@njit(**_jit)
def sacketh_words(buf, h):
    """SACKETH Bitmap Words (32-bit words that follow the header), 8 bits."""
    return _get(buf, h, _SK_WORDS)


@njit(**_jit)
def sacketh_flags(buf, h):
    """SACKETH flags byte: C 0x80, N 0x40, Rsvd; 8 bits."""
    return _get(buf, h, _SK_FLAGS)


@njit(**_jit)
def sacketh_word(buf, h, i):
    """Word i of the bitmap after the SACKETH at buf[h], 32 bits."""
    return get_be(buf, h + SACKETH_SIZE + SACK_WORD * i, SACK_WORD)


@njit(**_jit)
def put_sacketh(buf, h, tsecr, credit, ce_count, echo_sport, words, flags):
    """Write a SACKETH's fixed part (TSecr 32, Credit 16, CE Count 16, Echo Sport 16, Bitmap Words 8,
    flags 8 bits); returns the offset of bitmap word 0."""
    _put(buf, h, _SK_TSECR, tsecr)
    _put(buf, h, _SK_CREDIT, credit)
    _put(buf, h, _SK_CE, ce_count)
    _put(buf, h, _SK_SPORT, echo_sport)
    _put(buf, h, _SK_WORDS, words)
    _put(buf, h, _SK_FLAGS, flags)
    return h + SACKETH_SIZE


@njit(**_jit)
def put_sacketh_word(buf, h, i, w):
    """Write word i of the bitmap after the SACKETH at buf[h], 32 bits."""
    put_be(buf, h + SACKETH_SIZE + SACK_WORD * i, w, SACK_WORD)


@njit(**_jit)
def sacketh_end(buf, h):
    """Offset after the SACKETH at buf[h] and the bitmap words its Bitmap Words field counts."""
    return h + SACKETH_SIZE + SACK_WORD * sacketh_words(buf, h)


@njit(**_jit)
def put_cnp(buf, h):
    """Write the 16 reserved bytes of a CNP after its BTH, zero (MR-XH-016); returns the offset after them."""
    for i in range(CNP_SIZE):
        buf[h + i] = 0
    return h + CNP_SIZE


# ---- the ICRC field -----------------------------------------------------------------------------------
@njit(**_jit)
def icrc_field(buf, off):
    """The ICRC at buf[off], 32 bits sent least significant byte first (MR-ICRC-010)."""
    return (np.int64(buf[off]) | (np.int64(buf[off + 1]) << 8) | (np.int64(buf[off + 2]) << 16)
            | (np.int64(buf[off + 3]) << 24))


@njit(**_jit)
def put_icrc_field(buf, off, crc):
    """Write the ICRC at buf[off], least significant byte first (MR-ICRC-010)."""
    for i in range(ICRC_SIZE):
        buf[off + i] = (crc >> (8 * i)) & 0xFF


# ---- the frame parser ---------------------------------------------------------------------------------
@njit(**_jit)
def _refuse(reason):
    m1 = np.int64(-1)
    return np.int64(-reason), m1, m1, m1, m1, m1, m1


@njit(**_jit)
def parse_frame(buf, a, ln):
    """Walk the frame buf[a:a+ln] -- Ethernet [802.1Q] / IPv4 | IPv6 / UDP 4791 / BTH / extension
    headers -- with the checks of packet.decode short of the ICRC (MR-ENC-032 steps 1-3, 5, 7-9):

        (opcode, dest_qp, l3, bth, payload, icrc, pad)

    offsets into buf: the IP header, the BTH, the payload, the ICRC (the payload ends at icrc - pad);
    or (-DecodeReason, -1, ...) for a frame refused.  Reads nothing outside buf[a:a+ln]; Ethernet
    padding after the IP packet is ignored (MR-ENC-007).  The ICRC is not checked."""
    end = np.int64(a) + np.int64(ln)
    et, l3 = l3_of(buf, np.int64(a), np.int64(ln))
    if et < 0:
        return _refuse(-et)
    if et == ETH_P_IP:
        if l3 + IP4_SIZE > end:
            return _refuse(R_TRUNCATED_IP)
        ihl = ip4_ihl(buf, l3)
        if ip_version(buf, l3) != 4 or ihl < 5:
            return _refuse(R_BAD_IP_HEADER)
        if ip4_protocol(buf, l3) != IPPROTO_UDP:
            return _refuse(R_NOT_UDP)
        tot = ip4_total_len(buf, l3)
        if tot < 4 * ihl or l3 + tot > end:
            return _refuse(R_BAD_IP_HEADER)
        if (ip4_flags(buf, l3) & 1) or ip4_frag_offset(buf, l3):      # MF, or not the first fragment
            return _refuse(R_IP_FRAGMENT)
        if ihl != 5:
            return _refuse(R_IP_OPTIONS)
        pkt_end = l3 + tot
        u = l3 + IP4_SIZE
    elif et == ETH_P_IPV6:
        if l3 + IP6_SIZE > end:
            return _refuse(R_TRUNCATED_IP)
        if ip_version(buf, l3) != 6:
            return _refuse(R_BAD_IP_HEADER)
        if ip6_next_header(buf, l3) != IPPROTO_UDP:
            return _refuse(R_NOT_UDP)
        pkt_end = l3 + IP6_SIZE + ip6_payload_len(buf, l3)
        if pkt_end > end:
            return _refuse(R_BAD_IP_HEADER)
        u = l3 + IP6_SIZE
    else:
        return _refuse(R_NOT_IP)
    if pkt_end < u + UDP_SIZE:
        return _refuse(R_TRUNCATED_UDP)
    if udp_dport(buf, u) != ROCE_UDP_PORT:
        return _refuse(R_NOT_ROCE_PORT)
    if udp_len(buf, u) != pkt_end - u:
        return _refuse(R_BAD_UDP_LENGTH)
    b = u + UDP_SIZE
    if pkt_end < b + BTH_SIZE + ICRC_SIZE:
        return _refuse(R_TRUNCATED_BTH)
    if bth_tver(buf, b) != 0:                       # MR-BTH-007; Resv6 and Resv7 are ignored (MR-BTH-013)
        return _refuse(R_BAD_TVER)
    op = bth_opcode(buf, b)
    if OPT[op, OT_EXT] < 0:
        return _refuse(R_UNKNOWN_OPCODE)
    icrc = pkt_end - ICRC_SIZE
    pay = b + OPT[op, OT_PAY]
    if pay > icrc:
        return _refuse(R_TRUNCATED_EXT)
    sk = OPT[op, OT_SACKETH]
    if sk >= 0:
        nw = sacketh_words(buf, b + BTH_SIZE + sk)
        if nw > SACK_MAX_WORDS:
            return _refuse(R_BAD_FIELD)
        pay += SACK_WORD * nw
        if pay > icrc:
            return _refuse(R_TRUNCATED_EXT)
    rest = icrc - pay
    pad = bth_pad(buf, b)
    if OPT[op, OT_MASK] & M_PAYLOAD:
        if rest & 3 or pad > rest:
            return _refuse(R_BAD_PAD)
    elif rest != 0 or pad != 0:
        return _refuse(R_BAD_PAD)
    return op, bth_qpn(buf, b), l3, b, pay, icrc, pad
