"""Reference for CausalConv1d (18): float64 NumPy, tap by tap, over the left-padded sequence (SiLU after
where the params ask). The local scale of an output element is the same operation on |inputs|.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fuel.dtype import DType
from fuel.graph.registry.causal_conv1d import CausalConv1dParams
from fuel.testing.reference import Case, randn, register


def _causal_linear(x: np.ndarray, w: np.ndarray, bias: np.ndarray) -> np.ndarray:
    k = w.shape[2]
    seq = x.shape[2] - (k - 1)
    y = np.broadcast_to(bias.reshape(1, -1, 1), (x.shape[0], x.shape[1], seq)).copy()
    for tap in range(k):
        y += x[:, :, tap:tap + seq] * w[:, :, tap].reshape(1, -1, 1)
    return y


def causal_conv1d64(xs: list[np.ndarray], p: Any) -> np.ndarray:
    y = _causal_linear(*xs)
    if p.use_silu:
        with np.errstate(over="ignore"):
            y = y / (1.0 + np.exp(-y))
    return y


def causal_conv1d_scale(xs: list[np.ndarray], p: Any, ref: np.ndarray) -> np.ndarray:
    """|bias| + Σ|w|·|x| of the pre-activation (SiLU's slope is at most 1.1)."""
    return _causal_linear(*(np.abs(a) for a in xs))


# (B, C, seq, K): a typical Mamba row, an empty output, one tap, and the decode window (seq 1).
CAUSAL_SHAPES: tuple[tuple[int, int, int, int], ...] = (
    (2, 5, 10, 4), (1, 3, 0, 4), (1, 1, 1, 1), (3, 7, 64, 3), (2, 16, 130, 4), (2, 8, 1, 4),
)


def _causal_cases(dtypes: tuple[DType, ...], rng: np.random.Generator) -> list[Case]:
    dt = dtypes[0]
    out = []
    for silu in (False, True):
        p = CausalConv1dParams(silu)
        for b, c, seq, k in CAUSAL_SHAPES:
            inputs = (randn(rng, (b, c, seq + k - 1), dt), randn(rng, (c, 1, k), dt), randn(rng, (c,), dt))
            out.append(Case(f"[{b},{c},{seq}+{k}-1] silu={silu}", inputs, p))
        wide = (randn(rng, (2, 4, 40), dt, 8.0), randn(rng, (4, 1, 4), dt), randn(rng, (4,), dt, 4.0))
        out.append(Case(f"wide range silu={silu}", wide, p))
    return out


register("CausalConv1d", causal_conv1d64, _causal_cases, causal_conv1d_scale)
