"""Native profile: negotiation as the agent applies it, coalescing, RSN validation, malformed SACKs, READ limits,
RNR waits, timestamps and credits (04-native.md 4.2 to 4.6, 05-congestion.md 5.3 credits)."""
from __future__ import annotations

import time

from .. import native_packets as N
from .. import packets as P
from ..agentproto import AgentError
from ..context import CaseError
from ..registry import case
from ._common import ACK_WAIT, QUIET
from ._native import (CAP, WC_OK, check_wcs, connect_native, counted, fpsn, is_req, is_sack, need, nv, op, pattern,
                      post, sent_at, summ, wait_requests, wc_list, wr)
from .native_loss import tol
from .native_req import _first_tx, _sack_for


@case("TC-SACK-015-a", rules=["MR-SACK-015", "MR-SACK-017"], category="SACK", profile="native", timeout=30,
      timing=True)
def sack_coalescing_bound(t):
    """Eight in-order one-packet WRITEs without AckReq: a SACK covering the last comes within ack_coalesce_us
    (the IUT's, caps.defaults) plus the tester's tolerance; then no SACK while nothing arrives."""
    c = connect_native(t)
    d = t.caps.get("defaults", {})
    t_us = float(d.get("ack_coalesce_us") or 5)
    frames = [c.write_msg(pattern(16, i), 32 * i, ackreq_last=False)[0] for i in range(8)]
    last = P.psn_add(c.psn, -1)
    mark = c.send(*frames)
    ts = sent_at(c, mark)
    s = c.sack_for(last, mark)
    bound = t_us * 1e-6 + max(tol(t_us * 1e-6), 3e-3)     # the tester's allowance for a polling IUT on a busy host
    dt = (s.ts - ts) if s is not None else None
    # the eighth packet reaches the IUT at most a few us after the first: N = 8 or T both bound the SACK
    ok = s is not None and dt <= bound + 8 * 20e-6
    t.check("MR-SACK-015", ok, f"SACK for PSN {last:#08x}: " + (f"{1e3 * dt:.2f} ms after the first packet" if s else
            "none"), frames=[s] if s else [mark + 1],
            expected=f"within ack_coalesce_us {t_us:g} us + tolerance {1e3 * (bound - t_us * 1e-6):.2f} ms")
    after = c.sacks(s.num if s else mark, 0.4)
    after = [f for f in after if s is None or f.num > s.num]
    t.check("MR-SACK-017", not after, f"SACKs with nothing received: {summ(after) or 'none'}", frames=after,
            expected="no SACK without a request packet, a coalescing timer or a NAK")


@case("TC-OOO-026-a", rules=["MR-OOO-026", "MR-OOO-001"], category="OOO", profile="native", timeout=30)
def rsn_conflict_is_invalid(t):
    """Two incomplete SEND messages with the same RSN (different MSNs): the second is an invalid request -- a
    NAK-type SACK 0x61 for its PSN once it is the ePSN."""
    c = connect_native(t)
    c.post_recv(4096, 0, wr_id=1)
    c.post_recv(4096, 8192, wr_id=2)
    e = c.psn
    m0 = c.send_msg(pattern(1500, 1), rsn=0)          # PSN e, e + 1, RSN 0 -- sent only partly: incomplete
    m1 = c.send_msg(pattern(100, 2), rsn=0)           # PSN e + 2, RSN 0 again
    mark = c.send(m0[0], m1[0])
    res = c.quiet(0.3, after=mark)
    nk = [f for f in res if is_sack(f) and nv(f).sack_kind == "NAK"]
    mark2 = c.send(m0[1])                              # now e + 2 is the ePSN
    res2 = c.quiet(0.3, after=mark2)
    nk2 = [f for f in res2 if is_sack(f) and nv(f).sack_kind == "NAK"]
    v = nv(nk2[0]) if nk2 else None
    ok = not nk and v is not None and v.syndrome == 0x61 and v.psn == P.psn_add(e, 2)
    for r in ("MR-OOO-026", "MR-OOO-001"):
        t.check(r, ok, f"before the gap filled: {summ(nk) or 'no NAK'}; after: {summ(res2)}",
                frames=nk + nk2 + res2[:1],
                expected=f"one NAK-type SACK 0x61 psn {P.psn_add(e, 2):#08x}, only once it is the ePSN")


