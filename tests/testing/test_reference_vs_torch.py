"""Every function of `fuel.testing.reference` against an oracle of its own, once, on a small case or two:
torch in float64 (its functional ops, autograd, or the recurrence written out as a torch loop), the gguf
package and bitsandbytes for the quantised weights. The contract suite trusts these references; this
file (with test_reference_attention_vs_torch for the attention ones) is what they are trusted on. Each
registered entry is called through `reference(name, …)`, as `fuel verify` and the tests call it.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import bitsandbytes.functional as bnbf
import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fuel.testing.reference as R
from fuel.dtype import DType
from fuel.graph.registry.causal_conv1d import CausalConv1dParams
from fuel.graph.registry.conv2d import Conv2DParams
from fuel.graph.registry.conv_transpose2d import ConvTranspose2DParams
from fuel.graph.registry.fused_linear import FusedLinearParams
from fuel.graph.registry.fused_softmax_cross_entropy import FusedSoftmaxCrossEntropyParams
from fuel.graph.registry.inplace_affine import InplaceAffineParams
from fuel.graph.registry.layer_norm_last_dim import LayerNormLastDimParams
from fuel.graph.registry.layer_norm_last_dim_backward import LayerNormLastDimBackwardParams
from fuel.graph.registry.nf4_matmul import Nf4MatmulParams
from fuel.graph.registry.powi_backward import PowIBackwardParams
from fuel.graph.registry.qmatmul import QMatMulParams
from fuel.graph.registry.reduce_max_to_backward import ReduceMaxToBackwardParams
from fuel.graph.registry.rms_norm_last_dim import RmsNormLastDimParams
from fuel.graph.registry.rms_norm_last_dim_backward import RmsNormLastDimBackwardParams
from fuel.graph.registry.rope import RopeParams
from fuel.graph.registry.selective_scan import SelectiveScanParams
from fuel.graph.registry.softmax_last_dim import SoftmaxLastDimParams
from fuel.graph.registry.softmax_last_dim_backward import SoftmaxLastDimBackwardParams
from fuel.graph.registry.ssd_chunk_scan import SsdChunkScanParams
from fuel.quant import QuantType
from fuel.testing.reference import (
    causal_conv1d,
    conv2d,
    conv_transpose2d,
    fused_linear,
    fused_softmax_cross_entropy,
    nf4_matmul,
    qmatmul,
    rope,
    selective_scan,
    softmax_last_dim,
    ssd_chunk_scan,
)
from tests.testing import test_reference_attention_vs_torch as attention_checks
from tests.testing.reference_checks import CHECKED, NOT_MATH, checks, close, grad_of, t64


def test_every_public_function_has_an_oracle() -> None:
    assert attention_checks.CONFIGS  # imported: its checks are recorded too
    modules = {"__init__": R} | {i.name: importlib.import_module(f"{R.__name__}.{i.name}")
                                  for i in pkgutil.iter_modules(R.__path__)}
    for name, mod in modules.items():
        public = {n for n, f in inspect.getmembers(mod, inspect.isfunction)
                  if f.__module__ == mod.__name__ and not n.startswith("_")}
        assert public - NOT_MATH.get(name, set()) == CHECKED.get(name, set()), name


RNG = np.random.default_rng(2024)


def randn(*shape: int, scale: float = 1.0) -> np.ndarray:
    return RNG.standard_normal(shape) * scale


# ---- softmax, norms, rope, cross-entropy -------------------------------------------------------------


@checks("softmax_last_dim", "softmax64", "softmax_backward64", "softmax_backward_scale")
def test_softmax() -> None:
    x = randn(6, 33, scale=3.0)
    x[1, ::4] = -np.inf
    close(R.reference("SoftmaxLastDim", [x], SoftmaxLastDimParams()), torch.softmax(t64(x), -1))
    y, g = torch.softmax(t64(x), -1).numpy(), randn(6, 33)
    (want,) = grad_of(lambda a: torch.softmax(a, -1), [x], g)
    s = softmax_last_dim.softmax_backward_scale([y, g], None, None)
    close(R.reference("SoftmaxLastDimBackward", [y, g], SoftmaxLastDimBackwardParams()), want, s)
    ty, tg = t64(y).abs(), t64(g).abs()
    close(s, ty * (tg + (tg * ty).sum(-1, keepdim=True)))


@checks("rms_norm_last_dim", "rms_norm64", "rms_norm_backward64")
@checks("layer_norm_last_dim", "layer_norm64", "layer_norm_backward64")
@checks("norm_rows", "exponent", "scaled", "centred")  # the rescaling both norms apply: rows near overflow
@pytest.mark.parametrize("eps", [1e-6, 0.1])
def test_norms(eps: float) -> None:
    x = randn(5, 40, scale=2.0)
    x[1] *= 1e100  # squares near float64's overflow: the references rescale
    x[2] = 1.5  # a constant row
    g = randn(5, 40)
    n = (x.shape[-1],)
    for name, cls, fn in (("RmsNormLastDim", RmsNormLastDimParams, lambda a: F.rms_norm(a, n, eps=eps)),
                          ("LayerNormLastDim", LayerNormLastDimParams, lambda a: F.layer_norm(a, n, eps=eps))):
        close(R.reference(name, [x], cls(eps)), fn(t64(x)))
    for name, cls, fn in (
            ("RmsNormLastDimBackward", RmsNormLastDimBackwardParams, lambda a: F.rms_norm(a, n, eps=eps)),
            ("LayerNormLastDimBackward", LayerNormLastDimBackwardParams, lambda a: F.layer_norm(a, n, eps=eps))):
        # the terms g·rstd and x̂·mean(g·x̂)·rstd cancel: the bound is on their size
        c = x if name.startswith("Rms") else x - x.mean(-1, keepdims=True)
        rstd = 1 / np.sqrt((c * c).mean(-1, keepdims=True) + eps)
        size = np.abs(g).sum(-1, keepdims=True) * rstd * np.ones_like(x)
        close(R.reference(name, [x, g], cls(eps)), grad_of(fn, [x], g)[0], size, 1e-10)
    # one-element rows: the gradient g·eps/(x² + eps)^1.5 is what is left after the cancellation
    x1, g1 = randn(4, 1, scale=0.3), randn(4, 1)
    want = grad_of(lambda a: F.rms_norm(a, (1,), eps=eps), [x1], g1)[0]
    close(R.reference("RmsNormLastDimBackward", [x1, g1], RmsNormLastDimBackwardParams(eps)), want,
          np.abs(g1) / np.sqrt(x1 * x1 + eps), 1e-10)


@checks("rope", "rope64", "rope_scale", "rope_tables", "rotate_half64")
def test_rope() -> None:
    """Against transformers' Llama rotate_half and apply_rotary_pos_emb (torch float64)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, rotate_half

    x = randn(2, 3, 7, 16, scale=3.0)
    cos, sin = randn(7, 16), randn(7, 16)  # any tables, halves differing
    want, _ = apply_rotary_pos_emb(t64(x), t64(x), t64(cos), t64(sin), unsqueeze_dim=0)
    close(R.reference("Rope", [x, cos, sin], RopeParams()), want)
    close(rope.rotate_half64(x), rotate_half(t64(x)))
    close(rope.rope_scale([x, cos, sin], None, None), t64(x).abs() * t64(cos).abs()
          + rotate_half(t64(x)).abs() * t64(sin).abs())
    c, s = rope.rope_tables(9, 8, base=500.0, start=3)
    inv = 1.0 / (500.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    ang = torch.arange(3, 12, dtype=torch.float64)[:, None] * inv[None, :]
    close(c, torch.cat([ang, ang], -1).cos(), np.ones_like(c))
    close(s, torch.cat([ang, ang], -1).sin(), np.ones_like(s))


@checks("fused_softmax_cross_entropy", "cross_entropy64", "cross_entropy_scale")
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_cross_entropy(reduction: str) -> None:
    x = randn(6, 40, scale=8.0)
    t = RNG.integers(0, 40, 6)
    t[[1, 4]] = -100
    p = FusedSoftmaxCrossEntropyParams(reduction, -100)
    want = F.cross_entropy(t64(x), torch.from_numpy(t), ignore_index=-100, reduction=reduction)
    s = fused_softmax_cross_entropy.cross_entropy_scale([x, t], p, None)
    close(R.reference("FusedSoftmaxCrossEntropy", [x, t], p), want, s)
    tx = t64(x)
    d = tx - tx.amax(-1, keepdim=True)
    rows = torch.where(torch.from_numpy(t != -100), 1 + (torch.softmax(tx, -1) * d.abs()).sum(-1), 0.0)
    size = rows if reduction == "none" else rows.sum() / (1 if reduction == "sum" else int((t != -100).sum()))
    close(s, size)


# ---- convolutions and linear -------------------------------------------------------------------------


@checks("conv2d", "conv2d64", "conv2d_scale")
@pytest.mark.parametrize(("xs", "ws", "p"), [
    ((2, 4, 7, 9), (6, 2, 3, 3), Conv2DParams(1, 1, 1, 2)),
    ((1, 6, 8, 7), (4, 3, 2, 3), Conv2DParams((2, 3), ((1, 0), (2, 1)), (2, 1), 2)),
], ids=["grouped", "strided-dilated-asymmetric"])
def test_conv2d(xs: tuple[int, ...], ws: tuple[int, ...], p: Conv2DParams) -> None:
    x, w, b = randn(*xs), randn(*ws), randn(ws[0])
    (pt, pb), (pl, pr) = p.padding

    def torch_conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.conv2d(F.pad(x, (pl, pr, pt, pb)), w, b, p.stride, 0, p.dilation, p.groups)

    want = torch_conv(t64(x), t64(w), t64(b))
    scale = torch_conv(t64(x).abs(), t64(w).abs(), t64(b).abs())
    close(R.reference("Conv2D", [x, w, b], p), want, scale)
    close(R.reference("Conv2D", [x, w], p), want - t64(b)[:, None, None], scale)
    close(conv2d.conv2d_scale([x, w, b], p, None), scale)


@checks("conv_transpose2d", "conv_transpose2d64", "conv_transpose2d_scale")
@pytest.mark.parametrize("p", [ConvTranspose2DParams(2, 1, 1, 1, 2), ConvTranspose2DParams(3, 2, 2, 2, 1)],
                         ids=["grouped-output-padding", "dilated"])
def test_conv_transpose2d(p: ConvTranspose2DParams) -> None:
    x, w = randn(2, 4, 5, 6), randn(4, 3, 3, 3)
    (pt, _), (pl, _) = p.padding

    def torch_conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.conv_transpose2d(x, w, None, p.stride, (pt, pl), p.output_padding, p.groups, p.dilation)

    scale = torch_conv(t64(x).abs(), t64(w).abs())
    close(R.reference("ConvTranspose2D", [x, w], p), torch_conv(t64(x), t64(w)), scale)
    close(conv_transpose2d.conv_transpose2d_scale([x, w], p, None), scale)


@checks("causal_conv1d", "causal_conv1d64", "causal_conv1d_scale")
@pytest.mark.parametrize("silu", [False, True])
def test_causal_conv1d(silu: bool) -> None:
    x, w, b = randn(2, 5, 12 + 3, scale=3.0), randn(5, 1, 4), randn(5)  # pre-padded by K − 1

    def torch_conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.conv1d(x, w, b, groups=x.shape[1])

    want = torch_conv(t64(x), t64(w), t64(b))
    scale = torch_conv(t64(x).abs(), t64(w).abs(), t64(b).abs())
    close(R.reference("CausalConv1d", [x, w, b], CausalConv1dParams(silu)), F.silu(want) if silu else want, scale)
    close(causal_conv1d.causal_conv1d_scale([x, w, b], CausalConv1dParams(silu), None), scale)


@checks("fused_linear", "linear64", "linear_scale", "expand_b64")
@pytest.mark.parametrize(("sa", "sb"), [((3, 17), (17, 5)), ((2, 6, 3, 8), (1, 2, 8, 5))], ids=["shared", "gqa"])
def test_linear(sa: tuple[int, ...], sb: tuple[int, ...]) -> None:
    a, b, bias = randn(*sa), randn(*sb), randn(sb[-1])
    tb = t64(b)
    for d in range(len(sb) - 2):  # b's batch dims repeated up to a's, each block interleaved
        tb = tb.repeat_interleave(sa[d] // sb[d], d)
    close(fused_linear.expand_b64(b, sa[:-2]), tb, np.ones(tb.shape))
    scale = t64(a).abs() @ tb.abs() + t64(bias).abs()
    close(R.reference("FusedLinear", [a, b, bias], FusedLinearParams()), t64(a) @ tb + t64(bias), scale)
    close(fused_linear.linear_scale([a, b, bias], None), scale)


# ---- quantised weights -------------------------------------------------------------------------------


def gguf_dequant(raw: np.ndarray, qt: QuantType, n: int, k: int) -> torch.Tensor:
    """W [n, k] by the gguf package; Q8_1 (whose size gguf-py has wrong) as the Q8_0 blocks it holds:
    drop each block's f16 sum (bytes 2-3), keep d and the 32 int8 values."""
    if qt is QuantType.Q8_1:
        blocks = raw.reshape(-1, qt.block_bytes)
        raw, qt = np.concatenate([blocks[:, :2], blocks[:, 4:]], 1), QuantType.Q8_0
    values = gguf.quants.dequantize(np.ascontiguousarray(raw), gguf.GGMLQuantizationType[qt.ggml_name])
    return t64(values).reshape(n, k)


@checks("qmatmul", "qmatmul64", "qmatmul_scale", "dequant64")
@pytest.mark.parametrize("qt", [QuantType.Q4_0, QuantType.Q8_0, QuantType.Q8_1, QuantType.Q4K, QuantType.Q6K],
                         ids=lambda q: q.ggml_name)
@pytest.mark.parametrize("transpose", [False, True])
def test_qmatmul(qt: QuantType, transpose: bool) -> None:
    n, k = 6, 2 * qt.block_elements
    raw = qmatmul.random_weight(RNG, qt, n, k)
    words, p = qmatmul.as_words(raw), QMatMulParams(qt, k, n, transpose)
    w = gguf_dequant(raw, qt, n, k)
    close(qmatmul.dequant64(words, p), w, np.ones((n, k)), 0.0)
    a = RNG.standard_normal((3, n if transpose else k)).astype(np.float32)
    wt = w if transpose else w.T
    scale = t64(a).abs() @ wt.abs()
    close(R.reference("QMatMul", [a, words], p), t64(a) @ wt, scale)
    close(qmatmul.qmatmul_scale([a.astype(np.float64), words], p), scale)


@checks("nf4_matmul", "nf4_matmul64", "nf4_scale", "dequant64")
@pytest.mark.parametrize("transpose", [False, True])
def test_nf4_against_bitsandbytes(transpose: bool) -> None:
    """bitsandbytes quantises; its dequantize_4bit (f32, NF4[code]·absmax rounded once) is the oracle."""
    n, k, bs = 8, 256, 64
    q, st = bnbf.quantize_4bit(torch.tensor(randn(n, k, scale=0.05), dtype=torch.float32), blocksize=bs,
                               quant_type="nf4")
    packed, absmax = q.numpy().reshape(n, k // 2), st.absmax.numpy().reshape(n, k // bs)
    w = bnbf.dequantize_4bit(q, st).double()
    close(nf4_matmul.dequant64(packed, absmax, bs), w, w.abs(), 2.0**-24)
    a = randn(3, n if transpose else k)
    wt = w if transpose else w.T
    scale = t64(a).abs() @ wt.abs()
    close(R.reference("Nf4Matmul", [a, packed, absmax], Nf4MatmulParams(bs, transpose)), t64(a) @ wt,
          scale, 2.0**-23)
    close(nf4_matmul.nf4_scale([a, packed, absmax], Nf4MatmulParams(bs, transpose)), scale, scale, 2.0**-23)


# ---- scans -------------------------------------------------------------------------------------------


def mamba1_loop(u: torch.Tensor, d: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                sizes: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """h_t = exp(d_t·a)·h_{t−1} + d_t·u_t·b_t, y_t = Σ_n h_t·c_t (on |d·u|, |b|, |c| with `sizes`)."""
    h = torch.zeros(u.shape[0], u.shape[2], a.shape[1], dtype=torch.float64)
    ys = []
    for t in range(u.shape[1]):
        du = d[:, t, :, None] * u[:, t, :, None]
        bt, ct = (b[:, t, None, :].abs(), c[:, t, None, :].abs()) if sizes else (b[:, t, None, :], c[:, t, None, :])
        h = torch.exp(d[:, t, :, None] * a) * h + (du.abs() if sizes else du) * bt
        ys.append((h * ct).sum(-1))
    return torch.stack(ys, 1), h


@checks("selective_scan", "selective_scan64", "selective_scan_scale", "softplus64")
@pytest.mark.parametrize("softplus", [False, True])
def test_selective_scan(softplus: bool) -> None:
    bsz, length, dim, ns = 2, 9, 5, 4
    u, b, c = randn(bsz, length, dim), randn(bsz, length, ns), randn(bsz, length, ns)
    delta = randn(bsz, length, dim, scale=12.0) if softplus else np.abs(randn(bsz, length, dim, scale=0.3))
    a = -np.abs(randn(dim, ns)) - 0.1
    d = F.softplus(t64(delta)) if softplus else t64(delta)  # torch's threshold is 20, as Mamba's
    close(selective_scan.softplus64(delta), F.softplus(t64(delta)))
    want_y, want_h = mamba1_loop(t64(u), d, t64(a), t64(b), t64(c))
    size_y, size_h = mamba1_loop(t64(u), d, t64(a), t64(b), t64(c), sizes=True)
    y, h = R.reference("SelectiveScan", [u, delta, a, b, c], SelectiveScanParams(softplus))
    close(y, want_y, size_y)
    close(h, want_h, size_h)
    sy, sh = selective_scan.selective_scan_scale([u, delta, a, b, c], SelectiveScanParams(softplus), None)
    close(sy, size_y)
    close(sh, size_h)


def mamba2_loop(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                sizes: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """h ← exp(dt·a_h)·h + dt·x ⊗ b, y_t = h·c_t, head by head (on |dt·x|, |b|, |c| with `sizes`)."""
    nb, length, nh, p = x.shape
    h = torch.zeros(nb, nh, p, b.shape[3], dtype=torch.float64)
    ys = []
    for t in range(length):
        u = dt[:, t, :, None] * x[:, t]
        bt, ct = (b[:, t].abs(), c[:, t].abs()) if sizes else (b[:, t], c[:, t])
        h = torch.exp(dt[:, t] * a)[:, :, None, None] * h + (u.abs() if sizes else u)[..., None] * bt[:, :, None, :]
        ys.append((h * ct[:, :, None, :]).sum(-1))
    return torch.stack(ys, 1), h


@checks("ssd_chunk_scan", "ssd_chunk_scan64", "ssd_chunk_scan_scale", "ssd_scan64")
def test_ssd_chunk_scan() -> None:
    shape = (2, 10, 3, 4, 5)
    x, dt, a, b, c = ssd_chunk_scan.mamba2_inputs(RNG, shape, DType.F64, 4.0)
    tx, tdt, ta, tb, tc = (t64(v) for v in (x, dt, a, b, c))
    want_y, want_h = mamba2_loop(tx, tdt, ta, tb, tc)
    size_y, size_h = mamba2_loop(tx, tdt, ta, tb, tc, sizes=True)
    y, h = R.reference("SsdChunkScan", [x, dt, a, b, c], SsdChunkScanParams(4))
    close(y, want_y, size_y)
    close(h, want_h, size_h)
    close(ssd_chunk_scan.ssd_scan64(x, dt, a, b, c)[0], want_y, size_y)
    sy, sh = ssd_chunk_scan.ssd_chunk_scan_scale([x, dt, a, b, c], None, None)
    close(sy, size_y)
    close(sh, size_h)


# ---- backward helpers, inplace affine ----------------------------------------------------------------


@checks("reduce_max_to_backward", "reduce_max_to_backward64")
@pytest.mark.parametrize(("shape", "dims", "target"), [
    ((7, 33), (1,), (7, 1)), ((2, 3, 16), (0, 1), (16,)), ((4, 5, 6), (1,), (4, 1, 6)),
], ids=str)
def test_reduce_max_to_backward(shape: tuple[int, ...], dims: tuple[int, ...], target: tuple[int, ...]) -> None:
    """torch's amax spreads the gradient evenly over tied maxima, as the reference does; values rounded
    to integers tie often, and a row of -inf ties everywhere."""
    x = np.round(randn(*shape, scale=1.5))
    x.reshape(-1, shape[-1])[0] = -np.inf
    g = randn(*target)
    (want,) = grad_of(lambda a: torch.amax(a, dims, keepdim=len(target) == len(shape)), [x], g)
    close(R.reference("ReduceMaxToBackward", [x, g], ReduceMaxToBackwardParams()), want)


@checks("powi_backward", "powi_backward64", "powi_backward_scale")
@pytest.mark.parametrize("exp", [-3, -1, 0, 1, 2, 7])
def test_powi_backward(exp: int) -> None:
    x = np.sign(randn(5, 9)) * (0.25 + np.abs(randn(5, 9)))
    g = randn(5, 9)
    (want,) = grad_of(lambda a: a**exp, [x], g)
    got = R.reference("PowIBackward", [x, g], PowIBackwardParams(exp))
    close(got, want, np.abs(want))
    close(R.scale("PowIBackward", [x, g], PowIBackwardParams(exp), got), torch.from_numpy(want).abs())


@checks("inplace_affine", "inplace_affine64", "inplace_affine_scale")
def test_inplace_affine() -> None:
    x = 1 + randn(4, 30, scale=1e-2)  # 3·x − 3 cancels
    x[0, :3] = [np.inf, -np.inf, np.nan]
    p = InplaceAffineParams(3.0, -3.0)
    size = t64(x).abs() * 3.0 + 3.0
    close(R.reference("InplaceAffine", [x], p), 3.0 * t64(x) - 3.0, size, 2.0**-52)
    close(R.scale("InplaceAffine", [x], p, np.zeros(x.shape)), size)
