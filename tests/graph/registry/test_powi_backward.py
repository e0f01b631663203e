"""PowIBackward (15) against torch autograd of pow in float64, every dtype; exp = 0, x = 0, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fuel as fl
from fuel.dtype import DType
from fuel.graph.registry.powi_backward import PowIBackwardParams, decompose
from fuel.testing.oracle import assert_close_rowwise

EXPONENTS = [-3, -2, -1, 0, 1, 2, 3, 7]
SPECIAL = [0.0, 0.5, -0.5, -2.0, 3.0, 1.0, -1.0, 1.5]


def torch_powi_grad(x: np.ndarray, w: np.ndarray, n: int) -> np.ndarray:
    x64 = torch.tensor(x.astype(np.float64), requires_grad=True)
    (want,) = torch.autograd.grad((torch.pow(x64, n) * torch.tensor(w.astype(np.float64))).sum(), [x64])
    return want.numpy()


def _inputs(dt: DType, shape: tuple[int, ...], rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """x with |x| in [0.25, 3] (every result inside f16's range), the special values first."""
    x = np.sign(rng.standard_normal(shape)) * np.clip(0.25 + np.abs(rng.standard_normal(shape)), 0.25, 3.0)
    flat = x.reshape(-1)
    k = min(flat.size, len(SPECIAL))
    flat[:k] = SPECIAL[:k]
    return x.astype(dt.np), rng.standard_normal(shape).astype(dt.np)


@pytest.mark.parametrize("n", EXPONENTS)
@pytest.mark.parametrize("shape", [(4, 33), (2, 3, 5), (1, 1), (0, 4), (8,), ()], ids=str)
def test_matches_torch_autograd(float_dtype: DType, n: int, shape: tuple[int, ...], rng: np.random.Generator) -> None:
    x, w = _inputs(float_dtype, shape, rng)
    got = fl.ops.powi_backward(x, w, n).numpy()
    assert got.dtype == float_dtype.np and got.shape == shape
    want = torch_powi_grad(x, w, n)
    # Each element is its own scale (a product, no sum): the bound is relative to the element.
    assert_close_rowwise(got, want, float_dtype, backward=True, scale=np.abs(want))


def test_exp_zero_is_zero_everywhere(float_dtype: DType) -> None:
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 2.0], float_dtype.np)
    g = np.array([1.0, np.inf, 2.0, np.nan, 3.0, -1.0], float_dtype.np)
    got = fl.ops.powi_backward(x, g, 0).numpy()
    np.testing.assert_array_equal(got.astype(np.float64), np.zeros(6))
    np.testing.assert_array_equal(torch_powi_grad(x[:1], np.ones(1), 0), [0.0])  # torch agrees at x = 0


def test_zero_base_with_negative_exponents_gives_minus_inf_like_torch(float_dtype: DType) -> None:
    x = np.zeros(3, float_dtype.np)
    g = np.ones(3, float_dtype.np)
    for n in (-1, -2, -3):
        got = fl.ops.powi_backward(x, g, n).numpy().astype(np.float64)
        np.testing.assert_array_equal(got, [-np.inf] * 3)
        np.testing.assert_array_equal(got, torch_powi_grad(x, g, n))


@pytest.mark.parametrize("dt", [DType.F32, DType.F64], ids=lambda d: d.value)
def test_same_bytes_as_the_primitive_graph(dt: DType, rng: np.random.Generator) -> None:
    """The kernel multiplies in the POWI primitive's order, then by exp, then by g: the primitive graph
    (POWI, MUL_SCALAR, MUL) gives the very same bytes in f32 and f64."""
    x, g = _inputs(dt, (6, 50), rng)
    x[0, :4] = [0.0, np.inf, -np.inf, np.nan]
    for n in [*EXPONENTS, 13, -9, 64]:
        fused = fl.ops.powi_backward(x, g, n).numpy()
        (lowered,) = fl.realize(decompose([fl.tensor(x), fl.tensor(g)], PowIBackwardParams(n)), fuse=False)
        np.testing.assert_array_equal(fused, lowered.numpy(), err_msg=str(n))


def test_non_contiguous_inputs(rng: np.random.Generator) -> None:
    base = rng.standard_normal((20, 12))
    x, g = base.T[::2], base[:, ::2].T
    got = fl.ops.powi_backward(x, g, 3).numpy()
    np.testing.assert_allclose(got, torch_powi_grad(x, g, 3), rtol=1e-14)


def test_gradient_of_the_backward_through_its_decomposition(rng: np.random.Generator) -> None:
    """Second derivative of x^n (n = 3 and -2) against torch's double backward; exp = 0 gives zeros."""
    x, g, w = rng.standard_normal((3, 5)) + 2, rng.standard_normal((3, 5)), rng.standard_normal((3, 5))
    for n in (3, -2, 0):
        tx, tg = fl.tensor(x), fl.tensor(g)
        loss = (fl.ops.powi_backward(tx, tg, n) * w).sum()
        got = fl.grad(loss, [tx, tg])
        if n == 0:  # a constant zero: both gradients are zeros
            for a in got:
                np.testing.assert_array_equal(a.numpy(), np.zeros_like(x))
            continue
        x64, g64 = torch.tensor(x, requires_grad=True), torch.tensor(g, requires_grad=True)
        (gx,) = torch.autograd.grad(torch.pow(x64, n), [x64], g64, create_graph=True)
        want = torch.autograd.grad((gx * torch.tensor(w)).sum(), [x64, g64])
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12)


@pytest.mark.parametrize(("build", "error", "message"), [
    (lambda: fl.ops.powi_backward(np.zeros((3, 5), np.float32), np.zeros((3, 4), np.float32), 2),
     fl.ShapeError, r"powi_backward: g has shape \[3, 4\], x has \[3, 5\]"),
    (lambda: fl.ops.powi_backward(np.zeros(3, np.float32), np.zeros(3), 2),
     fl.DTypeError, "powi_backward: g is f64, x is f32"),
    (lambda: fl.ops.powi_backward(np.zeros(3, np.int64), np.zeros(3, np.int64), 2),
     fl.DTypeError, "x must be a float tensor, got i64"),
    (lambda: fl.ops.powi_backward(np.zeros(3), np.zeros(3), 2.0), fl.ParamError, "exp must be an int, got 2.0"),
    (lambda: fl.ops.powi_backward(np.zeros(3), np.zeros(3), True), fl.ParamError, "exp must be an int, got True"),
    (lambda: fl.ops.powi_backward(np.zeros(3), np.zeros(3), 2**31), fl.ParamError, "outside"),
])
def test_bad_inputs_raise_at_build_time(build, error, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=message):
        build()
