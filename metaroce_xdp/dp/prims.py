"""Compiled primitives of the data plane: raw memory, atomics and libc calls from numba.

Everything here is a numba `@intrinsic` that emits a few LLVM instructions, so code that
uses it stays `cache=True`-able: libc functions are declared by NAME in the module
(cgutils.get_or_insert_function) and resolved when the cached object is loaded, never
through ctypes pointers (a pointer constant makes a function uncacheable).

* `ptr_u8(addr)`, `ptr_u64(addr)`: an integer address as a typed pointer, for
  `numba.carray(ptr, n)` -- registered memory is addressed by raw address, so an MR
  may be a numpy array, a memfd mapping or shared memory of a daemon alike.
* `addr_of(arr)`: the address of an array's first element.
* `ld_acq_u32/u64/u8(addr)`, `st_rel_u32/u64/u8(addr, v)`: acquire loads and release
  stores (the AF_XDP ring protocol and the kernel's seqcount).  They are atomic, so
  LLVM never hoists them out of a polling loop.
* `ld_acq_i64(arr, i)`, `st_rel_i64(arr, i, v)`: the same on an element of an int64
  array (the tables another thread posts into).
* `add_i64(arr, i, v)`: atomic fetch-and-add on an element of an int64 array (a count the loops of
  several RX queues keep together); returns the old value.
* `c_memcpy(dst, src, n)`, `c_sendto_kick(fd)`, `c_recvfrom_kick(fd)`, `c_poll(addr,
  n, timeout_ms)`, `c_ppoll_ns(addr, n, timeout_ns)`, `c_read8(fd, addr)`, `c_monotonic_ns()`, `c_sched_yield()`: libc by name.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from .. import jitcache  # noqa: F401,E402  (cache keyed on every module compiled code depends on)

_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_VOIDP = ir.PointerType(_I8)


def _as_i64(builder, val, ty):
    """An integer argument widened (or kept) as i64."""
    if val.type.width == 64:
        return val
    if getattr(ty, "signed", True):
        return builder.sext(val, _I64)
    return builder.zext(val, _I64)


@intrinsic
def ptr_u8(typingctx, addr):
    def codegen(context, builder, sig, args):
        return builder.inttoptr(_as_i64(builder, args[0], sig.args[0]), _VOIDP)
    return types.CPointer(types.uint8)(addr), codegen


@intrinsic
def ptr_u64(typingctx, addr):
    def codegen(context, builder, sig, args):
        return builder.inttoptr(_as_i64(builder, args[0], sig.args[0]), ir.PointerType(_I64))
    return types.CPointer(types.uint64)(addr), codegen


@intrinsic
def addr_of(typingctx, arr):
    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.ptrtoint(ary.data, _I64)
    return types.int64(arr), codegen


def _load(bits, out_ty):
    ity = ir.IntType(bits)

    @intrinsic
    def ld(typingctx, addr):
        def codegen(context, builder, sig, args):
            p = builder.inttoptr(_as_i64(builder, args[0], sig.args[0]), ir.PointerType(ity))
            v = builder.load_atomic(p, "acquire", bits // 8)
            return v if bits == 64 else builder.zext(v, _I64)
        return out_ty(addr), codegen
    return ld


def _store(bits):
    ity = ir.IntType(bits)

    @intrinsic
    def st(typingctx, addr, val):
        def codegen(context, builder, sig, args):
            p = builder.inttoptr(_as_i64(builder, args[0], sig.args[0]), ir.PointerType(ity))
            v = _as_i64(builder, args[1], sig.args[1])
            if bits < 64:
                v = builder.trunc(v, ity)
            builder.store_atomic(v, p, "release", bits // 8)
            return context.get_dummy_value()
        return types.none(addr, val), codegen
    return st


ld_acq_u8 = _load(8, types.int64)
ld_acq_u32 = _load(32, types.int64)
ld_acq_u64 = _load(64, types.int64)
st_rel_u8 = _store(8)
st_rel_u32 = _store(32)
st_rel_u64 = _store(64)


@intrinsic
def ld_acq_i64(typingctx, arr, idx):
    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        p = builder.gep(ary.data, [_as_i64(builder, args[1], sig.args[1])])
        return builder.load_atomic(p, "acquire", 8)
    return types.int64(arr, idx), codegen


@intrinsic
def st_rel_i64(typingctx, arr, idx, val):
    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        p = builder.gep(ary.data, [_as_i64(builder, args[1], sig.args[1])])
        builder.store_atomic(_as_i64(builder, args[2], sig.args[2]), p, "release", 8)
        return context.get_dummy_value()
    return types.none(arr, idx, val), codegen


@intrinsic
def add_i64(typingctx, arr, idx, val):
    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        p = builder.gep(ary.data, [_as_i64(builder, args[1], sig.args[1])])
        return builder.atomic_rmw("add", p, _as_i64(builder, args[2], sig.args[2]), "seq_cst")
    return types.int64(arr, idx, val), codegen


def _libc(builder, name, ret, argtys):
    fnty = ir.FunctionType(ret, argtys)
    return cgutils.get_or_insert_function(builder.module, fnty, name)


@intrinsic
def c_memcpy(typingctx, dst, src, n):
    """memcpy(dst, src, n) between raw addresses (never overlapping here)."""
    def codegen(context, builder, sig, args):
        fn = _libc(builder, "memcpy", _VOIDP, [_VOIDP, _VOIDP, _I64])
        d = builder.inttoptr(_as_i64(builder, args[0], sig.args[0]), _VOIDP)
        s = builder.inttoptr(_as_i64(builder, args[1], sig.args[1]), _VOIDP)
        builder.call(fn, [d, s, _as_i64(builder, args[2], sig.args[2])])
        return context.get_dummy_value()
    return types.none(dst, src, n), codegen


@intrinsic
def c_sendto_kick(typingctx, fd):
    """sendto(fd, NULL, 0, MSG_DONTWAIT, NULL, 0): the AF_XDP TX kick.  Returns its result."""
    def codegen(context, builder, sig, args):
        fn = _libc(builder, "sendto", _I64, [_I32, _VOIDP, _I64, _I32, _VOIDP, _I32])
        null = ir.Constant(_VOIDP, None)
        r = builder.call(fn, [builder.trunc(_as_i64(builder, args[0], sig.args[0]), _I32), null,
                              ir.Constant(_I64, 0), ir.Constant(_I32, 0x40), null, ir.Constant(_I32, 0)])
        return r
    return types.int64(fd), codegen


@intrinsic
def c_recvfrom_kick(typingctx, fd):
    """recvfrom(fd, NULL, 0, MSG_DONTWAIT, NULL, NULL): the AF_XDP RX wake-up."""
    def codegen(context, builder, sig, args):
        fn = _libc(builder, "recvfrom", _I64, [_I32, _VOIDP, _I64, _I32, _VOIDP, _VOIDP])
        null = ir.Constant(_VOIDP, None)
        return builder.call(fn, [builder.trunc(_as_i64(builder, args[0], sig.args[0]), _I32), null,
                                 ir.Constant(_I64, 0), ir.Constant(_I32, 0x40), null, null])
    return types.int64(fd), codegen


@intrinsic
def c_poll(typingctx, addr, n, timeout_ms):
    """poll((struct pollfd *)addr, n, timeout_ms)."""
    def codegen(context, builder, sig, args):
        fn = _libc(builder, "poll", _I32, [_VOIDP, _I64, _I32])
        p = builder.inttoptr(_as_i64(builder, args[0], sig.args[0]), _VOIDP)
        r = builder.call(fn, [p, _as_i64(builder, args[1], sig.args[1]),
                              builder.trunc(_as_i64(builder, args[2], sig.args[2]), _I32)])
        return builder.sext(r, _I64)
    return types.int64(addr, n, timeout_ms), codegen


@intrinsic
def c_ppoll_ns(typingctx, addr, n, timeout_ns):
    """ppoll((struct pollfd *)addr, n, {timeout_ns}, NULL): poll() with a timeout in ns (a pacing gap)."""
    def codegen(context, builder, sig, args):
        fn = _libc(builder, "ppoll", _I32, [_VOIDP, _I64, _VOIDP, _VOIDP])
        p = builder.inttoptr(_as_i64(builder, args[0], sig.args[0]), _VOIDP)
        t = _as_i64(builder, args[2], sig.args[2])
        g = ir.Constant(_I64, 1_000_000_000)
        ts = cgutils.alloca_once(builder, ir.ArrayType(_I64, 2))
        builder.store(builder.sdiv(t, g), builder.gep(ts, [ir.Constant(_I32, 0), ir.Constant(_I32, 0)]))
        builder.store(builder.srem(t, g), builder.gep(ts, [ir.Constant(_I32, 0), ir.Constant(_I32, 1)]))
        r = builder.call(fn, [p, _as_i64(builder, args[1], sig.args[1]), builder.bitcast(ts, _VOIDP),
                              ir.Constant(_VOIDP, None)])
        return builder.sext(r, _I64)
    return types.int64(addr, n, timeout_ns), codegen


@intrinsic
def c_sched_yield(typingctx):
    """sched_yield(): the CPU to another runnable task of this one's, if any (a few hundred ns otherwise)."""
    def codegen(context, builder, sig, args):
        fn = _libc(builder, "sched_yield", _I32, [])
        return builder.sext(builder.call(fn, []), _I64)
    return types.int64(), codegen


