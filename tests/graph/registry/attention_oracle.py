"""Torch float64 oracles for the attention tests: the semantics written out in torch (`torch_attention`,
`bottom_right`), and how far an output may move when its scores carry rounding (`sdpa_with_slack`).

Semantics (FlashAttention-2's, the registry's): s = scale·q·k, then softcap c·tanh(s/c), then ALiBi
−slope_h·|aq − j| with aq the query's position aligned bottom-right against the live keys, then the
mask, then softmax; a row with no admissible key gives 0. Query head h reads kv head h // (Hq/Hkv).

The tolerance at large logits:

A kernel's scores come out of products, the scale and the shift by the row's max, each rounded, so the
score s_j it uses is off by at most δ_j = 2·(D + 4)·u·(A_j + A_max) + 8·u, where u is the compute
type's unit roundoff, A_j = |scale|·Σ_d |q_d|·|k_jd| and A_max the largest A_j of the row (the shift).
At logits of 1e6 and more, δ_j is far above the unit tolerance, and the probabilities can then move
as far as such perturbations allow. That is bounded exactly per probability:
    hi_j = e^(s_j+δ_j) / (e^(s_j+δ_j) + Σ_{k≠j} e^(s_k−δ_k)),  lo_j = the same with the signs swapped,
so an output element may move by Σ_j max(hi_j − p_j, p_j − lo_j)·|v_j| (its `slack`). The slack is
per element, and it is ~0 wherever a row's largest score stands clear of the others by many δ: there
the kernel must give the one-hot answer, exactly what a kernel whose exponent leaves the range breaks.

Everything here is torch float64, independent of fuel.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.nn.functional import scaled_dot_product_attention

from fuel.dtype import DType

# The unit roundoff of each dtype's compute type (the half types compute in f32).
UNIT = {DType.F64: 2.0**-53, DType.F32: 2.0**-24, DType.BF16: 2.0**-24, DType.F16: 2.0**-24}


# log10 of the size of large q and k, per dtype: logits up to ~1e13. f16 holds up to 65504, so its
# values are drawn near 1e4 and clipped (`large`).
MAGNITUDES = {DType.F16: (3.5, 4.3)}
F16_MOST = 60000.0


def large(rng: np.random.Generator, shape: tuple[int, ...], dt: DType, size: float) -> np.ndarray:
    """Normal values of the magnitude `size` in [0, 1] picks from MAGNITUDES, rounded to dt (f16's clipped
    to its range)."""
    lo, hi = MAGNITUDES.get(dt, (3.0, 6.0))
    x = rng.standard_normal(shape) * 10 ** (lo + size * (hi - lo))
    return np.clip(x, -F16_MOST, F16_MOST).astype(dt.np) if dt is DType.F16 else x.astype(dt.np)


def without_each(x: torch.Tensor) -> torch.Tensor:
    """log Σ_{k≠j} e^(x_k) for every j of the last axis (-inf where no other term is finite)."""
    m, top = x.max(-1, keepdim=True)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(x - safe)
    # For j other than the max's index the max's own term stays in the sum (>= 1): no cancellation.
    rest = safe + torch.log((e.sum(-1, keepdim=True) - e).clamp_min(0))
    at_top = torch.logsumexp(x.scatter(-1, top, -math.inf), -1, keepdim=True)
    return rest.scatter(-1, top, at_top)


def probability_bounds(s: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """max(hi_j − p_j, p_j − lo_j) for the softmax of s (-inf: masked) when each s_j may be off by δ_j."""
    up, down = s + delta, s - delta
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
    hi = torch.exp(up - torch.logaddexp(up, without_each(down)))
    lo = torch.exp(down - torch.logaddexp(down, without_each(up)))
    return torch.nan_to_num(torch.maximum(hi - p, p - lo), nan=0.0).clamp_min(0)


def bottom_right(sq: int, sk: int, k_len: int | None = None, causal: bool = False, left: int | None = None,
                 right: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, aq): bool `[Sq, Sk]` (True: attend) and each query's aligned position `[Sq]`. Query i sits
    at aq = i + k_len − Sq and sees key j iff j < k_len and aq − left <= j <= aq + right (None:
    unbounded; causal caps right at 0)."""
    kl = sk if k_len is None else k_len
    aq = torch.arange(sq) + kl - sq
    j = torch.arange(sk)[None, :]
    ok = (j < kl).expand(sq, sk).clone()
    if causal:
        right = 0 if right is None else min(right, 0)
    if left is not None:
        ok &= j >= aq[:, None] - left
    if right is not None:
        ok &= j <= aq[:, None] + right
    return ok, aq


def torch_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, mask: torch.Tensor,
                    aq: torch.Tensor, softcap: float | None = None, alibi: np.ndarray | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(output, S = Σ p·|v|) in float64: q `[B,Hq,Sq,D]`, k and v `[B,Hkv,Sk,D]`, a bool mask and the
    query positions aq broadcasting to `[B,1,Sq,Sk]` and `[B,1,Sq]` (`bottom_right`), slopes `[Hq]`."""
    tq, tk, tv = (torch.from_numpy(np.array(a, np.float64)) for a in (q, k, v))
    g = tq.shape[1] // max(tk.shape[1], 1)
    kr, vr = tk.repeat_interleave(g, 1), tv.repeat_interleave(g, 1)
    s = (tq @ kr.transpose(-2, -1)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        slopes = torch.from_numpy(np.asarray(alibi, np.float64))[:, None, None]
        s = s - slopes * (aq[..., None] - torch.arange(tk.shape[2])).abs()
    p = torch.nan_to_num(torch.softmax(s.masked_fill(~mask, -math.inf), -1), nan=0.0)
    return (p @ vr).numpy(), (p @ vr.abs()).numpy()


def sdpa_with_slack(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, mask: torch.Tensor, dt: DType
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(torch float64 SDPA output, S = Σ p·|v|, the slack) per element, for q `[B,Hq,Sq,D]`, k and v
    `[B,Hkv,Sk,D]` (query head h reads kv head h // (Hq/Hkv)) and a bool mask broadcasting to
    `[B,Hq,Sq,Sk]` (True: attend)."""
    tq, tk, tv = (torch.from_numpy(np.array(a, np.float64)) for a in (q, k, v))
    out = scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, scale=scale, enable_gqa=True)
    g = tq.shape[1] // tk.shape[1]
    kr, vr = tk.repeat_interleave(g, 1), tv.repeat_interleave(g, 1)
    s = ((tq @ kr.transpose(-2, -1)) * scale).masked_fill(~mask, -math.inf)
    sizes = (tq.abs() @ kr.abs().transpose(-2, -1)) * abs(scale)
    sizes = sizes.masked_fill(~mask, 0.0)
    u = UNIT[dt]
    delta = 2 * (tq.shape[-1] + 4) * u * (sizes + sizes.amax(-1, keepdim=True)) + 8 * u
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
    slack = probability_bounds(s, delta.masked_fill(~mask, 0.0)) @ vr.abs()
    return out.numpy(), (p @ vr.abs()).numpy(), slack.numpy()
