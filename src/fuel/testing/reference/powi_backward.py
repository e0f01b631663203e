"""Reference for PowIBackward (15)."""

from __future__ import annotations

from typing import Any

import numpy as np

from fuel.dtype import DType
from fuel.graph.registry.powi_backward import PowIBackwardParams
from fuel.testing.reference import Case, randn, register


def powi_backward64(xs: list[np.ndarray], params: Any) -> np.ndarray:
    """exp·x^(exp−1)·g with libm's pow in f64; 0 everywhere for exp = 0."""
    x, g = xs
    if params.exp == 0:
        return np.zeros(x.shape)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return (params.exp * np.power(x, float(params.exp - 1))) * g


def powi_backward_scale(xs: list[np.ndarray], params: Any, ref: np.ndarray) -> np.ndarray:
    """Each element is its own scale: its error is relative to itself (no sum, no cancellation)."""
    return np.abs(ref)


POWI_EXPONENTS = (-3, -2, -1, 0, 1, 2, 3, 7)


def _powi_cases(dtypes: tuple[DType, ...], rng: np.random.Generator) -> list[Case]:
    dt = dtypes[0]
    out = []
    special = np.array([0.0, 0.5, -0.5, -2.0, 3.0, 1.0, -1.0, 1.25], dt.np)
    for k, exp in enumerate(POWI_EXPONENTS):
        p = PowIBackwardParams(exp)
        shape = ((7, 33), (2, 3, 16), (1, 1), (0, 8), (4,), (), (3, 100), (5, 1))[k]
        # |x| in [0.25, 3]: x^(exp−1)·exp·g stays inside f16's range for every exponent here.
        mag = np.clip(0.25 + np.abs(rng.standard_normal(shape)), 0.25, 3.0)
        x = (np.sign(rng.standard_normal(shape)) * mag).astype(dt.np)
        out.append(Case(f"randn{list(shape)} exp={exp}", (x, randn(rng, shape, dt)), p))
    # x = 0 (inf and NaN gradients for negative exp) last: the finite-difference check takes the first cases.
    for exp in POWI_EXPONENTS:
        out.append(Case(f"special exp={exp}", (special, randn(rng, special.shape, dt)), PowIBackwardParams(exp)))
    return out


register("PowIBackward", powi_backward64, _powi_cases, powi_backward_scale)
