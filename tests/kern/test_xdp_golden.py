"""Golden packets through the MetaRoCE XDP program (bpf/metaroce_xdp.c).

katran/cilium style: each case is a description, an input frame built with
the codec (or by hand where the codec refuses to build it), the map setup,
the expected verdict, the expected counter and the expected effect on the
QP's shared state.  Negative cases are first-class.  Frames run through
BPF_PROG_TEST_RUN on the loaded program.

About redirects: test_run without live frames runs the program only; with no
AF_XDP socket in mr_xsks, bpf_redirect_map(..., 0) returns XDP_ABORTED and
the program turns that into XDP_DROP counted as NO_XSK.  So "steered" cases
here expect DROP/NO_XSK: the packet passed every check and reached the
redirect (the netns test at the bottom covers the real wire).

Every packet is exactly one of PASSED, STEERED, *_CONSUMED, DROPPED: each
case checks that the event deltas sum to one.
"""
from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from metaroce_xdp.kern.loader import pin_name
from typing import Callable

import pytest

from metaroce_xdp.wire import AETH, RETH, SACKETH, AtomicAckETH, AtomicETH, NETH, Op, Vlan, encode
from metaroce_xdp.wire.packet import inet_checksum

pytestmark = pytest.mark.root
pytest.importorskip("bcc")

from metaroce_xdp.kern import DropReason, Event, Profile, QpFlag, QpState, XdpLoader  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LOCAL4, PEER4 = "10.55.0.2", "10.55.0.1"
LOCAL6, PEER6 = "fd00:55::2", "fd00:55::1"
QPN, QPN6, QPN_NATIVE = 0x11, 0x12, 0x13
INIT_PSN, SND_NXT = 100, 110          # PSNs 100..109 outstanding; ack_psn starts at 99
MAC_SRC, MAC_DST = bytes.fromhex("020000000001"), bytes.fromhex("020000000002")


# --------------------------------------------------------------------------- frames
def eth(ethertype: int, vlan: int | None = None) -> bytes:
    if vlan is None:
        return MAC_DST + MAC_SRC + struct.pack("!H", ethertype)
    return MAC_DST + MAC_SRC + struct.pack("!HHH", 0x8100, vlan, ethertype)


def ipv4(proto: int, l4: bytes, src=PEER4, dst=LOCAL4, options: bytes = b"", frag: int = 0x4000) -> bytes:
    ihl = 5 + len(options) // 4
    hdr = struct.pack("!BBHHHBBH4s4s", 0x40 | ihl, 0, ihl * 4 + len(l4), 0, frag, 64, proto, 0,
                      socket.inet_aton(src), socket.inet_aton(dst)) + options
    hdr = hdr[:10] + struct.pack("!H", inet_checksum(hdr)) + hdr[12:]
    return eth(0x0800) + hdr + l4


def udp(dport: int, payload: bytes, sport: int = 49152, length: int | None = None) -> bytes:
    return struct.pack("!HHHH", sport, dport, length if length is not None else 8 + len(payload), 0) + payload


def arp() -> bytes:
    return (b"\xff" * 6 + MAC_SRC + struct.pack("!H", 0x0806) +
            struct.pack("!HHBBH6s4s6s4s", 1, 0x0800, 6, 4, 1, MAC_SRC, socket.inet_aton(PEER4),
                        b"\0" * 6, socket.inet_aton(LOCAL4)))


def ack(psn: int, syndrome: int = 0x1F, msn: int = 7, qp: int = QPN, **kw) -> bytes:
    return encode(Op.ACKNOWLEDGE, dest_qp=qp, psn=psn, src_ip=kw.pop("src_ip", PEER4),
                  dst_ip=kw.pop("dst_ip", LOCAL4), headers={"aeth": AETH(syndrome=syndrome, msn=msn)}, **kw)


def write(qp: int = QPN, psn: int = 5, **kw) -> bytes:
    return encode(Op.RDMA_WRITE_ONLY, dest_qp=qp, psn=psn, src_ip=kw.pop("src_ip", PEER4),
                  dst_ip=kw.pop("dst_ip", LOCAL4),
                  headers={"reth": RETH(va=0x1000, rkey=0x1234, dma_len=8)}, payload=b"8 bytes!", **kw)


def patch(frame: bytes, off: int, data: bytes) -> bytes:
    return frame[:off] + data + frame[off + len(data):]


UDP_OFF = 14 + 20
BTH_OFF = UDP_OFF + 8


def roce_raw(after_udp: bytes) -> bytes:
    """UDP/4791 to us with arbitrary bytes after the UDP header (lengths consistent)."""
    return ipv4(17, udp(4791, after_udp))


def bth(opcode: int, qp: int = QPN, psn: int = 0, flags: int = 0) -> bytes:
    return struct.pack("!BBHII", opcode, flags, 0xFFFF, qp, psn)


def fix_ip_csum(frame: bytes) -> bytes:
    """Recompute the IPv4 header checksum, as a router that rewrote TTL or ECN does."""
    hdr = frame[14:20 + 14]
    hdr = hdr[:10] + b"\0\0" + hdr[12:]
    return frame[:14] + hdr[:10] + struct.pack("!H", inet_checksum(hdr)) + frame[14 + 12:]


def bad_ip_csum(frame: bytes) -> bytes:
    c = struct.unpack_from("!H", frame, 14 + 10)[0]
    return patch(frame, 14 + 10, struct.pack("!H", c ^ 0x0101))


def set_ce(frame: bytes) -> bytes:
    """ECN CE on an IPv4 frame, checksum fixed: what a congested switch does."""
    return fix_ip_csum(patch(frame, 15, bytes([frame[15] | 3])))


def cnp(qp: int = QPN, **kw) -> bytes:
    return encode(Op.CNP, dest_qp=qp, becn=1, src_ip=kw.pop("src_ip", PEER4), dst_ip=kw.pop("dst_ip", LOCAL4),
                  dscp=48, **kw)


