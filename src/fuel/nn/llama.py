"""A trainable Llama whose parameters carry transformers' `LlamaForCausalLM` names, so one safetensors file
loads in both.

    cfg = LlamaConfig(dim=64, n_layers=5, n_heads=8, n_kv_heads=4, vocab_size=512, hidden_dim=172)
    model = Llama(cfg)                          # weights ~ N(0, 0.02), norms 1 (transformers' init)
    logits = model(tokens)                      # tokens [B, T] i64 -> [B, T, vocab]
    loss = model.loss(tokens, targets)          # mean cross-entropy, targets i64 [B, T], -100 ignored
    load_state_dict(model, safe_load("model.safetensors"))

The structure mirrors transformers' (`model.model.layers[i].self_attn.q_proj.weight`), and each piece is the
fused op transformers' eager code spells out: RmsNormLastDim times the weight (the norm in f32 at least, given
back in the activations' dtype, then the weight: LlamaRMSNorm's order), Rope with tables computed as
LlamaRotaryEmbedding computes them, causal FlashAttn with the key/value heads shared by groups of query heads
(GQA) at scale head_dim^-1/2, the SwiGLU FFN `down(silu(gate(h)) · up(h))`, and FusedSoftmaxCrossEntropy as
the loss. Built from `fuel.ops` and Tensor methods only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuel import ops
from fuel.dtype import DType, f32, i64
from fuel.errors import DTypeError, ParamError, ShapeError
from fuel.graph.tensor import Tensor, as_tensor, tensor
from fuel.nn.layers import Embedding, Linear, RMSNorm, parameter

__all__ = ["Llama", "LlamaConfig", "rope_tables"]

INIT_STD = 0.02  # transformers' initializer_range: every Linear and the embedding ~ N(0, 0.02²)


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama. `hidden_dim` is the FFN's width (transformers' intermediate_size)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    hidden_dim: int
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim", "max_seq_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
                raise ParamError(f"LlamaConfig: {name} must be a positive int, got {v!r}")
        if self.dim % self.n_heads:
            raise ParamError(f"LlamaConfig: n_heads {self.n_heads} does not divide dim {self.dim}")
        if self.n_heads % self.n_kv_heads:
            raise ParamError(f"LlamaConfig: n_kv_heads {self.n_kv_heads} does not divide n_heads {self.n_heads}")
        if self.head_dim % 2:
            raise ParamError(f"LlamaConfig: head_dim (dim / n_heads) must be even for rope, got {self.head_dim}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise ParamError(f"LlamaConfig: rope_theta must be a finite number > 0, got {self.rope_theta!r}")
        if not (math.isfinite(self.norm_eps) and self.norm_eps >= 0):
            raise ParamError(f"LlamaConfig: norm_eps must be a finite number >= 0, got {self.norm_eps!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def to_hf(self) -> dict[str, Any]:
        """Keyword arguments of `transformers.LlamaConfig` for the same model."""
        return {"vocab_size": self.vocab_size, "hidden_size": self.dim, "intermediate_size": self.hidden_dim,
                "num_hidden_layers": self.n_layers, "num_attention_heads": self.n_heads,
                "num_key_value_heads": self.n_kv_heads, "head_dim": self.head_dim, "hidden_act": "silu",
                "max_position_embeddings": self.max_seq_len, "rms_norm_eps": self.norm_eps,
                "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
                "tie_word_embeddings": self.tie_embeddings, "attention_bias": False, "mlp_bias": False,
                "initializer_range": INIT_STD}

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> LlamaConfig:
        """The config of a transformers Llama config dict (`config.to_dict()` or a config.json's contents).
        Only the default rope, silu and bias-free projections are supported (a ParamError otherwise)."""
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ParamError(f"LlamaConfig.from_hf: rope_type {kind!r} is not supported (only 'default')")
        if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ParamError("LlamaConfig.from_hf: only silu and bias-free projections are supported, got "
                             f"hidden_act={hf.get('hidden_act')!r}, attention_bias={hf.get('attention_bias')!r}, "
                             f"mlp_bias={hf.get('mlp_bias')!r}")
        dim, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim")
        if head_dim is not None and int(head_dim) * heads != dim:
            raise ParamError(f"LlamaConfig.from_hf: head_dim {head_dim} x {heads} heads != hidden_size {dim}")
        return cls(dim=dim, n_layers=int(hf["num_hidden_layers"]), n_heads=heads,
                   n_kv_heads=int(hf.get("num_key_value_heads") or heads), vocab_size=int(hf["vocab_size"]),
                   hidden_dim=int(hf["intermediate_size"]), max_seq_len=int(hf.get("max_position_embeddings", 2048)),
                   rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
                   norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(hf.get("tie_word_embeddings")))


def rope_tables(theta: float, head_dim: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin `[length, head_dim]` f32, read-only, as transformers' LlamaRotaryEmbedding makes them in f32:
    inv_freq = 1 / theta^(arange(0, D, 2) / D), angles = position · inv_freq, cat(angles, angles). Each f32 step
    rounds as torch's does; torch's pow and cos/sin may differ from NumPy's by an ulp (tests/nn measure it)."""
    exps = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / (np.float32(theta) ** exps)
    angles = np.arange(length, dtype=np.float32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([angles, angles], axis=1)
    cos, sin = np.cos(emb), np.sin(emb)
    cos.flags.writeable = False
    sin.flags.writeable = False
    return cos, sin


def _projection(n_in: int, n_out: int, dtype: DType, rng: np.random.Generator) -> Linear:
    layer = Linear(n_in, n_out, bias=False, dtype=dtype, seed=0)
    layer.weight = parameter(rng.normal(0.0, INIT_STD, (n_out, n_in)), dtype)
    return layer


class LlamaAttention:
    def __init__(self, cfg: LlamaConfig, dtype: DType, rng: np.random.Generator) -> None:
        hd = cfg.head_dim
        self.q_proj = _projection(cfg.dim, cfg.n_heads * hd, dtype, rng)
        self.k_proj = _projection(cfg.dim, cfg.n_kv_heads * hd, dtype, rng)
        self.v_proj = _projection(cfg.dim, cfg.n_kv_heads * hd, dtype, rng)
        self.o_proj = _projection(cfg.n_heads * hd, cfg.dim, dtype, rng)

    def __call__(self, h: Tensor, cos: Tensor, sin: Tensor, cfg: LlamaConfig) -> Tensor:
        b, t, _ = h.shape
        hd = cfg.head_dim

        def heads(x: Tensor, n: int) -> Tensor:  # [B, T, n·D] -> [B, n, T, D]
            return x.reshape(b, t, n, hd).permute(0, 2, 1, 3)

        q = ops.rope(heads(self.q_proj(h), cfg.n_heads), cos, sin)
        k = ops.rope(heads(self.k_proj(h), cfg.n_kv_heads), cos, sin)
        v = heads(self.v_proj(h), cfg.n_kv_heads)
        a = ops.flash_attn(q, k, v, softmax_scale=hd ** -0.5, causal=True)
        return self.o_proj(a.permute(0, 2, 1, 3).reshape(b, t, cfg.n_heads * hd))


class LlamaMLP:
    def __init__(self, cfg: LlamaConfig, dtype: DType, rng: np.random.Generator) -> None:
        self.gate_proj = _projection(cfg.dim, cfg.hidden_dim, dtype, rng)
        self.up_proj = _projection(cfg.dim, cfg.hidden_dim, dtype, rng)
        self.down_proj = _projection(cfg.hidden_dim, cfg.dim, dtype, rng)

    def __call__(self, h: Tensor) -> Tensor:
        return self.down_proj(self.gate_proj(h).silu() * self.up_proj(h))


class LlamaDecoderLayer:
    def __init__(self, cfg: LlamaConfig, dtype: DType, rng: np.random.Generator) -> None:
        self.self_attn = LlamaAttention(cfg, dtype, rng)
        self.mlp = LlamaMLP(cfg, dtype, rng)
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, dtype)

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, cfg: LlamaConfig) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cfg)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel:
    """transformers' `LlamaModel`: the embedding, the decoder layers and the final norm."""

    def __init__(self, cfg: LlamaConfig, dtype: DType, rng: np.random.Generator) -> None:
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.dim, dtype=dtype, seed=0)
        self.embed_tokens.weight = parameter(rng.normal(0.0, INIT_STD, (cfg.vocab_size, cfg.dim)), dtype)
        self.layers = [LlamaDecoderLayer(cfg, dtype, rng) for _ in range(cfg.n_layers)]
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype)


