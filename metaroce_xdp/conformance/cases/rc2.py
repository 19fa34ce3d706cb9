"""Compat RC and QP cases that the other modules leave open: the work request opcodes a requester supports
(MR-RC-001), the 2^31-byte message limit (MR-RC-008), the three state machines seen together on the wire
(MR-RC-024), atomicity across QPs (MR-ATOM-004), CNP validation (MR-CNP-005) and the QP states the agent
reports (MR-QP-001)."""
from __future__ import annotations

import secrets
import struct
import time

from ..agentproto import AgentError
from .. import packets as P
from ..context import Conn, _gid
from ..registry import case
from ._common import QUIET, counter, describe, expect_ack
from ._req import (ack, agent_error, cnp, connect_req, is_req, pattern, post, read_stream, requests, wc_list,
                   wr)

ATOMIC_ACK = 0x12
GB = 1 << 30


def second_qp(t, c: Conn) -> Conn:
    """Another IUT QP in c's PD (so it reaches c's MR), with its own CQ, connected in RTS to a new LT QP."""
    cq = t.agent.call("create_cq", cqe=64)["cq"]
    t._extra.append(("destroy_cq", {"cq": cq}))
    r = t.agent.call("create_qp", pd=c.pd, send_cq=cq, recv_cq=cq, type="RC",
                     cap={"max_send_wr": 16, "max_recv_wr": 16, "max_send_sge": 1, "max_recv_sge": 1,
                          "max_inline_data": 0})
    lt_qpn = 0x100 + secrets.randbelow(0xFFFE00)
    psn, iut_psn = secrets.randbelow(1 << 24), secrets.randbelow(1 << 24)
    mr = {"va": hex(c.va), "rkey": c.rkey, "lkey": c.lkey, "len": c.mr_len}
    c2 = Conn(t, r["qp"], r["qpn"], c.pd, cq, mr, c.mr, lt_qpn, psn, iut_psn, c.mtu, 0xC000 | secrets.randbelow(0x4000))
    t._conns.append(c2)
    t.agent.call("modify_qp", qp=c2.qp, state="INIT",
                 attrs={"access": ["LOCAL_WRITE", "REMOTE_WRITE", "REMOTE_READ", "REMOTE_ATOMIC"], "pkey": 0xFFFF})
    t.agent.call("modify_qp", qp=c2.qp, state="RTR",
                 attrs={"dest_qpn": lt_qpn, "rq_psn": psn, "path_mtu": c.mtu, "dgid": _gid(t.lt_ip),
                        "dmac": t.lt_mac, "max_dest_rd_atomic": 4, "min_rnr_timer": 1, "profile": "compat"})
    t.agent.call("modify_qp", qp=c2.qp, state="RTS",
                 attrs={"sq_psn": iut_psn, "timeout": 14, "retry_cnt": 7, "rnr_retry": 7, "max_rd_atomic": 4})
    return c2


# ---- MR-RC-001 --------------------------------------------------------------------------------------------
WR_OPS = [("SEND", 0x04), ("SEND_WITH_IMM", 0x05), ("SEND_WITH_INV", 0x17), ("RDMA_WRITE", 0x0A),
          ("RDMA_WRITE_WITH_IMM", 0x0B), ("RDMA_READ", 0x0C), ("ATOMIC_CMP_AND_SWP", 0x13),
          ("ATOMIC_FETCH_AND_ADD", 0x14)]
OTHER_OPS = ["LOCAL_INV", "BIND_MW", "SEND_WITH_IMMEDIATE", "TSO", "ATOMIC_WRITE", "NOP"]


