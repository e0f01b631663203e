"""BLAS products whose bytes do not depend on the thread count: `out <- a @ b` as one-thread OpenBLAS calls
on fixed pieces of the output, the pieces spread over fuel's threads.

Why: OpenBLAS's own threading cuts a GEMM over M and N by its thread count, and with some of its kernels an
element's sum then depends on the cut (docs/performance/runtime.md, "row_blocks"). A piece here is one
one-thread call whose shape is fixed by the product's (`pieces`), so whichever thread runs it, its bytes
are the same.

f32 and f64 products BLAS can address run their pieces as one job of the spinning pool, each piece a
`cblas_?gemm` (or the `cblas_?gemv` NumPy's matmul would call for a one-row piece) made from jitted code
(`fuel.cpu.simd.sgemm`). Other dtypes and layouts run the same pieces as NumPy calls in the calling thread.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.simd.sgemm import dgemm, dgemv_t, sgemm, sgemv_t
from fuel.runtime import jobs, pool, threads
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import ADDRESS, INT, record_at

PARTS = 4  # pieces a product is cut into, or a multiple of it: even, so two (or four) threads stay balanced
COLS = 64  # at least this many output columns a piece when columns are cut
FEW_ROWS = 16  # fewer output rows: NumPy's calls (gemv for one row), not the jitted sgemm's
WIDE = 16384  # columns a piece has at most (a 262144-column LM head: 16 pieces)
FLOPS_PER_SECOND = 60e9  # one core's sgemm rate at these shapes, for the pool's part count


def pieces(m: int, n: int) -> tuple[int, int]:
    """(rows, columns) of each piece of an [m, n] output.

    Columns are cut, into PARTS pieces (more for a wide output), so that each piece packs only its own
    columns of B and the rows of A, which BLAS repacks per block of columns anyway; an output too
    narrow for that has its rows cut instead. The count is a multiple of PARTS: a count two threads cannot
    share evenly costs a third of the speed (docs/performance/runtime.md, "row_blocks"). A few-row
    product (decode-sized) is one piece unless its columns are an LM head's."""
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


# Products of `batches` items (byte strides between items' A, B and C), each cut into pieces of
# piece_rows x piece_cols. `gemm` and `gemv` are the BLAS routines' addresses: with `gemv` 0 every piece is
# a gemm, else a one-row piece is a transposed gemv, the call NumPy's matmul makes for a vector @ matrix.
PIECES_ARGS = jobs.record(a=ADDRESS, b=ADDRESS, c=ADDRESS, bias=ADDRESS, gemm=ADDRESS, gemv=ADDRESS, batches=INT,
                          a_batch=INT, b_batch=INT, c_batch=INT, m=INT, n=INT, k=INT, lda=INT, ldb=INT, ldc=INT,
                          trans=INT, piece_rows=INT, piece_cols=INT)


