"""Congestion, compat profile (03-compat-rc.md MR-CNP, 05-congestion.md MR-CC-027 to MR-CC-038, 01 MR-ECN):
CNPs the IUT sends for CE-marked packets (format, which packets, how often) and the reaction of an IUT
requester to CNPs (its sending rate, DCQCN reaction point, caps=("DCQCN",)).

The LT marks its packets CE itself (IPv4 TOS ECN bits 11, MR-ECN-007) and sends
CNPs as a notification point would (MR-XH-016).  Rates are compared within one
case, before and after the CNPs, with a generous margin, so that a loaded host
slows both measurements alike.
"""
from __future__ import annotations

import threading
import time

from .. import packets as P
from ..context import NotApplicable
from ..registry import case
from ._common import describe, expect_ack
from ._req import (CNP, WC_OK, ack, cnp, need, post, read_rsp, read_wr, requests, tolerance_s,
                   write_wr)

CE_TOS = 0x6B                  # DSCP 26, ECN CE (binary 11)
CNP_INTERVAL = 50e-6           # cnp_interval default (MR-CNP-003, 05 Table 5.7.2)
SETTLE = 0.03                  # idle time that ends any cnp_interval


def _cnps(c, after: int, duration: float) -> list:
    return c.t.lt.collect(lambda f: c.is_mine(f) and f.roce.op == CNP, duration, after=after)


def _cnp_wait(c, after: int, timeout: float = 1.0) -> list:
    return c.expect(1, timeout, after=after, match=lambda f: f.roce.op == CNP)


def _udp_payload(f) -> bytes:
    ip = 14 + (4 if f.data[12:14] == b"\x81\x00" else 0)
    ihl = (f.data[ip] & 0x0F) * 4
    total = int.from_bytes(f.data[ip + 2:ip + 4], "big")
    return f.data[ip + ihl + 8:ip + total]


def _cnp_problems(t, c, f, sport: int | None) -> tuple[list[str], list[str]]:
    """(MUST problems of MR-XH-016 / MR-CC-029 / MR-CNP-001, SHOULD problems of DSCP and ECN)."""
    v = f.roce
    must = []
    for name, want in (("op", 0x81), ("se", 0), ("migreq", 0), ("pad", 0), ("tver", 0), ("pkey", 0xFFFF),
                       ("fecn", 0), ("becn", 1), ("dqpn", c.lt_qpn), ("ackreq", 0), ("psn", 0)):
        if getattr(v, name) != want:
            must.append(f"{name} {getattr(v, name)!r}, expected {want!r}")
    pl = _udp_payload(f)
    if len(pl) != 32:
        must.append(f"UDP payload {len(pl)} B, expected 32 (BTH 12 + 16 reserved + ICRC 4)")
    elif any(pl[12:28]):
        must.append(f"reserved bytes {pl[12:28].hex()} are not zero")
    if not v.icrc_ok:
        must.append("bad ICRC")
    if v.dst_ip != t.lt_ip or v.src_ip != t.iut_ip:
        must.append(f"addressed {v.src_ip} -> {v.dst_ip}")
    if sport is not None and v.sport != sport:
        must.append(f"UDP source port {v.sport:#06x}, the QP's other packets use {sport:#06x}")
    should = []
    if v.tos >> 2 != 48:
        should.append(f"DSCP {v.tos >> 2}, expected 48")
    if v.ecn != 0:
        should.append(f"ECN {v.ecn}, expected Not-ECT")
    return must, should


@case("TC-CNP-001-a", rules=["MR-CNP-001", "MR-CNP-002", "MR-CC-027", "MR-CC-029", "MR-XH-016", "MR-ECN-009",
                             "MR-CNP-004", "MR-CC-030", "MR-ECN-005"], category="CC", timeout=10)
