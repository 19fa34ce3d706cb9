"""The rule catalogue of docs/spec, as the conformance report needs it.

Each rule (a paragraph that starts with its bold ID, README section 2.2) with its
file, requirement level (the strongest RFC 2119 keyword in its text), whether a
black-box tester can observe it (Table 9-2 and "not observable on the wire",
MR-CONF-037) and to which claims it applies (MR-CONF-002, MR-CONF-003 and the
capability Table 9-1 of MR-CONF-034).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

DEFINITION = re.compile(r"^\*\*(MR-[A-Z]+-\d{3})\*\*", re.MULTILINE)
RULE_ID = re.compile(r"MR-[A-Z]+-\d{3}")
CAP_BITS = {"NATIVE": 0x1, "SACK": 0x2, "OOO_PLACEMENT": 0x4, "MULTIPATH": 0x8, "CC_DELAY": 0x10,
            "CREDITS": 0x20, "IPV6": 0x40, "ATOMICS": 0x80}
# Table 9-1's first column uses these names; the DCQCN reaction point is not a connection capability
# but a claim (caps.dcqcn of the agent).
TABLE_9_1_NAMES = {"ATOMICS": "ATOMICS", "IPV6": "IPV6", "DCQCN reaction point": "DCQCN", "CREDITS": "CREDITS",
                   "MULTIPATH": "MULTIPATH", "CC_DELAY": "CC_DELAY",
                   "ACK_CREDITS (the completer honours credits, MR-ACK-010)": "ACK_CREDITS",
                   "CM_RETRY (an active endpoint retries a failed exchange, MR-CM-035)": "CM_RETRY",
                   "CM_DUAL_LISTEN (a passive endpoint takes both message formats on one port, MR-CM-047)":
                       "CM_DUAL_LISTEN"}
# optional behaviours a claim states in hello.options (no capability bit; Table 9-1)
OPTIONS = ("ACK_CREDITS", "CM_RETRY", "CM_DUAL_LISTEN")
COMPAT_FILES = ("01-encapsulation.md", "02-headers.md", "03-compat-rc.md", "07-qp-state.md", "08-memory.md",
                "10-security.md")


def default_spec_dir() -> Path:
    """The specification the rules are read from: package data in a wheel; in a checkout
    metaroce_xdp/conformance/spec links to docs/spec."""
    return Path(__file__).resolve().parent / "spec"


@dataclass
class Rule:
    id: str
    file: str
    text: str
    level: str                     # "must", "must not", "should", "should not", "may", "informative"
    observable: str = "yes"        # "yes", "partly", "no" (MR-CONF-037, Table 9-2)
    unobservable_what: str = ""    # Table 9-2's second column
    needs: str = ""                # the capabilities of Table 9-1 the rule depends on ("+"-joined), "" if none
    native_only: bool = False      # under a "(native)" heading, or "In the native profile, ..." / "In NATIVE_..."

    @property
    def area(self) -> str:
        return self.id.rsplit("-", 1)[0]

    @property
    def num(self) -> int:
        return int(self.id.rsplit("-", 1)[1])

    @property
    def normative(self) -> bool:
        return self.level in ("must", "must not")

    @property
    def title(self) -> str:
        t = " ".join(self.text.split())
        return t[:160] + ("..." if len(t) > 160 else "")


@dataclass
class Claim:
    """What the IUT claims (MR-CONF-001), from the agent's hello and caps."""
    profiles: list = field(default_factory=lambda: ["compat"])
    caps: set = field(default_factory=set)            # names of CAP_BITS (and "DCQCN")
    impl: str = ""
    version: str = ""

    @classmethod
    def from_agent(cls, hello: dict, caps: dict | None = None) -> "Claim":
        names = {n for n, bit in CAP_BITS.items() if hello.get("caps", 0) & bit}
        if caps and caps.get("dcqcn"):
            names.add("DCQCN")
        opts = hello.get("options") or []
        names |= {o for o in opts if isinstance(o, str) and o in OPTIONS}
        return cls(list(hello.get("profiles", ["compat"])), names, hello.get("impl", ""),
                   hello.get("version", ""))

    @property
    def native(self) -> bool:
        return "native" in self.profiles

    def text(self) -> str:
        """e.g. "compat+ATOMICS" (the form of 9.6.1's iut.claim)."""
        base = "native" if self.native else "compat"
        extra = sorted(c for c in self.caps if c not in ("NATIVE", "SACK", "OOO_PLACEMENT"))
        return "+".join([base, *extra])


def _level(text: str) -> str:
    t = re.sub(r"\(Revised:.*?\)", "", text, flags=re.S)
    if re.search(r"\b(MUST NOT|SHALL NOT)\b", t) and not re.search(r"\b(MUST|SHALL|REQUIRED)\b(?! NOT)", t):
        return "must not"
    if re.search(r"\b(MUST|SHALL|REQUIRED)\b", t):
        return "must"
    if re.search(r"\b(SHOULD NOT|NOT RECOMMENDED)\b", t) and not re.search(r"\b(SHOULD|RECOMMENDED)\b(?! NOT)", t):
        return "should not"
    if re.search(r"\b(SHOULD|RECOMMENDED)\b", t):
        return "should"
    if re.search(r"\b(MAY|OPTIONAL)\b", t):
        return "may"
    return "informative"


