"""The ERF primitive's kernels: the error function, elementwise, in one vectorised pass.

NumPy has no erf, and BERT's exact GELU, x·(1 + erf(x/√2))/2, written without one is about twenty
elementwise passes (a polynomial for erfc, an exp, the products). Here:

- f32 (and bf16/f16, computed in f32 and rounded once on store): each value is widened to f64 and
  erf is a rational function x·P(x²)/Q(x²) on |x| <= 4, clamped to ±4 beyond (erf(4) rounds to 1 in
  f32, as every larger value does). P and Q were fitted for this module by iteratively re-weighted
  least squares on erf's relative error over Chebyshev points of [0, 4], with P(0) = 2/√π: the f64
  result is within 2.6e-9 relative of erf, so the f32 result is within 0.55 ulp (checked against torch's float64 erf
  on every seventh f32 bit pattern of [2^-30, 4]). Branch-free, so LLVM vectorises the loop.
- f64: libm's erf per element (`math.erf`), which the rational function is not accurate enough for.

NaN stays NaN, ±inf gives ±1, and −0 gives −0. One pass, a job whose parts hold at least `PIECE` values
each (docs/performance/runtime.md, "erf"); each value is computed alone, so the bytes never depend on the
cut.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import carray, njit

from fuel.errors import KernelError
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import ADDRESS, INT, record_at

P0 = 2 / math.sqrt(math.pi)  # erf'(0), fixed in the fit: small arguments get it exactly
P1, P2, P3 = 0.1853327427406865, 0.05435244858587421, 0.0038575623439003268
P4, P5, P6 = 0.00038053262549551047, 4.705003572865217e-06, -1.3311391345810908e-08
Q1, Q2, Q3 = 0.49758025273705486, 0.11402825585652378, 0.015480806037065852
Q4, Q5 = 0.0013104799999429306, 6.330848289552279e-05
CLAMP = 4.0
PIECE = 16384  # values a part of the pool's job at least holds


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


# `size` values of x into out, flat
ERF_ARGS = jobs.record(x=ADDRESS, out=ADDRESS, size=INT)


@njit(inline="always", cache=True)
def _erf_part(kernel: Any, part: int, parts: int, argv: int, dt: Any) -> None:
    a = record_at(argv, ERF_ARGS)
    size = a.size
    lo, hi = part * size // parts, (part + 1) * size // parts
    kernel(carray(pointer(a.x, dt), (size,))[lo:hi], carray(pointer(a.out, dt), (size,))[lo:hi])


@pool.task()
def _erf_f32_part(part: int, parts: int, argv: int) -> None:
    _erf_part(_erf_f32, part, parts, argv, np.float32)


@pool.task()
def _erf_f64_part(part: int, parts: int, argv: int) -> None:
    _erf_part(_erf_f64, part, parts, argv, np.float64)


# The dtypes erf has a kernel for: the task, which reads x and out as that type, and one core's time a
# value, for the part count.
KERNELS: dict[np.dtype[Any], tuple[pool.Task, float]] = {np.dtype(np.float32): (_erf_f32_part, 1.0e-9),
                                                         np.dtype(np.float64): (_erf_f64_part, 10e-9)}


def erf_into(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out <- erf(x) for f32 or f64 x (out: same shape and dtype, C-contiguous); returns out. Any other
    dtype is a KernelError: the task reads x and out by address as its type."""
    found = KERNELS.get(x.dtype)
    if found is None or out.dtype != x.dtype or out.shape != x.shape or not out.flags.c_contiguous:
        raise KernelError(f"erf: has a kernel for x and out both float32 or both float64 (out of x's shape, "
                          f"C-contiguous), got x {x.dtype} {list(x.shape)} and out {out.dtype} {list(out.shape)}")
    task, per_value = found
    flat = np.ascontiguousarray(x).reshape(-1)
    if flat.size:
        argv = jobs.argv_of(ERF_ARGS)
        argv[0] = (flat.ctypes.data, out.ctypes.data, flat.size)
        jobs.run(jobs.job(task, argv, flat.size * per_value, max(1, flat.size // PIECE)))
    return out