def cnp_for_ce_marked_write(t):
    """A CE-marked WRITE is executed, ACKed and answered with one CNP: opcode 0x81, BECN 1, PSN 0, AckReq 0, the
    peer QP, 16 zero bytes, ICRC, the QP's UDP source port, DSCP 48 and Not-ECT; it takes no PSN of the IUT's
    requester (its next request has sq_psn)."""
    c = t.connect()
    p = c.psn
    mark = c.send(c.write(b"ce-write", offset=0, tos=CE_TOS))
    a = expect_ack(c, p, mark)
    got = _cnp_wait(c, mark)
    more = _cnps(c, got[0].num if got else mark, 0.2)
    need(a is not None, "the CE-marked WRITE was not ACKed")
    placed = c.mem(0, 8) == b"ce-write"
    frames = [a] + got + more
    exp = f"one CNP to QP {c.lt_qpn:#08x}: BECN, PSN 0, 16 zero bytes, DSCP 48, Not-ECT"
    for r in ("MR-CNP-002", "MR-CC-027", "MR-ECN-009"):
        t.check(r, bool(got) and placed, f"ACK {a.summary()}, placed {placed}; CNPs {describe(got + more)}",
                frames=frames, expected=exp)
    if not got:
        for r in ("MR-CNP-001", "MR-CC-029", "MR-XH-016", "MR-CNP-004", "MR-CC-030", "MR-ECN-005"):
            t.check(r, False, "no CNP", frames=[a], expected=exp)
        return
    must, should = _cnp_problems(t, c, got[0], a.roce.sport)
    for r in ("MR-CNP-001", "MR-CC-029", "MR-XH-016"):
        t.check(r, not must, "; ".join(must) or f"CNP as specified: {got[0].summary()}", frames=got, expected=exp)
    t.check("MR-CC-030", not [s for s in should if "DSCP" in s], "; ".join(should) or "DSCP 48", frames=got,
            expected="DSCP 48")
    t.check("MR-ECN-005", not [s for s in should if "ECN" in s], "; ".join(should) or "Not-ECT", frames=got,
            expected="Not-ECT")
    m2 = post(c, write_wr(c, 8, 1, offset=64))
    rq = requests(c, m2, 1, 1.0)
    if rq:
        c.send(ack(c, rq[0].roce.psn, 1))
        c.poll(1, 0.5)
    ok = not more and bool(rq) and rq[0].roce.psn == c.iut_psn
    t.check("MR-CNP-004", ok, f"CNPs after the first: {describe(more)}; first request after it: {describe(rq)}",
            frames=got + more + rq, expected=f"one CNP, never repeated; first request psn={c.iut_psn:#08x}")


@case("TC-CNP-002-a", rules=["MR-CNP-002", "MR-CC-027"], category="CC", timeout=10)
def cnp_from_rtr(t):
    """A QP in RTR (its requester not running) answers a CE-marked WRITE with an ACK and a CNP."""
    c = t.connect(state="RTR")
    p = c.psn
    mark = c.send(c.write(b"ce-rtr!!", offset=0, tos=CE_TOS))
    a = expect_ack(c, p, mark)
    got = _cnp_wait(c, mark)
    for r in ("MR-CNP-002", "MR-CC-027"):
        t.check(r, a is not None and bool(got), f"ACK {a is not None}; CNP {describe(got)}",
                frames=([a] if a else []) + got or [mark + 1], expected="ACK and CNP from the QP in RTR")


