"""RmsNormLastDim (3) and RmsNormLastDimBackward (9) against torch float64: kernels in every dtype,
rules and errors, the live pattern, the fuse/decompose round trip, and gradients."""

from __future__ import annotations

import decimal
from decimal import Decimal

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.node import Op
from fuel.graph.passes.fuse import fuse
from fuel.graph.registry import NOT_DIFFERENTIABLE, FusedOpFamily, FusedOps, default_registry
from fuel.graph.registry.rms_norm_last_dim import RmsNormLastDimParams, decompose
from fuel.graph.registry.rms_norm_last_dim_backward import rms_norm_last_dim_backward
from fuel.testing.contract import fuel_threads, thread_counts
from fuel.testing.oracle import assert_close_rowwise
from fuel.testing.rescale import rescaled, rescaled_grad

F = torch.nn.functional

DTYPES = pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=lambda d: d.value)
SHAPES = [(4, 16), (2, 3, 8), (7,), (3, 1), (1, 1), (1,), (2, 1, 5)]
EPS = 1e-5


def _rand(shape: tuple[int, ...], dt: DType, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dt.np)


def _t64(a: np.ndarray, grad: bool = False) -> torch.Tensor:
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def _oracle(x: np.ndarray, eps: float) -> np.ndarray:
    return F.rms_norm(_t64(x), (x.shape[-1],), None, eps).numpy()


