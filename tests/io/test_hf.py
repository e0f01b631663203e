"""fuel.io.hf: a Hugging Face directory presented as the llama.cpp GGUF file of the same model.

Oracles: the `gguf` package's own HF -> GGUF name map (llama.cpp's `TensorNameMap`); transformers reading
back a GGUF file written from the directory as presented (`from_pretrained(gguf_file=...)` undoes the
converter's permutation, +1 and -exp and must give back the saved weights); transformers' rope parameter
functions for the synthesised Llama-3 and LongRoPE factors, from configs in either format; torch's saved
tensors for the dtypes; the Q8_0 block bound for `quantize`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from fuel.errors import FuelError, ParamError
from fuel.io.gguf import GGUFFile
from fuel.io.hf import HFError, HFModelDir, _permute, open_source
from fuel.io.hf_config import llama3_factors
from fuel.testing.llama_files import tiny_llama_gguf
from tests.models.hf_dirs import CONFIGS, hf_model, save_dir

ARCHS = tuple(CONFIGS)
GGUF_ARCH = {"llama": "LLAMA", "mistral": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "phi3": "PHI3",
             "gemma2": "GEMMA2", "gemma3": "GEMMA3", "mamba": "MAMBA"}


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    return {a: hf_model(a) for a in ARCHS}


@pytest.fixture(scope="module")
def dirs(models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {a: save_dir(m, root / a) for a, m in models.items()}


def _copy_dir(src: Path, dst: Path, config: dict[str, Any] | None = None,
              tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A copy of directory `src` with its config.json and/or its one safetensors file replaced."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config if config is not None else cfg))
    save_file(tensors if tensors is not None else load_file(src / "model.safetensors"), dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("arch", ARCHS)
def test_names_are_llama_cpp_names(arch: str, models: dict[str, Any], dirs: dict[str, Path]) -> None:
    src = open_source(dirs[arch])
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, GGUF_ARCH[arch]), 2)
    want = set()
    for hf_name in models[arch].state_dict():
        if hf_name == "lm_head.weight" and models[arch].config.tie_word_embeddings:
            continue  # tied: the model reads token_embd.weight
        base, _, suffix = hf_name.rpartition(".")
        mapped = names.get_name(base) if suffix in ("weight", "bias") else names.get_name(hf_name)
        assert mapped is not None, hf_name
        want.add(f"{mapped}.{suffix}" if suffix in ("weight", "bias") else mapped)
    made = {"llama": {"rope_freqs.weight"}, "phi3": {"rope_factors_long.weight", "rope_factors_short.weight"}}
    assert set(src.names()) == want | made.get(arch, set())


def _write_gguf(src: HFModelDir, path: Path) -> Path:
    """The source as a GGUF file, through gguf's writer (general.name left out: transformers reads a model
    type from it)."""
    w = gguf.GGUFWriter(str(path), src.architecture)
    for k, v in src.metadata.items():
        if k in ("general.architecture", "general.name"):
            continue
        add = (w.add_bool if isinstance(v, bool) else w.add_uint32 if isinstance(v, int)
               else w.add_float32 if isinstance(v, float) else w.add_string)
        add(k, v)
    for t in src:
        if t.is_quantized or t.type_name == "BF16":
            w.add_tensor(t.name, t.raw().reshape(t.shape[0], -1), raw_dtype=gguf.GGMLQuantizationType[t.type_name])
        else:
            w.add_tensor(t.name, np.ascontiguousarray(t.array()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_reads_the_presented_file_back(arch: str, models: dict[str, Any], dirs: dict[str, Path],
                                                    tmp_path: Path) -> None:
    """Names, permutation, norms' +1, -exp(A_log), conv squeeze and the shape metadata, all at once: the
    presented file, read by transformers' GGUF loader, holds the saved weights."""
    src = open_source(dirs[arch])
    path = _write_gguf(src, tmp_path / "m.gguf")
    extra: dict[str, Any] = {"head_dim": 32} if arch == "qwen3" else {"pad_token_id": 0} if arch == "phi3" else {}
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32, **extra)
    want, got = models[arch].state_dict(), back.state_dict()
    assert set(got) == set(want)
    for name, w in want.items():  # A_log went through -exp and back: a few float32 roundings
        torch.testing.assert_close(got[name], w, rtol=1e-6, atol=3e-7 if name.endswith("A_log") else 1e-7, msg=name)


