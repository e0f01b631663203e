"""A Llama written from primitives (tests/models/primitive_llama.py) runs on the fused kernels and computes what
the hand-fused `fuel.nn.Llama` computes.

- Plans: the fuse pass turns its spellings into the entries the hand-fused model calls (FlashAttn, RmsNormLastDim,
  Rope, FusedSoftmaxCrossEntropy) and autograd then builds their backward entries, read from `fuel.trace()` over
  a realised forward and a realised gradient. The projections are bias-free `x @ W.T`, a MATMUL in both models
  (FusedLinear is the biased form).
- Numbers: its loss equals the hand-fused model's and transformers' LlamaForCausalLM's (run in float64 from the
  same state dict, the outside oracle); each parameter's gradient equals the hand-fused model's and the float64
  oracle's per row, each row scaled by its own largest oracle value.

Its step time against the hand-fused model's is measured by benchmarks/bench_primitive_llama.py, not here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel import nn
from fuel.dispatch.executor import Trace
from fuel.nn.llama import Llama, LlamaConfig
from tests.models.primitive_llama import PrimitiveLlama

VOCAB = 48
# Both models are f32 end to end. The losses differ only in how each sums the same f32 terms; a gradient row goes
# through two layers of products in either order of rounding, bounded against the other model per row (GRAD_ROW_TOL)
# and against the float64 oracle per row (ORACLE_ROW_TOL). The oracle's bound is looser: with two positions a
# weight-gradient row is the sum of two outer-product rows that can cancel, so the f32 rounding of the terms is
# large against the row's own largest value (both models, bit-identical there, were 1.37e-5 from float64 on
# gate_proj at x = [[40, 30]] on a host whose OpenBLAS ran its Haswell kernels).
LOSS_RTOL = 2e-6
GRAD_ROW_TOL = 1e-5
ORACLE_ROW_TOL = 3e-5


def config(n_kv_heads: int, tie: bool) -> LlamaConfig:
    return LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, vocab_size=VOCAB, hidden_dim=48,
                       max_seq_len=32, tie_embeddings=tie)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads(), fl.get_num_threads()
    torch.set_num_threads(1)
    fl.set_num_threads(1)
    yield
    torch.set_num_threads(before[0])
    fl.set_num_threads(before[1])


def pair(cfg: LlamaConfig, seed: int) -> tuple[PrimitiveLlama, Llama]:
    """The primitive model with fresh weights, and the hand-fused model loaded from its state dict."""
    prim = PrimitiveLlama(cfg, seed=seed)
    fused = Llama(cfg, seed=seed + 1)
    nn.load_state_dict(fused, {k: t.numpy() for k, t in nn.get_state_dict(prim).items()})
    return prim, fused


def transformers_f64(model: Llama) -> transformers.LlamaForCausalLM:
    hf = transformers.LlamaConfig(**model.cfg.to_hf())
    hf._attn_implementation = "eager"
    ref = transformers.LlamaForCausalLM(hf)
    state = {k: torch.from_numpy(t.numpy().copy()) for k, t in nn.get_state_dict(model).items()}
    ref.load_state_dict(state, strict=True)
    return ref.double()


def row_error(got: np.ndarray, want: np.ndarray, oracle: np.ndarray) -> float:
    """max |got - want| over each last-axis row, divided by the oracle's max |value| over that row."""
    g = np.asarray(got, np.float64).reshape(-1, want.shape[-1])
    w = np.asarray(want, np.float64).reshape(-1, want.shape[-1])
    scale = np.abs(np.asarray(oracle, np.float64).reshape(-1, want.shape[-1])).max(axis=1, keepdims=True)
    return float((np.abs(g - w) / np.where(scale > 0, scale, 1.0)).max())


