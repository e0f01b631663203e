"""SoftmaxLastDimBackward (id 7): dx = y * (g - sum(g * y, last)) from the forward output y."""

from __future__ import annotations

from dataclasses import dataclass

from fuel.dtype import DType
from fuel.errors import ShapeError
from fuel.graph.node import Shape
from fuel.graph.passes.template import Wild, template_pattern
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


def _recipe(y: Wild, g: Wild) -> Tensor:
    return decompose([y, g], SoftmaxLastDimBackwardParams())


pattern = template_pattern(_recipe, build=lambda m: Match((m["y"], m["g"]), SoftmaxLastDimBackwardParams()))


def softmax_last_dim_backward(y: TensorLike, g: TensorLike) -> Tensor:
    """Gradient of softmax_last_dim given its output `y` and the upstream gradient `g`."""
    params = SoftmaxLastDimBackwardParams()
    return Tensor(fused_node(FusedOps.SOFTMAX_LAST_DIM_BACKWARD, operand_nodes(y, g), params))


ENTRY = gradient_entry(
    FusedOps.SOFTMAX_LAST_DIM_BACKWARD, "SoftmaxLastDimBackward", SoftmaxLastDimBackwardParams,
    shape_rule, dtype_rule, decompose, pattern=pattern, vjp=vjp_by_decomposition(decompose),
)
