"""The IUT's own frames: layout of its requests and responses (MR-ENC, MR-BTH, MR-ICRC on the sending side)."""
from __future__ import annotations

from .. import packets as P
from ..registry import case
from ._common import ACK_WAIT, describe, expect_ack, responses


def _frame_rules(t, c, frames, rules_ok: dict, *, response: bool) -> None:
    """Accumulate per-rule problems for frames the IUT sent to the LT."""
    from scapy.layers.inet import IP, UDP
    sports = set()
    for f in frames:
        v, ip, udp = f.roce, f.roce.pkt[IP], f.roce.pkt[UDP]
        sports.add(v.sport)
        info = P.OPS.get(v.op)
        probs = {
            "MR-ENC-001": bool(v.malformed) or info is None,
            "MR-OPC-001": bool(v.malformed) or info is None or (info.payload == "none" and bool(v.payload)),
            "MR-OPC-005": info is None or info.kind == "CNP" and not response,
            "MR-BTH-001": len(f.data) < 14 + 20 + 8 + 12,
            "MR-ENC-003": f.data[12:14] != b"\x08\x00",
            "MR-ENC-012": int(ip.ttl) != 64,
            "MR-ICRC-002": not v.icrc_ok, "MR-ICRC-003": not v.icrc_ok,
            "MR-ECN-004": (v.tos >> 2) != 26,
            "MR-ENC-002": (v.dst_mac.lower() != t.lt_mac.lower() or v.src_mac.lower() != t.iut_mac.lower()),
            "MR-ENC-008": (ip.version != 4 or ip.ihl != 5),
            "MR-ENC-010": (not (int(ip.flags) & 2) or int(ip.flags) & 1 or ip.frag != 0),
            "MR-ENC-013": (ip.proto != 17 or P.ipv4_checksum(bytes(f.data[14:34])) != int(ip.chksum)),
            "MR-ENC-019": udp.dport != 4791,
            "MR-ENC-022": int(udp.len) != len(bytes(udp)),
            "MR-ICRC-001": not v.icrc_ok, "MR-ICRC-010": not v.icrc_ok,
            "MR-BTH-006": v.tver != 0, "MR-BTH-009": v.pkey != 0xFFFF, "MR-BTH-011": v.fecn != 0,
            "MR-BTH-012": v.becn != 0, "MR-BTH-013": (v.resv6 != 0 or v.resv7 != 0),
            "MR-BTH-014": v.dqpn != c.lt_qpn, "MR-ECN-003": (v.ecn in (1, 3)),
            "MR-ENC-026": (v.pad != ((-len(v.payload)) & 3)),
        }
        if response:
            probs["MR-BTH-017"] = v.ackreq != 0
            probs["MR-XH-006"] = v.op == 0x11 and int(udp.len) != 8 + 12 + 4 + 4
            probs["MR-ECN-002"] = v.ecn != 2
        else:
            probs["MR-ECN-001"] = v.ecn != 2
            probs["MR-ENC-028"] = len(v.payload) > c.mtu
        for r, bad in probs.items():
            if r in rules_ok and bad:
                rules_ok[r].append(f)
    if "MR-ENC-020" in rules_ok and (len(sports) > 1 or any(not 0xC000 <= s <= 0xFFFF for s in sports)):
        rules_ok["MR-ENC-020"].extend(frames)


LAYOUT = ["MR-ENC-001", "MR-ENC-002", "MR-ENC-003", "MR-ENC-008", "MR-ENC-010", "MR-ENC-012", "MR-ENC-013",
          "MR-ENC-019", "MR-ENC-022", "MR-ICRC-001", "MR-ICRC-002", "MR-ICRC-003", "MR-ICRC-010", "MR-BTH-001",
          "MR-BTH-006", "MR-BTH-009", "MR-BTH-011", "MR-BTH-012", "MR-BTH-013", "MR-BTH-014", "MR-ECN-003",
          "MR-ECN-004", "MR-ENC-026", "MR-OPC-001", "MR-OPC-005"]


@case("TC-ENC-001-a", rules=LAYOUT + ["MR-BTH-017", "MR-ENC-020", "MR-XH-006", "MR-ECN-002"], category="WIRE",
      timeout=10)
