"""Connection set-up over TCP (spec 06-connection.md, rule area MR-CM).

Two formats, one module:

  * the MetaRoCE Connection Message (MR-CM-003..039): REQ / REP / RTU / REJ, a
    64-byte big-endian fixed part plus TLVs.  `metaroce perf` uses it and carries
    its test parameters (rkey, buffer address, size, iterations, test name) in an
    experimental non-critical TLV holding one JSON object (TLV_PERF_PARAMS);
  * the rdma-core pingpong text message (section 6.7, MR-CM-040..046), so that
    `metaroce pingpong` pairs with `ibv_rc_pingpong`.

This module only frames, validates and exchanges; moving the QP through
INIT/RTR/RTS stays with the caller, which passes a callback where the spec
places the transition (MR-CM-026: the passive side is in RTR/RTS before it
answers).  Neighbours: metaroce_xdp/cli/perf.py and metaroce_xdp/cli/pingpong.py (the callers),
metaroce_xdp/dp/context.py (the QP they connect).
"""
from __future__ import annotations

import enum
import ipaddress
import json
import secrets
import select
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Callable

CM_PORT = 18515                     # MR-CM-001
CM_CONNECT_TIMEOUT = 5.0            # cm_connect_timeout (6.5.3)
CM_TIMEOUT = 5.0                    # cm_timeout (6.5.3)

# --------------------------------------------------------------------------- errors


class CMError(Exception):
    """Connection set-up failed; the message says what was wrong and what to do."""


class ConnectFailed(CMError):
    """The TCP connection to the passive side could not be made."""


class PeerClosed(CMError):
    """The peer closed the TCP connection (or stopped answering) mid-exchange."""


class Rejected(CMError):
    """A REJ was sent or received; `reason` is the MR-CM reason code."""

    def __init__(self, reason: "Reason", text: str = "", *, by_peer: bool) -> None:
        self.reason = reason
        self.text = text
        self.by_peer = by_peer
        who = "the peer rejected the connection" if by_peer else "rejected the peer's message"
        super().__init__(f"{who}: {reason.name}" + (f" ({text})" if text else ""))


# --------------------------------------------------------------------------- GIDs


def ip_to_gid(ip: str) -> bytes:
    """MR-CM-006: the 16 GID bytes for an IP address; IPv4 as ::ffff:a.b.c.d."""
    a = ipaddress.ip_address(ip.removeprefix("::ffff:") if "." in ip else ip)
    if a.version == 4:
        return b"\x00" * 10 + b"\xff\xff" + a.packed
    return a.packed


def gid_to_ip(gid: bytes) -> str:
    """The IP address a GID stands for (IPv4-mapped GIDs as dotted quads)."""
    a = ipaddress.IPv6Address(bytes(gid))
    return str(a.ipv4_mapped) if a.ipv4_mapped else str(a)


