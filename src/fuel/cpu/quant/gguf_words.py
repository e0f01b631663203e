"""One-row Q4_K and Q6_K decoding by 32-bit words, for the types the host has no table kernel for (Q4_K
and Q6_K on AVX2 hosts, Q6_K on AVX-512 ones: `gguf_decode.WORD_KERNELS`).

The portable decoders (`simd16.codes2`) widen code bytes to 32-bit lanes (vpmovzxbd and the extracts that
feed it) before converting them. Here 64 code bytes are loaded as 16 little-endian 32-bit words, one a
lane, and each lane's eight nibbles are taken in place: nibble t (bits 4t..4t + 3: byte t // 2 of the
word, the high nibble if t is odd) is `word & (15 << 4t)`, the integer code·2^(4t), which one vcvtdq2ps
converts exactly (four significant bits); the top nibble is `word >> 28`. An AND and a convert per 8
codes, and no widening shuffle (docs/performance/quant.md, "gguf_words").

The 2^(4t) goes to the activations: each part of a call copies them into the lanes' order (`ORDER`),
scaled by 2^(-4t) and by a power of two that brings the row's largest into [0.5, 1) (`word_activations`).
Both are exact but for elements 2^100 below the row's largest, so each product
code·x is the same real number as in the portable kernel, up to that power of two, and rounds the same;
only which lane sums which products differs, as in `nibble_tables`' table kernels. Lanes 0-7 hold the words of a
super-block's unit pair 2g (units 4g and 4g + 1, the low and high nibbles of the same 32 bytes), lanes
8-15 pair 2g + 1: even nibbles meet units 4g and 4g + 2, odd ones 4g + 1 and 4g + 3, two scale vectors a
128 weights. For Q4_0 and Q4_1, whose blocks hold only four words and their own scales, the same scheme
is no faster than widening (the scales' gathering costs what the shuffles save).

Q6_K (`_super_q6k`) builds each half super-block's 128 six-bit codes in place, four to a word: 16 words of
low nibbles OR'd with their 2-bit high parts shifted to bits 4-5 of each byte (a load of the high bytes
serves two units). Byte b of a word is then `word & (63 << 8b)`, less 32·2^(8b): the integer
(q - 32)·2^(8b), which one vcvtdq2ps converts exactly; its activations are scaled by 2^(-8b). A lane's
four bytes are elements of one 16-element group, so its products (q - 32)·x are summed first and then
multiplied by the group's scale: one multiply per four codes, where forming gguf-py's values
d·scale·(q - 32) took one per code. A value is never formed, but the codes are exact, so a zero weight
adds nothing and an identity row gives gguf-py's value. No shuffle widens a byte, where the portable decoder
widens by vpmovsxbd (docs/performance/quant.md, "gguf_words").
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from fuel.cpu.quant.gguf_gemv import block_sums, gemv_args, pair_supers, part_chunks, rows_one
from fuel.cpu.simd.simd16 import IR_F32, IR_I32, IR_VF, LANES, VEC, element_pointer, fma, hi8, hsum, vadd, vload, vmul

GROUP = 128  # weights one load of words holds: 16 lanes, 8 nibbles each

# Position 16t + L of each 128 activations holds element ORDER[16t + L] of them, times SCALE[16t + L].
ORDER = [(2 * (lane // 8) + t % 2) * 32 + 4 * (lane % 8) + t // 2 for t in range(8) for lane in range(LANES)]
SCALE = [2.0 ** (-4 * t) if t < 7 else 1.0 for t in range(8) for _ in range(LANES)]
# Q6_K (`_super_q6k`): position 16v + L of each half super-block's 128 holds element 64(v // 4) + 4L + v % 4
# times 2^(-8(v % 4)): byte v % 4 of lane L's word in the codes of the half's first (v < 4) or last 64.
ORDER_Q6K = [64 * (v // 4) + 4 * lane + v % 4 for v in range(8) for lane in range(LANES)]
SCALE_Q6K = [2.0 ** (-8 * (v % 4)) for v in range(8) for _ in range(LANES)]
Q4K_LAYOUT, Q6K_LAYOUT = 0, 1
LAYOUTS = ((ORDER, SCALE), (ORDER_Q6K, SCALE_Q6K))


@intrinsic(prefer_literal=True)
def _permute128(typingctx: Any, x: Any, at: Any, out: Any, e: Any, layout: Any) -> Any:
    """out[at + p] = x[at + order[p]] * scale[p] * e, p < 128, (order, scale) = LAYOUTS[layout] (a literal; e
    a float32 power of two): one shuffle of 128 floats (LLVM lowers it to in-register permutes) and one
    multiply, a fraction of what indexed copies cost (docs/performance/quant.md, "gguf_words")."""
    if not isinstance(layout, types.IntegerLiteral):
        return None
    order, scale = LAYOUTS[int(layout.literal_value)]

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        vt = ir.VectorType(IR_F32, GROUP)
        v = builder.load(element_pointer(context, builder, signature.args[0], args[0], args[1], vt), align=4)
        undef = ir.Constant(vt, ir.Undefined)
        splat = builder.shuffle_vector(builder.insert_element(undef, args[3], ir.Constant(IR_I32, 0)), undef,
                                       ir.Constant(ir.VectorType(IR_I32, GROUP), [0] * GROUP))
        p = builder.fmul(builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(IR_I32, GROUP), order)),
                         builder.fmul(ir.Constant(vt, scale), splat))
        builder.store(p, element_pointer(context, builder, signature.args[2], args[2], args[1], vt), align=4)
        return context.get_dummy_value()

    return types.void(x, at, out, types.float32, layout), codegen


@intrinsic
def _words(typingctx: Any, row: Any, off: Any) -> Any:
    """The 16 little-endian 32-bit words at row[off:off + 64] (uint8 row, unchecked) as a vector's bits."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        addr = element_pointer(context, builder, signature.args[0], args[0], args[1], ir.VectorType(IR_I32, LANES))
        v = builder.load(addr, align=1)
        return builder.bitcast(v, IR_VF)

    return VEC(row, off), codegen


