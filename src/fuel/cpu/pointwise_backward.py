"""ReduceMaxToBackward (entry 10) and PowIBackward (entry 15): Numba, parallel over independent groups.

ReduceMaxToBackward sees x as [A, R, C] (a view, no copy) whenever the reduced axes of size > 1 form
one run: group (a, c) is x[a, :, c]. C = 1 (softmax's max over the last axes) is a row kernel, one
thread per row; C > 1 (e.g. a bias-like max over leading axes) walks R rows of a column block, so every
load is contiguous. Any other target transposes the reduced axes last (a NumPy copy) and uses the row
kernel. One pass finds each group's max, tie count and NaN count; a second writes g/ties. The max and
the counts are exact and g/ties is one correctly rounded division, so the bytes do not depend on the
threads. The division runs in f64 and is rounded once to the output (f32: 53 >= 2·24 + 2 bits, so this
is the correctly rounded f32 quotient); the half types widen exactly to f32, whose correctly rounded
quotient rounds once more to the half correctly for the same reason.

PowIBackward computes (exp · x^(exp−1)) · g per element in the working type (f32 for the half types
and f32, f64 for f64): x^(exp−1) by repeated squaring in the order of the POWI primitive's kernel, so
f32 and f64 give the very bytes of the primitive graph. exp = 0 writes zeros.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from numba import prange

from fuel.cpu.simd.driver import chunk_bounds, chunk_count, row_kernel
from fuel.cpu.simd.half import narrow_into, widened
from fuel.cpu.simd.vecmath import cast_like, neg_inf_like
from fuel.dispatch.impls import (
    CONTIGUOUS_ONLY,
    BackendImpl,
    FusedKernelRegistry,
    PrecisionGuarantee,
    elementwise_cost,
    revision_of,
)
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.registry import FusedOps
from fuel.graph.shapes import reduce_to_axes
from fuel.runtime.buffers import POOL

Kernel = Callable[[list[np.ndarray], np.ndarray, Any], None]
COLUMN_BLOCK = 256  # columns per task of the column kernel: 3 small scratch arrays, independent tasks


@row_kernel()
def _max_share_rows(x: Any, g: Any, out: Any) -> None:
    """x, out [A, R], g [A]: row a is one group."""
    rows, n = x.shape
    for a in prange(rows):
        row = x[a]
        m = neg_inf_like(row[0])
        ties = 0
        nans = 0
        for j in range(n):
            v = row[j]
            if v > m:
                m = v
                ties = 1
            elif v == m:
                ties += 1
            elif v != v:
                nans += 1
        # g / count in f64, rounded once into the array's type; 0·share keeps NaN for a non-finite g.
        share = cast_like(g[a] / (nans if nans else ties), m)
        zero = share * cast_like(0, m)
        o = out[a]
        if nans:
            for j in range(n):
                o[j] = share if row[j] != row[j] else zero
        else:
            for j in range(n):
                o[j] = share if row[j] == m else zero


@row_kernel()
def _max_share_columns(x: Any, g: Any, out: Any, block: int) -> None:
    """x, out [A, R, C], g [A, C]: group (a, c) is x[a, :, c]; one task per (a, block of columns)."""
    outer, n, cols = x.shape
    blocks = (cols + block - 1) // block
    for t in prange(outer * blocks):
        a = t // blocks
        c0 = (t % blocks) * block
        w = min(cols, c0 + block) - c0
        m = np.empty(w, x.dtype)
        ties = np.zeros(w, np.int64)
        nans = np.zeros(w, np.int64)
        m[:] = neg_inf_like(x[a, 0, c0])
        for r in range(n):
            xr = x[a, r, c0:c0 + w]
            for k in range(w):
                v = xr[k]
                if v > m[k]:
                    m[k] = v
                    ties[k] = 1
                elif v == m[k]:
                    ties[k] += 1
                elif v != v:
                    nans[k] += 1
        share = np.empty(w, x.dtype)
        for k in range(w):
            share[k] = g[a, c0 + k] / (nans[k] if nans[k] else ties[k])
        for r in range(n):
            xr = x[a, r, c0:c0 + w]
            o = out[a, r, c0:c0 + w]
            for k in range(w):
                v = xr[k]
                hit = v != v if nans[k] else v == m[k]
                s = share[k]
                o[k] = s if hit else s * cast_like(0, s)


def max_share_layout(x_shape: tuple[int, ...], g_shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """(A, R, C) when x reshapes to [A, R, C] with exactly the groups' elements along R (the reduced
    axes of size > 1 are one run), else None. Size-1 axes never matter for the layout."""
    reduced = set(reduce_to_axes("reduce_max_to_backward", x_shape, g_shape))
    big = [(d, i in reduced) for i, d in enumerate(x_shape) if d != 1]
    flags = [r for _, r in big]
    if True not in flags:
        return math.prod(x_shape), 1, 1
    first = flags.index(True)
    last = len(flags) - 1 - flags[::-1].index(True)
    if not all(flags[first:last + 1]):
        return None
    dims = [d for d, _ in big]
    return math.prod(dims[:first]), math.prod(dims[first:last + 1]), math.prod(dims[last + 1:])


def reduce_max_to_backward_native(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
    """f32 or f64 (the arrays' own type); contiguous inputs and output."""
    x, g = inputs
    if out.size == 0:
        return
    layout = max_share_layout(x.shape, g.shape)
    if layout is not None:
        a, r, c = layout
        if c == 1:
            _max_share_rows(x.reshape(a, r), g.reshape(a), out.reshape(a, r))
        else:
            _max_share_columns(x.reshape(a, r, c), g.reshape(a, c), out.reshape(a, r, c), COLUMN_BLOCK)
        return
    # Reduced axes apart from each other: gather them last (kept axes keep their order, so g's flat
    # order is the groups' order), run the row kernel, and scatter back.
    reduced = reduce_to_axes("reduce_max_to_backward", x.shape, g.shape)
    perm = [i for i in range(x.ndim) if i not in reduced] + list(reduced)
    xt = np.ascontiguousarray(x.transpose(perm))
    n = math.prod(x.shape[i] for i in reduced)
    tmp = POOL.empty(xt.shape, out.dtype)
    _max_share_rows(xt.reshape(-1, n), g.reshape(-1), tmp.reshape(-1, n))
    out[...] = tmp.transpose(np.argsort(perm))


@row_kernel()
def _powi_backward(x: Any, g: Any, out: Any, exp: int) -> None:
    """out = (exp · x^(exp−1)) · g over flat arrays of the work type, in chunks of elements."""
    n = x.shape[0]
    p0 = abs(exp - 1)
    chunks = chunk_count(n)
    for c in prange(chunks):
        lo, hi = chunk_bounds(c, n, chunks)
        for i in range(lo, hi):
            a = x[i]
            coef = cast_like(exp, a)
            r = cast_like(1, a)
            p = p0
            while True:  # the order of compiler-builtins __powi, as the POWI primitive's kernel
                if p & 1:
                    r = r * a
                p >>= 1
                if p == 0:
                    break
                a = a * a
            if exp < 1:  # a negative power exp − 1
                r = cast_like(1, a) / r
            out[i] = (r * coef) * g[i]


def powi_backward_native(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
    """f32 or f64 (the arrays' own type); contiguous inputs and output."""
    x, g = inputs
    if out.size == 0:
        return
    if params.exp == 0:  # 0 everywhere, even where x^-1 is inf or NaN
        out[...] = 0
        return
    _powi_backward(x.reshape(-1), g.reshape(-1), out.reshape(-1), params.exp)


def via_f32(kernel: Kernel) -> Kernel:
    """A bf16/f16 kernel from an f32 one: inputs widened exactly, one rounding on store."""

    def run(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
        if out.size == 0:
            return
        tmp = POOL.empty(out.shape, np.dtype(np.float32))
        kernel([widened(a) for a in inputs], tmp, params)
        narrow_into(tmp, out)

    run.__wrapped__ = kernel  # type: ignore[attr-defined]
    return run


# |out - ref| <= max_relative·|ref| + max_absolute·S against float64 (S = max|ref| over the row for
# entry 10, |exp·x^(exp−1)·g| per element for entry 15). Twice the worst error
# `python -m fuel.testing.measure ReduceMaxToBackward PowIBackward` found over seeds 0-59 (each at least
# the output's unit roundoff): entry 10 is one correctly rounded division per group (half an ulp);
# entry 15 rounds once per multiply (up to 2·log2|exp| + 3 roundings; f32 measured 2.5e-7, f64 5.7e-16).
REDUCE_MAX_PRECISION = {
    DType.F32: PrecisionGuarantee(True, None, 1.2e-7, None, "exact max and count; one f64 division rounded once"),
    DType.F64: PrecisionGuarantee(True, None, 2.3e-16, None, "exact max and count; one division"),
    DType.BF16: PrecisionGuarantee(True, None, 7.9e-3, None, "f32 compute, one RNE rounding on store"),
    DType.F16: PrecisionGuarantee(True, None, 9.8e-4, None, "f32 compute, one RNE rounding on store"),
}
POWI_PRECISION = {
    DType.F32: PrecisionGuarantee(True, None, 5.1e-7, None, "repeated squaring in f32, as the POWI primitive"),
    DType.F64: PrecisionGuarantee(True, None, 1.2e-15, None, "repeated squaring in f64, as the POWI primitive"),
    DType.BF16: PrecisionGuarantee(True, None, 7.9e-3, None, "f32 compute, one RNE rounding on store"),
    DType.F16: PrecisionGuarantee(True, None, 9.8e-4, None, "f32 compute, one RNE rounding on store"),
}


def register(registry: FusedKernelRegistry) -> None:
    rev = revision_of(_max_share_rows)
    reduce_max = {DType.F32: reduce_max_to_backward_native, DType.F64: reduce_max_to_backward_native,
                  DType.BF16: via_f32(reduce_max_to_backward_native), DType.F16: via_f32(reduce_max_to_backward_native)}
    powi = {DType.F32: powi_backward_native, DType.F64: powi_backward_native,
            DType.BF16: via_f32(powi_backward_native), DType.F16: via_f32(powi_backward_native)}
    for dt in FLOAT_DTYPES:
        # 2 flops per element of x (compare and count, then divide-and-select) and of the product.
        registry.register(BackendImpl(FusedOps.REDUCE_MAX_TO_BACKWARD, "cpu", reduce_max[dt], (dt, dt, dt),
                                      elementwise_cost(2), REDUCE_MAX_PRECISION[dt], CONTIGUOUS_ONLY, rev))
        registry.register(BackendImpl(FusedOps.POWI_BACKWARD, "cpu", powi[dt], (dt, dt, dt),
                                      elementwise_cost(2), POWI_PRECISION[dt], CONTIGUOUS_ONLY, rev))
