"""A client application of metaroced, remote-controlled by the daemon's tests: one process per client; and the
tests' side of it (Daemons: metaroced on two hosts and client processes of this file; PlayerProc).

    python tests/daemon_players.py SOCKET IFNAME

reads one JSON command per line on stdin and answers one JSON line on stdout ({"ok": true, ...} or
{"ok": false, "error": "<TypedError>", "message": ...}).  It uses only metaroce_xdp.daemon.client (no
numba, no BCC): everything it does goes through the daemon.  Commands:

  setup size seed          PD, a shared buffer of `size` random bytes (seed), an MR (LW|RW|RR), a CQ, a QP
  listen port / accept     passive connection set-up (spec 06) on the QP; connect host port: active side
  post ops=[...]           post work requests (write/send/read/recv with offsets into the buffers)
  wait n timeout           poll n completions; returns them
  stream op n size         post n WRITEs (or READs) of size back to back (window 32), stop at the first error
  digest off len           sha256 of a range of the local buffer
  state                    the QP's state and the daemon's query
  many n                   n more QPs (2 send, 1 receive entries each) on one CQ: their QPNs (the scale test)
  many_connect qpns ip va rkey   each of them to RTS towards the peer's QP of the same index (PSN 0)
  many_write size rounds   every QP WRITEs `size` bytes from offset i*size to the peer's n*size + i*size, all
                           posted before any is polled; `rounds` times; completions by status
  event timeout            the next asynchronous event
  punch off len            punch a hole in the buffer's memfd; hugetlb_mr: register a hugetlb memfd
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

import daemon_procs  # noqa: E402
import players  # noqa: E402
from metaroce_xdp.daemon import client  # noqa: E402
from metaroce_xdp.daemon.bench import Proc as BenchProc  # noqa: E402
from metaroce_xdp.verbs_types import (SGE, Access, QPCap, QPState, RecvWR, SendWR, VerbsError,  # noqa: E402
                                      WCStatus, WROpcode)

OPS = {"write": WROpcode.RDMA_WRITE, "write_imm": WROpcode.RDMA_WRITE_WITH_IMM, "send": WROpcode.SEND,
       "send_imm": WROpcode.SEND_WITH_IMM, "read": WROpcode.RDMA_READ}


class Player(players.Player):
    """A metaroced client's resources (tests/players.py), driven by JSON commands: each public method is one
    (its keyword arguments the command's fields, its dict the answer).  `connect` here is the connection
    set-up through the daemon (spec 06), not players.Player's RTS towards a peer in the same process."""

    ACCESS = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
    CAP = QPCap(max_send_wr=64, max_recv_wr=64)
    DEPTH = 256

    def __init__(self, sock: str, ifname: str) -> None:
        super().__init__(client.connect(sock, ifname))
        self.conn = None
        self.lst = None
        self.peer = {}

    def alloc(self, size: int) -> np.ndarray:
        return self.ctx.alloc_buf(size)

    def setup(self, size: int, seed: int, depth: int | None = None) -> dict:
        self.resources(size, access=self.ACCESS, cq_depth=depth or self.DEPTH, seed=seed, qp=True, cap=self.CAP)
        return {"qpn": self.qp.qp_num, "va": self.mr.addr, "rkey": self.mr.rkey, "lkey": self.mr.lkey,
                "pid": os.getpid()}

    def _private(self) -> dict:
        return {"va": self.mr.addr, "rkey": self.mr.rkey, "len": self.mr.length}

    def listen(self, port: int) -> dict:
        self.lst = self.ctx.listen(port)
        return {}

    def accept(self, timeout: float = 30, profile: str = "compat") -> dict:
        return self._connected(self.lst.accept(self.qp, self._private(), timeout=timeout, profile=profile))

    def connect(self, host: str, port: int, profile: str = "compat") -> dict:
        return self._connected(self.ctx.connect_qp(self.qp, host, port, self._private(), profile=profile))

    def _connected(self, conn) -> dict:
        self.conn = conn
        self.peer = conn.private
        return {"peer": conn.peer, "caps": int(conn.caps), "state": self.qp.state.name}

    def _wr(self, o: dict, wr_id: int):
        if o["op"] == "recv":
            return RecvWR(wr_id=wr_id, sg_list=[self.mr.sge(o.get("off", 0), o["len"])] if o["len"] else [])
        va = o.get("va", self.peer.get("va", 0))
        rkey = o.get("rkey", self.peer.get("rkey", 0))
        sg = [self.mr.sge(o.get("off", 0), o["len"])] if o["len"] else []
        if "addr" in o:                      # a raw SGE, for the tests of bad input
            sg = [SGE(o["addr"], o["len"], o.get("lkey", self.mr.lkey))]
        return SendWR(wr_id=wr_id, opcode=OPS[o["op"]], sg_list=sg, remote_addr=va + o.get("roff", 0), rkey=rkey,
                      imm_data=o.get("imm", 0))

    def post(self, ops: list[dict]) -> dict:
        for i, o in enumerate(ops):
            wr = self._wr(o, o.get("wr_id", i + 1))
            (self.qp.post_recv if o["op"] == "recv" else self.qp.post_send)(wr)
        return {}

    def wait(self, n: int, timeout: float = 20) -> dict:
        wcs = self.cq.wait(n, timeout)
        return {"wcs": [{"wr_id": w.wr_id, "status": w.status.name, "opcode": w.opcode.name, "byte_len": w.byte_len,
                         "imm": w.imm_data} for w in wcs]}

    def stream(self, n: int, size: int, op: str = "write", window: int = 32, timeout: float = 60,
               report_every: int = 0) -> dict:
        """n WRITEs of `size` bytes from offset 0 to the peer's offset 0 (or READs into offset size), window deep."""
        posted = done = 0
        first_err = None
        t0 = time.monotonic()
        while done < n:
            while posted < n and posted - done < window and first_err is None:
                self.qp.post_send(SendWR(wr_id=posted, opcode=OPS[op], sg_list=[self.mr.sge(0 if op == "write"
                                                                                             else size, size)],
                                         remote_addr=self.peer["va"], rkey=self.peer["rkey"]))
                posted += 1
            wcs = self.cq.poll(32)
            for w in wcs:
                done += 1
                if w.status != WCStatus.SUCCESS and first_err is None:
                    first_err = w.status.name
            if not wcs and posted - done >= window:
                os.sched_yield()             # waiting: the daemon may need this CPU
            if report_every and done and done % report_every == 0:
                print(json.dumps({"progress": done}), flush=True)
            if first_err is not None and done >= posted:
                break
            if time.monotonic() - t0 > timeout:
                return {"done": done, "posted": posted, "error": "TIMEOUT"}
        return {"done": done, "posted": posted, "error": first_err, "seconds": time.monotonic() - t0}

    def lat(self, iters: int, active: bool, size: int = 8, trace: bool = False) -> dict:
        """perftest write-lat through the daemon: each side WRITEs `size` bytes carrying the iteration number
        into the other's buffer and spins on its own buffer for the answer; one-way latency = RTT / 2.
        One work request built once and posted again each time (as perftest does).  trace: also the
        CLOCK_MONOTONIC times of each post's start and end and of each answer seen (daemon/bench.py --trace)."""
        mine = self.buf[:8].view(np.uint64)
        src = self.buf[4096:4096 + 8].view(np.uint64)
        rtts = []
        posted = completed = 0
        wr = SendWR(wr_id=1, opcode=OPS["write"], sg_list=[self.mr.sge(4096, size)], remote_addr=self.peer["va"],
                    rkey=self.peer["rkey"])
        post, poll, yield_, clock = self.qp.post_send, self.cq.poll, os.sched_yield, time.monotonic_ns
        t_post0, t_post1, t_seen = [], [], []

        def write(i: int) -> None:
            nonlocal posted
            src[0] = i
            if trace:
                t_post0.append(clock())
            post(wr)
            if trace:
                t_post1.append(clock())
            posted += 1
        deadline = time.monotonic() + 300
        for i in range(1, iters + 1):
            t0 = time.perf_counter_ns()
            if active:
                write(i)
            while int(mine[0]) != i:
                completed += len(poll(16))
                yield_()                     # the daemon may need this CPU to deliver it
                if time.monotonic() > deadline:
                    return {"error": f"stuck at iteration {i}"}
            if trace:
                t_seen.append(clock())
            if not active:
                write(i)
            else:
                rtts.append(time.perf_counter_ns() - t0)
            while posted - completed > 16:
                completed += len(poll(16))
        while completed < posted and time.monotonic() < deadline:
            completed += len(poll(16))
        tr = {"t_post0": t_post0, "t_post1": t_post1, "t_seen": t_seen} if trace else {}
        if not active:
            return tr
        r = np.array(rtts[len(rtts) // 10:], np.float64) / 2000.0
        return {"median_us": float(np.median(r)), "p99_us": float(np.percentile(r, 99)), "min_us": float(r.min()),
                "p10_us": float(np.percentile(r, 10)), "iters": iters, **tr}

    def many(self, n: int) -> dict:
        self.mcq = self.ctx.create_cq(max(2, 2 * n))
        self.mqps = [self.ctx.create_qp(self.pd, self.mcq, self.mcq, QPCap(max_send_wr=2, max_recv_wr=1))
                     for _ in range(n)]
        return {"qpns": [q.qp_num for q in self.mqps]}

    def many_connect(self, qpns: list[int], ip: str, va: int, rkey: int, timeout: int = 18) -> dict:
        self.mpeer = (va, rkey)
        for q, dest in zip(self.mqps, qpns, strict=True):
            players.to_rts(q, dest, ip, access=Access.REMOTE_WRITE, rq_psn=0, sq_psn=0, timeout=timeout)
        return {"rts": sum(q.state == QPState.RTS for q in self.mqps)}

    def many_write(self, size: int, rounds: int = 1, timeout: float = 60) -> dict:
        n = len(self.mqps)
        va, rkey = self.mpeer
        statuses: dict[str, int] = {}
        t0 = time.monotonic()
        for _ in range(rounds):
            for i, q in enumerate(self.mqps):
                q.post_send(SendWR(wr_id=i, opcode=OPS["write"], sg_list=[self.mr.sge(i * size, size)],
                                   remote_addr=va + (n + i) * size, rkey=rkey))
            done = 0
            while done < n:
                wcs = self.mcq.poll(64)
                if not wcs:
                    os.sched_yield()
                    if time.monotonic() - t0 > timeout:
                        statuses["TIMEOUT"] = n - done
                        break
                for w in wcs:
                    statuses[w.status.name] = statuses.get(w.status.name, 0) + 1
                done += len(wcs)
        return {"statuses": statuses, "seconds": time.monotonic() - t0}

    def digest(self, off: int, len: int) -> dict:  # noqa: A002
        return {"sha": hashlib.sha256(self.buf[off:off + len].tobytes()).hexdigest()}

    def punch(self, off: int, len: int) -> dict:  # noqa: A002
        """fallocate(PUNCH_HOLE) a range of the buffer's memfd, as a hostile client may (test_hostile_tenant)."""
        import ctypes
        fd = next(fd for start, end, fd, _ in self.ctx._bufs if start <= self.buf.ctypes.data < end)
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.fallocate(fd, 3, ctypes.c_long(off), ctypes.c_long(len)) != 0:   # KEEP_SIZE | PUNCH_HOLE
            raise OSError(ctypes.get_errno(), "fallocate")
        return {}

    def hugetlb_mr(self) -> dict:
        """Register a 2 MiB hugetlb memfd (MFD_HUGETLB, sealed) through the control socket directly."""
        from metaroce_xdp import shm
        fd = shm.create(2 << 20, "hostile-huge", hugepages=True)
        try:
            r, _ = self.ctx._call("reg_mr", [fd], pd=self.pd.handle, access=int(Access.LOCAL_WRITE), length=2 << 20)
        finally:
            os.close(fd)
        return {"mr": r["mr"]}

    def state(self) -> dict:
        q = self.qp.query()
        return {"state": self.qp.state.name, "query_state": q["state"].name, "error": q.get("error")}

    def event(self, timeout: float = 10) -> dict:
        ev = self.ctx.get_async_event(timeout)
        return {"event": ev.event_type.name if ev else None, "reason": ev.reason if ev else None}

    def chan_send(self, obj: dict) -> dict:
        self.conn.channel.send_json(obj)
        return {}

    def chan_recv(self, timeout: float = 30) -> dict:
        return {"msg": self.conn.channel.recv_json(timeout)}


def main() -> int:
    return serve(Player(sys.argv[1], sys.argv[2]))


def serve(p) -> int:
    """One JSON command per stdin line to player p's method of that name; one JSON answer per line."""
    print(json.dumps({"ok": True, "ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        name = cmd.pop("cmd")
        try:
            out = {"ok": True, **getattr(p, name)(**cmd)}
        except (VerbsError, TimeoutError, OSError, Exception) as e:  # noqa: BLE001 - reported to the test
            out = {"ok": False, "error": type(e).__name__, "message": str(e)}
        print(json.dumps(out), flush=True)
    return 0


# ---- the tests' side: metaroced on two hosts of a Fabric, and client processes of this file ---------------------

PLAYER = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(PLAYER))


class PlayerProc(BenchProc):
    """metaroce_xdp.daemon.bench.Proc (a child speaking JSON lines: a daemon, or a client process of this file) with
    the tests' call and assert forms."""

    def __call__(self, _wait: float = 60, **c) -> dict:
        self.send(**c)
        return self.line(_wait)

    def ok(self, _wait: float = 60, **c) -> dict:          # an assertion, not bench's RuntimeError
        r = self(_wait, **c)
        assert r["ok"], (self.name, c, r)
        return r

    def close(self) -> None:
        """The client ends as its stdin closes; killed after 10 s."""
        if self.p.poll() is None:
            try:
                self.p.stdin.close()
                self.p.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()


class Daemons:
    """metaroced on hosts A and B of a Fabric (tests/dp_players.py: `kind`, no Sides), their configurations,
    sockets and logs in one temporary directory, their pins on a bpffs mounted there; client processes of each
    (PLAYER: this file, or a script speaking its protocol).  `hosts`: {"A": (namespace, interface), "B": ...}.
    A subclass adds to the configuration (config_text) and to what runs the daemon (DAEMON_PREFIX: prlimit,
    env, ...)."""

    PLAYER = PLAYER
    DAEMON_PREFIX: tuple = ()
    TMP = "mrdaemon-"

    def __init__(self, kind: str = "flat", port: int = 19500) -> None:
        from dp_players import Fabric
        self.fabric = Fabric(kind, side=None)
        self.topo = self.fabric.topo
        self.hosts = {h: (ep.ns, ep) for h, ep in zip("AB", self.fabric.ifaces)}
        self.tmp = tempfile.mkdtemp(prefix=self.TMP)
        os.chmod(self.tmp, 0o755)
        self.bpffs = os.path.join(self.tmp, "bpf")
        os.mkdir(self.bpffs)
        subprocess.run(["mount", "-t", "bpf", "bpf", self.bpffs], check=True)
        self.prefix = os.path.join(self.bpffs, "metaroce")
        self.daemons: dict[str, PlayerProc] = {}
        self.players: list[PlayerProc] = []
        self.logs: list = []
        self.port = port

    @classmethod
    @contextlib.contextmanager
    def running(cls, *hosts: str):
        """The daemons of `hosts` started together, each then ready; all of it taken away after."""
        e = cls()
        try:
            for h in hosts:
                e.start_daemon(h)
            for h in hosts:
                e.ready(h)
            yield e
        finally:
            e.close()

    def sock(self, h: str) -> str:
        return os.path.join(self.tmp, f"{h}.sock")

    def config_text(self, h: str) -> str:
        return (f'interfaces = ["{self.hosts[h][1].ifname}"]\nsocket_path = "{self.sock(h)}"\nprogress = "sleep"\n'
                f'bpffs_prefix = "{self.prefix}"\n')

    def config(self, h: str) -> str:
        path = os.path.join(self.tmp, f"{h}.toml")
        with open(path, "w") as f:
            f.write(self.config_text(h))
        return path

    def start_daemon(self, h: str) -> PlayerProc:
        err = open(os.path.join(self.tmp, f"{h}.log"), "a")
        self.logs.append(err)
        p = self.topo.popen(self.hosts[h][0], [*self.DAEMON_PREFIX, sys.executable, "-m", "metaroce_xdp.daemon.server",
                                              "--config", self.config(h)],
                            stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT,
                            preexec_fn=daemon_procs.die_with_parent)     # dies with pytest, however it ends
        self.daemons[h] = PlayerProc(p, f"daemon {h}")
        return self.daemons[h]

    def ready(self, h: str) -> dict:
        r = self.daemons[h].line(timeout=180)
        if not r.get("ready"):
            with open(os.path.join(self.tmp, f"{h}.log")) as f:
                raise AssertionError((h, r, f.read()[-2000:]))
        return r

    def player(self, h: str) -> PlayerProc:
        ns, ep = self.hosts[h]
        p = self.topo.popen(ns, [sys.executable, self.PLAYER, self.sock(h), ep.ifname], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
        pl = PlayerProc(p, f"player {h}{len(self.players)}")
        assert pl.line(60)["ready"]
        self.players.append(pl)
        return pl

    def connect(self, size: int, seeds, **cm) -> tuple:
        """A client on A connected (spec 06; cm: the accept's and the connect's further fields) to a client on B,
        each with a buffer of `size` random bytes: (a, b, a's setup, b's setup, a's connect, b's accept)."""
        a, b = self.player("A"), self.player("B")
        sa, sb = a.ok(cmd="setup", size=size, seed=seeds[0]), b.ok(cmd="setup", size=size, seed=seeds[1])
        self.port += 1
        b.ok(cmd="listen", port=self.port)
        b.send(cmd="accept", **cm)
        ra = a.ok(cmd="connect", host=self.hosts["B"][1].ipv4, port=self.port, **cm)
        rb = b.line()
        assert rb["ok"], rb
        return a, b, sa, sb, ra, rb

    def status(self, h: str) -> dict:
        return client.status(self.sock(h))

    def release(self, *procs: PlayerProc) -> None:
        for pl in procs:
            pl.close()

    def close(self) -> None:
        for pl in self.players:
            try:
                pl.p.kill()
            except OSError:
                pass
        for d in self.daemons.values():
            daemon_procs.reap(d.p)            # SIGTERM (drains, unpins), then SIGKILL to its process group
        for f in self.logs:
            f.close()
        self.fabric.close()
        subprocess.run(["umount", self.bpffs], check=False)
        if not os.environ.get("METAROCE_KEEP_TMP"):
            subprocess.run(["rm", "-rf", self.tmp], check=False)


if __name__ == "__main__":
    raise SystemExit(main())
