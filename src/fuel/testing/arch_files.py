"""Tiny random decoder models of each GGUF architecture, written as llama.cpp's converter writes a real one,
for the transformers oracle tests (tests/models/test_arch_oracle.py).

A model is an `ArchFile`: its GGUF architecture, its sizes and the Hugging Face config values it stands for
(`hf_config`: rope scaling, softcaps, query scale, sliding window). `write_arch_gguf` draws the weights in
Hugging Face's meaning (a norm weight as HF multiplies by it, Q/K rows in HF's half-split rope layout) and
converts them as the converter does: Q/K rows permuted inside each head for `llama` files only, Gemma norm
weights stored with the +1 its modules add, Llama-3 rope scaling written as the per-frequency factors tensor
`rope_freqs.weight`, Phi-3 LongRoPE as `rope_factors_long/short.weight` and `rope.scaling.*` metadata.
Tensors come from one table, `TENSORS`, filtered by each model's features.

Block types: "F32"; "Q8_0" (gguf-py quantises every 2-D weight whose rows are whole blocks); "Q4_K"
(random valid blocks, as the QMatMul tests build them, since gguf-py has no K-quant writer; the token table
and head in Q6_K, as in llama.cpp's Q4_K_M; rows need k a multiple of 256, so a weight with other rows is
written in Q8_0, as llama.cpp falls back). Norms, biases and rope factors stay F32.

The tokenizer is SmolLM2's: its bundled GGUF vocabulary cut to the first `VOCAB` tokens and the merges that
build them (its ids follow merge order, so the cut is a valid BPE tokenizer), and its chat template.

`flip` writes the file wrong in one detail (`FLIPS`), for the tests that show the oracle notices.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from fuel.errors import ParamError
from fuel.quant import QuantType
from fuel.testing.gguf_files import finish
from fuel.testing.reference.qmatmul import random_weight

VOCAB = 4096
QTYPES = ("F32", "Q8_0", "Q4_K")
# one wrong detail each: the file as a decoder that got the detail wrong would read the right one
FLIPS = ("qk_unpermuted", "no_rope_freqs", "no_window", "no_bias", "qk_norm_ones", "gate_up_swapped",
         "norm_no_plus_one", "no_longrope", "tied_head")


@dataclass(frozen=True)
class ArchFile:
    """One tiny model. `hf_type` is the transformers model type of the oracle (mistral: a llama file with a
    window, loaded by transformers as llama and moved into MistralForCausalLM)."""

    name: str
    arch: str
    hf_type: str
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    ff: int = 512
    layers: int = 2
    context: int = 256
    rope_base: float = 10_000.0
    tied: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    fused: bool = False  # phi3: attn_qkv = q|k|v rows, ffn_up = gate|up rows
    gemma: bool = False  # norms stored +1, post-attention and post-FFN norms, √hidden embedding scale
    hf_config: dict[str, Any] = field(default_factory=dict)

    @property
    def window(self) -> int | None:
        w = self.hf_config.get("sliding_window")
        return None if w is None else int(w)

    @property
    def rope(self) -> dict[str, Any]:
        return dict(self.hf_config.get("rope_parameters", {}))


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
_rng_factors = np.random.default_rng(45)
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 32,
            "short_factor": [round(float(x), 4) for x in 1 + _rng_factors.uniform(0, 0.5, 16)],
            "long_factor": [round(float(x), 4) for x in 1 + _rng_factors.uniform(1, 12, 16)]}

ARCH_FILES: dict[str, ArchFile] = {a.name: a for a in (
    ArchFile("llama3", "llama", "llama", rope_base=500_000.0, tied=False,
             hf_config={"rope_parameters": LLAMA3_ROPE}),
    ArchFile("mistral", "llama", "mistral", heads=8, head_dim=32, tied=False, hf_config={"sliding_window": 16}),
    ArchFile("qwen2", "qwen2", "qwen2", qkv_bias=True, rope_base=1_000_000.0),
    ArchFile("qwen2_untied", "qwen2", "qwen2", qkv_bias=True, tied=False),
    ArchFile("qwen3", "qwen3", "qwen3", heads=4, head_dim=32, qk_norm=True, tied=True,
             hf_config={"head_dim": 32}),
    ArchFile("phi3", "phi3", "phi3", heads=8, kv_heads=8, head_dim=32, fused=True, tied=False),
    ArchFile("phi3_longrope", "phi3", "phi3", heads=8, kv_heads=8, head_dim=32, fused=True, tied=False,
             context=128, hf_config={"rope_parameters": LONGROPE}),
    ArchFile("gemma2", "gemma2", "gemma2", heads=8, kv_heads=4, head_dim=32, gemma=True,
             hf_config={"sliding_window": 16, "attn_logit_softcapping": 4.0, "final_logit_softcapping": 15.0,
                        "query_pre_attn_scalar": 48, "head_dim": 32}),
)}

Shape = Callable[[ArchFile], tuple[int, ...]]
Feature = Callable[[ArchFile], bool]
_always: Feature = lambda a: True  # noqa: E731


def _q(a: ArchFile) -> int:
    return a.heads * a.head_dim


def _kv(a: ArchFile) -> int:
    return a.kv_heads * a.head_dim


# (GGUF name, shape, present when, kind): kind "w" a projection, "norm" a norm weight, "bias", "embd".
# A "blk." name is per layer ({i} the layer).
TENSORS: tuple[tuple[str, Shape, Feature, str], ...] = (
    ("token_embd.weight", lambda a: (VOCAB, a.hidden), _always, "embd"),
    ("output_norm.weight", lambda a: (a.hidden,), _always, "norm"),
    ("output.weight", lambda a: (VOCAB, a.hidden), lambda a: not a.tied, "embd"),
    ("blk.{i}.attn_norm.weight", lambda a: (a.hidden,), _always, "norm"),
    ("blk.{i}.attn_q.weight", lambda a: (_q(a), a.hidden), lambda a: not a.fused, "w"),
    ("blk.{i}.attn_k.weight", lambda a: (_kv(a), a.hidden), lambda a: not a.fused, "w"),
    ("blk.{i}.attn_v.weight", lambda a: (_kv(a), a.hidden), lambda a: not a.fused, "w"),
    ("blk.{i}.attn_qkv.weight", lambda a: (_q(a) + 2 * _kv(a), a.hidden), lambda a: a.fused, "w"),
    ("blk.{i}.attn_q.bias", lambda a: (_q(a),), lambda a: a.qkv_bias, "bias"),
    ("blk.{i}.attn_k.bias", lambda a: (_kv(a),), lambda a: a.qkv_bias, "bias"),
    ("blk.{i}.attn_v.bias", lambda a: (_kv(a),), lambda a: a.qkv_bias, "bias"),
    ("blk.{i}.attn_q_norm.weight", lambda a: (a.head_dim,), lambda a: a.qk_norm, "norm"),
    ("blk.{i}.attn_k_norm.weight", lambda a: (a.head_dim,), lambda a: a.qk_norm, "norm"),
    ("blk.{i}.attn_output.weight", lambda a: (a.hidden, _q(a)), _always, "w"),
    ("blk.{i}.post_attention_norm.weight", lambda a: (a.hidden,), lambda a: a.gemma, "norm"),
    ("blk.{i}.ffn_norm.weight", lambda a: (a.hidden,), _always, "norm"),
    ("blk.{i}.ffn_gate.weight", lambda a: (a.ff, a.hidden), lambda a: not a.fused, "w"),
    ("blk.{i}.ffn_up.weight", lambda a: (2 * a.ff if a.fused else a.ff, a.hidden), _always, "w"),
    ("blk.{i}.ffn_down.weight", lambda a: (a.hidden, a.ff), _always, "w"),
    ("blk.{i}.post_ffw_norm.weight", lambda a: (a.hidden,), lambda a: a.gemma, "norm"),
)

# standard deviation of each kind's values in HF's meaning (a norm: 1 + this, the model's scale near 1;
# projections: this / √k, keeping activations O(1); embeddings: logits of a few units, so greedy picks are
# clear of f32 rounding and Gemma's final softcap bites)
_STD = {"norm": 0.2, "bias": 0.5, "w": 1.0, "embd": 0.3}


def llama3_rope_factors(rope: dict[str, Any], base: float, head_dim: int) -> np.ndarray:
    """`rope_freqs.weight` as llama.cpp's converter derives it from a Llama-3 `rope_scaling`: the divisor of
    each inverse frequency (1 for short wavelengths, `factor` for long ones, interpolated in between)."""
    inv = base ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    orig, factor = rope["original_max_position_embeddings"], rope["factor"]
    low, high = orig / rope["low_freq_factor"], orig / rope["high_freq_factor"]
    smooth = (orig / wavelen - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < high, 1.0, np.where(wavelen > low, factor, mid)).astype(np.float32)


def _permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's rope layout (each head's rows: first halves, then second halves of the rotated pairs) to the
    converter's (pairs adjacent): row (h, j, i) -> (h, i, j)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(a: ArchFile, seed: int = 0) -> dict[str, np.ndarray]:
    """The model's float32 weights in HF's meaning, under their GGUF names."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for i in range(a.layers):
        for name, shape, present, kind in TENSORS:
            if not present(a) or (i > 0 and "{i}" not in name):
                continue
            s = shape(a)
            x = rng.standard_normal(s) * _STD[kind]
            if kind == "w":
                x /= math.sqrt(s[-1])
            elif kind == "norm" and not a.gemma:
                x += 1.0  # Gemma's modules multiply by 1 + w; the others by w
            out[name.format(i=i)] = x.astype(np.float32)
    return out


