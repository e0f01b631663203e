"""Shared geometry of the convolution entries (Conv2D 6, ConvTranspose2D 11): parameter forms and sizes.

Not an entry module (it defines no ENTRY). The builders accept
- stride and dilation: an int or a pair `(h, w)`, each at least 1;
- padding: an int (all four sides), a pair `(ph, pw)` (symmetric per axis) or a pair of pairs
  `((top, bottom), (left, right))` (asymmetric), each at least 0. A flat 4-tuple is refused: torch's
  `F.pad` order (left, right, top, bottom) and the natural (top, bottom, left, right) disagree;
- output_padding (ConvTranspose2D): an int or a pair.
Params always hold the canonical forms: pairs, and padding as a pair of pairs.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from fuel.errors import ParamError, ShapeError
from fuel.graph.node import DynScalar, Shape

Pair = tuple[int, int]
Padding = tuple[Pair, Pair]


def _int(op: str, what: str, v: Any) -> int:
    if isinstance(v, (bool, DynScalar)):
        raise ParamError(f"{op}: {what} must be an integer fixed when the graph is built, got {v!r}")
    try:
        return operator.index(v)
    except TypeError:
        raise ParamError(f"{op}: {what} must be an integer, got {v!r}") from None


def as_pair(op: str, what: str, v: Any, low: int) -> Pair:
    """An int or a pair as `(h, w)`, each at least `low`."""
    if isinstance(v, (tuple, list)):
        if len(v) != 2:
            raise ParamError(f"{op}: {what} must be an int or a pair (h, w), got {v!r}")
        out = (_int(op, what, v[0]), _int(op, what, v[1]))
    else:
        k = _int(op, what, v)
        out = (k, k)
    if min(out) < low:
        raise ParamError(f"{op}: {what} must be at least {low}, got {v!r}")
    return out


def as_padding(op: str, v: Any) -> Padding:
    """An int, a pair `(ph, pw)` or `((top, bottom), (left, right))` as the canonical pair of pairs."""
    form = "an int, a pair (ph, pw) or ((top, bottom), (left, right))"
    if isinstance(v, (tuple, list)):
        if len(v) != 2:
            raise ParamError(f"{op}: padding must be {form}, got {v!r}")
        sides = []
        for axis in v:
            if isinstance(axis, (tuple, list)):
                if len(axis) != 2:
                    raise ParamError(f"{op}: padding must be {form}, got {v!r}")
                sides.append((_int(op, "padding", axis[0]), _int(op, "padding", axis[1])))
            else:
                k = _int(op, "padding", axis)
                sides.append((k, k))
        out = (sides[0], sides[1])
    else:
        k = _int(op, "padding", v)
        out = ((k, k), (k, k))
    if min(out[0] + out[1]) < 0:
        raise ParamError(f"{op}: padding must be non-negative, got {v!r}")
    return out


def as_groups(op: str, v: Any) -> int:
    g = _int(op, "groups", v)
    if g < 1:
        raise ParamError(f"{op}: groups must be at least 1, got {v!r}")
    return g


def canonicalise(params: Any, op: str) -> None:
    """A convolution params' __post_init__ (a frozen dataclass): stride, padding, output_padding (where
    the op has one), dilation and groups replaced by their canonical forms, each checked in that order."""
    settle = object.__setattr__
    settle(params, "stride", as_pair(op, "stride", params.stride, 1))
    settle(params, "padding", as_padding(op, params.padding))
    if hasattr(params, "output_padding"):
        settle(params, "output_padding", as_pair(op, "output_padding", params.output_padding, 0))
    settle(params, "dilation", as_pair(op, "dilation", params.dilation, 1))
    settle(params, "groups", as_groups(op, params.groups))


def check_ranks(op: str, x: Shape, w: Shape, w_layout: str) -> None:
    """x `[N, Cin, H, W]` and a rank-4 w (`w_layout` names its axes in the message)."""
    if len(x) != 4:
        raise ShapeError(f"{op}: x must be [N, Cin, H, W], got {list(x)}")
    if len(w) != 4:
        raise ShapeError(f"{op}: w must be {w_layout}, got {list(w)}")


def check_extents(op: str, x: Shape, w: Shape) -> None:
    """A kernel of at least 1x1 taps and an x of at least 1x1 positions (rank-4 shapes)."""
    if w[2] < 1 or w[3] < 1:
        raise ShapeError(f"{op}: the kernel must be at least 1x1, w is {list(w)}")
    if x[2] < 1 or x[3] < 1:
        raise ShapeError(f"{op}: x's spatial size must be at least 1x1, x is {list(x)}")


def conv_out(size: int, lo: int, hi: int, k: int, s: int, d: int) -> int:
    """Output length of a cross-correlation along one axis (the padded input holds the dilated kernel)."""
    return (size + lo + hi - d * (k - 1) - 1) // s + 1


def conv_rest(size: int, lo: int, hi: int, k: int, s: int, d: int) -> int:
    """Padded positions past the last window along one axis (0 <= rest < s): the output padding that
    makes the transposed convolution give back `size`."""
    return (size + lo + hi - d * (k - 1) - 1) % s


def tap_positions(kernel: Pair, grid: Pair, width: int, stride: Pair, dilation: Pair) -> np.ndarray:
    """Flat int64 positions in a plane `width` wide of every (kh, kw, i, j) tap, in that order: row
    kh·dh + i·sh, column kw·dw + j·sw, for each kernel tap and each (i, j) of `grid`. Conv2D gathers its
    windows there (grid: the output), ConvTranspose2D scatters its input's products there (grid: x)."""
    (kh, kw), (gh, gw), (sh, sw), (dh, dw) = kernel, grid, stride, dilation
    rows = (np.arange(kh)[:, None, None, None] * dh + np.arange(gh)[None, None, :, None] * sh) * width
    cols = np.arange(kw)[None, :, None, None] * dw + np.arange(gw)[None, None, None, :] * sw
    return (rows + cols).reshape(-1).astype(np.int64)


def transpose_out(size: int, lo: int, hi: int, k: int, s: int, d: int, extra: int) -> int:
    """Output length of a transposed convolution: (size − 1)·s − lo − hi + d·(k − 1) + extra + 1."""
    return (size - 1) * s - lo - hi + d * (k - 1) + extra + 1
