"""QMatMul's decode path (activation rows R <= DECODE_ROWS): one pass over the weight bytes, no BLAS.

Each output is one W row's dot product with one activation row, by 32-weight units (a 32-element block,
or 32 elements of a K-quant super-block): a unit gives its codes as two 16-lane vectors of exact small-
integer floats straight from the packed bytes (`simd16.codes`: shifts and masks in 8-bit lanes, one
widening convert), with its scale s and offset b (gguf-py's value: code·s + b). Nothing dequantised is
stored; the accumulators are vector values in registers.

- R = 1 (a decode token): where a unit shares one scale (32-element blocks, Q4_K/Q5_K sub-blocks) it is
  factored out, acc = fma(s, Σ code·x, acc) in 16 lanes, and the offset term b·Σx (Q4_1, Q5_1, Q4_K,
  Q5_K) goes to a scalar accumulator, with the 32-element sums of x computed once per call for all W
  rows: 3 vector operations per 32 weights besides the conversion, where the values cost 6. Its rounding
  is ~u·(|s·code| + |b|)·|x| rather than ~u·|s·code + b|·|x|: larger only where code·s + b cancels (the
  impl's PrecisionGuarantee). Q2_K, Q3_K and Q6_K (a scale per 16 elements) use the values: the same cost
  there. W rows j and j + h (the two halves of a chunk) run interleaved: independent FMA chains, and two
  sequential streams for the prefetcher (adjacent rows interleaved ran at half the memory speed).
- 1 < R <= DECODE_ROWS: each unit's values code·s + b are formed once (gguf-py's operations) and FMA'd
  into up to four activation rows' accumulators at a time.

A row's output is its lanes summed in a fixed tree, plus the scalar accumulator: one fixed sequence of
f32 operations whichever chunk, pair or thread computes it, so the bytes never depend on the thread
count. K-quant super-block scales are unpacked once per super-block into a 32-float stack scratch
(ggml's 32-bit mask tricks for the 6-bit fields), not once per unit.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit, prange

from fuel.dispatch.cpu.driver import row_kernel
from fuel.dispatch.cpu.simd16 import (
    adds,
    bytes16,
    codes,
    f16_at,
    fma,
    fmas,
    hsum,
    muls,
    muls2,
    stack_f32,
    vadd,
    vload,
    vmul,
    vstore,
    vzero,
)
from fuel.quant import QuantType

DECODE_ROWS = 16  # activation rows up to which this path runs (more go to dequantised tiles and sgemm)
CHUNKS = 256  # fixed chunks of row pairs (the split never depends on the thread count)
Z = np.float32(0)


@njit(inline="always", cache=True)
def _b(row: Any, i: int) -> Any:
    return np.int64(row[i])


@njit(inline="always", cache=True)
def _u32le(row: Any, o: int) -> Any:
    return _b(row, o) | (_b(row, o + 1) << 8) | (_b(row, o + 2) << 16) | (_b(row, o + 3) << 24)


# ---- unit u of the row at byte `base`: (codes of elements 0-15, of 16-31, their scales s, offsets b) ------
# gguf-py's value of an element is code * s + b (b = 0: no offset). `sc` holds the super-block's unpacked
# scales (K-quants, filled by the type's `_p_` function at each super-block's first unit).


@njit(inline="always", cache=True)
def _v_q4_0(row: Any, base: int, u: int, sc: Any) -> Any:
    o = base + 18 * u
    d = f16_at(row, o)
    return codes(row, o + 2, 0, 15, 0, 0, 0, 0, 8, 0), codes(row, o + 2, 4, 15, 0, 0, 0, 0, 8, 0), d, d, Z, Z


@njit(inline="always", cache=True)
def _v_q4_1(row: Any, base: int, u: int, sc: Any) -> Any:
    o = base + 20 * u
    d, m = f16_at(row, o), f16_at(row, o + 2)
    return codes(row, o + 4, 0, 15, 0, 0, 0, 0, 0, 0), codes(row, o + 4, 4, 15, 0, 0, 0, 0, 0, 0), d, d, m, m


@njit(inline="always", cache=True)
def _v_q5_0(row: Any, base: int, u: int, sc: Any) -> Any:
    o = base + 22 * u
    d, qh = f16_at(row, o), _u32le(row, o + 2)
    return codes(row, o + 6, 0, 15, qh, 0, 0, 4, 16, 4), codes(row, o + 6, 4, 15, qh, 16, 0, 4, 16, 4), d, d, Z, Z


@njit(inline="always", cache=True)
def _v_q5_1(row: Any, base: int, u: int, sc: Any) -> Any:
    o = base + 24 * u
    d, m, qh = f16_at(row, o), f16_at(row, o + 2), _u32le(row, o + 4)
    return codes(row, o + 8, 0, 15, qh, 0, 0, 4, 0, 4), codes(row, o + 8, 4, 15, qh, 16, 0, 4, 0, 4), d, d, m, m


@njit(inline="always", cache=True)
def _v_q8_0(row: Any, base: int, u: int, sc: Any) -> Any:
    o = base + 34 * u
    d = f16_at(row, o)
    return codes(row, o + 2, 0, 0, 0, 0, 0, 0, 0, 1), codes(row, o + 18, 0, 0, 0, 0, 0, 0, 0, 1), d, d, Z, Z


@njit(inline="always", cache=True)
def _v_q8_1(row: Any, base: int, u: int, sc: Any) -> Any:
    o = base + 36 * u
    d = f16_at(row, o)
    return codes(row, o + 4, 0, 0, 0, 0, 0, 0, 0, 1), codes(row, o + 20, 0, 0, 0, 0, 0, 0, 0, 1), d, d, Z, Z


@njit(inline="always", cache=True)
def _p_none(row: Any, o: int, sc: Any) -> None:
    """32-element block types have no super-block scales."""


@njit(inline="always", cache=True)
def _p_q2k(row: Any, o: int, sc: Any) -> None:
    """sc[i] = d * scale_i, sc[16 + i] = dmin * min_i for the 16-element groups i."""
    d, dmin = f16_at(row, o + 80), f16_at(row, o + 82)
    vstore(sc, 0, muls(codes(row, o, 0, 15, 0, 0, 0, 0, 0, 0), d))
    vstore(sc, 16, muls(codes(row, o, 4, 15, 0, 0, 0, 0, 0, 0), dmin))


@njit(inline="always", cache=True)
def _v_q2k(row: Any, base: int, u: int, sc: Any) -> Any:
    o, j = base + 84 * (u >> 3), u & 7
    src, sh = o + 16 + 32 * (j >> 2), 2 * (j & 3)
    return (codes(row, src, sh, 3, 0, 0, 0, 0, 0, 0), codes(row, src + 16, sh, 3, 0, 0, 0, 0, 0, 0),
            sc[2 * j], sc[2 * j + 1], -sc[16 + 2 * j], -sc[17 + 2 * j])


@njit(inline="always", cache=True)
def _p_q3k(row: Any, o: int, sc: Any) -> None:
    """sc[i] = d * (scale_i - 32): the 6-bit scales unpacked as ggml does (low nibbles, then 2 high bits)."""
    a0, a1, t = _u32le(row, o + 96), _u32le(row, o + 100), _u32le(row, o + 104)
    m1, m2 = 0x03030303, 0x0F0F0F0F
    v = bytes16((a0 & m2) | ((t & m1) << 4), (a1 & m2) | (((t >> 2) & m1) << 4),
                ((a0 >> 4) & m2) | (((t >> 4) & m1) << 4), ((a1 >> 4) & m2) | (((t >> 6) & m1) << 4), 32)
    vstore(sc, 0, muls(v, f16_at(row, o + 108)))


@njit(inline="always", cache=True)
def _v_q3k(row: Any, base: int, u: int, sc: Any) -> Any:
    o, j = base + 110 * (u >> 3), u & 7
    h, sh = j >> 2, j & 3
    src = o + 32 + 32 * h
    return (codes(row, src, 2 * sh, 3, o, 4 * h + sh, 1, 2, 4, 2),
            codes(row, src + 16, 2 * sh, 3, o + 16, 4 * h + sh, 1, 2, 4, 2), sc[2 * j], sc[2 * j + 1], Z, Z)


@njit(inline="always", cache=True)
def _p_q45k(row: Any, o: int, sc: Any) -> None:
    """sc[j] = d * scale_j, sc[8 + j] = dmin * min_j for the 32-element sub-blocks j (Q4_K, Q5_K): the
    12 bytes of 6-bit values unpacked as ggml does."""
    a0, a1, a2 = _u32le(row, o + 4), _u32le(row, o + 8), _u32le(row, o + 12)
    m6, m4, m2 = 0x3F3F3F3F, 0x0F0F0F0F, 0x03030303
    v = bytes16(a0 & m6, (a2 & m4) | (((a0 >> 6) & m2) << 4), a1 & m6, ((a2 >> 4) & m4) | (((a1 >> 6) & m2) << 4), 0)
    vstore(sc, 0, muls2(v, f16_at(row, o), f16_at(row, o + 2)))


@njit(inline="always", cache=True)
def _v_q4k(row: Any, base: int, u: int, sc: Any) -> Any:
    o, j = base + 144 * (u >> 3), u & 7
    src, sh = o + 16 + 32 * (j >> 1), 4 * (j & 1)
    return (codes(row, src, sh, 15, 0, 0, 0, 0, 0, 0), codes(row, src + 16, sh, 15, 0, 0, 0, 0, 0, 0),
            sc[j], sc[j], -sc[8 + j], -sc[8 + j])


@njit(inline="always", cache=True)
def _v_q5k(row: Any, base: int, u: int, sc: Any) -> Any:
    o, j = base + 176 * (u >> 3), u & 7
    src, sh = o + 48 + 32 * (j >> 1), 4 * (j & 1)
    return (codes(row, src, sh, 15, o + 16, j, 1, 4, 0, 2), codes(row, src + 16, sh, 15, o + 32, j, 1, 4, 0, 2),
            sc[j], sc[j], -sc[8 + j], -sc[8 + j])


@njit(inline="always", cache=True)
def _p_q6k(row: Any, o: int, sc: Any) -> None:
    """sc[i] = d * scale_i (int8 scales) for the 16-element groups i."""
    vstore(sc, 0, muls(codes(row, o + 192, 0, 0, 0, 0, 0, 0, 0, 1), f16_at(row, o + 208)))


@njit(inline="always", cache=True)
def _v_q6k(row: Any, base: int, u: int, sc: Any) -> Any:
    o, j = base + 210 * (u >> 3), u & 7
    h, sh = j >> 2, j & 3
    lo, hi = o + 64 * h + 32 * (sh & 1), o + 128 + 32 * h
    return (codes(row, lo, 4 * (sh >> 1), 15, hi, 2 * sh, 3, 4, 32, 2),
            codes(row, lo + 16, 4 * (sh >> 1), 15, hi + 16, 2 * sh, 3, 4, 32, 2), sc[2 * j], sc[2 * j + 1], Z, Z)


# ---- the driver -------------------------------------------------------------------------------------

SHARED, BIAS, FACTOR_BIAS, SUPER = 1, 2, 4, 8  # kind bits: one scale per unit, offsets, offsets factored, K-quant


@njit(inline="always", cache=True)
def _value(q: Any, s: Any, b: Any, kind: int) -> Any:
    """gguf-py's values: q * s, then + b where the type has offsets (two roundings, as gguf-py)."""
    v = muls(q, s)
    return adds(v, b) if kind & BIAS else v