@functools.cache
def _smollm2_tokenizer() -> dict[str, Any]:
    from fuel.io.gguf import bundled_gguf, open_gguf

    md = open_gguf(bundled_gguf("smollm2")).metadata
    tokens = list(md["tokenizer.ggml.tokens"][:VOCAB])
    vocab = set(tokens)
    merges = [m for m in md["tokenizer.ggml.merges"]
              if (parts := m.split(" "))[0] in vocab and parts[1] in vocab and "".join(parts) in vocab]
    return {"tokens": tokens, "types": [int(t) for t in md["tokenizer.ggml.token_type"][:VOCAB]],
            "merges": merges, "template": md["tokenizer.chat_template"]}


def add_smollm2_tokenizer(w: gguf.GGUFWriter) -> None:
    """The first VOCAB tokens of SmolLM2's tokenizer, its merges among them and its chat template, as the
    writer's `tokenizer.*` metadata."""
    tok = _smollm2_tokenizer()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(tok["template"])


def _to_gguf(a: ArchFile, w: dict[str, np.ndarray], flip: str | None) -> dict[str, np.ndarray]:
    """The converter's transforms of HF weights (module doc), one of them undone or changed by `flip`."""
    out = dict(w)
    for name, x in w.items():
        if a.arch == "llama" and flip != "qk_unpermuted" and name.endswith(("attn_q.weight", "attn_k.weight")):
            out[name] = _permute_qk(x, a.heads if "attn_q" in name else a.kv_heads)
        if a.gemma and name.endswith("norm.weight") and flip != "norm_no_plus_one":
            out[name] = x + np.float32(1.0)
        if flip == "no_bias" and name.endswith(".bias"):
            out[name] = np.zeros_like(x)
        if flip == "qk_norm_ones" and name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
            out[name] = np.ones_like(x)
        if flip == "tied_head" and name == "output.weight":
            del out[name]
        if flip == "gate_up_swapped" and name.endswith("ffn_up.weight") and a.fused:
            out[name] = np.concatenate([x[a.ff:], x[:a.ff]])
    rope = a.rope
    if rope.get("rope_type") == "llama3" and flip != "no_rope_freqs":
        out["rope_freqs.weight"] = llama3_rope_factors(rope, a.rope_base, a.head_dim)
    if rope.get("rope_type") == "longrope" and flip != "no_longrope":
        out["rope_factors_long.weight"] = np.asarray(rope["long_factor"], np.float32)
        out["rope_factors_short.weight"] = np.asarray(rope["short_factor"], np.float32)
    return out


