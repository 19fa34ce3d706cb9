"""Crashes, hangs and violations, saved one JSON file each so that `python -m metaroce_xdp.fuzz replay FILE`
runs the same input again: {"fuzzer", "seed", "case", "kind", "what", "where", "finding", "input"}."""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field

from . import known

DEFAULT_DIR = "fuzz-crashes"


@dataclass
class Finding:
    fuzzer: str                   # "ctl" | "pkt"
    seed: int
    case: int
    kind: str                     # crash | hang | oob-write | leak | accounting
    what: str                     # one line: the signal / exception / check that failed
    where: str = ""               # traceback tail or log lines that say where
    input: dict = field(default_factory=dict)   # what the case sent (replayable)
    finding: str | None = None    # "F2", ... from known.KNOWN_OPEN; None = NEW

    def __post_init__(self) -> None:
        if self.finding is None:
            self.finding = known.classify(f"{self.what}\n{self.where}")

    @property
    def new(self) -> bool:
        return self.finding is None

    def save(self, out_dir: str) -> str:
        os.makedirs(out_dir, exist_ok=True)
        h = hashlib.sha1(json.dumps(self.input, sort_keys=True, default=str).encode()).hexdigest()[:10]
        path = os.path.join(out_dir, f"{self.fuzzer}-{self.kind}-{self.finding or 'NEW'}-s{self.seed}-c{self.case}-{h}.json")
        with open(path, "w") as f:
            json.dump({**asdict(self), "saved": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f, indent=1,
                      default=str)
        return path

    def line(self) -> str:
        tag = self.finding or "NEW"
        return f"[{tag}] {self.fuzzer} seed {self.seed} case {self.case}: {self.kind}: {self.what}"


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
