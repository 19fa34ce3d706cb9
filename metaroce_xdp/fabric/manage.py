"""`metaroce fabric up|set|show|down` as functions: build a fabric, change its links, read its
counters, remove it -- each call a separate process, so what `up` built is recorded.

    fab = up("lab", hosts=2, paths=4)              # namespaces, links, routes, the BPF program
    fab.set("l*:h*", loss_ppm=10_000, seed=7)      # 1 % seeded loss on every last hop
    fab.show()["ports"][0]["counters"]["dropped"]
    down("lab")                                    # everything gone, also after a crashed `up`

The record is /run/metaroce/fabric-<name>.json (METAROCE_RUN_DIR moves it): the plan
(namespaces, hosts, ports), the pin directory of the program's maps and the program id.
`up` writes it before it builds anything, so a crash leaves a trace; `down` removes every
namespace with the fabric's prefix whether or not the record exists.  A lock file beside it
serialises commands on one fabric.

Neighbours: topology.py (plan, build), impair.py (program, maps, tbf), units.py, metaroce_xdp/cli/fabric.py.
"""
from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from . import impair
from .impair import PIN_ROOT, PPM, SCOPES, PortMaps
from .topology import (FabricError, Plan, Port, build, check_name, destroy, fabric_namespaces, link_states, make_plan,
                       ns_pids, set_link)

DEFAULT_NAME = "fab"
DEFAULT_DROP_DEPTH = 512 * 1024          # a queue always has a limit: a switch's buffer share
DEFAULT_REORDER_US = 200
MAX_REORDER_US = 500_000                 # deadlines live in a 20-bit ring of µs (1.05 s)
SETTINGS = ("loss_ppm", "dup_ppm", "reorder_ppm", "corrupt_ppm", "reorder_us", "rate_bps", "mark_depth",
            "drop_depth", "scope")


def run_dir() -> Path:
    return Path(os.environ.get("METAROCE_RUN_DIR", "/run/metaroce"))


def state_path(name: str) -> Path:
    return run_dir() / f"fabric-{name}.json"


def pin_dir(name: str) -> Path:
    return Path(PIN_ROOT) / f"fabric-{name}"


@contextlib.contextmanager
def _locked(name: str):
    run_dir().mkdir(parents=True, exist_ok=True)
    path = run_dir() / f"fabric-{name}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write_state(name: str, doc: dict) -> None:
    path = state_path(name)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


def list_fabrics() -> list[str]:
    d = run_dir()
    if not d.is_dir():
        return []
    return sorted(p.name[len("fabric-"):-len(".json")] for p in d.glob("fabric-*.json"))


