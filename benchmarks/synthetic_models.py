"""Synthetic ~0.5B GGUF models for `fuel bench --models`: a Qwen2 and a Phi-3 with random weights.

No weights of these models ship with Fuel, and speed does not depend on the values, so the benchmark
writes files of the real shapes with random *valid* blocks (random quant bytes, finite f16 scales sized
so the dequantised weights are about ±0.02-0.05) through gguf-py's writer.

- `QWEN2` is Qwen2.5-0.5B's shape: hidden 896, 24 layers, 14 query / 2 kv heads (head 64), ffn 4864,
  vocab 151936, tied embeddings, q/k/v biases (0.49B parameters).
- `PHI3` is Phi-3-mini scaled to ~0.5B: hidden 1536, 14 layers, 16 heads of 96 (Phi-3's head size, no
  GQA as in Phi-3-mini), ffn 4096 (Phi-3's ffn/hidden ratio 8/3), vocab 32064, untied output, fused
  `attn_qkv` and `ffn_up` (gate then up), Phi-3-mini-4k's sliding window of 2047 on every layer, as its
  converted files carry it (0.49B parameters). llama.cpp ignores a phi3 file's window ("Phi SWA is
  currently disabled"); at the benchmark's 256 positions no window applies, so both engines do the same math.

Block types follow llama.cpp's Q4_K_M recipe (`llama_tensor_get_type`): Q4_K by default; Q6_K for the
output head (the token embedding when it is tied) and for `attn_v` / `ffn_down` in the layers its
`use_more_bits` picks; Q5_K for a fused `attn_qkv`; f32 for norms and biases. A K-quant row needs a
multiple of 256 values, so where a row is shorter llama.cpp falls back (Q4_K → Q5_0, Q5_K → Q5_1,
Q6_K → Q8_0), as here: most of Qwen2.5-0.5B's matrices (rows of 896) are Q5_0 / Q8_0 in the real
Q4_K_M file too.

The tokenizer is SmolLM2's byte-level BPE (a valid gpt2 vocabulary llama.cpp loads), padded with
unreachable `[PAD<id>]` tokens to Qwen2's vocabulary, or cut to Phi-3's first 32064 tokens and the merges
that build them (its ids follow merge order, so the cut is a valid tokenizer).

`ensure(spec, folder)` writes a file once and reuses it: its name carries a key hashed from everything
that decides its bytes, so a changed spec or recipe writes a new file.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from fuel.quant import QuantType

RECIPE_VERSION = 2  # bump when the bytes written for a spec change
DEFAULT_FOLDER = Path.home() / ".cache" / "fuel-bench"
WEIGHT_SIZE = 0.03  # the typical |w| of a dequantised weight

# Byte offsets of each block type's f16 scale fields, and the typical |multiplier| of a scale there (the
# quant value times the sub-block scale), so that `WEIGHT_SIZE / multiplier` makes |w| about WEIGHT_SIZE.
_SCALES: dict[QuantType, tuple[tuple[int, ...], float]] = {
    QuantType.Q5_0: ((0,), 8.0),
    QuantType.Q5_1: ((0, 2), 16.0),
    QuantType.Q8_0: ((0,), 64.0),
    QuantType.Q4K: ((0, 2), 32.0 * 8.0),
    QuantType.Q5K: ((0, 2), 32.0 * 16.0),
    QuantType.Q6K: ((208,), 64.0 * 16.0),
}
_FALLBACK = {QuantType.Q4K: QuantType.Q5_0, QuantType.Q5K: QuantType.Q5_1, QuantType.Q6K: QuantType.Q8_0}


@dataclass(frozen=True)
class Spec:
    name: str
    arch: str  # "qwen2" | "phi3"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    context: int
    rope_base: float
    eps: float
    window: int = 0  # attention.sliding_window, written when set
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


QWEN2 = Spec("qwen2-0.5b", "qwen2", hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864, vocab=151936, tied=True,
             context=32768, rope_base=1_000_000.0, eps=1e-6)
PHI3 = Spec("phi3-0.5b", "phi3", hidden=1536, layers=14, heads=16, kv_heads=16, ffn=4096, vocab=32064, tied=False,
            context=4096, rope_base=10_000.0, eps=1e-5, window=2047)
SPECS = {"qwen2_0.5b": QWEN2, "phi3_0.5b": PHI3}


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits in Q4_K_M."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def block_type(name: str, k: int, layer: int, spec: Spec) -> QuantType:
    """The Q4_K_M recipe's type of the 2-D tensor `name` with rows of k values (module doc)."""
    base = name.split(".")[-2]
    head = base == "output" or (base == "token_embd" and spec.tied)
    if head or (base in ("attn_v", "ffn_down") and use_more_bits(layer, spec.layers)):
        qt = QuantType.Q6K
    elif base == "attn_qkv":
        qt = QuantType.Q5K
    else:
        qt = QuantType.Q4K
    return _FALLBACK[qt] if k % qt.block_elements else qt


def tensor_shapes(spec: Spec) -> dict[str, tuple[int, ...]]:
    """Every tensor's NumPy shape ([rows, k] for a matrix), in llama.cpp's names for the architecture."""
    h, kv, f = spec.hidden, spec.kv_heads * spec.head_dim, spec.ffn
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (spec.vocab, h), "output_norm.weight": (h,)}
    if not spec.tied:
        shapes["output.weight"] = (spec.vocab, h)
    for i in range(spec.layers):
        b = f"blk.{i}."
        shapes |= {b + "attn_norm.weight": (h,), b + "ffn_norm.weight": (h,), b + "attn_output.weight": (h, h),
                   b + "ffn_down.weight": (h, f)}
        if spec.arch == "phi3":
            shapes |= {b + "attn_qkv.weight": (h + 2 * kv, h), b + "ffn_up.weight": (2 * f, h)}
        else:
            shapes |= {b + "attn_q.weight": (h, h), b + "attn_k.weight": (kv, h), b + "attn_v.weight": (kv, h),
                       b + "attn_q.bias": (h,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,),
                       b + "ffn_gate.weight": (f, h), b + "ffn_up.weight": (f, h)}
    return shapes


