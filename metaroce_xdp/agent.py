"""The test agent (spec 09-conformance.md section 9.4, MR-CONF-013 to MR-CONF-023).

The upper tester drives the IUT through this agent: JSON lines over TCP, one
session per connection, each command a thin translation onto the verbs API of
what ships (agent_iut.py): the compiled data plane in this process (`--iut compiled`,
metaroce_xdp.dp.Context) or metaroced through its client library (`--iut daemon`,
metaroce_xdp.daemon.client).  hello names which (member `iut`).  The agent adds no
protocol behaviour of its own (MR-CONF-019); it only validates, translates values
(MR-CONF-018) and names errors (MR-CONF-023).

    Agent(iut)                one session: handle_line(bytes) -> bytes, reset()
    AgentServer(iut, host)    threaded TCP server, one Agent per connection
    AgentClient(host, port)   the tester's side: call(cmd, **args) -> result

The protocol itself -- framing, error codes, value names, limits, the server and the client -- is
conformance/agentproto.py's, which the rdma-core agent (conformance/pyverbs_agent.py) shares.

    python -m metaroce_xdp.agent --dev veth1 --listen 10.55.0.2 --port 18516
    python -m metaroce_xdp.agent --iut daemon --socket /run/metaroce/metaroced.sock --listen 10.55.0.2

The claim hello and caps announce (MR-CONF-001) is compat + ATOMICS (+ DCQCN when the plane's reaction point
runs) unless the agent is told more: `--profiles compat,native` (or METAROCE_AGENT_PROFILES) adds the native
profile -- NATIVE, SACK and OOO_PLACEMENT, the native defaults in caps.defaults, the native per-QP counters
(NATIVE_QP_COUNTERS) in caps.qp_counters -- and `--caps MULTIPATH,CREDITS,CC_DELAY` (or METAROCE_AGENT_CAPS)
the optional native capabilities.  modify_qp RTR with "profile": "native" and "native": {caps, sack_window,
entropy_count} (9.4.2) brings a native QP up on either IUT, its parameters those a connection set-up agreeing
the same would give it (dp/cmconnect.agreed_profile).

    python -m metaroce_xdp.agent --dev veth1 --listen 10.55.0.2 --profiles compat,native --caps MULTIPATH,CREDITS

MR-SEC-027: the agent is off unless started explicitly, binds only the
address it is given (default loopback) and logs every session.
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import __version__
from .conformance.agentproto import (ACCESS, CAP_ATOMICS, CAP_MULTIPATH, CAP_NAMES, CAP_NATIVE, CAP_OOO, CAP_SACK,
                                     DEFAULT_PORT, ERRNO_CODES, HEX, MAC, MAX_CQE, MAX_MEM_IO,
                                     MAX_MR_LEN, MAX_POLL, MAX_TIMEOUT_MS, MAX_WR, PROFILES, PROTO, QP_STATES,
                                     SEND_FLAGS, WR_OPCODES, AgentClient, AgentError, Session, check_hello,
                                     flag_names, get, get_bytes, get_enum, get_flags, get_int, get_list, get_obj,
                                     get_u64, get_wrs, gid_of, hex64, ip_of_gid)
from .conformance.agentproto import AgentServer as _AgentServer
from .agent_iut import NATIVE_QP_COUNTERS
from .dp.layout import MAX_MRS
from .verbs import MAX_INLINE
from .verbs_types import (PATH_MTUS, Access, Busy, InvalidArgument, InvalidState, QPAttr, QPCap, QPState,
                          QueueFull, RecvWR, ResourceError, SendFlags, SendWR, SGE, WROpcode)

log = logging.getLogger("metaroce.agent")

# ---- what hello and caps report ------------------------------------------------------
@dataclass
class ImplInfo:
    """The IUT's claim as the agent reports it (MR-CONF-001): the implementation (impl), which form of it
    runs (iut: the compiled plane in process or metaroced), its profiles and capabilities."""
    impl: str = "metaroce-ref"
    version: str = __version__
    profiles: list = field(default_factory=lambda: ["compat"])
    iut: str = ""                                     # what runs: CompiledIUT/DaemonIUT.describe()
    caps: int = CAP_ATOMICS                           # 06-connection.md 6.3
    limits: dict = field(default_factory=lambda: {
        "max_qp": 1023, "max_cq": 1024, "max_mr": MAX_MRS - 1, "max_sge": 16, "max_inline": MAX_INLINE,
        "max_rd_atomic": 16})
    # The loop's timers are checked every round; an idle loop sleeps at most 1 ms (poll_ms).
    timer_granularity_us: int = 1000
    defaults: dict = field(default_factory=lambda: {
        "sack_window": 0, "entropy_count": 1, "ack_coalesce_us": 0, "ack_coalesce_pkts": 1,
        "rto_min_us": 8})                             # 4.096 us * 2^1: the smallest local ACK timeout
    dcqcn: bool = False

    @classmethod
    def of(cls, info: "ImplInfo | dict | None") -> "ImplInfo":
        if isinstance(info, ImplInfo):
            return info
        return cls(**(info or {}))

    @classmethod
    def claiming(cls, profiles=("compat",), caps=(), **kw) -> "ImplInfo":
        """The claim the agent announces (MR-CONF-001): `profiles` ("compat", "native") and the names of the
        capabilities beyond the default ATOMICS (MULTIPATH, CC_DELAY, CREDITS, IPV6).  A native claim sets
        NATIVE, SACK and OOO_PLACEMENT (MR-NAT-004) and the native defaults of caps (04 4.7); without
        "native" the claim is compat, whatever `caps` names of the native set."""
        profiles = list(dict.fromkeys(profiles))
        bad = [p for p in profiles if p not in PROFILES]
        if bad or "compat" not in profiles:
            raise ValueError(f"profiles {profiles}: compat and optionally native (9.4.2)")
        bits = CAP_ATOMICS
        for name in caps:
            if name not in CAP_NAMES:
                raise ValueError(f"capability {name!r}: one of {', '.join(CAP_NAMES)}")
            bits |= CAP_NAMES[name]
        info = cls(profiles=profiles, **kw)
        if "native" in profiles:
            bits |= CAP_NATIVE | CAP_SACK | CAP_OOO
            info.defaults = native_defaults(bits)
        else:
            bits &= ~(CAP_NATIVE | CAP_SACK | CAP_OOO | CAP_MULTIPATH | CAP_NAMES["CC_DELAY"] | CAP_NAMES["CREDITS"])
        info.caps = bits
        return info

    @property
    def native(self) -> bool:
        return "native" in self.profiles


def native_defaults(caps: int) -> dict:
    """caps.defaults of a native claim (9.4.2): what a native QP uses when modify_qp's `native` leaves it
    out -- the offers of dp/cmconnect.py (W 256, K 16 with MULTIPATH, else 1) and the plane's coalescing
    (04 4.7: N 8, T 5 us) and rto_min (dp/cmconnect.RTO_MIN_US)."""
    from .dp.cmconnect import K_OFFER, RTO_MIN_US, W_OFFER
    from .native.layout import PARAMS
    d = {n: v for n, v, _ in PARAMS}
    return {"sack_window": W_OFFER, "entropy_count": K_OFFER if caps & CAP_MULTIPATH else 1,
            "ack_coalesce_us": int(d["ack_t"]), "ack_coalesce_pkts": int(d["ack_n"]), "rto_min_us": RTO_MIN_US}


# ---- one session ---------------------------------------------------------------------
@dataclass
class _QPEntry:
    qp: Any
    pd: int
    send_cq: int
    recv_cq: int
    attrs: dict = field(default_factory=dict)     # the attributes modify_qp set, as ibv_query_qp returns them


class Agent(Session):
    """One test-agent session on a Context: its handles, its commands, its reset.

    handle(request) -> response never raises: every failure becomes an error
    response, and a failed command changes nothing (MR-CONF-016) because each
    command decodes and checks all its arguments before the one verbs call
    that acts.
    """

    def __init__(self, iut: Any, impl_info: ImplInfo | dict | None = None) -> None:
        super().__init__()
        self.iut = iut                      # agent_iut.CompiledIUT or DaemonIUT
        self.v = iut.session()              # this session's verbs on it
        self.info = ImplInfo.of(impl_info)
        self.pds: dict[int, Any] = {}
        self.mrs: dict[int, Any] = {}
        self.cqs: dict[int, Any] = {}
        self.qps: dict[int, _QPEntry] = {}
        self._saved_params: dict[str, Any] = {}
        self._listeners: dict[int, "_PassiveCM"] = {}     # qp handle -> its cm_listen
        self._agreed: dict[int, int] = {}                 # qp handle -> capabilities agreed by set-up (6.3)
        self._pending_caps: int | None = None             # the agreed set of the native RTR being applied

    @property
    def engine(self):
        """The implementation's device-wide facts (local_ip, local_mac, max_pmtu) and its lock."""
        return self.iut

    @property
    def _unsupported(self) -> tuple:
        return tuple(getattr(self.iut, "unsupported", ()))

    def call(self, cmd: str, fn, args: dict):
        """Run one command and translate the engine's typed errors (MR-CONF-023)."""
        try:
            return fn(args)
        except AgentError:
            raise
        except self._unsupported as e:              # the IUT says it does not offer this
            raise AgentError("ENOTSUP", str(e)) from None
        except InvalidArgument as e:
            raise AgentError("EINVAL", str(e)) from None
        except Busy as e:                           # EBUSY, not ESTATE (MR-QP-014, MR-CONF-023)
            raise AgentError("EBUSY", str(e)) from None
        except InvalidState as e:
            raise AgentError("ESTATE", str(e)) from None
        except QueueFull as e:
            raise AgentError("EAGAIN", str(e)) from None
        except ResourceError as e:
            # The engine raises it for "still in use" on teardown and "exhausted" on creation.
            in_use = cmd.startswith(("destroy_", "dealloc_", "dereg_"))
            raise AgentError("EBUSY" if in_use else "ENOMEM", str(e)) from None
        except MemoryError as e:
            raise AgentError("ENOMEM", f"out of memory: {e}") from None
        except OSError as e:
            code = ERRNO_CODES.get(e.errno, "EINTERNAL")
            raise AgentError(code, f"{type(e).__name__}: {e}") from None
        except Exception as e:                      # never a crash: the session goes on
            log.exception("agent: %s failed", cmd)
            raise AgentError("EINTERNAL", f"{type(e).__name__}: {e}") from None

    # -- session ---------------------------------------------------------------------
    def cmd_hello(self, args: dict) -> dict:
        check_hello(args)
        eng, info = self.engine, self.info
        self.greeted = True
        return {"proto": PROTO, "impl": info.impl, "version": info.version, "iut": info.iut or self.iut.describe(),
                "profiles": list(info.profiles),
                "caps": info.caps, "gid": gid_of(eng.local_ip), "ip": eng.local_ip, "mac": eng.local_mac,
                "mtus": [m for m in PATH_MTUS if m <= eng.max_pmtu], "limits": dict(info.limits),
                "timer_granularity_us": info.timer_granularity_us}

    def cmd_caps(self, args: dict) -> dict:
        out = {"caps": self.info.caps, "defaults": dict(self.info.defaults), "dcqcn": self.info.dcqcn,
               "counters": list(self.iut.counter_names),
               "params": sorted(self.iut.params),
               # 9.4.2: the commands this agent implements and the counters get_counters qp reports
               "commands": sorted(self.commands),
               "qp_counters": list(self.iut.qp_counter_names)
                              + (list(NATIVE_QP_COUNTERS) if self.info.native else [])}
        p = self.iut.dcqcn
        if self.info.dcqcn and p is not None:       # the reaction point's parameters (5.6), for MR-CC-036..038
            out["dcqcn_params"] = {"g_ppm": round(p.g * 1e6), "alpha_init_ppm": round(p.alpha_init * 1e6),
                                   "k_ns": p.k_ns, "t_ns": p.t_ns, "b_bytes": p.b_bytes, "f": p.f,
                                   "r_ai_bps": int(p.r_ai_bps), "r_hai_bps": int(p.r_hai_bps),
                                   "r_min_bps": int(p.r_min_bps), "r_line_bps": int(p.r_line_bps),
                                   "cnp_interval_ns": p.cnp_interval_ns}
        return out

    def cmd_reset(self, args: dict) -> None:
        self.reset()

    def reset(self) -> None:
        """MR-CONF-021: destroy every QP, MR, CQ and PD of the session; restore set_param knobs.

        Never raises: a resource that fails to go is logged and forgotten, so
        that the next test case starts clean.
        """
        for lst in list(self._listeners.values()):        # connection set-ups in progress go first
            lst.close()
        self._listeners.clear()
        v = self.v
        for table, destroy in ((self.qps, lambda e: v.destroy_qp(e.qp)), (self.mrs, v.dereg_mr),
                               (self.cqs, v.destroy_cq), (self.pds, v.dealloc_pd)):
            for h, obj in list(table.items()):
                try:
                    if destroy is not None:
                        destroy(obj)
                except Exception:
                    log.exception("agent reset: cannot destroy handle %d", h)
            table.clear()
        for name, old in self._saved_params.items():
            try:
                self.iut.params[name][1](old)
            except Exception:
                log.exception("agent reset: cannot restore parameter %s", name)
        self._saved_params.clear()
        self._restart_handles()
        self._agreed.clear()          # handles start again at 1: no QP inherits another's set-up
        for _ in range(4096):                       # the events of this session's resources go with them
            if self.v.next_event(0.0) is None:
                break
        try:
            self.v.close()                          # metaroced: the client connection goes, and all it held
        except Exception:
            log.exception("agent reset: cannot close the session")

    # -- PD, MR, CQ --------------------------------------------------------------------
    def cmd_create_pd(self, args: dict) -> dict:
        pd = self.v.alloc_pd()
        h = self._new_handle("pd")
        self.pds[h] = pd
        return {"pd": h}

    def cmd_dealloc_pd(self, args: dict) -> None:
        h, pd = self._lookup(self.pds, "pd", args)
        self.v.dealloc_pd(pd)
        del self.pds[h]

    def cmd_reg_mr(self, args: dict) -> dict:
        _, pd = self._lookup(self.pds, "pd", args)
        n = get_int(args, "len", 0, 1 << 62)
        if n > MAX_MR_LEN:
            raise AgentError("ENOMEM", f"len {n} exceeds the agent's MR limit of {MAX_MR_LEN} bytes")
        access = Access(get_flags(args, "access", ACCESS))
        fill = get_int(args, "fill", 0, 255, 0)
        if len(self.mrs) >= self.info.limits["max_mr"]:
            raise AgentError("ENOMEM", f"at most {self.info.limits['max_mr']} MRs")
        inval = get(args, "remote_invalidate", False)
        if not isinstance(inval, bool):
            raise AgentError("EINVAL", "remote_invalidate must be true or false")
        mr = self.v.reg_mr(pd, n, fill, access, inval)     # MR-MEM-042
        h = self._new_handle("mr")
        self.mrs[h] = mr
        return {"mr": h, "lkey": mr.lkey, "rkey": mr.rkey, "va": hex64(mr.addr), "len": mr.length}

    def cmd_dereg_mr(self, args: dict) -> None:
        h, mr = self._lookup(self.mrs, "mr", args)
        self.v.dereg_mr(mr)
        del self.mrs[h]

    def cmd_rereg_mr(self, args: dict) -> None:
        self._lookup(self.mrs, "mr", args)
        raise AgentError("ENOTSUP", "rereg_mr is not supported by this IUT (MR-MEM-037)")

    def cmd_alloc_mw(self, args: dict) -> None:
        self._lookup(self.pds, "pd", args)
        raise AgentError("ENOTSUP", "MetaRoCE v1 has no memory windows (MR-MEM-036)")

    def cmd_create_cq(self, args: dict) -> dict:
        cqe = get_int(args, "cqe", 1, MAX_CQE)
        if len(self.cqs) >= self.info.limits["max_cq"]:
            raise AgentError("ENOMEM", f"at most {self.info.limits['max_cq']} CQs")
        cq = self.v.create_cq(cqe)
        h = self._new_handle("cq")
        self.cqs[h] = cq
        return {"cq": h, "cqe": cq.depth}

    def cmd_destroy_cq(self, args: dict) -> None:
        h, cq = self._lookup(self.cqs, "cq", args)
        users = [e.qp.qp_num for e in self.qps.values() if h in (e.send_cq, e.recv_cq)]
        if users:
            raise AgentError("EBUSY", f"CQ {h} is used by QPN {', '.join(f'{n:#x}' for n in users)}: "
                                      "destroy the QPs first")
        self.v.destroy_cq(cq)
        del self.cqs[h]

    # -- QP ----------------------------------------------------------------------------
    def cmd_create_qp(self, args: dict) -> dict:
        pd_h, pd = self._lookup(self.pds, "pd", args)
        scq_h, scq = self._lookup(self.cqs, "cq", args, "send_cq")
        rcq_h, rcq = self._lookup(self.cqs, "cq", args, "recv_cq")
        qtype = get(args, "type", "RC")
        if qtype != "RC":
            raise AgentError("ENOTSUP", f"QP type {qtype!r}: only RC")
        cap = get_obj(args, "cap", {})
        lim = self.info.limits
        qcap = QPCap(max_send_wr=get_int(cap, "max_send_wr", 1, MAX_WR, 1024),
                     max_recv_wr=get_int(cap, "max_recv_wr", 1, MAX_WR, 1024),
                     max_send_sge=get_int(cap, "max_send_sge", 0, lim["max_sge"], lim["max_sge"]),
                     max_recv_sge=get_int(cap, "max_recv_sge", 0, lim["max_sge"], lim["max_sge"]))
        get_int(cap, "max_inline_data", 0, lim["max_inline"], 0)
        sig_all = get(args, "sq_sig_all", False)
        if not isinstance(sig_all, bool):
            raise AgentError("EINVAL", "sq_sig_all must be true or false")
        if len(self.qps) >= lim["max_qp"]:
            raise AgentError("ENOMEM", f"at most {lim['max_qp']} QPs")
        qp = self.v.create_qp(pd, scq, rcq, qcap, sig_all)
        h = self._new_handle("qp")
        self.qps[h] = _QPEntry(qp, pd_h, scq_h, rcq_h, {"max_send_wr": qcap.max_send_wr,
                                                          "max_recv_wr": qcap.max_recv_wr})
        return {"qp": h, "qpn": qp.qp_num}

    def _set_agreed(self, h: int, caps: int) -> None:
        """What set-up agreed for QP handle h (6.3): without ATOMICS its QP refuses atomics at post (MR-CM-019)."""
        self._agreed[h] = caps
        self.qps[h].qp.atomics = bool(caps & CAP_ATOMICS)

    def cmd_destroy_qp(self, args: dict) -> None:
        h, e = self._lookup(self.qps, "qp", args)
        lst = self._listeners.pop(h, None)
        if lst is not None:
            lst.close()
        self.v.destroy_qp(e.qp)
        del self.qps[h]
        self._agreed.pop(h, None)

    def _qp_attr(self, state: QPState, attrs: dict) -> QPAttr:
        """modify_qp attrs (section 9.4.2) -> QPAttr, every value checked as QP._apply would."""
        a = QPAttr(qp_state=state)
        if "access" in attrs:
            a.qp_access_flags = Access(get_flags(attrs, "access", ACCESS))
        if "pkey" in attrs:
            pkey = get_int(attrs, "pkey", 0, 0xFFFF)
            if pkey != 0xFFFF:
                raise AgentError("ENOTSUP", f"pkey {pkey:#x}: only the default partition 0xffff")
        if state == QPState.INIT:
            a.pkey_index = 0
        if state == QPState.RTR and not getattr(self.iut, "ecn", True):
            a.ecn = False                                # set_param ecn 0 (MR-ECN-011)
        if "dest_qpn" in attrs:
            a.dest_qp_num = get_int(attrs, "dest_qpn", 1, 0xFFFFFF)
        if "rq_psn" in attrs:
            a.rq_psn = get_int(attrs, "rq_psn", 0, 0xFFFFFF)
        if "sq_psn" in attrs:
            a.sq_psn = get_int(attrs, "sq_psn", 0, 0xFFFFFF)
        if "path_mtu" in attrs:
            mtus = [m for m in PATH_MTUS if m <= self.engine.max_pmtu]
            a.path_mtu = get_int(attrs, "path_mtu", 0, 1 << 31)
            if a.path_mtu not in mtus:
                raise AgentError("EINVAL", f"path_mtu {a.path_mtu}: use one of {mtus}")
        if "dgid" in attrs:
            g = attrs["dgid"]
            if not isinstance(g, str) or len(g) != 32 or not HEX.fullmatch(g):
                raise AgentError("EINVAL", f"dgid {g!r} is not 32 hex digits")
            a.dgid = ip_of_gid(g)
        if "dmac" in attrs:
            m = attrs["dmac"]
            if not isinstance(m, str) or not MAC.fullmatch(m):
                raise AgentError("EINVAL", f"dmac {m!r} is not aa:bb:cc:dd:ee:ff")
            a.dmac = m.lower()
        for name, hi in (("max_dest_rd_atomic", 16), ("max_rd_atomic", 16), ("min_rnr_timer", 31),
                         ("timeout", 31), ("retry_cnt", 7), ("rnr_retry", 7)):
            if name in attrs:
                setattr(a, name, get_int(attrs, name, 0, hi))
        if "cur_state" in attrs:                     # IBV_QP_CUR_STATE (MR-QP-006)
            a.cur_qp_state = QPState[get_enum(attrs, "cur_state", QP_STATES)]
        if "alt_path" in attrs:                      # IBV_QP_ALT_PATH: the QP refuses it (MR-QP-008)
            a.alt_path = get_obj(attrs, "alt_path")
        if "path_mig_state" in attrs:                # IBV_QP_PATH_MIG_STATE (MR-QP-008)
            a.path_mig_state = get_enum(attrs, "path_mig_state", ("MIGRATED", "REARM", "ARMED"))
        profile = get_enum(attrs, "profile", PROFILES, "compat")
        if profile != "compat" and not self.info.native:
            raise AgentError("ENOTSUP", "profile native: this agent claims compat only (start it with "
                                        "--profiles compat,native)")
        if profile == "native" and state == QPState.RTR:
            a.profile, a.native_params, self._pending_caps = "native", *self._native(get_obj(attrs, "native", {}))
        elif "profile" in attrs:                       # MR-NAT-003: the IUT refuses another than the QP's
            a.profile = profile
        return a

    def _native(self, nat: dict) -> tuple[dict, int]:
        """modify_qp RTR `native` {caps, sack_window, entropy_count} (9.4.2) -> the plane's native parameters
        (dp/cmconnect.agreed_profile, as a connection set-up that agreed them would) and the agreed set.
        caps defaults to the claim's NATIVE, SACK, OOO_PLACEMENT (and ATOMICS); it must hold those three
        (MR-NAT-004) and nothing the agent does not claim."""
        from .dp.cmconnect import agreed_profile
        base = CAP_NATIVE | CAP_SACK | CAP_OOO
        caps = get_int(nat, "caps", 0, 0xFF, base | (self.info.caps & CAP_ATOMICS))
        if caps & base != base:
            raise AgentError("EINVAL", f"native caps {caps:#04x}: NATIVE needs SACK and OOO_PLACEMENT (MR-NAT-004)")
        if caps & ~self.info.caps:
            raise AgentError("EINVAL", f"native caps {caps:#04x}: {caps & ~self.info.caps:#04x} not claimed "
                                       f"(claim {self.info.caps:#04x})")
        d = self.info.defaults
        w = get_int(nat, "sack_window", 32, 1024, int(d.get("sack_window") or 256))
        if w % 32:
            raise AgentError("EINVAL", f"sack_window {w}: a multiple of 32 in 32..1024 (04 4.3.2)")
        k = get_int(nat, "entropy_count", 1, 255, int(d.get("entropy_count") or 1))
        if k > 1 and not caps & CAP_MULTIPATH:
            raise AgentError("EINVAL", f"entropy_count {k} without MULTIPATH in caps (MR-MP-001: K = 1)")
        _, params = agreed_profile(caps, w, k)
        return params, caps

    _TRACKED = ("timeout", "retry_cnt", "rnr_retry", "min_rnr_timer", "max_rd_atomic", "max_dest_rd_atomic")

    def cmd_modify_qp(self, args: dict) -> None:
        _, e = self._lookup(self.qps, "qp", args)
        state = QPState[get_enum(args, "state", QP_STATES)]
        given = get_obj(args, "attrs", {})
        self._pending_caps = None
        attr = self._qp_attr(state, given)
        from .netinfo import NetInfoError
        with self.iut.lock:
            try:
                self.v.modify(e.qp, attr)        # the IUT validates it all before it changes anything
            except NetInfoError as ex:           # the next hop of dgid did not resolve (RTR)
                raise AgentError("EINVAL", f"no MAC address for {attr.dgid}: {ex}") from None
            if state == QPState.RESET:
                e.attrs = {k: e.attrs[k] for k in ("max_send_wr", "max_recv_wr")}
            if attr.qp_access_flags is not None:
                e.attrs["access"] = attr.qp_access_flags
            for k in self._TRACKED:
                if k in given:
                    e.attrs[k] = getattr(attr, k)
        if self._pending_caps is not None:             # a native RTR: what it agreed (6.3), for query_qp
            self._set_agreed(args["qp"], self._pending_caps)

    def cmd_query_qp(self, args: dict) -> dict:
        _, e = self._lookup(self.qps, "qp", args)
        with self.iut.lock:
            q = self.v.query(e.qp)
        a = e.attrs
        attrs = {"qpn": q["qpn"], "dest_qpn": q["dest_qpn"],
                 "dgid": gid_of(q["dgid"]) if q["dgid"] else None, "dmac": q["dmac"],
                 "path_mtu": q["path_mtu"], "sq_psn": q["sq_psn"], "rq_psn": q["rq_psn"],
                 "access": flag_names(a.get("access", 0), ACCESS), **{k: a.get(k) for k in self._TRACKED},
                 "max_send_wr": a["max_send_wr"], "max_recv_wr": a["max_recv_wr"], "error": q["error"]}
        return {"state": QPState(q["state"]).name, "attrs": attrs, "profile": q.get("profile") or "compat",
                "agreed_caps": self._agreed.get(args["qp"], 0)}

    # -- work requests ---------------------------------------------------------------
    def _sg_list(self, wr: dict, pd: Any) -> list[SGE]:
        out = []
        for i, s in enumerate(get_list(wr, "sg_list", [])):
            if not isinstance(s, dict):
                raise AgentError("EINVAL", f"sg_list[{i}] must be an object {{mr, offset, len}}")
            _, mr = self._lookup(self.mrs, "mr", s)
            off = get_int(s, "offset", 0, 1 << 62, 0)
            n = get_int(s, "len", 0, 1 << 62)
            if off + n > mr.length:
                raise AgentError("EINVAL", f"sg_list[{i}]: offset {off} + len {n} is past the MR's {mr.length} bytes")
            out.append(SGE(mr.addr + off, n, mr.lkey))
        return out

    def _send_wr(self, wr: dict, pd: Any) -> SendWR:
        op = WROpcode[get_enum(wr, "opcode", WR_OPCODES)]
        flags = SendFlags(get_flags(wr, "flags", SEND_FLAGS, ["SIGNALED"]))    # absent: signaled; [] unsignaled
        s = SendWR(wr_id=get_u64(wr, "wr_id"), opcode=op, sg_list=self._sg_list(wr, pd), send_flags=flags)
        if op in (WROpcode.SEND_WITH_IMM, WROpcode.RDMA_WRITE_WITH_IMM):
            s.imm_data = get_int(wr, "imm", 0, 0xFFFFFFFF)
        if op == WROpcode.SEND_WITH_INV:                 # the peer's key to invalidate (IETH, MR-MEM-040)
            s.invalidate_rkey = get_int(wr, "invalidate_rkey", 0, 0xFFFFFFFF)
        if op not in (WROpcode.SEND, WROpcode.SEND_WITH_IMM, WROpcode.SEND_WITH_INV):
            remote = get_obj(wr, "remote")
            s.remote_addr = get_u64(remote, "va")
            s.rkey = get_int(remote, "rkey", 0, 0xFFFFFFFF)
        if op == WROpcode.ATOMIC_FETCH_AND_ADD:
            s.compare_add = get_u64(wr, "swap_add")
        elif op == WROpcode.ATOMIC_CMP_AND_SWP:
            s.compare_add = get_u64(wr, "compare")
            s.swap = get_u64(wr, "swap_add")
        return s

    def cmd_post_send(self, args: dict) -> None:
        _, e = self._lookup(self.qps, "qp", args)
        wrs = [self._send_wr(w, None) for w in get_wrs(args)]
        self.v.post_send(e.qp, wrs)             # checked there (verbs.check_send_wr), whole or not at all (MR-CONF-016)

    def cmd_post_recv(self, args: dict) -> None:
        _, e = self._lookup(self.qps, "qp", args)
        wrs = [RecvWR(wr_id=get_u64(w, "wr_id"), sg_list=self._sg_list(w, None)) for w in get_wrs(args)]
        self.v.post_recv(e.qp, wrs)

    def cmd_poll_cq(self, args: dict) -> dict:
        _, cq = self._lookup(self.cqs, "cq", args)
        n = get_int(args, "max", 1, MAX_POLL, 16)
        timeout_ms = get_int(args, "timeout_ms", 0, MAX_TIMEOUT_MS, 0)
        deadline = time.monotonic() + timeout_ms / 1000
        wcs = self.v.poll(cq, n)
        while not wcs and time.monotonic() < deadline:       # MR-CONF-020: at most timeout_ms
            time.sleep(min(0.0002, max(0.0, deadline - time.monotonic())))
            wcs = self.v.poll(cq, n)
        return {"completions": [self._wc(w) for w in wcs]}

    def cmd_req_notify_cq(self, args: dict) -> None:
        """ibv_req_notify_cq (MR-BTH-004): arm the CQ for its next completion, or only its next solicited one."""
        _, cq = self._lookup(self.cqs, "cq", args)
        solicited = get(args, "solicited_only", False)
        if not isinstance(solicited, bool):
            raise AgentError("EINVAL", "solicited_only must be true or false")
        self.v.req_notify(cq, solicited)

    def cmd_get_cq_event(self, args: dict) -> dict:
        """ibv_get_cq_event on the CQ's own channel: whether its completion event came within timeout_ms."""
        _, cq = self._lookup(self.cqs, "cq", args)
        timeout_ms = get_int(args, "timeout_ms", 0, MAX_TIMEOUT_MS, 0)
        return {"event": bool(self.v.get_event(cq, timeout_ms / 1000))}

    def cmd_get_async_events(self, args: dict) -> dict:
        """ibv_get_async_event, repeated: the events about this session's QPs and CQs raised so far (waiting up
        to timeout_ms for the first); events about other sessions' resources are not reported."""
        timeout_ms = get_int(args, "timeout_ms", 0, MAX_TIMEOUT_MS, 0)
        qps = {id(e.qp): h for h, e in self.qps.items()}
        cqs = {id(cq): h for h, cq in self.cqs.items()}
        out: list[dict] = []
        deadline = time.monotonic() + timeout_ms / 1000
        while len(out) < 256:
            ev = self.v.next_event(max(0.0, deadline - time.monotonic()) if not out else 0.0)
            if ev is None:
                break
            typ, qp, qp_num, cq = ev
            qh, ch = qps.get(id(qp)), cqs.get(id(cq))
            if qh is None and ch is None:
                continue
            out.append({"type": f"IBV_EVENT_{typ}", "qp": qh, "qp_num": qp_num, "cq": ch})
        return {"events": out}

    @staticmethod
    def _wc(wc) -> dict:
        d = {"wr_id": hex64(wc.wr_id), "status": "IBV_WC_" + wc.status.name,
             "opcode": "IBV_WC_" + wc.opcode.name, "byte_len": wc.byte_len, "qp_num": wc.qp_num}
        if wc.imm_data is not None:
            d["imm"] = wc.imm_data
        if getattr(wc, "invalidated_rkey", None) is not None:       # IBV_WC_WITH_INV (MR-RC-019)
            d["invalidated_rkey"] = wc.invalidated_rkey
        if wc.vendor_err:
            d["vendor_err"] = wc.vendor_err
        return d

    # -- memory (MR-CONF-022) ----------------------------------------------------------
    def cmd_mem_read(self, args: dict) -> dict:
        _, mr = self._lookup(self.mrs, "mr", args)
        off = get_int(args, "offset", 0, 1 << 62)
        n = get_int(args, "len", 0, MAX_MEM_IO)
        if off + n > mr.length:
            raise AgentError("EINVAL", f"offset {off} + len {n} is past the MR's {mr.length} bytes")
        with self.v.snapshot():                  # between two rounds of the loop where the IUT allows it
            data = self.v.mem(mr)[off:off + n].tobytes()
        return {"hex": data.hex()}

    def cmd_mem_write(self, args: dict) -> None:
        _, mr = self._lookup(self.mrs, "mr", args)
        off = get_int(args, "offset", 0, 1 << 62)
        data = get_bytes(args, "hex")
        if off + len(data) > mr.length:
            raise AgentError("EINVAL", f"offset {off} + {len(data)} bytes is past the MR's {mr.length} bytes")
        with self.v.snapshot():
            self.v.mem(mr)[off:off + len(data)] = np.frombuffer(data, np.uint8)

    # -- counters and knobs ------------------------------------------------------------
    def cmd_get_counters(self, args: dict) -> dict:
        if args.get("src") is not None:               # MR-SEC-006: the counts of one source IP address
            src = args["src"]
            try:
                ipaddress.ip_address(src)
            except (TypeError, ValueError):
                raise AgentError("EINVAL", f"src {src!r} is not an IP address") from None
            by_source = getattr(self.iut, "source_counters", None)
            if by_source is None:
                raise AgentError("ENOTSUP", f"{self.iut.kind}: no counters by source address")
            return {"counters": by_source(src)}
        if "qp" in args and args["qp"] is not None:
            _, e = self._lookup(self.qps, "qp", args)
            return {"counters": self.v.qp_counters(e.qp)}
        if self.iut.kind == "daemon":
            return {"counters": self.iut.counters(self.v)}
        return {"counters": self.iut.counters()}

    def cmd_set_param(self, args: dict) -> None:
        name = get(args, "name")
        params = self.iut.params
        if name not in params:
            raise AgentError("ENOTSUP", f"parameter {name!r}: this IUT sets {sorted(params) or 'none'}")
        read, put, lo, hi = params[name]
        value = get_int(args, "value", lo, hi)
        self._saved_params.setdefault(name, read())
        put(value)

    # -- connection set-up (section 6).  cm_connect: the active side of 6.5.1 in the MRC1 format
    # (metaroce_xdp/cm.py, as `metaroce perf` uses it).  The passive side (cm_listen, cm_wait) and
    # the pingpong format are not offered yet: a tester gets ENOTSUP ("not supported by the IUT").
    def cmd_cm_listen(self, args: dict) -> None:
        """The passive side of 6.5.2 for one QP in INIT: REQs on TCP `port` (all addresses); the first
        valid one connects the QP.  Set-ups in progress are bounded (MR-SEC-017); `check_address` (bool)
        makes a REQ whose GID is not the TCP source address a REJ ADDRESS_MISMATCH (MR-SEC-019)."""
        from . import cm
        h, e = self._lookup(self.qps, "qp", args)
        fmt = get_enum(args, "format", ("mrc1", "pingpong"), "mrc1")
        port = get_int(args, "port", 1, 65535, cm.CM_PORT)
        check = get(args, "check_address", False)
        if not isinstance(check, bool):
            raise AgentError("EINVAL", "check_address must be true or false")
        st = self.v.state(e.qp)
        if st != QPState.INIT:
            raise AgentError("ESTATE", f"cm_listen needs the QP in INIT, it is {st.name}")
        if h in self._listeners:
            raise AgentError("EBUSY", f"QP {h} is already listening")
        try:
            self._listeners[h] = _PassiveCM(self, h, port, check, get_int(args, "caps", 0, 0xFF, 0) & self.info.caps,
                                            fmt)
        except cm.CMError as ex:
            raise AgentError("EBUSY" if "in use" in str(ex) else "EINTERNAL", str(ex)) from None

    def cmd_cm_wait(self, args: dict) -> dict:
        h, _ = self._lookup(self.qps, "qp", args)
        lst = self._listeners.get(h)
        if lst is None:
            raise AgentError("ESTATE", f"QP {h} is not listening (cm_listen first)")
        timeout = get_int(args, "timeout_ms", 0, MAX_TIMEOUT_MS, 0) / 1000
        if not lst.done.wait(timeout):
            raise AgentError("ETIMEDOUT", f"no connection set up within {timeout:g} s")
        return lst.result

    def _pp_connect_qp(self, h: int, theirs, psn: int) -> None:
        """MR-CM-044: the fixed attributes of ibv_rc_pingpong (path MTU 1024)."""
        from . import cm
        self.cmd_modify_qp({"qp": h, "state": "RTR", "attrs": {
            "dest_qpn": theirs.qpn, "rq_psn": theirs.psn, "path_mtu": 1024, "dgid": theirs.gid.hex(),
            "max_dest_rd_atomic": cm.PP_ATTRS["max_dest_rd_atomic"], "min_rnr_timer": cm.PP_ATTRS["min_rnr_timer"]}})
        self.cmd_modify_qp({"qp": h, "state": "RTS", "attrs": {
            "sq_psn": psn, "timeout": cm.PP_ATTRS["timeout"], "retry_cnt": cm.PP_ATTRS["retry_cnt"],
            "rnr_retry": cm.PP_ATTRS["rnr_retry"], "max_rd_atomic": cm.PP_ATTRS["max_rd_atomic"]}})

    def _pp_connect(self, h: int, host: str, port: int, timeout: float) -> dict:
        """cm_connect format pingpong: the client role of 6.7 (MR-CM-041..044); MRC1 is never sent."""
        from . import cm
        qp = self.qps[h].qp
        psn = cm.random_psn()
        mine = cm.PingpongDest(0, qp.qp_num, psn, cm.ip_to_gid(self.engine.local_ip))
        try:
            with cm.connect(host, port, timeout) as ch:
                theirs = cm.pp_client_exchange(ch, mine, timeout)
            self._pp_connect_qp(h, theirs, psn)                       # after the "done", as rc_pingpong
        except (cm.CMError, AgentError) as ex:
            self._qp_to_error(h)
            raise AgentError("ETIMEDOUT" if "timed out" in str(ex) else "EINTERNAL",
                             f"cm_connect pingpong: {ex}") from None
        self._set_agreed(h, 0)
        return {"profile": "compat", "agreed_caps": 0, "peer": {"qpn": theirs.qpn, "psn": theirs.psn,
                "gid": theirs.gid.hex()}, "params": {"path_mtu": 1024, "sack_window": 0, "entropy_count": 1}}

    @staticmethod
    def _loop_dmac(mac: bytes) -> dict:
        """MR-CM-024: the mac field of a REQ/REP is informational; modify_qp finds the next hop from the
        GID (both IUTs run on a real interface with a forwarding table)."""
        return {}

    def _qp_to_error(self, h: int) -> None:
        try:
            if self.v.state(self.qps[h].qp) != QPState.ERR:
                self.cmd_modify_qp({"qp": h, "state": "ERR", "attrs": {}})
        except (AgentError, KeyError):
            pass

    def _cm_offer(self, caps: int) -> tuple[int, int]:
        """(sack_window, entropy_count) of a REQ or REP offering `caps`: the claim's native defaults (9.4.2)
        where SACK and MULTIPATH are offered, 0 and 1 where not (MR-CM-013)."""
        d = self.info.defaults or {}
        w = int(d.get("sack_window") or 256) if caps & CAP_SACK else 0
        k = int(d.get("entropy_count") or 1) if caps & CAP_MULTIPATH else 1
        return w, k

    @staticmethod
    def _cm_rtr_native(attrs: dict, agreed: int, w: int, k: int) -> str:
        """The RTR attributes of a set-up that agreed `agreed`: native ones (MR-CM-016, 6.4: W and K the
        smaller of the two offers) when NATIVE, SACK and OOO_PLACEMENT are all agreed; the profile."""
        base = CAP_NATIVE | CAP_SACK | CAP_OOO
        if agreed & base != base:
            return "compat"
        attrs["profile"] = "native"
        attrs["native"] = {"caps": agreed, "sack_window": w, "entropy_count": k if agreed & CAP_MULTIPATH else 1}
        return "native"

    def cmd_cm_connect(self, args: dict) -> dict:
        from . import cm
        h, e = self._lookup(self.qps, "qp", args)
        fmt = get_enum(args, "format", ("mrc1", "pingpong"), "mrc1")
        host = get(args, "host")
        if not isinstance(host, str) or not host:
            raise AgentError("EINVAL", "host must be a host name or address")
        port = get_int(args, "port", 1, 65535, cm.CM_PORT)
        timeout = get_int(args, "timeout_ms", 1, MAX_TIMEOUT_MS, int(cm.CM_TIMEOUT * 1000)) / 1000
        caps = get_int(args, "caps", 0, 0xFF, 0) & self.info.caps
        flags = get_int(args, "flags", 0, 0xFFFF, cm.FLAG_COMPAT_OK)
        qp = e.qp
        st = self.v.state(qp)
        if st != QPState.INIT:                                         # MR-CM-025
            raise AgentError("ESTATE", f"cm_connect needs the QP in INIT, it is {st.name}")
        eng = self.engine
        if fmt == "pingpong":
            return self._pp_connect(h, host, port, timeout)
        mtu = max(m for m in PATH_MTUS if m <= eng.max_pmtu)
        psn = cm.random_psn()                                          # MR-CM-007, MR-SEC-020
        w, k = self._cm_offer(caps)
        req = cm.CMMsg(cm.MsgType.REQ, cookie=cm.new_cookie(), flags=flags, capabilities=caps,
                       gid=cm.ip_to_gid(eng.local_ip), qpn=qp.qp_num, psn=psn, path_mtu=cm.MTU_ENUM[mtu],
                       sack_window=w, entropy_count=k,
                       mac=cm.mac_bytes(eng.local_mac), tlvs=[(cm.TLV_IMPL_NAME, self.info.impl.encode())])
        profile = "compat"

        def connect_qp(rep) -> None:
            nonlocal profile
            attrs = {"dest_qpn": rep.qpn, "rq_psn": rep.psn, "path_mtu": rep.mtu_bytes,
                     "dgid": cm.ip_to_gid(cm.gid_to_ip(rep.gid)).hex(), "max_dest_rd_atomic": req.max_dest_rd_atomic,
                     "min_rnr_timer": req.min_rnr_timer}
            attrs.update(self._loop_dmac(rep.mac))         # MR-CM-024: next hop resolved from the GID
            profile = self._cm_rtr_native(attrs, rep.capabilities, min(rep.sack_window, req.sack_window),
                                          min(rep.entropy_count, req.entropy_count))
            self.cmd_modify_qp({"qp": h, "state": "RTR", "attrs": attrs})
            self.cmd_modify_qp({"qp": h, "state": "RTS", "attrs": {
                "sq_psn": psn, "timeout": req.timeout, "retry_cnt": req.retry_cnt, "rnr_retry": req.rnr_retry,
                "max_rd_atomic": min(req.max_rd_atomic, rep.max_dest_rd_atomic)}})
        try:
            try:
                with cm.connect(host, port, timeout) as ch:
                    rep = cm.active_exchange(ch, req, connect_qp, timeout)
            except cm.CMError:
                self._qp_to_error(h)                                   # 6.5.1 FAILED, MR-CM-030
                raise
        except cm.ConnectFailed as ex:
            raise AgentError("ETIMEDOUT" if "timed out" in str(ex) else "EINTERNAL",
                             f"cm_connect to {host}:{port}: {ex}") from None
        except cm.Rejected as ex:
            raise AgentError("EACCES" if ex.by_peer else "EINVAL", f"cm_connect: {ex}") from None
        except cm.CMError as ex:
            raise AgentError("ETIMEDOUT" if "timed out" in str(ex) else "EINTERNAL", f"cm_connect: {ex}") from None
        self._set_agreed(h, rep.capabilities)
        native = profile == "native"
        return {"profile": profile, "agreed_caps": rep.capabilities,
                "peer": {"qpn": rep.qpn, "psn": rep.psn, "gid": rep.gid.hex()},
                "params": {"path_mtu": rep.mtu_bytes,
                           "sack_window": min(rep.sack_window, req.sack_window) if native else 0,
                           "entropy_count": min(rep.entropy_count, req.entropy_count)
                           if native and rep.capabilities & CAP_MULTIPATH else 1}}


