"""The decoder's architecture table and what `LlamaConfig.from_gguf` / `LlamaModel` read from a file of each
architecture: the per-arch hyper-parameters (head_dim, window layers, softcaps, query scale, rope factors) and
each refusal's message. The math itself is checked against transformers in tests/models/test_arch_oracle.py;
these are the fast unit checks of parsing, with small files written here by gguf-py's writer."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from fuel.io.gguf import GGUFKeyError, open_gguf
from fuel.models import llama_weights
from fuel.models.architectures import ARCHITECTURES, ArchSpec
from fuel.models.llama import LlamaModel, ModelError
from fuel.models.llama_weights import LlamaConfig, rope_factors
from fuel.testing.arch_files import ARCH_FILES, LONGROPE, llama3_rope_factors, write_arch_gguf

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 32, 4, 2, 8, 48, 40


def tiny_gguf(path: Path, arch: str, kv: dict[str, Any] | None = None, extra: dict[str, np.ndarray] | None = None,
              drop: tuple[str, ...] = ()) -> Path:
    """A 2-layer float32 decoder file of `arch` with the tensors its spec reads, plus `kv` metadata (keys
    without the arch prefix) and `extra` tensors, less the `drop`ped tensor names."""
    spec = ARCHITECTURES[arch]
    w = gguf.GGUFWriter(str(path), arch)
    meta: dict[str, Any] = {"block_count": 2, "context_length": 64, "embedding_length": HIDDEN,
                            "feed_forward_length": FFN, "attention.head_count": HEADS,
                            "attention.head_count_kv": KV_HEADS, "attention.layer_norm_rms_epsilon": 1e-6}
    for key, value in {**meta, **(kv or {})}.items():
        name = f"{arch}.{key}"
        if isinstance(value, str):
            w.add_string(name, value)
        elif isinstance(value, int):
            w.add_uint32(name, value)
        else:
            w.add_float32(name, float(value))
    q, k = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(2):
        layer = {"attn_norm.weight": (HIDDEN,), "attn_output.weight": (HIDDEN, q), "ffn_norm.weight": (HIDDEN,),
                 "ffn_down.weight": (HIDDEN, FFN)}
        if spec.fused_qkv:
            layer["attn_qkv.weight"] = (q + 2 * k, HIDDEN)
        else:
            layer |= {"attn_q.weight": (q, HIDDEN), "attn_k.weight": (k, HIDDEN), "attn_v.weight": (k, HIDDEN)}
        layer |= {"ffn_up.weight": (2 * FFN, HIDDEN)} if spec.fused_gate_up else {
            "ffn_gate.weight": (FFN, HIDDEN), "ffn_up.weight": (FFN, HIDDEN)}
        if spec.qkv_bias:
            layer |= {"attn_q.bias": (q,), "attn_k.bias": (k,), "attn_v.bias": (k,)}
        if spec.qk_norm:
            layer |= {"attn_q_norm.weight": (HEAD_DIM,), "attn_k_norm.weight": (HEAD_DIM,)}
        if spec.post_norms:
            layer |= {"post_attention_norm.weight": (HIDDEN,), "post_ffw_norm.weight": (HIDDEN,)}
        shapes |= {f"blk.{i}.{n}": s for n, s in layer.items()}
    rng = np.random.default_rng(0)
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()} | (extra or {})
    for name, a in tensors.items():
        if name not in drop:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def config(tmp_path: Path, arch: str, **kw: Any) -> LlamaConfig:
    return LlamaConfig.from_gguf(open_gguf(tiny_gguf(tmp_path / f"{arch}.gguf", arch, **kw)))


def test_every_architecture_has_a_spec() -> None:
    assert set(ARCHITECTURES) == {"llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"}
    assert all(isinstance(s, ArchSpec) and s.name == n for n, s in ARCHITECTURES.items())
    assert (*ARCHITECTURES, "mamba") == llama_weights.ARCHITECTURES
    assert {a.arch for a in ARCH_FILES.values()} <= set(ARCHITECTURES)  # the oracle's files are all ours


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_each_architecture_loads_its_tensors(tmp_path: Path, arch: str) -> None:
    """A file with exactly the tensors its spec names loads; each such tensor missing is named."""
    model = LlamaModel(open_gguf(tiny_gguf(tmp_path / "m.gguf", arch)), 16)
    assert model.cfg.spec is ARCHITECTURES[arch] and model.cfg.head_dim == HEAD_DIM
    assert set(model.layers[0]["qkv"].parts()) == {"q", "k", "v"}
    assert set(model.layers[0]["gate_up"].parts()) == {"gate", "up"}
    name = "blk.1.attn_qkv.weight" if ARCHITECTURES[arch].fused_qkv else "blk.1.attn_k.weight"
    with pytest.raises(GGUFKeyError, match=name):
        LlamaModel(open_gguf(tiny_gguf(tmp_path / "d.gguf", arch, drop=(name,))), 16)


def test_phi3_fused_projections_split_gate_first(tmp_path: Path) -> None:
    """Phi-3's `attn_qkv` is q|k|v rows and its `ffn_up` gate|up rows: each part is its own rows of the file."""
    f = open_gguf(tiny_gguf(tmp_path / "p.gguf", "phi3"))
    parts = LlamaModel(f, 16).layers[0]
    qkv, gate_up = f["blk.0.attn_qkv.weight"].array(), f["blk.0.ffn_up.weight"].array()
    q, k = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    want = {"q": qkv[:q], "k": qkv[q:q + k], "v": qkv[q + k:], "gate": gate_up[:FFN], "up": gate_up[FFN:]}
    got = parts["qkv"].parts() | parts["gate_up"].parts()
    for name, rows in want.items():
        np.testing.assert_array_equal(got[name].dense.T, rows, err_msg=name)


