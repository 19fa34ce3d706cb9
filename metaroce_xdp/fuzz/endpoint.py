"""The packet fuzzer's target: the compiled plane in a child process, so that a crash is a dead
child and not a dead fuzzer:

    python -m metaroce_xdp.fuzz.endpoint inproc IFNAME PEER_IP    # dp.Context and its progress thread
    python -m metaroce_xdp.fuzz.endpoint daemon SOCKET PEER_IP    # a client of metaroced (a crash: the daemon's)

in the target's namespace; one JSON command per stdin line, one JSON answer per stdout line.

Memory: every MR sits inside an anonymous mapping with a PROT_NONE page on each side (a write past the end
of a mapping faults: a crash, not silent corruption), and the bytes of those pages that are not the MR hold
a canary pattern.  The MRs:

  victim   PD 1, every access: the fuzzed QP's target (its bytes may change; the slack around it may not)
  local    PD 1, LOCAL_WRITE only: no remote packet may change it
  foreign  PD 2 (through the daemon: of a second client), every access: another tenant's; no packet of the
           fuzzed QP may change it
  legit    PD 3, every access: the legitimate QP's; only the legitimate peer's WRITEs change it

QPs: `victim` (PD 1, compat), `native` (PD 1, the native profile: SACKs, NETH, credits) and `legit` (PD 3),
each connected to a scripted peer at PEER_IP (QPNs that exist only in the fuzzer).  The victim QP also has work of its own outstanding (READs and WRITEs the peer never
answers except with fuzzed responses), so fuzzed ACKs and READ responses meet a completer with state.

Commands: {"cmd": "fix"} (the victim QP back to RTS if a packet moved it to ERR); {"cmd": "check", "legit": [[offset, hex], ...]} -> canaries, counters (the
plane's, XDP's drops by reason and events), completions seen; {"cmd": "quit"}.
"""
from __future__ import annotations

import ctypes
import faulthandler
import json
import mmap
import sys
import time

import numpy as np

