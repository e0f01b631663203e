"""QMatMul (entry 14) on the CPU: `C = A @ dequant(W)ᵀ` for every GGUF block type, never quantizing A.

Two paths, chosen by the number of activation rows R (batch dims folded in: the weight is shared):
- R <= DECODE_ROWS (decode): one pass over the weight bytes, rows of W in parallel chunks. Every 256
  weights of a row (one K-quant block, or eight 32-element ones) are decoded once into a stack scratch
  and dotted with each activation row: 16 products per lane summed pairwise, then added to the row's
  16 lanes, which are summed pairwise at the end. No dequantised weight exists anywhere, and each
  output is one thread's fixed sequence of f32 operations: the bytes never depend on the thread count.
- larger R: tiles of W rows are dequantised (`gguf_blocks.dequantize_rows_into`) into a reused f32
  scratch and each goes through one OpenBLAS sgemm into its output columns; tiles are fixed by the
  weight's shape and run on fuel's threads (`split_work`, one-thread BLAS each), so the bytes do not
  depend on the thread count either.
The transposed form (the gradient, `G @ dequant(W)`) adds tile products `G[:, tile] @ tile` in order.

The decode path has its own block decoders, written for it with `simd16`'s explicit vector operations:
inside this loop `gguf_blocks`' decoders (the same values) ran 1.5-3x slower for Q8_0 and Q4_K,
depending on how LLVM scheduled their stores against the dot products. Both give gguf-py's values bit
for bit (the same f32 operations in the same order, each rounded once, never fused), and the tests
check the two paths against gguf-py exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import carray, njit, prange

from fuel.dispatch.buffers import POOL
from fuel.dispatch.cpu.driver import chunk_bounds, chunk_count, row_kernel
from fuel.dispatch.cpu.gguf_blocks import dequantize_rows_into
from fuel.dispatch.cpu.simd16 import dot256, f16_at, mac16, stack_f32, unpack16
from fuel.dispatch.fused import (
    CONTIGUOUS_ONLY,
    BackendImpl,
    CostEstimate,
    FusedKernelRegistry,
    PrecisionGuarantee,
    revision_of,
)
from fuel.dispatch.threads import split_work
from fuel.dtype import DType
from fuel.graph.node import Shape
from fuel.graph.registry import FusedOps
from fuel.graph.registry.qmatmul import QMatMulParams, weight_bytes
from fuel.quant import QuantType

DECODE_ROWS = 16  # activation rows up to which the weight is decoded in registers (no BLAS)
TILE_BYTES = 1 << 20  # f32 bytes of one dequantised tile (fits L2)

# ---- block decoders: the block at row[o:o + bytes] into s[so:so + elements], gguf-py's values ----------


@njit(inline="always", cache=True)
def _b(row: Any, i: int) -> Any:
    return np.int64(row[i])


@njit(inline="always", cache=True)
def _u32le(row: Any, o: int) -> Any:
    return _b(row, o) | (_b(row, o + 1) << 8) | (_b(row, o + 2) << 16) | (_b(row, o + 3) << 24)


@njit(inline="always", cache=True)
def _dec_q4_0(row: Any, o: int, s: Any, so: int) -> None:
    """f16 d, 16 bytes of nibbles (byte j: element j low, j + 16 high); d * (q - 8)."""
    d = f16_at(row, o)
    for h in range(2):
        unpack16(s, so + 16 * h, row, o + 2, 4 * h, 15, 0, 0, 0, 0, 8, d, d, 0)


@njit(inline="always", cache=True)
def _dec_q4_1(row: Any, o: int, s: Any, so: int) -> None:
    """f16 d, f16 m, 16 bytes of nibbles; d * q + m."""
    d, m = f16_at(row, o), f16_at(row, o + 2)
    for h in range(2):
        unpack16(s, so + 16 * h, row, o + 4, 4 * h, 15, 0, 0, 0, 0, 0, d, m, 8)


@njit(inline="always", cache=True)
def _dec_q5_0(row: Any, o: int, s: Any, so: int) -> None:
    """f16 d, u32 of fifth bits (bit j: element j), 16 bytes of nibbles; d * (q - 16)."""
    d, qh = f16_at(row, o), _u32le(row, o + 2)
    for h in range(2):
        unpack16(s, so + 16 * h, row, o + 6, 4 * h, 15, qh, 16 * h, 1, 4, 16, d, d, 4)


@njit(inline="always", cache=True)
def _dec_q5_1(row: Any, o: int, s: Any, so: int) -> None:
    """f16 d, f16 m, u32 of fifth bits, 16 bytes of nibbles; d * q + m."""
    d, m, qh = f16_at(row, o), f16_at(row, o + 2), _u32le(row, o + 4)
    for h in range(2):
        unpack16(s, so + 16 * h, row, o + 8, 4 * h, 15, qh, 16 * h, 1, 4, 0, d, m, 12)


@njit(inline="always", cache=True)
def _dec_q8_0(row: Any, o: int, s: Any, so: int) -> None:
    """f16 d, 32 int8; q * d."""
    d = f16_at(row, o)
    for h in range(2):
        unpack16(s, so + 16 * h, row, o + 2 + 16 * h, 0, 0, 0, 0, 0, 0, 0, d, d, 1)


@njit(inline="always", cache=True)
def _dec_q8_1(row: Any, o: int, s: Any, so: int) -> None:
    """ggml's block_q8_1: f16 d, f16 s = d·Σq (not needed), 32 int8; d * q."""
    d = f16_at(row, o)
    for h in range(2):
        unpack16(s, so + 16 * h, row, o + 4 + 16 * h, 0, 0, 0, 0, 0, 0, 0, d, d, 1)


