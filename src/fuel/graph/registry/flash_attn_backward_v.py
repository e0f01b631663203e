"""FlashAttnBackwardV (id 24): dv of FlashAttn from [q, k, v, dO, (alibi)] and the forward's params.

The rules, the primitive form and the builder are shared by the three gradient entries
(`flash_attn_backward`); the CPU kernel computes all three at once.
"""

from __future__ import annotations

from fuel.graph.registry import FusedOps
from fuel.graph.registry.flash_attn_backward import builder, entry

OP_ID = FusedOps.FLASH_ATTN_BACKWARD_V

flash_attn_backward_v = builder(OP_ID)

ENTRY = entry(OP_ID, "FlashAttnBackwardV")
