"""QMatMul's decode path at 2 <= R <= ROW_INVARIANT_ROWS activation rows, row-invariant: every output is
the one-row kernel's own sequence of f32 operations on its row, so a row's bytes never depend on R or on
the other rows (the server batches requests: their tokens must not depend on what else is in the batch).

Each one-row kernel (`gguf_gemv.bpair`/`kpair`, the table and words kernels) has a four-row form here that
decodes each weight unit once (codes, scales, the values where the one-row kernel forms them) and applies
the one-row kernel's per-row operations to four activation rows, each into its own accumulators, summed by
the same lane tree: `bquad` (32-element blocks, any unit decoder), `kquad` with a super-block form
(`super4`: the portable K-quants; `super4_q4k_table`; `super4_q4k_words`, `super4_q6k_words`).

A job's W rows are cut in the one-row path's fixed chunks; in each, the activation rows go four at a time
(a last three or two as a group of three or two, whose absent rows' work is skipped: a last three as a four
took ~1.2x the time, docs/performance/quant.md, "many-row replay"), each group over the chunk's W rows, whose
bytes stay in cache for the next group, and a last single row by the one-row kernel's own pair of W rows.
The activations are those the one-row kernel reads, for every row: as given, permuted to a table kernel's
lanes, or in a words kernel's lanes and scale (`word_rows`); each part makes its own copy, so a job reads a,
w and out only.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.quant.gguf_gemv import (
    FACTOR_BIAS,
    block_sums,
    factored,
    gemv_args,
    part_chunks,
    unit_codes,
    unit_dot,
    unit_value,
)
from fuel.cpu.quant.gguf_words import EVEN_PAIRS, GROUP, ODD_PAIRS, QUADS, code6, nibble, q6k_words, spread, words
from fuel.cpu.quant.gguf_words import word_activations as _word_activations
from fuel.cpu.quant.nibble_tables import nibble_codes, pair_scales, permuted
from fuel.cpu.simd.driver import pair_bounds
from fuel.cpu.simd.simd16 import fma, fmas, hi8, hsum, stack_f32, vadd, vload, vmul, vzero
from fuel.runtime.atomics import pointer

Z = np.float32(0)


# ---- one W row with four activation rows (t: their offsets in x; s: in the block sums sx) -------------------


@njit(inline="always", cache=True)
def bquad(sup: Any, how: int, vals: Any, prep: Any, bpb: int, kind: int, row: Any, rb: int, x: Any, t: Any, k: int,
          sx: Any, s: Any, sc: Any, nr: int) -> Any:
    """The 32-element block W row at byte rb with the activation rows at x[t[r]:] (block sums at sx[s[r]:]),
    r < nr (2, 3 or 4): `gguf_gemv._row2`'s operations for each row, each unit decoded once (sup and how, the
    K-quant forms' arguments, unused)."""
    a0 = vzero()
    a1 = vzero()
    a2 = vzero()
    a3 = vzero()
    m0 = m1 = m2 = m3 = Z
    for u in range(k // 32):
        q0, q1, s0, b0, w0, w1 = unit_codes(vals, kind, bpb, row, rb, u, sc)
        a0, m0 = unit_dot(kind, q0, q1, s0, b0, w0, w1, x, t[0] + 32 * u, a0, m0, sx, s[0] + u)
        a1, m1 = unit_dot(kind, q0, q1, s0, b0, w0, w1, x, t[1] + 32 * u, a1, m1, sx, s[1] + u)
        if nr > 2:
            a2, m2 = unit_dot(kind, q0, q1, s0, b0, w0, w1, x, t[2] + 32 * u, a2, m2, sx, s[2] + u)
        if nr > 3:
            a3, m3 = unit_dot(kind, q0, q1, s0, b0, w0, w1, x, t[3] + 32 * u, a3, m3, sx, s[3] + u)
    return hsum(a0) + m0, hsum(a1) + m1, hsum(a2) + m2, hsum(a3) + m3


@njit(inline="always", cache=True)
def _offsets(kind: int, sc: Any, sx: Any, s: Any, b: int, mv: Any, nr: int) -> Any:
    """The four rows' offset accumulators after a super-block's factored offsets (`gguf_gemv._super`)."""
    if not kind & FACTOR_BIAS:
        return mv
    mins = hi8(vload(sc, 0))
    m0 = fma(mins, vload(sx, s[0] + 16 * b), mv[0])
    m1 = fma(mins, vload(sx, s[1] + 16 * b), mv[1])
    m2 = fma(mins, vload(sx, s[2] + 16 * b), mv[2]) if nr > 2 else mv[2]
    m3 = fma(mins, vload(sx, s[3] + 16 * b), mv[3]) if nr > 3 else mv[3]
    return m0, m1, m2, m3


@njit(inline="always", cache=True)
def _kunit4(vals: Any, kind: int, row: Any, o: int, j: int, sc: Any, x: Any, xo: Any, acc: Any, nr: int) -> Any:
    """`gguf_gemv._kunit` for four rows (xo: their offsets), the unit decoded (and its values formed) once."""
    q0, q1, s0, s1, b0, b1 = vals(row, o, j, sc)
    at = 32 * j
    if factored(kind):
        r0 = fmas(s0, fma(q1, vload(x, xo[0] + at + 16), vmul(q0, vload(x, xo[0] + at))), acc[0])
        r1 = fmas(s0, fma(q1, vload(x, xo[1] + at + 16), vmul(q0, vload(x, xo[1] + at))), acc[1])
        r2 = fmas(s0, fma(q1, vload(x, xo[2] + at + 16), vmul(q0, vload(x, xo[2] + at))), acc[2]) if nr > 2 else acc[2]
        r3 = fmas(s0, fma(q1, vload(x, xo[3] + at + 16), vmul(q0, vload(x, xo[3] + at))), acc[3]) if nr > 3 else acc[3]
        return r0, r1, r2, r3
    w0, w1 = unit_value(q0, s0, b0, kind), unit_value(q1, s1, b1, kind)
    r0 = fma(w1, vload(x, xo[0] + at + 16), fma(w0, vload(x, xo[0] + at), acc[0]))
    r1 = fma(w1, vload(x, xo[1] + at + 16), fma(w0, vload(x, xo[1] + at), acc[1]))
    r2 = fma(w1, vload(x, xo[2] + at + 16), fma(w0, vload(x, xo[2] + at), acc[2])) if nr > 2 else acc[2]
    r3 = fma(w1, vload(x, xo[3] + at + 16), fma(w0, vload(x, xo[3] + at), acc[3])) if nr > 3 else acc[3]
    return r0, r1, r2, r3


@njit(inline="always", cache=True)
def super4(vals: Any, kind: int, prep: Any, row: Any, o: int, sc: Any, x: Any, xo: Any, acc: Any, mv: Any,
           sx: Any, s: Any, b: int, nr: int) -> Any:
    """`gguf_gemv._super` (the portable K-quant super-block at byte o) for four rows."""
    prep(row, o, sc)
    for h in range(2):
        acc = _kunit4(vals, kind, row, o, 4 * h + 0, sc, x, xo, acc, nr)
        acc = _kunit4(vals, kind, row, o, 4 * h + 1, sc, x, xo, acc, nr)
        acc = _kunit4(vals, kind, row, o, 4 * h + 2, sc, x, xo, acc, nr)
        acc = _kunit4(vals, kind, row, o, 4 * h + 3, sc, x, xo, acc, nr)
    return acc, _offsets(kind, sc, sx, s, b, mv, nr)


@njit(inline="always", cache=True)
def _inner4(c0: Any, c1: Any, c2: Any, c3: Any, x: Any, at: int, step: int) -> Any:
    """fma(c3, x3, fma(c2, x2, fma(c1, x1, c0·x0))), xi = x[at + i·step:]: a table or words kernel's inner sum."""
    return fma(c3, vload(x, at + 3 * step), fma(c2, vload(x, at + 2 * step),
                                                fma(c1, vload(x, at + step), vmul(c0, vload(x, at)))))


@njit(inline="always", cache=True)
def super4_q4k_table(vals: Any, kind: int, prep: Any, row: Any, o: int, sc: Any, x: Any, xo: Any, acc: Any,
                     mv: Any, sx: Any, s: Any, b: int, nr: int) -> Any:
    """`gguf_units._super_q4k_table` for four rows."""
    prep(row, o, sc)
    a0, a1, a2, a3 = acc
    for p in range(4):
        src, xp = o + 16 + 32 * p, 64 * p
        c0, c1 = nibble_codes(row, src, 0), nibble_codes(row, src + 8, 0)
        c2, c3 = nibble_codes(row, src + 16, 0), nibble_codes(row, src + 24, 0)
        ps = pair_scales(sc, 2 * p)
        a0 = fma(ps, _inner4(c0, c1, c2, c3, x, xo[0] + xp, 16), a0)
        a1 = fma(ps, _inner4(c0, c1, c2, c3, x, xo[1] + xp, 16), a1)
        if nr > 2:
            a2 = fma(ps, _inner4(c0, c1, c2, c3, x, xo[2] + xp, 16), a2)
        if nr > 3:
            a3 = fma(ps, _inner4(c0, c1, c2, c3, x, xo[3] + xp, 16), a3)
    return (a0, a1, a2, a3), _offsets(kind, sc, sx, s, b, mv, nr)


@njit(inline="always", cache=True)
def _words_row(n: Any, sc: Any, g: int, x: Any, xg: int, acc: Any) -> Any:
    """One row's share of a Q4_K words group (`gguf_words._super`): n the eight nibble vectors."""
    ev = vmul(n[0], vload(x, xg))
    od = vmul(n[1], vload(x, xg + 16))
    ev = fma(n[2], vload(x, xg + 32), ev)
    od = fma(n[3], vload(x, xg + 48), od)
    ev = fma(n[4], vload(x, xg + 64), ev)
    od = fma(n[5], vload(x, xg + 80), od)
    ev = fma(n[6], vload(x, xg + 96), ev)
    od = fma(n[7], vload(x, xg + 112), od)
    acc = fma(spread(sc, 4 * g, EVEN_PAIRS), ev, acc)
    return fma(spread(sc, 4 * g, ODD_PAIRS), od, acc)


@njit(inline="always", cache=True)
def super4_q4k_words(vals: Any, kind: int, prep: Any, row: Any, o: int, sc: Any, x: Any, xo: Any, acc: Any,
                     mv: Any, sx: Any, s: Any, b: int, nr: int) -> Any:
    """`gguf_words._super` (Q4_K by words) for four rows: each group's eight nibble vectors taken once."""
    prep(row, o, sc)
    a0, a1, a2, a3 = acc
    for g in range(2):
        v = words(row, o + 16 + 64 * g)
        n = (nibble(v, 0), nibble(v, 1), nibble(v, 2), nibble(v, 3), nibble(v, 4), nibble(v, 5), nibble(v, 6),
             nibble(v, 7))
        a0 = _words_row(n, sc, g, x, xo[0] + GROUP * g, a0)
        a1 = _words_row(n, sc, g, x, xo[1] + GROUP * g, a1)
        if nr > 2:
            a2 = _words_row(n, sc, g, x, xo[2] + GROUP * g, a2)
        if nr > 3:
            a3 = _words_row(n, sc, g, x, xo[3] + GROUP * g, a3)
    return (a0, a1, a2, a3), _offsets(kind, sc, sx, s, b, mv, nr)


@njit(inline="always", cache=True)
def _q6k_row(first: Any, last: Any, sc: Any, h: int, x: Any, xh: int, acc: Any, acc1: Any) -> Any:
    """One row's share of a Q6_K words half super-block (`gguf_words._super_q6k`)."""
    inner = _inner4(code6(first, 0), code6(first, 1), code6(first, 2), code6(first, 3), x, xh, 16)
    acc = fma(spread(sc, 8 * h, QUADS), inner, acc)
    inner = _inner4(code6(last, 0), code6(last, 1), code6(last, 2), code6(last, 3), x, xh + 64, 16)
    return acc, fma(spread(sc, 8 * h + 4, QUADS), inner, acc1)


@njit(inline="always", cache=True)
def super4_q6k_words(vals: Any, kind: int, prep: Any, row: Any, o: int, sc: Any, x: Any, xo: Any, acc: Any,
                     mv: Any, sx: Any, s: Any, b: int, nr: int) -> Any:
    """`gguf_words._super_q6k` for four rows (mv: the second accumulators, of each half's last 64)."""
    prep(row, o, sc)
    a0, a1, a2, a3 = acc
    m0, m1, m2, m3 = mv
    for h in range(2):
        first, last = q6k_words(row, o + 64 * h, o + 128 + 32 * h)
        a0, m0 = _q6k_row(first, last, sc, h, x, xo[0] + GROUP * h, a0, m0)
        a1, m1 = _q6k_row(first, last, sc, h, x, xo[1] + GROUP * h, a1, m1)
        if nr > 2:
            a2, m2 = _q6k_row(first, last, sc, h, x, xo[2] + GROUP * h, a2, m2)
        if nr > 3:
            a3, m3 = _q6k_row(first, last, sc, h, x, xo[3] + GROUP * h, a3, m3)
    return (a0, a1, a2, a3), (m0, m1, m2, m3)


# How a family's accumulators end (its one-row pair's return): WITH_OFFSETS Σ acc - Σ mv (portable, table),
# SCALED_OFFSETS (Σ acc)·x[k] - Σ mv (Q4_K words), SCALED_SUM Σ (acc + mv)·x[k] (Q6_K words).
WITH_OFFSETS, SCALED_OFFSETS, SCALED_SUM = 0, 1, 2


@njit(inline="always", cache=True)
def _end(how: int, a: Any, m: Any, x: Any, xk: int) -> Any:
    if how == WITH_OFFSETS:
        return hsum(a) - hsum(m)
    if how == SCALED_OFFSETS:
        return hsum(a) * x[xk] - hsum(m)
    return hsum(vadd(a, m)) * x[xk]


@njit(inline="always", cache=True)
def kquad(sup: Any, how: int, vals: Any, prep: Any, bpb: int, kind: int, row: Any, rb: int, x: Any, t: Any,
          k: int, sx: Any, s: Any, sc: Any, nr: int) -> Any:
    """The K-quant W row at byte rb with the activation rows at x[t[r]:], r < nr, super-block by super-block
    (`sup`: a `super4` form), ended as the one-row pair ends (`how`)."""
    z = vzero()
    acc = (z, z, z, z)
    mv = (z, z, z, z)
    for b in range(k // 256):
        xo = (t[0] + 256 * b, t[1] + 256 * b, t[2] + 256 * b, t[3] + 256 * b)
        acc, mv = sup(vals, kind, prep, row, rb + bpb * b, sc, x, xo, acc, mv, sx, s, b, nr)
    return (_end(how, acc[0], mv[0], x, t[0] + k), _end(how, acc[1], mv[1], x, t[1] + k),
            _end(how, acc[2], mv[2], x, t[2] + k), _end(how, acc[3], mv[3], x, t[3] + k))


# ---- the driver and the task templates ------------------------------------------------------------------


@njit(inline="always", cache=True)
def _tail(x: Any, at: int) -> Any:
    """x[at:] of a contiguous f32 vector, as a contiguous array."""
    return carray(pointer(x.ctypes.data + 4 * at, np.float32), (x.size - at,))


@njit(inline="always", cache=True)
def _group(quad: Any, sup: Any, how: int, vals: Any, prep: Any, bpb: int, kind: int, row: Any, rl: int, lo: int,
           hi: int, x: Any, xs: int, k: int, sx: Any, ss: int, sc: Any, out: Any, g: int, m: int, nr: int) -> None:
    """out[g:g + nr, lo:hi]: W rows lo..hi with activation rows g..g + nr - 1 (nr = 2, 3 or 4; the offsets
    of rows past the last repeat it, their accumulators unused)."""
    i = (g, g + 1, min(g + 2, m - 1), min(g + 3, m - 1))
    t = (i[0] * xs, i[1] * xs, i[2] * xs, i[3] * xs)
    s = (i[0] * ss, i[1] * ss, i[2] * ss, i[3] * ss)
    for j in range(lo, hi):
        y = quad(sup, how, vals, prep, bpb, kind, row, rl * j, x, t, k, sx, s, sc, nr)
        out[i[0], j] = y[0]
        out[i[1], j] = y[1]
        if nr > 2:
            out[i[2], j] = y[2]
        if nr > 3:
            out[i[3], j] = y[3]


@njit(inline="always", cache=True)
def _chunk(quad: Any, sup: Any, how: int, pair: Any, vals: Any, prep: Any, bpb: int, kind: int, w: Any, out: Any,
           c: int, x: Any, xs: int, k: int, sx: Any, ss: int) -> None:
    """Chunk c of out <- a @ dequant(w)ᵀ (x: the m activation rows as the one-row kernel reads them, xs
    apart; sx: their block sums, ss apart)."""
    m = out.shape[0]
    lo, hi = pair_bounds(c, w.shape[0])
    rl = w.shape[1]
    row = w.reshape(w.size)
    sc = carray(stack_f32(32), (32,))
    sc1 = carray(stack_f32(32), (32,))
    g = 0
    while m - g >= 4:
        _group(quad, sup, how, vals, prep, bpb, kind, row, rl, lo, hi, x, xs, k, sx, ss, sc, out, g, m, 4)
        g += 4
    if m - g >= 2:
        _group(quad, sup, how, vals, prep, bpb, kind, row, rl, lo, hi, x, xs, k, sx, ss, sc, out, g, m, m - g)
    elif m - g == 1:  # the one-row kernel's pairs of W rows, for the last row
        xg, sg = _tail(x, g * xs), _tail(sx, g * ss)
        for j in range(lo, hi, 2):
            j1 = min(j + 1, hi - 1)
            out[g, j], out[g, j1] = pair(vals, prep, bpb, kind, row, rl * j, rl * j1, xg, k, sg, sc, sc1, 0)


@njit(inline="always", cache=True)
def many_rows(vals: Any, prep: Any, bpb: int, kind: int, pair: Any, quad: Any, sup: Any, how: int, part: int,
              parts: int, argv: int) -> None:
    """Part `part` of a 2..ROW_INVARIANT_ROWS activation rows job of a portable kernel (`pair`: its one-row
    pair; quad: `bquad`, or `kquad` with its super-block form `sup`)."""
    a, w, out = gemv_args(argv)
    m, k = a.shape
    sx = block_sums(a, kind)
    for c in range(*part_chunks(part, parts, w.shape[0])):
        _chunk(quad, sup, how, pair, vals, prep, bpb, kind, w, out, c, a.reshape(a.size), k, k, sx, sx.size // m)


@njit(inline="always", cache=True)
def many_rows_permuted(vals: Any, prep: Any, bpb: int, kind: int, pair: Any, quad: Any, sup: Any, how: int,
                       order: Any, part: int, parts: int, argv: int) -> None:
    """`many_rows` of a table kernel: each part permutes its own copy of the rows to the kernel's lanes'
    order (`nibble_tables.permuted`), so the job reads a as given and can be posted again."""
    a, w, out = gemv_args(argv)
    m, k = a.shape
    sx = block_sums(a, kind)
    x = permuted(a, order)[0]
    for c in range(*part_chunks(part, parts, w.shape[0])):
        _chunk(quad, sup, how, pair, vals, prep, bpb, kind, w, out, c, x, k, k, sx, sx.size // m)


@njit(inline="always", cache=True)
def word_rows(a: Any, layout: int) -> Any:
    """Each row of a [m, k] as `gguf_words.word_activations` gives it alone: k + 1 floats a row."""
    m, k = a.shape
    out = np.empty(m * (k + 1), np.float32)
    for r in range(m):
        out[r * (k + 1):(r + 1) * (k + 1)] = _word_activations(carray(pointer(a.ctypes.data + 4 * r * k, np.float32),
                                                                      (1, k)), layout)
    return out


@njit(inline="always", cache=True)
def many_rows_words(vals: Any, prep: Any, bpb: int, kind: int, pair: Any, quad: Any, sup: Any, how: int,
                    layout: int, part: int, parts: int, argv: int) -> None:
    """`many_rows` of a words kernel: each part lays out its own copy of the rows (`word_rows`)."""
    a, w, out = gemv_args(argv)
    m, k = a.shape
    sx = block_sums(a, kind)
    x = word_rows(a, layout)
    for c in range(*part_chunks(part, parts, w.shape[0])):
        _chunk(quad, sup, how, pair, vals, prep, bpb, kind, w, out, c, x, k + 1, k, sx, sx.size // m)
