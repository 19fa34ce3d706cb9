"""Memory regions seen from outside (08-memory.md), the rules cases/memory.py leaves open: protection
domains and registration (MR-MEM-001, 003, 005, 007), the key format and index reuse (MR-MEM-008,
MR-MEM-011, MR-SEC-001, MR-SEC-002), where the range checks happen and what is placed or read
(MR-MEM-025, 028, 029, 045), zero-length scatter/gather elements (MR-MEM-032), a local MR
deregistered under an outstanding WQE (MR-MEM-035), no memory windows (MR-MEM-036), rereg_mr
(MR-MEM-037) and the index an invalidated MR keeps (MR-MEM-043).

Memory is read back through the agent (mem_read, MR-CONF-022): the MRs are filled with FILL first,
so a byte the IUT was not allowed to touch still holds it.
"""
from __future__ import annotations

from ..agentproto import AgentError
from .. import packets as P
from ..registry import case
from ._common import ACK_WAIT, describe
from ._req import ack as ack_frame
from ._req import connect_req, post, requests, wc_list, wr
from ._resp import (ACKNOWLEDGE, FILL, READ_RESPONSES, check_err, check_nak, check_untouched, connect, dereg_mr,
                    first_response, poll_one, prime, read_req, read_responses, reg_mr, req, wc_text)


def _agent_error(t, cmd: str, **args):
    """(error code or None, result) of an agent command; an MR it registered is deregistered after the case."""
    try:
        r = t.agent.call(cmd, **args)
    except AgentError as e:
        return e.code, None
    if cmd == "reg_mr":
        t._extra.append(("dereg_mr", {"mr": r["mr"]}))
    return None, r


def _pattern(n: int, seed: int = 3) -> bytes:
    return bytes((i * 7 + seed) & 0xFF or 1 for i in range(n))       # never FILL's neighbour 0


# ---- protection domains and registration -----------------------------------------------------------
@case("TC-MEM-001-a", rules=["MR-MEM-001"], category="MEM", timeout=10)
def mr_of_another_pd(t):
    """An MR belongs to the PD it was registered in: its rkey works for a QP of that PD, and a QP of
    another PD gets NAK code 2 with the same rkey, nothing written."""
    a = connect(t)
    b = connect(t)                                    # its own PD
    h, mr = reg_mr(t, b.pd, 4096)
    data = _pattern(32)
    mark = b.send(req(b, "RDMA_WRITE_ONLY", reth=(int(mr["va"], 16), mr["rkey"], 32), payload=data))
    f = first_response(b, mark)
    placed = bytes.fromhex(t.agent.call("mem_read", mr=h, offset=0, len=32)["hex"])
    ok = f is not None and f.roce.ack_kind == "ACK" and placed == data
    t.check("MR-MEM-001", ok, f"WRITE from a QP of the MR's PD: {describe([f] if f else [])}, placed {placed == data}",
            frames=[f] if f else [mark + 1], expected="ACKNOWLEDGE ACK and the data placed")
    p = a.psn
    mark = a.send(req(a, "RDMA_WRITE_ONLY", reth=(int(mr["va"], 16) + 64, mr["rkey"], 32), payload=data))
    check_nak(t, a, ["MR-MEM-001"], mark, 2, p, 0, "WRITE from a QP of another PD with the MR's rkey")
    check_untouched(t, a, ["MR-MEM-001"], 64, 64, "the other PD's WRITE", mr=h)


