"""Hypothesis strategies shared by the codec tests."""
from __future__ import annotations

from hypothesis import strategies as st

from metaroce_xdp.wire import OPCODES, OpMask
from metaroce_xdp.wire.headers import (AETH, IETH, NETH, RETH, RSNETH, SACKETH, AtomicAckETH, AtomicETH,
                                       ImmDt, Vlan)

COMPAT_OPCODES = sorted(o for o, i in OPCODES.items() if not i.has(OpMask.NATIVE))
ALL_OPCODES = sorted(OPCODES)

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u24 = st.integers(0, 0xFFFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, 2**64 - 1)
bit = st.integers(0, 1)

mac = st.integers(0, 2**48 - 1).map(lambda v: ":".join(f"{b:02x}" for b in v.to_bytes(6, "big")))
ipv4 = st.integers(1, 2**32 - 2).map(lambda v: ".".join(str(b) for b in v.to_bytes(4, "big")))
ipv6 = st.integers(1, 2**128 - 2).map(lambda v: __import__("ipaddress").IPv6Address(v).compressed)


def ext_header(name: str):
    return {
        "reth": st.builds(RETH, va=u64, rkey=u32, dma_len=u32),
        "aeth": st.builds(AETH, syndrome=u8, msn=u24),
        "atomiceth": st.builds(AtomicETH, va=u64, rkey=u32, swap_add=u64, compare=u64),
        "atomicacketh": st.builds(AtomicAckETH, orig=u64),
        "immdt": st.builds(ImmDt, imm=u32),
        "ieth": st.builds(IETH, rkey=u32),
        "neth": st.builds(NETH, flags=st.sampled_from([0, 0x80, 0x40, 0xC0, 0x20]), msn=u24,
                          offset=u32, msg_len=u32, tsval=u32),
        "rsneth": st.builds(RSNETH, rsn=u24),
    }[name]


@st.composite
def packet_args(draw, opcodes=ALL_OPCODES, v6=None):
    """Keyword arguments for metaroce_xdp.wire.encode, describing one valid packet."""
    opcode = draw(st.sampled_from(opcodes))
    op = OPCODES[opcode]
    use_v6 = draw(st.booleans()) if v6 is None else v6
    headers = {}
    bitmap = ()
    for h in op.headers:
        if h == "cnp":
            continue
        if h == "sacketh":
            bitmap = tuple(draw(st.lists(u32, max_size=4)))
            headers[h] = draw(st.builds(SACKETH, tsecr=u32, credit=u16, ce_count=u16, echo_sport=u16,
                                        bitmap_words=st.just(len(bitmap)),
                                        flags=st.sampled_from([0, 0x80]))) 
            continue
        headers[h] = draw(ext_header(h))
    payload = draw(st.binary(max_size=300)) if op.has(OpMask.PAYLOAD) else b""
    kw = dict(
        src_mac=draw(mac), dst_mac=draw(mac),
        src_ip=draw(ipv6 if use_v6 else ipv4), dst_ip=draw(ipv6 if use_v6 else ipv4),
        sport=draw(u16), dest_qp=draw(u24), psn=draw(u24), ack_req=draw(bit), se=draw(bit),
        m=draw(bit), pkey=draw(u16), fecn=draw(bit), becn=draw(bit), payload=payload,
        headers=headers, sack_bitmap=bitmap, dscp=draw(st.integers(0, 63)), ecn=draw(st.integers(0, 3)),
        ttl=draw(st.integers(1, 255)), ident=draw(u16), df=draw(st.booleans()),
    )
    if use_v6:
        kw["flow_label"] = draw(st.integers(0, 2**20 - 1))
    if draw(st.integers(0, 4)) == 0:
        kw["vlan"] = Vlan(pcp=draw(st.integers(0, 7)), dei=0, vid=draw(st.integers(1, 4094)))
    return opcode, kw
