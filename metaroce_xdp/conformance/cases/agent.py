"""The IUT's test agent (spec 9.4, MR-CONF-014 to MR-CONF-023): framing, errors, encodings, reset, and that
it adds nothing to the wire.  A second session is opened where a case needs a fresh one."""
from __future__ import annotations

import json
import re
import socket
import time

from ..agentproto import CODES, MAX_LINE, PROTO, AgentError
from ..registry import case
from ._common import describe


class _Raw:
    """A second agent session with raw lines (the framing rules need to see them)."""

    def __init__(self, t, timeout: float = 5.0) -> None:
        host, port = t.agent.client.sock.getpeername()[:2]
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.f = self.sock.makefile("rb")

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def line(self) -> dict | None:
        raw = self.f.readline(2 * MAX_LINE)
        if not raw:
            return None
        return {"_raw": raw, **json.loads(raw)}

    def close(self) -> None:
        self.f.close()
        self.sock.close()


def _shape(resp: dict | None, rid) -> bool:
    """MR-CONF-016's two shapes, with the request's id."""
    if resp is None or resp.get("id") != rid or not resp["_raw"].endswith(b"\n") or resp["_raw"].count(b"\n") != 1:
        return False
    if resp.get("ok") is True:
        return isinstance(resp.get("result"), dict)
    err = resp.get("error")
    return (resp.get("ok") is False and isinstance(err, dict) and err.get("code") in CODES
            and isinstance(err.get("message"), str))


@case("TC-CONF-015-a", rules=["MR-CONF-014", "MR-CONF-015", "MR-CONF-016", "MR-CONF-017"], category="AGT",
      timeout=15)
def framing_order_and_hello_first(t):
    """A fresh session: a command before hello is EPROTO; pipelined requests are answered one line each, in
    order, with their ids; unknown args are ignored; an unknown command is ENOCMD."""
    r = _Raw(t)
    try:
        r.send(b'{"id":7,"cmd":"caps","args":{}}\n')
        first = r.line()
        t.check("MR-CONF-017", _shape(first, 7) and first["error"]["code"] == "EPROTO" if first and not first.get("ok")
                else False, f"caps before hello -> {first and first['_raw'][:200]!r}", expected='{"id":7,"ok":false,'
                '"error":{"code":"EPROTO",...}}')
        reqs = [{"id": 100, "cmd": "hello", "args": {"proto": PROTO}},
                {"id": 101, "cmd": "caps", "args": {"no_such_member": 5}},
                {"id": 102, "cmd": "create_pd", "args": {}},
                {"id": 103, "cmd": "no_such_command", "args": {}},
                {"id": 104, "cmd": "get_counters", "args": {}}]
        r.send(b"".join(json.dumps(q).encode() + b"\n" for q in reqs))
        got = [r.line() for _ in reqs]
        ids = [g.get("id") if g else None for g in got]
        t.check("MR-CONF-015", ids == [100, 101, 102, 103, 104], f"response ids {ids}",
                expected="ids 100..104 in order")
        t.check("MR-CONF-014", all(g is not None and len(g["_raw"]) <= MAX_LINE for g in got),
                "each response one JSON line" if all(got) else "a response missing", expected="one line each")
        t.check("MR-CONF-016", all(_shape(g, q["id"]) for g, q in zip(got, reqs)),
                "every response has one of the two shapes", expected="{id, ok, result} or {id, ok:false, error}")
        t.check("MR-CONF-017", got[1] is not None and got[1].get("ok") is True, "unknown member of args ignored"
                if got[1] and got[1].get("ok") else f"unknown member refused: {got[1]}", expected="caps succeeds")
        t.check("MR-CONF-016", got[3] is not None and got[3].get("error", {}).get("code") == "ENOCMD",
                f"unknown command -> {got[3] and got[3].get('error')}", expected="ENOCMD")
        r.send(b'{"id":105,"cmd":"reset","args":{}}\n')
        r.line()
    finally:
        r.close()


@case("TC-CONF-016-a", rules=["MR-CONF-016", "MR-CONF-023"], category="AGT", timeout=10)
def failed_commands_change_nothing(t):
    """Failing commands return a code of 9.4.3 and change nothing: RESET -> RTS is ESTATE and the QP stays
    in RESET; a mem_read past the MR is EINVAL; a post_send list with one bad WR posts none."""
    c = t.connect(state="RESET")
    codes = []
    try:
        t.agent.call("modify_qp", qp=c.qp, state="RTS", attrs={"sq_psn": 1})
    except AgentError as e:
        codes.append(e.code)
    st = c.query()["state"]
    try:
        t.agent.call("mem_read", mr=c.mr, offset=c.mr_len - 4, len=8)
    except AgentError as e:
        codes.append(e.code)
    c2 = t.connect()
    good = {"wr_id": "0x1", "opcode": "RDMA_WRITE", "sg_list": [{"mr": c2.mr, "offset": 0, "len": 8}],
            "remote": {"va": "0x1000", "rkey": 1}}
    bad = {**good, "wr_id": "0x2", "sg_list": [{"mr": c2.mr, "offset": c2.mr_len - 4, "len": 8}]}
    mark = t.lt.last_num()
    try:
        t.agent.call("post_send", qp=c2.qp, wrs=[good, bad])
    except AgentError as e:
        codes.append(e.code)
    sent = c2.quiet(0.3, after=mark)
    t.check("MR-CONF-023", codes == ["ESTATE", "EINVAL", "EINVAL"], f"codes {codes}",
            expected="ESTATE, EINVAL, EINVAL")
    t.check("MR-CONF-016", st == "RESET" and not sent, f"QP state after the failed modify {st}; frames after the "
            f"failed post_send: {describe(sent)}", frames=sent, expected="RESET; no frame")


