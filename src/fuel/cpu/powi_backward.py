"""PowIBackward (entry 15): (exp · x^(exp−1)) · g per element, one task over the elements.

Computed in the working type (f32 for the half types and f32, f64 for f64): x^(exp−1) by repeated
squaring in the order of the POWI primitive's kernel, so f32 and f64 give the very bytes of the primitive
graph. exp = 0 writes zeros (even where x^-1 is inf or NaN). Each element is one fixed expression, so the
bytes do not depend on how the elements are split. The half types widen exactly and round once on store.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.half_via_f32 import register_binary
from fuel.cpu.simd.vecmath import cast_like
from fuel.dispatch.impls import FusedKernelRegistry, PrecisionGuarantee, revision_of
from fuel.graph.registry import FusedOps
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import ADDRESS, INT, record_at

SECONDS_PER_VALUE = 1e-9  # one core's time an element, for the part count
POWI_ARGS = jobs.record(x=ADDRESS, g=ADDRESS, out=ADDRESS, n=INT, exp=INT)


@njit(inline="always", cache=True)
def _powi_elements(part: int, parts: int, argv: int, dt: Any) -> None:
    """Elements [part·n/parts, (part+1)·n/parts) of flat x, g and out of type dt."""
    a = record_at(argv, POWI_ARGS)
    n, exp = a.n, a.exp
    x = carray(pointer(a.x, dt), (n,))
    g = carray(pointer(a.g, dt), (n,))
    out = carray(pointer(a.out, dt), (n,))
    lo, hi = part * n // parts, (part + 1) * n // parts
    if exp == 0:
        for i in range(lo, hi):
            out[i] = 0
        return
    p0 = abs(exp - 1)
    for i in range(lo, hi):
        v = x[i]
        coef = cast_like(exp, v)
        r = cast_like(1, v)
        p = p0
        while True:  # the order of compiler-builtins __powi, as the POWI primitive's kernel
            if p & 1:
                r = r * v
            p >>= 1
            if p == 0:
                break
            v = v * v
        if exp < 1:  # a negative power exp − 1
            r = cast_like(1, v) / r
        out[i] = (r * coef) * g[i]


@pool.task(error_model="numpy")
def _powi_f32_part(part: int, parts: int, argv: int) -> None:
    _powi_elements(part, parts, argv, np.float32)


@pool.task(error_model="numpy")
def _powi_f64_part(part: int, parts: int, argv: int) -> None:
    _powi_elements(part, parts, argv, np.float64)


_TASKS = {np.dtype(np.float32): _powi_f32_part, np.dtype(np.float64): _powi_f64_part}


@njit(cache=True)
def _fill(x: Any, g: Any, out: Any, exp: int, argv: Any) -> None:
    a = argv[0]
    a.x, a.g, a.out = x.ctypes.data, g.ctypes.data, out.ctypes.data
    a.n, a.exp = out.size, exp


def powi_backward_job(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> jobs.Jobs | None:
    """x, g and out of one size and one dtype, f32 or f64, C-contiguous (None otherwise)."""
    if not out.size:
        return ()
    task = _TASKS.get(out.dtype)
    if task is None or not isinstance(params.exp, int) or not all(
            a.dtype == out.dtype and a.size == out.size and a.flags.c_contiguous for a in (*inputs, out)):
        return None
    argv = jobs.argv_of(POWI_ARGS)
    _fill(inputs[0], inputs[1], out, params.exp, argv)
    return jobs.job(task, argv, out.size * SECONDS_PER_VALUE, out.size)


powi_backward_kernel = jobs.kernel(powi_backward_job)


# |out - ref| <= max_relative·|ref| against float64 (|exp·x^(exp−1)·g| per element). Twice the worst error
# `python -m fuel.testing.measure PowIBackward` found over seeds 0-59 (each at least the output's unit
# roundoff): one rounding per multiply (up to 2·log2|exp| + 3 roundings; f32 measured 2.5e-7, f64 5.7e-16).
POWI_F32 = PrecisionGuarantee(True, None, 5.1e-7, None, "repeated squaring in f32, as the POWI primitive")
POWI_F64 = PrecisionGuarantee(True, None, 1.2e-15, None, "repeated squaring in f64, as the POWI primitive")


def register(registry: FusedKernelRegistry) -> None:
    register_binary(registry, FusedOps.POWI_BACKWARD, powi_backward_kernel, POWI_F32, POWI_F64,
                    revision_of(_powi_elements))
