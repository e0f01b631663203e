"""The norms' tasks: RmsNorm (3), LayerNorm (4) and their backwards (9, 8), one task per dtype.

A norm job's record names its norm (`kind`); the task runs that norm's row function over its rows
through the row driver (row_tasks), with the norm's overflow fallback (norm_rows). The four norms share
a task so that each dtype's row loop is written once; a part runs one norm, chosen before its rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from numba import njit

from fuel.cpu.norms.norm_rows import (
    ln_bwd_row,
    ln_bwd_row_rescaled,
    ln_row,
    ln_row_rescaled,
    rms_bwd_row,
    rms_bwd_row_rescaled,
    rms_row,
    rms_row_rescaled,
)
from fuel.cpu.norms.row_tasks import BF16, ROW_ARGS, bf16_rows, native_rows, reads_rows
from fuel.cpu.simd.half import via_f32
from fuel.dispatch.impls import (
    BackendImpl,
    CostEstimate,
    CostFn,
    FusedKernelRegistry,
    KernelCaps,
    PrecisionGuarantee,
    revision_of,
)
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.node import Shape
from fuel.graph.registry import FusedOpId
from fuel.runtime import pool
from fuel.runtime.jobs import record_at

RMS, RMS_BACKWARD, LAYER, LAYER_BACKWARD = range(4)  # a norm job's `kind`


# ---- the rows in the row driver's signature (a forward ignores g) ------------------------------


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


# ---- tasks --------------------------------------------------------------------------------------


@njit(inline="always", cache=True)
def _norm(part: int, parts: int, argv: int, driver: Any, dt: Any) -> None:
    """The job's norm over its rows through `driver` (native_rows or bf16_rows)."""
    kind = record_at(argv, ROW_ARGS).kind
    if kind == RMS:
        driver(part, parts, argv, dt, _rms, _rms_redo)
    elif kind == RMS_BACKWARD:
        driver(part, parts, argv, dt, _rms_bwd, _rms_bwd_redo)
    elif kind == LAYER:
        driver(part, parts, argv, dt, _ln, _ln_redo)
    else:
        driver(part, parts, argv, dt, _ln_bwd, _ln_bwd_redo)


@pool.task(error_model="numpy")
def _norm_f32_part(part: int, parts: int, argv: int) -> None:
    _norm(part, parts, argv, native_rows, np.float32)


@pool.task(error_model="numpy")
def _norm_f64_part(part: int, parts: int, argv: int) -> None:
    _norm(part, parts, argv, native_rows, np.float64)


@pool.task(error_model="numpy")
def _norm_bf16_part(part: int, parts: int, argv: int) -> None:
    _norm(part, parts, argv, bf16_rows, np.uint16)


NORM_TASKS = {np.dtype(np.float32): _norm_f32_part, np.dtype(np.float64): _norm_f64_part, BF16: _norm_bf16_part}


def norm_cost(flops_per_element: int) -> CostFn:
    """k flops per element plus one rsqrt per row; every input and the output move once."""

    def cost(shapes: Sequence[Shape], dtypes: Sequence[DType], params: Any) -> CostEstimate:
        out = shapes[-1]
        n = int(np.prod(out))
        rows = n // out[-1] if out and out[-1] else 0
        moved = sum(int(np.prod(s)) * d.itemsize for s, d in zip(shapes, dtypes, strict=True))
        return CostEstimate(flops=flops_per_element * n + 4 * rows, bytes_moved=moved)

    return cost


_ACCUMULATION = {DType.F32: "f32 accumulation", DType.F64: "f64 accumulation",
                 DType.BF16: "f32 compute, one RNE store", DType.F16: "f32 compute, one RNE store"}


Bounds = Mapping[DType, tuple[float, float, float]]  # (max_relative, max_absolute, measured) by dtype


def norm_precision(bounds: Bounds) -> dict[DType, PrecisionGuarantee]:
    """A norm's guarantee per dtype from (max_relative, max_absolute, measured): `measured` is the worst
    error the contract check saw over seeds 0-199, as a fraction of the bound."""
    return {dt: PrecisionGuarantee(True, None, rel, abs_, f"{_ACCUMULATION[dt]}; worst measured error "
                                   f"{seen:.2f} of this bound (seeds 0-199)")
            for dt, (rel, abs_, seen) in bounds.items()}



Kernel = Callable[[list[np.ndarray], np.ndarray, Any], None]


def register_norm(registry: FusedKernelRegistry, ops: tuple[FusedOpId, FusedOpId], kernels: tuple[Kernel, Kernel],
                  flops: tuple[int, int], bounds: tuple[Bounds, Bounds]) -> None:
    """A norm's forward and backward (`ops`, `kernels`, flops an element, bounds) for every float dtype:
    f16 runs the f32 kernel on a widened copy. Inputs whose rows are evenly spaced are read in place
    (`row_tasks.row_step`)."""
    rev = revision_of(_norm)
    caps = KernelCaps(strided_input=True, reads=reads_rows)
    for op_id, kernel, k, bound, arity in zip(ops, kernels, flops, bounds, (1, 2), strict=True):
        precision = norm_precision(bound)
        for dt in FLOAT_DTYPES:
            registry.register(BackendImpl(op_id, "cpu", via_f32(kernel) if dt == DType.F16 else kernel,
                                          (dt,) * (arity + 1), norm_cost(k), precision[dt], caps, rev))
