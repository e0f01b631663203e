"""CausalConv1d (id 18): depthwise causal 1-D convolution with an optional fused SiLU (Mamba's conv).

x `[B, C, seq + K − 1]` already left-padded by the caller (K − 1 zeros, or the previous tokens), w
`[C, 1, K]`, bias `[C]`; output `[B, C, seq]`:

    y[b, c, t] = bias[c] + Σ_k w[c, 0, k] · x[b, c, t + k],    out = silu(y) if use_silu else y

so `w[c, 0, K − 1]` multiplies the newest input (Dao-AILab `causal_conv1d_fn` on the unpadded x).

Decode: `causal_conv1d_step(x_new, state, w, bias, use_silu)` runs the same op on the rolling state
(the last K − 1 input columns) followed by the new columns and returns `(y, new_state)`; it is built
from Concat, this op and a Slice, so it works inside a replayed `fl.jit` step (pass the state in, take
the new state out).

Gradients w.r.t. x, w and bias, with or without SiLU: with dz = g·silu'(y) (y recomputed by this op
without SiLU), dx is this op on dz padded by K − 1 on both sides with w reversed, dw the K sums
Σ_{b,t} dz·x[t + k], dbias Σ dz. Half types run the gradient in f32 and round each result once.

The lowering is K shifted slices, multiplied by their tap and summed in tap order, plus the bias.

Pattern: that sum as users write it, in any order and nesting: a bias `[C]` viewed as `[C, 1]` or
`[1, C, 1]`, and for each tap k one product `x[:, :, k:k + seq] * w[:, :, k]` (the tap's weights any view
of `w[:, :, k:k + 1]` that lines its channels up with x's), optionally through SiLU (`.silu()` or
`y * y.sigmoid()`). x may be the caller's `pad(x, K − 1 zeros on the left)`. A hand matcher rather than a
template: the slices' offsets are tap numbers, not fractions of the axis, and K varies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fuel.dtype import DType
from fuel.errors import ParamError, ShapeError
from fuel.graph.functions import concat, pad
from fuel.graph.node import Node, Op, Shape
from fuel.graph.registry import NOT_DIFFERENTIABLE, FusedOpEntry, FusedOpFamily, FusedOps, Match, fused_node
from fuel.graph.registry.common import float_like_first, operand_nodes
from fuel.graph.tensor import Tensor, TensorLike, as_tensor, zeros

NAME = "causal_conv1d"


@dataclass(frozen=True)
class CausalConv1dParams:
    use_silu: bool

    def __post_init__(self) -> None:
        if not isinstance(self.use_silu, (bool, np.bool_)):
            raise ParamError(f"causal_conv1d: use_silu must be a bool, got {self.use_silu!r}")
        object.__setattr__(self, "use_silu", bool(self.use_silu))


def shape_rule(shapes: tuple[Shape, ...], params: CausalConv1dParams) -> Shape:
    x, w, bias = shapes
    if len(x) != 3:
        raise ShapeError(f"causal_conv1d: x must be [B, C, seq + K - 1], got {list(x)}")
    b, c, lin = x
    if len(w) != 3 or w[0] != c or w[1] != 1:
        raise ShapeError(f"causal_conv1d: w must be [C, 1, K] = [{c}, 1, K] for x {list(x)}, got {list(w)}")
    k = w[2]
    if k < 1:
        raise ShapeError(f"causal_conv1d: the kernel must have at least one tap, w is {list(w)}")
    if bias != (c,):
        raise ShapeError(f"causal_conv1d: bias must be [C] = [{c}], got {list(bias)}")
    if lin < k - 1:
        raise ShapeError(f"causal_conv1d: x holds {lin} positions, fewer than the K - 1 = {k - 1} of its left "
                         f"padding (x must be [B, C, seq + K - 1])")
    return (b, c, lin - (k - 1))


def dtype_rule(dtypes: tuple[DType, ...], params: CausalConv1dParams) -> DType:
    return float_like_first(NAME, ("x", "w", "bias"), dtypes)


def decompose(inputs: list[Tensor], params: CausalConv1dParams) -> Tensor:
    """Σ_k x[..., k : k + seq] · w[:, :, k] in tap order, then the bias (and SiLU)."""
    x, w, bias = inputs
    b, c, lin = x.shape
    k = w.shape[2]
    seq = lin - (k - 1)
    y = bias.reshape(1, c, 1).broadcast_to(b, c, seq)
    for tap in range(k):
        y = y + x[:, :, tap:tap + seq] * w[:, :, tap:tap + 1].reshape(1, c, 1)
    return y.silu() if params.use_silu else y


_RESHAPES = (Op.RESHAPE, Op.SQUEEZE, Op.UNSQUEEZE)


def _channels(n: Node, c: int) -> Node | None:
    """The C-element node behind `n` when `n` is it viewed as [C, 1] or [1, C, 1] (then perhaps broadcast),
    so that channel c meets x's channel c."""
    if n.op is Op.BROADCAST_TO:
        n = n.inputs[0]
    if n.shape not in ((c, 1), (1, c, 1)):
        return None
    while n.op in _RESHAPES:
        n = n.inputs[0]
    return n


