"""metaroced as a service: the sd_notify protocol, signals, reload, the unit file, configuration errors,
the CLI's JSON and the Prometheus endpoint (issue 8, service and operator side).

The end-to-end tests share one real daemon (daemon/metaroced, the script the unit runs) on a veth in a
namespace, started the way systemd starts it: NOTIFY_SOCKET naming a datagram socket of the test,
WATCHDOG_USEC set, and only the capabilities of the unit's CapabilityBoundingSet (setpriv) -- so they
also prove those capabilities suffice.  A client process made through the daemon's client library
holds one QP in RTS.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import daemon_procs
import pytest

from metaroce_xdp.daemon import config as config_mod
from metaroce_xdp.daemon import main as main_mod
from metaroce_xdp.daemon.config import ConfigError, DaemonConfig, load_config
from metaroce_xdp.daemon.notify import Notifier, NotifyError, socket_address, watchdog_interval

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UNIT = os.path.join(ROOT, "daemon", "metaroced.service")
CLI = [sys.executable, "-m", "metaroce_xdp.cli"]


def _dgram(path_or_abstract: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(socket_address(path_or_abstract))
    s.settimeout(0.2)
    return s


def _recv_all(s: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(s.recv(4096).decode())
        except (socket.timeout, BlockingIOError):
            return out


# ------------------------------------------------------------------------------- without a daemon
def test_notify_messages_reach_path_and_abstract_sockets(tmp_path):
    for addr in (str(tmp_path / "notify"), f"@metaroce-test-{os.getpid()}"):
        rx = _dgram(addr)
        n = Notifier({"NOTIFY_SOCKET": addr, "WATCHDOG_USEC": "2000000"})
        assert n.enabled and n.interval == 1.0
        assert n.ready("serving mr0")
        assert n.status("x\ny")                      # one line
        assert not n.status("x y")                   # unchanged: not resent
        assert n.reloading() and n.stopping() and n.watchdog()
        msgs = _recv_all(rx)
        assert msgs[0] == "READY=1\nSTATUS=serving mr0" and msgs[1] == "STATUS=x y"
        assert re.fullmatch(r"RELOADING=1\nMONOTONIC_USEC=\d+", msgs[2])
        usec = int(msgs[2].rsplit("=", 1)[1])
        assert abs(usec - time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000) < 5_000_000
        assert msgs[3:] == ["STOPPING=1", "WATCHDOG=1"]
        assert not n.watchdog_due() and n.watchdog_due(time.monotonic() + 1.0)
        # a manager that does not read: its queue fills, and the daemon drops pings instead of blocking
        t0 = time.monotonic()
        sent = [n.watchdog() for _ in range(200)]
        assert time.monotonic() - t0 < 5 and not all(sent) and n.dropped == sent.count(False)
        rx.close()
    assert not Notifier({}).enabled and not Notifier({}).ready()          # not under systemd: silent no-op
    assert watchdog_interval({"WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"}, pid=2) is None   # another PID's
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    with pytest.raises(NotifyError):
        Notifier({"NOTIFY_SOCKET": "vsock:2:1"})


def test_config_errors_are_typed_and_name_the_option(tmp_path):
    cases = [({"cm_port": "x"}, "cm_port"), ({"cm_port": 70000}, "cm_port"), ({"progress": "spin"}, "progress"),
             ({"max_clients": 0}, "max_clients"), ({"socket_mode": "999"}, "socket_mode"),
             ({"metrics_listen": "9462"}, "metrics_listen"), ({"watchdog": "maybe"}, "watchdog"),
             ({"socket_group": "no-such-group-mr"}, "socket_group"), ({"socket_path": "rel.sock"}, "socket_path"),
             ({"log_level": "loud"}, "log_level"), ({"bogus": 1}, "bogus"),
             ({"read_rate_mbps": "eth0=fast"}, "read_rate_mbps"), ({"read_rate_mbps": -1}, "read_rate_mbps"),
             ({"read_rate_mbps": {"eth0": "x"}}, "read_rate_mbps")]
    for overrides, name in cases:
        with pytest.raises(ConfigError) as ei:
            load_config(os.devnull, overrides)
        assert ei.value.option == name and name in str(ei.value), (overrides, ei.value)
    f = tmp_path / "bad.toml"
    f.write_text("[metaroced]\nmax_qps_per_client = 'many'\n")
    with pytest.raises(ConfigError) as ei:
        load_config(str(f))
    assert ei.value.option == "max_qps_per_client"
    f.write_text("[metaroced]\ninterfaces = [\n")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_config(str(f))
    # the process: exit 2, one line naming the option (systemd does not restart it: RestartPreventExitStatus=2)
    r = subprocess.run([sys.executable, "-m", "metaroce_xdp.daemon", "--config", str(f.with_name("none.toml"))],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "cannot read" in r.stderr
    r = subprocess.run([sys.executable, "-m", "metaroce_xdp.daemon", "--config", os.devnull, "--max-clients", "-1"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "max_clients" in r.stderr


def test_default_config_file_documents_the_defaults():
    """daemon/metaroced.toml (installed as /etc/metaroce/metaroced.toml) holds exactly the built-in defaults and
    mentions every option; --print-config writes a file that reads back to the same configuration."""
    path = os.path.join(ROOT, "daemon", "metaroced.toml")
    assert load_config(path) == DaemonConfig()
    text = open(path).read()
    for name in config_mod.FIELDS:
        assert re.search(rf"^#? ?{name} = ", text, re.M), name
    r = subprocess.run([sys.executable, "-m", "metaroce_xdp.daemon", "--config", path, "--print-config", "-i", "a,b",
                        "--no-watchdog", "--metrics-listen", "127.0.0.1:9999", "--read-rate-mbps", "eth0=25000,*=1000"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(r.stdout)
        f.flush()
        assert load_config(f.name) == DaemonConfig(interfaces=["a", "b"], watchdog=False,
                                                   metrics_listen="127.0.0.1:9999",
                                                   read_rate_mbps={"eth0": 25000.0, "*": 1000.0})
    # read_rate_mbps (MR-CC-021): a number for every interface, else per interface with "*" for the rest
    cfg = load_config(os.devnull, {"read_rate_mbps": "eth0=25000,1000"})
    assert cfg.read_rate_bps("eth0") == 25e9 and cfg.read_rate_bps("eth1") == 1e9
    assert load_config(os.devnull, {"read_rate_mbps": 200}).read_rate_bps("x") == 200e6
    assert DaemonConfig().read_rate_bps("eth0") is None


def _unit_caps() -> list[str]:
    for line in open(UNIT):
        if line.startswith("CapabilityBoundingSet="):
            return line.split("=", 1)[1].split()
    raise AssertionError("no CapabilityBoundingSet in the unit")


def test_metrics_show_per_qp_series_only_when_configured():
    """/metrics answers whoever reaches it.  Before: every tenant's QPs with peer address, remote QPN, PSNs and
    owner, and every client's pid and command, always.  Now per-device aggregates by default; the per-QP and
    per-client series with metrics_per_qp = true."""
    from metaroce_xdp.daemon import metrics
    snap = {"daemon": {"version": "x", "clients": 1, "refused": {"PathInUse": 2}},
            "devices": [{"ifname": "mr0", "counters": {"plane": {"rx": 5, "rx_drop_icrc": 2, "last_to_max": 3},
                                                       "xdp_drops": {"BAD_ICRC": 1}, "wrs_taken": 4,
                                                       "rx_queues": [{"queue": 1, "rx": 6, "fill_owed": 0,
                                                                      "xsk": {"rx_dropped": 0}}],
                                                       "umem": {"total": 9, "free": 8, "sg": False}}}],
            "qps": [{"dev": "mr0", "qpn": 0x11, "state": "RTS", "type": "RC", "remote_qpn": 0x4242,
                     "remote_addr": "10.9.9.9", "sq_psn": 123456, "rq_psn": 654321, "bytes_tx": 7,
                     "rate_bps": 800, "srtt_us": 12.5,
                     "owner": {"pid": 4321, "uid": 1000, "comm": "tenant-a"}}],
            "clients": [{"pid": 4321, "uid": 1000, "comm": "tenant-a", "qps": 1, "mrs": 0, "mr_bytes": 0}]}
    text = metrics.render(lambda: snap)
    for secret in ("10.9.9.9", "16962", "123456", "654321", "4321", "tenant-a", "metaroce_qp_", "metaroce_client_"):
        assert secret not in text, secret
    assert 'metaroce_qps{dev="mr0",state="RTS"} 1.0' in text
    # counters are typed counters named by what they count (_total), one family per counter, reasons as labels;
    # gauges are gauges; no metric name inside a label
    for line in ('metaroce_plane_rx_total{dev="mr0"} 5.0', 'metaroce_plane_rx_drops_total{dev="mr0",reason="icrc"} 2.0',
                 'metaroce_plane_last_to_max{dev="mr0"} 3.0', 'metaroce_xdp_drops_total{dev="mr0",reason="bad_icrc"} 1.0',
                 'metaroce_driver_wrs_taken_total{dev="mr0"} 4.0', 'metaroce_rx_queue_frames_total{dev="mr0",queue="1"} 6.0',
                 'metaroce_xsk_rx_dropped_total{dev="mr0",queue="1"} 0.0', 'metaroce_umem_frames{dev="mr0",where="free"} 8.0',
                 "# TYPE metaroce_plane_rx_total counter", "# TYPE metaroce_plane_last_to_max gauge"):
        assert line in text, line
    assert "metaroce_device_counter" not in text and "name=" not in text
    assert re.search(r"^process_resident_memory_bytes \d", text, re.M)     # prometheus-client's ProcessCollector
    full = metrics.render(lambda: snap, per_qp=True)
    assert 'remote_addr="10.9.9.9"' in full and 'metaroce_qp_sq_psn{dev="mr0",qpn="17"} 123456.0' in full
    assert 'metaroce_client_qps{comm="tenant-a",pid="4321",uid="1000"} 1.0' in full
    assert 'metaroce_qp_tx_rate_bytes_per_second{dev="mr0",qpn="17"} 100.0' in full
    assert 'metaroce_qp_srtt_seconds{dev="mr0",qpn="17"} 1.25e-05' in full and "_bps" not in full
    assert DaemonConfig().metrics_per_qp is False
    assert load_config(os.devnull, {"metrics_per_qp": True}).metrics_per_qp is True


def test_unit_file_verifies(tmp_path):
    """`systemd-analyze verify` accepts the unit (ExecStart pointed at this tree's daemon/metaroced, as
    `make install` points it at the installed one); Type=notify, a watchdog, no CAP_SYS_ADMIN."""
    text = open(UNIT).read()
    unit = tmp_path / "metaroced.service"
    unit.write_text(text.replace("/usr/local/bin/metaroced", os.path.join(ROOT, "daemon", "metaroced")))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr
    for line in ("Type=notify", "ExecReload=/bin/kill -HUP $MAINPID", "Restart=on-failure", "ProtectSystem=strict",
                 "ProtectHome=yes", "PrivateTmp=yes", "RuntimeDirectory=metaroce", "RestartPreventExitStatus=2"):
        assert re.search(rf"^{re.escape(line)}$", text, re.M), line
    assert re.search(r"^WatchdogSec=\d+s$", text, re.M)
    caps = _unit_caps()
    assert {"CAP_BPF", "CAP_NET_ADMIN", "CAP_NET_RAW"} <= set(caps) and "CAP_SYS_ADMIN" not in caps


def test_log_lines_for_journald_terminal_and_files(tmp_path):
    import logging
    rec = logging.LogRecord("metaroced", logging.WARNING, __file__, 1, "qpn %#x: two\nlines", (0x11,), None)
    assert main_mod.LineFormatter("journal").format(rec) == "<4>qpn 0x11: two | lines"
    plain = main_mod.LineFormatter("plain").format(rec)
    assert "\033" not in plain and plain.endswith("warning qpn 0x11: two | lines")
    assert "\033[33m" in main_mod.LineFormatter("tty").format(rec)
    with open(tmp_path / "log", "w") as f:
        st = os.fstat(f.fileno())
        assert main_mod.log_mode(f, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}) == "journal"
        assert main_mod.log_mode(f, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + 1}"}) == "plain"
        assert main_mod.log_mode(f, {}) == "plain"


def test_cli_without_a_daemon_says_so_in_one_line(tmp_path):
    for args in (["dev", "show"], ["qp", "list", "-j"], ["qp", "show", "17"], ["stat", "--json"], ["top", "-n", "1"]):
        r = subprocess.run(CLI + args + ["--socket", str(tmp_path / "none.sock")], capture_output=True, text=True,
                           cwd=ROOT, timeout=60)
        assert r.returncode == 3 and r.stderr.count("\n") == 1 and "no metaroced is running" in r.stderr, (args, r)
        assert not r.stdout


FAKE_SERVICE = r"""
import os, sys, threading, time
sys.path.insert(0, sys.argv[2])
from metaroce_xdp.daemon import main
from metaroce_xdp.daemon.config import load_config

