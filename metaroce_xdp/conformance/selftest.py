"""The suite against the reference implementation, in network namespaces it builds and removes.

    IUT namespace                              tester namespace
    python -m metaroce_xdp.agent   ctl0 ---- ctl1   AgentClient (TCP 18516, control only)
      --iut compiled: dp.Context on mr0 (XDP+AF_XDP) in the agent's process
      --iut daemon:   metaroced on mr0, the agent one of its clients (daemon.client)
                                    mr0 ---- mr1    LowerTester (AF_PACKET), peer IP 10.56.0.2

The RoCE link carries nothing but RoCE (and what the kernels say on their own);
the agent's TCP session has a link of its own so that it never shares the
captured wire.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from ..topo import Topology
from .agentproto import DEFAULT_PORT

IUT_IP, LT_IP = "10.56.0.1", "10.56.0.2"
CTL_IUT, CTL_LT = "10.57.0.1", "10.57.0.2"
AGENT_PORT = DEFAULT_PORT
IUTS = ("compiled", "daemon")
MAX_MR_BYTES = 4 << 30          # the agent's metaroced: room for TC-RC-008-a's 1 GiB MR and the rest


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG = SIGKILL: the IUT processes never outlive the tester, however it ends."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)


class SelfTest:
    """Namespaces, links and the reference agent; `with SelfTest() as st: st.enter_tester()` ..."""

    def __init__(self, start_timeout: float = 300.0, agent_log=None, iut: str = "compiled") -> None:
        # start_timeout: Context.open compiles the numba data path when its cache is cold (minutes on a
        # loaded 2-core host); a warm cache opens in seconds.  iut: "compiled" (the plane in the agent's
        # process) or "daemon" (metaroced on mr0, the agent its client).
        if iut not in IUTS:
            raise ValueError(f"iut {iut!r}: one of {IUTS}")
        self.iut = iut
        self.topo = Topology(2, prefix="mrcf")
        self.proc = self.daemon = None
        self._tmp = self._bpffs = None
        self._swallow = None
        try:
            self.iut_ns, self.lt_ns = self.topo[0], self.topo[1]
            self.topo.add_veth(self.iut_ns, self.lt_ns, "mr0", "mr1", ipv4=(f"{IUT_IP}/24", f"{LT_IP}/24"))
            self.topo.add_veth(self.iut_ns, self.lt_ns, "ctl0", "ctl1", ipv4=(f"{CTL_IUT}/24", f"{CTL_LT}/24"))
            self.lt_iface = "mr1"
            cmd = [sys.executable, "-m", "metaroce_xdp.agent", "--dev", "mr0", "--listen", CTL_IUT,
                   "--port", str(AGENT_PORT), "--iut", iut]
            if iut == "daemon":
                cmd += ["--socket", self._start_daemon(start_timeout, agent_log)]
            self.proc = self.topo.popen(self.iut_ns, cmd,
                                        stdout=agent_log or subprocess.DEVNULL,
                                        stderr=subprocess.STDOUT if agent_log is not None else subprocess.DEVNULL,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_die_with_parent)
            with self.topo.enter(self.lt_ns):
                # The tester's kernel owns LT_IP: without a socket on port 4791 it would answer the IUT's
                # frames to the LT with ICMP port unreachable.  This one swallows them.
                self._swallow = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                self._swallow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                self._swallow.bind((LT_IP, 4791))
                self._wait_agent(start_timeout)
        except BaseException:
            self.close()
            raise

    def _start_daemon(self, timeout: float, log) -> str:
        """metaroced on mr0 in the IUT namespace (a bpffs and a socket of its own in a temporary directory,
        its log into the agent's); its socket path once it says ready."""
        self._tmp = tempfile.mkdtemp(prefix="mrcf-daemon-")
        bpffs = os.path.join(self._tmp, "bpf")
        os.mkdir(bpffs)
        subprocess.run(["mount", "-t", "bpf", "bpf", bpffs], check=True)
        self._bpffs = bpffs
        sock = os.path.join(self._tmp, "metaroced.sock")
        conf = os.path.join(self._tmp, "metaroced.toml")
        with open(conf, "w") as f:
            f.write(f'interfaces = ["mr0"]\nsocket_path = "{sock}"\nbpffs_prefix = "{bpffs}/metaroce"\n')
            # MR-RC-008 registers a 1 GiB MR beside the case's others: more than the shipped 1 GiB per client
            f.write(f"max_mr_bytes_per_client = {MAX_MR_BYTES}\n")
        self.daemon = self.topo.popen(self.iut_ns, [sys.executable, "-m", "metaroce_xdp.daemon.server", "--config",
                                                    conf], stdout=subprocess.PIPE, text=True,
                                      stderr=log if log is not None else subprocess.DEVNULL,
                                      preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.daemon.stdout.readline()       # metaroced says {"ready": true} on stdout
            if not line:
                raise RuntimeError(f"metaroced exited with {self.daemon.wait()} before it was ready")
            with contextlib.suppress(ValueError):
                if json.loads(line).get("ready"):
                    return sock
        raise RuntimeError(f"metaroced was not ready within {timeout:g} s")

    def _wait_agent(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the reference agent exited with {self.proc.returncode} before serving")
            try:
                socket.create_connection((CTL_IUT, AGENT_PORT), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the reference agent did not listen within {timeout:g} s") from None
                time.sleep(0.2)

    @property
    def agent_addr(self) -> tuple[str, int]:
        return CTL_IUT, AGENT_PORT

    def enter_tester(self):
        """Context manager: the calling thread in the tester's namespace (sockets made there stay there)."""
        return self.topo.enter(self.lt_ns)

    def close(self) -> None:
        if self._swallow is not None:
            with contextlib.suppress(OSError):
                self._swallow.close()
        if self.daemon is not None:
            if self.daemon.poll() is None:
                self.daemon.send_signal(signal.SIGTERM)          # it drains and unpins
                try:
                    self.daemon.wait(15)
                except subprocess.TimeoutExpired:
                    self.daemon.kill()
                    self.daemon.wait(10)
            self.daemon.stdout.close()
        self.topo.close()        # stops the agent process too
        if self._bpffs is not None:
            subprocess.run(["umount", self._bpffs], check=False)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "SelfTest":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["SelfTest", "IUT_IP", "IUTS", "LT_IP"]
