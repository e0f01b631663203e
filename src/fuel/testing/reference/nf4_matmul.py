"""Reference for Nf4Matmul (21): float64 dequantise-then-matmul.

The reference weight is `NF4[code] · absmax` in float64 (not rounded to f32), so the kernels' f32
rounding of each weight is part of their measured error. The local scale is the contraction rule,
S = |act| @ |dequant(W)|ᵀ per element (|act| @ |dequant(W)| for the transposed product).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fuel.dtype import DType
from fuel.graph.registry.nf4_matmul import Nf4MatmulParams
from fuel.quant.nf4 import NF4, nf4_codes, nf4_quantize
from fuel.testing.reference import Case, randn, register


def dequant64(w_packed: np.ndarray, absmax: np.ndarray, block_size: int) -> np.ndarray:
    """dequant(W) `[N, K]` in float64."""
    n, k = w_packed.shape[0], 2 * w_packed.shape[1]
    values = NF4.astype(np.float64)[nf4_codes(w_packed)].reshape(n, k // block_size, block_size)
    return (values * np.asarray(absmax, np.float64)[:, :, None]).reshape(n, k)


def _product(act: np.ndarray, w: np.ndarray, p: Any) -> np.ndarray:
    return np.matmul(act, w if p.transpose else w.T)


def nf4_matmul64(xs: list[np.ndarray], params: Any) -> np.ndarray:
    act, w, absmax = xs
    return _product(act, dequant64(w, absmax, params.block_size), params)


def nf4_scale(xs: list[np.ndarray], params: Any, ref: np.ndarray | None = None) -> np.ndarray:
    act, w, absmax = xs
    return _product(np.abs(act), np.abs(dequant64(w, absmax, params.block_size)), params)


# (act shape, N, K, block_size, transpose): decode rows 1 and 3, a GEMM-sized 64, batched act, block
# sizes 64 and 128 (and 32, and 24, which no 16-byte step fits), empty M and N, the gradient's product.
NF4_SHAPES: tuple[tuple[tuple[int, ...], int, int, int, bool], ...] = (
    ((1, 256), 40, 256, 64, False),
    ((3, 256), 24, 256, 128, False),
    ((64, 128), 72, 128, 64, False),
    ((2, 3, 384), 16, 384, 128, False),
    ((2, 1, 64), 9, 64, 32, False),
    ((5, 96), 10, 96, 24, False),
    ((1, 72), 6, 72, 24, False),
    ((0, 128), 8, 128, 64, False),
    ((3, 128), 0, 128, 64, False),
    ((1, 40), 40, 256, 64, True),
    ((64, 24), 24, 256, 128, True),
    ((2, 3, 12), 12, 96, 24, True),
)


def weights(rng: np.random.Generator, n: int, k: int, bs: int, absmax_dt: DType) -> tuple[np.ndarray, np.ndarray]:
    """(w_packed, absmax) of a quantised normal weight, with one all-zero block when there is one."""
    w = rng.standard_normal((n, k)) * 0.05
    if n and k:
        w[rng.integers(n), :bs] = 0.0
    packed, absmax = nf4_quantize(w.astype(np.float32), bs)
    return packed, absmax.astype(absmax_dt.np)


def _cases(dtypes: tuple[DType, ...], rng: np.random.Generator) -> list[Case]:
    act_dt, _, absmax_dt = dtypes[:3]
    out = []
    for shape, n, k, bs, transpose in NF4_SHAPES:
        packed, absmax = weights(rng, n, k, bs, absmax_dt)
        label = f"{list(shape)}{'@W' if transpose else '@Wt'}[N={n},K={k},bs={bs}]"
        out.append(Case(label, (randn(rng, shape, act_dt), packed, absmax), Nf4MatmulParams(bs, transpose)))
    # Raw bytes (every code equally often) with scales spread over decades, zero scales included.
    packed = rng.integers(0, 256, (48, 128), dtype=np.uint8)
    absmax = np.exp(rng.uniform(-6, 3, (48, 4))).astype(absmax_dt.np)
    absmax[::7, 1] = 0
    out.append(Case("raw bytes, spread scales", (randn(rng, (4, 256), act_dt, 3.0), packed, absmax),
                    Nf4MatmulParams(64)))
    return out


register("Nf4Matmul", nf4_matmul64, _cases, nf4_scale)