@dataclass
class Fabric:
    """A fabric that is up: its plan and its maps."""

    plan: Plan
    doc: dict
    _maps: PortMaps | None = None

    @property
    def name(self) -> str:
        return self.plan.name

    @classmethod
    def load(cls, name: str = DEFAULT_NAME) -> "Fabric":
        check_name(name)
        try:
            doc = json.loads(state_path(name).read_text())
        except FileNotFoundError:
            others = list_fabrics()
            hint = f" (fabrics up: {', '.join(others)}; choose one with --name)" if others else \
                " (`metaroce fabric up` builds one)"
            raise FabricError(f"no fabric {name!r} is up{hint}") from None
        except (OSError, ValueError) as e:
            raise FabricError(f"the record of fabric {name} ({state_path(name)}) is unreadable: {e}; "
                              f"`metaroce fabric down --name {name}` removes what is left") from None
        if doc.get("status") != "up":
            raise FabricError(f"fabric {name} was not completely built (status {doc.get('status')!r}); "
                              f"`metaroce fabric down --name {name}` removes what is left")
        return cls(Plan.from_dict(doc["plan"]), doc)

    @property
    def maps(self) -> PortMaps:
        if self._maps is None:
            self._maps = PortMaps.open(self.doc["pin_dir"])
        return self._maps

    def close(self) -> None:
        """Let go of the maps; the fabric stays up."""
        if self._maps is not None:
            self._maps.close()
            self._maps = None

    def down(self, kill: bool = True) -> dict:
        """Close and remove the fabric (see down())."""
        self.close()
        return down(self.name, kill=kill)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ choosing ports
    def select(self, spec: str) -> list[Port]:
        """Ports named by spec: 'all', a port name ('l1:sp0'), a shell pattern ('l*:h*', 'sp:l2.*'),
        or several separated by commas."""
        out: list[Port] = []
        for part in (s.strip() for s in spec.split(",")):
            pat = "*" if part == "all" else part
            hit = [p for p in self.plan.ports if fnmatch.fnmatchcase(p.name, pat)]
            if not hit:
                raise FabricError(f"no port of fabric {self.name} matches {part!r}; ports are "
                                  f"{', '.join(p.name for p in self.plan.ports)} (patterns like 'l*:h*' work)")
            out += [p for p in hit if p not in out]
        return out

    # ------------------------------------------------------------------ changing links
    def set(self, spec: str, *, seed: int | None = None, reset: bool = False, clear: bool = False,
            link: str | None = None, **changes) -> list[Port]:
        """Change the settings of the ports `spec` names; settings not given stay.  seed: the
        coins restart from index 0 with this seed (each port mixes in its number); reset: zero
        the counters, the coin index and the queue; clear: every impairment off first;
        link "down"/"up": take the ports' links down (both directions, the routes move off
        them) or back up."""
        if link not in (None, "up", "down"):
            raise FabricError(f"link {link!r}: up or down")
        unknown = set(changes) - set(SETTINGS)
        if unknown:
            raise TypeError(f"unknown settings {sorted(unknown)}")
        changes = {k: v for k, v in changes.items() if v is not None}
        if isinstance(changes.get("scope"), str):
            if changes["scope"] not in SCOPES:
                raise FabricError(f"scope {changes['scope']!r}: one of {', '.join(SCOPES)}")
            changes["scope"] = SCOPES[changes["scope"]]
        ports = self.select(spec)
        with _locked(self.name):
            cfg = self.maps.cfg
            for p in ports:
                cur = {k: int(cfg[p.id][k]) for k in SETTINGS}
                new = cur | (dict(loss_ppm=0, dup_ppm=0, reorder_ppm=0, corrupt_ppm=0, rate_bps=0, mark_depth=0,
                                  drop_depth=0) if clear else {}) | changes
                if new["rate_bps"] and not new["drop_depth"]:
                    new["drop_depth"] = DEFAULT_DROP_DEPTH
                if new["reorder_ppm"] and not new["reorder_us"]:
                    new["reorder_us"] = DEFAULT_REORDER_US
                _check(new, p)
                queue_changed = (new["rate_bps"], new["drop_depth"]) != (cur["rate_bps"], cur["drop_depth"])
                rec = cfg[p.id]
                # Turn the queue off before its parameters change, on after: no frame sees half.
                rec["rate_bps"] = 0
                for k in SETTINGS:
                    if k != "rate_bps":
                        rec[k] = new[k]
                rec["ps_per_byte"] = impair.ps_per_byte(new["rate_bps"])
                rec["rate_bps"] = new["rate_bps"]
                if seed is not None:
                    rec["seed"] = impair.port_seed(seed, p.id)
                rec["enabled"] = 1
                if seed is not None or reset:
                    self.maps.reset_state(p.id)
                if reset:
                    self.maps.reset_counters(p.id)
                if queue_changed:
                    impair.set_tbf(p.ns, p.ifname, new["rate_bps"], new["drop_depth"], self.plan.mtu)
                if link is not None:
                    set_link(p, link == "up")
        return ports

    # ------------------------------------------------------------------ reading
    def port_settings(self, p: Port) -> dict:
        rec = self.maps.cfg[p.id]
        d = {k: int(rec[k]) for k in SETTINGS}
        d["scope"] = {v: k for k, v in SCOPES.items()}[d["scope"]]
        d["seed"] = int(rec["seed"])
        return d

    def sample(self, spec: str = "all") -> dict:
        """One reading of the ports `spec` names: time (CLOCK_MONOTONIC ns), and per port its
        counters and queue backlog now -- what `watch` prints the differences of, and what a
        benchmark samples to plot a queue over time."""
        return {"t_ns": impair.time_ns(),
                "ports": {p.name: {**self.maps.counters(p.id), "backlog_bytes": self.maps.backlog(p.id)}
                          for p in self.select(spec)}}

    def show(self, tbf: bool = True) -> dict:
        """The fabric as one dict: hosts, and per port its settings, counters and queue."""
        ports = []
        states = link_states(self.plan)
        for p in self.plan.ports:
            s = self.port_settings(p)
            st = self.maps.state(p.id)
            row = {"port": p.name, "id": p.id, "ns": p.ns, "ifname": p.ifname, "toward": p.toward, "link": p.link,
                   "state": states.get(p.name, "missing"), "settings": s, "counters": self.maps.counters(p.id),
                   "queue": {"backlog_bytes": self.maps.backlog(p.id), "peak_bytes": st["q_peak"]},
                   "coin_index": st["index"]}
            if tbf and s["rate_bps"]:
                row["tbf"] = impair.tbf_stats(p.ns, p.ifname)
            ports.append(row)
        hosts = [{"host": h.name, "ns": h.ns, "ifname": h.ifname, "ipv4": h.ipv4, "ipv6": h.ipv6, "gw4": h.gw4,
                  "gw6": h.gw6} for h in self.plan.host_list]
        return {"name": self.name, "hosts_n": self.plan.hosts, "paths": self.plan.paths, "mtu": self.plan.mtu,
                "ipv6": self.plan.ipv6, "namespaces": self.plan.namespaces, "prog_id": self.doc.get("prog_id"),
                "pin_dir": self.doc["pin_dir"], "hosts": hosts, "ports": ports}


