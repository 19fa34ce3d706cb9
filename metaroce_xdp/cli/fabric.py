"""`metaroce fabric`: an emulated lossy, congested data-centre fabric on one machine.

    metaroce fabric up --hosts 2 --paths 4                  # hosts h1..h2, leaves, a spine, 4 links per hop
    metaroce fabric set all --loss 1% --seed 7              # seeded loss on every port
    metaroce fabric set 'sp:l2.*' --rate 1gbit --mark-depth 30kb --drop-depth 200kb
    metaroce fabric set l1:sp2 --loss 5%                    # one degraded path
    metaroce fabric set l1:sp1 --link down                  # a pulled cable: ECMP moves to the other links
    metaroce fabric show                                    # topology, settings, counters per port
    metaroce fabric show -j                                 # the same as one JSON object
    metaroce fabric watch 'sp:l2.*' -i 0.5                  # rates, drops, marks and queue per interval
    metaroce fabric down                                    # remove everything (also after a crash)
    ip netns exec mrf-fab-h1 metaroce perf write-bw -d eth0 10.90.2.2   # run tools on a host

The machinery is metaroce_xdp/fabric; docs/fabric.md explains the design and the queue model.
"""
from __future__ import annotations

import json
from typing import Optional

import typer

app = typer.Typer(no_args_is_help=True, help="An emulated fabric of namespaces with ECMP paths and seeded "
                                             "impairments: up, set, show, down.")

_NAME = typer.Option("fab", "--name", "-n", help="fabric name (namespaces mrf-NAME-*)")
_JSON = typer.Option(False, "--json", "-j", help="print JSON")


def _impairments(loss, dup, reorder, reorder_delay, corrupt, rate, mark_depth, drop_depth, scope) -> dict:
    from metaroce_xdp.fabric import units
    return {
        "loss_ppm": None if loss is None else units.parse_ratio(loss),
        "dup_ppm": None if dup is None else units.parse_ratio(dup),
        "reorder_ppm": None if reorder is None else units.parse_ratio(reorder),
        "reorder_us": None if reorder_delay is None else units.parse_duration(reorder_delay),
        "corrupt_ppm": None if corrupt is None else units.parse_ratio(corrupt),
        "rate_bps": None if rate is None else units.parse_rate(rate),
        "mark_depth": None if mark_depth is None else units.parse_size(mark_depth),
        "drop_depth": None if drop_depth is None else units.parse_size(drop_depth),
        "scope": scope,
    }


def _fail(e: Exception, code: int = 1) -> typer.Exit:
    typer.echo(f"error: {e}", err=True)
    return typer.Exit(code)


# Options shared by `up` (applied to every port) and `set`.
_LOSS = typer.Option(None, "--loss", help="seeded random loss, e.g. 1%, 0.001, 500ppm")
_DUP = typer.Option(None, "--dup", help="duplicate this share of frames")
_REORDER = typer.Option(None, "--reorder", help="hold back this share of frames so later ones overtake them")
_REORDER_DELAY = typer.Option(None, "--reorder-delay", help="how long a reordered frame is held (default 200us)")
_CORRUPT = typer.Option(None, "--corrupt", help="flip one payload byte of this share of frames")
_RATE = typer.Option(None, "--rate", help="bottleneck rate (10gbit, 500mbit; off)")
_MARK = typer.Option(None, "--mark-depth", help="CE-mark ECT frames that find more than this queued (30kb)")
_DROP = typer.Option(None, "--drop-depth", help="drop frames that would queue beyond this (default 512kb)")
_SCOPE = typer.Option(None, "--scope", help="frames the random impairments act on: udp (default), roce, ip")
_SEED = typer.Option(None, "--seed", help="seed of the coins; restarts each port's pattern from its start")


