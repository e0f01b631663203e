"""conv2d_tasks: `product` makes the BLAS call np.matmul makes (gemm either layout, the transposed gemvs of
a one-row or one-column product, NumPy's own loop for a one-deep one), so a block's bytes are NumPy's; and
Conv2D's jobs (direct loop, padded planes, blocks of every gather form) write the same bytes at any part
count, matching torch's float64 conv2d per element."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from numba import njit

from fuel.cpu.conv import conv2d, conv2d_tasks
from fuel.runtime import pool, threads


@njit
def _product(gemm: int, gemv: int, wide: bool, k: int, a: Any, a_m: int, a_k: int, b: Any, b_k: int, b_n: int,
             c: Any) -> None:
    m, n = c.shape
    conv2d_tasks.product(gemm, gemv, wide, m, n, k, a.ctypes.data, a_m, a_k, b.ctypes.data, b_k, b_n,
                         c.ctypes.data, n, c.dtype.type)


def _operand(rng: np.random.Generator, rows: int, cols: int, dtype: Any, transposed: bool) -> tuple[Any, ...]:
    """A [rows, cols] operand stored row-major (or column-major where transposed) inside a wider array:
    (the view np.matmul gets, the storage, its element strides along rows and columns)."""
    if transposed:
        store = rng.standard_normal((cols, rows + 3)).astype(dtype)
        return store[:, :rows].T, store, 1, rows + 3
    store = rng.standard_normal((rows, cols + 3)).astype(dtype)
    return store[:, :cols], store, cols + 3, 1


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("m", "k", "n"), [(7, 13, 9), (7, 13, 1), (1, 13, 9), (7, 1, 9), (1, 1, 9), (5, 1, 1),
                                           (40, 300, 70)])
@pytest.mark.parametrize("a_t", [False, True])
@pytest.mark.parametrize("b_t", [False, True])
def test_product_is_numpys_call(dtype: Any, m: int, k: int, n: int, a_t: bool, b_t: bool) -> None:
    rng = np.random.default_rng(m * 100 + k * 10 + n)
    a, a_store, a_m, a_k = _operand(rng, m, k, dtype, a_t)
    b, b_store, b_k, b_n = _operand(rng, k, n, dtype, b_t)
    want = np.empty((m, n), dtype)
    with threads.one_blas_thread():
        np.matmul(a, b, out=want)
        got = np.full((m, n), np.nan, dtype)
        wide = dtype == np.float64
        names = ("dgemm", "dgemv") if wide else ("sgemm", "sgemv")
        _product(threads.blas_address(names[0]), threads.blas_address(names[1]), wide, k, a_store, a_m, a_k,
                 b_store, b_k, b_n, got)
    assert got.tobytes() == want.tobytes()


# (x shape, w shape, stride, padding, groups, dilation): direct loop, unit-stride blocks with padding, strided
# runs, the transposed gather (kernel wider than the output), K cut into blocks, one-column last block
CASES = [((2, 8, 12, 12), (8, 1, 3, 3), 1, 1, 8, 1), ((2, 6, 10, 11), (9, 6, 3, 3), 1, 1, 1, 1),
         ((2, 16, 17, 19), (24, 16, 3, 3), 2, 1, 1, 1), ((2, 8, 9, 9), (6, 8, 7, 7), 1, 0, 1, 1),
         ((1, 260, 6, 6), (8, 260, 3, 3), 1, 1, 1, 1), ((1, 6, 5, 1029), (10, 6, 1, 3), (1, 2), 0, 1, 1)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_jobs_match_torch_at_every_part_count(dtype: Any, case: tuple[Any, ...]) -> None:
    xs, ws, s, p, g, d = case
    rng = np.random.default_rng(7)
    x, w = rng.standard_normal(xs).astype(dtype), rng.standard_normal(ws).astype(dtype)
    bias = rng.standard_normal(ws[0]).astype(dtype)
    t = [torch.from_numpy(v.astype(np.float64)) for v in (x, w, bias)]
    want = F.conv2d(t[0], t[1], t[2], s, p, d, g).numpy()
    scale = F.conv2d(t[0].abs(), t[1].abs(), t[2].abs(), s, p, d, g).numpy()
    stride = (s, s) if isinstance(s, int) else s
    out = np.empty(want.shape, dtype)
    found = conv2d.conv2d_jobs(x, w, bias, out, g, stride, (d, d), p, p)
    got = set()
    with threads.one_blas_thread():
        for parts in (1, 2, 3, 7):
            out[...] = np.nan
            for job in found:
                pool.run_address(job.task, job.args, min(parts, job.most))
            got.add(out.tobytes())
    assert len(got) == 1
    unit = np.finfo(dtype).eps
    assert (np.abs(out - want) <= unit * np.abs(want) + 2 * unit * ws[1] * ws[2] * ws[3] * scale).all()
