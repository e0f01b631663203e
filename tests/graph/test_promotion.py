"""Mixed dtypes promote as NumPy 2 (NEP 50) does; NumPy itself (and ml_dtypes' bf16 table) is the oracle."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.dtype import DEFAULT_FLOAT, DType
from fuel.graph.node import Op
from fuel.graph.tensor import binary

INT_DTYPES = [fl.u8, fl.u32, fl.u64, fl.i64]
ALL = list(DType)
ARITH: list[tuple[str, Callable[[Any, Any], Any]]] = [
    ("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
    ("maximum", lambda a, b: a.maximum(b) if isinstance(a, fl.Tensor) else
     b.maximum(a) if isinstance(b, fl.Tensor) else np.maximum(a, b)),
]
COMPARISONS: list[Callable[[Any, Any], Any]] = [operator.lt, operator.le, operator.gt, operator.ge,
                                                operator.eq, operator.ne]


def _values(dt: DType, n: int = 6) -> np.ndarray:
    """Small values every dtype holds exactly, so results agree with NumPy's whatever the order."""
    return np.arange(1, n + 1).astype(dt.np)


@pytest.mark.parametrize(("a", "b"), list(itertools.product(ALL, ALL)), ids=lambda d: d.value)
def test_tensor_pairs_promote_like_numpy_result_type(a: DType, b: DType) -> None:
    x, y = _values(a), _values(b)[::-1].copy()
    want_dtype = np.result_type(a.np, b.np)  # ml_dtypes registers bf16's promotions with NumPy
    for name, f in ARITH:
        got = f(fl.tensor(x), fl.tensor(y))
        assert got.dtype.np == want_dtype, (name, a, b)
        want = f(x.astype(want_dtype), y.astype(want_dtype))
        np.testing.assert_array_equal(got.numpy(), want, err_msg=name)
    for f in COMPARISONS:
        np.testing.assert_array_equal(f(fl.tensor(x), fl.tensor(y)).numpy(), f(x, y).astype(np.uint8))


def test_bf16_pairs_follow_the_f16_rule_and_bf16_with_f16_gives_f32() -> None:
    bf = fl.tensor(np.ones(2, ml_dtypes.bfloat16))
    expected = {fl.f16: fl.f32, fl.f32: fl.f32, fl.f64: fl.f64, fl.u8: fl.bf16, fl.u32: fl.f64,
                fl.u64: fl.f64, fl.i64: fl.f64, fl.bf16: fl.bf16}
    for other, want in expected.items():
        assert (bf + fl.tensor(np.ones(2, other.np))).dtype is want, other
        assert (fl.tensor(np.ones(2, other.np)) * bf).dtype is want, other


@pytest.mark.parametrize("dt", ALL, ids=lambda d: d.value)
@pytest.mark.parametrize("scalar", [2, True, 2.5, np.float32(2.0), np.float64(2.0), np.int64(3), np.uint8(2),
                                    np.float16(2.0), np.bool_(True)], ids=repr)
def test_scalars_promote_like_numpy(dt: DType, scalar: Any) -> None:
    """Python scalars are weak, NumPy scalars keep their dtype; an integer tensor with a Python float gives
    the default float, where NumPy would give f64."""
    x = _values(dt)
    for name, f in ARITH:
        got = f(fl.tensor(x), scalar)
        want_dtype = DEFAULT_FLOAT.np if dt.is_int and type(scalar) is float else f(x, scalar).dtype
        assert got.dtype.np == want_dtype, (name, scalar)
        np.testing.assert_array_equal(got.numpy(), f(x.astype(want_dtype), want_dtype.type(scalar)), err_msg=name)
        flipped = f(scalar, fl.tensor(x))
        assert flipped.dtype.np == want_dtype
        np.testing.assert_array_equal(flipped.numpy(), f(want_dtype.type(scalar), x.astype(want_dtype)))


