"""The test agent's protocol (spec 09-conformance.md section 9.4, MR-CONF-013 to MR-CONF-023), one copy for
the two agents and the tester.

    metaroce_xdp/agent.py                    the agent of our implementation (agent_iut.py: in process, metaroced)
    metaroce_xdp/conformance/pyverbs_agent.py   the agent of any rdma-core device (Linux Soft-RoCE, RDMA NICs)
    AgentClient                              the tester's end (conformance/cli.py, runner.py)

What is here: the constants of the protocol (version, port, line and size limits, error codes, the names of
libibverbs values that requests and responses carry), the errors (AgentError), the decoding of a request's
arguments (MR-CONF-018), the framing of a session (Session: a JSON line in, one line out, hello first;
serve_lines: the line rules of MR-CONF-014) and the TCP server around it (AgentServer), and the client.
What each agent adds is its commands: `cmd_<name>(args)` methods of a Session subclass.

Standard library only, and nothing of the package: it runs where the package is not installed, beside
pyverbs_agent.py (tools/rxe_conformance.py copies both onto the Soft-RoCE VM's share).
"""
from __future__ import annotations

import errno
import ipaddress
import json
import logging
import re
import socket
import socketserver
import threading
import time
from typing import Any, Callable

PROTO = 1                          # hello's proto (MR-CONF-015)
DEFAULT_PORT = 18516
MAX_LINE = 1 << 20                 # MR-CONF-014: a line, including its line feed
MAX_MEM_IO = 65536                 # mem_read / mem_write limit of the command table
MAX_MR_LEN = 1 << 30               # a larger reg_mr is ENOMEM (not an exhausted host; pyverbs: a C int offset)
MAX_CQE = 1 << 20
MAX_WR = 1 << 16
MAX_POLL = 4096
MAX_TIMEOUT_MS = 600_000
U64 = (1 << 64) - 1

# MR-CONF-023: the codes of section 9.4.3 and no others; an errno names its code where one fits.
CODES = ("EPROTO", "ENOCMD", "EINVAL", "ENOENT", "EBUSY", "ENOMEM", "ESTATE", "EAGAIN", "ENOTSUP", "EACCES",
         "ETIMEDOUT", "EINTERNAL")
ERRNO_CODES = {errno.EINVAL: "EINVAL", errno.ENOMEM: "ENOMEM", errno.EAGAIN: "EAGAIN", errno.EBUSY: "EBUSY",
               errno.ENOENT: "ENOENT", errno.EACCES: "EACCES", errno.ETIMEDOUT: "ETIMEDOUT",
               errno.EOPNOTSUPP: "ENOTSUP", errno.ENOTSUP: "ENOTSUP"}
TOO_LONG = (b'{"id":null,"ok":false,"error":{"code":"EPROTO",'
            b'"message":"line longer than 1 MiB: closing the session"}}\n')

# The values requests and responses carry by name (MR-CONF-018): libibverbs' names and numbers (verbs.h,
# a stable ABI; metaroce_xdp/verbs_types.py has the same as enums, tests/conformance/test_conformance_agent.py compares).
ACCESS = {"LOCAL_WRITE": 1, "REMOTE_WRITE": 2, "REMOTE_READ": 4, "REMOTE_ATOMIC": 8}
SEND_FLAGS = {"FENCE": 1, "SIGNALED": 2, "SOLICITED": 4, "INLINE": 8}
QP_STATES = {"RESET": 0, "INIT": 1, "RTR": 2, "RTS": 3, "SQD": 4, "SQE": 5, "ERR": 6}
QP_STATE_NAMES = {v: k for k, v in QP_STATES.items()}
WR_OPCODES = {"RDMA_WRITE": 0, "RDMA_WRITE_WITH_IMM": 1, "SEND": 2, "SEND_WITH_IMM": 3, "RDMA_READ": 4,
              "ATOMIC_CMP_AND_SWP": 5, "ATOMIC_FETCH_AND_ADD": 6, "SEND_WITH_INV": 9}
