"""Dequantisers for the GGUF/ggml block types, bit-exact with gguf-py (and so with ggml's `to_float`).

`dequant_<type>(block, out)` decodes one block: `block` is the block's bytes (a C-contiguous uint8 1-D
array of `QuantType.block_bytes`), `out` receives its `block_elements` float32 values in ggml element
order (a C-contiguous float32 1-D array; neither length is checked). They are `inline="always"`, for a
caller's loop (a row dequantiser, a dot-product kernel) to compile them into its own body, and each
is a few vector instructions (see `gguf_kquants`, which also holds the K-quants). Each does gguf-py's
float32 operations in its order, one rounding each (`d * q`, `d * q + m`), with the fp16 scales
widened exactly (subnormals, inf and NaN included; NaN payloads as NumPy gives them).

`dequant_rows` and `dequant_tiles` are the templates of each type's tasks (`gguf_kernels`, generated):
rows of a weight into a caller's buffer (`gguf_blocks.dequantize_rows_into`), and tiles of W rows
multiplied as they are decoded (`gguf_tiles`). Each row is decoded by one part in one fixed order, so the
bytes never depend on the part count.

Q8_1 follows ggml's `block_q8_1` (f16 d, f16 s = d·Σq, 32 int8; value d * q), 36 bytes: gguf-py's
size table says 40 and cannot decode it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.quant.gguf_kquants import Emit, block_intrinsic, ir_q2k, ir_q3k, ir_q4k, ir_q5k, ir_q6k
from fuel.cpu.quant.gguf_kquants import f16_bytes as f16_bytes  # re-exported, for kernels reading scales
from fuel.cpu.quant.weight_tiles import each_tile, tile_args
from fuel.runtime import jobs
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import ADDRESS, INT, record_at


def _q4_0(e: Emit) -> None:
    """Q4_0 (18 bytes): f16 d, 16 bytes of nibbles (byte j: element j low, j + 16 high); d * (q - 8)."""
    d, qs = e.f16(0), e.bytes(2, 16)
    for nib in range(2):
        e.store(16 * nib, e.mul(d, e.f32(e.isub(e.bits(qs, 4 * nib, 15), 8))))


def _q4_1(e: Emit) -> None:
    """Q4_1 (20 bytes): f16 d, f16 m, 16 bytes of nibbles; d * q + m."""
    d, m, qs = e.f16(0), e.f16(2), e.bytes(4, 16)
    for nib in range(2):
        e.store(16 * nib, e.add_first_nan(e.mul(d, e.f32(e.bits(qs, 4 * nib, 15))), m))


def _q5_0(e: Emit) -> None:
    """Q5_0 (22 bytes): f16 d, u32 of high bits (bit j: element j), 16 bytes of nibbles; d * (q - 16)."""
    d, qh, qs = e.f16(0), e.word(2), e.bytes(6, 16)
    for nib in range(2):
        q = e.or_(e.bits(qs, 4 * nib, 15), e.shl(e.lane_bits(qh, 16 * nib, 16), 4))
        e.store(16 * nib, e.mul(d, e.f32(e.isub(q, 16))))


def _q5_1(e: Emit) -> None:
    """Q5_1 (24 bytes): f16 d, f16 m, u32 of high bits, 16 bytes of nibbles; d * q + m."""
    d, m, qh, qs = e.f16(0), e.f16(2), e.word(4), e.bytes(8, 16)
    for nib in range(2):
        q = e.or_(e.bits(qs, 4 * nib, 15), e.shl(e.lane_bits(qh, 16 * nib, 16), 4))
        e.store(16 * nib, e.add_first_nan(e.mul(d, e.f32(q)), m))


def _q8_0(e: Emit) -> None:
    """Q8_0 (34 bytes): f16 d, 32 int8; q * d."""
    e.store(0, e.mul(e.f32(e.bytes(2, 32, signed=True)), e.f16(0)))


def _q8_1(e: Emit) -> None:
    """Q8_1 (36 bytes, ggml's block_q8_1): f16 d, f16 s (= d·Σq, not needed here), 32 int8; d * q."""
    e.store(0, e.mul(e.f16(0), e.f32(e.bytes(4, 32, signed=True))))


_ir_q4_0, _ir_q4_1, _ir_q5_0, _ir_q5_1, _ir_q8_0, _ir_q8_1 = (
    block_intrinsic(f) for f in (_q4_0, _q4_1, _q5_0, _q5_1, _q8_0, _q8_1))


# The public decoders: plain jitted functions (callable from Python too) around the IR.


@njit(inline="always", cache=True)
def dequant_q4_0(block: Any, out: Any) -> None:
    _ir_q4_0(block, out)


@njit(inline="always", cache=True)
def dequant_q4_1(block: Any, out: Any) -> None:
    _ir_q4_1(block, out)


@njit(inline="always", cache=True)
def dequant_q5_0(block: Any, out: Any) -> None:
    _ir_q5_0(block, out)


@njit(inline="always", cache=True)
def dequant_q5_1(block: Any, out: Any) -> None:
    _ir_q5_1(block, out)


@njit(inline="always", cache=True)
def dequant_q8_0(block: Any, out: Any) -> None:
    _ir_q8_0(block, out)


@njit(inline="always", cache=True)
def dequant_q8_1(block: Any, out: Any) -> None:
    _ir_q8_1(block, out)


@njit(inline="always", cache=True)
def dequant_q2k(block: Any, out: Any) -> None:
    ir_q2k(block, out)


@njit(inline="always", cache=True)
def dequant_q3k(block: Any, out: Any) -> None:
    ir_q3k(block, out)


@njit(inline="always", cache=True)
def dequant_q4k(block: Any, out: Any) -> None:
    ir_q4k(block, out)


@njit(inline="always", cache=True)
def dequant_q5k(block: Any, out: Any) -> None:
    ir_q5k(block, out)


@njit(inline="always", cache=True)
def dequant_q6k(block: Any, out: Any) -> None:
    ir_q6k(block, out)


@njit(inline="always", cache=True)
def dequant_row(block_fn: Any, blk: int, bpb: int, src: Any, dst: Any) -> None:
    """Decode a row (or run of blocks): src (uint8, whole blocks of bpb bytes) by block_fn into dst
    (float32, blk values a block). Call it from jitted code naming a `dequant_*` global, e.g.
    `dequant_row(dequant_q4_0, 32, 18, src, dst)`: a cached kernel that takes the block function as
    an argument is never found again in Numba's cache (its type is keyed by the dispatcher's address)."""
    for b in range(src.shape[0] // bpb):
        block_fn(src[b * bpb:(b + 1) * bpb], dst[b * blk:(b + 1) * blk])


# ---- the templates of each type's row and tile tasks (`gguf_kernels`) ---------------------------------------

# Rows [row0, row0 + rows) of a weight's raw bytes raw [n, row_bytes] dequantised into out [rows, k].
ROWS_ARGS = jobs.record(raw=ADDRESS, n=INT, row_bytes=INT, row0=INT, rows=INT, k=INT, out=ADDRESS)


@njit(inline="always", cache=True)
def dequant_rows(block_fn: Any, blk: int, bpb: int, part: int, parts: int, argv: int) -> None:
    """Part `part` of a rows job (`ROWS_ARGS`): its share of the rows, each decoded by `dequant_row`."""
    v = record_at(argv, ROWS_ARGS)
    raw = carray(pointer(v.raw, np.uint8), (v.n, v.row_bytes))
    out = carray(pointer(v.out, np.float32), (v.rows, v.k))
    for r in range(part * v.rows // parts, (part + 1) * v.rows // parts):
        dequant_row(block_fn, blk, bpb, raw[v.row0 + r], out[r])


@njit(inline="always", cache=True)
def dequant_tiles(block_fn: Any, blk: int, bpb: int, part: int, parts: int, argv: int) -> None:
    """Part `part` of a tile job (`weight_tiles`): tiles of W rows claimed one at a time (`next_tile`, so the
    threads end at most a tile apart), each dequantised row by row into the part's scratch slot, then
    multiplied. W's own fields: its raw rows (`weight`) and their bytes
    (`weight_cols`)."""
    v = tile_args(argv)
    each_tile(v, _rows_of, block_fn, (carray(pointer(v.weight, np.uint8), (v.n, v.weight_cols)), blk, bpb))


@njit(inline="always", cache=True)
def _rows_of(tile: Any, r0: int, r1: int, block_fn: Any, state: Any) -> None:
    """tile row j <- W row r0 + j dequantised (state: the raw rows, a block's elements and bytes)."""
    raw, blk, bpb = state
    for r in range(r0, r1):
        dequant_row(block_fn, blk, bpb, raw[r], tile[r - r0])
