"""Python mirror of the structs and enums shared with the XDP program.

C source of truth: bpf/metaroce_structs.h (struct mr_qp_state, struct
mr_config), bpf/metaroce_drop_reasons.h (enum mr_drop_reason, enum mr_event),
bpf/metaroce_consts.h.  tests/kern/test_c_python_agree.py compiles the headers with
gcc and compares every offset, size and enum value with this module.

Writers of mr_qp_state (one per field; see the C header for the protocol):
control plane = daemon, requester = user-space engine, kernel = ACK fast path.
"""
from __future__ import annotations

import enum

import numpy as np

from ..wire.errors import DecodeReason

MR_MAX_QPS = 1024            # default of bpf/metaroce_consts.h; the loader may override
MR_MAX_RXQ = 64
MR_DROP_SLOTS = 64
MR_EVENT_SLOTS = 16
ROCE_UDP_PORT = 4791
QP_STATE_SIZE = 256
PSN_MASK = 0xFFFFFF
PSN_NONE = 0xFFFFFFFF        # MR_PSN_NONE: a PSN field holding no PSN


class QpState(enum.IntEnum):
    """ibv_qp_state numbering (enum mr_qp_state_code, Table 7-1: MR-QP-001)."""
    RESET = 0
    INIT = 1
    RTR = 2
    RTS = 3
    SQD = 4
    SQE = 5
    ERR = 6


class Profile(enum.IntEnum):
    COMPAT = 0
    NATIVE = 1


class QpFlag(enum.IntFlag):
    ACK_TO_USER = 1 << 0     # kernel steers ACKs instead of consuming them


class CfgFlag(enum.IntFlag):
    HAVE_IP4 = 1 << 0
    HAVE_IP6 = 1 << 1
    HAVE_MAC = 1 << 2


# Values 1..31 are DecodeReason's, by construction (never renumber).
_DROP_REASONS = {r.name: int(r) for r in DecodeReason if r != DecodeReason.OK}
_DROP_REASONS.update({
    "NONE": 0,
    "UNKNOWN_QP": 32,
    "QP_STATE": 33,
    "WRONG_PEER": 34,
    "NO_XSK": 35,
    "WRONG_PROFILE": 36,
    "BAD_ICRC": 37,
    "STALE_ACK": 38,
    "ACK_BUSY": 39,
    "BAD_PKEY": 40,
    "GHOST_ACK": 41,
})
DropReason = enum.IntEnum("DropReason", sorted(_DROP_REASONS.items(), key=lambda kv: kv[1]))
DropReason.__doc__ = "enum mr_drop_reason: index of the per-CPU counter in mr_drops.  Never renumber."


class Event(enum.IntEnum):
    """enum mr_event: index into mr_events.  PASSED + STEERED + *_CONSUMED + DROPPED = packets
    (CNP, RTT_SAMPLE, ACK_BAD_AETH_TO_USER and SACK_RING_FULL are not in the partition: CNP_CONSUMED,
    SACK_CONSUMED and STEERED are)."""
    PASSED = 0
    STEERED = 1
    ACK_CONSUMED = 2
    NAK_CONSUMED = 3
    RNR_CONSUMED = 4
    DROPPED = 5
    RTT_SAMPLE = 6
    CNP = 7
    CNP_CONSUMED = 8
    ACK_BAD_AETH_TO_USER = 9     # bad AETH (MR-XH-008) in the window: to the completer (MR-NAK-012)
    SACK_CONSUMED = 10           # NATIVE_SACK put in its QP's mr_sacks ring (MR-SACK-043)
    SACK_RING_FULL = 11          # its ring full or contended, or its loop asleep: steered instead (then STEERED)


