"""Products of a few rows with a weight matrix (decode-sized MATMUL): one pass over the weight.

At decode sizes a matrix product streams a weight `[K, N]` from memory to make one to `GEMV_MAX_ROWS` rows.
Run through OpenBLAS, each call pays its thread hand-off, which costs more than the product at these sizes
(docs/performance/runtime.md, "gemv"), and BLAS's blocking makes a row's bytes depend on how many rows come
with it. Here every row's arithmetic is its own: each output value is `a[i, k] * b[k, j]` accumulated over k
in order, one fused multiply-add per k (in the working type: f32, or f64 for f64), within each of K_SPLIT
fixed row ranges of the weight, the partial sums added in order. So a value's bytes depend neither on the
thread count, nor on which part computed its column tile, nor on the other rows, nor on which loop below
computed it: a served request's rows are the same bytes alone or in a batch (docs/kernels.md, "Batch
invariance").

The work is cut into column tiles; the parts take whole tiles, or, where a few rows of a narrow weight make
fewer tiles than threads could share, (tile, row range) items whose partial sums a second job adds in order.
Within a tile, each weight row range is walked in chunks of `CHUNK_ROWS` weight rows:
- rows four at a time (`_block`): for a column block of COLUMN_VECTORS 64-byte vectors, the 4 x 4
  accumulators stay in registers over the chunk, each weight vector loaded once for the 4 rows; between
  chunks they pause in a scratch `acc` [M, N];
- the one to three rows left (`_sweep`): each weight row read whole for all of them, the partial sums in
  `acc`. One or two rows alone read the weight in its memory order, which streams from memory faster than
  the blocks' short runs of many rows (docs/performance/runtime.md, "gemv");
- columns past the last block narrower than a vector (`_narrow`), for the block rows: one value at a time.

Only the dtypes in `TASKS` have a kernel: the tasks read raw addresses as that type, so any other dtype
would be read as the wrong type and written past the arrays. The MATMUL primitive routes by `TASKS`
(other dtypes take NumPy's matmul) and every entry point checks it, raising KernelError.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.simd.vec64 import fma1, fmas, vadd, vload, vstore, vzero
from fuel.errors import KernelError
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import ADDRESS, INT, record_at
from fuel.runtime.threads import SERIAL_BYTES_PER_SECOND

GEMV_MAX_ROWS = 16  # up to this many rows a MATMUL with a 2-D weight runs here: each row's bytes as alone
SUM_SECONDS_PER_VALUE = 0.4e-9  # one core, adding the partial sums
K_SPLIT = 8  # fixed row ranges of the weight, each summed on its own, then added in order
TILE_VALUES = 8192  # M x the columns of a tile: one row's tile reads long runs of each weight row
MIN_TILE = 256
BLOCK_ROWS = 4  # rows of a register block (`_block`)
COLUMN_VECTORS = 4  # 64-byte vectors of a column block: 4 rows x 4 accumulators stay in registers
CHUNK_ROWS = 16  # weight rows a block runs over between pauses (docs/performance/runtime.md, "gemv"); a
# tile's chunk stays in L2 for the sweep of the rows left after the blocks
MOST_PARTS = 16  # parts a job may be cut into

SPLIT_BELOW_TILES = 4  # fewer column tiles than this (and a weight of SPLIT_MIN_BYTES): the row ranges are items
SPLIT_MIN_BYTES = 1 << 20
SUM_PIECE = 4096  # values a part of the partial sums' addition holds at least

# a [m, k] @ b [k, n] into out [m, n], by column tiles of `tile` columns, weight rows `chunk` at a time; `acc`
# [m, n] holds the partial sums between chunks. `split` 1: the items are (tile, row range) pairs, each range's
# partial sums left in its own plane of `acc` [K_SPLIT, m, n] for `SUM_ARGS`' job to add in order into out
GEMV_ARGS = jobs.record(a=ADDRESS, b=ADDRESS, out=ADDRESS, acc=ADDRESS, m=INT, k=INT, n=INT, tile=INT,
                        chunk=INT, split=INT)
# out [size] <- acc[0] + acc[1] + ... + acc[K_SPLIT - 1], added in that order, over `size` values
SUM_ARGS = jobs.record(acc=ADDRESS, out=ADDRESS, size=INT)


def column_tile(m: int) -> int:
    """The columns of a tile for M rows (a multiple of 64). It changes which columns share a part, never a
    value's arithmetic, so the bytes are the same at any M."""
    return max(MIN_TILE, TILE_VALUES // max(1, m) // 64 * 64)


@njit(inline="always", cache=True)
def _offsets(j: int, j1: int, lanes: int) -> tuple[int, int, int, int]:
    """The COLUMN_VECTORS vector offsets of the column block at j of a tile ending at j1 (j1 - j >= lanes):
    those that would pass j1 end at j1 instead, so they overlap the block's others, which only recomputes a
    column with the same arithmetic."""
    last = j1 - lanes
    return min(j, last), min(j + lanes, last), min(j + 2 * lanes, last), min(j + 3 * lanes, last)


@njit(inline="always", cache=True)
def _weights(b: Any, at: int, o: tuple[int, int, int, int]) -> Any:
    return vload(b, at + o[0]), vload(b, at + o[1]), vload(b, at + o[2]), vload(b, at + o[3])


@njit(inline="always", cache=True)
def _step(s: Any, w: Any, c: Any) -> Any:
    """One k step of one row's block: c + s · w, fused, vector by vector."""
    return fmas(s, w[0], c[0]), fmas(s, w[1], c[1]), fmas(s, w[2], c[2]), fmas(s, w[3], c[3])


@njit(inline="always", cache=True)
def _put(out: Any, at: int, o: tuple[int, int, int, int], c: Any, first: bool) -> None:
    """out's block at row offset `at` <- c (the first partial sum) or out + c. Every load comes before the
    first store: overlapping vectors then add c once."""
    if first:
        vstore(out, at + o[0], c[0])
        vstore(out, at + o[1], c[1])
        vstore(out, at + o[2], c[2])
        vstore(out, at + o[3], c[3])
    else:
        t0, t1 = vadd(vload(out, at + o[0]), c[0]), vadd(vload(out, at + o[1]), c[1])
        t2, t3 = vadd(vload(out, at + o[2]), c[2]), vadd(vload(out, at + o[3]), c[3])
        vstore(out, at + o[0], t0)
        vstore(out, at + o[1], t1)
        vstore(out, at + o[2], t2)
        vstore(out, at + o[3], t3)


@njit(inline="always", cache=True)
def _resume(acc: Any, at: int, o: tuple[int, int, int, int], start: bool) -> Any:
    """A row's block of partial sums: zero at the start of a weight row range, else as `_pause` left it."""
    if start:
        z = vzero(acc)
        return z, z, z, z
    return _weights(acc, at, o)


@njit(inline="always", cache=True)
def _pause(acc: Any, at: int, o: tuple[int, int, int, int], c: Any) -> None:
    vstore(acc, at + o[0], c[0])
    vstore(acc, at + o[1], c[1])
    vstore(acc, at + o[2], c[2])
    vstore(acc, at + o[3], c[3])


@njit(inline="always", cache=True)
def _block(a: Any, b: Any, out: Any, acc: Any, i: int, k0: int, k1: int, o: tuple[int, int, int, int], start: bool,
           end: bool, first: bool) -> None:
    """Rows i .. i + 4 of one column block over the weight rows [k0, k1): each of the 16 accumulators a
    register, each weight vector loaded once for the 4 rows, k in order. The partial sums pause in `acc`
    between chunks of k (`start`: the first chunk of a weight row range, `end`: its last) and land in `out`
    at the range's end."""
    n = b.shape[1]
    c0, c1 = _resume(acc, i * n, o, start), _resume(acc, (i + 1) * n, o, start)
    c2, c3 = _resume(acc, (i + 2) * n, o, start), _resume(acc, (i + 3) * n, o, start)
    for kk in range(k0, k1):
        w = _weights(b, kk * n, o)
        c0 = _step(a[i, kk], w, c0)
        c1 = _step(a[i + 1, kk], w, c1)
        c2 = _step(a[i + 2, kk], w, c2)
        c3 = _step(a[i + 3, kk], w, c3)
    if end:
        _put(out, i * n, o, c0, first)
        _put(out, (i + 1) * n, o, c1, first)
        _put(out, (i + 2) * n, o, c2, first)
        _put(out, (i + 3) * n, o, c3, first)
    else:
        _pause(acc, i * n, o, c0)
        _pause(acc, (i + 1) * n, o, c1)
        _pause(acc, (i + 2) * n, o, c2)
        _pause(acc, (i + 3) * n, o, c3)


@njit(inline="always", cache=True)
def _sweep(a: Any, b: Any, out: Any, acc: Any, i0: int, k0: int, k1: int, j0: int, j1: int, start: bool, end: bool,
           first: bool) -> None:
    """Rows [i0, M) (fewer than a block's) over the weight rows [k0, k1) and the columns [j0, j1), their
    partial sums in `acc`, k in order: the weight read in its memory order, one stream, which streams from
    memory faster than blocks do at so few rows."""
    if start:
        acc[i0:, j0:j1] = 0
    for kk in range(k0, k1):
        brow = b[kk, j0:j1]
        for i in range(i0, a.shape[0]):
            s, y = a[i, kk], acc[i, j0:j1]
            for j in range(brow.shape[0]):
                y[j] = fma1(s, brow[j], y[j])
    if end:
        if first:
            out[i0:, j0:j1] = acc[i0:, j0:j1]
        else:
            out[i0:, j0:j1] += acc[i0:, j0:j1]


@njit(inline="always", cache=True)
def _narrow(a: Any, b: Any, out: Any, k0: int, k1: int, j0: int, j1: int, first: bool, zero: Any, rows: int) -> None:
    """`_block`'s arithmetic, one value at a time, for the first `rows` rows of the columns past the blocks."""
    for i in range(rows):
        for j in range(j0, j1):
            acc = zero
            for kk in range(k0, k1):
                acc = fma1(a[i, kk], b[kk, j], acc)
            out[i, j] = acc if first else out[i, j] + acc


@njit(inline="always", cache=True)
def _range(a: Any, b: Any, out: Any, acc: Any, j0: int, j1: int, s: int, chunk: int, first: bool) -> None:
    """Weight row range s of the columns [j0, j1): its partial sums put in out (`first`) or added to it."""
    m, k = a.shape
    lanes = 64 // b.itemsize
    sliver = (j1 - j0) % (COLUMN_VECTORS * lanes)
    jv = j1 - (sliver if sliver < lanes else 0)  # vector blocks cover [j0, jv), no vector past them
    k0, k1 = s * k // K_SPLIT, (s + 1) * k // K_SPLIT
    # an empty row range (K < K_SPLIT) still adds its zero partial sum, as the contract's chain does
    for c0 in range(k0, max(k0 + 1, k1), chunk):
        c1 = min(k1, c0 + chunk)
        for j in range(j0, jv, COLUMN_VECTORS * lanes):
            o = _offsets(j, jv, lanes)
            i = 0
            while i + BLOCK_ROWS <= m:
                _block(a, b, out, acc, i, c0, c1, o, c0 == k0, c1 == k1, first)
                i += BLOCK_ROWS
        if m % BLOCK_ROWS:
            _sweep(a, b, out, acc, m - m % BLOCK_ROWS, c0, c1, j0, j1, c0 == k0, c1 == k1, first)
    _narrow(a, b, out, k0, k1, jv, j1, first, a.dtype.type(0), m - m % BLOCK_ROWS)


@njit(inline="always", cache=True)
def _part(argv: int, part: int, parts: int, dtype: Any) -> None:
    """Column tiles [part·tiles/parts, (part + 1)·tiles/parts), each value's K_SPLIT partial sums over fixed
    row ranges of the weight added in order in `out`; or, split, the (tile, range) items of the part, each
    range's partial sums in its plane of `acc` (the sum job adds them in the same order). Either way a value's
    bytes never depend on the parts or on M."""
    r = record_at(argv, GEMV_ARGS)
    m, k, n = r.m, r.k, r.n
    a = carray(pointer(r.a, dtype), (m, k))
    b = carray(pointer(r.b, dtype), (k, n))
    out = carray(pointer(r.out, dtype), (m, n))
    tile = r.tile
    tiles = (n + tile - 1) // tile
    if r.split:
        planes = carray(pointer(r.acc, dtype), (K_SPLIT, m, n))
        for item in range(part * tiles * K_SPLIT // parts, (part + 1) * tiles * K_SPLIT // parts):
            t, s = item // K_SPLIT, item % K_SPLIT
            _range(a, b, planes[s], planes[s], t * tile, min(n, (t + 1) * tile), s, r.chunk, True)
        return
    acc = carray(pointer(r.acc, dtype), (m, n))
    for t in range(part * tiles // parts, (part + 1) * tiles // parts):
        for s in range(K_SPLIT):
            _range(a, b, out, acc, t * tile, min(n, (t + 1) * tile), s, r.chunk, s == 0)


@njit(inline="always", cache=True)
def _sum(argv: int, part: int, parts: int, dtype: Any) -> None:
    """Values [part·size/parts, (part + 1)·size/parts) of out <- the K_SPLIT planes of acc, added in order."""
    r = record_at(argv, SUM_ARGS)
    size = r.size
    planes = carray(pointer(r.acc, dtype), (K_SPLIT, size))
    out = carray(pointer(r.out, dtype), (size,))
    for i in range(part * size // parts, (part + 1) * size // parts):
        v = planes[0, i]
        for s in range(1, K_SPLIT):
            v = v + planes[s, i]
        out[i] = v


@pool.task()
def _gemv_f32(part: int, parts: int, argv: int) -> None:
    _part(argv, part, parts, np.float32)


@pool.task()
def _gemv_f64(part: int, parts: int, argv: int) -> None:
    _part(argv, part, parts, np.float64)


@pool.task()
def _sum_f32(part: int, parts: int, argv: int) -> None:
    _sum(argv, part, parts, np.float32)


@pool.task()
def _sum_f64(part: int, parts: int, argv: int) -> None:
    _sum(argv, part, parts, np.float64)


# The dtypes gemv has a kernel for (a, b and out all of one of them).
TASKS: dict[np.dtype[Any], pool.Task] = {np.dtype(np.float32): _gemv_f32, np.dtype(np.float64): _gemv_f64}
SUM_TASKS: dict[np.dtype[Any], pool.Task] = {np.dtype(np.float32): _sum_f32, np.dtype(np.float64): _sum_f64}


@njit(cache=True)
def _fill(a: Any, b: Any, out: Any, acc: Any, tile: int, chunk: int, split: int, argv: Any) -> None:
    r = argv[0]
    r.a, r.b, r.out, r.acc = a.ctypes.data, b.ctypes.data, out.ctypes.data, acc.ctypes.data
    r.m, r.k, r.n, r.tile, r.chunk, r.split = a.shape[0], a.shape[1], b.shape[1], tile, chunk, split


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


def gemv_job(a: np.ndarray, b: np.ndarray, out: np.ndarray, op: str = "gemv") -> jobs.Jobs:
    """The job of out [M, N] <- a [M, K] @ b [K, N], all C-contiguous and of one dtype of `TASKS` (else a
    KernelError naming `op`). A weight of at least SPLIT_MIN_BYTES in fewer than SPLIT_BELOW_TILES column
    tiles (a few rows of a narrow weight: one tile would be one thread) is two jobs: the (tile, row range)
    items, then their partial sums added in order, the very additions one job makes."""
    task = _task_for(op, a, b, out, TASKS, out_raw=True)
    m, n = out.shape
    tile = column_tile(m)
    tiles = -(-n // tile)
    split = int(tiles < SPLIT_BELOW_TILES and b.nbytes >= SPLIT_MIN_BYTES)
    argv = jobs.argv_of(GEMV_ARGS)
    acc = np.empty((K_SPLIT, m, n) if split else (m, n), out.dtype)
    chunk = CHUNK_ROWS if m >= BLOCK_ROWS else max(1, a.shape[1])  # a sweep alone needs no chunks
    _fill(a, b, out, acc, tile, chunk, split, argv)
    sums = out.size * K_SPLIT * SUM_SECONDS_PER_VALUE
    seconds = b.nbytes / SERIAL_BYTES_PER_SECOND
    if not split:
        return jobs.job(task, argv, seconds + sums, max(1, min(MOST_PARTS, tiles)), keep=(acc,))
    sum_argv = jobs.argv_of(SUM_ARGS)
    sum_argv[0] = (acc.ctypes.data, out.ctypes.data, out.size)
    return (jobs.job(task, argv, seconds, min(MOST_PARTS, tiles * K_SPLIT), keep=(acc,)),
            jobs.job(SUM_TASKS[out.dtype], sum_argv, sums, max(1, out.size // SUM_PIECE), keep=(acc,)))


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
