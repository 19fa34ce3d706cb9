"""Header validation: what the IUT must drop silently, and what it must accept (MR-ENC, MR-ICRC, MR-BTH, MR-OPC)."""
from __future__ import annotations

from .. import packets as P
from ..registry import case
from ._common import ACK_WAIT, describe, dropped_silently, expect_ack, responses


def _bad_write(c, **kw) -> bytes:
    """A WRITE ONLY of 16 bytes "BAD!" at MR offset 0 with the conn's next PSN (edited by kw)."""
    return c.frame("RDMA_WRITE_ONLY", ackreq=True, reth=(c.va, c.rkey, 16), payload=b"BAD!" * 4, **kw)


@case("TC-ACK-001-a", rules=["MR-ACK-001", "MR-ACK-003", "MR-ICRC-013"], category="ACK", timeout=10)
def write_only_acked(t):
    """A valid WRITE ONLY with AckReq is placed and ACKed with its PSN and the new MSN."""
    c = t.connect()
    data = bytes(range(48))
    mark = c.send(c.write(data, offset=128))
    ack = expect_ack(c, P.psn_add(c.psn, -1), mark)
    placed = c.mem(128, len(data)) == data
    exp = f"ACKNOWLEDGE ACK psn={P.psn_add(c.psn, -1):#08x} msn=1"
    t.check("MR-ACK-003", ack is not None, f"ACK {'seen' if ack else 'missing'}", frames=[ack] if ack else [mark + 1],
            expected=exp)
    t.check("MR-ACK-001", ack is not None and ack.roce.msn == 1,
            f"ACK msn={ack.roce.msn if ack else None} (expected 1)", frames=[ack] if ack else [mark + 1], expected=exp)
    t.check("MR-ICRC-013", placed, "a frame with a correct ICRC was accepted and placed" if placed
            else "a valid frame was not placed", frames=[mark + 1])


@case("TC-ICRC-014-a", rules=["MR-ICRC-014", "MR-ICRC-013"], category="ICRC", timeout=10)
def bad_icrc_dropped(t):
    """A WRITE whose ICRC has one bit flipped is dropped silently, neither NAKed nor placed."""
    c = t.connect()
    dropped_silently(t, c, _bad_write(c, bad_icrc=True), ["MR-ICRC-014", "MR-ICRC-013"], "ICRC bit 0 flipped",
                     length=16, counter_name="rx_drop_icrc")


@case("TC-BTH-007-a", rules=["MR-BTH-007"], category="WIRE", timeout=10)
def tver_nonzero_dropped(t):
    """A request with TVer 1 is dropped without a response."""
    c = t.connect()
    dropped_silently(t, c, _bad_write(c, tver=1), ["MR-BTH-007"], "TVer 1", length=16, counter_name="rx_drop_tver")


@case("TC-OPC-003-a", rules=["MR-OPC-003"], category="SEQ", timeout=15)
def unknown_opcodes_dropped(t):
    """Opcodes outside Table 2-1 (0x15, 0x18, 0x1f, 0x64, 0xff) are dropped without a response."""
    c = t.connect()
    for op in (0x15, 0x18, 0x1F, 0x64, 0xFF):
        bad = c.frame(op, ackreq=True, headers=P.RETH(va=c.va, rkey=c.rkey, dlen=16).build(), payload=b"BAD!" * 4)
        dropped_silently(t, c, bad, ["MR-OPC-003"], f"opcode {op:#04x}", length=16,
                         counter_name="rx_drop_opcode")


