"""fuel's tile kernel (`tile_gemm`, QMatMul's and Nf4Matmul's many-row products) in both geometries on any
host, against torch float64, at edge shapes, and its bytes against the padding, tiling and geometry around
it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fuel.cpu.quant import tile_gemm
from fuel.dtype import DType
from fuel.testing.oracle import assert_close_contraction


def _run(w: np.ndarray, a: np.ndarray, extra_cols: int = 0, extra_rows: int = 0, wide: bool = True) -> np.ndarray:
    """tile_gemm's w @ aᵀ (w [n, K], a [R, K]) in one geometry, the tile padded to whole blocks of rows
    (plus extra_rows of garbage) and packed Aᵀ to extra_cols more padded activations (so to other panel
    widths)."""
    n, k = w.shape
    block = tile_gemm.WIDE_ROWS if wide else tile_gemm.NARROW_ROWS
    t = -(-(n + extra_rows) // block) * block
    tile = np.full((t, k), np.nan, np.float32)
    tile[:n] = w
    width = tile_gemm.padded_width(a.shape[0] + extra_cols)
    ap = np.full(k * width, np.nan, np.float32)
    tile_gemm.pack_activations(a, ap, width, tile_gemm.WIDE_PANEL if wide else tile_gemm.NARROW_PANEL)
    c = np.full((t, width), np.nan, np.float32)
    tile_gemm.tile_times_at_checked(tile, n, ap, c, wide)
    np.testing.assert_array_equal(tile[:n], w)  # the valid rows are read, never written
    return c[:n, :a.shape[0]]


@pytest.fixture(params=[True, False], ids=["wide", "narrow"])
def wide(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def _check(w: np.ndarray, a: np.ndarray, wide: bool) -> np.ndarray:
    got = _run(w, a, wide=wide)
    w64, a64 = torch.from_numpy(w.astype(np.float64)), torch.from_numpy(a.astype(np.float64))
    assert_close_contraction(got, (w64 @ a64.T).numpy(), (w64.abs() @ a64.abs().T).numpy(), DType.F32)
    return got


@pytest.mark.parametrize(("n", "k", "rows"), [(1, 1, 1), (4, 256, 16), (7, 257, 17), (13, 600, 64), (256, 4096, 64),
                                              (144, 576, 128), (9, 300, 200), (5, 4100, 65), (3, 0, 5)], ids=str)
def test_matches_torch(n: int, k: int, rows: int, wide: bool, rng: np.random.Generator) -> None:
    got = _check(rng.standard_normal((n, k)).astype(np.float32), rng.standard_normal((rows, k)).astype(np.float32),
                 wide)
    if k == 0:
        assert not got.any()


def test_non_finite_values_propagate(wide: bool, rng: np.random.Generator) -> None:
    w = rng.standard_normal((6, 40)).astype(np.float32)
    a = rng.standard_normal((3, 40)).astype(np.float32)
    w[1, 5], a[2, 7] = np.inf, np.nan
    got = _run(w, a, wide=wide)
    assert np.isnan(got[:, 2]).all() and np.isinf(got[1, :2]).all() and np.isfinite(np.delete(got[:, :2], 1, 0)).all()


@given(n=st.integers(1, 19), k=st.integers(1, 700), rows=st.integers(1, 80), extra_cols=st.integers(0, 70),
       extra_rows=st.integers(0, 9), seed=st.integers(0, 2**32 - 1))
def test_bytes_depend_only_on_the_inputs(n: int, k: int, rows: int, extra_cols: int, extra_rows: int,
                                        seed: int) -> None:
    """Within the bound, and the same bytes whatever padding, garbage rows or blocks of Aᵀ columns surround
    the product (so no thread count or tile size can change them), in either geometry (so no host)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    a = rng.standard_normal((rows, k)).astype(np.float32)
    got = _check(w, a, True)
    assert _run(w, a, wide=False).tobytes() == got.tobytes()
    for wide in (True, False):
        assert _run(w, a, extra_cols, extra_rows, wide).tobytes() == got.tobytes()
        if n > 1:  # nor where in the tile a row sits
            assert _run(w[1:], a, wide=wide).tobytes() == got[1:].tobytes()
