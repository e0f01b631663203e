"""A Hugging Face `config.json` as the GGUF metadata llama.cpp's converter writes for the same model, plus the
tensors the converter synthesises from it (`rope_freqs.weight`, `rope_factors_long/short.weight`).

Both config formats are read: transformers 5's `rope_parameters` (for Gemma 3, one dict per layer type) and
the older `rope_theta` / `rope_scaling` / `rope_local_base_freq` most published checkpoints carry. A value
the decoder would not honour (a rope type it lacks, sliding layers where its architecture has none, a
softcap it would not apply) is refused here, naming the key and the value: never a silently different model.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from fuel.errors import FuelError
from fuel.io.hf_names import Table

GEMMA3_GLOBAL_EVERY = 6   # Gemma 3's decoder: every sixth layer is global
MAMBA_CONTEXT = 1 << 20   # the converter's context length for a Mamba file (a state model has no limit)


class HFError(FuelError, ValueError):
    """A Hugging Face model directory that cannot be presented as a GGUF model: a missing or malformed file,
    a missing or unexpected tensor, or a configuration the decoder does not support."""


class Config:
    """`config.json`'s dict, with lookups that name the file in their errors."""

    def __init__(self, path: Path, values: dict[str, Any]) -> None:
        self.path, self.values = path, values

    def get(self, *keys: str, default: Any = None) -> Any:
        """The first of `keys` the config sets to a non-null value, else `default`."""
        for k in keys:
            if self.values.get(k) is not None:
                return self.values[k]
        return default

    def need(self, *keys: str, kind: type = int) -> Any:
        value = self.get(*keys)
        if value is None:
            raise HFError(f"hf: {self.path} has no {keys[0]!r}")
        if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and value != int(value)) \
                or value <= 0:
            raise HFError(f"hf: {self.path}: {keys[0]} must be a positive {kind.__name__}, got {value!r}")
        return kind(value)

    def refuse(self, key: str, value: Any, why: str) -> HFError:
        return HFError(f"hf: {self.path}: {key} = {value!r} is not supported: {why}")


def _rope(cfg: Config, table: Table) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the global layers' rope parameters with their `rope_theta`, the window layers' own or None)."""
    default_theta = 1_000_000.0 if table.arch == "gemma3" else 10_000.0
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:        # transformers 5, per layer type
        full, local = dict(params["full_attention"]), params.get("sliding_attention")
        return full, None if local is None else dict(local)
    if isinstance(params, dict):
        full = dict(params)
    else:
        full = dict(cfg.get("rope_scaling", default={}))
        full.setdefault("rope_theta", cfg.get("rope_theta", default=default_theta))
    for key in ("partial_rotary_factor", "original_max_position_embeddings"):
        if key not in full and cfg.get(key) is not None:
            full[key] = cfg.get(key)
    full.setdefault("rope_theta", default_theta)
    local = None
    if table.arch == "gemma3":
        local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", default=10_000.0)}
    return full, local


def _rope_type(p: dict[str, Any]) -> str:
    kind = str(p.get("rope_type") or p.get("type") or "default")
    return "longrope" if kind == "su" else kind


def llama3_factors(p: dict[str, Any], head_dim: int) -> np.ndarray:
    """Llama 3's per-frequency divisors `[head_dim/2]`, as llama.cpp's converter computes `rope_freqs`:
    1 for short wavelengths, `factor` for long ones, a smooth blend between."""
    base = float(p["rope_theta"])
    factor = float(p.get("factor", 8.0))
    low, high = float(p.get("low_freq_factor", 1.0)), float(p.get("high_freq_factor", 4.0))
    old = float(p.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, blended))
    return out.astype(np.float32)


def _layer_kinds(cfg: Config, table: Table, layers: int, window: int | None) -> list[str]:
    """Which layers the decoder runs over the sliding window, as transformers' `layer_types` names them."""
    if window is None:
        local = [False] * layers
    elif table.arch == "gemma2":
        local = [i % 2 == 0 for i in range(layers)]
    elif table.arch == "gemma3":
        local = [(i + 1) % GEMMA3_GLOBAL_EVERY != 0 for i in range(layers)]
    else:
        local = [table.arch in ("llama", "phi3")] * layers
    return ["sliding_attention" if x else "full_attention" for x in local]


