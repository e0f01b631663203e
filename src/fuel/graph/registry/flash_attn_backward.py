"""The rules FlashAttnBackward Q, K and V (ids 22, 23, 24) share: inputs `[q, k, v, dO, (alibi)]` and the
forward's FlashAttnParams, k_len and mask included (upstream's backward aligns top-left and ignores
k_len; these follow the forward exactly). Each entry module holds one id; its gradient is the matching
piece of `gradients`, the primitive form that re-materialises the score matrix.

This module holds no entry. The CPU kernel computes dQ, dK and dV in one pass over the recomputed
softmax; the executor runs it once for the three entries when they share their inputs.
"""

from __future__ import annotations

from fuel.dtype import DType
from fuel.errors import ShapeError
from fuel.graph.node import Shape
from fuel.graph.registry import FusedOpId, FusedOps, fused_node
from fuel.graph.registry.flash_attn import FlashAttnParams, check_dtypes, check_shapes, materialise
from fuel.graph.tensor import Tensor, matmul, pad

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