@case("TC-NAK-002-a", rules=["MR-NAK-002", "MR-NAK-003"], category="ACK", timeout=10)
def future_psn_one_nak(t):
    """Three WRITEs after a gap: one PSN-sequence-error NAK at epsn, the others dropped silently."""
    c = t.connect()
    epsn = c.psn
    frames = [c.write(b"ahead%d" % i, offset=256 + 64 * i, psn=P.psn_add(epsn, 2 + i)) for i in range(3)]
    mark = c.send(*frames)
    got = responses(c, mark, lambda f: f.roce.op == 0x11 and f.roce.ack_kind == "NAK", extra=0.3)
    naks = [f for f in got if f.roce.op == 0x11 and f.roce.ack_kind == "NAK" and f.roce.nak_code == 0]
    exp = f"exactly one ACKNOWLEDGE NAK(0x60) psn={epsn:#08x}, nothing else"
    ok1 = len(naks) >= 1 and naks[0].roce.psn == epsn
    t.check("MR-NAK-002", ok1, f"responses: {describe(got)}", frames=got or [mark + 1], expected=exp)
    t.check("MR-NAK-003", len(got) == 1 and ok1, f"{len(got)} responses to 3 out-of-sequence packets",
            frames=got or [mark + 1], expected=exp)
    placed = any(c.mem(256 + 64 * i, 6) != bytes(6) for i in range(3))
    t.check("MR-NAK-002", not placed, "no out-of-sequence packet was placed" if not placed
            else "an out-of-sequence packet was placed", frames=[mark + 1])
    # epsn unchanged: the WRITE at epsn is accepted and ACKed; nak_sent cleared (MR-NAK-003)
    mark = c.send(c.write(b"inorder", offset=1024))
    ack = expect_ack(c, epsn, mark, ACK_WAIT)
    t.check("MR-NAK-003", ack is not None, "the packet at epsn was then accepted and ACKed" if ack
            else "no ACK for the packet at epsn", frames=[ack] if ack else [mark + 1],
            expected=f"ACKNOWLEDGE ACK psn={epsn:#08x}")


# ---- byte-level edits of a valid frame (untagged IPv4: IP at 14, UDP at 34, BTH at 42) ----------
IP0, UDP0, BTH0 = 14, 34, 42


def _set(frame: bytes, off: int, data: bytes) -> bytes:
    return frame[:off] + data + frame[off + len(data):]


def _u16(frame: bytes, off: int, v: int) -> bytes:
    return _set(frame, off, v.to_bytes(2, "big"))


def _lengths(frame: bytes, ip_len: int | None = None, udp_len: int | None = None) -> bytes:
    n = len(frame) - IP0
    frame = _u16(frame, IP0 + 2, n if ip_len is None else ip_len)
    return _u16(frame, UDP0 + 4, n - 20 if udp_len is None else udp_len)


@case("TC-BTH-010-a", rules=["MR-BTH-010"], category="WIRE", timeout=15)
def pkey_mismatch_dropped(t):
    """Requests with a P_Key outside the QP's partition (0x8001, 0x1234) or the invalid P_Key are dropped."""
    c = t.connect()
    for pkey in (0x8001, 0x1234, 0x0000, 0x8000):
        dropped_silently(t, c, _bad_write(c, pkey=pkey), ["MR-BTH-010"], f"P_Key {pkey:#06x}", length=16,
                         counter_name="rx_drop_pkey")


@case("TC-BTH-010-b", rules=["MR-BTH-010"], category="WIRE", timeout=10)
def pkey_limited_member_accepted(t):
    """P_Key 0x7fff (limited member of the default partition) matches the QP's 0xffff and is accepted."""
    c = t.connect()
    mark = c.send(c.write(b"limited!", offset=64, pkey=0x7FFF))
    ack = expect_ack(c, P.psn_add(c.psn, -1), mark)
    placed = c.mem(64, 8) == b"limited!"
    t.check("MR-BTH-010", ack is not None and placed, f"ACKed: {ack is not None}, placed: {placed}",
            frames=[ack] if ack else [mark + 1], expected="ACKNOWLEDGE ACK for the WRITE with P_Key 0x7fff")


@case("TC-BTH-013-a", rules=["MR-BTH-005", "MR-BTH-011", "MR-BTH-012", "MR-BTH-013"], category="WIRE", timeout=10)
def ignored_bth_bits(t):
    """M, FECN, BECN, Resv6 and Resv7 set in a request are ignored: the WRITE is placed and ACKed."""
    c = t.connect()
    for i, (kw, rules) in enumerate((({"migreq": True}, ["MR-BTH-005"]), ({"fecn": True}, ["MR-BTH-011"]),
                                     ({"becn": True}, ["MR-BTH-012"]), ({"resv6": 0x3F, "resv7": 0x7F},
                                                                       ["MR-BTH-013"]))):
        data = b"bits%04d" % i
        mark = c.send(c.write(data, offset=64 * i, **kw))
        ack = expect_ack(c, P.psn_add(c.psn, -1), mark)
        placed = c.mem(64 * i, len(data)) == data
        for r in rules:
            t.check(r, ack is not None and placed, f"{kw}: ACKed {ack is not None}, placed {placed}",
                    frames=[ack] if ack else [mark + 1], expected="ACKNOWLEDGE ACK, data placed")


