"""Asynchronous events, as ibv_get_async_event delivers them (spec 07-qp-state.md).

The engine raises an event where the spec asks for one: a CQ overflow
(IBV_EVENT_CQ_ERR, MR-QP-036), a QP moved to ERR by an error that no send
completion reports (IBV_EVENT_QP_FATAL / _REQ_ERR / _ACCESS_ERR, MR-QP-030,
MR-QP-036), the first request accepted in RTR (IBV_EVENT_COMM_EST,
MR-QP-021), a drained send queue in SQD (IBV_EVENT_SQ_DRAINED, MR-QP-013).
Each Context has one bounded queue (`Context.async_events`); the
application takes events with `Context.get_async_event(timeout)`.  Event
numbers are those of libibverbs' `enum ibv_event_type`.
"""
from __future__ import annotations

import enum
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any


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
