"""GGUF decode units for `gguf_gemv`: each type's 32 weights as codes, scales and offsets, in registers.

`_v_<type>(row, o, j, sc)` gives unit j of the block (32-element types: j = 0) or K-quant super-block (j
< 8) at byte o of the flat weight bytes `row`: the codes of its elements 0-15 and 16-31 as two 16-lane
vectors of exact small-integer floats (`simd16.codes`; `codes2` where the two halves' bytes are adjacent,
the integer work then one 32-byte pass: docs/performance/quant.md, "gguf_units"), their
scales s0, s1 and offsets b0, b1 (gguf-py's value of an element is code·s + b). `_p_<type>(row, o, sc)`
unpacks a K-quant super-block's scales into the 32-float scratch `sc` once per super-block. With j a
constant (the decode path unrolls a super-block's eight units) every shift is a constant too: a variable
one costs x86 a widening to 16-bit lanes and back.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from fuel.cpu.quant.gguf_gemv import pair_supers
from fuel.cpu.quant.nibble_tables import (
    CODES32_LANES,
    nibble_codes,
    nibble_codes32,
    nibble_lanes,
    nibble_values,
    pair_scales,
    value_table,
)
from fuel.cpu.simd.simd16 import (
    bytes16,
    codes,
    codes2,
    f16_at,
    fma,
    hi8,
    hsum,
    muls,
    muls2,
    u32_at,
    vload,
    vmul,
    vstore,
)

Z = np.float32(0)


_u32le = u32_at  # the little-endian word at a byte offset (hosts Numba targets are little-endian)


# Every f16's value, indexed by its bits: a 32-element block's f16 scale (and offset) is then one load, which a
# vector broadcast takes from memory, where F16C widens each per block (docs/performance/quant.md, "gguf_units").
F16_VALUES = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@njit(inline="always", cache=True)
def f16_value_at(row: Any, o: int) -> Any:
    """The f16 at row[o:o + 2], read as the word at o: the four bytes at o are in the block (every use is
    in a 32-element block's first 4 + 2 bytes)."""
    return F16_VALUES[u32_at(row, o) & 0xFFFF]


# ---- unit j of the block (or K-quant super-block) at byte o: (codes of elements 0-15, of 16-31, their scales s,
# offsets b) --------------------------------------------------------------------------------------------------
# gguf-py's value of an element is code * s + b (b = 0: no offset). `sc` holds the super-block's unpacked
# scales (K-quants, filled by the type's `_p_` function at each super-block's first unit).


@njit(inline="always", cache=True)
def unit_q4_0(row: Any, o: int, j: int, sc: Any) -> Any:
    d = f16_value_at(row, o)
    return codes(row, o + 2, 0, 15, 0, 0, 0, 0, 8, 0), codes(row, o + 2, 4, 15, 0, 0, 0, 0, 8, 0), d, d, Z, Z


# The table decoders (`simd16.nibble_codes`, AVX-512): the same codes, scales and offsets, the lanes in
# another order; `UNIT_ORDER_*[t]` is the element of lane t (t < 16: the first vector, else the second),
# the order the activations are permuted into for them (Q4_0 and Q4_1 share their code layout).
UNIT_ORDER_Q4_0 = np.array([half + b + 16 * h for half in (0, 8) for b, h in nibble_lanes()])
# Q4_K by unit pairs (`gguf_gemv._super_q4k_table`): of 64 activations, byte b's low nibble meets element
# b of the first unit, its high nibble element b of the second.
UNIT_ORDER_Q4K = np.array([half + b + 32 * h for half in (0, 8, 16, 24) for b, h in nibble_lanes()])


@njit(inline="always", cache=True)
def table_unit_q4_0(row: Any, o: int, j: int, sc: Any) -> Any:
    d = f16_value_at(row, o)
    return nibble_codes(row, o + 2, 8), nibble_codes(row, o + 10, 8), d, d, Z, Z


@njit(inline="always", cache=True)
def table_unit_q4_1(row: Any, o: int, j: int, sc: Any) -> Any:
    """The unit's values (kind VALUES): its 16 possible values formed once, then looked up."""
    t = value_table(f16_value_at(row, o), f16_value_at(row, o + 2))
    return nibble_values(row, o + 4, t), nibble_values(row, o + 12, t), Z, Z, Z, Z


# The byte-table decoder (`nibble_tables.nibble_codes32`, AVX2): a block's 32 codes from one lookup, lanes in
# `CODES32_LANES` order, the order the activations are permuted into for it. Q4_1 keeps the portable decoder:
# its scalar offset term per block made the lookup no faster (docs/performance/quant.md, "gguf_units").
BYTE_ORDER_Q4_0 = np.array(CODES32_LANES)


@njit(inline="always", cache=True)
def bytes_unit_q4_0(row: Any, o: int, j: int, sc: Any) -> Any:
    d = f16_value_at(row, o)
    q0, q1 = nibble_codes32(row, o + 2, 8)
    return q0, q1, d, d, Z, Z


@njit(inline="always", cache=True)
def unit_q4_1(row: Any, o: int, j: int, sc: Any) -> Any:
    d, m = f16_value_at(row, o), f16_value_at(row, o + 2)
    return codes(row, o + 4, 0, 15, 0, 0, 0, 0, 0, 0), codes(row, o + 4, 4, 15, 0, 0, 0, 0, 0, 0), d, d, m, m


@njit(inline="always", cache=True)
def unit_q5_0(row: Any, o: int, j: int, sc: Any) -> Any:
    d, qh = f16_value_at(row, o), _u32le(row, o + 2)
    return codes(row, o + 6, 0, 15, qh, 0, 0, 4, 16, 4), codes(row, o + 6, 4, 15, qh, 16, 0, 4, 16, 4), d, d, Z, Z


@njit(inline="always", cache=True)
def unit_q5_1(row: Any, o: int, j: int, sc: Any) -> Any:
    d, m, qh = f16_value_at(row, o), f16_value_at(row, o + 2), _u32le(row, o + 4)
    return codes(row, o + 8, 0, 15, qh, 0, 0, 4, 0, 4), codes(row, o + 8, 4, 15, qh, 16, 0, 4, 0, 4), d, d, m, m


@njit(inline="always", cache=True)
def unit_q8_0(row: Any, o: int, j: int, sc: Any) -> Any:
    d = f16_value_at(row, o)
    q0, q1 = codes2(row, o + 2, 0, 0, 0, 0, 0, 0, 0, 1)
    return q0, q1, d, d, Z, Z


@njit(inline="always", cache=True)
def unit_q8_1(row: Any, o: int, j: int, sc: Any) -> Any:
    d = f16_value_at(row, o)
    q0, q1 = codes2(row, o + 4, 0, 0, 0, 0, 0, 0, 0, 1)
    return q0, q1, d, d, Z, Z


@njit(inline="always", cache=True)
def prep_none(row: Any, o: int, sc: Any) -> None:
    """32-element block types have no super-block scales."""


@njit(inline="always", cache=True)
def prep_q2k(row: Any, o: int, sc: Any) -> None:
    """sc[i] = d * scale_i, sc[16 + i] = dmin * min_i for the 16-element groups i."""
    d, dmin = f16_at(row, o + 80), f16_at(row, o + 82)
    vstore(sc, 0, muls(codes(row, o, 0, 15, 0, 0, 0, 0, 0, 0), d))
    vstore(sc, 16, muls(codes(row, o, 4, 15, 0, 0, 0, 0, 0, 0), dmin))


@njit(inline="always", cache=True)
def unit_q2k(row: Any, o: int, j: int, sc: Any) -> Any:
    src, sh = o + 16 + 32 * (j >> 2), 2 * (j & 3)
    q0, q1 = codes2(row, src, sh, 3, 0, 0, 0, 0, 0, 0)
    return q0, q1, sc[2 * j], sc[2 * j + 1], -sc[16 + 2 * j], -sc[17 + 2 * j]


@njit(inline="always", cache=True)
def prep_q3k(row: Any, o: int, sc: Any) -> None:
    """sc[i] = d * (scale_i - 32): the 6-bit scales unpacked as ggml does (low nibbles, then 2 high bits)."""
    a0, a1, t = _u32le(row, o + 96), _u32le(row, o + 100), _u32le(row, o + 104)
    m1, m2 = 0x03030303, 0x0F0F0F0F
    v = bytes16((a0 & m2) | ((t & m1) << 4), (a1 & m2) | (((t >> 2) & m1) << 4),
                ((a0 >> 4) & m2) | (((t >> 4) & m1) << 4), ((a1 >> 4) & m2) | (((t >> 6) & m1) << 4), 32)
    vstore(sc, 0, muls(v, f16_at(row, o + 108)))


@njit(inline="always", cache=True)
def unit_q3k(row: Any, o: int, j: int, sc: Any) -> Any:
    h, sh = j >> 2, j & 3
    src = o + 32 + 32 * h
    q0, q1 = codes2(row, src, 2 * sh, 3, o, 4 * h + sh, 1, 2, 4, 2)
    return q0, q1, sc[2 * j], sc[2 * j + 1], Z, Z


@njit(inline="always", cache=True)
def prep_q45k(row: Any, o: int, sc: Any) -> None:
    """sc[j] = d * scale_j, sc[8 + j] = dmin * min_j for the 32-element sub-blocks j (Q4_K, Q5_K): the
    12 bytes of 6-bit values unpacked as ggml does."""
    a0, a1, a2 = _u32le(row, o + 4), _u32le(row, o + 8), _u32le(row, o + 12)
    m6, m4, m2 = 0x3F3F3F3F, 0x0F0F0F0F, 0x03030303
    v = bytes16(a0 & m6, (a2 & m4) | (((a0 >> 6) & m2) << 4), a1 & m6, ((a2 >> 4) & m4) | (((a1 >> 6) & m2) << 4), 0)
    vstore(sc, 0, muls2(v, f16_at(row, o), f16_at(row, o + 2)))


@njit(inline="always", cache=True)
def unit_q4k(row: Any, o: int, j: int, sc: Any) -> Any:
    src, sh = o + 16 + 32 * (j >> 1), 4 * (j & 1)
    q0, q1 = codes2(row, src, sh, 15, 0, 0, 0, 0, 0, 0)
    return q0, q1, sc[j], sc[j], -sc[8 + j], -sc[8 + j]


@njit(inline="always", cache=True)
def unit_q5k(row: Any, o: int, j: int, sc: Any) -> Any:
    src, sh = o + 48 + 32 * (j >> 1), 4 * (j & 1)
    q0, q1 = codes2(row, src, sh, 15, o + 16, j, 1, 4, 0, 2)
    return q0, q1, sc[j], sc[j], -sc[8 + j], -sc[8 + j]


@njit(inline="always", cache=True)
def prep_q6k(row: Any, o: int, sc: Any) -> None:
    """sc[i] = d * scale_i (int8 scales) for the 16-element groups i."""
    vstore(sc, 0, muls(codes(row, o + 192, 0, 0, 0, 0, 0, 0, 0, 1), f16_at(row, o + 208)))


@njit(inline="always", cache=True)
def unit_q6k(row: Any, o: int, j: int, sc: Any) -> Any:
    h, sh = j >> 2, j & 3
    lo, hi = o + 64 * h + 32 * (sh & 1), o + 128 + 32 * h
    q0, q1 = codes2(row, lo, 4 * (sh >> 1), 15, hi, 2 * sh, 3, 4, 32, 2)
    return q0, q1, sc[2 * j], sc[2 * j + 1], Z, Z


# ---- Q4_K by table, a unit pair at a time (the form of `gguf_gemv.kpair`) ----------------------------------


@njit(inline="always", cache=True)
def _super_q4k_table(vals: Any, kind: int, prep: Any, row: Any, o: int, sc: Any, x: Any, xo: int, acc: Any, mv: Any,
                     sx: Any, so: int) -> Any:
    """`_super` for Q4_K by table (`nibble_tables.nibble_codes`): its unit pairs 2p, 2p + 1 (the low and high
    nibbles of the same 32 bytes) as four 16-lane vectors, each lane scaled by its unit's scale; x holds
    each 64 activations in `UNIT_ORDER_Q4K` order."""
    prep(row, o, sc)
    for p in range(4):
        src, xp = o + 16 + 32 * p, xo + 64 * p
        inner = vmul(nibble_codes(row, src, 0), vload(x, xp))
        inner = fma(nibble_codes(row, src + 8, 0), vload(x, xp + 16), inner)
        inner = fma(nibble_codes(row, src + 16, 0), vload(x, xp + 32), inner)
        inner = fma(nibble_codes(row, src + 24, 0), vload(x, xp + 48), inner)
        acc = fma(pair_scales(sc, 2 * p), inner, acc)
    return acc, fma(hi8(vload(sc, 0)), vload(sx, so), mv)


@njit(inline="always", cache=True)
def kpair_q4k_table(vals: Any, prep: Any, bpb: int, kind: int, row: Any, rb: int, rb1: int, x: Any, k: int,
                    sx: Any, sc: Any, sc1: Any, ahead: int) -> tuple[Any, Any]:
    """`gguf_gemv.kpair` for Q4_K by table (vals and kind unused: the decoding is `_super_q4k_table`'s)."""
    a0, m0, a1, m1 = pair_supers(_super_q4k_table, vals, kind, prep, bpb, row, rb, rb1, x, k, sx, sc, sc1, ahead)
    return hsum(a0) - hsum(m0), hsum(a1) - hsum(m1)
