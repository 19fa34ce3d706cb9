"""The C headers in bpf/ and their Python mirrors say the same thing (STYLE habit 1).

A small C program, generated from the Python side, includes the real headers,
is compiled with gcc and prints sizeof/offsetof of every mr_qp_state and
mr_config field, every enum value and the whole opcode table; the output is
compared with metaroce_xdp/kern/layout.py and metaroce_xdp/wire (OpMask,
header sizes, opcode table, DecodeReason).  Names are also parsed from the
headers so that a reason added on one side only is caught.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from metaroce_xdp.kern import layout
from metaroce_xdp.wire import headers as H
from metaroce_xdp.wire.errors import DecodeReason
from metaroce_xdp.wire.opcodes import OPCODES, OpMask

BPF = Path(__file__).resolve().parents[2] / "bpf"

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

HDR_LENS = {"BTH": H.BTH, "RETH": H.RETH, "AETH": H.AETH, "ATOMICETH": H.AtomicETH,
            "ATOMICACKETH": H.AtomicAckETH, "IMMDT": H.ImmDt, "IETH": H.IETH, "NETH": H.NETH,
            "RSNETH": H.RSNETH, "SACKETH": H.SACKETH, "CNP": H.CNPPad}
WIRE_STRUCTS = {"mr_bth": H.BTH, "mr_reth": H.RETH, "mr_aeth": H.AETH, "mr_atomiceth": H.AtomicETH,
                "mr_atomicacketh": H.AtomicAckETH, "mr_immdt": H.ImmDt, "mr_ieth": H.IETH,
                "mr_neth": H.NETH, "mr_rsneth": H.RSNETH, "mr_sacketh": H.SACKETH, "mr_cnp_pad": H.CNPPad}


def _header_names(prefix: str, filename: str) -> dict[str, int]:
    text = (BPF / filename).read_text()
    return {m.group(1): int(m.group(2), 0) for m in re.finditer(rf"\b{prefix}(\w+)\s*=\s*(\w+)\s*,", text)}


@pytest.fixture(scope="module")
def c_facts(tmp_path_factory) -> dict[str, int]:
    lines = []

    def p(key: str, expr: str) -> None:
        lines.append(f'\tprintf("%s %llu\\n", "{key}", (unsigned long long)({expr}));')

    for struct, dtype in (("mr_qp_state", layout.QP_STATE_DTYPE), ("mr_config", layout.CONFIG_DTYPE),
                          ("mr_sack_rec", layout.SACK_REC_DTYPE), ("mr_sack_ring", layout.SACK_RING_DTYPE)):
        p(f"sizeof.{struct}", f"sizeof(struct {struct})")
        for name in dtype.names:
            p(f"offsetof.{struct}.{name}", f"offsetof(struct {struct}, {name})")
            p(f"sizeof.{struct}.{name}", f"sizeof(((struct {struct} *)0)->{name})")
    for s in WIRE_STRUCTS:
        p(f"sizeof.{s}", f"sizeof(struct {s})")
    for name in _header_names("MR_DROP_", "metaroce_drop_reasons.h"):
        p(f"drop.{name}", f"MR_DROP_{name}")
    for name in _header_names("MR_EV_", "metaroce_drop_reasons.h"):
        p(f"event.{name}", f"MR_EV_{name}")
    for name in _header_names("MR_QPS_", "metaroce_structs.h"):
        p(f"qps.{name}", f"MR_QPS_{name}")
    p("drop._MAX", "MR_DROP__MAX")
    p("event._MAX", "MR_EV__MAX")
    for m in OpMask:
        p(f"opm.{m.name}", f"MR_OPM_{m.name}")
    for n in HDR_LENS:
        p(f"len.{n}", f"MR_{n}_LEN")
    for c in ("MR_MAX_QPS", "ROCE_UDP_PORT", "MR_MAX_RXQ", "MR_DROP_SLOTS", "MR_EVENT_SLOTS",
              "MR_PROFILE_COMPAT", "MR_PROFILE_NATIVE", "MR_QPF_ACK_TO_USER", "MR_CFG_HAVE_IP4",
              "MR_CFG_HAVE_IP6", "MR_CFG_HAVE_MAC", "MR_SACK_MAX_WORDS", "MR_PSN_MASK", "MR_PSN_NONE",
              "MR_SACK_RINGS", "MR_SACK_RING_LEN", "MR_SACK_RAW_MAX"):
        p(f"const.{c}", c)
    src = "\n".join([
        "#include <stdio.h>", "#include <stddef.h>",
        '#include "metaroce_consts.h"', '#include "metaroce_hdr.h"',
        '#include "metaroce_drop_reasons.h"', '#include "metaroce_structs.h"',
        "int main(void) {", *lines,
        "\tfor (unsigned op = 0; op < 256; op++) {",
        "\t\t__u32 mask; int len = mr_opcode_info(op, &mask);",
        '\t\tprintf("op.%u %lld\\n", op, len < 0 ? -1LL : ((long long)mask << 16) | len);',
        "\t}", "\treturn 0;", "}"])
    d = tmp_path_factory.mktemp("cagree")
    (d / "facts.c").write_text(src)
    subprocess.run(["gcc", "-std=gnu11", "-Wall", "-Werror", f"-I{BPF}", "-o", str(d / "facts"),
                    str(d / "facts.c")], check=True, capture_output=True, text=True)
    out = subprocess.run([str(d / "facts")], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (ln.split() for ln in out.splitlines())}


@pytest.mark.parametrize("struct,dtype", [("mr_qp_state", layout.QP_STATE_DTYPE),
                                          ("mr_config", layout.CONFIG_DTYPE),
                                          ("mr_sack_rec", layout.SACK_REC_DTYPE),
                                          ("mr_sack_ring", layout.SACK_RING_DTYPE)])
def test_struct_layout_matches_dtype(c_facts, struct, dtype):
    assert c_facts[f"sizeof.{struct}"] == dtype.itemsize
    for name in dtype.names:
        off = dtype.fields[name][1]
        assert c_facts[f"offsetof.{struct}.{name}"] == off, f"{struct}.{name} offset"
        assert c_facts[f"sizeof.{struct}.{name}"] == dtype.fields[name][0].itemsize, f"{struct}.{name} size"


def test_qp_state_fields_documented_and_grouped_by_writer():
    """Each writer owns one contiguous range; the C comment names the same ranges."""
    ranges = {}
    for name, _, writer in layout.QP_STATE_FIELDS:
        off = layout.QP_STATE_DTYPE.fields[name][1]
        end = off + layout.QP_STATE_DTYPE.fields[name][0].itemsize
        lo, hi = ranges.get((writer, name == "sack_rsvd"), (off, end))
        ranges[(writer, name == "sack_rsvd")] = (min(lo, off), max(hi, end))
    assert ranges[("control", False)] == (0, 40)
    assert ranges[("requester", False)] == (40, 64)
    assert ranges[("kernel", False)] == (64, 192)
    assert ranges[("kernel", True)] == (192, 256)
    text = (BPF / "metaroce_structs.h").read_text()
    for name in layout.QP_STATE_DTYPE.names:
        assert re.search(rf"\b{name}\b.*;\s*/\*", text), f"field {name} has no comment in C"


def test_drop_reasons_agree(c_facts):
    c_names = set(_header_names("MR_DROP_", "metaroce_drop_reasons.h")) - {"_MAX"}
    assert c_names == {r.name for r in layout.DropReason}
    for r in layout.DropReason:
        assert c_facts[f"drop.{r.name}"] == int(r), r.name
    assert c_facts["drop._MAX"] <= c_facts["const.MR_DROP_SLOTS"] == layout.MR_DROP_SLOTS


def test_drop_reasons_start_with_decode_reasons(c_facts):
    """Codec and kernel give one answer to 'why was this refused' (same numbers)."""
    for r in DecodeReason:
        if r is DecodeReason.OK:
            continue
        assert c_facts[f"drop.{r.name}"] == int(r)
        assert layout.DropReason[r.name] == int(r)
    kernel_only = [r for r in layout.DropReason if r.name not in DecodeReason.__members__ and r.name != "NONE"]
    assert min(kernel_only) >= 32, "kernel-only reasons start at 32, above the codec range"


def test_events_and_states_agree(c_facts):
    c_events = set(_header_names("MR_EV_", "metaroce_drop_reasons.h")) - {"_MAX"}
    assert c_events == {e.name for e in layout.Event}
    for e in layout.Event:
        assert c_facts[f"event.{e.name}"] == int(e)
    assert c_facts["event._MAX"] <= layout.MR_EVENT_SLOTS == c_facts["const.MR_EVENT_SLOTS"]
    for s in layout.QpState:
        assert c_facts[f"qps.{s.name}"] == int(s)
    assert c_facts["const.MR_PROFILE_COMPAT"] == layout.Profile.COMPAT
    assert c_facts["const.MR_PROFILE_NATIVE"] == layout.Profile.NATIVE
    assert c_facts["const.MR_QPF_ACK_TO_USER"] == layout.QpFlag.ACK_TO_USER
    for f in layout.CfgFlag:
        assert c_facts[f"const.MR_CFG_{f.name}"] == int(f)


def test_constants_agree(c_facts):
    assert c_facts["const.MR_MAX_QPS"] == layout.MR_MAX_QPS == 1024
    assert c_facts["const.ROCE_UDP_PORT"] == layout.ROCE_UDP_PORT == H.ROCE_UDP_PORT
    assert c_facts["const.MR_MAX_RXQ"] == layout.MR_MAX_RXQ
    assert c_facts["const.MR_SACK_MAX_WORDS"] == H.SACK_MAX_WORDS
    assert c_facts["const.MR_PSN_MASK"] == layout.PSN_MASK
    assert c_facts["const.MR_PSN_NONE"] == layout.PSN_NONE
    assert c_facts["const.MR_SACK_RINGS"] == layout.MR_SACK_RINGS
    assert c_facts["const.MR_SACK_RING_LEN"] == layout.MR_SACK_RING_LEN
    assert c_facts["const.MR_SACK_RAW_MAX"] == layout.SACK_RAW_MAX


def test_opmask_bits_agree(c_facts):
    for m in OpMask:
        assert c_facts[f"opm.{m.name}"] == int(m), m.name
    text = (BPF / "metaroce_hdr.h").read_text()
    assert set(re.findall(r"#define MR_OPM_(\w+)", text)) == {m.name for m in OpMask}


def test_header_sizes_agree(c_facts):
    for name, cls in HDR_LENS.items():
        assert c_facts[f"len.{name}"] == cls.SIZE, name
    for s, cls in WIRE_STRUCTS.items():
        assert c_facts[f"sizeof.{s}"] == cls.SIZE, s


def test_opcode_table_agrees(c_facts):
    """All 256 opcodes: same set known, same mask, same fixed header length."""
    for op in range(256):
        v = c_facts[f"op.{op}"]
        info = OPCODES.get(op)
        if info is None:
            assert v == -1, f"C knows opcode {op:#04x}, Python does not"
            continue
        assert v != -1, f"Python knows {info.name}, C does not"
        assert v >> 16 == int(info.mask), f"{info.name} mask"
        assert v & 0xFFFF == info.hdr_len, f"{info.name} header length"


def test_opcode_names_agree():
    text = (BPF / "metaroce_hdr.h").read_text()
    rows = {int(v, 16): n for v, n in re.findall(r"X\((0x[0-9A-Fa-f]{2}),\s*(\w+),", text)}
    assert rows == {v: o.name for v, o in OPCODES.items()}
