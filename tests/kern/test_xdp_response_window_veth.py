"""The kernel ACK fast path and the completer agree on which responses count, on a real
interface: the compiled plane's endpoint A (XDP program, AF_XDP socket) against a scripted peer B, a
raw socket in the other namespace that forges each response (B's kernel has no endpoint:
A's requests there go nowhere, so nothing answers but the script).

Checks MR-XH-008 / MR-NAK-012 (an AETH with a reserved type reaches the completer, which
fails the WQE with IBV_WC_BAD_RESP_ERR) and MR-ACK-015 / MR-SEC-022 as revised (a NAK or RNR
NAK before comp_psn is stale, dropped and counted by the kernel even when READ responses,
which only user space sees, moved comp_psn; MR-MEM-033's NAK of a partly answered READ
still fails it with the remote access error).
"""
from __future__ import annotations

import socket
import time

import pytest

from metaroce_xdp.verbs_types import QPState
from metaroce_xdp.wire import AETH, Op, encode
from metaroce_xdp.verbs_types import SendWR, WCStatus, WROpcode
from wire_players import ScriptedQP

pytestmark = pytest.mark.netns

PEER_QPN = 0x777          # the scripted peer's QP: exists nowhere
SQ_PSN = 0x100
MTU = 1024


@pytest.fixture(scope="module")
def wire():
    from metaroce_xdp.dp import Context
    from metaroce_xdp.topo import two_hosts
    topo, pair = two_hosts(prefix="mrwin")
    ctx = sock = None
    try:
        with topo.enter(topo[0]):
            ctx = Context.open("mr0")
        with topo.enter(topo[1]):
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
            sock.bind(("mr1", 0))
        yield topo, pair, ctx, sock
    finally:
        if sock is not None:
            sock.close()
        if ctx is not None:
            ctx.close()
        topo.close()


class Requester(ScriptedQP):
    """A's side: one fresh QP per test, connected to the scripted peer."""

    def __init__(self, wire):
        topo, pair, ctx, self.sock = wire
        super().__init__(ctx, topo, pair, PEER_QPN, rq_psn=0, sq_psn=SQ_PSN, rd_atomic=4, mtu=MTU)
        self.slot = self.ctx.loader.qp(self.qp.qp_num)
        self.st0 = self.ctx.stats()              # the module's Context: counters are diffed from here

    def stat(self, name: str) -> int:
        return self.ctx.stats()[name] - self.st0[name]

    def spin(self, cond, timeout: float = 5.0):
        deadline = time.monotonic() + timeout
        while not cond():
            self.ctx.progress()
            assert time.monotonic() < deadline, self.qp.query()

    def settle(self, rounds: int = 50):
        """Give the frame just sent time to cross the veth, and the engine rounds to take it."""
        for _ in range(rounds):
            self.ctx.progress()
            time.sleep(0.001)

    def respond(self, opcode: Op, psn: int, syndrome: int | None = 0x1F, payload: bytes = b""):
        a, b = self.pair.a, self.pair.b
        headers = {"aeth": AETH(syndrome=syndrome, msn=1)} if syndrome is not None else {}
        self.sock.send(encode(opcode, src_mac=b.mac, dst_mac=a.mac, src_ip=b.ipv4, dst_ip=a.ipv4,
                              dest_qp=self.qp.qp_num, psn=psn, headers=headers, payload=payload))

    def wcs(self, n: int):
        got = []

        def have():
            got.extend(self.cq.poll(n - len(got)))
            return len(got) >= n
        self.spin(have)
        return got


@pytest.fixture
def req(wire):
    r = Requester(wire)
    yield r
    r.close()


def _sge(r: Requester, off: int, n: int):
    from metaroce_xdp.verbs_types import SGE
    return SGE(r.mr.addr + off, n, r.mr.lkey)


def _sent(r: Requester, packets: int, psns: int):
    r.spin(lambda: r.stat("tx") >= packets and int(r.slot["snd_nxt"]) == SQ_PSN + psns)


def test_bad_aeth_reaches_the_completer(req):
    """MR-XH-008, MR-NAK-012: an ACKNOWLEDGE with AETH type 10 for the outstanding SEND, from the peer,
    passes the kernel (ACK_BAD_AETH_TO_USER, not BAD_FIELD) and fails the WQE with IBV_WC_BAD_RESP_ERR."""
    ev0, dr0 = req.ctx.loader.events(), req.ctx.loader.drops()
    req.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.SEND, sg_list=[_sge(req, 0, 100)]))
    _sent(req, 1, 1)
    req.respond(Op.ACKNOWLEDGE, SQ_PSN, syndrome=0x40)
    (wc,) = req.wcs(1)
    assert (wc.wr_id, wc.status) == (1, WCStatus.BAD_RESP_ERR)
    q = req.qp.query()
    assert q["state"] == QPState.ERR and q["error"].startswith("bad response") and "reserved AETH" in q["error"]
    ev, dr = req.ctx.loader.events(), req.ctx.loader.drops()
    assert ev["ACK_BAD_AETH_TO_USER"] - ev0["ACK_BAD_AETH_TO_USER"] == 1
    assert dr["BAD_FIELD"] == dr0["BAD_FIELD"]


