"""The rules FlashAttnBackward Q, K and V (ids 22, 23, 24) share: inputs `[q, k, v, dO, (alibi)]` and the
forward's FlashAttnParams, k_len and mask included (upstream's backward aligns top-left and ignores
k_len; these follow the forward exactly). Each entry module holds one id; its gradient is the matching
piece of `gradients`, the primitive form that re-materialises the score matrix.

This module holds no entry itself: `entry(op_id)` and `builder(op_id)` make each entry module's.
The CPU kernel computes dQ, dK and dV in one pass over the recomputed softmax; the executor runs it
once for the three entries when they share their inputs.
"""

from __future__ import annotations

from collections.abc import Callable

from fuel.dtype import DType
from fuel.errors import ShapeError
from fuel.graph.functions import pad
from fuel.graph.node import DynScalar, Shape
from fuel.graph.registry import NOT_DIFFERENTIABLE, FusedOpEntry, FusedOpFamily, FusedOpId, FusedOps, fused_node
from fuel.graph.registry.flash_attn import (
    FlashAttnParams,
    attention_inputs,
    check_dtypes,
    check_shapes,
    make_params,
    materialise,
)
from fuel.graph.tensor import Tensor, TensorLike, as_tensor, matmul

NAMES = {FusedOps.FLASH_ATTN_BACKWARD_Q: "flash_attn_backward_q",
         FusedOps.FLASH_ATTN_BACKWARD_K: "flash_attn_backward_k",
         FusedOps.FLASH_ATTN_BACKWARD_V: "flash_attn_backward_v"}


def shape_rule_of(op_id: FusedOpId) -> object:
    op = NAMES[op_id]
    slot = {FusedOps.FLASH_ATTN_BACKWARD_Q: 0, FusedOps.FLASH_ATTN_BACKWARD_K: 1,
            FusedOps.FLASH_ATTN_BACKWARD_V: 2}[op_id]

    def shape_rule(shapes: tuple[Shape, ...], params: FlashAttnParams) -> Shape:
        if len(shapes) < 4:
            raise ShapeError(f"{op}: takes q, k, v, the upstream gradient and optional alibi")
        check_shapes(op, shapes[:3] + shapes[4:], params)
        if shapes[3] != shapes[0]:
            raise ShapeError(f"{op}: the upstream gradient {list(shapes[3])} must have q's shape {list(shapes[0])}")
        return shapes[slot]

    return shape_rule


def dtype_rule_of(op_id: FusedOpId) -> object:
    op = NAMES[op_id]

    def dtype_rule(dtypes: tuple[DType, ...], params: FlashAttnParams) -> DType:
        return check_dtypes(op, dtypes, ("k", "v", "the upstream gradient"))

    return dtype_rule


def _fold(x: Tensor, like: Tensor) -> Tensor:
    """Per-query-head gradients [B,Hq,kl,D] summed into their kv head, zero past kl: like's [B,Hkv,Sk,D]."""
    b, hq, kl, d = x.shape
    hkv, sk = like.shape[1], like.shape[2]
    if hq != hkv:
        x = x.reshape(b, hkv, hq // hkv, kl, d).sum(2)
    return x if kl == sk else pad(x, [(0, 0), (0, 0), (0, sk - kl), (0, 0)])


def gradients(inputs: list[Tensor], p: FlashAttnParams) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in primitives, through the materialised softmax."""
    q, k, v, do = inputs[:4]
    m = materialise(q, k, v, inputs[4] if len(inputs) == 5 else None, p)
    dp = matmul(do, m.v.transpose(-2, -1))
    ds = m.probs * (dp - (dp * m.probs).sum(-1, keepdim=True))
    if m.capped is not None:
        ds = ds * (1.0 - m.capped * m.capped)
    ds = ds * p.softmax_scale
    dq = matmul(ds, m.k)
    return dq, _fold(matmul(ds.transpose(-2, -1), q), k), _fold(matmul(m.probs.transpose(-2, -1), do), v)


def build(op_id: FusedOpId, inputs: list[Tensor], params: FlashAttnParams) -> Tensor:
    return Tensor(fused_node(op_id, [t.node for t in inputs], params))


def flash_attn_backward_grads(inputs: list[Tensor], params: FlashAttnParams, grad_out: Tensor
                              ) -> list[Tensor | None]:
    """FlashAttn's VJP: the three backward entries over [q, k, v, dO, (alibi)]; ALiBi slopes get none."""
    args = [*inputs[:3], grad_out, *inputs[3:]]
    grads: list[Tensor | None] = [build(i, args, params) for i in NAMES]
    return grads + [None] * (len(inputs) - 3)


def builder(op_id: FusedOpId) -> Callable[..., Tensor]:
    """The `fuel.ops` builder of one gradient entry (the forward's options, plus the upstream gradient)."""
    op = NAMES[op_id]

    def build_gradient(q: TensorLike, k: TensorLike, v: TensorLike, do: TensorLike,
                       softmax_scale: float | None = None, causal: bool = False,
                       window_size: tuple[int | None, int | None] = (None, None), softcap: float | None = None,
                       alibi: TensorLike | None = None, k_len: DynScalar | int | None = None) -> Tensor:
        inputs = attention_inputs(q, k, v, alibi)
        params = make_params(inputs[0], softmax_scale, causal, window_size, softcap, k_len, op)
        return build(op_id, [*inputs[:3], as_tensor(do), *inputs[3:]], params)

    build_gradient.__name__ = build_gradient.__qualname__ = op
    build_gradient.__doc__ = (f"d{op[-1]} of flash_attn(q, k, v, ...) for the upstream gradient `do` "
                              f"(the forward's options).")
    return build_gradient


def entry(op_id: FusedOpId, name: str) -> FusedOpEntry:
    slot = list(NAMES).index(op_id)

    def decompose(inputs: list[Tensor], params: FlashAttnParams) -> Tensor:
        return gradients(inputs, params)[slot]

    return FusedOpEntry(
        id=op_id,
        name=name,
        family=FusedOpFamily.ATTENTION,
        params=FlashAttnParams,
        arity=(4, 5),
        shape_rule=shape_rule_of(op_id),  # type: ignore[arg-type]
        dtype_rule=dtype_rule_of(op_id),  # type: ignore[arg-type]
        decompose=decompose,
        backward=NOT_DIFFERENTIABLE,
        vjp=None,
        pattern=None,
        no_pattern=("only FlashAttn's vjp emits it: naive attention is fused to FlashAttn before fl.grad "
                    "differentiates it, and the primitive VJPs of unfused attention differentiate the [S, S] "
                    "scores, which is not this lowering"),
        output_views=None,
        destructive_input=None,
    )
