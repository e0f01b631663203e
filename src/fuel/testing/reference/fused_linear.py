"""Reference for FusedLinear (2): float64 `a @ b + bias`, b shared (rank 2) or repeated GQA-style."""

from __future__ import annotations

from typing import Any

import numpy as np

from fuel.dtype import DType
from fuel.graph.registry.fused_linear import FusedLinearParams
from fuel.testing.reference import Case, randn, register


def expand_b64(b: np.ndarray, a_batch: tuple[int, ...]) -> np.ndarray:
    """b's batch dims repeated (interleaved, like torch.repeat_interleave) up to a's."""
    if b.ndim == 2:
        return b
    for d, (da, db) in enumerate(zip(a_batch, b.shape[:-2], strict=True)):
        if da != db:
            b = np.repeat(b, da // db, axis=d)
    return b


def linear64(xs: list[np.ndarray], params: Any) -> np.ndarray:
    a, b, bias = xs
    return np.matmul(a, expand_b64(b, a.shape[:-2])) + bias


def linear_scale(xs: list[np.ndarray], params: Any, ref: np.ndarray | None = None) -> np.ndarray:
    """S = |a| @ |b| + |bias| per output element: the size of the terms its sum adds up."""
    a, b, bias = xs
    return np.matmul(np.abs(a), np.abs(expand_b64(b, a.shape[:-2]))) + np.abs(bias)


# (a shape, b shape): rank 2, batched, shared weight, GQA multiples, size-1 and empty dims.
LINEAR_SHAPES: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = (
    ((7, 33), (33, 5)),
    ((1, 1), (1, 1)),
    ((2, 3, 17), (2, 17, 9)),
    ((2, 3, 40), (40, 24)),
    ((2, 2, 3, 16), (16, 8)),
    ((4, 5, 12), (2, 12, 6)),
    ((2, 6, 3, 8), (1, 2, 8, 5)),
    ((3, 1, 300), (300, 70)),
    ((0, 8), (8, 4)),
    ((4, 6), (6, 0)),
    ((3, 0), (0, 5)),
)


def _cases(dtypes: tuple[DType, ...], rng: np.random.Generator) -> list[Case]:
    dt = dtypes[0]
    p = FusedLinearParams()
    out = []
    for sa, sb in LINEAR_SHAPES:
        inputs = (randn(rng, sa, dt), randn(rng, sb, dt), randn(rng, (sb[-1],), dt))
        out.append(Case(f"{list(sa)}@{list(sb)}", inputs, p))
    big = (randn(rng, (64, 256), dt, 30.0), randn(rng, (256, 48), dt, 0.01), randn(rng, (48,), dt, 5.0))
    out.append(Case("scaled, bias-dominated", big, p))
    return out


register("FusedLinear", linear64, _cases, linear_scale)