def test_qwen2_reads_biases_and_gemma2_its_caps_and_scale(tmp_path: Path) -> None:
    f = open_gguf(tiny_gguf(tmp_path / "q.gguf", "qwen2"))
    bias = LlamaModel(f, 16).layers[1]["bias"]
    np.testing.assert_array_equal(bias["k"], f["blk.1.attn_k.bias"].array())
    np.testing.assert_array_equal(bias["q+k"], np.concatenate([f["blk.1.attn_q.bias"].array(),
                                                               f["blk.1.attn_k.bias"].array()]))
    cfg = config(tmp_path, "gemma2", kv={"attn_logit_softcapping": 4.0, "final_logit_softcapping": 15.0,
                                         "attention.scale": 0.125, "attention.sliding_window": 16})
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.attn_scale) == (4.0, 15.0, 0.125)
    assert [cfg.window_left(i) for i in range(4)] == [15, None, 15, None]  # even layers local, as transformers
    plain = config(tmp_path, "gemma2")  # llama.cpp's defaults when the file has no caps or scale
    assert (plain.attn_softcap, plain.final_softcap, plain.attn_scale) == (50.0, 30.0, 1 / math.sqrt(HEAD_DIM))
    assert plain.window_left(0) is None
    assert config(tmp_path, "llama").attn_softcap is None


@pytest.mark.parametrize(("arch", "window", "want"), [
    ("llama", 16, [15, 15]), ("llama", None, [None, None]), ("phi3", 8, [7, 7]), ("phi3", 0, [None, None]),
    ("qwen2", 16, [None, None]), ("gemma3", 4, [3, 3])])
def test_window_layers(tmp_path: Path, arch: str, window: int | None, want: list[int | None]) -> None:
    """Mistral (llama with a window) and Phi-3 window every layer (Phi-3's 0: none); qwen2 does not read it."""
    kv = {} if window is None else {"attention.sliding_window": window}
    assert [config(tmp_path, arch, kv=kv).window_left(i) for i in range(2)] == want


def test_qwen3_head_dim_from_key_length(tmp_path: Path) -> None:
    """`attention.key_length` is the head_dim even where it is not hidden / heads (Qwen3)."""
    cfg = config(tmp_path, "qwen3", kv={"attention.key_length": HEAD_DIM, "embedding_length": 2 * HIDDEN},
                 extra={"token_embd.weight": np.zeros((VOCAB, 2 * HIDDEN), np.float32)})
    assert (cfg.head_dim, cfg.hidden, cfg.attn_scale) == (HEAD_DIM, 2 * HIDDEN, 1 / math.sqrt(HEAD_DIM))