# the token table and the head: Q6_K in a Q4_K file, as llama.cpp's Q4_K_M writes the head. A random Q4_K
# block is mostly a constant per 32 values (its sub-block offsets), which as a head makes the same few tokens
# win whatever the prompt (Gemma-2's capped logits tie at the cap); Q6_K's centred codes behave as a weight.
_TABLES = ("token_embd.weight", "output.weight")


def _write_tensor(wr: gguf.GGUFWriter, name: str, x: np.ndarray, qtype: str, rng: np.random.Generator) -> None:
    if x.ndim != 2 or qtype == "F32" or name.startswith("rope_"):
        wr.add_tensor(name, x)
        return
    n, k = x.shape
    if qtype == "Q4_K" and k % 256 == 0:
        # random blocks scaled to the float weight's spread (values of scale 1: Q4_K about 16 std, Q6_K 70)
        qt = QuantType.Q6K if name in _TABLES else QuantType.Q4K
        raw = random_weight(rng, qt, n, k, scale=float(x.std()) / (70.0 if qt is QuantType.Q6K else 16.0))
        wr.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[qt.ggml_name])
    elif k % 32 == 0:
        wr.add_tensor(name, gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
        wr.add_tensor(name, x)


def write_arch_gguf(path: Path, name: str, qtype: str = "F32", *, flip: str | None = None, seed: int = 0) -> Path:
    """Write the tiny model `ARCH_FILES[name]` at `path` in block type `qtype` (module doc)."""
    if name not in ARCH_FILES:
        raise ParamError(f"write_arch_gguf: unknown model {name!r}, expected one of {sorted(ARCH_FILES)}")
    if qtype not in QTYPES:
        raise ParamError(f"write_arch_gguf: qtype must be one of {QTYPES}, got {qtype!r}")
    if flip is not None and flip not in FLIPS:
        raise ParamError(f"write_arch_gguf: flip must be one of {FLIPS}, got {flip!r}")
    a = ARCH_FILES[name]
    tensors = _to_gguf(a, hf_weights(a, seed), flip)
    wr = gguf.GGUFWriter(str(path), a.arch)
    wr.add_name(f"tiny-{a.name}")
    wr.add_context_length(a.context)
    wr.add_embedding_length(a.hidden)
    wr.add_block_count(a.layers)
    wr.add_feed_forward_length(a.ff)
    wr.add_head_count(a.heads)
    wr.add_head_count_kv(a.kv_heads)
    wr.add_layer_norm_rms_eps(1e-6)
    wr.add_rope_freq_base(a.rope_base)
    wr.add_vocab_size(VOCAB)
    if a.head_dim != a.hidden // a.heads or a.gemma:
        wr.add_key_length(a.head_dim)
        wr.add_value_length(a.head_dim)
    if a.arch == "llama":
        wr.add_rope_dimension_count(a.head_dim)
    if a.window is not None and flip != "no_window":
        wr.add_sliding_window(a.window)
    cfg = a.hf_config
    if a.gemma:
        wr.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        wr.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        wr.add_attention_scale(cfg["query_pre_attn_scalar"] ** -0.5)
    rope = a.rope
    if rope.get("rope_type") == "longrope" and flip != "no_longrope":
        orig = rope["original_max_position_embeddings"]
        wr.add_rope_scaling_orig_ctx_len(orig)
        wr.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(a.context / orig) / math.log(orig)))
    add_smollm2_tokenizer(wr)
    rng = np.random.default_rng(seed + 1)
    for tname, x in tensors.items():
        _write_tensor(wr, tname, x, qtype, rng)
    finish(wr)
    return path
