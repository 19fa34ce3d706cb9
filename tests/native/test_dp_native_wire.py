"""Native header and wire rules of the compiled data plane, asserted on frames read off a real wire.

Two kinds of traffic:

* A native transfer between hosts A and B through a switch namespace (a bridge; XDP and AF_XDP on both
  hosts), a seeded fault injector on the switch port towards B dropping chosen request PSNs once, and an
  AF_PACKET socket on the switch port towards A that sees every frame both ways: A's requests (first
  transmissions and retransmissions: the tap sits before the drop) and B's SACKs, READ responses and atomic
  acknowledgements.  One transfer (WRITE, SEND, WRITE with immediate, a READ that takes several request
  messages, an atomic, a zero-length SEND, a one-byte WRITE; then, after a pause, a second batch) is
  captured once and checked by the tests of this module: NETH.tsval (MR-NAT-014), MSNs (MR-NAT-012),
  reserved bits (MR-NAT-011, MR-SACK-009), the SACK layout and its ACK fields (MR-SACK-002, MR-SACK-003)
  and retransmissions identical to their originals (MR-SACK-024).  Frames are decoded with the project's
  codec; the SACKs' BTH, ICRC and byte layout are checked against scapy.contrib.roce as well, and reserved
  bits are read from the raw bytes at the offsets the spec's tables give.
* A scripted peer (a raw socket in the other namespace, tests/wire_players.py): crafted frames the codec
  cannot build -- native requests and SACKs shorter than their opcode needs, built with scapy -- reach a
  native QP and are discarded and counted (MR-NAT-009); SACK syndromes with bits 4-0 other than 0x1F and
  with bit 7 set (MR-SACK-038) and reserved bits set (MR-NAT-011, MR-SACK-009) are read as the spec says.
"""
from __future__ import annotations

import socket
import time

import pytest
from scapy.contrib.roce import BTH as S_BTH
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from dp_players import collect, connected
from metaroce_xdp.verbs_types import SGE, QPState, RecvWR, SendWR, WCStatus, WROpcode
from metaroce_xdp.wire import AETH, NETH, RETH, RSNETH, SACKETH, MalformedPacket, Op, decode, encode
from wire_players import PortTap, ScriptedQP, is_roce_v4

pytestmark = [pytest.mark.netns, pytest.mark.fabric(prefix="mrnw")]

MASK = 0xFFFFFF
PMTU = 1024
FIRST, LAST, RETX = 0x80, 0x40, 0x20
NETH_OPS = (Op.NATIVE_SEND, Op.NATIVE_SEND_IMM, Op.NATIVE_WRITE, Op.NATIVE_WRITE_IMM, Op.NATIVE_READ_REQ,
            Op.NATIVE_READ_RESP)
# bytes between the BTH and the NETH (04 section 4.2.2's table): a RETH comes first in WRITEs and READ requests
NETH_AT = {Op.NATIVE_SEND: 0, Op.NATIVE_SEND_IMM: 0, Op.NATIVE_READ_RESP: 0,
           Op.NATIVE_WRITE: 16, Op.NATIVE_WRITE_IMM: 16, Op.NATIVE_READ_REQ: 16}
ATOMICS = (Op.COMPARE_SWAP, Op.FETCH_ADD)
BTH_AT = 14 + 20 + 8                    # Ethernet, IPv4, UDP


# ============================================================================ captured native transfer
def _held(tap: PortTap) -> list:
    """(raw, decoded) of every IPv4 UDP/4791 frame the tap holds, in the order the port saw them."""
    return [(f, decode(f)) for f in tap.frames(is_roce_v4)]


PSN0 = 0xFFFFF0                        # A's first request PSN: the transfer crosses 2^24
# A's batch 1, in posting order: (kind, bytes).  PSNs from PSN0: WRITE 0-4, SEND 5-7, WRITE_IMM 8-10, READ 11-303
# (several request messages), FETCH_ADD 304, SEND of 0 bytes 305, WRITE of 1 byte 306
BATCH1 = (("write", 5000), ("send", 3000), ("write_imm", 2500), ("read", 300_000), ("faa", 8), ("send", 0),
          ("write", 1))
