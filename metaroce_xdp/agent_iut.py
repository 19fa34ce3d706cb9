"""The implementations the test agent drives (agent.py): what ships, in two forms.

    CompiledIUT(ctx)            the compiled data plane in this process (metaroce_xdp.dp.Context)
    DaemonIUT(socket, ifname)   metaroced, as a client of it (metaroce_xdp.daemon.client)

An IUT gives the agent one `Session` per agent session (IUT.session()): the verbs the commands of 9.4.2
translate onto, the counters get_counters reports and the set_param knobs.  Every answer comes from the
implementation itself; what an implementation does not offer is said (the agent's ENOTSUP, the counter or
parameter left out of caps), never made up.

The two differ where the daemon's client does: one SGE per work request, no INLINE, no set_param knobs (the
daemon's settings are its configuration's); its MR addresses are daemon IOVAs (client.MR.addr), and its
completion events come as messages on the client's socket (client.CQ.req_notify, CQ.get_event).
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import numpy as np

from .verbs import QP_RX_COUNTERS
from .verbs_types import InvalidArgument, QPState

# The receive drop counters the spec names (01-encapsulation.md MR-ENC-032, MR-BTH, MR-OPC): each the sum of
# the XDP program's drops (kern/layout.py DropReason) and the compiled loop's (Plane.stats) for the same reasons.
# get_counters qp on a native QP (MR-LOSS-014): the agent's names for the plane's per-QP native counters
# (NativeSlots.counters: nx/tx/rx rows); each a sum of the plane's counters that count the same thing.
NATIVE_QP_COUNTERS = {
    "sack_sent": ("c_sack_tx",), "sack_received": ("c_sack_rx",),
    "sack_discarded": ("c_sack_inv", "c_sack_bad", "c_sack_nak_seq", "c_sack_kern_discarded"),
    "sack_stale": ("c_sack_stale",), "retx_sack": ("c_retx_sack",), "retx_rto": ("c_retx_rto",),
    "retx_tlp": ("c_retx_tlp",), "retx_rnr": ("c_retx_rnr",), "read_rerequests": ("c_rereq",),
    "atomic_replays": ("c_at_replay",), "spurious_retx": ("c_spurious",), "rx_duplicates": ("c_dup",),
    "rx_out_of_window": ("c_oow",), "rx_not_ready": ("c_notready",), "rnr_nak_during_wait": ("c_rnr_wait",),
    "rnr_nak_discarded": ("c_rnr_inv",), "atomic_ack_discarded": ("c_at_ack_bad",),
    "read_resp_discarded": ("c_rd_bad",), "rx_drop_len": ("c_bad_len",),
}


def native_qp_counters(nat: dict) -> dict:
    """The agent's native per-QP counters from the plane's (NativeSlots.counters), {} for a compat QP; with the
    requester's srtt_us and rto_us (state, not counters: what a tester may quote as evidence, never judge by)."""
    if not nat:
        return {}
    out = {name: sum(int(nat.get(k, 0) or 0) for k in keys) for name, keys in NATIVE_QP_COUNTERS.items()}
    for k in ("srtt", "rto"):
        v = int(nat.get(k + "_ns", -1) or 0)
        out[k + "_us"] = v // 1000 if v >= 0 else -1
    return out