@case("TC-CC-031-a", rules=["MR-CC-031", "MR-ECN-007", "MR-CNP-002"], category="CC", timeout=10)
def cnp_for_duplicate_and_out_of_sequence(t):
    """A CE-marked duplicate WRITE (ACKed, not placed) and, later, a CE-marked WRITE after a PSN gap (NAKed):
    each answered with a CNP."""
    c = t.connect()
    p = c.psn
    m0 = c.send(c.write(b"original", offset=0))
    need(expect_ack(c, p, m0) is not None, "the first WRITE was not ACKed")
    time.sleep(SETTLE)
    m1 = c.send(c.write(b"dup-data", offset=0, psn=p, tos=CE_TOS))
    d = _cnp_wait(c, m1)
    time.sleep(SETTLE)
    m2 = c.send(c.write(b"gap-data", offset=64, psn=P.psn_add(c.psn, 2), tos=CE_TOS))
    g = _cnp_wait(c, m2)
    untouched = c.mem(0, 8) == b"original" and c.mem(64, 8) == bytes(8)
    det = (f"CNP for the duplicate: {describe(d)}; for the out-of-sequence WRITE: {describe(g)}; "
           f"memory kept: {untouched}")
    for r in ("MR-CC-031", "MR-ECN-007", "MR-CNP-002"):
        t.check(r, bool(d) and bool(g) and untouched, det, frames=d + g or [m1 + 1],
                expected="a CNP for each, nothing placed")


@case("TC-ECN-008-a", rules=["MR-ECN-008", "MR-CC-027", "MR-ECN-007"], category="CC", timeout=10)
def no_cnp_for_ce_responses_but_read_response(t):
    """At the IUT requester: a CE-marked ACK and a CE-marked CNP cause no CNP; a CE-marked READ RESPONSE does."""
    c = t.connect(timeout=16)
    mark = post(c, write_wr(c, 8, 1))
    rq = requests(c, mark, 1, 1.0)
    need(bool(rq), "the WRITE was not sent")
    m1 = c.send(ack(c, c.iut_psn, 1, tos=CE_TOS))
    wc1 = c.poll(1, 0.5)
    time.sleep(SETTLE)
    m2 = c.send(cnp(c, tos=CE_TOS | 0xC0))
    quiet = _cnps(c, m1, 0.2)
    psn = P.psn_add(c.iut_psn, 1)
    m3 = post(c, read_wr(c, 64, 2, offset=256))
    rq2 = requests(c, m3, 1, 1.0)
    need(bool(rq2), "the READ was not sent")
    m4 = c.send(read_rsp(c, "RDMA_READ_RESPONSE_ONLY", psn, bytes(range(64)), 2, tos=CE_TOS))
    got = _cnp_wait(c, m4)
    wc2 = c.poll(1, 0.5)
    ok_wc = [w["status"] for w in wc1 + wc2] == [WC_OK, WC_OK]
    t.check("MR-ECN-008", not quiet and ok_wc, f"CNPs after the CE-marked ACK and CNP: {describe(quiet)}",
            frames=quiet or [m1 + 1, m2 + 1], expected="no CNP")
    t.check("MR-CC-027", not quiet and bool(got), f"after ACK/CNP: {describe(quiet)}; after READ RESPONSE: "
            f"{describe(got)}", frames=quiet + got or [m4 + 1], expected="a CNP for the READ RESPONSE only")
    t.check("MR-ECN-007", bool(got) and ok_wc, f"CNP for the CE-marked READ RESPONSE: {describe(got)}",
            frames=got or [m4 + 1], expected="a CNP")


