"""Softmax over the last axis (entry 1) and its backward (entry 7): Numba, one thread per row block.

Each row is computed by one thread in a fixed order, so results are bit-stable. The f32 path uses a
vectorisable Cephes-style expf (measured error in the impl's PrecisionGuarantee); f64 uses libm exp.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import njit, prange

from fuel.cpu.simd.driver import chunk_bounds, chunk_count, row_kernel
from fuel.cpu.simd.half import bits, narrow_bf16_row, rows2d, via_f32, widen_bf16_row
from fuel.cpu.simd.vecmath import bf16_to_f32, expf_nonpositive, f32_to_bf16, maxnum
from fuel.dispatch.impls import (
    CONTIGUOUS_ONLY,
    BackendImpl,
    FusedKernelRegistry,
    PrecisionGuarantee,
    elementwise_cost,
    revision_of,
)
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.registry import FusedOps

# Reassociation lets the row sums vectorise (a fixed order per build: still bit-stable);
# no nnan/ninf, so NaN and inf rows keep IEEE behaviour.
FASTMATH = {"nsz", "reassoc", "contract", "arcp"}

@njit(inline="always", cache=True, fastmath=FASTMATH)
def _row_max(x: Any) -> Any:
    # llvm.maxnum vectorises; a `v > m` select does not (5-8x slower on long rows). Either way a NaN
    # never becomes the max, and its own exp still makes the row NaN.
    m = x[0]
    for j in range(1, x.shape[0]):
        m = maxnum(m, x[j])
    return m


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _exp_sum_f32(x: Any, m: Any, o: Any) -> Any:
    """o <- exp(x - m); returns the sum (one vectorised pass)."""
    s = np.float32(0.0)
    for j in range(x.shape[0]):
        e = expf_nonpositive(x[j] - m)
        o[j] = e
        s += e
    return s


@row_kernel(fastmath=FASTMATH)
def _softmax_f32(x: Any, out: Any) -> None:
    rows, n = x.shape
    for r in prange(rows):
        o = out[r]
        inv = np.float32(1.0) / _exp_sum_f32(x[r], _row_max(x[r]), o)
        for j in range(n):
            o[j] = o[j] * inv


@row_kernel(fastmath=FASTMATH)
def _softmax_bf16(x: Any, out: Any) -> None:
    """bf16 bits in and out; each row widened once into f32 scratch, rounded once on store."""
    rows, n = x.shape
    chunks = chunk_count(rows)
    for c in prange(chunks):
        wide = np.empty(n, np.float32)
        e = np.empty(n, np.float32)
        start, stop = chunk_bounds(c, rows, chunks)
        for r in range(start, stop):
            xr = x[r]
            for j in range(n):
                wide[j] = bf16_to_f32(xr[j])
            inv = np.float32(1.0) / _exp_sum_f32(wide, _row_max(wide), e)
            o = out[r]
            for j in range(n):
                o[j] = f32_to_bf16(e[j] * inv)


@row_kernel()
def _softmax_f64(x: Any, out: Any) -> None:
    rows, n = x.shape
    for r in prange(rows):
        m = _row_max(x[r])
        s = 0.0
        for j in range(n):
            e = math.exp(x[r, j] - m)
            out[r, j] = e
            s += e
        inv = 1.0 / s
        for j in range(n):
            out[r, j] = out[r, j] * inv


@row_kernel(fastmath=FASTMATH)
def _softmax_backward(y: Any, g: Any, out: Any) -> None:
    """out = y * (g - sum(g * y)) per row; f32 or f64 (the arrays' own type)."""
    rows, n = y.shape
    for r in prange(rows):
        dot = y[r, 0] * g[r, 0] * 0
        for j in range(n):
            dot += y[r, j] * g[r, j]
        for j in range(n):
            out[r, j] = y[r, j] * (g[r, j] - dot)


@row_kernel(fastmath=FASTMATH)
def _softmax_backward_bf16(y: Any, g: Any, out: Any) -> None:
    rows, n = y.shape
    chunks = chunk_count(rows)
    for c in prange(chunks):
        wy = np.empty(n, np.uint32)
        wg = np.empty(n, np.uint32)
        res = np.empty(n, np.float32)
        start, stop = chunk_bounds(c, rows, chunks)
        for r in range(start, stop):
            widen_bf16_row(y[r], wy)
            widen_bf16_row(g[r], wg)
            fy = wy.view(np.float32)
            fg = wg.view(np.float32)
            dot = np.float32(0.0)
            for j in range(n):
                dot += fy[j] * fg[j]
            for j in range(n):
                res[j] = fy[j] * (fg[j] - dot)
            narrow_bf16_row(res.view(np.uint32), out[r])


def softmax_f32(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
    if out.size:
        _softmax_f32(rows2d(inputs[0]), rows2d(out))


def softmax_f64(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
    if out.size:
        _softmax_f64(rows2d(inputs[0]), rows2d(out))


def softmax_bf16(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
    if out.size:
        _softmax_bf16(rows2d(bits(inputs[0])), rows2d(bits(out)))


softmax_f16 = via_f32(softmax_f32)


def softmax_backward_f32(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
    if out.size:
        _softmax_backward(rows2d(inputs[0]), rows2d(inputs[1]), rows2d(out))


softmax_backward_f64 = softmax_backward_f32


def softmax_backward_bf16(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
    if out.size:
        _softmax_backward_bf16(rows2d(bits(inputs[0])), rows2d(bits(inputs[1])), rows2d(bits(out)))


softmax_backward_f16 = via_f32(softmax_backward_f32)


# |out - ref| <= max_relative·|ref| + max_absolute·S against float64, S = max|ref| over the row (forward)
# or |y|·(|g| + Σ|g·y|) per element (backward, whose two terms can cancel). Twice the worst error
# `python -m fuel.testing.measure SoftmaxLastDim SoftmaxLastDimBackward` found over seeds 0-59; the
# relative part is at least the output's unit roundoff. The half types compute in f32 and round once,
# so their absolute part is the f32 impl's (the forward's covers expf flushing to 0 below e^-87.33).
SOFTMAX_PRECISION = {
    DType.F32: PrecisionGuarantee(True, None, 5e-7, 5.8e-9, "Cephes-style expf polynomial; f32 accumulation"),
    DType.F64: PrecisionGuarantee(True, None, 5e-15, 1.5e-17, "libm exp; f64 accumulation"),
    DType.BF16: PrecisionGuarantee(True, None, 7.9e-3, 5.8e-9, "f32 compute, one RNE rounding on store"),
    DType.F16: PrecisionGuarantee(True, None, 9.8e-4, 5.8e-9, "f32 compute, one RNE rounding on store"),
}
SOFTMAX_BACKWARD_PRECISION = {
    DType.F32: PrecisionGuarantee(True, None, 2.1e-7, 5.4e-8, "f32 accumulation of sum(g*y)"),
    DType.F64: PrecisionGuarantee(True, None, 1.2e-15, 3.9e-16, "f64 accumulation"),
    DType.BF16: PrecisionGuarantee(True, None, 7.9e-3, 5.4e-8, "f32 compute, one RNE rounding on store"),
    DType.F16: PrecisionGuarantee(True, None, 9.8e-4, 5.4e-8, "f32 compute, one RNE rounding on store"),
}


def register(registry: FusedKernelRegistry) -> None:
    rev = revision_of(_softmax_f32)
    forward = {DType.F32: softmax_f32, DType.F64: softmax_f64, DType.BF16: softmax_bf16, DType.F16: softmax_f16}
    backward = {DType.F32: softmax_backward_f32, DType.F64: softmax_backward_f64,
                DType.BF16: softmax_backward_bf16, DType.F16: softmax_backward_f16}
    for dt in FLOAT_DTYPES:
        registry.register(BackendImpl(FusedOps.SOFTMAX_LAST_DIM, "cpu", forward[dt], (dt, dt),
                                      elementwise_cost(5), SOFTMAX_PRECISION[dt], CONTIGUOUS_ONLY, rev))
        registry.register(BackendImpl(FusedOps.SOFTMAX_LAST_DIM_BACKWARD, "cpu", backward[dt], (dt, dt, dt),
                                      elementwise_cost(4), SOFTMAX_BACKWARD_PRECISION[dt], CONTIGUOUS_ONLY, rev))