class Llama:
    """transformers' `LlamaForCausalLM`: `model` (a LlamaModel) and `lm_head` (its weight is the embedding's
    own tensor when the config ties them: one parameter, listed under both names)."""

    def __init__(self, cfg: LlamaConfig, dtype: DType = f32, seed: int = 0) -> None:
        if not isinstance(cfg, LlamaConfig):
            raise ParamError(f"Llama: cfg must be a LlamaConfig, got {type(cfg).__name__}")
        if not isinstance(dtype, DType) or not dtype.is_float:
            raise DTypeError(f"Llama: dtype must be a float DType, got {dtype!r}")
        self.cfg, self.dtype = cfg, dtype
        rng = np.random.default_rng(seed)
        self.model = LlamaModel(cfg, dtype, rng)
        self.lm_head = Linear(cfg.dim, cfg.vocab_size, bias=False, dtype=dtype, seed=0)
        self.lm_head.weight = (self.model.embed_tokens.weight if cfg.tie_embeddings
                               else parameter(rng.normal(0.0, INIT_STD, (cfg.vocab_size, cfg.dim)), dtype))
        cos, sin = rope_tables(cfg.rope_theta, cfg.head_dim, cfg.max_seq_len)
        self.rope_cos, self.rope_sin = (_frozen(a.astype(dtype.np)) for a in (cos, sin))

    def _tokens(self, tokens: Any, what: str = "tokens") -> Tensor:
        t = as_tensor(tokens)
        if t.dtype is not i64:
            raise DTypeError(f"Llama: {what} must be i64, got {t.dtype.value}")
        if t.ndim != 2 or t.shape[1] < 1:
            raise ShapeError(f"Llama: {what} must be [batch, seq] with seq >= 1, got {list(t.shape)}")
        if t.shape[1] > self.cfg.max_seq_len:
            raise ShapeError(f"Llama: {what} has {t.shape[1]} positions, more than max_seq_len "
                             f"{self.cfg.max_seq_len}")
        return t

    def __call__(self, tokens: Any) -> Tensor:
        """The logits `[B, T, vocab]` of tokens `[B, T]` (i64), every row seeing itself and the rows before it."""
        t = self._tokens(tokens)
        n = t.shape[1]
        cos, sin = tensor(self.rope_cos[:n], const=True), tensor(self.rope_sin[:n], const=True)
        x = self.model.embed_tokens(t)
        for layer in self.model.layers:
            x = layer(x, cos, sin, self.cfg)
        return self.lm_head(self.model.norm(x))

    def loss(self, tokens: Any, targets: Any, ignore_index: int = -100) -> Tensor:
        """The mean cross-entropy (an f32 scalar) of the logits of `tokens` against `targets` `[B, T]` (i64),
        over the positions whose target is not `ignore_index` (0 if none is)."""
        t = self._tokens(tokens)
        y = self._tokens(targets, "targets")
        if y.shape != t.shape:
            raise ShapeError(f"Llama.loss: targets are {list(y.shape)}, tokens are {list(t.shape)}")
        return ops.fused_softmax_cross_entropy(self(t), y, "mean", ignore_index)


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    a.flags.writeable = False
    return a