@njit(inline="always", cache=True)
def _dec_q2k(row: Any, o: int, s: Any, so: int) -> None:
    """16 scale bytes (low nibble scale, high nibble min), 64 bytes of 2-bit codes, f16 d, f16 dmin;
    (d * sc) * q - (dmin * m)."""
    d, dmin = f16_at(row, o + 80), f16_at(row, o + 82)
    for i in range(16):  # 16-element group i = 8h + 2s + half
        h, sh, half = i >> 3, (i >> 1) & 3, i & 1
        sc = _b(row, o + i)
        unpack16(s, so + 16 * i, row, o + 16 + 32 * h + 16 * half, 2 * sh, 3, 0, 0, 0, 0, 0,
                 d * np.float32(sc & 15), -(dmin * np.float32(sc >> 4)), 8)


@njit(inline="always", cache=True)
def _dec_q3k(row: Any, o: int, s: Any, so: int) -> None:
    """32 bytes of high bits, 64 bytes of 2-bit codes, 12 bytes of 6-bit scales, f16 d; (d * (sc - 32))
    * (low | high << 2) - 4 (gguf-py's q - 4·(1 - high))."""
    d = f16_at(row, o + 108)
    for i in range(16):
        h, sh, half = i >> 3, (i >> 1) & 3, i & 1
        low = (_b(row, o + 96 + (i & 7)) >> (4 * (i >> 3))) & 15
        high = (_b(row, o + 104 + (i & 3)) >> (2 * (i >> 2))) & 3
        unpack16(s, so + 16 * i, row, o + 32 + 32 * h + 16 * half, 2 * sh, 3, o + 16 * half, 4 * h + sh, 1, 2, 4,
                 d * np.float32((low | (high << 4)) - 32), d, 2)


@njit(inline="always", cache=True)
def _scale_min(row: Any, o: int, j: int) -> tuple[Any, Any]:
    """Sub-block j's 6-bit scale and min, packed in the 12 bytes at row[o + 4:o + 16] (Q4_K, Q5_K)."""
    if j < 4:
        return _b(row, o + 4 + j) & 63, _b(row, o + 8 + j) & 63
    p = _b(row, o + 8 + j)
    return (p & 15) | ((_b(row, o + j) >> 6) << 4), (p >> 4) | ((_b(row, o + 4 + j) >> 6) << 4)


