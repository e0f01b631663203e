"""RmsNormLastDimBackward (id 9): dx of RmsNormLastDim from its input x and the upstream gradient g.

With r = rsqrt(mean(x²) + eps): dx = r·(g − x·Σ(g·x) / (n·(mean(x²) + eps))), n = x's last dim.
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

NAME = "rms_norm_last_dim_backward"


@dataclass(frozen=True)
class RmsNormLastDimBackwardParams:
    eps: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "eps", check_eps(NAME, self.eps))


def shape_rule(shapes: tuple[Shape, ...], params: RmsNormLastDimBackwardParams) -> Shape:
    return norm_shape_rule(NAME, shapes)


def dtype_rule(dtypes: tuple[DType, ...], params: RmsNormLastDimBackwardParams) -> DType:
    return norm_dtype_rule(NAME, dtypes)


def decompose(inputs: list[Tensor], params: RmsNormLastDimBackwardParams) -> Tensor:
    x, g = inputs
    n = float(x.shape[-1])
    den = (x * x).mean(-1, keepdim=True).add(params.eps)
    return den.rsqrt() * (g - x * (g * x).sum(-1, keepdim=True) / (den * n))


def rms_norm_last_dim_backward(x: TensorLike, g: TensorLike, eps: float) -> Tensor:
    """Gradient of rms_norm_last_dim(x, eps) given the upstream gradient `g`."""
    params = RmsNormLastDimBackwardParams(eps)
    tx = as_tensor(x)
    nodes = [tx.node, as_tensor(g, tx).node]
    return Tensor(fused_node(FusedOps.RMS_NORM_LAST_DIM_BACKWARD, nodes, params))


ENTRY = FusedOpEntry(
    id=FusedOps.RMS_NORM_LAST_DIM_BACKWARD,
    name="RmsNormLastDimBackward",
    family=FusedOpFamily.BACKWARD,
    params=RmsNormLastDimBackwardParams,
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
