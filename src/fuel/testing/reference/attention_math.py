"""Float64 attention semantics shared by the attention references (FlashAttn, its backward, PagedAttn).

The decisions in DESIGN.md: q `[B,Hq,Sq,D]`, k/v `[B,Hkv,Sk,D]`, query head h reads kv head
`h // (Hq/Hkv)`; scores `s = scale·q·k`, then softcap `c·tanh(s/c)`, then ALiBi `-slope_h·|aq − j|`,
then the mask, then softmax. Alignment is bottom-right: `aq = i + k_len − Sq`; key j is admissible iff
`j < k_len` and `aq − left ≤ j ≤ aq + right` (None: unbounded; causal: right = 0). A row with no
admissible key gives 0.

This module registers nothing (it holds no entry); the entries' reference modules import it.
"""

from __future__ import annotations

import numpy as np


def admissible(sq: int, sk: int, k_len: int | None, causal: bool, left: int | None, right: int | None
               ) -> np.ndarray:
    """Bool `[Sq, Sk]`: which keys each query may attend to."""
    kl = sk if k_len is None else k_len
    aq = np.arange(sq)[:, None] + (kl - sq)
    j = np.arange(sk)[None, :]
    ok = np.broadcast_to(j < kl, (sq, sk)).copy()
    if causal:
        right = 0 if right is None else min(right, 0)
    if left is not None:
        ok &= j >= aq - left
    if right is not None:
        ok &= j <= aq + right
    return ok


def alibi_bias(slopes: np.ndarray, sq: int, sk: int, k_len: int | None) -> np.ndarray:
    """`[Hq, Sq, Sk]` float64: -slope_h·|aq − j| (FlashAttention-2)."""
    kl = sk if k_len is None else k_len
    aq = np.arange(sq)[:, None] + (kl - sq)
    dist = np.abs(aq - np.arange(sk)[None, :]).astype(np.float64)
    return -np.asarray(slopes, np.float64)[:, None, None] * dist


def scores64(q: np.ndarray, k: np.ndarray, scale: float, softcap: float | None, alibi: np.ndarray | None,
             k_len: int | None) -> np.ndarray:
    """`[B,Hq,Sq,Sk]` float64 scores before the mask (K read through the GQA head map)."""
    hq, hkv = q.shape[1], k.shape[1]
    kr = np.repeat(np.asarray(k, np.float64), hq // hkv, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", np.asarray(q, np.float64), kr) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if alibi is not None:
        s = s + alibi_bias(alibi, q.shape[2], k.shape[2], k_len)[None]
    return s


def probs64(q: np.ndarray, k: np.ndarray, scale: float, causal: bool, left: int | None, right: int | None,
            softcap: float | None, alibi: np.ndarray | None, k_len: int | None) -> np.ndarray:
    """`[B,Hq,Sq,Sk]` float64 attention probabilities; a row with no admissible key is all 0."""
    s = scores64(q, k, scale, softcap, alibi, k_len)
    ok = admissible(q.shape[2], k.shape[2], k_len, causal, left, right)
    s = np.where(ok, s, -np.inf)
    m = s.max(-1, keepdims=True) if s.shape[-1] else np.zeros(s.shape[:-1] + (1,))
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(ok, np.exp(s - m), 0.0)
    den = e.sum(-1, keepdims=True)
    return np.divide(e, den, out=np.zeros_like(e), where=den > 0)


def attention64(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, causal: bool = False,
                left: int | None = None, right: int | None = None, softcap: float | None = None,
                alibi: np.ndarray | None = None, k_len: int | None = None) -> np.ndarray:
    """`[B,Hq,Sq,D]` float64 attention output."""
    p = probs64(q, k, scale, causal, left, right, softcap, alibi, k_len)
    hq, hkv = q.shape[1], k.shape[1]
    vr = np.repeat(np.asarray(v, np.float64), hq // hkv, axis=1)
    return np.einsum("bhqk,bhkd->bhqd", p, vr)


def abs_attention64(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, causal: bool = False,
                    left: int | None = None, right: int | None = None, softcap: float | None = None,
                    alibi: np.ndarray | None = None, k_len: int | None = None) -> np.ndarray:
    """Σ_j p_ij·|v_j|: the local scale of an attention output element (the size of what it averages)."""
    p = probs64(q, k, scale, causal, left, right, softcap, alibi, k_len)
    hq, hkv = q.shape[1], k.shape[1]
    vr = np.repeat(np.abs(np.asarray(v, np.float64)), hq // hkv, axis=1)
    return np.einsum("bhqk,bhkd->bhqd", p, vr)


def _fold(x: np.ndarray, hkv: int) -> np.ndarray:
    """[B,Hq,Sk,D] per-query-head terms summed into their kv head: [B,Hkv,Sk,D]."""
    b, hq, sk, d = x.shape
    return x.reshape(b, hkv, hq // hkv, sk, d).sum(2)


def attention_grads64(q: np.ndarray, k: np.ndarray, v: np.ndarray, do: np.ndarray, scale: float,
                      causal: bool = False, left: int | None = None, right: int | None = None,
                      softcap: float | None = None, alibi: np.ndarray | None = None, k_len: int | None = None,
                      magnitude: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dq, dk, dv) in float64 by the chain rule through softmax, softcap and the GQA head map.

    With `magnitude`, every term is replaced by its absolute value: the size of what each gradient
    element sums before it cancels (its local error scale)."""
    f = np.abs if magnitude else (lambda a: a)
    hq, hkv = q.shape[1], k.shape[1]
    p = probs64(q, k, scale, causal, left, right, softcap, alibi, k_len)
    kr, vr = np.repeat(f(k), hq // hkv, axis=1), np.repeat(f(v), hq // hkv, axis=1)
    dp = np.einsum("bhqd,bhkd->bhqk", f(do), vr)
    delta = (p * dp).sum(-1, keepdims=True)
    ds = p * (dp + delta) if magnitude else p * (dp - delta)
    if softcap is not None:
        t = np.tanh(scores64(q, k, scale, None, None, k_len) / softcap)
        ds = ds * (1 - t * t)
    ds = ds * abs(scale)
    dq = np.einsum("bhqk,bhkd->bhqd", ds, kr)
    dk = _fold(np.einsum("bhqk,bhqd->bhkd", ds, f(q)), hkv)
    dv = _fold(np.einsum("bhqk,bhqd->bhkd", p, f(do)), hkv)
    return dq, dk, dv
