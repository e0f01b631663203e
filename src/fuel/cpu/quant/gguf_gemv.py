"""QMatMul's decode path (activation rows R <= DECODE_ROWS): one pass over the weight bytes, no BLAS.

Each output is one W row's dot product with one activation row, by 32-weight units (a 32-element block,
or 32 elements of a K-quant super-block; the decoders are in `gguf_units`): a unit gives its codes as two
16-lane vectors of exact small-integer floats straight from the packed bytes (`simd16.codes`: shifts and
masks in 8-bit lanes, one widening convert), with its scale s and offset b (gguf-py's value: code·s + b).
Nothing dequantised is stored; the accumulators are vector values in registers.

- R = 1 (a decode token): where a unit shares one scale (Q4_0, Q5_0, Q8_0, Q8_1, Q4_K/Q5_K sub-blocks) it
  is factored out, acc = fma(s, Σ code·x, acc) in 16 lanes, and the offset term b·Σx (Q4_K, Q5_K) goes to a
  separate accumulator, with the sums of x computed once per call for all W rows: 3 vector operations per
  32 weights besides the conversion. Its rounding is ~u·(|s·code| + |b|)·|x| rather than ~u·|s·code + b|·|x|:
  larger only where code·s + b cancels (the impl's PrecisionGuarantee). Q4_1 and Q5_1 (AFFINE) form each
  unit's values by one FMA, code·s + b (gguf-py's values exactly, `unit_value`), then two FMAs a row: a
  third fewer operations a row from R = 2 on, and one more at R = 1, which Q4_1's table decoder saves by
  forming the block's 16 possible values (one FMA) and looking its values up (VALUES; docs/performance/
  quant.md, "affine values"). Q2_K, Q3_K and Q6_K (a scale per 16 elements) use the values, formed as
  gguf-py forms them.
  W rows j and j + 1 run together: independent FMA chains over one sequential stream, each unit
  prefetching its share of a later pair's bytes into L1 (the next pair, or the first at least 4 KiB on:
  `driver.ahead_of`), so that pair is in L1 when it starts (`rows_one`; the layouts measured against it:
  docs/performance/quant.md, "gguf_gemv"). K-quants go super-block by super-block (`_super`), the units
  written out so that their shifts are constants, the offsets as one vector FMA per super-block (mins times
  the units' sums of x). On AVX-512 hosts Q4_0, Q4_1 and Q4_K look their codes up by table
  (`nibble_tables`; Q4_K by unit pairs in `gguf_units.kpair_q4k_table`), the activations permuted to the lanes' order;
  on AVX2 hosts Q4_0 looks a block's codes up as bfloat16 bits (`nibble_tables.codes32`), and Q4_K and
  Q6_K take their codes from 32-bit words in place (`gguf_words`).
- 1 < R <= DECODE_ROWS: the one-row kernel's arithmetic for every row, each unit decoded once for up to
  four rows (`gguf_many`), so that a row's bytes never depend on R or on the other rows.

A row's output is its lanes summed in a fixed tree, plus (32-element blocks) the scalar offset accumulator
or less (K-quants) the offset vector's lanes summed the same way: one fixed sequence of f32 operations
whichever chunk, pair or thread computes it, so the bytes never depend on the thread count. K-quant
super-block scales are unpacked once per super-block into a 32-float stack scratch (ggml's 32-bit mask
tricks for the 6-bit fields), not once per unit; it stays in memory, so each scale is a broadcast load.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit
from numba.extending import intrinsic

from fuel.cpu.simd.driver import ahead_of, pair_bounds, pair_chunk_count
from fuel.cpu.simd.simd16 import (
    VEC,
    adds,
    fma,
    fma_lanes,
    fmas,
    hi8,
    hsum,
    muls,
    prefetch,
    splat_f32,
    stack_f32,
    vadd,
    vload,
    vmul,
    vzero,
)
from fuel.runtime import jobs
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import ADDRESS, INT, record_at

DECODE_ROWS = 16  # activation rows up to which this path runs, each row as at R = 1 (more go to tiles and sgemm)
CHUNKS = 256  # fixed chunks of row pairs (the split never depends on the thread count)
Z = np.float32(0)


# ---- the driver -------------------------------------------------------------------------------------

# kind bits: one scale per unit, offsets, offsets factored, K-quant, values by one FMA (`unit_value`), values
# looked up by the unit decoder
SHARED, BIAS, FACTOR_BIAS, SUPER, AFFINE, VALUES = 1, 2, 4, 8, 16, 32


@intrinsic
def _affine(typingctx: Any, v: Any, s: Any, b: Any) -> Any:
    """v * s + b for scalars s and b, fused: one rounding."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        s_, b_ = (splat_f32(context, builder, args[i], signature.args[i]) for i in (1, 2))
        return fma_lanes(builder, args[0], s_, b_)

    return VEC(v, s, b), codegen


