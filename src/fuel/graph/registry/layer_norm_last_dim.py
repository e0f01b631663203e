"""LayerNormLastDim (id 4): (x - mean) / sqrt(var + eps) over the last axis (population variance,
no affine weight or bias)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fuel.graph.passes.template import Bound, Scalar, Wild, template_pattern
from fuel.graph.registry import BackwardKind, FusedOpEntry, FusedOpFamily, FusedOps, Match, fused_node
from fuel.graph.registry.rms_norm_last_dim import (
    NormParams,
    norm_dtype_rule,
    norm_shape_rule,
    normable,
    valid_eps,
)
from fuel.graph.tensor import Tensor, TensorLike, as_tensor

NAME = "layer_norm_last_dim"


@dataclass(frozen=True)
class LayerNormLastDimParams(NormParams):
    OP: ClassVar[str] = NAME


def decompose(inputs: list[Tensor], params: LayerNormLastDimParams) -> Tensor:
    (x,) = inputs
    # The spelling a user writes, so fuse(decompose(op)) finds the op again.
    centered = x - x.mean(-1, keepdim=True)
    return centered / (centered * centered).mean(-1, keepdim=True).add(params.eps).sqrt()


def _recipe(x: Wild, eps: Scalar) -> Tensor:
    return decompose([x], LayerNormLastDimParams(eps))


def _by_rsqrt(x: Wild, eps: Scalar) -> Tensor:
    centered = x - x.mean(-1, keepdim=True)
    return centered * (centered * centered).mean(-1, keepdim=True).add(eps).rsqrt()


def _build(m: Bound) -> Match | None:
    x, eps = m.node("x"), m.scalar("eps")
    return Match((x,), LayerNormLastDimParams(eps)) if normable(x) and valid_eps(eps) else None


pattern = template_pattern(_recipe, build=_build, variants=[_by_rsqrt])


def vjp(inputs: list[Tensor], params: LayerNormLastDimParams, out: Tensor,
        grad_out: Tensor) -> list[Tensor | None]:
    from fuel.graph.registry.layer_norm_last_dim_backward import layer_norm_last_dim_backward

    return [layer_norm_last_dim_backward(inputs[0], grad_out, params.eps)]


def layer_norm_last_dim(x: TensorLike, eps: float) -> Tensor:
    """Layer norm over the last axis: (x - mean) / sqrt(var + eps) (no weight, no bias)."""
    params = LayerNormLastDimParams(eps)
    return Tensor(fused_node(FusedOps.LAYER_NORM_LAST_DIM, [as_tensor(x).node], params))


ENTRY = FusedOpEntry(
    id=FusedOps.LAYER_NORM_LAST_DIM,
    name="LayerNormLastDim",
    family=FusedOpFamily.NORM,
    params=LayerNormLastDimParams,
    arity=(1,),
    shape_rule=norm_shape_rule,
    dtype_rule=norm_dtype_rule,
    decompose=decompose,
    backward=BackwardKind.fused(FusedOps.LAYER_NORM_LAST_DIM_BACKWARD),
    vjp=vjp,
    pattern=pattern,
    output_views=None,
    destructive_input=None,
)
