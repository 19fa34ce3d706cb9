"""Helpers shared by the case modules."""
from __future__ import annotations

from .. import packets as P
from ..context import Conn, T
from ..lt import Frame

QUIET = 0.25           # seconds of silence that count as "no response"
ACK_WAIT = 2.0         # seconds to wait for a response that must come (generous: a loaded host is slow)


def acks(frames: list[Frame]) -> list[Frame]:
    return [f for f in frames if f.roce.op == 0x11]


def describe(frames: list[Frame]) -> str:
    return ", ".join(f.summary() for f in frames) or "nothing"


def responses(c: Conn, after: int, first, timeout: float = ACK_WAIT, extra: float = QUIET) -> list[Frame]:
    """Every frame the IUT sends to this conn after `after`: waits up to `timeout` s for one that
    matches `first`, then `extra` s more for anything else (so a slow IUT is not taken for a silent
    one, and a second, unwanted response is still seen)."""
    got = c.expect(1, timeout, after=after, match=first)
    if not got:
        return c.quiet(0.0, after=after)
    before = [f for f in c.quiet(0.0, after=after) if f.num <= got[0].num]
    return before + c.quiet(extra, after=got[0].num)


def expect_ack(c: Conn, psn: int, after: int, timeout: float = ACK_WAIT) -> Frame | None:
    """The first ACKNOWLEDGE of type ACK with BTH.PSN psn that the IUT sends after `after`."""
    got = c.expect(1, timeout, after=after,
                   match=lambda f: f.roce.op == 0x11 and f.roce.ack_kind == "ACK" and f.roce.psn == psn)
    return got[0] if got else None


def counter(t: T, name: str | None) -> int | None:
    """A global IUT counter by its spec name (e.g. rx_drop_icrc), None when the IUT does not report it."""
    if name is None or name not in t.caps.get("counters", ()):
        return None
    return int(t.agent.call("get_counters")["counters"].get(name, 0))


def valid_write(c: Conn, offset: int, data: bytes) -> tuple[int, Frame | None]:
    """A valid WRITE ONLY with AckReq at c.psn, `data` at `offset` of the MR: (the capture mark before it,
    its ACK or None).  c.psn is left for the caller to advance."""
    mark = c.send(c.frame("RDMA_WRITE_ONLY", ackreq=True, reth=(c.va + offset, c.rkey, len(data)), payload=data))
    return mark, expect_ack(c, c.psn, mark)


def quiet_then_answered(c: Conn, mark: int, probe: Conn) -> tuple[list[Frame], Frame | None]:
    """A silence check that a stopped IUT cannot pass: the frames the IUT sent to `c` after `mark` over
    QUIET s, then a valid WRITE ONLY with AckReq to `probe` (another QP of the IUT connected to the LT) that
    must be ACKed.  Returns (frames to c since mark, counted until that ACK came; the ACK or None) -- the
    silence means "dropped" only when the ACK is there: the IUT was running and answered what came after."""
    c.quiet(QUIET, after=mark)
    _, a = valid_write(probe, 2048, b"ALIVE?")
    probe.psn = P.psn_add(probe.psn, 1)
    return c.quiet(0.0, after=mark), a


def alive_text(a: Frame | None) -> str:
    return "a WRITE to another QP sent after it was ACKed" if a is not None else \
        "a WRITE to another QP sent after it was NOT answered either: the silence proves nothing"


def dropped_silently(t: T, c: Conn, bad: bytes, rules: list[str], what: str, *, offset: int = 0,
                     length: int = 0, counter_name: str | None = None) -> None:
    """Send `bad` (a request at c.psn that the IUT must drop without a response), then the valid
    WRITE ONLY at the same PSN.  Pass for each rule when: nothing answered the bad frame within
    QUIET s; the bytes [offset, offset + length) of the MR are still zero; the counter the rule
    names (counter_name, e.g. rx_drop_icrc) grew, when the IUT reports it (get_counters; an IUT
    that does not report it is not failed for that); and the valid WRITE at the same PSN is ACKed
    (the drop changed no PSN state) and placed."""
    n0 = counter(t, counter_name)
    mark = c.send(bad)
    seen = c.quiet(QUIET, after=mark)
    n1 = counter(t, counter_name)
    counted = n0 is None or (n1 is not None and n1 > n0)
    before = c.mem(offset, length) if length else b""
    good = b"GOOD"
    goff = offset + max(length, 64)
    _, ack = valid_write(c, goff, good)
    placed = c.mem(goff, len(good)) == good
    untouched = before == bytes(length)
    ok = not seen and untouched and ack is not None and placed and counted
    cnt = "" if counter_name is None else (f", {counter_name} +{n1 - n0}" if n0 is not None else
                                           f", {counter_name} not reported")
    detail = (f"{what}: " + (f"no response, memory untouched{cnt}, the valid WRITE at the same PSN ACKed"
                             if ok else
                             f"responses to it: {describe(seen)}; memory untouched: {untouched}{cnt}; "
                             f"valid WRITE at PSN {c.psn:#08x} ACKed: {ack is not None}, placed: {placed}"))
    frames = seen + ([ack] if ack is not None else [])
    exp = (f"no frame from the IUT for {QUIET:g} s after the bad frame"
           + (f", {counter_name} incremented" if counter_name else "")
           + f", then ACKNOWLEDGE ACK psn={c.psn:#08x} for the valid WRITE")
    for r in rules:
        t.check(r, ok, detail, frames=frames or [mark + 1], expected=exp)
    c.psn = P.psn_add(c.psn, 1)
