"""ConvTranspose2D (entry 11) against torch float64: kernels in every dtype, rules, lowering, gradients.

torch's conv_transpose2d takes `(input, weight, bias, stride, padding, output_padding, groups, dilation)`
in that positional order. Asymmetric padding is checked against torch's unpadded output, cropped.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.registry import FusedOps, default_registry
from fuel.graph.registry.conv_geometry import as_padding, as_pair
from fuel.graph.registry.conv_transpose2d import ConvTranspose2DParams, decompose
from fuel.testing.oracle import assert_close_contraction

DTYPES = pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=lambda d: d.value)

# (N, Cin, Cout, H, W, kernel, stride, padding, output_padding, dilation, groups): stride 1 (the
# gather form, also cropping more than the kernel adds), strides 2-3 (col2im), output_padding up to
# max(stride, dilation) − 1, groups up to depthwise, asymmetric padding and kernels, 1x1.
CONFIGS = [
    (2, 4, 6, 5, 6, (3, 3), 1, 1, 0, 1, 1),
    (1, 6, 4, 4, 5, (2, 3), (2, 3), ((1, 0), (0, 2)), (1, 2), 1, 3),
    (2, 4, 4, 5, 5, (3, 3), 1, 0, 1, 2, 1),
    (2, 6, 6, 4, 4, (3, 3), 2, 1, 1, 1, 6),
    (1, 4, 8, 3, 3, (4, 4), 3, 2, 2, 2, 2),
    (2, 3, 5, 4, 4, (1, 1), 2, 0, 1, 1, 1),
    (1, 3, 4, 6, 6, (3, 3), 1, 3, 0, 1, 1),
    (1, 8, 6, 20, 20, (3, 3), 1, 1, 0, 1, 1),
    (2, 4, 6, 6, 5, (2, 4), (3, 1), ((0, 2), (1, 1)), (2, 0), (1, 2), 2),
]
IDS = [f"N{c[0]}-C{c[1]}to{c[2]}-{c[3]}x{c[4]}-k{c[5]}-s{c[6]}-p{c[7]}-op{c[8]}-d{c[9]}-g{c[10]}" for c in CONFIGS]


def _rand(rng: np.random.Generator, shape: tuple[int, ...], dt: DType, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(dt.np)


def _t64(a: np.ndarray, grad: bool = False) -> torch.Tensor:
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def torch_conv_transpose2d(x: torch.Tensor, w: torch.Tensor, stride: Any, padding: Any, output_padding: Any,
                           dilation: Any, groups: int) -> torch.Tensor:
    """torch's conv_transpose2d (positional order: output_padding, groups, dilation), unpadded, then the
    (possibly asymmetric) padding cropped."""
    (pt, pb), (pl, pr) = as_padding("test", padding)
    full = F.conv_transpose2d(x, w, None, as_pair("t", "s", stride, 1), 0, as_pair("t", "op", output_padding, 0),
                              groups, as_pair("t", "d", dilation, 1))
    return full[:, :, pt:full.shape[2] - pb, pl:full.shape[3] - pr]


def _inputs(rng: np.random.Generator, cfg: tuple[Any, ...], dt: DType) -> list[np.ndarray]:
    n, cin, cout, h, w, (kh, kw), *_rest, g = cfg
    return [_rand(rng, (n, cin, h, w), dt), _rand(rng, (cin, cout // g, kh, kw), dt)]


def _geometry(cfg: tuple[Any, ...]) -> tuple[Any, ...]:
    return cfg[6], cfg[7], cfg[8], cfg[9], cfg[10]


def check_forward(out: np.ndarray, arrays: list[np.ndarray], cfg: tuple[Any, ...], dt: DType) -> None:
    x, w = (_t64(a) for a in arrays)
    ref = torch_conv_transpose2d(x, w, *_geometry(cfg)).numpy()
    scale = torch_conv_transpose2d(x.abs(), w.abs(), *_geometry(cfg)).numpy()
    assert_close_contraction(out, ref, scale, dt)


@DTYPES
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_forward_matches_torch(dt: DType, cfg: tuple[Any, ...]) -> None:
    rng = np.random.default_rng(1)
    x, w = _inputs(rng, cfg, dt)
    y = fl.ops.conv_transpose2d(x, w, *_geometry(cfg))
    assert y.dtype is dt
    with fl.trace() as t:
        out = y.numpy()
    assert any(r.impl.startswith("ConvTranspose2D[") for r in t.records)
    check_forward(out, [x, w], cfg, dt)


def test_symmetric_padding_matches_torch_directly() -> None:
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((2, 4, 5, 6)), rng.standard_normal((4, 3, 3, 2))
    out = fl.ops.conv_transpose2d(x, w, stride=(2, 1), padding=(1, 0), output_padding=(1, 0), dilation=(1, 2)).numpy()
    ref = F.conv_transpose2d(_t64(x), _t64(w), None, (2, 1), (1, 0), (1, 0), 1, (1, 2)).numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)


def test_is_the_input_gradient_of_conv2d() -> None:
    """Verified identical to torch's conv2d input gradient (oracles.md)."""
    rng = np.random.default_rng(3)
    x, w = _t64(rng.standard_normal((2, 6, 11, 9)), True), _t64(rng.standard_normal((4, 3, 3, 3)))
    y = F.conv2d(x, w, None, 2, 1, 1, 2)
    g = rng.standard_normal(tuple(y.shape))
    (gx,) = torch.autograd.grad(y, [x], _t64(g))
    out = fl.ops.conv_transpose2d(g, w.numpy(), 2, 1, (0, 0), 1, 2).numpy()
    np.testing.assert_allclose(out, gx.numpy(), rtol=1e-12, atol=1e-12)


