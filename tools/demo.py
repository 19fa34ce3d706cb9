"""`make demo`: MetaRoCE between two hosts on this machine.

Builds host A and host B as network namespaces joined through a third one
acting as a switch, starts an endpoint on each (XDP program + AF_XDP socket +
the compiled data plane, `from metaroce_xdp import Context`), and runs a short
visible exchange: RDMA WRITE, RDMA READ, SEND with immediate, and ATOMIC
FetchAdd, first on a clean link and then with the switch dropping, duplicating,
corrupting and reordering packets.  The QPs are connected by connection set-up
(spec 06, dp/cmconnect), so they run the native profile when both ends offer it.
Prints a summary (bytes, operations, retransmissions, SACKs or ACKs consumed in
the kernel, integrity verdict) and removes everything it built, also on Ctrl-C.

    python -m tools.demo [--size-mib N] [--no-faults] [--codec] [--daemon] [--profile auto|native|compat]

Engine: the demo builds its own hosts, so no running metaroced can serve their interfaces; it runs the
compiled data plane (metaroce_xdp.dp, what applications get) in process on each.  With --daemon it
starts one metaroced per host namespace instead and its two hosts are client processes' views of them
(metaroce_xdp.daemon.client): the traffic goes through the daemons' compiled data planes, which have no
ATOMICs (that step is skipped).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import zlib

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from metaroce_xdp.faults import FaultInjector
from metaroce_xdp.topo import switched_hosts
from metaroce_xdp.verbs_types import (SGE, Access, QPAttr, QPState, RecvWR, SendWR, WCStatus, WROpcode,
                                       wc_failure)

FULL = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC
INTACT, CORRUPT = "intact", "CORRUPT"
DEMO_CM_PORT = 18519                 # the demo's connection set-up (TCP, in B's namespace)
con = Console()


class Host:
    def __init__(self, topo, ns: str, ifname: str, size: int, daemon_sock: str | None = None) -> None:
        self.topo, self.ns, self.daemon = topo, ns, daemon_sock is not None
        access = FULL
        if self.daemon:              # a client of the metaroced serving ifname; memory it can reach
            from metaroce_xdp.daemon import client
            self.ctx = client.connect(daemon_sock, ifname)
            self.buf = self.ctx.alloc_buf(size)
            access = FULL & ~Access.REMOTE_ATOMIC
        else:
            from metaroce_xdp import Context
            with topo.enter(ns):
                self.ctx = Context.open(ifname, progress_thread=True)
            self.buf = np.zeros(size, np.uint8)
        self.access = access
        self.pd = self.ctx.alloc_pd()
        self.mr = self.pd.reg_mr(self.buf, access)
        self.cq = self.ctx.create_cq(1 << 13 if self.daemon else 1 << 16)
        self.qp = self.ctx.create_qp(self.pd, self.cq, self.cq)

    def connect(self, peer: "Host") -> None:
        """Straight to RTS with the peer's numbers (no connection set-up): the compat profile."""
        with self.topo.enter(self.ns):
            q = self.qp
            q.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=self.access))
            q.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=peer.qp.qp_num, rq_psn=0, path_mtu=1024,
                            dgid=peer.ctx.gid, max_dest_rd_atomic=8, min_rnr_timer=1))
            q.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0, timeout=12, retry_cnt=7, rnr_retry=7, max_rd_atomic=8))

    def sge(self, off: int, n: int) -> SGE:
        return SGE(self.mr.addr + off, n, self.mr.lkey)


def connect_negotiated(a: Host, b: Host, profile: str) -> str:
    """Connection set-up as applications do it (spec 06, dp/cmconnect): B listens on the CM port in its
    namespace, A connects to B's address; the profile is the one both ends agree (auto: native when both
    offer it).  Returns the agreed profile."""
    from metaroce_xdp.dp import cmconnect
    for h in (a, b):
        with h.topo.enter(h.ns):
            h.qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=h.access))

    def active() -> dict:
        with a.topo.enter(a.ns):
            return cmconnect.connect_qp(a.qp, b.ctx.local_ip, port=DEMO_CM_PORT, profile=profile)
    res, _ = cmconnect.with_acceptor(active, b.qp, DEMO_CM_PORT, profile=profile, timeout=30,
                                     enter=lambda: b.topo.enter(b.ns))
    return res["profile"]


