"""RmsNormLastDim (id 3): x / sqrt(mean(x², last) + eps), no affine weight.

The rules and pattern pieces shared by the whole norm family (entries 3, 4, 8, 9) live here too:
the eps check, the params, the shape/dtype rules and the matcher of `sqrt(mean(v², last) + eps)`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from fuel.dtype import DType
from fuel.errors import ParamError, ShapeError
from fuel.graph.node import Node, Op, Shape
from fuel.graph.passes.pattern import keepdim_last, only_used_once, unbroadcast
from fuel.graph.registry import BackwardKind, FusedOpEntry, FusedOpFamily, FusedOps, Match, fused_node
from fuel.graph.registry.common import gradient_dtype
from fuel.graph.tensor import Tensor, TensorLike, as_tensor

# ---- shared by the norm family ---------------------------------------------------------------


def valid_eps(eps: object) -> bool:
    """A finite real > 0 (bools are not numbers here)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)):
        return False
    return math.isfinite(float(eps)) and float(eps) > 0.0


def check_eps(op: str, eps: object) -> float:
    """eps as a float, or ParamError naming `op`: every norm divides by sqrt(... + eps)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)):
        raise ParamError(f"{op}: eps must be a number > 0, got {eps!r}")
    if not math.isfinite(float(eps)):
        raise ParamError(f"{op}: eps must be finite and > 0, got {float(eps)!r}")
    if not float(eps) > 0.0:
        raise ParamError(f"{op}: eps must be > 0, got {float(eps)!r}")
    return float(eps)


@dataclass(frozen=True)
class NormParams:
    """The norm family's params: eps, checked on construction. Each entry has its own subclass, whose
    OP names it in error messages (and the registry's params check tells the entries apart)."""

    OP: ClassVar[str]
    eps: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "eps", check_eps(self.OP, self.eps))


def norm_shape_rule(shapes: tuple[Shape, ...], params: NormParams) -> Shape:
    """Input 0 (x) of rank >= 1 with a non-empty last axis; every other input has x's shape."""
    op, x = params.OP, shapes[0]
    if not x:
        raise ShapeError(f"{op}: x must have rank >= 1, got a rank-0 tensor")
    if x[-1] == 0:
        raise ShapeError(f"{op}: x's last dim must be > 0 (a norm of nothing), got shape {list(x)}")
    for s in shapes[1:]:
        if s != x:
            raise ShapeError(f"{op}: upstream gradient {list(s)} must have x's shape {list(x)}")
    return x


def norm_dtype_rule(dtypes: tuple[DType, ...], params: NormParams) -> DType:
    """Float x; the backward entries' upstream gradient of x's dtype."""
    return gradient_dtype(params.OP, ("x", "upstream gradient"), dtypes)


def square_of(sq: Node, v: Node) -> bool:
    """sq is v² in any spelling a user writes: v * v, v.square(), v ** 2."""
    if sq.op is Op.MUL:
        return sq.inputs[0] is v and sq.inputs[1] is v
    if sq.op is Op.SQR:
        return sq.inputs[0] is v
    return sq.op is Op.POWI and sq.arg == 2 and sq.inputs[0] is v


def match_root_ms(denom: Node, shape: Shape, root_op: Op) -> tuple[Node, float, list[Node]] | None:
    """`denom` = bcast(ROOT_OP(keepdim mean(sq, last) + eps)) with sq of `shape`.

    Returns (sq, eps, the interior nodes) so the caller can check sq squares its value and guard
    every interior node. ROOT_OP is SQRT (divided by) or RSQRT (multiplied by).
    """
    root, nodes = unbroadcast(denom, shape)
    if root.op is not root_op:
        return None
    add = root.inputs[0]
    if add.op is not Op.ADD_SCALAR or not valid_eps(add.arg):
        return None
    found = keepdim_last(add.inputs[0], Op.MEAN_DIM, None)
    if found is None or found[0].shape != shape:
        return None
    sq, kd = found
    return sq, float(add.arg), [*nodes, root, add, *kd, sq]


def scaled_by_root_ms(node: Node) -> list[tuple[Node, Node, Op]]:
    """The (value, denominator, root op) readings of a DIV by sqrt or a MUL by rsqrt (either side)."""
    if node.op is Op.DIV:
        return [(node.inputs[0], node.inputs[1], Op.SQRT)]
    if node.op is Op.MUL:
        a, b = node.inputs
        return [(a, b, Op.RSQRT), (b, a, Op.RSQRT)]
    return []


def normable(x: Node) -> bool:
    """A pattern must not propose a node the shape/dtype rules would reject."""
    return x.dtype.is_float and bool(x.shape) and x.shape[-1] > 0


# ---- the entry ---------------------------------------------------------------------------------

NAME = "rms_norm_last_dim"


@dataclass(frozen=True)
class RmsNormLastDimParams(NormParams):
    OP: ClassVar[str] = NAME


def decompose(inputs: list[Tensor], params: RmsNormLastDimParams) -> Tensor:
    (x,) = inputs
    # The spelling a user writes, so fuse(decompose(op)) finds the op again.
    return x / (x * x).mean(-1, keepdim=True).add(params.eps).sqrt()


def pattern(node: Node, counts: Mapping[Node, int]) -> Match | None:
    """Div(x, bcast(Sqrt(AddScalar(eps)(keepdim MeanDim(last)(x²))))), or Mul(x, bcast(Rsqrt(...)))."""
    if not node.dtype.is_float:
        return None
    for x, denom, root_op in scaled_by_root_ms(node):
        if not normable(x):
            continue
        found = match_root_ms(denom, x.shape, root_op)
        if found is None:
            continue
        sq, eps, interior = found
        if square_of(sq, x) and only_used_once(counts, interior):
            return Match((x,), RmsNormLastDimParams(eps))
    return None


def vjp(inputs: list[Tensor], params: RmsNormLastDimParams, out: Tensor,
        grad_out: Tensor) -> list[Tensor | None]:
    from fuel.graph.registry.rms_norm_last_dim_backward import rms_norm_last_dim_backward

    return [rms_norm_last_dim_backward(inputs[0], grad_out, params.eps)]


def rms_norm_last_dim(x: TensorLike, eps: float) -> Tensor:
    """RMS norm over the last axis: x / sqrt(mean(x², last) + eps) (no weight)."""
    params = RmsNormLastDimParams(eps)
    return Tensor(fused_node(FusedOps.RMS_NORM_LAST_DIM, [as_tensor(x).node], params))


ENTRY = FusedOpEntry(
    id=FusedOps.RMS_NORM_LAST_DIM,
    name="RmsNormLastDim",
    family=FusedOpFamily.NORM,
    params=RmsNormLastDimParams,
    arity=(1,),
    shape_rule=norm_shape_rule,
    dtype_rule=norm_dtype_rule,
    decompose=decompose,
    backward=BackwardKind.fused(FusedOps.RMS_NORM_LAST_DIM_BACKWARD),
    vjp=vjp,
    pattern=pattern,
    output_views=None,
    destructive_input=None,
)
