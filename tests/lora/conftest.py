"""The frozen models QLoRA is tested on, each loaded once per session: fuel's SmolLM2 (GGUF blocks, and the
same weights re-quantised to NF4) and transformers' float model of the same GGUF file (the oracle, under
peft)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fuel.cli import main as fuel_main
from fuel.lora import LoraAdapter, LoraConfig, load_model
from fuel.models.llama import LlamaModel
from fuel.models.tokenizer import GGUFTokenizer
from tests.models.oracles import hf_model

CAPACITY = 64


@pytest.fixture(scope="session")
def smol_hf() -> Any:
    return hf_model("smollm2")


@pytest.fixture(scope="session")
def smol_gguf() -> tuple[LlamaModel, GGUFTokenizer]:
    return load_model("smollm2", CAPACITY)


@pytest.fixture(scope="session")
def smol_nf4() -> tuple[LlamaModel, GGUFTokenizer]:
    return load_model("smollm2", CAPACITY, quant="nf4")


def random_adapter(model: LlamaModel, seed: int, r: int = 4, alpha: float = 8.0, scale: float = 0.02,
                   **kw: Any) -> LoraAdapter:
    """An adapter whose A and B are both random (a new one's B is zero: its term and A's gradient would be 0)."""
    adapter = LoraAdapter.create(model.cfg, LoraConfig(r=r, lora_alpha=alpha, **kw), seed=seed)
    rng = np.random.default_rng(seed)
    adapter.load_state_dict({k: (rng.standard_normal(v.shape) * scale).astype(np.float32)
                             for k, v in adapter.state_dict().items()})
    return adapter


TRAIN_EXAMPLES = (("Why is the sky blue?", "In short: air scatters blue sunlight the most."),
                  ("What is a noun?", "In short: a word that names a person, place or thing."))


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An adapter `fuel train --lora` trained for 3 steps on a fixed batch of two examples (its directory;
    train_log.json beside the adapter's files holds each step's loss)."""
    d = tmp_path_factory.mktemp("lora")
    data = d / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in TRAIN_EXAMPLES))
    code = fuel_main(["train", "--lora", "--data", str(data), "--out", str(d / "adapter"), "--steps", "3",
                      "--batch", "2", "--seq-len", "48", "--r", "4", "--alpha", "8", "--lr", "2e-3"])
    assert code == 0
    return d / "adapter"
