"""What a test case gets: `t`, its view of the IUT (agent), the link (LT) and its verdicts.

    t.connect(...)  -> Conn    an IUT QP in RTS whose peer is the LT (MR-CONF-012)
    t.check(rule, ok, detail, frames=..., expected=...)   one observation for one rule
    t.agent.call(cmd, **args)                             any 9.4 command, logged
    t.lt                                                   the LowerTester (send, wait, collect)
"""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .agentproto import AgentError
from . import packets as P
from .lt import Frame, LowerTester

FULL_ACCESS = ["LOCAL_WRITE", "REMOTE_WRITE", "REMOTE_READ", "REMOTE_ATOMIC"]

# The coarsest timer granularity G the tester accepts in a tolerance (MR-CONF-011): an IUT may claim a coarser
# G (Linux Soft-RoCE claims 1/HZ, 4 ms), but its timing rules are judged as if G were this, so a claim cannot
# widen a limit until nothing fails (MR-ACK-004's 10 us would have become 8 ms).
G_CAP_S = 1e-3


class CaseError(Exception):
    """The case could not establish a precondition: every rule it has not decided gets ERROR."""


class CannotDrive(Exception):
    """The agent cannot drive what the case needs (a command, a set_param parameter, a per-QP counter, an
    MR kind, a state the IUT would not enter): every rule the case has not decided gets CANNOT-DRIVE.
    That is not NOT-APPLICABLE, which only the claim gives (MR-CONF-006): an applicable MUST rule
    with nothing better than CANNOT-DRIVE has no PASS, and the run is INCONCLUSIVE (MR-CONF-025)."""


NotApplicable = CannotDrive        # the old name, for case modules written before the distinction


class LoggedAgent:
    """An AgentClient that keeps the case's agent log (requests and responses, numbered lines)."""

    def __init__(self, client) -> None:
        self.client = client
        self.lines: list[str] = []

    def call(self, cmd: str, **args) -> dict:
        self.lines.append(json.dumps({"cmd": cmd, "args": args}, separators=(",", ":")))
        try:
            res = self.client.call(cmd, **args)
        except AgentError as e:
            self.lines.append(json.dumps({"ok": False, "error": {"code": e.code, "message": e.message}},
                                         separators=(",", ":")))
            raise
        self.lines.append(json.dumps({"ok": True, "result": res}, separators=(",", ":")))
        return res

    @property
    def line(self) -> int:
        """The number of the last line written (1-based), for evidence.agent_lines."""
        return len(self.lines)


@dataclass
class Observation:
    rule: str
    ok: bool | None                   # None: the case says the rule cannot be decided here (ERROR)
    detail: str
    frames: list[int] = field(default_factory=list)
    expected: str = ""
    observed: list[str] = field(default_factory=list)
    agent_lines: list[int] = field(default_factory=list)
    verdict: str = ""                 # "CANNOT-DRIVE" (t.cannot_drive), "BLOCKED" (t.blocked); "" otherwise
    by: str = ""                      # BLOCKED: the rule whose failure kept this one's subject off the wire


