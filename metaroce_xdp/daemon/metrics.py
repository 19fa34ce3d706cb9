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
  metaroce_qp_tx_rate_bytes_per_second{dev,qpn}          gauge (payload sent, over the last half second)   (per_qp)
  metaroce_qp_srtt_seconds{dev,qpn}                      gauge (smoothed RTT where measured: a native sender's;
                                                         compat QPs have none yet)   (per_qp)
  metaroce_qp_{sq,rq}_psn{dev,qpn}                       gauges   (per_qp)
  metaroce_client_{qps,mrs,mr_bytes}{pid,uid,comm}       gauges   (per_qp)
  metaroce_xdp_drops_total{dev,reason}                   the XDP program's drops by named reason
  metaroce_xdp_events_total{dev,event}                   the XDP program's events (ACKs consumed, ...)
  metaroce_plane_rx_drops_total{dev,reason}              frames the data plane dropped (icrc, qp, state, len, op)
  metaroce_plane_<counter>_total{dev}                    the data plane's other counters (PLANE_COUNTERS)
  metaroce_plane_<gauge>{dev}                            ... and its gauges (PLANE_GAUGES: last timeout's state)
  metaroce_driver_<counter>_total{dev}                   the serving loop's: wrs_taken, cqes_delivered, ...
  metaroce_rx_queue_frames_total{dev,queue}              frames received per RX queue; fill_owed a gauge
  metaroce_xsk_<statistic>_total{dev,queue}              each AF_XDP socket's XDP_STATISTICS
  metaroce_umem_frames{dev,where}                        where the UMEM frames are (free, kernel_rx, ...)
  process_*                                              prometheus-client's ProcessCollector (CPU, memory, fds)

A QP's metrics disappear with the QP (labels are per QPN: QPNs are reused slowly, 24 bits).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

from prometheus_client import ProcessCollector
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest, start_http_server

__all__ = ["DaemonCollector", "MetricsServer", "serve", "render"]

_QP_COUNTERS = (("bytes_tx", "tx_bytes", "payload bytes sent"), ("bytes_rx", "rx_bytes", "payload bytes received"),
                ("retransmits", "retransmits", "packets retransmitted"),
                ("naks_rx", "naks_rx", "NAKs received"), ("naks_tx", "naks_tx", "NAKs sent"),
                ("rnr", "rnr", "RNR NAKs (receiver not ready)"))
_QP_GAUGES = (("outstanding_send", "outstanding_send", "send work requests posted and not completed"),
              ("outstanding_recv", "outstanding_recv", "receive work requests posted and not consumed"),
              ("sq_psn", "sq_psn", "next PSN the send queue uses"),
              ("rq_psn", "rq_psn", "next PSN the receive queue expects"))


# the data plane's counters (dp.Context.stats): gauges by name, the rest counters; rx_drop_* one family by reason
PLANE_GAUGES = frozenset(("last_to_comp", "last_to_max", "last_to_kack", "last_to_kseq", "last_to_head",
                          "last_to_next", "last_to_tail"))
DRIVER_COUNTERS = ("driver_iterations", "wrs_taken", "cqes_delivered", "bad_wrs", "ring_scans", "credit_runs")


def _num(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return None


class DaemonCollector:
    """A prometheus-client collector over `snapshot` (Daemon.snapshot or anything returning its dict)."""

    def __init__(self, snapshot: Callable[[], dict], per_qp: bool = False):
        self.snapshot = snapshot
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
        rate = GaugeMetricFamily("metaroce_qp_tx_rate_bytes_per_second", "payload bytes sent per second, over the "
                                 "last half second", labels=labels)
        srtt = GaugeMetricFamily("metaroce_qp_srtt_seconds", "smoothed round-trip time", labels=labels)
        for q in qps:
            lv = [str(q.get("dev", "")), str(q.get("qpn", ""))]
            if _num(q.get("rate_bps")) is not None:
                rate.add_metric(lv, _num(q["rate_bps"]) / 8)
            if _num(q.get("srtt_us")) is not None:
                srtt.add_metric(lv, _num(q["srtt_us"]) / 1e6)
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
        yield rate
        yield srtt

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
        pdrops = CounterMetricFamily("metaroce_plane_rx_drops", "frames the data plane dropped, by reason",
                                     labels=["dev", "reason"])
        plane: dict[str, Any] = {}
        driver = {k: CounterMetricFamily(f"metaroce_driver_{k}", f"the serving loop's {k.replace('_', ' ')}",
                                         labels=["dev"]) for k in DRIVER_COUNTERS}
        qframes = CounterMetricFamily("metaroce_rx_queue_frames", "frames received, per RX queue",
                                      labels=["dev", "queue"])
        qowed = GaugeMetricFamily("metaroce_rx_queue_fill_owed", "frames an RX queue's fill ring is owed",
                                  labels=["dev", "queue"])
        xsk: dict[str, CounterMetricFamily] = {}
        umem = GaugeMetricFamily("metaroce_umem_frames", "where the UMEM frames are", labels=["dev", "where"])
        for d in devices:
            dev = str(d.get("ifname", ""))
            c = d.get("counters") or {}
            for name, n in (c.get("xdp_drops") or {}).items():
                if _num(n) is not None:
                    drops.add_metric([dev, str(name).lower()], _num(n))
            for name, n in (c.get("xdp_events") or {}).items():
                if _num(n) is not None:
                    events.add_metric([dev, str(name).lower()], _num(n))
            for name, n in (c.get("plane") or {}).items():
                v = _num(n)
                if v is None:
                    continue
                if name.startswith("rx_drop_"):
                    pdrops.add_metric([dev, name[len("rx_drop_"):]], v)
                    continue
                if name not in plane:
                    plane[name] = (GaugeMetricFamily(f"metaroce_plane_{name}", f"the data plane's {name}",
                                                     labels=["dev"]) if name in PLANE_GAUGES else
                                   CounterMetricFamily(f"metaroce_plane_{name}", f"the data plane's {name}",
                                                       labels=["dev"]))
                plane[name].add_metric([dev], v)
            for k, fam in driver.items():
                if _num(c.get(k)) is not None:
                    fam.add_metric([dev], _num(c[k]))
            for q in c.get("rx_queues") or []:
                qid = str(q.get("queue", ""))
                if _num(q.get("rx")) is not None:
                    qframes.add_metric([dev, qid], _num(q["rx"]))
                if _num(q.get("fill_owed")) is not None:
                    qowed.add_metric([dev, qid], _num(q["fill_owed"]))
                for name, n in (q.get("xsk") or {}).items():
                    if _num(n) is None:
                        continue
                    if name not in xsk:
                        xsk[name] = CounterMetricFamily(f"metaroce_xsk_{name}", f"the AF_XDP socket's {name} "
                                                        "(XDP_STATISTICS)", labels=["dev", "queue"])
                    xsk[name].add_metric([dev, qid], _num(n))
            for where, n in (c.get("umem") or {}).items():
                if where not in ("total", "sg") and _num(n) is not None:
                    umem.add_metric([dev, where], _num(n))
        yield drops
        yield events
        yield pdrops
        yield from plane.values()
        yield from driver.values()
        yield qframes
        yield qowed
        yield from xsk.values()
        yield umem


def registry_for(snapshot: Callable[[], dict], per_qp: bool = False) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(DaemonCollector(snapshot, per_qp=per_qp))
    ProcessCollector(registry=reg)            # process_cpu_seconds_total, process_resident_memory_bytes, ...
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
