"""CausalConv1d (entry 18) against torch float64 `conv1d(groups=C)` (+ SiLU): kernels in every dtype,
rules, lowering, gradients with and without SiLU, and the one-step decode form under `fl.jit`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.registry import FusedOps, default_registry
from fuel.graph.registry.causal_conv1d import CausalConv1dParams, causal_conv1d_step, decompose
from fuel.testing.oracle import assert_close_contraction

DTYPES = pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=lambda d: d.value)
SILU = pytest.mark.parametrize("silu", [False, True], ids=["linear", "silu"])
# (B, C, seq, K): a Mamba-like row, an empty output, one tap, longer rows, the decode window (seq 1)
SHAPES = [(2, 5, 10, 4), (1, 3, 0, 4), (1, 1, 1, 1), (3, 7, 64, 3), (2, 16, 130, 4), (1, 8, 1, 4)]


def _rand(rng: np.random.Generator, shape: tuple[int, ...], dt: DType, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(dt.np)


def _t64(a: np.ndarray, grad: bool = False) -> torch.Tensor:
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def _inputs(rng: np.random.Generator, shape: tuple[int, int, int, int], dt: DType) -> list[np.ndarray]:
    b, c, seq, k = shape
    return [_rand(rng, (b, c, seq + k - 1), dt, 2.0), _rand(rng, (c, 1, k), dt), _rand(rng, (c,), dt)]


def torch_causal(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, silu: bool) -> torch.Tensor:
    """The oracle for a caller-padded x: depthwise conv1d (oracles.md). torch refuses an empty output;
    `0 · x[..., :0]` keeps the graph (zero gradients) for it."""
    if x.shape[2] < w.shape[2]:
        return (x[:, :, :0] * 0 + b.reshape(1, -1, 1) * 0 + w.sum() * 0)
    y = F.conv1d(x, w, b, groups=x.shape[1])
    return F.silu(y) if silu else y


def _linear_scale(arrays: list[np.ndarray]) -> torch.Tensor:
    """S_y = |bias| + Σ_k |w_k|·|x_{t+k}|, the pre-activation's terms."""
    x, w, b = (_t64(a).abs() for a in arrays)
    return torch_causal(x, w, b, False)


def check_forward(out: np.ndarray, arrays: list[np.ndarray], silu: bool, dt: DType) -> None:
    ref = torch_causal(*(_t64(a) for a in arrays), silu).numpy()
    scale = _linear_scale(arrays).numpy()
    if silu:  # SiLU's slope is at most 1.1; its own few roundings are relative to the result
        scale = 1.1 * scale + np.abs(ref)
    assert_close_contraction(out, ref, scale, dt)


@DTYPES
@SILU
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_matches_torch(dt: DType, silu: bool, shape: tuple[int, int, int, int]) -> None:
    rng = np.random.default_rng(1)
    arrays = _inputs(rng, shape, dt)
    y = fl.ops.causal_conv1d(*arrays, use_silu=silu)
    assert y.shape == shape[:2] + (shape[2],) and y.dtype is dt
    with fl.trace() as t:
        out = y.numpy()
    if out.size:
        assert any(r.impl.startswith("CausalConv1d[") for r in t.records)
    check_forward(out, arrays, silu, dt)


def test_matches_causal_conv1d_fn_on_unpadded_input() -> None:
    """Dao-AILab causal_conv1d_fn(x, w[:, 0], b) = conv1d(x, w, b, padding=K-1, groups=C)[..., :L]."""
    rng = np.random.default_rng(2)
    x, w, b = rng.standard_normal((2, 6, 17)), rng.standard_normal((6, 1, 4)), rng.standard_normal(6)
    out = fl.ops.causal_conv1d(np.pad(x, ((0, 0), (0, 0), (3, 0))), w, b, True).numpy()
    ref = F.silu(F.conv1d(_t64(x), _t64(w), _t64(b), padding=3, groups=6)[..., :17]).numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dt", [DType.F32, DType.BF16], ids=lambda d: d.value)
