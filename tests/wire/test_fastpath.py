"""The compiled frame builder and ICRC (data path) against the reference codec."""
from __future__ import annotations

import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metaroce_xdp.wire import OPCODES, RETH, decode, encode
from metaroce_xdp.wire.fastpath import BTH_SE, TABLES, build_frame, icrc_ok_at, make_template
from metaroce_xdp.wire.hdr import parse_frame
from metaroce_xdp.wire.icrc import crc32_bulk, crc32_update
from strategies import packet_args

pytestmark = pytest.mark.compiles      # its own argument types (conftest: jitwarm.unsealed)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=3000), st.integers(0, 2**32 - 1))
def test_crc32_matches_zlib(data, seed):
    arr = np.frombuffer(data, dtype=np.uint8)
    assert crc32_update(TABLES, 0, arr, 0, len(arr)) == zlib.crc32(data)
    half = len(data) // 2
    c = crc32_update(TABLES, 0, arr, 0, half)
    assert crc32_update(TABLES, c, arr, half, len(arr)) == zlib.crc32(data)
    # the compiled call into zlib's own crc32 (the data path's bulk CRC)
    c = crc32_bulk(arr, 0, half, 0)
    assert crc32_bulk(arr, half, len(arr), c) == zlib.crc32(data)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packet_args(), st.integers(0, 64))
def test_build_frame_matches_reference(case, out_off):
    opcode, kw = case
    if "sacketh" in OPCODES[opcode].headers or opcode == 0x81:
        return  # data-path builder: SACK/CNP are built by the reference encoder
    kw = dict(kw, df=True, ident=0)
    ref = encode(opcode, **kw)
    tkw = {k: kw[k] for k in ("src_mac", "dst_mac", "src_ip", "dst_ip", "sport", "dest_qp", "pkey",
                              "dscp", "ecn", "ttl", "fecn", "becn") }
    tkw["vlan"] = kw.get("vlan")
    if "flow_label" in kw:
        tkw["flow_label"] = kw["flow_label"]
    t = make_template(**tkw)
    ext = b"".join(kw["headers"][h].pack() for h in OPCODES[opcode].headers)
    ext_a = np.frombuffer(ext, dtype=np.uint8) if ext else np.zeros(1, np.uint8)
    pay = np.frombuffer(b"\xEE" * 5 + kw["payload"], dtype=np.uint8)
    out = np.full(4096, 0x5A, dtype=np.uint8)
    flags = (BTH_SE if kw["se"] else 0) | (0x40 if kw["m"] else 0)
    n = build_frame(TABLES, out, out_off, t.buf, t.length, t.l3_off, t.ipv6, opcode, flags,
                    kw["ack_req"], kw["psn"], ext_a, len(ext), pay, 5, len(kw["payload"]))
    got = bytes(out[out_off:out_off + n])
    assert got.hex() == ref.hex()
    r = parse_frame(out, out_off, n)
    assert r[0] == opcode
    assert icrc_ok_at(TABLES, out, r[2], r[5])
    out[out_off + n - 5] ^= 0x10
    assert not icrc_ok_at(TABLES, out, r[2], r[5])


def test_fastpath_without_jit():
    """STYLE 6: hot functions are also tested as plain Python (NUMBA_DISABLE_JIT=1)."""
    env = dict(os.environ, NUMBA_DISABLE_JIT="1")
    here = os.path.dirname(__file__)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "--hypothesis-seed=1", "-k", "matches", os.path.join(here, "test_fastpath.py")],
                       env=env, capture_output=True, text=True, timeout=600,
                       cwd=os.path.dirname(os.path.dirname(here)))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
