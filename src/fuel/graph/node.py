"""The IR: immutable nodes over a closed primitive op set plus FUSED."""

from __future__ import annotations

import enum
import itertools
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from fuel.dtype import DType
from fuel.errors import ParamError

Shape = tuple[int, ...]


class Op(enum.Enum):
    """Primitive ops (closed set) and FUSED, whose arg is `(FusedOpId, params)`."""

    CONST = enum.auto()
    # elementwise unary
    NEG = enum.auto()
    ABS = enum.auto()
    SQR = enum.auto()
    SQRT = enum.auto()
    RSQRT = enum.auto()
    RECIP = enum.auto()
    EXP = enum.auto()
    LOG = enum.auto()
    TANH = enum.auto()
    SIN = enum.auto()
    COS = enum.auto()
    SIGMOID = enum.auto()
    RELU = enum.auto()
    SILU = enum.auto()
    SIGN = enum.auto()
    STEP = enum.auto()
    FLOOR = enum.auto()
    ERF = enum.auto()
    # elementwise binary (same shape, same dtype)
    ADD = enum.auto()
    SUB = enum.auto()
    MUL = enum.auto()
    DIV = enum.auto()
    MAXIMUM = enum.auto()
    MINIMUM = enum.auto()
    POW = enum.auto()
    # comparisons -> U8
    EQ = enum.auto()
    NE = enum.auto()
    LT = enum.auto()
    LE = enum.auto()
    GT = enum.auto()
    GE = enum.auto()
    WHERE = enum.auto()
    # integer bit operations (same shape, same integer dtype; NumPy's >> and &)
    SHR = enum.auto()
    BITAND = enum.auto()
    # scalar-parameterised elementwise
    ADD_SCALAR = enum.auto()
    MUL_SCALAR = enum.auto()
    POWI = enum.auto()
    POW_SCALAR = enum.auto()
    CAST = enum.auto()
    # the bytes of the last axis read as another dtype (little-endian), arg the target DType
    BITCAST = enum.auto()
    # reductions
    REDUCE_SUM_TO = enum.auto()
    REDUCE_MAX_TO = enum.auto()
    SUM_DIM = enum.auto()
    MAX_DIM = enum.auto()
    MEAN_DIM = enum.auto()
    # movement
    BROADCAST_TO = enum.auto()
    RESHAPE = enum.auto()
    PERMUTE = enum.auto()
    SLICE = enum.auto()
    UNSQUEEZE = enum.auto()
    SQUEEZE = enum.auto()
    CONCAT = enum.auto()
    PAD = enum.auto()
    CONTIGUIZE = enum.auto()
    # contraction and indexing
    MATMUL = enum.auto()
    GATHER = enum.auto()
    INDEX_SELECT = enum.auto()
    SCATTER_ADD = enum.auto()
    INDEX_ADD = enum.auto()
    # destructive: write rows into input 0 in place and return it; CACHE_WRITE at a runtime offset (a
    # KV-cache append), INDEX_COPY each row at its own index (a paged KV cache's slots)
    CACHE_WRITE = enum.auto()
    INDEX_COPY = enum.auto()
    # Gradient kernels of fused ops whose backward has no inventory entry. Each reads the forward's
    # inputs and the output cotangent(s); the scan ones are multi-output (one slot per input gradient).
    CROSS_ENTROPY_GRAD = enum.auto()
    SELECTIVE_SCAN_GRAD = enum.auto()
    SSD_CHUNK_SCAN_GRAD = enum.auto()
    # multi-output projection (arg: slot, shape, dtype) and fused ops
    VIEW = enum.auto()
    FUSED = enum.auto()


@dataclass(frozen=True)
class DynScalar:
    """A runtime integer bound at `realize(..., env={name: value})`; part of no plan key."""

    name: str

    def resolve(self, env: dict[str, int] | None) -> int:
        if env is None or self.name not in env:
            raise ParamError(f"realize: dynamic scalar {self.name!r} is unbound; pass env={{{self.name!r}: …}}")
        v = env[self.name]
        return v if type(v) is int else dyn_value("realize", self.name, v)


def dyn_value(op: str, name: str, v: object) -> int:
    """The integer a DynScalar `name` is bound to: any integral number (Python's, NumPy's, a
    `numbers.Integral`) or a 0-d integer array. A bool, a float or anything else is a ParamError, never
    truncated."""
    if isinstance(v, np.ndarray) and v.ndim == 0 and v.dtype.kind in "iu":
        return int(v)
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        return int(v)
    raise ParamError(f"{op}: dynamic scalar {name!r} must be an integer (a Python or NumPy integer, or a 0-d "
                     f"integer array), got {v!r} ({type(v).__name__})")


