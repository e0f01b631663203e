"""fuel.nn.llama trains as transformers' LlamaForCausalLM does, step for step.

Both models start from the same weights (fuel's initial state saved to safetensors, loaded by transformers
with strict names), see the same batches and use the same AdamW settings (fuel.optim.AdamW through
`opt.compile(model.loss)`, one captured replay per step; torch.optim.AdamW's single-tensor path). transformers
runs eager attention in f32, on one thread as fuel does. Checked:

- step 0: the loss within 1e-5 relative of torch's, the logits per row (each row scaled by its own max |torch
  value|) within 1e-5, and every parameter's gradient per row within 1e-5 of torch's f32 gradient beyond torch's
  own f32 error. That error is measured against transformers run in float64 from the same weights: at the
  stories15M shape torch's f32 weight gradients are themselves up to 2e-5 of their row's max away from the f64
  ones (the sum over the batch's positions cancels), so no f32 implementation meets 1e-5 against torch there;
  fuel's activation gradients are within 2e-6 per row of the f64 ones at every layer, as torch's are;
- 20 AdamW steps: each step's loss within 1e-5 relative. At lr 5e-4 the trajectory is one f32 reproduces (torch
  f32 against torch f64: 2e-7 at most over the 20 steps); at lr 3e-3 the motifs are memorised so fast that torch
  f32 itself leaves its f64 run by 7e-4 by step 17, and a loss check measures chaos rather than the code;
- bf16 weights with f32 master weights and optimizer state against torch's bf16 autocast run (f32 weights):
  each of 20 losses within 1e-2 relative.

Two shapes, both llama2.c's with their tied embeddings: stories260K (dim 64, 5 layers, 8 query / 4 key-value
heads, vocab 512, FFN 172: llama2.c's rule, 2/3 of 4·dim rounded up to a multiple of 4) and stories15M (dim 288,
6 layers, 6 heads, vocab 32000, FFN 768). The batches (B2 x T32) cycle through four fixed token sequences, so
the models learn and the losses move.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

import fuel as fl
from fuel import nn
from fuel.nn.llama import Llama, LlamaConfig
from fuel.optim import AdamW

SHAPES = {
    "stories260K": LlamaConfig(dim=64, n_layers=5, n_heads=8, n_kv_heads=4, vocab_size=512, hidden_dim=172,
                               max_seq_len=512, tie_embeddings=True),
    "stories15M": LlamaConfig(dim=288, n_layers=6, n_heads=6, n_kv_heads=6, vocab_size=32000, hidden_dim=768,
                              max_seq_len=256, tie_embeddings=True),
}
B, T = 2, 32  # rows per batch
STEPS = 20
ADAMW = {"lr": 5e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def batches(shape: str, n: int = 4) -> list[tuple[np.ndarray, np.ndarray]]:
    """n fixed batches of tokens and their next tokens, each row a short random motif repeated (learnable)."""
    rng = np.random.default_rng(7)
    vocab = SHAPES[shape].vocab_size
    out = []
    for _ in range(n):
        rows = [np.resize(rng.integers(0, vocab, rng.integers(3, 9)), T + 1) for _ in range(B)]
        data = np.stack(rows).astype(np.int64)
        out.append((np.ascontiguousarray(data[:, :-1]), np.ascontiguousarray(data[:, 1:])))
    return out


def hf_model(cfg: LlamaConfig, path: Path) -> transformers.LlamaForCausalLM:
    hf = transformers.LlamaConfig(**cfg.to_hf())
    hf._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(hf)
    model.load_state_dict(load_file(path), strict=True)
    return model


def torch_loss(model: transformers.LlamaForCausalLM, x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(torch.from_numpy(x)).logits
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                             torch.from_numpy(y).reshape(-1), ignore_index=-100)
    return logits, loss


@pytest.fixture(scope="module", autouse=True)
def same_threads() -> Iterator[None]:
    """One thread each: the counts are equal, and on a shared 2-core host torch's OpenMP team, contending with
    the other processes, runs the small shape ten times slower on two threads than on one."""
    before = torch.get_num_threads(), fl.get_num_threads()
    torch.set_num_threads(1)
    fl.set_num_threads(1)
    yield
    torch.set_num_threads(before[0])
    fl.set_num_threads(before[1])


@dataclass
class Start:
    name: str
    cfg: LlamaConfig
    fuel: Llama
    torch: transformers.LlamaForCausalLM
    path: Path


@pytest.fixture(scope="module", params=list(SHAPES))
def start(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Start:
    cfg = SHAPES[request.param]
    model = Llama(cfg, seed=11)
    path = tmp_path_factory.mktemp("parity") / f"{request.param}.safetensors"
    nn.safe_save(nn.get_state_dict(model), path, metadata={"format": "pt"})
    return Start(request.param, cfg, model, hf_model(cfg, path), path)


def rowwise_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / (that row's max |want|) over the rows (last axis) of a tensor."""
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    w2, g2 = w.reshape(-1, w.shape[-1]), g.reshape(-1, w.shape[-1])
    scale = np.abs(w2).max(axis=1, keepdims=True)
    return float((np.abs(g2 - w2) / np.where(scale > 0, scale, 1.0)).max())