class Fake:                        # the Daemon interface, nothing behind it: this test is about the process
    def __init__(self, cfg): self.cfg = cfg
    def start(self): pass
    def run(self, stop, tick):
        while not stop.wait(0.05):
            tick()
    def drain_and_stop(self, timeout_s): print("drained", timeout_s, flush=True)
    def reload(self, cfg): self.cfg = cfg; return []
    def snapshot(self): return {"daemon": {}, "devices": [{"ifname": "fake0"}], "qps": [], "clients": []}

main.setup_logging("info")
cfg = load_config(sys.argv[1])
sys.exit(main.Service(cfg, sys.argv[1], {}, daemon_factory=Fake).run())
"""


def test_sigint_stops_like_sigterm_and_a_bad_reload_keeps_the_running_configuration(tmp_path):
    """The process layer alone (main.Service around a stand-in for server.Daemon): SIGHUP with a broken file
    is refused whole (logged, READY=1 again, still serving); SIGINT drains and exits 0 like SIGTERM."""
    conf = tmp_path / "m.toml"
    conf.write_text("[metaroced]\nmax_clients = 8\n")
    rx = _dgram(str(tmp_path / "notify"))
    env = dict(os.environ, NOTIFY_SOCKET=str(tmp_path / "notify"))
    env.pop("JOURNAL_STREAM", None)
    p = subprocess.Popen([sys.executable, "-c", FAKE_SERVICE, str(conf), ROOT], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        msgs: list[str] = []

        def wait(pred, what):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                msgs.extend(_recv_all(rx))
                if any(pred(m) for m in msgs):
                    return
            raise AssertionError(f"no {what}: {msgs}")

        wait(lambda m: m.startswith("READY=1\nSTATUS=serving fake0"), "READY=1")
        msgs.clear()
        conf.write_text("[metaroced]\nmax_clients = 0\n")
        p.send_signal(signal.SIGHUP)
        wait(lambda m: m.startswith("READY=1\nSTATUS=reload refused: max_clients must be positive"), "refusal")
        p.send_signal(signal.SIGINT)
        wait(lambda m: m.startswith("STOPPING=1"), "STOPPING=1")
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0, err
        assert out.startswith("drained 5.0")
        assert "reload refused, keeping the running configuration: max_clients must be positive" in err
        assert "SIGINT: draining" in err and "stopped (exit 0)" in err
        assert all(line.count("\n") == 0 for line in err.splitlines())
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        rx.close()


# --------------------------------------------------------------------------------- a real daemon
CLIENT = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[3])
from metaroce_xdp.daemon import client
from metaroce_xdp.verbs_types import Access, QPAttr, QPState
ctx = client.connect(sys.argv[1], sys.argv[2])
pd = ctx.alloc_pd()
buf = ctx.alloc_buf(1 << 16)
mr = pd.reg_mr(buf, Access.LOCAL_WRITE | Access.REMOTE_WRITE)
cq = ctx.create_cq(64)
qp = ctx.create_qp(pd, cq, cq)
qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=Access.REMOTE_WRITE))
qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=0x4242, rq_psn=100, path_mtu=1024, dgid="10.77.0.2"))
qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=200, timeout=14, retry_cnt=7, rnr_retry=7))
print(json.dumps({"qpn": qp.qp_num, "pid": os.getpid()}), flush=True)
sys.stdin.read()
"""


