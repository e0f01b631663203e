"""Shape and dtype rules of the bit primitives, for `fuel.graph.prims.RULES`.

- SHR and BITAND: elementwise `x >> s` and `x & m` of two integer operands of one shape and one dtype
  (the Tensor operators `>>` and `&` broadcast and promote first, as every binary op's do). A shift by the
  dtype's width or more gives 0 for unsigned types, as NumPy's does.
- BITCAST (arg: the target DType): the bytes of the last axis read as another dtype, little-endian, as
  NumPy's `.view` of a C-contiguous array reads them. `[..., L]` of itemsize a becomes `[..., L·a/b]` of
  itemsize b; `L·a` must be a multiple of b. Types of one size keep the shape (rank 0 included).

These are integer data movement, not arithmetic on values: none has a gradient (`fuel.graph.autograd`),
and `fl.grad` refuses an integer tensor as `wrt`.
"""

from __future__ import annotations

from typing import Any

from fuel.dtype import DType
from fuel.errors import DTypeError, ParamError, ShapeError
from fuel.graph.node import Node, Op, Shape

BIT_OPS = frozenset({Op.SHR, Op.BITAND})


def bitwise_rule(op: Op) -> Any:
    name = op.name.lower()

    def rule(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
        if len(inputs) != 2:
            raise ShapeError(f"{name}: takes 2 input(s), got {len(inputs)}")
        a, b = inputs
        if a.shape != b.shape:
            raise ShapeError(f"{name}: operands must have one shape, got {list(a.shape)} and {list(b.shape)}")
        if a.dtype is not b.dtype:
            raise DTypeError(f"{name}: operands must have one dtype, got {a.dtype.value} and {b.dtype.value}")
        if not a.dtype.is_int:
            raise DTypeError(f"{name}: needs integer operands, got {a.dtype.value}")
        return a.shape, a.dtype
    return rule


def bitcast_rule(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
    if len(inputs) != 1:
        raise ShapeError(f"bitcast: takes 1 input(s), got {len(inputs)}")
    if not isinstance(arg, DType):
        raise ParamError(f"bitcast: target must be a DType, got {arg!r}")
    x = inputs[0]
    a, b = x.dtype.itemsize, arg.itemsize
    if a == b:
        return x.shape, arg
    if not x.shape:
        raise ShapeError(f"bitcast: a rank-0 {x.dtype.value} ({a} bytes) cannot be read as {arg.value} "
                         f"({b} bytes); the last axis carries the bytes")
    last = x.shape[-1]
    if last * a % b:
        raise ShapeError(f"bitcast: the last axis of {list(x.shape)} {x.dtype.value} holds {last * a} bytes, "
                         f"not a multiple of {arg.value}'s {b}")
    return x.shape[:-1] + (last * a // b,), arg


BIT_RULES: dict[Op, Any] = {Op.SHR: bitwise_rule(Op.SHR), Op.BITAND: bitwise_rule(Op.BITAND),
                            Op.BITCAST: bitcast_rule}