def _run_phase(progress, label: str, host: Host, wrs: list, total_bytes: int) -> list:
    task = progress.add_task(label, total=len(wrs))
    t0 = time.monotonic()
    window = 32
    posted = done = 0
    wcs = []
    while done < len(wrs):
        while posted < len(wrs) and posted - done < window:
            host.qp.post_send(wrs[posted])
            posted += 1
        got = host.cq.poll(64)
        if not got:
            time.sleep(0.0005)
            if time.monotonic() - t0 > 120:
                raise TimeoutError(f"{label}: {done}/{len(wrs)} completions after 120 s")
            continue
        wcs += got
        done += len(got)
        progress.update(task, completed=done)
    dt = time.monotonic() - t0
    progress.update(task, description=f"{label}  [dim]{total_bytes * 8 / dt / 1e9:.2f} Gbit/s[/dim]")
    return wcs


def outcome(wcs: list, hosts: dict, data_ok) -> str:
    """A phase's verdict: the first failed completion by status and reason (a failed WR is not
    a data mismatch), else INTACT or CORRUPT from comparing the bytes."""
    bad = [(w, h) for w, h in ((w, h) for h, ws in hosts.items() for w in ws) if w.status != WCStatus.SUCCESS]
    if bad:
        # the WR that failed first, not the ones flushed after it
        w, h = next(((w, h) for w, h in bad if w.status != WCStatus.WR_FLUSH_ERR), bad[0])
        return wc_failure(w, h.qp.query().get("error"))
    return INTACT if data_ok() else CORRUPT


def exchange(a: Host, b: Host, size: int, title: str) -> dict:
    """One round of WRITE / READ / SEND / ATOMIC; returns a verdict per operation (INTACT,
    CORRUPT or a failed work request's status and reason; after a failure the QP is in
    error and the round stops)."""
    rng = np.random.default_rng(int(time.time()))
    half = size // 2
    a.buf[:half] = rng.integers(0, 256, half, dtype=np.uint8)
    b.buf[half:] = rng.integers(0, 256, size - half, dtype=np.uint8)
    chunk = 1 << 20
    n = half // chunk
    verdict = {}
    con.rule(f"[bold]{title}")
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=con) as progress:
        w = [SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(i * chunk, chunk)],
                    remote_addr=b.mr.addr + i * chunk, rkey=b.mr.rkey) for i in range(n)]
        wcs = _run_phase(progress, f"A writes {half >> 20} MiB into B", a, w, half)
        verdict["WRITE"] = outcome(wcs, {a: wcs}, lambda: zlib.crc32(a.buf[:half]) == zlib.crc32(b.buf[:half]))
        if verdict["WRITE"] not in (INTACT, CORRUPT):
            return verdict
        r = [SendWR(wr_id=i, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(half + i * chunk, chunk)],
                    remote_addr=b.mr.addr + half + i * chunk, rkey=b.mr.rkey) for i in range(n)]
        wcs = _run_phase(progress, f"A reads {half >> 20} MiB from B ", a, r, half)
        verdict["READ"] = outcome(wcs, {a: wcs}, lambda: zlib.crc32(a.buf[half:half + n * chunk]) ==
                                  zlib.crc32(b.buf[half:half + n * chunk]))
        if verdict["READ"] not in (INTACT, CORRUPT):
            return verdict
        msgs = 64
        b.qp.post_recv([RecvWR(wr_id=1000 + i, sg_list=[b.sge(i * 4096, 4096)]) for i in range(msgs)])
        s = [SendWR(wr_id=i, opcode=WROpcode.SEND_WITH_IMM, sg_list=[a.sge(i * 4096, 4096)], imm_data=i)
             for i in range(msgs)]
        wcs = _run_phase(progress, f"A sends {msgs} messages with immediate", a, s, msgs * 4096)
        deadline = time.monotonic() + 30
        rwcs = []
        while len(rwcs) < msgs and time.monotonic() < deadline:
            rwcs += b.cq.poll(64)
        verdict["SEND"] = outcome(wcs, {a: wcs, b: rwcs},
                                  lambda: len(rwcs) == msgs and [x.imm_data for x in rwcs] == list(range(msgs)))
        if verdict["SEND"] not in (INTACT, CORRUPT) or a.daemon:
            return verdict                      # the daemon's compiled data plane does no ATOMICs
        cell = size - 8
        b.buf[cell:] = 0
        k = 256
        at = [SendWR(wr_id=i, opcode=WROpcode.ATOMIC_FETCH_AND_ADD, sg_list=[a.sge(size - 4096 + (i % 64) * 8, 8)],
                     remote_addr=b.mr.addr + cell, rkey=b.mr.rkey, compare_add=1) for i in range(k)]
        wcs = _run_phase(progress, f"A does {k} FetchAdd on one counter", a, at, k * 8)
        verdict["ATOMIC"] = outcome(wcs, {a: wcs}, lambda: int(b.buf[cell:].view(np.uint64)[0]) == k)
    return verdict


