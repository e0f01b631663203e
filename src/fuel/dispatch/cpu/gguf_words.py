"""One-row Q4_K decoding by 32-bit words, for hosts without AVX-512's table kernels.

The portable decoders (`simd16.codes2`) widen code bytes to 32-bit lanes (vpmovzxbd and the extracts that
feed it) before converting them. Here 64 code bytes are loaded as 16 little-endian 32-bit words, one a
lane, and each lane's eight nibbles are taken in place: nibble t (bits 4t..4t + 3: byte t // 2 of the
word, the high nibble if t is odd) is `word & (15 << 4t)`, the integer code·2^(4t), which one vcvtdq2ps
converts exactly (four significant bits); the top nibble is `word >> 28`. An AND and a convert per 8
codes. 4096² at one activation row, one core of this Zen 3: 1.2 ms against 1.9 ms widening.

The 2^(4t) goes to the activations: each part of a call copies them into the lanes' order (`ORDER`,
~0.2 ns an element), scaled by 2^(-4t) and by a power of two that brings the row's largest into [0.5, 1)
(`word_activations`). Both are exact but for elements 2^100 below the row's largest, so each product
code·x is the same real number as in the portable kernel, up to that power of two, and rounds the same;
only which lane sums which products differs, as in `nibble_tables`' table kernels. Lanes 0-7 hold the words of a
super-block's unit pair 2g (units 4g and 4g + 1, the low and high nibbles of the same 32 bytes), lanes
8-15 pair 2g + 1: even nibbles meet units 4g and 4g + 2, odd ones 4g + 1 and 4g + 3, two scale vectors a
128 weights. For Q4_0 and Q4_1, whose blocks hold only four words and their own scales, the same scheme
measured no faster than widening (the scales' gathering costs what the shuffles saved).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from fuel.dispatch.cpu.gguf_gemv import PF, pair_supers
from fuel.dispatch.cpu.simd16 import _F32, _I32, _VF, _W, VEC, _ptr, fma, hi8, hsum, prefetch, vload, vmul

GROUP = 128  # weights one load of words holds: 16 lanes, 8 nibbles each

# Position 16t + L of each 128 activations holds element ORDER[16t + L] of them, times SCALE[16t + L].
ORDER = [(2 * (lane // 8) + t % 2) * 32 + 4 * (lane % 8) + t // 2 for t in range(8) for lane in range(_W)]
SCALE = [2.0 ** (-4 * t) if t < 7 else 1.0 for t in range(8) for _ in range(_W)]


@intrinsic
def _permute128(typingctx: Any, x: Any, at: Any, out: Any, e: Any) -> Any:
    """out[at + p] = x[at + ORDER[p]] * SCALE[p] * e, p < 128 (e a float32 power of two): one shuffle of 128
    floats (LLVM lowers it to in-register permutes) and one multiply, ~0.2 ns an element where indexed
    copies took 0.8."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        vt = ir.VectorType(_F32, GROUP)
        v = builder.load(_ptr(context, builder, signature.args[0], args[0], args[1], vt), align=4)
        undef = ir.Constant(vt, ir.Undefined)
        splat = builder.shuffle_vector(builder.insert_element(undef, args[3], ir.Constant(_I32, 0)), undef,
                                       ir.Constant(ir.VectorType(_I32, GROUP), [0] * GROUP))
        p = builder.fmul(builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, GROUP), ORDER)),
                         builder.fmul(ir.Constant(vt, SCALE), splat))
        builder.store(p, _ptr(context, builder, signature.args[2], args[2], args[1], vt), align=4)
        return context.get_dummy_value()

    return types.void(x, at, out, types.float32), codegen


@intrinsic
def _words(typingctx: Any, row: Any, off: Any) -> Any:
    """The 16 little-endian 32-bit words at row[off:off + 64] (uint8 row, unchecked) as a vector's bits."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        v = builder.load(_ptr(context, builder, signature.args[0], args[0], args[1], ir.VectorType(_I32, _W)),
                         align=1)
        return builder.bitcast(v, _VF)

    return VEC(row, off), codegen


@intrinsic(prefer_literal=True)
def _nibble(typingctx: Any, v: Any, t: Any) -> Any:
    """Nibble t (a literal) of each lane's word, times 2^(4t) for t < 7, as exact floats."""
    if not isinstance(t, types.IntegerLiteral):
        return None
    at = int(t.literal_value)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        vt = ir.VectorType(_I32, _W)
        bits = builder.bitcast(args[0], vt)
        if at < 7:
            code = builder.and_(bits, ir.Constant(vt, [15 << 4 * at] * _W))
        else:
            code = builder.lshr(bits, ir.Constant(vt, [28] * _W))
        return builder.sitofp(code, _VF)

    return VEC(v, t), codegen