def _tap(n: Node, c: int) -> tuple[Node, int] | None:
    """(w, k) when `n` views w[:, :, k:k + 1] of a w [C, 1, K] as channels."""
    s = _channels(n, c)
    if s is not None and s.op is not Op.SLICE and s.shape == (c, 1, 1):
        return s, 0  # K = 1: the slice of the only tap is w itself
    if s is None or s.op is not Op.SLICE or len(s.inputs[0].shape) != 3:
        return None
    w = s.inputs[0]
    (c0, c1, cs), (o0, o1, os), (k0, k1, ks) = s.arg
    if (c0, c1, cs) != (0, c, 1) or w.shape[:2] != (c, 1) or (o0, o1, os) != (0, 1, 1) or (k1, ks) != (k0 + 1, 1):
        return None
    return w, k0


def _shifted(n: Node, shape: Shape) -> tuple[Node, int] | None:
    """(x, k) when `n` is x[:, :, k:k + seq] (x itself at k = 0 when nothing is cut)."""
    b, c, seq = shape
    if n.op is not Op.SLICE:
        return (n, 0) if len(n.shape) == 3 else None
    x = n.inputs[0]
    (b0, b1, bs), (c0, c1, cs), (k0, k1, ks) = n.arg
    if (b0, b1, bs, c0, c1, cs) != (0, b, 1, 0, c, 1) or (k1, ks) != (k0 + seq, 1):
        return None
    return x, k0


def _terms(n: Node, counts: Mapping[Node, int], out: list[Node]) -> None:
    """The leaves of a sum: ADD nodes read only inside it are opened."""
    if n.op is Op.ADD and counts[n] == 1:
        for i in n.inputs:
            _terms(i, counts, out)
    else:
        out.append(n)


def pattern(node: Node, counts: Mapping[Node, int]) -> Match | None:
    """bias + Σ_k x[:, :, k:k + seq]·w[:, :, k] (any order), perhaps through SiLU."""
    if len(node.shape) != 3 or not node.dtype.is_float:
        return None
    use_silu = False
    y = node
    if node.op is Op.SILU and counts[node.inputs[0]] == 1:
        use_silu, y = True, node.inputs[0]
    elif node.op is Op.MUL:
        a, b = node.inputs
        for u, sg in ((a, b), (b, a)):
            if sg.op is Op.SIGMOID and sg.inputs[0] is u and counts[u] == 2 and counts[sg] == 1:
                use_silu, y = True, u
    if y.op is not Op.ADD:
        return None
    leaves: list[Node] = []
    for i in y.inputs:
        _terms(i, counts, leaves)
    _, c, _ = y.shape
    bias, x, w, taps = None, None, None, set()
    for leaf in leaves:
        found = None
        if leaf.op is Op.MUL and counts[leaf] == 1:
            for a, b in (leaf.inputs, leaf.inputs[::-1]):
                t, xs = _tap(b, c), _shifted(a, y.shape)
                if t is not None and xs is not None and t[1] == xs[1]:
                    found = (xs[0], t[0], t[1])
                    break
        if found is None:
            bn = _channels(leaf, c)
            if bias is not None or bn is None or bn.shape != (c,):
                return None
            bias = bn
            continue
        if (x is not None and found[0] is not x) or (w is not None and found[1] is not w) or found[2] in taps:
            return None
        x, w = found[0], found[1]
        taps.add(found[2])
    if bias is None or x is None or w is None or taps != set(range(w.shape[2])):
        return None
    if x.shape[:2] != y.shape[:2] or x.shape[2] != y.shape[2] + w.shape[2] - 1:
        return None
    return Match((x, w, bias), CausalConv1dParams(use_silu))