@njit(inline="always", cache=True)
def _dec_q45k(row: Any, o: int, s: Any, so: int, five: bool) -> None:
    """Q4_K (f16 d, f16 dmin, 12 scale bytes, 128 bytes of nibbles) and Q5_K (32 bytes of fifth bits
    before the nibbles): sub-block 2c + nib is the low (nib 0) or high nibbles of bytes 32c..32c + 31;
    (d * sc) * q - (dmin * m)."""
    d, dmin = f16_at(row, o), f16_at(row, o + 2)
    q = o + 48 if five else o + 16
    for j in range(8):
        sc, m = _scale_min(row, o, j)
        dl, ml = d * np.float32(sc), dmin * np.float32(m)
        for h in range(2):
            src = q + 32 * (j >> 1) + 16 * h
            if five:
                unpack16(s, so + 32 * j + 16 * h, row, src, 4 * (j & 1), 15, o + 16 + 16 * h, j, 1, 4, 0, dl, -ml, 10)
            else:
                unpack16(s, so + 32 * j + 16 * h, row, src, 4 * (j & 1), 15, 0, 0, 0, 0, 0, dl, -ml, 8)


@njit(inline="always", cache=True)
def _dec_q4k(row: Any, o: int, s: Any, so: int) -> None:
    _dec_q45k(row, o, s, so, False)


@njit(inline="always", cache=True)
def _dec_q5k(row: Any, o: int, s: Any, so: int) -> None:
    _dec_q45k(row, o, s, so, True)


@njit(inline="always", cache=True)
def _dec_q6k(row: Any, o: int, s: Any, so: int) -> None:
    """128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales, f16 d; (d * sc) * (q - 32)."""
    d = f16_at(row, o + 208)
    for i in range(16):  # 16-element group i = 8h + 2s + half
        h, sh, half = i >> 3, (i >> 1) & 3, i & 1
        dl = d * np.float32(np.int8(row[o + 192 + i]))
        lo = o + 64 * h + 32 * (sh & 1) + 16 * half
        unpack16(s, so + 16 * i, row, lo, 4 * (sh >> 1), 15, o + 128 + 32 * h + 16 * half, 2 * sh, 3, 4, 32,
                 dl, dl, 2)


# ---- the decode-sized kernel: one cached parallel kernel per type ------------------------------------


