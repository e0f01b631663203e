"""InplaceAffine (16): values in every dtype, aliasing of the caller's buffer, ordering, CSE, errors, jit."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import fuel as fl
from fuel.dispatch.plan import destructive_of as _destructive
from fuel.dtype import DType
from fuel.graph.node import Node
from fuel.graph.passes.cse import cse
from fuel.graph.registry import default_registry
from fuel.testing.oracle import assert_close_rowwise


def _rounded_once(x: np.ndarray, mul: float, add: float) -> np.ndarray:
    """mul·x + add in f64, rounded once to x's dtype (NumPy's f64→f16 and ml_dtypes' f64→bf16 casts
    round directly, not through f32)."""
    return (mul * x.astype(np.float64) + add).astype(x.dtype)


@pytest.mark.parametrize("shape", [(7, 33), (2, 3, 64), (1, 1), (0, 8), (5,), (), (300, 1000)], ids=str)
@pytest.mark.parametrize(("mul", "add"), [(2.5, -1.0), (-0.3, 0.7), (3.0, -3.0)])
def test_values_against_numpy_float64(float_dtype: DType, shape: tuple[int, ...], mul: float, add: float,
                                      rng: np.random.Generator) -> None:
    x = (rng.standard_normal(shape) * 2).astype(float_dtype.np)
    want64 = mul * x.astype(np.float64) + add
    got = fl.ops.inplace_affine(x.copy(), mul, add).numpy()
    assert got.dtype == float_dtype.np and got.shape == shape
    assert_close_rowwise(got, want64, float_dtype, scale=np.abs(mul * x.astype(np.float64)) + abs(add))
    np.testing.assert_array_equal(got, _rounded_once(x, mul, add))  # f64 compute, one rounding


@pytest.mark.parametrize(("dt", "add"), [(DType.BF16, 2.0**-8 + 2.0**-30), (DType.F16, 2.0**-11 + 2.0**-40)],
                         ids=["bf16", "f16"])
def test_halves_round_once_not_through_f32(dt: DType, add: float) -> None:
    """1 + add lies just above a half-precision midpoint but rounds to it in f32: going through f32
    would round down to 1; rounding once gives the next half value up."""
    got = fl.ops.inplace_affine(np.ones(3, dt.np), 1.0, add).numpy().astype(np.float64)
    step = 2.0**-7 if dt is DType.BF16 else 2.0**-10
    np.testing.assert_array_equal(got, [1 + step] * 3)
    assert float(np.float32(1 + add)) == 1 + step / 2  # the f32 detour would land on the midpoint


def test_non_finite_elements(float_dtype: DType) -> None:
    x = np.array([np.inf, -np.inf, np.nan, 1.0], float_dtype.np)
    got = fl.ops.inplace_affine(x, -2.0, 1.0).numpy().astype(np.float64)
    np.testing.assert_array_equal(got, [-np.inf, np.inf, np.nan, -1.0])


def test_the_result_is_the_callers_buffer(float_dtype: DType, rng: np.random.Generator) -> None:
    """fl.tensor does not copy a NumPy array, so realising overwrites the caller's array in place."""
    arr = rng.standard_normal((4, 6)).astype(float_dtype.np)
    before = arr.copy()
    t = fl.tensor(arr)
    assert np.shares_memory(t.numpy(), arr)  # the leaf wraps arr itself
    out = fl.ops.inplace_affine(t, 2.0, 0.5).numpy()
    assert np.shares_memory(out, arr)
    np.testing.assert_array_equal(arr, _rounded_once(before, 2.0, 0.5))


def test_a_non_contiguous_view_is_written_in_place(rng: np.random.Generator) -> None:
    arr = rng.standard_normal((5, 8)).astype(np.float32)
    before = arr.copy()
    out = fl.ops.inplace_affine(fl.tensor(arr.T[::2]), -1.0, 3.0).numpy()
    assert np.shares_memory(out, arr)
    want = before.copy()
    want.T[::2] = _rounded_once(before.T[::2], -1.0, 3.0)
    np.testing.assert_array_equal(arr, want)  # the other columns are untouched


def test_other_readers_of_x_in_the_graph_see_the_old_values(rng: np.random.Generator) -> None:
    arr = rng.standard_normal((3, 7)).astype(np.float32)
    before = arr.copy()
    t = fl.tensor(arr)
    z = t * 2.0
    s = t.sum(-1)
    r = fl.ops.inplace_affine(t, 3.0, 1.0)
    zr, rr, sr = fl.realize(z, r, s)  # the destructive node is listed before a reader: still ordered
    np.testing.assert_array_equal(zr.numpy(), before * 2)
    np.testing.assert_allclose(sr.numpy(), before.sum(-1), rtol=1e-6)
    np.testing.assert_array_equal(rr.numpy(), _rounded_once(before, 3.0, 1.0))


