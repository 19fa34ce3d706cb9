"""Congestion, compat profile (03-compat-rc.md MR-CNP, 05-congestion.md MR-CC-027 to MR-CC-038, 01 MR-ECN):
CNPs the IUT sends for CE-marked packets (format, which packets, how often) and the reaction of an IUT
requester to CNPs (its sending rate, DCQCN reaction point, caps=("DCQCN",)).

The LT marks its packets CE itself (IPv4 TOS ECN bits 11, MR-ECN-007) and sends
CNPs as a notification point would (MR-XH-016).  The reaction to CNPs
(TC-CNP-006-a) is judged against the pseudocode of 5.6 through the agent's
readings of the reaction point's state, and the wire against the most rate those
readings allow: never against a throughput that depends on how busy the host is.
"""
from __future__ import annotations

import bisect
import threading
import time

from .. import packets as P
from ..context import CaseError, CannotDrive
from ..registry import case
from ._common import describe, expect_ack
from .cc2 import _params
from ._req import (CNP, WC_OK, ack, cnp, is_req, need, post, read_rsp, read_wr, requests, tolerance_s,
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
    if not got:                             # rules about the CNP's format: nothing to judge (MR-CONF-024)
        for r in ("MR-CNP-001", "MR-CC-029", "MR-XH-016", "MR-CNP-004", "MR-CC-030", "MR-ECN-005"):
            t.blocked(r, "MR-CNP-002", "no CNP was sent", frames=[a])
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
    stim = 10 * max(2 * t.granularity_s(), 50e-6)                  # MR-CONF-038: the 10 % term of the tolerance decides
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
    time.sleep(SETTLE)
    m2 = c.send(c.write(b"later", offset=2048, tos=CE_TOS))
    g = _cnp_wait(c, m2)
    t.check("MR-CC-027", bool(cn) and bool(g), f"CNP after the idle time: {describe(g)}", frames=g or [m2 + 1],
            expected="a CNP")
    if not cn:                               # a rate of CNPs that never came: nothing to judge (MR-CONF-024)
        for r in ("MR-CNP-003", "MR-CC-028"):
            t.blocked(r, "MR-CC-027", det, frames=[mark + 1])
        return
    t.check("MR-CNP-003", ok, det, frames=cn[:6], expected="CNPs at least cnp_interval apart")
    t.check("MR-CC-028", ok, det, frames=cn[:6], expected="at most one CNP per cnp_interval")


# ---- TC-CNP-006-a: the reaction point's cut (state readings) and its pacing (the wire) -----------------
WIRE_EXTRA = 24                # FCS 4 + preamble 8 + inter-frame gap 12: wire bytes the capture does not show
PACER_ALLOWANCE = 64 << 10     # the burst the case allows at the start of any interval (see the docstring)


class _Rp:
    """One reading of the reaction point through the agent (9.4.2 get_counters qp): its timers ran up to a
    moment between tb and ta (wall clock, as the capture time stamps)."""

    __slots__ = ("rc", "rt", "alpha", "rx_cnp", "tb", "ta")

    def __init__(self, c) -> None:
        self.tb = time.time()
        q = c.counters()
        self.ta = time.time()
        if "dcqcn_rate_bps" not in q or "dcqcn_alpha_ppm" not in q:
            raise CannotDrive("the IUT's agent reports no dcqcn_rate_bps / dcqcn_alpha_ppm counters: the reaction "
                                "point's state is not visible")
        self.rc, self.rt = float(q["dcqcn_rate_bps"]), float(q["dcqcn_target_bps"])
        self.alpha, self.rx_cnp = q["dcqcn_alpha_ppm"] / 1e6, int(q.get("rx_cnp", 0))

    def __str__(self) -> str:
        return f"Rc {self.rc:.0f} Rt {self.rt:.0f} alpha {self.alpha * 1e6:.0f} ppm rx_cnp {self.rx_cnp}"


def _rp_after(c, rx_cnp: int, timeout: float = 2.0) -> "_Rp":
    """The first reading whose rx_cnp reaches `rx_cnp` (the CNPs were acted on before it)."""
    deadline = time.monotonic() + timeout
    while True:
        s = _Rp(c)
        if s.rx_cnp >= rx_cnp:
            return s
        if time.monotonic() > deadline:
            raise CaseError(f"rx_cnp {s.rx_cnp}, {rx_cnp} expected: the CNPs did not reach the reaction point")
        time.sleep(0.002)


def _alpha_bounds(a0: float, n: int, periods: int, g_lo: float, g_hi: float) -> tuple[float, float]:
    """alpha after n CNPs (alpha = (1 - g) alpha + g each, MR-CC-035) and up to `periods` decays (x (1 - g),
    MR-CC-036) in any order, from a reading a0 (rounded to 1 ppm).  The least: every decay after the CNPs
    (decaying first keeps more of the +g terms); the most: no decay."""
    lo = 1 - (1 - max(0.0, a0 - 1e-6)) * (1 - g_lo) ** n
    hi = 1 - (1 - min(1.0, a0 + 1e-6)) * (1 - g_hi) ** n
    return lo * (1 - g_hi) ** periods - 2e-6, hi + 2e-6


def _rate_bound(readings: list, p: dict):
    """R_up(u): the most the pseudocode of 5.6 lets Rc be at wall time u, from the readings around u.  Rc <= Rt
    always; a CNP never raises Rt (Rt = Rc); each expiry of T raises it by R_AI at most (the stream is shorter
    than B, so no byte-counter step and no hyper increase).  Between two readings that saw no CNP acted on,
    Rc only grows, so it is at most the later reading's Rc."""
    tt, rai, line = p["t_ns"] / 1e9, float(p["r_ai_bps"]), float(p["r_line_bps"])
    tas = [r.ta for r in readings]

    def up(u: float) -> float:
        i = max(0, bisect.bisect_right(tas, u) - 1)      # the last reading whose moment lies before u
        r = readings[i]
        v = min(line, r.rt + rai * (int(max(0.0, u - r.tb) / tt) + 1))
        if i + 1 < len(readings) and u <= readings[i + 1].tb and readings[i + 1].rx_cnp == r.rx_cnp:
            v = min(v, readings[i + 1].rc)
        return v
    return up


def _pacing_excess(frames: list, up, tol_of, allowance: float) -> tuple[float, int, int]:
    """The largest (wire bytes of the packets i..j) - (allowance + integral of R_up over [t_i - tol, t_j]) over
    all i <= j, and that i, j (MR-CC-034 judged over every interval; MR-CONF-011 widens each by its tolerance)."""
    import numpy as np
    ts = np.array([f.ts for f in frames])
    wb = np.array([len(f.data) + WIRE_EXTRA for f in frames], dtype=float)
    tol_max = tol_of(ts[-1] - ts[0])
    step = 5e-6
    grid = np.arange(ts[0] - tol_max - step, ts[-1] + 2 * step, step)
    vals = np.array([up(u) for u in grid])
    cell = np.maximum(vals[:-1], vals[1:]) * step / 8           # bytes, each cell at its larger end
    cum = np.concatenate(([0.0], np.cumsum(cell)))

    def integral_to(x):
        return np.interp(x, grid, cum)
    cw = np.concatenate(([0.0], np.cumsum(wb)))
    span = ts[None, :] - ts[:, None]                             # [i, j] = t_j - t_i
    tol = np.vectorize(tol_of)(np.maximum(span, 0.0))
    sent = cw[None, 1:] - cw[:-1, None]                          # bytes of packets i..j
    allowed = allowance + integral_to(ts)[None, :] - integral_to(ts[:, None] - tol)
    excess = np.where(span >= 0, sent - allowed, -np.inf)
    i, j = np.unravel_index(int(np.argmax(excess)), excess.shape)
    return float(excess[i, j]), int(i), int(j)


@case("TC-CNP-006-a", rules=["MR-CNP-006", "MR-CC-035", "MR-CC-034"], category="CC", caps=("DCQCN",), timeout=30,
      timing=True)
def cnp_slows_the_requester(t):
    """The reaction point's answer to CNPs, judged against the pseudocode of 5.6 through the agent's readings
    of Rc, Rt and alpha (dcqcn_*_bps, dcqcn_alpha_ppm, caps.dcqcn_params), over every count of timer expiries
    the measured intervals allow, so that a loaded host cannot fail it:
    (1) an idle QP (Rc = Rt = R_line, alpha decayed below g / 8) gets one CNP: Rt stays R_line (= Rc at the
    cut), alpha = (1 - g) alpha + g less the decays the interval allows, and Rc = R_line (1 - alpha / 2) raised
    by fast recovery, R_line - (R_line alpha / 2) / 2^k for a k the interval allows;
    (2) three bursts of 64 CNPs: alpha within the bounds of the updates MR-CC-035 allows (at most one per
    cnp_interval, caps.dcqcn_params.cnp_interval_ns) and the decays the interval allows, and
    R_min <= Rc <= Rt <= R_line;
    (3) the QP sends a 512 KiB WRITE while the LT sends it bursts of 8 CNPs every ~0.5 ms and reads the state
    as often as it can: the wire bytes of the stream over every interval do not exceed the integral of the
    most Rc the readings and the pseudocode allow (R_up), widened by the MR-CONF-011 tolerance, plus 64 KiB
    (the pacer depth of a sender that sends from a polling loop: the reference's token bucket, a documented
    deviation from MR-CC-034's one packet, traceability.md).  Load only slows the IUT, so it only lowers the
    bytes on the wire: the verdict does not depend on scheduling."""
    p = _params(t)
    line, rmin = float(p["r_line_bps"]), float(p["r_min_bps"])
    g_lo, g_hi = (p["g_ppm"] - 0.5) / 1e6, (p["g_ppm"] + 0.5) / 1e6
    kk, tt = p["k_ns"] / 1e9, p["t_ns"] / 1e9
    size = 512 << 10
    need(size < int(p["b_bytes"]), f"B = {p['b_bytes']} B is not above the stream's {size} B")
    c = t.connect(mtu=1024, timeout=20, mr_len=size)      # T = 4.3 s: no retransmission of a slow stream
    # (1) one CNP at an idle QP
    idle_by = time.monotonic() + min(2.0, t.left() / 4)
    while True:
        s0 = _Rp(c)
        if (s0.rc >= line and s0.rt >= line and s0.alpha <= g_lo / 8) or time.monotonic() > idle_by:
            break
        time.sleep(0.02)
    need(s0.rc >= line and s0.rt >= line, f"the QP is not at line rate before any CNP: {s0}")
    m1 = c.send(cnp(c))
    s1 = _rp_after(c, s0.rx_cnp + 1)
    nk, nt = int((s1.ta - s0.tb) / kk) + 2, int((s1.ta - s0.tb) / tt) + 2
    a_lo, a_hi = _alpha_bounds(s0.alpha, 1, nk, g_lo, g_hi)
    ac_lo, ac_hi = max(0.0, s0.alpha - 1e-6) * (1 - g_hi) ** nk, s0.alpha + 1e-6
    gap = line - s1.rc                          # R_line - Rc: the cut R_line alpha / 2, halved per expiry
    ks = [k for k in range(nt + 1) if line * ac_lo / 2 ** (k + 1) - 2 <= gap <= line * ac_hi / 2 ** (k + 1) + 2]
    ok_a = a_lo <= s1.alpha <= a_hi
    ok_t = abs(s1.rt - line) <= 1
    ok_c = bool(ks) and s1.rc >= rmin
    det1 = (f"one CNP at an idle QP ({s0}): {s1}, {1e3 * (s1.ta - s0.tb):.2f} ms later (0..{nk} alpha periods, "
            f"0..{nt} rate timer expiries); alpha expected {a_lo * 1e6:.0f}..{a_hi * 1e6:.0f} ppm; Rt expected "
            f"R_line {line:.0f}; R_line - Rc = {gap:.0f} expected R_line alpha / 2^(k+1) for alpha at the cut "
            f"{ac_lo * 1e6:.0f}..{ac_hi * 1e6:.0f} ppm: k in {ks[:3]}{'...' if len(ks) > 3 else ''}")
    for r in ("MR-CNP-006", "MR-CC-035"):
        t.check(r, ok_a and ok_t and ok_c, det1, frames=[m1 + 1],
                expected="Rt = Rc; Rc = max(R_min, Rc (1 - alpha / 2)); alpha = (1 - g) alpha + g; then fast "
                         "recovery from T_cnt = 0", observed=[str(s0), str(s1)])
    # (2) three bursts of 64 CNPs (each acted on before the next)
    n, m2, s2 = 0, None, s1
    for _ in range(3):
        mk = c.send(*[cnp(c)] * 64)
        m2 = mk if m2 is None else m2
        n += 64
        s2 = _rp_after(c, s1.rx_cnp + n)
    nk2 = int((s2.ta - s1.tb) / kk) + 2
    # MR-CC-035: one reaction per cnp_interval at most (an IUT that names no interval: one per CNP), so
    # between none (every burst within an interval of the last cut) and one per interval the span allows
    iv = float(p.get("cnp_interval_ns", 0)) / 1e9
    n_up = n if iv <= 0 else min(n, int((s2.ta - s1.tb) / iv) + 2)
    b_lo = _alpha_bounds(s1.alpha, 0 if iv > 0 else n, nk2, g_lo, g_hi)[0]
    b_hi = _alpha_bounds(s1.alpha, n_up, nk2, g_lo, g_hi)[1]
    ok2 = b_lo <= s2.alpha <= b_hi and rmin <= s2.rc <= s2.rt <= line
    det2 = (f"{n} CNPs: {s2}, {1e3 * (s2.ta - s1.tb):.2f} ms after {s1} (0..{nk2} alpha periods, at most {n_up} "
            f"reactions): alpha expected {b_lo * 1e6:.0f}..{b_hi * 1e6:.0f} ppm, R_min {rmin:.0f} <= Rc <= Rt <= R_line")
    for r in ("MR-CNP-006", "MR-CC-035"):
        t.check(r, ok2, det2, frames=[m2 + 1], expected=f"at most {n_up} cuts and alpha updates",
                observed=[str(s1), str(s2)])
    # (3) the stream, paced while CNPs keep coming
    npk = -(-size // c.mtu)
    stop = threading.Event()
    readings = [s2]
    burst = [cnp(c)] * 8

    def pump():
        while not stop.is_set():
            c.t.lt.send(*burst)
            time.sleep(0.0005)

    def read():
        while not stop.is_set():
            readings.append(_Rp(c))
            time.sleep(0.0005)
    th_pump = threading.Thread(target=pump, name="cnp-pump", daemon=True)
    th_pump.start()
    try:
        readings.append(_Rp(c))
        mark = post(c, write_wr(c, size, 2))
        th_read = threading.Thread(target=read, name="rp-reader", daemon=True)
        th_read.start()
        try:
            got = c.t.lt.collect(lambda f: c.is_mine(f) and is_req(f), max(0.5, min(15.0, t.left() - 3)),
                                 after=mark, until=lambda fs: len({f.roce.psn for f in fs}) >= npk)
        finally:
            stop.set()
            th_read.join(2.0)
    finally:
        stop.set()
        th_pump.join(1.0)
    readings.append(_Rp(c))
    psns = {f.roce.psn for f in got}
    if len(psns) == npk:
        c.send(ack(c, P.psn_add(got[0].roce.psn, npk - 1), 2))
    c.poll(1, 1.0)
    need(len(psns) == npk, f"the stream: {len(psns)} of {npk} packets captured")
    readings.sort(key=lambda r: r.tb)
    up = _rate_bound(readings, p)

    def tol_of(span: float) -> float:
        return tolerance_s(t, span)
    allowance = PACER_ALLOWANCE + len(got[0].data) + WIRE_EXTRA
    excess, i, j = _pacing_excess(got, up, tol_of, allowance)
    dur = got[-1].ts - got[0].ts
    total = sum(len(f.data) + WIRE_EXTRA for f in got)
    rcs = [r.rc for r in readings[1:-1]] or [readings[-1].rc]
    det3 = (f"{len(got)} packets ({len(got) - npk} retransmitted), {total} wire bytes in {dur * 1e3:.2f} ms ({8 * total / max(dur, 1e-9) / 1e6:.0f} Mb/s); "
            f"{len(readings)} readings, Rc {min(rcs) / 1e6:.0f}..{max(rcs) / 1e6:.0f} Mb/s; the worst interval, "
            f"packets {i}..{j}, is {excess:+.0f} B from its bound (allowance {allowance} B)")
    t.check("MR-CC-034", excess <= 0, det3, frames=[got[i], got[j]],
            expected="the wire bytes of every interval at most the integral of R_up (the readings and 5.6) plus "
                     "64 KiB")


@case("TC-CNP-010-a", rules=["MR-CNP-010", "MR-ECN-012", "MR-CNP-003"], category="CC", timeout=10)
def cnp_counters_per_qp(t):
    """Per-QP counters (get_counters qp): five CE-marked WRITEs back to back add 5 to rx_ce_marked and, to
    tx_cnp, the number of CNPs captured (marks inside the interval are counted, not answered); three CNPs
    from the LT add 3 to rx_cnp.  CANNOT-DRIVE when the IUT does not report these counters per QP."""
    names = ("tx_cnp", "rx_cnp", "rx_ce_marked")
    t.need_qp_counters(*names)
    c = t.connect(timeout=16)
    c0 = c.counters()
    if not all(n in c0 for n in names):
        raise CannotDrive(f"the IUT does not report {', '.join(n for n in names if n not in c0)} per QP")
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
