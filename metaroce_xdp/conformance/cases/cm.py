"""Connection set-up (06-connection.md, rule area MR-CM) seen from the peer's side of the TCP connection.

The LT plays the remote side of the exchange: it connects to the IUT's listening port (cm_listen, the IUT
passive) or listens while the IUT connects (cm_connect, the IUT active).  Every connection message the LT
sends is built here from the field table of 6.2 with struct, and every message it receives is read the same
way -- never with metaroce_xdp/cm.py, the reference implementation's codec, so a codec bug cannot hide on
both sides.  After a completed exchange the cases send traffic over the QP (scapy frames, as everywhere in
the suite) to show that the agreed QPN, PSNs and MTU are the ones the QP uses.
"""
from __future__ import annotations

import secrets
import socket
import struct
import threading
import time

from ..agentproto import AgentError
from .. import packets as P
from ..context import CaseError, CannotDrive
from ..registry import case
from ._common import ACK_WAIT, describe, expect_ack
from ._req import ack, post, requests, wr, write_wr

# ---- the MetaRoCE Connection Message, from the table of 6.2 -------------------------------------------
FIXED = struct.Struct("!4sBBHHHI16sIIBBBBBBBBH6sHBBI")
FIELDS = ("magic", "version", "msg_type", "flags", "total_len", "reason", "caps", "gid", "qpn", "psn", "path_mtu",
          "max_rd_atomic", "max_dest_rd_atomic", "min_rnr_timer", "timeout", "retry_cnt", "rnr_retry",
          "entropy_count", "sack_window", "mac", "p_key", "dscp", "reserved", "cookie")
REQ, REP, RTU, REJ = 1, 2, 3, 4
TYPE_NAMES = {1: "REQ", 2: "REP", 3: "RTU", 4: "REJ"}
MALFORMED, NATIVE_REQUIRED, INVALID_PARAM, NO_RESOURCES, UNSUPPORTED_TLV, UNEXPECTED = 2, 3, 4, 5, 6, 7
UNSUPPORTED_VERSION = 1
REASONS = {1: "UNSUPPORTED_VERSION", 2: "MALFORMED", 3: "NATIVE_REQUIRED", 4: "INVALID_PARAM", 5: "NO_RESOURCES",
           6: "UNSUPPORTED_TLV", 7: "UNEXPECTED_MESSAGE", 8: "CONSUMER_REJECT", 9: "ADDRESS_MISMATCH", 10: "TIMEOUT"}
COMPAT_OK = 0x0001
ATOMICS, IPV6 = 0x80, 0x40
MTU_CODE = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}
CM_PORT = 18515


def gid(ip: str) -> bytes:
    import ipaddress
    a = ipaddress.ip_address(ip)
    return b"\0" * 10 + b"\xff\xff" + a.packed if a.version == 4 else a.packed


def macb(mac: str) -> bytes:
    return bytes(int(x, 16) for x in mac.split(":"))


def tlv(typ: int, value: bytes) -> bytes:
    return struct.pack("!HH", typ, len(value)) + value


def msg(mtype: int, *, cookie: int = 0, flags: int = COMPAT_OK, caps: int = 0, gid_: bytes = bytes(16),
        qpn: int = 0, psn: int = 0, path_mtu: int = 3, max_rd_atomic: int = 4, max_dest_rd_atomic: int = 4,
        min_rnr_timer: int = 12, timeout: int = 14, retry_cnt: int = 7, rnr_retry: int = 7,
        entropy_count: int = 1, sack_window: int = 0, mac: bytes = bytes(6), p_key: int = 0xFFFF, dscp: int = 0,
        reserved: int = 0, reason: int = 0, version: int = 1, tlvs: bytes = b"", total: int | None = None,
        magic: bytes = b"MRC1") -> bytes:
    """One connection message laid out as in 6.2 (qpn/psn given whole, so bits 31-24 can be set)."""
    n = FIXED.size + len(tlvs) if total is None else total
    return FIXED.pack(magic, version, mtype, flags, n, reason, caps, gid_, qpn, psn, path_mtu, max_rd_atomic,
                      max_dest_rd_atomic, min_rnr_timer, timeout, retry_cnt, rnr_retry, entropy_count, sack_window,
                      mac, p_key, dscp, reserved, cookie) + tlvs


def parse(data: bytes) -> dict:
    m = dict(zip(FIELDS, FIXED.unpack_from(data)))
    m["raw"], m["tlvs"], off = data, [], FIXED.size
    while off + 4 <= len(data):
        ty, n = struct.unpack_from("!HH", data, off)
        m["tlvs"].append((ty, data[off + 4:off + 4 + n]))
        off += 4 + n
    return m


def show(m) -> str:
    if not isinstance(m, dict):
        return str(m)
    s = TYPE_NAMES.get(m["msg_type"], f"type {m['msg_type']}")
    if m["msg_type"] == REJ:
        s += " " + REASONS.get(m["reason"], str(m["reason"]))
    return s + f" cookie {m['cookie']:#x} len {m['total_len']}"


def recv_msg(s: socket.socket, timeout: float = 3.0):
    """The next message from the IUT: a dict, "closed" (EOF/reset), "timeout", or "bad:<bytes>" (no MRC1)."""
    buf = b""
    deadline = time.monotonic() + timeout
    need = 10
    while len(buf) < need:
        left = deadline - time.monotonic()
        if left <= 0:
            return "timeout"
        s.settimeout(left)
        try:
            chunk = s.recv(need - len(buf))
        except socket.timeout:
            return "timeout"
        except OSError:
            return "closed"
        if not chunk:
            return "closed"
        buf += chunk
        if len(buf) == 10 and need == 10:
            if buf[:4] != b"MRC1":
                return "bad:" + buf.hex()
            need = max(10, struct.unpack_from("!H", buf, 8)[0])
    return parse(buf)


def closed_soon(s: socket.socket, timeout: float = 2.0) -> bool:
    """The IUT closes the TCP connection (EOF or reset) within timeout, sending nothing more."""
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except socket.timeout:
        return False
    except OSError:
        return True


def is_rej(m, reason: int) -> bool:
    return isinstance(m, dict) and m["msg_type"] == REJ and m["reason"] == reason


# ---- the IUT passive (cm_listen) ---------------------------------------------------------------------
def tcp_from_lt(t, dst: str, port: int):
    """A TCP connection from the LT's address, made in the network namespace of the LT's capture socket when this
    thread's namespace has no such address (the in-process tester of tests/conformance/test_conformance_native.py
    keeps its sockets in a namespace of their own): SIOCGSKNS gives the socket's namespace, which a helper thread
    enters (setns) to create the socket; a socket keeps the namespace it was created in."""
    try:
        return socket.create_connection((dst, port), timeout=2.0, source_address=(t.lt_ip, 0))
    except OSError as e:
        import errno
        if e.errno != errno.EADDRNOTAVAIL:
            raise
    import ctypes
    import fcntl
    import os
    import threading
    nsfd = fcntl.ioctl(t.lt.rx.fileno(), 0x894C)          # SIOCGSKNS
    box: dict = {}

    def run():
        try:
            if ctypes.CDLL(None, use_errno=True).setns(nsfd, 0x40000000) != 0:     # CLONE_NEWNET
                raise OSError(ctypes.get_errno(), "setns into the LT's network namespace")
            box["s"] = socket.create_connection((dst, port), timeout=2.0, source_address=(t.lt_ip, 0))
        except OSError as e:
            box["e"] = e
    th = threading.Thread(target=run, name="lt-netns-tcp", daemon=True)
    th.start()
    th.join(5)
    os.close(nsfd)
    if "e" in box:
        raise box["e"]
    return box["s"]