def _daemon_table(a: Host, b: Host) -> Table:
    """The summary from the daemons' snapshots (their `status` op): per-QP bytes, port counters, XDP's."""
    from metaroce_xdp.daemon.client import status
    snaps = [status(h.ctx.socket_path) for h in (a, b)]
    qps = [next(q for q in s["qps"] if q["qpn"] == h.qp.qp_num) for s, h in zip(snaps, (a, b))]
    dev = [s["devices"][0]["counters"] for s in snaps]
    pl = [d["plane"] for d in dev]
    t = Table(title=f"summary (through metaroced: pids {snaps[0]['daemon']['pid']}, {snaps[1]['daemon']['pid']})")
    t.add_column("")
    t.add_column("host A (requester)", justify="right")
    t.add_column("host B (responder)", justify="right")
    t.add_row("payload bytes sent", f"{qps[0]['bytes_tx']:,}", f"{qps[1]['bytes_tx']:,}")
    t.add_row("packets sent", f"{pl[0].get('tx', 0):,}", f"{pl[1].get('tx', 0):,}")
    t.add_row("retransmissions", str(pl[0].get("retransmits")), str(pl[1].get("retransmits")))
    t.add_row("local ACK timeouts", str(pl[0].get("timeouts")), str(pl[1].get("timeouts")))
    t.add_row("NAKs received / sent", str(pl[0].get("naks_seen")), str(pl[1].get("tx_nak")))
    t.add_row("duplicate requests seen", "", str(pl[1].get("rx_dup")))
    ev = dev[0].get("xdp_events", {})
    t.add_row("ACKs + NAKs consumed by the XDP program", f"{ev.get('ACK_CONSUMED', 0) + ev.get('NAK_CONSUMED', 0):,}",
              "")
    t.add_row("frames dropped for a bad ICRC (user / kernel)",
              *(f"{p.get('rx_drop_icrc')} / {d.get('xdp_drops', {}).get('BAD_ICRC')}" for p, d in zip(pl, dev)))
    return t


def summary(a: Host, b: Host, verdicts: dict, faults: dict | None) -> int:
    """Print the table and the verdicts; 0 when every operation is intact, 1 otherwise."""
    if a.daemon:
        con.print(_daemon_table(a, b))
    else:
        con.print(_plane_table(a, b))
    return _verdicts(verdicts, faults)


def _summary(title: str) -> Table:
    """The summary table's frame: a row label, then host A's and host B's column."""
    t = Table(title=title)
    t.add_column("")
    t.add_column("host A (requester)", justify="right")
    t.add_column("host B (responder)", justify="right")
    return t