@case("TC-OPC-004-a", rules=["MR-OPC-004", "MR-NAT-008"], category="SEQ", timeout=20)
def native_opcodes_on_compat_dropped(t):
    """Native opcodes 0xc0-0xc6 on a compat QP are dropped without a NAK and change nothing."""
    import struct
    c = t.connect()
    reth = P.RETH(va=c.va, rkey=c.rkey, dlen=16).build()
    neth = struct.pack("!IIII", 0xC0 << 24, 0, 16, 0)                     # F, L, MSN 0, offset 0, length 16
    imm = struct.pack("!I", 0x1234)
    layouts = {0xC0: neth, 0xC1: neth + imm, 0xC2: reth + neth, 0xC3: reth + neth + imm, 0xC4: reth + neth,
               0xC5: neth, 0xC6: struct.pack("!I", 0x1F << 24) + struct.pack("!IHHHBB", 0, 0xFFFF, 0, c.sport, 0, 0)}
    for op in P.NATIVE_OPCODES:                 # each laid out as Table 2-1 says (MR-XH-017, MR-XH-026)
        payload = b"" if op in (0xC4, 0xC6) else b"BAD!" * 4
        bad = c.frame(op, ackreq=True, headers=layouts[op], payload=payload)
        dropped_silently(t, c, bad, ["MR-OPC-004", "MR-NAT-008"], f"opcode {op:#04x}", length=16,
                         counter_name="rx_drop_opcode")


@case("TC-BTH-016-a", rules=["MR-BTH-016"], category="WIRE", timeout=10)
def unknown_dest_qp_dropped(t):
    """A WRITE to a QPN no QP has is dropped without a response."""
    c = t.connect()
    for delta in (1, 0x1000):
        other = (c.qpn + delta) & 0xFFFFFF
        dropped_silently(t, c, _bad_write(c, dqpn=other), ["MR-BTH-016"], f"DestQP {other:#08x}", length=16,
                         counter_name="rx_drop_qpn")


@case("TC-BTH-015-a", rules=["MR-BTH-015"], category="WIRE", timeout=10)
def reserved_qpns_dropped(t):
    """Packets to the reserved QPNs 0, 1 and 0xffffff are dropped without a response."""
    c = t.connect()
    for q in (0, 1, 0xFFFFFF):
        dropped_silently(t, c, _bad_write(c, dqpn=q), ["MR-BTH-015"], f"DestQP {q:#08x}", length=16,
                         counter_name="rx_drop_qpn")


@case("TC-ENC-014-a", rules=["MR-ENC-014"], category="WIRE", timeout=15)
def ip_udp_length_mismatch_dropped(t):
    """IPv4 Total Length beyond the frame, UDP Length not Total Length - 20, or below 44: dropped."""
    c = t.connect()
    good = _bad_write(c)
    n = len(good) - IP0
    variants = (("Total Length 8 bytes beyond the frame", _lengths(good, ip_len=n + 8, udp_len=n + 8 - 20)),
                ("UDP Length 4 less than Total Length - 20", _lengths(good, udp_len=n - 20 - 4)),
                ("UDP Length 4 more than Total Length - 20", _lengths(good, udp_len=n - 20 + 4)),
                ("Total Length 40 (no room for BTH and ICRC)", _lengths(good[:IP0 + 40], ip_len=40, udp_len=20)))
    for what, f in variants:
        dropped_silently(t, c, P.refresh(f, icrc_=False), ["MR-ENC-014"], what, length=16,
                         counter_name="rx_drop_len")


@case("TC-ENC-007-a", rules=["MR-ENC-007"], category="WIRE", timeout=10)
def bytes_after_ip_packet_ignored(t):
    """Bytes after the end of the IP packet (Ethernet padding) are ignored: the WRITE is accepted."""
    c = t.connect()
    data = b"padded"
    mark = c.send(c.write(data, offset=32) + b"\xee" * 20)
    ack = expect_ack(c, P.psn_add(c.psn, -1), mark)
    placed = c.mem(32, 8) == data + b"\0\0"
    t.check("MR-ENC-007", ack is not None and placed, f"ACKed {ack is not None}, placed exactly: {placed}",
            frames=[ack] if ack else [mark + 1], expected="ACKNOWLEDGE ACK; 6 bytes placed, nothing more")


