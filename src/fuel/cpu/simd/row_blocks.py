"""BLAS products whose bytes do not depend on the thread count: `out <- a @ b` as one-thread OpenBLAS GEMMs
on fixed pieces of the output, the pieces spread over fuel's threads.

Why: OpenBLAS's own threading cuts a GEMM over M and N by its thread count, and with its Haswell kernels
(AVX2 hosts) an element's sum then depends on the cut. On Zen 3 (OpenBLAS 0.3.31), [64, 256] @ [256, 48]
differed in 670 of 3072 elements between one and two BLAS threads, and MiniLM's [400, 384] @ [384, 1536]
in 38355; its SkylakeX kernels (AVX-512 hosts) agreed. A piece here is one one-thread call whose shape is
fixed by the product's (`pieces`), so whichever thread runs it, its bytes are the same.

A 2-D f32 product runs its pieces as a task of the spinning pool, each a `cblas_sgemm` called from jitted
code (`sgemm`: a job joins in microseconds, where `split_work`'s Python threads cost ~55 µs and a batch-1
MiniLM projection is ~100 µs of work). Other dtypes, batches and layouts BLAS cannot address take
`split_work` with the same pieces.
"""

from __future__ import annotations

import numpy as np
from numba import carray

from fuel.cpu.simd.sgemm import sgemm
from fuel.runtime import pool, threads
from fuel.runtime.atomics import pointer
from fuel.runtime.threads import split_work

PARTS = 4  # pieces a product is cut into, or a multiple of it: even, so two (or four) threads stay balanced
COLS = 64  # at least this many output columns a piece when columns are cut
FEW_ROWS = 16  # fewer output rows: NumPy's calls (gemv for one row), not the jitted sgemm's
WIDE = 16384  # columns a piece has at most (a 262144-column LM head: 16 pieces)
FLOPS_PER_SECOND = 60e9  # one core's sgemm rate at these shapes, for the pool's part count


