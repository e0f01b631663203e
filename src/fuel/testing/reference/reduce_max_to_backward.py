"""Reference for ReduceMaxToBackward (10)."""

from __future__ import annotations

from typing import Any

import numpy as np

from fuel.dtype import DType
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


register("ReduceMaxToBackward", reduce_max_to_backward64, _reduce_max_cases)
