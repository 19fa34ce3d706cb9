"""metaroced, the process: flags, logging, signals and systemd notifications around `server.Daemon`.

    metaroced --interfaces eth1 [--config /etc/metaroce/metaroced.toml] [--socket-path ...] ...
    metaroced --print-config ...        # the effective configuration as TOML, then exit
    python -m metaroce_xdp.daemon ...    # the same, from a source tree

Every DaemonConfig option is a flag (`--socket-path` for `socket_path`; `--watchdog/--no-watchdog`
for booleans; `--metrics-listen ''` turns an option that the file set back off); flags win over
the file.  Exit status: 0 after a clean stop (SIGTERM, SIGINT), 1 when the daemon fails to start
or dies, 2 for a configuration error (one line naming the option; systemd does not restart it:
RestartPreventExitStatus=2 in the unit).

Signals: SIGTERM and SIGINT stop (STOPPING=1, drain for drain_timeout_s, flush, detach, exit 0);
SIGUSR1 writes every thread's stack to stderr (a stuck daemon); SIGHUP re-reads the file (the flags given at start still win), applies what can change while
running and logs each option changed and each one that needs a restart (RELOADING=1 ... READY=1).

Logging goes to stderr, one line per event (a traceback is folded into that line).  Under systemd
(`$JOURNAL_STREAM` names our stderr) each line starts with its syslog priority, `<3>` ... `<7>`, and
journald keeps the level; on a terminal the level is coloured; anywhere else it is plain text.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

from . import config as config_mod
from .config import ConfigError, DaemonConfig, load_config
from ..version import VersionAction
from .notify import Notifier
from .startup import StartClock, prebuild_xdp

log = logging.getLogger("metaroced")

EXIT_OK, EXIT_FAILURE, EXIT_CONFIG = 0, 1, 2

# Options the service layer (this module and metrics.py) applies itself on SIGHUP; the rest go to
# Daemon.reload, which raises ConfigError for those that cannot change while it runs.
SERVICE_OPTIONS = ("log_level", "metrics_listen", "metrics_per_qp", "watchdog", "drain_timeout_s")

STATUS_EVERY_S = 2.0


# ------------------------------------------------------------------------------------------- logging
_PRIO = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}
_COLOUR = {logging.DEBUG: "\033[2m", logging.WARNING: "\033[33m", logging.ERROR: "\033[31m",
           logging.CRITICAL: "\033[1;31m"}


def journal_stream_is(fd: int, env: dict | None = None) -> bool:
    """True when `fd` is the stream systemd connected to the journal ($JOURNAL_STREAM = dev:inode)."""
    value = (os.environ if env is None else env).get("JOURNAL_STREAM", "")
    dev, _, ino = value.partition(":")
    if not dev.isdigit() or not ino.isdigit():
        return False
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return st.st_dev == int(dev) and st.st_ino == int(ino)


class LineFormatter(logging.Formatter):
    """One line per record.  mode: 'journal' (`<prio>message`: journald stamps time and unit),
    'tty' (time, coloured level, message) or 'plain' (time, level, message; no escape codes)."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if record.exc_info:
            msg += " | " + self.formatException(record.exc_info)
        msg = " | ".join(part for part in msg.splitlines() if part.strip()) or msg
        if self.mode == "journal":
            return f"<{_PRIO.get(record.levelno, 6)}>{msg}"
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        level = record.levelname.lower()
        if self.mode == "tty" and record.levelno in _COLOUR:
            level = f"{_COLOUR[record.levelno]}{level}\033[0m"
        return f"{stamp} {level} {msg}"


def log_mode(stream=None, env: dict | None = None) -> str:
    stream = sys.stderr if stream is None else stream
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return "plain"
    if journal_stream_is(fd, env):
        return "journal"
    return "tty" if os.isatty(fd) else "plain"


