"""Shared pieces of the RmsNormLastDim and LayerNormLastDim references (and their backwards): the
per-row rescaling that keeps squares from overflowing float64, and the cases both norms run.

Every reference rescales each row by a power of two first, so rows whose squares overflow float64
(from about 1e154) still get the exact answer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fuel.dtype import DType
from fuel.testing.reference import ROW_SHAPES, Case, randn

EPSILONS: tuple[float, ...] = (1e-6, 1e-5, 1e-3, 0.1)


def exponent(a: np.ndarray) -> np.ndarray:
    """Per row, the k >= 0 that brings max|a| below 1 (0 for rows holding NaN or ±inf)."""
    m = np.max(np.abs(a), -1, keepdims=True)
    k = np.frexp(np.where(np.isfinite(m), m, 0.0))[1]
    return np.maximum(k, 0)


def scaled(x: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(k, x·2^-k, eps·2^-2k): a norm of x with eps equals that of the rescaled row and eps, whose
    squares cannot overflow (eps may underflow: it is then negligible next to mean(x²) >= 1/4n)."""
    k = exponent(x)
    return k, np.ldexp(x, -k), np.ldexp(eps, -2 * k)


def centred(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x − mean(x), whether the row is constant): a constant row centres to exactly 0 (its mean
    may round off the value in float64)."""
    const = np.all(x == x[..., :1], -1, keepdims=True) & np.isfinite(x[..., :1])
    return np.where(const, 0.0, x - x.mean(-1, keepdims=True)), const


def row_inputs(rng: np.random.Generator, dt: DType) -> list[tuple[str, np.ndarray, float]]:
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
    out.append((HUGE, huge_rows(rng, dt), 1e-5))
    return out


HUGE = "huge rows"


def huge(dt: DType) -> tuple[float, float]:
    """(B, T): a huge value, and a power of two whose rows' sums overflow f32 (both tame in f16)."""
    return (1e4, 2.0**13) if dt is DType.F16 else (1e30, 2.0**124)


def huge_rows(rng: np.random.Generator, dt: DType) -> np.ndarray:
    """Rows whose squares (or sums) overflow f32, the working type of f32 and bf16, next to an
    ordinary row: one huge element, a whole huge row, a huge positive row, a huge constant row, ±B.
    (Kept below float64's overflow so the unfused decomposition still agrees in float64.)"""
    b, t = huge(dt)
    x = rng.standard_normal((6, 64))
    x[0, 3] = b
    x[2] *= b
    x[3] = np.abs(x[3]) * t
    x[4] = 1.5 * t
    x[5, :2] = (b, -b)
    return x.astype(dt.np)


def forward_cases(cls: type) -> Any:
    def cases(dtypes: tuple[DType, ...], rng: np.random.Generator) -> list[Case]:
        dt = dtypes[0]
        return [Case(f"{label} eps={eps}", (x,), cls(eps)) for label, x, eps in row_inputs(rng, dt)]

    return cases


def backward_cases(cls: type) -> Any:
    def cases(dtypes: tuple[DType, ...], rng: np.random.Generator) -> list[Case]:
        dt = dtypes[0]
        out = []
        for label, x, eps in row_inputs(rng, dt):
            g = randn(rng, x.shape, dt)
            if x.shape[-1] == 1:
                # A size-1 row's gradient is g·eps/(x² + eps)^1.5, the rest of g cancels: with a
                # small eps or |g| it sinks into f16's subnormals, where no relative bound holds.
                eps = 0.1
                g = (g.astype(np.float64) + np.copysign(1.0, g.astype(np.float64))).astype(dt.np)
            if label == HUGE:  # huge upstream gradients too: on an ordinary row and on a huge one
                g[1:3] = (g[1:3].astype(np.float64) * huge(dt)[0]).astype(dt.np)
            out.append(Case(f"{label} eps={eps}", (x, g), cls(eps)))
        return out

    return cases