def test_sharded_index(models: dict[str, Any], dirs: dict[str, Path], tmp_path: Path) -> None:
    sharded = save_dir(models["qwen2"], tmp_path / "sharded", max_shard_size="60KB")
    assert len(list(sharded.glob("*.safetensors"))) > 2 and (sharded / "model.safetensors.index.json").is_file()
    one, many = open_source(dirs["qwen2"]), open_source(sharded)
    assert sorted(one.names()) == sorted(many.names())
    for name in one.names():
        np.testing.assert_array_equal(many[name].array(), one[name].array())
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    moved = next(iter(index["weight_map"]))
    index["weight_map"][moved] = "elsewhere.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HFError, match=r"elsewhere\.safetensors"):
        open_source(sharded)


def test_missing_and_unexpected_tensors(dirs: dict[str, Path], tmp_path: Path) -> None:
    tensors = load_file(dirs["llama"] / "model.safetensors")
    gone = "model.layers.1.self_attn.k_proj.weight"
    broken = _copy_dir(dirs["llama"], tmp_path / "missing", tensors={k: v for k, v in tensors.items() if k != gone})
    with pytest.raises(HFError, match=rf"no tensor '{gone}' \(GGUF 'blk.1.attn_k.weight'\)"):
        open_source(broken)
    extra = _copy_dir(dirs["llama"], tmp_path / "extra", tensors={**tensors, "model.layers.0.self_attn.q_proj.bias":
                                                                  np.zeros(64, np.float32)})
    with pytest.raises(HFError, match=r"unexpected tensor 'model.layers.0.self_attn.q_proj.bias' in .*safetensors"):
        open_source(extra)
    layer = {**tensors, "model.layers.2.input_layernorm.weight": np.ones(64, np.float32)}
    with pytest.raises(HFError, match=r"model.layers.2.input_layernorm.weight.*the config has 2 layers"):
        open_source(_copy_dir(dirs["llama"], tmp_path / "layer", tensors=layer))


def _old_format(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers 4's config.json of the same model: rope_theta, rope_scaling, rope_local_base_freq."""
    old = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "layer_types")}
    rp = dict(cfg["rope_parameters"])
    if "full_attention" in rp:
        old["rope_theta"] = rp["full_attention"]["rope_theta"]
        old["rope_local_base_freq"] = rp["sliding_attention"]["rope_theta"]
        return old
    old["rope_theta"] = rp.pop("rope_theta")
    if rp.get("rope_type", "default") != "default":
        old["rope_scaling"] = {("type" if "factor" in rp else "rope_type"): rp.pop("rope_type"), **rp}
    return old


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma3", "qwen3"])
def test_both_config_formats_agree_with_transformers(arch: str, dirs: dict[str, Path], tmp_path: Path) -> None:
    cfg = json.loads((dirs[arch] / "config.json").read_text())
    old = _copy_dir(dirs[arch], tmp_path / "old", config=_old_format(cfg))
    assert "rope_parameters" not in json.loads((old / "config.json").read_text())
    for d in (dirs[arch], old):
        src, hf_cfg = open_source(d), AutoConfig.from_pretrained(str(d))
        md = src.metadata
        params = hf_cfg.rope_parameters
        if arch == "gemma3":
            assert md["gemma3.rope.freq_base"] == params["full_attention"]["rope_theta"]
            assert md["gemma3.rope.freq_base_swa"] == params["sliding_attention"]["rope_theta"]
            continue
        assert md[f"{src.architecture}.rope.freq_base"] == params["rope_theta"]
        head_dim = md[f"{src.architecture}.attention.key_length"]
        base_inv = 1.0 / params["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
        if arch == "llama":       # angle = pos * inv_freq / rope_freqs
            inv, scale = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, None)
            np.testing.assert_allclose(base_inv / src["rope_freqs.weight"].array(), inv.numpy(), rtol=1e-6)
        elif arch == "phi3":      # short factors below the original context, cos/sin times attn_factor
            inv, scale = ROPE_INIT_FUNCTIONS["longrope"](hf_cfg, None)
            np.testing.assert_allclose(base_inv / src["rope_factors_short.weight"].array(), inv.numpy(), rtol=1e-6)
            inv_long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf_cfg, None, seq_len=65)
            np.testing.assert_allclose(base_inv / src["rope_factors_long.weight"].array(), inv_long.numpy(),
                                       rtol=1e-6)
            assert md["phi3.rope.scaling.attn_factor"] == pytest.approx(scale, rel=1e-12)
            assert md["phi3.rope.scaling.original_context_length"] == 64
        else:
            assert "rope_freqs.weight" not in src and f"{arch}.rope.scaling.type" not in md


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtypes_are_kept(dtype: torch.dtype, models: dict[str, Any], tmp_path: Path) -> None:
    d = save_dir(models["gemma2"], tmp_path / "m", dtype=dtype)
    src = open_source(d)
    want = {k: v.to(dtype) for k, v in models["gemma2"].state_dict().items()}
    q = src["blk.0.attn_q.weight"]
    assert q.type_name == {torch.bfloat16: "BF16", torch.float16: "F16"}[dtype]
    got = torch.from_numpy(q.array().view(np.int16).copy()).view(dtype)
    assert torch.equal(got, want["model.layers.0.self_attn.q_proj.weight"])  # bit for bit
    norm = src["blk.1.ffn_norm.weight"]   # 1-D: float32, 1 + w computed in float32 as Gemma's forward does
    assert norm.type_name == "F32"
    np.testing.assert_array_equal(norm.array(), 1 + want["model.layers.1.pre_feedforward_layernorm.weight"]
                                  .float().numpy())


