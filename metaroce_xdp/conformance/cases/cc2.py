"""Congestion control, compat (05-congestion.md 5.6): CNPs the IUT must discard (MR-CC-033) and the DCQCN
reaction point's state (MR-CC-036 to MR-CC-038).

The reaction point's rate and alpha are not on the wire at the resolution these rules speak of (one step
is tens of microseconds and a few Mb/s); the cases read them through the agent's per-QP counters
dcqcn_rate_bps, dcqcn_target_bps and dcqcn_alpha_ppm and its caps.dcqcn_params (9.4.2), and give
CANNOT-DRIVE where an IUT does not report them.  The expected values are computed here from the
pseudocode of 5.6, over the range of timer expiries the measured interval allows.
"""
from __future__ import annotations

import ipaddress
import math
import time

from ..agentproto import AgentError
from ..context import CaseError, CannotDrive
from ..registry import case
from ._req import cnp


def _other_ip(t) -> str:
    a = ipaddress.ip_address(t.lt_ip)
    for k in (60, 61, 62):
        cand = str(a + k)
        if cand not in (t.iut_ip, t.lt_ip):
            return cand
    return str(a + 1)


def _qp(c) -> dict:
    return c.counters()


def _port(t) -> dict:
    return t.agent.call("get_counters")["counters"]


def _sum(cs: dict, part: str) -> int:
    named = f"rx_drop_{part}"
    if named in cs:
        return int(cs[named])
    return sum(int(v) for k, v in cs.items() if part in k)


