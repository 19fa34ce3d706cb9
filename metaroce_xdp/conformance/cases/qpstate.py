"""QP states (07-qp-state.md): packets arriving in RESET, INIT, RTR, SQD and ERR; post_send and post_recv in
states that refuse them; flushing on ERR; illegal transitions and attributes refused; RESET stops everything.

A QP is brought to the state under test through the agent (modify_qp); the LT
sends to it and watches what it sends; completions, agent errors and memory read
through the agent are the other evidence.  Agent error codes: a refused transition
or a post in a state that refuses it is ESTATE (the verbs errno of MR-QP-004/017/018
is EINVAL, which the agent reports as ESTATE: MR-CONF-023); a bad attribute is
EINVAL (MR-QP-005).
"""
from __future__ import annotations

import time

from .. import packets as P
from ..context import FULL_ACCESS, CaseError, _gid
from ..registry import case
from ._common import QUIET, alive_text, counter, describe, expect_ack, quiet_then_answered
from ._req import (STATE_ERRORS, WC_FLUSH, WC_OK, ack, agent_error, expect_wcs, need, post, qp_state,
                   requests, sent_since, write_wr)


def _attrs(t, c, state: str) -> dict:
    """The attributes t.connect gives for the transition into `state`."""
    if state == "INIT":
        return {"access": list(FULL_ACCESS), "pkey": 0xFFFF}
    if state == "RTR":
        return {"dest_qpn": c.lt_qpn, "rq_psn": c.psn, "path_mtu": c.mtu, "dgid": _gid(t.lt_ip), "dmac": t.lt_mac,
                "max_dest_rd_atomic": 4, "min_rnr_timer": 1, "profile": "compat"}
    if state == "RTS":
        return {"sq_psn": c.iut_psn, "timeout": 14, "retry_cnt": 7, "rnr_retry": 7, "max_rd_atomic": 4}
    return {}


def _modify(t, c, state: str, attrs: dict | None = None) -> str | None:
    """modify_qp; the agent error code, None on success."""
    a = _attrs(t, c, state) if attrs is None else attrs
    return agent_error(lambda: t.agent.call("modify_qp", qp=c.qp, state=state, attrs=a))


def _dropped(t, c, rules, what: str, offset: int = 256, name: str = "rx_drop_qp_state") -> None:
    """A valid WRITE ONLY to the QP gets no response, writes nothing, and counts in the counter `name` when the
    IUT reports it (MR-QP-020): rx_drop_qp_state for a QP that has a connected peer (ERR after RTR), rx_drop_qpn
    for one that has none (RESET, INIT), which fails step 10 of MR-ENC-032."""
    probe = t.connect()
    n0 = counter(t, name)
    mark = c.send(c.write(b"NOTHERE!", offset=offset))
    seen, alive = quiet_then_answered(c, mark, probe)
    n1 = counter(t, name)
    untouched = c.mem(offset, 8) == bytes(8)
    counted = n0 is None or (n1 is not None and n1 > n0)
    ok = not seen and untouched and counted and alive is not None
    cnt = f"{name} {n0} -> {n1}" if n0 is not None else f"{name} not reported"
    for r in rules:
        t.check(r, ok, f"{what}: responses {describe(seen)}; memory untouched: {untouched}; {cnt}; "
                f"{alive_text(alive)}", frames=seen + ([alive] if alive else []) or [mark + 1],
                expected=f"no response, nothing written, {name} +1; then the other QP's WRITE ACKed")


def _post_refused(t, c, rules_send, rules_recv, state: str, recv_ok: bool) -> None:
    es = agent_error(lambda: t.agent.call("post_send", qp=c.qp, wr=write_wr(c, 8, 0x51)))
    for r in rules_send:
        t.check(r, es in STATE_ERRORS, f"post_send in {state}: {es or 'accepted'}",
                expected=f"post_send fails ({' or '.join(STATE_ERRORS)})", observed=[f"agent: {es or 'ok'}"])
    er = agent_error(lambda: c.post_recv(8, 0, 0x52))
    want = None if recv_ok else STATE_ERRORS
    ok = er is None if recv_ok else er in STATE_ERRORS
    for r in rules_recv:
        t.check(r, ok, f"post_recv in {state}: {er or 'accepted'}",
                expected="post_recv accepted" if recv_ok else f"post_recv fails ({' or '.join(want)})",
                observed=[f"agent: {er or 'ok'}"])


