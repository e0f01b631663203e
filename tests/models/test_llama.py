"""SmolLM2 and Gemma-3 through Fuel against transformers running the same GGUF files in float32.

transformers dequantises the GGUF tensors with gguf-py and runs its own Llama / Gemma-3 modules: an
independent implementation of every part (rope layout, GQA, QK-norm, sliding window, the two rope
bases, GeGLU, the tied head). Both sides get the same token ids, so these tests isolate the model;
the tokenizer has its own tests. Measured: first-step logits differ by at most 7e-5 (|logits| up to
65), far inside the 1e-3 relative bound asked; greedy tokens agree exactly.
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from fuel.dispatch import native
from fuel.errors import FuelError
from fuel.io.gguf import bundled_gguf
from fuel.models import generate as gen
from fuel.models.llama import LlamaModel, ModelError
from fuel.models.tokenizer import GGUFTokenizer

STEPS = 32
SMOL_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
)


def hf_model(name: str) -> Any:
    path = bundled_gguf(name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def hf_greedy(model: Any, ids: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy continuation (its own KV cache) and its first-step logits."""
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
        first = out.logits[0, -1].double().numpy()
        toks: list[int] = []
        for _ in range(steps):
            t = int(out.logits[0, -1].argmax())
            toks.append(t)
            out = model(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
    return toks, first


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


@pytest.fixture(scope="module")
def smol() -> Iterator[tuple[LlamaModel, GGUFTokenizer, Any]]:
    model = LlamaModel.load(bundled_gguf("smollm2"), capacity=256)
    yield model, GGUFTokenizer.from_metadata(model.file.metadata), hf_model("smollm2")


@pytest.mark.parametrize("prompt", SMOL_PROMPTS)
def test_smollm2_greedy_matches_transformers(smol: tuple[LlamaModel, GGUFTokenizer, Any], prompt: str) -> None:
    model, tok, hf = smol
    ids = tok.encode_chat([{"role": "user", "content": prompt}])
    want, want_first = hf_greedy(hf, ids, STEPS)
    got, got_first = fuel_greedy(model, ids, STEPS)
    assert_logits_close(got_first, want_first)
    assert got == want, f"{tok.decode(got)!r} != {tok.decode(want)!r}"


@pytest.mark.parametrize("runs", [(1,), (2,), (9,), (130,), (100, 20), (250, 5)], ids=str)
def test_prefill_logits_are_those_of_one_token_at_a_time(smol: tuple[LlamaModel, GGUFTokenizer, Any],
                                                         runs: tuple[int, ...]) -> None:
    """prefill's logits (its last chunk runs the last layer past the cache writes for its last live row
    only) against decoding the same tokens one by one; consecutive prefills continue the sequence, and
    one near the cache's end (no room for a padded chunk) decodes token by token."""
    model, _, _ = smol
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


def test_decode_runs_natively_with_the_python_replays_logits(smol: tuple[LlamaModel, GGUFTokenizer, Any],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode step replays natively (`fuel.dispatch.native`), every step of it, the logits written
    into a buffer of the capture's and copied out, and gives the bytes a model whose captures stay in
    Python gives."""
    model, _, _ = smol
    ids = [int(t) for t in np.random.default_rng(3).integers(100, 40000, 20)]
    got, _ = fuel_greedy(model, ids, 6)
    got_logits = model.decode(got[-1])
    capture = next(iter(model._decode._captures.values()))
    assert capture.native is not None
    assert not [item for item in capture.native.items if len(item) != 2] and capture.native.copied
    with monkeypatch.context() as m:
        m.setattr(native, "prepare", lambda *a, **kw: None)
        python = LlamaModel.load(bundled_gguf("smollm2"), capacity=64)
        want, _ = fuel_greedy(python, ids, 6)
        want_logits = python.decode(want[-1])
    assert next(iter(python._decode._captures.values())).native is None
    assert got == want and got_logits.tobytes() == want_logits.tobytes()


def test_warm_up_captures_every_step_a_timed_run_uses() -> None:
    """The reported speeds are those of replayed steps: the warm-up captures the prompt's prefill chunk
    (which gives the logits itself) and the decode step, and leaves the cache empty."""
    model = LlamaModel.load(bundled_gguf("smollm2"), capacity=64)
    gen.warm_up(model, 37, io.StringIO())
    assert model.pos == 0
    assert model._prefill_last.captures == 1 and model._decode.captures == 1
    model.prefill(list(range(100, 137)))
    model.decode(5)
    assert model._prefill_last.captures == 1 and model._decode.captures == 1  # nothing captured anew


def test_generate_streams_the_greedy_text(smol: tuple[LlamaModel, GGUFTokenizer, Any]) -> None:
    """The public API: pieces concatenate to the decode of the greedy ids, stopping at <|im_end|>; a
    second turn reuses the cached conversation and runs only its new tokens."""
    model, tok, _ = smol
    model.reset()
    llm = gen.LLM(model, tok)
    text = "".join(llm.generate("What is 2 + 2?", max_tokens=48, chat=True))
    ids = tok.encode_chat([{"role": "user", "content": "What is 2 + 2?"}])
    toks, _ = fuel_greedy(model, ids, 48)
    end = next((i for i, t in enumerate(toks) if t in tok.eos_ids), len(toks))
    assert end < 48, "the answer should end with an end-of-turn token"
    assert text == tok.decode(toks[:end], skip_special=True)
    llm.cached = ids + toks[:end]  # fuel_greedy ran the same ids: the cache holds them
    model.pos = len(llm.cached)
    messages = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": text},
                {"role": "user", "content": "And 3 + 3?"}]
    before = llm.stats.prompt_tokens
    second = "".join(llm.generate(messages, max_tokens=16))
    assert second
    assert llm.stats.prompt_tokens - before < len(llm.prompt_ids(messages, True)) - len(ids)


def test_sampling_is_seeded_and_bounded(smol: tuple[LlamaModel, GGUFTokenizer, Any]) -> None:
    model, tok, _ = smol
    llm = gen.LLM(model, tok)
    kw: dict[str, Any] = {"max_tokens": 12, "temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 7}
    llm.cached = []
    a = "".join(llm.generate("Once upon a time", **kw))
    llm.cached = []
    b = "".join(llm.generate("Once upon a time", **kw))
    assert a == b and a


@pytest.fixture(scope="module")
def gemma() -> Iterator[tuple[LlamaModel, Any]]:
    yield LlamaModel.load(bundled_gguf("gemma3"), capacity=1024), hf_model("gemma3")


def test_gemma3_greedy_matches_transformers(gemma: tuple[LlamaModel, Any]) -> None:
    model, hf = gemma
    tok = GGUFTokenizer.from_metadata(model.file.metadata)
    ids = tok.encode("The three primary colours are", add_bos=True)
    want, want_first = hf_greedy(hf, ids, STEPS)
    got, got_first = fuel_greedy(model, ids, STEPS)
    assert_logits_close(got_first, want_first)
    assert got == want, f"{tok.decode(got)!r} != {tok.decode(want)!r}"


def test_gemma3_past_the_sliding_window(gemma: tuple[LlamaModel, Any]) -> None:
    """700 tokens: the local layers see 512 keys, the global ones all; prefill runs in several chunks
    and the last tokens through the decode step."""
    model, hf = gemma
    rng = np.random.default_rng(0)
    ids = [2, *(int(t) for t in rng.integers(300, 200_000, 699))]
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].double().numpy()
    model.reset()
    got = model.prefill(ids[:690])
    assert_logits_close(got, ref[689])
    for j in range(690, 700):
        got = model.decode(ids[j])
        assert_logits_close(got, ref[j])


# ---- errors ------------------------------------------------------------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    gen.add_generate_arguments(p)
    return p.parse_args(list(argv))


def test_unknown_model_name_is_a_clear_error() -> None:
    err = io.StringIO()
    assert gen.run_generate(_args("hi", "--model", "nosuchmodel"), out=io.StringIO(), err=err) == 2
    assert "nosuchmodel" in err.getvalue() and "smollm2" in err.getvalue()


def test_prompt_longer_than_the_context(smol: tuple[LlamaModel, GGUFTokenizer, Any]) -> None:
    model, tok, _ = smol
    llm = gen.LLM(model, tok)
    with pytest.raises(ModelError, match="KV cache holds 256"):
        list(llm.generate("word " * 400, max_tokens=4))
    with pytest.raises(ModelError, match="do not fit the KV cache"):
        model.reset()
        model.prefill([1] * 300)


def test_token_id_outside_the_vocabulary(smol: tuple[LlamaModel, GGUFTokenizer, Any]) -> None:
    model, _, _ = smol
    model.reset()
    with pytest.raises(ModelError, match="outside the vocabulary"):
        model.decode(49152)


def _write_gguf(path: Path, arch: str, qtype: Any = None) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_context_length(64)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(50)
    w.add_rope_freq_base(10_000.0)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (50, 32), "output_norm.weight": (32,), "blk.0.attn_norm.weight": (32,),
              "blk.0.ffn_norm.weight": (32,), "blk.0.attn_q.weight": (32, 32), "blk.0.attn_k.weight": (16, 32),
              "blk.0.attn_v.weight": (16, 32), "blk.0.attn_output.weight": (32, 32),
              "blk.0.ffn_gate.weight": (64, 32), "blk.0.ffn_up.weight": (64, 32), "blk.0.ffn_down.weight": (32, 64)}
    for name, shape in shapes.items():
        a = rng.standard_normal(shape).astype(np.float32)
        if qtype is not None and name == "blk.0.ffn_up.weight":
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((shape[0], shape[1] // block * size), np.uint8)  # zero scales: valid blocks
            w.add_tensor(name, raw, raw_dtype=qtype)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "m.gguf", "gpt2")
    with pytest.raises(ModelError, match="architecture 'gpt2' is not supported"):
        LlamaModel.load(path, capacity=16)


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    import gguf

    path = _write_gguf(tmp_path / "m.gguf", "llama", gguf.GGMLQuantizationType.IQ4_NL)
    with pytest.raises(FuelError, match="IQ4_NL"):
        LlamaModel.load(path, capacity=16)


def test_any_llama_gguf_float_weights(tmp_path: Path) -> None:
    """A tiny float32 Llama file (no quantized tensor; its float Q/K rows are reordered too) against
    transformers loading the same file, at prefill and at one decode step."""
    path = _write_gguf(tmp_path / "m.gguf", "llama")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    ids = [1, 2, 3, 4, 5, 7]
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].double().numpy()
    model = LlamaModel.load(path, capacity=32)
    assert_logits_close(model.prefill(ids[:-1]), ref[-2], rel=1e-5)
    assert_logits_close(model.decode(ids[-1]), ref[-1], rel=1e-5)