def ipv6_ext(chain=(0,), dport: int = 4791, dst: str = LOCAL6, frag_off: int = 0) -> bytes:
    """IPv6 whose Next Header is an extension header chain (hop-by-hop 0, destination options 60:
    8 bytes each; fragment 44 with offset `frag_off`) in front of UDP carrying a WRITE's BTH on."""
    l4 = udp(dport, write(qp=QPN6, src_ip=PEER6, dst_ip=LOCAL6)[14 + 40 + 8:])
    exts = b""
    for i, t in enumerate(chain):
        nxt = chain[i + 1] if i + 1 < len(chain) else 17
        exts += (struct.pack("!BBHI", nxt, 0, frag_off << 3, 1) if t == 44
                 else struct.pack("!BB6s", nxt, 0, b"\x01\x04\0\0\0\0"))
    ip6 = struct.pack("!IHBB16s16s", 0x60000000, len(exts) + len(l4), chain[0], 64,
                      socket.inet_pton(socket.AF_INET6, PEER6), socket.inet_pton(socket.AF_INET6, dst))
    return eth(0x86DD) + ip6 + exts + l4


# --------------------------------------------------------------------------- cases
@dataclass
class Case:
    desc: str
    frame: Callable[[], bytes]
    verdict: str                                   # XDP_PASS / XDP_DROP
    event: Event
    reason: DropReason | None = None
    setup: Callable[["XdpLoader"], None] | None = None
    qp: dict = field(default_factory=dict)         # expected QP fields after (slot of QPN)
    qpn: int = QPN
    also: dict = field(default_factory=dict)       # expected deltas of events outside the partition


def _state(s: QpState):
    return lambda ld: ld.set_qp_state(QPN, s)


def _flags(f: int):
    def go(ld):
        ld.qp(QPN)["flags"] = f
    return go


def _pkey(k: int):
    def go(ld):
        ld.qp(QPN)["pkey"] = k
    return go


def _req(comp: int | None = None, nak_read: int | None = None, ack_psn: int | None = None):
    """What the completer publishes (comp_psn, nak_read_psn) and what the kernel has acknowledged."""
    def go(ld):
        s = ld.qp(QPN)
        for name, v in (("comp_psn", comp), ("nak_read_psn", nak_read), ("ack_psn", ack_psn)):
            if v is not None:
                s[name] = v
    return go


def _probe(psn: int, age_ns: int):
    def go(ld):
        ld.qp(QPN)["rtt_probe_psn"] = psn
        ld.qp(QPN)["rtt_probe_ns"] = time.monotonic_ns() - age_ns
    return go