WC_STATUS = ("SUCCESS", "LOC_LEN_ERR", "LOC_QP_OP_ERR", "LOC_EEC_OP_ERR", "LOC_PROT_ERR", "WR_FLUSH_ERR",
             "MW_BIND_ERR", "BAD_RESP_ERR", "LOC_ACCESS_ERR", "REM_INV_REQ_ERR", "REM_ACCESS_ERR", "REM_OP_ERR",
             "RETRY_EXC_ERR", "RNR_RETRY_EXC_ERR", "LOC_RDD_VIOL_ERR", "REM_INV_RD_REQ_ERR", "REM_ABORT_ERR",
             "INV_EECN_ERR", "INV_EEC_STATE_ERR", "FATAL_ERR", "RESP_TIMEOUT_ERR", "GENERAL_ERR",
             "TM_ERR", "TM_RNDV_INCOMPLETE")
WC_OPCODES = {0: "SEND", 1: "RDMA_WRITE", 2: "RDMA_READ", 3: "COMP_SWAP", 4: "FETCH_ADD", 5: "BIND_MW",
              6: "LOCAL_INV", 7: "TSO", 128: "RECV", 129: "RECV_RDMA_WITH_IMM"}
PROFILES = ("compat", "native")
# 06-connection.md 6.3: the capability bits hello's `caps` claims
CAP_IPV6, CAP_ATOMICS = 0x40, 0x80
# 06-connection.md 6.3: the native capability bits (the claim of a native IUT, MR-CONF-003)
CAP_NATIVE, CAP_SACK, CAP_OOO, CAP_MULTIPATH, CAP_CC_DELAY, CAP_CREDITS = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
CAP_NAMES = {"NATIVE": CAP_NATIVE, "SACK": CAP_SACK, "OOO_PLACEMENT": CAP_OOO, "MULTIPATH": CAP_MULTIPATH,
             "CC_DELAY": CAP_CC_DELAY, "CREDITS": CAP_CREDITS, "IPV6": CAP_IPV6, "ATOMICS": CAP_ATOMICS}


