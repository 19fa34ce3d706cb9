"""Native requester: what the IUT sends and how it consumes NATIVE_SACKs (04-native.md 4.2, 4.3.4 to 4.3.6,
4.4.6/4.4.7 requester side).  The agent posts work requests at the IUT's native QP; the LT plays the responder
and answers -- or forges, withholds, reorders -- SACKs, READ responses and ATOMIC_ACKNOWLEDGEs.

The IUT's RTO before its first RTT sample is its rto_initial (4 ms by default, 04 4.7): the LT answers at once,
and a case whose precondition was spoilt by an IUT retransmitting before the LT's first answer reached it says
so (ERROR, "the tester was too slow"), never FAIL.
"""
from __future__ import annotations

import struct
import time

from .. import native_packets as N
from .. import packets as P
from ..agentproto import AgentError
from ..registry import case
from ._native import (CAP, REMOTE_RKEY, REMOTE_VA, WC_FLUSH, WC_OK, check_wcs, connect_native, counted, fpsn,
                      iut_after, need, nv, op, pattern, peek, post, retx_before, sent_at, summ, wait_requests, wc_list,
                      wr)


def _sack_for(c, trig, cum, received=(), **kw):
    """An ACK-type SACK the LT sends for the IUT's request frame `trig` (tsecr, echo_sport from it)."""
    k = peek(trig)
    if k is None:
        v = nv(trig)
        k = (v.op, v.dqpn, v.psn, v.ackreq, b"", v.sport, int(v.neth.tsval) if v.neth is not None else None)
    kw.setdefault("tsecr", k[6] or 0)
    kw.setdefault("n", k[6] is None)
    kw.setdefault("echo_sport", k[5])
    return c.sack(cum, received=received, **kw)


def _first_tx(frames):
    """{psn: first frame} of request frames."""
    out = {}
    for f in frames:
        out.setdefault(fpsn(f), f)
    return out


def _retx(frames, after_num=0):
    return [f for f in frames if f.num > after_num and nv(f).neth is not None and nv(f).neth.retx]


def _conn(t, **kw):
    kw.setdefault("timeout", 18)            # rto_max 1.07 s: the RTO backs off slowly past the tester's pauses
    return connect_native(t, **kw)


@case("TC-NAT-017-a", rules=["MR-NAT-016", "MR-NAT-017", "MR-NAT-018", "MR-NAT-019", "MR-NAT-012", "MR-XH-017",
                             "MR-XH-003",
                             "MR-XH-018", "MR-XH-019", "MR-XH-020", "MR-NAT-005", "MR-NAT-014", "MR-SACK-026"],
      category="WIRE", profile="native", timeout=30)
def write_segmentation(t):
    """A 2500-byte RDMA WRITE is three NATIVE_WRITE packets (offsets 0/1024/2048, F/L, MSN 0, one RETH); a WRITE
    posted 200 ms later is MSN 1 at the next PSN with a TSval about 200 000 us later."""
    c = _conn(t)
    p = c.iut_psn
    c.mem_write(0, pattern(2500, 1))
    mark = post(c, wr(c, "RDMA_WRITE", 2500, wr_id=1))
    fr = wait_requests(c, mark, {p, P.psn_add(p, 1), P.psn_add(p, 2)})
    first = _first_tx(fr)
    need(len(first) == 3, f"the WRITE's packets: {summ(fr)}")
    mark_s = c.send(_sack_for(c, first[P.psn_add(p, 2)], P.psn_add(p, 2)))
    need(not retx_before(fr, mark_s + 1), "the tester was too slow: the IUT retransmitted before its first SACK")
    time.sleep(0.2)
    mark2 = post(c, wr(c, "RDMA_WRITE", 10, wr_id=2, offset=4000, remote_off=8192))
    fr2 = c.requests(mark2, 1, match=lambda f: fpsn(f) == P.psn_add(p, 3))
    need(bool(fr2), f"no packet for the second WRITE at PSN {P.psn_add(p, 3):#08x}")
    c.send(_sack_for(c, fr2[0], P.psn_add(p, 3)))
    vs = [nv(first[P.psn_add(p, i)]) for i in range(3)]
    w2 = nv(fr2[0])
    frames = [first[P.psn_add(p, i)] for i in range(3)] + fr2
    data = pattern(2500, 1)
    seg = ([len(v.payload) for v in vs] == [1024, 1024, 452] and b"".join(v.payload for v in vs) == data)
    t.check("MR-NAT-017", seg, summ(frames[:3]), frames=frames[:3], expected="payloads 1024, 1024, 452 bytes")
    t.check("MR-NAT-016", [v.psn for v in vs] + [w2.psn] == [P.psn_add(p, i) for i in range(4)], summ(frames),
            frames=frames, expected=f"PSNs {p:#x}..{p + 3:#x}, one per packet")
    nt = [(int(v.neth.offset), int(v.neth.msg_len), int(v.neth.first), int(v.neth.last)) for v in vs]
    t.check("MR-NAT-018", nt == [(0, 2500, 1, 0), (1024, 2500, 0, 0), (2048, 2500, 0, 1)]
            and (int(w2.neth.offset), int(w2.neth.msg_len), int(w2.neth.first), int(w2.neth.last)) == (0, 10, 1, 1),
            summ(frames), frames=frames, expected="offset (PSN - first) x 1024, msg_len L, F at 0, L at the end")
    reths = {(int(v.reth.va), int(v.reth.rkey), int(v.reth.dlen)) for v in vs}
    for r in ("MR-NAT-019", "MR-XH-003"):
        t.check(r, reths == {(REMOTE_VA, REMOTE_RKEY, 2500)}, f"RETHs {reths}", frames=frames[:3],
                expected=f"one RETH in every packet: va {REMOTE_VA:#x} rkey {REMOTE_RKEY:#x} dlen 2500")
    msns = [int(v.neth.msn) for v in vs] + [int(w2.neth.msn)]
    t.check("MR-NAT-012", msns == [0, 0, 0, 1], f"MSNs {msns}", frames=frames, expected="0, 0, 0, then 1")
    t.check("MR-XH-019", msns == [0, 0, 0, 1], f"MSNs {msns}", frames=frames, expected="0 0 0 1")
    t.check("MR-XH-017", all(v.neth is not None and v.hdr_len == 32 and not v.malformed for v in vs + [w2]),
            summ(frames), frames=frames, expected="RETH then a 16-byte NETH in every NATIVE_WRITE")
    t.check("MR-XH-018", all(v.neth.retx == 0 and v.neth.resv5 == 0 for v in vs + [w2]) and nt[0][2] == 1,
            summ(frames), frames=frames, expected="R 0 on first transmissions, Rsvd 0, F/L as above")
    t.check("MR-XH-020", all(int(v.neth.offset) + len(v.payload) <= int(v.neth.msg_len) == int(v.reth.dlen)
                             for v in vs + [w2]), summ(frames), frames=frames,
            expected="offset + payload <= Message Length = RETH.DMA Length")
    t.check("MR-NAT-005", all(v.op == N.NATIVE_WRITE for v in vs + [w2]), summ(frames), frames=frames,
            expected="NATIVE_WRITE (0xc2)")
    dt_us = (fr2[0].ts - first[p].ts) * 1e6
    dts = (int(w2.neth.tsval) - int(vs[0].neth.tsval)) & 0xFFFFFFFF
    mono = all(((int(b.neth.tsval) - int(a.neth.tsval)) & 0xFFFFFFFF) < 1 << 31 for a, b in zip(vs, vs[1:] + [w2]))
    t.check("MR-NAT-014", mono and abs(dts - dt_us) <= 0.1 * dt_us + 2000,
            f"TSval advanced {dts} us over {dt_us:.0f} us of capture time; monotonic {mono}", frames=frames,
            expected="a microsecond clock: the TSval difference within 10 % + 2 ms of the capture time difference")
    wcs = c.poll(2, 2.0)
    check_wcs(t, "MR-SACK-026", wcs, [(1, WC_OK), (2, WC_OK)], "after the SACKs", frames=frames)


