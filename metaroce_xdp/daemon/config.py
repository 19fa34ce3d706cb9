"""metaroced's configuration: a TOML file (`/etc/metaroce/metaroced.toml`) whose every option is also a
command-line flag.  Defaults are documented in `DEFAULTS_TOML` (installed as the default file)."""
from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any

from ..verbs_types import InvalidArgument

DEFAULT_PATH = "/etc/metaroce/metaroced.toml"


class ConfigError(InvalidArgument):
    """The configuration file or a flag is wrong: names the option and what is allowed."""


@dataclass
class DaemonConfig:
    interfaces: list[str] = field(default_factory=list)   # interfaces the daemon owns (XDP + AF_XDP per RX queue)
    socket_path: str = "/run/metaroce/metaroced.sock"     # Unix socket applications connect to
    socket_group: str | None = None                       # group allowed besides root (None: root only)
    socket_mode: int = 0o660
    bpffs_prefix: str = "/sys/fs/bpf/metaroce"            # pins live under <prefix>/<ifname>/
    progress: str = "busy"                                # busy | sleep (poll() on the socket + eventfd)
    max_clients: int = 64
    max_qps_per_client: int = 256
    max_mr_bytes_per_client: int = 1 << 30
    cm_port: int = 18515                                  # TCP port of connection set-up (spec 06)
    metrics_listen: str | None = None                     # "127.0.0.1:9462" serves Prometheus; None: off
    watchdog: bool = True                                 # send WATCHDOG=1 when systemd asks for it
    drain_timeout_s: float = 5.0                          # SIGTERM: how long outstanding work may finish
    log_level: str = "info"

    def validate(self) -> "DaemonConfig":
        if self.progress not in ("busy", "sleep"):
            raise ConfigError(f"progress must be 'busy' or 'sleep', not {self.progress!r}")
        for name in ("max_clients", "max_qps_per_client", "max_mr_bytes_per_client"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, not {getattr(self, name)!r}")
        if not 0 < self.cm_port < 65536:
            raise ConfigError(f"cm_port must be 1..65535, not {self.cm_port!r}")
        if not 0 <= self.socket_mode <= 0o777:
            raise ConfigError(f"socket_mode must be an octal permission, not {self.socket_mode!r}")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level must be debug|info|warning|error, not {self.log_level!r}")
        if self.drain_timeout_s < 0:
            raise ConfigError("drain_timeout_s must be >= 0")
        if self.metrics_listen is not None:
            host, _, port = self.metrics_listen.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"metrics_listen must be HOST:PORT, not {self.metrics_listen!r}")
        return self


FIELDS = {f.name: f for f in dataclasses.fields(DaemonConfig)}


def _coerce(name: str, value: Any) -> Any:
    default = getattr(DaemonConfig(), name)
    if name == "interfaces":
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError("interfaces must be a list of interface names")
        return value
    if name == "socket_mode" and isinstance(value, str):
        try:
            return int(value, 8)
        except ValueError:
            raise ConfigError(f"socket_mode must be octal, not {value!r}") from None
    if isinstance(default, bool):
        if isinstance(value, str):
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ConfigError(f"{name} must be true or false, not {value!r}")
            return value.lower() in ("true", "1", "yes")
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, not {value!r}")
        return value
    if isinstance(default, int):
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name} must be an integer, not {value!r}") from None
    if isinstance(default, float):
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name} must be a number, not {value!r}") from None
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{name} must be a string, not {value!r}")
    return value


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
                raise ConfigError(f"{path}: unknown option {k!r} (known: {', '.join(FIELDS)})")
            values[k] = _coerce(k, v)
    for k, v in (overrides or {}).items():
        if v is None:
            continue
        if k not in FIELDS:
            raise ConfigError(f"unknown option {k!r}")
        values[k] = _coerce(k, v)
    return DaemonConfig(**values).validate()