affine: Any = _affine


@njit(inline="always", cache=True)
def unit_value(q: Any, s: Any, b: Any, kind: int) -> Any:
    """gguf-py's values: q * s, then + b where the type has offsets (two roundings, as gguf-py); with AFFINE
    as one FMA, the same values: q * s is exact in f32 for every type that uses it (an f16 scale times a
    code of at most 5 bits), so gguf-py's first rounding is none."""
    if kind & VALUES:  # the decoder looked the values up (`nibble_tables.nibble_values`)
        return q
    if kind & AFFINE:
        return affine(q, s, b)
    v = muls(q, s)
    return adds(v, b) if kind & BIAS else v


@njit(inline="always", cache=True)
def factored(kind: int) -> bool:
    return bool(kind & SHARED) and (not kind & BIAS or bool(kind & FACTOR_BIAS))


@njit(inline="always", cache=True)
def unit_dot(kind: int, q0: Any, q1: Any, s0: Any, b0: Any, w0: Any, w1: Any, x: Any, xo: int, acc: Any, macc: Any,
         sx: Any, su: int) -> Any:
    """(acc, macc) after one unit dotted with x[xo:xo + 32]: factored (codes q, scale s0, offset b0 times
    the activations' sum sx[su]) or by the values w0, w1."""
    if factored(kind):
        acc = fmas(s0, fma(q1, vload(x, xo + 16), vmul(q0, vload(x, xo))), acc)
        if kind & BIAS:
            macc += b0 * sx[su]
        return acc, macc
    return fma(w1, vload(x, xo + 16), fma(w0, vload(x, xo), acc)), macc


@njit(inline="always", cache=True)
def unit_codes(vals: Any, kind: int, bpb: int, row: Any, rb: int, u: int, sc: Any) -> Any:
    """Unit u of the row at byte rb: its codes, scale and offset, and its values where not factored."""
    if kind & SUPER:
        q0, q1, s0, s1, b0, b1 = vals(row, rb + bpb * (u >> 3), u & 7, sc)
    else:
        q0, q1, s0, s1, b0, b1 = vals(row, rb + bpb * u, 0, sc)
    if factored(kind):
        return q0, q1, s0, b0, q0, q1
    return q0, q1, s0, b0, unit_value(q0, s0, b0, kind), unit_value(q1, s1, b1, kind)


@njit(inline="always", cache=True)
def _next_pair(row: Any, rb: int, rb1: int, ahead: int, bpb: int, u: int) -> None:
    """At unit u of the adjacent rows rb, rb1, prefetch the unit-u bytes of the pair `ahead` on: one line a unit
    where the pair's 2·bpb bytes fit one, else a line in each row (Q8_0 and Q8_1: one line at every 2·bpb
    skips lines; docs/performance/quant.md, "gguf_gemv")."""
    if 2 * bpb <= 64:
        prefetch(row, rb + ahead + 2 * bpb * u)
    else:
        prefetch(row, rb + ahead + bpb * u)
        prefetch(row, rb1 + ahead + bpb * u)