class Conn:
    """An IUT QP connected to the LT, which plays the peer QP `lt_qpn`.

    psn is the LT's next request PSN (the IUT responder's epsn); iut_psn the IUT requester's
    first PSN.  The memory region (mr, va, rkey, mr_len) belongs to the IUT QP's PD.
    """

    def __init__(self, t: "T", qp: int, qpn: int, pd: int, cq: int, mr: dict, mr_h: int, lt_qpn: int,
                 psn: int, iut_psn: int, mtu: int, sport: int) -> None:
        self.t, self.qp, self.qpn, self.pd, self.cq = t, qp, qpn, pd, cq
        self.mr, self.va, self.rkey, self.lkey, self.mr_len = mr_h, int(mr["va"], 16), mr["rkey"], mr["lkey"], mr["len"]
        self.lt_qpn, self.psn, self.iut_psn, self.mtu, self.sport = lt_qpn, psn, iut_psn, mtu, sport

    # -- frames to the IUT -----------------------------------------------------------
    def frame(self, op, psn: int | None = None, **kw) -> bytes:
        """A frame of the LT's QP to this IUT QP (defaults: the conn's addresses, port, next PSN)."""
        t = self.t
        args = dict(src_mac=t.lt_mac, dst_mac=t.iut_mac, src_ip=t.lt_ip, dst_ip=t.iut_ip, dqpn=self.qpn,
                    psn=self.psn if psn is None else psn, sport=self.sport)
        args.update(kw)
        return P.build(op, **args)

    def send(self, *frames: bytes) -> int:
        """Send frames; returns the capture mark before them (for wait/collect `after`)."""
        mark = self.t.lt.last_num()
        self.t.lt.send(*frames)
        return mark

    def write(self, data: bytes, offset: int = 0, psn: int | None = None, ackreq: bool = True, **kw) -> bytes:
        """An RDMA WRITE ONLY of `data` to the IUT MR at `offset` (psn None: the next PSN, then advanced)."""
        f = self.frame("RDMA_WRITE_ONLY", psn=psn, ackreq=ackreq, reth=(self.va + offset, self.rkey, len(data)),
                       payload=data, **kw)
        if psn is None:
            self.psn = P.psn_add(self.psn, 1)
        return f

    # -- frames from the IUT -------------------------------------------------------------
    def is_mine(self, f: Frame) -> bool:
        """A RoCE frame the IUT sent to the LT's QP."""
        v = f.roce
        return not f.outgoing and v is not None and v.dqpn == self.lt_qpn and v.src_ip == self.t.iut_ip

    def expect(self, n: int = 1, timeout: float = 1.0, after: int = 0,
               match: Callable[[Frame], bool] | None = None) -> list[Frame]:
        """Up to n frames from the IUT to this conn (and `match`), waiting up to timeout s."""
        m = (lambda f: self.is_mine(f) and match(f)) if match else self.is_mine
        return self.t.lt.collect(m, timeout, after=after, until=lambda fs: len(fs) >= n)

    def quiet(self, duration: float = 0.3, after: int = 0) -> list[Frame]:
        """Every frame the IUT sends to this conn during `duration` s (a case expecting silence wants [])."""
        return self.t.lt.collect(self.is_mine, duration, after=after)

    # -- verbs through the agent ---------------------------------------------------------
    def post_recv(self, length: int, offset: int = 0, wr_id: int = 1) -> None:
        self.t.agent.call("post_recv", qp=self.qp, wr={"wr_id": hex(wr_id),
                                                       "sg_list": [{"mr": self.mr, "offset": offset, "len": length}]})

    def post_send(self, **wr) -> None:
        self.t.agent.call("post_send", qp=self.qp, wr=wr)

    def poll(self, n: int = 1, timeout: float = 1.0) -> list[dict]:
        """Up to n completions, waiting up to timeout s in all."""
        out: list[dict] = []
        deadline = time.monotonic() + timeout
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            out += self.t.agent.call("poll_cq", cq=self.cq, max=n - len(out),
                                     timeout_ms=max(1, int(min(left, 0.5) * 1000)))["completions"]
        return out

    def mem(self, offset: int, n: int) -> bytes:
        return bytes.fromhex(self.t.agent.call("mem_read", mr=self.mr, offset=offset, len=n)["hex"])

    def mem_write(self, offset: int, data: bytes) -> None:
        self.t.agent.call("mem_write", mr=self.mr, offset=offset, hex=data.hex())

    def query(self) -> dict:
        return self.t.agent.call("query_qp", qp=self.qp)

    def counters(self) -> dict:
        """get_counters qp; CannotDrive when the IUT's agent offers no per-QP counters (caps.qp_counters
        empty, or ENOTSUP from an agent that does not say)."""
        self.t.need_qp_counters()
        try:
            return self.t.agent.call("get_counters", qp=self.qp)["counters"]
        except AgentError as e:
            if e.code != "ENOTSUP":
                raise
            raise CannotDrive(f"the IUT's agent offers no per-QP counters: {e}") from None


