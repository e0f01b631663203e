"""SoftmaxLastDim (id 1): softmax over the last axis."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fuel.dtype import DType
from fuel.errors import DTypeError, ShapeError
from fuel.graph.node import Node, Op, Shape
from fuel.graph.passes.pattern import broadcast_keepdim_last, only_used_once
from fuel.graph.registry import BackwardKind, FusedOpEntry, FusedOpFamily, FusedOps, Match, fused_node
from fuel.graph.tensor import Tensor, TensorLike, as_tensor


@dataclass(frozen=True)
class SoftmaxLastDimParams:
    pass


def shape_rule(shapes: tuple[Shape, ...], params: SoftmaxLastDimParams) -> Shape:
    (x,) = shapes
    if not x:
        raise ShapeError("softmax_last_dim: x must have rank >= 1, got a rank-0 tensor")
    return x


def dtype_rule(dtypes: tuple[DType, ...], params: SoftmaxLastDimParams) -> DType:
    (x,) = dtypes
    if not x.is_float:
        raise DTypeError(f"softmax_last_dim: x must be a float tensor, got {x.value}")
    return x


def decompose(inputs: list[Tensor], params: SoftmaxLastDimParams) -> Tensor:
    (x,) = inputs
    if x.shape[-1] == 0:
        return x
    e = (x - x.max(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


def pattern(node: Node, counts: Mapping[Node, int]) -> Match | None:
    """Div(e, bcast(keepdim sum(e))) with e = Exp(Sub(x, bcast(keepdim max(x))))."""
    if node.op is not Op.DIV or not node.dtype.is_float:
        return None
    e, denom = node.inputs
    if e.op is not Op.EXP or counts[e] != 2:
        return None
    summed = broadcast_keepdim_last(denom, Op.SUM_DIM, Op.REDUCE_SUM_TO, e.shape)
    sub = e.inputs[0]
    if summed is None or summed[0] is not e or sub.op is not Op.SUB:
        return None
    x, shifted = sub.inputs
    maxed = broadcast_keepdim_last(shifted, Op.MAX_DIM, Op.REDUCE_MAX_TO, x.shape)
    if maxed is None or maxed[0] is not x:
        return None
    if not only_used_once(counts, [sub, *summed[1], *maxed[1]]):
        return None
    return Match((x,), SoftmaxLastDimParams())


def vjp(inputs: list[Tensor], params: SoftmaxLastDimParams, out: Tensor, grad_out: Tensor) -> list[Tensor | None]:
    from fuel.graph.registry.softmax_last_dim_backward import softmax_last_dim_backward

    return [softmax_last_dim_backward(out, grad_out)]


def softmax_last_dim(x: TensorLike) -> Tensor:
    """Softmax over the last axis: exp(x - max) / sum(exp(x - max))."""
    return Tensor(fused_node(FusedOps.SOFTMAX_LAST_DIM, [as_tensor(x).node], SoftmaxLastDimParams()))


ENTRY = FusedOpEntry(
    id=FusedOps.SOFTMAX_LAST_DIM,
    name="SoftmaxLastDim",
    family=FusedOpFamily.FORWARD,
    params=SoftmaxLastDimParams,
    arity=(1,),
    shape_rule=shape_rule,
    dtype_rule=dtype_rule,
    decompose=decompose,
    backward=BackwardKind.fused(FusedOps.SOFTMAX_LAST_DIM_BACKWARD),
    vjp=vjp,
    pattern=pattern,
    output_views=None,
    destructive_input=None,
)