class Passive:
    """An IUT QP in INIT listening with cm_listen; the LT connects and plays the active side."""

    def __init__(self, t, caps: int = ATOMICS, port: int | None = None, **kw) -> None:
        self.t = t
        self.c = t.connect(state="INIT")
        t.need_commands("cm_listen", "cm_wait")
        ports = [port] if port else [20000 + secrets.randbelow(40000) for _ in range(5)]
        for p in ports:
            try:
                args = dict(qp=self.c.qp, format="mrc1", caps=caps, flags=COMPAT_OK, **kw)
                if p != CM_PORT or port is None:
                    args["port"] = p
                t.agent.call("cm_listen", **args)
                self.port = p
                break
            except AgentError as e:
                if e.code in ("ENOTSUP", "ENOCMD"):
                    raise CannotDrive(f"the IUT's agent offers no cm_listen: {e.code}") from None
                if e.code not in ("EBUSY", "EINTERNAL") or port:
                    raise
        else:
            raise CaseError("cm_listen found no free port")
        self.lt_qpn = 0x100 + secrets.randbelow(0xFFFE00)

    def tcp(self) -> socket.socket:
        return tcp_from_lt(self.t, self.t.iut_ip, self.port)

    def req(self, psn: int | None = None, **kw) -> tuple[bytes, int, int]:
        """A valid REQ of the LT's QP (overridable fields); returns (bytes, cookie, psn)."""
        t = self.t
        cookie = kw.pop("cookie", secrets.randbelow(0xFFFFFFFE) + 1)
        psn = secrets.randbelow(1 << 24) if psn is None else psn
        args = dict(cookie=cookie, gid_=gid(t.lt_ip), qpn=self.lt_qpn, psn=psn, mac=macb(t.lt_mac))
        args.update(kw)
        return msg(REQ, **args), cookie, psn

    def ask(self, data: bytes):
        """Send one message on a new TCP connection; returns (socket, the IUT's answer)."""
        s = self.tcp()
        s.sendall(data)
        return s, recv_msg(s)

    def state(self) -> str:
        return self.c.query()["state"]

    def complete(self, mtu: int = 3, **kw):
        """A whole exchange: REQ, REP, RTU.  Returns (rep dict, req psn, socket) or raises CaseError."""
        data, cookie, psn = self.req(path_mtu=mtu, **kw)
        s, rep = self.ask(data)
        if not (isinstance(rep, dict) and rep["msg_type"] == REP):
            s.close()
            raise CaseError(f"valid REQ answered with {show(rep)}")
        s.sendall(msg(RTU, cookie=cookie))
        return rep, psn, s

    def established(self, **kw) -> tuple[dict, int, dict]:
        """complete() with the REQ fields kw (path MTU 1024 unless given), then cm_wait and query_qp; the TCP
        connection closed.  Returns (rep dict, req psn, the QP's query_qp)."""
        rep, psn, s = self.complete(kw.pop("path_mtu", 3), **kw)
        try:
            self.wait(3000)
            return rep, psn, self.c.query()
        finally:
            s.close()

    def wait(self, timeout_ms: int = 3000) -> dict:
        try:
            return self.t.agent.call("cm_wait", qp=self.c.qp, timeout_ms=timeout_ms)
        except AgentError as e:
            return {"error": e.code}

    def bind(self, rep: dict, req_psn: int, mtu_bytes: int) -> None:
        """Point the suite's Conn at what the exchange agreed (the LT's QPN and PSN, the IUT's PSN)."""
        self.c.lt_qpn, self.c.psn, self.c.iut_psn, self.c.mtu = self.lt_qpn, req_psn, rep["psn"], mtu_bytes


def traffic(t, c, rules, what: str) -> bool:
    """A WRITE from the LT is ACKed and placed; a WRITE the IUT posts carries its announced PSN and completes."""
    p = c.psn
    data = secrets.token_bytes(48)
    mark = c.send(c.write(data, offset=256))
    a = expect_ack(c, p, mark)
    placed = c.mem(256, len(data)) == data
    mark = post(c, write_wr(c, 32, wr_id=0x5C))
    rq = requests(c, mark, 1, ACK_WAIT)
    okq = bool(rq) and rq[0].roce.psn == c.iut_psn
    if rq:
        c.send(ack(c, rq[0].roce.psn, 1))
    wc = c.poll(1, 1.0)
    ok = a is not None and placed and okq and bool(wc) and str(wc[0].get("status", "")).endswith("SUCCESS")
    for r in rules:
        t.check(r, ok, f"{what}: LT WRITE psn {p:#x} -> {describe([a] if a else [])}, placed {placed}; IUT WRITE "
                f"{describe(rq)} (announced psn {c.iut_psn:#x}); completion {wc}",
                frames=([a] if a else []) + rq or [mark + 1],
                expected=f"ACK of {p:#x}, data placed, an IUT request with PSN {c.iut_psn:#x} completing SUCCESS")
    return ok


# ---- cases: the IUT passive ----------------------------------------------------------------------------
@case("TC-CM-003-a", rules=["MR-CM-002", "MR-CM-003", "MR-CM-005", "MR-CM-006", "MR-CM-009", "MR-CM-010",
                            "MR-CM-014", "MR-CM-016", "MR-CM-020", "MR-CM-021", "MR-CM-022", "MR-CM-024",
                            "MR-CM-026", "MR-CM-028", "MR-CM-032", "MR-QP-012"], category="CM", timeout=25)
