"""What `metaroce dev show | qp list | qp show | stat | top` print: metaroced's snapshot() (the
`status` op on its control socket) turned into documents with a stable JSON schema (docs/daemon.md,
"CLI JSON schema") and into text tables.

Every document carries "schema" ("metaroce.<kind>/1"; a field is only ever added within a version)
and "source": "daemon" (fields from metaroced's control socket) or "kernel" (fields read from the
maps the XDP program pins in bpffs, which stay readable while the daemon is stuck).
"""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

SCHEMA_VERSION = 1

QP_FIELDS = ("dev", "qpn", "state", "type", "remote_qpn", "remote_addr", "sq_psn", "rq_psn", "outstanding_send",
             "outstanding_recv", "retransmits", "naks_rx", "naks_tx", "rnr", "rate_bps", "bytes_tx", "bytes_rx",
             "owner")
DEVICE_FIELDS = ("ifname", "mtu", "mac", "gids", "queues", "caps", "features", "counters")
CLIENT_FIELDS = ("pid", "uid", "comm", "qps", "mrs", "mr_bytes")
DAEMON_FIELDS = ("pid", "started", "clients", "version")


class StatusError(Exception):
    """The daemon could not be asked or answered an error; one line, for the CLI's stderr."""


class DaemonNotRunning(StatusError):
    """Nothing listens on the control socket (no daemon, or another socket path)."""


class DaemonNotAnswering(StatusError):
    """The control socket accepts but the daemon does not answer in time (stuck or stopped)."""


class QpNotFound(StatusError):
    pass


def schema(kind: str) -> str:
    return f"metaroce.{kind}/{SCHEMA_VERSION}"


# ------------------------------------------------------------------------------------- the question
class StatusConnection:
    """One connection to metaroced's control socket for repeated `status` requests (`metaroce top` keeps
    one open instead of connecting every refresh).  Messages: one JSON object per SOCK_SEQPACKET
    message (docs/daemon.md, "The control socket"); the answer is {"ok": true, "snapshot": {...}}."""

    def __init__(self, socket_path: str, timeout: float = 5.0):
        self.socket_path, self.timeout = socket_path, timeout
        self._id = 0
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        s.settimeout(timeout)
        try:
            s.connect(socket_path)
        except (FileNotFoundError, ConnectionRefusedError):
            s.close()
            raise DaemonNotRunning(f"no metaroced is running on {socket_path} (start it with `systemctl start "
                                   f"metaroced`, or give its socket with --socket)") from None
        except PermissionError:
            s.close()
            raise StatusError(f"not allowed to connect to {socket_path}: run as root or as a member of the "
                              f"daemon's socket_group") from None
        except OSError as e:
            s.close()
            raise DaemonNotRunning(f"cannot connect to metaroced on {socket_path}: {e.strerror}") from None
        self.sock = s

    def ask(self) -> dict:
        self._id += 1
        path, timeout = self.socket_path, self.timeout
        try:
            self.sock.settimeout(timeout)
            self.sock.sendmsg([json.dumps({"op": "status", "id": self._id}).encode()])
            deadline = time.monotonic() + timeout
            while True:
                self.sock.settimeout(max(0.01, deadline - time.monotonic()))
                data, _, _, _ = self.sock.recvmsg(1 << 24)
                if not data:
                    raise DaemonNotAnswering(f"metaroced on {path} closed the connection without answering")
                reply = json.loads(data.decode())
                if isinstance(reply, dict) and "event" in reply and "ok" not in reply:
                    continue                                      # an unsolicited event: not our answer
                if isinstance(reply, dict) and reply.get("id") not in (None, self._id):
                    continue                                      # the answer to an earlier, timed-out request
                break
        except socket.timeout:
            raise DaemonNotAnswering(f"metaroced on {path} did not answer within {timeout:g} s "
                                     f"(stuck or stopped?)") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise StatusError(f"metaroced on {path} answered something that is not JSON: {e}") from None
        except OSError as e:
            raise DaemonNotAnswering(f"metaroced on {path} dropped the connection: {e}") from None
        if not isinstance(reply, dict):
            raise StatusError(f"metaroced answered {reply!r}")
        if not reply.get("ok", False):
            raise StatusError(f"metaroced refused the status request: {reply.get('error', '')}: "
                              f"{reply.get('message', '')}")
        snap = reply.get("snapshot", reply)
        return {k: snap[k] for k in ("daemon", "devices", "qps", "clients") if k in snap}

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def query_status(socket_path: str, timeout: float = 5.0) -> dict:
    """The daemon's snapshot() through one `status` request."""
    with StatusConnection(socket_path, timeout) as c:
        return c.ask()