def _plane_table(a: Host, b: Host) -> Table:
    """The summary from the compiled planes' port counters (each host's port carries only the demo's QP)
    and the XDP programs' counters."""
    pl = [h.ctx.stats() for h in (a, b)]
    ev_a = a.ctx.loader.events()
    native = a.qp.profile == "native"
    t = _summary(f"summary (compiled data plane, {a.qp.profile} profile)")
    t.add_row("payload bytes placed", f"{pl[0]['rx_bytes']:,}", f"{pl[1]['rx_bytes']:,}")
    t.add_row("packets sent", f"{pl[0]['tx']:,}", f"{pl[1]['tx']:,}")
    if native:
        nc = [h.qp.native_counters() for h in (a, b)]
        t.add_row("retransmissions: selective (SACK) / tail probe / timeout",
                  *(f"{n['c_retx_sack']} / {n['c_retx_tlp']} / {n['c_retx_rto']}" for n in nc))
        t.add_row("READs re-requested / atomics replayed", f"{nc[0]['c_rereq']} / {nc[0]['c_at_replay']}", "")
        t.add_row("SACKs received (consumed by the XDP program) / sent",
                  f"{nc[0]['c_sack_rx']:,} ({nc[0]['c_sack_kern']:,})", f"{nc[1]['c_sack_tx']:,}")
        t.add_row("packets placed out of order / duplicates dropped", "", f"{nc[1]['c_ooo']:,} / {nc[1]['c_dup']:,}")
        t.add_row("frames dropped for a bad ICRC (user / kernel)",
                  *(f"{p['rx_drop_icrc']} / {h.ctx.loader.drops()['BAD_ICRC']}" for p, h in zip(pl, (a, b))))
        return t
    t.add_row("retransmissions (go-back-N)", str(pl[0]["retransmits"]), str(pl[1]["retransmits"]))
    t.add_row("local ACK timeouts", str(pl[0]["timeouts"]), str(pl[1]["timeouts"]))
    t.add_row("NAKs received / sent", str(pl[0]["naks_seen"]), str(pl[1]["tx_nak"]))
    t.add_row("duplicate requests seen", "", str(pl[1]["rx_dup"]))
    t.add_row("ACKs + NAKs consumed by the XDP program", f"{ev_a['ACK_CONSUMED'] + ev_a['NAK_CONSUMED']:,}", "")
    t.add_row("frames dropped for a bad ICRC (user / kernel)",
              *(f"{p['rx_drop_icrc']} / {h.ctx.loader.drops()['BAD_ICRC']}" for p, h in zip(pl, (a, b))))
    return t