def passive_exchange_and_traffic(t):
    """The LT (active) sends a REQ offering every capability bit (native ones, IPV6, ATOMICS, SACK window 256,
    K 16), path MTU 4096, reserved flag/capability bits and byte 59 set, its own timers and a MAC field naming
    no one; the IUT's REP is laid out as in 6.2 with its own GID and QPN, the REQ's cookie, a compat-only
    agreed set (no native bits), path MTU min(4096, its own), W 0 and K 1, and the QP is in RTR before the RTU.
    An RTU with junk at offsets 12-59 moves the QP to RTS with the REQ's QPN/PSN, its own timers and
    max_rd_atomic min(own, REQ max_dest_rd_atomic 2); the LT closes TCP and traffic then flows both ways to
    the LT's real MAC, the IUT's first request carrying the REP's PSN."""
    pv = Passive(t, caps=ATOMICS)
    c = pv.c
    data, cookie, psn = pv.req(caps=0xFFFFFF00 | 0xFF, flags=COMPAT_OK | 0x8000, reserved=0xA5, path_mtu=5,
                               max_dest_rd_atomic=2, min_rnr_timer=3, timeout=20, retry_cnt=2, rnr_retry=1,
                               entropy_count=16, sack_window=256, mac=bytes.fromhex("02deadbeef01"))
    s, rep = pv.ask(data)
    try:
        if not isinstance(rep, dict) or rep["msg_type"] != REP:
            raise CaseError(f"the REQ was answered with {show(rep)}")
        raw = rep["raw"]
        tl_ok = True
        off = 64
        while off < len(raw):
            if off + 4 > len(raw):
                tl_ok = False
                break
            off += 4 + struct.unpack_from("!H", raw, off + 2)[0]
        tl_ok = tl_ok and off == len(raw)
        layout = (rep["magic"] == b"MRC1" and rep["version"] == 1 and rep["total_len"] == len(raw) and tl_ok
                  and rep["reason"] == 0)
        t.check("MR-CM-003", layout, f"REP: {raw[:64].hex()} (+{len(raw) - 64} TLV bytes)",
                expected="MRC1, version 1, msg_type 2, total_len = length, TLVs filling the area",
                observed=[raw.hex()])
        t.check("MR-CM-002", layout, "the REP arrives alone, framed by total_len", observed=[show(rep)])
        zero = (rep["flags"] & 0xFFFE) == 0 and rep["caps"] >> 8 == 0 and rep["reserved"] == 0 \
            and rep["qpn"] >> 24 == 0 and rep["psn"] >> 24 == 0
        t.check("MR-CM-005", zero, f"REP flags {rep['flags']:#x} caps {rep['caps']:#x} byte59 {rep['reserved']} "
                f"qpn {rep['qpn']:#x} psn {rep['psn']:#x} (the REQ's reserved bits were ignored: a REP came)",
                expected="reserved bits and byte 59 zero", observed=[show(rep)])
        t.check("MR-CM-006", rep["gid"] == gid(t.iut_ip), f"REP gid {rep['gid'].hex()}, IUT IP {t.iut_ip}",
                expected=gid(t.iut_ip).hex(), observed=[rep["gid"].hex()])
        t.check("MR-CM-009", rep["cookie"] == cookie, f"REP cookie {rep['cookie']:#x}, REQ's {cookie:#x}",
                expected=f"{cookie:#x}", observed=[f"{rep['cookie']:#x}"])
        local = t.hello.get("caps", 0) & ATOMICS
        t.check("MR-CM-014", rep["caps"] == local, f"REP capabilities {rep['caps']:#x} for a REQ offering 0xff "
                f"to a compat IUT listening with ATOMICS ({local:#x})", expected=f"{local:#x} (no native bits)",
                observed=[f"{rep['caps']:#x}"])
        mtu_code = max(MTU_CODE[m] for m in (t.hello.get("mtus") or t.caps.get("mtus") or [1024]) if m in MTU_CODE)
        rep_mtu_ok = 1 <= rep["path_mtu"] <= 5
        t.check("MR-CM-020", rep_mtu_ok and rep["path_mtu"] == min(5, mtu_code) and rep["sack_window"] == 0 and rep["entropy_count"] == 1,
                f"REP path_mtu {rep['path_mtu']} (REQ 5, IUT max {mtu_code}) W {rep['sack_window']} "
                f"K {rep['entropy_count']}", expected="path_mtu <= 5, W 0, K 1 (no SACK, no MULTIPATH)",
                observed=[show(rep)])
        st = pv.state()
        t.check("MR-CM-026", st == "RTR", f"QP state after the REP, before the RTU: {st}", expected="RTR",
                observed=[st])
        s.sendall(msg(RTU, cookie=cookie, caps=0xFFFFFFFF, gid_=b"\xee" * 16, qpn=0xFFFFFFFF, psn=0x12345678,
                      path_mtu=9, timeout=99, entropy_count=0, sack_window=7, p_key=0x1234, reserved=0xFF))
        w = pv.wait(3000)
        q = c.query()
        a = q["attrs"]
        t.check("MR-CM-028", q["state"] == "RTS", f"after the RTU: QP {q['state']}, cm_wait {w}", expected="RTS",
                observed=[q["state"]])
        t.check("MR-CM-010", q["state"] == "RTS" and a["path_mtu"] == 128 << rep["path_mtu"],
                f"an RTU with junk at offsets 12-59 was accepted: QP {q['state']}, path_mtu {a['path_mtu']}",
                expected="RTS with the REP's path MTU", observed=[str(a)])
        t.check("MR-QP-012", a["rq_psn"] == psn and a["dest_qpn"] == pv.lt_qpn and a["sq_psn"] == rep["psn"],
                f"QP rq_psn {a['rq_psn']:#x} (REQ {psn:#x}), dest_qpn {a['dest_qpn']:#x} (REQ {pv.lt_qpn:#x}), "
                f"sq_psn {a['sq_psn']:#x} (REP {rep['psn']:#x})", expected="the REQ's PSN and QPN, the REP's PSN",
                observed=[str(a)])
        t.check("MR-CM-020", a["path_mtu"] == 128 << rep["path_mtu"], f"QP path_mtu {a['path_mtu']}",
                expected=f"{128 << rep['path_mtu']}", observed=[str(a["path_mtu"])])
        t.check("MR-CM-021", a["max_rd_atomic"] == min(rep["max_rd_atomic"], 2),
                f"QP max_rd_atomic {a['max_rd_atomic']}, own {rep['max_rd_atomic']}, REQ max_dest_rd_atomic 2",
                expected=f"{min(rep['max_rd_atomic'], 2)}", observed=[str(a)])
        own = (a["timeout"], a["retry_cnt"], a["rnr_retry"], a["min_rnr_timer"])
        announced = (rep["timeout"], rep["retry_cnt"], rep["rnr_retry"], rep["min_rnr_timer"])
        t.check("MR-CM-022", own == announced and own != (20, 2, 1, 3),
                f"QP timeout/retry_cnt/rnr_retry/min_rnr_timer {own}; the REP announced {announced}; the REQ "
                "carried (20, 2, 1, 3)", expected="the IUT's own values, not the REQ's", observed=[str(a)])
    finally:
        s.close()                                              # MR-CM-032: closing after the RTU changes nothing
    time.sleep(0.2)
    st = pv.state()
    t.check("MR-CM-032", st == "RTS", f"QP after the LT closed TCP: {st}", expected="RTS", observed=[st])
    t.check("MR-CM-024", a["dmac"] in (None, t.lt_mac.lower()),
            f"QP dmac {a['dmac']} (REQ mac field 02:de:ad:be:ef:01, LT MAC {t.lt_mac})",
            expected=f"{t.lt_mac} or resolved later, never the mac field", observed=[str(a["dmac"])])
    pv.bind(rep, psn, 128 << rep["path_mtu"])
    mark = t.lt.last_num()
    traffic(t, c, ["MR-CM-016", "MR-CM-032", "MR-QP-012"], "after the exchange")
    frames = [f for f in t.lt.collect(lambda f: not f.outgoing and f.roce is not None, 0.0, after=mark)]
    bad = [f for f in frames if f.data[0:6] != macb(t.lt_mac)]
    t.check("MR-CM-024", bool(frames) and not bad, f"{len(frames)} RoCE frames from the IUT, {len(bad)} not to "
            f"the LT's MAC {t.lt_mac}", frames=bad or frames[:1], expected=f"every frame to {t.lt_mac}")


@case("TC-CM-004-a", rules=["MR-CM-004", "MR-CM-011", "MR-CM-012", "MR-CM-036", "MR-CM-037", "MR-CM-038"],
      category="CM", timeout=25)
def passive_rejects_malformed_messages(t):
    """To the IUT's listening port: a message not starting with MRC1 is met with a close and no reply;
    total_len 63 and 5000 with REJ MALFORMED; a TLV running past total_len with REJ MALFORMED; an unknown
    critical TLV with REJ UNSUPPORTED_TLV; version 2 with REJ UNSUPPORTED_VERSION listing version 1 in a
    SUPPORTED_VERSIONS TLV, each REJ a version-1 msg_type-4 message with the cookie, and the connection
    closed.  The QP stays in INIT; a REQ with an unknown non-critical TLV then connects."""
    pv = Passive(t)
    rej_shape = []

    def one(name, data, reason, rules, cookie):
        s, m = pv.ask(data)
        closed = closed_soon(s, 2.0) if isinstance(m, dict) else m == "closed"
        s.close()
        ok = is_rej(m, reason) and closed
        for r in rules:
            t.check(r, ok, f"{name}: {show(m)}, then {'closed' if closed else 'left open'}",
                    expected=f"REJ {REASONS[reason]}, then close", observed=[show(m)])
        if isinstance(m, dict) and m["msg_type"] == REJ:
            rej_shape.append((name, m, cookie))
        return m

    s = pv.tcp()
    s.sendall(b"XRC1" + msg(REQ)[4:])
    m = recv_msg(s, 2.0)
    s.close()
    t.check("MR-CM-004", m == "closed", f"bad magic: {show(m)}", expected="closed without reply",
            observed=[show(m)])
    d, ck, _ = pv.req()
    one("total_len 63", d[:8] + struct.pack("!H", 63) + d[10:], MALFORMED, ["MR-CM-004"], ck)
    d, ck, _ = pv.req()
    one("total_len 5000", d[:8] + struct.pack("!H", 5000) + d[10:], MALFORMED, ["MR-CM-004"], ck)
    d, ck, _ = pv.req(tlvs=tlv(0x0001, b"lt") + struct.pack("!HH", 0x0001, 40) + b"xx")
    one("TLV length past total_len", d, MALFORMED, ["MR-CM-011"], ck)
    d, ck, _ = pv.req(tlvs=tlv(0x8123, b"critical"))
    one("unknown critical TLV 0x8123", d, UNSUPPORTED_TLV, ["MR-CM-012"], ck)
    d, ck, _ = pv.req(version=2)
    m = one("version 2", d, UNSUPPORTED_VERSION, ["MR-CM-037"], ck)
    sv = [v for ty, v in m["tlvs"] if ty == 0x0002] if isinstance(m, dict) else []
    t.check("MR-CM-037", bool(sv) and 1 in sv[0], f"SUPPORTED_VERSIONS TLVs {[v.hex() for v in sv]}",
            expected="a SUPPORTED_VERSIONS TLV listing 1", observed=[show(m)])
    for name, m, ck in rej_shape:
        raw = m["raw"]
        zero = raw[12:60] == bytes(48)
        ok = m["version"] == 1 and m["msg_type"] == REJ and m["cookie"] in (ck, 0) and zero \
            and m["total_len"] == len(raw)
        t.check("MR-CM-036", ok, f"REJ to {name}: {raw[:64].hex()}",
                expected=f"version 1, type 4, reason at 10, cookie {ck:#x} (or 0), offsets 12-59 zero",
                observed=[raw.hex()])
        t.check("MR-CM-038", m["version"] == 1, f"REJ to {name} is version {m['version']}", expected="1",
                observed=[show(m)])
    st = pv.state()
    t.check("MR-CM-036", st == "INIT", f"QP after the refused messages: {st}", expected="INIT", observed=[st])
    rep, psn, s = pv.complete(tlvs=tlv(0x7F55, b"ignore me") + tlv(0x0123, b"reserved, not critical"))
    s.close()
    w = pv.wait(3000)
    t.check("MR-CM-012", "error" not in w and pv.state() == "RTS",
            f"REQ with unknown non-critical TLVs: {show(rep)}, cm_wait {w}", expected="REP and connected",
            observed=[show(rep)])
    t.check("MR-CM-038", rep["version"] == 1, f"REP to a version-1 REQ is version {rep['version']}",
            expected="1", observed=[show(rep)])


