"""INDEX_SELECT as jobs of the spinning pool, for native replay: `out = take(x, index, axis)`.

Replay reads the index afresh at every call (an argument staged into the capture's buffer), so its range
is checked inside the native program, as `index_copy`'s is:
- the check (one part): every index lies in [0, n); else it records the first bad one (in order) in its
  status words, and the gather writes nothing;
- the gather: x read as `[outer, n, row]` (row: the bytes after the axis), out as `[outer, m, row]`; each
  part copies its share of the outer·m rows. A row is a byte copy, so no split changes a byte.
The check job's hook then raises what the check found: IndexOutOfRange, worded as the eager kernel's.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import carray, njit

from fuel.errors import IndexOutOfRange
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import ADDRESS, INT, Job, job, record_at

SECONDS_PER_BYTE = 0.1e-9  # one core, a row copied from cache
SECONDS_PER_INDEX = 1e-9  # one core, an index compared with the axis
WIDE = {np.dtype(np.int64): 1, np.dtype(np.uint32): 0}  # the index dtypes the tasks read
# x [outer, n rows of `row` bytes]; index [m] (i64 when `wide`, else u32); out [outer, m rows]; status [2]
# i64: (1 after a bad index, its value)
INDEX_SELECT_ARGS = jobs.record(x=ADDRESS, index=ADDRESS, out=ADDRESS, status=ADDRESS, outer=INT, n=INT, m=INT,
                                row=INT, wide=INT)


@njit(cache=True)
def find_bad(idx: Any, n: int, status: Any) -> None:
    """status <- (1, the first index outside [0, n)), or zeros."""
    status[:] = 0
    for r in range(idx.shape[0]):
        v = np.int64(idx[r])
        if v < 0 or v >= n:
            status[0], status[1] = 1, v
            return


@pool.task()
def _check(part: int, parts: int, argv: int) -> None:
    v = record_at(argv, INDEX_SELECT_ARGS)
    status = carray(pointer(v.status, np.int64), (2,))
    for _ in range(part // parts, (part + 1) // parts):  # one item: the whole check
        if v.wide:
            find_bad(carray(pointer(v.index, np.int64), (v.m,)), v.n, status)
        else:
            find_bad(carray(pointer(v.index, np.uint32), (v.m,)), v.n, status)


@njit(inline="always", cache=True)
def _gather(idx: Any, x: Any, out: Any, n: int, m: int, row: int, lo: int, hi: int) -> None:
    for k in range(lo, hi):  # output row k: outer o = k // m, index position r = k % m
        src = ((k // m) * n + np.int64(idx[k % m])) * row
        out[k * row:(k + 1) * row] = x[src:src + row]


@pool.task()
def _write(part: int, parts: int, argv: int) -> None:
    v = record_at(argv, INDEX_SELECT_ARGS)
    if carray(pointer(v.status, np.int64), (2,))[0] != 0:
        return  # a bad index: nothing is read
    outer, n, m, row = v.outer, v.n, v.m, v.row
    x = carray(pointer(v.x, np.uint8), (outer * n * row,))
    out = carray(pointer(v.out, np.uint8), (outer * m * row,))
    lo, hi = part * outer * m // parts, (part + 1) * outer * m // parts
    if v.wide:
        _gather(carray(pointer(v.index, np.int64), (m,)), x, out, n, m, row, lo, hi)
    else:
        _gather(carray(pointer(v.index, np.uint32), (m,)), x, out, n, m, row, lo, hi)


def raise_bad(status: np.ndarray, n: int) -> None:
    """Raise the IndexOutOfRange `find_bad` recorded, if any (the eager kernel's words)."""
    if status[0]:
        raise IndexOutOfRange(f"index_select: index {int(status[1])} is out of range for an axis of size {n}")


def index_select_jobs(x: np.ndarray, index: np.ndarray, out: np.ndarray, axis: int) -> tuple[Job, Job] | None:
    """The check and the gather over these arrays, or None where the tasks do not read their layout (not
    C-contiguous, another dtype for out or the index, out sharing memory with what the gather reads)."""
    wide = WIDE.get(index.dtype)
    if (wide is None or out.dtype != x.dtype or index.ndim != 1 or out.size == 0
            or not (x.flags.c_contiguous and index.flags.c_contiguous and out.flags.c_contiguous)
            or np.may_share_memory(out, x) or np.may_share_memory(out, index)):
        return None
    outer, n, m = math.prod(x.shape[:axis]), x.shape[axis], index.shape[0]
    row = math.prod(x.shape[axis + 1:]) * x.itemsize
    status = np.zeros(2, np.int64)
    argv = jobs.argv_of(INDEX_SELECT_ARGS)
    argv[0] = (x.ctypes.data, index.ctypes.data, out.ctypes.data, status.ctypes.data, outer, n, m, row, wide)
    check = job(_check, argv, m * SECONDS_PER_INDEX, 1, keep=(status,), check=lambda: raise_bad(status, n))
    return check, job(_write, argv, out.nbytes * SECONDS_PER_BYTE, outer * m)