# (name, numpy type, writer).  Offsets are implied by order and checked by the test.
QP_STATE_FIELDS = [
    # control plane [0, 40)
    ("qpn", "<u4", "control"),
    ("state", "u1", "control"),
    ("profile", "u1", "control"),
    ("flags", "<u2", "control"),
    ("dest_qpn", "<u4", "control"),
    ("pmtu", "<u2", "control"),
    ("pkey", "<u2", "control"),          # MR-BTH-010; install_qp writes 0xFFFF by default
    ("peer_ip", ("u1", 16), "control"),
    ("sack_ring", "<u2", "control"),      # native QP: its mr_sacks ring + 1 (MR-SACK-043); 0 = steer SACKs
    ("ctrl_pad", "<u2", "control"),
    ("ctrl_rsvd", "<u4", "control"),
    # requester [40, 64)
    ("snd_nxt", "<u4", "requester"),
    ("comp_psn", "<u4", "requester"),      # the NAK window starts here (MR-ACK-015)
    ("rtt_probe_psn", "<u4", "requester"),
    ("nak_read_psn", "<u4", "requester"),  # MR-MEM-033's NAK PSN, or PSN_NONE
    ("rtt_probe_ns", "<u8", "requester"),
    # kernel ACK fast path [64, 192)
    ("ack_seq", "<u8", "kernel"),
    ("ack_psn", "<u4", "kernel"),
    ("ack_msn", "<u4", "kernel"),
    ("nak_psn", "<u4", "kernel"),
    ("nak_seq", "<u4", "kernel"),
    ("rnr_psn", "<u4", "kernel"),
    ("rnr_seq", "<u4", "kernel"),
    ("last_syndrome", "u1", "kernel"),
    ("nak_code", "u1", "kernel"),
    ("rnr_timer", "u1", "kernel"),
    ("k_pad0", "u1", "kernel"),
    ("ghost_acks", "<u4", "kernel"),      # MR-ACK-015 (a): ghost ACKs the XDP program dropped
    ("rtt_ns", "<u8", "kernel"),
    ("srtt_ns", "<u8", "kernel"),
    ("rttvar_ns", "<u8", "kernel"),
    ("acks", "<u8", "kernel"),
    ("naks", "<u8", "kernel"),
    ("rnr_naks", "<u8", "kernel"),
    ("stale_acks", "<u8", "kernel"),
    ("cnp_count", "<u8", "kernel"),
    ("last_ack_ns", "<u8", "kernel"),
    ("cnp_discarded", "<u8", "kernel"),
    ("k_rsvd", ("u1", 8), "kernel"),
    # reserved for the SACK/CNP fast path [192, 256)
    ("sack_rsvd", ("u1", 64), "kernel"),
]

QP_STATE_DTYPE = np.dtype([(n, t) for n, t, _ in QP_STATE_FIELDS], align=False)
QP_FIELD_WRITER = {n: w for n, _, w in QP_STATE_FIELDS}
assert QP_STATE_DTYPE.itemsize == QP_STATE_SIZE, QP_STATE_DTYPE.itemsize

# ---- the NATIVE_SACK rings (struct mr_sack_ring, struct mr_sack_rec: the protocol is in the C header)
MR_SACK_RINGS = 32           # default of bpf/metaroce_structs.h; the loader may override
MR_SACK_RING_LEN = 32
SACK_RAW_MAX = 12 + 4 + 12 + 4 * 32
SACK_REC_DTYPE = np.dtype([
    ("seq", "<u8"),              # ring position + 1 once whole (kernel, last)
    ("ts_ns", "<u8"),            # arrival, CLOCK_MONOTONIC
    ("qpn", "<u4"),
    ("len", "<u4"),              # bytes in raw (0: discard)
    ("raw", ("u1", 168)),        # BTH .. last bitmap word, as received
])
assert SACK_REC_DTYPE.itemsize == 192


def sack_ring_dtype(ring_len: int = MR_SACK_RING_LEN) -> np.dtype:
    return np.dtype([
        ("prod", "<u8"), ("pushed", "<u8"), ("full", "<u8"), ("busy", "<u8"), ("asleep", "<u8"),
        ("k_rsvd", ("u1", 24)),                                                                         # kernel
        ("cons", "<u8"), ("owner", "<u4"), ("sleeping", "<u4"), ("drained", "<u8"), ("discarded", "<u8"),
        ("u_rsvd", ("u1", 32)),                                                                         # data plane
        ("rec", SACK_REC_DTYPE, (ring_len,)),
    ])


SACK_RING_DTYPE = sack_ring_dtype()
assert SACK_RING_DTYPE.fields["cons"][1] == 64 and SACK_RING_DTYPE.fields["rec"][1] == 128

CONFIG_DTYPE = np.dtype([
    ("flags", "<u4"),
    ("local_ip4", ("u1", 4)),
    ("local_ip6", ("u1", 16)),
    ("local_mac", ("u1", 6)),
    ("pad0", "<u2"),
    ("rsvd", ("<u4", 8)),
])
assert CONFIG_DTYPE.itemsize == 64


def peer_ip_bytes(addr) -> bytes:
    """16-byte peer address as mr_qp_state.peer_ip wants it (IPv4 as ::ffff:a.b.c.d)."""
    import ipaddress
    a = ipaddress.ip_address(str(addr))
    if a.version == 4:
        return bytes(10) + b"\xff\xff" + a.packed
    return a.packed


def read_ack_state(slot: np.ndarray, fields=("ack_psn", "ack_msn", "last_syndrome", "nak_psn", "nak_code",
                                             "nak_seq", "rnr_psn", "rnr_seq", "rnr_timer", "rtt_ns",
                                             "srtt_ns"), retries: int = 1000) -> dict:
    """Consistent snapshot of the kernel-written ACK fields of one slot (the seqcount
    read protocol of struct mr_qp_state): retry while ack_seq is odd or changed."""
    for _ in range(retries):
        s1 = int(slot["ack_seq"])
        if s1 & 1:
            continue
        snap = {f: (slot[f].copy() if slot[f].shape else int(slot[f])) for f in fields}
        if int(slot["ack_seq"]) == s1:
            snap["ack_seq"] = s1
            return snap
    raise TimeoutError("mr_qp_state.ack_seq kept changing; is the kernel writer stuck?")
