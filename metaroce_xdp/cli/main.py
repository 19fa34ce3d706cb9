"""The `metaroce` command.

    metaroce decode capture.pcap            # readable, one line per packet
    metaroce decode --json capture.pcap     # one JSON object per packet
    metaroce decode --hex '02 00 00 ...'    # a frame given as hex
    metaroce perf write-bw -d mr1                 # perftest-style server (write-bw write-lat read-bw send-bw)
    metaroce perf write-bw -d mr0 10.77.0.2       # ... and its client; --json for one summary object
    metaroce pingpong -d mr1                      # ibv_rc_pingpong server; add the server's IP for the client

Subcommands are added as the endpoint grows (qp, ...).
"""
from __future__ import annotations

import json
import sys
from typing import List, Optional

import typer

from . import fabric as fabric_mod
from . import perf as perf_mod
from . import pingpong as pingpong_mod

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="MetaRoCE: RDMA over plain Ethernet -- tools for the reference endpoint.")


def _print_version(value: bool) -> None:
    if value:
        from metaroce_xdp.version import version_text
        typer.echo(version_text("metaroce"))
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="print the version and the git revision, then exit")) -> None:
    """MetaRoCE: RDMA over plain Ethernet -- tools for the reference endpoint."""


@app.command("decode")
def decode_cmd(
    pcap: Optional[str] = typer.Argument(None, metavar="[FILE.pcap]", help="pcap or pcapng capture"),
    hex_: Optional[List[str]] = typer.Option(None, "--hex", "-x", help="a frame as hex (repeatable)"),
    as_json: bool = typer.Option(False, "--json", "-j", help="one JSON object per packet"),
    show_all: bool = typer.Option(False, "--all", "-a", help="also list frames that are not MetaRoCE"),
    strict: bool = typer.Option(False, "--strict", help="exit 1 if any packet is malformed or has a bad ICRC"),
) -> None:
    """Decode MetaRoCE (RoCEv2) packets: headers, fields and ICRC verdict."""
    if (pcap is None) == (not hex_):
        typer.echo("error: give either a capture file or --hex HEX (not both, not neither)", err=True)
        raise typer.Exit(2)
    from . import decode as decode_mod          # here: it loads numba (the ICRC), which other commands do not need
    try:
        if hex_:
            frames = [decode_mod.parse_hex(h) for h in hex_]
        else:
            frames = decode_mod.read_pcap(pcap)  # type: ignore[arg-type]
        s = decode_mod.run(frames, sys.stdout, as_json, show_all)
    except decode_mod.InputError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    if not as_json:
        typer.echo(decode_mod.summary_line(s), err=True)
    if strict and (s.malformed or s.icrc_bad):
        raise typer.Exit(1)


app.add_typer(fabric_mod.app, name="fabric")    # metaroce_xdp/cli/fabric.py: metaroce fabric up|set|show|down

# ---------------------------------------------------------------- perf (metaroce_xdp/cli/perf.py)
perf_app = typer.Typer(no_args_is_help=True, help="perftest-style benchmarks: server without HOST, client with it.")
app.add_typer(perf_app, name="perf")


