"""PagedAttn's inner tiles: the scores of one key for a run of query rows, and the probability-weighted V
update, reading the cache by flat element offset.

The kernel's per-key loop touches the caches only through these tiles and the intrinsics below, never
through an array view: a view of a cache row costs a reference-count increment and decrement (calls into
the runtime, atomics on a counter both threads share; see docs/performance/attention.md, "paged tiles").
f32 with D a multiple of 16 runs on explicit 16-lane vectors (`simd16`: one zmm or two ymm, whichever the
host has); every other case on scalar loops that LLVM vectorises. Scores are key-major (`buf[t, row]`):
one key's scores are a contiguous write, where row-major rows 8 KiB apart all fell in one L1 set.
Each row's arithmetic depends only on its own values and D, never on how rows are grouped, so a row's
bytes do not depend on how tasks are cut.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from fuel.cpu.simd.simd16 import fmas, fmax, hsum, vload, vstore, vzero
from fuel.cpu.simd.vecmath import cast_like, widen

# As paged_attention's: reassociation lets the reductions vectorise (one fixed order per build).
FASTMATH = {"nsz", "reassoc", "contract", "arcp"}

_I32 = ir.IntType(32)


@intrinsic
def _prefetch_intrinsic(typingctx: Any, arr: Any, index: Any) -> Any:
    """Hint the cache line holding `arr.flat[index]` into L2 (llvm.prefetch: read, locality 2). Into L2
    rather than L1: a core has few L1 miss buffers, and the kernel prefetches far enough ahead (tens of
    KiB) that L1 would evict the lines first (see docs/performance/attention.md, "paged prefetch")."""
    if not isinstance(arr, types.Array) or not isinstance(index, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        i8p = ir.IntType(8).as_pointer()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]),
                                            "llvm.prefetch.p0")
        address = builder.bitcast(builder.gep(data, [args[1]]), i8p)
        builder.call(fn, [address, *(ir.Constant(_I32, k) for k in (0, 2, 1))])
        return context.get_dummy_value()

    return types.none(arr, index), codegen


@intrinsic
def _at_intrinsic(typingctx: Any, arr: Any, index: Any) -> Any:
    """`arr.flat[index]` of a C-contiguous array, unchecked (the caller keeps it inside the array)."""
    if not isinstance(arr, types.Array) or not isinstance(index, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.load(builder.gep(data, [args[1]]))

    return arr.dtype(arr, index), codegen


# Typed as Any, as vecmath's: Numba fills in the typing context when jitted code calls the intrinsic.
prefetch: Any = _prefetch_intrinsic
at: Any = _at_intrinsic


def vector_path(cache: Any, dh: Any) -> Any:
    """Whether the 16-lane tiles apply: an f32 cache and D a multiple of 16."""
    raise NotImplementedError


@overload(vector_path, inline="always")
def _vector_path_impl(cache: Any, dh: Any) -> Any:
    def f32(cache: Any, dh: Any) -> Any:
        return dh % 16 == 0

    def other(cache: Any, dh: Any) -> Any:
        return False

    return f32 if cache.dtype == types.float32 else other


@njit(inline="always", cache=True, fastmath=FASTMATH)
def dots(qw: Any, base: Any, n: Any, kc: Any, koff: Any, buf: Any, t: Any, simd: bool) -> None:
    """buf[t, base + j] <- qw[base + j]·k for j < n, k the D values at kc.flat[koff:]. Four rows share each
    pass over k, so their reductions overlap (see docs/performance/attention.md, "paged tiles")."""
    dh = qw.shape[1]
    n4 = n - n % 4
    if simd:  # per row: one fused multiply-add chain over the 16-lane chunks, then a fixed lane tree
        for j in range(0, n4, 4):
            r = base + j
            a0 = a1 = a2 = a3 = vzero()
            for c in range(0, dh, 16):
                k = vload(kc, koff + c)
                a0 = fmax(k, qw, r * dh + c, a0)
                a1 = fmax(k, qw, (r + 1) * dh + c, a1)
                a2 = fmax(k, qw, (r + 2) * dh + c, a2)
                a3 = fmax(k, qw, (r + 3) * dh + c, a3)
            buf[t, r], buf[t, r + 1], buf[t, r + 2], buf[t, r + 3] = hsum(a0), hsum(a1), hsum(a2), hsum(a3)
        for r in range(base + n4, base + n):
            a = vzero()
            for c in range(0, dh, 16):
                a = fmax(vload(kc, koff + c), qw, r * dh + c, a)
            buf[t, r] = hsum(a)
        return
    for j in range(0, n4, 4):
        r = base + j
        s0 = s1 = s2 = s3 = cast_like(0, buf[t, r])
        for d in range(dh):
            x = widen(at(kc, koff + d))
            s0 += qw[r, d] * x
            s1 += qw[r + 1, d] * x
            s2 += qw[r + 2, d] * x
            s3 += qw[r + 3, d] * x
        buf[t, r], buf[t, r + 1], buf[t, r + 2], buf[t, r + 3] = s0, s1, s2, s3
    for r in range(base + n4, base + n):
        s = cast_like(0, buf[t, r])
        for d in range(dh):
            s += qw[r, d] * widen(at(kc, koff + d))
        buf[t, r] = s


@njit(inline="always", cache=True, fastmath=FASTMATH)
def accumulate(acc: Any, base: Any, n: Any, buf: Any, t: Any, vc: Any, voff: Any, simd: bool) -> None:
    """acc[base + j] += P[base + j, t]·v for j < n, v the D values at vc.flat[voff:] (one key)."""
    dh = acc.shape[1]
    if simd:
        for r in range(base, base + n):
            p, o = buf[t, r], r * dh
            for c in range(0, dh, 16):
                vstore(acc, o + c, fmas(p, vload(vc, voff + c), vload(acc, o + c)))
        return
    for r in range(base, base + n):
        p = buf[t, r]
        for d in range(dh):
            acc[r, d] += p * widen(at(vc, voff + d))
