"""`metaroce-conformance`: run the suite against an IUT, or against the reference implementation."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .agentproto import AgentClient
from ..version import VersionAction


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="metaroce-conformance",
        description="MetaRoCE conformance suite (spec 09): drives the IUT through its test agent (TCP) and "
                    "plays its peer on the link (AF_PACKET); writes JSON Lines, JUnit XML, Markdown and HTML.",
        epilog="examples:\n"
               "  metaroce-conformance --self-test --report out/\n"
               "  metaroce-conformance --self-test --iut daemon --report out-daemon/\n"
               "  metaroce-conformance --agent 192.0.2.10:18516 --iface eth1 --peer-ip 10.0.0.2 --report out/\n"
               "  metaroce-conformance --list --case 'TC-PSN-*'",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action=VersionAction)
    p.add_argument("--agent", metavar="HOST:PORT", help="the IUT's test agent (9.4)")
    p.add_argument("--iface", help="the tester's interface on the link to the IUT")
    p.add_argument("--peer-ip", help="the IP address the lower tester plays (the IUT's QPs connect to it)")
    p.add_argument("--case", action="append", metavar="PATTERN",
                   help="glob on case ID, case module or rule ID (repeatable; default: every case)")
    p.add_argument("--category", action="append", help="only cases of this category (WIRE, ICRC, SEQ, ACK, ...)")
    p.add_argument("--report", default="conformance-report", metavar="DIR", help="report directory (%(default)s)")
    p.add_argument("--spec", metavar="DIR", help="spec directory (default: docs/spec of this source tree)")
    p.add_argument("--self-test", action="store_true",
                   help="build namespaces, start the reference agent and run against it")
    p.add_argument("--iut", choices=("compiled", "daemon"), default="compiled",
                   help="--self-test: the agent drives the compiled plane in its process (default) or metaroced")
    p.add_argument("--list", action="store_true", help="list the selected cases and exit")
    p.add_argument("--no-timing", action="store_true",
                   help="leave out the cases that decide on measured times (make test does)")
    p.add_argument("--peer-name", default="LT", help="the 'peer' member of the report (%(default)s)")
    return p, p.parse_args(argv)


def run(client, iface: str, peer_ip: str, report_dir: Path, cases, spec_dir=None, peer="LT", reconnect=None,
        log=print):
    """Run cases with a connected AgentClient and a LowerTester on iface; returns (result, catalogue, paths)."""
    from .lt import LowerTester
    from .report import write_all
    from .runner import Runner
    from .spec import Catalogue
    cat = Catalogue(spec_dir)
    with LowerTester(iface) as lt:
        r = Runner(client, lt, peer_ip, report_dir, catalogue=cat, peer=peer, reconnect=reconnect, log=log)
        log(f"IUT {r.hello.get('impl')} {r.hello.get('version')}: {r.hello.get('iut') or '-'}, "
            f"at {r.hello.get('ip')} ({r.hello.get('mac')}), "
            f"claim {r.claim.text()}; {len(cases)} cases")
        res = r.run(cases)
    paths = write_all(res, cat, report_dir)
    return res, cat, paths


def main(argv: list[str] | None = None) -> int:
    p, a = _parse(argv)
    from .registry import select
    cases = select(a.case, a.category, timing=not a.no_timing)
    if a.list:
        try:
            for c in cases:
                print(f"{c.id:<16} {c.category:<5} {','.join(c.rules):<40} {c.title}")
        except BrokenPipeError:               # `--list | head`
            sys.stdout = None
        return 0
    if not cases:
        print("metaroce-conformance: no case matches", file=sys.stderr)
        return 2
    from .report import console
    report_dir = Path(a.report)
    t0 = time.monotonic()
    if a.self_test:
        from .selftest import LT_IP, SelfTest
        report_dir.mkdir(parents=True, exist_ok=True)
        with open(report_dir / "agent-stderr.log", "wb") as alog, SelfTest(agent_log=alog, iut=a.iut) as st:
            with st.enter_tester():
                client = AgentClient(*st.agent_addr, timeout=15)

                def reconnect():
                    with st.enter_tester():
                        return AgentClient(*st.agent_addr, timeout=15)
                try:
                    res, cat, paths = run(client, st.lt_iface, LT_IP, report_dir, cases, a.spec, a.peer_name,
                                          reconnect)
                finally:
                    client.close()
    else:
        if not (a.agent and a.iface and a.peer_ip):
            p.error("give --agent HOST:PORT, --iface and --peer-ip (or --self-test)")
        host, _, port = a.agent.rpartition(":")
        client = AgentClient(host, int(port), timeout=15)
        try:
            res, cat, paths = run(client, a.iface, a.peer_ip, report_dir, cases, a.spec, a.peer_name,
                                  lambda: AgentClient(host, int(port), timeout=15))
        finally:
            client.close()
    print(console(res, cat))
    print(f"reports: {', '.join(str(p) for p in paths.values())} ({time.monotonic() - t0:.1f} s)")
    return exit_code(res, cat, subset=bool(a.case or a.category or a.no_timing))


def exit_code(res, cat, subset: bool) -> int:
    """0 when no verdict is FAIL or ERROR and, for a run of the whole catalogue, the claim is CONFORMANT
    (no applicable MUST rule without a PASS, MR-CONF-025); a run of some cases cannot decide the claim."""
    from .report import summary
    if any(v.verdict in ("FAIL", "ERROR") for v in res.verdicts()):
        return 1
    return 0 if subset or summary(res, cat)["conformance"] == "CONFORMANT" else 1


if __name__ == "__main__":
    sys.exit(main())
