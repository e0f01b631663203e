"""Conv2D (entry 6) against torch float64: kernels in every dtype, rules, lowering, exact gradients.

Asymmetric padding is checked against torch by padding with F.pad first (torch's conv2d pads
symmetrically only). Tolerances: contractions, `|out − ref| ≤ c_acc·S + c_out·|ref|` with S the same
convolution of |x| and |w| (+ |bias|) per element (oracles.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fuel as fl
from fuel.cpu.conv import conv2d as conv
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.registry import FusedOps, default_registry
from fuel.graph.registry.conv2d import Conv2DParams, decompose
from fuel.graph.registry.conv_geometry import as_padding
from fuel.testing.oracle import assert_close_contraction

DTYPES = pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=lambda d: d.value)

# (N, Cin, Cout, H, W, kernel, stride, padding, dilation, groups, bias), covering every form of the
# kernel: runs along output rows, padded planes (unit stride), the transposed gather (a kernel as
# large as the padded input), the direct loop (depthwise, 4 channels per group, 1x1 of few taps).
CONFIGS = [
    (2, 4, 6, 7, 9, (3, 3), 1, 1, 1, 1, True),
    (1, 6, 8, 9, 20, (3, 3), 1, ((1, 2), (0, 1)), (2, 1), 1, False),
    (2, 8, 12, 11, 10, (3, 2), 2, ((2, 0), (1, 1)), 1, 2, True),
    (3, 6, 6, 10, 9, (3, 3), 3, 1, 1, 6, True),
    (1, 6, 12, 8, 8, (2, 3), (1, 2), 0, (2, 1), 3, False),
    (2, 16, 10, 5, 6, (1, 1), 1, 0, 1, 1, True),
    (1, 3, 8, 4, 4, (6, 6), 1, 1, 1, 1, True),
    (2, 4, 6, 12, 10, (5, 7), (1, 3), ((0, 3), (2, 0)), 1, 2, True),
]
IDS = [f"N{c[0]}-C{c[1]}to{c[2]}-{c[3]}x{c[4]}-k{c[5]}-s{c[6]}-p{c[7]}-d{c[8]}-g{c[9]}" for c in CONFIGS]


def _rand(rng: np.random.Generator, shape: tuple[int, ...], dt: DType, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(dt.np)


def _t64(a: np.ndarray, grad: bool = False) -> torch.Tensor:
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def torch_conv2d(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: Any, padding: Any,
                 dilation: Any, groups: int) -> torch.Tensor:
    """torch's conv2d with any (asymmetric) padding applied by F.pad first."""
    (pt, pb), (pl, pr) = as_padding("test", padding)
    return F.conv2d(F.pad(x, (pl, pr, pt, pb)), w, b, stride, 0, dilation, groups)


