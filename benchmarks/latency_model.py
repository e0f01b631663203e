"""A SmolLM2-135M-shaped decoder (random f32 weights, no embedding or LM head) for bench_latency.

The model is written once, in `forward`, over a small `Math` adapter, so fuel, NumPy and torch run
the very same sequence of operations (same layouts, same GQA grouping, same mask handling): a latency
gap between them is then the runtime's, not a difference in the job. The adapters only cover what the
three libraries spell differently (norms, rope, softmax, silu, axis moves); `@`, `*` and `+` are native.

Call convention (also the one `fl.jit` traces): `fn(x, mask, *caches, cos, sin)`.
Decode: x `[1, hidden]`, mask `[1, cache]` (0 live, -inf dead), caches `k0, v0, k1, v1, …` each
`[kv_heads, cache, head_dim]`, cos/sin `[1, head_dim]`. Prefill: x `[S, hidden]`, a causal mask `[S, S]`,
no caches (attention over the tokens themselves), cos/sin `[S, head_dim]`. Both return
`(final normed hidden, k_0, v_0, k_1, v_1, …)`: the new (roped) key and value rows of every layer, which
a real decode writes into its cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import fuel as fl

Array = Any  # a fuel Tensor, a NumPy array or a torch tensor, depending on the adapter


@dataclass(frozen=True)
class ModelConfig:
    """SmolLM2-135M's shape by default; tests shrink it."""

    layers: int = 30
    hidden: int = 576
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    ffn: int = 1536
    cache: int = 256
    prefill: int = 64
    eps: float = 1e-5
    rope_base: float = 10000.0

    @property
    def rep(self) -> int:
        """Query heads per KV head (GQA); query head h reads KV head h // rep, as HF's repeat_kv."""
        return self.heads // self.kv_heads

    @property
    def decode_pos(self) -> int:
        """The decode step's position: mid-cache, so the mask has both live and dead positions."""
        return self.cache // 2


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    mlp_norm: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray


@dataclass(frozen=True)
class Weights:
    layers: tuple[LayerWeights, ...]
    final_norm: np.ndarray

    def convert(self, f: Callable[[np.ndarray], Any]) -> Weights:
        """The same weights in another library's type (fuel leaves and torch views share the arrays)."""
        return Weights(tuple(LayerWeights(*(f(getattr(lw, k)) for k in LayerWeights.__dataclass_fields__))
                             for lw in self.layers), f(self.final_norm))


