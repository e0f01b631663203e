"""The real models and their transformers oracles, each loaded once per session (each costs seconds to
minutes: transformers dequantises Gemma-3's GGUF file in pure NumPy)."""

from __future__ import annotations

from typing import Any

import pytest

from fuel.models import generate as gen
from tests.models.oracles import hf_model

SMOL_CONTEXT = 256
GEMMA_CONTEXT = 1024


@pytest.fixture(scope="session")
def smollm2() -> gen.LLM:
    """SmolLM2-135M-Instruct with KV caches of 256 tokens (`fuel.models.generate.load` keeps the weights per
    process, so the CLI tests' runs at --context 256 share them)."""
    return gen.load("smollm2", SMOL_CONTEXT)


@pytest.fixture(scope="session")
def smollm2_hf() -> Any:
    return hf_model("smollm2")


@pytest.fixture(scope="session")
def gemma3() -> gen.LLM:
    return gen.load("gemma3", GEMMA_CONTEXT)


@pytest.fixture(scope="session")
def gemma3_hf() -> Any:
    return hf_model("gemma3")
