"""The half types of the pointwise backwards (reduce_max_to_backward, powi_backward): their f32 kernel on
inputs widened exactly, its result rounded once (nearest-even) into out; and how those entries register."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from fuel.cpu.simd.half import narrow_into, widened
from fuel.dispatch.impls import (
    CONTIGUOUS_ONLY,
    BackendImpl,
    FusedKernelRegistry,
    PrecisionGuarantee,
    elementwise_cost,
)
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.registry import FusedOpId
from fuel.runtime.buffers import POOL

Kernel = Callable[[list[np.ndarray], np.ndarray, Any], None]

# f32 compute rounded once: the output's unit roundoff, twice (as the entries' measured bounds).
HALF_PRECISION = {
    DType.BF16: PrecisionGuarantee(True, None, 7.9e-3, None, "f32 compute, one RNE rounding on store"),
    DType.F16: PrecisionGuarantee(True, None, 9.8e-4, None, "f32 compute, one RNE rounding on store"),
}


def rounded_via_f32(kernel: Kernel) -> Kernel:
    """`kernel` (f32) for half inputs and output: the result rounded once into out."""

    def run(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
        if out.size == 0:
            return
        tmp = POOL.empty(out.shape, np.dtype(np.float32))
        kernel([widened(a) for a in inputs], tmp, params)
        narrow_into(tmp, out)

    run.__wrapped__ = kernel  # type: ignore[attr-defined]
    return run


def register_binary(registry: FusedKernelRegistry, op_id: FusedOpId, kernel: Kernel, f32: PrecisionGuarantee,
                    f64: PrecisionGuarantee, revision: str) -> None:
    """`kernel` for (x, g) -> out of one dtype: as is for f32 and f64 (guarantees given), through
    `rounded_via_f32` for the halves; 2 flops an element, contiguous arrays."""
    precision = {DType.F32: f32, DType.F64: f64, **HALF_PRECISION}
    for dt in FLOAT_DTYPES:
        registry.register(BackendImpl(op_id, "cpu", rounded_via_f32(kernel) if dt.is_half else kernel, (dt, dt, dt),
                                      elementwise_cost(2), precision[dt], CONTIGUOUS_ONLY, revision))
