"""Dequantisers for the GGUF/ggml block types, bit-exact with gguf-py (and so with ggml's `to_float`).

`dequant_<type>(block, out)` decodes one block: `block` is the block's bytes (a C-contiguous uint8 1-D
array of `QuantType.block_bytes`), `out` receives its `block_elements` float32 values in ggml element
order (a C-contiguous float32 1-D array; neither length is checked). They are `inline="always"`, for a
caller's loop (a row dequantiser, a dot-product kernel) to compile them into its own body, and each
is a few vector instructions (see `gguf_kquants`, which also holds the K-quants). Each does gguf-py's
float32 operations in its order, one rounding each (`d * q`, `d * q + m`), with the fp16 scales
widened exactly (subnormals, inf and NaN included; NaN payloads as NumPy gives them).

`dequantize` turns a whole weight's bytes into float32 `[n, k]`; `dequantize_rows_into` writes a range
of rows into a caller's buffer (no allocation). Both run one Numba kernel per type with rows in
parallel, each row written by one thread in one fixed order (bit-stable at any thread count).

Q8_1 follows ggml's `block_q8_1` (f16 d, f16 s = d·Σq, 32 int8; value d * q), 36 bytes: gguf-py's
size table says 40 and cannot decode it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

from fuel.cpu.quant.gguf_kquants import Emit, block_intrinsic, ir_q2k, ir_q3k, ir_q4k, ir_q5k, ir_q6k
from fuel.cpu.quant.gguf_kquants import f16_bytes as f16_bytes  # re-exported, for kernels reading scales
from fuel.cpu.simd.driver import row_kernel
from fuel.errors import ShapeError
from fuel.quant import QuantType


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


DEQUANT_BLOCK: dict[QuantType, Any] = {
    QuantType.Q4_0: dequant_q4_0,
    QuantType.Q4_1: dequant_q4_1,
    QuantType.Q5_0: dequant_q5_0,
    QuantType.Q5_1: dequant_q5_1,
    QuantType.Q8_0: dequant_q8_0,
    QuantType.Q8_1: dequant_q8_1,
    QuantType.Q2K: dequant_q2k,
    QuantType.Q3K: dequant_q3k,
    QuantType.Q4K: dequant_q4k,
    QuantType.Q5K: dequant_q5k,
    QuantType.Q6K: dequant_q6k,
}


@njit(inline="always", cache=True)
def dequant_row(block_fn: Any, blk: int, bpb: int, src: Any, dst: Any) -> None:
    """Decode a row (or run of blocks): src (uint8, whole blocks of bpb bytes) by block_fn into dst
    (float32, blk values a block). Call it from jitted code naming a `dequant_*` global, e.g.
    `dequant_row(dequant_q4_0, 32, 18, src, dst)`: a cached kernel that takes the block function as
    an argument is never found again in Numba's cache (its type is keyed by the dispatcher's address)."""
    for b in range(src.shape[0] // bpb):
        block_fn(src[b * bpb:(b + 1) * bpb], dst[b * blk:(b + 1) * blk])


# One parallel kernel per type, named for Numba's cache (closures made by a factory are never found
# again in it): rows [row0, row1) of raw (uint8 [n, row bytes]) into out[:row1 - row0].


@row_kernel()
def _rows_q4_0(raw: Any, row0: int, row1: int, out: Any) -> None:
    for r in prange(row1 - row0):
        dequant_row(dequant_q4_0, 32, 18, raw[row0 + r], out[r])


@row_kernel()
def _rows_q4_1(raw: Any, row0: int, row1: int, out: Any) -> None:
    for r in prange(row1 - row0):
        dequant_row(dequant_q4_1, 32, 20, raw[row0 + r], out[r])


@row_kernel()
def _rows_q5_0(raw: Any, row0: int, row1: int, out: Any) -> None:
    for r in prange(row1 - row0):
        dequant_row(dequant_q5_0, 32, 22, raw[row0 + r], out[r])


@row_kernel()
def _rows_q5_1(raw: Any, row0: int, row1: int, out: Any) -> None:
    for r in prange(row1 - row0):
        dequant_row(dequant_q5_1, 32, 24, raw[row0 + r], out[r])


@row_kernel()
def _rows_q8_0(raw: Any, row0: int, row1: int, out: Any) -> None:
    for r in prange(row1 - row0):
        dequant_row(dequant_q8_0, 32, 34, raw[row0 + r], out[r])


@row_kernel()
def _rows_q8_1(raw: Any, row0: int, row1: int, out: Any) -> None:
    for r in prange(row1 - row0):
        dequant_row(dequant_q8_1, 32, 36, raw[row0 + r], out[r])


@row_kernel()
def _rows_q2k(raw: Any, row0: int, row1: int, out: Any) -> None:
    for r in prange(row1 - row0):
        dequant_row(dequant_q2k, 256, 84, raw[row0 + r], out[r])


@row_kernel()
def _rows_q3k(raw: Any, row0: int, row1: int, out: Any) -> None:
    for r in prange(row1 - row0):
        dequant_row(dequant_q3k, 256, 110, raw[row0 + r], out[r])


@row_kernel()
def _rows_q4k(raw: Any, row0: int, row1: int, out: Any) -> None:
    for r in prange(row1 - row0):
        dequant_row(dequant_q4k, 256, 144, raw[row0 + r], out[r])


@row_kernel()
def _rows_q5k(raw: Any, row0: int, row1: int, out: Any) -> None:
    for r in prange(row1 - row0):
        dequant_row(dequant_q5k, 256, 176, raw[row0 + r], out[r])


@row_kernel()
def _rows_q6k(raw: Any, row0: int, row1: int, out: Any) -> None:
    for r in prange(row1 - row0):
        dequant_row(dequant_q6k, 256, 210, raw[row0 + r], out[r])


_ROWS: dict[QuantType, Any] = {
    QuantType.Q4_0: _rows_q4_0,
    QuantType.Q4_1: _rows_q4_1,
    QuantType.Q5_0: _rows_q5_0,
    QuantType.Q5_1: _rows_q5_1,
    QuantType.Q8_0: _rows_q8_0,
    QuantType.Q8_1: _rows_q8_1,
    QuantType.Q2K: _rows_q2k,
    QuantType.Q3K: _rows_q3k,
    QuantType.Q4K: _rows_q4k,
    QuantType.Q5K: _rows_q5k,
    QuantType.Q6K: _rows_q6k,
}


def _as_rows(raw: np.ndarray, qt: QuantType, n: int, k: int, op: str) -> np.ndarray:
    """raw's bytes as uint8 [n, k / block_elements * block_bytes], checked."""
    if n < 0 or k < 0 or k % qt.block_elements:
        raise ShapeError(f"{op}: {qt.ggml_name} needs k a multiple of {qt.block_elements}, got {k}")
    row_bytes = k // qt.block_elements * qt.block_bytes
    if not raw.flags.c_contiguous:
        raise ShapeError(f"{op}: the {qt.ggml_name} weight bytes must be C-contiguous")
    u8 = raw.reshape(-1).view(np.uint8)
    if u8.size != n * row_bytes:
        raise ShapeError(f"{op}: a [{n}, {k}] {qt.ggml_name} weight is {n * row_bytes} bytes "
                         f"({n} rows of {k // qt.block_elements} blocks of {qt.block_bytes}), got {u8.size}")
    return u8.reshape(n, row_bytes)


