"""The rdma-core test agent (metaroce_xdp/conformance/pyverbs_agent.py) on Linux Soft-RoCE, end to end.

One QEMU VM for the module (tools/rxe_conformance.RxeVM, vm/rxe;
instance ID the first free one from 11): the Debian kernel's rdma_rxe on the
VM's eth0, the pyverbs agent serving on 10.77.<ID>.2:18516.  On this side, in
netns rxeh<ID>, OUR endpoint runs on the tap (Context.open("rxetap<ID>"): the
XDP program and an AF_XDP socket) behind the
reference agent (metaroce_xdp/agent.py) on 127.0.0.1 of that namespace.  The
test is the upper tester: AgentClient sessions to both agents, QPs connected
by hand with modify_qp (RoCEv2 GID of each side from hello), RDMA WRITE,
SEND (with immediate data), RDMA READ and the two atomics from each side over
the tap, completions polled through the agents, memory read back through them
and compared byte by byte.  Then the agent's error answers (section 9.4.3),
and remote errors that rxe reports as NAKs.

The VM takes 15-30 s to boot under TCG on an idle host (up to two minutes on
a loaded one); the `vm` mark lets `make test` leave those tests out (pytest -m
"not vm").  The first test needs no VM: the agent file is self-contained.
"""
from __future__ import annotations

import ast
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time

import pytest

from metaroce_xdp.agent import AgentClient, AgentError, AgentServer
from tools.rxe_conformance import AGENT_FILES, RxeVM, free_vm_id, in_netns

pytestmark = [pytest.mark.timeout(600)]
AGENT = os.path.join(os.path.dirname(__file__), "..", "..", "metaroce_xdp", "conformance", "pyverbs_agent.py")

# RXE_TEST_VM_ID, else the first free instance from 11 (0 is left to interactive use and make
# conformance-rxe; a VM someone else is running is never taken)
VM_ID = os.environ.get("RXE_TEST_VM_ID")
FULL = ["LOCAL_WRITE", "REMOTE_WRITE", "REMOTE_READ", "REMOTE_ATOMIC"]
MR_LEN = 65536
WAIT_MS = 20000          # TCG: a round trip through the VM can take tens of ms on a loaded host
TIMEOUT = 16             # local ACK timeout 4.096 us * 2^16 = 268 ms: nothing is lost on the tap


def test_agent_is_self_contained(tmp_path):
    """The agent runs where our package is not installed (the VM's 9p share, a NIC host): it imports
    only the standard library, pyverbs and the protocol module beside it (agentproto.py, stdlib only:
    tests/conformance/test_agentproto.py), which is what tools/rxe_conformance.py ships (AGENT_FILES); from a directory
    holding just those files it starts, and without pyverbs it says what to install."""
    tree = ast.parse(open(AGENT).read())
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    rel = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level for a in n.names}
    assert rel <= {"agentproto"}, rel
    assert mods - {"pyverbs", "agentproto"} <= set(sys.stdlib_module_names), mods - set(sys.stdlib_module_names)
    assert sorted(f.name for f in AGENT_FILES) == ["agentproto.py", "pyverbs_agent.py"]
    for f in AGENT_FILES:
        shutil.copy(f, tmp_path)
    agent = str(tmp_path / "pyverbs_agent.py")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    help_ = subprocess.run(["/usr/bin/python3", "-I", agent, "--help"], capture_output=True, text=True, env=env,
                           timeout=30, cwd="/")
    assert help_.returncode == 0 and "--gid-index" in help_.stdout, help_.stderr
    run = subprocess.run(["/usr/bin/python3", "-I", agent, "--listen", "127.0.0.1", "--port", "0"],
                         capture_output=True, text=True, env=env, timeout=30, cwd="/")
    assert run.returncode == 2 and "python3-pyverbs" in run.stderr, run.stderr    # no pyverbs on this host


@pytest.fixture(scope="module")
def vm():
    if os.geteuid() != 0:
        pytest.fail("needs root: netns, tap and QEMU")
    with RxeVM(int(VM_ID) if VM_ID else free_vm_id(11), agent_timeout=120) as v:
        yield v


@pytest.fixture(scope="module")
def ours(vm):
    """Our endpoint -- the compiled data plane, what applications get -- on the tap in the VM's netns, served by the reference agent there."""
    from metaroce_xdp.agent_iut import CompiledIUT
    with in_netns(vm.netns):
        iut = CompiledIUT.open(vm.iface, pin=False)
        srv = AgentServer(iut, "127.0.0.1", 0).start()
    try:
        yield srv
    finally:
        srv.close()
        iut.close()


def _client(vm: RxeVM, host: str, port: int) -> AgentClient:
    with in_netns(vm.netns):
        return AgentClient(host, port, timeout=30)


