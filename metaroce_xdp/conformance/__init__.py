"""The MetaRoCE conformance suite (spec 09): a wire-level tester that checks an IUT rule by rule.

The tester plays the IUT's peer.  It drives the IUT through the test agent of
spec 9.4 (the upper tester: agentproto.AgentClient, JSON lines over
TCP) and sends and captures raw frames on the link (the lower tester,
lt.LowerTester, AF_PACKET).  Packets are built and read with scapy and the
ICRC is computed here (packets.py) -- never with metaroce_xdp.wire, the
reference implementation's codec.

    metaroce-conformance --self-test --report out/                 # against the reference implementation
    metaroce-conformance --agent HOST:PORT --iface IF --peer-ip IP [--case PATTERN] [--report DIR]
    make conformance

Modules: packets (layers, opcode table, ICRC), lt (send, capture, pcap),
spec (the rule catalogue: level, observability, applicability), registry
(@case), context (T and Conn, what a case gets), runner (verdicts, 9.5),
report (JSON Lines 9.6.1, JUnit XML, Markdown and HTML with the rule matrix),
selftest (namespaces + reference agent), cli, cases/ (the catalogue), agentproto (the
agent protocol of 9.4, shared with both agents), pyverbs_agent (the agent for rdma-core devices).

How to add a case
-----------------
Put it in a module of metaroce_xdp/conformance/cases/ (a new module is found
by itself; one module per group, e.g. cases/responder.py):

    from ..registry import case
    from .. import packets as P

    @case("TC-DUP-002-a", rules=["MR-DUP-002", "MR-DUP-006"], category="DUP", caps=(), timeout=10)
    def duplicate_write_is_acked_not_placed(t):
        '''A duplicate RDMA WRITE ONLY is ACKed at epsn - 1 and not placed again.'''   # first line: the title
        c = t.connect()                         # IUT QP in RTS; c.psn = the LT's next request PSN
        mark = c.send(c.write(b"first", offset=0))          # c.write builds a WRITE ONLY, advances c.psn
        (ack,) = c.expect(1, timeout=1.0, after=mark) or [None]
        ...
        t.check("MR-DUP-002", ok, "what was seen", frames=[ack], expected="ACKNOWLEDGE psn=...")
        t.check("MR-DUP-006", ...)

Rules of the game:
* The ID is TC-<AREA>-<NNN>-<letter>, after the main rule it checks (TC-DUP-002-a checks MR-DUP-002);
  `rules` lists every rule the case gives a verdict on; each must be defined in docs/spec
  (tests/conformance/test_conformance.py checks).  `category` is a code of spec 9.3.3.
* Decide each declared rule with t.check(rule, ok, detail, frames=..., expected=...) -- from
  captured frames, agent replies and memory read through the agent only (MR-CONF-010).
  Several checks of one rule are ANDed; a rule never checked gets ERROR; an exception or a
  failed precondition (raise CaseError) gives ERROR to the rules not yet decided; what the
  agent cannot drive (raise CannotDrive, or t.set_param(name, v) for a parameter it does not
  list in caps.params) gives CANNOT-DRIVE to them, t.cannot_drive(rule, why) to one -- never
  NOT-APPLICABLE, which only the claim gives (MR-CONF-006), and never a PASS: an applicable MUST
  rule without a PASS leaves the claim INCONCLUSIVE.  A rule about a packet that never came
  because the IUT failed another rule of the case is t.blocked(rule, by=that_rule, why), not a
  FAIL (MR-CONF-024).  A FAIL must cite frames (MR-CONF-027): pass the Frames, and describe the
  packet you expected.  A silence check ("nothing is sent, nothing placed") is followed by a
  request that must be answered (_common.dropped_silently), so a dead IUT cannot pass it.
* `caps` names capabilities the case needs ("ATOMICS", "IPV6", "DCQCN", "MULTIPATH", "CREDITS",
  "CC_DELAY"); if the IUT does not claim one, the case does not run and its rules are
  NOT-APPLICABLE ("skipped, not claimed").  Rules outside the claim, and unobservable rules
  (Table 9-2), get their verdicts without running.
* `timeout` is the case's time bound in seconds; keep every wait bounded by it (t.left()).
  `timing=True` marks a case whose verdict rests on measured times (MR-CONF-011 tolerances):
  make conformance runs it, make test leaves it out (the project asserts no speed in make test).
* Clean-up is automatic for what t.connect / t.pd / t.reg_mr created (QPs destroyed, MRs
  deregistered, CQs and PDs freed), and the runner issues `reset` before and after every case.

What a case has (context.T, context.Conn):
    t.connect(mtu=1024, psn=None, iut_psn=None, access=..., mr_access=..., mr_len=65536,
              timeout=14, retry_cnt=7, rnr_retry=7, min_rnr_timer=1, max_rd_atomic=4,
              max_dest_rd_atomic=4, state="RTS") -> Conn
    t.agent.call(cmd, **args)      any 9.4 command (logged to the case's agent log)
    t.lt.send(frame) / t.lt.wait(match, timeout, after) / t.lt.collect(match, duration, after, until)
    t.iut_ip, t.iut_mac, t.lt_ip, t.lt_mac, t.hello, t.caps, t.claim, t.left()
    c.frame(op, psn=None, **build_kwargs) -> bytes      (packets.build with this conn's addresses)
    c.write(data, offset=0, psn=None, ackreq=True)     WRITE ONLY into the IUT MR
    c.send(*frames) -> mark;  c.expect(n, timeout, after=mark, match=None) -> [Frame];  c.quiet(s, after)
    c.post_recv(len, offset, wr_id) / c.post_send(**wr) / c.poll(n, timeout) / c.mem(off, n) /
    c.mem_write(off, data) / c.query() / c.counters();   c.qpn, c.lt_qpn, c.psn, c.iut_psn, c.va,
    c.rkey, c.mtu
    Frame: .num, .ts (capture time, s), .outgoing, .data, .roce (packets.RoceView: .op, .name, .psn,
    .ackreq, .syndrome, .ack_kind, .nak_code, .msn, .headers, .payload, .icrc_ok, ...), .summary()
Shared helpers for cases live in cases/_common.py.
"""
from __future__ import annotations

from .context import CaseError, Conn, NotApplicable, T
from .registry import CASES, Case, case, select

__all__ = ["CASES", "Case", "CaseError", "Conn", "NotApplicable", "T", "case", "select"]
