"""Security considerations (10-security.md) seen on the wire: memory checks on every keyed packet
(MR-SEC-004), which requests may cost a connection (MR-SEC-005), counting and not punishing remote
access errors (MR-SEC-006, MR-SEC-007, MR-SEC-033), replies only to the address vector (MR-SEC-010),
bounded responder state (MR-SEC-015), the passive connection set-up (MR-SEC-017, MR-SEC-018,
MR-SEC-019), random starting PSNs (MR-SEC-020), forged and stale
acknowledgements (MR-SEC-021, MR-SEC-023, MR-SEC-026, MR-SEC-032) and named drop counters (MR-SEC-031).

A forged source address is one the LT sends from without owning it: every frame still goes only to
the IUT on the test link.
"""
from __future__ import annotations

import ipaddress
import secrets
import time

from ..agentproto import AgentError
from .. import packets as P
from ..context import CaseError, CannotDrive
from ..registry import case
from ._common import ACK_WAIT, QUIET, counter, describe, dropped_silently, expect_ack
from ._req import ack, connect_req, nak, post, requests, wc_list, write_wr
from ._resp import (ACKNOWLEDGE, READ_RESPONSES, atomic_req, check_nak, check_state, check_untouched, connect,
                    dereg_mr, first_response, prime, read_req, read_responses, reg_mr, req)

WRONG_TAG = 0x5B


def _bad_key(rkey: int) -> int:
    return (rkey & ~0xFF) | ((rkey + WRONG_TAG) & 0xFF)


def _other_ip(t) -> str:
    """An address of the test subnet that is neither the LT's nor the IUT's (a forged source)."""
    a = ipaddress.ip_address(t.lt_ip)
    for k in (50, 51, 52):
        cand = str(a + k) if a.version == 4 and int(str(a).split(".")[-1]) + k < 255 else str(a + k)
        if cand != t.iut_ip:
            return cand
    return str(a + 1)


def _qp_counter(c, name: str) -> int | None:
    try:
        v = c.counters().get(name)
    except AgentError:
        return None
    return None if v is None else int(v)


# ---- memory checks on every packet that carries an R_Key (MR-SEC-004) -------------------------------
@case("TC-SEC-004-a", rules=["MR-SEC-004"], category="SEC", timeout=15)
def every_keyed_packet_checked(t):
    """Every packet with an R_Key is checked: a 3-packet WRITE whose FIRST has a wrong key is NAKed (code 2) at
    the FIRST and nothing of it placed; a duplicate READ re-request after its MR was deregistered is NAKed
    (code 2) with no data; an ATOMIC with a wrong key (ATOMICS claimed) is NAKed (code 2)."""
    c = connect(t, mtu=256)
    prime(t, c)
    data = bytes(range(256)) * 3
    p = c.psn
    mark = c.send(req(c, "RDMA_WRITE_FIRST", reth=(c.va + 4096, _bad_key(c.rkey), 700), payload=data[:256],
                      ackreq=False),
                  req(c, "RDMA_WRITE_MIDDLE", payload=data[256:512], ackreq=False),
                  req(c, "RDMA_WRITE_LAST", payload=data[512:700]))
    check_nak(t, c, ["MR-SEC-004"], mark, 2, p, 1, "WRITE FIRST with a wrong R_Key")
    check_untouched(t, c, ["MR-SEC-004"], 4096, 700, "the 3-packet WRITE with a wrong key")
    c = connect(t)
    h, mr = reg_mr(t, c.pd, 4096)
    p = c.psn
    mark = c.send(read_req(c, int(mr["va"], 16), 64, rkey=mr["rkey"]))
    if not read_responses(c, mark, 1):
        t.undecided("MR-SEC-004", "the original READ was not answered")
        return
    dereg_mr(t, h)
    mark = c.send(read_req(c, int(mr["va"], 16), 64, rkey=mr["rkey"], psn=p))
    check_nak(t, c, ["MR-SEC-004"], mark, 2, p, 1, "duplicate READ after its MR was deregistered")
    got = [f for f in c.quiet(0.1, after=mark) if f.roce.op in READ_RESPONSES]
    t.check("MR-SEC-004", not got, f"READ RESPONSEs to the duplicate: {describe(got)}", frames=got or [mark + 1],
            expected="none")
    if "ATOMICS" in t.claim.caps:
        c = connect(t)
        prime(t, c)
        p = c.psn
        mark = c.send(atomic_req(c, "FETCH_ADD", c.va + 64, 1, rkey=_bad_key(c.rkey)))
        check_nak(t, c, ["MR-SEC-004"], mark, 2, p, 1, "FETCH_ADD with a wrong R_Key")
        check_untouched(t, c, ["MR-SEC-004"], 64, 8, "FETCH_ADD with a wrong key")