@case("TC-RC-001-a", rules=["MR-RC-001"], category="SEQ", timeout=15)
def work_request_opcodes(t):
    """Each of the eight work request opcodes posted at the IUT is accepted, goes out as its request opcode
    and completes successfully once the LT answers; any other opcode name is refused at post, and nothing
    is sent or completed for it."""
    c = connect_req(t, timeout=14)
    c.mem_write(0, pattern(64))
    ops = [(o, code) for o, code in WR_OPS if "ATOMIC" not in o or "ATOMICS" in t.claim.caps]
    probs = []
    for i, (op, code) in enumerate(ops):
        kw = {"invalidate_rkey": 0x1234} if op == "SEND_WITH_INV" else {}
        if op == "ATOMIC_CMP_AND_SWP":
            kw = {"compare": "0x0", "swap_add": "0x1"}
        elif op == "ATOMIC_FETCH_AND_ADD":
            kw = {"swap_add": "0x1"}
        n = 8 if "ATOMIC" in op else 32
        w = wr(op, n, wr_id=0x100 + i, c=c, offset=256 + 16 * i, remote_off=64 * i, **kw)
        mark = c.t.lt.last_num()
        err = agent_error(lambda: c.t.agent.call("post_send", qp=c.qp, wr=w))
        if err:
            probs.append(f"{op}: refused ({err})")
            continue
        got = c.expect(1, 2.0, after=mark, match=lambda f, p=c.iut_psn: is_req(f) and f.roce.psn == p)
        if not got:
            probs.append(f"{op}: nothing sent")
            continue
        f = got[0]
        if f.roce.op != code:
            probs.append(f"{op}: sent {f.roce.name}")
        p = c.iut_psn
        if op == "RDMA_READ":
            c.send(*read_stream(c, p, pattern(n, 3), i + 1))
        elif "ATOMIC" in op:
            c.send(c.frame("ATOMIC_ACKNOWLEDGE", psn=p, aeth=(0x1F, i + 1), atomic_ack=0))
        else:
            c.send(ack(c, p, i + 1))
        c.iut_psn = P.psn_add(p, 1)
        wcs = c.poll(1, 1.0)
        if [(w_["wr_id"], w_["status"]) for w_ in wcs] != [(hex(0x100 + i), "IBV_WC_SUCCESS")]:
            probs.append(f"{op}: completions {wc_list(wcs)}")
    t.check("MR-RC-001", not probs, "; ".join(probs) or f"{len(ops)} opcodes sent and completed",
            expected="each opcode accepted, sent as its request, completed IBV_WC_SUCCESS")
    mark = c.t.lt.last_num()
    refused = {}
    for j, op in enumerate(OTHER_OPS):
        w = wr("SEND", 8, wr_id=0x200 + j, c=c)
        w["opcode"] = op
        refused[op] = agent_error(lambda: c.t.agent.call("post_send", qp=c.qp, wr=w))
    sent = c.quiet(QUIET, after=mark)
    wcs = c.poll(4, 0.2)
    ok = all(refused.values()) and not sent and not wcs
    t.check("MR-RC-001", ok, f"other opcodes: {refused}; sent {describe(sent)}; completions {wc_list(wcs)}",
            frames=sent, expected="every other opcode refused at post (an error), nothing sent or completed")


# ---- MR-RC-008 --------------------------------------------------------------------------------------------
@case("TC-RC-008-a", rules=["MR-RC-008"], category="SEQ", timeout=15)
def message_over_2_31_bytes(t):
    """A WRITE whose three SGEs of 2^30 bytes (one MR, 3 x 2^30 > 2^31) completes with IBV_WC_LOC_LEN_ERR and
    sends no packet."""
    from ..context import CannotDrive
    c = connect_req(t, timeout=14, max_send_sge=3)
    try:
        big, _ = t.reg_mr(c.pd, GB)
    except AgentError as e:              # an IUT may refuse 1 GiB of registered memory (ENOMEM)
        raise CannotDrive(f"the IUT does not register a 1 GiB MR: {e}") from None
    mark = post(c, {"wr_id": "0x1", "opcode": "RDMA_WRITE", "flags": ["SIGNALED"],
                    "sg_list": [{"mr": big, "offset": 0, "len": GB}] * 3,
                    "remote": {"va": hex(0x7F00_0000_0000), "rkey": 0x1234}})
    wcs = c.poll(1, 2.0)
    sent = c.quiet(QUIET, after=mark)
    ok = [w["status"] for w in wcs] == ["IBV_WC_LOC_LEN_ERR"] and not sent
    t.check("MR-RC-008", ok, f"3 x 2^30 bytes: completions {wc_list(wcs)}, sent {describe(sent[:3])}",
            frames=sent[:3], expected="IBV_WC_LOC_LEN_ERR, no packet")


