"""LayerNormLastDim (id 4): (x - mean) / sqrt(var + eps) over the last axis (population variance,
no affine weight or bias)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from fuel.graph.node import Node, Op
from fuel.graph.passes.pattern import broadcast_keepdim_last, only_used_once
from fuel.graph.registry import BackwardKind, FusedOpEntry, FusedOpFamily, FusedOps, Match, fused_node
from fuel.graph.registry.rms_norm_last_dim import (
    NormParams,
    match_root_ms,
    norm_dtype_rule,
    norm_shape_rule,
    normable,
    scaled_by_root_ms,
    square_of,
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


def pattern(node: Node, counts: Mapping[Node, int]) -> Match | None:
    """Div(c, bcast(Sqrt(AddScalar(eps)(keepdim MeanDim(c²))))) with c = Sub(x, bcast(keepdim
    MeanDim(x))); or Mul(c, bcast(Rsqrt(...))) in either operand order."""
    if not node.dtype.is_float:
        return None
    for centered, denom, root_op in scaled_by_root_ms(node):
        if centered.op is not Op.SUB or not normable(centered):
            continue
        found = match_root_ms(denom, centered.shape, root_op)
        if found is None:
            continue
        sq, eps, interior = found
        if not square_of(sq, centered):
            continue
        x, bmean = centered.inputs
        mean = broadcast_keepdim_last(bmean, Op.MEAN_DIM, None, x.shape)
        if mean is None or mean[0] is not x:
            continue
        # `centered` feeds the root and the square (twice when spelled c * c), nothing else.
        uses = 1 + (2 if sq.op is Op.MUL else 1)
        if counts[centered] == uses and only_used_once(counts, [*interior, *mean[1]]):
            return Match((x,), LayerNormLastDimParams(eps))
    return None


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
