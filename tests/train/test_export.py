"""GGUF export (`fuel.train.export`): a file written from a Hugging Face-named state dict, loaded by
`fuel.models.llama`, gives the logits transformers' `LlamaForCausalLM` gives with the same weights.

Oracles: transformers (the float model, for F32); for Q8_0, transformers over the weights the `gguf`
package's own Q8_0 round trip gives (`gguf.quants.quantize` then `dequantize`), since QMatMul reads exactly
those blocks and never quantizes activations. The tokenizer: the exported byte vocabulary must encode any
text to its UTF-8 bytes, as the byte tokenizer does, and decode them back."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from fuel.errors import ParamError
from fuel.models.llama import LlamaModel
from fuel.models.tokenizer import GGUFTokenizer
from fuel.train.data import BYTE_EOS, BYTE_VOCAB, ByteTokenizer
from fuel.train.export import export_gguf

HP = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "hidden_dim": 96, "vocab_size": BYTE_VOCAB,
      "context_length": 32, "rope_theta": 10000.0, "norm_eps": 1e-5}


def hf_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=HP["dim"], num_hidden_layers=HP["n_layers"], num_attention_heads=HP["n_heads"],
        num_key_value_heads=HP["n_kv_heads"], intermediate_size=HP["hidden_dim"], vocab_size=HP["vocab_size"],
        max_position_embeddings=HP["context_length"], rope_theta=HP["rope_theta"], rms_norm_eps=HP["norm_eps"],
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False)


@pytest.fixture(scope="session")
def hf_state() -> dict[str, np.ndarray]:
    """A random state dict under transformers' names (norm weights away from 1, so a swapped norm shows)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config()).eval()
    rng = np.random.default_rng(0)
    state = {}
    for k, v in model.state_dict().items():
        a = v.numpy().astype(np.float32)
        state[k] = (1.0 + 0.3 * rng.standard_normal(a.shape)).astype(np.float32) if a.ndim == 1 else a
    return state


def hf_logits(state: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    model = transformers.LlamaForCausalLM(hf_config()).eval()
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()})
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy().astype(np.float64)


def fuel_logits(path: Path, ids: list[int]) -> np.ndarray:
    m = LlamaModel.load(path, capacity=len(ids))
    rows = [m.prefill(ids[:1])] + [m.decode(t) for t in ids[1:]]
    return np.stack(rows).astype(np.float64)


def q8_roundtrip(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    q = gguf.GGMLQuantizationType.Q8_0
    return {k: gguf.quants.dequantize(gguf.quants.quantize(v, q), q).astype(np.float32) if v.ndim == 2 else v
            for k, v in state.items()}


def assert_rows_close(got: np.ndarray, want: np.ndarray, rel: float) -> None:
    """Each row within rel times that row's largest |logit| (per row, never the whole tensor's max)."""
    scale = np.maximum(np.abs(want).max(axis=1, keepdims=True), 1e-6)
    err = np.abs(got - want) / scale
    assert err.max() <= rel, f"worst row error {err.max(axis=1).max():.3g} of its max |logit| > {rel}"


IDS = list(b"def f(x):\n    return x")


@pytest.fixture(scope="session")
def exported(tmp_path_factory: pytest.TempPathFactory, hf_state: dict[str, np.ndarray]) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("export")
    out = {}
    for q in ("f32", "q8_0"):
        out[q] = d / f"m-{q}.gguf"
        export_gguf(hf_state, HP, "byte", out[q], q)
    return out


def test_f32_export_matches_transformers(exported: dict[str, Path], hf_state: dict[str, np.ndarray]) -> None:
    assert_rows_close(fuel_logits(exported["f32"], IDS), hf_logits(hf_state, IDS), 2e-5)


def test_q8_0_export_matches_the_gguf_round_trip(exported: dict[str, Path], hf_state: dict[str, np.ndarray]) -> None:
    got = fuel_logits(exported["q8_0"], IDS)
    assert_rows_close(got, hf_logits(q8_roundtrip(hf_state), IDS), 2e-5)
    # and Q8_0's own error against the float model stays at its 8-bit level (per row)
    assert_rows_close(got, hf_logits(hf_state, IDS), 5e-2)


def test_q8_0_export_holds_q8_0_blocks(exported: dict[str, Path]) -> None:
    r = gguf.GGUFReader(exported["q8_0"])
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32


@settings(max_examples=50)
@given(text=st.text(max_size=40))
def test_exported_byte_vocabulary_encodes_utf8_bytes(exported: dict[str, Path], text: str) -> None:
    tok = GGUFTokenizer.from_gguf(exported["f32"])
    assume_valid = text.encode("utf-8", errors="replace").decode("utf-8")
    ids = tok.encode(assume_valid, add_bos=False)
    assert ids == ByteTokenizer().encode(assume_valid)
    assert tok.decode(ids) == assume_valid


def test_exported_tokenizer_metadata(exported: dict[str, Path]) -> None:
    tok = GGUFTokenizer.from_gguf(exported["f32"])
    assert tok.vocab_size == BYTE_VOCAB and tok.eos_id == BYTE_EOS and not tok.add_bos
    assert tok.encode("<|endoftext|>", add_bos=False) == [BYTE_EOS]


def test_export_errors_name_the_problem(tmp_path: Path, hf_state: dict[str, np.ndarray]) -> None:
    with pytest.raises(ParamError, match="qtype must be one of f32, q8_0, got 'q4_0'"):
        export_gguf(hf_state, HP, "byte", tmp_path / "x.gguf", "q4_0")
    with pytest.raises(ParamError, match=re.escape("no 'model.norm.weight'")):
        export_gguf({k: v for k, v in hf_state.items() if k != "model.norm.weight"}, HP, "byte",
                    tmp_path / "y.gguf")
    with pytest.raises(ParamError, match="q8_0 needs rows that are multiples of 32, got dim 48"):
        export_gguf(hf_state, {**HP, "dim": 48}, "byte", tmp_path / "z.gguf", "q8_0")