@njit(inline="always", cache=True)
def _row2(vals: Any, prep: Any, bpb: int, kind: int, row: Any, rb: int, rb1: int, x: Any, i: int, i1: int,
          k: int, sx: Any, sc: Any, sc1: Any, ahead: int) -> tuple[Any, Any]:
    """W row rb with activation row i and W row rb1 with activation row i1, interleaved: independent FMA
    chains (each pair element the same operations whichever its partner). Where ahead > 0 the rows are
    adjacent (`rows_one`) and each unit prefetches its share of the next pair, `ahead` bytes on."""
    a0 = vzero()
    a1 = vzero()
    m0 = m1 = Z
    units = k // 32
    for u in range(units):
        if kind & SUPER and u & 7 == 0:
            prep(row, rb + bpb * (u >> 3), sc)
            prep(row, rb1 + bpb * (u >> 3), sc1)
        if ahead:
            _next_pair(row, rb, rb1, ahead, bpb, u)
        q0, q1, s0, b0, w0, w1 = unit_codes(vals, kind, bpb, row, rb, u, sc)
        a0, m0 = unit_dot(kind, q0, q1, s0, b0, w0, w1, x, i * k + 32 * u, a0, m0, sx, i * units + u)
        q0, q1, s0, b0, w0, w1 = unit_codes(vals, kind, bpb, row, rb1, u, sc1)
        a1, m1 = unit_dot(kind, q0, q1, s0, b0, w0, w1, x, i1 * k + 32 * u, a1, m1, sx, i1 * units + u)
    return hsum(a0) + m0, hsum(a1) + m1


@njit(inline="always", cache=True)
def _kunit(vals: Any, kind: int, row: Any, o: int, j: int, sc: Any, x: Any, xo: int, acc: Any) -> Any:
    """acc after unit j (a constant) of the super-block at byte o dotted with x[xo + 32j:]; a factored
    offset is left to the super-block's vector term (`_super`)."""
    q0, q1, s0, s1, b0, b1 = vals(row, o, j, sc)
    xo += 32 * j
    if factored(kind):
        return fmas(s0, fma(q1, vload(x, xo + 16), vmul(q0, vload(x, xo))), acc)
    return fma(unit_value(q1, s1, b1, kind), vload(x, xo + 16), fma(unit_value(q0, s0, b0, kind), vload(x, xo), acc))


@njit(inline="always", cache=True)
def _super(vals: Any, kind: int, prep: Any, row: Any, o: int, sc: Any, x: Any, xo: int, acc: Any, mv: Any,
           sx: Any, so: int) -> Any:
    """(acc, mv) after the super-block at byte o dotted with x[xo:xo + 256], R = 1: its units four at a
    time, written out, so that every shift is a constant (LLVM did not unroll a loop of Q6_K's units, and a
    variable byte shift costs x86 a widening to 16-bit lanes and back); Q4_K/Q5_K's factored offsets as one
    vector FMA, their mins (sc[8:16]) times the units' sums of x (sx[so + 8:so + 16], lanes 0-7 zero)."""
    prep(row, o, sc)
    for h in range(2):  # units 4h + c: every type's shifts depend on c only (Q3_K's high bits aside)
        acc = _kunit(vals, kind, row, o, 4 * h + 0, sc, x, xo, acc)
        acc = _kunit(vals, kind, row, o, 4 * h + 1, sc, x, xo, acc)
        acc = _kunit(vals, kind, row, o, 4 * h + 2, sc, x, xo, acc)
        acc = _kunit(vals, kind, row, o, 4 * h + 3, sc, x, xo, acc)
    if kind & FACTOR_BIAS:
        mv = fma(hi8(vload(sc, 0)), vload(sx, so), mv)
    return acc, mv


@njit(inline="always", cache=True)
def prefetch_pair(row: Any, rb: int, ahead: int, bpb: int, b: int) -> None:
    """Prefetch the 2·bpb bytes at rb + ahead + 2·bpb·b: at a pair's super-block b, the pair's `ahead` on
    (two adjacent rows of super-blocks of bpb bytes, `rows_one`)."""
    for t in range(0, 2 * bpb, 64):
        prefetch(row, rb + ahead + 2 * bpb * b + t)


