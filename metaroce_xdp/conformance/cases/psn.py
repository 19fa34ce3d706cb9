"""PSN handling of the IUT's responder: duplicates, the future-PSN NAK once per gap, the wrap at 2^24,
ACK coalescing and AckReq (MR-DUP, MR-NAK-002/003, MR-BTH-020, MR-ACK)."""
from __future__ import annotations

from .. import packets as P
from ..registry import case
from ._common import ACK_WAIT, QUIET, describe, expect_ack, responses

HALF = 1 << 23


def _is_nak0(f) -> bool:
    return f.roce.op == 0x11 and f.roce.ack_kind == "NAK" and f.roce.nak_code == 0


@case("TC-DUP-002-a", rules=["MR-DUP-001", "MR-DUP-002", "MR-DUP-006", "MR-ACK-008", "MR-DUP-010"], category="DUP",
      timeout=10)
def duplicate_write_acked_not_placed(t):
    """A WRITE sent again at the same PSN (other bytes) is ACKed at epsn - 1 with the same MSN, not placed."""
    c = t.connect()
    p = c.psn
    m1 = c.send(c.write(b"original", offset=0))
    a1 = expect_ack(c, p, m1)
    m2 = c.send(c.write(b"imposter", offset=0, psn=p))
    a2 = expect_ack(c, p, m2)
    mem = c.mem(0, 8)
    exp = f"two ACKNOWLEDGE ACK psn={p:#08x} msn=1; memory 'original'"
    frames = [f for f in (a1, a2) if f is not None] or [m2 + 1]
    t.check("MR-DUP-001", a2 is not None and not any(_is_nak0(f) for f in c.quiet(0.05, after=m2)),
            "the duplicate was answered as a duplicate, not as an error" if a2 else "no answer to the duplicate",
            frames=frames, expected=exp)
    t.check("MR-DUP-002", a2 is not None and mem == b"original",
            f"duplicate ACKed: {a2 is not None}; memory {mem!r}", frames=frames, expected=exp)
    ok = a1 is not None and a2 is not None and a1.roce.msn == 1 and a2.roce.msn == 1
    t.check("MR-DUP-006", ok, f"MSN after the original {a1.roce.msn if a1 else None}, after the duplicate "
            f"{a2.roce.msn if a2 else None}", frames=frames, expected=exp)
    t.check("MR-ACK-008", ok, "MSN 1 after one WRITE, unchanged by its duplicate" if ok else "MSN wrong",
            frames=frames, expected=exp)
    qpc = t.caps.get("qp_counters")
    if "rx_dup_req" in (qpc if qpc is not None else t.caps.get("counters", ())):
        n = c.counters().get("rx_dup_req")
        t.check("MR-DUP-010", n == 1, f"rx_dup_req {n} after one duplicate", frames=frames,
                expected="rx_dup_req 1")
    else:
        t.cannot_drive("MR-DUP-010", "the IUT's agent reports no per-QP rx_dup_req counter (caps.qp_counters)")
    m3 = c.send(c.write(b"next", offset=16))          # epsn unchanged by the duplicate
    a3 = expect_ack(c, P.psn_add(p, 1), m3)
    t.check("MR-DUP-006", a3 is not None and a3.roce.msn == 2, f"the next PSN was then accepted: {a3 is not None}",
            frames=[a3] if a3 else [m3 + 1], expected=f"ACKNOWLEDGE ACK psn={P.psn_add(p, 1):#08x} msn=2")


