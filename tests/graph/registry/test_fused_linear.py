"""FusedLinear (entry 2) against torch float64: kernels, rules, pattern, round trip, gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.node import Op
from fuel.graph.passes.fuse import fuse
from fuel.graph.registry import FusedOps, default_registry
from fuel.graph.registry.fused_linear import FusedLinearParams, decompose
from fuel.testing.oracle import assert_close_contraction

DTYPES = pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=lambda d: d.value)

# (a, b): rank 2, batched, shared rank-2 weight, GQA multiples, size-1 dims
SHAPES = [
    ((7, 33), (33, 5)),
    ((1, 1), (1, 1)),
    ((2, 3, 17), (2, 17, 9)),
    ((2, 4, 12), (12, 6)),
    ((2, 2, 3, 16), (16, 8)),
    ((4, 5, 12), (2, 12, 6)),
    ((2, 6, 1, 8), (1, 2, 8, 5)),
    ((3, 1, 20), (1, 20, 1)),
]


def _rand(rng: np.random.Generator, shape: tuple[int, ...], dt: DType, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(dt.np)


def _t64(a: np.ndarray, grad: bool = False) -> torch.Tensor:
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def _expand(b: torch.Tensor, a_batch: tuple[int, ...]) -> torch.Tensor:
    if b.ndim == 2:
        return b
    for d, (da, db) in enumerate(zip(a_batch, b.shape[:-2], strict=True)):
        if da != db:
            b = b.repeat_interleave(da // db, dim=d)
    return b


def torch_linear(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, _expand(b, tuple(a.shape[:-2]))) + bias


def check(out: np.ndarray, a: np.ndarray, b: np.ndarray, bias: np.ndarray, dt: DType) -> None:
    ref = torch_linear(_t64(a), _t64(b), _t64(bias)).numpy()
    scale = torch_linear(_t64(a).abs(), _t64(b).abs(), _t64(bias).abs()).numpy()
    assert_close_contraction(out, ref, scale, dt)


@DTYPES
@pytest.mark.parametrize(("sa", "sb"), SHAPES, ids=str)
def test_forward_matches_torch(dt: DType, sa: tuple[int, ...], sb: tuple[int, ...]) -> None:
    rng = np.random.default_rng(1)
    a, b, bias = _rand(rng, sa, dt), _rand(rng, sb, dt), _rand(rng, (sb[-1],), dt)
    y = fl.ops.fused_linear(a, b, bias)
    assert y.shape == sa[:-1] + (sb[-1],) and y.dtype is dt
    with fl.trace() as t:
        out = y.numpy()
    assert any(r.impl.startswith("FusedLinear[") for r in t.records)
    check(out, a, b, bias, dt)


@DTYPES
def test_non_contiguous_inputs(dt: DType) -> None:
    """Transposed, sliced, strided and broadcast inputs (the impl reads BLAS-able strides as is)."""
    rng = np.random.default_rng(2)
    a_t = _rand(rng, (2, 9, 5), dt)       # used transposed: a [2, 5, 9]
    w_big = _rand(rng, (9, 14), dt)       # used sliced: w [9, 7] with a row stride of 14
    bias_big = _rand(rng, (14,), dt)      # used strided: bias [7]
    a = fl.tensor(a_t).transpose(-2, -1)
    w = fl.tensor(w_big)[:, 3:10]
    bias = fl.tensor(bias_big)[::2]
    y = fl.ops.fused_linear(a, w, bias)
    with fl.trace() as t:
        out = y.numpy()
    assert any(r.impl.startswith("FusedLinear[") for r in t.records)
    check(out, a_t.transpose(0, 2, 1), w_big[:, 3:10], bias_big[::2], dt)
    # leaves whose own arrays are views: transposed a, column-major w, an every-other-column w
    w_t = _rand(rng, (4, 9), dt)
    for w_view in (w_t.T, w_big[:, ::2]):
        n = w_view.shape[-1]
        leaf = fl.ops.fused_linear(fl.tensor(a_t.transpose(0, 2, 1)), fl.tensor(w_view), bias_big[:n].copy())
        check(leaf.numpy(), a_t.transpose(0, 2, 1), w_view, bias_big[:n], dt)
    # a broadcast a (stride 0 along M) and a broadcast batch
    row = _rand(rng, (1, 9), dt)
    a_b = fl.tensor(row).broadcast_to(3, 4, 9)
    check(fl.ops.fused_linear(a_b, w, bias).numpy(), np.broadcast_to(row, (3, 4, 9)), w_big[:, 3:10],
          bias_big[::2], dt)


def test_transposed_weight_is_not_copied() -> None:
    """`x @ w.T + b` with w [N, K] (the nn.Linear layout) fuses and BLAS reads w transposed."""
    rng = np.random.default_rng(12)
    x_np, w_np, b_np = _rand(rng, (2, 3, 8), DType.F32), _rand(rng, (5, 8), DType.F32), _rand(rng, (5,), DType.F32)
    y = fl.tensor(x_np) @ fl.tensor(w_np).T + fl.tensor(b_np)
    with fl.trace() as t:
        fl.realize(y)
    (rec,) = [r for r in t.records if r.impl.startswith("FusedLinear[")]
    assert rec.copies == 0
    check(y.numpy(), x_np, w_np.T, b_np, DType.F32)


def test_empty_dims() -> None:
    rng = np.random.default_rng(3)
    for sa, sb in [((0, 8), (8, 4)), ((4, 6), (6, 0)), ((3, 0), (0, 5)), ((2, 0, 4), (4, 3))]:
        a, b, bias = _rand(rng, sa, DType.F32), _rand(rng, sb, DType.F32), _rand(rng, (sb[-1],), DType.F32)
        out = fl.ops.fused_linear(a, b, bias).numpy()
        np.testing.assert_allclose(out, np.matmul(a, b) + bias, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("sa", "sb", "sbias", "err", "words"),
    [
        ((4, 5), (6, 3), (3,), fl.ShapeError, "K=5"),
        ((4, 5), (5, 3), (4,), fl.ShapeError, "bias must be [3]"),
        ((4, 5), (5, 3), (1, 3), fl.ShapeError, "bias"),
        ((5,), (5, 3), (3,), fl.ShapeError, "rank >= 2"),
        ((2, 4, 5), (3, 5, 3), (3,), fl.ShapeError, "multiple"),
        ((2, 2, 4, 5), (2, 5, 3), (3,), fl.ShapeError, "rank"),
    ],
)
def test_build_errors(sa: tuple[int, ...], sb: tuple[int, ...], sbias: tuple[int, ...],
                      err: type[Exception], words: str) -> None:
    with pytest.raises(err, match="fused_linear") as info:
        fl.ops.fused_linear(np.zeros(sa, np.float32), np.zeros(sb, np.float32), np.zeros(sbias, np.float32))
    assert words in str(info.value)


def test_dtype_errors() -> None:
    a, b, bias = np.zeros((4, 5), np.float32), np.zeros((5, 3), np.float32), np.zeros(3, np.float32)
    with pytest.raises(fl.DTypeError, match="fused_linear: a, b and bias must share a dtype"):
        fl.ops.fused_linear(a, b.astype(np.float64), bias)
    with pytest.raises(fl.DTypeError, match="fused_linear: a, b and bias must share a dtype"):
        fl.ops.fused_linear(a, b, bias.astype(np.float16))
    with pytest.raises(fl.DTypeError, match="fused_linear: a must be a float"):
        fl.ops.fused_linear(a.astype(np.uint8), b.astype(np.uint8), bias.astype(np.uint8))


@DTYPES
@pytest.mark.parametrize("order", ["mm+bias", "bias+mm"])
@pytest.mark.parametrize(("sa", "sb"), [((6, 8), (8, 5)), ((2, 3, 8), (8, 5)), ((2, 3, 8), (2, 8, 5)),
                                        ((2, 3, 8), (1, 8, 5))], ids=str)
def test_pattern_fires_on_user_code(dt: DType, order: str, sa: tuple[int, ...], sb: tuple[int, ...]) -> None:
    rng = np.random.default_rng(4)
    a_np, b_np, bias_np = _rand(rng, sa, dt), _rand(rng, sb, dt), _rand(rng, (sb[-1],), dt)

    def build() -> fl.Tensor:
        x, w, bias = fl.tensor(a_np), fl.tensor(b_np), fl.tensor(bias_np)
        return x @ w + bias if order == "mm+bias" else bias + x @ w

    y = build()
    with fl.trace() as t:
        fl.realize(y)
    impls = [r.impl for r in t.records]
    assert [i for i in impls if i.startswith("FusedLinear[")] and not any("matmul" in i for i in impls)
    plain = fl.realize(build(), fuse=False)[0].numpy()
    if dt.is_half:  # the unfused graph rounds the product, then the sum: allow both roundings
        check(y.numpy(), a_np, b_np, bias_np, dt)
        scale = torch_linear(_t64(a_np).abs(), _t64(b_np).abs(), _t64(bias_np).abs()).numpy()
        u = 2.0**-8 if dt is DType.BF16 else 2.0**-11
        err = np.abs(plain.astype(np.float64) - y.numpy().astype(np.float64))
        assert (err <= 2 * u * scale).all()
    else:
        np.testing.assert_array_equal(y.numpy(), plain)


def test_pattern_guards() -> None:
    rng = np.random.default_rng(5)
    x, w, bias = (fl.tensor(_rand(rng, s, DType.F32)) for s in [(4, 6), (6, 3), (3,)])
    mm = x @ w
    y, other = mm + bias, mm * 2.0  # the product has a second reader: fusing would compute it twice
    with fl.trace() as t:
        fl.realize(y, other)
    assert not any(r.impl.startswith("FusedLinear[") for r in t.records)
    full_bias = fl.tensor(_rand(rng, (4, 3), DType.F32))  # not a [N] bias
    with fl.trace() as t:
        fl.realize(x @ w + full_bias)
    assert not any(r.impl.startswith("FusedLinear[") for r in t.records)


@pytest.mark.parametrize(("sa", "sb"), [((5, 8), (8, 3)), ((2, 5, 8), (8, 3)), ((2, 5, 8), (2, 8, 3)),
                                        ((4, 2, 5, 8), (2, 1, 8, 3)), ((2, 4, 3, 8), (1, 2, 8, 3))], ids=str)
def test_fuse_decompose_round_trip(sa: tuple[int, ...], sb: tuple[int, ...]) -> None:
    rng = np.random.default_rng(6)
    a, b, bias = (fl.tensor(_rand(rng, s, DType.F32)) for s in (sa, sb, (sb[-1],)))
    fused = fl.ops.fused_linear(a, b, bias)
    lowered = decompose([a, b, bias], FusedLinearParams())
    assert lowered.node.op is Op.ADD
    (back,) = fuse([lowered.node], default_registry())
    assert back.op is Op.FUSED and back.arg == fused.node.arg
    assert back.arg[0] == FusedOps.FUSED_LINEAR
    assert all(i is j for i, j in zip(back.inputs, fused.node.inputs, strict=True))
    np.testing.assert_allclose(fl.realize(lowered, fuse=False)[0].numpy(), fused.numpy(), rtol=1e-6, atol=1e-6)


def _torch_grads(a: np.ndarray, b: np.ndarray, bias: np.ndarray, g: np.ndarray, absolute: bool
                 ) -> list[np.ndarray]:
    """torch's gradients; with `absolute`, of |inputs| and |g| (the scale S of each sum)."""
    fix = np.abs if absolute else np.asarray
    ts = [_t64(fix(v), grad=True) for v in (a, b, bias)]
    gt = _t64(fix(g))
    out = torch_linear(*ts)
    return [x.numpy() for x in torch.autograd.grad(out, ts, gt)]