@case("TC-OOO-026-b", rules=["MR-OOO-026"], category="OOO", profile="native", timeout=30)
def rsn_change_within_a_message_is_invalid(t):
    """The second packet of a SEND carries another RSN than the first: invalid request (NAK-type SACK 0x61)."""
    c = connect_native(t)
    c.post_recv(4096, 0, wr_id=1)
    c.post_recv(4096, 8192, wr_id=2)
    e = c.psn
    data = pattern(1500, 3)
    f0 = c.send_msg(data, rsn=0, advance=False)
    f1 = c.send_msg(data, rsn=1, advance=False)
    mark = c.send(f0[0], f1[1])
    res = c.quiet(0.4, after=mark)
    nk = [f for f in res if is_sack(f) and nv(f).sack_kind == "NAK"]
    v = nv(nk[0]) if nk else None
    t.check("MR-OOO-026", v is not None and v.syndrome == 0x61 and v.psn == P.psn_add(e, 1),
            f"SEND packets with RSN 0 then 1: {summ(res)}", frames=nk or res or [mark + 1],
            expected=f"NAK-type SACK 0x61 psn {P.psn_add(e, 1):#08x}")


@case("TC-XH-027-a", rules=["MR-XH-027", "MR-SACK-005", "MR-NAT-009"], category="SACK", profile="native",
      timeout=30)
def malformed_sack_dropped(t):
    """SACKs with Bitmap Words 33, or a bitmap shorter or longer than Bitmap Words says, are dropped (counted in
    rx_drop_len) and complete nothing; a well-formed SACK then completes the WRITE."""
    from ._common import counter
    c = connect_native(t, timeout=18)
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_WRITE", 16, wr_id=1))
    fr = wait_requests(c, mark, {p})
    need(fr, "the WRITE was not sent")
    k = nv(fr[0])
    ts = int(k.neth.tsval)
    base = N.headers_of(N.NATIVE_SACK, aeth=(0x1F, 0), sack=N.sack_layer(tsecr=ts, echo_sport=k.sport))
    bad = [("Bitmap Words 33 with 33 words", base[:14] + bytes([33]) + base[15:] + bytes(4 * 33)),
           ("Bitmap Words 2 with one word", base[:14] + bytes([2]) + base[15:] + bytes(4)),
           ("Bitmap Words 0 with a word after", base + bytes(4))]
    c.sync()                            # the post_send's reply, before this case's own agent calls
    for what, hdr in bad:
        n0 = counter(t, "rx_drop_len")
        c.send(c.nframe(N.NATIVE_SACK, psn=p, headers=hdr, tos=0x68))
        wcs = c.poll(1, 0.15)
        n1 = counter(t, "rx_drop_len")
        grew = n0 is None or (n1 is not None and n1 > n0)
        ok = not wcs and grew
        for r in ("MR-XH-027", "MR-NAT-009") if "33" not in what else ("MR-XH-027", "MR-SACK-005"):
            t.check(r, ok, f"{what}: completions {wc_list(wcs)}, rx_drop_len "
                    + (f"+{n1 - n0}" if n0 is not None else "not reported"),
                    expected="dropped: nothing completes, rx_drop_len counts it")
    c.send(_sack_for(c, fr[0], p))
    wcs = c.poll(1, 2.0)
    t.check("MR-XH-027", [w["status"] for w in wcs] == [WC_OK], f"then a well-formed SACK: {wc_list(wcs)}",
            expected="the WRITE completes")


@case("TC-OOO-028-a", rules=["MR-OOO-028"], category="OOO", profile="native", timeout=30)
def reads_outstanding_bounded(t):
    """max_rd_atomic 2 and three READs: the third READ request leaves only once the first READ's responses have
    all arrived."""
    c = connect_native(t, timeout=18, max_rd_atomic=2)
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_READ", 100, wr_id=1, offset=0), wr(c, "RDMA_READ", 100, wr_id=2, offset=256),
                wr(c, "RDMA_READ", 100, wr_id=3, offset=512))
    fr = wait_requests(c, mark, {p, P.psn_add(p, 1)})
    first = _first_tx(fr)
    need(len(first) >= 2, f"READ requests: {summ(fr)}")
    early = [f for f in c.quiet(0.15, after=mark) if c.is_mine(f) and op(f) == N.NATIVE_READ_REQ
             and fpsn(f) == P.psn_add(p, 2)]
    mark2 = c.send(c.read_resp(p, 0, 0, 100, pattern(100, 1)))
    third = c.requests(mark2, 1, match=lambda f: fpsn(f) == P.psn_add(p, 2))
    t.check("MR-OOO-028", not early and bool(third), f"third READ before the first completed: {summ(early) or 'no'}; "
            f"after: {summ(third)}", frames=early + third, expected="two READs outstanding at most")
    c.send(c.read_resp(P.psn_add(p, 1), 1, 0, 100, pattern(100, 2)),
           c.read_resp(P.psn_add(p, 2), 2, 0, 100, pattern(100, 3)))
    c.poll(3, 1.0)