@case("TC-DUP-002-b", rules=["MR-DUP-002", "MR-ACK-014"], category="DUP", timeout=10)
def duplicate_without_ackreq_acked(t):
    """A duplicate WRITE without AckReq is still ACKed (duplicates are ACKed whatever AckReq says)."""
    c = t.connect()
    p = c.psn
    m1 = c.send(c.write(b"first", offset=0))
    expect_ack(c, p, m1)
    m2 = c.send(c.write(b"again", offset=0, psn=p, ackreq=False))
    a2 = expect_ack(c, p, m2)
    for r in ("MR-DUP-002", "MR-ACK-014"):
        t.check(r, a2 is not None, "duplicate without AckReq ACKed" if a2 else "duplicate without AckReq not ACKed",
                frames=[a2] if a2 else [m2 + 1], expected=f"ACKNOWLEDGE ACK psn={p:#08x}")


@case("TC-DUP-006-a", rules=["MR-DUP-006", "MR-NAK-003"], category="DUP", timeout=10)
def duplicate_during_gap_keeps_nak_sent(t):
    """After a sequence-error NAK, a duplicate is ACKed, causes no NAK, and leaves nak_sent set."""
    c = t.connect()
    p = c.psn
    m0 = c.send(c.write(b"one", offset=0))
    expect_ack(c, p, m0)
    m1 = c.send(c.write(b"ahead", offset=64, psn=P.psn_add(p, 3)))
    nak = c.expect(1, ACK_WAIT, after=m1, match=_is_nak0)
    m2 = c.send(c.write(b"dup", offset=0, psn=p))
    dup = responses(c, m2, lambda f: f.roce.op == 0x11)
    m3 = c.send(c.write(b"ahead2", offset=128, psn=P.psn_add(p, 4)))
    later = c.quiet(QUIET, after=m3)
    ok_dup = len(dup) == 1 and dup[0].roce.ack_kind == "ACK" and dup[0].roce.psn == p
    t.check("MR-DUP-006", bool(nak) and ok_dup, f"NAK for the gap: {bool(nak)}; answers to the duplicate: "
            f"{describe(dup)}", frames=nak + dup or [m2 + 1],
            expected=f"one ACKNOWLEDGE ACK psn={p:#08x} for the duplicate, no NAK")
    t.check("MR-NAK-003", bool(nak) and not later, f"answers to a second out-of-sequence packet: {describe(later)}",
            frames=nak + later or [m3 + 1], expected="no second NAK while nak_sent is set")
    m4 = c.send(c.write(b"fill", offset=192, psn=P.psn_add(p, 1)))
    a4 = expect_ack(c, P.psn_add(p, 1), m4)
    t.check("MR-NAK-003", a4 is not None, "the packet at epsn was then accepted", frames=[a4] if a4 else [m4 + 1],
            expected=f"ACKNOWLEDGE ACK psn={P.psn_add(p, 1):#08x}")


@case("TC-NAK-003-b", rules=["MR-NAK-003", "MR-NAK-002"], category="ACK", timeout=10)
def one_nak_per_gap(t):
    """Two gaps one after the other: each gets its own sequence-error NAK (nak_sent cleared in between)."""
    c = t.connect()
    p = c.psn
    m1 = c.send(c.write(b"g1", offset=0, psn=P.psn_add(p, 1)), c.write(b"g1b", offset=8, psn=P.psn_add(p, 2)))
    n1 = responses(c, m1, _is_nak0)
    m2 = c.send(c.write(b"fill", offset=16, psn=p))
    a2 = expect_ack(c, p, m2)
    m3 = c.send(c.write(b"g2", offset=32, psn=P.psn_add(p, 3)), c.write(b"g2b", offset=40, psn=P.psn_add(p, 4)))
    n3 = responses(c, m3, _is_nak0)
    ok1 = len(n1) == 1 and _is_nak0(n1[0]) and n1[0].roce.psn == p
    ok3 = len(n3) == 1 and _is_nak0(n3[0]) and n3[0].roce.psn == P.psn_add(p, 1)
    detail = f"first gap: {describe(n1)}; filled: {a2 is not None}; second gap: {describe(n3)}"
    exp = f"NAK(0x60) psn={p:#08x} once, ACK psn={p:#08x}, NAK(0x60) psn={P.psn_add(p, 1):#08x} once"
    frames = n1 + ([a2] if a2 else []) + n3 or [m1 + 1]
    t.check("MR-NAK-003", ok1 and ok3 and a2 is not None, detail, frames=frames, expected=exp)
    t.check("MR-NAK-002", ok1 and ok3, detail, frames=frames, expected=exp)


