"""The queue pair: state machine (spec 07-qp-state.md, MR-QP) and the glue
between its three roles (requester, responder, completer) and the engine.
"""
from __future__ import annotations

import ipaddress
import logging
import time
from typing import TYPE_CHECKING, Iterable

import numpy as np

from ..verbs_types import (PATH_MTUS, Access, Busy, InvalidArgument, InvalidState, QPAttr, QPCap, QPState,
                           QueueFull, RecvWR, SendFlags, SendWR, WC, WCOpcode, WCStatus, WROpcode)
from ..wire.opcodes import MI
from .completer import Completer
from ..verbs_types import EventType
from .dcqcn import Dcqcn
from .requester import Requester
from .responder import Responder
from .wqe import WC_OF_WR, RecvWQE, SendWQE

if TYPE_CHECKING:
    from .engine import CQ, Context
    from .memory import PD
    from .rxparse import RxPkt

log = logging.getLogger("metaroce.qp")

# MR-QP-004 (Table 7-2): allowed transitions (IBTA 10.3.1, as in ibv_modify_qp); any state -> RESET and -> ERR.
# No transition enters SQE (MR-QP-003).
TRANSITIONS = {
    QPState.RESET: {QPState.INIT},
    QPState.INIT: {QPState.INIT, QPState.RTR},
    QPState.RTR: {QPState.RTS},
    QPState.RTS: {QPState.RTS, QPState.SQD},
    QPState.SQD: {QPState.SQD, QPState.RTS},
    QPState.SQE: {QPState.RTS},
    QPState.ERR: set(),
}
# MR-QP-005.  Fewer attributes are required than Table 7-2 lists: the others have defaults.
REQUIRED = {
    (QPState.INIT, QPState.RTR): ("dest_qp_num", "rq_psn", "path_mtu", "dgid"),
    (QPState.RTR, QPState.RTS): ("sq_psn",),
}
OPTIONAL = {
    (QPState.RESET, QPState.INIT): ("qp_access_flags", "pkey_index", "port_num"),
    (QPState.INIT, QPState.INIT): ("qp_access_flags", "pkey_index", "port_num"),
    (QPState.INIT, QPState.RTR): ("qp_access_flags", "max_dest_rd_atomic", "min_rnr_timer", "dmac", "sport",
                                  "dscp", "pkey_index"),
    (QPState.RTR, QPState.RTS): ("timeout", "retry_cnt", "rnr_retry", "max_rd_atomic", "qp_access_flags",
                                 "min_rnr_timer"),
    (QPState.RTS, QPState.RTS): ("qp_access_flags", "min_rnr_timer", "timeout", "retry_cnt", "rnr_retry"),
    (QPState.RTS, QPState.SQD): ("en_sqd_async_notify",),
    (QPState.SQD, QPState.RTS): ("qp_access_flags", "timeout", "retry_cnt", "rnr_retry"),
    (QPState.SQE, QPState.RTS): ("qp_access_flags",),
}

_ATTR_FIELDS = ("access", "pmtu", "dest_qp", "dgid", "dmac", "sport", "dscp")

REQ_STATES = (QPState.RTR, QPState.RTS, QPState.SQD)           # accept requests (MR-QP-020)
ACK_STATES = (QPState.RTS, QPState.SQD, QPState.SQE)           # accept responses


