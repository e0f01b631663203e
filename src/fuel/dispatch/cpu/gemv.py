"""Products of a few rows with a weight matrix (decode-sized MATMUL): one serial pass over the weight.

At decode sizes a matrix product streams a weight `[K, N]` from memory to make one to four rows. Run
through OpenBLAS, each call pays its thread hand-off: measured on a 2-core machine with the weights
cold, `[1, 576] @ [576, 576]` took 101 µs and `@ [576, 192]` 44 µs, against 56 µs and 17 µs for this
loop in the calling thread. In the SmolLM2-shaped decode step (weights up to 3.5 MB, interleaved in
one process) the step took 36.4 ms with every product on OpenBLAS, 32.5 ms with this loop for weights
up to 2 MB and 30.8 ms with it for all of them. Past `GEMV_MAX_BYTES` (not measured) the BLAS keeps
them: two threads may stream a large weight faster than one.

Each output row accumulates `a[i, k] * b[k, :]` over k in order, in the working type (f32, or f64
for f64), one thread: the bytes never depend on the thread count.
"""

from __future__ import annotations

from typing import Any

from numba import njit

GEMV_MAX_ROWS = 4
GEMV_MAX_BYTES = 8 << 20


@njit(cache=True, fastmath={"contract"})
def gemv(a: Any, b: Any, out: Any) -> None:
    """out [M, N] <- a [M, K] @ b [K, N], b row-major; each weight row is read once for all M rows."""
    m, k = a.shape
    n = b.shape[1]
    for i in range(m):
        for j in range(n):
            out[i, j] = 0
    for kk in range(k):
        brow = b[kk]
        for i in range(m):
            av = a[i, kk]
            y = out[i]
            for j in range(n):
                y[j] += av * brow[j]
