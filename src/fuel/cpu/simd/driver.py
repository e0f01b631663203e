"""The shared row driver: every Numba kernel is a row-parallel loop with a serial path for free.

A kernel is written once, as a function whose outer loop is `prange` over independent rows (or
chunks of rows, see `chunk_count`/`chunk_bounds`), and decorated with `row_kernel(...)`. The
serial path is the same compiled code run on one thread: for a plan step whose cost is below the
parallel threshold, the executor sets Numba's thread count to one (`fuel.runtime.threads`), and
the loop then runs entirely in the calling thread without waking the pool. Each row is computed by
the same machine code whichever the path, so both give the same bytes; a separately compiled
serial twin did not (LLVM vectorised a row's reductions differently in the two compilations).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from numba import njit

CHUNKS = 256


def row_kernel(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """Decorate a `prange` kernel: Numba options as for `njit` (e.g. `fastmath`); cached and parallel."""
    return njit(cache=True, parallel=True, **options)


@njit(inline="always", cache=True)
def chunk_count(rows: int) -> int:
    """How many chunks a kernel with per-chunk scratch splits `rows` into (a fixed number: the split,
    and so the scratch each row sees, does not depend on the thread count)."""
    return min(rows, CHUNKS)


@njit(inline="always", cache=True)
def chunk_bounds(c: int, rows: int, chunks: int) -> tuple[int, int]:
    """Rows [lo, hi) of chunk c."""
    return c * rows // chunks, (c + 1) * rows // chunks


@njit(inline="always", cache=True)
def pair_chunk_count(rows: int) -> int:
    """How many fixed chunks a kernel taking rows two at a time splits `rows` into: whole pairs, so that
    no chunk of one row (`chunk_bounds`' up to CHUNKS rows) goes as a pair with itself, twice its work."""
    return min((rows + 1) // 2, CHUNKS)


@njit(inline="always", cache=True)
def pair_bounds(c: int, rows: int) -> tuple[int, int]:
    """Rows [lo, hi) of chunk c of `pair_chunk_count(rows)`: whole pairs, but the last chunk's odd row."""
    pairs, chunks = (rows + 1) // 2, pair_chunk_count(rows)
    return 2 * (c * pairs // chunks), min(rows, 2 * ((c + 1) * pairs // chunks))


# The least distance, in bytes, at which a one-row decoder's row pairs prefetch the rows ahead (`ahead_of`).
PF = 4096


@njit(inline="always", cache=True)
def ahead_of(pair_bytes: int) -> int:
    """How far on from a pair of adjacent W rows (pair_bytes long) the pair a one-row decoder prefetches
    starts: the next pair, or the first whole pair at least PF bytes on: the next pair of short rows is too
    near (docs/performance/runtime.md, "driver")."""
    return pair_bytes * max(1, -(-PF // pair_bytes))
