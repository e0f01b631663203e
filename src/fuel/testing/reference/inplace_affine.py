"""Reference for InplaceAffine (16): mul·x + add in extended precision, rounded once to float64."""

from __future__ import annotations

from typing import Any

import numpy as np

from fuel.dtype import DType
from fuel.graph.registry.inplace_affine import InplaceAffineParams
from fuel.testing.reference import ROW_SHAPES, Case, randn, register


def inplace_affine64(xs: list[np.ndarray], params: Any) -> np.ndarray:
    """In long double (64-bit significand on x86; float64 elsewhere), so the f64 kernel's own two
    roundings show against it. Never writes its input (it is a widened copy anyway)."""
    x = xs[0].astype(np.longdouble)
    with np.errstate(invalid="ignore", over="ignore"):
        return (np.longdouble(params.mul) * x + np.longdouble(params.add)).astype(np.float64)


def inplace_affine_scale(xs: list[np.ndarray], params: Any, ref: np.ndarray) -> np.ndarray:
    """|mul·x| + |add| per element: the two terms before they cancel."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.abs(params.mul * xs[0]) + abs(params.add)


PARAMS = ((2.5, -1.0), (-0.3, 0.7), (1e-3, 5.0), (1.0, 0.0), (3.0, -3.0), (0.1, 0.2))


def _cases(dtypes: tuple[DType, ...], rng: np.random.Generator) -> list[Case]:
    dt = dtypes[0]
    out = []
    for k, shape in enumerate(ROW_SHAPES):
        mul, add = PARAMS[k % len(PARAMS)]
        x = randn(rng, shape, dt, 2.0)
        out.append(Case(f"randn{list(shape)} {mul}·x+{add}", (x,), InplaceAffineParams(mul, add)))
    # x near 1 with 3·x - 3: the sum cancels; inf, -inf and NaN elements stay non-finite.
    near_one = (1 + rng.standard_normal((4, 50)) * 1e-2).astype(dt.np)
    out.append(Case("cancelling", (near_one,), InplaceAffineParams(3.0, -3.0)))
    odd = randn(rng, (3, 8), dt)
    odd[0, :3] = [np.inf, -np.inf, np.nan]
    out.append(Case("non-finite", (odd,), InplaceAffineParams(-1.5, 0.25)))
    out.append(Case("rank 0", (randn(rng, (), dt),), InplaceAffineParams(0.5, 0.5)))
    return out


register("InplaceAffine", inplace_affine64, _cases, inplace_affine_scale)