class _PassiveCM:
    """cm_listen's server: accepts TCP connections in a thread and runs each exchange in its own.

    MR-SEC-017: at most SETUP_TOTAL exchanges in progress, SETUP_PER_SOURCE per source address; a
    connection beyond either is closed at once, before anything is read, and counted in the engine's
    cm_drop_setup_limit (MR-SEC-031).  MR-SEC-018: the QP is touched only by make_rep, after the REQ
    has passed every check of 6.2 (cm.read_msg, passive_exchange); an exchange abandoned after the REP
    (REJ, cm_timeout, TCP close before the RTU) takes the QP back to INIT for the next REQ."""

    SETUP_TOTAL, SETUP_PER_SOURCE = 64, 8             # 10.4 defaults

    def __init__(self, agent: "Agent", h: int, port: int, check_address: bool, caps: int,
                 fmt: str = "mrc1") -> None:
        from . import cm
        self.agent, self.h, self.check, self.caps, self.fmt = agent, h, check_address, caps, fmt
        self.listener = cm.Listener(port)
        self.done = threading.Event()
        self.result: dict = {}
        self.lock = threading.Lock()
        self.busy = False                              # an exchange holds the QP (REP sent, no RTU yet)
        self.profile = "compat"                        # the profile the exchange holding it set up
        self.total = 0
        self.per_source: dict[str, int] = {}
        self.closed = False
        threading.Thread(target=self._serve, name=f"cm-listen-{port}", daemon=True).start()

    def close(self) -> None:
        self.closed = True
        try:
            self.listener.close()
        except OSError:
            pass

    def _serve(self) -> None:
        from . import cm
        while not self.closed:
            try:
                ch = self.listener.accept(0.1)
            except cm.CMError:
                continue
            except OSError:
                return
            src = ch.peer
            with self.lock:
                if self.total >= self.SETUP_TOTAL or self.per_source.get(src, 0) >= self.SETUP_PER_SOURCE:
                    self.agent.iut.agent_counts["cm_drop_setup_limit"] += 1
                    ch.close()                                             # MR-SEC-017: at once, no QP
                    continue
                self.total += 1
                self.per_source[src] = self.per_source.get(src, 0) + 1
            threading.Thread(target=self._exchange, args=(ch, src), daemon=True).start()

    def _exchange(self, ch, src: str) -> None:
        from . import cm
        agent, h = self.agent, self.h
        took = False
        try:
            if self.fmt == "pingpong":
                took = self._pp_exchange(ch)
                return
            def make_rep(req):
                nonlocal took
                if self.check and cm.gid_to_ip(req.gid) != _canon_ip(src):             # MR-SEC-019
                    raise cm.Rejected(cm.Reason.ADDRESS_MISMATCH, f"GID {cm.gid_text(req.gid)} is not {src}",
                                      by_peer=False)
                if req.p_key != 0xFFFF:                # MR-CM-023; checked before the QP is taken (MR-SEC-018)
                    raise cm.Rejected(cm.Reason.INVALID_PARAM, f"p_key {req.p_key:#06x} is not the QP's 0xffff",
                                      by_peer=False)
                with self.lock:
                    if self.busy or self.done.is_set() or self.closed:
                        raise cm.Rejected(cm.Reason.NO_RESOURCES, "the listening QP is taken", by_peer=False)
                    self.busy = took = True
                eng = agent.engine
                mtu = min(req.mtu_bytes, max(m for m in PATH_MTUS if m <= eng.max_pmtu))
                # MR-CM-022: the QP gets this side's own values (those the REP announces), never the REQ's
                own = cm.CMMsg(cm.MsgType.REP, max_rd_atomic=16, max_dest_rd_atomic=16)
                attrs = {"dest_qpn": req.qpn, "rq_psn": req.psn, "path_mtu": mtu, "dgid": req.gid.hex(),
                         "max_dest_rd_atomic": own.max_dest_rd_atomic, "min_rnr_timer": own.min_rnr_timer}
                attrs.update(agent._loop_dmac(req.mac))    # MR-CM-024: modify_qp resolves the next hop
                # what passive_exchange agrees (MR-CM-014); a native QP when NATIVE is in it, W and K the
                # smaller of the REQ's and ours, which the REP announces (6.4)
                agreed = cm.agree_caps(req.capabilities, self.caps)
                w, k = agent._cm_offer(agreed)
                own.sack_window = min(w, req.sack_window) if agreed & CAP_SACK else 0
                own.entropy_count = min(k, req.entropy_count) if agreed & CAP_MULTIPATH else 1
                self.profile = agent._cm_rtr_native(attrs, agreed, own.sack_window, own.entropy_count)
                agent.cmd_modify_qp({"qp": h, "state": "RTR", "attrs": attrs})          # MR-CM-026
                qp = agent.qps[h].qp
                self.psn = cm.random_psn()                                            # MR-CM-007
                own.qpn, own.psn, own.gid, own.mac = qp.qp_num, self.psn, cm.ip_to_gid(eng.local_ip), \
                    cm.mac_bytes(eng.local_mac)
                own.path_mtu = cm.MTU_ENUM[mtu]
                return own
            with ch:
                req, rep = cm.passive_exchange(ch, self.caps, make_rep)
            agent.cmd_modify_qp({"qp": h, "state": "RTS", "attrs": {                  # MR-CM-021, MR-CM-022
                "sq_psn": rep.psn, "timeout": rep.timeout, "retry_cnt": rep.retry_cnt, "rnr_retry": rep.rnr_retry,
                "max_rd_atomic": min(rep.max_rd_atomic, req.max_dest_rd_atomic)}})
            agent._set_agreed(h, rep.capabilities)
            native = self.profile == "native"
            self.result = {"profile": self.profile, "agreed_caps": rep.capabilities,
                           "peer": {"qpn": req.qpn, "psn": req.psn, "gid": req.gid.hex()},
                           "params": {"path_mtu": rep.mtu_bytes, "sack_window": rep.sack_window if native else 0,
                                      "entropy_count": rep.entropy_count if native else 1}}
            self.done.set()
        except Exception as ex:                        # noqa: BLE001 - an abandoned exchange (MR-SEC-018)
            log.info("cm_listen: exchange with %s abandoned: %s", src, ex)
            if took and not self.done.is_set():
                try:                                   # give the QP back for the next REQ
                    e = agent.qps[h]
                    access = flag_names(e.attrs.get("access", 0), ACCESS)
                    agent.cmd_modify_qp({"qp": h, "state": "RESET", "attrs": {}})
                    agent.cmd_modify_qp({"qp": h, "state": "INIT", "attrs": {"access": access, "pkey": 0xFFFF}})
                except Exception:                      # noqa: BLE001 - the QP may be gone (reset, destroy_qp)
                    log.exception("cm_listen: cannot return QP handle %d to INIT", h)
        finally:
            with self.lock:
                if took:
                    self.busy = False
                self.total -= 1
                self.per_source[src] -= 1