class Service:
    def __init__(self, tmp: str, ns: str, ifname: str = "mr0"):
        self.tmp, self.ns, self.ifname = tmp, ns, ifname
        self.sock = os.path.join(tmp, "metaroced.sock")
        self.conf = os.path.join(tmp, "metaroced.toml")
        self.log = os.path.join(tmp, "metaroced.log")
        with socket.socket() as s:            # a free port (in the namespace's own loopback)
            s.bind(("127.0.0.1", 0))
            self.metrics_port = s.getsockname()[1]
        self.write_conf(max_clients=64, cm_port=18515)
        self.notify_path = os.path.join(tmp, "notify")
        self.notify = _dgram(self.notify_path)
        self.msgs: list[str] = []

    def write_conf(self, **kw) -> None:
        body = {"interfaces": [self.ifname], "socket_path": self.sock, "metrics_listen": f"127.0.0.1:{self.metrics_port}",
                "metrics_per_qp": True, "drain_timeout_s": 1.0, **kw}
        with open(self.conf, "w") as f:
            f.write("[metaroced]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in body.items()))

    def start(self) -> None:
        bounding = "-all" + "".join(",+" + c[4:].lower() for c in _unit_caps())
        env = {k: v for k, v in os.environ.items() if k not in ("JOURNAL_STREAM",)}
        env.update(NOTIFY_SOCKET=self.notify_path, WATCHDOG_USEC="400000")
        argv = ["nsenter", f"--net=/run/netns/{self.ns}", "setpriv", f"--bounding-set={bounding}", "--inh-caps=-all",
                sys.executable, os.path.join(ROOT, "daemon", "metaroced"), "--config", self.conf]
        self.logf = open(self.log, "w")
        self.proc = subprocess.Popen(argv, stdout=self.logf, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                     start_new_session=True, preexec_fn=daemon_procs.die_with_parent)
        self.wait_msg(lambda m: m.startswith("READY=1"), 120, "READY=1")

    def wait_msg(self, pred, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in _recv_all(self.notify):
                self.msgs.append(m)
            hit = [m for m in self.msgs if pred(m)]
            if hit:
                return hit[0]
            if self.proc.poll() is not None:
                raise AssertionError(f"metaroced exited {self.proc.returncode} before {what}: {self.log_text()}")
        raise AssertionError(f"no {what} from metaroced within {timeout}s: {self.log_text()}")

    def log_text(self) -> str:
        self.logf.flush()
        return open(self.log).read()

    def cli(self, *args: str, ns: bool = False, check: bool = True) -> subprocess.CompletedProcess:
        pre = ["nsenter", f"--net=/run/netns/{self.ns}"] if ns else []
        r = subprocess.run(pre + CLI + list(args) + ["--socket", self.sock], capture_output=True, text=True,
                           cwd=ROOT, timeout=60)
        if check:
            assert r.returncode == 0, (args, r.stdout, r.stderr, self.log_text()[-3000:])
        return r

    def stop(self) -> None:
        if hasattr(self, "proc"):
            daemon_procs.reap(self.proc, 20)      # a test failed before stopping it: drain (unpins), else kill
        self.notify.close()
        self.logf.close()


@pytest.fixture(scope="module")
def svc():
    if os.geteuid() != 0:
        pytest.fail("needs root (namespaces, XDP)")
    from metaroce_xdp.topo import two_hosts
    topo, _pair = two_hosts()
    tmp = tempfile.mkdtemp(prefix="metaroced-svc-")
    s = Service(tmp, topo[0])
    cl = None
    try:
        s.start()
        cl = subprocess.Popen([sys.executable, "-c", CLIENT, s.sock, "mr0", ROOT], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        line = cl.stdout.readline()
        assert line, cl.stderr.read()
        s.client = json.loads(line)
        s.client_proc = cl
        s.topo = topo
        yield s
    finally:
        if cl is not None and cl.poll() is None:
            cl.kill()
            cl.wait(10)
        s.stop()
        topo.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_ready_status_and_watchdog_pings(svc):
    ready = svc.wait_msg(lambda m: m.startswith("READY=1"), 1, "READY=1")
    assert "STATUS=serving mr0" in ready
    n0 = sum(m == "WATCHDOG=1" for m in svc.msgs)
    svc.wait_msg(lambda m: m == "WATCHDOG=1" and sum(x == "WATCHDOG=1" for x in svc.msgs) >= n0 + 3, 10,
                 "three WATCHDOG=1 pings (every WATCHDOG_USEC/2 = 0.2 s)")
    # STATUS follows the daemon's state: the client's QP shows up
    svc.wait_msg(lambda m: m.startswith("STATUS=") and "1 QPs (1 RTS)" in m, 10, "a STATUS with the client's QP")
    log = svc.log_text()
    assert "ready in" in log and "\033" not in log                 # not a terminal: no colour
    # where start-up went: the phases from the process's start, BCC's thread beside them
    assert re.search(r"start-up phases \(s\): python [0-9.]+, config [0-9.]+, imports .*xdp wait .*control socket "
                     r"[0-9.]+, loop start [0-9.]+, metrics [0-9.]+ \(cpu [0-9.]+\); meanwhile in threads: .*xdp compile",
                     log), log
    assert re.search(rf"qpn {svc.client['qpn']:#x}", log)          # one line per event, with the QPN


def test_cli_json_against_the_daemon(svc):
    qpn, pid = svc.client["qpn"], svc.client["pid"]
    dev = json.loads(svc.cli("dev", "show", "-j").stdout)
    assert dev["schema"] == "metaroce.dev/1" and dev["source"] == "daemon"
    d = dev["devices"][0]
    assert d["ifname"] == "mr0" and d["gids"] and d["caps"] and d["queues"] is not None
    assert "mtu" in d and "mac" in d           # (the daemon reads the MTU from /sys, which nsenter --net leaves
                                               # showing the initial namespace: None here, 1500 on a host)
    assert "GID table" in svc.cli("dev", "show").stdout
    ql = json.loads(svc.cli("qp", "list", "-j").stdout)
    assert ql["schema"] == "metaroce.qp-list/1"
    mine = [q for q in ql["qps"] if q["qpn"] == qpn]
    assert len(mine) == 1
    q = mine[0]
    assert set(("dev", "qpn", "state", "type", "remote_qpn", "remote_addr", "sq_psn", "rq_psn", "outstanding_send",
                "outstanding_recv", "retransmits", "naks_rx", "naks_tx", "rnr", "rate_bps", "bytes_tx", "bytes_rx",
                "owner")) <= set(q)
    assert q["state"] == "RTS" and q["remote_qpn"] == 0x4242 and q["remote_addr"] == "10.77.0.2"
    assert q["sq_psn"] == 200 and q["rq_psn"] == 100 and q["owner"]["pid"] == pid
    assert f"{qpn:#x} RTS" in svc.cli("qp", "list").stdout            # text: QPNs in hex, as the log writes them
    one = json.loads(svc.cli("qp", "show", hex(qpn), "-j").stdout)
    assert one["schema"] == "metaroce.qp/1" and one["qp"]["qpn"] == qpn
    assert f"lqpn {qpn:#x} type RC state RTS rqpn 0x4242" in svc.cli("qp", "show", str(qpn)).stdout
    r = svc.cli("qp", "show", "0xfffff0", check=False)
    assert r.returncode == 1 and "no QP" in r.stderr
    stat = json.loads(svc.cli("stat", "-j").stdout)
    assert stat["schema"] == "metaroce.stat/1" and stat["totals"]["qps"] >= 1
    assert stat["totals"]["qp_states"].get("RTS", 0) >= 1
    counters = stat["devices"][0]["counters"]
    assert any(k.endswith("drops") and isinstance(v, dict) and v for k, v in counters.items())
    top = svc.cli("top", "-n", "2", "-i", "0.2", "-j").stdout.splitlines()
    assert len(top) == 2
    t = json.loads(top[-1])
    assert t["schema"] == "metaroce.top/1" and any(r["qpn"] == qpn and r["tx_bps"] == 0 for r in t["qps"])


def test_metrics_endpoint_has_per_qp_and_drop_counters(svc):
    from metaroce_xdp.topo import thread_in_netns
    with thread_in_netns(svc.ns):
        text = urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_port}/metrics", timeout=10).read().decode()
    qpn = svc.client["qpn"]
    assert re.search(rf'^metaroce_qp_info{{.*qpn="{qpn}".*state="RTS".*}} 1\.0$', text, re.M), text[:3000]
    assert re.search(rf'^metaroce_qp_tx_bytes_total{{dev="mr0",qpn="{qpn}"}} ', text, re.M)
    assert re.search(rf'^metaroce_qp_outstanding_send{{dev="mr0",qpn="{qpn}"}} 0\.0$', text, re.M)
    assert re.search(r'^metaroce_xdp_drops_total{dev="mr0",reason="[a-z_]+"} \d', text, re.M)
    assert re.search(r"^process_resident_memory_bytes \d", text, re.M)
    assert re.search(r"^process_cpu_seconds_total \d", text, re.M)
    assert re.search(r'^metaroce_plane_tx_total{dev="mr0"} \d', text, re.M)


def test_kernel_view_while_the_daemon_is_stopped(svc):
    """SIGSTOP: the socket accepts but nobody answers -> the CLI says so (exit 3); the kernel's view of the
    QP table still comes from the maps the daemon pinned."""
    pins = json.loads(svc.cli("dev", "show", "-j").stdout)["devices"][0].get("pins")
    os.kill(svc.proc.pid, signal.SIGSTOP)
    try:
        r = svc.cli("qp", "list", "-j", "--timeout", "1", check=False)
        assert r.returncode == 3 and "did not answer" in r.stderr
        args = ["qp", "list", "--kernel", "-d", "mr0", "-j"] + (["--pin-dir", pins] if pins else [])
        k = json.loads(svc.cli(*args, ns=True).stdout)
        assert k["source"] == "kernel" and k["schema"] == "metaroce.kernel-qp-list/1"   # its fields differ
        assert any(q["qpn"] == svc.client["qpn"] and q["dest_qpn"] == 0x4242 for q in k["qps"]), k
        # with -d, qp list and stat fall back to the kernel's view by themselves, and say so on stderr
        r = svc.cli("qp", "list", "-d", "mr0", "-j", "--timeout", "1", *(["--pin-dir", pins] if pins else []), ns=True)
        assert json.loads(r.stdout)["source"] == "kernel" and "did not answer" in r.stderr
        r = svc.cli("stat", "-d", "mr0", "-j", "--timeout", "1", ns=True)
        assert "kernel's counters" in r.stderr and json.loads(r.stdout)["source"] == "kernel"
    finally:
        os.kill(svc.proc.pid, signal.SIGCONT)


XFER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[5])
from metaroce_xdp.daemon import client
from metaroce_xdp.verbs_types import Access, QPCap, SendWR, WCStatus, WROpcode
role, sock, ifname, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ctx = client.connect(sock, ifname)
pd = ctx.alloc_pd()
buf = ctx.alloc_buf(1 << 20)
mr = pd.reg_mr(buf, Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ)
cq = ctx.create_cq(256)
qp = ctx.create_qp(pd, cq, cq, QPCap(max_send_wr=64, max_recv_wr=64))
mine = {"va": mr.addr, "rkey": mr.rkey}
if role == "server":
    lst = ctx.listen(port)
    print(json.dumps({"listening": port}), flush=True)
    conn = lst.accept(qp, mine, timeout=60)
    print(json.dumps({"qpn": qp.qp_num}), flush=True)
    sys.stdin.read()
    sys.exit(0)
conn = ctx.connect_qp(qp, sys.argv[6], port, mine)
print(json.dumps({"qpn": qp.qp_num}), flush=True)
import select
posted = done = 0
t_end = time.monotonic() + float(sys.argv[7])
while time.monotonic() < t_end and not select.select([sys.stdin], [], [], 0)[0]:   # 64 KiB WRITEs, 8 deep, until told
    while posted - done < 8:
        qp.post_send(SendWR(wr_id=posted, opcode=WROpcode.RDMA_WRITE, sg_list=[mr.sge(0, 65536)],
                            remote_addr=conn.private["va"], rkey=conn.private["rkey"]))
        posted += 1
    for w in cq.poll(16):
        assert w.status == WCStatus.SUCCESS, w
        done += 1
while done < posted:
    done += len(cq.wait(1, 10))
print(json.dumps({"done": done}), flush=True)
sys.stdin.read()
"""


def test_cli_shows_a_live_transfer(svc):
    """A second daemon in the peer namespace, a client on each connected through spec 06, 64 KiB WRITEs
    streaming: `metaroce top` puts the busy QP first with a throughput, `qp list` shows its PSN and bytes
    advancing in RTS."""
    tmp = tempfile.mkdtemp(prefix="metaroced-svc-b-")
    b = Service(tmp, svc.topo[1], "mr1")
    procs = []
    try:
        b.start()

        def player(ns, *args):
            p = subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", sys.executable, "-c", XFER, *args],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 cwd=ROOT)
            procs.append(p)
            return p

        def line(p):
            out = p.stdout.readline()
            assert out, p.stderr.read() if p.poll() is not None else "no output"
            return json.loads(out)

        srv = player(b.ns, "server", b.sock, "mr1", "18533", ROOT)
        assert line(srv) == {"listening": 18533}
        cli = player(svc.ns, "client", svc.sock, "mr0", "18533", ROOT, "10.77.0.2", "60")
        qpn = line(cli)["qpn"]
        line(srv)
        first = [q for q in json.loads(svc.cli("qp", "list", "-j").stdout)["qps"] if q["qpn"] == qpn][0]
        top = json.loads(svc.cli("top", "-n", "1", "-i", "1", "-j").stdout)
        later = [q for q in json.loads(svc.cli("qp", "list", "-j").stdout)["qps"] if q["qpn"] == qpn][0]
        assert top["qps"][0]["qpn"] == qpn and top["qps"][0]["tx_bps"] > 0, top        # the busy QP first
        assert [r["qpn"] for r in top["qps"]].index(svc.client["qpn"]) > 0
        assert first["state"] == later["state"] == "RTS" and first["remote_addr"] == "10.77.0.2"
        assert later["bytes_tx"] > first["bytes_tx"] > 0
        assert (later["sq_psn"] - first["sq_psn"]) % (1 << 24) > 0                       # PSNs advance
        cli.stdin.write("stop\n")
        cli.stdin.flush()
        assert line(cli)["done"] > 0                   # every WRITE completed successfully
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        if b.proc.poll() is None:
            os.kill(b.proc.pid, signal.SIGTERM)
            assert b.proc.wait(30) == 0, b.log_text()
        b.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_sighup_reload_then_sigterm_drains_and_exits_0(svc):
    """SIGHUP: RELOADING=1 (+MONOTONIC_USEC) ... READY=1; the log names what changed and what needs a restart.
    Then SIGTERM: STOPPING=1, exit 0, the socket removed.  (Last test of the module: it ends the daemon.)"""
    old_port = svc.metrics_port
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        svc.metrics_port = so.getsockname()[1]
    from metaroce_xdp.daemon.client import status
    assert status(svc.sock)["devices"][0]["caps"]["read_rate_bps"] == 10_000_000_000   # veth's speed
    svc.write_conf(max_clients=32, cm_port=18600, read_rate_mbps=300)   # metrics_listen moves to the new port too
    svc.msgs.clear()
    os.kill(svc.proc.pid, signal.SIGHUP)
    svc.wait_msg(lambda m: m.startswith("RELOADING=1\nMONOTONIC_USEC="), 10, "RELOADING=1")
    svc.wait_msg(lambda m: m.startswith("READY=1"), 10, "READY=1 after the reload")
    log = svc.log_text()
    assert "reload: max_clients 64 -> 32" in log
    # MR-CC-021: the interface's READ response rate follows the file at once
    assert status(svc.sock)["devices"][0]["caps"]["read_rate_bps"] == 300_000_000
    assert "mr0: native READ responses paced at 300 Mb/s" in log
    assert re.search(r"reload: cm_port cannot change while running", log)
    assert f"metrics_listen '127.0.0.1:{old_port}' -> '127.0.0.1:{svc.metrics_port}'" in log
    from metaroce_xdp.topo import thread_in_netns
    with thread_in_netns(svc.ns):
        text = urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_port}/metrics", timeout=10).read().decode()
    assert "metaroce_qp_info" in text
    svc.msgs.clear()
    os.kill(svc.proc.pid, signal.SIGTERM)
    svc.wait_msg(lambda m: m.startswith("STOPPING=1"), 10, "STOPPING=1")
    assert svc.proc.wait(30) == 0, svc.log_text()
    assert not os.path.exists(svc.sock)
    assert "SIGTERM: draining" in svc.log_text()


# ------------------------------------------------------------------------------- as the unit's user
def _unit_values(key: str) -> list[str]:
    return [w for line in open(UNIT) if line.startswith(key + "=") for w in line.split("=", 1)[1].split()]


def _numba_cache_for(dst: str) -> None:
    """This tree's numba cache (__pycache__ beside the sources, root's) copied into the NUMBA_CACHE_DIR layout,
    as `make install` warms /var/cache/metaroce/numba for the daemon's user."""
    from metaroce_xdp.jitcache import export_in_tree
    assert export_in_tree(dst) > 0