class AgentError(Exception):
    """An error response: `code` from section 9.4.3, `message` for the reader."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# ---- values (MR-CONF-018) ---------------------------------------------------------------
def gid_of(ip: str) -> str:
    """An IP address as a GID of 32 hex digits (IPv4 mapped as ::ffff:a.b.c.d)."""
    a = ipaddress.ip_address(ip)
    if a.version == 4:
        a = ipaddress.IPv6Address("::ffff:" + ip)
    return a.packed.hex()


def ip_of_gid(gid: str) -> str:
    """The inverse of gid_of: the IP address text of a GID of 32 hex digits."""
    a = ipaddress.IPv6Address(bytes.fromhex(gid))
    return str(a.ipv4_mapped) if a.ipv4_mapped is not None else str(a)


def hex64(n: int) -> str:
    return f"{n:#x}"


def flag_names(bits: int, table: dict) -> list:
    return [k for k, v in table.items() if bits & v]


# ---- a request's arguments (MR-CONF-018): each decoder refuses what does not fit -----------------
MISSING = object()
HEX = re.compile(r"[0-9a-fA-F]*")
MAC = re.compile(r"[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}")


def get(args: dict, name: str, default: Any = MISSING) -> Any:
    """args[name]; absent or null: `default`, or EPROTO when there is none."""
    v = args.get(name, MISSING)
    if v is MISSING or v is None:
        if default is MISSING:
            raise AgentError("EPROTO", f"missing member args.{name}")
        return default
    return v


def get_int(args: dict, name: str, lo: int, hi: int, default: Any = MISSING) -> int:
    v = get(args, name, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise AgentError("EINVAL", f"{name} must be an integer, not {v!r}")
    if not lo <= v <= hi:
        raise AgentError("EINVAL", f"{name} {v} is outside {lo}..{hi}")
    return v


def get_u64(args: dict, name: str, default: Any = MISSING) -> int:
    """A 64-bit quantity: "0x" and hex digits (a plain JSON integer is accepted too)."""
    v = get(args, name, default)
    if isinstance(v, int) and not isinstance(v, bool):
        n = v
    elif isinstance(v, str) and v[:2] in ("0x", "0X") and len(v) > 2 and HEX.fullmatch(v[2:]):
        n = int(v, 16)
    else:
        raise AgentError("EINVAL", f"{name} must be a string 0x<hex>, not {v!r}")
    if not 0 <= n <= U64:
        raise AgentError("EINVAL", f"{name} {v} does not fit in 64 bits")
    return n


def get_bytes(args: dict, name: str) -> bytes:
    v = get(args, name)
    if not isinstance(v, str) or len(v) % 2 or not HEX.fullmatch(v):
        raise AgentError("EINVAL", f"{name} must be a string of hex byte pairs")
    return bytes.fromhex(v)


def get_enum(args: dict, name: str, choices, default: Any = MISSING) -> str:
    """One of `choices` (names; a dict: its keys)."""
    v = get(args, name, default)
    if not isinstance(v, str) or v not in choices:
        raise AgentError("EINVAL", f"{name} {v!r}: use one of {sorted(choices)}")
    return v


def get_obj(args: dict, name: str, default: Any = MISSING) -> dict:
    v = get(args, name, default)
    if not isinstance(v, dict):
        raise AgentError("EINVAL", f"{name} must be an object")
    return v


def get_list(args: dict, name: str, default: Any = MISSING) -> list:
    v = get(args, name, default)
    if not isinstance(v, list):
        raise AgentError("EINVAL", f"{name} must be a list")
    return v


def get_flags(args: dict, name: str, table: dict, default: Any = MISSING) -> int:
    """A list of flag names of `table` (e.g. ACCESS, SEND_FLAGS) -> their bits."""
    out = 0
    for n in get_list(args, name, default):
        if not isinstance(n, str) or n not in table:
            raise AgentError("EINVAL", f"{name}: unknown flag {n!r}; use {list(table)}")
        out |= table[n]
    return out


def get_wrs(args: dict) -> list:
    """post_send / post_recv: `wrs` (a list) or `wr` (one), each an object."""
    wrs = get_list(args, "wrs") if "wrs" in args else [get_obj(args, "wr")]
    if not wrs:
        raise AgentError("EINVAL", "wrs is empty")
    if not all(isinstance(w, dict) for w in wrs):
        raise AgentError("EINVAL", "every work request is an object")
    return wrs


def check_hello(args: dict) -> None:
    """hello's proto is this protocol's (MR-CONF-015)."""
    proto = get_int(args, "proto", 0, 1 << 31)
    if proto != PROTO:
        raise AgentError("EPROTO", f"this agent speaks proto {PROTO}, not {proto}")


# ---- a session --------------------------------------------------------------------------------
def response(rid: Any, result: dict | None = None, error: AgentError | None = None) -> dict:
    """MR-CONF-016's two shapes: {"id", "ok": true, "result"} or {"id", "ok": false, "error": {code, message}};
    an id that is not an integer is answered with null."""
    rid = rid if isinstance(rid, int) and not isinstance(rid, bool) else None
    if error is not None:
        return {"id": rid, "ok": False, "error": {"code": error.code, "message": error.message}}
    return {"id": rid, "ok": True, "result": result or {}}


def encode(resp: dict) -> bytes:
    return (json.dumps(resp, separators=(",", ":")) + "\n").encode()


class Session:
    """One agent session: handle_line(bytes) -> bytes, which never raises.  A subclass brings the commands
    (`cmd_<name>(args) -> dict | None`, the names of 9.4.2), `call(cmd, fn, args)` to run one and name the
    implementation's failures (MR-CONF-023), and `reset()` (MR-CONF-021).  The first request of a session is
    hello (MR-CONF-017); its command sets `greeted`.  `bye` sets `closing`: the server closes after the reply.
    Handles are numbered from 1 per kind and session (_new_handle, _lookup; reset starts them again)."""

    HANDLE_KINDS = ("pd", "mr", "cq", "qp")

    def __init__(self) -> None:
        self.greeted = False
        self.closing = False
        self._next = dict.fromkeys(self.HANDLE_KINDS, 1)
        self.commands: dict[str, Callable[[dict], Any]] = {
            name[4:]: getattr(self, name) for name in dir(type(self)) if name.startswith("cmd_")}

    def _new_handle(self, kind: str) -> int:
        h = self._next[kind]
        self._next[kind] = h + 1
        return h

    def _lookup(self, table: dict, kind: str, args: dict, name: str | None = None) -> tuple[int, Any]:
        """(handle, object) of the handle args[name or kind] in `table`: ENOENT when this session has none."""
        h = get_int(args, name or kind, -(1 << 63), 1 << 63)
        obj = table.get(h)
        if obj is None:
            raise AgentError("ENOENT", f"no {kind} handle {h} in this session")
        return h, obj

    def _restart_handles(self) -> None:
        self._next = dict.fromkeys(self.HANDLE_KINDS, 1)

    def handle_line(self, line: bytes) -> bytes:
        """One request line -> one response line (with its line feed)."""
        req_id = None
        try:
            try:
                req = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as e:
                raise AgentError("EPROTO", f"not a JSON line: {e}") from None
            if not isinstance(req, dict):
                raise AgentError("EPROTO", "a request is a JSON object")
            req_id = req.get("id")
            resp = self.handle(req)
        except AgentError as e:
            resp = response(req_id, error=e)
        return encode(resp)

    def handle(self, req: dict) -> dict:
        rid = req.get("id")
        try:
            if isinstance(rid, bool) or not isinstance(rid, int):
                raise AgentError("EPROTO", "member id must be an integer")
            cmd, args = req.get("cmd"), req.get("args")
            if not isinstance(cmd, str):
                raise AgentError("EPROTO", "member cmd must be a string")
            if not isinstance(args, dict):
                raise AgentError("EPROTO", "member args must be an object")
            if not self.greeted and cmd != "hello":
                raise AgentError("EPROTO", f"{cmd} before hello: the first request of a session is hello")
            fn = self.commands.get(cmd)
            if fn is None:
                raise AgentError("ENOCMD", f"unknown command {cmd!r}")
            return response(rid, self.call(cmd, fn, args))
        except AgentError as e:
            if e.code not in CODES:                 # a bug of the agent's, not the tester's
                e = AgentError("EINTERNAL", f"{e.code}: {e.message}")
            return response(rid, error=e)

    def call(self, cmd: str, fn: Callable[[dict], Any], args: dict) -> Any:
        return fn(args)

    def cmd_bye(self, args: dict) -> None:
        self.closing = True

    def reset(self) -> None:
        pass


def serve_lines(rfile, write: Callable[[bytes], None], session: Session, stopping: Callable[[], bool]) -> None:
    """A session's lines from rfile, each answered through write(), until the end of the stream, bye, a line
    longer than MAX_LINE (answered EPROTO, then the session closes: MR-CONF-014) or stopping().  Empty lines
    are skipped; a last line without its line feed is not a request."""
    while not stopping():
        line = rfile.readline(MAX_LINE)
        if not line:
            break
        if not line.endswith(b"\n"):
            if len(line) >= MAX_LINE:
                write(TOO_LONG)
            break
        if not line.strip():
            continue
        write(session.handle_line(line))
        if session.closing:
            break


# ---- the agent's TCP server (MR-CONF-013) ---------------------------------------------------------
class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        owner = self.server.owner
        session = owner.new_session()
        peer = "%s:%s" % self.client_address[:2]
        owner.log.info("agent session from %s opened", peer)          # MR-SEC-027: log every session
        owner._sessions_add(self.connection)
        try:
            serve_lines(self.rfile, self._send, session, lambda: owner.closing)
        except (ConnectionError, OSError) as e:
            owner.log.info("agent session from %s: %s", peer, e)
        finally:
            session.reset()                                  # a vanished tester leaves nothing behind
            owner._sessions_discard(self.connection)
            owner.log.info("agent session from %s closed", peer)

    def _send(self, data: bytes) -> None:
        self.wfile.write(data)
        self.wfile.flush()


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class _TCPServer6(_TCPServer):
    address_family = socket.AF_INET6


class AgentServer:
    """An agent's TCP listener: one session per connection, each on its thread (new_session() makes it).
    Off unless started, and bound only to the address it is given (MR-SEC-027).

        srv = Sub(..., host, 0).start(); host, port = srv.address; ...; srv.close()
    """

    log = logging.getLogger("metaroce.agent")

    def __init__(self, host: str, port: int = DEFAULT_PORT) -> None:
        self.closing = False
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._thread: threading.Thread | None = None
        self._serving = False
        server_cls = _TCPServer6 if ":" in host else _TCPServer
        self._srv = server_cls((host, port), _Handler)
        self._srv.owner = self

    def new_session(self) -> Session:
        raise NotImplementedError

    @property
    def address(self) -> tuple[str, int]:
        return self._srv.server_address[:2]

    def start(self) -> "AgentServer":
        """Serve on a thread of its own."""
        self._serving = True
        self._thread = threading.Thread(target=self._srv.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="metaroce-agent", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._serving = True
        self._srv.serve_forever(poll_interval=0.1)

    def _sessions_add(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.add(conn)

    def _sessions_discard(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.discard(conn)

    def sessions(self) -> int:
        with self._lock:
            return len(self._conns)

    def close(self) -> None:
        """Stop listening and end every session (each resets its resources on the way out)."""
        if self.closing:
            return
        self.closing = True
        if self._serving:                  # shutdown() blocks forever on a server never served
            self._srv.shutdown()
        self._srv.server_close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)
        deadline = time.monotonic() + 2.0      # let the sessions finish their reset
        while self.sessions() and time.monotonic() < deadline:
            time.sleep(0.01)

    def __enter__(self) -> "AgentServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- the tester's end ---------------------------------------------------------------------------
class AgentClient:
    """The upper tester's end: `call(cmd, **args) -> result`, AgentError on an error response."""

    def __init__(self, host: str, port: int = DEFAULT_PORT, timeout: float = 10.0) -> None:
        self.timeout = timeout
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.rfile = self.sock.makefile("rb")
        self._id = 0

    def request(self, cmd: str, args: dict | None = None) -> dict:
        """Send one request, return the whole response object."""
        self._id += 1
        line = json.dumps({"id": self._id, "cmd": cmd, "args": args or {}}, separators=(",", ":"))
        wait = self.timeout + (args or {}).get("timeout_ms", 0) / 1000
        resp = self.send_raw(line.encode() + b"\n", timeout=wait)
        if resp.get("id") != self._id:
            raise AgentError("EPROTO", f"response id {resp.get('id')!r} to request {self._id}")
        return resp

    def call(self, cmd: str, **args) -> dict:
        resp = self.request(cmd, args)
        if not resp.get("ok"):
            err = resp.get("error") or {}
            raise AgentError(err.get("code", "EINTERNAL"), err.get("message", ""))
        return resp.get("result", {})

    def send_raw(self, data: bytes, timeout: float | None = None) -> dict:
        """Send bytes as they are and read one response line (tests of the framing)."""
        self.sock.settimeout(timeout or self.timeout)
        self.sock.sendall(data)
        line = self.rfile.readline(MAX_LINE + 1)
        if not line:
            raise ConnectionError("the agent closed the session")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.rfile.close()
        finally:
            self.sock.close()

    def __enter__(self) -> "AgentClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
