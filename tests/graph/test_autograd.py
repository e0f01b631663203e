"""Primitive VJPs against torch autograd in float64."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import fuel as fl


def _check(fn_fuel: Callable[..., fl.Tensor], fn_torch: Callable[..., Any], *arrays: np.ndarray,
           fuse: bool = True) -> None:
    ts = [fl.tensor(a) for a in arrays]
    out = fn_fuel(*ts)
    g_np = np.random.default_rng(7).standard_normal(out.shape)
    grads = fl.grad(out, ts, grad_out=fl.tensor(g_np), fuse=fuse)
    tt = [torch.tensor(a, requires_grad=True) for a in arrays]
    tout = fn_torch(*tt)
    want = torch.autograd.grad(tout, tt, grad_outputs=torch.tensor(g_np), allow_unused=True)
    np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, want, strict=True):
        w_np = np.zeros(g.shape) if w is None else w.numpy()
        np.testing.assert_allclose(g.numpy(), w_np, rtol=1e-10, atol=1e-12)


def _x(*shape: int, positive: bool = False, seed: int = 0) -> np.ndarray:
    a = np.random.default_rng(seed).standard_normal(shape)
    return np.abs(a) + 0.5 if positive else a


CASES: list[tuple[str, Callable[..., Any], Callable[..., Any], tuple[np.ndarray, ...]]] = [
    ("arith", lambda a, b: (a * b - a / b + b) * 2.0 + 1.0,
     lambda a, b: (a * b - a / b + b) * 2.0 + 1.0, (_x(3, 4), _x(3, 4, positive=True, seed=1))),
    ("broadcast", lambda a, b: a * b, lambda a, b: a * b, (_x(3, 1, 4), _x(5, 1, seed=1))),
    ("unary", lambda a: a.exp().tanh() + a.sin() * a.cos() + a.sigmoid() + a.silu() + a.relu() + a.abs(),
     lambda a: a.exp().tanh() + a.sin() * a.cos() + a.sigmoid() + torch.nn.functional.silu(a) + a.relu() + a.abs(),
     (_x(4, 5),)),
    ("roots", lambda a: a.sqrt() + a.rsqrt() + a.log() + a.recip() + a.square() + a ** 3 + a ** -2,
     lambda a: a.sqrt() + a.rsqrt() + a.log() + a.reciprocal() + a.square() + a ** 3 + a ** -2,
     (_x(4, 5, positive=True),)),
    ("reductions", lambda a: a.sum(-1, keepdim=True) * a.mean(0) + a.max(1, keepdim=True) + a.sum() + a.max(),
     lambda a: a.sum(-1, keepdim=True) * a.mean(0) + a.amax(1, keepdim=True) + a.sum() + a.amax(),
     (_x(3, 4),)),
    ("multi-axis", lambda a: a.sum((0, 2)) + a.max((0, 2)) + a.mean((0, 1), keepdim=True).sum(),
     lambda a: a.sum((0, 2)) + a.amax((0, 2)) + a.mean((0, 1), keepdim=True).sum(), (_x(2, 3, 4),)),
    ("movement",
     lambda a: (a.reshape(4, 3).transpose() + a.permute(1, 0)[:, 1:3].sum(-1, keepdim=True).transpose()).unsqueeze(0),
     lambda a: (a.reshape(4, 3).t() + a.permute(1, 0)[:, 1:3].sum(-1, keepdim=True).t()).unsqueeze(0), (_x(3, 4),)),
    ("strided slice", lambda a: a[1:, ::3] * 2.0, lambda a: a[1:, ::3] * 2.0, (_x(3, 10),)),
    ("concat pad", lambda a, b: fl.pad(fl.concat([a, b], 1), [(1, 0), (0, 2)], 3.0),
     lambda a, b: torch.nn.functional.pad(torch.cat([a, b], 1), (0, 2, 1, 0), value=3.0), (_x(2, 3), _x(2, 2))),
    ("matmul", lambda a, b: a @ b, lambda a, b: a @ b, (_x(2, 3, 4), _x(4, 5, seed=1))),
    ("maximum ties", lambda a, b: a.maximum(b) + a.minimum(b),
     lambda a, b: torch.maximum(a, b) + torch.minimum(a, b), (np.array([1.0, 2, 3]), np.array([1.0, 0, 4]))),
    ("max ties share", lambda a: a.max(-1), lambda a: a.amax(-1), (np.array([[1.0, 3, 3, 2], [0, 0, 0, 0]]),)),
    ("where", lambda a, b: fl.where(a > b, a * a, b), lambda a, b: torch.where(a > b, a * a, b),
     (_x(3, 4), _x(3, 4, seed=1))),
    ("gather", lambda a: a.gather(1, np.array([[0, 0], [2, 1]], np.int64)) * 3.0,
     lambda a: a.gather(1, torch.tensor([[0, 0], [2, 1]])) * 3.0, (_x(2, 3),)),
    ("index_select", lambda a: a.index_select(0, np.array([1, 1, 0], np.uint32)),
     lambda a: a.index_select(0, torch.tensor([1, 1, 0])), (_x(2, 3),)),
    ("cast", lambda a: a.cast(fl.f32).cast(fl.f64) * a, lambda a: a.float().double() * a, (_x(3),)),
    ("softmax", lambda a: a.softmax(-1) * a, lambda a: a.softmax(-1) * a, (_x(3, 5),)),
    ("softmax axis 0", lambda a: a.softmax(0), lambda a: a.softmax(0), (_x(3, 5),)),
]


@pytest.mark.parametrize(("name", "f", "t", "arrays"), CASES, ids=[c[0] for c in CASES])
def test_gradients_match_torch_autograd(name: str, f: Any, t: Any, arrays: tuple[np.ndarray, ...]) -> None:
    if name == "cast":
        f32 = np.float32
        arrays = tuple(a.astype(f32).astype(np.float64) for a in arrays)
    _check(f, t, *arrays)
    _check(f, t, *arrays, fuse=False)


def test_grad_needs_scalar_or_grad_out() -> None:
    x = fl.tensor(np.ones((2, 2)))
    with pytest.raises(fl.ShapeError, match="pass grad_out"):
        fl.grad(x * 2.0, [x])
    with pytest.raises(fl.DTypeError, match="u32"):
        fl.grad((x * 2.0).sum(), [fl.tensor(np.ones(2, np.uint32))])


def test_unreached_inputs_get_zeros_and_gradients_are_lazy() -> None:
    x, y = fl.tensor(np.ones(3)), fl.tensor(np.ones(3))
    gx, gy = fl.grad((x * 3.0).sum(), [x, y])
    assert gx.node.value is None
    np.testing.assert_array_equal(gx.numpy(), [3.0, 3.0, 3.0])
    np.testing.assert_array_equal(gy.numpy(), [0.0, 0.0, 0.0])


def test_grad_with_respect_to_an_interior_node_is_not_fused_away() -> None:
    x = fl.tensor(np.random.default_rng(0).standard_normal((2, 5)))
    e = (x - x.max(-1, keepdim=True)).exp()
    y = e / e.sum(-1, keepdim=True)
    (ge,) = fl.grad((y * y).sum(), [e])
    te = torch.tensor(e.numpy(), requires_grad=True)
    ty = te / te.sum(-1, keepdim=True)
    (want,) = torch.autograd.grad((ty * ty).sum(), [te])
    np.testing.assert_allclose(ge.numpy(), want.numpy(), rtol=1e-10, atol=1e-12)