def loss_and_grads(model: Llama, x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    params = nn.get_parameters(model)
    loss = model.loss(x, y)
    grads = fl.grad(loss, params)
    fl.realize(loss, *grads)
    by_id = {id(p): g.numpy() for p, g in zip(params, grads, strict=True)}
    return float(loss.numpy()), {k: by_id[id(t)] for k, t in nn.get_state_dict(model).items()}


@st.composite
def batches(draw: st.DrawFn) -> tuple[int, bool, np.ndarray, np.ndarray]:
    kv = draw(st.sampled_from([1, 2, 4]))
    tie = draw(st.booleans())
    # From 2 positions: with one, every query and key gradient is exactly 0 in exact arithmetic (a softmax over one
    # score), so no per-row relative bound applies to the f32 rounding noise either model leaves there.
    b, t = draw(st.integers(1, 2)), draw(st.integers(2, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    x, y = rng.integers(0, VOCAB, (b, t)), rng.integers(0, VOCAB, (b, t))
    ignored = rng.random((b, t)) < draw(st.sampled_from([0.0, 0.3]))
    ignored.flat[rng.integers(0, b * t)] = False  # at least one counted row: torch's mean over none is NaN
    return kv, tie, x, np.where(ignored, -100, y)


@settings(max_examples=6)
@given(case=batches())
def test_loss_and_gradients_equal_the_hand_fused_model_and_transformers(
        case: tuple[int, bool, np.ndarray, np.ndarray]) -> None:
    kv, tie, x, y = case
    prim, fused = pair(config(kv, tie), seed=int(x.sum()))
    p_loss, p_grads = loss_and_grads(prim, x, y)
    f_loss, f_grads = loss_and_grads(fused, x, y)

    ref = transformers_f64(fused)
    logits = ref(torch.from_numpy(x)).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), torch.from_numpy(y).reshape(-1))
    want.backward()
    assert p_loss == pytest.approx(f_loss, rel=LOSS_RTOL)
    assert p_loss == pytest.approx(want.item(), rel=LOSS_RTOL)

    oracle = dict(ref.named_parameters())
    for name, g in p_grads.items():
        truth = oracle[name if name in oracle else "model.embed_tokens.weight"].grad  # tied: torch names it once
        assert truth is not None
        t = truth.numpy()
        assert row_error(g, f_grads[name], t) <= GRAD_ROW_TOL, name
        assert row_error(g, t, t) <= ORACLE_ROW_TOL, name
        assert row_error(f_grads[name], t, t) <= ORACLE_ROW_TOL, name


def test_the_models_share_one_state_dict() -> None:
    cfg = config(2, False)
    prim, fused = pair(cfg, seed=3)
    assert list(nn.get_state_dict(prim)) == list(nn.get_state_dict(fused))
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg.to_hf()))
    assert set(nn.get_state_dict(prim)) == set(hf.state_dict())



def test_a_batch_with_every_target_ignored_has_loss_and_gradients_zero() -> None:
    """As `fuel.nn.Llama.loss` documents (torch's mean over no rows is NaN, so torch is no oracle here)."""
    prim, fused = pair(config(2, True), seed=9)
    x = np.random.default_rng(1).integers(0, VOCAB, (2, 5))
    y = np.full_like(x, -100)
    for model in (prim, fused):
        loss, grads = loss_and_grads(model, x, y)
        assert loss == 0.0
        assert all(not g.any() for g in grads.values())


def kernels(trace: Trace) -> Counter[str]:
    """How many times each fused entry, MATMUL and CROSS_ENTROPY_GRAD ran (a joint step counts each entry)."""
    out: Counter[str] = Counter()
    for r in trace.records:
        for impl in r.impl.split(" + "):
            name = impl.split("[")[0]
            if not name.startswith("prim:") or name in ("prim:matmul", "prim:cross_entropy_grad"):
                out[name] += 1
    return out


def plans(model: Llama, x: np.ndarray, y: np.ndarray) -> tuple[Counter[str], Counter[str]]:
    """The kernels of a realised loss, then of a realised gradient of every parameter."""
    with fl.trace() as forward:
        model.loss(x, y).numpy()
    grads = fl.grad(model.loss(x, y), nn.get_parameters(model))
    with fl.trace() as backward:
        fl.realize(*grads)
    return kernels(forward), kernels(backward)


def test_plans_run_the_hand_fused_models_kernels() -> None:
    """Forward: FlashAttn (causal, key/value heads shared by query groups), RmsNormLastDim, Rope, the MATMUL
    projections and FusedSoftmaxCrossEntropy, no SoftmaxLastDim (no [T, T] score matrix). Backward: the FlashAttn
    backward entries, RmsNormLastDimBackward, Rope of the gradient and CROSS_ENTROPY_GRAD. Both plans run the
    hand-fused model's kernels, count for count."""
    cfg = config(2, False)
    prim, fused = pair(cfg, seed=5)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, VOCAB, (2, 7)), rng.integers(0, VOCAB, (2, 7))
    y[0, :2] = -100
    p_forward, p_backward = plans(prim, x, y)
    f_forward, f_backward = plans(fused, x, y)
    layers = cfg.n_layers
    assert p_forward["FlashAttn"] == layers
    assert p_forward["RmsNormLastDim"] == 2 * layers + 1
    assert p_forward["Rope"] == 2 * layers
    assert p_forward["FusedSoftmaxCrossEntropy"] == 1
    assert p_forward["prim:matmul"] == 7 * layers + 1
    assert p_forward["SoftmaxLastDim"] == 0
    for name in ("FlashAttnBackwardQ", "FlashAttnBackwardK", "FlashAttnBackwardV"):
        assert p_backward[name] == layers, name
    assert p_backward["RmsNormLastDimBackward"] == 2 * layers + 1
    assert p_backward["Rope"] == 4 * layers  # q and k forward, then their gradients through rope's adjoint
    assert p_backward["prim:cross_entropy_grad"] == 1
    assert p_backward["SoftmaxLastDimBackward"] == 0
    assert p_forward == f_forward
    assert p_backward == f_backward
