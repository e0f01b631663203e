"""The row machinery every last-axis row kernel shares: softmax, RmsNorm, LayerNorm and their backwards.

A kernel of this family sees its arrays as [rows, cols] (one or two inputs x and g of out's dtype; out
C-contiguous; each input with a unit-stride last axis and rows at most three strides place: C-contiguous,
sliced, broadcast, its leading axes permuted, the record holding each input's `row_layout`) and computes
each row from that row alone, in a fixed order, so a part of the job is a range
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

# `kind` tells a task serving several kernels which one a job runs (norm_tasks); x_* and g_* are the
# inputs' `row_layout`s
ROW_ARGS = jobs.record(x=ADDRESS, g=ADDRESS, out=ADDRESS, rows=INT, cols=INT, inputs=INT, kind=INT, eps=REAL,
                       x_s0=INT, x_n1=INT, x_s1=INT, x_n2=INT, x_s2=INT,
                       g_s0=INT, g_n1=INT, g_s1=INT, g_n2=INT, g_s2=INT)
Layout = tuple[int, int, int, int, int]  # (s0, n1, s1, n2, s2): see row_layout
BF16 = DType.BF16.np


@njit(inline="always", cache=True)
def row_arrays(argv: int, dt: Any) -> tuple[Any, Any]:
    """(record, out) of a row job, out the array [rows, cols] of type dt."""
    a = record_at(argv, ROW_ARGS)
    return a, carray(pointer(a.out, dt), (a.rows, a.cols))


@njit(inline="always", cache=True)
def row_at(where: Any, r: int, cols: int, dt: Any) -> Any:
    """Row r of an input at `where` = (address, *its row_layout) as a contiguous [cols] array of type dt:
    the same type a row of a C-contiguous [rows, cols] array has, so a row function compiles the same.
    Rows of the innermost group (every row of a contiguous input) need no division. Callers read `where`
    out of the record once, before their row loop: the loop's stores may alias the record, so fields read
    inside it are loaded again at every row."""
    base, s0, n1, s1, n2, s2 = where
    if r < n2:
        return carray(pointer(base + r * s2, dt), (cols,))
    q = r // n2
    return carray(pointer(base + (q // n1) * s0 + (q % n1) * s1 + (r - q * n2) * s2, dt), (cols,))


@njit(inline="always", cache=True)
def _where(a: Any) -> tuple[Any, Any]:
    """`row_at`'s `where` of x and of g."""
    return ((a.x, a.x_s0, a.x_n1, a.x_s1, a.x_n2, a.x_s2), (a.g, a.g_s0, a.g_n1, a.g_s1, a.g_n2, a.g_s2))