BATCH2 = (("write", 2048), ("read", 4096), ("cas", 8), ("send_imm", 100))
# dropped once towards B: a middle WRITE packet, a SEND packet (RSNETH), the last WRITE_IMM packet (RSNETH,
# ImmDt), the first READ request message, the atomic (AtomicETH) and the one-byte WRITE at the tail
DROPS = [(PSN0 + d) & MASK for d in (1, 6, 10, 11, 304, 306)]
PAUSE = 0.3                             # seconds between the two batches (MR-NAT-014: the clock's unit)


def _wrs(a, b, batch, wr0, src0, dst0):
    wrs, src, dst = [], src0, dst0
    for i, (kind, n) in enumerate(batch):
        wr_id = wr0 + i
        if kind in ("write", "write_imm"):
            op = WROpcode.RDMA_WRITE if kind == "write" else WROpcode.RDMA_WRITE_WITH_IMM
            wrs.append(SendWR(wr_id=wr_id, opcode=op, sg_list=[a.sge(src, n)], remote_addr=b.mr.addr + dst,
                              rkey=b.mr.rkey, imm_data=0x5EED0000 + i))
        elif kind in ("send", "send_imm"):
            op = WROpcode.SEND if kind == "send" else WROpcode.SEND_WITH_IMM
            wrs.append(SendWR(wr_id=wr_id, opcode=op, sg_list=[a.sge(src, n)], imm_data=0x1234 + i))
        elif kind == "read":
            wrs.append(SendWR(wr_id=wr_id, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(dst, n)],
                              remote_addr=b.mr.addr + src, rkey=b.mr.rkey))
        else:
            cell = (dst + 7) & ~7
            op = WROpcode.ATOMIC_FETCH_AND_ADD if kind == "faa" else WROpcode.ATOMIC_CMP_AND_SWP
            wrs.append(SendWR(wr_id=wr_id, opcode=op, sg_list=[a.sge(cell, 8)], remote_addr=b.mr.addr + cell,
                              rkey=b.mr.rkey, compare_add=3, swap=9))
        src += n + 64
        dst += n + 64
    return wrs


@pytest.fixture(scope="module")
def capture(fabric):
    """The captured transfer: all frames, A's and B's (raw, decoded) of each batch, A's QPN, and the
    local monotonic clock (us) read before batch 1, after batch 1 completed (no round ran after it), before
    batch 2 was posted and after it completed."""
    topo, a, b = fabric
    # RACK's reordering window at its floor, well above this host's scheduling delay between the players:
    # the retransmissions are those of the dropped PSNs (spurious ones would be checked the same way)
    params = {"reo_floor": 5000, "rto_min": 20000}
    connected(a, b, seeds=(3, 4), mtu=PMTU, sq_psn=PSN0, rq_psn=PSN0, min_rnr_timer=None, profile="native",
              native_params=params)
    b.qp.post_recv([RecvWR(wr_id=900 + i, sg_list=[b.sge(3_500_000 + i * 8192, 8192)]) for i in range(4)])
    w1 = _wrs(a, b, BATCH1, 0, 0, 1_000_000)
    w2 = _wrs(a, b, BATCH2, 100, 2_000_000, 2_500_000)
    tap = PortTap(topo, topo[1], "swA")
    try:
        with fabric.impair("b", psn_drop_once=DROPS) as fb:
            t0 = time.monotonic_ns() // 1000
            a.qp.post_send(w1)
            got1 = collect(a, len(w1), [b], timeout=30)
            t1 = time.monotonic_ns() // 1000
            time.sleep(0.05)                     # the last frames cross the bridge
            f1 = _held(tap)
            time.sleep(PAUSE)
            t2 = time.monotonic_ns() // 1000
            a.qp.post_send(w2)
            got2 = collect(a, len(w2), [b], timeout=30)
            t3 = time.monotonic_ns() // 1000
            time.sleep(0.05)
            f2 = _held(tap)
            dropped = fb.stats()["psn_dropped"]
        collect(b, 4, [a], timeout=5)
    finally:
        tap.close()
    assert [(w.wr_id, w.status) for w in got1 + got2] == [(w.wr_id, WCStatus.SUCCESS) for w in w1 + w2]
    assert dropped == len(DROPS)
    a_ip = int.from_bytes(socket.inet_aton(a.ctx.gid), "big")
    b_ip = int.from_bytes(socket.inet_aton(b.ctx.gid), "big")
    yield dict(all1=f1, all2=f2,
               a1=[x for x in f1 if x[1].ip.src == a_ip], a2=[x for x in f2 if x[1].ip.src == a_ip],
               b1=[x for x in f1 if x[1].ip.src == b_ip], b2=[x for x in f2 if x[1].ip.src == b_ip],
               qpn_a=a.qp.qp_num, t=(t0, t1, t2, t3))