def dyn(name: str) -> DynScalar:
    return DynScalar(name)


_serial = itertools.count()


@dataclass(frozen=True)
class OpSpec:
    """What a kernel needs of a node, without the graph: op, argument, shapes and dtypes.

    Plans hold these instead of Nodes, so a cached plan pins no graph and none of its arrays.
    """

    op: Op
    arg: Any
    shape: Shape
    dtype: DType
    in_shapes: tuple[Shape, ...]
    in_dtypes: tuple[DType, ...]
    label: str  # the node as a trace shows it


class Node:
    """One value in the graph. Structure is immutable; `value` caches a realised array."""

    __slots__ = ("__weakref__", "arg", "bound", "dtype", "inputs", "op", "serial", "shape", "value", "written")

    def __init__(
        self,
        op: Op,
        inputs: tuple[Node, ...],
        shape: Shape,
        dtype: DType,
        arg: Any = None,
        value: np.ndarray | None = None,
    ) -> None:
        self.op = op
        self.inputs = inputs
        self.shape = shape
        self.dtype = dtype
        self.arg = arg
        self.value = value
        # The DynScalar bindings a realised value was computed under ({name: value}), or None when it
        # depends on none: realising it again under other bindings recomputes it.
        self.bound: dict[str, int] | None = None
        self.serial = next(_serial)
        # For a realised value: the serial stamp of the last time a destructive op overwrote its buffer
        # (-1: never). A node built before that stamp would read the new contents, not what its builder
        # saw, so realising it is refused (see `overwritten`).
        self.written = -1

    def overwritten(self) -> None:
        """Record that a destructive op has just rewritten this node's buffer."""
        self.written = next(_serial)

    @property
    def is_leaf(self) -> bool:
        return self.value is not None

    def with_inputs(self, inputs: tuple[Node, ...]) -> Node:
        """The same op over other inputs (self when nothing changed)."""
        if all(a is b for a, b in zip(inputs, self.inputs, strict=True)):
            return self
        return Node(self.op, inputs, self.shape, self.dtype, self.arg)

    def spec(self) -> OpSpec:
        return OpSpec(self.op, self.arg, self.shape, self.dtype, tuple(i.shape for i in self.inputs),
                      tuple(i.dtype for i in self.inputs), repr(self))

    def __repr__(self) -> str:
        arg = "" if self.arg is None or self.op is Op.CONST else f" {self.arg!r}"
        return f"Node#{self.serial}({self.op.name}{arg} {list(self.shape)} {self.dtype.value})"


def frozen(arr: np.ndarray) -> bool:
    """Whether nothing can write `arr`'s contents through NumPy: it is read-only, and so is every array it
    views, down to a read-only buffer (bytes, a memory map opened read-only) or memory it owns. Clearing
    the flag is the owner's promise not to write it (NumPy lets the owner set it back)."""
    a: Any = arr
    while isinstance(a, np.ndarray):
        if a.flags.writeable:
            return False
        a = a.base
    if a is None:
        return True
    try:
        return memoryview(a).readonly
    except TypeError:  # no buffer to ask: it may be writable
        return False


def is_constant(node: Node) -> bool:
    """A leaf whose value cannot change between realisations (see `frozen`): what `fl.jit` may fold."""
    return node.value is not None and frozen(node.value)


def topo_order(roots: list[Node] | tuple[Node, ...], stop_at_leaves: bool = True) -> list[Node]:
    """Post-order DFS from the roots, inputs before users; leaves are not descended."""
    order: list[Node] = []
    seen: set[int] = set()
    for root in roots:
        if id(root) in seen:
            continue
        stack: list[tuple[Node, int]] = [(root, 0)]
        seen.add(id(root))
        while stack:
            node, i = stack.pop()
            if stop_at_leaves and node.value is not None:
                order.append(node)
                continue
            if i < len(node.inputs):
                stack.append((node, i + 1))
                child = node.inputs[i]
                if id(child) not in seen:
                    seen.add(id(child))
                    stack.append((child, 0))
            else:
                order.append(node)
    return order


def consumer_counts(order: list[Node], roots: list[Node] | tuple[Node, ...]) -> dict[int, int]:
    """Uses of each node (by id): one per input edge and one per root occurrence."""
    counts: dict[int, int] = {}
    for node in order:
        if node.value is not None:
            continue
        for inp in node.inputs:
            counts[id(inp)] = counts.get(id(inp), 0) + 1
    for r in roots:
        counts[id(r)] = counts.get(id(r), 0) + 1
    return counts
