"""Native responder: the NATIVE_SACK it sends (04-native.md 4.3.1 to 4.3.3, 02-headers.md 3.8).

The IUT's native QP is the responder; the LT plays the requester with native_packets frames and reads every
SACK field by field.  Bitmap bit i stands for PSN cum + 2 + i (MR-XH-029, MR-SACK-004 as revised).
"""
from __future__ import annotations

from .. import native_packets as N
from .. import packets as P
from ..registry import case
from ._common import ACK_WAIT, QUIET
from ._native import TOS_CE, connect_native, counted, is_sack, need, nv, pattern, summ


def _last_sack(c, after, settle=QUIET):
    got = c.sacks(after, settle)
    return got[-1] if got else None


@case("TC-SACK-002-a", rules=["MR-SACK-002", "MR-SACK-003", "MR-SACK-001", "MR-XH-026", "MR-XH-028", "MR-XH-035",
                              "MR-NAT-005"],
      category="SACK", profile="native", timeout=30)
def sack_layout(t):
    """A one-packet NATIVE_WRITE with AckReq is answered by one NATIVE_SACK laid out as 4.3.1, ACK-type 0x1F."""
    c = connect_native(t)
    psn = c.psn
    mark = c.send(*c.write_msg(b"native!!", 0))
    got = c.quiet(ACK_WAIT / 2, after=mark)
    mine = [f for f in got]
    s = next((f for f in mine if is_sack(f)), None)
    need(s is not None, f"no NATIVE_SACK for the WRITE at PSN {psn:#08x}: {summ(mine)}")
    v = nv(s)
    others = [f for f in mine if f.roce.op != N.NATIVE_SACK]
    t.check("MR-SACK-001", not others, f"frames other than NATIVE_SACK: {summ(others)}" if others else
            "only NATIVE_SACK acknowledged the WRITE", frames=others or [s],
            expected="NATIVE_SACK only (no ACKNOWLEDGE 0x11, no CNP)")
    t.check("MR-NAT-005", not others and v.op == 0xC6, f"acknowledged with {v.name}", frames=[s],
            expected="NATIVE_SACK (0xC6)")
    layout = (v.op == 0xC6 and v.dqpn == c.lt_qpn and v.se == 0 and v.pad == 0 and v.ackreq == 0
              and v.pkey == 0xFFFF and not v.malformed and v.sack is not None and v.payload == b""
              and v.hdr_len == 4 + 12 + 4 * int(v.sack.bitmap_words) and v.icrc_ok)
    t.check("MR-SACK-002", layout, f"SACK {v.summary()}", frames=[s],
            expected=f"BTH opcode 0xC6 dqpn={c.lt_qpn:#08x} SE 0 PadCnt 0 AckReq 0 P_Key 0xffff, AETH, SACKETH, "
                     "exactly bitmap_words words, nothing after")
    t.check("MR-XH-026", v.sack is not None and v.hdr_len == 16 + 4 * int(v.sack.bitmap_words) and not v.malformed,
            f"AETH then a 12-byte SACKETH and {int(v.sack.bitmap_words)} words: {v.hdr_len} bytes after the BTH",
            frames=[s], expected="AETH (4) + SACKETH (12) + 4 x Bitmap Words")
    t.check("MR-XH-028", v.psn == psn, f"BTH.PSN {v.psn:#08x}, cumulative PSN {psn:#08x}", frames=[s],
            expected=f"BTH.PSN {psn:#08x}")
    ok = v.syndrome == 0x1F and v.psn == psn and v.msn == 1
    t.check("MR-SACK-003", ok, f"syndrome {v.syndrome:#04x}, PSN {v.psn:#08x}, MSN {v.msn}", frames=[s],
            expected=f"syndrome 0x1f, PSN {psn:#08x}, MSN 1 (one message completed)")
    t.check("MR-XH-035", v.syndrome == 0x1F, f"ACK-type syndrome {v.syndrome:#04x}", frames=[s],
            expected="syndrome 0x1f exactly")


@case("TC-SACK-006-a", rules=["MR-SACK-006", "MR-XH-030", "MR-XH-033", "MR-XH-038", "MR-XH-034", "MR-SACK-009"],
      category="SACK", profile="native", timeout=30)
