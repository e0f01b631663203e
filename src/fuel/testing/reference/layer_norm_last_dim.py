"""References for LayerNormLastDim (4) and its backward (8).

The f32/half kernels add eps rounded to f32 (as upstream does); the references add eps itself, as in
`rms_norm_last_dim`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fuel.graph.registry.layer_norm_last_dim import LayerNormLastDimParams
from fuel.graph.registry.layer_norm_last_dim_backward import LayerNormLastDimBackwardParams
from fuel.testing.reference import register
from fuel.testing.reference.norm_rows import backward_cases, centred, exponent, forward_cases, scaled


def layer_norm64(xs: list[np.ndarray], params: Any) -> np.ndarray:
    _, x, eps = scaled(xs[0], params.eps)
    c, const = centred(x)
    with np.errstate(invalid="ignore", divide="ignore"):  # 0/0 in constant rows, replaced by 0
        return np.where(const, 0.0, c / np.sqrt((c * c).mean(-1, keepdims=True) + eps))


def layer_norm_backward64(xs: list[np.ndarray], params: Any) -> np.ndarray:
    """dx = istd·(g − mean g − x̂·mean(g·x̂)), from the rescaled x and g; a constant row has x̂ = 0
    and istd = 1/sqrt(eps) (which the rescaled eps could not give)."""
    kx, x, eps = scaled(xs[0], params.eps)
    kg = exponent(xs[1])
    g = np.ldexp(xs[1], -kg)
    c, const = centred(x)
    with np.errstate(divide="ignore", invalid="ignore"):  # constant rows: replaced below
        istd = 1.0 / np.sqrt((c * c).mean(-1, keepdims=True) + eps)
        xhat = np.where(const, 0.0, c * istd)
        inner = g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True)
        return np.where(const, np.ldexp(inner / np.sqrt(params.eps), kg), np.ldexp(inner * istd, kg - kx))


register("LayerNormLastDim", layer_norm64, forward_cases(LayerNormLastDimParams))
register("LayerNormLastDimBackward", layer_norm_backward64, backward_cases(LayerNormLastDimBackwardParams))