@pytest.mark.parametrize("dt", [DType.F64, DType.F32, DType.BF16], ids=lambda d: d.value)
@pytest.mark.parametrize(("sa", "sb"), [((5, 8), (8, 3)), ((2, 5, 8), (8, 3)), ((2, 5, 8), (2, 8, 3)),
                                        ((4, 2, 5, 8), (2, 1, 8, 3)), ((1, 6, 1, 4), (1, 3, 4, 2))], ids=str)
def test_grad_matches_torch(dt: DType, sa: tuple[int, ...], sb: tuple[int, ...]) -> None:
    """Shared-weight and GQA cases included: grad_b sums over every batch entry that read it."""
    rng = np.random.default_rng(7)
    a_np, b_np, bias_np = _rand(rng, sa, dt), _rand(rng, sb, dt), _rand(rng, (sb[-1],), dt)
    g_np = _rand(rng, sa[:-1] + (sb[-1],), dt)
    a, b, bias = fl.tensor(a_np), fl.tensor(b_np), fl.tensor(bias_np)
    y = fl.ops.fused_linear(a, b, bias)
    grads = fl.grad(y, [a, b, bias], fl.tensor(g_np))
    fl.realize(*grads)
    refs = _torch_grads(a_np, b_np, bias_np, g_np, absolute=False)
    scales = _torch_grads(a_np, b_np, bias_np, g_np, absolute=True)
    for got, ref, scale in zip(grads, refs, scales, strict=True):
        assert got.shape == ref.shape and got.dtype is dt
        assert_close_contraction(got.numpy(), ref, scale, dt)