@njit(inline="always", cache=True)
def _gemv_rows(dec: Any, blk: int, bpb: int, a: Any, w: Any, out: Any, c: int) -> None:
    """Chunk c of out <- a @ dequant(w)ᵀ for a [R <= DECODE_ROWS, K] (C-contiguous), w uint8 [n, row
    bytes]: each 256 weights are decoded once (`dec`: one block into the scratch) and dotted with every
    row of a."""
    m, k = a.shape
    lo, hi = chunk_bounds(c, w.shape[0], chunk_count(w.shape[0]))
    flat = a.reshape(m * k)
    s = carray(stack_f32(256), (256,))
    acc = carray(stack_f32(256), (256,))  # 16 lanes per row, DECODE_ROWS rows
    per = 256 // blk  # blocks per 256 weights
    full = k // 256
    for j in range(lo, hi):
        for t in range(16 * m):
            acc[t] = 0
        row = w[j]
        for g in range(full):
            for b in range(per):
                o = (g * per + b) * bpb
                dec(row, o, s, b * blk)
            for i in range(m):
                dot256(acc, 16 * i, s, 0, flat, i * k + 256 * g)
        b0 = full * per  # a last run of fewer than 8 32-element blocks
        for b in range(b0, k // blk):
            dec(row, b * bpb, s, (b - b0) * blk)
        for i in range(m):
            for t in range((k - 256 * full) // 16):
                mac16(acc, 16 * i, s, 16 * t, flat, i * k + 256 * full + 16 * t)
            for h in (8, 4, 2, 1):
                for t in range(h):
                    acc[16 * i + t] += acc[16 * i + t + h]
            out[i, j] = acc[16 * i]


# Named kernels, one per type, so that Numba's cache finds them again (factory closures it does not).
@row_kernel()
def _gemv_q4_0(a: Any, w: Any, out: Any) -> None:
    for c in prange(chunk_count(w.shape[0])):
        _gemv_rows(_dec_q4_0, 32, 18, a, w, out, c)


@row_kernel()
def _gemv_q4_1(a: Any, w: Any, out: Any) -> None:
    for c in prange(chunk_count(w.shape[0])):
        _gemv_rows(_dec_q4_1, 32, 20, a, w, out, c)


@row_kernel()
def _gemv_q5_0(a: Any, w: Any, out: Any) -> None:
    for c in prange(chunk_count(w.shape[0])):
        _gemv_rows(_dec_q5_0, 32, 22, a, w, out, c)


@row_kernel()
def _gemv_q5_1(a: Any, w: Any, out: Any) -> None:
    for c in prange(chunk_count(w.shape[0])):
        _gemv_rows(_dec_q5_1, 32, 24, a, w, out, c)


@row_kernel()
def _gemv_q8_0(a: Any, w: Any, out: Any) -> None:
    for c in prange(chunk_count(w.shape[0])):
        _gemv_rows(_dec_q8_0, 32, 34, a, w, out, c)


@row_kernel()
def _gemv_q8_1(a: Any, w: Any, out: Any) -> None:
    for c in prange(chunk_count(w.shape[0])):
        _gemv_rows(_dec_q8_1, 32, 36, a, w, out, c)


@row_kernel()
def _gemv_q2k(a: Any, w: Any, out: Any) -> None:
    for c in prange(chunk_count(w.shape[0])):
        _gemv_rows(_dec_q2k, 256, 84, a, w, out, c)


@row_kernel()
def _gemv_q3k(a: Any, w: Any, out: Any) -> None:
    for c in prange(chunk_count(w.shape[0])):
        _gemv_rows(_dec_q3k, 256, 110, a, w, out, c)


@row_kernel()
def _gemv_q4k(a: Any, w: Any, out: Any) -> None:
    for c in prange(chunk_count(w.shape[0])):
        _gemv_rows(_dec_q4k, 256, 144, a, w, out, c)


@row_kernel()
def _gemv_q5k(a: Any, w: Any, out: Any) -> None:
    for c in prange(chunk_count(w.shape[0])):
        _gemv_rows(_dec_q5k, 256, 176, a, w, out, c)


@row_kernel()
def _gemv_q6k(a: Any, w: Any, out: Any) -> None:
    for c in prange(chunk_count(w.shape[0])):
        _gemv_rows(_dec_q6k, 256, 210, a, w, out, c)


GEMV: dict[QuantType, Any] = {
    QuantType.Q4_0: _gemv_q4_0, QuantType.Q4_1: _gemv_q4_1, QuantType.Q5_0: _gemv_q5_0,
    QuantType.Q5_1: _gemv_q5_1, QuantType.Q8_0: _gemv_q8_0, QuantType.Q8_1: _gemv_q8_1,
    QuantType.Q2K: _gemv_q2k, QuantType.Q3K: _gemv_q3k, QuantType.Q4K: _gemv_q4k, QuantType.Q5K: _gemv_q5k,
    QuantType.Q6K: _gemv_q6k,
}

# ---- the impl -----------------------------------------------------------------------------------------

def _scratch(rows: int, k: int) -> np.ndarray:
    """A float32 [rows, k] tile buffer (from the shared pool, which reuses large buffers once free)."""
    return POOL.empty((rows, k), np.dtype(np.float32))


def tile_rows(k: int) -> int:
    """Rows of W per dequantised tile: about TILE_BYTES of f32, a multiple of 16, 16..256."""
    return min(256, max(16, TILE_BYTES // (4 * max(k, 1)) // 16 * 16))


def qmatmul_kernel(inputs: list[np.ndarray], out: np.ndarray, params: QMatMulParams) -> None:
    a, w = inputs
    qt, k, n = params.quant_type, params.k, params.n
    rows = math.prod(a.shape[:-1])
    if out.size == 0:
        return
    if k == 0 or n == 0:
        out.fill(0)
        return
    raw = w.view(np.uint8)[:weight_bytes(params)].reshape(n, -1)  # the padding to whole words dropped
    a2, o2 = a.reshape(rows, a.shape[-1]), out.reshape(rows, out.shape[-1])
    if params.transpose:
        _transposed(qt, a2, raw, o2)
    elif rows <= DECODE_ROWS:
        GEMV[qt](a2, raw, o2)
    else:
        _tiled(qt, a2, raw, o2)


def _tiled(qt: QuantType, a2: np.ndarray, raw: np.ndarray, o2: np.ndarray) -> None:
    """o2 <- a2 @ dequant(W)ᵀ by tiles of W rows: dequantise a tile, one sgemm into its columns."""
    n, k = raw.shape[0], a2.shape[1]
    t = tile_rows(k)

    def part(tiles: range) -> None:
        tile = _scratch(t, k)
        for i in tiles:
            r0, r1 = i * t, min(n, i * t + t)
            dequantize_rows_into(raw, qt, r0, r1, tile)
            np.matmul(a2, tile[:r1 - r0].T, out=o2[:, r0:r1])

    split_work(part, -(-n // t))


def _transposed(qt: QuantType, g2: np.ndarray, raw: np.ndarray, o2: np.ndarray) -> None:
    """o2 <- g2 @ dequant(W) (g2 [R, n], o2 [R, k]): the tiles' products added in tile order."""
    n, k = raw.shape[0], o2.shape[1]
    t = tile_rows(k)
    tile = _scratch(t, k)
    part = np.empty_like(o2)
    for r0 in range(0, n, t):
        r1 = min(n, r0 + t)
        dequantize_rows_into(raw, qt, r0, r1, tile)
        np.matmul(g2[:, r0:r1], tile[:r1 - r0], out=o2 if r0 == 0 else part)
        if r0:
            np.add(o2, part, out=o2)


def qmatmul_cost(shapes: Sequence[Shape], dtypes: Sequence[DType], params: QMatMulParams) -> CostEstimate:
    """2·R·n·k flops of products and sums, plus 2·n·k of dequantisation (each weight converted and
    scaled, once a call); the weight's bytes, a and the output move once. Counting the dequantisation
    keeps mid-sized decode steps parallel: one core decodes about 7 GB/s of Q4_0, not the executor's
    12 GB/s a byte (a [1536, 576] weight took 197 µs serially, 119 µs on two threads)."""
    a, _, out = shapes
    rows = math.prod(a[:-1])
    moved = weight_bytes(params) + 4 * (math.prod(a) + math.prod(out))
    return CostEstimate(flops=2 * (rows + 1) * params.n * params.k, bytes_moved=moved)


# |out - ref| <= max_relative·|ref| + max_absolute·S against float64 `a @ dequant(W)ᵀ` (dequantised by
# gguf), S = |a| @ |dequant(W)|ᵀ per element. Twice the worst `python -m fuel.testing.measure QMatMul`
# found over seeds 0-59 (worst relative 6.2e-7, absolute still needed 1.6e-7·S; both from the sgemm).
PRECISION = PrecisionGuarantee(True, None, 1.3e-6, 3.3e-7, "bit-exact gguf dequantisation, f32 products and "
                               "sums (fixed-order lanes when decoding, sgemm per tile otherwise)")


def register(registry: FusedKernelRegistry) -> None:
    registry.register(BackendImpl(FusedOps.QMATMUL, "cpu", qmatmul_kernel, (DType.F32, DType.U32, DType.F32),
                                  qmatmul_cost, PRECISION, CONTIGUOUS_ONLY, revision_of(qmatmul_kernel)))
