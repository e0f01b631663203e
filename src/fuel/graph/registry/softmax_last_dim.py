"""SoftmaxLastDim (id 1): softmax over the last axis."""

from __future__ import annotations

from dataclasses import dataclass

from fuel.dtype import DType
from fuel.errors import DTypeError, ShapeError
from fuel.graph.node import Shape
from fuel.graph.passes.template import Wild, template_pattern
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


def _recipe(x: Wild) -> Tensor:
    return decompose([x], SoftmaxLastDimParams())


pattern = template_pattern(_recipe, build=lambda m: Match((m["x"],), SoftmaxLastDimParams()))


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
