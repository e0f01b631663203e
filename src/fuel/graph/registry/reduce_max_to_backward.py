"""ReduceMaxToBackward (id 10): the gradient of REDUCE_MAX_TO, with tied maxima sharing it equally.

Inputs x (the forward input) and g (the upstream gradient, of the forward's target shape: right-aligned
against x, each reduced axis 1 or missing on the left). The result has x's shape and dtype: every
element that is its group's maximum gets g/ties, where ties is how many elements share that maximum
(`[1, 3, 3, 2] -> [0, g/2, g/2, 0]`, as torch.amax's backward); the other elements get 0·(g/ties), which
is 0 for a finite g (a non-finite g gives NaN there, as torch's amax backward and the decomposition do).

NaN: REDUCE_MAX_TO propagates NaN, so a group holding a NaN has the maximum NaN. An element counts as
its group's maximum when it equals it or when both are NaN: such a group shares g among its NaN
elements, and its other elements get 0. (torch.amax gives NaN gradients there; it is not an oracle for
NaN inputs.) An all-(−inf) group has maximum −inf, and all its elements tie.

Only autograd emits it (the REDUCE_MAX_TO primitive's gradient); its own gradient differentiates the
decomposition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fuel.dtype import DType
from fuel.errors import ShapeError
from fuel.graph.node import Op, Shape
from fuel.graph.prims import make
from fuel.graph.registry import FusedOps, fused_node, vjp_by_decomposition
from fuel.graph.registry.common import gradient_dtype, gradient_entry, operand_nodes
from fuel.graph.shapes import reduce_to_axes
from fuel.graph.tensor import Tensor, TensorLike

NAME = "reduce_max_to_backward"


@dataclass(frozen=True)
class ReduceMaxToBackwardParams:
    pass


def reduced_axes(x: Shape, target: Shape) -> tuple[int, ...]:
    """The axes of x that REDUCE_MAX_TO(target) takes the max over; ShapeError if target does not fit."""
    try:
        axes = reduce_to_axes(NAME, x, target)
    except ShapeError as e:
        raise ShapeError(f"{NAME}: g has shape {list(target)}, which is not a reduce-to target of x's "
                         f"{list(x)} ({str(e).split(': ', 1)[-1]})") from None
    if 0 in x and math.prod(target) > 0:
        raise ShapeError(f"{NAME}: g has shape {list(target)}, but x {list(x)} has an empty axis to take "
                         f"the max over")
    return axes


def shape_rule(shapes: tuple[Shape, ...], params: ReduceMaxToBackwardParams) -> Shape:
    x, g = shapes
    reduced_axes(x, g)
    return x


def dtype_rule(dtypes: tuple[DType, ...], params: ReduceMaxToBackwardParams) -> DType:
    return gradient_dtype(NAME, ("x", "g"), dtypes)


def decompose(inputs: list[Tensor], params: ReduceMaxToBackwardParams) -> Tensor:
    """mask = (x == y) or both NaN, as x's dtype (a cast of the comparison: never 0·x, which is NaN at
    ±inf); grad = mask · (g / Σmask) broadcast back."""
    x, g = inputs
    y = Tensor(make(Op.REDUCE_MAX_TO, (x.node,), g.shape)).broadcast_to(x.shape)
    both_nan = (x != x) * (y != y)  # u8 product: NaN never equals itself
    mask = (x == y).maximum(both_nan).cast(x.dtype)
    ties = Tensor(make(Op.REDUCE_SUM_TO, (mask.node,), g.shape))
    return mask * (g / ties).broadcast_to(x.shape)


def reduce_max_to_backward(x: TensorLike, g: TensorLike) -> Tensor:
    """Gradient of `REDUCE_MAX_TO(x, g.shape)` given the upstream gradient `g`: tied maxima share g
    equally; a group holding NaN shares it among its NaN elements (see the module docstring)."""
    return Tensor(fused_node(FusedOps.REDUCE_MAX_TO_BACKWARD, operand_nodes(x, g), ReduceMaxToBackwardParams()))


ENTRY = gradient_entry(
    FusedOps.REDUCE_MAX_TO_BACKWARD, "ReduceMaxToBackward", ReduceMaxToBackwardParams,
    shape_rule, dtype_rule, decompose, pattern=None, vjp=vjp_by_decomposition(decompose),
    no_pattern="autograd's VJP of MAX_DIM and REDUCE_MAX_TO emits it directly, so no graph holds its lowering",
)