def test_extreme_pre_activations(dt: DType) -> None:
    """SiLU far into both tails (exp(−|y|) underflows) and ±inf inputs keep IEEE results."""
    x = np.array([[[0.0, 0.0, 90.0, -90.0, 1e30, -1e30, 20.0, -20.0]]], np.float32).astype(dt.np)
    w, b = np.ones((1, 1, 1), dt.np), np.zeros((1,), dt.np)
    out = fl.ops.causal_conv1d(x, w, b, True).numpy().astype(np.float64)
    ref = F.silu(_t64(x.astype(np.float32))).numpy()
    assert_close_contraction(out, ref, 1.1 * np.abs(_t64(x.astype(np.float32)).numpy()) + np.abs(ref), dt)
    inf = np.array([[[np.inf, -1.0, np.nan]]], dt.np)
    got = fl.ops.causal_conv1d(inf, w, b, True).numpy().astype(np.float64)
    assert got[0, 0, 0] == np.inf and np.isnan(got[0, 0, 2])


@pytest.mark.parametrize("dt", [DType.F64, DType.F32], ids=lambda d: d.value)
@SILU
def test_lowering_agrees_with_kernel(dt: DType, silu: bool) -> None:
    rng = np.random.default_rng(3)
    for shape in SHAPES[:4]:
        arrays = _inputs(rng, shape, dt)
        lowered = decompose([fl.tensor(a) for a in arrays], CausalConv1dParams(silu))
        check_forward(fl.realize(lowered, fuse=False)[0].numpy(), arrays, silu, dt)


