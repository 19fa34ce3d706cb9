"""The NATIVE_SACK fast path of the XDP program (bpf/metaroce_xdp.c mr_sack_push, MR-SACK-043), packet by
packet through BPF_PROG_TEST_RUN on the real program: a native QP with a ring gets its SACKs copied, as
received, into the mmapped mr_sacks ring after their ICRC; a corrupt one is dropped before; a full ring,
a QP without a ring, ACK_TO_USER and a state that refuses SACKs leave the ring alone.  (As in
test_xdp_golden.py, "steered" is DROP/NO_XSK here: test_run has no AF_XDP socket.)"""
from __future__ import annotations

import struct
import time

import pytest

from metaroce_xdp.wire import AETH, SACKETH, Op, encode

pytestmark = pytest.mark.root
pytest.importorskip("bcc")

from metaroce_xdp.kern import Profile, QpFlag, QpState, XdpLoader  # noqa: E402
from metaroce_xdp.kern.layout import MR_SACK_RING_LEN  # noqa: E402

LOCAL4, PEER4 = "10.55.0.2", "10.55.0.1"
LOCAL6, PEER6 = "fd00:55::2", "fd00:55::1"
QPN, QPN6, QPN_NORING = 0x13, 0x14, 0x15
RING, RING6 = 3, 4
ETH, V4, V6, UDP = 14, 20, 40, 8


def sack(psn=105, qp=QPN, words=(0x80000000,), syn=0x1F, tsecr=0x01020304, credit=0xFFFF, ce=2, sport=0xC123,
         flags=0x80, v6=False, **kw) -> bytes:
    kw.setdefault("src_ip", PEER6 if v6 else PEER4)
    return encode(Op.NATIVE_SACK, dest_qp=qp, psn=psn, dst_ip=LOCAL6 if v6 else LOCAL4,
                  headers={"aeth": AETH(syndrome=syn, msn=7),
                           "sacketh": SACKETH(tsecr=tsecr, credit=credit, ce_count=ce, echo_sport=sport,
                                              bitmap_words=len(words), flags=flags)},
                  sack_bitmap=list(words), **kw)


def raw_of(frame: bytes, v6: bool = False) -> bytes:
    """BTH .. last bitmap word: what the ring keeps."""
    b = ETH + (V6 if v6 else V4) + UDP
    return frame[b:len(frame) - 4]


@pytest.fixture(scope="module")
def ld():
    x = XdpLoader(max_qps=1024)
    yield x
    x.close()


@pytest.fixture
def qps(ld):
    ld.qps[:] = 0
    ld.sacks[:] = 0
    ld.set_config(local_ip4=LOCAL4, local_ip6=LOCAL6)
    for qpn, peer in ((QPN, PEER4), (QPN6, PEER6), (QPN_NORING, PEER4)):
        ld.install_qp(qpn, peer_ip=peer, dest_qpn=0x40 + qpn, state=QpState.RTS, profile=Profile.NATIVE,
                      init_psn=100)
    ld.set_sack_ring(QPN, RING, owner=QPN + 1)
    ld.set_sack_ring(QPN6, RING6, owner=QPN6 + 1)
    return ld


def _run(ld, frame):
    d0, e0 = ld.drops(), ld.events()
    res = ld.test_run(frame)
    d1, e1 = ld.drops(), ld.events()
    return (res.action, {k: d1[k] - d0[k] for k in d1 if d1[k] != d0[k]},
            {k: e1[k] - e0[k] for k in e1 if e1[k] != e0[k]})


def test_a_sack_is_copied_into_its_ring_as_received(qps):
    """MR-SACK-043: ICRC verified, then the record holds BTH to the last bitmap word byte for byte, the QPN,
    its length and the arrival time; published with seq = position + 1; consumed (not a drop)."""
    ld = qps
    r = ld.sacks[RING]
    for i, words in enumerate([(), (0x80000000, 0x1), tuple(range(1, 33))]):   # 0, 2 and 32 bitmap words
        f = sack(psn=101 + i, words=words)
        t0 = time.monotonic_ns()
        act, drops, ev = _run(ld, f)
        assert (act, drops, ev) == ("XDP_DROP", {}, {"SACK_CONSUMED": 1}), (drops, ev)
        rec = r["rec"][i]
        assert int(rec["seq"]) == i + 1 and int(rec["qpn"]) == QPN
        assert int(rec["len"]) == 28 + 4 * len(words)
        assert bytes(rec["raw"][:int(rec["len"])]) == raw_of(f)
        assert t0 <= int(rec["ts_ns"]) <= time.monotonic_ns()          # CLOCK_MONOTONIC, as the data plane's
    assert (int(r["prod"]), int(r["pushed"]), int(r["full"]), int(r["cons"])) == (3, 3, 0, 0)


