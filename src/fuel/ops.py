"""One builder per registry entry, named as the entry in snake_case (`fuel.ops.softmax_last_dim`).

The builders live beside their entries in `fuel.graph.registry.<name>`; this module names each one
statically, so type checkers and editors see them. tests/test_ops.py checks the list against the
registry: every entry has its builder here, and nothing else is listed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

from fuel.graph.registry.causal_conv1d import causal_conv1d
from fuel.graph.registry.conv2d import conv2d
from fuel.graph.registry.conv_transpose2d import conv_transpose2d
from fuel.graph.registry.flash_attn import flash_attn
from fuel.graph.registry.flash_attn_backward_k import flash_attn_backward_k
from fuel.graph.registry.flash_attn_backward_q import flash_attn_backward_q
from fuel.graph.registry.flash_attn_backward_v import flash_attn_backward_v
from fuel.graph.registry.fused_linear import fused_linear
from fuel.graph.registry.fused_softmax_cross_entropy import fused_softmax_cross_entropy
from fuel.graph.registry.inplace_affine import inplace_affine
from fuel.graph.registry.layer_norm_last_dim import layer_norm_last_dim
from fuel.graph.registry.layer_norm_last_dim_backward import layer_norm_last_dim_backward
from fuel.graph.registry.nf4_matmul import nf4_matmul
from fuel.graph.registry.paged_attn import paged_attn
from fuel.graph.registry.powi_backward import powi_backward
from fuel.graph.registry.qmatmul import qmatmul
from fuel.graph.registry.reduce_max_to_backward import reduce_max_to_backward
from fuel.graph.registry.rms_norm_last_dim import rms_norm_last_dim
from fuel.graph.registry.rms_norm_last_dim_backward import rms_norm_last_dim_backward
from fuel.graph.registry.rope import rope
from fuel.graph.registry.selective_scan import selective_scan
from fuel.graph.registry.softmax_last_dim import softmax_last_dim
from fuel.graph.registry.softmax_last_dim_backward import softmax_last_dim_backward
from fuel.graph.registry.ssd_chunk_scan import ssd_chunk_scan

__all__ = [
    "causal_conv1d",
    "conv2d",
    "conv_transpose2d",
    "flash_attn",
    "flash_attn_backward_k",
    "flash_attn_backward_q",
    "flash_attn_backward_v",
    "fused_linear",
    "fused_softmax_cross_entropy",
    "inplace_affine",
    "layer_norm_last_dim",
    "layer_norm_last_dim_backward",
    "nf4_matmul",
    "paged_attn",
    "powi_backward",
    "qmatmul",
    "reduce_max_to_backward",
    "rms_norm_last_dim",
    "rms_norm_last_dim_backward",
    "rope",
    "selective_scan",
    "softmax_last_dim",
    "softmax_last_dim_backward",
    "ssd_chunk_scan",
]

if not TYPE_CHECKING:  # at run time only, so type checkers still flag a misspelt builder

    def __getattr__(name: str) -> NoReturn:
        raise AttributeError(f"fuel.ops has no builder {name!r}; entries: {', '.join(__all__)}")
