"""Powers: x ** number, x ** tensor and number ** x, forward and gradient, against torch in every dtype."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import fuel as fl
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.node import Op

TORCH = {fl.f32: torch.float32, fl.f64: torch.float64, fl.bf16: torch.bfloat16, fl.f16: torch.float16}
# Elementwise work rounds once to the dtype; torch computes half types in f32 too, so a couple of ulps.
RTOL = {fl.f32: 1e-6, fl.f64: 1e-14, fl.bf16: 1.6e-2, fl.f16: 2e-3}

BASES = np.array([0.0, 0.0, 0.5, 1.0, 1.7, 3.0, -1.0, -2.5], np.float64)


def _torch(a: np.ndarray, dtype: DType, grad: bool = True) -> torch.Tensor:
    return torch.tensor(a.astype(np.float64), dtype=TORCH[dtype], requires_grad=grad)


def _check(got: np.ndarray, want: torch.Tensor, dtype: DType) -> None:
    w = want.detach().to(torch.float64).numpy()
    g = np.asarray(got, dtype=np.float64)
    assert np.array_equal(np.isnan(g), np.isnan(w)), (g, w)
    fin = np.isfinite(w)
    assert np.array_equal(g[~fin & ~np.isnan(w)], w[~fin & ~np.isnan(w)]), (g, w)
    np.testing.assert_allclose(g[fin], w[fin], rtol=2 * RTOL[dtype], atol=1e-30)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.value)
# Exponents exact in every dtype: torch rounds a scalar exponent to a half tensor's dtype, Fuel does not.
@pytest.mark.parametrize("p", [2.5, 0.375, -1.5, 1.0078125, 7.25])
def test_real_exponent_and_its_gradient_match_torch(dtype: DType, p: float) -> None:
    x = BASES.astype(dtype.np)
    t = fl.tensor(x)
    y = t ** p
    assert y.node.op is Op.POW_SCALAR
    (g,) = fl.grad(y.sum(), [t])
    tx = _torch(x, dtype)
    ty = tx ** p
    ty.sum().backward()
    _check(y.numpy(), ty, dtype)
    _check(g.numpy(), tx.grad, dtype)  # type: ignore[arg-type]


def test_gradient_of_a_real_power_at_zero_is_zero_not_nan() -> None:
    x = fl.tensor(np.zeros(3, np.float32))
    (g,) = fl.grad((x ** 2.5).sum(), [x])
    np.testing.assert_array_equal(g.numpy(), np.zeros(3, np.float32))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.value)
def test_tensor_exponent_broadcasts_and_both_gradients_match_torch(dtype: DType) -> None:
    rng = np.random.default_rng(2)
    x = np.concatenate([BASES, np.abs(rng.standard_normal(4)) + 0.1]).reshape(3, 4).astype(dtype.np)
    e = np.array([0.0, 2.0, -0.5, 1.5], np.float64).astype(dtype.np)
    tx, te = fl.tensor(x), fl.tensor(e)
    y = tx ** te
    w = rng.standard_normal((3, 4))
    gx, ge = fl.grad(y, [tx, te], grad_out=w.astype(dtype.np))
    px, pe = _torch(x, dtype), _torch(e, dtype)
    py = px ** pe
    py.backward(torch.tensor(w, dtype=TORCH[dtype]))
    _check(y.numpy(), py, dtype)
    _check(gx.numpy(), px.grad, dtype)  # type: ignore[arg-type]
    if dtype in (fl.f32, fl.f64):  # a sum over rows: half types accumulate differently from torch
        _check(ge.numpy(), pe.grad, dtype)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.value)
def test_number_to_a_tensor_power_matches_torch(dtype: DType) -> None:
    e = np.array([-2.0, -0.5, 0.0, 0.5, 3.0], np.float64).astype(dtype.np)
    for base in (2, 0.5, 0.0):
        te = fl.tensor(e)
        y = base ** te
        assert y.dtype is dtype
        (g,) = fl.grad(y.sum(), [te])
        pe = _torch(e, dtype)
        py = torch.pow(base, pe)
        py.sum().backward()
        _check(y.numpy(), py, dtype)
        _check(g.numpy(), pe.grad, dtype)  # type: ignore[arg-type]


def test_numpy_scalar_exponents_are_numbers_and_promote_like_numpy() -> None:
    x = np.array([0.5, 1.5, 2.0], np.float16)
    t = fl.tensor(x)
    y = t ** np.float32(2.0)
    assert y.node.op is Op.POWI and y.dtype is fl.f32
    np.testing.assert_array_equal(y.numpy(), (x ** np.float32(2.0)))
    assert (t ** np.int64(3)).dtype is fl.tensor(x ** np.int64(3)).dtype
    assert (fl.tensor(x.astype(np.float32)) ** np.float64(2.5)).dtype is fl.f64
    np.testing.assert_allclose((t ** np.float16(2.5)).numpy().astype(np.float64), x.astype(np.float64) ** 2.5,
                               rtol=2e-3)
    bf = fl.tensor(x.astype(ml_dtypes.bfloat16))
    assert (bf ** 2.5).dtype is fl.bf16


def test_integer_tensors_and_bad_exponents() -> None:
    i = fl.tensor(np.array([1, 2, 3], np.int64))
    np.testing.assert_array_equal((i ** 2).numpy(), np.array([1, 4, 9]))
    y = i ** 0.5
    assert y.dtype is fl.f32
    np.testing.assert_allclose(y.numpy(), np.sqrt([1, 2, 3]), rtol=1e-6)
    with pytest.raises(fl.DTypeError, match="pow: an integer tensor"):
        i ** -1
    with pytest.raises(fl.DTypeError, match="pow: needs float operands, got i64"):
        i ** i
    with pytest.raises(fl.DTypeError, match="pow: exponent must be a number or a tensor, got str"):
        fl.tensor(np.ones(2, np.float32)) ** "2"  # type: ignore[operator]


def test_integral_and_half_exponents_keep_the_nodes_the_fusion_patterns_match() -> None:
    t = fl.tensor(np.ones(4, np.float32))
    assert (t ** 2).node.op is Op.POWI and (t ** 2.0).node.op is Op.POWI
    assert (t ** 0.5).node.op is Op.SQRT and (t ** -0.5).node.op is Op.RSQRT


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.value)
@pytest.mark.parametrize(("sx", "se"), [((0, 3), (3,)), ((2, 0), (1,)), ((2, 3), (0, 1, 3)), ((0,), ())])
def test_zero_size_powers_and_their_gradients_match_torch(dtype: DType, sx: tuple[int, ...],
                                                          se: tuple[int, ...]) -> None:
    x = np.full(sx, 1.5).astype(dtype.np)
    e = np.full(se, 2.5).astype(dtype.np)
    tx, te = fl.tensor(x), fl.tensor(e)
    px, pe = _torch(x, dtype), _torch(e, dtype)
    for y, py, wrt, leaves in ((tx ** te, px ** pe, [tx, te], [px, pe]), (tx ** 2.5, px ** 2.5, [tx], [px]),
                               (2.0 ** tx, torch.pow(2.0, px), [tx], [px])):
        assert y.shape == tuple(py.shape) and y.dtype is dtype
        _check(y.numpy(), py, dtype)
        grads = fl.grad(y.sum(), wrt)
        for leaf in leaves:
            leaf.grad = None
        py.sum().backward()
        for g, leaf in zip(grads, leaves, strict=True):
            assert g.shape == tuple(leaf.shape)
            _check(g.numpy(), leaf.grad, dtype)  # type: ignore[arg-type]
