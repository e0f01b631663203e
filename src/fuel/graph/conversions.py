"""A Tensor's realisation and its conversions to NumPy and Python values (the `Tensor` class's base).

Each of them computes the value; inside an `fl.jit` trace that is refused for a value that can change
between calls (`fuel.graph.traced`), naming the call that asked for it.
"""

from __future__ import annotations

import math
from typing import Any, Self

import numpy as np

from fuel.errors import DTypeError, ParamError, ShapeError
from fuel.graph.node import Node
from fuel.graph.traced import check_realize

# How each Python conversion realises, as a trace's error names it.
_HOW = {"item": ".item()", "float": "float()", "int": "int()", "bool": "bool()", "index": "operator.index()"}


class Conversions:
    """Realisation and conversions, over the `node` a Tensor holds."""

    __slots__ = ()
    node: Node

    def realize(self, env: dict[str, int] | None = None) -> Self:
        check_realize([self.node], ".realize()")
        from fuel.dispatch.executor import realize

        realize(self, env=env)  # type: ignore[arg-type]
        return self

    def numpy(self, env: dict[str, int] | None = None) -> np.ndarray:
        """The realised value (read-only; copy it to write)."""
        return self._value(env, ".numpy()")

    def _value(self, env: dict[str, int] | None, how: str) -> np.ndarray:
        check_realize([self.node], how)
        self.realize(env)
        value = self.node.value
        assert value is not None
        out = value.view()
        out.flags.writeable = False
        return out

    def item(self, env: dict[str, int] | None = None, op: str = "item") -> float | int:
        if math.prod(self.node.shape) != 1:
            raise ShapeError(f"{op}: needs exactly one element, tensor has shape {list(self.node.shape)}")
        value: float | int = self._value(env, _HOW.get(op, op)).reshape(()).item()
        return value

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """NumPy 2's protocol. copy=True gives a fresh writable array; copy=None may give the read-only
        realised array, which can share memory with a leaf's own array; copy=False refuses to copy."""
        arr = self._value(None, "np.asarray()")
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
