"""4-bit codes to floats by a 16-entry table held in vector registers: one vpermps per 16 codes on AVX-512
hosts (`LUT16`), byte shuffles per 32 on AVX2 hosts (`BYTE_LUT`, `lookup32`).

The portable decoders (`simd16.codes`) widen 16 code bytes to 32-bit lanes and convert them to floats: two
512-bit operations per 16 codes, the two that bound one-row GGUF decoding (docs/performance/nf4.md,
"nibble_tables"). Here
the 8 bytes holding 16 nibbles are spread over the 16 lanes as their two 32-bit words, each lane shifted
to bring its nibble to the low 4 bits, and one vpermps (which reads only those 4 bits) looks the codes up:
one shift and one permute for 16 codes. The lanes then hold the nibbles in `nibble_lanes` order, not
element order, so the activations a kernel dots them with are permuted once a call to match
(`permuted`). GGUF's table kernels compute every value the portable path does, only which lane sums which
products differs; NF4's applies each block's absmax to the block's sum (`nf4_table`).

AVX2 has no 16-float permute (its vpermps reads 8), but vpshufb looks up 32 bytes in a 16-byte table:
`lookup32` looks up each of the table floats' four bytes and interleaves them (Nf4Matmul's). Small integer
codes (GGUF's 4-bit ones) are exact bfloat16s, two bytes a code: `codes32` looks up those two and takes two
codes' floats from each 32-bit lane of their interleave by a mask and a shift.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import binding, ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from fuel.cpu.simd.simd16 import IR_F32, IR_I8, IR_I32, IR_V8, IR_VF, LANES, VEC, element_pointer, fma_lanes, splat_f32
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import ADDRESS, INT, record_at

_HOST = binding.get_host_cpu_features()
LUT16 = bool(_HOST.get("avx512f"))  # the 16-float vpermps is AVX-512F
BYTE_LUT = not LUT16 and bool(_HOST.get("avx2"))  # `lookup32`'s byte shuffles (AVX2 hosts)
LUT32 = LUT16 or BYTE_LUT  # `nibble_lookup32` is a few vector operations a code


def nibble_lanes() -> list[tuple[int, int]]:
    """`nibble_codes`' lane j as (byte, nibble): which of the 8 bytes, and its low (0) or high (1) nibble."""
    return [(4 * (j % 2) + j // 4, (j // 2) % 2) for j in range(LANES)]


@njit(inline="always", cache=True)
def permute_into(x: Any, order: Any, out: Any) -> None:
    """out [2, k] <- [the row x (k) with each order.size elements in `order` (order[t]: the element that
    goes to place t); x as given]. Each group's elements through slices, which is faster than indexing x
    and out [2, k] in place."""
    g = order.size
    first = out[0]
    for u in range(0, x.size, g):
        src = x[u:u + g]
        dst = first[u:u + g]
        for t in range(g):
            dst[t] = src[order[t]]
    out[1, :] = x


@njit(cache=True)
def permuted(a: Any, order: Any) -> Any:
    """[a's one row with each order.size elements in `order` (order[t]: the element that goes to place t);
    the row as given] as a [2, k] f32 array: a table kernel reads the first, and block sums the second."""
    x = a.reshape(a.size)
    out = np.empty((2, x.size), np.float32)
    permute_into(x, order, out)
    return out


PERMUTE_ARGS = jobs.record(a=ADDRESS, scratch=ADDRESS, order=ADDRESS, k=INT, group=INT)


@pool.task()
def _permute_part(part: int, parts: int, argv: int) -> None:
    """`permuted` into a scratch [2, k] in place, for a table kernel's job after it (one part; written in
    place rather than into a fresh array copied in: docs/performance/nf4.md, "nibble_tables")."""
    p = record_at(argv, PERMUTE_ARGS)
    permute_into(carray(pointer(p.a, np.float32), (p.k,)), carray(pointer(p.order, np.int64), (p.group,)),
                 carray(pointer(p.scratch, np.float32), (2, p.k)))


@njit(cache=True)
def _fill_permute(a: Any, scratch: Any, order: Any, argv: Any) -> None:
    p = argv[0]
    p.a, p.scratch, p.order = a.ctypes.data, scratch.ctypes.data, order.ctypes.data
    p.k, p.group = a.shape[1], order.size


def permute_job(a: np.ndarray, order: np.ndarray) -> tuple[jobs.Job, np.ndarray, tuple[np.ndarray, ...]]:
    """A job writing `permuted(a, order)` (a [1, k]) into a scratch of its own, for a table kernel's job
    after it to read at every call: (the job, the scratch, the arrays it points at besides a)."""
    order = np.ascontiguousarray(order, np.int64)
    scratch = np.empty((2, a.shape[1]), np.float32)
    argv = jobs.argv_of(PERMUTE_ARGS)
    _fill_permute(a, scratch, order, argv)
    return jobs.job(_permute_part, argv, 0.0, 1), scratch, (scratch, order)


def _nibble_index(context: Any, builder: Any, aryty: Any, ary: Any, off: Any) -> Any:
    """The 16 nibbles of the 8 bytes at ary[off] in the low 4 bits of 32-bit lanes, `nibble_lanes` order:
    the two 32-bit words spread over the lanes, lane j shifted right by 4·(j // 2)."""
    v16 = ir.VectorType(IR_I32, LANES)
    words = builder.load(element_pointer(context, builder, aryty, ary, off, ir.VectorType(IR_I32, 2)), align=1)
    spread = builder.shuffle_vector(words, words, ir.Constant(v16, [j % 2 for j in range(LANES)]))
    return builder.lshr(spread, ir.Constant(v16, [4 * (j // 2) for j in range(LANES)]))


def permute16(builder: Any, table: Any, index: Any) -> Any:
    """table[index & 15] per lane for a 16-float table and 16 32-bit indices: one vpermps on AVX-512, else
    a build-vector of extracts (scalar code: AVX2 hosts look codes up by `lookup32`)."""
    v16 = ir.VectorType(IR_I32, LANES)
    if LUT16:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(IR_VF, [IR_VF, v16]),
                                            "llvm.x86.avx512.permvar.sf.512")
        return builder.call(fn, [table, index])
    masked = builder.and_(index, ir.Constant(v16, [15] * LANES))
    out = ir.Constant(IR_VF, [0.0] * LANES)
    for lane in range(LANES):
        at = ir.Constant(IR_I32, lane)
        out = builder.insert_element(out, builder.extract_element(table, builder.extract_element(masked, at)), at)
    return out


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
        table = ir.Constant(IR_VF, [float(i - less) for i in range(16)])
        return permute16(builder, table, _nibble_index(context, builder, signature.args[0], args[0], args[1]))

    return VEC(src, off, sub), codegen


@intrinsic
def _value_table(typingctx: Any, s: Any, b: Any) -> Any:
    """The 16 values code·s + b of the codes 0-15 by one FMA, a unit's table for `nibble_values`: each
    value `gguf_gemv.affine` forms from its code, where code·s is exact (an f16 scale, a 4-bit code)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        codes = ir.Constant(IR_VF, [float(i) for i in range(16)])
        return fma_lanes(builder, codes, *(splat_f32(context, builder, args[i], signature.args[i]) for i in (0, 1)))

    return VEC(s, b), codegen


@intrinsic
def _nibble_values(typingctx: Any, src: Any, off: Any, table: Any) -> Any:
    """table[code] for the 16 four-bit codes of the 8 bytes at src[off], in `nibble_codes`' lanes and at
    its cost (AVX-512 only): a unit's values straight from its `value_table`, one FMA a unit where forming
    them from the codes takes one a 16 codes."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return permute16(builder, args[2], _nibble_index(context, builder, signature.args[0], args[0], args[1]))

    return VEC(src, off, table), codegen


# The unpacks in `_lookup_index` leave index positions 0-3, 16-19, 4-7, 20-23 in its first vector's lanes and
# 8-11, 24-27, 12-15, 28-31 in its second's: lane j reads position _POSITIONS[j].
_POSITIONS = [q + 4 * g + h for g in range(4) for h in (0, 16) for q in range(4)]
# The cheapest index: position p < 16 is byte p's low nibble, p >= 16 byte p - 16's high one.
SHIFTED_LANES = [(p % 16, int(p >= 16)) for p in _POSITIONS]
ELEMENT_LANES = [(e // 2, 1 - e % 2) for e in range(32)]  # NF4's element order: the high nibble first


def lookup32_lanes() -> list[tuple[int, int]]:
    """`nibble_lookup32`'s lane j (of 32) as (byte of the 16, its low (0) or high (1) nibble)."""
    if LUT16:
        return [(8 * half + b, h) for half in (0, 1) for b, h in nibble_lanes()]
    return SHIFTED_LANES


def lookup32(builder: Any, at: Any, table: Any, lanes: list[tuple[int, int]]) -> tuple[Any, Any]:
    """AVX2: table[nibble] for the 32 nibbles of the 16 bytes at the i8 pointer `at`, as two 16-float vectors
    whose lane j holds the nibble lanes[j] names (`_lookup_index`). `SHIFTED_LANES` builds the index from the
    16 bytes in both 128-bit halves, the upper shifted right by 4 (two operations); any other order picks
    and duplicates bytes by one more vpshufb and selects each position's nibble (four)."""
    v32, i32x8, sel = ir.VectorType(IR_I8, 32), ir.VectorType(IR_I32, 8), ir.VectorType(IR_I32, 32)
    raw = builder.load(builder.bitcast(at, IR_V8.as_pointer()), align=1)
    if lanes == SHIFTED_LANES:
        both = builder.bitcast(builder.shuffle_vector(raw, raw, ir.Constant(sel, list(range(16)) * 2)), i32x8)
        index = builder.and_(builder.bitcast(builder.lshr(both, ir.Constant(i32x8, [0] * 4 + [4] * 4)), v32),
                             ir.Constant(v32, [15] * 32))
    else:
        at_position = dict(zip(_POSITIONS, lanes, strict=True))
        dup = builder.shuffle_vector(raw, raw, ir.Constant(sel, [at_position[p][0] for p in range(32)]))
        high = ir.Constant(ir.VectorType(ir.IntType(1), 32), [bool(at_position[p][1]) for p in range(32)])
        index = builder.select(high, builder.lshr(dup, ir.Constant(v32, [4] * 32)),
                               builder.and_(dup, ir.Constant(v32, [15] * 32)))
    return _lookup_index(builder, index, table)


# `lookup64`'s lane j (of 64): byte _POSITIONS[j % 32] of the 32, its low nibble (j < 32) or high one.
LOOKUP64_LANES = [(p, 0) for p in _POSITIONS] + [(p, 1) for p in _POSITIONS]


def lookup64(builder: Any, at: Any, table: Any) -> tuple[Any, Any, Any, Any]:
    """AVX2: table[nibble] for the 64 nibbles of the 32 bytes at the i8 pointer `at`, as four 16-float
    vectors in `LOOKUP64_LANES` order: the bytes loaded once, their low nibbles one index and their high
    ones another (a shift and two masks), where `lookup32` builds each 32 nibbles' index from a broadcast
    and a variable shift (docs/performance/nf4.md, "nibble_tables")."""
    v32 = ir.VectorType(IR_I8, 32)
    raw = builder.load(builder.bitcast(at, v32.as_pointer()), align=1)
    low = ir.Constant(v32, [15] * 32)
    first = _lookup_index(builder, builder.and_(raw, low), table)
    second = _lookup_index(builder, builder.and_(builder.lshr(raw, ir.Constant(v32, [4] * 32)), low), table)
    return first[0], first[1], second[0], second[1]


def _unpack(builder: Any, a: Any, b: Any, size: int, high: int) -> Any:
    """vpunpck{l,h} of two 32-byte vectors: per 128-bit half, the low (high = 0) or high half's units of
    `size` bytes of a and b interleaved."""
    units = 16 // size
    vt = ir.VectorType(ir.IntType(8 * size), 2 * units)
    a, b = builder.bitcast(a, vt), builder.bitcast(b, vt)
    mask = [x for half in (0, units) for u in range(units // 2)
            for x in (half + high * units // 2 + u, 2 * units + half + high * units // 2 + u)]
    return builder.bitcast(builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(IR_I32, 2 * units), mask)),
                           ir.VectorType(IR_I8, 32))


def _pshufb(builder: Any, table: Any, index: Any) -> Any:
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(table.type, [table.type, index.type]),
                                        "llvm.x86.avx2.pshuf.b")
    return builder.call(fn, [table, index])


def _lookup_index(builder: Any, index: Any, table: Any) -> tuple[Any, Any]:
    """table[index] for a 32-byte index of nibbles, as two 16-float vectors whose lane j holds index position
    _POSITIONS[j]. Each of the table floats' four bytes is looked up by one vpshufb, and the four byte
    vectors are interleaved into floats by two rounds of unpacks: 12 shuffles for 32 floats, where two
    vpermps, a mask, a compare and a blend per 8 floats take 20."""
    sel = ir.VectorType(IR_I32, 32)
    fbytes = builder.bitcast(table, ir.VectorType(IR_I8, 4 * LANES))
    planes = [_pshufb(builder, builder.shuffle_vector(fbytes, fbytes, ir.Constant(
        sel, [4 * c + j for c in range(16)] * 2)), index) for j in range(4)]
    floats = [builder.bitcast(_unpack(builder, _unpack(builder, planes[0], planes[1], 1, hi),
                                      _unpack(builder, planes[2], planes[3], 1, hi), 2, h), ir.VectorType(IR_F32, 8))
              for hi in (0, 1) for h in (0, 1)]
    whole = ir.Constant(ir.VectorType(IR_I32, LANES), list(range(LANES)))
    return builder.shuffle_vector(floats[0], floats[1], whole), builder.shuffle_vector(floats[2], floats[3], whole)


@intrinsic
def _nibble_lookup32(typingctx: Any, src: Any, off: Any, table: Any) -> Any:
    """(table[nibble] for the 32 nibbles of the 16 bytes at src[off]) as two vectors, in `lookup32_lanes`
    order: a vpermps of each 8 bytes' nibbles on AVX-512 (`nibble_lanes` order twice), byte shuffles on
    AVX2 (`lookup32`)."""
    pair = types.UniTuple(VEC, 2)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        aryty = signature.args[0]
        if LUT16:
            later = builder.add(args[1], context.get_constant(signature.args[1], 8))
            vs = [permute16(builder, args[2], _nibble_index(context, builder, aryty, args[0], o))
                  for o in (args[1], later)]
        else:
            table = element_pointer(context, builder, aryty, args[0], args[1], IR_I8)
            vs = list(lookup32(builder, table, args[2], SHIFTED_LANES))
        return context.make_tuple(builder, pair, vs)

    return pair(src, off, table), codegen


@intrinsic
def _nibble_lookup64(typingctx: Any, src: Any, off: Any, table: Any) -> Any:
    """(table[nibble] for the 64 nibbles of the 32 bytes at src[off]) as four vectors in `LOOKUP64_LANES`
    order (`lookup64`: AVX2's byte shuffles; AVX-512 hosts have them too)."""
    quad = types.UniTuple(VEC, 4)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        at = element_pointer(context, builder, signature.args[0], args[0], args[1], IR_I8)
        return context.make_tuple(builder, quad, list(lookup64(builder, at, args[2])))

    return quad(src, off, table), codegen


@intrinsic
def _pair_scales(typingctx: Any, sc: Any, i: Any) -> Any:
    """sc[i] in the lanes `nibble_codes` fills from low nibbles, sc[i + 1] in those from high nibbles."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        addr = element_pointer(context, builder, signature.args[0], args[0], args[1], ir.VectorType(IR_F32, 2))
        two = builder.load(addr, align=4)
        halves = ir.Constant(ir.VectorType(IR_I32, LANES), [h for _, h in nibble_lanes()])
        return builder.shuffle_vector(two, two, halves)

    return VEC(sc, i), codegen


# `nibble_codes32`'s lane j (of 32): the index position, so the element of a 32-element block whose byte b
# holds elements b (low nibble) and b + 16 (high nibble), as Q4_0's (and Q4_1's) do.
CODES32_LANES = [p + 16 * g + 8 * v + o for v in (0, 1) for o in (0, 1) for g in (0, 1) for p in range(0, 8, 2)]


def _bf16(v: int) -> int:
    """The bfloat16 bits of a small integer (exact: |v| < 256)."""
    return int(np.array(v, np.float32).view(np.uint32)) >> 16


def codes32(builder: Any, at: Any, sub: int) -> tuple[Any, Any]:
    """AVX2: the 32 nibbles of the 16 bytes at the i8 pointer `at`, less sub, as exact floats in two 16-float
    vectors in `CODES32_LANES` order. The codes' bfloat16 bits are looked up as two byte planes (the 16
    bytes in both 128-bit halves, the upper half's nibbles shifted down, one vpshufb a plane) and interleaved
    into 16-bit units by one round of unpacks; a 32-bit lane then holds two codes' bfloat16 bits, which are
    floats as they stand: the high one masked, the low one shifted up. No widening of bytes to 32-bit lanes
    and no int-to-float convert (`simd16.codes`' way)."""
    v16, v32, i32x8 = ir.VectorType(IR_I8, 16), ir.VectorType(IR_I8, 32), ir.VectorType(IR_I32, 8)
    raw = builder.load(builder.bitcast(at, v16.as_pointer()), align=1)
    twice = ir.Constant(ir.VectorType(IR_I32, 32), list(range(16)) * 2)
    both = builder.bitcast(builder.shuffle_vector(raw, raw, twice), i32x8)
    index = builder.and_(builder.bitcast(builder.lshr(both, ir.Constant(i32x8, [0] * 4 + [4] * 4)), v32),
                         ir.Constant(v32, [15] * 32))
    bits = [_bf16(c - sub) for c in range(16)]
    planes = [_pshufb(builder, ir.Constant(v32, [(b >> shift) & 255 for b in bits] * 2), index) for shift in (0, 8)]
    floats = []
    for high in (0, 1):
        units = builder.bitcast(_unpack(builder, planes[0], planes[1], 1, high), i32x8)
        floats += [builder.bitcast(builder.shl(units, ir.Constant(i32x8, [16] * 8)), ir.VectorType(IR_F32, 8)),
                   builder.bitcast(builder.and_(units, ir.Constant(i32x8, [-65536] * 8)), ir.VectorType(IR_F32, 8))]
    whole = ir.Constant(ir.VectorType(IR_I32, LANES), list(range(LANES)))
    return builder.shuffle_vector(floats[0], floats[1], whole), builder.shuffle_vector(floats[2], floats[3], whole)


@intrinsic(prefer_literal=True)
def _nibble_codes32(typingctx: Any, src: Any, off: Any, sub: Any) -> Any:
    """(the 32 four-bit codes of the 16 bytes at src[off], less sub, as exact floats) as two vectors in
    `CODES32_LANES` order (`codes32`, AVX2). sub a literal."""
    if not isinstance(sub, types.IntegerLiteral):
        return None
    less = int(sub.literal_value)
    pair = types.UniTuple(VEC, 2)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        at = element_pointer(context, builder, signature.args[0], args[0], args[1], IR_I8)
        return context.make_tuple(builder, pair, list(codes32(builder, at, less)))

    return pair(src, off, sub), codegen


nibble_codes: Any = _nibble_codes
nibble_values: Any = _nibble_values
value_table: Any = _value_table
nibble_codes32: Any = _nibble_codes32
nibble_lookup32: Any = _nibble_lookup32
nibble_lookup64: Any = _nibble_lookup64
pair_scales: Any = _pair_scales
