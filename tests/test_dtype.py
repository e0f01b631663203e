from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import fuel as fl
from fuel.cpu.simd.half import narrow_bf16_row, widen_bf16_row
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

    from fuel.cpu.simd.vecmath import bf16_to_f32, expf_nonpositive, f32_to_bf16

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


@pytest.mark.parametrize("name", ["f99", "bogus", "int16", "float128"])
def test_unknown_dtype_names_list_the_valid_ones(name: str) -> None:
    with pytest.raises(fl.DTypeError, match=rf"'{name}' is not a dtype Fuel stores; valid names: f32, f64, bf16, "
                                            r"f16, u8, u32, u64, i64"):
        as_dtype(name)
    with pytest.raises(fl.DTypeError, match=rf"cast: '{name}'"):
        fl.tensor(np.zeros(2, np.float32)).cast(name)
    with pytest.raises(fl.DTypeError, match=rf"zeros: '{name}'"):
        fl.zeros((2,), name)
    with pytest.raises(fl.DTypeError, match="None"):
        as_dtype(None)


def test_u64_is_a_stored_dtype() -> None:
    assert fl.u64 is DType.U64 and fl.u64.np == np.uint64 and as_dtype("U64") is fl.u64
    assert fl.tensor(np.array([2**64 - 1], np.uint64)).dtype is fl.u64


def _saturated(v: float, lo: int, hi: int) -> int:
    """The saturating float-to-int rule, in Python's exact integers."""
    if np.isnan(v):
        return 0
    if v == np.inf or (np.isfinite(v) and int(v) > hi):
        return hi
    if v == -np.inf or (np.isfinite(v) and int(v) < lo):
        return lo
    return int(v)  # truncates toward zero


@pytest.mark.parametrize("src", [fl.f32, fl.f64, fl.f16, fl.bf16], ids=lambda d: d.value)
@pytest.mark.parametrize("dst", [fl.u8, fl.u32, fl.u64, fl.i64], ids=lambda d: d.value)
def test_float_to_int_casts_saturate_at_the_limits(src: DType, dst: DType) -> None:
    lo, hi = int(np.iinfo(dst.np).min), int(np.iinfo(dst.np).max)
    seeds = [0.0, 0.5, -0.5, 1.7, -1.7, 254.5, 255.5, 256.0, hi, hi + 1, 2.0 * hi, lo, lo - 1, 2.0 * lo - 8,
             1e30, -1e30, 2.0**63, 2.0**64, np.inf, -np.inf, np.nan]
    with np.errstate(over="ignore", invalid="ignore"):  # 1e30 is inf in f16; neighbours of NaN are NaNs
        base = np.array([float(s) for s in seeds], np.float64).astype(src.np)  # rounded into the source type
        bits = base.view(f"u{src.np.itemsize}")
        # each value with its two neighbours in the source type, so both sides of every limit are tried
        values = np.concatenate([base, (bits + 1).view(src.np), (bits - 1).view(src.np)])
        wide = values.astype(np.float64)
    got = fl.tensor(values).cast(dst).numpy()
    assert got.dtype == dst.np
    want = [_saturated(float(v), lo, hi) for v in wide]
    assert [int(g) for g in got] == want