@case("TC-CNP-003-a", rules=["MR-CNP-003", "MR-CC-028", "MR-CC-027"], category="CC", timeout=15, timing=True)
def cnp_rate_limited(t):
    """200 CE-marked WRITEs back to back, then the same frames again (duplicates are CE-marked packets too,
    MR-ECN-007) until the burst has lasted 10 x max(2 G, 50 us) on the wire:
    k CNPs, k >= 1, fewer than the WRITEs, spread over at least (k - 1) x cnp_interval
    (50 us) less the MR-CONF-011 tolerance of that span (MR-CONF-038: judged on the count; the smallest gap
    between two CNPs is reported only); after 30 ms idle one more CE-marked WRITE gets its CNP."""
    c = t.connect(mr_len=1 << 16)
    g = float(t.hello.get("timer_granularity_us", 0) or 0) * 1e-6
    stim = 10 * max(2 * g, 50e-6)                  # MR-CONF-038: the 10 % term of the tolerance decides
    frames = [c.write(b"c%03d" % i, offset=8 * i, tos=CE_TOS, ackreq=(i == 199)) for i in range(200)]
    mark = c.send(*frames)
    t0, n = time.monotonic(), 200
    while time.monotonic() - t0 < stim and n < 4000:
        c.send(*frames)
        n += 200
    expect_ack(c, P.psn_add(c.psn, -1), mark, timeout=2.0)
    sent = t.lt.collect(lambda f: f.outgoing and f.roce is not None and f.roce.op == 0x0A, 0.0, after=mark)
    took = sent[-1].ts - sent[0].ts if sent else 0.0      # the stimulus on the wire, first to last WRITE
    cn = _cnps(c, mark, 0.1)
    k = len(cn)
    span = cn[-1].ts - cn[0].ts if k > 1 else 0.0
    tol = tolerance_s(t, (k - 1) * CNP_INTERVAL) if k > 1 else 0.0
    floor = (k - 1) * CNP_INTERVAL - tol
    gap = min((b.ts - a.ts for a, b in zip(cn, cn[1:])), default=None)
    ok = 1 <= k < n and span >= floor
    det = (f"{k} CNPs for {n} CE-marked WRITEs sent over {took * 1e3:.1f} ms (at least {stim * 1e3:.1f} ms), CNPs "
           f"over {span * 1e3:.2f} ms (at least {max(floor, 0) * 1e3:.2f} ms for that many: (k - 1) x 50 us less "
           f"{tol * 1e6:.0f} us); smallest gap "
           f"{'-' if gap is None else f'{gap * 1e6:.0f} us'} (reported, not judged)")
    t.check("MR-CNP-003", ok, det, frames=cn[:6] or [mark + 1], expected="CNPs at least cnp_interval apart")
    t.check("MR-CC-028", ok, det, frames=cn[:6] or [mark + 1], expected="at most one CNP per cnp_interval")
    time.sleep(SETTLE)
    m2 = c.send(c.write(b"later", offset=2048, tos=CE_TOS))
    g = _cnp_wait(c, m2)
    t.check("MR-CC-027", bool(cn) and bool(g), f"CNP after the idle time: {describe(g)}", frames=g or [m2 + 1],
            expected="a CNP")


