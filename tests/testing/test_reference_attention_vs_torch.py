"""The attention functions of `fuel.testing.reference` (attention_math, flash_attn, paged_attn)
against torch in float64: the mask, ALiBi, softcap and softmax written out in torch
(`attention_oracle`), and torch.autograd for the gradients."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

import fuel.testing.reference as R
from fuel.dtype import DType
from fuel.graph.registry.flash_attn import FlashAttnParams
from fuel.testing.reference import attention_math as am
from fuel.testing.reference import paged_attn
from tests.graph.registry.attention_oracle import bottom_right, torch_attention
from tests.testing.reference_checks import checks, close, grad_of, t64

RNG = np.random.default_rng(2025)


def randn(*shape: int, scale: float = 1.0) -> np.ndarray:
    return RNG.standard_normal(shape) * scale


def attention_inputs(b: int, hq: int, hkv: int, sq: int, sk: int, d: int) -> tuple[np.ndarray, ...]:
    return randn(b, hq, sq, d, scale=2.0), randn(b, hkv, sk, d), randn(b, hkv, sk, d), randn(b, hq, sq, d)


CONFIGS = [  # (hq, hkv, sq, sk, causal, window, softcap, alibi, k_len)
    (4, 2, 5, 9, True, (None, None), None, False, None),
    (6, 2, 7, 12, False, (3, 2), 4.0, True, 10),
    (4, 1, 6, 4, True, (1, None), 2.0, True, 3),  # Sq > k_len: rows with no key
]


@checks("attention_math", "admissible", "alibi_bias", "scores64", "probs64", "attention64", "abs_attention64")
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_attention_math(cfg: tuple[Any, ...]) -> None:
    hq, hkv, sq, sk, causal, (left, right), cap, alibi, kl = cfg
    q, k, v, _ = attention_inputs(2, hq, hkv, sq, sk, 16)
    slopes = RNG.uniform(0.05, 0.6, hq) if alibi else None
    mask, aq = bottom_right(sq, sk, kl, causal, left, right)
    np.testing.assert_array_equal(am.admissible(sq, sk, kl, causal, left, right), mask.numpy())
    dist = (aq[:, None] - torch.arange(sk)).abs()
    if slopes is not None:
        close(am.alibi_bias(slopes, sq, sk, kl), -t64(slopes)[:, None, None] * dist)
    kr = t64(k).repeat_interleave(hq // hkv, 1)
    s = t64(q) @ kr.transpose(-2, -1) * 0.3
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    if slopes is not None:
        s = s - t64(slopes)[:, None, None] * dist
    close(am.scores64(q, k, 0.3, cap, slopes, kl), s, (t64(q).abs() @ kr.abs().transpose(-2, -1)) * 0.3 + dist)
    p = torch.nan_to_num(torch.softmax(s.masked_fill(~mask, -math.inf), -1), nan=0.0)
    close(am.probs64(q, k, 0.3, causal, left, right, cap, slopes, kl), p)
    want, size = torch_attention(q, k, v, 0.3, mask, aq, cap, slopes)
    close(am.attention64(q, k, v, 0.3, causal, left, right, cap, slopes, kl), want, size)
    close(am.abs_attention64(q, k, v, 0.3, causal, left, right, cap, slopes, kl), size)
    params = FlashAttnParams(0.3, causal, left, right, cap, kl)
    xs = [q, k, v, *([slopes] if alibi else [])]
    close(R.reference("FlashAttn", xs, params), want, size)
    close(R.scale("FlashAttn", xs, params, want), size)


def torch_grads(q: np.ndarray, k: np.ndarray, v: np.ndarray, do: np.ndarray, cfg: tuple[Any, ...],
                slopes: np.ndarray | None) -> list[np.ndarray]:
    hq, hkv, sq, sk, causal, (left, right), cap, _, kl = cfg
    mask, aq = bottom_right(sq, sk, kl, causal, left, right)

    def attend(tq: torch.Tensor, tk: torch.Tensor, tv: torch.Tensor) -> torch.Tensor:
        g = hq // hkv
        s = tq @ tk.repeat_interleave(g, 1).transpose(-2, -1) * 0.3
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        if slopes is not None:
            s = s - t64(slopes)[:, None, None] * (aq[:, None] - torch.arange(sk)).abs()
        p = torch.nan_to_num(torch.softmax(s.masked_fill(~mask, -math.inf), -1), nan=0.0)
        return p @ tv.repeat_interleave(g, 1)

    return grad_of(attend, [q, k, v], do)


def magnitudes(q: np.ndarray, k: np.ndarray, v: np.ndarray, do: np.ndarray, cfg: tuple[Any, ...],
               slopes: np.ndarray | None) -> list[torch.Tensor]:
    """The gradients' terms in absolute value, in torch: |dS| = p·(|dO|·|v| + Σ p·|dO|·|v|)·(1 − t²)·|scale|,
    then |dS|·|k|, |dS|ᵀ·|q| and pᵀ·|dO| (summed over the heads sharing a kv head)."""
    hq, hkv, sq, sk, causal, (left, right), cap, _, kl = cfg
    g = hq // hkv
    mask, aq = bottom_right(sq, sk, kl, causal, left, right)
    kr, vr = t64(k).repeat_interleave(g, 1), t64(v).repeat_interleave(g, 1)
    raw = t64(q) @ kr.transpose(-2, -1) * 0.3
    s = raw if cap is None else cap * torch.tanh(raw / cap)
    if slopes is not None:
        s = s - t64(slopes)[:, None, None] * (aq[:, None] - torch.arange(sk)).abs()
    p = torch.nan_to_num(torch.softmax(s.masked_fill(~mask, -math.inf), -1), nan=0.0)
    dp = t64(do).abs() @ vr.abs().transpose(-2, -1)
    ds = p * (dp + (p * dp).sum(-1, keepdim=True)) * 0.3
    if cap is not None:
        ds = ds * (1 - torch.tanh(raw / cap) ** 2)

    def fold(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], hkv, g, *x.shape[2:]).sum(2)

    return [ds @ kr.abs(), fold(ds.transpose(-2, -1) @ t64(q).abs()), fold(p.transpose(-2, -1) @ t64(do).abs())]


@checks("attention_math", "attention_grads64")
@checks("flash_attn", "flash_attn64", "flash_attn_scale")
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_attention_gradients(cfg: tuple[Any, ...]) -> None:
    hq, hkv, sq, sk, causal, (left, right), cap, alibi, kl = cfg
    q, k, v, do = attention_inputs(1, hq, hkv, sq, sk, 8)
    slopes = RNG.uniform(0.05, 0.6, hq) if alibi else None
    want, sizes = torch_grads(q, k, v, do, cfg, slopes), magnitudes(q, k, v, do, cfg, slopes)
    params = FlashAttnParams(0.3, causal, left, right, cap, kl)
    xs = [q, k, v, do, *([slopes] if alibi else [])]
    for slot, name in enumerate(("FlashAttnBackwardQ", "FlashAttnBackwardK", "FlashAttnBackwardV")):
        got = R.reference(name, xs, params)
        close(got, want[slot], sizes[slot])
        close(R.scale(name, xs, params, got), sizes[slot])
    mine = am.attention_grads64(q, k, v, do, 0.3, causal, left, right, cap, slopes, kl)
    for slot in range(3):
        close(mine[slot], want[slot], sizes[slot])


@checks("paged_attn", "gather_pages", "paged64", "paged_scale")
@pytest.mark.parametrize("opts", [{}, {"softcap": 3.0, "alibi": True}, {"window": 2}],
                         ids=["plain", "softcap-alibi", "window"])
def test_paged_attention(opts: dict[str, Any]) -> None:
    inputs, p = paged_attn.paged_inputs(RNG, DType.F64, 3, 4, 2, 3, 16, 4, (7, 2, 0), **opts)
    q, kc, vc, bt, cl = inputs[:5]
    alibi = inputs[5] if len(inputs) == 6 else None
    lmax = bt.shape[1] * 4
    t = torch.arange(lmax)
    lens = torch.from_numpy(cl.astype(np.int64))
    table = torch.from_numpy(bt.astype(np.int64))[:, t // 4]
    live = (t < lens[:, None]) & (table != paged_attn.DEAD_BLOCK)  # dead: past L, or left of the window
    blocks = torch.where(live, table, 0)
    live = live[:, None, :, None]
    k, v = ((t64(c)[blocks, t % 4].permute(0, 2, 1, 3) * live).numpy() for c in (kc, vc))
    close(paged_attn.gather_pages(kc, bt, cl), k, np.ones(k.shape), 0.0)
    sq = q.shape[2]
    aq = torch.arange(sq)[None, None, :] + lens[:, None, None] - sq
    mask = ((t <= aq[..., None]) & (t < lens[:, None, None, None]))
    if "window" in opts:
        mask &= t >= aq[..., None] - opts["window"]
    want, size = torch_attention(q, k, v, p.softmax_scale, mask, aq, p.softcap, alibi)
    close(R.reference("PagedAttn", list(inputs), p), want, size)
    close(R.scale("PagedAttn", list(inputs), p, want), size)