SPEC_DROPS = {
    "rx_drop_ip_options": (("IP_OPTIONS",), ()), "rx_drop_ip_frag": (("IP_FRAGMENT",), ()),
    "rx_drop_ip_csum": (("BAD_IP_CSUM",), ()),
    # BAD_FIELD: a NATIVE_SACK's bitmap_words above 32, the XDP program's only use of it (MR-XH-027: rx_drop_len)
    "rx_drop_len": (("TRUNCATED_IP", "BAD_IP_HEADER", "TRUNCATED_UDP", "BAD_UDP_LENGTH", "TRUNCATED_BTH",
                     "TRUNCATED_EXT", "BAD_PAD", "BAD_FIELD"), ("rx_drop_len",)),
    "rx_drop_tver": (("BAD_TVER",), ()), "rx_drop_opcode": (("UNKNOWN_OPCODE", "WRONG_PROFILE"), ("rx_drop_op",)),
    "rx_drop_qpn": (("UNKNOWN_QP",), ("rx_drop_qp",)), "rx_drop_wrong_peer": (("WRONG_PEER",), ()),
    "rx_drop_icrc": (("BAD_ICRC",), ("rx_drop_icrc",)), "rx_drop_pkey": (("BAD_PKEY",), ()),
    "rx_drop_qp_state": (("QP_STATE",), ("rx_drop_state",)),
    # the reasons of MR-SEC-031 by the spec's names: responses outside the window (MR-ACK-015), remote access
    # errors (MR-MEM-019), RNR NAKs sent, requests after the expected PSN, duplicates (MR-DUP-010)
    "rx_stale_rsp": (("STALE_ACK",), ("rx_rsp_stale",)), "rx_ghost_rsp": (("GHOST_ACK",), ("rx_ghost_rsp",)),
    "rx_rkey_violation": ((), ("rx_rkey",)), "rnr_naks_sent": ((), ("tx_rnr",)),
    "rx_drop_out_of_seq": ((), ("rx_oos",)), "rx_dup_req": ((), ("rx_dup",)),
}
# the plane's own counters (dp/context.py Plane.stats) get_counters reports under their names
PLANE_COUNTERS = ("rx", "tx", "rx_drop_icrc", "rx_drop_qp", "rx_drop_state", "rx_drop_len", "rx_drop_op", "rx_dup",
                  "rx_oos", "tx_ack", "tx_nak", "tx_rnr", "tx_no_frame", "tx_ring_full", "retransmits", "timeouts",
                  "acks_seen", "naks_seen", "rnr_seen", "rx_rsp_stale", "tx_cnp", "rx_cnp", "rx_ce", "rx_dup_atomic",
                  "rx_rkey", "rx_ghost_rsp")
AGENT_COUNTERS = ("cm_drop_setup_limit",)        # the agent's own CM (cm_listen): connections refused (MR-SEC-017)


def _spec_drops(plane: dict, xdp: dict) -> dict:
    return {name: sum(int(xdp.get(r, 0)) for r in reasons) + sum(int(plane.get(p, 0)) for p in mine)
            for name, (reasons, mine) in SPEC_DROPS.items()}


class _BaseIUT:
    kind = ""
    name = ""
    local_ip = local_mac = ""
    max_pmtu = 1024
    dcqcn = None                                 # the reaction point's parameters, when they are observable

    def __init__(self) -> None:
        self.lock = threading.RLock()            # one control command at a time on the implementation
        self.agent_counts = dict.fromkeys(AGENT_COUNTERS, 0)

    def describe(self) -> str:
        return self.name

    def close(self) -> None:
        pass


