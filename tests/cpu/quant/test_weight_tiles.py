"""The tiled product of a compressed weight's rows (QMatMul's and Nf4Matmul's many-row path), by fuel's own
tile kernel and by OpenBLAS in both operand orders, as jobs of the spinning pool and tile by tile in the
calling thread (`tiled_product`, for a Python fill), against
torch float64. The own kernel runs on any host here (on one without AVX-512 only slower)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from threadpoolctl import threadpool_limits

import fuel as fl
from fuel.cpu.quant import gguf_tiles, weight_tiles
from fuel.cpu.simd.sgemm import sgemm_nt
from fuel.dtype import DType
from fuel.quant import QuantType
from fuel.runtime import threads
from fuel.testing.contract import fuel_threads, thread_counts
from fuel.testing.oracle import assert_close_contraction
from fuel.testing.reference.qmatmul import as_words, random_weight


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


@pytest.fixture(params=[True, False], ids=["own", "openblas"])
def own(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Each test once with fuel's tile kernel and once with OpenBLAS's sgemm."""
    monkeypatch.setattr(weight_tiles, "OWN_KERNEL", request.param)
    return bool(request.param)


def test_own_kernel_up_to_its_row_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weight_tiles, "OWN_KERNEL", True)
    assert weight_tiles.own_mode(1) and weight_tiles.own_mode(weight_tiles.OWN_MAX_ROWS)
    assert not weight_tiles.own_mode(weight_tiles.OWN_MAX_ROWS + 1)
    monkeypatch.setattr(weight_tiles, "OWN_KERNEL", False)
    assert not weight_tiles.own_mode(1)


def test_operand_order_by_shape() -> None:
    assert weight_tiles.flipped(1, 4096) and weight_tiles.flipped(weight_tiles.FLIP_ROWS, weight_tiles.FLIP_MIN_N)
    assert not weight_tiles.flipped(weight_tiles.FLIP_ROWS + 1, 4096)
    assert not weight_tiles.flipped(64, weight_tiles.FLIP_MIN_N - 1)


@pytest.mark.parametrize(("rows", "k", "n"), [(1, 64, 1030), (17, 96, 1040), (64, 256, 1300), (65, 256, 1300),
                                              (40, 32, 300), (3, 16384, 1024), (513, 48, 200)], ids=str)
def test_both_operand_orders_match_torch(rows: int, k: int, n: int, own: bool, rng: np.random.Generator) -> None:
    a = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    got = _product(a, w)
    a64, w64 = torch.from_numpy(a.astype(np.float64)), torch.from_numpy(w.astype(np.float64))
    assert_close_contraction(got, (a64 @ w64.T).numpy(), (a64.abs() @ w64.abs().T).numpy(), DType.F32)


@pytest.mark.parametrize("rows", [20, 80], ids=str)
def test_same_bytes_on_any_thread_count(rows: int, own: bool, rng: np.random.Generator) -> None:
    a = rng.standard_normal((rows, 384)).astype(np.float32)
    w = rng.standard_normal((1100, 384)).astype(np.float32)
    before = fl.get_num_threads()
    outs = []
    try:
        for threads in thread_counts():
            fl.set_num_threads(threads)
            with fuel_threads(threads), threadpool_limits(threads, "blas"):
                outs.append(_product(a, w).tobytes())
    finally:
        fl.set_num_threads(before)
    assert len(set(outs)) == 1


def test_sgemm_called_from_jitted_code_matches_numpy(rng: np.random.Generator) -> None:
    assert threads.blas_sgemm_address(), "NumPy's OpenBLAS exports no ILP64 cblas_sgemm"
    a = rng.standard_normal((7, 33)).astype(np.float32)
    b = rng.standard_normal((5, 33)).astype(np.float32)
    c = np.full((7, 5), np.nan, np.float32)
    sgemm_nt(threads.blas_sgemm_address(), a, b, c)
    with threadpool_limits(1, "blas"):
        np.testing.assert_array_equal(c, a @ b.T)