@njit(inline="always", cache=True)
def _pieces(part: int, parts: int, argv: int, dt: Any, size: int) -> None:
    """This part's share of the fixed pieces of every item, elements of type dt (`size` bytes)."""
    v = record_at(argv, PIECES_ARGS)
    m, n, pr, pc, ldc = v.m, v.n, v.piece_rows, v.piece_cols, v.ldc
    across = -(-n // pc)
    per_item = -(-m // pr) * across
    count = v.batches * per_item
    for t in range(part * count // parts, (part + 1) * count // parts):
        i, u = t // per_item, t % per_item
        r0, c0 = u // across * pr, u % across * pc
        rows, cols = min(pr, m - r0), min(pc, n - c0)
        at_a = v.a + i * v.a_batch + size * r0 * (1 if v.trans & 2 else v.lda)
        at_b = v.b + i * v.b_batch + size * c0 * (v.ldb if v.trans & 1 else 1)
        at_c = v.c + i * v.c_batch + size * (r0 * ldc + c0)
        if rows == 1 and v.gemv:
            if size == 8:
                dgemv_t(v.gemv, v.trans & 1, v.k, cols, at_b, v.ldb, at_a, 1, at_c, 1)
            else:
                sgemv_t(v.gemv, v.trans & 1, v.k, cols, at_b, v.ldb, at_a, 1, at_c, 1)
        elif size == 8:
            dgemm(v.gemm, v.trans, 0, rows, cols, v.k, at_a, v.lda, at_b, v.ldb, at_c, ldc)
        else:
            sgemm(v.gemm, v.trans, 0, rows, cols, v.k, at_a, v.lda, at_b, v.ldb, at_c, ldc)
        if v.bias:  # added to the piece while it is in cache: the same sums as NumPy's add after the product
            bias = carray(pointer(v.bias + size * c0, dt), (cols,))
            for r in range(rows):
                row = carray(pointer(at_c + size * r * ldc, dt), (cols,))
                for j in range(cols):
                    row[j] += bias[j]


@pool.task()
def _pieces_f32(part: int, parts: int, argv: int) -> None:
    _pieces(part, parts, argv, np.float32, 4)


@pool.task()
def _pieces_f64(part: int, parts: int, argv: int) -> None:
    _pieces(part, parts, argv, np.float64, 8)


# Per dtype the task jitted code runs and the BLAS routines it calls.
_ROUTINES = {np.dtype(np.float32): (_pieces_f32, "sgemm", "sgemv"),
             np.dtype(np.float64): (_pieces_f64, "dgemm", "dgemv")}


def _layout(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> tuple[int, int, int, int] | None:
    """(lda, ldb, trans, ldc) in elements where BLAS can read a [m, k] (row-major, or column-major as a
    transposed [k, m]: trans bit 1, a weight gradient's `xᵀ @ g`), b [k, n] (row-major, or column-major as a
    transposed [n, k]: trans bit 0) and write out [m, n] (row-major) in place, as NumPy's matmul would call
    it; None otherwise."""
    e = out.itemsize
    if out.strides[1] != e or out.strides[0] % e or out.strides[0] < e * out.shape[1]:
        return None
    if a.strides[1] == e and a.strides[0] % e == 0 and a.strides[0] >= e * a.shape[1]:
        lda, trans_a = a.strides[0] // e, 0
    elif a.strides[0] == e and a.strides[1] % e == 0 and a.strides[1] >= e * a.shape[0] and a.shape[0] > 1:
        lda, trans_a = a.strides[1] // e, 2
    else:
        return None
    if b.strides[1] == e and b.strides[0] % e == 0 and b.strides[0] >= e * b.shape[1]:
        return lda, b.strides[0] // e, trans_a, out.strides[0] // e
    if b.strides[0] == e and b.strides[1] % e == 0 and b.strides[1] >= e * b.shape[0]:
        return lda, b.strides[1] // e, trans_a | 1, out.strides[0] // e
    return None


def _items(x: np.ndarray, lead: tuple[int, ...]) -> tuple[np.ndarray, int] | None:
    """x broadcast over the leading dims `lead` as one [items, r, c] view and its item stride in bytes, or
    None where those dims do not merge into one stride."""
    v = np.broadcast_to(x, lead + x.shape[-2:]).view()
    try:
        v.shape = (-1, *x.shape[-2:])  # raises where the leading dims need a copy to merge
    except AttributeError:
        return None
    items = int(v.shape[0])
    return v[0], int(v.strides[0]) if items > 1 else 0


def pieces_job(a: np.ndarray, b: np.ndarray, out: np.ndarray, bias: np.ndarray | None) -> jobs.Job | None:
    """The job of `matmul`'s pieces where the task serves the call (f32 or f64 operands BLAS can address,
    bias None or a vector of out's dtype), else None. Batched products are an item each, as NumPy's matmul
    runs them. The pieces make NumPy's calls: gemm, and gemv for a one-row piece. A product NumPy would make
    otherwise (a one-column piece, K under 2, a @ aᵀ by syrk) is None. f32 products of FEW_ROWS rows or
    more with out C-contiguous take gemm for every piece, their one-row pieces included."""
    found = _ROUTINES.get(out.dtype)
    if found is None or a.dtype != out.dtype or b.dtype != out.dtype or a.ndim < 2 or b.ndim < 2:
        return None
    if bias is not None and (bias.dtype != out.dtype or bias.shape != out.shape[-1:]):
        return None
    task, gemm_name, gemv_name = found
    m, n = out.shape[-2:]
    k = a.shape[-1]
    if out.ndim == 2:
        (pr, pc), batches, strides = pieces(m, n), 1, (0, 0, 0)
        a2, b2, o2 = a, b, out
    else:
        lead = out.shape[:-2]
        ia, ib, io = _items(a, lead), _items(b, lead), _items(out, lead)
        if ia is None or ib is None or io is None:
            return None
        (a2, sa), (b2, sb), (o2, so) = ia, ib, io
        (pr, pc), batches, strides = (m, n), math.prod(lead), (sa, sb, so)
    layout = _layout(a2, b2, o2)
    if layout is None or k == 0:
        return None
    gemm = threads.blas_sgemm_address() if gemm_name == "sgemm" else threads.blas_address(gemm_name)
    every_piece_gemm = out.ndim == 2 and out.dtype == np.float32 and out.flags.c_contiguous and m >= FEW_ROWS
    gemv = 0 if every_piece_gemm else threads.blas_address(gemv_name)
    last_cols = n - (-(-n // pc) - 1) * pc
    if not gemm or not (every_piece_gemm or (gemv and k >= 2 and min(pc, last_cols) >= 2
                                             and not np.may_share_memory(a, b))):
        return None
    lda, ldb, trans, ldc = layout
    if trans & 2 and gemv:  # a one-row piece of a transposed A is a strided vector: NumPy's calls serve it
        return None
    vec = None if bias is None else np.ascontiguousarray(bias)
    argv = jobs.argv_of(PIECES_ARGS)
    argv[0] = (a2.ctypes.data, b2.ctypes.data, o2.ctypes.data, 0 if vec is None else vec.ctypes.data, gemm, gemv,
               batches, *strides, m, n, k, lda, ldb, ldc, trans, pr, pc)
    count = batches * -(-m // pr) * -(-n // pc)
    seconds = 2 * batches * m * n * k / FLOPS_PER_SECOND
    return jobs.job(task, argv, seconds, count, keep=() if vec is None else (vec,))


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray, bias: np.ndarray | None = None) -> None:
    """out <- a @ b (+ bias, a vector over out's last dim, of out's dtype) with np.matmul's broadcasting (out
    given, of the broadcast shape). The bias is added to each piece after its product: the same bytes as
    NumPy adding it to the whole product."""
    if out.size == 0:
        return
    if out.ndim <= 2 and (a.ndim < 2 or b.ndim < 2 or pieces(*out.shape) == out.shape):
        # One piece (a vector operand, or too few rows and columns to cut): NumPy's own one-thread call,
        # which takes gemv for one row (see docs/performance/runtime.md, "row_blocks").
        with threads.one_blas_thread():
            np.matmul(a, b, out=out)
        _add(out, bias)
        return
    found = pieces_job(a, b, out, bias)
    with threads.one_blas_thread():  # BLAS inside a task, and NumPy's calls for the same pieces below
        if found is not None:
            jobs.run(found)
        else:
            _pieces_here(a, b, out, bias)


def _pieces_here(a: np.ndarray, b: np.ndarray, out: np.ndarray, bias: np.ndarray | None) -> None:
    """`matmul`'s pieces as NumPy calls in this thread, for products the task does not serve (integers,
    layouts BLAS cannot address): the same pieces, so the same bytes."""
    if out.ndim == 2:
        m, n = out.shape
        pr, pc = pieces(m, n)
        for r0 in range(0, m, pr):
            for c0 in range(0, n, pc):
                piece = out[r0:r0 + pr, c0:c0 + pc]
                np.matmul(a[r0:r0 + pr], b[:, c0:c0 + pc], out=piece)
                _add(piece, None if bias is None else bias[c0:c0 + pc])
        return
    lead = out.shape[0]
    a1 = a.reshape((1,) * (out.ndim - a.ndim) + a.shape) if a.ndim < out.ndim else a
    b1 = b.reshape((1,) * (out.ndim - b.ndim) + b.shape) if b.ndim < out.ndim else b
    for i in range(lead):
        np.matmul(a1[i if a1.shape[0] == lead else 0], b1[i if b1.shape[0] == lead else 0], out=out[i])
        _add(out[i], bias)


def _add(out: np.ndarray, bias: np.ndarray | None) -> None:
    if bias is not None:
        np.add(out, bias, out=out)
