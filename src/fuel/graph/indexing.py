"""Basic indexing (integers, slices, None, Ellipsis and 0-d bools) of a Tensor, with NumPy's semantics."""

from __future__ import annotations

from typing import Any

import numpy as np

from fuel.errors import AxisIndexError, ShapeError
from fuel.graph.node import Op
from fuel.graph.prims import make
from fuel.graph.tensor import Tensor


def getitem(t: Tensor, key: Any) -> Tensor:
    keys = tuple(_basic(k) for k in (key if isinstance(key, tuple) else (key,)))
    ellipses = [i for i, k in enumerate(keys) if k is Ellipsis]
    if len(ellipses) > 1:
        raise ShapeError("getitem: at most one ... in an index")
    # A bool is a 0-d mask in NumPy: a new axis of size 1 (True) or 0 (False), never the index 1 or 0.
    n_axes = sum(1 for k in keys if k is not None and k is not Ellipsis and not _is_bool(k))
    if n_axes > t.ndim:
        raise AxisIndexError(f"getitem: {n_axes} indices for a tensor of rank {t.ndim}")
    if ellipses:
        i = ellipses[0]
        keys = keys[:i] + (slice(None),) * (t.ndim - n_axes) + keys[i + 1:]
    else:
        keys = keys + (slice(None),) * (t.ndim - n_axes)
    if any(_is_bool(k) for k in keys):
        return _bool_getitem(t, keys)
    ranges: list[tuple[int, int, int]] = []
    squeeze: list[int] = []
    insert: list[int] = []
    axis = 0
    out_axis = 0
    for k in keys:
        if k is None:
            insert.append(out_axis)
            out_axis += 1
            continue
        size = t.shape[axis]
        if isinstance(k, (int, np.integer)):
            i = int(k)
            if not -size <= i < size:
                raise AxisIndexError(f"getitem: index {i} is out of range for axis {axis} of size {size}")
            ranges.append((i % size, i % size + 1, 1))
            squeeze.append(axis)
        else:
            start, stop, step = k.indices(size)
            if step < 1:
                raise ShapeError(f"getitem: step {k.step} is not supported (positive steps only)")
            stop = max(stop, start)
            ranges.append((start, stop, step))
            out_axis += 1
        axis += 1
    out = t
    if any(r != (0, d, 1) for r, d in zip(ranges, t.shape, strict=True)):
        out = Tensor(make(Op.SLICE, (t.node,), tuple(ranges)))
    for a in reversed(squeeze):
        out = Tensor(make(Op.SQUEEZE, (out.node,), a))
    for a in insert:
        out = Tensor(make(Op.UNSQUEEZE, (out.node,), a))
    return out


def _bool_getitem(t: Tensor, keys: tuple[Any, ...]) -> Tensor:
    """NumPy's rule for 0-d bool masks: they and the integers beside them are advanced indices, whose one
    result axis (size 1 if every bool is True, else 0) stands where they are when adjacent, else first."""
    advanced = [i for i, k in enumerate(keys) if _is_bool(k) or isinstance(k, (int, np.integer))]
    adjacent = advanced == list(range(advanced[0], advanced[-1] + 1))
    at = sum(1 for k in keys[:advanced[0]] if not isinstance(k, (int, np.integer))) if adjacent else 0
    out = getitem(t, tuple(k for k in keys if not _is_bool(k)))
    out = out.unsqueeze(at)
    if not all(k for k in keys if _is_bool(k)):
        out = Tensor(make(Op.SLICE, (out.node,), tuple((0, 0 if i == at else d, 1) for i, d in enumerate(out.shape))))
    return out


def _is_bool(k: object) -> bool:
    return isinstance(k, (bool, np.bool_))


_ADVICE = ("advanced indexing, which Tensors do not do: use t.index_select(axis, idx) to take whole slices "
           "along one axis, or t.gather(axis, idx) to take one element per index")


def _basic(k: Any) -> Any:
    """One index of a key, checked to be basic: an integer, a slice, None, ..., or a bool (0-d arrays of
    integers and bools count as those, as in NumPy). An array, a list or a Tensor is an error naming
    index_select and gather, which take them."""
    if k is None or k is Ellipsis or isinstance(k, (slice, bool, int, np.bool_, np.integer)):
        return k
    if isinstance(k, np.ndarray) and k.ndim == 0 and k.dtype.kind in "biu":
        return k.item()
    if isinstance(k, Tensor):
        raise ShapeError(f"getitem: a Tensor index ({list(k.shape)} {k.dtype.value}) is {_ADVICE}")
    if isinstance(k, (list, tuple)) or (isinstance(k, np.ndarray) and k.ndim):
        arr = np.asarray(k, dtype=object) if not isinstance(k, np.ndarray) else k
        mask = arr.dtype.kind == "b" or bool(arr.size and all(_is_bool(v) for v in arr.flat))
        what = "a bool mask" if mask else "an index array"
        hint = "; a mask's indices are np.flatnonzero(mask)" if mask else ""
        raise ShapeError(f"getitem: {what} ({type(k).__name__} of shape {list(arr.shape)}) is {_ADVICE}{hint}")
    raise ShapeError(f"getitem: unsupported index {k!r} ({type(k).__name__}); an index is an integer, a slice "
                     f"with a positive step, None, ... or a bool")
