"""DCQCN for compat QPs: the notification point and the reaction point.

Spec: 01-encapsulation.md MR-ECN-007/009/012, 03-compat-rc.md MR-CNP-001 to
MR-CNP-010, 05-congestion.md sections 5.5 to 5.7 (MR-CC-027 to MR-CC-039).

* Notification point (receiver).  A request packet or READ RESPONSE that
  passed every check of MR-ENC-032 with ECN CE (binary 11) is counted in
  `rx_ce_marked` (MR-ECN-012) and, at most once per `cnp_interval` per QP
  (MR-CNP-003), answered with a CNP to the peer QP (MR-ECN-009, MR-CNP-002):
  BTH opcode 0x81, BECN 1, PSN 0, 16 zero bytes, the QP's P_Key, UDP source
  port and path, DSCP `cnp_dscp` and Not-ECT (MR-CNP-001, MR-CC-029,
  MR-ECN-005).  CNPs take no PSN and are never acknowledged or retransmitted
  (MR-CNP-004).
* Reaction point (sender).  Each valid CNP cuts the QP's rate
  (`Rt = Rc; Rc = max(R_min, Rc (1 - alpha/2)); alpha = (1-g) alpha + g`,
  MR-CNP-006, MR-CC-035); `alpha` decays every K without a CNP (MR-CNP-007,
  MR-CC-036); the rate timer T and the byte counter B drive fast recovery,
  additive and hyper increase (MR-CC-037); `R_min <= Rc <= R_line`
  (MR-CNP-008, MR-CC-038).  Timers are evaluated lazily from the engine's
  clock whenever the QP asks for sending budget, so an idle QP costs nothing.
  The QP's packets -- new requests, retransmissions and READ RESPONSEs --
  are paced by one token bucket filled at `Rc` (MR-CC-034, MR-CNP-009); the
  bucket holds at most `burst_bytes` (the engine sends in bursts from a
  polling loop, so the rate holds over intervals longer than one burst, not
  one packet).

Neighbours: engine.py calls `Dcqcn.on_ce_marked` for accepted packets and
`ReactionPoint.on_cnp` for CNPs that reach user space (in-process ports, or
`ACK_TO_USER` QPs); fastack.py turns increments of the kernel's per-QP
`cnp_count` (bpf/metaroce_xdp.c counts CNPs after verifying their ICRC) into
`on_cnp`; requester.py and the engine's READ RESPONSE step ask `allowance`
before sending and report with `on_sent`.

Parameters (`DcqcnParams`, defaults of 05-congestion.md Table 5.7.2; each
can be overridden with the environment variable METAROCE_DCQCN_<NAME>, e.g.
METAROCE_DCQCN_CNP_INTERVAL_NS=100000, METAROCE_DCQCN_ENABLED=0):

| name | meaning | default |
|---|---|---|
| enabled | run the reaction point (MR-CC-032); 0 = no rate control | 1 |
| cnp_interval_ns | N: minimum interval between CNPs per QP | 50 us |
| cnp_dscp | DSCP of CNPs | 48 |
| g | alpha gain | 1/256 |
| alpha_init | alpha at start | 1.0 |
| k_ns | K: alpha decay period | 55 us |
| t_ns | T: rate increase timer | 55 us |
| b_bytes | B: bytes per byte-counter increase event | 10 MiB |
| f | F: fast recovery steps | 5 |
| r_ai_bps | R_AI: additive increase step | 40 Mb/s |
| r_hai_bps | R_HAI: hyper increase step | 400 Mb/s |
| r_min_bps | R_min: minimum rate | 10 Mb/s |
| r_line_bps | R_line: initial and maximum rate | the interface's speed, else 10 Gb/s |
| burst_bytes | token bucket depth of the pacer | 64 KiB |
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

# Bytes on the wire besides the payload of one compat IPv4 packet: Ethernet 14 + FCS 4 +
# preamble/IFG 20 + IPv4 20 + UDP 8 + BTH 12 + ICRC 4 (extension headers are not counted).
WIRE_OVERHEAD = 82
# Most timer periods processed one by one when the clock jumped (a stalled process):
# beyond that the rate has long reached R_line and alpha is computed in closed form.
_MAX_STEPS = 4096


@dataclass(frozen=True)
class DcqcnParams:
    enabled: bool = True
    cnp_interval_ns: int = 50_000
    cnp_dscp: int = 48
    g: float = 1 / 256
    alpha_init: float = 1.0
    k_ns: int = 55_000
    t_ns: int = 55_000
    b_bytes: int = 10 << 20
    f: int = 5
    r_ai_bps: float = 40e6
    r_hai_bps: float = 400e6
    r_min_bps: float = 10e6
    r_line_bps: float = 10e9
    burst_bytes: int = 64 << 10

    @classmethod
    def from_env(cls, **defaults) -> "DcqcnParams":
        """The table's defaults, then `defaults` (e.g. the link's R_line), then
        METAROCE_DCQCN_<NAME> from the environment."""
        kw = dict(defaults)
        for f in dataclasses.fields(cls):
            v = os.environ.get("METAROCE_DCQCN_" + f.name.upper())
            if v is None:
                continue
            if f.type in ("bool", bool):
                kw[f.name] = v.strip().lower() not in ("0", "no", "false", "off", "")
            elif f.type in ("int", int):
                kw[f.name] = int(float(v))
            else:
                kw[f.name] = float(v)
        p = cls(**kw)
        if not 0 < p.r_min_bps <= p.r_line_bps:
            raise ValueError(f"DCQCN needs 0 < r_min_bps <= r_line_bps (got {p.r_min_bps}, {p.r_line_bps})")
        if not 0 < p.g < 1 or p.k_ns <= 0 or p.t_ns <= 0 or p.b_bytes <= 0 or p.cnp_interval_ns < 0:
            raise ValueError("DCQCN needs 0 < g < 1 and positive K, T, B")
        return p


def link_rate_bps(ifname: str | None, default: float = 10e9) -> float:
    """R_line: the interface's speed from sysfs (Mb/s), or `default` when unknown (-1, absent)."""
    if not ifname:
        return default
    try:
        with open(f"/sys/class/net/{ifname}/speed") as f:
            mbps = int(f.read().strip())
    except (OSError, ValueError):
        return default
    return mbps * 1e6 if mbps > 0 else default