@case("TC-ENC-027-a", rules=["MR-ENC-027", "MR-OPC-002"], category="WIRE", timeout=15)
def truncated_headers_and_payload_on_none(t):
    """A RETH cut short, a PadCnt beyond the payload, and a READ REQUEST with payload are dropped."""
    c = t.connect()
    reth = P.RETH(va=c.va, rkey=c.rkey, dlen=16).build()
    cut = c.frame("RDMA_WRITE_ONLY", ackreq=True, headers=reth[:8], payload=b"")
    dropped_silently(t, c, cut, ["MR-ENC-027"], "WRITE ONLY with 8 of the RETH's 16 bytes", length=16,
                     counter_name="rx_drop_len")
    pad = c.frame("SEND_ONLY", ackreq=True, headers=b"", payload=b"", pad=b"", padcount=3)
    dropped_silently(t, c, pad, ["MR-ENC-027"], "SEND ONLY with no payload and PadCnt 3", length=16,
                     counter_name="rx_drop_len")
    rd = c.frame("RDMA_READ_REQUEST", ackreq=True, reth=(c.va, c.rkey, 16), payload=b"XXXX")
    dropped_silently(t, c, rd, ["MR-ENC-027", "MR-OPC-002"], "READ REQUEST with 4 payload bytes", length=16,
                     counter_name="rx_drop_len")


@case("TC-ENC-026-a", rules=["MR-ENC-026"], category="WIRE", timeout=10)
def pad_byte_values_ignored(t):
    """Pad bytes that are not zero are ignored (ICRC correct): 5 bytes placed, no pad byte."""
    c = t.connect()
    mark = c.send(c.write(b"fives", offset=16, pad=b"\xab\xcd\xef"))
    ack = expect_ack(c, P.psn_add(c.psn, -1), mark)
    got = c.mem(16, 8)
    ok = ack is not None and got == b"fives\0\0\0"
    t.check("MR-ENC-026", ok, f"ACKed {ack is not None}, memory {got.hex()}", frames=[ack] if ack else [mark + 1],
            expected="ACKNOWLEDGE ACK; memory 6669766573000000")


@case("TC-ENC-009-a", rules=["MR-ENC-009", "MR-ENC-010", "MR-ENC-013"], category="WIRE", timeout=15)
def ipv4_options_fragments_checksum_dropped(t):
    """IPv4 with options (IHL 6), with MF or a fragment offset, or with a wrong header checksum: dropped."""
    c = t.connect()
    good = _bad_write(c)
    opt = good[:IP0] + bytes([0x46]) + good[IP0 + 1:IP0 + 20] + b"\x01\x01\x01\x00" + good[IP0 + 20:]
    opt = _u16(opt, IP0 + 2, len(opt) - IP0)
    dropped_silently(t, c, P.refresh(opt, icrc_=False), ["MR-ENC-009"], "IHL 6 (4 bytes of options)", length=16,
                     counter_name="rx_drop_ip_options")
    dropped_silently(t, c, P.refresh(_u16(good, IP0 + 6, 0x6000)), ["MR-ENC-010"], "More Fragments", length=16,
                     counter_name="rx_drop_ip_frag")
    # A non-first fragment has no UDP header: a receiver cannot tell it is for port 4791 and may leave it
    # to its IP stack (MR-ENC-032 step 1), so only "not acted upon" is required of it, not the count.
    dropped_silently(t, c, P.refresh(_u16(good, IP0 + 6, 0x4001)), ["MR-ENC-010"], "Fragment Offset 8", length=16)
    f = _u16(good, IP0 + 10, int.from_bytes(good[IP0 + 10:IP0 + 12], "big") ^ 0x0101)
    dropped_silently(t, c, f, ["MR-ENC-013"], "IPv4 header checksum wrong", length=16,
                     counter_name="rx_drop_ip_csum")


@case("TC-ENC-021-a", rules=["MR-ENC-021", "MR-ENC-023", "MR-ECN-006", "MR-ENC-011", "MR-ENC-012", "MR-ENC-006"],
      category="WIRE", timeout=10)