def test_identical_in_place_affines_are_not_merged(rng: np.random.Generator) -> None:
    """CSE keeps both. Realised in one graph the two writes have no order between them, so the scheduler
    refuses; realised one after the other, the second was built on x's old value, which the first has
    overwritten (a stale input): also refused. Chaining them (next test) is how both apply."""
    arr = rng.standard_normal((2, 5)).astype(np.float64)
    before = arr.copy()
    t = fl.tensor(arr)
    a, b = fl.ops.inplace_affine(t, 2.0, 1.0), fl.ops.inplace_affine(t, 2.0, 1.0)
    merged: list[Node] = cse([a.node, b.node], _destructive(default_registry()))
    assert merged[0] is not merged[1]
    with pytest.raises(fl.FuelError):
        fl.realize(a, b)
    np.testing.assert_array_equal(arr, before)  # refused before anything ran
    a.numpy()
    with pytest.raises(fl.FuelError):
        b.numpy()
    np.testing.assert_array_equal(arr, 2 * before + 1)


def test_chained_in_place_affines_compose(rng: np.random.Generator) -> None:
    arr = rng.standard_normal((2, 5))
    before = arr.copy()
    out = fl.ops.inplace_affine(fl.ops.inplace_affine(arr, 2.0, 1.0), 2.0, 1.0).numpy()
    assert np.shares_memory(out, arr)
    np.testing.assert_array_equal(arr, 2 * (2 * before + 1) + 1)


def test_reading_x_after_it_is_overwritten_is_refused() -> None:
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = fl.tensor(arr)
    both = t + fl.ops.inplace_affine(t, 2.0, 1.0)  # needs x before and after the write
    with pytest.raises(fl.FuelError):
        both.numpy()
    np.testing.assert_array_equal(arr, np.arange(6).reshape(2, 3))


def test_a_read_only_buffer_is_a_kernel_error() -> None:
    frozen = np.zeros((2, 3), np.float32)
    frozen.flags.writeable = False
    for leaf in (fl.tensor(np.broadcast_to(np.float32(1.0), (3, 4))), fl.tensor(frozen), fl.zeros((2, 2), "f32")):
        with pytest.raises(fl.KernelError, match="read-only"):
            fl.ops.inplace_affine(leaf, 2.0, 0.0).numpy()


def test_jit_replay_writes_each_call_argument(rng: np.random.Generator) -> None:
    def step(x: fl.Tensor) -> tuple[fl.Tensor, fl.Tensor]:
        return x * 2.0, fl.ops.inplace_affine(x, 0.5, -1.0)

    f = fl.jit(step)
    for _ in range(3):
        arr = rng.standard_normal((4, 9)).astype(np.float32)
        before = arr.copy()
        doubled, written = f(arr)
        np.testing.assert_array_equal(doubled.numpy(), before * 2)  # read before the write
        np.testing.assert_array_equal(arr, _rounded_once(before, 0.5, -1.0))
        np.testing.assert_array_equal(written.numpy(), arr)
        assert not np.shares_memory(written.numpy(), arr)  # fl.jit hands out the call's own copy
    assert f.captures == 1


def test_gradient_is_mul_times_g(rng: np.random.Generator) -> None:
    x, w = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    tx = fl.tensor(x.copy())
    (g,) = fl.grad((fl.ops.inplace_affine(tx, -1.5, 2.0) * w).sum(), [tx])
    np.testing.assert_array_equal(g.numpy(), -1.5 * w)


def test_bf16_values(rng: np.random.Generator) -> None:
    x = rng.standard_normal(1000).astype(ml_dtypes.bfloat16)
    got = fl.ops.inplace_affine(x.copy(), 0.1, 0.2).numpy()
    np.testing.assert_array_equal(got, _rounded_once(x, 0.1, 0.2))


@pytest.mark.parametrize(("build", "error", "message"), [
    (lambda: fl.ops.inplace_affine(np.zeros(3, np.int64), 2.0, 1.0), fl.DTypeError, "x must be a float tensor"),
    (lambda: fl.ops.inplace_affine(np.zeros(3), True, 1.0), fl.ParamError, "inplace_affine: mul must be a float"),
    (lambda: fl.ops.inplace_affine(np.zeros(3), 1.0, "1"), fl.ParamError, "inplace_affine: add must be a float"),
])
def test_bad_inputs_raise_at_build_time(build, error, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=message):
        build()
