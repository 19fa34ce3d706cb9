"""`metaroce dev show | qp list | qp show | stat | top`: live state of metaroced, through its control
socket (`status` op), with the kernel's view from the pinned maps where the daemon cannot answer.

    metaroce dev show                 # like ibv_devinfo: interface, MTU, GID table, capabilities, queues
    metaroce qp list                  # like rdma res show qp
    metaroce qp show 17               # one QP, `rdma res show qp lqpn 17` style (0x11 works too)
    metaroce stat                     # totals, the XDP program's counters incl. drop reasons, clients
    metaroce top                      # live, refreshed in place, sorted by throughput (q or Ctrl-C quits)
    metaroce qp list --kernel -d eth1 # the kernel's QP table from the pinned maps (also what `qp list -d eth1`
                                      # and `stat -d eth1` show when the daemon is stuck or gone, saying so)
    metaroce qp -d eth1               # the same, in the older form (a bare JSON list with --json)

Every command takes -j/--json (schemas: docs/daemon.md, "CLI JSON schema") and --socket PATH (default:
$METAROCE_SOCKET, else socket_path of /etc/metaroce/metaroced.toml, else /run/metaroce/metaroced.sock).
Exit status: 0 done; 1 an error (e.g. no such QP); 2 a usage error; 3 the daemon is unavailable (nothing on
the socket, or no answer within --timeout) -- one line on stderr.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional

import typer

from metaroce_xdp.daemon import status as st

SOCKET_OPT = typer.Option(None, "--socket", "-S", help="metaroced's control socket (default: $METAROCE_SOCKET, "
                          "else socket_path of /etc/metaroce/metaroced.toml, else /run/metaroce/metaroced.sock)")
JSON_OPT = typer.Option(False, "-j", "--json", help="JSON (schema in docs/daemon.md)")
TIMEOUT_OPT = typer.Option(5.0, "--timeout", help="seconds to wait for the daemon's answer")


def default_socket() -> str:
    env = os.environ.get("METAROCE_SOCKET")
    if env:
        return env
    from metaroce_xdp.daemon import config
    if os.path.exists(config.DEFAULT_PATH):
        try:
            return config.load_config(config.DEFAULT_PATH).socket_path
        except config.ConfigError:
            pass
    return config.DaemonConfig().socket_path


EXIT_ERROR, EXIT_USAGE, EXIT_UNAVAILABLE = 1, 2, 3      # as systemctl status: 3 is "not running"


def _fail(msg: str, code: int = EXIT_USAGE) -> typer.Exit:
    typer.echo(f"metaroce: {msg}", err=True)
    return typer.Exit(code)


def _status_fail(e: "st.StatusError") -> typer.Exit:
    """The daemon could not be asked (EXIT_UNAVAILABLE) or answered with an error (EXIT_ERROR)."""
    unavailable = isinstance(e, (st.DaemonNotRunning, st.DaemonNotAnswering))
    return _fail(str(e), EXIT_UNAVAILABLE if unavailable else EXIT_ERROR)


def _snapshot(sock: Optional[str], timeout: float) -> dict:
    try:
        return st.query_status(sock or default_socket(), timeout)
    except st.StatusError as e:
        raise _status_fail(e) from None


def _emit(doc: dict, as_json: bool, fmt) -> None:
    typer.echo(json.dumps(doc, indent=None if not sys.stdout.isatty() else 2) if as_json else fmt(doc))


# ------------------------------------------------------------------------------------------- dev
dev_app = typer.Typer(no_args_is_help=True, help="Devices (interfaces) metaroced owns.")


@dev_app.command("show")
def dev_show(dev: Optional[str] = typer.Argument(None, metavar="[DEV]", help="only this interface"),
             as_json: bool = JSON_OPT, sock: Optional[str] = SOCKET_OPT, timeout: float = TIMEOUT_OPT) -> None:
    """Interface, MTU, GID table, capabilities and queues (like ibv_devinfo)."""
    snap = _snapshot(sock, timeout)
    try:
        doc = st.dev_doc(snap, dev)
    except st.StatusError as e:
        raise _status_fail(e) from None
    _emit(doc, as_json, st.format_dev)


# -------------------------------------------------------------------------------------------- qp
qp_app = typer.Typer(invoke_without_command=True,
                     help="Queue pairs: `qp list`, `qp show QPN` (daemon); `qp -d DEV` (kernel view).")


def _kernel_rows(dev: str, pin_dir: Optional[str]) -> list[dict]:
    from . import qpstat
    try:
        return qpstat.read_qps(dev, pin_dir)
    except (qpstat.StatError, OSError) as e:
        raise _fail(str(e), EXIT_ERROR) from None


@qp_app.callback()
def qp_root(ctx: typer.Context,
            dev: Optional[str] = typer.Option(None, "-d", "--dev", help="(without a subcommand) the kernel's QP "
                                              "table of this interface, from the pinned maps"),
            as_json: bool = typer.Option(False, "--json", "-j", help="(without a subcommand) a JSON list"),
            pin_dir: Optional[str] = typer.Option(None, "--pin-dir", help="read the maps pinned here instead"),
            sock: Optional[str] = SOCKET_OPT) -> None:
    """Queue pairs: `qp list`, `qp show QPN` (metaroced's view); `qp -d DEV` (the kernel's view)."""
    if ctx.invoked_subcommand is not None:
        return
    if dev is None:                              # plain `metaroce qp`: the daemon's list
        ctx.invoke(qp_list, dev=None, as_json=as_json, sock=sock, timeout=5.0, kernel=False, pin_dir=None)
        return
    from . import qpstat
    rows = _kernel_rows(dev, pin_dir)
    typer.echo(json.dumps(rows) if as_json else qpstat.format_qps(rows))


@qp_app.command("list")
def qp_list(dev: Optional[str] = typer.Option(None, "-d", "--dev", help="only QPs on this interface"),
            as_json: bool = JSON_OPT, sock: Optional[str] = SOCKET_OPT, timeout: float = TIMEOUT_OPT,
            kernel: bool = typer.Option(False, "--kernel", "-k", help="the kernel's view from the pinned maps "
                                        "(needs -d; works while the daemon is stuck or stopped)"),
            pin_dir: Optional[str] = typer.Option(None, "--pin-dir", help="with --kernel: maps pinned here")) -> None:
    """QPs with state, peer, PSNs, outstanding WRs, retransmissions, bytes and owner (like rdma res show qp).
    With -d DEV and a daemon that is not running or not answering, the kernel's QP table of DEV."""
    if not kernel:
        try:
            snap = st.query_status(sock or default_socket(), timeout)
        except (st.DaemonNotRunning, st.DaemonNotAnswering) as e:
            if dev is None:
                raise _status_fail(e) from None
            typer.echo(f"metaroce: {e}; showing the kernel's QP table of {dev}", err=True)
            kernel = True
        except st.StatusError as e:
            raise _status_fail(e) from None
    if kernel:
        if dev is None:
            raise _fail("--kernel needs -d DEV (the pinned maps are per interface)")
        doc = st.kernel_qp_list_doc(_kernel_rows(dev, pin_dir), dev)
        if as_json:
            typer.echo(json.dumps(doc))
        else:
            from . import qpstat
            typer.echo(f"(kernel view of {dev}, from the pinned maps)\n" + qpstat.format_qps(doc["qps"]))
        return
    _emit(st.qp_list_doc(snap, dev), as_json, st.format_qp_list)


