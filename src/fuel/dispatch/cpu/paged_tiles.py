"""PagedAttn's inner tiles: the scores of one key for the G query heads of a kv head, and the
probability-weighted V update, written so LLVM overlaps several rows' work (shared loads, independent
reductions). Scores are key-major (`buf[t, row]`): one key's scores are a contiguous write, where
row-major rows 8 KiB apart all fell in one L1 set.
"""

from __future__ import annotations

from typing import Any

from numba import njit

from fuel.dispatch.cpu.vecmath import cast_like

# As paged_attention's: reassociation lets the reductions vectorise (one fixed order per build).
FASTMATH = {"nsz", "reassoc", "contract", "arcp"}


@njit(inline="always", cache=True, fastmath=FASTMATH)
def dots(qw: Any, base: Any, g: int, krow: Any, buf: Any, t: Any) -> None:
    """buf[t, base + j] <- qw[base + j]·krow for j < g (the G query heads of one kv head and query). Four
    rows share each pass over krow: their four reductions overlap (1.6x faster than one row at a time
    for D 64). A row's path depends only on j, so its bytes do not depend on how tasks are cut."""
    g4 = g - g % 4
    for j in range(0, g4, 4):
        r = base + j
        a0 = a1 = a2 = a3 = cast_like(0, buf[t, r])
        for d in range(krow.shape[0]):
            x = krow[d]
            a0 += qw[r, d] * x
            a1 += qw[r + 1, d] * x
            a2 += qw[r + 2, d] * x
            a3 += qw[r + 3, d] * x
        buf[t, r], buf[t, r + 1], buf[t, r + 2], buf[t, r + 3] = a0, a1, a2, a3
    for r in range(base + g4, base + g):
        a = cast_like(0, buf[t, r])
        for d in range(krow.shape[0]):
            a += qw[r, d] * krow[d]
        buf[t, r] = a


@njit(inline="always", cache=True, fastmath=FASTMATH)
def accumulate(acc: Any, base: Any, g: int, buf: Any, t: Any, v0: Any) -> None:
    """acc[base + j] += P[base + j, t]·v0 for j < g (one key)."""
    for r in range(base, base + g):
        x = buf[t, r]
        a = acc[r]
        for d in range(v0.shape[0]):
            a[d] += x * v0[d]


@njit(inline="always", cache=True, fastmath=FASTMATH)
def accumulate2(acc: Any, base: Any, g: int, buf: Any, t: Any, v0: Any, v1: Any) -> None:
    """acc[base + j] += P[base + j, t]·v0 + P[base + j, t + 1]·v1 for j < g: two keys per pass over the
    accumulator halve its loads and stores (2x faster for D 64)."""
    for r in range(base, base + g):
        x, y = buf[t, r], buf[t + 1, r]
        a = acc[r]
        for d in range(v0.shape[0]):
            a[d] += x * v0[d] + y * v1[d]