@case("TC-BTH-020-a", rules=["MR-BTH-020", "MR-RC-015", "MR-ACK-001"], category="SEQ", timeout=10)
def psn_wraps_at_2_24(t):
    """WRITEs at PSNs 0xfffffe, 0xffffff, 0, 1: each accepted and ACKed with its PSN; a duplicate of 0xffffff
    after the wrap is a duplicate (ACK psn 1) and a packet at 4 is a gap (NAK psn 2)."""
    c = t.connect(psn=0xFFFFFE)
    ok, frames = True, []
    for i in range(4):
        psn = c.psn
        m = c.send(c.write(b"wrap%d" % i, offset=16 * i))
        a = expect_ack(c, psn, m)
        frames.append(a or m + 1)
        ok &= a is not None and c.mem(16 * i, 5) == b"wrap%d" % i and (a.roce.msn == i + 1)
    t.check("MR-RC-015", ok, "four WRITEs across the wrap accepted in order", frames=frames,
            expected="ACKs psn 0xfffffe, 0xffffff, 0x000000, 0x000001, msn 1..4")
    t.check("MR-ACK-001", ok, "each ACK carries its packet's PSN and the new MSN" if ok else "ACKs wrong",
            frames=frames, expected="ACKs psn 0xfffffe, 0xffffff, 0x000000, 0x000001, msn 1..4")
    m = c.send(c.write(b"dup", offset=512, psn=0xFFFFFF))
    dup = c.expect(1, ACK_WAIT, after=m)
    m2 = c.send(c.write(b"gap", offset=512, psn=4))
    gap = c.expect(1, ACK_WAIT, after=m2)
    ok2 = (len(dup) == 1 and dup[0].roce.ack_kind == "ACK" and dup[0].roce.psn == 1
           and len(gap) == 1 and _is_nak0(gap[0]) and gap[0].roce.psn == 2 and c.mem(512, 3) == bytes(3))
    t.check("MR-BTH-020", ok and ok2, f"after the wrap: duplicate 0xffffff -> {describe(dup)}; 4 -> {describe(gap)}",
            frames=frames + dup + gap, expected="ACK psn 0x000001 for the duplicate, NAK(0x60) psn 0x000002")


@case("TC-BTH-020-b", rules=["MR-BTH-020", "MR-DUP-001", "MR-NAK-002"], category="SEQ", timeout=10)
def half_space_edges(t):
    """epsn + 2^23 - 1 is after epsn (sequence-error NAK); epsn + 2^23 + 1 is before it (a duplicate).
    (epsn + 2^23 itself is neither, README section 4; MR-BTH-021 keeps it from happening.)"""
    c = t.connect()
    p = c.psn
    m0 = c.send(c.write(b"base", offset=0))
    expect_ack(c, p, m0)
    e = c.psn                                          # epsn now
    m1 = c.send(c.write(b"before", offset=64, psn=P.psn_add(e, HALF + 1)))
    r1 = c.expect(1, ACK_WAIT, after=m1)
    m2 = c.send(c.write(b"after", offset=128, psn=P.psn_add(e, HALF - 1)))
    r2 = c.expect(1, ACK_WAIT, after=m2)
    placed = c.mem(64, 6) != bytes(6) or c.mem(128, 5) != bytes(5)
    ok1 = len(r1) == 1 and r1[0].roce.ack_kind == "ACK" and r1[0].roce.psn == p
    ok2 = len(r2) == 1 and _is_nak0(r2[0]) and r2[0].roce.psn == e
    exp = (f"psn {P.psn_add(e, HALF + 1):#08x}: ACKNOWLEDGE ACK psn={p:#08x} (duplicate); psn {P.psn_add(e, HALF - 1):#08x}: "
           f"NAK(0x60) psn={e:#08x}")
    det = f"epsn+2^23+1 -> {describe(r1)}; epsn+2^23-1 -> {describe(r2)}; placed: {placed}"
    t.check("MR-BTH-020", ok1 and ok2 and not placed, det, frames=r1 + r2 or [m1 + 1], expected=exp)
    t.check("MR-DUP-001", ok1 and not placed, det, frames=r1 or [m1 + 1], expected=exp)
    t.check("MR-NAK-002", ok2 and not placed, det, frames=r2 or [m2 + 1], expected=exp)


