"""SmolLM2 and Gemma-3 through Fuel against transformers running the same GGUF files in float32.

transformers dequantises the GGUF tensors with gguf-py and runs its own Llama / Gemma-3 modules: an
independent implementation of every part (rope layout, GQA, QK-norm, sliding window, the two rope
bases, GeGLU, the tied head). Both sides get the same token ids, so these tests isolate the model;
the tokenizer has its own tests. Measured: first-step logits differ by at most 7e-5 (|logits| up to
65), far inside the 1e-3 relative bound asked; greedy tokens agree exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from fuel.errors import FuelError
from fuel.io.gguf import bundled_gguf
from fuel.models import generate as gen
from fuel.models.llama import LlamaModel, ModelError
from fuel.runtime import replay
from fuel.testing.llama_files import tiny_llama_gguf
from tests.models.oracles import hf_greedy, hf_logits

STEPS = 32
SMOL_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
)


def fuel_greedy(model: LlamaModel, ids: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    model.reset()
    logits = model.prefill(ids)
    first = logits.astype(np.float64)
    toks: list[int] = []
    for _ in range(steps):
        t = int(np.argmax(logits))
        toks.append(t)
        logits = model.decode(t)
    return toks, first


def assert_logits_close(got: np.ndarray, ref: np.ndarray, rel: float = 1e-3) -> None:
    """Within rel of the row's largest |logit| (one row: the scale is per row)."""
    scale = float(np.abs(ref).max())
    worst = float(np.abs(got - ref).max())
    assert worst <= rel * scale, f"max |fuel - transformers| = {worst:.3g}, bound {rel * scale:.3g}"


@pytest.mark.parametrize("prompt", SMOL_PROMPTS)
def test_smollm2_greedy_matches_transformers(smollm2: gen.LLM, smollm2_hf: Any, prompt: str) -> None:
    tok = smollm2.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": prompt}])
    want, want_first = hf_greedy(smollm2_hf, ids, STEPS)
    got, got_first = fuel_greedy(smollm2.model, ids, STEPS)
    assert_logits_close(got_first, want_first)
    assert got == want, f"{tok.decode(got)!r} != {tok.decode(want)!r}"


@pytest.mark.parametrize("runs", [(1,), (2,), (9,), (130,), (100, 20), (250, 5)], ids=str)
def test_prefill_logits_are_those_of_one_token_at_a_time(smollm2: gen.LLM, runs: tuple[int, ...]) -> None:
    """prefill's logits (its last chunk runs the last layer past the cache writes for its last live row
    only) against decoding the same tokens one by one; consecutive prefills continue the sequence, and
    one near the cache's end (no room for a padded chunk) decodes token by token."""
    model = smollm2.model
    ids = [int(t) for t in np.random.default_rng(sum(runs)).integers(100, 40000, sum(runs))]
    model.reset()
    for t in ids[:-1]:
        model.decode(t)
    want = model.decode(ids[-1])
    model.reset()
    start = 0
    for n in runs:
        got = model.prefill(ids[start:start + n])
        start += n
    assert model.pos == len(ids) and got.shape == want.shape
    assert_logits_close(got, want, rel=1e-5)


