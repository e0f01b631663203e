"""Export a trained `fuel.nn.Llama` to a GGUF file (F32 or Q8_0) through the `gguf` package's writer.

The file is what llama.cpp's `convert_hf_to_gguf.py` writes for a Hugging Face Llama, so `fuel generate
--model` (`fuel.models.llama`) and llama.cpp both load it:
- tensors under llama.cpp's names (`token_embd`, `blk.{i}.attn_q`, ..., `output_norm`, `output`; no `output`
  when the embeddings are tied), each a row-major `[out, in]` matrix as the state dict holds it;
- the rows of Q and K permuted inside each head from the halves layout (Hugging Face's rope rotates rows i and
  i + D/2) to the pairs layout llama.cpp's rope rotates (rows 2i and 2i + 1); the loader permutes them back;
- Q8_0 quantizes every matrix (`gguf.quants.quantize`, blocks of 32 along a row); norm weights stay F32;
- the llama hyper-parameters and the tokenizer's metadata: the byte tokenizer as a GPT-2 byte-level
  vocabulary (byte b's symbol at id b, `<|endoftext|>` = 256 the end of text, and the one merge the format
  requires, of two 0xFF bytes, at 257: `fuel.train.data`), or the bundled SmolLM2 file's tokenizer keys.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from fuel.errors import ParamError

QUANT_TYPES = ("f32", "q8_0")


def byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet, byte b's symbol at index b: the printable Latin-1 bytes stand for
    themselves, every other byte takes the next code point from 256 up, in byte order."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def to_pairs(w: np.ndarray, heads: int) -> np.ndarray:
    """Q or K rows `[heads·D, in]` from the halves layout to llama.cpp's pairs layout: file row h·D + 2i + j
    is row h·D + j·D/2 + i."""
    rows = w.shape[0]
    d = rows // heads
    return np.ascontiguousarray(w.reshape(heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _tokenizer_metadata(writer: Any, tokenizer: str) -> None:
    import gguf

    if tokenizer == "byte":
        from fuel.train.data import BYTE_EOS, BYTE_VOCAB

        symbols = byte_symbols()
        tokens = [*symbols, "<|endoftext|>", symbols[0xFF] * 2]
        assert len(tokens) == BYTE_VOCAB
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list(tokens)
        writer.add_token_types([gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL, gguf.TokenType.NORMAL])
        writer.add_token_merges([f"{symbols[0xFF]} {symbols[0xFF]}"])
        writer.add_eos_token_id(BYTE_EOS)
        writer.add_add_bos_token(False)
        return
    from fuel.io.bundled import bundled_gguf
    from fuel.io.gguf import open_gguf

    meta = open_gguf(bundled_gguf("smollm2")).metadata
    writer.add_tokenizer_model(str(meta["tokenizer.ggml.model"]))
    writer.add_tokenizer_pre(str(meta["tokenizer.ggml.pre"]))
    writer.add_token_list([str(t) for t in meta["tokenizer.ggml.tokens"]])
    writer.add_token_types([int(t) for t in meta["tokenizer.ggml.token_type"]])
    writer.add_token_merges([str(m) for m in meta["tokenizer.ggml.merges"]])
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("unknown_token_id", writer.add_unk_token_id), ("padding_token_id", writer.add_pad_token_id)):
        if f"tokenizer.ggml.{key}" in meta:
            add(int(meta[f"tokenizer.ggml.{key}"]))
    writer.add_add_bos_token(bool(meta.get("tokenizer.ggml.add_bos_token", False)))
    if "tokenizer.chat_template" in meta:
        writer.add_chat_template(str(meta["tokenizer.chat_template"]))


def export_gguf(state: Mapping[str, np.ndarray], hp: Mapping[str, Any], tokenizer: str,
                path: str | os.PathLike[str], qtype: str = "f32", name: str = "fuel-train") -> None:
    """Write the model `state` (Hugging Face `LlamaForCausalLM` names, float arrays) with hyper-parameters
    `hp` (dim, n_layers, n_heads, n_kv_heads, hidden_dim, vocab_size, context_length, rope_theta, norm_eps)
    and the named tokenizer ("byte" or "smollm2") to `path` as `qtype` ("f32" or "q8_0")."""
    import gguf

    if qtype not in QUANT_TYPES:
        raise ParamError(f"export_gguf: qtype must be one of {', '.join(QUANT_TYPES)}, got {qtype!r}")
    dim, layers, heads = int(hp["dim"]), int(hp["n_layers"]), int(hp["n_heads"])
    kv_heads, vocab = int(hp["n_kv_heads"]), int(hp["vocab_size"])
    if qtype == "q8_0" and dim % 32:
        raise ParamError(f"export_gguf: q8_0 needs rows that are multiples of 32, got dim {dim}")
    w = gguf.GGUFWriter(os.fspath(path), "llama")
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "q8_0" else gguf.LlamaFileType.ALL_F32)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(layers)
    w.add_context_length(int(hp["context_length"]))
    w.add_embedding_length(dim)
    w.add_feed_forward_length(int(hp["hidden_dim"]))
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(dim // heads)
    w.add_rope_freq_base(float(hp["rope_theta"]))
    w.add_layer_norm_rms_eps(float(hp["norm_eps"]))
    w.add_vocab_size(vocab)
    _tokenizer_metadata(w, tokenizer)

    def get(key: str) -> np.ndarray:
        if key not in state:
            raise ParamError(f"export_gguf: the state has no {key!r}")
        return np.asarray(state[key], dtype=np.float32)

    def add(gname: str, a: np.ndarray) -> None:
        a = np.ascontiguousarray(a, dtype=np.float32)
        if qtype == "q8_0" and a.ndim == 2:
            w.add_tensor(gname, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, a)

    add("token_embd.weight", get("model.embed_tokens.weight"))
    for i in range(layers):
        hf, g = f"model.layers.{i}.", f"blk.{i}."
        add(g + "attn_norm.weight", get(hf + "input_layernorm.weight"))
        add(g + "attn_q.weight", to_pairs(get(hf + "self_attn.q_proj.weight"), heads))
        add(g + "attn_k.weight", to_pairs(get(hf + "self_attn.k_proj.weight"), kv_heads))
        add(g + "attn_v.weight", get(hf + "self_attn.v_proj.weight"))
        add(g + "attn_output.weight", get(hf + "self_attn.o_proj.weight"))
        add(g + "ffn_norm.weight", get(hf + "post_attention_layernorm.weight"))
        add(g + "ffn_gate.weight", get(hf + "mlp.gate_proj.weight"))
        add(g + "ffn_up.weight", get(hf + "mlp.up_proj.weight"))
        add(g + "ffn_down.weight", get(hf + "mlp.down_proj.weight"))
    add("output_norm.weight", get("model.norm.weight"))
    if "lm_head.weight" in state:  # absent when the embeddings are tied: the loader then reads token_embd
        add("output.weight", get("lm_head.weight"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