def dequantize(raw: np.ndarray, qt: QuantType, n: int, k: int) -> np.ndarray:
    """The float32 [n, k] values of a weight stored as n rows of k / block_elements blocks of type qt
    (raw: its bytes, as uint8 or any dtype viewed as bytes, C-contiguous)."""
    rows = _as_rows(raw, qt, n, k, "dequantize")
    out = np.empty((n, k), np.float32)
    if n and k:
        _ROWS[qt](rows, 0, n, out)
    return out


def dequantize_rows_into(raw: np.ndarray, qt: QuantType, row0: int, row1: int, out: np.ndarray) -> None:
    """Dequantise rows [row0, row1) of a weight into out[:row1 - row0], allocating nothing: raw is the
    weight's bytes as C-contiguous uint8 [n, row bytes] (`weight_rows` makes it once), out a
    C-contiguous float32 [>= row1 - row0, k] buffer the caller reuses (rows past row1 - row0 untouched)."""
    op = "dequantize_rows_into"
    if raw.dtype != np.uint8 or raw.ndim != 2 or not raw.flags.c_contiguous or raw.shape[1] % qt.block_bytes:
        raise ShapeError(f"{op}: raw must be C-contiguous uint8 [n, whole {qt.ggml_name} blocks of "
                         f"{qt.block_bytes} bytes], got {raw.dtype} {list(raw.shape)}")
    n, k = raw.shape[0], raw.shape[1] // qt.block_bytes * qt.block_elements
    if not 0 <= row0 <= row1 <= n:
        raise ShapeError(f"{op}: rows [{row0}, {row1}) outside a weight of {n} rows")
    if (out.dtype != np.float32 or out.ndim != 2 or not out.flags.c_contiguous or out.shape[0] < row1 - row0
            or out.shape[1] != k):
        raise ShapeError(f"{op}: out must be C-contiguous float32 [>= {row1 - row0}, {k}], got "
                         f"{out.dtype} {list(out.shape)}")
    if row1 > row0 and k:
        _ROWS[qt](raw, row0, row1, out)


def weight_rows(raw: np.ndarray, qt: QuantType, n: int, k: int) -> np.ndarray:
    """raw's bytes as the uint8 [n, row bytes] array `dequantize_rows_into` reads (a view; checked)."""
    return _as_rows(raw, qt, n, k, "weight_rows")
