"""References for RmsNormLastDim (3) and its backward (9).

The f32/half kernels add eps rounded to f32 (as upstream does); the references add eps itself. The
difference moves an output by at most 6e-8·eps/(mean square + eps) relative, far below any bound.
"""

from __future__ import annotations

import decimal
from decimal import Decimal
from typing import Any

import numpy as np

from fuel.graph.registry.rms_norm_last_dim import RmsNormLastDimParams
from fuel.graph.registry.rms_norm_last_dim_backward import RmsNormLastDimBackwardParams
from fuel.testing.reference import register
from fuel.testing.reference.norm_rows import backward_cases, exponent, forward_cases, scaled


def rms_norm64(xs: list[np.ndarray], params: Any) -> np.ndarray:
    _, x, eps = scaled(xs[0], params.eps)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def _rms_backward_single(x: float, g: float, eps: float) -> float:
    """g·eps/(x² + eps)^1.5 in decimal arithmetic (no overflow, 40 digits), rounded once."""
    with decimal.localcontext() as ctx:
        ctx.prec = 40
        ctx.Emax, ctx.Emin = 10**6, -(10**6)
        ctx.traps[decimal.InvalidOperation] = False  # NaN/inf inputs give NaN, as in float64
        den = Decimal(x) ** 2 + Decimal(eps)
        return float(Decimal(g) * Decimal(eps) / (den * den.sqrt()))


def rms_norm_backward64(xs: list[np.ndarray], params: Any) -> np.ndarray:
    kx, x, eps = scaled(xs[0], params.eps)
    kg = exponent(xs[1])
    g = np.ldexp(xs[1], -kg)
    if x.shape[-1] == 1:
        return np.vectorize(_rms_backward_single)(xs[0], xs[1], params.eps)
    den = (x * x).mean(-1, keepdims=True) + eps
    dx = (g - x * (g * x).sum(-1, keepdims=True) / (x.shape[-1] * den)) / np.sqrt(den)
    return np.ldexp(dx, kg - kx)


register("RmsNormLastDim", rms_norm64, forward_cases(RmsNormLastDimParams))
register("RmsNormLastDimBackward", rms_norm_backward64, backward_cases(RmsNormLastDimBackwardParams))