def _angles(cos: np.ndarray, sin: np.ndarray, scale: float = 1.0) -> np.ndarray:
    return np.arctan2(sin / scale, cos / scale)[:, :cos.shape[1] // 2]


def test_llama3_rope_freqs_divide_each_frequency(tmp_path: Path) -> None:
    """Llama 3's `rope_freqs.weight`: angle = pos · base^(-2i/d) / factor_i, from transformers' llama3 rule."""
    path = write_arch_gguf(tmp_path / "l3.gguf", "llama3")
    a = ARCH_FILES["llama3"]
    model = LlamaModel.load(path, 64)
    pos = np.arange(64, dtype=np.float64)[:, None]
    inv = a.rope_base ** (-np.arange(0, a.head_dim, 2) / a.head_dim) / llama3_rope_factors(a.rope, a.rope_base,
                                                                                            a.head_dim)
    want = np.angle(np.exp(1j * pos * inv))
    np.testing.assert_allclose(_angles(*model.rope["global"]), want, atol=2e-6)
    assert np.abs(want - np.angle(np.exp(1j * pos * inv * llama3_rope_factors(a.rope, a.rope_base,
                                                                             a.head_dim)))).max() > 0.1


@pytest.mark.parametrize(("capacity", "which"), [(32, "short_factor"), (33, "long_factor")])
def test_phi3_longrope_factors_by_capacity(tmp_path: Path, capacity: int, which: str) -> None:
    """LongRoPE: the long factors when the capacity exceeds `rope.scaling.original_context_length` (32),
    as llama.cpp picks them; cos/sin scaled by the file's attn_factor √(1 + ln(128/32)/ln 32)."""
    f = open_gguf(write_arch_gguf(tmp_path / "p.gguf", "phi3_longrope"))
    cfg = LlamaConfig.from_gguf(f)
    factors, scale = rope_factors(f, cfg, capacity)
    assert factors is not None
    np.testing.assert_allclose(factors, LONGROPE[which], rtol=1e-6)
    assert scale == pytest.approx(math.sqrt(1 + math.log(128 / 32) / math.log(32)), rel=1e-6)


Refusal = tuple[str, dict[str, Any], dict[str, np.ndarray], str]
REFUSALS: list[Refusal] = [
    ("qwen2", {"rope.scaling.type": "yarn"}, {}, r"qwen2\.rope\.scaling\.type = 'yarn' is not supported by qwen2"),
    ("llama", {"rope.dimension_count": HEAD_DIM // 2}, {}, r"llama\.rope\.dimension_count = 4 .*whole head_dim 8"),
    ("llama", {"attention.value_length": 16}, {}, r"llama\.attention\.value_length = 16"),
    ("gemma2", {"attn_logit_softcapping": -1.0}, {}, r"gemma2\.attn_logit_softcapping must be a positive"),
    ("llama", {}, {"blk.0.attn_output.bias": np.zeros(HIDDEN, np.float32)}, r"'blk\.0\.attn_output\.bias' is not read"),
    ("qwen3", {}, {"blk.1.attn_q.bias": np.zeros(HEADS * HEAD_DIM, np.float32)}, r"'blk\.1\.attn_q\.bias' is not read"),
    ("qwen2", {}, {"rope_freqs.weight": np.ones(HEAD_DIM // 2, np.float32)},
     r"'rope_freqs\.weight' \(rope factors\) is not supported by qwen2"),
    ("llama", {}, {"rope_freqs.weight": np.ones(3, np.float32)}, r"rope factors have 3 values, expected head_dim / 2"),
    ("phi3", {}, {"rope_factors_long.weight": np.ones(4, np.float32), "rope_factors_short.weight":
                  np.ones(4, np.float32)}, r"LongRoPE factors need metadata phi3\.rope\.scaling\.original_context"),
    ("phi3", {}, {"blk.0.attn_qkv.weight": np.zeros((HEADS * HEAD_DIM, HIDDEN), np.float32)},
     r"fused projection has 32 rows, expected 32 \+ 16 \+ 16 \(q, k, v\)"),
]


@pytest.mark.parametrize(("arch", "kv", "extra", "match"), REFUSALS, ids=[r[3][:40] for r in REFUSALS])
def test_refusals_name_the_key_and_the_value(tmp_path: Path, arch: str, kv: dict[str, Any],
                                             extra: dict[str, np.ndarray], match: str) -> None:
    with pytest.raises(ModelError, match=match):
        LlamaModel(open_gguf(tiny_gguf(tmp_path / "bad.gguf", arch, kv=kv, extra=extra)), 16)


def test_unknown_architecture_lists_the_supported(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((VOCAB, HIDDEN), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match="'falcon' is not supported by the decoder; supported: llama, qwen2, qwen3, "
                                         "phi3, gemma2, gemma3"):
        LlamaModel.load(tmp_path / "falcon.gguf", 16)


def test_gemma3_linear_rope_scaling_on_global_layers_only(tmp_path: Path) -> None:
    """Gemma 3's `rope.scaling.type` linear (its 4B+ files): the global layers' angles are pos · inv_freq / factor
    (transformers' linear rope), the window layers keep their own base unscaled."""
    f = tiny_gguf(tmp_path / "g.gguf", "gemma3", kv={"rope.scaling.type": "linear", "rope.scaling.factor": 8.0,
                                                     "rope.freq_base": 1e6, "attention.sliding_window": 4})
    model = LlamaModel(open_gguf(f), 16)
    pos = np.arange(16, dtype=np.float64)[:, None]
    for table, base, factor in (("global", 1e6, 8.0), ("local", 1e4, 1.0)):
        inv = base ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM) / factor
        np.testing.assert_allclose(_angles(*model.rope[table]), np.angle(np.exp(1j * pos * inv)), atol=2e-6,
                                   err_msg=table)
    assert [model.cfg.rope_name(i) for i in range(2)] == ["local", "local"]


def test_a_config_built_by_hand_takes_its_architectures_spec() -> None:
    """`LlamaConfig(arch=...)` without a spec (as fuel.lora's tests build one) gets its architecture's."""
    fields: dict[str, Any] = dict(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=48, eps=1e-5,
                                  rope_base=1e4, vocab=64, context_length=64)
    assert LlamaConfig(arch="qwen3", **fields).spec is ARCHITECTURES["qwen3"]
    with pytest.raises(ModelError, match="architecture 'falcon' is not one of llama, qwen2"):
        LlamaConfig(arch="falcon", **fields)