# ---- only a request at epsn may cost the connection (MR-SEC-005, MR-SEC-032) --------------------------
@case("TC-SEC-005-a", rules=["MR-SEC-005", "MR-SEC-032"], category="SEC", timeout=15)
def bad_key_outside_the_psn_check_ignored(t):
    """Wrong-key WRITEs that fail an earlier check are discarded without a key check: at a future PSN (at most
    the sequence-error NAK), with a bad ICRC at epsn (nothing), as a duplicate (an ACK, nothing placed). No NAK
    code 1, 2 or 3, rx_rkey_violation unchanged, the QP stays in RTS and a valid WRITE at epsn is ACKed."""
    c = connect(t)
    prime(t, c)
    e = c.psn
    v0 = _qp_counter(c, "rx_rkey_violation")
    bad = _bad_key(c.rkey)

    def w(psn, **kw):
        return c.frame("RDMA_WRITE_ONLY", psn=psn, ackreq=True, reth=(c.va + 1024, bad, 16), payload=b"NOPE" * 4, **kw)
    frames = [(w(P.psn_add(e, 3)), "future PSN"), (w(e, bad_icrc=True), "bad ICRC at epsn"),
              (w(P.psn_add(e, -1)), "duplicate PSN")]
    seen = []
    for f, what in frames:
        mark = c.send(f)
        got = c.quiet(QUIET, after=mark)
        seen += got
        fatal = [x for x in got if x.roce.op == ACKNOWLEDGE and x.roce.ack_kind == "NAK" and x.roce.nak_code in (1, 2, 3)]
        t.check("MR-SEC-005", not fatal, f"{what}: {describe(got)}", frames=got or [mark + 1],
                expected="no NAK code 1, 2 or 3 (a sequence-error NAK or a duplicate's ACK at most)")
        if what == "future PSN":
            ok = all(x.roce.op == ACKNOWLEDGE and x.roce.ack_kind == "NAK" and x.roce.nak_code == 0 for x in got)
            t.check("MR-SEC-032", ok and len(got) <= 1, f"{what}: {describe(got)}", frames=got or [mark + 1],
                    expected=f"at most one NAK(0x60) psn={P.psn_add(e, -1):#08x}")
        elif what == "bad ICRC at epsn":
            t.check("MR-SEC-032", not got, f"{what}: {describe(got)}", frames=got or [mark + 1], expected="nothing")
    v1 = _qp_counter(c, "rx_rkey_violation")
    if v0 is not None and v1 is not None:
        t.check("MR-SEC-005", v1 == v0, f"rx_rkey_violation {v0} -> {v1}", expected="unchanged",
                observed=[f"rx_rkey_violation {v1}"])
    check_untouched(t, c, ["MR-SEC-005", "MR-SEC-032"], 1024, 16, "the discarded WRITEs")
    check_state(t, c, ["MR-SEC-005", "MR-SEC-032"], "RTS", "after the discarded WRITEs")
    mark = c.send(c.write(b"GOOD", offset=2048))
    a = expect_ack(c, e, mark)
    for r in ("MR-SEC-005", "MR-SEC-032"):
        t.check(r, a is not None and c.mem(2048, 4) == b"GOOD", f"valid WRITE at epsn {e:#08x}: "
                f"{describe([a] if a else [])}", frames=[a] if a else [mark + 1],
                expected=f"ACKNOWLEDGE ACK psn={e:#08x}, data placed")


# ---- counted per QP and per source, never punished (MR-SEC-006, MR-SEC-007, MR-SEC-033) ---------------
@case("TC-SEC-006-a", rules=["MR-SEC-006"], category="SEC", timeout=15)
def remote_access_errors_counted(t):
    """Two QPs each get a WRITE with a wrong R_Key: each QP's rx_rkey_violation counts 1, and the count of the
    LT's source address (get_counters with src) grows by 2."""
    try:
        s0 = t.agent.call("get_counters", src=t.lt_ip)["counters"].get("rx_rkey_violation")
    except AgentError:
        s0 = None
    conns = [connect(t), connect(t)]
    for c in conns:
        p = c.psn
        mark = c.send(req(c, "RDMA_WRITE_ONLY", reth=(c.va, _bad_key(c.rkey), 8), payload=b"x" * 8))
        check_nak(t, c, ["MR-SEC-006"], mark, 2, p, 0, "WRITE with a wrong R_Key")
    per_qp = [_qp_counter(c, "rx_rkey_violation") for c in conns]
    if None in per_qp:
        t.cannot_drive("MR-SEC-006", "the agent reports no per-QP rx_rkey_violation")
    else:
        t.check("MR-SEC-006", per_qp == [1, 1], f"rx_rkey_violation per QP {per_qp}", expected="[1, 1]",
                observed=[str(per_qp)])
    try:
        s1 = t.agent.call("get_counters", src=t.lt_ip)["counters"].get("rx_rkey_violation")
    except AgentError:
        s1 = None
    if s0 is None or s1 is None:
        t.cannot_drive("MR-SEC-006", "the agent reports no per-source count (get_counters src)")
    else:
        t.check("MR-SEC-006", s1 - s0 == 2, f"rx_rkey_violation of source {t.lt_ip}: {s0} -> {s1}",
                expected="+2", observed=[f"{s0} -> {s1}"])