@case("TC-ACK-003-b", rules=["MR-ACK-003", "MR-ACK-001", "MR-ACK-008"], category="ACK", timeout=10)
def coalesced_ack_for_last_ackreq(t):
    """Eight WRITEs back to back, AckReq only on the last: an ACK for the last PSN with MSN 8, none beyond it."""
    c = t.connect()
    p = c.psn
    frames = [c.write(b"c%d" % i, offset=8 * i, ackreq=(i == 7)) for i in range(8)]
    m = c.send(*frames)
    last = P.psn_add(p, 7)
    c.expect(1, ACK_WAIT, after=m, match=lambda f: f.roce.op == 0x11 and f.roce.psn == last)
    got = c.quiet(0.05, after=m)
    fin = [f for f in got if f.roce.ack_kind == "ACK" and f.roce.psn == last]
    stray = [f for f in got if f.roce.ack_kind != "ACK" or not (P.psn_before(f.roce.psn, P.psn_add(last, 1))
                                                                 and not P.psn_before(f.roce.psn, p))]
    exp = f"ACKNOWLEDGE ACK psn={last:#08x} msn=8 (earlier ACKs, if any, for PSNs {p:#08x}..{last:#08x})"
    t.check("MR-ACK-003", bool(fin), f"ACKs: {describe(got)}", frames=got or [m + 1], expected=exp)
    t.check("MR-ACK-001", bool(fin) and not stray, f"ACKs outside the packets sent: {describe(stray)}",
            frames=got or [m + 1], expected=exp)
    t.check("MR-ACK-008", bool(fin) and fin[-1].roce.msn == 8, f"MSN of the last ACK {fin[-1].roce.msn if fin else None}",
            frames=fin or [m + 1], expected=exp)


@case("TC-ACK-003-c", rules=["MR-ACK-003"], category="ACK", timeout=10)
def every_ackreq_covered(t):
    """Eight WRITEs with AckReq each: every one is covered by an ACK at or after its PSN; the last ACK is the last PSN."""
    c = t.connect()
    p = c.psn
    m = c.send(*[c.write(b"e%d" % i, offset=8 * i) for i in range(8)])
    last = P.psn_add(p, 7)
    got = c.expect(1, ACK_WAIT, after=m, match=lambda f: f.roce.op == 0x11 and f.roce.psn == last)
    acks = [f for f in c.t.lt.collect(c.is_mine, 0.05, after=m) if f.roce.ack_kind == "ACK"]
    ok = bool(got) and acks and acks[-1].roce.psn == last
    t.check("MR-ACK-003", ok, f"ACKs: {describe(acks)}", frames=acks or [m + 1],
            expected=f"ACKs ending with psn={last:#08x}")