def test_quantize_q8_0(dirs: dict[str, Path]) -> None:
    src = open_source(dirs["llama"], quantize="q8_0")
    plain = open_source(dirs["llama"])
    for name in plain.names():
        t, p = src[name], plain[name]
        if (name.startswith("blk.") and p.ndim == 2) or name == "output.weight":
            assert t.type_name == "Q8_0", name
            w = p.array().astype(np.float32).reshape(p.shape[0], -1, 32)
            # half a step per block, plus the step's own rounding to float16 (127 steps of relative 2^-11)
            bound = np.abs(w).max(axis=2, keepdims=True) / 127 * (0.5 + 127 * 2.0**-11)
            assert np.all(np.abs(t.dequantize().reshape(w.shape) - w) <= bound + 1e-12), name
        else:
            assert t.type_name == "F32" and not t.is_quantized, name


@pytest.mark.parametrize("bad", ["q4_k", "Q8_0", "", 8])
def test_quantize_refuses_other_values(bad: Any, dirs: dict[str, Path]) -> None:
    with pytest.raises(ParamError, match=rf"quantize must be None or one of q8_0, got {bad!r}".replace("(", r"\(")):
        open_source(dirs["llama"], quantize=bad)


def test_open_source_kinds(tmp_path: Path, dirs: dict[str, Path]) -> None:
    path = tiny_llama_gguf(tmp_path / "tiny.gguf")
    assert isinstance(open_source(path), GGUFFile)
    with pytest.raises(ParamError, match="GGUF file"):
        open_source(path, quantize="q8_0")
    assert isinstance(open_source(dirs["gemma3"]), HFModelDir)
    (tmp_path / "empty").mkdir()
    with pytest.raises(HFError, match=r"empty is a directory without config.json"):
        open_source(tmp_path / "empty")
    with pytest.raises(HFError, match=r"nowhere is not there; expected a .gguf file or a Hugging Face"):
        open_source(tmp_path / "nowhere")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(HFError, match=r"notes.txt is a file without the .gguf suffix"):
        open_source(tmp_path / "notes.txt")


@pytest.mark.parametrize("arch, change, match", [
    ("llama", {"model_type": "gpt2"}, r"model_type 'gpt2' is not supported"),
    ("qwen2", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     r"rope type = 'yarn' is not supported: qwen2 supports default"),
    ("qwen2", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
     r"layer_types = \['sliding_attention', 'full_attention'\] is not supported"),
    ("gemma2", {"final_logit_softcapping": None}, r"softcapping = \(5.0, None\) is not supported"),
    ("gemma3", {"final_logit_softcapping": 30.0}, r"gemma3 applies no softcap"),
    ("llama", {"hidden_act": "gelu"}, r"hidden_act = 'gelu' is not supported: llama runs silu"),
    ("llama", {"num_attention_heads": None}, r"has no 'num_attention_heads'"),
    ("llama", {"head_dim": 15}, r"head_dim = 15 is not supported: rope rotates pairs"),
])
def test_config_refusals(arch: str, change: dict[str, Any], match: str, dirs: dict[str, Path],
                         tmp_path: Path) -> None:
    cfg = {**json.loads((dirs[arch] / "config.json").read_text()), **change}
    with pytest.raises(FuelError, match=match):
        open_source(_copy_dir(dirs[arch], tmp_path / "m", config=cfg))