class Side:
    """One IUT as the upper tester sees it: a session, hello's answer, its handles."""

    def __init__(self, c: AgentClient) -> None:
        self.c = c
        self.hello = c.call("hello", proto=1)

    def setup(self, cqe: int = 64) -> "Side":
        c = self.c
        self.pd = c.call("create_pd")["pd"]
        self.mr_info = c.call("reg_mr", pd=self.pd, len=MR_LEN, access=FULL)
        self.mr = self.mr_info["mr"]
        self.cq = c.call("create_cq", cqe=cqe)["cq"]
        r = c.call("create_qp", pd=self.pd, send_cq=self.cq, recv_cq=self.cq, type="RC",
                   cap={"max_send_wr": 32, "max_recv_wr": 32, "max_send_sge": 2, "max_recv_sge": 2,
                        "max_inline_data": self.hello["limits"]["max_inline"] and 64})
        self.qp, self.qpn = r["qp"], r["qpn"]
        return self

    def connect(self, peer: "Side", psn: int, peer_psn: int, mtu: int = 1024) -> None:
        c = self.c
        c.call("modify_qp", qp=self.qp, state="INIT", attrs={"access": FULL, "pkey": 0xFFFF})
        c.call("modify_qp", qp=self.qp, state="RTR",
               attrs={"dest_qpn": peer.qpn, "rq_psn": peer_psn, "path_mtu": mtu, "dgid": peer.hello["gid"],
                      "dmac": peer.hello["mac"], "max_dest_rd_atomic": 4, "min_rnr_timer": 1,
                      "profile": "compat"})
        c.call("modify_qp", qp=self.qp, state="RTS",
               attrs={"sq_psn": psn, "timeout": TIMEOUT, "retry_cnt": 6, "rnr_retry": 6, "max_rd_atomic": 4})

    def va(self, off: int) -> str:
        return hex(int(self.mr_info["va"], 16) + off)

    def rkey(self) -> int:
        return self.mr_info["rkey"]

    def poll(self, n: int = 1, timeout_ms: int = WAIT_MS) -> list[dict]:
        out: list[dict] = []
        deadline = time.monotonic() + timeout_ms / 1000
        while len(out) < n and time.monotonic() < deadline:
            out += self.c.call("poll_cq", cq=self.cq, max=n - len(out), timeout_ms=500)["completions"]
        assert len(out) == n, f"{len(out)} of {n} completions: {out}"
        return out

    def read(self, off: int, n: int) -> bytes:
        return bytes.fromhex(self.c.call("mem_read", mr=self.mr, offset=off, len=n)["hex"])

    def write(self, off: int, data: bytes) -> None:
        self.c.call("mem_write", mr=self.mr, offset=off, hex=data.hex())

    def sge(self, off: int, n: int) -> list[dict]:
        return [{"mr": self.mr, "offset": off, "len": n}]


def _pattern(seed: int, n: int) -> bytes:
    return bytes((seed * 31 + i * 7) & 0xFF for i in range(n))


@pytest.fixture
def pair(vm, ours):
    """Our QP and rxe's QP, connected both ways, each with a 64 KiB MR of full access."""
    a = Side(_client(vm, *ours.address)).setup()
    b = Side(_client(vm, vm.vm_ip, vm.agent_port)).setup()
    a.connect(b, psn=0x100, peer_psn=0xFFFFF0)          # rxe's PSNs wrap at 2^24 during the test
    b.connect(a, psn=0xFFFFF0, peer_psn=0x100)
    yield a, b
    for s in (a, b):
        s.c.call("reset")
        s.c.close()


@pytest.mark.vm
@pytest.mark.netns
def test_hello_describes_rxe(vm):
    with _client(vm, vm.vm_ip, vm.agent_port) as c:
        h = c.call("hello", proto=1)
        assert h["proto"] == 1 and h["impl"] == "rdma-core:rxe0" and h["profiles"] == ["compat"]
        assert h["ip"] == vm.vm_ip and h["mac"] == vm.vm_mac
        assert h["gid"] == "00000000000000000000ffff" + "".join(f"{int(x):02x}" for x in vm.vm_ip.split("."))
        assert h["gid_index"] == vm.gid_index
        assert h["mtus"] == [256, 512, 1024]             # tap MTU 1500: rxe's active_mtu is 1024
        assert h["caps"] & 0x80                           # rxe executes atomics (ATOMICS)
        assert set(h["limits"]) == {"max_qp", "max_cq", "max_mr", "max_sge", "max_inline", "max_rd_atomic"}
        assert h["limits"]["max_inline"] > 0 and h["timer_granularity_us"] > 0
        caps = c.call("caps")
        assert {"sent_pkts", "rcvd_pkts"} <= set(caps["counters"]) and caps["dcqcn"] is False
        assert caps["params"] == ["dscp", "ecn", "hop_limit"]
        # 9.4.2: what the suite asks before it binds a socket or reads a QP's counters (CANNOT-DRIVE, not ERROR)
        assert caps["qp_counters"] == [] and "post_send" in caps["commands"]
        assert not {"cm_listen", "cm_connect", "cm_wait", "get_async_events"} & set(caps["commands"])
        counters = c.call("get_counters")["counters"]
        assert set(counters) == set(caps["counters"])
        assert counters["rx_dup_req"] == counters["duplicate_request"]      # the spec's name (MR-DUP-010)