def test_daemon_runs_as_the_metaroce_user_with_the_units_capabilities_and_drops_them_after_attach(tmp_path):
    """The unit's User= and AmbientCapabilities= (issue 19, finding 11), as setpriv gives them: the daemon starts
    as metaroce (made from daemon/metaroce.sysusers as `make install` does), serves a WRITE between an
    unprivileged client and a peer, keeps only CAP_BPF and CAP_CHOWN once attached, and stops cleanly."""
    import pwd

    from daemon_players import PLAYER, PlayerProc
    from metaroce_xdp.topo import two_hosts
    if os.geteuid() != 0:
        pytest.skip("needs root (namespaces, XDP, setpriv)")
    try:
        pwd.getpwnam("metaroce")
    except KeyError:
        subprocess.run(["systemd-sysusers", os.path.join(ROOT, "daemon", "metaroce.sysusers")], capture_output=True)
    try:
        user = pwd.getpwnam("metaroce")
    except KeyError:
        pytest.skip("no user metaroce and systemd-sysusers could not make it")
    assert _unit_values("User") == ["metaroce"] and _unit_values("AmbientCapabilities") == _unit_caps()
    caps = ",".join("+" + c[4:].lower() for c in _unit_values("AmbientCapabilities"))
    tmp = tempfile.mkdtemp(prefix="metaroced-user-")
    os.chmod(tmp, 0o755)
    _numba_cache_for(os.path.join(tmp, "numba"))
    bpffs = os.path.join(tmp, "bpf")
    os.mkdir(bpffs)
    subprocess.run(["mount", "-t", "bpf", "bpf", bpffs], check=True)
    os.makedirs(os.path.join(bpffs, "metaroce"))
    for d, _, files in os.walk(tmp):
        for p in [d] + [os.path.join(d, f) for f in files]:
            os.chown(p, user.pw_uid, user.pw_gid)
    sock = os.path.join(tmp, "A.sock")
    conf = os.path.join(tmp, "A.toml")
    with open(conf, "w") as f:
        f.write(f'interfaces = ["mr0"]\nsocket_path = "{sock}"\nprogress = "sleep"\nbpffs_prefix = "{bpffs}/metaroce"\n'
                'socket_group = "nogroup"\nsocket_mode = "0660"\ndrain_timeout_s = 1.0\n')
    topo, pair = two_hosts()
    procs = []
    try:
        env = {**os.environ, "NUMBA_CACHE_DIR": os.path.join(tmp, "numba")}
        d = subprocess.Popen(["nsenter", f"--net=/run/netns/{topo[0]}", "setpriv", "--reuid=metaroce",
                              "--regid=metaroce", "--init-groups", f"--inh-caps={caps}", f"--ambient-caps={caps}",
                              f"--bounding-set=-all,{caps}", sys.executable, "-m", "metaroce_xdp.daemon.server",
                              "--config", conf], stdout=subprocess.PIPE, stderr=open(os.path.join(tmp, "A.log"), "w"),
                             text=True, cwd=ROOT, env=env, start_new_session=True,
                             preexec_fn=daemon_procs.die_with_parent)
        procs.append(d)
        line = d.stdout.readline()
        assert line and json.loads(line)["ready"], open(os.path.join(tmp, "A.log")).read()[-3000:]
        st = open(f"/proc/{d.pid}/status").read()
        assert re.search(rf"^Uid:\s+{user.pw_uid}\s", st, re.M)
        from metaroce_xdp.daemon.client import status
        snap = status(sock)
        assert snap["daemon"]["capabilities"] == ["chown", "bpf"], snap["daemon"]
        assert "xdp_drops" in snap["devices"][0]["counters"]            # bpf() on its maps still works
        with daemon_procs.serving(topo, topo[1], "mr1", tag="mrd-peer") as (peer_sock, _):
            a = PlayerProc(topo.popen(topo[0], ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                                sys.executable, PLAYER, sock, "mr0"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT), "a")
            b = PlayerProc(topo.popen(topo[1], [sys.executable, PLAYER, peer_sock, "mr1"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT), "b")
            procs += [a.p, b.p]
            assert a.line(60)["ready"] and b.line(60)["ready"]
            a.ok(cmd="setup", size=1 << 16, seed=1), b.ok(cmd="setup", size=1 << 16, seed=2)
            b.ok(cmd="listen", port=19600)
            b.send(cmd="accept")
            a.ok(cmd="connect", host=pair.b.ipv4, port=19600)
            assert b.line()["ok"]
            a.ok(cmd="post", ops=[{"op": "write", "len": 1 << 16}])
            assert a.ok(cmd="wait", n=1)["wcs"][0]["status"] == "SUCCESS"
            assert a.ok(cmd="digest", off=0, len=1 << 16)["sha"] == b.ok(cmd="digest", off=0, len=1 << 16)["sha"]
            a.close(), b.close()
        d.send_signal(signal.SIGTERM)
        assert d.wait(30) == 0
        out = subprocess.run(["ip", "-n", topo[0], "link", "show", "mr0"], capture_output=True, text=True).stdout
        assert "xdp" not in out                                          # detached without CAP_NET_ADMIN
    finally:
        for p in procs:
            daemon_procs.reap(p)
        topo.close()
        subprocess.run(["umount", bpffs], check=False)
        shutil.rmtree(tmp, ignore_errors=True)
