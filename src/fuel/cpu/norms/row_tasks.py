"""The row machinery every last-axis row kernel shares: softmax, RmsNorm, LayerNorm and their backwards.

A kernel of this family sees its arrays as [rows, cols] (one or two inputs x and g of out's dtype, all
C-contiguous) and computes each row from that row alone, in a fixed order, so a part of the job is a range
of rows and the bytes do not depend on how the rows are split. Its row function has one signature,
`row(x, g, o, eps, inv_n, one) -> bool`, the scalars in the working type (f64 for f64, else f32); it returns
False when the row needs its fallback `redo(x, g, o, eps, inv_n, one)` (the norms' overflow path), which
then overwrites o. A one-input kernel gets x again as g.

- `native_rows` runs the row function on f32 or f64 rows in place;
- `bf16_rows` widens each bf16 row (and g's) exactly into f32 scratch, runs the f32 row function into an f32
  scratch row and rounds it once (nearest-even) into out. The scratch is fully rewritten for every row, so
  which rows share a part's scratch never shows in the bytes.
The job (`rows_job`) is what the eager kernel runs and native replay posts. Tasks compile with Numba's
numpy error model, so a division by zero is IEEE's ±inf or NaN (the default python model would swallow
the exception in the callback and leave 0).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.simd.half import bits, narrow_bf16_row, widen_bf16_row
from fuel.dtype import DType
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import ADDRESS, INT, REAL, record_at

# `kind` tells a task serving several kernels which one a job runs (norm_tasks)
ROW_ARGS = jobs.record(x=ADDRESS, g=ADDRESS, out=ADDRESS, rows=INT, cols=INT, inputs=INT, kind=INT, eps=REAL)
BF16 = DType.BF16.np


@njit(inline="always", cache=True)
def row_arrays(argv: int, dt: Any) -> tuple[Any, Any, Any, Any]:
    """(record, x, g, out) of a row job, the arrays [rows, cols] of type dt."""
    a = record_at(argv, ROW_ARGS)
    shape = (a.rows, a.cols)
    return a, carray(pointer(a.x, dt), shape), carray(pointer(a.g, dt), shape), carray(pointer(a.out, dt), shape)


@njit(inline="always", cache=True)
def native_rows(part: int, parts: int, argv: int, dt: Any, row: Any, redo: Any) -> None:
    """Rows [part·rows/parts, (part+1)·rows/parts) of f32 or f64 (dt) arrays, straight into out."""
    a, x, g, out = row_arrays(argv, dt)
    one = dt(1)
    eps = dt(a.eps)
    inv_n = one / dt(a.cols)
    for r in range(part * a.rows // parts, (part + 1) * a.rows // parts):
        if not row(x[r], g[r], out[r], eps, inv_n, one):
            redo(x[r], g[r], out[r], eps, inv_n, one)


@njit(inline="always", cache=True)
def bf16_rows(part: int, parts: int, argv: int, dt: Any, row: Any, redo: Any) -> None:
    """Rows of bf16 bits (dt is uint16): widened into f32 scratch, computed by the f32 row function,
    rounded once. (native_rows' signature, so that a task can take either.)"""
    a, x, g, out = row_arrays(argv, dt)
    n = a.cols
    one = np.float32(1)
    eps = np.float32(a.eps)
    inv_n = one / np.float32(n)
    wx = np.empty(n, np.uint32)
    wg = np.empty(n, np.uint32)
    res = np.empty(n, np.float32)
    fx = wx.view(np.float32)
    fg = wg.view(np.float32) if a.inputs == 2 else fx
    for r in range(part * a.rows // parts, (part + 1) * a.rows // parts):
        widen_bf16_row(x[r], wx)
        if a.inputs == 2:
            widen_bf16_row(g[r], wg)
        if not row(fx, fg, res, eps, inv_n, one):
            redo(fx, fg, res, eps, inv_n, one)
        narrow_bf16_row(res.view(np.uint32), out[r])


@njit(cache=True)
def _fill(x: Any, g: Any, out: Any, inputs: int, kind: int, eps: float, argv: Any) -> None:
    a = argv[0]
    a.x, a.g, a.out = x.ctypes.data, g.ctypes.data, out.ctypes.data
    a.cols = out.shape[-1] if out.ndim else 1
    a.rows = out.size // a.cols
    a.inputs, a.kind = inputs, kind
    a.eps = eps


def rows_job(tasks: Mapping[Any, pool.Task], inputs: Sequence[np.ndarray], out: np.ndarray, eps: float,
             seconds_per_value: float, kind: int = 0) -> jobs.Jobs | None:
    """The job of a row kernel: `tasks` by out's dtype, every input of out's shape and dtype, all
    C-contiguous (None otherwise: no task serves the call, and in native replay an eps still a DynScalar,
    which this record holds as a value); `()` for an empty out."""
    if not out.size:
        return ()
    if not isinstance(eps, numbers.Real):
        return None
    task = tasks.get(out.dtype)
    if task is None or not all(a.dtype == out.dtype and a.shape == out.shape and a.flags.c_contiguous
                               for a in (*inputs, out)):
        return None
    x, g, o = (bits(a) if out.dtype == BF16 else a for a in (inputs[0], inputs[-1], out))
    argv = jobs.argv_of(ROW_ARGS)
    _fill(x, g, o, len(inputs), kind, float(eps), argv)
    return jobs.job(task, argv, out.size * seconds_per_value, int(argv[0]["rows"]))