@case("TC-QP-020-a", rules=["MR-QP-002", "MR-QP-020", "MR-QP-019", "MR-QP-017", "MR-QP-018"], category="QPS",
      timeout=10)
def packets_in_reset(t):
    """A new QP is in RESET; a valid WRITE addressed to it is dropped without response; post_send and post_recv
    fail."""
    c = t.connect(state="RESET")
    st = qp_state(c)
    t.check("MR-QP-002", st == "RESET", f"state after create_qp: {st}", expected="RESET", observed=[st])
    _dropped(t, c, ["MR-QP-020", "MR-QP-019"], "WRITE to a QP in RESET", name="rx_drop_qpn")
    _post_refused(t, c, ["MR-QP-018"], ["MR-QP-017"], "RESET", recv_ok=False)


@case("TC-QP-020-b", rules=["MR-QP-020", "MR-QP-019", "MR-QP-017", "MR-QP-018", "MR-QP-009"], category="QPS",
      timeout=10)
def packets_in_init(t):
    """A QP in INIT drops a valid WRITE without response; post_recv is accepted, post_send fails; the receive
    posted in INIT is kept: after INIT -> RTR a SEND from the LT lands in it."""
    c = t.connect(state="INIT")
    need(qp_state(c) == "INIT", "the QP did not reach INIT")
    _dropped(t, c, ["MR-QP-020", "MR-QP-019"], "WRITE to a QP in INIT", name="rx_drop_qpn")
    _post_refused(t, c, ["MR-QP-018"], ["MR-QP-017"], "INIT", recv_ok=True)     # the receive: wr_id 0x52, 8 B at 0
    need(_modify(t, c, "RTR") is None, "INIT -> RTR failed")
    p = c.psn
    mark = c.send(c.frame("SEND_ONLY", ackreq=True, payload=b"kept-wr!"))
    c.psn = P.psn_add(p, 1)
    a = expect_ack(c, p, mark)
    wcs = c.poll(1, 1.0)
    ok = (a is not None and [(w["wr_id"], w["status"]) for w in wcs] == [("0x52", WC_OK)]
          and c.mem(0, 8) == b"kept-wr!")
    t.check("MR-QP-009", ok, f"SEND after RTR: ACK {a is not None}; completions {wcs}; data placed "
            f"{c.mem(0, 8) == b'kept-wr!'}", frames=[a] if a else [mark + 1],
            expected="the receive posted in INIT completes IBV_WC_SUCCESS with the SEND's 8 bytes")


@case("TC-QP-020-c", rules=["MR-QP-020", "MR-QP-019", "MR-QP-018"], category="QPS", timeout=10)
def requests_in_rtr(t):
    """A QP in RTR executes and ACKs a WRITE (its responder runs); post_send fails; an ACKNOWLEDGE addressed to it
    (a response) is dropped without effect, counted in rx_drop_qp_state when reported; it sends nothing else."""
    c = t.connect(state="RTR")
    p = c.psn
    mark = c.send(c.write(b"rtr-data", offset=0))
    a = expect_ack(c, p, mark)
    placed = c.mem(0, 8) == b"rtr-data"
    t.check("MR-QP-019", a is not None and placed, f"WRITE in RTR: ACK {a.summary() if a else None}, placed {placed}",
            frames=[a] if a else [mark + 1], expected=f"ACKNOWLEDGE ACK psn={p:#08x}")
    probe = t.connect()
    n0 = counter(t, "rx_drop_qp_state")
    m2 = c.send(ack(c, c.iut_psn, 1))
    seen, alive = quiet_then_answered(c, m2, probe)
    n1 = counter(t, "rx_drop_qp_state")
    st = qp_state(c)
    counted = n0 is None or (n1 is not None and n1 > n0)
    t.check("MR-QP-020", not seen and st == "RTR" and counted and alive is not None,
            f"ACK to a QP in RTR: responses {describe(seen)}, state {st}, rx_drop_qp_state {n0} -> {n1}; "
            f"{alive_text(alive)}", frames=seen + ([alive] if alive else []) or [m2 + 1],
            expected="dropped, counted, QP still RTR; the other QP's WRITE ACKed")
    t.check("MR-QP-019", not seen and alive is not None, f"frames after the ACK: {describe(seen)}; "
            f"{alive_text(alive)}", frames=seen + ([alive] if alive else []) or [m2 + 1],
            expected="nothing sent")
    _post_refused(t, c, ["MR-QP-018"], [], "RTR", recv_ok=True)
    m3 = c.send(c.write(b"still-on", offset=16))
    a3 = expect_ack(c, c.psn - 1 & 0xFFFFFF, m3)
    t.check("MR-QP-020", a3 is not None, "the next WRITE still ACKed", frames=[a3] if a3 else [m3 + 1],
            expected="ACK")


