"""Quantized weight formats: the GGUF/ggml block types QMatMul reads, and NF4 (bitsandbytes).

`QuantType` names each GGUF block type with its ggml type id, the elements per block and the bytes per
block. A weight `W [n, k]` is stored as n rows of k/block_elements blocks, carried as little-endian
u32 words (so the byte count must be a multiple of 4).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from fuel.errors import ParamError


class QuantType(enum.Enum):
    """(ggml type id, elements per block, bytes per block) of each GGUF block type."""

    Q4_0 = (2, 32, 18)
    Q4_1 = (3, 32, 20)
    Q5_0 = (6, 32, 22)
    Q5_1 = (7, 32, 24)
    Q8_0 = (8, 32, 34)
    Q8_1 = (9, 32, 36)  # ggml's block_q8_1: f16 d, f16 s, 32 int8 (gguf-py's size table says 40)
    Q2K = (10, 256, 84)
    Q3K = (11, 256, 110)
    Q4K = (12, 256, 144)
    Q5K = (13, 256, 176)
    Q6K = (14, 256, 210)

    @property
    def ggml_type(self) -> int:
        return self.value[0]

    @property
    def block_elements(self) -> int:
        return self.value[1]

    @property
    def block_bytes(self) -> int:
        return self.value[2]

    @property
    def ggml_name(self) -> str:
        """The name GGUF tools use ("Q4_K" for Q4K)."""
        return self.name if "_" in self.name else f"{self.name[:2]}_K"

    @staticmethod
    def of(value: QuantType | str, op: str = "qmatmul") -> QuantType:
        """A QuantType from itself or a name: "Q4_0", "Q4_K" or "Q4K" (any case)."""
        if isinstance(value, QuantType):
            return value
        if isinstance(value, str):
            key = value.upper().replace("_K", "K")
            if key in QuantType.__members__:
                return QuantType[key]
        names = ", ".join(q.ggml_name for q in QuantType)
        raise ParamError(f"{op}: unknown quant type {value!r}; expected one of {names}")

    @staticmethod
    def from_ggml(type_id: int) -> QuantType | None:
        """The QuantType of a ggml type id, or None for a type QMatMul does not read."""
        return next((q for q in QuantType if q.ggml_type == type_id), None)


# The public helpers, as fuel.quant.*: NF4's, and the GGUF dequantisers. Those are kernels of fuel.cpu.quant
# (which import QuantType from here), loaded on first use so that `import fuel` loads no GGUF kernel module.
from fuel.quant.nf4 import NF4, nf4_dequantize, nf4_quantize  # noqa: E402

if TYPE_CHECKING:
    from fuel.cpu.quant.gguf_blocks import dequantize, dequantize_rows_into, weight_rows

_GGUF_HELPERS = ("dequantize", "dequantize_rows_into", "weight_rows")


def __getattr__(name: str) -> Any:
    if name in _GGUF_HELPERS:
        from fuel.cpu.quant import gguf_blocks

        return getattr(gguf_blocks, name)
    raise AttributeError(f"module 'fuel.quant' has no attribute {name!r}")

__all__ = ["NF4", "QuantType", "dequantize", "dequantize_rows_into", "nf4_dequantize", "nf4_quantize",
           "weight_rows"]