@pytest.mark.vm
def test_xdp_program_passes_debian12_stock_kernels_verifier(vm):
    """The VM runs Debian 12's own kernel (6.1): its verifier accepts the XDP program as the loader
    compiles it, multi-buffer and single-buffer, and the tc programs of `metaroce fabric` and the fault
    injector (vm/endpoint/xdp_loads.py: BCC and the kernel's
    headers in the guest, the checkout's bpf/ and kern/ modules through the share).  This machine's
    6.18 accepts more: a program it loads, 6.1 refused until the byte-swapped IP lengths were masked
    (bpf/metaroce_hdr.h, mr_ntohs_bounded)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    dst = vm.share / "xdp-src"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(os.path.join(root, "bpf"), dst / "bpf")
    (dst / "kern").mkdir()
    for f in ("bccbuild.py", "bpfsys.py"):
        shutil.copy(os.path.join(root, "metaroce_xdp", "kern", f), dst / "kern")
    shutil.copy(os.path.join(root, "vm", "endpoint", "xdp_loads.py"), dst)
    r = _vm(vm, "--", "python3 /mnt/host/xdp-src/xdp_loads.py /mnt/host/xdp-src", timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "kernel 6.1." in r.stdout, r.stdout
    assert "LOADED multi-buffer" in r.stdout and "LOADED single-buffer" in r.stdout, r.stdout
    for fn in ("fab_egress", "fab_delay", "fi_tc"):                  # metaroce fabric, the fault injector
        assert f" {fn} " in r.stdout and "REFUSED" not in r.stdout, r.stdout


PP_ITERS, PP_SIZE = 50, 4096


def _vm(vm: RxeVM, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return vm._script("vmexec.sh", "-i", str(vm.vm_id), *args, timeout=timeout, check=False)


def _our_pingpong(vm: RxeVM, *args: str) -> subprocess.Popen:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return subprocess.Popen(["ip", "netns", "exec", vm.netns, sys.executable, "-m", "metaroce_xdp.cli", "pingpong",
                             "-d", vm.iface, "-g", "1", "-n", str(PP_ITERS), "-s", str(PP_SIZE), *args],
                            cwd=root, env={**os.environ, "PYTHONPATH": root}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _closing_lines_ok(out: str) -> bool:
    return (f"{2 * PP_ITERS * PP_SIZE} bytes in " in out and f"{PP_ITERS} iters in " in out)


@pytest.mark.vm
@pytest.mark.netns
def test_metaroce_pingpong_with_ibv_rc_pingpong(vm):
    """`metaroce pingpong` on its default engine (the compiled data plane, compat RoCEv2) against
    rdma-core's own ibv_rc_pingpong on rxe, each as client and as server (MR-CM-040..046).  Before
    the `ours` fixture: the tap is free for the tool's own endpoint."""
    # rxe's ibv_rc_pingpong the server, ours the client
    job = _vm(vm, "-b", "--", f"ibv_rc_pingpong -d rxe0 -g $RXE_GID_IDX -n {PP_ITERS} -s {PP_SIZE}").stdout.split()[-1]
    deadline = time.monotonic() + 90
    while True:          # its "local address" line sits in stdio's buffer: try until it listens
        ours = _our_pingpong(vm, vm.vm_ip)
        cout, cerr = ours.communicate(timeout=240)
        if ours.returncode == 0 or "Couldn't connect to" not in cerr or time.monotonic() > deadline:
            break
        time.sleep(1)
    srv = _vm(vm, "-w", job, "-t", "120", timeout=150)
    assert ours.returncode == 0, cout + cerr
    assert "compiled plane" in cerr, cerr
    assert srv.returncode == 0 and _closing_lines_ok(srv.stdout), srv.stdout + srv.stderr
    assert _closing_lines_ok(cout), cout
    assert f"GID ::ffff:{vm.vm_ip}" in cout                          # the remote address line: rxe's GID
    # ours the server, rxe's the client
    ours = _our_pingpong(vm)
    try:
        line = ours.stdout.readline()                                 # printed once it listens
        assert "local address:" in line, line + ours.stderr.read()
        cli = _vm(vm, "-t", "180", "--", f"ibv_rc_pingpong -d rxe0 -g $RXE_GID_IDX -n {PP_ITERS} -s {PP_SIZE} "
                  f"{vm.host_ip}", timeout=200)
        sout, serr = ours.communicate(timeout=60)
    finally:
        if ours.poll() is None:
            ours.kill()
            ours.wait()
    assert cli.returncode == 0 and _closing_lines_ok(cli.stdout), cli.stdout + cli.stderr
    assert ours.returncode == 0 and _closing_lines_ok(sout), sout + serr
    assert "compiled plane" in serr, serr


