"""SoftmaxLastDimBackward (id 7): dx = y * (g - sum(g * y, last)) from the forward output y."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fuel.dtype import DType
from fuel.errors import ShapeError
from fuel.graph.node import Node, Op, Shape
from fuel.graph.passes.pattern import broadcast_keepdim_last, only_used_once
from fuel.graph.registry import FusedOps, Match, fused_node, vjp_by_decomposition
from fuel.graph.registry.common import gradient_dtype, gradient_entry, operand_nodes
from fuel.graph.tensor import Tensor, TensorLike


@dataclass(frozen=True)
class SoftmaxLastDimBackwardParams:
    pass


def shape_rule(shapes: tuple[Shape, ...], params: SoftmaxLastDimBackwardParams) -> Shape:
    y, g = shapes
    if not y:
        raise ShapeError("softmax_last_dim_backward: y must have rank >= 1, got a rank-0 tensor")
    if g != y:
        raise ShapeError(f"softmax_last_dim_backward: upstream gradient {list(g)} must have y's shape {list(y)}")
    return y


def dtype_rule(dtypes: tuple[DType, ...], params: SoftmaxLastDimBackwardParams) -> DType:
    return gradient_dtype("softmax_last_dim_backward", ("y", "upstream gradient"), dtypes)


def decompose(inputs: list[Tensor], params: SoftmaxLastDimBackwardParams) -> Tensor:
    y, g = inputs
    if y.shape[-1] == 0:
        return y
    return y * (g - (g * y).sum(-1, keepdim=True))


def pattern(node: Node, counts: Mapping[Node, int]) -> Match | None:
    """Mul(y, Sub(g, bcast(keepdim sum(Mul(g, y)))))."""
    if node.op is not Op.MUL or not node.dtype.is_float:
        return None
    y, diff = node.inputs
    if diff.op is not Op.SUB:
        return None
    g, bsum = diff.inputs
    found = broadcast_keepdim_last(bsum, Op.SUM_DIM, Op.REDUCE_SUM_TO, y.shape)
    if found is None or found[0].op is not Op.MUL:
        return None
    prod = found[0]
    if set(prod.inputs) != {g, y} or y is g:
        return None
    if not only_used_once(counts, [diff, prod, *found[1]]):
        return None
    return Match((y, g), SoftmaxLastDimBackwardParams())


def softmax_last_dim_backward(y: TensorLike, g: TensorLike) -> Tensor:
    """Gradient of softmax_last_dim given its output `y` and the upstream gradient `g`."""
    params = SoftmaxLastDimBackwardParams()
    return Tensor(fused_node(FusedOps.SOFTMAX_LAST_DIM_BACKWARD, operand_nodes(y, g), params))


ENTRY = gradient_entry(
    FusedOps.SOFTMAX_LAST_DIM_BACKWARD, "SoftmaxLastDimBackward", SoftmaxLastDimBackwardParams,
    shape_rule, dtype_rule, decompose, pattern=pattern, vjp=vjp_by_decomposition(decompose),
)
