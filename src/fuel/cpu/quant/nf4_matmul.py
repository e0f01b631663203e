"""Nf4Matmul (entry 21) on the CPU: `act @ dequant(W)ᵀ` (or `g @ dequant(W)`) straight from NF4 bytes.

A weight value is `NF4[code] * absmax`, rounded once to f32 (bitsandbytes' dequantisation, bit for
bit). The 16-entry table lookup is what makes NF4 slow in plain loops (a scalar load or a gather per
element; measured 7 ms single-threaded for a 4096² GEMV): here the table is held in vector registers and
looked up in LLVM IR, by one 16-lane `vpermps` on AVX-512 (`nibble_tables.permute16`) and by byte
shuffles on AVX2 (`nibble_tables.lookup32`: LLVM's own lowering of a 16-lane variable permute there was
one scalar extract per lane, 9.4 ms for a 4096² one-row product). Each step reads 16 packed bytes and
looks up both nibbles: 16 weights of even k (high nibbles) and 16 of odd k, each scaled by its block's
absmax (the tiles' dequantisation on AVX2 takes them in element order straight from the shuffles).

Three paths, chosen by shape and host:
- decode (at most `DECODE_MAX_ROWS` activation rows, forward only): the activation rows are split
  once into their even and odd k, then each output column streams its packed weight row once and
  accumulates every activation row against it in two 16-lane f32 FMA accumulators, summed by a fixed
  tree. Nothing is dequantised to memory; rows are split over threads in a fixed number of chunks. One
  activation row on AVX-512 and AVX2 hosts goes by table instead (`nf4_table`: 0.37 against 0.54 ms
  warm on AVX-512).
- AMX (more rows, K >= `AMX_MIN_K` and N·K >= `AMX_MIN_WEIGHTS`, on hosts with AMX tiles): `nf4_amx`,
  the products on the tiles in bf16 pieces whose sums are exact f32 values (f32-accurate: at most 8.2e-8
  of S measured). Declined (the tiles path runs) for blocks of other than a multiple of 64, non-finite
  absmax and activations outside the tiles' range. 4096², 64 rows, two threads: 0.66-1.0x the tiles
  path's time, by the host's phase (interleaved in one process on a Xeon VM whose two vCPUs share
  their tile unit's throughput: two threads of tile products ran 1.1-1.5x one thread's rate).
- tiles (more rows): rows of W are dequantised in k order into a reused f32 tile, each tile multiplied
  by fuel's tile kernel on AVX-512 and AVX2 hosts (`tile_gemm`) or one one-thread OpenBLAS GEMM elsewhere, the
  tiles split over fuel's threads (`weight_tiles`). The transposed product `g @ W` of the gradient
  dequantises column blocks into `TILE_BYTES` tiles in the calling thread, each multiplied as one-thread
  GEMMs on fixed row blocks (`row_blocks`). Every product's sum for an output element is then fixed by
  the shape, so the bytes do not depend on the thread count.
Block sizes that are not a multiple of 32 (no 16-byte step fits a block) take plain loops instead.
bf16/f16 activations are widened exactly to f32 and the output is rounded once on store.

Measured (2 cores, K = N = 4096, block 64, f32), on AVX-512 (Zen 4): one row 0.49 ms, 85% of the time
to stream the packed weight and absmax (9.4 MB) at the 22.6 GB/s a NumPy copy reached; 64 rows 11.0-11.4
ms (the tile kernel; 13.3-14.2 by OpenBLAS); torch's `dequantize_4bit` then matmul 23.5-26.2 ms. On AVX2
(Zen 3): one row 0.8-1.0 ms, 64 rows 15-15.7 ms (OpenBLAS), torch 30 ms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.quant import nf4_amx
from fuel.cpu.quant.nf4_intrinsics import DOT_MAX_ROWS, dequant_blocks, dot1, dot2, dot3, dot4
from fuel.cpu.quant.nf4_table import WEIGHTS_PER_SECOND, decode_one_row, table_forms
from fuel.cpu.quant.nibble_tables import LUT32
from fuel.cpu.quant.weight_tiles import (
    WEIGHT,
    N,
    claim_slot,
    job,
    multiply_tile,
    part_tiles,
    post_tiles,
    release_slot,
    tile_of,
    tile_span,
    tiled_product,
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

DECODE_MAX_ROWS = DOT_MAX_ROWS  # up to this many activation rows, the fused decode path (no dequantised tile)
TILE_BYTES = 8 << 20  # f32 scratch per dequantised tile of the transposed product (the gradient)
_LUT = np.array(NF4, np.float32)  # a writable copy: Numba types it as a plain array



@njit(cache=True)
def _decode_args(a: Any, w: Any, absmax: Any, lut: Any, out: Any, bs: int, argv: Any) -> Any:
    """The activation rows split into their even and odd k (rows·K floats, the path's only allocation),
    and argv <- the addresses and sizes `_decode` reads."""
    rows = a.shape[0]
    kh = w.shape[1]
    split = np.empty((rows, 2, kh), np.float32)
    for i in range(rows):
        for j in range(kh):
            split[i, 0, j] = a[i, 2 * j]
            split[i, 1, j] = a[i, 2 * j + 1]
    argv[0], argv[1], argv[2], argv[3], argv[4] = split.ctypes.data, rows, kh, w.ctypes.data, w.shape[0]
    argv[5], argv[6], argv[7], argv[8], argv[9] = absmax.ctypes.data, absmax.shape[1], lut.ctypes.data, \
        out.ctypes.data, bs
    return split


@pool.task()
def _decode(part: int, parts: int, argv: int) -> None:
    """Part `part` of out [rows, N] <- a [rows, K] @ dequant(W)ᵀ for rows <= 4, bs a multiple of 32: its
    share of the fixed row chunks (whoever runs a chunk, its bytes are the same)."""
    v = carray(pointer(argv, np.int64), (10,))
    rows, kh, n, nb = v[1], v[2], v[4], v[6]
    split = carray(pointer(v[0], np.float32), (rows, 2, kh))
    w = carray(pointer(v[3], np.uint8), (n, kh))
    absmax = carray(pointer(v[5], np.float32), (n, nb))
    lut = carray(pointer(v[7], np.float32), (16,))
    out = carray(pointer(v[8], np.float32), (rows, n))
    steps = v[9] // 32
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


def _decode_rows(x: np.ndarray, w: np.ndarray, absmax: np.ndarray, bs: int, out: np.ndarray) -> None:
    """The decode path (rows <= DECODE_MAX_ROWS) on the spinning pool."""
    if USE_TABLE and x.shape[0] == 1:
        decode_one_row(x, w, absmax, _LUT, out, bs)
        return
    argv = np.empty(10, np.int64)
    split = _decode_args(x, w, absmax, _LUT, out, bs, argv)
    n = w.shape[0]
    seconds = x.shape[0] * n * x.shape[1] / WEIGHTS_PER_SECOND
    pool.run(_decode, argv, pool.parts_for(seconds, chunk_count(n)))
    del split  # alive until here: the tasks read it by address


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
    """Part `part` of the many-row product on the spinning pool (`weight_tiles`): its tiles of W rows
    dequantised into a scratch slot, each multiplied (`weight_tiles.multiply_tile`). W's fields: w, K/2,
    absmax, blocks, LUT."""
    v = job(argv)
    f = carray(pointer(argv, np.int64), (WEIGHT + 5,))
    n, kh, nb = v[N], f[WEIGHT + 1], f[WEIGHT + 3]
    w = carray(pointer(f[WEIGHT], np.uint8), (n, kh))
    absmax = carray(pointer(f[WEIGHT + 2], np.float32), (n, nb))
    lut = carray(pointer(f[WEIGHT + 4], np.float32), (16,))
    slot = claim_slot(v)
    tile = tile_of(v, slot)
    i0, i1 = part_tiles(v, part, parts)
    for i in range(i0, i1):
        r0, r1 = tile_span(v, i)
        _dequant_tile(w, absmax, lut, 2 * kh // nb, r0, r1, 0, nb, tile)
        multiply_tile(v, slot, r0, r1)
    release_slot(v, slot)


def _scratch(rows: int, cols: int, buf: np.ndarray | None) -> np.ndarray:
    """A contiguous [rows, cols] f32 view of the tile buffer (one per call, reused by every tile)."""
    assert buf is not None
    return buf[: rows * cols].reshape(rows, cols)


USE_AMX = True  # large products on AMX tiles where the host has them (`nf4_amx`); tests turn it off
AMX_MIN_K = 2048  # the smallest contraction, and
AMX_MIN_WEIGHTS = 1 << 23  # the smallest weight (N·K), the AMX path takes (below, it measured 0.9-1.3x)


def _forward(x: np.ndarray, w: np.ndarray, absmax: np.ndarray, bs: int, out: np.ndarray,
             x_pieces: int = nf4_amx.PIECES) -> None:
    """out [R, N] <- x [R, K] @ dequant(W)ᵀ, all f32 and contiguous (x holding values of `x_pieces` bf16
    pieces, `nf4_amx.forward`): the decode path; large products on AMX tiles where the host has them;
    else tiles each dequantised and multiplied in one thread, the tiles split over fuel's threads
    (`weight_tiles`, as QMatMul's). One serial dequantisation of 8 MiB tiles before a two-thread GEMM took
    1.8x as long at 4096 x 4096, M = 64. Each output element's sum is fixed by the shape and the host,
    whatever the tiling and the thread count."""
    rows, k = x.shape
    n = w.shape[0]
    if rows <= DECODE_MAX_ROWS and bs % 32 == 0:
        _decode_rows(x, w, absmax, bs, out)
        return
    if (USE_AMX and k >= AMX_MIN_K and n * k >= AMX_MIN_WEIGHTS
            and nf4_amx.forward(x, w, absmax, bs, out, x_pieces)):
        return
    nb = k // bs
    if not post_tiles(_tiles, x, n, out, (w.ctypes.data, w.shape[1], absmax.ctypes.data, nb, _LUT.ctypes.data)):
        tiled_product(x, n, lambda n0, n1, tile: _dequant_tile(w, absmax, _LUT, bs, n0, n1, 0, nb, tile), out)


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
def nf4_form(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> jobs.Jobs | None:
    """One f32 activation row of the forward product by table: the jobs `_decode_rows` runs a call."""
    return table_forms(inputs, out, params, _LUT) if USE_TABLE else None


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