# --------------------------------------------------------------------------------------- documents
def _fill(obj: dict | None, fields: tuple[str, ...]) -> dict:
    obj = dict(obj or {})
    out = {f: obj.pop(f, None) for f in fields}
    out.update(obj)                               # fields the daemon added later: kept, after the documented ones
    return out


def normalize(snap: dict) -> dict:
    """The snapshot with every documented field present (None when the daemon did not report it)."""
    qps = []
    for q in snap.get("qps", []):
        q = _fill(q, QP_FIELDS)
        q["owner"] = _fill(q.get("owner"), ("pid", "uid", "comm"))
        qps.append(q)
    return {"daemon": _fill(snap.get("daemon"), DAEMON_FIELDS),
            "devices": [_fill(d, DEVICE_FIELDS) for d in snap.get("devices", [])],
            "qps": sorted(qps, key=lambda q: (str(q["dev"]), q["qpn"] or 0)),
            "clients": [_fill(c, CLIENT_FIELDS) for c in snap.get("clients", [])]}


def parse_qpn(text: str) -> int:
    try:
        v = int(text, 0)
    except ValueError:
        raise StatusError(f"QPN must be a number (decimal or 0x...), not {text!r}") from None
    if not 0 <= v < 1 << 24:
        raise StatusError(f"QPN must be 0..0xffffff, not {text}")
    return v


def dev_doc(snap: dict, dev: str | None = None) -> dict:
    n = normalize(snap)
    devs = [d for d in n["devices"] if dev is None or d["ifname"] == dev]
    if dev is not None and not devs:
        raise StatusError(f"metaroced does not own {dev} (it owns: "
                          f"{', '.join(str(d['ifname']) for d in n['devices']) or 'none'})")
    return {"schema": schema("dev"), "source": "daemon", "daemon": n["daemon"], "devices": devs}


def qp_list_doc(snap: dict, dev: str | None = None) -> dict:
    n = normalize(snap)
    return {"schema": schema("qp-list"), "source": "daemon",
            "qps": [q for q in n["qps"] if dev is None or q["dev"] == dev]}


def qp_doc(snap: dict, qpn: int, dev: str | None = None) -> dict:
    n = normalize(snap)
    hits = [q for q in n["qps"] if q["qpn"] == qpn and (dev is None or q["dev"] == dev)]
    if not hits:
        raise QpNotFound(f"no QP {qpn} (0x{qpn:06x})" + (f" on {dev}" if dev else "") + " in metaroced")
    if len(hits) > 1:
        raise StatusError(f"QP {qpn} exists on several devices ({', '.join(q['dev'] for q in hits)}): give -d DEV")
    return {"schema": schema("qp"), "source": "daemon", "qp": hits[0]}


_SUM = ("bytes_tx", "bytes_rx", "retransmits", "naks_rx", "naks_tx", "rnr")


