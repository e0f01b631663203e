"""The tiny architecture files' writer (fuel.testing.arch_files): what it writes, checked against gguf-py's
reader and transformers' own rope code; its refusals. The models themselves are checked in
tests/models/test_arch_oracle*.py."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from fuel.errors import ParamError
from fuel.testing.arch_files import ARCH_FILES, LLAMA3_ROPE, VOCAB, llama3_rope_factors, write_arch_gguf


def test_llama3_rope_factors_divide_transformers_inverse_frequencies() -> None:
    """rope_freqs.weight = HF's plain inverse frequencies over its Llama-3 scaled ones, per frequency; the
    tiny model's scaling covers all three bands (kept, interpolated, divided by the whole factor)."""
    a = ARCH_FILES["llama3"]
    cfg = LlamaConfig(hidden_size=a.hidden, num_attention_heads=a.heads, head_dim=a.head_dim,
                      rope_parameters={"rope_theta": a.rope_base, **LLAMA3_ROPE})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg)
    plain = a.rope_base ** -(np.arange(0, a.head_dim, 2) / a.head_dim)
    got = llama3_rope_factors(dict(LLAMA3_ROPE), a.rope_base, a.head_dim)
    np.testing.assert_allclose(got, plain / scaled.double().numpy(), rtol=1e-6)
    assert got.min() == 1.0 and got.max() == LLAMA3_ROPE["factor"] and ((got > 1) & (got < 8)).any()


def test_q4_k_file_block_types(tmp_path: Path) -> None:
    """Q4_K where rows are whole 256-blocks, the token table and head Q6_K, other rows Q8_0 (qwen3's
    attn_output has k = 128), norms and biases F32."""
    r = gguf.GGUFReader(write_arch_gguf(tmp_path / "q.gguf", "qwen3", "Q4_K"))
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["token_embd.weight"] == "Q6_K"
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_down.weight"] == "Q4_K"
    assert types["blk.0.attn_output.weight"] == "Q8_0"
    assert types["blk.0.attn_q_norm.weight"] == types["output_norm.weight"] == "F32"
    assert r.fields["qwen3.attention.key_length"].contents() == 32


def test_tokenizer_cut_keeps_only_merges_of_its_tokens(tmp_path: Path) -> None:
    r = gguf.GGUFReader(write_arch_gguf(tmp_path / "t.gguf", "qwen2"))
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    merges = r.fields["tokenizer.ggml.merges"].contents()
    vocab = set(tokens)
    assert len(tokens) == VOCAB and len(merges) > 3000
    assert all(a in vocab and b in vocab and a + b in vocab for a, b in (m.split(" ") for m in merges))


@pytest.mark.parametrize(("name", "qtype", "flip", "match"), [
    ("falcon", "F32", None, "unknown model 'falcon'"),
    ("qwen2", "Q5_K", None, "qtype must be one of .* got 'Q5_K'"),
    ("qwen2", "F32", "upside_down", "flip must be one of .* got 'upside_down'"),
])
def test_refusals_name_what_came(tmp_path: Path, name: str, qtype: str, flip: str | None, match: str) -> None:
    with pytest.raises(ParamError, match=f"write_arch_gguf: {match}"):
        write_arch_gguf(tmp_path / "x.gguf", name, qtype, flip=flip)
    assert not (tmp_path / "x.gguf").exists()
