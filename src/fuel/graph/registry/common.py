"""Pieces several entry modules share: a builder's operand nodes, the dtype rules of ops whose inputs
all take the first one's float dtype and of gradient ops, and the entry of a gradient op only autograd
emits.

Not an entry module (it defines no ENTRY).
"""

from __future__ import annotations

from collections.abc import Sequence

from fuel.dtype import DType
from fuel.errors import DTypeError
from fuel.graph.node import Node
from fuel.graph.registry import (
    NOT_DIFFERENTIABLE,
    Decompose,
    DTypeRule,
    FusedOpEntry,
    FusedOpFamily,
    FusedOpId,
    Pattern,
    ShapeRule,
    Vjp,
)
from fuel.graph.tensor import TensorLike, as_tensor


def operand_nodes(first: TensorLike, *rest: TensorLike) -> list[Node]:
    """The builder's operands as graph nodes. A bare scalar after the first takes the first operand's
    dtype (an upstream gradient of 1.0, say); arrays keep their own, for the dtype rule to judge."""
    head = as_tensor(first)
    return [head.node, *(as_tensor(t, head).node for t in rest)]


def spoken(words: Sequence[str]) -> str:
    """'a', 'a and b', 'a, b and c': names listed in a message."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def float_like_first(op: str, names: Sequence[str], dtypes: Sequence[DType]) -> DType:
    """The dtype rule of an op whose first input is a float tensor and whose other inputs share its dtype.

    One message names all the others, e.g. "rope: cos and sin must have x's dtype f32, got f64 and f32".
    """
    first = dtypes[0]
    if not first.is_float:
        raise DTypeError(f"{op}: {names[0]} must be a float tensor, got {first.value}")
    rest = dtypes[1:]
    if any(d != first for d in rest):
        raise DTypeError(f"{op}: {spoken(names[1:])} must have {names[0]}'s dtype {first.value}, "
                         f"got {spoken([d.value for d in rest])}")
    return first


def gradient_dtype(op: str, names: tuple[str, str], dtypes: Sequence[DType]) -> DType:
    """The dtype rule of a gradient op: its forward operand (`names[0]`, the forward's input or output) is
    a float tensor and the upstream gradient (`names[1]`) shares its dtype: "g is f64, x is f32"."""
    first = dtypes[0]
    if not first.is_float:
        raise DTypeError(f"{op}: {names[0]} must be a float tensor, got {first.value}")
    for d in dtypes[1:]:
        if d != first:
            raise DTypeError(f"{op}: {names[1]} is {d.value}, {names[0]} is {first.value}")
    return first


def emitted_by_vjp(forward: str) -> str:
    """The `no_pattern` reason of a gradient op that only a fused forward's vjp emits."""
    return (f"only {forward}'s vjp emits it: fl.grad fuses a {forward} spelled in primitives before "
            f"differentiating, so no primitive VJP emits this lowering")


def gradient_entry(op_id: FusedOpId, name: str, params: type, shape_rule: ShapeRule, dtype_rule: DTypeRule,
                   decompose: Decompose, pattern: Pattern | None, vjp: Vjp, no_pattern: str | None = None
                   ) -> FusedOpEntry:
    """The entry of a single-output gradient op that autograd emits from a forward input (or output)
    and the upstream gradient, arity 2.

    The inventory lists it as NotDifferentiable (no fused op is its gradient); `vjp` is its own gradient,
    for higher-order derivatives (mostly `vjp_by_decomposition(decompose)`). `no_pattern` says why an
    entry without a pattern has none.
    """
    return FusedOpEntry(
        id=op_id,
        name=name,
        family=FusedOpFamily.BACKWARD,
        params=params,
        arity=(2,),
        shape_rule=shape_rule,
        dtype_rule=dtype_rule,
        decompose=decompose,
        backward=NOT_DIFFERENTIABLE,
        vjp=vjp,
        pattern=pattern,
        output_views=None,
        destructive_input=None,
        no_pattern=no_pattern,
    )

