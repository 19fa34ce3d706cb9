"""Verbs vocabulary: enums, work requests, completions and typed errors.

Numbers follow libibverbs (`enum ibv_qp_state`, `ibv_wc_status`,
`ibv_wr_opcode`, `ibv_access_flags`) so that users who know `ibv_*` read
them without a table, and spec 07-qp-state.md cites the same values.
"""
from __future__ import annotations

import enum
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence


class QPState(enum.IntEnum):
    RESET = 0
    INIT = 1
    RTR = 2
    RTS = 3
    SQD = 4
    SQE = 5
    ERR = 6


class WCStatus(enum.IntEnum):
    SUCCESS = 0
    LOC_LEN_ERR = 1
    LOC_QP_OP_ERR = 2
    LOC_EEC_OP_ERR = 3
    LOC_PROT_ERR = 4
    WR_FLUSH_ERR = 5
    MW_BIND_ERR = 6
    BAD_RESP_ERR = 7
    LOC_ACCESS_ERR = 8
    REM_INV_REQ_ERR = 9
    REM_ACCESS_ERR = 10
    REM_OP_ERR = 11
    RETRY_EXC_ERR = 12
    RNR_RETRY_EXC_ERR = 13
    LOC_RDD_VIOL_ERR = 14
    REM_INV_RD_REQ_ERR = 15
    REM_ABORT_ERR = 16
    INV_EECN_ERR = 17
    INV_EEC_STATE_ERR = 18
    FATAL_ERR = 19
    RESP_TIMEOUT_ERR = 20
    GENERAL_ERR = 21


class WROpcode(enum.IntEnum):
    RDMA_WRITE = 0
    RDMA_WRITE_WITH_IMM = 1
    SEND = 2
    SEND_WITH_IMM = 3
    RDMA_READ = 4
    ATOMIC_CMP_AND_SWP = 5
    ATOMIC_FETCH_AND_ADD = 6
    SEND_WITH_INV = 9                   # IBV_WR_SEND_WITH_INV (MR-RC-001); 7, 8 (LOCAL_INV, BIND_MW) not offered


class WCOpcode(enum.IntEnum):
    SEND = 0
    RDMA_WRITE = 1
    RDMA_READ = 2
    COMP_SWAP = 3
    FETCH_ADD = 4
    RECV = 128
    RECV_RDMA_WITH_IMM = 129


class Access(enum.IntFlag):
    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4
    REMOTE_ATOMIC = 8


class SendFlags(enum.IntFlag):
    FENCE = 1
    SIGNALED = 2
    SOLICITED = 4
    INLINE = 8


class WCFlags(enum.IntFlag):
    GRH = 1
    WITH_IMM = 2
    WITH_INV = 8          # IBV_WC_WITH_INV (1 << 3)


# ---- errors -----------------------------------------------------------------
class VerbsError(Exception):
    """Base of the API's typed errors: each says what was wrong and what to do."""


class InvalidArgument(VerbsError, ValueError):
    pass


class InvalidState(VerbsError):
    """The QP's state does not allow the call (e.g. post_send before RTS)."""


class Busy(InvalidState):
    """EBUSY: the call must wait until the QP is idle (SQD -> SQD while the send queue drains, MR-QP-014)."""


class QueueFull(VerbsError):
    """The send or receive queue is full: poll the CQ, then post again."""


class ResourceError(VerbsError):
    """A resource is exhausted or still in use (destroying a PD with MRs ...)."""


class Unsupported(InvalidArgument):
    """The endpoint does not implement this (the message names it): the compiled plane in process and
    metaroced raise the same class."""


# ---- work requests and completions ------------------------------------------------
@dataclass(frozen=True)
class SGE:
    addr: int
    length: int
    lkey: int


@dataclass
class SendWR:
    wr_id: int
    opcode: WROpcode
    sg_list: Sequence[SGE] = ()
    send_flags: SendFlags = SendFlags.SIGNALED
    remote_addr: int = 0
    rkey: int = 0
    imm_data: int = 0
    compare_add: int = 0
    swap: int = 0
    invalidate_rkey: int = 0            # SEND_WITH_INV: the peer's key to invalidate (IETH, MR-MEM-040)


@dataclass
class RecvWR:
    wr_id: int
    sg_list: Sequence[SGE] = ()


