"""The user-space half of the kernel ACK fast path.

The XDP program consumes ACK/NAK/RNR NAK packets and records them in the
QP's slot of the mmap-able `mr_qps` array (bpf/metaroce_structs.h).  This
class keeps the control-plane and requester fields of each slot current
(state, peer, snd_nxt, comp_psn, nak_read_psn) and, on every engine round,
turns changes of the kernel-written fields into the same completer calls an
ACK packet would make.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..kern.layout import PSN_NONE, QP_STATE_DTYPE, Profile, QpState
from ..verbs_types import QPState
from ..wire.headers import AETH_ACK, AETH_CREDIT_INVALID, AETH_NAK, AETH_RNR_NAK
from ..wire.psn import PSN_MASK, psn_diff

if TYPE_CHECKING:
    from ..kern.loader import XdpLoader
    from .engine import Engine
    from .qp import QP


class FastAck:
    def __init__(self, loader: "XdpLoader") -> None:
        self.loader = loader
        # Plain integer views of the mmap'd slots: a structured-field read costs ~1 us in
        # numpy, an element of a plain array a tenth of that.  Offsets come from the dtype.
        n = len(loader.qps)
        raw = loader.qps.view(np.uint8).reshape(n, QP_STATE_DTYPE.itemsize)
        self._u8 = raw
        self._u32 = raw.view(np.uint32)
        self._u64 = raw.view(np.uint64)
        off = {k: v[1] for k, v in QP_STATE_DTYPE.fields.items()}
        self._seq = off["ack_seq"] // 8
        self._ack = off["ack_psn"] // 4
        self._msn = off["ack_msn"] // 4
        self._nak_psn, self._nak_seq = off["nak_psn"] // 4, off["nak_seq"] // 4
        self._rnr_psn, self._rnr_seq = off["rnr_psn"] // 4, off["rnr_seq"] // 4
        self._nak_code, self._rnr_timer = off["nak_code"], off["rnr_timer"]
        self._snd_nxt = off["snd_nxt"] // 4
        self._comp, self._nak_read = off["comp_psn"] // 4, off["nak_read_psn"] // 4
        self.published: dict[int, tuple[int, int]] = {}         # qpn -> (comp_psn, nak_read_psn) in the slot
        self.seen: dict[int, tuple[int, int, int, int]] = {}   # qpn -> (ack_seq, ack_psn, nak_seq, rnr_seq)
        self._cnp = off["cnp_count"] // 8
        self.cnp_seen: dict[int, int] = {}                      # qpn -> cnp_count already given to the RP
        self._ghost = off["ghost_acks"] // 4
        self.ghost_seen: dict[int, int] = {}                    # qpn -> ghost_acks already in rx_ghost_rsp
        self.installed: set[int] = set()

    def stale_acks(self, qp: "QP") -> int:
        """The ACKNOWLEDGEs the XDP program dropped as stale for this QP (its slot's stale_acks,
        DropReason.STALE_ACK): part of the QP's rx_stale_rsp (MR-ACK-015, MR-SEC-031).  Ghosts are
        counted apart (ghost_acks, added to rx_ghost_rsp by poll())."""
        if qp.qp_num not in self.installed:
            return 0
        rec = self.loader.qp(qp.qp_num)
        return int(rec["stale_acks"]) if int(rec["qpn"]) == qp.qp_num else 0

    def cnp_discarded(self, qp: "QP") -> int:
        """The CNPs naming this QP that the XDP program dropped (wrong peer, P_Key, state or profile:
        its slot's cnp_discarded), part of the QP's rx_cnp_discarded (MR-CC-039)."""
        if qp.qp_num not in self.installed:
            return 0
        rec = self.loader.qp(qp.qp_num)
        return int(rec["cnp_discarded"]) if int(rec["qpn"]) == qp.qp_num else 0

    def qp_changed(self, qp: "QP") -> None:
        """Mirror the QP's control-plane fields into its slot (single writer: us)."""
        qpn = qp.qp_num
        if qp.state in (QPState.RESET,) or qp.dgid is None:
            if qpn in self.installed:
                self.loader.clear_qp(qpn)
                self.installed.discard(qpn)
                self.seen.pop(qpn, None)
                self.cnp_seen.pop(qpn, None)
                self.ghost_seen.pop(qpn, None)
                self.published.pop(qpn, None)
            return
        if qpn not in self.installed:
            self.loader.install_qp(qpn, peer_ip=qp.dgid, dest_qpn=qp.dest_qp, state=QpState(int(qp.state)),
                                   profile=Profile.COMPAT, pmtu=qp.pmtu, init_psn=qp.requester.psn_next,
                                   pkey=qp.pkey)
            self.installed.add(qpn)
            slot = self.loader.qp(qpn)
            self.seen[qpn] = (int(slot["ack_seq"]), int(slot["ack_psn"]), int(slot["nak_seq"]), int(slot["rnr_seq"]))
            self.cnp_seen[qpn] = int(slot["cnp_count"])
            self.ghost_seen[qpn] = int(slot["ghost_acks"])
        else:
            self.loader.set_qp_state(qpn, QpState(int(qp.state)))
        if qp.state == QPState.RTS and qpn in self.installed:
            self.publish_snd_nxt(qp)
            slot = self.loader.qp(qpn)
            # the requester starts at sq_psn: everything before it counts as acknowledged
            slot["ack_psn"] = (qp.requester.psn_next - 1) & PSN_MASK
            s = self.seen[qpn]
            self.seen[qpn] = (s[0], int(slot["ack_psn"]), s[2], s[3])
            self.published.pop(qpn, None)
            self.publish_comp_psn(qp)

    def publish_snd_nxt(self, qp: "QP") -> None:
        if qp.qp_num in self.installed:
            self._u32[self.loader.slot_of(qp.qp_num), self._snd_nxt] = qp.requester.psn_next

    def publish_comp_psn(self, qp: "QP") -> None:
        """The completer's comp_psn, and the first PSN of the oldest READ while some of its
        responses are placed (the PSN MR-MEM-033's NAK names, MR-ACK-015 (b)): the kernel's NAK
        window starts there (mr_nak_window_start in bpf/metaroce_xdp.c; MR-ACK-015, MR-SEC-022).
        Called after each receive burst, so the slot lags the completer by at most one engine
        round; a late value only widens the kernel's window, and the completer checks again."""
        req = qp.requester
        comp, nak_read = req.psn_next, PSN_NONE
        if req.sq:
            comp = req.oldest_unacked_psn()
            for w in req.sq:
                if w.first_psn is None:
                    break
                if not w.done:
                    if qp.completer._is_partial_read_psn(w.first_psn):
                        nak_read = w.first_psn
                    break
        if self.published.get(qp.qp_num) != (comp, nak_read):
            i = self.loader.slot_of(qp.qp_num)
            # nak_read_psn first: the kernel reads the two without a lock, and never sees comp_psn
            # past a partly answered READ without the READ's first PSN (x86 keeps store order)
            self._u32[i, self._nak_read] = nak_read
            self._u32[i, self._comp] = comp
            self.published[qp.qp_num] = (comp, nak_read)

    def _snapshot(self, i: int) -> tuple | None:
        """Consistent read of slot i's kernel-written fields (the seqcount protocol of
        struct mr_qp_state: retry while odd or changed), or None when the kernel kept
        writing: the caller tries again next round.  Nothing is lost by waiting (ack_psn is
        cumulative, NAKs and RNR NAKs are counted by nak_seq / rnr_seq), whereas raising
        here failed whole progress rounds: a soak at 1 % loss saw this a few times in ten
        minutes, when the reading thread lost the GIL between the two reads of ack_seq
        while ACKs kept coming."""
        u32, u64, u8 = self._u32[i], self._u64[i], self._u8[i]
        for _ in range(64):
            s1 = int(u64[self._seq])
            if s1 & 1:
                continue
            snap = (s1, int(u32[self._ack]), int(u32[self._msn]), int(u32[self._nak_psn]),
                    int(u32[self._nak_seq]), int(u8[self._nak_code]), int(u32[self._rnr_psn]),
                    int(u32[self._rnr_seq]), int(u8[self._rnr_timer]))
            if int(u64[self._seq]) == s1:
                return snap
        return None

    def poll(self, engine: "Engine") -> bool:
        work = False
        for qpn in self.installed:
            qp = engine.qps.get(qpn)
            # CNPs the kernel verified and counted (bpf/metaroce_xdp.c) -> the DCQCN reaction point
            cnps = int(self._u64[self.loader.slot_of(qpn), self._cnp])
            if cnps != self.cnp_seen.get(qpn, cnps):
                if qp is not None:
                    qp.dcqcn.rp.on_cnp(engine.now, cnps - self.cnp_seen[qpn])
                    engine.stats["rx_cnp"] += cnps - self.cnp_seen[qpn]
                self.cnp_seen[qpn] = cnps
            # ACK/NAKs the kernel dropped as ghosts (PSN never sent, MR-ACK-015 (a)) -> rx_ghost_rsp
            ghosts = int(self._u32[self.loader.slot_of(qpn), self._ghost])
            if ghosts != self.ghost_seen.get(qpn, ghosts):
                if qp is not None:
                    qp.completer.ghost += (ghosts - self.ghost_seen[qpn]) & 0xFFFFFFFF
                self.ghost_seen[qpn] = ghosts
            if qp is None or qp.state not in (QPState.RTS, QPState.SQD, QPState.SQE):
                continue
            self.publish_comp_psn(qp)    # READ responses of this round may have moved it
            if not qp.requester.sq:
                continue                 # nothing outstanding: an ACK now could only be stale
            i = self.loader.slot_of(qpn)
            last = self.seen[qpn]
            if int(self._u64[i, self._seq]) == last[0]:
                continue
            snap = self._snapshot(i)
            if snap is None:
                engine.stats["ack_snapshot_busy"] += 1
                work = True              # come back at once
                continue
            seq, ack_psn, msn, nak_psn, nak_seq, nak_code, rnr_psn, rnr_seq, rnr_timer = snap
            c = qp.completer
            if psn_diff(ack_psn, last[1]) > 0:
                c.on_syndrome(ack_psn, AETH_ACK | AETH_CREDIT_INVALID, msn, from_kernel=True)
            if nak_seq != last[2]:
                c.on_syndrome(nak_psn, AETH_NAK | nak_code, msn, from_kernel=True)
            if rnr_seq != last[3]:
                c.on_syndrome(rnr_psn, AETH_RNR_NAK | rnr_timer, msn, from_kernel=True)
            self.seen[qpn] = (seq, ack_psn, nak_seq, rnr_seq)
            work = True
        return work