@case("TC-SEC-007-a", rules=["MR-SEC-007", "MR-SEC-033"], category="SEC", timeout=40)
def remote_access_errors_do_not_penalise_the_address(t):
    """17 remote access errors from one address within a second (more than sec_rae_limit 16), each on its own
    QP: a QP of the same peer address created before them stays in RTS and a WRITE to it is ACKed and placed;
    a QP created after them works as well."""
    survivor = connect(t, mr_len=4096)
    victims = [connect(t, mr_len=4096) for _ in range(17)]
    frames = [req(c, "RDMA_WRITE_ONLY", reth=(c.va, _bad_key(c.rkey), 8), payload=b"x" * 8) for c in victims]
    start = time.monotonic()
    mark = t.lt.last_num()
    t.lt.send(*frames)
    spent = time.monotonic() - start
    naks = t.lt.collect(lambda f: f.roce is not None and not f.outgoing and f.roce.op == ACKNOWLEDGE
                        and f.roce.ack_kind == "NAK" and f.roce.nak_code == 2, 3.0, after=mark,
                        until=lambda fs: len(fs) >= 17)
    if len(naks) < 17 or spent > 1.0:
        t.undecided("MR-SEC-007", f"{len(naks)} of 17 NAKs code 2 in {spent:.2f} s: the premise is not established")
        t.undecided("MR-SEC-033", "premise not established")
        return
    check_state(t, survivor, ["MR-SEC-033"], "RTS", "the other QP of the same peer after 17 remote access errors")
    for c, what in ((survivor, "QP created before the errors"), (connect(t, mr_len=4096), "QP created after them")):
        p = c.psn
        sent = time.monotonic()
        mark = c.send(c.write(b"STILL OK", offset=128))
        a = expect_ack(c, p, mark)
        dt = time.monotonic() - sent
        ok = a is not None and c.mem(128, 8) == b"STILL OK"
        for r in ("MR-SEC-007", "MR-SEC-033"):
            t.check(r, ok, f"{what}: valid WRITE -> {describe([a] if a else [])} after {dt * 1000:.0f} ms, placed "
                    f"{c.mem(128, 8) == b'STILL OK'}", frames=[a] if a else [mark + 1],
                    expected=f"ACKNOWLEDGE ACK psn={p:#08x} within {ACK_WAIT:g} s, data placed")


# ---- replies go to the address vector (MR-SEC-010) ------------------------------------------------
@case("TC-SEC-010-a", rules=["MR-SEC-010"], category="SEC", timeout=12)
def replies_to_the_address_vector(t):
    """Requests with a forged source MAC and UDP source port are answered at the QP's address vector (the LT's
    MAC and IP); a READ from a forged source IP gets no reply at all, neither to it nor to anyone else."""
    c = connect(t)
    c.mem_write(0, bytes(range(64)))
    fake_mac = "02:de:ad:be:ef:01"
    mark = c.send(c.frame("RDMA_READ_REQUEST", ackreq=True, reth=(c.va, c.rkey, 64), src_mac=fake_mac, sport=0xD00D),
                  c.frame("RDMA_WRITE_ONLY", psn=P.psn_add(c.psn, 1), ackreq=True, reth=(c.va + 512, c.rkey, 8),
                          payload=b"AVAVAVAV", src_mac=fake_mac, sport=0xD00E))
    c.psn = P.psn_add(c.psn, 2)

    def from_iut(f):
        return f.roce is not None and not f.outgoing and f.roce.src_ip == t.iut_ip
    got = t.lt.collect(from_iut, ACK_WAIT, after=mark, until=lambda fs: len(fs) >= 2)
    got += t.lt.collect(from_iut, QUIET, after=got[-1].num if got else mark)
    wrong = [f for f in got if f.roce.dst_ip != t.lt_ip or f.roce.dst_mac.lower() != t.lt_mac.lower()]
    have = {f.roce.op for f in got}
    ok = not wrong and bool(have & set(READ_RESPONSES)) and ACKNOWLEDGE in have
    t.check("MR-SEC-010", ok, f"replies: {describe(got)}; to another address: {describe(wrong)}",
            frames=wrong or got or [mark + 1],
            expected=f"a READ RESPONSE and an ACK, all to {t.lt_mac} / {t.lt_ip}")
    other = _other_ip(t)
    mark = c.send(c.frame("RDMA_READ_REQUEST", ackreq=True, reth=(c.va, c.rkey, 64), src_ip=other))
    got = t.lt.collect(from_iut, QUIET, after=mark)
    t.check("MR-SEC-010", not got, f"READ from forged source {other}: {describe(got)}", frames=got or [mark + 1],
            expected="no reply to anyone")