@case("TC-NAT-022-a", rules=["MR-NAT-022", "MR-NAT-016", "MR-SACK-026"], category="OOO", profile="native",
      timeout=30)
def long_read_split_by_window(t):
    """W 32, MTU 256: a READ of 10000 bytes (40 PSNs) is sent as READ requests of at most 32 PSNs over consecutive
    sub-ranges, each with its own MSN; the work request completes once all are answered."""
    c = connect_native(t, mtu=256, w=32, timeout=18)
    p = c.iut_psn
    n = 10000
    mark = post(c, wr(c, "RDMA_READ", n, wr_id=1, offset=0))
    src = pattern(n, 5)
    got = c.requests(mark, 1)
    need(got, "no READ request")
    reqs, answered = [], 0
    deadline = time.monotonic() + 3
    seen = set()
    while answered < n and time.monotonic() < deadline:
        news = [f for f in c.quiet(0.0, after=mark) if c.is_mine(f) and op(f) == N.NATIVE_READ_REQ
                and not nv(f).neth.retx and fpsn(f) not in seen]
        if not news:
            time.sleep(0.005)
            continue
        for f in news:
            v = nv(f)
            seen.add(v.psn)
            reqs.append(f)
            off = int(v.reth.va) - (0x7F00_0020_0000)
            ln = int(v.reth.dlen)
            k = max(1, -(-ln // 256))
            out = [c.read_resp(P.psn_add(v.psn, i), int(v.neth.msn), 256 * i, ln,
                               src[off + 256 * i:off + min(ln, 256 * (i + 1))]) for i in range(k)]
            c.send(*out)
            answered += ln
    wcs = c.poll(1, 2.0)
    vs = [nv(f) for f in reqs]
    spans = [max(1, -(-int(v.reth.dlen) // 256)) for v in vs]
    offs = [int(v.reth.va) - 0x7F00_0020_0000 for v in vs]
    contiguous = all(offs[i + 1] == offs[i] + int(vs[i].reth.dlen) for i in range(len(vs) - 1)) and offs[:1] == [0]
    msns = [int(v.neth.msn) for v in vs]
    ok = (len(vs) >= 2 and all(s <= 32 for s in spans) and contiguous and sum(int(v.reth.dlen) for v in vs) == n
          and msns == list(range(len(vs))))
    t.check("MR-NAT-022", ok, f"READ requests: {summ(reqs)}", frames=reqs,
            expected="at least two READ requests of at most 32 PSNs, consecutive sub-ranges, MSNs 0, 1, ...")
    psn_ok = all(vs[i + 1].psn == P.psn_add(vs[i].psn, spans[i]) for i in range(len(vs) - 1))
    t.check("MR-NAT-016", psn_ok, f"request PSNs {[hex(v.psn) for v in vs]}, spans {spans}", frames=reqs,
            expected="each request at the PSN after the previous one's responses")
    check_wcs(t, "MR-SACK-026", wcs, [(1, WC_OK)], "one completion for the work request")
    t.check("MR-SACK-026", c.mem(0, n) == src, "the 10000 bytes placed", expected="the READ's data")


@case("TC-SACK-041-a", rules=["MR-SACK-041", "MR-SACK-040", "MR-SACK-039"], category="RNR", profile="native",
      timeout=30, timing=True)
def rnr_nak_during_wait(t):
    """A second RNR NAK-type SACK 15 ms into an RNR wait of 40.96 ms neither extends nor restarts it, and no RTO
    or probe is sent during the wait (the SEND leaves again about 40.96 ms after the first NAK)."""
    c = connect_native(t, timeout=18)
    p = c.iut_psn
    before = c.native_counters()
    mark = post(c, wr(c, "SEND", 16, wr_id=1))
    fr = wait_requests(c, mark, {p})
    need(fr, "the SEND was not sent")
    mark_n = c.send(_sack_for(c, fr[0], p, syndrome=0x20 | 24))
    t_nak = sent_at(c, mark_n)
    time.sleep(0.015)
    c.send(_sack_for(c, fr[0], p, syndrome=0x20 | 24))
    rx = c.t.lt.collect(lambda f: c.is_mine(f) and op(f) == N.NATIVE_SEND and f.ts > t_nak, 0.2, after=mark,
                        until=lambda fs: bool(fs))
    wait = 40.96e-3
    dt = (rx[0].ts - t_nak) if rx else None
    ok = rx and abs(dt - wait) <= tol(wait) + 2e-3
    t.check("MR-SACK-041", bool(ok), f"the SEND resent {1e3 * dt:.1f} ms after the first NAK" if rx else "not resent",
            frames=rx, expected=f"about {1e3 * wait:.2f} ms after the first NAK (not 15 + 40.96 ms)")
    t.check("MR-SACK-040", bool(rx) and dt >= wait - tol(wait), "no RTO retransmission during the wait "
            f"(the RTO before any RTT sample is a few ms)", frames=rx,
            expected="nothing sent during the RNR wait")
    t.check("MR-SACK-039", bool(rx) and dt >= wait - tol(wait), "nothing at or after the NAK'd PSN during the wait",
            frames=rx)
    grew, text = counted(t, c, "rnr_nak_during_wait", before)
    t.check("MR-SACK-041", grew, f"the second NAK counted: {text}", expected="counted")
    c.send(_sack_for(c, rx[0] if rx else fr[0], p))
    c.poll(1, 1.0)


@case("TC-NAT-001-a", rules=["MR-NAT-001", "MR-NAT-002"], category="WIRE", profile="native", timeout=30)
def compat_qp_sends_no_native_opcode(t):
    """A QP brought up without the native profile (no NATIVE agreed) runs compat: a native request to it is
    dropped like any unknown opcode, and its own WRITE is RDMA_WRITE_ONLY."""
    c = t.connect()
    nh = N.neth(0, 0, 8, 1, payload_len=8)
    f = N.build("NATIVE_WRITE", src_mac=t.lt_mac, dst_mac=t.iut_mac, src_ip=t.lt_ip, dst_ip=t.iut_ip, dqpn=c.qpn,
                psn=c.psn, sport=c.sport, ackreq=True, reth=(c.va, c.rkey, 8), neth_=nh, payload=b"nativeop")
    mark2 = c.send(f)
    seen = c.quiet(QUIET, after=mark2)
    psn = c.psn
    m2 = c.send(c.write(b"GOOD", offset=64))
    ack = c.expect(1, ACK_WAIT, after=m2, match=lambda f: f.roce.op == 0x11 and f.roce.psn == psn)
    ok = not seen and bool(ack) and c.mem(0, 8) != b"nativeop"
    t.check("MR-NAT-002", ok, f"a NATIVE_WRITE to the compat QP: responses "
            f"{', '.join(x.summary() for x in seen) or 'none'}; a valid compat WRITE after it ACKed: {bool(ack)}",
            frames=seen + ack or [mark2 + 1], expected="dropped silently; the QP runs compat")
    mark = t.lt.last_num()
    t.agent.call("post_send", qp=c.qp, wrs=[{"wr_id": "0x1", "opcode": "RDMA_WRITE", "flags": ["SIGNALED"],
                                            "sg_list": [{"mr": c.mr, "offset": 0, "len": 16}],
                                            "remote": {"va": hex(0x7F00_0010_0000), "rkey": 77}}])
    got = c.expect(1, ACK_WAIT, after=mark, match=lambda f: f.roce.op < 0x20)
    ops = [f.roce.op for f in got]
    t.check("MR-NAT-001", ops == [0x0A], f"the compat QP's WRITE: {', '.join(f.summary() for f in got)}",
            frames=got, expected="RDMA_WRITE_ONLY (0x0a), no opcode 0xC0-0xC6")
    if got:
        c.send(c.frame("ACKNOWLEDGE", psn=got[0].roce.psn, aeth=(0x1F, 1)))
        c.poll(1, 1.0)


@case("TC-NAT-003-a", rules=["MR-NAT-003"], category="QPS", profile="native", timeout=30)
def profile_fixed_until_reset(t):
    """The native QP in RTS refuses a profile change (modify_qp to RTS/SQD with profile compat fails, the QP stays
    native and keeps answering with NATIVE_SACK)."""
    c = connect_native(t)
    code = None
    try:
        t.agent.call("modify_qp", qp=c.qp, state="RTS", attrs={"profile": "compat"})
    except AgentError as e:
        code = e.code
    q = c.query()
    mark = c.send(*c.write_msg(b"still native", 0))
    s = c.sack_for(P.psn_add(c.psn, -1), mark)
    t.check("MR-NAT-003", code is not None and q.get("profile") == "native" and s is not None,
            f"modify_qp RTS profile compat: {code or 'accepted'}; profile {q.get('profile')}; "
            f"a WRITE afterwards: {summ([s]) if s else 'no SACK'}", frames=[s] if s else [],
            expected="refused; the QP stays native")


@case("TC-XH-024-a", rules=["MR-XH-024", "MR-NAT-014", "MR-SACK-024"], category="WIRE", profile="native",
      timeout=30)
def tsval_at_each_transmission(t):
    """Unanswered, a WRITE is retransmitted on RTO: each copy carries the TSval of its own transmission (the
    TSval difference matches the capture time difference) and otherwise the original's fields."""
    c = connect_native(t, timeout=18)
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_WRITE", 64, wr_id=1))
    txs = c.t.lt.collect(lambda f: c.is_mine(f) and fpsn(f) == p, 0.2, after=mark, until=lambda fs: len(fs) >= 4)
    need(len(txs) >= 3, f"transmissions: {summ(txs)}")
    txs = txs[1:]                       # between retransmissions (a first transmission may leave an idle IUT late)
    bad = []
    for a, b in zip(txs, txs[1:]):
        dts = ((int(nv(b).neth.tsval) - int(nv(a).neth.tsval)) & 0xFFFFFFFF) * 1e-6
        dt = b.ts - a.ts
        if abs(dts - dt) > 0.1 * dt + 1e-3:
            bad.append(f"#{a.num}->#{b.num}: TSval +{1e3 * dts:.2f} ms, capture +{1e3 * dt:.2f} ms")
    for r in ("MR-XH-024", "MR-NAT-014"):
        t.check(r, not bad, "; ".join(bad) or f"{len(txs)} retransmissions, TSvals follow the capture times",
                frames=txs, expected="TSval = the sender's us clock at each transmission (10 % + 1 ms)")
    a0 = nv(txs[0])
    same = all((bytes(nv(f).reth), int(nv(f).neth.msn), int(nv(f).neth.offset), int(nv(f).neth.msg_len), nv(f).payload)
               == (bytes(a0.reth), int(a0.neth.msn), int(a0.neth.offset), int(a0.neth.msg_len), a0.payload)
               for f in txs)
    t.check("MR-SACK-024", same, summ(txs[:2]), frames=txs, expected="RETH, NETH (but TSval), payload unchanged")
    c.send(_sack_for(c, txs[-1], p))
    c.poll(1, 1.0)


@case("TC-OOO-013-a", rules=["MR-OOO-013", "MR-OOO-014", "MR-OOO-011"], category="OOO", profile="native",
      timeout=30)
def receive_completions_in_wqe_order(t):
    """WRITE_IMM (RSN 0), SEND (RSN 1) and SEND_IMM (RSN 2) arriving last to first: no completion until the
    cumulative PSN covers each; then three completions in receive WQE order with their immediates."""
    c = connect_native(t)
    for i in range(3):
        c.post_recv(1024, 4096 * (i + 1), wr_id=0xE0 + i)
    a = c.write_msg(pattern(64, 1), 0, imm=0x11111111)
    b = c.send_msg(pattern(64, 2))
    d = c.send_msg(pattern(64, 3), imm=0x33333333)
    mark = c.send(d[0], b[0])
    c.first_sack(mark)
    early = c.poll(3, 0.25)
    mark2 = c.send(a[0])
    c.sack_for(P.psn_add(c.psn, -1), mark2)
    wcs = c.poll(3, 2.0)
    t.check("MR-OOO-014", not early, f"before the first PSN arrived: {wc_list(early)}", expected="no completion",
            observed=[wc_list(early)])
    check_wcs(t, "MR-OOO-013", wcs, [(0xE0, WC_OK), (0xE1, WC_OK), (0xE2, WC_OK)], "receive completions")
    imms = [w.get("imm") for w in wcs]
    t.check("MR-OOO-011", imms == [0x11111111, None, 0x33333333] and c.mem(8192, 64) == pattern(64, 2)
            and c.mem(12288, 64) == pattern(64, 3), f"immediates {imms}", expected="0x11111111, none, 0x33333333",
            observed=[str(imms)])


_CREDITS = CAP["NATIVE"] | CAP["SACK"] | CAP["OOO_PLACEMENT"] | CAP["CREDITS"]


@case("TC-CC-014-a", rules=["MR-CC-014"], category="CC", caps=("CREDITS",), profile="native", timeout=30)
def credits_bound_new_psns(t):
    """CREDITS agreed: after a SACK with cumulative PSN q and credit 2 the IUT sends no new PSN after q + 2; each
    later SACK moves the edge, and the IUT sends up to it."""
    c = connect_native(t, timeout=18, caps=_CREDITS, w=64)
    p = c.iut_psn
    n = 40
    mark = post(c, wr(c, "RDMA_WRITE", n * 1024, wr_id=1))
    time.sleep(0.05)
    sent = {}
    for f in c.quiet(0.0, after=mark):
        if c.is_mine(f) and op(f) == N.NATIVE_WRITE:
            sent.setdefault(fpsn(f), f)
    need(sent, "nothing sent")
    hi = max(((q - p) & 0xFFFFFF) for q in sent)
    bad, steps = [], []
    cum = hi
    while cum < n - 1:
        trig = sent.get(P.psn_add(p, cum)) or next(iter(sent.values()))
        mk = c.send(_sack_for(c, trig, P.psn_add(p, cum), credit=2))
        ts = sent_at(c, mk)
        edge = cum + 2
        got = c.t.lt.collect(lambda f: c.is_mine(f) and op(f) == N.NATIVE_WRITE and f.ts > ts, 0.15, after=mk,
                             until=lambda fs: any(((fpsn(f) - p) & 0xFFFFFF) >= min(edge, n - 1) for f in fs))
        new = [f for f in got if fpsn(f) not in sent]
        for f in new:
            sent[fpsn(f)] = f
        rel = sorted(((fpsn(f) - p) & 0xFFFFFF) for f in new)
        steps.append(f"cum +{cum} credit 2: new +{rel}")
        over = [r for r in rel if r > edge]
        if over:
            bad.append(f"after cum +{cum} credit 2 the IUT sent +{over}")
        if not rel:
            bad.append(f"after cum +{cum} credit 2 nothing new (edge +{edge})")
            break
        cum = max(rel)
    c.send(_sack_for(c, sent[max(sent, key=lambda q: (q - p) & 0xFFFFFF)], P.psn_add(p, n - 1), credit=64))
    wcs = c.poll(1, 2.0)
    t.check("MR-CC-014", not bad and [w["status"] for w in wcs] == [WC_OK],
            "; ".join(bad) or "; ".join(steps[:6]) + f"; completion {wc_list(wcs)}",
            frames=list(sent.values())[-4:], expected="new PSNs up to cum + credit only, then the edge moves")


@case("TC-CC-015-a", rules=["MR-CC-015", "MR-SACK-008", "MR-XH-031"], category="CC", caps=("CREDITS",),
      profile="native", timeout=30)
def credit_advertised(t):
    """CREDITS agreed: every ACK-type SACK of the IUT's responder advertises a credit from 1 to W (never 0xFFFF)."""
    w = 64
    c = connect_native(t, caps=_CREDITS, w=w)
    mark = c.send(*[c.write_msg(pattern(32, i), 64 * i)[0] for i in range(6)])
    sk = [f for f in c.sacks(mark, 0.3) if nv(f).sack_kind == "ACK"]
    need(sk, "no SACK")
    creds = [int(nv(f).sack.credit) for f in sk]
    ok = all(1 <= x <= w for x in creds)
    for r in ("MR-CC-015", "MR-SACK-008", "MR-XH-031"):
        t.check(r, ok, f"credits {creds}", frames=sk, expected=f"1 to W = {w} in every ACK-type SACK")


@case("TC-CC-025-a", rules=["MR-CC-025", "MR-ECN-010", "MR-CC-026"], category="CC", profile="native", timeout=30)
def ce_counted_on_every_request(t):
    """CE-marked request packets are counted in ce_count even when they are duplicates or outside the window;
    the native receiver sends no CNP for any of them."""
    w = 64
    c = connect_native(t, w=w)
    e = c.psn
    mark = c.send(*c.write_msg(b"a" * 8, 0, tos=TOS_CE_))
    s1 = c.sack_for(e, mark)
    need(s1 is not None, "no SACK for the first WRITE")
    n1 = int(nv(s1).sack.ce_count)
    dup = c.write_msg(b"d" * 8, 0, psn=e, msn=0, tos=TOS_CE_, advance=False, retx=True)
    far = c.write_msg(b"f" * 8, 1024, psn=P.psn_add(e, 1 + w), msn=5, tos=TOS_CE_, advance=False)
    c.send(*dup, *far)
    time.sleep(0.05)
    mark2 = c.send(*c.write_msg(b"b" * 8, 64))
    s2 = c.sack_for(P.psn_add(e, 1), mark2)
    n2 = int(nv(s2).sack.ce_count) if s2 else None
    t.check("MR-CC-025", s2 is not None and n2 == n1 + 2 and not nv(s2).sack.ce,
            f"ce_count {n1} after the first WRITE, {n2} after a CE duplicate, a CE packet outside the window and an "
            f"unmarked WRITE", frames=[s1] + ([s2] if s2 else []), expected=f"ce_count {n1 + 2}, C 0")
    t.check("MR-ECN-010", nv(s1).sack.ce == 1 and n1 == 1, f"first SACK: C {int(nv(s1).sack.ce)}, ce_count {n1}",
            frames=[s1], expected="C 1, ce_count 1")
    cnps = [f for f in c.quiet(0.0) if not f.outgoing and op(f) == 0x81]
    for r in ("MR-ECN-010", "MR-CC-026"):
        t.check(r, not cnps, f"CNPs from the IUT: {summ(cnps) or 'none'}", frames=cnps, expected="no CNP")


TOS_CE_ = 0x6B


@case("TC-CC-002-a", rules=["MR-CC-002"], category="CC", profile="native", timeout=30)
def window_bounds_new_psns(t):
    """W 32: with PSN p never acknowledged (the LT sacks everything after it), the IUT sends no new PSN at or
    beyond p + 32; once p is acknowledged it goes on."""
    c = connect_native(t, w=32, mtu=256, timeout=18)
    p = c.iut_psn
    n = 80
    mark = post(c, wr(c, "RDMA_WRITE", n * 256, wr_id=1))
    sent: dict = {}
    deadline = time.monotonic() + 0.6
    last_sack = 0.0
    while time.monotonic() < deadline:
        fs = [f for f in c.quiet(0.01, after=mark) if c.is_mine(f) and op(f) == N.NATIVE_WRITE]
        newest = None
        for f in fs:
            q = (fpsn(f) - p) & 0xFFFFFF
            if q not in sent:
                sent[q] = f
                newest = f
        got = {q for q in sent if q != 0}
        if newest is not None and time.monotonic() - last_sack > 0.005:
            c.send(_sack_for(c, newest, P.psn_add(p, -1), received={P.psn_add(p, q) for q in got}))
            last_sack = time.monotonic()
    over = sorted(q for q in sent if q >= 32)
    t.check("MR-CC-002", not over and max(sent, default=0) >= 16,
            f"new PSNs while PSN p is missing: +0..+{max(sent, default=-1)}" + (f", beyond the window: +{over}" if over
                                                                                else ""),
            frames=[sent[q] for q in over] or list(sent.values())[-2:], expected="none at or beyond p + 32")
    trig = sent[max(sent)]
    mk = c.send(_sack_for(c, trig, P.psn_add(p, max(sent))))
    more = c.requests(mk, 1, timeout=1.0, match=lambda f: ((fpsn(f) - p) & 0xFFFFFF) > max(sent))
    t.check("MR-CC-002", bool(more), f"after p was acknowledged: {summ(more)}", frames=more,
            expected="new PSNs again")
    # let the WRITE finish: acknowledge what comes
    end = time.monotonic() + 2
    while time.monotonic() < end:
        fs = [f for f in c.quiet(0.02, after=mk) if c.is_mine(f) and op(f) == N.NATIVE_WRITE]
        if fs:
            top = max(((fpsn(f) - p) & 0xFFFFFF) for f in fs)
            c.send(_sack_for(c, fs[-1], P.psn_add(p, top)))
            if top == n - 1:
                break
    c.poll(1, 1.0)


@case("TC-NAT-026-a", rules=["MR-NAT-026", "MR-NAT-012", "MR-NAT-025"], category="QPS", profile="native",
      timeout=30)
def sqd_keeps_native_state(t):
    """RTS -> SQD -> RTS between two SENDs: the second takes the next PSN, MSN 1 and RSN 1 (nothing restarts)."""
    c = connect_native(t, timeout=18)
    p = c.iut_psn
    mark = post(c, wr(c, "SEND", 8, wr_id=1))
    fr = wait_requests(c, mark, {p})
    need(fr, "the first SEND was not sent")
    c.send(_sack_for(c, fr[0], p))
    need(c.poll(1, 2.0), "the first SEND did not complete")
    try:
        t.agent.call("modify_qp", qp=c.qp, state="SQD", attrs={})
        t.agent.call("modify_qp", qp=c.qp, state="RTS", attrs={})
    except AgentError as e:
        if e.code == "ENOTSUP":
            raise
        raise CaseError(f"RTS -> SQD -> RTS refused: {e}") from None
    mark2 = post(c, wr(c, "SEND", 8, wr_id=2))
    fr2 = c.requests(mark2, 1, timeout=2.0)
    v = nv(fr2[0]) if fr2 else None
    ok = (v is not None and v.psn == P.psn_add(p, 1) and int(v.neth.msn) == 1 and v.rsneth is not None
          and int(v.rsneth.rsn) == 1)
    exp = f"NATIVE_SEND psn {P.psn_add(p, 1):#08x} MSN 1 RSN 1"
    for r in ("MR-NAT-026", "MR-NAT-012", "MR-NAT-025"):
        t.check(r, ok, f"after SQD and back: {summ(fr2)}", frames=fr2 or [mark2 + 1], expected=exp)
    if fr2:
        c.send(_sack_for(c, fr2[0], P.psn_add(p, 1)))
    c.poll(1, 1.0)


@case("TC-LOSS-004-a", rules=["MR-LOSS-004", "MR-LOSS-006"], category="RTO", profile="native", timeout=30,
      timing=True)
def rto_before_the_first_sample(t):
    """A QP that has no RTT sample yet retransmits an unanswered WRITE after rto_initial (4 ms, 04 4.7 -- or the
    IUT's caps.defaults.rto_initial_us), with AckReq."""
    from .native_loss import tol
    c = connect_native(t, timeout=18)
    p = c.iut_psn
    rto0 = float(t.caps.get("defaults", {}).get("rto_initial_us") or 4000) * 1e-6
    mark = post(c, wr(c, "RDMA_WRITE", 16, wr_id=1))
    txs = c.t.lt.collect(lambda f: c.is_mine(f) and fpsn(f) == p, 0.5, after=mark, until=lambda fs: len(fs) >= 2)
    need(len(txs) >= 2, f"no retransmission: {summ(txs)}")
    dt = txs[1].ts - txs[0].ts
    dts = ((int(nv(txs[1]).neth.tsval) - int(nv(txs[0]).neth.tsval)) & 0xFFFFFFFF) * 1e-6
    ok = abs(dt - rto0) <= tol(rto0) and nv(txs[1]).ackreq
    t.check("MR-LOSS-004", ok, f"retransmitted {1e3 * dt:.2f} ms after the first transmission (TSvals "
            f"{1e3 * dts:.2f} ms apart)", frames=txs[:2],
            expected=f"{1e3 * rto0:.2f} ms (tolerance {1e3 * tol(rto0):.2f} ms), AckReq")
    mk = c.send(_sack_for(c, txs[-1], p))
    ts = sent_at(c, mk)
    wcs = c.poll(1, 1.0)
    after = [f for f in c.quiet(0.15, after=mk) if c.is_mine(f) and is_req(f) and f.ts > ts + 0.0005]
    t.check("MR-LOSS-006", len(txs) >= 2 and not after and [w["status"] for w in wcs] == [WC_OK],
            f"timer ran while outstanding (retransmission {1e3 * dt:.2f} ms after the first); after the SACK "
            f"acknowledged it: {summ(after) or 'nothing sent for 150 ms'}", frames=txs[:2] + after,
            expected="a retransmission while outstanding; none once nothing is outstanding (timer stopped)")


@case("TC-LOSS-014-a", rules=["MR-LOSS-014"], category="RTO", profile="native", timeout=30)
def native_counters_count(t):
    """The per-QP counters of MR-LOSS-014 exist and count: SACKs sent, duplicates and out-of-window packets at the
    responder; SACKs received and RTO retransmissions at the requester."""
    c = connect_native(t, timeout=18)
    c0 = c.native_counters()
    names = ("sack_sent", "sack_received", "rx_duplicates", "rx_out_of_window", "retx_rto", "retx_sack", "retx_tlp",
             "retx_rnr", "read_rerequests", "atomic_replays", "spurious_retx", "rx_not_ready", "rnr_nak_during_wait",
             "rnr_nak_discarded")
    if not c0:
        from ..context import NotApplicable
        raise NotApplicable("the agent reports no per-QP counters")
    missing = [n for n in names if n not in c0]
    e = c.psn
    c.send(*c.write_msg(b"x" * 8, 0))
    c.send(*c.write_msg(b"x" * 8, 0, psn=e, msn=0, advance=False, retx=True))
    c.send(*c.write_msg(b"y" * 8, 64, psn=P.psn_add(e, c.w + 5), msn=9, advance=False))
    p = c.iut_psn
    mark = post(c, wr(c, "RDMA_WRITE", 16, wr_id=1))
    txs = c.t.lt.collect(lambda f: c.is_mine(f) and fpsn(f) == p, 0.5, after=mark, until=lambda fs: len(fs) >= 2)
    if txs:
        c.send(_sack_for(c, txs[-1], p))
    c.poll(1, 1.0)
    c1 = c.native_counters() or {}
    d = {n: int(c1.get(n, 0)) - int(c0.get(n, 0)) for n in names if n in c0}
    ok = not missing and all(d.get(n, 0) >= 1 for n in ("sack_sent", "sack_received", "rx_duplicates",
                                                         "rx_out_of_window", "retx_rto"))
    t.check("MR-LOSS-014", ok, f"missing: {missing or 'none'}; moved: " +
            ", ".join(f"{k} +{v}" for k, v in d.items() if v), expected="every counter of MR-LOSS-014 reported; "
            "sack_sent, sack_received, rx_duplicates, rx_out_of_window, retx_rto each +1 or more",
            observed=[str(d)])
