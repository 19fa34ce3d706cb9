"""A hostile peer against the memory regions of the compiled data plane (issue 19, findings 1-3).

Crafted request frames from a scripted requester (a raw socket in the other namespace: nothing there
answers but the script) reach a responder QP on a real interface (XDP program, AF_XDP socket).

* MR-SEC-003, MR-MEM-011 (use after deregistration): work that outlives one packet -- a multi-packet
  WRITE in progress, a posted receive WQE, a queued READ response stream -- keeps an MR reference (the
  registration's generation and key), never the bare MR row.  The MR is deregistered and its row
  registered again over other memory (forced: the allocator would keep the row in quarantine); the
  rest of the message must not reach the old buffer (kept alive by the test, so the old code's write
  lands there instead of crashing) nor the new one, and the QP gets a remote access error / the RECV a
  local protection error.
* MR-MEM-024, STYLE 14 (bounds without overflow): a WRITE, READ or ATOMIC whose VA is just below 2^63
  (so VA + length wraps in int64) or at/above 2^63 (a negative int64) against a real rkey gets NAK code
  2 and the endpoint lives.  The endpoint runs in a subprocess: the old code died of SIGSEGV.  The
  daemon's check of a client's SGE (dp/serve.local_mr) refuses such an address too.
* MR-MEM-010 to MR-MEM-012 (keys): 20 random bits in a key, rows drawn at random, a freed row kept in
  quarantine, a re-registration gets another key and another row.
"""
from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from metaroce_xdp import jitwarm
from metaroce_xdp.verbs_types import SGE, QPAttr, QPState, RecvWR, SendWR, WCStatus, WROpcode
from metaroce_xdp.wire import NETH, RETH, Op
from metaroce_xdp.wire.headers import AtomicETH

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/: wire_players
from wire_players import FULL, ScriptedQP, scripted_wire  # noqa: E402

pytestmark = [pytest.mark.netns, pytest.mark.fabric(prefix="mrhmr")]

PEER_QPN = 0x779            # the scripted requester's QPs: exist nowhere
MTU = 1024
EPSN = 100
NAK_REM_ACCESS = 0x62       # AETH: NAK, code 2 (MR-NAK-007)


class Responder(ScriptedQP):
    """A fresh compat responder QP (ePSN 100) of the compiled plane, connected to the scripted requester."""

    def __init__(self, wire, budget: int | None = None, **rtr) -> None:
        topo, pair, self.sock, ctx = wire
        super().__init__(ctx, topo, pair, PEER_QPN, rq_psn=EPSN, sq_psn=0x100, rd_atomic=16, mtu=MTU, **rtr)
        if budget is not None:
            self.budget(budget)
        self.drain()

    def exchange(self, frames) -> list:
        self.send(frames)
        return self.rounds()


def naks(pkts) -> list[tuple[int, int]]:
    """(syndrome, PSN) of each NAK: an ACKNOWLEDGE or a NAK-type NATIVE_SACK."""
    return [(p.aeth.syndrome, p.bth.psn) for p in pkts
            if p.bth.opcode in (Op.ACKNOWLEDGE, Op.NATIVE_SACK) and p.aeth.syndrome & 0x60 == 0x60]


def read_responses(pkts) -> list:
    return [p for p in pkts if Op.RDMA_READ_RESPONSE_FIRST <= p.bth.opcode <= Op.RDMA_READ_RESPONSE_ONLY]


def reg_on_row(ctx, pd, buf, row: int):
    """Register buf on MR row `row`, as a busy allocator eventually does once the row has left quarantine
    (the old allocator: round-robin from _mr_next; the new: a random row out of quarantine, _mr_row)."""
    if hasattr(ctx, "_mr_free"):
        ctx._mr_row = lambda: (ctx._mr_free.remove(row), row)[1]
        try:
            mr = pd.reg_mr(buf, FULL)
        finally:
            del ctx._mr_row
    else:
        ctx._mr_next = row
        mr = pd.reg_mr(buf, FULL)
    assert mr.index == row
    return mr


