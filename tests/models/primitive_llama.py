"""A Llama written the way a user writes one from plain Tensor ops, with no fused builder anywhere.

The same architecture and parameter names as `fuel.nn.Llama` (transformers' `LlamaForCausalLM` names), so
one state dict loads into both; the difference is only the spelling:

- projections are `x @ W.T` matmuls;
- RMSNorm is `x * rsqrt(mean(x², -1) + eps) * w` (LlamaRMSNorm's order);
- rotary embedding is `x·cos + rotate_half(x)·sin` with rotate_half by slicing the halves and a concat;
- attention is `softmax(q @ kᵀ · scale, masked) @ v`: the key/value heads repeated for the query heads by
  transformers' `repeat_kv` (an expand and a reshape), the causal mask applied with `where` from a
  lower-triangular constant, the softmax spelled `exp(s - max) / sum(exp(s - max))`;
- the loss is a max-shifted log-softmax, the target column gathered, ignored targets masked with `where`,
  and the sum divided by the number of counted rows (at least 1).

The fuse pass is what turns these spellings into the fused entries the hand-fused model calls directly;
`test_primitive_llama.py` checks that it does and that both models compute the same loss and gradients.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import fuel as fl
from fuel.dtype import f32
from fuel.graph.tensor import Tensor
from fuel.nn.llama import Llama

__all__ = ["PrimitiveLlama"]


def linear(x: Tensor, w: Tensor) -> Tensor:
    """`x @ w.T` over x's leading rows, w `[out, in]` (torch.nn.functional.linear without a bias)."""
    lead = x.shape[:-1]
    return (x.reshape(-1, x.shape[-1]) @ w.transpose(0, 1)).reshape(*lead, w.shape[0])


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return x * ((x * x).mean(-1, keepdim=True) + eps).rsqrt() * w


def rotate_half(x: Tensor) -> Tensor:
    h = x.shape[-1] // 2
    return fl.concat([-x[..., h:], x[..., :h]], axis=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """`[B, KV, T, D]` -> `[B, KV·n_rep, T, D]`, each key/value head repeated for its group of query heads."""
    if n_rep == 1:
        return x
    b, kv, t, d = x.shape
    return x.unsqueeze(2).broadcast_to(b, kv, n_rep, t, d).reshape(b, kv * n_rep, t, d)


def softmax(s: Tensor) -> Tensor:
    e = (s - s.max(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    t = q.shape[-2]
    allowed = fl.tensor(np.tril(np.ones((t, t), dtype=bool)), const=True)
    scores = q @ k.transpose(-1, -2) * scale
    return softmax(fl.where(allowed, scores, -np.inf)) @ v


def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int) -> Tensor:
    """Mean negative log-likelihood over the rows whose target is not `ignore_index`, 0 when none is (the count
    kept at least 1, so an all-ignored batch gives 0 as `fuel.nn.Llama.loss` does, not 0 / 0)."""
    shifted = logits - logits.max(-1, keepdim=True)
    log_probs = shifted - shifted.exp().sum(-1, keepdim=True).log()
    valid = targets != ignore_index
    picked = log_probs.gather(-1, fl.where(valid, targets, 0).unsqueeze(-1)).squeeze(-1)
    return fl.where(valid, -picked, 0.0).sum() / valid.cast(f32).sum().maximum(1.0)


class PrimitiveLlama(Llama):
    """`fuel.nn.Llama`'s parameters, names, initialisation and input checks (it is a subclass), with the forward
    and the loss written from primitives: `load_state_dict` and `get_parameters` treat both models alike."""

    def __call__(self, tokens: Any) -> Tensor:
        cfg = self.cfg
        t = self._tokens(tokens)
        b, n = t.shape
        hd, heads, kv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        cos = fl.tensor(self.rope_cos[:n], const=True)
        sin = fl.tensor(self.rope_sin[:n], const=True)
        x = self.model.embed_tokens.weight.index_select(0, t.reshape(-1)).reshape(b, n, cfg.dim)
        for layer in self.model.layers:
            at, mlp = layer.self_attn, layer.mlp
            h = rms_norm(x, layer.input_layernorm.weight, cfg.norm_eps)
            q = linear(h, at.q_proj.weight).reshape(b, n, heads, hd).transpose(1, 2)
            k = linear(h, at.k_proj.weight).reshape(b, n, kv, hd).transpose(1, 2)
            v = linear(h, at.v_proj.weight).reshape(b, n, kv, hd).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            a = causal_attention(q, repeat_kv(k, heads // kv), repeat_kv(v, heads // kv), hd ** -0.5)
            x = x + linear(a.transpose(1, 2).reshape(b, n, heads * hd), at.o_proj.weight)
            h = rms_norm(x, layer.post_attention_layernorm.weight, cfg.norm_eps)
            x = x + linear(linear(h, mlp.gate_proj.weight).silu() * linear(h, mlp.up_proj.weight),
                           mlp.down_proj.weight)
        return linear(rms_norm(x, self.model.norm.weight, cfg.norm_eps), self.lm_head.weight)

    def loss(self, tokens: Any, targets: Any, ignore_index: int = -100) -> Tensor:
        t = self._tokens(tokens)
        y = self._tokens(targets, "targets")
        if y.shape != t.shape:
            raise fl.ShapeError(f"PrimitiveLlama.loss: targets are {list(y.shape)}, tokens are {list(t.shape)}")
        return cross_entropy(self(t), y, ignore_index)
