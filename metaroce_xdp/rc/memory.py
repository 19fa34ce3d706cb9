"""Protection domains, memory regions and keys (spec 08-memory.md, MR-MEM).

A key is `index << 8 | tag`: the index finds the MR in the table, the 8-bit
tag is random per registration so that a stale or guessed key misses
(MR-MEM-008, MR-MEM-010, MR-SEC-001).  Every remote access is checked -- key, PD, access flag, bounds --
before any byte of memory is touched.
"""
from __future__ import annotations

import secrets
from typing import Any

import numpy as np

from ..verbs_types import Access, InvalidArgument, ResourceError

MAX_MRS = 1 << 16


def as_u8(buf: Any) -> np.ndarray:
    """A writable flat uint8 view over the caller's memory (numpy array, bytearray, memoryview)."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise InvalidArgument("MR memory must be C-contiguous")
        if not buf.flags.writeable:
            raise InvalidArgument("MR memory must be writable")
        return buf.reshape(-1).view(np.uint8)
    if isinstance(buf, (bytearray, memoryview)):
        mv = memoryview(buf)
        if mv.readonly:
            raise InvalidArgument("MR memory must be writable (bytes is read-only: use bytearray)")
        return np.frombuffer(mv, dtype=np.uint8)
    raise InvalidArgument(f"MR memory must be a numpy array, bytearray or memoryview, not {type(buf).__name__}")


class PD:
    def __init__(self, ctx: Any, handle: int) -> None:
        self.ctx = ctx
        self.handle = handle
        self.mrs: set[int] = set()
        self.qps: set[int] = set()
        self.closed = False

    def reg_mr(self, buf: Any, access: Access = Access.LOCAL_WRITE, *, remote_invalidate: bool = False) -> "MR":
        return self.ctx.reg_mr(self, buf, access, remote_invalidate=remote_invalidate)

    def __repr__(self) -> str:
        return f"PD({self.handle})"


class MR:
    def __init__(self, pd: PD, mem: np.ndarray, access: Access, index: int, tag: int,
                 remote_invalidate: bool = False) -> None:
        self.pd = pd
        self.mem = mem
        self.addr = int(mem.ctypes.data) if mem.size else 0
        self.length = int(mem.size)
        self.access = Access(access)
        self.index = index
        self.lkey = (index << 8) | tag
        self.rkey = self.lkey
        self.valid = True
        self.remote_invalidate = remote_invalidate   # a SEND WITH INVALIDATE may name it (MR-MEM-042)

    def offset_of(self, va: int, length: int) -> int | None:
        """Offset of [va, va+length) inside the MR, or None when out of bounds (MR-MEM-024)."""
        off = va - self.addr
        if off < 0 or length < 0 or off + length > self.length:
            return None
        return off

    def dereg(self) -> None:
        self.pd.ctx.dereg_mr(self)

    def __repr__(self) -> str:
        return f"MR(addr={self.addr:#x}, len={self.length}, lkey={self.lkey:#x}, access={self.access!r})"


class KeyTable:
    """lkey/rkey -> MR, with per-registration random tags."""

    def __init__(self) -> None:
        self.by_index: dict[int, MR] = {}
        self.next_index = 1                 # index 0 is never assigned (MR-MEM-009)
        self.last_tag: dict[int, int] = {}  # index -> the tag it had last (at most MAX_MRS entries)

    def add(self, pd: PD, mem: np.ndarray, access: Access, remote_invalidate: bool = False) -> MR:
        if len(self.by_index) >= MAX_MRS - 1:
            raise ResourceError(f"too many MRs ({MAX_MRS - 1}); deregister some")
        idx = self.next_index
        while idx in self.by_index:
            idx = idx % (MAX_MRS - 1) + 1
        self.next_index = idx % (MAX_MRS - 1) + 1
        # a reused index never gets the tag it had before, so the old key stays dead (MR-MEM-011)
        tag = secrets.randbelow(256)
        last = self.last_tag.get(idx)
        if last is not None and tag == last:
            tag = (tag + 1 + secrets.randbelow(255)) & 0xFF
        self.last_tag[idx] = tag
        mr = MR(pd, mem, access, idx, tag, remote_invalidate)
        self.by_index[idx] = mr
        return mr

    def remove(self, mr: MR) -> None:
        """Deregister: from now on no packet reaches the MR's memory (MR-MEM-033)."""
        if self.by_index.get(mr.index) is mr:
            del self.by_index[mr.index]
        mr.valid = False

    def lookup(self, key: int) -> MR | None:
        """MR-MEM-014: the entry at the key's index, valid and with the key's tag."""
        mr = self.by_index.get(key >> 8)
        if mr is None or mr.lkey != key or not mr.valid:
            return None
        return mr

    def check_invalidate(self, key: int, pd: PD) -> MR | None:
        """MR-MEM-041: the MR a SEND WITH INVALIDATE's IETH key may invalidate -- valid, of the QP's PD,
        registered as remotely invalidatable (MR-MEM-042) -- or None."""
        mr = self.lookup(key)
        if mr is None or mr.pd is not pd or not mr.remote_invalidate:
            return None
        return mr

    def check_remote(self, key: int, pd: PD, va: int, length: int, need: Access) -> tuple[MR, int] | None:
        """MR-MEM-021 to MR-MEM-024: key, PD, access and bounds all pass -> (mr, offset); else
        None, the same answer whichever check failed (MR-MEM-016)."""
        mr = self.lookup(key)
        if mr is None or mr.pd is not pd or not (mr.access & need):
            return None
        off = mr.offset_of(va, length)
        if off is None:
            return None
        return mr, off

    def check_local(self, key: int, pd: PD, addr: int, length: int, need: Access = Access(0)) -> tuple[MR, int] | None:
        """MR-MEM-020: an SGE's lkey, PD, bounds and (when written) LOCAL_WRITE."""
        mr = self.lookup(key)
        if mr is None or mr.pd is not pd or (need and not (mr.access & need)):
            return None
        off = mr.offset_of(addr, length)
        if off is None:
            return None
        return mr, off
