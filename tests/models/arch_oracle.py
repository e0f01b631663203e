"""transformers as the oracle of the architecture tests: the tiny files of `fuel.testing.arch_files` loaded by
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`, with the config values its GGUF reader ignores
given back as overrides (the model's `hf_config`: Llama-3's rope scaling, which the file carries as
`rope_freqs.weight`; Phi-3's LongRoPE; Qwen3's head_dim, assumed 128; Gemma-2's softcaps and query scale,
assumed 50, 30 and 1/√256; a sliding window). transformers' `mistral` GGUF path fails, so a Mistral file is
loaded as llama and its weights copied into a `MistralForCausalLM` with the window set.

The Fuel side is `fuel_greedy` / `fuel_last_logits` over `LlamaModel`'s `prefill` / `decode` / `reset` only.

The bound of a quantized file (`check_quantized`). transformers dequantises every block with gguf-py and runs
float32; Fuel's QMatMul decodes the same blocks to the same float32 values (bit-exact with gguf-py:
tests/cpu/quant) and accumulates in float32. So the two differ by f32 rounding alone, as for an F32 file, but
of weights with a wider spread (random K-quant blocks have heavy tails), which is why the bound is not
scaled by the logits themselves. A logit is the contraction z_j = Σ_i h_i·W_ji of the final normed hidden
state h with a head row: rounding in it is at most k·2⁻²⁴·Σ_i|h_i||W_ji| (1.5e-5 of that sum at k = 256),
and rounding anywhere upstream reaches it as Σ_i δh_i·W_ji, bounded by the same sum times δh's relative
size. So the row's scale is S = max_j Σ_i |h_i||W_ji|, from transformers' h and its dequantised head, and the
bound is 1e-4·S per element: 2 layers of a few f32 contractions each, with room (measured: at most 4e-7 of
S). Gemma-2's final softcap c·tanh(z/c) has slope at most 1, so the bound holds through it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

from fuel.models.llama import LlamaModel
from fuel.models.tokenizer import GGUFTokenizer
from fuel.testing.arch_files import ARCH_FILES, write_arch_gguf

STEPS = 32
QUANT_REL = 1e-4
CAPACITY = 128
PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "List three uses of a paperclip.")


def hf_arch_model(name: str, path: Path) -> Any:
    """transformers' float32 model of the file at `path` written for `ARCH_FILES[name]` (module doc)."""
    torch.set_num_threads(1)
    a = ARCH_FILES[name]
    # overrides as from_pretrained's config kwargs: the file is parsed once (its 8000 tokenizer strings cost
    # most of a load)
    overrides = {k: v for k, v in a.hf_config.items() if not (k == "sliding_window" and a.hf_type == "mistral")}
    if a.rope:
        overrides["rope_parameters"] = {"rope_theta": a.rope_base, **a.rope}
        if a.rope.get("rope_type") == "longrope":  # Phi3Config keeps its own copy, default 4096
            overrides["original_max_position_embeddings"] = a.rope["original_max_position_embeddings"]
    model: Any = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                      attn_implementation="eager", **overrides)
    config = model.config
    for key, value in overrides.items():  # a kwarg transformers dropped would leave its GGUF default
        got = getattr(config, key)
        assert (got.items() >= value.items() if isinstance(value, dict) else got == value), (key, got, value)
    if a.hf_type == "mistral":
        fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        mistral = MistralForCausalLM(MistralConfig(**{**fields, "sliding_window": a.window}))
        mistral.config._attn_implementation = "eager"
        mistral.load_state_dict(model.state_dict())
        model = mistral
    return model.eval()


def hf_greedy(model: Any, ids: list[int], steps: int = STEPS) -> tuple[list[int], np.ndarray]:
    """transformers' greedy continuation of `ids` with its own KV cache, and its first-step logits."""
    torch.set_num_threads(1)
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        first = out.logits[0, -1].double().numpy()
        toks: list[int] = []
        for _ in range(steps):
            t = int(out.logits[0, -1].argmax())
            toks.append(t)
            if len(toks) < steps:
                out = model(torch.tensor([[t]]), cache=out.past_key_values, use_cache=True,
                            logits_to_keep=1)
    return toks, first


