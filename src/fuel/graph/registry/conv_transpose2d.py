"""ConvTranspose2D (id 11): the transposed (fractionally strided) 2-D convolution, NCHW, no bias.

x `[N, Cin, H, W]`, w `[Cin, Cout/groups, Kh, Kw]` (Cin first, as torch's conv_transpose2d); output
`[N, Cout, Ho, Wo]` with `Ho = (H − 1)·sh − top − bottom + dh·(Kh − 1) + output_padding_h + 1`:

    out[n, g·Cout/groups + co, ih·sh + kh·dh − top, iw·sw + kw·dw − left] += x[n, ci, ih, iw] · w[ci, co, kh, kw]

for ci in group g, positions outside the output dropped. It is the adjoint of Conv2D with the same
geometry: `output_padding < max(stride, dilation)` (per axis) only adds rows the scatter may reach at
the bottom/right. Padding may be asymmetric, `((top, bottom), (left, right))`, as Conv2D's, so the
input gradient of any Conv2D is one ConvTranspose2D. NaN or ±inf in w reach the output through a zero
x (torch's semantics; upstream's kernel skips zero inputs).

Gradients: dX is a Conv2D of the upstream gradient with w (same stride, padding, dilation, groups),
dW the Conv2D weight gradient with the roles of x and the upstream gradient swapped.

The lowering is col2im: one batched MatMul `wᵀ·x` per (batch, group), one IndexAdd scattering every
tap into a zero buffer that holds the whole uncropped output, then the crop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fuel.dtype import DType
from fuel.errors import ParamError, ShapeError
from fuel.graph.node import Op, Shape
from fuel.graph.prims import make
from fuel.graph.registry import NOT_DIFFERENTIABLE, FusedOpEntry, FusedOpFamily, FusedOps, fused_node
from fuel.graph.registry.common import float_like_first, operand_nodes
from fuel.graph.registry.conv_geometry import (
    Padding,
    Pair,
    canonicalise,
    check_extents,
    check_ranks,
    tap_positions,
    transpose_out,
)
from fuel.graph.tensor import Tensor, TensorLike, as_tensor, zeros

NAME = "conv_transpose2d"


@dataclass(frozen=True)
class ConvTranspose2DParams:
    """Canonical geometry (pairs; padding `((top, bottom), (left, right))`), normalised on construction."""

    stride: Pair
    padding: Padding
    output_padding: Pair
    dilation: Pair
    groups: int

    def __post_init__(self) -> None:
        canonicalise(self, NAME)
        for axis, op, s, d in zip(("height", "width"), self.output_padding, self.stride, self.dilation, strict=True):
            if op >= max(s, d):
                raise ParamError(f"conv_transpose2d: output_padding {op} along the {axis} must be smaller than "
                                 f"max(stride {s}, dilation {d})")


def output_hw(x: Shape, w: Shape, p: ConvTranspose2DParams) -> tuple[int, int]:
    (pt, pb), (pl, pr) = p.padding
    return (transpose_out(x[2], pt, pb, w[2], p.stride[0], p.dilation[0], p.output_padding[0]),
            transpose_out(x[3], pl, pr, w[3], p.stride[1], p.dilation[1], p.output_padding[1]))


def shape_rule(shapes: tuple[Shape, ...], params: ConvTranspose2DParams) -> Shape:
    x, w = shapes
    check_ranks(NAME, x, w, "[Cin, Cout/groups, Kh, Kw]")
    n, cin = x[0], x[1]
    wc, cog = w[0], w[1]
    g = params.groups
    if wc != cin:
        raise ShapeError(f"conv_transpose2d: w has {wc} input channels (its first dim), x has {cin}")
    if cin % g:
        raise ShapeError(f"conv_transpose2d: x has {cin} channels, which {g} groups do not divide")
    check_extents(NAME, x, w)
    ho, wo = output_hw(x, w, params)
    if ho < 1 or wo < 1:
        raise ShapeError(f"conv_transpose2d: padding {list(params.padding)} crops the whole output of x {list(x)} "
                         f"with w {list(w)} (it would be {ho}x{wo})")
    return (n, cog * g, ho, wo)


def dtype_rule(dtypes: tuple[DType, ...], params: ConvTranspose2DParams) -> DType:
    return float_like_first(NAME, ("x", "w"), dtypes)


def decompose(inputs: list[Tensor], params: ConvTranspose2DParams) -> Tensor:
    """col2im: cols = wᵀ·x per (batch, group), scattered with one IndexAdd into the uncropped output."""
    x, w = inputs
    n, cin, h, wd = x.shape
    _, cog, kh, kw = w.shape
    g = params.groups
    cout = cog * g
    ho, wo = output_hw(x.shape, w.shape, params)
    (pt, _), (pl, _) = params.padding
    (sh, sw), (dh, dw) = params.stride, params.dilation
    # Holds every tap (its natural extent) and every output position (top/left shifted by the padding).
    hbuf = max((h - 1) * sh + dh * (kh - 1) + 1, pt + ho)
    wbuf = max((wd - 1) * sw + dw * (kw - 1) + 1, pl + wo)
    wt = w.reshape(g, cin // g, cog * kh * kw).transpose(-2, -1)  # [g, Cout/g·Kh·Kw, Cin/g]
    cols = (wt @ x.reshape(n, g, cin // g, h * wd)).reshape(n, cout, kh * kw * h * wd)
    # Every (kh, kw, ih, iw) tap's position in the uncropped [hbuf, wbuf] plane.
    idx = as_tensor(tap_positions((kh, kw), (h, wd), wbuf, params.stride, params.dilation))
    base = zeros((n, cout, hbuf * wbuf), x.dtype)
    acc = Tensor(make(Op.INDEX_ADD, (base.node, idx.node, cols.node), 2)) if n and cout else base
    return acc.reshape(n, cout, hbuf, wbuf)[:, :, pt:pt + ho, pl:pl + wo]


def vjp(inputs: list[Tensor], params: ConvTranspose2DParams, out: Tensor, grad_out: Tensor
        ) -> list[Tensor | None]:
    """dX = Conv2D(g, w) (cropped to x when output_padding ≥ stride), dW = Conv2D weight gradient of g → x."""
    from fuel.graph.registry.conv2d import conv2d, weight_grad

    x, w = inputs
    g = grad_out
    h, wd = x.shape[2], x.shape[3]
    dx = conv2d(g, w, None, params.stride, params.padding, params.groups, params.dilation)
    if dx.shape[2:] != (h, wd):
        dx = dx[:, :, :h, :wd]
    dw = weight_grad(g, x, (w.shape[2], w.shape[3]), params.stride, params.padding, params.dilation, params.groups)
    return [dx, dw]


def conv_transpose2d(x: TensorLike, w: TensorLike, stride: Any = 1, padding: Any = 0, output_padding: Any = 0,
                     dilation: Any = 1, groups: int = 1) -> Tensor:
    """Transposed 2-D convolution (torch.nn.functional.conv_transpose2d without bias; note torch's own
    positional order is `output_padding, groups, dilation`). x `[N, Cin, H, W]`, w `[Cin, Cout/groups, Kh, Kw]`.

    stride, output_padding and dilation: an int or `(h, w)`; padding: an int, `(ph, pw)` or
    `((top, bottom), (left, right))`, cropped from the output.
    """
    params = ConvTranspose2DParams(stride, padding, output_padding, dilation, groups)
    return Tensor(fused_node(FusedOps.CONV_TRANSPOSE2D, operand_nodes(x, w), params))


ENTRY = FusedOpEntry(
    id=FusedOps.CONV_TRANSPOSE2D,
    name="ConvTranspose2D",
    family=FusedOpFamily.FORWARD,
    params=ConvTranspose2DParams,
    arity=(2,),
    shape_rule=shape_rule,
    dtype_rule=dtype_rule,
    decompose=decompose,
    # The inventory's metadata (upstream panics); `vjp` below is exact.
    backward=NOT_DIFFERENTIABLE,
    vjp=vjp,
    pattern=None,
    no_pattern=(
        "its col2im lowering scatters through an index table of the geometry (IndexAdd), not a spelling a "
        "user writes: models call the op"),
    output_views=None,
    destructive_input=None,
)