# ---- bounded responder state (MR-SEC-015) ---------------------------------------------------------
@case("TC-SEC-015-a", rules=["MR-SEC-015", "MR-DUP-003"], category="SEC", timeout=12)
def responder_resources_bounded(t):
    """With max_dest_rd_atomic 1 the responder holds one READ: after READs A and B, a duplicate of B is
    executed again while a duplicate of A (no longer held) is silently discarded."""
    c = connect(t, max_dest_rd_atomic=1)
    c.mem_write(0, bytes(range(128)))
    pa = c.psn
    mark = c.send(read_req(c, c.va, 32))
    ra = read_responses(c, mark, 1)
    pb = c.psn
    mark = c.send(read_req(c, c.va + 64, 32))
    rb = read_responses(c, mark, 1)
    if not ra or not rb:
        t.undecided("MR-SEC-015", f"READs not answered: A {describe(ra)}, B {describe(rb)}")
        return
    mark = c.send(read_req(c, c.va + 64, 32, psn=pb))
    again = read_responses(c, mark, 1)
    ok = bool(again) and again[0].roce.psn == pb and again[0].roce.payload == bytes(range(64, 96))
    t.check("MR-DUP-003", ok, f"duplicate of the held READ B: {describe(again)}", frames=again or [mark + 1],
            expected=f"READ RESPONSE ONLY psn={pb:#08x} with bytes 64..95")
    mark = c.send(read_req(c, c.va, 32, psn=pa))
    got = c.quiet(QUIET, after=mark)
    t.check("MR-SEC-015", not got, f"duplicate of READ A, no longer held with one resource: {describe(got)}",
            frames=got or [mark + 1], expected="silently discarded")
    t.check("MR-DUP-003", not got, f"duplicate of a READ not held: {describe(got)}", frames=got or [mark + 1],
            expected="silently discarded")
    check_state(t, c, ["MR-SEC-015"], "RTS", "after the discarded duplicate")


# ---- forged and stale acknowledgements (MR-SEC-021, MR-SEC-023, MR-SEC-026, MR-SEC-032) -----------------
@case("TC-SEC-021-a", rules=["MR-SEC-021", "MR-SEC-026"], category="SEC", timeout=15)
def forged_source_acks_and_requests_ignored(t):
    """An ACK and a NAK code 2 with valid ICRC, P_Key, QPN and PSN but a forged source IP are discarded and
    counted: the WRITE does not complete, the QP stays in RTS, and the real ACK then completes it. A valid
    WRITE from the forged address is not placed and not answered."""
    c = connect_req(t, timeout=16)
    other = _other_ip(t)
    n0 = counter(t, "rx_drop_wrong_peer")
    mark = post(c, write_wr(c, 32, wr_id=0x21))
    rq = requests(c, mark, 1, ACK_WAIT)
    if not rq:
        t.undecided("MR-SEC-021", "the IUT sent no WRITE")
        return
    p = rq[0].roce.psn
    c.send(ack(c, p, 1, src_ip=other), c.frame("ACKNOWLEDGE", psn=p, aeth=(0x62, 1), src_ip=other))
    time.sleep(QUIET)
    wcs = c.poll(1, 0.05)
    st = c.query()["state"]
    n1 = counter(t, "rx_drop_wrong_peer")
    ok = not wcs and st == "RTS"
    for r in ("MR-SEC-021", "MR-SEC-026"):
        t.check(r, ok, f"ACK and NAK(0x62) from {other}: completions {wc_list(wcs)}, QP state {st}",
                expected="no completion, QP in RTS", observed=[f"{wc_list(wcs)}; {st}"])
    if n0 is not None:
        t.check("MR-SEC-021", n1 - n0 >= 2, f"rx_drop_wrong_peer {n0} -> {n1}", expected="+2",
                observed=[f"{n0} -> {n1}"])
    c.send(ack(c, p, 1))
    wcs = c.poll(1, 1.0)
    t.check("MR-SEC-021", bool(wcs) and wcs[0]["status"] == "IBV_WC_SUCCESS",
            f"the real peer's ACK: completions {wc_list(wcs)}", expected="0x21:SUCCESS", observed=[wc_list(wcs)])
    d = t.connect()
    bad = d.frame("RDMA_WRITE_ONLY", ackreq=True, reth=(d.va + 256, d.rkey, 16), payload=b"FORGED-SOURCE!!!",
                  src_ip=other)
    dropped_silently(t, d, bad, ["MR-SEC-026"], f"WRITE from {other} with valid ICRC, P_Key, QPN, PSN and R_Key",
                     offset=256, length=16, counter_name="rx_drop_wrong_peer")


