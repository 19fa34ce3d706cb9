"""Players that need no in-process engine: a batch of mixed work (Plan), a player in a namespace (VethPlayer),
captures on a port (PortTap), and a scripted peer -- a raw socket in the other namespace -- facing one QP of the
compiled plane (scripted_wire, scripted_dp_wire, ScriptedQP)."""
from __future__ import annotations

import contextlib
import socket
import time

import numpy as np

from metaroce_xdp.verbs_types import RecvWR, SendWR, WCStatus, WROpcode
from metaroce_xdp.wire import decode, encode
from players import FULL, Player, to_rts

PACKET_OUTGOING = 4           # sll_pkttype of a frame this host sent


MTU = 1024


class Plan:
    """A mixed batch of work requests from A to B and what each must leave in memory (buffers of at
    least 2 MiB, path MTU `MTU`): WRITEs of 0, 1, MTU - 1, MTU + 1, 64 KiB and 300,000 bytes, a WRITE
    WITH IMMEDIATE, READs, a SEND and a SEND WITH IMMEDIATE, FetchAdd and CompareSwap.  check()
    compares both whole buffers byte for byte with what the operations must have left."""

    W_SIZES = (0, 1, MTU - 1, MTU + 1, 65536, 300_000)
    R_SIZES = (1, 4097, 200_000)

    def __init__(self, a, b, seed: int = 1):
        rng = np.random.default_rng(seed)
        a.buf[:] = rng.integers(0, 256, a.buf.size, dtype=np.uint8)
        b.buf[:] = rng.integers(0, 256, b.buf.size, dtype=np.uint8)
        self.a, self.b = a, b
        self.wrs, self.writes, self.reads = [], [], []
        off = 0
        for i, n in enumerate(self.W_SIZES):                      # A[off] -> B[off + 7]
            self.wrs.append(SendWR(wr_id=i, opcode=WROpcode.RDMA_WRITE, sg_list=[a.sge(off, n)],
                                   remote_addr=b.mr.addr + off + 7, rkey=b.mr.rkey))
            self.writes.append((off, off + 7, n))
            off += n + 64
        self.wrs.append(SendWR(wr_id=20, opcode=WROpcode.RDMA_WRITE_WITH_IMM, sg_list=[a.sge(off, 5000)],
                               remote_addr=b.mr.addr + off, rkey=b.mr.rkey, imm_data=0xBEEF))
        self.writes.append((off, off, 5000))
        off += 5000 + 64
        base = 1 << 20
        for j, n in enumerate(self.R_SIZES):                      # B[src] -> A[dst]
            src, dst = base + j * 262144, base + j * 262144 + 3
            self.wrs.append(SendWR(wr_id=30 + j, opcode=WROpcode.RDMA_READ, sg_list=[a.sge(dst, n)],
                                   remote_addr=b.mr.addr + src, rkey=b.mr.rkey))
            self.reads.append((src, dst, n))
        self.recv_at = (1 << 20) - 65536
        # three receive WQEs: the WRITE WITH IMMEDIATE consumes the first, the two SENDs the others
        b.qp.post_recv([RecvWR(wr_id=900 + k, sg_list=[b.sge(self.recv_at + k * 16384, 16384)]) for k in range(3)])
        self.sends = [(off, 9999), (off, 0)]
        self.wrs.append(SendWR(wr_id=40, opcode=WROpcode.SEND, sg_list=[a.sge(off, 9999)]))
        self.wrs.append(SendWR(wr_id=41, opcode=WROpcode.SEND_WITH_IMM, sg_list=[a.sge(off, 0)], imm_data=5))
        self.cell = b.buf.size - 64
        self.res = a.buf.size - 64
        b.buf[self.cell:self.cell + 8] = np.frombuffer(np.uint64(1000).tobytes(), np.uint8)
        self.wrs.append(SendWR(wr_id=50, opcode=WROpcode.ATOMIC_FETCH_AND_ADD, sg_list=[a.sge(self.res, 8)],
                               remote_addr=b.mr.addr + self.cell, rkey=b.mr.rkey, compare_add=5))
        self.wrs.append(SendWR(wr_id=51, opcode=WROpcode.ATOMIC_CMP_AND_SWP, sg_list=[a.sge(self.res + 8, 8)],
                               remote_addr=b.mr.addr + self.cell, rkey=b.mr.rkey, compare_add=1005, swap=77))
        self.a_before, self.b_before = a.buf.copy(), b.buf.copy()

    def check(self, wcs, rwcs) -> None:
        a, b = self.a, self.b
        assert [(w.wr_id, w.status) for w in wcs] == [(w.wr_id, WCStatus.SUCCESS) for w in self.wrs]
        assert [(w.wr_id, w.status, w.byte_len) for w in rwcs] == [
            (900, WCStatus.SUCCESS, 5000), (901, WCStatus.SUCCESS, 9999), (902, WCStatus.SUCCESS, 0)]
        expect_b, expect_a = self.b_before.copy(), self.a_before.copy()
        for src, dst, n in self.writes:
            expect_b[dst:dst + n] = self.a_before[src:src + n]
        for src, dst, n in self.reads:
            expect_a[dst:dst + n] = self.b_before[src:src + n]
        off, n = self.sends[0]
        expect_b[self.recv_at + 16384:self.recv_at + 16384 + n] = self.a_before[off:off + n]
        expect_b[self.cell:self.cell + 8] = np.frombuffer(np.uint64(77).tobytes(), np.uint8)
        expect_a[self.res:self.res + 8] = np.frombuffer(np.uint64(1000).tobytes(), np.uint8)
        expect_a[self.res + 8:self.res + 16] = np.frombuffer(np.uint64(1005).tobytes(), np.uint8)
        assert np.array_equal(b.buf, expect_b), f"B differs at {np.flatnonzero(b.buf != expect_b)[:8]}"
        assert np.array_equal(a.buf, expect_a), f"A differs at {np.flatnonzero(a.buf != expect_a)[:8]}"