def test_larger_blocks_and_channel_chunks() -> None:
    rng = np.random.default_rng(4)
    for cfg in [(1, 8, 64, 10, 10, (3, 3), 2, 1, 1, 1, 1), (2, 8, 16, 30, 30, (3, 3), 2, 0, 0, 1, 1),
                (2, 32, 32, 16, 16, (3, 3), 1, 1, 0, 1, 1)]:
        x, w = _inputs(rng, cfg, DType.F32)
        check_forward(fl.ops.conv_transpose2d(x, w, *_geometry(cfg)).numpy(), [x, w], cfg, DType.F32)


def test_edge_shapes() -> None:
    rng = np.random.default_rng(5)
    assert fl.ops.conv_transpose2d(np.zeros((0, 4, 3, 3), np.float32), _rand(rng, (4, 2, 3, 3), DType.F32),
                                   stride=2).numpy().shape == (0, 2, 7, 7)
    x, w = rng.standard_normal((1, 3, 1, 1)), rng.standard_normal((3, 5, 2, 2))
    out = fl.ops.conv_transpose2d(x, w).numpy()  # one input pixel: the weights, scaled and summed
    np.testing.assert_allclose(out[0], np.einsum("c,cohw->ohw", x[0, :, 0, 0], w), rtol=1e-13)


@pytest.mark.parametrize("dt", [DType.F64, DType.F32], ids=lambda d: d.value)
@pytest.mark.parametrize("cfg", CONFIGS[:6], ids=IDS[:6])
def test_lowering_agrees_with_kernel(dt: DType, cfg: tuple[Any, ...]) -> None:
    rng = np.random.default_rng(6)
    x, w = _inputs(rng, cfg, dt)
    lowered = decompose([fl.tensor(x), fl.tensor(w)], ConvTranspose2DParams(*_geometry(cfg)))
    check_forward(fl.realize(lowered, fuse=False)[0].numpy(), [x, w], cfg, dt)


def _torch_grads(arrays: list[np.ndarray], g: np.ndarray, cfg: tuple[Any, ...], absolute: bool) -> list[np.ndarray]:
    fix = np.abs if absolute else np.asarray
    ts = [_t64(fix(a), grad=True) for a in arrays]
    out = torch_conv_transpose2d(*ts, *_geometry(cfg))
    return [t.numpy() for t in torch.autograd.grad(out, ts, _t64(fix(g)))]


@DTYPES
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_grad_matches_torch(dt: DType, cfg: tuple[Any, ...]) -> None:
    """dX is a Conv2D of the upstream gradient, dW the swapped Conv2D (upstream: not differentiable)."""
    rng = np.random.default_rng(7)
    arrays = _inputs(rng, cfg, dt)
    leaves = [fl.tensor(a) for a in arrays]
    y = fl.ops.conv_transpose2d(*leaves, *_geometry(cfg))
    g_np = _rand(rng, y.shape, dt)
    grads = fl.realize(*fl.grad(y, leaves, g_np))
    for got, ref, scale in zip(grads, _torch_grads(arrays, g_np, cfg, False), _torch_grads(arrays, g_np, cfg, True),
                               strict=True):
        assert got.shape == ref.shape and got.dtype is dt
        assert_close_contraction(got.numpy(), ref, scale, dt)


