"""The codec at work: build, decode and verify a few MetaRoCE packets.

Builds one packet of each kind a WRITE/READ/SEND/ATOMIC exchange uses, plus a
native SACK, decodes each back, corrupts one to show the ICRC catching it,
and writes them all to a pcap that Wireshark/tshark opens as RoCEv2.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

from rich.console import Console
from rich.table import Table

from metaroce_xdp.wire import (AETH, NETH, RETH, SACKETH, AtomicAckETH, AtomicETH, ImmDt, Op,
                               decode, encode)


def packets() -> list[tuple[str, bytes]]:
    qa, qb = 0x000011, 0x000012
    return [
        ("requester writes 16 bytes", encode(Op.RDMA_WRITE_ONLY, dest_qp=qb, psn=0x100, ack_req=1,
            headers={"reth": RETH(va=0x7F0000001000, rkey=0x2A0001, dma_len=16)}, payload=b"MetaRoCE rocks!\n")),
        ("responder ACKs it", encode(Op.ACKNOWLEDGE, dest_qp=qa, psn=0x100, src_ip="10.55.0.2",
            dst_ip="10.55.0.1", headers={"aeth": AETH(syndrome=0x1F, msn=1)})),
        ("requester reads 4 KiB", encode(Op.RDMA_READ_REQUEST, dest_qp=qb, psn=0x101, ack_req=1,
            headers={"reth": RETH(va=0x7F0000002000, rkey=0x2A0001, dma_len=4096)})),
        ("READ response, first of 4", encode(Op.RDMA_READ_RESPONSE_FIRST, dest_qp=qa, psn=0x101,
            src_ip="10.55.0.2", dst_ip="10.55.0.1", headers={"aeth": AETH(syndrome=0x1F, msn=1)},
            payload=bytes(1024))),
        ("SEND with immediate", encode(Op.SEND_ONLY_WITH_IMMEDIATE, dest_qp=qb, psn=0x105, se=1,
            headers={"immdt": ImmDt(imm=0xC0FFEE)}, payload=b"hello")),
        ("RNR NAK (no receive posted)", encode(Op.ACKNOWLEDGE, dest_qp=qa, psn=0x105, src_ip="10.55.0.2",
            dst_ip="10.55.0.1", headers={"aeth": AETH(syndrome=0x20 | 14, msn=1)})),
        ("FetchAdd +1", encode(Op.FETCH_ADD, dest_qp=qb, psn=0x106, ack_req=1,
            headers={"atomiceth": AtomicETH(va=0x7F0000003000, rkey=0x2A0001, swap_add=1)})),
        ("its ATOMIC ACK", encode(Op.ATOMIC_ACKNOWLEDGE, dest_qp=qa, psn=0x106, src_ip="10.55.0.2",
            dst_ip="10.55.0.1", headers={"aeth": AETH(syndrome=0x1F, msn=3), "atomicacketh": AtomicAckETH(orig=41)})),
        ("CNP (congestion)", encode(Op.CNP, dest_qp=qa, becn=1, src_ip="10.55.0.2", dst_ip="10.55.0.1")),
        ("native WRITE, last packet", encode(Op.NATIVE_WRITE, dest_qp=qb, psn=0x200, sport=50001,
            headers={"reth": RETH(va=0x7F0000004000, rkey=0x2A0001, dma_len=8192),
                     "neth": NETH(flags=0x40, msn=9, offset=7168, msg_len=8192, tsval=123456)}, payload=bytes(1024))),
        # cumulative PSN 0x1FF, 0x200 missing, 0x201-0x205 received: bit 0 is 0x201 (MR-XH-029)
        ("native SACK with a hole", encode(Op.NATIVE_SACK, dest_qp=qa, psn=0x1FF, src_ip="10.55.0.2",
            dst_ip="10.55.0.1", headers={"aeth": AETH(syndrome=0x1F, msn=8),
            "sacketh": SACKETH(tsecr=123456, credit=64, echo_sport=50001, bitmap_words=1)}, sack_bitmap=(0xF8000000,))),
    ]


def main() -> int:
    con = Console()
    con.rule("[bold]MetaRoCE codec demo[/bold]")
    con.print("The endpoint is not built yet: this shows the wire codec only.\n")
    t = Table(show_lines=False)
    for col in ("#", "what", "opcode", "QP", "PSN", "bytes", "headers", "ICRC"):
        t.add_column(col)
    frames = packets()
    ok = True
    for i, (what, f) in enumerate(frames, 1):
        p = decode(f)
        hdrs = " ".join(p.ext) or "-"
        ok &= bool(p.icrc_ok)
        t.add_row(str(i), what, p.op.name, f"{p.bth.dest_qp:#08x}", str(p.bth.psn), str(len(f)), hdrs,
                  "[green]ok[/green]" if p.icrc_ok else "[red]BAD[/red]")
    con.print(t)
    bad = bytearray(frames[0][1])
    bad[60] ^= 0x40
    caught = decode(bytes(bad)).icrc_ok is False
    con.print(f"flip one payload bit of packet 1 -> ICRC {'[green]catches it[/green]' if caught else '[red]MISSES it[/red]'}")
    sack = decode(frames[-1][1])
    con.print(f"SACK: cumulative PSN {sack.bth.psn:#x}, also received {[hex(x) for x in sack.sack_received_psns()]}")
    out = os.path.join(tempfile.gettempdir(), "metaroce-codec-demo.pcap")
    from scapy.layers.l2 import Ether
    from scapy.utils import wrpcap
    wrpcap(out, [Ether(f) for _, f in frames] + [Ether(bytes(bad))])
    con.print(f"wrote {out}  (try: metaroce decode {out}  or  tshark -r {out})")
    if shutil.which("tshark"):
        r = subprocess.run(["tshark", "-r", out, "-T", "fields", "-e", "frame.number", "-e", "_ws.col.Protocol",
                            "-e", "_ws.col.Info"], capture_output=True, text=True, timeout=60)
        con.print("[dim]tshark's view:[/dim]")
        for line in r.stdout.splitlines()[:6]:
            con.print("  " + line)
    ok &= caught
    con.rule("[green]all packets verified[/green]" if ok else "[red]verification failed[/red]")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