@case("TC-SEC-023-a", rules=["MR-SEC-023", "MR-SEC-032"], category="SEC", timeout=15)
def fatal_naks_outside_the_window_ignored(t):
    """Fatal NAKs (codes 1, 2, 3) and a READ RESPONSE at PSNs the requester has no request outstanding at (before
    comp_psn, at or after next_psn) are discarded and counted: nothing completes, the QP stays in RTS, and the
    real ACK completes the WRITE."""
    c = connect_req(t, timeout=16)
    mark = post(c, write_wr(c, 32, wr_id=0x23))
    rq = requests(c, mark, 1, ACK_WAIT)
    if not rq:
        t.undecided("MR-SEC-023", "the IUT sent no WRITE")
        return
    p = rq[0].roce.psn
    q0 = [_qp_counter(c, n) for n in ("rx_ghost_rsp", "rx_stale_rsp")]
    bad = [nak(c, P.psn_add(p, 1), 1, 2), nak(c, P.psn_add(p, 7), 1, 1), nak(c, P.psn_add(p, -1), 0, 3),
           nak(c, P.psn_add(p, -9), 0, 2),
           c.frame("RDMA_READ_RESPONSE_ONLY", psn=P.psn_add(p, 5), payload=b"z" * 16, aeth=(0x1F, 1))]
    c.send(*bad)
    time.sleep(QUIET)
    wcs = c.poll(1, 0.05)
    st = c.query()["state"]
    ok = not wcs and st == "RTS"
    for r in ("MR-SEC-023", "MR-SEC-032"):
        t.check(r, ok, f"NAKs code 2, 1 after next_psn, codes 3, 2 before comp_psn, a READ RESPONSE after next_psn: "
                f"completions {wc_list(wcs)}, QP state {st}", expected="no completion, QP in RTS",
                observed=[f"{wc_list(wcs)}; {st}"])
    q1 = [_qp_counter(c, n) for n in ("rx_ghost_rsp", "rx_stale_rsp")]
    if None not in q0 + q1:
        grew = (q1[0] - q0[0]) + (q1[1] - q0[1])
        t.check("MR-SEC-023", grew >= 5, f"rx_ghost_rsp {q0[0]} -> {q1[0]}, rx_stale_rsp {q0[1]} -> {q1[1]}",
                expected="5 more in all", observed=[f"ghost {q1[0]}, stale {q1[1]}"])
    c.send(ack(c, p, 1))
    wcs = c.poll(1, 1.0)
    for r in ("MR-SEC-023", "MR-SEC-032"):
        t.check(r, bool(wcs) and wcs[0]["status"] == "IBV_WC_SUCCESS", f"the real ACK: completions {wc_list(wcs)}",
                expected="0x23:SUCCESS", observed=[wc_list(wcs)])


# ---- named drop counters (MR-SEC-031) ----------------------------------------------------------------
@case("TC-SEC-031-a", rules=["MR-SEC-031"], category="SEC", timeout=15)
def discards_counted_by_name(t):
    """Each discard of chapter 10 grows its own named counter: a request from the wrong source
    (rx_drop_wrong_peer), a request to a QP in ERR (rx_drop_qp_state), a stale ACK (rx_stale_rsp), a remote
    access error (rx_rkey_violation), a SEND without a receive WQE (rnr_naks_sent), three requests after
    epsn (rx_drop_out_of_seq, each one); the names are distinct."""
    names = {"wrong source": "rx_drop_wrong_peer", "bad QP state": "rx_drop_qp_state",
             "stale acknowledgement": "rx_stale_rsp", "remote access error": "rx_rkey_violation",
             "receiver not ready": "rnr_naks_sent", "out of window": "rx_drop_out_of_seq"}
    listed = set(t.caps.get("counters", ()))
    missing = [n for n in names.values() if n not in listed]
    if missing:          # an IUT may name its counters otherwise (rdma-core devices): the tester cannot map them
        t.cannot_drive("MR-SEC-031", f"the IUT does not report the counters {missing} (caps.counters); "
                         "its own names cannot be matched to the reasons of chapter 10")
        return
    t.check("MR-SEC-031", len(set(names.values())) == len(names), "every reason has its own counter name",
            expected=", ".join(names.values()), observed=[" ".join(sorted(listed))[:300]])

    def grew(what, before, after):
        t.check("MR-SEC-031", after > before, f"{what}: {names[what]} {before} -> {after}",
                expected=f"{names[what]} grows", observed=[f"{before} -> {after}"])

    c = connect_req(t, timeout=16)
    g0 = counter(t, "rx_drop_wrong_peer")
    mark = c.send(c.write(b"FORGED!!", offset=64, src_ip=_other_ip(t)))
    c.psn = P.psn_add(c.psn, -1)
    c.quiet(QUIET, after=mark)
    grew("wrong source", g0, counter(t, "rx_drop_wrong_peer"))
    s0 = _qp_counter(c, "rx_drop_out_of_seq")
    mark = c.send(*[c.write(b"FUTURE!!", offset=64, psn=P.psn_add(c.psn, k)) for k in (4, 5, 6)])
    c.quiet(QUIET, after=mark)
    s1 = _qp_counter(c, "rx_drop_out_of_seq")
    t.check("MR-SEC-031", s1 - s0 == 3, f"3 requests after epsn: rx_drop_out_of_seq {s0} -> {s1}",
            expected="+3 (each discarded one, not only the one NAKed)", observed=[f"{s0} -> {s1}"])
    r0 = _qp_counter(c, "rnr_naks_sent")
    mark = c.send(req(c, "SEND_ONLY", payload=b"no WQE"))
    c.psn = P.psn_add(c.psn, -1)
    c.quiet(QUIET, after=mark)
    grew("receiver not ready", r0, _qp_counter(c, "rnr_naks_sent"))
    mark = post(c, write_wr(c, 16, wr_id=0x31))
    rq = requests(c, mark, 1, ACK_WAIT)
    if rq:
        p = rq[0].roce.psn
        c.send(ack(c, p, 1))
        c.poll(1, 1.0)
        st0 = _qp_counter(c, "rx_stale_rsp")
        c.send(ack(c, P.psn_add(p, -5), 0))      # older than anything outstanding (at p itself: MR-ACK-015 (b))
        time.sleep(QUIET)
        grew("stale acknowledgement", st0, _qp_counter(c, "rx_stale_rsp"))
    else:
        t.undecided("MR-SEC-031", "the IUT sent no WRITE for the stale-ACK step")
    k0 = _qp_counter(c, "rx_rkey_violation")
    mark = c.send(req(c, "RDMA_WRITE_ONLY", reth=(c.va, _bad_key(c.rkey), 8), payload=b"x" * 8))
    first_response(c, mark)
    grew("remote access error", k0, _qp_counter(c, "rx_rkey_violation"))
    q0 = counter(t, "rx_drop_qp_state")
    mark = c.send(c.write(b"IN ERR!!", offset=64))             # the QP is in ERR after the NAK code 2
    c.quiet(QUIET, after=mark)
    grew("bad QP state", q0, counter(t, "rx_drop_qp_state"))