# perftest (Debian's 4.5+0.17 in the VM) against `metaroce perf`: its exchange, both ways, each test.  Same
# -s/-n on both sides (perftest's rule); small, as perftest under TCG moves a few tens of MB/s.
PERFTEST = {"write-bw": ("ib_write_bw", 8192, 200), "read-bw": ("ib_read_bw", 8192, 200),
            "send-bw": ("ib_send_bw", 8192, 200), "write-lat": ("ib_write_lat", 64, 200)}


def _our_perf(vm: RxeVM, test: str, size: int, iters: int, *args: str) -> subprocess.Popen:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return subprocess.Popen(["ip", "netns", "exec", vm.netns, sys.executable, "-m", "metaroce_xdp.cli", "perf", test,
                             "-d", vm.iface, "-s", str(size), "-n", str(iters), "-j", "--timeout", "60", *args],
                            cwd=root, env={**os.environ, "PYTHONPATH": root}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _perftest_row(out: str, test: str) -> list[str]:
    """The result row under perftest's table header (#bytes ...)."""
    lines = out.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.strip().startswith("#bytes"))
    return lines[i + 1].split()


@pytest.mark.vm
@pytest.mark.netns
@pytest.mark.parametrize("test", list(PERFTEST))
def test_perftest_server_and_metaroce_perf_client(vm, test):
    """perftest's server in the VM (ib_write_bw -d rxe0 -x GID ...), `metaroce perf TEST --perftest` here: the
    exchange completes, the test runs on rxe, both print results."""
    tool, size, iters = PERFTEST[test]
    job = _vm(vm, "-b", "--", f"{tool} -d rxe0 -x $RXE_GID_IDX -F -s {size} -n {iters}").stdout.split()[-1]
    deadline = time.monotonic() + 90
    while True:                                    # until perftest listens
        ours = _our_perf(vm, test, size, iters, "--perftest", vm.vm_ip)
        out, err = ours.communicate(timeout=240)
        if ours.returncode == 0 or "start perftest's server there first" not in err or time.monotonic() > deadline:
            break
        time.sleep(1)
    srv = _vm(vm, "-w", job, "-t", "120", timeout=150)
    assert ours.returncode == 0, out + err
    assert srv.returncode == 0, srv.stdout + srv.stderr
    r = json.loads(out.strip().splitlines()[-1])
    assert r["peer"] == "perftest" and r["bytes"] == size and r["iterations"] == iters, r
    if test == "write-lat":
        assert 0 < r["lat_us"]["typical"] < 1e6, r
        row = _perftest_row(srv.stdout, test)
        assert row[:2] == [str(size), str(iters)] and float(row[4]) > 0, srv.stdout     # its t_typical
    else:
        assert r["gbps"] > 0 and r["mb_per_s"] > 0, r
        row = _perftest_row(srv.stdout, test)
        assert row[0] == str(size) and float(row[3]) > 0, srv.stdout                    # BW average[MB/sec]


@pytest.mark.vm
@pytest.mark.netns
@pytest.mark.parametrize("test", list(PERFTEST))
def test_metaroce_perf_server_and_perftest_client(vm, test):
    """`metaroce perf TEST` here as the server, perftest's client in the VM (ib_write_bw ... HOST): the server
    recognises perftest's exchange by itself; both print results (a bw server prints the client's report)."""
    tool, size, iters = PERFTEST[test]
    ours = _our_perf(vm, test, size, iters)
    try:
        for line in ours.stderr:                   # its banner, once it listens
            if "Waiting for client" in line:
                break
        else:
            pytest.fail("metaroce perf did not listen: " + ours.stdout.read())
        cli = _vm(vm, "-t", "180", "--", f"{tool} -d rxe0 -x $RXE_GID_IDX -F -s {size} -n {iters} {vm.host_ip}",
                  timeout=200)
        out, err = ours.communicate(timeout=60)
    finally:
        if ours.poll() is None:
            ours.kill()
            ours.wait()
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert ours.returncode == 0, out + err
    assert "using perftest's exchange" in err, err
    r = json.loads(out.strip().splitlines()[-1])
    assert r["peer"] == "perftest" and r["role"] == "server", r
    row = _perftest_row(cli.stdout, test)
    if test == "write-lat":
        assert 0 < r["lat_us"]["typical"] < 1e6 and row[:2] == [str(size), str(iters)], (r, cli.stdout)
    else:
        assert row[0] == str(size) and float(row[3]) > 0, cli.stdout
        if test != "send-bw":                      # the bw server prints the client's report
            assert r["client_report"]["bytes"] == size and r["client_report"]["bw_average"] == pytest.approx(
                float(row[3]), rel=0.01), (r, row)
        else:
            assert r["iterations"] == iters and r["gbps"] > 0, r


