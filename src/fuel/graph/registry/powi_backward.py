"""PowIBackward (id 15): the gradient of POWI(exp), `exp · x^(exp−1) · g`.

Inputs x (the forward input) and g (the upstream gradient, x's shape and dtype); params `exp`, the
forward's integer exponent. x^(exp−1) is computed as the POWI primitive does (repeated squaring in the
order of compiler-builtins __powi, in f32 for the half types and f32, f64 for f64; a negative power is
1/x^|p|), then times exp, then times g. Like torch: exp = 0 gives 0 everywhere, even where x is 0,
±inf or NaN (not 0·x^−1); exp = −1 at x = 0 gives −inf·g.

Only autograd emits it (the POWI primitive's gradient); its own gradient differentiates the
decomposition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fuel.dtype import DType
from fuel.errors import ParamError, ShapeError
from fuel.graph.node import Shape
from fuel.graph.registry import FusedOps, fused_node, vjp_by_decomposition
from fuel.graph.registry.common import gradient_dtype, gradient_entry, operand_nodes
from fuel.graph.tensor import Tensor, TensorLike, zeros

NAME = "powi_backward"
EXP_LIMIT = 2**31  # the exponent is an i32, as the forward's is upstream: exp − 1 never overflows


@dataclass(frozen=True)
class PowIBackwardParams:
    exp: int

    def __post_init__(self) -> None:
        if isinstance(self.exp, bool) or not isinstance(self.exp, int):
            raise ParamError(f"{NAME}: exp must be an int, got {self.exp!r}")
        if not -EXP_LIMIT < self.exp < EXP_LIMIT:
            raise ParamError(f"{NAME}: exp {self.exp} is outside (-2**31, 2**31)")


def shape_rule(shapes: tuple[Shape, ...], params: PowIBackwardParams) -> Shape:
    x, g = shapes
    if g != x:
        raise ShapeError(f"{NAME}: g has shape {list(g)}, x has {list(x)}")
    return x


def dtype_rule(dtypes: tuple[DType, ...], params: PowIBackwardParams) -> DType:
    return gradient_dtype(NAME, ("x", "g"), dtypes)


def decompose(inputs: list[Tensor], params: PowIBackwardParams) -> Tensor:
    """(exp · x^(exp−1)) · g; a real zeros constant for exp = 0 (never 0·x, NaN at ±inf and NaN)."""
    x, g = inputs
    if params.exp == 0:
        return zeros(x.shape, x.dtype)
    return (x ** (params.exp - 1) * float(params.exp)) * g


_vjp_of_decomposition = vjp_by_decomposition(decompose)


def vjp(inputs: list[Tensor], params: PowIBackwardParams, out: Tensor, grad_out: Tensor) -> list[Any]:
    """The decomposition's gradient; exp = 0's output is a constant, so both gradients are zeros."""
    if params.exp == 0:
        return [zeros(t.shape, t.dtype) for t in inputs]
    return _vjp_of_decomposition(inputs, params, out, grad_out)


def powi_backward(x: TensorLike, g: TensorLike, exp: int) -> Tensor:
    """Gradient of `x ** exp` (integer exp) given the upstream gradient `g`: exp·x^(exp−1)·g, and 0
    everywhere for exp = 0."""
    params = PowIBackwardParams(exp)
    return Tensor(fused_node(FusedOps.POWI_BACKWARD, operand_nodes(x, g), params))


ENTRY = gradient_entry(
    FusedOps.POWI_BACKWARD, "PowIBackward", PowIBackwardParams,
    shape_rule, dtype_rule, decompose, pattern=None, vjp=vjp,
    no_pattern="autograd's VJP of POWI emits it directly, so no graph holds its lowering",
)
