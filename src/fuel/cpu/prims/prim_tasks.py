"""Primitive steps as tasks of the spinning pool, for the native replay (`fuel.runtime.replay`).

Each builder returns the step's `Job` where its task computes the bytes the primitive's NumPy kernel
does, else None (the step stays in Python):
- ADD, SUB, MUL, DIV of f32 operands, and ADD_SCALAR and MUL_SCALAR (the scalar rounded to f32, as NumPy
  takes it): one IEEE operation per element. Each operand is read as `[rows, cols]` with a row stride of
  cols, 1 or 0 and a column stride of 1 or 0 (a whole operand, a row vector broadcast down the rows, a
  column broadcast along them, or one value), which covers a norm's weight, a residual and a scalar.
- SILU and TANH of f32: `logistic`'s own tasks.
- MATMUL of a few f32 rows with a weight: `gemv`'s job (two where its row ranges are the items).
- CACHE_WRITE: the rows copied into the cache at the offset, a DynScalar offset bound at each call.
- INDEX_COPY: `index_copy`'s check and write, the index read afresh at each call.
- INDEX_SELECT: `index_select`'s check and gather, likewise.
Elements are independent, so a job's split into parts never changes a byte.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.prims import gemv, index_copy, index_select, logistic
from fuel.graph.node import Op, OpSpec
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import ADDRESS, INT, Job, Jobs, job, record_at
from fuel.runtime.replay import dyn_name, prim_job

SECONDS_PER_VALUE = 0.4e-9  # one core, an f32 operation streamed from cache
ADD, SUB, MUL, DIV = range(4)
_CODES = {Op.ADD: ADD, Op.SUB: SUB, Op.MUL: MUL, Op.DIV: DIV, Op.ADD_SCALAR: ADD, Op.MUL_SCALAR: MUL}
# A binary job: out [rows, cols] <- a op b, each operand read with its row and column strides in elements
BINARY_ARGS = jobs.record(a=ADDRESS, a_row=INT, a_col=INT, b=ADDRESS, b_row=INT, b_col=INT, out=ADDRESS, rows=INT,
                          cols=INT)
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
    v = record_at(argv, BINARY_ARGS)
    ars, acs, brs, bcs, rows, cols = v.a_row, v.a_col, v.b_row, v.b_col, v.rows, v.cols
    a = carray(pointer(v.a, np.float32), ((rows - 1) * ars + (cols - 1) * acs + 1,))
    b = carray(pointer(v.b, np.float32), ((rows - 1) * brs + (cols - 1) * bcs + 1,))
    o = carray(pointer(v.out, np.float32), (rows * cols,))
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


def _binary(a: np.ndarray, b: np.ndarray, out: np.ndarray, code: int, own_b: bool) -> Job | None:
    """The job of out <- a op b, or None where its layout is not one the task reads; `own_b`: b is scratch
    the job keeps (a scalar operand's one value)."""
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
    argv = jobs.argv_of(BINARY_ARGS)
    argv[0] = (a.ctypes.data, *sa, b.ctypes.data, *sb, out.ctypes.data, rows, cols)
    return job(_TASKS[code], argv, out.size * SECONDS_PER_VALUE, rows, keep=(b,) if own_b else ())


@prim_job(Op.ADD, Op.SUB, Op.MUL, Op.DIV)
def binary_form(xs: list[np.ndarray], spec: OpSpec, out: np.ndarray, arg: Any) -> Job | None:
    return _binary(xs[0], xs[1], out, _CODES[spec.op], False)


@prim_job(Op.ADD_SCALAR, Op.MUL_SCALAR)
def scalar_form(xs: list[np.ndarray], spec: OpSpec, out: np.ndarray, arg: Any) -> Job | None:
    x = xs[0]
    if x.dtype != F32:
        return None
    one = np.full((1,) * x.ndim, arg, F32)  # the scalar rounded to f32, as NumPy takes it, kept by the job
    return _binary(x, one, out, _CODES[spec.op], True)


@prim_job(Op.SILU, Op.TANH)
def logistic_form(xs: list[np.ndarray], spec: OpSpec, out: np.ndarray, arg: Any) -> Job | None:
    x = xs[0]
    if x.dtype != F32 or out.dtype != F32 or not out.flags.c_contiguous or np.may_share_memory(x, out):
        return None
    flat, rows, cols, stride = logistic.rows_of(x)
    if flat.ctypes.data != x.ctypes.data or x.size == 0:  # a contiguous copy: not x's own memory
        return None
    make = logistic.silu_job if spec.op is Op.SILU else logistic.tanh_job
    return make(flat, rows, cols, stride, out)


@prim_job(Op.MATMUL)
def matmul_form(xs: list[np.ndarray], spec: OpSpec, out: np.ndarray, arg: Any) -> Jobs | None:
    """An f32 product of a few rows with a 2-D weight, which the MATMUL kernel runs as `gemv`: its job."""
    a, b = xs
    if b.ndim > 2 and all(s == 0 for s in b.strides[:-2]):
        b = b[(0,) * (b.ndim - 2)]  # a weight broadcast over the batch, as the kernel takes it
    if (a.dtype != F32 or b.dtype != F32 or out.dtype != F32 or b.ndim != 2 or a.ndim < 2 or a.size == 0
            or b.size == 0 or not (a.flags.c_contiguous and b.flags.c_contiguous and out.flags.c_contiguous)):
        return None
    rows = math.prod(a.shape[:-1])
    if rows > gemv.GEMV_MAX_ROWS:
        return None
    return gemv.gemv_job(a.reshape(rows, a.shape[-1]), b, out.reshape(rows, b.shape[1]), "matmul")


# ---- CACHE_WRITE ------------------------------------------------------------------------------------
# The rows' `outer` blocks (each `rows_block` bytes) copied into the cache's (each `cache_block` bytes) at
# position `offset` (`position` bytes a position)
CACHE_WRITE_ARGS = jobs.record(cache=ADDRESS, rows=ADDRESS, outer=INT, cache_block=INT, rows_block=INT,
                               position=INT, offset=INT)


@pool.task()
def _cache_write(part: int, parts: int, argv: int) -> None:
    v = record_at(argv, CACHE_WRITE_ARGS)
    outer, cb, rb, pb, off = v.outer, v.cache_block, v.rows_block, v.position, v.offset
    cache = carray(pointer(v.cache, np.uint8), (outer * cb,))
    rows = carray(pointer(v.rows, np.uint8), (outer * rb,))
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
    outer = math.prod(cache.shape[:ax])
    name = dyn_name(arg.offset)
    argv = jobs.argv_of(CACHE_WRITE_ARGS)
    argv[0] = (cache.ctypes.data, rows.ctypes.data, outer, cap * per, count * per, per,
               0 if name is not None else int(arg.offset))
    return job(_cache_write, argv, rows.nbytes * SECONDS_PER_VALUE / 4, outer,
               dyn=((jobs.word(CACHE_WRITE_ARGS, "offset"), name, 0, cap - count),) if name else ())


@prim_job(Op.INDEX_COPY)
def index_copy_form(xs: list[np.ndarray], spec: OpSpec, out: np.ndarray, arg: Any) -> tuple[Job, Job] | None:
    target, index, rows = xs
    if out is not target or not target.flags.writeable:
        return None
    return index_copy.index_copy_jobs(target, index, rows)


@prim_job(Op.INDEX_SELECT)
def index_select_form(xs: list[np.ndarray], spec: OpSpec, out: np.ndarray, arg: Any) -> tuple[Job, Job] | None:
    return index_select.index_select_jobs(xs[0], xs[1], out, arg)