@intrinsic(prefer_literal=True)
def _nibble(typingctx: Any, v: Any, t: Any) -> Any:
    """Nibble t (a literal) of each lane's word, times 2^(4t) for t < 7, as exact floats."""
    if not isinstance(t, types.IntegerLiteral):
        return None
    at = int(t.literal_value)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        vt = ir.VectorType(IR_I32, LANES)
        bits = builder.bitcast(args[0], vt)
        if at < 7:
            code = builder.and_(bits, ir.Constant(vt, [15 << 4 * at] * LANES))
        else:
            code = builder.lshr(bits, ir.Constant(vt, [28] * LANES))
        return builder.sitofp(code, IR_VF)

    return VEC(v, t), codegen


# Lane patterns of `spread`: which of four scales each of the 16 lanes takes.
EVEN_PAIRS = 0  # Q4_K's even nibbles: scale 0 in lanes 0-7, scale 2 in lanes 8-15
ODD_PAIRS = 1  # its odd nibbles: scales 1 and 3
QUADS = 2  # Q6_K: scale t // 4 in lane t
_SPREADS = ([0] * 8 + [2] * 8, [1] * 8 + [3] * 8, [t // 4 for t in range(LANES)])


@intrinsic(prefer_literal=True)
def _spread(typingctx: Any, sc: Any, i: Any, pattern: Any) -> Any:
    """sc[i + _SPREADS[pattern][t]] in lane t (pattern a literal)."""
    if not isinstance(pattern, types.IntegerLiteral):
        return None
    lanes = _SPREADS[int(pattern.literal_value)]

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        addr = element_pointer(context, builder, signature.args[0], args[0], args[1], ir.VectorType(IR_F32, 4))
        four = builder.load(addr, align=4)
        return builder.shuffle_vector(four, four, ir.Constant(ir.VectorType(IR_I32, LANES), lanes))

    return VEC(sc, i, pattern), codegen


@intrinsic
def _q6k_words(typingctx: Any, row: Any, lo: Any, hi: Any) -> Any:
    """A Q6_K half super-block's 128 codes as two vectors of 16 words, each byte a 6-bit code (bit patterns
    in a float vector): the low nibbles at row[lo:lo + 64] with their high bits at row[hi:hi + 32] (bits
    2c of byte l for the element 32c + l), then the high nibbles with theirs. Byte b of lane L holds
    element 4L + b of the first 64, then of the last 64 (`ORDER_Q6K`)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        vt, at = ir.VectorType(IR_I32, LANES), signature.args

        def const(values: list[int]) -> Any:
            return ir.Constant(vt, values)

        low = builder.load(element_pointer(context, builder, at[0], args[0], args[1], vt), align=1)
        eight = builder.load(element_pointer(context, builder, at[0], args[0], args[2], ir.VectorType(IR_I32, 8)),
                             align=1)
        high = builder.shuffle_vector(eight, eight, ir.Constant(vt, list(range(8)) * 2))
        nib, top = const([0x0F0F0F0F] * LANES), const([0x30303030] * LANES)
        first = builder.or_(builder.and_(low, nib), builder.and_(builder.shl(high, const([4] * 8 + [2] * 8)), top))
        last = builder.or_(builder.and_(builder.lshr(low, const([4] * LANES)), nib),
                           builder.and_(builder.lshr(high, const([0] * 8 + [2] * 8)), top))
        return context.make_tuple(builder, types.UniTuple(VEC, 2),
                                  [builder.bitcast(first, IR_VF), builder.bitcast(last, IR_VF)])

    return types.UniTuple(VEC, 2)(row, lo, hi), codegen


@intrinsic(prefer_literal=True)
def _code6(typingctx: Any, v: Any, b: Any) -> Any:
    """(byte b of each lane's word - 32)·2^(8b) as exact floats (b a literal): the masked byte less
    32·2^(8b) is an int32 of six significant bits, which converts exactly."""
    if not isinstance(b, types.IntegerLiteral):
        return None
    at = int(b.literal_value)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        vt = ir.VectorType(IR_I32, LANES)
        code = builder.and_(builder.bitcast(args[0], vt), ir.Constant(vt, [0x3F << 8 * at] * LANES))
        return builder.sitofp(builder.sub(code, ir.Constant(vt, [32 << 8 * at] * LANES)), IR_VF)

    return VEC(v, b), codegen


permute128: Any = _permute128
words: Any = _words
nibble: Any = _nibble
spread: Any = _spread
q6k_words: Any = _q6k_words
code6: Any = _code6


@njit(inline="always", cache=True)
def word_activations(a: Any, layout: int) -> Any:
    """a's one row (k a multiple of 128) in the lanes' order (`LAYOUTS[layout]`) times 2^e, 2^e bringing the
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
        permute128(x, u, out, e, layout)
    out[x.size] = 1 / e
    return out


@njit(inline="always", cache=True)
def _super(vals: Any, kind: int, prep: Any, row: Any, o: int, sc: Any, x: Any, xo: int, acc: Any, mv: Any, sx: Any,
           so: int) -> Any:
    """(acc, mv) after the Q4_K super-block at byte o dotted with x[xo:xo + 256] (in `ORDER`); the
    offsets as in `gguf_gemv._super`."""
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
        acc = fma(spread(sc, 4 * g, EVEN_PAIRS), ev, acc)
        acc = fma(spread(sc, 4 * g, ODD_PAIRS), od, acc)
    return acc, fma(hi8(vload(sc, 0)), vload(sx, so), mv)


@njit(inline="always", cache=True)
def kpair_q4k(vals: Any, prep: Any, bpb: int, kind: int, row: Any, rb: int, rb1: int, x: Any, k: int,
              sx: Any, sc: Any, sc1: Any, ahead: int) -> tuple[Any, Any]:
    """`gguf_gemv.kpair` for Q4_K by words (vals and kind unused); x from `word_activations`, its element
    k the factor that undoes their normalisation."""
    a0, m0, a1, m1 = pair_supers(_super, vals, kind, prep, bpb, row, rb, rb1, x, k, sx, sc, sc1, ahead)
    return hsum(a0) * x[k] - hsum(m0), hsum(a1) * x[k] - hsum(m1)


@njit(inline="always", cache=True)
def _super_q6k(vals: Any, kind: int, prep: Any, row: Any, o: int, sc: Any, x: Any, xo: int, acc: Any, acc1: Any,
               sx: Any, so: int) -> Any:
    """The two accumulators (of each half's first and last 64 elements) after the Q6_K super-block at byte o
    dotted with x[xo:xo + 256] (in `ORDER_Q6K`): each lane's four products (q - 32)·x summed, then times
    its group's scale d·scale_g (sc[0:16], from `prep`)."""
    prep(row, o, sc)
    for h in range(2):
        first, last = q6k_words(row, o + 64 * h, o + 128 + 32 * h)
        xh = xo + GROUP * h
        inner = vmul(code6(first, 0), vload(x, xh))
        inner = fma(code6(first, 1), vload(x, xh + 16), inner)
        inner = fma(code6(first, 2), vload(x, xh + 32), inner)
        inner = fma(code6(first, 3), vload(x, xh + 48), inner)
        acc = fma(spread(sc, 8 * h, QUADS), inner, acc)
        inner = vmul(code6(last, 0), vload(x, xh + 64))
        inner = fma(code6(last, 1), vload(x, xh + 80), inner)
        inner = fma(code6(last, 2), vload(x, xh + 96), inner)
        inner = fma(code6(last, 3), vload(x, xh + 112), inner)
        acc1 = fma(spread(sc, 8 * h + 4, QUADS), inner, acc1)
    return acc, acc1


@njit(inline="always", cache=True)
def kpair_q6k(vals: Any, prep: Any, bpb: int, kind: int, row: Any, rb: int, rb1: int, x: Any, k: int,
              sx: Any, sc: Any, sc1: Any, ahead: int) -> tuple[Any, Any]:
    """`gguf_gemv.kpair` for Q6_K by words (vals, kind and sx unused); x from `word_activations` (layout
    `Q6K_LAYOUT`), its element k the factor that undoes their normalisation."""
    a0, b0, a1, b1 = pair_supers(_super_q6k, vals, kind, prep, bpb, row, rb, rb1, x, k, sx, sc, sc1, ahead)
    return hsum(vadd(a0, b0)) * x[k], hsum(vadd(a1, b1)) * x[k]


@njit(inline="always", cache=True)
def one_row_words(vals: Any, prep: Any, bpb: int, kind: int, pair: Any, layout: int, part: int, parts: int,
                  argv: int) -> None:
    """`gguf_gemv.one_row` of a words decoder (`pair`: `kpair_q4k` or `kpair_q6k`): each part reads the
    activations as given and permutes its own copy to the layout's lanes (`word_activations`)."""
    a, w, out = gemv_args(argv)
    sx, x, row = block_sums(a, kind), word_activations(a, layout), w.reshape(w.size)
    for c in range(*part_chunks(part, parts, w.shape[0])):
        rows_one(vals, prep, bpb, kind, a, w, out, c, sx, x, row, pair)
