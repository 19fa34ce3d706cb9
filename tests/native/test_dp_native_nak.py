"""Error NAK-type SACKs of a native responder in the compiled data plane, on the wire: crafted native
request frames from a scripted requester (a raw socket in the other namespace: nothing there answers but
the script) reach a native responder QP on a real interface (XDP program, AF_XDP socket), and every
NATIVE_SACK it sends back is read off the wire and decoded.

* MR-SACK-031: an error found on a request whose PSN is not yet the ePSN is remembered, not NAKed; the
  SACKs sent meanwhile never report that PSN as received; the NAK-type SACK (MR-SACK-032: BTH.PSN the
  NAK'd PSN, no bitmap) leaves once every earlier PSN came, exactly once; of two such errors the one
  with the lower PSN is NAKed.
* MR-OOO-011: an ImmDt that differs from an earlier packet of the same WRITE_IMM message is an invalid
  request (check 5), NAKed per MR-SACK-031; the receive WQE does not complete successfully.  A message
  whose packets agree completes with its immediate, whatever order they came in.
"""
from __future__ import annotations

import pytest

from metaroce_xdp.verbs_types import QPState, RecvWR, WCOpcode, WCStatus
from metaroce_xdp.wire import NETH, RETH, RSNETH, ImmDt, Op
from wire_players import ScriptedQP

pytestmark = [pytest.mark.netns, pytest.mark.fabric(prefix="mrnak")]

PEER_QPN = 0x778            # the scripted requester's QP: exists nowhere
MTU = 1024
EPSN = 100                  # the responder's initial ePSN
FIRST, LAST = 0x80, 0x40
SYN_INV_REQ, SYN_REM_ACCESS = 0x61, 0x62


class Responder(ScriptedQP):
    """A fresh native responder QP (ePSN 100) connected to the scripted requester."""
    settle = 0.05

    def __init__(self, wire) -> None:
        topo, pair, self.sock, ctx = wire
        super().__init__(ctx, topo, pair, PEER_QPN, rq_psn=EPSN, sq_psn=0x100, rd_atomic=16, mtu=MTU,
                         profile="native")
        self.drain()

    def rounds(self) -> list:
        """Rounds until nothing more comes (bounded); the SACKs sent meanwhile."""
        out = super().rounds()
        assert all(p.bth.opcode == Op.NATIVE_SACK for p in out), [hex(p.bth.opcode) for p in out]
        return out

    def exchange(self, frames) -> list:
        self.send(frames)
        return self.rounds()



def naks(sacks) -> list[tuple[int, int, int]]:
    """(syndrome, BTH.PSN, bitmap_words) of each NAK-type SACK."""
    return [(p.aeth.syndrome, p.bth.psn, p.sacketh.bitmap_words) for p in sacks if p.aeth.syndrome & 0x60]


def reported(sacks) -> set[int]:
    """Every PSN an ACK-type SACK of `sacks` reports received: up to its cumulative PSN, and its bitmap."""
    out = set()
    for p in sacks:
        if not p.aeth.syndrome & 0x60:
            out |= set(range(EPSN, p.bth.psn + 1)) | set(p.sack_received_psns())
    return out


def neth(msn, off, mlen):
    fl = (FIRST if off == 0 else 0) | (LAST if off + min(MTU, mlen - off) == mlen else 0)
    return NETH(flags=fl, msn=msn, offset=off, msg_len=mlen, tsval=1)


def write(r, psn, msn, n, off=0, rkey=None):
    """A one-packet NATIVE_WRITE of n bytes to the responder's MR at off (rkey: a wrong one, if given)."""
    return (Op.NATIVE_WRITE, psn, bytes([psn & 0xFF]) * n,
            dict(reth=RETH(va=r.mr.addr + off, rkey=r.mr.rkey if rkey is None else rkey, dma_len=n),
                 neth=neth(msn, 0, n)))


def bad_read(r, psn, msn):
    """A NATIVE_READ_REQ whose NETH.msg_len contradicts its RETH.DMA Length: an invalid request (check 4)."""
    return (Op.NATIVE_READ_REQ, psn, b"", dict(reth=RETH(va=r.mr.addr, rkey=r.mr.rkey, dma_len=64),
                                                 neth=NETH(flags=FIRST | LAST, msn=msn, offset=0, msg_len=32,
                                                           tsval=1)))


def write_imm(r, psn0, msn, rsn, mlen, i, imm, off=0):
    """Packet i of a NATIVE_WRITE_IMM message of mlen bytes whose first PSN is psn0, with ImmDt imm."""
    o = i * MTU
    n = min(MTU, mlen - o)
    return (Op.NATIVE_WRITE_IMM, psn0 + i, bytes([(psn0 + i) & 0xFF]) * n,
            dict(reth=RETH(va=r.mr.addr + off, rkey=r.mr.rkey, dma_len=mlen), neth=neth(msn, o, mlen),
                 rsneth=RSNETH(rsn=rsn), immdt=ImmDt(imm=imm)))


