"""Shape and dtype rules of every primitive op: one table, checked when a node is built."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fuel.dtype import DType
from fuel.errors import DTypeError, ParamError, ShapeError
from fuel.graph.bits import BIT_RULES
from fuel.graph.node import DynScalar, Node, Op, Shape
from fuel.graph.shapes import broadcast_shapes, check_dims, reduce_to_axes
from fuel.graph.slots import PRIM_SLOTS, slots_of

Rule = Callable[[tuple[Node, ...], Any], tuple[Shape, DType]]

UNARY = frozenset({
    Op.NEG, Op.ABS, Op.SQR, Op.SQRT, Op.RSQRT, Op.RECIP, Op.EXP, Op.LOG, Op.TANH, Op.SIN, Op.COS,
    Op.SIGMOID, Op.RELU, Op.SILU, Op.SIGN, Op.STEP, Op.FLOOR, Op.ERF,
})
BINARY = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MAXIMUM, Op.MINIMUM, Op.POW})
COMPARE = frozenset({Op.EQ, Op.NE, Op.LT, Op.LE, Op.GT, Op.GE})
VIEW_OPS = frozenset({Op.BROADCAST_TO, Op.PERMUTE, Op.SLICE, Op.UNSQUEEZE, Op.SQUEEZE, Op.VIEW})
# Steps whose result may alias their input's memory: the views, and a reshape NumPy can do as one (a copying
# reshape is caught where it matters).
MAY_ALIAS = VIEW_OPS | {Op.RESHAPE}
# op -> the input it writes in place (and returns)
DESTRUCTIVE_PRIMS: dict[Op, int] = {Op.CACHE_WRITE: 0, Op.INDEX_COPY: 0}


def _name(op: Op) -> str:
    return op.name.lower()


def _arity(op: Op, inputs: tuple[Node, ...], n: int) -> None:
    if len(inputs) != n:
        raise ShapeError(f"{_name(op)}: takes {n} input(s), got {len(inputs)}")


def _unary(op: Op) -> Rule:
    def rule(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
        _arity(op, inputs, 1)
        x = inputs[0]
        if not x.dtype.is_float and op not in (Op.NEG, Op.ABS, Op.SQR, Op.SIGN, Op.RELU):
            raise DTypeError(f"{_name(op)}: needs a float input, got {x.dtype.value}")
        return x.shape, x.dtype
    return rule


def _same_shapes(op: Op, inputs: tuple[Node, ...]) -> None:
    a = inputs[0]
    for b in inputs[1:]:
        if b.shape != a.shape:
            raise ShapeError(f"{_name(op)}: operands must have one shape, got {list(a.shape)} and {list(b.shape)}")
        if b.dtype != a.dtype:
            raise DTypeError(f"{_name(op)}: operands must have one dtype, got {a.dtype.value} and {b.dtype.value}")


def _binary(op: Op) -> Rule:
    def rule(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
        _arity(op, inputs, 2)
        _same_shapes(op, inputs)
        if op in (Op.DIV, Op.POW) and not inputs[0].dtype.is_float:
            raise DTypeError(f"{_name(op)}: needs float operands, got {inputs[0].dtype.value}")
        return inputs[0].shape, (DType.U8 if op in COMPARE else inputs[0].dtype)
    return rule


def _where(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
    _arity(Op.WHERE, inputs, 3)
    cond, a, b = inputs
    if cond.dtype is not DType.U8:
        raise DTypeError(f"where: condition must be u8, got {cond.dtype.value}")
    if cond.shape != a.shape:
        raise ShapeError(f"where: condition {list(cond.shape)} and values {list(a.shape)} differ in shape")
    _same_shapes(Op.WHERE, (a, b))
    return a.shape, a.dtype


def _scalar(op: Op) -> Rule:
    def rule(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
        _arity(op, inputs, 1)
        if not isinstance(arg, (int, float)):
            raise ParamError(f"{_name(op)}: scalar must be a number, got {arg!r}")
        if op is Op.POWI and not isinstance(arg, int):
            raise ParamError(f"powi: exponent must be an int, got {arg!r}")
        if op is not Op.POWI and not inputs[0].dtype.is_float:
            raise DTypeError(f"{_name(op)}: needs a float input, got {inputs[0].dtype.value}")
        return inputs[0].shape, inputs[0].dtype
    return rule


def _cast(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
    _arity(Op.CAST, inputs, 1)
    if not isinstance(arg, DType):
        raise ParamError(f"cast: target must be a DType, got {arg!r}")
    return inputs[0].shape, arg


def _reduce_to(op: Op) -> Rule:
    def rule(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
        _arity(op, inputs, 1)
        reduce_to_axes(_name(op), inputs[0].shape, tuple(arg))
        if op is Op.REDUCE_MAX_TO and 0 in inputs[0].shape and math.prod(arg) > 0:
            raise ShapeError(f"reduce_max_to: cannot take the max over an empty axis of {list(inputs[0].shape)}")
        return tuple(arg), (inputs[0].dtype.sum_dtype if op is Op.REDUCE_SUM_TO else inputs[0].dtype)
    return rule


def _dim_reduce(op: Op) -> Rule:
    def rule(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
        _arity(op, inputs, 1)
        x = inputs[0]
        if not isinstance(arg, int) or not 0 <= arg < len(x.shape):
            raise ShapeError(f"{_name(op)}: axis {arg!r} is out of range for rank {len(x.shape)}")
        if op is Op.MAX_DIM and x.shape[arg] == 0:
            raise ShapeError(f"max_dim: axis {arg} of {list(x.shape)} is empty")
        dtype = x.dtype.sum_dtype if op is Op.SUM_DIM else x.dtype.mean_dtype if op is Op.MEAN_DIM else x.dtype
        return x.shape[:arg] + x.shape[arg + 1:], dtype
    return rule


def _broadcast_to(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
    _arity(Op.BROADCAST_TO, inputs, 1)
    x, target = inputs[0], check_dims("broadcast_to", tuple(arg))
    if broadcast_shapes("broadcast_to", x.shape, target) != target:
        raise ShapeError(f"broadcast_to: {list(x.shape)} does not broadcast to {list(target)}")
    return target, x.dtype


def _reshape(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
    _arity(Op.RESHAPE, inputs, 1)
    x, target = inputs[0], tuple(arg)
    if any(d < 0 for d in target) or math.prod(target) != math.prod(x.shape):
        raise ShapeError(f"reshape: cannot reshape {list(x.shape)} ({math.prod(x.shape)} elements) to {list(target)}")
    return target, x.dtype


def _permute(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
    _arity(Op.PERMUTE, inputs, 1)
    x, axes = inputs[0], tuple(arg)
    if sorted(axes) != list(range(len(x.shape))):
        raise ShapeError(f"permute: axes {list(axes)} are not a permutation of {len(x.shape)} axes")
    return tuple(x.shape[a] for a in axes), x.dtype


def _slice(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
    _arity(Op.SLICE, inputs, 1)
    x = inputs[0]
    if len(arg) != len(x.shape):
        raise ShapeError(f"slice: {len(arg)} ranges for rank {len(x.shape)}")
    out = []
    for (start, stop, step), size in zip(arg, x.shape, strict=True):
        if step < 1 or not 0 <= start <= size or not start <= stop <= size:
            raise ShapeError(f"slice: range {start}:{stop}:{step} is not inside an axis of {size}")
        out.append(len(range(start, stop, step)))
    return tuple(out), x.dtype


def _unsqueeze(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
    _arity(Op.UNSQUEEZE, inputs, 1)
    x = inputs[0]
    if not 0 <= arg <= len(x.shape):
        raise ShapeError(f"unsqueeze: position {arg} is out of range for rank {len(x.shape)}")
    return x.shape[:arg] + (1,) + x.shape[arg:], x.dtype


def _squeeze(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
    _arity(Op.SQUEEZE, inputs, 1)
    x = inputs[0]
    if not 0 <= arg < len(x.shape) or x.shape[arg] != 1:
        raise ShapeError(f"squeeze: axis {arg} of {list(x.shape)} is not of size 1")
    return x.shape[:arg] + x.shape[arg + 1:], x.dtype


def _concat(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
    if not inputs:
        raise ShapeError("concat: needs at least one input")
    a = inputs[0]
    if not 0 <= arg < len(a.shape):
        raise ShapeError(f"concat: axis {arg} is out of range for rank {len(a.shape)}")
    total = 0
    for b in inputs:
        if b.dtype != a.dtype:
            raise DTypeError(f"concat: inputs must share a dtype, got {a.dtype.value} and {b.dtype.value}")
        if len(b.shape) != len(a.shape) or any(
            i != arg and p != q for i, (p, q) in enumerate(zip(a.shape, b.shape, strict=True))
        ):
            raise ShapeError(f"concat: {list(b.shape)} does not fit {list(a.shape)} outside axis {arg}")
        total += b.shape[arg]
    return a.shape[:arg] + (total,) + a.shape[arg + 1:], a.dtype


def _pad(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
    _arity(Op.PAD, inputs, 1)
    x = inputs[0]
    widths, _value = arg
    if len(widths) != len(x.shape) or any(b < 0 or a < 0 for b, a in widths):
        raise ShapeError(f"pad: needs one non-negative (before, after) per axis of {list(x.shape)}, got {widths}")
    return tuple(s + b + a for s, (b, a) in zip(x.shape, widths, strict=True)), x.dtype


def _contiguize(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
    _arity(Op.CONTIGUIZE, inputs, 1)
    return inputs[0].shape, inputs[0].dtype


def _matmul(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
    _arity(Op.MATMUL, inputs, 2)
    a, b = inputs
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise ShapeError(f"matmul: operands need rank >= 2, got {list(a.shape)} and {list(b.shape)}")
    if a.shape[:-2] != b.shape[:-2]:
        raise ShapeError(f"matmul: batch dims differ: {list(a.shape[:-2])} vs {list(b.shape[:-2])}")
    if a.shape[-1] != b.shape[-2]:
        raise ShapeError(f"matmul: a has K={a.shape[-1]} but b has K={b.shape[-2]} "
                         f"({list(a.shape)} @ {list(b.shape)})")
    if a.dtype != b.dtype:
        raise DTypeError(f"matmul: operands must share a dtype, got {a.dtype.value} and {b.dtype.value}")
    return a.shape[:-1] + (b.shape[-1],), a.dtype


def _index_dtype(op: str, idx: Node) -> None:
    if idx.dtype not in (DType.U32, DType.I64):
        raise DTypeError(f"{op}: indices must be u32 or i64, got {idx.dtype.value}")


def _gather(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
    _arity(Op.GATHER, inputs, 2)
    x, idx = inputs
    _index_dtype("gather", idx)
    if len(idx.shape) != len(x.shape) or not 0 <= arg < len(x.shape):
        raise ShapeError(f"gather: indices {list(idx.shape)} need the rank of {list(x.shape)} and a valid axis")
    if any(i != arg and p != q for i, (p, q) in enumerate(zip(idx.shape, x.shape, strict=True))):
        raise ShapeError(f"gather: indices {list(idx.shape)} differ from {list(x.shape)} outside axis {arg}")
    return idx.shape, x.dtype


def _index_select(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
    _arity(Op.INDEX_SELECT, inputs, 2)
    x, idx = inputs
    _index_dtype("index_select", idx)
    if len(idx.shape) != 1 or not 0 <= arg < len(x.shape):
        raise ShapeError(f"index_select: needs 1-D indices and a valid axis, got {list(idx.shape)}, axis {arg}")
    return x.shape[:arg] + idx.shape + x.shape[arg + 1:], x.dtype


def _scatter_add(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
    _arity(Op.SCATTER_ADD, inputs, 3)
    base, idx, src = inputs
    _index_dtype("scatter_add", idx)
    if idx.shape != src.shape or len(src.shape) != len(base.shape):
        raise ShapeError(f"scatter_add: indices {list(idx.shape)} and source {list(src.shape)} must match "
                         f"and have the rank of {list(base.shape)}")
    return base.shape, base.dtype


def _index_add(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
    _arity(Op.INDEX_ADD, inputs, 3)
    base, idx, src = inputs
    _index_dtype("index_add", idx)
    want = base.shape[:arg] + idx.shape + base.shape[arg + 1:]
    if len(idx.shape) != 1 or src.shape != want:
        raise ShapeError(f"index_add: source must be {list(want)}, got {list(src.shape)}")
    return base.shape, base.dtype


@dataclass(frozen=True)
class CacheWriteArg:
    """Where CACHE_WRITE puts its rows: along `axis`, from position `offset` (an int or a DynScalar)."""

    axis: int
    offset: DynScalar | int


def _cache_write(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
    _arity(Op.CACHE_WRITE, inputs, 2)
    cache, rows = inputs
    ax = arg.axis
    if rows.dtype != cache.dtype:
        raise DTypeError(f"cache_write: rows are {rows.dtype.value}, the cache is {cache.dtype.value}")
    if len(rows.shape) != len(cache.shape) or any(
            i != ax and r != c for i, (r, c) in enumerate(zip(rows.shape, cache.shape, strict=True))):
        raise ShapeError(f"cache_write: rows {list(rows.shape)} must match the cache {list(cache.shape)} "
                         f"outside axis {ax}")
    cap, n = cache.shape[ax], rows.shape[ax]
    if n > cap:
        raise ShapeError(f"cache_write: {n} rows do not fit the cache's {cap} positions on axis {ax}")
    off = arg.offset
    if not isinstance(off, DynScalar) and not 0 <= off <= cap - n:
        raise ParamError(f"cache_write: offset {off} with {n} rows is outside the cache's {cap} positions "
                         f"on axis {ax}")
    return cache.shape, cache.dtype


def _index_copy(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
    _arity(Op.INDEX_COPY, inputs, 3)
    target, idx, rows = inputs
    _index_dtype("index_copy", idx)
    if len(idx.shape) != 1 or not target.shape:
        raise ShapeError(f"index_copy: needs 1-D indices into a target of rank >= 1, got indices "
                         f"{list(idx.shape)} and a target {list(target.shape)}")
    if rows.shape != idx.shape + target.shape[1:]:
        raise ShapeError(f"index_copy: rows are {list(rows.shape)}, target rows are {list(target.shape[1:])} "
                         f"({idx.shape[0]} indices)")
    if rows.dtype != target.dtype:
        raise DTypeError(f"index_copy: rows are {rows.dtype.value}, the target is {target.dtype.value}")
    return target.shape, target.dtype


def _view(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
    _arity(Op.VIEW, inputs, 1)
    slot, shape, dtype = arg
    slots = slots_of(inputs[0])
    if slots is None:
        raise ShapeError(f"view: {inputs[0]!r} has a single output; only multi-output nodes are projected")
    if not 0 <= slot < len(slots) or slots[slot] != (tuple(shape), dtype):
        raise ShapeError(f"view: slot {slot} {list(shape)} {dtype.value} is not one of the node's "
                         f"{[(list(s), d.value) for s, d in slots]}")
    return tuple(shape), dtype


def _multi(op: Op) -> Rule:
    def rule(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
        return PRIM_SLOTS[op](inputs, arg)[0]
    return rule


def _cross_entropy_grad(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
    _arity(Op.CROSS_ENTROPY_GRAD, inputs, 3)  # logits, targets, the loss's cotangent
    return inputs[0].shape, inputs[0].dtype


def _no_rule(op: Op) -> Rule:
    def rule(inputs: tuple[Node, ...], arg: Any) -> tuple[Shape, DType]:
        raise ShapeError(f"{_name(op)}: is not built through the primitive table")
    return rule


RULES: dict[Op, Rule] = {
    **{op: _unary(op) for op in UNARY},
    **{op: _binary(op) for op in BINARY | COMPARE},
    Op.WHERE: _where,
    Op.ADD_SCALAR: _scalar(Op.ADD_SCALAR),
    Op.MUL_SCALAR: _scalar(Op.MUL_SCALAR),
    Op.POWI: _scalar(Op.POWI),
    Op.POW_SCALAR: _scalar(Op.POW_SCALAR),
    Op.CAST: _cast,
    **BIT_RULES,
    Op.REDUCE_SUM_TO: _reduce_to(Op.REDUCE_SUM_TO),
    Op.REDUCE_MAX_TO: _reduce_to(Op.REDUCE_MAX_TO),
    Op.SUM_DIM: _dim_reduce(Op.SUM_DIM),
    Op.MAX_DIM: _dim_reduce(Op.MAX_DIM),
    Op.MEAN_DIM: _dim_reduce(Op.MEAN_DIM),
    Op.BROADCAST_TO: _broadcast_to,
    Op.RESHAPE: _reshape,
    Op.PERMUTE: _permute,
    Op.SLICE: _slice,
    Op.UNSQUEEZE: _unsqueeze,
    Op.SQUEEZE: _squeeze,
    Op.CONCAT: _concat,
    Op.PAD: _pad,
    Op.CONTIGUIZE: _contiguize,
    Op.MATMUL: _matmul,
    Op.GATHER: _gather,
    Op.INDEX_SELECT: _index_select,
    Op.SCATTER_ADD: _scatter_add,
    Op.INDEX_ADD: _index_add,
    Op.CACHE_WRITE: _cache_write,
    Op.INDEX_COPY: _index_copy,
    Op.VIEW: _view,
    Op.CROSS_ENTROPY_GRAD: _cross_entropy_grad,
    Op.SELECTIVE_SCAN_GRAD: _multi(Op.SELECTIVE_SCAN_GRAD),
    Op.SSD_CHUNK_SCAN_GRAD: _multi(Op.SSD_CHUNK_SCAN_GRAD),
    Op.CONST: _no_rule(Op.CONST),
    Op.FUSED: _no_rule(Op.FUSED),
}
assert set(RULES) == set(Op), "every primitive needs a shape/dtype rule"


def make(op: Op, inputs: tuple[Node, ...], arg: Any = None) -> Node:
    """Build a primitive node, checking its shape and dtype rule first."""
    shape, dtype = RULES[op](inputs, arg)
    return Node(op, inputs, check_dims(_name(op), tuple(int(d) for d in shape)), dtype, arg)


def views(node: Node) -> tuple[Node, ...]:
    """One VIEW node per output slot of a multi-output node."""
    slots = slots_of(node)
    if slots is None:
        raise ShapeError(f"view: {node!r} has a single output")
    return tuple(make(Op.VIEW, (node,), (k, shape, dtype)) for k, (shape, dtype) in enumerate(slots))