@case("TC-CM-005-a", rules=["MR-CM-005", "MR-CM-017", "MR-CM-018", "MR-CM-023", "MR-CM-033", "MR-CM-030"],
      category="CM", timeout=25)
def passive_rejects_invalid_req(t):
    """REQs the IUT must refuse, each on a new TCP connection: bits 31-24 of qpn set (REJ MALFORMED), of psn
    (MALFORMED); COMPAT_OK clear with no native agreed (NATIVE_REQUIRED); an IPv6 GID with IPV6 not agreed
    (INVALID_PARAM); p_key 0x7fff (INVALID_PARAM); the QP stays out of RTR/RTS and sends nothing.  Once a
    REQ has connected the QP, another valid REQ gets REJ NO_RESOURCES."""
    pv = Passive(t, caps=ATOMICS)
    mark = t.lt.last_num()
    cases = [("qpn bits 31-24 set", dict(qpn=0x01000000 | pv.lt_qpn), MALFORMED, "MR-CM-005"),
             ("psn bits 31-24 set", dict(psn=0x80000123), MALFORMED, "MR-CM-005"),
             ("COMPAT_OK clear", dict(flags=0), NATIVE_REQUIRED, "MR-CM-017"),
             ("IPv6 GID", dict(gid_=bytes.fromhex("fd000000000000000000000000000042")), INVALID_PARAM, "MR-CM-018"),
             ("p_key 0x7fff", dict(p_key=0x7FFF), INVALID_PARAM, "MR-CM-023")]
    for name, kw, reason, rule in cases:
        d, ck, _ = pv.req(**kw)
        s, m = pv.ask(d)
        closed = closed_soon(s, 2.0) if isinstance(m, dict) else m == "closed"
        s.close()
        t.check(rule, is_rej(m, reason) and m["cookie"] in (ck, 0) and closed,
                f"REQ with {name}: {show(m)}, {'closed' if closed else 'open'}",
                expected=f"REJ {REASONS[reason]} and close", observed=[show(m)])
        st = pv.state()
        t.check("MR-CM-030", st not in ("RTR", "RTS"), f"QP after the REJ to {name}: {st}",
                expected="not RTR/RTS (INIT, RESET or ERROR)", observed=[st])
    sent = [f for f in t.lt.collect(lambda f: not f.outgoing and f.roce is not None, 0.0, after=mark)]
    t.check("MR-CM-030", not sent, f"RoCE frames from the IUT during the refused exchanges: {describe(sent)}",
            frames=sent, expected="none")
    rep, psn, s = pv.complete()
    s.close()
    pv.wait(3000)
    d, ck, _ = pv.req()
    s, m = pv.ask(d)
    s.close()
    t.check("MR-CM-033", is_rej(m, NO_RESOURCES), f"a second REQ for the connected listening QP: {show(m)}",
            expected="REJ NO_RESOURCES", observed=[show(m)])
    st = pv.state()
    t.check("MR-CM-033", st == "RTS", f"the connected QP: {st}", expected="RTS (untouched)", observed=[st])


@case("TC-CM-031-a", rules=["MR-CM-031", "MR-CM-009", "MR-CM-030", "MR-CM-039", "MR-CM-029"], category="CM",
      timeout=25)
def passive_unexpected_messages(t):
    """A REP sent to the passive IUT: REJ UNEXPECTED_MESSAGE and close.  After a REP: a second REQ gets REJ
    UNEXPECTED_MESSAGE; an RTU with another cookie gets REJ UNEXPECTED_MESSAGE; a pingpong-format message in
    place of the RTU is not taken as one.  After each the QP leaves RTR (no traffic on it).  Before an RTU the
    RTR QP answers a WRITE with an ACK but sends no request of its own."""
    pv = Passive(t)
    d, ck, _ = pv.req()
    rep_as_first = msg(REP, cookie=ck, gid_=gid(t.lt_ip), qpn=pv.lt_qpn, psn=5, mac=macb(t.lt_mac))
    s, m = pv.ask(rep_as_first)
    closed = closed_soon(s, 2.0) if isinstance(m, dict) else m == "closed"
    s.close()
    t.check("MR-CM-031", is_rej(m, UNEXPECTED) and closed, f"REP to the passive side: {show(m)}",
            expected="REJ UNEXPECTED_MESSAGE, close", observed=[show(m)])

    def after_rep(name, second, rule):
        d, ck, psn = pv.req()
        s, rep = pv.ask(d)
        if not (isinstance(rep, dict) and rep["msg_type"] == REP):
            s.close()
            raise CaseError(f"valid REQ answered with {show(rep)}")
        s.sendall(second(ck))
        m = recv_msg(s, 3.0)
        closed = closed_soon(s, 2.0) if isinstance(m, dict) else m == "closed"
        s.close()
        ok = (is_rej(m, UNEXPECTED) if rule != "MR-CM-039" else m in ("closed",) or is_rej(m, UNEXPECTED)
              or (isinstance(m, dict) and m["msg_type"] == REJ)) and closed
        t.check(rule, ok, f"{name} after the REP: {show(m)}, {'closed' if closed else 'open'}",
                expected="REJ UNEXPECTED_MESSAGE (or a close for a non-MRC1 message), then close",
                observed=[show(m)])
        time.sleep(0.2)
        st = pv.state()
        t.check("MR-CM-030", st not in ("RTR", "RTS"), f"QP after {name}: {st}", expected="not RTR/RTS",
                observed=[st])
        return rep, psn
    after_rep("a second REQ", lambda ck: pv.req()[0], "MR-CM-031")
    after_rep("an RTU with another cookie", lambda ck: msg(RTU, cookie=ck ^ 0x5A5A), "MR-CM-009")
    pp = b"0000:%06x:%06x:%s\0" % (pv.lt_qpn, 0x123, gid(t.lt_ip).hex().encode())
    after_rep("a pingpong message", lambda ck: pp, "MR-CM-039")
    # RTR before the RTU: a responder, not a requester (MR-CM-029)
    d, ck, psn = pv.req()
    s, rep = pv.ask(d)
    try:
        if not (isinstance(rep, dict) and rep["msg_type"] == REP):
            raise CaseError(f"valid REQ answered with {show(rep)}")
        c = pv.c
        pv.bind(rep, psn, 1024)
        mark = t.lt.last_num()
        try:
            post(c, write_wr(c, 16, wr_id=0x29))
            posted = "accepted"
        except AgentError as e:
            posted = e.code
        quiet = [f for f in requests(c, mark, 1, 0.5)]
        t.check("MR-CM-029", not quiet, f"IUT requests while in RTR (post_send {posted}): {describe(quiet)}",
                frames=quiet, expected="none before RTS")
        data = b"before-the-rtu"
        p = c.psn
        mark = c.send(c.write(data, offset=64))
        a = expect_ack(c, p, mark)
        placed = c.mem(64, len(data)) == data
        t.check("MR-CM-029", a is not None and placed, f"WRITE before the RTU: {describe([a] if a else [])}, "
                f"placed {placed}", frames=[a] if a else [mark + 1], expected=f"ACK {p:#x}, placed")
        s.sendall(msg(RTU, cookie=ck))
        pv.wait(3000)
    finally:
        s.close()