@case("TC-QP-025-a", rules=["MR-QP-025", "MR-QP-020", "MR-QP-019", "MR-QP-038", "MR-QP-016"], category="QPS",
      timeout=10)
def packets_in_err(t):
    """A QP moved to ERR reports ERR and drops a valid WRITE without response or placement."""
    c = t.connect()
    e = _modify(t, c, "ERR", {})
    need(e is None, f"modify to ERR failed: {e}")
    st = qp_state(c)
    t.check("MR-QP-038", st == "ERR", f"query_qp after modify to ERR: {st}", expected="ERR", observed=[st])
    t.check("MR-QP-016", st == "ERR", f"state {st}", expected="ERR", observed=[st])
    _dropped(t, c, ["MR-QP-025", "MR-QP-020", "MR-QP-019"], "WRITE to a QP in ERR")


@case("TC-QP-018-a", rules=["MR-QP-018", "MR-QP-017", "MR-QP-028"], category="QPS", timeout=10)
def post_in_err_flushed(t):
    """A WRITE outstanding, the QP moved to ERR, then a WRITE and a receive posted in ERR: both accepted and
    completed WR_FLUSH_ERR, the send after the flush of the earlier WRITE."""
    c = t.connect(timeout=18)
    mark = post(c, write_wr(c, 8, 1))
    need(bool(requests(c, mark, 1, 1.0)), "the first WRITE was not sent")
    need(_modify(t, c, "ERR", {}) is None, "modify to ERR failed")
    es = agent_error(lambda: t.agent.call("post_send", qp=c.qp, wr=write_wr(c, 8, 2, offset=64)))
    er = agent_error(lambda: c.post_recv(8, 128, 10))
    wcs = c.poll(4, 1.0)
    sends = [w for w in wcs if int(w["wr_id"], 16) in (1, 2)]
    recvs = [w for w in wcs if int(w["wr_id"], 16) == 10]
    t.check("MR-QP-018", es is None, f"post_send in ERR: {es or 'accepted'}", expected="accepted",
            observed=[f"agent: {es or 'ok'}"])
    expect_wcs(t, ["MR-QP-018", "MR-QP-028"], sends, [(1, WC_FLUSH), (2, WC_FLUSH)], "send queue in ERR")
    t.check("MR-QP-017", er is None, f"post_recv in ERR: {er or 'accepted'}", expected="accepted",
            observed=[f"agent: {er or 'ok'}"])
    expect_wcs(t, "MR-QP-017", recvs, [(10, WC_FLUSH)], "receive posted in ERR")


@case("TC-QP-027-a", rules=["MR-QP-027", "MR-QP-016", "MR-QP-033", "MR-QP-025", "MR-QP-035"], category="QPS",
      timeout=10)
