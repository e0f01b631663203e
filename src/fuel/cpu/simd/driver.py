"""Fixed chunks of rows: the work items of a task whose bytes depend on how rows are grouped.

A kernel's task (`fuel.runtime.pool`) does its share `[part·n//parts, (part+1)·n//parts)` of a fixed list of
work items. Where an item's bytes depend on how rows are grouped (per-chunk scratch, a pair of rows decoded
together), the items are the chunks below: their count depends on the row count only, never on the thread
count or the part count, so every split gives the same bytes.
"""

from __future__ import annotations

from numba import njit

CHUNKS = 256  # chunks at most: enough for any part count the pool cuts a job into


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
