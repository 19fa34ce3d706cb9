"""Encapsulation cases (01-encapsulation.md): the UDP checksum against the ICRC, the ICRC of
retransmissions, the path MTU against the link and between the two ends."""
from __future__ import annotations

import fcntl
import socket
import struct

from ..agentproto import AgentError
from .. import packets as P
from ..registry import case
from ..context import CannotDrive, _gid
from ._common import QUIET, describe
from ._req import ack, connect_req, is_req, pattern, post, requests, wr, write_wr

SIOCGIFMTU = 0x8921


def _fold(s: int) -> int:
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return s


def udp_checksum_state(frame: bytes) -> str:
    """"zero" (no checksum sent), "ok" (it verifies over pseudo-header, UDP header and the whole
    datagram up to and including the ICRC, RFC 768 / RFC 8200) or "bad"."""
    ip, ver = P._ip_offset(frame)
    if ver == 4:
        total = struct.unpack_from("!H", frame, ip + 2)[0]
        ihl = (frame[ip] & 0x0F) * 4
        udp, end = ip + ihl, ip + total
        pseudo = frame[ip + 12:ip + 20] + struct.pack("!BBH", 0, 17, end - udp)
    else:
        plen = struct.unpack_from("!H", frame, ip + 4)[0]
        udp, end = ip + 40, ip + 40 + plen
        pseudo = frame[ip + 8:ip + 40] + struct.pack("!IxxxB", end - udp, 17)
    if struct.unpack_from("!H", frame, udp + 6)[0] == 0:
        return "zero"
    data = pseudo + frame[udp:end]
    if len(data) % 2:
        data += b"\0"
    s = _fold(sum(struct.unpack(f"!{len(data) // 2}H", data)))
    return "ok" if s == 0xFFFF else "bad"