def sack_echoes_trigger(t):
    """Each SACK echoes the TSval and UDP source port of the packet that triggered it; N and C clear, Rsvd 0."""
    c = connect_native(t)
    ok_all, seen = True, []
    for i, (ts, sport) in enumerate(((0x1234_5678, 0xC101), (0xFFFF_FFF0, 0xE202), (7, 0xFFFF))):
        frames = c.write_msg(pattern(32, i), 64 * i, tsval=ts, sport=sport)
        mark = c.send(*frames)
        s = c.sack_for(P.psn_add(c.psn, -1), mark)
        need(s is not None, f"no SACK for the WRITE from source port {sport:#06x}")
        v = nv(s)
        seen.append(s)
        k = v.sack
        t.check("MR-SACK-006", k.tsecr == ts and k.echo_sport == sport and not k.n,
                f"tsecr {int(k.tsecr):#x} echo_sport {int(k.echo_sport):#06x} N {int(k.n)}", frames=[s],
                expected=f"tsecr {ts:#x}, echo_sport {sport:#06x}, N 0")
        t.check("MR-XH-030", k.tsecr == ts, f"TSecr {int(k.tsecr):#x}", frames=[s], expected=f"TSecr {ts:#x}")
        t.check("MR-XH-033", k.echo_sport == sport, f"Echo Sport {int(k.echo_sport):#06x}", frames=[s],
                expected=f"Echo Sport {sport:#06x}")
        t.check("MR-XH-038", not k.n, f"N {int(k.n)} for a packet with a NETH", frames=[s], expected="N 0")
        t.check("MR-XH-034", not k.ce and k.resv6 == 0, f"C {int(k.ce)}, reserved bits {int(k.resv6):#x}",
                frames=[s], expected="C 0 (not CE-marked), bits 5-0 zero")
        t.check("MR-SACK-009", k.resv6 == 0, f"byte 11 bits 5-0 {int(k.resv6):#x}", frames=[s], expected="0")


@case("TC-LOSS-002-a", rules=["MR-LOSS-002", "MR-SACK-006"], category="SACK", profile="native", timeout=30)
def delayed_sack_echoes_tsval_unaltered(t):
    """WRITEs without AckReq are acknowledged when the responder's coalescing counter or timer says (MR-SACK-015),
    later than they arrived; that SACK still echoes the TSval of the most recently received packet exactly --
    the responder does not adjust tsecr for its delay (MR-LOSS-002): one packet with TSval 0x7000_0001, then
    three with 0x7000_0101..0x7000_0103, each the TSval a sender whose clock were that value would stamp."""
    c = connect_native(t)
    got = []
    for n, base in ((1, 0x7000_0001), (3, 0x7000_0101)):
        frames = [c.write_msg(pattern(16, k), 32 * k + 256 * n, tsval=base + k, ackreq_last=False)[0]
                  for k in range(n)]
        mark = c.send(*frames)
        s = c.sack_for(P.psn_add(c.psn, -1), mark)
        need(s is not None, f"no SACK within the coalescing bounds for {n} WRITE(s) without AckReq")
        got.append((s, base + n - 1))
    bad = [(nv(s).sack.tsecr, want) for s, want in got if int(nv(s).sack.tsecr) != want]
    for r in ("MR-LOSS-002", "MR-SACK-006"):
        t.check(r, not bad, "; ".join(f"tsecr {int(nv(s).sack.tsecr):#x} for TSval {want:#x}" for s, want in got),
                frames=[s for s, _ in got], expected="tsecr equal to the last packet's TSval, however late the SACK")


@case("TC-SACK-008-a", rules=["MR-SACK-008", "MR-XH-031"], category="SACK", profile="native", timeout=30)
def sack_credit_without_credits(t):
    """Without CREDITS agreed every SACK carries Credit 0xFFFF."""
    c = connect_native(t)
    mark = c.send(*c.write_msg(b"x" * 100, 0), *c.write_msg(b"y" * 100, 256))
    sacks = c.sacks(mark, 0.3)
    need(sacks, "no SACK")
    bad = [f for f in sacks if nv(f).sack.credit != 0xFFFF]
    for r in ("MR-SACK-008", "MR-XH-031"):
        t.check(r, not bad, f"credit of {len(sacks)} SACKs: {sorted({int(nv(f).sack.credit) for f in sacks})}",
                frames=bad or sacks, expected="credit 0xffff (CREDITS not agreed)")


@case("TC-SACK-007-a", rules=["MR-SACK-007", "MR-XH-032", "MR-XH-034"], category="SACK",
      profile="native", timeout=30)