# ================================================================================ compiled plane
class CompiledIUT(_BaseIUT):
    """The compiled data plane in this process: one dp.Context (its progress thread runs the loop)."""
    kind = "compiled"

    def __init__(self, ctx: Any) -> None:
        super().__init__()
        self.ctx = ctx
        self.local_ip, self.local_mac, self.max_pmtu = ctx.local_ip, ctx.local_mac, ctx.max_pmtu
        self.name = f"compiled plane in process (metaroce_xdp.dp.Context on {ctx.ifname})"
        p = ctx.plane.dcqcn
        self.dcqcn = p if getattr(p, "enabled", False) else None
        self.counter_names = list(PLANE_COUNTERS) + list(SPEC_DROPS) + list(AGENT_COUNTERS)
        self.qp_counter_names = ["retransmits", "naks_received", "rnr_naks_received", "sq_depth", "rq_depth",
                                 "tx_cnp", "rx_cnp", "rx_ce_marked", "rx_cnp_discarded", *QP_RX_COUNTERS]
        if self.dcqcn is not None:
            self.qp_counter_names += ["dcqcn_rate_bps", "dcqcn_target_bps", "dcqcn_alpha_ppm"]
        self.params = {"budget": (self._get_budget, self._set_budget, 1, 65536),    # packets per round
                       "ecn": (lambda: int(self.ecn), self._set_ecn, 0, 1)}
        from .dp.context import Unsupported
        self.unsupported = (Unsupported,)

    @classmethod
    def open(cls, ifname: str, **opts) -> "CompiledIUT":
        from .dp import Context
        return cls(Context.open(ifname, progress_thread=True, **opts))

    ecn = True            # set_param ecn: the QPs moved to RTR from now on are ECN-capable (QPAttr.ecn, MR-ECN-011)

    def _set_ecn(self, v: int) -> None:
        self.ecn = bool(v)

    def _get_budget(self) -> int:
        from .dp import layout as L
        return int(self.ctx.plane.A[L.P_BUDGET])

    def _set_budget(self, v: int) -> None:
        from .dp import layout as L
        with self.ctx.plane.paused():
            self.ctx.plane.A[L.P_BUDGET] = v

    def session(self) -> "CompiledSession":
        return CompiledSession(self)

    def counters(self) -> dict:
        st = self.ctx.stats()
        try:
            xdp = {k: int(v) for k, v in self.ctx.loader.drops().items()}
        except Exception:                        # noqa: BLE001 - the maps may be closing
            xdp = {}
        out = {k: int(st.get(k, 0)) for k in PLANE_COUNTERS}
        out.update({"xdp_drop_" + k.lower(): v for k, v in xdp.items()})
        out.update(_spec_drops(st, xdp))
        out.update(self.agent_counts)
        return out

    def source_counters(self, src: str) -> dict:
        """The receive counters of the QPs connected to `src` (MR-SEC-006), dp.Context.source_counters."""
        return self.ctx.source_counters(src)

    def close(self) -> None:
        self.ctx.close()


