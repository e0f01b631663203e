"""The Tensor builder: NumPy semantics for primitives, and build-time errors that say what went wrong."""

from __future__ import annotations

import operator

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.graph.node import Op


def _arr(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def test_elementwise_and_broadcasting_match_numpy(rng: np.random.Generator) -> None:
    a, b = _arr(rng, 3, 1, 5), _arr(rng, 4, 1)
    ta, tb = fl.tensor(a), fl.tensor(b)
    y = (ta + tb) * ta - tb / (ta.abs() + 1.0)
    assert y.node.inputs[0].op is Op.MUL
    np.testing.assert_allclose(y.numpy(), (a + b) * a - b / (np.abs(a) + 1.0), rtol=1e-6)
    np.testing.assert_allclose((2.0 - ta).numpy(), 2.0 - a, rtol=1e-6)
    np.testing.assert_allclose((3.0 / (ta.abs() + 1)).numpy(), 3.0 / (np.abs(a) + 1), rtol=1e-6)
    np.testing.assert_allclose((ta ** 3).numpy(), a * a * a, rtol=1e-6)
    np.testing.assert_allclose((ta.abs() ** 0.5).numpy(), np.sqrt(np.abs(a)), rtol=1e-6)
    np.testing.assert_allclose(ta.maximum(tb).numpy(), np.maximum(a, b))


@pytest.mark.parametrize("name", ["exp", "log", "sqrt", "rsqrt", "tanh", "sin", "cos", "sigmoid", "relu",
                                  "silu", "abs", "neg", "square", "recip", "sign", "floor"])
def test_unary_ops_match_numpy(rng: np.random.Generator, name: str) -> None:
    x = np.abs(_arr(rng, 4, 6)) + 0.1 if name in ("log", "sqrt", "rsqrt") else _arr(rng, 4, 6)
    ref = {
        "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "rsqrt": lambda v: 1 / np.sqrt(v), "tanh": np.tanh,
        "sin": np.sin, "cos": np.cos, "sigmoid": lambda v: 1 / (1 + np.exp(-v)), "relu": lambda v: np.maximum(v, 0),
        "silu": lambda v: v / (1 + np.exp(-v)), "abs": np.abs, "neg": np.negative, "square": np.square,
        "recip": lambda v: 1 / v, "sign": np.sign, "floor": np.floor,
    }[name](x.astype(np.float64))
    np.testing.assert_allclose(getattr(fl.tensor(x), name)().numpy(), ref, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["silu", "sigmoid"])
def test_exp_based_unary_ops_on_a_0d_tensor(name: str) -> None:
    x = np.array(-1.5, np.float32)
    ref = {"silu": x / (1 + np.exp(-x)), "sigmoid": 1 / (1 + np.exp(-x))}[name]
    got = getattr(fl.tensor(x), name)().numpy()
    assert got.shape == ()
    np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_reductions_match_numpy(rng: np.random.Generator) -> None:
    x = _arr(rng, 2, 3, 4)
    t = fl.tensor(x)
    for axis in (None, 0, -1, (0, 2), (1,)):
        for keepdim in (False, True):
            for name in ("sum", "max", "mean"):
                got = getattr(t, name)(axis, keepdim=keepdim).numpy()
                want = getattr(x, name)(axis=axis, keepdims=keepdim)
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{name} {axis} {keepdim}")


def test_keepdim_max_is_dim_reduce_then_unsqueeze() -> None:
    t = fl.tensor(np.zeros((2, 5), np.float32))
    m = t.max(-1, keepdim=True)
    assert m.node.op is Op.UNSQUEEZE and m.node.inputs[0].op is Op.MAX_DIM and m.shape == (2, 1)


def test_movement_ops_match_numpy(rng: np.random.Generator) -> None:
    x = _arr(rng, 2, 3, 4)
    t = fl.tensor(x)
    np.testing.assert_array_equal(t.reshape(4, -1).numpy(), x.reshape(4, -1))
    np.testing.assert_array_equal(t.permute(2, 0, 1).numpy(), x.transpose(2, 0, 1))
    np.testing.assert_array_equal(t.transpose().numpy(), x.swapaxes(-1, -2))
    np.testing.assert_array_equal(t.T.numpy(), x.T)
    np.testing.assert_array_equal(t.unsqueeze(1).numpy(), x[:, None])
    np.testing.assert_array_equal(t[:, :1].squeeze().numpy(), x[:, :1].squeeze())
    np.testing.assert_array_equal(t[1, ::2, None, -1].numpy(), x[1, ::2, None, -1])
    np.testing.assert_array_equal(t[..., 1:3].numpy(), x[..., 1:3])
    np.testing.assert_array_equal(t[:, 5:].numpy(), x[:, 5:])
    np.testing.assert_array_equal(t.broadcast_to(3, 2, 3, 4).numpy(), np.broadcast_to(x, (3, 2, 3, 4)))
    np.testing.assert_array_equal(fl.concat([t, t[:, :1]], axis=1).numpy(), np.concatenate([x, x[:, :1]], 1))
    np.testing.assert_array_equal(fl.pad(t, [(0, 0), (1, 2), (0, 1)], 7.0).numpy(),
                                  np.pad(x, [(0, 0), (1, 2), (0, 1)], constant_values=7.0))
    assert t.contiguous().numpy().flags.c_contiguous


def test_matmul_broadcasts_batch_and_promotes_vectors(rng: np.random.Generator) -> None:
    a, w, v = _arr(rng, 2, 3, 4), _arr(rng, 4, 5), _arr(rng, 4)
    a64, w64, v64 = (t.astype(np.float64) for t in (a, w, v))
    ta = fl.tensor(a)
    # float64 einsum, not the np.matmul call the primitive makes
    np.testing.assert_allclose((ta @ fl.tensor(w)).numpy(), np.einsum("bik,kj->bij", a64, w64), rtol=1e-5)
    np.testing.assert_allclose((ta @ v).numpy(), np.einsum("bik,k->bi", a64, v64), rtol=1e-5)
    np.testing.assert_allclose(fl.matmul(v, w).numpy(), np.einsum("k,kj->j", v64, w64), rtol=1e-5)


def test_matmul_half_types_compute_in_f32(rng: np.random.Generator) -> None:
    k = 512
    a = _arr(rng, 8, k).astype(ml_dtypes.bfloat16)
    b = _arr(rng, k, 4).astype(ml_dtypes.bfloat16)
    got = (fl.tensor(a) @ fl.tensor(b)).numpy()
    assert got.dtype == ml_dtypes.bfloat16
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    want = np.einsum("ik,kj->ij", a64, b64)  # exact products, f64 sums
    # One rounding to bf16 (half an ulp, 2^-8 relative at most) plus f32 accumulation error; a product
    # summed in bf16 would be off by several bf16 ulps.
    ulp = 2.0 ** (np.floor(np.log2(np.abs(want))) - 7)
    bound = 0.5 * ulp + k * 2.0**-23 * (np.abs(a64) @ np.abs(b64))
    assert np.all(np.abs(got.astype(np.float64) - want) <= bound)


def test_indexing_ops_and_where(rng: np.random.Generator) -> None:
    x = _arr(rng, 3, 5)
    t = fl.tensor(x)
    idx = np.array([4, 0, 0], np.uint32)
    np.testing.assert_array_equal(t.index_select(1, idx).numpy(), x[:, idx])
    g = np.array([[1], [0], [4]], np.int64)
    np.testing.assert_array_equal(t.gather(1, g).numpy(), np.take_along_axis(x, g, 1))
    np.testing.assert_array_equal(fl.where(t > 0, t, 0.0).numpy(), np.where(x > 0, x, 0))
    assert (t == t).numpy().dtype == np.uint8 and (t != t).numpy().sum() == 0
    np.testing.assert_array_equal(t.cast(fl.bf16).numpy(), x.astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(t.cast(fl.i64).numpy(), x.astype(np.int64))


def test_out_of_range_indices_are_checked(rng: np.random.Generator) -> None:
    t = fl.tensor(_arr(rng, 3, 5))
    with pytest.raises(fl.IndexOutOfRange, match="index 5 is out of range for an axis of size 5"):
        t.index_select(1, np.array([5], np.uint32)).numpy()
    with pytest.raises(fl.IndexOutOfRange, match="gather"):
        t.gather(1, np.full((3, 1), -1, np.int64)).numpy()


@pytest.mark.parametrize(("build", "error", "message"), [
    (lambda a, b: a + b, fl.ShapeError, r"add: shapes \[2, 3\] and \[4\] do not broadcast"),
    (lambda a, b: a @ a, fl.ShapeError, r"matmul: a has K=3 but b has K=2"),
    (lambda a, b: a.cast(fl.u8) + 300, fl.DTypeError, "add: the Python int 300 is out of range for u8"),
    (lambda a, b: a.cast("f99"), fl.DTypeError, "cast: 'f99' is not a dtype Fuel stores; valid names: f32, f64"),
    (lambda a, b: fl.zeros((2, 3), "bogus"), fl.DTypeError, "zeros: 'bogus' is not a dtype Fuel stores"),
    (lambda a, b: a.reshape(7), fl.ShapeError, r"reshape: cannot reshape \[2, 3\]"),
    (lambda a, b: a.permute(0, 0), fl.ShapeError, "permute"),
    (lambda a, b: a.sum(axis=2), fl.ShapeError, "sum: axis 2 is out of range for rank 2"),
    (lambda a, b: a[3], fl.ShapeError, "getitem: index 3 is out of range for axis 0 of size 2"),
    (lambda a, b: a[::-1], fl.ShapeError, "positive steps only"),
    (lambda a, b: a.squeeze(0), fl.ShapeError, r"squeeze: axis 0 of \[2, 3\] is not of size 1"),
    (lambda a, b: fl.concat([a, b], 0), fl.ShapeError, "concat"),
    (lambda a, b: a.cast(fl.i64).exp(), fl.DTypeError, "exp: needs a float input, got i64"),
    (lambda a, b: fl.where(a, a, a), fl.DTypeError, "where: condition must be u8"),
    (lambda a, b: a.broadcast_to(4, 3), fl.ShapeError, "broadcast_to"),
    (lambda a, b: fl.pad(a, [(1, 1)]), fl.ShapeError, "pad"),
    (lambda a, b: a.index_select(0, np.zeros(2, np.float32)), fl.DTypeError, "index_select: indices must be"),
])
def test_malformed_builds_raise_at_build_time(build, error, message) -> None:  # type: ignore[no-untyped-def]
    a = fl.tensor(np.zeros((2, 3), np.float32))
    b = fl.tensor(np.zeros((4,), np.float32))
    with pytest.raises(error, match=message):
        build(a, b)


def test_user_arrays_are_never_written(rng: np.random.Generator) -> None:
    x = _arr(rng, 4, 8)
    before = x.copy()
    t = fl.tensor(x)
    fl.realize(fl.ops.softmax_last_dim(t), (t * 2).exp(), t.softmax(0))
    np.testing.assert_array_equal(x, before)


def test_realised_values_are_read_only_and_cached(rng: np.random.Generator) -> None:
    t = fl.tensor(_arr(rng, 3)) * 2.0
    v = t.numpy()
    assert not v.flags.writeable
    assert np.shares_memory(t.numpy(), v)
    np.testing.assert_array_equal((t + 1.0).numpy(), v + np.float32(1.0))
    with pytest.raises(fl.ShapeError, match="item"):
        t.item()
    assert fl.tensor(np.array([2.5], np.float32)).item() == 2.5


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.data())
def test_broadcast_binary_ops_match_numpy_for_any_shapes(shape: list[int], data: st.DataObject) -> None:
    other = [d if data.draw(st.booleans()) else 1 for d in shape][data.draw(st.integers(0, len(shape) - 1)):]
    rng = np.random.default_rng(len(shape))
    a, b = _arr(rng, *shape), _arr(rng, *other)
    got = (fl.tensor(a) - fl.tensor(b) * fl.tensor(a)).numpy()
    np.testing.assert_allclose(got, a - b * a, rtol=1e-6)


def test_python_conversions_realise_one_element_tensors() -> None:
    t = fl.tensor(np.array([[2.75]], np.float32)) * 2.0
    assert float(t) == 5.5 and t.node.value is not None
    assert int(t) == 5 and bool(t) is True and bool(t * 0.0) is False
    i = fl.tensor(np.array([3], np.int64)) + 1
    assert operator.index(i) == 4 and list(range(i)) == [0, 1, 2, 3]
    assert [10, 20, 30, 40, 50][i] == 50
    assert float(fl.tensor(np.array(1.5, ml_dtypes.bfloat16))) == 1.5
    with pytest.raises(fl.DTypeError, match="index: needs an integer tensor, got f32"):
        operator.index(t)
    many = fl.tensor(np.zeros((2, 3), np.float32))
    with pytest.raises(fl.ShapeError, match=r"bool: the truth value of a tensor of shape \[2, 3\] is ambiguous"):
        bool(many)
    with pytest.raises(fl.ShapeError, match=r"float: needs exactly one element, tensor has shape \[2, 3\]"):
        float(many)
    with pytest.raises(fl.ShapeError, match="int: needs exactly one element"):
        int(many)


def test_array_protocol_honours_copy(rng: np.random.Generator) -> None:
    x = _arr(rng, 3, 4)
    t = fl.tensor(x)
    fresh = np.array(t, copy=True)
    assert fresh.flags.writeable and not np.shares_memory(fresh, x)
    fresh[0, 0] = 99.0
    assert x[0, 0] != 99.0 and t.numpy()[0, 0] == x[0, 0]
    assert not np.shares_memory(np.array(t), x)  # np.array copies by default
    view = np.asarray(t)  # copy=None: the realised (read-only) array may be returned as it is
    np.testing.assert_array_equal(view, x)
    assert not view.flags.writeable
    assert np.shares_memory(np.array(t, copy=False), x)
    wide = np.asarray(t, dtype=np.float64)
    assert wide.dtype == np.float64 and wide.flags.writeable
    np.testing.assert_array_equal(wide, x.astype(np.float64))
    with pytest.raises(ValueError, match="copy=False"):
        np.array(t, dtype=np.float64, copy=False)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: fl.zeros((2, -3)), r"zeros: dimension -3 of \[2, -3\] is negative"),
    (lambda: fl.full((-1, 3), 1.0), r"full: dimension -1 of \[-1, 3\] is negative"),
    (lambda: fl.ones(-2), r"ones: dimension -2 of \[-2\] is negative"),
    (lambda: fl.tensor(np.ones(1, np.float32)).broadcast_to(2, -3), r"broadcast_to: dimension -3 of \[2, -3\]"),
    (lambda: fl.tensor(np.ones(1, np.float32)).broadcast_to(-1), r"broadcast_to: dimension -1 of \[-1\]"),
    (lambda: fl.tensor(np.ones(6, np.float32)).reshape(-2, -3), r"reshape: at most one -1 and no other negative"),
    (lambda: fl.tensor(np.ones(6, np.float32)).reshape(-1, -2), r"reshape: at most one -1 and no other negative"),
])
def test_negative_dimensions_are_a_build_time_shape_error(build, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(fl.ShapeError, match=message):
        build()


def test_reshape_still_infers_one_dimension() -> None:
    assert fl.tensor(np.ones(6, np.float32)).reshape(-1, 3).shape == (2, 3)
    assert fl.zeros((0, 3)).reshape(-1).shape == (0,)
    assert fl.zeros(3).shape == (3,) and fl.zeros(()).shape == ()


@pytest.mark.parametrize(("build", "op", "what"), [
    (lambda t, n: t.reshape(n, 3), "reshape", "a dimension"),
    (lambda t, n: t.reshape((n, 3)), "reshape", "a dimension"),
    (lambda t, n: t.broadcast_to(2, n, 3), "broadcast_to", "a dimension"),
    (lambda t, n: t.sum(axis=n), "sum", "an axis"),
    (lambda t, n: t.mean(axis=(0, n)), "mean", "an axis"),
    (lambda t, n: t.permute(n, 0), "permute", "an axis"),
    (lambda t, n: fl.pad(t, [(n, 0), (0, 0)]), "pad", "a pad width"),
    (lambda t, n: fl.full((n, 3), 1.0), "full", "a dimension"),
    (lambda t, n: fl.zeros(n), "zeros", "a dimension"),
    (lambda t, n: fl.ones((2, n)), "ones", "a dimension"),
])
def test_a_dynscalar_as_a_size_is_a_clear_error(build, op: str, what: str) -> None:  # type: ignore[no-untyped-def]
    t = fl.tensor(np.zeros((2, 3), np.float32))
    with pytest.raises(fl.ParamError, match=rf"{op}: a DynScalar \('n'\) is not supported as {what}"):
        build(t, fl.dyn("n"))


def test_tensor_const_takes_a_read_only_snapshot_without_touching_the_callers_array() -> None:
    w = np.arange(4, dtype=np.float32)
    tc = fl.tensor(w, const=True)
    assert w.flags.writeable and not np.shares_memory(tc.numpy(), w)  # the caller's array is left as it was
    w[:] = -1.0
    np.testing.assert_array_equal(tc.numpy(), np.arange(4))
    frozen = _read_only(np.arange(4, dtype=np.float32))
    assert np.shares_memory(fl.tensor(frozen, const=True).numpy(), frozen)  # already constant: no copy
    with pytest.raises(fl.ParamError, match="const=True takes an array, got a Tensor"):
        fl.tensor(tc, const=True)


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a
