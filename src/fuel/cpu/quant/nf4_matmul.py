"""Nf4Matmul (entry 21) on the CPU: `act @ dequant(W)ᵀ` (or `g @ dequant(W)`) straight from NF4 bytes.

A weight value is `NF4[code] * absmax`, rounded once to f32 (bitsandbytes' dequantisation, bit for
bit). The 16-entry table lookup is what makes NF4 slow in plain loops (a scalar load or a gather per
element): here the table is held in vector registers and looked up in LLVM IR, by one 16-lane `vpermps`
on AVX-512 (`nibble_tables.permute16`) and by byte shuffles on AVX2 (`nibble_tables.lookup32`: LLVM's own
lowering of a 16-lane variable permute there is one scalar extract per lane). Each step reads 16 packed
bytes and looks up both nibbles: 16 weights of even k (high nibbles) and 16 of odd k, each scaled by its
block's absmax (the tiles' dequantisation on AVX2 takes them in element order straight from the
shuffles). See docs/performance/nf4.md, "nf4_matmul", for the measurements.

Three paths, chosen by shape and host, each a sequence of pool jobs:
- decode (at most `DECODE_MAX_ROWS` activation rows, forward only, bs a multiple of 32): a job splits the
  activation rows into their even and odd k, then each output column streams its packed weight row once
  and accumulates every activation row against it in two 16-lane f32 FMA accumulators, summed by a fixed
  tree; rows in a fixed number of chunks. Nothing is dequantised to memory. One activation row on
  AVX-512 and AVX2 hosts goes by table instead (`nf4_table`: the row permuted, then looked up). These
  jobs are what native replay posts (`nf4_job`).
- AMX (more rows, K >= `AMX_MIN_K` and N·K >= `AMX_MIN_WEIGHTS`, on hosts with AMX tiles): `nf4_amx`,
  the products on the tiles in bf16 pieces whose sums are exact f32 values (its bound: `nf4_amx`).
  Declined (the tiles path runs) for blocks of other than a multiple of 64, non-finite absmax and
  activations outside the tiles' range.
- tiles (more rows): rows of W are dequantised in k order into a reused f32 tile, each tile multiplied
  by fuel's tile kernel on AVX-512 and AVX2 hosts (`tile_gemm`) or one one-thread OpenBLAS GEMM elsewhere
  (`weight_tiles`: a prep job and this module's tile task). The transposed product `g @ W` of the
  gradient dequantises column blocks into `TILE_BYTES` tiles in the calling thread, each multiplied as
  one-thread GEMMs on fixed row blocks (`row_blocks`). Every product's sum for an output element is then
  fixed by the shape, so the bytes do not depend on the thread count.
Block sizes that are not a multiple of 32 (no 16-byte step fits a block) take plain loops instead.
bf16/f16 activations are widened exactly to f32 and the output is rounded once on store.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.quant import nf4_amx
from fuel.cpu.quant.nf4_intrinsics import DOT_MAX_ROWS, dequant_blocks, dot1, dot2, dot3, dot4
from fuel.cpu.quant.nf4_table import DECODE_ARGS, WEIGHTS_PER_SECOND, fill_decode, table_jobs
from fuel.cpu.quant.nibble_tables import LUT32
from fuel.cpu.quant.weight_tiles import (
    each_tile,
    run_tiles,
    tile_args,
    tiled_product,
    tiles_jobs,
)
from fuel.cpu.simd import row_blocks
from fuel.cpu.simd.driver import chunk_bounds, chunk_count
from fuel.cpu.simd.half import narrow_into, widened
from fuel.dispatch.impls import (
    CONTIGUOUS_ONLY,
    BackendImpl,
    CostEstimate,
    FusedKernelRegistry,
    PrecisionGuarantee,
    revision_of,
)
from fuel.dtype import DType
from fuel.graph.node import Shape
from fuel.graph.registry import FusedOps
from fuel.quant.nf4 import NF4
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.buffers import POOL
from fuel.runtime.jobs import ADDRESS, INT, record_at

DECODE_MAX_ROWS = DOT_MAX_ROWS  # up to this many activation rows, the fused decode path (no dequantised tile)
TILE_BYTES = 8 << 20  # f32 scratch per dequantised tile of the transposed product (the gradient)
_LUT = np.array(NF4, np.float32)  # a writable copy: Numba types it as a plain array
SECONDS_PER_VALUE = 1e-9  # one core's time to split a value by its k's parity
SPLIT_ARGS = jobs.record(a=ADDRESS, rows=INT, k=INT, split=ADDRESS)  # the split job's record


@pool.task()
def _split_part(part: int, parts: int, argv: int) -> None:
    """Part `part` of the split job: its share of the activation rows, each into its even and odd k."""
    p = record_at(argv, SPLIT_ARGS)
    rows, kh = p.rows, p.k // 2
    a = carray(pointer(p.a, np.float32), (rows, p.k))
    split = carray(pointer(p.split, np.float32), (rows, 2, kh))
    for i in range(part * rows // parts, (part + 1) * rows // parts):
        for j in range(kh):
            split[i, 0, j] = a[i, 2 * j]
            split[i, 1, j] = a[i, 2 * j + 1]


@pool.task()
def _decode(part: int, parts: int, argv: int) -> None:
    """Part `part` of out [rows, N] <- a [rows, K] @ dequant(W)ᵀ for rows <= 4, bs a multiple of 32, from
    the split activations: its share of the fixed row chunks (whoever runs a chunk, its bytes are the
    same)."""
    v = record_at(argv, DECODE_ARGS)
    rows, kh, n, nb = v.rows, v.half_k, v.n, v.blocks
    split = carray(pointer(v.x, np.float32), (rows, 2, kh))
    w = carray(pointer(v.w, np.uint8), (n, kh))
    absmax = carray(pointer(v.absmax, np.float32), (n, nb))
    lut = carray(pointer(v.lut, np.float32), (16,))
    out = carray(pointer(v.out, np.float32), (rows, n))
    steps = v.block // 32
    chunks = chunk_count(n)
    for c in range(part * chunks // parts, (part + 1) * chunks // parts):
        lo, hi = chunk_bounds(c, n, chunks)
        for r in range(lo, hi):
            if rows == 1:
                dot1(w, r * kh, absmax, r * nb, lut, nb, steps, split, out, r, n)
            elif rows == 2:
                dot2(w, r * kh, absmax, r * nb, lut, nb, steps, split, out, r, n)
            elif rows == 3:
                dot3(w, r * kh, absmax, r * nb, lut, nb, steps, split, out, r, n)
            else:
                dot4(w, r * kh, absmax, r * nb, lut, nb, steps, split, out, r, n)


USE_TABLE = LUT32  # one row by table (`nf4_table`); tests turn it off to run the portable path here too


@njit(cache=True)
def _fill_split(x: Any, split: Any, argv: Any) -> None:
    p = argv[0]
    p.a, p.rows, p.k, p.split = x.ctypes.data, x.shape[0], x.shape[1], split.ctypes.data


def _decode_jobs(x: np.ndarray, w: np.ndarray, absmax: np.ndarray, bs: int, out: np.ndarray) -> jobs.Jobs:
    """The decode path (rows <= DECODE_MAX_ROWS, bs a multiple of 32) as two jobs: one row by table (the
    row permuted, then looked up), else the rows split into their even and odd k into a scratch of the
    job's own (rows·K floats, the path's only allocation), then the fused dots."""
    if USE_TABLE and x.shape[0] == 1:
        return table_jobs(x, w, absmax, _LUT, out, bs)
    rows, k = x.shape
    split = np.empty((rows, 2, k // 2), np.float32)
    first, argv = jobs.argv_of(SPLIT_ARGS), jobs.argv_of(DECODE_ARGS)
    _fill_split(x, split, first)
    fill_decode(split, rows, w, absmax, _LUT, out, bs, argv)
    n = w.shape[0]
    return (jobs.job(_split_part, first, x.size * SECONDS_PER_VALUE, rows, keep=(split,)),
            jobs.job(_decode, argv, rows * n * k / WEIGHTS_PER_SECOND, chunk_count(n), keep=(split,)))


@njit(cache=True, nogil=True)
def _dequant_tile(w: Any, absmax: Any, lut: Any, bs: int, n0: int, n1: int, b0: int, b1: int, dst: Any) -> None:
    """dst [n1-n0, (b1-b0)·bs] <- the weights of rows [n0, n1), blocks [b0, b1), in the calling thread (no
    Numba pool: a BLAS call follows, and its idle workers would fight one); without the GIL, so the forward's
    parts dequantise concurrently."""
    kh, nb = w.shape[1], absmax.shape[1]
    width = (b1 - b0) * bs
    if bs % 32 == 0:
        for r in range(n0, n1):
            dequant_blocks(w, r * kh + b0 * bs // 2, absmax, r * nb + b0, lut, b1 - b0, bs // 32, dst,
                            (r - n0) * width)
        return
    for r in range(n0, n1):
        row = dst[r - n0]
        for b in range(b0, b1):
            scale = absmax[r, b]
            for j in range(bs // 2):
                byte = w[r, (b * bs) // 2 + j]
                at = (b - b0) * bs + 2 * j
                row[at] = lut[byte >> 4] * scale
                row[at + 1] = lut[byte & 15] * scale


@pool.task()
def _tiles(part: int, parts: int, argv: int) -> None:
    """Part `part` of the many-row product (`weight_tiles`): tiles of W rows claimed one at a time, each
    dequantised into the part's scratch slot and multiplied (`weight_tiles.multiply_tile`). W's fields:
    weight (the packed bytes), weight_cols (K/2), scales (absmax), scale_cols (blocks), table (the LUT)."""
    v = tile_args(argv)
    n, kh, nb = v.n, v.weight_cols, v.scale_cols
    w = carray(pointer(v.weight, np.uint8), (n, kh))
    absmax = carray(pointer(v.scales, np.float32), (n, nb))
    lut = carray(pointer(v.table, np.float32), (16,))
    each_tile(v, _tile_rows, 0, (w, absmax, lut, 2 * kh // nb, nb))


@njit(inline="always", cache=True)
def _tile_rows(tile: Any, r0: int, r1: int, how: int, state: Any) -> None:
    """tile <- W rows [r0, r1) dequantised (state: codes, absmax, the table, the block size, blocks a row)."""
    w, absmax, lut, bs, nb = state
    _dequant_tile(w, absmax, lut, bs, r0, r1, 0, nb, tile)


def _scratch(rows: int, cols: int, buf: np.ndarray | None) -> np.ndarray:
    """A contiguous [rows, cols] f32 view of the tile buffer (one per call, reused by every tile)."""
    assert buf is not None
    return buf[: rows * cols].reshape(rows, cols)


USE_AMX = True  # large products on AMX tiles where the host has them (`nf4_amx`); tests turn it off
AMX_MIN_K = 2048  # the smallest contraction, and
AMX_MIN_WEIGHTS = 1 << 23  # the smallest weight (N·K), the AMX path takes (below, it is not faster)


def _forward(x: np.ndarray, w: np.ndarray, absmax: np.ndarray, bs: int, out: np.ndarray,
             x_pieces: int = nf4_amx.PIECES) -> None:
    """out [R, N] <- x [R, K] @ dequant(W)ᵀ, all f32 and contiguous (x holding values of `x_pieces` bf16
    pieces, `nf4_amx.forward`): the decode path; large products on AMX tiles where the host has them;
    else tiles each dequantised and multiplied in one thread, the tiles split over fuel's threads
    (`weight_tiles`, as QMatMul's), rather than one serial dequantisation before a threaded GEMM
    (docs/performance/nf4.md, "nf4_matmul"). Each output element's sum is fixed by the shape and the host,
    whatever the tiling and the thread count."""
    rows, k = x.shape
    n = w.shape[0]
    if rows <= DECODE_MAX_ROWS and bs % 32 == 0:
        jobs.run(_decode_jobs(x, w, absmax, bs, out))
        return
    if _takes_amx(k, n) and nf4_amx.forward(x, w, absmax, bs, out, x_pieces):
        return
    found = _tiles_jobs(x, w, absmax, bs, out)
    if found is not None:
        run_tiles(found)
    else:
        nb = k // bs
        tiled_product(x, n, lambda n0, n1, tile: _dequant_tile(w, absmax, _LUT, bs, n0, n1, 0, nb, tile), out)


def _takes_amx(k: int, n: int) -> bool:
    """Whether a product of this size is offered to the AMX path (which may still decline it)."""
    return USE_AMX and k >= AMX_MIN_K and n * k >= AMX_MIN_WEIGHTS


def _tiles_jobs(x: np.ndarray, w: np.ndarray, absmax: np.ndarray, bs: int,
                out: np.ndarray) -> tuple[jobs.Job, jobs.Job] | None:
    """The many-row product's prep and tile jobs (`weight_tiles.tiles_jobs`), None where there are none."""
    fields = (pool.address_of(w), w.shape[1], pool.address_of(absmax), x.shape[1] // bs, pool.address_of(_LUT))
    return tiles_jobs(_tiles, x, w.shape[0], out, fields)


def _transposed(g: np.ndarray, w: np.ndarray, absmax: np.ndarray, bs: int, out: np.ndarray) -> None:
    """out [R, K] <- g [R, N] @ dequant(W), over column tiles of whole blocks (one GEMM each: every
    output element's sum over N stays inside one BLAS call)."""
    n, k = w.shape[0], out.shape[1]
    nb = k // bs
    per_tile = max(1, min(nb, TILE_BYTES // (4 * n * bs)))
    buf = POOL.empty((per_tile * bs * n,), np.dtype(np.float32))
    for b0 in range(0, nb, per_tile):
        b1 = min(nb, b0 + per_tile)
        t = _scratch(n, (b1 - b0) * bs, buf)
        _dequant_tile(w, absmax, _LUT, bs, 0, n, b0, b1, t)
        row_blocks.matmul(g, t, out[:, b0 * bs:b1 * bs])


# bf16 pieces (`nf4_amx`) of the values an activation dtype widens to: f32 takes three.
_PIECES = {DType.BF16.np: 1, DType.F16.np: 2}


def nf4_kernel(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
    act, w, absmax = inputs
    if out.size == 0:
        return
    acc = out if out.dtype == np.float32 else POOL.empty(out.shape, np.dtype(np.float32))
    x = act if act.dtype == np.float32 else widened(act)
    rows = math.prod(act.shape[:-1])
    x2, o2 = x.reshape(rows, act.shape[-1]), acc.reshape(rows, out.shape[-1])
    if x2.shape[1] == 0:  # an empty contraction (K = 0, or N = 0 for the transposed product)
        o2.fill(0)
    elif params.transpose:
        _transposed(x2, w, absmax, params.block_size, o2)
    else:
        _forward(x2, w, absmax, params.block_size, o2, _PIECES.get(act.dtype, nf4_amx.PIECES))
    if acc is not out:
        narrow_into(acc, out)


@jobs.replays(nf4_kernel)
def nf4_job(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> jobs.Jobs | None:
    """The jobs `nf4_kernel` runs for an f32 forward product of up to DECODE_MAX_ROWS activation rows, bs a
    multiple of 32 (the decode path), for native replay; None for any other call (the tiles' scratch and
    the AMX path's data-dependent choice stay with the eager kernel)."""
    act, w, absmax = inputs
    bs = params.block_size
    rows = math.prod(act.shape[:-1])
    if (params.transpose or rows > DECODE_MAX_ROWS or out.size == 0 or act.shape[-1] == 0 or bs % 32
            or act.dtype != np.float32 or out.dtype != np.float32
            or not all(a.flags.c_contiguous for a in (act, w, absmax, out))):
        return None
    return _decode_jobs(act.reshape(rows, -1), w, absmax, bs, out.reshape(rows, -1))


def nf4_cost(shapes: Sequence[Shape], dtypes: Sequence[DType], params: Any) -> CostEstimate:
    """2·N·K flops per activation row (plus the N·K scale products); the packed weight, absmax, the
    activations and the output each move once."""
    act, w = shapes[0], shapes[1]
    rows = math.prod(act[:-1])
    n, k = w[0], 2 * w[1]
    moved = sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes, strict=True))
    return CostEstimate(flops=2 * rows * n * k + n * k, bytes_moved=moved)


# |out - ref| <= max_relative·|ref| + max_absolute·S against float64 dequant-then-matmul, with
# S = |act| @ |dequant(W)|ᵀ per element (the contraction rule). Twice the worst error
# `python -m fuel.testing.measure Nf4Matmul` found over seeds 0-59; the half types compute in f32 and
# round once on store, so their absolute part is the f32 impl's.
PRECISION = {
    DType.F32: PrecisionGuarantee(True, None, 8.5e-7, 3.4e-7, "exact f32 weights, f32 FMA / sgemm accumulation"),
    DType.BF16: PrecisionGuarantee(True, None, 7.9e-3, 3.4e-7, "exact widening, f32 compute, one RNE rounding"),
    DType.F16: PrecisionGuarantee(True, None, 9.8e-4, 3.4e-7, "exact widening, f32 compute, one rounding on store"),
}


def register(registry: FusedKernelRegistry) -> None:
    rev = revision_of(nf4_kernel)
    for dt in (DType.F32, DType.BF16, DType.F16):
        registry.register(BackendImpl(FusedOps.NF4_MATMUL, "cpu", nf4_kernel, (dt, DType.U8, DType.F32, dt),
                                      nf4_cost, PRECISION[dt], CONTIGUOUS_ONLY, rev))
