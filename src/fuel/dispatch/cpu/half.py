"""Half-precision plumbing for Numba kernels: bf16 as uint16 bits, widened and rounded by hand.

Numba has no half arithmetic. bf16 widens exactly with a 16-bit shift and narrows with
round-to-nearest-even on the f32 bits (NaN stays NaN); f16 goes through NumPy's exact casts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numba import njit

from fuel.dispatch.buffers import POOL
from fuel.dispatch.cpu.vecmath import bf16_to_f32, f32_to_bf16
from fuel.dtype import DType


@njit(inline="always", cache=True)
def widen_bf16_row(src: Any, dst_bits: Any) -> None:
    """dst_bits (uint32) <- src (uint16 bf16 bits) << 16; view dst_bits as float32 to read it."""
    wide = dst_bits.view(np.float32)
    for j in range(src.shape[0]):
        wide[j] = bf16_to_f32(src[j])


@njit(inline="always", cache=True)
def narrow_bf16_row(src_bits: Any, dst: Any) -> None:
    """dst (uint16) <- round-to-nearest-even of src_bits (float32 bits as uint32); NaN stays a quiet NaN."""
    src = src_bits.view(np.float32)
    for j in range(src.shape[0]):
        dst[j] = f32_to_bf16(src[j])


def bits(a: np.ndarray) -> np.ndarray:
    """The uint16 bits of a bf16 array (no copy)."""
    return a.view(np.uint16)


def rows2d(a: np.ndarray) -> np.ndarray:
    """A contiguous array seen as [outer, last] (rank 0 and 1 included)."""
    if a.ndim == 2 and a.shape[1]:
        return a
    last = a.shape[-1] if a.ndim else 1
    return a.reshape(-1, last) if last else a.reshape(0, 0)


def via_f32(kernel: Callable[[list[np.ndarray], np.ndarray, Any], None]) -> Callable[..., None]:
    """Run an f32 kernel for f16 data: widen inputs exactly, compute in f32, round once into out."""

    def run(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
        wide = [a.astype(np.float32) if a.dtype == DType.F16.np else a for a in inputs]
        tmp = POOL.empty(out.shape, np.dtype(np.float32))
        kernel(wide, tmp, params)
        np.copyto(out, tmp, casting="unsafe")

    run.__wrapped__ = kernel  # type: ignore[attr-defined]
    return run
