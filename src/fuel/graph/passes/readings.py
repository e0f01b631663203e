"""Canonical readings of graph nodes, shared by pattern templates and the graphs they match.

A node's readings are the spellings it stands for, keyed so that one key means one computation at any
shape: axes in negative form, slices as fractions of their axis, permutations by their trailing
non-identity part; `v * v`, `v.square()` and `v ** 2` all read as SQR; a keepdim reduction reads the same
whether spelled UNSQUEEZE(X_DIM), RESHAPE(X_DIM) or REDUCE_X_TO; a reduction of every axis reads alike at
every rank. A RESHAPE reads as its target shape; PAD as the axes it pads (widths are the caller's to check).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from fuel.graph.node import Node, Op

COMMUTATIVE = frozenset({Op.ADD, Op.MUL, Op.MAXIMUM, Op.MINIMUM, Op.EQ, Op.NE})
VIEWS = frozenset({Op.BROADCAST_TO, Op.RESHAPE, Op.PERMUTE, Op.SLICE, Op.UNSQUEEZE, Op.SQUEEZE})
SCALAR_ARG = frozenset({Op.ADD_SCALAR, Op.MUL_SCALAR, Op.POW_SCALAR})
_DIM_OPS = {Op.SUM_DIM: "sum", Op.MAX_DIM: "max", Op.MEAN_DIM: "mean"}
_TO_OPS = {Op.REDUCE_SUM_TO: "sum", Op.REDUCE_MAX_TO: "max"}


@dataclass(frozen=True)
class Reading:
    """One way to read a graph node: a canonical key, its operands, the extra nodes it absorbs."""

    key: Hashable
    inputs: tuple[Node, ...]
    covered: tuple[Node, ...] = ()
    arg: Any = None  # the scalar of a SCALAR_ARG op


def _neg_axis(axis: int, rank: int) -> int:
    return axis - rank


def _slice_key(n: Node) -> tuple[Any, ...]:
    x = n.inputs[0].shape
    parts = [None if r == (0, d, 1) else (Fraction(r[0], d or 1), Fraction(r[1], d or 1), r[2])
             for r, d in zip(n.arg, x, strict=True)]
    while parts and parts[0] is None:
        parts.pop(0)
    return (Op.SLICE, tuple(parts))


def _perm_key(n: Node) -> tuple[Any, ...]:
    perm, rank = tuple(n.arg), len(n.arg)
    i = 0
    while i < rank and perm[i] == i:
        i += 1
    return (Op.PERMUTE, tuple(p - rank for p in perm[i:]))


def _keepdim(red: Node, out: Node) -> Reading | None:
    """UNSQUEEZE/RESHAPE(X_DIM(a)(x)) back to x's rank with a 1 at a: a keepdim reduction."""
    x = red.inputs[0]
    a = red.arg
    if out.shape != x.shape[:a] + (1,) + x.shape[a + 1:]:
        return None
    return Reading(("keepdim", _DIM_OPS[red.op], _neg_axis(a, len(x.shape))), (x,), (red,))


def readings(n: Node) -> list[Reading]:
    """Every canonical reading of `n`, the most canonical first (the template uses that one)."""
    op, ins = n.op, n.inputs
    out: list[Reading] = []
    if op is Op.MUL and ins[0] is ins[1]:
        out.append(Reading((Op.SQR,), (ins[0],)))
    if op is Op.POWI and n.arg == 2:
        out.append(Reading((Op.SQR,), ins))
    if op in (Op.UNSQUEEZE, Op.RESHAPE) and ins[0].op in _DIM_OPS:
        kd = _keepdim(ins[0], n)
        if kd is not None:
            out.append(kd)
    if op in _TO_OPS:
        x = ins[0].shape
        if not n.shape:  # a reduction of every axis (`t.sum()`), at any rank, 0 included
            out.append(Reading((op, "all"), ins))
        if len(x) == len(n.shape):
            axes = tuple(_neg_axis(i, len(x)) for i, (a, b) in enumerate(zip(x, n.shape, strict=True))
                         if b == 1 and a != 1)
            if len(axes) == 1:
                out.append(Reading(("keepdim", _TO_OPS[op], axes[0]), ins))
            out.append(Reading((op, axes), ins))
        return out
    if op in SCALAR_ARG:
        out.append(Reading((op,), ins, arg=n.arg))
    elif op in _DIM_OPS or op in (Op.SQUEEZE, Op.GATHER, Op.INDEX_SELECT, Op.SCATTER_ADD, Op.INDEX_ADD):
        out.append(Reading((op, _neg_axis(n.arg, len(ins[0].shape))), ins))
    elif op in (Op.UNSQUEEZE, Op.CONCAT):
        out.append(Reading((op, _neg_axis(n.arg, len(n.shape))), ins))
    elif op is Op.SLICE:
        out.append(Reading(_slice_key(n), ins))
    elif op is Op.PERMUTE:
        out.append(Reading(_perm_key(n), ins))
    elif op is Op.PAD:
        widths, value = n.arg
        first = next((i for i, w in enumerate(widths) if w != (0, 0)), len(widths))
        sides = tuple((b > 0, a > 0) for b, a in widths[first:])
        out.append(Reading((op, first - len(widths), sides, value), ins))
    elif op is Op.FUSED:
        out.append(Reading((op, n.arg[0], n.arg[1]), ins))
    else:
        arg = n.arg
        key = (op,) if arg is None else (op, arg if isinstance(arg, Hashable) else repr(arg))
        out.append(Reading(key, ins))
    return out
