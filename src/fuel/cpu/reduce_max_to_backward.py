"""ReduceMaxToBackward (entry 10): g/ties to each maximum of its group, a task over independent groups.

x is seen as [A, R, C] (a view, no copy) whenever the reduced axes of size > 1 form one run: group (a, c)
is x[a, :, c]. C = 1 (softmax's max over the last axes) is the row task, a row a group; C > 1 (e.g. a
bias-like max over leading axes) is the column task, whose items are (a, block of COLUMN_BLOCK columns):
it walks the R rows of a block, so every load is contiguous. Any other target transposes the reduced axes
last (a NumPy copy) and runs the row task on the copy. One pass finds each group's max, tie count and NaN
count; a second writes g/ties. The max and the counts are exact and g/ties is one correctly rounded
division, so the bytes do not depend on how the groups are split. The division runs in f64 and is rounded
once to the output (f32: 53 >= 2·24 + 2 bits, so this is the correctly rounded f32 quotient); the half
types widen exactly to f32, whose correctly rounded quotient rounds once more to the half correctly for
the same reason.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.half_via_f32 import register_binary
from fuel.cpu.simd.vecmath import cast_like, neg_inf_like
from fuel.dispatch.impls import FusedKernelRegistry, PrecisionGuarantee, revision_of
from fuel.graph.registry import FusedOps
from fuel.graph.shapes import reduce_to_axes
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.buffers import POOL
from fuel.runtime.jobs import ADDRESS, INT, record_at

COLUMN_BLOCK = 256  # columns an item of the column task: 4 small scratch arrays, independent items
SECONDS_PER_VALUE = 1e-9  # one core's time an element of x, for the part count
# x, out [outer, n, cols] and g [outer, cols] (cols = 1 for the row task)
SHARE_ARGS = jobs.record(x=ADDRESS, g=ADDRESS, out=ADDRESS, outer=INT, n=INT, cols=INT)


@njit(inline="always", cache=True)
def _share_rows(part: int, parts: int, argv: int, dt: Any) -> None:
    """Rows [part·outer/parts, (part+1)·outer/parts) of x, out [outer, n] and g [outer]."""
    a = record_at(argv, SHARE_ARGS)
    rows, n = a.outer, a.n
    x = carray(pointer(a.x, dt), (rows, n))
    g = carray(pointer(a.g, dt), (rows,))
    out = carray(pointer(a.out, dt), (rows, n))
    for r in range(part * rows // parts, (part + 1) * rows // parts):
        row = x[r]
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
        share = cast_like(g[r] / (nans if nans else ties), m)
        zero = share * cast_like(0, m)
        o = out[r]
        if nans:
            for j in range(n):
                o[j] = share if row[j] != row[j] else zero
        else:
            for j in range(n):
                o[j] = share if row[j] == m else zero


@njit(inline="always", cache=True)
def _share_columns(part: int, parts: int, argv: int, dt: Any) -> None:
    """Items [part·count/parts, (part+1)·count/parts) of the (a, column block) items."""
    a = record_at(argv, SHARE_ARGS)
    outer, n, cols = a.outer, a.n, a.cols
    x = carray(pointer(a.x, dt), (outer, n, cols))
    g = carray(pointer(a.g, dt), (outer, cols))
    out = carray(pointer(a.out, dt), (outer, n, cols))
    blocks = (cols + COLUMN_BLOCK - 1) // COLUMN_BLOCK
    count = outer * blocks
    for t in range(part * count // parts, (part + 1) * count // parts):
        b = t // blocks
        c0 = (t % blocks) * COLUMN_BLOCK
        w = min(cols, c0 + COLUMN_BLOCK) - c0
        m = np.empty(w, x.dtype)
        ties = np.zeros(w, np.int64)
        nans = np.zeros(w, np.int64)
        m[:] = neg_inf_like(x[b, 0, c0])
        for r in range(n):
            xr = x[b, r, c0:c0 + w]
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
            share[k] = g[b, c0 + k] / (nans[k] if nans[k] else ties[k])
        for r in range(n):
            xr = x[b, r, c0:c0 + w]
            o = out[b, r, c0:c0 + w]
            for k in range(w):
                v = xr[k]
                hit = v != v if nans[k] else v == m[k]
                s = share[k]
                o[k] = s if hit else s * cast_like(0, s)


@pool.task(error_model="numpy")
def _rows_f32_part(part: int, parts: int, argv: int) -> None:
    _share_rows(part, parts, argv, np.float32)


@pool.task(error_model="numpy")
def _rows_f64_part(part: int, parts: int, argv: int) -> None:
    _share_rows(part, parts, argv, np.float64)


@pool.task(error_model="numpy")
def _columns_f32_part(part: int, parts: int, argv: int) -> None:
    _share_columns(part, parts, argv, np.float32)


@pool.task(error_model="numpy")
def _columns_f64_part(part: int, parts: int, argv: int) -> None:
    _share_columns(part, parts, argv, np.float64)


_ROW_TASKS = {np.dtype(np.float32): _rows_f32_part, np.dtype(np.float64): _rows_f64_part}
_COLUMN_TASKS = {np.dtype(np.float32): _columns_f32_part, np.dtype(np.float64): _columns_f64_part}


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


def _share_job(x: np.ndarray, g: np.ndarray, out: np.ndarray, outer: int, n: int, cols: int) -> jobs.Job:
    argv = jobs.argv_of(SHARE_ARGS)
    row = argv[0]
    row["x"], row["g"], row["out"] = x.ctypes.data, g.ctypes.data, out.ctypes.data
    row["outer"], row["n"], row["cols"] = outer, n, cols
    if cols == 1:
        return jobs.job(_ROW_TASKS[out.dtype], argv, x.size * SECONDS_PER_VALUE, outer)
    items = outer * -(-cols // COLUMN_BLOCK)
    return jobs.job(_COLUMN_TASKS[out.dtype], argv, x.size * SECONDS_PER_VALUE, items)


def reduce_max_to_backward_job(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> jobs.Jobs | None:
    """f32 or f64 x, g and out, C-contiguous, whose groups are a run of axes (None otherwise)."""
    x, g = inputs
    if not out.size:
        return ()
    if (out.dtype not in _ROW_TASKS or not all(a.dtype == out.dtype and a.flags.c_contiguous for a in (x, g, out))
            or x.shape != out.shape):
        return None
    layout = max_share_layout(x.shape, g.shape)
    return None if layout is None else _share_job(x, g, out, *layout)


def reduce_max_to_backward_native(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
    """f32 or f64 (the arrays' own type); contiguous inputs and output."""
    found = reduce_max_to_backward_job(inputs, out, params)
    if found is not None:
        jobs.run(found)
        return
    # Reduced axes apart from each other: gather them last (kept axes keep their order, so g's flat
    # order is the groups' order), run the row task, and scatter back.
    x, g = inputs
    reduced = reduce_to_axes("reduce_max_to_backward", x.shape, g.shape)
    perm = [i for i in range(x.ndim) if i not in reduced] + list(reduced)
    xt = np.ascontiguousarray(x.transpose(perm))
    n = math.prod(x.shape[i] for i in reduced)
    tmp = POOL.empty(xt.shape, out.dtype)
    jobs.run(_share_job(xt, np.ascontiguousarray(g), tmp, xt.size // n, n, 1))
    out[...] = tmp.transpose(np.argsort(perm))


jobs.replays(reduce_max_to_backward_native)(reduce_max_to_backward_job)


# |out - ref| <= max_relative·|ref| against float64 (S = max|ref| over the row). Twice the worst error
# `python -m fuel.testing.measure ReduceMaxToBackward` found over seeds 0-59 (each at least the output's
# unit roundoff): one correctly rounded division per group (half an ulp).
REDUCE_MAX_F32 = PrecisionGuarantee(True, None, 1.2e-7, None, "exact max and count; one f64 division rounded once")
REDUCE_MAX_F64 = PrecisionGuarantee(True, None, 2.3e-16, None, "exact max and count; one division")


def register(registry: FusedKernelRegistry) -> None:
    register_binary(registry, FusedOps.REDUCE_MAX_TO_BACKWARD, reduce_max_to_backward_native, REDUCE_MAX_F32,
                    REDUCE_MAX_F64, revision_of(_share_rows))
