"""The control protocol between metaroced and its clients (docs/daemon.md, "The control socket").

A Unix SOCK_SEQPACKET socket: one message = one UTF-8 JSON object (at most MAX_MSG bytes), with file
descriptors riding along as SCM_RIGHTS.  Requests carry "op" and an "id" the reply echoes; a reply is
{"ok": true, ...} or {"ok": false, "error": "<TypedError>", "message": "..."}; messages with "event"
are unsolicited (asynchronous events: a QP moved to ERR, a CQ overflowed, the daemon stopping).

The typed errors are the verbs errors of metaroce_xdp.verbs_types plus those below; the client raises
the class the reply names.
"""
from __future__ import annotations

import array
import json
import socket

import numpy as np

from ..verbs_types import Busy, InvalidArgument, InvalidState, QueueFull, ResourceError, Unsupported, VerbsError

MAX_MSG = 65536               # a request; replies (status with many QPs) may be larger: MAX_REPLY
MAX_REPLY = 1 << 26
MAX_FDS = 4
MAX_DEPTH = 16                # nesting of arrays and objects in a message; the protocol's deepest is 5 (status)
SO_SNDBUFFORCE = 32           # socket.h; Python does not name it
VERSION = 1


class DaemonError(VerbsError):
    """metaroced refused or failed an operation; the message says why."""


class PermissionDenied(DaemonError):
    """The connecting process is neither root nor in the daemon's socket group (SO_PEERCRED)."""


class DaemonUnavailable(DaemonError):
    """No daemon answers on the socket, or it closed the connection (stopped or restarted)."""


class MalformedRequest(InvalidArgument):
    """The control message is not a JSON object of a known op with fields of the right types."""


class UnknownHandle(InvalidArgument):
    """The handle names no object of this client (never one of another client's)."""


class LimitExceeded(ResourceError):
    """A per-client limit of the daemon's configuration (max_qps_per_client, max_mr_bytes_per_client,
    max_clients) would be exceeded."""


class PathInUse(InvalidArgument):
    """Another live QP on this interface already talks to this remote QP (the same dgid and dest_qp_num): packets
    carry no source QPN, so the peer could not tell the two apart and one QP could write into the other's stream.
    Connect to a QP of your own (connection set-up, spec 06) or destroy the other QP first."""


class InternalError(DaemonError):
    """The daemon failed unexpectedly on this request (logged there); it keeps serving."""


ERRORS: dict[str, type[VerbsError]] = {c.__name__: c for c in (
    VerbsError, InvalidArgument, InvalidState, Busy, QueueFull, ResourceError, DaemonError, PermissionDenied,
    DaemonUnavailable, MalformedRequest, UnknownHandle, LimitExceeded, PathInUse, Unsupported, InternalError)}


def error_reply(e: BaseException, rid=None) -> dict:
    name = type(e).__name__
    if name not in ERRORS:
        # a subclass of ours or of verbs_types (dp.Unsupported, ConfigError, XdpBusy...): its nearest known base
        name = next((c.__name__ for c in type(e).__mro__ if c.__name__ in ERRORS), "InternalError")
    return {"ok": False, "id": rid, "error": name, "message": str(e)}


def raise_error(reply: dict) -> None:
    cls = ERRORS.get(str(reply.get("error")), DaemonError)
    raise cls(str(reply.get("message", "")))


def send(sock: socket.socket, obj: dict, fds: list[int] | tuple = (), limit: int = MAX_MSG) -> None:
    send_bytes(sock, encode(obj, limit), fds)


def encode(obj: dict, limit: int = MAX_MSG) -> bytes:
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > limit:
        raise MalformedRequest(f"message of {len(data)} bytes exceeds {limit}")
    return data


def send_bytes(sock: socket.socket, data: bytes, fds: list[int] | tuple = (), flags: int = 0) -> None:
    """One message (MSG_DONTWAIT in flags: BlockingIOError when the peer's queue is full)."""
    if len(data) > 100_000:
        # one SEQPACKET message must fit the send buffer: grow it (SO_SNDBUFFORCE needs CAP_NET_ADMIN)
        for opt in (SO_SNDBUFFORCE, socket.SO_SNDBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, 2 * len(data) + 65536)
                break
            except OSError:
                continue
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    sock.sendmsg([data], anc, flags)


def nesting(data: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest, counted outside its strings, in linear time and
    without recursion (json.loads recurses: a message of 60,000 '[' raises RecursionError: the
    message must cost its sender only).  Text that is not JSON may give any number; json.loads refuses it."""
    b = np.frombuffer(data, np.uint8)
    if int(np.count_nonzero((b == 0x5B) | (b == 0x7B))) <= MAX_DEPTH:
        return 0                                   # too few openers to nest that deep: the common case
    n = len(b)
    idx = np.arange(n)
    # a quote is escaped when an odd run of backslashes precedes it
    last_plain = np.maximum.accumulate(np.where(b != 0x5C, idx, -1))
    run = np.empty(n, np.int64)
    run[0] = 0
    run[1:] = idx[:-1] - last_plain[:-1]
    quote = (b == 0x22) & (run % 2 == 0)
    inside = (np.cumsum(quote) - quote) % 2 == 1   # after an opening quote, before its closing one
    step = np.where(inside, 0, ((b == 0x5B) | (b == 0x7B)).astype(np.int64) - ((b == 0x5D) | (b == 0x7D)))
    return int(np.cumsum(step).max())


def recv(sock: socket.socket, limit: int = MAX_MSG) -> tuple[dict | None, list[int], str | None]:
    """(message, fds, problem): message None at EOF; problem names why a message is unusable
    (truncated, not JSON, not an object) -- the fds are still returned so the caller closes them.
    With limit > MAX_MSG (the client reading replies) the message's size is peeked first."""
    size = MAX_MSG
    if limit > MAX_MSG:
        size = min(max(sock.recv_into(bytearray(1), 1, socket.MSG_PEEK | socket.MSG_TRUNC), 1), limit)
    data, anc, flags, _ = sock.recvmsg(size, socket.CMSG_SPACE(MAX_FDS * 4))
    fds: list[int] = []
    for level, typ, cdata in anc:
        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(cdata[:len(cdata) - len(cdata) % a.itemsize])
            fds.extend(a)
    if not data and not fds:
        return None, [], None
    if flags & socket.MSG_TRUNC:
        return {}, fds, f"message longer than {size} bytes (truncated)"
    if flags & socket.MSG_CTRUNC:
        return {}, fds, f"more than {MAX_FDS} file descriptors"
    # requests (at most MAX_MSG) are checked before parsing; a reply of the daemon to its client may be MiBs
    # (status), and json.loads' RecursionError below still bounds it
    depth = nesting(data) if len(data) <= MAX_MSG else 0
    if depth > MAX_DEPTH:
        return {}, fds, f"arrays and objects nested {depth} deep (at most {MAX_DEPTH})"
    try:
        obj = json.loads(data.decode())
    except (UnicodeDecodeError, ValueError) as e:
        return {}, fds, f"not a JSON message: {e}"
    except RecursionError:                         # nesting() missed it: still this message's problem only
        return {}, fds, f"arrays and objects nested deeper than {MAX_DEPTH}"
    if not isinstance(obj, dict):
        return {}, fds, "a message must be a JSON object"
    return obj, fds, None