# ------------------------------------------------------------------------------------- finding 1
def test_write_continuation_after_reregistration(wire):
    """MR-SEC-003: WRITE FIRST lands in MR1; MR1 is deregistered and its row registered again (MR2, other
    memory); WRITE MIDDLE and LAST get NAK code 2 and place nothing, in MR1's memory or MR2's.  (Before:
    the continuation checked only the row's valid bit, which MR2 had set, and wrote on at MR1's address.)"""
    r = Responder(wire)
    try:
        buf1 = np.zeros(8192, np.uint8)              # kept alive: the old code's bytes land here
        buf2 = np.zeros(8192, np.uint8)
        mr1 = r.pd.reg_mr(buf1, FULL)
        first = (Op.RDMA_WRITE_FIRST, EPSN, b"\xaa" * MTU,
                 dict(reth=RETH(va=mr1.addr, rkey=mr1.rkey, dma_len=3 * MTU)))
        r.exchange([first])
        assert (buf1[:MTU] == 0xAA).all(), "WRITE FIRST was not placed"
        row = mr1.index
        mr1.dereg()
        mr2 = reg_on_row(r.ctx, r.pd, buf2, row)
        assert mr2.rkey != mr1.rkey
        out = r.exchange([(Op.RDMA_WRITE_MIDDLE, EPSN + 1, b"\xbb" * MTU, {}),
                          (Op.RDMA_WRITE_LAST, EPSN + 2, b"\xcc" * MTU, {})])
        assert not buf1[MTU:].any(), f"{int(np.count_nonzero(buf1[MTU:]))} bytes written after dereg_mr"
        assert not buf2.any(), "the continuation reached the MR now on the row"
        assert (NAK_REM_ACCESS, EPSN + 1) in naks(out), naks(out)
        assert r.qp.query_state() == QPState.ERR
        mr2.dereg()
    finally:
        r.close()


def test_send_into_receive_wqe_after_reregistration(wire):
    """MR-SEC-003, MR-MEM-035: a receive WQE posted on MR1; MR1 deregistered, its row registered again
    (MR2); a SEND places nothing and the RECV completes with a local protection error.  (Before: the
    WQE's row was valid again, and the SEND landed in MR1's memory.)"""
    r = Responder(wire)
    try:
        buf1 = np.zeros(8192, np.uint8)
        buf2 = np.zeros(8192, np.uint8)
        mr1 = r.pd.reg_mr(buf1, FULL)
        r.qp.post_recv(RecvWR(7, [SGE(mr1.addr, 4096, mr1.lkey)]))
        row = mr1.index
        mr1.dereg()
        mr2 = reg_on_row(r.ctx, r.pd, buf2, row)
        out = r.exchange([(Op.SEND_ONLY, EPSN, b"\xdd" * 512, {})])
        assert not buf1.any(), f"{int(np.count_nonzero(buf1))} bytes of the SEND placed after dereg_mr"
        assert not buf2.any()
        wcs = r.cq.poll()
        assert [(w.wr_id, w.status) for w in wcs][:1] == [(7, WCStatus.LOC_PROT_ERR)], wcs
        assert naks(out) and naks(out)[0][1] == EPSN, naks(out)
        mr2.dereg()
    finally:
        r.close()