R, E = DropReason, Event
CASES = [
    # ---- not MetaRoCE for us: the stack gets it untouched (MR-ENC-005, MR-ENC-032 step 1)
    Case("ARP request", arp, "XDP_PASS", E.PASSED),
    Case("ICMP echo", lambda: ipv4(1, b"\x08\0\0\0\0\1\0\1" + b"x" * 16), "XDP_PASS", E.PASSED),
    Case("TCP to port 22", lambda: ipv4(6, struct.pack("!HHIIBBHHH", 40000, 22, 1, 0, 0x50, 2, 1024, 0, 0)),
         "XDP_PASS", E.PASSED),
    Case("UDP to port 53", lambda: ipv4(17, udp(53, b"\0" * 20)), "XDP_PASS", E.PASSED),
    Case("UDP/4791 to another address", lambda: write(dst_ip="10.55.0.77"), "XDP_PASS", E.PASSED),
    Case("ICMP with IP options (legal IP, not ours)",
         lambda: ipv4(1, b"\x08\0\0\0\0\1\0\1", options=b"\x94\x04\0\0"), "XDP_PASS", E.PASSED),
    Case("non-first fragment (no UDP header to judge)",
         lambda: ipv4(17, b"\0" * 24, frag=0x0003), "XDP_PASS", E.PASSED),
    # (A frame shorter than Ethernet cannot be tested: BPF_PROG_TEST_RUN refuses < 14 bytes.)
    Case("two VLAN tags (only one allowed: not IP to us)",
         lambda: MAC_DST + MAC_SRC + struct.pack("!HHHH", 0x88A8, 5, 0x8100, 6) + write()[12:],
         "XDP_PASS", E.PASSED),
    Case("two 802.1Q tags (MR-ENC-005)",
         lambda: MAC_DST + MAC_SRC + struct.pack("!HHHH", 0x8100, 5, 0x8100, 6) + write()[12:],
         "XDP_PASS", E.PASSED),
    Case("one 802.1ad tag is not MetaRoCE: to the stack (MR-ENC-005)",
         lambda: MAC_DST + MAC_SRC + struct.pack("!HH", 0x88A8, 5) + write()[12:], "XDP_PASS", E.PASSED),
    Case("IPv6 extension header, not in front of UDP/4791: not ours (MR-ENC-015)",
         lambda: ipv6_ext(dport=53), "XDP_PASS", E.PASSED),
    Case("IPv6 non-first fragment: no UDP header to judge (MR-ENC-015)",
         lambda: ipv6_ext(chain=(44,), frag_off=8), "XDP_PASS", E.PASSED),
    Case("IPv4 bad header checksum on UDP 53 is the stack's business (MR-ENC-013)",
         lambda: bad_ip_csum(ipv4(17, udp(53, b"\0" * 20))), "XDP_PASS", E.PASSED),
    # ---- malformed MetaRoCE: dropped with the codec's reason (MR-ENC-009, MR-ENC-010, MR-ENC-014,
    # MR-BTH-007, MR-OPC-003, MR-ENC-027, MR-XH-027)
    Case("IPv4 with options around UDP/4791", lambda: ipv4(17, udp(4791, write()[BTH_OFF:]),
                                                           options=b"\x94\x04\0\0"),
         "XDP_DROP", E.DROPPED, R.IP_OPTIONS),
    Case("first fragment of UDP/4791", lambda: ipv4(17, udp(4791, write()[BTH_OFF:]), frag=0x2000),
         "XDP_DROP", E.DROPPED, R.IP_FRAGMENT),
    # ---- IPv4 header checksum (MR-ENC-013, MR-ENC-032 step 4) and IPv6 Next Header (MR-ENC-015, step 2)
    Case("IPv4 header checksum wrong on a WRITE", lambda: bad_ip_csum(write()), "XDP_DROP", E.DROPPED,
         R.BAD_IP_CSUM),
    Case("IPv4 header checksum wrong on an ACK moves nothing", lambda: bad_ip_csum(ack(105)), "XDP_DROP",
         E.DROPPED, R.BAD_IP_CSUM, qp={"ack_psn": 99, "acks": 0}),
    Case("IPv4 header with a flipped address bit and the old checksum",
         lambda: patch(write(), 14 + 12, b"\x0b"), "XDP_DROP", E.DROPPED, R.BAD_IP_CSUM),
    Case("options are refused before the checksum is looked at (step 2 before 4)",
         lambda: bad_ip_csum(ipv4(17, udp(4791, write()[BTH_OFF:]), options=b"\x94\x04\0\0")),
         "XDP_DROP", E.DROPPED, R.IP_OPTIONS),
    Case("IPv6 hop-by-hop header in front of UDP/4791", lambda: ipv6_ext(), "XDP_DROP", E.DROPPED,
         R.IP_OPTIONS),
    Case("IPv6 destination options + first fragment in front of UDP/4791",
         lambda: ipv6_ext(chain=(60, 44)), "XDP_DROP", E.DROPPED, R.IP_OPTIONS),
    Case("IPv6 extension headers around UDP/4791 to another address",
         lambda: ipv6_ext(dst=PEER6), "XDP_PASS", E.PASSED),
    Case("IP total length beyond the frame", lambda: fix_ip_csum(patch(write(), 14 + 2, struct.pack("!H", 400))),
         "XDP_DROP", E.DROPPED, R.BAD_IP_HEADER),
    Case("UDP length disagrees with IP", lambda: patch(write(), UDP_OFF + 4, struct.pack("!H", 30)),
         "XDP_DROP", E.DROPPED, R.BAD_UDP_LENGTH),
    Case("truncated BTH (8 bytes after UDP)", lambda: roce_raw(b"\x0a" + b"\0" * 7), "XDP_DROP",
         E.DROPPED, R.TRUNCATED_BTH),
    Case("bad TVer", lambda: write(tver=1), "XDP_DROP", E.DROPPED, R.BAD_TVER),
    Case("unknown opcode 0x15", lambda: patch(write(), BTH_OFF, b"\x15"), "XDP_DROP", E.DROPPED,
         R.UNKNOWN_OPCODE),
    Case("WRITE_ONLY with a cut RETH", lambda: roce_raw(bth(0x0A) + b"\0" * 8 + b"\0" * 4), "XDP_DROP",
         E.DROPPED, R.TRUNCATED_EXT),
    Case("ACK carrying payload", lambda: roce_raw(bth(0x11) + b"\0" * 4 + b"\0" * 4 + b"\0" * 4),
         "XDP_DROP", E.DROPPED, R.BAD_PAD),
    Case("payload not a multiple of 4", lambda: roce_raw(bth(0x04) + b"abc" + b"\0" * 4), "XDP_DROP",
         E.DROPPED, R.BAD_PAD),
    Case("SACK with 33 bitmap words",
         lambda: encode(Op.NATIVE_SACK, dest_qp=QPN_NATIVE, psn=1, src_ip=PEER4, dst_ip=LOCAL4,
                        headers={"aeth": AETH(syndrome=0x1F, msn=0), "sacketh": SACKETH(bitmap_words=33)},
                        sack_bitmap=[0] * 33), "XDP_DROP", E.DROPPED, R.BAD_FIELD),
    # ---- validation pipeline (MR-BTH-015, MR-BTH-016, MR-SEC-009, MR-SEC-021, MR-QP-020, MR-OPC-004)
    Case("unknown QP (empty slot)", lambda: write(qp=0x99), "XDP_DROP", E.DROPPED, R.UNKNOWN_QP),
    Case("QPN collides with a live slot", lambda: write(qp=QPN + 1024), "XDP_DROP", E.DROPPED, R.UNKNOWN_QP),
    Case("QPN 0 never matches", lambda: write(qp=0), "XDP_DROP", E.DROPPED, R.UNKNOWN_QP),
    Case("wrong peer (MR-SEC)", lambda: write(src_ip="10.55.0.9"), "XDP_DROP", E.DROPPED, R.WRONG_PEER),
    Case("wrong peer on the ACK path", lambda: ack(105, src_ip="10.55.0.9"), "XDP_DROP", E.DROPPED,
         R.WRONG_PEER, qp={"ack_psn": 99, "acks": 0}),
    Case("QP in RESET takes no request", write, "XDP_DROP", E.DROPPED, R.QP_STATE, setup=_state(QpState.RESET)),
    Case("QP in INIT takes no request", write, "XDP_DROP", E.DROPPED, R.QP_STATE, setup=_state(QpState.INIT)),
    Case("QP in ERR takes no request", write, "XDP_DROP", E.DROPPED, R.QP_STATE, setup=_state(QpState.ERR)),
    Case("QP in RTR takes no ACK", lambda: ack(105), "XDP_DROP", E.DROPPED, R.QP_STATE,
         setup=_state(QpState.RTR), qp={"ack_psn": 99}),
    Case("QP in RESET takes no ACK", lambda: ack(105), "XDP_DROP", E.DROPPED, R.QP_STATE,
         setup=_state(QpState.RESET), qp={"ack_psn": 99}),
    # ---- P_Key (MR-BTH-010, MR-BTH-009; MR-ENC-032 step 13)
    Case("P_Key of another partition", lambda: write(pkey=0xFFFE), "XDP_DROP", E.DROPPED, R.BAD_PKEY),
    Case("invalid P_Key 0x0000", lambda: write(pkey=0x0000), "XDP_DROP", E.DROPPED, R.BAD_PKEY),
    Case("invalid P_Key 0x8000", lambda: write(pkey=0x8000), "XDP_DROP", E.DROPPED, R.BAD_PKEY),
    Case("invalid P_Key 0x8000 even on a QP whose key is 0x8000", lambda: write(pkey=0x8000), "XDP_DROP",
         E.DROPPED, R.BAD_PKEY, setup=_pkey(0x8000)),
    Case("limited-member P_Key 0x7FFF matches the full key 0xFFFF", lambda: write(pkey=0x7FFF), "XDP_DROP",
         E.DROPPED, R.NO_XSK),
    Case("full-member P_Key 0x8123 matches a limited QP key 0x0123", lambda: write(pkey=0x8123), "XDP_DROP",
         E.DROPPED, R.NO_XSK, setup=_pkey(0x0123)),
    Case("two limited members do not talk: 0x0123 vs 0x0123", lambda: write(pkey=0x0123), "XDP_DROP",
         E.DROPPED, R.BAD_PKEY, setup=_pkey(0x0123)),
    Case("P_Key checked on the ACK path too", lambda: ack(105, pkey=0x1234), "XDP_DROP", E.DROPPED,
         R.BAD_PKEY, qp={"ack_psn": 99, "acks": 0}),
    Case("wrong peer is refused before the P_Key (step 11 before 13)",
         lambda: write(src_ip="10.55.0.9", pkey=0), "XDP_DROP", E.DROPPED, R.WRONG_PEER),
    Case("P_Key before QP state (step 13 before 14)", lambda: write(pkey=0x0000), "XDP_DROP", E.DROPPED,
         R.BAD_PKEY, setup=_state(QpState.INIT)),
    Case("QP state before profile (step 14 before 15)",
         lambda: encode(Op.NATIVE_SEND, dest_qp=QPN, psn=1, src_ip=PEER4, dst_ip=LOCAL4,
                        headers={"neth": NETH(flags=0xC0, msg_len=4)}, payload=b"abcd"),
         "XDP_DROP", E.DROPPED, R.QP_STATE, setup=_state(QpState.ERR)),
    Case("native opcode on a compat QP",
         lambda: encode(Op.NATIVE_SEND, dest_qp=QPN, psn=1, src_ip=PEER4, dst_ip=LOCAL4,
                        headers={"neth": NETH(flags=0xC0, msg_len=4)}, payload=b"abcd"),
         "XDP_DROP", E.DROPPED, R.WRONG_PROFILE),
    # ---- steered (no socket in test_run: NO_XSK, see module doc; MR-OPC-006)
    Case("RDMA WRITE ONLY in RTS", write, "XDP_DROP", E.DROPPED, R.NO_XSK),
    Case("SEND ONLY in RTR", lambda: encode(Op.SEND_ONLY, dest_qp=QPN, src_ip=PEER4, dst_ip=LOCAL4,
                                            payload=b"hi"),
         "XDP_DROP", E.DROPPED, R.NO_XSK, setup=_state(QpState.RTR)),
    Case("READ RESPONSE ONLY goes to user space",
         lambda: encode(Op.RDMA_READ_RESPONSE_ONLY, dest_qp=QPN, psn=101, src_ip=PEER4, dst_ip=LOCAL4,
                        headers={"aeth": AETH(syndrome=0x1F, msn=1)}, payload=b"data"),
         "XDP_DROP", E.DROPPED, R.NO_XSK, qp={"ack_psn": 99}),
    Case("ATOMIC ACKNOWLEDGE goes to user space",
         lambda: encode(Op.ATOMIC_ACKNOWLEDGE, dest_qp=QPN, psn=101, src_ip=PEER4, dst_ip=LOCAL4,
                        headers={"aeth": AETH(syndrome=0x1F, msn=1), "atomicacketh": AtomicAckETH(orig=5)}),
         "XDP_DROP", E.DROPPED, R.NO_XSK, qp={"ack_psn": 99}),
    # ---- CNPs (MR-CNP-005, MR-CNP-010, MR-ENC-032, MR-ICRC-014, MR-BTH-022): verified, counted, consumed
    Case("CNP is verified, counted and consumed", lambda: cnp(), "XDP_DROP", E.CNP_CONSUMED,
         qp={"cnp_count": 1, "ack_psn": 99}),
    Case("CNP with a corrupt ICRC is not counted", lambda: patch(cnp(), len(cnp()) - 2, b"\x00"), "XDP_DROP",
         E.DROPPED, R.BAD_ICRC, qp={"cnp_count": 0}),
    Case("CNP with a corrupt reserved byte is not counted", lambda: patch(cnp(), BTH_OFF + 12 + 3, b"\x01"),
         "XDP_DROP", E.DROPPED, R.BAD_ICRC, qp={"cnp_count": 0, "cnp_discarded": 0}),
    Case("CE-marked CNP with a fixed IP checksum still verifies (ECN is masked)",
         lambda: set_ce(cnp()), "XDP_DROP", E.CNP_CONSUMED, qp={"cnp_count": 1, "cnp_discarded": 0}),
    Case("CNP over IPv6 (76-byte ICRC input)", lambda: cnp(qp=QPN6, src_ip=PEER6, dst_ip=LOCAL6), "XDP_DROP",
         E.CNP_CONSUMED, qpn=QPN6, qp={"cnp_count": 1}),
    Case("corrupt CNP over IPv6", lambda: patch(cnp(qp=QPN6, src_ip=PEER6, dst_ip=LOCAL6), -1, b"\x00"),
         "XDP_DROP", E.DROPPED, R.BAD_ICRC, qpn=QPN6, qp={"cnp_count": 0}),
    Case("CNP from a spoofed source is not counted", lambda: cnp(src_ip="10.55.0.9"), "XDP_DROP", E.DROPPED,
         R.WRONG_PEER, qp={"cnp_count": 0, "cnp_discarded": 1}),
    Case("CNP for a QP in SQD is not counted (only RTS)", lambda: cnp(), "XDP_DROP", E.DROPPED, R.QP_STATE,
         setup=_state(QpState.SQD), qp={"cnp_count": 0, "cnp_discarded": 1}),
    Case("CNP for a QP in RTR is not counted", lambda: cnp(), "XDP_DROP", E.DROPPED, R.QP_STATE,
         setup=_state(QpState.RTR), qp={"cnp_count": 0, "cnp_discarded": 1}),
    Case("CNP with an invalid P_Key is not counted", lambda: cnp(pkey=0x8000), "XDP_DROP", E.DROPPED,
         R.BAD_PKEY, qp={"cnp_count": 0, "cnp_discarded": 1}),
    Case("CNP steered, not counted, when the QP says ACK_TO_USER", lambda: cnp(), "XDP_DROP", E.DROPPED,
         R.NO_XSK, setup=_flags(QpFlag.ACK_TO_USER), qp={"cnp_count": 0}),
    # ---- a native QP takes 0xC0-0xC6 and 0x12-0x14 only: a CNP is dropped, not counted (MR-NAT-007,
    # MR-CC-026); a compat WRITE too; an atomic is accepted
    Case("CNP on a native QP is dropped as WRONG_PROFILE", lambda: cnp(qp=QPN_NATIVE), "XDP_DROP", E.DROPPED,
         R.WRONG_PROFILE, qpn=QPN_NATIVE, qp={"cnp_count": 0, "cnp_discarded": 1}),
    Case("compat WRITE on a native QP", lambda: write(qp=QPN_NATIVE), "XDP_DROP", E.DROPPED, R.WRONG_PROFILE,
         qpn=QPN_NATIVE),
    Case("FETCH_ADD on a native QP is steered",
         lambda: encode(Op.FETCH_ADD, dest_qp=QPN_NATIVE, psn=1, src_ip=PEER4, dst_ip=LOCAL4,
                        headers={"atomiceth": AtomicETH(va=0, rkey=1, swap_add=1, compare=0)}),
         "XDP_DROP", E.DROPPED, R.NO_XSK, qpn=QPN_NATIVE),
    # ---- CE-marked data is delivered like any other (MR-ECN-006); the CNP is user space's (MR-ECN-009)
    Case("CE-marked WRITE with its IP checksum fixed is steered", lambda: set_ce(write(ecn=2)), "XDP_DROP",
         E.DROPPED, R.NO_XSK),
    Case("CE-marked WRITE over IPv6 is steered",
         lambda: write(qp=QPN6, src_ip=PEER6, dst_ip=LOCAL6, ecn=3), "XDP_DROP", E.DROPPED, R.NO_XSK, qpn=QPN6),
    Case("CE mark without the checksum fix is a bad IP checksum", lambda: patch(write(ecn=2), 15, b"\x03"),
         "XDP_DROP", E.DROPPED, R.BAD_IP_CSUM),
    Case("VLAN-tagged WRITE", lambda: write(vlan=Vlan(vid=10)), "XDP_DROP", E.DROPPED, R.NO_XSK),
    Case("IPv6 WRITE", lambda: write(qp=QPN6, src_ip=PEER6, dst_ip=LOCAL6), "XDP_DROP", E.DROPPED, R.NO_XSK,
         qpn=QPN6),
    Case("native WRITE on a native QP",
         lambda: encode(Op.NATIVE_WRITE, dest_qp=QPN_NATIVE, psn=1, src_ip=PEER4, dst_ip=LOCAL4,
                        headers={"reth": RETH(va=0, rkey=1, dma_len=4), "neth": NETH(flags=0xC0, msg_len=4)},
                        payload=b"abcd"), "XDP_DROP", E.DROPPED, R.NO_XSK, qpn=QPN_NATIVE),
    Case("ACK steered when the QP says ACK_TO_USER", lambda: ack(105), "XDP_DROP", E.DROPPED, R.NO_XSK,
         setup=_flags(QpFlag.ACK_TO_USER), qp={"ack_psn": 99, "acks": 0}),
    # ---- the ACK fast path (MR-ACK-002, MR-NAK-001, MR-RNR-002, MR-SEC-022; ICRC MR-ICRC-007, MR-ICRC-014)
    Case("ACK moves ack_psn", lambda: ack(105, msn=3), "XDP_DROP", E.ACK_CONSUMED,
         qp={"ack_psn": 105, "ack_msn": 3, "acks": 1, "ack_seq": 2, "last_syndrome": 0x1F, "stale_acks": 0}),
    Case("ACK in SQD and SQE too", lambda: ack(101), "XDP_DROP", E.ACK_CONSUMED, setup=_state(QpState.SQE),
         qp={"ack_psn": 101}),
    Case("duplicate ACK of ack_psn takes its MSN, moves nothing, counts stale (MR-ACK-015 (c))", lambda: ack(99),
         "XDP_DROP", E.ACK_CONSUMED, qp={"ack_psn": 99, "acks": 1, "ack_seq": 2, "stale_acks": 1}),
    Case("ACK of the last sent PSN", lambda: ack(109), "XDP_DROP", E.ACK_CONSUMED, qp={"ack_psn": 109}),
    Case("NAK PSN sequence error", lambda: ack(103, syndrome=0x60), "XDP_DROP", E.NAK_CONSUMED,
         qp={"ack_psn": 102, "nak_psn": 103, "nak_code": 0, "nak_seq": 1, "naks": 1, "acks": 0,
             "last_syndrome": 0x60}),
    Case("NAK remote access error", lambda: ack(100, syndrome=0x62), "XDP_DROP", E.NAK_CONSUMED,
         qp={"ack_psn": 99, "nak_psn": 100, "nak_code": 2, "nak_seq": 1}),
    Case("RNR NAK", lambda: ack(101, syndrome=0x25), "XDP_DROP", E.RNR_CONSUMED,
         qp={"ack_psn": 100, "rnr_psn": 101, "rnr_timer": 5, "rnr_seq": 1, "rnr_naks": 1}),
    Case("ACK over VLAN", lambda: ack(104, vlan=Vlan(vid=10)), "XDP_DROP", E.ACK_CONSUMED, qp={"ack_psn": 104}),
    Case("ACK over IPv6 (v6 ICRC)", lambda: ack(104, qp=QPN6, src_ip=PEER6, dst_ip=LOCAL6), "XDP_DROP",
         E.ACK_CONSUMED, qpn=QPN6, qp={"ack_psn": 104, "acks": 1}),
    Case("ghost ACK: PSN == snd_nxt (MR-ACK-015 (a))", lambda: ack(SND_NXT), "XDP_DROP", E.DROPPED, R.GHOST_ACK,
         qp={"ack_psn": 99, "ghost_acks": 1, "stale_acks": 0, "ack_seq": 0, "acks": 0}),
    Case("stale ACK: before ack_psn", lambda: ack(98), "XDP_DROP", E.DROPPED, R.STALE_ACK,
         qp={"ack_psn": 99, "stale_acks": 1, "ghost_acks": 0}),
    Case("ghost NAK far ahead", lambda: ack(0x800000, syndrome=0x60), "XDP_DROP", E.DROPPED, R.GHOST_ACK,
         qp={"nak_seq": 0, "ghost_acks": 1, "stale_acks": 0}),
    Case("corrupt ICRC on an ACK moves nothing", lambda: patch(ack(105), len(ack(105)) - 1, b"\x00"),
         "XDP_DROP", E.DROPPED, R.BAD_ICRC, qp={"ack_psn": 99, "acks": 0, "ack_seq": 0}),
    Case("corrupt PSN (ICRC no longer matches)", lambda: patch(ack(105), BTH_OFF + 11, b"\x68"),
         "XDP_DROP", E.DROPPED, R.BAD_ICRC, qp={"ack_psn": 99}),
    Case("masked fields may change: TTL/ECN/FECN do not break the ICRC",
         lambda: fix_ip_csum(patch(patch(ack(105), 14 + 8, b"\x05"), BTH_OFF + 4, b"\x80")), "XDP_DROP",
         E.ACK_CONSUMED, qp={"ack_psn": 105}),
    # ---- a bad AETH (bit 7 set or type 10, MR-XH-008) is the completer's to fail with IBV_WC_BAD_RESP_ERR
    # (MR-NAK-012): steered, changing nothing here (NO_XSK: no socket under test_run); before the window it
    # is stale and can move no QP to ERR (MR-SEC-032)
    Case("AETH type 10 goes to the completer (MR-XH-008, MR-NAK-012)", lambda: ack(105, syndrome=0x40),
         "XDP_DROP", E.DROPPED, R.NO_XSK,
         qp={"ack_psn": 99, "ack_seq": 0, "acks": 0, "naks": 0, "stale_acks": 0, "last_syndrome": 0},
         also={"ACK_BAD_AETH_TO_USER": 1}),
    Case("AETH bit 7 set goes to the completer (MR-XH-008, MR-NAK-012)", lambda: ack(100, syndrome=0x9F),
         "XDP_DROP", E.DROPPED, R.NO_XSK, qp={"ack_psn": 99, "ack_seq": 0, "acks": 0},
         also={"ACK_BAD_AETH_TO_USER": 1}),
    Case("AETH bit 7 set on a NAK goes to the completer (MR-XH-008)", lambda: ack(109, syndrome=0xE0),
         "XDP_DROP", E.DROPPED, R.NO_XSK, qp={"ack_psn": 99, "nak_seq": 0, "naks": 0},
         also={"ACK_BAD_AETH_TO_USER": 1}),
    Case("bad AETH at ack_psn is stale, not a bad response (MR-SEC-032, MR-ACK-015)",
         lambda: ack(99, syndrome=0x40), "XDP_DROP", E.DROPPED, R.STALE_ACK, qp={"stale_acks": 1, "ack_seq": 0},
         also={"ACK_BAD_AETH_TO_USER": 0}),
    Case("bad AETH at snd_nxt is a ghost, dropped (MR-SEC-032, MR-ACK-015)",
         lambda: ack(SND_NXT, syndrome=0x80), "XDP_DROP", E.DROPPED, R.GHOST_ACK,
         qp={"ghost_acks": 1, "stale_acks": 0},
         also={"ACK_BAD_AETH_TO_USER": 0}),
    Case("bad AETH with a corrupt ICRC is BAD_ICRC (MR-ICRC-014)",
         lambda: (lambda f: patch(f, len(f) - 1, bytes([f[-1] ^ 0xFF])))(ack(105, syndrome=0x40)), "XDP_DROP",
         E.DROPPED, R.BAD_ICRC, also={"ACK_BAD_AETH_TO_USER": 0}),
    Case("bad AETH from another address is WRONG_PEER (MR-SEC-021)",
         lambda: ack(105, syndrome=0x40, src_ip="10.55.0.9"), "XDP_DROP", E.DROPPED, R.WRONG_PEER),
    Case("ACK to an unknown QP", lambda: ack(105, qp=0x99), "XDP_DROP", E.DROPPED, R.UNKNOWN_QP),
    # ---- the response window (MR-ACK-015, MR-SEC-022 as revised): a NAK, an RNR NAK or a bad AETH names a
    # PSN in [comp_psn, snd_nxt); comp_psn is at least ack_psn + 1, and further on where the completer
    # published it (READ responses moved it); the one exception is MR-MEM-033's NAK of a partly answered READ
    Case("NAK at comp_psn - 1 (= ack_psn) is stale (MR-ACK-015, MR-SEC-022)", lambda: ack(99, syndrome=0x60),
         "XDP_DROP", E.DROPPED, R.STALE_ACK, qp={"nak_seq": 0, "naks": 0, "ack_seq": 0, "stale_acks": 1}),
    Case("RNR NAK at comp_psn - 1 (= ack_psn) is stale (MR-ACK-015, MR-SEC-022)", lambda: ack(99, syndrome=0x25),
         "XDP_DROP", E.DROPPED, R.STALE_ACK, qp={"rnr_seq": 0, "rnr_naks": 0, "stale_acks": 1}),
    Case("NAK at comp_psn, the first unacknowledged PSN (MR-ACK-015 (b))", lambda: ack(100, syndrome=0x60),
         "XDP_DROP", E.NAK_CONSUMED, qp={"ack_psn": 99, "nak_psn": 100, "nak_seq": 1}),
    Case("NAK before the completer's comp_psn is stale (MR-ACK-015)", lambda: ack(102, syndrome=0x60),
         "XDP_DROP", E.DROPPED, R.STALE_ACK, setup=_req(comp=103), qp={"nak_seq": 0, "stale_acks": 1}),
    Case("RNR NAK at the completer's comp_psn - 1 is stale (MR-ACK-015)", lambda: ack(102, syndrome=0x25),
         "XDP_DROP", E.DROPPED, R.STALE_ACK, setup=_req(comp=103), qp={"rnr_seq": 0, "stale_acks": 1}),
    Case("NAK at the completer's comp_psn (MR-ACK-015 (b))", lambda: ack(103, syndrome=0x60), "XDP_DROP",
         E.NAK_CONSUMED, setup=_req(comp=103), qp={"ack_psn": 102, "nak_psn": 103, "nak_seq": 1}),
    Case("RNR NAK at the last sent PSN (MR-ACK-015 (b))", lambda: ack(109, syndrome=0x21), "XDP_DROP",
         E.RNR_CONSUMED, setup=_req(comp=103), qp={"ack_psn": 108, "rnr_psn": 109}),
    Case("a published comp_psn behind ack_psn + 1 is ignored (MR-ACK-015)", lambda: ack(104, syndrome=0x60),
         "XDP_DROP", E.DROPPED, R.STALE_ACK, setup=_req(comp=101, ack_psn=104), qp={"stale_acks": 1}),
    Case("a published comp_psn beyond snd_nxt is ignored", lambda: ack(105, syndrome=0x60), "XDP_DROP",
         E.NAK_CONSUMED, setup=_req(comp=SND_NXT + 5), qp={"nak_psn": 105}),
    Case("a positive ACK before comp_psn still moves ack_psn; the completer judges it (MR-ACK-015 (c))",
         lambda: ack(101), "XDP_DROP", E.ACK_CONSUMED, setup=_req(comp=103), qp={"ack_psn": 101, "stale_acks": 0}),
    Case("bad AETH before the completer's comp_psn is stale (MR-SEC-032)", lambda: ack(102, syndrome=0x40),
         "XDP_DROP", E.DROPPED, R.STALE_ACK, setup=_req(comp=103), qp={"stale_acks": 1},
         also={"ACK_BAD_AETH_TO_USER": 0}),
    Case("bad AETH at the completer's comp_psn goes to the completer (MR-XH-008)", lambda: ack(103, syndrome=0x40),
         "XDP_DROP", E.DROPPED, R.NO_XSK, setup=_req(comp=103), also={"ACK_BAD_AETH_TO_USER": 1}),
    Case("MR-MEM-033: remote access NAK naming a partly answered READ's first PSN (MR-ACK-015 (b))",
         lambda: ack(100, syndrome=0x62), "XDP_DROP", E.NAK_CONSUMED, setup=_req(comp=102, nak_read=100),
         qp={"ack_psn": 99, "nak_psn": 100, "nak_code": 2, "nak_seq": 1, "stale_acks": 0}),
    Case("MR-MEM-033 after an ACK overtook the READ: ack_psn stays (MR-SEC-022)", lambda: ack(100, syndrome=0x62),
         "XDP_DROP", E.NAK_CONSUMED, setup=_req(comp=102, nak_read=100, ack_psn=104),
         qp={"ack_psn": 104, "nak_psn": 100, "nak_seq": 1}),
    Case("MR-MEM-033's exception is for a NAK with a code: a PSN sequence error there is stale",
         lambda: ack(100, syndrome=0x60), "XDP_DROP", E.DROPPED, R.STALE_ACK, setup=_req(comp=102, nak_read=100),
         qp={"nak_seq": 0, "stale_acks": 1}),
    Case("MR-MEM-033's exception is for a NAK: an RNR NAK there is stale", lambda: ack(100, syndrome=0x22),
         "XDP_DROP", E.DROPPED, R.STALE_ACK, setup=_req(comp=102, nak_read=100), qp={"rnr_seq": 0}),
    Case("MR-MEM-033's exception names one PSN: a NAK inside the READ is stale", lambda: ack(101, syndrome=0x62),
         "XDP_DROP", E.DROPPED, R.STALE_ACK, setup=_req(comp=102, nak_read=100), qp={"nak_seq": 0}),
    Case("no partly answered READ (nak_read_psn = MR_PSN_NONE): a NAK before comp_psn is stale",
         lambda: ack(100, syndrome=0x62), "XDP_DROP", E.DROPPED, R.STALE_ACK, setup=_req(comp=102),
         qp={"nak_seq": 0}),
]