@case("TC-NAT-025-a", rules=["MR-NAT-025", "MR-XH-037", "MR-XH-039", "MR-NAT-020", "MR-NAT-012", "MR-NAT-005"],
      category="WIRE", profile="native", timeout=30)
def rsn_and_imm(t):
    """SEND (2 packets), SEND_WITH_IMM (2 packets), RDMA_WRITE and RDMA_WRITE_WITH_IMM: RSNETH with RSN 0, 1, -, 2
    in every packet of the recv-consuming ones only; the ImmDt in every packet; MSNs 0..3."""
    c = _conn(t)
    p = c.iut_psn
    mark = post(c, wr(c, "SEND", 1500, wr_id=1), wr(c, "SEND_WITH_IMM", 1500, wr_id=2, imm=0x0BADCAFE),
                wr(c, "RDMA_WRITE", 10, wr_id=3), wr(c, "RDMA_WRITE_WITH_IMM", 10, wr_id=4, imm=0x01020304))
    fr = wait_requests(c, mark, {P.psn_add(p, i) for i in range(6)})
    first = _first_tx(fr)
    need(len(first) >= 6, f"the requests: {summ(fr)}")
    last = first[P.psn_add(p, 5)]
    c.send(_sack_for(c, last, P.psn_add(p, 5)))
    vs = [nv(first[P.psn_add(p, i)]) for i in range(6)]
    frames = [first[P.psn_add(p, i)] for i in range(6)]
    ops = [v.op for v in vs]
    t.check("MR-NAT-005", ops == [0xC0, 0xC0, 0xC1, 0xC1, 0xC2, 0xC3], summ(frames), frames=frames,
            expected="NATIVE_SEND x2, NATIVE_SEND_IMM x2, NATIVE_WRITE, NATIVE_WRITE_IMM")
    rsns = [None if v.rsneth is None else int(v.rsneth.rsn) for v in vs]
    t.check("MR-NAT-025", rsns == [0, 0, 1, 1, None, 2], f"RSNs {rsns}", frames=frames,
            expected="0, 0, 1, 1, none (WRITE), 2")
    hl = [v.hdr_len for v in vs]
    t.check("MR-XH-037", rsns == [0, 0, 1, 1, None, 2] and all(v.rsneth is None or v.rsneth.resv == 0 for v in vs),
            f"RSNETH present in {[r is not None for r in rsns]}, Rsvd 0", frames=frames,
            expected="an RSNETH after the NETH exactly in SEND, SEND_IMM, WRITE_IMM packets")
    t.check("MR-XH-039", hl == [20, 20, 24, 24, 32, 40], f"header bytes after the BTH {hl}", frames=frames,
            expected="20, 20, 24, 24, 32, 40 (fixed lengths 32, 36, 44, 52 with the BTH)")
    imms = [v.imm for v in vs]
    t.check("MR-NAT-020", imms == [None, None, 0x0BADCAFE, 0x0BADCAFE, None, 0x01020304], f"ImmDt {imms}",
            frames=frames, expected="the WR's immediate in both SEND_IMM packets and in the WRITE_IMM")
    msns = [int(v.neth.msn) for v in vs]
    t.check("MR-NAT-012", msns == [0, 0, 1, 1, 2, 3], f"MSNs {msns}", frames=frames, expected="0 0 1 1 2 3")


@case("TC-NAT-021-a", rules=["MR-NAT-021", "MR-XH-022", "MR-NAT-016", "MR-OOO-018", "MR-SACK-026"],
      category="OOO", profile="native", timeout=30)