def test_read_response_source_after_reregistration(wire):
    """MR-SEC-003: a 16-packet READ of MR1 is answered two packets a round; MR1 is deregistered, its row
    registered again (MR2) and MR1's old memory overwritten; no further READ RESPONSE leaves (none
    carries the new bytes), the READ's PSN gets NAK code 2.  (Before: the stream went on reading MR1's
    address.)"""
    r = Responder(wire, budget=2)
    try:
        n = 16 * MTU
        buf1 = np.full(n, 0x11, np.uint8)
        buf2 = np.zeros(n, np.uint8)
        mr1 = r.pd.reg_mr(buf1, FULL)
        r.send([(Op.RDMA_READ_REQUEST, EPSN, b"", dict(reth=RETH(va=mr1.addr, rkey=mr1.rkey, dma_len=n)))])
        before = read_responses(r.rounds(1))
        assert 0 < len(before) < 16, f"{len(before)} responses in the first round: the budget did not hold"
        row = mr1.index
        mr1.dereg()
        mr2 = reg_on_row(r.ctx, r.pd, buf2, row)
        buf1[:] = 0xEE                               # what a later reader of the old memory would send
        out = r.rounds()
        after = read_responses(out)
        assert not any(b"\xee" in p.payload for p in after), "a READ RESPONSE read MR1 after dereg_mr"
        assert not after, [hex(p.bth.psn) for p in after]
        assert (NAK_REM_ACCESS, EPSN) in naks(out), naks(out)
        mr2.dereg()
    finally:
        r.close()


def test_native_read_job_source_after_reregistration(wire):
    """MR-SEC-003 on the native profile: a 64-packet NATIVE_READ_REQ of MR1 is answered over several rounds;
    MR1 is deregistered, its row registered again (MR2) and MR1's old memory overwritten; no further
    NATIVE_READ_RESP leaves and the READ's PSN gets a NAK-type SACK with code 2.  (Before: the job checked
    only the row's valid bit and went on reading MR1's address.)"""
    r = Responder(wire, budget=2, profile="native")
    try:
        n = 64 * MTU
        buf1 = np.full(n, 0x11, np.uint8)
        buf2 = np.zeros(n, np.uint8)
        mr1 = r.pd.reg_mr(buf1, FULL)
        r.send([(Op.NATIVE_READ_REQ, EPSN, b"", dict(reth=RETH(va=mr1.addr, rkey=mr1.rkey, dma_len=n),
                                                      neth=NETH(flags=0x80 | 0x40, msn=0, offset=0, msg_len=n,
                                                                tsval=1)))])
        before = [p for p in r.rounds(1) if p.bth.opcode == Op.NATIVE_READ_RESP]
        assert 0 < len(before) < 64, f"{len(before)} responses in the first round"
        row = mr1.index
        mr1.dereg()
        mr2 = reg_on_row(r.ctx, r.pd, buf2, row)
        buf1[:] = 0xEE
        out = r.rounds()
        after = [p for p in out if p.bth.opcode == Op.NATIVE_READ_RESP]
        assert not any(b"\xee" in p.payload for p in after), "a NATIVE_READ_RESP read MR1 after dereg_mr"
        assert not after, [hex(p.bth.psn) for p in after]
        errs = [(p.aeth.syndrome, p.bth.psn) for p in out if p.bth.opcode == Op.NATIVE_SACK and p.aeth.syndrome & 0x60]
        assert (NAK_REM_ACCESS, EPSN) in errs, errs
        mr2.dereg()
    finally:
        r.close()


# ------------------------------------------------------------------------------------- finding 3
def test_keys_random_rows_quarantined(wire):
    """MR-MEM-010 to MR-MEM-012, MR-SEC-002: 64 registrations get rows that are not sequential and keys
    whose index bits above the row vary; a row freed is not handed out again within 600 registrations;
    the registration after a deregistration gets another key and another row."""
    ctx = wire[3]
    pd = ctx.alloc_pd()
    bufs = [np.zeros(64, np.uint8) for _ in range(64)]
    mrs = [pd.reg_mr(b, FULL) for b in bufs]
    try:
        rows = [m.index for m in mrs]
        steps = sum(1 for a, b in zip(rows, rows[1:]) if b == a + 1)
        assert steps < 8, f"rows {rows[:16]}...: {steps} of 63 steps are +1 (sequential)"
        assert len({m.rkey >> 20 for m in mrs}) > 16, "the key's index bits above the row do not vary"
        assert len({m.rkey for m in mrs}) == 64
        old = mrs.pop()
        old_row, old_key = old.index, old.rkey
        old.dereg()
        b = np.zeros(64, np.uint8)
        again = pd.reg_mr(b, FULL)
        assert again.index != old_row and again.rkey != old_key
        again.dereg()
        seen = set()
        for _ in range(600):
            m = pd.reg_mr(b, FULL)
            seen.add(m.index)
            m.dereg()
        assert old_row not in seen, f"row {old_row} handed out again within 600 registrations"
    finally:
        for m in mrs:
            m.dereg()


