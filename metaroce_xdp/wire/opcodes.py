"""The opcode table as data (spec 02-headers.md, Table 2-1: MR-OPC-001, MR-OPC-009).

As in Linux rxe's opcode table, code tests masks (is this a request? does it
carry a RETH? is it the end of a message?), never lists of opcodes.  Header
lengths and offsets are derived from the header set, never written by hand.
The C mirror lives in bpf/metaroce_hdr.h; tests/kern/test_c_python_agree.py
proves they agree.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from .headers import BTH, EXT_CLASSES, EXT_ORDER


class OpMask(enum.IntFlag):
    """Properties of an opcode.  Bit values are shared with the C table: never renumber."""
    RETH = 1 << 0
    AETH = 1 << 1
    ATOMICETH = 1 << 2
    ATOMICACKETH = 1 << 3
    IMMDT = 1 << 4
    IETH = 1 << 5
    NETH = 1 << 6
    SACKETH = 1 << 7
    CNP = 1 << 8
    PAYLOAD = 1 << 9     # may carry payload
    REQ = 1 << 10        # travels requester -> responder
    ACK = 1 << 11        # travels responder -> requester (ACK, NAK, READ response, atomic ACK, SACK)
    SEND = 1 << 12
    WRITE = 1 << 13
    READ = 1 << 14       # READ request or READ response
    ATOMIC = 1 << 15     # atomic request or atomic ACK
    RWR = 1 << 16        # consumes a receive WQE at the responder
    COMP = 1 << 17       # completes a message at the responder
    START = 1 << 18      # first packet of a message (FIRST/ONLY)
    MIDDLE = 1 << 19
    END = 1 << 20        # last packet of a message (LAST/ONLY)
    NATIVE = 1 << 21     # native-profile opcode
    CONTROL = 1 << 22    # not part of the PSN sequence (CNP)
    RSNETH = 1 << 23     # carries the native receive sequence number header


_HDR_BIT = {"reth": OpMask.RETH, "aeth": OpMask.AETH, "atomiceth": OpMask.ATOMICETH,
            "atomicacketh": OpMask.ATOMICACKETH, "immdt": OpMask.IMMDT, "ieth": OpMask.IETH,
            "neth": OpMask.NETH, "sacketh": OpMask.SACKETH, "cnp": OpMask.CNP,
            "rsneth": OpMask.RSNETH}


@dataclass(frozen=True)
class OpInfo:
    value: int
    name: str
    mask: int                        # OpMask bits (a plain int: see MI)
    headers: tuple[str, ...]         # extension headers after the BTH, in wire order
    hdr_len: int                     # BTH + extension headers (fixed part), bytes
    offsets: dict                    # header name -> byte offset from the BTH start

    def has(self, m: OpMask) -> bool:
        return bool(self.mask & int(m))


class MI:
    """OpMask bits as plain ints, for hot paths: int & IntFlag goes through
    IntFlag.__rand__ and costs a microsecond per test."""


for _m in OpMask:
    setattr(MI, _m.name, int(_m))


def _op(value: int, name: str, mask: OpMask) -> OpInfo:
    headers = tuple(h for h in EXT_ORDER if mask & _HDR_BIT[h])
    offsets = {"bth": 0}
    off = BTH.SIZE
    for h in headers:
        offsets[h] = off
        off += EXT_CLASSES[h].SIZE
    return OpInfo(value, name, int(mask), headers, off, offsets)


M = OpMask
_S, _W, _RD, _AT = M.SEND | M.REQ, M.WRITE | M.REQ, M.READ, M.ATOMIC
_P = M.PAYLOAD

_TABLE = [
    # --- compat: RC (IBTA opcodes 0x00-0x1F) ---
    (0x00, "SEND_FIRST",                      _S | _P | M.RWR | M.START),
    (0x01, "SEND_MIDDLE",                     _S | _P | M.MIDDLE),
    (0x02, "SEND_LAST",                       _S | _P | M.COMP | M.END),
    (0x03, "SEND_LAST_WITH_IMMEDIATE",        _S | _P | M.IMMDT | M.COMP | M.END),
    (0x04, "SEND_ONLY",                       _S | _P | M.RWR | M.COMP | M.START | M.END),
    (0x05, "SEND_ONLY_WITH_IMMEDIATE",        _S | _P | M.IMMDT | M.RWR | M.COMP | M.START | M.END),
    (0x06, "RDMA_WRITE_FIRST",                _W | _P | M.RETH | M.START),
    (0x07, "RDMA_WRITE_MIDDLE",               _W | _P | M.MIDDLE),
    (0x08, "RDMA_WRITE_LAST",                 _W | _P | M.END),
    (0x09, "RDMA_WRITE_LAST_WITH_IMMEDIATE",  _W | _P | M.IMMDT | M.RWR | M.COMP | M.END),
    (0x0A, "RDMA_WRITE_ONLY",                 _W | _P | M.RETH | M.START | M.END),
    (0x0B, "RDMA_WRITE_ONLY_WITH_IMMEDIATE",  _W | _P | M.RETH | M.IMMDT | M.RWR | M.COMP | M.START | M.END),
    (0x0C, "RDMA_READ_REQUEST",               _RD | M.REQ | M.RETH | M.START | M.END),
    (0x0D, "RDMA_READ_RESPONSE_FIRST",        _RD | M.ACK | _P | M.AETH | M.START),
    (0x0E, "RDMA_READ_RESPONSE_MIDDLE",       _RD | M.ACK | _P | M.MIDDLE),
    (0x0F, "RDMA_READ_RESPONSE_LAST",         _RD | M.ACK | _P | M.AETH | M.END),
    (0x10, "RDMA_READ_RESPONSE_ONLY",         _RD | M.ACK | _P | M.AETH | M.START | M.END),
    (0x11, "ACKNOWLEDGE",                     M.ACK | M.AETH | M.START | M.END),
    (0x12, "ATOMIC_ACKNOWLEDGE",              _AT | M.ACK | M.AETH | M.ATOMICACKETH | M.START | M.END),
    (0x13, "COMPARE_SWAP",                    _AT | M.REQ | M.ATOMICETH | M.START | M.END),
    (0x14, "FETCH_ADD",                       _AT | M.REQ | M.ATOMICETH | M.START | M.END),
    (0x16, "SEND_LAST_WITH_INVALIDATE",       _S | _P | M.IETH | M.COMP | M.END),
    (0x17, "SEND_ONLY_WITH_INVALIDATE",       _S | _P | M.IETH | M.RWR | M.COMP | M.START | M.END),
    # --- congestion notification (RoCEv2 annex) ---
    (0x81, "CNP",                             M.CNP | M.CONTROL),
    # --- native profile (manufacturer-specific range 0xC0-0xFF) ---
    # START/END of a native data packet are in NETH.flags, not in the opcode.
    (0xC0, "NATIVE_SEND",                     _S | _P | M.NETH | M.RSNETH | M.RWR | M.COMP | M.NATIVE),
    (0xC1, "NATIVE_SEND_IMM",                 _S | _P | M.NETH | M.RSNETH | M.IMMDT | M.RWR | M.COMP | M.NATIVE),
    (0xC2, "NATIVE_WRITE",                    _W | _P | M.RETH | M.NETH | M.NATIVE),
    (0xC3, "NATIVE_WRITE_IMM",                _W | _P | M.RETH | M.NETH | M.RSNETH | M.IMMDT | M.RWR | M.COMP | M.NATIVE),
    (0xC4, "NATIVE_READ_REQ",                 _RD | M.REQ | M.RETH | M.NETH | M.START | M.END | M.NATIVE),
    (0xC5, "NATIVE_READ_RESP",                _RD | M.ACK | _P | M.NETH | M.NATIVE),
    (0xC6, "NATIVE_SACK",                     M.ACK | M.AETH | M.SACKETH | M.START | M.END | M.NATIVE),
]

OPCODES: dict[int, OpInfo] = {v: _op(v, n, m) for v, n, m in _TABLE}
BY_NAME: dict[str, OpInfo] = {o.name: o for o in OPCODES.values()}


class Op(enum.IntEnum):
    """Opcode numbers by name, for code that builds packets."""
    SEND_FIRST = 0x00
    SEND_MIDDLE = 0x01
    SEND_LAST = 0x02
    SEND_LAST_WITH_IMMEDIATE = 0x03
    SEND_ONLY = 0x04
    SEND_ONLY_WITH_IMMEDIATE = 0x05
    RDMA_WRITE_FIRST = 0x06
    RDMA_WRITE_MIDDLE = 0x07
    RDMA_WRITE_LAST = 0x08
    RDMA_WRITE_LAST_WITH_IMMEDIATE = 0x09
    RDMA_WRITE_ONLY = 0x0A
    RDMA_WRITE_ONLY_WITH_IMMEDIATE = 0x0B
    RDMA_READ_REQUEST = 0x0C
    RDMA_READ_RESPONSE_FIRST = 0x0D
    RDMA_READ_RESPONSE_MIDDLE = 0x0E
    RDMA_READ_RESPONSE_LAST = 0x0F
    RDMA_READ_RESPONSE_ONLY = 0x10
    ACKNOWLEDGE = 0x11
    ATOMIC_ACKNOWLEDGE = 0x12
    COMPARE_SWAP = 0x13
    FETCH_ADD = 0x14
    SEND_LAST_WITH_INVALIDATE = 0x16
    SEND_ONLY_WITH_INVALIDATE = 0x17
    CNP = 0x81
    NATIVE_SEND = 0xC0
    NATIVE_SEND_IMM = 0xC1
    NATIVE_WRITE = 0xC2
    NATIVE_WRITE_IMM = 0xC3
    NATIVE_READ_REQ = 0xC4
    NATIVE_READ_RESP = 0xC5
    NATIVE_SACK = 0xC6


assert {o.value for o in Op} == set(OPCODES), "Op enum and opcode table disagree"
assert all(OPCODES[o.value].name == o.name for o in Op)


def opinfo(opcode: int) -> OpInfo | None:
    return OPCODES.get(opcode)


def opcode_name(opcode: int) -> str:
    o = OPCODES.get(opcode)
    return o.name if o else f"UNKNOWN_{opcode:#04x}"