@case("TC-ACK-004-a", rules=["MR-ACK-004"], category="ACK", timeout=15, timing=True)
def ack_delay_bounded(t):
    """The observable part of MR-ACK-004 (Table 9-2): 20 lone WRITEs with AckReq, each followed by a lone 8-byte
    READ, to an otherwise idle IUT; arrival-to-send on the capture time stamps.  The median ACK time may exceed
    the median READ RESPONSE time (the IUT's own input latency and processing, never coalesced) by at most
    ack_delay_max (10 us) plus the tolerance of MR-CONF-011; the largest delays are reported, not judged."""
    c = t.connect()
    tol_us, g_us = t.tolerance_s(10e-6) * 1e6, t.granularity_s() * 1e6
    limit_us = 10 + tol_us
    acks, reads, worst_pair = [], [], []

    def delay(frame: bytes, psn: int, match) -> tuple[float, list] | None:
        m = c.send(frame)
        got = c.t.lt.wait(match, ACK_WAIT, after=m)
        req = c.t.lt.wait(lambda f: f.outgoing and f.roce is not None and f.roce.psn == psn, 0.2, after=m)
        return None if got is None or req is None else ((got.ts - req.ts) * 1e6, [req, got])

    for i in range(20):
        psn = c.psn
        r = delay(c.write(b"d%02d" % i, offset=8 * i), psn,
                  lambda f: c.is_mine(f) and f.roce.ack_kind == "ACK" and f.roce.psn == psn)
        if r is None:
            t.check("MR-ACK-004", False, f"no ACK for PSN {psn:#08x}", frames=[], expected="an ACK")
            return
        if not acks or r[0] > max(acks):
            worst_pair = r[1]
        acks.append(r[0])
        psn = c.psn
        r = delay(c.frame("RDMA_READ_REQUEST", ackreq=True, reth=(c.va + 8 * i, c.rkey, 8)), psn,
                  lambda f: c.is_mine(f) and f.roce.op == 0x10 and f.roce.psn == psn)
        c.psn = P.psn_add(psn, 1)
        if r is None:
            t.undecided("MR-ACK-004", f"no READ RESPONSE ONLY for the READ at PSN {psn:#08x}: no reference time")
            return
        reads.append(r[0])
    acks.sort()
    reads.sort()
    ma, mr = acks[len(acks) // 2], reads[len(reads) // 2]
    t.check("MR-ACK-004", ma - mr <= limit_us,
            f"median ACK {ma:.0f} us, median READ RESPONSE {mr:.0f} us (arrival to send, input latency included), "
            f"difference {ma - mr:.0f} us, limit {limit_us:.0f} us (10 us + max(50 us, 2 x G = {2 * g_us:.0f} us)); "
            f"largest ACK {acks[-1]:.0f} us, largest READ RESPONSE {reads[-1]:.0f} us (reported, not judged)",
            frames=worst_pair, expected=f"median ACK at most {limit_us:.0f} us after the median READ RESPONSE")


@case("TC-RC-015-a", rules=["MR-RC-015", "MR-DUP-009"], category="SEQ", timeout=10)
def read_consumes_its_response_count(t):
    """A 3-packet READ at PSN p moves epsn to p + 3: a WRITE at p + 1 is a duplicate (ACK p + 2, not placed),
    a WRITE at p + 3 is accepted."""
    c = t.connect()
    p = c.psn
    c.mem_write(0, bytes(range(256)) * 12)
    m = c.send(c.frame("RDMA_READ_REQUEST", reth=(c.va, c.rkey, 3 * c.mtu), ackreq=True))
    rsp = c.expect(3, ACK_WAIT, after=m)
    c.psn = P.psn_add(p, 3)
    m1 = c.send(c.write(b"inside", offset=8192, psn=P.psn_add(p, 1)))
    d = c.expect(1, ACK_WAIT, after=m1)
    m2 = c.send(c.write(b"next", offset=8256))
    a = expect_ack(c, P.psn_add(p, 3), m2)
    # epsn - 1 = p + 2, or p - 1, the PSN before the READ (MR-DUP-002 as revised; Linux rxe)
    ok_dup = len(d) == 1 and d[0].roce.ack_kind == "ACK" and d[0].roce.psn in (P.psn_add(p, 2), P.psn_add(p, -1))
    placed = c.mem(8192, 6) != bytes(6)
    t.check("MR-RC-015", len(rsp) == 3 and ok_dup and a is not None,
            f"READ responses {len(rsp)}; WRITE at p+1 -> {describe(d)}; WRITE at p+3 ACKed {a is not None}",
            frames=rsp + d + ([a] if a else []) or [m + 1],
            expected=f"3 READ RESPONSEs, ACK psn={P.psn_add(p, 2):#08x} (or {P.psn_add(p, -1):#08x}), "
                     f"ACK psn={P.psn_add(p, 3):#08x}")
    which = ("" if not ok_dup else "; the PSN before the READ, r - 1 (recommended)"
             if d[0].roce.psn == P.psn_add(p, -1) else "; epsn - 1 (allowed)")
    t.check("MR-DUP-009", ok_dup and not placed, f"WRITE inside the READ's PSNs: {describe(d)}, placed {placed}{which}",
            frames=d or [m1 + 1],
            expected=f"ACK psn={P.psn_add(p, 2):#08x} (or {P.psn_add(p, -1):#08x}), nothing placed")


@case("TC-NAK-002-c", rules=["MR-NAK-002", "MR-NAK-001", "MR-ACK-007"], category="ACK", timeout=10)
def future_read_and_atomic_naked(t):
    """A READ REQUEST and (with ATOMICS) a FETCH_ADD after a gap each get the sequence-error NAK, with the
    current MSN; an in-order READ is answered by READ RESPONSEs only, never by an ACKNOWLEDGE."""
    c = t.connect()
    p = c.psn
    m = c.send(c.write(b"msn1", offset=0))
    expect_ack(c, p, m)
    e, msn = c.psn, 1
    kinds = [("READ REQUEST", c.frame("RDMA_READ_REQUEST", psn=P.psn_add(e, 2), ackreq=True,
                                      reth=(c.va, c.rkey, 64)))]
    if "ATOMICS" in t.claim.caps:
        kinds.append(("FETCH_ADD", c.frame("FETCH_ADD", psn=P.psn_add(e, 2), ackreq=True,
                                           atomic=(c.va + 64, c.rkey, 1, 0))))
    for what, f in kinds:
        mk = c.send(f)
        got = responses(c, mk, _is_nak0)
        ok = len(got) == 1 and _is_nak0(got[0]) and got[0].roce.psn == e
        t.check("MR-NAK-002", ok, f"{what} at epsn + 2: {describe(got)}", frames=got or [mk + 1],
                expected=f"one NAK(0x60) psn={e:#08x}")
        t.check("MR-NAK-001", ok and got[0].roce.msn == msn, f"NAK msn {got[0].roce.msn if got else None}",
                frames=got or [mk + 1], expected=f"NAK msn {msn} (the messages executed so far)")
        mk = c.send(c.write(b"fill", offset=256))      # clears nak_sent (MR-NAK-003) for the next kind
        expect_ack(c, e, mk)
        e, msn = c.psn, msn + 1
    mk = c.send(c.frame("RDMA_READ_REQUEST", ackreq=True, reth=(c.va, c.rkey, 16)))
    c.psn = P.psn_add(c.psn, 1)
    got = responses(c, mk, lambda f: f.roce.op == 0x10)
    ok = bool(got) and all(f.roce.op != 0x11 for f in got) and got[0].roce.op == 0x10
    t.check("MR-ACK-007", ok, f"answers to an in-order READ with AckReq: {describe(got)}", frames=got or [mk + 1],
            expected="RDMA_READ_RESPONSE_ONLY and no ACKNOWLEDGE")


@case("TC-DUP-006-b", rules=["MR-DUP-006", "MR-DUP-002"], category="DUP", timeout=10)
def duplicate_first_leaves_op_state(t):
    """A duplicate RDMA WRITE FIRST after its message completed is ACKed and not placed, and does not leave
    the responder expecting a MIDDLE/LAST: a WRITE ONLY after it is accepted."""
    c = t.connect(mtu=256)
    p = c.psn
    first = c.frame("RDMA_WRITE_FIRST", reth=(c.va, c.rkey, 300), payload=b"\x01" * 256)
    last = c.frame("RDMA_WRITE_LAST", psn=P.psn_add(p, 1), ackreq=True, payload=b"\x02" * 44)
    m = c.send(first, last)
    expect_ack(c, P.psn_add(p, 1), m)
    c.psn = P.psn_add(p, 2)
    c.mem_write(0, b"\xee" * 8)                         # a re-placement would overwrite this
    m2 = c.send(first)
    dup = expect_ack(c, P.psn_add(p, 1), m2)
    m3 = c.send(c.write(b"only", offset=1024))
    only = c.expect(1, ACK_WAIT, after=m3)
    ok_only = len(only) == 1 and only[0].roce.ack_kind == "ACK" and only[0].roce.psn == P.psn_add(p, 2)
    t.check("MR-DUP-002", dup is not None and c.mem(0, 8) == b"\xee" * 8,
            f"duplicate FIRST ACKed {dup is not None}, memory {c.mem(0, 8).hex()}", frames=[dup] if dup else [m2 + 1],
            expected=f"ACK psn={P.psn_add(p, 1):#08x}; memory untouched")
    t.check("MR-DUP-006", ok_only, f"WRITE ONLY after the duplicate FIRST: {describe(only)}",
            frames=only or [m3 + 1], expected=f"ACK psn={P.psn_add(p, 2):#08x} (op_state unchanged)")


@case("TC-NAK-002-d", rules=["MR-NAK-002", "MR-RC-014", "MR-RC-018"], category="SEQ", timeout=10)
def lost_middle_recovered(t):
    """A 3-packet SEND whose MIDDLE is lost: the LAST draws the sequence-error NAK at the MIDDLE's PSN; MIDDLE
    and LAST sent again complete the receive WQE with the whole message, in order."""
    c = t.connect(mtu=256)
    c.post_recv(1024, offset=0, wr_id=0x31)
    p = c.psn
    parts = [bytes([0x41 + i]) * n for i, n in enumerate((256, 256, 10))]
    first = c.frame("SEND_FIRST", payload=parts[0])
    middle = c.frame("SEND_MIDDLE", psn=P.psn_add(p, 1), payload=parts[1])
    last = c.frame("SEND_LAST", psn=P.psn_add(p, 2), ackreq=True, payload=parts[2])
    m = c.send(first, last)
    nak = responses(c, m, _is_nak0)
    ok_nak = len(nak) == 1 and _is_nak0(nak[0]) and nak[0].roce.psn == P.psn_add(p, 1)
    t.check("MR-NAK-002", ok_nak, f"after FIRST, LAST: {describe(nak)}", frames=nak or [m + 1],
            expected=f"one NAK(0x60) psn={P.psn_add(p, 1):#08x}")
    m2 = c.send(middle, last)
    ack = expect_ack(c, P.psn_add(p, 2), m2)
    wcs = c.poll(1, ACK_WAIT)
    data = c.mem(0, 522)
    ok = (ack is not None and wcs and wcs[0].get("status") == "IBV_WC_SUCCESS" and wcs[0].get("byte_len") == 522
          and data == b"".join(parts))
    t.check("MR-RC-014", ok, f"ACK {ack is not None}; completion {wcs}", frames=[ack] if ack else [m2 + 1],
            expected=f"ACK psn={P.psn_add(p, 2):#08x}, IBV_WC_RECV 522 bytes")
    t.check("MR-RC-018", ok, "the message placed in order" if ok else f"memory {data[:16].hex()}...",
            frames=[ack] if ack else [m2 + 1], expected="A x 256, B x 256, C x 10 at the WQE's buffer")
