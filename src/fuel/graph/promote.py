"""Dtype promotion of mixed operands, following NumPy 2 (NEP 50), lowered to CAST nodes.

Two typed operands (tensors, arrays, NumPy scalars) promote like `np.result_type`. bf16, which NumPy
does not know, promotes as f16 does against every other type (so bf16 with u8 stays bf16 and bf16
with i64 gives f64), and bf16 with f16 gives f32, the narrowest type holding both. Python scalars
(bool, int, float, but not NumPy scalars) are weak: they take the tensor's dtype, an int that does not
fit an integer dtype is an error, and a float with an integer tensor gives DEFAULT_FLOAT.

Operands are cast to the promoted dtype before the primitive is built, so every primitive's own rule
stays strict (one dtype); fused-op builders do not promote, since their dtype tuples are kernel keys.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fuel.dtype import DEFAULT_FLOAT, DType, from_numpy
from fuel.errors import DTypeError, ParamError
from fuel.graph.node import Node, Op, Shape
from fuel.graph.prims import COMPARE, make
from fuel.graph.shapes import broadcast_shapes

PyScalar = bool | int | float
# A binary op's operand: a graph node, a NumPy scalar (typed) or a Python scalar (weak).
Operand = Node | np.generic | PyScalar

# `s op x` is `x FLIPPED[op] s`.
FLIPPED: dict[Op, Op] = {Op.LT: Op.GT, Op.LE: Op.GE, Op.GT: Op.LT, Op.GE: Op.LE, Op.EQ: Op.EQ, Op.NE: Op.NE}


def is_weak(x: object) -> bool:
    """A Python bool, int or float. NumPy scalars are excluded: NumPy 2 gives them their own dtype."""
    return isinstance(x, (bool, int, float)) and not isinstance(x, np.generic)


def is_number(x: object) -> bool:
    """A Python or NumPy scalar number (bool included)."""
    return is_weak(x) or isinstance(x, (np.integer, np.floating, np.bool_))


def _fuel(dtype: DType | np.dtype[Any], op: str) -> DType | np.dtype[Any]:
    """A Fuel DType where there is one (NumPy bool is stored as u8), else the NumPy dtype itself."""
    if isinstance(dtype, DType):
        return dtype
    if dtype == np.bool_:
        return DType.U8
    try:
        return from_numpy(dtype, op)
    except DTypeError:
        return dtype


def result_dtype(op: str, a: DType | np.dtype[Any], b: DType | np.dtype[Any]) -> DType:
    """The dtype two typed operands promote to (see the module docstring)."""
    fa, fb = _fuel(a, op), _fuel(b, op)
    if fa == fb and isinstance(fa, DType):
        return fa
    if {fa, fb} == {DType.BF16, DType.F16}:
        return DType.F32
    has_bf16 = DType.BF16 in (fa, fb)
    na, nb = (DType.F16.np if f is DType.BF16 else f.np if isinstance(f, DType) else f for f in (fa, fb))
    res = np.result_type(na, nb)
    try:
        out = from_numpy(res, op)
    except DTypeError:
        raise DTypeError(f"{op}: {a} and {b} promote to {res}, which Fuel does not store; cast first") from None
    return DType.BF16 if has_bf16 and out is DType.F16 else out


def int_range(dtype: DType) -> tuple[int, int]:
    info = np.iinfo(dtype.np)
    return int(info.min), int(info.max)


def weak_dtype(op: str, dtype: DType, value: PyScalar) -> DType:
    """The dtype of a `dtype` tensor combined with the Python scalar `value`."""
    if dtype.is_float:
        return dtype
    if isinstance(value, float):
        return DEFAULT_FLOAT
    lo, hi = int_range(dtype)
    if not lo <= value <= hi:
        raise DTypeError(f"{op}: the Python int {value} is out of range for {dtype.value} ({lo} to {hi}); "
                         f"cast the tensor to a wider dtype first")
    return dtype


def int_compare(op: Op, dtype: DType, value: PyScalar) -> tuple[Op, int] | bool:
    """`x op value` for integers x of `dtype`, rewritten exactly: either the same comparison with an int
    inside dtype's range, or the constant answer where every x gives the same one. Rounding the scalar
    to the dtype instead would make `[0, 1, 2] >= 0.5` all true and `u8 < 300` overflow."""
    lo, hi = int_range(dtype)
    k: int
    if isinstance(value, float):
        if math.isnan(value):
            return op is Op.NE
        if math.isinf(value):
            k = hi + 1 if value > 0 else lo - 1
        elif op in (Op.EQ, Op.NE):
            if not value.is_integer():
                return op is Op.NE
            k = int(value)
        else:
            # For an integer x: x < v and x >= v compare with ceil(v); x <= v and x > v with floor(v).
            k = math.ceil(value) if op in (Op.LT, Op.GE) else math.floor(value)
    else:
        k = int(value)
    if k > hi:
        return op in (Op.LT, Op.LE, Op.NE)
    if k < lo:
        return op in (Op.GT, Op.GE, Op.NE)
    return op, k


def const(op: str, value: Any, dtype: DType) -> Node:
    """A rank-0 leaf holding `value` as `dtype`; a Python int outside an integer dtype is an error."""
    if dtype.is_int and is_weak(value) and not isinstance(value, float):
        weak_dtype(op, dtype, value)
    arr = np.array(value, dtype=dtype.np)
    if arr.ndim:
        raise ParamError(f"{op}: the fill value must be a scalar, got shape {list(arr.shape)}")
    arr.flags.writeable = False  # a constant (`fuel.graph.node.frozen`): fl.jit folds what reads only these
    return Node(Op.CONST, (), (), dtype, None, arr)


def cast(node: Node, dtype: DType) -> Node:
    return node if node.dtype is dtype else make(Op.CAST, (node,), dtype)


def broadcast(node: Node, shape: Shape) -> Node:
    return node if node.shape == shape else make(Op.BROADCAST_TO, (node,), shape)


def _typed(x: Operand) -> DType | np.dtype[Any] | None:
    return x.dtype if isinstance(x, (Node, np.generic)) else None


def operand_dtype(op: str, a: Operand, b: Operand) -> DType:
    """The dtype `a` and `b` promote to."""
    da, db = _typed(a), _typed(b)
    if da is not None and db is not None:
        return result_dtype(op, da, db)
    if da is not None:
        return weak_dtype(op, result_dtype(op, da, da), b)  # type: ignore[arg-type]
    if db is not None:
        return weak_dtype(op, result_dtype(op, db, db), a)  # type: ignore[arg-type]
    kinds = {type(a), type(b)}  # two Python scalars: NumPy's default types, floats DEFAULT_FLOAT
    return DEFAULT_FLOAT if float in kinds else DType.I64 if int in kinds else DType.U8


def promote_pair(op: str, a: Operand, b: Operand) -> tuple[Node, Node]:
    """Both operands as nodes of the dtype they promote to (scalars become rank-0 leaves)."""
    dt = operand_dtype(op, a, b)
    na, nb = (cast(x, dt) if isinstance(x, Node) else const(op, x, dt) for x in (a, b))
    return na, nb


def _compare_int(op: Op, x: Node, value: PyScalar) -> Node:
    exact = int_compare(op, x.dtype, value)
    if isinstance(exact, bool):
        return broadcast(const(_name(op), int(exact), DType.U8), x.shape)
    cmp, k = exact
    return make(cmp, (x, broadcast(const(_name(op), k, x.dtype), x.shape)))


def _scalar_node(op: Op, x: Node, value: float, node_first: bool) -> Node:
    """A float tensor with a scalar, as the ADD_SCALAR/MUL_SCALAR nodes the fusion patterns match."""
    if op is Op.MUL:
        return make(Op.MUL_SCALAR, (x,), value)
    if op is Op.SUB and node_first:
        return make(Op.ADD_SCALAR, (x,), -value)
    return make(Op.ADD_SCALAR, (x if op is Op.ADD else make(Op.NEG, (x,)),), value)


def _name(op: Op) -> str:
    return op.name.lower()


def elementwise(op: Op, a: Operand, b: Operand) -> Node:
    """A binary elementwise primitive over promoted, broadcast operands. An integer tensor compared with
    a Python scalar is rewritten exactly (int_compare); true division of integers gives DEFAULT_FLOAT."""
    name = _name(op)
    for x, s, x_op, x_first in ((a, b, op, True), (b, a, FLIPPED.get(op, op), False)):
        if isinstance(x, Node) and not isinstance(s, Node):
            if op in COMPARE and x.dtype.is_int and is_weak(s):
                return _compare_int(x_op, x, s)  # type: ignore[arg-type]
            dt = operand_dtype(name, x, s)
            if dt.is_float and op in (Op.ADD, Op.SUB, Op.MUL):
                return _scalar_node(op, cast(x, dt), float(s), x_first)
            break
    na, nb = promote_pair(name, a, b)
    if op is Op.DIV and na.dtype.is_int:
        na, nb = cast(na, DEFAULT_FLOAT), cast(nb, DEFAULT_FLOAT)
    shape = broadcast_shapes(name, na.shape, nb.shape)
    return make(op, (broadcast(na, shape), broadcast(nb, shape)))
