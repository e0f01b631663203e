"""Rope (id 5): rotary position embedding, rotate-half (Llama/HF/NeoX) layout, caller tables.

x `[..., S, D]` (D even), cos and sin `[S, D]` in x's dtype, the same table row s for every leading
index: `out = x·cos + rotate_half(x)·sin` with `rotate_half(x) = concat(-x[..., D/2:], x[..., :D/2])`.
The gradient is the exact adjoint for any tables (upstream's `rope(g, cos, -sin)` is exact only when
the table halves are duplicated), and cos and sin get gradients too.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuel.dtype import DType
from fuel.errors import ShapeError
from fuel.graph.functions import concat
from fuel.graph.node import Shape
from fuel.graph.passes.template import Wild, template_pattern
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


def _recipe(x: Wild, cos: Wild, sin: Wild) -> Tensor:
    return decompose([x, cos, sin], RopeParams())


# Both operand orders of the Add and of each Mul. Broadcasts and slices of x and the tables are free
# views (tables broadcast once and shared by q and k still fuse); the Muls, Neg and Concat are guarded.
pattern = template_pattern(_recipe, build=lambda m: Match((m["x"], m["cos"], m["sin"]), RopeParams()),
                           shapes={"x": (2, 3, 4, 8), "cos": (4, 8), "sin": (4, 8)})


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
