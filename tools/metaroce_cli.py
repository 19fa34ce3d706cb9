"""The `metaroce` command.

    metaroce decode capture.pcap            # readable, one line per packet
    metaroce decode --json capture.pcap     # one JSON object per packet
    metaroce decode --hex '02 00 00 ...'    # a frame given as hex

Subcommands are added as the endpoint grows (perf, pingpong, qp, ...).
"""
from __future__ import annotations

import sys
from typing import List, Optional

import typer

from . import decode as decode_mod

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="MetaRoCE: RDMA over plain Ethernet -- tools for the reference endpoint.")


@app.callback()
def _root() -> None:
    """MetaRoCE: RDMA over plain Ethernet -- tools for the reference endpoint."""


@app.command("decode")
def decode_cmd(
    pcap: Optional[str] = typer.Argument(None, metavar="[FILE.pcap]", help="pcap or pcapng capture"),
    hex_: Optional[List[str]] = typer.Option(None, "--hex", "-x", help="a frame as hex (repeatable)"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per packet"),
    show_all: bool = typer.Option(False, "--all", "-a", help="also list frames that are not MetaRoCE"),
    strict: bool = typer.Option(False, "--strict", help="exit 1 if any packet is malformed or has a bad ICRC"),
) -> None:
    """Decode MetaRoCE (RoCEv2) packets: headers, fields and ICRC verdict."""
    if (pcap is None) == (not hex_):
        typer.echo("error: give either a capture file or --hex HEX (not both, not neither)", err=True)
        raise typer.Exit(2)
    try:
        if hex_:
            frames = [decode_mod.parse_hex(h) for h in hex_]
        else:
            frames = decode_mod.read_pcap(pcap)  # type: ignore[arg-type]
        s = decode_mod.run(frames, sys.stdout, as_json, show_all)
    except decode_mod.InputError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    if not as_json:
        typer.echo(decode_mod.summary_line(s), err=True)
    if strict and (s.malformed or s.icrc_bad):
        raise typer.Exit(1)


def main() -> None:
    app(prog_name="metaroce")


if __name__ == "__main__":
    main()