@case("TC-CONF-018-a", rules=["MR-CONF-018"], category="AGT", timeout=10)
def value_encodings(t):
    """hello's gid is 32 hex digits, reg_mr's va "0x" + lowercase hex, handles and keys numbers, and a
    completion's wr_id comes back as "0x" + lowercase hex."""
    c = t.connect()
    mr = t.agent.call("reg_mr", pd=c.pd, len=64, access=["LOCAL_WRITE"])
    t.agent.call("dereg_mr", mr=mr["mr"])
    hexa = re.compile(r"0x[0-9a-f]+")
    ok = (re.fullmatch(r"[0-9a-f]{32}", t.hello.get("gid", "")) is not None and hexa.fullmatch(mr["va"]) is not None
          and all(isinstance(mr[k], int) and not isinstance(mr[k], bool) for k in ("mr", "lkey", "rkey", "len")))
    t.agent.call("modify_qp", qp=c.qp, state="ERR", attrs={})
    t.agent.call("post_send", qp=c.qp, wr={"wr_id": "0xabcdef0123456789", "opcode": "SEND", "sg_list": []})
    wcs = c.poll(1, 2.0)
    wr_ok = bool(wcs) and wcs[0].get("wr_id") == "0xabcdef0123456789"
    t.check("MR-CONF-018", ok and wr_ok, f"gid {t.hello.get('gid')!r}, va {mr['va']!r}, completion {wcs}",
            expected="gid 32 hex digits, va 0x<lowercase hex>, wr_id '0xabcdef0123456789'")


@case("TC-CONF-019-a", rules=["MR-CONF-019"], category="AGT", timeout=10)
def agent_adds_no_packets(t):
    """Commands that post no work (query_qp, mem_read, mem_write, get_counters, caps, poll_cq) send nothing
    on the link of a connected QP."""
    c = t.connect()
    mark = t.lt.last_num()
    for _ in range(3):
        c.query()
        c.mem_write(0, b"x" * 64)
        c.mem(0, 64)
        if t.caps.get("qp_counters", True):    # an agent without per-QP counters: the port's
            c.counters()
        else:
            t.agent.call("get_counters")
        t.agent.call("caps")
        c.poll(1, 0.05)
    sent = c.quiet(0.3, after=mark)
    t.check("MR-CONF-019", not sent, f"frames: {describe(sent)}", frames=sent, expected="no frame from the IUT")


@case("TC-CONF-021-a", rules=["MR-CONF-021"], category="AGT", timeout=10)
def reset_destroys_everything(t):
    """After reset every handle of the session is unknown (ENOENT) and new resources can be created."""
    c = t.connect()
    t.agent.call("reset")
    codes = []
    for cmd, args in (("query_qp", {"qp": c.qp}), ("mem_read", {"mr": c.mr, "offset": 0, "len": 1}),
                      ("poll_cq", {"cq": c.cq}), ("dealloc_pd", {"pd": c.pd})):
        try:
            t.agent.call(cmd, **args)
            codes.append("ok")
        except AgentError as e:
            codes.append(e.code)
    t._conns.clear()                     # already gone: nothing for the clean-up to destroy
    t._extra.clear()
    c2 = t.connect()
    t.check("MR-CONF-021", codes == ["ENOENT"] * 4 and c2.qp > 0, f"after reset: {codes}; a new QP {c2.qpn:#x}",
            expected="ENOENT x 4, then a new QP")


@case("TC-CONF-020-a", rules=["MR-CONF-020", "MR-CONF-021"], category="AGT", timeout=10, timing=True)
def poll_and_reset_times(t):
    """poll_cq on an empty CQ returns after at most timeout_ms (200 ms, + 100 ms of transport), and reset
    takes under 1 s."""
    c = t.connect()
    t0 = time.monotonic()
    got = t.agent.call("poll_cq", cq=c.cq, max=1, timeout_ms=200)["completions"]
    dt = time.monotonic() - t0
    t.check("MR-CONF-020", not got and dt <= 0.3, f"empty poll_cq took {dt * 1000:.0f} ms",
            expected="at most 200 ms + 100 ms")
    t0 = time.monotonic()
    t.agent.call("reset")
    dt = time.monotonic() - t0
    t._conns.clear()
    t._extra.clear()
    t.check("MR-CONF-021", dt < 1.0, f"reset took {dt * 1000:.0f} ms", expected="under 1 s")