def flush_on_modify_to_err(t):
    """Three WRITEs outstanding (the 2nd unsignaled) and two receives posted; modify to ERR: every WQE completes
    WR_FLUSH_ERR, each queue in posting order, and the QP sends nothing more."""
    c = t.connect(timeout=18)
    c.post_recv(16, 1024, 10)
    c.post_recv(16, 1040, 11)
    mark = post(c, *[write_wr(c, 8, i + 1, offset=8 * i, signaled=(i != 1)) for i in range(3)])
    need(len(requests(c, mark, 3, 1.0)) == 3, "the WRITEs were not sent")
    need(_modify(t, c, "ERR", {}) is None, "modify to ERR failed")
    wall, m = time.time(), t.lt.last_num()
    wcs = c.poll(5, 1.0)
    after = sent_since(c, wall, m, 0.15)
    sends = [w for w in wcs if int(w["wr_id"], 16) < 10]
    recvs = [w for w in wcs if int(w["wr_id"], 16) >= 10]
    expect_wcs(t, ["MR-QP-027", "MR-QP-016", "MR-QP-033", "MR-QP-035"], sends,
               [(1, WC_FLUSH), (2, WC_FLUSH), (3, WC_FLUSH)], "send queue flushed")
    expect_wcs(t, ["MR-QP-027", "MR-QP-035"], recvs, [(10, WC_FLUSH), (11, WC_FLUSH)], "receive queue flushed")
    t.check("MR-QP-025", not after, f"frames after the modify: {describe(after)}", frames=after or [m],
            expected="nothing (no retransmission of the flushed WRITEs)")


ILLEGAL = {"RESET": ("RTR", "RTS", "SQD"), "INIT": ("RTS", "SQD"), "RTR": ("INIT", "RTR", "SQD"),
           "RTS": ("INIT", "RTR"), "ERR": ("INIT", "RTR", "RTS")}


@case("TC-QP-004-a", rules=["MR-QP-004", "MR-QP-038", "MR-QP-022"], category="QPS", timeout=15)
def illegal_transitions_refused(t):
    """From RESET, INIT, RTR, RTS and ERR, each transition Table 7-2 does not list is refused and leaves the
    state as it was; ERR is left by RESET, from which INIT is allowed again."""
    bad = []
    tried = 0
    for src, targets in ILLEGAL.items():
        c = t.connect(state="RTS" if src == "ERR" else src)
        if src == "ERR":
            need(_modify(t, c, "ERR", {}) is None, "modify to ERR failed")
        for dst in targets:
            tried += 1
            e = _modify(t, c, dst)
            st = qp_state(c)
            if e not in STATE_ERRORS or st != src:
                bad.append(f"{src} -> {dst}: {e or 'accepted'}, state {st}")
        if src == "ERR":
            e1, e2 = _modify(t, c, "RESET", {}), _modify(t, c, "INIT")
            st = qp_state(c)
            t.check("MR-QP-022", e1 is None and e2 is None and st == "INIT",
                    f"ERR -> RESET: {e1 or 'ok'}, RESET -> INIT: {e2 or 'ok'}, state {st}", expected="INIT",
                    observed=[st])
    ok = not bad
    det = f"{tried} illegal transitions: " + ("each refused, state unchanged" if ok else "; ".join(bad))
    t.check("MR-QP-004", ok, det, expected=f"each refused with {' or '.join(STATE_ERRORS)}", observed=bad or [det])
    t.check("MR-QP-038", ok, det, expected="query_qp reports the unchanged state", observed=bad or [det])


@case("TC-QP-003-a", rules=["MR-QP-003"], category="QPS", timeout=10)
def sqe_refused(t):
    """An RC QP never enters SQE: modify RTS -> SQE and RTR -> SQE are refused and leave the QP as it was."""
    res = []
    for src in ("RTS", "RTR"):
        c = t.connect(state=src)
        e = _modify(t, c, "SQE", {})
        res.append((src, e, qp_state(c)))
    ok = all(e in STATE_ERRORS and st == src for src, e, st in res)
    t.check("MR-QP-003", ok, "; ".join(f"{s} -> SQE: {e or 'accepted'}, state {st}" for s, e, st in res),
            expected="refused, state unchanged", observed=[str(r) for r in res])


