"""The data plane's tunables, in one place: one typed object, one default per knob.

`Tunables()` holds the defaults; `load()` returns them with the environment's overrides applied (each
variable read here and nowhere else, parsed and range-checked once: a bad value is an InvalidArgument naming
the variable).  `Context.open(..., tunables=...)` takes one; metaroced builds its own from metaroced.toml
(daemon/config.py: `spin_idle`, `max_pending_events`) and applies the same overrides, which are for tests
and experiments -- an operator sets the TOML file.

    knob                 variable                   default
    window               METAROCE_WINDOW            1024   packets a QP may have un-ACKed
    budget               METAROCE_BUDGET            256    packets a loop round takes from the RX ring
    spin_idle            METAROCE_DP_SPIN           2000   idle rounds a progress thread spins before it sleeps
    yield_after          METAROCE_DP_YIELD          64     idle rounds between sched_yield()s while QPs wait (0: never)
    port_inflight        METAROCE_PORT_INFLIGHT     None   packets all QPs of a port may have un-ACKed (None: 3/4 of
                                                           the RX ring; 0: no port limit)
    read_rate_mbps       METAROCE_READ_RATE_MBPS    None   native READ responses' shared rate (None: the link's
                                                           speed; 0: not paced), MR-CC-021
    xdp_sacks            METAROCE_XDP_SACKS         True   native SACKs through the XDP program's rings (0: the socket)
    trace                METAROCE_DP_TRACE          None   metaroced: a file its loop records ring, RX and TX events to
    max_pending_events   METAROCE_MAX_PENDING_EVENTS 1024  metaroced: events queued for one client before EVENTS_LOST

DCQCN's parameters (METAROCE_DCQCN_*) are congestion control's and are read with its parameter object.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Mapping

from .verbs_types import InvalidArgument


@dataclass(frozen=True)
class Tunables:
    window: int = 1024
    budget: int = 256
    spin_idle: int = 2000
    yield_after: int = 64
    port_inflight: int | None = None
    read_rate_mbps: float | None = None
    xdp_sacks: bool = True
    trace: str | None = None
    max_pending_events: int = 1024


INT64_MAX = (1 << 63) - 1
# field -> (environment variable, parser, lowest value accepted)
ENV = {
    "window": ("METAROCE_WINDOW", int, 1),
    "budget": ("METAROCE_BUDGET", int, 1),
    "spin_idle": ("METAROCE_DP_SPIN", int, 0),
    "yield_after": ("METAROCE_DP_YIELD", int, 0),
    "port_inflight": ("METAROCE_PORT_INFLIGHT", int, 0),
    "read_rate_mbps": ("METAROCE_READ_RATE_MBPS", float, 0.0),
    "xdp_sacks": ("METAROCE_XDP_SACKS", None, None),
    "trace": ("METAROCE_DP_TRACE", str, None),
    "max_pending_events": ("METAROCE_MAX_PENDING_EVENTS", int, 1),
}
assert set(ENV) == {f.name for f in dataclasses.fields(Tunables)}


def _parse(name: str, var: str, parse, low, text: str):
    if parse is None:                                   # a flag
        if text not in ("0", "1"):
            raise InvalidArgument(f"{var}={text!r}: use 0 or 1")
        return text == "1"
    if parse is str:
        return text
    try:
        v = parse(text)
    except ValueError:
        raise InvalidArgument(f"{var}={text!r}: not a number ({name})") from None
    if v != v or v < low:                               # NaN or below the range
        raise InvalidArgument(f"{var}={text!r}: {name} must be at least {low}")
    if v > INT64_MAX:                                   # the plane keeps them in int64 words
        raise InvalidArgument(f"{var}={text!r}: {name} must be at most {INT64_MAX}")
    return v


def load(base: Tunables | None = None, env: Mapping[str, str] | None = None) -> Tunables:
    """`base` (default: the defaults) with each variable of ENV that is set (and not empty) applied."""
    env = os.environ if env is None else env
    kw = {}
    for name, (var, parse, low) in ENV.items():
        text = env.get(var)
        if text:
            kw[name] = _parse(name, var, parse, low, text)
    return dataclasses.replace(base or Tunables(), **kw)
