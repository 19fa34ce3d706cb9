"""ibv_comp_channel: armed CQs report completion events here, and `get_cq_event`
(ibv_get_cq_event) hands out the CQ of the oldest one.

A subclass says how a waiter makes progress, in `_lock`, `_threaded`, `_progress` and `_idle`:
`dp.context.CompChannel` runs the compiled loop (a lock of its own, and `Plane.run` while no
progress thread runs)."""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any


class CompChannelBase:
    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.q: deque = deque()
        self.ready = threading.Event()

    # -- what a plane supplies ------------------------------------------------
    def _lock(self):                        # guards self.q
        raise NotImplementedError

    def _threaded(self) -> bool:            # a progress thread runs: just wait for `ready`
        raise NotImplementedError

    def _progress(self) -> None:            # one round of progress, no progress thread
        raise NotImplementedError

    def _idle(self, left: float | None) -> None:   # no event yet, no progress thread: make more progress
        pass

    # -- ibv_comp_channel -------------------------------------------------------
    def _notify(self, cq: Any) -> None:
        with self._lock():
            self.q.append(cq)
            self.ready.set()

    def get_cq_event(self, timeout: float | None = 0.0) -> Any:
        """ibv_get_cq_event: the CQ of the oldest completion event (its `cq_context` is the one given to
        create_cq), waiting up to `timeout` seconds (None: for ever; 0: just look).  Drives progress
        when there is no progress thread.  None when no event came in time.  The CQ is disarmed:
        call its req_notify again for the next event."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            threaded = self._threaded()
            if not threaded:
                self._progress()
            with self._lock():
                if self.q:
                    cq = self.q.popleft()
                    cq.events += 1
                    if not self.q:
                        self.ready.clear()
                    return cq
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            if threaded:
                self.ready.wait(0.01 if left is None else min(left, 0.01))
            else:
                self._idle(left)
