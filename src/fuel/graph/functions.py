"""The ops the API offers as functions rather than Tensor methods: `fl.where`, `fl.concat`, `fl.pad`,
and the destructive `fl.cache_write`, `fl.index_copy` and `fl.assign`. `fl.matmul` and the constructors
(`fl.tensor`, `fl.zeros`, ...) stay in fuel.graph.tensor, since Tensor's own methods (`@`, leaves from
arrays) call them."""

from __future__ import annotations

from collections.abc import Sequence

from fuel.dtype import DType
from fuel.errors import DTypeError, ParamError, ShapeError
from fuel.graph.node import DynScalar, Op
from fuel.graph.prims import CacheWriteArg, make
from fuel.graph.promote import broadcast, is_number, promote_pair, result_dtype
from fuel.graph.shapes import as_int, broadcast_shapes, norm_axis
from fuel.graph.tensor import Tensor, TensorLike, as_tensor, to_operand
from fuel.graph.traced import note_effect


def where(cond: TensorLike, a: TensorLike, b: TensorLike) -> Tensor:
    """`a` where cond is non-zero, else `b` (all three broadcast)."""
    tc = as_tensor(cond)
    if tc.dtype is not DType.U8:
        raise DTypeError(f"where: condition must be u8 (a comparison's result), got {tc.dtype.value}")
    na, nb = promote_pair("where", to_operand(a), to_operand(b))
    shape = broadcast_shapes("where", broadcast_shapes("where", tc.shape, na.shape), nb.shape)
    nodes = (tc.broadcast_to(shape).node, broadcast(na, shape), broadcast(nb, shape))
    return Tensor(make(Op.WHERE, nodes))


def concat(tensors: Sequence[TensorLike], axis: int = 0) -> Tensor:
    ts = [as_tensor(t) for t in tensors]
    if not ts:
        raise ShapeError("concat: needs at least one tensor")
    if len(ts) == 1:
        return ts[0]
    dt = ts[0].dtype
    for t in ts[1:]:
        dt = result_dtype("concat", dt, t.dtype)
    ts = [t.cast(dt) for t in ts]
    return Tensor(make(Op.CONCAT, tuple(t.node for t in ts), norm_axis("concat", axis, ts[0].ndim)))


def pad(x: TensorLike, widths: Sequence[tuple[int, int]], value: float = 0.0) -> Tensor:
    t = as_tensor(x)
    w = tuple((as_int("pad", b, "a pad width"), as_int("pad", a, "a pad width")) for b, a in widths)
    if not is_number(value):
        raise ParamError(f"pad: the fill value must be a number, got {value!r}")
    return Tensor(make(Op.PAD, (t.node,), (w, float(value))))


def cache_write(cache: TensorLike, rows: TensorLike, offset: DynScalar | int, axis: int = -2) -> Tensor:
    """Write `rows` into `cache` in place at positions [offset, offset + n) of `axis`, and return the
    cache (the same memory). A KV cache `[B, H, capacity, D]` takes a step's new rows at
    `offset = fl.dyn("pos")`, so one captured decode step serves every token.
    Readers of `cache` built before the write run before it; read the returned tensor to see the new
    rows. An offset outside the cache is an error (at build for an int, at realize for a DynScalar).
    `index_copy` is the other destructive primitive."""
    tc, tr = as_tensor(cache), as_tensor(rows)
    ax = norm_axis("cache_write", axis, tc.ndim)
    if not isinstance(offset, DynScalar):
        offset = as_int("cache_write", offset, "the offset")
    return _effect(Tensor(make(Op.CACHE_WRITE, (tc.node, tr.node), CacheWriteArg(ax, offset))))


def index_copy(target: TensorLike, index: TensorLike, rows: TensorLike) -> Tensor:
    """Write `rows[r]` into `target[index[r]]` in place for every r, and return the target (the same
    memory), as torch's `target.index_copy_(0, index, rows)`. target is `[N, ...rest]`, index `[M]` (u32 or
    i64) and rows `[M, ...rest]` of target's dtype: a batched step's K/V rows, each into its own slot of a
    paged KV cache `[num_blocks * block_size, kv_heads, head_dim]`. Readers of `target` built before the
    write run before it; read the returned tensor to see the new rows. Shapes and dtypes are checked at
    build; at realize an index outside [0, N) or one repeated (a scatter with duplicates has no single
    answer) raises IndexOutOfRange naming its position and value, before anything is written."""
    tt, ti, tr = as_tensor(target), as_tensor(index), as_tensor(rows)
    return _effect(Tensor(make(Op.INDEX_COPY, (tt.node, ti.node, tr.node))))


def assign(target: TensorLike, value: TensorLike) -> Tensor:
    """Write `value` into `target`'s memory in place and return the target, as torch's `target.copy_(value)`
    with equal shapes and dtypes (no broadcast, no cast: a mismatch is an error naming both). The target is
    a realised tensor: a parameter or an optimizer state. Readers of `target` built before the write run
    before it, so `fl.assign(w, w - lr * g)` reads the old w. Inside `fl.jit` the write runs at every call
    even when nothing reads the result: a training step returns its loss, and its updates are effects."""
    tt, tv = as_tensor(target), as_tensor(value)
    if tt.node.value is None:
        raise ParamError(f"assign: the target must be a realised tensor (a parameter or state), got a lazy "
                         f"{tt.node.op.name} result")
    if tt.shape != tv.shape:
        raise ShapeError(f"assign: value is {list(tv.shape)}, the target is {list(tt.shape)}")
    if tt.dtype is not tv.dtype:
        raise DTypeError(f"assign: value is {tv.dtype.value}, the target is {tt.dtype.value}")
    if tt.ndim == 0:
        return _effect(Tensor(make(Op.CACHE_WRITE, (tt.reshape((1,)).node, tv.reshape((1,)).node),
                                   CacheWriteArg(0, 0)))).reshape(())
    return _effect(Tensor(make(Op.CACHE_WRITE, (tt.node, tv.node), CacheWriteArg(0, 0))))


def _effect(t: Tensor) -> Tensor:
    """A destructive op's result, recorded as an effect of the `fl.jit` trace in progress (if any)."""
    note_effect(t.node)
    return t
