"""References for FlashAttn (12) and FlashAttnBackward Q/K/V (22-24), and the inputs `fuel verify` draws."""

from __future__ import annotations

from typing import Any

import numpy as np

from fuel.dtype import DType
from fuel.graph.registry.flash_attn import FlashAttnParams
from fuel.testing.reference import Case, randn, register
from fuel.testing.reference.attention_math import abs_attention64, attention64, attention_grads64


def _options(p: FlashAttnParams, xs: list[np.ndarray], n: int) -> dict[str, Any]:
    return {"scale": p.softmax_scale, "causal": p.causal, "left": p.window_size_left,
            "right": p.window_size_right, "softcap": p.softcap, "alibi": xs[n] if len(xs) > n else None,
            "k_len": p.k_len}


def flash_attn64(xs: list[np.ndarray], p: Any) -> np.ndarray:
    q, k, v = xs[:3]
    return attention64(q, k, v, **_options(p, xs, 3))


def flash_attn_scale(xs: list[np.ndarray], p: Any, ref: np.ndarray) -> np.ndarray:
    """Σ_j p_ij·|v_j| per element: the size of what the output averages."""
    q, k, v = xs[:3]
    return abs_attention64(q, k, v, **_options(p, xs, 3))


def _grad(slot: int, magnitude: bool) -> Any:
    def fn(xs: list[np.ndarray], p: Any, ref: np.ndarray | None = None) -> np.ndarray:
        q, k, v, do = xs[:4]
        return attention_grads64(q, k, v, do, **_options(p, xs, 4), magnitude=magnitude)[slot]
    return fn


# (B, Hq, Hkv, Sq, Sk, D, causal, window, softcap, alibi, k_len)
CONFIGS: tuple[tuple[Any, ...], ...] = (
    (1, 4, 4, 7, 13, 32, False, (None, None), None, False, None),
    (2, 6, 2, 13, 7, 16, True, (None, None), None, False, None),
    (1, 4, 1, 1, 64, 64, True, (None, None), None, False, 40),
    (1, 8, 1, 5, 33, 16, False, (3, 2), 5.0, True, 20),
    (1, 4, 2, 64, 64, 32, True, (8, None), None, True, None),
    (1, 2, 1, 9, 4, 8, True, (None, None), 2.0, False, 3),
    (1, 2, 2, 3, 5, 8, False, (None, None), None, False, 0),
    (0, 2, 1, 3, 5, 8, True, (None, None), None, False, None),
    (1, 2, 1, 0, 5, 8, True, (None, None), None, False, None),
    (1, 2, 2, 150, 600, 16, True, (None, None), None, False, 560),
)


def _inputs(dtypes: tuple[DType, ...], rng: np.random.Generator, backward: bool) -> list[Case]:
    dt = dtypes[0]
    out = []
    for b, hq, hkv, sq, sk, d, causal, win, cap, alibi, kl in CONFIGS:
        q, k, v = randn(rng, (b, hq, sq, d), dt), randn(rng, (b, hkv, sk, d), dt), randn(rng, (b, hkv, sk, d), dt)
        xs: tuple[np.ndarray, ...] = (q, k, v, randn(rng, (b, hq, sq, d), dt)) if backward else (q, k, v)
        want_alibi = len(dtypes) == len(xs) + 2
        if want_alibi != alibi:
            continue
        if alibi:
            xs = (*xs, rng.uniform(0.05, 1.0, hq).astype(dtypes[-2].np))
        p = FlashAttnParams(0.7 / np.sqrt(d) if d else 1.0, causal, win[0], win[1], cap, kl)
        out.append(Case(f"B{b} H{hq}/{hkv} S{sq}x{sk} D{d} causal={causal} win={win} cap={cap} k_len={kl}", xs, p))
    return out


def _forward_cases(dtypes: tuple[DType, ...], rng: np.random.Generator) -> list[Case]:
    return _inputs(dtypes, rng, backward=False)


def _backward_cases(dtypes: tuple[DType, ...], rng: np.random.Generator) -> list[Case]:
    return _inputs(dtypes, rng, backward=True)


register("FlashAttn", flash_attn64, _forward_cases, flash_attn_scale)
for _slot, _name in enumerate(("FlashAttnBackwardQ", "FlashAttnBackwardK", "FlashAttnBackwardV")):
    register(_name, _grad(_slot, False), _backward_cases, _grad(_slot, True))