@pytest.mark.vm
@pytest.mark.netns
def test_write_send_read_atomics_both_ways(pair):
    """The full session: each side WRITEs, SENDs (with immediate), READs and runs both atomics
    into the other over the tap; completions and memory through the agents."""
    a, b = pair
    for src, dst, seed in ((a, b, 1), (b, a, 2)):
        # RDMA WRITE of 3000 bytes (3 packets at MTU 1024) to offset 4096
        data = _pattern(seed, 3000)
        src.write(0, data)
        src.c.call("post_send", qp=src.qp, wr={"wr_id": "0x10", "opcode": "RDMA_WRITE", "sg_list": src.sge(0, 3000),
                                               "remote": {"va": dst.va(4096), "rkey": dst.rkey()}})
        (wc,) = src.poll()
        assert (wc["wr_id"], wc["status"], wc["opcode"]) == ("0x10", "IBV_WC_SUCCESS", "IBV_WC_RDMA_WRITE")
        assert dst.read(4096, 3000) == data
        assert dst.read(4096 + 3000, 16) == bytes(16)            # nothing past the end

        # SEND WITH IMMEDIATE of 1500 bytes into a posted receive at offset 16384
        msg = _pattern(seed + 10, 1500)
        src.write(8192, msg)
        dst.c.call("post_recv", qp=dst.qp, wr={"wr_id": "0x20", "sg_list": dst.sge(16384, 2048)})
        src.c.call("post_send", qp=src.qp, wr={"wr_id": "0x21", "opcode": "SEND_WITH_IMM", "imm": 0xC0FFEE00 + seed,
                                               "sg_list": src.sge(8192, 1500)})
        (ws,) = src.poll()
        (wr,) = dst.poll()
        assert (ws["wr_id"], ws["status"], ws["opcode"]) == ("0x21", "IBV_WC_SUCCESS", "IBV_WC_SEND")
        assert (wr["wr_id"], wr["status"], wr["opcode"]) == ("0x20", "IBV_WC_SUCCESS", "IBV_WC_RECV")
        assert wr["byte_len"] == 1500 and wr["imm"] == 0xC0FFEE00 + seed and wr["qp_num"] == dst.qpn
        assert dst.read(16384, 1500) == msg

        # plain SEND of 0 bytes (a packet with no payload)
        dst.c.call("post_recv", qp=dst.qp, wr={"wr_id": "0x22", "sg_list": dst.sge(20000, 64)})
        src.c.call("post_send", qp=src.qp, wr={"wr_id": "0x23", "opcode": "SEND", "sg_list": []})
        assert src.poll()[0]["status"] == "IBV_WC_SUCCESS"
        (w0,) = dst.poll()
        assert (w0["wr_id"], w0["status"], w0["byte_len"]) == ("0x22", "IBV_WC_SUCCESS", 0) and "imm" not in w0

        # a chain of two WRITEs (one post, the first unsignaled), then WRITE WITH IMMEDIATE: placed
        # at 24576, and the immediate consumes a receive (byte_len: the message length)
        src.write(12288, _pattern(seed + 20, 2048))
        src.c.call("post_send", qp=src.qp, wrs=[
            {"wr_id": "0x24", "opcode": "RDMA_WRITE", "sg_list": src.sge(12288, 1024), "flags": [],
             "remote": {"va": dst.va(24576), "rkey": dst.rkey()}},
            {"wr_id": "0x25", "opcode": "RDMA_WRITE", "sg_list": src.sge(13312, 1024),
             "remote": {"va": dst.va(25600), "rkey": dst.rkey()}}])
        assert [w["wr_id"] for w in src.poll()] == ["0x25"]
        dst.c.call("post_recv", qp=dst.qp, wr={"wr_id": "0x26", "sg_list": []})
        src.c.call("post_send", qp=src.qp, wr={"wr_id": "0x27", "opcode": "RDMA_WRITE_WITH_IMM", "imm": 7 + seed,
                                               "sg_list": src.sge(0, 100),
                                               "remote": {"va": dst.va(26624), "rkey": dst.rkey()}})
        assert src.poll()[0]["opcode"] == "IBV_WC_RDMA_WRITE"
        (wi,) = dst.poll()
        assert (wi["wr_id"], wi["status"], wi["opcode"], wi["imm"]) == \
            ("0x26", "IBV_WC_SUCCESS", "IBV_WC_RECV_RDMA_WITH_IMM", 7 + seed)
        assert dst.read(24576, 2048) == _pattern(seed + 20, 2048) and dst.read(26624, 100) == data[:100]

        if src is b:    # rxe offers inline data (hello: max_inline 512); our endpoint claims none
            # an INLINE SEND of 60 bytes (the payload copied at post time)
            dst.c.call("post_recv", qp=dst.qp, wr={"wr_id": "0x28", "sg_list": dst.sge(28000, 64)})
            src.write(30000, b"inline!!" * 8)
            src.c.call("post_send", qp=src.qp, wr={"wr_id": "0x29", "opcode": "SEND", "flags": ["SIGNALED", "INLINE"],
                                                   "sg_list": src.sge(30000, 60)})
            src.write(30000, bytes(64))                              # too late to change what was sent
            assert src.poll()[0]["status"] == "IBV_WC_SUCCESS"
            (wn,) = dst.poll()
            assert (wn["wr_id"], wn["byte_len"]) == ("0x28", 60) and dst.read(28000, 60) == (b"inline!!" * 8)[:60]

        # RDMA READ of 2500 bytes back from where the WRITE put them
        src.c.call("post_send", qp=src.qp, wr={"wr_id": "0x30", "opcode": "RDMA_READ", "sg_list": src.sge(32768, 2500),
                                               "remote": {"va": dst.va(4096), "rkey": dst.rkey()}})
        (wc,) = src.poll()
        assert (wc["status"], wc["opcode"], wc["byte_len"]) == ("IBV_WC_SUCCESS", "IBV_WC_RDMA_READ", 2500)
        assert src.read(32768, 2500) == data[:2500]

        # FETCH_ADD then CMP_AND_SWP on an 8-byte word at offset 40960 (little-endian in memory)
        dst.write(40960, (1000 + seed).to_bytes(8, "little"))
        src.c.call("post_send", qp=src.qp, wr={"wr_id": "0x40", "opcode": "ATOMIC_FETCH_AND_ADD",
                                               "sg_list": src.sge(48000, 8), "swap_add": "0x5",
                                               "remote": {"va": dst.va(40960), "rkey": dst.rkey()}})
        (wc,) = src.poll()
        assert (wc["status"], wc["opcode"]) == ("IBV_WC_SUCCESS", "IBV_WC_FETCH_ADD")
        assert int.from_bytes(src.read(48000, 8), "little") == 1000 + seed
        assert int.from_bytes(dst.read(40960, 8), "little") == 1005 + seed
        src.c.call("post_send", qp=src.qp, wr={"wr_id": "0x41", "opcode": "ATOMIC_CMP_AND_SWP",
                                               "sg_list": src.sge(48008, 8), "compare": hex(1005 + seed),
                                               "swap_add": "0xabcdef0123456789",
                                               "remote": {"va": dst.va(40960), "rkey": dst.rkey()}})
        (wc,) = src.poll()
        assert (wc["status"], wc["opcode"]) == ("IBV_WC_SUCCESS", "IBV_WC_COMP_SWAP")
        assert int.from_bytes(src.read(48008, 8), "little") == 1005 + seed
        assert dst.read(40960, 8) == (0xABCDEF0123456789).to_bytes(8, "little")

    # both QPs still in RTS, and rxe counted what it sent and received
    assert b.c.call("query_qp", qp=b.qp)["state"] == "RTS"
    q = b.c.call("query_qp", qp=b.qp)["attrs"]
    assert q["dest_qpn"] == a.qpn and q["path_mtu"] == 1024 and q["dgid"] == a.hello["gid"]
    assert q["dmac"] == a.hello["mac"]
    n = b.c.call("get_counters")["counters"]
    assert n["sent_pkts"] > 0 and n["rcvd_pkts"] > 0


