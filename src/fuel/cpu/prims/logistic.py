"""The SIGMOID, SILU and TANH primitives' f32 kernels: one vectorised pass, never an overflowing exponential.

NumPy's spelling, x / (1 + e^-x), is four passes over the tensor (negate, exp, add, divide); this is one
(docs/performance/runtime.md, "logistic"). Each value v uses
e = e^-|v| in (0, 1] (the Cephes expf polynomial of `vecmath`, ~1 ulp), so nothing overflows:
- sigmoid(v) = 1 / (1 + e) for v >= 0 and e / (1 + e) below,
- silu(v) = v / (1 + e) for v >= 0 and (v·e) / (1 + e) below,
each within 3 ulp, measured against torch's float64 (the exponential's error, one product, one sum and
one quotient, each rounded once).
Below v = -87.33 e leaves the normal range: the exponential is kept as e·2^32 (exact) and scaled down
once at the end, so silu stays accurate while its result is normal (to v ≈ -92) and sigmoid's subnormal
results are rounded once.
Large tensors (a prefill's) are cut over the spinning pool's threads by rows, or a single row by
fixed chunks: each value is computed alone, so the split never changes a byte.
tanh(v) = sign(v)·(1 - e)/(1 + e) with e = e^-2|v| for |v| >= TANH_SERIES; below, an odd polynomial
|v| + |v|³·P(v²), P fitted for this module by re-weighted least squares on Chebyshev points of
[0, TANH_SERIES²] against mpmath (relative error 4e-9). All in f32, with FMAs; -0 stays -0 and tiny values are
exact. Within 1.5 ulp of torch's float64 tanh (tested on a sweep of f32 bit patterns), tanh(±inf) = ±1.
silu(+inf) = +inf, sigmoid(±inf) = 1 or 0, and silu(-inf) is NaN (-inf·0), as in NumPy's and torch's
spellings. The half types are widened to f32, computed here and rounded once; in f32 and the half types a
NaN gives that same NaN, bit for bit. f64 keeps NumPy's path, where a NaN stays a NaN but may come out
quieted or with its sign flipped (sigmoid of 0x7ff0000000000001 is 0xfff8000000000001). The same input
bytes always give the same output bytes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.simd.vecmath import EXP_LOW, expf_nonpositive, expf_parts, pow2_f32
from fuel.errors import KernelError
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import ADDRESS, INT, record_at

EXP_DEEP = np.float32(-103.9)  # e^t below this rounds to 0 in f32, and so do sigmoid and silu
_ONE, _ZERO = np.float32(1), np.float32(0)
_UP, _DOWN = np.float32(32), np.float32(2.0**-32)


@njit(inline="always", cache=True)
def _exp_and_scaled(t: Any) -> tuple[Any, Any]:
    """(e^t rounded once, e^t·2^32) for float32 t <= 0: the second stays normal down to EXP_DEEP, where
    the first is already subnormal; both 0 below EXP_DEEP, NaN for NaN."""
    p, fx = expf_parts(EXP_DEEP if t < EXP_DEEP else t)
    big = p * pow2_f32(fx + _UP)
    big = _ZERO if t < EXP_DEEP else big
    return big * _DOWN, big


# A NaN input is returned as it is: computed, it would be v·e with e NaN too, and x86 returns the NaN of
# whichever operand LLVM placed first, which differs between this kernel's compiled copies (the eager call's
# and the native replay's task), so the same input bytes would give NaNs of either sign.
# Rows by slices: indexing x[r * stride + c] directly keeps LLVM from vectorising (a possibly negative
# index gets a wraparound test; docs/performance/runtime.md, "logistic").
@njit(cache=True, error_model="numpy")
def _silu_f32(x: Any, rows: int, cols: int, stride: int, out: Any) -> None:
    for r in range(rows):
        xr, orow = x[r * stride:r * stride + cols], out[r * cols:(r + 1) * cols]
        for c in range(cols):
            v = xr[c]
            t = -abs(v)
            e, big = _exp_and_scaled(t)
            # past EXP_LOW, 1 + e rounds to 1 and v·e is taken from the unrounded e·2^32
            neg = (v * big) * _DOWN if t < EXP_LOW else (v * e) / (_ONE + e)
            value = v / (_ONE + e) if v >= 0 else neg
            orow[c] = v if v != v else value


@njit(cache=True, error_model="numpy")
def _sigmoid_f32(x: Any, rows: int, cols: int, stride: int, out: Any) -> None:
    for r in range(rows):
        xr, orow = x[r * stride:r * stride + cols], out[r * cols:(r + 1) * cols]
        for c in range(cols):
            v = xr[c]
            e, _ = _exp_and_scaled(-abs(v))
            value = _ONE / (_ONE + e) if v >= 0 else e / (_ONE + e)
            orow[c] = v if v != v else value


TANH_SERIES = np.float32(0.625)  # below this |v| tanh takes the polynomial; above, the exponential's form
_T1, _T2, _T3 = np.float32(-0.3333328366279602), np.float32(0.13331490755081177), np.float32(-0.05374348536133766)
_T4, _T5 = np.float32(0.020650554448366165), np.float32(-0.005717011168599129)


@njit(cache=True, error_model="numpy", fastmath={"contract"})
def _tanh_f32(x: Any, rows: int, cols: int, stride: int, out: Any) -> None:
    for r in range(rows):
        xr, orow = x[r * stride:r * stride + cols], out[r * cols:(r + 1) * cols]
        for c in range(cols):
            v = xr[c]
            a = abs(v)
            z = a * a
            series = a + a * z * ((((_T5 * z + _T4) * z + _T3) * z + _T2) * z + _T1)
            e = expf_nonpositive(np.float32(-2) * a)
            value = series if a < TANH_SERIES else (_ONE - e) / (_ONE + e)
            orow[c] = v if v != v else np.float32(math.copysign(value, v))


def _one_row(x: np.ndarray) -> tuple[np.ndarray, int, int, int]:
    flat = np.ascontiguousarray(x).reshape(-1)
    return flat, 1, flat.size, flat.size


def rows_of(x: np.ndarray) -> tuple[np.ndarray, int, int, int]:
    """x as (flat, rows, cols, row stride): itself flattened when contiguous; a 1-D view from its first
    element over whole rows of unit stride that are not adjacent (a stacked projection's half, whose copy
    would cost more than the kernel: docs/performance/runtime.md, "logistic"); else one row of a contiguous
    copy."""
    if x.flags.c_contiguous or x.size == 0 or x.ndim == 0:
        return _one_row(x)
    v = x.view()
    try:
        v.shape = (-1, x.shape[-1])  # raises where the leading axes do not merge into one stride
    except AttributeError:
        return _one_row(x)
    (rows, cols), (rs, cs) = v.shape, v.strides
    if cs != x.itemsize or rs < 0 or rs % x.itemsize:
        return _one_row(x)
    stride = rs // x.itemsize
    flat = np.lib.stride_tricks.as_strided(v, shape=((rows - 1) * stride + cols,), strides=(x.itemsize,))
    return flat, rows, cols, stride


SECONDS_PER_VALUE = 0.7e-9  # one core's time a value, for the part count
COLUMN_PIECE = 4096  # values of a single row a part holds at least

# x as `rows_of` sees it (rows of `cols` values, `stride` apart), out [rows, cols] contiguous
LOGISTIC_ARGS = jobs.record(x=ADDRESS, out=ADDRESS, rows=INT, cols=INT, stride=INT)


@njit(inline="always", cache=True)
def _task_arrays(argv: int) -> tuple[Any, Any, int, int, int]:
    """(flat x, flat out, rows, cols, stride) of a `LOGISTIC_ARGS` record."""
    a = record_at(argv, LOGISTIC_ARGS)
    rows, cols, stride = a.rows, a.cols, a.stride
    x = carray(pointer(a.x, np.float32), ((rows - 1) * stride + cols,))
    return x, carray(pointer(a.out, np.float32), (rows * cols,)), rows, cols, stride


@njit(inline="always", cache=True)
def _part(kernel: Any, part: int, parts: int, argv: int) -> None:
    """Part `part` of `parts`: its rows where there are several (as many parts as rows at most), else
    its fixed slice of the one row."""
    x, out, rows, cols, stride = _task_arrays(argv)
    if rows > 1:
        r0, r1 = part * rows // parts, (part + 1) * rows // parts
        kernel(x[r0 * stride:], r1 - r0, cols, stride, out[r0 * cols:r1 * cols])
    else:
        c0, c1 = part * cols // parts, (part + 1) * cols // parts
        kernel(x[c0:c1], 1, c1 - c0, c1 - c0, out[c0:c1])


@pool.task()
def _silu_part(part: int, parts: int, argv: int) -> None:
    _part(_silu_f32, part, parts, argv)


_F32 = np.dtype(np.float32)  # the one dtype these kernels read and write


@pool.task()
def _sigmoid_part(part: int, parts: int, argv: int) -> None:
    _part(_sigmoid_f32, part, parts, argv)


@pool.task()
def _tanh_part(part: int, parts: int, argv: int) -> None:
    _part(_tanh_f32, part, parts, argv)


def logistic_job(task: pool.Task, flat: np.ndarray, rows: int, cols: int, stride: int, out: np.ndarray) -> jobs.Job:
    """The job of `task` (`_silu_part` or `_sigmoid_part`) over x as `rows_of` gives it, into out (f32, C-
    contiguous): rows a part where there are several, else fixed slices of the one row."""
    argv = jobs.argv_of(LOGISTIC_ARGS)
    argv[0] = (flat.ctypes.data, out.ctypes.data, rows, cols, stride)
    return jobs.job(task, argv, rows * cols * SECONDS_PER_VALUE, max(1, rows if rows > 1 else cols // COLUMN_PIECE))


def silu_job(flat: np.ndarray, rows: int, cols: int, stride: int, out: np.ndarray) -> jobs.Job:
    """`logistic_job` of silu (the native replay's form of a SILU step posts it)."""
    return logistic_job(_silu_part, flat, rows, cols, stride, out)


def tanh_job(flat: np.ndarray, rows: int, cols: int, stride: int, out: np.ndarray) -> jobs.Job:
    """`logistic_job` of tanh (the native replay's form of a TANH step posts it)."""
    return logistic_job(_tanh_part, flat, rows, cols, stride, out)


def _apply(x: np.ndarray, out: np.ndarray | None, task: pool.Task, op: str) -> np.ndarray:
    """The kernels and tasks read x and out by address as f32: any other dtype is a KernelError."""
    if out is None:
        out = np.empty(np.shape(x), np.float32)
    if not x.dtype == out.dtype == _F32 or out.shape != x.shape or not out.flags.c_contiguous:
        raise KernelError(f"{op}: has a kernel for x and out both float32 (out of x's shape, C-contiguous), got "
                          f"x {x.dtype} {list(x.shape)} and out {out.dtype} {list(out.shape)}")
    flat, rows, cols, stride = rows_of(x)
    if out.size:
        jobs.run(logistic_job(task, flat, rows, cols, stride, out))
    return out


def sigmoid_f32(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """sigmoid(x) of f32 x into `out` (f32, x's shape, C-contiguous, not overlapping x unless it is x)
    or a fresh array; returns it."""
    return _apply(x, out, _sigmoid_part, "sigmoid")


def silu_f32(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x·sigmoid(x) of f32 x, as `sigmoid_f32`."""
    return _apply(x, out, _silu_part, "silu")


def tanh_f32(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """tanh(x) of f32 x, as `sigmoid_f32`."""
    return _apply(x, out, _tanh_part, "tanh")


# ---- any dtype: the primitives' kernels (`fuel.cpu.prims.prims`) ----------------------------------------

def _one_plus_exp_neg(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """1 + e^-x in one buffer (`out`, or a fresh one). Sigmoid is 1 / this and SiLU x / this: e^-x
    overflows to inf for very negative x, which gives 0 as it should, and the relative error stays a few
    ulp everywhere. A two-branch form allocates five large temporaries, each page-faulted
    (docs/performance/runtime.md, "prims"). The fresh buffer is an array even for 0-d x (a ufunc returns a
    scalar)."""
    d = np.negative(x, out=np.empty(np.shape(x), x.dtype) if out is None else out)
    np.exp(d, out=d)
    return np.add(d, 1, out=d)


def sigmoid_any(x: np.ndarray) -> np.ndarray:
    """SIGMOID of any float dtype: the f32 kernel, else NumPy's spelling in one buffer."""
    if x.dtype == np.float32:
        return sigmoid_f32(x)
    d = _one_plus_exp_neg(x)
    return np.divide(1, d, out=d)


def silu_any(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """SILU of any float dtype into `out` (or a fresh array): the f32 kernel, else NumPy's spelling."""
    if x.dtype == np.float32 and (out is None or out.flags.c_contiguous):
        return silu_f32(x, out)
    d = _one_plus_exp_neg(x, out)
    return np.divide(x, d, out=d)


def tanh_any(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """TANH of any float dtype into `out` (or a fresh array): the f32 kernel, else NumPy's."""
    if x.dtype == np.float32 and (out is None or out.flags.c_contiguous):
        return tanh_f32(x, out)
    return np.tanh(x) if out is None else np.tanh(x, out=out)
