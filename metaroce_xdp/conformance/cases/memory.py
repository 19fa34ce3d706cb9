"""Memory protection at the IUT's responder (08-memory.md): keys, protection domains, access rights,
bounds, zero-length requests, deregistration, invalidation and the receive WQE's local checks.

Every violation must be answered with the NAK its check gives (code 2 for a remote key check,
code 1 for an invalid request, code 3 for a bad receive WQE), carry the request's PSN and the
current MSN, move the QP to ERR and leave every byte of memory as it was: the MRs are filled
with FILL before the case and read back through the agent afterwards (MR-MEM-027).
"""
from __future__ import annotations

from ..agentproto import AgentError
from .. import packets as P
from ..registry import case
from ._common import describe
from ._resp import (ACKNOWLEDGE, FILL, READ_RESPONSES, atomic_req, check_err, check_nak, check_untouched,
                    connect, dereg_mr, expect_fatal, first_response, poll_one, prime, read_req, reg_mr, req,
                    wc_text)

PAYLOAD = bytes(range(1, 65))
NAK2 = ["MR-NAK-007", "MR-NAK-001", "MR-MEM-026"]
MEM = ["MR-MEM-027", "MR-NAK-009"]
ERR = ["MR-NAK-009", "MR-MEM-026"]


def _write(c, va, rkey, data=PAYLOAD[:16]):
    return req(c, "RDMA_WRITE_ONLY", reth=(va, rkey, len(data)), payload=data)


def _other_key(rkey: int, tag_only: bool) -> int:
    """The rkey with another tag (same index), or with an index far from it."""
    if tag_only:
        return (rkey & ~0xFF) | ((rkey + 0x5B) & 0xFF)
    return rkey ^ 0x00A5_5A00


# ---- R_Key lookup (MR-MEM-021, MR-MEM-014, MR-MEM-016) ---------------------------------------
@case("TC-MEM-021-a", rules=["MR-MEM-019", "MR-MEM-021", "MR-MEM-014", "MR-MEM-016", *NAK2, "MR-MEM-027", "MR-NAK-009"],
      category="MEM", timeout=10)
def write_wrong_tag(t):
    """A WRITE whose R_Key has the right index and a wrong tag: NAK code 2, nothing written, QP in ERR."""
    c = connect(t)
    prime(t, c)
    expect_fatal(t, c, _write(c, c.va + 256, _other_key(c.rkey, True)), 2, "R_Key with a wrong tag",
                 nak=["MR-MEM-021", "MR-MEM-014", "MR-MEM-016", *NAK2], mem=MEM, err=ERR,
                 untouched=[(None, 256, 16)])


@case("TC-MEM-021-b", rules=["MR-MEM-019", "MR-MEM-021", "MR-MEM-016", *NAK2, "MR-MEM-027", "MR-NAK-009"],
      category="MEM", timeout=10)
def write_unknown_index(t):
    """A WRITE whose R_Key names an index holding no MR: the same NAK code 2, nothing written, QP in ERR."""
    c = connect(t)
    prime(t, c)
    expect_fatal(t, c, _write(c, c.va + 256, _other_key(c.rkey, False)), 2, "R_Key of an unused index",
                 nak=["MR-MEM-021", "MR-MEM-016", *NAK2], mem=MEM, err=ERR, untouched=[(None, 256, 16)])


@case("TC-MEM-009-a", rules=["MR-MEM-009", "MR-MEM-021", *NAK2, "MR-MEM-027", "MR-NAK-009"],
      category="MEM", timeout=10)
def write_rkey_zero(t):
    """An 8-byte WRITE with R_Key 0 (never valid) at a valid address: NAK code 2, nothing written."""
    c = connect(t)
    prime(t, c)
    expect_fatal(t, c, _write(c, c.va + 256, 0, PAYLOAD[:8]), 2, "R_Key 0 with DMA Length 8",
                 nak=["MR-MEM-009", "MR-MEM-021", *NAK2], mem=MEM, err=ERR, untouched=[(None, 256, 8)])


@case("TC-MEM-021-c", rules=["MR-MEM-021", "MR-MEM-027", *NAK2, "MR-NAK-009"], category="MEM", timeout=10)
def read_wrong_key(t):
    """A READ with a wrong R_Key: NAK code 2 and no READ RESPONSE, QP in ERR."""
    c = connect(t)
    prime(t, c)
    mark = c.send(read_req(c, c.va + 512, 64, rkey=_other_key(c.rkey, True)))
    p = P.psn_add(c.psn, -1)
    check_nak(t, c, ["MR-MEM-021", *NAK2], mark, 2, p, 1, "READ with a wrong R_Key")
    data = [f for f in c.quiet(0.1, after=mark) if f.roce.op in READ_RESPONSES]
    t.check("MR-MEM-027", not data, "no READ RESPONSE" if not data else f"READ RESPONSE sent: {describe(data)}",
            frames=data or [mark + 1], expected="no READ RESPONSE")
    check_err(t, c, ERR, "READ with a wrong R_Key")


@case("TC-MEM-021-d", rules=["MR-MEM-019", "MR-MEM-021", "MR-ATOM-005", "MR-ATOM-011", *NAK2, "MR-NAK-009"],
      category="ATOM", caps=("ATOMICS",), timeout=10)
def atomic_wrong_key(t):
    """A FETCH_ADD with a wrong R_Key: NAK code 2, the target word unchanged, QP in ERR."""
    c = connect(t)
    prime(t, c)
    expect_fatal(t, c, atomic_req(c, "FETCH_ADD", c.va + 1024, 1, rkey=_other_key(c.rkey, True)), 2,
                 "FETCH_ADD with a wrong R_Key", nak=["MR-MEM-021", "MR-ATOM-005", *NAK2],
                 mem=["MR-ATOM-011", "MR-NAK-009"], err=ERR, untouched=[(None, 1024, 8)])


# ---- bounds (MR-MEM-024) -----------------------------------------------------------------
@case("TC-MEM-024-a", rules=["MR-MEM-019", "MR-MEM-024", *NAK2, "MR-MEM-027", "MR-NAK-009"], category="MEM", timeout=10)
def write_past_end(t):
    """EX-MEM-1: an 8-byte WRITE at the MR's last 4 bytes: NAK code 2, not even the 4 bytes that fit are written."""
    c = connect(t)
    prime(t, c)
    expect_fatal(t, c, _write(c, c.va + c.mr_len - 4, c.rkey, PAYLOAD[:8]), 2, "WRITE 4 bytes past the end",
                 nak=["MR-MEM-024", *NAK2], mem=MEM, err=ERR, untouched=[(None, c.mr_len - 64, 64)])