# ------------------------------------------------------------------------------------- finding 2
def test_local_sge_address_wrapping_refused():
    """STYLE 14, MR-MEM-020: the daemon's check of a client's SGE (dp/serve.local_mr) refuses an address
    just below 2^63 whose end wraps in int64, and one at or above 2^63.  (Before: addr + length wrapped
    negative, the check passed and the loop would copy at that address.)"""
    from metaroce_xdp.dp import layout as L
    from metaroce_xdp.dp import serve
    MRT = np.zeros((L.MAX_MRS, L.NM), np.int64)
    base, key = 0x7F00_0000_0000, (5 << 8) | 0x33
    MRT[5, [L.M_ADDR, L.M_LENGTH, L.M_KEY, L.M_PD, L.M_ACCESS, L.M_VALID]] = (base, 4096, key, 1, 0xF, 1)
    if hasattr(L, "M_REF"):
        MRT[5, L.M_REF] = (1 << 32) | key
    i64 = np.int64
    with jitwarm.unsealed():                    # a plane started earlier in the process sealed the compiler
        assert serve.local_mr(MRT, i64(1), i64(base + 8), i64(32), i64(key), i64(0)) > 0      # inside: taken
        for addr in (2**63 - 16, -16, -(2**63)):
            assert serve.local_mr(MRT, i64(1), i64(addr), i64(32), i64(key), i64(0)) < 0, hex(addr & (2**64 - 1))


def test_post_send_sge_address_wrapping_local_prot(wire):
    """MR-RC-022: an SGE at an address just below 2^63 (its end past 2^63) on a real lkey is accepted and
    fails LOC_PROT_ERR, nothing sent."""
    r = Responder(wire)
    try:
        r.qp.post_send(SendWR(1, WROpcode.RDMA_WRITE, [SGE(2**63 - 16, 32, r.mr.lkey)], remote_addr=0x1000,
                              rkey=0x1234))
        wcs = []
        for _ in range(200):
            r.round()
            wcs += r.cq.poll()
            if wcs:
                break
            time.sleep(0.002)
        assert [(w.wr_id, w.status) for w in wcs] == [(1, WCStatus.LOC_PROT_ERR)], wcs
        assert not [p for p in r.drain() if p.bth.opcode != Op.ACKNOWLEDGE]
    finally:
        r.close()


@pytest.fixture(scope="module")
def daemon_a():
    """metaroced on host A of tests/daemon/test_daemon.py's Env (B not started: nothing answers)."""
    from test_daemon import Env
    with Env.running("A") as e:
        yield e


