"""The tiled product of a compressed weight's rows (QMatMul's and Nf4Matmul's many-row path), in both
operand orders, against torch float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from threadpoolctl import threadpool_limits

import fuel as fl
from fuel.dispatch.cpu import weight_tiles
from fuel.dtype import DType
from fuel.testing.contract import numba_threads, thread_counts
from fuel.testing.oracle import assert_close_contraction


def _product(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """weight_tiles' product, the tiles filled by copying rows of a dense W (and counted)."""
    filled: list[int] = []

    def fill(r0: int, r1: int, tile: np.ndarray) -> None:
        tile[:r1 - r0] = w[r0:r1]
        filled.extend(range(r0, r1))

    out = np.full((a.shape[0], w.shape[0]), np.nan, np.float32)
    weight_tiles.tiled_product(a, w.shape[0], fill, out)
    assert sorted(filled) == list(range(w.shape[0]))  # every W row dequantised exactly once
    return out


def test_operand_order_by_shape() -> None:
    assert weight_tiles.flipped(1, 4096) and weight_tiles.flipped(weight_tiles.FLIP_ROWS, weight_tiles.FLIP_MIN_N)
    assert not weight_tiles.flipped(weight_tiles.FLIP_ROWS + 1, 4096)
    assert not weight_tiles.flipped(64, weight_tiles.FLIP_MIN_N - 1)


@pytest.mark.parametrize(("rows", "k", "n"), [(1, 64, 1030), (17, 96, 1040), (64, 256, 1300), (65, 256, 1300),
                                              (40, 32, 300), (3, 16384, 1024)], ids=str)
def test_both_operand_orders_match_torch(rows: int, k: int, n: int, rng: np.random.Generator) -> None:
    a = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    got = _product(a, w)
    a64, w64 = torch.from_numpy(a.astype(np.float64)), torch.from_numpy(w.astype(np.float64))
    assert_close_contraction(got, (a64 @ w64.T).numpy(), (a64.abs() @ w64.abs().T).numpy(), DType.F32)


@pytest.mark.parametrize("rows", [20, 80], ids=str)
def test_same_bytes_on_any_thread_count(rows: int, rng: np.random.Generator) -> None:
    a = rng.standard_normal((rows, 384)).astype(np.float32)
    w = rng.standard_normal((1100, 384)).astype(np.float32)
    before = fl.get_num_threads()
    outs = []
    try:
        for threads in thread_counts():
            fl.set_num_threads(threads)
            with numba_threads(threads), threadpool_limits(threads, "blas"):
                outs.append(_product(a, w).tobytes())
    finally:
        fl.set_num_threads(before)
    assert len(set(outs)) == 1
