"""Helpers of the requester, QP-state and congestion cases (cases/requester.py, qpstate.py, congestion.py).

The IUT's QP is the requester: the agent posts work requests at it and the LT
plays the responder frame by frame -- it withholds, drops, delays or forges the
responses.  Verdicts rest on captured frames (the requests the IUT sends and
their capture times) and on the completions the agent reports (MR-CONF-010).
"""
from __future__ import annotations

import time

from ..agentproto import AgentError
from .. import packets as P
from ..context import CaseError, Conn, T
from ..lt import Frame
from ._common import describe

# The LT's "memory": the IUT's requests name it, nothing on the LT side checks it.
REMOTE_VA = 0x7F00_0010_0000
REMOTE_RKEY = 0x00C0FFEE
REQUEST_OPS = frozenset({*range(0x00, 0x0D), 0x13, 0x14, 0x16, 0x17})
ACKNOWLEDGE, CNP = 0x11, 0x81
ACK_SYN = 0x1F                      # ACK, no credit information
WC_OK, WC_FLUSH = "IBV_WC_SUCCESS", "IBV_WC_WR_FLUSH_ERR"
STATE_ERRORS = ("ESTATE",)     # the agent's code for the refusals of MR-QP-004/017/018 (MR-CONF-023, 9.4.3)


def timeout_s(code: int) -> float:
    """MR-RETRY-001: T = 4.096 us x 2^timeout."""
    return 4.096e-6 * (1 << code)


def tolerance_s(t: T, nominal: float) -> float:
    """MR-CONF-011: max(10 %, 2 G, 50 us), G capped by the tester (T.granularity_s)."""
    return t.tolerance_s(nominal)


# ---- work requests at the IUT ---------------------------------------------------------------
def wr(op: str, length: int, *, wr_id: int, offset: int = 0, mr: int | None = None, c: Conn | None = None,
       remote_off: int = 0, signaled: bool = True, **extra) -> dict:
    """One post_send work request of the IUT QP: `length` bytes at `offset` of its MR, the remote side
    the LT's fictitious memory (REMOTE_VA + remote_off, REMOTE_RKEY)."""
    w: dict = {"wr_id": hex(wr_id), "opcode": op,
               "sg_list": [{"mr": mr if mr is not None else c.mr, "offset": offset, "len": length}],
               "flags": ["SIGNALED"] if signaled else []}
    if op not in ("SEND", "SEND_WITH_IMM", "SEND_WITH_INV"):
        w["remote"] = {"va": hex(REMOTE_VA + remote_off), "rkey": REMOTE_RKEY}
    if op in ("SEND_WITH_IMM", "RDMA_WRITE_WITH_IMM"):
        w.setdefault("imm", extra.pop("imm", 0x1234))
    w.update(extra)
    return w


def post(c: Conn, *wrs: dict) -> int:
    """Post the work requests (one agent call); returns the capture mark before them."""
    mark = c.t.lt.last_num()
    c.t.agent.call("post_send", qp=c.qp, wrs=list(wrs))
    return mark


def write_wr(c: Conn, length: int, wr_id: int, offset: int = 0, **kw) -> dict:
    return wr("RDMA_WRITE", length, wr_id=wr_id, offset=offset, c=c, **kw)


def read_wr(c: Conn, length: int, wr_id: int, offset: int = 0, **kw) -> dict:
    return wr("RDMA_READ", length, wr_id=wr_id, offset=offset, c=c, **kw)


# ---- frames from the IUT ---------------------------------------------------------------------
def is_req(f: Frame) -> bool:
    return f.roce.op in REQUEST_OPS


def requests(c: Conn, after: int, n: int, timeout: float, psn: int | None = None) -> list[Frame]:
    """Up to n request packets the IUT sends to the LT's QP after `after` (only PSN `psn` if given)."""
    if psn is None:
        return c.expect(n, timeout, after=after, match=is_req)
    return c.expect(n, timeout, after=after, match=lambda f: is_req(f) and f.roce.psn == psn)


def all_requests(c: Conn, after: int = 0) -> list[Frame]:
    """Every request packet of the IUT to this conn captured so far after `after`."""
    return [f for f in c.quiet(0.0, after=after) if is_req(f)]


def last_num(c: Conn) -> int:
    return c.t.lt.last_num()


# ---- frames to the IUT ------------------------------------------------------------------------
def ack(c: Conn, psn: int, msn: int, syndrome: int = ACK_SYN, **kw) -> bytes:
    """An ACKNOWLEDGE (ACK, NAK or RNR NAK by `syndrome`) to the IUT QP."""
    return c.frame("ACKNOWLEDGE", psn=psn, aeth=(syndrome, msn), **kw)


def nak(c: Conn, psn: int, msn: int, code: int) -> bytes:
    return ack(c, psn, msn, 0x60 | code)


def rnr(c: Conn, psn: int, msn: int, timer: int) -> bytes:
    return ack(c, psn, msn, 0x20 | (timer & 0x1F))


def read_rsp(c: Conn, op: str, psn: int, payload: bytes, msn: int, syndrome: int = ACK_SYN, **kw) -> bytes:
    """A READ RESPONSE packet to the IUT QP; FIRST/LAST/ONLY carry an AETH."""
    if op in ("RDMA_READ_RESPONSE_MIDDLE",):
        return c.frame(op, psn=psn, payload=payload, **kw)
    return c.frame(op, psn=psn, payload=payload, aeth=(syndrome, msn), **kw)