@njit(inline="always", cache=True)
def _factored(kind: int) -> bool:
    return bool(kind & SHARED) and (not kind & BIAS or bool(kind & FACTOR_BIAS))


@njit(inline="always", cache=True)
def _dot(kind: int, q0: Any, q1: Any, s0: Any, b0: Any, w0: Any, w1: Any, x: Any, xo: int, acc: Any, macc: Any,
         sx: Any, su: int) -> Any:
    """(acc, macc) after one unit dotted with x[xo:xo + 32]: factored (codes q, scale s0, offset b0 times
    the activations' sum sx[su]) or by the values w0, w1."""
    if _factored(kind):
        acc = fmas(s0, fma(q1, vload(x, xo + 16), vmul(q0, vload(x, xo))), acc)
        if kind & BIAS:
            macc += b0 * sx[su]
        return acc, macc
    return fma(w1, vload(x, xo + 16), fma(w0, vload(x, xo), acc)), macc


@njit(inline="always", cache=True)
def _unit(vals: Any, kind: int, row: Any, rb: int, u: int, sc: Any) -> Any:
    """Unit u of the row at byte rb: its codes, scale and offset, and its values where not factored."""
    q0, q1, s0, s1, b0, b1 = vals(row, rb, u, sc)
    if _factored(kind):
        return q0, q1, s0, b0, q0, q1
    return q0, q1, s0, b0, _value(q0, s0, b0, kind), _value(q1, s1, b1, kind)


