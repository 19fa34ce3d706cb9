"""`metaroce perf`: perftest-style benchmarks between two MetaRoCE endpoints.

    metaroce perf write-bw -d mr1                       # server: waits on TCP 18515
    metaroce perf write-bw -d mr0 -s 65536 10.77.0.2    # client: runs the test, prints the table
    metaroce perf write-lat -d mr0 -s 8 -n 1000 --json 10.77.0.2

Tests (as in perftest's ib_write_bw, ib_write_lat, ib_read_bw, ib_send_bw):
  write-bw   client posts ITERS RDMA WRITEs, keeping TX_DEPTH outstanding; server waits
  read-bw    client posts ITERS RDMA READs of the server's buffer
  send-bw    client posts ITERS SENDs; the server keeps RX_DEPTH receives posted
  write-lat  ping-pong of SIZE-byte WRITEs; each side busy-polls the last byte of
             its buffer for the peer's write (perftest's write_lat method)

  --qps N          (bw tests) N QP pairs, -n and -t on each; aggregate reported
  --bidirectional  (write-bw) the server writes to the client at the same time; the
                   client reports both directions (all bytes over the longer run)
  write-bw checks the data: each side compares what arrived with the writer's pattern; read-bw:
                   the client compares what its READs brought with the server's pattern.
  --plane compiled (the default and only choice) runs the bw and latency loops in process inside the
                   compiled plane (dp/drive.py, metaroce_xdp.dp: the endpoint `from metaroce_xdp import
                   Context` gives) when no metaroced serves the interface, or with --no-daemon.
  --profile auto (the default) negotiates the profile in the connection set-up: native when both
                   ends offer it (the compiled plane, both sides), compat otherwise -- against
                   metaroced (ask it with --profile native), Soft-RoCE or another compat-only peer, and where
                   the plane cannot run the test natively (read-bw until native READ, more QPs than
                   native slots).  native refuses a compat-only peer; compat never offers native.
                   The header and the JSON (`profile`) say which profile was agreed.
  --start-at T     (client) connect, then start the test at wall-clock time T (epoch seconds,
                   or @FILE: the time written into FILE once it exists), so that several clients
                   measure the same interval; the JSON has start_epoch and end_epoch.  METAROCE_NATIVE_PARAMS='{"name": value}' overrides native
                   parameters (native/layout.py) of an in-process compiled QP, for experiments.
  --progress spin  (the default) the in-process compiled plane busy-polls (sched_yield when idle):
                   the lowest latency.  --progress sleep: idle, the bw loop sleeps in ppoll() until
                   the next timer or pacing deadline of its native QPs, a frame (their SACKs are
                   steered to the socket meanwhile) or a post, and the waits for the peer sleep in
                   poll() -- for several senders sharing few cores (tools/bench_fabric's incast).
                   compat QPs and write-lat spin either way.

The two sides set up the connection with the MetaRoCE Connection Message
(metaroce_xdp/cm.py, spec 06-connection.md); the test's own parameters (rkey,
buffer address, size, iterations, test name) ride in its PERF_PARAMS TLV.  The
server takes size and iterations from the client.  After the test the two
exchange one JSON line each over the same TCP connection: the client's result,
the server's counters.

perftest on the other end (Debian's ib_write_bw, ib_read_bw, ib_send_bw, ib_write_lat):
--perftest makes the client speak perftest's exchange (perftest_oob.py); a server
recognises a perftest client by its first bytes.  Nothing of the test is exchanged
there: both sides need the same -s/-a, -n and -q, as between two perftests.  Rows
are perftest's: MB/sec = 2^20 bytes/s (--report_gbits: Gb/sec); -a every size from
2 B to 8 MiB; -D SECONDS (write-bw, read-bw) a timed run in batches of -n.

Bandwidth: average = SIZE*ITERS over the time from the first post to the last
completion; peak = the best rate over any TX_DEPTH consecutive completions.
Latency: perftest's convention, half of each round trip measured between
consecutive posts.
"""
from __future__ import annotations

import json
import math
import os
import select
import socket
import sys
import time
from dataclasses import dataclass
from typing import Callable, TextIO

import numpy as np

from metaroce_xdp import cm

TESTS = ("write-bw", "write-lat", "read-bw", "send-bw")
TITLES = {"write-bw": "RDMA_Write BW Test", "write-lat": "RDMA_Write Latency Test",
          "read-bw": "RDMA_Read BW Test", "send-bw": "Send BW Test"}
DEFAULT_SIZE = {"write-bw": 65536, "read-bw": 65536, "send-bw": 65536, "write-lat": 2}
DEFAULT_ITERS = {"write-bw": 5000, "read-bw": 5000, "send-bw": 5000, "write-lat": 1000}
MAX_RD_ATOMIC = 16                  # outstanding READs (perftest's -o default on most devices)
MIN_RNR_TIMER = 1                   # 10 us: the server's receives are reposted at once
RESULT_LINE = "-" * 87
BW_HEADER = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]"
BW_HEADER_GBITS = " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]"
MIB = 1 << 20                       # perftest's MB/sec is MiB/s (2^20 bytes); its Gb/sec is 10^9 bits/s
ALL_SIZES = tuple(1 << k for k in range(1, 24))     # -a: 2 B .. 8 MiB, as perftest
LAT_HEADER = (" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    "
              "t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]")
COUNTERS = ("packets_sent", "bytes_sent", "bytes_received", "retransmits", "timeouts", "naks_received",
            "rnr_naks_received", "seq_naks_sent", "rnr_naks_sent", "duplicates")
# the compiled plane has no per-QP traffic counters in process: the port's (this run's QPs are the port's
# only ones), under these names -- packets_sent counts every frame (ACKs too), bytes_received
# the payload placed (WRITE/SEND data and READ responses); no bytes_sent (the port counts frame bytes)
DP_COUNTERS = {"packets_sent": "tx", "bytes_received": "rx_bytes", "retransmits": "retransmits",
               "timeouts": "timeouts", "naks_received": "naks_seen", "rnr_naks_received": "rnr_seen",
               "seq_naks_sent": "tx_nak", "rnr_naks_sent": "tx_rnr", "duplicates": "rx_dup"}


class PerfError(Exception):
    """The benchmark could not run; the message says what to do."""


@dataclass
class PerfOptions:
    test: str
    ifname: str
    server: str | None = None            # None: this side is the server
    size: int | None = None
    iters: int | None = None
    port: int = cm.CM_PORT
    mtu: int | None = None               # None: the largest the interface carries
    tx_depth: int = 128
    rx_depth: int = 512
    as_json: bool = False
    timeout: float = 30.0                # seconds without progress before giving up
    plane: str = "compiled"              # the in-process data plane: "compiled" (metaroce_xdp.dp), the only one
    qps: int = 1                         # bw tests: QP pairs, each with tx_depth outstanding (client side)
    bidir: bool = False                  # write-bw: both sides write at once (client side; the server follows)
    no_daemon: bool = False              # never metaroced, even when it serves the interface
    profile: str = "auto"                # native|compat|auto, negotiated (dp/cmconnect.py); auto: native when
                                         # both ends offer it, compat with a compat-only peer
    socket: str | None = None            # metaroced's control socket (default: metaroce_xdp/cli/engine_choice.py's)
    start_at: str | None = None          # client: connect, then start at this time.time(), or "@PATH": at the time
                                         # written into PATH once it exists (several clients at once: incast)
    progress: str = "spin"               # in-process compiled plane: "spin" (busy polling) or "sleep" (idle: poll())
    check_address: bool = True           # server: a REQ whose GID is not its TCP source gets REJ ADDRESS_MISMATCH
                                         # (MR-SEC-019); off only where set-up runs on another network
    rx_queues: int = 0                   # in-process plane: RX queues served from 0 (0: every one, as RSS needs)
    perftest: bool = False               # client: the server is perftest (ib_write_bw ...): its exchange, not ours
                                         # (a server recognises a perftest client by itself)
    all_sizes: bool = False              # -a: every size from 2 B to 8 MiB
    duration: float | None = None        # -D: bw tests run for this many seconds instead of -n iterations
    report_gbits: bool = False           # --report_gbits: Gb/sec instead of MB/sec
    gid_index: int | None = None         # -x: accepted; the GID is the interface's address (index 0 of ours)

    @property
    def is_server(self) -> bool:
        return self.server is None


# --------------------------------------------------------------------------- statistics


def bw_stats(size: int, iters: int, seconds: float, done_ns: np.ndarray, window: int) -> dict:
    gbps = size * iters * 8 / seconds / 1e9 if seconds > 0 else 0.0
    peak = gbps
    w = min(window, len(done_ns) - 1)
    if w >= 1:
        spans = done_ns[w:] - done_ns[:-w]
        best = int(spans.min()) if len(spans) else 0
        if best > 0:
            peak = max(gbps, size * w * 8 / best)
    return {"bytes": size, "iterations": iters, "total_bytes": size * iters, "seconds": seconds,
            "gbps": gbps, "gbps_peak": peak, "msg_rate": iters / seconds / 1e6 if seconds > 0 else 0.0}


