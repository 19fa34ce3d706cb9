"""Helpers of the native cases (cases/native_*.py): a native IUT QP connected to the LT, and the LT's native
frames, both ways.

    c = connect_native(t, mtu=1024, w=256)       an IUT QP in RTS, profile native (modify_qp `native`, 9.4.2)
    c.write_msg(data, offset)  -> [frame]          the LT as requester: one NATIVE_WRITE message (MSN, PSNs advance)
    c.send_msg(data, imm=None) -> [frame]          NATIVE_SEND (RSN advances), ...
    c.sack(cum, received=..., ...) -> frame        the LT as responder: a NATIVE_SACK to the IUT's requester
    c.nexpect(n, timeout, after, match) -> [Frame] frames from the IUT; nv(f) is a frame's native_packets view

Every frame is built by native_packets (written from the spec, never from the reference codec).
"""
from __future__ import annotations

import secrets
import time
from typing import Callable

from .. import native_packets as N
from .. import packets as P
from ..context import FULL_ACCESS, CaseError, Conn, NotApplicable, T, _gid
from ..lt import Frame
from ._common import ACK_WAIT, QUIET, describe

REQ_OPS = frozenset({N.NATIVE_SEND, N.NATIVE_SEND_IMM, N.NATIVE_WRITE, N.NATIVE_WRITE_IMM, N.NATIVE_READ_REQ,
                     N.FETCH_ADD, N.COMPARE_SWAP})
CAP = {"NATIVE": 0x01, "SACK": 0x02, "OOO_PLACEMENT": 0x04, "MULTIPATH": 0x08, "CC_DELAY": 0x10, "CREDITS": 0x20,
       "IPV6": 0x40, "ATOMICS": 0x80}
TOS_DATA, TOS_ACK, TOS_CE = 0x6A, 0x68, 0x6B        # DSCP 26 with ECT(0), Not-ECT, CE (4.3.7's examples)
FILL = 0x5A
WC_OK, WC_FLUSH = "IBV_WC_SUCCESS", "IBV_WC_WR_FLUSH_ERR"
REMOTE_VA, REMOTE_RKEY = 0x7F00_0020_0000, 0x00C0FFEE      # the LT's "memory" when the IUT is the requester


def peek(f: Frame) -> tuple | None:
    """(op, dqpn, psn, ackreq, source address bytes, UDP source port, NETH.TSval or None) of an IPv4 RoCE frame,
    read with struct and cached on the frame: the LT answers within the IUT's timers, which a scapy dissection
    of every frame would not let it do.  None for anything else (IPv6 frames: use nv())."""
    v = f.__dict__.get("_peek", 0)
    if v != 0:
        return v
    d = f.data
    v = None
    if len(d) >= 58 and d[12:14] == b"\x08\x00" and d[23] == 17:
        u = 14 + (d[14] & 0xF) * 4
        if len(d) >= u + 20 and d[u + 2:u + 4] == b"\x12\xb7":
            b = u + 8
            op = d[b]
            ts = None
            if 0xC0 <= op <= 0xC5:
                n = b + 12 + (16 if op in (0xC2, 0xC3, 0xC4) else 0)
                if len(d) >= n + 16:
                    ts = int.from_bytes(d[n + 12:n + 16], "big")
            v = (op, int.from_bytes(d[b + 5:b + 8], "big"), int.from_bytes(d[b + 9:b + 12], "big"), d[b + 8] >> 7,
                 bytes(d[26:30]), int.from_bytes(d[u:u + 2], "big"), ts)
    f.__dict__["_peek"] = v
    return v


def op(f: Frame) -> int:
    k = peek(f)
    return k[0] if k is not None else f.roce.op


def fpsn(f: Frame) -> int:
    k = peek(f)
    return k[2] if k is not None else f.roce.psn


def nv(f: Frame | None) -> N.NativeView | None:
    """The native view of a captured frame (cached on it)."""
    if f is None:
        return None
    v = f.__dict__.get("_nv")
    if v is None:
        v = N.parse(f.data)
        f.__dict__["_nv"] = v
    return v


