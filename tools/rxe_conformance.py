"""Run the conformance tester against Linux Soft-RoCE (`rdma_rxe`) in the QEMU VM of vm/rxe.

    python -m tools.rxe_conformance                         # boot, agent smoke check, tear down
    python -m tools.rxe_conformance -- metaroce-conformance --agent {agent} --iface {iface} --peer-ip {lt_ip}

Steps: build the VM image (rxe-vm/build.sh, idempotent), boot it in keep mode
(up.sh -k: netns rxeh<ID> with tap rxetap<ID> 10.77.<ID>.1/24 <-> VM eth0
10.77.<ID>.2), put metaroce_xdp/conformance/pyverbs_agent.py and the protocol
module it imports (agentproto.py: AGENT_FILES) on the VM's 9p
share, start it in the VM listening on the VM's address (port 18516), wait
until it says AGENT-READY, then run the given command in netns rxeh<ID>
(`ip netns exec`).  The VM, the netns and the tap are always removed at the
end, also on Ctrl-C or SIGTERM; the agent's log is kept in
/tmp/rxevm/run/<ID>/agent.log.

In the command, {agent} (VM address:port), {iface} (the tap), {lt_ip} (an
address on the tap's subnet for the lower tester to play, 10.77.<ID>.3),
{vm_ip}, {vm_mac}, {host_ip} (the tap's own) and {netns} are replaced; the
same values are in the environment as RXE_AGENT, RXE_IFACE, RXE_LT_IP,
RXE_VM_IP, RXE_VM_MAC, RXE_HOST_IP and RXE_NETNS.  Without a command the agent smoke check runs: one AgentClient
session (hello, caps, PD/MR/CQ/QP, memory write and read back, reset).

Publishing a report into the tree (docs/conformance/rxe/: the reports and the captures and agent logs of the
failing cases):

    python -m tools.rxe_conformance --publish conformance-report-rxe docs/conformance/rxe

Library use (tests/conformance/test_rxe_agent.py):

    with RxeVM(vm_id=11) as vm:          # boots, starts the agent; tears down on exit
        with in_netns(vm.netns):           # this thread's sockets now live in rxeh11
            AgentClient(vm.vm_ip, vm.agent_port)
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from metaroce_xdp.conformance.agentproto import DEFAULT_PORT, PROTO, AgentClient
from metaroce_xdp.topo import thread_in_netns

ROOT = Path(__file__).resolve().parent.parent
# What the VM runs: the rdma-core agent and the protocol module beside it (it imports nothing else of ours)
AGENT_FILES = tuple(ROOT / "metaroce_xdp" / "conformance" / f for f in ("pyverbs_agent.py", "agentproto.py"))
VM_DIR = Path(os.environ.get("RXEVM_SCRIPTS", ROOT / "vm" / "rxe"))      # vm/rxe/README.md
RUN_BASE = Path(os.environ.get("RXEVM_DIR", "/tmp/rxevm"))
AGENT_PORT = DEFAULT_PORT


class RxeVMError(RuntimeError):
    """The VM or its agent could not be brought up; the message says what and where to look."""


# Move the calling thread into a netns by name for a block (sockets made inside stay there): how one
# process talks to the VM through its tap.  One implementation, metaroce_xdp.topo's.
in_netns = thread_in_netns


def free_vm_id(first: int = 11, last: int = 254) -> int:
    """The first VM instance ID in first..last that no QEMU and no netns uses (for tests, which
    must not take a VM that another run or a developer is using)."""
    for i in range(first, last + 1):
        if RxeVM(i).in_use() is None:
            return i
    raise RxeVMError(f"every VM id {first}..{last} is in use")


class RxeVM:
    """One Soft-RoCE VM with the pyverbs agent running in it.

    up() builds and boots, start_agent() starts the agent and waits for it,
    down() removes everything (safe to call twice, and after a failed up())."""

    def __init__(self, vm_id: int = 0, *, port: int = AGENT_PORT, smp: int = 2, mtu: int | None = None,
                 boot_timeout: float = 420.0, agent_timeout: float = 120.0, scripts: Path = VM_DIR,
                 log=None) -> None:
        if not 0 <= vm_id <= 254:
            raise ValueError(f"vm_id {vm_id}: 0..254")
        self.vm_id, self.agent_port, self.smp, self.mtu = vm_id, port, smp, mtu
        self.boot_timeout, self.agent_timeout = boot_timeout, agent_timeout
        self.scripts = Path(scripts)
        self.netns, self.iface = f"rxeh{vm_id}", f"rxetap{vm_id}"
        self.host_ip, self.vm_ip = f"10.77.{vm_id}.1", f"10.77.{vm_id}.2"
        # The address a lower tester plays on the tap: on the subnet but not the tap's own (whose
        # kernel would answer RoCE packets with ICMP port unreachable).  The VM learns its MAC from
        # the dmac of modify_qp (the agent's neighbour entry); rxeh<ID> silently drops what is sent to it.
        self.lt_ip = f"10.77.{vm_id}.3"
        self.vm_mac = f"52:54:00:77:{vm_id:02x}:02"
        self.run_dir = RUN_BASE / "run" / str(vm_id)
        self.share = self.run_dir / "share"
        self.gid_index: int | None = None
        self.agent_job: str | None = None
        self.booted = False
        self._log = log or (lambda msg: print(f"[rxe-conformance] {msg}", file=sys.stderr, flush=True))

    @property
    def agent(self) -> str:
        return f"{self.vm_ip}:{self.agent_port}"

    def env(self) -> dict:
        return {"RXE_AGENT": self.agent, "RXE_IFACE": self.iface, "RXE_VM_IP": self.vm_ip,
                "RXE_VM_MAC": self.vm_mac, "RXE_HOST_IP": self.host_ip, "RXE_LT_IP": self.lt_ip,
                "RXE_NETNS": self.netns,
                "RXE_GID_IDX": str(self.gid_index if self.gid_index is not None else "")}

    # -- the scripts of vm/rxe --------------------------------------------------------
    def _script(self, name: str, *args: str, timeout: float, check: bool = True) -> subprocess.CompletedProcess:
        argv = [str(self.scripts / name), *args]
        try:
            cp = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise RxeVMError(f"{' '.join(argv)} did not finish in {timeout:.0f} s: {e.stdout or ''}"
                             f"{e.stderr or ''}") from None
        if check and cp.returncode != 0:
            raise RxeVMError(f"{' '.join(argv)} failed ({cp.returncode}):\n{cp.stdout}{cp.stderr}")
        return cp

    def build(self) -> None:
        if not (self.scripts / "build.sh").exists():
            raise RxeVMError(f"no {self.scripts}/build.sh: set RXEVM_SCRIPTS to the rxe-vm folder")
        self._log("building the VM image (build.sh; ~1 min the first time, ~1 s when up to date)")
        self._script("build.sh", timeout=1800)

    def in_use(self) -> str | None:
        """Why this ID is taken (a live QEMU of it, or its netns), or None when it is free."""
        why = []
        pid = self.run_dir / "qemu.pid"
        text = pid.read_text().strip() if pid.exists() else ""
        if text.isdigit():
            try:
                if b"qemu-system" in Path(f"/proc/{text}/cmdline").read_bytes():
                    why.append(f"qemu pid {text}")
            except OSError:
                pass
        if Path(f"/var/run/netns/{self.netns}").exists():
            why.append(f"netns {self.netns}")
        return ", ".join(why) or None

    def up(self, replace: bool = False) -> None:
        """Build if needed and boot (up.sh -k).  A VM of this ID that is already there belongs to
        someone else (another run, a developer): refused unless `replace`, which stops it first."""
        self.build()
        busy = self.in_use()
        if busy:
            if not replace:
                raise RxeVMError(f"VM {self.vm_id} is in use ({busy}): another run owns it; pick another id "
                                 f"or stop it ({self.scripts}/down.sh -i {self.vm_id}, or --replace)")
            self._log(f"VM {self.vm_id} is there ({busy}): replacing it (down.sh -i {self.vm_id})")
            self._script("down.sh", "-i", str(self.vm_id), timeout=90, check=False)
        args = ["-i", str(self.vm_id), "-k", "-s", str(self.smp), "-t", str(int(self.boot_timeout))]
        if self.mtu:
            args += ["-M", str(self.mtu)]
        self._log(f"booting VM {self.vm_id} (netns {self.netns}, {self.iface} {self.host_ip} <-> {self.vm_ip})")
        t0 = time.monotonic()
        self.booted = True                      # from here on down() has something to remove
        cp = self._script("up.sh", *args, timeout=self.boot_timeout + 30)
        gid = (self.run_dir / "gid_idx").read_text().strip() if (self.run_dir / "gid_idx").exists() else ""
        self.gid_index = int(gid) if gid.isdigit() else None
        self._log(f"VM {self.vm_id} ready after {time.monotonic() - t0:.1f} s, RXE_GID_IDX={gid} "
                  f"({cp.stdout.strip().splitlines()[-1] if cp.stdout.strip() else ''})")

    def start_agent(self) -> None:
        """Copy the agent (AGENT_FILES) onto the share, start it in the VM and wait for AGENT-READY."""
        for src in AGENT_FILES:
            shutil.copyfile(src, self.share / src.name)
        cmd = (f"exec python3 /mnt/host/pyverbs_agent.py --dev $RXE_DEV --gid-index $RXE_GID_IDX "
               f"--listen $RXE_IP --port {self.agent_port}")
        cp = self._script("vmexec.sh", "-i", str(self.vm_id), "-b", "--", cmd, timeout=30)
        self.agent_job = cp.stdout.strip().splitlines()[-1]
        out, rc = self._job_file("out"), self._job_file("rc")
        deadline = time.monotonic() + self.agent_timeout
        while True:
            text = out.read_text(errors="replace") if out.exists() else ""
            if "AGENT-READY" in text:
                break
            if rc.exists():
                raise RxeVMError(f"the agent exited (rc {rc.read_text().strip()}) before it was ready:\n{text}")
            if time.monotonic() > deadline:
                raise RxeVMError(f"the agent was not ready after {self.agent_timeout:.0f} s:\n{text}")
            time.sleep(0.2)
        self._log(f"agent ready on {self.agent} (job {self.agent_job})")

    def _job_file(self, ext: str) -> Path:
        return self.share / "queue" / f"{self.agent_job}.{ext}"

    def agent_log(self) -> str:
        p = self._job_file("out") if self.agent_job else None
        return p.read_text(errors="replace") if p is not None and p.exists() else ""

    def down(self) -> None:
        """Stop the agent and the VM, remove the netns and the tap; keep the agent's log."""
        if self.agent_job:
            text = self.agent_log()
            if text:
                with contextlib.suppress(OSError):
                    (self.run_dir / "agent.log").write_text(text)
            with contextlib.suppress(RxeVMError):
                self._script("vmexec.sh", "-i", str(self.vm_id), "-k", self.agent_job, timeout=30, check=False)
            self.agent_job = None
        if self.booted:
            self._log(f"stopping VM {self.vm_id} (down.sh)")
            self._script("down.sh", "-i", str(self.vm_id), timeout=90, check=False)
            self.booted = False

    def __enter__(self) -> "RxeVM":
        try:
            self.up()
            self.start_agent()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    # -- the command ------------------------------------------------------------------
    def run_in_netns(self, argv: list[str], timeout: float | None = None) -> int:
        """Run argv in the VM's netns (ip netns exec) with {agent} etc. replaced; its exit code."""
        values = {"agent": self.agent, "iface": self.iface, "vm_ip": self.vm_ip, "vm_mac": self.vm_mac,
                  "host_ip": self.host_ip, "lt_ip": self.lt_ip, "netns": self.netns, "gid_index": self.gid_index}
        for key, val in values.items():            # only these placeholders: other braces stay as they are
            argv = [a.replace("{" + key + "}", str(val)) for a in argv]
        self._log(f"running in netns {self.netns}: {shlex.join(argv)}")
        env = dict(os.environ, **self.env())
        p = subprocess.Popen(["ip", "netns", "exec", self.netns, *argv], env=env, start_new_session=True)
        try:
            return p.wait(timeout=timeout)
        except BaseException:                   # Ctrl-C, SIGTERM or timeout: stop it, then tear down
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            raise