def setup_logging(level: str, stream=None) -> logging.Handler:
    """metaroced's handler on the 'metaroced' and 'metaroce_xdp' loggers (replacing an earlier one)."""
    stream = sys.stderr if stream is None else stream
    handler = logging.StreamHandler(stream)
    handler.setFormatter(LineFormatter(log_mode(stream)))
    handler.set_name("metaroced")
    for name in ("metaroced", "metaroce_xdp"):
        lg = logging.getLogger(name)
        for h in list(lg.handlers):
            if h.get_name() == "metaroced":
                lg.removeHandler(h)
        lg.addHandler(handler)
        lg.setLevel(level.upper())
        lg.propagate = False
    return handler


def set_log_level(level: str) -> None:
    for name in ("metaroced", "metaroce_xdp"):
        logging.getLogger(name).setLevel(level.upper())


# --------------------------------------------------------------------------------------------- flags
_HELP = {
    "interfaces": "interfaces to own, comma-separated or repeated (XDP program + one AF_XDP socket per RX queue)",
    "rx_queues": "RX queues served on each interface from queue 0 (0: every one it has, as RSS needs)",
    "socket_path": "Unix socket applications connect to",
    "socket_group": "group allowed on the socket besides root ('' for root only)",
    "socket_mode": "permissions of the socket, octal",
    "bpffs_prefix": "bpffs directory under which each interface's maps are pinned (<prefix>/<ifname>/)",
    "progress": "how the data-plane threads wait for work: busy (spin) or sleep (poll)",
    "busy_idle_ms": "busy mode: after this many ms without work a data-plane thread sleeps as in sleep mode "
                    "until the next packet or post (0: spin while the interface has any QP)",
    "max_clients": "most client processes served at once",
    "max_qps_per_client": "most QPs one client may create",
    "max_mr_bytes_per_client": "most bytes one client may register",
    "cm_port": "TCP port of connection set-up (spec 06)",
    "metrics_listen": "HOST:PORT of the Prometheus endpoint ('' or unset: off)",
    "metrics_per_qp": "the Prometheus endpoint also shows each QP (peer address, remote QPN, PSNs, owner) and "
                      "each client: to whoever reaches it, every tenant's (off: per-device aggregates only)",
    "watchdog": "answer systemd's watchdog (WATCHDOG=1 every WatchdogSec/2)",
    "drain_timeout_s": "on SIGTERM, seconds outstanding work may take to finish before it is flushed",
    "log_level": "debug, info, warning or error",
    "read_rate_mbps": "native READ responses' shared rate, Mb/s (MR-CC-021): N for every interface, IF=N[,IF=N] "
                      "per interface, *=N for the rest; 0: not paced (unset: the interface's speed)",
}


def flag_name(option: str) -> str:
    return "--" + option.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="metaroced", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="MetaRoCE daemon: hosts the data plane for other processes (see docs/daemon.md).",
        epilog=f"Options not given come from the configuration file ({config_mod.DEFAULT_PATH} when it exists),\n"
               "then from the built-in defaults.  SIGHUP reloads, SIGTERM drains and stops.")
    p.add_argument("-c", "--config", metavar="PATH",
                   help=f"configuration file (default: {config_mod.DEFAULT_PATH} if it exists)")
    p.add_argument("--print-config", action="store_true",
                   help="print the effective configuration as TOML and exit")
    p.add_argument("--version", action=VersionAction)
    defaults = DaemonConfig()
    for f in dataclasses.fields(DaemonConfig):
        default = getattr(defaults, f.name)
        helptext = _HELP.get(f.name, f.name)
        shown = f"{default:04o}" if f.name == "socket_mode" else default
        helptext += f" (default: {shown})" if default not in (None, [], {}) else ""
        if f.name == "interfaces":
            p.add_argument("-i", flag_name(f.name), dest=f.name, action="append", metavar="IFNAME[,IFNAME]",
                           help=helptext)
        elif isinstance(default, bool):
            p.add_argument(flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                           default=None, help=helptext)
        else:
            p.add_argument(flag_name(f.name), dest=f.name, metavar=f.name.upper(), help=helptext)
    return p


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in config_mod.FIELDS:
        v = getattr(args, name, None)
        if v is None:
            continue
        if name == "interfaces":
            v = [i for item in v for i in item.split(",") if i]
        out[name] = v
    return out