def _perf_command(test: str):
    def cmd(
        server: Optional[str] = typer.Argument(None, metavar="[SERVER]", help="server IP (client side only)"),
        ifname: str = typer.Option(..., "-d", "--ib-dev", help="interface to run on (e.g. mr0)"),
        size: Optional[int] = typer.Option(None, "-s", "--size", help="message size in bytes "
                                           f"(default {perf_mod.DEFAULT_SIZE[test]})"),
        iters: Optional[int] = typer.Option(None, "-n", "--iters", help="iterations "
                                            f"(default {perf_mod.DEFAULT_ITERS[test]})"),
        port: int = typer.Option(18515, "-p", "--port", help="TCP port for the connection set-up"),
        mtu: Optional[int] = typer.Option(None, "-m", "--mtu", help="path MTU (default: the largest the "
                                          "interface carries)"),
        tx_depth: int = typer.Option(128, "-t", "--tx-depth", help="outstanding work requests (bw tests)"),
        rx_depth: int = typer.Option(512, "-r", "--rx-depth", help="receives kept posted (send-bw server)"),
        as_json: bool = typer.Option(False, "--json", "-j", help="print one JSON summary object"),
        timeout: float = typer.Option(30.0, "--timeout", help="give up after this many seconds without traffic"),
        plane: str = typer.Option("compiled", "--plane", help="in-process data plane: compiled (metaroce_xdp.dp, "
                                  "the endpoint applications get; the only choice)"),
        profile: str = typer.Option("auto", "--profile", help="native, compat or auto, negotiated with the "
                                    "peer: auto runs native when both ends offer it in process and compat "
                                    "otherwise (metaroced, a compat-only peer such as Soft-RoCE); native needs "
                                    "a native peer"),
        start_at: Optional[str] = typer.Option(None, "--start-at", metavar="EPOCH_SECONDS|@FILE", help="client: "
                                               "connect, then start the test at this wall-clock time, or at the "
                                               "time written into FILE once it exists (several clients at once)"),
        qps: int = typer.Option(1, "--qps", "-q", help="bw tests: QP pairs, -n iterations and -t depth on each "
                                "(client side; aggregate reported)"),
        bidir: bool = typer.Option(False, "--bidirectional", "-b", help="write-bw: both sides write at once "
                                   "(client side; aggregate of both directions reported)"),
        no_daemon: bool = typer.Option(False, "--no-daemon", help="own engine even when metaroced serves the "
                                       "interface"),
        sock: Optional[str] = typer.Option(None, "--socket", help="metaroced's control socket (default: "
                                           "$METAROCE_SOCKET, the configuration's, /run/metaroce/metaroced.sock)"),
        progress: str = typer.Option("spin", "--progress", help="in-process compiled plane: spin (busy polling, "
                                     "the lowest latency) or sleep (idle, the bw loop and the waits for the peer "
                                     "sleep in poll() until a frame, a post or the next timer or pacing deadline: "
                                     "several senders sharing few cores); write-lat spins either way"),
        no_address_check: bool = typer.Option(False, "--no-address-check", help="server: accept a REQ whose GID "
                                              "is not the address its TCP connection comes from (MR-SEC-019); "
                                              "only where set-up runs on another network than the traffic"),
        rx_queues: int = typer.Option(0, "--rx-queues", min=0, max=64, help="in-process plane: RX queues served "
                                      "from queue 0 (0: every one the interface has, as the NIC's RSS needs)"),
        perftest: bool = typer.Option(False, "--perftest", help="client: the server is perftest's "
                                      f"ib_{test.replace('-', '_')} (its exchange, compat; give both sides the "
                                      "same -s/-a, -n, -q); a server recognises a perftest client by itself"),
        all_sizes: bool = typer.Option(False, "-a", "--all", help="every size from 2 B to 8 MiB (perftest's -a)"),
        duration: Optional[float] = typer.Option(None, "-D", "--duration", help="write-bw, read-bw: run this many "
                                                 "seconds (batches of -n) instead of -n iterations"),
        report_gbits: bool = typer.Option(False, "--report_gbits", "--report-gbits", help="Gb/sec instead of "
                                          "MB/sec (perftest's default unit: 2^20 bytes per second)"),
        gid_index: Optional[int] = typer.Option(None, "-x", "--gid-index", help="accepted for perftest's command "
                                                "lines: the GID is always the interface's address"),
        cpu_freq: bool = typer.Option(False, "-F", "--CPU-freq", help="accepted for perftest's command lines "
                                      "(no CPU-frequency check here: clocks are the kernel's)"),
    ) -> None:
        opt = perf_mod.PerfOptions(test, ifname, server, size, iters, port, mtu, tx_depth, rx_depth, as_json,
                                   timeout, plane, qps, bidir)
        opt.no_daemon, opt.socket = no_daemon, sock
        opt.profile = profile
        opt.start_at = start_at
        opt.progress = progress
        opt.check_address = not no_address_check
        opt.rx_queues = rx_queues
        opt.perftest, opt.all_sizes, opt.duration = perftest, all_sizes, duration
        opt.report_gbits, opt.gid_index = report_gbits, gid_index
        try:
            perf_mod.run(opt)
        except perf_mod.PerfError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1)
        except KeyboardInterrupt:
            raise typer.Exit(130)
    cmd.__doc__ = f"{perf_mod.TITLES[test]} (like perftest's ib_{test.replace('-', '_')})."
    return cmd


for _test in perf_mod.TESTS:
    perf_app.command(_test)(_perf_command(_test))