def test_naks_before_comp_psn_are_stale_in_the_kernel(req):
    """MR-ACK-015, MR-SEC-022 as revised, MR-SEC-024: a READ of two packets (PSNs 0x100, 0x101) and a SEND
    (0x102).  Once READ responses have moved comp_psn (the kernel never sees them), a NAK or RNR NAK at
    comp_psn - 1 is dropped as STALE_ACK by the kernel and changes nothing; then everything completes."""
    req.qp.post_send([SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[_sge(req, 0, 2 * MTU)],
                             remote_addr=0x1000, rkey=0x1234),
                      SendWR(wr_id=2, opcode=WROpcode.SEND, sg_list=[_sge(req, 4 * MTU, 100)])])
    _sent(req, 2, 3)                                            # a READ request takes one PSN a response
    first, last = bytes(range(256)) * (MTU // 256), bytes(range(255, -1, -1)) * (MTU // 256)
    req.respond(Op.RDMA_READ_RESPONSE_FIRST, SQ_PSN, payload=first)
    req.spin(lambda: int(req.slot["comp_psn"]) == SQ_PSN + 1)
    assert int(req.slot["nak_read_psn"]) == SQ_PSN            # MR-MEM-033's PSN, published too
    stale0, naks0 = int(req.slot["stale_acks"]), int(req.slot["nak_seq"])
    req.respond(Op.ACKNOWLEDGE, SQ_PSN, syndrome=0x60)          # PSN sequence error NAK at comp_psn - 1
    req.settle()
    assert int(req.slot["stale_acks"]) == stale0 + 1 and int(req.slot["nak_seq"]) == naks0
    req.respond(Op.RDMA_READ_RESPONSE_LAST, SQ_PSN + 1, payload=last)
    req.spin(lambda: int(req.slot["comp_psn"]) == SQ_PSN + 2)
    assert int(req.slot["nak_read_psn"]) == 0xFFFFFFFF
    (wc,) = req.wcs(1)
    assert (wc.wr_id, wc.status) == (1, WCStatus.SUCCESS)
    req.respond(Op.ACKNOWLEDGE, SQ_PSN + 1, syndrome=0x60)      # NAK at comp_psn - 1
    req.respond(Op.ACKNOWLEDGE, SQ_PSN + 1, syndrome=0x21)      # RNR NAK at comp_psn - 1
    req.settle()
    assert int(req.slot["stale_acks"]) == stale0 + 3
    assert int(req.slot["nak_seq"]) == naks0 and int(req.slot["rnr_seq"]) == 0
    req.respond(Op.ACKNOWLEDGE, SQ_PSN + 2)
    (wc,) = req.wcs(1)
    assert (wc.wr_id, wc.status) == (2, WCStatus.SUCCESS)
    assert bytes(req.buf[:2 * MTU]) == first + last
    assert req.qp.query()["state"] == QPState.RTS
    assert req.stat("retransmits") == 0 and req.stat("rx_rsp_stale") == 0


def test_nak_of_a_partly_answered_read_still_fails_it(req):
    """MR-MEM-033, MR-ACK-015 (b): the remote access error NAK names the READ's first PSN, which comp_psn
    has passed; the kernel takes it (nak_read_psn) and the READ completes with IBV_WC_REM_ACCESS_ERR."""
    req.qp.post_send(SendWR(wr_id=1, opcode=WROpcode.RDMA_READ, sg_list=[_sge(req, 0, 3 * MTU)],
                            remote_addr=0x1000, rkey=0x1234))
    _sent(req, 1, 3)
    req.respond(Op.RDMA_READ_RESPONSE_FIRST, SQ_PSN, payload=b"\x01" * MTU)
    req.spin(lambda: int(req.slot["comp_psn"]) == SQ_PSN + 1 and int(req.slot["nak_read_psn"]) == SQ_PSN)
    naks0 = req.ctx.loader.events()["NAK_CONSUMED"]
    req.respond(Op.ACKNOWLEDGE, SQ_PSN, syndrome=0x62)
    (wc,) = req.wcs(1)
    assert (wc.wr_id, wc.status) == (1, WCStatus.REM_ACCESS_ERR)
    assert req.ctx.loader.events()["NAK_CONSUMED"] == naks0 + 1
