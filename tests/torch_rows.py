"""torch oracles of the row ops (softmax's backward, RMS and layer norms and their gradients), shared by the
row-kernel tests (tests/cpu/norms) and the strided-input tests (tests/dispatch)."""

from __future__ import annotations

from collections.abc import Callable

import torch

EPS = 1e-5
T = torch.Tensor


def grad_of(f: Callable[[T], T]) -> Callable[[T, T], T]:
    """The vector-Jacobian product of f at x with cotangent g, by torch's autograd."""
    def backward(x: T, g: T) -> T:
        x = x.clone().requires_grad_(True)
        (dx,) = torch.autograd.grad(f(x), [x], g)
        return dx

    return backward


def rms(x: T) -> T:
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), None, EPS)


def ln(x: T) -> T:
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), None, None, EPS)


def softmax_backward(y: T, g: T) -> T:
    return y * (g - (g * y).sum(-1, keepdim=True))