def accepted_variations(t):
    """Any UDP source port, a correct non-zero UDP checksum, any DSCP/ECN (but CE), any IPv4 Identification,
    any TTL and any Ethernet source address are accepted."""
    c = t.connect()
    from scapy.layers.inet import UDP
    from scapy.layers.l2 import Ether

    def csum(f):
        p = Ether(f)
        p[UDP].chksum = None
        return bytes(p)
    variants = ((["MR-ENC-021"], "UDP source port 1", lambda d, o: c.write(d, offset=o, sport=1)),
                (["MR-ENC-021"], "UDP source port 0xbfff", lambda d, o: c.write(d, offset=o, sport=0xBFFF)),
                (["MR-ENC-023"], "correct non-zero UDP checksum", lambda d, o: csum(c.write(d, offset=o))),
                (["MR-ECN-006"], "DSCP 0, Not-ECT", lambda d, o: c.write(d, offset=o, tos=0x00)),
                (["MR-ECN-006"], "DSCP 63, ECT(1)", lambda d, o: c.write(d, offset=o, tos=0xFD)),
                (["MR-ENC-011"], "IPv4 Identification 0xbeef", lambda d, o: c.write(d, offset=o, ip_id=0xBEEF)),
                (["MR-ENC-012"], "TTL 1", lambda d, o: c.write(d, offset=o, ttl=1)),
                (["MR-ENC-006"], "Ethernet source 02:12:34:56:78:9a",
                 lambda d, o: c.write(d, offset=o, src_mac="02:12:34:56:78:9a")))
    for i, (rules, what, mk) in enumerate(variants):
        data = b"var%05d" % i
        mark = c.send(mk(data, 64 * i))
        ack = expect_ack(c, P.psn_add(c.psn, -1), mark)
        placed = c.mem(64 * i, len(data)) == data
        for r in rules:
            t.check(r, ack is not None and placed, f"{what}: ACKed {ack is not None}, placed {placed}",
                    frames=[ack] if ack else [mark + 1], expected="ACKNOWLEDGE ACK, data placed")


@case("TC-ICRC-013-a", rules=["MR-ICRC-013", "MR-ICRC-010"], category="ICRC", timeout=10)
def icrc_wrong_byte_order_dropped(t):
    """The correct ICRC sent most significant byte first is not accepted."""
    c = t.connect()
    f = _bad_write(c)
    f = f[:-4] + f[-4:][::-1]
    if f[-4:] == f[-4:][::-1]:
        raise RuntimeError("palindromic ICRC: rerun")
    dropped_silently(t, c, f, ["MR-ICRC-013", "MR-ICRC-010"], "ICRC byte-swapped", length=16,
                     counter_name="rx_drop_icrc")


@case("TC-ICRC-004-a", rules=["MR-ICRC-004", "MR-ICRC-007", "MR-ICRC-011"], category="ICRC", timeout=10)
def masked_fields_may_change(t):
    """TTL, DSCP and BTH byte 4 changed after the ICRC was computed: still accepted (masked fields)."""
    c = t.connect()
    edits = ((["MR-ICRC-004", "MR-ICRC-011"], "TTL 64 -> 3", lambda f: P.refresh(_set(f, IP0 + 8, b"\x03"), icrc_=False)),
             (["MR-ICRC-004", "MR-ICRC-011"], "DSCP 26 -> 10", lambda f: P.refresh(_set(f, IP0 + 1, b"\x2a"), icrc_=False)),
             (["MR-ICRC-007"], "FECN and BECN set", lambda f: _set(f, BTH0 + 4, bytes([f[BTH0 + 4] | 0xC0]))))
    for i, (rules, what, edit) in enumerate(edits):
        data = b"mask%04d" % i
        mark = c.send(edit(c.write(data, offset=64 * i)))
        ack = expect_ack(c, P.psn_add(c.psn, -1), mark)
        placed = c.mem(64 * i, len(data)) == data
        for r in rules:
            t.check(r, ack is not None and placed, f"{what}: ACKed {ack is not None}, placed {placed}",
                    frames=[ack] if ack else [mark + 1], expected="ACKNOWLEDGE ACK, data placed")