def sack_ce_count(t):
    """CE-marked requests: the triggered SACK has C set and ce_count is the running count of CE packets."""
    c = connect_native(t)
    plan = [(TOS_CE, 1, 1), (TOS_CE, 1, 2), (None, 0, 2), (TOS_CE, 1, 3)]
    for i, (tos, want_c, want_n) in enumerate(plan):
        kw = {"tos": tos} if tos is not None else {}
        mark = c.send(*c.write_msg(pattern(16, i), 32 * i, **kw))
        s = c.sack_for(P.psn_add(c.psn, -1), mark)
        need(s is not None, f"no SACK for WRITE {i}")
        k = nv(s).sack
        ok = int(k.ce) == want_c and int(k.ce_count) == want_n
        for r in ("MR-SACK-007", "MR-XH-032", "MR-XH-034"):
            t.check(r, ok, f"WRITE {i} ({'CE' if want_c else 'ECT(0)'}): C {int(k.ce)}, ce_count {int(k.ce_count)}",
                    frames=[s], expected=f"C {want_c}, ce_count {want_n}")


@case("TC-SACK-004-a", rules=["MR-SACK-004", "MR-SACK-005", "MR-SACK-014", "MR-XH-029", "MR-OOO-005",
                              "MR-SACK-018"],
      category="SACK", profile="native", timeout=30)
def sack_bitmap_spec_example(t):
    """09 9.3.4: a 37-packet WRITE at 0x100-0x124 missing 0x101, 0x104, 0x120 (MTU 256, W 256, AckReq clear)."""
    c = connect_native(t, mtu=256, psn=0x100, w=256)
    data = pattern(37 * 256, 3)
    frames = c.write_msg(data, 0, ackreq_last=False)
    missing = {0x101, 0x104, 0x120}
    # in groups, each ending with a packet that opens a new gap, the next group sent once the IUT has
    # answered the last: a SACK must follow each gap without waiting for coalescing (MR-SACK-014 1)
    groups = [(0x100, 0x102), (0x103, 0x105), (0x106, 0x121), (0x122, 0x124)]
    first = c.t.lt.last_num()
    for lo, hi in groups:
        mark = c.send(*[frames[p - 0x100] for p in range(lo, hi + 1) if p not in missing])
        hit = c.first_sack(mark, ACK_WAIT, match=lambda f, hi=hi: max(nv(f).received() | {nv(f).psn}) == hi)
        if hi in (0x102, 0x105, 0x121):
            t.check("MR-SACK-014", hit is not None,
                    f"after PSN {hi:#08x} (a new gap): {summ([hit]) if hit else 'no SACK reporting it'}",
                    frames=[hit] if hit else [mark + 1], expected=f"a NATIVE_SACK reporting PSN {hi:#08x} received")
    sacks = c.sacks(first, 0.3)
    need(sacks, "no NATIVE_SACK at all")
    last = sacks[-1]
    v = nv(last)
    want = [0xDFFFFFFD, 0xE0000000]
    ok = v.psn == 0x100 and list(v.sack.bitmap) == want
    t.check("MR-SACK-004", ok, f"last SACK: {v.summary()}", frames=[last],
            expected="BTH.PSN 0x000100, words dffffffd e0000000 (bit i = PSN 0x102 + i)")
    t.check("MR-XH-029", ok, f"words {[hex(w) for w in v.sack.bitmap]}", frames=[last],
            expected="dffffffd e0000000")
    t.check("MR-SACK-005", int(v.sack.bitmap_words) == 2, f"bitmap_words {int(v.sack.bitmap_words)}", frames=[last],
            expected="2 (highest 0x124 is 35 beyond the ePSN 0x101)")
    reported_missing = [f for f in sacks if nv(f).received() & missing or nv(f).psn in missing
                        or any(P.psn_before(m, nv(f).psn) for m in missing)]
    t.check("MR-SACK-018", not reported_missing and all(nv(f).psn == 0x100 for f in sacks),
            f"{len(sacks)} SACKs, none reports 0x101, 0x104 or 0x120", frames=reported_missing or [last],
            expected="no SACK reports a missing PSN received")
    holes = [c.mem((p - 0x100) * 256, 256) for p in sorted(missing)]
    placed = all(c.mem((p - 0x100) * 256, 256) == data[(p - 0x100) * 256:(p - 0x100 + 1) * 256]
                 for p in (0x100, 0x102, 0x110, 0x124))
    t.check("MR-OOO-005", all(h == bytes([0x5A]) * 256 for h in holes) and placed,
            f"missing PSNs' bytes untouched: {all(h == bytes([0x5A]) * 256 for h in holes)}; received placed: {placed}",
            expected="the received packets placed, nothing for 0x101, 0x104, 0x120")


@case("TC-SACK-004-b", rules=["MR-SACK-004", "MR-SACK-005", "MR-SACK-010", "MR-SACK-011", "MR-SACK-012"],
      category="SACK", profile="native", timeout=30)
