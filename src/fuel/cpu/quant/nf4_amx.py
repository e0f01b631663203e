"""Nf4Matmul's many-row forward product on AMX tiles (`amx`), f32-accurate from bf16 pieces.

`out = x @ dequant(W)ᵀ` with `dequant(W)[n, k] = NF4[code] * absmax[n, k // bs]` is computed block by
block as `out[m, n] = Σ_b absmax[n, b] · Σ_{k in b} x[m, k] · NF4[code[n, k]]`. The inner sums run on the
tiles in bf16 pieces with f32 sums: every f32 is the exact sum of three bf16 (`split3`: the nearest bf16,
then the nearest bf16 to what is left, then the rest, which fits), so `x · t = Σ_{i,j} x_i · t_j` exactly,
and the six products with i + j <= 2 are kept. Each tile product adds exact bf16 x bf16 products into
f32, rounding each sum, so a block's inner sum is one rounded f32 chain over its 6·bs products, and each
block's sum is scaled by its absmax and added with one FMA (AVX-512) in block order. bf16 activations are
one piece (three products), f16 two (five): their products are exact.

The guaranteed bound, with u = 2^-24 and S = |x| @ |dequant(W)|ᵀ (dequant(W) unrounded, as bitsandbytes'
f32 dequantisation rounds it once more, by at most u·S):
    |out - x @ dequant(W)ᵀ| <= 1.02 · (6·bs + K/bs + 1) · u · S.
Why: a dropped product x_i·t_j (i + j >= 3) has |x_1|, |t_1| <= 2^-8 and |x_2|, |t_2| <= 2^-16 of |x|, |t|,
so the three together are at most (2 + 2^-8)·u·|x|·|t|; a rounded chain of L terms errs by at most
γ(L-1)·Σ|terms| (γ(n) = n·u / (1 - n·u)), and the kept pieces' magnitudes sum to at most 1.016·|x|·|t|:
(6·bs - 1)·u·1.016·S for the inner sums, K/bs·u·1.016·S for the FMA chain over the blocks; the factor
1.02 covers these constants and the second-order terms. It holds where the tiles flush nothing, which
is what the range checks below ensure. Typical errors are far smaller (docs/performance/nf4.md,
"nf4_amx").

The tiles treat denormal inputs and results as zero, so the path is taken only where every nonzero
activation lies between `TINY` and `HUGE` in magnitude (`split_activations` reports it; NaN, Inf and
values outside go to the f32 path instead): then every kept product is at least 2^-116, well clear of
the denormals, and no block's inner sum can overflow where the scaled one would not. absmax must be
finite too (the factored absmax would turn a dequantised 0·Inf NaN into an Inf).

Layout: for each 64 k, the tile products run over its 32 even k (the high nibbles of its 32 bytes: step
0) and then its 32 odd k (the low nibbles: step 1). A W tile is 16 rows of 32 bf16 pieces of NF4 values,
decoded per 64 k of a row by one zero-extension of its 32 bytes to 16-bit lanes, one shift and a 32-entry
`vpermw` per piece and step (`_decode_group`); activation tiles are the pieces in VNNI pairs, laid out
once per call (`split_activations`). Each part of the job takes 32 W rows at a time (two W tiles) against
two activation tiles (16 rows each): four f32 tiles, two W tiles and two activation tiles.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from fuel.cpu.simd import amx
from fuel.cpu.simd.simd16 import fmas, prefetch, vload, vstore
from fuel.cpu.simd.vecmath import bf16_to_f32, f32_to_bf16
from fuel.quant.nf4 import NF4
from fuel.runtime import jobs, pool, threads
from fuel.runtime.atomics import claim_slot, pointer, release_slot
from fuel.runtime.jobs import ADDRESS, INT, record_at

PIECES = 3  # bf16 pieces of an f32
GROUP = 64  # k per group: two tile steps of 32 (its even k, then its odd k)
ROWS = 2 * amx.ROWS  # W rows a part takes at a time
TINY = np.float32(2.0**-66)  # nonzero activations below this take the f32 path (see the module)
HUGE = np.float32(2.0**100)  # and so do those above this
_TILE = amx.ROWS * amx.ROW_BYTES // 2  # 16-bit elements in a tile
_STEP = PIECES * 2 * _TILE  # a step's W tiles: pieces x two W tiles
_A_GROUP = 2 * _STEP  # a group's W tiles: two steps
SPLIT_SECONDS_PER_VALUE = 2e-9  # one core's time to split an activation into its pieces
MACS_PER_SECOND = 60e9  # about one core's rate on the tiles, f32 (for the part count)
SKEW = 17 * 64  # bytes between scratch areas that would otherwise sit a multiple of 4 KiB apart
# How far past the bytes it decodes a decoding prefetches its W row: two lines, not the next one
# (docs/performance/nf4.md, "nf4_amx").
W_AHEAD = 128


def error_bound(k: int, bs: int) -> float:
    """The module's guaranteed bound on |out - x @ dequant(W)ᵀ|, as a fraction of |x| @ |dequant(W)|ᵀ."""
    return 1.02 * (6 * bs + k // bs + 1) * 2.0**-24


def split3(v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The bf16 bits (uint16) of three pieces whose exact sum is the finite f32 v: the nearest bf16, the
    nearest to what is left, and the rest (ml_dtypes rounds to nearest even)."""
    pieces = []
    rest = np.asarray(v, np.float32)
    for _ in range(PIECES):
        p = rest.astype(ml_dtypes.bfloat16)
        pieces.append(p.view(np.uint16))
        rest = rest - p.astype(np.float32)
    return pieces[0], pieces[1], pieces[2]


def _tables() -> np.ndarray:
    """[pieces, 32] uint16: each piece of the 16 NF4 values, twice (a `vpermw` index reads 5 bits, and the
    unmasked low-nibble index carries the high nibble's low bit in bit 4)."""
    out = np.empty((PIECES, 32), np.uint16)
    for p, bits in enumerate(split3(NF4)):
        out[p] = np.tile(bits, 2)
    return out


TABLES = amx.aligned_empty(PIECES * 32, np.uint16).reshape(PIECES, 32)
TABLES[:] = _tables()
CONFIG = amx.config()


@njit(inline="always", cache=True)
def _split_tile(x: Any, t: int, tiles: int, out: Any, loc: Any) -> bool:
    """Activation tile t's pieces into out (`split_activations`' layout), 64 k at a time through loc
    [PIECES, 16, 64] (the pieces in k order: the reads of out's pair order stay in L1). False where a value
    would leave the tiles' range."""
    m_rows, k = x.shape
    per_step = PIECES * tiles * _TILE
    for g in range(k // GROUP):
        for m in range(amx.ROWS):
            i = amx.ROWS * t + m
            bad = False
            for q in range(GROUP):
                v = x[i, GROUP * g + q] if i < m_rows else np.float32(0)
                a = abs(v)
                bad |= not a <= HUGE or (a > 0 and a < TINY)  # NaN fails the first test
                p1 = f32_to_bf16(v)
                rest = v - bf16_to_f32(p1)
                p2 = f32_to_bf16(rest)
                loc[0, m, q], loc[1, m, q], loc[2, m, q] = p1, p2, f32_to_bf16(rest - bf16_to_f32(p2))
            if bad:
                return False
        for s in range(2):
            for p in range(PIECES):
                o = (g * 2 + s) * per_step + (p * tiles + t) * _TILE
                for r in range(amx.ROWS):
                    for m in range(amx.ROWS):
                        out[o + r * 32 + 2 * m] = loc[p, m, 4 * r + s]
                        out[o + r * 32 + 2 * m + 1] = loc[p, m, 4 * r + 2 + s]
    return True


# `split_activations`' record: x [rows, k], the activation tiles and their count, a flag a tile.
SPLIT_ARGS = jobs.record(x=ADDRESS, rows=INT, k=INT, out=ADDRESS, tiles=INT, flags=ADDRESS)


@pool.task()
def _split_part(part: int, parts: int, argv: int) -> None:
    """Part `part` of `split_activations`' tiles."""
    v = record_at(argv, SPLIT_ARGS)
    x = carray(pointer(v.x, np.float32), (v.rows, v.k))
    tiles = v.tiles
    out = carray(pointer(v.out, np.uint16), (v.k // GROUP * 2 * PIECES * tiles * _TILE,))
    flags = carray(pointer(v.flags, np.int64), (tiles,))
    loc = np.empty((PIECES, amx.ROWS, GROUP), np.uint16)
    for t in range(part * tiles // parts, (part + 1) * tiles // parts):
        flags[t] = 0 if _split_tile(x, t, tiles, out, loc) else 1


def split_activations(x: np.ndarray, tiles: int, out: np.ndarray) -> bool:
    """out <- x's pieces as activation tiles: out[g, s, p, t, r, m, j] = piece p of x[16t + m, 64g + 4r + 2j
    + s] (zero past x's rows), for `tiles` tiles of 16 rows, the tiles split over threads. False (out
    unfinished) where x holds a NaN or a nonzero value outside [`TINY`, `HUGE`] in magnitude."""
    flags = np.zeros(tiles, np.int64)
    argv = jobs.argv_of(SPLIT_ARGS)
    argv[0] = (x.ctypes.data, x.shape[0], x.shape[1], out.ctypes.data, tiles, flags.ctypes.data)
    jobs.run(jobs.job(_split_part, argv, x.size * SPLIT_SECONDS_PER_VALUE, tiles))
    return not flags.any()


_V32I16 = ir.VectorType(ir.IntType(16), 32)
_V32I8 = ir.VectorType(ir.IntType(8), 32)


@intrinsic
def _decode_group(typingctx: Any, src: Any, dst: Any, tables: Any) -> Any:
    """The W tile rows of one row's 64 k (the 32 bytes at address src) <- at address dst + 2·(s·_STEP +
    p·2·_TILE), piece p of the NF4 values of step s (0: the high nibbles, even k; 1: the low ones, odd k);
    tables: the address of `TABLES`."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        raw = builder.load(builder.inttoptr(args[0], _V32I8.as_pointer()), align=1)
        low = builder.zext(raw, _V32I16)
        index = (builder.lshr(low, ir.Constant(_V32I16, [4] * 32)), low)
        permw = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V32I16, [_V32I16, _V32I16]),
                                               "llvm.x86.avx512.permvar.hi.512")
        tables_at = builder.inttoptr(args[2], _V32I16.as_pointer())
        base = builder.inttoptr(args[1], ir.IntType(8).as_pointer())
        for p in range(PIECES):
            table = builder.load(builder.gep(tables_at, [ir.Constant(ir.IntType(64), p)]), align=64)
            for s in range(2):
                at = builder.gep(base, [ir.Constant(ir.IntType(64), 2 * (s * _STEP + p * 2 * _TILE))])
                builder.store(builder.call(permw, [table, index[s]]), builder.bitcast(at, _V32I16.as_pointer()),
                              align=64)
        return context.get_dummy_value()

    return types.void(src, dst, tables), codegen


decode_group: Any = _decode_group


# The product job's record: W's packed rows (n of row_bytes), absmax [n, blocks], `block` codes a block; the
# activation tiles (x_tiles of them, for m_rows rows of x_pieces pieces); out [m_rows, n]; the parts'
# scratch slots (part_bytes each, claimed by a part while it runs); the decoding tables and the tile
# configuration.
AMX_ARGS = jobs.record(w=ADDRESS, n=INT, row_bytes=INT, absmax=ADDRESS, blocks=INT, block=INT, x=ADDRESS,
                       x_tiles=INT, m_rows=INT, out=ADDRESS, scratch=ADDRESS, part_bytes=INT, tables=ADDRESS,
                       config=ADDRESS, x_pieces=INT, claims=ADDRESS, slots=INT)


@njit(inline="always", cache=True)
def _term(i: int, x_pieces: int) -> tuple[int, int, int]:
    """Product i of a block's sequence: (its step, its W piece, its activation piece), the steps' products
    in order of activation piece, so that an activation tile stays loaded across W pieces."""
    per_step = 3 if x_pieces == 1 else 5 if x_pieces == 2 else 6
    j = i % per_step
    pb = 0 if j < 3 else 1 if j < 5 else 2
    return i // per_step, j - (0, 3, 5)[pb], pb


@njit(inline="always", cache=True)
def _w_tile(w_at: int, step: int, pa: int, h: int) -> int:
    return w_at + 2 * ((step // 2) * _A_GROUP + (step % 2) * _STEP + 2 * pa * _TILE + h * _TILE)


@njit(inline="always", cache=True)
def _x_tile(x_at: int, tiles: int, step: int, pb: int, t: int) -> int:
    return x_at + 2 * (step * PIECES * tiles + pb * tiles + t) * _TILE


@njit(inline="always", cache=True)
def _decode_row(v: Any, w_at: int, n0: int, b: int, groups: int, i: int, g: int) -> None:
    """The W tiles at w_at <- group g of block b of W row n0 + i (zero past W's rows)."""
    at = g * _A_GROUP + i * 32
    if n0 + i < v.n:
        decode_group(v.w + (n0 + i) * v.row_bytes + (b * v.block + GROUP * g) // 2, w_at + 2 * at, v.tables)
        return
    tiles = carray(pointer(w_at, np.uint16), (groups * _A_GROUP,))
    for s in range(2):
        for p in range(PIECES):
            o = at + s * _STEP + 2 * p * _TILE
            tiles[o:o + 32] = 0


@njit(inline="always", cache=True)
def _scale_row(sums_at: int, absmax: Any, n0: int, b: int, tiles: int, acc: Any, i: int) -> None:
    """acc[i] += block b's sums of W row n0 + i (the f32 tiles stored at sums_at, 4 KiB a pair of
    activation tiles) times absmax[n0 + i, b], one FMA each."""
    n = absmax.shape[0]
    scale = absmax[n0 + i, b] if n0 + i < n else np.float32(0)
    c = (i // amx.ROWS) * 512 + (i % amx.ROWS) * 16
    for t in range(0, tiles, 2):
        sums = carray(pointer(sums_at + 2048 * t, np.float32), (1024,))
        at = i * amx.ROWS * tiles + amx.ROWS * t
        vstore(acc, at, fmas(scale, vload(sums, c), vload(acc, at)))
        if t + 1 < tiles:
            vstore(acc, at + 16, fmas(scale, vload(sums, c + 256), vload(acc, at + 16)))


@njit(inline="always", cache=True)
def _side(v: Any, j: int, next_w: int, n0: int, b: int, groups: int, last_sums: int, absmax: Any, acc: Any,
          wbytes: Any) -> None:
    """Side job j of block b's products: the decoding of one row's group of block b + 1 (j < ROWS·groups)
    or the scaling of one row of block b - 1's sums (the next ROWS), where those blocks exist. A decoding
    also prefetches its row's bytes `W_AHEAD` on: the rows are read 32 bytes at a time, a stride the
    hardware prefetchers miss."""
    nb = absmax.shape[1]
    if j < ROWS * groups:
        i, g = j // groups, j % groups
        if b + 1 < nb:
            at = ((b + 1) * v.block + GROUP * g) // 2 + W_AHEAD
            if at < v.row_bytes and n0 + i < v.n:
                prefetch(wbytes, (n0 + i) * v.row_bytes + at)
            _decode_row(v, next_w, n0, b + 1, groups, i, g)
    elif b > 0:
        _scale_row(last_sums, absmax, n0, b - 1, v.x_tiles, acc, j - ROWS * groups)


@njit(inline="always", cache=True)
def _products(v: Any, w_at: int, b: int, groups: int, sums_at: int, next_w: int, n0: int, last_sums: int,
              absmax: Any, acc: Any, wbytes: Any) -> None:
    """Block b's sums for the decoded W tiles at w_at against every pair of activation tiles, stored at
    sums_at (4 KiB a pair: W tile 0 x t, W tile 0 x t + 1, W tile 1 x t, W tile 1 x t + 1), with the side
    jobs (`_side`) spread between its tile products: issued after the products as whole loops, they
    would wait behind the products in the reorder buffer and add their time to theirs. Each operand tile is
    loaded for the next product as soon as this product's last reader of it is issued, so its load
    overlaps the products still to run."""
    tiles, x_pieces = v.x_tiles, v.x_pieces
    x_at = v.x + b * groups * 2 * 2 * PIECES * tiles * _TILE
    count = groups * 2 * (3 if x_pieces == 1 else 5 if x_pieces == 2 else 6)
    pairs = (tiles + 1) // 2
    sides = ROWS * groups + ROWS
    done = 0
    for t in range(0, tiles, 2):
        two = t + 1 < tiles
        amx.tile_zero(0)
        amx.tile_zero(1)
        amx.tile_zero(2)
        amx.tile_zero(3)
        step, pa, pb = _term(0, x_pieces)
        amx.tile_load(6, _x_tile(x_at, tiles, step, pb, t), amx.ROW_BYTES)
        if two:
            amx.tile_load(7, _x_tile(x_at, tiles, step, pb, t + 1), amx.ROW_BYTES)
        amx.tile_load(4, _w_tile(w_at, step, pa, 0), amx.ROW_BYTES)
        amx.tile_load(5, _w_tile(w_at, step, pa, 1), amx.ROW_BYTES)
        for i in range(count):
            more = i + 1 < count
            step, pa, pb = _term(i, x_pieces)
            step1, pa1, pb1 = _term(i + 1, x_pieces)
            new_x = more and (pb1 != pb or step1 != step)
            amx.tile_dot_bf16(0, 4, 6)
            if two:
                amx.tile_dot_bf16(1, 4, 7)
            if more:
                amx.tile_load(4, _w_tile(w_at, step1, pa1, 0), amx.ROW_BYTES)
            amx.tile_dot_bf16(2, 5, 6)
            if new_x:
                amx.tile_load(6, _x_tile(x_at, tiles, step1, pb1, t), amx.ROW_BYTES)
            if two:
                amx.tile_dot_bf16(3, 5, 7)
            if more:
                amx.tile_load(5, _w_tile(w_at, step1, pa1, 1), amx.ROW_BYTES)
            if new_x and two:
                amx.tile_load(7, _x_tile(x_at, tiles, step1, pb1, t + 1), amx.ROW_BYTES)
            upto = ((t // 2) * count + i + 1) * sides // (pairs * count)
            while done < upto:
                _side(v, done, next_w, n0, b, groups, last_sums, absmax, acc, wbytes)
                done += 1
        at = sums_at + 2048 * t
        amx.tile_store(0, at, amx.ROW_BYTES)
        amx.tile_store(1, at + 1024, amx.ROW_BYTES)
        amx.tile_store(2, at + 2048, amx.ROW_BYTES)
        amx.tile_store(3, at + 3072, amx.ROW_BYTES)


@njit(cache=True)
def _layout(groups: int, tiles: int) -> tuple[int, int, int, int]:
    """A part's scratch: (the stride of its two blocks' W tiles, the stride of its two blocks' sums, the
    offset of its accumulator, its size), in bytes. The strides are skewed off multiples of 4 KiB: a
    load 4 KiB from an in-flight store (the next block's W tiles beside the tiles being read) waits."""
    w_stride = 2 * groups * _A_GROUP + SKEW
    s_stride = 4096 * ((tiles + 1) // 2) + SKEW
    acc_at = 2 * w_stride + 2 * s_stride
    return w_stride, s_stride, acc_at, acc_at + 4 * ROWS * amx.ROWS * tiles + SKEW


@pool.task()
def _part(part: int, parts: int, argv: int) -> None:
    """Part `part` of the product: its share of the W row pairs (32 rows), each over all activation tiles,
    block by block, software-pipelined so that the vector work overlaps the tile products: between block
    b's products, block b + 1 is decoded and block b - 1's sums are scaled by absmax into an f32
    accumulator (W rows x activation rows), written out transposed at the end."""
    v = record_at(argv, AMX_ARGS)
    n, nb, bs, tiles, m_rows = v.n, v.blocks, v.block, v.x_tiles, v.m_rows
    absmax = carray(pointer(v.absmax, np.float32), (n, nb))
    out = carray(pointer(v.out, np.float32), (m_rows, n))
    groups = bs // GROUP
    width = amx.ROWS * tiles
    w_bytes, s_bytes, acc_at, _ = _layout(groups, tiles)
    slot = claim_slot(v.claims, v.slots)
    scratch = v.scratch + slot * v.part_bytes
    sums_at = scratch + 2 * w_bytes
    acc = carray(pointer(scratch + acc_at, np.float32), (ROWS * width,))
    pairs = (n + ROWS - 1) // ROWS
    wbytes = carray(pointer(v.w, np.uint8), (n * v.row_bytes,))
    amx.tile_config(v.config)
    for q in range(part * pairs // parts, (part + 1) * pairs // parts):
        n0 = ROWS * q
        acc[:] = 0
        for i in range(ROWS):
            for g in range(groups):
                _decode_row(v, scratch, n0, 0, groups, i, g)
        for b in range(nb):
            _products(v, scratch + (b % 2) * w_bytes, b, groups, sums_at + (b % 2) * s_bytes,
                      scratch + ((b + 1) % 2) * w_bytes, n0, sums_at + ((b + 1) % 2) * s_bytes, absmax, acc, wbytes)
        for i in range(ROWS):
            _scale_row(sums_at + ((nb - 1) % 2) * s_bytes, absmax, n0, nb - 1, tiles, acc, i)
        for m in range(m_rows):  # each output row's 32 floats together: a column at a time is slower
            for i in range(min(ROWS, n - n0)):
                out[m, n0 + i] = acc[i * width + m]
    amx.tile_release()
    release_slot(v.claims, v.slots, slot)


def forward(x: np.ndarray, w: np.ndarray, absmax: np.ndarray, bs: int, out: np.ndarray, x_pieces: int) -> bool:
    """out [R, N] <- x [R, K] @ dequant(W)ᵀ (all contiguous, x f32 holding values of `x_pieces` bf16 pieces:
    3 for f32, 2 for widened f16, 1 for widened bf16) on AMX tiles; False, out untouched, where the path
    does not apply (no AMX, bs not a multiple of 64, or values the tiles would flush: see the module)."""
    rows, k = x.shape
    n = w.shape[0]
    if not amx.available() or bs % GROUP or rows == 0 or n == 0 or k == 0 or not np.isfinite(absmax).all():
        return False
    tiles = -(-rows // amx.ROWS)
    x_tiles = amx.aligned_empty(k // GROUP * 2 * PIECES * tiles * _TILE, np.uint16)
    if not split_activations(x, tiles, x_tiles):
        return False
    pairs = -(-n // ROWS)
    part_bytes = _layout(bs // GROUP, tiles)[3]
    slots = min(pairs, threads.get_num_threads())  # a running part holds one; more parts at once wait for one
    scratch = amx.aligned_empty(slots * part_bytes, np.uint8)
    claims = np.zeros(slots, np.int64)
    argv = jobs.argv_of(AMX_ARGS)
    argv[0] = (w.ctypes.data, n, w.shape[1], absmax.ctypes.data, absmax.shape[1], bs, x_tiles.ctypes.data, tiles,
               rows, out.ctypes.data, scratch.ctypes.data, part_bytes, TABLES.ctypes.data, CONFIG.ctypes.data, x_pieces,
               claims.ctypes.data, slots)
    jobs.run(jobs.job(_part, argv, rows * n * k / MACS_PER_SECOND, pairs, keep=(x_tiles, scratch, claims)))
    return True
