"""InplaceAffine (id 16): x ← mul·x + add, written into x's own buffer (destructive_input = 0).

Input x (a float tensor); params `mul` and `add` (Python floats). The result has x's shape and dtype
and, once realised, *is* x's memory: the kernel receives `out = inputs[0]` from the executor. Each
element is computed in f64 (the half types widen exactly) and rounded once to x's dtype.

Ordering: the scheduler runs every other reader of x (and of its views) in the same graph before this
node, and CSE never merges two of them (each one applies). A node that needs x both before and after
the write (e.g. `x + inplace_affine(x, …)`) cannot be ordered: realising it raises `StaleInput`, as
does realising a reader of x built before the write once the write has run.

The decomposition is the value form only, `AddScalar(add)(MulScalar(mul)(x))`, which writes a fresh
buffer; its gradient is d/dx = mul·g (the inventory's metadata says NotDifferentiable as `backward=`,
but the entry serves this vjp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fuel.dtype import DType
from fuel.errors import DTypeError, ParamError, ShapeError
from fuel.graph.node import Shape
from fuel.graph.registry import NOT_DIFFERENTIABLE, FusedOpEntry, FusedOpFamily, FusedOps, fused_node
from fuel.graph.tensor import Tensor, TensorLike, as_tensor
from fuel.graph.traced import note_effect

NAME = "inplace_affine"


def _real(field: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ParamError(f"{NAME}: {field} must be a float, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class InplaceAffineParams:
    mul: float
    add: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "mul", _real("mul", self.mul))
        object.__setattr__(self, "add", _real("add", self.add))


def shape_rule(shapes: tuple[Shape, ...], params: InplaceAffineParams) -> Shape:
    if len(shapes) != 1:
        raise ShapeError(f"{NAME}: takes 1 input, got {len(shapes)}")
    return shapes[0]


def dtype_rule(dtypes: tuple[DType, ...], params: InplaceAffineParams) -> DType:
    (x,) = dtypes
    if not x.is_float:
        raise DTypeError(f"{NAME}: x must be a float tensor, got {x.value}")
    return x


def decompose(inputs: list[Tensor], params: InplaceAffineParams) -> Tensor:
    """The value form: a fresh buffer, MulScalar then AddScalar (each rounded in x's dtype)."""
    (x,) = inputs
    return x * params.mul + params.add


def vjp(inputs: list[Tensor], params: InplaceAffineParams, out: Tensor, grad_out: Tensor) -> list[Any]:
    """d/dx (mul·x + add) = mul: the gradient never reads x, so the write does not disturb it."""
    return [grad_out * params.mul]


def inplace_affine(x: TensorLike, mul: float, add: float) -> Tensor:
    """`mul·x + add`, computed IN PLACE: realising the result OVERWRITES X'S BUFFER.

    **This mutates the caller's memory.** `fl.tensor(arr)` (and passing `arr` here directly) wraps a
    NumPy array without copying it (unless it converts a dtype or a bool array), so when the graph is
    realised `arr` itself holds `mul·arr + add`, and the result's array is `arr`'s memory. Every later
    graph that reads that leaf sees the new values. A non-contiguous view (e.g. `arr.T`) is written in
    place too; a read-only array (a broadcast, a `.numpy()` result) raises a KernelError at realise.

    Other readers of x in the same graph (`z = x * 2` realised together with the result) run before
    the write and see the old values. A reader of x built before the write and realised after it, a
    node needing x both before and after the write, and two in-place ops on the same x realised
    together (each from the old value: chain them instead) raise `fl.StaleInput`.
    """
    params = InplaceAffineParams(mul, add)
    node = fused_node(FusedOps.INPLACE_AFFINE, [as_tensor(x).node], params)
    note_effect(node)  # runs inside fl.jit even when nothing reads it
    return Tensor(node)


ENTRY = FusedOpEntry(
    id=FusedOps.INPLACE_AFFINE,
    name="InplaceAffine",
    family=FusedOpFamily.FORWARD,
    params=InplaceAffineParams,
    arity=(1,),
    shape_rule=shape_rule,
    dtype_rule=dtype_rule,
    decompose=decompose,
    backward=NOT_DIFFERENTIABLE,
    vjp=vjp,
    pattern=None,
    output_views=None,
    destructive_input=0,
)