# ---- MR-RC-024 --------------------------------------------------------------------------------------------
@case("TC-RC-024-a", rules=["MR-RC-024"], category="SEQ", timeout=10)
def three_machines_on_the_wire(t):
    """Both directions at once on one QP (path MTU 256): the IUT's requester sends a 600-byte SEND and a READ
    while its responder takes a 2-packet WRITE, a SEND into a posted receive and a READ from the LT.  Every
    IUT frame is what section 10's requester, responder and completer would send, in that order: the
    requests at consecutive PSNs, ACKs with the running MSN (the WRITE's may be coalesced into the SEND's), the
    READ answered at the request's PSNs; and the completions are the ones they would produce."""
    c = connect_req(t, mtu=256, timeout=14)
    c.mem_write(0, pattern(600))
    c.post_recv(64, offset=8192, wr_id=0x77)
    p, q = c.iut_psn, c.psn
    mark = post(c, wr("SEND", 600, wr_id=1, c=c), wr("RDMA_READ", 300, wr_id=2, c=c, offset=4096))
    reqs = c.expect(4, 2.0, after=mark, match=is_req)
    c.send(ack(c, P.psn_add(p, 2), 1), *read_stream(c, P.psn_add(p, 3), pattern(300, 9), 2))
    w1 = c.frame("RDMA_WRITE_FIRST", psn=q, reth=(c.va + 12288, c.rkey, 300), payload=pattern(256, 5))
    w2 = c.frame("RDMA_WRITE_LAST", psn=P.psn_add(q, 1), ackreq=True, payload=pattern(300, 5)[256:])
    s1 = c.frame("SEND_ONLY", psn=P.psn_add(q, 2), ackreq=True, payload=b"hello")
    rd = c.frame("RDMA_READ_REQUEST", psn=P.psn_add(q, 3), reth=(c.va, c.rkey, 300))
    m2 = c.send(w1, w2, s1, rd)
    c.psn = P.psn_add(q, 5)
    resp = c.expect(4, 0.5, after=m2, match=lambda f: f.roce.op in (0x11, 0x0D, 0x0E, 0x0F, 0x10))
    wcs = c.poll(3, 1.0)
    got_req = [(f.roce.op, f.roce.psn) for f in reqs]
    want_req = [(0x00, p), (0x01, P.psn_add(p, 1)), (0x02, P.psn_add(p, 2)), (0x0C, P.psn_add(p, 3))]
    got_rsp = [(f.roce.op, f.roce.psn, f.roce.msn) for f in resp]
    # the ACK of the WRITE may be coalesced into the SEND's (a cumulative ACK covers it, MR-ACK-002)
    want_rsp = [(0x11, P.psn_add(q, 1), 1), (0x11, P.psn_add(q, 2), 2), (0x0D, P.psn_add(q, 3), 3),
                (0x0F, P.psn_add(q, 4), 3)]
    if got_rsp == want_rsp[1:]:
        want_rsp = want_rsp[1:]
    got_wc = sorted((w["wr_id"], w["status"], w.get("opcode")) for w in wcs)
    want_wc = sorted([("0x1", "IBV_WC_SUCCESS", "IBV_WC_SEND"), ("0x2", "IBV_WC_SUCCESS", "IBV_WC_RDMA_READ"),
                      ("0x77", "IBV_WC_SUCCESS", "IBV_WC_RECV")])
    placed = c.mem(12288, 300) == pattern(300, 5) and c.mem(8192, 5) == b"hello" and c.mem(4096, 300) == pattern(300, 9)
    probs = []
    if got_req != want_req:
        probs.append(f"requests {[(hex(o), hex(s)) for o, s in got_req]}")
    if got_rsp != want_rsp:
        probs.append(f"responses {[(hex(o), hex(s), m) for o, s, m in got_rsp]}")
    if got_wc != want_wc:
        probs.append(f"completions {got_wc}")
    if not placed:
        probs.append("memory not as placed by WRITE, SEND and READ")
    t.check("MR-RC-024", not probs, "; ".join(probs) or "requests, responses, completions and memory as the "
            "section 10 machines produce them", frames=reqs + resp,
            expected=f"requests {[(hex(o), hex(s)) for o, s in want_req]}; responses "
                     f"{[(hex(o), hex(s), m) for o, s, m in want_rsp]}")


# ---- MR-ATOM-004 ------------------------------------------------------------------------------------------
@case("TC-ATOM-004-a", rules=["MR-ATOM-004"], category="ATOM", caps=("ATOMICS",), timeout=15)
def atomics_of_two_qps_are_atomic(t):
    """Two IUT QPs in one PD, 48 FETCH_ADD +1 to one 8-byte word, sent in bursts of 4 per QP interleaved: the
    original values returned are exactly 0..47 (each once) and the word ends at 48 -- no add was lost or
    seen twice."""
    c1 = t.connect()
    c2 = second_qp(t, c1)
    c1.mem_write(512, bytes(8))
    origs: list[int] = []
    frames = []
    for _ in range(6):
        burst = []
        for _k in range(4):
            for c in (c1, c2):
                burst.append(c.frame("FETCH_ADD", atomic=(c1.va + 512, c1.rkey, 1, 0)))
                c.psn = P.psn_add(c.psn, 1)
        mark = t.lt.last_num()
        t.lt.send(*burst)
        for c in (c1, c2):
            got = c.expect(4, 2.0, after=mark, match=lambda f: f.roce.op == ATOMIC_ACK)
            frames += got
            origs += [int(f.roce.headers["AtomicAckETH"].orig) for f in got if "AtomicAckETH" in f.roce.headers]
    final = struct.unpack("<Q", c1.mem(512, 8))[0]
    ok = sorted(origs) == list(range(48)) and final == 48
    t.check("MR-ATOM-004", ok, f"{len(origs)} ATOMIC ACKNOWLEDGEs, originals sorted {sorted(origs)[:6]}..., "
            f"final value {final}", frames=frames[:4], expected="originals 0..47 each once, final value 48")


