"""The user-space half of the kernel ACK fast path.

The XDP program consumes ACK/NAK/RNR NAK packets and records them in the
QP's slot of the mmap-able `mr_qps` array (bpf/metaroce_structs.h).  This
class keeps the control-plane and requester fields of each slot current
(state, peer, snd_nxt) and, on every engine round, turns changes of the
kernel-written fields into the same completer calls an ACK packet would make.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..kern.layout import Profile, QpState, read_ack_state
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
        self.seen: dict[int, tuple[int, int, int, int]] = {}   # qpn -> (ack_seq, ack_psn, nak_seq, rnr_seq)
        self.installed: set[int] = set()

    def qp_changed(self, qp: "QP") -> None:
        """Mirror the QP's control-plane fields into its slot (single writer: us)."""
        qpn = qp.qp_num
        if qp.state in (QPState.RESET,) or qp.dgid is None:
            if qpn in self.installed:
                self.loader.clear_qp(qpn)
                self.installed.discard(qpn)
                self.seen.pop(qpn, None)
            return
        if qpn not in self.installed:
            self.loader.install_qp(qpn, peer_ip=qp.dgid, dest_qpn=qp.dest_qp, state=QpState(int(qp.state)),
                                   profile=Profile.COMPAT, pmtu=qp.pmtu, init_psn=qp.requester.psn_next)
            self.installed.add(qpn)
            slot = self.loader.qp(qpn)
            self.seen[qpn] = (int(slot["ack_seq"]), int(slot["ack_psn"]), int(slot["nak_seq"]), int(slot["rnr_seq"]))
        else:
            self.loader.set_qp_state(qpn, QpState(int(qp.state)))
        if qp.state == QPState.RTS and qpn in self.installed:
            self.publish_snd_nxt(qp)
            slot = self.loader.qp(qpn)
            # the requester starts at sq_psn: everything before it counts as acknowledged
            slot["ack_psn"] = (qp.requester.psn_next - 1) & PSN_MASK
            s = self.seen[qpn]
            self.seen[qpn] = (s[0], int(slot["ack_psn"]), s[2], s[3])

    def publish_snd_nxt(self, qp: "QP") -> None:
        if qp.qp_num in self.installed:
            self.loader.qp(qp.qp_num)["snd_nxt"] = qp.requester.psn_next

    def poll(self, engine: "Engine") -> bool:
        work = False
        for qpn in self.installed:
            qp = engine.qps.get(qpn)
            if qp is None or not qp.requester.sq or qp.state not in (QPState.RTS, QPState.SQD, QPState.SQE):
                continue                 # nothing outstanding: an ACK now could only be stale
            slot = self.loader.qp(qpn)
            seq = int(slot["ack_seq"])
            last = self.seen[qpn]
            if seq == last[0]:
                continue
            snap = read_ack_state(slot)
            msn = snap["ack_msn"]
            c = qp.completer
            if psn_diff(snap["ack_psn"], last[1]) > 0:
                c.on_syndrome(snap["ack_psn"], AETH_ACK | AETH_CREDIT_INVALID, msn)
            if snap["nak_seq"] != last[2]:
                c.on_syndrome(snap["nak_psn"], AETH_NAK | snap["nak_code"], msn)
            if snap["rnr_seq"] != last[3]:
                c.on_syndrome(snap["rnr_psn"], AETH_RNR_NAK | snap["rnr_timer"], msn)
            self.seen[qpn] = (snap["ack_seq"], snap["ack_psn"], snap["nak_seq"], snap["rnr_seq"])
            work = True
        return work