def _is_local(a: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """An address of this host (in this network namespace): the kernel lets a socket bind to it."""
    if a.is_loopback:
        return True
    with socket.socket(socket.AF_INET if a.version == 4 else socket.AF_INET6, socket.SOCK_DGRAM) as s:
        try:
            s.bind((str(a), 0))
            return True
        except OSError:
            return False


def address_problem(gid: bytes, tcp_source: str) -> str:
    """MR-SEC-019: '' when a REQ's GID is the address its TCP connection comes from (IPv4 and IPv4-mapped IPv6
    forms compare equal), or when both are addresses of this host (a client on the same host connects from
    loopback or from another of its addresses); else why the REQ must get REJ ADDRESS_MISMATCH.  Without it any
    TCP client could aim a listening QP at a third host (READ responses and WRITEs reflected at a victim)."""
    try:
        src = ipaddress.ip_address(tcp_source.split("%")[0])
    except ValueError:
        return f"the TCP source {tcp_source!r} is not an IP address"
    if isinstance(src, ipaddress.IPv6Address) and src.ipv4_mapped:
        src = src.ipv4_mapped
    claimed = ipaddress.ip_address(gid_to_ip(gid))
    if claimed == src:
        return ""
    if _is_local(src) and _is_local(claimed):
        return ""
    return f"the REQ's GID {gid_text(gid)} is not the address {src} its TCP connection comes from (MR-SEC-019)"


def gid_text(gid: bytes) -> str:
    """The GID as inet_ntop(AF_INET6) prints it (what ibv_rc_pingpong shows)."""
    return socket.inet_ntop(socket.AF_INET6, bytes(gid))


def gid_to_wire(gid: bytes) -> str:
    """rdma-core pingpong.c gid_to_wire_gid: four 32-bit words, each printed as
    %08x after htonl.  On any host that is the 16 bytes in order, lowercase hex."""
    return "".join("%08x" % struct.unpack_from("!I", gid, 4 * i)[0] for i in range(4))


def wire_to_gid(text: str) -> bytes:
    """Inverse of gid_to_wire (pingpong.c wire_gid_to_gid)."""
    if len(text) != 32:
        raise ValueError(f"wire GID must be 32 hex digits, got {len(text)}")
    return b"".join(struct.pack("!I", int(text[8 * i:8 * i + 8], 16)) for i in range(4))


# --------------------------------------------------------------------------- TCP channel


class Channel:
    """A TCP connection with exact reads, deadlines and newline-framed JSON (for
    what the tools say to each other after the exchange: results, sync)."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self._buf = b""

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError as e:
            raise PeerClosed(f"sending to {self.peer}: {e.strerror or e}") from None

    def recv_exact(self, n: int, timeout: float | None = CM_TIMEOUT) -> bytes:
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self._buf) < n:
            self._fill(deadline, f"{n} bytes")
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def recv_some(self, n: int, timeout: float | None = CM_TIMEOUT) -> bytes:
        """Like read(2): whatever arrives first, at most n bytes (>= 1)."""
        if not self._buf:
            self._fill(None if timeout is None else time.monotonic() + timeout, "data")
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def _fill(self, deadline: float | None, what: str) -> None:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([self.sock], [], [], left)[0]:
            raise PeerClosed(f"{self.peer} sent no {what} within the set-up timeout")
        try:
            chunk = self.sock.recv(65536)
        except OSError as e:
            raise PeerClosed(f"reading from {self.peer}: {e.strerror or e}") from None
        if not chunk:
            raise PeerClosed(f"{self.peer} closed the connection")
        self._buf += chunk

    def send_json(self, obj: dict) -> None:
        self.send(json.dumps(obj, separators=(",", ":")).encode() + b"\n")

    def recv_json(self, timeout: float | None = CM_TIMEOUT) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            self._fill(deadline, "line")
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            raise CMError(f"{self.peer} sent a malformed line: {line[:60]!r}") from None

    def poll_json(self) -> dict | None:
        """A complete line if one is waiting, without blocking; PeerClosed on EOF."""
        if b"\n" not in self._buf and select.select([self.sock], [], [], 0)[0]:
            self._fill(time.monotonic(), "line")
        if b"\n" in self._buf:
            return self.recv_json(0)
        return None

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def connect(host: str, port: int = CM_PORT, timeout: float = CM_CONNECT_TIMEOUT) -> Channel:
    """Active side: TCP connect, bounded by cm_connect_timeout."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ConnectFailed(f"cannot resolve {host!r}: {e.strerror}") from None
    last: OSError | None = None
    for fam, typ, proto, _, addr in infos:
        s = socket.socket(fam, typ, proto)
        s.settimeout(timeout)
        try:
            s.connect(addr)
        except OSError as e:
            last = e
            s.close()
            continue
        s.settimeout(None)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return Channel(s, f"{host}:{port}")
    why = "timed out" if isinstance(last, socket.timeout) else (last.strerror if last else "no address")
    raise ConnectFailed(f"cannot connect to {host}:{port}: {why} -- is the server side running "
                        f"and listening on port {port}?")


class Listener:
    """Passive side: a listening TCP socket on every address (dual stack when possible)."""

    def __init__(self, port: int = CM_PORT) -> None:
        try:
            if socket.has_dualstack_ipv6():
                try:
                    self.sock = socket.create_server(("", port), family=socket.AF_INET6, reuse_port=False,
                                                     dualstack_ipv6=True)
                except OSError:     # IPv6 disabled in this namespace: IPv4 only
                    self.sock = socket.create_server(("", port))
            else:
                self.sock = socket.create_server(("", port))
        except OSError as e:
            raise CMError(f"cannot listen on TCP port {port}: {e.strerror} -- choose another with -p") from None
        self.port = port

    def accept(self, timeout: float | None = None) -> Channel:
        if not select.select([self.sock], [], [], timeout)[0]:
            raise CMError(f"no client connected to port {self.port} within {timeout:g}s")
        s, addr = self.sock.accept()
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        host = addr[0].removeprefix("::ffff:")
        return Channel(s, host)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# =========================================================================== pingpong format
# Section 6.7: "%04x:%06x:%06x:%s" with a 32-digit wire GID, sent with its NUL.
PP_MSG_LEN = len("0000:000000:000000:" + "0" * 32) + 1      # 52 bytes (MR-CM-041)
PP_DONE = b"done\x00"                                         # 5 bytes (MR-CM-043)
# MR-CM-044: the fixed QP attributes of ibv_rc_pingpong
PP_ATTRS = {"max_dest_rd_atomic": 1, "min_rnr_timer": 12, "timeout": 14, "retry_cnt": 7, "rnr_retry": 7,
            "max_rd_atomic": 1}


@dataclass
class PingpongDest:
    """struct pingpong_dest of rc_pingpong.c."""
    lid: int
    qpn: int
    psn: int
    gid: bytes = bytes(16)


def pp_encode(d: PingpongDest) -> bytes:
    """MR-CM-041: exactly 52 bytes, lowercase hex, NUL-terminated."""
    if not (0 <= d.lid <= 0xFFFF and 0 <= d.qpn < 1 << 24 and 0 <= d.psn < 1 << 24 and len(d.gid) == 16):
        raise ValueError(f"pingpong fields out of range: {d}")
    msg = ("%04x:%06x:%06x:%s" % (d.lid, d.qpn, d.psn, gid_to_wire(d.gid))).encode() + b"\x00"
    assert len(msg) == PP_MSG_LEN
    return msg


def pp_decode(msg: bytes) -> PingpongDest:
    """MR-CM-042: hex fields separated by colons (sscanf "%x:%x:%x:%s")."""
    text = msg.split(b"\x00", 1)[0].decode("ascii", "replace")
    parts = text.split(":")
    try:
        if len(parts) != 4:
            raise ValueError("expected LID:QPN:PSN:GID")
        lid, qpn, psn = (int(p, 16) for p in parts[:3])
        gid = wire_to_gid(parts[3])
    except ValueError as e:
        raise CMError(f"malformed pingpong message {text[:60]!r}: {e}") from None
    return PingpongDest(lid, qpn & 0xFFFFFF, psn & 0xFFFFFF, gid)


def pp_client_exchange(ch: Channel, mine: PingpongDest, timeout: float = CM_TIMEOUT) -> PingpongDest:
    """Client role (MR-CM-043): write ours, read theirs, write "done".  The caller
    moves the QP to RTR/RTS afterwards, as rc_pingpong does."""
    ch.send(pp_encode(mine))
    theirs = pp_decode(ch.recv_exact(PP_MSG_LEN, timeout))
    ch.send(PP_DONE)
    return theirs


def pp_server_exchange(ch: Channel, mine: PingpongDest, connect_qp: Callable[[PingpongDest], None],
                       timeout: float = CM_TIMEOUT) -> PingpongDest:
    """Server role (MR-CM-043/045): read theirs, connect_qp(theirs) (RTR and RTS),
    write ours, read the 5-byte "done"."""
    theirs = pp_decode(ch.recv_exact(PP_MSG_LEN, timeout))
    connect_qp(theirs)
    ch.send(pp_encode(mine))
    ack = ch.recv_some(PP_MSG_LEN, timeout)       # rc_pingpong reads up to 52, expects 5
    if len(ack) != len(PP_DONE):
        raise CMError(f"expected the 5-byte \"done\" from {ch.peer}, got {len(ack)} bytes")
    return theirs


# =========================================================================== MetaRoCE Connection Message
MAGIC = b"MRC1"
VERSION = 1
FIXED_LEN = 64
MAX_LEN = 4096
_FIXED = struct.Struct("!4sBBHHHI16sIIBBBBBBBBH6sHBBI")
assert _FIXED.size == FIXED_LEN


class MsgType(enum.IntEnum):
    REQ = 1
    REP = 2
    RTU = 3
    REJ = 4


class Reason(enum.IntEnum):
    """6.6: REJ reason codes (never renumbered)."""
    NONE = 0
    UNSUPPORTED_VERSION = 1
    MALFORMED = 2
    NATIVE_REQUIRED = 3
    INVALID_PARAM = 4
    NO_RESOURCES = 5
    UNSUPPORTED_TLV = 6
    UNEXPECTED_MESSAGE = 7
    CONSUMER_REJECT = 8
    ADDRESS_MISMATCH = 9
    TIMEOUT = 10


class Cap(enum.IntFlag):
    """6.3: capability bits."""
    NATIVE = 0x01
    SACK = 0x02
    OOO_PLACEMENT = 0x04
    MULTIPATH = 0x08
    CC_DELAY = 0x10
    CREDITS = 0x20
    IPV6 = 0x40
    ATOMICS = 0x80


NATIVE_SET = Cap.NATIVE | Cap.SACK | Cap.OOO_PLACEMENT | Cap.MULTIPATH | Cap.CC_DELAY | Cap.CREDITS
FLAG_COMPAT_OK = 0x0001

TLV_IMPL_NAME = 0x0001
TLV_SUPPORTED_VERSIONS = 0x0002
TLV_REJECT_TEXT = 0x0003
TLV_NATIVE_TIMING = 0x0004
TLV_PERF_PARAMS = 0x7F00            # experimental, non-critical: one JSON object (metaroce perf)
TLV_CRITICAL = 0x8000
KNOWN_TLVS = {TLV_IMPL_NAME, TLV_SUPPORTED_VERSIONS, TLV_REJECT_TEXT, TLV_NATIVE_TIMING, TLV_PERF_PARAMS}

MTU_ENUM = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}
MTU_BYTES = {v: k for k, v in MTU_ENUM.items()}
IMPL_NAME = "metaroce-ref"