@qp_app.command("show")
def qp_show(qpn: str = typer.Argument(..., help="QP number, decimal or 0x..."),
            dev: Optional[str] = typer.Option(None, "-d", "--dev", help="interface (when the QPN is on several)"),
            as_json: bool = JSON_OPT, sock: Optional[str] = SOCKET_OPT, timeout: float = TIMEOUT_OPT) -> None:
    """One QP in detail (like `rdma res show qp lqpn QPN`)."""
    try:
        n = st.parse_qpn(qpn)
        doc = st.qp_doc(_snapshot(sock, timeout), n, dev)
    except st.QpNotFound as e:
        raise _fail(str(e), EXIT_ERROR) from None
    except st.StatusError as e:
        raise _status_fail(e) from None
    _emit(doc, as_json, st.format_qp)


# ------------------------------------------------------------------------------------------ stat
def stat_cmd(dev: Optional[str] = typer.Option(None, "-d", "--dev", help="only this interface"),
             as_json: bool = JSON_OPT, sock: Optional[str] = SOCKET_OPT, timeout: float = TIMEOUT_OPT,
             kernel: bool = typer.Option(False, "--kernel", "-k", help="the XDP program's counters from the pinned "
                                         "maps (needs -d)"),
             pin_dir: Optional[str] = typer.Option(None, "--pin-dir", help="read the maps pinned here (implies "
                                                   "--kernel)")) -> None:
    """Counters: QP totals, the XDP program's events and drops by named reason, clients.  With -d DEV and a
    daemon that is not running or not answering, the kernel's counters of DEV from the pinned maps."""
    if not kernel and pin_dir is None:
        try:
            snap = st.query_status(sock or default_socket(), timeout)
        except (st.DaemonNotRunning, st.DaemonNotAnswering) as e:
            if dev is None:
                raise _status_fail(e) from None
            typer.echo(f"metaroce: {e}; showing the kernel's counters of {dev}", err=True)
        except st.StatusError as e:
            raise _status_fail(e) from None
        else:
            _emit(st.stat_doc(snap, dev), as_json, st.format_stat)
            return
    if dev is None:
        raise _fail("--kernel needs -d DEV (the pinned maps are per interface)")
    from . import qpstat
    try:
        c = qpstat.read_counters(dev, pin_dir)
    except (qpstat.StatError, OSError) as e:
        raise _fail(str(e), EXIT_ERROR) from None
    if as_json:
        typer.echo(json.dumps({"schema": st.schema("kernel-stat"), "source": "kernel", "dev": dev, **c}))
    else:
        typer.echo(f"(kernel view of {dev}, from the pinned maps)\n" + qpstat.format_counters(c))