def _inputs(rng: np.random.Generator, cfg: tuple[Any, ...], dt: DType) -> list[np.ndarray]:
    n, cin, cout, h, w, (kh, kw), _s, _p, _d, g, bias = cfg
    arrays = [_rand(rng, (n, cin, h, w), dt), _rand(rng, (cout, cin // g, kh, kw), dt)]
    if bias:
        arrays.append(_rand(rng, (cout,), dt))
    return arrays


def check_forward(out: np.ndarray, arrays: list[np.ndarray], cfg: tuple[Any, ...], dt: DType) -> None:
    s, p, d, g = cfg[6:10]
    ts = [_t64(a) for a in arrays]
    ref = torch_conv2d(ts[0], ts[1], ts[2] if len(ts) == 3 else None, s, p, d, g).numpy()
    absd = [t.abs() for t in ts]
    scale = torch_conv2d(absd[0], absd[1], absd[2] if len(ts) == 3 else None, s, p, d, g).numpy()
    assert_close_contraction(out, ref, scale, dt)


@DTYPES
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_forward_matches_torch(dt: DType, cfg: tuple[Any, ...]) -> None:
    rng = np.random.default_rng(1)
    arrays = _inputs(rng, cfg, dt)
    s, p, d, g = cfg[6:10]
    y = fl.ops.conv2d(arrays[0], arrays[1], arrays[2] if len(arrays) == 3 else None, stride=s, padding=p,
                      groups=g, dilation=d)
    assert y.dtype is dt
    with fl.trace() as t:
        out = y.numpy()
    assert any(r.impl.startswith("Conv2D[") for r in t.records)
    check_forward(out, arrays, cfg, dt)


def test_configs_cover_every_kernel_form() -> None:
    forms = set()
    for cfg in CONFIGS:
        n, cin, cout, h, w, (kh, kw), s, p, d, g, _ = cfg
        params = Conv2DParams(s, p, d, g)
        _, wo = fl.ops.conv2d(np.zeros((n, cin, h, w), np.float32), np.zeros((cout, cin // g, kh, kw), np.float32),
                              stride=s, padding=p, groups=g, dilation=d).shape[2:]
        if conv.uses_direct((n, cin, h, w), (cout, cin // g, kh, kw), g):
            forms.add("direct")
        elif params.stride == (1, 1) and params.dilation[1] * (kw - 1) * conv.UNIT_MAX_WASTE <= wo:
            forms.add("unit")
        else:
            forms.add("transposed" if kw > wo else "rows")
    assert forms == {"direct", "unit", "rows", "transposed"}


@pytest.mark.parametrize("dt", [DType.F32, DType.BF16], ids=lambda d: d.value)
def test_larger_blocks_and_long_reductions(dt: DType) -> None:
    """Several column blocks straddling images and reductions longer than one K block (KB_MAX)."""
    rng = np.random.default_rng(2)
    for cfg in [(3, 64, 24, 14, 14, (3, 3), 1, 1, 1, 1, True), (1, 272, 8, 9, 9, (3, 3), 1, 0, 1, 1, False),
                (2, 32, 16, 13, 13, (3, 3), 2, 1, 1, 1, True)]:
        arrays = _inputs(rng, cfg, dt)
        s, p, d, g = cfg[6:10]
        out = fl.ops.conv2d(*arrays[:2], arrays[2] if len(arrays) == 3 else None, s, p, g, d).numpy()
        check_forward(out, arrays, cfg, dt)


def test_edge_shapes() -> None:
    rng = np.random.default_rng(3)
    # an empty batch, no output channels: empty outputs of the right shape
    y = fl.ops.conv2d(np.zeros((0, 4, 5, 5), np.float32), _rand(rng, (6, 4, 3, 3), DType.F32), padding=1)
    assert y.numpy().shape == (0, 6, 5, 5)
    y = fl.ops.conv2d(_rand(rng, (2, 4, 5, 5), DType.F32), np.zeros((0, 4, 3, 3), np.float32))
    assert y.numpy().shape == (2, 0, 3, 3)
    # batch 1, a 1x1 output from a kernel exactly the padded input's size
    x, w, b = _rand(rng, (1, 3, 3, 2), DType.F64), _rand(rng, (5, 3, 5, 4), DType.F64), _rand(rng, (5,), DType.F64)
    out = fl.ops.conv2d(x, w, b, padding=1).numpy()
    assert out.shape == (1, 5, 1, 1)
    np.testing.assert_allclose(out[0, :, 0, 0], np.einsum("chw,ochw->o", np.pad(x[0], ((0, 0), (1, 1), (1, 1))), w) + b,
                               rtol=1e-13)


def test_non_contiguous_input() -> None:
    rng = np.random.default_rng(4)
    nhwc = _rand(rng, (2, 7, 8, 6), DType.F32)
    w = _rand(rng, (5, 6, 3, 3), DType.F32)
    x = fl.tensor(nhwc).permute(0, 3, 1, 2)
    out = fl.ops.conv2d(x, w, stride=2, padding=1).numpy()
    cfg = (2, 6, 5, 7, 8, (3, 3), 2, 1, 1, 1, False)
    check_forward(out, [np.ascontiguousarray(nhwc.transpose(0, 3, 1, 2)), w], cfg, DType.F32)


@pytest.mark.parametrize("dt", [DType.F64, DType.F32], ids=lambda d: d.value)
@pytest.mark.parametrize("cfg", CONFIGS[:5], ids=IDS[:5])
def test_lowering_agrees_with_kernel(dt: DType, cfg: tuple[Any, ...]) -> None:
    """The im2col lowering (what runs when no kernel serves a dtype) gives the kernel's values."""
    rng = np.random.default_rng(5)
    arrays = _inputs(rng, cfg, dt)
    params = Conv2DParams(*cfg[6:10])
    lowered = decompose([fl.tensor(a) for a in arrays], params)
    got = fl.realize(lowered, fuse=False)[0].numpy()
    check_forward(got, arrays, cfg, dt)


def _torch_grads(arrays: list[np.ndarray], g: np.ndarray, cfg: tuple[Any, ...], absolute: bool) -> list[np.ndarray]:
    fix = np.abs if absolute else np.asarray
    ts = [_t64(fix(a), grad=True) for a in arrays]
    s, p, d, gr = cfg[6:10]
    out = torch_conv2d(ts[0], ts[1], ts[2] if len(ts) == 3 else None, s, p, d, gr)
    return [t.numpy() for t in torch.autograd.grad(out, ts, _t64(fix(g)))]


@DTYPES
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_grad_matches_torch(dt: DType, cfg: tuple[Any, ...]) -> None:
    """dX (a ConvTranspose2D), dW (a swapped Conv2D) and dBias, for every stride, padding, dilation and
    groups (upstream panics for groups > 1 and stride > 1)."""
    rng = np.random.default_rng(6)
    arrays = _inputs(rng, cfg, dt)
    leaves = [fl.tensor(a) for a in arrays]
    s, p, d, g = cfg[6:10]
    y = fl.ops.conv2d(leaves[0], leaves[1], leaves[2] if len(leaves) == 3 else None, s, p, g, d)
    g_np = _rand(rng, y.shape, dt)
    grads = fl.grad(y, leaves, g_np)
    fl.realize(*grads)
    refs = _torch_grads(arrays, g_np, cfg, absolute=False)
    scales = _torch_grads(arrays, g_np, cfg, absolute=True)
    for got, ref, scale in zip(grads, refs, scales, strict=True):
        assert got.shape == ref.shape and got.dtype is dt
        assert_close_contraction(got.numpy(), ref, scale, dt)


def test_grad_runs_fused_kernels() -> None:
    rng = np.random.default_rng(7)
    x, w = fl.tensor(_rand(rng, (2, 4, 9, 9), DType.F32)), fl.tensor(_rand(rng, (6, 2, 3, 3), DType.F32))
    y = fl.ops.conv2d(x, w, stride=2, padding=1, groups=2)
    with fl.trace() as t:
        fl.realize(*fl.grad(y.square().sum(), [x, w]))
    impls = [r.impl for r in t.records]
    assert any(i.startswith("ConvTranspose2D[") for i in impls)
    assert sum(i.startswith("Conv2D[") for i in impls) == 2  # the forward and the weight gradient


def test_second_order_grad() -> None:
    """The gradient graph is made of Conv2D/ConvTranspose2D, so it is differentiable again."""
    rng = np.random.default_rng(8)
    x_np, w_np = rng.standard_normal((1, 2, 6, 5)), rng.standard_normal((3, 2, 3, 2))
    x, w = fl.tensor(x_np), fl.tensor(w_np)
    (gx,) = fl.grad(fl.ops.conv2d(x, w, stride=2, padding=1).square().sum(), [x])
    (gw,) = fl.grad(gx.square().sum(), [w])
    xt, wt = _t64(x_np, True), _t64(w_np, True)
    (gxt,) = torch.autograd.grad(F.conv2d(xt, wt, None, 2, 1).square().sum(), [xt], create_graph=True)
    (gwt,) = torch.autograd.grad(gxt.square().sum(), [wt])
    np.testing.assert_allclose(gw.numpy(), gwt.numpy(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("sx", "sw", "sb", "kw", "err", "words"),
    [
        ((2, 8, 5, 5), (4, 3, 3, 3), None, {"groups": 2}, fl.ShapeError,
         "conv2d: w has 3 input channels per group, which does not match x's 8 channels / 2 groups"),
        ((2, 6, 5, 5), (4, 3, 3, 3), None, {"groups": 4}, fl.ShapeError, "x has 6 channels, which 4 groups"),
        ((2, 6, 5, 5), (5, 3, 3, 3), None, {"groups": 2}, fl.ShapeError, "5 output channels, which 2 groups"),
        ((2, 6, 5), (4, 6, 3, 3), None, {}, fl.ShapeError, "x must be [N, Cin, H, W]"),
        ((2, 6, 5, 5), (4, 6, 3), None, {}, fl.ShapeError, "w must be [Cout, Cin/groups, Kh, Kw]"),
        ((2, 6, 5, 5), (4, 6, 3, 3), (5,), {}, fl.ShapeError, "bias must be [Cout] = [4]"),
        ((2, 6, 2, 5), (4, 6, 3, 3), None, {}, fl.ShapeError, "padded input height 2 + 0 + 0 is smaller"),
        ((2, 6, 5, 5), (4, 6, 3, 3), None, {"dilation": 3}, fl.ShapeError, "kernel's 7 (size 3, dilation 3)"),
        ((2, 6, 5, 5), (4, 6, 0, 3), None, {}, fl.ShapeError, "at least 1x1"),
        ((2, 6, 5, 5), (4, 6, 3, 3), None, {"stride": 0}, fl.ParamError, "stride must be at least 1"),
        ((2, 6, 5, 5), (4, 6, 3, 3), None, {"stride": (1, 2, 3)}, fl.ParamError, "an int or a pair"),
        ((2, 6, 5, 5), (4, 6, 3, 3), None, {"padding": -1}, fl.ParamError, "non-negative"),
        ((2, 6, 5, 5), (4, 6, 3, 3), None, {"padding": (1, 1, 1, 1)}, fl.ParamError, "((top, bottom), (left, right))"),
        ((2, 6, 5, 5), (4, 6, 3, 3), None, {"groups": 0}, fl.ParamError, "groups must be at least 1"),
        ((2, 6, 5, 5), (4, 6, 3, 3), None, {"dilation": 1.5}, fl.ParamError, "dilation must be an integer"),
    ],
)
def test_build_errors(sx: tuple[int, ...], sw: tuple[int, ...], sb: tuple[int, ...] | None, kw: dict[str, Any],
                      err: type[Exception], words: str) -> None:
    bias = None if sb is None else np.zeros(sb, np.float32)
    with pytest.raises(err) as info:
        fl.ops.conv2d(np.zeros(sx, np.float32), np.zeros(sw, np.float32), bias, **kw)
    assert words in str(info.value) and str(info.value).startswith("conv2d")


def test_dtype_errors() -> None:
    x, w = np.zeros((1, 2, 4, 4), np.float32), np.zeros((3, 2, 3, 3), np.float32)
    with pytest.raises(fl.DTypeError, match="conv2d: w must have x's dtype f32, got f64"):
        fl.ops.conv2d(x, w.astype(np.float64))
    with pytest.raises(fl.DTypeError, match="conv2d: bias must have x's dtype f32, got f16"):
        fl.ops.conv2d(x, w, np.zeros(3, np.float16))
    with pytest.raises(fl.DTypeError, match="conv2d: x must be a float tensor"):
        fl.ops.conv2d(x.astype(np.uint8), w.astype(np.uint8))


def test_padding_forms_and_params() -> None:
    p = Conv2DParams(2, 1, 1, 1)
    assert p.stride == (2, 2) and p.padding == ((1, 1), (1, 1)) and p.dilation == (1, 1)
    assert Conv2DParams((1, 2), (3, 4), (2, 1), 2).padding == ((3, 3), (4, 4))
    assert Conv2DParams(1, ((1, 2), (3, 0)), 1, 1).padding == ((1, 2), (3, 0))
    assert Conv2DParams(np.int64(2), 0, 1, 1).stride == (2, 2)
    entry = default_registry().entry(FusedOps.CONV2D)
    assert entry.name == "Conv2D" and entry.arity == (2, 3) and entry.vjp is not None and entry.decompose is not None


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 2), groups=st.integers(1, 3), cg=st.integers(1, 3), mg=st.integers(1, 6),
    kh=st.integers(1, 4), kw=st.integers(1, 4), sh=st.integers(1, 3), sw=st.integers(1, 3),
    dh=st.integers(1, 2), dw=st.integers(1, 2), pads=st.tuples(*[st.integers(0, 2)] * 4),
    extra=st.tuples(st.integers(0, 7), st.integers(0, 7)), bias=st.booleans(), seed=st.integers(0, 2**16),
)
def test_property_forward(n: int, groups: int, cg: int, mg: int, kh: int, kw: int, sh: int, sw: int, dh: int,
                          dw: int, pads: tuple[int, int, int, int], extra: tuple[int, int], bias: bool,
                          seed: int) -> None:
    pt, pb, pl, pr = pads
    h = max(1, dh * (kh - 1) + 1 - pt - pb + extra[0])
    w = max(1, dw * (kw - 1) + 1 - pl - pr + extra[1])
    cfg = (n, cg * groups, mg * groups, h, w, (kh, kw), (sh, sw), ((pt, pb), (pl, pr)), (dh, dw), groups, bias)
    rng = np.random.default_rng(seed)
    arrays = _inputs(rng, cfg, DType.F32)
    out = fl.ops.conv2d(arrays[0], arrays[1], arrays[2] if bias else None, cfg[6], cfg[7], groups, cfg[8]).numpy()
    check_forward(out, arrays, cfg, DType.F32)


@settings(max_examples=12, deadline=None)
@given(
    groups=st.integers(1, 2), cg=st.integers(1, 2), mg=st.integers(1, 5), kh=st.integers(1, 3),
    kw=st.integers(1, 3), sh=st.integers(1, 3), sw=st.integers(1, 3), dh=st.integers(1, 2), dw=st.integers(1, 2),
    pads=st.tuples(*[st.integers(0, 2)] * 4), extra=st.tuples(st.integers(0, 5), st.integers(0, 5)),
    seed=st.integers(0, 2**16),
)
def test_property_grad(groups: int, cg: int, mg: int, kh: int, kw: int, sh: int, sw: int, dh: int, dw: int,
                       pads: tuple[int, int, int, int], extra: tuple[int, int], seed: int) -> None:
    pt, pb, pl, pr = pads
    h = max(1, dh * (kh - 1) + 1 - pt - pb + extra[0])
    w = max(1, dw * (kw - 1) + 1 - pl - pr + extra[1])
    cfg = (2, cg * groups, mg * groups, h, w, (kh, kw), (sh, sw), ((pt, pb), (pl, pr)), (dh, dw), groups, True)
    rng = np.random.default_rng(seed)
    arrays = _inputs(rng, cfg, DType.F64)
    leaves = [fl.tensor(a) for a in arrays]
    y = fl.ops.conv2d(*leaves, cfg[6], cfg[7], groups, cfg[8])
    g_np = rng.standard_normal(y.shape)
    grads = fl.realize(*fl.grad(y, leaves, g_np))
    for got, ref, scale in zip(grads, _torch_grads(arrays, g_np, cfg, False), _torch_grads(arrays, g_np, cfg, True),
                               strict=True):
        assert_close_contraction(got.numpy(), ref, scale, DType.F64)
