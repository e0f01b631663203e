"""NF4 (bitsandbytes' 4-bit NormalFloat): the code table, quantisation and dequantisation in NumPy.

A weight `W [N, K]` is cut into blocks of `block_size` consecutive elements of each row (K must be a
multiple of the block size, so no block crosses a row). Each block keeps `absmax = max|w|` (f32) and,
per element, the index of the nearest entry of the 16-value table `NF4` to `w / absmax`, two indices
a byte with the even element in the HIGH nibble (bitsandbytes' order, so its weights load unchanged).
The value an index stands for is `NF4[code] * absmax`, rounded once to f32.

`nf4_quantize` reproduces `bitsandbytes.functional.quantize_4bit(w, blocksize=bs, quant_type="nf4")`
byte for byte (bitsandbytes 0.50.2, CPU): the scaled value `w * (1 / max(absmax, 1e-38))` clamped to
[-1, 1] in f32, then the index of the first table midpoint (computed in f32) it does not exceed, so a
value exactly on a midpoint takes the lower entry. bitsandbytes returns the bytes as `(N*K/2, 1)` and
absmax as `(N*K/bs,)`; here they are `[N, K/2]` and `[N, K/bs]`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fuel.errors import DTypeError, ParamError, ShapeError

# bitsandbytes' NF4 table (`bitsandbytes.functional.get_4bit_type("nf4")`), as f32.
NF4 = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], dtype=np.float32)
NF4.flags.writeable = False

# Midpoints between neighbouring entries, in f32 as bitsandbytes computes them.
_MIDPOINTS = (NF4[:-1] + NF4[1:]) / np.float32(2)
_TINY = np.float32(1e-38)  # bitsandbytes' clamp of absmax before taking its reciprocal


def check_block_size(op: str, k: int, block_size: Any) -> int:
    """block_size as an int: a positive even number that divides K (which must be even)."""
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise ParamError(f"{op}: block_size must be an int, got {block_size!r}")
    bs = int(block_size)
    if bs <= 0 or bs % 2:
        raise ParamError(f"{op}: block_size must be a positive even number, got {bs}")
    if k % 2:
        raise ShapeError(f"{op}: K must be even (two 4-bit codes a byte), got K={k}")
    if k % bs:
        raise ShapeError(f"{op}: K={k} is not a multiple of block_size {bs}")
    return bs


def nf4_quantize(w: np.ndarray, block_size: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """`(w_packed u8 [N, K/2], absmax f32 [N, K/block_size])` of a float weight `w [N, K]`.

    The same bytes and absmax as bitsandbytes' `quantize_4bit(..., quant_type="nf4")`; w is rounded to
    f32 first (as bitsandbytes does with `.float()`). A block of zeros has absmax 0 and codes 7 (0.0).
    """
    a = np.asarray(w)
    if a.ndim != 2:
        raise ShapeError(f"nf4_quantize: w must be [N, K], got {list(a.shape)}")
    if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
        raise DTypeError(f"nf4_quantize: w must be a float array, got {a.dtype}")
    n, k = a.shape
    bs = check_block_size("nf4_quantize", k, block_size)
    blocks = a.astype(np.float32).reshape(-1, bs)
    absmax = np.abs(blocks).max(axis=1) if blocks.size else np.zeros(0, np.float32)
    inv = np.float32(1) / np.maximum(absmax, _TINY)
    scaled = np.clip(blocks * inv[:, None], np.float32(-1), np.float32(1))
    codes = np.searchsorted(_MIDPOINTS, scaled.reshape(-1), side="left").astype(np.uint8)
    packed = (codes[0::2] << 4) | codes[1::2]
    return packed.reshape(n, k // 2), absmax.astype(np.float32).reshape(n, k // bs)


def nf4_codes(w_packed: np.ndarray) -> np.ndarray:
    """The 4-bit indices `[N, K]` (u8) of packed bytes `[N, K/2]`: even k from the high nibble."""
    p = np.asarray(w_packed, np.uint8)
    codes = np.empty(p.shape[:-1] + (2 * p.shape[-1],), np.uint8)
    codes[..., 0::2] = p >> 4
    codes[..., 1::2] = p & 15
    return codes


def nf4_dequantize(w_packed: np.ndarray, absmax: np.ndarray, block_size: int = 64) -> np.ndarray:
    """`NF4[code] * absmax` as f32 `[N, K]`: bitsandbytes' `dequantize_4bit` in f32, bit for bit."""
    p = np.asarray(w_packed)
    if p.dtype != np.uint8 or p.ndim != 2:
        raise DTypeError(f"nf4_dequantize: w_packed must be a u8 [N, K/2] array, got {p.dtype} {list(p.shape)}")
    n, k = p.shape[0], 2 * p.shape[1]
    bs = check_block_size("nf4_dequantize", k, block_size)
    am = np.asarray(absmax, np.float32)
    if am.shape != (n, k // bs):
        raise ShapeError(f"nf4_dequantize: absmax must be [{n}, {k // bs}], got {list(am.shape)}")
    values = NF4[nf4_codes(p)].reshape(n, k // bs, bs)
    return (values * am[:, :, None]).reshape(n, k)
