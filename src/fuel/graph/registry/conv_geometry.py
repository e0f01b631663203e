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

from fuel.errors import ParamError
from fuel.graph.node import DynScalar

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


def conv_out(size: int, lo: int, hi: int, k: int, s: int, d: int) -> int:
    """Output length of a cross-correlation along one axis (the padded input holds the dilated kernel)."""
    return (size + lo + hi - d * (k - 1) - 1) // s + 1


def conv_rest(size: int, lo: int, hi: int, k: int, s: int, d: int) -> int:
    """Padded positions past the last window along one axis (0 <= rest < s): the output padding that
    makes the transposed convolution give back `size`."""
    return (size + lo + hi - d * (k - 1) - 1) % s


def transpose_out(size: int, lo: int, hi: int, k: int, s: int, d: int, extra: int) -> int:
    """Output length of a transposed convolution: (size − 1)·s − lo − hi + d·(k − 1) + extra + 1."""
    return (size - 1) * s - lo - hi + d * (k - 1) + extra + 1