def pieces(m: int, n: int) -> tuple[int, int]:
    """(rows, columns) of each piece of an [m, n] output.

    Columns are cut, into PARTS pieces (more for a wide output), so that each piece packs only its own
    columns of B and the rows of A, which BLAS repacks per block of columns anyway; an output too
    narrow for that has its rows cut instead. A count of pieces that two threads cannot share evenly
    costs a third: [544, 384] @ [384, 1536] ran at 125 GFLOP/s as 3 row pieces, 170 as 2 or 4.
    A few-row product (decode-sized) is one piece unless its columns are an LM head's."""
    if m < FEW_ROWS:
        return (m, _rounded(n, -(-n // 32768))) if n >= 65536 else (m, n)
    if n >= PARTS * COLS:
        return m, _rounded(n, PARTS * -(-n // (PARTS * WIDE)))
    if m >= PARTS * FEW_ROWS:
        return _rounded(m, PARTS), n
    return m, n


def _rounded(size: int, count: int) -> int:
    """size / count rounded up to a multiple of 16."""
    return (-(-size // count) + 15) // 16 * 16


# argv of `_pieces_task`: addresses of A, B, C, the bias (0: none) and sgemm, then sizes, leading dimensions
# and the piece size
A, B, C, BIAS, SGEMM, M, N, K, LDA, LDB, LDC, TRANS_B, PR, PC = range(14)


@pool.task()
def _pieces_task(part: int, parts: int, argv: int) -> None:
    v = carray(pointer(argv, np.int64), (14,))
    m, n, pr, pc, ldc = v[M], v[N], v[PR], v[PC], v[LDC]
    across = -(-n // pc)
    count = -(-m // pr) * across
    for t in range(part * count // parts, (part + 1) * count // parts):
        r0, c0 = t // across * pr, t % across * pc
        rows, cols = min(pr, m - r0), min(pc, n - c0)
        b_at = v[B] + 4 * c0 * (v[LDB] if v[TRANS_B] else 1)
        sgemm(v[SGEMM], v[TRANS_B], 0, rows, cols, v[K], v[A] + 4 * r0 * v[LDA], v[LDA], b_at, v[LDB],
              v[C] + 4 * (r0 * ldc + c0), ldc)
        if v[BIAS]:  # added to the piece while it is in cache: the same sums as NumPy's add after the product
            bias = carray(pointer(v[BIAS] + 4 * c0, np.float32), (cols,))
            for r in range(rows):
                row = carray(pointer(v[C] + 4 * ((r0 + r) * ldc + c0), np.float32), (cols,))
                for j in range(cols):
                    row[j] += bias[j]


def _sgemm_layout(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> tuple[int, int, int] | None:
    """(lda, ldb, trans_b) where cblas_sgemm can read a (row-major), b (row-major, or column-major as a
    transposed [n, k]) and write out (C-contiguous) in place; None otherwise."""
    f4 = np.dtype(np.float32)
    if not (a.dtype == b.dtype == out.dtype == f4 and a.ndim == b.ndim == 2 and out.flags.c_contiguous):
        return None
    if a.strides[1] != 4 or a.strides[0] % 4 or a.strides[0] < 4 * a.shape[1]:
        return None
    if b.strides[1] == 4 and b.strides[0] % 4 == 0 and b.strides[0] >= 4 * b.shape[1]:
        return a.strides[0] // 4, b.strides[0] // 4, 0
    if b.strides[0] == 4 and b.strides[1] % 4 == 0 and b.strides[1] >= 4 * b.shape[0]:
        return a.strides[0] // 4, b.strides[1] // 4, 1
    return None


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray, bias: np.ndarray | None = None) -> None:
    """out <- a @ b (+ bias, a vector over out's last dim, of out's dtype) with np.matmul's broadcasting (out
    given, of the broadcast shape). The bias is added to each piece after its product: the same bytes as
    NumPy adding it to the whole product."""
    if out.size == 0:
        return
    if out.ndim <= 2 and (a.ndim < 2 or b.ndim < 2 or pieces(*out.shape) == out.shape):
        # One piece (a vector operand, or too few rows and columns to cut): NumPy's own one-thread call,
        # which takes gemv for one row ([1, 640] @ [640, 2048]: 0.09 ms, 0.28 through the jitted sgemm).
        with threads.one_blas_thread():
            np.matmul(a, b, out=out)
        _add(out, bias)
        return
    if out.ndim == 2:
        m, n = out.shape
        pr, pc = pieces(m, n)
        layout = _sgemm_layout(a, b, out) if a.shape[1] and m >= FEW_ROWS else None
        address = threads.blas_sgemm_address() if layout is not None else 0
        if layout is not None and address and (bias is None or bias.dtype == out.dtype):
            lda, ldb, trans_b = layout
            vec = None if bias is None else np.ascontiguousarray(bias)
            argv = np.array([a.ctypes.data, b.ctypes.data, out.ctypes.data, 0 if vec is None else vec.ctypes.data,
                             address, m, n, a.shape[1], lda, ldb, n, trans_b, pr, pc], np.int64)
            count = -(-m // pr) * -(-n // pc)
            seconds = 2 * m * n * a.shape[1] / FLOPS_PER_SECOND
            with threads.one_blas_thread():
                pool.run(_pieces_task, argv, pool.parts_for(seconds, count, 1))
            return
        across = -(-n // pc)

        def blocks(tasks: range) -> None:
            for t in tasks:
                r0, c0 = t // across * pr, t % across * pc
                piece = out[r0:r0 + pr, c0:c0 + pc]
                np.matmul(a[r0:r0 + pr], b[:, c0:c0 + pc], out=piece)
                _add(piece, None if bias is None else bias[c0:c0 + pc])

        split_work(blocks, -(-m // pr) * across)
        return
    lead = out.shape[0]
    a1 = a.reshape((1,) * (out.ndim - a.ndim) + a.shape) if a.ndim < out.ndim else a
    b1 = b.reshape((1,) * (out.ndim - b.ndim) + b.shape) if b.ndim < out.ndim else b

    def batch(tasks: range) -> None:
        for i in tasks:
            np.matmul(a1[i if a1.shape[0] == lead else 0], b1[i if b1.shape[0] == lead else 0], out=out[i])
            _add(out[i], bias)

    split_work(batch, lead)


def _add(out: np.ndarray, bias: np.ndarray | None) -> None:
    if bias is not None:
        np.add(out, bias, out=out)