def stat_doc(snap: dict, dev: str | None = None) -> dict:
    n = normalize(snap)
    qps = [q for q in n["qps"] if dev is None or q["dev"] == dev]
    totals: dict[str, Any] = {k: sum(int(q[k] or 0) for q in qps) for k in _SUM}
    totals["qps"] = len(qps)
    totals["clients"] = len(n["clients"])
    states: dict[str, int] = {}
    for q in qps:
        states[str(q["state"])] = states.get(str(q["state"]), 0) + 1
    totals["qp_states"] = states
    return {"schema": schema("stat"), "source": "daemon", "daemon": n["daemon"],
            "devices": [{"ifname": d["ifname"], "counters": d["counters"] or {}}
                        for d in n["devices"] if dev is None or d["ifname"] == dev],
            "totals": totals, "clients": n["clients"],
            "qps": [{k: q[k] for k in ("dev", "qpn", "state") + _SUM} for q in qps]}


def top_doc(prev: dict | None, cur: dict, interval_s: float, dev: str | None = None) -> dict:
    """QPs with throughput from the byte counters' deltas between two snapshots, fastest first.
    A QP new since `prev` (or the first sample) counts from 0 only once it has a previous sample."""
    before = {(q["dev"], q["qpn"]): q for q in normalize(prev)["qps"]} if prev else {}
    rows = []
    for q in normalize(cur)["qps"]:
        if dev is not None and q["dev"] != dev:
            continue
        p = before.get((q["dev"], q["qpn"]))
        row = {k: q[k] for k in ("dev", "qpn", "state", "remote_qpn", "remote_addr", "outstanding_send",
                                 "outstanding_recv", "retransmits", "bytes_tx", "bytes_rx", "owner")}
        for k, out in (("bytes_tx", "tx_bps"), ("bytes_rx", "rx_bps")):
            if p is None or interval_s <= 0 or q[k] is None or p[k] is None:
                row[out] = None
            else:
                row[out] = max(0, int(q[k]) - int(p[k])) * 8 / interval_s
        rows.append(row)
    rows.sort(key=lambda r: -((r["tx_bps"] or 0) + (r["rx_bps"] or 0)))
    return {"schema": schema("top"), "source": "daemon", "time": time.time(), "interval_s": interval_s,
            "qps": rows}


def kernel_qp_list_doc(rows: list[dict], dev: str) -> dict:
    """The kernel's view (metaroce_xdp/cli/qpstat.read_qps of the pinned QP table) in a qp-list document."""
    return {"schema": schema("kernel-qp-list"), "source": "kernel", "dev": dev, "qps": rows}


# ------------------------------------------------------------------------------------------- text
def _v(x: Any) -> str:
    return "-" if x is None else str(x)


def _qpn(x: Any) -> str:
    """QPNs in text as the daemon's log writes them (hex); JSON keeps integers."""
    return f"{x:#x}" if isinstance(x, int) and not isinstance(x, bool) else _v(x)


def human_bps(bps: float | None) -> str:
    if bps is None:
        return "-"
    for unit, div in (("Gb/s", 1e9), ("Mb/s", 1e6), ("kb/s", 1e3)):
        if bps >= div:
            return f"{bps / div:.2f} {unit}"
    return f"{bps:.0f} b/s"


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def _kv(value: Any, indent: str) -> list[str]:
    if isinstance(value, dict):
        out = []
        for k, v in value.items():
            if isinstance(v, list) and not any(isinstance(x, (dict, list)) for x in v):
                out.append(f"{indent}{k}: {', '.join(map(_v, v)) if v else '(none)'}")
            elif isinstance(v, (dict, list)) and v:
                out.append(f"{indent}{k}:")
                out += _kv(v, indent + "\t")
            else:
                out.append(f"{indent}{k}: {_v(v)}")
        return out
    if isinstance(value, list):
        out = []
        for i, v in enumerate(value):
            if isinstance(v, dict):
                out.append(f"{indent}[{i}]")
                out += _kv(v, indent + "\t")
            else:
                out.append(f"{indent}[{i}] {_v(v)}")
        return out
    return [f"{indent}{_v(value)}"]