@dataclass
class CMMsg:
    """One connection message; fields as in the table of 6.2."""
    msg_type: MsgType
    cookie: int = 0
    flags: int = FLAG_COMPAT_OK
    reason: Reason = Reason.NONE
    capabilities: int = 0
    gid: bytes = bytes(16)
    qpn: int = 0
    psn: int = 0
    path_mtu: int = 3
    max_rd_atomic: int = 1
    max_dest_rd_atomic: int = 1
    min_rnr_timer: int = 12
    timeout: int = 14
    retry_cnt: int = 7
    rnr_retry: int = 7
    entropy_count: int = 1
    sack_window: int = 0
    mac: bytes = bytes(6)
    p_key: int = 0xFFFF
    dscp: int = 26
    version: int = VERSION
    tlvs: list[tuple[int, bytes]] = field(default_factory=list)

    # -- convenience ---------------------------------------------------------------
    def tlv(self, t: int) -> bytes | None:
        return next((v for k, v in self.tlvs if k == t), None)

    @property
    def perf(self) -> dict:
        v = self.tlv(TLV_PERF_PARAMS)
        return json.loads(v) if v else {}

    @property
    def mtu_bytes(self) -> int:
        return MTU_BYTES.get(self.path_mtu, 0)

    @property
    def mac_text(self) -> str:
        return ":".join("%02x" % b for b in self.mac)

    # -- codec (MR-CM-003, MR-CM-010) -----------------------------------------------------
    def encode(self) -> bytes:
        tl = b"".join(struct.pack("!HH", t, len(v)) + v for t, v in self.tlvs)
        total = FIXED_LEN + len(tl)
        if total > MAX_LEN:
            raise ValueError(f"connection message of {total} bytes exceeds {MAX_LEN}")
        body = self.msg_type in (MsgType.REQ, MsgType.REP)
        z = (lambda v: v) if body else (lambda v: 0)
        fixed = _FIXED.pack(
            MAGIC, self.version, int(self.msg_type), self.flags if body else 0, total,
            int(self.reason) if self.msg_type == MsgType.REJ else 0,
            z(self.capabilities), self.gid if body else bytes(16), z(self.qpn) & 0xFFFFFF,
            z(self.psn) & 0xFFFFFF, z(self.path_mtu), z(self.max_rd_atomic), z(self.max_dest_rd_atomic),
            z(self.min_rnr_timer), z(self.timeout), z(self.retry_cnt), z(self.rnr_retry), z(self.entropy_count),
            z(self.sack_window), self.mac if body else bytes(6), z(self.p_key), z(self.dscp), 0, self.cookie)
        return fixed + tl

    @classmethod
    def decode(cls, data: bytes) -> "CMMsg":
        """Parse and validate one whole message; Rejected(by_peer=False) says which REJ to send."""
        if len(data) < 10 or data[:4] != MAGIC:
            raise CMError("not a MetaRoCE connection message (bad magic)")      # MR-CM-004: close, no reply
        version, mtype, total = data[4], data[5], struct.unpack_from("!H", data, 8)[0]
        if version != VERSION:
            raise Rejected(Reason.UNSUPPORTED_VERSION, f"version {version}", by_peer=False)
        if not FIXED_LEN <= total <= MAX_LEN or total != len(data):
            raise Rejected(Reason.MALFORMED, f"total_len {total}", by_peer=False)
        (_, _, _, flags, _, reason, caps, gid, qpn, psn, mtu, rd, drd, rnr_t, tmo, retry, rnr_r, ent, sackw, mac,
         pkey, dscp, _, cookie) = _FIXED.unpack_from(data)
        try:
            mtype = MsgType(mtype)
        except ValueError:
            raise Rejected(Reason.UNEXPECTED_MESSAGE, f"msg_type {mtype}", by_peer=False) from None
        tlvs, off = [], FIXED_LEN
        while off < total:                                                   # MR-CM-011
            if off + 4 > total:
                raise Rejected(Reason.MALFORMED, "TLV header past total_len", by_peer=False)
            t, n = struct.unpack_from("!HH", data, off)
            if off + 4 + n > total:
                raise Rejected(Reason.MALFORMED, f"TLV {t:#06x} runs past total_len", by_peer=False)
            if t & TLV_CRITICAL and t not in KNOWN_TLVS:                      # MR-CM-012
                raise Rejected(Reason.UNSUPPORTED_TLV, f"critical TLV {t:#06x}", by_peer=False)
            tlvs.append((t, bytes(data[off + 4:off + 4 + n])))
            off += 4 + n
        m = cls(mtype, cookie, flags, Reason.NONE, caps, gid, qpn, psn, mtu, rd, drd, rnr_t, tmo, retry, rnr_r, ent,
                sackw, mac, pkey, dscp, version, tlvs)
        if mtype == MsgType.REJ:
            try:
                m.reason = Reason(reason)
            except ValueError:
                m.reason = Reason.NONE
        if mtype in (MsgType.REQ, MsgType.REP):
            m.validate()
        return m

    def validate(self) -> None:
        """MR-CM-005/007/008: field ranges of a REQ or REP."""
        def bad(what: str, reason: Reason = Reason.INVALID_PARAM):
            raise Rejected(reason, what, by_peer=False)
        if self.qpn >> 24 or self.psn >> 24:
            bad("bits 31-24 of qpn/psn set", Reason.MALFORMED)
        if self.qpn in (0, 1):
            bad(f"qpn {self.qpn}")
        if self.path_mtu not in MTU_BYTES:
            bad(f"path_mtu {self.path_mtu}")
        if self.min_rnr_timer > 31 or self.timeout > 31:
            bad("min_rnr_timer/timeout above 31")
        if self.retry_cnt > 7 or self.rnr_retry > 7:
            bad("retry_cnt/rnr_retry above 7")
        if self.entropy_count == 0:
            bad("entropy_count 0")
        if self.sack_window and (self.sack_window % 32 or not 32 <= self.sack_window <= 1024):
            bad(f"sack_window {self.sack_window}")
        if self.capabilities & Cap.SACK and not self.sack_window:
            bad("SACK offered with sack_window 0")