def test_ipv6_sack_is_consumed_after_its_icrc(qps):
    ld = qps
    f = sack(qp=QPN6, v6=True, words=(0xFFFFFFFF,) * 5)
    assert _run(ld, f) == ("XDP_DROP", {}, {"SACK_CONSUMED": 1})
    rec = ld.sacks[RING6]["rec"][0]
    assert bytes(rec["raw"][:int(rec["len"])]) == raw_of(f, v6=True)
    bad = f[:-1] + bytes([f[-1] ^ 1])
    assert _run(ld, bad) == ("XDP_DROP", {"BAD_ICRC": 1}, {"DROPPED": 1})
    assert int(ld.sacks[RING6]["prod"]) == 1


@pytest.mark.parametrize("where", ["icrc", "tsecr", "bitmap"])
def test_a_corrupt_sack_never_reaches_the_ring(qps, where):
    """MR-ICRC-014, MR-SACK-043: a SACK whose ICRC fails is dropped as BAD_ICRC (whatever byte changed)."""
    ld = qps
    f = bytearray(sack(words=(0x80000000, 0x40000000)))
    off = {"icrc": len(f) - 2, "tsecr": ETH + V4 + UDP + 12 + 4 + 1, "bitmap": len(f) - 6}[where]
    f[off] ^= 0x10
    assert _run(ld, bytes(f)) == ("XDP_DROP", {"BAD_ICRC": 1}, {"DROPPED": 1})
    assert int(ld.sacks[RING]["prod"]) == 0


def test_a_full_ring_steers_the_sack_instead(qps):
    """A ring holding MR_SACK_RING_LEN unread records takes no more: the SACK goes to the socket (here:
    NO_XSK), counted in the ring's `full` and SACK_RING_FULL; once the loop reads one, it takes SACKs again."""
    ld = qps
    r = ld.sacks[RING]
    for i in range(MR_SACK_RING_LEN):
        assert _run(ld, sack(psn=100 + (i % 9)))[2] == {"SACK_CONSUMED": 1}
    act, drops, ev = _run(ld, sack())
    assert (act, drops, ev) == ("XDP_DROP", {"NO_XSK": 1}, {"SACK_RING_FULL": 1, "DROPPED": 1})
    assert (int(r["prod"]), int(r["full"])) == (MR_SACK_RING_LEN, 1)
    r["cons"] = 1                                       # the data plane read position 0
    assert _run(ld, sack(psn=109))[2] == {"SACK_CONSUMED": 1}
    assert int(r["rec"][0]["seq"]) == MR_SACK_RING_LEN + 1       # position 32 reuses record 0
    assert struct.unpack_from("!I", bytes(r["rec"][0]["raw"][8:12]))[0] & 0xFFFFFF == 109


@pytest.mark.parametrize("case", ["no ring", "ack_to_user", "RTR", "wrong peer"])
def test_what_the_ring_does_not_take(qps, case):
    """A native QP without a ring keeps the AF_XDP path (steered, NO_XSK here); so does ACK_TO_USER; a QP
    in RTR refuses SACKs (MR-QP-020) and a SACK from another address is dropped (MR-SEC-009), before any
    ring is touched."""
    ld = qps
    frame, want = sack(), ("XDP_DROP", {"NO_XSK": 1}, {"DROPPED": 1})
    if case == "no ring":
        frame = sack(qp=QPN_NORING)
    elif case == "ack_to_user":
        ld.qp(QPN)["flags"] = int(QpFlag.ACK_TO_USER)
    elif case == "RTR":
        ld.set_qp_state(QPN, QpState.RTR)
        want = ("XDP_DROP", {"QP_STATE": 1}, {"DROPPED": 1})
    else:
        frame = sack(src_ip="10.55.0.9")
        want = ("XDP_DROP", {"WRONG_PEER": 1}, {"DROPPED": 1})
    assert _run(ld, frame) == want
    assert int(ld.sacks[RING]["prod"]) == 0


def test_set_sack_ring_skips_what_an_earlier_qp_left(qps):
    """A ring handed to a new QP starts empty for its reader: cons = prod (the old QP's records unread)."""
    ld = qps
    for _ in range(3):
        _run(ld, sack())
    ld.set_sack_ring(QPN, RING, owner=QPN + 1)
    r = ld.sacks[RING]
    assert int(r["cons"]) == int(r["prod"]) == 3 and int(r["owner"]) == QPN + 1
    ld.set_sack_ring(QPN, None)
    assert int(ld.qp(QPN)["sack_ring"]) == 0
    assert _run(ld, sack())[1] == {"NO_XSK": 1}


def test_while_the_loop_sleeps_sacks_go_to_the_socket(qps):
    """MR-SACK-043 (4): while the ring's loop sleeps in poll() (`sleeping`), a SACK would wait in the ring
    until something else woke it, so the kernel steers it to the socket, whose frame wakes the loop
    (counted in `asleep` and SACK_RING_FULL); awake again, the ring takes SACKs."""
    ld = qps
    r = ld.sacks[RING]
    r["sleeping"] = 1
    assert _run(ld, sack()) == ("XDP_DROP", {"NO_XSK": 1}, {"SACK_RING_FULL": 1, "DROPPED": 1})
    assert (int(r["prod"]), int(r["asleep"])) == (0, 1)
    r["sleeping"] = 0
    assert _run(ld, sack())[2] == {"SACK_CONSUMED": 1}