@pytest.mark.parametrize(
    ("sx", "sw", "kw", "err", "words"),
    [
        ((2, 4, 5, 5), (3, 2, 3, 3), {}, fl.ShapeError, "w has 3 input channels (its first dim), x has 4"),
        ((2, 6, 5, 5), (6, 2, 3, 3), {"groups": 4}, fl.ShapeError, "x has 6 channels, which 4 groups"),
        ((2, 4, 5), (4, 2, 3, 3), {}, fl.ShapeError, "x must be [N, Cin, H, W]"),
        ((2, 4, 5, 5), (4, 2, 3), {}, fl.ShapeError, "w must be [Cin, Cout/groups, Kh, Kw]"),
        ((2, 4, 2, 2), (4, 2, 3, 3), {"padding": 2}, fl.ShapeError, "crops the whole output"),
        ((2, 4, 5, 5), (4, 2, 3, 3), {"stride": 2, "output_padding": 2}, fl.ParamError,
         "output_padding 2 along the height must be smaller than max(stride 2, dilation 1)"),
        ((2, 4, 5, 5), (4, 2, 3, 3), {"output_padding": (0, 1)}, fl.ParamError, "along the width"),
        ((2, 4, 5, 5), (4, 2, 3, 3), {"dilation": 0}, fl.ParamError, "dilation must be at least 1"),
        ((2, 4, 5, 5), (4, 2, 3, 3), {"output_padding": -1}, fl.ParamError, "at least 0"),
    ],
)
def test_build_errors(sx: tuple[int, ...], sw: tuple[int, ...], kw: dict[str, Any], err: type[Exception],
                      words: str) -> None:
    with pytest.raises(err) as info:
        fl.ops.conv_transpose2d(np.zeros(sx, np.float32), np.zeros(sw, np.float32), **kw)
    assert words in str(info.value) and str(info.value).startswith("conv_transpose2d")


def test_dtype_errors_and_metadata() -> None:
    with pytest.raises(fl.DTypeError, match="conv_transpose2d: w must have x's dtype f32, got bf16"):
        fl.ops.conv_transpose2d(np.zeros((1, 2, 3, 3), np.float32), np.zeros((2, 1, 2, 2), fl.bf16.np))
    entry = default_registry().entry(FusedOps.CONV_TRANSPOSE2D)
    assert entry.name == "ConvTranspose2D" and entry.arity == (2,) and entry.vjp is not None
    p = ConvTranspose2DParams(2, 1, 1, 1, 1)
    assert p.output_padding == (1, 1) and p.padding == ((1, 1), (1, 1))


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 2), groups=st.integers(1, 3), cg=st.integers(1, 3), mg=st.integers(1, 5),
    kh=st.integers(1, 4), kw=st.integers(1, 4), sh=st.integers(1, 3), sw=st.integers(1, 3),
    dh=st.integers(1, 2), dw=st.integers(1, 2), h=st.integers(1, 6), w=st.integers(1, 6),
    pads=st.tuples(*[st.integers(0, 2)] * 4), ops=st.tuples(st.integers(0, 2), st.integers(0, 2)),
    grad=st.booleans(), seed=st.integers(0, 2**16),
)
def test_property(n: int, groups: int, cg: int, mg: int, kh: int, kw: int, sh: int, sw: int, dh: int, dw: int,
                  h: int, w: int, pads: tuple[int, int, int, int], ops: tuple[int, int], grad: bool, seed: int) -> None:
    oph, opw = min(ops[0], max(sh, dh) - 1), min(ops[1], max(sw, dw) - 1)
    pt, pb, pl, pr = pads
    # A geometry with an empty output is no example: assume() draws another, so every example checks.
    assume((h - 1) * sh - pt - pb + dh * (kh - 1) + oph + 1 >= 1)
    assume((w - 1) * sw - pl - pr + dw * (kw - 1) + opw + 1 >= 1)
    cfg = (n, cg * groups, mg * groups, h, w, (kh, kw), (sh, sw), ((pt, pb), (pl, pr)), (oph, opw), (dh, dw), groups)
    rng = np.random.default_rng(seed)
    dt = DType.F64 if grad else DType.F32
    arrays = _inputs(rng, cfg, dt)
    leaves = [fl.tensor(a) for a in arrays]
    y = fl.ops.conv_transpose2d(*leaves, *_geometry(cfg))
    check_forward(y.numpy(), arrays, cfg, dt)
    if grad:
        g_np = rng.standard_normal(y.shape)
        grads = fl.realize(*fl.grad(y, leaves, g_np))
        for got, ref, scale in zip(grads, _torch_grads(arrays, g_np, cfg, False),
                                   _torch_grads(arrays, g_np, cfg, True), strict=True):
            assert_close_contraction(got.numpy(), ref, scale, dt)