def link_mtu(ifname: str) -> int:
    """The MTU of the tester's interface on the link (SIOCGIFMTU, in the tester's namespace)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16si12x", ifname.encode()[:15], 0)
        return struct.unpack_from("16si", fcntl.ioctl(s.fileno(), SIOCGIFMTU, req))[1]


@case("TC-ENC-025-a", rules=["MR-ENC-025", "MR-ICRC-012"], category="WIRE", timeout=10)
def udp_checksum_covers_icrc(t):
    """Every frame the IUT sends (a WRITE as requester, an ACK and a READ response as responder) carries a
    UDP checksum that is zero or verifies over the whole datagram including the ICRC, and a correct ICRC."""
    c = connect_req(t, timeout=14)
    c.mem_write(0, pattern(700))
    mark = post(c, write_wr(c, 700, 1))
    (req,) = requests(c, mark, 1, 2.0) or [None]
    if req is not None:
        c.send(ack(c, req.roce.psn, 1))
    m2 = c.send(c.write(b"tested", offset=2048))
    got = c.expect(1, 2.0, after=m2)
    m3 = c.send(c.frame("RDMA_READ_REQUEST", reth=(c.va, c.rkey, 100)))
    c.psn = P.psn_add(c.psn, 1)
    got += c.expect(1, 2.0, after=m3, match=lambda f: f.roce.op == 0x10)
    frames = ([req] if req is not None else []) + got
    states = [(f, udp_checksum_state(f.data)) for f in frames]
    bad = [f for f, s in states if s == "bad"]
    kinds = ", ".join(f"{f.roce.name}: {s}" for f, s in states)
    enough = len(frames) == 3
    t.check("MR-ENC-025", enough and not bad,
            f"UDP checksums of the IUT's frames: {kinds}" + ("" if enough else f"; only {describe(frames)}"),
            frames=bad or frames, expected="a WRITE, an ACK and a READ RESPONSE ONLY, each UDP checksum 0 or "
                                           "verifying over the datagram including the ICRC")
    icrc_bad = [f for f in frames if not f.roce.icrc_ok]
    t.check("MR-ICRC-012", enough and not bad and not icrc_bad,
            f"{kinds}; ICRC verifies in {len(frames) - len(icrc_bad)} of {len(frames)}",
            frames=bad + icrc_bad or frames,
            expected="every checksummed frame: ICRC correct and the checksum computed after it (covering it)")


@case("TC-ICRC-015-a", rules=["MR-ICRC-015"], category="ICRC", timeout=10)
def retransmission_icrc_verifies(t):
    """A WRITE whose ACK the LT withholds is retransmitted; the original and every retransmission carry an
    ICRC that verifies for their own bytes (the AckReq bit, part of the ICRC, may change between them)."""
    c = connect_req(t, timeout=10, retry_cnt=7)
    c.mem_write(0, pattern(400))
    p = c.iut_psn
    mark = post(c, write_wr(c, 400, 1), wr("SEND", 200, wr_id=2, c=c, offset=512))
    sent = c.expect(4, 2.0, after=mark, match=is_req)
    c.send(ack(c, P.psn_add(p, 1), 2))
    c.poll(2, 0.5)
    orig = [f for f in sent if f.roce.psn == p]
    again = len(orig) >= 2
    bad = [f for f in sent if not f.roce.icrc_ok]
    t.check("MR-ICRC-015", again and not bad,
            f"{len(sent)} request frames, PSN {p:#08x} sent {len(orig)} times; ICRC bad in: {describe(bad)}",
            frames=bad or sent, expected=f"PSN {p:#08x} retransmitted after the local ACK timeout, every copy "
                                         "with a verifying ICRC")


@case("TC-ENC-030-a", rules=["MR-ENC-030"], category="WIRE", timeout=10)
def path_mtu_applies_both_ways(t):
    """path_mtu 512 set on the IUT QP: its SEND of 1300 bytes goes out as 512 + 512 + 276 bytes, and its
    READ response to a 1300-byte READ as well; nothing it sends exceeds 512 bytes of payload."""
    mtus = t.hello.get("mtus", [1024])
    if 512 not in mtus:
        raise CannotDrive(f"the IUT offers path MTUs {mtus}, not 512")
    c = connect_req(t, mtu=512, timeout=14)
    data = pattern(1300)
    c.mem_write(0, data)
    mark = post(c, wr("SEND", 1300, wr_id=1, c=c))
    reqs = c.expect(3, 2.0, after=mark, match=is_req)
    if reqs:
        c.send(ack(c, reqs[-1].roce.psn, 1))
    m2 = c.send(c.frame("RDMA_READ_REQUEST", reth=(c.va, c.rkey, 1300)))
    c.psn = P.psn_add(c.psn, 3)
    rsps = c.expect(3, 2.0, after=m2, match=lambda f: 0x0D <= f.roce.op <= 0x10)
    c.poll(1, 0.3)
    sizes_req = [len(f.roce.payload) for f in reqs]
    sizes_rsp = [len(f.roce.payload) for f in rsps]
    ok = sizes_req == [512, 512, 276] and sizes_rsp == [512, 512, 276]
    t.check("MR-ENC-030", ok, f"SEND payloads {sizes_req}, READ response payloads {sizes_rsp}",
            frames=reqs + rsps, expected="both streams as 512, 512, 276 bytes (path MTU 512 of the QP)")


@case("TC-ENC-029-a", rules=["MR-ENC-029"], category="WIRE", timeout=10)
def path_mtu_fits_link(t):
    """The IUT accepts no path MTU whose full-size packet would exceed the link MTU: modify_qp to RTR with a
    larger one fails, and a full-size WRITE FIRST (BTH + RETH + path MTU) at the largest MTU it offers fits
    the link."""
    link = link_mtu(t.lt.ifname)
    ip_hdr = 40 if ":" in t.iut_ip else 20
    stack = ip_hdr + 8 + 12 + 16 + 4            # IP, UDP, BTH, RETH, ICRC: the largest request stack
    offered = sorted(t.hello.get("mtus", [1024]))
    too_big = [m for m in offered if m + stack > link]
    t.check("MR-ENC-029", not too_big, f"link MTU {link}; hello offers path MTUs {offered}",
            expected=f"only path MTUs with MTU + {stack} <= {link}", observed=[f"hello mtus {offered}"])
    bigger = [m for m in (256, 512, 1024, 2048, 4096) if m + stack > link]
    if bigger:
        c = t.connect(mtu=offered[0], state="INIT")
        err = None
        try:
            t.agent.call("modify_qp", qp=c.qp, state="RTR",
                         attrs={"dest_qpn": c.lt_qpn, "rq_psn": c.psn, "path_mtu": bigger[0],
                                "dgid": _gid(t.lt_ip),
                                "dmac": t.lt_mac, "max_dest_rd_atomic": 4, "min_rnr_timer": 1})
        except AgentError as e:
            err = e.code
        t.check("MR-ENC-029", err is not None,
                f"modify_qp RTR with path_mtu {bigger[0]} (full packet {bigger[0] + stack} B > link {link}): "
                + (f"refused ({err})" if err else "accepted"),
                expected="the modify refused", observed=[f"modify_qp path_mtu {bigger[0]}: {err or 'ok'}"])
    top = offered[-1] if offered[-1] + stack <= link else max([m for m in offered if m + stack <= link] or [256])
    c2 = connect_req(t, mtu=top, timeout=14)
    n = top + 100
    c2.mem_write(0, pattern(n))
    mark = post(c2, write_wr(c2, n, 7))
    reqs = c2.expect(2, 2.0, after=mark, match=is_req)
    if reqs:
        c2.send(ack(c2, reqs[-1].roce.psn, 1))
        c2.poll(1, 0.3)
    over = [f for f in reqs if len(f.data) - 14 > link]
    first = [f for f in reqs if f.roce.op == 0x06]
    t.check("MR-ENC-029", bool(first) and not over,
            f"path MTU {top}: IP sizes {[len(f.data) - 14 for f in reqs]} against link MTU {link}",
            frames=over or reqs, expected=f"a WRITE FIRST with {top} B of payload, IP size <= {link}")


@case("TC-ECN-011-a", rules=["MR-ECN-011"], category="CC", timeout=10)
def ecn_disabled_not_ect_no_cnp(t):
    """set_param ecn 0, then a new QP: its WRITE request, its ACKs and its READ response are Not-ECT, and
    three CE-marked WRITEs to it draw ACKs but no CNP."""
    t.set_param("ecn", 0)
    c = connect_req(t, timeout=14)
    c.mem_write(0, pattern(200))
    mark = post(c, write_wr(c, 200, 1))
    reqs = requests(c, mark, 1, 2.0)
    if reqs:
        c.send(ack(c, reqs[0].roce.psn, 1))
    c.poll(1, 0.5)
    m2 = c.send(*[c.write(b"ce %d" % i, offset=1024 + 64 * i, tos=0x6B) for i in range(3)])
    got = c.quiet(0.2 + QUIET, after=m2)
    m3 = c.send(c.frame("RDMA_READ_REQUEST", reth=(c.va, c.rkey, 64)))
    c.psn = P.psn_add(c.psn, 1)
    rsp = c.expect(1, 2.0, after=m3, match=lambda f: f.roce.op == 0x10)
    frames = reqs + got + rsp
    cnps = [f for f in got if f.roce.op == 0x81]
    ect = [f for f in frames if f.roce.ecn != 0]
    acks = [f for f in got if f.roce.op == 0x11]
    ok = bool(reqs) and bool(rsp) and len(acks) >= 1 and not cnps and not ect
    t.check("MR-ECN-011", ok, f"IUT frames {describe(frames)}; ECN bits {[f.roce.ecn for f in frames]}; "
            f"CNPs {len(cnps)}", frames=cnps + ect or frames,
            expected="every frame of the QP Not-ECT (ECN 00), ACKs for the CE-marked WRITEs, no CNP")
