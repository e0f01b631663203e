"""Each decoder architecture's tiny F32 file (fuel.testing.arch_files) through Fuel against transformers reading
the same file (tests/models/arch_oracle.py): last-position logits, 32 greedy tokens on three prompts, prompts
past the sliding window, Phi-3's short and long rope factors; and the oracle itself: transformers reads the
weights the writer meant, and a file (or an architecture entry) wrong in one detail moves the logits far past
the tolerance, so a decoder that got that detail wrong could not pass.

The F32 bound is 1e-4 of the row's largest |logit|, per element: both sides multiply the same float32 weights
and differ only by f32 rounding, measured at a few 1e-6 of the row's scale.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from fuel.models.tokenizer import GGUFTokenizer
from fuel.testing.arch_files import ARCH_FILES, VOCAB, hf_weights
from tests.models.arch_oracle import (
    PROMPTS,
    ArchCache,
    fuel_greedy,
    fuel_last_logits,
    hf_greedy,
    hf_last_logits,
)

F32_REL = 1e-4
FAR = 100  # a wrong detail moves some logit by more than FAR times the tolerance


@pytest.fixture(scope="session")
def arch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ArchCache]:
    yield ArchCache(tmp_path_factory.mktemp("arch_f32"))


def worst_over_row(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| per element, in units of the row's largest |ref| (one row: the scale is per row)."""
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def assert_logits_close(got: np.ndarray, ref: np.ndarray, rel: float = F32_REL) -> None:
    assert got.shape == ref.shape, f"logits shape {got.shape} != {ref.shape}"
    worst = worst_over_row(got, ref)
    j = int(np.argmax(np.abs(got - ref)))
    assert worst <= rel, f"|fuel - transformers| reaches {worst:.3g} of the row's max at token {j} " \
                         f"({got[j]:.6g} vs {ref[j]:.6g}), bound {rel:g}"


@pytest.mark.parametrize("name", ARCH_FILES)
def test_transformers_reads_the_weights_the_writer_meant(arch: ArchCache, name: str) -> None:
    """The oracle's side of the file: every tensor transformers holds equals the weight drawn in HF's meaning
    (the converter's Q/K permutation undone, Gemma's +1 taken off: equal to f32 rounding of w + 1 - 1)."""
    a = ARCH_FILES[name]
    state = {k: v.numpy() for k, v in arch.hf(name).state_dict().items()}
    want = hf_weights(a)
    hf_of = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_down": "mlp.down_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.gate_up_proj" if a.fused else "mlp.up_proj",
             "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
             "ffn_norm": "pre_feedforward_layernorm" if a.gemma else "post_attention_layernorm"}
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    for gname, w in want.items():
        if gname in top:
            hname = top[gname]
        else:
            _, i, part, kind = gname.split(".")
            hname = f"model.layers.{i}.{hf_of[part]}.{kind}"
        assert hname in state, f"{name}: transformers has no {hname} for {gname}"
        np.testing.assert_allclose(state[hname], w, rtol=0, atol=1e-6 if a.gemma else 0, err_msg=gname)
    assert ("output.weight" in want) != bool(arch.hf(name).config.tie_word_embeddings)


def test_the_files_tokenizer_is_the_one_transformers_reads(arch: ArchCache) -> None:
    """SmolLM2's vocabulary cut to 4096 tokens and the merges that build them is a working BPE tokenizer:
    Fuel's tokenizer of the file encodes as transformers' tokenizer of the same file, chat prompts included."""
    from transformers import AutoTokenizer

    path = arch.file("qwen2")
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = GGUFTokenizer.from_gguf(path)
    assert tok.vocab_size == VOCAB == len(hf)
    for text in ("What is the capital of France?", "naïve café, 1234 — ok\n\n  spaces", "<|im_start|>hi<|im_end|>"):
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    for p, ids in zip(PROMPTS, arch.prompts(), strict=True):
        chat: Any = hf.apply_chat_template([{"role": "user", "content": p}], tokenize=True, add_generation_prompt=True)
        assert ids == list(chat["input_ids"])


