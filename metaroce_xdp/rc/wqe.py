"""Work queue elements as the transport tracks them."""
from __future__ import annotations

import numpy as np

from ..verbs_types import SendWR, WCOpcode, WROpcode

WC_OF_WR = {
    WROpcode.RDMA_WRITE: WCOpcode.RDMA_WRITE,
    WROpcode.RDMA_WRITE_WITH_IMM: WCOpcode.RDMA_WRITE,
    WROpcode.SEND: WCOpcode.SEND,
    WROpcode.SEND_WITH_IMM: WCOpcode.SEND,
    WROpcode.SEND_WITH_INV: WCOpcode.SEND,
    WROpcode.RDMA_READ: WCOpcode.RDMA_READ,
    WROpcode.ATOMIC_CMP_AND_SWP: WCOpcode.COMP_SWAP,
    WROpcode.ATOMIC_FETCH_AND_ADD: WCOpcode.FETCH_ADD,
}


class SendWQE:
    """One posted send WR and its progress.

    For SEND/WRITE `data` is the message (a view of the MR when the WR has
    one SGE, a gathered copy otherwise).  For READ/ATOMIC `sinks` lists the
    (mr_mem, offset, length) pieces the response is scattered into.
    """

    __slots__ = ("wr", "opcode", "length", "data", "sinks", "first_psn", "npsn", "sent", "done",
                 "resp_bytes", "signaled", "is_rd_atomic", "fence", "status_error", "burst_args", "restart_psns",
                 "mrs")

    def __init__(self, wr: SendWR, length: int, data: np.ndarray | None, sinks: list, signaled: bool) -> None:
        self.wr = wr
        self.opcode = wr.opcode
        self.length = length
        self.data = data
        self.sinks = sinks
        self.first_psn: int | None = None   # assigned when first sent; kept across retries
        self.npsn = 0                       # PSNs the message occupies
        self.sent = 0                       # packets (request side) generated in the current pass
        self.done = False
        self.resp_bytes = 0                 # READ: bytes placed so far
        self.restart_psns: set | None = None  # READ: PSNs it asked for the rest at; a FIRST/ONLY may start there (MR-NAK-012)
        self.signaled = signaled
        self.is_rd_atomic = wr.opcode in (WROpcode.RDMA_READ, WROpcode.ATOMIC_CMP_AND_SWP,
                                          WROpcode.ATOMIC_FETCH_AND_ADD)
        self.fence = False
        self.status_error = None
        self.burst_args = None              # cached arguments of burst.tx_segment
        self.mrs: tuple = ()                # READ/ATOMIC: the MRs of `sinks`, checked before placing (MR-MEM-035)

    @property
    def last_psn(self) -> int:
        return ((self.first_psn or 0) + self.npsn - 1) & 0xFFFFFF

    def __repr__(self) -> str:
        return (f"SendWQE(wr_id={self.wr.wr_id}, {self.opcode.name}, len={self.length}, "
                f"psn={self.first_psn}+{self.npsn}, sent={self.sent}, done={self.done})")


class RecvWQE:
    """A posted receive WR; `sinks` is None when its scatter list failed the local checks (MR-MEM-020).
    `mrs` are the MRs its pieces lie in: a deregistered or invalidated one fails the WQE when the
    responder comes to use it (MR-MEM-020, MR-MEM-033), since the pieces were checked at post time."""
    __slots__ = ("wr_id", "sinks", "length", "mrs")

    def __init__(self, wr_id: int, sinks: list | None, length: int, mrs: tuple = ()) -> None:
        self.wr_id = wr_id
        self.sinks = sinks
        self.length = length
        self.mrs = mrs

    def usable(self) -> bool:
        """The local checks still hold: every piece's MR is registered and valid."""
        return self.sinks is not None and all(mr.valid for mr in self.mrs)


def scatter(sinks: list, offset: int, data: np.ndarray) -> bool:
    """Copy data into the scatter list at byte offset; False when it does not fit."""
    n = len(data)
    if n == 0:
        return True
    pos = 0
    base = 0
    for mem, moff, mlen in sinks:
        if offset < base + mlen:
            start = max(offset - base, 0)
            take = min(mlen - start, n - pos)
            mem[moff + start:moff + start + take] = data[pos:pos + take]
            pos += take
            offset += take
            if pos == n:
                return True
        base += mlen
    return pos == n
