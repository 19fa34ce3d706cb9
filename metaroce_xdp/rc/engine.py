"""The progress engine and the verbs-like API around it.

    ctx = Context(port, ...)            # or Context.open("veth0") for XDP + AF_XDP
    pd = ctx.alloc_pd(); mr = pd.reg_mr(buf, Access.LOCAL_WRITE | Access.REMOTE_WRITE)
    cq = ctx.create_cq(256); qp = ctx.create_qp(pd, cq, cq)
    qp.modify(QPAttr(qp_state=QPState.INIT, ...)) ... RTR ... RTS
    qp.post_send(SendWR(...)); cq.poll()

One Engine per port; no process-global state, so a daemon can host several.
Progress happens in `Engine.progress()`: called by CQ.poll (busy polling) or
by a background thread (`Context(..., progress_thread=True)`).  A lock makes
the API safe to call from other threads.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import struct
import sys
import threading
import time
from collections import Counter, deque
from typing import Any

import numpy as np

from ..netinfo import NetInfoError
from ..verbs_types import (Access, InvalidArgument, InvalidState, QPCap, QPState, ResourceError, SendFlags,
                           VerbsError, WC, WCStatus, WROpcode)
from ..wire.opcodes import MI
from ..wire.psn import PSN_MASK, psn_diff
from .burst import peek_bth, rx_write_run, tx_segment
from .requester import ACKREQ_EVERY
from ..wire.errors import MalformedPacket
from ..wire.fastpath import TABLES, build_frame, frame_icrc_ok, make_template
from ..verbs_types import AsyncEvent, AsyncEventQueue, EventType
from .memory import MR, PD, KeyTable, as_u8
from .pathwatch import PathWatch
from .qp import ACK_STATES, QP, REQ_STATES
from .dcqcn import WIRE_OVERHEAD, DcqcnParams, link_rate_bps
from .rxparse import parse, pkey_match
from ..compchannel import CompChannelBase

log = logging.getLogger("metaroce.engine")
_EMPTY = np.zeros(1, np.uint8)
MAX_QPS = 1024


class CompChannel(CompChannelBase):
    """ibv_comp_channel: where armed CQs report their completion events (ibv_get_cq_event).  One
    channel may serve several CQs; `Context.create_cq(channel=...)` attaches a CQ to it.  The
    engine's lock guards the queue; a waiter without a progress thread drives the engine."""

    def _lock(self):
        return self.ctx.engine.lock

    def _threaded(self) -> bool:
        return self.ctx.engine.threaded

    def _progress(self) -> None:
        self.ctx.engine.progress()


_NOTIFY_NEXT, _NOTIFY_SOLICITED = 1, 2


