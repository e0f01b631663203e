"""Tiny Llama GGUF files written with gguf-py's own writer, for the model and CLI tests.

`tiny_llama_gguf` writes a one-layer float32 Llama (hidden 32, 2 query heads, 1 kv head) with random
weights, optionally with a byte-level tokenizer of 260 tokens (the 256 bytes, one merge "he", `<|im_start|>`,
`<|im_end|>`, `<|endoftext|>`) and a chat template, and optionally without some metadata keys or tensors (a broken
file). With `letters_only`, the file has its own output head whose rows are zero except those of the
ASCII letters: greedy decoding then emits letters only (an all-negative row of 52 random logits, the only
way another token could win, has probability 2^-52), never an end-of-turn token, so a generation runs
until its limit: what the CLI's streaming tests need.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from fuel.testing.gguf_files import finish
from fuel.train.export import byte_symbols

TINY_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def tiny_llama_gguf(path: Path, *, arch: str = "llama", context: int = 64, tokenizer: bool = True,
                    letters_only: bool = False, qtype: Any = None, drop: Iterable[str] = (),
                    strings: Mapping[str, str] | None = None, seed: int = 0) -> Path:
    """Write the tiny model (module doc) at `path`. `qtype`: a raw GGML type for ffn_up (zero blocks: valid
    bytes of any type); `drop`: metadata keys (e.g. "llama.block_count") or tensor names to leave out;
    `strings`: hyper-parameters written as these strings instead of their numbers (a malformed file)."""
    drop, strings = set(drop), dict(strings or {})
    tokens = [*byte_symbols(), "he", *SPECIALS] if tokenizer else []
    vocab = len(tokens) if tokenizer else 50
    w = gguf.GGUFWriter(str(path), arch)
    kv: list[tuple[str, Any]] = [
        (f"{arch}.block_count", w.add_block_count), (f"{arch}.embedding_length", w.add_embedding_length),
        (f"{arch}.context_length", w.add_context_length), (f"{arch}.feed_forward_length", w.add_feed_forward_length),
        (f"{arch}.attention.head_count", w.add_head_count), (f"{arch}.attention.head_count_kv", w.add_head_count_kv),
        (f"{arch}.attention.layer_norm_rms_epsilon", w.add_layer_norm_rms_eps),
        (f"{arch}.vocab_size", w.add_vocab_size), (f"{arch}.rope.freq_base", w.add_rope_freq_base)]
    values = [1, 32, context, 64, 2, 1, 1e-5, vocab, 10_000.0]
    for (key, add), value in zip(kv, values, strict=True):
        if key in strings:
            w.add_string(key, strings[key])
        elif key not in drop:
            add(value)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tokens)
        w.add_token_types([1] * 257 + [3] * len(SPECIALS))
        w.add_token_merges(["h e"])
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_chat_template(TINY_TEMPLATE)
    rng = np.random.default_rng(seed)
    shapes = {"token_embd.weight": (vocab, 32), "output_norm.weight": (32,), "blk.0.attn_norm.weight": (32,),
              "blk.0.ffn_norm.weight": (32,), "blk.0.attn_q.weight": (32, 32), "blk.0.attn_k.weight": (16, 32),
              "blk.0.attn_v.weight": (16, 32), "blk.0.attn_output.weight": (32, 32),
              "blk.0.ffn_gate.weight": (64, 32), "blk.0.ffn_up.weight": (64, 32), "blk.0.ffn_down.weight": (32, 64)}
    if letters_only:
        shapes["output.weight"] = (vocab, 32)
    for name, shape in shapes.items():
        a = rng.standard_normal(shape).astype(np.float32)
        if name == "output.weight":
            keep = np.zeros(vocab, bool)
            keep[[ord(c) for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"]] = True
            a[~keep] = 0.0
        if name in drop:
            continue
        if qtype is not None and name == "blk.0.ffn_up.weight":
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((shape[0], shape[1] // block * size), np.uint8)
            w.add_tensor(name, raw, raw_dtype=qtype)
        else:
            w.add_tensor(name, a)
    finish(w)
    return path
