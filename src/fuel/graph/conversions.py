"""A Tensor's realisation and its conversions to NumPy and Python values (the `Tensor` class's base)."""

from __future__ import annotations

import math
from typing import Any, Self

import numpy as np

from fuel.errors import DTypeError, ParamError, ShapeError
from fuel.graph.node import Node


class Conversions:
    """Realisation and conversions, over the `node` a Tensor holds."""

    __slots__ = ()
    node: Node

    def realize(self, env: dict[str, int] | None = None) -> Self:
        from fuel.dispatch.executor import realize

        realize(self, env=env)  # type: ignore[arg-type]
        return self

    def numpy(self, env: dict[str, int] | None = None) -> np.ndarray:
        """The realised value (read-only; copy it to write)."""
        self.realize(env)
        value = self.node.value
        assert value is not None
        out = value.view()
        out.flags.writeable = False
        return out

    def item(self, env: dict[str, int] | None = None, op: str = "item") -> float | int:
        if math.prod(self.node.shape) != 1:
            raise ShapeError(f"{op}: needs exactly one element, tensor has shape {list(self.node.shape)}")
        value: float | int = self.numpy(env).reshape(()).item()
        return value

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """NumPy 2's protocol. copy=True gives a fresh writable array; copy=None may give the read-only
        realised array, which can share memory with a leaf's own array; copy=False refuses to copy."""
        arr = self.numpy()
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            if copy is False:
                raise ParamError(f"__array__: {self.node.dtype.value} to {np.dtype(dtype)} needs a copy, "
                                 f"and copy=False forbids one")
            return arr.astype(dtype)
        return arr.copy() if copy else arr

    # Python conversions realise a one-element tensor.
    def __float__(self) -> float: return float(self.item(op="float"))
    def __int__(self) -> int: return int(self.item(op="int"))

    def __index__(self) -> int:
        if self.node.dtype.is_float:
            raise DTypeError(f"index: needs an integer tensor, got {self.node.dtype.value}")
        return int(self.item(op="index"))

    def __bool__(self) -> bool:
        if math.prod(self.node.shape) != 1:
            raise ShapeError(f"bool: the truth value of a tensor of shape {list(self.node.shape)} is ambiguous; "
                             f"reduce it first, e.g. (t != 0).sum() > 0")
        return bool(self.item(op="bool"))