@case("TC-QP-013-a", rules=["MR-QP-013", "MR-QP-018", "MR-QP-019", "MR-QP-014"], category="QPS", timeout=10)
def sqd_queues_without_sending(t):
    """In SQD a WRITE posted is accepted but not sent while the responder still ACKs the LT's WRITE; SQD -> RTS
    sends it and its ACK completes it."""
    c = t.connect(timeout=16)
    need(_modify(t, c, "SQD", {}) is None, "RTS -> SQD failed")
    e = agent_error(lambda: t.agent.call("post_send", qp=c.qp, wr=write_wr(c, 8, 1)))
    mark = t.lt.last_num()
    early = requests(c, mark, 1, 0.25)
    p = c.psn
    m2 = c.send(c.write(b"sqd-resp", offset=512))
    a = expect_ack(c, p, m2)
    t.check("MR-QP-018", e is None, f"post_send in SQD: {e or 'accepted'}", expected="accepted",
            observed=[f"agent: {e or 'ok'}"])
    t.check("MR-QP-013", e is None and not early, f"requests in SQD: {describe(early)}", frames=early or [mark],
            expected="none (no new WQE starts in SQD)")
    t.check("MR-QP-019", a is not None, f"LT's WRITE in SQD answered: {a.summary() if a else None}",
            frames=[a] if a else [m2 + 1], expected=f"ACKNOWLEDGE ACK psn={p:#08x}")
    e2 = _modify(t, c, "RTS", {})
    m3 = t.lt.last_num()
    sent = requests(c, m3, 1, 1.0)
    if sent:
        c.send(ack(c, sent[0].roce.psn, 1))
    wcs = c.poll(1, 0.5)
    ok = e2 is None and [f.roce.psn for f in sent] == [c.iut_psn] and [w["status"] for w in wcs] == [WC_OK]
    t.check("MR-QP-014", ok, f"SQD -> RTS: {e2 or 'ok'}; sent {describe(sent)}; completion "
            f"{[w['status'] for w in wcs]}", frames=sent or [m3], expected="the WRITE sent, then IBV_WC_SUCCESS")


@case("TC-QP-015-a", rules=["MR-QP-015", "MR-QP-019"], category="QPS", timeout=10)
def reset_stops_everything(t):
    """A WRITE being retransmitted (timeout 14: T = 67 ms, never ACKed), then modify to RESET: no packet after it
    (its capture time stamp after the modify), no completion, state RESET."""
    c = t.connect(timeout=14, retry_cnt=7)
    mark = post(c, write_wr(c, 8, 1))
    need(len(requests(c, mark, 2, 2.0)) == 2, "the WRITE was not retransmitted")
    e = _modify(t, c, "RESET", {})
    wall, m = time.time(), t.lt.last_num()
    after = sent_since(c, wall, m, 0.3)
    wcs = c.poll(1, 0.2)
    st = qp_state(c)
    ok = e is None and not after and not wcs and st == "RESET"
    for r in ("MR-QP-015", "MR-QP-019"):
        t.check(r, ok, f"modify to RESET: {e or 'ok'}; frames after: {describe(after)}; completions {wcs}; state {st}",
                frames=after or [m], expected="nothing sent, no completion, RESET")


@case("TC-QP-005-a", rules=["MR-QP-005"], category="QPS", timeout=10)
def bad_attributes_refused(t):
    """A required attribute missing (INIT -> RTR without dest_qpn), an attribute the transition does not take
    (RESET -> INIT with sq_psn), and one out of range (RTR -> RTS with retry_cnt 8): refused, state unchanged."""
    res = []
    c = t.connect(state="RESET")
    a = {**_attrs(t, c, "INIT"), "sq_psn": 5}
    res.append(("RESET -> INIT with sq_psn", _modify(t, c, "INIT", a), qp_state(c), "RESET"))
    c2 = t.connect(state="INIT")
    a = _attrs(t, c2, "RTR")
    a.pop("dest_qpn")
    res.append(("INIT -> RTR without dest_qpn", _modify(t, c2, "RTR", a), qp_state(c2), "INIT"))
    c3 = t.connect(state="RTR")
    a = {**_attrs(t, c3, "RTS"), "retry_cnt": 8}
    res.append(("RTR -> RTS with retry_cnt 8", _modify(t, c3, "RTS", a), qp_state(c3), "RTR"))
    bad = [f"{w}: {e or 'accepted'}, state {st}" for w, e, st, want in res if e != "EINVAL" or st != want]
    t.check("MR-QP-005", not bad, "; ".join(bad) or "each refused with EINVAL, state unchanged",
            expected="EINVAL, state unchanged", observed=bad or ["ok"])