def fuel_greedy(model: LlamaModel, ids: list[int], steps: int = STEPS) -> tuple[list[int], np.ndarray]:
    """Fuel's greedy continuation of `ids` from a reset sequence, and its first-step logits."""
    model.reset()
    logits = model.prefill(ids)
    first = np.asarray(logits, np.float64)
    toks: list[int] = []
    for _ in range(steps):
        toks.append(int(np.argmax(logits)))
        if len(toks) < steps:
            logits = model.decode(toks[-1])
    return toks, first


def hf_last_logits(model: Any, ids: list[int]) -> np.ndarray:
    torch.set_num_threads(1)
    with torch.inference_mode():
        return model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].double().numpy()


def fuel_last_logits(model: LlamaModel, ids: list[int]) -> np.ndarray:
    model.reset()
    return np.asarray(model.prefill(ids), np.float64)


class ArchCache:
    """Each file, transformers model and Fuel model built once per session (a file ~0.1 s, a transformers
    load ~1 s, a Fuel model's captures a few seconds)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._prompts: list[list[int]] = []
        self._files: dict[tuple[str, str, str | None], Path] = {}
        self._hf: dict[tuple[str, str], Any] = {}
        self._fuel: dict[tuple[str, str, str | None, int], LlamaModel] = {}

    def file(self, name: str, qtype: str = "F32", flip: str | None = None) -> Path:
        key = (name, qtype, flip)
        if key not in self._files:
            path = self.root / f"{name}-{qtype}-{flip or 'ok'}.gguf"
            self._files[key] = write_arch_gguf(path, name, qtype, flip=flip)
        return self._files[key]

    def hf(self, name: str, qtype: str = "F32") -> Any:
        if (name, qtype) not in self._hf:
            self._hf[name, qtype] = hf_arch_model(name, self.file(name, qtype))
        return self._hf[name, qtype]

    def fuel(self, name: str, qtype: str = "F32", flip: str | None = None, capacity: int = CAPACITY) -> LlamaModel:
        key = (name, qtype, flip, capacity)
        if key not in self._fuel:
            self._fuel[key] = LlamaModel.load(self.file(name, qtype, flip), capacity)
        return self._fuel[key]

    def load(self, name: str, qtype: str = "F32", capacity: int = CAPACITY) -> LlamaModel:
        """A new Fuel model of the file (one that reads a patched architecture table)."""
        return LlamaModel.load(self.file(name, qtype), capacity)

    def prompts(self) -> list[list[int]]:
        """Three chat prompts in the files' tokenizer (SmolLM2's system prompt makes each ~50 tokens)."""
        if not self._prompts:
            tok = GGUFTokenizer.from_gguf(self.file("qwen2"))
            self._prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
        return self._prompts


def row_scale(model: Any, ids: list[int]) -> float:
    """S = max_j Σ_i |h_i||W_ji| at the last position (module doc), in float64."""
    torch.set_num_threads(1)
    with torch.inference_mode():
        h = model.model(torch.tensor([ids])).last_hidden_state[0, -1].double().abs()
        w = model.lm_head.weight.double().abs()
    return float((w @ h).max())


def check_quantized(arch: ArchCache, name: str, qtype: str, prompt: int) -> None:
    """Last-position logits within QUANT_REL·S (module doc) and 32 equal greedy tokens on prompt `prompt`."""
    ids = arch.prompts()[prompt]
    hf = arch.hf(name, qtype)
    want, want_first = hf_greedy(hf, ids)
    got, got_first = fuel_greedy(arch.fuel(name, qtype), ids)
    bound = QUANT_REL * row_scale(hf, ids)
    worst = float(np.abs(got_first - want_first).max())
    assert worst <= bound, f"|fuel - transformers| reaches {worst:.3g}, bound {bound:.3g} (1e-4 of the row's S)"
    assert got == want