@pytest.mark.parametrize("qt", [QuantType.Q4_1, QuantType.Q6K], ids=lambda q: q.ggml_name)
@pytest.mark.parametrize("rows", [17, 64, 65], ids=str)
def test_pool_tasks_and_python_threads_agree(qt: QuantType, rows: int, own: bool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """QMatMul's tiles on the spinning pool (the kernel called from jitted code) and on `split_work`'s
    threads: both within the contraction bound, on any thread count. The OpenBLAS tiles need an sgemm
    that jitted code can call and fall back to the threads without one; fuel's kernel needs none, and
    gives the same bytes on either."""
    k, n = 512, 1100
    raw = random_weight(np.random.default_rng(rows), qt, n, k)
    deq = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qt.ggml_name]))
    a = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)
    a64, w64 = torch.from_numpy(a.astype(np.float64)), torch.from_numpy(deq.astype(np.float64))
    want, scale = (a64 @ w64.T).numpy(), (a64.abs() @ w64.abs().T).numpy()
    outs, before = [], fl.get_num_threads()
    for threads_n in thread_counts():
        out = np.full((rows, n), np.nan, np.float32)
        fl.set_num_threads(threads_n)
        try:
            assert gguf_tiles.tiled(qt, a, raw, out)
        finally:
            fl.set_num_threads(before)
        outs.append(out.tobytes())
        assert_close_contraction(out, want, scale, DType.F32)
    assert len(set(outs)) == 1
    monkeypatch.setattr(threads, "blas_sgemm_address", lambda: 0)
    out = np.full((rows, n), np.nan, np.float32)
    assert gguf_tiles.tiled(qt, a, raw, out) == own
    if own:
        assert out.tobytes() == outs[0]
    else:
        assert np.isnan(out).all()
    got = fl.ops.qmatmul(a, as_words(raw), qt, k, n).numpy()
    assert_close_contraction(got, want, scale, DType.F32)
    threaded = _product(a, deq)
    assert_close_contraction(threaded, want, scale, DType.F32)
    if own:
        assert threaded.tobytes() == outs[0]


@pytest.mark.parametrize("rows", [20, 80], ids=str)
def test_tile_jobs_rerun_with_any_part_count(rows: int, own: bool, rng: np.random.Generator) -> None:
    """A product's prep and tile jobs (Nf4Matmul's tile task) posted again and again, as native replay
    does, with any part count (one, fewer parts than tiles, more parts than threads, one a tile): every
    tile is claimed once per run (the prep job resets the counter), so each run writes the whole output,
    the same bytes each time, within the contraction bound of torch float64."""
    from fuel.cpu.quant import nf4_matmul
    from fuel.quant.nf4 import nf4_quantize
    from fuel.runtime import pool
    from fuel.testing.reference.nf4_matmul import dequant64

    k, n, bs = 256, 1100, 64
    packed, absmax = nf4_quantize(rng.standard_normal((n, k)).astype(np.float32), bs)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    out = np.full((rows, n), np.nan, np.float32)
    found = nf4_matmul._tiles_jobs(x, packed, absmax, bs, out)
    assert found is not None
    prep, tiles = found
    count = int(tiles.argv[0]["tiles"])
    assert tiles.most == count > 3
    outs = []
    with threads.one_blas_thread():
        for parts in (1, 2, 3, count, 1, 7):
            out.fill(np.nan)
            pool.run_address(prep.task, prep.args, 1)
            pool.run_address(tiles.task, tiles.args, parts)
            outs.append(out.tobytes())
    assert len(set(outs)) == 1
    x64, w64 = torch.from_numpy(x.astype(np.float64)), torch.from_numpy(dequant64(packed, absmax, bs))
    assert_close_contraction(out, (x64 @ w64.T).numpy(), (x64.abs() @ w64.abs().T).numpy(), DType.F32)
