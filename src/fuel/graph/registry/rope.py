"""Rope (id 5): rotary position embedding, rotate-half (Llama/HF/NeoX) layout, caller tables.

x `[..., S, D]` (D even), cos and sin `[S, D]` in x's dtype, the same table row s for every leading
index: `out = x·cos + rotate_half(x)·sin` with `rotate_half(x) = concat(-x[..., D/2:], x[..., :D/2])`.
The gradient is the exact adjoint for any tables (upstream's `rope(g, cos, -sin)` is exact only when
the table halves are duplicated), and cos and sin get gradients too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fuel.dtype import DType
from fuel.errors import ShapeError
from fuel.graph.functions import concat
from fuel.graph.node import Node, Op, Shape
from fuel.graph.passes.pattern import unbroadcast
from fuel.graph.registry import NOT_DIFFERENTIABLE, FusedOpEntry, FusedOpFamily, FusedOps, Match, fused_node
from fuel.graph.registry.common import float_like_first, operand_nodes
from fuel.graph.tensor import Tensor, TensorLike


@dataclass(frozen=True)
class RopeParams:
    pass


def shape_rule(shapes: tuple[Shape, ...], params: RopeParams) -> Shape:
    x, cos, sin = shapes
    if len(x) < 2:
        raise ShapeError(f"rope: x must have rank >= 2 ([..., seq, head_dim]), got {list(x)}")
    s, d = x[-2:]
    if d % 2:
        raise ShapeError(f"rope: head_dim must be even, got {d}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t != (s, d):
            raise ShapeError(f"rope: {name} must be [seq, head_dim] = {[s, d]} for x {list(x)}, got {list(t)}")
    return x


def dtype_rule(dtypes: tuple[DType, ...], params: RopeParams) -> DType:
    return float_like_first("rope", ("x", "cos", "sin"), dtypes)


def rotate_half(x: Tensor) -> Tensor:
    """concat(-x[..., D/2:], x[..., :D/2]): the user's spelling, which the pattern recognises."""
    h = x.shape[-1] // 2
    return concat([-x[..., h:], x[..., :h]], axis=-1)


def decompose(inputs: list[Tensor], params: RopeParams) -> Tensor:
    x, cos, sin = inputs
    if x.shape[-1] == 0:
        return x
    return x * cos + rotate_half(x) * sin


def _half_slice(n: Node, x: Node, hi: bool) -> bool:
    """n = x[..., D/2:] (hi) or x[..., :D/2] (lo)."""
    if n.op is not Op.SLICE or n.inputs[0] is not x:
        return False
    d = x.shape[-1]
    want = (d // 2, d, 1) if hi else (0, d // 2, 1)
    return tuple(n.arg) == (*((0, k, 1) for k in x.shape[:-1]), want)


def _rotated(n: Node) -> Node | None:
    """The x of `n = concat(neg(x[..., D/2:]), x[..., :D/2])` along the last axis."""
    if n.op is not Op.CONCAT or len(n.inputs) != 2 or n.arg != len(n.shape) - 1:
        return None
    neg, lo = n.inputs
    if neg.op is not Op.NEG or lo.op is not Op.SLICE:
        return None
    x = lo.inputs[0]
    if x.shape != n.shape or not _half_slice(neg.inputs[0], x, True) or not _half_slice(lo, x, False):
        return None
    return x


def _table(n: Node, shape: Shape) -> Node | None:
    """The [S, D] table behind `n` (a broadcast of it to x's shape, or itself when x is rank 2)."""
    t, _ = unbroadcast(n, shape)
    return t if t.shape == shape[-2:] else None


def pattern(node: Node, counts: Mapping[Node, int]) -> Match | None:
    """Add(Mul(x, bcast(cos)), Mul(concat(neg(x[..., h:]), x[..., :h]), bcast(sin))).

    Both operand orders of the Add and of each Mul. The Muls, the Neg and the Concat must have no
    other reader (fusing would compute them twice); broadcasts and slices are free views and are not
    guarded, so tables broadcast once and shared by q and k still fuse.
    """
    if node.op is not Op.ADD or not node.dtype.is_float or len(node.shape) < 2 or node.shape[-1] % 2:
        return None
    for m_cos, m_sin in (node.inputs, node.inputs[::-1]):
        if m_cos.op is not Op.MUL or m_sin.op is not Op.MUL:
            continue
        for rot, bsin in (m_sin.inputs, m_sin.inputs[::-1]):
            x = _rotated(rot)
            sin = _table(bsin, node.shape)
            if x is None or sin is None:
                continue
            for xx, bcos in (m_cos.inputs, m_cos.inputs[::-1]):
                cos = _table(bcos, node.shape)
                if xx is not x or cos is None or cos.dtype is not x.dtype or sin.dtype is not x.dtype:
                    continue
                if all(counts[k] == 1 for k in (m_cos, m_sin, rot, rot.inputs[0])):
                    return Match((x, cos, sin), RopeParams())
    return None


def _table_sum(t: Tensor) -> Tensor:
    """Sum a [..., S, D] tensor over its leading axes (a table is shared by every one of them)."""
    return t.sum(tuple(range(t.ndim - 2))) if t.ndim > 2 else t


def vjp(inputs: list[Tensor], params: RopeParams, out: Tensor, grad_out: Tensor) -> list[Tensor | None]:
    """Exact adjoint. rotate_half R is linear with Rᵀ = -R, so grad_x = g·cos - R(g·sin).

    R(g·sin) = R(g)·swap(sin) with swap(s) = concat(s[:, h:], s[:, :h]), hence
    grad_x = rope(g, cos, -swap(sin)): one more fused pass, the table transform is only [S, D].
    grad_cos = Σ_lead g·x and grad_sin = Σ_lead g·R(x).
    """
    x, cos, sin = inputs
    g = grad_out
    h = x.shape[-1] // 2
    if h == 0:
        return [g, _table_sum(g * x), _table_sum(g * x)]
    swapped = concat([sin[:, h:], sin[:, :h]], axis=-1)
    return [rope(g, cos, -swapped), _table_sum(g * x), _table_sum(g * rotate_half(x))]


def rope(x: TensorLike, cos: TensorLike, sin: TensorLike) -> Tensor:
    """x·cos + rotate_half(x)·sin; x `[..., S, D]`, cos and sin `[S, D]` in x's dtype."""
    return Tensor(fused_node(FusedOps.ROPE, operand_nodes(x, cos, sin), RopeParams()))


ENTRY = FusedOpEntry(
    id=FusedOps.ROPE,
    name="Rope",
    family=FusedOpFamily.FORWARD,
    params=RopeParams,
    arity=(3,),
    shape_rule=shape_rule,
    dtype_rule=dtype_rule,
    decompose=decompose,
    # The inventory's metadata (the gradient is not another fused op); `vjp` below is exact.
    backward=NOT_DIFFERENTIABLE,
    vjp=vjp,
    pattern=pattern,
    output_views=None,
    destructive_input=None,
)