def decoder_metadata(cfg: Config, table: Table) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The GGUF metadata of a decoder's config and the rope tensors synthesised from it."""
    a = table.arch
    hidden, heads = cfg.need("hidden_size"), cfg.need("num_attention_heads")
    layers = cfg.need("num_hidden_layers")
    head_dim = cfg.get("head_dim") or hidden // heads
    if head_dim % 2:
        raise cfg.refuse("head_dim", head_dim, "rope rotates pairs of a head's dimensions: it must be even")
    act = cfg.get("hidden_activation", "hidden_act", default="silu")
    if act not in table.activations:
        raise cfg.refuse("hidden_act", act, f"{a} runs {', '.join(table.activations)}")
    md: dict[str, Any] = {
        "general.architecture": a, "general.name": cfg.path.parent.name,
        f"{a}.block_count": layers, f"{a}.context_length": cfg.need("max_position_embeddings"),
        f"{a}.embedding_length": hidden, f"{a}.feed_forward_length": cfg.need("intermediate_size"),
        f"{a}.attention.head_count": heads,
        f"{a}.attention.head_count_kv": cfg.need("num_key_value_heads") if cfg.get("num_key_value_heads") else heads,
        f"{a}.attention.layer_norm_rms_epsilon": cfg.need("rms_norm_eps", kind=float),
        f"{a}.attention.key_length": int(head_dim), f"{a}.attention.value_length": int(head_dim),
        f"{a}.vocab_size": cfg.need("vocab_size"),
    }
    tensors: dict[str, np.ndarray] = {}
    full, local = _rope(cfg, table)
    md[f"{a}.rope.freq_base"] = float(full["rope_theta"])
    md[f"{a}.rope.dimension_count"] = int(head_dim * float(full.get("partial_rotary_factor", 1.0)))
    kind = _rope_type(full)
    if kind not in table.rope_types:
        raise cfg.refuse("rope type", kind, f"{a} supports {', '.join(table.rope_types)}")
    if kind == "linear":
        md[f"{a}.rope.scaling.type"] = "linear"
        md[f"{a}.rope.scaling.factor"] = float(full["factor"])
    elif kind == "llama3":
        tensors["rope_freqs.weight"] = llama3_factors(full, int(head_dim))
    elif kind == "longrope":
        orig = int(full.get("original_max_position_embeddings") or md[f"{a}.context_length"])
        factor = full.get("factor") or md[f"{a}.context_length"] / orig
        attn = full.get("attention_factor")
        if attn is None:
            attn = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1 else 1.0
        md[f"{a}.rope.scaling.original_context_length"] = orig
        md[f"{a}.rope.scaling.attn_factor"] = float(attn)
        for which in ("long", "short"):
            f = np.asarray(full[f"{which}_factor"], np.float32)
            if f.shape != (md[f"{a}.rope.dimension_count"] // 2,):
                raise cfg.refuse(f"rope {which}_factor", f"{f.size} values",
                                 f"LongRoPE needs rope dimension / 2 = {md[f'{a}.rope.dimension_count'] // 2}")
            tensors[f"rope_factors_{which}.weight"] = f
    if local is not None:
        if _rope_type(local) != "default":
            raise cfg.refuse("sliding_attention rope type", _rope_type(local), "the window layers' rope is plain")
        md[f"{a}.rope.freq_base_swa"] = float(local["rope_theta"])

    window = cfg.get("sliding_window")
    if a in ("qwen2", "qwen3") or (a == "llama" and cfg.get("model_type") != "mistral"):
        window = None  # transformers reads no window for these unless layer_types say so (checked below)
    if window is not None:
        md[f"{a}.attention.sliding_window"] = int(window)
    kinds = _layer_kinds(cfg, table, layers, window)
    given = cfg.get("layer_types")
    if given is None and a in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        first = int(cfg.get("max_window_layers", default=0))
        given = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if a == "gemma3" and cfg.get("sliding_window_pattern", "_sliding_window_pattern") not in (None, 6):
        raise cfg.refuse("sliding_window_pattern", cfg.get("sliding_window_pattern", "_sliding_window_pattern"),
                         f"gemma3 runs every {GEMMA3_GLOBAL_EVERY}th layer global")
    if given is not None and list(given) != kinds:
        raise cfg.refuse("layer_types", list(given), f"{a} runs {kinds}")

    if a in ("gemma2", "gemma3"):
        md[f"{a}.attention.scale"] = float(cfg.need("query_pre_attn_scalar", kind=float)) ** -0.5
    caps = cfg.get("attn_logit_softcapping"), cfg.get("final_logit_softcapping")
    if a == "gemma2":
        if None in caps:
            raise cfg.refuse("attn_logit_softcapping, final_logit_softcapping", caps, "gemma2 applies both")
        md[f"{a}.attn_logit_softcapping"], md[f"{a}.final_logit_softcapping"] = map(float, caps)
    elif caps != (None, None):
        raise cfg.refuse("attn_logit_softcapping, final_logit_softcapping", caps, f"{a} applies no softcap")
    return md, tensors


def mamba_metadata(cfg: Config, table: Table) -> dict[str, Any]:
    """The GGUF metadata of a Mamba-1 config, as the converter writes it."""
    hidden = cfg.need("hidden_size", "d_model")
    rank = cfg.get("time_step_rank", "dt_rank")
    if rank in (None, "auto"):
        rank = -(-hidden // 16)
    return {
        "general.architecture": "mamba", "general.name": cfg.path.parent.name,
        "mamba.context_length": MAMBA_CONTEXT, "mamba.embedding_length": hidden,
        "mamba.feed_forward_length": 0, "mamba.attention.head_count": 0,
        "mamba.block_count": cfg.need("num_hidden_layers", "n_layer"),
        "mamba.ssm.conv_kernel": int(cfg.get("conv_kernel", "d_conv", default=4)),
        "mamba.ssm.inner_size": int(cfg.get("intermediate_size", "d_inner", default=2 * hidden)),
        "mamba.ssm.state_size": int(cfg.get("state_size", "d_state", default=16)),
        "mamba.ssm.time_step_rank": int(rank),
        "mamba.attention.layer_norm_rms_epsilon": float(cfg.get("layer_norm_epsilon", "rms_norm_eps",
                                                                default=1e-5)),
        "mamba.ssm.dt_b_c_rms": False,
        "mamba.vocab_size": cfg.need("vocab_size"),
    }
