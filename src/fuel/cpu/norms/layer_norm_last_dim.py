"""LayerNorm over the last axis (entry 4) and its backward (entry 8): one task over rows per dtype.

The row functions, and how they survive rows whose squares overflow, are in norm_rows; the row tasks
(f32 and f64 in place, bf16 through f32 scratch rows rounded once) in row_tasks. A row is computed by
one thread in a fixed order, so the bytes are the same for any thread count and on every path (eager,
native replay). f16 runs the f32 kernel on a widened copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from fuel.cpu.norms.norm_rows import ln_bwd_row, ln_bwd_row_rescaled, ln_row, ln_row_rescaled
from fuel.cpu.norms.row_tasks import BF16, bf16_rows, native_rows, norm_cost, norm_precision, rows_job
from fuel.cpu.simd.half import via_f32
from fuel.dispatch.impls import CONTIGUOUS_ONLY, BackendImpl, FusedKernelRegistry, revision_of
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.registry import FusedOps
from fuel.runtime import jobs, pool

SECONDS_PER_VALUE = 1e-9  # one core's time a value of the forward (three passes), for the part count
BACKWARD_SECONDS_PER_VALUE = 1e-9  # the backward reads two rows and makes two passes


@njit(inline="always", cache=True)
def _ln(x: Any, g: Any, o: Any, eps: Any, inv_n: Any, one: Any) -> bool:
    return ln_row(x, o, eps, inv_n, one)


@njit(inline="always", cache=True)
def _ln_redo(x: Any, g: Any, o: Any, eps: Any, inv_n: Any, one: Any) -> bool:
    ln_row_rescaled(x, o, eps, inv_n, one)
    return True


@njit(inline="always", cache=True)
def _ln_bwd(x: Any, g: Any, o: Any, eps: Any, inv_n: Any, one: Any) -> bool:
    return ln_bwd_row(x, g, o, eps, inv_n, one, True)


@njit(inline="always", cache=True)
def _ln_bwd_redo(x: Any, g: Any, o: Any, eps: Any, inv_n: Any, one: Any) -> bool:
    ln_bwd_row_rescaled(x, g, o, eps, inv_n, one)
    return True


@pool.task(error_model="numpy")
def _ln_f32_part(part: int, parts: int, argv: int) -> None:
    native_rows(part, parts, argv, np.float32, _ln, _ln_redo)


@pool.task(error_model="numpy")
def _ln_f64_part(part: int, parts: int, argv: int) -> None:
    native_rows(part, parts, argv, np.float64, _ln, _ln_redo)


@pool.task(error_model="numpy")
def _ln_bf16_part(part: int, parts: int, argv: int) -> None:
    bf16_rows(part, parts, argv, _ln, _ln_redo)


@pool.task(error_model="numpy")
def _ln_bwd_f32_part(part: int, parts: int, argv: int) -> None:
    native_rows(part, parts, argv, np.float32, _ln_bwd, _ln_bwd_redo)


@pool.task(error_model="numpy")
def _ln_bwd_f64_part(part: int, parts: int, argv: int) -> None:
    native_rows(part, parts, argv, np.float64, _ln_bwd, _ln_bwd_redo)


@pool.task(error_model="numpy")
def _ln_bwd_bf16_part(part: int, parts: int, argv: int) -> None:
    bf16_rows(part, parts, argv, _ln_bwd, _ln_bwd_redo)


_TASKS = {np.dtype(np.float32): _ln_f32_part, np.dtype(np.float64): _ln_f64_part, BF16: _ln_bf16_part}
_BACKWARD_TASKS = {np.dtype(np.float32): _ln_bwd_f32_part, np.dtype(np.float64): _ln_bwd_f64_part,
                   BF16: _ln_bwd_bf16_part}


def layer_norm_job(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> jobs.Jobs | None:
    """x and out of one dtype among f32, f64 and bf16, C-contiguous (None otherwise)."""
    return rows_job(_TASKS, inputs, out, params.eps, SECONDS_PER_VALUE)


def layer_norm_backward_job(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> jobs.Jobs | None:
    """x, g and out of one dtype among f32, f64 and bf16, C-contiguous (None otherwise)."""
    return rows_job(_BACKWARD_TASKS, inputs, out, params.eps, BACKWARD_SECONDS_PER_VALUE)


layer_norm_kernel = jobs.kernel(layer_norm_job)
layer_norm_backward_kernel = jobs.kernel(layer_norm_backward_job)

# (max_relative, max_absolute, measured) per dtype: |out - ref| <= max_relative·|ref| + max_absolute·S
# against float64, S = max|ref| over the row. Twice the worst error `python -m fuel.testing.measure
# LayerNormLastDim LayerNormLastDimBackward` found over seeds 0-59 of fuel.testing.reference.norms (huge rows
# included); the relative part is at least the output's unit roundoff. The half types compute in f32 and
# round once, so their absolute part is at least the f32 impl's.
LN_BOUNDS = {DType.F32: (5.6e-7, 4.3e-8, 0.74), DType.F64: (3.1e-14, 1.6e-14, 0.48),
             DType.BF16: (7.9e-3, 5.4e-8, 0.53), DType.F16: (9.8e-4, 4.3e-8, 0.78)}
LN_BACKWARD_BOUNDS = {DType.F32: (8.4e-6, 1.1e-6, 0.53), DType.F64: (6.8e-15, 4.6e-15, 0.55),
                      DType.BF16: (7.9e-3, 1.1e-6, 0.49), DType.F16: (9.8e-4, 1.1e-6, 0.50)}


def register(registry: FusedKernelRegistry) -> None:
    rev = revision_of(native_rows, bf16_rows, ln_row, ln_bwd_row)
    forward, backward = norm_precision(LN_BOUNDS), norm_precision(LN_BACKWARD_BOUNDS)
    for dt in FLOAT_DTYPES:
        fwd = via_f32(layer_norm_kernel) if dt == DType.F16 else layer_norm_kernel
        bwd = via_f32(layer_norm_backward_kernel) if dt == DType.F16 else layer_norm_backward_kernel
        registry.register(BackendImpl(FusedOps.LAYER_NORM_LAST_DIM, "cpu", fwd, (dt, dt), norm_cost(6),
                                      forward[dt], CONTIGUOUS_ONLY, rev))
        registry.register(BackendImpl(FusedOps.LAYER_NORM_LAST_DIM_BACKWARD, "cpu", bwd, (dt, dt, dt),
                                      norm_cost(12), backward[dt], CONTIGUOUS_ONLY, rev))