PAGE = mmap.PAGESIZE
CANARY = {"victim": 0xA5, "local": 0x3C, "foreign": 0x5A, "legit": 0xC3}
SLACK = 100                                  # canary bytes before each MR (and the rest of its last page after)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class Guarded:
    """`n` bytes at offset SLACK of a mapping whose first and last pages are PROT_NONE; canary elsewhere.
    With `alloc` (a daemon client's alloc_buf: a memfd the daemon maps too) no guard pages -- the daemon maps
    the file itself -- but the same canaries in the pages around the MR, which the daemon's mapping covers."""

    def __init__(self, n: int, canary: int, alloc=None) -> None:
        self.data_pages = (SLACK + n + PAGE - 1) // PAGE
        if alloc is None:
            self.mm = mmap.mmap(-1, (self.data_pages + 2) * PAGE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.all = np.frombuffer(self.mm, np.uint8)
        else:
            self.all = alloc((self.data_pages + 2) * PAGE)
        base = int(self.all.ctypes.data)
        self.all[PAGE:-PAGE] = canary
        for off in (0, (self.data_pages + 1) * PAGE):
            if alloc is None and _libc.mprotect(ctypes.c_void_p(base + off), PAGE, 0) != 0:
                raise OSError(ctypes.get_errno(), "mprotect")
        self.canary = canary
        self.lo, self.hi = PAGE + SLACK, PAGE + SLACK + n
        self.mr_view = self.all[self.lo:self.hi]

    def slack_ok(self) -> list[int]:
        """Offsets (relative to the MR's start) of changed canary bytes outside the MR."""
        inner = self.all[PAGE:-PAGE]
        lo, hi = self.lo - PAGE, self.hi - PAGE
        bad = [i - lo for i in np.flatnonzero(inner[:lo] != self.canary)[:8]]
        bad += [hi - lo + i for i in np.flatnonzero(inner[hi:] != self.canary)[:8]]
        return [int(x) for x in bad]


def main() -> int:
    faulthandler.enable()
    from ..dp import Context
    from ..verbs_types import SGE, Access, QPAttr, QPCap, QPState, RecvWR, SendFlags, SendWR, WROpcode
    full = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC
    mode, where, peer_ip = sys.argv[1], sys.argv[2], sys.argv[3]
    if mode == "inproc":
        ctx = Context.open(where, progress_thread=True, busy_poll=False)
        ctx2, alloc, alloc2 = ctx, None, None
        loader = ctx.loader

        def counters() -> dict:
            return {"stats": ctx.stats(), "xdp_drops": loader.drops(), "xdp_events": loader.events()}
    else:                                       # a client of metaroced at socket `where`; "foreign": another client
        from ..daemon import client
        ctx = client.connect(where).open_device()
        ctx2 = client.connect(where).open_device()
        alloc, alloc2 = ctx.alloc_buf, ctx2.alloc_buf

        def counters() -> dict:
            c = ctx.status()["devices"][0]["counters"]
            return {"stats": c["plane"], "xdp_drops": c.get("xdp_drops", {}), "xdp_events": c.get("xdp_events", {})}
    pd1, pd2, pd3 = ctx.alloc_pd(), ctx2.alloc_pd(), ctx.alloc_pd()
    g = {"victim": Guarded(1 << 16, CANARY["victim"], alloc), "local": Guarded(8192, CANARY["local"], alloc),
         "foreign": Guarded(8192, CANARY["foreign"], alloc2), "legit": Guarded(1 << 16, CANARY["legit"], alloc)}
    g["victim"].mr_view[:] = 0
    g["legit"].mr_view[:] = 0
    mrs = {"victim": pd1.reg_mr(g["victim"].mr_view, full), "local": pd1.reg_mr(g["local"].mr_view, Access.LOCAL_WRITE),
           "foreign": pd2.reg_mr(g["foreign"].mr_view, full), "legit": pd3.reg_mr(g["legit"].mr_view, full)}
    cq = ctx.create_cq(4096)
    qps = {"victim": ctx.create_qp(pd1, cq, cq, QPCap(max_send_wr=64, max_recv_wr=256)),
           "legit": ctx.create_qp(pd3, cq, cq, QPCap(max_send_wr=16, max_recv_wr=16)),
           "native": ctx.create_qp(pd1, cq, cq, QPCap(max_send_wr=64, max_recv_wr=64))}
    peer = {"victim": 0x5F0001, "legit": 0x5F0002, "native": 0x5F0003}
    psn = {"victim": 1000, "legit": 5000, "native": 9000}
    # the native QP's timers far above the fuzzer's pace (as tests/native/test_dp_native_scripted.py); through the daemon
    # a client may not choose rto_initial (server.CLIENT_NATIVE_PARAMS)
    nat = {"profile": "native",
           "native_params": {"rto_initial": 200, "rto_min": 100_000} if mode == "inproc" else {"rto_min": 100_000}}

    def connect(k: str) -> None:
        qp = qps[k]
        qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=full))
        qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=peer[k], rq_psn=psn[k], path_mtu=1024, dgid=peer_ip,
                         max_dest_rd_atomic=4, min_rnr_timer=1, **(nat if k == "native" else {})))
        qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=psn[k] + 100000, timeout=0, retry_cnt=7, rnr_retry=7,
                         max_rd_atomic=4))

    for k in list(qps):
        try:
            connect(k)
        except Exception as e:                              # noqa: BLE001 - no native profile here: fuzz without
            if k != "native":
                raise
            print(f"endpoint: no native QP ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
            del qps[k]
    vm = mrs["victim"]
    posted = 0
    resets = 0

    def replenish() -> None:
        nonlocal posted
        while posted < 128:
            try:
                qps["victim"].post_recv(RecvWR(wr_id=posted, sg_list=[SGE(vm.addr + 32768 + (posted % 8) * 4096,
                                                                              4096, vm.lkey)]))
            except Exception:                               # noqa: BLE001 - QP in ERR: nothing to replenish
                return
            posted += 1

    replenish()
    # the victim's own requests: its completer meets the fuzzed responses
    wrs = [SendWR(wr_id=1 << 20 | i, opcode=WROpcode.RDMA_READ if i % 2 else WROpcode.RDMA_WRITE,
                  send_flags=SendFlags.SIGNALED, sg_list=[SGE(vm.addr + 16384 + 2048 * i, 2048, vm.lkey)],
                  remote_addr=0x10000 + 4096 * i, rkey=0x1234) for i in range(6)]
    qps["victim"].post_send(wrs)
    nwrs = [SendWR(wr_id=2 << 20 | i, opcode=WROpcode.RDMA_WRITE, send_flags=SendFlags.SIGNALED,
                   sg_list=[SGE(vm.addr + 8192 + 1024 * i, 1024, vm.lkey)], remote_addr=0x20000 + 4096 * i,
                   rkey=0x4321) for i in range(4)]
    if "native" in qps:
        qps["native"].post_send(nwrs)

    def reset_native() -> None:
        nonlocal resets
        resets += 1
        qps["native"].modify(QPAttr(qp_state=QPState.RESET))
        psn["native"] = (psn["native"] + 7919) & 0xFFFFFF
        connect("native")
        qps["native"].post_send(nwrs)

    def reset_victim() -> None:
        """A fuzzed packet moved the victim QP to ERR (as it may): back to RTS, its work posted again."""
        nonlocal posted, resets
        resets += 1
        for wc in cq.poll(4096):
            pass
        qps["victim"].modify(QPAttr(qp_state=QPState.RESET))
        psn["victim"] = (psn["victim"] + 7919) & 0xFFFFFF
        connect("victim")
        posted = 0
        replenish()
        qps["victim"].post_send(wrs)
    wc_status: dict[str, int] = {}

    def answer(obj) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    answer({"ready": True, "qpn": {k: q.qp_num for k, q in qps.items()}, "peer": peer, "psn": psn,
            "mr": {k: {"addr": m.addr, "len": m.length, "rkey": m.rkey, "lkey": m.lkey} for k, m in mrs.items()}})
    for line in sys.stdin:
        c = json.loads(line)
        if c["cmd"] == "quit":
            break
        if c["cmd"] == "fix":                       # between cases: the victim back to RTS if a packet ended it
            if qps["victim"].query_state() != QPState.RTS:
                reset_victim()
            if "native" in qps and qps["native"].query_state() != QPState.RTS:
                reset_native()
            answer({"resets": resets, "victim_psn": psn["victim"], "native_psn": psn["native"]})
            continue
        if c["cmd"] == "check":
            time.sleep(0.05)
            for wc in cq.poll(4096):
                name = getattr(wc.status, "name", str(wc.status))
                wc_status[name] = wc_status.get(name, 0) + 1
                if wc.qp_num == qps["victim"].qp_num and wc.wr_id < (1 << 20):
                    posted -= 1
            replenish()
            if qps["victim"].query_state() != QPState.RTS and c.get("reset", True):
                reset_victim()
            if "native" in qps and qps["native"].query_state() != QPState.RTS:
                reset_native()
            bad = {k: x.slack_ok() for k, x in g.items()}
            changed = {k: int(np.count_nonzero(g[k].mr_view != CANARY[k])) for k in ("local", "foreign")}
            want = np.zeros(1 << 16, np.uint8)
            for off, hx in c.get("legit", []):
                b = bytes.fromhex(hx)
                want[off:off + len(b)] = np.frombuffer(b, np.uint8)
            legit_diff = np.flatnonzero(g["legit"].mr_view != want)
            answer({"slack": {k: v for k, v in bad.items() if v}, "changed": {k: v for k, v in changed.items() if v},
                    "legit_diff": [int(x) for x in legit_diff[:8]], **counters(), "wc": wc_status,
                    "state": {k: q.query_state().name for k, q in qps.items()},
                    "resets": resets, "victim_psn": psn["victim"], "native_psn": psn["native"]})
    ctx.close()
    if ctx2 is not ctx:
        ctx2.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
