"""DCQCN's parameters for compat QPs: one place for the compiled plane, metaroced and the tests.

Spec: 01-encapsulation.md MR-ECN-007/009/012, 03-compat-rc.md MR-CNP-001 to MR-CNP-010,
05-congestion.md sections 5.5 to 5.7 (MR-CC-027 to MR-CC-039).

The algorithm runs in the compiled plane (dp/cc.py): the notification point answers an
accepted CE-marked request or READ RESPONSE with at most one CNP per `cnp_interval` per QP; the
reaction point cuts the rate on each CNP (`Rt = Rc; Rc = max(R_min, Rc (1 - alpha/2)); alpha =
(1-g) alpha + g`), decays alpha every K without one, and raises the rate again on the timer T and
the byte counter B (fast recovery, additive and hyper increase) within `R_min <= Rc <= R_line`; a
token bucket filled at Rc paces the QP's packets.  dp/context.py's Plane writes these parameters
into row 0 of its float table (dp/layout.py D_FIELDS: the same names); dp/cc.py reads
WIRE_OVERHEAD from here (jitcache.DEPENDS_FILES lists this file: the constant is frozen into
compiled code).

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


__all__ = ["WIRE_OVERHEAD", "DcqcnParams", "link_rate_bps"]
