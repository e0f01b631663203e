"""`fuel models`: the packaged models and the architectures Fuel runs, read from the tables that define them
(`fuel.models.generate.MODELS`, `fuel.models.architectures.ARCHITECTURES`, `generate.MODEL_CLASSES`), so the
listing cannot drift from what loading accepts.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from fuel.models.architectures import ARCHITECTURES, ArchSpec
from fuel.models.generate import MODEL_CLASSES, MODELS

# What each ArchSpec field means for a user, in the order the listing names them.
_FEATURES: tuple[tuple[str, str], ...] = (
    ("qkv_bias", "q/k/v biases"), ("qk_norm", "q/k RMS norms per head"), ("post_norms", "pre- and post-norms"),
    ("fused_qkv", "fused QKV"), ("fused_gate_up", "fused gate+up"), ("embed_scale", "embeddings x sqrt(hidden)"),
    ("softcaps", "attention and final logit softcaps"))
_WINDOWS = {"all": "sliding window (all layers) when the file sets one", "even": "sliding window on even layers",
            "gemma3": "sliding window on 5 of every 6 layers"}
_FACTORS = {"freqs": "Llama-3 rope factors (rope_freqs)", "longrope": "LongRoPE factors"}
# the model families each GGUF architecture name covers
_FAMILIES = {"llama": "Llama 1-3.x, Mistral", "qwen2": "Qwen2, Qwen2.5", "qwen3": "Qwen3", "phi3": "Phi-3, Phi-3.5",
             "gemma2": "Gemma 2", "gemma3": "Gemma 3 (text)", "mamba": "Mamba (v1)"}
# the architectures that are not Llama-family decoders, with what their model runs
_OTHERS = {"mamba": "Mamba-1: CausalConv1d + SelectiveScan, recurrent decode carrying the conv and SSM states "
                    "(not served: fuel serve batches over a paged KV cache)"}


def spec_features(spec: ArchSpec) -> list[str]:
    """What the architecture's decoder layer does beyond the Llama recipe, in words."""
    out = [words for field, words in _FEATURES if getattr(spec, field)]
    out.append("GELU (tanh) gated FFN" if spec.activation == "gelu_tanh" else "SwiGLU FFN")
    if spec.window_layers in _WINDOWS:
        out.append(_WINDOWS[spec.window_layers])
    if spec.rope_factors in _FACTORS:
        out.append(_FACTORS[spec.rope_factors])
    scaling = [s for s in spec.rope_scaling if s != "none"]
    if scaling:
        out.append(f"rope scaling {', '.join(scaling)}")
    return out


def catalog() -> dict[str, Any]:
    """The packaged models and every supported architecture with its features."""
    archs = {name: {"family": _FAMILIES.get(name, name), "features": spec_features(spec)}
             for name, spec in ARCHITECTURES.items()}
    archs.update({name: {"family": _FAMILIES.get(name, name), "features": [_OTHERS[name]]} for name in MODEL_CLASSES})
    return {"packaged": dict(MODELS), "architectures": archs,
            "sources": ["a .gguf file (every block type QMatMul reads)",
                        "a Hugging Face directory: config.json, *.safetensors (sharded through the index), "
                        "tokenizer.json; f32, bf16 or f16, --quantize q8_0 on load"]}


def run_models(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    found = catalog()
    if args.json:
        out.write(json.dumps(found, indent=2) + "\n")
        return 0
    out.write("Packaged models (fuel generate --model NAME):\n")
    for name, title in found["packaged"].items():
        out.write(f"  {name:<10} {title}\n")
    out.write("\nArchitectures (fuel generate --model PATH.gguf or a model directory):\n")
    for name, arch in found["architectures"].items():
        out.write(f"  {name:<8} {arch['family']}: {'; '.join(arch['features'])}\n")
    out.write("\nSources:\n" + "".join(f"  {s}\n" for s in found["sources"]))
    return 0