def test_integer_tensors_with_python_ints_stay_integer() -> None:
    x = np.array([0, 7, 255], np.uint8)
    t = fl.tensor(x)
    assert (t + 1).dtype is fl.u8 and (t * 2).dtype is fl.u8
    np.testing.assert_array_equal((t + 1).numpy(), x + 1)  # wraps at 256, as NumPy does
    np.testing.assert_array_equal((t * 2).numpy(), x * 2)
    np.testing.assert_array_equal((t - 3).numpy(), x - 3)
    np.testing.assert_array_equal((3 - t).numpy(), 3 - x)
    big = fl.tensor(np.array([2**62], np.int64))
    assert (big + 2**62 - 1).numpy()[0] == 2**63 - 1
    assert (fl.tensor(np.array([1], np.uint64)) + (2**64 - 2)).numpy()[0] == 2**64 - 1


@pytest.mark.parametrize(("dt", "value"), [(fl.u8, 300), (fl.u8, -1), (fl.u32, 2**32), (fl.i64, 2**63),
                                           (fl.u64, -1), (fl.u64, 2**64)])
def test_python_ints_that_do_not_fit_are_a_clear_error(dt: DType, value: int) -> None:
    t = fl.tensor(np.zeros(3, dt.np))
    with pytest.raises(fl.DTypeError, match=rf"add: the Python int {value} is out of range for {dt.value}"):
        t + value
    with pytest.raises(fl.DTypeError, match=rf"mul: the Python int {value} is out of range for {dt.value}"):
        value * t


def test_true_division_of_integers_gives_the_default_float() -> None:
    x, y = np.array([1, 2, 7], np.int64), np.array([2, 4, 3], np.uint8)
    assert (fl.tensor(x) / 2).dtype is DEFAULT_FLOAT
    np.testing.assert_allclose((fl.tensor(x) / 2).numpy(), x / 2, rtol=1e-7)
    got = fl.tensor(x) / fl.tensor(y)
    assert got.dtype is DEFAULT_FLOAT
    np.testing.assert_allclose(got.numpy(), x / y, rtol=1e-7)
    np.testing.assert_allclose((1 / fl.tensor(y)).numpy(), 1 / y, rtol=1e-7)


def test_float_tensor_with_a_scalar_builds_the_nodes_the_patterns_match() -> None:
    t = fl.tensor(np.ones((2, 3), np.float32))
    for y, op, arg in [(t + 1.0, Op.ADD_SCALAR, 1.0), (t + 1, Op.ADD_SCALAR, 1.0), (t - 2, Op.ADD_SCALAR, -2.0),
                       (t * 3, Op.MUL_SCALAR, 3.0), (t * np.float32(0.5), Op.MUL_SCALAR, 0.5),
                       (t + True, Op.ADD_SCALAR, 1.0), (4.0 * t, Op.MUL_SCALAR, 4.0)]:
        assert y.node.op is op and y.node.arg == arg and y.node.inputs == (t.node,) and y.dtype is fl.f32
    r = 2.0 - t
    assert r.node.op is Op.ADD_SCALAR and r.node.inputs[0].op is Op.NEG and r.node.inputs[0].inputs == (t.node,)
    s = t + t
    assert s.node.op is Op.ADD and s.node.inputs == (t.node, t.node)
    d = t / 2.0
    assert d.node.op is Op.DIV and d.node.inputs[0] is t.node


def test_promotion_casts_before_the_primitive() -> None:
    a, b = fl.tensor(np.ones(3, np.float32)), fl.tensor(np.ones(3, np.float64))
    y = a + b
    assert y.node.op is Op.ADD and y.dtype is fl.f64
    assert y.node.inputs[0].op is Op.CAST and y.node.inputs[0].inputs == (a.node,) and y.node.inputs[1] is b.node
    assert (a.cast(fl.bf16) + a.cast(fl.f16)).dtype is fl.f32


def test_where_and_concat_promote() -> None:
    x = np.array([1.5, -2.0, 3.0], np.float32)
    t = fl.tensor(x)
    m = t > 0
    assert fl.where(m, t, 0).dtype is fl.f32
    got = fl.where(m, t, fl.tensor(np.zeros(3, np.float64)))
    assert got.dtype is fl.f64
    np.testing.assert_array_equal(got.numpy(), np.where(x > 0, x, 0.0))
    assert fl.where(m, 1, 0).dtype is fl.i64 and fl.where(m, 1.0, 0).dtype is DEFAULT_FLOAT
    cat = fl.concat([t, fl.tensor(np.array([4], np.int64))])
    assert cat.dtype is fl.f64  # np.result_type(f32, i64)
    np.testing.assert_array_equal(cat.numpy(), np.concatenate([x, np.array([4], np.int64)]))