def test_daemon_refuses_a_client_sge_whose_end_wraps(daemon_a):
    """STYLE 14, MR-MEM-020: a client that bypasses its library writes a WRITE whose SGE, on its own real
    lkey, starts at 2^63 - 16: the daemon's loop (dp/serve.local_mr) fails it LOC_PROT_ERR on that QP and
    lives.  (Before: addr + length wrapped, the entry was taken and the loop read the payload at that
    address: metaroced died of SIGSEGV, for every tenant.)"""
    from metaroce_xdp.daemon import client as C
    from metaroce_xdp import shm
    from metaroce_xdp.verbs_types import Access, QPCap
    env = daemon_a
    c = C.connect(env.sock("A"), env.pair.a.ifname)
    try:
        pd = c.alloc_pd()
        mr = pd.reg_mr(c.alloc_buf(1 << 16), Access.LOCAL_WRITE)
        cq = c.create_cq(16)
        qp = c.create_qp(pd, cq, cq, QPCap(max_send_wr=16, max_recv_wr=16))
        qp.modify(QPAttr(qp_state=QPState.INIT))
        qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=0x777, rq_psn=0, path_mtu=1024, dgid=env.pair.b.ipv4))
        qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0))
        entry = (21, int(WROpcode.RDMA_WRITE), 2, 2**63 - 16, 32, mr.lkey, 0x1000, 0x1234, 0)
        ring = qp._sq                                # what a client bypassing the library writes
        ring[int(qp.W[shm.QH_SQ_TAIL]) & (len(ring) - 1), :len(entry)] = entry
        qp.W[shm.QH_SQ_TAIL] += 1
        c._doorbell(qp.qp_num)
        try:
            w = cq.wait(1, 10)[0]
        except (TimeoutError, OSError) as e:
            pytest.fail(f"no completion ({e}); metaroced's exit status: {env.daemons['A'].p.poll()}")
        assert (w.wr_id, w.status.name) == (21, "LOC_PROT_ERR"), w
        assert env.daemons["A"].p.poll() is None, "metaroced died"
        assert env.status("A")["daemon"]["clients"] >= 1
    finally:
        c.close()
    assert env.daemons["A"].p.poll() is None, "metaroced died"


# the wrapping requests, each to its own responder QP (a remote access error moves the QP to ERR); the
# first of each kind is the one whose VA + length wraps in int64
WRAPS = {"write": [("WRITE VA 2^63-16", Op.RDMA_WRITE_ONLY, 2**63 - 16, 32),
                   ("WRITE VA 2^64-16", Op.RDMA_WRITE_ONLY, 2**64 - 16, 32)],
         "read": [("READ VA 2^63-16", Op.RDMA_READ_REQUEST, 2**63 - 16, 32),
                  ("READ VA 2^64-16", Op.RDMA_READ_REQUEST, 2**64 - 16, 32)],
         "atomic": [("CMP_SWAP VA 2^63-8", Op.COMPARE_SWAP, 2**63 - 8, 8),
                    ("FETCH_ADD VA 2^63-8", Op.FETCH_ADD, 2**63 - 8, 8),
                    ("FETCH_ADD VA 2^64-8", Op.FETCH_ADD, 2**64 - 8, 8)],
         # the native profile (MR-SEC-004: every NATIVE_WRITE packet is checked)
         "native-write": [("NATIVE_WRITE VA 2^63-16", Op.NATIVE_WRITE, 2**63 - 16, 32),
                          ("NATIVE_WRITE VA 2^64-16", Op.NATIVE_WRITE, 2**64 - 16, 32)],
         "native-read": [("NATIVE_READ_REQ VA 2^63-16", Op.NATIVE_READ_REQ, 2**63 - 16, 32),
                         ("NATIVE_READ_REQ VA 2^64-16", Op.NATIVE_READ_REQ, 2**64 - 16, 32)]}


def _request(op, va, n, rkey):
    if op in (Op.NATIVE_WRITE, Op.NATIVE_READ_REQ):
        neth = NETH(flags=0x80 | 0x40, msn=0, offset=0, msg_len=n, tsval=1)
        return op, EPSN, b"\x5a" * n if op == Op.NATIVE_WRITE else b"", dict(reth=RETH(va=va, rkey=rkey, dma_len=n),
                                                                             neth=neth)
    if op == Op.RDMA_WRITE_ONLY:
        return op, EPSN, b"\x5a" * n, dict(reth=RETH(va=va, rkey=rkey, dma_len=n))
    if op == Op.RDMA_READ_REQUEST:
        return op, EPSN, b"", dict(reth=RETH(va=va, rkey=rkey, dma_len=n))
    return op, EPSN, b"", dict(atomiceth=AtomicETH(va=va, rkey=rkey, swap_add=1, compare=0))


