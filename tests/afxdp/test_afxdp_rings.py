"""AF_XDP ring logic without a kernel: metaroce_xdp.afxdp.rings on plain numpy arrays.

A FakeKernel plays the kernel's half of the four rings (consume fill, produce RX, consume
TX, produce completion) so every burst function is checked against the protocol, including
u32 index wrap-around.  The whole file runs twice: jitted (this process) and interpreted
(test_same_tests_pass_without_jit re-runs it with NUMBA_DISABLE_JIT=1).  The uapi test
checks our copy of linux/if_xdp.h against the installed header.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from collections import Counter, deque
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metaroce_xdp.afxdp import rings, uapi
from metaroce_xdp.afxdp.rings import FramePool

FRAME = 2048
HEADROOM = 256  # the offset a copy-mode kernel puts data at, inside the chunk
U32 = 1 << 32
NESTED = "METAROCE_RINGS_NESTED"
pytestmark = pytest.mark.compiles      # its own argument types (conftest: jitwarm.unsealed)


class Ring:
    """A ring as xsk.Ring exposes it, but on private arrays."""

    def __init__(self, size: int, start: int, desc: bool):
        self.size = size
        self.producer = np.array([start % U32], np.uint32)
        self.consumer = np.array([start % U32], np.uint32)
        self.flags = np.zeros(1, np.uint32)
        self.addrs = None if desc else np.zeros(size, np.uint64)
        self.descs = np.zeros((size, 2), np.uint64) if desc else None

    def count(self) -> int:
        return (int(self.producer[0]) - int(self.consumer[0])) % U32

    def entries(self) -> list[int]:
        """Addresses currently in flight on this ring, oldest first."""
        c, m = int(self.consumer[0]), self.size - 1
        arr = self.addrs if self.addrs is not None else self.descs[:, 0]
        return [int(arr[(c + i) & m]) for i in range(self.count())]


class FakeKernel:
    """The kernel side, written from the uapi contract, deliberately in plain Python."""

    def __init__(self, size: int, start: int, umem: np.ndarray):
        self.fill, self.comp = Ring(size, start, False), Ring(size, start + 7, False)
        self.rx, self.tx = Ring(size, start + 3, True), Ring(size, start + 11, True)
        self.umem = umem
        self.sent_rx: deque[bytes] = deque()  # frames delivered to RX, in order
        self.wire: list[bytes] = []  # frames transmitted from TX, in order

    @staticmethod
    def _pop(r: Ring):
        i = int(r.consumer[0]) & (r.size - 1)
        r.consumer[0] = (int(r.consumer[0]) + 1) % U32
        return i

    @staticmethod
    def _push(r: Ring):
        i = int(r.producer[0]) & (r.size - 1)
        r.producer[0] = (int(r.producer[0]) + 1) % U32
        return i

    def deliver(self, payloads: list[bytes]) -> int:
        """Receive frames: take fill entries, write data, publish RX descriptors."""
        n = 0
        for p in payloads:
            if self.fill.count() == 0 or self.rx.count() == self.rx.size:
                break  # what the kernel counts as rx_fill_ring_empty / rx_ring_full
            addr = int(self.fill.addrs[self._pop(self.fill)]) + HEADROOM
            self.umem[addr:addr + len(p)] = np.frombuffer(p, np.uint8)
            j = self._push(self.rx)
            self.rx.descs[j, 0] = addr
            self.rx.descs[j, 1] = len(p)
            self.sent_rx.append(p)
            n += 1
        return n

    def transmit(self, max_n: int) -> int:
        """Send queued TX descriptors, publish their addresses on the completion ring."""
        n = 0
        while n < max_n and self.tx.count() and self.comp.count() < self.comp.size:
            j = self._pop(self.tx)
            addr, word = int(self.tx.descs[j, 0]), int(self.tx.descs[j, 1])
            length, options = word & 0xFFFFFFFF, word >> 32
            assert options == 0
            self.wire.append(self.umem[addr:addr + length].tobytes())
            self.comp.addrs[self._push(self.comp)] = addr
            n += 1
        return n


def make(size=8, nframes=32, start=0):
    umem = np.zeros(nframes * FRAME, np.uint8)
    return FakeKernel(size, start, umem), FramePool(nframes, FRAME), umem


def refill(k, pool, max_n=1 << 30):
    f = k.fill
    return rings.fill_ring_refill(f.producer, f.consumer, f.addrs, pool.stack, pool.top, max_n)


def rx(k, max_n):
    a, l = np.zeros(max_n, np.uint64), np.zeros(max_n, np.uint32)
    n = rings.rx_burst(k.rx.producer, k.rx.consumer, k.rx.descs, a, l, max_n)
    return a[:n], l[:n]


def tx(k, addrs, lens):
    addrs = np.asarray(addrs, np.uint64)
    lens = np.asarray(lens, np.uint32)
    return rings.tx_burst(k.tx.producer, k.tx.consumer, k.tx.descs, addrs, lens, len(addrs))


def reap(k, pool, max_n=1 << 30):
    c = k.comp
    return rings.comp_reap(c.producer, c.consumer, c.addrs, pool.stack, pool.top, pool.frame_mask, max_n)


# --------------------------------------------------------------------------- uapi


def test_jit_mode_matches_environment():
    assert rings.JIT_ENABLED == (os.environ.get("NUMBA_DISABLE_JIT", "0") in ("", "0"))


def test_uapi_constants_match_installed_header():
    hdr = Path("/usr/include/linux/if_xdp.h")
    if not hdr.exists():
        pytest.skip("linux/if_xdp.h not installed (linux-libc-dev)")
    defines = {}
    for name, value in re.findall(r"#define\s+(\w+)\s+(\(1 << \d+\)|0x[0-9a-fA-F]+(?:ULL)?|\d+)\s", hdr.read_text()):
        defines[name] = eval(value.replace("ULL", ""))  # noqa: S307 - integer literals only
    assert len(defines) >= 20, "header parse found too little"
    for name, value in defines.items():
        assert getattr(uapi, name) == value, name
    # The header on the build machine may be older than the running kernel, never newer.
    for newer in ("XDP_USE_SG", "XDP_UMEM_TX_SW_CSUM", "XDP_UMEM_TX_METADATA_LEN", "XDP_PKT_CONTD"):
        assert newer in defines or hasattr(uapi, newer)


def test_uapi_struct_layouts_match_compiler():
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc or not Path("/usr/include/linux/if_xdp.h").exists():
        pytest.skip("no C compiler or linux/if_xdp.h")
    structs = [uapi.sockaddr_xdp, uapi.xdp_ring_offset, uapi.xdp_mmap_offsets, uapi.xdp_umem_reg,
               uapi.xdp_statistics, uapi.xdp_options, uapi.xdp_desc]
    hdr = Path("/usr/include/linux/if_xdp.h").read_text()
    lines = []
    for s in structs:
        lines.append(f'printf("{s.__name__} size %zu\\n", sizeof(struct {s.__name__}));')
        for f, _ in s._fields_:
            # Fields newer than the installed header (e.g. tx_metadata_len) are skipped.
            if re.search(rf"struct {s.__name__} \{{[^}}]*\b{f}\b", hdr):
                lines.append(f'printf("{s.__name__} {f} %zu\\n", offsetof(struct {s.__name__}, {f}));')
    src = ("#include <stdio.h>\n#include <stddef.h>\n#include <linux/if_xdp.h>\nint main(void){"
           + "".join(lines) + "return 0;}\n")
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"if_xdp_layout_{os.getpid()}"
    tmp.with_suffix(".c").write_text(src)
    try:
        subprocess.run([cc, "-o", str(tmp), str(tmp.with_suffix(".c"))], check=True, timeout=60)
        out = subprocess.run([str(tmp)], check=True, capture_output=True, text=True, timeout=10).stdout
    finally:
        tmp.with_suffix(".c").unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    by_name = {s.__name__: s for s in structs}
    for line in out.splitlines():
        name, what, value = line.split()
        s = by_name[name]
        got = ctypes.sizeof(s) if what == "size" else getattr(s, what).offset
        assert got == int(value), line
    assert uapi.XDP_DESC_DTYPE.itemsize == ctypes.sizeof(uapi.xdp_desc)


# --------------------------------------------------------------------------- frame pool


def test_frame_pool_alloc_free_round_trip():
    pool = FramePool(8, FRAME)
    got = pool.alloc(5)
    assert list(got) == [i * FRAME for i in range(5)]
    assert pool.free_count == 3
    assert len(pool.alloc(10)) == 3 and pool.free_count == 0
    assert len(pool.alloc(1)) == 0
    pool.free(got + HEADROOM + 17)  # an RX/TX address anywhere inside the chunk
    assert sorted(pool.alloc(5)) == sorted(got)


def test_frame_pool_double_free_is_an_error():
    pool = FramePool(4, FRAME)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([0])


def test_frame_pool_rejects_non_power_of_two():
    with pytest.raises(ValueError):
        FramePool(4, 3000)


# --------------------------------------------------------------------------- primitives


@pytest.mark.parametrize("start", [0, U32 - 3])
def test_producer_free_and_consumer_avail_across_wrap(start):
    r = Ring(8, start, False)
    assert rings.prod_free(r.producer, r.consumer, r.size) == 8
    rings.prod_submit(r.producer, 5)
    assert rings.prod_free(r.producer, r.consumer, r.size) == 3
    assert rings.cons_avail(r.producer, r.consumer) == 5
    rings.cons_release(r.consumer, 5)
    assert rings.cons_avail(r.producer, r.consumer) == 0
    assert int(r.producer[0]) == (start + 5) % U32 == int(r.consumer[0])


def test_needs_wakeup_reads_flag_bit():
    flags = np.zeros(1, np.uint32)
    assert not rings.needs_wakeup(flags)
    flags[0] = uapi.XDP_RING_NEED_WAKEUP
    assert rings.needs_wakeup(flags)
    flags[0] = 2
    assert not rings.needs_wakeup(flags)


# --------------------------------------------------------------------------- bursts


@pytest.mark.parametrize("start", [0, U32 - 5])
def test_refill_bounded_by_ring_space_and_pool(start):
    k, pool, _ = make(size=8, nframes=32, start=start)
    assert refill(k, pool, 3) == 3
    assert refill(k, pool) == 5  # ring now full
    assert refill(k, pool) == 0
    assert pool.free_count == 24
    assert k.fill.entries() == [i * FRAME for i in range(8)]
    k2, small, _ = make(size=8, nframes=2, start=start)
    assert refill(k2, small) == 2 and small.free_count == 0


@pytest.mark.parametrize("start", [0, U32 - 2])
def test_rx_burst_in_order_and_intact(start):
    k, pool, umem = make(size=8, nframes=32, start=start)
    refill(k, pool)
    frames = [bytes([i]) * (60 + i) for i in range(6)]
    assert k.deliver(frames) == 6
    a, l = rx(k, 4)
    assert len(a) == 4
    a2, l2 = rx(k, 64)
    assert len(a2) == 2 and len(rx(k, 64)[0]) == 0
    for addr, ln, want in zip(np.concatenate([a, a2]), np.concatenate([l, l2]), frames):
        assert umem[int(addr):int(addr) + int(ln)].tobytes() == want
    assert k.rx.count() == 0  # all RX slots released back to the kernel


def test_rx_burst_respects_output_capacity():
    k, pool, _ = make()
    refill(k, pool)
    k.deliver([b"x" * 64] * 5)
    out_a, out_l = np.zeros(2, np.uint64), np.zeros(2, np.uint32)
    n = rings.rx_burst(k.rx.producer, k.rx.consumer, k.rx.descs, out_a, out_l, 100)
    assert n == 2 and k.rx.count() == 3


@pytest.mark.parametrize("start", [0, U32 - 1])
def test_tx_burst_then_completion_returns_frames(start):
    k, pool, umem = make(size=8, nframes=32, start=start)
    addrs = pool.alloc(10)
    payloads = [bytes([0xA0 + i]) * (100 + i) for i in range(10)]
    for addr, p in zip(addrs, payloads):
        umem[int(addr):int(addr) + len(p)] = np.frombuffer(p, np.uint8)
    lens = [len(p) for p in payloads]
    assert tx(k, addrs, lens) == 8  # ring holds 8
    assert tx(k, addrs[8:], lens[8:]) == 0
    assert k.transmit(3) == 3
    assert reap(k, pool, 2) == 2
    assert tx(k, addrs[8:], lens[8:]) == 2
    assert k.transmit(100) == 7  # completion ring: 1 unreaped + 7 = full
    assert k.wire == payloads
    assert reap(k, pool) == 8
    assert pool.free_count == 32
    assert sorted(pool.stack[:32]) == [i * FRAME for i in range(32)]


def test_tx_descriptor_layout_is_xdp_desc():
    k, pool, _ = make()
    tx(k, [0x1234000], [1500])
    rec = k.tx.descs.view(uapi.XDP_DESC_DTYPE).reshape(-1)[int(k.tx.consumer[0]) & 7]
    assert (int(rec["addr"]), int(rec["len"]), int(rec["options"])) == (0x1234000, 1500, 0)


def test_comp_reap_never_overflows_pool():
    k, pool, _ = make(size=8, nframes=4)
    # A completion for a frame the pool already holds is a bug elsewhere; reap must stop
    # at the pool's capacity instead of writing past the stack.
    k.comp.addrs[int(k.comp.producer[0]) & 7] = 0
    k.comp.producer[0] += 1
    assert reap(k, pool) == 0
    assert k.comp.count() == 1


# --------------------------------------------------------------------------- property


OPS = st.lists(st.tuples(st.integers(0, 6), st.integers(1, 12)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, start=st.sampled_from([0, 12345, U32 - 7]))
def test_frames_are_conserved_and_ordered(ops, start):
    """Whatever the interleaving, every frame is in exactly one place, RX keeps the
    kernel's order, and TX puts exactly what the app queued on the wire."""
    nframes = 24
    k, pool, umem = make(size=8, nframes=nframes, start=start)
    held: list[int] = []  # frames the app received and still holds
    queued: list[bytes] = []  # what the app queued for TX, in order
    seq = 0
    for op, n in ops:
        if op == 0:
            refill(k, pool, n)
        elif op == 1:
            k.deliver([seq.to_bytes(4, "little") * (i + 1) for i in range(n)])
            seq += 1
        elif op == 2:
            a, l = rx(k, n)
            for addr, ln in zip(a, l):
                want = k.sent_rx.popleft()
                assert umem[int(addr):int(addr) + int(ln)].tobytes() == want
                held.append(int(addr))
        elif op == 3 and held:
            pool.free(held[:n])
            del held[:n]
        elif op == 4:
            addrs = pool.alloc(n)
            payloads = [b"%d:%d" % (seq, i) for i in range(len(addrs))]
            seq += 1
            for addr, p in zip(addrs, payloads):
                umem[int(addr):int(addr) + len(p)] = np.frombuffer(p, np.uint8)
            q = tx(k, addrs, [len(p) for p in payloads])
            queued.extend(payloads[:q])
            pool.free(addrs[q:])
        elif op == 5:
            k.transmit(n)
        elif op == 6:
            reap(k, pool, n)
        places = (
            [int(x) for x in pool.stack[: pool.free_count]] + k.fill.entries() + held
            + k.rx.entries() + k.tx.entries() + k.comp.entries()
        )
        chunked = Counter(a - a % FRAME for a in places)
        assert chunked == Counter(i * FRAME for i in range(nframes))
    assert k.wire == queued[: len(k.wire)]


# --------------------------------------------------------------------------- no-JIT run


@pytest.mark.skipif(os.environ.get(NESTED) == "1", reason="already the nested run")
def test_same_tests_pass_without_jit():
    """Re-run this file interpreted: the hot functions must mean the same without numba."""
    env = dict(os.environ, NUMBA_DISABLE_JIT="1", **{NESTED: "1"})
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env, capture_output=True, text=True, timeout=280,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "passed" in proc.stdout
