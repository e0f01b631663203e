"""Each architecture from a Hugging Face directory (`fuel.io.hf.open_source`) on `LlamaModel`, against the
transformers model that saved the directory: last-position logits within 1e-4 of the row's largest, and 32
greedy tokens equal. The prompt is longer than the sliding window where the architecture has one, and the
generation runs past it. One architecture is read from shards, one from bfloat16 weights (the oracle is the
float32 model holding the same bfloat16 values), one quantised to Q8_0 on load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from fuel.io.hf import open_source
from fuel.models.llama import LlamaModel
from tests.models.arch_oracle import fuel_greedy
from tests.models.hf_dirs import VOCAB, WINDOW, hf_model, save_dir
from tests.models.oracles import hf_greedy

STEPS = 32
CAPACITY = 64   # below Phi-3's original context (64): the short LongRoPE factors, as transformers picks them
PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, VOCAB, size=WINDOW + 5)]
DECODERS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
SEEDS = {"gemma2": 1}  # seeds whose greedy continuation is not one token repeated


def _check(model: Any, path: Path, rtol: float = 1e-4, quantize: str | None = None) -> None:
    src = open_source(path, quantize=quantize)
    fuel = LlamaModel(src, CAPACITY)
    want_toks, want = hf_greedy(model, PROMPT, STEPS)
    got_toks, got = fuel_greedy(fuel, PROMPT)
    scale = np.abs(want).max()  # one row: the last position's logits
    assert np.abs(got - want).max() <= rtol * scale, (np.abs(got - want).max(), scale)
    assert got_toks == want_toks


@pytest.mark.parametrize("arch", DECODERS)
def test_decoder_from_safetensors(arch: str, tmp_path: Path) -> None:
    model = hf_model(arch, SEEDS.get(arch, 0))
    shards = {"max_shard_size": "60KB"} if arch == "qwen3" else {}
    path = save_dir(model, tmp_path / arch, **shards)
    if shards:
        assert len(list(path.glob("*.safetensors"))) > 1
    _check(model, path)


def test_bf16_directory(tmp_path: Path) -> None:
    model = hf_model("llama", seed=1)
    path = save_dir(model, tmp_path / "bf16", dtype=torch.bfloat16)
    rounded = model.to(torch.bfloat16).to(torch.float32)   # float32 compute over the same bf16 values
    _check(rounded, path, rtol=1e-3)


def test_q8_0_on_load(tmp_path: Path) -> None:
    """Llama's projections quantised on load (its Q/K rows permuted, then moved back by the model): the oracle
    holds gguf's own Q8_0 round trip of each projection (per-row blocks, so the permutation commutes)."""
    model = hf_model("llama", seed=2)
    path = save_dir(model, tmp_path / "q8")
    q8 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and ("layers." in name or name == "lm_head.weight"):
                w = gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), q8), q8)
                p.copy_(torch.from_numpy(np.ascontiguousarray(w, np.float32)))
    _check(model, path, quantize="q8_0")


def test_mamba_from_safetensors(tmp_path: Path) -> None:
    """Mamba-1 on `MambaModel`; the oracle reruns transformers' whole forward for each greedy token."""
    from fuel.models.mamba_lm import MambaModel

    model = hf_model("mamba")
    fuel = MambaModel(open_source(save_dir(model, tmp_path / "mamba")), CAPACITY)
    got_toks, got = fuel_greedy(fuel, PROMPT)   # type: ignore[arg-type]
    ids, want_toks = list(PROMPT), []
    with torch.inference_mode():
        want = model(torch.tensor([ids])).logits[0, -1].double().numpy()
        logits = want
        for _ in range(STEPS):
            want_toks.append(int(np.argmax(logits)))
            ids.append(want_toks[-1])
            logits = model(torch.tensor([ids])).logits[0, -1].double().numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), (np.abs(got - want).max(), np.abs(want).max())
    assert got_toks == want_toks