# ---- random starting PSNs (MR-SEC-020, MR-CM-007) ------------------------------------------------
@case("TC-SEC-020-a", rules=["MR-SEC-020", "MR-CM-007"], category="SEC", timeout=30)
def starting_psns_random(t):
    """The IUT connects (cm_connect, MRC1) to a passive side the tester plays on the link: the REQs of six
    QPs carry the QPN of their QP and six different starting PSNs without a fixed step; after a seventh
    exchange completes, the QP's first request carries the PSN its REQ announced.

    The tester reads and writes the connection messages with metaroce_xdp/cm.py (the wire format of
    6.2); the RoCE packets are still read with scapy."""
    import socket
    import threading

    from ... import cm
    t.need_commands("cm_connect")          # before the socket: the LT's address may be packet-level only
    srv = socket.socket(socket.AF_INET6 if ":" in t.lt_ip else socket.AF_INET, socket.SOCK_STREAM)
    srv.bind((t.lt_ip, 0))
    srv.listen(2)
    port = srv.getsockname()[1]
    reqs = []
    try:
        for k in range(7):
            c = t.connect(state="INIT")
            out: dict = {}

            def run(c=c, out=out):
                try:
                    out["result"] = t.agent.call("cm_connect", qp=c.qp, host=t.lt_ip, port=port, format="mrc1",
                                                 caps=0, flags=cm.FLAG_COMPAT_OK, timeout_ms=5000)
                except AgentError as e:
                    out["error"] = e.code
            th = threading.Thread(target=run, daemon=True)
            th.start()
            srv.settimeout(0.2)
            conn = None
            while conn is None and th.is_alive() and t.left() > 3:
                try:
                    conn, _ = srv.accept()
                except socket.timeout:
                    pass
            if conn is None:
                th.join(1)
                if out.get("error") in ("ENOTSUP", "ENOCMD"):
                    raise CannotDrive(f"the IUT's agent does not offer cm_connect ({out['error']})")
                raise CaseError(f"no connection from the IUT's cm_connect: {out}")
            with cm.Channel(conn, "IUT") as ch:
                if k < 6:
                    req = cm.read_msg(ch, 3.0)
                    reqs.append((c, req))
                    cm.reject(ch, req.cookie, cm.Reason.CONSUMER_REJECT, "conformance: looking at the PSN only")
                else:
                    lt_qpn = 0x100 + secrets.randbelow(0xFFFE00)
                    c.lt_qpn = lt_qpn

                    def make_rep(r, lt_qpn=lt_qpn):
                        return cm.CMMsg(cm.MsgType.REP, qpn=lt_qpn, psn=secrets.randbelow(1 << 24),
                                        gid=cm.ip_to_gid(t.lt_ip), mac=cm.mac_bytes(t.lt_mac), path_mtu=r.path_mtu)
                    req, _ = cm.passive_exchange(ch, 0, make_rep, 3.0)
                    reqs.append((c, req))
            th.join(6)
    finally:
        srv.close()
    psns = [r.psn for _, r in reqs]
    qpn_ok = all(r.qpn == c.qpn and r.qpn not in (0, 1) for c, r in reqs)
    t.check("MR-CM-007", qpn_ok, f"REQ qpn vs QP: {[(hex(r.qpn), hex(c.qpn)) for c, r in reqs]}",
            expected="each REQ carries its QP's QPN", observed=[" ".join(hex(r.qpn) for _, r in reqs)])
    steps = {(b - a) & 0xFFFFFF for a, b in zip(psns, psns[1:])}
    varied = len(set(psns)) == len(psns) and len(steps) > 1 and all(0 <= p < 1 << 24 for p in psns)
    for r in ("MR-SEC-020", "MR-CM-007"):
        t.check(r, varied, f"starting PSNs of {len(psns)} REQs: {[hex(p) for p in psns]} (the distribution itself "
                "is not observable from a few samples)", expected="distinct PSNs without a fixed step",
                observed=[" ".join(hex(p) for p in psns)])
    c, req = reqs[-1]
    st = c.query()["state"]
    if st != "RTS":
        t.undecided("MR-CM-007", f"the completed exchange left the QP in {st}")
        return
    mark = post(c, write_wr(c, 16, wr_id=0x20))
    rq = requests(c, mark, 1, ACK_WAIT)
    ok = bool(rq) and rq[0].roce.psn == req.psn
    t.check("MR-CM-007", ok, f"first request after the exchange: {describe(rq)}; REQ psn {req.psn:#08x}",
            frames=rq or [mark + 1], expected=f"a request with PSN {req.psn:#08x}")
    if rq:
        c.send(ack(c, req.psn, 1))
        c.poll(1, 1.0)