class CompiledSession:
    """One agent session's view of the in-process plane (resources are the shared Context's)."""

    def __init__(self, iut: CompiledIUT) -> None:
        self.iut, self.ctx = iut, iut.ctx

    def alloc_pd(self):
        return self.ctx.alloc_pd()

    def dealloc_pd(self, pd) -> None:
        self.ctx.dealloc_pd(pd)

    def reg_mr(self, pd, n: int, fill: int, access, remote_invalidate: bool):
        buf = np.full(n, fill, np.uint8) if fill else np.zeros(n, np.uint8)
        return self.ctx.reg_mr(pd, buf, access, remote_invalidate=remote_invalidate)

    @staticmethod
    def mem(mr) -> np.ndarray:
        return mr.mem

    def snapshot(self):
        """Memory read or written between two rounds of the loop, never half a placement."""
        return self.ctx.plane.paused()

    def dereg_mr(self, mr) -> None:
        self.ctx.dereg_mr(mr)

    def create_cq(self, n: int):
        return self.ctx.create_cq(n)

    def destroy_cq(self, cq) -> None:
        self.ctx.destroy_cq(cq)

    def create_qp(self, pd, scq, rcq, cap, sq_sig_all: bool):
        return self.ctx.create_qp(pd, scq, rcq, cap, sq_sig_all=sq_sig_all)

    def destroy_qp(self, qp) -> None:
        self.ctx.destroy_qp(qp)

    @staticmethod
    def modify(qp, attr) -> None:
        qp.modify(attr)                          # validates everything before it changes anything

    @staticmethod
    def state(qp) -> QPState:
        return qp.query_state()

    @staticmethod
    def query(qp) -> dict:
        q = qp.query()
        return {"state": q["state"], "qpn": qp.qp_num, "dest_qpn": q["dest_qp_num"], "dgid": qp.dgid,
                "dmac": q["dmac"], "path_mtu": q["path_mtu"], "sq_psn": q["sq_psn"], "rq_psn": q["rq_psn"],
                "error": q["error"], "profile": q["profile"]}

    @staticmethod
    def post_send(qp, wrs) -> None:
        qp.post_send(wrs)                        # a list whole or not at all

    @staticmethod
    def post_recv(qp, wrs) -> None:
        qp.post_recv(wrs)

    @staticmethod
    def poll(cq, n: int) -> list:
        return cq.poll(n)

    @staticmethod
    def req_notify(cq, solicited_only: bool) -> None:
        cq.req_notify(solicited_only=solicited_only)

    @staticmethod
    def get_event(cq, timeout: float) -> bool:
        return bool(cq.get_event(timeout))

    def next_event(self, timeout: float):
        """(IBV_EVENT name, qp, qp_num, cq) of the Context's next async event, or None."""
        ev = self.ctx.get_async_event(timeout)
        if ev is None:
            return None
        return ev.event_type.name, ev.qp, ev.qp_num, ev.cq

    def qp_counters(self, qp) -> dict:
        from .dp import layout as L
        qp.refresh_cc()               # the loop applies CNPs and DCQCN timers to an idle QP only when it runs it
        pl = self.ctx.plane
        r, f = qp.row, pl.F[qp.qi]
        out = {"retransmits": int(r[L.Q_N_RETX]), "sq_depth": int(r[L.Q_SQ_TAIL] - r[L.Q_SQ_HEAD]),
               "rq_depth": int(r[L.Q_RQ_TAIL] - r[L.Q_RQ_HEAD]), "tx_cnp": int(f[L.F_NP_TX]),
               "rx_cnp": int(f[L.F_RX_CNP]), "rx_ce_marked": int(f[L.F_NP_CE]),
               "naks_received": 0, "rnr_naks_received": 0, "rx_cnp_discarded": 0}
        if qp.installed and self.ctx.loader is not None:     # what the XDP program counted in the QP's slot
            slot = self.ctx.loader.qp(qp.qp_num)
            out["naks_received"], out["rnr_naks_received"] = int(slot["naks"]), int(slot["rnr_naks"])
            out["rx_cnp_discarded"] = int(slot["cnp_discarded"])
            # the CNPs the XDP program verified for the QP; the loop's reaction point takes them when it next
            # runs the QP (dp/cc.py rp_cnps), so its own count (F_RX_CNP) lags on an idle QP
            out["rx_cnp"] = max(out["rx_cnp"], int(slot["cnp_count"]))
        out.update(qp.rx_counters())                          # MR-DUP-010, MR-MEM-019, MR-ACK-015, MR-SEC-031
        if self.iut.dcqcn is not None:                        # the reaction point's state (5.6)
            out.update({"dcqcn_rate_bps": int(f[L.F_RC]), "dcqcn_target_bps": int(f[L.F_RT]),
                        "dcqcn_alpha_ppm": round(float(f[L.F_ALPHA]) * 1e6)})
        if qp.profile == "native":                            # MR-LOSS-014 (agent.NATIVE_QP_COUNTERS)
            out.update(native_qp_counters(qp.native_counters()))
        return out

    def close(self) -> None:
        pass