def read_msg(ch: Channel, timeout: float = CM_TIMEOUT) -> CMMsg:
    """6.2: read 10 bytes, check magic/version/total_len, then read the rest."""
    head = ch.recv_exact(10, timeout)
    if head[:4] != MAGIC:
        raise CMError(f"{ch.peer} does not speak the MetaRoCE connection message (got {head[:4]!r})")
    total = struct.unpack_from("!H", head, 8)[0]
    if not FIXED_LEN <= total <= MAX_LEN:
        raise Rejected(Reason.MALFORMED, f"total_len {total}", by_peer=False)
    return CMMsg.decode(head + ch.recv_exact(total - 10, timeout))


def peer_timing(msg: CMMsg) -> int | None:
    """The ack_coalesce_us of the peer's NATIVE_TIMING TLV (6.3: ack_coalesce_us u16, ack_coalesce_pkts u16,
    rto_min_us u32), within 04 section 4.7's 1-100 us; None when it announced none: the default 5 us then
    (MR-CC-040, the native parameter t_peer).  This implementation's endpoints announce none: their
    ack_coalesce_us is the default."""
    v = msg.tlv(TLV_NATIVE_TIMING)
    if v is None or len(v) < 2:
        return None
    return min(100, max(1, int.from_bytes(v[:2], "big")))


