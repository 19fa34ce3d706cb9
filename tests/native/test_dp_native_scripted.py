"""A native QP of the compiled data plane (real XDP program and AF_XDP socket on veth) against a scripted peer
(wire_players.scripted_wire: a raw socket in the other namespace, nothing there answers but the script):

* MR-SACK-034: NAK-type SACKs with the invalid request, remote access and remote operational error syndromes
  sent to a native requester: the work requests before the NAK'd PSN complete, the one holding it fails
  with the syndrome's status, the later ones are flushed, the QP is in ERR.  A NAK-type SACK whose PSN is
  outside [snd_una, snd_nxt - 1] is discarded and counted (MR-SACK-019): nothing fails.
* MR-SACK-012: a native responder never reports missing a PSN it once reported received, and never drops
  what that packet placed, across gaps, duplicates carrying other bytes and the gaps' filling.
"""
from __future__ import annotations

import time

import pytest

from metaroce_xdp.verbs_types import SGE, QPState, SendWR, WCStatus, WROpcode
from metaroce_xdp.wire import AETH, NETH, RETH, SACKETH, Op, encode
from wire_players import ScriptedQP

pytestmark = [pytest.mark.netns, pytest.mark.fabric(prefix="mrscr")]

PEER_QPN = 0x779            # the scripted peer's QP: exists nowhere
MTU = 1024
SQ_PSN = 0x200              # the requester's first PSN
EPSN = 100                  # the responder's initial ePSN
FLAG_N = 0x40


class Native(ScriptedQP):
    """A fresh native QP connected to the scripted peer; timers far above the script's pace (rto_initial
    200 ms), so the requester's retransmissions do not run out of retries meanwhile."""
    settle = 0.05

    def __init__(self, wire) -> None:
        topo, pair, self.sock, ctx = wire
        super().__init__(ctx, topo, pair, PEER_QPN, rq_psn=EPSN, sq_psn=SQ_PSN, rd_atomic=16, mtu=MTU,
                         profile="native", native_params={"rto_initial": 200, "rto_min": 100_000})
        self.drain()

    def rounds(self, until=None, n=400) -> list:
        """Progress rounds (n at most) until nothing more comes for 25 rounds (or until(frames) holds); the
        frames."""
        return super().rounds(until=until, limit=n)

    def sack(self, syndrome, psn, nw=0, words=()) -> None:
        """A NATIVE_SACK from the scripted peer: syndrome (0x1F ACK-type, 0x61..0x63 error NAKs), BTH.PSN psn."""
        a, b = self.pair.a, self.pair.b
        self.sock.send(encode(Op.NATIVE_SACK, src_mac=b.mac, dst_mac=a.mac, src_ip=b.ipv4, dst_ip=a.ipv4,
                              sport=0xC321, dest_qp=self.qp.qp_num, psn=psn,
                              headers=dict(aeth=AETH(syndrome=syndrome, msn=0),
                                           sacketh=SACKETH(tsecr=0, bitmap_words=nw, flags=FLAG_N)),
                              sack_bitmap=list(words)))
        time.sleep(self.settle)



@pytest.fixture
def qp(wire):
    q = Native(wire)
    try:
        yield q
    finally:
        q.close()


def _post_four(q) -> None:
    """WR 1: PSN 0x200; WR 2: 3 packets, 0x201..0x203; WR 3: 0x204; WR 4: 0x205 (to an address the script
    never checks); returns once every PSN was seen on the wire."""
    def w(i, n):
        return SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE, sg_list=[SGE(q.mr.addr, n, q.mr.lkey)],
                      remote_addr=0x10000, rkey=0x1234)
    q.qp.post_send([w(1, 100), w(2, 3000), w(3, 10), w(4, 10)])
    seen = set()
    fr = q.rounds(until=lambda f: seen.update(p.bth.psn for p in f if p.bth.opcode == Op.NATIVE_WRITE) or
                  len(seen) >= 6)
    assert {p.bth.psn for p in fr if p.bth.opcode == Op.NATIVE_WRITE} == set(range(SQ_PSN, SQ_PSN + 6))


@pytest.mark.parametrize("syn,status", [(0x61, WCStatus.REM_INV_REQ_ERR), (0x62, WCStatus.REM_ACCESS_ERR),
                                        (0x63, WCStatus.REM_OP_ERR)], ids=["inv-req", "rem-access", "rem-op"])
def test_error_nak_sack_fails_the_wr_holding_its_psn_mr_sack_034(qp, syn, status):
    """MR-SACK-034: a NAK-type SACK with syndrome 0x61 / 0x62 / 0x63 at PSN 0x202 -- inside WR 2's three
    packets, in [snd_una, snd_nxt - 1] -- acknowledges 0x200 (WR 1 completes successfully), completes WR 2
    with IBV_WC_REM_INV_REQ_ERR / REM_ACCESS_ERR / REM_OP_ERR, flushes WRs 3 and 4 (IBV_WC_WR_FLUSH_ERR),
    and the QP is in the Error state."""
    _post_four(qp)
    assert qp.cq.poll(8) == [] and qp.qp.query_state() == QPState.RTS
    qp.sack(syn, SQ_PSN + 2)
    wcs = []
    qp.rounds(until=lambda f: wcs.extend(qp.cq.poll(8)) or len(wcs) >= 4)
    assert [(w.wr_id, w.status) for w in wcs] == [(1, WCStatus.SUCCESS), (2, status), (3, WCStatus.WR_FLUSH_ERR),
                                                  (4, WCStatus.WR_FLUSH_ERR)]
    assert qp.qp.query_state() == QPState.ERR