@case("TC-QP-022-a", rules=["MR-QP-022", "MR-QP-010", "MR-QP-015"], category="QPS", timeout=10)
def err_reset_and_reconnect(t):
    """A QP in ERR moved to RESET drops a WRITE; brought to RTR again with a new rq_psn it accepts a WRITE at
    that PSN and ACKs it with MSN 1 (the responder state starts afresh)."""
    c = t.connect()
    m0 = c.send(c.write(b"before!!", offset=0))
    expect_ack(c, P.psn_add(c.psn, -1), m0)
    need(_modify(t, c, "ERR", {}) is None and _modify(t, c, "RESET", {}) is None, "ERR -> RESET failed")
    st = qp_state(c)
    probe = t.connect()
    mark = c.send(c.write(b"dropped!", offset=64))
    seen, alive = quiet_then_answered(c, mark, probe)
    t.check("MR-QP-015", st == "RESET" and not seen and alive is not None,
            f"after RESET: state {st}, responses {describe(seen)}; {alive_text(alive)}",
            frames=seen + ([alive] if alive else []) or [mark + 1],
            expected="RESET, no response; the other QP's WRITE ACKed")
    c.psn = 0x00ABCD
    errs = [_modify(t, c, s) for s in ("INIT", "RTR")]
    need(errs == [None, None], f"RESET -> INIT -> RTR failed: {errs}")
    p = c.psn
    m2 = c.send(c.write(b"again!!!", offset=128))
    a = expect_ack(c, p, m2)
    ok = a is not None and a.roce.msn == 1 and c.mem(128, 8) == b"again!!!"
    t.check("MR-QP-022", ok, f"reconnected: {a.summary() if a else 'no ACK'}", frames=[a] if a else [m2 + 1],
            expected=f"ACKNOWLEDGE ACK psn={p:#08x} msn=1")
    t.check("MR-QP-010", ok, f"epsn = rq_psn {p:#08x}, msn from 0: {a.summary() if a else 'no ACK'}",
            frames=[a] if a else [m2 + 1], expected=f"ACKNOWLEDGE ACK psn={p:#08x} msn=1")


@case("TC-QP-014-a", rules=["MR-QP-014", "MR-QP-013"], category="QPS", timeout=10)
def sqd_to_sqd_busy_while_draining(t):
    """A WRITE outstanding (the LT withholds its ACK), RTS -> SQD: SQD -> SQD fails with EBUSY and leaves SQD;
    the WRITE is still retransmitted in SQD; once its ACK drains the QP, SQD -> SQD and SQD -> RTS succeed."""
    c = t.connect(timeout=14)
    mark = post(c, write_wr(c, 8, 1))
    first = requests(c, mark, 1, 1.0)
    need(bool(first), "the WRITE was not sent")
    need(_modify(t, c, "SQD", {}) is None, "RTS -> SQD failed")
    e1 = _modify(t, c, "SQD", {})
    st = qp_state(c)
    m = t.lt.last_num()
    again = requests(c, m, 1, 1.0, psn=c.iut_psn)
    c.send(ack(c, c.iut_psn, 1))
    wcs = c.poll(1, 1.0)
    e2 = _modify(t, c, "SQD", {})
    e3 = _modify(t, c, "RTS", {})
    st2 = qp_state(c)
    ok = e1 == "EBUSY" and st == "SQD" and e2 is None and e3 is None and st2 == "RTS"
    t.check("MR-QP-014", ok, f"SQD -> SQD while draining: {e1 or 'accepted'} (state {st}); after the ACK: "
            f"SQD -> SQD {e2 or 'ok'}, SQD -> RTS {e3 or 'ok'} (state {st2})",
            expected="EBUSY and SQD, then both accepted", observed=[f"{e1} {st} {e2} {e3} {st2}"])
    t.check("MR-QP-013", bool(again) and [w["status"] for w in wcs] == [WC_OK],
            f"retransmission in SQD: {describe(again)}; completion {[w['status'] for w in wcs]}",
            frames=first + again, expected="the outstanding WRITE retransmitted in SQD, then completed")


