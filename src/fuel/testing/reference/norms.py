"""References for RmsNormLastDim (3), LayerNormLastDim (4) and their backwards (9, 8).

The f32/half kernels add eps rounded to f32 (as upstream does); the references add eps itself. The
difference moves an output by at most 6e-8·eps/(mean square + eps) relative, far below any bound.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fuel.dtype import DType
from fuel.graph.registry.layer_norm_last_dim import LayerNormLastDimParams
from fuel.graph.registry.layer_norm_last_dim_backward import LayerNormLastDimBackwardParams
from fuel.graph.registry.rms_norm_last_dim import RmsNormLastDimParams
from fuel.graph.registry.rms_norm_last_dim_backward import RmsNormLastDimBackwardParams
from fuel.testing.reference import ROW_SHAPES, Case, randn, register

EPSILONS: tuple[float, ...] = (1e-6, 1e-5, 1e-3, 0.1)


def rms_norm64(xs: list[np.ndarray], params: Any) -> np.ndarray:
    x = xs[0]
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + params.eps)


def layer_norm64(xs: list[np.ndarray], params: Any) -> np.ndarray:
    x = xs[0]
    c = x - x.mean(-1, keepdims=True)
    return c / np.sqrt((c * c).mean(-1, keepdims=True) + params.eps)


def rms_norm_backward64(xs: list[np.ndarray], params: Any) -> np.ndarray:
    x, g = xs
    den = (x * x).mean(-1, keepdims=True) + params.eps
    return (g - x * (g * x).sum(-1, keepdims=True) / (x.shape[-1] * den)) / np.sqrt(den)


def layer_norm_backward64(xs: list[np.ndarray], params: Any) -> np.ndarray:
    x, g = xs
    c = x - x.mean(-1, keepdims=True)
    istd = 1.0 / np.sqrt((c * c).mean(-1, keepdims=True) + params.eps)
    xhat = c * istd
    return istd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))


def _inputs(rng: np.random.Generator, dt: DType) -> list[tuple[str, np.ndarray, float]]:
    """(label, x, eps): every ROW_SHAPE, large magnitudes, a large offset, tiny rows, constants."""
    out = []
    for i, s in enumerate(ROW_SHAPES):
        if s[-1] > 0:
            out.append((f"randn{list(s)}", randn(rng, s, dt, 2.0), EPSILONS[i % len(EPSILONS)]))
    big = 3e3 if dt is DType.F16 else 1e6
    out.append(("large values", randn(rng, (4, 129), dt, big), 1e-5))
    out.append(("offset 100", (100.0 + rng.standard_normal((3, 300))).astype(dt.np), 1e-5))
    out.append(("tiny values", randn(rng, (3, 40), dt, 1e-3), 1e-6))
    out.append(("constant rows", np.full((2, 17), 1.5, dt.np), 1e-5))
    out.append(("wide row", randn(rng, (2, 4096), dt), 1e-6))
    return out


def _forward_cases(cls: type) -> Any:
    def cases(dtypes: tuple[DType, ...], rng: np.random.Generator) -> list[Case]:
        dt = dtypes[0]
        return [Case(f"{label} eps={eps}", (x,), cls(eps)) for label, x, eps in _inputs(rng, dt)]

    return cases


def _backward_cases(cls: type) -> Any:
    def cases(dtypes: tuple[DType, ...], rng: np.random.Generator) -> list[Case]:
        dt = dtypes[0]
        out = []
        for label, x, eps in _inputs(rng, dt):
            g = randn(rng, x.shape, dt)
            if x.shape[-1] == 1:
                # A size-1 row's gradient is g·eps/(x² + eps)^1.5, the rest of g cancels: with a
                # small eps or |g| it sinks into f16's subnormals, where no relative bound holds.
                eps = 0.1
                g = (g.astype(np.float64) + np.copysign(1.0, g.astype(np.float64))).astype(dt.np)
            out.append(Case(f"{label} eps={eps}", (x, g), cls(eps)))
        return out

    return cases


register("RmsNormLastDim", rms_norm64, _forward_cases(RmsNormLastDimParams))
register("LayerNormLastDim", layer_norm64, _forward_cases(LayerNormLastDimParams))
register("LayerNormLastDimBackward", layer_norm_backward64, _backward_cases(LayerNormLastDimBackwardParams))
register("RmsNormLastDimBackward", rms_norm_backward64, _backward_cases(RmsNormLastDimBackwardParams))
