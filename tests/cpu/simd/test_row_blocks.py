"""`row_blocks.matmul`: products on fixed pieces, one BLAS thread each, against torch float64, and the same
bytes at one and two fuel threads and one and two BLAS threads (where OpenBLAS's own threading, with its
Haswell kernels, changed 1342 of [128, 256] @ [256, 48]'s elements)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from threadpoolctl import threadpool_limits

from fuel.cpu.simd import row_blocks
from fuel.dtype import DType
from fuel.runtime import pool, threads
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


def _numpy_pieces(a: np.ndarray, b: np.ndarray, shape: tuple[int, ...], bias: np.ndarray | None) -> np.ndarray:
    """The oracle of the job's bytes: NumPy's own one-thread matmul on each piece (each batch item whole),
    and the bias added by NumPy after it."""
    out = np.empty(shape, a.dtype)
    with threadpool_limits(1, "blas"):
        if len(shape) == 2:
            pr, pc = row_blocks.pieces(*shape)
            for r0 in range(0, shape[0], pr):
                for c0 in range(0, shape[1], pc):
                    np.matmul(a[r0:r0 + pr], b[:, c0:c0 + pc], out=out[r0:r0 + pr, c0:c0 + pc])
        else:
            for i in np.ndindex(*shape[:-2]):
                ai = a[i[len(i) - (a.ndim - 2):]] if a.ndim > 2 else a
                bi = b[i[len(i) - (b.ndim - 2):]] if b.ndim > 2 else b
                np.matmul(ai, bi, out=out[i])
    if bias is not None:
        out += bias
    return out


def _job_bytes(a: np.ndarray, b: np.ndarray, out: np.ndarray, bias: np.ndarray | None) -> set[bytes]:
    job = row_blocks.pieces_job(a, b, out, bias)
    assert job is not None
    got = set()
    for parts in (1, 2, 3, 7):
        out[...] = np.nan
        with threads.one_blas_thread():
            pool.run_address(job.task, job.args, parts)
        got.add(out.tobytes())
    return got


@given(st.sampled_from([np.float32, np.float64]), st.sampled_from([1, 2, 5, 17, 70, 97]),
       st.sampled_from([2, 33, 300]), st.sampled_from([24, 300, 1000]), st.booleans(), st.booleans(),
       st.booleans(), st.integers(0, 2**31))
@settings(max_examples=80)
def test_pieces_job_makes_numpys_calls_at_every_part_count(dt: type, m: int, k: int, n: int, transposed: bool,
                                                           a_transposed: bool, with_bias: bool, seed: int) -> None:
    """f32 and f64, one row (NumPy's gemv) to many, a and b row- or column-major (a column-major a is a weight
    gradient's `xᵀ @ g`): the job's pieces at 1, 2, 3 and 7 parts write the same bytes, NumPy's for the same
    pieces, and values within the contraction bound of float64. Where f32 products of FEW_ROWS rows or more
    (out C-contiguous) end in a one-row piece, that piece is a gemm, where NumPy's call is a gemv: there only
    the bytes' independence of the part count. A column-major a whose pieces could be one-row gemvs stays
    NumPy's (no job)."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((k, m)).astype(dt).T if a_transposed else rng.standard_normal((m, k)).astype(dt)
    b = rng.standard_normal((n, k)).astype(dt).T if transposed else rng.standard_normal((k, n)).astype(dt)
    bias = rng.standard_normal(n).astype(dt) if with_bias else None
    want = _numpy_pieces(a, b, (m, n), bias)
    pr, _ = row_blocks.pieces(m, n)
    if (pr, _) == (m, n):
        return  # one piece: NumPy's call itself, no job
    if a_transposed and m > 1 and not (dt == np.float32 and m >= row_blocks.FEW_ROWS):
        assert row_blocks.pieces_job(a, b, np.empty((m, n), dt), bias) is None
        return
    got = _job_bytes(a, b, np.empty((m, n), dt), bias)
    assert len(got) == 1
    if not (dt == np.float32 and m >= row_blocks.FEW_ROWS and m % pr == 1):
        assert got == {want.tobytes()}
    want = np.frombuffer(got.pop(), dt).reshape(m, n)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    with_b = a64 @ b64 + (0 if bias is None else bias)
    assert_close_contraction(want, with_b, np.abs(a64) @ np.abs(b64) + (0 if bias is None else np.abs(bias)),
                             DType.F32 if dt == np.float32 else DType.F64)


def test_one_row_lm_head_and_batches_make_numpys_calls() -> None:
    """A one-row product with a wide (LM head) output is cut into column pieces, each NumPy's gemv; batched
    products are an item each (gemv for one-row items, gemm otherwise), with a weight broadcast over them."""
    rng = np.random.default_rng(6)
    for dt in (np.float32, np.float64):
        a, w = rng.standard_normal((1, 40)).astype(dt), rng.standard_normal((70000, 40)).astype(dt)
        assert row_blocks.pieces(1, 70000) != (1, 70000)
        assert _job_bytes(a, w.T, np.empty((1, 70000), dt), None) == {_numpy_pieces(a, w.T, (1, 70000), None).tobytes()}
        for rows, y_shape in [(1, (24, 10)), (6, (24, 10)), (1, (2, 3, 24, 10)), (6, (2, 3, 24, 10))]:
            x, y = rng.standard_normal((2, 3, rows, 24)).astype(dt), rng.standard_normal(y_shape).astype(dt)
            want = _numpy_pieces(x, y, (2, 3, rows, 10), None)
            assert _job_bytes(x, y, np.empty((2, 3, rows, 10), dt), None) == {want.tobytes()}
        x, y = rng.standard_normal((2, 3, 6, 24)).astype(dt), rng.standard_normal((3, 24, 10)).astype(dt)
        out = np.empty((2, 3, 6, 10), dt)
        assert row_blocks.pieces_job(x, y, out, None) is None  # a weight broadcast over one lead dim only
        row_blocks.matmul(x, y, out)
        assert out.tobytes() == _numpy_pieces(x, y, out.shape, None).tobytes()


def test_products_the_task_does_not_serve_are_numpys_pieces() -> None:
    """Integers, a @ aᵀ (NumPy's syrk) and one-column pieces (NumPy's matrix @ vector gemv) keep NumPy's
    calls, in this thread."""
    rng = np.random.default_rng(7)
    ints = rng.integers(-9, 9, (40, 300)), rng.integers(-9, 9, (300, 260))
    x = rng.standard_normal((40, 300))
    cases = [(*ints, None), (x, x.T, None), (rng.standard_normal((100, 30)), rng.standard_normal((30, 1)), None)]
    for a, b, bias in cases:
        out = np.empty((a.shape[0], b.shape[1]), np.result_type(a, b))
        assert a.dtype.kind == "i" or row_blocks.pieces_job(a, b, out, bias) is None
        row_blocks.matmul(a, b, out)
        assert out.tobytes() == _numpy_pieces(a, b, out.shape, bias).tobytes()
