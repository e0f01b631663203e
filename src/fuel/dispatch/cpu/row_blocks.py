"""BLAS products whose bytes do not depend on the thread count: `out <- a @ b` as one-thread OpenBLAS GEMMs
on fixed pieces of the output (blocks of `ROWS` rows of a 2-D product, or the matrices of a batch), the
pieces spread over fuel's threads (`threads.split_work`).

Why: OpenBLAS's own threading cuts a GEMM over M and N by its thread count, and with its Haswell kernels
(AVX2 hosts) an element's sum then depends on the cut. On Zen 3 (OpenBLAS 0.3.31), [64, 256] @ [256, 48]
differed in 670 of 3072 elements between one and two BLAS threads, and MiniLM's [400, 384] @ [384, 1536]
in 38355; its SkylakeX kernels (AVX-512 hosts) agreed. A piece here is one one-thread call whose shape is
fixed by the product's, so whichever thread runs it, its bytes are the same.
"""

from __future__ import annotations

import numpy as np

from fuel.dispatch.threads import split_work

ROWS = 64  # output rows per piece of a 2-D product: about OpenBLAS's speed at full M, ~7 pieces for MiniLM


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out <- a @ b with np.matmul's broadcasting (out given, of the broadcast shape)."""
    if out.size == 0:
        return
    if out.ndim <= 2:
        m = out.shape[0] if out.ndim == 2 else 1
        whole = a.ndim == 1 or b.ndim == 1

        def rows(tasks: range) -> None:
            for t in tasks:
                if whole:
                    np.matmul(a, b, out=out)
                else:
                    np.matmul(a[t * ROWS:(t + 1) * ROWS], b, out=out[t * ROWS:(t + 1) * ROWS])

        split_work(rows, 1 if whole else -(-m // ROWS))
        return
    lead = out.shape[0]
    a1 = a.reshape((1,) * (out.ndim - a.ndim) + a.shape) if a.ndim < out.ndim else a
    b1 = b.reshape((1,) * (out.ndim - b.ndim) + b.shape) if b.ndim < out.ndim else b

    def batch(tasks: range) -> None:
        for i in tasks:
            np.matmul(a1[i if a1.shape[0] == lead else 0], b1[i if b1.shape[0] == lead else 0], out=out[i])

    split_work(batch, lead)