def vjp(inputs: list[Tensor], params: CausalConv1dParams, out: Tensor, grad_out: Tensor) -> list[Tensor | None]:
    x, w, bias = inputs
    dt = x.dtype
    work = dt.acc  # half types: the whole gradient in f32, each result rounded once
    xw, ww, bw, g = x.cast(work), w.cast(work), bias.cast(work), grad_out.cast(work)
    _, c, lin = x.shape
    k = w.shape[2]
    seq = lin - (k - 1)
    if params.use_silu:
        y = causal_conv1d(xw, ww, bw, False)
        s = y.sigmoid()
        dz = g * (s * (1.0 + y * (1.0 - s)))
    else:
        dz = g
    flipped = ww.index_select(2, as_tensor(np.arange(k - 1, -1, -1, dtype=np.int64)))
    dx = causal_conv1d(pad(dz, ((0, 0), (0, 0), (k - 1, k - 1))), flipped, zeros((c,), work), False)
    taps = [(dz * xw[:, :, tap:tap + seq]).sum((0, 2)).reshape(c, 1, 1) for tap in range(k)]
    dw = concat(taps, axis=2)
    db = dz.sum((0, 2))
    return [dx.cast(dt), dw.cast(dt), db.cast(dt)]


def causal_conv1d(x: TensorLike, w: TensorLike, bias: TensorLike, use_silu: bool = False) -> Tensor:
    """Depthwise causal conv over a left-padded x `[B, C, seq + K − 1]`, w `[C, 1, K]`, bias `[C]`."""
    nodes = operand_nodes(x, w, bias)
    return Tensor(fused_node(FusedOps.CAUSAL_CONV1D, nodes, CausalConv1dParams(use_silu)))


def causal_conv1d_step(x_new: TensorLike, state: TensorLike, w: TensorLike, bias: TensorLike,
                       use_silu: bool = False) -> tuple[Tensor, Tensor]:
    """One decode step over a rolling state: x_new `[B, C, T]` (T new columns, usually 1), state
    `[B, C, K − 1]` (the last K − 1 inputs, zeros at the start). Returns `(y [B, C, T], new_state)`."""
    tx = as_tensor(x_new)
    ts, tw = as_tensor(state, tx), as_tensor(w, tx)
    k = tw.shape[2] if tw.ndim == 3 else 0
    if tx.ndim != 3 or ts.ndim != 3 or ts.shape != (tx.shape[0], tx.shape[1], k - 1):
        raise ShapeError(f"causal_conv1d_step: x_new must be [B, C, T] and state [B, C, K - 1] for w {list(tw.shape)}, "
                         f"got {list(tx.shape)} and {list(ts.shape)}")
    window = concat([ts, tx], axis=2) if k > 1 else tx
    y = causal_conv1d(window, tw, bias, use_silu)
    return y, window[:, :, tx.shape[2]:]


ENTRY = FusedOpEntry(
    id=FusedOps.CAUSAL_CONV1D,
    name="CausalConv1d",
    family=FusedOpFamily.FORWARD,
    params=CausalConv1dParams,
    arity=(3,),
    shape_rule=shape_rule,
    dtype_rule=dtype_rule,
    decompose=decompose,
    # The inventory's metadata (v1 inference-only upstream); `vjp` below is exact.
    backward=NOT_DIFFERENTIABLE,
    vjp=vjp,
    pattern=pattern,
    output_views=None,
    destructive_input=None,
)