@pytest.mark.vm
@pytest.mark.netns
def test_remote_access_error_leaves_rxe_memory_alone(pair):
    """A WRITE from our side with a wrong rkey: rxe NAKs it (remote access error), our
    completion says so, and rxe's memory is unchanged (read through its agent)."""
    a, b = pair
    b.write(0, b"\x11" * 64)
    a.write(0, b"\x99" * 64)
    a.c.call("post_send", qp=a.qp, wr={"wr_id": "0x50", "opcode": "RDMA_WRITE", "sg_list": a.sge(0, 64),
                                       "remote": {"va": b.va(0), "rkey": b.rkey() ^ 0x1000}})
    (wc,) = a.poll()
    assert (wc["wr_id"], wc["status"]) == ("0x50", "IBV_WC_REM_ACCESS_ERR")
    assert b.read(0, 64) == b"\x11" * 64
    assert a.c.call("query_qp", qp=a.qp)["state"] == "ERR"


@pytest.mark.vm
@pytest.mark.netns
def test_rxe_requester_flushes_in_err(vm, ours):
    """ERR on rxe's QP flushes its posted receives with IBV_WC_WR_FLUSH_ERR (in order)."""
    b = Side(_client(vm, vm.vm_ip, vm.agent_port)).setup()
    try:
        b.c.call("modify_qp", qp=b.qp, state="INIT", attrs={"access": FULL})
        b.c.call("post_recv", qp=b.qp, wrs=[{"wr_id": hex(0x60 + i), "sg_list": b.sge(64 * i, 64)} for i in range(3)])
        b.c.call("modify_qp", qp=b.qp, state="ERR", attrs={})
        wcs = b.poll(3)
        assert [w["wr_id"] for w in wcs] == ["0x60", "0x61", "0x62"]
        assert {w["status"] for w in wcs} == {"IBV_WC_WR_FLUSH_ERR"}
    finally:
        b.c.call("reset")
        b.c.close()