def smoke(vm: RxeVM) -> None:
    """One agent session from the VM's netns: the commands every tester session starts with."""
    with in_netns(vm.netns):
        c = AgentClient(vm.vm_ip, vm.agent_port, timeout=20)
    with c:
        h = c.call("hello", proto=PROTO)
        print(f"hello: impl {h['impl']} ({h['version']}), gid {h['gid']} ip {h['ip']} mac {h['mac']}, "
              f"caps {h['caps']:#x}, mtus {h['mtus']}, G {h['timer_granularity_us']} us, limits {h['limits']}")
        caps = c.call("caps")
        print(f"caps: counters {', '.join(caps['counters'])}")
        pd = c.call("create_pd")["pd"]
        mr = c.call("reg_mr", pd=pd, len=4096, access=["LOCAL_WRITE", "REMOTE_WRITE", "REMOTE_READ"], fill=0x5A)
        c.call("mem_write", mr=mr["mr"], offset=100, hex="0102030405")
        got = c.call("mem_read", mr=mr["mr"], offset=98, len=9)["hex"]
        if got != "5a5a01020304055a5a":
            raise RxeVMError(f"mem_read after mem_write gave {got}")
        cq = c.call("create_cq", cqe=16)["cq"]
        qp = c.call("create_qp", pd=pd, send_cq=cq, recv_cq=cq, type="RC",
                    cap={"max_send_wr": 8, "max_recv_wr": 8, "max_send_sge": 1, "max_recv_sge": 1,
                         "max_inline_data": 0})
        c.call("modify_qp", qp=qp["qp"], state="INIT", attrs={"access": ["REMOTE_WRITE"], "pkey": 0xFFFF})
        state = c.call("query_qp", qp=qp["qp"])["state"]
        if state != "INIT":
            raise RxeVMError(f"QP in {state} after modify_qp INIT")
        c.call("reset")
        c.call("bye")
    print(f"smoke: OK (QPN {qp['qpn']:#x}, rkey {mr['rkey']:#x}, memory read back)")