# ---- MR-CNP-005 -------------------------------------------------------------------------------------------
@case("TC-CNP-005-a", rules=["MR-CNP-005"], category="CC", timeout=10)
def cnps_are_validated(t):
    """A CNP with a bad ICRC, one from an address that is not the QP's peer, and one to a QP in RTR change no
    QP's rx_cnp and draw no response (counted in rx_drop_icrc, rx_drop_wrong_peer and rx_drop_qp_state when
    the IUT reports them); a valid CNP to the QP in RTS adds 1 to its rx_cnp."""
    from ..context import CannotDrive
    c = t.connect()
    r = t.connect(state="RTR")
    if "rx_cnp" not in t.caps.get("counters", ()):
        raise CannotDrive("the IUT does not report rx_cnp")
    t.need_qp_counters("rx_cnp")                 # the QP's own count: the port's would not tell the three apart
    probs, frames = [], []

    def rx(cn):
        return int(cn.counters().get("rx_cnp", 0))

    tests = [("bad ICRC", c, cnp(c, bad_icrc=True), "rx_drop_icrc"),
             ("wrong peer", c, cnp(c, src_ip=_other_ip(t.lt_ip)), "rx_drop_wrong_peer"),
             ("QP in RTR", r, cnp(r), "rx_drop_qp_state")]
    for what, cn, frame, name in tests:
        before, n0 = rx(cn), counter(t, name)
        mark = cn.send(frame)
        seen = cn.quiet(QUIET, after=mark)
        after, n1 = rx(cn), counter(t, name)
        counted = n0 is None or (n1 is not None and n1 > n0)
        if after != before or seen or not counted:
            probs.append(f"{what}: rx_cnp {before}->{after}, {name} {n0}->{n1}, answered by {describe(seen)}")
        frames += seen
    before = rx(c)
    c.send(cnp(c))
    m = c.send(c.write(b"x", offset=0))
    expect_ack(c, P.psn_add(c.psn, -1), m)
    after = rx(c)
    if after != before + 1:
        probs.append(f"valid CNP: rx_cnp {before}->{after}")
    t.check("MR-CNP-005", not probs, "; ".join(probs) or "the three invalid CNPs discarded and counted, the valid "
            "one taken", frames=frames or [m], expected="invalid CNPs: rx_cnp unchanged, drop counter +1; valid: +1")


def _other_ip(ip: str) -> str:
    if ":" in ip:
        return ip.rsplit(":", 1)[0] + ":beef"
    a = ip.split(".")
    a[-1] = str((int(a[-1]) + 77) % 254 + 1)
    return ".".join(a)


# ---- MR-QP-001 --------------------------------------------------------------------------------------------
@case("TC-QP-001-a", rules=["MR-QP-001"], category="QPS", timeout=10)
def states_reported(t):
    """A QP walked RESET -> INIT -> RTR -> RTS -> SQD -> RTS -> ERR -> RESET is reported by query_qp in each of
    the states of Table 7-1 it was moved to, and never as UNKNOWN."""
    c = t.connect(state="RESET")
    seen = [c.query()["state"]]
    steps = [("INIT", {"access": ["LOCAL_WRITE", "REMOTE_WRITE"], "pkey": 0xFFFF}),
             ("RTR", {"dest_qpn": c.lt_qpn, "rq_psn": c.psn, "path_mtu": c.mtu, "dgid": _gid(t.lt_ip),
                      "dmac": t.lt_mac, "max_dest_rd_atomic": 4, "min_rnr_timer": 1}),
             ("RTS", {"sq_psn": c.iut_psn, "timeout": 14, "retry_cnt": 7, "rnr_retry": 7, "max_rd_atomic": 4}),
             ("SQD", {}), ("RTS", {}), ("ERR", {}), ("RESET", {})]
    want = ["RESET"]
    skip = False
    for state, attrs in steps:
        if skip:                     # the RTS after an SQD the IUT does not offer
            skip = False
            continue
        try:
            t.agent.call("modify_qp", qp=c.qp, state=state, attrs=attrs)
        except AgentError:
            if state != "SQD":
                raise
            skip = True              # SQD is optional for this walk (MR-QP-013 decides it)
            continue
        want.append(state)
        seen.append(c.query()["state"])
    ok = seen == want
    t.check("MR-QP-001", ok, f"query_qp after each modify: {seen}", expected=f"{want}",
            observed=[f"states {seen}"])


# ---- MR-QP-006, MR-QP-008, MR-QP-021 (9.4.2: cur_state, alt_path, path_mig_state, get_async_events) ----------
def _modify(t, c: Conn, state: str, attrs: dict) -> str | None:
    """modify_qp; the agent's error code, None when it succeeded."""
    return agent_error(lambda: t.agent.call("modify_qp", qp=c.qp, state=state, attrs=attrs))


def _rtr_attrs(t, c: Conn) -> dict:
    return {"dest_qpn": c.lt_qpn, "rq_psn": c.psn, "path_mtu": c.mtu, "dgid": _gid(t.lt_ip), "dmac": t.lt_mac,
            "max_dest_rd_atomic": 4, "min_rnr_timer": 1}