def agree_caps(req_caps: int, local_caps: int) -> int:
    """MR-CM-014: the passive side's agreed capability set."""
    agreed = req_caps & local_caps & 0xFF
    if not (agreed & Cap.NATIVE and agreed & Cap.SACK and agreed & Cap.OOO_PLACEMENT):
        agreed &= ~int(NATIVE_SET)
    return agreed


def reject(ch: Channel, cookie: int, reason: Reason, text: str = "") -> None:
    """MR-CM-036: send a REJ (with REJECT_TEXT) and close; never raises."""
    try:
        tl = [(TLV_REJECT_TEXT, text.encode()[:256])] if text else []
        if reason == Reason.UNSUPPORTED_VERSION:
            tl.append((TLV_SUPPORTED_VERSIONS, bytes([VERSION])))
        ch.send(CMMsg(MsgType.REJ, cookie, reason=reason, tlvs=tl).encode())
    except CMError:
        pass
    ch.close()


def _raise_if_rej(m: CMMsg) -> None:
    if m.msg_type == MsgType.REJ:
        t = m.tlv(TLV_REJECT_TEXT)
        raise Rejected(m.reason, t.decode("utf-8", "replace") if t else "", by_peer=True)


def new_cookie() -> int:
    """MR-CM-009: random, never 0."""
    return secrets.randbelow(0xFFFFFFFF) + 1


