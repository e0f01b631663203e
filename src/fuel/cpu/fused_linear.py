"""FusedLinear (entry 2): `a @ b + bias` as one OpenBLAS GEMM through NumPy, bias added in place.

- A shared rank-2 b makes the whole batch one `[rows, K] @ [K, N]` GEMM (BLAS is fastest on one
  large product, and b is read once).
- GQA-style batches (a batch dim a multiple of b's) are NumPy views: a is split `[b_d, rep]` per
  batch dim and b gets size-1 axes that matmul broadcasts; the trailing repetition folds into M,
  so e.g. 4 query heads sharing one kv head are one GEMM, not 4.
- f32/f64 run BLAS straight into `out` and add the bias to each piece of it as soon as it is done,
  while it is in cache. bf16/f16 widen exactly to f32, run one sgemm into an f32 scratch buffer, add
  the bias in f32 and round once on store.
Up to `GEMV_MAX_ROWS` rows times a C-contiguous 2-D f32/f64 weight run through MATMUL's row-invariant gemv loop
instead (docs/kernels.md, "Batch invariance"); any other f32 product with a 2-D weight runs on fuel's tile GEMM
(`dense_tiles`), whose rows are the same bytes at any row count, so a sentence's embedding does not depend on
the sentences batched with it. Otherwise the product runs as one-thread OpenBLAS GEMMs on fixed pieces
of the output (`row_blocks`), so an element's bytes do not depend on the thread count (OpenBLAS's own
threading cuts a GEMM by it). The bf16 store (bias added, one rounding) is a task over the rows.

The impl takes strided inputs: BLAS reads a transposed matrix through its trans flag, so the
common `x @ w.T + b` (a [N, K] weight) costs no copy of the weight. Only a matrix BLAS cannot
address (neither dim unit-stride) is made contiguous here, because NumPy would otherwise run its
slow non-BLAS matmul loop on it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import carray

from fuel.cpu import dense_tiles
from fuel.cpu.prims.gemv import gemv, takes
from fuel.cpu.simd import row_blocks
from fuel.cpu.simd.half import bits, narrow_bf16_row, widened
from fuel.dispatch.impls import (
    BackendImpl,
    CostEstimate,
    FusedKernelRegistry,
    KernelCaps,
    PrecisionGuarantee,
    revision_of,
)
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.node import Shape
from fuel.graph.registry import FusedOps
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.buffers import POOL
from fuel.runtime.jobs import ADDRESS, INT, record_at

SECONDS_PER_VALUE = 0.5e-9  # one core's time an output value of the bf16 store, for the part count
BIAS_ARGS = jobs.record(acc=ADDRESS, bias=ADDRESS, out=ADDRESS, rows=INT, cols=INT)


@pool.task(error_model="numpy")
def _bias_narrow_bf16_part(part: int, parts: int, argv: int) -> None:
    """Rows of out (bf16 bits) <- round(acc + bias) per row of the f32 accumulator, rounded once. The
    scratch row is rewritten for every row, so the split never shows in the bytes."""
    a = record_at(argv, BIAS_ARGS)
    rows, n = a.rows, a.cols
    acc = carray(pointer(a.acc, np.float32), (rows, n))
    bias = carray(pointer(a.bias, np.float32), (n,))
    out = carray(pointer(a.out, np.uint16), (rows, n))
    tmp = np.empty(n, np.float32)
    for r in range(part * rows // parts, (part + 1) * rows // parts):
        for j in range(n):
            tmp[j] = acc[r, j] + bias[j]
        narrow_bf16_row(tmp.view(np.uint32), out[r])


def _bias_narrow_bf16(acc: np.ndarray, bias: np.ndarray, out: np.ndarray) -> None:
    """out (bf16 bits [rows, n]) <- acc (f32 [rows, n]) + bias (f32 [n]), all C-contiguous."""
    argv = jobs.argv_of(BIAS_ARGS)
    row = argv[0]
    row["acc"], row["bias"], row["out"] = acc.ctypes.data, bias.ctypes.data, out.ctypes.data
    row["rows"], row["cols"] = acc.shape
    jobs.run(jobs.job(_bias_narrow_bf16_part, argv, acc.size * SECONDS_PER_VALUE, acc.shape[0]))


def _blas_ready(x: np.ndarray) -> np.ndarray:
    """x itself when BLAS can read each of its matrices (row- or column-major), else a C copy."""
    item = x.itemsize
    st, sh = x.strides, x.shape
    rows_ok = st[-1] == item and st[-2] >= item * max(sh[-1], 1)
    cols_ok = st[-2] == item and st[-1] >= item * max(sh[-2], 1)
    if (rows_ok or cols_ok) and all(t >= 0 for t in st):
        return x
    return np.ascontiguousarray(x)


def _operands(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Views of a, b and out whose plain np.matmul is the entry's product (out is contiguous).

    reshape copies a (only) when its layout cannot be regrouped, which NumPy decides.
    """
    a, b = _blas_ready(a), _blas_ready(b)
    k, n = b.shape[-2], b.shape[-1]
    if b.ndim == 2:
        rows = math.prod(a.shape[:-1])  # explicit: reshape(-1, 0) is ambiguous for empty arrays
        return a.reshape(rows, k), b, out.reshape(rows, n)
    m = a.shape[-2]
    reps = [da // db if db else 1 for da, db in zip(a.shape[:-2], b.shape[:-2], strict=True)]
    if all(r == 1 for r in reps):
        return a, b, out
    lead = b.shape[:-2]
    spread_b = tuple(d for db in lead for d in (db, 1)) + (k, n)
    wide = [d for db, r in zip(lead, reps, strict=True) for d in (db, r)]
    # Fold the last repetition into M: its rep*M rows of a are contiguous and read the same b.
    last = wide.pop()
    return (a.reshape((*wide, last * m, k)), b.reshape(spread_b[:-3] + (k, n)),
            out.reshape((*wide, last * m, n)))


def _gemm_bias(a: np.ndarray, b: np.ndarray, bias: np.ndarray, out: np.ndarray) -> None:
    """out <- a @ b + bias for f32/f64 (out has the inputs' dtype). Up to GEMV_MAX_ROWS rows times a
    C-contiguous 2-D weight run through the row-invariant gemv loop, the bias added after, as MATMUL's do: a
    row's bytes are then the same in any batch (a served float model's biased projections)."""
    if b.ndim > 2 and all(d == 1 or st == 0 for d, st in zip(b.shape[:-2], b.strides[:-2], strict=True)):
        b = b[(0,) * (b.ndim - 2)]  # one weight for every batch entry: one product over all rows, as MATMUL's
    va, vb, vo = _operands(a, b, out)
    if va.ndim == 2 and takes(va.shape[0], va, vb) and vo.dtype == va.dtype:
        gemv(va, vb, vo)
        np.add(vo, bias, out=vo)
        return
    if (dense_tiles.AVAILABLE and va.ndim == 2 and vb.ndim == 2 and va.dtype == vb.dtype == vo.dtype == np.float32
            and min(vb.strides) >= 0):
        dense_tiles.matmul(np.ascontiguousarray(va), vb, vo)
        np.add(vo, bias, out=vo)
        return
    row_blocks.matmul(va, vb, vo, bias)


def linear_f32(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
    a, b, bias = inputs
    _gemm_bias(a, b, bias, out)


linear_f64 = linear_f32


def linear_half(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
    """bf16/f16: one sgemm on exact f32 copies, bias added in f32, one rounding on store."""
    a, b, bias = inputs
    acc = POOL.empty(out.shape, np.dtype(np.float32))
    va, vb, vo = _operands(widened(a), widened(b), acc)
    row_blocks.matmul(va, vb, vo)
    bias32 = bias.astype(np.float32)
    if out.dtype == DType.BF16.np:
        if out.size:
            n = out.shape[-1]
            _bias_narrow_bf16(acc.reshape(-1, n), np.ascontiguousarray(bias32), bits(out).reshape(-1, n))
    else:
        np.add(acc, bias32, out=acc)
        np.copyto(out, acc, casting="unsafe")


def linear_cost(shapes: Sequence[Shape], dtypes: Sequence[DType], params: Any) -> CostEstimate:
    """2·K flops per output element (the batch and shared-b cases alike); every operand moves once."""
    a, out = shapes[0], shapes[-1]
    flops = 2 * math.prod(out) * (a[-1] if a else 0)
    moved = sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes, strict=True))
    return CostEstimate(flops=flops, bytes_moved=moved)


# |out - ref| <= max_relative·|ref| + max_absolute·S with S = |a| @ |b| + |bias| per output element
# (BLAS error scales with the sum of |terms|, not with the result). Twice the worst error
# `python -m fuel.testing.measure FusedLinear` found over seeds 0-59 (K <= 300); the relative part is
# at least the unit roundoff of the output. The half types widen exactly and run sgemm, so their
# absolute part is the f32 impl's.
LINEAR_PRECISION = {
    DType.F32: PrecisionGuarantee(True, None, 6.6e-7, 4.1e-7, "fuel's tile GEMM (or OpenBLAS sgemm for a batched "
                                  "weight), f32 accumulation; bias added after"),
    DType.F64: PrecisionGuarantee(True, None, 2.3e-16, 7.7e-16, "OpenBLAS dgemm, f64 accumulation"),
    DType.BF16: PrecisionGuarantee(True, None, 7.9e-3, 4.1e-7, "exact widening, sgemm, one RNE rounding on store"),
    DType.F16: PrecisionGuarantee(True, None, 9.8e-4, 4.1e-7, "exact widening, sgemm, one rounding on store"),
}

STRIDED = KernelCaps(strided_input=True)


def register(registry: FusedKernelRegistry) -> None:
    rev = revision_of(linear_f32)
    kernels = {DType.F32: linear_f32, DType.F64: linear_f64, DType.BF16: linear_half, DType.F16: linear_half}
    for dt in FLOAT_DTYPES:
        registry.register(BackendImpl(FusedOps.FUSED_LINEAR, "cpu", kernels[dt], (dt, dt, dt, dt),
                                      linear_cost, LINEAR_PRECISION[dt], STRIDED, rev))