@intrinsic
def c_read8(typingctx, fd, addr):
    """read(fd, addr, 8): drains an eventfd."""
    def codegen(context, builder, sig, args):
        fn = _libc(builder, "read", _I64, [_I32, _VOIDP, _I64])
        p = builder.inttoptr(_as_i64(builder, args[1], sig.args[1]), _VOIDP)
        return builder.call(fn, [builder.trunc(_as_i64(builder, args[0], sig.args[0]), _I32), p,
                                 ir.Constant(_I64, 8)])
    return types.int64(fd, addr), codegen


@intrinsic
def c_monotonic_ns(typingctx):
    """clock_gettime(CLOCK_MONOTONIC) in ns (the clock of time.monotonic_ns)."""
    def codegen(context, builder, sig, args):
        fn = _libc(builder, "clock_gettime", _I32, [_I32, _VOIDP])
        ts = cgutils.alloca_once(builder, ir.ArrayType(_I64, 2))
        builder.call(fn, [ir.Constant(_I32, 1), builder.bitcast(ts, _VOIDP)])
        sec = builder.load(builder.gep(ts, [ir.Constant(_I32, 0), ir.Constant(_I32, 0)]))
        nsec = builder.load(builder.gep(ts, [ir.Constant(_I32, 0), ir.Constant(_I32, 1)]))
        return builder.add(builder.mul(sec, ir.Constant(_I64, 1_000_000_000)), nsec)
    return types.int64(), codegen


@intrinsic
def unowned(typingctx, arr):
    """The same array without its owner (meminfo and parent NULL): a borrowed view whose copies,
    slices and rows need no reference counting.  Numba increfs and decrefs an owned array at
    every view (`Q[qi]`), every call that passes it and every slice -- NRT_incref/NRT_decref,
    a locked instruction each, were a quarter of the receiver's and a sixth of the sender's
    CPU on a 64 KiB WRITE stream.  Only for arrays the caller keeps alive for the whole call:
    the entry points' arguments (the Python caller holds them), never a local allocation."""
    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, value=args[0])
        ary.meminfo = cgutils.get_null_value(ary.meminfo.type)
        ary.parent = cgutils.get_null_value(ary.parent.type)
        return ary._getvalue()
    return arr(arr), codegen
