"""metaroced's Prometheus endpoint (off by default; `metrics_listen = "127.0.0.1:9462"` turns it on).

Each scrape of /metrics takes one Daemon.snapshot() and turns it into metric families (prometheus-client's
custom-collector API, on a registry of its own, so nothing global is touched).  Whoever reaches the endpoint
reads it: by default it shows per-device aggregates only; the series marked (per_qp) -- each QP's peer,
remote QPN, PSNs and owner, each client's pid and command, what `status` shows only to root -- come with
`metrics_per_qp = true`:

  metaroce_daemon_info{version}                          1
  metaroce_daemon_start_time_seconds                     when the daemon started (Unix time)
  metaroce_clients, metaroce_qps{dev,state}              gauges
  metaroce_refused_total{error}                          control requests refused, by typed error
  metaroce_clients_dropped_total{reason}                 clients the daemon disconnected, by reason
  metaroce_qp_info{dev,qpn,state,type,remote_qpn,remote_addr,owner_pid,owner_comm}   1 per QP   (per_qp)
  metaroce_qp_{tx,rx}_bytes_total{dev,qpn}               counters   (per_qp)
  metaroce_qp_retransmits_total, _naks_rx_total, _naks_tx_total, _rnr_total{dev,qpn}   (per_qp)
  metaroce_qp_outstanding_{send,recv}{dev,qpn}           gauges (work requests posted, not completed)   (per_qp)
  metaroce_qp_rate_bps{dev,qpn}                          gauge (congestion control's current rate)   (per_qp)
  metaroce_qp_{sq,rq}_psn{dev,qpn}                       gauges   (per_qp)
  metaroce_client_{qps,mrs,mr_bytes}{pid,uid,comm}       gauges   (per_qp)
  metaroce_xdp_drops_total{dev,reason}                   the XDP program's drops by named reason
  metaroce_xdp_events_total{dev,event}                   the XDP program's events (ACKs consumed, ...)
  metaroce_device_counter{dev,name}                      any other numeric device counter the daemon reports
  metaroced_process_cpu_seconds_total{mode}              user / system, psutil
  metaroced_process_resident_memory_bytes, _virtual_memory_bytes, _threads, _open_fds   psutil

A QP's metrics disappear with the QP (labels are per QPN: QPNs are reused slowly, 24 bits).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

import psutil
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest, start_http_server

__all__ = ["DaemonCollector", "MetricsServer", "serve", "render"]

_QP_COUNTERS = (("bytes_tx", "tx_bytes", "payload bytes sent"), ("bytes_rx", "rx_bytes", "payload bytes received"),
                ("retransmits", "retransmits", "packets retransmitted"),
                ("naks_rx", "naks_rx", "NAKs received"), ("naks_tx", "naks_tx", "NAKs sent"),
                ("rnr", "rnr", "RNR NAKs (receiver not ready)"))
_QP_GAUGES = (("outstanding_send", "outstanding_send", "send work requests posted and not completed"),
              ("outstanding_recv", "outstanding_recv", "receive work requests posted and not consumed"),
              ("rate_bps", "rate_bps", "current sending rate of congestion control, bits/s"),
              ("sq_psn", "sq_psn", "next PSN the send queue uses"),
              ("rq_psn", "rq_psn", "next PSN the receive queue expects"))


def _num(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return None


class DaemonCollector:
    """A prometheus-client collector over `snapshot` (Daemon.snapshot or anything returning its dict)."""

    def __init__(self, snapshot: Callable[[], dict], process: psutil.Process | None = None, per_qp: bool = False):
        self.snapshot = snapshot
        self.process = process or psutil.Process()
        self.per_qp = per_qp

    def describe(self):                       # no metrics at registration: register() must not call snapshot()
        return []

    def collect(self) -> Iterator:
        snap = self.snapshot()
        yield from self._daemon(snap)
        if self.per_qp:
            yield from self._qps(snap.get("qps", []))
            yield from self._clients(snap.get("clients", []))
        yield from self._devices(snap.get("devices", []))
        yield from self._process()

    def _daemon(self, snap: dict):
        d = snap.get("daemon", {})
        info = GaugeMetricFamily("metaroce_daemon_info", "metaroced's version", labels=["version"])
        info.add_metric([str(d.get("version", ""))], 1)
        yield info
        if _num(d.get("started")) is not None:
            yield GaugeMetricFamily("metaroce_daemon_start_time_seconds", "when metaroced started (Unix time)",
                                    value=_num(d["started"]))
        clients = d.get("clients", len(snap.get("clients", [])))
        yield GaugeMetricFamily("metaroce_clients", "client processes connected", value=_num(clients) or 0)
        by = {}
        for q in snap.get("qps", []):
            k = (str(q.get("dev", "")), str(q.get("state", "")))
            by[k] = by.get(k, 0) + 1
        g = GaugeMetricFamily("metaroce_qps", "QPs by device and state", labels=["dev", "state"])
        for (dev, state), n in sorted(by.items()):
            g.add_metric([dev, state], n)
        yield g
        for key, name, label, help_ in (("refused", "refused", "error", "control requests refused, by typed error"),
                                        ("clients_dropped", "clients_dropped", "reason",
                                         "clients the daemon disconnected, by reason")):
            c = CounterMetricFamily(f"metaroce_{name}", help_, labels=[label])
            for k, v in sorted((d.get(key) or {}).items()):
                if _num(v) is not None:
                    c.add_metric([str(k)], _num(v))
            yield c

    def _qps(self, qps: list[dict]):
        labels = ["dev", "qpn"]
        info = GaugeMetricFamily("metaroce_qp_info", "one per QP: its state, type, peer and owner",
                                 labels=["dev", "qpn", "state", "type", "remote_qpn", "remote_addr",
                                         "owner_pid", "owner_comm"])
        counters = {key: CounterMetricFamily(f"metaroce_qp_{name}", help_, labels=labels)
                    for key, name, help_ in _QP_COUNTERS}
        gauges = {key: GaugeMetricFamily(f"metaroce_qp_{name}", help_, labels=labels)
                  for key, name, help_ in _QP_GAUGES}
        for q in qps:
            lv = [str(q.get("dev", "")), str(q.get("qpn", ""))]
            owner = q.get("owner") or {}
            info.add_metric(lv + [str(q.get("state", "")), str(q.get("type", "")), str(q.get("remote_qpn", "")),
                                  str(q.get("remote_addr", "")), str(owner.get("pid", "")),
                                  str(owner.get("comm", ""))], 1)
            for key, fam in counters.items():
                v = _num(q.get(key))
                if v is not None:
                    fam.add_metric(lv, v)
            for key, fam in gauges.items():
                v = _num(q.get(key))
                if v is not None:
                    fam.add_metric(lv, v)
        yield info
        yield from counters.values()
        yield from gauges.values()

    def _clients(self, clients: list[dict]):
        fams = {k: GaugeMetricFamily(f"metaroce_client_{k}", h, labels=["pid", "uid", "comm"])
                for k, h in (("qps", "QPs a client holds"), ("mrs", "memory regions a client registered"),
                             ("mr_bytes", "bytes a client registered"))}
        for c in clients:
            lv = [str(c.get("pid", "")), str(c.get("uid", "")), str(c.get("comm", ""))]
            for k, fam in fams.items():
                v = _num(c.get(k))
                if v is not None:
                    fam.add_metric(lv, v)
        yield from fams.values()

    def _devices(self, devices: list[dict]):
        drops = CounterMetricFamily("metaroce_xdp_drops", "packets the XDP program dropped, by named reason",
                                    labels=["dev", "reason"])
        events = CounterMetricFamily("metaroce_xdp_events", "events of the XDP program (ACKs consumed, ...)",
                                     labels=["dev", "event"])
        other = GaugeMetricFamily("metaroce_device_counter", "other numeric device counters the daemon reports",
                                  labels=["dev", "name"])
        for d in devices:
            dev = str(d.get("ifname", ""))
            for group, value in (d.get("counters") or {}).items():
                if isinstance(value, dict):
                    fam = drops if group.endswith("drops") else events if group.endswith("events") else None
                    for name, n in value.items():
                        v = _num(n)
                        if v is None:
                            continue
                        if fam is None:
                            other.add_metric([dev, f"{group}.{name}"], v)
                        else:
                            fam.add_metric([dev, str(name).lower()], v)
                elif _num(value) is not None:
                    other.add_metric([dev, str(group)], _num(value))
        yield drops
        yield events
        yield other

    def _process(self):
        p = self.process
        with p.oneshot():
            cpu = p.cpu_times()
            mem = p.memory_info()
            threads = p.num_threads()
            try:
                fds = p.num_fds()
            except (psutil.Error, AttributeError):
                fds = None
        c = CounterMetricFamily("metaroced_process_cpu_seconds", "CPU time of metaroced (psutil)", labels=["mode"])
        c.add_metric(["user"], cpu.user)
        c.add_metric(["system"], cpu.system)
        yield c
        yield GaugeMetricFamily("metaroced_process_resident_memory_bytes", "resident memory (psutil)", value=mem.rss)
        yield GaugeMetricFamily("metaroced_process_virtual_memory_bytes", "virtual memory (psutil)", value=mem.vms)
        yield GaugeMetricFamily("metaroced_process_threads", "threads", value=threads)
        if fds is not None:
            yield GaugeMetricFamily("metaroced_process_open_fds", "open file descriptors", value=fds)


def registry_for(snapshot: Callable[[], dict], per_qp: bool = False) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(DaemonCollector(snapshot, per_qp=per_qp))
    return reg


def render(snapshot: Callable[[], dict], per_qp: bool = False) -> str:
    """The text exposition of one scrape (what GET /metrics answers)."""
    return generate_latest(registry_for(snapshot, per_qp)).decode()


def parse_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


class MetricsServer:
    """The HTTP endpoint (prometheus-client's server, in a daemon thread); `address` is HOST:PORT as bound."""

    def __init__(self, listen: str, snapshot: Callable[[], dict], per_qp: bool = False):
        host, port = parse_listen(listen)
        self.registry = registry_for(snapshot, per_qp)
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        bound = self._server.server_address
        self.address = f"[{bound[0]}]:{bound[1]}" if ":" in bound[0] else f"{bound[0]}:{bound[1]}"
        self._closed = threading.Event()

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._server.shutdown()
            self._server.server_close()


def serve(listen: str, snapshot: Callable[[], dict], per_qp: bool = False) -> MetricsServer:
    return MetricsServer(listen, snapshot, per_qp)