@app.command("up")
def up_cmd(
    name: str = _NAME,
    hosts: int = typer.Option(2, "--hosts", help="hosts h1..hN, each behind its own leaf router"),
    paths: int = typer.Option(4, "--paths", help="parallel links between each leaf and the spine"),
    mtu: int = typer.Option(1500, "--mtu", help="MTU of every link (9000 for path MTU 4096)"),
    ipv6: bool = typer.Option(True, "--ipv6/--no-ipv6", help="IPv6 addresses and routes beside IPv4"),
    loss: Optional[str] = _LOSS, dup: Optional[str] = _DUP, reorder: Optional[str] = _REORDER,
    reorder_delay: Optional[str] = _REORDER_DELAY, corrupt: Optional[str] = _CORRUPT, rate: Optional[str] = _RATE,
    mark_depth: Optional[str] = _MARK, drop_depth: Optional[str] = _DROP, scope: Optional[str] = _SCOPE,
    seed: Optional[int] = _SEED, as_json: bool = _JSON,
) -> None:
    """Build the fabric: namespaces, links, ECMP routes, the impairment program on every switch port."""
    from metaroce_xdp import fabric
    from metaroce_xdp.fabric import units
    try:
        settings = _impairments(loss, dup, reorder, reorder_delay, corrupt, rate, mark_depth, drop_depth, scope)
        with fabric.up(name, hosts, paths, mtu=mtu, ipv6=ipv6, seed=seed, **settings) as fab:
            doc = fab.show(tbf=False)
    except (fabric.FabricError, units.UnitError) as e:
        raise _fail(e)
    if as_json:
        typer.echo(json.dumps(doc))
        return
    typer.echo(f"fabric {name}: {hosts} hosts, {paths} parallel links per leaf-spine hop, MTU {mtu}, ECMP on "
               f"the L4 hash (fib_multipath_hash_policy=1)")
    _echo_hosts(doc)
    first = doc["hosts"][0]
    typer.echo(f"run a command on a host:  ip netns exec {first['ns']} COMMAND   (interface {first['ifname']})")
    typer.echo(f"ports (one direction of a link each): {_port_summary(doc)}")
    typer.echo(f"change them with `metaroce fabric set PORT|PATTERN|all ...`; `metaroce fabric down"
               f"{'' if name == 'fab' else ' --name ' + name}` removes it all")


def _echo_hosts(doc: dict) -> None:
    for h in doc["hosts"]:
        v6 = f"  {h['ipv6']:<12}" if h["ipv6"] else ""
        typer.echo(f"  {h['host']:<4} {h['ipv4']:<12}{v6}  ns {h['ns']:<16} {h['ifname']}, gateway {h['gw4']}")


def _port_summary(doc: dict) -> str:
    return " ".join(p["port"] for p in doc["ports"])


@app.command("set")
def set_cmd(
    link: str = typer.Argument(..., metavar="PORT|PATTERN|all",
                               help="a port (l1:sp0, sp:l2.1, l2:h2), a shell pattern ('l*:h*'), a comma list, or all"),
    name: str = _NAME,
    loss: Optional[str] = _LOSS, dup: Optional[str] = _DUP, reorder: Optional[str] = _REORDER,
    reorder_delay: Optional[str] = _REORDER_DELAY, corrupt: Optional[str] = _CORRUPT, rate: Optional[str] = _RATE,
    mark_depth: Optional[str] = _MARK, drop_depth: Optional[str] = _DROP, scope: Optional[str] = _SCOPE,
    seed: Optional[int] = _SEED,
    reset: bool = typer.Option(False, "--reset", help="zero the counters, the queue and the coins' index"),
    clear: bool = typer.Option(False, "--clear", help="turn every impairment and the queue off first"),
    link_state: Optional[str] = typer.Option(None, "--link", help="down: pull the link's cable (both "
                                             "directions; routes move to the other links); up: plug it back"),
    as_json: bool = _JSON,
) -> None:
    """Change ports: settings not given stay as they are."""
    from metaroce_xdp import fabric
    from metaroce_xdp.fabric import units
    try:
        settings = _impairments(loss, dup, reorder, reorder_delay, corrupt, rate, mark_depth, drop_depth, scope)
        with fabric.Fabric.load(name) as fab:
            ports = fab.set(link, seed=seed, reset=reset, clear=clear, link=link_state, **settings)
            rows = [{"port": p.name, **fab.port_settings(p)} for p in ports]
    except (fabric.FabricError, units.UnitError) as e:
        raise _fail(e)
    if as_json:
        typer.echo(json.dumps(rows))
        return
    for r in rows:
        typer.echo(f"{r['port']:<10} {_settings_text(r)}")


def _settings_text(s: dict) -> str:
    from metaroce_xdp.fabric.units import fmt_rate, fmt_ratio, fmt_size
    parts = []
    if s["rate_bps"]:
        parts.append(f"rate {fmt_rate(s['rate_bps'])} mark>{fmt_size(s['mark_depth'])} drop>{fmt_size(s['drop_depth'])}")
    for k, label in (("loss_ppm", "loss"), ("dup_ppm", "dup"), ("corrupt_ppm", "corrupt")):
        if s[k]:
            parts.append(f"{label} {fmt_ratio(s[k])}")
    if s["reorder_ppm"]:
        parts.append(f"reorder {fmt_ratio(s['reorder_ppm'])} by {s['reorder_us']}us")
    if parts and s["scope"] != "udp":
        parts.append(f"scope {s['scope']}")
    return ", ".join(parts) or "clean"


_COLUMNS = (("pkts", "PKTS"), ("tx_pkts", "TX"), ("q_dropped", "QDROP"), ("marked", "CE"), ("dropped", "LOST"),
            ("duplicated", "DUP"), ("reordered", "HELD"), ("corrupted", "CORRUPT"))


