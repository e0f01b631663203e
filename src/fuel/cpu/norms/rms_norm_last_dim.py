"""RmsNorm over the last axis (entry 3) and its backward (entry 9): one task over rows per dtype.

The row functions, and how they survive rows whose squares overflow, are in norm_rows; the row tasks
(f32 and f64 in place, bf16 through f32 scratch rows rounded once) in row_tasks. A row is computed by
one thread in a fixed order, so the bytes are the same for any thread count and on every path (eager,
native replay). f16 runs the f32 kernel on a widened copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from fuel.cpu.norms.norm_rows import rms_bwd_row, rms_bwd_row_rescaled, rms_row, rms_row_rescaled
from fuel.cpu.norms.row_tasks import BF16, bf16_rows, native_rows, norm_cost, norm_precision, rows_job
from fuel.cpu.simd.half import via_f32
from fuel.dispatch.impls import CONTIGUOUS_ONLY, BackendImpl, FusedKernelRegistry, revision_of
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.registry import FusedOps
from fuel.runtime import jobs, pool

SECONDS_PER_VALUE = 0.5e-9  # one core's time a value of the forward, for the part count
BACKWARD_SECONDS_PER_VALUE = 1e-9  # the backward reads two rows and makes two passes


@njit(inline="always", cache=True)
def _rms(x: Any, g: Any, o: Any, eps: Any, inv_n: Any, one: Any) -> bool:
    return rms_row(x, o, eps, inv_n, one)


@njit(inline="always", cache=True)
def _rms_redo(x: Any, g: Any, o: Any, eps: Any, inv_n: Any, one: Any) -> bool:
    rms_row_rescaled(x, o, eps, inv_n, one)
    return True


@njit(inline="always", cache=True)
def _rms_bwd(x: Any, g: Any, o: Any, eps: Any, inv_n: Any, one: Any) -> bool:
    return rms_bwd_row(x, g, o, eps, inv_n, one, True)


@njit(inline="always", cache=True)
def _rms_bwd_redo(x: Any, g: Any, o: Any, eps: Any, inv_n: Any, one: Any) -> bool:
    rms_bwd_row_rescaled(x, g, o, eps, inv_n, one)
    return True


@pool.task(error_model="numpy")
def _rms_f32_part(part: int, parts: int, argv: int) -> None:
    native_rows(part, parts, argv, np.float32, _rms, _rms_redo)


@pool.task(error_model="numpy")
def _rms_f64_part(part: int, parts: int, argv: int) -> None:
    native_rows(part, parts, argv, np.float64, _rms, _rms_redo)


@pool.task(error_model="numpy")
def _rms_bf16_part(part: int, parts: int, argv: int) -> None:
    bf16_rows(part, parts, argv, _rms, _rms_redo)


@pool.task(error_model="numpy")
def _rms_bwd_f32_part(part: int, parts: int, argv: int) -> None:
    native_rows(part, parts, argv, np.float32, _rms_bwd, _rms_bwd_redo)


@pool.task(error_model="numpy")
def _rms_bwd_f64_part(part: int, parts: int, argv: int) -> None:
    native_rows(part, parts, argv, np.float64, _rms_bwd, _rms_bwd_redo)


@pool.task(error_model="numpy")
def _rms_bwd_bf16_part(part: int, parts: int, argv: int) -> None:
    bf16_rows(part, parts, argv, _rms_bwd, _rms_bwd_redo)


_TASKS = {np.dtype(np.float32): _rms_f32_part, np.dtype(np.float64): _rms_f64_part, BF16: _rms_bf16_part}
_BACKWARD_TASKS = {np.dtype(np.float32): _rms_bwd_f32_part, np.dtype(np.float64): _rms_bwd_f64_part,
                   BF16: _rms_bwd_bf16_part}


def rms_norm_job(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> jobs.Jobs | None:
    """x and out of one dtype among f32, f64 and bf16, C-contiguous (None otherwise)."""
    return rows_job(_TASKS, inputs, out, params.eps, SECONDS_PER_VALUE)


def rms_norm_backward_job(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> jobs.Jobs | None:
    """x, g and out of one dtype among f32, f64 and bf16, C-contiguous (None otherwise)."""
    return rows_job(_BACKWARD_TASKS, inputs, out, params.eps, BACKWARD_SECONDS_PER_VALUE)


rms_norm_kernel = jobs.kernel(rms_norm_job)
rms_norm_backward_kernel = jobs.kernel(rms_norm_backward_job)

# (max_relative, max_absolute, measured) per dtype: |out - ref| <= max_relative·|ref| + max_absolute·S
# against float64, S = max|ref| over the row. Twice the worst error `python -m fuel.testing.measure
# RmsNormLastDim RmsNormLastDimBackward` found over seeds 0-59 of fuel.testing.reference.norms (huge rows
# included); the relative part is at least the output's unit roundoff. The half types compute in f32 and
# round once, so their absolute part is at least the f32 impl's. The forward's error is relative only
# (x times one rounded factor).
RMS_BOUNDS = {DType.F32: (4.6e-7, 0.0, 0.49), DType.F64: (1.2e-15, 0.0, 0.47),
              DType.BF16: (7.9e-3, 0.0, 0.49), DType.F16: (9.8e-4, 0.0, 0.50)}
RMS_BACKWARD_BOUNDS = {DType.F32: (1.5e-6, 8.1e-7, 0.50), DType.F64: (2.8e-15, 3.2e-15, 0.49),
                       DType.BF16: (7.9e-3, 8.1e-7, 0.49), DType.F16: (9.8e-4, 8.1e-7, 0.50)}


def register(registry: FusedKernelRegistry) -> None:
    rev = revision_of(native_rows, bf16_rows, rms_row, rms_bwd_row)
    forward, backward = norm_precision(RMS_BOUNDS), norm_precision(RMS_BACKWARD_BOUNDS)
    for dt in FLOAT_DTYPES:
        fwd = via_f32(rms_norm_kernel) if dt == DType.F16 else rms_norm_kernel
        bwd = via_f32(rms_norm_backward_kernel) if dt == DType.F16 else rms_norm_backward_kernel
        registry.register(BackendImpl(FusedOps.RMS_NORM_LAST_DIM, "cpu", fwd, (dt, dt), norm_cost(3),
                                      forward[dt], CONTIGUOUS_ONLY, rev))
        registry.register(BackendImpl(FusedOps.RMS_NORM_LAST_DIM_BACKWARD, "cpu", bwd, (dt, dt, dt),
                                      norm_cost(7), backward[dt], CONTIGUOUS_ONLY, rev))