def test_fused_op_builders_keep_their_strict_dtypes() -> None:
    x = fl.tensor(np.ones((2, 8), np.float32))
    cos = fl.tensor(np.ones((2, 8), np.float64))
    with pytest.raises(fl.DTypeError, match="f64"):
        fl.ops.rope(x, cos, cos)


@pytest.mark.parametrize("dt", INT_DTYPES, ids=lambda d: d.value)
def test_comparisons_with_python_scalars_never_round_the_scalar(dt: DType) -> None:
    t = fl.tensor(np.array([0, 1, 2], dt.np))
    np.testing.assert_array_equal((t >= 0.5).numpy(), [0, 1, 1])
    np.testing.assert_array_equal((t < 1.5).numpy(), [1, 1, 0])
    np.testing.assert_array_equal((t == 1.0).numpy(), [0, 1, 0])
    np.testing.assert_array_equal((t != 1.5).numpy(), [1, 1, 1])
    np.testing.assert_array_equal(binary(Op.LT, 0.5, t).numpy(), [0, 1, 1])  # the scalar first
    big = 2**70
    np.testing.assert_array_equal((t < big).numpy(), [1, 1, 1])
    np.testing.assert_array_equal((t > -big).numpy(), [1, 1, 1])
    np.testing.assert_array_equal((t == -1).numpy(), [0, 0, 0])


_SCALARS = st.one_of(
    st.integers(-(2**66), 2**66), st.floats(-1e22, 1e22), st.sampled_from([np.nan, np.inf, -np.inf, 0.5, -0.5]),
    st.booleans(),
)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(INT_DTYPES), st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=6), _SCALARS,
       st.sampled_from(COMPARISONS))
def test_integer_comparisons_with_python_scalars_match_numpy(dt: DType, raw: list[int], scalar: Any,
                                                              cmp: Callable[[Any, Any], Any]) -> None:
    lo, hi = np.iinfo(dt.np).min, np.iinfo(dt.np).max
    x = np.array([min(max(v, lo), hi) for v in raw], dt.np)  # |x| < 2**53: NumPy's f64 compare is exact
    got = cmp(fl.tensor(x), scalar)
    assert got.dtype is fl.u8
    np.testing.assert_array_equal(got.numpy(), cmp(x, scalar).astype(np.uint8))


def test_u8_comparison_with_an_out_of_range_int_is_all_true_like_numpy() -> None:
    x = np.array([0, 200, 255], np.uint8)
    np.testing.assert_array_equal((fl.tensor(x) < 300).numpy(), (x < 300).astype(np.uint8))
    assert (fl.tensor(x) < 300).numpy().all()


def test_gradients_flow_back_through_the_promotion_casts() -> None:
    x, y = np.array([1.0, -2.0, 3.0], np.float32), np.array([0.5, 4.0, -1.0], np.float64)
    a, b = fl.tensor(x), fl.tensor(y)
    ga, gb = fl.grad((a * b + 1).sum(), [a, b])
    assert ga.dtype is fl.f32 and gb.dtype is fl.f64
    tx, ty = torch.tensor(x, requires_grad=True), torch.tensor(y, requires_grad=True)
    (tx * ty + 1).sum().backward()
    assert tx.grad is not None and ty.grad is not None
    np.testing.assert_allclose(ga.numpy(), tx.grad.numpy(), rtol=1e-7)
    np.testing.assert_allclose(gb.numpy(), ty.grad.numpy(), rtol=1e-15)
    h = fl.tensor(np.ones((3, 4), np.float16))
    (gh,) = fl.grad(h.mean(), [h])
    assert gh.dtype is fl.f16
    np.testing.assert_array_equal(gh.numpy(), np.full((3, 4), np.float16(1 / 12)))