@case("TC-CM-034-a", rules=["MR-CM-034"], category="CM", timeout=25)
def passive_abandons_after_cm_timeout(t):
    """A TCP connection to the IUT's port on which no REQ comes is closed within cm_timeout (5 s, +2 s); a REQ
    answered with a REP and never followed by an RTU is abandoned within cm_timeout: the connection closed
    (optionally after REJ TIMEOUT) and the QP out of RTR."""
    pv = Passive(t)
    s = pv.tcp()
    t0 = time.monotonic()
    m = recv_msg(s, 7.5)
    dt = time.monotonic() - t0
    s.close()
    ok = (m == "closed" or is_rej(m, 10)) and dt <= 7.5
    t.check("MR-CM-034", ok, f"no REQ: {show(m)} after {dt:.1f} s", expected="closed within 5 s (+2 s)",
            observed=[show(m)])
    d, ck, _ = pv.req()
    s, rep = pv.ask(d)
    t0 = time.monotonic()
    m = recv_msg(s, 7.5) if isinstance(rep, dict) and rep["msg_type"] == REP else rep
    if is_rej(m, 10):
        m = "closed" if closed_soon(s, 1.0) else m
    dt = time.monotonic() - t0
    s.close()
    time.sleep(0.2)
    st = pv.state()
    ok = isinstance(rep, dict) and rep["msg_type"] == REP and m == "closed" and st not in ("RTR", "RTS")
    t.check("MR-CM-034", ok, f"REP then no RTU: {show(m)} after {dt:.1f} s; QP {st}",
            expected="closed within 5 s (+2 s), QP out of RTR", observed=[show(m), st])