PUBLISH_MAX_PCAP = 256 << 10     # captures above this stay out of the tree (make conformance-rxe writes them all)


def publish(report: Path, dest: Path) -> list[str]:
    """Copy a report directory into the tree (docs/conformance/rxe/): report.md, report.html, report.jsonl,
    junit.xml, and the capture and agent log of every case with a FAIL or ERROR verdict (captures above
    PUBLISH_MAX_PCAP left out).  Files of an earlier report in captures/ and agent/ are removed first; the
    README stays.  Returns the paths written, relative to dest."""
    import json
    lines = [json.loads(x) for x in (report / "report.jsonl").read_text().splitlines() if x.strip()]
    failing = sorted({x["test"] for x in lines if x.get("verdict") in ("FAIL", "ERROR")})
    dest.mkdir(parents=True, exist_ok=True)
    for sub in ("captures", "agent"):
        shutil.rmtree(dest / sub, ignore_errors=True)
        (dest / sub).mkdir()
    out = []
    for name in ("report.md", "report.html", "report.jsonl", "junit.xml"):
        shutil.copyfile(report / name, dest / name)
        out.append(name)
    for test in failing:
        for sub, ext in (("captures", "pcap"), ("agent", "jsonl")):
            src = report / sub / f"{test}.{ext}"
            if src.is_file() and (ext != "pcap" or src.stat().st_size <= PUBLISH_MAX_PCAP):
                shutil.copyfile(src, dest / sub / src.name)
                out.append(f"{sub}/{src.name}")
    return out


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--publish"]:
        if len(argv) != 3:
            print("usage: python -m tools.rxe_conformance --publish REPORT_DIR DEST_DIR", file=sys.stderr)
            return 2
        written = publish(Path(argv[1]), Path(argv[2]))
        print(f"rxe_conformance: {len(written)} files written to {argv[2]}")
        return 0
    p = argparse.ArgumentParser(
        prog="python -m tools.rxe_conformance",
        description="Boot the Soft-RoCE VM, run the rdma-core (pyverbs) test agent in it, run COMMAND in the "
                    "VM's network namespace (default: the agent smoke check), always tear down.",
        epilog="example: python -m tools.rxe_conformance -- metaroce-conformance --agent {agent} --iface {iface} "
               "--peer-ip {lt_ip} --report conformance-report-rxe")
    p.add_argument("-i", "--id", type=int, default=int(os.environ.get("RXEVM_ID", 0)),
                   help="VM instance: netns rxeh<ID>, 10.77.<ID>.0/24 (default %(default)s)")
    p.add_argument("--port", type=int, default=AGENT_PORT, help="agent TCP port in the VM (default %(default)s)")
    p.add_argument("--smp", type=int, default=2, help="VM vCPUs (default %(default)s)")
    p.add_argument("--mtu", type=int, help="link MTU (default 1500: rxe active_mtu 1024; 9000: 4096)")
    p.add_argument("--timeout", type=float, help="seconds COMMAND may run (default: no limit)")
    p.add_argument("--keep", action="store_true", help="leave the VM running after COMMAND (down.sh -i ID)")
    p.add_argument("--replace", action="store_true",
                   help="stop a VM that already runs with this ID first (default: refuse, it is someone's)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ... (run in netns rxeh<ID>)")
    a = p.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if os.geteuid() != 0:
        print("rxe_conformance: needs root (netns, tap, QEMU)", file=sys.stderr)
        return 2

    def _terminate(signum, frame):              # SIGTERM/SIGHUP: the same clean-up as Ctrl-C
        raise KeyboardInterrupt(f"signal {signum}")
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _terminate)
    # Ctrl-C even when started with SIGINT ignored (a background job of a script)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    vm = RxeVM(a.id, port=a.port, smp=a.smp, mtu=a.mtu)
    rc = 1
    try:
        vm.up(replace=a.replace)
        vm.start_agent()
        if cmd:
            rc = vm.run_in_netns(cmd, timeout=a.timeout)
        else:
            smoke(vm)
            rc = 0
    except KeyboardInterrupt:
        print("rxe_conformance: interrupted, tearing down", file=sys.stderr)
        rc = 130
    except subprocess.TimeoutExpired:
        print(f"rxe_conformance: the command ran longer than {a.timeout} s", file=sys.stderr)
        rc = 124
    except Exception as e:  # noqa: BLE001 - tool boundary: one clear line, then the clean-up
        print(f"rxe_conformance: {type(e).__name__}: {e}", file=sys.stderr)
        if vm.agent_job:
            print(f"agent log:\n{vm.agent_log()}", file=sys.stderr)
        rc = 1
    finally:
        if a.keep and rc == 0:
            print(f"VM {a.id} left running: agent {vm.agent}; stop it with {VM_DIR}/down.sh -i {a.id}",
                  file=sys.stderr)
        else:
            # A second Ctrl-C during the clean-up must not leave the VM behind.
            old = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                vm.down()
            finally:
                signal.signal(signal.SIGINT, old)
    return rc


if __name__ == "__main__":
    sys.exit(main())