def _rts_attrs(c: Conn) -> dict:
    return {"sq_psn": c.iut_psn, "timeout": 14, "retry_cnt": 7, "rnr_retry": 7, "max_rd_atomic": 4}


@case("TC-QP-006-a", rules=["MR-QP-006"], category="QPS", timeout=10)
def cur_state_must_match(t):
    """modify_qp INIT -> RTR with cur_state RESET (wrong) fails with EINVAL and leaves the QP in INIT; with
    cur_state INIT it succeeds; RTR -> RTS with cur_state RTS (wrong) fails, with RTR succeeds."""
    c = t.connect(state="INIT")
    steps = [("RTR", "RESET", _rtr_attrs(t, c), "EINVAL", "INIT"), ("RTR", "INIT", _rtr_attrs(t, c), None, "RTR"),
             ("RTS", "RTS", _rts_attrs(c), "EINVAL", "RTR"), ("RTS", "RTR", _rts_attrs(c), None, "RTS")]
    seen, ok = [], True
    for state, cur, attrs, want_err, want_state in steps:
        err = _modify(t, c, state, dict(attrs, cur_state=cur))
        st = c.query()["state"]
        seen.append(f"-> {state} cur_state {cur}: {err or 'ok'}, now {st}")
        ok &= err == want_err and st == want_state
    t.check("MR-QP-006", ok, "; ".join(seen), expected="wrong cur_state: EINVAL, state unchanged; right: accepted",
            observed=seen)


@case("TC-QP-008-a", rules=["MR-QP-008"], category="QPS", timeout=10)
def no_alternate_path(t):
    """RTR -> RTS with alt_path, or with path_mig_state REARM or ARMED, is refused and leaves the QP in RTR;
    with path_mig_state MIGRATED it is accepted; RTS -> RTS with alt_path is refused too."""
    c = t.connect(state="RTR")
    alt = {"dgid": _gid(t.lt_ip), "dmac": t.lt_mac, "port_num": 1, "timeout": 14}
    steps = [("RTS", {"alt_path": alt}, False, "RTR"), ("RTS", {"path_mig_state": "REARM"}, False, "RTR"),
             ("RTS", {"path_mig_state": "ARMED"}, False, "RTR"), ("RTS", {"path_mig_state": "MIGRATED"}, True, "RTS"),
             ("RTS", {"alt_path": alt}, False, "RTS")]
    seen, ok = [], True
    for i, (state, extra, accept, want_state) in enumerate(steps):
        attrs = dict(_rts_attrs(c), **extra) if i < 4 else dict(extra)
        err = _modify(t, c, state, attrs)
        st = c.query()["state"]
        seen.append(f"-> {state} {extra}: {err or 'ok'}, now {st}")
        ok &= (err is None) == accept and st == want_state
    t.check("MR-QP-008", ok, "; ".join(seen), expected="alt_path and path_mig_state other than MIGRATED refused",
            observed=seen)


def _events(t, timeout_ms: int = 0) -> list[dict]:
    return t.agent.call("get_async_events", timeout_ms=timeout_ms)["events"]


@case("TC-QP-021-a", rules=["MR-QP-021"], category="QPS", timeout=10)
def comm_est_once(t):
    """A QP in RTR that accepts its first request (a WRITE, ACKed) raises IBV_EVENT_COMM_EST once for it; a
    second request raises no second one."""
    from ..context import CannotDrive
    t.need_commands("get_async_events")
    c = t.connect(state="RTR")
    try:
        _events(t)
    except AgentError as e:
        raise CannotDrive(f"the agent has no get_async_events ({e.code})") from None
    m = c.send(c.write(b"first", offset=0))
    a1 = expect_ack(c, P.psn_add(c.psn, -1), m)
    ev1 = _events(t, 500)
    m2 = c.send(c.write(b"second", offset=64))
    a2 = expect_ack(c, P.psn_add(c.psn, -1), m2)
    ev2 = _events(t, 200)
    mine = [e for e in ev1 if e["type"] == "IBV_EVENT_COMM_EST" and e["qp"] == c.qp]
    again = [e for e in ev2 if e["type"] == "IBV_EVENT_COMM_EST" and e["qp"] == c.qp]
    ok = a1 is not None and a2 is not None and len(mine) == 1 and not again
    t.check("MR-QP-021", ok, f"after the first WRITE: ACK {a1 is not None}, events {ev1}; after the second: ACK "
            f"{a2 is not None}, events {ev2}", frames=[f for f in (a1, a2) if f is not None] or [m + 1],
            expected="one IBV_EVENT_COMM_EST for the QP after the first request, none after the second",
            observed=[f"events {ev1}", f"events {ev2}"])