class CQ:
    def __init__(self, ctx: "Context", depth: int, channel: CompChannel | None = None,
                 cq_context: Any = None) -> None:
        self.ctx = ctx
        self.depth = depth
        self.q: deque[WC] = deque()
        self.overruns = 0                   # completions lost because the CQ was full
        self._overflowing = False
        # completion events (ibv_req_notify_cq, MR-BTH-004): a CQ without a channel of its own gets a
        # private one, read by CQ.get_event
        self.private_channel = channel is None
        self.channel = channel if channel is not None else CompChannel(ctx)
        self.cq_context = cq_context
        self.armed = 0                      # 0, _NOTIFY_NEXT or _NOTIFY_SOLICITED
        self.events = 0                     # events taken from the channel (ibv_ack_cq_events' count)

    def req_notify(self, solicited_only: bool = False) -> None:
        """ibv_req_notify_cq: arm the CQ for one completion event, sent to its channel for the next
        completion added -- with solicited_only, for the next solicited one (a receive completion
        whose request packet had SE, MR-BTH-004) or unsuccessful one.  Arming for any completion
        outranks solicited_only until the event comes (as rxe)."""
        with self.ctx.engine.lock:
            if self.armed != _NOTIFY_NEXT:
                self.armed = _NOTIFY_SOLICITED if solicited_only else _NOTIFY_NEXT

    def get_event(self, timeout: float | None = 0.0) -> bool:
        """Wait up to `timeout` seconds for this CQ's completion event (CQs created without a
        channel); True when it came, which also disarms the CQ."""
        if not self.private_channel:
            raise InvalidState("this CQ reports to a completion channel: use channel.get_cq_event()")
        return self.channel.get_cq_event(timeout) is self

    def push(self, wc: WC, solicited: bool = False) -> None:
        """Queue a completion.  A full CQ overflows (MR-QP-036): the completion is lost and counted,
        IBV_EVENT_CQ_ERR is raised and every QP using the CQ moves to ERR (its flushed completions are
        lost too while the CQ stays full); the queue never holds more than `depth`.  An armed CQ
        reports the completion to its channel (req_notify; `solicited`: MR-BTH-004)."""
        if len(self.q) < self.depth:
            self._overflowing = False
            self.q.append(wc)
            if self.armed and (self.armed == _NOTIFY_NEXT or solicited or wc.status != WCStatus.SUCCESS):
                self.armed = 0
                self.channel._notify(self)
            return
        self.overruns += 1
        if self._overflowing:               # one event per overflow, not one per lost completion
            return
        self._overflowing = True
        self.ctx.raise_event(EventType.CQ_ERR, cq=self, reason=f"CQ of depth {self.depth} overflowed")
        for qp in list(self.ctx.engine.qps.values()):
            if (qp.send_cq is self or qp.recv_cq is self) and qp.state != QPState.ERR:
                qp.to_error(None, "its CQ overflowed")
                self.ctx.raise_event(EventType.QP_FATAL, qp=qp, reason="its CQ overflowed")

    def poll(self, num_entries: int = 16) -> list[WC]:
        """ibv_poll_cq: up to num_entries completions (drives progress when busy polling)."""
        eng = self.ctx.engine
        if not eng.threaded:
            eng.progress()
        out = []
        with eng.lock:
            while self.q and len(out) < num_entries:
                out.append(self.q.popleft())
        return out

    def wait(self, n: int = 1, timeout: float = 10.0) -> list[WC]:
        """Poll until n completions arrived (test and tool helper); TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        out: list[WC] = []
        while len(out) < n:
            out += self.poll(n - len(out))
            if len(out) >= n:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(out)} of {n} completions after {timeout}s")
            if self.ctx.engine.threaded:
                time.sleep(0.0002)
        return out


def _warm_up(seal: bool = False) -> None:
    """Compile (or load from numba's cache) every function of this engine's data path (jitwarm
    plane "python"; the compiled plane, dp/, is not needed here) before any QP can transmit: a
    compile on a live QP outlasts the peer's local ACK timeout.  Cold, this takes a while and says
    so on stderr; warm, ~0.1 s.  seal (an Engine starting): no compilation afterwards
    (jitwarm.seal) -- a type the warm-up missed raises at the call."""
    from ..jitwarm import seal as seal_jit, warm_up
    warm_up(planes=("python",))
    if seal:
        seal_jit()


class Engine:
    def __init__(self, port: Any, local_ip: str, local_mac: str, max_pmtu: int, threaded: bool = False,
                 resolve_mac=None) -> None:
        self.port = port
        self.local_ip = local_ip
        self.local_mac = local_mac
        self.max_pmtu = max_pmtu
        self.resolve_mac = resolve_mac
        self.lock = threading.RLock()
        self.qps: dict[int, QP] = {}
        self.now = time.monotonic_ns()
        self.stats: Counter = Counter()
        # remote access errors (NAK code 2) by the source IP address of the request (MR-SEC-006); the
        # source is always a QP's connected peer (other sources are dropped first, MR-SEC-009)
        self.rae_by_src: Counter = Counter()
        self.threaded = threaded
        # packets per progress round, and in flight per QP: tunables (also through the environment)
        self.budget = int(os.environ.get("METAROCE_BUDGET", "256"))
        self.ecn = True                # new QPs ECT(0), CE answered by CNPs; False: Not-ECT, no CNP (MR-ECN-011)
        self.window = int(os.environ.get("METAROCE_WINDOW", "1024"))
        # packets all QPs of the port may have un-ACKed, shared among the QPs with something to send, as
        # the compiled plane does (dp/loop.py, P_INFL_CAP): about what the peer's fill ring holds.  Without
        # PFC more in flight is dropped there, and go-back-N on 16 QPs both ways ran out of retries.
        # 0: no port limit (each QP its window); ports without rings (LoopPort) have none.
        ring = getattr(port, "ring", 0)
        self.port_inflight = int(os.environ.get("METAROCE_PORT_INFLIGHT", str(ring * 3 // 4)))
        self.infl_left = 1 << 40       # this round: packets the port may still put in flight
        self.qp_share = 0              # this round: each sending QP's share of port_inflight (0: none)
        self.rx_bursts = 8             # receive bursts a round may take (while each comes back full)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.fast_ack = None           # kernel ACK fast path (xskport), polled when present
        # compiled bursts (burst.py) when the port offers batched slots; METAROCE_NO_BURST=1 turns
        # them off so tests can compare the two paths
        nob = os.environ.get("METAROCE_NO_BURST") == "1"
        self.burst_tx = hasattr(port, "tx_slots") and not nob
        self.burst_rx = hasattr(port, "rx_burst_raw") and not nob
        self._lens = np.zeros(4096, np.uint32)
        # DCQCN for compat QPs (dcqcn.py): R_line is the interface's speed; METAROCE_DCQCN_* override
        self.dcqcn = DcqcnParams.from_env(r_line_bps=link_rate_bps(getattr(port, "ifname", None)))
        self._cnp_ext = np.zeros(16, np.uint8)     # the 16 reserved bytes of a CNP (MR-XH-016)
        # routed paths: the port's resolver (netinfo.PathResolver) re-resolves running QPs'
        # next hops on route/neighbour events and local ACK timeouts (pathwatch.py)
        paths = getattr(port, "paths", None)
        self.pathwatch = PathWatch(self, paths) if paths is not None else None
        _warm_up(seal=True)

    # -- TX ---------------------------------------------------------------------
    def prepare_path(self, dgid: str) -> None:
        """Resolve the path to dgid before QP.modify takes the engine lock (ARP/ND may take a
        while); make_template then finds the neighbour entry at once."""
        if self.pathwatch is None:
            return
        try:
            ipaddress.ip_address(dgid.removeprefix("::ffff:") if "." in dgid else dgid)
        except ValueError:
            return                                 # QP.modify reports it
        self.pathwatch.resolver.resolve(dgid.removeprefix("::ffff:") if "." in dgid else dgid)

    def make_template(self, qp: QP):
        """The QP's frame template.  Its destination MAC is QPAttr.dmac when the application gave
        one, else the next hop's from the kernel's route and neighbour tables (netinfo), which
        PathWatch then keeps current."""
        given = qp.dmac is not None and (qp.next_hop is None or qp.dmac != qp.next_hop.mac)
        if given:
            return self.build_template(qp, qp.dmac)
        if self.pathwatch is not None:
            hop = self.pathwatch.resolver.resolve(qp.dgid)
            t = self.build_template(qp, hop.mac, hop.src)
            qp.dmac, qp.next_hop = hop.mac, hop
            self.pathwatch.track(qp.qp_num, qp.dgid)
            return t
        dmac = self.resolve_mac(qp.dgid) if self.resolve_mac else None
        if dmac is None:
            raise InvalidArgument(f"no MAC address for {qp.dgid}: give QPAttr.dmac or make the peer reachable")
        qp.dmac = dmac
        return self.build_template(qp, dmac)

    def build_template(self, qp: QP, dmac: str, src: str | None = None):
        if src is not None and ipaddress.ip_address(src) != ipaddress.ip_address(self.local_ip):
            raise NetInfoError(f"the route to {qp.dgid} uses source {src}, but this endpoint's address (its GID) "
                               f"is {self.local_ip}: make the route use it (ip route change <prefix> via "
                               f"<gateway> src {self.local_ip})")
        return make_template(src_mac=self.local_mac, dst_mac=dmac, src_ip=self.local_ip, dst_ip=qp.dgid,
                             sport=qp.sport, dest_qp=qp.dest_qp, dscp=qp.dscp,
                             ecn=2 if qp.ecn else 0)    # ECT(0) (MR-ECN-001); Not-ECT without ECN (MR-ECN-011)

    def emit(self, qp: QP, opcode: int, psn: int, ack_req: int, se: int, ext: bytes, payload, off: int,
             plen: int) -> None:
        slot = self.port.tx_slot()
        if slot is None:
            self.port.flush()
            slot = self.port.tx_slot()
            if slot is None:
                self.stats["tx_no_frame"] += 1     # recovered by retransmission
                return
        buf, boff = slot
        t = qp.template
        ext_a = np.frombuffer(ext, dtype=np.uint8) if ext else _EMPTY
        pay = payload if payload is not None else _EMPTY
        n = build_frame(TABLES, buf, boff, t.buf, t.length, t.l3_off, t.ipv6, int(opcode), 0x80 if se else 0,
                        int(ack_req), int(psn), ext_a, len(ext), pay, off, plen)
        self.port.tx_commit(boff, n)
        self.stats["tx"] += 1

    def emit_segments(self, qp: QP, w, room: int) -> int:
        """Build up to `room` packets of SEND/WRITE WQE `w` from packet w.sent on (burst.tx_segment)."""
        room = min(room, len(self._lens))
        if room <= 0:
            return 0
        slots = self.port.tx_slots(room)
        if slots is None:
            return 0
        umem, addrs = slots
        if len(addrs) == 0:
            return 0
        if w.burst_args is None:
            is_write = w.opcode in (WROpcode.RDMA_WRITE, WROpcode.RDMA_WRITE_WITH_IMM)
            has_imm = w.opcode in (WROpcode.RDMA_WRITE_WITH_IMM, WROpcode.SEND_WITH_IMM)
            reth = np.frombuffer(struct.pack("!QII", w.wr.remote_addr, w.wr.rkey, w.length), np.uint8)
            imm = np.frombuffer(struct.pack("!I", w.wr.imm_data & 0xFFFFFFFF), np.uint8)
            se = bool(w.wr.send_flags & SendFlags.SOLICITED) and w.opcode != WROpcode.RDMA_WRITE
            w.burst_args = (is_write, has_imm, reth, imm, se)
        is_write, has_imm, reth, imm, se = w.burst_args
        t = qp.template
        n = tx_segment(TABLES, umem, addrs, self._lens, len(addrs), t.buf, t.length, t.l3_off, t.ipv6, is_write,
                       has_imm, reth, imm, w.data, w.length, qp.pmtu, w.sent, w.npsn, w.first_psn, ACKREQ_EVERY, se)
        self.port.tx_commit_batch(addrs, self._lens, n)
        mtu = qp.pmtu
        qp.requester.bytes_sent += min(w.length, (w.sent + n) * mtu) - min(w.length, w.sent * mtu)
        self.stats["tx"] += n
        self.stats["tx_burst"] += n             # frames built by the compiled segmenter (tests tell the paths apart)
        return n

    def _rx_frame(self, f) -> None:
        self.stats["rx"] += 1
        if not frame_icrc_ok(TABLES, f, 0, len(f)):
            self.stats["drop_icrc"] += 1          # MR-ICRC-013, MR-ICRC-014: silently dropped, counted
            return
        try:
            pkt = parse(f)
        except MalformedPacket as e:
            self.stats["drop_" + e.reason.name.lower()] += 1
            return
        qp = self.qps.get(pkt.dest_qp)
        if qp is None or qp.dgid is None:
            # MR-BTH-016; a QP without a connected peer (RESET, INIT, or ERR entered from them) is not
            # addressable yet: step 10 of MR-ENC-032, as in the XDP program, which learns a QP at RTR
            self.stats["drop_unknown_qp"] += 1
            return
        if not pkey_match(pkt.pkey, qp.pkey):
            self.stats["drop_bad_pkey"] += 1       # MR-BTH-010 (the XDP program's BAD_PKEY)
            if pkt.opcode == 0x81:
                qp.cnp_discarded += 1              # MR-CC-039
            return
        if pkt.op.mask & MI.NATIVE:
            # MR-OPC-004, MR-NAT-008: every QP of this engine runs the compat profile, so a native
            # opcode is dropped without a NAK, counted as the XDP program counts it (step 15, after
            # the state, step 14: MR-ENC-032)
            ok = qp.state in (REQ_STATES if pkt.op.mask & MI.REQ else ACK_STATES)
            self.stats["drop_wrong_profile" if ok else "drop_qp_state"] += 1
            return
        if pkt.opcode == 0x81:                     # CNP: to the reaction point (MR-CNP-005, MR-CC-033)
            if qp.state != QPState.RTS:
                self.stats["drop_qp_state"] += 1
                qp.cnp_discarded += 1              # MR-CC-039
                return
            qp.dcqcn.rp.on_cnp(self.now)
            self.stats["rx_cnp"] += 1
            return
        if not qp.handle(pkt):
            self.stats["drop_qp_state"] += 1       # MR-QP-020
            return
        # MR-ECN-007, MR-ECN-008: CE on an accepted request or READ RESPONSE (duplicates and
        # NAKed packets too), never on ACKs, ATOMIC ACKNOWLEDGEs or CNPs
        if pkt.ecn == 3 and (pkt.op.mask & MI.REQ or 0x0D <= pkt.opcode <= 0x10):
            if not qp.ecn:                         # MR-ECN-011: ECN off on this QP, counted but no CNP
                qp.dcqcn.np.rx_ce_marked += 1
            elif qp.dcqcn.np.on_ce(self.now):      # MR-ECN-009, MR-ECN-012, MR-CNP-002, MR-CNP-003
                self.send_cnp(qp)

    def send_cnp(self, qp: QP) -> None:
        """One CNP to the peer QP (MR-CNP-001, MR-CC-029): built from the QP's own template (so
        it follows the QP's path, UDP source port and P_Key), with DSCP cnp_dscp, Not-ECT
        (MR-ECN-005), BECN 1 (MR-BTH-012), PSN 0 (MR-BTH-019), AckReq 0; no PSN is consumed
        and nothing acknowledges it (MR-CNP-004)."""
        t = qp.template
        cached = qp.dcqcn.np.cnp_template
        if cached is None or cached[0] is not t:
            tb = t.buf.copy()
            l3 = t.l3_off
            tos = (self.dcqcn.cnp_dscp << 2) & 0xFC
            if t.ipv6:
                tb[l3] = 0x60 | (tos >> 4)
                tb[l3 + 1] = ((tos & 0x0F) << 4) | (tb[l3 + 1] & 0x0F)
            else:
                tb[l3 + 1] = tos
            tb[t.length - 12 + 4] = 0x40 | (tb[t.length - 12 + 4] & 0x3F)     # BECN 1, FECN 0
            qp.dcqcn.np.cnp_template = cached = (t, tb)
        slot = self.port.tx_slot()
        if slot is None:
            self.port.flush()
            slot = self.port.tx_slot()
            if slot is None:
                self.stats["tx_cnp_no_frame"] += 1   # a later CE mark sends the next one
                return
        buf, boff = slot
        tb = cached[1]
        n = build_frame(TABLES, buf, boff, tb, len(tb), t.l3_off, t.ipv6, 0x81, 0, 0, 0, self._cnp_ext, 16,
                        _EMPTY, 0, 0)
        self.port.tx_commit(boff, n)
        self.stats["tx"] += 1
        self.stats["tx_cnp"] += 1

    def _rx_raw(self) -> int:
        """One burst of at most `budget` frames; returns how many were taken."""
        umem, addrs, lens = self.port.rx_burst_raw(self.budget)
        n = len(addrs)
        if n == 0:
            self.stats["rx_idle_polls"] += 1
            return 0
        self.stats["rx_polls"] += 1
        i = 0
        while i < n:
            a = int(addrs[i])
            op, qpn, _, _ = peek_bth(umem, a, int(lens[i]))
            if op == 7 or op == 8:               # WRITE MIDDLE / LAST: try the compiled placer
                qp = self.qps.get(qpn)
                if (qp is not None and qp.state in (QPState.RTR, QPState.RTS, QPState.SQD)
                        and qp.responder.in_progress == MI.WRITE and qp.responder.write_mr is not None
                        and qp.responder.write_mr.valid):    # deregistered: the per-packet path NAKs (MR-MEM-033)
                    j = qp.responder.fast_write(umem, addrs, lens, i, n)
                    if j > i:
                        self.stats["rx"] += j - i
                        self.stats["rx_burst"] += j - i
                        i = j
                        continue
            # Frames a role only counts, skipped by a compiled run: SEND / WRITE duplicates and
            # out-of-sequence frames after a go-back-N (responder), stale and old-stream READ
            # RESPONSEs (completer)
            skip = None
            if 0 <= op <= 11 or 13 <= op <= 16:
                qp = self.qps.get(qpn)
                if qp is not None:
                    if op <= 11 and qp.state in (QPState.RTR, QPState.RTS, QPState.SQD):
                        skip = qp.responder.skip_run
                    elif op >= 13 and qp.state in (QPState.RTS, QPState.SQD, QPState.SQE):
                        skip = qp.completer.skip_run
            if skip is not None:
                j = skip(umem, addrs, lens, i, n)
                if j > i:
                    self.stats["rx"] += j - i
                    self.stats["rx_skipped"] += j - i
                    i = j
                    continue
            self._rx_frame(umem[a:a + int(lens[i])])
            i += 1
        self.port.rx_done()
        return n

    # -- progress ----------------------------------------------------------------
    def progress(self) -> bool:
        """One round: receive, timers, transmit.  Returns True when it did any work."""
        with self.lock:
            self.now = time.monotonic_ns()
            work = False
            if self.pathwatch is not None and self.pathwatch.updates:
                self.pathwatch.apply()             # next hops re-resolved by the resolver thread
            # Receive until the ring is empty, up to rx_bursts bursts: one burst a round fell behind a
            # peer whose round sent a message on each of many QPs (1,000 QPs: 4,000 frames sent a
            # round, 256 taken), so its ring overflowed and every QP's ACK timer fired each round.
            for _ in range(self.rx_bursts):
                if self.burst_rx:
                    got = self._rx_raw()
                else:
                    frames = self.port.rx_burst(self.budget)
                    for f in frames:
                        self._rx_frame(f)
                    if frames:
                        self.port.rx_done()
                    got = len(frames)
                work |= got > 0
                if got < min(self.budget, getattr(self.port, "BATCH", self.budget)):
                    break                          # (a LoopPort hands out at most BATCH frames a burst)
            if self.fast_ack is not None:
                work |= self.fast_ack.poll(self)
            qps = list(self.qps.values())
            self._share_port(qps)
            for qp in qps:
                r = qp.responder
                if qp.state in (QPState.RESET, QPState.INIT, QPState.ERR) and not r.drain_in_err:
                    continue                       # (a fatal NAK held behind READ responses: MR-RC-025)
                r.flush_ack()                      # ACKs leave at the end of each batch (MR-ACK-004)
                if r.read_queue:
                    # READ RESPONSEs are paced by the QP's own DCQCN rate (MR-CNP-009)
                    rp = qp.dcqcn.rp
                    room = rp.allowance(self.now, self.budget, qp.pmtu + WIRE_OVERHEAD)
                    if room:
                        b0 = r.bytes_sent
                        k = r.progress(room)
                        rp.on_sent(r.bytes_sent - b0 + k * WIRE_OVERHEAD)
                        work |= k > 0
                if qp.state in (QPState.RTS, QPState.SQD):
                    tmo = qp.completer.timeouts
                    qp.completer.check_timer(self.now)
                    if qp.completer.timeouts != tmo and qp.next_hop is not None:
                        self.pathwatch.recheck(qp.qp_num, qp.dgid)   # has the next hop moved?
                    if qp.requester.progress(self.budget):
                        work = True
            self.port.flush()
            if not work and hasattr(self.port, "idle_flush"):
                self.port.idle_flush()
            return work

    def _share_port(self, qps: list) -> None:
        """This round's port in-flight budget (infl_left) and each sending QP's share of it (qp_share)."""
        if self.port_inflight <= 0:
            self.infl_left, self.qp_share = 1 << 40, 0
            return
        left, nsend = self.port_inflight, 0
        for qp in qps:
            if qp.state != QPState.RTS:
                continue
            r = qp.requester
            # what is on the wire, not what the started WQEs hold: counting a whole 64 MiB WRITE as in
            # flight spent the port's budget at once, the QP went on 16 packets at a time (fewer than
            # the 32 between AckReqs) and every step waited for a local ACK timeout
            out = psn_diff(r.send_psn(), (r.acked_psn + 1) & PSN_MASK)
            if out > 0:
                left -= out
            if out > 0 or r.cursor < len(r.sq):
                nsend += 1
        self.infl_left = left
        self.qp_share = max(16, self.port_inflight // max(1, nsend))

    def busy(self) -> bool:
        return any(q.requester.outstanding() or q.requester.cursor < len(q.requester.sq)
                   or q.responder.read_queue or q.responder.held for q in self.qps.values())

    def kick(self) -> None:
        self._wake.set()

    def qp_state_changed(self, qp: QP) -> None:
        if self.fast_ack is not None:
            self.fast_ack.qp_changed(qp)

    def start(self) -> None:
        if self._thread is None:
            # A progress thread shares the interpreter: with the default 5 ms GIL switch
            # interval a busy peer thread (another engine, the application) could starve it
            # past a short local ACK timeout.  0.5 ms bounds that wait.
            sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
            self.threaded = True
            self._thread = threading.Thread(target=self._run, name="metaroce-progress", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        idle = 0
        while not self._stop.is_set():
            try:
                did = self.progress()
            except Exception:                      # keep the engine alive; the error is logged
                log.exception("progress failed")
                self.stats["progress_errors"] += 1
                did = False
            if did:
                idle = 0
                # Hand the GIL over after each productive round: otherwise a busy engine
                # keeps it for the interpreter's 5 ms switch interval, and another engine
                # (or the application) in this process stalls for longer than a short
                # local ACK timeout.
                time.sleep(0)
                continue
            idle += 1
            if idle > 50:
                # nothing moving: sleep until a packet, a post, or the next timer tick
                self.port.wait(0.001)
                self._wake.clear()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


class Context:
    """ibv_context-like: one engine on one port (an interface, or an in-process loop)."""

    def __init__(self, port: Any, local_ip: str | None = None, local_mac: str | None = None,
                 max_pmtu: int | None = None, progress_thread: bool = False, resolve_mac=None) -> None:
        self.port = port
        self.keys = KeyTable()
        self.async_events = AsyncEventQueue()   # ibv_get_async_event's queue (events.py)
        self.engine = Engine(port, local_ip or port.ip, local_mac or port.mac, max_pmtu or port.max_pmtu,
                             resolve_mac=resolve_mac or getattr(port, "resolve_mac", None))
        if hasattr(port, "attach_engine"):
            port.attach_engine(self.engine)
        self._pd_next = 1
        self._qpn_next = 0x11
        self.closed = False
        if progress_thread:
            self.engine.start()

    @classmethod
    def open(cls, ifname: str, *, queue: int = 0, progress_thread: bool = False, ipv6: bool = False,
             frame_size: int = 4096, xdp_mode: str = "drv", pin: bool = True) -> "Context":
        """An endpoint on a real interface: the XDP program attached, an AF_XDP
        socket on `queue`, and the kernel ACK fast path feeding the completers."""
        from ..kern.loader import XdpLoader, XdpMode, check_interface_free
        from .fastack import FastAck
        from .xskport import XskPort

        check_interface_free(ifname)   # XdpBusy before seconds of compiling when another owner lives
        _warm_up()            # before the socket and XDP program exist, long before any QP reaches RTR
        loader = XdpLoader(max_qps=MAX_QPS)
        port = None
        try:
            # attach first: the bpf_link is the interface's ownership (XdpBusy while another owner lives)
            loader.attach(ifname, mode=XdpMode.DRV if xdp_mode == "drv" else XdpMode.SKB, pin=pin)
            port = XskPort(ifname, queue=queue, frame_size=frame_size, ipv6=ipv6, multibuffer=None)   # SG: MTU >= 4178
            loader.set_config(local_ip4=None if ipv6 else port.ip, local_ip6=port.ip if ipv6 else None,
                              local_mac=port.mac)
            loader.set_xsk(queue, port.fileno())
        except BaseException:
            if port is not None:
                port.close()
            loader.close()
            raise
        port.loader = loader
        ctx = cls(port, progress_thread=False)
        ctx.engine.fast_ack = FastAck(loader)
        ctx.loader = loader
        if progress_thread:
            ctx.engine.start()
        return ctx

    @property
    def gid(self) -> str:
        return self.engine.local_ip

    def raise_event(self, event_type: EventType, qp: QP | None = None, cq: CQ | None = None,
                    reason: str = "") -> None:
        """Queue an asynchronous event (called by the transport with the engine lock held)."""
        self.async_events.put(AsyncEvent(EventType(event_type), qp=qp, cq=cq, reason=reason))

    def get_async_event(self, timeout: float | None = 0.0) -> AsyncEvent | None:
        """ibv_get_async_event: the oldest event, waiting up to `timeout` seconds for one (None: for
        ever; 0: just look).  Drives progress when there is no progress thread.  None when no event
        came in time."""
        eng = self.engine
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if not eng.threaded:
                eng.progress()
            with eng.lock:
                ev = self.async_events.get()
            if ev is not None:
                return ev
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            if eng.threaded:
                self.async_events.ready.wait(0.01 if left is None else min(left, 0.01))

    def alloc_pd(self) -> PD:
        pd = PD(self, self._pd_next)
        self._pd_next += 1
        return pd

    def reg_mr(self, pd: PD, buf: Any, access: Access = Access.LOCAL_WRITE, *, remote_invalidate: bool = False) -> MR:
        """ibv_reg_mr.  remote_invalidate=True lets the peer's SEND WITH INVALIDATE invalidate the MR
        (MR-MEM-042; plain registrations cannot be)."""
        access = Access(access)
        if access & (Access.REMOTE_WRITE | Access.REMOTE_ATOMIC) and not access & Access.LOCAL_WRITE:   # MR-MEM-006
            raise InvalidArgument("REMOTE_WRITE/REMOTE_ATOMIC need LOCAL_WRITE too (as in ibv_reg_mr)")
        mem = as_u8(buf)
        if mem.size == 0:                                                  # MR-MEM-004
            raise InvalidArgument("an MR of 0 bytes cannot be registered")
        with self.engine.lock:
            mr = self.keys.add(pd, mem, access, remote_invalidate)
            pd.mrs.add(mr.index)
        return mr

    def dereg_mr(self, mr: MR) -> None:
        with self.engine.lock:
            self.keys.remove(mr)
            mr.pd.mrs.discard(mr.index)

    def invalidate_rkey(self, rkey: int, pd: PD) -> bool:
        """SEND WITH INVALIDATE (MR-MEM-040): from now on no lookup of rkey succeeds, for any QP; the
        MR stays registered, its index taken, until dereg_mr (MR-MEM-042, MR-MEM-043).  False, and
        nothing invalidated, when the key names no valid, remotely invalidatable MR of `pd`
        (MR-MEM-041)."""
        mr = self.keys.check_invalidate(rkey, pd)
        if mr is None:
            return False
        mr.valid = False
        return True

    def create_comp_channel(self) -> CompChannel:
        """ibv_create_comp_channel (completion events: CQ.req_notify)."""
        return CompChannel(self)

    def create_cq(self, depth: int = 1024, cq_context: Any = None, channel: CompChannel | None = None) -> CQ:
        """ibv_create_cq; with `channel`, completion events go there (CompChannel.get_cq_event), else
        CQ.get_event reads them."""
        if depth <= 0:
            raise InvalidArgument("CQ depth must be positive")
        if channel is not None and channel.ctx is not self:
            raise InvalidArgument("the completion channel belongs to another context")
        return CQ(self, depth, channel, cq_context)

    def create_qp(self, pd: PD, send_cq: CQ, recv_cq: CQ, cap: QPCap | None = None,
                  sq_sig_all: bool = False) -> QP:
        with self.engine.lock:
            if len(self.engine.qps) >= MAX_QPS - 1:
                raise ResourceError(f"at most {MAX_QPS - 1} QPs per context")
            qpn = self._qpn_next
            while qpn in self.engine.qps or qpn % MAX_QPS == 0 or any(
                    q % MAX_QPS == qpn % MAX_QPS for q in self.engine.qps):
                qpn = (qpn + 1) & 0xFFFFFF or 1
            self._qpn_next = (qpn + 1) & 0xFFFFFF or 1
            qp = QP(self, pd, send_cq, recv_cq, cap or QPCap(), qpn, sq_sig_all)
            self.engine.qps[qpn] = qp
            pd.qps.add(qpn)
            self.engine.qp_state_changed(qp)
            return qp

    def destroy_qp(self, qp: QP) -> None:
        with self.engine.lock:
            qp.to_error(None, "destroyed")
            self.engine.qps.pop(qp.qp_num, None)
            qp.pd.qps.discard(qp.qp_num)
            qp.state = QPState.RESET
            self.engine.qp_state_changed(qp)

    def dealloc_pd(self, pd: PD) -> None:
        if pd.mrs or pd.qps:                     # MR-MEM-002
            raise ResourceError(f"PD {pd.handle} still has {len(pd.mrs)} MRs and {len(pd.qps)} QPs")
        pd.closed = True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.engine.stop()
        self.port.close()
        loader = getattr(self, "loader", None)
        if loader is not None:
            loader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["CompChannel", "Context", "CQ", "Engine", "VerbsError"]
