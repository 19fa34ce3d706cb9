"""Header validation: what the IUT must drop silently, and what it must accept (MR-ENC, MR-ICRC, MR-BTH, MR-OPC)."""
from __future__ import annotations

from .. import packets as P
from ..registry import case
from ._common import ACK_WAIT, describe, dropped_silently, expect_ack


def _bad_write(c, **kw) -> bytes:
    """A WRITE ONLY of 16 bytes "BAD!" at MR offset 0 with the conn's next PSN (edited by kw)."""
    return c.frame("RDMA_WRITE_ONLY", ackreq=True, reth=(c.va, c.rkey, 16), payload=b"BAD!" * 4, **kw)


@case("TC-ACK-001-a", rules=["MR-ACK-001", "MR-ACK-003", "MR-ICRC-013"], category="ACK", timeout=10)
def write_only_acked(t):
    """A valid WRITE ONLY with AckReq is placed and ACKed with its PSN and the new MSN."""
    c = t.connect()
    data = bytes(range(48))
    mark = c.send(c.write(data, offset=128))
    ack = expect_ack(c, P.psn_add(c.psn, -1), mark)
    placed = c.mem(128, len(data)) == data
    exp = f"ACKNOWLEDGE ACK psn={P.psn_add(c.psn, -1):#08x} msn=1"
    t.check("MR-ACK-003", ack is not None, f"ACK {'seen' if ack else 'missing'}", frames=[ack] if ack else [mark + 1],
            expected=exp)
    t.check("MR-ACK-001", ack is not None and ack.roce.msn == 1,
            f"ACK msn={ack.roce.msn if ack else None} (expected 1)", frames=[ack] if ack else [mark + 1], expected=exp)
    t.check("MR-ICRC-013", placed, "a frame with a correct ICRC was accepted and placed" if placed
            else "a valid frame was not placed", frames=[mark + 1])


@case("TC-ICRC-014-a", rules=["MR-ICRC-014", "MR-ICRC-013"], category="ICRC", timeout=10)
def bad_icrc_dropped(t):
    """A WRITE whose ICRC has one bit flipped is dropped silently, neither NAKed nor placed."""
    c = t.connect()
    dropped_silently(t, c, _bad_write(c, bad_icrc=True), ["MR-ICRC-014", "MR-ICRC-013"], "ICRC bit 0 flipped",
                     length=16)


@case("TC-BTH-007-a", rules=["MR-BTH-007"], category="WIRE", timeout=10)
def tver_nonzero_dropped(t):
    """A request with TVer 1 is dropped without a response."""
    c = t.connect()
    dropped_silently(t, c, _bad_write(c, tver=1), ["MR-BTH-007"], "TVer 1", length=16)


@case("TC-OPC-003-a", rules=["MR-OPC-003"], category="SEQ", timeout=15)
def unknown_opcodes_dropped(t):
    """Opcodes outside Table 2-1 (0x15, 0x18, 0x1f, 0x64, 0xff) are dropped without a response."""
    c = t.connect()
    for op in (0x15, 0x18, 0x1F, 0x64, 0xFF):
        bad = c.frame(op, ackreq=True, headers=P.RETH(va=c.va, rkey=c.rkey, dlen=16).build(), payload=b"BAD!" * 4)
        dropped_silently(t, c, bad, ["MR-OPC-003"], f"opcode {op:#04x}", length=16)


@case("TC-NAK-002-a", rules=["MR-NAK-002", "MR-NAK-003"], category="ACK", timeout=10)
def future_psn_one_nak(t):
    """Three WRITEs after a gap: one PSN-sequence-error NAK at epsn, the others dropped silently."""
    c = t.connect()
    epsn = c.psn
    frames = [c.write(b"ahead%d" % i, offset=256 + 64 * i, psn=P.psn_add(epsn, 2 + i)) for i in range(3)]
    mark = c.send(*frames)
    got = c.quiet(0.4, after=mark)
    naks = [f for f in got if f.roce.op == 0x11 and f.roce.ack_kind == "NAK" and f.roce.nak_code == 0]
    exp = f"exactly one ACKNOWLEDGE NAK(0x60) psn={epsn:#08x}, nothing else"
    ok1 = len(naks) >= 1 and naks[0].roce.psn == epsn
    t.check("MR-NAK-002", ok1, f"responses: {describe(got)}", frames=got or [mark + 1], expected=exp)
    t.check("MR-NAK-003", len(got) == 1 and ok1, f"{len(got)} responses to 3 out-of-sequence packets",
            frames=got or [mark + 1], expected=exp)
    placed = any(c.mem(256 + 64 * i, 6) != bytes(6) for i in range(3))
    t.check("MR-NAK-002", not placed, "no out-of-sequence packet was placed" if not placed
            else "an out-of-sequence packet was placed", frames=[mark + 1])
    # epsn unchanged: the WRITE at epsn is accepted and ACKed; nak_sent cleared (MR-NAK-003)
    mark = c.send(c.write(b"inorder", offset=1024))
    ack = expect_ack(c, epsn, mark, ACK_WAIT)
    t.check("MR-NAK-003", ack is not None, "the packet at epsn was then accepted and ACKed" if ack
            else "no ACK for the packet at epsn", frames=[ack] if ack else [mark + 1],
            expected=f"ACKNOWLEDGE ACK psn={epsn:#08x}")
