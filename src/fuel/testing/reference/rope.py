"""Reference for Rope (5): float64 HF rotate-half, `x·cos + rotate_half(x)·sin`."""

from __future__ import annotations

from typing import Any

import numpy as np

from fuel.dtype import DType
from fuel.graph.registry.rope import RopeParams
from fuel.testing.reference import Case, randn, register


def rotate_half64(x: np.ndarray) -> np.ndarray:
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def rope64(xs: list[np.ndarray], params: Any) -> np.ndarray:
    x, cos, sin = xs
    return x * cos + rotate_half64(x) * sin


def rope_scale(xs: list[np.ndarray], params: Any, ref: np.ndarray) -> np.ndarray:
    """|x|·|cos| + |rotate_half(x)|·|sin| per element: the size of the two products it adds."""
    x, cos, sin = xs
    return np.abs(x) * np.abs(cos) + np.abs(rotate_half64(x)) * np.abs(sin)


def rope_tables(seq: int, d: int, base: float = 10000.0, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Llama-style float64 tables [seq, d] with duplicated halves."""
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    theta = np.outer(np.arange(start, start + seq, dtype=np.float64), inv)
    ang = np.concatenate([theta, theta], axis=-1)
    return np.cos(ang), np.sin(ang)


ROPE_SHAPES: tuple[tuple[int, ...], ...] = ((5, 8), (2, 3, 7, 16), (1, 1, 2), (3, 1, 64), (2, 4, 0),
                                            (0, 3, 6), (4, 33, 128))


def _cases(dtypes: tuple[DType, ...], rng: np.random.Generator) -> list[Case]:
    dt = dtypes[0]
    p = RopeParams()
    out = []
    for s in ROPE_SHAPES:
        seq, d = s[-2:]
        # Tables whose halves differ (any table is legal), on the unit circle or not.
        cos, sin = randn(rng, (seq, d), dt), randn(rng, (seq, d), dt)
        out.append(Case(f"randn{list(s)}", (randn(rng, s, dt, 3.0), cos, sin), p))
    c, s_ = rope_tables(50, 32, start=1000)
    out.append(Case("llama tables", (randn(rng, (2, 50, 32), dt), c.astype(dt.np), s_.astype(dt.np)), p))
    return out


register("Rope", rope64, _cases, rope_scale)
