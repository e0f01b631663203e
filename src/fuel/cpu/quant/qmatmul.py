"""QMatMul (entry 14) on the CPU: `C = A @ dequant(W)ᵀ` for every GGUF block type, never quantizing A.

Two paths, chosen by the number of activation rows R (batch dims folded in: the weight is shared):
- R <= DECODE_ROWS (decode): `gguf_gemv`, one pass over the weight bytes, rows of W in fixed parallel
  chunks. Each 32 weights' integer codes are widened to exact floats in registers straight from the
  packed bytes (one row of Q4_0, Q4_1 or Q4_K on an AVX-512 host: looked up by table, `nibble_tables`)
  and dotted with the activations, the block scale factored out where the block shares one, or (Q4_1,
  Q5_1) the unit's values formed once by FMA (see that module). No dequantised weight exists anywhere,
  and each output is one thread's fixed sequence of f32 operations: the bytes never depend on the thread
  count.
  Row-invariant: for 1 <= R <= ROW_INVARIANT_ROWS (= DECODE_ROWS) each output row's bytes are those of
  its activation row alone (the same kernel's operations; 2 or more rows share each decoded weight unit,
  `gguf_many`), whatever the other rows are or where it sits. The server's batched step caps its rows
  at it, so that a request's tokens never depend on what else is in the batch.
- larger R: tiles of W rows are dequantised (`gguf_blocks.dequantize_rows_into`) into a reused f32
  scratch and each is multiplied by fuel's tile kernel on AVX-512 hosts, else one one-thread OpenBLAS
  sgemm (`weight_tiles`); tiles are fixed by the weight's shape and run on fuel's threads, so the bytes
  do not depend on the thread count either.
The transposed form (the gradient, `G @ dequant(W)`) adds tile products `G[:, tile] @ tile` in order.

Both paths use gguf-py's dequantised values bit for bit (the decode path's factored form is the same
math in another f32 order: with identity activations it returns them exactly), and the tests check
both against gguf-py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fuel.cpu.quant import gguf_tiles
from fuel.cpu.quant.gguf_blocks import dequantize_rows_into
from fuel.cpu.quant.gguf_decode import gemv, many_rows_job, one_row_job, table_jobs
from fuel.cpu.quant.gguf_gemv import DECODE_ROWS
from fuel.cpu.quant.weight_tiles import F32, tile_rows, tiled_product
from fuel.cpu.simd import row_blocks
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
from fuel.graph.registry.qmatmul import QMatMulParams, weight_bytes
from fuel.quant import QuantType
from fuel.runtime import jobs
from fuel.runtime.buffers import POOL

ROW_INVARIANT_ROWS = DECODE_ROWS  # up to this many activation rows, each output row is the same bytes as alone

_LAUNCHES = jobs.JobCache()  # decode calls (1..DECODE_ROWS rows) of replayed steps (`fuel.runtime.jobs`)


def qmatmul_kernel(inputs: list[np.ndarray], out: np.ndarray, params: QMatMulParams) -> None:
    a, w = inputs
    launch = _LAUNCHES.find((a, w, out), params)
    if launch is not None:
        jobs.run(launch)
        return
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
        launch = gemv(qt, a2, raw, o2)
        if launch is not None:
            _LAUNCHES.remember((a, w, out), params, launch)
    else:
        _tiled(qt, a2, raw, o2)


@jobs.replays(qmatmul_kernel)
def qmatmul_form(inputs: list[np.ndarray], out: np.ndarray, params: QMatMulParams) -> jobs.Jobs | None:
    """1..ROW_INVARIANT_ROWS activation rows of a non-transposed f32 product: the decode job `qmatmul_kernel`
    posts for them (`gguf_decode.gemv`): at two or more rows the many-row job, at one the one-row job, or a
    table kernel's after the job permuting the activations into its scratch, as `gemv` does per call."""
    a, w = inputs
    rows = math.prod(a.shape[:-1])
    if (params.transpose or not 1 <= rows <= ROW_INVARIANT_ROWS or out.size == 0 or params.k == 0
            or a.dtype != np.float32 or not (a.flags.c_contiguous and w.flags.c_contiguous and out.flags.c_contiguous)):
        return None
    raw = w.view(np.uint8)[:weight_bytes(params)].reshape(params.n, -1)
    a2, o2 = a.reshape(rows, a.shape[-1]), out.reshape(rows, out.shape[-1])
    if rows > 1:
        return many_rows_job(params.quant_type, a2, raw, o2)
    job = one_row_job(params.quant_type, a2, raw, o2)
    if job is not None:
        return job
    permute, table, keep = table_jobs(params.quant_type, a2, raw, o2)
    return permute._replace(keep=keep), table


