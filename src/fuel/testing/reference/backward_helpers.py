"""References for ReduceMaxToBackward (10) and PowIBackward (15)."""

from __future__ import annotations

from typing import Any

import numpy as np

from fuel.dtype import DType
from fuel.graph.registry.powi_backward import PowIBackwardParams
from fuel.graph.registry.reduce_max_to_backward import ReduceMaxToBackwardParams
from fuel.graph.shapes import reduce_to_axes
from fuel.testing.reference import Case, randn, register


def reduce_max_to_backward64(xs: list[np.ndarray], params: Any) -> np.ndarray:
    """g/ties on each group's maxima (an element is a maximum when it equals the group's NaN-propagating
    max, or both are NaN), 0·(g/ties) elsewhere."""
    x, g = xs
    if x.size == 0:
        return np.zeros(x.shape)
    axes = reduce_to_axes("reduce_max_to_backward", x.shape, g.shape)
    keep = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    y = np.max(x, axis=axes, keepdims=True)
    mask = (x == y) | (np.isnan(x) & np.isnan(y))
    ties = mask.sum(axis=axes, keepdims=True)
    with np.errstate(invalid="ignore"):
        return mask * (np.reshape(g, keep) / ties)


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


# (x shape, target): last axes with keepdim (rows), leading axes dropped and a middle axis (columns),
# reduced axes apart (the transposing fallback), full reduction, nothing reduced, size-1 and empty axes.
REDUCE_TARGETS: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = (
    ((7, 33), (7, 1)), ((2, 3, 64), (2, 3, 1)), ((2, 3, 64), (2, 1, 1)), ((2, 3, 64), (64,)),
    ((4, 5, 6), (4, 1, 6)), ((3, 40, 300), (3, 1, 300)), ((4, 5, 6), (1, 5, 1)), ((3, 1000), ()),
    ((1, 1), (1, 1)), ((5, 1), (5, 1)), ((5, 1), (1,)), ((0, 8), (0, 1)), ((4,), (1,)), ((), ()),
    ((6, 1, 9), (1, 9)),
)


def _reduce_max_cases(dtypes: tuple[DType, ...], rng: np.random.Generator) -> list[Case]:
    dt = dtypes[0]
    p = ReduceMaxToBackwardParams()
    out = []
    for shape, target in REDUCE_TARGETS:
        out.append(Case(f"randn{list(shape)}->{list(target)}", (randn(rng, shape, dt, 3.0), randn(rng, target, dt)), p))
    # Rounded values: many ties in every group.
    tied = np.round(rng.standard_normal((6, 4, 20))).astype(dt.np)
    for target in ((6, 4, 1), (4, 20), (6, 1, 20)):
        out.append(Case(f"ties->{list(target)}", (tied, randn(rng, target, dt)), p))
    # -inf: a row of only -inf (all tie), and -inf beside finite values; NaN: groups holding NaN.
    odd = randn(rng, (5, 12), dt)
    odd[0] = -np.inf
    odd[1, ::2] = -np.inf
    odd[2, 3] = np.nan
    odd[3, [0, 7]] = np.nan
    odd[4] = np.nan
    out.append(Case("-inf and NaN rows", (odd, randn(rng, (5, 1), dt)), p))
    out.append(Case("-inf and NaN columns", (odd, randn(rng, (12,), dt)), p))
    return out


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


register("ReduceMaxToBackward", reduce_max_to_backward64, _reduce_max_cases)
register("PowIBackward", powi_backward64, _powi_cases, powi_backward_scale)