@pytest.fixture(scope="module")
def loader():
    ld = XdpLoader(max_qps=1024)
    yield ld
    ld.close()


def _setup(ld: XdpLoader) -> None:
    ld.qps[:] = 0
    ld.set_config(local_ip4=LOCAL4, local_ip6=LOCAL6)
    for qpn, peer, prof in ((QPN, PEER4, Profile.COMPAT), (QPN6, PEER6, Profile.COMPAT),
                            (QPN_NATIVE, PEER4, Profile.NATIVE)):
        ld.install_qp(qpn, peer_ip=peer, dest_qpn=0x40 + qpn, state=QpState.RTS, profile=prof,
                      init_psn=INIT_PSN)
        ld.qp(qpn)["snd_nxt"] = SND_NXT


@pytest.mark.parametrize("case", CASES, ids=[c.desc for c in CASES])
def test_golden(loader, case: Case):
    """One golden case of CASES; the rules each group checks are named in its comment."""
    _setup(loader)
    if case.setup:
        case.setup(loader)
    d0, e0 = loader.drops(), loader.events()
    res = loader.test_run(case.frame())
    d1, e1 = loader.drops(), loader.events()
    ddelta = {k: d1[k] - d0[k] for k in d1 if d1[k] != d0[k]}
    edelta = {k: e1[k] - e0[k] for k in e1 if e1[k] != e0[k]}

    assert res.action == case.verdict, (ddelta, edelta)
    assert ddelta == ({case.reason.name: 1} if case.reason else {})
    partition = ("PASSED", "STEERED", "ACK_CONSUMED", "NAK_CONSUMED", "RNR_CONSUMED", "CNP_CONSUMED", "DROPPED")
    assert sum(edelta.get(k, 0) for k in partition) == 1
    assert edelta.get(case.event.name) == 1
    for name, n in case.also.items():
        assert edelta.get(name, 0) == n, name
    if case.verdict == "XDP_PASS":
        assert res.data == case.frame(), "passed frames are untouched"
    slot = loader.qp(case.qpn)
    for fname, want in case.qp.items():
        assert int(slot[fname]) == want, fname