@case("TC-MEM-003-a", rules=["MR-MEM-003", "MR-MEM-007", "MR-CONF-022"], category="MEM", timeout=12)
def registration_addresses(t):
    """reg_mr returns an lkey, an rkey and the MR's va; remote requests address it by that va: a WRITE
    at va + 100 is what mem_read sees at offset 100, a READ at va + 500 returns what mem_write put at
    offset 500, and both still hold after other MRs came and went (the MR stays at its addresses)."""
    c = connect(t)
    h, mr = reg_mr(t, c.pd, 4096)
    va = int(mr["va"], 16)
    keys = all(isinstance(mr.get(k), int) for k in ("lkey", "rkey")) and mr.get("len") == 4096 and va != 0
    t.check("MR-MEM-003", keys, f"reg_mr result {mr}", expected="lkey, rkey, va and len 4096",
            observed=[str(mr)])
    for rnd in range(2):
        data = _pattern(16, seed=rnd + 5)
        mark = c.send(req(c, "RDMA_WRITE_ONLY", reth=(va + 100, mr["rkey"], 16), payload=data))
        f = first_response(c, mark)
        got = bytes.fromhex(t.agent.call("mem_read", mr=h, offset=100, len=16)["hex"])
        before = bytes.fromhex(t.agent.call("mem_read", mr=h, offset=84, len=16)["hex"])
        ok = f is not None and f.roce.ack_kind == "ACK" and got == data and before == bytes([FILL]) * 16
        rules = ["MR-MEM-003", "MR-CONF-022"] + (["MR-MEM-007"] if rnd else [])
        for r in rules:
            t.check(r, ok, f"round {rnd}: WRITE at va+100 -> {describe([f] if f else [])}; mem_read(100) "
                    f"{'matches' if got == data else got.hex()}", frames=[f] if f else [mark + 1],
                    expected="ACK, the 16 bytes at offset 100, offset 84..99 untouched")
        src = _pattern(64, seed=rnd + 9)
        t.agent.call("mem_write", mr=h, offset=500, hex=src.hex())
        mark = c.send(read_req(c, va + 500, 64, rkey=mr["rkey"]))
        rs = read_responses(c, mark, 1)
        ok = bool(rs) and rs[0].roce.payload == src
        for r in rules:
            t.check(r, ok, f"round {rnd}: READ at va+500 returned {rs[0].roce.payload[:16].hex() if rs else 'nothing'}...",
                    frames=rs or [mark + 1], expected=f"READ RESPONSE with {src[:16].hex()}...")
        if rnd == 0:                      # other registrations come and go in between
            pd = t.pd()
            for _ in range(8):
                hh, _mr = reg_mr(t, pd, 8192)
                dereg_mr(t, hh)


@case("TC-MEM-005-a", rules=["MR-MEM-005"], category="MEM", timeout=10)
def registration_unknown_access_flag(t):
    """reg_mr with an access flag outside LOCAL_WRITE, REMOTE_WRITE, REMOTE_READ, REMOTE_ATOMIC (memory-window
    bind, zero-based, on-demand paging) fails with EINVAL; the four flags together succeed."""
    pd = t.pd()
    for extra in ("MW_BIND", "ZERO_BASED", "ON_DEMAND"):
        code, _ = _agent_error(t, "reg_mr", pd=pd, len=4096, access=["LOCAL_WRITE", extra])
        t.check("MR-MEM-005", code == "EINVAL", f"reg_mr access [LOCAL_WRITE, {extra}]: {code or 'succeeded'}",
                expected="EINVAL", observed=[str(code)])
    code, _ = _agent_error(t, "reg_mr", pd=pd, len=4096,
                           access=["LOCAL_WRITE", "REMOTE_WRITE", "REMOTE_READ", "REMOTE_ATOMIC"])
    t.check("MR-MEM-005", code is None, f"reg_mr with the four flags: {code or 'ok'}", expected="success",
            observed=[str(code)])


