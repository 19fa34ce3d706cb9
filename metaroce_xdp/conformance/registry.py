"""The case registry: every test case declares what it checks, what it needs and how long it may take."""
from __future__ import annotations

import fnmatch
import importlib
import pkgutil
import re
from dataclasses import dataclass
from typing import Callable

# The codes of 9.3.3, and AGT for the test agent itself (9.4, MR-CONF-013 to MR-CONF-023).
CATEGORIES = ("WIRE", "ICRC", "SEQ", "ACK", "RTO", "RNR", "DUP", "ATOM", "MEM", "QPS", "SACK", "OOO", "MP", "CC",
              "CM", "SEC", "IOP", "AGT")
CASE_ID = re.compile(r"TC-[A-Z]+-\d{3}-[a-z]")


@dataclass(frozen=True)
class Case:
    id: str                          # TC-<AREA>-<NNN>-<letter> (9.1)
    rules: tuple[str, ...]           # rule IDs it gives a verdict on, each defined in docs/spec
    category: str                    # a code of 9.3.3
    fn: Callable                     # fn(t: T) -> None
    caps: tuple[str, ...] = ()       # capabilities the IUT must claim ("ATOMICS", "IPV6", "DCQCN", ...)
    profile: str = "compat"          # the profile of the QP under test
    timeout: float = 20.0            # seconds, the case's time bound
    title: str = ""
    timing: bool = False             # decides on measured times: left out of make test (not of make conformance)

    @property
    def module(self) -> str:
        return self.fn.__module__.rsplit(".", 1)[-1]


CASES: dict[str, Case] = {}


def case(id: str, *, rules, category: str, caps=(), profile: str = "compat", timeout: float = 20.0,
         timing: bool = False):
    """Register a test case function `fn(t)`; see the package docstring for how to write one."""
    if not CASE_ID.fullmatch(id):
        raise ValueError(f"case ID {id!r} is not TC-<AREA>-<NNN>-<letter>")
    if category not in CATEGORIES:
        raise ValueError(f"{id}: category {category!r} is not one of {CATEGORIES}")
    rules = (rules,) if isinstance(rules, str) else tuple(rules)
    if not rules or len(set(rules)) != len(rules):
        raise ValueError(f"{id}: rules must be a non-empty list without repeats")

    def register(fn: Callable) -> Callable:
        if id in CASES and CASES[id].fn is not fn:
            raise ValueError(f"case {id} registered twice ({CASES[id].fn.__module__}, {fn.__module__})")
        doc = (fn.__doc__ or "").strip().splitlines()
        CASES[id] = Case(id, rules, category, fn, tuple(caps), profile, float(timeout), doc[0] if doc else "",
                         bool(timing))
        return fn
    return register


def load_all() -> dict[str, Case]:
    """Import every module of metaroce_xdp.conformance.cases (each registers its cases)."""
    from . import cases as pkg
    for m in pkgutil.iter_modules(pkg.__path__):
        if not m.name.startswith("_"):
            importlib.import_module(f"{pkg.__name__}.{m.name}")
    return CASES


def select(patterns: list[str] | None = None, categories: list[str] | None = None,
           timing: bool = True) -> list[Case]:
    """Cases whose ID (or module name, or a rule they check) matches any glob pattern, in ID order;
    timing=False leaves out the cases that decide on measured times."""
    load_all()
    out = []
    for c in sorted(CASES.values(), key=lambda c: c.id):
        if categories and c.category not in categories:
            continue
        if not timing and c.timing:
            continue
        if patterns and not any(fnmatch.fnmatchcase(c.id, p) or fnmatch.fnmatchcase(c.module, p)
                                or any(fnmatch.fnmatchcase(r, p) for r in c.rules) for p in patterns):
            continue
        out.append(c)
    return out


__all__ = ["CASES", "CATEGORIES", "Case", "case", "load_all", "select"]
