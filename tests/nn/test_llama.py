"""fuel.nn.llama's structure against transformers: the same parameter names and shapes as LlamaForCausalLM,
the config's round trip through transformers.LlamaConfig, rope tables against LlamaRotaryEmbedding, tied
embeddings, and clear errors. The numerics against transformers are in test_llama_parity.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import fuel as fl
from fuel import nn
from fuel.nn.llama import Llama, LlamaConfig, rope_tables

SMALL = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40, hidden_dim=48, max_seq_len=64)


def hf_model(cfg: LlamaConfig) -> transformers.LlamaForCausalLM:
    hf = transformers.LlamaConfig(**cfg.to_hf())
    hf._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(hf)


@pytest.mark.parametrize("tie", [False, True])
def test_names_and_shapes_are_transformers(tie: bool) -> None:
    cfg = LlamaConfig(**{**SMALL.__dict__, "tie_embeddings": tie})
    model, ref = Llama(cfg), hf_model(cfg)
    ours = {k: t.shape for k, t in nn.get_state_dict(model).items()}
    theirs = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert ours == theirs
    assert nn.get_state_dict(model)["model.layers.1.mlp.up_proj.weight"] is model.model.layers[1].mlp.up_proj.weight
    params = nn.get_parameters(model)
    assert sum(p.size for p in params) == sum(p.numel() for p in ref.parameters())  # tied: counted once
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie


def test_initialisation_is_transformers() -> None:
    """N(0, 0.02) for every projection and the embedding, ones for the norms (transformers' _init_weights)."""
    big = LlamaConfig(dim=128, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=512, hidden_dim=256)
    sd = nn.get_state_dict(Llama(big, seed=1))
    for k, t in sd.items():
        a = t.numpy()
        if "norm" in k:
            np.testing.assert_array_equal(a, np.ones_like(a))
        else:
            assert abs(float(a.std()) - 0.02) < 2e-3 and abs(float(a.mean())) < 2e-3, k
    again = nn.get_state_dict(Llama(big, seed=1))
    assert all(np.array_equal(sd[k].numpy(), again[k].numpy()) for k in sd)


def test_config_round_trips_through_transformers() -> None:
    cfg = LlamaConfig(dim=48, n_layers=3, n_heads=6, n_kv_heads=2, vocab_size=100, hidden_dim=96, max_seq_len=128,
                      rope_theta=50000.0, norm_eps=1e-6, tie_embeddings=True)
    hf = transformers.LlamaConfig(**cfg.to_hf())
    assert LlamaConfig.from_hf(hf.to_dict()) == cfg
    assert hf.head_dim == 8 and hf.to_dict()["rope_parameters"]["rope_theta"] == 50000.0


@pytest.mark.parametrize(("theta", "head_dim"), [(10000.0, 8), (10000.0, 48), (500000.0, 64)])
def test_rope_tables_are_llama_rotary_embedding(theta: float, head_dim: int) -> None:
    """Within torch's own f32 rounding: inv_freq may differ by an ulp where torch's pow does, which moves
    position p's angle by p ulps of inv_freq; cos and sin by an ulp of f32."""
    n = 256
    cfg = LlamaConfig(dim=head_dim * 2, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=8, hidden_dim=8,
                      max_seq_len=n, rope_theta=theta)
    rot = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(transformers.LlamaConfig(**cfg.to_hf()))
    tc, ts = rot(torch.zeros(1, dtype=torch.float32), torch.arange(n)[None])
    cos, sin = rope_tables(theta, head_dim, n)
    pos = np.arange(n, dtype=np.float64)[:, None]
    allowed = pos * 2.0 ** -23 + 2.0 ** -23  # angle |θ| ≤ p, one ulp of inv_freq ≤ 2^-23·inv_freq ≤ 2^-23
    assert np.all(np.abs(cos - tc[0].numpy()) <= allowed)
    assert np.all(np.abs(sin - ts[0].numpy()) <= allowed)
    assert not cos.flags.writeable


def test_rope_tables_follow_the_model_dtype() -> None:
    model = Llama(SMALL, dtype=fl.bf16)
    assert model.rope_cos.dtype == fl.bf16.np and all(t.dtype is fl.bf16 for t in nn.get_parameters(model))
    logits = model(np.zeros((1, 3), np.int64))
    assert logits.shape == (1, 3, 40) and logits.dtype is fl.bf16
    assert model.loss(np.zeros((1, 3), np.int64), np.ones((1, 3), np.int64)).dtype is fl.f32


def test_loss_ignores_ignore_index() -> None:
    model = Llama(SMALL, seed=2)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 40, (2, 5)), rng.integers(0, 40, (2, 5))
    logits = model(x).numpy().astype(np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    per = lse - np.take_along_axis(logits, y[..., None], -1)[..., 0]
    masked = y.copy()
    masked[0, :3] = 7
    assert float(model.loss(x, masked, ignore_index=7).numpy()) == pytest.approx(
        float(np.concatenate([per[0, 3:], per[1]]).mean()), rel=1e-6)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"n_heads": 5}, "LlamaConfig: n_heads 5 does not divide dim 32"),
    ({"n_kv_heads": 3}, "LlamaConfig: n_kv_heads 3 does not divide n_heads 4"),
    ({"vocab_size": 0}, "LlamaConfig: vocab_size must be a positive int, got 0"),
    ({"dim": 12, "n_heads": 4, "n_kv_heads": 4}, r"LlamaConfig: head_dim \(dim / n_heads\) must be even for rope, "
                                                 "got 3"),
    ({"rope_theta": -1.0}, "LlamaConfig: rope_theta must be a finite number > 0, got -1.0"),
])
def test_bad_config_is_a_param_error(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(fl.ParamError, match=message):
        LlamaConfig(**{**SMALL.__dict__, **kwargs})


def test_bad_tokens_name_what_was_expected() -> None:
    model = Llama(SMALL)
    with pytest.raises(fl.DTypeError, match="Llama: tokens must be i64, got u32"):
        model(np.zeros((1, 3), np.uint32))
    with pytest.raises(fl.ShapeError, match=r"Llama: tokens must be \[batch, seq\] with seq >= 1, got \[3\]"):
        model(np.zeros(3, np.int64))
    with pytest.raises(fl.ShapeError, match="Llama: tokens has 65 positions, more than max_seq_len 64"):
        model(np.zeros((1, 65), np.int64))
    with pytest.raises(fl.ShapeError, match=r"Llama.loss: targets are \[1, 4\], tokens are \[1, 3\]"):
        model.loss(np.zeros((1, 3), np.int64), np.zeros((1, 4), np.int64))
    with pytest.raises(fl.IndexOutOfRange):
        model(np.array([[1, 40]], np.int64)).numpy()
    with pytest.raises(fl.ParamError, match="rope_type 'linear' is not supported"):
        LlamaConfig.from_hf({**transformers.LlamaConfig(**SMALL.to_hf()).to_dict(),
                             "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}})


def test_a_transformers_checkpoint_loads_and_gives_its_logits(tmp_path: Path) -> None:
    """save_pretrained's files (config.json, model.safetensors without the tied lm_head.weight) load into
    fuel's Llama, whose logits are transformers' within 1e-5 of each row's max."""
    cfg = LlamaConfig(**{**SMALL.__dict__, "tie_embeddings": True})
    torch.manual_seed(0)
    ref = hf_model(cfg)
    ref.save_pretrained(tmp_path)
    model = Llama(LlamaConfig.from_hf(json.loads((tmp_path / "config.json").read_text())), seed=1)
    nn.load_state_dict(model, nn.safe_load(tmp_path / "model.safetensors"))
    tokens = np.random.default_rng(3).integers(0, 40, (2, 9))
    with torch.no_grad():
        want = ref(torch.from_numpy(tokens)).logits.numpy()
    got = model(tokens).numpy()
    scale = np.abs(want).max(-1, keepdims=True)
    assert np.all(np.abs(got - want) <= 1e-5 * scale)
