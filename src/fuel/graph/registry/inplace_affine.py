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

Pattern: the value form written back over x, `fl.assign(x, x * mul + add)` (also `x * mul` and `x + add`
alone), the update shape of an optimizer step in a captured training step (a decay, a momentum
rescale). The fused op rounds once where the spelling rounds after the product and again after the sum,
so its result is the exact affine value rounded to x's dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuel.dtype import DType
from fuel.errors import DTypeError, ParamError, ShapeError
from fuel.graph.node import Node, Op, Shape
from fuel.graph.passes.template import Bound, Scalar, Wild, template_pattern
from fuel.graph.prims import CacheWriteArg, make
from fuel.graph.registry import NOT_DIFFERENTIABLE, FusedOpEntry, FusedOpFamily, FusedOps, Match, fused_node
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


def _written_back(x: Tensor, value: Tensor) -> Tensor:
    """`fl.assign(x, value)` as its nodes (a 0-d target written through one-element views), built
    without noting an effect: the recipe is traced once, possibly while a jit capture is recording."""
    if x.ndim == 0:
        return _written_back(x.reshape(1), value.reshape(1)).reshape(())
    return Tensor(make(Op.CACHE_WRITE, (x.node, value.node), CacheWriteArg(0, 0)))


def _affine(x: Wild, mul: Scalar, add: Scalar) -> Tensor:
    return _written_back(x, x * mul + add)


def _scale(x: Wild, mul: Scalar) -> Tensor:
    return _written_back(x, x * mul)


def _shift(x: Wild, add: Scalar) -> Tensor:
    return _written_back(x, x + add)


def _scalar(m: Bound, name: str, absent: float) -> float:
    """The number a Scalar bound, or `absent` in a variant without it (`x * mul` adds 0)."""
    try:
        return m.scalar(name)
    except KeyError:
        return absent


def _build(m: Bound) -> Match | None:
    x = m.node("x")
    if x.value is None or not x.dtype.is_float:  # assign writes only a realised tensor
        return None
    # The spelling's scalars are rounded to the dtype its primitives compute in (f32 for f32 and the
    # half types, f64 for f64), as NumPy rounds a Python scalar to the array's type.
    work = np.float64 if x.dtype is DType.F64 else np.float32
    mul, add = (float(work(_scalar(m, name, absent))) for name, absent in (("mul", 1.0), ("add", 0.0)))
    return Match((x,), InplaceAffineParams(mul, add))


_PATTERNS = [template_pattern(_affine, _build, variants=[_scale, _shift], shapes={"x": shape})
             for shape in ((2, 3), ())]


def pattern(node: Node, counts: Mapping[Node, int]) -> Match | None:
    """`fl.assign(x, x * mul + add)` (or `x * mul`, `x + add`) at any rank, 0 included."""
    if node.op not in (Op.CACHE_WRITE, Op.RESHAPE):
        return None
    return next((m for m in (p(node, counts) for p in _PATTERNS) if m is not None), None)


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
    pattern=pattern,
    output_views=None,
    destructive_input=0,
)