def response_layout(t):
    """The IUT's ACKs and NAK to the LT: Ethernet/IPv4/UDP/BTH fields as the sender rules require (TTL 64 and
    DSCP 26 being the defaults of a QP created without other values)."""
    c = t.connect()
    m = c.send(*[c.write(b"L%d" % i, offset=8 * i) for i in range(3)],
               c.write(b"gap", offset=64, psn=P.psn_add(c.psn, 5)))
    got = responses(c, m, lambda f: f.roce.ack_kind == "NAK", extra=0.1)
    probs: dict = {r: [] for r in LAYOUT + ["MR-BTH-017", "MR-ENC-020", "MR-XH-006", "MR-ECN-002"]}
    _frame_rules(t, c, got, probs, response=True)
    for r, bad in probs.items():
        t.check(r, bool(got) and not bad, f"{len(got)} responses checked" + (f"; violating: {describe(bad)}" if bad
                                                                           else ""),
                frames=bad or got or [m + 1], expected="3 ACKs and 1 NAK laid out as the sender rules say")


@case("TC-RC-002-a", rules=LAYOUT + ["MR-RC-002", "MR-RC-004", "MR-RC-007", "MR-ACK-013", "MR-BTH-003",
                                     "MR-XH-002", "MR-XH-001", "MR-BTH-008", "MR-ENC-020", "MR-RC-021", "MR-ECN-001",
                                     "MR-ENC-028", "MR-RC-006"],
      category="WIRE", timeout=15)
def segmented_write_from_the_iut(t):
    """A 2501-byte RDMA WRITE posted on the IUT at path MTU 1024: FIRST (RETH), MIDDLE, LAST of 1024, 1024 and
    453 bytes with PadCnt 3 and zero pad, consecutive PSNs from sq_psn, AckReq on LAST, SE 0; the LT's ACK
    completes it successfully."""
    c = t.connect(mtu=1024)
    data = bytes((i * 13 + 7) & 0xFF for i in range(2501))
    c.mem_write(0, data)
    remote_va, remote_rkey = 0x7F00_1234_5000, 0xABCD
    m = c.t.lt.last_num()
    c.post_send(wr_id="0x77", opcode="RDMA_WRITE", sg_list=[{"mr": c.mr, "offset": 0, "len": len(data)}],
                remote={"va": hex(remote_va), "rkey": remote_rkey})
    got = c.expect(3, ACK_WAIT, after=m)
    probs: dict = {r: [] for r in LAYOUT + ["MR-ENC-020", "MR-ECN-001", "MR-ENC-028"]}
    _frame_rules(t, c, got, probs, response=False)
    names = [f.roce.name for f in got]
    sizes = [len(f.roce.payload) for f in got]
    psns = [f.roce.psn for f in got]
    exp = (f"RDMA_WRITE_FIRST psn={c.iut_psn:#08x} RETH va={remote_va:#x} rkey={remote_rkey:#x} len=2501 payload=1024B, "
           f"RDMA_WRITE_MIDDLE payload=1024B, RDMA_WRITE_LAST A payload=453B (PadCnt 3)")
    seg_ok = names == ["RDMA_WRITE_FIRST", "RDMA_WRITE_MIDDLE", "RDMA_WRITE_LAST"] and sizes == [1024, 1024, 453]
    t.check("MR-RC-002", seg_ok and b"".join(f.roce.payload for f in got) == data,
            f"{names} {sizes}", frames=got or [m + 1], expected=exp)
    t.check("MR-RC-004", psns == [P.psn_add(c.iut_psn, i) for i in range(3)], f"PSNs {[hex(p) for p in psns]}",
            frames=got or [m + 1], expected=exp)
    reth = [f for f in got if "RETH" in f.roce.headers]
    t.check("MR-RC-007", len(got) == 3 and reth == got[:1], f"RETH in {[f.num for f in reth]}", frames=got or [m + 1],
            expected=exp)
    r0 = got[0].roce.headers.get("RETH") if got else None
    reth_ok = r0 is not None and (int(r0.va), int(r0.rkey), int(r0.dlen)) == (remote_va, remote_rkey, 2501)
    for r in ("MR-XH-002", "MR-XH-001"):
        t.check(r, reth_ok, f"RETH {r0.summary() if r0 is not None else None}", frames=got[:1] or [m + 1],
                expected=exp)
    t.check("MR-RC-006", seg_ok and psns == sorted(psns, key=lambda p: (p - c.iut_psn) & 0xFFFFFF),
            f"{names} in PSN order", frames=got or [m + 1], expected=exp)
    t.check("MR-ACK-013", len(got) == 3 and got[-1].roce.ackreq == 1, f"AckReq {[f.roce.ackreq for f in got]}",
            frames=got or [m + 1], expected=exp)
    t.check("MR-BTH-003", len(got) == 3 and all(f.roce.se == 0 for f in got), f"SE {[f.roce.se for f in got]}",
            frames=got or [m + 1], expected="SE 0 in every packet (no SOLICITED; a WRITE)")
    pad_ok = len(got) == 3 and [f.roce.pad for f in got] == [0, 0, 3] and _pad_bytes(got[-1]) == bytes(3)
    t.check("MR-BTH-008", pad_ok, f"PadCnt {[f.roce.pad for f in got]}", frames=got or [m + 1], expected=exp)
    for r, bad in probs.items():
        t.check(r, len(got) == 3 and not bad and (r != "MR-ENC-026" or pad_ok),
                f"{len(got)} requests checked" + (f"; violating: {describe(bad)}" if bad else ""),
                frames=bad or got or [m + 1], expected=exp)
    if len(got) == 3:
        c.send(P.build("ACKNOWLEDGE", src_mac=t.lt_mac, dst_mac=t.iut_mac, src_ip=t.lt_ip, dst_ip=t.iut_ip,
                       dqpn=c.qpn, psn=psns[-1], sport=c.sport, aeth=(0x1F, 1)))
    wcs = c.poll(1, timeout=ACK_WAIT)
    ok = len(wcs) == 1 and wcs[0]["status"] == "IBV_WC_SUCCESS" and wcs[0]["wr_id"] == "0x77"
    t.check("MR-RC-021", ok, f"completion {wcs}", frames=got[-1:] or [m + 1],
            expected="IBV_WC_SUCCESS for wr_id 0x77 after the ACK of the LAST packet")


