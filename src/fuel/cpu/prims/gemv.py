"""Products of a few rows with a weight matrix (decode-sized MATMUL): one pass over the weight.

At decode sizes a matrix product streams a weight `[K, N]` from memory to make one to `GEMV_MAX_ROWS` rows.
Run through OpenBLAS, each call pays its thread hand-off, which costs more than the product at these sizes
(docs/performance/runtime.md, "gemv"), and BLAS's blocking makes a row's bytes depend on how many rows come
with it. Here every row's arithmetic is its own: each output value is `a[i, k] * b[k, j]` accumulated over k
in order within each of K_SPLIT fixed row ranges of the weight (in the working type: f32, or f64 for f64), the
partial sums added in order. So a value's bytes depend neither on the thread count, nor on which part
computed its column tile, nor on the other rows: a served request's rows are the same bytes alone or in a
batch (docs/kernels.md, "Batch invariance"). The work is cut into column tiles, each weight row read once
for all M rows of a tile; the parts take whole tiles.

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

GEMV_MAX_ROWS = 16  # up to this many rows a MATMUL with a 2-D weight runs here: each row's bytes as alone
SUM_SECONDS_PER_VALUE = 0.4e-9  # one core, adding the partial sums
K_SPLIT = 8  # fixed row ranges of the weight, each summed on its own, then added in order
TILE_VALUES = 8192  # M x the columns of a tile: a tile's two partial-sum blocks stay in the first-level cache,
# and one row's tile reads long runs of each weight row
MIN_TILE = 256
MOST_PARTS = 16  # parts a job may be cut into (each owns a scratch of two partial-sum tiles)

# a [m, k] @ b [k, n] into out [m, n], by column tiles of `tile` columns; `scratch` holds MOST_PARTS x 2 blocks
# [m, tile]
GEMV_ARGS = jobs.record(a=ADDRESS, b=ADDRESS, out=ADDRESS, scratch=ADDRESS, m=INT, k=INT, n=INT, tile=INT)


def column_tile(m: int) -> int:
    """The columns of a tile for M rows (a multiple of 64). It changes which columns share a part, never a
    value's arithmetic, so the bytes are the same at any M."""
    return max(MIN_TILE, TILE_VALUES // max(1, m) // 64 * 64)


@njit(inline="always", cache=True, fastmath={"contract"})
def _rows(a: Any, b: Any, acc: Any, k0: int, k1: int, j0: int, j1: int) -> None:
    """acc [M, j1 - j0] <- a[:, k0:k1] @ b[k0:k1, j0:j1]: each weight row read once for all M rows, k in
    order, every row's arithmetic its own (the same at any M)."""
    m = a.shape[0]
    acc[:] = 0
    for kk in range(k0, k1):
        brow = b[kk, j0:j1]
        for i in range(m):
            av = a[i, kk]
            y = acc[i]
            for j in range(brow.shape[0]):
                y[j] += av * brow[j]


@njit(inline="always", cache=True)
def _part(argv: int, part: int, parts: int, dtype: Any) -> None:
    """Column tiles [part·tiles/parts, (part + 1)·tiles/parts): each tile's K_SPLIT partial sums over fixed
    row ranges of the weight, added in order, so a value's bytes never depend on the parts or on M."""
    r = record_at(argv, GEMV_ARGS)
    m, k, n = r.m, r.k, r.n
    a = carray(pointer(r.a, dtype), (m, k))
    b = carray(pointer(r.b, dtype), (k, n))
    out = carray(pointer(r.out, dtype), (m, n))
    tile = r.tile
    scratch = carray(pointer(r.scratch, dtype), (parts, 2, m, tile))
    tiles = (n + tile - 1) // tile
    for t in range(part * tiles // parts, (part + 1) * tiles // parts):
        j0, j1 = t * tile, min(n, (t + 1) * tile)
        total, partial = scratch[part, 0, :, :j1 - j0], scratch[part, 1, :, :j1 - j0]
        _rows(a, b, total, 0, k // K_SPLIT, j0, j1)
        for s in range(1, K_SPLIT):
            _rows(a, b, partial, s * k // K_SPLIT, (s + 1) * k // K_SPLIT, j0, j1)
            total += partial
        out[:, j0:j1] = total


@pool.task(fastmath={"contract"})
def _gemv_f32(part: int, parts: int, argv: int) -> None:
    _part(argv, part, parts, np.float32)


@pool.task(fastmath={"contract"})
def _gemv_f64(part: int, parts: int, argv: int) -> None:
    _part(argv, part, parts, np.float64)


# The dtypes gemv has a kernel for (a, b and out all of one of them).
TASKS: dict[np.dtype[Any], pool.Task] = {np.dtype(np.float32): _gemv_f32, np.dtype(np.float64): _gemv_f64}


@njit(cache=True)
def _fill(a: Any, b: Any, out: Any, scratch: Any, argv: Any) -> None:
    r = argv[0]
    r.a, r.b, r.out, r.scratch = a.ctypes.data, b.ctypes.data, out.ctypes.data, scratch.ctypes.data
    r.m, r.k, r.n, r.tile = a.shape[0], a.shape[1], b.shape[1], scratch.shape[3]


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


def takes(rows: int, a: np.ndarray, b: np.ndarray) -> bool:
    """Whether a product of `rows` rows of a with the 2-D weight b runs here: the one rule MATMUL and
    FusedLinear share, so a row's bytes are the same whichever of them computes it."""
    return (rows <= GEMV_MAX_ROWS and b.ndim == 2 and b.flags.c_contiguous and b.dtype in TASKS
            and a.dtype == b.dtype)


def gemv_job(a: np.ndarray, b: np.ndarray, out: np.ndarray, op: str = "gemv") -> jobs.Job:
    """The job of out [M, N] <- a [M, K] @ b [K, N], all C-contiguous and of one dtype of `TASKS` (else a
    KernelError naming `op`); it keeps its scratch alive."""
    task = _task_for(op, a, b, out, TASKS, out_raw=True)
    tile = column_tile(a.shape[0])
    most = max(1, min(MOST_PARTS, -(-b.shape[1] // tile)))
    scratch = np.empty((most, 2, a.shape[0], tile), out.dtype)
    argv = jobs.argv_of(GEMV_ARGS)
    _fill(a, b, out, scratch, argv)
    seconds = b.nbytes / SERIAL_BYTES_PER_SECOND + out.size * K_SPLIT * SUM_SECONDS_PER_VALUE
    return jobs.job(task, argv, seconds, most, keep=(scratch,))


def gemv(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out [M, N] <- a [M, K] @ b [K, N], all of one dtype of `TASKS` (any other is a KernelError), b
    C-contiguous. Each output value is K_SPLIT partial sums over fixed row ranges of the weight, each in k
    order, added in order: its bytes depend neither on who computed which columns nor on the other rows
    (`GEMV_MAX_ROWS` rows of a MATMUL come here, so a served request's rows are the same bytes in any batch)."""
    a = np.ascontiguousarray(a)  # the job reads it by address: a copy made here must live until it has run
    if out.flags.c_contiguous:
        jobs.run(gemv_job(a, b, out))
        return
    flat = np.empty(out.shape, out.dtype)
    jobs.run(gemv_job(a, b, flat))
    out[...] = flat