def read_request_and_responses(t):
    """An RDMA READ of 2500 bytes is one NATIVE_READ_REQ (F, L, offset 0, msg_len 2500) taking three PSNs; the
    next WRITE starts after them.  Responses answered out of order are placed; READ then WRITE complete."""
    c = _conn(t)
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_READ", 2500, wr_id=1, offset=0), wr(c, "RDMA_WRITE", 8, wr_id=2, offset=8192))
    fr = wait_requests(c, mark, {p, P.psn_add(p, 3)})
    first = _first_tx(fr)
    need(p in first and P.psn_add(p, 3) in first, f"requests: {summ(fr)}")
    rq, w = nv(first[p]), nv(first[P.psn_add(p, 3)])
    src = pattern(2500, 9)
    rs = [c.read_resp(P.psn_add(p, i), int(rq.neth.msn), 1024 * i, 2500, src[1024 * i:1024 * (i + 1)])
          for i in range(3)]
    c.send(rs[2], rs[0], rs[1], _sack_for(c, first[P.psn_add(p, 3)], P.psn_add(p, 3)))
    ok = (rq.op == N.NATIVE_READ_REQ and rq.neth.first and rq.neth.last and not rq.neth.retx
          and int(rq.neth.offset) == 0 and int(rq.neth.msg_len) == 2500 == int(rq.reth.dlen) and rq.payload == b""
          and int(rq.neth.msn) == 0 and rq.pad == 0)
    t.check("MR-NAT-021", ok, summ([first[p]]), frames=[first[p]],
            expected="NATIVE_READ_REQ F L, offset 0, msg_len = RETH.DMA Length 2500, MSN 0, no payload")
    t.check("MR-XH-022", ok, summ([first[p]]), frames=[first[p]], expected="F and L set, R clear, no payload")
    t.check("MR-NAT-016", w.psn == P.psn_add(p, 3) and int(w.neth.msn) == 1 and
            not any(P.psn_add(p, i) in first for i in (1, 2)), summ(fr[:4]), frames=fr[:4],
            expected=f"the WRITE at {P.psn_add(p, 3):#08x}: the READ took {p:#x}..{p + 2:#x}")
    wcs = c.poll(2, 2.0)
    check_wcs(t, "MR-SACK-026", wcs, [(1, WC_OK), (2, WC_OK)], "READ then WRITE")
    t.check("MR-OOO-018", c.mem(0, 2500) == src and wcs[:1] and wcs[0]["status"] == WC_OK,
            "responses sent last, first, middle: data placed by NETH.offset", expected="the 2500 bytes in order",
            observed=[c.mem(0, 16).hex()])


@case("TC-NAT-010-a", rules=["MR-NAT-010"], category="WIRE", profile="native", timeout=30)
def send_with_invalidate_refused(t):
    """A SEND_WITH_INV work request on a native QP fails at post (EINVAL) and nothing is sent."""
    c = _conn(t)
    mark = t.lt.last_num()
    code = None
    try:
        post(c, wr(c, "SEND_WITH_INV", 16, wr_id=1, invalidate_rkey=0x1234), wait=True)
    except AgentError as e:
        code = e.code
    sent = c.quiet(0.3, after=mark)
    t.check("MR-NAT-010", code == "EINVAL" and not sent, f"post_send: {code or 'accepted'}; frames {summ(sent)}",
            frames=sent, expected="EINVAL, no 0x16/0x17 on the wire")


@case("TC-SACK-020-a", rules=["MR-SACK-020", "MR-SACK-022", "MR-SACK-023", "MR-SACK-024", "MR-SACK-021",
                              "MR-NAT-015", "MR-SACK-026"],
      category="SACK", profile="native", timeout=30)
def selective_retransmission(t):
    """Eight packets; the SACK misses two: the IUT retransmits exactly those two (RETX set, fields unchanged), never
    a sacked PSN, not even after a later SACK with a shorter bitmap."""
    c = _conn(t)
    p = c.iut_psn
    c.mem_write(0, pattern(8192, 2))
    mark = post(c, wr(c, "RDMA_WRITE", 8192, wr_id=1))
    fr = wait_requests(c, mark, {P.psn_add(p, i) for i in range(8)})
    first = _first_tx(fr)
    need(len(first) == 8, f"the WRITE's packets: {summ(fr)}")
    missing = {P.psn_add(p, 1), P.psn_add(p, 5)}
    got = {P.psn_add(p, i) for i in range(2, 8)} - missing
    mark_s = c.send(_sack_for(c, first[P.psn_add(p, 7)], p, received=got))
    ts = sent_at(c, mark_s)
    seen: dict = {}
    # every WRITE packet the IUT sends after the SACK left the LT (an RTO retransmission before it may have
    # sent them all: those are not judged here)
    rx = c.t.lt.collect(lambda f: c.is_mine(f) and op(f) == N.NATIVE_WRITE and f.ts > ts + 0.0005, 1.0, after=mark,
                        until=lambda fs: missing <= {fpsn(f) for f in fs})
    for f in rx:
        seen.setdefault(nv(f).psn, f)
    # a later SACK with a shorter bitmap: the sacked PSNs stay sacked (MR-SACK-021)
    mark2 = c.send(_sack_for(c, rx[-1] if rx else first[p], P.psn_add(p, 1), received={P.psn_add(p, 6)}))
    ts2 = sent_at(c, mark2)
    later = iut_after(c, ts2, [f for f in c.quiet(0.3, after=mark) if op(f) == N.NATIVE_WRITE])
    bad_later = [f for f in later if nv(f).psn in got]
    resent = set(seen)
    ok = resent == missing
    t.check("MR-SACK-023", ok, f"retransmitted after the SACK: {sorted(resent)}", frames=rx,
            expected=f"exactly {sorted(missing)}")
    t.check("MR-SACK-022", not (resent & got), f"sacked PSNs resent: {sorted(resent & got)}", frames=rx,
            expected="no sacked PSN retransmitted")
    t.check("MR-SACK-021", not bad_later, f"after a SACK with a shorter bitmap: {summ(later)}", frames=later,
            expected=f"none of {sorted(got - {P.psn_add(p, 6)})} retransmitted")
    probs = []
    for q, f in seen.items():
        a, b = nv(first[q]), nv(f)
        if (bytes(a.reth), a.neth.msn, a.neth.offset, a.neth.msg_len, a.neth.first, a.neth.last, a.payload, a.op) != \
                (bytes(b.reth), b.neth.msn, b.neth.offset, b.neth.msg_len, b.neth.first, b.neth.last, b.payload, b.op):
            probs.append(f"{q:#x}")
    t.check("MR-SACK-024", ok and not probs, f"retransmissions differing from the original: {probs or 'none'}",
            frames=list(seen.values()), expected="identical but for AckReq, RETX, TSval, source port")
    t.check("MR-NAT-015", ok and all(nv(f).neth.retx for f in seen.values()) and
            all(not nv(f).neth.retx for f in first.values()), summ(list(seen.values())), frames=list(seen.values()),
            expected="RETX 1 in retransmissions, 0 in first transmissions")
    mark3 = c.send(_sack_for(c, later[-1] if later else first[p], P.psn_add(p, 7)))
    wcs = c.poll(1, 2.0)
    t.check("MR-SACK-020", [w["status"] for w in wcs] == [WC_OK], f"after cum {P.psn_add(p, 7):#08x}: {wc_list(wcs)}",
            frames=[mark3 + 1], expected="the WRITE completes")
    check_wcs(t, "MR-SACK-026", wcs, [(1, WC_OK)], "after the last SACK")