def test_error_nak_sack_outside_the_outstanding_psns_is_discarded_mr_sack_034_019(qp):
    """MR-SACK-034 applies to a NAK'd PSN in [snd_una, snd_nxt - 1] only: a remote access error NAK at
    snd_nxt (0x206), far beyond it, or (once an ACK-type SACK acknowledged 0x200..0x203) at 0x201, before
    snd_una, is discarded and counted (MR-SACK-019); the QP stays in RTS, and an ACK-type SACK then
    completes every work request successfully."""
    _post_four(qp)
    qp.sack(0x62, SQ_PSN + 6)
    qp.sack(0x62, SQ_PSN + 0x1000)
    qp.rounds(n=30)
    assert qp.qp.query_state() == QPState.RTS and qp.cq.poll(8) == []
    qp.sack(0x1F, SQ_PSN + 3)
    wcs = []
    qp.rounds(until=lambda f: wcs.extend(qp.cq.poll(8)) or len(wcs) >= 2)
    assert [(w.wr_id, w.status) for w in wcs] == [(1, WCStatus.SUCCESS), (2, WCStatus.SUCCESS)]
    qp.sack(0x62, SQ_PSN + 1)
    qp.rounds(n=30)
    assert qp.qp.query_state() == QPState.RTS and qp.cq.poll(8) == []
    c = qp.qp.native_counters()
    assert c["c_sack_inv"] == 3, c
    qp.sack(0x1F, SQ_PSN + 5)
    qp.rounds(until=lambda f: wcs.extend(qp.cq.poll(8)) or len(wcs) >= 4)
    assert [(w.wr_id, w.status) for w in wcs] == [(i, WCStatus.SUCCESS) for i in (1, 2, 3, 4)]
    assert qp.qp.query_state() == QPState.RTS


# ---------------------------------------------------------------------------- responder
def _write(q, psn, off, fill, retx=False):
    """A one-packet NATIVE_WRITE of 64 bytes `fill` to the responder's MR at off, MSN psn - EPSN."""
    return (Op.NATIVE_WRITE, psn, bytes([fill]) * 64,
            dict(reth=RETH(va=q.mr.addr + off, rkey=q.mr.rkey, dma_len=64),
                 neth=NETH(flags=0x80 | 0x40 | (0x20 if retx else 0), msn=psn - EPSN, offset=0, msg_len=64,
                           tsval=1)))


def _missing(p) -> set[int]:
    """The PSNs an ACK-type SACK reports missing: cum + 1, and each 0 bit of its bitmap."""
    got = set(p.sack_received_psns())
    return {p.bth.psn + 1} | {p.bth.psn + 2 + i for i in range(32 * p.sacketh.bitmap_words)} - got


def _received(p) -> set[int]:
    return set(range(EPSN, p.bth.psn + 1)) | set(p.sack_received_psns())


def test_reported_received_is_never_taken_back_mr_sack_012(qp):
    """MR-SACK-012: WRITEs at ePSN + 2 and ePSN + 4 arrive first (reported by the bitmap), then copies of
    them carrying other bytes (RETX), then ePSN, then ePSN + 1 and ePSN + 3.  No SACK after the one that
    first reported a PSN received reports it missing, and the bytes the first copies placed stay (the
    copies are duplicates, MR-SACK-013, not placed again)."""
    steps = [[_write(qp, EPSN + 2, 2000, 0xA2), _write(qp, EPSN + 4, 4000, 0xA4)],
             [_write(qp, EPSN + 2, 2000, 0xB2, retx=True), _write(qp, EPSN + 4, 4000, 0xB4, retx=True)],
             [_write(qp, EPSN, 0, 0xA0)],
             [_write(qp, EPSN + 1, 1000, 0xA1), _write(qp, EPSN + 3, 3000, 0xA3)]]
    ever, sacks = set(), []
    for frames in steps:
        qp.send(frames)
        got = [p for p in qp.rounds() if p.bth.opcode == Op.NATIVE_SACK]
        assert got and all(not p.aeth.syndrome & 0x60 for p in got)
        for p in got:
            assert not (ever & _missing(p)), (sorted(ever & _missing(p)), p.bth.psn)
            ever |= _received(p)
        if not sacks:                                  # the first two reported received by the first step
            assert {EPSN + 2, EPSN + 4} <= ever and EPSN not in ever
        sacks += got
    assert sacks[-1].bth.psn == EPSN + 4 and qp.qp.query_state() == QPState.RTS
    for i in range(5):
        assert (qp.buf[1000 * i:1000 * i + 64] == 0xA0 + i).all(), i
    assert qp.qp.native_counters()["c_dup"] >= 2
