"""FlashAttnBackwardV (id 24): dv of FlashAttn from [q, k, v, dO, (alibi)] and the forward's params.

The shared rules and the primitive form are in `flash_attn_backward`.
"""

from __future__ import annotations

from fuel.graph.node import DynScalar
from fuel.graph.registry import NOT_DIFFERENTIABLE, FusedOpEntry, FusedOpFamily, FusedOps
from fuel.graph.registry.flash_attn import FlashAttnParams, attention_inputs, make_params
from fuel.graph.registry.flash_attn_backward import build, dtype_rule_of, gradients, shape_rule_of
from fuel.graph.tensor import Tensor, TensorLike, as_tensor

OP_ID = FusedOps.FLASH_ATTN_BACKWARD_V


def decompose(inputs: list[Tensor], params: FlashAttnParams) -> Tensor:
    return gradients(inputs, params)[2]


def flash_attn_backward_v(q: TensorLike, k: TensorLike, v: TensorLike, do: TensorLike,
                          softmax_scale: float | None = None, causal: bool = False,
                          window_size: tuple[int | None, int | None] = (None, None), softcap: float | None = None,
                          alibi: TensorLike | None = None, k_len: DynScalar | int | None = None) -> Tensor:
    """dv of flash_attn(q, k, v, ...) for the upstream gradient `do` (same options as the forward)."""
    inputs = attention_inputs(q, k, v, alibi)
    params = make_params(inputs[0], softmax_scale, causal, window_size, softcap, k_len, "flash_attn_backward_v")
    return build(OP_ID, [*inputs[:3], as_tensor(do), *inputs[3:]], params)


ENTRY = FusedOpEntry(
    id=OP_ID,
    name="FlashAttnBackwardV",
    family=FusedOpFamily.ATTENTION,
    params=FlashAttnParams,
    arity=(4, 5),
    shape_rule=shape_rule_of(OP_ID),  # type: ignore[arg-type]
    dtype_rule=dtype_rule_of(OP_ID),  # type: ignore[arg-type]
    decompose=decompose,
    backward=NOT_DIFFERENTIABLE,
    vjp=None,
    pattern=None,
    output_views=None,
    destructive_input=None,
)