@app.command("show")
def show_cmd(name: str = _NAME, as_json: bool = _JSON) -> None:
    """The fabric: hosts, and per port its settings, counters and queue."""
    from metaroce_xdp import fabric
    try:
        with fabric.Fabric.load(name) as fab:
            doc = fab.show()
    except fabric.FabricError as e:
        raise _fail(e)
    if as_json:
        typer.echo(json.dumps(doc))
        return
    typer.echo(f"fabric {doc['name']}: {doc['hosts_n']} hosts, {doc['paths']} paths, MTU {doc['mtu']}, "
               f"program id {doc['prog_id']}, maps in {doc['pin_dir']}")
    _echo_hosts(doc)
    head = f"{'PORT':<10} {'TO':<4} {'LINK':<10}" + "".join(f" {h:>8}" for _, h in _COLUMNS) + f" {'PEAKQ':>8}  SETTINGS"
    typer.echo(head)
    for p in doc["ports"]:
        c = p["counters"]
        typer.echo(f"{p['port']:<10} {p['toward']:<4} {p['state']:<10}" + "".join(f" {c[k]:>8}" for k, _ in _COLUMNS)
                   + f" {p['queue']['peak_bytes']:>8}  {_settings_text(p['settings'])}")


@app.command("watch")
def watch_cmd(
    link: str = typer.Argument("all", metavar="[PORT|PATTERN|all]", help="ports to watch (default all)"),
    name: str = _NAME,
    interval: float = typer.Option(1.0, "--interval", "-i", help="seconds between readings"),
    count: int = typer.Option(0, "--count", "-c", help="stop after this many intervals (0: until Ctrl-C)"),
    as_json: bool = typer.Option(False, "--json", "-j", help="one JSON object per port and interval"),
) -> None:
    """Per interval and busy port: frames and Mbit/s out, drops and marks by reason, queue now."""
    import time

    from metaroce_xdp import fabric
    if interval <= 0:
        raise _fail(ValueError("--interval must be above 0"), 2)
    try:
        with fabric.Fabric.load(name) as fab:
            prev = fab.sample(link)
            if not as_json:
                typer.echo(f"{'PORT':<10} {'PKT/S':>9} {'MBIT/S':>9} {'QDROP':>7} {'CE':>7} {'LOST':>7} {'DUP':>7} "
                           f"{'HELD':>7} {'CORRUPT':>7} {'QUEUE':>9}")
            n = 0
            while count == 0 or n < count:
                time.sleep(interval)
                cur = fab.sample(link)
                dt = (cur["t_ns"] - prev["t_ns"]) / 1e9
                for port, c in cur["ports"].items():
                    d = {k: v - prev["ports"][port][k] for k, v in c.items() if k != "backlog_bytes"}
                    if as_json:
                        typer.echo(json.dumps({"t": cur["t_ns"] / 1e9, "interval": dt, "port": port,
                                               "backlog_bytes": c["backlog_bytes"], **d}))
                    elif d["pkts"] or c["backlog_bytes"]:
                        typer.echo(f"{port:<10} {d['tx_pkts'] / dt:>9.0f} {d['tx_bytes'] * 8e-6 / dt:>9.1f} "
                                   f"{d['q_dropped']:>7} {d['marked']:>7} {d['dropped']:>7} {d['duplicated']:>7} "
                                   f"{d['reordered']:>7} {d['corrupted']:>7} {c['backlog_bytes']:>9}")
                prev, n = cur, n + 1
    except fabric.FabricError as e:
        raise _fail(e)
    except KeyboardInterrupt:
        raise typer.Exit(130)


@app.command("down")
def down_cmd(
    name: str = _NAME,
    kill: bool = typer.Option(False, "--kill", help="also end processes still running in its namespaces"),
    as_json: bool = _JSON,
) -> None:
    """Remove the fabric: namespaces, links, the program, its pinned maps and the record."""
    from metaroce_xdp import fabric
    try:
        rep = fabric.down(name, kill=kill)
    except fabric.FabricError as e:
        raise _fail(e)
    if as_json:
        typer.echo(json.dumps(rep))
        return
    if not rep["namespaces"] and not rep["record"]:
        typer.echo(f"fabric {name}: nothing to remove")
        return
    typer.echo(f"fabric {name}: removed {len(rep['namespaces'])} namespaces, the pinned maps and the record")
    for ns, pids in rep["processes"].items():
        verb = "ended" if rep["killed"] else "still running (detached from the fabric; --kill ends them)"
        typer.echo(f"  processes in {ns}: {' '.join(map(str, pids))} {verb}")
