"""4-bit codes to floats by a 16-entry table held in one vector register (AVX-512 hosts only: `LUT16`).

The portable decoders (`simd16.codes`) widen 16 code bytes to 32-bit lanes and convert them to floats: two
512-bit operations per 16 codes, the two that bound one-row GGUF decoding on this machine's cores. Here
the 8 bytes holding 16 nibbles are spread over the 16 lanes as their two 32-bit words, each lane shifted
to bring its nibble to the low 4 bits, and one vpermps (which reads only those 4 bits) looks the codes up:
one shift and one permute for 16 codes. The lanes then hold the nibbles in `nibble_lanes` order, not
element order, so the activations a kernel dots them with are permuted once a call to match
(`permuted`). GGUF's table kernels compute every value the portable path does, only which lane sums which
products differs; NF4's applies each block's absmax to the block's sum (`nf4_table`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import binding, ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from fuel.dispatch.cpu.simd16 import _F32, _I32, _VF, _W, VEC, _ptr

LUT16 = bool(binding.get_host_cpu_features().get("avx512f"))  # the 16-float vpermps is AVX-512F


def nibble_lanes() -> list[tuple[int, int]]:
    """`nibble_codes`' lane j as (byte, nibble): which of the 8 bytes, and its low (0) or high (1) nibble."""
    return [(4 * (j % 2) + j // 4, (j // 2) % 2) for j in range(_W)]


@njit(cache=True)
def permuted(a: Any, order: Any) -> Any:
    """[a's one row with each order.size elements in `order` (order[t]: the element that goes to place t);
    the row as given] as a [2, k] f32 array: a table kernel reads the first, and block sums the second."""
    x = a.reshape(a.size)
    out = np.empty((2, x.size), np.float32)
    g = order.size
    for u in range(0, x.size, g):
        for t in range(g):
            out[0, u + t] = x[u + order[t]]
    out[1] = x
    return out


def _nibble_index(context: Any, builder: Any, aryty: Any, ary: Any, off: Any) -> Any:
    """The 16 nibbles of the 8 bytes at ary[off] in the low 4 bits of 32-bit lanes, `nibble_lanes` order:
    the two 32-bit words spread over the lanes, lane j shifted right by 4·(j // 2)."""
    v16 = ir.VectorType(_I32, _W)
    words = builder.load(_ptr(context, builder, aryty, ary, off, ir.VectorType(_I32, 2)), align=1)
    spread = builder.shuffle_vector(words, words, ir.Constant(v16, [j % 2 for j in range(_W)]))
    return builder.lshr(spread, ir.Constant(v16, [4 * (j // 2) for j in range(_W)]))


def _permute16(builder: Any, table: Any, index: Any) -> Any:
    """table[index & 15] per lane: one vpermps (AVX-512)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF, ir.VectorType(_I32, _W)]),
                                        "llvm.x86.avx512.permvar.sf.512")
    return builder.call(fn, [table, index])


@intrinsic(prefer_literal=True)
def _nibble_codes(typingctx: Any, src: Any, off: Any, sub: Any) -> Any:
    """The 16 four-bit codes of the 8 bytes at src[off], less sub, as exact floats, by table (AVX-512
    only): a shift and a vpermps, where `codes` widens bytes to 32-bit lanes and converts them (two
    512-bit operations). Lanes hold the codes in `nibble_lanes` order, so the activations they meet are
    permuted to match. sub a literal."""
    if not isinstance(sub, types.IntegerLiteral):
        return None
    less = int(sub.literal_value)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        table = ir.Constant(_VF, [float(i - less) for i in range(16)])
        return _permute16(builder, table, _nibble_index(context, builder, signature.args[0], args[0], args[1]))

    return VEC(src, off, sub), codegen


@intrinsic
def _nibble_lookup(typingctx: Any, src: Any, off: Any, table: Any) -> Any:
    """table[nibble] for the 16 nibbles of the 8 bytes at src[off], in `nibble_lanes` order (AVX-512)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return _permute16(builder, args[2], _nibble_index(context, builder, signature.args[0], args[0], args[1]))

    return VEC(src, off, table), codegen


@intrinsic
def _pair_scales(typingctx: Any, sc: Any, i: Any) -> Any:
    """sc[i] in the lanes `nibble_codes` fills from low nibbles, sc[i + 1] in those from high nibbles."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        two = builder.load(_ptr(context, builder, signature.args[0], args[0], args[1], ir.VectorType(_F32, 2)),
                           align=4)
        return builder.shuffle_vector(two, two, ir.Constant(ir.VectorType(_I32, _W), [h for _, h in nibble_lanes()]))

    return VEC(sc, i), codegen


nibble_codes: Any = _nibble_codes
nibble_lookup: Any = _nibble_lookup
pair_scales: Any = _pair_scales