def _expand(item: str) -> list[str] | None:
    """"MR-ATOM-001 to MR-ATOM-011" / "MR-XH-011, MR-XH-012" / "MR-DUP-005" -> IDs; None for prose."""
    item = item.strip()
    m = re.fullmatch(r"(MR-[A-Z]+)-(\d{3}) to (MR-[A-Z]+)-(\d{3})", item)
    if m and m.group(1) == m.group(3):
        return [f"{m.group(1)}-{n:03d}" for n in range(int(m.group(2)), int(m.group(4)) + 1)]
    parts = [p.strip() for p in item.split(",")]
    if parts and all(RULE_ID.fullmatch(p) for p in parts):
        return parts
    return None


class Catalogue:
    """Every rule of the spec, by ID, in spec order."""

    def __init__(self, spec_dir: Path | str | None = None) -> None:
        self.dir = Path(spec_dir) if spec_dir else default_spec_dir()
        if not self.dir.is_dir():
            raise FileNotFoundError(f"spec directory {self.dir} not found (give --spec DIR)")
        self.rules: dict[str, Rule] = {}
        for md in sorted(self.dir.glob("*.md")):
            text = md.read_text()
            native_section = False
            for para in re.split(r"\n\s*\n", text):
                if para.startswith("#"):
                    native_section = para.splitlines()[0].rstrip().endswith("(native)")
                m = DEFINITION.match(para)
                if m:
                    body = para[m.end():].strip()
                    native = native_section or re.match(r"In (the native profile\b|NATIVE_)", body) is not None
                    self.rules[m.group(1)] = Rule(m.group(1), md.name, body, _level(body), native_only=native)
        self.version = self._version()
        self._observability()
        self._capabilities()

    def _version(self) -> str:
        readme = self.dir / "README.md"
        m = re.search(r"Status: version (\d+)", readme.read_text()) if readme.exists() else None
        return f"v{m.group(1)}" if m else "v1"

    def _table(self, name: str) -> list[list[str]]:
        """Rows (cells) of the Markdown table that follows the line starting with `name`."""
        text = (self.dir / "09-conformance.md").read_text()
        i = text.find(name)
        if i < 0:
            return []
        rows = []
        started = False
        for line in text[i:].splitlines()[1:]:
            if line.startswith("|"):
                started = True
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                if not set("".join(cells)) <= set("-: "):
                    rows.append(cells)
            elif started:
                break
        return rows[1:]          # without the header row

    def _observability(self) -> None:
        for r in self.rules.values():
            if "not observable on the wire" in " ".join(r.text.split()):
                r.observable = "partly"
        for cells in self._table("Table 9-2"):
            if len(cells) < 2:
                continue
            what = cells[1]
            partly = re.search(r"\bis observable\b", what) is not None
            for rid in RULE_ID.findall(cells[0]):
                if rid in self.rules:
                    self.rules[rid].observable = "partly" if partly else "no"
                    self.rules[rid].unobservable_what = what

    def _capabilities(self) -> None:
        for cells in self._table("Table 9-1"):
            if len(cells) < 2:
                continue
            cap = TABLE_9_1_NAMES.get(cells[0])
            if cap is None:
                continue
            for item in cells[1].split(";"):
                ids = _expand(item)
                if ids is None and re.fullmatch(r"every rule of (MR-[A-Z]+)", item.strip()):
                    area = item.strip().rsplit(" ", 1)[1]
                    ids = [rid for rid in self.rules if rid.startswith(area + "-")]
                for rid in ids or ():
                    if rid in self.rules:           # in two rows (MR-MP-016: IPV6 and MULTIPATH): needs both
                        r = self.rules[rid]
                        r.needs = "+".join(sorted({c for c in r.needs.split("+") if c} | {cap}))

    # -- applicability (MR-CONF-002, MR-CONF-003, MR-CONF-034) --------------------------------
    def in_profile(self, r: Rule, claim: Claim) -> bool:
        """Whether the rule belongs to what the claimed profile requires, before capabilities."""
        area, n = r.area, r.num
        if r.native_only:           # a native header (02-headers.md 3.7 to 3.9) or a native-profile rule
            return claim.native
        if r.file in COMPAT_FILES or area == "MR-CM":
            return True
        if area == "MR-CC":
            compat = 27 <= n <= 39
            return compat or claim.native
        if r.id == "MR-NAT-008":
            return True
        if area in ("MR-NAT", "MR-SACK", "MR-OOO", "MR-LOSS", "MR-MP"):
            return claim.native
        if area == "MR-CONF":       # requirements on the tester and on the agent (13-23): judged by the suite
            return 13 <= n <= 23
        return r.file not in ("04-native.md", "05-congestion.md")

    def applicable(self, rid: str, claim: Claim) -> tuple[bool, str]:
        """(applies, why not) for one rule under a claim."""
        r = self.rules[rid]
        if not self.in_profile(r, claim):
            return False, f"not part of the {claim.text()} claim (MR-CONF-002, MR-CONF-003)"
        missing = [c for c in r.needs.split("+") if c and c not in claim.caps]
        if missing:
            return False, f"{' and '.join(missing)} not claimed (Table 9-1, MR-CONF-034)"
        return True, ""

    def __contains__(self, rid: str) -> bool:
        return rid in self.rules

    def __getitem__(self, rid: str) -> Rule:
        return self.rules[rid]

    def __iter__(self):
        return iter(self.rules.values())

    def __len__(self) -> int:
        return len(self.rules)


__all__ = ["CAP_BITS", "Catalogue", "Claim", "Rule", "default_spec_dir"]
