"""Softmax over the last axis (entry 1) and its backward (entry 7): one task over rows per dtype (row_tasks).

Each row is computed by one thread in a fixed order, so results are bit-stable; bf16 rows are widened into
f32 scratch, computed as f32 rows and rounded once on store; f16 runs the f32 kernel on a widened copy.
The f32 path uses a vectorisable Cephes-style expf (measured error in the impl's PrecisionGuarantee); f64
uses libm exp.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import njit

from fuel.cpu.norms.row_tasks import BF16, bf16_rows, native_rows, reads_rows, rows_job
from fuel.cpu.simd.half import via_f32
from fuel.cpu.simd.vecmath import expf_nonpositive, maxnum
from fuel.dispatch.impls import (
    BackendImpl,
    FusedKernelRegistry,
    KernelCaps,
    PrecisionGuarantee,
    elementwise_cost,
    revision_of,
)
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.registry import FusedOps
from fuel.runtime import jobs, pool

# Reassociation lets the row sums vectorise (a fixed order per build: still bit-stable);
# no nnan/ninf, so NaN and inf rows keep IEEE behaviour.
FASTMATH = {"nsz", "reassoc", "contract", "arcp"}
SECONDS_PER_VALUE = 1e-9  # one core's time a value (a max pass, an exp pass, a scaling pass)
BACKWARD_SECONDS_PER_VALUE = 0.5e-9


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _row_max(x: Any) -> Any:
    # llvm.maxnum vectorises, a `v > m` select does not (docs/performance/rows.md, "softmax_last_dim").
    # Either way a NaN never becomes the max, and its own exp still makes the row NaN.
    m = x[0]
    for j in range(1, x.shape[0]):
        m = maxnum(m, x[j])
    return m


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _exp_sum_f32(x: Any, m: Any, o: Any) -> Any:
    """o <- exp(x - m); returns the sum of o. Two passes: a loop that reads x and writes o gets a runtime
    check of the distance between them, and its scalar fallback (o just past x) would sum in another
    order; the sum reads o alone, so its order never depends on where the arrays lie."""
    for j in range(x.shape[0]):
        o[j] = expf_nonpositive(x[j] - m)
    s = np.float32(0.0)
    for j in range(x.shape[0]):
        s += o[j]
    return s


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _softmax_f32(x: Any, g: Any, o: Any, eps: Any, inv_n: Any, one: Any) -> bool:
    """One f32 row: the exponentials into o, then scaled by the reciprocal of their sum."""
    inv = np.float32(1.0) / _exp_sum_f32(x, _row_max(x), o)
    for j in range(x.shape[0]):
        o[j] = o[j] * inv
    return True


@njit(inline="always", cache=True)
def _softmax_f64(x: Any, g: Any, o: Any, eps: Any, inv_n: Any, one: Any) -> bool:
    """One f64 row, libm exp, summed in row order (its task compiles without reassociation)."""
    m = _row_max(x)
    s = 0.0
    for j in range(x.shape[0]):
        e = math.exp(x[j] - m)
        o[j] = e
        s += e
    inv = 1.0 / s
    for j in range(x.shape[0]):
        o[j] = o[j] * inv
    return True


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _backward(y: Any, g: Any, o: Any, dot: Any) -> None:
    """o = y * (g - (dot + sum(g * y))) for one row."""
    for j in range(y.shape[0]):
        dot += y[j] * g[j]
    for j in range(y.shape[0]):
        o[j] = y[j] * (g[j] - dot)


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _softmax_backward(y: Any, g: Any, o: Any, eps: Any, inv_n: Any, one: Any) -> bool:
    """f32 or f64 (the rows' own type); the sum starts from y[0]·g[0]·0 (NaN when that product is not
    finite)."""
    _backward(y, g, o, y[0] * g[0] * 0)
    return True


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _softmax_backward_bf16(y: Any, g: Any, o: Any, eps: Any, inv_n: Any, one: Any) -> bool:
    """bf16 rows widened to f32; the sum starts from 0."""
    _backward(y, g, o, np.float32(0.0))
    return True


@njit(inline="always", cache=True)
def _never(x: Any, g: Any, o: Any, eps: Any, inv_n: Any, one: Any) -> bool:
    """The fallback of a row function that never asks for one."""
    return True


@pool.task(fastmath=FASTMATH, error_model="numpy")
def _softmax_f32_part(part: int, parts: int, argv: int) -> None:
    native_rows(part, parts, argv, np.float32, _softmax_f32, _never)


@pool.task(error_model="numpy")
def _softmax_f64_part(part: int, parts: int, argv: int) -> None:
    native_rows(part, parts, argv, np.float64, _softmax_f64, _never)


@pool.task(fastmath=FASTMATH, error_model="numpy")
def _softmax_bf16_part(part: int, parts: int, argv: int) -> None:
    bf16_rows(part, parts, argv, np.uint16, _softmax_f32, _never)


@pool.task(fastmath=FASTMATH, error_model="numpy")
def _backward_f32_part(part: int, parts: int, argv: int) -> None:
    native_rows(part, parts, argv, np.float32, _softmax_backward, _never)


@pool.task(fastmath=FASTMATH, error_model="numpy")
def _backward_f64_part(part: int, parts: int, argv: int) -> None:
    native_rows(part, parts, argv, np.float64, _softmax_backward, _never)


@pool.task(fastmath=FASTMATH, error_model="numpy")
def _backward_bf16_part(part: int, parts: int, argv: int) -> None:
    bf16_rows(part, parts, argv, np.uint16, _softmax_backward_bf16, _never)


_TASKS = {np.dtype(np.float32): _softmax_f32_part, np.dtype(np.float64): _softmax_f64_part,
          BF16: _softmax_bf16_part}
_BACKWARD_TASKS = {np.dtype(np.float32): _backward_f32_part, np.dtype(np.float64): _backward_f64_part,
                   BF16: _backward_bf16_part}


def softmax_job(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> jobs.Jobs | None:
    """x and out of one dtype among f32, f64 and bf16, rows laid out as `rows_job` reads them (None otherwise)."""
    return rows_job(_TASKS, inputs, out, 0.0, SECONDS_PER_VALUE)


def softmax_backward_job(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> jobs.Jobs | None:
    """y, g and out of one dtype among f32, f64 and bf16, rows laid out as `rows_job` reads them (None otherwise)."""
    return rows_job(_BACKWARD_TASKS, inputs, out, 0.0, BACKWARD_SECONDS_PER_VALUE)


softmax_kernel = jobs.kernel(softmax_job)
softmax_backward_kernel = jobs.kernel(softmax_backward_job)


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
    """Both entries for every float dtype; inputs whose rows are evenly spaced are read in place."""
    rev = revision_of(_softmax_f32, native_rows)
    caps = KernelCaps(strided_input=True, reads=reads_rows)
    for dt in FLOAT_DTYPES:
        forward = via_f32(softmax_kernel) if dt == DType.F16 else softmax_kernel
        backward = via_f32(softmax_backward_kernel) if dt == DType.F16 else softmax_backward_kernel
        registry.register(BackendImpl(FusedOps.SOFTMAX_LAST_DIM, "cpu", forward, (dt, dt),
                                      elementwise_cost(5), SOFTMAX_PRECISION[dt], caps, rev))
        registry.register(BackendImpl(FusedOps.SOFTMAX_LAST_DIM_BACKWARD, "cpu", backward, (dt, dt, dt),
                                      elementwise_cost(4), SOFTMAX_BACKWARD_PRECISION[dt], caps, rev))
