"""INDEX_COPY, the destructive scatter of rows: `target[index[r]] = rows[r]` for every r, in place.

Two jobs, run in order by the eager kernel and posted alike by native replay (the index is an array the
task reads, so one capture serves any slots):
- the check (one part): every index lies in [0, N) and none repeats; else it records the first bad
  position and value in its status words and the write does nothing. A repeat is found through a byte
  per target row (`seen`), marked and then cleared again, so the scratch is all zeros between calls;
- the write: each part copies its rows' bytes (any dtype: a row is `row` bytes) to their slots. Indices are
  distinct, so no two rows land on one slot and the bytes never depend on the split.
The job's `check` then raises the recorded error (IndexOutOfRange naming the position and value).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import carray, njit

from fuel.errors import IndexOutOfRange, KernelError
from fuel.graph.node import OpSpec
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import ADDRESS, INT, Job, job, record_at

SECONDS_PER_BYTE = 0.1e-9  # one core, a row copied from cache
SECONDS_PER_INDEX = 2e-9  # one core, an index checked and its mark set and cleared
OUT_OF_RANGE, REPEATED = 1, 2
# target [n rows of `row` bytes]; index [m] (i64 when `wide`, else u32); rows [m rows of `row` bytes];
# status [4] i64: (0 or OUT_OF_RANGE or REPEATED, position, value, the earlier position of a repeat);
# seen [n] u8 scratch
INDEX_COPY_ARGS = jobs.record(target=ADDRESS, index=ADDRESS, rows=ADDRESS, status=ADDRESS, seen=ADDRESS, n=INT,
                              m=INT, row=INT, wide=INT)


@njit(cache=True)
def find_problem(idx: Any, n: int, seen: Any, status: Any) -> None:
    """Set status to the first index (in order) outside [0, n) or equal to an earlier one, or to zeros.
    `seen` (n bytes) is all zeros on entry and on return."""
    status[:] = 0
    m = idx.shape[0]
    bad = m
    for r in range(m):
        v = np.int64(idx[r])
        if v < 0 or v >= n:
            status[0], status[1], status[2] = OUT_OF_RANGE, r, v
            bad = r
            break
        if seen[v]:
            first = 0
            while np.int64(idx[first]) != v:
                first += 1
            status[0], status[1], status[2], status[3] = REPEATED, r, v, first
            bad = r
            break
        seen[v] = 1
    for r in range(bad):
        seen[np.int64(idx[r])] = 0


@pool.task()
def _check(part: int, parts: int, argv: int) -> None:
    v = record_at(argv, INDEX_COPY_ARGS)
    status = carray(pointer(v.status, np.int64), (4,))
    seen = carray(pointer(v.seen, np.uint8), (max(v.n, 1),))
    for _ in range(part // parts, (part + 1) // parts):  # one item: the whole check
        if v.wide:
            find_problem(carray(pointer(v.index, np.int64), (v.m,)), v.n, seen, status)
        else:
            find_problem(carray(pointer(v.index, np.uint32), (v.m,)), v.n, seen, status)


@njit(inline="always", cache=True)
def _copy_rows(idx: Any, target: Any, rows: Any, row: int, lo: int, hi: int) -> None:
    for r in range(lo, hi):
        at = np.int64(idx[r]) * row
        target[at:at + row] = rows[r * row:(r + 1) * row]


@pool.task()
def _write(part: int, parts: int, argv: int) -> None:
    v = record_at(argv, INDEX_COPY_ARGS)
    if carray(pointer(v.status, np.int64), (4,))[0] != 0:
        return  # the check found a bad index: nothing is written
    m, row = v.m, v.row
    target = carray(pointer(v.target, np.uint8), (v.n * row,))
    rows = carray(pointer(v.rows, np.uint8), (m * row,))
    lo, hi = part * m // parts, (part + 1) * m // parts
    if v.wide:
        _copy_rows(carray(pointer(v.index, np.int64), (m,)), target, rows, row, lo, hi)
    else:
        _copy_rows(carray(pointer(v.index, np.uint32), (m,)), target, rows, row, lo, hi)


def raise_problem(status: np.ndarray, n: int) -> None:
    """Raise the error `find_problem` recorded, if any (nothing recorded: one read; replay calls it a step)."""
    if not status[0]:
        return
    code, r, v, first = (int(s) for s in status)
    if code == OUT_OF_RANGE:
        raise IndexOutOfRange(f"index_copy: index[{r}] = {v} is outside the target's {n} rows [0, {n})")
    if code == REPEATED:
        raise IndexOutOfRange(f"index_copy: index[{r}] = {v} repeats index[{first}]; a scatter with duplicate "
                              f"indices has no single answer")


def index_copy_jobs(target: np.ndarray, index: np.ndarray, rows: np.ndarray) -> tuple[Job, Job] | None:
    """The check and the write over these arrays, or None where the tasks do not read their layout (a
    target or rows not C-contiguous, or sharing memory with what the write reads)."""
    if (not target.flags.c_contiguous or not rows.flags.c_contiguous or not index.flags.c_contiguous
            or np.may_share_memory(target, rows) or np.may_share_memory(target, index)):
        return None
    n, m = target.shape[0], index.shape[0]
    row = math.prod(target.shape[1:]) * target.itemsize
    status, seen = np.zeros(4, np.int64), np.zeros(max(n, 1), np.uint8)
    argv = jobs.argv_of(INDEX_COPY_ARGS)
    argv[0] = (target.ctypes.data, index.ctypes.data, rows.ctypes.data, status.ctypes.data, seen.ctypes.data,
               n, m, row, int(index.dtype == np.int64))
    check = job(_check, argv, m * SECONDS_PER_INDEX, 1, keep=(status, seen))
    write = job(_write, argv, m * row * SECONDS_PER_BYTE, max(m, 1), check=lambda: raise_problem(status, n))
    return check, write


def index_copy_kernel(xs: list[np.ndarray], spec: OpSpec, out: np.ndarray | None) -> np.ndarray:
    """Write the rows into the target (input 0) in place at their indices; return the target. Indices are
    checked before any row is written. Index and rows the tasks cannot read as they are (strided, or
    overlapping the target) are copied first; a strided target is written through NumPy after the same
    check."""
    target, index, rows = xs
    if not target.flags.writeable:
        raise KernelError("index_copy: the target is read-only; pass a writable array (it is written in place)")
    index, rows = (np.array(a) if np.may_share_memory(target, a) else np.ascontiguousarray(a) for a in (index, rows))
    found = index_copy_jobs(target, index, rows)
    if found is not None:
        jobs.run(found)
        return target
    n = target.shape[0]
    status = np.zeros(4, np.int64)
    find_problem(index, n, np.zeros(max(n, 1), np.uint8), status)
    raise_problem(status, n)
    target[index.astype(np.intp)] = rows
    return target
