"""Shape arithmetic shared by the primitive rules, the Tensor builders and the kernels: user-given sizes and
axes as ints, broadcasting, and the axes a reduction to a target shape sums over."""

from __future__ import annotations

import operator
from typing import Any

from fuel.errors import ParamError, ShapeError
from fuel.graph.node import DynScalar, Shape


def as_int(op: str, value: Any, what: str) -> int:
    """A size, axis or width the user gave, as an int. These fix shapes when the graph is built, so a
    DynScalar (bound only at realize) cannot stand for one."""
    if isinstance(value, DynScalar):
        raise ParamError(f"{op}: a DynScalar ({value.name!r}) is not supported as {what}; {what} is fixed "
                         f"when the graph is built")
    try:
        return operator.index(value)
    except TypeError:
        raise ShapeError(f"{op}: {what} must be an integer, got {value!r}") from None


def check_dims(op: str, dims: Shape) -> Shape:
    """`dims` if no dimension is negative, else a ShapeError."""
    for d in dims:
        if d < 0:
            raise ShapeError(f"{op}: dimension {d} of {list(dims)} is negative")
    return dims


def norm_axis(op: str, axis: int, rank: int, extra: int = 0) -> int:
    """Resolve a possibly negative axis against `rank` (+`extra` for insert positions)."""
    axis = as_int(op, axis, "an axis")
    n = rank + extra
    if not -n <= axis < n:
        raise ShapeError(f"{op}: axis {axis} is out of range for rank {rank}")
    return axis % n if n else 0


def broadcast_shapes(op: str, a: Shape, b: Shape) -> Shape:
    out: list[int] = []
    for i in range(1, max(len(a), len(b)) + 1):
        da = a[-i] if i <= len(a) else 1
        db = b[-i] if i <= len(b) else 1
        if da != db and da != 1 and db != 1:
            raise ShapeError(f"{op}: shapes {list(a)} and {list(b)} do not broadcast (axis -{i}: {da} vs {db})")
        out.append(db if da == 1 else da)
    return tuple(reversed(out))


def reduce_to_axes(op: str, src: Shape, target: Shape) -> tuple[int, ...]:
    """Axes of `src` reduced to reach `target` (right-aligned, target dims equal or 1)."""
    if len(target) > len(src):
        raise ShapeError(f"{op}: target {list(target)} has more axes than input {list(src)}")
    lead = len(src) - len(target)
    axes = list(range(lead))
    for i, t in enumerate(target):
        s = src[lead + i]
        if t == s:
            continue
        if t != 1:
            raise ShapeError(f"{op}: target {list(target)} does not fit input {list(src)} at axis {lead + i}")
        axes.append(lead + i)
    return tuple(axes)
