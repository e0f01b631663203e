"""Reductions accumulate as NumPy's do: integers in 64 bits, half types in f32 (rounded once at the end)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.dtype import DEFAULT_FLOAT, DType
from fuel.graph.node import Op
from fuel.graph.prims import make

INT_DTYPES = [fl.u8, fl.u32, fl.u64, fl.i64]


def test_sum_and_mean_of_a_mask_count_like_numpy(rng: np.random.Generator) -> None:
    x = rng.standard_normal(1000).astype(np.float32)
    mask = fl.tensor(x) > 0
    total = mask.sum()
    assert total.dtype is fl.u64
    assert total.item() == int((x > 0).sum())  # 466 for this seed; u8 accumulation would give it mod 256
    mean = mask.mean()
    assert mean.dtype is DEFAULT_FLOAT
    assert mean.item() == pytest.approx(float((x > 0).mean()), rel=1e-7)


@pytest.mark.parametrize("dt", INT_DTYPES, ids=lambda d: d.value)
def test_integer_sums_widen_to_64_bits_like_numpy(dt: DType) -> None:
    x = np.full((3, 300), np.iinfo(dt.np).max if dt is not fl.i64 else 2**40, dt.np)
    for axis in (None, 0, 1, (0, 1)):
        got = fl.tensor(x).sum(axis)
        want = x.sum(axis=axis)
        assert got.dtype.np == want.dtype, axis
        np.testing.assert_array_equal(got.numpy(), want)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(INT_DTYPES), st.lists(st.integers(1, 5), min_size=1, max_size=3), st.data())
def test_integer_sum_and_mean_match_numpy_for_any_axes(dt: DType, shape: list[int], data: st.DataObject) -> None:
    rng = np.random.default_rng(len(shape) * 31 + sum(shape))
    hi = min(int(np.iinfo(dt.np).max), 2**40)
    x = rng.integers(0, hi, size=shape, endpoint=True).astype(dt.np)
    axes = data.draw(st.sets(st.integers(0, len(shape) - 1)))
    axis = tuple(sorted(axes)) if axes else None
    keepdim = data.draw(st.booleans())
    got = fl.tensor(x).sum(axis, keepdim=keepdim)
    want = x.sum(axis=axis, keepdims=keepdim)
    assert got.dtype.np == want.dtype
    np.testing.assert_array_equal(got.numpy(), want)
    mean = fl.tensor(x).mean(axis, keepdim=keepdim)
    assert mean.dtype is DEFAULT_FLOAT
    # NumPy's f64 mean, rounded once to the default float.
    np.testing.assert_array_equal(mean.numpy(), x.mean(axis=axis, keepdims=keepdim).astype(DEFAULT_FLOAT.np))


@pytest.mark.parametrize("dt", [fl.f16, fl.bf16], ids=lambda d: d.value)
def test_half_mean_over_several_axes_does_not_round_the_sum_to_half(dt: DType) -> None:
    ones = fl.tensor(np.ones((400, 400), dt.np))
    assert ones.mean().item() == 1.0  # the f16 sum, 160000, would be inf
    assert ones.mean((0, 1), keepdim=True).numpy().tolist() == [[1.0]]
    assert ones.mean().dtype is dt


@pytest.mark.parametrize("dt", [fl.f16, fl.bf16], ids=lambda d: d.value)
def test_half_reductions_round_once_from_an_exact_reference(dt: DType, rng: np.random.Generator) -> None:
    x = (rng.standard_normal((6, 50, 70)) * 40 + 3).astype(dt.np)
    x64 = x.astype(np.float64)
    for axis in ((0, 1), (1, 2), None, 2, (0, 2)):
        for name in ("sum", "mean"):
            got = getattr(fl.tensor(x), name)(axis).numpy().astype(np.float64)
            want = getattr(x64, name)(axis=axis)
            # f32 accumulation errs by about 2^-24 of the absolute sum per level of pairwise summation, far
            # below a half-type ulp; rounding once adds at most half an ulp.
            ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 1e-30))) - (7 if dt is fl.bf16 else 10))
            bound = 0.5 * ulp + 1e-6 * np.abs(x64).sum(axis=axis) / (1 if name == "sum" else x64.size / np.size(want))
            assert np.all(np.abs(got - want) <= bound), (name, axis)


def test_float_last_axis_reductions_keep_their_nodes() -> None:
    for dt in (fl.f32, fl.bf16, fl.f16, fl.f64):
        t = fl.tensor(np.ones((3, 5), dt.np))
        for y, op in ((t.mean(-1), Op.MEAN_DIM), (t.sum(-1), Op.SUM_DIM), (t.max(-1), Op.MAX_DIM)):
            assert y.node.op is op and y.node.inputs == (t.node,) and y.dtype is dt


def test_reduction_primitives_give_the_accumulated_dtype() -> None:
    u = fl.tensor(np.full((4, 300), 255, np.uint8)).node
    for op, arg, shape in ((Op.SUM_DIM, 1, (4,)), (Op.REDUCE_SUM_TO, (4, 1), (4, 1))):
        n = make(op, (u,), arg)
        assert n.dtype is fl.u64 and n.shape == shape
        np.testing.assert_array_equal(fl.Tensor(n).numpy().ravel(), np.full(4, 255 * 300))
    m = fl.Tensor(make(Op.MEAN_DIM, (u,), 1))
    assert m.dtype is DEFAULT_FLOAT
    np.testing.assert_array_equal(m.numpy(), np.full(4, 255.0, np.float32))
    i = fl.tensor(np.array([[-5, 2]], np.int64)).node
    assert make(Op.SUM_DIM, (i,), 1).dtype is fl.i64 and make(Op.MAX_DIM, (u,), 1).dtype is fl.u8
    h = fl.tensor(np.full((2, 4000), 30.0, ml_dtypes.bfloat16)).node
    # 120000 is a bf16 value (bf16 has f32's range); an f16 accumulator could not reach it.
    np.testing.assert_array_equal(fl.Tensor(make(Op.SUM_DIM, (h,), 1)).numpy().astype(np.float32),
                                  np.full(2, np.float32(np.float32(120000.0).astype(ml_dtypes.bfloat16))))