# ---- MR-BTH-004 (9.4.2: req_notify_cq, get_cq_event) ---------------------------------------------------------
@case("TC-BTH-004-a", rules=["MR-BTH-004"], category="WIRE", timeout=10)
def solicited_event_from_the_completing_packet(t):
    """The IUT's CQ armed for solicited completions only: a SEND ONLY without SE, and a SEND FIRST with SE whose
    completing SEND LAST has no SE, complete their receives without an event; a SEND ONLY with SE completes
    its receive with the event."""
    from ..context import CannotDrive
    c = t.connect()
    for i in range(3):
        c.post_recv(2048, offset=4096 * i, wr_id=0x10 + i)
    try:
        t.agent.call("req_notify_cq", cq=c.cq, solicited_only=True)
    except AgentError as e:
        raise CannotDrive(f"the agent has no req_notify_cq ({e.code})") from None
    results, frames = [], []
    sends = [("SEND ONLY, SE 0", [c.frame("SEND_ONLY", psn=c.psn, ackreq=True, payload=b"a" * 8)], False),
             ("SEND FIRST SE 1 + LAST SE 0",
              [c.frame("SEND_FIRST", psn=P.psn_add(c.psn, 1), se=True, payload=b"b" * c.mtu),
               c.frame("SEND_LAST", psn=P.psn_add(c.psn, 2), ackreq=True, payload=b"c" * 8)], False),
             ("SEND ONLY, SE 1", [c.frame("SEND_ONLY", psn=P.psn_add(c.psn, 3), se=True, ackreq=True,
                                          payload=b"d" * 8)], True)]
    ok = True
    for what, fs, want in sends:
        m = c.send(*fs)
        c.psn = P.psn_add(c.psn, len(fs))
        a = expect_ack(c, P.psn_add(c.psn, -1), m)
        ev = t.agent.call("get_cq_event", cq=c.cq, timeout_ms=300 if want else 150)["event"]
        wcs = c.poll(1, 1.0)
        results.append(f"{what}: ACK {a is not None}, completions {wc_list(wcs)}, event {ev}")
        frames += [a] if a is not None else []
        ok &= a is not None and ev == want and [w["status"] for w in wcs] == ["IBV_WC_SUCCESS"]
    t.check("MR-BTH-004", ok, "; ".join(results), frames=frames or [1],
            expected="events: no, no, yes (SE only counts on the packet that completes the receive)",
            observed=results)


# ---- MR-ACK-012 --------------------------------------------------------------------------------------------
@case("TC-ACK-012-a", rules=["MR-ACK-012"], category="ACK", caps=("ACK_CREDITS",), timeout=10)
def nak_leaves_lsn(t):
    """SEND 1 is ACKed with credit code 0 (lsn = 1); SEND 2 goes out (before, or as the one probe of MR-ACK-011)
    and SEND 3 is posted: an IUT that honours credits holds SEND 3.  The LT then RNR-NAKs SEND 2 with timer
    code 31, whose low bits read as a credit code would mean "unlimited": SEND 3 must still be held (lsn
    unchanged) until an ACK with fresh credits comes.  Only for an IUT that claims ACK_CREDITS (Table 9-1):
    MR-ACK-010 is a SHOULD, and an IUT that keeps no credit limit has no lsn a NAK could change."""
    c = connect_req(t, timeout=18)
    c.mem_write(0, pattern(64))
    p = c.iut_psn
    m1 = post(c, wr("SEND", 16, wr_id=1, c=c))
    s1 = requests(c, m1, 1, 2.0)
    c.send(ack(c, p, 1, syndrome=0x00))                 # ACK, credit code 0: lsn = msn 1 + 0
    c.poll(1, 0.5)
    m2 = post(c, wr("SEND", 16, wr_id=2, c=c, offset=16))
    s2 = requests(c, m2, 1, 1.0, psn=P.psn_add(p, 1))
    m3 = post(c, wr("SEND", 16, wr_id=3, c=c, offset=32))
    early = requests(c, m3, 1, 0.3, psn=P.psn_add(p, 2))
    if not s1 or not s2:
        t.check("MR-ACK-012", False, f"SEND 1: {describe(s1)}; SEND 2: {describe(s2)}", frames=s1 + s2,
                expected="SEND 1 and SEND 2 sent")
        return
    if early:
        c.send(ack(c, P.psn_add(p, 2), 3))
        c.poll(2, 0.5)
        t.check("MR-ACK-012", False, "the IUT claims ACK_CREDITS, yet SEND 3 went out with lsn = 1",
                frames=s1 + s2 + early, expected="SEND 3 held until fresh credits")
        return
    m4 = c.send(ack(c, P.psn_add(p, 1), 1, syndrome=0x3F))     # RNR NAK, timer code 31 (491.52 ms)
    held = requests(c, m4, 1, 0.35, psn=P.psn_add(p, 2))
    m5 = c.send(ack(c, P.psn_add(p, 1), 2, syndrome=0x1F))     # SEND 2 done, credits unlimited
    later = requests(c, m5, 1, 2.0, psn=P.psn_add(p, 2))
    if later:
        c.send(ack(c, P.psn_add(p, 2), 3))
    c.poll(2, 0.5)
    t.check("MR-ACK-012", not held and bool(later),
            f"after the RNR NAK (syndrome 0x3f): SEND 3 {describe(held) if held else 'held'}; after an ACK with "
            f"unlimited credit: {describe(later)}", frames=held or later or s2,
            expected="SEND 3 held after the RNR NAK (lsn still 1), sent after the ACK with syndrome 0x1f")


