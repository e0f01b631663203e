"""RmsNormLastDimBackward (id 9): dx of RmsNormLastDim from its input x and the upstream gradient g.

With r = rsqrt(mean(x²) + eps): dx = r·(g − x·Σ(g·x) / (n·(mean(x²) + eps))), n = x's last dim.
RmsNormLastDim's vjp emits it; its own gradient differentiates the decomposition (higher-order grads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fuel.graph.registry import FusedOps, fused_node, vjp_by_decomposition
from fuel.graph.registry.common import emitted_by_vjp, gradient_entry, operand_nodes
from fuel.graph.registry.rms_norm_last_dim import NormParams, norm_dtype_rule, norm_shape_rule
from fuel.graph.tensor import Tensor, TensorLike

NAME = "rms_norm_last_dim_backward"


@dataclass(frozen=True)
class RmsNormLastDimBackwardParams(NormParams):
    OP: ClassVar[str] = NAME


def decompose(inputs: list[Tensor], params: RmsNormLastDimBackwardParams) -> Tensor:
    x, g = inputs
    n = float(x.shape[-1])
    den = (x * x).mean(-1, keepdim=True).add(params.eps)
    if x.shape[-1] == 1:  # g·x² cancels x·(g·x) to rounding noise; one element's gradient is g·eps/den^1.5
        return den.rsqrt() * g * (params.eps / den)
    return den.rsqrt() * (g - x * (g * x).sum(-1, keepdim=True) / (den * n))


def rms_norm_last_dim_backward(x: TensorLike, g: TensorLike, eps: float) -> Tensor:
    """Gradient of rms_norm_last_dim(x, eps) given the upstream gradient `g`."""
    params = RmsNormLastDimBackwardParams(eps)
    return Tensor(fused_node(FusedOps.RMS_NORM_LAST_DIM_BACKWARD, operand_nodes(x, g), params))


ENTRY = gradient_entry(
    FusedOps.RMS_NORM_LAST_DIM_BACKWARD, "RmsNormLastDimBackward", RmsNormLastDimBackwardParams,
    norm_shape_rule, norm_dtype_rule, decompose, pattern=None, vjp=vjp_by_decomposition(decompose),
    no_pattern=emitted_by_vjp("RmsNormLastDim"),
)
