"""Keeps running QPs on the kernel's current path to their peer.

A QP's frame template carries the next hop's MAC (the gateway's when the peer is
routed).  That next hop changes under running QPs: a router fails over and its
MAC moves, or a route is switched to another gateway.  PathWatch re-resolves a
QP's path (netinfo.PathResolver: route, then neighbour entry) when

  * the kernel reports a route or neighbour event on the interface (the
    resolver thread follows rtnetlink), which also covers a responder-only QP
    whose ACKs would otherwise go to a stale MAC with no timer of its own;
  * the QP's local ACK timeout fires (Engine.progress calls `recheck`), in case
    an event was missed.

Resolution runs on the resolver's thread and never waits for ARP/ND (it sends
one probe; the neighbour event that follows brings the answer back).  Results
go through a queue that the progress loop applies under the engine lock, so
the resolver thread never takes that lock.  Neighbours: rc/engine.py,
netinfo.py.
"""
from __future__ import annotations

import logging
import sys
from collections import deque
from typing import TYPE_CHECKING

from ..netinfo import NetInfoError, NextHop, PathResolver
from ..verbs_types import QPState

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("metaroce.path")

LIVE = (QPState.RTR, QPState.RTS, QPState.SQD)


class PathWatch:
    def __init__(self, engine: "Engine", resolver: PathResolver) -> None:
        self.engine = engine
        self.resolver = resolver
        self.tracked: dict[int, str] = {}          # qpn -> dgid of QPs on a resolved (not given) path
        self.updates: deque = deque()              # (qpn, dgid, NextHop | None | NetInfoError)
        resolver.watch(self._on_event)
        # The resolver thread needs the GIL a few times per lookup; with the default 5 ms switch
        # interval a busy-polling application delays a path change by tens of ms, longer than a
        # short local ACK timeout.  0.5 ms, as for progress threads (Engine.start).
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))

    # -- engine side (under the engine lock) ------------------------------------------
    def track(self, qpn: int, dgid: str) -> None:
        self.tracked[qpn] = dgid

    def recheck(self, qpn: int, dgid: str) -> None:
        """Re-resolve one QP's path soon; never waits."""
        self.resolver.submit(self._check, {qpn: dgid})

    def apply(self) -> None:
        """Apply resolution results: a QP whose next hop changed gets a new template."""
        eng = self.engine
        while self.updates:
            qpn, dgid, hop = self.updates.popleft()
            qp = eng.qps.get(qpn)
            if qp is None or self.tracked.get(qpn) != dgid:
                if qp is None:
                    self.tracked.pop(qpn, None)
                continue
            if qp.state not in LIVE or qp.dgid != dgid:
                continue
            eng.stats["path_resolves"] += 1
            qp.path_resolves += 1
            if hop is None:
                continue                             # the kernel is resolving it: an event follows
            if isinstance(hop, Exception):
                eng.stats["path_errors"] += 1
                qp.path_error = str(hop)
                log.warning("QP %#x: path to %s: %s", qpn, dgid, hop)
                continue
            qp.path_error = None
            if qp.next_hop is not None and hop.mac == qp.dmac and hop.src == qp.next_hop.src:
                qp.next_hop = hop
                continue
            try:
                template = eng.build_template(qp, hop.mac, hop.src)
            except NetInfoError as e:
                eng.stats["path_errors"] += 1
                qp.path_error = str(e)
                log.warning("QP %#x: %s", qpn, e)
                continue
            old = qp.next_hop
            qp.template, qp.dmac, qp.next_hop = template, hop.mac, hop
            eng.stats["path_changes"] += 1
            qp.path_changes += 1
            log.info("QP %#x: next hop to %s now %s (%s), was %s (%s)", qpn, dgid, hop.hop, hop.mac,
                     old.hop if old else "?", old.mac if old else "?")
            req = qp.requester
            if qp.state in (QPState.RTS, QPState.SQD) and req.outstanding():
                # What left since the change went to the old next hop: resend it now rather than
                # at the next timeout, without spending the retry budget (the path lost it, not
                # the peer).
                req.retry_from(req.oldest_unacked_psn())
                qp.completer.last_progress = eng.now

    # -- resolver thread ------------------------------------------------------------------
    def _on_event(self) -> None:
        self._check(dict(self.tracked))             # a C-level copy: safe against the engine's writes

    def _check(self, todo: dict[int, str]) -> None:
        by_dst: dict[str, list[int]] = {}
        for qpn, dgid in todo.items():
            by_dst.setdefault(dgid, []).append(qpn)
        for dgid, qpns in by_dst.items():
            try:
                hop: NextHop | None | NetInfoError = self.resolver.lookup(dgid)
            except NetInfoError as e:
                hop = e
            for qpn in qpns:
                self.updates.append((qpn, dgid, hop))
        if by_dst:
            self.engine.kick()
