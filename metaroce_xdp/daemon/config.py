"""metaroced's configuration: a TOML file (`/etc/metaroce/metaroced.toml`) whose every option is also a
command-line flag (`--socket-path` for `socket_path`, ...).  The defaults are those of `DaemonConfig`; the
file installed by `make install`, daemon/metaroced.toml, lists every option with its default and meaning
(tests/daemon/test_daemon_service.py checks that the two agree).  Errors are `ConfigError`, naming the option."""
from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any

from ..verbs_types import InvalidArgument

DEFAULT_PATH = "/etc/metaroce/metaroced.toml"


class ConfigError(InvalidArgument):
    """The configuration file or a flag is wrong: names the option and what is allowed.  `option` is
    the option's name (None when the error is not about one option, e.g. an unreadable file)."""

    def __init__(self, msg: str, option: str | None = None):
        super().__init__(msg)
        self.option = option


@dataclass
class DaemonConfig:
    interfaces: list[str] = field(default_factory=list)   # interfaces the daemon owns (XDP + AF_XDP per RX queue)
    rx_queues: int = 0                                    # RX queues served from 0 on (0: every one the interface has)
    socket_path: str = "/run/metaroce/metaroced.sock"     # Unix socket applications connect to
    socket_group: str | None = None                       # group allowed besides root (None: root only)
    socket_mode: int = 0o660
    bpffs_prefix: str = "/sys/fs/bpf/metaroce"            # pins live under <prefix>/<ifname>/
    progress: str = "busy"                                # busy | sleep (poll() on the socket + eventfd)
    busy_idle_ms: int = 1000                              # busy: sleep as `sleep` does after this long idle (0: never)
    max_clients: int = 64
    max_qps_per_client: int = 256
    max_native_qps_per_client: int = 4                    # of an interface's 16 native slots (native/plane_slot.py NSLOT)
    max_mr_bytes_per_client: int = 1 << 30
    cm_port: int = 18515                                  # TCP port of connection set-up (spec 06)
    metrics_listen: str | None = None                     # "127.0.0.1:9462" serves Prometheus; None: off
    metrics_per_qp: bool = False                          # /metrics with per-QP and per-client series (peers, PSNs)
    watchdog: bool = True                                 # send WATCHDOG=1 when systemd asks for it
    drain_timeout_s: float = 5.0                          # SIGTERM: how long outstanding work may finish
    log_level: str = "info"
    profile: str = "auto"                                 # native | compat | auto: the profiles its QPs may run
    credit_budget: int = 1024                             # native receiver: packets granted over all senders (MR-CC-018)
    # idle rounds the loop spins before it sleeps (progress = sleep): fewer than in process (tunables.py's
    # 2000, ~1-2 ms) -- a client on the same core would wait behind the spinning
    spin_idle: int = 200
    max_pending_events: int = 1024                        # events queued for one client before EVENTS_LOST
    # native READ responses' shared rate per interface, Mb/s (MR-CC-021): {ifname or "*": Mb/s}; empty: the
    # interface's speed (METAROCE_READ_RATE_MBPS when set); 0: not paced
    read_rate_mbps: dict[str, float] = field(default_factory=dict)

    def read_rate_bps(self, ifname: str) -> float | None:
        """The READ response rate configured for `ifname`, bits/s (its own entry, else "*"), or None: the
        data plane's default (METAROCE_READ_RATE_MBPS, else the interface's speed)."""
        mbps = self.read_rate_mbps.get(ifname, self.read_rate_mbps.get("*"))
        return None if mbps is None else float(mbps) * 1e6

    def validate(self) -> "DaemonConfig":
        if self.progress not in ("busy", "sleep"):
            raise ConfigError(f"progress must be 'busy' or 'sleep', not {self.progress!r}", "progress")
        if not 0 <= self.busy_idle_ms <= 3_600_000:
            raise ConfigError(f"busy_idle_ms must be 0 (spin while any QP exists) .. 3600000 ms, not "
                              f"{self.busy_idle_ms!r}", "busy_idle_ms")
        for name in ("max_clients", "max_qps_per_client", "max_mr_bytes_per_client"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, not {getattr(self, name)!r}", name)
        if not 0 <= self.max_native_qps_per_client <= 16:
            raise ConfigError(f"max_native_qps_per_client must be 0 (no native QPs) .. 16 (an interface's native "
                              f"slots), not {self.max_native_qps_per_client!r}", "max_native_qps_per_client")
        if not 0 < self.cm_port < 65536:
            raise ConfigError(f"cm_port must be 1..65535, not {self.cm_port!r}", "cm_port")
        if not 0 <= self.socket_mode <= 0o777:
            raise ConfigError(f"socket_mode must be an octal permission, not {self.socket_mode!r}", "socket_mode")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level must be debug|info|warning|error, not {self.log_level!r}", "log_level")
        if self.profile not in ("native", "compat", "auto"):
            raise ConfigError(f"profile must be native, compat or auto, not {self.profile!r}", "profile")
        if not 0 <= self.spin_idle <= 1_000_000:
            raise ConfigError(f"spin_idle must be 0..1000000 rounds, not {self.spin_idle!r}", "spin_idle")
        if not 1 <= self.max_pending_events <= 1 << 20:
            raise ConfigError(f"max_pending_events must be 1..1048576, not {self.max_pending_events!r}",
                              "max_pending_events")
        if not 0 <= self.rx_queues <= 64:
            raise ConfigError(f"rx_queues must be 0 (every RX queue) .. 64, not {self.rx_queues!r}", "rx_queues")
        if not 0 <= self.credit_budget <= 65535:
            raise ConfigError(f"credit_budget must be 0..65535 packets, not {self.credit_budget!r}", "credit_budget")
        for ifname, mbps in self.read_rate_mbps.items():
            if not isinstance(mbps, (int, float)) or isinstance(mbps, bool) or not 0 <= mbps <= 10_000_000:
                raise ConfigError(f"read_rate_mbps[{ifname!r}] must be 0 (not paced) .. 10000000 Mb/s, not {mbps!r}",
                                  "read_rate_mbps")
        if self.drain_timeout_s < 0:
            raise ConfigError(f"drain_timeout_s must be >= 0, not {self.drain_timeout_s!r}", "drain_timeout_s")
        if self.metrics_listen is not None:
            host, _, port = self.metrics_listen.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"metrics_listen must be HOST:PORT, not {self.metrics_listen!r}", "metrics_listen")
            if not 0 < int(port) < 65536:
                raise ConfigError(f"metrics_listen's port must be 1..65535, not {port}", "metrics_listen")
        if self.socket_group is not None:
            import grp
            try:
                grp.getgrnam(self.socket_group)
            except KeyError:
                raise ConfigError(f"socket_group: no group named {self.socket_group!r} on this host",
                                  "socket_group") from None
        if not self.socket_path.startswith("/"):
            raise ConfigError(f"socket_path must be an absolute path, not {self.socket_path!r}", "socket_path")
        if not self.bpffs_prefix.startswith("/"):
            raise ConfigError(f"bpffs_prefix must be an absolute path, not {self.bpffs_prefix!r}", "bpffs_prefix")
        return self