@case("TC-MEM-024-b", rules=["MR-MEM-024", *NAK2, "MR-MEM-027", "MR-NAK-009"], category="MEM", timeout=10)
def write_before_start(t):
    """A 16-byte WRITE starting one byte before the MR: NAK code 2, the MR's first bytes untouched."""
    c = connect(t)
    mark = c.send(c.write(b"PRIMEPRM", offset=c.mr_len - 128))        # prime away from the start
    if first_response(c, mark) is None:
        t.undecided("MR-MEM-024", "the priming WRITE was not answered")
    expect_fatal(t, c, _write(c, c.va - 1, c.rkey, PAYLOAD[:16]), 2, "WRITE from one byte before the start",
                 nak=["MR-MEM-024", *NAK2], mem=MEM, err=ERR, untouched=[(None, 0, 64)])


@case("TC-MEM-024-c", rules=["MR-MEM-024", "MR-RC-018", "MR-ACK-001"], category="MEM", timeout=10)
def write_edges_accepted(t):
    """WRITEs covering exactly the MR's first and last bytes, and the whole MR's last MTU, are placed and ACKed."""
    c = connect(t, mr_len=8192)
    for i, (off, n) in enumerate(((0, 8), (c.mr_len - 8, 8), (c.mr_len - c.mtu, c.mtu))):
        data = bytes((i * 7 + off) & 0xFF for i in range(n))
        p = c.psn
        mark = c.send(_write(c, c.va + off, c.rkey, data))
        f = first_response(c, mark)
        ok = f is not None and f.roce.ack_kind == "ACK" and f.roce.psn == p
        t.check("MR-MEM-024", ok, f"WRITE [{off}, {off + n}) of a {c.mr_len}-byte MR: {describe([f] if f else [])}",
                frames=[f] if f else [mark + 1], expected=f"ACKNOWLEDGE ACK psn={p:#08x}")
        t.check("MR-ACK-001", ok and f.roce.msn == i + 1, f"ACK msn={f.roce.msn if f else None} (expected {i + 1})",
                frames=[f] if f else [mark + 1])
        placed = c.mem(off, n) == data
        t.check("MR-RC-018", placed, f"[{off}, {off + n}) placed: {placed}", frames=[mark + 1])