@dataclass
class WC:
    wr_id: int
    status: WCStatus
    opcode: WCOpcode
    byte_len: int = 0
    qp_num: int = 0
    imm_data: int | None = None
    wc_flags: WCFlags = WCFlags(0)
    vendor_err: int = 0
    invalidated_rkey: int | None = None   # with WCFlags.WITH_INV (a union with imm_data in libibverbs)

    def __repr__(self) -> str:
        imm = f" imm={self.imm_data:#x}" if self.imm_data is not None else ""
        return (f"WC(wr_id={self.wr_id}, {self.status.name}, {self.opcode.name}, "
                f"byte_len={self.byte_len}, qp={self.qp_num:#x}{imm})")


@dataclass
class QPCap:
    max_send_wr: int = 1024
    max_recv_wr: int = 1024
    max_send_sge: int = 16
    max_recv_sge: int = 16


@dataclass
class QPAttr:
    """Attributes for QP.modify, named as in struct ibv_qp_attr."""
    qp_state: QPState | None = None
    qp_access_flags: Access | None = None
    pkey_index: int | None = None
    port_num: int | None = None
    path_mtu: int | None = None          # bytes: 256 .. 4096
    dest_qp_num: int | None = None
    rq_psn: int | None = None
    sq_psn: int | None = None
    max_dest_rd_atomic: int | None = None
    max_rd_atomic: int | None = None
    min_rnr_timer: int | None = None
    timeout: int | None = None
    retry_cnt: int | None = None
    rnr_retry: int | None = None
    dgid: str | None = None              # peer IP address (IPv4 or IPv6 text)
    dmac: str | None = None              # peer MAC; resolved from the neighbour table when None
    sport: int | None = None             # UDP source port (compat: per-QP entropy)
    dscp: int | None = None
    ecn: bool | None = None              # INIT -> RTR: False sends Not-ECT and no CNP for CE marks (MR-ECN-011)
    en_sqd_async_notify: bool | None = None   # RTS -> SQD: raise IBV_EVENT_SQ_DRAINED when drained
    cur_qp_state: QPState | None = None   # IBV_QP_CUR_STATE: must equal the QP's state (MR-QP-006)
    alt_path: Any = None                  # IBV_QP_ALT_PATH: always refused, no path migration (MR-QP-008)
    path_mig_state: str | None = None     # IBV_QP_PATH_MIG_STATE: only "MIGRATED" (MR-QP-008)
    profile: str | None = None            # INIT -> RTR: the agreed profile, "compat" (default) or "native" (MR-NAT-001)
    native_params: dict | None = None     # INIT -> RTR, native: parameters of 04 4.7 / 05 5.7.1 (native.layout.params)

    def given(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


PATH_MTUS = (256, 512, 1024, 2048, 4096)
IBV_MTU_ENUM = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}

# IBTA RNR NAK timer table (AETH timer code -> microseconds), Table 3-5 (MR-RNR-004).
RNR_TIMER_US = (
    655360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920,
    2560, 3840, 5120, 7680, 10240, 15360, 20480, 30720, 40960, 61440, 81920, 122880,
    163840, 245760, 327680, 491520,
)


def local_ack_timeout_ns(timeout: int) -> int | None:
    """MR-RETRY-001: 4.096 us x 2^timeout; 0 means infinite (None)."""
    if timeout == 0:
        return None
    return (4096 << timeout)


_WC_VERB = {WCOpcode.SEND: "SEND", WCOpcode.RDMA_WRITE: "WRITE", WCOpcode.RDMA_READ: "READ",
            WCOpcode.COMP_SWAP: "ATOMIC CMP_AND_SWP", WCOpcode.FETCH_ADD: "ATOMIC FETCH_AND_ADD",
            WCOpcode.RECV: "RECV", WCOpcode.RECV_RDMA_WITH_IMM: "RECV (WRITE with immediate)"}


def wc_failure(wc: WC, reason: str | None = None) -> str:
    """One line for a failed completion: its operation, status and why, e.g.
    'WRITE failed: RETRY_EXC_ERR, retries exhausted (local ACK timeout)'.

    `reason` is the QP's error reason (QP.query()["error"], the `why` of QP.to_error);
    WR_FLUSH_ERR completions say that the QP was already in error, and why."""
    verb = _WC_VERB.get(wc.opcode, getattr(wc.opcode, "name", str(wc.opcode)))
    status = wc.status.name if isinstance(wc.status, WCStatus) else str(wc.status)
    if wc.status == WCStatus.WR_FLUSH_ERR:
        detail = "flushed: the QP was in error" + (f" ({reason})" if reason else "")
    else:
        detail = reason or "no reason recorded"
    return f"{verb} failed: {status}, {detail} (wr_id {wc.wr_id}, QP {wc.qp_num:#x})"


