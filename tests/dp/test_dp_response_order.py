"""The compat responder's responses on the wire, on the compiled data plane: crafted request frames from a
scripted requester (a raw socket in the other namespace: nothing there answers but the script) reach a
responder QP on a real interface (XDP program, AF_XDP socket), and what the responder sends back is read
off the wire in the order it left: opcode, PSN, AETH syndrome and the ACKs' MSN, each as the rules say.

* MR-RC-025 (with MR-ACK-001, MR-ACK-003): responses of a QP leave in PSN order.  The coalesced ACK of
  a WRITE after a READ leaves after that READ's responses -- also when the responses are queued over
  several rounds (a small budget) and when the WRITE arrives while the READ's responses are still
  going out; the ACK of a WRITE before a READ leaves before it, with the WRITE's PSN.
* MR-RC-025 too: a PSN sequence error NAK, an RNR NAK and an ATOMIC ACKNOWLEDGE caused by requests
  after a READ leave after its responses.
* MR-DUP-002: a duplicate WRITE that arrives when the last requests executed were READs is re-ACKed
  with r - 1, r the PSN of the first of those READs (what rxe sends; 09-conformance.md 9.7.1,
  TC-DUP-009-a), and with epsn - 1 once a WRITE was executed after them.
"""
from __future__ import annotations

import contextlib

import pytest

from metaroce_xdp.wire import RETH, Op
from metaroce_xdp.wire.headers import AtomicETH
from wire_players import ScriptedQP

pytestmark = [pytest.mark.netns, pytest.mark.fabric(prefix="mrord")]

PEER_QPN = 0x777            # the scripted requester's QP: exists nowhere
MTU = 1024


@pytest.fixture(scope="module")
def engine(wire):
    """The compiled plane's Context on mr0 (no progress thread: the test runs the rounds)."""
    return wire[3]


class Responder(ScriptedQP):
    """A fresh responder QP (ePSN 100) of `engine`, connected to the scripted requester."""

    def __init__(self, wire, engine, budget: int = 256) -> None:
        topo, pair, self.sock, _ = wire
        super().__init__(engine, topo, pair, PEER_QPN, rq_psn=100, sq_psn=0x100, rd_atomic=16, mtu=MTU,
                         min_rnr_timer=4)
        self.budget(budget)
        self.drain()


@contextlib.contextmanager
def responder(wire, engine, budget=256):
    r = Responder(wire, engine, budget)
    try:
        yield r
    finally:
        r.close()


def seen(pkts) -> list[tuple]:
    """(kind, PSN, syndrome, MSN) of each response: RR for a READ RESPONSE (syndrome and MSN of an
    AETH-less MIDDLE: None), ACK for an ACKNOWLEDGE."""
    out = []
    for p in pkts:
        aeth = p.ext.get("aeth")
        op = p.bth.opcode
        kind = "ACK" if op == Op.ACKNOWLEDGE else "ATOMIC_ACK" if op == Op.ATOMIC_ACKNOWLEDGE \
            else "RR" if Op.RDMA_READ_RESPONSE_FIRST <= op <= Op.RDMA_READ_RESPONSE_ONLY else int(op)
        out.append((kind, p.bth.psn, aeth.syndrome if aeth else None, aeth.msn if aeth else None))
    return out


def order(pkts) -> list[tuple[str, int]]:
    return [(k, psn) for k, psn, _, _ in seen(pkts)]


def read(r, psn, n, off=0):
    return (Op.RDMA_READ_REQUEST, psn, b"", dict(reth=RETH(va=r.mr.addr + off, rkey=r.mr.rkey, dma_len=n)))


def write(r, psn, data, off=32768):
    return (Op.RDMA_WRITE_ONLY, psn, data, dict(reth=RETH(va=r.mr.addr + off, rkey=r.mr.rkey, dma_len=len(data))))


@pytest.mark.parametrize("budget", [256, 2])
def test_ack_after_a_read_waits_for_its_responses(wire, engine, budget):
    """MR-RC-025, MR-ACK-003: READ 100 (3 responses, PSNs 100-102), WRITE 103, READ 104, WRITE 105 arriving
    together: the coalesced ACKs leave after the responses of the READs before them and before those of
    the READs after them; budget 2: the responses leave over several rounds."""
    with responder(wire, engine, budget) as r:
        r.buf[:3000] = 0x42
        r.send([read(r, 100, 3000), write(r, 103, b"w" * 8), read(r, 104, 8), write(r, 105, b"v" * 8, 33000)])
        out = r.rounds()
        assert order(out) == [("RR", 100), ("RR", 101), ("RR", 102), ("ACK", 103), ("RR", 104), ("ACK", 105)]
        acks = [s for s in seen(out) if s[0] == "ACK"]
        assert [(s[2], s[3]) for s in acks] == [(0x1F, 2), (0x1F, 4)]       # the MSN when each was decided
        # an AETH (ACK syndrome) on READ RESPONSE FIRST, LAST and ONLY, none on MIDDLE
        assert [s[:3] for s in seen(out)] == [("RR", 100, 0x1F), ("RR", 101, None), ("RR", 102, 0x1F),
                                              ("ACK", 103, 0x1F), ("RR", 104, 0x1F), ("ACK", 105, 0x1F)]
        assert bytes(r.buf[32768:32776]) == b"w" * 8 and bytes(r.buf[33000:33008]) == b"v" * 8


