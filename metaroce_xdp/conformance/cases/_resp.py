"""Helpers of the responder and memory cases (cases/responder.py, cases/memory.py).

The IUT's QP is the responder; the LT plays the requester frame by frame.  Every
helper decides from captured frames, agent replies and memory read through the
agent only (MR-CONF-010).
"""
from __future__ import annotations

from ..agentproto import AgentError
from .. import packets as P
from ..context import CaseError, Conn, CannotDrive, T
from ..lt import Frame
from ._common import ACK_WAIT, QUIET, describe

FILL = 0x5A                       # every byte of a case's MRs before the case writes anything
ACKNOWLEDGE, ATOMIC_ACKNOWLEDGE = 0x11, 0x12
READ_RESPONSES = (0x0D, 0x0E, 0x0F, 0x10)
NAK_NAMES = {0: "PSN sequence error", 1: "invalid request", 2: "remote access error", 3: "remote operational error"}


def npsn(length: int, mtu: int) -> int:
    """PSNs an RDMA READ of `length` bytes consumes (MR-RC-004)."""
    return max(1, -(-length // mtu))


def req(c: Conn, op, *, psn: int | None = None, n: int = 1, ackreq: bool = True, **kw) -> bytes:
    """A request frame at c.psn (or `psn`); with psn None, c.psn advances by n."""
    f = c.frame(op, psn=psn, ackreq=ackreq, **kw)
    if psn is None:
        c.psn = P.psn_add(c.psn, n)
    return f


def read_req(c: Conn, va: int, length: int, rkey: int | None = None, psn: int | None = None) -> bytes:
    """An RDMA READ REQUEST; with psn None it takes c.psn and advances c.psn by its response count."""
    return req(c, "RDMA_READ_REQUEST", psn=psn, n=npsn(length, c.mtu),
               reth=(va, c.rkey if rkey is None else rkey, length))


def atomic_req(c: Conn, op: str, va: int, swap_add: int, compare: int = 0, rkey: int | None = None,
               psn: int | None = None) -> bytes:
    return req(c, op, psn=psn, atomic=(va, c.rkey if rkey is None else rkey, swap_add, compare))


def first_response(c: Conn, mark: int, timeout: float = ACK_WAIT) -> Frame | None:
    """The first ACKNOWLEDGE, ATOMIC ACKNOWLEDGE or READ RESPONSE the IUT sends after `mark`."""
    got = c.expect(1, timeout, after=mark, match=lambda f: f.roce.op in (ACKNOWLEDGE, ATOMIC_ACKNOWLEDGE)
                   + READ_RESPONSES)
    return got[0] if got else None


def read_responses(c: Conn, mark: int, count: int, timeout: float = 2.0) -> list[Frame]:
    return c.expect(count, timeout, after=mark, match=lambda f: f.roce.op in READ_RESPONSES)


def aeth_text(f: Frame | None) -> str:
    return f.summary() if f is not None else "nothing"


def prime(t: T, c: Conn, offset: int = 0) -> int:
    """One valid WRITE ONLY of 8 bytes at `offset`, ACKed: the responder's msn is then 1.
    Raises CaseError (a precondition) when it is not ACKed."""
    mark = c.send(c.write(b"PRIMEPRM", offset=offset))
    psn = P.psn_add(c.psn, -1)
    got = c.expect(1, ACK_WAIT, after=mark, match=lambda f: f.roce.op == ACKNOWLEDGE and f.roce.psn == psn)
    if not got or got[0].roce.ack_kind != "ACK":
        raise CaseError(f"the priming WRITE at PSN {psn:#08x} was not ACKed: {describe(got)}")
    return 1


def check_nak(t: T, c: Conn, rules, mark: int, code, psn: int, msn: int, what: str,
              timeout: float = ACK_WAIT) -> Frame | None:
    """Wait for the IUT's first response after `mark` and decide each rule on it: an ACKNOWLEDGE
    with a NAK syndrome 0x60 | code, BTH.PSN psn and AETH MSN msn (MR-NAK-001, MR-XH-007).
    `code` may be a tuple of the codes the spec allows (e.g. (1, 2), MR-NAK-014)."""
    codes = (code,) if isinstance(code, int) else tuple(code)
    f = first_response(c, mark, timeout)
    exp = " or ".join(f"ACKNOWLEDGE NAK({0x60 | k:#04x}) psn={psn:#08x} msn={msn} ({NAK_NAMES.get(k, k)})"
                      for k in codes)
    ok = (f is not None and f.roce.op == ACKNOWLEDGE and f.roce.ack_kind == "NAK" and f.roce.nak_code in codes
          and f.roce.psn == psn and f.roce.msn == msn)
    detail = f"{what}: " + (f"NAK code {f.roce.nak_code} psn={psn:#08x} msn={msn}" if ok else f"got {aeth_text(f)}")
    for r in ([rules] if isinstance(rules, str) else rules):
        t.check(r, ok, detail, frames=[f] if f is not None else [mark + 1], expected=exp)
    return f


def check_err(t: T, c: Conn, rules, what: str) -> bool:
    """The IUT QP is in ERR (query_qp) and a valid WRITE at the next PSN is neither answered nor placed
    (MR-QP-025)."""
    st = c.query()["state"]
    probe_off = c.mr_len - 16
    before = c.mem(probe_off, 8)
    mark = c.send(req(c, "RDMA_WRITE_ONLY", reth=(c.va + probe_off, c.rkey, 8), payload=b"PROBE!!!"))
    seen = c.quiet(QUIET, after=mark)
    untouched = c.mem(probe_off, 8) == before
    ok = st == "ERR" and not seen and untouched
    detail = (f"{what}: QP state {st}; a valid WRITE afterwards: responses {describe(seen[:3])}"
              f"{f' and {len(seen) - 3} more' if len(seen) > 3 else ''}, "
              f"placed: {not untouched}")
    for r in ([rules] if isinstance(rules, str) else rules):
        t.check(r, ok, detail, frames=seen or [mark + 1], expected="QP in ERR, nothing sent, nothing placed",
                observed=[detail])
    return ok


def check_state(t: T, c: Conn, rules, want: str, what: str) -> bool:
    st = c.query()["state"]
    for r in ([rules] if isinstance(rules, str) else rules):
        t.check(r, st == want, f"{what}: QP state {st}", expected=f"QP state {want}", observed=[f"state {st}"])
    return st == want


def check_untouched(t: T, c: Conn, rules, offset: int, length: int, what: str, mr: int | None = None,
                    fill: int = FILL) -> bool:
    """`length` bytes of the MR (c's own, or handle `mr`) at `offset` still hold the fill byte."""
    if mr is None:
        got = c.mem(offset, length)
    else:
        got = bytes.fromhex(t.agent.call("mem_read", mr=mr, offset=offset, len=length)["hex"])
    ok = got == bytes([fill]) * length
    bad = next((i for i, b in enumerate(got) if b != fill), None)
    detail = f"{what}: " + ("memory untouched" if ok else f"memory changed at offset {offset + bad}")
    for r in ([rules] if isinstance(rules, str) else rules):
        t.check(r, ok, detail, expected=f"{length} bytes of {fill:#04x} at offset {offset}",
                observed=[got[:64].hex()])
    return ok


def poll_one(t: T, c: Conn, timeout: float = 1.0) -> dict | None:
    got = c.poll(1, timeout)
    return got[0] if got else None


def wc_text(wc: dict | None) -> str:
    if wc is None:
        return "no completion"
    return ", ".join(f"{k}={v}" for k, v in wc.items())


def reg_mr(t: T, pd: int, length: int = 4096, access=("LOCAL_WRITE", "REMOTE_WRITE", "REMOTE_READ",
                                                      "REMOTE_ATOMIC"),
           fill: int = FILL, remote_invalidate: bool = False) -> tuple[int, dict]:
    """reg_mr through the agent (deregistered after the case), optionally remotely invalidatable."""
    args = {"pd": pd, "len": length, "access": list(access), "fill": fill}
    if remote_invalidate:
        args["remote_invalidate"] = True
    try:
        r = t.agent.call("reg_mr", **args)
    except AgentError as e:
        if remote_invalidate and e.code == "ENOTSUP":      # MR-MEM-042: offering one is a MAY
            raise CannotDrive(f"the IUT offers no remotely invalidatable MR: {e.message}") from None
        raise
    t._extra.append(("dereg_mr", {"mr": r["mr"]}))
    return r["mr"], r


def dereg_mr(t: T, mr: int) -> None:
    """Deregister now (and not again at clean-up)."""
    t.agent.call("dereg_mr", mr=mr)
    t._extra[:] = [x for x in t._extra if x != ("dereg_mr", {"mr": mr})]


def connect(t: T, **kw) -> Conn:
    """t.connect with the MR filled with FILL."""
    kw.setdefault("fill", FILL)
    return t.connect(**kw)


__all__ = ["ACKNOWLEDGE", "ATOMIC_ACKNOWLEDGE", "FILL", "READ_RESPONSES", "atomic_req", "check_err", "check_nak",
           "check_state", "check_untouched", "connect", "dereg_mr", "first_response", "npsn", "poll_one", "prime",
           "read_req", "read_responses", "reg_mr", "req", "wc_text"]


def check_rkey_counter(t: T, c: Conn, what: str, want: int = 1) -> None:
    """MR-MEM-019: the QP's rx_rkey_violation counter (get_counters) counts the failed key check."""
    try:
        v = c.counters().get("rx_rkey_violation")
    except AgentError as e:
        if e.code != "ENOTSUP":
            raise
        v = None
    if v is None:                    # an agent that cannot read per-QP counters (rdma-core devices)
        t.cannot_drive("MR-MEM-019", "the agent reports no per-QP rx_rkey_violation counter")
        return
    t.check("MR-MEM-019", v == want, f"{what}: rx_rkey_violation {v}", expected=f"rx_rkey_violation {want}",
            observed=[f"rx_rkey_violation {v}"])


def expect_fatal(t: T, c: Conn, frame: bytes, code: int, what: str, *, nak=(), mem=(), err=(),
                 untouched=(), msn: int = 1, psn: int | None = None) -> Frame | None:
    """Send `frame` (a request at PSN `psn`, default the PSN before c.psn) to a QP whose msn is `msn`
    and decide: `nak` rules on a NAK with code `code`, that PSN and msn; `mem` rules on each
    (mr handle or None, offset, length) of `untouched` still holding FILL; `err` rules on the QP
    being in ERR and silent afterwards."""
    psn = P.psn_add(c.psn, -1) if psn is None else psn
    mark = c.send(frame)
    f = check_nak(t, c, nak, mark, code, psn, msn, what)
    if code == 2 and "MR-MEM-019" in t.case.rules:
        check_rkey_counter(t, c, what)
    for mr, off, n in untouched:
        check_untouched(t, c, mem, off, n, what, mr=mr)
    if err:
        check_err(t, c, err, what)
    return f
