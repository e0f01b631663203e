"""LayerNormLastDimBackward (id 8): dx of LayerNormLastDim from its input x and the upstream g.

With xhat = (x − mean)·istd, istd = rsqrt(var + eps): dx = istd·(g − mean(g) − xhat·mean(g·xhat)).
Only autograd emits it; its own gradient differentiates the decomposition (higher-order grads).
"""

from __future__ import annotations

from dataclasses import dataclass

from fuel.dtype import DType
from fuel.graph.node import Shape
from fuel.graph.registry import (
    NOT_DIFFERENTIABLE,
    FusedOpEntry,
    FusedOpFamily,
    FusedOps,
    fused_node,
    vjp_by_decomposition,
)
from fuel.graph.registry.rms_norm_last_dim import check_eps, norm_dtype_rule, norm_shape_rule
from fuel.graph.tensor import Tensor, TensorLike, as_tensor

NAME = "layer_norm_last_dim_backward"


@dataclass(frozen=True)
class LayerNormLastDimBackwardParams:
    eps: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "eps", check_eps(NAME, self.eps))


def shape_rule(shapes: tuple[Shape, ...], params: LayerNormLastDimBackwardParams) -> Shape:
    return norm_shape_rule(NAME, shapes)


def dtype_rule(dtypes: tuple[DType, ...], params: LayerNormLastDimBackwardParams) -> DType:
    return norm_dtype_rule(NAME, dtypes)


def decompose(inputs: list[Tensor], params: LayerNormLastDimBackwardParams) -> Tensor:
    x, g = inputs
    xc = x - x.mean(-1, keepdim=True)
    istd = (xc * xc).mean(-1, keepdim=True).add(params.eps).rsqrt()
    xhat = xc * istd
    return istd * ((g - g.mean(-1, keepdim=True)) - xhat * (g * xhat).mean(-1, keepdim=True))


def layer_norm_last_dim_backward(x: TensorLike, g: TensorLike, eps: float) -> Tensor:
    """Gradient of layer_norm_last_dim(x, eps) given the upstream gradient `g`."""
    params = LayerNormLastDimBackwardParams(eps)
    tx = as_tensor(x)
    nodes = [tx.node, as_tensor(g, tx).node]
    return Tensor(fused_node(FusedOps.LAYER_NORM_LAST_DIM_BACKWARD, nodes, params))


ENTRY = FusedOpEntry(
    id=FusedOps.LAYER_NORM_LAST_DIM_BACKWARD,
    name="LayerNormLastDimBackward",
    family=FusedOpFamily.BACKWARD,
    params=LayerNormLastDimBackwardParams,
    arity=(2,),
    shape_rule=shape_rule,
    dtype_rule=dtype_rule,
    decompose=decompose,
    backward=NOT_DIFFERENTIABLE,
    vjp=vjp_by_decomposition(decompose),
    pattern=None,
    output_views=None,
    destructive_input=None,
)