# ------------------------------------------------------------------------------------------- service
class Service:
    """Runs one Daemon: start, READY, run with a tick (watchdog, SIGHUP, STATUS), drain on stop.
    `daemon_factory` is server.Daemon (tests of this layer alone may pass another)."""

    def __init__(self, cfg: DaemonConfig, config_path: str | None, overrides: dict[str, Any],
                 notifier: Notifier | None = None, daemon_factory: Callable[[DaemonConfig], Any] | None = None,
                 clock: StartClock | None = None):
        self.cfg = cfg
        self.config_path = config_path
        self.overrides = overrides
        self.notifier = notifier or Notifier()
        self.daemon_factory = daemon_factory
        self.clock = clock or StartClock(from_exec=False)     # start-up phases (startup.py)
        self.daemon: Any = None
        self.metrics: Any = None
        self.stop = threading.Event()
        self._hup = threading.Event()
        self._status_at = 0.0
        self._stop_signal: str | None = None

    # signals: handlers only set flags; the work happens in tick() on the daemon's control thread
    def _on_stop(self, signum, frame) -> None:
        if not self.stop.is_set():
            self._stop_signal = signal.Signals(signum).name
        self.stop.set()

    def _on_hup(self, signum, frame) -> None:
        self._hup.set()

    def install_signals(self) -> None:
        import faulthandler
        faulthandler.register(signal.SIGUSR1, all_threads=True)     # a stuck daemon: where every thread is
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)

    def status_line(self) -> str:
        try:
            snap = self.daemon.snapshot()
        except Exception as e:                                   # a status line must never stop the daemon
            return f"serving (status unavailable: {type(e).__name__})"
        devs = ",".join(d.get("ifname", "?") for d in snap.get("devices", [])) or "no interface"
        qps = snap.get("qps", [])
        rts = sum(1 for q in qps if q.get("state") == "RTS")
        return (f"serving {devs}: {len(snap.get('clients', []))} clients, {len(qps)} QPs ({rts} RTS) "
                f"on {self.cfg.socket_path}")

    def tick(self) -> None:
        if self._hup.is_set():
            self._hup.clear()
            self.reload()
        if self.cfg.watchdog:
            self.notifier.ping_if_due()
        now = time.monotonic()
        if self.notifier.enabled and now - self._status_at >= STATUS_EVERY_S:
            self._status_at = now
            self.notifier.status(self.status_line())

    def reload(self) -> list[str]:
        """SIGHUP: re-read the file (start-up flags still win), apply what can change live.
        Returns the names of the options applied."""
        self.notifier.reloading("reloading configuration")
        log.info("SIGHUP: reloading %s", self.config_path or config_mod.DEFAULT_PATH)
        try:
            new = load_config(self.config_path, self.overrides)
        except ConfigError as e:
            log.error("reload refused, keeping the running configuration: %s", e)
            self.notifier.ready(f"reload refused: {e}")
            return []
        changed = config_mod.diff(self.cfg, new)
        if not changed:
            log.info("reload: configuration unchanged")
            self.notifier.ready(self.status_line())
            return []
        kept: list[str] = []
        candidate = new
        for _ in range(len(changed) + 1):
            try:
                self.daemon.reload(candidate)
                break
            except ConfigError as e:
                name = e.option if e.option in changed else next((n for n in changed if n in str(e)), None)
                if name is None or name in kept:
                    log.error("reload refused, keeping the running configuration: %s", e)
                    self.notifier.ready(f"reload refused: {e}")
                    return []
                log.warning("reload: %s cannot change while running (kept %r; restart metaroced to apply %r): %s",
                            name, getattr(self.cfg, name), getattr(new, name), e)
                kept.append(name)
                candidate = dataclasses.replace(candidate, **{name: getattr(self.cfg, name)})
        applied = [n for n in changed if n not in kept]
        old = self.cfg
        self.cfg = candidate
        for n in applied:
            log.info("reload: %s %r -> %r", n, getattr(old, n), getattr(candidate, n))
        if "log_level" in applied:
            set_log_level(candidate.log_level)
        if "metrics_listen" in applied or "metrics_per_qp" in applied:
            self._restart_metrics()
        self.notifier.ready(self.status_line())
        return applied

    def _start_metrics(self) -> None:
        if self.cfg.metrics_listen:
            from . import metrics
            self.metrics = metrics.serve(self.cfg.metrics_listen, self.daemon.snapshot, self.cfg.metrics_per_qp)
            log.info("metrics: Prometheus endpoint on http://%s/metrics%s", self.metrics.address,
                     " (per-QP series: every tenant's peers and PSNs)" if self.cfg.metrics_per_qp else "")

    def _restart_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        try:
            self._start_metrics()
        except OSError as e:
            log.error("metrics: cannot listen on %s: %s (endpoint off)", self.cfg.metrics_listen, e)

    def run(self) -> int:
        self.install_signals()
        clock = self.clock
        log.info("metaroced %s starting (pid %d): interfaces %s, socket %s", _version(), os.getpid(),
                 ",".join(self.cfg.interfaces) or "(none)", self.cfg.socket_path)
        self.notifier.status("starting")
        builds = None
        if self.daemon_factory is None:
            # BCC's compile first, in threads (outside the GIL), so that it overlaps numpy's and numba's imports
            builds = prebuild_xdp(self.cfg.interfaces, clock)
            from .server import Daemon
            self.daemon_factory = Daemon
        clock.mark("imports")
        try:
            self.daemon = self.daemon_factory(self.cfg)
            if builds is not None:
                self.daemon.start(clock, builds)  # phases marked on the clock; the loaders from the threads
            else:
                self.daemon.start()
            if self.cfg.metrics_listen:
                self._start_metrics()
                clock.mark("metrics")
        except Exception as e:
            if self.daemon is None:
                for b in (builds or {}).values():
                    b.discard()
            log.error("start failed: %s: %s", type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
            self.notifier.notify(STATUS=f"start failed: {type(e).__name__}: {e}".replace("\n", " "))
            self._close_quietly()
            return EXIT_CONFIG if isinstance(e, ConfigError) else EXIT_FAILURE
        status = self.status_line()
        log.info("ready in %.2f s: %s", clock.total(), status)
        log.info("start-up phases (s): %s", clock.text())
        self.notifier.ready(status)
        self._status_at = time.monotonic()
        if self.cfg.watchdog:
            self.notifier.ping_if_due()
        rc = EXIT_OK
        try:
            if not self.stop.is_set():
                self.daemon.run(self.stop, self.tick)
        except Exception as e:
            log.error("daemon failed: %s: %s", type(e).__name__, e, exc_info=True)
            rc = EXIT_FAILURE
        why = self._stop_signal or ("failure" if rc else "run() returned")
        log.info("%s: draining (up to %.1f s), then stopping", why, self.cfg.drain_timeout_s)
        self.notifier.stopping(f"stopping ({why}): draining")
        try:
            self.daemon.drain_and_stop(self.cfg.drain_timeout_s)
        except Exception as e:
            log.error("drain_and_stop failed: %s: %s", type(e).__name__, e, exc_info=True)
            rc = EXIT_FAILURE
        self._close_quietly(daemon=False)
        log.info("stopped (exit %d)", rc)
        return rc

    def _close_quietly(self, daemon: bool = True) -> None:
        if self.metrics is not None:
            try:
                self.metrics.close()
            except Exception:
                pass
            self.metrics = None
        if daemon and self.daemon is not None:
            try:
                self.daemon.drain_and_stop(0)
            except Exception:
                pass


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("metaroce-xdp")
    except Exception:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    clock = StartClock()                      # from the process's start: the "ready in" line counts it all
    args = build_parser().parse_args(argv)
    overrides = overrides_from(args)
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"metaroced: configuration error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if args.print_config:
        sys.stdout.write(config_mod.to_toml(cfg))
        return EXIT_OK
    setup_logging(cfg.log_level)
    notifier = Notifier(unset_environment=True)
    clock.mark("config")
    return Service(cfg, args.config, overrides, notifier, clock=clock).run()


if __name__ == "__main__":
    sys.exit(main())