def summ(frames) -> str:
    return ", ".join(f"#{f.num} {'LT>IUT' if f.outgoing else 'IUT>LT'} {nv(f).summary()}" for f in frames) or "nothing"


def nobs(frames) -> list[str]:
    return [f"#{f.num} {'LT>IUT' if f.outgoing else 'IUT>LT'} {nv(f).summary()}" for f in frames]


def is_sack(f: Frame) -> bool:
    return op(f) == N.NATIVE_SACK


def is_ack_sack(f: Frame) -> bool:
    return op(f) == N.NATIVE_SACK and nv(f).sack_kind == "ACK"


def is_req(f: Frame) -> bool:
    return op(f) in REQ_OPS


class NConn(Conn):
    """A native IUT QP whose peer is the LT.  As the LT's requester: psn (the IUT responder's ePSN), msn and
    rsn (the LT's next MSN and RSN).  As the LT's responder: iut_psn (the IUT requester's first PSN), the
    MSN count the LT reports (lt_msn)."""

    def __init__(self, *a, w: int, k: int, caps: int, **kw) -> None:
        super().__init__(*a, **kw)
        self.w, self.k, self.caps = w, k, caps
        self.msn = 0                  # the LT requester's next message number (MR-NAT-012)
        self.rsn = 0                  # ... and receive sequence number (MR-NAT-025)
        self.lt_msn = 0               # messages the LT responder reports completed (AETH.MSN)
        self.fb = N.FastBuilder()
        import ipaddress
        a = ipaddress.ip_address(self.t.iut_ip)
        self._iut_ip4 = a.packed if a.version == 4 else None

    def is_mine(self, f: Frame) -> bool:
        """A RoCE frame the IUT sent to the LT's QP (struct-read for IPv4, see peek)."""
        if f.outgoing:
            return False
        k = peek(f)
        if k is None or self._iut_ip4 is None:
            return super().is_mine(f)
        return k[1] == self.lt_qpn and k[4] == self._iut_ip4

    # -- frames of the LT --------------------------------------------------------------------------
    def addr(self, **kw) -> dict:
        t = self.t
        a = dict(src_mac=t.lt_mac, dst_mac=t.iut_mac, src_ip=t.lt_ip, dst_ip=t.iut_ip, dqpn=self.qpn,
                 sport=self.sport, tos=TOS_DATA)
        a.update(kw)
        return a

    def nframe(self, op, *, psn: int, ackreq: bool = False, payload: bytes = b"", reth=None, neth_=None,
               rsn=None, imm=None, aeth=None, sack=None, headers: bytes | None = None, **kw) -> bytes:
        code = N.opcode(op)
        if headers is None and code in N.NATIVE_OPS:
            headers = N.headers_of(code, reth=reth, neth_=neth_, rsn=rsn, imm=imm, aeth=aeth, sack=sack)
        if code not in N.NATIVE_OPS:
            return N.build(code, psn=psn, ackreq=ackreq, payload=payload, reth=reth, imm=imm, aeth=aeth,
                           headers=headers, **self.addr(**kw))
        return self.fb.build(code, psn=psn, ackreq=ackreq, payload=payload, headers=headers, **self.addr(**kw))

    @staticmethod
    def tsval() -> int:
        return int(time.monotonic() * 1e6) & 0xFFFFFFFF

    def npkts(self, length: int) -> int:
        return max(1, -(-length // self.mtu))

    def _msg(self, op, data: bytes, *, reth=None, rsn=None, imm=None, psn=None, msn=None, ackreq_last=True,
             retx=False, tsval=None, advance=True, **kw) -> list[bytes]:
        psn0 = self.psn if psn is None else psn
        m = self.msn if msn is None else msn
        n = self.npkts(len(data))
        out = []
        for i in range(n):
            chunk = data[i * self.mtu:(i + 1) * self.mtu]
            nh = N.neth(m, i * self.mtu, len(data), self.tsval() if tsval is None else tsval,
                        payload_len=len(chunk), retx=retx)
            out.append(self.nframe(op, psn=P.psn_add(psn0, i), ackreq=ackreq_last and i == n - 1, payload=chunk,
                                   reth=reth, neth_=nh, rsn=rsn, imm=imm, **kw))
        if advance and psn is None:
            self.psn = P.psn_add(psn0, n)
        if advance and msn is None:
            self.msn = (m + 1) & 0xFFFFFF
        return out

    def write_msg(self, data: bytes, offset: int = 0, *, rkey: int | None = None, imm: int | None = None,
                  **kw) -> list[bytes]:
        """A NATIVE_WRITE (or NATIVE_WRITE_IMM with imm) message into the IUT MR at offset."""
        reth = (self.va + offset, self.rkey if rkey is None else rkey, len(data))
        if imm is None:
            return self._msg(N.NATIVE_WRITE, data, reth=reth, **kw)
        rsn = kw.pop("rsn", None)
        out = self._msg(N.NATIVE_WRITE_IMM, data, reth=reth, imm=imm, rsn=self.rsn if rsn is None else rsn, **kw)
        if rsn is None and kw.get("advance", True):
            self.rsn = (self.rsn + 1) & 0xFFFFFF
        return out

    def send_msg(self, data: bytes, *, imm: int | None = None, rsn: int | None = None, **kw) -> list[bytes]:
        """A NATIVE_SEND (NATIVE_SEND_IMM with imm) message; RSN the next unless given."""
        op = N.NATIVE_SEND if imm is None else N.NATIVE_SEND_IMM
        out = self._msg(op, data, rsn=self.rsn if rsn is None else rsn, imm=imm, **kw)
        if rsn is None and kw.get("advance", True):
            self.rsn = (self.rsn + 1) & 0xFFFFFF
        return out

    def read_req(self, offset: int, length: int, *, psn=None, msn=None, rkey=None, retx=False, ackreq=True,
                 **kw) -> bytes:
        """A NATIVE_READ_REQ (MR-NAT-021) for `length` bytes of the IUT MR at offset; PSN and MSN advance."""
        p = self.psn if psn is None else psn
        m = self.msn if msn is None else msn
        nh = N.neth(m, 0, length, self.tsval(), first=True, last=True, retx=retx)
        f = self.nframe(N.NATIVE_READ_REQ, psn=p, ackreq=ackreq, reth=(self.va + offset,
                        self.rkey if rkey is None else rkey, length), neth_=nh, **kw)
        if psn is None:
            self.psn = P.psn_add(p, self.npkts(length))
        if msn is None:
            self.msn = (m + 1) & 0xFFFFFF
        return f

    def atomic(self, op: str, offset: int, swap_add: int, compare: int = 0, *, psn=None, rkey=None, **kw) -> bytes:
        """FETCH_ADD / COMPARE_SWAP with the compat layout (MR-NAT-006): one PSN, one MSN, no NETH."""
        p = self.psn if psn is None else psn
        f = self.nframe(op, psn=p, ackreq=True, atomic=(self.va + offset, self.rkey if rkey is None else rkey,
                                                       swap_add, compare), **kw)
        if psn is None:
            self.psn = P.psn_add(p, 1)
            self.msn = (self.msn + 1) & 0xFFFFFF
        return f

    def sack(self, cum: int, *, received=(), syndrome: int = 0x1F, msn: int | None = None, tsecr: int = 0,
             credit: int = 0xFFFF, ce_count: int = 0, echo_sport: int = 0, words: list[int] | None = None,
             nwords: int | None = None, ce: bool = False, n: bool = False, **kw) -> bytes:
        """A NATIVE_SACK of the LT responder to the IUT requester: BTH.PSN cum, the bitmap of `received`
        (MR-SACK-004; or `words` as given)."""
        ws = N.bitmap_words(received, cum, nwords) if words is None else list(words)
        kw.setdefault("tos", TOS_ACK)
        return self.nframe(N.NATIVE_SACK, psn=cum, aeth=(syndrome, self.lt_msn if msn is None else msn),
                           sack=N.sack_layer(tsecr=tsecr, credit=credit, ce_count=ce_count, echo_sport=echo_sport,
                                             words=ws, ce=ce, n=n), **kw)

    def read_resp(self, psn: int, msn: int, offset: int, msg_len: int, payload: bytes, *, retx=False,
                  first=None, last=None, **kw) -> bytes:
        nh = N.neth(msn, offset, msg_len, self.tsval(), payload_len=len(payload), first=first, last=last, retx=retx)
        return self.nframe(N.NATIVE_READ_RESP, psn=psn, payload=payload, neth_=nh, **kw)

    def atomic_ack(self, psn: int, orig: int, msn: int | None = None, **kw) -> bytes:
        kw.setdefault("tos", TOS_ACK)
        return N.build("ATOMIC_ACKNOWLEDGE", psn=psn, aeth=(0x1F, self.lt_msn if msn is None else msn),
                       headers=P.AETHx(syndrome=0x1F, msn=self.lt_msn if msn is None else msn).build()
                       + P.AtomicAckETH(orig=orig).build(), **self.addr(**kw))

    # -- frames from the IUT -----------------------------------------------------------------------
    def nexpect(self, n: int = 1, timeout: float = ACK_WAIT, after: int = 0,
                match: Callable[[Frame], bool] | None = None) -> list[Frame]:
        return self.expect(n, timeout, after=after, match=match)

    def sacks(self, after: int, duration: float = QUIET, match=None) -> list[Frame]:
        """Every NATIVE_SACK the IUT sends to this conn during `duration` s after `after`."""
        return [f for f in self.quiet(duration, after=after) if is_sack(f) and (match is None or match(f))]

    def first_sack(self, after: int, timeout: float = ACK_WAIT, match=None) -> Frame | None:
        got = self.expect(1, timeout, after=after, match=lambda f: is_sack(f) and (match is None or match(f)))
        return got[0] if got else None

    def sack_for(self, cum: int, after: int, timeout: float = ACK_WAIT) -> Frame | None:
        """The first ACK-type SACK whose cumulative PSN is `cum` (or later) after `after`."""
        def ok(f):
            v = nv(f)
            return v.sack_kind == "ACK" and (v.psn == cum or P.psn_before(cum, v.psn))
        return self.first_sack(after, timeout, ok)

    def requests(self, after: int, n: int, timeout: float = ACK_WAIT, match=None) -> list[Frame]:
        return self.expect(n, timeout, after=after, match=lambda f: is_req(f) and (match is None or match(f)))

    def all_requests(self, after: int = 0) -> list[Frame]:
        return [f for f in self.quiet(0.0, after=after) if is_req(f)]

    # -- agent calls wait for a post_send still in flight (post()) ---------------------------------------
    _pending = None

    def sync(self) -> None:
        p, self._pending = self._pending, None
        if p is not None:
            th, box = p
            th.join(30)
            if "exc" in box:
                raise box["exc"]

    def poll(self, *a, **kw):
        self.sync()
        return super().poll(*a, **kw)

    def mem(self, *a, **kw):
        self.sync()
        return super().mem(*a, **kw)

    def mem_write(self, *a, **kw):
        self.sync()
        return super().mem_write(*a, **kw)

    def query(self):
        self.sync()
        return super().query()

    def post_recv(self, *a, **kw):
        self.sync()
        return super().post_recv(*a, **kw)

    def native_counters(self) -> dict | None:
        """get_counters qp when the agent lists per-QP counters, None otherwise (a case is not failed for it)."""
        self.sync()
        if not self.t.caps.get("qp_counters"):
            return None
        try:
            return self.t.agent.call("get_counters", qp=self.qp)["counters"]
        except Exception:                            # noqa: BLE001
            return None


def counted(t: T, c: NConn, name: str, before: dict | None) -> tuple[bool, str]:
    """(grew or not reported, text) for a per-QP counter of the agent's native set."""
    if before is None or name not in before:
        return True, f"{name} not reported"
    after = c.native_counters() or {}
    d = int(after.get(name, 0)) - int(before.get(name, 0))
    return d > 0, f"{name} +{d}"


def connect_native(t: T, *, mtu: int = 1024, psn: int | None = None, iut_psn: int | None = None,
                   w: int | None = None, k: int = 1, caps: int | None = None, access=FULL_ACCESS,
                   mr_access=FULL_ACCESS, mr_len: int = 65536, fill: int = FILL, timeout: int = 14,
                   retry_cnt: int = 7, rnr_retry: int = 7, min_rnr_timer: int = 1, max_rd_atomic: int = 4,
                   max_dest_rd_atomic: int = 4, lt_qpn: int | None = None, cqe: int = 64) -> NConn:
    """t.connect for the native profile: PD, MR (filled with `fill`), CQ and an RC QP brought to RTS with
    modify_qp RTR {"profile": "native", "native": {caps, sack_window, entropy_count}} (9.4.2); the LT plays
    the peer QP lt_qpn.  caps defaults to NATIVE|SACK|OOO_PLACEMENT plus ATOMICS when claimed; w to the
    IUT's default offer (caps.defaults.sack_window, else 256)."""
    sync_all(t)
    if not t.claim.native:
        raise NotApplicable("the IUT does not claim the native profile")
    if mtu not in t.hello.get("mtus", [mtu]):
        raise NotApplicable(f"path MTU {mtu} not offered (hello.mtus)")
    if caps is None:
        caps = CAP["NATIVE"] | CAP["SACK"] | CAP["OOO_PLACEMENT"] | (CAP["ATOMICS"] if "ATOMICS" in t.claim.caps else 0)
    if w is None:
        w = int(t.caps.get("defaults", {}).get("sack_window") or 256)
    pd = t.pd()
    mr_h, mr = t.reg_mr(pd, mr_len, mr_access, fill)
    cq = t.agent.call("create_cq", cqe=cqe)["cq"]
    t._extra.append(("destroy_cq", {"cq": cq}))
    r = t.agent.call("create_qp", pd=pd, send_cq=cq, recv_cq=cq, type="RC",
                     cap={"max_send_wr": 64, "max_recv_wr": 64, "max_send_sge": 1, "max_recv_sge": 1,
                          "max_inline_data": 0})
    qp = r["qp"]
    lt_qpn = lt_qpn if lt_qpn is not None else 0x100 + secrets.randbelow(0xFFFE00)
    psn = secrets.randbelow(1 << 24) if psn is None else psn & 0xFFFFFF
    iut_psn = secrets.randbelow(1 << 24) if iut_psn is None else iut_psn & 0xFFFFFF
    c = NConn(t, qp, r["qpn"], pd, cq, mr, mr_h, lt_qpn, psn, iut_psn, mtu, 0xC000 | secrets.randbelow(0x4000),
              w=w, k=k, caps=caps)
    t._conns.append(c)
    t.agent.call("modify_qp", qp=qp, state="INIT", attrs={"access": list(access), "pkey": 0xFFFF})
    t.agent.call("modify_qp", qp=qp, state="RTR", attrs={
        "dest_qpn": lt_qpn, "rq_psn": psn, "path_mtu": mtu, "dgid": _gid(t.lt_ip), "dmac": t.lt_mac,
        "max_dest_rd_atomic": max_dest_rd_atomic, "min_rnr_timer": min_rnr_timer, "profile": "native",
        "native": {"caps": caps, "sack_window": w, "entropy_count": k}})
    t.agent.call("modify_qp", qp=qp, state="RTS", attrs={
        "sq_psn": iut_psn, "timeout": timeout, "retry_cnt": retry_cnt, "rnr_retry": rnr_retry,
        "max_rd_atomic": max_rd_atomic})
    q = c.query()
    if q.get("profile") != "native":
        raise CaseError(f"modify_qp with profile native left the QP in profile {q.get('profile')!r}")
    return c


# ---- work requests of the IUT (the IUT is the requester) ---------------------------------------------
def wr(c: NConn, op: str, length: int, *, wr_id: int, offset: int = 0, remote_off: int = 0, flags=("SIGNALED",),
       **extra) -> dict:
    w: dict = {"wr_id": hex(wr_id), "opcode": op, "sg_list": [{"mr": c.mr, "offset": offset, "len": length}],
               "flags": list(flags)}
    if op not in ("SEND", "SEND_WITH_IMM", "SEND_WITH_INV"):
        w["remote"] = {"va": hex(REMOTE_VA + remote_off), "rkey": REMOTE_RKEY}
    if op in ("SEND_WITH_IMM", "RDMA_WRITE_WITH_IMM"):
        w["imm"] = extra.pop("imm", 0x1234ABCD)
    w.update(extra)
    return w


def sync_all(t: T) -> None:
    """Wait for every post_send still in flight on the case's conns (before an agent call of the case's own:
    one agent session serves one request at a time)."""
    for c in list(t._conns):
        if isinstance(c, NConn):
            c.sync()


def post(c: NConn, *wrs: dict, wait: bool = False) -> int:
    """post_send the work requests; returns the capture mark before them.  The call runs in a thread of its own
    (wait=False) so that the LT can answer the IUT's packets at once, before the agent's reply comes back: the
    IUT's timers (an RTO of 4 ms before the first RTT sample) do not wait for the tester.  Every other agent call
    of the conn (poll, mem, query, counters ...) first waits for it and raises what it raised."""
    import threading
    c.sync()
    mark = c.t.lt.last_num()
    if wait:
        c.t.agent.call("post_send", qp=c.qp, wrs=list(wrs))
        return mark
    box: dict = {}

    def run():
        try:
            c.t.agent.call("post_send", qp=c.qp, wrs=list(wrs))
        except BaseException as e:              # noqa: BLE001 - re-raised by sync()
            box["exc"] = e
    th = threading.Thread(target=run, name="native-post", daemon=True)
    th.start()
    c._pending = (th, box)
    return mark


def wc_list(wcs: list[dict]) -> str:
    return ", ".join(f"{w.get('wr_id')}:{w.get('status', '?').replace('IBV_WC_', '')}" for w in wcs) or "none"


def check_wcs(t: T, rules, wcs: list[dict], want: list[tuple[int, str]], what: str, frames=()) -> bool:
    got = [(int(w["wr_id"], 16), w["status"]) for w in wcs]
    ok = got == want
    exp = ", ".join(f"{hex(i)}:{s.replace('IBV_WC_', '')}" for i, s in want)
    for r in ([rules] if isinstance(rules, str) else rules):
        t.check(r, ok, f"{what}: completions {wc_list(wcs)}" + ("" if ok else f", expected {exp}"), frames=frames,
                expected=f"completions {exp}", observed=[f"completions {wc_list(wcs)}"])
    return ok


def pattern(n: int, seed: int = 7) -> bytes:
    return bytes((i * 13 + seed) & 0xFF for i in range(n))


def need(cond: bool, why: str) -> None:
    if not cond:
        raise CaseError(why)


def wait_requests(c: NConn, after: int, psns: set[int], timeout: float = ACK_WAIT) -> list[Frame]:
    """The IUT's request frames after `after` until every PSN of `psns` was seen (first transmissions)."""
    seen: set[int] = set()

    def done(fs):
        seen.update(fpsn(f) for f in fs)
        return psns <= seen
    out = c.t.lt.collect(lambda f: c.is_mine(f) and is_req(f), timeout, after=after, until=done)
    if not psns <= seen:
        c.sync()                      # a post_send the agent refused says why nothing came (ENOTSUP: cannot drive)
    return out


def retx_before(frames: list[Frame], num: int) -> list[Frame]:
    """Retransmissions (NETH.R set, or a PSN seen twice) among the IUT's requests captured before frame num."""
    seen, out = set(), []
    for f in frames:
        if f.num >= num:
            break
        v = nv(f)
        if (v.neth is not None and v.neth.retx) or v.psn in seen:
            out.append(f)
        seen.add(v.psn)
    return out


def ndropped(t: T, c: NConn, bad: list[bytes], rules, what: str, *, offset: int = 0, length: int = 0,
             counter_name: str | None = None, qp_counter: str | None = None) -> bool:
    """_common.dropped_silently for a native responder: send `bad` (requests at c.psn the IUT must drop without
    a response), then a valid NATIVE_WRITE at the same PSN.  Pass when nothing answered the bad frames within
    QUIET s, bytes [offset, offset + length) of the MR still hold FILL, the counter (global `counter_name`
    or per-QP `qp_counter`) grew when the IUT reports it, and the valid WRITE is placed and SACKed at its PSN."""
    from ._common import counter
    n0 = counter(t, counter_name)
    q0 = c.native_counters() if qp_counter else None
    mark = c.send(*bad)
    seen = c.quiet(QUIET, after=mark)
    n1 = counter(t, counter_name)
    grew = n0 is None or (n1 is not None and n1 > n0)
    qgrew, qtext = counted(t, c, qp_counter, q0) if qp_counter else (True, "")
    untouched = c.mem(offset, length) == bytes([FILL]) * length if length else True
    good = b"GOOD"
    goff = offset + max(length, 64)
    psn = c.psn
    mark2 = c.send(*c.write_msg(good, goff))
    s = c.sack_for(psn, mark2)
    placed = c.mem(goff, len(good)) == good
    ok = not seen and untouched and grew and qgrew and s is not None and placed
    cnt = ("" if counter_name is None else f", {counter_name} +{n1 - n0}" if n0 is not None else
           f", {counter_name} not reported") + (f", {qtext}" if qtext else "")
    detail = (f"{what}: " + (f"no response, memory untouched{cnt}, the valid WRITE at the same PSN SACKed"
                             if ok else f"responses {summ(seen)}; memory untouched {untouched}{cnt}; valid WRITE at "
                             f"PSN {psn:#08x} SACKed {s is not None}, placed {placed}"))
    frames = seen + ([s] if s is not None else [])
    for r in ([rules] if isinstance(rules, str) else rules):
        t.check(r, ok, detail, frames=frames or [mark + 1],
                expected=f"nothing from the IUT for {QUIET:g} s, then a NATIVE_SACK cum {psn:#08x} for the valid WRITE")
    return ok


def sent_at(c: NConn, mark: int, timeout: float = 1.0) -> float:
    """The capture time of the first frame the LT sent after `mark` (what c.send just sent)."""
    f = c.t.lt.wait(lambda f: f.outgoing, timeout, after=mark)
    if f is None:
        raise CaseError("the LT's own frame was not captured")
    return f.ts


def iut_after(c: NConn, ts: float, frames) -> list[Frame]:
    """The frames among `frames` the IUT sent (captured) after time `ts` (the capture numbers of a loaded tester
    may lag; its kernel time stamps do not)."""
    return [f for f in frames if not f.outgoing and f.ts > ts]


__all__ = ["CAP", "FILL", "NConn", "REMOTE_RKEY", "REMOTE_VA", "TOS_ACK", "TOS_CE", "TOS_DATA", "WC_FLUSH", "WC_OK",
           "check_wcs", "connect_native", "counted", "describe", "fpsn", "is_ack_sack", "is_req", "is_sack",
           "iut_after", "ndropped", "need", "nobs", "nv", "op", "pattern", "peek", "post", "retx_before", "sent_at",
           "summ", "sync_all", "wait_requests", "wc_list", "wr"]