# ---- asynchronous events, as ibv_get_async_event delivers them (spec 07-qp-state.md) ----
#
# An endpoint raises one where the spec asks: a CQ overflow (IBV_EVENT_CQ_ERR, MR-QP-036), a QP moved to ERR by an
# error no send completion reports (IBV_EVENT_QP_FATAL / _REQ_ERR / _ACCESS_ERR, MR-QP-030, MR-QP-036), the first
# request accepted in RTR (IBV_EVENT_COMM_EST, MR-QP-021), a drained send queue in SQD (IBV_EVENT_SQ_DRAINED,
# MR-QP-013).  Each Context has one bounded queue (`Context.async_events`); the application takes events with
# `Context.get_async_event(timeout)`.  Numbers are libibverbs' `enum ibv_event_type`.

class EventType(enum.IntEnum):
    """enum ibv_event_type (libibverbs verbs.h), same numbers."""
    CQ_ERR = 0
    QP_FATAL = 1
    QP_REQ_ERR = 2
    QP_ACCESS_ERR = 3
    COMM_EST = 4
    SQ_DRAINED = 5
    PATH_MIG = 6
    PATH_MIG_ERR = 7
    DEVICE_FATAL = 8
    PORT_ACTIVE = 9
    PORT_ERR = 10
    LID_CHANGE = 11
    PKEY_CHANGE = 12
    SM_CHANGE = 13
    SRQ_ERR = 14
    SRQ_LIMIT_REACHED = 15
    QP_LAST_WQE_REACHED = 16
    CLIENT_REREGISTER = 17
    GID_CHANGE = 18
    WQ_FATAL = 19
    # MetaRoCE's own, outside libibverbs' numbers: the queue of events was full and `count` of them were
    # dropped (metaroced tells a client that stopped reading; AsyncEvent.count says how many)
    EVENTS_LOST = 256


# libibverbs spellings, for code written against ibv_event_type
IBV_EVENT_CQ_ERR = EventType.CQ_ERR
IBV_EVENT_QP_FATAL = EventType.QP_FATAL
IBV_EVENT_QP_REQ_ERR = EventType.QP_REQ_ERR
IBV_EVENT_QP_ACCESS_ERR = EventType.QP_ACCESS_ERR
IBV_EVENT_COMM_EST = EventType.COMM_EST
IBV_EVENT_SQ_DRAINED = EventType.SQ_DRAINED
IBV_EVENT_QP_LAST_WQE_REACHED = EventType.QP_LAST_WQE_REACHED


@dataclass(frozen=True)
class AsyncEvent:
    """struct ibv_async_event: the type and the element it is about (a QP or a CQ), plus why."""
    event_type: EventType
    qp: Any = None
    cq: Any = None
    reason: str = ""
    count: int = 0                # EVENTS_LOST: how many were dropped

    @property
    def qp_num(self) -> int | None:
        return self.qp.qp_num if self.qp is not None else None

    def __repr__(self) -> str:
        what = f" qp={self.qp.qp_num:#x}" if self.qp is not None else ""
        what += " cq" if self.cq is not None else ""
        return f"AsyncEvent(IBV_EVENT_{self.event_type.name}{what}{': ' + self.reason if self.reason else ''})"


class AsyncEventQueue:
    """A bounded FIFO of events.  When it is full the new event is dropped and counted in `overruns`
    (the earliest events, which name the first failure, are the ones kept)."""

    def __init__(self, depth: int = 1024) -> None:
        self.depth = depth
        self.q: deque[AsyncEvent] = deque()
        self.raised = 0
        self.overruns = 0
        self.ready = threading.Event()

    def put(self, ev: AsyncEvent) -> None:
        self.raised += 1
        if len(self.q) >= self.depth:
            self.overruns += 1
            return
        self.q.append(ev)
        self.ready.set()

    def get(self) -> AsyncEvent | None:
        if not self.q:
            return None
        ev = self.q.popleft()
        if not self.q:
            self.ready.clear()
        return ev

    def __len__(self) -> int:
        return len(self.q)

    def __iter__(self):
        return iter(list(self.q))


__all__ = [n for n in dir() if not n.startswith("_")]
_ = field