# ================================================================================ metaroced
class DaemonIUT(_BaseIUT):
    """metaroced, driven as its applications drive it: each agent session is a client connection
    (metaroce_xdp.daemon.client) on the daemon's socket, opened on `ifname`."""
    kind = "daemon"

    def __init__(self, socket_path: str, ifname: str | None = None) -> None:
        super().__init__()
        from .daemon import client
        self.client, self.socket_path = client, socket_path
        with client.connect(socket_path, ifname) as c:
            self.ifname, self.local_ip, self.local_mac, self.max_pmtu = c.ifname, c.gid, c.local_mac, c.max_pmtu
            self.profiles = list(c.profiles)
            self.pid = c.daemon_pid
            dcqcn = c.dcqcn
        self.name = f"metaroced (pid {self.pid}, {self.ifname}) through metaroce_xdp.daemon.client"
        self.counter_names = list(PLANE_COUNTERS) + list(SPEC_DROPS) + list(AGENT_COUNTERS)
        # what the daemon's query_qp reports per QP (server.Device.qp_info, cnp_counters)
        self.qp_counter_names = ["retransmits", "naks_received", "rnr_naks_received", "sq_depth", "rq_depth",
                                 "bytes_sent", "bytes_received", "tx_cnp", "rx_cnp", "rx_ce_marked",
                                 "rx_cnp_discarded", *QP_RX_COUNTERS]
        # the reaction point's parameters when the daemon runs DCQCN (open_device's reply), its values per QP
        if dcqcn is not None:
            from .congestion import DcqcnParams
            self.dcqcn = DcqcnParams(**{k: v for k, v in dcqcn.items() if k in DcqcnParams.__dataclass_fields__})
            self.qp_counter_names += ["dcqcn_rate_bps", "dcqcn_target_bps", "dcqcn_alpha_ppm"]
        # the daemon's knobs are its configuration's, not a client's; ecn is the QPs' own (QPAttr.ecn)
        self.params: dict = {"ecn": (lambda: int(self.ecn), self._set_ecn, 0, 1)}
        from .daemon.proto import Unsupported
        self.unsupported = (Unsupported,)

    ecn = True            # set_param ecn: the QPs moved to RTR from now on are ECN-capable (MR-ECN-011)

    def _set_ecn(self, v: int) -> None:
        self.ecn = bool(v)

    def source_counters(self, src: str) -> dict:
        """The receive counters of the QPs connected to `src` (MR-SEC-006): metaroced's administrator view
        (status, devices[].rx_by_source), zero for an address no QP was connected to."""
        import ipaddress
        key = str(ipaddress.ip_address(src))
        for d in self._status().get("devices", []):
            if d.get("ifname") == self.ifname:
                return dict((d.get("rx_by_source") or {}).get(key) or dict.fromkeys(QP_RX_COUNTERS, 0))
        return dict.fromkeys(QP_RX_COUNTERS, 0)

    def session(self) -> "DaemonSession":
        return DaemonSession(self)

    def _status(self) -> dict:
        with self.client.connect(self.socket_path) as c:
            return c.status()

    def counters(self, sess: "DaemonSession | None" = None) -> dict:
        c = sess.conn() if sess is not None else None
        if c is None:
            with self.client.connect(self.socket_path, self.ifname) as c2:
                st = c2.stats()
        else:
            st = c.stats()
        xdp: dict = {}
        for d in self._status().get("devices", []):
            if d.get("ifname") == self.ifname:
                xdp = {k: int(v) for k, v in (d.get("counters", {}).get("xdp_drops") or {}).items()}
        out = {k: int(st.get(k, 0)) for k in PLANE_COUNTERS}
        out.update({"xdp_drop_" + k.lower(): v for k, v in xdp.items()})
        out.update(_spec_drops(st, xdp))
        out.update(self.agent_counts)
        return out