class QP:
    def __init__(self, ctx: "Context", pd: "PD", send_cq: "CQ", recv_cq: "CQ", cap: QPCap,
                 qp_num: int, sq_sig_all: bool) -> None:
        self.ctx = ctx
        self.pd = pd
        self.send_cq = send_cq
        self.recv_cq = recv_cq
        self.cap = cap
        self.qp_num = qp_num
        self.sq_sig_all = sq_sig_all
        self.state = QPState.RESET
        self.access = Access(0)
        self.pmtu = 1024
        self.dest_qp = 0
        self.dgid: str | None = None
        self.dmac: str | None = None
        self.next_hop = None                        # netinfo.NextHop when the engine resolved dmac
        self.path_resolves = 0                      # re-resolutions of the next hop (pathwatch.py)
        self.path_changes = 0                       # ... that changed it
        self.path_error: str | None = None
        self.sport = 0xC000 | (qp_num & 0x3FFF)     # one source port per QP in [0xC000, 0xFFFF] (MR-ENC-020)
        self.dscp = 26                              # MR-ECN-004
        self.ecn = bool(getattr(ctx.engine, "ecn", True))   # ECN on this QP, fixed at creation (MR-ECN-011)
        self.pkey = 0xFFFF                          # pkey_index 0 of the one-entry P_Key table (MR-BTH-009)
        self.dcqcn = Dcqcn(ctx.engine.dcqcn, time.monotonic_ns())   # CNPs and the sender's rate (dcqcn.py);
        # a fresh clock: the engine's round clock may be stale on an idle host, and alpha decays from creation
        self.attr_timeout = 14
        self.attr_retry_cnt = 7
        self.attr_rnr_retry = 7
        self.attr_min_rnr_timer = 12
        self.attr_max_rd_atomic = 1
        self.attr_max_dest_rd_atomic = 1
        self.template = None
        self.requester = Requester(self)
        self.responder = Responder(self)
        self.completer = Completer(self)
        self.error_reason: str | None = None
        self.cnp_discarded = 0                 # CNPs for this QP dropped in user space (MR-CC-039)
        self.comm_est = False                       # IBV_EVENT_COMM_EST raised (MR-QP-021)
        self.sq_draining = False                    # in SQD and not yet drained (MR-QP-013)
        self.sqd_notify = False                     # en_sqd_async_notify of the last RTS -> SQD

    # ---- the engine's services -------------------------------------------------
    def now(self) -> int:
        return self.ctx.engine.now

    def emit(self, opcode, psn, ack_req, se, ext, payload, off, plen) -> None:
        self.ctx.engine.emit(self, opcode, psn, ack_req, se, ext, payload, off, plen)

    def publish_snd_nxt(self) -> None:
        fa = self.ctx.engine.fast_ack
        if fa is not None:
            fa.publish_snd_nxt(self)

    def log(self, msg: str) -> None:
        log.debug("QP %#x: %s", self.qp_num, msg)

    def can_send(self) -> bool:
        """RTS sends everything; SQD only finishes and retransmits WQEs already started (the
        requester starts no new one there, MR-QP-013)."""
        return self.state in (QPState.RTS, QPState.SQD)

    def may_start_wqe(self) -> bool:
        return self.state == QPState.RTS

    def check_drained(self) -> None:
        """MR-QP-013: in SQD the QP is drained once no request packet is outstanding; then, if
        en_sqd_async_notify was set, IBV_EVENT_SQ_DRAINED (once per RTS -> SQD)."""
        if self.state == QPState.SQD and self.sq_draining and not self.requester.outstanding():
            self.sq_draining = False
            self.log("send queue drained")
            if self.sqd_notify:
                self.ctx.raise_event(EventType.SQ_DRAINED, qp=self, reason="send queue drained")

    # ---- state machine -------------------------------------------------------------
    def modify(self, attr: QPAttr) -> None:
        """ibv_modify_qp: move to attr.qp_state (or stay) setting the given attributes."""
        new = QPState(attr.qp_state) if attr.qp_state is not None else self.state
        given = attr.given()
        given.pop("qp_state", None)
        cur = given.pop("cur_qp_state", None)
        if cur is not None and QPState(cur) != self.state:          # MR-QP-006
            raise InvalidArgument(f"QP {self.qp_num:#x}: cur_qp_state {QPState(cur).name} but the QP is "
                                  f"{self.state.name}")
        if given.pop("alt_path", None) is not None:                 # MR-QP-008: no automatic path migration
            raise InvalidArgument(f"QP {self.qp_num:#x}: alternate paths are not supported")
        mig = given.pop("path_mig_state", None)
        if mig is not None and mig != "MIGRATED":                   # MR-QP-008
            raise InvalidArgument(f"QP {self.qp_num:#x}: path_mig_state {mig}: only MIGRATED")
        if new == QPState.RTR and self.state == QPState.INIT and "dgid" in given and "dmac" not in given:
            self.ctx.engine.prepare_path(given["dgid"])      # may wait for ARP/ND: not under the lock
        with self.ctx.engine.lock:
            if new == QPState.RESET:
                self._reset()
                return
            if new == QPState.ERR:
                self.to_error(None, "moved to ERR by the application")
                return
            if new not in TRANSITIONS[self.state]:
                raise InvalidState(f"QP {self.qp_num:#x}: {self.state.name} -> {new.name} is not a valid transition")
            if self.state == new == QPState.SQD and self.sq_draining:
                # EBUSY (MR-QP-014): wait for IBV_EVENT_SQ_DRAINED or poll until nothing is outstanding
                raise Busy(f"QP {self.qp_num:#x}: SQD -> SQD while the send queue is still draining "
                                   "(EBUSY); wait until it is drained")
            key = (self.state, new)
            missing = [a for a in REQUIRED.get(key, ()) if a not in given]
            if missing:
                raise InvalidArgument(f"QP {self.qp_num:#x}: {self.state.name} -> {new.name} needs {missing}")
            allowed = set(REQUIRED.get(key, ())) | set(OPTIONAL.get(key, ()))
            extra = sorted(set(given) - allowed)
            if extra:
                raise InvalidArgument(f"QP {self.qp_num:#x}: {self.state.name} -> {new.name} does not take {extra}")
            saved = {k: v for k, v in self.__dict__.items() if k.startswith("attr_") or k in _ATTR_FIELDS}
            try:
                self._apply(given)
                if key == (QPState.INIT, QPState.RTR):
                    template = self.ctx.engine.make_template(self)
            except BaseException:
                self.__dict__.update(saved)         # a failed modify changes nothing
                raise
            if key == (QPState.INIT, QPState.RTR):
                self.responder.reset(given["rq_psn"])
                self.template = template
            if key == (QPState.RTR, QPState.RTS):
                self.requester.reset(given["sq_psn"])
                self.completer.reset_budgets()
                self.completer.last_progress = self.now()
            prev = self.state
            self.state = new
            if new == QPState.SQD and prev == QPState.RTS:
                self.sq_draining = True
                self.sqd_notify = bool(given.get("en_sqd_async_notify", False))
            elif new == QPState.RTS:
                self.sq_draining = False                # SQD -> RTS resumes where it stopped (MR-QP-014)
            self.ctx.engine.qp_state_changed(self)
            self.log(f"-> {new.name}")
            self.check_drained()

    def _apply(self, given: dict) -> None:
        for k, v in given.items():
            if k == "qp_access_flags":
                self.access = Access(v)
            elif k == "path_mtu":
                if v not in PATH_MTUS:
                    raise InvalidArgument(f"path_mtu {v}: use one of {PATH_MTUS}")
                limit = self.ctx.engine.max_pmtu
                if v > limit:
                    raise InvalidArgument(f"path_mtu {v} exceeds what the interface carries ({limit})")
                self.pmtu = v
            elif k == "dest_qp_num":
                if not 0 < v < 1 << 24:
                    raise InvalidArgument(f"dest_qp_num {v:#x} is not a 24-bit QPN")
                self.dest_qp = v
            elif k in ("rq_psn", "sq_psn"):
                if not 0 <= v < 1 << 24:
                    raise InvalidArgument(f"{k} {v:#x} is not a 24-bit PSN")
            elif k == "dgid":
                try:
                    ipaddress.ip_address(v.removeprefix("::ffff:") if "." in v else v)
                except ValueError:
                    raise InvalidArgument(f"dgid {v!r} is not an IP address") from None
                self.dgid = v.removeprefix("::ffff:") if "." in v else v
            elif k == "dmac":
                self.dmac = v
            elif k in ("timeout", "min_rnr_timer"):
                if not 0 <= v <= 31:
                    raise InvalidArgument(f"{k} {v} must be 0..31")
                setattr(self, "attr_" + k, v)
            elif k in ("retry_cnt", "rnr_retry"):
                if not 0 <= v <= 7:
                    raise InvalidArgument(f"{k} {v} must be 0..7")
                setattr(self, "attr_" + k, v)
            elif k in ("max_rd_atomic", "max_dest_rd_atomic"):
                if not 0 <= v <= 16:
                    raise InvalidArgument(f"{k} {v} must be 0..16")
                setattr(self, "attr_" + k, v)
            elif k == "sport":
                self.sport = v
            elif k == "dscp":
                self.dscp = v

    def _reset(self) -> None:
        self.state = QPState.RESET
        self.dgid = None                        # the connected peer goes with the transport state (MR-QP-015, MR-QP-020)
        self.requester = Requester(self)
        self.responder = Responder(self)
        self.completer = Completer(self)
        self.error_reason = None
        self.comm_est = self.sq_draining = self.sqd_notify = False
        self.ctx.engine.qp_state_changed(self)

    def to_error(self, status: WCStatus | None, why: str) -> None:
        """Enter ERR (MR-QP-016): the WQE at the head completes with `status` first (MR-QP-023),
        the rest of both queues are flushed in posting order (MR-QP-027)."""
        if self.state == QPState.ERR:
            return
        self.log(f"-> ERR: {why}")
        self.error_reason = why
        self.state = QPState.ERR
        self.sq_draining = False
        sq = self.requester.sq
        first = True
        while sq:
            w = sq.pop(0)
            st = status if (first and status is not None and w.first_psn is not None) else WCStatus.WR_FLUSH_ERR
            first = False
            self.send_cq.push(WC(wr_id=w.wr.wr_id, status=st, opcode=WC_OF_WR[w.opcode], qp_num=self.qp_num))
        self.requester.cursor = 0
        cur = self.responder.cur_recv
        if cur is not None:                         # the receive WQE a partial SEND was filling (MR-QP-027)
            self.responder.cur_recv = None
            self.recv_cq.push(WC(wr_id=cur.wr_id, status=WCStatus.WR_FLUSH_ERR, opcode=WCOpcode.RECV,
                                 qp_num=self.qp_num))
        for r in self.responder.rq:
            self.recv_cq.push(WC(wr_id=r.wr_id, status=WCStatus.WR_FLUSH_ERR, opcode=WCOpcode.RECV,
                                 qp_num=self.qp_num))
        self.responder.rq.clear()
        self.ctx.engine.qp_state_changed(self)

    def fail_unsent(self, w: SendWQE) -> None:
        """MR-RC-022, MR-RC-008: a WQE whose local check failed completes with its status once it is
        the oldest (the WQEs before it complete as usual), nothing of it is sent, and the QP moves
        to ERR, flushing the WQEs after it."""
        self.requester.sq.remove(w)
        self.send_cq.push(WC(wr_id=w.wr.wr_id, status=w.status_error, opcode=WC_OF_WR[w.opcode],
                             qp_num=self.qp_num))
        self.to_error(None, f"{w.opcode.name} WR {w.wr.wr_id}: {w.status_error.name} (local scatter/gather list)")

    # ---- posting ------------------------------------------------------------------
    def _sinks(self, sg_list, need: Access, mrs: list | None = None) -> tuple[list | None, int]:
        """The SGEs as (memory, offset, length) pieces and their total length.  A zero-length SGE is
        skipped, its lkey unchecked (MR-MEM-032).  The pieces are None when an lkey, PD, bound or
        LOCAL_WRITE check fails (MR-MEM-020): that is reported by a completion, not here (MR-RC-022)."""
        sinks: list | None = []
        total = 0
        if len(sg_list) > self.cap.max_send_sge:
            raise InvalidArgument(f"{len(sg_list)} SGEs > max {self.cap.max_send_sge}")
        for sge in sg_list:
            if sge.length == 0:
                continue
            total += sge.length
            chk = self.ctx.keys.check_local(sge.lkey, self.pd, sge.addr, sge.length, need)
            if chk is None:
                sinks = None
            elif sinks is not None:
                mr, off = chk
                sinks.append((mr.mem, off, sge.length))
                if mrs is not None:
                    mrs.append(mr)
        return sinks, total

    def post_send(self, wrs: SendWR | Iterable[SendWR]) -> None:
        if isinstance(wrs, SendWR):
            wrs = [wrs]
        with self.ctx.engine.lock:
            if self.state == QPState.ERR:
                # MR-QP-018, MR-QP-028: accepted and flushed, after everything posted earlier
                for wr in wrs:
                    self.send_cq.push(WC(wr_id=wr.wr_id, status=WCStatus.WR_FLUSH_ERR,
                                         opcode=WC_OF_WR.get(wr.opcode, WCOpcode.SEND), qp_num=self.qp_num))
                return
            if self.state not in (QPState.RTS, QPState.SQD):     # MR-QP-018
                raise InvalidState(f"QP {self.qp_num:#x} is {self.state.name}: post_send needs RTS")
            staged: list[SendWQE] = []      # all or nothing: nothing is queued if one WR is bad
            for wr in wrs:
                if len(self.requester.sq) + len(staged) >= self.cap.max_send_wr:
                    raise QueueFull(f"send queue full ({self.cap.max_send_wr} WRs): poll the send CQ")
                try:
                    op = WROpcode(wr.opcode)
                except ValueError:
                    raise InvalidArgument(f"unknown send opcode {wr.opcode!r}") from None
                need = Access.LOCAL_WRITE if op in (WROpcode.RDMA_READ, WROpcode.ATOMIC_CMP_AND_SWP,
                                                    WROpcode.ATOMIC_FETCH_AND_ADD) else Access(0)
                mrs: list = []
                sinks, total = self._sinks(wr.sg_list, need, mrs)
                data = None
                # a bad SGE or a message over 2^31 bytes is accepted here and completes in error, without
                # a packet, when its turn comes (MR-RC-022, MR-MEM-020, MR-RC-008)
                error = (WCStatus.LOC_PROT_ERR if sinks is None else
                         WCStatus.LOC_LEN_ERR if total > 1 << 31 else None)
                if op in (WROpcode.ATOMIC_CMP_AND_SWP, WROpcode.ATOMIC_FETCH_AND_ADD):
                    if total != 8:
                        raise InvalidArgument("ATOMIC needs one 8-byte SGE for the original value")
                    if wr.remote_addr % 8:          # MR-XH-011: the AtomicETH VA is a multiple of 8
                        raise InvalidArgument(f"ATOMIC remote address {wr.remote_addr:#x} is not a multiple of 8")
                elif op != WROpcode.RDMA_READ and error is None:
                    if len(sinks) == 1:
                        mem, off, n = sinks[0]
                        data = mem[off:off + n]
                    elif sinks:
                        data = np.concatenate([m[o:o + n] for m, o, n in sinks])
                    else:
                        data = np.zeros(0, np.uint8)
                signaled = self.sq_sig_all or bool(wr.send_flags & SendFlags.SIGNALED)
                wqe = SendWQE(wr, total, data, sinks or [], signaled)
                wqe.status_error = error
                if op in (WROpcode.RDMA_READ, WROpcode.ATOMIC_CMP_AND_SWP, WROpcode.ATOMIC_FETCH_AND_ADD):
                    wqe.mrs = tuple(mrs)
                staged.append(wqe)
            self.requester.sq.extend(staged)
        self.ctx.engine.kick()

    def post_recv(self, wrs: RecvWR | Iterable[RecvWR]) -> None:
        if isinstance(wrs, RecvWR):
            wrs = [wrs]
        with self.ctx.engine.lock:
            if self.state == QPState.ERR:
                for wr in wrs:                       # MR-QP-017: accepted and flushed
                    self.recv_cq.push(WC(wr_id=wr.wr_id, status=WCStatus.WR_FLUSH_ERR, opcode=WCOpcode.RECV,
                                         qp_num=self.qp_num))
                return
            if self.state == QPState.RESET:
                raise InvalidState(f"QP {self.qp_num:#x} is RESET: post_recv needs INIT or later")
            staged = []
            for wr in wrs:
                if len(self.responder.rq) + len(staged) >= self.cap.max_recv_wr:
                    raise QueueFull(f"receive queue full ({self.cap.max_recv_wr} WRs)")
                mrs: list = []
                sinks, total = self._sinks(wr.sg_list, Access.LOCAL_WRITE, mrs)
                # a bad SGE is found by the responder before it places a byte (MR-MEM-020: NAK code 3),
                # and so is an MR deregistered after this post (MR-MEM-033)
                staged.append(RecvWQE(wr.wr_id, sinks, total, tuple(mrs)))
            self.responder.rq.extend(staged)
        self.ctx.engine.kick()

    # ---- input ---------------------------------------------------------------------
    def handle(self, pkt: "RxPkt") -> bool:
        """Dispatch a packet addressed to this QP: requests to the responder, responses to the
        completer (MR-OPC-006); False when the state refuses it (MR-QP-020)."""
        m = pkt.op.mask
        if m & MI.REQ:
            if self.state not in REQ_STATES:
                return False
            if self.state == QPState.RTR and not self.comm_est:
                epsn = self.responder.epsn
                self.responder.on_request(pkt)
                if self.responder.epsn != epsn and self.state == QPState.RTR:
                    # the first request accepted in RTR (MR-QP-021)
                    self.comm_est = True
                    self.ctx.raise_event(EventType.COMM_EST, qp=self, reason="first request accepted in RTR")
                return True
            self.responder.on_request(pkt)
            return True
        if m & MI.ACK:
            if self.state not in ACK_STATES:
                return False
            if pkt.opcode == 0x11:
                self.completer.on_syndrome(pkt.psn, pkt.syndrome, pkt.msn)
            else:
                self.completer.on_response(pkt)
            return True
        return False

    def query(self) -> dict:
        r, s, c = self.requester, self.responder, self.completer
        fast = self.ctx.engine.fast_ack
        kernel_stale = fast.stale_acks(self) if fast is not None else 0     # dropped by the XDP program
        return {
            "qpn": self.qp_num, "state": self.state.name, "dest_qpn": self.dest_qp, "dgid": self.dgid,
            "path_mtu": self.pmtu, "sq_psn": r.psn_next, "acked_psn": r.acked_psn, "rq_psn": s.epsn,
            "msn": s.msn, "sq_depth": len(r.sq), "rq_depth": len(s.rq), "packets_sent": r.packets_sent,
            "bytes_sent": r.bytes_sent + s.bytes_sent, "bytes_received": s.bytes_received, "retransmits": r.retransmits,
            "timeouts": c.timeouts, "naks_received": c.naks, "rnr_naks_received": c.rnr_naks,
            "seq_naks_sent": s.seq_naks, "rnr_naks_sent": s.rnr_naks_sent, "duplicates": s.dup_requests,
            "rx_ghost_rsp": c.ghost, "rx_stale_rsp": c.stale, "rx_bad_rsp": c.bad_rsp,
            "rx_stale_ack_kernel": kernel_stale,       # stale ACKNOWLEDGEs the XDP program dropped
            "dup_read_replays": s.dup_read_replays, "dup_read_discards": s.dup_read_discards,
            "rx_rkey_violation": s.rkey_violations,
            "rx_drop_out_of_seq": s.out_of_seq,
            "rx_cnp_discarded": self.cnp_discarded + (fast.cnp_discarded(self) if fast is not None else 0),
            "error": self.error_reason, **self.dcqcn.counters(),   # rate_bps, tx_cnp, rx_cnp, ... (MR-CNP-010)
            "next_hop": (self.next_hop.hop if self.next_hop else None), "dmac": self.dmac,
            "path_resolves": self.path_resolves, "path_changes": self.path_changes,
        }