def read_stream(c: Conn, psn: int, data: bytes, msn: int) -> list[bytes]:
    """The correct READ RESPONSE packets for `data` starting at `psn` (MR-RC-002 segmentation)."""
    mtu = c.mtu
    n = max(1, -(-len(data) // mtu))
    out = []
    for k in range(n):
        chunk = data[k * mtu:(k + 1) * mtu]
        op = ("RDMA_READ_RESPONSE_ONLY" if n == 1 else "RDMA_READ_RESPONSE_FIRST" if k == 0 else
              "RDMA_READ_RESPONSE_LAST" if k == n - 1 else "RDMA_READ_RESPONSE_MIDDLE")
        out.append(read_rsp(c, op, P.psn_add(psn, k), chunk, msn))
    return out


def cnp(c: Conn, **kw) -> bytes:
    """A CNP of the LT's QP to the IUT QP (MR-XH-016: BECN, PSN 0, 16 reserved bytes)."""
    kw.setdefault("tos", 0xC0)
    return c.frame("CNP", psn=0, becn=True, **kw)


# ---- completions --------------------------------------------------------------------------------
def completions(c: Conn, n: int, timeout: float) -> list[dict]:
    return c.poll(n, timeout)


def wc_list(wcs: list[dict]) -> str:
    return ", ".join(f"{w.get('wr_id')}:{w.get('status', '?').replace('IBV_WC_', '')}" for w in wcs) or "none"


def expect_wcs(t: T, rules, wcs: list[dict], want: list[tuple[int, str]], what: str, frames=()) -> bool:
    """Decide each rule on the completions being exactly `want` [(wr_id, status)], in that order."""
    got = [(int(w["wr_id"], 16), w["status"]) for w in wcs]
    ok = got == want
    exp = ", ".join(f"{hex(i)}:{s.replace('IBV_WC_', '')}" for i, s in want)
    detail = f"{what}: completions {wc_list(wcs)}" + ("" if ok else f", expected {exp}")
    for r in ([rules] if isinstance(rules, str) else rules):
        t.check(r, ok, detail, frames=frames, expected=f"completions {exp}", observed=[f"completions {wc_list(wcs)}"])
    return ok


def qp_state(c: Conn) -> str:
    return c.query()["state"]


def sent_since(c: Conn, wall: float, mark: int, duration: float) -> list[Frame]:
    """What the IUT sends to this conn during `duration` s, captured after `mark` with a capture time stamp
    after `wall` (time.time()): a frame sent before `wall` that the capture thread numbered late (a loaded
    host) is not taken for one sent after it."""
    return [f for f in c.quiet(duration, after=mark) if f.ts > wall]


def check_err_silent(t: T, c: Conn, rules, what: str, quiet: float = 0.1) -> bool:
    """The IUT QP is in ERR (query_qp) and sends nothing for `quiet` s (MR-QP-025)."""
    st = qp_state(c)
    wall, mark = time.time(), last_num(c)
    seen = sent_since(c, wall, mark, quiet)
    ok = st == "ERR" and not seen
    for r in ([rules] if isinstance(rules, str) else rules):
        t.check(r, ok, f"{what}: QP state {st}, frames sent afterwards: {describe(seen)}",
                frames=seen, expected="QP in ERR, nothing sent", observed=[f"state {st}"] + [f.summary() for f in seen])
    return ok


def agent_error(fn) -> str | None:
    """Run an agent call; the error code it failed with, None on success."""
    try:
        fn()
    except AgentError as e:
        return e.code
    return None


def same_request(a: Frame, b: Frame) -> list[str]:
    """What differs between a request and its retransmission beyond what MR-RETRY-006 allows
    (AckReq and the ICRC-masked fields may differ)."""
    va, vb = a.roce, b.roce
    probs = []
    for name in ("op", "psn", "dqpn", "pkey", "se", "pad", "sport"):
        if getattr(va, name) != getattr(vb, name):
            probs.append(f"{name} {getattr(va, name)!r} -> {getattr(vb, name)!r}")
    ha = {k: bytes(v) for k, v in va.headers.items()}
    hb = {k: bytes(v) for k, v in vb.headers.items()}
    if ha != hb:
        probs.append(f"extension headers {sorted(ha)} differ")
    if va.payload != vb.payload:
        probs.append(f"payload of {len(va.payload)} B -> {len(vb.payload)} B differs")
    return probs


def pattern(n: int, seed: int = 7) -> bytes:
    return bytes((i * 13 + seed) & 0xFF for i in range(n))


def connect_req(t: T, **kw) -> Conn:
    """t.connect for a requester case: a short local ACK timeout unless given (timeout 10: T = 4.2 ms)."""
    kw.setdefault("timeout", 10)
    return t.connect(**kw)


def need(cond: bool, why: str) -> None:
    if not cond:
        raise CaseError(why)


def sleep_until(deadline: float) -> None:
    d = deadline - time.monotonic()
    if d > 0:
        time.sleep(d)


__all__ = ["ACKNOWLEDGE", "ACK_SYN", "CNP", "REMOTE_RKEY", "REMOTE_VA", "REQUEST_OPS", "STATE_ERRORS", "WC_FLUSH",
           "WC_OK", "ack", "agent_error", "all_requests", "check_err_silent", "cnp", "completions", "connect_req",
           "expect_wcs", "is_req", "last_num", "nak", "need", "pattern", "post", "qp_state", "read_rsp",
           "read_stream", "read_wr", "requests", "rnr", "same_request", "sent_since", "sleep_until", "timeout_s", "tolerance_s",
           "wc_list", "wr", "write_wr"]
