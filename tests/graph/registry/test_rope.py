"""Rope (entry 5) against torch float64 (HF rotate-half): kernels, rules, pattern, exact gradients."""

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
from fuel.graph.registry.rope import RopeParams, decompose
from fuel.testing.oracle import assert_close_rowwise
from fuel.testing.reference.rope import rope_tables

DTYPES = pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=lambda d: d.value)
SHAPES = [(5, 8), (2, 3, 7, 16), (1, 1, 1, 2), (3, 1, 64), (2, 1, 4, 6), (1, 9, 32)]


def _rand(rng: np.random.Generator, shape: tuple[int, ...], dt: DType, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(dt.np)


def _t64(a: np.ndarray, grad: bool = False) -> torch.Tensor:
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers.models.llama.modeling_llama.rotate_half."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF apply_rotary_pos_emb for one tensor; [S, D] tables broadcast over the leading axes."""
    return (x * cos) + (rotate_half(x) * sin)


def assert_close_rope(out: np.ndarray, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dt: DType) -> None:
    """Against torch, each element judged by the size of its own two products (rope is elementwise:
    a row's largest value would hide a wrong small element)."""
    scale = (x.abs() * cos.abs() + rotate_half(x).abs() * sin.abs()).numpy()
    assert_close_rowwise(out, torch_rope(x, cos, sin).numpy(), dt, scale=scale)


def _inputs(rng: np.random.Generator, shape: tuple[int, ...], dt: DType
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x and tables whose halves differ (legal tables, and they expose an inexact VJP)."""
    seq, d = shape[-2:]
    return _rand(rng, shape, dt, 2.0), _rand(rng, (seq, d), dt), _rand(rng, (seq, d), dt)


@DTYPES
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_matches_torch(dt: DType, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(1)
    x, cos, sin = _inputs(rng, shape, dt)
    y = fl.ops.rope(x, cos, sin)
    assert y.shape == shape and y.dtype is dt
    with fl.trace() as t:
        out = y.numpy()
    assert any(r.impl.startswith("Rope[") for r in t.records)
    assert_close_rope(out, _t64(x), _t64(cos), _t64(sin), dt)


@DTYPES
def test_llama_tables(dt: DType) -> None:
    rng = np.random.default_rng(2)
    c, s = (t.astype(dt.np) for t in rope_tables(12, 32, start=500))
    x = _rand(rng, (2, 4, 12, 32), dt)
    assert_close_rope(fl.ops.rope(x, c, s).numpy(), _t64(x), _t64(c), _t64(s), dt)


@DTYPES
def test_non_contiguous_inputs(dt: DType) -> None:
    rng = np.random.default_rng(3)
    x_bshd = _rand(rng, (2, 5, 3, 8), dt)           # [B, S, H, D], used as [B, H, S, D]
    cos_big, sin_big = _rand(rng, (5, 20), dt), _rand(rng, (10, 8), dt)
    x = fl.tensor(x_bshd).transpose(1, 2)
    cos = fl.tensor(cos_big)[:, 4:12]               # row stride 20
    sin = fl.tensor(sin_big)[::2]                   # every other row
    y = fl.ops.rope(x, cos, sin)
    with fl.trace() as t:
        out = y.numpy()
    assert [r.copies for r in t.records if r.impl.startswith("Rope[")] == [0]  # read in place
    assert_close_rope(out, _t64(x_bshd.transpose(0, 2, 1, 3)), _t64(cos_big[:, 4:12]), _t64(sin_big[::2]), dt)
    leaf = fl.ops.rope(fl.tensor(x_bshd.transpose(0, 2, 1, 3)), cos_big[:, 4:12].copy(), sin_big[::2].copy())
    np.testing.assert_array_equal(leaf.numpy(), out)


def test_empty() -> None:
    for shape in [(2, 4, 0), (0, 3, 6), (2, 0, 4)]:
        x = np.ones(shape, np.float32)
        tab = np.ones(shape[-2:], np.float32)
        assert fl.ops.rope(x, tab, tab).numpy().shape == shape


@pytest.mark.parametrize(
    ("sx", "sc", "ss", "words"),
    [
        ((2, 4, 63), (4, 63), (4, 63), "rope: head_dim must be even, got 63"),
        ((2, 4, 8), (4, 4), (4, 8), "rope: cos must be [seq, head_dim] = [4, 8]"),
        ((2, 4, 8), (4, 8), (1, 4, 8), "rope: sin must be [seq, head_dim]"),
        ((2, 4, 8), (5, 8), (5, 8), "rope: cos must be"),
        ((8,), (1, 8), (1, 8), "rope: x must have rank >= 2"),
    ],
)
def test_shape_errors(sx: tuple[int, ...], sc: tuple[int, ...], ss: tuple[int, ...], words: str) -> None:
    with pytest.raises(fl.ShapeError) as info:
        fl.ops.rope(np.zeros(sx, np.float32), np.zeros(sc, np.float32), np.zeros(ss, np.float32))
    assert words in str(info.value)


def test_dtype_errors() -> None:
    x, tab = np.zeros((3, 4), np.float32), np.zeros((3, 4), np.float32)
    with pytest.raises(fl.DTypeError, match="rope: cos and sin must have x's dtype f32"):
        fl.ops.rope(x, tab.astype(np.float64), tab)
    with pytest.raises(fl.DTypeError, match="rope: cos and sin must have x's dtype"):
        fl.ops.rope(x, tab, tab.astype(np.float16))
    with pytest.raises(fl.DTypeError, match="rope: x must be a float"):
        fl.ops.rope(x.astype(np.uint8), tab.astype(np.uint8), tab.astype(np.uint8))


def _user_rope(x: fl.Tensor, cos: fl.Tensor, sin: fl.Tensor, variant: int) -> fl.Tensor:
    """The expression people write, in several operand orders."""
    h = x.shape[-1] // 2
    rot = fl.concat([-x[..., h:], x[..., :h]], axis=-1)
    if variant == 0:
        return x * cos + rot * sin
    if variant == 1:
        return rot * sin + x * cos
    return cos * x + sin * rot


@DTYPES
@pytest.mark.parametrize("variant", [0, 1, 2])
@pytest.mark.parametrize("shape", [(6, 8), (2, 3, 5, 16)], ids=str)
def test_pattern_fires_on_user_code(dt: DType, variant: int, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(4)
    x_np, c_np, s_np = _inputs(rng, shape, dt)

    def build() -> fl.Tensor:
        return _user_rope(fl.tensor(x_np), fl.tensor(c_np), fl.tensor(s_np), variant)

    y = build()
    with fl.trace() as t:
        fl.realize(y)
    impls = [r.impl for r in t.records]
    assert [i for i in impls if i.startswith("Rope[")] and not any("concat" in i for i in impls)
    plain = fl.realize(build(), fuse=False)[0].numpy()
    ref = torch_rope(_t64(x_np), _t64(c_np), _t64(s_np)).numpy()
    assert_close_rowwise(y.numpy(), ref, dt)
    if dt.is_half:  # the unfused graph rounds each product and the sum
        assert_close_rowwise(plain, ref, dt, backward=True)
    else:
        assert_close_rowwise(plain, y.numpy(), dt)


def test_pattern_guards() -> None:
    rng = np.random.default_rng(5)
    x, c, s = (fl.tensor(a) for a in _inputs(rng, (2, 4, 8), DType.F32))
    h = 4
    rot = fl.concat([-x[..., h:], x[..., :h]], axis=-1)
    y = x * c + rot * s
    with fl.trace() as t:
        fl.realize(y, rot * 2.0)  # the rotation has another reader: fusing would compute it twice
    assert not any(r.impl.startswith("Rope[") for r in t.records)
    wrong = fl.concat([-x[..., h:], x[..., :h]], axis=-1)  # a different x in the product
    z = fl.tensor(np.ones((2, 4, 8), np.float32))
    with fl.trace() as t:
        fl.realize(z * c + wrong * s)
    assert not any(r.impl.startswith("Rope[") for r in t.records)
    swapped = fl.concat([x[..., :h], -x[..., h:]], axis=-1)  # not rotate_half
    with fl.trace() as t:
        fl.realize(x * c + swapped * s)
    assert not any(r.impl.startswith("Rope[") for r in t.records)


def test_shared_tables_still_fuse() -> None:
    """q and k of one shape share the broadcast tables after CSE; both still fuse."""
    rng = np.random.default_rng(6)
    q, c, s = (fl.tensor(a) for a in _inputs(rng, (2, 3, 4, 8), DType.F32))
    k = fl.tensor(_rand(rng, (2, 3, 4, 8), DType.F32))
    with fl.trace() as t:
        fl.realize(_user_rope(q, c, s, 0), _user_rope(k, c, s, 0))
    assert sum(r.impl.startswith("Rope[") for r in t.records) == 2


@pytest.mark.parametrize("shape", [(6, 8), (2, 3, 5, 16), (1, 4, 2)], ids=str)
def test_fuse_decompose_round_trip(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(7)
    x, c, s = (fl.tensor(a) for a in _inputs(rng, shape, DType.F32))
    fused = fl.ops.rope(x, c, s)
    lowered = decompose([x, c, s], RopeParams())
    assert lowered.node.op is Op.ADD
    (back,) = fuse([lowered.node], default_registry())
    assert back.op is Op.FUSED and back.arg == fused.node.arg and back.arg[0] == FusedOps.ROPE
    assert all(i is j for i, j in zip(back.inputs, fused.node.inputs, strict=True))
    np.testing.assert_allclose(fl.realize(lowered, fuse=False)[0].numpy(), fused.numpy(), rtol=1e-6, atol=1e-6)


@DTYPES
@pytest.mark.parametrize("shape", [(5, 8), (2, 3, 7, 16), (1, 1, 1, 2), (3, 4, 6)], ids=str)
def test_grad_matches_torch(dt: DType, shape: tuple[int, ...]) -> None:
    """Exact VJP for x, cos and sin, with tables whose halves are NOT duplicated."""
    rng = np.random.default_rng(8)
    x_np, c_np, s_np = _inputs(rng, shape, dt)
    g_np = _rand(rng, shape, dt)
    x, c, s = fl.tensor(x_np), fl.tensor(c_np), fl.tensor(s_np)
    grads = fl.grad(fl.ops.rope(x, c, s), [x, c, s], fl.tensor(g_np))
    fl.realize(*grads)
    tx, tc, ts = (_t64(a, grad=True) for a in (x_np, c_np, s_np))
    refs = torch.autograd.grad(torch_rope(tx, tc, ts), (tx, tc, ts), _t64(g_np))
    for got, ref in zip(grads, refs, strict=True):
        assert got.dtype is dt
        assert_close_rowwise(got.numpy(), ref.numpy(), dt, backward=True)


def test_grad_differs_from_upstream_trick() -> None:
    """With non-duplicated tables, upstream's rope(g, cos, -sin) is wrong; ours is not."""
    rng = np.random.default_rng(9)
    x_np, c_np, s_np = _inputs(rng, (3, 4, 8), DType.F64)
    g_np = _rand(rng, (3, 4, 8), DType.F64)
    x = fl.tensor(x_np)
    (gx,) = fl.grad(fl.ops.rope(x, c_np, s_np), [x], fl.tensor(g_np))
    upstream = fl.ops.rope(g_np, c_np, -s_np).numpy()
    tx = _t64(x_np, grad=True)
    (ref,) = torch.autograd.grad(torch_rope(tx, _t64(c_np), _t64(s_np)), (tx,), _t64(g_np))
    assert_close_rowwise(gx.numpy(), ref.numpy(), DType.F64, backward=True)
    assert np.abs(upstream - ref.numpy()).max() > 0.1
    # with duplicated halves both agree
    c2, s2 = rope_tables(4, 8)
    (gx2,) = fl.grad(fl.ops.rope(x, c2, s2), [x], fl.tensor(g_np))
    np.testing.assert_allclose(gx2.numpy(), fl.ops.rope(g_np, c2, -s2).numpy(), rtol=1e-12, atol=1e-12)


def test_second_order_grad() -> None:
    """The VJP is built from lazy, differentiable ops (rope itself among them)."""
    rng = np.random.default_rng(10)
    x_np, c_np, s_np = _inputs(rng, (2, 3, 4), DType.F64)
    x, c = fl.tensor(x_np), fl.tensor(c_np)
    (gx,) = fl.grad(fl.ops.rope(x, c, s_np).square().sum(), [x])
    (gc,) = fl.grad(gx.sum(), [c])
    tx, tc = _t64(x_np, grad=True), _t64(c_np, grad=True)
    (tgx,) = torch.autograd.grad(torch_rope(tx, tc, _t64(s_np)).square().sum(), (tx,), create_graph=True)
    (tgc,) = torch.autograd.grad(tgx.sum(), (tc,))
    assert_close_rowwise(gc.numpy(), tgc.numpy(), DType.F64, backward=True)


@settings(max_examples=25, deadline=None)
@given(lead=st.lists(st.integers(1, 3), min_size=0, max_size=2), seq=st.integers(1, 9),
       half=st.integers(1, 12), seed=st.integers(0, 2**16),
       dt=st.sampled_from([DType.F32, DType.BF16]))
def test_property_shapes(lead: list[int], seq: int, half: int, seed: int, dt: DType) -> None:
    rng = np.random.default_rng(seed)
    x, c, s = _inputs(rng, (*lead, seq, 2 * half), dt)
    assert_close_rope(fl.ops.rope(x, c, s).numpy(), _t64(x), _t64(c), _t64(s), dt)


def test_pattern_refuses_a_rotation_of_another_axis() -> None:
    from fuel.graph.node import topo_order

    rng = np.random.default_rng(8)
    x, c, s = (fl.tensor(a) for a in _inputs(rng, (2, 6, 8), DType.F32))
    rows = fl.concat([-x[..., 3:, :], x[..., :3, :]], axis=-2)  # rotate-half of the positions, not the dims
    nodes = topo_order(fuse([(x * c + rows * s).node], default_registry()))
    assert not any(n.op is Op.FUSED and n.arg[0] == FusedOps.ROPE for n in nodes)
