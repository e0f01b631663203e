"""Tiny random transformers models of each architecture `fuel.io.hf` reads, saved as Hugging Face directories
(`save_pretrained`): the oracle side of the safetensors tests.

Every parameter is redrawn (projections N(0, 0.1²), Gemma's embeddings N(0, 0.03²) and Mamba's mixer
weights N(0, 0.3²), else greedy decoding repeats the last token; norm weights around their neutral value,
Mamba's A_log and dt bias kept in their valid ranges), so that a detail read wrong (a norm's +1, a
permutation, a rope factor) moves the logits far past the tolerance, and the logits spread widely enough
that greedy decoding has no near-ties. Each config sets what changes the math: Llama-3 rope scaling with
factors in all three bands, a Mistral window shorter than the test prompts, Qwen2's biases with tied
embeddings, Qwen3's head_dim unlike hidden/heads, Phi-3's LongRoPE, Gemma-2's window and softcaps small
enough to bite, query scales unlike 1/√head_dim.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

VOCAB = 512
WINDOW = 8
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)
# longrope: 8 factors (head_dim 16 / 2) in each band
LONGROPE = {"rope_type": "longrope", "long_factor": [1.0 + 0.5 * i for i in range(8)],
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "original_max_position_embeddings": 64}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"rope_scaling": LLAMA3}),
    "mistral": ("MistralConfig", {"sliding_window": WINDOW}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "phi3": ("Phi3Config", {"rope_scaling": LONGROPE, "original_max_position_embeddings": 64}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": WINDOW,
                                "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": WINDOW}),
    "mamba": ("MambaConfig", {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": VOCAB, "state_size": 8,
                              "pad_token_id": 0}),
}


def hf_model(arch: str, seed: int = 0) -> Any:
    """A random float32 transformers model of `arch` (a key of CONFIGS), in eval mode."""
    import transformers

    torch.manual_seed(seed)
    cls, extra = CONFIGS[arch]
    kwargs = extra if arch == "mamba" else {**SMALL, **extra}
    config = getattr(transformers, cls)(**kwargs)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gemma = arch.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand_like(p) * 4 + 0.5))
            elif name.endswith("dt_proj.bias"):
                p.copy_(torch.randn_like(p) * 0.5 - 2.0)
            elif p.ndim == 1 and "norm" in name:
                p.copy_(torch.randn_like(p) * 0.2 + (0.0 if gemma else 1.0))
            elif gemma and "embed_tokens" in name:
                # × √hidden on input: else each token's own row wins and greedy decoding repeats the last token
                p.copy_(torch.randn_like(p) * 0.03)
            elif "mixer." in name and not name.endswith("x_proj.weight"):
                # Mamba's mixer output must outweigh the tied embedding in the residual
                p.copy_(torch.randn_like(p) * 0.3)
            else:
                p.copy_(torch.randn_like(p) * 0.1)
    return model.eval()


def save_dir(model: Any, path: Path, dtype: torch.dtype = torch.float32, **save: Any) -> Path:
    """`model` saved at `path` (in `dtype`; `save`: save_pretrained's options, e.g. max_shard_size); the model
    itself is left as it was."""
    copy.deepcopy(model).to(dtype).save_pretrained(str(path), **save)
    return path