# ---- the passive side of the connection set-up (MR-SEC-017, MR-SEC-018, MR-SEC-019) -----------------
def _cm_listen(t, c, **kw) -> int:
    """cm_listen on the IUT QP `c` (in INIT) at a free port; CannotDrive when the IUT offers none."""
    t.need_commands("cm_listen", "cm_wait")
    for _ in range(5):
        port = 20000 + secrets.randbelow(40000)
        try:
            t.agent.call("cm_listen", qp=c.qp, port=port, format="mrc1", caps=0, flags=1, **kw)
            return port
        except AgentError as e:
            if e.code in ("ENOTSUP", "ENOCMD") or (e.code == "EINVAL" and kw):
                raise CannotDrive(f"the IUT's agent offers no cm_listen{' with ' + str(kw) if kw else ''}: "
                                    f"{e.code}") from None
            if e.code not in ("EBUSY", "EINTERNAL"):
                raise
    raise CaseError("cm_listen found no free port")


def _tcp(t, port: int, timeout: float = 2.0):
    import socket
    s = socket.create_connection((t.iut_ip, port), timeout=timeout, source_address=(t.lt_ip, 0))
    return s


def _req_msg(t, cm, qpn: int, psn: int, gid_ip: str | None = None, **kw):
    return cm.CMMsg(cm.MsgType.REQ, cookie=cm.new_cookie(), qpn=qpn, psn=psn, gid=cm.ip_to_gid(gid_ip or t.lt_ip),
                    mac=cm.mac_bytes(t.lt_mac), **kw)


def _answer(cm, ch):
    """The IUT's answer to a REQ: the message (REP or REJ), or None when it closed the connection."""
    try:
        return cm.read_msg(ch, 3.0)
    except cm.Rejected as e:                 # a message this side could not parse
        return e
    except cm.CMError:
        return None


@case("TC-SEC-017-a", rules=["MR-SEC-017"], category="SEC", timeout=20)
def setup_exchanges_bounded_per_source(t):
    """Eight TCP connections from one address to the IUT's listening port stay open waiting for a REQ (the
    default 8 per source address); a ninth is closed at once, before any message, and the QP stays in INIT."""
    import socket
    c = t.connect(state="INIT")
    port = _cm_listen(t, c)
    held = []
    try:
        for _ in range(8):
            held.append(_tcp(t, port))
        time.sleep(0.2)
        ninth = _tcp(t, port)
        ninth.settimeout(1.0)
        t0 = time.monotonic()
        try:
            got = ninth.recv(16)
        except socket.timeout:
            got = None
        except ConnectionResetError:
            got = b""
        dt = time.monotonic() - t0
        ninth.close()
        t.check("MR-SEC-017", got == b"", f"9th connection from {t.lt_ip}: "
                + ("closed" if got == b"" else "still open after 1 s" if got is None else f"sent {got!r}")
                + f" after {dt * 1000:.0f} ms", expected="closed at once, nothing sent",
                observed=[repr(got)])
        alive = 0
        for s in held:
            s.settimeout(0.05)
            try:
                alive += s.recv(16) != b""
            except socket.timeout:
                alive += 1
            except OSError:
                pass
        t.check("MR-SEC-017", alive == 8, f"{alive} of the first 8 connections still open", expected="8",
                observed=[str(alive)])
        st = c.query()["state"]
        t.check("MR-SEC-017", st == "INIT", f"QP state {st}", expected="INIT (no QP used)", observed=[st])
    finally:
        for s in held:
            s.close()