def random_psn() -> int:
    """MR-CM-007: uniform over 0 .. 2^24-1."""
    return secrets.randbelow(1 << 24)


def active_exchange(ch: Channel, req: CMMsg, connect_qp: Callable[[CMMsg], None],
                    timeout: float = CM_TIMEOUT) -> CMMsg:
    """Active side of 6.5.1 (QP already in INIT, MR-CM-025): send REQ, wait for
    REP, connect_qp(rep) (RTR then RTS, MR-CM-027), send RTU.  Returns the REP."""
    req.msg_type = MsgType.REQ
    ch.send(req.encode())
    try:
        rep = read_msg(ch, timeout)
    except Rejected as e:
        reject(ch, req.cookie, e.reason, e.text)
        raise
    _raise_if_rej(rep)
    if rep.msg_type != MsgType.REP or rep.cookie != req.cookie:                       # MR-CM-009/031
        reject(ch, req.cookie, Reason.UNEXPECTED_MESSAGE, f"expected REP for cookie {req.cookie:#x}")
        raise Rejected(Reason.UNEXPECTED_MESSAGE, f"got {rep.msg_type.name}", by_peer=False)
    if rep.capabilities & ~req.capabilities or agree_caps(rep.capabilities, 0xFF) != rep.capabilities:
        reject(ch, req.cookie, Reason.INVALID_PARAM, "REP capabilities are not a valid subset")  # MR-CM-015
        raise Rejected(Reason.INVALID_PARAM, "REP capabilities", by_peer=False)
    if not rep.capabilities & Cap.NATIVE and not (rep.flags & req.flags & FLAG_COMPAT_OK):
        reject(ch, req.cookie, Reason.NATIVE_REQUIRED)                                   # MR-CM-017
        raise Rejected(Reason.NATIVE_REQUIRED, "", by_peer=False)
    bad_gid = _gid_problem(req.gid, rep.gid, rep.capabilities)
    if bad_gid:
        reject(ch, req.cookie, Reason.INVALID_PARAM, bad_gid)                             # MR-CM-018
        raise Rejected(Reason.INVALID_PARAM, bad_gid, by_peer=False)
    try:
        connect_qp(rep)
    except Exception as e:
        reject(ch, req.cookie, Reason.NO_RESOURCES, str(e))
        raise
    ch.send(CMMsg(MsgType.RTU, req.cookie).encode())
    return rep