def _torch_grads(arrays: list[np.ndarray], g: np.ndarray, silu: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """torch's gradients, and their scales: the linear conv's adjoint of |inputs| applied to
    |g|·(|silu'(y)| + S_y) (the SiLU's slope at the recomputed pre-activation, which carries its error)."""
    ts = [_t64(a, grad=True) for a in arrays]
    grads = [t.numpy() for t in torch.autograd.grad(torch_causal(*ts, silu), ts, _t64(g))]
    weight = np.abs(g)
    if silu:
        y = torch_causal(*(_t64(a) for a in arrays), False)
        s = torch.sigmoid(y)
        weight = weight * (np.abs((s * (1 + y * (1 - s))).numpy()) + _linear_scale(arrays).numpy())
    abs_ts = [_t64(np.abs(a), grad=True) for a in arrays]
    scales = [t.numpy() for t in torch.autograd.grad(torch_causal(*abs_ts, False), abs_ts, _t64(weight))]
    return grads, scales


@DTYPES
@SILU
@pytest.mark.parametrize("shape", [(2, 5, 10, 4), (1, 1, 1, 1), (3, 7, 64, 3), (1, 4, 0, 2)], ids=str)
def test_grad_matches_torch(dt: DType, silu: bool, shape: tuple[int, int, int, int]) -> None:
    rng = np.random.default_rng(4)
    arrays = _inputs(rng, shape, dt)
    leaves = [fl.tensor(a) for a in arrays]
    y = fl.ops.causal_conv1d(*leaves, use_silu=silu)
    g_np = _rand(rng, y.shape, dt)
    grads = fl.realize(*fl.grad(y, leaves, g_np))
    refs, scales = _torch_grads(arrays, g_np, silu)
    for got, ref, scale in zip(grads, refs, scales, strict=True):
        assert got.shape == ref.shape and got.dtype is dt
        assert_close_contraction(got.numpy(), ref, scale, dt)


@pytest.mark.parametrize("dt", [DType.F32, DType.BF16], ids=lambda d: d.value)
@SILU
def test_decode_steps_under_jit_match_the_full_sequence(dt: DType, silu: bool) -> None:
    """A rolling state of K − 1 columns, one token per replayed step, gives the full conv's outputs."""
    rng = np.random.default_rng(5)
    b, c, k, steps = 2, 6, 4, 9
    x = _rand(rng, (b, c, steps), dt)
    w, bias = _rand(rng, (c, 1, k), dt), _rand(rng, (c,), dt)
    full = fl.ops.causal_conv1d(np.pad(x, ((0, 0), (0, 0), (k - 1, 0))), w, bias, silu).numpy()
    step = fl.jit(lambda xt, st: causal_conv1d_step(xt, st, w, bias, silu))
    state = np.zeros((b, c, k - 1), dt.np)
    outs = []
    with fl.trace() as t:
        for i in range(steps):
            y, state = step(x[:, :, i:i + 1], state)
            outs.append(np.asarray(y))
    assert t.plans_built <= 1
    np.testing.assert_array_equal(np.concatenate(outs, axis=2), full)
    np.testing.assert_array_equal(np.asarray(state), x[:, :, steps - (k - 1):])


def test_decode_step_with_several_columns_and_one_tap() -> None:
    rng = np.random.default_rng(6)
    x, w, bias = rng.standard_normal((1, 3, 5)), rng.standard_normal((3, 1, 3)), rng.standard_normal(3)
    state = rng.standard_normal((1, 3, 2))
    y, new = causal_conv1d_step(x, state, w, bias)
    ref = fl.ops.causal_conv1d(np.concatenate([state, x], axis=2), w, bias).numpy()
    np.testing.assert_array_equal(y.numpy(), ref)
    np.testing.assert_array_equal(new.numpy(), x[:, :, 3:])
    y1, s1 = causal_conv1d_step(x, np.zeros((1, 3, 0)), w[:, :, :1], bias)
    assert s1.shape == (1, 3, 0) and y1.shape == (1, 3, 5)
    with pytest.raises(fl.ShapeError, match="causal_conv1d_step: x_new must be"):
        causal_conv1d_step(x, np.zeros((1, 3, 3)), w, bias)


@pytest.mark.parametrize(
    ("sx", "sw", "sb", "words"),
    [
        ((2, 4, 10), (4, 2, 3), (4,), "w must be [C, 1, K] = [4, 1, K]"),
        ((2, 4, 10), (5, 1, 3), (4,), "w must be [C, 1, K]"),
        ((2, 4, 10), (4, 1, 3), (5,), "bias must be [C] = [4]"),
        ((2, 4, 1), (4, 1, 3), (4,), "fewer than the K - 1 = 2"),
        ((2, 4), (4, 1, 3), (4,), "x must be [B, C, seq + K - 1]"),
        ((2, 4, 10), (4, 1, 0), (4,), "at least one tap"),
    ],
)
def test_shape_errors(sx: tuple[int, ...], sw: tuple[int, ...], sb: tuple[int, ...], words: str) -> None:
    with pytest.raises(fl.ShapeError) as info:
        fl.ops.causal_conv1d(np.zeros(sx, np.float32), np.zeros(sw, np.float32), np.zeros(sb, np.float32))
    assert words in str(info.value) and str(info.value).startswith("causal_conv1d")


def test_dtype_and_param_errors() -> None:
    x, w, b = np.zeros((1, 2, 5), np.float32), np.zeros((2, 1, 3), np.float32), np.zeros(2, np.float32)
    with pytest.raises(fl.DTypeError, match="causal_conv1d: w and bias must have x's dtype f32"):
        fl.ops.causal_conv1d(x, w.astype(np.float64), b)
    with pytest.raises(fl.DTypeError, match="x must be a float tensor"):
        fl.ops.causal_conv1d(x.astype(np.uint8), w.astype(np.uint8), b.astype(np.uint8))
    with pytest.raises(fl.ParamError, match="use_silu must be a bool"):
        fl.ops.causal_conv1d(x, w, b, use_silu="yes")  # type: ignore[arg-type]
    entry = default_registry().entry(FusedOps.CAUSAL_CONV1D)
    assert entry.name == "CausalConv1d" and entry.arity == (3,) and entry.vjp is not None


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 3), c=st.integers(1, 9), seq=st.integers(0, 40), k=st.integers(1, 5), silu=st.booleans(),
       grad=st.booleans(), seed=st.integers(0, 2**16))
def test_property(b: int, c: int, seq: int, k: int, silu: bool, grad: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    dt = DType.F64 if grad else DType.F32
    arrays = _inputs(rng, (b, c, seq, k), dt)
    leaves = [fl.tensor(a) for a in arrays]
    y = fl.ops.causal_conv1d(*leaves, use_silu=silu)
    check_forward(y.numpy(), arrays, silu, dt)
    if grad:
        g_np = rng.standard_normal(y.shape)
        grads = fl.realize(*fl.grad(y, leaves, g_np))
        refs, scales = _torch_grads(arrays, g_np, silu)
        for got, ref, scale in zip(grads, refs, scales, strict=True):
            assert_close_contraction(got.numpy(), ref, scale, dt)