def test_decode_runs_natively_with_the_python_replays_logits(smollm2: gen.LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode step replays natively (`fuel.runtime.replay`), every step of it, the logits written
    into a buffer of the capture's and copied out, and gives the bytes a model whose captures stay in
    Python gives."""
    model = smollm2.model
    ids = [int(t) for t in np.random.default_rng(3).integers(100, 40000, 20)]
    got, _ = fuel_greedy(model, ids, 6)
    got_logits = model.decode(got[-1])
    capture = next(iter(model.default.decode_step._captures.values()))
    assert capture.native is not None
    assert not [item for item in capture.native.items if len(item) != 2] and capture.native.copied
    with monkeypatch.context() as m:
        m.setattr(replay, "prepare", lambda *a, **kw: None)
        python = LlamaModel.load(bundled_gguf("smollm2"), capacity=64)
        want, _ = fuel_greedy(python, ids, 6)
        want_logits = python.decode(want[-1])
    assert next(iter(python.default.decode_step._captures.values())).native is None
    assert got == want and got_logits.tobytes() == want_logits.tobytes()


def test_gemma3_greedy_matches_transformers(gemma3: gen.LLM, gemma3_hf: Any) -> None:
    tok = gemma3.tokenizer
    ids = tok.encode("The three primary colours are", add_bos=True)
    want, want_first = hf_greedy(gemma3_hf, ids, STEPS)
    got, got_first = fuel_greedy(gemma3.model, ids, STEPS)
    assert_logits_close(got_first, want_first)
    assert got == want, f"{tok.decode(got)!r} != {tok.decode(want)!r}"


def test_gemma3_past_the_sliding_window(gemma3: gen.LLM, gemma3_hf: Any) -> None:
    """700 tokens: the local layers see 512 keys, the global ones all; prefill runs in several chunks
    and the last tokens through the decode step. transformers computes the logits of the 11 positions
    compared only (`logits_to_keep`)."""
    model = gemma3.model
    rng = np.random.default_rng(0)
    ids = [2, *(int(t) for t in rng.integers(300, 200_000, 699))]
    ref = hf_logits(gemma3_hf, ids, 11)  # positions 689 … 699
    model.reset()
    got = model.prefill(ids[:690])
    assert_logits_close(got, ref[0])
    for j in range(690, 700):
        got = model.decode(ids[j])
        assert_logits_close(got, ref[j - 689])


# ---- errors ------------------------------------------------------------------------------------------


def test_prefill_past_the_capacity_and_bad_token_ids(smollm2: gen.LLM) -> None:
    model = smollm2.model
    model.reset()
    with pytest.raises(ModelError, match="do not fit the KV cache"):
        model.prefill([1] * 300)
    with pytest.raises(ModelError, match="outside the vocabulary"):
        model.decode(49152)
    for bad in ([1, 2.0], [True], "12"):
        with pytest.raises(ModelError, match="prefill"):
            model.prefill(bad)  # type: ignore[arg-type]
    assert model.pos == 0  # nothing ran


@pytest.mark.parametrize("missing", ["llama.block_count", "llama.embedding_length", "llama.context_length",
                                     "llama.attention.layer_norm_rms_epsilon", "token_embd.weight",
                                     "blk.0.ffn_down.weight", "output_norm.weight"])
def test_a_file_missing_a_key_or_tensor_names_both(tmp_path: Path, missing: str) -> None:
    """A missing hyper-parameter or tensor is a FuelError (a KeyError too) naming the key and the file."""
    path = tiny_llama_gguf(tmp_path / "broken.gguf", drop=[missing], tokenizer=False)
    with pytest.raises(FuelError) as info:
        LlamaModel.load(path, capacity=16)
    assert isinstance(info.value, KeyError)
    assert missing in str(info.value) and str(path) in str(info.value)


def test_a_malformed_hyper_parameter_is_named(tmp_path: Path) -> None:
    path = tiny_llama_gguf(tmp_path / "m.gguf", tokenizer=False, strings={"llama.block_count": "two"})
    with pytest.raises(ModelError, match=r"llama\.block_count must be a positive integer, got 'two'"):
        LlamaModel.load(path, capacity=16)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tiny_llama_gguf(tmp_path / "m.gguf", arch="gpt2", tokenizer=False)
    with pytest.raises(ModelError, match="architecture 'gpt2' is not supported"):
        LlamaModel.load(path, capacity=16)


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    import gguf

    path = tiny_llama_gguf(tmp_path / "m.gguf", qtype=gguf.GGMLQuantizationType.IQ4_NL, tokenizer=False)
    with pytest.raises(FuelError, match="IQ4_NL"):
        LlamaModel.load(path, capacity=16)


def test_any_llama_gguf_float_weights(tmp_path: Path) -> None:
    """A tiny float32 Llama file (no quantized tensor; its float Q/K rows are reordered too) against
    transformers loading the same file, at prefill and at one decode step."""
    path = tiny_llama_gguf(tmp_path / "m.gguf", tokenizer=False)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    ids = [1, 2, 3, 4, 5, 7]
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].double().numpy()
    model = LlamaModel.load(path, capacity=32)
    assert_logits_close(model.prefill(ids[:-1]), ref[-2], rel=1e-5)
    assert_logits_close(model.decode(ids[-1]), ref[-1], rel=1e-5)
