"""FusedLinear (id 2): `a @ b + bias`, one GEMM with a bias epilogue.

Shapes: a `[..., M, K]`, bias `[N]`, and b either
- `[K, N]`, a *shared weight* applied to every batch entry of a (what `x @ w` means for a rank-2 w),
  so the kernel runs one `[prod(batch)·M, K] @ [K, N]` GEMM; or
- `[..., K, N]` of a's rank, each batch dim equal to a's or dividing it (GQA-style, not NumPy
  broadcasting: a batch index i reads b at `i // (a_d / b_d)`, as `repeat_interleave` would).
Output `[..., M, N]` in the common dtype of the three inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fuel.dtype import DType
from fuel.errors import DTypeError, ShapeError
from fuel.graph.node import Node, Op, Shape
from fuel.graph.passes.template import Bound, Wild, template_pattern
from fuel.graph.registry import NOT_DIFFERENTIABLE, FusedOpEntry, FusedOpFamily, FusedOps, Match, fused_node
from fuel.graph.tensor import Tensor, TensorLike, as_tensor


@dataclass(frozen=True)
class FusedLinearParams:
    pass


def _shape(s: Shape) -> str:
    return str(list(s))


def batch_reps(a: Shape, b: Shape) -> tuple[int, ...] | None:
    """Per batch dim, how many a entries read one b entry; None when b is a shared rank-2 weight."""
    if len(b) == 2:
        return None
    return tuple(da // db if db else 1 for da, db in zip(a[:-2], b[:-2], strict=True))


def shape_rule(shapes: tuple[Shape, ...], params: FusedLinearParams) -> Shape:
    a, b, bias = shapes
    if len(a) < 2 or len(b) < 2:
        raise ShapeError(f"fused_linear: a and b need rank >= 2, got a {_shape(a)} and b {_shape(b)}")
    if len(b) != 2 and len(b) != len(a):
        raise ShapeError(f"fused_linear: b must be a rank-2 shared weight or have a's rank {len(a)}, "
                         f"got a {_shape(a)} and b {_shape(b)}")
    if a[-1] != b[-2]:
        raise ShapeError(f"fused_linear: a has K={a[-1]} but b has K={b[-2]} ({_shape(a)} @ {_shape(b)})")
    if len(b) > 2:
        for d, (da, db) in enumerate(zip(a[:-2], b[:-2], strict=True)):
            if da != db and (db == 0 or da % db):
                raise ShapeError(f"fused_linear: batch dim {d} of a ({da}) is neither equal to nor a "
                                 f"multiple of b's ({db}); a {_shape(a)}, b {_shape(b)}")
    n = b[-1]
    if bias != (n,):
        raise ShapeError(f"fused_linear: bias must be [{n}] (b's last dim), got {_shape(bias)}")
    return a[:-1] + (n,)


def dtype_rule(dtypes: tuple[DType, ...], params: FusedLinearParams) -> DType:
    a, b, bias = dtypes
    if not a.is_float:
        raise DTypeError(f"fused_linear: a must be a float tensor, got {a.value}")
    if b != a or bias != a:
        raise DTypeError(f"fused_linear: a, b and bias must share a dtype, got {a.value}, {b.value} "
                         f"and {bias.value}")
    return a


def _expansion(a_shape: Shape, b_shape: Shape) -> tuple[Shape, Shape] | None:
    """The two intermediate shapes of expand_b: b with a 1 after each batch dim, then repeated.

    None when nothing is repeated (b shared, or batch dims already equal).
    """
    reps = batch_reps(a_shape, b_shape)
    if reps is None or all(r == 1 for r in reps):
        return None
    batch, tail = b_shape[:-2], b_shape[-2:]
    spread = tuple(d for db in batch for d in (db, 1)) + tail
    wide = tuple(d for db, r in zip(batch, reps, strict=True) for d in (db, r)) + tail
    return spread, wide


def expand_b(b: Tensor, a_shape: Shape) -> Tensor:
    """b `[..., K, N]` repeated (interleaved) up to a's batch dims: one reshape, broadcast, reshape.

    A shared rank-2 b is left as is: Tensor matmul broadcasts it (and the kernels reuse it).
    """
    shapes = _expansion(a_shape, b.shape)
    if shapes is None:
        return b
    spread, wide = shapes
    return b.reshape(spread).broadcast_to(wide).reshape(a_shape[:-2] + b.shape[-2:])


def decompose(inputs: list[Tensor], params: FusedLinearParams) -> Tensor:
    a, b, bias = inputs
    return a @ expand_b(b, a.shape) + bias


def _unexpand(bb: Node, a_shape: Shape) -> Node:
    """See through what `expand_b` or Tensor matmul did to b (views only); else bb itself."""
    tail = bb.shape[-2:]
    if bb.op is Op.BROADCAST_TO:
        s = bb.inputs[0].shape
        if s == tail:  # `x @ w` with a rank-2 weight: the kernel shares w across the batch
            return bb.inputs[0]
        if len(s) == len(a_shape) and s[-2:] == tail and all(
                d in (1, da) for d, da in zip(s[:-2], a_shape[:-2], strict=True)):
            return bb.inputs[0]  # NumPy broadcast of size-1 batch dims: a GQA repetition of b
        return bb
    if bb.op is Op.RESHAPE and bb.inputs[0].op is Op.BROADCAST_TO and bb.inputs[0].inputs[0].op is Op.RESHAPE:
        bc = bb.inputs[0]
        b = bc.inputs[0].inputs[0]
        if len(b.shape) != len(a_shape) or b.shape[-2:] != tail:
            return bb
        try:
            shape_rule((a_shape, b.shape, (tail[1],)), FusedLinearParams())
        except ShapeError:
            return bb
        if _expansion(a_shape, b.shape) == (bc.inputs[0].shape, bc.shape):
            return b
    return bb


def _recipe(a: Wild, b: Wild, bias: Wild) -> Tensor:
    return decompose([a, b, bias], FusedLinearParams())


def _build(m: Bound) -> Match | None:
    """b may be b expanded (views only), bias a broadcast [N]. The MatMul is guarded (fusing a product
    read elsewhere would compute it twice); the views of b and bias are free, and CSE often shares
    `BroadcastTo(w)` between projections. The fuse pass checks the match against the rules."""
    a, bb, bias = m.node("a"), m.node("b"), m.node("bias")
    if bias.shape != bb.shape[-1:]:
        return None
    return Match((a, _unexpand(bb, a.shape), bias), FusedLinearParams())


pattern = template_pattern(_recipe, build=_build, shapes={"a": (2, 3, 4), "b": (2, 4, 5), "bias": (5,)})


def _fold_reps(t: Tensor, b_shape: Shape) -> Tensor:
    """`[a-batch..., X, Y]` -> `[b-batch..., R·X, Y]`: the R repetitions sharing one b entry become rows.

    Then aᵀ @ g contracts over them inside one GEMM (one rounding, no separate reduction pass).
    """
    shapes = _expansion(t.shape, b_shape)
    if shapes is None:
        return t
    wide = shapes[1][:-2] + t.shape[-2:]
    lead = len(wide) - 2
    perm = (*range(0, lead, 2), *range(1, lead, 2), lead, lead + 1)
    rows = math.prod(wide[1:lead:2]) * t.shape[-2]
    return t.reshape(wide).permute(*perm).reshape(b_shape[:-2] + (rows, t.shape[-1]))


def vjp(inputs: list[Tensor], params: FusedLinearParams, out: Tensor, grad_out: Tensor
        ) -> list[Tensor | None]:
    """grad_a = g @ bᵀ, grad_b = aᵀ @ g summed over the batch entries sharing b, grad_bias = Σ g."""
    a, b, _bias = inputs
    g = grad_out
    k, n = b.shape[-2], b.shape[-1]
    rows = math.prod(a.shape[:-1])
    grad_a = g @ expand_b(b, a.shape).transpose(-2, -1)
    if b.ndim == 2:
        # One [K, rows] @ [rows, N] GEMM sums over every batch entry at once.
        grad_b = a.reshape(rows, k).transpose(-2, -1) @ g.reshape(rows, n)
    else:
        grad_b = _fold_reps(a, b.shape).transpose(-2, -1) @ _fold_reps(g, b.shape)
    grad_bias = g.reshape(rows, n).sum(0)
    return [grad_a, grad_b, grad_bias]


def fused_linear(a: TensorLike, b: TensorLike, bias: TensorLike) -> Tensor:
    """`a @ b + bias` in one kernel: a `[..., M, K]`, b `[K, N]` or `[..., K, N]`, bias `[N]`."""
    nodes = [as_tensor(a).node, as_tensor(b).node, as_tensor(bias).node]
    return Tensor(fused_node(FusedOps.FUSED_LINEAR, nodes, FusedLinearParams()))


ENTRY = FusedOpEntry(
    id=FusedOps.FUSED_LINEAR,
    name="FusedLinear",
    family=FusedOpFamily.FORWARD,
    params=FusedLinearParams,
    arity=(3,),
    shape_rule=shape_rule,
    dtype_rule=dtype_rule,
    decompose=decompose,
    # The inventory's metadata (the gradient is not another fused op); `vjp` below is exact.
    backward=NOT_DIFFERENTIABLE,
    vjp=vjp,
    pattern=pattern,
    output_views=None,
    destructive_input=None,
)