def _oracle_grad(x: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    tx = _t64(x, grad=True)
    F.rms_norm(tx, (x.shape[-1],), None, eps).backward(_t64(g))
    return tx.grad.numpy()


def _impls_run(y: fl.Tensor) -> list[str]:
    with fl.trace() as t:
        fl.realize(y)
    return [r.impl for r in t.records]


# ---- kernels against torch -----------------------------------------------------------------


@DTYPES
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("eps", [1e-6, 0.1])
def test_forward_matches_torch(dt: DType, shape: tuple[int, ...], eps: float) -> None:
    x = _rand(shape, dt, scale=2.0)
    y = fl.ops.rms_norm_last_dim(fl.tensor(x), eps)
    assert any(i.startswith("RmsNormLastDim[") for i in _impls_run(y))
    assert_close_rowwise(y.numpy(), _oracle(x, eps), dt)


@DTYPES
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_backward_entry_matches_torch_autograd(dt: DType, shape: tuple[int, ...]) -> None:
    x, g = _rand(shape, dt, 1), _rand(shape, dt, 2)
    # A size-1 row's gradient g·eps/(x² + eps)^1.5 is what is left after g·x² cancels against
    # x·(g·x); torch's float64 autograd keeps only ~1e-16·(x²/eps) of it, so give it a large eps.
    eps = EPS if shape[-1] > 1 else 0.1
    dx = rms_norm_last_dim_backward(x, g, eps)
    assert any(i.startswith("RmsNormLastDimBackward[") for i in _impls_run(dx))
    assert_close_rowwise(dx.numpy(), _oracle_grad(x, g, eps), dt, backward=True)


@DTYPES
def test_large_and_tiny_values(dt: DType) -> None:
    for scale in (1e-3, 3e3 if dt is DType.F16 else 1e6):
        x = _rand((3, 40), dt, 3, scale)
        assert_close_rowwise(fl.ops.rms_norm_last_dim(x, EPS).numpy(), _oracle(x, EPS), dt)


@pytest.mark.parametrize("dt", [DType.F32, DType.BF16], ids=lambda d: d.value)
def test_non_contiguous_inputs(dt: DType) -> None:
    a = _rand((12, 6), dt, 4)
    for view in (fl.tensor(a).transpose(), fl.tensor(a)[:, ::2], fl.tensor(a)[1::3]):
        ref = _oracle(np.ascontiguousarray(view.numpy()), EPS)
        assert_close_rowwise(fl.ops.rms_norm_last_dim(view, EPS).numpy(), ref, dt)


# ---- rows whose squares overflow the working type ---------------------------------------------
# Every row but one ordinary one overflows Σx² in the kernel's working type (f32 for f32 and bf16):
# from about 1e19 (f32) or 1e154 (f64) on, next to small values. The answer is ordinary.
HUGE: dict[DType, list[list[float]]] = {
    DType.F32: [[1e20, 1, 2, 3], [1, 2, 3, 4], [3e38, -3e38, 3e38, 1], [1e30, 1e-30, 0, -1e19]],
    DType.F64: [[1e155, 1, 2, 3], [1, 2, 3, 4], [1.7e308, -1.7e308, 1.7e308, 1],
                [1e300, 1e-300, 0, -1e160]],
    DType.F16: [[6e4, 1, 2, 3], [1, 2, 3, 4], [6e4, -6e4, 6e4, 1], [3e4, 1e-4, 0, -2e4]],
}
HUGE[DType.BF16] = HUGE[DType.F32]
HUGE_G = [[0.5, -1, 2, 0.25], [3, -1, 0.5, 2], [1, 1, -2, 0.75], [-0.5, 2, 1, -1]]


@DTYPES
def test_huge_rows_forward(dt: DType) -> None:
    x = np.array(HUGE[dt], np.float64).astype(dt.np)
    y = fl.ops.rms_norm_last_dim(x, EPS).numpy()
    # Never a large wrong value (every element is at most sqrt(n)), nor a zeroed row.
    assert np.all(np.abs(y.astype(np.float64)) <= 2 * 1.01), y
    assert np.all(np.max(np.abs(y.astype(np.float64)), -1) >= 0.5), y
    assert_close_rowwise(y, rescaled(_oracle, x, EPS), dt)
    if dt is not DType.F64:  # float64 holds these rows' squares: torch needs no rescaling
        assert_close_rowwise(y, _oracle(x, EPS), dt)


@DTYPES
def test_huge_rows_backward(dt: DType) -> None:
    x = np.array(HUGE[dt], np.float64).astype(dt.np)
    for big_g in (1.0, float(ml_dtypes.finfo(dt.np).max) / 8):
        g = np.array(HUGE_G, np.float64)
        g[1:3] *= big_g  # a huge g (Σg² overflows) on an ordinary x and on a huge one
        g = g.astype(dt.np)
        dx = rms_norm_last_dim_backward(x, g, EPS).numpy()
        assert np.isfinite(dx.astype(np.float64)).all(), dx
        assert_close_rowwise(dx, rescaled_grad(_oracle_grad, x, g, EPS), dt, backward=True)


def _one_element_grad(x: float, g: float, eps: float) -> float:
    """g·eps/(x² + eps)^1.5 in 40-digit decimal arithmetic (no overflow), rounded once."""
    with decimal.localcontext() as ctx:
        ctx.prec = 40
        den = Decimal(x) ** 2 + Decimal(eps)
        return float(Decimal(g) * Decimal(eps) / (den * den.sqrt()))


@pytest.mark.parametrize("dt", [DType.F32, DType.BF16, DType.F64], ids=lambda d: d.value)
def test_huge_one_element_rows_backward(dt: DType) -> None:
    # A one-element row's gradient is all eps term: g·eps/(x² + eps)^1.5. With x² overflowing and
    # a huge g it is still an ordinary number (the fast path's x² = inf made it 0).
    big = [(1e20, 3e37), (2e19, 3e38), (1e19, -1e30)] if dt is not DType.F64 else [
        (1e155, 1e300), (1e200, 1.7e308), (1e160, -1e307)]
    x = np.array([[a] for a, _ in big] + [[2.0]]).astype(dt.np)
    g = np.array([[b] for _, b in big] + [[1.5]]).astype(dt.np)
    want = [[_one_element_grad(float(a), float(b), EPS)] for a, b in zip(x[:, 0], g[:, 0], strict=True)]
    dx = rms_norm_last_dim_backward(x, g, EPS).numpy()
    assert np.all(dx.astype(np.float64) != 0), dx
    assert_close_rowwise(dx, np.array(want), dt, backward=True)


@pytest.mark.parametrize("dt", [DType.F32, DType.BF16, DType.F64], ids=lambda d: d.value)
def test_non_finite_rows_keep_ieee_results_next_to_huge_ones(dt: DType) -> None:
    x = np.array([[np.inf, 1, 2, 3], [np.nan, 1, 2, 3], [-np.inf, np.inf, 0, 1], HUGE[dt][0]]).astype(dt.np)
    g = np.array(HUGE_G, np.float64).astype(dt.np)
    want = np.concatenate([_oracle(x[:3], EPS), rescaled(_oracle, x[3:], EPS)])
    assert_close_rowwise(fl.ops.rms_norm_last_dim(x, EPS).numpy(), want, dt)
    dx = rms_norm_last_dim_backward(x, g, EPS).numpy()
    assert np.isnan(dx[:3].astype(np.float64)).any(axis=-1).all()
    assert_close_rowwise(dx[3:], rescaled_grad(_oracle_grad, x[3:], g[3:], EPS), dt, backward=True)


@pytest.mark.parametrize("dt", [DType.F32, DType.BF16, DType.F64], ids=lambda d: d.value)
def test_rows_redone_after_overflow_are_right_and_bit_stable(dt: DType) -> None:
    # Every third row overflows; the rows redone in a second pass must not depend on the thread
    # count, nor on which other rows overflowed.
    rng = np.random.default_rng(7)
    x64 = rng.standard_normal((300, 64))
    x64[::3] *= 1e30 if dt is not DType.F64 else 1e160
    x, g = x64.astype(dt.np), _rand((300, 64), dt, 8)
    runs = {}
    for threads in thread_counts():
        with fuel_threads(threads):
            runs[threads] = (fl.ops.rms_norm_last_dim(x, EPS).numpy(), rms_norm_last_dim_backward(x, g, EPS).numpy())
    y, dx = runs[1]
    for other in runs.values():
        assert y.tobytes() == other[0].tobytes() and dx.tobytes() == other[1].tobytes()
    assert y[3].tobytes() == fl.ops.rms_norm_last_dim(x[3:4], EPS).numpy()[0].tobytes()
    assert_close_rowwise(y, rescaled(_oracle, x, EPS), dt)
    assert_close_rowwise(dx, rescaled_grad(_oracle_grad, x, g, EPS), dt, backward=True)


# ---- rules and errors ------------------------------------------------------------------------


def test_entry_metadata() -> None:
    fwd = default_registry().entry(FusedOps.RMS_NORM_LAST_DIM)
    bwd = default_registry().entry(FusedOps.RMS_NORM_LAST_DIM_BACKWARD)
    assert (fwd.name, fwd.family, str(fwd.backward)) == (
        "RmsNormLastDim", FusedOpFamily.NORM, "Fused(RmsNormLastDimBackward)")
    assert (bwd.name, bwd.family, bwd.backward) == (
        "RmsNormLastDimBackward", FusedOpFamily.BACKWARD, NOT_DIFFERENTIABLE)
    assert fl.ops.rms_norm_last_dim_backward is rms_norm_last_dim_backward
    assert fl.kernels().lookup(FusedOps.RMS_NORM_LAST_DIM, "cpu", (DType.BF16, DType.BF16))


@pytest.mark.parametrize("eps", [0.0, -1.0, float("nan"), float("inf"), "1e-5", None])
def test_bad_eps_is_a_param_error(eps: object) -> None:
    x = fl.tensor(np.ones((2, 3), np.float32))
    with pytest.raises(fl.ParamError, match="rms_norm_last_dim: eps must be"):
        fl.ops.rms_norm_last_dim(x, eps)  # type: ignore[arg-type]
    with pytest.raises(fl.ParamError, match="rms_norm_last_dim_backward: eps must be"):
        rms_norm_last_dim_backward(x, x, eps)  # type: ignore[arg-type]


def test_eps_message_reads_well() -> None:
    with pytest.raises(fl.ParamError, match=r"^rms_norm_last_dim: eps must be > 0, got -1.0$"):
        fl.ops.rms_norm_last_dim(np.ones(3, np.float32), -1.0)


def test_shape_and_dtype_errors() -> None:
    with pytest.raises(fl.ShapeError, match="rms_norm_last_dim: x must have rank >= 1"):
        fl.ops.rms_norm_last_dim(np.ones((), np.float32), EPS)
    with pytest.raises(fl.ShapeError, match="rms_norm_last_dim: x's last dim must be > 0"):
        fl.ops.rms_norm_last_dim(np.ones((3, 0), np.float32), EPS)
    with pytest.raises(fl.DTypeError, match="rms_norm_last_dim: x must be a float tensor, got u8"):
        fl.ops.rms_norm_last_dim(np.ones((2, 3), np.uint8), EPS)
    x = np.ones((2, 3), np.float32)
    with pytest.raises(fl.ShapeError, match=r"rms_norm_last_dim_backward: upstream gradient \[3, 2\]"):
        rms_norm_last_dim_backward(x, np.ones((3, 2), np.float32), EPS)
    with pytest.raises(fl.DTypeError, match="rms_norm_last_dim_backward: upstream gradient is f64"):
        rms_norm_last_dim_backward(x, np.ones((2, 3), np.float64), EPS)


# ---- pattern and round trip ------------------------------------------------------------------

SPELLINGS = {
    "div sqrt x*x": lambda x, e: x / (x * x).mean(-1, keepdim=True).add(e).sqrt(),
    "div sqrt square": lambda x, e: x / (x.square().mean(-1, keepdim=True) + e).sqrt(),
    "mul rsqrt pow": lambda x, e: x * ((x**2).mean(-1, keepdim=True) + e).rsqrt(),
    "rsqrt times x": lambda x, e: (x * x).mean(-1, keepdim=True).add(e).rsqrt() * x,
    "reshape keepdim": lambda x, e: x / ((x * x).mean(-1).reshape(*x.shape[:-1], 1) + e).sqrt(),
}


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("shape", [(3, 8), (5,), (2, 1)], ids=str)
def test_pattern_fires_on_user_spellings(spelling: str, shape: tuple[int, ...]) -> None:
    a = _rand(shape, DType.F32, 5)
    build = SPELLINGS[spelling]
    fused = build(fl.tensor(a), 1e-4)
    assert any(i.startswith("RmsNormLastDim[") for i in _impls_run(fused))
    plain = build(fl.tensor(a), 1e-4)
    fl.realize(plain, fuse=False)
    assert_close_rowwise(fused.numpy(), plain.numpy(), DType.F32)
    assert_close_rowwise(fused.numpy(), _oracle(a, 1e-4), DType.F32)


def test_pattern_respects_other_consumers() -> None:
    x = fl.tensor(_rand((3, 8), DType.F32, 6))
    ms = (x * x).mean(-1, keepdim=True)
    y = x / (ms + EPS).sqrt()
    with fl.trace() as t:
        fl.realize(y, ms)
    assert not any(r.impl.startswith("RmsNormLastDim[") for r in t.records)
    assert_close_rowwise(y.numpy(), _oracle(x.numpy(), EPS), DType.F32)


def test_pattern_ignores_nonpositive_eps() -> None:
    x = fl.tensor(_rand((3, 8), DType.F32, 7))
    assert not any(i.startswith("RmsNormLastDim[") for i in _impls_run(x / (x * x).mean(-1, keepdim=True).sqrt()))


@DTYPES
def test_fuse_of_decompose_round_trips(dt: DType) -> None:
    x = fl.tensor(_rand((4, 6), dt))
    params = RmsNormLastDimParams(3e-4)
    lowered = decompose([x], params)
    assert lowered.node.op is Op.DIV
    (node,) = fuse([lowered.node], default_registry())
    assert node.op is Op.FUSED and node.arg == (FusedOps.RMS_NORM_LAST_DIM, params)
    assert node.inputs == (x.node,)


@DTYPES
def test_unfused_decomposition_agrees(dt: DType) -> None:
    x = _rand((3, 16), dt, 8)
    plain = decompose([fl.tensor(x)], RmsNormLastDimParams(EPS))
    fl.realize(plain, fuse=False)
    assert_close_rowwise(plain.numpy(), _oracle(x, EPS), dt, backward=dt.is_half)


# ---- gradients -------------------------------------------------------------------------------


@DTYPES
def test_grad_through_fused_op_matches_torch(dt: DType) -> None:
    x, w = _rand((3, 2, 8), dt, 9), _rand((3, 2, 8), dt, 10)
    xt = fl.tensor(x)
    loss = (fl.ops.rms_norm_last_dim(xt, EPS) * fl.tensor(w)).sum()
    (dx,) = fl.grad(loss, [xt])
    assert any(i.startswith("RmsNormLastDimBackward[") for i in _impls_run(dx))
    assert_close_rowwise(dx.numpy(), _oracle_grad(x, w, EPS), dt, backward=True)


def test_second_order_grad_through_backward_entry() -> None:
    x, g, w = (_rand((2, 5), DType.F64, s) for s in (11, 12, 13))
    xt, gt = fl.tensor(x), fl.tensor(g)
    loss = (rms_norm_last_dim_backward(xt, gt, EPS) * fl.tensor(w)).sum()
    dx, dg = fl.grad(loss, [xt, gt])
    tx, tg = _t64(x, grad=True), _t64(g, grad=True)
    (first,) = torch.autograd.grad(F.rms_norm(tx, (5,), None, EPS), tx, tg, create_graph=True)
    rx, rg = torch.autograd.grad((first * _t64(w)).sum(), (tx, tg))
    assert_close_rowwise(dx.numpy(), rx.numpy(), DType.F64, backward=True)
    assert_close_rowwise(dg.numpy(), rg.numpy(), DType.F64, backward=True)


@settings(max_examples=25, deadline=None)
@given(dims=st.lists(st.integers(1, 9), min_size=1, max_size=3), seed=st.integers(0, 2**16),
       eps=st.sampled_from([1e-6, 1e-3, 0.5]), dt=st.sampled_from([DType.F32, DType.F64]))
def test_property_forward_and_grad(dims: list[int], seed: int, eps: float, dt: DType) -> None:
    shape = tuple(dims)
    x = _rand(shape, dt, seed, 3.0)
    y = fl.ops.rms_norm_last_dim(x, eps)
    assert_close_rowwise(y.numpy(), _oracle(x, eps), dt)
    # The gradient is g's part orthogonal to x: when a random g happens to lie almost along x it
    # cancels, in any f32 implementation (torch's too). f64 keeps ~1e-16/sin(angle) of it.
    x64, g64 = x.astype(np.float64), _rand(shape, DType.F64, seed + 1)
    eps = eps if shape[-1] > 1 else 0.5  # see test_backward_entry_matches_torch_autograd
    dx = rms_norm_last_dim_backward(x64, g64, eps)
    assert_close_rowwise(dx.numpy(), _oracle_grad(x64, g64, eps), DType.F64, backward=True)


def test_pattern_refuses_a_wrong_axis_or_another_input() -> None:
    from fuel.graph.node import topo_order

    x = fl.tensor(_rand((3, 4, 8), DType.F32, 8))
    z = fl.tensor(_rand((3, 4, 8), DType.F32, 9))
    for y in (x / (x * x).mean(1, keepdim=True).add(EPS).sqrt(),  # the norm of axis 1
              x * (x * x).mean(0, keepdim=True).add(EPS).rsqrt(),
              x / (z * z).mean(-1, keepdim=True).add(EPS).sqrt()):  # the mean square of another tensor
        nodes = topo_order(fuse([y.node], default_registry()))
        assert not any(n.op is Op.FUSED and n.arg[0] == FusedOps.RMS_NORM_LAST_DIM for n in nodes)