def _wait_rx_cnp(c, want: int, timeout: float = 1.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        q = _qp(c)
        if int(q.get("rx_cnp", 0)) >= want or time.monotonic() > deadline:
            return q
        time.sleep(0.01)


@case("TC-CC-033-a", rules=["MR-CC-033"], category="CC", timeout=15)
def cnps_not_from_the_peer_or_not_in_rts_discarded(t):
    """A CNP to an RTS QP from an address that is not its peer, and a CNP from the peer to a QP in RTR, are
    discarded -- the QP's rx_cnp (and its rate) do not move -- and counted (wrong peer, QP state); a valid CNP
    from the peer to the RTS QP then counts in rx_cnp."""
    t.need_qp_counters("rx_cnp")
    c = t.connect()
    before, pb = _qp(c), _port(t)
    c.send(cnp(c, src_ip=_other_ip(t)))
    time.sleep(0.3)
    after, pa = _qp(c), _port(t)
    moved = int(after.get("rx_cnp", 0)) - int(before.get("rx_cnp", 0))
    rate_same = after.get("dcqcn_rate_bps") == before.get("dcqcn_rate_bps") or "dcqcn_rate_bps" not in after
    counted = _sum(pa, "wrong_peer") - _sum(pb, "wrong_peer")
    t.check("MR-CC-033", moved == 0 and rate_same and counted >= 1,
            f"CNP from {_other_ip(t)}: QP rx_cnp +{moved}, rate {before.get('dcqcn_rate_bps')} -> "
            f"{after.get('dcqcn_rate_bps')}, wrong-peer drops +{counted}",
            expected="rx_cnp +0, rate unchanged, a wrong-peer drop counted", observed=[str(after)])
    r = t.connect(state="RTR")
    before, pb = _qp(r), _port(t)
    r.send(cnp(r))
    time.sleep(0.3)
    after, pa = _qp(r), _port(t)
    moved = int(after.get("rx_cnp", 0)) - int(before.get("rx_cnp", 0))
    counted = _sum(pa, "qp_state") - _sum(pb, "qp_state")
    t.check("MR-CC-033", moved == 0 and counted >= 1, f"CNP to a QP in RTR: rx_cnp +{moved}, QP-state drops "
            f"+{counted}", expected="rx_cnp +0, a QP-state drop counted", observed=[str(after)])
    base = int(_qp(c).get("rx_cnp", 0))
    c.send(cnp(c))
    q = _wait_rx_cnp(c, base + 1)
    t.check("MR-CC-033", int(q.get("rx_cnp", 0)) == base + 1, f"a valid CNP: rx_cnp {base} -> {q.get('rx_cnp')}",
            expected=f"{base + 1} (the control: a CNP from the peer counts)", observed=[str(q)])


# ---- the DCQCN reaction point (5.6) --------------------------------------------------------------------
def _params(t) -> dict:
    p = t.caps.get("dcqcn_params")
    if not p:
        raise CannotDrive("the IUT's agent reports no dcqcn_params (caps): the reaction point's state is not "
                            "visible")
    return p


def _state(c) -> tuple[float, float, float, float, float]:
    """(rate, target, alpha, time before the call, time after it) through the agent: the IUT's timers ran up to
    a moment between the last two."""
    tb = time.monotonic()
    q = _qp(c)
    if "dcqcn_rate_bps" not in q:
        raise CannotDrive("the IUT's agent reports no dcqcn_rate_bps / dcqcn_alpha_ppm counters")
    return (float(q["dcqcn_rate_bps"]), float(q["dcqcn_target_bps"]), q["dcqcn_alpha_ppm"] / 1e6, tb,
            time.monotonic())


def _between(a: tuple, b: tuple, period: float) -> tuple[int, int]:
    """The fewest and most timer expiries between the moments of two _state readings a and b."""
    return max(0, int((b[3] - a[4]) / period) - 1), int((b[4] - a[3]) / period) + 2


@case("TC-CC-038-a", rules=["MR-CC-038", "MR-CC-036"], category="CC", caps=("DCQCN",), timeout=15)
def reaction_point_starts_at_line_rate_and_alpha_decays(t):
    """A new QP starts at Rc = Rt = R_line with alpha = alpha_init decayed by (1 - g) once per K since its creation
    (no CNP yet); 400 CNPs drive Rc down but never below R_min; with no CNP for ~3 ms alpha falls by (1 - g) per K."""
    p = _params(t)
    # the agent reports g and alpha rounded to parts per million: bound the decay with g +- 0.5 ppm (38 decays
    # with g = 1/256 reported as 3906 ppm differ by 8e-6) and allow 2 ppm on each alpha reading.
    g_lo, g_hi, k = (p["g_ppm"] - 0.5) / 1e6, (p["g_ppm"] + 0.5) / 1e6, p["k_ns"] / 1e9
    t0 = time.monotonic()
    c = t.connect()
    t1 = time.monotonic()
    rc, rt, alpha, _, tr = _state(c)
    line = float(p["r_line_bps"])
    t.check("MR-CC-038", rc == line and rt == line, f"new QP: Rc {rc:.0f} Rt {rt:.0f}, R_line {line:.0f}",
            expected="Rc = Rt = R_line", observed=[f"{rc} {rt}"])
    a0 = p["alpha_init_ppm"] / 1e6
    n_hi, n_lo = int((tr - t0) / k) + 2, 0
    lo, hi = a0 * (1 - g_hi) ** n_hi - 2e-6, a0 * (1 - g_lo) ** n_lo + 2e-6
    t.check("MR-CC-038", lo <= alpha <= hi, f"alpha {alpha:.6f} {1e3 * (tr - t1):.1f}-{1e3 * (tr - t0):.1f} ms after "
            f"creation; alpha_init {a0} decayed {n_lo}..{n_hi} times: {lo:.6f}..{hi:.6f}",
            expected="alpha_init x (1 - g)^(elapsed / K)", observed=[str(alpha)])
    n = 400
    t_cnp = time.monotonic()
    c.send(*[cnp(c) for _ in range(n)])
    q = _wait_rx_cnp(c, n, 2.0)
    if int(q.get("rx_cnp", 0)) < n:
        raise CaseError(f"only {q.get('rx_cnp')} of {n} CNPs reached the reaction point")
    s1 = _state(c)
    rc, rt, alpha1, t2 = s1[0], s1[1], s1[2], s1[4]
    # Rc < R_line is demanded only when the reading came too soon for any recovery to reach R_line: the last
    # cut took at least R_line alpha / 2 off (alpha before it >= (alpha1 - g) / (1 - g)), and each expiry of T
    # at most halves the gap to R_line, so that needs log2(gap) expiries; a later reading may see R_line.
    a_last = max(0.0, (alpha1 - 2e-6 - g_hi) / (1 - g_hi))
    k_need = math.ceil(math.log2(line * a_last / 2)) if line * a_last / 2 > 1 else 0
    k_max = int((t2 - t_cnp) / (p["t_ns"] / 1e9)) + 2
    below = rc < line or k_max >= k_need
    t.check("MR-CC-038", p["r_min_bps"] <= rc <= line and rc <= rt and below,
            f"after {n} CNPs: Rc {rc:.0f}, Rt {rt:.0f} (R_min {p['r_min_bps']}, R_line {line:.0f}), read "
            f"{1e3 * (t2 - t_cnp):.2f} ms after the CNPs were sent (up to {k_max} T expiries; back to R_line "
            f"takes at least {k_need}, so Rc < R_line {'is' if k_max < k_need else 'is not'} required)",
            expected="R_min <= Rc <= Rt <= R_line", observed=[str(rc)])
    time.sleep(0.003)
    s2 = _state(c)
    alpha2, t3 = s2[2], s2[4]
    steps_lo, steps_hi = _between(s1, s2, k)
    steps_lo = max(0, steps_lo - 1)                      # the period of the last CNP does not decay
    lo, hi = alpha1 * (1 - g_hi) ** steps_hi - 2e-6, alpha1 * (1 - g_lo) ** steps_lo + 2e-6
    t.check("MR-CC-036", lo <= alpha2 <= hi and alpha2 < alpha1,
            f"alpha {alpha1:.6f} -> {alpha2:.6f} over {1e3 * (t3 - t2):.2f} ms without CNPs ({steps_lo}..{steps_hi} "
            f"K periods: {lo:.6f}..{hi:.6f})", expected="alpha x (1 - g) per K", observed=[f"{alpha1} {alpha2}"])


def _state_after_cnps(c, want: int, timeout: float) -> tuple[float, float, float, float, float]:
    """The first _state reading whose rx_cnp reaches `want`, polled without pause: MR-CC-035 reacts once to a
    burst (one cnp_interval), a cut of alpha / 2 with alpha decayed since the QP was made, which fast
    recovery undoes within a millisecond or two -- a reading 10 ms late sees R_line again."""
    deadline = time.monotonic() + timeout
    while True:
        tb = time.monotonic()
        q = _qp(c)
        ta = time.monotonic()
        if "dcqcn_rate_bps" not in q:
            raise CannotDrive("the IUT's agent reports no dcqcn_rate_bps / dcqcn_alpha_ppm counters")
        if int(q.get("rx_cnp", 0)) >= want:
            return (float(q["dcqcn_rate_bps"]), float(q["dcqcn_target_bps"]), q["dcqcn_alpha_ppm"] / 1e6, tb, ta)
        if ta > deadline:
            raise CaseError(f"only {q.get('rx_cnp')} of {want} CNPs reached the reaction point")


@case("TC-CC-037-a", rules=["MR-CC-037", "MR-CC-038", "MR-CC-032"], category="CC", caps=("DCQCN",), timeout=30)
def reaction_point_increases_after_cnps(t):
    """After 50 CNPs and no further one, the rate increase timer raises the rate as the pseudocode does: from the
    state read just after the last CNP, Rc and Rt after ~2 ms lie between the values of the fewest and the most
    T expiries the interval allows (fast recovery for F steps, then additive increase), and R_min <= Rc <= R_line."""
    p = _params(t)
    tt = p["t_ns"] / 1e9
    c = t.connect()
    n = 50
    # A reading that comes after the rate is back at R_line (about 14 ms with the defaults of 5.7.2: a loaded
    # host may be that slow to answer) shows no increase: the CNPs are sent again, up to 5 times.
    for attempt in range(1, 6):
        ts = time.monotonic()
        c.send(*[cnp(c) for _ in range(n)])
        s1 = _state_after_cnps(c, n * attempt, 2.0)
        rc1, rt1, t1 = s1[0], s1[1], s1[4]
        if rc1 < p["r_line_bps"] or attempt == 5:
            break
        time.sleep(0.02)
    time.sleep(0.002)
    s2 = _state(c)
    rc2, rt2, t2 = s2[0], s2[1], s2[4]
    # Expiries since the last CNP: at t1 between 0 and (t1 - ts) / T (+1); at t2 that plus (t2 - t1) / T (+-2).
    k1_max = int((t1 - ts) / tt) + 1
    d_lo, d_hi = _between(s1, s2, tt)
    # Rc, Rt at t1 are the state after k1 steps; unknown k1 in [0, k1_max].  Re-run the steps from the cut state
    # is not possible (unknown), so bound from the t1 state: the next d steps continue the same sequence.
    cands = []
    for k1 in range(0, min(k1_max, p["f"]) + 1):        # from F - 1 on, every step is the same additive one
        lo = _continue(p, rc1, rt1, k1, d_lo)
        hi = _continue(p, rc1, rt1, k1, d_hi)
        cands.append((lo, hi))
    ok = any(lo[0] - 1 <= rc2 <= hi[0] + 1 and lo[1] - 1 <= rt2 <= hi[1] + 1 for lo, hi in cands)
    if rc1 >= p["r_line_bps"]:
        raise CaseError(f"five readings came after the rate was back at R_line ({1e3 * (t1 - ts):.1f} ms after the "
                        "CNPs): no increase to observe")
    t.check("MR-CC-037", ok and rc2 > rc1,
            f"Rc {rc1:.0f} -> {rc2:.0f}, Rt {rt1:.0f} -> {rt2:.0f} over {1e3 * (t2 - t1):.2f} ms ({d_lo}..{d_hi} T "
            f"expiries after {0}..{k1_max} already run); predicted Rc/Rt ranges "
            f"{[(round(a[0]), round(b[0]), round(a[1]), round(b[1])) for a, b in cands[:3]]}...",
            expected="the pseudocode's fast recovery and additive increase", observed=[f"{rc2} {rt2}"])
    t.check("MR-CC-032", ok and rc2 > rc1, "the running reaction point follows 5.6: cut on CNPs, then fast "
            "recovery and additive increase with the parameters it reports", expected="the pseudocode of 5.6",
            observed=[f"{rc1} {rt1} -> {rc2} {rt2}"])
    t.check("MR-CC-038", p["r_min_bps"] <= rc1 <= rc2 <= p["r_line_bps"],
            f"Rc {rc1:.0f}, {rc2:.0f} within R_min {p['r_min_bps']}..R_line {p['r_line_bps']}",
            expected="R_min <= Rc <= R_line", observed=[f"{rc1} {rc2}"])


def _continue(p: dict, rc: float, rt: float, done: int, more: int) -> tuple[float, float]:
    """The state `more` expiries after one that had run `done` expiries since the last CNP."""
    f, line = p["f"], float(p["r_line_bps"])
    for k in range(done + 1, done + more + 1):
        if k < f:
            pass
        elif min(k, 0) > f:
            rt += (min(k, 0) - f) * p["r_hai_bps"]
        else:
            rt += p["r_ai_bps"]
        rt = min(rt, line)
        rc = min(line, (rt + rc) / 2)
    return rc, rt


# ---- per-QP CNP counters (MR-CC-039, the compat part) ----------------------------------------------------
@case("TC-CC-039-a", rules=["MR-CC-039"], category="CC", timeout=15)
def cnps_counted_per_qp_sent_acted_on_and_discarded(t):
    """Per QP the IUT counts CNPs sent (a CE-marked WRITE answered with a CNP: tx_cnp), received and acted on
    (a valid CNP from the peer: rx_cnp) and discarded (a CNP from an address that is not the peer, and one with
    a P_Key outside the QP's partition: rx_cnp_discarded), each moving by exactly what was sent; the native
    counters of the rule do not apply to a compat QP."""
    t.need_qp_counters("tx_cnp", "rx_cnp", "rx_cnp_discarded")
    c = t.connect()
    try:
        b = _qp(c)
    except AgentError as e:                 # an agent without per-QP counters (rdma-core devices)
        if e.code != "ENOTSUP":
            raise
        raise CannotDrive("the IUT's agent reports no per-QP counters") from e
    if "rx_cnp_discarded" not in b or "tx_cnp" not in b or "rx_cnp" not in b:
        raise CannotDrive("the IUT's agent reports no per-QP tx_cnp / rx_cnp / rx_cnp_discarded counters")
    mark = c.send(c.write(b"ce-count", offset=0, tos=0x6B))          # DSCP 26, ECN CE
    cnps = c.expect(1, timeout=min(2.0, t.left()), after=mark, match=lambda f: f.roce.op == 0x81)
    cnps += c.t.lt.collect(lambda f: c.is_mine(f) and f.roce.op == 0x81, 0.2, after=cnps[-1].num if cnps else mark)
    q = _qp(c)
    sent = int(q["tx_cnp"]) - int(b["tx_cnp"])
    t.check("MR-CC-039", len(cnps) == 1 and sent == len(cnps),
            f"a CE-marked WRITE: {len(cnps)} CNP(s) on the wire, tx_cnp +{sent}", frames=cnps,
            expected="one CNP on the wire and tx_cnp +1")
    b = q
    c.send(cnp(c, src_ip=_other_ip(t)), cnp(c, pkey=0x1234))
    time.sleep(0.3)
    q = _qp(c)
    disc = int(q["rx_cnp_discarded"]) - int(b["rx_cnp_discarded"])
    acted = int(q["rx_cnp"]) - int(b["rx_cnp"])
    t.check("MR-CC-039", disc == 2 and acted == 0,
            f"a CNP from {_other_ip(t)} and one with P_Key 0x1234: rx_cnp_discarded +{disc}, rx_cnp +{acted}",
            expected="rx_cnp_discarded +2, rx_cnp +0", observed=[str(q)])
    b = q
    c.send(cnp(c))
    q = _wait_rx_cnp(c, int(b["rx_cnp"]) + 1)
    disc = int(q["rx_cnp_discarded"]) - int(b["rx_cnp_discarded"])
    acted = int(q["rx_cnp"]) - int(b["rx_cnp"])
    t.check("MR-CC-039", acted == 1 and disc == 0, f"a valid CNP from the peer: rx_cnp +{acted}, "
            f"rx_cnp_discarded +{disc}", expected="rx_cnp +1, rx_cnp_discarded +0", observed=[str(q)])