@pytest.mark.vm
@pytest.mark.netns
def test_agent_errors(vm):
    """Section 9.4.3 codes from the rdma-core agent; a failed command changes nothing."""
    with _client(vm, vm.vm_ip, vm.agent_port) as c:
        def code(cmd, **args):
            with pytest.raises(AgentError) as ei:
                c.call(cmd, **args)
            return ei.value.code

        assert code("create_pd") == "EPROTO"                      # before hello (MR-CONF-017)
        c.call("hello", proto=1)
        assert code("frobnicate") == "ENOCMD"
        assert code("dealloc_pd", pd=7) == "ENOENT"
        pd = c.call("create_pd")["pd"]
        mr = c.call("reg_mr", pd=pd, len=4096, access=["LOCAL_WRITE"])["mr"]
        assert code("reg_mr", pd=pd, len=64, access=["EXECUTE"]) == "EINVAL"
        assert code("mem_read", mr=mr, offset=4000, len=200) == "EINVAL"
        cq = c.call("create_cq", cqe=8)["cq"]
        qp = c.call("create_qp", pd=pd, send_cq=cq, recv_cq=cq, type="RC", cap={"max_recv_wr": 4})["qp"]
        assert code("create_qp", pd=pd, send_cq=cq, recv_cq=cq, type="UD", cap={}) == "ENOTSUP"
        assert code("modify_qp", qp=qp, state="RTS", attrs={"sq_psn": 256}) == "ESTATE"
        assert code("modify_qp", qp=qp, state="INIT", attrs={"pkey": 0x1234}) == "ENOTSUP"
        assert c.call("query_qp", qp=qp)["state"] == "RESET"      # the failures changed nothing
        assert code("post_send", qp=qp, wr={"wr_id": "0x1", "opcode": "SEND", "sg_list": [{"mr": mr, "len": 8}]}) \
            == "ESTATE"
        c.call("modify_qp", qp=qp, state="INIT", attrs={})
        assert code("modify_qp", qp=qp, state="RTR", attrs={"dest_qpn": 5, "rq_psn": 0, "path_mtu": 4096,
                                                            "dgid": "00" * 16}) == "EINVAL"
        assert code("modify_qp", qp=qp, state="RTR", attrs={"profile": "native"}) == "ENOTSUP"
        assert c.call("query_qp", qp=qp)["state"] == "INIT"
        assert code("destroy_cq", cq=cq) == "EBUSY"
        assert code("dealloc_pd", pd=pd) == "EBUSY"
        assert code("set_param", name="ack_delay_max_us", value=0) == "ENOTSUP"
        assert code("set_param", name="hop_limit", value=300) == "EINVAL"
        assert code("reg_mr", pd=pd, len=64, access=["LOCAL_WRITE"], remote_invalidate="yes") == "EINVAL"
        assert code("cm_connect", qp=qp, host="10.77.0.1", port=18515) == "ENOTSUP"
        assert code("get_counters", qp=qp) == "ENOTSUP"
        assert code("reg_mr", pd=pd, len=64, access=["LOCAL_WRITE"], remote_invalidate=True) == "ENOTSUP"
        # a full receive queue: EAGAIN (rxe answers ENOMEM, ibv_post_recv's "queue full")
        depth = c.call("query_qp", qp=qp)["attrs"]["max_recv_wr"]        # granted (rxe rounds up)
        posted, refused = 0, None
        while posted < 256 and refused is None:
            try:
                c.call("post_recv", qp=qp, wr={"wr_id": hex(posted + 1), "sg_list": [{"mr": mr, "len": 8}]})
                posted += 1
            except AgentError as e:
                refused = e.code
        assert refused == "EAGAIN" and depth <= posted < 256, (refused, depth, posted)
        assert code("reg_mr", pd=pd, len=1 << 31, access=["LOCAL_WRITE"]) == "ENOMEM"   # over the agent's limit
        c.call("destroy_qp", qp=qp)
        c.call("destroy_cq", cq=cq)
        c.call("reset")
        assert code("dereg_mr", mr=mr) == "ENOENT"               # reset destroyed it
        c.call("bye")


