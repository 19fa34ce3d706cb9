"""Where a frame's CPU time goes, stage by stage, on both cores: MetaRoCE beside the raw AF_XDP loop.

    python -m tools.frame_cost [--seconds 3] [--pmtu 1024 4096] [--json FILE] [--markdown FILE]

Two hosts on one veth (metaroce_xdp.topo), host A on CPU 0 and host B on CPU 1.  For each path MTU, each
workload streams full WRITE frames (1082 B at path MTU 1024, 4154 B at 4096) from A to B:

* `raw`: tools/afxdp_rawloop.c, pre-built frames through one AF_XDP socket each way, no protocol work
  (tx on CPU 0, rx on CPU 1, the receiving veth's NAPI in softirq: the placement MetaRoCE runs with);
* `raw, threaded NAPI`: the same with B's veth NAPI in a kthread pinned to CPU 1 and rx asleep in poll()
  (the raw loop's best configuration in make bench's sweeps);
* `compat` and `native`: `metaroce perf write-bw -s 65536` with that profile, client in A, server in B.

While a workload is in its steady state, `perf record -e cpu-clock -c 50000 -C 0,1 -g` samples both
CPUs every 50 us of CPU time; each sample is given to the stage of the first frame of its call stack,
from the leaf up, that names one (STAGES: the copy into the receiver's UMEM under __xsk_rcv is "rx:
copy into UMEM" although it runs inside the sender's sendto), and the stage's samples x 50 us /
the frames B received in the window is its cost per frame.  The per-CPU idle share is reported
beside it.  Symbols of numba's compiled code are not known to perf: user-space samples outside a
shared library (libdeflate, libc, libpython, numpy's ...) count as "compiled loop".  perf's sampling
with call stacks costs CPU of its own on these two cores: rates under it are below make bench's, so
read the table as shares of a frame's cost, not as the unperturbed figures.

Root only (netns, XDP, perf).  Takes about a minute per path MTU."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PERIOD_NS = 50_000

# (stage, pattern on a kernel or user symbol / dso): the first frame from the leaf that matches decides
STAGES: list[tuple[str, re.Pattern]] = [(s, re.compile(p)) for s, p in (
    ("user: ICRC (libdeflate)", r"libdeflate"),
    ("user: copies (libc memcpy/memmove)", r"^__mem(cpy|move)|^memcpy|^memmove"),
    ("rx: copy into UMEM (__xsk_rcv)", r"^__?xsk_rcv|^xsk_copy_xdp|^__xsk_map_redirect|^xsk_rcv_check"),
    ("rx: XDP program", r"^bpf_prog_|^bpf_xdp_|^bpf_dispatcher"),
    ("rx: veth skb to xdp (skb_pp_cow_data)", r"^skb_pp_cow_data|^veth_convert_skb_to_xdp_buff"),
    ("rx: NAPI, veth_poll rest", r"^veth_poll|^veth_xdp_rcv|^__napi_poll|^net_rx_action|^napi_threaded_poll"),
    ("tx: skb per frame (xsk_build_skb)", r"^xsk_build_skb|^xsk_skb_init|^xsk_destruct_skb|^xsk_consume_skb"),
    ("tx: __xsk_generic_xmit rest", r"^__xsk_generic_xmit|^xsk_generic_xmit|^__xsk_sendmsg|^xsk_sendmsg"),
    ("tx: veth_xmit / dev_queue_xmit", r"^veth_xmit|^dev_hard_start_xmit|^__dev_queue_xmit|^__dev_direct_xmit"),
    ("rx ring / fill ring / poll()", r"^xsk_poll|^do_sys_poll|^__x64_sys_poll|^__x64_sys_ppoll|^do_poll"),
    ("syscall entry/exit", r"^entry_SYSCALL|^do_syscall_64|^syscall_exit|^__x64_sys_sendto|^__sys_sendto"),
    ("scheduler, idle", r"^schedule$|^__schedule|^do_idle|^cpuidle|^default_idle|^pv_native_safe_halt|"
                        r"^acpi_idle|^native_safe_halt|^cpu_startup_entry"),
)]


def classify(comm: str, frames: list[tuple[str, str]]) -> str:
    """frames: (symbol, dso) from the leaf up."""
    for sym, dso in frames:
        kernel = "kernel" in dso
        for stage, pat in STAGES:
            if stage.startswith("user:") == kernel:
                continue                       # user stages name user code, the others the kernel's
            if pat.search(sym) or (stage.startswith("user: ICRC") and pat.search(dso)):
                return stage
    if comm == "swapper":
        return "scheduler, idle"
    leaf_sym, leaf_dso = frames[0] if frames else ("", "")
    if "kernel" in leaf_dso:
        return "kernel, other"
    if "libpython" in leaf_dso or leaf_dso.endswith("python3.11"):
        return "user: Python"
    if leaf_dso.startswith("/") and ".so" in leaf_dso:
        return "user: other libraries"
    return "user: compiled loop (numba)"         # numba's code lives in anonymous memory perf cannot name


_SAMPLE = re.compile(r"^(?P<comm>.+?)\s+(?P<pid>\d+)\s+\[(?P<cpu>\d+)\]\s*$")
_FRAME = re.compile(r"^\s+[0-9a-f]+\s+(?P<sym>.*?)\s+\((?P<dso>[^)]*)\)\s*$")


def parse_perf(data: Path) -> dict[int, dict[str, int]]:
    """perf script of `data` -> {cpu: {stage: samples}}."""
    cp = subprocess.run(["perf", "script", "-i", str(data), "-F", "comm,pid,cpu,ip,sym,dso"],
                        capture_output=True, text=True, timeout=600)
    out: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    comm, cpu, frames = None, None, []

    def flush():
        if comm is not None:
            out[cpu][classify(comm, frames)] += 1
    for line in cp.stdout.splitlines():
        if not line.strip():
            continue
        m = _SAMPLE.match(line)
        if m and not line.startswith((" ", "\t")):
            flush()
            comm, cpu, frames = m.group("comm").strip(), int(m.group("cpu")), []
            continue
        f = _FRAME.match(line)
        if f:
            sym = f.group("sym")
            sym = re.sub(r"\+0x[0-9a-f]+$", "", sym)
            frames.append((sym, f.group("dso")))
    flush()
    return {c: dict(v) for c, v in out.items()}


def _rx_packets(topo, ep) -> int:
    link = topo.ipr(ep.ns).link("get", index=ep.ifindex)[0]
    return int(link.get_attr("IFLA_STATS64")["rx_packets"])


def sample(topo, pair, seconds: float, start_rate: float = 50_000, warm_timeout: float = 90) -> dict:
    """Wait for B's veth to receive `start_rate` frames/s, then perf record both CPUs for `seconds`."""
    deadline = time.monotonic() + warm_timeout
    last, t_last = _rx_packets(topo, pair.b), time.monotonic()
    while True:
        time.sleep(0.25)
        now, t = _rx_packets(topo, pair.b), time.monotonic()
        if (now - last) / (t - t_last) >= start_rate:
            break
        last, t_last = now, t
        if t > deadline:
            raise RuntimeError(f"no steady stream after {warm_timeout:.0f} s ({(now - last) / (t - t_last):.0f} frames/s)")
    time.sleep(0.5)
    with tempfile.TemporaryDirectory() as td:
        data = Path(td) / "perf.data"
        f0, t0 = _rx_packets(topo, pair.b), time.monotonic()
        subprocess.run(["perf", "record", "-q", "-e", "cpu-clock", "-c", str(PERIOD_NS), "-C", "0,1", "-g",
                        "-o", str(data), "--", "sleep", str(seconds)], capture_output=True, timeout=seconds + 60,
                       check=True)
        f1, t1 = _rx_packets(topo, pair.b), time.monotonic()
        by_cpu = parse_perf(data)
    return {"frames": f1 - f0, "wall_s": t1 - t0, "by_cpu": by_cpu}


