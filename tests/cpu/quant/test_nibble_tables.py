"""`nibble_tables.lookup32` and `lookup64` (Nf4Matmul's code lookups on AVX2 hosts: byte shuffles) and
`nibble_codes32` (Q4_0's on AVX2 hosts) against NumPy's indexing, for every lane order Nf4Matmul
asks of them, on any host with AVX2 (the AVX-512 hosts too, though their kernels look codes up by vpermps)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from fuel.cpu.quant import nf4_intrinsics
from fuel.cpu.quant.nibble_tables import (
    CODES32_LANES,
    ELEMENT_LANES,
    LOOKUP64_LANES,
    SHIFTED_LANES,
    lookup32,
    lookup64,
    nibble_codes32,
)
from fuel.cpu.simd.simd16 import IR_I8, IR_VF, vstore

ORDERS = {"shifted": SHIFTED_LANES, "element": ELEMENT_LANES, "split": nf4_intrinsics.SPLIT_LANES}


def _looked_up(lanes: list[tuple[int, int]] | None) -> Any:
    """A jitted (codes u8 [16·n], table f32 [16]) -> f32 [32·n]: `lookup32` of each 16 bytes in `lanes`, or
    (lanes None) `lookup64` of each 32 bytes."""
    group = 16 if lanes else 32

    @intrinsic
    def lookup(typingctx: Any, codes: Any, off: Any, table: Any, out: Any, out_off: Any) -> Any:
        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
            t = signature.args
            data = context.make_array(t[0])(context, builder, args[0]).data
            at = builder.bitcast(builder.gep(data, [args[1]]), IR_I8.as_pointer())
            tdata = context.make_array(t[2])(context, builder, args[2]).data
            vec = builder.load(builder.bitcast(tdata, IR_VF.as_pointer()), align=4)
            odata = context.make_array(t[3])(context, builder, args[3]).data
            dst = builder.bitcast(builder.gep(odata, [args[4]]), IR_VF.as_pointer())
            vectors = lookup32(builder, at, vec, lanes) if lanes else lookup64(builder, at, vec)
            for i, v in enumerate(vectors):
                builder.store(v, builder.gep(dst, [ir.Constant(ir.IntType(32), i)]), align=4)
            return context.get_dummy_value()

        return types.void(codes, off, table, out, out_off), codegen

    @njit
    def run(codes: Any, table: Any) -> Any:
        out = np.empty(2 * codes.size, np.float32)
        for s in range(codes.size // group):
            lookup(codes, group * s, table, out, 2 * group * s)
        return out

    return run


@pytest.mark.parametrize("order", [*sorted(ORDERS), "lookup64"])
def test_lookups_match_indexing(order: str) -> None:
    """Every byte value at every position, against table[nibble] in the lanes' order; the table's floats
    carry all four bytes (negative, subnormal, NaN payloads), so a misplaced byte plane shows."""
    lanes, group = (LOOKUP64_LANES, 32) if order == "lookup64" else (ORDERS[order], 16)
    rng = np.random.default_rng(3)
    codes = np.concatenate([np.arange(256, dtype=np.uint8), rng.integers(0, 256, 32 * 40, dtype=np.uint8)])
    table = rng.integers(0, 2**32, 16, dtype=np.uint64).astype(np.uint32).view(np.float32)
    table[:3] = np.array([-0.6961928009986877, 1e-40, 0.07958029955625534], np.float32)
    got = _looked_up(None if order == "lookup64" else lanes)(codes, table).view(np.uint32)
    nibbles = np.stack([codes & 15, codes >> 4], axis=-1).reshape(-1, group, 2)  # [group, byte, nibble]
    want = np.stack([table.view(np.uint32)[nibbles[:, b, h]] for b, h in lanes], axis=-1).reshape(-1)
    np.testing.assert_array_equal(got, want)


@njit(cache=True)
def _codes32_of(w: Any, out: Any, sub8: bool) -> None:
    """`nibble_codes32` of each 16 bytes of w (sub 8 or 0, literals) into out [2·w.size]."""
    for s in range(w.size // 16):
        if sub8:
            first, second = nibble_codes32(w, 16 * s, 8)
        else:
            first, second = nibble_codes32(w, 16 * s, 0)
        vstore(out, 32 * s, first)
        vstore(out, 32 * s + 16, second)


@pytest.mark.parametrize("sub", [0, 8])
def test_codes32_are_the_nibbles_less_sub_in_their_lanes(sub: int) -> None:
    """Every byte value in every position: lane j holds element CODES32_LANES[j] of its 16 bytes (element b
    the low nibble of byte b, element 16 + b its high nibble), less sub, as an exact float."""
    assert sorted(CODES32_LANES) == list(range(32))
    rng = np.random.default_rng(4)
    w = np.concatenate([np.arange(256, dtype=np.uint8), rng.integers(0, 256, 16 * 20, dtype=np.uint8)])
    got = np.empty(2 * w.size, np.float32)
    _codes32_of(w, got, sub == 8)
    blocks = w.reshape(-1, 16)
    elements = np.concatenate([blocks & 15, blocks >> 4], axis=1).astype(np.float32) - sub
    np.testing.assert_array_equal(got.reshape(-1, 32), elements[:, CODES32_LANES])