def _pad_bytes(f) -> bytes:
    v = f.roce
    from scapy.contrib.roce import BTH
    body = bytes(v.pkt[BTH].payload)
    return body[len(body) - v.pad:] if v.pad else b""




@case("TC-RC-004-b", rules=["MR-RC-004", "MR-BTH-020", "MR-RC-021"], category="SEQ", timeout=10)
def requester_psn_wraps(t):
    """The IUT as requester with sq_psn 0xffffff: a 3-packet WRITE takes PSNs 0xffffff, 0, 1, and the LT's
    ACK with PSN 1 (after 0xffffff modulo 2^24) completes it."""
    c = t.connect(mtu=1024, iut_psn=0xFFFFFF)
    c.mem_write(0, b"w" * 2049)
    m = c.t.lt.last_num()
    c.post_send(wr_id="0x5", opcode="RDMA_WRITE", sg_list=[{"mr": c.mr, "offset": 0, "len": 2049}],
                remote={"va": "0x10000", "rkey": 0x77})
    got = c.expect(3, ACK_WAIT, after=m)
    psns = [f.roce.psn for f in got]
    t.check("MR-RC-004", psns == [0xFFFFFF, 0, 1], f"PSNs {[hex(p) for p in psns]}", frames=got or [m + 1],
            expected="RDMA WRITE FIRST/MIDDLE/LAST at PSNs 0xffffff, 0x000000, 0x000001")
    if len(got) == 3:
        c.send(P.build("ACKNOWLEDGE", src_mac=t.lt_mac, dst_mac=t.iut_mac, src_ip=t.lt_ip, dst_ip=t.iut_ip,
                       dqpn=c.qpn, psn=1, sport=c.sport, aeth=(0x1F, 1)))
    wcs = c.poll(1, timeout=ACK_WAIT)
    ok = len(wcs) == 1 and wcs[0]["status"] == "IBV_WC_SUCCESS"
    t.check("MR-BTH-020", ok and psns == [0xFFFFFF, 0, 1], f"ACK psn 0x000001 -> completion {wcs}",
            frames=got or [m + 1], expected="the ACK at PSN 1 acknowledges the packet at 0xffffff too")
    t.check("MR-RC-021", ok, f"completion {wcs}", frames=got[-1:] or [m + 1], expected="IBV_WC_SUCCESS")


@case("TC-XH-016-a", rules=["MR-XH-016", "MR-CNP-001", "MR-CNP-002", "MR-BTH-019", "MR-ECN-005", "MR-ECN-009"],
      category="CC", timeout=10)