# ---------------------------------------------------------------- pingpong (metaroce_xdp/cli/pingpong.py)
@app.command("pingpong")
def pingpong_cmd(
    server: Optional[str] = typer.Argument(None, metavar="[HOST]", help="server to connect to (client side)"),
    ifname: str = typer.Option(..., "-d", "--ib-dev", help="interface to run on (e.g. mr0)"),
    port: int = typer.Option(18515, "-p", "--port", help="listen on/connect to this TCP port"),
    ib_port: int = typer.Option(1, "-i", "--ib-port", help="accepted for compatibility (one port)"),
    size: int = typer.Option(4096, "-s", "--size", help="size of message to exchange"),
    mtu: int = typer.Option(1024, "-m", "--mtu", help="path MTU"),
    rx_depth: int = typer.Option(500, "-r", "--rx-depth", help="number of receives to post at a time"),
    iters: int = typer.Option(1000, "-n", "--iters", help="number of exchanges"),
    sl: int = typer.Option(0, "-l", "--sl", help="accepted for compatibility (no service levels)"),
    gid_idx: int = typer.Option(-1, "-g", "--gid-idx", help="accepted for compatibility: the GID is always "
                                "the interface's IP address"),
    timeout: float = typer.Option(60.0, "--timeout", help="give up after this many seconds without a completion"),
    no_daemon: bool = typer.Option(False, "--no-daemon", help="own engine even when metaroced serves the interface"),
    sock: Optional[str] = typer.Option(None, "--socket", help="metaroced's control socket (default: "
                                       "$METAROCE_SOCKET, the configuration's, /run/metaroce/metaroced.sock)"),
    plane: str = typer.Option("compiled", "--plane", help="in-process data plane: compiled (metaroce_xdp.dp, the "
                              "endpoint applications get; the only choice); compat RoCEv2"),
    as_json: bool = typer.Option(False, "--json", "-j", help="one JSON summary object on stdout (rc_pingpong's "
                                 "lines then go to stderr)"),
) -> None:
    """ibv_rc_pingpong on a MetaRoCE endpoint: same options, exchange, traffic and output (through metaroced
    when it serves the interface)."""
    opt = pingpong_mod.PingpongOptions(ifname, server, port, size, mtu, rx_depth, iters, gid_idx, timeout,
                                       no_daemon, sock, plane)
    try:
        res = pingpong_mod.run(opt, sys.stderr if as_json else sys.stdout)
        if as_json:
            typer.echo(json.dumps(pingpong_mod.summary(res)))
    except pingpong_mod.PingpongError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(1)
    except KeyboardInterrupt:
        raise typer.Exit(130)


@app.command("warmup")
def warmup_cmd(
    quiet: bool = typer.Option(False, "-q", "--quiet", help="only the summary line"),
    as_json: bool = typer.Option(False, "--json", "-j", help="one JSON object: every entry point, where it came "
                                 "from (compiled or the cache) and how long it took"),
) -> None:
    """Compile the data path's numba functions into numba's on-disk cache (`make setup` runs it).

    Every function is called once with the argument types its run-time caller passes, so an
    endpoint never compiles while its QPs are live (a cold compile outlasts the peer's ACK timeout)."""
    from metaroce_xdp import jitwarm

    echo = (lambda s: None) if quiet or as_json else typer.echo
    if not jitwarm.JIT_ENABLED:
        typer.echo("metaroce warmup: NUMBA_DISABLE_JIT is set, nothing to compile")
        return
    echo(f"metaroce warmup: planes {', '.join(jitwarm.PLANES)} (the compiled plane compiles at import: "
         "3-4 minutes of CPU when the cache is cold)")
    try:
        rep = jitwarm.warm_up(echo, cold_notice=lambda msg: echo("  cache cold: compiling"))
    except Exception as e:                             # a numba or LLVM failure: say which and stop setup
        typer.echo(f"error: compiling the data path failed: {type(e).__name__}: {e}", err=True)
        raise typer.Exit(1)
    if as_json:
        typer.echo(json.dumps({"schema": "metaroce-warmup/1", "compiled": rep.compiled, "entry_points": len(rep.entries),
                               "seconds": round(rep.seconds, 3), "cache_was_warm": rep.was_warm,
                               "cache_dir": rep.cache_dir, "compiled_at_import": rep.compiled_at_import,
                               "entries": [{"module": e.module, "name": e.name, "source": e.source,
                                            "seconds": round(e.seconds, 4)} for e in rep.entries]}))
        return
    if not quiet:
        per = rep.per_module()
        entry = {(e.module, e.name) for e in rep.entries}
        for mod in jitwarm.MODULES:
            inner = [n for m, n, _ in jitwarm.dispatchers() if m == mod and (m, n) not in entry]
            typer.echo(f"  {mod:<28} {per.get(mod, 0.0):7.2f} s" +
                       (f"   compiled into its callers: {', '.join(inner)}" if inner else ""))
    at_import = f" ({len(rep.compiled_at_import)} modules compiled at import)" if rep.compiled_at_import else ""
    typer.echo(f"metaroce warmup: {rep.compiled} of {len(rep.entries)} entry points compiled{at_import}, the rest "
               f"loaded from the cache, in {rep.seconds:.1f} s; cache was "
               f"{'warm' if rep.was_warm else 'cold' if rep.was_warm is False else 'unknown'} ({rep.cache_dir})")


# dev show, qp list/show (and the kernel view `qp -d DEV`), stat, top: metaroce_xdp/cli/daemon_cli.py
from . import daemon_cli  # noqa: E402

daemon_cli.register(app)


def main() -> None:
    app(prog_name="metaroce")


if __name__ == "__main__":
    main()
