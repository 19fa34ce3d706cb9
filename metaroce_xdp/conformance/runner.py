"""Run test cases against an IUT: one verdict per (case, rule) (section 9.5, MR-CONF-024)."""
from __future__ import annotations

import datetime as dt
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .agentproto import PROTO, AgentError
from .context import CannotDrive, CaseError, LoggedAgent, Observation, T
from .lt import LowerTester
from .registry import Case
from .spec import Catalogue, Claim

# Spec 9.5.  NOT-APPLICABLE and NOT-OBSERVABLE are decided before a case runs, from the claim and
# Table 9-2 only (MR-CONF-006, MR-CONF-037); what a case finds at run time is one of the others.
VERDICTS = ("PASS", "FAIL", "ERROR", "BLOCKED", "CANNOT-DRIVE", "NOT-APPLICABLE", "NOT-OBSERVABLE")


@dataclass
class Verdict:
    """One (test case, rule) verdict, the line of 9.6.1."""
    test: str
    rule: str
    verdict: str
    detail: str
    level: str = "must"
    profile: str = "compat"
    ts: str = ""
    frames: list[int] = field(default_factory=list)
    agent_lines: list[int] = field(default_factory=list)
    expected: str = ""
    observed: list[str] = field(default_factory=list)
    duration_ms: float = 0.0


@dataclass
class CaseRun:
    case: Case
    verdicts: list[Verdict]
    duration_ms: float
    pcap: str = ""                     # relative to the report directory
    agent_log: str = ""
    counters: dict = field(default_factory=dict)
    error: str = ""                    # tester-side failure, traceback
    skipped: str = ""                  # why the case did not run


@dataclass
class RunResult:
    run_id: str
    iut: dict                          # {name, version, claim, under_test}: under_test the agent's hello.iut
    claim: Claim
    hello: dict
    caps: dict
    peer: str
    spec_version: str
    started: str
    runs: list[CaseRun] = field(default_factory=list)

    def verdicts(self) -> list[Verdict]:
        return [v for r in self.runs for v in r.verdicts]


def now_rfc3339() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _decide(rule: str, obs: list[Observation]) -> tuple[str, Observation | None, str]:
    """One case's verdict on `rule` from its observations, ANDed (MR-CONF-024): FAIL > ERROR > BLOCKED >
    CANNOT-DRIVE > PASS -- a PASS only when every observation passed."""
    mine = [o for o in obs if o.rule == rule]
    if not mine:
        return "ERROR", None, "the case ended without deciding this rule"
    bad = [o for o in mine if o.ok is False]
    if bad:
        return "FAIL", bad[0], "; ".join(o.detail for o in bad)
    for verdict, pick in (("ERROR", lambda o: o.ok is None and not o.verdict),
                          ("BLOCKED", lambda o: o.verdict == "BLOCKED"),
                          ("CANNOT-DRIVE", lambda o: o.verdict == "CANNOT-DRIVE")):
        some = [o for o in mine if pick(o)]
        if some:
            return verdict, some[0], "; ".join(o.detail for o in some)
    return "PASS", mine[-1], "; ".join(dict.fromkeys(o.detail for o in mine))