@case("TC-ICRC-006-a", rules=["MR-ICRC-006", "MR-ICRC-008"], category="ICRC", timeout=10)
def covered_fields_break_the_icrc(t):
    """A UDP source port or a payload byte changed after the ICRC was computed: dropped silently."""
    c = t.connect()
    f = _bad_write(c)
    dropped_silently(t, c, _u16(f, UDP0, int.from_bytes(f[UDP0:UDP0 + 2], "big") ^ 1), ["MR-ICRC-006"],
                     "UDP source port changed", length=16, counter_name="rx_drop_icrc")
    f = _bad_write(c)
    dropped_silently(t, c, _set(f, len(f) - 6, b"?"), ["MR-ICRC-008"], "a payload byte changed", length=16,
                     counter_name="rx_drop_icrc")


@case("TC-ENC-005-a", rules=["MR-ENC-005", "MR-ENC-006", "MR-ICRC-009"], category="WIRE", timeout=10)
def vlan_tagged_accepted(t):
    """A priority-tagged frame (VID 0) is accepted; a frame of a VLAN the IUT is not configured for (7, 4000)
    is accepted or left to the host stack, never answered otherwise (MR-ENC-005 as revised); the VID does not
    select the QP, and the tag is not covered by the ICRC (computed over the untagged packet)."""
    for i, vid in enumerate((0, 7, 4000)):
        c = t.connect()                                    # a fresh QP: an ignored frame leaves a PSN gap
        data = b"vlan%04d" % vid
        mark = c.send(c.write(data, offset=64 * i, vlan=vid))
        ack = expect_ack(c, P.psn_add(c.psn, -1), mark)
        placed = c.mem(64 * i, len(data)) == data
        ok = ack is not None and placed
        if vid and not ok:                                 # not configured for this VLAN: ignored entirely
            ok = not placed and not c.quiet(0.2, after=mark)
        for r in ("MR-ENC-005", "MR-ENC-006", "MR-ICRC-009"):
            t.check(r, ok, f"VID {vid}: ACKed {ack is not None}, placed {placed}",
                    frames=[ack] if ack else [mark + 1],
                    expected="ACKNOWLEDGE ACK, data placed" + (" (or, VLAN not configured: no response, nothing "
                                                               "placed)" if vid else ""))


@case("TC-ENC-005-b", rules=["MR-ENC-005"], category="WIRE", timeout=10)
def qinq_not_metaroce(t):
    """A frame with an 802.1ad (0x88a8) outer tag, or two 802.1Q tags, is not processed as MetaRoCE."""
    c = t.connect()
    f = _bad_write(c)
    for what, tag in (("802.1ad outer tag", b"\x88\xa8\x00\x05\x81\x00\x00\x07"),
                      ("two 802.1Q tags", b"\x81\x00\x00\x05\x81\x00\x00\x07")):
        dropped_silently(t, c, f[:12] + tag + f[12:], ["MR-ENC-005"], what, length=16)


def _never_answered(t, c, frames_and_what, rules, counter_name=None):
    """Each frame must get no response at all (no ACK, NAK or CNP) and change nothing; afterwards the
    packet at epsn is accepted (the PSN state did not move)."""
    from ._common import QUIET, counter
    for bad, what in frames_and_what:
        n0 = counter(t, counter_name)
        mark = c.send(bad)
        seen = c.t.lt.collect(lambda f: not f.outgoing and f.roce is not None, QUIET, after=mark)
        n1 = counter(t, counter_name)
        counted = n0 is None or (n1 is not None and n1 > n0)
        cnt = "" if counter_name is None else (f"; {counter_name} +{n1 - n0}" if n0 is not None
                                               else f"; {counter_name} not reported")
        for r in rules:
            t.check(r, not seen and counted, f"{what}: responses {describe(seen)}{cnt}", frames=seen or [mark + 1],
                    expected="no frame at all from the IUT" + (f", {counter_name} incremented" if counter_name else ""))
    untouched = c.mem(0, 64) == bytes(64)
    mark = c.send(c.write(b"in order", offset=512))
    ack = expect_ack(c, P.psn_add(c.psn, -1), mark)
    for r in rules:
        t.check(r, untouched and ack is not None, f"memory untouched {untouched}; the packet at epsn then ACKed "
                f"{ack is not None}", frames=[ack] if ack else [mark + 1],
                expected=f"ACKNOWLEDGE ACK psn={P.psn_add(c.psn, -1):#08x}")


