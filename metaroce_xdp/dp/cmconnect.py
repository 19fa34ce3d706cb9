"""Connection set-up for the compiled data plane with capability negotiation (06-connection.md, MRC1).

    from metaroce_xdp.dp.cmconnect import connect_qp, accept_qp
    # active side, QP in INIT                       # passive side, QP in INIT
    connect_qp(qp, "10.77.0.2", profile="auto")     accept_qp(qp, cm.Listener(port), profile="auto")

`profile` is the user's switch of issue 9: "native" offers the native capabilities and refuses a
compat-only peer (COMPAT_OK clear, MR-CM-017); "compat" offers none of them; "auto" (the default)
offers them with COMPAT_OK set, so two native endpoints run native and a compat-only peer (the Python
engine, an agent, Linux Soft-RoCE through the MRC1 exchange) falls back to compat (MR-NAT-002,
MR-CM-016).  The agreed capability set chooses the QP's profile at RTR and its native parameters: W
and K are the agreed sack_window and entropy_count (6.4), CC_DELAY is not offered by this endpoint
(MR-CC-042: its RTT samples carry host scheduling delay) and `rto_min` is raised to RTO_MIN_US; a peer's
NATIVE_TIMING TLV sets T_peer (MR-CC-040).
ATOMICS is offered with every profile (native atomics: native/plane.py, MR-NAT-006).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, ContextManager

from .. import cm
from ..verbs_types import InvalidArgument, InvalidState, QPAttr, QPState

PROFILES = ("native", "compat", "auto")
NATIVE_OFFER = cm.Cap.NATIVE | cm.Cap.SACK | cm.Cap.OOO_PLACEMENT | cm.Cap.MULTIPATH
W_OFFER, K_OFFER = 256, 16
RTO_MIN_US = 4000            # MR-CC-042, MR-LOSS-005: above this endpoint's host delay on shared cores
QP_RD = 16


def offer(profile: str, local_ip: str) -> tuple[int, int]:
    """(capabilities, flags) this endpoint puts in its REQ or REP for `profile` (MR-CM-013, MR-CM-017)."""
    if profile not in PROFILES:
        raise InvalidArgument(f"profile {profile!r}: one of {', '.join(PROFILES)}")
    caps = (0 if profile == "compat" else int(NATIVE_OFFER)) | cm.Cap.ATOMICS
    if ":" in local_ip:
        caps |= cm.Cap.IPV6
    return int(caps), 0 if profile == "native" else cm.FLAG_COMPAT_OK


def agreed_profile(agreed: int, w: int, k: int, t_peer: int | None = None) -> tuple[str, dict | None]:
    """The QP's profile and native parameters from the agreed set (MR-CM-016, MR-NAT-004, 6.4); t_peer: the
    ack_coalesce_us the peer announced (peer_timing), None for the default (MR-CC-040)."""
    if not (agreed & cm.Cap.NATIVE and agreed & cm.Cap.SACK and agreed & cm.Cap.OOO_PLACEMENT):
        return "compat", None
    out = {"w": w, "k": k if agreed & cm.Cap.MULTIPATH else 1, "cc_delay": 1 if agreed & cm.Cap.CC_DELAY else 0,
           "credits": 1 if agreed & cm.Cap.CREDITS else 0, "rto_min": RTO_MIN_US}
    if t_peer is not None:
        out["t_peer"] = t_peer
    return "native", out


peer_timing = cm.peer_timing        # T_peer from the peer's NATIVE_TIMING TLV (MR-CC-040); this endpoint sends none


def _need_init(qp) -> None:
    if qp.query_state() != QPState.INIT:                                  # MR-CM-025
        raise InvalidState(f"connection set-up needs the QP in INIT, it is {qp.query_state().name}")


def connect_qp(qp, host: str, *, port: int = cm.CM_PORT, profile: str = "auto", mtu: int = 1024,
               timeout: float = cm.CM_TIMEOUT) -> dict:
    """Active side of 6.5.1: REQ, REP, RTR and RTS with the agreed profile, RTU.  Returns
    {"profile", "agreed_caps"}; raises cm.Rejected (NATIVE_REQUIRED ...) or cm.ConnectFailed."""
    _need_init(qp)
    ctx = qp.ctx
    caps, flags = offer(profile, ctx.local_ip)
    psn = cm.random_psn()                                                  # MR-CM-007
    req = cm.CMMsg(cm.MsgType.REQ, cookie=cm.new_cookie(), flags=flags, capabilities=caps,
                   gid=cm.ip_to_gid(ctx.local_ip), qpn=qp.qp_num, psn=psn, path_mtu=cm.MTU_ENUM[mtu],
                   mac=cm.mac_bytes(ctx.local_mac), max_rd_atomic=QP_RD, max_dest_rd_atomic=QP_RD,
                   sack_window=W_OFFER if caps & cm.Cap.SACK else 0,
                   entropy_count=K_OFFER if caps & cm.Cap.MULTIPATH else 1)
    out: dict = {}

    def to_rts(rep: cm.CMMsg) -> None:                                     # MR-CM-027
        prof, params = agreed_profile(rep.capabilities, rep.sack_window, rep.entropy_count, peer_timing(rep))
        qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=rep.qpn, rq_psn=rep.psn, path_mtu=rep.mtu_bytes,
                         dgid=cm.gid_to_ip(rep.gid), max_dest_rd_atomic=QP_RD, min_rnr_timer=req.min_rnr_timer,
                         profile=prof, native_params=params))
        qp.atomics = bool(rep.capabilities & caps & cm.Cap.ATOMICS)                 # MR-CM-019
        qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=psn, timeout=req.timeout, retry_cnt=req.retry_cnt,
                         rnr_retry=req.rnr_retry, max_rd_atomic=min(QP_RD, rep.max_dest_rd_atomic)))
        out.update(profile=prof, agreed_caps=int(rep.capabilities))

    with cm.connect(host, port, timeout) as ch:
        cm.active_exchange(ch, req, to_rts, timeout)
    return out


def accept_qp(qp, listener: cm.Listener, *, profile: str = "auto", mtu: int = 1024,
              timeout: float = cm.CM_TIMEOUT, check_address: bool = True) -> dict:
    """Passive side of 6.5.2 on the next connection of `listener`: RTR with the agreed profile before the
    REP (MR-CM-026), RTS after the RTU.  Returns {"profile", "agreed_caps"}."""
    _need_init(qp)
    ctx = qp.ctx
    caps, flags = offer(profile, ctx.local_ip)
    st: dict = {}

    def make_rep(req: cm.CMMsg) -> cm.CMMsg:
        why = cm.address_problem(req.gid, ch.peer) if check_address else ""
        if why:                                                            # MR-SEC-019 (client.Listener.accept)
            raise cm.Rejected(cm.Reason.ADDRESS_MISMATCH, why, by_peer=False)
        agreed = cm.agree_caps(req.capabilities, caps)                     # MR-CM-014
        if not agreed & cm.Cap.NATIVE and not flags & cm.FLAG_COMPAT_OK:
            raise cm.Rejected(cm.Reason.NATIVE_REQUIRED, "", by_peer=False)  # MR-CM-017
        w = min(req.sack_window, W_OFFER) if agreed & cm.Cap.SACK else 0
        k = min(req.entropy_count, K_OFFER) if agreed & cm.Cap.MULTIPATH else 1
        prof, params = agreed_profile(agreed, w, k, peer_timing(req))
        m = min(req.mtu_bytes, mtu)
        qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=req.qpn, rq_psn=req.psn, path_mtu=m,
                         dgid=cm.gid_to_ip(req.gid), max_dest_rd_atomic=QP_RD, min_rnr_timer=12,
                         profile=prof, native_params=params))
        qp.atomics = bool(agreed & cm.Cap.ATOMICS)                                 # MR-CM-019
        st.update(psn=cm.random_psn(), profile=prof)
        return cm.CMMsg(cm.MsgType.REP, flags=flags, qpn=qp.qp_num, psn=st["psn"], gid=cm.ip_to_gid(ctx.local_ip),
                        mac=cm.mac_bytes(ctx.local_mac), path_mtu=cm.MTU_ENUM[m], max_rd_atomic=QP_RD,
                        max_dest_rd_atomic=QP_RD, sack_window=w, entropy_count=k)

    ch = listener.accept(timeout)
    with ch:
        req, rep = cm.passive_exchange(ch, caps, make_rep, timeout)
    qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=st["psn"], timeout=rep.timeout, retry_cnt=rep.retry_cnt,
                     rnr_retry=rep.rnr_retry, max_rd_atomic=min(QP_RD, req.max_dest_rd_atomic)))
    return {"profile": st["profile"], "agreed_caps": int(rep.capabilities)}


def with_acceptor(active: Callable[[], Any], qp, port: int, *, profile: str = "auto", mtu: int = 1024,
                  timeout: float = 10.0, enter: Callable[[], ContextManager] = contextlib.nullcontext
                  ) -> tuple[Any, dict]:
    """Two QPs of one process connected through the set-up exchange (the demo, tests): `qp` (in INIT)
    listens on `port` and accept_qp()s in a thread of its own while `active()` -- connect_qp() of the
    other QP, or a test playing another implementation -- runs in the calling thread.  `enter()` is
    entered around the listener and the accept (a network namespace: lambda: topo.enter(ns)).
    Returns (what active() returned, accept_qp's result).  An error of the active side propagates;
    else one of the passive side (cm.Rejected ...) is raised here."""
    with enter():
        listener = cm.Listener(port)
    got: dict = {}

    def passive() -> None:
        try:
            with enter():
                got["result"] = accept_qp(qp, listener, profile=profile, mtu=mtu, timeout=timeout)
        except BaseException as e:          # noqa: BLE001 - raised in the caller's thread
            got["error"] = e

    t = threading.Thread(target=passive, name=f"cm-accept-{port}", daemon=True)
    t.start()
    try:
        res = active()
    finally:
        t.join(timeout + 5)
        listener.close()
    if "error" in got:
        raise got["error"]
    if "result" not in got:
        raise cm.CMError(f"the accepting side on port {port} did not finish within {timeout + 5} s")
    return res, got["result"]