@case("TC-SACK-019-a", rules=["MR-SACK-019", "MR-SACK-020"], category="SACK", profile="native", timeout=30)
def sack_for_psn_never_sent(t):
    """SACKs naming PSNs the IUT never sent -- cumulative PSN beyond snd_nxt, a bitmap bit at snd_nxt -- are
    ignored and counted: nothing completes; a valid SACK then completes the WRITE."""
    c = _conn(t)
    p = c.iut_psn
    before = c.native_counters()
    mark = post(c, wr(c, "RDMA_WRITE", 2048, wr_id=1))
    fr = wait_requests(c, mark, {p, P.psn_add(p, 1)})
    first = _first_tx(fr)
    need(len(first) == 2, f"the WRITE's packets: {summ(fr)}")
    trig = first[P.psn_add(p, 1)]
    forged = [_sack_for(c, trig, P.psn_add(p, 2)),                       # cum = snd_nxt: never sent
              _sack_for(c, trig, P.psn_add(p, 40)),
              _sack_for(c, trig, p, received={P.psn_add(p, 2)})]         # a bit at snd_nxt
    mark2 = c.send(*forged)
    wcs = c.poll(1, 0.3)
    grew, text = counted(t, c, "sack_discarded", before)
    t.check("MR-SACK-019", not wcs and grew, f"after SACKs for PSNs never sent: completions {wc_list(wcs)}; {text}",
            frames=[mark2 + 1, mark2 + 2, mark2 + 3], expected="no completion, the SACKs counted as discarded")
    c.send(_sack_for(c, trig, P.psn_add(p, 1)))
    wcs2 = c.poll(1, 2.0)
    t.check("MR-SACK-020", [w["status"] for w in wcs2] == [WC_OK], f"after the valid SACK: {wc_list(wcs2)}",
            expected="the WRITE completes")


@case("TC-SACK-019-b", rules=["MR-SACK-019", "MR-SACK-037"], category="SACK", profile="native", timeout=30)
def sack_acceptance_window(t):
    """MR-SACK-019's window: a SACK with BTH.PSN + 1 = snd_una - W - 1 is discarded (counted as such), one at
    snd_una - W is stale: neither changes what is acknowledged."""
    c = _conn(t, w=64)
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_WRITE", 1024, wr_id=1))
    fr = wait_requests(c, mark, {p})
    need(fr, "the WRITE was not sent")
    before = c.native_counters()
    if not before or "sack_discarded" not in before or "sack_stale" not in before:
        from ..context import NotApplicable
        raise NotApplicable("the agent reports no per-QP sack_discarded / sack_stale counters")
    c.send(_sack_for(c, fr[0], P.psn_add(p, -64 - 2)))          # BTH.PSN + 1 = snd_una - W - 1: outside
    time.sleep(0.1)
    mid = c.native_counters()
    c.send(_sack_for(c, fr[0], P.psn_add(p, -64 - 1)))          # BTH.PSN + 1 = snd_una - W: stale
    time.sleep(0.1)
    after = c.native_counters()
    wcs = c.poll(1, 0.1)
    d1 = (mid["sack_discarded"] - before["sack_discarded"], mid["sack_stale"] - before["sack_stale"])
    d2 = (after["sack_discarded"] - mid["sack_discarded"], after["sack_stale"] - mid["sack_stale"])
    t.check("MR-SACK-019", d1 == (1, 0) and not wcs, f"BTH.PSN + 1 = snd_una - W - 1: discarded +{d1[0]}, stale "
            f"+{d1[1]}", expected="discarded +1, stale +0", observed=[f"{d1}"])
    t.check("MR-SACK-037", d2 == (0, 1) and not wcs, f"BTH.PSN + 1 = snd_una - W: discarded +{d2[0]}, stale +{d2[1]}; "
            f"completions {wc_list(wcs)}", expected="stale +1, nothing completed", observed=[f"{d2}"])
    c.send(_sack_for(c, fr[0], p))
    c.poll(1, 1.0)


@case("TC-SACK-037-a", rules=["MR-SACK-037"], category="SACK", profile="native", timeout=30)
def stale_sack_changes_nothing(t):
    """After a SACK acknowledged two of four packets, a stale SACK (older cumulative PSN) whose bitmap names the
    other two does not sack them: both are still retransmitted."""
    c = _conn(t)
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_WRITE", 4096, wr_id=1))
    fr = wait_requests(c, mark, {P.psn_add(p, i) for i in range(4)})
    first = _first_tx(fr)
    need(len(first) == 4, f"the WRITE's packets: {summ(fr)}")
    mark_s = c.send(_sack_for(c, first[P.psn_add(p, 1)], P.psn_add(p, 1)),
                    _sack_for(c, first[P.psn_add(p, 3)], p, received={P.psn_add(p, 2), P.psn_add(p, 3)}))
    ts = sent_at(c, mark_s)
    want = {P.psn_add(p, 2), P.psn_add(p, 3)}
    rx = c.t.lt.collect(lambda f: c.is_mine(f) and op(f) == N.NATIVE_WRITE and f.ts > ts + 0.0005, 1.0, after=mark,
                        until=lambda fs: want <= {fpsn(f) for f in fs})
    got = {nv(f).psn for f in rx}
    t.check("MR-SACK-037", want <= got, f"retransmitted after the stale SACK: {sorted(got)}", frames=rx,
            expected=f"{sorted(want)} still retransmitted (the stale bitmap sacked nothing)")
    c.send(_sack_for(c, rx[-1] if rx else first[p], P.psn_add(p, 3)))
    c.poll(1, 1.0)