@case("TC-QP-039-a", rules=["MR-QP-039", "MR-BTH-016"], category="QPS", timeout=10)
def destroyed_qp_is_gone(t):
    """A QP destroyed while a WRITE of it is being retransmitted sends nothing more; a WRITE to its QPN is dropped
    without response and counted in rx_drop_qpn when reported."""
    c = t.connect(timeout=14)
    mark = post(c, write_wr(c, 8, 1))
    need(bool(requests(c, mark, 1, 1.0)), "the WRITE was not sent")
    t.agent.call("destroy_qp", qp=c.qp)
    t._conns.remove(c)                                   # destroyed here, not again at clean-up
    wall, m = time.time(), t.lt.last_num()
    after = sent_since(c, wall, m, 0.2)
    probe = t.connect()
    n0 = counter(t, "rx_drop_qpn")
    m2 = c.send(c.write(b"ghostqp!", offset=0))
    seen, alive = quiet_then_answered(c, m2, probe)
    n1 = counter(t, "rx_drop_qpn")
    counted = n0 is None or (n1 is not None and n1 > n0)
    ev = after + seen + ([alive] if alive else [])
    t.check("MR-QP-039", not after and not seen and alive is not None, f"sent after destroy_qp: {describe(after)}; "
            f"answer to a WRITE to its QPN: {describe(seen)}; {alive_text(alive)}", frames=ev or [m2 + 1],
            expected="nothing; the other QP's WRITE ACKed")
    t.check("MR-BTH-016", not seen and counted and alive is not None, f"WRITE to the destroyed QPN: "
            f"{describe(seen)}; rx_drop_qpn {n0} -> {n1}; {alive_text(alive)}",
            frames=seen + ([alive] if alive else []) or [m2 + 1], expected="dropped, rx_drop_qpn +1")


def _cq_depth(t) -> int:
    """The cqe the agent's last create_cq answered (the IUT may round the request up)."""
    import json
    lines = t.agent.lines
    for i in range(len(lines) - 2, -1, -1):
        if json.loads(lines[i]).get("cmd") == "create_cq":
            return int(json.loads(lines[i + 1])["result"]["cqe"])
    raise CaseError("no create_cq in the agent log")


@case("TC-QP-036-a", rules=["MR-QP-036"], category="QPS", timeout=10)
def cq_overflow_moves_qp_to_err(t):
    """A CQ asked for 4 entries (the IUT may give more: create_cq's cqe) and that many signaled WRITEs plus 8
    ACKed at once: the CQ overflows and the QP using it moves to ERR (query_qp), after which a WRITE from the LT
    is not answered."""
    c = t.connect(timeout=16, cqe=4)
    depth = _cq_depth(t)
    need(depth + 8 <= 60, f"the IUT made the CQ {depth} deep: too deep to overflow with one send queue")
    n = depth + 8
    p = c.iut_psn
    mark = post(c, *[write_wr(c, 8, i + 1, offset=8 * i) for i in range(n)])
    need(len(requests(c, mark, n, 1.0)) >= n, "the WRITEs were not sent")
    c.send(ack(c, P.psn_add(p, n - 1), n))
    time.sleep(0.2)
    st = qp_state(c)
    probe = t.connect()
    m2 = c.send(c.write(b"after-ov", offset=512))
    seen, alive = quiet_then_answered(c, m2, probe)
    t.check("MR-QP-036", st == "ERR" and not seen and alive is not None, f"QP state after the overflow: {st}; "
            f"answer to a WRITE: {describe(seen)}; {alive_text(alive)}",
            frames=seen + ([alive] if alive else []) or [m2 + 1], expected="ERR, no answer; the other QP's WRITE ACKed")


__all__: list[str] = []
