"""Parsing the quantities `metaroce fabric` takes on its command line, with typed errors.

    parse_rate("10gbit") == 10_000_000_000      # bit/s; tc's suffixes (bit kbit mbit gbit tbit, decimal)
    parse_size("64kb") == 65_536                # bytes; b, kb/k/kib, mb/m/mib (binary, as tc's sizes)
    parse_ratio("1%") == 10_000                 # parts per million; also "0.01", "250ppm"
    parse_duration("200us") == 200              # microseconds; us, ms, s

Neighbours: manage.py (applies the values), metaroce_xdp/cli/fabric.py (the CLI).
"""
from __future__ import annotations

import re

__all__ = ["UnitError", "parse_rate", "parse_size", "parse_ratio", "parse_duration", "fmt_rate", "fmt_size",
           "fmt_ratio"]


class UnitError(ValueError):
    """A quantity could not be read; the message shows what is accepted."""


_NUM = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-zA-Z%]*)\s*$")

_RATE = {"": 1, "bit": 1, "bps": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_SIZE = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
         "mib": 1 << 20}
_TIME = {"us": 1, "ms": 1000, "s": 1_000_000}


def _split(text, what: str, example: str) -> tuple[float, str]:
    m = _NUM.match(str(text))
    if not m:
        raise UnitError(f"{what} {text!r} is not a number with a unit (e.g. {example})")
    return float(m.group(1)), m.group(2).lower()


def parse_rate(text) -> int:
    """A rate in bit/s; 0, 'off' or 'none' mean no bottleneck."""
    if str(text).strip().lower() in ("off", "none"):
        return 0
    v, unit = _split(text, "rate", "10gbit, 500mbit")
    if unit not in _RATE:
        raise UnitError(f"rate {text!r}: unit {unit!r} is not one of {', '.join(u for u in _RATE if u)}")
    return int(round(v * _RATE[unit]))


def parse_size(text) -> int:
    """A size in bytes."""
    v, unit = _split(text, "size", "30kb, 1500b, 1mb")
    if unit not in _SIZE:
        raise UnitError(f"size {text!r}: unit {unit!r} is not one of {', '.join(u for u in _SIZE if u)}")
    return int(round(v * _SIZE[unit]))


def parse_ratio(text) -> int:
    """A probability in parts per million: '1%', '0.5 %', '250ppm' or a fraction '0.01'."""
    v, unit = _split(text, "probability", "1%, 0.01, 250ppm")
    if unit == "%":
        ppm = v * 10_000
    elif unit == "ppm":
        ppm = v
    elif unit == "":
        if v > 1:
            raise UnitError(f"probability {text!r} is above 1 (write '{v:g}%' for a percentage)")
        ppm = v * 1_000_000
    else:
        raise UnitError(f"probability {text!r}: unit {unit!r} is not %, ppm or none")
    if ppm > 1_000_000:
        raise UnitError(f"probability {text!r} is above 100%")
    return int(round(ppm))


def parse_duration(text) -> int:
    """A duration in microseconds (a bare number is microseconds)."""
    v, unit = _split(text, "duration", "200us, 1ms")
    unit = unit or "us"
    if unit not in _TIME:
        raise UnitError(f"duration {text!r}: unit {unit!r} is not one of us, ms, s")
    return int(round(v * _TIME[unit]))


def fmt_rate(bps: int) -> str:
    if not bps:
        return "-"
    for unit, f in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps >= f:
            return f"{bps / f:g}{unit}"
    return f"{bps}bit"


def fmt_size(n: int) -> str:
    if not n:
        return "-"
    for unit, f in (("mb", 1 << 20), ("kb", 1 << 10)):
        if n >= f and n % (f // 16) == 0:
            return f"{n / f:g}{unit}"
    return f"{n}b"


def fmt_ratio(ppm: int) -> str:
    return f"{ppm / 10_000:g}%" if ppm else "-"