def _pp_server(self, ch) -> bool:
    """cm_listen format pingpong: the server role of 6.7 (MR-CM-043, MR-CM-045): read the client's 52
    bytes, RTR and RTS, write ours, read the "done".  Anything that is not a pingpong message (an MRC1
    REQ too, MR-CM-046) closes the connection without a reply and leaves the QP alone."""
    from . import cm
    agent, h = self.agent, self.h
    with ch:
        theirs = cm.pp_decode(ch.recv_exact(cm.PP_MSG_LEN, cm.CM_TIMEOUT))
        with self.lock:
            if self.busy or self.done.is_set() or self.closed:
                raise cm.CMError("the listening QP is taken")
            self.busy = True
        try:
            qp = agent.qps[h].qp
            self.psn = cm.random_psn()
            agent._pp_connect_qp(h, theirs, self.psn)
            self.result = {"profile": "compat", "agreed_caps": 0,
                           "peer": {"qpn": theirs.qpn, "psn": theirs.psn, "gid": theirs.gid.hex()},
                           "params": {"path_mtu": 1024, "sack_window": 0, "entropy_count": 1}}
            agent._set_agreed(h, 0)
            self.done.set()                                   # usable before the "done" (MR-CM-045)
            ch.send(cm.pp_encode(cm.PingpongDest(0, qp.qp_num, self.psn, cm.ip_to_gid(agent.engine.local_ip))))
            try:
                ch.recv_some(cm.PP_MSG_LEN, cm.CM_TIMEOUT)
            except cm.CMError:
                pass
        finally:
            with self.lock:
                self.busy = False
    return False


