from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import fuel as fl
from fuel.dispatch.cpu.half import narrow_bf16_row, widen_bf16_row
from fuel.dtype import DType, as_dtype, from_numpy


def test_numpy_mapping_round_trips() -> None:
    for dt in DType:
        assert from_numpy(dt.np) is dt
        assert as_dtype(dt.value) is dt
    assert DType.BF16.np == np.dtype(ml_dtypes.bfloat16)


def test_accumulation_types() -> None:
    assert DType.BF16.acc is DType.F32 and DType.F16.acc is DType.F32
    assert DType.F32.acc is DType.F32 and DType.F64.acc is DType.F64


def test_unknown_numpy_dtype_is_a_clear_error() -> None:
    with pytest.raises(fl.DTypeError, match="int16"):
        fl.tensor(np.zeros(3, np.int16))


def test_bf16_narrowing_is_round_to_nearest_even_like_ml_dtypes(rng: np.random.Generator) -> None:
    x = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 100,
                        np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-40, 3.3895314e38], np.float32)])
    # exact ties: 1 + 2^-8 sits halfway between two bf16 values
    ties = (np.arange(1, 200, dtype=np.float32) * np.float32(1 + 2.0**-8))
    x = np.concatenate([x, ties, -ties])
    out = np.empty(x.shape, np.uint16)
    narrow_bf16_row(x.view(np.uint32), out)
    want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    finite = ~np.isnan(x)
    assert np.array_equal(out[finite], want[finite])
    assert np.isnan(out[~finite].view(ml_dtypes.bfloat16).astype(np.float32)).all()
    back = np.empty(x.shape, np.uint32)
    widen_bf16_row(out, back)
    assert np.array_equal(back.view(np.float32)[finite], want.view(ml_dtypes.bfloat16).astype(np.float32)[finite])


def test_vectorisable_intrinsics_are_exact(rng: np.random.Generator) -> None:
    from numba import njit

    from fuel.dispatch.cpu.vecmath import bf16_to_f32, expf_nonpositive, f32_to_bf16

    @njit
    def run(x: np.ndarray, h: np.ndarray, wide: np.ndarray, e: np.ndarray) -> None:
        for j in range(x.shape[0]):
            h[j] = f32_to_bf16(x[j])
            wide[j] = bf16_to_f32(h[j])
            e[j] = expf_nonpositive(-abs(x[j]))

    x = np.concatenate([rng.standard_normal(20000).astype(np.float32) * 30,
                        np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-40, -100.0, -87.0], np.float32),
                        np.arange(1, 200, dtype=np.float32) * np.float32(1 + 2.0**-8)])
    h, wide, e = np.empty(x.shape, np.uint16), np.empty_like(x), np.empty_like(x)
    run(x, h, wide, e)
    finite = ~np.isnan(x)
    want = x.astype(ml_dtypes.bfloat16)
    assert np.array_equal(h[finite], want.view(np.uint16)[finite])
    assert np.isnan(wide[~finite]).all()
    assert np.array_equal(wide[finite], want.astype(np.float32)[finite])
    ref = np.exp(-np.abs(x[finite].astype(np.float64)))
    got = e[finite].astype(np.float64)
    tiny = ref < 1.2e-38
    assert np.all(np.abs(got[~tiny] - ref[~tiny]) <= 4e-7 * ref[~tiny])
    assert np.all(np.abs(got[tiny]) <= 1.2e-38)
    assert np.isnan(e[~finite]).all()