# ---- keys (MR-MEM-008, MR-MEM-011, MR-SEC-001, MR-SEC-002) -------------------------------------------
@case("TC-MEM-011-a", rules=["MR-MEM-008", "MR-MEM-011", "MR-SEC-001", "MR-SEC-002"], category="MEM", timeout=25)
def stale_key_after_reregistration(t):
    """Keys are index << 8 | tag: live MRs have distinct indices; an MR registered, deregistered and followed
    by up to 600 registrations (each deregistered again, the last kept) never gives its index back with the
    same tag, the tags vary, and a WRITE with the old rkey gets NAK code 2 and touches no MR."""
    c = connect(t)
    live = [reg_mr(t, c.pd, 64)[1] for _ in range(8)]
    idx = [m["rkey"] >> 8 for m in live]
    t.check("MR-MEM-008", len(set(idx)) == 8 and all(idx) and all(m["rkey"] & ~0xFFFFFFFF == 0 for m in live),
            f"8 live MRs, rkey indices {[hex(i) for i in idx]}", expected="8 distinct non-zero 24-bit indices",
            observed=[" ".join(hex(m["rkey"]) for m in live)])
    h0, mr0 = reg_mr(t, c.pd, 4096)
    k0 = mr0["rkey"]
    dereg_mr(t, h0)
    tags, reused, h, mr = [k0 & 0xFF], None, None, None
    limit = min(600, int(t.hello.get("limits", {}).get("max_mr", 600)) + 8)
    for n in range(limit):
        if t.left() < 8:
            break
        h, mr = reg_mr(t, c.pd, 4096)
        tags.append(mr["rkey"] & 0xFF)
        if mr["rkey"] >> 8 == k0 >> 8:
            reused = n + 1
            break
        if n < limit - 1:
            dereg_mr(t, h)
    if reused is not None:
        ok = mr["rkey"] != k0
        detail = f"index {k0 >> 8:#x} reused after {reused} registrations with tag {mr['rkey'] & 0xFF:#04x} (was {k0 & 0xFF:#04x})"
    else:
        ok = True
        detail = f"index {k0 >> 8:#x} not reused within {len(tags) - 1} registrations (quarantine)"
    for r in ("MR-MEM-011", "MR-SEC-002"):
        t.check(r, ok, detail, expected="a reused index gets another tag", observed=[detail])
    distinct = len(set(tags))
    steps = {(b - a) & 0xFF for a, b in zip(tags, tags[1:])}
    varied = distinct >= min(16, len(tags) // 2) and len(steps) > 1
    t.check("MR-SEC-001", varied, f"{distinct} distinct tags among {len(tags)} registrations, {len(steps)} distinct "
            "steps between consecutive tags (the generator itself is not observable)",
            expected="tags that vary and do not follow a fixed step", observed=[" ".join(f"{x:02x}" for x in tags[:64])])
    p = c.psn
    mark = c.send(req(c, "RDMA_WRITE_ONLY", reth=(int(mr0["va"], 16), k0, 16), payload=_pattern(16)))
    for r in ("MR-MEM-011", "MR-SEC-002", "MR-MEM-008"):
        check_nak(t, c, [r], mark, 2, p, 0, "WRITE with the rkey of a deregistered MR")
    check_untouched(t, c, ["MR-MEM-011", "MR-SEC-002"], 0, 4096, "the newest MR after the stale-key WRITE", mr=h)
    check_untouched(t, c, ["MR-MEM-011"], 0, 4096, "the QP's own MR after the stale-key WRITE")


# ---- range checks, what is placed and what is read ----------------------------------------------------
@case("TC-MEM-025-a", rules=["MR-MEM-025"], category="MEM", timeout=12)
def range_checked_at_first_packet(t):
    """A WRITE FIRST whose own 256 bytes lie inside the MR but whose DMA Length runs past its end is NAKed
    (code 2) at the FIRST, with nothing placed; a READ whose range runs past the end gets no response at all."""
    c = connect(t, mtu=256)
    prime(t, c)
    off = c.mr_len - 300
    p = c.psn
    mark = c.send(req(c, "RDMA_WRITE_FIRST", reth=(c.va + off, c.rkey, 600), payload=_pattern(256), ackreq=False))
    check_nak(t, c, ["MR-MEM-025"], mark, 2, p, 1, "WRITE FIRST of 600 bytes 300 bytes before the MR's end")
    check_untouched(t, c, ["MR-MEM-025"], off, 300, "WRITE FIRST running past the MR")
    c = connect(t, mtu=256)
    prime(t, c)
    p = c.psn
    mark = c.send(read_req(c, c.va + c.mr_len - 512, 1024))
    check_nak(t, c, ["MR-MEM-025"], mark, 2, p, 1, "READ of 1024 bytes 512 bytes before the MR's end")
    data = [f for f in c.quiet(0.1, after=mark) if f.roce.op in READ_RESPONSES]
    t.check("MR-MEM-025", not data, f"READ RESPONSEs: {describe(data)}", frames=data or [mark + 1],
            expected="no READ RESPONSE (the whole range is checked at the request)")


@case("TC-MEM-028-a", rules=["MR-MEM-028", "MR-RC-011"], category="MEM", timeout=12)
def write_payload_beyond_dma_length(t):
    """Payload beyond a WRITE's DMA Length is an invalid request and nothing is written past [va, va + len):
    a WRITE ONLY of DMA Length 16 carrying 32 bytes, and a FIRST + LAST of DMA Length 300 whose LAST carries
    100 bytes where 44 remain."""
    c = connect(t)
    prime(t, c)
    p = c.psn
    mark = c.send(req(c, "RDMA_WRITE_ONLY", reth=(c.va + 1024, c.rkey, 16), payload=_pattern(32)))
    check_nak(t, c, ["MR-MEM-028", "MR-RC-011"], mark, 1, p, 1, "WRITE ONLY, DMA Length 16, 32 bytes of payload")
    check_untouched(t, c, ["MR-MEM-028"], 1024 + 16, 64, "bytes past DMA Length")
    c = connect(t, mtu=256)
    prime(t, c)
    data = _pattern(356)
    c.send(req(c, "RDMA_WRITE_FIRST", reth=(c.va + 4096, c.rkey, 300), payload=data[:256], ackreq=False))
    p = c.psn
    mark = c.send(req(c, "RDMA_WRITE_LAST", payload=data[256:]))
    f = first_response(c, mark)
    ok = f is not None and f.roce.ack_kind == "NAK" and f.roce.nak_code == 1 and f.roce.psn == p
    for r in ("MR-MEM-028", "MR-RC-011"):
        t.check(r, ok, f"LAST with 100 bytes where 44 remain: {describe([f] if f else [])}",
                frames=[f] if f else [mark + 1], expected=f"ACKNOWLEDGE NAK(0x61) psn={p:#08x}")
    check_untouched(t, c, ["MR-MEM-028"], 4096 + 300, 128, "bytes past va + DMA Length")


@case("TC-MEM-029-a", rules=["MR-MEM-029", "MR-DUP-003"], category="MEM", timeout=12)
def read_returns_exactly_the_range(t):
    """A READ of 300 bytes at va + 1000 (PMTU 256) returns exactly bytes 1000..1299 of the MR in two
    responses, no byte more; its duplicate returns the same range again."""
    c = connect(t, mtu=256)
    src = _pattern(4096, seed=11)
    c.mem_write(0, src)
    p = c.psn
    mark = c.send(read_req(c, c.va + 1000, 300))
    rs = read_responses(c, mark, 2)
    got = b"".join(f.roce.payload for f in rs)
    ok = len(rs) == 2 and got == src[1000:1300] and [f.roce.psn for f in rs] == [p, P.psn_add(p, 1)]
    t.check("MR-MEM-029", ok, f"{len(rs)} responses with {len(got)} bytes"
            + ("" if got == src[1000:1300] else " that are not bytes 1000..1299"), frames=rs or [mark + 1],
            expected="READ RESPONSE FIRST (256 B) and LAST (44 B) with bytes 1000..1299")
    extra = [f for f in c.quiet(0.1, after=rs[-1].num if rs else mark) if f.roce.op in READ_RESPONSES]
    t.check("MR-MEM-029", not extra, f"further responses: {describe(extra)}", frames=extra or [mark + 1],
            expected="nothing after the LAST")
    mark = c.send(read_req(c, c.va + 1000, 300, psn=p))
    rs = read_responses(c, mark, 2)
    got = b"".join(f.roce.payload for f in rs)
    for r in ("MR-MEM-029", "MR-DUP-003"):
        t.check(r, len(rs) == 2 and got == src[1000:1300], f"duplicate READ: {len(rs)} responses, {len(got)} bytes",
                frames=rs or [mark + 1], expected="the same two responses with bytes 1000..1299")


@case("TC-MEM-045-a", rules=["MR-MEM-045"], category="MEM", timeout=12)
def local_placement_within_sges(t):
    """What the IUT places locally stays inside the scatter/gather element: a 40-byte SEND into a 64-byte
    receive element, a 100-byte READ response, an 8-byte ATOMIC result (when ATOMICS is claimed): every
    byte around them still holds FILL."""
    c = connect_req(t, fill=FILL, timeout=16)
    c.post_recv(64, offset=4096, wr_id=0x45)
    data = _pattern(40)
    mark = c.send(req(c, "SEND_ONLY", payload=data))
    first_response(c, mark)
    wc = poll_one(t, c)
    got = c.mem(4032, 192)
    ok = (wc is not None and wc["status"] == "IBV_WC_SUCCESS" and got[64:104] == data
          and got[:64] + got[104:] == bytes([FILL]) * 152)
    t.check("MR-MEM-045", ok, f"SEND of 40 bytes into [4096, 4160): {wc_text(wc)}; bytes around it untouched: "
            f"{got[:64] + got[104:] == bytes([FILL]) * 152}", expected="data at 4096..4135, FILL elsewhere",
            observed=[got.hex()])
    rdata = _pattern(100, seed=21)
    mark = post(c, wr("RDMA_READ", 100, wr_id=0x46, offset=1000, c=c))
    rq = requests(c, mark, 1, ACK_WAIT)
    if not rq:
        t.undecided("MR-MEM-045", "the IUT sent no READ REQUEST")
        return
    c.send(c.frame("RDMA_READ_RESPONSE_ONLY", psn=rq[0].roce.psn, payload=rdata, aeth=(0x1F, 1)))
    wcs = c.poll(1, 1.0)
    got = c.mem(936, 228)
    ok = (wcs and wcs[0]["status"] == "IBV_WC_SUCCESS" and got[64:164] == rdata
          and got[:64] + got[164:] == bytes([FILL]) * 128)
    t.check("MR-MEM-045", bool(ok), f"READ of 100 bytes into [1000, 1100): {wc_list(wcs)}",
            expected="data at 1000..1099, FILL around it", observed=[got.hex()])
    if "ATOMICS" in t.claim.caps:
        mark = post(c, wr("ATOMIC_FETCH_AND_ADD", 8, wr_id=0x47, offset=2000, c=c, swap_add=1))
        rq = requests(c, mark, 1, ACK_WAIT)
        if rq:
            c.send(c.frame("ATOMIC_ACKNOWLEDGE", psn=rq[0].roce.psn, aeth=(0x1F, 2), atomic_ack=0x1122334455667788))
            wcs = c.poll(1, 1.0)
            got = c.mem(1936, 136)
            v = 0x1122334455667788
            ok = (wcs and wcs[0]["status"] == "IBV_WC_SUCCESS" and got[64:72] in (v.to_bytes(8, "big"),
                                                                                v.to_bytes(8, "little"))
                  and got[:64] + got[72:] == bytes([FILL]) * 128)
            t.check("MR-MEM-045", bool(ok), f"FETCH_ADD result into [2000, 2008): {wc_list(wcs)}",
                    expected="the original value at 2000..2007, FILL around it",
                    observed=[got.hex()])
        else:
            t.undecided("MR-MEM-045", "the IUT sent no ATOMIC request")


# ---- scatter/gather elements of length 0 (MR-MEM-032) ------------------------------------------------
@case("TC-MEM-032-a", rules=["MR-MEM-032"], category="MEM", timeout=12)
def zero_length_sge_not_checked(t):
    """A scatter/gather element of length 0 in an MR of another PD is skipped, not checked: a receive WQE made of
    it takes a zero-length SEND with success, and a SEND whose only element it is goes out empty and completes."""
    c = connect_req(t, fill=FILL, timeout=16)
    other, mr = reg_mr(t, t.pd(), 4096)
    t.agent.call("post_recv", qp=c.qp, wr={"wr_id": "0x32", "sg_list": [{"mr": other, "offset": 0, "len": 0}]})
    p = c.psn
    mark = c.send(req(c, "SEND_ONLY"))
    f = first_response(c, mark)
    wc = poll_one(t, c)
    ok = (f is not None and f.roce.ack_kind == "ACK" and f.roce.psn == p and wc is not None
          and wc["status"] == "IBV_WC_SUCCESS" and wc["byte_len"] == 0)
    t.check("MR-MEM-032", ok, f"zero-length SEND into a 0-byte element of another PD's MR: "
            f"{describe([f] if f else [])}; {wc_text(wc)}", frames=[f] if f else [mark + 1],
            expected="ACKNOWLEDGE ACK, receive completion IBV_WC_SUCCESS byte_len 0")
    mark = post(c, {"wr_id": "0x33", "opcode": "SEND", "sg_list": [{"mr": other, "offset": 0, "len": 0}],
                    "flags": ["SIGNALED"]})
    rq = requests(c, mark, 1, ACK_WAIT)
    sent = bool(rq) and rq[0].roce.name.startswith("SEND_ONLY") and rq[0].roce.payload == b""
    t.check("MR-MEM-032", sent, f"SEND from a 0-byte element of another PD's MR: {describe(rq)}",
            frames=rq or [mark + 1], expected="SEND ONLY without payload")
    if rq:
        c.send(ack_frame(c, rq[0].roce.psn, 1))
    wcs = c.poll(1, 1.0)
    t.check("MR-MEM-032", bool(wcs) and wcs[0]["status"] == "IBV_WC_SUCCESS", f"its completion: {wc_list(wcs)}",
            expected="0x33:SUCCESS", observed=[wc_list(wcs)])
    check_untouched(t, c, ["MR-MEM-032"], 0, 64, "the other PD's MR", mr=other)


# ---- a local MR deregistered under an outstanding WQE (MR-MEM-035) --------------------------------------
@case("TC-MEM-035-a", rules=["MR-MEM-035"], category="MEM", timeout=12)
def read_into_deregistered_mr(t):
    """The local MR of an outstanding READ is deregistered before the response comes: the READ completes with
    IBV_WC_LOC_PROT_ERR and the QP moves to ERR."""
    c = connect_req(t, timeout=18)
    h, mr = reg_mr(t, c.pd, 4096)
    w = wr("RDMA_READ", 64, wr_id=0x35, mr=h, offset=0, c=c)
    mark = post(c, w)
    rq = requests(c, mark, 1, ACK_WAIT)
    if not rq:
        t.undecided("MR-MEM-035", "the IUT sent no READ REQUEST")
        return
    code, _ = _agent_error(t, "dereg_mr", mr=h)
    if code is not None:
        t.undecided("MR-MEM-035", f"dereg_mr of the READ's destination MR failed: {code}")
        return
    t._extra[:] = [x for x in t._extra if x != ("dereg_mr", {"mr": h})]
    mark = c.send(c.frame("RDMA_READ_RESPONSE_ONLY", psn=rq[0].roce.psn, payload=_pattern(64), aeth=(0x1F, 1)))
    wcs = c.poll(1, 2.0)
    ok = bool(wcs) and wcs[0]["status"] == "IBV_WC_LOC_PROT_ERR" and int(wcs[0]["wr_id"], 16) == 0x35
    t.check("MR-MEM-035", ok, f"READ response into the deregistered MR: completion {wc_list(wcs)}",
            expected="0x35:LOC_PROT_ERR", observed=[wc_text(wcs[0] if wcs else None)])
    st = c.query()["state"]
    t.check("MR-MEM-035", st == "ERR", f"QP state {st}", expected="QP in ERR", observed=[f"state {st}"])


# ---- no memory windows, rereg_mr (MR-MEM-036, MR-MEM-037) ------------------------------------------------
@case("TC-MEM-036-a", rules=["MR-MEM-036"], category="MEM", timeout=10)
def no_memory_windows(t):
    """alloc_mw fails, a BIND_MW work request is refused at post time with nothing sent and no completion."""
    c = connect_req(t)
    code, res = _agent_error(t, "alloc_mw", pd=c.pd)
    if code == "ENOCMD":
        t.cannot_drive("MR-MEM-036", "the agent offers no alloc_mw command: ibv_alloc_mw is not reachable")
    else:
        t.check("MR-MEM-036", code is not None, f"alloc_mw: {code or f'succeeded {res}'}",
                expected="an error (ENOTSUP)", observed=[str(code or res)])
    mark = t.lt.last_num()
    code, _ = _agent_error(t, "post_send", qp=c.qp, wr={"wr_id": "0x36", "opcode": "BIND_MW", "sg_list": [],
                                                         "flags": ["SIGNALED"]})
    t.check("MR-MEM-036", code is not None, f"post_send BIND_MW: {code or 'accepted'}", expected="an error at post time",
            observed=[str(code)])
    sent = c.quiet(0.2, after=mark)
    wcs = c.poll(1, 0.05)
    ok = not sent and not wcs
    t.check("MR-MEM-036", ok, f"after it: frames {describe(sent)}, completions {wc_list(wcs)}", frames=sent,
            expected="nothing sent, no completion (never IBV_WC_MW_BIND_ERR)")


@case("TC-MEM-037-a", rules=["MR-MEM-037"], category="MEM", timeout=10)
def rereg_mr_new_tag(t):
    """rereg_mr either fails with ENOTSUP (unsupported) or, changing the access flags, gives the MR a new
    rkey with which it works while the old rkey gets NAK code 2."""
    c = connect(t)
    h, mr = reg_mr(t, c.pd, 4096)
    code, res = _agent_error(t, "rereg_mr", mr=h, access=["LOCAL_WRITE", "REMOTE_WRITE"])
    if code == "ENOCMD":
        t.cannot_drive("MR-MEM-037", "the agent offers no rereg_mr command")
        return
    if code is not None:
        t.check("MR-MEM-037", code == "ENOTSUP", f"rereg_mr: {code}", expected="ENOTSUP (EOPNOTSUPP) or success",
                observed=[code])
        return
    t.check("MR-MEM-037", res["rkey"] != mr["rkey"], f"rkey {mr['rkey']:#x} -> {res['rkey']:#x}",
            expected="a new rkey", observed=[str(res)])
    p = c.psn
    mark = c.send(req(c, "RDMA_WRITE_ONLY", reth=(int(res["va"], 16), mr["rkey"], 16), payload=_pattern(16)))
    check_nak(t, c, ["MR-MEM-037"], mark, 2, p, 0, "WRITE with the rkey from before rereg_mr")
    check_untouched(t, c, ["MR-MEM-037"], 0, 64, "after the old-key WRITE", mr=h)


# ---- invalidation keeps the index (MR-MEM-043) -----------------------------------------------------------
@case("TC-MEM-043-a", rules=["MR-MEM-043"], category="MEM", timeout=12)
def invalidated_mr_keeps_index(t):
    """After SEND WITH INVALIDATE, the MR stays registered (readable through the agent) and holds its index:
    32 new MRs get other indices, and a WRITE with the invalidated key gets NAK code 2 and changes nothing."""
    c = connect(t)
    h, mr = reg_mr(t, c.pd, 4096, remote_invalidate=True)
    c.post_recv(64, offset=4096, wr_id=0x43)
    p = c.psn
    mark = c.send(req(c, "SEND_ONLY_WITH_INVALIDATE", ieth=mr["rkey"], payload=b"invalidate"))
    f = first_response(c, mark)
    wc = poll_one(t, c)
    if f is None or f.roce.ack_kind != "ACK" or wc is None or wc.get("invalidated_rkey") != mr["rkey"]:
        t.undecided("MR-MEM-043", f"the invalidation did not succeed: {describe([f] if f else [])}, {wc_text(wc)}")
        return
    pd = t.pd()
    idx = []
    for _ in range(32):
        hh, m = reg_mr(t, pd, 64)
        idx.append(m["rkey"] >> 8)
    ok = (mr["rkey"] >> 8) not in idx
    t.check("MR-MEM-043", ok, f"index {mr['rkey'] >> 8:#x} of the invalidated MR; new indices "
            f"{sorted(set(hex(i) for i in idx))[:8]}...", expected="no new MR at the invalidated MR's index",
            observed=[" ".join(hex(i) for i in idx)])
    p = c.psn
    mark = c.send(req(c, "RDMA_WRITE_ONLY", reth=(int(mr["va"], 16), mr["rkey"], 16), payload=_pattern(16)))
    check_nak(t, c, ["MR-MEM-043"], mark, 2, p, 1, "WRITE with the invalidated key")
    check_untouched(t, c, ["MR-MEM-043"], 0, 256, "the invalidated MR", mr=h)
