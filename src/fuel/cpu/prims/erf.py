"""The ERF primitive's kernels: the error function, elementwise, in one vectorised pass.

NumPy has no erf, and BERT's exact GELU, x·(1 + erf(x/√2))/2, written without one took about twenty
elementwise passes (a polynomial for erfc, an exp, the products). Here:

- f32 (and bf16/f16, computed in f32 and rounded once on store): each value is widened to f64 and
  erf is a rational function x·P(x²)/Q(x²) on |x| <= 4, clamped to ±4 beyond (erf(4) rounds to 1 in
  f32, as every larger value does). P and Q were fitted for this module by iteratively re-weighted
  least squares on erf's relative error over Chebyshev points of [0, 4], with P(0) = 2/√π: the f64
  result is within 2.6e-9 relative of erf, so the f32 result is within 0.55 ulp (checked against torch's float64 erf
  on every seventh f32 bit pattern of [2^-30, 4]). Branch-free, so LLVM vectorises the loop.
- f64: libm's erf per element (`math.erf`), which the rational function is not accurate enough for.

NaN stays NaN, ±inf gives ±1, and −0 gives −0. One pass, cut into fixed pieces of `PIECE` values
that the spinning pool's threads share when the array is large (BERT's FFN: [768, 1536] values, about a
millisecond on one core); each value is computed alone, so the bytes never depend on the cut.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import carray, njit

from fuel.errors import KernelError
from fuel.runtime import pool
from fuel.runtime.atomics import pointer

P0 = 2 / math.sqrt(math.pi)  # erf'(0), fixed in the fit: small arguments get it exactly
P1, P2, P3 = 0.1853327427406865, 0.05435244858587421, 0.0038575623439003268
P4, P5, P6 = 0.00038053262549551047, 4.705003572865217e-06, -1.3311391345810908e-08
Q1, Q2, Q3 = 0.49758025273705486, 0.11402825585652378, 0.015480806037065852
Q4, Q5 = 0.0013104799999429306, 6.330848289552279e-05
CLAMP = 4.0
PIECE = 16384  # values a part of the pool's job at least holds
SECONDS_PER_VALUE = (1.0e-9, 10e-9)  # one core's time a value, f32 and f64, for the pool's part count


# IEEE division (no ZeroDivisionError check, which kept LLVM from vectorising the loop)
@njit(cache=True, fastmath={"contract"}, error_model="numpy")
def _erf_f32(x: Any, out: Any) -> None:
    for i in range(x.size):
        v = np.float64(x[i])
        c = CLAMP if v > CLAMP else (-CLAMP if v < -CLAMP else v)  # NaN compares false: it passes through
        t = c * c
        p = ((((((P6 * t + P5) * t + P4) * t + P3) * t + P2) * t + P1) * t + P0)
        q = (((((Q5 * t + Q4) * t + Q3) * t + Q2) * t + Q1) * t + 1.0)
        out[i] = np.float32(c * p / q)


@njit(cache=True)
def _erf_f64(x: Any, out: Any) -> None:
    for i in range(x.size):
        out[i] = math.erf(x[i])


# argv of `_erf_task`: the addresses of x and out, the value count and 1 for f64 (0 for f32)
X, OUT, SIZE, F64 = range(4)


@pool.task()
def _erf_task(part: int, parts: int, argv: int) -> None:
    v = carray(pointer(argv, np.int64), (4,))
    size = v[SIZE]
    lo, hi = part * size // parts, (part + 1) * size // parts
    if v[F64]:
        _erf_f64(carray(pointer(v[X], np.float64), (size,))[lo:hi], carray(pointer(v[OUT], np.float64), (size,))[lo:hi])
    else:
        _erf_f32(carray(pointer(v[X], np.float32), (size,))[lo:hi], carray(pointer(v[OUT], np.float32), (size,))[lo:hi])


# The dtypes erf has a kernel for: the serial kernel and the task's F64 flag, which picks the type the
# task reads x and out as.
KERNELS: dict[np.dtype[Any], tuple[Any, int]] = {np.dtype(np.float32): (_erf_f32, 0),
                                                 np.dtype(np.float64): (_erf_f64, 1)}


def erf_into(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out <- erf(x) for f32 or f64 x (out: same shape and dtype, C-contiguous); returns out. Any other
    dtype is a KernelError: the task reads x and out by address as its type."""
    found = KERNELS.get(x.dtype)
    if found is None or out.dtype != x.dtype or out.shape != x.shape or not out.flags.c_contiguous:
        raise KernelError(f"erf: has a kernel for x and out both float32 or both float64 (out of x's shape, "
                          f"C-contiguous), got x {x.dtype} {list(x.shape)} and out {out.dtype} {list(out.shape)}")
    kernel, f64 = found
    flat = np.ascontiguousarray(x).reshape(-1)
    seconds = flat.size * SECONDS_PER_VALUE[f64]
    parts = pool.parts_for(seconds, max(1, flat.size // PIECE))
    if parts <= 1:
        kernel(flat, out.reshape(-1))
        return out
    pool.run(_erf_task, np.array([flat.ctypes.data, out.ctypes.data, flat.size, f64], np.int64), parts)
    return out
