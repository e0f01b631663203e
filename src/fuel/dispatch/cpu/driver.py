"""The shared row driver: every Numba kernel is a row-parallel loop with a serial path for free.

A kernel is written once, as a function whose outer loop is `prange` over independent rows (or
chunks of rows, see `chunk_count`/`chunk_bounds`), and decorated with `row_kernel(...)`. The
serial path is the same compiled code run on one thread: for a plan step whose cost is below the
parallel threshold, the executor sets Numba's thread count to one (`fuel.dispatch.threads`), and
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