@case("TC-SACK-033-a", rules=["MR-SACK-033", "MR-SACK-036"], category="SACK", profile="native", timeout=30)
def sequence_error_nak_discarded(t):
    """NAK-type SACKs with syndrome 0x60 or 0x64, and an RNR NAK naming a WRITE's PSN, are discarded: the QP stays
    in RTS and a valid SACK completes the work request successfully."""
    c = _conn(t)
    p = c.iut_psn
    before = c.native_counters()
    mark = post(c, wr(c, "RDMA_WRITE", 16, wr_id=1))
    fr = wait_requests(c, mark, {p})
    need(fr, "the WRITE was not sent")
    mark2 = c.send(_sack_for(c, fr[0], p, syndrome=0x60), _sack_for(c, fr[0], p, syndrome=0x64))
    time.sleep(0.1)
    st = c.query()["state"]
    g1, t1 = counted(t, c, "sack_discarded", before)
    mid = c.native_counters()
    mark3 = c.send(_sack_for(c, fr[0], p, syndrome=0x20 | 24))
    time.sleep(0.05)
    g2, t2 = counted(t, c, "rnr_nak_discarded", mid)
    c.send(_sack_for(c, fr[0], p))
    wcs = c.poll(1, 2.0)
    t.check("MR-SACK-033", st == "RTS" and g1 and [w["status"] for w in wcs] == [WC_OK],
            f"after NAKs 0x60 and 0x64: QP {st}, {t1}; then the WRITE completed {wc_list(wcs)}",
            frames=[mark2 + 1, mark2 + 2], expected="discarded and counted; QP in RTS; the WRITE succeeds")
    t.check("MR-SACK-036", g2 and [w["status"] for w in wcs] == [WC_OK],
            f"an RNR NAK for the PSN of a WRITE (not recv-consuming): {t2}; WRITE {wc_list(wcs)}",
            frames=[mark3 + 1], expected="discarded and counted")


@case("TC-SACK-034-a", rules=["MR-SACK-034", "MR-SACK-019"], category="SACK", profile="native", timeout=30)
def error_nak_fails_its_wr(t):
    """A remote access error NAK-type SACK inside the second of three WRITEs: the first completes, the second
    fails IBV_WC_REM_ACCESS_ERR, the third is flushed, the QP is in ERR; one outside [snd_una, snd_nxt - 1]
    before it changed nothing."""
    c = _conn(t)
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_WRITE", 16, wr_id=1), wr(c, "RDMA_WRITE", 3000, wr_id=2, remote_off=4096),
                wr(c, "RDMA_WRITE", 16, wr_id=3, remote_off=16384))
    fr = wait_requests(c, mark, {P.psn_add(p, i) for i in range(5)})
    first = _first_tx(fr)
    need(len(first) >= 5, f"requests: {summ(fr)}")
    c.send(_sack_for(c, first[P.psn_add(p, 4)], P.psn_add(p, 5), syndrome=0x62))      # PSN = snd_nxt: outside
    time.sleep(0.05)
    st0 = c.query()["state"]
    wcs0 = c.poll(1, 0.05)
    t.check("MR-SACK-019", st0 == "RTS" and not wcs0, f"NAK at snd_nxt: QP {st0}, completions {wc_list(wcs0)}",
            expected="discarded: QP in RTS, nothing completed")
    c.send(_sack_for(c, first[P.psn_add(p, 2)], P.psn_add(p, 2), syndrome=0x62))
    wcs = c.poll(3, 2.0)
    st = c.query()["state"]
    ok = check_wcs(t, "MR-SACK-034", wcs, [(1, WC_OK), (2, "IBV_WC_REM_ACCESS_ERR"), (3, WC_FLUSH)],
                   "NAK 0x62 at the second WRITE's middle PSN")
    t.check("MR-SACK-034", st == "ERR", f"QP state {st}", expected="ERR", observed=[st])


@case("TC-SACK-038-a", rules=["MR-SACK-038"], category="SACK", profile="native", timeout=30)
def ack_syndrome_low_bits_ignored(t):
    """SACKs with syndrome 0x05 (bits 6-5 00, a credit-like code) and 0x9f (bit 7 set) are ACK-type."""
    c = _conn(t)
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_WRITE", 16, wr_id=1), wr(c, "RDMA_WRITE", 16, wr_id=2))
    fr = wait_requests(c, mark, {p, P.psn_add(p, 1)})
    first = _first_tx(fr)
    need(len(first) == 2, f"requests: {summ(fr)}")
    c.send(_sack_for(c, first[p], p, syndrome=0x05))
    w1 = c.poll(1, 1.0)
    c.send(_sack_for(c, first[P.psn_add(p, 1)], P.psn_add(p, 1), syndrome=0x9F))
    w2 = c.poll(1, 1.0)
    check_wcs(t, "MR-SACK-038", w1 + w2, [(1, WC_OK), (2, WC_OK)], "SACKs with syndromes 0x05 then 0x9f")


@case("TC-SACK-036-a", rules=["MR-SACK-036", "MR-SACK-039", "MR-SACK-042"], category="RNR", profile="native",
      timeout=30, timing=True)
