"""QMatMul's many-row path on the spinning pool: each type's tile task (`gguf_kernels.GGUF[qt].tiles`)
dequantises its tiles of W rows (`gguf_dequant.dequant_tiles`: gguf-py's values bit for bit) into a scratch
slot and multiplies each (`weight_tiles`: fuel's tile kernel on AVX-512 and AVX2 hosts, one OpenBLAS sgemm
elsewhere)."""

from __future__ import annotations

import numpy as np

from fuel.cpu.quant.gguf_kernels import GGUF
from fuel.cpu.quant.weight_tiles import post_tiles
from fuel.quant import QuantType


def tiled(qt: QuantType, a2: np.ndarray, raw: np.ndarray, out: np.ndarray) -> bool:
    """out <- a2 @ dequant(W)ᵀ on the spinning pool (raw: uint8 [n, row bytes], C-contiguous); False where
    the tiles need OpenBLAS and there is no sgemm to call from jitted code."""
    return post_tiles(GGUF[qt].tiles, a2, raw.shape[0], out, (raw.ctypes.data, raw.shape[1]))
