"""Tensor: the lazy builder users call. Every method builds nodes; nothing runs until realize."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, Union

import numpy as np

from fuel.dtype import DEFAULT_FLOAT, DType, as_dtype, from_numpy
from fuel.errors import DTypeError, ParamError, RankZeroError, ShapeError
from fuel.graph.conversions import Conversions
from fuel.graph.node import DynScalar, Node, Op, Shape, frozen
from fuel.graph.prims import make
from fuel.graph.promote import Operand, broadcast, const, elementwise, is_number, promote_pair, result_dtype
from fuel.graph.shapes import as_int, broadcast_shapes, check_dims, norm_axis

Scalar = int | float
TensorLike = Union["Tensor", np.ndarray, Scalar]


class Tensor(Conversions):
    """A lazy value: a handle on a graph node (realisation and conversions: `fuel.graph.conversions`)."""

    __slots__ = ("node",)
    __array_priority__ = 1000

    def __init__(self, node: Node) -> None:
        self.node = node

    # ---- introspection -------------------------------------------------------------------
    @property
    def shape(self) -> Shape:
        return self.node.shape

    @property
    def dtype(self) -> DType:
        return self.node.dtype

    @property
    def ndim(self) -> int:
        return len(self.node.shape)

    @property
    def size(self) -> int:
        return math.prod(self.node.shape)

    def __len__(self) -> int:
        if not self.shape:
            raise RankZeroError("len: a rank-0 tensor has no length")
        return self.shape[0]

    def __iter__(self) -> Iterator[Tensor]:
        """The sub-tensors along the first axis, as NumPy iterates an array."""
        if not self.shape:
            raise RankZeroError("iter: a rank-0 tensor cannot be iterated (it has no first axis); use .item()")
        return (self[i] for i in range(self.shape[0]))

    def __repr__(self) -> str:
        state = "realised" if self.node.value is not None else "lazy"
        return f"Tensor({list(self.shape)}, {self.dtype.value}, {state}, op={self.node.op.name})"

    # ---- elementwise ---------------------------------------------------------------------
    def _unary(self, op: Op) -> Tensor:
        return Tensor(make(op, (self.node,)))

    def neg(self) -> Tensor: return self._unary(Op.NEG)
    def abs(self) -> Tensor: return self._unary(Op.ABS)
    def square(self) -> Tensor: return self._unary(Op.SQR)
    def sqrt(self) -> Tensor: return self._unary(Op.SQRT)
    def rsqrt(self) -> Tensor: return self._unary(Op.RSQRT)
    def recip(self) -> Tensor: return self._unary(Op.RECIP)
    def exp(self) -> Tensor: return self._unary(Op.EXP)
    def log(self) -> Tensor: return self._unary(Op.LOG)
    def tanh(self) -> Tensor: return self._unary(Op.TANH)
    def sin(self) -> Tensor: return self._unary(Op.SIN)
    def cos(self) -> Tensor: return self._unary(Op.COS)
    def sigmoid(self) -> Tensor: return self._unary(Op.SIGMOID)
    def relu(self) -> Tensor: return self._unary(Op.RELU)
    def silu(self) -> Tensor: return self._unary(Op.SILU)
    def sign(self) -> Tensor: return self._unary(Op.SIGN)
    def floor(self) -> Tensor: return self._unary(Op.FLOOR)
    def erf(self) -> Tensor: return self._unary(Op.ERF)

    def add(self, other: TensorLike) -> Tensor: return self + other
    def sub(self, other: TensorLike) -> Tensor: return self - other
    def mul(self, other: TensorLike) -> Tensor: return self * other
    def div(self, other: TensorLike) -> Tensor: return self / other

    def maximum(self, other: TensorLike) -> Tensor: return binary(Op.MAXIMUM, self, other)
    def minimum(self, other: TensorLike) -> Tensor: return binary(Op.MINIMUM, self, other)

    def __neg__(self) -> Tensor: return self.neg()
    def __abs__(self) -> Tensor: return self.abs()

    def __add__(self, other: TensorLike) -> Tensor: return binary(Op.ADD, self, other)
    def __radd__(self, other: TensorLike) -> Tensor: return binary(Op.ADD, other, self)
    def __sub__(self, other: TensorLike) -> Tensor: return binary(Op.SUB, self, other)
    def __rsub__(self, other: TensorLike) -> Tensor: return binary(Op.SUB, other, self)
    def __mul__(self, other: TensorLike) -> Tensor: return binary(Op.MUL, self, other)
    def __rmul__(self, other: TensorLike) -> Tensor: return binary(Op.MUL, other, self)

    def __truediv__(self, other: TensorLike) -> Tensor: return binary(Op.DIV, self, other)
    def __rtruediv__(self, other: TensorLike) -> Tensor: return binary(Op.DIV, other, self)

    def __pow__(self, exponent: TensorLike) -> Tensor:
        """`x ** p`: an integral number is POWI (repeated squaring), ±0.5 is sqrt/rsqrt (what the fusion
        patterns match), another number is POW_SCALAR, and a tensor or array is the elementwise POW.
        NumPy scalars promote like NumPy 2 (`f16 ** np.float32(2.5)` is f32); an integer tensor with a
        fractional exponent gives the default float."""
        if not is_number(exponent):
            if not isinstance(exponent, (Tensor, np.ndarray, list, tuple)):
                raise DTypeError(f"pow: exponent must be a number or a tensor, got {type(exponent).__name__}")
            return binary(Op.POW, self, exponent)
        base = self
        if isinstance(exponent, np.generic):
            base = self.cast(result_dtype("pow", self.dtype, exponent.dtype))
        p = float(exponent)
        if math.isfinite(p) and p.is_integer():
            if p < 0 and not base.dtype.is_float:
                raise DTypeError(f"pow: an integer tensor ({base.dtype.value}) to a negative power {exponent!r} "
                                 f"is not an integer; cast it to a float first")
            return Tensor(make(Op.POWI, (base.node,), int(p)))
        if not base.dtype.is_float:
            base = base.cast(DEFAULT_FLOAT)
        if p == 0.5:
            return base.sqrt()
        if p == -0.5:
            return base.rsqrt()
        return Tensor(make(Op.POW_SCALAR, (base.node,), p))

    def __rpow__(self, base: TensorLike) -> Tensor:
        """`base ** x`, elementwise POW with `base` promoted like any operand (a Python number is weak)."""
        return binary(Op.POW, base, self)

    def __lt__(self, other: TensorLike) -> Tensor: return binary(Op.LT, self, other)  # type: ignore[misc]
    def __le__(self, other: TensorLike) -> Tensor: return binary(Op.LE, self, other)  # type: ignore[misc]
    def __gt__(self, other: TensorLike) -> Tensor: return binary(Op.GT, self, other)  # type: ignore[misc]
    def __ge__(self, other: TensorLike) -> Tensor: return binary(Op.GE, self, other)  # type: ignore[misc]
    def __eq__(self, other: object) -> Tensor: return binary(Op.EQ, self, other)  # type: ignore[override,arg-type]
    def __ne__(self, other: object) -> Tensor: return binary(Op.NE, self, other)  # type: ignore[override,arg-type]
    __hash__ = object.__hash__

    # integer bit operations (fuel.graph.bits): broadcast and promoted like the arithmetic operators
    def __rshift__(self, other: TensorLike) -> Tensor: return binary(Op.SHR, self, other)
    def __rrshift__(self, other: TensorLike) -> Tensor: return binary(Op.SHR, other, self)
    def __and__(self, other: TensorLike) -> Tensor: return binary(Op.BITAND, self, other)
    def __rand__(self, other: TensorLike) -> Tensor: return binary(Op.BITAND, other, self)

    def bitcast(self, dtype: DType | str) -> Tensor:
        """The bytes of the last axis read as `dtype` (little-endian): u32 `[..., n]` -> u8 `[..., 4n]`."""
        return Tensor(make(Op.BITCAST, (self.node,), as_dtype(dtype, "bitcast")))

    def __matmul__(self, other: TensorLike) -> Tensor: return matmul(self, other)
    def __rmatmul__(self, other: TensorLike) -> Tensor: return matmul(other, self)

    def cast(self, dtype: DType | str) -> Tensor:
        """This tensor as `dtype`. Float to integer saturates: values above the integer range give its
        max, values below give its min, NaN gives 0, the rest truncate toward zero. Integer to integer
        wraps, as NumPy's astype does; anything to a float rounds to nearest."""
        target = as_dtype(dtype, "cast")
        return self if target is self.dtype else Tensor(make(Op.CAST, (self.node,), target))

    astype = cast

    # ---- reductions ----------------------------------------------------------------------
    def _axes(self, op: str, axis: int | Sequence[int] | None) -> tuple[int, ...]:
        if axis is None:
            return tuple(range(self.ndim))
        axes = tuple(axis) if isinstance(axis, (Sequence, np.ndarray)) else (axis,)
        out = tuple(sorted({norm_axis(op, a, self.ndim) for a in axes}))
        if len(out) != len(axes):
            raise ShapeError(f"{op}: axis {axis} repeats an axis")
        return out

    def _reduce(self, op: str, axis: int | Sequence[int] | None, keepdim: bool) -> Tensor:
        axes = self._axes(op, axis)
        kept = tuple(1 if i in axes else d for i, d in enumerate(self.shape))
        dropped = tuple(d for i, d in enumerate(self.shape) if i not in axes)
        if len(axes) == 1:
            dim_op = {"sum": Op.SUM_DIM, "max": Op.MAX_DIM, "mean": Op.MEAN_DIM}[op]
            out = Tensor(make(dim_op, (self.node,), axes[0]))
            return out.unsqueeze(axes[0]) if keepdim else out
        if op == "mean" and self.dtype.is_half:
            # A half-type sum can overflow (or lose digits) before the scale: sum and scale in f32.
            return self.cast(self.dtype.acc)._reduce(op, axis, keepdim).cast(self.dtype)
        if op == "mean":
            n = math.prod(self.shape[a] for a in axes)
            if self.dtype.is_int:  # NumPy's mean of integers: the exact 64-bit sum, divided in f64
                return (self._reduce("sum", axis, keepdim).cast(DType.F64) / float(n)).cast(DEFAULT_FLOAT)
            return self._reduce("sum", axis, keepdim) * (1.0 / n if n else math.nan)
        to_op = Op.REDUCE_SUM_TO if op == "sum" else Op.REDUCE_MAX_TO
        out = Tensor(make(to_op, (self.node,), kept if axes != tuple(range(self.ndim)) or keepdim else ()))
        if keepdim:
            return out if out.shape == kept else out.reshape(kept)
        return out if out.shape == dropped else out.reshape(dropped)

    def sum(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
        return self._reduce("sum", axis, keepdim)

    def max(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
        return self._reduce("max", axis, keepdim)

    def mean(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
        return self._reduce("mean", axis, keepdim)

    def softmax(self, axis: int = -1) -> Tensor:
        from fuel.graph.registry.softmax_last_dim import softmax_last_dim

        a = norm_axis("softmax", axis, self.ndim)
        if a == self.ndim - 1:
            return softmax_last_dim(self)
        perm = list(range(self.ndim))
        perm[a], perm[-1] = perm[-1], perm[a]
        return softmax_last_dim(self.permute(*perm)).permute(*perm)

    # ---- movement ------------------------------------------------------------------------
    def reshape(self, *shape: int | Sequence[int]) -> Tensor:
        dims = _dims("reshape", shape)
        if dims.count(-1) > 1 or any(d < -1 for d in dims):
            raise ShapeError(f"reshape: at most one -1 and no other negative dimension in {list(dims)}")
        if -1 in dims:
            rest = math.prod(d for d in dims if d != -1)
            if rest == 0 or self.size % rest:
                raise ShapeError(f"reshape: cannot reshape {list(self.shape)} to {list(dims)}")
            dims = tuple(self.size // rest if d == -1 else d for d in dims)
        if dims == self.shape:
            return self
        return Tensor(make(Op.RESHAPE, (self.node,), dims))

    def permute(self, *axes: int | Sequence[int]) -> Tensor:
        dims = tuple(norm_axis("permute", a, self.ndim) for a in _dims("permute", axes, "an axis"))
        if dims == tuple(range(self.ndim)):
            return self
        return Tensor(make(Op.PERMUTE, (self.node,), dims))

    def transpose(self, a: int = -2, b: int = -1) -> Tensor:
        perm = list(range(self.ndim))
        i, j = norm_axis("transpose", a, self.ndim), norm_axis("transpose", b, self.ndim)
        perm[i], perm[j] = perm[j], perm[i]
        return self.permute(*perm)

    @property
    def T(self) -> Tensor:
        return self.permute(*reversed(range(self.ndim)))

    def unsqueeze(self, dim: int) -> Tensor:
        return Tensor(make(Op.UNSQUEEZE, (self.node,), norm_axis("unsqueeze", dim, self.ndim, extra=1)))

    def squeeze(self, dim: int | None = None) -> Tensor:
        if dim is not None:
            return Tensor(make(Op.SQUEEZE, (self.node,), norm_axis("squeeze", dim, self.ndim)))
        out = self
        for d in reversed(range(self.ndim)):
            if self.shape[d] == 1:
                out = Tensor(make(Op.SQUEEZE, (out.node,), d))
        return out

    def broadcast_to(self, *shape: int | Sequence[int]) -> Tensor:
        dims = _dims("broadcast_to", shape)
        return self if dims == self.shape else Tensor(make(Op.BROADCAST_TO, (self.node,), dims))

    def contiguous(self) -> Tensor:
        return Tensor(make(Op.CONTIGUIZE, (self.node,)))

    def __getitem__(self, key: Any) -> Tensor:
        from fuel.graph.indexing import getitem

        return getitem(self, key)

    def gather(self, axis: int, index: TensorLike) -> Tensor:
        idx = as_tensor(index)
        return Tensor(make(Op.GATHER, (self.node, idx.node), norm_axis("gather", axis, self.ndim)))

    def index_select(self, axis: int, index: TensorLike) -> Tensor:
        idx = as_tensor(index)
        return Tensor(make(Op.INDEX_SELECT, (self.node, idx.node), norm_axis("index_select", axis, self.ndim)))


def _is_scalar(x: object) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _dims(op: str, shape: Sequence[Any], what: str = "a dimension") -> tuple[int, ...]:
    """Sizes given either as arguments or as one sequence: `reshape(2, 3)` or `reshape((2, 3))`."""
    items = shape[0] if len(shape) == 1 and isinstance(shape[0], (Sequence, np.ndarray)) else shape
    return tuple(as_int(op, d, what) for d in items)


def tensor(data: Any, dtype: DType | str | None = None, *, const: bool = False) -> Tensor:
    """A leaf over an array (shared, not copied: only the in-place ops, `fl.ops.inplace_affine` and
    `fl.cache_write`, ever write it); `dtype` converts it once (a copy unless already that dtype).

    `const=True` makes a constant: a read-only snapshot of the data (copied, unless the array is read-only
    all the way down already, `fuel.graph.node.frozen`). `fl.jit` folds arithmetic on constants at capture,
    where a writable array is read again on every call."""
    if isinstance(data, Tensor):
        if const:
            raise ParamError("tensor: const=True takes an array, got a Tensor; realise it and pass its array")
        return data if dtype is None else data.cast(dtype)
    arr = np.asarray(data)
    if arr.dtype == np.bool_:
        arr = arr.astype(np.uint8)
    if dtype is not None:
        arr = arr.astype(as_dtype(dtype, "tensor").np, copy=False)
    dt = from_numpy(arr.dtype)
    if const and not frozen(arr):
        arr = arr.copy()
        arr.flags.writeable = False
    return Tensor(Node(Op.CONST, (), tuple(int(d) for d in arr.shape), dt, None, arr))


def full(shape: int | Sequence[int], value: float, dtype: DType | str = DEFAULT_FLOAT, op: str = "full") -> Tensor:
    """A constant filled with `value` (a rank-0 leaf broadcast, so no memory is spent)."""
    dt = as_dtype(dtype, op)
    dims = check_dims(op, _dims(op, (shape,)))
    if isinstance(value, DynScalar):
        raise ParamError(f"{op}: a DynScalar ({value.name!r}) is not supported as the fill value")
    return Tensor(broadcast(const(op, value, dt), dims))


def zeros(shape: int | Sequence[int], dtype: DType | str = DEFAULT_FLOAT) -> Tensor:
    return full(shape, 0, dtype, op="zeros")


def ones(shape: int | Sequence[int], dtype: DType | str = DEFAULT_FLOAT) -> Tensor:
    return full(shape, 1, dtype, op="ones")


def as_tensor(x: TensorLike, like: Tensor | None = None) -> Tensor:
    """Wrap an array as a leaf; a scalar takes `like`'s dtype."""
    if isinstance(x, Tensor):
        return x
    if isinstance(x, np.generic) and like is None:
        return tensor(x)
    if _is_scalar(x):
        if like is None:
            raise DTypeError("tensor: a bare scalar needs a tensor operand to take its dtype from")
        return full((), float(x), like.dtype)
    return tensor(x)


def to_operand(x: Any) -> Operand:
    """A binary op's operand: a tensor's node, a scalar as it is (promotion needs to know weak from typed),
    anything else (an array, a list) as a new leaf."""
    if isinstance(x, Tensor):
        return x.node
    return x if is_number(x) else tensor(x).node


def binary(op: Op, a: TensorLike, b: TensorLike) -> Tensor:
    """Elementwise op with NumPy 2 promotion (fuel.graph.promote) and broadcasting."""
    return Tensor(elementwise(op, to_operand(a), to_operand(b)))


def matmul(a: TensorLike, b: TensorLike) -> Tensor:
    """NumPy matmul semantics: 1-D operands promote, batch dims broadcast, dtypes promote."""
    ta, tb = as_tensor(a), as_tensor(b)
    if ta.dtype != tb.dtype:
        na, nb = promote_pair("matmul", ta.node, tb.node)
        ta, tb = Tensor(na), Tensor(nb)
    if ta.ndim == 0 or tb.ndim == 0:
        raise ShapeError(f"matmul: operands need rank >= 1, got {list(ta.shape)} and {list(tb.shape)}")
    va, vb = ta.ndim == 1, tb.ndim == 1
    if va:
        ta = ta.unsqueeze(0)
    if vb:
        tb = tb.unsqueeze(1)
    if ta.shape[-1] != tb.shape[-2]:
        raise ShapeError(f"matmul: a has K={ta.shape[-1]} but b has K={tb.shape[-2]} "
                         f"({list(ta.shape)} @ {list(tb.shape)})")
    batch = broadcast_shapes("matmul", ta.shape[:-2], tb.shape[:-2])
    ta = ta.broadcast_to(batch + ta.shape[-2:])
    tb = tb.broadcast_to(batch + tb.shape[-2:])
    out = Tensor(make(Op.MATMUL, (ta.node, tb.node)))
    if va:
        out = out.squeeze(-2)
    if vb:
        out = out.squeeze(-1)
    return out