def format_dev(doc: dict) -> str:
    """ibv_devinfo-like: one block per interface."""
    d = doc["daemon"]
    lines = [f"metaroced pid {_v(d['pid'])}, version {_v(d['version'])}, {_v(d['clients'])} clients"]
    if not doc["devices"]:
        lines.append("(no interface)")
    for dev in doc["devices"]:
        lines.append(f"hca_id:\t{dev['ifname']}")
        lines.append("\ttransport:\t\tMetaRoCE (RoCEv2 compat) over XDP/AF_XDP")
        lines.append(f"\tnode_guid/mac:\t\t{_v(dev['mac'])}")
        lines.append(f"\tactive_mtu:\t\t{_v(dev['mtu'])}")
        q = dev["queues"]
        if isinstance(q, list) and not any(isinstance(x, (dict, list)) for x in q):
            lines.append(f"\tqueues:\t\t\t{', '.join(map(_v, q))} ({len(q)} RX queue{'s' * (len(q) != 1)})")
        else:
            lines.append(f"\tqueues:\t\t\t{_v(q) if not isinstance(q, (list, dict)) else ''}".rstrip())
            if isinstance(q, (list, dict)):
                lines += _kv(q, "\t\t")
        lines.append("\tGID table:")
        for i, g in enumerate(dev["gids"] or []):
            lines.append(f"\t\tGID[{i:3}]:\t{g if not isinstance(g, dict) else json.dumps(g)}")
        if not dev["gids"]:
            lines.append("\t\t(none)")
        lines.append("\tcapabilities:")
        lines += _kv(dev["caps"] or {}, "\t\t") if dev["caps"] else ["\t\t(none reported)"]
        if dev.get("features"):
            lines.append("\tkernel and driver:")
            lines += _kv(dev["features"], "\t\t")
    return "\n".join(lines)


def format_qp_list(doc: dict) -> str:
    head = (f"{'DEV':<8} {'QPN':>8} {'STATE':<5} {'TYPE':<4} {'RQPN':>8} {'PEER':<16} {'SQ_PSN':>8} {'RQ_PSN':>8} "
            f"{'OUT_S':>5} {'OUT_R':>5} {'RETX':>6} {'TX':>10} {'RX':>10} OWNER")
    lines = [head]
    for q in doc["qps"]:
        o = q["owner"] or {}
        lines.append(f"{_v(q['dev']):<8} {_qpn(q['qpn']):>8} {_v(q['state']):<5} {_v(q['type']):<4} "
                     f"{_qpn(q['remote_qpn']):>8} {_v(q['remote_addr']):<16} {_v(q['sq_psn']):>8} "
                     f"{_v(q['rq_psn']):>8} {_v(q['outstanding_send']):>5} {_v(q['outstanding_recv']):>5} "
                     f"{_v(q['retransmits']):>6} {human_bytes(q['bytes_tx']):>10} {human_bytes(q['bytes_rx']):>10} "
                     f"{_v(o.get('comm'))}[{_v(o.get('pid'))}]")
    if not doc["qps"]:
        lines.append("(no QPs)")
    return "\n".join(lines)


def format_qp(doc: dict) -> str:
    """Like `rdma res show qp lqpn N`: one line of key value pairs, then the counters."""
    q = doc["qp"]
    o = q["owner"] or {}
    first = (f"dev {_v(q['dev'])} lqpn {_qpn(q['qpn'])} type {_v(q['type'])} state {_v(q['state'])} "
             f"rqpn {_qpn(q['remote_qpn'])} raddr {_v(q['remote_addr'])} sq-psn {_v(q['sq_psn'])} "
             f"rq-psn {_v(q['rq_psn'])} pid {_v(o.get('pid'))} uid {_v(o.get('uid'))} comm {_v(o.get('comm'))}")
    second = (f"    outstanding-send {_v(q['outstanding_send'])} outstanding-recv {_v(q['outstanding_recv'])} "
              f"retransmits {_v(q['retransmits'])} naks-rx {_v(q['naks_rx'])} naks-tx {_v(q['naks_tx'])} "
              f"rnr {_v(q['rnr'])} rate {human_bps(q['rate_bps'])}")
    third = f"    bytes-tx {_v(q['bytes_tx'])} bytes-rx {_v(q['bytes_rx'])}"
    extra = {k: v for k, v in q.items() if k not in QP_FIELDS}
    out = [first, second, third]
    if extra:
        out.append("    " + " ".join(f"{k.replace('_', '-')} {_v(v)}" for k, v in extra.items()))
    return "\n".join(out)


