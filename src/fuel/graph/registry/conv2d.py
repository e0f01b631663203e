"""Conv2D (id 6): 2-D cross-correlation, NCHW, with stride, padding, dilation and groups.

x `[N, Cin, H, W]`, w `[Cout, Cin/groups, Kh, Kw]`, optional bias `[Cout]`; output `[N, Cout, Ho, Wo]`
with `Ho = (H + top + bottom − dh·(Kh − 1) − 1) // sh + 1` (likewise Wo):

    out[n, co, oh, ow] = bias[co] + Σ_{ci, kh, kw} x[n, g·Cin/groups + ci, oh·sh + kh·dh − top,
                                                      ow·sw + kw·dw − left] · w[co, ci, kh, kw]

where g = co // (Cout/groups) and taps outside x read 0. Padding may be asymmetric
(`((top, bottom), (left, right))`, see conv_geometry). The inventory's Conv2D has no dilation; this
one does (default 1), because the gradients need it: dW of a strided convolution is a convolution
dilated by the stride, and dX of a dilated ConvTranspose2D is a dilated convolution.

Gradients, for every stride, padding, dilation and groups: dX is a ConvTranspose2D of the upstream
gradient with w (its output_padding recovers the rows the last window did not reach), dW a Conv2D of x
against the upstream gradient with batch and channels swapped (stride and dilation trade places,
groups ride along as the batch axis), dBias a sum.

The lowering is the im2col recipe: pad, one IndexSelect gathering every window (the index is baked
when the graph is lowered), one batched MatMul with the group as a batch axis, the bias added.
The pattern finds that recipe again wherever it is written (an unfold by a constant tap table, then a
grouped matmul), reading stride and dilation off the table; a table of any other geometry stays
primitive. A hand matcher: the table is a constant array, which a template cannot hold.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuel.dtype import DType
from fuel.errors import DTypeError, ShapeError
from fuel.graph.functions import pad
from fuel.graph.node import Node, Op, Shape
from fuel.graph.registry import NOT_DIFFERENTIABLE, FusedOpEntry, FusedOpFamily, FusedOps, Match, fused_node
from fuel.graph.registry.common import operand_nodes
from fuel.graph.registry.conv_geometry import (
    Padding,
    Pair,
    canonicalise,
    check_extents,
    check_ranks,
    conv_out,
    conv_rest,
    tap_positions,
)
from fuel.graph.tensor import Tensor, TensorLike, as_tensor, zeros

NAME = "conv2d"


@dataclass(frozen=True)
class Conv2DParams:
    """Canonical geometry: pairs, and padding `((top, bottom), (left, right))`. Other accepted forms
    (ints, symmetric pairs) are normalised on construction."""

    stride: Pair
    padding: Padding
    dilation: Pair
    groups: int

    def __post_init__(self) -> None:
        canonicalise(self, NAME)


def output_hw(x: Shape, w: Shape, p: Conv2DParams) -> tuple[int, int]:
    (pt, pb), (pl, pr) = p.padding
    return (conv_out(x[2], pt, pb, w[2], p.stride[0], p.dilation[0]),
            conv_out(x[3], pl, pr, w[3], p.stride[1], p.dilation[1]))


def shape_rule(shapes: tuple[Shape, ...], params: Conv2DParams) -> Shape:
    x, w = shapes[0], shapes[1]
    check_ranks(NAME, x, w, "[Cout, Cin/groups, Kh, Kw]")
    n, cin, h, wd = x
    cout, cg, kh, kw = w
    g = params.groups
    if cin % g:
        raise ShapeError(f"conv2d: x has {cin} channels, which {g} groups do not divide")
    if cg * g != cin:
        raise ShapeError(f"conv2d: w has {cg} input channels per group, which does not match x's {cin} channels "
                         f"/ {g} groups")
    if cout % g:
        raise ShapeError(f"conv2d: w has {cout} output channels, which {g} groups do not divide")
    check_extents(NAME, x, w)
    if len(shapes) == 3 and shapes[2] != (cout,):
        raise ShapeError(f"conv2d: bias must be [Cout] = [{cout}], got {list(shapes[2])}")
    (pt, pb), (pl, pr) = params.padding
    (dh, dw) = params.dilation
    for axis, size, lo, hi, k, d in (("height", h, pt, pb, kh, dh), ("width", wd, pl, pr, kw, dw)):
        if size + lo + hi < d * (k - 1) + 1:
            raise ShapeError(f"conv2d: the padded input {axis} {size} + {lo} + {hi} is smaller than the "
                             f"kernel's {d * (k - 1) + 1} (size {k}, dilation {d})")
    ho, wo = output_hw(x, w, params)
    return (n, cout, ho, wo)


def dtype_rule(dtypes: tuple[DType, ...], params: Conv2DParams) -> DType:
    x = dtypes[0]
    if not x.is_float:
        raise DTypeError(f"conv2d: x must be a float tensor, got {x.value}")
    for name, d in zip(("w", "bias"), dtypes[1:], strict=False):
        if d != x:
            raise DTypeError(f"conv2d: {name} must have x's dtype {x.value}, got {d.value}")
    return x


def decompose(inputs: list[Tensor], params: Conv2DParams) -> Tensor:
    """im2col: pad, gather every window with one IndexSelect, one MatMul per (batch, group)."""
    x, w = inputs[0], inputs[1]
    n, cin, h, wd = x.shape
    cout, cg, kh, kw = w.shape
    g = params.groups
    ho, wo = output_hw(x.shape, w.shape, params)
    (pt, pb), (pl, pr) = params.padding
    xp = pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr))) if pt or pb or pl or pr else x
    hp, wp = h + pt + pb, wd + pl + pr
    idx = as_tensor(tap_positions((kh, kw), (ho, wo), wp, params.stride, params.dilation))
    cols = xp.reshape(n, cin, hp * wp).index_select(2, idx).reshape(n, g, cg * kh * kw, ho * wo)
    out = (w.reshape(g, cout // g, cg * kh * kw) @ cols).reshape(n, cout, ho, wo)
    if len(inputs) == 3:
        out = out + inputs[2].reshape(1, cout, 1, 1)
    return out


def _unbroadcast(n: Node) -> Node:
    return n.inputs[0] if n.op is Op.BROADCAST_TO else n


def _step(idx: np.ndarray, axis: int, unit: int) -> int | None:
    """The distance (in units of `unit`) between the first two entries along `axis` of the tap table;
    0 when that axis has one entry (then any step gives the same table)."""
    if idx.shape[axis] < 2:
        return 0
    d = int(np.take(idx, 1, axis).reshape(-1)[0] - idx.reshape(-1)[0])
    return d // unit if d > 0 and d % unit == 0 else None


def _geometry(idx: Node, kernel: tuple[int, int], out: tuple[int, int], plane: tuple[int, int]
              ) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """(stride, dilation) whose tap table is exactly the IndexSelect's constant index, or None. Where the
    table does not fix one (one tap: dilation 1; one output: the least stride giving one output), the
    canonical value."""
    if idx.value is None or idx.dtype.is_float or idx.shape != (kernel[0] * kernel[1] * out[0] * out[1],):
        return None
    table = np.asarray(idx.value).reshape(*kernel, *out)
    steps = [_step(table, a, u) for a, u in ((0, plane[1]), (1, 1), (2, plane[1]), (3, 1))]
    if any(f is None for f in steps):
        return None
    dh, dw, sh, sw = (int(f) for f in steps if f is not None)
    dh, dw = dh or 1, dw or 1
    sh = sh or max(1, plane[0] - dh * (kernel[0] - 1))
    sw = sw or max(1, plane[1] - dw * (kernel[1] - 1))
    if not np.array_equal(tap_positions(kernel, out, plane[1], (sh, sw), (dh, dw)), idx.value):
        return None
    return (sh, sw), (dh, dw)


def pattern(node: Node, counts: Mapping[Node, int]) -> Match | None:
    """The im2col lowering as `decompose` spells it: [pad,] reshape to planes, IndexSelect of the tap
    table, reshape to (N, groups, Cin/groups·Kh·Kw, Ho·Wo), MATMUL by w as (groups, Cout/groups, ·),
    reshape to NCHW [+ bias viewed as (1, Cout, 1, 1)]. Stride and dilation are read off the table and
    must rebuild it exactly; the pad must be zeros on H and W only. Every interior node but the views of
    w and bias is read only here."""
    bias = None
    core = node
    if node.op is Op.ADD:
        for a, b in (node.inputs, node.inputs[::-1]):
            bv = _unbroadcast(b)
            if bv.op is Op.RESHAPE and len(bv.shape) == 4 and bv.inputs[0].shape == (bv.shape[1],) \
                    and bv.shape == (1, bv.shape[1], 1, 1):
                bias, core = bv.inputs[0], a
                break
        if bias is None:
            return None
    if core.op is not Op.RESHAPE or len(core.shape) != 4 or core.inputs[0].op is not Op.MATMUL:
        return None
    mm = core.inputs[0]
    wv, cols = _unbroadcast(mm.inputs[0]), mm.inputs[1]
    if wv.op is not Op.RESHAPE or len(wv.inputs[0].shape) != 4 or cols.op is not Op.RESHAPE:
        return None
    w, sel = wv.inputs[0], cols.inputs[0]
    if sel.op is not Op.INDEX_SELECT or sel.arg != 2 or sel.inputs[0].op is not Op.RESHAPE:
        return None
    planes = sel.inputs[0]
    xp = planes.inputs[0]
    if len(xp.shape) != 4:
        return None
    n, cout, ho, wo = core.shape
    _, cg, kh, kw = w.shape
    g = wv.shape[0]
    if wv.shape != (g, cout // g, cg * kh * kw) or cols.shape != (n, g, cg * kh * kw, ho * wo):
        return None
    x, padding = xp, ((0, 0), (0, 0))
    if xp.op is Op.PAD:
        widths, value = xp.arg
        if value != 0.0 or tuple(widths[:2]) != ((0, 0), (0, 0)):
            return None
        x, padding = xp.inputs[0], (tuple(widths[2]), tuple(widths[3]))
    geometry = _geometry(sel.inputs[1], (kh, kw), (ho, wo), xp.shape[2:])
    interior = [core, mm, cols, sel, planes] + ([xp] if xp is not x else []) + ([node] if bias is not None else [])
    if geometry is None or any(counts[i] != 1 for i in interior if i is not node):
        return None
    params = Conv2DParams(geometry[0], padding, geometry[1], g)
    return Match((x, w) if bias is None else (x, w, bias), params)


def weight_grad(x: Tensor, g: Tensor, kernel: Pair, stride: Pair, padding: Padding, dilation: Pair,
                groups: int) -> Tensor:
    """∂/∂w of a Conv2D `x` → `g` (x `[N, Cin, H, W]`, g `[N, Cout, Ho, Wo]`) as `[Cout, Cin/groups, Kh, Kw]`.

    It is itself a Conv2D: with batch and channels swapped, the input `[Cin/groups, groups·N, H, W]`
    correlated with g as a weight `[Cout, N, Ho, Wo]` (groups kept: out channel co of group k reads
    the N batch entries of group k), stride and dilation traded. The rows (columns) the forward's last
    window did not reach are trimmed from the bottom padding, or from x, so the result is Kh x Kw.
    """
    n, cin, h, wd = x.shape
    cout = g.shape[1]
    kh, kw = kernel
    cg = cin // groups
    if n == 0 or cin == 0:
        return zeros((cout, cg, kh, kw), x.dtype)
    (pt, pb), (pl, pr) = padding
    rest_h = conv_rest(h, pt, pb, kh, stride[0], dilation[0])
    rest_w = conv_rest(wd, pl, pr, kw, stride[1], dilation[1])
    pb2, pr2 = pb - min(pb, rest_h), pr - min(pr, rest_w)
    h2, w2 = h - (rest_h - (pb - pb2)), wd - (rest_w - (pr - pr2))
    if h2 < 1 or w2 < 1:  # every window reads only padding along an axis: w never meets x
        return zeros((cout, cg, kh, kw), x.dtype)
    xs = x.reshape(n, groups, cg, h, wd).permute(2, 1, 0, 3, 4).reshape(cg, groups * n, h, wd)
    if (h2, w2) != (h, wd):
        xs = xs[:, :, :h2, :w2]
    gs = g.permute(1, 0, 2, 3)
    params = Conv2DParams(stride=dilation, padding=((pt, pb2), (pl, pr2)), dilation=stride, groups=groups)
    dw = Tensor(fused_node(FusedOps.CONV2D, [xs.node, gs.node], params))
    return dw.permute(1, 0, 2, 3)


def vjp(inputs: list[Tensor], params: Conv2DParams, out: Tensor, grad_out: Tensor) -> list[Tensor | None]:
    """dX = ConvTranspose2D(g, w), dW = weight_grad (a Conv2D), dBias = Σ g over batch and space."""
    from fuel.graph.registry.conv_transpose2d import conv_transpose2d

    x, w = inputs[0], inputs[1]
    g = grad_out
    (pt, pb), (pl, pr) = params.padding
    kh, kw = w.shape[2], w.shape[3]
    extra = (conv_rest(x.shape[2], pt, pb, kh, params.stride[0], params.dilation[0]),
             conv_rest(x.shape[3], pl, pr, kw, params.stride[1], params.dilation[1]))
    dx = conv_transpose2d(g, w, params.stride, params.padding, extra, params.dilation, params.groups)
    dw = weight_grad(x, g, (kh, kw), params.stride, params.padding, params.dilation, params.groups)
    grads: list[Tensor | None] = [dx, dw]
    if len(inputs) == 3:
        grads.append(g.sum((0, 2, 3)))
    return grads


def conv2d(x: TensorLike, w: TensorLike, bias: TensorLike | None = None, stride: Any = 1, padding: Any = 0,
           groups: int = 1, dilation: Any = 1) -> Tensor:
    """2-D cross-correlation (torch.nn.functional.conv2d), x `[N, Cin, H, W]`, w `[Cout, Cin/groups, Kh, Kw]`.

    stride and dilation: an int or `(h, w)`; padding: an int, `(ph, pw)` or
    `((top, bottom), (left, right))` (asymmetric); bias `[Cout]` or None.
    """
    params = Conv2DParams(stride, padding, dilation, groups)
    nodes = operand_nodes(x, w) if bias is None else operand_nodes(x, w, bias)
    return Tensor(fused_node(FusedOps.CONV2D, nodes, params))


ENTRY = FusedOpEntry(
    id=FusedOps.CONV2D,
    name="Conv2D",
    family=FusedOpFamily.FORWARD,
    params=Conv2DParams,
    arity=(2, 3),
    shape_rule=shape_rule,
    dtype_rule=dtype_rule,
    decompose=decompose,
    # The inventory's metadata (the gradient is not one fused op); `vjp` below is exact.
    backward=NOT_DIFFERENTIABLE,
    vjp=vjp,
    pattern=pattern,
    output_views=None,
    destructive_input=None,
)