def cnp_format(t):
    """A CE-marked WRITE to a compat QP draws a CNP: opcode 0x81, BECN 1, PSN 0, DestQP the LT's QP, 16 zero
    bytes, ICRC correct, DSCP 48 (default), Not-ECT (SHOULD), the QP's UDP source port."""
    c = t.connect()
    m0 = c.send(c.write(b"plain", offset=0))
    ack = expect_ack(c, P.psn_add(c.psn, -1), m0)
    mark = c.send(c.write(b"marked", offset=64, tos=0x6B))
    got = c.expect(1, ACK_WAIT, after=mark, match=lambda f: f.roce.op == 0x81)
    cnp = got[0] if got else None
    v = cnp.roce if cnp else None
    from scapy.contrib.roce import BTH
    body = bytes(v.pkt[BTH].payload) if v else b""
    fmt = (v is not None and v.se == 0 and v.migreq == 0 and v.pad == 0 and v.tver == 0 and v.pkey == 0xFFFF
           and v.fecn == 0 and v.becn == 1 and v.dqpn == c.lt_qpn and v.ackreq == 0 and v.psn == 0
           and body == bytes(16) and v.icrc_ok and len(cnp.data) - 14 - 20 == 8 + 12 + 16 + 4)
    exp = f"CNP dqpn={c.lt_qpn:#08x} psn=0 BECN, 16 zero bytes, DSCP 48, Not-ECT"
    f = [cnp] if cnp else [mark + 1]
    t.check("MR-CNP-002", cnp is not None, "CNP sent" if cnp else "no CNP for a CE-marked request", frames=f,
            expected=exp)
    t.check("MR-ECN-009", cnp is not None, "the CE mark was answered with a CNP" if cnp else "no CNP", frames=f,
            expected=exp)
    if cnp is None:                          # the format rules have no packet to judge (MR-CONF-024)
        for r in ("MR-XH-016", "MR-BTH-019", "MR-CNP-001", "MR-ECN-005"):
            t.blocked(r, "MR-CNP-002", "no CNP was sent", frames=f)
        return
    t.check("MR-XH-016", fmt, v.summary() + f" body {body.hex()}", frames=f, expected=exp)
    t.check("MR-BTH-019", v.psn == 0, f"PSN {v.psn}", frames=f, expected=exp)
    sport_ok = ack is not None and v.sport == ack.roce.sport
    t.check("MR-CNP-001", fmt and v.dst_ip == t.lt_ip and (v.tos >> 2) == 48 and sport_ok,
            f"to {v.dst_ip}, DSCP {v.tos >> 2}, source port {v.sport} (the QP's ACKs: "
            f"{ack.roce.sport if ack else None})", frames=f, expected=exp)
    t.check("MR-ECN-005", v.ecn == 0, f"ECN {v.ecn}", frames=f, expected=exp)


@case("TC-ENC-031-a", rules=["MR-ENC-031", "MR-RC-010"], category="WIRE", timeout=10)
def payload_beyond_pmtu_is_a_transport_error(t):
    """A WRITE ONLY with 1280 bytes of payload on a QP of path MTU 1024 (the frame fits the link MTU) is not
    dropped at the encapsulation layer: it is an invalid request, NAK code 1, nothing placed."""
    c = t.connect(mtu=1024)
    p = c.psn
    mark = c.send(c.write(b"\x5a" * 1280, offset=0))
    got = c.expect(1, ACK_WAIT, after=mark)
    nak = bool(got) and got[0].roce.ack_kind == "NAK" and got[0].roce.nak_code == 1 and got[0].roce.psn == p
    placed = c.mem(0, 16) != bytes(16)
    exp = f"ACKNOWLEDGE NAK(0x61) psn={p:#08x}; nothing placed"
    t.check("MR-ENC-031", bool(got), f"answered: {describe(got)}", frames=got or [mark + 1], expected=exp)
    t.check("MR-RC-010", nak and not placed, f"{describe(got)}; placed {placed}", frames=got or [mark + 1],
            expected=exp)


