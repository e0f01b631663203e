"""`out <- a @ b` for an f32 2-D weight b, every output row the same bytes at any row count: the weight's
columns copied tile by tile into `weight_tiles`' scratch and multiplied by fuel's tile GEMM (`tile_gemm`),
as QMatMul's many-row path multiplies its dequantised tiles.

Why: an OpenBLAS sgemm rounds a row differently as the row count changes (its edge kernels, and its
blocking), so a sentence's embedding would depend on the sentences batched with it. Here each element is
one chain of fused multiply-adds over k blocks, fixed by k alone (`tile_gemm`'s contract): whatever the row
count, the row's position, the tiling or the thread count. Rows go `weight_tiles.OWN_MAX_ROWS` at a time
(the tile kernel's bound), each chunk its own product, so the contract holds at any row count.

`AVAILABLE` is False on hosts without AVX2 and FMA (no tile kernel): callers keep their BLAS products there.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.quant.weight_tiles import (
    OWN_KERNEL,
    OWN_MAX_ROWS,
    each_tile,
    tile_args,
    tiles_jobs,
)
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer

AVAILABLE = OWN_KERNEL


@pool.task()
def _f32_tiles(part: int, parts: int, argv: int) -> None:
    """Part `part` of the product (`weight_tiles`' tile job): tiles of b's columns claimed one at a time,
    each copied into the part's scratch slot as rows (tile row j = column r0 + j of b) and multiplied. b's
    fields: weight (its address), weight_cols (its row stride in elements), scale_cols (its column stride),
    scales (its extent in elements)."""
    v = tile_args(argv)
    each_tile(v, _columns, 0, (carray(pointer(v.weight, np.float32), (v.scales,)), v.weight_cols, v.scale_cols, v.k))


@njit(inline="always", cache=True)
def _columns(tile: Any, r0: int, r1: int, how: int, state: Any) -> None:
    """tile row j <- column r0 + j of b (state: b's elements, its row and column strides, k)."""
    b, rs, cs, k = state
    for r in range(r0, r1):
        for kk in range(k):
            tile[r - r0, kk] = b[kk * rs + r * cs]


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out [R, n] <- a [R, k] @ b [k, n], f32, every row the same bytes at any R; a and out C-contiguous, b any
    layout with non-negative strides (a transposed view `w.T` reads w's rows). Needs `AVAILABLE`."""
    rows, k = a.shape
    n = b.shape[1]
    if rows == 0 or n == 0:
        return
    if k == 0:
        out.fill(0)
        return
    rs, cs = (s // b.itemsize for s in b.strides)
    weight: Any = (b.ctypes.data, rs, (k - 1) * rs + (n - 1) * cs + 1, cs)  # address, strides, extent
    for r0 in range(0, rows, OWN_MAX_ROWS):
        r1 = min(rows, r0 + OWN_MAX_ROWS)
        found = tiles_jobs(_f32_tiles, a[r0:r1], n, out[r0:r1], weight)
        assert found is not None, "dense_tiles: the tile kernel multiplies every chunk (own mode)"
        jobs.run(found)
