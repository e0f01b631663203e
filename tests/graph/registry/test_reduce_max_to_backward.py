"""ReduceMaxToBackward (10) against torch.amax's autograd in float64, every dtype; NaN, -inf, bad input.

Each element of the result is g/ties of its own group, one correctly rounded division (the kernel's
contract), or 0: it is compared on its own magnitude, within half an ulp of its format (plus the
reference's own f64 rounding). A row or tensor scale would let a group with a small g hide behind a
large g elsewhere in the row, and with the target [4, 1, 6] a last-axis row is not a group at all.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import fuel as fl
from fuel.dtype import DType
from fuel.graph.registry.reduce_max_to_backward import ReduceMaxToBackwardParams, decompose
from fuel.graph.shapes import reduce_to_axes
from fuel.testing.check import excess, floor_of, nonfinite_mismatch

# (x shape, target): last axis keepdim (softmax's max), last two axes, leading axes dropped, a middle
# axis, reduced axes apart from each other, full reduction, nothing reduced, size-1 and empty axes.
TARGETS = [
    ((6, 40), (6, 1)), ((2, 3, 17), (2, 1, 1)), ((4, 3, 9), (9,)), ((4, 5, 6), (4, 1, 6)),
    ((3, 20, 300), (3, 1, 300)), ((4, 5, 6), (1, 5, 1)), ((3, 50), ()), ((5, 1), (5, 1)), ((1, 1), (1,)),
    ((5, 1), (1, 1)), ((0, 8), (0, 1)), ((2, 0, 3), (2, 0, 1)), ((), ()), ((6, 1, 9), (1, 9)),
]


def _fused_ids(t: fl.trace) -> list[str]:  # type: ignore[valid-type]
    return [r.impl for r in t.records if not r.impl.startswith("prim:")]  # type: ignore[attr-defined]


def torch_amax_grad(x: np.ndarray, g: np.ndarray) -> np.ndarray:
    """torch.amax(x64, reduced axes, keepdim=True) backward with g: ties share equally."""
    axes = reduce_to_axes("amax", x.shape, g.shape)
    keep = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    x64 = torch.tensor(x.astype(np.float64), requires_grad=True)
    if not axes:  # torch.amax(dim=()) would reduce every axis: nothing reduced is the identity
        return np.broadcast_to(g.astype(np.float64).reshape(keep), x.shape).copy()
    y = torch.amax(x64, dim=axes, keepdim=True)
    (want,) = torch.autograd.grad(y, [x64], torch.tensor(g.astype(np.float64).reshape(keep)))
    return want.numpy()


def assert_one_rounding(got: np.ndarray, want: np.ndarray, dt: DType) -> None:
    """Every element within half an ulp of `dt` of the float64 oracle, on its own magnitude; NaN and
    ±inf exactly where the oracle has them."""
    why = nonfinite_mismatch(got, want)
    assert why is None, why
    half_ulp = float(ml_dtypes.finfo(dt.np).eps) / 2 + 2.0**-52  # + the oracle's f64 division
    ratio = excess(got, want, np.abs(want), 0.0, half_ulp, floor_of(dt.np))
    bad = int((ratio > 1.0).sum())
    assert bad == 0, f"{bad} of {ratio.size} elements off; worst |err|/allowed {ratio.max():.3g} ({dt.value})"


@pytest.mark.parametrize(("shape", "target"), TARGETS, ids=str)
def test_matches_torch_amax_autograd(float_dtype: DType, shape: tuple[int, ...], target: tuple[int, ...],
                                     rng: np.random.Generator) -> None:
    x = (rng.standard_normal(shape) * 3).astype(float_dtype.np)
    g = rng.standard_normal(target).astype(float_dtype.np)
    with fl.trace() as t:
        got = fl.ops.reduce_max_to_backward(x, g).numpy()
    assert got.dtype == float_dtype.np and got.shape == shape
    if x.size:
        assert _fused_ids(t) == [f"ReduceMaxToBackward[cpu:{','.join([float_dtype.value] * 3)}]"]
    assert_one_rounding(got, torch_amax_grad(x, g), float_dtype)


def test_a_small_group_is_not_hidden_by_a_large_one(float_dtype: DType, rng: np.random.Generator) -> None:
    """Target [4, 1, 6]: the groups are columns, and a last-axis row holds maxima of several groups. With
    group (0, 0)'s g 1e-3 of the others', a 1% error in its share must fail."""
    x = (rng.standard_normal((4, 5, 6)) * 3).astype(float_dtype.np)
    g64 = rng.standard_normal((4, 1, 6))
    g64[:, :, 0] *= 1e-3
    g = g64.astype(float_dtype.np)
    got = fl.ops.reduce_max_to_backward(x, g).numpy()
    want = torch_amax_grad(x, g)
    assert_one_rounding(got, want, float_dtype)
    hit = (0, int(np.argmax(x[0, :, 0])), 0)  # the maximum of group (0, 0)
    wrong = got.copy()
    wrong[hit] = float_dtype.np.type(float(got[hit]) * 1.01)
    with pytest.raises(AssertionError, match="1 of 120 elements off"):
        assert_one_rounding(wrong, want, float_dtype)


@pytest.mark.parametrize("target", [(6, 4, 1), (4, 20), (6, 1, 20), (1, 4, 1)], ids=str)
def test_ties_share_equally_like_torch(float_dtype: DType, target: tuple[int, ...], rng: np.random.Generator) -> None:
    x = np.round(rng.standard_normal((6, 4, 20))).astype(float_dtype.np)  # many tied maxima per group
    g = rng.standard_normal(target).astype(float_dtype.np)
    got = fl.ops.reduce_max_to_backward(x, g).numpy()
    assert_one_rounding(got, torch_amax_grad(x, g), float_dtype)


def test_the_documented_tie_example() -> None:
    got = fl.ops.reduce_max_to_backward(np.array([1.0, 3.0, 3.0, 2.0], np.float32), np.ones(1, np.float32))
    np.testing.assert_array_equal(got.numpy(), [0.0, 0.5, 0.5, 0.0])


def test_minus_inf(float_dtype: DType) -> None:
    """An all -inf group has max -inf and every element ties; -inf beside finite values gets 0."""
    x = np.array([[-np.inf] * 4, [-np.inf, 2.0, -np.inf, 1.0]], float_dtype.np)
    g = np.array([[2.0], [3.0]], float_dtype.np)
    got = fl.ops.reduce_max_to_backward(x, g).numpy().astype(np.float64)
    np.testing.assert_array_equal(got, [[0.5] * 4, [0.0, 3.0, 0.0, 0.0]])
    np.testing.assert_array_equal(got, torch_amax_grad(x, g))


@pytest.mark.parametrize("target", [(4, 1), (5,)], ids=str)
def test_nan_groups_share_among_their_nans(float_dtype: DType, target: tuple[int, ...]) -> None:
    """Documented: a group holding NaN has max NaN (as REDUCE_MAX_TO), and g is shared among its NaN
    elements; the others get 0. torch.amax gives NaN gradients there, so it is no oracle."""
    nan = np.nan
    x = np.array([[1.0, nan, 3.0, nan, 0.0], [nan] * 5, [2.0, 2.0, -np.inf, 1.0, 0.0], [0.0] * 5], float_dtype.np)
    g = np.full(target, 4.0, float_dtype.np)
    got = fl.ops.reduce_max_to_backward(x, g).numpy().astype(np.float64)
    if target == (4, 1):
        want = [[0, 2, 0, 2, 0], [0.8] * 5, [2, 2, 0, 0, 0], [0.8] * 5]
    else:  # row 1 is all NaN, so every column holds NaN: columns 1 and 3 hold two
        want = [[0, 2, 0, 2, 0], [4, 2, 4, 2, 4], [0] * 5, [0] * 5]
    np.testing.assert_allclose(got, np.array(want, np.float64), rtol=2 ** -7)
    assert np.isfinite(got).all()


def test_agrees_with_the_primitive_decomposition(float_dtype: DType, rng: np.random.Generator) -> None:
    """The kernel and the (fuse=False) primitive graph: the same mask, the same one division."""
    x = np.round(rng.standard_normal((5, 7, 6)) * 2).astype(float_dtype.np)
    x[0, 0, 0] = np.nan
    x[1, :, 2] = -np.inf
    for target in [(5, 7, 1), (7, 6), (5, 1, 6), (1, 7, 1), ()]:
        g = rng.standard_normal(target).astype(float_dtype.np)
        fused = fl.ops.reduce_max_to_backward(x, g).numpy()
        (lowered,) = fl.realize(decompose([fl.tensor(x), fl.tensor(g)], ReduceMaxToBackwardParams()),
                                fuse=False)
        np.testing.assert_array_equal(fused, lowered.numpy(), err_msg=str(target))


def test_non_contiguous_inputs(rng: np.random.Generator) -> None:
    base = rng.standard_normal((30, 8)).astype(np.float32)
    gbase = rng.standard_normal((8, 6)).astype(np.float32)
    for x, g in [(base.T[::4], gbase[::4, :1]), (base.T, gbase[:1, ::6].repeat(30, 1)), (base[::3], gbase.T[:1])]:
        assert not (x.flags.c_contiguous and g.flags.c_contiguous)
        got = fl.ops.reduce_max_to_backward(x, g).numpy()
        assert_one_rounding(got, torch_amax_grad(x, g), DType.F32)


def test_gradient_of_the_backward_through_its_decomposition(rng: np.random.Generator) -> None:
    """d/dg of Σ w·grad is w·mask/ties reduced back: compare with torch's double backward."""
    x, g, w = rng.standard_normal((4, 9)), rng.standard_normal((4, 1)), rng.standard_normal((4, 9))
    tg = fl.tensor(g)
    loss = (fl.ops.reduce_max_to_backward(x, tg) * w).sum()
    (got,) = fl.grad(loss, [tg])
    g64 = torch.tensor(g, requires_grad=True)
    x64 = torch.tensor(x, requires_grad=True)
    (gx,) = torch.autograd.grad(torch.amax(x64, 1, keepdim=True), [x64], g64, create_graph=True)
    (want,) = torch.autograd.grad((gx * torch.tensor(w)).sum(), [g64])
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12)


@pytest.mark.parametrize(("build", "error", "message"), [
    (lambda: fl.ops.reduce_max_to_backward(np.zeros((3, 4), np.float32), np.zeros((3, 2), np.float32)),
     fl.ShapeError, r"reduce_max_to_backward: g has shape \[3, 2\], which is not a reduce-to target of x's \[3, 4\]"),
    (lambda: fl.ops.reduce_max_to_backward(np.zeros(4, np.float32), np.zeros((2, 4), np.float32)),
     fl.ShapeError, "more axes than input"),
    (lambda: fl.ops.reduce_max_to_backward(np.zeros((3, 0), np.float32), np.zeros((3, 1), np.float32)),
     fl.ShapeError, "has an empty axis to take the max over"),
    (lambda: fl.ops.reduce_max_to_backward(np.zeros((3, 4), np.float32), np.zeros((3, 1))),
     fl.DTypeError, "reduce_max_to_backward: g is f64, x is f32"),
    (lambda: fl.ops.reduce_max_to_backward(np.zeros((3, 4), np.int64), np.zeros((3, 1), np.int64)),
     fl.DTypeError, "x must be a float tensor, got i64"),
])
def test_bad_inputs_raise_at_build_time(build, error, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=message):
        build()
