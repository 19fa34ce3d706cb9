"""`metaroce decode`: print MetaRoCE packets from a pcap/pcapng file or hex.

Readable by default (one line per packet, one indented line per extension
header), `--json` for one JSON object per packet.  Frames that are not
MetaRoCE (not IP/UDP/4791) are skipped and counted; a truncated or malformed
MetaRoCE frame is reported with the codec's reason, never a traceback.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from typing import Iterator, TextIO

from metaroce_xdp.wire import MalformedPacket, NotMetaRoCE, decode
from metaroce_xdp.wire.headers import NAK_NAMES

DLT_EN10MB = 1
DLT_LINUX_SLL = 113
DLT_LINUX_SLL2 = 276


class InputError(Exception):
    """The input itself cannot be read (missing file, not a capture, bad hex)."""


def parse_hex(text: str) -> bytes:
    s = text.strip()
    s = re.sub(r"0x", "", s, flags=re.I)
    s = re.sub(r"[\s:.\-]", "", s)
    if not s:
        raise InputError("empty hex string")
    if len(s) % 2 or not re.fullmatch(r"[0-9a-fA-F]*", s):
        raise InputError(f"not a hex byte string: {text[:40]!r}...")
    return bytes.fromhex(s)


def _sll_to_ether(linktype: int, data: bytes) -> bytes | None:
    """Turn a Linux cooked capture (tcpdump -i any) into an Ethernet-shaped frame."""
    if linktype == DLT_LINUX_SLL and len(data) >= 16:
        proto = data[14:16]
        return b"\0" * 12 + proto + data[16:]
    if linktype == DLT_LINUX_SLL2 and len(data) >= 20:
        proto = data[0:2]
        return b"\0" * 12 + proto + data[20:]
    return None


def read_pcap(path: str) -> Iterator[bytes | None]:
    """Yield each frame as Ethernet bytes (None for link types we cannot decode)."""
    try:
        from scapy.utils import RawPcapNgReader, RawPcapReader
    except ImportError as e:  # pragma: no cover
        raise InputError(f"scapy is required to read captures: {e}") from e
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise InputError(f"cannot open {path}: {e.strerror}") from None
    if len(magic) < 4:
        raise InputError(f"{path}: empty or not a capture file")
    try:
        reader = RawPcapNgReader(path) if magic == b"\x0a\x0d\x0d\x0a" else RawPcapReader(path)
    except Exception as e:
        raise InputError(f"{path}: not a pcap/pcapng file ({e})") from None
    with reader:
        for item in reader:
            data, meta = item
            linktype = getattr(meta, "linktype", None) or getattr(reader, "linktype", DLT_EN10MB)
            if linktype == DLT_EN10MB:
                yield data
            else:
                yield _sll_to_ether(linktype, data)


@dataclass
class Summary:
    frames: int = 0
    metaroce: int = 0
    icrc_bad: int = 0
    malformed: int = 0
    skipped: int = 0
    by_opcode: dict = field(default_factory=dict)


def _fmt_ext(name: str, h: dict) -> str:
    if name == "aeth":
        return f"AETH {h['text']} (syndrome {h['syndrome']:#04x}) msn={h['msn']}"
    if name == "reth":
        return f"RETH va={h['va']:#x} rkey={h['rkey']:#010x} dma_len={h['dma_len']}"
    if name == "atomiceth":
        return (f"AtomicETH va={h['va']:#x} rkey={h['rkey']:#010x} swap_add={h['swap_add']:#x} "
                f"compare={h['compare']:#x}")
    if name == "atomicacketh":
        return f"AtomicAckETH orig={h['orig']:#x}"
    if name == "immdt":
        return f"ImmDt {h['imm']:#010x}"
    if name == "ieth":
        return f"IETH rkey={h['rkey']:#010x}"
    if name == "cnp":
        return "CNP reserved=" + h["resv"]
    if name == "neth":
        fl = "".join(c for c, on in (("F", h["first"]), ("L", h["last"]), ("R", h["retx"])) if on) or "-"
        return (f"NETH flags={fl} msn={h['msn']} offset={h['offset']} msg_len={h['msg_len']} "
                f"tsval={h['tsval']}")
    if name == "sacketh":
        return (f"SACKETH tsecr={h['tsecr']} credit={h['credit']} ce_count={h['ce_count']} "
                f"echo_sport={h['echo_sport']} words={h['bitmap_words']} received={h['received_psns']}")
    return f"{name} {h}"


def format_packet(n: int, d: dict) -> str:
    ip = d["ip"]
    flags = "".join(c for c, on in (("A", d["ack_req"]), ("S", d["se"]), ("F", d["fecn"]), ("B", d["becn"])) if on)
    icrc = "ok" if d["icrc_ok"] else ("BAD" if d["icrc_ok"] is False else "unchecked")
    head = (f"#{n:<4} {ip['src']}:{d['udp']['sport']} > {ip['dst']}:{d['udp']['dport']}  "
            f"{d['opcode_name']} ({d['opcode']:#04x})  QP {d['dest_qp']:#08x}  PSN {d['psn']}"
            f"{'  [' + flags + ']' if flags else ''}  payload {d['payload_len']}  ICRC {icrc}")
    lines = [head]
    for name in ("reth", "atomiceth", "aeth", "atomicacketh", "neth", "sacketh", "immdt", "ieth", "cnp"):
        if name in d:
            lines.append("       " + _fmt_ext(name, d[name]))
    return "\n".join(lines)


def run(frames: Iterator[bytes | None], out: TextIO, as_json: bool, show_all: bool = False) -> Summary:
    s = Summary()
    for n, frame in enumerate(frames, 1):
        s.frames += 1
        if frame is None:
            s.skipped += 1
            continue
        try:
            pkt = decode(frame)
        except NotMetaRoCE as e:
            s.skipped += 1
            if show_all:
                if as_json:
                    out.write(json.dumps({"frame": n, "skipped": True, "reason": e.reason.name.lower()}) + "\n")
                else:
                    out.write(f"#{n:<4} (not MetaRoCE: {e})\n")
            continue
        except MalformedPacket as e:
            s.malformed += 1
            if as_json:
                out.write(json.dumps({"frame": n, "error": "malformed", "reason": e.reason.name.lower(),
                                      "detail": e.detail, "offset": e.offset, "frame_len": len(frame)}) + "\n")
            else:
                out.write(f"#{n:<4} MALFORMED MetaRoCE frame ({len(frame)} bytes): {e}\n")
            continue
        d = pkt.to_dict()
        s.metaroce += 1
        s.by_opcode[d["opcode_name"]] = s.by_opcode.get(d["opcode_name"], 0) + 1
        if not pkt.icrc_ok:
            s.icrc_bad += 1
        if as_json:
            out.write(json.dumps({"frame": n, **d}) + "\n")
        else:
            out.write(format_packet(n, d) + "\n")
    return s


def summary_line(s: Summary) -> str:
    return (f"{s.frames} frames: {s.metaroce} MetaRoCE ({s.icrc_bad} with bad ICRC), "
            f"{s.malformed} malformed, {s.skipped} not MetaRoCE")


__all__ = ["InputError", "parse_hex", "read_pcap", "run", "summary_line", "NAK_NAMES"]