@njit(inline="always", cache=True)
def native_rows(part: int, parts: int, argv: int, dt: Any, row: Any, redo: Any) -> None:
    """Rows [part·rows/parts, (part+1)·rows/parts) of f32 or f64 (dt) arrays, straight into out."""
    a, out = row_arrays(argv, dt)
    one = dt(1)
    eps = dt(a.eps)
    cols = a.cols
    inv_n = one / dt(cols)
    xw, gw = _where(a)
    for r in range(part * a.rows // parts, (part + 1) * a.rows // parts):
        x = row_at(xw, r, cols, dt)
        g = row_at(gw, r, cols, dt)
        if not row(x, g, out[r], eps, inv_n, one):
            redo(x, g, out[r], eps, inv_n, one)


@njit(inline="always", cache=True)
def bf16_rows(part: int, parts: int, argv: int, dt: Any, row: Any, redo: Any) -> None:
    """Rows of bf16 bits (dt is uint16): widened into f32 scratch, computed by the f32 row function,
    rounded once. (native_rows' signature, so that a task can take either.)"""
    a, out = row_arrays(argv, dt)
    n = a.cols
    one = np.float32(1)
    eps = np.float32(a.eps)
    inv_n = one / np.float32(n)
    two = a.inputs == 2
    xw, gw = _where(a)
    wx = np.empty(n, np.uint32)
    wg = np.empty(n, np.uint32)
    res = np.empty(n, np.float32)
    fx = wx.view(np.float32)
    fg = wg.view(np.float32) if two else fx
    for r in range(part * a.rows // parts, (part + 1) * a.rows // parts):
        widen_bf16_row(row_at(xw, r, n, dt), wx)
        if two:
            widen_bf16_row(row_at(gw, r, n, dt), wg)
        if not row(fx, fg, res, eps, inv_n, one):
            redo(fx, fg, res, eps, inv_n, one)
        narrow_bf16_row(res.view(np.uint32), out[r])


@njit(cache=True)
def _fill(x: int, g: int, out: Any, inputs: int, kind: int, eps: float, xl: Layout, gl: Layout,
          argv: Any) -> None:
    a = argv[0]
    a.x, a.g, a.out = x, g, out.ctypes.data
    a.cols = out.shape[-1] if out.ndim else 1
    a.rows = out.size // a.cols
    a.inputs, a.kind = inputs, kind
    a.eps = eps
    a.x_s0, a.x_n1, a.x_s1, a.x_n2, a.x_s2 = xl
    a.g_s0, a.g_n1, a.g_s1, a.g_n2, a.g_s2 = gl


def row_layout(a: np.ndarray) -> Layout | None:
    """Where the rows of `a` (seen as [rows, last]) lie, when they can be read in place: its last axis
    unit-stride and its leading axes collapsing into at most three evenly strided groups. Row r, split as
    (i0, i1, i2) over counts (·, n1, n2), starts i0·s0 + i1·s1 + i2·s2 bytes past `a`'s first element
    (steps of any sign, 0 for a broadcast axis). None otherwise: a transposed last axis, or four groups."""
    if a.ndim and a.shape[-1] > 1 and a.strides[-1] != a.itemsize:
        return None
    groups: list[list[int]] = []  # [step, count], innermost first
    for n, s in zip(reversed(a.shape[:-1]), reversed(a.strides[:-1]), strict=True):
        if n == 1:
            continue
        if groups and s == groups[-1][0] * groups[-1][1]:
            groups[-1][1] *= n
        else:
            groups.append([s, n])
    if len(groups) > 3:
        return None
    groups += [[0, 1]] * (3 - len(groups))
    (s2, n2), (s1, n1), (s0, _) = groups
    return s0, n1, s1, n2, s2


def reads_rows(k: int, a: np.ndarray) -> bool:
    """`KernelCaps.reads` of a row kernel: every input whose `row_layout` it has is read in place."""
    return row_layout(a) is not None


def rows_job(tasks: Mapping[Any, pool.Task], inputs: Sequence[np.ndarray], out: np.ndarray, eps: float,
             seconds_per_value: float, kind: int = 0) -> jobs.Jobs | None:
    """The job of a row kernel: `tasks` by out's dtype, every input of out's shape and dtype with rows
    a `row_layout`, out C-contiguous (None otherwise: no task serves the call, and in native
    replay an eps still a DynScalar, which this record holds as a value); `()` for an empty out. The
    record holds the inputs' addresses: the job reads the very arrays (views included) it was built on."""
    if not out.size:
        return ()
    if not isinstance(eps, numbers.Real):
        return None
    task = tasks.get(out.dtype)
    if task is None or not out.flags.c_contiguous or not all(a.dtype == out.dtype and a.shape == out.shape
                                                             for a in inputs):
        return None
    x, g = inputs[0], inputs[-1]
    xl, gl = row_layout(x), row_layout(g)
    if xl is None or gl is None:
        return None
    argv = jobs.argv_of(ROW_ARGS)
    _fill(x.ctypes.data, g.ctypes.data, bits(out) if out.dtype == BF16 else out, len(inputs), kind, float(eps),
          xl, gl, argv)
    return jobs.job(task, argv, out.size * seconds_per_value, int(argv[0]["rows"]))