@case("TC-MEM-024-d", rules=["MR-MEM-024", "MR-MEM-027", *NAK2, "MR-NAK-009"], category="MEM", timeout=10)
def read_past_end(t):
    """A READ of the whole MR plus one byte: NAK code 2 and no READ RESPONSE."""
    c = connect(t, mr_len=8192)
    prime(t, c)
    mark = c.send(read_req(c, c.va, c.mr_len + 1))
    p = P.psn_add(c.psn, -((c.mr_len + 1 + c.mtu - 1) // c.mtu))
    check_nak(t, c, ["MR-MEM-024", *NAK2], mark, 2, p, 1, "READ one byte past the end")
    data = [f for f in c.quiet(0.1, after=mark) if f.roce.op in READ_RESPONSES]
    t.check("MR-MEM-027", not data, "no READ RESPONSE" if not data else f"READ RESPONSE sent: {describe(data)}",
            frames=data or [mark + 1], expected="no READ RESPONSE")
    check_err(t, c, ERR, "READ past the end")


@case("TC-MEM-024-e", rules=["MR-MEM-024", *NAK2, "MR-NAK-009"], category="MEM", timeout=10)
def write_va_wraps(t):
    """A WRITE whose VA + DMA Length wraps past 2^64 (VA 2^64 - 4, 8 bytes): NAK code 2, QP in ERR."""
    c = connect(t)
    prime(t, c)
    expect_fatal(t, c, _write(c, (1 << 64) - 4, c.rkey, PAYLOAD[:8]), 2, "VA + length wraps 2^64",
                 nak=["MR-MEM-024", *NAK2], err=ERR)


@case("TC-MEM-024-f", rules=["MR-MEM-024", "MR-NAK-014", "MR-ATOM-002", "MR-ATOM-011", "MR-NAK-007"],
      category="ATOM", caps=("ATOMICS",), timeout=10)
def atomic_past_end_is_access_error(t):
    """A FETCH_ADD at the MR's last 4 bytes fails bounds before alignment (NAK 2, not 1); the last 8 execute."""
    c = connect(t)
    prime(t, c)
    expect_fatal(t, c, atomic_req(c, "FETCH_ADD", c.va + c.mr_len - 4, 1), 2,
                 "FETCH_ADD at the last 4 bytes (out of bounds and unaligned)",
                 nak=["MR-MEM-024", "MR-NAK-014", "MR-ATOM-002", "MR-NAK-007"], mem=["MR-ATOM-011"],
                 untouched=[(None, c.mr_len - 16, 16)])
    c2 = connect(t)
    c2.mem_write(c2.mr_len - 8, (41).to_bytes(8, "little"))
    p = c2.psn
    mark = c2.send(atomic_req(c2, "FETCH_ADD", c2.va + c2.mr_len - 8, 1))
    f = first_response(c2, mark)
    ok = (f is not None and f.roce.op == 0x12 and f.roce.psn == p
          and int(f.roce.headers["AtomicAckETH"].orig) == 41 and c2.mem(c2.mr_len - 8, 8) == (42).to_bytes(8, "little"))
    t.check("MR-MEM-024", ok, f"FETCH_ADD at the last 8 bytes: {describe([f] if f else [])}",
            frames=[f] if f else [mark + 1], expected=f"ATOMIC_ACKNOWLEDGE psn={p:#08x} orig=0x29, memory 42")


# ---- access rights of the MR (MR-MEM-023, MR-MEM-013, MR-MEM-017) ---------------------------
def _mr_without(t, c, missing: str):
    access = [a for a in ("LOCAL_WRITE", "REMOTE_WRITE", "REMOTE_READ", "REMOTE_ATOMIC") if a != missing]
    return reg_mr(t, c.pd, 4096, access)


@case("TC-MEM-023-a", rules=["MR-MEM-019", "MR-MEM-023", "MR-MEM-017", "MR-SEC-008", *NAK2, "MR-MEM-027", "MR-NAK-009"],
      category="MEM", timeout=10)
def write_mr_without_remote_write(t):
    """A WRITE to an MR of the QP's PD registered without REMOTE_WRITE: NAK code 2 (not 1), nothing written."""
    c = connect(t)
    h, mr = _mr_without(t, c, "REMOTE_WRITE")
    prime(t, c)
    expect_fatal(t, c, _write(c, int(mr["va"], 16) + 64, mr["rkey"]), 2, "WRITE to an MR without REMOTE_WRITE",
                 nak=["MR-MEM-023", "MR-MEM-017", "MR-SEC-008", *NAK2], mem=MEM, err=ERR,
                 untouched=[(h, 0, 256)])


@case("TC-MEM-023-b", rules=["MR-MEM-023", "MR-MEM-027", *NAK2, "MR-NAK-009"], category="MEM", timeout=10)
def read_mr_without_remote_read(t):
    """A READ from an MR registered without REMOTE_READ: NAK code 2 and no READ RESPONSE."""
    c = connect(t)
    h, mr = _mr_without(t, c, "REMOTE_READ")
    prime(t, c)
    mark = c.send(read_req(c, int(mr["va"], 16), 128, rkey=mr["rkey"]))
    check_nak(t, c, ["MR-MEM-023", *NAK2], mark, 2, P.psn_add(c.psn, -1), 1, "READ of an MR without REMOTE_READ")
    data = [f for f in c.quiet(0.1, after=mark) if f.roce.op in READ_RESPONSES]
    t.check("MR-MEM-027", not data, "no READ RESPONSE" if not data else f"READ RESPONSE sent: {describe(data)}",
            frames=data or [mark + 1], expected="no READ RESPONSE")
    check_err(t, c, ERR, "READ of an MR without REMOTE_READ")


@case("TC-MEM-023-c", rules=["MR-MEM-023", "MR-MEM-039", "MR-ATOM-005", "MR-ATOM-011", *NAK2, "MR-NAK-009"],
      category="ATOM", caps=("ATOMICS",), timeout=10)
def atomic_mr_without_remote_atomic(t):
    """A COMPARE_SWAP on an MR registered without REMOTE_ATOMIC: NAK code 2, the word unchanged."""
    c = connect(t)
    h, mr = _mr_without(t, c, "REMOTE_ATOMIC")
    prime(t, c)
    fill_word = int.from_bytes(bytes([FILL]) * 8, "little")
    expect_fatal(t, c, atomic_req(c, "COMPARE_SWAP", int(mr["va"], 16) + 64, 7, fill_word, rkey=mr["rkey"]), 2,
                 "COMPARE_SWAP on an MR without REMOTE_ATOMIC",
                 nak=["MR-MEM-023", "MR-MEM-039", "MR-ATOM-005", *NAK2], mem=["MR-ATOM-011", "MR-NAK-009"],
                 err=ERR, untouched=[(h, 0, 256)])


@case("TC-MEM-013-a", rules=["MR-MEM-013", "MR-MEM-017", *NAK2, "MR-MEM-027"], category="MEM", timeout=10)
def write_mr_local_only(t):
    """A WRITE with the rkey of an MR registered with LOCAL_WRITE only: NAK code 2, nothing written."""
    c = connect(t)
    h, mr = reg_mr(t, c.pd, 4096, ["LOCAL_WRITE"])
    prime(t, c)
    expect_fatal(t, c, _write(c, int(mr["va"], 16), mr["rkey"]), 2, "WRITE to a local-only MR",
                 nak=["MR-MEM-013", "MR-MEM-017", *NAK2], mem=["MR-MEM-027"], err=["MR-MEM-026"],
                 untouched=[(h, 0, 256)])


# ---- protection domain (MR-MEM-022) --------------------------------------------------------
@case("TC-MEM-022-a", rules=["MR-MEM-019", "MR-MEM-022", "MR-SEC-008", *NAK2, "MR-MEM-027", "MR-NAK-009"],
      category="MEM", timeout=10)
def write_other_pd(t):
    """A WRITE with the rkey of a fully accessible MR of another PD: NAK code 2, that MR untouched."""
    c = connect(t)
    h, mr = reg_mr(t, t.pd(), 4096)
    prime(t, c)
    expect_fatal(t, c, _write(c, int(mr["va"], 16) + 32, mr["rkey"]), 2, "WRITE to an MR of another PD",
                 nak=["MR-MEM-022", "MR-SEC-008", *NAK2], mem=MEM, err=ERR, untouched=[(h, 0, 256)])


@case("TC-MEM-022-b", rules=["MR-MEM-022", "MR-MEM-027", *NAK2, "MR-NAK-009"], category="MEM", timeout=10)
def read_other_pd(t):
    """A READ with the rkey of an MR of another PD: NAK code 2 and no READ RESPONSE."""
    c = connect(t)
    h, mr = reg_mr(t, t.pd(), 4096)
    prime(t, c)
    mark = c.send(read_req(c, int(mr["va"], 16), 100, rkey=mr["rkey"]))
    check_nak(t, c, ["MR-MEM-022", *NAK2], mark, 2, P.psn_add(c.psn, -1), 1, "READ of an MR of another PD")
    data = [f for f in c.quiet(0.1, after=mark) if f.roce.op in READ_RESPONSES]
    t.check("MR-MEM-027", not data, "no READ RESPONSE" if not data else f"READ RESPONSE sent: {describe(data)}",
            frames=data or [mark + 1], expected="no READ RESPONSE")
    check_err(t, c, ERR, "READ of an MR of another PD")


@case("TC-MEM-022-c", rules=["MR-MEM-022", "MR-ATOM-005", "MR-ATOM-011", *NAK2], category="ATOM",
      caps=("ATOMICS",), timeout=10)
def atomic_other_pd(t):
    """A FETCH_ADD with the rkey of an MR of another PD: NAK code 2, its word unchanged."""
    c = connect(t)
    h, mr = reg_mr(t, t.pd(), 4096)
    prime(t, c)
    expect_fatal(t, c, atomic_req(c, "FETCH_ADD", int(mr["va"], 16) + 8, 1, rkey=mr["rkey"]), 2,
                 "FETCH_ADD on an MR of another PD", nak=["MR-MEM-022", "MR-ATOM-005", *NAK2],
                 mem=["MR-ATOM-011"], err=["MR-MEM-026"], untouched=[(h, 0, 64)])


# ---- deregistration (MR-MEM-033) -------------------------------------------------------------
@case("TC-MEM-033-a", rules=["MR-MEM-019", "MR-MEM-033", "MR-MEM-014", "MR-SEC-003", *NAK2, "MR-MEM-027", "MR-NAK-009"],
      category="MEM", timeout=10)
def write_deregistered(t):
    """A WRITE with the rkey of an MR deregistered before it arrives: NAK code 2, nothing written anywhere."""
    c = connect(t)
    h, mr = reg_mr(t, c.pd, 4096)
    prime(t, c)
    dereg_mr(t, h)
    expect_fatal(t, c, _write(c, int(mr["va"], 16), mr["rkey"]), 2, "WRITE to a deregistered MR",
                 nak=["MR-MEM-033", "MR-MEM-014", "MR-SEC-003", *NAK2], mem=MEM, err=ERR,
                 untouched=[(None, 64, c.mr_len - 128)])


@case("TC-MEM-033-b", rules=["MR-MEM-033", "MR-SEC-003", "MR-NAK-007", "MR-NAK-009"], category="MEM",
      timeout=10)
def write_dereg_mid_message(t):
    """An MR deregistered between a WRITE's FIRST and MIDDLE: the MIDDLE gets NAK code 2 at its PSN, QP in ERR."""
    c = connect(t, mtu=256)
    h, mr = reg_mr(t, c.pd, 4096)
    prime(t, c)
    va = int(mr["va"], 16)
    first = req(c, "RDMA_WRITE_FIRST", reth=(va, mr["rkey"], 3 * 256), payload=bytes([1]) * 256, ackreq=True)
    mark = c.send(first)
    f = first_response(c, mark)
    if f is None or f.roce.ack_kind != "ACK":
        t.undecided("MR-MEM-033", f"the WRITE FIRST was not ACKed: {describe([f] if f else [])}")
    dereg_mr(t, h)
    p = c.psn
    mark = c.send(req(c, "RDMA_WRITE_MIDDLE", payload=bytes([2]) * 256))
    check_nak(t, c, ["MR-MEM-033", "MR-SEC-003", "MR-NAK-007"], mark, 2, p, 1,
              "WRITE MIDDLE after its MR was deregistered")
    check_err(t, c, ["MR-NAK-009"], "WRITE MIDDLE after its MR was deregistered")


# ---- zero-length requests (MR-MEM-030) ---------------------------------------------------------
@case("TC-MEM-030-a", rules=["MR-MEM-030", "MR-XH-005", "MR-ACK-008", "MR-ACK-001"], category="MEM", timeout=10)
def zero_length_write_any_key(t):
    """EX-MEM-2: zero-length WRITEs with VA 0 / R_Key 0, or past the MR with a bad key, are ACKed, no memory."""
    c = connect(t)
    for i, (va, rkey) in enumerate(((0, 0), (c.va + c.mr_len + 4096, _other_key(c.rkey, True)))):
        p = c.psn
        mark = c.send(req(c, "RDMA_WRITE_ONLY", reth=(va, rkey, 0)))
        f = first_response(c, mark)
        ok = f is not None and f.roce.op == ACKNOWLEDGE and f.roce.ack_kind == "ACK" and f.roce.psn == p
        what = f"zero-length WRITE va={va:#x} rkey={rkey:#x}"
        for r in ("MR-MEM-030", "MR-XH-005", "MR-ACK-001"):
            t.check(r, ok, f"{what}: {describe([f] if f else [])}", frames=[f] if f else [mark + 1],
                    expected=f"ACKNOWLEDGE ACK psn={p:#08x} msn={i + 1}")
        t.check("MR-ACK-008", ok and f.roce.msn == i + 1, f"{what}: msn {f.roce.msn if f else None}",
                frames=[f] if f else [mark + 1], expected=f"msn={i + 1}")
    check_untouched(t, c, ["MR-MEM-030"], 0, c.mr_len, "zero-length WRITEs")
    st = c.query()["state"]
    t.check("MR-MEM-030", st == "RTS", f"QP state after them: {st}")


@case("TC-MEM-030-b", rules=["MR-MEM-030", "MR-XH-005", "MR-ACK-008"], category="MEM", timeout=10)
def zero_length_read(t):
    """A zero-length READ with R_Key 0 is answered by one READ RESPONSE ONLY without payload, AETH ACK, msn 1."""
    c = connect(t)
    p = c.psn
    mark = c.send(read_req(c, 0, 0, rkey=0))
    got = c.quiet(0.3, after=mark)
    ok = (len(got) == 1 and got[0].roce.op == 0x10 and got[0].roce.psn == p and not got[0].roce.payload
          and got[0].roce.ack_kind == "ACK" and got[0].roce.pad == 0)
    exp = f"exactly one RDMA_READ_RESPONSE_ONLY psn={p:#08x}, no payload, AETH ACK msn=1"
    for r in ("MR-MEM-030", "MR-XH-005"):
        t.check(r, ok, f"responses: {describe(got)}", frames=got or [mark + 1], expected=exp)
    t.check("MR-ACK-008", ok and got[0].roce.msn == 1, f"responses: {describe(got)}", frames=got or [mark + 1],
            expected=exp)
    # epsn advanced by one: a WRITE at the next PSN is ACKed
    q = c.psn
    mark = c.send(c.write(b"next", offset=64))
    f = first_response(c, mark)
    t.check("MR-MEM-030", f is not None and f.roce.ack_kind == "ACK" and f.roce.psn == q,
            f"next WRITE: {describe([f] if f else [])}", frames=[f] if f else [mark + 1],
            expected=f"ACKNOWLEDGE ACK psn={q:#08x}")


@case("TC-MEM-030-c", rules=["MR-MEM-030", "MR-RC-017", "MR-NAK-006"], category="MEM", timeout=10)
def zero_length_write_qp_access(t):
    """A zero-length WRITE to a QP without REMOTE_WRITE is still an invalid request (NAK code 1)."""
    c = connect(t, access=["REMOTE_READ", "REMOTE_ATOMIC"])
    p = c.psn
    mark = c.send(req(c, "RDMA_WRITE_ONLY", reth=(0, 0, 0)))
    check_nak(t, c, ["MR-MEM-030", "MR-RC-017", "MR-NAK-006"], mark, 1, p, 0,
              "zero-length WRITE on a QP without REMOTE_WRITE")


@case("TC-MEM-030-d", rules=["MR-MEM-030", "MR-RC-019", "MR-OPC-008"], category="MEM", timeout=10)
def zero_length_write_imm(t):
    """A zero-length WRITE ONLY WITH IMMEDIATE (R_Key 0) consumes a receive WQE: RECV_RDMA_WITH_IMM, byte_len 0."""
    c = connect(t)
    c.post_recv(64, offset=4096, wr_id=0x77)
    p = c.psn
    mark = c.send(req(c, "RDMA_WRITE_ONLY_WITH_IMMEDIATE", reth=(0, 0, 0), imm=0x0A0B0C0D))
    f = first_response(c, mark)
    ok = f is not None and f.roce.ack_kind == "ACK" and f.roce.psn == p and f.roce.msn == 1
    t.check("MR-MEM-030", ok, f"response: {describe([f] if f else [])}", frames=[f] if f else [mark + 1],
            expected=f"ACKNOWLEDGE ACK psn={p:#08x} msn=1")
    wc = poll_one(t, c)
    good = (wc is not None and wc["status"] == "IBV_WC_SUCCESS" and wc["opcode"] == "IBV_WC_RECV_RDMA_WITH_IMM"
            and wc["byte_len"] == 0 and wc.get("imm") == 0x0A0B0C0D and int(wc["wr_id"], 16) == 0x77)
    for r in ("MR-MEM-030", "MR-RC-019", "MR-OPC-008"):
        t.check(r, good, f"completion: {wc_text(wc)}",
                expected="wr_id 0x77 IBV_WC_SUCCESS IBV_WC_RECV_RDMA_WITH_IMM byte_len 0 imm 0x0a0b0c0d",
                observed=[wc_text(wc)])
    check_untouched(t, c, ["MR-MEM-030"], 64, c.mr_len - 64, "zero-length WRITE WITH IMMEDIATE")


@case("TC-MEM-031-a", rules=["MR-MEM-031", "MR-RC-019", "MR-ACK-008"], category="MEM", timeout=10)
def zero_length_send(t):
    """A SEND ONLY without payload is valid: ACK, and the receive WQE completes with byte_len 0."""
    c = connect(t)
    c.post_recv(64, offset=4096, wr_id=0x31)
    p = c.psn
    mark = c.send(req(c, "SEND_ONLY"))
    f = first_response(c, mark)
    ok = f is not None and f.roce.ack_kind == "ACK" and f.roce.psn == p
    t.check("MR-MEM-031", ok, f"response: {describe([f] if f else [])}", frames=[f] if f else [mark + 1],
            expected=f"ACKNOWLEDGE ACK psn={p:#08x} msn=1")
    t.check("MR-ACK-008", ok and f.roce.msn == 1, f"msn {f.roce.msn if f else None}", frames=[f] if f else [mark + 1])
    wc = poll_one(t, c)
    good = (wc is not None and wc["status"] == "IBV_WC_SUCCESS" and wc["opcode"] == "IBV_WC_RECV"
            and wc["byte_len"] == 0 and int(wc["wr_id"], 16) == 0x31 and "imm" not in wc)
    for r in ("MR-MEM-031", "MR-RC-019"):
        t.check(r, good, f"completion: {wc_text(wc)}", expected="wr_id 0x31 IBV_WC_SUCCESS IBV_WC_RECV byte_len 0",
                observed=[wc_text(wc)])
    check_untouched(t, c, ["MR-MEM-031"], 4096, 64, "zero-length SEND")


# ---- invalidation (MR-MEM-040 to MR-MEM-043) -------------------------------------------------------
@case("TC-MEM-040-a", rules=["MR-MEM-040", "MR-RC-019", "MR-MEM-014", "MR-MEM-042", *NAK2, "MR-MEM-027"],
      category="MEM", timeout=10)
def send_with_invalidate(t):
    """SEND WITH INVALIDATE: the completion carries the invalidated key; a WRITE with it then gets NAK code 2.

    The MR stays registered (readable through the agent) and unchanged."""
    c = connect(t)
    h, mr = reg_mr(t, c.pd, 4096, remote_invalidate=True)
    c.post_recv(64, offset=4096, wr_id=0x40)
    p = c.psn
    mark = c.send(req(c, "SEND_ONLY_WITH_INVALIDATE", ieth=mr["rkey"], payload=b"invalidate it"))
    f = first_response(c, mark)
    ok = f is not None and f.roce.ack_kind == "ACK" and f.roce.psn == p and f.roce.msn == 1
    t.check("MR-MEM-040", ok, f"SEND WITH INVALIDATE: {describe([f] if f else [])}", frames=[f] if f else [mark + 1],
            expected=f"ACKNOWLEDGE ACK psn={p:#08x} msn=1")
    wc = poll_one(t, c)
    good = (wc is not None and wc["status"] == "IBV_WC_SUCCESS" and wc["opcode"] == "IBV_WC_RECV"
            and wc["byte_len"] == 13 and wc.get("invalidated_rkey") == mr["rkey"])
    for r in ("MR-MEM-040", "MR-RC-019"):
        t.check(r, good, f"completion: {wc_text(wc)}",
                expected=f"IBV_WC_SUCCESS IBV_WC_RECV byte_len 13 invalidated_rkey {mr['rkey']}",
                observed=[wc_text(wc)])
    t.check("MR-RC-019", c.mem(4096, 13) == b"invalidate it", "SEND data placed in the receive buffer")
    expect_fatal(t, c, _write(c, int(mr["va"], 16), mr["rkey"]), 2, "WRITE with the invalidated key",
                 nak=["MR-MEM-040", "MR-MEM-014", "MR-MEM-042", *NAK2], mem=["MR-MEM-027", "MR-MEM-040"],
                 untouched=[(h, 0, 256)])


@case("TC-MEM-040-b", rules=["MR-MEM-040", "MR-RC-019", "MR-RC-018", "MR-NAK-007"], category="MEM", timeout=10)
def send_last_with_invalidate(t):
    """A 3-packet SEND ending in LAST WITH INVALIDATE: one completion of 600 bytes with the key; the key then fails."""
    c = connect(t, mtu=256)
    h, mr = reg_mr(t, c.pd, 4096, remote_invalidate=True)
    c.post_recv(1024, offset=4096, wr_id=0x43)
    data = bytes((i * 13) & 0xFF for i in range(600))
    frames = [req(c, "SEND_FIRST", payload=data[:256], ackreq=False),
              req(c, "SEND_MIDDLE", payload=data[256:512], ackreq=False),
              req(c, "SEND_LAST_WITH_INVALIDATE", ieth=mr["rkey"], payload=data[512:])]
    p = P.psn_add(c.psn, -1)
    mark = c.send(*frames)
    f = c.expect(1, 1.0, after=mark, match=lambda x: x.roce.op == ACKNOWLEDGE and x.roce.psn == p)
    t.check("MR-MEM-040", bool(f) and f[0].roce.ack_kind == "ACK" and f[0].roce.msn == 1, f"ACK: {describe(f)}",
            frames=f or [mark + 1], expected=f"ACKNOWLEDGE ACK psn={p:#08x} msn=1")
    wc = poll_one(t, c)
    good = (wc is not None and wc["status"] == "IBV_WC_SUCCESS" and wc["opcode"] == "IBV_WC_RECV"
            and wc["byte_len"] == 600 and wc.get("invalidated_rkey") == mr["rkey"] and int(wc["wr_id"], 16) == 0x43)
    for r in ("MR-MEM-040", "MR-RC-019"):
        t.check(r, good, f"completion: {wc_text(wc)}",
                expected=f"wr_id 0x43 IBV_WC_SUCCESS IBV_WC_RECV byte_len 600 invalidated_rkey {mr['rkey']}",
                observed=[wc_text(wc)])
    t.check("MR-RC-018", c.mem(4096, 600) == data, "the three packets in order in the receive buffer")
    expect_fatal(t, c, _write(c, int(mr["va"], 16), mr["rkey"]), 2, "WRITE with the key invalidated by the LAST",
                 nak=["MR-MEM-040", "MR-NAK-007"], msn=1, untouched=[(h, 0, 64)], mem=["MR-MEM-040"])


def _inval_refused(t, c, key: int, what: str, rules, msn: int = 1, primed: bool = True) -> None:
    c.post_recv(64, offset=4096, wr_id=0x41)
    if primed:
        prime(t, c)
    p = c.psn
    mark = c.send(req(c, "SEND_ONLY_WITH_INVALIDATE", ieth=key, payload=b"no"))
    check_nak(t, c, rules, mark, 1, p, msn, what)
    wc = poll_one(t, c)
    good = wc is not None and wc["status"] == "IBV_WC_REM_INV_REQ_ERR" and int(wc["wr_id"], 16) == 0x41
    t.check("MR-MEM-041", good, f"receive completion: {wc_text(wc)}", expected="wr_id 0x41 IBV_WC_REM_INV_REQ_ERR",
            observed=[wc_text(wc)])
    check_err(t, c, ["MR-MEM-041", "MR-NAK-009"], what)


@case("TC-MEM-041-a", rules=["MR-MEM-041", "MR-MEM-042", "MR-NAK-006", "MR-NAK-009"], category="MEM", timeout=10)
def invalidate_plain_mr(t):
    """SEND WITH INVALIDATE naming a plain (not invalidatable) MR: NAK code 1, REM_INV_REQ_ERR, QP in ERR."""
    c = connect(t)
    _inval_refused(t, c, c.rkey, "IETH names a plain MR", ["MR-MEM-041", "MR-MEM-042", "MR-NAK-006"])


@case("TC-MEM-041-b", rules=["MR-MEM-041", "MR-NAK-006", "MR-NAK-009"], category="MEM", timeout=10)
def invalidate_other_pd(t):
    """SEND WITH INVALIDATE naming an invalidatable MR of another PD: NAK code 1, REM_INV_REQ_ERR."""
    c = connect(t)
    pd2 = t.pd()
    h, mr = reg_mr(t, pd2, 4096, remote_invalidate=True)
    _inval_refused(t, c, mr["rkey"], "IETH names an MR of another PD", ["MR-MEM-041", "MR-NAK-006"])


# ---- the receive WQE's local checks (MR-MEM-020, MR-NAK-008) -------------------------------------
def _bad_recv(t, c, h, what: str, extra=()) -> None:
    prime(t, c)
    p = c.psn
    mark = c.send(req(c, "SEND_ONLY", payload=b"x" * 40))
    check_nak(t, c, ["MR-MEM-020", "MR-NAK-008", "MR-NAK-001", *extra], mark, 3, p, 1, what)
    wc = poll_one(t, c)
    # LOC_PROT_ERR recommended, LOC_QP_OP_ERR allowed (MR-MEM-020, Table 7-6; Linux rxe)
    good = (wc is not None and wc["status"] in ("IBV_WC_LOC_PROT_ERR", "IBV_WC_LOC_QP_OP_ERR")
            and int(wc["wr_id"], 16) == 0x20)
    t.check("MR-MEM-020", good, f"receive completion: {wc_text(wc)}",
            expected="wr_id 0x20 IBV_WC_LOC_PROT_ERR (or IBV_WC_LOC_QP_OP_ERR)", observed=[wc_text(wc)])
    if h is not None:
        check_untouched(t, c, ["MR-MEM-020", "MR-MEM-027"], 0, 64, what, mr=h)
    check_err(t, c, ["MR-NAK-009"], what)


@case("TC-MEM-020-a", rules=["MR-MEM-020", "MR-NAK-008", "MR-NAK-001", "MR-MEM-027", "MR-NAK-009"],
      category="MEM", timeout=10)
def recv_wqe_without_local_write(t):
    """A SEND into a receive WQE whose MR lacks LOCAL_WRITE: NAK code 3, LOC_PROT_ERR, nothing placed, QP in ERR."""
    c = connect(t)
    h, mr = reg_mr(t, c.pd, 4096, ["REMOTE_READ"])
    t.agent.call("post_recv", qp=c.qp, wr={"wr_id": "0x20", "sg_list": [{"mr": h, "offset": 0, "len": 64}]})
    _bad_recv(t, c, h, "receive WQE in an MR without LOCAL_WRITE")


@case("TC-MEM-020-b", rules=["MR-MEM-020", "MR-NAK-008", "MR-NAK-001", "MR-MEM-027", "MR-NAK-009"],
      category="MEM", timeout=10)
def recv_wqe_other_pd(t):
    """A SEND into a receive WQE whose MR belongs to another PD: NAK code 3, LOC_PROT_ERR, nothing placed."""
    c = connect(t)
    h, mr = reg_mr(t, t.pd(), 4096)
    t.agent.call("post_recv", qp=c.qp, wr={"wr_id": "0x20", "sg_list": [{"mr": h, "offset": 0, "len": 64}]})
    _bad_recv(t, c, h, "receive WQE in an MR of another PD")


@case("TC-MEM-020-c", rules=["MR-MEM-020", "MR-MEM-033", "MR-NAK-008", "MR-NAK-001", "MR-NAK-009"],
      category="MEM", timeout=10)
def recv_wqe_mr_deregistered(t):
    """A SEND into a receive WQE whose MR was deregistered after the WR was posted: NAK code 3, LOC_PROT_ERR."""
    c = connect(t)
    h, mr = reg_mr(t, c.pd, 4096)
    t.agent.call("post_recv", qp=c.qp, wr={"wr_id": "0x20", "sg_list": [{"mr": h, "offset": 0, "len": 64}]})
    dereg_mr(t, h)
    _bad_recv(t, c, None, "receive WQE in a deregistered MR", extra=["MR-MEM-033"])


@case("TC-MEM-026-a", rules=["MR-MEM-026", "MR-NAK-007", "MR-QP-032", "MR-QP-024", "MR-MEM-027"], category="MEM",
      timeout=10)
def write_imm_bad_key_after_wqe_taken(t):
    """A WRITE WITH IMMEDIATE with a wrong R_Key, its receive WQE already taken: NAK code 2, LOC_ACCESS_ERR."""
    c = connect(t)
    c.post_recv(64, offset=4096, wr_id=0x91)
    c.post_recv(64, offset=8192, wr_id=0x92)
    prime(t, c)
    expect_fatal(t, c, req(c, "RDMA_WRITE_ONLY_WITH_IMMEDIATE", reth=(c.va + 256, _other_key(c.rkey, True), 16),
                           imm=5, payload=PAYLOAD[:16]), 2, "WRITE WITH IMMEDIATE with a wrong R_Key",
                 nak=["MR-MEM-026", "MR-NAK-007"], mem=["MR-MEM-027"], untouched=[(None, 256, 16), (None, 4096, 64)])
    wcs = c.poll(2, 1.0)
    got = [(int(w["wr_id"], 16), w["status"]) for w in wcs]
    want = [(0x91, "IBV_WC_LOC_ACCESS_ERR"), (0x92, "IBV_WC_WR_FLUSH_ERR")]
    t.check("MR-QP-032", got[:1] == want[:1], f"completions: {got}", expected=str(want[:1]),
            observed=[wc_text(w) for w in wcs])
    t.check("MR-QP-024", got == want, f"completions: {got}", expected=str(want), observed=[wc_text(w) for w in wcs])


@case("TC-MEM-033-c", rules=["MR-MEM-033", "MR-SEC-003"], category="MEM", timeout=20)
def read_stream_dereg(t):
    """An MR deregistered during a READ RESPONSE stream from it: no response after dereg_mr returned.

    If the stream was still under way, it must end with NAK code 2 at the READ REQUEST's PSN and nothing
    after it.  An IUT may also hold dereg_mr until the stream has left (MR-MEM-034): then every response
    precedes its return, which the capture time stamps show."""
    import time
    c = connect(t, mtu=256)
    size = 1 << 20                                      # 4096 responses: more overrun the capture on 2 CPUs
    h, mr = reg_mr(t, c.pd, size)
    p = c.psn
    n = size // 256
    mark = c.send(read_req(c, int(mr["va"], 16), size, rkey=mr["rkey"]))
    first = c.expect(1, 2.0, after=mark, match=lambda f: f.roce.op in READ_RESPONSES)
    if not first:
        t.undecided("MR-MEM-033", "the READ was not answered")
    dereg_mr(t, h)
    returned = time.time()                              # capture stamps are on this clock
    c.expect(1, 1.0, after=mark, match=lambda f: f.roce.op == ACKNOWLEDGE)
    seen = t.lt.last_num()
    while t.left() > 3:                                  # until the capture has caught up with the link
        time.sleep(0.3)
        if t.lt.last_num() == seen:
            break
        seen = t.lt.last_num()
    got = t.lt.collect(c.is_mine, 0.01, after=mark)
    reads = [f for f in got if f.roce.op in READ_RESPONSES]
    naks = [f for f in got if f.roce.op == ACKNOWLEDGE]
    f = naks[0] if naks else None
    late = [x for x in reads if x.ts > returned + 0.002]
    after = [x for x in reads if f is not None and x.num > f.num]
    detail = (f"{len(reads)} of {n} READ RESPONSEs, {len(late)} stamped more than 2 ms after dereg_mr returned; "
              f"then {describe(naks[:2])}, {len(after)} responses after it")
    if f is not None:
        ok = (f.roce.ack_kind == "NAK" and f.roce.nak_code == 2 and f.roce.psn == p and f.roce.msn == 1
              and not after and len(naks) == 1)
        t.check("MR-MEM-033", ok, detail, frames=[f] + after[:1], expected=f"ACKNOWLEDGE NAK(0x62) psn={p:#08x} "
                "msn=1 ends the stream; no READ RESPONSE after it")
        t.check("MR-SEC-003", not after, detail, frames=[f] + after[:1], expected="no READ RESPONSE after the NAK")
    else:
        ok = not late and bool(reads)
        for r in ("MR-MEM-033", "MR-SEC-003"):
            t.check(r, ok, detail + (" (dereg_mr returned after the whole stream had left)" if ok else ""),
                    frames=late[:1] or reads[-1:] or [mark + 1],
                    expected="no READ RESPONSE stamped after dereg_mr returned")


@case("TC-MEM-033-d", rules=["MR-MEM-033", "MR-DUP-003", "MR-NAK-007", "MR-NAK-009"], category="MEM", timeout=10)
def duplicate_read_after_dereg(t):
    """A duplicate of a READ whose MR has since been deregistered checks the key again: NAK code 2, no data."""
    c = connect(t)
    h, mr = reg_mr(t, c.pd, 4096)
    p = c.psn
    mark = c.send(read_req(c, int(mr["va"], 16), 100, rkey=mr["rkey"]))
    if not c.expect(1, 1.0, after=mark, match=lambda f: f.roce.op in READ_RESPONSES):
        t.undecided("MR-DUP-003", "the original READ was not answered")
    dereg_mr(t, h)
    mark = c.send(read_req(c, int(mr["va"], 16), 100, rkey=mr["rkey"], psn=p))
    check_nak(t, c, ["MR-MEM-033", "MR-DUP-003", "MR-NAK-007"], mark, 2, p, 1, "duplicate READ after dereg")
    data = [f for f in c.quiet(0.1, after=mark) if f.roce.op in READ_RESPONSES]
    t.check("MR-MEM-033", not data, f"READ RESPONSEs to the duplicate: {describe(data)}", frames=data or [mark + 1],
            expected="none")
    check_err(t, c, ["MR-NAK-009"], "duplicate READ after dereg")


@case("TC-MEM-041-c", rules=["MR-MEM-041", "MR-MEM-040", "MR-NAK-006", "MR-NAK-009"], category="MEM", timeout=10)
def invalidate_twice(t):
    """A second SEND WITH INVALIDATE of a key already invalidated names no valid MR: NAK code 1."""
    c = connect(t)
    h, mr = reg_mr(t, c.pd, 4096, remote_invalidate=True)
    c.post_recv(64, offset=4096, wr_id=0x42)
    p = c.psn
    mark = c.send(req(c, "SEND_ONLY_WITH_INVALIDATE", ieth=mr["rkey"], payload=b"once"))
    f = first_response(c, mark)
    wc = poll_one(t, c)
    ok = (f is not None and f.roce.ack_kind == "ACK" and f.roce.psn == p and wc is not None
          and wc.get("invalidated_rkey") == mr["rkey"])
    t.check("MR-MEM-040", ok, f"first: {describe([f] if f else [])}; {wc_text(wc)}", frames=[f] if f else [mark + 1],
            expected=f"ACKNOWLEDGE ACK psn={p:#08x}, completion with invalidated_rkey {mr['rkey']}")
    _inval_refused(t, c, mr["rkey"], "IETH names a key already invalidated", ["MR-MEM-041", "MR-NAK-006"],
                   msn=1, primed=False)


# ---- registration through the agent (MR-MEM-002, MR-MEM-004, MR-MEM-006, MR-MEM-009, MR-MEM-015) ----------
def _agent_error(t, cmd: str, **args) -> str | None:
    """The 9.4.3 error code of an agent command, or None when it succeeded (then it is undone)."""
    try:
        r = t.agent.call(cmd, **args)
    except AgentError as e:
        return e.code
    if cmd == "reg_mr":
        t._extra.append(("dereg_mr", {"mr": r["mr"]}))
    return None


@case("TC-MEM-004-a", rules=["MR-MEM-004", "MR-MEM-006"], category="MEM", timeout=10)
def registration_refused(t):
    """reg_mr of 0 bytes, and with REMOTE_WRITE or REMOTE_ATOMIC but no LOCAL_WRITE, fails with EINVAL."""
    pd = t.pd()
    code = _agent_error(t, "reg_mr", pd=pd, len=0, access=["LOCAL_WRITE"])
    t.check("MR-MEM-004", code == "EINVAL", f"reg_mr len 0: {code or 'succeeded'}", expected="EINVAL",
            observed=[str(code)])
    for access in (["REMOTE_WRITE"], ["REMOTE_ATOMIC"], ["REMOTE_READ", "REMOTE_WRITE"]):
        code = _agent_error(t, "reg_mr", pd=pd, len=4096, access=access)
        t.check("MR-MEM-006", code == "EINVAL", f"reg_mr access {access}: {code or 'succeeded'}", expected="EINVAL",
                observed=[str(code)])
    code = _agent_error(t, "reg_mr", pd=pd, len=4096, access=["REMOTE_READ"])
    t.check("MR-MEM-006", code is None, f"reg_mr access ['REMOTE_READ'] (no LOCAL_WRITE needed): {code or 'ok'}",
            expected="success", observed=[str(code)])


@case("TC-MEM-002-a", rules=["MR-MEM-002"], category="MEM", timeout=10)
def dealloc_pd_in_use(t):
    """dealloc_pd fails with EBUSY while an MR or a QP belongs to the PD, and succeeds once they are gone."""
    pd = t.agent.call("create_pd")["pd"]
    mr = t.agent.call("reg_mr", pd=pd, len=4096, access=["LOCAL_WRITE"])["mr"]
    code = _agent_error(t, "dealloc_pd", pd=pd)
    t.check("MR-MEM-002", code == "EBUSY", f"dealloc_pd with an MR: {code or 'succeeded'}", expected="EBUSY",
            observed=[str(code)])
    if code is None:
        return
    t.agent.call("dereg_mr", mr=mr)
    cq = t.agent.call("create_cq", cqe=8)["cq"]
    t._extra.append(("destroy_cq", {"cq": cq}))
    qp = t.agent.call("create_qp", pd=pd, send_cq=cq, recv_cq=cq, type="RC",
                      cap={"max_send_wr": 4, "max_recv_wr": 4, "max_send_sge": 1, "max_recv_sge": 1,
                           "max_inline_data": 0})["qp"]
    code = _agent_error(t, "dealloc_pd", pd=pd)
    t.check("MR-MEM-002", code == "EBUSY", f"dealloc_pd with a QP: {code or 'succeeded'}", expected="EBUSY",
            observed=[str(code)])
    t.agent.call("destroy_qp", qp=qp)
    code = _agent_error(t, "dealloc_pd", pd=pd)
    t.check("MR-MEM-002", code is None, f"dealloc_pd once empty: {code or 'ok'}", expected="success",
            observed=[str(code)])


@case("TC-MEM-015-a", rules=["MR-MEM-015", "MR-MEM-009", "MR-MEM-010"], category="MEM", timeout=10)
def keys_unique(t):
    """16 MRs in two PDs: every rkey distinct, none with index 0, and their tags not all the same."""
    pds = [t.pd(), t.pd()]
    keys = [reg_mr(t, pds[i % 2], 64)[1]["rkey"] for i in range(16)]
    t.check("MR-MEM-015", len(set(keys)) == 16, f"rkeys {[hex(k) for k in keys]}", expected="16 distinct rkeys",
            observed=[" ".join(hex(k) for k in keys)])
    t.check("MR-MEM-009", all(k >> 8 for k in keys), "no rkey has index 0", expected="index (key >> 8) never 0",
            observed=[" ".join(hex(k) for k in keys)])
    tags = {k & 0xFF for k in keys}
    t.check("MR-MEM-010", len(tags) > 1, f"{len(tags)} distinct tags among 16 keys (the random source itself is "
            "not observable)", expected="tags that vary", observed=[" ".join(hex(k & 0xFF) for k in keys)])
