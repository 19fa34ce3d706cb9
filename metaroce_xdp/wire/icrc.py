"""Invariant CRC (ICRC) exactly as RoCEv2 computes it (MR-ICRC-002 to MR-ICRC-009).

The ICRC is CRC-32 (IEEE 802.3 polynomial, reflected, init and final
complement: what zlib.crc32 computes) over a pseudo-packet:

    8 x 0xFF                 stands in for the InfiniBand LRH
    IP header, masked        IPv4: TOS, TTL, checksum -> all ones
                             IPv6: traffic class, flow label, hop limit -> all ones
    UDP header, masked       checksum -> 0xFFFF
    BTH, masked              byte 4 (FECN, BECN, Resv6) -> 0xFF
    rest of the packet       extension headers, payload, pad; not the ICRC

The value goes on the wire least-significant byte first (MR-ICRC-010).

Two implementations: `icrc_ref` (zlib from Python, the reference) and
`icrc_numba` (compiled, for the data path: the masked headers through our
slicing-by-8 table CRC `crc32_update`, the bulk through zlib's own crc32
called by symbol from compiled code, `crc32_bulk`).  Tests prove all of
them agree (MR-ICRC-016).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import zlib

import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import config as numba_config
from numba import njit
from numba import types as nb_types
from numba.core import cgutils
from numba.extending import intrinsic
from .. import jitcache  # noqa: F401,E402  (cache keyed on every module compiled code depends on)

from .errors import DecodeReason, MalformedPacket
from .hdr import (BTH_SIZE, IP4_SIZE, IP6_SIZE, O_BTH_FECN, O_IP4_CSUM, O_IP4_TOS, O_IP4_TTL, O_IP6_HOPS, O_UDP_CSUM,
                  UDP_SIZE)

LRH_STANDIN = b"\xff" * 8


def masked_pseudo_header(l3: bytes | memoryview, ipv6: bool) -> bytes:
    """The first bytes of the ICRC input: LRH stand-in + masked IP + UDP + BTH.

    `l3` starts at the IP header and holds at least IP + UDP + BTH.
    """
    iplen = IP6_SIZE if ipv6 else IP4_SIZE
    need = iplen + UDP_SIZE + BTH_SIZE
    if len(l3) < need:
        raise MalformedPacket(DecodeReason.TRUNCATED_BTH, "too short for IP/UDP/BTH", len(l3))
    h = bytearray(l3[:need])
    if ipv6:
        # version(4) | traffic class(8) | flow label(20): keep the version nibble.
        h[0] |= 0x0F
        h[1] = 0xFF
        h[2] = 0xFF
        h[3] = 0xFF
        h[O_IP6_HOPS] = 0xFF              # hop limit
    else:
        h[O_IP4_TOS] = 0xFF               # TOS (DSCP + ECN)
        h[O_IP4_TTL] = 0xFF
        h[O_IP4_CSUM] = 0xFF              # header checksum
        h[O_IP4_CSUM + 1] = 0xFF
    u = iplen
    h[u + O_UDP_CSUM] = 0xFF              # UDP checksum
    h[u + O_UDP_CSUM + 1] = 0xFF
    h[u + UDP_SIZE + O_BTH_FECN] = 0xFF    # BTH FECN/BECN/Resv6
    return LRH_STANDIN + bytes(h)


def icrc_ref(l3: bytes | memoryview, ipv6: bool) -> int:
    """ICRC of a packet given from its IP header up to, not including, the ICRC."""
    iplen = IP6_SIZE if ipv6 else IP4_SIZE
    head = masked_pseudo_header(l3, ipv6)
    crc = zlib.crc32(head)
    return zlib.crc32(bytes(l3[iplen + UDP_SIZE + BTH_SIZE:]), crc) & 0xFFFFFFFF


def icrc_bytes(value: int) -> bytes:
    return (value & 0xFFFFFFFF).to_bytes(4, "little")


# ---- compiled version --------------------------------------------------
def _make_tables() -> np.ndarray:
    t = np.zeros((8, 256), dtype=np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0xEDB88320 if c & 1 else c >> 1
        t[0, i] = c
    for k in range(1, 8):
        for i in range(256):
            p = int(t[k - 1, i])
            t[k, i] = (p >> 8) ^ int(t[0, p & 0xFF])
    return t


CRC_TABLES = _make_tables()


@njit(cache=True, nogil=True)
def crc32_update(tables, crc, buf, start, end):
    """Continue a zlib-style CRC-32 over buf[start:end]; crc is the previous result (0 to begin)."""
    c = np.uint32(crc) ^ np.uint32(0xFFFFFFFF)
    i = start
    # slicing-by-8: eight table look-ups per 8 input bytes
    while i + 8 <= end:
        lo = c ^ (np.uint32(buf[i]) | (np.uint32(buf[i + 1]) << 8)
                  | (np.uint32(buf[i + 2]) << 16) | (np.uint32(buf[i + 3]) << 24))
        c = (tables[7, lo & 0xFF] ^ tables[6, (lo >> 8) & 0xFF]
             ^ tables[5, (lo >> 16) & 0xFF] ^ tables[4, lo >> 24]
             ^ tables[3, buf[i + 4]] ^ tables[2, buf[i + 5]]
             ^ tables[1, buf[i + 6]] ^ tables[0, buf[i + 7]])
        i += 8
    while i < end:
        c = tables[0, (c ^ np.uint32(buf[i])) & 0xFF] ^ (c >> 8)
        i += 1
    return c ^ np.uint32(0xFFFFFFFF)


# zlib's crc32 (about twice as fast as our table loop), called from compiled code by
# symbol name -- an external function, not a ctypes pointer, so numba can still cache
# the callers on disk.  The table version above stays as the in-house reference.
# libdeflate's crc32 (PCLMULQDQ folding where the CPU has it: 2-3x zlib's on a 1 KiB payload here,
# and the ICRC was a seventh of the sender's CPU on a 64 KiB WRITE stream) when the library is there
# (Debian libdeflate0, scripts/setup.sh); zlib's otherwise.  Same CRC, same continuation convention.
_DEFLATE = ctypes.util.find_library("deflate")
if _DEFLATE:
    try:
        llvm_binding.load_library_permanently(_DEFLATE)
    except RuntimeError:
        _DEFLATE = None
_HAVE_DEFLATE = bool(_DEFLATE)
if _HAVE_DEFLATE:
    _zcrc32 = nb_types.ExternalFunction("libdeflate_crc32", nb_types.uint32(nb_types.uint32, nb_types.voidptr,
                                                                             nb_types.uint64))
else:
    llvm_binding.load_library_permanently(ctypes.util.find_library("z") or "libz.so.1")
    _zcrc32 = nb_types.ExternalFunction("crc32", nb_types.uint64(nb_types.uint64, nb_types.voidptr, nb_types.uint32))


@intrinsic
def _voidptr(typingctx, arr, offset):
    """Address of arr[offset] as void* (no bounds check: callers pass valid offsets)."""
    sig = nb_types.voidptr(arr, offset)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        return builder.bitcast(ptr, cgutils.voidptr_t)
    return sig, codegen


if numba_config.DISABLE_JIT:
    def crc32_bulk(buf, start, end, crc):
        """Plain-Python twin of the compiled version below (NUMBA_DISABLE_JIT=1)."""
        return np.uint32(zlib.crc32(bytes(buf[start:end]), int(crc)))
else:
    @njit(cache=True, nogil=True)
    def crc32_bulk(buf, start, end, crc):
        """zlib-compatible CRC-32 of buf[start:end] continuing from crc (zlib's own code)."""
        if end <= start:
            return np.uint32(crc)
        if _HAVE_DEFLATE:
            return np.uint32(_zcrc32(np.uint32(crc), _voidptr(buf, start), np.uint64(end - start)))
        return np.uint32(_zcrc32(np.uint64(crc), _voidptr(buf, start), np.uint32(end - start)))


if numba_config.DISABLE_JIT:
    def _scratch68():
        return np.empty(68, dtype=np.uint8)
else:
    @intrinsic
    def _scratch68(typingctx):
        """68 bytes on the caller's stack as a uint8 array with no owner: np.empty here was a
        malloc, a free and two locked reference counts per frame, on both ends of every packet."""
        aty = nb_types.Array(nb_types.uint8, 1, "C")

        def codegen(context, builder, signature, args):
            buf = cgutils.alloca_once(builder, ir.ArrayType(ir.IntType(8), 68))
            ary = context.make_array(aty)(context, builder)
            context.populate_array(ary, data=builder.bitcast(buf, ir.PointerType(ir.IntType(8))),
                                   shape=[context.get_constant(nb_types.intp, 68)],
                                   strides=[context.get_constant(nb_types.intp, 1)],
                                   itemsize=context.get_constant(nb_types.intp, 1), meminfo=None)
            return ary._getvalue()
        return aty(), codegen


@njit(cache=True, nogil=True)
def icrc_numba(tables, buf, l3_off, ipv6, end):
    """ICRC of the packet in buf whose IP header starts at l3_off; the ICRC field starts at `end`.

    The masked headers are copied into a 68-byte scratch array; the rest is
    read in place.
    """
    iplen = IP6_SIZE if ipv6 else IP4_SIZE
    n = iplen + UDP_SIZE + BTH_SIZE
    scratch = _scratch68()                 # 8 + 60 bytes
    for k in range(8):
        scratch[k] = 0xFF
    for k in range(n):
        scratch[8 + k] = buf[l3_off + k]
    if ipv6:
        scratch[8] |= 0x0F                 # traffic class and flow label; the version nibble stays
        scratch[9] = 0xFF
        scratch[10] = 0xFF
        scratch[11] = 0xFF
        scratch[8 + O_IP6_HOPS] = 0xFF
    else:
        scratch[8 + O_IP4_TOS] = 0xFF
        scratch[8 + O_IP4_TTL] = 0xFF
        scratch[8 + O_IP4_CSUM] = 0xFF
        scratch[8 + O_IP4_CSUM + 1] = 0xFF
    scratch[8 + iplen + O_UDP_CSUM] = 0xFF
    scratch[8 + iplen + O_UDP_CSUM + 1] = 0xFF
    scratch[8 + iplen + UDP_SIZE + O_BTH_FECN] = 0xFF
    crc = crc32_update(tables, np.uint32(0), scratch, 0, 8 + n)
    return crc32_bulk(buf, l3_off + n, end, crc)