class VethPlayer(Player):
    """A player whose context (opened in namespace ns) is given; QPs made by new_qp(), both directions starting
    at PSN 0xFFFF80 (the PSN wraps early)."""

    CONNECT = dict(sq_psn=0xFFFF80, rq_psn=0xFFFF80, timeout=14, rd_atomic=4, min_rnr_timer=1)

    def __init__(self, topo, ns, ctx, size=2 << 20, cq_depth=4096):
        super().__init__(ctx, topo, ns)
        self.resources(size, cq_depth=cq_depth)


SO_RCVBUFFORCE = 33


def is_roce_v4(f: bytes) -> bool:
    """An Ethernet frame carrying IPv4 UDP to port 4791 (RoCEv2 / MetaRoCE)."""
    return len(f) > 42 and f[12:14] == b"\x08\x00" and f[23] == 17 and f[36:38] == b"\x12\xb7"


def is_roce_v6(f: bytes) -> bool:
    """An Ethernet frame carrying IPv6 UDP to port 4791 (no extension headers)."""
    return len(f) > 62 and f[12:14] == b"\x86\xdd" and f[20] == 17 and f[56:58] == b"\x12\xb7"


class PortTap:
    """A capture on one interface of one namespace (a switch port, usually): every frame both ways, in the
    order the port saw them.  ETH_P_ALL, because a bridge port's frames reach only the taps of every
    protocol; a 64 MiB buffer (SO_RCVBUFFORCE) so that a burst is not lost before the test reads it.
    Non-blocking: each call takes what the socket holds now."""

    def __init__(self, topo, ns: str, ifname: str, rcvbuf: int = 64 << 20) -> None:
        with topo.enter(ns):
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
            self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, rcvbuf)
            self.sock.bind((ifname, 3))
        self.sock.setblocking(False)

    def raw(self, keep=None, limit: int = 1 << 30) -> list[tuple[bytes, bool]]:
        """(frame, sent by the port's side) for each frame held that `keep(frame)` accepts (every frame when
        keep is None); at most `limit` of them, the rest stay for the next call."""
        out: list[tuple[bytes, bool]] = []
        while len(out) < limit:
            try:
                f, addr = self.sock.recvfrom(1 << 16)
            except BlockingIOError:
                break
            if keep is None or keep(f):
                out.append((f, addr[2] == PACKET_OUTGOING))
        return out

    def frames(self, keep=None, limit: int = 1 << 30) -> list[bytes]:
        """raw() without the direction."""
        return [f for f, _ in self.raw(keep, limit)]

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def scripted_wire(prefix: str):
    """two_hosts(prefix=...) with the scripted peer's side in namespace 1: a raw socket on mr1 that sees every
    frame (non-blocking), and a UDP socket on 4791 that swallows what the QP under test sends, so that
    namespace's kernel sends no ICMP back.  Yields (topo, pair, raw socket); tears all down."""
    from metaroce_xdp.topo import two_hosts
    topo, pair = two_hosts(prefix=prefix)
    sock = swallow = None
    try:
        with topo.enter(topo[1]):
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))     # ETH_P_ALL
            sock.bind(("mr1", 3))
            sock.setblocking(False)
            swallow = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            swallow.bind((pair.b.ipv4, 4791))
        yield topo, pair, sock
    finally:
        for s in (sock, swallow):
            if s is not None:
                s.close()
        topo.close()


@contextlib.contextmanager
def engine_context(topo, kind: str, ifname: str = "mr0"):
    """The compiled plane's Context opened on `ifname` in namespace topo[0], without a progress thread (the
    test runs the rounds); closed after.  `kind` must be "compiled" (the only engine)."""
    if kind != "compiled":
        raise ValueError(f"no engine {kind!r}: the compiled plane is the only one")
    from metaroce_xdp.dp import Context
    with topo.enter(topo[0]):
        ctx = Context.open(ifname)
    try:
        yield ctx
    finally:
        ctx.close()


