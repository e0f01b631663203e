"""RmsNorm over the last axis (entry 3) and its backward (entry 9): one task over rows per dtype.

The row functions, and how they survive rows whose squares overflow, are in norm_rows; the tasks (f32
and f64 in place, bf16 through f32 scratch rows rounded once), shared by the four norms, in norm_tasks.
A row is computed by one thread in a fixed order, so the bytes are the same for any thread count and on
every path (eager, native replay). f16 runs the f32 kernel on a widened copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fuel.cpu.norms.norm_tasks import NORM_TASKS, RMS, RMS_BACKWARD, register_norm
from fuel.cpu.norms.row_tasks import rows_job
from fuel.dispatch.impls import FusedKernelRegistry
from fuel.dtype import DType
from fuel.graph.registry import FusedOps
from fuel.runtime import jobs

SECONDS_PER_VALUE = 0.5e-9  # one core's time a value of the forward, for the part count
BACKWARD_SECONDS_PER_VALUE = 1e-9  # the backward reads two rows and makes two passes


def rms_norm_job(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> jobs.Jobs | None:
    """x and out of one dtype among f32, f64 and bf16, rows laid out as `rows_job` reads them (None otherwise)."""
    return rows_job(NORM_TASKS, inputs, out, params.eps, SECONDS_PER_VALUE, RMS)


def rms_norm_backward_job(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> jobs.Jobs | None:
    """x, g and out of one dtype among f32, f64 and bf16, rows laid out as `rows_job` reads them (None otherwise)."""
    return rows_job(NORM_TASKS, inputs, out, params.eps, BACKWARD_SECONDS_PER_VALUE, RMS_BACKWARD)


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
    register_norm(registry, (FusedOps.RMS_NORM_LAST_DIM, FusedOps.RMS_NORM_LAST_DIM_BACKWARD),
                  (rms_norm_kernel, rms_norm_backward_kernel),
                  (3, 7), (RMS_BOUNDS, RMS_BACKWARD_BOUNDS))