def sack_window_edge(t):
    """PSN ePSN + W - 1 is accepted and reported by bit W - 2 (last bit of word W/32 - 1); ePSN + W is dropped."""
    w = 64
    c = connect_native(t, w=w)
    e = c.psn
    before = c.native_counters()
    far = c.write_msg(b"E" * 8, 1024, psn=P.psn_add(e, w - 1), msn=c.msn + 5, advance=False)
    mark = c.send(*far)
    s = c.first_sack(mark)
    need(s is not None, "no SACK for ePSN + W - 1")
    v = nv(s)
    want = [0] * (w // 32 - 1) + [0x00000002]
    ok = v.psn == P.psn_add(e, -1) and list(v.sack.bitmap) == want
    t.check("MR-SACK-010", ok and c.mem(1024, 8) == b"E" * 8, f"ePSN + W - 1 placed and reported: {v.summary()}",
            frames=[s], expected=f"cum {P.psn_add(e, -1):#08x}, bit {w - 2} set")
    t.check("MR-SACK-004", ok, f"bitmap {[hex(x) for x in v.sack.bitmap]}", frames=[s],
            expected=f"{' '.join(f'{x:08x}' for x in want)}")
    t.check("MR-SACK-005", int(v.sack.bitmap_words) == w // 32, f"bitmap_words {int(v.sack.bitmap_words)}",
            frames=[s], expected=f"{w // 32} (W / 32, never above)")
    out = c.write_msg(b"O" * 8, 2048, psn=P.psn_add(e, w), msn=c.msn + 6, advance=False)
    mark2 = c.send(*out)
    seen = c.quiet(QUIET, after=mark2)
    grew, ctext = counted(t, c, "rx_out_of_window", before)
    # then a valid request at the ePSN must be answered (the drop changed nothing)
    mark3 = c.send(*c.write_msg(b"V" * 8, 0))
    s3 = c.sack_for(e, mark3)
    ok3 = s3 is not None and nv(s3).psn == e and P.psn_add(e, w - 1) in nv(s3).received()
    t.check("MR-SACK-011", not seen and c.mem(2048, 8) == bytes([0x5A]) * 8 and grew and s3 is not None,
            f"ePSN + W: responses {summ(seen)}, placed {c.mem(2048, 8) != bytes([0x5A]) * 8}, {ctext}; the valid "
            f"WRITE at the ePSN: {summ([s3]) if s3 else 'no SACK'}", frames=seen + ([s3] if s3 else []),
            expected="no SACK, nothing placed, counted; then a SACK for the valid WRITE")
    t.check("MR-SACK-012", ok3, f"after the ePSN arrived: {summ([s3]) if s3 else 'nothing'}",
            frames=[s3] if s3 else [], expected=f"cum {e:#08x}, ePSN + W - 1 still reported")


@case("TC-SACK-004-c", rules=["MR-SACK-004", "MR-SACK-003", "MR-XH-028"], category="SACK", profile="native",
      timeout=30)
def sack_psn_wrap(t):
    """Across the PSN wrap (ePSN 0xfffffe): gaps at 0xffffff and 0x000001 reported modulo 2^24."""
    c = connect_native(t, psn=0xFFFFFD)
    fr = [c.write_msg(pattern(16, i), 32 * i)[0] for i in range(6)]       # 0xfffffd .. 0x000002
    mark = c.send(fr[0], fr[1], fr[3], fr[5])                            # missing 0xffffff and 0x000001
    sacks = c.sacks(mark, 0.3)
    need(sacks, "no SACK")
    v = nv(sacks[-1])
    ok = v.psn == 0xFFFFFE and list(v.sack.bitmap) == [0xA0000000]
    t.check("MR-SACK-004", ok, f"gaps 0xffffff, 0x000001: {v.summary()}", frames=sacks[-1:],
            expected="cum 0xfffffe, word a0000000 (0x000000 and 0x000002)")
    mark2 = c.send(fr[2], fr[4])
    s2 = c.sack_for(0x000002, mark2)
    ok2 = s2 is not None and nv(s2).psn == 0x000002 and int(nv(s2).sack.bitmap_words) == 0 and nv(s2).msn == 6
    t.check("MR-SACK-003", ok2, f"gaps filled: {summ([s2]) if s2 else 'no SACK'}", frames=[s2] if s2 else [],
            expected="cum 0x000002, no bitmap, MSN 6")
    t.check("MR-XH-028", ok2, f"cumulative PSN across the wrap: {nv(s2).psn:#08x}" if s2 else "no SACK",
            frames=[s2] if s2 else [], expected="0x000002")
