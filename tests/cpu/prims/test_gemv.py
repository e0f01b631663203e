"""Decode-sized matmul (a few rows times a weight) runs a serial Numba pass: checked against torch. It has
kernels for f32 and f64 only, and refuses anything else instead of reading it as the wrong type."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.cpu.prims import prims
from fuel.cpu.prims.gemv import GEMV_MAX_ROWS, gemv, gemv_job
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.errors import KernelError
from fuel.testing.oracle import assert_close_contraction


def _check(a: np.ndarray, b: np.ndarray, got: np.ndarray, dtype: DType) -> None:
    a64, b64 = torch.from_numpy(a.astype(np.float64)), torch.from_numpy(b.astype(np.float64))
    want = (a64 @ b64).numpy()
    assert_close_contraction(got, want, (a64.abs() @ b64.abs()).numpy(), dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.value)
@pytest.mark.parametrize("lead", [(1,), (3,), (4,), (2, 2), (1, 1)], ids=str)
def test_small_row_counts_match_torch(dtype: DType, lead: tuple[int, ...], rng: np.random.Generator) -> None:
    a = rng.standard_normal((*lead, 96)).astype(dtype.np)
    b = (rng.standard_normal((96, 40)) * 0.1).astype(dtype.np)
    got = (fl.tensor(a) @ fl.tensor(b)).numpy()
    assert got.dtype == dtype.np and got.shape == (*lead, 40)
    _check(a, b, got, dtype)


def test_strided_rows_broadcast_weights_and_nonfinite_values(rng: np.random.Generator) -> None:
    a = rng.standard_normal((2, 64)).astype(np.float32)[:, ::2]  # strided rows
    b = rng.standard_normal((32, 16)).astype(np.float32)
    b[3, 5] = np.inf
    got = (fl.tensor(a) @ fl.tensor(b)).numpy()
    want = torch.from_numpy(a.astype(np.float64)) @ torch.from_numpy(b.astype(np.float64))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want.numpy()))
    b[3, 5] = 0
    batched = (fl.tensor(a[None]) @ fl.tensor(b).broadcast_to(1, 32, 16)).numpy()
    _check(a, b, batched[0], fl.f32)


@pytest.mark.parametrize("rows", [2, 3, 4])
def test_transposed_rows_are_read_while_the_job_runs(rows: int, rng: np.random.Generator) -> None:
    """A column-major a (a [K, M] array's transpose, as a model's conv output permuted back to rows) is
    copied contiguous for the kernel, which reads that copy by address: the copy must outlive the job."""
    for _ in range(3):
        a = rng.standard_normal((512, rows)).astype(np.float32).T
        b = rng.standard_normal((512, 48)).astype(np.float32)
        gemv_out = np.empty((rows, 48), np.float32)
        gemv(a, b, gemv_out)
        _check(a, b, gemv_out, fl.f32)
        _check(a, b, (fl.tensor(a) @ fl.tensor(b)).numpy(), fl.f32)


def test_decode_path_is_taken_and_bit_stable_across_thread_counts(
        rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    a = rng.standard_normal((1, 576)).astype(np.float32)
    b = rng.standard_normal((576, 192)).astype(np.float32)
    assert a.shape[0] <= GEMV_MAX_ROWS
    calls: list[int] = []
    real = prims.gemv
    monkeypatch.setattr(prims, "gemv", lambda *args: (calls.append(1), real(*args)))
    first = (fl.tensor(a) @ fl.tensor(b)).numpy()
    assert calls == [1]
    before = fl.get_num_threads()
    try:
        for n in (1, 2):
            fl.set_num_threads(n)
            assert (fl.tensor(a) @ fl.tensor(b)).numpy().tobytes() == first.tobytes()
    finally:
        fl.set_num_threads(before)
    _check(a, b, first, fl.f32)


def test_many_rows_stay_on_blas(rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prims, "gemv", lambda *args: pytest.fail("gemv used outside its sizes"))
    a = rng.standard_normal((GEMV_MAX_ROWS + 1, 32)).astype(np.float32)
    b = rng.standard_normal((32, 8)).astype(np.float32)
    _check(a, b, (fl.tensor(a) @ fl.tensor(b)).numpy(), fl.f32)


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, GEMV_MAX_ROWS), row=st.integers(0, GEMV_MAX_ROWS - 1),
       n=st.sampled_from([1, 37, 515, 1100, 8200]), k=st.sampled_from([7, 96, 300]),
       seed=st.integers(0, 2**16))
def test_each_row_is_the_same_bytes_in_any_batch(m: int, row: int, n: int, k: int, seed: int) -> None:
    """A row's output is the bytes it has alone, whatever the other rows hold and wherever it sits, at any
    thread count: a served request's tokens never depend on its batch (docs/kernels.md). The widths cross the
    column tiles of every row count (8192 columns for one row down to 512 for 16)."""
    rng = np.random.default_rng(seed)
    row = row % m
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    alone = (fl.tensor(a[row:row + 1]) @ fl.tensor(b)).numpy()
    before = fl.get_num_threads()
    try:
        for threads in (1, 2):
            fl.set_num_threads(threads)
            batch = (fl.tensor(a) @ fl.tensor(b)).numpy()
            assert batch[row].tobytes() == alone[0].tobytes()
    finally:
        fl.set_num_threads(before)
    _check(a, b, batch, fl.f32)


def test_a_large_weight_is_row_invariant_too(rng: np.random.Generator) -> None:
    """Past 8 MiB of weight (a model's output head) the rows still come here, column tile by tile."""
    b = rng.standard_normal((1024, 2304)).astype(np.float32)
    a = rng.standard_normal((GEMV_MAX_ROWS, 1024)).astype(np.float32)
    batch = (fl.tensor(a) @ fl.tensor(b)).numpy()
    for r in (0, 5, GEMV_MAX_ROWS - 1):
        assert (fl.tensor(a[r:r + 1]) @ fl.tensor(b)).numpy()[0].tobytes() == batch[r].tobytes()
    _check(a, b, batch, fl.f32)


@pytest.mark.parametrize(("da", "db", "dout"), [
    *((d, d, d) for d in (fl.u8, fl.u32, fl.u64, fl.i64, fl.f16, fl.bf16)),
    (fl.f32, fl.f64, fl.f64), (fl.f64, fl.f32, fl.f64), (fl.f64, fl.f64, fl.f32), (fl.f32, fl.f32, fl.u8),
], ids=str)
def test_gemv_refuses_dtypes_it_has_no_kernel_for(da: DType, db: DType, dout: DType) -> None:
    a, b = np.ones((2, 256), da.np), np.ones((256, 256), db.np)
    out = np.full((2, 256), 7, dout.np)
    with pytest.raises(KernelError, match=rf"gemv: has a kernel for a, b and out all float32, float64, got "
                                          rf"{da.np}, {db.np} and {dout.np}"):
        gemv(a, b, out)
    assert (out == 7).all() and (a == 1).all() and (b == 1).all()


def test_gemv_refuses_shapes_and_layouts_it_would_read_out_of_bounds() -> None:
    a, out = np.ones((2, 64), np.float32), np.zeros((2, 32), np.float32)
    with pytest.raises(KernelError, match=r"gemv: needs a \[M, K\] and b \[K, N\] C-contiguous and out \[M, N\] "
                                          r"C-contiguous, got \[2, 64\], \[32, 32\] and \[2, 32\]"):
        gemv(a, np.ones((32, 32), np.float32), out)
    with pytest.raises(KernelError, match="C-contiguous"):
        gemv(a, np.ones((32, 64), np.float32).T, out)
    with pytest.raises(KernelError, match=r"got \[2, 64\], \[64, 32\] and \[2, 16\]"):
        gemv(a, np.ones((64, 32), np.float32), np.zeros((2, 16), np.float32))
    assert not out.any()


def test_the_job_refuses_an_out_it_cannot_write_by_address() -> None:
    a, b = np.ones((1, 64), np.float32), np.ones((64, 32), np.float32)
    with pytest.raises(KernelError, match=r"matmul: .* out \[M, N\] C-contiguous"):
        gemv_job(a, b, np.zeros((1, 64), np.float32)[:, ::2], "matmul")
    with pytest.raises(KernelError, match=r"matmul: has a kernel for a, b and out all float32, float64, got float64, "
                                          r"float32 and float32"):
        gemv_job(a.astype(np.float64), b, np.zeros((1, 32), np.float32), "matmul")