class DaemonSession:
    """One agent session: one client connection to metaroced, opened at first use and closed by close()
    (reset): the daemon reclaims whatever the session left."""

    def __init__(self, iut: DaemonIUT) -> None:
        self.iut = iut
        self._c = None

    def conn(self):
        if self._c is None:
            self._c = self.iut.client.connect(self.iut.socket_path, self.iut.ifname)
        return self._c

    def alloc_pd(self):
        return self.conn().alloc_pd()

    def dealloc_pd(self, pd) -> None:
        pd.dealloc()

    def reg_mr(self, pd, n: int, fill: int, access, remote_invalidate: bool):
        c = self.conn()
        buf = c.alloc_buf(n)             # shared memory: the daemon places into it; MR.addr is the daemon's IOVA
        if fill:
            buf[:] = fill
        return c.reg_mr(pd, buf, access, remote_invalidate=remote_invalidate)

    @staticmethod
    def mem(mr) -> np.ndarray:
        return mr.buf

    @staticmethod
    def snapshot():
        return contextlib.nullcontext()  # the daemon's loop cannot be paused by a client

    def dereg_mr(self, mr) -> None:
        self.conn().dereg_mr(mr)

    def create_cq(self, n: int):
        cq = self.conn().create_cq(n)
        cq.depth = cq.size
        return cq

    @staticmethod
    def destroy_cq(cq) -> None:
        cq.destroy()

    def create_qp(self, pd, scq, rcq, cap, sq_sig_all: bool):
        if cap.max_send_sge > 1 or cap.max_recv_sge > 1:
            pass                         # the daemon takes one SGE per WR; a longer list is refused at post
        return self.conn().create_qp(pd, scq, rcq, cap, sq_sig_all=sq_sig_all)

    @staticmethod
    def destroy_qp(qp) -> None:
        qp.destroy()

    @staticmethod
    def modify(qp, attr) -> None:
        qp.modify(attr)

    @staticmethod
    def state(qp) -> QPState:
        return qp.state

    @staticmethod
    def query(qp) -> dict:
        q = qp.query()
        return {"state": q["state"], "qpn": q["qpn"], "dest_qpn": q.get("remote_qpn") or 0,
                "dgid": q.get("remote_addr"), "dmac": None, "path_mtu": q["path_mtu"], "sq_psn": q["sq_psn"],
                "rq_psn": q["rq_psn"], "error": q.get("error"), "profile": q.get("profile", "compat")}

    @staticmethod
    def post_send(qp, wrs) -> None:
        qp.post_send(wrs)

    @staticmethod
    def post_recv(qp, wrs) -> None:
        qp.post_recv(wrs)

    @staticmethod
    def poll(cq, n: int) -> list:
        return cq.poll(n)

    @staticmethod
    def req_notify(cq, solicited_only: bool) -> None:
        cq.req_notify(solicited_only=solicited_only)

    @staticmethod
    def get_event(cq, timeout: float) -> bool:
        return bool(cq.get_event(timeout))

    def next_event(self, timeout: float):
        if self._c is None:
            time.sleep(timeout)
            return None
        ev = self._c.get_async_event(timeout)
        if ev is None:
            return None
        return ev.event_type.name, ev.qp, ev.qp_num, ev.cq

    @staticmethod
    def qp_counters(qp) -> dict:
        q = qp.query()           # the daemon runs the QP's reaction point once first (server._op_query_qp)
        out = {"retransmits": int(q.get("retransmits") or 0), "naks_received": int(q.get("naks_rx") or 0),
               "rnr_naks_received": int(q.get("rnr") or 0), "sq_depth": int(q.get("outstanding_send") or 0),
               "rq_depth": int(q.get("outstanding_recv") or 0), "bytes_sent": int(q.get("bytes_tx") or 0),
               "bytes_received": int(q.get("bytes_rx") or 0)}
        # the CNP/ECN counters (MR-CC-039, MR-CNP-010, MR-ECN-012) and, with DCQCN on, the reaction point's state
        out.update({k: int(q[k]) for k in ("tx_cnp", "rx_cnp", "rx_ce_marked", "rx_cnp_discarded", "dcqcn_rate_bps",
                                           "dcqcn_target_bps", "dcqcn_alpha_ppm") if q.get(k) is not None})
        out.update({k: int(q.get(k) or 0) for k in QP_RX_COUNTERS})      # MR-DUP-010, MR-MEM-019, MR-SEC-031
        out.update(native_qp_counters(q.get("native") or {}))      # a native QP's (server.Device.qp_info)
        return out

    def close(self) -> None:
        if self._c is not None:
            c, self._c = self._c, None
            c.close()


__all__ = ["CompiledIUT", "DaemonIUT", "SPEC_DROPS", "PLANE_COUNTERS", "InvalidArgument"]