def test_rtt_sample_when_ack_covers_probe(loader):
    _setup(loader)
    _probe(104, 5_000_000)(loader)
    e0 = loader.events()
    assert loader.test_run(ack(103)).action == "XDP_DROP"
    assert int(loader.qp(QPN)["rtt_ns"]) == 0, "ACK before the probe PSN gives no sample"
    assert loader.test_run(ack(106)).action == "XDP_DROP"
    s = loader.qp(QPN)
    assert 5_000_000 <= int(s["rtt_ns"]) < 5_000_000_000
    assert int(s["srtt_ns"]) == int(s["rtt_ns"]) and int(s["rttvar_ns"]) == int(s["rtt_ns"]) // 2
    rtt = int(s["rtt_ns"])
    assert loader.test_run(ack(106)).action == "XDP_DROP"           # duplicate: covers nothing new
    assert int(s["rtt_ns"]) == rtt
    assert loader.events()["RTT_SAMPLE"] - e0["RTT_SAMPLE"] == 1
    assert int(s["ack_seq"]) == 6 and int(s["acks"]) == 3


def test_ack_seq_read_protocol(loader):
    from metaroce_xdp.kern.layout import read_ack_state
    _setup(loader)
    for psn in (101, 103, 105):
        loader.test_run(ack(psn))
    snap = read_ack_state(loader.qp(QPN))
    assert snap["ack_psn"] == 105 and snap["ack_seq"] == 6


