"""QMatMul's many-row path as tasks of the spinning pool, one per GGUF type (named, so that Numba's cache
finds them again): each part dequantises its tiles of W rows (`gguf_blocks`' block decoders, gguf-py's
values bit for bit) into a scratch slot and multiplies each (`weight_tiles`: fuel's tile kernel on AVX-512
and AVX2 hosts, one OpenBLAS sgemm elsewhere)."""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.quant.gguf_blocks import (
    dequant_q2k,
    dequant_q3k,
    dequant_q4_0,
    dequant_q4_1,
    dequant_q4k,
    dequant_q5_0,
    dequant_q5_1,
    dequant_q5k,
    dequant_q6k,
    dequant_q8_0,
    dequant_q8_1,
    dequant_row,
)
from fuel.cpu.quant.weight_tiles import (
    WEIGHT,
    N,
    claim_slot,
    job,
    multiply_tile,
    part_tiles,
    post_tiles,
    release_slot,
    tile_of,
    tile_span,
)
from fuel.quant import QuantType
from fuel.runtime import pool
from fuel.runtime.atomics import pointer


@njit(inline="always", cache=True)
def _tiles(block_fn: Any, blk: int, bpb: int, part: int, parts: int, argv: int) -> None:
    """Part `part` of the job at argv: its tiles, each dequantised row by row, then multiplied."""
    v = job(argv)
    fields = carray(pointer(argv, np.int64), (WEIGHT + 2,))  # W's own: its bytes' address, row bytes
    raw = carray(pointer(fields[WEIGHT], np.uint8), (v[N], fields[WEIGHT + 1]))
    slot = claim_slot(v)
    tile = tile_of(v, slot)
    i0, i1 = part_tiles(v, part, parts)
    for i in range(i0, i1):
        r0, r1 = tile_span(v, i)
        for r in range(r0, r1):
            dequant_row(block_fn, blk, bpb, raw[r], tile[r - r0])
        multiply_tile(v, slot, r0, r1)
    release_slot(v, slot)


@pool.task()
def _q4_0(part: int, parts: int, argv: int) -> None:
    _tiles(dequant_q4_0, 32, 18, part, parts, argv)


@pool.task()
def _q4_1(part: int, parts: int, argv: int) -> None:
    _tiles(dequant_q4_1, 32, 20, part, parts, argv)


@pool.task()
def _q5_0(part: int, parts: int, argv: int) -> None:
    _tiles(dequant_q5_0, 32, 22, part, parts, argv)


@pool.task()
def _q5_1(part: int, parts: int, argv: int) -> None:
    _tiles(dequant_q5_1, 32, 24, part, parts, argv)


@pool.task()
def _q8_0(part: int, parts: int, argv: int) -> None:
    _tiles(dequant_q8_0, 32, 34, part, parts, argv)


@pool.task()
def _q8_1(part: int, parts: int, argv: int) -> None:
    _tiles(dequant_q8_1, 32, 36, part, parts, argv)


@pool.task()
def _q2k(part: int, parts: int, argv: int) -> None:
    _tiles(dequant_q2k, 256, 84, part, parts, argv)


@pool.task()
def _q3k(part: int, parts: int, argv: int) -> None:
    _tiles(dequant_q3k, 256, 110, part, parts, argv)


@pool.task()
def _q4k(part: int, parts: int, argv: int) -> None:
    _tiles(dequant_q4k, 256, 144, part, parts, argv)


@pool.task()
def _q5k(part: int, parts: int, argv: int) -> None:
    _tiles(dequant_q5k, 256, 176, part, parts, argv)


@pool.task()
def _q6k(part: int, parts: int, argv: int) -> None:
    _tiles(dequant_q6k, 256, 210, part, parts, argv)


TASKS: dict[QuantType, pool.Task] = {
    QuantType.Q4_0: _q4_0, QuantType.Q4_1: _q4_1, QuantType.Q5_0: _q5_0, QuantType.Q5_1: _q5_1,
    QuantType.Q8_0: _q8_0, QuantType.Q8_1: _q8_1, QuantType.Q2K: _q2k, QuantType.Q3K: _q3k,
    QuantType.Q4K: _q4k, QuantType.Q5K: _q5k, QuantType.Q6K: _q6k,
}


def tiled(qt: QuantType, a2: np.ndarray, raw: np.ndarray, out: np.ndarray) -> bool:
    """out <- a2 @ dequant(W)ᵀ on the spinning pool (raw: uint8 [n, row bytes], C-contiguous); False where
    the tiles need OpenBLAS and there is no sgemm to call from jitted code."""
    return post_tiles(TASKS[qt], a2, raw.shape[0], out, (raw.ctypes.data, raw.shape[1]))