def passive_exchange(ch: Channel, local_caps: int, make_rep: Callable[[CMMsg], CMMsg],
                     timeout: float = CM_TIMEOUT) -> tuple[CMMsg, CMMsg]:
    """Passive side of 6.5.2: read a REQ; make_rep(req) must bring the QP to RTR
    (MR-CM-026) and return the REP body, or raise Rejected to refuse; send the
    REP, wait for the RTU.  Returns (req, rep); the caller then moves to RTS."""
    try:
        req = read_msg(ch, timeout)
    except Rejected as e:
        reject(ch, 0, e.reason, e.text)
        raise
    if req.msg_type != MsgType.REQ:
        reject(ch, req.cookie, Reason.UNEXPECTED_MESSAGE, f"expected REQ, got {req.msg_type.name}")
        raise Rejected(Reason.UNEXPECTED_MESSAGE, req.msg_type.name, by_peer=False)
    agreed = agree_caps(req.capabilities, local_caps)
    if not agreed & Cap.NATIVE and not req.flags & FLAG_COMPAT_OK:
        reject(ch, req.cookie, Reason.NATIVE_REQUIRED)
        raise Rejected(Reason.NATIVE_REQUIRED, "", by_peer=False)
    if not _v4_mapped(req.gid) and not agreed & Cap.IPV6:                               # MR-CM-018
        reject(ch, req.cookie, Reason.INVALID_PARAM, "an IPv6 GID without IPV6 agreed")
        raise Rejected(Reason.INVALID_PARAM, "IPv6 GID without IPV6", by_peer=False)
    try:
        rep = make_rep(req)
    except Rejected as e:
        reject(ch, req.cookie, e.reason, e.text)
        raise
    bad_gid = _gid_problem(req.gid, rep.gid, agreed)
    if bad_gid:
        reject(ch, req.cookie, Reason.INVALID_PARAM, bad_gid)
        raise Rejected(Reason.INVALID_PARAM, bad_gid, by_peer=False)
    rep.msg_type, rep.cookie, rep.capabilities = MsgType.REP, req.cookie, agreed
    rep.path_mtu = min(req.path_mtu, rep.path_mtu)                                      # MR-CM-020
    ch.send(rep.encode())
    rtu = read_msg(ch, timeout)
    _raise_if_rej(rtu)
    if rtu.msg_type != MsgType.RTU or rtu.cookie != req.cookie:
        reject(ch, req.cookie, Reason.UNEXPECTED_MESSAGE, f"expected RTU, got {rtu.msg_type.name}")
        raise Rejected(Reason.UNEXPECTED_MESSAGE, rtu.msg_type.name, by_peer=False)
    return req, rep


def _v4_mapped(gid: bytes) -> bool:
    return bytes(gid[:12]) == b"\x00" * 10 + b"\xff\xff"


def _gid_problem(a: bytes, b: bytes, agreed: int) -> str:
    """MR-CM-018: both GIDs IPv4-mapped, or both not with IPV6 agreed; else what is wrong."""
    if _v4_mapped(a) != _v4_mapped(b):
        return "the two GIDs are of different families"
    if not _v4_mapped(a) and not agreed & Cap.IPV6:
        return "IPv6 GIDs without IPV6 agreed"
    return ""


def mac_bytes(mac: str) -> bytes:
    return bytes(int(x, 16) for x in mac.split(":"))


__all__ = [n for n in dir() if not n.startswith("_") and n not in (
    "annotations", "enum", "ipaddress", "json", "secrets", "select", "socket", "struct", "time")]