def _per_frame(s: dict) -> dict:
    frames = max(1, s["frames"])
    res = {}
    for cpu, stages in s["by_cpu"].items():
        res[cpu] = {k: v * PERIOD_NS / frames for k, v in stages.items()}
    return res


def run_raw(topo, pair, pmtu: int, seconds: float, threaded: bool) -> dict:
    from tools import bench as B
    binary = B.build_rawloop()
    frame = B.frame_bytes(pmtu)
    prog = B.RedirectProgram(topo, pair.b, attach=True, frags=pmtu > 2048)
    napi = B.NapiControl(topo, pair.b, False)
    try:
        napi.set(threaded, 1 if threaded else None)
        cfg = B.RawConfig(tx_cpu=0, rx_cpu=1, napi_threaded=threaded, napi_cpu=1 if threaded else None,
                          wait="poll")
        box: dict = {}
        t = threading.Thread(target=lambda: box.update(r=B.run_rawloop(topo, pair, binary, prog, frame,
                                                                       seconds + 6, cfg)), daemon=True)
        t.start()
        s = sample(topo, pair, seconds)
        t.join(seconds + 60)
        s["result"] = box.get("r")
        s["config"] = cfg.label
    finally:
        napi.restore()
        prog.close()
    return s


def run_perf(topo, pair, pmtu: int, seconds: float, profile: str) -> dict:
    from tools import bench as B
    base = [sys.executable, "-m", "metaroce_xdp.cli", "perf", "write-bw", "-s", "65536", "-m", str(pmtu),
            "-D", str(seconds + 8), "-j", "--profile", profile]
    srv = topo.popen(pair.b.ns, ["taskset", "-c", "1", *base, "-d", pair.b.ifname], cwd=ROOT,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cli = None
    try:
        for _ in range(400):
            if B._listening(topo, pair.b.ns, B.PERF_PORT):
                break
            time.sleep(0.25)
        cli = topo.popen(pair.a.ns, ["taskset", "-c", "0", *base, "-d", pair.a.ifname, pair.b.ipv4], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        s = sample(topo, pair, seconds)
        out, err = cli.communicate(timeout=seconds + 120)
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        s["result"] = json.loads(lines[-1]) if lines else {"error": err[-500:]}
        s["config"] = f"metaroce perf write-bw -s 65536 --profile {profile}, client CPU 0, server CPU 1"
    finally:
        for p in (cli, srv):
            if p is not None and p.poll() is None:
                p.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(10)
            if p is not None and p.poll() is None:
                p.kill()
    return s


def table(results: dict, pmtu: int) -> str:
    cols = [k for k in results if k.startswith(f"{pmtu}:")]
    stages = [s for s, _ in STAGES] + ["kernel, other", "user: Python", "user: compiled loop (numba)",
                                       "user: other libraries"]
    head = "| stage | " + " | ".join(f"{c.split(':', 1)[1]} CPU {cpu}" for c in cols for cpu in (0, 1)) + " |"
    lines = [f"Path MTU {pmtu} ({pmtu + 58} B frames); ns of CPU per frame B received; CPU 0 = A (sender), "
             "CPU 1 = B (receiver)", "", head, "|---" * (1 + 2 * len(cols)) + "|"]
    pf = {c: _per_frame(results[c]) for c in cols}
    for st in stages:
        vals = [pf[c].get(cpu, {}).get(st, 0.0) for c in cols for cpu in (0, 1)]
        if any(v >= 1 for v in vals):
            lines.append(f"| {st} | " + " | ".join(f"{v:.0f}" if v >= 1 else "" for v in vals) + " |")
    busy = []
    for c in cols:
        for cpu in (0, 1):
            d = pf[c].get(cpu, {})
            busy.append(sum(v for k, v in d.items() if k != "scheduler, idle"))
    lines.append("| **busy total** | " + " | ".join(f"**{v:.0f}**" for v in busy) + " |")
    rates = []
    for c in cols:
        r = results[c]
        fps = r["frames"] / r["wall_s"]
        rates.append(f"{c.split(':', 1)[1]}: {fps / 1e6:.3f} M frames/s = {fps * pmtu * 8 / 1e9:.2f} Gbit/s goodput")
    lines += ["", "Rates in the sampled window: " + "; ".join(rates) + "."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--pmtu", type=int, nargs="+", default=[1024, 4096], choices=[1024, 4096])
    ap.add_argument("--workloads", nargs="+", default=["raw", "raw-napi", "compat", "native"],
                    choices=["raw", "raw-napi", "compat", "native"])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("frame_cost: run as root (netns, XDP, perf)", file=sys.stderr)
        return 2
    from metaroce_xdp.topo import two_hosts
    from tools import bench as B
    results: dict = {}
    topo, pair = two_hosts(mtu=B.MTU_FOR_PMTU[1024], prefix="mrcost")
    with topo:
        for pmtu in a.pmtu:
            B.set_mtu(topo, pair, B.MTU_FOR_PMTU[pmtu])
            for w in a.workloads:
                name = {"raw": "raw", "raw-napi": "raw, threaded NAPI", "compat": "compat", "native": "native"}[w]
                print(f"[frame_cost] path MTU {pmtu}: {name}", file=sys.stderr, flush=True)
                try:
                    if w.startswith("raw"):
                        r = run_raw(topo, pair, pmtu, a.seconds, threaded=w == "raw-napi")
                    else:
                        r = run_perf(topo, pair, pmtu, a.seconds, w)
                except Exception as e:  # noqa: BLE001 - the other workloads still count
                    print(f"[frame_cost]   failed: {e}", file=sys.stderr, flush=True)
                    continue
                results[f"{pmtu}:{name}"] = r
    text = "\n\n".join(table(results, p) for p in a.pmtu)
    print(text)
    if a.markdown:
        a.markdown.write_text(text + "\n")
    if a.json:
        a.json.write_text(json.dumps({"period_ns": PERIOD_NS, "results": results,
                                      "per_frame": {k: _per_frame(v) for k, v in results.items()}},
                                     indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