@pytest.mark.vm
@pytest.mark.netns
def test_send_with_invalidate_from_rxe(vm, ours):
    """rxe's SEND WITH INVALIDATE names the rkey of our remotely invalidatable MR: our receive
    completion carries it as invalidated_rkey, and rxe's next WRITE with that key is refused."""
    a = Side(_client(vm, *ours.address)).setup()
    b = Side(_client(vm, vm.vm_ip, vm.agent_port)).setup()
    try:
        inv = a.c.call("reg_mr", pd=a.pd, len=4096, access=FULL, remote_invalidate=True)
        a.connect(b, psn=0x300, peer_psn=0x400)
        b.connect(a, psn=0x400, peer_psn=0x300)
        a.c.call("post_recv", qp=a.qp, wr={"wr_id": "0x70", "sg_list": a.sge(0, 256)})
        b.write(0, b"inv!" * 8)
        b.c.call("post_send", qp=b.qp, wr={"wr_id": "0x71", "opcode": "SEND_WITH_INV", "sg_list": b.sge(0, 32),
                                           "invalidate_rkey": inv["rkey"]})
        assert b.poll()[0]["status"] == "IBV_WC_SUCCESS"
        (wr,) = a.poll()
        assert (wr["wr_id"], wr["status"], wr["byte_len"]) == ("0x70", "IBV_WC_SUCCESS", 32)
        assert wr["invalidated_rkey"] == inv["rkey"] and a.read(0, 32) == b"inv!" * 8
        b.c.call("post_send", qp=b.qp, wr={"wr_id": "0x72", "opcode": "RDMA_WRITE", "sg_list": b.sge(0, 8),
                                           "remote": {"va": inv["va"], "rkey": inv["rkey"]}})
        assert b.poll()[0]["status"] == "IBV_WC_REM_ACCESS_ERR"
    finally:
        for s in (a, b):
            s.c.call("reset")
            s.c.close()


def _capture_roce(ns: str, iface: str, src_ip: str, seconds: float) -> bytes | None:
    """The first RoCEv2 frame from src_ip seen on iface within `seconds` (AF_PACKET, in ns)."""
    with in_netns(ns):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    with s:
        s.bind((iface, 0))
        s.settimeout(0.5)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                f = s.recv(4096)
            except TimeoutError:
                continue
            if (len(f) > 42 and f[12:14] == b"\x08\x00" and f[23] == 17 and socket.inet_ntoa(f[26:30]) == src_ip
                    and struct.unpack("!H", f[36:38])[0] == 4791):
                return f
    return None


@pytest.mark.vm
@pytest.mark.netns
def test_set_param_hop_limit_and_dscp_reach_the_wire(vm, ours):
    """set_param hop_limit and dscp go into the address vector of rxe's next QP: its request to a
    lower-tester address (10.77.<ID>.3, MAC given as dmac: the agent's neighbour entry) leaves
    with that TTL and DSCP, to that MAC, with the QPN and PSN of modify_qp."""
    b = Side(_client(vm, vm.vm_ip, vm.agent_port)).setup()
    with _client(vm, *ours.address) as c:
        tap_mac = c.call("hello", proto=1)["mac"]                     # our endpoint is on the tap
    lt_gid = "00000000000000000000ffff" + socket.inet_aton(vm.lt_ip).hex()
    try:
        b.c.call("set_param", name="hop_limit", value=7)
        b.c.call("set_param", name="dscp", value=10)
        b.c.call("modify_qp", qp=b.qp, state="INIT", attrs={"access": FULL})
        b.c.call("modify_qp", qp=b.qp, state="RTR",
                 attrs={"dest_qpn": 0x123, "rq_psn": 0x10, "path_mtu": 1024, "dgid": lt_gid, "dmac": tap_mac})
        b.c.call("modify_qp", qp=b.qp, state="RTS", attrs={"sq_psn": 0x777, "timeout": 14, "retry_cnt": 1,
                                                           "rnr_retry": 1})
        assert b.c.call("query_qp", qp=b.qp)["attrs"]["dmac"] == tap_mac
        b.c.call("post_send", qp=b.qp, wr={"wr_id": "0x80", "opcode": "SEND", "sg_list": b.sge(0, 16)})
        f = _capture_roce(vm.netns, vm.iface, vm.vm_ip, 15.0)
        assert f is not None, "no RoCEv2 frame from rxe on the tap"
        assert f[0:6] == bytes.fromhex(tap_mac.replace(":", ""))
        assert f[22] == 7 and f[15] >> 2 == 10                        # IPv4 TTL and DSCP
        assert socket.inet_ntoa(f[30:34]) == vm.lt_ip
        bth = f[42:54]
        assert bth[0] == 0x04                                          # RC SEND ONLY
        assert int.from_bytes(bth[5:8], "big") == 0x123 and int.from_bytes(bth[9:12], "big") == 0x777
    finally:
        b.c.call("reset")
        b.c.close()