FIELDS = {f.name: f for f in dataclasses.fields(DaemonConfig)}


def _coerce(name: str, value: Any) -> Any:
    default = getattr(DaemonConfig(), name)
    if name == "interfaces":
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"interfaces must be a list of interface names, not {value!r}", name)
        return value
    if name == "read_rate_mbps":
        return _read_rates(value)
    if name == "socket_mode" and isinstance(value, str):
        try:
            return int(value, 8)
        except ValueError:
            raise ConfigError(f"socket_mode must be octal, not {value!r}", name) from None
    if isinstance(default, bool):
        if isinstance(value, str):
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ConfigError(f"{name} must be true or false, not {value!r}", name)
            return value.lower() in ("true", "1", "yes")
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, not {value!r}", name)
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or isinstance(value, float):
            raise ConfigError(f"{name} must be an integer, not {value!r}", name)
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name} must be an integer, not {value!r}", name) from None
    if isinstance(default, float):
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name} must be a number, not {value!r}", name) from None
    if isinstance(value, str) and value == "" and default is None:
        return None                               # "" on the command line or in the file: off
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{name} must be a string, not {value!r}", name)
    return value


def _read_rates(value: Any) -> dict[str, float]:
    """read_rate_mbps as {ifname or "*": Mb/s}: from a number (every interface), a TOML table
    ({ eth0 = 25000, "*" = 10000 }) or a flag's text ("25000", "eth0=25000,eth1=10000", "eth0=25000,*=1000")."""
    bad = ConfigError(f"read_rate_mbps must be Mb/s for every interface (10000), per interface "
                      f"(eth0=25000,eth1=10000 or a table), or both (eth0=25000,*=10000), not {value!r}",
                      "read_rate_mbps")
    if isinstance(value, bool):
        raise bad
    if isinstance(value, (int, float)):
        value = {"*": value}
    elif isinstance(value, str):
        out: dict[str, Any] = {}
        for item in (v.strip() for v in value.split(",")):
            if not item:
                continue
            name, eq, num = item.rpartition("=")
            try:
                out[name.strip() if eq else "*"] = float(num)
            except ValueError:
                raise bad from None
        value = out
    if not isinstance(value, dict) or not all(isinstance(k, str) and k for k in value):
        raise bad
    for v in value.values():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise bad
    return {k: float(v) for k, v in value.items()}


def load_config(path: str | None = None, overrides: dict[str, Any] | None = None) -> DaemonConfig:
    """The file at `path` (DEFAULT_PATH if it exists when None), then `overrides` (flags) on top."""
    values: dict[str, Any] = {}
    if path is None and os.path.exists(DEFAULT_PATH):
        path = DEFAULT_PATH
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read {path}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: {e}") from None
        data = data.get("metaroced", data)      # options may sit under a [metaroced] table
        for k, v in data.items():
            if k not in FIELDS:
                raise ConfigError(f"{path}: unknown option {k!r} (known: {', '.join(FIELDS)})", k)
            values[k] = _coerce(k, v)
    for k, v in (overrides or {}).items():
        if v is None:
            continue
        if k not in FIELDS:
            raise ConfigError(f"unknown option {k!r}", k)
        values[k] = _coerce(k, v)
    return DaemonConfig(**values).validate()


def diff(old: DaemonConfig, new: DaemonConfig) -> list[str]:
    """Names of the options whose values differ between two configurations, in declaration order."""
    return [n for n in FIELDS if getattr(old, n) != getattr(new, n)]


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_value(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_toml(cfg: DaemonConfig) -> str:
    """The configuration as a TOML file that load_config reads back to the same values (options that
    are None, i.e. off, are written as comments)."""
    lines = ["[metaroced]"]
    for n in FIELDS:
        v = getattr(cfg, n)
        if v is None:
            lines.append(f"# {n} = (off)")
        elif n == "socket_mode":
            lines.append(f'{n} = "{v:04o}"')
        else:
            lines.append(f"{n} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"