def _verdicts(verdicts: dict, faults: dict | None) -> int:
    if faults:
        con.print("switch impairments: " + ", ".join(f"{k} {v}" for k, v in faults.items()))
    failed = [f for v in verdicts.values() for f in v.values() if f not in (INTACT, CORRUPT)]
    corrupt = any(f == CORRUPT for v in verdicts.values() for f in v.values())
    for title, v in verdicts.items():
        con.print(f"{title}: " + "  ".join(f"{k} [{'green' if f == INTACT else 'red'}]{f}[/]"
                                             for k, f in v.items() if f in (INTACT, CORRUPT)))
        for f in v.values():
            if f not in (INTACT, CORRUPT):
                con.print(f"  [red]{escape(f)}", soft_wrap=True)
    if failed:
        con.rule(f"[red]{len(failed)} operation(s) failed: see the completion status above")
        return 1
    if corrupt:
        con.rule("[red]integrity check FAILED: completions succeeded but the bytes differ")
        return 1
    con.rule("[green]integrity verified: every byte where it belongs")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=16, help="memory region per host (default 16)")
    ap.add_argument("--no-faults", action="store_true", help="skip the lossy-switch round")
    ap.add_argument("--codec", action="store_true", help="show the packet codec demo instead")
    ap.add_argument("--daemon", action="store_true", help="run each host through a metaroced started in its "
                    "namespace (the hosts are the daemons' clients) instead of an in-process engine")
    ap.add_argument("--profile", choices=("auto", "native", "compat"), default="auto",
                    help="the profile the hosts' QPs negotiate at connection set-up (default auto: native "
                    "when both ends offer it; through the daemons: compat)")
    args = ap.parse_args(argv)
    if args.profile == "native" and args.daemon:
        ap.error("--profile native needs the in-process compiled plane (no --daemon)")
    if args.codec:
        from . import demo_codec
        return demo_codec.main()
    if os.geteuid() != 0:
        con.print("[red]the demo needs root (network namespaces, XDP, AF_XDP): run `sudo make demo`")
        return 2
    size = max(4, args.size_mib) << 20
    topo = None
    hosts: list[Host] = []
    daemons: list = []
    try:
        con.print("building hosts A and B (network namespaces) joined by a switch namespace M ...")
        topo, _, _ = switched_hosts()
        socks: dict[str, str | None] = {"mr0": None, "mr1": None}
        if args.daemon:
            socks = _start_daemons(topo, daemons)
        con.print("engine: " + (f"metaroced in each host's namespace ({socks['mr0']}, {socks['mr1']})" if args.daemon
                                else "in process, the compiled plane (the demo's hosts are its own: no running "
                                     "metaroced serves them; --daemon starts one per host)"))
        a = Host(topo, topo[0], "mr0", size, socks["mr0"])
        hosts.append(a)
        b = Host(topo, topo[2], "mr1", size, socks["mr1"])
        hosts.append(b)
        if args.daemon:
            a.connect(b)               # compat only: metaroced's plane here
            b.connect(a)
            agreed = "compat"
        else:
            agreed = connect_negotiated(a, b, args.profile)
        con.print(f"A {a.ctx.gid} QP {a.qp.qp_num:#x}  <->  B {b.ctx.gid} QP {b.qp.qp_num:#x}   "
                  f"(path MTU 1024, XDP + AF_XDP on both ends)")
        con.print(f"profile: [bold]{agreed}[/bold] (" + (
            "selective acknowledgement, out-of-order placement, multipath entropy, congestion control"
            if agreed == "native" else "RoCEv2: go-back-N") + f"; --profile {args.profile})")
        verdicts = {"clean link": exchange(a, b, size, "clean link")}
        fstats = None
        if not args.no_faults and all(v == INTACT for v in verdicts["clean link"].values()):
            knobs = dict(drop_ppm=10000, dup_ppm=5000, corrupt_ppm=5000)
            with FaultInjector("swB", netns=topo[1], seed=7, reorder_ppm=10000, reorder_delay_us=300, **knobs) as fb, \
                 FaultInjector("swA", netns=topo[1], seed=8, **knobs) as fa:
                verdicts["lossy switch"] = exchange(a, b, size, "switch drops 1%, duplicates 0.5%, corrupts 0.5%, "
                                                                "reorders 1%")
                sb, sa = fb.stats(), fa.stats()
                fstats = {k: sb[k] + sa[k] for k in ("dropped", "duplicated", "corrupted")}
                fstats["delayed"] = sb["delayed"]
        return summary(a, b, verdicts, fstats)
    except KeyboardInterrupt:
        con.print("[yellow]interrupted: cleaning up")
        return 130
    finally:
        for h in hosts:
            h.ctx.close()
        for p in daemons:              # SIGTERM: each drains, detaches XDP and exits
            p.terminate()
            try:
                p.wait(30)
            except Exception:          # noqa: BLE001
                p.kill()
        if daemons and os.path.isdir(daemons[0].tmp):
            import shutil
            shutil.rmtree(daemons[0].tmp, ignore_errors=True)
        if topo is not None:
            topo.close()
            con.print("[dim]namespaces, veths and XDP programs removed[/dim]")


def _start_daemons(topo, out: list) -> dict[str, str]:
    """One metaroced (python -m metaroce_xdp.daemon.server) per host namespace; their control sockets.
    Each dies with this process (PR_SET_PDEATHSIG) should the demo be killed."""
    import ctypes
    import json
    import signal
    import subprocess
    import tempfile

    def die_with_parent() -> None:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)

    tmp = tempfile.mkdtemp(prefix="metaroce-demo-")
    os.mkdir(os.path.join(tmp, "bpf"))
    socks = {}
    for ns, ifname in ((topo[0], "mr0"), (topo[2], "mr1")):
        sock, cfg = os.path.join(tmp, f"{ifname}.sock"), os.path.join(tmp, f"{ifname}.toml")
        with open(cfg, "w") as f:
            f.write(f'interfaces = ["{ifname}"]\nsocket_path = "{sock}"\nprogress = "sleep"\n'
                    f'bpffs_prefix = "{tmp}/bpf/metaroce"\nmax_mr_bytes_per_client = {1 << 31}\n')
        p = topo.popen(ns, [sys.executable, "-m", "metaroce_xdp.daemon.server", "--config", cfg],
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), preexec_fn=die_with_parent)
        p.tmp = tmp
        out.append(p)
        socks[ifname] = sock
    con.print("starting metaroced in A and in B (BCC compiles the XDP program: a few seconds) ...")
    for p in out:
        line = p.stdout.readline()
        if not line.startswith("{") or not json.loads(line).get("ready"):
            raise RuntimeError(f"metaroced did not start (exit {p.poll()})")
    return socks


if __name__ == "__main__":
    sys.exit(main())