def rnr_wait(t):
    """An RNR NAK-type SACK (timer code 24, 40.96 ms) for a SEND: nothing at or after its PSN is sent during the
    wait; then the SEND and the WRITE after it are retransmitted, AckReq on the SEND's last packet."""
    c = _conn(t)
    p = c.iut_psn
    mark = post(c, wr(c, "SEND", 16, wr_id=1), wr(c, "RDMA_WRITE", 16, wr_id=2))
    fr = wait_requests(c, mark, {p, P.psn_add(p, 1)})
    first = _first_tx(fr)
    need(len(first) == 2, f"requests: {summ(fr)}")
    mark_n = c.send(_sack_for(c, first[p], p, syndrome=0x20 | 24))
    nak = c.t.lt.wait(lambda f: f.outgoing, 1.0, after=mark_n)
    need(nak is not None, "the RNR NAK was not captured")
    rx = c.t.lt.collect(lambda f: c.is_mine(f) and op(f) in (0xC0, 0xC2) and f.ts > nak.ts, 0.5, after=mark,
                        until=lambda fs: {p, P.psn_add(p, 1)} <= {fpsn(f) for f in fs})
    wait_s = 40.96e-3
    tol = max(0.1 * wait_s, 2e-3)
    early = [f for f in rx if f.ts < nak.ts + wait_s - tol]
    t.check("MR-SACK-039", not early, f"sent during the wait: {summ(early) or 'nothing'}", frames=early,
            expected=f"nothing at or after {p:#08x} for 40.96 ms (tolerance {tol * 1e3:.1f} ms)")
    first_retx = next((f for f in rx if nv(f).psn == p), None)
    ok = (first_retx is not None and first_retx.ts >= nak.ts + wait_s - tol and nv(first_retx).ackreq
          and nv(first_retx).neth.retx and first_retx.ts <= nak.ts + wait_s + 0.05)
    t.check("MR-SACK-042", ok, f"after the wait: {summ(rx)}" + (f"; SEND resent {1e3 * (first_retx.ts - nak.ts):.1f} "
            "ms after the NAK" if first_retx else ""), frames=rx or [nak],
            expected="the SEND retransmitted with AckReq and RETX about 40.96 ms after the NAK (within 50 ms more)")
    t.check("MR-SACK-036", first_retx is not None and not early, "the NAK started an RNR wait", frames=rx[:1])
    c.send(_sack_for(c, rx[-1] if rx else first[p], P.psn_add(p, 1)))
    c.poll(2, 1.0)


@case("TC-OOO-025-a", rules=["MR-OOO-025", "MR-NAT-006", "MR-NAT-012"], category="ATOM", caps=("ATOMICS",),
      profile="native", timeout=30)
def atomic_ack_accepted_only_for_its_psn(t):
    """The IUT's FETCH_ADD is a compat 0x14 packet without NETH taking one PSN and one MSN; an
    ATOMIC_ACKNOWLEDGE for another PSN is discarded; the right one completes the WR with its original value."""
    c = _conn(t)
    p = c.iut_psn
    before = c.native_counters()
    mark = post(c, wr(c, "ATOMIC_FETCH_AND_ADD", 8, wr_id=1, offset=64, swap_add=hex(3)),
                wr(c, "RDMA_WRITE", 8, wr_id=2, offset=128))
    fr = wait_requests(c, mark, {p, P.psn_add(p, 1)})
    first = _first_tx(fr)
    need(len(first) == 2, f"requests: {summ(fr)}")
    a, w = nv(first[p]), nv(first[P.psn_add(p, 1)])
    t.check("MR-NAT-006", a.op == N.FETCH_ADD and a.neth is None and "AtomicETH" in a.base.headers
            and not a.base.malformed and a.payload == b"" and w.psn == P.psn_add(p, 1), summ([first[p]]),
            frames=[first[p]],
            expected="FETCH_ADD (0x14), BTH + AtomicETH, no NETH, one PSN")
    t.check("MR-NAT-012", int(w.neth.msn) == 1, f"the WRITE after the atomic: MSN {int(w.neth.msn)}",
            frames=[first[P.psn_add(p, 1)]], expected="MSN 1 (the atomic consumed MSN 0)")
    c.send(c.atomic_ack(P.psn_add(p, 1), 0xDEAD), c.atomic_ack(P.psn_add(p, 7), 0xBEEF))
    w0 = c.poll(1, 0.2)
    grew, text = counted(t, c, "atomic_ack_discarded", before)
    c.send(c.atomic_ack(p, 0x1122334455667788, msn=1), _sack_for(c, first[P.psn_add(p, 1)], P.psn_add(p, 1)))
    wcs = c.poll(2, 2.0)
    orig = struct.unpack("<Q", c.mem(64, 8))[0]
    ok = not w0 and grew and [w_["status"] for w_ in wcs] == [WC_OK, WC_OK] and orig == 0x1122334455667788
    t.check("MR-OOO-025", ok, f"ATOMIC_ACKNOWLEDGEs for the WRITE's PSN and a PSN never sent: completions "
            f"{wc_list(w0)}, {text}; the right one: {wc_list(wcs)}, local value {orig:#x}",
            expected="the wrong ones discarded; the atomic completes with 0x1122334455667788")


@case("TC-OOO-027-a", rules=["MR-OOO-027", "MR-OOO-025"], category="ATOM", caps=("ATOMICS",), profile="native",
      timeout=30)
def atomic_replayed_when_its_ack_is_lost(t):
    """The LT acknowledges the atomic's PSN by SACK but withholds the ATOMIC_ACKNOWLEDGE: the IUT replays the
    atomic unchanged with AckReq; the ATOMIC_ACKNOWLEDGE then completes it."""
    c = _conn(t)
    p = c.iut_psn
    mark = post(c, wr(c, "ATOMIC_CMP_AND_SWP", 8, wr_id=1, offset=64, compare=hex(5), swap_add=hex(9)))
    fr = wait_requests(c, mark, {p})
    need(fr, "the atomic was not sent")
    orig = nv(fr[0])
    mark_s = c.send(_sack_for(c, fr[0], p))
    rep = c.expect(1, 1.5, after=mark_s, match=lambda f: op(f) == N.COMPARE_SWAP)
    v = nv(rep[0]) if rep else None
    ok = (v is not None and v.psn == p and bytes(v.base.headers["AtomicETH"]) == bytes(orig.base.headers["AtomicETH"])
          and v.ackreq)
    t.check("MR-OOO-027", ok, f"after the SACK, no ATOMIC_ACKNOWLEDGE: {summ(rep)}", frames=rep or [mark_s + 1],
            expected=f"COMPARE_SWAP psn {p:#08x}, same AtomicETH, AckReq")
    c.send(c.atomic_ack(p, 5, msn=1))
    wcs = c.poll(1, 2.0)
    val = struct.unpack("<Q", c.mem(64, 8))[0]
    t.check("MR-OOO-025", [w["status"] for w in wcs] == [WC_OK] and val == 5,
            f"ATOMIC_ACKNOWLEDGE after snd_una passed the atomic: {wc_list(wcs)}, value {val}",
            expected="accepted: the atomic completes with 5")