def format_stat(doc: dict) -> str:
    t = doc["totals"]
    lines = [f"qps: {t['qps']} ({', '.join(f'{k} {v}' for k, v in sorted(t['qp_states'].items())) or 'none'}), "
             f"clients: {t['clients']}",
             f"bytes: tx {t['bytes_tx']} rx {t['bytes_rx']}; retransmits {t['retransmits']}; "
             f"naks rx {t['naks_rx']} tx {t['naks_tx']}; rnr {t['rnr']}"]
    for d in doc["devices"]:
        lines.append(f"{d['ifname']}:")
        counters = d["counters"] or {}
        for group, value in counters.items():
            if isinstance(value, dict):
                nz = {k: v for k, v in value.items() if v}
                lines.append(f"  {group}:" + ("" if nz else " (none)"))
                lines += [f"    {str(k).lower():<24} {v}" for k, v in nz.items()]
            else:
                lines.append(f"  {group:<26} {_v(value)}")
    for c in doc["clients"]:
        me = " (this command)" if c["pid"] == os.getpid() else ""
        lines.append(f"client {_v(c['comm'])}[{_v(c['pid'])}]{me} uid {_v(c['uid'])}: {_v(c['qps'])} QPs, "
                     f"{_v(c['mrs'])} MRs ({human_bytes(c['mr_bytes'])})")
    return "\n".join(lines)


def top_table(doc: dict, title: str = ""):
    """A rich Table of a top document (for rich.live.Live)."""
    from rich.table import Table
    t = Table(title=title or None, expand=False, box=None, header_style="bold")
    for name, just in (("DEV", "left"), ("QPN", "right"), ("STATE", "left"), ("PEER", "left"), ("TX", "right"),
                       ("RX", "right"), ("OUT_S", "right"), ("OUT_R", "right"), ("RETX", "right"),
                       ("OWNER", "left")):
        t.add_column(name, justify=just)
    for r in doc["qps"]:
        o = r["owner"] or {}
        t.add_row(_v(r["dev"]), _qpn(r["qpn"]), _v(r["state"]), f"{_v(r['remote_addr'])}/{_qpn(r['remote_qpn'])}",
                  human_bps(r["tx_bps"]), human_bps(r["rx_bps"]), _v(r["outstanding_send"]),
                  _v(r["outstanding_recv"]), _v(r["retransmits"]), f"{_v(o.get('comm'))}[{_v(o.get('pid'))}]")
    return t


def top_table_text(doc: dict) -> str:
    """A top document as plain text (stdout not a terminal, no --json): one block per refresh."""
    lines = [f"--- {time.strftime('%H:%M:%S', time.localtime(doc['time']))} {len(doc['qps'])} QPs",
             f"{'DEV':<8} {'QPN':>8} {'STATE':<5} {'TX':>12} {'RX':>12} {'OUT_S':>5} {'RETX':>6} OWNER"]
    for r in doc["qps"]:
        o = r["owner"] or {}
        lines.append(f"{_v(r['dev']):<8} {_qpn(r['qpn']):>8} {_v(r['state']):<5} {human_bps(r['tx_bps']):>12} "
                     f"{human_bps(r['rx_bps']):>12} {_v(r['outstanding_send']):>5} {_v(r['retransmits']):>6} "
                     f"{_v(o.get('comm'))}[{_v(o.get('pid'))}]")
    return "\n".join(lines)