def test_psn_window_wraps_modulo_2_24(loader):
    """MR-BTH-020: the ACK PSN window is modular."""
    _setup(loader)
    s = loader.qp(QPN)
    s["ack_psn"] = 0xFFFFFE
    s["snd_nxt"] = 3                                   # outstanding 0xFFFFFF, 0, 1, 2
    assert loader.test_run(ack(1)).action == "XDP_DROP"
    assert int(s["ack_psn"]) == 1 and int(s["acks"]) == 1
    loader.test_run(ack(0xFFFFFF))                      # now before ack_psn: stale
    assert int(s["stale_acks"]) == 1 and int(s["ack_psn"]) == 1


def test_config_without_local_ip_accepts_any_destination(loader):
    _setup(loader)
    loader.set_config()                                 # no local IPs: every UDP/4791 is ours
    d0 = loader.drops()["NO_XSK"]
    assert loader.test_run(write(dst_ip="10.55.0.77")).action == "XDP_DROP"
    assert loader.drops()["NO_XSK"] == d0 + 1


def test_local_mac_filter(loader):
    _setup(loader)
    loader.set_config(local_ip4=LOCAL4, local_mac="02:00:00:00:00:aa")
    assert loader.test_run(write()).action == "XDP_PASS"            # to 02:..:02, not us
    assert loader.test_run(write(dst_mac="02:00:00:00:00:aa")).action == "XDP_DROP"


