"""`half`'s bf16 conversions as pool jobs: widening is exact and narrowing rounds to nearest-even, against
torch's own bf16 casts, and a job writes the same bytes at any part count (its items are fixed chunks)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from fuel.cpu.simd import half
from fuel.dtype import DType
from fuel.runtime import pool

SIZES = st.integers(min_value=1, max_value=5000)


def _bf16_bits(rng: np.random.Generator, size: int) -> np.ndarray:
    """Random bf16 bit patterns, NaNs, infinities and subnormals included."""
    return rng.integers(0, 1 << 16, size, dtype=np.uint16)


def _at_parts(task: pool.Task, src: np.ndarray, dst: np.ndarray, parts: int) -> bytes:
    dst[...] = 0
    job = half.convert_job(task, src, dst)
    pool.run_address(job.task, job.args, parts)
    return dst.tobytes()


@given(SIZES, st.integers(min_value=0, max_value=2**31))
def test_widen_job_is_exact_at_every_part_count(size: int, seed: int) -> None:
    src = _bf16_bits(np.random.default_rng(seed), size)
    want = torch.from_numpy(src.view(np.int16)).view(torch.bfloat16).to(torch.float32).numpy()
    dst = np.empty(size, np.uint32)
    got = {_at_parts(half.widen_bf16_part, src, dst, parts) for parts in (1, 2, 3, 7)}
    assert got == {want.view(np.uint32).tobytes()}


@given(SIZES, st.integers(min_value=0, max_value=2**31))
def test_narrow_job_rounds_to_nearest_even_at_every_part_count(size: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 1 << 32, size, dtype=np.uint32)
    src[::7] = np.float32(np.inf).view(np.uint32)  # and finite values
    src[1::7] = rng.standard_normal(len(src[1::7])).astype(np.float32).view(np.uint32)
    wide = src.view(np.float32)
    want = torch.from_numpy(wide.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    dst = np.empty(size, np.uint16)
    got = {_at_parts(half.narrow_bf16_part, src, dst, parts) for parts in (1, 2, 3, 7)}
    assert len(got) == 1
    out = np.frombuffer(got.pop(), np.uint16)
    nan = np.isnan(wide)
    assert np.array_equal(out[~nan], want[~nan])
    assert np.isnan(out[nan].astype(np.uint32).__lshift__(16).view(np.float32)).all()  # NaN stays NaN


def test_widened_and_narrow_into_round_trip_strided_bf16() -> None:
    """A strided bf16 array is gathered in C order (the job keeps that copy alive), widened exactly."""
    rng = np.random.default_rng(5)
    x = _bf16_bits(rng, 64 * 48).reshape(64, 48).view(DType.BF16.np)[::2, 1::3]
    wide = half.widened(x)
    want = torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16).to(torch.float32).numpy()
    assert wide.view(np.uint32).tobytes() == want.view(np.uint32).tobytes()
    back = np.empty(x.shape, DType.BF16.np)
    half.narrow_into(np.ascontiguousarray(wide), back)
    finite = np.isfinite(want)
    assert np.array_equal(back.view(np.uint16)[finite], np.ascontiguousarray(x).view(np.uint16)[finite])


@given(st.integers(1, 6), st.integers(1, 9), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_widened_reads_a_strided_view_as_torch_casts_it(rows: int, cols: int, step: int, seed: int) -> None:
    """An evenly strided view (every step-th column, which reshape(-1) flattens without a copy) is widened
    value by value, as torch casts the same bf16 values."""
    w = np.random.default_rng(seed).standard_normal((rows, cols * step)).astype(DType.BF16.np)
    x = w[:, ::step]
    want = torch.from_numpy(x.view(np.uint16).astype(np.int32) << 16).view(torch.float32).numpy()
    assert half.widened(x).tobytes() == np.ascontiguousarray(want).tobytes()