@contextlib.contextmanager
def scripted_dp_wire(prefix: str):
    """scripted_wire(prefix) with the compiled plane's Context opened on mr0 in namespace 0 (the QP under
    test's side).  Yields (topo, pair, raw socket, ctx); tears all down."""
    with scripted_wire(prefix) as (topo, pair, sock), engine_context(topo, "compiled") as ctx:
        yield topo, pair, sock, ctx


class ScriptedQP(Player):
    """One fresh QP of `ctx` (a compiled-plane Context opened in topo[0]), connected to a scripted peer: a
    QPN that exists nowhere, at `pair.b`, played by a test's raw socket.  No local ACK timeout unless
    `timeout` says (0 = infinite, MR-RETRY-001), so nothing is retransmitted while the script runs.  PD,
    64 KiB MR and CQ of its own."""

    def __init__(self, ctx, topo, pair, peer_qpn: int, *, rq_psn: int, sq_psn: int, rd_atomic: int,
                 mtu: int = 1024, timeout: int = 0, **rtr) -> None:
        super().__init__(ctx, topo, topo[0])
        self.pair = pair
        self.resources(1 << 16, cq_depth=64, qp=True)
        with topo.enter(topo[0]):
            to_rts(self.qp, peer_qpn, pair.b.ipv4, mtu=mtu, rq_psn=rq_psn, sq_psn=sq_psn, timeout=timeout,
                   rd_atomic=rd_atomic, **rtr)
        self.src = socket.inet_aton(pair.a.ipv4)     # send() and drain() use self.sock: the script's AF_PACKET
        #                                              socket on the peer's interface, which the subclass sets
        self._budget0 = None

    settle = 0.1                            # seconds for a scripted burst to cross the veth before the next round

    def round(self) -> None:
        """One progress round of the QP's Context."""
        self.ctx.progress()

    def rounds(self, n: int | None = None, *, until=None, quiet_after: int | None = 25, limit: int = 400) -> list:
        """n rounds; or, n None, rounds until until(frames) holds or nothing came for `quiet_after` rounds in a
        row (None: quiet rounds do not end it), `limit` rounds at most.  The frames the QP sent meanwhile."""
        out, quiet = [], 0
        for _ in range(n if n is not None else limit):
            self.round()
            time.sleep(0.002)
            got = self.drain()
            out += got
            quiet = 0 if got else quiet + 1
            if n is None and ((until is not None and until(out))
                              or (quiet_after is not None and quiet >= quiet_after)):
                break
        return out

    def budget(self, n: int) -> None:
        """At most n frames sent per round (the port's round budget) until restore_budget()."""
        from metaroce_xdp.dp import layout as L
        if self._budget0 is None:
            self._budget0 = int(self.ctx.plane.A[L.P_BUDGET])
        self.ctx.plane.A[L.P_BUDGET] = n

    def restore_budget(self) -> None:
        if self._budget0 is not None:
            self.budget(self._budget0)

    def close(self) -> None:
        """The port's budget as it was, the QP gone (unless the test destroyed it); the Context, which the
        module's tests share, stays open."""
        self.restore_budget()
        if not self.ctx.closed:
            self.destroy_qp()

    def send(self, frames) -> None:
        """Request frames (opcode, psn, payload, headers), AckReq set, onto the wire in this order from the
        scripted peer; then `settle` seconds for them to cross the veth."""
        a, b = self.pair.a, self.pair.b
        for opcode, psn, payload, headers in frames:
            self.sock.send(encode(opcode, src_mac=b.mac, dst_mac=a.mac, src_ip=b.ipv4, dst_ip=a.ipv4,
                                  sport=0xC123, dest_qp=self.qp.qp_num, psn=psn, ack_req=1, headers=headers,
                                  payload=payload))
        time.sleep(self.settle)

    def drain(self) -> list:
        """The QP's RoCE frames that reached the script's side, in order (decoded): not what the script sent
        (PACKET_OUTGOING), IPv4 UDP to 4791 from the QP's address only."""
        out = []
        while True:
            try:
                frame, addr = self.sock.recvfrom(1 << 16)
            except BlockingIOError:
                return out
            if addr[2] == PACKET_OUTGOING or len(frame) < 42 or frame[12:14] != b"\x08\x00" or frame[23] != 17 \
                    or int.from_bytes(frame[36:38], "big") != 4791 or frame[26:30] != self.src:
                continue
            out.append(decode(frame))


__all__ = ["FULL", "MTU", "Plan", "VethPlayer", "PortTap", "ScriptedQP", "scripted_wire", "scripted_dp_wire",
           "engine_context", "is_roce_v4", "is_roce_v6", "PACKET_OUTGOING"]