_PassiveCM._pp_exchange = _pp_server


def _canon_ip(a: str) -> str:
    try:
        return str(ipaddress.ip_address(a))
    except ValueError:
        return a


# ---- TCP server ----------------------------------------------------------------------
class AgentServer(_AgentServer):
    """The agent's TCP listener (MR-CONF-013): one session (Agent) per connection, each on its thread.

        srv = AgentServer(iut, "127.0.0.1", 0).start(); host, port = srv.address; ...; srv.close()

    iut: agent_iut.CompiledIUT or DaemonIUT (the server does not close it).
    """

    log = log

    def __init__(self, iut: Any, host: str, port: int = DEFAULT_PORT,
                 impl_info: ImplInfo | dict | None = None) -> None:
        self.iut = iut
        self.impl_info = ImplInfo.of(impl_info)
        super().__init__(host, port)

    def new_session(self) -> Agent:
        return Agent(self.iut, self.impl_info)


# ---- command line ---------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m metaroce_xdp.agent",
        description="MetaRoCE test agent (spec 9.4): serves the upper tester on TCP. Off unless started; "
                    "listens only on --listen (MR-SEC-027).",
        epilog="example: python -m metaroce_xdp.agent --dev veth1 --listen 10.55.0.2 --port 18516")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="TCP port (default %(default)s)")
    p.add_argument("--listen", default="127.0.0.1", help="address to bind (default %(default)s)")
    p.add_argument("--iut", choices=("compiled", "daemon"), default="compiled",
                   help="what the agent drives: the compiled data plane in this process (default), or metaroced "
                        "through its client library")
    p.add_argument("--dev", help="RoCE interface: the one the plane opens (compiled; required), or the daemon's "
                                 "device to use (daemon; default: its only one)")
    p.add_argument("--socket", help="metaroced's socket (--iut daemon; default METAROCE_SOCKET or "
                                    "/run/metaroce/metaroced.sock)")
    p.add_argument("--xdp-mode", choices=("drv", "skb"), help="XDP attach mode (Context.open's default if unset)")
    p.add_argument("--queue", type=int, help="NIC queue of the AF_XDP socket (Context.open's default if unset)")
    p.add_argument("--profiles", default=os.environ.get("METAROCE_AGENT_PROFILES", "compat"),
                   help="the profiles hello claims, comma-separated: compat (default) or compat,native "
                        "(default from METAROCE_AGENT_PROFILES)")
    p.add_argument("--caps", default=os.environ.get("METAROCE_AGENT_CAPS", ""),
                   help="capabilities claimed beyond ATOMICS (and NATIVE, SACK, OOO_PLACEMENT with native), "
                        "comma-separated: MULTIPATH, CC_DELAY, CREDITS (default from METAROCE_AGENT_CAPS)")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    profiles = [x.strip() for x in a.profiles.split(",") if x.strip()]
    caps = [x.strip().upper() for x in a.caps.split(",") if x.strip()]
    try:
        ImplInfo.claiming(profiles, caps)
    except ValueError as e:
        p.error(str(e))
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from . import agent_iut
    try:
        if a.iut == "compiled":
            if not a.dev:
                p.error("--iut compiled needs --dev")
            opts = {k: v for k, v in (("xdp_mode", a.xdp_mode), ("queue", a.queue)) if v is not None}
            iut = agent_iut.CompiledIUT.open(a.dev, **opts)
        else:
            from .daemon.client import default_socket
            iut = agent_iut.DaemonIUT(a.socket or default_socket(), a.dev)
    except Exception as e:
        print(f"metaroce agent: cannot open the {a.iut} IUT on {a.dev}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    # the claim follows the plane: its DCQCN reaction point runs unless METAROCE_DCQCN_ENABLED=0 (in the agent's
    # process, or in metaroced's: its open_device reply gives the parameters, query_qp the state; agent_iut.py)
    if "native" in profiles and "native" not in getattr(iut, "profiles", ["compat", "native"]):
        iut.close()
        print(f"metaroce agent: {iut.describe()} serves {iut.profiles} only: no native claim", file=sys.stderr)
        return 1
    info = ImplInfo.claiming(profiles, caps, iut=iut.describe(), dcqcn=iut.dcqcn is not None)
    try:
        srv = AgentServer(iut, a.listen, a.port, impl_info=info)
    except OSError as e:
        iut.close()
        print(f"metaroce agent: cannot listen on {a.listen}:{a.port}: {e}", file=sys.stderr)
        return 1
    log.info("agent on %s:%d for %s (%s)", *srv.address, iut.describe(), iut.local_ip)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.close()
        iut.close()
    return 0


__all__ = ["Agent", "AgentClient", "AgentError", "AgentServer", "ImplInfo", "PROTO", "DEFAULT_PORT",
           "gid_of", "ip_of_gid"]

if __name__ == "__main__":
    sys.exit(main())