def _retx(p) -> bool:
    return p.neth is not None and bool(p.neth.flags & RETX)


def _messages(reqs):
    """A's request messages in PSN order from the first transmissions: dicts with d (first PSN - PSN0), end
    (last PSN - PSN0), op, msn (None for an atomic), the packets."""
    firsts = sorted((p for p in reqs if not _retx(p)), key=lambda p: (p.bth.psn - PSN0) & MASK)
    seen = set()
    msgs = []
    for p in firsts:
        d = (p.bth.psn - PSN0) & MASK
        if p.bth.opcode in ATOMICS:
            if d in seen:
                continue                                         # an atomic replay: RETX has no field here
            msgs.append(dict(d=d, end=d, op=p.bth.opcode, msn=None, pkts=[p]))
        elif p.bth.opcode == Op.NATIVE_READ_REQ:
            n = max(1, -(-p.reth.dma_len // PMTU))
            msgs.append(dict(d=d, end=d + n - 1, op=p.bth.opcode, msn=p.neth.msn, pkts=[p]))
        elif p.neth.flags & FIRST:
            msgs.append(dict(d=d, end=d, op=p.bth.opcode, msn=p.neth.msn, pkts=[p]))
        else:
            m = msgs[-1]
            assert m["end"] == d - 1 and m["op"] == p.bth.opcode, (hex(p.bth.psn), m["d"], m["end"])
            m["end"] = d
            m["pkts"].append(p)
        assert d not in seen, f"two first transmissions of PSN {p.bth.psn:#x}"
        seen.add(d)
    return msgs


def _all(cap, who):
    return cap[who + "1"] + cap[who + "2"]


def test_neth_tsval_is_a_monotonic_microsecond_clock_mr_nat_014(capture):
    """MR-NAT-014: in every native packet A sends (first transmissions and retransmissions) and B sends (READ
    responses) NETH.tsval never steps backwards, in the order the packets left; it counts microseconds: the
    pause of 0.3 s between the two batches is at least as many tsval units (milliseconds would make it ~300),
    and no two tsvals of a side differ by more than the microseconds the whole transfer took (nanoseconds
    would)."""
    cap = capture
    t0, t1, t2, t3 = cap["t"]
    for who in ("a", "b"):
        one = [p.neth.tsval for _, p in cap[who + "1"] if p.neth is not None]
        two = [p.neth.tsval for _, p in cap[who + "2"] if p.neth is not None]
        ts = one + two
        assert len(one) >= 3 and len(two) >= 3, (who, len(one), len(two))
        steps = [(y - x) & 0xFFFFFFFF for x, y in zip(ts, ts[1:])]
        assert all(s < 1 << 31 for s in steps), f"{who}: tsval stepped back at {steps.index(max(steps))}"
        span = (ts[-1] - ts[0]) & 0xFFFFFFFF
        assert span <= t3 - t0 + 1, (who, span, t3 - t0)
        gap = (two[0] - one[-1]) & 0xFFFFFFFF
        assert t2 - t1 - 1 <= gap <= t3 - t0 + 1, (who, gap, t2 - t1)
    assert t2 - t1 >= PAUSE * 1e6


def test_msn_per_request_message_one_per_read_request_message_mr_nat_012(capture):
    """MR-NAT-012: A numbers its request messages 0, 1, 2, ... in posting order (PSN order) from the QP's
    entry to RTS; every packet of a message carries its MSN; each request message of a READ (the 300,000-byte
    READ takes several, MR-NAT-022) has its own; an atomic consumes one and carries none (the MSN after it
    skips one); every retransmission and READ re-request carries the MSN of the message its PSN belongs
    to."""
    reqs = [p for _, p in _all(capture, "a")]
    msgs = _messages(reqs)
    reads = [m for m in msgs if m["op"] == Op.NATIVE_READ_REQ]
    assert len(reads) >= 3 + 1, [(m["d"], m["end"]) for m in reads]     # batch 1's READ in >= 3 messages
    atomics = [m for m in msgs if m["msn"] is None]
    assert len(atomics) == 2
    assert msgs[0]["d"] == 0
    want = 0
    for m, nxt in zip(msgs, msgs[1:] + [None]):
        if nxt is not None:
            assert nxt["d"] == m["end"] + 1, (m["d"], m["end"], nxt["d"])   # no PSN without a message
        if m["msn"] is not None:
            assert m["msn"] == want, (m["d"], m["msn"], want)
            assert {p.neth.msn for p in m["pkts"]} == {want}
        want += 1
    assert want == len(BATCH1) - 1 + len(BATCH2) - 1 + len(reads)           # the two READs' messages

    def owner(psn):
        d = (psn - PSN0) & MASK
        return next(m for m in msgs if m["d"] <= d <= m["end"])

    again = [p for p in reqs if _retx(p)]
    assert again, "no retransmission captured"
    for p in again:
        assert p.neth.msn == owner(p.bth.psn)["msn"], hex(p.bth.psn)
    assert {(p.bth.psn - PSN0) & MASK for p in again} >= {(d - PSN0) & MASK for d in DROPS if d != DROPS[4]}


def test_reserved_bits_zero_in_neth_and_sacketh_mr_nat_011_mr_sack_009(capture):
    """MR-NAT-011: NETH byte 0 bits 4-0 are zero in every native packet of both senders (requests,
    retransmissions, READ responses); only FIRST, LAST and RETX appear.  MR-SACK-009: SACKETH byte 11 bits
    5-0 are zero in every NATIVE_SACK.  Read from the raw bytes at the spec's offsets (the NETH after the
    BTH, or after BTH + RETH; SACKETH byte 11 at BTH + 4 + 11), and from the codec's decoding: the same."""
    n_neth = n_sack = 0
    for raw, p in _all(capture, "a") + _all(capture, "b"):
        op = p.bth.opcode
        if op in NETH_AT:
            b0 = raw[BTH_AT + 12 + NETH_AT[op]]
            assert b0 == p.neth.flags and b0 & 0x1F == 0, (hex(op), hex(p.bth.psn), hex(b0))
            n_neth += 1
        elif op == Op.NATIVE_SACK:
            b11 = raw[BTH_AT + 12 + 4 + 11]
            assert b11 == p.sacketh.flags and b11 & 0x3F == 0, (hex(p.bth.psn), hex(b11))
            n_sack += 1
    assert n_neth > 300 and n_sack >= 5, (n_neth, n_sack)


def test_sack_layout_on_the_wire_mr_sack_002(capture):
    """MR-SACK-002: every NATIVE_SACK B sends is BTH (opcode 0xC6, DestQP A's QPN, SE, PadCnt and AckReq 0,
    the P_Key of the QP's other packets), AETH, SACKETH and exactly bitmap_words words, then the ICRC: the UDP
    length is 8 + 28 + 4 * bitmap_words + 4.  scapy.contrib.roce reads the same BTH and computes the same
    ICRC; the 16 bytes after its BTH are AETH and SACKETH and the bitmap follows."""
    cap = capture
    frames = _all(cap, "b")
    sacks = [(raw, p) for raw, p in frames if p.bth.opcode == Op.NATIVE_SACK]
    others = [p for _, p in frames if p.bth.opcode != Op.NATIVE_SACK] + [p for _, p in _all(cap, "a")]
    assert len(sacks) >= 5 and others
    pkeys = {p.bth.pkey for p in others}
    assert len(pkeys) == 1
    words = set()
    for raw, p in sacks:
        b = p.bth
        assert (b.dest_qp, b.se, b.pad, b.ack_req, b.tver) == (cap["qpn_a"], 0, 0, 0, 0), b
        assert b.pkey in pkeys and p.icrc_ok and p.payload == b""
        nw = p.sacketh.bitmap_words
        words.add(nw)
        assert len(p.sack_bitmap) == nw and p.udp.length == 8 + 28 + 4 * nw + 4, (nw, p.udp.length)
        s = Ether(raw)[S_BTH]                                    # the independent decoding
        assert (s.opcode, s.dqpn, s.psn, s.pkey, s.solicited, s.padcount, s.ackreq) == \
            (0xC6, b.dest_qp, b.psn, b.pkey, 0, 0, 0)
        assert s.compute_icrc(b"") == raw[-4:]                    # scapy's ICRC is the one on the wire
        load = bytes(s[Raw].load)
        assert len(load) == 4 + 12 + 4 * nw and load[14] == nw
        assert load[0] == p.aeth.syndrome and int.from_bytes(load[1:4], "big") == p.aeth.msn
        assert [int.from_bytes(load[16 + 4 * i:20 + 4 * i], "big") for i in range(nw)] == list(p.sack_bitmap)
    assert max(words) >= 1 and 0 in words                        # with and without a bitmap


def test_ack_sack_names_the_cumulative_psn_and_completed_messages_mr_sack_003(capture):
    """MR-SACK-003: every ACK-type SACK B sends has AETH.Syndrome 0x1F; its BTH.PSN is a cumulative PSN (every
    PSN up to it crossed the switch towards B before the SACK came back: its first transmission if that was
    not dropped, else a retransmission); its AETH.MSN is the number of A's request messages wholly at or
    before that PSN (READs and atomics included: they are executed once the ePSN passes them), modulo 2^24."""
    cap = capture
    msgs = _messages([p for _, p in _all(cap, "a")])
    reached, drop_pending = set(), {(d - PSN0) & MASK for d in DROPS}
    n = 0
    for _, p in cap["all1"] + cap["all2"]:                       # both directions, in the tap's order
        op = p.bth.opcode
        if op in (Op.NATIVE_READ_RESP, Op.ATOMIC_ACKNOWLEDGE):
            continue
        if op != Op.NATIVE_SACK:                                 # A's request: did it reach B?
            d = (p.bth.psn - PSN0) & MASK
            if d in drop_pending:                                # the fault injector's one drop of d
                drop_pending.discard(d)
                continue
            span = max(1, -(-p.reth.dma_len // PMTU)) if op == Op.NATIVE_READ_REQ else 1
            reached |= set(range(d, d + span))
            continue
        assert p.aeth.syndrome == 0x1F, hex(p.aeth.syndrome)
        cum = (p.bth.psn - PSN0) & MASK
        if cum == MASK:                                          # PSN0 - 1: nothing received yet
            cum = -1
        assert set(range(cum + 1)) <= reached, (hex(p.bth.psn), sorted(set(range(cum + 1)) - reached)[:4])
        done = sum(1 for m in msgs if m["end"] <= cum)
        assert p.aeth.msn == done & MASK, (hex(p.bth.psn), p.aeth.msn, done)
        n += 1
    assert n >= 5 and not drop_pending
    assert len(reached) == max(m["end"] for m in msgs) + 1


def _fields(p):
    """Every field MR-SACK-024 requires a retransmission to repeat: BTH but AckReq, RETH, NETH but RETX and
    tsval, RSNETH, ImmDt, AtomicETH, and the payload."""
    b = p.bth
    ext = {}
    for name, h in p.ext.items():
        d = h.as_dict()
        if name == "neth":
            d["flags"] &= ~RETX
            d.pop("tsval")
        ext[name] = d
    return ((b.opcode, b.se, b.m, b.pad, b.tver, b.pkey, b.fecn, b.becn, b.dest_qp, b.psn), ext, p.payload)


def _check_rerequest(p, orig):
    """A READ re-request for part of a READ's responses (MR-OOO-021, not a copy of the request, so not held to
    MR-SACK-024; only a slow host, whose READ timer fires before the responses come, sends one here): PSN q
    inside the original READ request at p, VA + (q - p) * pmtu, the rkey, MSN and msg_len of the original,
    offset (q - p) * pmtu, FIRST and LAST set, a length within what is left of the READ."""
    o = next(r for (op, psn), r in orig.items() if op == Op.NATIVE_READ_REQ and
             0 <= (p.bth.psn - psn) & MASK < -(-r.reth.dma_len // PMTU))
    k = ((p.bth.psn - o.bth.psn) & MASK) * PMTU
    assert (p.reth.va, p.reth.rkey, p.neth.msn, p.neth.offset, p.neth.msg_len) == \
        (o.reth.va + k, o.reth.rkey, o.neth.msn, k, o.neth.msg_len), hex(p.bth.psn)
    assert p.neth.flags & (FIRST | LAST) == FIRST | LAST and 0 < p.reth.dma_len <= o.reth.dma_len - k


def test_retransmissions_repeat_the_original_mr_sack_024(capture):
    """MR-SACK-024: each packet A sends again -- the dropped middle WRITE packet, SEND packet (RSNETH), last
    WRITE_IMM packet (RSNETH, ImmDt), READ request, FETCH_ADD (AtomicETH) and tail WRITE -- repeats the
    original's BTH (but AckReq), RETH, NETH (but flags.RETX, set now, and tsval), RSNETH, ImmDt, AtomicETH and
    payload, byte for byte; only the UDP source port, the IP header's checksum-bearing fields and the ICRC may
    differ (all frames' ICRCs check)."""
    frames = [p for _, p in _all(capture, "a")]
    orig = {}
    again = []
    for p in frames:
        assert p.icrc_ok
        key = (p.bth.opcode, p.bth.psn)
        if _retx(p) or key in orig:
            again.append(p)
        else:
            orig[key] = p
    assert {(p.bth.psn) for p in again} >= set(DROPS), sorted(hex(p.bth.psn) for p in again)
    kinds = set()
    for p in again:
        o = orig.get((p.bth.opcode, p.bth.psn))
        if p.bth.opcode == Op.NATIVE_READ_REQ and (o is None or p.reth != o.reth):
            _check_rerequest(p, orig)                            # a run of a READ's responses: MR-OOO-021
            continue
        assert _fields(p) == _fields(o), (hex(p.bth.psn), _fields(p)[:2], _fields(o)[:2])
        if p.neth is not None:
            assert p.neth.flags & RETX and not o.neth.flags & RETX
        kinds.add(p.bth.opcode)
    assert kinds >= {Op.NATIVE_WRITE, Op.NATIVE_SEND, Op.NATIVE_WRITE_IMM, Op.NATIVE_READ_REQ, Op.FETCH_ADD}, kinds


# ============================================================================ a scripted peer
PEER_QPN = 0x779                        # the script's QP: exists nowhere
EPSN = 200                              # the QP under test's ePSN (the script's first request PSN)
SQ_PSN = 0x700                          # the QP under test's first request PSN


class Native(ScriptedQP):
    """A fresh native QP (ePSN 200, first request PSN 0x700) connected to the scripted peer."""
    settle = 0.05

    def __init__(self, wire) -> None:
        topo, pair, self.sock, ctx = wire
        # no RTO or tail-loss probe while the script takes its time: nothing is resent, no retry budget spent
        super().__init__(ctx, topo, pair, PEER_QPN, rq_psn=EPSN, sq_psn=SQ_PSN, rd_atomic=16, mtu=PMTU,
                         profile="native", native_params=dict(rto_initial=900, rto_min=500_000, pto_min=500_000))
        self.drain()

    def rounds(self, until=None) -> list:
        """Rounds until nothing more comes (or, given, until until(frames) holds), bounded; the frames."""
        return super().rounds(until=until, quiet_after=25 if until is None else None)

    def raw(self, frames) -> None:
        """Frames built elsewhere (scapy) onto the wire, then `settle` for them to cross."""
        for f in frames:
            self.sock.send(bytes(f))
        time.sleep(self.settle)

    def frame(self, opcode, psn, l4_after_bth: bytes, pad: int = 0, ack_req: int = 1):
        """A frame built by scapy alone: BTH (opcode, the QP as DestQP, psn) followed by l4_after_bth as it
        stands -- headers the codec could not build because they are too short -- and scapy's ICRC."""
        a, b = self.pair.a, self.pair.b
        return (Ether(src=b.mac, dst=a.mac) / IP(src=b.ipv4, dst=a.ipv4, flags="DF") /
                UDP(sport=0xC123, dport=4791, chksum=0) /
                S_BTH(opcode=opcode, padcount=pad, dqpn=self.qp.qp_num, ackreq=ack_req, psn=psn, icrc=None) /
                Raw(l4_after_bth))

    def sack(self, psn, syndrome, msn, tsecr=0, flags=0, bitmap=()):
        a, b = self.pair.a, self.pair.b
        self.sock.send(encode(Op.NATIVE_SACK, src_mac=b.mac, dst_mac=a.mac, src_ip=b.ipv4, dst_ip=a.ipv4,
                              sport=0xC123, dest_qp=self.qp.qp_num, psn=psn,
                              headers=dict(aeth=AETH(syndrome=syndrome, msn=msn),
                                           sacketh=SACKETH(tsecr=tsecr, credit=0xFFFF, echo_sport=0xC123,
                                                           bitmap_words=len(bitmap), flags=flags)),
                              sack_bitmap=bitmap))
        time.sleep(self.settle)

    def drops(self) -> dict:
        return self.ctx.loader.drops()



@pytest.fixture
def native(wire):
    q = Native(wire)
    try:
        yield q
    finally:
        q.close()


def _neth(fl, msn, off, mlen, tsval=7) -> bytes:
    return NETH(flags=fl, msn=msn, offset=off, msg_len=mlen, tsval=tsval).pack()


def test_short_native_requests_are_discarded_and_counted_mr_nat_009(native):
    """MR-NAT-009: native requests shorter than their opcode's fixed headers plus pad plus ICRC -- a
    NATIVE_WRITE whose NETH stops after 8 bytes, a NATIVE_SEND without its RSNETH, a NATIVE_WRITE_IMM without
    its ImmDt, a NATIVE_READ_REQ whose NETH is cut, a NATIVE_SEND_IMM whose PadCnt (3) exceeds the bytes
    after its headers (0) -- each with AckReq and a good ICRC (scapy's), each at the ePSN, are discarded
    (no SACK, the ePSN stays, nothing placed) and counted by reason (TRUNCATED_EXT, BAD_PAD); the codec
    refuses the same bytes.  Then a well-formed NATIVE_WRITE at the ePSN whose NETH has its reserved bits 4-0
    set is placed and acknowledged as usual (MR-NAT-011: a receiver ignores them), by an ACK-type SACK with
    syndrome 0x1F, BTH.PSN the ePSN and AETH.MSN 1 (MR-SACK-003)."""
    q = native
    reth = RETH(va=q.mr.addr, rkey=q.mr.rkey, dma_len=64).pack()
    short = [q.frame(Op.NATIVE_WRITE, EPSN, reth + _neth(FIRST | LAST, 0, 0, 64)[:8]),
             q.frame(Op.NATIVE_SEND, EPSN, _neth(FIRST | LAST, 0, 0, 0)),
             q.frame(Op.NATIVE_WRITE_IMM, EPSN, reth + _neth(FIRST | LAST, 0, 0, 64) + RSNETH(rsn=0).pack()),
             q.frame(Op.NATIVE_READ_REQ, EPSN, reth + _neth(FIRST | LAST, 0, 0, 64)[:12])]
    bad_pad = [q.frame(Op.NATIVE_SEND_IMM, EPSN, _neth(FIRST | LAST, 0, 0, 0) + RSNETH(rsn=0).pack() +
                       (5).to_bytes(4, "big"), pad=3)]
    for f in short + bad_pad:
        with pytest.raises(MalformedPacket):
            decode(bytes(f))
    d0 = q.drops()
    c0 = q.qp.native_counters()
    q.raw(short + bad_pad)
    assert q.rounds() == []
    d1 = q.drops()
    assert d1.get("TRUNCATED_EXT", 0) - d0.get("TRUNCATED_EXT", 0) == len(short), (d0, d1)
    assert d1.get("BAD_PAD", 0) - d0.get("BAD_PAD", 0) == len(bad_pad), (d0, d1)
    c1 = q.qp.native_counters()
    assert c1["epsn"] == c0["epsn"] == EPSN and c1["c_sack_tx"] == c0["c_sack_tx"] == 0
    assert q.qp.query_state() == QPState.RTS and (q.buf[:64] == 0).all()
    q.send([(Op.NATIVE_WRITE, EPSN, b"\xAB" * 64,
             dict(reth=RETH(va=q.mr.addr, rkey=q.mr.rkey, dma_len=64), neth=NETH(flags=FIRST | LAST | 0x1F, msn=0,
                                                                               offset=0, msg_len=64, tsval=7)))])
    got = q.rounds()
    assert [(p.bth.opcode, p.bth.psn, p.aeth.syndrome, p.aeth.msn) for p in got] == \
        [(Op.NATIVE_SACK, EPSN, 0x1F, 1)]
    assert (q.buf[:64] == 0xAB).all() and q.qp.native_counters()["epsn"] == EPSN + 1


def _post_write(q, wr_id, n=100):
    """A one-packet WRITE posted on the QP under test; the NATIVE_WRITE the script sees."""
    q.qp.post_send(SendWR(wr_id=wr_id, opcode=WROpcode.RDMA_WRITE, sg_list=[SGE(q.mr.addr, n, q.mr.lkey)],
                          remote_addr=0x10000, rkey=0x4242))
    got = q.rounds(lambda fs: any(p.bth.opcode == Op.NATIVE_WRITE for p in fs))
    return next(p for p in got if p.bth.opcode == Op.NATIVE_WRITE)


def test_sack_syndrome_bits_and_reserved_flags_at_the_requester_mr_sack_038(native):
    """MR-SACK-038, MR-SACK-009, MR-NAT-009 at a native requester facing a scripted responder:
    * a SACK with syndrome 0x85 (bit 7 set, bits 6-5 00, bits 4-0 5, not 0x1F) is ACK-type: it acknowledges
      the WRITE, which completes; SACKETH byte 11's reserved bits 5-0, all set, change nothing (MR-SACK-009);
    * a SACK whose bitmap_words (2) claims more words than it carries (1) is discarded and counted
      (TRUNCATED_EXT, MR-NAT-009): nothing completes;
    * syndrome 0xE0 is 0x60 with bit 7 set, the PSN sequence error NAK a native requester discards and counts
      (MR-SACK-033): it neither fails nor completes anything; syndrome 0x00 then acknowledges;
    * syndrome 0xE2 is the remote access error NAK (0x62) with bit 7 set: the WRITE completes with
      IBV_WC_REM_ACCESS_ERR and the QP enters the Error state."""
    q = native
    p = _post_write(q, 1)
    assert p.bth.psn == SQ_PSN and p.neth.msn == 0
    q.sack(SQ_PSN, 0x85, 1, tsecr=p.neth.tsval, flags=0x3F)
    q.rounds()
    assert [(w.wr_id, w.status) for w in q.cq.poll(4)] == [(1, WCStatus.SUCCESS)]
    c = q.qp.native_counters()
    assert c["c_sack_rx"] == 1 and c["c_sack_bad"] == 0 and c["snd_una"] == SQ_PSN + 1, c

    p = _post_write(q, 2)
    assert p.bth.psn == SQ_PSN + 1 and p.neth.msn == 1
    d0 = q.drops()
    q.raw([q.frame(Op.NATIVE_SACK, SQ_PSN + 1,
                   AETH(syndrome=0x1F, msn=2).pack() +
                   SACKETH(tsecr=p.neth.tsval, credit=0xFFFF, bitmap_words=2).pack() + (1 << 31).to_bytes(4, "big"),
                   ack_req=0)])
    q.rounds()
    assert q.drops().get("TRUNCATED_EXT", 0) - d0.get("TRUNCATED_EXT", 0) == 1
    assert q.cq.poll(4) == [] and q.qp.native_counters()["c_sack_rx"] == 1
    q.sack(SQ_PSN + 1, 0xE0, 1, tsecr=p.neth.tsval)
    q.rounds()
    c = q.qp.native_counters()
    assert q.cq.poll(4) == [] and q.qp.query_state() == QPState.RTS, c
    assert c["c_sack_nak_seq"] == 1, c
    q.sack(SQ_PSN + 1, 0x00, 2, tsecr=p.neth.tsval)
    q.rounds()
    assert [(w.wr_id, w.status) for w in q.cq.poll(4)] == [(2, WCStatus.SUCCESS)]

    p = _post_write(q, 3)
    q.sack(SQ_PSN + 2, 0xE2, 2, tsecr=p.neth.tsval)
    q.rounds()
    assert [(w.wr_id, w.status) for w in q.cq.poll(4)] == [(3, WCStatus.REM_ACCESS_ERR)]
    assert q.qp.query_state() == QPState.ERR