def _stream(c, wr_id: int, size: int, deadline: float, cnp_burst: int = 0) -> list:
    """Post one WRITE of `size` bytes and capture its packets; with cnp_burst > 0 that many CNPs are sent every
    ~0.5 ms, ~60 times before the post and then by a thread until the last packet is seen."""
    n = -(-size // c.mtu)
    stop = threading.Event()
    burst = [cnp(c)] * cnp_burst

    def pump():
        while not stop.is_set():
            c.t.lt.send(*burst)
            time.sleep(0.0005)
    th = None
    if cnp_burst:
        # A CNP train of ~60 bursts first: DCQCN's alpha has decayed to ~0 since the QP was made (g = 1/256
        # per K = 55 us), so each early CNP cuts the rate by a few per cent only (5.6); the train builds alpha
        # up, so the cut shows within the stream even when an idle host sends it in ~2 ms
        for _ in range(60):
            c.t.lt.send(*burst)
            time.sleep(0.0005)
        th = threading.Thread(target=pump, name="cnp-pump", daemon=True)
        th.start()
    try:
        mark = post(c, write_wr(c, size, wr_id))
        got = requests(c, mark, n, max(0.5, deadline - time.monotonic()))
    finally:
        stop.set()
        if th is not None:
            th.join(1.0)
    if len(got) == n:
        c.send(ack(c, got[-1].roce.psn, wr_id))
    c.poll(1, 1.0)
    return got


@case("TC-CNP-006-a", rules=["MR-CNP-006", "MR-CC-034", "MR-CC-035"], category="CC", caps=("DCQCN",), timeout=30,
      timing=True)
def cnp_slows_the_requester(t):
    """The IUT sends a 512 KiB WRITE (512 packets) twice: as it likes, then after and while the LT sends it
    bursts of 8 CNPs every ~0.5 ms.  Past the first 128 KiB (room for a pacer's burst allowance), the second stream's rate
    is less than half the first's."""
    size = 512 << 10
    c = t.connect(mtu=1024, timeout=18, mr_len=size)
    a = _stream(c, 1, size, time.monotonic() + 5.0)
    need(len(a) == 512, f"first stream: {len(a)} of 512 packets captured")
    b = _stream(c, 2, size, time.monotonic() + min(15.0, t.left() - 3), cnp_burst=8)
    need(len(b) == 512, f"second stream: {len(b)} of 512 packets captured")
    k = 128

    def rate(fs):
        dt = fs[-1].ts - fs[k].ts
        return (len(fs) - 1 - k) * 1024 / dt if dt > 0 else float("inf")
    ra, rb = rate(a), rate(b)
    ok = rb < ra / 2
    det = (f"packets {k}..511: {ra / 1e6:.1f} MB/s before, {rb / 1e6:.1f} MB/s with CNPs "
           f"({(a[-1].ts - a[k].ts) * 1e3:.2f} ms vs {(b[-1].ts - b[k].ts) * 1e3:.2f} ms)")
    for r in ("MR-CNP-006", "MR-CC-034", "MR-CC-035"):
        t.check(r, ok, det, frames=[a[k], a[-1], b[k], b[-1]],
                expected="the rate with CNPs below half the rate without")


@case("TC-CNP-010-a", rules=["MR-CNP-010", "MR-ECN-012", "MR-CNP-003"], category="CC", timeout=10)
def cnp_counters_per_qp(t):
    """Per-QP counters (get_counters qp): five CE-marked WRITEs back to back add 5 to rx_ce_marked and, to
    tx_cnp, the number of CNPs captured (marks inside the interval are counted, not answered); three CNPs
    from the LT add 3 to rx_cnp.  NOT-APPLICABLE when the IUT does not report these counters per QP."""
    c = t.connect(timeout=16)
    names = ("tx_cnp", "rx_cnp", "rx_ce_marked")
    c0 = c.counters()
    if not all(n in c0 for n in names):
        raise NotApplicable(f"the IUT does not report {', '.join(n for n in names if n not in c0)} per QP")
    time.sleep(SETTLE)
    n = 5
    mark = c.send(*[c.write(b"m%d" % i, offset=8 * i, tos=CE_TOS, ackreq=(i == n - 1)) for i in range(n)])
    expect_ack(c, P.psn_add(c.psn, -1), mark)
    sent = _cnps(c, mark, 0.1)
    c1 = c.counters()
    m2 = c.send(*[cnp(c)] * 3)
    time.sleep(0.1)
    c2 = c.counters()
    d_ce, d_tx, d_rx = (c1["rx_ce_marked"] - c0["rx_ce_marked"], c1["tx_cnp"] - c0["tx_cnp"],
                        c2["rx_cnp"] - c1["rx_cnp"])
    det = f"rx_ce_marked +{d_ce}, tx_cnp +{d_tx} ({len(sent)} CNPs captured), rx_cnp +{d_rx} (3 CNPs sent)"
    t.check("MR-CNP-010", d_tx == len(sent) >= 1 and d_rx == 3, det, frames=sent or [m2 + 1],
            expected=f"tx_cnp +{len(sent)}, rx_cnp +3")
    t.check("MR-ECN-012", d_ce == n, det, frames=sent or [mark + 1], expected=f"rx_ce_marked +{n}")
    t.check("MR-CNP-003", d_ce == n and d_tx == len(sent), det, frames=sent or [mark + 1],
            expected="every CE mark counted, CNPs only as sent")


__all__: list[str] = []