def test_max_qps_is_a_define(tmp_path):
    """Parameters are -D flags: a small table maps a small region."""
    ld = XdpLoader(max_qps=16)
    try:
        assert ld.qps.shape == (16,) and "-DMR_MAX_QPS=16" in ld.cflags
        ld.set_config(local_ip4=LOCAL4)
        ld.install_qp(0x21, peer_ip=PEER4, dest_qpn=1, init_psn=INIT_PSN)
        ld.qp(0x21)["snd_nxt"] = SND_NXT
        assert ld.test_run(ack(105, qp=0x21)).action == "XDP_DROP"
        assert int(ld.qps[0x21 % 16]["ack_psn"]) == 105
        assert ld.test_run(ack(105, qp=0x21 + 16)).action == "XDP_DROP"   # same slot, other QPN
        assert ld.drops()["UNKNOWN_QP"] == 1
    finally:
        ld.close()
        ld.close()                                       # idempotent


# --------------------------------------------------------------------------- real wire
def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


SENDER = r"""
import socket, sys
from metaroce_xdp.wire import encode, Op, AETH, RETH
ifname, src_mac, dst_mac, src, dst = sys.argv[1:6]
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind((ifname, 0))
kw = dict(src_mac=src_mac, dst_mac=dst_mac, src_ip=src, dst_ip=dst)
s.send(encode(Op.ACKNOWLEDGE, dest_qp=0x11, psn=105, headers={"aeth": AETH(syndrome=0x1F, msn=4)}, **kw))
s.send(encode(Op.RDMA_WRITE_ONLY, dest_qp=0x99, psn=1, payload=b"abcd",
              headers={"reth": RETH(va=0, rkey=1, dma_len=4)}, **kw))
s.send(encode(Op.RDMA_WRITE_ONLY, dest_qp=0x11, psn=1, payload=b"abcd",
              headers={"reth": RETH(va=0, rkey=1, dma_len=4)}, **kw))
"""