def _readline(p, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if p.poll() is not None:
            return None
        if select.select([p.stdout], [], [], 0.5)[0]:
            return p.stdout.readline()
    return None


@pytest.mark.parametrize("kind", list(WRAPS))
def test_wrapping_va_remote_access_error_endpoint_lives(kind):
    """MR-MEM-024, MR-SEC-004, STYLE 14: each request of WRAPS[kind], with the endpoint's real rkey, gets NAK
    code 2 at its PSN, and the endpoint (a subprocess running the compiled plane) is alive after all of
    them.  (Before: VA + length wrapped in int64, the bounds check passed, and the first request killed the
    process with SIGSEGV: a WRITE in its copy, a READ in its response's copy, an atomic in its update.)"""
    wraps = WRAPS[kind]
    with scripted_wire("mrhov") as (topo, pair, sock):
        peers = [PEER_QPN + 1 + i for i in range(len(wraps))]
        profile = "native" if kind.startswith("native") else "compat"
        p = topo.popen(topo[0], [sys.executable, os.path.abspath(__file__), "endpoint", pair.b.ipv4,
                                 ",".join(map(str, peers)), profile],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = _readline(p, 900)                 # a cold JIT cache compiles the plane first
            assert line, f"the endpoint did not start: rc {p.poll()}, {p.stderr.read()[-2000:] if p.poll() is not None else ''}"
            info = json.loads(line)
            results = {}
            for (name, op, va, n), qpn in zip(wraps, info["qpns"]):
                s = ScriptedQP.__new__(ScriptedQP)
                s.pair, s.sock, s.settle = pair, sock, 0.05
                s.qp = SimpleNamespace(qp_num=qpn)
                s.src = socket.inet_aton(pair.a.ipv4)
                s.drain()
                s.send([_request(op, va, n, info["rkey"])])
                got = []
                end = time.monotonic() + 3
                while time.monotonic() < end and p.poll() is None:
                    got += [q for q in s.drain() if q.bth.dest_qp in peers]
                    if naks(got):
                        break
                    time.sleep(0.01)
                results[name] = (naks(got), p.poll())
                if p.poll() is not None:
                    break
            try:
                p.stdin.write("quit\n")
                p.stdin.flush()
            except BrokenPipeError:                  # it died
                pass
            out, err = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()
        assert p.returncode == 0 and "alive" in out, f"endpoint rc {p.returncode} after {results}: {err[-2000:]}"
        for name, *_ in wraps:
            assert results.get(name, ([], None))[0] == [(NAK_REM_ACCESS, EPSN)], (name, results.get(name))


def _endpoint(peer_ip: str, peers: list[int], profile: str) -> None:
    """The subprocess of test_wrapping_va_remote_access_error_endpoint_lives, in namespace 0: a compiled
    plane on mr0, one responder QP per peer QPN, its progress run until stdin says quit."""
    from metaroce_xdp.dp import Context
    ctx = Context.open("mr0")
    pd = ctx.alloc_pd()
    buf = np.zeros(1 << 16, np.uint8)
    mr = pd.reg_mr(buf, FULL)
    cq = ctx.create_cq(256)
    qpns = []
    for pq in peers:
        qp = ctx.create_qp(pd, cq, cq)
        qp.modify(QPAttr(qp_state=QPState.INIT, qp_access_flags=FULL))
        qp.modify(QPAttr(qp_state=QPState.RTR, dest_qp_num=pq, rq_psn=EPSN, path_mtu=MTU, dgid=peer_ip,
                         max_dest_rd_atomic=16, profile=profile))
        qp.modify(QPAttr(qp_state=QPState.RTS, sq_psn=0x100, timeout=0, retry_cnt=7, rnr_retry=7, max_rd_atomic=16))
        qpns.append(qp.qp_num)
    print(json.dumps({"qpns": qpns, "rkey": mr.rkey, "addr": mr.addr}), flush=True)
    end = time.monotonic() + 300
    while time.monotonic() < end:
        ctx.progress()
        if select.select([sys.stdin], [], [], 0.0005)[0]:
            break
    print("alive", flush=True)
    ctx.close()


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "endpoint":
    _endpoint(sys.argv[2], [int(x) for x in sys.argv[3].split(",")], sys.argv[4])
