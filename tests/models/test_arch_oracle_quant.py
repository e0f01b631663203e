"""Each decoder architecture's tiny Q8_0 file (fuel.testing.arch_files: gguf-py's blocks) through Fuel against
transformers reading the same file: last-position logits within the per-row bound of f32 rounding with the
dequantised weights (derived in tests/models/arch_oracle.py) and 32 greedy tokens on three prompts.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fuel.testing.arch_files import ARCH_FILES
from tests.models.arch_oracle import ArchCache, check_quantized


@pytest.fixture(scope="session")
def arch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ArchCache]:
    yield ArchCache(tmp_path_factory.mktemp("arch_q8_0"))


@pytest.mark.parametrize("prompt", range(3))
@pytest.mark.parametrize("name", ARCH_FILES)
def test_q8_0_logits_and_greedy_tokens_match_transformers(arch: ArchCache, name: str, prompt: int) -> None:
    check_quantized(arch, name, "Q8_0", prompt)