@case("TC-SEC-018-a", rules=["MR-SEC-018", "MR-CM-008"], category="SEC", timeout=25)
def qp_only_after_checks_and_released(t):
    """A REQ that fails a check (path_mtu 9) is answered by REJ INVALID_PARAM and leaves the listening QP in
    INIT; a valid REQ gets a REP, and when the tester then closes the connection before the RTU the exchange
    is released: a later REQ is answered with a REP again and completes, the QP taking the later REQ's PSN."""
    from ... import cm
    c = t.connect(state="INIT")
    port = _cm_listen(t, c)
    lt_qpn = 0x100 + secrets.randbelow(0xFFFE00)
    with cm.Channel(_tcp(t, port), "IUT") as ch:
        ch.send(_req_msg(t, cm, lt_qpn, 0x111, path_mtu=9).encode())
        m = _answer(cm, ch)
    ok = isinstance(m, cm.CMMsg) and m.msg_type == cm.MsgType.REJ and m.reason == cm.Reason.INVALID_PARAM
    what = m if not isinstance(m, cm.CMMsg) else f"{m.msg_type.name} {m.reason.name}"
    t.check("MR-CM-008", ok, f"REQ with path_mtu 9: {what}", expected="REJ INVALID_PARAM", observed=[str(what)])
    st = c.query()["state"]
    t.check("MR-SEC-018", st == "INIT", f"after the refused REQ: QP state {st}", expected="INIT", observed=[st])
    with cm.Channel(_tcp(t, port), "IUT") as ch:
        ch.send(_req_msg(t, cm, lt_qpn, 0x222).encode())
        m = _answer(cm, ch)
    ok = isinstance(m, cm.CMMsg) and m.msg_type == cm.MsgType.REP
    t.check("MR-SEC-018", ok, f"valid REQ: {getattr(m, 'msg_type', m)!s}; the tester closes before the RTU",
            expected="REP", observed=[str(getattr(m, "msg_type", m))])
    time.sleep(0.3)
    psn = secrets.randbelow(1 << 24)
    with cm.Channel(_tcp(t, port), "IUT") as ch:
        try:
            rep = cm.active_exchange(ch, _req_msg(t, cm, lt_qpn, psn), lambda r: None, 3.0)
            answer = f"REP qpn {rep.qpn:#x}, RTU sent"
        except cm.CMError as e:
            rep, answer = None, str(e)
    try:
        r = t.agent.call("cm_wait", qp=c.qp, timeout_ms=3000)
    except AgentError as e:
        r = {"error": e.code}
    st = c.query()
    ok = rep is not None and r.get("peer", {}).get("psn") == psn and st["state"] == "RTS" and st["attrs"]["rq_psn"] == psn
    t.check("MR-SEC-018", ok, f"REQ after the abandoned exchange: {answer}; cm_wait {r}; QP {st['state']} "
            f"rq_psn {st['attrs'].get('rq_psn')}", expected=f"REP, connected with rq_psn {psn:#x}",
            observed=[answer, str(r)])


@case("TC-SEC-019-a", rules=["MR-SEC-019"], category="SEC", timeout=20)
def req_gid_checked_against_source(t):
    """With the address check configured (cm_listen check_address), a REQ whose GID names another address
    than the TCP connection's source gets REJ ADDRESS_MISMATCH and the QP stays in INIT; a REQ with the
    source's own GID then connects."""
    from ... import cm
    c = t.connect(state="INIT")
    port = _cm_listen(t, c, check_address=True)
    other = _other_ip(t)
    lt_qpn = 0x100 + secrets.randbelow(0xFFFE00)
    with cm.Channel(_tcp(t, port), "IUT") as ch:
        ch.send(_req_msg(t, cm, lt_qpn, 0x333, gid_ip=other).encode())
        m = _answer(cm, ch)
    ok = isinstance(m, cm.CMMsg) and m.msg_type == cm.MsgType.REJ and m.reason == cm.Reason.ADDRESS_MISMATCH
    what = m if not isinstance(m, cm.CMMsg) else f"{m.msg_type.name} {m.reason.name}"
    t.check("MR-SEC-019", ok, f"REQ from {t.lt_ip} with the GID of {other}: {what}",
            expected="REJ ADDRESS_MISMATCH", observed=[str(what)])
    st = c.query()["state"]
    t.check("MR-SEC-019", st == "INIT", f"QP state {st}", expected="INIT", observed=[st])
    with cm.Channel(_tcp(t, port), "IUT") as ch:
        try:
            cm.active_exchange(ch, _req_msg(t, cm, lt_qpn, 0x444), lambda r: None, 3.0)
            answer = "REP"
        except cm.CMError as e:
            answer = str(e)
    t.check("MR-SEC-019", answer == "REP", f"REQ with its own GID: {answer}", expected="REP", observed=[answer])