# ---- MR-CNP-007, MR-CNP-008 (DCQCN reaction point, 05-congestion.md 5.7.2 defaults) --------------------------
R_MIN_BPS = 10e6            # R_min, Table of 05-congestion.md 5.7.2


def _timed_write(c: Conn, wr_id: int, size: int, timeout: float, cnps: str = "",
                 readings: list | None = None) -> list:
    """Post one WRITE of `size` bytes and capture its packets; ACK it at the end.  cnps "barrage": 64 CNPs just
    before the post (from R_line, 64 halvings reach R_min); "rain": the barrage, then 8 CNPs every ~0.5 ms
    until the last packet.  With `readings` (a list), the QP's counters are read through the agent every
    ~1 ms while the packets go out and appended to it."""
    import threading
    import time
    n = -(-size // c.mtu)
    stop = threading.Event()
    burst = [cnp(c)] * 8

    def pump():
        while not stop.is_set():
            c.t.lt.send(*burst)
            time.sleep(0.0005)
    if cnps:
        for _ in range(8):
            c.t.lt.send(*burst)
            time.sleep(0.0001)
        time.sleep(0.002)                # the IUT takes them before the WRITE is posted
    th = threading.Thread(target=pump, name="cnp-pump", daemon=True) if cnps == "rain" else None
    if th is not None:
        th.start()
    def read():
        while not stop.is_set():
            readings.append(c.counters())
            time.sleep(0.001)
    rd = None
    try:
        mark = post(c, wr("RDMA_WRITE", size, wr_id=wr_id, c=c))
        if readings is not None:
            rd = threading.Thread(target=read, name="rp-reader", daemon=True)
            rd.start()
        got = c.expect(n, timeout, after=mark, match=is_req)
    finally:
        stop.set()
        if th is not None:
            th.join(1.0)
        if rd is not None:
            rd.join(2.0)
    if got:
        c.send(ack(c, got[-1].roce.psn, wr_id))
    c.poll(1, 1.0)
    return got


def _rate_bps(fs: list, k: int) -> float:
    """The wire rate of packets k+1.. over [t_k, t_last]: frame + FCS, preamble and gap (24 B), as Rc counts."""
    dt = fs[-1].ts - fs[k].ts
    return sum(len(f.data) + 24 for f in fs[k + 1:]) * 8 / dt if dt > 0 else float("inf")


@case("TC-CNP-007-a", rules=["MR-CNP-007", "MR-CNP-008"], category="CC", caps=("DCQCN",), timeout=30,
      timing=True)
def rate_floor_and_recovery(t):
    """Under 64 CNPs and then a steady rain of them (8 every ~0.5 ms), a 384 KiB WRITE goes out; after 64 CNPs
    alone (the rate cut to R_min), a 512 KiB WRITE is posted.  Where the agent reports the reaction point's
    state (dcqcn_rate_bps, dcqcn_alpha_ppm, 9.4.2) the verdicts rest on it, not on a throughput that depends
    on how busy the host is: MR-CNP-008, every reading during the rain has R_min <= Rc <= Rt <= R_line;
    MR-CNP-007, after the 64 CNPs alpha decays by (1 - g) per K and the rate rises (two readings ~3 ms apart:
    alpha within the bounds of the K periods between them, Rc higher unless at R_line).  Otherwise from the
    wire: past the first 128 packets (the pacer's burst allowance) the first WRITE's wire rate is at least
    R_min less 10 %, and the second WRITE's packets past the first 64 take less than a quarter of the time
    R_min would need."""
    from ._req import need
    c = t.connect(mtu=1024, timeout=20, mr_len=512 << 10)
    try:
        q0 = c.counters()
    except AgentError as e:                 # an agent without per-QP counters: the wire decides
        if e.code != "ENOTSUP":
            raise
        q0 = {}
    p = t.caps.get("dcqcn_params") or {}
    state = bool(p) and "dcqcn_rate_bps" in q0 and "dcqcn_alpha_ppm" in q0
    r_min, line = float(p.get("r_min_bps", R_MIN_BPS)), float(p.get("r_line_bps", 0) or 0)
    rd: list = []
    low = _timed_write(c, 1, 384 << 10, min(12.0, t.left() - 12), cnps="rain", readings=rd if state else None)
    need(len(low) == 384, f"first WRITE: {len(low)} of 384 packets captured")
    r_low = _rate_bps(low, 128)
    wire = f"with CNPs, packets 128..383: {r_low / 1e6:.2f} Mb/s on the wire ({(low[-1].ts - low[128].ts) * 1e3:.1f} ms)"
    if state:
        bad = [q for q in rd if not r_min <= q["dcqcn_rate_bps"] <= q["dcqcn_target_bps"] <= line]
        rcs = [q["dcqcn_rate_bps"] for q in rd]
        t.check("MR-CNP-008", bool(rd) and not bad,
                f"{len(rd)} readings during the rain: Rc {min(rcs, default=0) / 1e6:.2f}..{max(rcs, default=0) / 1e6:.2f}"
                f" Mb/s; outside R_min..Rt..R_line: {bad[:2]} ({wire}, reported)", frames=[low[128], low[-1]],
                expected=f"R_min {r_min:.0f} <= Rc <= Rt <= R_line {line:.0f} at every reading",
                observed=[str(q) for q in (bad or rd)[:3]])
    else:
        t.check("MR-CNP-008", r_low >= R_MIN_BPS * 0.9, wire, frames=[low[128], low[-1]],
                expected=f"at least R_min = {R_MIN_BPS / 1e6:g} Mb/s less 10 %")
    k0 = c.counters().get("rx_cnp") if q0 else None
    if state:
        # 64 CNPs, then two readings ~3 ms apart with no CNP between them
        for _ in range(8):
            t.lt.send(*[cnp(c)] * 8)
        deadline = time.monotonic() + 2.0
        while True:
            tb1 = time.monotonic()
            q1 = c.counters()
            ta1 = time.monotonic()
            if k0 is None or q1["rx_cnp"] - k0 >= 64 or time.monotonic() > deadline:
                break
            time.sleep(0.002)
        time.sleep(0.003)
        tb2 = time.monotonic()
        q2 = c.counters()
        need(q2.get("rx_cnp") == q1.get("rx_cnp") and (k0 is None or q1["rx_cnp"] - k0 >= 64),
             f"the IUT took {q1.get('rx_cnp', 0) - (k0 or 0)} of the 64 CNPs (rx_cnp), then {q2.get('rx_cnp')}")
        kk = p["k_ns"] / 1e9
        g_lo, g_hi = (p["g_ppm"] - 0.5) / 1e6, (p["g_ppm"] + 0.5) / 1e6
        n_lo, n_hi = max(0, int((tb2 - ta1) / kk) - 2), int((time.monotonic() - tb1) / kk) + 2
        a1, a2 = q1["dcqcn_alpha_ppm"] / 1e6, q2["dcqcn_alpha_ppm"] / 1e6
        lo, hi = a1 * (1 - g_hi) ** n_hi - 2e-6, a1 * (1 - g_lo) ** n_lo + 2e-6
        rc1, rc2 = q1["dcqcn_rate_bps"], q2["dcqcn_rate_bps"]
        ok = lo <= a2 <= hi and a2 < a1 and (rc2 > rc1 or rc1 >= line) and r_min <= rc1 <= rc2 <= line
        t.check("MR-CNP-007", ok, f"after 64 CNPs: alpha {a1 * 1e6:.0f} -> {a2 * 1e6:.0f} ppm over "
                f"{(tb2 - ta1) * 1e3:.2f} ms ({n_lo}..{n_hi} K periods: {lo * 1e6:.0f}..{hi * 1e6:.0f}), Rc "
                f"{rc1 / 1e6:.2f} -> {rc2 / 1e6:.2f} Mb/s", expected="alpha x (1 - g) per K without CNPs; Rc raised",
                observed=[str(q1), str(q2)])
        return
    up = _timed_write(c, 2, 512 << 10, min(8.0, t.left() - 2), cnps="barrage")
    need(len(up) == 512, f"second WRITE: {len(up)} of 512 packets captured")
    k1 = c.counters().get("rx_cnp") if q0 else None
    need(k0 is None or k1 - k0 >= 64, f"the IUT took {k1 - k0 if k0 is not None else '?'} of the 64 CNPs (rx_cnp)")
    took = up[-1].ts - up[64].ts
    at_floor = sum(len(f.data) + 24 for f in up[65:]) * 8 / R_MIN_BPS
    t.check("MR-CNP-007", took < at_floor / 4,
            f"after 64 CNPs, packets 64..511 took {took * 1e3:.1f} ms; at R_min they would take "
            f"{at_floor * 1e3:.0f} ms", frames=[up[64], up[-1]],
            expected=f"less than {at_floor / 4 * 1e3:.0f} ms: the rate raised from R_min")