@pytest.fixture
def responder(wire):
    r = Responder(wire)
    try:
        yield r
    finally:
        r.close()


def test_error_naked_only_once_its_psn_is_the_epsn_mr_sack_031(responder):
    """MR-SACK-031, MR-SACK-032: a WRITE outside the MR's key (remote access error) at PSN ePSN + 2 and an
    invalid READ at ePSN + 5 arrive while ePSN and ePSN + 1 are missing: no NAK, and no SACK reports either
    PSN as received (the valid WRITE at ePSN + 3 is reported); the NAK-type SACK -- syndrome 0x62, BTH.PSN
    ePSN + 2, no bitmap -- leaves once ePSN + 1 and then ePSN came, exactly once: the lower of the two
    errors is the one NAKed.  The QP is in ERR then, having placed what came before the error."""
    r = responder
    p = EPSN + 2
    got = r.exchange([bad_read(r, EPSN + 5, 5), write(r, p, 2, 64, rkey=r.mr.rkey ^ 0x5A5A00),
                      write(r, EPSN + 3, 3, 64, off=3000)])
    assert len(got) >= 1 and naks(got) == [], naks(got)          # the erroneous packets trigger none
    assert p not in reported(got) and EPSN + 5 not in reported(got) and EPSN + 3 in reported(got)
    assert r.qp.query_state() == QPState.RTS
    more = r.exchange([write(r, EPSN + 1, 1, 64, off=1000)])
    assert len(more) >= 1 and naks(more) == [] and p not in reported(more)
    assert EPSN + 1 in reported(more) and EPSN + 3 in reported(more)
    last = r.exchange([write(r, EPSN, 0, 64, off=0)])
    assert naks(last) == [(SYN_REM_ACCESS, p, 0)], [(p.aeth.syndrome, p.bth.psn) for p in last]
    assert p not in reported(last)
    assert r.qp.query_state() == QPState.ERR
    assert r.exchange([write(r, p + 1, 4, 8, off=5000)]) == []                 # nothing more: the QP failed
    assert (r.buf[0:64] == EPSN & 0xFF).all() and (r.buf[1000:1064] == (EPSN + 1) & 0xFF).all()
    c = r.qp.native_counters()
    assert c["c_err_held"] >= 2 and c["c_sack_tx"] == len(got) + len(more) + len(last), c


def test_immdt_that_changes_within_a_message_is_an_invalid_request_mr_ooo_011(responder):
    """MR-OOO-011: a three-packet NATIVE_WRITE_IMM whose packets agree on ImmDt completes (out of order:
    last, first, middle) with that immediate (IBV_WC_WITH_IMM, MR-OOO-015); the next one, whose middle
    packet carries another ImmDt than its last (seen first), fails check 5: invalid request, NAKed per
    MR-SACK-031 once that middle PSN is the ePSN (its first packet came after it), its receive WQE never
    completes successfully (it is flushed)."""
    r = responder
    r.qp.post_recv([RecvWR(wr_id=700), RecvWR(wr_id=701)])
    good = r.exchange([write_imm(r, EPSN, 0, 0, 3000, i, 0xA1B2C3D4) for i in (2, 0, 1)])
    assert naks(good) == []
    wc = r.cq.poll(4)
    assert [(w.wr_id, w.status, w.opcode, w.byte_len, w.imm_data) for w in wc] == \
        [(700, WCStatus.SUCCESS, WCOpcode.RECV_RDMA_WITH_IMM, 3000, 0xA1B2C3D4)]
    p0 = EPSN + 3
    held = r.exchange([write_imm(r, p0, 1, 1, 3000, 2, 0x11111111, off=8192),
                       write_imm(r, p0, 1, 1, 3000, 1, 0x22222222, off=8192)])
    assert naks(held) == [] and p0 + 1 not in reported(held) and p0 + 2 in reported(held)
    assert r.qp.query_state() == QPState.RTS and r.cq.poll(4) == []
    last = r.exchange([write_imm(r, p0, 1, 1, 3000, 0, 0x11111111, off=8192)])
    assert naks(last) == [(SYN_INV_REQ, p0 + 1, 0)], naks(last)
    assert r.qp.query_state() == QPState.ERR
    wc = r.cq.poll(4)
    assert [(w.wr_id, w.status) for w in wc] == [(701, WCStatus.WR_FLUSH_ERR)]
    assert r.qp.native_counters()["c_imm_inv"] == 1