def test_grad_through_user_expression_matches_fused() -> None:
    """The fused pattern's VJP equals differentiating the user's primitive graph."""
    rng = np.random.default_rng(8)
    x, w, bias = (fl.tensor(_rand(rng, s, DType.F64)) for s in [(3, 4, 6), (6, 5), (5,)])
    loss = ((x @ w + bias) * (x @ w + bias)).sum()
    fused = fl.grad(fl.ops.fused_linear(x, w, bias).square().sum(), [x, w, bias])
    plain = fl.grad(loss, [x, w, bias])
    for f, p in zip(fl.realize(*fused), fl.realize(*plain, fuse=False), strict=True):
        np.testing.assert_allclose(f.numpy(), p.numpy(), rtol=1e-12, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(
    batch=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3)), min_size=0, max_size=2),
    shared=st.booleans(),
    m=st.integers(1, 6), k=st.integers(1, 9), n=st.integers(1, 7),
    seed=st.integers(0, 2**16),
)
def test_property_shapes(batch: list[tuple[int, int]], shared: bool, m: int, k: int, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    b_batch = tuple(db for db, _ in batch)
    a_batch = tuple(db * r for db, r in batch)
    sb = (k, n) if shared else b_batch + (k, n)
    a, b, bias = _rand(rng, a_batch + (m, k), DType.F32), _rand(rng, sb, DType.F32), _rand(rng, (n,), DType.F32)
    check(fl.ops.fused_linear(a, b, bias).numpy(), a, b, bias, DType.F32)


def test_pattern_refuses_a_bias_along_the_wrong_axis() -> None:
    rng = np.random.default_rng(9)
    x, w = (fl.tensor(_rand(rng, s, DType.F32)) for s in [(4, 6), (6, 4)])
    col = fl.tensor(_rand(rng, (4, 1), DType.F32))  # one bias per row, not per output column
    (root,) = fuse([(x @ w + col).node], default_registry())
    assert root.op is Op.ADD
    row = fl.tensor(_rand(rng, (4,), DType.F32))
    (root,) = fuse([(x @ w + row).node], default_registry())
    assert root.op is Op.FUSED and root.arg[0] == FusedOps.FUSED_LINEAR