PINGER = r"""
import os, socket, struct, sys, time
# ICMP echo with a raw socket: this machine has no ping binary.
def csum(b):
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF
dst, count = sys.argv[1], int(sys.argv[2])
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
s.settimeout(2.0)
ident = os.getpid() & 0xFFFF
for seq in range(count):
    body = struct.pack("!BBHHH", 8, 0, 0, ident, seq) + b"metaroce-ping!"
    s.sendto(body[:2] + struct.pack("!H", csum(body)) + body[4:], (dst, 0))
    deadline = time.monotonic() + 2
    while True:
        data, addr = s.recvfrom(2048)           # raises on timeout: exit status != 0
        icmp = data[(data[0] & 0xF) * 4:]
        if addr[0] == dst and icmp[0] == 0 and struct.unpack("!HH", icmp[4:8]) == (ident, seq):
            break
        if time.monotonic() > deadline:
            sys.exit(1)
print("ok")
"""


@pytest.mark.netns
def test_veth_in_netns_ping_and_counters():
    pid = os.getpid()
    ns, host_if, peer_if = f"mrk{pid}", f"mrh{pid}"[:15], f"mrp{pid}"[:15]
    host_ip, peer_ip = "10.77.0.1", "10.77.0.2"
    _sh("ip", "netns", "add", ns)
    ld = None
    try:
        _sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", peer_if, "netns", ns)
        _sh("ip", "addr", "add", f"{host_ip}/24", "dev", host_if)
        _sh("ip", "link", "set", host_if, "up")
        _sh("ip", "-n", ns, "addr", "add", f"{peer_ip}/24", "dev", peer_if)
        _sh("ip", "-n", ns, "link", "set", peer_if, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        host_mac = Path(f"/sys/class/net/{host_if}/address").read_text().strip()
        peer_mac = _sh("ip", "netns", "exec", ns, "cat", f"/sys/class/net/{peer_if}/address").stdout.strip()

        ld = XdpLoader(max_qps=1024)
        ld.set_config(local_ip4=host_ip)
        ld.install_qp(0x11, peer_ip=peer_ip, dest_qpn=0x22, init_psn=INIT_PSN)
        ld.qp(0x11)["snd_nxt"] = SND_NXT
        ld.attach(host_if)
        pin = Path("/sys/fs/bpf/metaroce") / pin_name(host_if)
        assert all((pin / m).exists() for m in ("mr_qps", "mr_drops", "mr_events", "mr_cfg"))

        ping = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", PINGER, host_ip, "2"],
                              capture_output=True, text=True, timeout=30)
        assert ping.returncode == 0, ping.stdout + ping.stderr
        assert ld.events()["PASSED"] >= 2                       # ARP + ICMP went to the stack

        env = dict(os.environ, PYTHONPATH=str(ROOT))
        r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", SENDER, peer_if, peer_mac,
                            host_mac, peer_ip, host_ip], capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 0, r.stderr
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            d, e = ld.drops(), ld.events()
            if e["ACK_CONSUMED"] >= 1 and d["UNKNOWN_QP"] >= 1 and d["NO_XSK"] >= 1:
                break
            time.sleep(0.05)
        assert e["ACK_CONSUMED"] == 1 and d["UNKNOWN_QP"] == 1 and d["NO_XSK"] == 1, (d, e)
        assert int(ld.qp(0x11)["ack_psn"]) == 105 and int(ld.qp(0x11)["ack_msn"]) == 4
    finally:
        if ld is not None:
            ld.close()
            assert not (Path("/sys/fs/bpf/metaroce") / pin_name(host_if)).exists()
        _sh("ip", "link", "del", host_if, check=False)
        _sh("ip", "netns", "del", ns, check=False)