class ReactionPoint:
    """The sender side of DCQCN for one QP (MR-CNP-006 to MR-CNP-009, MR-CC-034 to MR-CC-038)."""

    def __init__(self, p: DcqcnParams, now: int) -> None:
        self.p = p
        self.rc = self.rt = p.r_line_bps          # MR-CC-038
        self.alpha = p.alpha_init
        self.t_cnt = self.b_cnt = 0
        self.bytes_since = 0
        self.cnp_in_period = False
        self.alpha_due = now + p.k_ns
        self.rate_due = now + p.t_ns
        self.tokens = float(p.burst_bytes)
        self.t_tokens = now
        # counters (MR-CNP-010, MR-CC-039)
        self.rx_cnp = 0
        self.rate_cuts = 0
        self.rate_min = self.rc
        self.cnp_coalesced = 0                    # CNPs within cnp_interval of the last cut (MR-CC-035)
        self.last_cut: int | None = None

    # -- events --------------------------------------------------------------
    def on_cnp(self, now: int, count: int = 1) -> None:
        """`count` valid CNPs arrived (MR-CC-035).  Counted even when the RP is disabled.  One reaction per
        cnp_interval: a notification point sends no more (MR-CNP-003), so the rest are copies or forgeries
        (a CNP carries no PSN) and only counted; cnp_interval 0 reacts to each, up to 64 a look."""
        self.rx_cnp += count
        if not self.p.enabled:
            return
        p = self.p
        cuts = min(count, 64)
        if p.cnp_interval_ns > 0:
            if self.last_cut is not None and now - self.last_cut < p.cnp_interval_ns:
                self.cnp_coalesced += count
                return
            self.cnp_coalesced += count - 1
            self.last_cut = now
            cuts = 1
        self.advance(now)
        for _ in range(cuts):
            self.rt = self.rc
            self.rc = max(p.r_min_bps, self.rc * (1 - self.alpha / 2))
            self.alpha = (1 - p.g) * self.alpha + p.g
        self.rate_cuts += 1
        self.rate_min = min(self.rate_min, self.rc)
        self.cnp_in_period = True
        self.t_cnt = self.b_cnt = 0
        self.bytes_since = 0
        self.rate_due = now + p.t_ns              # restart the rate increase timer
        self.tokens = min(self.tokens, float(p.burst_bytes))

    def on_sent(self, nbytes: int) -> None:
        """The QP put `nbytes` on the wire: pay the pacer, drive the byte counter (MR-CC-037)."""
        if not self.p.enabled or nbytes <= 0:
            return
        self.tokens -= nbytes
        self.bytes_since += nbytes
        while self.bytes_since >= self.p.b_bytes:
            self.bytes_since -= self.p.b_bytes
            self.b_cnt += 1
            self._increase()

    # -- timers ----------------------------------------------------------------
    def advance(self, now: int) -> None:
        """Run the alpha timer (K) and the rate timer (T) up to `now` (MR-CC-036, MR-CC-037)."""
        p = self.p
        if now >= self.alpha_due:
            n = (now - self.alpha_due) // p.k_ns + 1
            if self.cnp_in_period:               # the period that saw a CNP does not decay alpha
                n -= 1
                self.cnp_in_period = False
            self.alpha *= (1 - p.g) ** n
            self.alpha_due += ((now - self.alpha_due) // p.k_ns + 1) * p.k_ns
        if now >= self.rate_due:
            n = (now - self.rate_due) // p.t_ns + 1
            self.rate_due += n * p.t_ns
            if self.rc >= p.r_line_bps and self.rt >= p.r_line_bps:
                self.t_cnt += n                  # at line rate an increase step changes nothing
            else:
                for _ in range(min(n, _MAX_STEPS)):
                    self.t_cnt += 1
                    self._increase()
                if n > _MAX_STEPS:
                    self.t_cnt += n - _MAX_STEPS
                    self.rc = self.rt = p.r_line_bps

    def _increase(self) -> None:
        p = self.p
        lo, hi = min(self.t_cnt, self.b_cnt), max(self.t_cnt, self.b_cnt)
        if hi < p.f:
            pass                                  # fast recovery: Rt unchanged
        elif lo > p.f:
            self.rt += (lo - p.f) * p.r_hai_bps   # hyper increase
        else:
            self.rt += p.r_ai_bps                 # additive increase
        self.rt = min(self.rt, p.r_line_bps)
        self.rc = min(p.r_line_bps, (self.rt + self.rc) / 2)

    # -- pacing ----------------------------------------------------------------------
    def allowance(self, now: int, budget: int, packet_bytes: int) -> int:
        """How many of `budget` packets of about `packet_bytes` wire bytes the QP may send now
        (MR-CC-034).  At line rate nothing is paced; below it the token bucket decides, and a
        positive balance lets one more packet go (its cost is paid in on_sent)."""
        if not self.p.enabled:
            return budget
        self.advance(now)
        dt = now - self.t_tokens
        self.t_tokens = now
        if self.rc >= self.p.r_line_bps:
            self.tokens = float(self.p.burst_bytes)
            return budget
        if dt > 0:
            self.tokens = min(float(self.p.burst_bytes), self.tokens + dt * self.rc / 8e9)
        if self.tokens < 0:
            return 0
        return min(budget, 1 + int(self.tokens // max(1, packet_bytes)))


class NotificationPoint:
    """The receiver side of DCQCN for one QP (MR-ECN-007/009/012, MR-CNP-002/003, MR-CC-027/028)."""

    def __init__(self, p: DcqcnParams) -> None:
        self.p = p
        self.last_cnp_ns: int | None = None
        self.rx_ce_marked = 0
        self.tx_cnp = 0
        self.cnp_template = None                  # (QP template it was derived from, bytes)

    def on_ce(self, now: int) -> bool:
        """A CE-marked packet was accepted: count it; True when a CNP is due now."""
        self.rx_ce_marked += 1
        if self.last_cnp_ns is not None and now - self.last_cnp_ns < self.p.cnp_interval_ns:
            return False                          # MR-CNP-003: counted only
        self.last_cnp_ns = now
        self.tx_cnp += 1
        return True


class Dcqcn:
    """Both points of one compat QP."""

    def __init__(self, p: DcqcnParams, now: int) -> None:
        self.p = p
        self.rp = ReactionPoint(p, now)
        self.np = NotificationPoint(p)

    def counters(self) -> dict:
        rp, np_ = self.rp, self.np
        return {"rate_bps": rp.rc, "rate_target_bps": rp.rt, "rate_min_bps": rp.rate_min, "alpha": rp.alpha,
                "rate_cuts": rp.rate_cuts, "rx_cnp": rp.rx_cnp, "tx_cnp": np_.tx_cnp,
                "rx_ce_marked": np_.rx_ce_marked}