@case("TC-OOO-020-a", rules=["MR-OOO-020", "MR-OOO-021", "MR-OOO-018", "MR-XH-022"], category="OOO",
      profile="native", timeout=30)
def read_response_loss_rerequested(t):
    """The LT answers a 3-packet READ with its first and last responses only: the IUT re-requests exactly the
    middle one (MR-OOO-021's layout) and completes once it arrives."""
    c = _conn(t)
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_READ", 3000, wr_id=1, offset=0, remote_off=4096))
    fr = wait_requests(c, mark, {p})
    need(fr, "no READ request")
    rq = nv(fr[0])
    m = int(rq.neth.msn)
    src = pattern(3000, 17)
    mark_r = c.send(c.read_resp(p, m, 0, 3000, src[:1024]), c.read_resp(P.psn_add(p, 2), m, 2048, 3000, src[2048:]))
    rr = c.expect(1, 1.5, after=mark_r, match=lambda f: op(f) == N.NATIVE_READ_REQ and fpsn(f) != p)
    v = nv(rr[0]) if rr else None
    ok = (v is not None and v.psn == P.psn_add(p, 1) and int(v.reth.va) == int(rq.reth.va) + 1024
          and int(v.reth.rkey) == int(rq.reth.rkey) and int(v.reth.dlen) == 1024 and int(v.neth.msn) == m
          and v.neth.retx and v.neth.first and v.neth.last and int(v.neth.offset) == 1024
          and int(v.neth.msg_len) == 3000)
    exp = (f"NATIVE_READ_REQ psn {P.psn_add(p, 1):#08x} va +1024 len 1024 msn {m} F L R offset 1024 msg_len 3000")
    t.check("MR-OOO-020", v is not None and v.psn == P.psn_add(p, 1), f"after responses 0 and 2: {summ(rr)}",
            frames=rr or [mark_r + 1], expected="a re-request for the missing response")
    t.check("MR-OOO-021", ok, summ(rr), frames=rr, expected=exp)
    t.check("MR-XH-022", ok, summ(rr), frames=rr, expected="R set, offset 1024 + DMA Length 1024 <= 3000")
    c.send(c.read_resp(P.psn_add(p, 1), m, 1024, 3000, src[1024:2048], retx=True))
    wcs = c.poll(1, 2.0)
    t.check("MR-OOO-018", [w["status"] for w in wcs] == [WC_OK] and c.mem(0, 3000) == src,
            f"completion {wc_list(wcs)}, data {'as read' if c.mem(0, 3000) == src else 'wrong'}",
            expected="READ complete with the 3000 bytes")


@case("TC-OOO-018-a", rules=["MR-OOO-018"], category="OOO", profile="native", timeout=30)
def bad_read_responses_discarded(t):
    """READ responses with a wrong MSN, a PSN outside the READ, or FIRST at a non-zero offset are discarded and
    place nothing; the right ones complete the READ."""
    c = _conn(t)
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_READ", 2048, wr_id=1, offset=0))
    fr = wait_requests(c, mark, {p})
    need(fr, "no READ request")
    m = int(nv(fr[0]).neth.msn)
    junk = b"\xEE" * 1024
    c.send(c.read_resp(p, (m + 3) & 0xFFFFFF, 0, 2048, junk),                 # an MSN no READ has
           c.read_resp(P.psn_add(p, 5), m, 1024, 2048, junk),                   # PSN outside the READ
           c.read_resp(P.psn_add(p, 1), m, 1024, 2048, junk, first=True))       # FIRST at offset 1024
    time.sleep(0.1)
    untouched = c.mem(0, 2048) == bytes([0x5A]) * 2048
    wcs0 = c.poll(1, 0.05)
    src = pattern(2048, 4)
    c.send(c.read_resp(p, m, 0, 2048, src[:1024]), c.read_resp(P.psn_add(p, 1), m, 1024, 2048, src[1024:]))
    wcs = c.poll(1, 2.0)
    t.check("MR-OOO-018", untouched and not wcs0 and [w["status"] for w in wcs] == [WC_OK] and c.mem(0, 2048) == src,
            f"bad responses: memory untouched {untouched}, completions {wc_list(wcs0)}; good ones: {wc_list(wcs)}",
            expected="nothing placed by the bad ones; the READ completes with the right bytes")


@case("TC-NAT-024-a", rules=["MR-NAT-024"], category="WIRE", profile="native", timeout=30)
def fence_waits_for_completion(t):
    """A WRITE posted with FENCE after a WRITE is not sent until the first has completed."""
    c = _conn(t)
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_WRITE", 16, wr_id=1), wr(c, "RDMA_WRITE", 16, wr_id=2, flags=["SIGNALED", "FENCE"]))
    fr = wait_requests(c, mark, {p})
    need(fr, "the first WRITE was not sent")
    early = [f for f in c.quiet(0.1, after=mark) if op(f) == N.NATIVE_WRITE and nv(f).psn == P.psn_add(p, 1)]
    mark_s = c.send(_sack_for(c, fr[0], p))
    later = c.requests(mark_s, 1, match=lambda f: fpsn(f) == P.psn_add(p, 1))
    t.check("MR-NAT-024", not early and bool(later), f"fenced WRITE before the first completed: {summ(early) or 'no'}; "
            f"after: {summ(later)}", frames=early + later, expected="the fenced WRITE only after the SACK")
    if later:
        c.send(_sack_for(c, later[0], P.psn_add(p, 1)))
    c.poll(2, 1.0)


@case("TC-MP-003-a", rules=["MR-MP-003", "MR-MP-005"], category="MP", caps=("MULTIPATH",), profile="native",
      timeout=30)