def parameter_count(spec: Spec) -> int:
    return sum(int(np.prod(s)) for s in tensor_shapes(spec).values())


def type_counts(spec: Spec) -> dict[str, int]:
    """How many tensors the file holds of each block type ("F32" for norms and biases)."""
    counts: dict[str, int] = {}
    for name, shape in tensor_shapes(spec).items():
        layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
        kind = "F32" if len(shape) == 1 else block_type(name, shape[1], layer, spec).ggml_name
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def random_blocks(rng: np.random.Generator, qt: QuantType, n: int, k: int) -> np.ndarray:
    """uint8 [n, row bytes]: random quant bytes with finite f16 scales of random sign (valid blocks)."""
    nblocks = n * (k // qt.block_elements)
    blocks = np.frombuffer(rng.bytes(nblocks * qt.block_bytes), np.uint8).reshape(nblocks, qt.block_bytes).copy()
    offsets, multiplier = _SCALES[qt]
    for off in offsets:
        size = rng.uniform(0.5, 1.5, nblocks) * rng.choice((-1.0, 1.0), nblocks) * (WEIGHT_SIZE / multiplier)
        blocks[:, off:off + 2] = size.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def tokenizer_metadata(vocab: int) -> dict[str, Any]:
    """SmolLM2's tokenizer keys, its vocabulary padded or cut to `vocab` tokens (module doc)."""
    from fuel.io.gguf import bundled_gguf, open_gguf

    md = open_gguf(bundled_gguf("smollm2")).metadata
    tokens = [str(t) for t in md["tokenizer.ggml.tokens"]]
    types = [int(t) for t in md["tokenizer.ggml.token_type"]]
    merges = [str(m) for m in md["tokenizer.ggml.merges"]]
    if vocab < len(tokens):
        tokens, types = tokens[:vocab], types[:vocab]
        kept = set(tokens)
        merges = [m for m in merges if m.replace(" ", "") in kept]
    else:
        pad = range(len(tokens), vocab)
        tokens, types = tokens + [f"[PAD{i}]" for i in pad], types + [1] * len(pad)
    return {"tokens": tokens, "types": types, "merges": merges, "pre": str(md["tokenizer.ggml.pre"]),
            "bos": int(md["tokenizer.ggml.bos_token_id"]), "eos": int(md["tokenizer.ggml.eos_token_id"]),
            "unk": int(md["tokenizer.ggml.unknown_token_id"]), "pad": int(md["tokenizer.ggml.padding_token_id"]),
            "template": str(md["tokenizer.chat_template"])}


def content_key(spec: Spec) -> str:
    """A hash of everything that decides the file's bytes: the spec, the recipe, the scale and gguf-py."""
    what = {"spec": asdict(spec), "recipe": RECIPE_VERSION, "weight_size": WEIGHT_SIZE,
            "gguf": getattr(gguf, "__version__", "?")}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]


def file_path(spec: Spec, folder: Path | None = None) -> Path:
    return (folder or DEFAULT_FOLDER) / f"{spec.name}-q4_k_m-{content_key(spec)}.gguf"


def write(spec: Spec, path: Path) -> Path:
    """Write the model `spec` at `path` (through a temporary file, renamed when complete)."""
    arch = spec.arch
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    # Not the spec's name: llama.cpp gives a model named like "phi3" Phi-3's token attributes, which need
    # Phi-3's own "<s>", "</s>" and "<unk>" tokens.
    w.add_name(f"fuel bench synthetic model, {parameter_count(spec) / 1e9:.2f}B random parameters")
    w.add_context_length(spec.context)
    w.add_embedding_length(spec.hidden)
    w.add_block_count(spec.layers)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(spec.kv_heads)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_rope_freq_base(spec.rope_base)
    w.add_layer_norm_rms_eps(spec.eps)
    if spec.window:
        w.add_sliding_window(spec.window)
    w.add_vocab_size(spec.vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    tok = tokenizer_metadata(spec.vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(tok["bos"])
    w.add_eos_token_id(tok["eos"])
    w.add_unk_token_id(tok["unk"])
    w.add_pad_token_id(tok["pad"])
    w.add_add_bos_token(False)
    w.add_chat_template(tok["template"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    rng = np.random.default_rng(spec.seed)
    for name, shape in tensor_shapes(spec).items():
        if len(shape) == 1:
            base = 1.0 if name.endswith("norm.weight") else 0.0
            w.add_tensor(name, (base + 0.02 * rng.standard_normal(shape)).astype(np.float32))
            continue
        layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
        qt = block_type(name, shape[1], layer, spec)
        w.add_tensor(name, random_blocks(rng, qt, *shape), raw_dtype=gguf.GGMLQuantizationType[qt.ggml_name])
    path.parent.mkdir(parents=True, exist_ok=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)
    return path


def ensure(spec: Spec, folder: Path | None = None) -> Path:
    """The model's file in `folder` (default ~/.cache/fuel-bench), written the first time only. Writing it
    removes the files an older spec or recipe of the same name left there."""
    path = file_path(spec, folder)
    if not path.exists():
        print(f"writing {path} ({parameter_count(spec) / 1e9:.2f}B random parameters, once) ...", flush=True)
        write(spec, path)
        for old in path.parent.glob(f"{spec.name}-q4_k_m-*.gguf"):
            if old != path:
                old.unlink()
    return path
