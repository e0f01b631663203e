"""Oracles for norm rows whose squares overflow even float64: run them on rows scaled by powers of two.

A norm is invariant under x → 2^-k·x when eps → 2^-2k·eps, and its input gradient is linear in g and
scales as 1/scale(x), so rescaling by powers of two (exact) keeps a float64 oracle exact on any row.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

Oracle = Callable[[np.ndarray, float], np.ndarray]
GradOracle = Callable[[np.ndarray, np.ndarray, float], np.ndarray]


def exponent(row: np.ndarray) -> int:
    """The k >= 0 that brings max|row| below 1."""
    return max(math.frexp(float(np.max(np.abs(row))))[1], 0)


def rescaled(oracle: Oracle, x: np.ndarray, eps: float) -> np.ndarray:
    """`oracle` (a norm over the last axis) on each row scaled by 2^-k, eps by 2^-2k."""
    rows = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    out = [oracle(np.ldexp(r, -exponent(r)), math.ldexp(eps, -2 * exponent(r))) for r in rows]
    return np.stack(out).reshape(x.shape)


def rescaled_grad(oracle: GradOracle, x: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    """`oracle` (a norm's dx) per row: dx(x, g) = 2^(kg − kx)·dx(x·2^-kx, g·2^-kg) with eps·2^-2kx."""
    out = []
    for rx, rg in zip(np.asarray(x, np.float64), np.asarray(g, np.float64), strict=True):
        kx, kg = exponent(rx), exponent(rg)
        d = oracle(np.ldexp(rx, -kx), np.ldexp(rg, -kg), math.ldexp(eps, -2 * kx))
        out.append(np.ldexp(d, kg - kx))
    return np.stack(out)