@case("TC-RC-011-a", rules=["MR-RC-011", "MR-NAK-006", "MR-NAK-009"], category="SEQ", timeout=15)
def write_lengths_must_add_up(t):
    """WRITEs whose payloads do not add up to RETH.DMA Length are invalid requests (NAK code 1, QP to ERR,
    nothing placed): ONLY shorter than its DMA Length, ONLY longer, FIRST + LAST short of it."""
    variants = (("ONLY with 12 of 16 bytes", lambda c: [c.frame("RDMA_WRITE_ONLY", ackreq=True,
                                                                 reth=(c.va, c.rkey, 16), payload=b"\x11" * 12)]),
                ("ONLY with 20 of 16 bytes", lambda c: [c.frame("RDMA_WRITE_ONLY", ackreq=True,
                                                                 reth=(c.va, c.rkey, 16), payload=b"\x11" * 20)]),
                ("FIRST + LAST with 256 + 100 of 400 bytes",
                 lambda c: [c.frame("RDMA_WRITE_FIRST", reth=(c.va, c.rkey, 400), payload=b"\x11" * 256),
                            c.frame("RDMA_WRITE_LAST", psn=P.psn_add(c.psn, 1), ackreq=True, payload=b"\x11" * 100)]))
    for what, mk in variants:
        c = t.connect(mtu=256)
        frames = mk(c)
        bad_psn = P.psn_add(c.psn, len(frames) - 1)
        mark = c.send(*frames)
        got = c.expect(1, ACK_WAIT, after=mark, match=lambda f: f.roce.op == 0x11 and f.roce.ack_kind == "NAK")
        ok = bool(got) and got[0].roce.nak_code == 1 and got[0].roce.psn == bad_psn
        exp = f"ACKNOWLEDGE NAK(0x61) psn={bad_psn:#08x}; QP in ERR; nothing placed beyond earlier packets"
        placed_tail = c.mem(256, 16) != bytes(16) if len(frames) > 1 else c.mem(0, 16) != bytes(16)
        state = c.query()["state"]
        for r in ("MR-RC-011", "MR-NAK-006"):
            t.check(r, ok and not placed_tail, f"{what}: {describe(got)}; placed {placed_tail}",
                    frames=got or [mark + 1], expected=exp)
        t.check("MR-NAK-009", ok and state == "ERR", f"{what}: QP {state} after the NAK", frames=got or [mark + 1],
                expected=exp)


@case("TC-XH-014-a", rules=["MR-XH-014", "MR-BTH-003", "MR-RC-019"], category="WIRE", timeout=10)
def immediate_data_both_ways(t):
    """SEND WITH IMMEDIATE posted on the IUT with SOLICITED: SEND_ONLY_WITH_IMMEDIATE carries the value in
    ImmDt unchanged and SE 1; the LT's SEND_ONLY_WITH_IMMEDIATE with SE reaches the receive completion with
    its ImmDt unchanged."""
    c = t.connect()
    c.mem_write(0, b"immediate")
    m = c.t.lt.last_num()
    c.post_send(wr_id="0x9", opcode="SEND_WITH_IMM", imm=0x11223344, flags=["SIGNALED", "SOLICITED"],
                sg_list=[{"mr": c.mr, "offset": 0, "len": 9}])
    got = c.expect(1, ACK_WAIT, after=m)
    v = got[0].roce if got else None
    imm = int(v.headers["ImmDt"].imm) if v is not None and "ImmDt" in v.headers else None
    exp = "SEND_ONLY_WITH_IMMEDIATE SE A imm=0x11223344 payload=9B"
    t.check("MR-XH-014", v is not None and v.name == "SEND_ONLY_WITH_IMMEDIATE" and imm == 0x11223344,
            f"IUT sent {describe(got)}", frames=got or [m + 1], expected=exp)
    t.check("MR-BTH-003", v is not None and v.se == 1, f"SE {v.se if v else None}", frames=got or [m + 1],
            expected=exp)
    if got:
        c.send(P.build("ACKNOWLEDGE", src_mac=t.lt_mac, dst_mac=t.iut_mac, src_ip=t.lt_ip, dst_ip=t.iut_ip,
                       dqpn=c.qpn, psn=v.psn, sport=c.sport, aeth=(0x1F, 1)))
        c.poll(1, ACK_WAIT)                                   # the send completion
    c.post_recv(64, offset=1024, wr_id=0x21)
    mark = c.send(c.frame("SEND_ONLY_WITH_IMMEDIATE", ackreq=True, se=True, imm=0xA1B2C3D4, payload=b"hello"))
    c.psn = P.psn_add(c.psn, 1)
    ack = expect_ack(c, P.psn_add(c.psn, -1), mark)
    wcs = c.poll(1, ACK_WAIT)
    w = wcs[0] if wcs else {}
    ok = (w.get("opcode") == "IBV_WC_RECV" and w.get("imm") == 0xA1B2C3D4 and w.get("byte_len") == 5
          and w.get("status") == "IBV_WC_SUCCESS" and c.mem(1024, 5) == b"hello")
    t.check("MR-XH-014", ok, f"receive completion {w}", frames=[ack] if ack else [mark + 1],
            expected="IBV_WC_RECV, imm 0xa1b2c3d4, byte_len 5")
    t.check("MR-RC-019", ok, f"receive completion {w}", frames=[ack] if ack else [mark + 1],
            expected="IBV_WC_RECV, imm 0xa1b2c3d4, byte_len 5")
