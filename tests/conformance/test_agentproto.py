"""One protocol module for the conformance agents (metaroce_xdp/conformance/agentproto.py, spec 9.4): it imports
the standard library only (it ships beside pyverbs_agent.py to the Soft-RoCE VM, tests/conformance/test_rxe_agent.py runs
the two copied files there), both agents and the tester take the protocol from it and define none of it
themselves, its value names are libibverbs' (verbs_types), and its framing answers as MR-CONF-014..017 say."""
from __future__ import annotations

import ast
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from metaroce_xdp.conformance import agentproto as P

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "metaroce_xdp" / "conformance"
AGENTS = (ROOT / "metaroce_xdp" / "agent.py", CONF / "pyverbs_agent.py")
TESTER = (*sorted(CONF.glob("*.py")), *sorted((CONF / "cases").glob("*.py")), ROOT / "tools" / "rxe_conformance.py")
# what only agentproto defines: its constants, and the names of its classes and decoders
PROTOCOL_NAMES = {"PROTO", "DEFAULT_PORT", "MAX_LINE", "MAX_MEM_IO", "MAX_MR_LEN", "MAX_CQE", "MAX_WR", "MAX_POLL",
                  "MAX_TIMEOUT_MS", "CODES", "ERRNO_CODES", "_ERRNO_CODES", "ACCESS", "SEND_FLAGS", "QP_STATES",
                  "WR_OPCODES", "WC_STATUS", "WC_OPCODES", "CAP_IPV6", "CAP_ATOMICS", "AgentError", "AgentClient",
                  "_Handler", "_TCPServer", "_get", "_int", "_u64", "_bytes", "_enum", "_obj", "_list", "_flags",
                  "_wrs", "handle_line", "handle", "_new_handle", "_lookup"}


def _imports(path: Path) -> tuple[set[str], list[str]]:
    """(top-level modules imported absolutely, modules imported relatively) by a file."""
    tree = ast.parse(path.read_text())
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    rel = [n.module or "." for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
    return mods, rel


def test_the_protocol_module_needs_the_standard_library_only(tmp_path):
    mods, rel = _imports(Path(P.__file__))
    assert not rel and mods <= set(sys.stdlib_module_names), (rel, mods - set(sys.stdlib_module_names))
    # a copy on its own, no site-packages, no environment: it imports, and loads nothing but the stdlib
    shutil.copy(P.__file__, tmp_path)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import agentproto as P; "
            "print(P.PROTO, sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names) - {'__main__'}))")
    run = subprocess.run([sys.executable, "-S", "-I", "-c", code, str(tmp_path)], capture_output=True, text=True,
                         env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, timeout=60)
    assert run.returncode == 0 and run.stdout.split(None, 1) == ["1", "['agentproto']\n"], (run.stdout, run.stderr)


def test_both_agents_and_the_tester_take_the_protocol_from_it():
    from metaroce_xdp import agent as ours
    from metaroce_xdp.conformance import pyverbs_agent as rdma_core
    for mod in (ours, rdma_core):
        assert issubclass(mod.Agent, P.Session) and issubclass(mod.AgentServer, P.AgentServer), mod
    assert rdma_core.P is P and ours.AgentError is P.AgentError and ours.AgentClient is P.AgentClient
    for path in (*AGENTS, *TESTER):
        if path.name == "agentproto.py":
            continue
        tree = ast.parse(path.read_text())
        defined = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        defined |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
        assert not defined & PROTOCOL_NAMES, (path.name, defined & PROTOCOL_NAMES)
        consts = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and type(n.value) is int}
        assert P.DEFAULT_PORT not in consts, f"{path.name}: the agent's port, not DEFAULT_PORT"
        src = path.read_text()
        for dup in ('"EPROTO", "ENOCMD"', "proto=1)", '"proto": 1}', "from ..agent import", "from ...agent import"):
            assert dup not in src, (path.name, dup)
    for path in AGENTS:                     # framing and the server are agentproto's
        mods, _ = _imports(path)
        assert not mods & {"json", "socketserver"}, (path.name, mods & {"json", "socketserver"})


def test_value_names_are_libibverbs():
    from metaroce_xdp import cm
    from metaroce_xdp.verbs_types import Access, QPState, SendFlags, WCOpcode, WCStatus, WROpcode
    assert P.ACCESS == {f.name: int(f) for f in Access}
    assert P.SEND_FLAGS == {f.name: int(f) for f in SendFlags}
    assert P.QP_STATES == {s.name: int(s) for s in QPState}
    assert P.WR_OPCODES == {o.name: int(o) for o in WROpcode}
    assert P.WC_STATUS[:len(WCStatus)] == tuple(s.name for s in WCStatus)
    assert all(P.WC_OPCODES[int(o)] == o.name for o in WCOpcode)
    assert (P.CAP_IPV6, P.CAP_ATOMICS) == (int(cm.Cap.IPV6), int(cm.Cap.ATOMICS))


class _Echo(P.Session):
    def cmd_hello(self, args):
        P.check_hello(args)
        self.greeted = True
        return {"proto": P.PROTO}

    def cmd_echo(self, args):
        return {"n": P.get_int(args, "n", 0, 9), "wrs": len(P.get_wrs(args))}

    def cmd_bad(self, args):
        raise P.AgentError("EWHAT", "not a code of 9.4.3")


def test_session_framing():
    """MR-CONF-014..017 on a session of the module's own: hello first, one line per request with its id (null
    when it has none), ENOCMD, EINTERNAL for a code outside 9.4.3, an over-long line answered and closing."""
    s = _Echo()

    def ask(req) -> dict:
        line = s.handle_line(req if isinstance(req, bytes) else json.dumps(req).encode() + b"\n")
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        return json.loads(line)
    assert ask({"id": 1, "cmd": "echo", "args": {}})["error"]["code"] == "EPROTO"          # before hello
    assert ask({"id": 2, "cmd": "hello", "args": {"proto": 2}})["error"]["code"] == "EPROTO"
    assert ask({"id": 3, "cmd": "hello", "args": {"proto": P.PROTO}}) == {"id": 3, "ok": True, "result": {"proto": 1}}
    assert ask({"id": 4, "cmd": "echo", "args": {"n": 3, "wr": {}}})["result"] == {"n": 3, "wrs": 1}
    assert ask({"id": 5, "cmd": "echo", "args": {"n": 10, "wr": {}}})["error"]["code"] == "EINVAL"
    assert ask({"id": 6, "cmd": "echo", "args": {"n": 1, "wrs": []}})["error"]["code"] == "EINVAL"
    assert ask({"id": 7, "cmd": "nope", "args": {}})["error"]["code"] == "ENOCMD"
    assert ask({"id": 8, "cmd": "bad", "args": {}})["error"]["code"] == "EINTERNAL"
    assert ask({"id": True, "cmd": "echo", "args": {}}) == {
        "id": None, "ok": False, "error": {"code": "EPROTO", "message": "member id must be an integer"}}
    assert ask(b"{not json\n")["id"] is None
    out: list[bytes] = []
    lines = b'{"id":9,"cmd":"echo","args":{"n":1,"wr":{}}}\n\n' + b"x" * P.MAX_LINE + b"\n" + b'{"id":10}\n'
    P.serve_lines(io.BytesIO(lines), out.append, s, lambda: False)
    assert [json.loads(x)["id"] for x in out] == [9, None] and out[1] == P.TOO_LONG     # then closed
    out.clear()
    P.serve_lines(io.BytesIO(b'{"id":11,"cmd":"bye","args":{}}\n{"id":12}\n'), out.append, s, lambda: False)
    assert len(out) == 1 and s.closing