def test_step0_loss_logits_and_every_gradient(start: Start) -> None:
    x, y = batches(start.name)[0]
    params = nn.get_state_dict(start.fuel)
    unique = nn.get_parameters(start.fuel)
    logits = start.fuel(x)
    loss = start.fuel.loss(x, y)
    grads = fl.grad(loss, unique)
    fl.realize(logits, loss, *grads)

    start.torch.zero_grad()
    t_logits, t_loss = torch_loss(start.torch, x, y)
    t_loss.backward()
    assert float(loss.numpy()) == pytest.approx(t_loss.item(), rel=1e-5)
    assert rowwise_error(logits.numpy(), t_logits.detach().numpy()) <= 1e-5

    exact = copy.deepcopy(start.torch).double()
    exact.zero_grad()
    _, e_loss = torch_loss(exact, x, y)
    e_loss.backward()
    by_id = {id(p): g for p, g in zip(unique, grads, strict=True)}
    named, named64 = dict(start.torch.named_parameters()), dict(exact.named_parameters())
    assert set(named) <= set(params)  # a tied weight is named once by torch, under its first name
    bad = {}
    for name, tp in named.items():
        g32, g64 = tp.grad, named64[name].grad
        assert g32 is not None and g64 is not None
        want, truth = g32.numpy(), g64.numpy()
        ours = by_id[id(params[name])].numpy()
        allowed = 1e-5 + 2 * rowwise_error(want, truth)  # torch's own f32 error per row, relative to its rows
        err = rowwise_error(ours, want)
        if err > allowed:
            bad[name] = (err, allowed)
    assert not bad, f"gradients off by more than allowed (error, allowed): {bad}"


def test_twenty_adamw_steps(start: Start) -> None:
    model = Llama(start.cfg, seed=0)
    nn.load_state_dict(model, nn.safe_load(start.path))
    ref = hf_model(start.cfg, start.path)
    opt = AdamW(nn.get_parameters(model), **ADAMW)  # type: ignore[arg-type]
    step = opt.compile(model.loss)
    t_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)  # type: ignore[arg-type]
    data = batches(start.name)
    ours, theirs = [], []
    for i in range(STEPS):
        x, y = data[i % len(data)]
        ours.append(step(x, y))
        t_opt.zero_grad()
        _, t_loss = torch_loss(ref, x, y)
        t_loss.backward()
        t_opt.step()
        theirs.append(t_loss.item())
    rel = np.abs(np.array(ours) / np.array(theirs) - 1)
    assert rel.max() <= 1e-5, f"worst step {int(rel.argmax())}: {rel.max():.2e}; fuel {ours}, torch {theirs}"
    assert theirs[-1] < theirs[0] - 0.5  # it learned: the check follows a moving trajectory


def test_bf16_master_weights_against_torch_autocast(tmp_path: Path) -> None:
    """fuel: bf16 parameters, f32 masters and state. torch: f32 weights (the same bf16-rounded values) under
    `torch.autocast("cpu", dtype=torch.bfloat16)`. The small shape, untied here to cover the untied head."""
    cfg = replace(SHAPES["stories260K"], tie_embeddings=False)
    init = {k: t.numpy().astype(ml_dtypes.bfloat16) for k, t in nn.get_state_dict(Llama(cfg, seed=5)).items()}
    path = tmp_path / "bf16.safetensors"
    nn.safe_save({k: v.astype(np.float32) for k, v in init.items()}, path)
    ref = hf_model(cfg, path)
    model = Llama(cfg, dtype=fl.bf16)
    nn.load_state_dict(model, init)
    opt = AdamW(nn.get_parameters(model), master_weights=True, **ADAMW)  # type: ignore[arg-type]
    step = opt.compile(model.loss)
    t_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)  # type: ignore[arg-type]
    data = batches("stories260K")
    ours, theirs = [], []
    for i in range(STEPS):
        x, y = data[i % len(data)]
        ours.append(step(x, y))
        t_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, t_loss = torch_loss(ref, x, y)
        t_loss.backward()
        t_opt.step()
        theirs.append(t_loss.item())
    rel = np.abs(np.array(ours) / np.array(theirs) - 1)
    assert rel.max() <= 1e-2, f"worst step {int(rel.argmax())}: {rel.max():.2e}; fuel {ours}, torch {theirs}"
    assert theirs[-1] < theirs[0] - 0.5