class T:
    """One test case's context.  Created by the runner; a case receives it as its only argument."""

    def __init__(self, case, agent: LoggedAgent, lt: LowerTester, hello: dict, caps: dict, claim,
                 lt_ip: str, deadline: float) -> None:
        self.case, self.agent, self.lt, self.hello, self.caps, self.claim = case, agent, lt, hello, caps, claim
        self.iut_ip, self.iut_mac = hello["ip"], hello["mac"]
        self.lt_ip, self.lt_mac = lt_ip, lt.mac
        self.deadline = deadline
        self.observations: list[Observation] = []
        self._conns: list[Conn] = []
        self._extra: list[tuple[str, dict]] = []       # other resources to free, in creation order

    # -- verdicts ---------------------------------------------------------------------------
    def check(self, rule: str, ok: bool, detail: str, frames=(), expected: str = "", observed=None) -> bool:
        """Record one observation for `rule` (MR-CONF-024: several per rule are ANDed).  frames are
        captured Frames (or frame numbers) that show it (MR-CONF-027); expected/observed describe the
        packets for the report when ok is false (observed defaults to the frames' summaries)."""
        self._declared(rule)
        nums = [f.num if isinstance(f, Frame) else int(f) for f in frames]
        obs = observed if observed is not None else [f.summary() for f in frames if isinstance(f, Frame)]
        self.observations.append(Observation(rule, bool(ok), detail, nums, expected, list(obs),
                                             [self.agent.line] if self.agent.line else []))
        return bool(ok)

    def undecided(self, rule: str, detail: str) -> None:
        """The case cannot decide `rule` this run (ERROR for it, the others keep their verdicts)."""
        self.observations.append(Observation(rule, None, detail))

    def cannot_drive(self, rule: str, detail: str) -> None:
        """The agent cannot drive what `rule`'s check needs in this case (CANNOT-DRIVE: no PASS, see
        CannotDrive); `detail` says what is missing."""
        self._declared(rule)
        self.observations.append(Observation(rule, None, detail, verdict="CANNOT-DRIVE"))

    not_applicable = cannot_drive   # the old name (a rule outside the claim never reaches a case)

    def blocked(self, rule: str, by: str, detail: str, frames=()) -> None:
        """`rule` is about a packet that never appeared because the IUT failed `by` (a rule this case
        checks too, e.g. a CNP's format when no CNP was sent): BLOCKED, not FAIL (MR-CONF-024)."""
        self._declared(rule)
        if by not in self.case.rules:
            raise CaseError(f"{self.case.id}: {rule} blocked by {by}, which the case does not check")
        nums = [f.num if isinstance(f, Frame) else int(f) for f in frames]
        self.observations.append(Observation(rule, None, f"blocked by {by}: {detail}", nums, verdict="BLOCKED",
                                             by=by))

    def _declared(self, rule: str) -> None:
        if rule not in self.case.rules:
            raise CaseError(f"{self.case.id} gives a verdict on {rule}, which it does not declare")

    def set_param(self, name: str, value: int) -> None:
        """set_param through the agent; CannotDrive when the IUT does not offer `name` (9.4.2:
        caps.params).  The runner's reset restores it."""
        if name not in self.caps.get("params", ()):
            raise CannotDrive(f"the IUT does not offer set_param {name!r}")
        self.agent.call("set_param", name=name, value=value)

    def need_commands(self, *names: str) -> None:
        """CannotDrive unless the agent implements every command named (9.4.2 caps.commands; an agent that
        does not list its commands is assumed to have them and answers ENOTSUP or ENOCMD otherwise)."""
        have = self.caps.get("commands")
        missing = [n for n in names if have is not None and n not in have]
        if missing:
            raise CannotDrive(f"the IUT's agent does not offer {', '.join(missing)} (caps.commands)")

    def need_qp_counters(self, *names: str) -> None:
        """CannotDrive unless get_counters qp reports the counters named (9.4.2 caps.qp_counters; with no
        names: any per-QP counter at all).  An agent that does not list them is asked."""
        have = self.caps.get("qp_counters")
        if have is None:
            return
        missing = [n for n in names if n not in have]
        if not have or missing:
            raise CannotDrive("the IUT's agent reports " + (f"no per-QP {', '.join(missing)}" if have else
                                                               "no per-QP counters") + " (caps.qp_counters)")

    def granularity_s(self) -> float:
        """G of MR-CONF-011 in seconds: the IUT's claimed timer granularity (hello.timer_granularity_us), capped
        by the tester at G_CAP_S."""
        return min(float(self.hello.get("timer_granularity_us", 0) or 0) * 1e-6, G_CAP_S)

    def tolerance_s(self, nominal: float) -> float:
        """MR-CONF-011: the deviation accepted from a specified time `nominal`: max(10 %, 2 G, 50 us)."""
        return max(0.1 * nominal, 2 * self.granularity_s(), 50e-6)

    def left(self) -> float:
        """Seconds left of the case's time bound."""
        return self.deadline - time.monotonic()

    # -- set-up -----------------------------------------------------------------------------
    def pd(self) -> int:
        h = self.agent.call("create_pd")["pd"]
        self._extra.append(("dealloc_pd", {"pd": h}))
        return h

    def reg_mr(self, pd: int, length: int = 65536, access=FULL_ACCESS, fill: int = 0) -> tuple[int, dict]:
        r = self.agent.call("reg_mr", pd=pd, len=length, access=list(access), **({"fill": fill} if fill else {}))
        self._extra.append(("dereg_mr", {"mr": r["mr"]}))
        return r["mr"], r

    def connect(self, *, mtu: int = 1024, psn: int | None = None, iut_psn: int | None = None,
                access=FULL_ACCESS, mr_access=FULL_ACCESS, mr_len: int = 65536, fill: int = 0,
                timeout: int = 14, retry_cnt: int = 7, rnr_retry: int = 7, min_rnr_timer: int = 1,
                max_rd_atomic: int = 4, max_dest_rd_atomic: int = 4, lt_qpn: int | None = None,
                state: str = "RTS", cqe: int = 64, max_send_sge: int = 1) -> Conn:
        """Create a PD, an MR, a CQ and an RC QP on the IUT and bring the QP to `state` with the LT as
        its peer: dest QPN lt_qpn (random if None), rq_psn = psn (the LT's first request PSN),
        sq_psn = iut_psn.  Everything is destroyed after the case."""
        pd = self.pd()
        mr_h, mr = self.reg_mr(pd, mr_len, mr_access, fill)
        cq = self.agent.call("create_cq", cqe=cqe)["cq"]
        self._extra.append(("destroy_cq", {"cq": cq}))
        r = self.agent.call("create_qp", pd=pd, send_cq=cq, recv_cq=cq, type="RC",
                            cap={"max_send_wr": 64, "max_recv_wr": 64, "max_send_sge": max_send_sge, "max_recv_sge": 1,
                                 "max_inline_data": 0})
        qp = r["qp"]
        lt_qpn = lt_qpn if lt_qpn is not None else 0x100 + secrets.randbelow(0xFFFE00)
        psn = secrets.randbelow(1 << 24) if psn is None else psn & 0xFFFFFF
        iut_psn = secrets.randbelow(1 << 24) if iut_psn is None else iut_psn & 0xFFFFFF
        conn = Conn(self, qp, r["qpn"], pd, cq, mr, mr_h, lt_qpn, psn, iut_psn, mtu,
                    0xC000 | secrets.randbelow(0x4000))
        self._conns.append(conn)
        order = ["INIT", "RTR", "RTS"]
        steps = order[:order.index(state) + 1] if state in order else []
        for s in steps:
            if s == "INIT":
                attrs: dict[str, Any] = {"access": list(access), "pkey": 0xFFFF}
            elif s == "RTR":
                attrs = {"dest_qpn": lt_qpn, "rq_psn": psn, "path_mtu": mtu, "dgid": _gid(self.lt_ip),
                         "dmac": self.lt_mac, "max_dest_rd_atomic": max_dest_rd_atomic,
                         "min_rnr_timer": min_rnr_timer, "profile": "compat"}
            else:
                attrs = {"sq_psn": iut_psn, "timeout": timeout, "retry_cnt": retry_cnt, "rnr_retry": rnr_retry,
                         "max_rd_atomic": max_rd_atomic}
            self.agent.call("modify_qp", qp=qp, state=s, attrs=attrs)
        return conn

    def cleanup(self) -> list[str]:
        """Destroy what the case created (QPs first, then MRs, CQs, PDs); returns what failed."""
        errors = []
        todo = [("destroy_qp", {"qp": c.qp}) for c in self._conns]
        kinds = ("dereg_mr", "destroy_cq", "dealloc_pd")
        todo += [x for k in kinds for x in reversed(self._extra) if x[0] == k]
        for cmd, args in todo:
            try:
                self.agent.call(cmd, **args)
            except (AgentError, OSError) as e:
                errors.append(f"{cmd} {args}: {e}")
        self._conns.clear()
        self._extra.clear()
        return errors


def _gid(ip: str) -> str:
    import ipaddress
    a = ipaddress.ip_address(ip)
    if a.version == 4:
        a = ipaddress.IPv6Address("::ffff:" + ip)
    return a.packed.hex()


__all__ = ["CannotDrive", "CaseError", "Conn", "NotApplicable", "FULL_ACCESS", "LoggedAgent", "Observation", "T"]
