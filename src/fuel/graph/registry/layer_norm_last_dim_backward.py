"""LayerNormLastDimBackward (id 8): dx of LayerNormLastDim from its input x and the upstream g.

With xhat = (x − mean)·istd, istd = rsqrt(var + eps): dx = istd·(g − mean(g) − xhat·mean(g·xhat)).
LayerNormLastDim's vjp emits it; its own gradient differentiates the decomposition (higher-order grads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fuel.graph.registry import FusedOps, fused_node, vjp_by_decomposition
from fuel.graph.registry.common import emitted_by_vjp, gradient_entry, operand_nodes
from fuel.graph.registry.rms_norm_last_dim import NormParams, norm_dtype_rule, norm_shape_rule
from fuel.graph.tensor import Tensor, TensorLike

NAME = "layer_norm_last_dim_backward"


@dataclass(frozen=True)
class LayerNormLastDimBackwardParams(NormParams):
    OP: ClassVar[str] = NAME


def decompose(inputs: list[Tensor], params: LayerNormLastDimBackwardParams) -> Tensor:
    x, g = inputs
    xc = x - x.mean(-1, keepdim=True)
    istd = (xc * xc).mean(-1, keepdim=True).add(params.eps).rsqrt()
    xhat = xc * istd
    return istd * ((g - g.mean(-1, keepdim=True)) - xhat * (g * xhat).mean(-1, keepdim=True))


def layer_norm_last_dim_backward(x: TensorLike, g: TensorLike, eps: float) -> Tensor:
    """Gradient of layer_norm_last_dim(x, eps) given the upstream gradient `g`."""
    params = LayerNormLastDimBackwardParams(eps)
    return Tensor(fused_node(FusedOps.LAYER_NORM_LAST_DIM_BACKWARD, operand_nodes(x, g), params))


ENTRY = gradient_entry(
    FusedOps.LAYER_NORM_LAST_DIM_BACKWARD, "LayerNormLastDimBackward", LayerNormLastDimBackwardParams,
    norm_shape_rule, norm_dtype_rule, decompose, pattern=None, vjp=vjp_by_decomposition(decompose),
    no_pattern=emitted_by_vjp("LayerNormLastDim"),
)