@intrinsic(prefer_literal=True)
def _spread4(typingctx: Any, sc: Any, i: Any, parity: Any) -> Any:
    """sc[i + parity] in lanes 0-7, sc[i + 2 + parity] in lanes 8-15 (parity a literal, 0 or 1)."""
    if not isinstance(parity, types.IntegerLiteral):
        return None
    p = int(parity.literal_value)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        four = builder.load(_ptr(context, builder, signature.args[0], args[0], args[1], ir.VectorType(_F32, 4)),
                            align=4)
        return builder.shuffle_vector(four, four, ir.Constant(ir.VectorType(_I32, _W), [p] * 8 + [p + 2] * 8))

    return VEC(sc, i, parity), codegen


permute128: Any = _permute128
words: Any = _words
nibble: Any = _nibble
spread4: Any = _spread4


@njit(inline="always", cache=True)
def word_activations(a: Any) -> Any:
    """a's one row (k a multiple of 128) in the lanes' order (`ORDER`, `SCALE`) times 2^e, 2^e bringing the
    row's largest |x| into [0.5, 1) (as near as |e| <= 126 allows) so that the 2^-24 of SCALE leaves only
    elements below 2^-100 of it inexact (a row of activations below 2^-102 would otherwise lose bits as
    subnormals); element k holds 2^-e, which the kernel's sums are multiplied by (exactly, unless the
    result itself is subnormal)."""
    x = a.reshape(a.size)
    big = np.float32(0)
    for i in range(x.size):
        big = max(big, abs(x[i]))
    e = np.float32(1)
    if 0 < big < np.inf:  # 2^e and 2^-e stay normal f32: |e| <= 126
        e = np.float32(math.ldexp(1.0, max(-126, min(126, -math.frexp(big)[1]))))
    out = np.empty(x.size + 1, np.float32)
    for u in range(0, x.size, GROUP):
        permute128(x, u, out, e)
    out[x.size] = 1 / e
    return out


@njit(inline="always", cache=True)
def _super(prep: Any, row: Any, o: int, sc: Any, x: Any, xo: int, acc: Any, mv: Any, sx: Any, so: int) -> Any:
    """(acc, mv) after the Q4_K super-block at byte o dotted with x[xo:xo + 256] (in `ORDER`); the
    offsets as in `gguf_gemv._super`."""
    for t in range(0, 144, 64):
        prefetch(row, o + PF + t)
    prep(row, o, sc)
    for g in range(2):
        v = words(row, o + 16 + 64 * g)
        xg = xo + GROUP * g
        ev = vmul(nibble(v, 0), vload(x, xg))
        od = vmul(nibble(v, 1), vload(x, xg + 16))
        ev = fma(nibble(v, 2), vload(x, xg + 32), ev)
        od = fma(nibble(v, 3), vload(x, xg + 48), od)
        ev = fma(nibble(v, 4), vload(x, xg + 64), ev)
        od = fma(nibble(v, 5), vload(x, xg + 80), od)
        ev = fma(nibble(v, 6), vload(x, xg + 96), ev)
        od = fma(nibble(v, 7), vload(x, xg + 112), od)
        acc = fma(spread4(sc, 4 * g, 0), ev, acc)
        acc = fma(spread4(sc, 4 * g, 1), od, acc)
    return acc, fma(hi8(vload(sc, 0)), vload(sx, so), mv)


@njit(inline="always", cache=True)
def kpair_q4k(vals: Any, prep: Any, bpb: int, kind: int, row: Any, rb: int, rb1: int, x: Any, k: int,
              sx: Any, sc: Any, sc1: Any) -> tuple[Any, Any]:
    """`gguf_gemv.kpair` for Q4_K by words (vals and kind unused); x from `word_activations`, its element
    k the factor that undoes their normalisation."""
    a0, m0, a1, m1 = pair_supers(_super, prep, bpb, row, rb, rb1, x, k, sx, sc, sc1)
    return hsum(a0) * x[k] - hsum(m0), hsum(a1) * x[k] - hsum(m1)