@case("TC-ICRC-014-b", rules=["MR-ICRC-014", "MR-ECN-007"], category="ICRC", timeout=15)
def bad_icrc_never_answered(t):
    """A bad ICRC is never answered, whatever else the packet would cause: a future PSN (no sequence NAK),
    a duplicate PSN (no ACK), a READ REQUEST (no response), a CE mark (no CNP)."""
    c = t.connect()
    p0 = c.psn
    m = c.send(c.write(b"base", offset=1024))
    expect_ack(c, p0, m)
    frames = [
        (c.frame("RDMA_WRITE_ONLY", psn=P.psn_add(c.psn, 5), ackreq=True, reth=(c.va, c.rkey, 16),
                 payload=b"BAD!" * 4, bad_icrc=True), "future PSN"),
        (c.frame("RDMA_WRITE_ONLY", psn=p0, ackreq=True, reth=(c.va, c.rkey, 16), payload=b"BAD!" * 4,
                 bad_icrc=True), "duplicate PSN"),
        (c.frame("RDMA_READ_REQUEST", ackreq=True, reth=(c.va, c.rkey, 16), bad_icrc=True), "READ REQUEST"),
        (c.frame("RDMA_WRITE_ONLY", ackreq=True, reth=(c.va, c.rkey, 16), payload=b"BAD!" * 4, tos=0x6B,
                 bad_icrc=True), "CE-marked"),
    ]
    _never_answered(t, c, frames, ["MR-ICRC-014"], "rx_drop_icrc")
    # MR-ECN-007: only a packet that passed every check counts as CE-marked.  The CE-marked frame with a bad
    # ICRC drew no CNP (above); the same frame with a good ICRC must draw one (MR-CNP-002), or the silence
    # above proves nothing.
    mark = c.send(c.write(b"ce", offset=2048, tos=0x6B))
    cnp = c.expect(1, ACK_WAIT, after=mark, match=lambda f: f.roce.op == 0x81)
    if cnp:
        t.check("MR-ECN-007", True, "no CNP for the bad-ICRC CE frame; a CNP for the valid one", frames=cnp)
    else:
        t.undecided("MR-ECN-007", "no CNP for a valid CE-marked packet either: this case cannot tell")


@case("TC-ENC-032-a", rules=["MR-ENC-032", "MR-BTH-022"], category="WIRE", timeout=15)
def failed_checks_at_future_psn_never_naked(t):
    """Packets that fail a header check (TVer, opcode, length, P_Key, ICRC) at a future PSN are dropped
    before the PSN check: no sequence-error NAK, no state change."""
    c = t.connect()
    fut = P.psn_add(c.psn, 3)

    def w(**kw):
        return c.frame("RDMA_WRITE_ONLY", psn=fut, ackreq=True, reth=(c.va, c.rkey, 16), payload=b"BAD!" * 4, **kw)
    good = w()
    n = len(good) - IP0
    frames = [(w(tver=1), "TVer 1"), (c.frame(0x1F, psn=fut, ackreq=True, payload=b"BAD!"), "opcode 0x1f"),
              (P.refresh(_lengths(good, udp_len=n - 24), icrc_=False), "UDP Length short by 4"),
              (w(pkey=0x1234), "P_Key 0x1234"), (w(bad_icrc=True), "ICRC wrong"),
              (w(dqpn=(c.qpn + 7) & 0xFFFFFF), "unknown DestQP")]
    _never_answered(t, c, frames, ["MR-ENC-032", "MR-BTH-022"])


@case("TC-SEC-009-a", rules=["MR-SEC-009"], category="SEC", timeout=10)
def request_from_another_address_dropped(t):
    """A valid request from an IP address other than the QP's peer is discarded and counted, not answered."""
    import ipaddress
    c = t.connect()
    other = str(ipaddress.ip_address(t.lt_ip) + 1)
    if other == t.iut_ip:
        other = str(ipaddress.ip_address(t.lt_ip) + 2)
    dropped_silently(t, c, _bad_write(c, src_ip=other), ["MR-SEC-009"], f"source {other}", length=16,
                     counter_name="rx_drop_wrong_peer")
