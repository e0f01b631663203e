"""Primitive steps as tasks of the spinning pool, for the native replay (`fuel.runtime.replay`).

Each builder returns the step's `Job` where its task computes the bytes the primitive's NumPy kernel
does, else None (the step stays in Python):
- ADD, SUB, MUL, DIV of f32 operands, and ADD_SCALAR and MUL_SCALAR (the scalar rounded to f32, as NumPy
  takes it): one IEEE operation per element. Each operand is read as `[rows, cols]` with a row stride of
  cols, 1 or 0 and a column stride of 1 or 0 (a whole operand, a row vector broadcast down the rows, a
  column broadcast along them, or one value), which covers a norm's weight, a residual and a scalar.
- SILU of f32: `logistic`'s own task.
- MATMUL of a few f32 rows with a weight: `gemv`'s partial sums, then their sum, as two jobs.
- CACHE_WRITE: the rows copied into the cache at the offset, a DynScalar offset bound at each call.
Elements are independent, so a job's split into parts never changes a byte.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.prims import gemv, logistic
from fuel.graph.node import Op, OpSpec
from fuel.runtime import pool
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import Job, job
from fuel.runtime.replay import dyn_name, prim_job

SECONDS_PER_VALUE = 0.4e-9  # one core, an f32 operation streamed from cache
ADD, SUB, MUL, DIV = range(4)
_CODES = {Op.ADD: ADD, Op.SUB: SUB, Op.MUL: MUL, Op.DIV: DIV, Op.ADD_SCALAR: ADD, Op.MUL_SCALAR: MUL}
# argv of a binary job: a, a's row and column strides, b, b's strides, out, rows, cols, then b's value when
# it is a scalar (b then points at that entry)
_ARGS = 10
_SCALAR = 9
F32 = np.dtype(np.float32)


@njit(inline="always", cache=True)
def _op(code: int, x: Any, y: Any) -> Any:
    if code == ADD:
        return x + y
    if code == SUB:
        return x - y
    if code == MUL:
        return x * y
    return x / y


@njit(inline="always", cache=True)
def _binary_part(code: int, part: int, parts: int, argv: int) -> None:
    v = carray(pointer(argv, np.int64), (_ARGS,))
    ars, acs, brs, bcs, rows, cols = v[1], v[2], v[4], v[5], v[7], v[8]
    a = carray(pointer(v[0], np.float32), ((rows - 1) * ars + (cols - 1) * acs + 1,))
    b = carray(pointer(v[3], np.float32), ((rows - 1) * brs + (cols - 1) * bcs + 1,))
    o = carray(pointer(v[6], np.float32), (rows * cols,))
    for r in range(part * rows // parts, (part + 1) * rows // parts):
        orow = o[r * cols:(r + 1) * cols]
        if acs and bcs:
            ar, br = a[r * ars:r * ars + cols], b[r * brs:r * brs + cols]
            for c in range(cols):
                orow[c] = _op(code, ar[c], br[c])
        elif acs:
            ar, y = a[r * ars:r * ars + cols], b[r * brs]
            for c in range(cols):
                orow[c] = _op(code, ar[c], y)
        elif bcs:
            x, br = a[r * ars], b[r * brs:r * brs + cols]
            for c in range(cols):
                orow[c] = _op(code, x, br[c])
        else:
            orow[:] = _op(code, a[r * ars], b[r * brs])


@pool.task(error_model="numpy")
def _add(part: int, parts: int, argv: int) -> None:
    _binary_part(ADD, part, parts, argv)


@pool.task(error_model="numpy")
def _sub(part: int, parts: int, argv: int) -> None:
    _binary_part(SUB, part, parts, argv)


@pool.task(error_model="numpy")
def _mul(part: int, parts: int, argv: int) -> None:
    _binary_part(MUL, part, parts, argv)


@pool.task(error_model="numpy")
def _div(part: int, parts: int, argv: int) -> None:
    _binary_part(DIV, part, parts, argv)


_TASKS = {ADD: _add, SUB: _sub, MUL: _mul, DIV: _div}


def _strides(x: np.ndarray, shape: tuple[int, ...], t: int) -> tuple[int, int] | None:
    """x broadcast to `shape` read as [rows, cols] split before axis t: its (row, column) strides in
    elements, each 0 or the span of what it steps over; None where its layout is neither."""
    st, e = np.broadcast_to(x, shape).strides, x.itemsize
    inner = [d for d in range(t, len(shape)) if shape[d] != 1]
    outer = [d for d in range(t) if shape[d] != 1]
    if all(st[d] == 0 for d in inner):
        cs, span = 0, 1
    else:
        expected = e
        for d in reversed(inner):
            if st[d] != expected:
                return None
            expected *= shape[d]
        cs, span = 1, math.prod(shape[t:])
    if all(st[d] == 0 for d in outer):
        return 0, cs
    expected = e * span
    for d in reversed(outer):
        if st[d] != expected:
            return None
        expected *= shape[d]
    return span, cs


def _binary(a: np.ndarray, b: np.ndarray, out: np.ndarray, code: int, scalar: float | None) -> Job | None:
    shape = out.shape
    if a.dtype != F32 or b.dtype != F32 or out.dtype != F32 or not out.flags.c_contiguous or out.size == 0:
        return None
    if np.may_share_memory(a, out) and not (a.ctypes.data == out.ctypes.data and a.strides == out.strides):
        return None
    if np.may_share_memory(b, out) and not (b.ctypes.data == out.ctypes.data and b.strides == out.strides):
        return None
    for t in (*range(len(shape) - 1, -1, -1), len(shape)):
        sa, sb = _strides(a, shape, t), _strides(b, shape, t)
        if sa is not None and sb is not None:
            break
    else:
        return None
    rows, cols = math.prod(shape[:t]), math.prod(shape[t:])
    argv = np.zeros(_ARGS, np.int64)
    argv[:9] = a.ctypes.data, *sa, b.ctypes.data, *sb, out.ctypes.data, rows, cols
    if scalar is not None:
        argv[_SCALAR:_SCALAR + 1].view(np.float32)[0] = scalar
        argv[3] = argv.ctypes.data + 8 * _SCALAR
    return job(_TASKS[code], argv, out.size * SECONDS_PER_VALUE, rows)


@prim_job(Op.ADD, Op.SUB, Op.MUL, Op.DIV)
def binary_form(xs: list[np.ndarray], spec: OpSpec, out: np.ndarray, arg: Any) -> Job | None:
    return _binary(xs[0], xs[1], out, _CODES[spec.op], None)


@prim_job(Op.ADD_SCALAR, Op.MUL_SCALAR)
def scalar_form(xs: list[np.ndarray], spec: OpSpec, out: np.ndarray, arg: Any) -> Job | None:
    x = xs[0]
    if x.dtype != F32:
        return None
    one = np.zeros((1,) * x.ndim, F32)  # b's layout (one value); the task reads the value from argv
    form = _binary(x, one, out, _CODES[spec.op], float(np.float32(arg)))
    return form


@prim_job(Op.SILU)
def silu_form(xs: list[np.ndarray], spec: OpSpec, out: np.ndarray, arg: Any) -> Job | None:
    x = xs[0]
    if x.dtype != F32 or out.dtype != F32 or not out.flags.c_contiguous or np.may_share_memory(x, out):
        return None
    flat, rows, cols, stride = logistic.rows_of(x)
    if flat.ctypes.data != x.ctypes.data or x.size == 0:  # a contiguous copy: not x's own memory
        return None
    argv = np.array([flat.ctypes.data, rows, cols, stride, out.ctypes.data], np.int64)
    return job(logistic.SILU_TASK, argv, rows * cols * logistic.SECONDS_PER_VALUE,
                max(1, rows if rows > 1 else cols // 4096))


@prim_job(Op.MATMUL)
def matmul_form(xs: list[np.ndarray], spec: OpSpec, out: np.ndarray, arg: Any) -> tuple[Job, Job] | None:
    """An f32 product of a few rows with a 2-D weight, which the MATMUL kernel runs as `gemv`: its two jobs."""
    a, b = xs
    if b.ndim > 2 and all(s == 0 for s in b.strides[:-2]):
        b = b[(0,) * (b.ndim - 2)]  # a weight broadcast over the batch, as the kernel takes it
    if (a.dtype != F32 or b.dtype != F32 or out.dtype != F32 or b.ndim != 2 or a.ndim < 2 or a.size == 0
            or b.size == 0 or not (a.flags.c_contiguous and b.flags.c_contiguous and out.flags.c_contiguous)):
        return None
    rows = math.prod(a.shape[:-1])
    if rows > gemv.GEMV_MAX_ROWS or b.nbytes > gemv.GEMV_MAX_BYTES:
        return None
    partials, total, scratch = gemv.f32_jobs(a.reshape(rows, a.shape[-1]), b, out.reshape(rows, b.shape[1]))
    return partials._replace(keep=(scratch,)), total


# ---- CACHE_WRITE ------------------------------------------------------------------------------------
_CW_ARGS = 7  # cache, rows, outer count, cache block bytes, rows block bytes, bytes per position, offset
_CW_OFFSET = 6


@pool.task()
def _cache_write(part: int, parts: int, argv: int) -> None:
    v = carray(pointer(argv, np.int64), (_CW_ARGS,))
    outer, cb, rb, pb, off = v[2], v[3], v[4], v[5], v[6]
    cache = carray(pointer(v[0], np.uint8), (outer * cb,))
    rows = carray(pointer(v[1], np.uint8), (outer * rb,))
    for o in range(part * outer // parts, (part + 1) * outer // parts):
        cache[o * cb + off * pb:o * cb + off * pb + rb] = rows[o * rb:(o + 1) * rb]


@prim_job(Op.CACHE_WRITE)
def cache_write_form(xs: list[np.ndarray], spec: OpSpec, out: np.ndarray, arg: Any) -> Job | None:
    cache, rows = xs
    if (out is not cache or not cache.flags.c_contiguous or not rows.flags.c_contiguous
            or np.may_share_memory(cache, rows) or rows.size == 0):
        return None
    ax = arg.axis
    cap, count = cache.shape[ax], rows.shape[ax]
    per = math.prod(cache.shape[ax + 1:]) * cache.itemsize
    argv = np.array([cache.ctypes.data, rows.ctypes.data, math.prod(cache.shape[:ax]), cap * per, count * per, per,
                     0], np.int64)
    name = dyn_name(arg.offset)
    if name is None:
        argv[_CW_OFFSET] = int(arg.offset)
    return job(_cache_write, argv, rows.nbytes * SECONDS_PER_VALUE / 4, int(argv[2]),
                dyn=((_CW_OFFSET, name, 0, cap - count),) if name else ())