@njit(inline="always", cache=True)
def pair_supers(sup: Any, vals: Any, kind: int, prep: Any, bpb: int, row: Any, rb: int, rb1: int, x: Any, k: int,
                sx: Any, sc: Any, sc1: Any, ahead: int) -> tuple[Any, Any, Any, Any]:
    """The (products, offsets) accumulators of K-quant W rows rb and rb1 over their super-blocks, each
    taken by `sup(vals, kind, prep, row, o, sc, x, xo, acc, mv, sx, so)` (`_super`, or a table or word
    decoder's super-block), the next pair's bytes prefetched (`prefetch_pair`)."""
    a0 = vzero()
    a1 = vzero()
    m0 = vzero()
    m1 = vzero()
    for b in range(k // 256):
        prefetch_pair(row, rb, ahead, bpb, b)
        a0, m0 = sup(vals, kind, prep, row, rb + bpb * b, sc, x, 256 * b, a0, m0, sx, 16 * b)
        a1, m1 = sup(vals, kind, prep, row, rb1 + bpb * b, sc1, x, 256 * b, a1, m1, sx, 16 * b)
    return a0, m0, a1, m1


@njit(inline="always", cache=True)
def kpair(vals: Any, prep: Any, bpb: int, kind: int, row: Any, rb: int, rb1: int, x: Any, k: int, sx: Any,
           sc: Any, sc1: Any, ahead: int) -> tuple[Any, Any]:
    """K-quant W rows rb and rb1 dotted with x (R = 1), super-block by super-block: Σ lanes of the
    products, less Σ lanes of the offset terms (one fixed sequence per row, whichever its partner)."""
    a0, m0, a1, m1 = pair_supers(_super, vals, kind, prep, bpb, row, rb, rb1, x, k, sx, sc, sc1, ahead)
    return hsum(a0) - hsum(m0), hsum(a1) - hsum(m1)


@njit(inline="always", cache=True)
def bpair(vals: Any, prep: Any, bpb: int, kind: int, row: Any, rb: int, rb1: int, x: Any, k: int, sx: Any,
           sc: Any, sc1: Any, ahead: int) -> tuple[Any, Any]:
    """32-element block W rows rb and rb1 dotted with x (R = 1), the next pair's bytes (`ahead` on)
    prefetched as they go."""
    return _row2(vals, prep, bpb, kind, row, rb, rb1, x, 0, 0, k, sx, sc, sc1, ahead)


@njit(inline="always", cache=True)
def rows_one(vals: Any, prep: Any, bpb: int, kind: int, a: Any, w: Any, out: Any, c: int, sx: Any, x: Any,
              row: Any, pair: Any) -> None:
    """Chunk c of out <- a @ dequant(w)ᵀ for one activation row (x and row: a and w flat; pair: the two-row
    dot, `bpair` or `kpair`): W rows j and j + 1 together, one sequential stream, while the pair's dot
    prefetches a pair ahead's bytes (`ahead_of`) into L1 as it goes."""
    k = a.shape[1]
    lo, hi = pair_bounds(c, w.shape[0])
    rl = w.shape[1]
    sc0 = carray(stack_f32(32), (32,))
    sc1 = carray(stack_f32(32), (32,))
    ahead = ahead_of(2 * rl)
    for j in range(lo, hi, 2):
        j1 = min(j + 1, hi - 1)  # an odd last row as a pair with itself: the same operations
        out[0, j], out[0, j1] = pair(vals, prep, bpb, kind, row, rl * j, rl * j1, x, k, sx, sc0, sc1, ahead)


@njit(inline="always", cache=True)
def part_chunks(part: int, parts: int, n: int) -> tuple[int, int]:
    """Chunks [c0, c1) of part `part` of `parts` (of n W rows): whole chunks, so a row's bytes never depend
    on the part count."""
    chunks = pair_chunk_count(n)
    return part * chunks // parts, (part + 1) * chunks // parts


# A decode job's record: activations a [rows, k] f32, the weight's raw rows w [n, row_bytes] u8, out [rows, n].
GEMV_ARGS = jobs.record(a=ADDRESS, rows=INT, k=INT, w=ADDRESS, n=INT, row_bytes=INT, out=ADDRESS)


@njit(cache=True)
def fill_gemv_args(a: Any, w: Any, out: Any, argv: Any) -> None:
    """argv[0] <- the record `gemv_args` reads for a [rows, k] f32, w [n, row bytes] u8 and out [rows, n] f32."""
    v = argv[0]
    v.a, v.rows, v.k = a.ctypes.data, a.shape[0], a.shape[1]
    v.w, v.n, v.row_bytes, v.out = w.ctypes.data, w.shape[0], w.shape[1], out.ctypes.data


@njit(inline="always", cache=True)
def gemv_args(argv: int) -> tuple[Any, Any, Any]:
    """A decode task's (a, w, out) from its record (`GEMV_ARGS`)."""
    v = record_at(argv, GEMV_ARGS)
    a = carray(pointer(v.a, np.float32), (v.rows, v.k))
    w = carray(pointer(v.w, np.uint8), (v.n, v.row_bytes))
    return a, w, carray(pointer(v.out, np.float32), (v.rows, v.n))


@njit(inline="always", cache=True)
def activations_as_given(a: Any) -> Any:
    """The m rows after a [m, k] in memory: the table kernels' activations in their own order, as given."""
    return carray(pointer(a.ctypes.data + 4 * a.size, np.float32), a.shape)


# ---- the task templates: each type's decode tasks (`gguf_kernels`, generated) are one call of these -------


@njit(inline="always", cache=True)
def one_row(vals: Any, prep: Any, bpb: int, kind: int, pair: Any, part: int, parts: int, argv: int) -> None:
    """Part `part` of one activation row's job: its chunks of W row pairs, each pair by `pair`."""
    a, w, out = gemv_args(argv)
    sx, x, row = block_sums(a, kind), a.reshape(a.size), w.reshape(w.size)
    for c in range(*part_chunks(part, parts, w.shape[0])):
        rows_one(vals, prep, bpb, kind, a, w, out, c, sx, x, row, pair)


@njit(inline="always", cache=True)
def one_row_permuted(vals: Any, prep: Any, bpb: int, kind: int, pair: Any, part: int, parts: int,
                     argv: int) -> None:
    """`one_row` of a table decoder: a holds the activations permuted to its lanes' order, the row after it
    them as given (`nibble_tables.permuted`), which the block sums read."""
    a, w, out = gemv_args(argv)
    sx, x, row = block_sums(activations_as_given(a), kind), a.reshape(a.size), w.reshape(w.size)
    for c in range(*part_chunks(part, parts, w.shape[0])):
        rows_one(vals, prep, bpb, kind, a, w, out, c, sx, x, row, pair)


@njit(inline="always", cache=True)
def block_sums(a: Any, kind: int) -> Any:
    """Σ of each 32 activations of each row (fixed order) for the factored offset terms, row r's from
    r·(size / m): one a unit (32-element blocks), or 16 a super-block with its eight sums in slots 8-15
    (K-quants, `_super`). One zero where the type factors no offset."""
    m, k = a.shape
    if not kind & FACTOR_BIAS:
        return np.zeros(1, np.float32)
    per = k // 16 if kind & SUPER else k // 32
    sx = np.zeros(m * per, np.float32)
    x = a.reshape(a.size)
    for r in range(m):
        for u in range(k // 32):
            at = r * per + (16 * (u >> 3) + 8 + (u & 7) if kind & SUPER else u)
            sx[at] = hsum(vadd(vload(x, r * k + 32 * u), vload(x, r * k + 32 * u + 16)))
    return sx