@pytest.mark.parametrize("arch, change, match", [
    ("llama", {"num_attention_heads": 8}, r"'model.layers.0.self_attn.o_proj.weight' has shape \[64, 64\]; "
                                          r"config.json gives \[64, 128\] \(hidden 64, q 128\)"),
    ("llama", {"intermediate_size": 256}, r"'model.layers.0.mlp.down_proj.weight' has shape \[64, 128\]"),
    ("qwen2", {"vocab_size": 1024}, r"'model.embed_tokens.weight' has shape \[512, 64\]; config.json gives "
                                    r"\[1024, 64\]"),
    ("phi3", {"num_key_value_heads": 4}, r"'model.layers.0.self_attn.qkv_proj.weight' has shape \[128, 64\]; "
                                         r"config.json gives \[192, 64\] \(qkv 192, hidden 64\)"),
    ("mamba", {"state_size": 16}, r"'backbone.layers.0.mixer.A_log' has shape \[128, 8\]"),
    ("mamba", {"conv_kernel": 3}, r"'backbone.layers.0.mixer.conv1d.weight' has shape \[128, 1, 4\]; config.json "
                                  r"gives \[128, 3\]"),
])
def test_shapes_against_the_config(arch: str, change: dict[str, Any], match: str, dirs: dict[str, Path],
                                   tmp_path: Path) -> None:
    cfg = {**json.loads((dirs[arch] / "config.json").read_text()), **change}
    with pytest.raises(HFError, match=match):
        open_source(_copy_dir(dirs[arch], tmp_path / "m", config=cfg))


def test_bad_safetensors_file(dirs: dict[str, Path], tmp_path: Path) -> None:
    d = _copy_dir(dirs["llama"], tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(HFError, match=r"not a safetensors file that can be read: .*JSON"):
        open_source(d)
    save_file({"model.embed_tokens.weight": np.zeros((2, 2), np.int32)}, d / "model.safetensors")
    with pytest.raises(HFError, match=r"'model.embed_tokens.weight' has dtype I32; read are F32, F16, BF16"):
        open_source(d)


def test_mamba_values(models: dict[str, Any], dirs: dict[str, Path]) -> None:
    """What the Mamba model reads, against the transformers model's own tensors."""
    src, sd = open_source(dirs["mamba"]), models["mamba"].state_dict()
    p = "backbone.layers.1.mixer."
    np.testing.assert_array_equal(src["blk.1.ssm_a"].array(), -np.exp(sd[p + "A_log"].numpy()))
    np.testing.assert_array_equal(src["blk.1.ssm_conv1d.weight"].array(), sd[p + "conv1d.weight"].numpy()[:, 0])
    np.testing.assert_array_equal(src["blk.1.ssm_d"].array(), sd[p + "D"].numpy())
    cfg = models["mamba"].config
    assert src.hparam("ssm.time_step_rank") == cfg.time_step_rank
    assert src.hparam("ssm.inner_size") == cfg.intermediate_size
    assert src.hparam("ssm.state_size") == cfg.state_size and src.hparam("ssm.conv_kernel") == cfg.conv_kernel
    assert "output.weight" not in src and math.isclose(src.hparam("attention.layer_norm_rms_epsilon"),
                                                       cfg.layer_norm_epsilon)


@settings(max_examples=40)
@given(heads=st.integers(1, 8), half=st.integers(1, 12), k=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_permutation_is_undone_by_transformers(heads: int, half: int, k: int, seed: int) -> None:
    """The converter's Q/K row order over any head count and size: transformers' GGUF reader undoes it."""
    w = np.random.default_rng(seed).standard_normal((heads * 2 * half, k)).astype(np.float32)
    back = LlamaTensorProcessor()._reverse_permute_weights(_permute(w, heads), heads, heads)
    np.testing.assert_array_equal(back, w)


@settings(max_examples=40)
@given(half=st.integers(2, 64), theta=st.floats(1e3, 1e6), factor=st.floats(1.5, 64), low=st.floats(0.5, 2),
       ratio=st.floats(1.5, 8), orig=st.integers(64, 16384))
def test_llama3_factors_match_transformers(half: int, theta: float, factor: float, low: float, ratio: float,
                                           orig: int) -> None:
    """rope_freqs.weight divides each frequency as transformers' llama3 rope scales it, over any parameters."""
    params = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
              "high_freq_factor": low * ratio, "original_max_position_embeddings": orig}
    head_dim = 2 * half
    cfg = LlamaConfig(hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim, rope_parameters=params)
    inv, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, None)
    base_inv = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    # transformers computes in float32: its pow over a base up to 1e6 and the smooth band's blend round to a few
    # 1e-6, up to 2.3e-5 at the band's edges (measured over 20 000 random draws); a wrong rule moves it by O(1)
    np.testing.assert_allclose(base_inv / llama3_factors(params, head_dim), inv.numpy(), rtol=1e-4)
