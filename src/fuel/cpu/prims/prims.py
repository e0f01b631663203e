"""NumPy kernels of the primitive ops: one table, each `kernel(inputs, spec, out) -> array`.

`out` is a buffer of the node's shape and dtype to write into (a replayed plan's arena), or None to
allocate. View ops ignore it and return a view. Common f32/f64 elementwise ops and matmul write into
`out` directly; the rest compute as NumPy does and copy into it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from fuel.cpu.prims.bits import BIT_KERNELS
from fuel.cpu.prims.erf import erf_into
from fuel.cpu.prims.gemv import gemv, takes
from fuel.cpu.prims.index_copy import index_copy_kernel
from fuel.cpu.prims.logistic import sigmoid_any as _sigmoid
from fuel.cpu.prims.logistic import silu_any as _silu
from fuel.cpu.prims.logistic import tanh_any as _tanh
from fuel.cpu.simd import row_blocks
from fuel.dtype import DType
from fuel.errors import IndexOutOfRange, KernelError
from fuel.graph.node import Op, OpSpec
from fuel.graph.shapes import reduce_to_axes

PrimKernel = Callable[[list[np.ndarray], OpSpec, np.ndarray | None], np.ndarray]
Computed = Callable[[list[np.ndarray], OpSpec], np.ndarray]


def _work(x: np.ndarray, dtype: DType) -> np.ndarray:
    """Half types compute in f32 (widening is exact); the result is rounded once on store."""
    return x.astype(np.float32) if dtype.is_half else x


def _store(y: np.ndarray, node: OpSpec) -> np.ndarray:
    return y if y.dtype == node.dtype.np else y.astype(node.dtype.np)


_UNARY: dict[Op, Callable[[np.ndarray], np.ndarray]] = {
    Op.NEG: np.negative,
    Op.ABS: np.abs,
    Op.SQR: np.square,
    Op.SQRT: np.sqrt,
    Op.RSQRT: lambda x: 1 / np.sqrt(x),
    Op.RECIP: lambda x: 1 / x,
    Op.EXP: np.exp,
    Op.LOG: np.log,
    Op.TANH: _tanh,
    Op.SIN: np.sin,
    Op.COS: np.cos,
    Op.SIGMOID: _sigmoid,
    Op.RELU: lambda x: np.maximum(x, 0).astype(x.dtype, copy=False),
    Op.SILU: _silu,
    Op.SIGN: lambda x: np.sign(x),
    Op.STEP: lambda x: (x > 0).astype(x.dtype),
    Op.FLOOR: np.floor,
}

_BINARY: dict[Op, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    Op.ADD: np.add, Op.SUB: np.subtract, Op.MUL: np.multiply, Op.DIV: np.divide,
    Op.MAXIMUM: np.maximum, Op.MINIMUM: np.minimum, Op.POW: np.power,
    Op.EQ: np.equal, Op.NE: np.not_equal, Op.LT: np.less, Op.LE: np.less_equal,
    Op.GT: np.greater, Op.GE: np.greater_equal,
}


def _straight(f: Callable[..., np.ndarray]) -> PrimKernel:
    """A logistic-family kernel (`f(x, out)`) straight into `out` where it can: a prefill's [128, 1536] no
    longer allocates a temporary and copies it."""

    def kernel(xs: list[np.ndarray], n: OpSpec, out: np.ndarray | None) -> np.ndarray:
        x = xs[0]
        if out is None or n.dtype.is_half or x.dtype != out.dtype or np.may_share_memory(x, out):
            return _copy_into(_store(f(_work(x, n.dtype)), n), out)
        return f(x, out)

    return kernel


def _unary(op: Op) -> PrimKernel:
    f = _UNARY[op]
    computed: Computed = lambda xs, n: _store(f(_work(xs[0], n.dtype)), n)  # noqa: E731
    if not isinstance(f, np.ufunc):
        return _into(computed)

    def kernel(xs: list[np.ndarray], n: OpSpec, out: np.ndarray | None) -> np.ndarray:
        if out is None or n.dtype.is_half or xs[0].dtype != out.dtype:
            return _copy_into(computed(xs, n), out)
        return f(xs[0], out=out)

    return kernel


def _binary(op: Op) -> PrimKernel:
    f = _BINARY[op]

    def kernel(xs: list[np.ndarray], n: OpSpec, out: np.ndarray | None) -> np.ndarray:
        if out is None or n.dtype.is_half or not xs[0].dtype == xs[1].dtype == out.dtype:
            return _copy_into(_store(f(_work(xs[0], n.in_dtypes[0]), _work(xs[1], n.in_dtypes[1])), n), out)
        return f(xs[0], xs[1], out=out)  # type: ignore[call-arg]

    return kernel


def _erf(xs: list[np.ndarray], n: OpSpec, out: np.ndarray | None) -> np.ndarray:
    x = _work(xs[0], n.dtype)
    if out is not None and out.dtype == x.dtype and out.flags.c_contiguous:
        return erf_into(x, out)
    return _copy_into(_store(erf_into(x, np.empty(x.shape, x.dtype)), n), out)


def _copy_into(y: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    if out is None:
        return y
    np.copyto(out, y)
    return out


def _into(computed: Computed) -> PrimKernel:
    """A kernel that computes a fresh array and copies it into `out` when one is given."""
    return lambda xs, n, out: _copy_into(computed(xs, n), out)


def _view(computed: Computed) -> PrimKernel:
    """A view op: never writes, `out` is always None for it."""
    return lambda xs, n, out: computed(xs, n)


def _scalar(f: np.ufunc) -> PrimKernel:
    def kernel(xs: list[np.ndarray], n: OpSpec, out: np.ndarray | None) -> np.ndarray:
        x = _work(xs[0], n.dtype)
        if out is not None and not n.dtype.is_half and x.dtype == out.dtype:
            return f(x, np.asarray(n.arg, dtype=x.dtype), out=out)
        return _copy_into(_store(f(x, np.asarray(n.arg, dtype=x.dtype)), n), out)
    return kernel


def _powi(xs: list[np.ndarray], n: OpSpec) -> np.ndarray:
    """Repeated squaring in the order of compiler-builtins __powi (not np.power)."""
    a = _work(xs[0], n.dtype)
    p = abs(int(n.arg))
    r = np.ones_like(a)
    while True:
        if p & 1:
            r = r * a
        p >>= 1
        if p == 0:
            break
        a = a * a
    if int(n.arg) < 0:
        r = 1 / r
    return _store(r, n)


def _saturate(x: np.ndarray, target: DType) -> np.ndarray:
    """Float to integer, saturating: above the range gives the max, below it the min, NaN gives 0, and
    the rest truncates toward zero. The bounds are compared in f64, where every float type widens exactly;
    the max itself may round up there (2**63 - 1 becomes 2**63), so reaching the rounded max saturates."""
    info = np.iinfo(target.np)
    lo, hi = int(info.min), int(info.max)
    with np.errstate(invalid="ignore"):  # a signalling NaN is still a NaN: it saturates to 0 below
        wide = x.astype(np.float64)
    hi_f = float(hi)
    over = wide >= hi_f if int(hi_f) > hi else wide > hi_f
    under = wide < float(lo)
    nan = np.isnan(wide)
    out = np.where(over | under | nan, 0.0, wide).astype(target.np)
    out[over] = hi
    out[under] = lo
    return out


def _cast(xs: list[np.ndarray], n: OpSpec) -> np.ndarray:
    x, target = xs[0], n.dtype
    if n.in_dtypes[0].is_float and not target.is_float:
        return _saturate(x, target)
    return x.astype(target.np)


def _acc(n: OpSpec) -> Any:
    """The dtype NumPy accumulates a reduction in: the node's own for integer sums (64 bits), f64 for the
    mean of integers, and the working type (f32 for half types) for floats."""
    if n.in_dtypes[0].is_float:
        return None
    return np.float64 if n.dtype.is_float else n.dtype.np


def _reduce_to(f: Callable[..., np.ndarray]) -> Computed:
    def kernel(xs: list[np.ndarray], n: OpSpec) -> np.ndarray:
        axes = reduce_to_axes(n.op.name.lower(), n.in_shapes[0], n.shape)
        x = _work(xs[0], n.in_dtypes[0])
        y = f(x, axis=axes, keepdims=True) if f is np.max else f(x, axis=axes, keepdims=True, dtype=_acc(n))
        return _store(np.reshape(y, n.shape), n)
    return kernel


def _dim(f: Callable[..., np.ndarray]) -> Computed:
    def kernel(xs: list[np.ndarray], n: OpSpec) -> np.ndarray:
        x = _work(xs[0], n.in_dtypes[0])
        return _store(np.asarray(f(x, axis=n.arg) if f is np.max else f(x, axis=n.arg, dtype=_acc(n))), n)
    return kernel


def _matmul(xs: list[np.ndarray], n: OpSpec, out: np.ndarray | None) -> np.ndarray:
    """a @ b. A few rows with a weight take `gemv` where it has a kernel for the dtype (f32, f64, and the
    half types computed in f32); integers and larger products take NumPy's matmul on fixed pieces
    (`row_blocks`), which wraps integer sums in the result type as np.matmul does."""
    a, b = _work(xs[0], n.dtype), _work(xs[1], n.dtype)
    if a.size == 0 or b.size == 0:
        # NumPy's answer without its reshapes: empty when M, N or a batch dim is 0, zeros when only K is.
        return _copy_into(np.zeros(n.shape, n.dtype.np), out)
    direct = out if out is not None and not n.dtype.is_half else None
    if b.ndim > 2 and all(s == 0 for s in b.strides[:-2]):
        b = b[(0,) * (b.ndim - 2)]  # b broadcast over the batch (a weight): one product over all rows of a
    if b.ndim == 2 and a.ndim >= 2:
        rows = math.prod(a.shape[:-1])
        flat = None if direct is None else direct.reshape(rows, b.shape[1])
        if takes(rows, a, b):
            if flat is None:
                flat = np.empty((rows, b.shape[1]), b.dtype)
            gemv(a.reshape(rows, a.shape[-1]), b, flat)
            y = flat.reshape(n.shape)
        else:
            if flat is None:
                flat = np.empty((rows, b.shape[1]), np.result_type(a, b))
            row_blocks.matmul(a.reshape(rows, a.shape[-1]), b, flat)
            y = flat.reshape(n.shape)
    else:
        y = direct if direct is not None else np.empty(n.shape, np.result_type(a, b))
        row_blocks.matmul(a, b, y)
    return y if direct is not None else _copy_into(_store(y, n), out)


def _check_index(op: str, idx: np.ndarray, size: int) -> np.ndarray:
    if idx.size and (int(idx.max()) >= size or (idx.dtype.kind == "i" and int(idx.min()) < 0)):
        bad = idx[(idx >= size) | (idx < 0)].ravel()[0]
        raise IndexOutOfRange(f"{op}: index {int(bad)} is out of range for an axis of size {size}")
    return idx.astype(np.intp, copy=False)


def _gather(xs: list[np.ndarray], n: OpSpec) -> np.ndarray:
    idx = _check_index("gather", xs[1], n.in_shapes[0][n.arg])
    return np.take_along_axis(xs[0], idx, axis=n.arg)


def _index_select(xs: list[np.ndarray], n: OpSpec, out: np.ndarray | None) -> np.ndarray:
    """Straight into `out` where it has the input's dtype: one pass, not a fresh array and a copy (half
    the time of MiniLM's packed-token gathers). mode="clip" only skips NumPy's own check (and the
    buffered output that check forces): the indices were checked above."""
    idx = _check_index("index_select", xs[1], n.in_shapes[0][n.arg])
    if out is None or out.dtype != xs[0].dtype:
        return _copy_into(np.take(xs[0], idx, axis=n.arg), out)
    return np.take(xs[0], idx, axis=n.arg, out=out, mode="clip")


def _scatter_add(xs: list[np.ndarray], n: OpSpec) -> np.ndarray:
    base, src = _work(xs[0], n.dtype), _work(xs[2], n.dtype)
    idx = _check_index("scatter_add", xs[1], n.shape[n.arg])
    out = np.array(base, copy=True)
    grids: list[Any] = list(np.indices(idx.shape, sparse=True))
    grids[n.arg] = idx
    np.add.at(out, tuple(grids), src)
    return _store(out, n)


def _index_add(xs: list[np.ndarray], n: OpSpec, out: np.ndarray | None) -> np.ndarray:
    """base with src's rows added at idx in index order (np.add.at), straight into `out` where one is given
    and nothing is widened (an embedding's gradient in a train step: no base-sized copy besides it); half
    types add in f32 and round once."""
    idx = _check_index("index_add", xs[1], n.shape[n.arg])
    at = (slice(None),) * n.arg + (idx,)
    if out is not None and not n.dtype.is_half and out.flags.c_contiguous:
        np.copyto(out, xs[0])
        np.add.at(out, at, xs[2])
        return out
    res = np.array(_work(xs[0], n.dtype), copy=True)
    np.add.at(res, at, _work(xs[2], n.dtype))
    return _copy_into(_store(res, n), out)


def _pad(xs: list[np.ndarray], n: OpSpec) -> np.ndarray:
    widths, value = n.arg
    return np.pad(xs[0], widths, mode="constant", constant_values=np.asarray(value, dtype=n.dtype.np))


def _cache_write(xs: list[np.ndarray], n: OpSpec, out: np.ndarray | None) -> np.ndarray:
    """Write the rows into the cache (input 0) in place, from the resolved offset; return the cache."""
    cache, rows = xs
    ax, off = n.arg.axis, n.arg.offset
    count, cap = rows.shape[ax], cache.shape[ax]
    if not 0 <= off <= cap - count:
        raise IndexOutOfRange(f"cache_write: offset {off} with {count} rows is outside the cache's {cap} "
                              f"positions on axis {ax}")
    if not cache.flags.writeable:
        raise KernelError("cache_write: the cache is read-only; pass a writable array (it is written in place)")
    cache[(slice(None),) * ax + (slice(off, off + count),)] = rows
    return cache


def _grad_kernel(module: str, name: str, as_is: bool = False, into: bool = False) -> PrimKernel:
    """A fused op's gradient kernel, `kernel(inputs, arg) -> array or tuple of arrays`, living beside the
    op's forward kernels in module `module` of `fuel.cpu` (imported on first use: it compiles Numba code,
    then kept). Inputs arrive contiguous (those the autograd built as broadcast zeros included), or as they
    are for a kernel that reads any layout (`as_is`). A one-array result is copied into `out` when one is
    given, as every primitive's: an fl.jit capture reads that buffer through views of it that it folded at
    capture; a kernel that writes `out` itself (`into`: `kernel(inputs, arg, out)`) is handed it instead."""
    found: list[Callable[..., Any]] = []

    def run(xs: list[np.ndarray], n: OpSpec, out: np.ndarray | None) -> Any:
        if not found:
            import importlib

            found.append(getattr(importlib.import_module(f"fuel.cpu.{module}"), name))
        args = xs if as_is else [np.ascontiguousarray(x) for x in xs]
        res = found[0](args, n.arg, out) if into else found[0](args, n.arg)
        return res if isinstance(res, tuple) else _copy_into(res, out) if res is not out else res
    return run


def _no_kernel(xs: list[np.ndarray], n: OpSpec, out: np.ndarray | None) -> np.ndarray:
    raise KernelError(f"{n.op.name.lower()}: has no primitive kernel; the executor handles it")


def _concat(xs: list[np.ndarray], n: OpSpec, out: np.ndarray | None) -> np.ndarray:
    return np.concatenate(xs, axis=n.arg, out=out)


def _contiguize(xs: list[np.ndarray], n: OpSpec, out: np.ndarray | None) -> np.ndarray:
    return np.ascontiguousarray(xs[0]) if out is None else _copy_into(xs[0], out)


PRIM_KERNELS: dict[Op, PrimKernel] = {
    **{op: _unary(op) for op in _UNARY},
    Op.SILU: _straight(_silu),
    Op.TANH: _straight(_tanh),
    **{op: _binary(op) for op in _BINARY},
    Op.ERF: _erf,
    Op.WHERE: _into(lambda xs, n: np.where(xs[0] != 0, xs[1], xs[2])),
    Op.ADD_SCALAR: _scalar(np.add),
    Op.MUL_SCALAR: _scalar(np.multiply),
    Op.POWI: _into(_powi),
    Op.POW_SCALAR: _scalar(np.power),
    Op.CAST: _into(_cast),
    **BIT_KERNELS,
    Op.REDUCE_SUM_TO: _into(_reduce_to(np.sum)),
    Op.REDUCE_MAX_TO: _into(_reduce_to(np.max)),
    Op.SUM_DIM: _into(_dim(np.sum)),
    Op.MAX_DIM: _into(_dim(np.max)),
    Op.MEAN_DIM: _into(_dim(np.mean)),
    Op.BROADCAST_TO: _view(lambda xs, n: np.broadcast_to(xs[0], n.shape)),
    Op.RESHAPE: _view(lambda xs, n: np.reshape(xs[0], n.shape)),
    Op.PERMUTE: _view(lambda xs, n: np.transpose(xs[0], n.arg)),
    Op.SLICE: _view(lambda xs, n: xs[0][tuple(slice(*r) for r in n.arg)]),
    Op.UNSQUEEZE: _view(lambda xs, n: np.expand_dims(xs[0], n.arg)),
    Op.SQUEEZE: _view(lambda xs, n: np.squeeze(xs[0], axis=n.arg)),
    Op.CONCAT: _concat,
    Op.PAD: _into(_pad),
    Op.CONTIGUIZE: _contiguize,
    Op.MATMUL: _matmul,
    Op.GATHER: _into(_gather),
    Op.INDEX_SELECT: _index_select,
    Op.SCATTER_ADD: _into(_scatter_add),
    Op.INDEX_ADD: _index_add,
    Op.CACHE_WRITE: _cache_write,
    Op.INDEX_COPY: index_copy_kernel,
    Op.VIEW: lambda xs, n, out: xs[0][n.arg[0]],
    Op.CROSS_ENTROPY_GRAD: _grad_kernel("fused_softmax_cross_entropy", "cross_entropy_grad", as_is=True,
                                        into=True),
    Op.SELECTIVE_SCAN_GRAD: _grad_kernel("scans.selective_scan", "selective_scan_grad"),
    Op.SSD_CHUNK_SCAN_GRAD: _grad_kernel("scans.ssd_chunk_scan", "ssd_chunk_scan_grad"),
    Op.CONST: _no_kernel,
    Op.FUSED: _no_kernel,
}
assert set(PRIM_KERNELS) == set(Op), "every primitive needs a CPU kernel"