def _check(s: dict, p: Port) -> None:
    for k in ("loss_ppm", "dup_ppm", "reorder_ppm", "corrupt_ppm"):
        if not 0 <= s[k] <= PPM:
            raise FabricError(f"{p.name}: {k} {s[k]} is outside 0..{PPM}")
    if s["rate_bps"] and not impair.MIN_RATE <= s["rate_bps"] <= impair.MAX_RATE:
        raise FabricError(f"{p.name}: rate {s['rate_bps']} bit/s is outside {impair.MIN_RATE} bit/s .. 100 gbit")
    for k in ("mark_depth", "drop_depth"):
        if not 0 <= s[k] < 1 << 32:
            raise FabricError(f"{p.name}: {k} {s[k]} bytes does not fit in 32 bits")
    if s["mark_depth"] and s["drop_depth"] and s["mark_depth"] >= s["drop_depth"]:
        raise FabricError(f"{p.name}: mark depth {s['mark_depth']} B must be below drop depth {s['drop_depth']} B")
    if not 0 <= s["reorder_us"] <= MAX_REORDER_US:
        raise FabricError(f"{p.name}: reorder delay {s['reorder_us']} us is outside 0..{MAX_REORDER_US}")


# ---------------------------------------------------------------------- up / down
def up(name: str = DEFAULT_NAME, hosts: int = 2, paths: int = 4, *, mtu: int = 1500, ipv6: bool = True,
       seed: int | None = None, **settings) -> Fabric:
    """Build fabric `name` and attach the impairment program; settings (as Fabric.set) apply to
    every port.  On any failure everything built so far is removed."""
    plan = make_plan(name, hosts, paths, mtu=mtu, ipv6=ipv6)
    pins = pin_dir(name)
    with _locked(name):
        if state_path(name).exists():
            raise FabricError(f"fabric {name} is up already (record {state_path(name)}); "
                              f"`metaroce fabric down --name {name}` first, or choose another --name")
        if fabric_namespaces(name):
            raise FabricError(f"namespaces of fabric {name} exist ({', '.join(fabric_namespaces(name))}) "
                              f"without a record: `metaroce fabric down --name {name}` removes them")
        doc = {"status": "building", "plan": plan.to_dict(), "pin_dir": str(pins), "created": time.time(),
               "pid": os.getpid()}
        _write_state(name, doc)
        try:
            build(plan)
            doc["prog_id"] = impair.load_and_attach(plan, pins)
            doc["status"] = "up"
            _write_state(name, doc)
        except BaseException:
            destroy(plan.namespaces)
            impair.unpin(pins)
            with contextlib.suppress(FileNotFoundError):
                state_path(name).unlink()
            raise
    fab = Fabric(plan, doc)
    if seed is not None or any(v is not None for v in settings.values()):
        try:
            fab.set("all", seed=seed, **settings)
        except BaseException:
            fab.close()
            down(name)
            raise
    return fab


def down(name: str = DEFAULT_NAME, *, kill: bool = False) -> dict:
    """Remove fabric `name`: its namespaces (with them the links, routes, tc filters and
    qdiscs, and so the program), the pinned maps and the record.  Works from what exists, so
    also after a crash.  Processes still running in the namespaces are listed; with kill=True
    they get SIGTERM, then SIGKILL after 2 s."""
    check_name(name)
    with _locked(name):
        names: list[str] = []
        pins = pin_dir(name)
        with contextlib.suppress(OSError, ValueError, KeyError):
            doc = json.loads(state_path(name).read_text())
            names += doc["plan"]["namespaces"]
            pins = Path(doc.get("pin_dir", pins))
        names = sorted(set(names) | set(fabric_namespaces(name)))
        procs = {ns: ns_pids(ns) for ns in names}
        procs = {ns: pids for ns, pids in procs.items() if pids}
        if kill and procs:
            _terminate([p for pids in procs.values() for p in pids])
        errors = destroy(names)
        errors += impair.unpin(pins)
        existed = state_path(name).exists()
        with contextlib.suppress(FileNotFoundError):
            state_path(name).unlink()
    with contextlib.suppress(FileNotFoundError):
        (run_dir() / f"fabric-{name}.lock").unlink()
    if errors:
        raise FabricError("fabric down incomplete: " + "; ".join(errors))
    return {"name": name, "namespaces": names, "record": existed, "pins": str(pins),
            "processes": {ns: pids for ns, pids in procs.items()}, "killed": kill and bool(procs)}


def _terminate(pids: list[int]) -> None:
    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)):
        alive = []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                alive.append(pid)
        deadline = time.monotonic() + wait
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if os.path.exists(f"/proc/{p}")]
            time.sleep(0.05)
        if not alive:
            return
        pids = alive
