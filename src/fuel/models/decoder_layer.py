"""The decoder-layer recipe every Llama-family architecture shares, with the options of its `ArchSpec`
(`fuel.models.architectures`), as llama.cpp's `llm_build_*` functions share their building blocks.

A layer of rows x `[S, hidden]`:

    h = rms_norm(x) · attn_norm
    q, k, v = h @ Wq, h @ Wk, h @ Wv            (+ biases: qwen2; one fused weight: phi3)
    q, k = rms_norm(q) · q_norm, rms_norm(k) · k_norm   per head (qwen3, gemma3)
    q, k = rope(q), rope(k)                      (the layer's tables: Gemma 3's window layers have their own)
    a = attention(q, K, V)                       (scale, window, logit softcap: per the config)
    x = x + post_norm(a @ Wo)                    (post-norms: gemma2, gemma3)
    h = rms_norm(x) · ffn_norm
    x = x + post_norm(act(h @ Wgate) · (h @ Wup) @ Wdown)   (SiLU, or tanh-GELU for Gemma; phi3 fuses gate+up)

and the head: rms_norm(x) · output_norm @ Wout, then `c·tanh(logits/c)` with Gemma 2's final softcap. The
embedding rows are scaled by √hidden for Gemma. `layer_weights` reads one layer's tensors by their GGUF
names; `DecoderGraph` holds the graph of each part, which `LlamaModel`'s captured steps, its training
forward (`causal_logits`) and the serving batch step (`fuel.serve.batch_model`) all build from.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

import fuel as fl
from fuel.graph.tensor import Tensor
from fuel.io.gguf import GGUFFile
from fuel.models.llama_weights import LlamaConfig, ModelError, _Linear, _Projections

# (layer, projection name, input rows x, the projection's output y) -> the output to use instead (y plus a term)
ProjectionHook = Callable[[int, str, Tensor, Tensor], Tensor]

# the tensors of a layer, by GGUF name, that some architecture reads; `layer_weights` refuses any other
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "attn_q_norm", "attn_k_norm",
                 "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm")


def gelu_tanh(x: Tensor) -> Tensor:
    """GELU, tanh form (Gemma's `gelu_pytorch_tanh`)."""
    return x * 0.5 * ((x + x * x * x * 0.044715) * math.sqrt(2.0 / math.pi)).tanh() + x * 0.5


def layer_weights(f: GGUFFile, cfg: LlamaConfig, i: int) -> dict[str, Any]:
    """Layer i's weights by role, read from the source by GGUF name as its spec says; a missing tensor is a
    `GGUFKeyError` naming it, one no architecture option reads a ModelError naming it."""
    spec, p = cfg.spec, f"blk.{i}."
    q_rows, kv_rows = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    used = {"attn_norm", "attn_output", "ffn_norm", "ffn_up", "ffn_down"}
    lw: dict[str, Any] = {"index": i, "attn_norm": f[p + "attn_norm.weight"].array(),
                          "o": _Linear.of(f[p + "attn_output.weight"]), "ffn_norm": f[p + "ffn_norm.weight"].array(),
                          "down": _Linear.of(f[p + "ffn_down.weight"])}
    if spec.fused_qkv:
        used.add("attn_qkv")
        lw["qkv"] = _Projections.fused(_Linear.of(f[p + "attn_qkv.weight"]), {"q": q_rows, "k": kv_rows, "v": kv_rows})
    else:
        used |= {"attn_q", "attn_k", "attn_v"}
        heads = (cfg.heads, cfg.kv_heads) if spec.permuted_qk else (None, None)  # the converter's rope permutation
        lw["qkv"] = _Projections({"q": _Linear.of(f[p + "attn_q.weight"], heads[0]),
                                  "k": _Linear.of(f[p + "attn_k.weight"], heads[1]),
                                  "v": _Linear.of(f[p + "attn_v.weight"])})
    if spec.fused_gate_up:
        lw["gate_up"] = _Projections.fused(_Linear.of(f[p + "ffn_up.weight"]), {"gate": cfg.ffn, "up": cfg.ffn})
    else:
        used.add("ffn_gate")
        lw["gate_up"] = _Projections({"gate": _Linear.of(f[p + "ffn_gate.weight"]),
                                      "up": _Linear.of(f[p + "ffn_up.weight"])})
    if spec.qkv_bias:
        biases = [f[p + f"attn_{n}.bias"].array().astype(np.float32).reshape(-1) for n in "qkv"]
        lw["bias"] = dict(zip("qkv", biases, strict=True)) | {"q+k": np.concatenate(biases[:2])}
    names = ["attn_q_norm", "attn_k_norm"] if spec.qk_norm else []
    names += ["post_attention_norm", "post_ffw_norm"] if spec.post_norms else []
    for name in names:
        lw[name] = f[p + name + ".weight"].array()
    used |= set(names)
    for name in f.names():
        if name.startswith(p) and name.removeprefix(p).removesuffix(".weight") not in used and not (
                spec.qkv_bias and name.removeprefix(p) in ("attn_q.bias", "attn_k.bias", "attn_v.bias")):
            raise ModelError(f"model: {f.path}: tensor {name!r} is not read by the {cfg.arch} decoder (an option "
                             "of the architecture it does not support)")
    return lw


class DecoderGraph:
    """The graph of a decoder's parts (module doc); `LlamaModel` holds the weights these methods read."""

    cfg: LlamaConfig
    layers: list[dict[str, Any]]
    adapter: ProjectionHook | None
    out_norm: np.ndarray
    head: _Linear

    def _norm(self, x: Tensor, w: np.ndarray) -> Tensor:
        return fl.ops.rms_norm_last_dim(x, self.cfg.eps) * fl.tensor(w)

    def _heads(self, x: Tensor, heads: int, batch: int = 1) -> Tensor:
        """`[B·S, heads·D]` → `[B, heads, S, D]` (rows of sequence b are b·S … b·S + S - 1)."""
        s = x.shape[0] // batch
        return x.reshape(batch, s, heads, self.cfg.head_dim).permute(0, 2, 1, 3)

    def project(self, lw: dict[str, Any], name: str, x: Tensor, y: Tensor) -> Tensor:
        """Projection `name` ("q", "k", "v", "o", "gate", "up", "down") of layer lw: its output y of the
        input rows x, with the adapter's term added when one is set."""
        return y if self.adapter is None else self.adapter(lw["index"], name, x, y)

    def qkv(self, i: int, lw: dict[str, Any], h: Tensor, tables: dict[str, tuple[Tensor, Tensor]], batch: int = 1
            ) -> tuple[Tensor, Tensor, Tensor]:
        """Layer i's queries, keys and values `[B, heads, S, D]` of the normed rows h `[B·S, hidden]` (B = batch
        sequences of S rows): biases added, per-head norms, rope applied with the layer's tables (row s of the
        tables is position s's)."""
        cfg = self.cfg
        p = self._qkv_products(lw, h, None if self.adapter is not None else ("q", "k"))
        cos, sin = tables[cfg.rope_name(i)]
        if "q+k" in p and not cfg.spec.qk_norm:  # one rope over Q's and K's heads: one step less per layer
            qk = fl.ops.rope(self._heads(p["q+k"], cfg.heads + cfg.kv_heads, batch), cos, sin)
            q, k, v = qk[:, :cfg.heads], qk[:, cfg.heads:], self._heads(p["v"], cfg.kv_heads, batch)
        else:
            q, k, v = (self._heads(p[n], hs, batch)
                       for n, hs in (("q", cfg.heads), ("k", cfg.kv_heads), ("v", cfg.kv_heads)))
            if cfg.spec.qk_norm:
                q, k = self._norm(q, lw["attn_q_norm"]), self._norm(k, lw["attn_k_norm"])
            q, k = fl.ops.rope(q, cos, sin), fl.ops.rope(k, cos, sin)
        return q, k, v

    def _qkv_products(self, lw: dict[str, Any], h: Tensor, joined: tuple[str, str] | None,
                      linears: dict[str, _Linear] | None = None) -> dict[str, Tensor]:
        """The q, k and v products of the rows h (with `joined`, also "q+k": their columns as one slice where
        one product gave both), adapter terms and biases added; with `linears` (`_Projections.parts()`),
        each from its own weight, so each output is C-contiguous."""
        p = lw["qkv"](h, joined=joined) if linears is None else {n: linears[n](h) for n in ("q", "k", "v")}
        if self.adapter is not None:
            p = {n: self.project(lw, n, h, p[n]) for n in ("q", "k", "v")}
        if "bias" in lw:
            p = {n: y + fl.tensor(lw["bias"][n]) for n, y in p.items()}
        return p

    def row_qkv(self, i: int, lw: dict[str, Any], h: Tensor, tables: dict[str, tuple[Tensor, ...]],
                linears: dict[str, _Linear]) -> tuple[Tensor, Tensor, Tensor]:
        """Layer i's queries `[M, heads, D]`, keys and values `[M, kv_heads, D]` of M normed rows h `[M, hidden]`,
        each row at a position of its own (the serving step, `fuel.serve.batch_model`). Each projection is its
        own product (`linears`: the layer's `_Projections.parts()`) and rope runs over rows: `tables[name]` is
        (cos, sin) for q's rows `[M·heads, D]`, then for k's `[M·kv_heads, D]`, row r·heads + j holding row r's
        position. So every result is C-contiguous, what the cache writes and PagedAttn read, and each element
        is computed as `qkv` computes it."""
        cfg = self.cfg
        m, d = h.shape[0], cfg.head_dim
        p = self._qkv_products(lw, h, None, linears)
        q, k = p["q"].reshape(m * cfg.heads, d), p["k"].reshape(m * cfg.kv_heads, d)
        if cfg.spec.qk_norm:
            q, k = self._norm(q, lw["attn_q_norm"]), self._norm(k, lw["attn_k_norm"])
        q_cos, q_sin, k_cos, k_sin = tables[cfg.rope_name(i)]
        q, k = fl.ops.rope(q, q_cos, q_sin), fl.ops.rope(k, k_cos, k_sin)
        return q.reshape(m, cfg.heads, d), k.reshape(m, cfg.kv_heads, d), p["v"].reshape(m, cfg.kv_heads, d)

    def attention(self, i: int, q: Tensor, k: Tensor, v: Tensor, k_len: str | None = None) -> Tensor:
        """Layer i's causal attention `[B, heads, S, D]` of the queries over keys/values (a KV cache ending
        at DynScalar `k_len`, or the step's own): the config's scale, the layer's window, the logit softcap."""
        cfg = self.cfg
        return fl.ops.flash_attn(q, k, v, softmax_scale=cfg.attn_scale, causal=True,
                                 window_size=(cfg.window_left(i), None), softcap=cfg.attn_softcap,
                                 k_len=None if k_len is None else fl.dyn(k_len))

    def output_projection(self, lw: dict[str, Any], a: Tensor) -> Tensor:
        """The attention output `[B, heads, S, D]` as rows `[B·S, hidden]` through the o projection."""
        b, heads, s, d = a.shape
        rows = a.permute(0, 2, 1, 3).reshape(b * s, heads * d)
        return self.project(lw, "o", rows, lw["o"](rows))

    def after_attention(self, lw: dict[str, Any], x: Tensor, a: Tensor,
                        linears: dict[str, _Linear] | None = None) -> Tensor:
        """The rest of a layer: the residual x `[S, hidden]` plus the projected attention a, then the gated
        FFN and its residual (post-norms on both where the spec has them). With `linears` (the layer's
        `_Projections.parts()`), gate and up are each their own product, so each is C-contiguous."""
        spec = self.cfg.spec
        x = x + (self._norm(a, lw["post_attention_norm"]) if spec.post_norms else a)
        h = self._norm(x, lw["ffn_norm"])
        p = lw["gate_up"](h) if linears is None else {n: linears[n](h) for n in ("gate", "up")}
        gate, up = self.project(lw, "gate", h, p["gate"]), self.project(lw, "up", h, p["up"])
        act = (gelu_tanh(gate) if spec.activation == "gelu_tanh" else gate.silu()) * up
        d = self.project(lw, "down", act, lw["down"](act))
        return x + (self._norm(d, lw["post_ffw_norm"]) if spec.post_norms else d)

    def logits(self, x: Tensor) -> Tensor:
        """The logits `[S, vocab]` of the last layer's rows x (softcapped where the config has a final cap)."""
        y = self.head(self._norm(x, self.out_norm))
        cap = self.cfg.final_softcap
        return y if cap is None else (y / cap).tanh() * cap

    def scaled_input(self, x: Tensor) -> Tensor:
        """The embedding rows as the first layer reads them (Gemma scales them by √hidden)."""
        return x * float(np.float32(math.sqrt(self.cfg.hidden))) if self.cfg.spec.embed_scale else x