def single_entropy_value(t):
    """With K = 1 every packet of the QP has one UDP source port; SACKs from other source ports are accepted."""
    c = _conn(t, k=1, caps=CAP["NATIVE"] | CAP["SACK"] | CAP["OOO_PLACEMENT"] | CAP["MULTIPATH"])
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_WRITE", 8 * 1024, wr_id=1))
    fr = wait_requests(c, mark, {P.psn_add(p, i) for i in range(8)})
    first = _first_tx(fr)
    need(len(first) == 8, f"requests: {summ(fr)}")
    ports = {nv(f).sport for f in first.values()}
    t.check("MR-MP-003", len(ports) == 1, f"source ports {sorted(hex(x) for x in ports)}", frames=list(first.values()),
            expected="one source port")
    c.send(_sack_for(c, first[P.psn_add(p, 7)], P.psn_add(p, 7), sport=0xC777))
    wcs = c.poll(1, 2.0)
    t.check("MR-MP-005", [w["status"] for w in wcs] == [WC_OK], f"SACK from source port 0xc777: {wc_list(wcs)}",
            expected="accepted: the WRITE completes")


@case("TC-MP-002-a", rules=["MR-MP-002", "MR-MP-001", "MR-MP-006"], category="MP", caps=("MULTIPATH",),
      profile="native", timeout=30)
def entropy_values_spread(t):
    """With MULTIPATH and K = 4 the packets use at most 4 distinct source ports in 0xC000-0xFFFF, all 4 over 16
    packets, consecutive packets mostly on different values."""
    c = _conn(t, k=4, caps=CAP["NATIVE"] | CAP["SACK"] | CAP["OOO_PLACEMENT"] | CAP["MULTIPATH"])
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_WRITE", 16 * 1024, wr_id=1))
    fr = wait_requests(c, mark, {P.psn_add(p, i) for i in range(16)})
    first = _first_tx(fr)
    need(len(first) == 16, f"requests: {summ(fr)}")
    seq = [nv(first[P.psn_add(p, i)]).sport for i in range(16)]
    ports = set(seq)
    t.check("MR-MP-002", len(ports) <= 4 and all(0xC000 <= x <= 0xFFFF for x in ports),
            f"ports {sorted(hex(x) for x in ports)}", frames=list(first.values()),
            expected="at most 4 distinct ports in 0xc000-0xffff")
    t.check("MR-MP-001", len(ports) == 4, f"{len(ports)} values used over 16 packets", frames=list(first.values()),
            expected="the K = 4 agreed values")
    same = sum(1 for a, b in zip(seq, seq[1:]) if a == b)
    t.check("MR-MP-006", same <= 3, f"consecutive packets on the same value: {same} of 15; "
            f"ports {[hex(x) for x in seq]}",
            frames=list(first.values()), expected="the values spread (weighted round-robin)")
    c.send(_sack_for(c, first[P.psn_add(p, 15)], P.psn_add(p, 15)))
    c.poll(1, 1.0)


@case("TC-CC-020-a", rules=["MR-CC-020", "MR-NAT-022"], category="CC", profile="native", timeout=30)
def read_window_holds_the_next_request(t):
    """W 64: a 96 KiB READ (path MTU 1024, 96 response PSNs) is several request messages of at most W PSNs over
    consecutive sub-ranges, each with its own MSN (MR-NAT-022).  The first goes at once (no response PSN is
    outstanding); while it is unanswered read_cwnd is at most its initial 16 (05 5.7.1: nothing was delivered
    to grow it), so for 30 ms no further message may be asked for unless the PSNs requested stay within 16
    (MR-CC-020; re-requests of the first are exempt).  Then the LT answers each message in full once it is
    asked for, and the READ completes with its data."""
    c = _conn(t, w=64, mr_len=128 << 10)
    p = c.iut_psn
    size, mtu, init = 96 << 10, 1024, 16
    src = pattern(size, 23)
    mark = post(c, wr(c, "RDMA_READ", size, wr_id=1, offset=0))

    def is_new_rq(f):
        return op(f) == N.NATIVE_READ_REQ and not nv(f).neth.retx

    first = c.expect(1, 1.0, after=mark, match=is_new_rq)
    need(first, "no READ request")
    held = [f for f in c.quiet(0.03, after=mark) if is_new_rq(f)]
    spans = [max(1, -(-int(nv(f).reth.dlen) // mtu)) for f in held]
    ok_hold = len(held) == 1 or sum(spans) <= init
    asked, done = [], 0
    pending = list(held)
    while pending and done < 96:
        f = pending.pop(0)
        v = nv(f)
        asked.append(f)
        span = max(1, -(-int(v.reth.dlen) // mtu))
        at = int(v.reth.va) - REMOTE_VA
        need(0 <= at and at + int(v.reth.dlen) <= size, f"a READ request outside the READ: {summ([f])}")
        mk = c.send(*[c.read_resp(P.psn_add(v.psn, i), int(v.neth.msn), int(v.neth.offset) + mtu * i,
                                  int(v.neth.msg_len), src[at + mtu * i:at + min(mtu * (i + 1), int(v.reth.dlen))])
                      for i in range(span)])
        done += span
        if done < 96 and not pending:
            want = P.psn_add(p, done)
            nxt = c.expect(1, 1.0, after=mk, match=lambda g, want=want: is_new_rq(g) and fpsn(g) == want)
            need(nxt, f"no READ request for PSN {want:#08x} after the responses to {v.psn:#08x}")
            pending.append(nxt[0])
    wcs = c.poll(1, 2.0)
    t.check("MR-CC-020", ok_hold,
            f"new READ requests in the first 30 ms, nothing answered: {summ(held)} (spans {spans})",
            frames=held, expected=f"one message, or messages of at most {init} response PSNs in all")
    psns = [fpsn(f) for f in asked]
    ok = [w["status"] for w in wcs] == [WC_OK] and all(c.mem(o, min(1 << 15, size - o)) == src[o:o + (1 << 15)]
                                                        for o in range(0, size, 1 << 15))
    within = all(max(1, -(-int(nv(f).reth.dlen) // mtu)) <= 64 for f in asked)
    msns = [int(nv(f).neth.msn) for f in asked]
    t.check("MR-NAT-022", ok and within and len(set(msns)) == len(msns) and psns[0] == p,
            f"request messages {summ(asked)}; completion {wc_list(wcs)}", frames=asked,
            expected="consecutive messages of at most W = 64 PSNs, each its own MSN; the READ completes with its "
                     "96 KiB")
