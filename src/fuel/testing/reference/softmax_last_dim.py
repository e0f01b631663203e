"""References for SoftmaxLastDim (1) and SoftmaxLastDimBackward (7)."""

from __future__ import annotations

from typing import Any

import numpy as np

from fuel.dtype import DType
from fuel.graph.registry.softmax_last_dim import SoftmaxLastDimParams
from fuel.graph.registry.softmax_last_dim_backward import SoftmaxLastDimBackwardParams
from fuel.testing.reference import ROW_SHAPES, Case, randn, register


def softmax64(xs: list[np.ndarray], params: Any) -> np.ndarray:
    x = xs[0]
    if x.shape[-1] == 0:
        return x.copy()
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)


def softmax_backward64(xs: list[np.ndarray], params: Any) -> np.ndarray:
    y, g = xs
    return y * (g - (g * y).sum(-1, keepdims=True))


def softmax_backward_scale(xs: list[np.ndarray], params: Any, ref: np.ndarray) -> np.ndarray:
    """|y|·(|g| + Σ|g·y|): the size of each term of y·(g - Σ g·y) before it cancels."""
    y, g = np.abs(xs[0]), np.abs(xs[1])
    return y * (g + (g * y).sum(-1, keepdims=True))


def _forward_cases(dtypes: tuple[DType, ...], rng: np.random.Generator) -> list[Case]:
    dt = dtypes[0]
    p = SoftmaxLastDimParams()
    out = [Case(f"randn{list(s)}", (randn(rng, s, dt, 3.0),), p) for s in ROW_SHAPES]
    wide = randn(rng, (4, 257), dt, 30.0)
    out.append(Case("wide-range", (wide,), p))
    masked = randn(rng, (3, 16), dt)
    masked[:, ::3] = -np.inf
    out.append(Case("some -inf", (masked,), p))
    return out


def _backward_cases(dtypes: tuple[DType, ...], rng: np.random.Generator) -> list[Case]:
    dt = dtypes[0]
    p = SoftmaxLastDimBackwardParams()
    out = []
    for s in ROW_SHAPES:
        y = softmax64([randn(rng, s, DType.F64, 2.0)], None).astype(dt.np)
        out.append(Case(f"randn{list(s)}", (y, randn(rng, s, dt)), p))
    return out


register("SoftmaxLastDim", softmax64, _forward_cases)
register("SoftmaxLastDimBackward", softmax_backward64, _backward_cases, softmax_backward_scale)
