"""A bf16/f16 kernel from an f32 one for the pointwise backwards (reduce_max_to_backward, powi_backward):
inputs widened exactly, the f32 kernel into an f32 scratch, one nearest-even rounding on store."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from fuel.cpu.simd.half import narrow_into, widened
from fuel.runtime.buffers import POOL

Kernel = Callable[[list[np.ndarray], np.ndarray, Any], None]


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
