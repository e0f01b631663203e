"""RmsNormLastDim (id 3): x / sqrt(mean(x², last) + eps), no affine weight.

The rules and pattern pieces shared by the whole norm family (entries 3, 4, 8, 9) live here too:
the eps check, the params and the shape/dtype rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from fuel.dtype import DType
from fuel.errors import ParamError, ShapeError
from fuel.graph.node import Node, Shape
from fuel.graph.passes.template import Bound, Scalar, Wild, template_pattern
from fuel.graph.registry import BackwardKind, FusedOpEntry, FusedOpFamily, FusedOps, Match, fused_node
from fuel.graph.registry.common import gradient_dtype
from fuel.graph.tensor import Tensor, TensorLike, as_tensor

# ---- shared by the norm family ---------------------------------------------------------------


def valid_eps(eps: object) -> bool:
    """A finite real > 0 (bools are not numbers here)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)):
        return False
    return math.isfinite(float(eps)) and float(eps) > 0.0


def check_eps(op: str, eps: object) -> float:
    """eps as a float, or ParamError naming `op`: every norm divides by sqrt(... + eps)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)):
        raise ParamError(f"{op}: eps must be a number > 0, got {eps!r}")
    if not math.isfinite(float(eps)):
        raise ParamError(f"{op}: eps must be finite and > 0, got {float(eps)!r}")
    if not float(eps) > 0.0:
        raise ParamError(f"{op}: eps must be > 0, got {float(eps)!r}")
    return float(eps)


@dataclass(frozen=True)
class NormParams:
    """The norm family's params: eps, checked on construction. Each entry has its own subclass, whose
    OP names it in error messages (and the registry's params check tells the entries apart)."""

    OP: ClassVar[str]
    eps: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "eps", check_eps(self.OP, self.eps))


def norm_shape_rule(shapes: tuple[Shape, ...], params: NormParams) -> Shape:
    """Input 0 (x) of rank >= 1 with a non-empty last axis; every other input has x's shape."""
    op, x = params.OP, shapes[0]
    if not x:
        raise ShapeError(f"{op}: x must have rank >= 1, got a rank-0 tensor")
    if x[-1] == 0:
        raise ShapeError(f"{op}: x's last dim must be > 0 (a norm of nothing), got shape {list(x)}")
    for s in shapes[1:]:
        if s != x:
            raise ShapeError(f"{op}: upstream gradient {list(s)} must have x's shape {list(x)}")
    return x


def norm_dtype_rule(dtypes: tuple[DType, ...], params: NormParams) -> DType:
    """Float x; the backward entries' upstream gradient of x's dtype."""
    return gradient_dtype(params.OP, ("x", "upstream gradient"), dtypes)


def normable(x: Node) -> bool:
    """A pattern must not propose a node the shape/dtype rules would reject."""
    return x.dtype.is_float and bool(x.shape) and x.shape[-1] > 0


# ---- the entry ---------------------------------------------------------------------------------

NAME = "rms_norm_last_dim"


@dataclass(frozen=True)
class RmsNormLastDimParams(NormParams):
    OP: ClassVar[str] = NAME


def decompose(inputs: list[Tensor], params: RmsNormLastDimParams) -> Tensor:
    (x,) = inputs
    # The spelling a user writes, so fuse(decompose(op)) finds the op again.
    return x / (x * x).mean(-1, keepdim=True).add(params.eps).sqrt()


def _recipe(x: Wild, eps: Scalar) -> Tensor:
    return decompose([x], RmsNormLastDimParams(eps))


def _by_rsqrt(x: Wild, eps: Scalar) -> Tensor:
    return x * (x * x).mean(-1, keepdim=True).add(eps).rsqrt()


def _build(m: Bound) -> Match | None:
    x, eps = m.node("x"), m.scalar("eps")
    return Match((x,), RmsNormLastDimParams(eps)) if normable(x) and valid_eps(eps) else None


# x², x.square() and x ** 2 read alike; so do the operand orders of the product.
pattern = template_pattern(_recipe, build=_build, variants=[_by_rsqrt])


def vjp(inputs: list[Tensor], params: RmsNormLastDimParams, out: Tensor,
        grad_out: Tensor) -> list[Tensor | None]:
    from fuel.graph.registry.rms_norm_last_dim_backward import rms_norm_last_dim_backward

    return [rms_norm_last_dim_backward(inputs[0], grad_out, params.eps)]


def rms_norm_last_dim(x: TensorLike, eps: float) -> Tensor:
    """RMS norm over the last axis: x / sqrt(mean(x², last) + eps) (no weight)."""
    params = RmsNormLastDimParams(eps)
    return Tensor(fused_node(FusedOps.RMS_NORM_LAST_DIM, [as_tensor(x).node], params))


ENTRY = FusedOpEntry(
    id=FusedOps.RMS_NORM_LAST_DIM,
    name="RmsNormLastDim",
    family=FusedOpFamily.NORM,
    params=RmsNormLastDimParams,
    arity=(1,),
    shape_rule=norm_shape_rule,
    dtype_rule=norm_dtype_rule,
    decompose=decompose,
    backward=BackwardKind.fused(FusedOps.RMS_NORM_LAST_DIM_BACKWARD),
    vjp=vjp,
    pattern=pattern,
    output_views=None,
    destructive_input=None,
)