def lat_stats(posted_ns: np.ndarray) -> dict:
    """perftest print_report_lat: half of each interval between consecutive posts, sorted."""
    d = np.sort(np.diff(posted_ns.astype(np.int64))) / 2 / 1000.0
    n = len(d)
    if n == 0:
        return dict.fromkeys(("min", "max", "typical", "avg", "stdev", "p99", "p999"), 0.0)
    return {"min": float(d[0]), "max": float(d[-1]), "typical": float(d[n // 2]), "avg": float(d.mean()),
            "stdev": float(d.std()), "p99": float(d[max(0, math.ceil(n * 0.99) - 1)]),
            "p999": float(d[max(0, math.ceil(n * 0.999) - 1)])}


def bw_row(r: dict, gbits: bool = False) -> str:
    """perftest's result row: MB/sec (2^20 bytes per second) by default, Gb/sec with --report_gbits."""
    k = 1.0 if gbits else 1e9 / 8 / MIB
    return " %-7d    %-10d       %-7.2f            %-7.2f\t\t   %-7.6f" % (
        r["bytes"], r["iterations"], r["gbps_peak"] * k, r["gbps"] * k, r["msg_rate"])


def lat_row(r: dict) -> str:
    s = r["lat_us"]
    return " %-7d %-10d      %-7.2f        %-7.2f      %-7.2f  \t%-7.2f     \t%-7.2f\t\t%-7.2f  \t\t%-7.2f" % (
        r["bytes"], r["iterations"], s["min"], s["max"], s["typical"], s["avg"], s["stdev"], s["p99"], s["p999"])


# --------------------------------------------------------------------------- the run


PLANES = ("compiled",)


def open_context(ifname: str, rx_queues: int = 0):
    """Context.open for the tools: the compiled data plane (metaroce_xdp.dp, what `from metaroce_xdp import
    Context` gives), driven from this thread (busy polling, no progress thread), on every RX queue of the
    interface (rx_queues > 0: queues 0 .. rx_queues - 1).  Pinning the maps (for the CLI's readers) needs a
    bpffs at /sys/fs/bpf; `ip netns exec` mounts a fresh /sys without one, so pin only where it can work
    rather than fail the run."""
    import os

    from metaroce_xdp.dp import Context
    return Context.open(ifname, progress_thread=False, pin=os.path.ismount("/sys/fs/bpf"),
                        queues=rx_queues or None)


PROGRESS = ("spin", "sleep")


class _DpEngine:
    """What the benchmark loops use of an engine, for the compiled plane: progress() runs the compiled
    loop without the GIL for a slice of time (sleep: up to 20 ms, asleep in poll() when idle, so the
    caller looks at its TCP line after every slice); stats are the port's counters."""

    def __init__(self, ctx, sleep: bool = False) -> None:
        self.ctx, self.plane = ctx, ctx.plane
        self.local_mac, self.max_pmtu = ctx.local_mac, ctx.max_pmtu
        self.threaded = False
        self.sleep = sleep

    def progress(self) -> int:
        if self.sleep:
            return self.plane.run(20_000_000, sleep_ok=True)
        return self.plane.run(200_000)

    @property
    def stats(self) -> dict:
        return self.ctx.stats()


class _Side:
    """One endpoint's resources: context, PD, CQ, QP, buffer and MR."""

    def __init__(self, opt: PerfOptions) -> None:
        from metaroce_xdp.verbs_types import QPCap
        if opt.plane not in PLANES:
            raise PerfError(f"--plane {opt.plane}: use one of {', '.join(PLANES)}")
        from . import engine_choice          # metaroced when it serves the interface (--no-daemon: never)
        choice = engine_choice.choose(opt.ifname, opt.socket, opt.no_daemon)
        engine_choice.say("metaroce perf", choice)
        self.daemon = choice.daemon
        self.compiled = not self.daemon                # the compiled plane in this process
        from metaroce_xdp.dp.cmconnect import PROFILES
        if opt.profile not in PROFILES:
            raise PerfError(f"--profile {opt.profile}: use one of {', '.join(PROFILES)}")
        # auto where the native profile does not run (_native_room): this side offers compat, as a Soft-RoCE
        # peer does; the peer's auto agrees compat (MR-NAT-002)
        self.profile = opt.profile
        self.native_room = 1 << 30           # QPs this run may still run native (run() narrows it, _native_room)
        self.is_client = not opt.is_server
        try:
            self.ctx = (engine_choice.open_daemon_context(choice, opt.ifname) if self.daemon
                        else open_context(opt.ifname, opt.rx_queues))
        except Exception as e:  # noqa: BLE001 - tool boundary: every cause becomes one clear line
            raise PerfError(f"cannot open interface {opt.ifname!r}: {e} (run as root in the interface's "
                            "network namespace; list interfaces with `ip link`)") from None
        self.eng = (engine_choice.DaemonEngine(self.ctx) if self.daemon else
                    _DpEngine(self.ctx, opt.progress == "sleep"))
        self.pd = self.ctx.alloc_pd()
        self.cq = self.ctx.create_cq(1 << 13 if self.daemon else 1 << 16)     # the daemon's share per client
        self.cap = QPCap(max_send_wr=max(opt.tx_depth, 16), max_recv_wr=max(opt.rx_depth, 16))
        self.qps: list = []
        self.psns: list[int] = []
        self.add_qps(1)
        self.qp, self.psn = self.qps[0], self.psns[0]
        self.buf: np.ndarray | None = None
        self.mr = None
        self.verified: bool | None = None

    def add_qps(self, n: int) -> None:
        """Up to n QPs (all on the one CQ and PD), each with its own initial PSN."""
        while len(self.qps) < n:
            self.qps.append(self.ctx.create_qp(self.pd, self.cq, self.cq, self.cap))
            self.psns.append(cm.random_psn())

    def register(self, nbytes: int) -> None:
        from metaroce_xdp.verbs_types import Access
        self.buf = self.ctx.alloc_buf(max(nbytes, 64)) if self.daemon else np.zeros(max(nbytes, 64), np.uint8)
        self.mr = self.pd.reg_mr(self.buf, Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ)

    def to_init(self, i: int = 0) -> None:
        from metaroce_xdp.verbs_types import Access, QPAttr, QPState
        self.qps[i].modify(QPAttr(qp_state=QPState.INIT,
                                  qp_access_flags=Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ))

    def to_rtr(self, peer: cm.CMMsg, mtu: int, i: int = 0, agreed: int = 0) -> None:
        from metaroce_xdp.dp.cmconnect import K_OFFER, W_OFFER, agreed_profile, peer_timing
        from metaroce_xdp.verbs_types import QPAttr, QPState, VerbsError
        # MR-CM-024: the destination MAC is the next hop's, from this host's route and neighbour
        # tables (the engine resolves it); the peer's mac field is informational only
        prof, params = agreed_profile(agreed, min(peer.sack_window, W_OFFER), min(peer.entropy_count, K_OFFER),
                                      peer_timing(peer))
        if params is not None and os.environ.get("METAROCE_NATIVE_PARAMS") and self.compiled:
            params.update(json.loads(os.environ["METAROCE_NATIVE_PARAMS"]))   # experiments (bench_fabric's CC off)
        extra = {"profile": prof, "native_params": params} if self.compiled else {}     # MR-CM-016
        if self.daemon and prof == "native":          # the daemon adds rto_min and its receiver's parameters
            prof, params = self.ctx.agreed_profile(agreed, min(peer.sack_window, W_OFFER),
                                                   min(peer.entropy_count, K_OFFER), peer_timing(peer))
            extra = {"profile": prof, "native_params": params}
        attr = QPAttr(qp_state=QPState.RTR, dest_qp_num=peer.qpn, rq_psn=peer.psn, path_mtu=mtu,
                      dgid=cm.gid_to_ip(peer.gid), max_dest_rd_atomic=MAX_RD_ATOMIC, min_rnr_timer=MIN_RNR_TIMER,
                      **extra)
        try:
            self.qps[i].modify(attr)
        except VerbsError as e:
            raise PerfError(f"cannot reach {attr.dgid}: {e}") from None
        if self.daemon:
            self.qps[i].profile = prof

    def to_rts(self, peer: cm.CMMsg, i: int = 0) -> None:
        from metaroce_xdp.verbs_types import QPAttr, QPState
        self.qps[i].modify(QPAttr(qp_state=QPState.RTS, sq_psn=self.psns[i], timeout=14, retry_cnt=7, rnr_retry=7,
                                  max_rd_atomic=min(MAX_RD_ATOMIC, peer.max_dest_rd_atomic)))   # MR-CM-021

    def caps(self) -> tuple[int, int]:
        """(capabilities, flags) this side offers: --profile's (dp/cmconnect.py), IPV6 for an IPv6 GID."""
        from metaroce_xdp.dp.cmconnect import offer
        prof = self.profile
        if prof == "auto" and self.native_room < 1:
            prof = "compat"                  # auto: compat where this run cannot go native (_native_room)
        if self.daemon:
            return self.ctx.offer(prof)      # what metaroced serves (daemon/client.py)
        caps, flags = offer(prof, self.ctx.gid)
        if prof == "compat":
            caps &= ~int(cm.Cap.ATOMICS)            # as before: perf never offered ATOMICS
        elif self.is_client:
            # a sender honours the receiver's credits (MR-CC-014); this plane grants none of its own (no
            # allocation, MR-CC-018, outside metaroced), so the server side does not offer CREDITS
            caps |= int(cm.Cap.CREDITS)
        v6 = cm.Cap.IPV6 if ":" in self.ctx.gid else 0                     # MR-CM-018: IPv6 GIDs need IPV6
        return int(caps | v6), flags

    def msg(self, mtu: int, perf: dict, i: int = 0) -> cm.CMMsg:
        from metaroce_xdp.dp.cmconnect import K_OFFER, W_OFFER
        gid = cm.ip_to_gid(self.ctx.gid)
        caps, flags = self.caps()
        return cm.CMMsg(cm.MsgType.REQ, cookie=cm.new_cookie(), gid=gid, qpn=self.qps[i].qp_num, flags=flags,
                        sack_window=W_OFFER if caps & cm.Cap.SACK else 0,
                        entropy_count=K_OFFER if caps & cm.Cap.MULTIPATH else 1,
                        capabilities=caps, psn=self.psns[i], path_mtu=cm.MTU_ENUM[mtu], max_rd_atomic=MAX_RD_ATOMIC,
                        max_dest_rd_atomic=MAX_RD_ATOMIC, min_rnr_timer=MIN_RNR_TIMER,
                        mac=cm.mac_bytes(self.eng.local_mac),
                        tlvs=[(cm.TLV_IMPL_NAME, cm.IMPL_NAME.encode()),
                              (cm.TLV_PERF_PARAMS, json.dumps(perf, separators=(",", ":")).encode())])

    def counters(self) -> dict:
        if self.compiled:
            st = self.ctx.stats()
            return {k: st[v] for k, v in DP_COUNTERS.items()}
        q = self.qp.query()
        return {k: q[k] for k in COUNTERS if k in q}

    def close(self) -> None:
        import os
        if os.environ.get("METAROCE_PERF_DEBUG"):      # engine and XDP counters, for bug reports
            ld = getattr(self.ctx, "loader", None)
            sys.stderr.write(f"debug: engine {dict(self.eng.stats)} port {getattr(self.ctx.port, 'stats', {})}\n")
            if self.compiled:
                sys.stderr.write(f"debug: qp {self.qp.query()}\n")
                for qp in self.qps[1:]:
                    if qp.query()["state"] != self.qp.query()["state"]:
                        sys.stderr.write(f"debug: qp {qp.query()}\n")
            if ld is not None:
                drops = {k: v for k, v in ld.drops().items() if v}
                sys.stderr.write(f"debug: xdp drops {drops} events {ld.events()}\n")
        self.ctx.close()


def _dp_stats(side: _Side) -> dict:
    """The compiled port's non-zero counters, with the socket's XDP_STATISTICS (ring-full drops ...)."""
    out = {k: v for k, v in side.ctx.stats().items() if v and not k.startswith("last_to")}
    try:
        out.update({f"xsk_{k}": v for k, v in side.ctx.port.xsk.statistics().items() if v})
    except Exception:  # noqa: BLE001 - diagnostics only
        pass
    return out


def _native_room(opt: PerfOptions, side: _Side) -> int:
    """How many QPs --profile auto may offer native in this run: 0 (offer compat, as a compat-only peer
    would) where the plane cannot carry the test natively -- read-bw if native READ were refused
    (verbs.NATIVE_REFUSED), or more QPs than the port has native slots (native/plane_slot.py NSLOT)."""
    if not side.compiled:
        return 0
    from metaroce_xdp.verbs import NATIVE_REFUSED
    from metaroce_xdp.verbs_types import WROpcode
    if opt.test == "read-bw" and WROpcode.RDMA_READ in NATIVE_REFUSED:
        return 0
    free = len(side.ctx.plane.nat.free)
    return 0 if not opt.is_server and opt.qps > free else free


def _local_mtu(opt: PerfOptions, side: _Side) -> int:
    limit = side.eng.max_pmtu
    mtu = opt.mtu or limit
    if mtu not in cm.MTU_ENUM:
        raise PerfError(f"-m {mtu}: the path MTU must be one of {sorted(cm.MTU_ENUM)}")
    if mtu > limit:
        raise PerfError(f"-m {mtu}: {opt.ifname} carries at most a {limit}-byte path MTU (raise the interface MTU)")
    return mtu


def _check_wc(wc, side: _Side) -> None:
    """A failed completion ends the run, reported by its status and the QP's reason
    (e.g. 'WRITE failed: RETRY_EXC_ERR, retries exhausted (local ACK timeout)')."""
    from metaroce_xdp.verbs_types import WCStatus, wc_failure
    if wc.status != WCStatus.SUCCESS:
        raise PerfError(wc_failure(wc, side.qp.query().get("error")) + " -- is the peer still running?")


class _Watchdog:
    """Fails the run when nothing arrives for `timeout` seconds (checked cheaply)."""

    def __init__(self, side: _Side, timeout: float, what: str) -> None:
        self.side, self.timeout, self.what = side, timeout, what
        self.n = 0
        self.last_rx = -1
        self.since = time.monotonic()

    def tick(self) -> None:
        self.n += 1
        if self.n & 1023:
            return
        rx = self.side.eng.stats["rx"]
        now = time.monotonic()
        if rx != self.last_rx:
            self.last_rx, self.since = rx, now
        elif self.timeout and now - self.since > self.timeout:
            raise PerfError(f"no traffic from the peer for {self.timeout:g}s while {self.what}")


def _progress_until_line(side: _Side, ch: cm.Channel, timeout: float, step: Callable[[], None] | None = None,
                         what: str = "waiting for the peer") -> dict:
    """Drive the engine (the responder must ACK and answer READs) until the peer's next line."""
    dog = _Watchdog(side, timeout, what)
    # metaroced makes progress by itself: wait for the line in select() instead of spinning on sched_yield (a
    # core given back to the daemon and the senders sharing the host: tools/bench_fabric's incast)
    blocking = step is None and getattr(side.eng, "threaded", False)
    step = step or side.eng.progress
    every = 1 if getattr(side.eng, "sleep", False) else 64      # a sleeping step lasts up to 20 ms
    n = 0
    while True:
        if blocking:
            select.select([ch.sock], [], [], 0.02)
            n = 63
            dog.n |= 1023 if time.monotonic() - dog.since > 1.0 else 0    # the watchdog's check about every second
        else:
            step()
            if every == 1:
                dog.n |= 1023                   # a sleeping step lasts up to 20 ms: the watchdog checks each one
        n += 1
        if not n % every:
            try:
                line = ch.poll_json()
            except cm.PeerClosed:
                raise PerfError(f"the peer ({ch.peer}) closed the connection {what}") from None
            if line is not None:
                return line
        dog.tick()


def _barrier(ch: cm.Channel, side: _Side, opt: PerfOptions, client: bool) -> None:
    """Both sides ready (in RTS, engine warm) before the clock starts, like perftest's
    ctx_hand_shake: the client asks, the server answers when it enters its loop."""
    side.eng.progress()                       # first round loads the compiled hot path
    try:
        if client:
            ch.send_json({"type": "ready"})
            ch.recv_json(opt.timeout or None)
        else:
            ch.recv_json(opt.timeout or None)
            ch.send_json({"type": "go"})
    except cm.CMError as e:
        raise PerfError(f"synchronising with {ch.peer} before the test: {e}") from None


def _bw_client(side: _Side, opt: PerfOptions, size: int, iters: int, peer: dict, nq: int = 1,
               peers: list[dict] | None = None) -> dict:
    """ITERS work requests on each of nq QPs, TX_DEPTH outstanding on each (perftest's -q); `peers`: each
    QP's own remote buffer (a perftest server advertises one per QP), else `peer`'s for all.  With -D
    (opt.duration): batches of ITERS until that many seconds have passed, reported together."""
    if opt.duration:
        return _bw_for(side, opt, size, iters, peer, nq, peers)
    from metaroce_xdp.verbs_types import SGE, SendFlags, SendWR, WROpcode
    op = {"write-bw": WROpcode.RDMA_WRITE, "read-bw": WROpcode.RDMA_READ, "send-bw": WROpcode.SEND}[opt.test]
    qps = side.qps[:nq]
    wrs = [SendWR(wr_id=q, opcode=op, sg_list=[SGE(side.mr.addr, size, side.mr.lkey)] if size else [],
                  send_flags=SendFlags.SIGNALED, remote_addr=(peers[q] if peers else peer).get("va", 0),
                  rkey=(peers[q] if peers else peer).get("rkey", 0))
           for q in range(nq)]
    depth = max(1, min(opt.tx_depth, getattr(side.qp, "cap", side.cap).max_send_wr))   # (a daemon's QP: requested)
    if side.compiled:
        return _bw_compiled(side, opt, size, iters, qps, wrs, depth)
    done_ns = np.zeros(iters * nq, np.int64)
    posted = [0] * nq
    done = [0] * nq
    completed = 0
    dog = _Watchdog(side, opt.timeout, f"running {opt.test}")
    poll = side.cq.poll
    t0 = time.perf_counter_ns()
    while completed < iters * nq:
        for q in range(nq):
            room = min(depth - (posted[q] - done[q]), iters - posted[q])
            if room > 0:
                qps[q].post_send([wrs[q]] * room)
                posted[q] += room
        wcs = poll(64)
        if wcs:
            now = time.perf_counter_ns()
            for wc in wcs:
                _check_wc(wc, side)
                done_ns[completed] = now
                completed += 1
                done[wc.wr_id] += 1
        else:
            dog.tick()
    seconds = (time.perf_counter_ns() - t0) / 1e9
    r = bw_stats(size, iters * nq, seconds, done_ns, depth)
    r["iterations"], r["qps"] = iters, nq
    return r


def _bw_for(side: _Side, opt: PerfOptions, size: int, batch: int, peer: dict, nq: int, peers: list[dict] | None) -> dict:
    """-D: batches of `batch` work requests per QP until opt.duration seconds have passed; the rates over the
    whole time (the pipeline drains between batches: a little below a continuous run), peak the best batch's."""
    import dataclasses
    one = dataclasses.replace(opt, duration=None)
    end = time.monotonic() + opt.duration
    total = {"bytes": size, "iterations": 0, "total_bytes": 0, "seconds": 0.0, "gbps_peak": 0.0, "batches": 0}
    while time.monotonic() < end:
        r = _bw_client(side, one, size, batch, peer, nq, peers)
        total["iterations"] += r["iterations"] * r.get("qps", nq)
        total["total_bytes"] += r["total_bytes"]
        total["seconds"] += r["seconds"]
        total["gbps_peak"] = max(total["gbps_peak"], r["gbps_peak"])
        total["batches"] += 1
    secs = total["seconds"]
    total.update(gbps=total["total_bytes"] * 8 / secs / 1e9 if secs else 0.0,
                 msg_rate=total["iterations"] / secs / 1e6 if secs else 0.0, qps=nq, duration=opt.duration)
    total["iterations"] //= nq          # per QP, as -n
    return total


def _bw_compiled(side: _Side, opt: PerfOptions, size: int, iters: int, qps: list, wrs: list, depth: int) -> dict:
    """The bw loop on the compiled plane: posting, progress and completions in dp.drive.dp_drive_bw (one
    compiled call per 50 ms; no Python per work request)."""
    from metaroce_xdp.dp import drive
    from metaroce_xdp.dp import layout as L
    from metaroce_xdp.verbs_types import WCStatus
    nq = len(qps)
    W = np.zeros((nq, L.NW + 1), np.int64)
    for q, (qp, wr) in enumerate(zip(qps, wrs)):
        W[q, 0] = qp.qi
        W[q, 1:] = qp.send_wqe(wr)
    S = np.zeros(4 + 2 * nq, np.int64)
    S[1] = iters
    done_ns = np.zeros(iters * nq, np.int64)
    pl = side.eng.plane
    dog = _Watchdog(side, opt.timeout, f"running {opt.test}")
    sleep = 1 if opt.progress == "sleep" else 0
    t0, cpu0, sch0 = time.monotonic_ns(), time.process_time(), _schedstat()
    trace = _NativeTrace(side, qps[0]) if os.environ.get("METAROCE_PERF_TRACE") else None
    while True:
        with pl.lock:
            rc = drive.dp_drive_bw(pl.A, pl.TM, pl.umem, pl.tables, W, S, done_ns, side.cq.index, depth,
                                   50_000_000 if trace is None else trace.every_ns, sleep)
        if trace is not None:
            trace.sample()
        if rc == 0:
            break
        if rc == 1:
            pl.drain_events()
        elif rc == 3:
            q = int(S[3])
            qp = qps[q] if 0 <= q < nq else side.qp
            raise PerfError(f"{opt.test} work request failed: {WCStatus(int(S[2]) - 1).name}, "
                            f"{qp.query().get('error')} -- is the peer still running?")
        elif rc < 0:
            raise PerfError("the compiled data plane is closed")
        dog.n = 1023                                     # check the watchdog every call (50 ms)
        dog.tick()
    seconds = (time.monotonic_ns() - t0) / 1e9
    r = bw_stats(size, iters * nq, seconds, done_ns, depth)
    r["iterations"], r["qps"] = iters, nq
    r["cpu_seconds"] = round(time.process_time() - cpu0, 4)      # this process's CPU over the loop (vs seconds)
    sch = _schedstat()
    if sch and sch0:                   # and the time it was runnable but waited for a CPU (the run queue)
        r["runq_wait_seconds"] = round((sch[1] - sch0[1]) / 1e9, 4)
    if trace is not None:
        with open(os.environ["METAROCE_PERF_TRACE"], "w") as f:
            json.dump(trace.rows, f)
    return r


def _schedstat() -> tuple[int, ...] | None:
    """This thread's /proc schedstat: ns on a CPU, ns waiting on a run queue, time slices (Linux)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return tuple(int(x) for x in f.read().split()[:3])
    except (OSError, ValueError):
        return None


class _NativeTrace:
    """METAROCE_PERF_TRACE=FILE (experiments, tools/bench_fabric --incast): the first QP's requester row
    (native/layout.py TX_FIELDS) every 5 ms of the compiled bw loop, written to FILE as a JSON list of
    {"t": epoch seconds, field: value}."""
    every_ns = 5_000_000

    def __init__(self, side: _Side, qp) -> None:
        from metaroce_xdp.native import layout as NL
        self.nat, self.qi, self.fields = side.eng.plane.nat, getattr(qp, "qi", None), NL.TX_FIELDS
        self.rows: list[dict] = []

    def sample(self) -> None:
        r = self.nat.rows(self.qi) if self.nat is not None and self.qi is not None else None
        if r is not None:
            s = r[2]
            self.rows.append({"t": round(time.time(), 4), **{n: int(s[i]) for i, n in enumerate(self.fields)}})


def _fill_pattern(buf: np.ndarray, size: int, who: int) -> None:
    """The bytes a side writes (its send area): a pattern that differs per side and per offset."""
    buf[:size] = ((np.arange(size, dtype=np.int64) * 7 + 31 * who) & 0xFF).astype(np.uint8)


def _verify(buf: np.ndarray, off: int, size: int, who: int) -> bool:
    """buf[off:off+size] holds what side `who` writes."""
    want = ((np.arange(size, dtype=np.int64) * 7 + 31 * who) & 0xFF).astype(np.uint8)
    return bool(np.array_equal(buf[off:off + size], want))


def _send_bw_server_step(side: _Side, size: int, iters: int, depth: int):
    """Keep receives posted until ITERS have been consumed (perftest's send_bw server)."""
    from metaroce_xdp.verbs_types import SGE, RecvWR
    rwr = RecvWR(wr_id=2, sg_list=[SGE(side.mr.addr, size, side.mr.lkey)] if size else [])
    st = {"posted": 0, "received": 0}

    posted = {qp.qp_num: 0 for qp in side.qps}
    by_num = {qp.qp_num: qp for qp in side.qps}

    def post(qpn: int, n: int) -> None:
        n = min(n, iters - posted[qpn])
        if n > 0:
            by_num[qpn].post_recv([rwr] * n)
            posted[qpn] += n
            st["posted"] += n

    def step() -> None:
        for wc in side.cq.poll(64):
            _check_wc(wc, side)
            if not st["received"]:
                st["t0"] = time.monotonic_ns()
            st["received"] += 1
            st["t1"] = time.monotonic_ns()
            post(wc.qp_num, 1)

    for qpn in posted:
        post(qpn, min(depth, iters))
    return step, st


def _write_lat(side: _Side, opt: PerfOptions, size: int, iters: int, peer: dict, region: int | None = None,
               sends_first: bool | None = None) -> dict:
    """perftest run_iter_lat_write: one side writes first (ours: the client; perftest's: the server),
    each side answers the peer's write (seen as its last byte changing) with its own.  The buffer is
    [ post area | poll area ], each `region` bytes (default: size; -a: the largest size)."""
    from metaroce_xdp.verbs_types import SGE, SendFlags, SendWR, WROpcode
    buf, eng, cq = side.buf, side.eng, side.cq
    region = size if region is None else region
    post_last, poll_last = size - 1, region + size - 1
    wr = SendWR(wr_id=1, opcode=WROpcode.RDMA_WRITE, sg_list=[SGE(side.mr.addr, size, side.mr.lkey)],
                send_flags=SendFlags.SIGNALED, remote_addr=peer["va"], rkey=peer["rkey"])
    posted_ns = np.zeros(iters, np.int64)
    sends_first = (not opt.is_server) if sends_first is None else sends_first
    dog = _Watchdog(side, opt.timeout, "waiting for the peer's write")
    scnt = rcnt = ccnt = 0
    clock = time.perf_counter_ns
    if side.compiled:
        return _write_lat_compiled(side, opt, size, iters, wr, posted_ns, sends_first, dog, poll_last)
    while scnt < iters or ccnt < iters or rcnt < iters:
        if rcnt < iters and not (scnt < 1 and sends_first):
            rcnt += 1
            want = rcnt & 0xFF
            while buf[poll_last] != want:
                eng.progress()
                dog.tick()
        if scnt < iters:
            posted_ns[scnt] = clock()
            scnt += 1
            buf[post_last] = scnt & 0xFF
            side.qp.post_send(wr)
        if ccnt < iters:
            while True:
                wcs = cq.poll(1)
                if wcs:
                    _check_wc(wcs[0], side)
                    ccnt += 1
                    break
                dog.tick()
    seconds = (int(posted_ns[-1]) - int(posted_ns[0])) / 1e9 if iters > 1 else 0.0
    r = {"bytes": size, "iterations": iters, "total_bytes": size * iters, "seconds": seconds,
         "gbps": size * (iters - 1) * 8 / seconds / 1e9 if seconds else 0.0,
         "msg_rate": (iters - 1) / seconds / 1e6 if seconds else 0.0, "lat_us": lat_stats(posted_ns)}
    return r


def _write_lat_compiled(side: _Side, opt: PerfOptions, size: int, iters: int, wr, posted_ns, sends_first: bool,
                        dog: _Watchdog, poll_last: int | None = None) -> dict:
    """write-lat on the compiled plane: the whole ping-pong (post, wait for the peer's write seen as the
    last byte of the poll area changing, reap the completion) runs in dp.drive.dp_drive_lat, one
    compiled call without the GIL and without Python per iteration."""
    from metaroce_xdp.dp import drive
    from metaroce_xdp.verbs_types import WCStatus
    buf, plane = side.buf, side.eng.plane
    post_last = size - 1
    poll_last = size + size - 1 if poll_last is None else poll_last
    wqe = side.qp.send_wqe(wr)
    with plane.lock:
        rc = drive.dp_drive_lat(plane.A, plane.TM, plane.umem, plane.tables, wqe, side.qp.qi, side.cq.index,
                                int(buf.ctypes.data) + post_last, int(buf.ctypes.data) + poll_last, iters,
                                int(sends_first), posted_ns, int((opt.timeout or 3600) * 1e9))
    if rc == -2:
        raise PerfError(f"no traffic from the peer for {opt.timeout:g}s while waiting for the peer's write")
    if rc == -1:
        plane.drain_events()
        raise PerfError(f"the QP failed: {side.qp.query().get('error')} -- is the peer still running?")
    if rc >= 100:
        raise PerfError(f"WRITE failed: {WCStatus(rc - 100).name}, {side.qp.query().get('error')} -- "
                        "is the peer still running?")
    seconds = (int(posted_ns[-1]) - int(posted_ns[0])) / 1e9 if iters > 1 else 0.0
    return {"bytes": size, "iterations": iters, "total_bytes": size * iters, "seconds": seconds,
            "gbps": size * (iters - 1) * 8 / seconds / 1e9 if seconds else 0.0,
            "msg_rate": (iters - 1) / seconds / 1e6 if seconds else 0.0, "lat_us": lat_stats(posted_ns)}


def _print_header(out: TextIO, opt: PerfOptions, side: _Side, mtu: int, size: int, iters: int,
                  local: cm.CMMsg, remote: cm.CMMsg, peer: dict) -> None:
    w = out.write
    w(RESULT_LINE + "\n")
    w(" " * 20 + TITLES[opt.test] + "\n")
    w(f" Interface       : {opt.ifname:<12s}Transport       : MetaRoCE RC\n")
    w(f" Data plane      : {'metaroced (its compiled plane)' if side.daemon else 'compiled (in process)'}\n")
    w(f" Profile         : {getattr(side.qp, 'profile', 'compat')} (agreed; --profile {opt.profile})\n")
    w(f" Number of qps   : {len(side.qps):<12d}Connection type : RC"
      + ("    Bidirectional" if getattr(opt, "_bidir_on", False) else "") + "\n")
    if opt.test == "write-lat":
        w(f" Mtu             : {mtu}[B]\n")
    else:
        w(f" TX depth        : {opt.tx_depth:<12d}Mtu             : {mtu}[B]\n")
    w(f" Message size    : {size:<12d}Iterations      : {iters}\n")
    for name, m, p in (("local", local, {"rkey": side.mr.rkey, "va": side.mr.addr}), ("remote", remote, peer)):
        w(f" {name} address: QPN {m.qpn:#06x} PSN {m.psn:#08x} RKey {p.get('rkey', 0):#010x} "
          f"VAddr {p.get('va', 0):#018x}\n")
        w(f" GID: {cm.gid_text(m.gid)}  MAC: {m.mac_text}\n")
    w(RESULT_LINE + "\n")
    w((LAT_HEADER if opt.test == "write-lat" else BW_HEADER_GBITS if opt.report_gbits else BW_HEADER) + "\n")
    out.flush()


def _report(out: TextIO, opt: PerfOptions, r: dict) -> None:
    if opt.as_json:
        out.write(json.dumps(r) + "\n")
    else:
        out.write((lat_row(r) if opt.test == "write-lat" else bw_row(r, opt.report_gbits)) + "\n")
        if not getattr(opt, "_more_rows", False):
            out.write(RESULT_LINE + "\n")
    out.flush()


def run(opt: PerfOptions, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> dict:
    """Run one benchmark side; returns the summary printed (as a dict)."""
    if opt.test not in TESTS:
        raise PerfError(f"unknown test {opt.test!r}: use one of {', '.join(TESTS)}")
    size = DEFAULT_SIZE[opt.test] if opt.size is None else opt.size
    iters = DEFAULT_ITERS[opt.test] if opt.iters is None else opt.iters
    if size < 0 or size >= 1 << 31:
        raise PerfError(f"-s {size}: the message size must be 0 .. 2^31-1")
    if opt.test == "write-lat" and size < 1:
        raise PerfError("write-lat needs -s 1 or more: it polls the last byte of the message")
    if opt.test == "read-bw" and size < 1:
        raise PerfError("read-bw needs -s 1 or more")
    if iters < 1 or (opt.test == "write-lat" and iters < 2):
        raise PerfError(f"-n {iters}: too few iterations")
    if not 1 <= opt.qps <= 512:
        raise PerfError(f"--qps {opt.qps}: use 1 to 512 QP pairs")
    if opt.qps > 1 and opt.test not in ("write-bw", "read-bw", "send-bw"):
        raise PerfError(f"--qps applies to the bw tests, not {opt.test}")
    if opt.bidir and opt.test != "write-bw":
        raise PerfError(f"--bidirectional applies to write-bw, not {opt.test}")
    if opt.progress not in PROGRESS:
        raise PerfError(f"--progress {opt.progress}: use one of {', '.join(PROGRESS)}")
    if opt.all_sizes and opt.duration:
        raise PerfError("-a and -D cannot go together (as in perftest)")
    if opt.duration is not None and (opt.duration <= 0 or opt.test not in ("write-bw", "read-bw")):
        raise PerfError("-D SECONDS (> 0) applies to write-bw and read-bw")
    if opt.all_sizes and opt.bidir:
        raise PerfError("-a does not go with --bidirectional")
    if opt.all_sizes and not opt.perftest and not opt.is_server and opt.test in ("send-bw", "write-lat"):
        raise PerfError(f"-a with {opt.test} needs a perftest peer (--perftest); between two `metaroce perf` "
                        "it applies to write-bw and read-bw")
    if opt.perftest and opt.is_server:
        raise PerfError("--perftest is for the client: a server recognises a perftest client by itself")
    if opt.perftest and opt.bidir:
        raise PerfError("--bidirectional is not offered against perftest")
    side = _Side(opt)
    try:
        side.native_room = _native_room(opt, side)
        mtu = _local_mtu(opt, side)
        if opt.is_server:
            return _run_server(opt, side, mtu, out, err)
        if opt.perftest:
            return _run_perftest_client(opt, side, mtu, size, iters, out)
        return _run_client(opt, side, mtu, size, iters, out)
    finally:
        side.close()


def _buf_len(test: str, size: int, bidir: bool = False) -> int:
    """write-lat and bidirectional write-bw: [ what this side writes | what the peer writes here ]."""
    return 2 * size if test == "write-lat" or bidir else size


def _start_time(spec: str, timeout: float) -> float:
    """--start-at: EPOCH_SECONDS, or @PATH -- the epoch seconds written into PATH, once it exists."""
    if not str(spec).startswith("@"):
        try:
            return float(spec)
        except ValueError:
            raise PerfError(f"--start-at {spec}: epoch seconds or @FILE") from None
    path, deadline = spec[1:], time.monotonic() + (timeout or 3600)
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                text = f.read().strip()
            if text:
                return float(text)
        except FileNotFoundError:
            pass
        except ValueError:
            raise PerfError(f"--start-at {spec}: the file holds {text[:40]!r}, not epoch seconds") from None
        time.sleep(0.01)
    raise PerfError(f"--start-at {spec}: no start time after {timeout:g}s")


def _run_client(opt: PerfOptions, side: _Side, mtu: int, size: int, iters: int, out: TextIO) -> dict:
    try:
        ch = cm.connect(opt.server, opt.port)
    except cm.ConnectFailed as e:
        raise PerfError(f"{e} (start `metaroce perf {opt.test} -d IFACE` there first)") from None
    with ch:
        nq, bidir = opt.qps, opt.bidir
        opt._bidir_on = bidir
        sizes = ALL_SIZES if opt.all_sizes else (size,)
        size = sizes[-1]                     # -a: the server sizes its buffer for the largest
        side.add_qps(nq)
        side.register(_buf_len(opt.test, size, bidir))
        if opt.test in ("write-bw", "send-bw"):        # what the server checks it received
            _fill_pattern(side.buf, size, 1)
        lat = opt.test == "write-lat"
        state = {}
        reqs, reps = [], []
        for i in range(nq):
            side.to_init(i)                                             # MR-CM-025
            req = side.msg(mtu, {"test": opt.test, "size": size, "iters": iters, "tx_depth": opt.tx_depth,
                                 "rkey": side.mr.rkey, "va": side.mr.addr + (size if lat or bidir else 0),
                                 "qps": nq, "qp": i, "bidir": bidir}, i)

            def connect_qp(rep: cm.CMMsg, i=i) -> None:
                state["mtu"] = rep.mtu_bytes
                side.to_rtr(rep, rep.mtu_bytes, i, rep.capabilities)
                side.to_rts(rep, i)
            try:
                rep = cm.active_exchange(ch, req, connect_qp)
            except cm.CMError as e:
                raise PerfError(f"connection set-up with {ch.peer} failed: {e}") from None
            reqs.append(req)
            reps.append(rep)
        req, rep = reqs[0], reps[0]
        peer = rep.perf
        if not opt.as_json:
            _print_header(out, opt, side, state["mtu"], size, iters, req, rep, peer)
        _barrier(ch, side, opt, client=True)
        if opt.start_at is not None:               # several clients start together (tools/bench_fabric incast)
            time.sleep(max(0.0, _start_time(opt.start_at, opt.timeout) - time.time()))
        t_start = time.time()
        if lat:
            r = _write_lat(side, opt, size, iters, peer)
        else:
            for sz in sizes[:-1]:            # -a: a row per size, the last one's after the exchange below
                r = _bw_client(side, opt, sz, iters, peer, nq)
                r.update(test=opt.test, role="client", plane="compiled", qps=nq)
                opt._more_rows = True
                _report(out, opt, r)
            opt._more_rows = False
            r = _bw_client(side, opt, size, iters, peer, nq)
        r.update(start_epoch=t_start, end_epoch=time.time())
        r.update(test=opt.test, role="client", mtu=state["mtu"], tx_depth=opt.tx_depth, counters=side.counters(),
                 plane="compiled", qps=nq, bidirectional=bidir, profile=getattr(side.qp, "profile", "compat"))
        try:
            ch.send_json({"type": "result", **r})
            reply = _progress_until_line(side, ch, opt.timeout, what="waiting for the server's summary")
        except cm.CMError as e:
            raise PerfError(f"after the test: {e}") from None
        r["peer_counters"] = reply.get("counters", {})
        if side.compiled:            # the port's counters (timeouts, retransmissions, kicks, rounds ...)
            r["dp_stats"] = _dp_stats(side)
            if getattr(side.qp, "profile", "compat") == "native":
                r["native"] = side.qp.native_counters()       # window, RTT, SACKs, blocks by cause (MR-LOSS-014)
        if reply.get("dp_stats"):
            r["peer_dp_stats"] = reply["dp_stats"]
        if lat and "lat_us" in reply:
            r["peer_lat_us"] = reply["lat_us"]
        if "verified" in reply:
            r["peer_verified"] = reply["verified"]          # the server's buffer holds what we wrote
        if opt.test == "read-bw":
            r["verified"] = _verify(side.buf, 0, size, 2)    # the server's pattern, read into our buffer
        if bidir:
            # what the server wrote to us, and both directions together: all bytes over the longer run
            r["verified"] = _verify(side.buf, size, size, 2)
            back = reply.get("result") or {}
            r["reverse"] = back
            if back.get("seconds"):
                total = r["total_bytes"] + back["total_bytes"]
                secs = max(r["seconds"], back["seconds"])
                r.update(gbps_one_way=r["gbps"], gbps=total * 8 / secs / 1e9,
                         msg_rate=(r["iterations"] * nq + back["iterations"] * back.get("qps", nq)) / secs / 1e6,
                         gbps_peak=r["gbps_peak"] + back.get("gbps_peak", 0.0), seconds=secs, total_bytes=total)
        _report(out, opt, r)
        if r.get("peer_verified") is False or r.get("verified") is False:
            raise PerfError("the data that arrived differs from what was written")
        return r


def _run_server(opt: PerfOptions, side: _Side, mtu: int, out: TextIO, err: TextIO) -> dict:
    with cm.Listener(opt.port) as lst:
        err.write(f"\n{'*' * 36}\n* Waiting for client to connect... *\n{'*' * 36}\n"
                  f" {TITLES[opt.test]} on {opt.ifname} ({side.ctx.gid}), TCP port {opt.port}\n")
        err.flush()
        ch = lst.accept(None)
    with ch:
        if _peer_is_perftest(ch, opt.timeout):
            return _run_perftest_server(opt, side, mtu, ch, out, err)
        params = {}

        def make_rep(req: cm.CMMsg) -> cm.CMMsg:
            why = cm.address_problem(req.gid, ch.peer) if opt.check_address else ""
            if why:                                                                      # MR-SEC-019
                raise cm.Rejected(cm.Reason.ADDRESS_MISMATCH, why, by_peer=False)
            p = req.perf
            if p.get("test") != opt.test:
                raise cm.Rejected(cm.Reason.CONSUMER_REJECT, f"this server runs {opt.test}, the client asked for "
                                  f"{p.get('test')!r}", by_peer=False)
            size, iters = int(p.get("size", -1)), int(p.get("iters", 0))
            nq, i, bidir = int(p.get("qps", 1)), int(p.get("qp", 0)), bool(p.get("bidir", False))
            if not 0 <= size < 1 << 31 or iters < 1 or not 1 <= nq <= 512 or not 0 <= i < nq:
                raise cm.Rejected(cm.Reason.INVALID_PARAM, f"size {size}, iters {iters}, qps {nq}, qp {i}",
                                  by_peer=False)
            if i == 0 and (opt.size is not None and opt.size != size or opt.iters is not None and opt.iters != iters):
                err.write(f" note: using the client's -s {size} -n {iters}\n")
            try:
                if i == 0:
                    side.add_qps(nq)
                    side.register(_buf_len(opt.test, size, bidir))
                    if bidir or opt.test == "read-bw":      # read-bw: what the client's READs must bring back
                        _fill_pattern(side.buf, size, 2)
                agreed = min(mtu, cm.MTU_BYTES.get(req.path_mtu, 0))
                side.to_init(i)
                if opt.test == "send-bw" and i == nq - 1:
                    params["step"], params["rx"] = _send_bw_server_step(side, size, iters, opt.rx_depth)
                side.to_rtr(req, agreed, i, cm.agree_caps(req.capabilities, side.caps()[0]))   # MR-CM-026
            except Exception as e:  # noqa: BLE001 - becomes a REJ the client can read
                raise cm.Rejected(cm.Reason.NO_RESOURCES, str(e), by_peer=False) from None
            params.update(size=size, iters=iters, mtu=agreed, qps=nq, bidir=bidir)
            lat = opt.test == "write-lat"
            return side.msg(agreed, {"test": opt.test, "rkey": side.mr.rkey,
                                     "va": side.mr.addr + (size if lat or bidir else 0)}, i)
        reqs = []
        try:
            while not reqs or len(reqs) < params["qps"]:
                req, rep = cm.passive_exchange(ch, side.caps()[0] | int(cm.Cap.IPV6), make_rep)   # MR-CM-018
                side.to_rts(req, len(reqs))                                    # MR-CM-028: RTS on the RTU
                reqs.append((req, rep))
        except cm.CMError as e:
            raise PerfError(f"connection set-up with {ch.peer} failed: {e}") from None
        req, rep = reqs[0]
        size, iters, mtu, nq, bidir = params["size"], params["iters"], params["mtu"], params["qps"], params["bidir"]
        opt._bidir_on = bidir
        if not opt.as_json:
            _print_header(out, opt, side, mtu, size, iters, rep, req, req.perf)
        _barrier(ch, side, opt, client=False)
        mine = None
        if opt.test == "write-lat":
            mine = _write_lat(side, opt, size, iters, req.perf)
            line = _progress_until_line(side, ch, opt.timeout, what="waiting for the client's summary")
            r = {**mine, "test": opt.test, "role": "server", "mtu": mtu, "counters": side.counters(),
                 "profile": getattr(side.qp, "profile", "compat"),
                 "peer_counters": line.get("counters", {}), "peer_lat_us": line.get("lat_us")}
        else:
            if bidir:                  # our half of the traffic, to the client's buffer, while we serve its half
                mine = _bw_client(side, opt, size, iters, req.perf, nq)
                mine.update(test=opt.test, role="server")
            line = _progress_until_line(side, ch, opt.timeout, step=params.get("step"),
                                        what=f"serving {opt.test}")
            if opt.test == "send-bw" and params["rx"]["received"] < iters * nq:
                raise PerfError(f"the client finished but only {params['rx']['received']} of {iters * nq} "
                                "messages arrived")
            r = {k: line[k] for k in ("bytes", "iterations", "total_bytes", "seconds", "gbps", "gbps_peak",
                                      "msg_rate", "qps") if k in line}
            r.update(test=opt.test, role="server", mtu=mtu, tx_depth=line.get("tx_depth"),
                     counters=side.counters(), peer_counters=line.get("counters", {}), bidirectional=bidir,
                     profile=getattr(side.qp, "profile", "compat"))
            if opt.test == "write-bw":
                r["verified"] = _verify(side.buf, size if bidir else 0, size, 1)
            elif opt.test == "send-bw":             # every receive lands at 0: the last one's bytes
                r["verified"] = _verify(side.buf, 0, size, 1)
            if mine is not None:
                r["reverse"] = mine
        if side.compiled:
            r["dp_stats"] = _dp_stats(side)
        try:
            ch.send_json({"type": "summary", "counters": r["counters"], "dp_stats": r.get("dp_stats"),
                          **({"lat_us": r["lat_us"]} if "lat_us" in r else {}),
                          **({"verified": r["verified"]} if "verified" in r else {}),
                          **({"result": mine} if mine is not None and opt.test != "write-lat" else {})})
        except cm.CMError:
            pass                     # the client may already be gone; our numbers stand
        _report(out, opt, r)
        return r


# --------------------------------------------------------------------------- perftest on the other end
# perftest_oob.py has its exchange; here the order of its rounds per test, and the test itself on our side.
# Its parameters are not exchanged: both sides must be given the same -s/-a, -n, -q (perftest's rule).


def _peer_is_perftest(ch: cm.Channel, timeout: float) -> bool:
    """A connected client's first bytes, peeked: perftest's version string, or our connection message."""
    from . import perftest_oob
    if not select.select([ch.sock], [], [], timeout or None)[0]:
        raise PerfError(f"the client ({ch.peer}) connected and sent nothing for {timeout:g}s")
    try:
        first = ch.sock.recv(4, socket.MSG_PEEK)
    except OSError as e:
        raise PerfError(f"reading from the client ({ch.peer}): {e}") from None
    return perftest_oob.looks_like_perftest(first)


def _pt_sizes(opt: PerfOptions, size: int) -> tuple[int, ...]:
    return ALL_SIZES if opt.all_sizes else (size,)


def _pt_register(opt: PerfOptions, side: _Side, sizes: tuple[int, ...], page: int) -> int:
    """Our buffer for a perftest peer: write-lat [ post | poll ], each `region` bytes; the bw tests one region
    (every QP's target, as perftest's peer may write or read `size` bytes at it, or cycle within a page).
    Returns the region."""
    region = max(max(sizes), page)
    side.register(2 * region if opt.test == "write-lat" else region)
    return region


def _pt_key(side: _Side, i: int, va: int, test: str):
    from . import perftest_oob
    return perftest_oob.Key(qpn=side.qps[i].qp_num, psn=side.psns[i], rkey=side.mr.rkey, vaddr=va,
                            gid=cm.ip_to_gid(side.ctx.gid), out_reads=MAX_RD_ATOMIC if test == "read-bw" else 1)


def _pt_connect(side: _Side, i: int, theirs, mtu: int) -> None:
    """RTR and RTS towards a perftest QP: compat (perftest negotiates nothing), perftest's attributes."""
    from metaroce_xdp.verbs_types import QPAttr, QPState, VerbsError
    if theirs.gid[:12] != cm.ip_to_gid("0.0.0.0")[:12]:
        raise PerfError(f"the perftest peer's GID {cm.gid_text(theirs.gid)} is not an IPv4-mapped RoCEv2 GID: "
                        "give it -x with the index of its IPv4 RoCE v2 GID (show_gids)")
    attr = QPAttr(qp_state=QPState.RTR, dest_qp_num=theirs.qpn, rq_psn=theirs.psn, path_mtu=mtu,
                  dgid=cm.gid_to_ip(theirs.gid), max_dest_rd_atomic=MAX_RD_ATOMIC, min_rnr_timer=12,
                  **({"profile": "compat"} if side.compiled else {}))
    try:
        side.qps[i].modify(attr)
        side.qps[i].modify(QPAttr(qp_state=QPState.RTS, sq_psn=side.psns[i], timeout=14, retry_cnt=7, rnr_retry=7,
                                  max_rd_atomic=max(1, min(MAX_RD_ATOMIC, theirs.out_reads))))
    except VerbsError as e:
        raise PerfError(f"cannot reach {attr.dgid}: {e}") from None
    if side.daemon:
        side.qps[i].profile = "compat"


def _pt_header(out: TextIO, opt: PerfOptions, side: _Side, mtu: int, mine: list, theirs: list) -> None:
    if opt.as_json:
        return
    w = out.write
    w(RESULT_LINE + "\n" + " " * 20 + TITLES[opt.test] + "\n")
    w(f" Interface       : {opt.ifname:<12s}Transport       : MetaRoCE RC, compat (the peer is perftest)\n")
    w(f" Data plane      : {'metaroced (its compiled plane)' if side.daemon else 'compiled (in process)'}\n")
    w(f" Number of qps   : {len(mine):<12d}Connection type : RC\n")
    w(f" Mtu             : {mtu}[B]\n Data ex. method : Ethernet (perftest's exchange)\n" + RESULT_LINE + "\n")
    for name, ks in (("local", mine), ("remote", theirs)):
        for k in ks:
            w(f" {name} address: LID {k.lid:#06x} QPN {k.qpn:#06x} PSN {k.psn:#08x} RKey {k.rkey:#08x} "
              f"VAddr {k.vaddr:#016x}\n GID: {cm.gid_text(k.gid)}\n")
    w(RESULT_LINE + "\n")
    w((LAT_HEADER if opt.test == "write-lat" else BW_HEADER_GBITS if opt.report_gbits else BW_HEADER) + "\n")
    out.flush()


def _pt_wait_key(side: _Side, ex, timeout: float, what: str, step: Callable[[], None] | None = None):
    """Drive the engine (the responder must ACK, answer READs; the send-bw server re-post receives) until
    the perftest client's next key message has arrived; returns it (not yet answered)."""
    from . import perftest_oob
    dog = _Watchdog(side, timeout, what)
    blocking = step is None and getattr(side.eng, "threaded", False)
    step = step or side.eng.progress
    n = 0
    while True:
        if blocking:
            select.select([ex.ch.sock], [], [], 0.02)
            dog.n |= 1023 if time.monotonic() - dog.since > 1.0 else 0
        else:
            step()
        n += 1
        if blocking or not n % 64:
            if ex.ch._buf or select.select([ex.ch.sock], [], [], 0)[0]:
                try:
                    return perftest_oob.Key.decode(ex.ch.recv_exact(perftest_oob.KEY_LEN, timeout))
                except cm.PeerClosed:
                    raise PerfError(f"the perftest peer ({ex.ch.peer}) closed the connection {what}") from None
        dog.tick()


def _pt_result(opt: PerfOptions, side: _Side, r: dict, mtu: int, role: str) -> dict:
    r.update(test=opt.test, role=role, mtu=mtu, peer="perftest", profile="compat", plane="compiled",
             counters=side.counters())
    if "gbps" in r:
        r["mb_per_s"] = r["gbps"] * 1e9 / 8 / MIB
    return r


def _run_perftest_client(opt: PerfOptions, side: _Side, mtu: int, size: int, iters: int, out: TextIO) -> dict:
    """`metaroce perf TEST --perftest SERVER`: perftest's ib_write_bw/ib_read_bw/ib_send_bw/ib_write_lat
    server on the other end (give both sides the same -s/-a, -n and -q)."""
    from . import perftest_oob
    try:
        ch = cm.connect(opt.server, opt.port)
    except cm.ConnectFailed as e:
        raise PerfError(f"{e} (start perftest's server there first, e.g. `ib_write_bw -d DEV -x GID_INDEX`)") \
            from None
    with ch:
        ex = perftest_oob.Exchange(ch, client=True, timeout=opt.timeout)
        try:
            page, _, mtu = ex.hello(mtu)
            lat = opt.test == "write-lat"
            nq = 1 if lat else opt.qps
            side.add_qps(nq)
            sizes = _pt_sizes(opt, size)
            region = _pt_register(opt, side, sizes, page)
            if opt.test == "write-bw":
                _fill_pattern(side.buf, min(region, len(side.buf)), 1)
            mine = [_pt_key(side, i, side.mr.addr + (region if lat else 0), opt.test) for i in range(nq)]
            for i in range(nq):
                side.to_init(i)
            if lat:
                ex.key(mine[0])                                   # write_lat's extra exchange
            theirs = [ex.key(k) for k in mine]                    # round A
            for i in range(nq):
                _pt_connect(side, i, theirs[i], mtu)
            if opt.test == "send-bw":
                ex.key(mine[0])                                   # round C, then B
                [ex.key(k) for k in mine]
            else:
                [ex.key(k) for k in mine]                         # round B, then C
                ex.key(mine[0])
            _pt_header(out, opt, side, mtu, mine, theirs)
            peers = [{"va": k.vaddr, "rkey": k.rkey} for k in theirs]
            rows = []
            for j, sz in enumerate(sizes):
                last = j == len(sizes) - 1
                if lat:
                    r = _write_lat(side, opt, sz, iters, peers[0], region=region, sends_first=False)
                else:
                    if opt.test == "send-bw":
                        ex.key(mine[0])                           # the server's receives are posted
                    side.eng.progress()
                    r = _bw_client(side, opt, sz, iters, peers[0], nq, peers)
                    if opt.test == "send-bw" and opt.all_sizes:
                        ex.key(mine[0])                           # -a: after each size too
                _pt_result(opt, side, r, mtu, "client")
                opt._more_rows = not last
                _report(out, opt, r)
                rows.append(r)
            opt._more_rows = False
            r = rows[-1]
            if opt.test in ("write-bw", "read-bw"):
                ex.key(mine[0])                                   # round D: the end of the test
                k = 1.0 if opt.report_gbits else 1e9 / 8 / MIB          # in the units we print, as perftest
                ex.reports(r["bytes"], r["iterations"] * nq, r["gbps_peak"] * k, r["gbps"] * k, r["msg_rate"])
            if not lat:
                ex.close(mine[0])
        except perftest_oob.PerftestError as e:
            raise PerfError(str(e)) from None
        except cm.CMError as e:
            raise PerfError(f"perftest's exchange with {ch.peer}: {e}") from None
        if opt.test == "read-bw":
            r["verified"] = None                                  # perftest's buffer holds rand() bytes
        return r


def _run_perftest_server(opt: PerfOptions, side: _Side, mtu: int, ch: cm.Channel, out: TextIO,
                         err: TextIO) -> dict:
    """A perftest client (ib_write_bw ... SERVER) connected: perftest's exchange and rounds; the number of
    QPs is learnt from the client's keys (its first QP's key again ends round A)."""
    from . import perftest_oob
    err.write(f" perftest client {ch.peer}: using perftest's exchange (compat RoCEv2)\n")
    err.flush()
    ex = perftest_oob.Exchange(ch, client=False, timeout=opt.timeout)
    size = DEFAULT_SIZE[opt.test] if opt.size is None else opt.size
    iters = DEFAULT_ITERS[opt.test] if opt.iters is None else opt.iters
    lat = opt.test == "write-lat"
    try:
        page, _, mtu = ex.hello(mtu)
        sizes = _pt_sizes(opt, size)
        region = _pt_register(opt, side, sizes, page)
        if opt.test == "read-bw":
            _fill_pattern(side.buf, region, 2)
        va = side.mr.addr + (region if lat else 0)
        mine: list = []
        theirs: list = []

        def add_qp() -> None:
            i = len(mine)
            side.add_qps(i + 1)
            side.to_init(i)
            mine.append(_pt_key(side, i, va, opt.test))

        add_qp()
        if lat:
            ex.key(mine[0])                                       # write_lat's extra exchange
            theirs.append(ex.key(mine[0]))                        # round A (one QP)
            pending = None
        else:
            pending = None
            while True:                                           # round A, as long as new QPs come
                k = perftest_oob.Key.decode(ch.recv_exact(perftest_oob.KEY_LEN, opt.timeout))
                if theirs and k.qpn == theirs[0].qpn:
                    pending = k                                   # the next round has begun
                    break
                if len(theirs) >= 512:
                    raise PerfError("the perftest client offered more than 512 QPs")
                if len(theirs) == len(mine):
                    add_qp()
                theirs.append(k)
                ch.send(mine[len(theirs) - 1].encode())
        nq = len(theirs)
        del mine[nq:]
        for i in range(nq):
            _pt_connect(side, i, theirs[i], mtu)
        if lat:
            ex.key(mine[0])                                       # rounds B and C
            ex.key(mine[0])
        else:
            ch.send(mine[0].encode())                             # answer the pending first key of the round
            if opt.test == "send-bw":                             # it was round C; now round B
                [ex.key(k) for k in mine]
            else:                                                 # it was round B's first; the rest, then C
                [ex.key(k) for k in mine[1:]]
                ex.key(mine[0])
        _pt_header(out, opt, side, mtu, mine, theirs)
        rows = []
        if lat:
            for sz in sizes:
                r = _write_lat(side, opt, sz, iters, {"va": theirs[0].vaddr, "rkey": theirs[0].rkey},
                               region=region, sends_first=True)
                rows.append(_pt_result(opt, side, r, mtu, "server"))
                opt._more_rows = sz != sizes[-1]
                _report(out, opt, r)
        elif opt.test == "send-bw":
            for sz in sizes:
                step, st = _send_bw_server_step(side, sz, iters, opt.rx_depth)
                ex.key(mine[0])                                   # receives posted: the client may send
                dog = _Watchdog(side, opt.timeout, f"receiving the perftest client's SENDs ({st['received']} of "
                                f"{iters * nq}: give both sides the same -n and -q)")
                while st["received"] < iters * nq:
                    step()
                    dog.tick()
                secs = (st.get("t1", 0) - st.get("t0", 0)) / 1e9
                r = {"bytes": sz, "iterations": iters, "total_bytes": sz * iters * nq, "seconds": secs,
                     "gbps": sz * iters * nq * 8 / secs / 1e9 if secs > 0 else 0.0, "gbps_peak": 0.0,
                     "msg_rate": iters * nq / secs / 1e6 if secs > 0 else 0.0, "qps": nq}
                if opt.all_sizes:
                    ex.key(mine[0])                               # -a: after each size too
                rows.append(_pt_result(opt, side, r, mtu, "server"))
                opt._more_rows = sz != sizes[-1]
                _report(out, opt, r)
            ex.close(mine[0])
        else:
            k = _pt_wait_key(side, ex, opt.timeout, f"serving the perftest client's {opt.test}")   # round D
            ch.send(mine[0].encode())
            size_r, iters_r, peak, avg, rate = ex.reports(0, 0, 0.0, 0.0, 0.0)
            # perftest's server prints the client's numbers (its report, in the client's units: MB/sec unless it
            # was given --report_gbits, which this side cannot know -- give both the same): so do we
            k = 1.0 if opt.report_gbits else 8 * MIB / 1e9
            r = {"bytes": size_r, "iterations": iters_r, "total_bytes": size_r * iters_r, "seconds": None,
                 "gbps": avg * k, "gbps_peak": peak * k, "msg_rate": rate,
                 "qps": nq, "client_report": {"bytes": size_r, "iterations": iters_r, "bw_peak": peak,
                                              "bw_average": avg, "msg_rate_mpps": rate}}
            rows.append(_pt_result(opt, side, r, mtu, "server"))
            _report(out, opt, r)
            ex.close(mine[0])
    except perftest_oob.PerftestError as e:
        raise PerfError(str(e)) from None
    except cm.CMError as e:
        raise PerfError(f"perftest's exchange with {ch.peer}: {e}") from None
    finally:
        opt._more_rows = False
    r = rows[-1]
    return r


__all__ = ["PerfError", "PerfOptions", "PLANES", "TESTS", "run", "bw_stats", "lat_stats"]
