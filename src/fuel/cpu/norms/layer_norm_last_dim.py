"""LayerNorm over the last axis (entry 4) and its backward (entry 8): one task over rows per dtype.

The row functions, and how they survive rows whose squares overflow, are in norm_rows; the tasks (f32
and f64 in place, bf16 through f32 scratch rows rounded once), shared by the four norms, in norm_tasks.
A row is computed by one thread in a fixed order, so the bytes are the same for any thread count and on
every path (eager, native replay). f16 runs the f32 kernel on a widened copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fuel.cpu.norms.norm_tasks import LAYER, LAYER_BACKWARD, NORM_TASKS, register_norm
from fuel.cpu.norms.row_tasks import rows_job
from fuel.dispatch.impls import FusedKernelRegistry
from fuel.dtype import DType
from fuel.graph.registry import FusedOps
from fuel.runtime import jobs

SECONDS_PER_VALUE = 1e-9  # one core's time a value of the forward (three passes), for the part count
BACKWARD_SECONDS_PER_VALUE = 1e-9  # the backward reads two rows and makes two passes


def layer_norm_job(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> jobs.Jobs | None:
    """x and out of one dtype among f32, f64 and bf16, rows laid out as `rows_job` reads them (None otherwise)."""
    return rows_job(NORM_TASKS, inputs, out, params.eps, SECONDS_PER_VALUE, LAYER)


def layer_norm_backward_job(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> jobs.Jobs | None:
    """x, g and out of one dtype among f32, f64 and bf16, rows laid out as `rows_job` reads them (None otherwise)."""
    return rows_job(NORM_TASKS, inputs, out, params.eps, BACKWARD_SECONDS_PER_VALUE, LAYER_BACKWARD)


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
    register_norm(registry, (FusedOps.LAYER_NORM_LAST_DIM, FusedOps.LAYER_NORM_LAST_DIM_BACKWARD),
                  (layer_norm_kernel, layer_norm_backward_kernel),
                  (6, 12), (LN_BOUNDS, LN_BACKWARD_BOUNDS))
