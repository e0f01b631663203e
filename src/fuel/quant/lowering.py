"""GGUF block dequantisation written with primitives: QMatMul's lowering (`dequantize`), bit for bit
with `gguf.quants.dequantize` for every `QuantType`.

The u32 word stream is read as bytes (BITCAST), cut into `[blocks, block_bytes]` and each block's
fields sliced out. Every layout is made of the same few pieces, so each type is one row of `LAYOUTS`:
- a *plane*: `bits`-bit integers packed low bits first, 8/bits to a byte, in runs of `run` bytes (byte
  j of a run holds value j of each of its 8/bits sub-runs): `(bytes >> [0, bits, ...]) & mask`;
- an *integer field*: `low + (high << low.bits) - bias` from a low and an optional high plane, or a
  signed byte (`b − 256·(b >> 7)`);
- f16 scales (BITCAST to f16, CAST to f32), one per block (`d`, `m`/`dmin`), and per sub-block
  integer scales and mins, which for Q4_K and Q5_K are 6-bit values packed across 12 bytes.
The integers are exact in f32, so they are combined there; then the float arithmetic of gguf-py in its
order (`d·q`, `d·q + m`, `(d·sc)·q − dmin·m`), each operation one f32 rounding as NumPy's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fuel.dtype import DType
from fuel.graph.functions import concat
from fuel.graph.tensor import Tensor, tensor
from fuel.quant import QuantType


@dataclass(frozen=True)
class Plane:
    """`nbytes` bytes from `offset` holding `bits`-bit values in runs of `run` bytes."""

    offset: int
    nbytes: int
    bits: int
    run: int


@dataclass(frozen=True)
class Ints:
    """Integers `low + (high << low.bits) - bias`, or signed bytes (`low` of 8 bits read as int8)."""

    low: Plane
    high: Plane | None = None
    bias: int = 0
    signed: bool = False


@dataclass(frozen=True)
class Layout:
    """One block type: its f16 scale `d`, its quants `q`, and how they combine.

    `m`: an f16 min added to every value (`d·q + m`). `sub`: sub-blocks with their own integer scale
    (`scales`), giving `(d·sc)·q`, less `dmin·mn` where there is an f16 `dmin` (the mins follow the
    scales in the same field; `scale_min_k4` marks Q4_K's and Q5_K's 12-byte 6-bit packing of both)."""

    d: int
    q: Ints
    m: int | None = None
    sub: int = 1
    scales: Ints | None = None
    dmin: int | None = None
    scale_min_k4: bool = False


def _nibbles(offset: int, nbytes: int, run: int) -> Plane:
    return Plane(offset, nbytes, 4, run)


_K4_SCALES = Ints(Plane(4, 12, 8, 12))  # Q4_K and Q5_K: decoded by _scale_min_k4
LAYOUTS: dict[QuantType, Layout] = {
    QuantType.Q4_0: Layout(d=0, q=Ints(_nibbles(2, 16, 16), bias=8)),
    QuantType.Q4_1: Layout(d=0, m=2, q=Ints(_nibbles(4, 16, 16))),
    QuantType.Q5_0: Layout(d=0, q=Ints(_nibbles(6, 16, 16), Plane(2, 4, 1, 1), bias=16)),
    QuantType.Q5_1: Layout(d=0, m=2, q=Ints(_nibbles(8, 16, 16), Plane(4, 4, 1, 1))),
    QuantType.Q8_0: Layout(d=0, q=Ints(Plane(2, 32, 8, 32), signed=True)),
    QuantType.Q8_1: Layout(d=0, q=Ints(Plane(4, 32, 8, 32), signed=True)),  # the sum s (bytes 2:4) unused
    QuantType.Q2K: Layout(d=80, dmin=82, sub=16, q=Ints(Plane(16, 64, 2, 32)),
                          scales=Ints(_nibbles(0, 16, 16))),  # 16 scales, then 16 mins
    QuantType.Q3K: Layout(d=108, sub=16, q=Ints(Plane(32, 64, 2, 32), Plane(0, 32, 1, 32), bias=4),
                          scales=Ints(_nibbles(96, 8, 8), Plane(104, 4, 2, 4), bias=32)),
    QuantType.Q4K: Layout(d=0, dmin=2, sub=8, q=Ints(_nibbles(16, 128, 32)), scales=_K4_SCALES,
                          scale_min_k4=True),
    QuantType.Q5K: Layout(d=0, dmin=2, sub=8, q=Ints(_nibbles(48, 128, 32), Plane(16, 32, 1, 32)),
                          scales=_K4_SCALES, scale_min_k4=True),
    QuantType.Q6K: Layout(d=208, sub=16, q=Ints(_nibbles(0, 128, 64), Plane(128, 64, 2, 32), bias=32),
                          scales=Ints(Plane(192, 16, 8, 16), signed=True)),
}


def _const(values: list[int], shape: tuple[int, ...]) -> Tensor:
    return tensor(np.array(values, np.uint8).reshape(shape), const=True)


def _field(blocks: Tensor, offset: int, nbytes: int) -> Tensor:
    return blocks[:, offset:offset + nbytes]


def plane(blocks: Tensor, p: Plane) -> Tensor:
    """The plane's values, u8 `[blocks, nbytes·8/bits]`, in gguf-py's order."""
    nb = blocks.shape[0]
    raw = _field(blocks, p.offset, p.nbytes)
    if p.bits == 8:
        return raw
    per = 8 // p.bits
    shifts = _const(list(range(0, 8, p.bits)), (1, 1, per, 1))
    runs = raw.reshape(nb, p.nbytes // p.run, 1, p.run)
    return ((runs >> shifts) & ((1 << p.bits) - 1)).reshape(nb, p.nbytes * per)


def ints(blocks: Tensor, f: Ints) -> Tensor:
    """The field's integers as exact f32 values `[blocks, count]`."""
    low = plane(blocks, f.low)
    v = low.cast(DType.F32)
    if f.signed:
        return v - (low >> 7).cast(DType.F32) * 256.0
    if f.high is not None:
        v = v + plane(blocks, f.high).cast(DType.F32) * float(1 << f.low.bits)
    return v - float(f.bias) if f.bias else v