def make_weights(cfg: ModelConfig, seed: int = 0) -> Weights:
    """Seeded random weights, [in, out] for `x @ w`, scaled by 1/sqrt(fan_in) so 30 residual layers stay
    O(1) and the three implementations can be compared at a fixed tolerance."""
    rng = np.random.default_rng(seed)

    def lin(n_in: int, n_out: int) -> np.ndarray:
        return rng.standard_normal((n_in, n_out), dtype=np.float32) * np.float32(1 / math.sqrt(n_in))

    def norm(n: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    q, kv, h = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.hidden
    layers = tuple(LayerWeights(norm(h), lin(h, q), lin(h, kv), lin(h, kv), lin(q, h),
                                norm(h), lin(h, cfg.ffn), lin(h, cfg.ffn), lin(cfg.ffn, h))
                   for _ in range(cfg.layers))
    return Weights(layers, norm(h))


def rope_tables(cfg: ModelConfig, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rotate-half tables [len(positions), head_dim]: the angle row is duplicated across the halves."""
    inv = cfg.rope_base ** (-np.arange(0, cfg.head_dim // 2, dtype=np.float64) * 2.0 / cfg.head_dim)
    ang = positions.astype(np.float64)[:, None] * inv[None, :]
    ang = np.concatenate([ang, ang], axis=1)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def decode_inputs(cfg: ModelConfig, seed: int = 1) -> list[np.ndarray]:
    """`[x, mask, k0, v0, …, cos, sin]` for one decode step at `cfg.decode_pos` over random caches."""
    rng = np.random.default_rng(seed)
    pos = cfg.decode_pos
    x = rng.standard_normal((1, cfg.hidden), dtype=np.float32)
    mask = np.where(np.arange(cfg.cache) < pos + 1, 0.0, -np.inf).astype(np.float32)[None, :]
    caches = [rng.standard_normal((cfg.kv_heads, cfg.cache, cfg.head_dim), dtype=np.float32)
              for _ in range(2 * cfg.layers)]
    cos, sin = rope_tables(cfg, np.array([pos]))
    return [x, mask, *caches, cos, sin]


def prefill_inputs(cfg: ModelConfig, seed: int = 2) -> list[np.ndarray]:
    """`[x, causal mask, cos, sin]` for a prefill of `cfg.prefill` tokens from position 0."""
    rng = np.random.default_rng(seed)
    s = cfg.prefill
    x = rng.standard_normal((s, cfg.hidden), dtype=np.float32)
    mask = np.triu(np.full((s, s), -np.inf, np.float32), k=1)
    cos, sin = rope_tables(cfg, np.arange(s))
    return [x, mask, cos, sin]


# ---- the three libraries' spellings ----------------------------------------------------------

# Bound once, as a latency-minded user would, so fuel eager times the graph build and not the
# attribute lookup (at 74013a4 each `fl.ops.<name>` access re-resolved the registry: ~30 µs).
_fl_rms = fl.ops.rms_norm_last_dim
_fl_rope = fl.ops.rope
_fl_softmax = fl.ops.softmax_last_dim


class FuelMath:
    @staticmethod
    def rms_norm(x: Array, w: Array, eps: float) -> Array:
        return _fl_rms(x, eps) * w

    @staticmethod
    def rope(x: Array, cos: Array, sin: Array) -> Array:
        return _fl_rope(x, cos, sin)

    @staticmethod
    def softmax(x: Array) -> Array:
        return _fl_softmax(x)

    @staticmethod
    def silu(x: Array) -> Array:
        return x.silu()

    @staticmethod
    def permute(x: Array, axes: tuple[int, ...]) -> Array:
        return x.permute(*axes)


class NumpyMath:
    @staticmethod
    def rms_norm(x: Array, w: Array, eps: float) -> Array:
        return x * (1 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))) * w

    @staticmethod
    def rope(x: Array, cos: Array, sin: Array) -> Array:
        h = x.shape[-1] // 2
        return x * cos + np.concatenate([-x[..., h:], x[..., :h]], axis=-1) * sin

    @staticmethod
    def softmax(x: Array) -> Array:
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    @staticmethod
    def silu(x: Array) -> Array:
        with np.errstate(over="ignore"):  # exp(-x) overflows to inf for very negative x: x / inf = -0
            return x / (1 + np.exp(-x))

    @staticmethod
    def permute(x: Array, axes: tuple[int, ...]) -> Array:
        return np.transpose(x, axes)


def torch_math() -> type:
    """The torch adapter, built on first use so that importing this module does not load torch (whose
    OpenMP pool reads OMP_WAIT_POLICY when it loads; the bench sets it first)."""
    import torch
    import torch.nn.functional as F

    class TorchMath:
        @staticmethod
        def rms_norm(x: Array, w: Array, eps: float) -> Array:
            return F.rms_norm(x, (x.shape[-1],), w, eps)

        @staticmethod
        def rope(x: Array, cos: Array, sin: Array) -> Array:
            h = x.shape[-1] // 2
            return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin

        @staticmethod
        def softmax(x: Array) -> Array:
            return torch.softmax(x, dim=-1)

        @staticmethod
        def silu(x: Array) -> Array:
            return F.silu(x)

        @staticmethod
        def permute(x: Array, axes: tuple[int, ...]) -> Array:
            return x.permute(*axes)

    return TorchMath


Math = Any  # FuelMath, NumpyMath or torch_math(): classes of static methods


# ---- the model --------------------------------------------------------------------------------


def _split_heads(m: Math, x: Array, n: int, d: int) -> Array:
    """[S, n*d] -> [n, S, d]; one row is a plain reshape (no axis move, so no copy in any library)."""
    s = x.shape[0]
    return x.reshape(n, 1, d) if s == 1 else m.permute(x.reshape(s, n, d), (1, 0, 2))


def _merge_heads(m: Math, x: Array) -> Array:
    """[n, S, d] -> [S, n*d], the inverse of _split_heads."""
    n, s, d = x.shape
    return x.reshape(1, n * d) if s == 1 else m.permute(x, (1, 0, 2)).reshape(s, n * d)


def _attention(m: Math, cfg: ModelConfig, q: Array, keys: Array, values: Array, mask: Array) -> Array:
    """GQA without repeating K/V: q [heads, S, D] viewed as [kv_heads, rep*S, D] (query head h reads KV
    head h // rep), so each KV head is one GEMM. The mask [S, T] is added on a [kv, rep, S, T] view
    (for S = 1 it broadcasts as is)."""
    _, s, d = q.shape
    t = keys.shape[-2]
    qg = q.reshape(cfg.kv_heads, cfg.rep * s, d)
    scores = (qg @ m.permute(keys, (0, 2, 1))) * (1.0 / math.sqrt(d))
    if s == 1:
        probs = m.softmax(scores + mask)
    else:
        probs = m.softmax(scores.reshape(cfg.kv_heads, cfg.rep, s, t) + mask).reshape(cfg.kv_heads, cfg.rep * s, t)
    return (probs @ values).reshape(cfg.heads, s, d)


def forward(m: Math, cfg: ModelConfig, w: Weights, args: Sequence[Array]) -> tuple[Array, ...]:
    """One decode step (2 * layers caches among `args`) or a prefill (none): see the module docstring."""
    x, mask, *caches, cos, sin = args
    if caches and len(caches) != 2 * cfg.layers:
        raise ValueError(f"forward: expected {2 * cfg.layers} caches (k, v per layer), got {len(caches)}")
    new_kv: list[Array] = []
    for i, lw in enumerate(w.layers):
        h = m.rms_norm(x, lw.attn_norm, cfg.eps)
        q = m.rope(_split_heads(m, h @ lw.wq, cfg.heads, cfg.head_dim), cos, sin)
        k = m.rope(_split_heads(m, h @ lw.wk, cfg.kv_heads, cfg.head_dim), cos, sin)
        v = _split_heads(m, h @ lw.wv, cfg.kv_heads, cfg.head_dim)
        new_kv += [k, v]
        keys, values = (caches[2 * i], caches[2 * i + 1]) if caches else (k, v)
        x = x + _merge_heads(m, _attention(m, cfg, q, keys, values, mask)) @ lw.wo
        h = m.rms_norm(x, lw.mlp_norm, cfg.eps)
        x = x + (m.silu(h @ lw.w_gate) * (h @ lw.w_up)) @ lw.w_down
    return (m.rms_norm(x, w.final_norm, cfg.eps), *new_kv)


# ---- one callable per way ----------------------------------------------------------------------


def fuel_fn(cfg: ModelConfig, w: Weights) -> Callable[..., tuple[fl.Tensor, ...]]:
    """The graph builder `fn(x, mask, *caches, cos, sin)` over fuel Tensors; weights are closure leaves."""
    wt = w.convert(fl.tensor)
    return lambda *args: forward(FuelMath, cfg, wt, args)


def fuel_eager(fn: Callable[..., tuple[fl.Tensor, ...]]) -> Callable[..., list[np.ndarray]]:
    """Build the graph from fresh leaves and realise it: what an eager fuel user pays each step."""
    def run(*arrays: np.ndarray) -> list[np.ndarray]:
        outs = fl.realize(*fn(*(fl.tensor(a) for a in arrays)))
        return [o.numpy() for o in outs]
    return run


def numpy_fn(cfg: ModelConfig, w: Weights) -> Callable[..., tuple[np.ndarray, ...]]:
    return lambda *args: forward(NumpyMath, cfg, w, args)


def torch_fn(cfg: ModelConfig, w: Weights) -> Callable[..., tuple[Any, ...]]:
    """Torch eager under inference_mode over torch inputs (convert them once with torch_inputs)."""
    import torch

    wt = w.convert(torch.from_numpy)
    math_ = torch_math()

    def run(*args: Any) -> tuple[Any, ...]:
        with torch.inference_mode():
            return forward(math_, cfg, wt, args)
    return run


def torch_inputs(arrays: Sequence[np.ndarray]) -> list[Any]:
    import torch

    return [torch.from_numpy(a) for a in arrays]
