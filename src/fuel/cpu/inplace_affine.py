"""InplaceAffine (entry 16): x ← mul·x + add in x's own buffer, a task over the elements.

The executor hands the kernel `out = inputs[0]` (the destroyed input); every element is computed in
f64 and rounded once into x's type. f32 and f64 store `mul·x + add` evaluated in f64. The half types
widen exactly to an f32 scratch, take the f64 result rounded to f32 *to odd* (24 bits >= the half's
11 + 2, so the final nearest-even rounding to bf16/f16 is the correctly rounded f64 result, with no
double-rounding error), then round once into x. Elements are independent and each is computed by one
fixed expression, so the bytes do not depend on how the elements are split.

The impl accepts strided inputs, so the executor does not copy a non-contiguous x away from its
memory: a contiguous x is rewritten in place element by element, any other layout through a
contiguous scratch copied back into x. The kernel is more than its job (widening, a copy back), so it
runs the job itself; an in-place step is never replayed natively.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.simd.half import narrow_into, widened
from fuel.dispatch.impls import (
    BackendImpl,
    FusedKernelRegistry,
    KernelCaps,
    PrecisionGuarantee,
    elementwise_cost,
    revision_of,
)
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.registry import FusedOps
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import ADDRESS, INT, REAL, record_at

STRIDED = KernelCaps(strided_input=True)
SECONDS_PER_VALUE = 0.5e-9  # one core's time an element, for the part count
AFFINE_ARGS = jobs.record(x=ADDRESS, n=INT, mul=REAL, add=REAL)


@njit(inline="always", cache=True)
def _affine_native(part: int, parts: int, argv: int, dt: Any) -> None:
    """Elements of x (flat f32 or f64, dt) <- mul·x + add in f64, rounded once on store (no FMA
    contraction: the tasks compile without fastmath)."""
    a = record_at(argv, AFFINE_ARGS)
    n, mul, add = a.n, a.mul, a.add
    x = carray(pointer(a.x, dt), (n,))
    for i in range(part * n // parts, (part + 1) * n // parts):
        x[i] = mul * np.float64(x[i]) + add


@pool.task(error_model="numpy")
def _affine_f32_part(part: int, parts: int, argv: int) -> None:
    _affine_native(part, parts, argv, np.float32)


@pool.task(error_model="numpy")
def _affine_f64_part(part: int, parts: int, argv: int) -> None:
    _affine_native(part, parts, argv, np.float64)


@njit(cache=True)
def _f32_round_to_odd(d: float) -> Any:
    """d rounded to float32 toward zero, with the lowest bit set when inexact (round to odd)."""
    f = np.float32(d)  # nearest-even; when inexact, the odd one of f and its neighbour toward d is wanted
    if f == d or d != d:
        return f
    b = f.view(np.uint32)
    if b & 1:
        return f
    # Bit patterns of adjacent floats differ by one (sign-magnitude), so the neighbour is odd.
    if abs(f) > abs(d):
        return np.uint32(b - 1).view(np.float32)
    return np.uint32(b + 1).view(np.float32)


@pool.task(error_model="numpy")
def _affine_to_odd_part(part: int, parts: int, argv: int) -> None:
    """Elements of w (flat f32, a half array widened exactly) <- mul·w + add in f64, rounded to odd in f32."""
    a = record_at(argv, AFFINE_ARGS)
    n, mul, add = a.n, a.mul, a.add
    w = carray(pointer(a.x, np.float32), (n,))
    for i in range(part * n // parts, (part + 1) * n // parts):
        w[i] = _f32_round_to_odd(mul * np.float64(w[i]) + add)


def _run(task: pool.Task, flat: np.ndarray, mul: float, add: float) -> None:
    argv = jobs.argv_of(AFFINE_ARGS)
    row = argv[0]
    row["x"], row["n"], row["mul"], row["add"] = flat.ctypes.data, flat.size, mul, add
    jobs.run(jobs.job(task, argv, flat.size * SECONDS_PER_VALUE, flat.size))


def _in_place(x: np.ndarray, mul: float, add: float) -> None:
    """Rewrite x (any layout, writable) in place."""
    if x.dtype.itemsize >= 4:
        flat = x.reshape(-1) if x.flags.c_contiguous else np.ascontiguousarray(x).reshape(-1)
        _run(_affine_f64_part if x.dtype == np.float64 else _affine_f32_part, flat, mul, add)
    else:
        wide = widened(np.ascontiguousarray(x))
        flat = wide.reshape(-1)
        _run(_affine_to_odd_part, flat, mul, add)
        if x.flags.c_contiguous:
            narrow_into(wide, x)
            return
        narrow = np.empty(x.shape, x.dtype)
        narrow_into(wide, narrow)
        flat = narrow.reshape(-1)
    if not x.flags.c_contiguous:
        x[...] = flat.reshape(x.shape)


def inplace_affine(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
    """Every dtype: `out` is inputs[0] under the executor (copied in first when a caller passes another)."""
    if out is not inputs[0]:
        np.copyto(out, inputs[0])
    if out.size:
        _in_place(out, float(params.mul), float(params.add))


# |out - ref| <= max_relative·|ref| + max_absolute·S against a float64 reference computed in extended
# precision, S = |mul·x| + |add| per element (the terms before they cancel). Twice the worst error
# `python -m fuel.testing.measure InplaceAffine` found over seeds 0-59 (each at least the output's unit
# roundoff): f64 rounds mul·x and the sum (measured 2.2e-16·|ref| + 5.5e-17·S). f32 and the halves
# measured one rounding of |ref| only; their absolute part, 2.3e-16·S, is the f64 intermediate's own
# worst case (2 roundings of 2^-53), which only an almost exact cancellation can expose.
PRECISION = {
    DType.F32: PrecisionGuarantee(True, None, 1.2e-7, 2.3e-16, "f64 compute, one rounding on store"),
    DType.F64: PrecisionGuarantee(True, None, 4.5e-16, 1.2e-16, "f64 multiply then add (two roundings)"),
    DType.BF16: PrecisionGuarantee(True, None, 7.9e-3, 2.3e-16, "f64 compute, round-to-odd f32, one RNE rounding"),
    DType.F16: PrecisionGuarantee(True, None, 9.8e-4, 2.3e-16, "f64 compute, round-to-odd f32, one RNE rounding"),
}


def register(registry: FusedKernelRegistry) -> None:
    rev = revision_of(_affine_native)
    for dt in FLOAT_DTYPES:
        registry.register(BackendImpl(FusedOps.INPLACE_AFFINE, "cpu", inplace_affine, (dt, dt),
                                      elementwise_cost(2), PRECISION[dt], STRIDED, rev))