@pytest.mark.parametrize("prompt", range(3))
@pytest.mark.parametrize("name", ARCH_FILES)
def test_f32_logits_and_greedy_tokens_match_transformers(arch: ArchCache, name: str, prompt: int) -> None:
    ids = arch.prompts()[prompt]
    a = ARCH_FILES[name]
    assert a.window is None or len(ids) > a.window  # the chat prompts already reach past a window
    want, want_first = hf_greedy(arch.hf(name), ids)
    got, got_first = fuel_greedy(arch.fuel(name), ids)
    assert_logits_close(got_first, want_first)
    assert got == want


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_a_prompt_several_windows_long(arch: ArchCache, name: str) -> None:
    """90 tokens past a 16-token window (several prefill chunks), then 32 greedy steps with it sliding."""
    window = ARCH_FILES[name].window
    ids = [t for p in arch.prompts() for t in p][:90]
    assert window is not None and len(ids) > 5 * window
    want, want_first = hf_greedy(arch.hf(name), ids)
    got, got_first = fuel_greedy(arch.fuel(name), ids)
    assert_logits_close(got_first, want_first)
    assert got == want


def test_phi3_short_rope_factors_below_the_original_context(arch: ArchCache) -> None:
    """A KV cache within `rope.scaling.original_context_length` (32) runs the short factors, as llama.cpp
    chooses by context; transformers chooses by length, so the prompt stays within 32 too."""
    ids = arch.prompts()[0][:24]
    ref = hf_last_logits(arch.hf("phi3_longrope"), ids)
    assert_logits_close(fuel_last_logits(arch.fuel("phi3_longrope", capacity=32), ids), ref)


# (model, flip): the file written wrong in one detail a decoder could get wrong
FLIPS = [("llama3", "no_rope_freqs"), ("llama3", "qk_unpermuted"), ("mistral", "no_window"), ("qwen2", "no_bias"),
         ("qwen2_untied", "tied_head"), ("qwen3", "qk_norm_ones"), ("phi3", "gate_up_swapped"),
         ("phi3_longrope", "no_longrope"), ("gemma2", "norm_no_plus_one")]


@pytest.mark.parametrize(("name", "flip"), FLIPS, ids=[f"{n}-{f}" for n, f in FLIPS])
def test_a_file_wrong_in_one_detail_moves_the_logits_far(arch: ArchCache, name: str, flip: str) -> None:
    ids = arch.prompts()[0]
    ref = hf_last_logits(arch.hf(name), ids)
    got = fuel_last_logits(arch.fuel(name, flip=flip), ids)
    assert worst_over_row(got, ref) > FAR * F32_REL


@pytest.mark.parametrize(("name", "field", "value"), [("gemma2", "softcaps", False),
                                                      ("gemma2", "window_layers", "all"),
                                                      ("gemma2", "embed_scale", False),
                                                      ("llama3", "permuted_qk", False)])
def test_an_architecture_entry_wrong_in_one_detail_moves_the_logits_far(
        arch: ArchCache, monkeypatch: pytest.MonkeyPatch, name: str, field: str, value: object) -> None:
    """`fuel.models.architectures.ARCHITECTURES[arch]` with one field replaced (details that change no
    tensor, so the model still loads), read by a model built while the patch holds."""
    from fuel.models import architectures

    a = ARCH_FILES[name]
    spec = architectures.ARCHITECTURES[a.arch]
    assert getattr(spec, field) != value
    changes: dict[str, Any] = {field: value}
    monkeypatch.setitem(architectures.ARCHITECTURES, a.arch, dataclasses.replace(spec, **changes))
    ids = arch.prompts()[0]
    ref = hf_last_logits(arch.hf(name), ids)
    got = fuel_last_logits(arch.load(name), ids)
    assert worst_over_row(got, ref) > FAR * F32_REL
