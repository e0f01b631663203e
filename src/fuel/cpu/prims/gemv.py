"""Products of a few rows with a weight matrix (decode-sized MATMUL): one serial pass over the weight.

At decode sizes a matrix product streams a weight `[K, N]` from memory to make one to four rows. Run
through OpenBLAS, each call pays its thread hand-off, which costs more than the product at these sizes
(docs/performance/runtime.md, "gemv"). Past `GEMV_MAX_BYTES` the BLAS keeps them: two threads may stream a
large weight faster than one.

Each output row accumulates `a[i, k] * b[k, :]` over k in order, in the working type (f32, or f64
for f64), one thread: the bytes never depend on the thread count.

Only the dtypes in `TASKS` have a kernel: the tasks read raw addresses as that type, so any other dtype
would be read as the wrong type and written past the scratch. The MATMUL primitive routes by `TASKS`
(other dtypes take NumPy's matmul) and every entry point checks it, raising KernelError.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit

from fuel.errors import KernelError
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import ADDRESS, INT, record_at
from fuel.runtime.threads import SERIAL_BYTES_PER_SECOND

GEMV_MAX_ROWS = 4
GEMV_MAX_BYTES = 8 << 20
SUM_SECONDS_PER_VALUE = 0.4e-9  # one core, adding the partial sums
K_SPLIT = 8  # fixed row ranges of the weight, each summed on its own, then added in order

# a [m, k] @ b [k, n] into the K_SPLIT partial sums [K_SPLIT, m, n] at `partial`
GEMV_ARGS = jobs.record(a=ADDRESS, b=ADDRESS, partial=ADDRESS, m=INT, k=INT, n=INT)
# the `size` values of the K_SPLIT partial sums at `partial` added in order into `out`
SUM_ARGS = jobs.record(partial=ADDRESS, out=ADDRESS, size=INT)


@njit(inline="always", cache=True, fastmath={"contract"})
def _rows(a: Any, b: Any, acc: Any, k0: int, k1: int) -> None:
    """acc [M, N] <- a[:, k0:k1] @ b[k0:k1]: each weight row read once for all M rows, k in order."""
    m = a.shape[0]
    acc[:] = 0
    for kk in range(k0, k1):
        brow = b[kk]
        for i in range(m):
            av = a[i, kk]
            y = acc[i]
            for j in range(brow.shape[0]):
                y[j] += av * brow[j]


@njit(inline="always", cache=True)
def _part(argv: int, part: int, parts: int, dtype: Any) -> None:
    """Row ranges [part·K_SPLIT/parts, (part + 1)·K_SPLIT/parts) of the weight, each into its partial sum."""
    r = record_at(argv, GEMV_ARGS)
    m, k, n = r.m, r.k, r.n
    a = carray(pointer(r.a, dtype), (m, k))
    b = carray(pointer(r.b, dtype), (k, n))
    partial = carray(pointer(r.partial, dtype), (K_SPLIT, m, n))
    for s in range(part * K_SPLIT // parts, (part + 1) * K_SPLIT // parts):
        _rows(a, b, partial[s], s * k // K_SPLIT, (s + 1) * k // K_SPLIT)


@pool.task(fastmath={"contract"})
def _gemv_f32(part: int, parts: int, argv: int) -> None:
    _part(argv, part, parts, np.float32)


@pool.task(fastmath={"contract"})
def _gemv_f64(part: int, parts: int, argv: int) -> None:
    _part(argv, part, parts, np.float64)


# The dtypes gemv has a kernel for (a, b and out all of one of them), and those of `f32_jobs`, whose sum
# task adds f32 partial sums.
TASKS: dict[np.dtype[Any], pool.Task] = {np.dtype(np.float32): _gemv_f32, np.dtype(np.float64): _gemv_f64}
F32_TASKS: dict[np.dtype[Any], pool.Task] = {np.dtype(np.float32): _gemv_f32}


@njit(cache=True)
def _fill(a: Any, b: Any, partial: Any, argv: Any) -> None:
    r = argv[0]
    r.a, r.b, r.partial = a.ctypes.data, b.ctypes.data, partial.ctypes.data
    r.m, r.k, r.n = a.shape[0], a.shape[1], b.shape[1]


@njit(cache=True)
def _sum_partials(partial: Any, out: Any) -> None:
    """out <- the partial sums added in order."""
    out[:] = partial[0]
    for s in range(1, partial.shape[0]):
        out += partial[s]


@pool.task()
def _sum_task(part: int, parts: int, argv: int) -> None:
    """`_sum_partials` of f32 as a job (one part), for the native replay."""
    r = record_at(argv, SUM_ARGS)
    _sum_partials(carray(pointer(r.partial, np.float32), (K_SPLIT, r.size)),
                  carray(pointer(r.out, np.float32), (r.size,)))


def _task_for(op: str, a: np.ndarray, b: np.ndarray, out: np.ndarray, tasks: dict[np.dtype[Any], pool.Task],
              out_raw: bool) -> pool.Task:
    """The task of `tasks` for a [M, K] @ b [K, N] -> out [M, N], or a KernelError naming `op`, the dtypes
    it has a kernel for and those it was given. The task reads a and b (and out where `out_raw`) by raw
    address as its dtype: another dtype, shape or layout would be read and written out of bounds."""
    task = tasks.get(b.dtype)
    if task is None or not a.dtype == b.dtype == out.dtype:
        known = ", ".join(str(d) for d in tasks)
        raise KernelError(f"{op}: has a kernel for a, b and out all {known}, got {a.dtype}, {b.dtype} and "
                          f"{out.dtype}")
    raw = (a, b, out) if out_raw else (a, b)
    if not (a.ndim == b.ndim == out.ndim == 2 and a.shape[1] == b.shape[0] and out.shape == (a.shape[0], b.shape[1])
            and all(x.flags.c_contiguous for x in raw)):
        raise KernelError(f"{op}: needs a [M, K] and b [K, N] C-contiguous and out [M, N]"
                          f"{' C-contiguous' if out_raw else ''}, got {list(a.shape)}, {list(b.shape)} and "
                          f"{list(out.shape)}")
    return task


def _partials_job(a: np.ndarray, b: np.ndarray, out: np.ndarray, op: str,
                  summed_by_job: bool) -> tuple[jobs.Job, np.ndarray]:
    """`gemv`'s first job, the K_SPLIT partial sums of a @ b into a scratch, and that scratch. Where
    `summed_by_job` the partial sums are then added by `_sum_task`, which writes out by address as f32:
    only f32 and a C-contiguous out are taken. Else they are added by `_sum_partials` on the array out."""
    task = _task_for(op, a, b, out, F32_TASKS if summed_by_job else TASKS, out_raw=summed_by_job)
    partial = np.empty((K_SPLIT, *out.shape), out.dtype)
    argv = jobs.argv_of(GEMV_ARGS)
    _fill(a, b, partial, argv)
    return jobs.job(task, argv, b.nbytes / SERIAL_BYTES_PER_SECOND, K_SPLIT), partial


def f32_jobs(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> tuple[jobs.Job, jobs.Job, np.ndarray]:
    """`gemv` of f32 a (C-contiguous), b and out as two jobs, the partial sums into a scratch and their sum
    into out, and that scratch. Only f32: `_sum_task` adds f32 partial sums."""
    partials, partial = _partials_job(a, b, out, "gemv.f32_jobs", summed_by_job=True)
    total = jobs.argv_of(SUM_ARGS)
    total[0] = (partial.ctypes.data, out.ctypes.data, out.size)
    return partials, jobs.job(_sum_task, total, out.size * SUM_SECONDS_PER_VALUE, 1), partial


def gemv(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out [M, N] <- a [M, K] @ b [K, N], all of one dtype of `TASKS` (any other is a KernelError), b
    C-contiguous. The weight is cut into K_SPLIT fixed row ranges: each is one sequential stream, summed
    alone (on the spinning pool past a few microseconds of weight), and the partial sums are added in
    order, so the bytes never depend on who computed which range."""
    a = np.ascontiguousarray(a)  # the job reads it by address: a copy made here must live until it has run
    partials, partial = _partials_job(a, b, out, "gemv", summed_by_job=False)
    jobs.run(partials)
    _sum_partials(partial, out)