def _f16(blocks: Tensor, offset: int) -> Tensor:
    """The f16 at `offset` of each block as f32 `[blocks, 1]`."""
    return _field(blocks, offset, 2).bitcast(DType.F16).cast(DType.F32)


def _scale_min_k4(blocks: Tensor, offset: int) -> tuple[Tensor, Tensor]:
    """Q4_K/Q5_K's 8 scales and 8 mins (6 bits each) from 12 bytes: `d = b[0:4]`, `m = b[4:8]`,
    `md = b[8:12]`; scales `[d & 63, (md & 15) | ((d >> 2) & 48)]`, mins `[m & 63, (md >> 4) | ((m >> 2) & 48)]`."""
    d, m, md = (_field(blocks, offset + 4 * i, 4) for i in range(3))

    def f(x: Tensor) -> Tensor:
        return x.cast(DType.F32)

    sc = concat([f(d & 63), f(md & 15) + f((d >> 2) & 48)], -1)
    mn = concat([f(m & 63), f(md >> 4) + f((m >> 2) & 48)], -1)
    return sc, mn


def dequantize_blocks(blocks: Tensor, qt: QuantType) -> Tensor:
    """f32 `[blocks, block_elements]` from u8 `[blocks, block_bytes]` of type qt."""
    lay = LAYOUTS[qt]
    nb, n_el = blocks.shape[0], qt.block_elements
    d = _f16(blocks, lay.d)
    q = ints(blocks, lay.q)
    if lay.scales is None:
        out = d * q
        return out + _f16(blocks, lay.m) if lay.m is not None else out
    if lay.scale_min_k4:
        sc, mn = _scale_min_k4(blocks, lay.scales.low.offset)
    elif lay.dmin is not None:  # Q2_K: the low nibbles scale, the high ones are the mins
        both = ints(blocks, lay.scales)
        sc, mn = both[:, :lay.sub], both[:, lay.sub:]
    else:
        sc, mn = ints(blocks, lay.scales), None
    per = q.reshape(nb, lay.sub, n_el // lay.sub)
    out = (d * sc).reshape(nb, lay.sub, 1) * per
    if mn is not None and lay.dmin is not None:
        out = out - (_f16(blocks, lay.dmin) * mn).reshape(nb, lay.sub, 1)
    return out.reshape(nb, n_el)


def dequantize(w_q: Tensor, qt: QuantType, n: int, k: int) -> Tensor:
    """W f32 `[n, k]` from QMatMul's u32 word stream (its padding past the blocks ignored)."""
    blk = qt.block_elements
    nblocks = n * (k // blk)
    if nblocks == 0:
        return tensor(np.zeros((n, k), np.float32), const=True)
    raw = w_q.bitcast(DType.U8)[:nblocks * qt.block_bytes]
    return dequantize_blocks(raw.reshape(nblocks, qt.block_bytes), qt).reshape(n, k)
