"""`row_blocks.matmul`: products on fixed pieces, one BLAS thread each, against torch float64, and the same
bytes at one and two fuel threads and one and two BLAS threads (where OpenBLAS's own threading, with its
Haswell kernels, changed 1342 of [128, 256] @ [256, 48]'s elements)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from threadpoolctl import threadpool_limits

from fuel.cpu.simd import row_blocks
from fuel.dtype import DType
from fuel.runtime import threads
from fuel.testing.oracle import assert_close_contraction

SHAPES = [((128, 256), (256, 48)), ((197, 40), (40, 24)), ((40, 16), (16, 300)), ((1, 7), (7, 3)), ((7,), (7, 3)),
          ((5, 7), (7,)), ((2, 3, 70, 16), (16, 9)), ((2, 1, 9, 16), (3, 16, 5)), ((0, 4), (4, 6))]


@pytest.mark.parametrize(("sa", "sb"), SHAPES, ids=str)
def test_matches_float64_and_every_thread_count(sa: tuple[int, ...], sb: tuple[int, ...]) -> None:
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal(sa, dtype=np.float32), rng.standard_normal(sb, dtype=np.float32)
    a64, b64 = torch.from_numpy(a.astype(np.float64)), torch.from_numpy(b.astype(np.float64))
    want = torch.matmul(a64, b64).numpy()
    outs, before = set(), threads.get_num_threads()
    try:
        for n in (1, 2):
            threads.set_num_threads(n)
            for blas in (1, 2):
                with threadpool_limits(blas, "blas"):
                    out = np.full(want.shape, np.nan, np.float32)
                    row_blocks.matmul(a, b, out)
                outs.add(out.tobytes())
    finally:
        threads.set_num_threads(before)
    assert len(outs) == 1
    assert_close_contraction(out, want, torch.matmul(a64.abs(), b64.abs()).numpy(), DType.F32)


def test_transposed_and_sliced_operands() -> None:
    """x @ w.T (BLAS's trans flag) and a column slice of the output, as Nf4Matmul's gradient writes."""
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((150, 33), dtype=np.float32), rng.standard_normal((20, 33), dtype=np.float32)
    out = np.zeros((150, 50), np.float32)
    row_blocks.matmul(x, w.T, out[:, 10:30])
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    assert_close_contraction(out[:, 10:30], want, np.abs(x.astype(np.float64)) @ np.abs(w.T.astype(np.float64)),
                             DType.F32)
    assert not out[:, :10].any() and not out[:, 30:].any()
