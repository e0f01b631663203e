"""One table per architecture: how a Hugging Face checkpoint's tensor names map to llama.cpp's GGUF names.

A `Rule` maps one HF name pattern (`{i}` stands for a layer index) to one GGUF name, with the transform
llama.cpp's converter applies on the way (`Transform`) and whether the tensor may be absent. The loader
(`fuel.io.hf.HFModelDir`) runs the same code for every row of every table: a checkpoint tensor no rule
matches, or a rule's tensor the checkpoint lacks, is an error naming it.

Tables are keyed by `config.json`'s `model_type`; `Table.arch` is the GGUF `general.architecture` the
directory presents itself as (Mistral is "llama", Gemma 3's text model "gemma3").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

# What the converter does to a tensor's values:
# - "permute_q" / "permute_k": the rows of each head reordered for ggml's pair-rotating rope (llama files),
#   over the query heads / the key-value heads;
# - "plus_one": Gemma's norm weights, stored as 1 + w (float32);
# - "neg_exp": Mamba's A = -exp(A_log) (float32);
# - "squeeze": Mamba's conv1d weight [d_inner, 1, d_conv] -> [d_inner, d_conv].
Transform = Literal["", "permute_q", "permute_k", "plus_one", "neg_exp", "squeeze"]


@dataclass(frozen=True)
class Rule:
    """HF name pattern -> GGUF name (`{i}`: the layer). `shape`: the checkpoint tensor's dimensions by name
    (`SIZES`), checked against the config's. `projection`: a layer's 2-D projection or the output
    head, the weights `quantize="q8_0"` quantises. `tied`: absent when the embeddings are tied (and ignored
    then, as transformers ignores it)."""

    hf: str
    gguf: str
    shape: tuple[str, ...]
    transform: Transform = ""
    projection: bool = False
    tied: bool = False

    @property
    def layered(self) -> bool:
        return "{i}" in self.hf

    @property
    def regex(self) -> re.Pattern[str]:
        return re.compile(re.escape(self.hf).replace(r"\{i\}", r"(\d+)") + "$")


@dataclass(frozen=True)
class Table:
    """An architecture's names (`rules`), what it presents itself as (`arch`), the activations and rope
    types its decoder runs, and checkpoint tensors the converter drops (`ignore`: regexes)."""

    arch: str
    rules: tuple[Rule, ...]
    activations: tuple[str, ...] = ("silu",)
    rope_types: tuple[str, ...] = ("default",)
    tie_default: bool = False  # transformers' tie_word_embeddings default for the model type
    ignore: tuple[str, ...] = (r".*\.rotary_emb\.inv_freq$",)
    matchers: tuple[tuple[re.Pattern[str], Rule], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "matchers", tuple((r.regex, r) for r in self.rules))


# The dimensions a shape names, from the presented metadata (`fuel.io.hf` computes them): a decoder's hidden
# size, vocabulary, query rows (heads × head_dim), key/value rows, FFN size, head_dim; Mamba's inner size,
# conv kernel, dt rank and state size. "2ffn", "qkv", "2inner", "xbc" are the fused ones.
SIZES = ("hidden", "vocab", "q", "kv", "ffn", "head_dim", "2ffn", "qkv", "inner", "2inner", "conv", "rank",
         "state", "xbc")


def _p(name: str, gguf: str, shape: tuple[str, ...], transform: Transform = "") -> Rule:
    """A layer's 2-D projection."""
    return Rule(f"model.layers.{{i}}.{name}", f"blk.{{i}}.{gguf}", shape, transform, projection=True)


def _n(name: str, gguf: str, size: str = "hidden", transform: Transform = "") -> Rule:
    """A layer's vector (norm weight, bias)."""
    return Rule(f"model.layers.{{i}}.{name}", f"blk.{{i}}.{gguf}", (size,), transform)


def _top(norm: Transform = "") -> tuple[Rule, ...]:
    return (Rule("model.embed_tokens.weight", "token_embd.weight", ("vocab", "hidden")),
            Rule("model.norm.weight", "output_norm.weight", ("hidden",), norm),
            Rule("lm_head.weight", "output.weight", ("vocab", "hidden"), projection=True, tied=True))


_ATTN = (_p("self_attn.q_proj.weight", "attn_q.weight", ("q", "hidden")),
         _p("self_attn.k_proj.weight", "attn_k.weight", ("kv", "hidden")),
         _p("self_attn.v_proj.weight", "attn_v.weight", ("kv", "hidden")),
         _p("self_attn.o_proj.weight", "attn_output.weight", ("hidden", "q")))
_MLP = (_p("mlp.gate_proj.weight", "ffn_gate.weight", ("ffn", "hidden")),
        _p("mlp.up_proj.weight", "ffn_up.weight", ("ffn", "hidden")),
        _p("mlp.down_proj.weight", "ffn_down.weight", ("hidden", "ffn")))