def test_ack_of_a_write_arriving_while_read_responses_go_out(wire, engine):
    """MR-RC-025: READ 100 of 6 responses with a budget of 2 a round; after the first round (2 responses
    out, 4 queued) WRITE 106 arrives with AckReq: its ACK leaves after the 4 queued responses."""
    with responder(wire, engine, 2) as r:
        r.send([read(r, 100, 6 * MTU)])
        first = []
        for _ in range(200):                                    # the round that takes the READ
            first = r.rounds(1)
            if first:
                break
        assert order(first) == [("RR", 100), ("RR", 101)]
        r.send([write(r, 106, b"x" * 16)])
        out = first + r.rounds()
        assert order(out) == [("RR", 100 + k) for k in range(6)] + [("ACK", 106)]


def test_ack_of_a_write_before_a_read_has_the_writes_psn(wire, engine):
    """MR-RC-025, MR-ACK-001: WRITE 100 then READ 101 (2 responses) together: the WRITE's ACK names PSN 100
    (not the READ's last PSN) and leaves before the READ's responses."""
    with responder(wire, engine) as r:
        r.send([write(r, 100, b"y" * 8), read(r, 101, 2 * MTU)])
        out = r.rounds()
        assert order(out) == [("ACK", 100), ("RR", 101), ("RR", 102)]
        assert seen(out)[0][3] == 1


def test_duplicate_write_after_reads_is_acked_before_them(wire, engine):
    """MR-DUP-002 (r - 1), MR-DUP-006: WRITE 100, READ 101, READ 102; a duplicate of the WRITE is re-ACKed
    with PSN 100, the one before the first READ -- not 102 (epsn - 1), which would tell a requester whose
    READ responses were lost that the READs are done; epsn, msn untouched.  Once WRITE 103 was executed
    after the READs, a duplicate is re-ACKed with epsn - 1 (103).  A duplicate WRITE at a READ's PSN too."""
    with responder(wire, engine) as r:
        steps = []
        r.send([write(r, 100, b"a" * 8)])
        steps.append(r.rounds())
        r.send([read(r, 101, 8)])
        steps.append(r.rounds())
        r.send([read(r, 102, 8)])
        steps.append(r.rounds())
        r.send([write(r, 100, b"b" * 8)])                       # duplicate
        steps.append(r.rounds())
        r.send([write(r, 101, b"c" * 8)])                       # duplicate at the first READ's PSN
        steps.append(r.rounds())
        r.send([write(r, 103, b"d" * 8, 40000)])
        steps.append(r.rounds())
        r.send([write(r, 100, b"e" * 8)])                       # duplicate, after a WRITE
        steps.append(r.rounds())
        got = [seen(s) for s in steps]
        assert got == [[("ACK", 100, 0x1F, 1)],
                       [("RR", 101, 0x1F, 2)],
                       [("RR", 102, 0x1F, 3)],
                       [("ACK", 100, 0x1F, 3)],
                       [("ACK", 100, 0x1F, 3)],
                       [("ACK", 103, 0x1F, 4)],
                       [("ACK", 103, 0x1F, 4)]]
        assert bytes(r.buf[32768:32776]) == b"a" * 8                # duplicates never placed


@pytest.mark.parametrize("case", ["seq", "rnr", "atomic"])
def test_naks_and_atomic_acks_do_not_overtake_read_responses(wire, engine, case):
    """MR-RC-025: READ 100 (2 responses) with a budget of 1 a round, then -- in the same burst -- a SEND at
    110 (out of sequence: a PSN sequence error NAK at ePSN 102), a SEND at 102 with no receive WQE (an RNR
    NAK, MR-RNR-001) or a FETCH_ADD at 102 (its ATOMIC ACKNOWLEDGE): that response leaves after the READ's
    responses."""
    with responder(wire, engine, 1) as r:
        later = {"seq": (Op.SEND_ONLY, 110, b"s", {}), "rnr": (Op.SEND_ONLY, 102, b"s", {}),
                 "atomic": (Op.FETCH_ADD, 102, b"", dict(atomiceth=AtomicETH(va=r.mr.addr + 4096, rkey=r.mr.rkey,
                                                                              swap_add=1, compare=0)))}[case]
        r.send([read(r, 100, 2 * MTU), later])
        out = r.rounds()
        last = {"seq": ("ACK", 102, 0x60), "rnr": ("ACK", 102, 0x24), "atomic": ("ATOMIC_ACK", 102, 0x1F)}[case]
        assert [s[:3] for s in seen(out)] == [("RR", 100, 0x1F), ("RR", 101, 0x1F), last]