# ------------------------------------------------------------------------------------------- top
def top_cmd(dev: Optional[str] = typer.Option(None, "-d", "--dev", help="only QPs on this interface"),
            interval: float = typer.Option(1.0, "-i", "--interval", help="seconds between refreshes"),
            iterations: int = typer.Option(0, "-n", "--iterations", help="stop after N refreshes (0: until Ctrl-C)"),
            as_json: bool = JSON_OPT, sock: Optional[str] = SOCKET_OPT, timeout: float = TIMEOUT_OPT) -> None:
    """Live QP view, refreshed in place, sorted by throughput (from the byte counters' deltas).  When
    stdout is not a terminal: the table as text, once per refresh; with --json: one JSON object per
    refresh (JSON Lines)."""
    if interval <= 0:
        raise _fail("--interval must be > 0")
    try:
        conn = st.StatusConnection(sock or default_socket(), timeout)
    except st.StatusError as e:
        raise _status_fail(e) from None

    def sample() -> tuple[dict, float]:
        try:
            return conn.ask(), time.monotonic()
        except st.StatusError as e:
            raise _status_fail(e) from None

    prev, t_prev = sample()
    live = None
    if not as_json and sys.stdout.isatty():
        from rich.console import Console
        from rich.live import Live
        live = Live(console=Console(), auto_refresh=False, transient=False)
        live.start()
    n = 0
    try:
        while iterations <= 0 or n < iterations:
            time.sleep(max(0.0, interval - (time.monotonic() - t_prev)))
            cur, t_cur = sample()
            doc = st.top_doc(prev, cur, t_cur - t_prev, dev)
            prev, t_prev = cur, t_cur
            n += 1
            if live is not None:
                d = doc
                title = (f"metaroce top -- {len(d['qps'])} QPs, every {interval:g} s "
                         f"({time.strftime('%H:%M:%S')}; Ctrl-C quits)")
                live.update(st.top_table(d, title), refresh=True)
            elif as_json:
                typer.echo(json.dumps(doc))
                sys.stdout.flush()
            else:
                typer.echo(st.top_table_text(doc))
                sys.stdout.flush()
    except KeyboardInterrupt:
        pass
    finally:
        conn.close()
        if live is not None:
            live.stop()


def register(app: typer.Typer) -> None:
    """Add dev, qp, stat and top to the `metaroce` app (metaroce_xdp/cli/main.py)."""
    app.add_typer(dev_app, name="dev")
    app.add_typer(qp_app, name="qp")
    app.command("stat")(stat_cmd)
    app.command("top")(top_cmd)