@case("TC-CM-001-a", rules=["MR-CM-001"], category="CM", timeout=20)
def default_port_18515(t):
    """cm_listen without a port listens on TCP 18515 (a REQ there is answered); cm_connect without a port
    connects to the LT's 18515."""
    t.need_commands("cm_listen", "cm_connect")
    c = t.connect(state="INIT")
    try:
        t.agent.call("cm_listen", qp=c.qp, format="mrc1", caps=0, flags=COMPAT_OK)
    except AgentError as e:
        if e.code in ("ENOTSUP", "ENOCMD"):
            raise CannotDrive(f"no cm_listen: {e.code}") from None
        raise CaseError(f"cm_listen on the default port: {e}") from None
    s = socket.create_connection((t.iut_ip, CM_PORT), timeout=2.0, source_address=(t.lt_ip, 0))
    qpn = 0x100 + secrets.randbelow(0xFFFE00)
    s.sendall(msg(REQ, cookie=7, gid_=gid(t.lt_ip), qpn=qpn, psn=1, mac=macb(t.lt_mac)))
    m = recv_msg(s)
    s.close()
    t.check("MR-CM-001", isinstance(m, dict) and m["msg_type"] == REP, f"REQ to {t.iut_ip}:{CM_PORT}: {show(m)}",
            expected="REP", observed=[show(m)])
    c2 = t.connect(state="INIT")
    srv = socket.socket(socket.AF_INET6 if ":" in t.lt_ip else socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((t.lt_ip, CM_PORT))
    srv.listen(1)
    out: dict = {}
    th = threading.Thread(target=_connect_call, args=(t, c2, None, out, 2000), daemon=True)
    th.start()
    srv.settimeout(4.0)
    try:
        conn, _ = srv.accept()
        m = recv_msg(conn)
        conn.close()
    except socket.timeout:
        m = "no connection"
    finally:
        srv.close()
        th.join(4)
    t.check("MR-CM-001", isinstance(m, dict) and m["msg_type"] == REQ,
            f"cm_connect without a port: {show(m)} on {t.lt_ip}:{CM_PORT}", expected="a REQ", observed=[show(m)])


# ---- the IUT active (cm_connect) -------------------------------------------------------------------------
def _connect_call(t, c, port, out, timeout_ms=3000, caps=ATOMICS):
    args = dict(qp=c.qp, host=t.lt_ip, format="mrc1", caps=caps, flags=COMPAT_OK, timeout_ms=timeout_ms)
    if port:
        args["port"] = port
    try:
        out["result"] = t.agent.call("cm_connect", **args)
    except AgentError as e:
        out["error"] = e.code


class Active:
    """The LT listens on a TCP port; the IUT QP (INIT) connects with cm_connect in a thread (the agent
    session is busy until the exchange ends: no other agent call meanwhile)."""

    def __init__(self, t, caps: int = ATOMICS, timeout_ms: int = 3000) -> None:
        self.t = t
        t.need_commands("cm_connect")          # before the socket: the LT's address may be packet-level only
        self.c = t.connect(state="INIT")
        self.srv = socket.socket(socket.AF_INET6 if ":" in t.lt_ip else socket.AF_INET, socket.SOCK_STREAM)
        self.srv.bind((t.lt_ip, 0))
        self.srv.listen(1)
        self.out: dict = {}
        self.th = threading.Thread(target=_connect_call,
                                   args=(t, self.c, self.srv.getsockname()[1], self.out, timeout_ms, caps),
                                   daemon=True)
        self.th.start()
        self.srv.settimeout(0.2)
        self.s = None
        deadline = time.monotonic() + 4.0
        while self.s is None and self.th.is_alive() and time.monotonic() < deadline:
            try:
                self.s, _ = self.srv.accept()
            except socket.timeout:
                pass
        self.srv.close()
        if self.s is None:
            self.th.join(2)
            if self.out.get("error") in ("ENOTSUP", "ENOCMD"):
                raise CannotDrive(f"the IUT's agent offers no cm_connect ({self.out['error']})")
            raise CaseError(f"no TCP connection from the IUT's cm_connect: {self.out}")
        self.req = recv_msg(self.s, 3.0)
        if not isinstance(self.req, dict) or self.req["msg_type"] != REQ:
            self.finish()
            raise CaseError(f"the IUT's first message is {show(self.req)}, not a REQ")
        self.lt_qpn = 0x100 + secrets.randbelow(0xFFFE00)
        self.lt_psn = secrets.randbelow(1 << 24)

    def rep(self, **kw) -> bytes:
        r = self.req
        args = dict(cookie=r["cookie"], caps=r["caps"] & ATOMICS, gid_=gid(self.t.lt_ip), qpn=self.lt_qpn,
                    psn=self.lt_psn, path_mtu=min(r["path_mtu"], 3), mac=macb(self.t.lt_mac))
        args.update(kw)
        return msg(REP, **args)

    def finish(self, timeout: float = 5.0) -> dict:
        """Close the LT's side and wait for cm_connect to return: its result or {"error": code}."""
        self.th.join(timeout)
        if self.s is not None:
            self.s.close()
        self.th.join(1.0)
        return self.out


@case("TC-CM-025-a", rules=["MR-CM-003", "MR-CM-005", "MR-CM-006", "MR-CM-009", "MR-CM-013", "MR-CM-020",
                            "MR-CM-010", "MR-CM-015", "MR-CM-021", "MR-CM-022", "MR-CM-024", "MR-CM-025",
                            "MR-CM-027", "MR-CM-016", "MR-QP-012"], category="CM", timeout=25)
def active_exchange_and_traffic(t):
    """The IUT connects (cm_connect offering ATOMICS): its REQ is laid out as in 6.2 (MRC1, version 1, COMPAT_OK,
    reserved bits zero, its GID and QPN, a non-zero cookie, capabilities exactly ATOMICS, W 0, K 1).  The LT's
    REP (ATOMICS agreed, path MTU 256, max_dest_rd_atomic 1, timers 31/0/0, a MAC field naming no one) is met
    with an RTU carrying the cookie and zeros at 12-59, sent only once the QP is in RTS: a WRITE the LT sends
    the moment the RTU arrives is ACKed.  The QP then has the REP's QPN/PSN as dest_qpn/rq_psn, MTU 256,
    max_rd_atomic 1 and its own timers, and traffic flows both ways to the LT's real MAC."""
    ac = Active(t)
    r = ac.req
    raw = r["raw"]
    try:
        layout = r["magic"] == b"MRC1" and r["version"] == 1 and r["total_len"] == len(raw) and r["reason"] == 0
        t.check("MR-CM-003", layout, f"REQ {raw[:64].hex()} (+{len(raw) - 64})", observed=[raw.hex()],
                expected="MRC1, version 1, type 1, total_len = length, reason 0")
        t.check("MR-CM-005", r["flags"] & 0xFFFE == 0 and r["caps"] >> 8 == 0 and r["reserved"] == 0
                and r["qpn"] >> 24 == 0 and r["psn"] >> 24 == 0, f"REQ flags {r['flags']:#x} caps {r['caps']:#x} "
                f"byte59 {r['reserved']} qpn {r['qpn']:#x} psn {r['psn']:#x}", expected="reserved bits zero",
                observed=[raw.hex()])
        t.check("MR-CM-006", r["gid"] == gid(t.iut_ip), f"REQ gid {r['gid'].hex()}", expected=gid(t.iut_ip).hex(),
                observed=[r["gid"].hex()])
        t.check("MR-CM-009", r["cookie"] != 0, f"REQ cookie {r['cookie']:#x}", expected="non-zero",
                observed=[hex(r["cookie"])])
        want = t.hello.get("caps", 0) & ATOMICS
        t.check("MR-CM-013", r["caps"] == want, f"REQ capabilities {r['caps']:#x} (cm_connect caps ATOMICS, the "
                f"IUT claims {t.hello.get('caps', 0):#x})", expected=f"{want:#x}", observed=[hex(r["caps"])])
        t.check("MR-CM-020", r["sack_window"] == 0 and r["entropy_count"] == 1,
                f"REQ W {r['sack_window']} K {r['entropy_count']}", expected="W 0, K 1 (no SACK, no MULTIPATH)",
                observed=[raw.hex()])
        rep = ac.rep(path_mtu=1, max_dest_rd_atomic=1, timeout=31, retry_cnt=0, rnr_retry=0, min_rnr_timer=31,
                     mac=bytes.fromhex("02deadbeef02"))
        ac.s.sendall(rep)
        rtu = recv_msg(ac.s, 3.0)
        c = ac.c
        c.lt_qpn, c.psn, c.iut_psn, c.mtu = ac.lt_qpn, ac.lt_psn, r["psn"], 256
        p = c.psn
        mark = c.send(c.write(b"first-after-rtu", offset=0)) if isinstance(rtu, dict) else t.lt.last_num()
        t.check("MR-CM-010", isinstance(rtu, dict) and rtu["msg_type"] == RTU and rtu["raw"][12:60] == bytes(48)
                and rtu["cookie"] == r["cookie"], f"answer to the REP: {show(rtu)}",
                expected=f"RTU cookie {r['cookie']:#x}, offsets 12-59 zero",
                observed=[rtu["raw"].hex() if isinstance(rtu, dict) else show(rtu)])
        t.check("MR-CM-009", isinstance(rtu, dict) and rtu["cookie"] == r["cookie"], f"RTU: {show(rtu)}",
                expected=f"cookie {r['cookie']:#x}", observed=[show(rtu)])
        a = expect_ack(c, p, mark) if isinstance(rtu, dict) else None
        t.check("MR-CM-027", a is not None, f"WRITE sent as the RTU arrived: {describe([a] if a else [])}",
                frames=[a] if a else [mark + 1], expected=f"ACK {p:#x} (the QP was in RTR/RTS before the RTU)")
        t.check("MR-CM-025", a is not None and isinstance(rtu, dict), "the QP went INIT -> RTR -> RTS on the REP",
                frames=[a] if a else [mark + 1], expected="connected")
    finally:
        out = ac.finish()
    res = out.get("result", {})
    t.check("MR-CM-015", res.get("agreed_caps") == (r["caps"] & ATOMICS), f"cm_connect: {out}",
            expected=f"agreed_caps {r['caps'] & ATOMICS:#x}", observed=[str(out)])
    q = c.query()
    at = q["attrs"]
    t.check("MR-CM-027", q["state"] == "RTS", f"QP {q['state']}", expected="RTS", observed=[q["state"]])
    t.check("MR-QP-012", at["dest_qpn"] == ac.lt_qpn and at["rq_psn"] in (ac.lt_psn, P.psn_add(ac.lt_psn, 1))
            and at["sq_psn"] == r["psn"], f"QP dest_qpn {at['dest_qpn']:#x} rq_psn {at['rq_psn']:#x} "
            f"sq_psn {at['sq_psn']:#x}; REP qpn {ac.lt_qpn:#x} psn {ac.lt_psn:#x}, REQ psn {r['psn']:#x}",
            expected="the REP's QPN and PSN, the REQ's PSN", observed=[str(at)])
    t.check("MR-CM-020", at["path_mtu"] == 256, f"QP path_mtu {at['path_mtu']}", expected="256 (the REP's)",
            observed=[str(at["path_mtu"])])
    t.check("MR-CM-021", at["max_rd_atomic"] == min(r["max_rd_atomic"], 1),
            f"QP max_rd_atomic {at['max_rd_atomic']}, REQ's own {r['max_rd_atomic']}, REP max_dest_rd_atomic 1",
            expected="1", observed=[str(at)])
    own = (at["timeout"], at["retry_cnt"], at["rnr_retry"], at["min_rnr_timer"])
    t.check("MR-CM-022", own == (r["timeout"], r["retry_cnt"], r["rnr_retry"], r["min_rnr_timer"]),
            f"QP timers {own}; the REQ announced {(r['timeout'], r['retry_cnt'], r['rnr_retry'], r['min_rnr_timer'])};"
            " the REP carried (31, 0, 0, 31)", expected="the IUT's own values", observed=[str(at)])
    t.check("MR-CM-016", q.get("profile", "compat") == "compat", f"profile {q.get('profile')}",
            expected="compat", observed=[str(q.get("profile"))])
    c.psn = P.psn_add(ac.lt_psn, 1)
    mark = t.lt.last_num()
    traffic(t, c, ["MR-CM-016"], "after the exchange")
    c.iut_psn = P.psn_add(r["psn"], 1)
    frames = t.lt.collect(lambda f: not f.outgoing and f.roce is not None, 0.0, after=mark)
    bad = [f for f in frames if f.data[0:6] != macb(t.lt_mac)]
    t.check("MR-CM-024", bool(frames) and not bad, f"{len(frames)} frames, {len(bad)} not to {t.lt_mac} (REP "
            "mac field 02:de:ad:be:ef:02)", frames=bad or frames[:1], expected=f"every frame to {t.lt_mac}")
    mark = t.lt.last_num()
    try:
        post(c, write_wr(c, 8, wr_id=0x77) | {})
    except Exception:                                # noqa: BLE001 - only the frames matter here
        pass
    rq = requests(c, mark, 1, ACK_WAIT)
    t.check("MR-QP-012", bool(rq) and rq[0].roce.psn == c.iut_psn, f"second IUT request {describe(rq)}",
            frames=rq or [mark + 1], expected=f"PSN {c.iut_psn:#x}")
    if rq:
        c.send(ack(c, rq[0].roce.psn, 2))
        c.poll(1, 1.0)


@case("TC-CM-015-a", rules=["MR-CM-015", "MR-CM-017", "MR-CM-009", "MR-CM-030", "MR-CM-018"], category="CM",
      timeout=30)
def active_rejects_invalid_rep(t):
    """The IUT (active) answers a REP whose capabilities exceed its REQ's with REJ INVALID_PARAM, a REP without
    COMPAT_OK and no native with REJ NATIVE_REQUIRED, a REP with another cookie with REJ UNEXPECTED_MESSAGE, a
    REP with an IPv6 GID with REJ INVALID_PARAM; each time it closes, cm_connect fails and the QP is in ERROR
    (or RESET) and sends nothing."""
    mark0 = t.lt.last_num()
    cases = [("capabilities beyond the REQ's", lambda ac: ac.rep(caps=(ac.req["caps"] | IPV6)), INVALID_PARAM,
              "MR-CM-015"),
             ("COMPAT_OK clear", lambda ac: ac.rep(flags=0), NATIVE_REQUIRED, "MR-CM-017"),
             ("another cookie", lambda ac: ac.rep(cookie=ac.req["cookie"] ^ 0xFFFF), UNEXPECTED, "MR-CM-009"),
             ("an IPv6 GID", lambda ac: ac.rep(gid_=bytes.fromhex("fd000000000000000000000000000043")),
              INVALID_PARAM, "MR-CM-018")]
    for name, make, reason, rule in cases:
        ac = Active(t)
        try:
            ac.s.sendall(make(ac))
            m = recv_msg(ac.s, 3.0)
            closed = closed_soon(ac.s, 2.0) if isinstance(m, dict) else m == "closed"
        finally:
            out = ac.finish()
        t.check(rule, is_rej(m, reason) and closed and "error" in out,
                f"REP with {name}: {show(m)}, {'closed' if closed else 'open'}; cm_connect {out}",
                expected=f"REJ {REASONS[reason]}, close, cm_connect fails", observed=[show(m), str(out)])
        st = ac.c.query()["state"]
        t.check("MR-CM-030", st in ("ERR", "RESET"), f"QP after the REJ to a REP with {name}: {st}",
                expected="ERROR (or RESET)", observed=[st])
    sent = t.lt.collect(lambda f: not f.outgoing and f.roce is not None, 0.0, after=mark0)
    t.check("MR-CM-030", not sent, f"RoCE frames from the IUT: {describe(sent)}", frames=sent, expected="none")


@case("TC-CM-034-b", rules=["MR-CM-034", "MR-CM-030", "MR-CM-019"], category="CM", timeout=25)
def active_timeout_and_rej(t):
    """The IUT (active, cm_timeout 1.5 s) gets no answer to its REQ: cm_connect fails within cm_timeout (+2 s)
    and the QP is in ERROR.  A REJ CONSUMER_REJECT from the LT: cm_connect fails and the QP is in ERROR, with
    nothing sent.  A connection that agreed no ATOMICS refuses an atomic work request at post time and sends
    no atomic."""
    ac = Active(t, timeout_ms=1500)
    t0 = time.monotonic()
    ac.th.join(5.0)
    dt = time.monotonic() - t0
    out = ac.finish()
    st = ac.c.query()["state"]
    t.check("MR-CM-034", "error" in out and dt <= 3.5 and st in ("ERR", "RESET"),
            f"no REP: cm_connect {out} after {dt:.1f} s; QP {st}", expected="failure within 1.5 s (+2 s), QP ERROR",
            observed=[str(out), st])
    mark = t.lt.last_num()
    ac = Active(t)
    try:
        ac.s.sendall(msg(REJ, cookie=ac.req["cookie"], reason=8))
        closed = closed_soon(ac.s, 3.0)
    finally:
        out = ac.finish()
    st = ac.c.query()["state"]
    sent = t.lt.collect(lambda f: not f.outgoing and f.roce is not None, 0.0, after=mark)
    t.check("MR-CM-030", "error" in out and st in ("ERR", "RESET") and not sent and closed,
            f"REJ CONSUMER_REJECT: cm_connect {out}, QP {st}, TCP {'closed' if closed else 'open'}, frames "
            f"{describe(sent)}", frames=sent, expected="failure, QP ERROR, closed, no frames", observed=[st])
    # MR-CM-019: ATOMICS not agreed
    ac = Active(t, caps=0)
    try:
        ac.s.sendall(ac.rep(caps=0))
        rtu = recv_msg(ac.s, 3.0)
    finally:
        out = ac.finish()
    if not (isinstance(rtu, dict) and rtu["msg_type"] == RTU and "result" in out):
        raise CaseError(f"the exchange without ATOMICS did not complete: {show(rtu)}, {out}")
    c = ac.c
    c.lt_qpn, c.psn, c.iut_psn = ac.lt_qpn, ac.lt_psn, ac.req["psn"]
    mark = t.lt.last_num()
    try:
        post(c, wr("ATOMIC_FETCH_AND_ADD", 8, wr_id=0x19, c=c, swap_add="0x1"))
        posted = "accepted"
    except AgentError as e:
        posted = e.code
    atom = [f for f in t.lt.collect(lambda f: c.is_mine(f) and f.roce.op in ("COMPARE_SWAP", "FETCH_ADD"), 0.5,
                                    after=mark)]
    t.check("MR-CM-019", posted != "accepted" and not atom,
            f"atomic WR on a QP without ATOMICS agreed: post_send {posted}; atomics sent {describe(atom)}",
            frames=atom, expected="refused at post time, nothing sent", observed=[posted])


# ---- the pingpong format of 6.7 ------------------------------------------------------------------------
PP_RE = __import__("re").compile(rb"0000:[0-9a-f]{6}:[0-9a-f]{6}:[0-9a-f]{32}\x00")


def pp_msg(lid: int, qpn: int, psn: int, gid_: bytes) -> bytes:
    return b"%04x:%06x:%06x:%s\x00" % (lid, qpn, psn, gid_.hex().encode())


def recv_n(s: socket.socket, n: int, timeout: float = 3.0) -> bytes:
    buf = b""
    deadline = time.monotonic() + timeout
    while len(buf) < n and time.monotonic() < deadline:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = s.recv(n - len(buf))
        except (socket.timeout, OSError):
            break
        if not chunk:
            break
        buf += chunk
    return buf


def _pp_attrs_ok(t, c, rules, what):
    a = c.query()["attrs"]
    got = (a["path_mtu"], a["timeout"], a["retry_cnt"], a["rnr_retry"], a["max_rd_atomic"],
           a["max_dest_rd_atomic"], a["min_rnr_timer"])
    for r in rules:
        t.check(r, got == (1024, 14, 7, 7, 1, 1, 12), f"{what}: QP path_mtu/timeout/retry/rnr_retry/max_rd_atomic/"
                f"max_dest_rd_atomic/min_rnr_timer {got}", expected="(1024, 14, 7, 7, 1, 1, 12)", observed=[str(a)])
    return a


@case("TC-CM-040-a", rules=["MR-CM-040", "MR-CM-041", "MR-CM-042", "MR-CM-043", "MR-CM-044", "MR-CM-045",
                            "MR-CM-046", "MR-CM-047"], category="CM", timeout=30)
def pingpong_both_roles(t):
    """The ibv_rc_pingpong exchange in both roles.  Server (cm_listen format pingpong): an MRC1 REQ is met with
    a close and no MRC1 reply; the LT's 52-byte message (LID abcd, to be ignored) is answered with 52 bytes
    "0000:qpn:psn:gid" + NUL naming the IUT's QP and GID, the QP already in RTS with rc_pingpong's attributes
    before the "done"; traffic uses the LT's QPN/PSN.  Client (cm_connect format pingpong): the IUT writes its
    52 bytes first, reads the LT's and writes "done" + NUL; its QP then runs with the same attributes."""
    t.need_commands("cm_listen", "cm_connect")
    c = t.connect(state="INIT")
    port = 20000 + secrets.randbelow(40000)
    try:
        t.agent.call("cm_listen", qp=c.qp, port=port, format="pingpong", caps=0, flags=COMPAT_OK)
    except AgentError as e:
        if e.code in ("ENOTSUP", "ENOCMD", "EINVAL"):
            raise CannotDrive(f"the IUT's agent offers no pingpong cm_listen: {e.code}") from None
        raise
    lt_qpn, lt_psn = 0x100 + secrets.randbelow(0xFFFE00), secrets.randbelow(1 << 24)
    s = socket.create_connection((t.iut_ip, port), timeout=2.0, source_address=(t.lt_ip, 0))
    s.sendall(msg(REQ, cookie=9, gid_=gid(t.lt_ip), qpn=lt_qpn, psn=lt_psn, mac=macb(t.lt_mac)))
    got = recv_n(s, 64, 3.0)
    s.close()
    t.check("MR-CM-046", not got.startswith(b"MRC1") and c.query()["state"] == "INIT",
            f"MRC1 REQ to the pingpong listener: got {got[:16]!r}", expected="closed without an MRC1 reply, QP INIT",
            observed=[repr(got)])
    s = socket.create_connection((t.iut_ip, port), timeout=2.0, source_address=(t.lt_ip, 0))
    try:
        s.sendall(pp_msg(0xABCD, lt_qpn, lt_psn, gid(t.lt_ip)))
        theirs = recv_n(s, 52, 3.0)
        ok = PP_RE.fullmatch(theirs) is not None
        t.check("MR-CM-041", ok and theirs[5:11] == b"%06x" % c.qpn and theirs[19:51] == gid(t.iut_ip).hex().encode(),
                f"server's message {theirs!r} (QP {c.qpn:#x})", expected="0000:<qpn 6>:<psn 6>:<gid 32> NUL, 52 bytes",
                observed=[repr(theirs)])
        st = c.query()["state"]
        t.check("MR-CM-045", st == "RTS", f"QP before the LT's \"done\": {st}", expected="RTS", observed=[st])
        t.check("MR-CM-043", ok and st == "RTS", "server: read the client's message, RTR/RTS, wrote its own",
                observed=[repr(theirs)])
        a = _pp_attrs_ok(t, c, ["MR-CM-044"], "server")
        t.check("MR-CM-042", a["dest_qpn"] == lt_qpn and a["rq_psn"] == lt_psn and
                a["dgid"] in (gid(t.lt_ip).hex(), t.lt_ip, "::ffff:" + t.lt_ip),
                f"QP dest_qpn {a['dest_qpn']:#x} rq_psn {a['rq_psn']:#x} dgid {a['dgid']} (LID abcd sent)",
                expected=f"{lt_qpn:#x}, {lt_psn:#x}, the LT's GID", observed=[str(a)])
        if ok:
            c.lt_qpn, c.psn, c.iut_psn = lt_qpn, lt_psn, int(theirs[12:18], 16)
            traffic(t, c, ["MR-CM-040", "MR-CM-044"], "server role")
        s.sendall(b"done\x00")
    finally:
        s.close()
    # client role
    c2 = t.connect(state="INIT")
    srv = socket.socket(socket.AF_INET6 if ":" in t.lt_ip else socket.AF_INET, socket.SOCK_STREAM)
    srv.bind((t.lt_ip, 0))
    srv.listen(1)
    out: dict = {}
    th = threading.Thread(target=lambda: _pp_connect(t, c2, srv.getsockname()[1], out), daemon=True)
    th.start()
    srv.settimeout(4.0)
    lt_qpn2, lt_psn2 = 0x100 + secrets.randbelow(0xFFFE00), secrets.randbelow(1 << 24)
    try:
        conn, _ = srv.accept()
    except socket.timeout:
        th.join(2)
        raise CaseError(f"no connection from cm_connect pingpong: {out}") from None
    finally:
        srv.close()
    with conn:
        first = recv_n(conn, 52, 3.0)
        conn.sendall(pp_msg(0, lt_qpn2, lt_psn2, gid(t.lt_ip)))
        done = recv_n(conn, 5, 3.0)
        th.join(5)
    ok = PP_RE.fullmatch(first) is not None and first[5:11] == b"%06x" % c2.qpn \
        and first[19:51] == gid(t.iut_ip).hex().encode()
    t.check("MR-CM-041", ok, f"client's message {first!r}", expected="52 bytes, 0000:<qpn>:<psn>:<gid> NUL",
            observed=[repr(first)])
    t.check("MR-CM-046", not first.startswith(b"MRC1"), f"client's first bytes {first[:8]!r}",
            expected="no MRC1 message", observed=[repr(first)])
    t.check("MR-CM-043", ok and done == b"done\x00" and "result" in out,
            f"client: wrote its message, then after ours {done!r}; cm_connect {out}",
            expected='its message first, then "done" NUL', observed=[repr(done)])
    a = _pp_attrs_ok(t, c2, ["MR-CM-044"], "client")
    t.check("MR-CM-042", a["dest_qpn"] == lt_qpn2 and a["rq_psn"] == lt_psn2, f"client QP {a}",
            expected=f"dest_qpn {lt_qpn2:#x}, rq_psn {lt_psn2:#x}", observed=[str(a)])
    if ok:
        c2.lt_qpn, c2.psn, c2.iut_psn = lt_qpn2, lt_psn2, int(first[12:18], 16)
        traffic(t, c2, ["MR-CM-040"], "client role")
    # reached only by an IUT that claims CM_DUAL_LISTEN (Table 9-1; else NOT-APPLICABLE before the case ran)
    t.cannot_drive("MR-CM-047", "the agent protocol (9.4.2 cm_listen format) listens for one format per port")


def _pp_connect(t, c, port, out):
    try:
        out["result"] = t.agent.call("cm_connect", qp=c.qp, host=t.lt_ip, port=port, format="pingpong", caps=0,
                                     flags=COMPAT_OK, timeout_ms=3000)
    except AgentError as e:
        out["error"] = e.code


@case("TC-CM-035-a", rules=["MR-CM-035"], category="CM", caps=("CM_RETRY",), timeout=20)
def active_retries_are_fresh(t):
    """The LT closes the TCP connection on the IUT's first REQ without answering.  An IUT that claims CM_RETRY
    (Table 9-1: retrying is a MAY) retries the exchange, every retry on a new TCP connection with a new cookie
    and a new starting PSN (the QP is in INIT again: a REQ is only sent from INIT, MR-CM-025); the LT completes
    none."""
    t.need_commands("cm_connect")
    c = t.connect(state="INIT")
    srv = socket.socket(socket.AF_INET6 if ":" in t.lt_ip else socket.AF_INET, socket.SOCK_STREAM)
    srv.bind((t.lt_ip, 0))
    srv.listen(4)
    out: dict = {}
    th = threading.Thread(target=_connect_call, args=(t, c, srv.getsockname()[1], out, 1500), daemon=True)
    th.start()
    reqs, ports = [], []
    deadline = time.monotonic() + min(12.0, t.left() - 3)
    srv.settimeout(0.2)
    try:
        while time.monotonic() < deadline and (th.is_alive() or not reqs):
            try:
                conn, addr = srv.accept()
            except socket.timeout:
                if not th.is_alive():
                    break
                continue
            with conn:
                m = recv_msg(conn, 2.0)
            ports.append(addr[1])
            if isinstance(m, dict) and m["msg_type"] == REQ:
                reqs.append(m)
    finally:
        srv.close()
        th.join(4)
    if not reqs:
        raise CaseError(f"no REQ from cm_connect: {out}")
    if len(reqs) == 1:
        t.check("MR-CM-035", False, f"the IUT claims CM_RETRY but did not retry the exchange (cm_connect {out})",
                expected="a second REQ", observed=[show(r) for r in reqs])
        return
    cookies, psns = [r["cookie"] for r in reqs], [r["psn"] for r in reqs]
    ok = len(set(cookies)) == len(reqs) and len(set(psns)) == len(reqs) and len(set(ports)) == len(ports)
    t.check("MR-CM-035", ok, f"{len(reqs)} REQs: cookies {[hex(x) for x in cookies]}, PSNs "
            f"{[hex(x) for x in psns]}, TCP source ports {ports}", expected="all different",
            observed=[show(r) for r in reqs])