@njit(inline="always", cache=True)
def _chunks(n: int) -> int:
    return min((n + 1) // 2, CHUNKS)


@njit(inline="always", cache=True)
def _bounds(c: int, n: int) -> tuple[int, int]:
    """Rows [lo, hi) of chunk c: whole pairs, but the last chunk's odd row."""
    pairs, chunks = (n + 1) // 2, _chunks(n)
    return 2 * (c * pairs // chunks), min(n, 2 * ((c + 1) * pairs // chunks))


@njit(inline="always", cache=True)
def _row1(vals: Any, prep: Any, bpb: int, kind: int, row: Any, rb: int, x: Any, i: int, k: int, sx: Any,
          sc: Any) -> Any:
    """One W row (at byte rb) dotted with activation row i."""
    acc = vzero()
    macc = Z
    units = k // 32
    for u in range(units):
        if kind & SUPER and u & 7 == 0:
            prep(row, rb + bpb * (u >> 3), sc)
        q0, q1, s0, b0, w0, w1 = _unit(vals, kind, row, rb, u, sc)
        acc, macc = _dot(kind, q0, q1, s0, b0, w0, w1, x, i * k + 32 * u, acc, macc, sx, i * units + u)
    return hsum(acc) + macc


@njit(inline="always", cache=True)
def _row2(vals: Any, prep: Any, bpb: int, kind: int, row: Any, rb: int, rb1: int, x: Any, i: int, i1: int,
          k: int, sx: Any, sc: Any, sc1: Any) -> tuple[Any, Any]:
    """W row rb with activation row i and W row rb1 with activation row i1, interleaved: independent FMA
    chains (each pair element is computed exactly as `_row1` computes it)."""
    a0 = vzero()
    a1 = vzero()
    m0 = m1 = Z
    units = k // 32
    for u in range(units):
        if kind & SUPER and u & 7 == 0:
            prep(row, rb + bpb * (u >> 3), sc)
            prep(row, rb1 + bpb * (u >> 3), sc1)
        q0, q1, s0, b0, w0, w1 = _unit(vals, kind, row, rb, u, sc)
        a0, m0 = _dot(kind, q0, q1, s0, b0, w0, w1, x, i * k + 32 * u, a0, m0, sx, i * units + u)
        q0, q1, s0, b0, w0, w1 = _unit(vals, kind, row, rb1, u, sc1)
        a1, m1 = _dot(kind, q0, q1, s0, b0, w0, w1, x, i1 * k + 32 * u, a1, m1, sx, i1 * units + u)
    return hsum(a0) + m0, hsum(a1) + m1


@njit(inline="always", cache=True)
def _rows4(vals: Any, prep: Any, bpb: int, kind: int, row: Any, rb: int, x: Any, i: int, m: int, k: int,
           sx: Any, sc: Any, out: Any, j: int) -> None:
    """out[i:i + 4, j]: one W row with four activation rows (of m: the last repeated where m < 4), each
    unit decoded once for the four, and each element computed exactly as `_row1` computes it."""
    i1, i2, i3 = min(i + 1, m - 1), min(i + 2, m - 1), min(i + 3, m - 1)
    a0 = vzero()
    a1 = vzero()
    a2 = vzero()
    a3 = vzero()
    m0 = m1 = m2 = m3 = Z
    units = k // 32
    for u in range(units):
        if kind & SUPER and u & 7 == 0:
            prep(row, rb + bpb * (u >> 3), sc)
        q0, q1, s0, b0, w0, w1 = _unit(vals, kind, row, rb, u, sc)
        a0, m0 = _dot(kind, q0, q1, s0, b0, w0, w1, x, i * k + 32 * u, a0, m0, sx, i * units + u)
        a1, m1 = _dot(kind, q0, q1, s0, b0, w0, w1, x, i1 * k + 32 * u, a1, m1, sx, i1 * units + u)
        a2, m2 = _dot(kind, q0, q1, s0, b0, w0, w1, x, i2 * k + 32 * u, a2, m2, sx, i2 * units + u)
        a3, m3 = _dot(kind, q0, q1, s0, b0, w0, w1, x, i3 * k + 32 * u, a3, m3, sx, i3 * units + u)
    out[i, j] = hsum(a0) + m0
    out[i1, j] = hsum(a1) + m1
    out[i2, j] = hsum(a2) + m2
    out[i3, j] = hsum(a3) + m3


@njit(inline="always", cache=True)
def _rows(vals: Any, prep: Any, bpb: int, kind: int, a: Any, w: Any, out: Any, c: int, sx: Any, x: Any,
          row: Any) -> None:
    """Chunk c of out <- a @ dequant(w)ᵀ (a [m <= DECODE_ROWS, k]; x and row: a and w flat). For a given m
    every element is the same operations whichever way it is reached (`_row1`)."""
    m, k = a.shape
    lo, hi = _bounds(c, w.shape[0])
    rl = w.shape[1]
    sc0 = carray(stack_f32(32), (32,))
    sc1 = carray(stack_f32(32), (32,))
    if m == 1:  # W rows j and j + h together: two sequential streams (adjacent rows ran at half the speed)
        h = (hi - lo) // 2
        for j in range(lo, lo + h):
            out[0, j], out[0, j + h] = _row2(vals, prep, bpb, kind, row, rl * j, rl * (j + h), x, 0, 0, k, sx,
                                             sc0, sc1)
        if (hi - lo) & 1:
            out[0, hi - 1] = _row1(vals, prep, bpb, kind, row, rl * (hi - 1), x, 0, k, sx, sc0)
        return
    kind &= ~FACTOR_BIAS  # the values, formed once for all the activation rows, cost less than the offsets
    for j in range(lo, hi):
        g = 0
        while m - g >= 3:  # fours, and a last three as a four repeating its last row (same value twice)
            _rows4(vals, prep, bpb, kind, row, rl * j, x, g, m, k, sx, sc0, out, j)
            g += 4
        if m - g == 2:
            out[g, j], out[g + 1, j] = _row2(vals, prep, bpb, kind, row, rl * j, rl * j, x, g, g + 1, k, sx, sc0,
                                             sc1)
        elif m - g == 1:
            out[g, j] = _row1(vals, prep, bpb, kind, row, rl * j, x, g, k, sx, sc0)


@njit(inline="always", cache=True)
def _block_sums(a: Any, kind: int) -> Any:
    """Σ of each 32 activations (fixed order) for the factored offset term: only R = 1 factors offsets."""
    m, k = a.shape
    factored = kind & FACTOR_BIAS and m == 1
    sx = np.zeros(k // 32 if factored else 1, np.float32)
    if factored:
        x = a.reshape(k)
        for u in range(k // 32):
            sx[u] = hsum(vadd(vload(x, 32 * u), vload(x, 32 * u + 16)))
    return sx


# Named kernels, one per type, so that Numba's cache finds them again (factory closures it does not).

@row_kernel()
def _gemv_q4_0(a: Any, w: Any, out: Any) -> None:
    sx, x, row = _block_sums(a, SHARED), a.reshape(a.size), w.reshape(w.size)
    for c in prange(_chunks(w.shape[0])):
        _rows(_v_q4_0, _p_none, 18, SHARED, a, w, out, c, sx, x, row)


@row_kernel()
def _gemv_q4_1(a: Any, w: Any, out: Any) -> None:
    sx, x, row = _block_sums(a, SHARED | BIAS | FACTOR_BIAS), a.reshape(a.size), w.reshape(w.size)
    for c in prange(_chunks(w.shape[0])):
        _rows(_v_q4_1, _p_none, 20, SHARED | BIAS | FACTOR_BIAS, a, w, out, c, sx, x, row)


@row_kernel()
def _gemv_q5_0(a: Any, w: Any, out: Any) -> None:
    sx, x, row = _block_sums(a, SHARED), a.reshape(a.size), w.reshape(w.size)
    for c in prange(_chunks(w.shape[0])):
        _rows(_v_q5_0, _p_none, 22, SHARED, a, w, out, c, sx, x, row)


@row_kernel()
def _gemv_q5_1(a: Any, w: Any, out: Any) -> None:
    sx, x, row = _block_sums(a, SHARED | BIAS | FACTOR_BIAS), a.reshape(a.size), w.reshape(w.size)
    for c in prange(_chunks(w.shape[0])):
        _rows(_v_q5_1, _p_none, 24, SHARED | BIAS | FACTOR_BIAS, a, w, out, c, sx, x, row)


@row_kernel()
def _gemv_q8_0(a: Any, w: Any, out: Any) -> None:
    sx, x, row = _block_sums(a, SHARED), a.reshape(a.size), w.reshape(w.size)
    for c in prange(_chunks(w.shape[0])):
        _rows(_v_q8_0, _p_none, 34, SHARED, a, w, out, c, sx, x, row)


@row_kernel()
def _gemv_q8_1(a: Any, w: Any, out: Any) -> None:
    sx, x, row = _block_sums(a, SHARED), a.reshape(a.size), w.reshape(w.size)
    for c in prange(_chunks(w.shape[0])):
        _rows(_v_q8_1, _p_none, 36, SHARED, a, w, out, c, sx, x, row)


@row_kernel()
def _gemv_q2k(a: Any, w: Any, out: Any) -> None:
    sx, x, row = _block_sums(a, SUPER | BIAS), a.reshape(a.size), w.reshape(w.size)
    for c in prange(_chunks(w.shape[0])):
        _rows(_v_q2k, _p_q2k, 84, SUPER | BIAS, a, w, out, c, sx, x, row)


@row_kernel()
def _gemv_q3k(a: Any, w: Any, out: Any) -> None:
    sx, x, row = _block_sums(a, SUPER), a.reshape(a.size), w.reshape(w.size)
    for c in prange(_chunks(w.shape[0])):
        _rows(_v_q3k, _p_q3k, 110, SUPER, a, w, out, c, sx, x, row)


@row_kernel()
def _gemv_q4k(a: Any, w: Any, out: Any) -> None:
    sx, x, row = _block_sums(a, SUPER | SHARED | BIAS | FACTOR_BIAS), a.reshape(a.size), w.reshape(w.size)
    for c in prange(_chunks(w.shape[0])):
        _rows(_v_q4k, _p_q45k, 144, SUPER | SHARED | BIAS | FACTOR_BIAS, a, w, out, c, sx, x, row)


@row_kernel()
def _gemv_q5k(a: Any, w: Any, out: Any) -> None:
    sx, x, row = _block_sums(a, SUPER | SHARED | BIAS | FACTOR_BIAS), a.reshape(a.size), w.reshape(w.size)
    for c in prange(_chunks(w.shape[0])):
        _rows(_v_q5k, _p_q45k, 176, SUPER | SHARED | BIAS | FACTOR_BIAS, a, w, out, c, sx, x, row)


@row_kernel()
def _gemv_q6k(a: Any, w: Any, out: Any) -> None:
    sx, x, row = _block_sums(a, SUPER), a.reshape(a.size), w.reshape(w.size)
    for c in prange(_chunks(w.shape[0])):
        _rows(_v_q6k, _p_q6k, 210, SUPER, a, w, out, c, sx, x, row)


GEMV: dict[QuantType, Any] = {
    QuantType.Q4_0: _gemv_q4_0, QuantType.Q4_1: _gemv_q4_1, QuantType.Q5_0: _gemv_q5_0,
    QuantType.Q5_1: _gemv_q5_1, QuantType.Q8_0: _gemv_q8_0, QuantType.Q8_1: _gemv_q8_1,
    QuantType.Q2K: _gemv_q2k, QuantType.Q3K: _gemv_q3k, QuantType.Q4K: _gemv_q4k, QuantType.Q5K: _gemv_q5k,
    QuantType.Q6K: _gemv_q6k,
}