class Runner:
    """Runs cases one after the other on one agent session and one lower tester.

        r = Runner(client, lt, lt_ip, report_dir); result = r.run(cases)

    Per case (MR-CONF-009): `reset`, counters, capture from frame 1, the case in a thread bounded
    by its time limit, the case's clean-up, `reset`, counters again, the capture and the agent log
    written under report_dir/captures and report_dir/agent.
    """

    def __init__(self, client, lt: LowerTester, lt_ip: str, report_dir: Path | str, *,
                 catalogue: Catalogue | None = None, peer: str = "LT", reconnect: Callable | None = None,
                 log: Callable[[str], None] = print) -> None:
        self.client, self.lt, self.lt_ip = client, lt, lt_ip
        self.dir = Path(report_dir)
        self.cat = catalogue or Catalogue()
        self.peer = peer
        self.reconnect = reconnect        # () -> a new client, after a case overran its time bound
        self.log = log
        self.hello = client.call("hello", proto=PROTO)
        self.caps = client.call("caps")
        self.claim = Claim.from_agent(self.hello, self.caps)

    def run(self, cases: list[Case]) -> RunResult:
        started = now_rfc3339()
        res = RunResult(run_id=f"{started}-{self.hello.get('impl', 'iut')}",
                        iut={"name": self.hello.get("impl", ""), "version": self.hello.get("version", ""),
                             "claim": self.claim.text(), "under_test": self.hello.get("iut", "")},
                        claim=self.claim, hello=self.hello, caps=self.caps, peer=self.peer,
                        spec_version=self.cat.version, started=started)
        (self.dir / "captures").mkdir(parents=True, exist_ok=True)
        (self.dir / "agent").mkdir(parents=True, exist_ok=True)
        for c in cases:
            run = self.run_case(c)
            res.runs.append(run)
            counts = {}
            for v in run.verdicts:
                counts[v.verdict] = counts.get(v.verdict, 0) + 1
            self.log(f"{c.id:<16} {' '.join(f'{k} {n}' for k, n in sorted(counts.items())):<28} "
                     f"{run.duration_ms:7.0f} ms  {c.title}")
        return res

    # -- one case ---------------------------------------------------------------------------
    def _static(self, c: Case, rule: str) -> tuple[str, str] | None:
        """A verdict decided without running: not in the spec, not applicable, not observable."""
        if rule not in self.cat:
            return "ERROR", f"{rule} is not a rule of the spec"
        ok, why = self.cat.applicable(rule, self.claim)
        if not ok:
            return "NOT-APPLICABLE", why
        missing = [cap for cap in c.caps if cap not in self.claim.caps]
        if missing:
            return "NOT-APPLICABLE", f"skipped, not claimed: {', '.join(missing)}"
        if c.profile == "native" and not self.claim.native:
            return "NOT-APPLICABLE", "skipped, not claimed: native profile"
        if self.cat[rule].observable == "no":
            return "NOT-OBSERVABLE", f"not observable on the wire: {self.cat[rule].unobservable_what}"
        return None

    def run_case(self, c: Case) -> CaseRun:
        t0 = time.monotonic()
        static = {r: self._static(c, r) for r in c.rules}
        if all(v is not None for v in static.values()):
            verdicts = [self._verdict(c, r, v[0], v[1], 0.0) for r, v in static.items()]
            return CaseRun(c, verdicts, 0.0, skipped="; ".join(dict.fromkeys(v[1] for v in static.values())))
        agent = LoggedAgent(self.client)
        run = CaseRun(c, [], 0.0)
        before = {}
        try:
            agent.call("reset")
            before = agent.call("get_counters")["counters"]
        except Exception as e:                # noqa: BLE001 - the agent is gone: every rule is ERROR
            run.error = f"agent before the case: {type(e).__name__}: {e}"
        self.lt.begin_case()
        t = T(c, agent, self.lt, self.hello, self.caps, self.claim, self.lt_ip, time.monotonic() + c.timeout)
        if not run.error:
            box: dict = {}

            def body():
                try:
                    c.fn(t)
                except BaseException as e:    # noqa: BLE001 - reported as ERROR
                    box["exc"] = e
                    box["tb"] = traceback.format_exc()

            th = threading.Thread(target=body, name=f"case-{c.id}", daemon=True)
            th.start()
            th.join(c.timeout)
            if th.is_alive():
                run.error = f"exceeded its time bound of {c.timeout:g} s"
                if self.reconnect is not None:         # the case thread still holds the old session
                    try:
                        self.client.close()
                    except Exception:                  # noqa: BLE001
                        pass
                    self.client = self.reconnect()
                    agent = LoggedAgent(self.client)
                    t.agent = agent
                    self.client.call("hello", proto=PROTO)
                th.join(2.0)
            elif isinstance(box.get("exc"), CannotDrive) or _not_offered(box.get("exc")):
                # ENOTSUP is the agent's "not supported by the IUT" (9.4.3): what the agent cannot drive
                # leaves the rules it was needed for CANNOT-DRIVE -- no PASS, and not NOT-APPLICABLE, which
                # only the claim gives (MR-CONF-006)
                why = box["exc"] if isinstance(box["exc"], CannotDrive) else f"the IUT does not offer it: {box['exc']}"
                for r in c.rules:
                    if not any(o.rule == r for o in t.observations):
                        t.cannot_drive(r, f"agent cannot drive: {why}")
            elif "exc" in box:
                e = box["exc"]
                kind = "precondition failed" if isinstance(e, CaseError) else type(e).__name__
                run.error = f"{kind}: {e}"
                if not isinstance(e, CaseError):
                    run.error += "\n" + box["tb"]
            cleanup_errors = t.cleanup()
            if cleanup_errors:
                run.error = (run.error + "\n" if run.error else "") + "clean-up: " + "; ".join(cleanup_errors)
        try:
            agent.call("reset")
            after = agent.call("get_counters")["counters"]
            run.counters = {k: v - before.get(k, 0) for k, v in after.items()
                            if isinstance(v, int) and v != before.get(k, 0)}
        except Exception as e:                 # noqa: BLE001
            run.error = (run.error + "\n" if run.error else "") + f"agent after the case: {e}"
        frames = self.lt.end_case()
        run.duration_ms = (time.monotonic() - t0) * 1000
        run.pcap = f"captures/{c.id}.pcap"
        LowerTester.write_pcap(self.dir / run.pcap, frames)
        run.agent_log = f"agent/{c.id}.jsonl"
        (self.dir / run.agent_log).write_text("".join(line + "\n" for line in agent.lines))
        first_err = run.error.splitlines()[0] if run.error else ""
        for r in c.rules:
            if static[r] is not None:
                run.verdicts.append(self._verdict(c, r, *static[r], run.duration_ms))
                continue
            verdict, obs, detail = _decide(r, t.observations)
            if verdict == "ERROR" and first_err:       # undecided because the case stopped early
                detail = first_err if obs is None else f"{detail}; {first_err}"
            v = self._verdict(c, r, verdict, detail, run.duration_ms)
            if obs is not None:
                v.frames, v.agent_lines, v.expected, v.observed = obs.frames, obs.agent_lines, obs.expected, obs.observed
            run.verdicts.append(v)
        return run

    def _verdict(self, c: Case, rule: str, verdict: str, detail: str, ms: float) -> Verdict:
        level = self.cat[rule].level if rule in self.cat else "must"
        return Verdict(c.id, rule, verdict, detail, level, c.profile, now_rfc3339(), duration_ms=round(ms, 1))


def _not_offered(exc) -> bool:
    """An agent error ENOTSUP out of a case: the IUT does not offer what the case asked for."""
    return isinstance(exc, AgentError) and exc.code == "ENOTSUP"


__all__ = ["CaseRun", "RunResult", "Runner", "VERDICTS", "Verdict"]
