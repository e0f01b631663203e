"""Errors raised by Fuel. Every message names the op, what it expected and what it received."""

from __future__ import annotations


class FuelError(Exception):
    """Base class of every error Fuel raises on purpose."""


class ShapeError(FuelError, ValueError):
    """An input's shape does not fit the op (raised when the graph is built)."""


class DTypeError(FuelError, TypeError):
    """An input's dtype does not fit the op (raised when the graph is built)."""


class ParamError(FuelError, ValueError):
    """A parameter is out of its domain, or a dynamic scalar is unbound."""


class IndexOutOfRange(FuelError, IndexError):
    """An index tensor points outside the tensor it indexes, or, for index_copy, at one row twice (checked
    before reading or writing)."""


class AxisIndexError(ShapeError, IndexError):
    """An integer index is outside its axis (raised when the graph is built). It is an IndexError too, so
    Python's iteration protocol stops at the end of the first axis."""


class RankZeroError(ShapeError, TypeError):
    """A rank-0 tensor was iterated. It is a TypeError too, as NumPy raises for a 0-d array, so code that
    tells iterables apart by catching TypeError treats a rank-0 tensor like a 0-d array."""


class KernelError(FuelError, RuntimeError):
    """No kernel can run a node, or a kernel broke its contract."""


class StaleInput(FuelError, RuntimeError):
    """A graph would read a buffer that a destructive op (inplace_affine, cache_write, index_copy) overwrote
    after the graph was built, or would need a value after the op in the same graph destroys it."""


class NoDecomposition(FuelError):
    """A fused op has no lowering to primitives."""


class NotDifferentiable(FuelError):
    """A gradient was asked through an op that has none."""


class RealizeInTrace(FuelError, RuntimeError):
    """A function traced by `fl.jit` realised a value that can change between calls (one depending on an
    argument, or on a writable captured array): it would have been baked into the capture."""