def _tiled(qt: QuantType, a2: np.ndarray, raw: np.ndarray, o2: np.ndarray) -> None:
    """o2 <- a2 @ dequant(W)ᵀ by tiles of W rows (`weight_tiles`: dequantise a tile, multiply it)."""
    if not gguf_tiles.tiled(qt, a2, raw, o2):
        tiled_product(a2, raw.shape[0], lambda r0, r1, tile: dequantize_rows_into(raw, qt, r0, r1, tile), o2)


def _transposed(qt: QuantType, g2: np.ndarray, raw: np.ndarray, o2: np.ndarray) -> None:
    """o2 <- g2 @ dequant(W) (g2 [R, n], o2 [R, k]): the tiles' products added in tile order."""
    n, k = raw.shape[0], o2.shape[1]
    t = tile_rows(k)
    tile = POOL.empty((t, k), F32)
    part = np.empty_like(o2)
    for r0 in range(0, n, t):
        r1 = min(n, r0 + t)
        dequantize_rows_into(raw, qt, r0, r1, tile)
        row_blocks.matmul(g2[:, r0:r1], tile[:r1 - r0], o2 if r0 == 0 else part)
        if r0:
            np.add(o2, part, out=o2)


def qmatmul_cost(shapes: Sequence[Shape], dtypes: Sequence[DType], params: QMatMulParams) -> CostEstimate:
    """2·R·n·k flops of products and sums; the weight's bytes, a and the output move once. The decode
    path widens the codes in registers for about the price of the products, so the decoding is not
    counted again (docs/performance/quant.md, "qmatmul")."""
    a, _, out = shapes
    rows = math.prod(a[:-1])
    moved = weight_bytes(params) + 4 * (math.prod(a) + math.prod(out))
    return CostEstimate(flops=2 * rows * params.n * params.k, bytes_moved=moved)


# |out - ref| <= max_relative·|ref| + max_absolute·S against float64 `a @ dequant(W)ᵀ` (dequantised by
# gguf), S = |a| @ |dequant(W)|ᵀ per element. Twice the worst `python -m fuel.testing.measure QMatMul`
# found over seeds 0-59: worst relative 6.2e-7 (from the sgemm), absolute still needed 2.2e-7·S (from
# the decode path's factored offsets: Q4_K and Q5_K, and Q4_1 and Q5_1 when it was measured, at R <= 16
# sum d·Σq·x and m·Σx apart, so their rounding scales with |d·q|·|x| + |m|·|x| rather than |d·q + m|·|x|;
# within ~2x of S for weights as quantized, unbounded by S only for adversarial x large exactly where
# d·q + m cancels).
PRECISION = PrecisionGuarantee(True, None, 1.3e-6, 4.5e-7, "bit-exact gguf dequantisation, f32 products and "
                               "sums (fixed-order lanes when decoding, block scales and offsets factored out "
                               "or values formed by FMA at R <= 16; tile kernel or sgemm per tile otherwise)")


def register(registry: FusedKernelRegistry) -> None:
    registry.register(BackendImpl(FusedOps.QMATMUL, "cpu", qmatmul_kernel, (DType.F32, DType.U32, DType.F32),
                                  qmatmul_cost, PRECISION, CONTIGUOUS_ONLY, revision_of(qmatmul_kernel)))