_NORMS = (_n("input_layernorm.weight", "attn_norm.weight"), _n("post_attention_layernorm.weight", "ffn_norm.weight"))
_QK_NORMS = (_n("self_attn.q_norm.weight", "attn_q_norm.weight", "head_dim"),
             _n("self_attn.k_norm.weight", "attn_k_norm.weight", "head_dim"))

_LLAMA = Table("llama", (
    *_top(), *_NORMS,
    _p("self_attn.q_proj.weight", "attn_q.weight", ("q", "hidden"), "permute_q"),
    _p("self_attn.k_proj.weight", "attn_k.weight", ("kv", "hidden"), "permute_k"),
    *_ATTN[2:], *_MLP), rope_types=("default", "linear", "llama3"))

_GEMMA_NORMS = (_n("input_layernorm.weight", "attn_norm.weight", transform="plus_one"),
                _n("post_attention_layernorm.weight", "post_attention_norm.weight", transform="plus_one"),
                _n("pre_feedforward_layernorm.weight", "ffn_norm.weight", transform="plus_one"),
                _n("post_feedforward_layernorm.weight", "post_ffw_norm.weight", transform="plus_one"))
_GELU = ("gelu_pytorch_tanh", "gelu_tanh")

TABLES: dict[str, Table] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": Table("qwen2", (*_top(), *_NORMS, *_ATTN, *_MLP, _n("self_attn.q_proj.bias", "attn_q.bias", "q"),
                             _n("self_attn.k_proj.bias", "attn_k.bias", "kv"),
                             _n("self_attn.v_proj.bias", "attn_v.bias", "kv"))),
    "qwen3": Table("qwen3", (*_top(), *_NORMS, *_ATTN, *_MLP, *_QK_NORMS)),
    "phi3": Table("phi3", (*_top(), *_NORMS,
                           _p("self_attn.qkv_proj.weight", "attn_qkv.weight", ("qkv", "hidden")),
                           _ATTN[3],
                           _p("mlp.gate_up_proj.weight", "ffn_up.weight", ("2ffn", "hidden")),  # gate rows, then up
                           _MLP[2]), rope_types=("default", "longrope")),
    "gemma2": Table("gemma2", (*_top("plus_one"), *_GEMMA_NORMS, *_ATTN, *_MLP), activations=_GELU,
                    tie_default=True),
    "gemma3_text": Table("gemma3", (*_top("plus_one"), *_GEMMA_NORMS, *_ATTN, *_MLP,
                                    _n("self_attn.q_norm.weight", "attn_q_norm.weight", "head_dim", "plus_one"),
                                    _n("self_attn.k_norm.weight", "attn_k_norm.weight", "head_dim", "plus_one")),
                         activations=_GELU, rope_types=("default", "linear"), tie_default=True),
    "mamba": Table("mamba", (
        Rule("backbone.embeddings.weight", "token_embd.weight", ("vocab", "hidden")),
        Rule("backbone.norm_f.weight", "output_norm.weight", ("hidden",)),
        Rule("lm_head.weight", "output.weight", ("vocab", "hidden"), projection=True, tied=True),
        Rule("backbone.layers.{i}.norm.weight", "blk.{i}.attn_norm.weight", ("hidden",)),
        Rule("backbone.layers.{i}.mixer.in_proj.weight", "blk.{i}.ssm_in.weight", ("2inner", "hidden"),
             projection=True),
        Rule("backbone.layers.{i}.mixer.conv1d.weight", "blk.{i}.ssm_conv1d.weight", ("inner", "conv"), "squeeze"),
        Rule("backbone.layers.{i}.mixer.conv1d.bias", "blk.{i}.ssm_conv1d.bias", ("inner",)),
        Rule("backbone.layers.{i}.mixer.x_proj.weight", "blk.{i}.ssm_x.weight", ("xbc", "inner")),
        Rule("backbone.layers.{i}.mixer.dt_proj.weight", "blk.{i}.ssm_dt.weight", ("inner", "rank")),
        Rule("backbone.layers.{i}.mixer.dt_proj.bias", "blk.{i}.ssm_dt.bias", ("inner",)),
        Rule("backbone.layers.{i}.mixer.A_log", "blk.{i}.ssm_a", ("inner", "state"), "neg_exp"),
        Rule("backbone.layers.{i}.mixer.D", "blk.{i}.ssm_d", ("inner",)),
        Rule("backbone.layers.{i}.mixer.out_proj.weight", "blk.{i}.ssm_out.weight", ("hidden", "inner"),
             projection=True),
    ), tie_default=True),
}


def match(table: Table, name: str) -> tuple[Rule, int | None] | None:
    """The rule of `table` that checkpoint tensor `name` falls under, and its layer (None for a
    non-layer tensor); None when no rule matches."""
    for regex, rule in table.matchers:
        m = regex.match(name)
        if m:
            return rule, int(m.group(1)) if rule.layered else None
    return None


def ignored(table: Table, name: str) -> bool:
    return any(re.match(p, name) for p in table.ignore)
