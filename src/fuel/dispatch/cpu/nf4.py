"""Nf4Matmul (entry 21) on the CPU: `act @ dequant(W)ᵀ` (or `g @ dequant(W)`) straight from NF4 bytes.

A weight value is `NF4[code] * absmax`, rounded once to f32 (bitsandbytes' dequantisation, bit for
bit). The 16-entry table lookup is what makes NF4 slow in plain loops (a scalar load or a gather per
element; measured 7 ms single-threaded for a 4096² GEMV): here the table is held in vector registers and
looked up in LLVM IR, by one 16-lane `vpermps` on AVX-512 (`nibble_tables.permute16`) and by byte
shuffles on AVX2 (`nibble_tables.lookup32`: LLVM's own lowering of a 16-lane variable permute there was
one scalar extract per lane, 9.4 ms for a 4096² one-row product). Each step reads 16 packed bytes and
looks up both nibbles: 16 weights of even k (high nibbles) and 16 of odd k, each scaled by its block's
absmax (the tiles' dequantisation on AVX2 takes them in element order straight from the shuffles).

Three paths, chosen by shape and host:
- decode (at most `DECODE_MAX_ROWS` activation rows, forward only): the activation rows are split
  once into their even and odd k, then each output column streams its packed weight row once and
  accumulates every activation row against it in two 16-lane f32 FMA accumulators, summed by a fixed
  tree. Nothing is dequantised to memory; rows are split over threads in a fixed number of chunks. One
  activation row on AVX-512 and AVX2 hosts goes by table instead (`nf4_table`: 0.37 against 0.54 ms
  warm on AVX-512).
- AMX (more rows, K >= `AMX_MIN_K` and N·K >= `AMX_MIN_WEIGHTS`, on hosts with AMX tiles): `nf4_amx`,
  the products on the tiles in bf16 pieces whose sums are exact f32 values (f32-accurate: at most 8.2e-8
  of S measured). Declined (the tiles path runs) for blocks of other than a multiple of 64, non-finite
  absmax and activations outside the tiles' range. 4096², 64 rows, two threads: 0.66-1.0x the tiles
  path's time, by the host's phase (interleaved in one process on a Xeon VM whose two vCPUs share
  their tile unit's throughput: two threads of tile products ran 1.1-1.5x one thread's rate).
- tiles (more rows): rows of W are dequantised in k order into a reused f32 tile, each tile multiplied
  by fuel's tile kernel on AVX-512 and AVX2 hosts (`tile_gemm`) or one one-thread OpenBLAS GEMM elsewhere, the
  tiles split over fuel's threads (`weight_tiles`). The transposed product `g @ W` of the gradient
  dequantises column blocks into `TILE_BYTES` tiles in the calling thread, each multiplied as one-thread
  GEMMs on fixed row blocks (`row_blocks`). Every product's sum for an output element is then fixed by
  the shape, so the bytes do not depend on the thread count.
Block sizes that are not a multiple of 32 (no 16-byte step fits a block) take plain loops instead.
bf16/f16 activations are widened exactly to f32 and the output is rounded once on store.

Measured (2 cores, K = N = 4096, block 64, f32), on AVX-512 (Zen 4): one row 0.49 ms, 85% of the time
to stream the packed weight and absmax (9.4 MB) at the 22.6 GB/s a NumPy copy reached; 64 rows 11.0-11.4
ms (the tile kernel; 13.3-14.2 by OpenBLAS); torch's `dequantize_4bit` then matmul 23.5-26.2 ms. On AVX2
(Zen 3): one row 0.8-1.0 ms, 64 rows 15-15.7 ms (OpenBLAS), torch 30 ms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from fuel.dispatch import native, spin
from fuel.dispatch.buffers import POOL
from fuel.dispatch.cpu import nf4_amx, row_blocks
from fuel.dispatch.cpu.atomics import pointer
from fuel.dispatch.cpu.driver import chunk_bounds, chunk_count
from fuel.dispatch.cpu.half import narrow_into, widened
from fuel.dispatch.cpu.nf4_table import WEIGHTS_PER_SECOND, decode_one_row, table_forms
from fuel.dispatch.cpu.nibble_tables import BYTE_LUT, ELEMENT_LANES, LUT32, lookup32, permute16
from fuel.dispatch.cpu.weight_tiles import (
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
    tiled_product,
)
from fuel.dispatch.fused import (
    CONTIGUOUS_ONLY,
    BackendImpl,
    CostEstimate,
    FusedKernelRegistry,
    PrecisionGuarantee,
    revision_of,
)
from fuel.dtype import DType
from fuel.graph.node import Shape
from fuel.graph.registry import FusedOps
from fuel.quant.nf4 import NF4

DECODE_MAX_ROWS = 4  # up to this many activation rows, the fused decode path (no dequantised tile)
TILE_BYTES = 8 << 20  # f32 scratch per dequantised tile of the transposed product (the gradient)
_LUT = np.array(NF4, np.float32)  # a writable copy: Numba types it as a plain array

_I32 = ir.IntType(32)
_V16I = ir.VectorType(_I32, 16)
_V16F = ir.VectorType(ir.FloatType(), 16)
_V16B = ir.VectorType(ir.IntType(8), 16)
_EVEN = ir.Constant(_V16I, [x for i in range(8) for x in (i, 16 + i)])  # interleave (hi, lo): k 0..15
_ODD = ir.Constant(_V16I, [x for i in range(8, 16) for x in (i, 16 + i)])  # k 16..31
_ZERO = ir.Constant(_V16F, [0.0] * 16)
_SPLIT_LANES = [(b, 1) for b in range(16)] + [(b, 0) for b in range(16)]  # `lookup32`: even k, then odd k


def _i32(v: int) -> ir.Constant:
    return ir.Constant(_I32, v)


def _pointer(context: Any, builder: ir.IRBuilder, aryty: Any, ary: Any, offset: Any) -> Any:
    """The address of element `offset` of a contiguous array (flat index)."""
    return builder.gep(context.make_array(aryty)(context, builder, ary).data, [offset])


def _splat(builder: ir.IRBuilder, x: Any) -> Any:
    v = builder.insert_element(_ZERO, x, _i32(0))
    return builder.shuffle_vector(v, v, ir.Constant(_V16I, [0] * 16))


def _hsum(builder: ir.IRBuilder, v: Any) -> Any:
    """The lanes' sum by a fixed halving tree."""
    n = 16
    while n > 1:
        half = ir.VectorType(_I32, n // 2)
        lo = builder.shuffle_vector(v, v, ir.Constant(half, list(range(n // 2))))
        hi = builder.shuffle_vector(v, v, ir.Constant(half, list(range(n // 2, n))))
        v, n = builder.fadd(lo, hi), n // 2
    return builder.extract_element(v, _i32(0))


def _nibbles(builder: ir.IRBuilder, table: Any, wp: Any, step: Any, scale: Any) -> tuple[Any, Any]:
    """The weights of the 16 packed bytes at wp[16·step]: (16 even k from the high nibbles, 16 odd k)."""
    at = builder.gep(wp, [builder.mul(step, ir.Constant(step.type, 16))])
    if BYTE_LUT:
        hi, lo = lookup32(builder, at, table, _SPLIT_LANES)
        return builder.fmul(hi, scale), builder.fmul(lo, scale)
    idx = builder.zext(builder.load(builder.bitcast(at, _V16B.as_pointer()), align=1), _V16I)
    hi = builder.fmul(permute16(builder, table, builder.lshr(idx, ir.Constant(_V16I, [4] * 16))), scale)
    lo = builder.fmul(permute16(builder, table, builder.and_(idx, ir.Constant(_V16I, [15] * 16))), scale)
    return hi, lo


def _table(context: Any, builder: ir.IRBuilder, lutty: Any, lut: Any) -> Any:
    return builder.load(builder.bitcast(_pointer(context, builder, lutty, lut, _i32(0)), _V16F.as_pointer()),
                        align=4)


def _c_arrays(*tys: Any) -> bool:
    """The intrinsics address arrays by flat offsets: only C-contiguous ones type-check."""
    return all(isinstance(t, types.Array) and t.layout == "C" for t in tys)


def _dequant_blocks_ir(typingctx: Any, w: Any, w_off: Any, absmax: Any, am_off: Any, lut: Any, nblocks: Any,
                       steps: Any, dst: Any, dst_off: Any) -> Any:
    """dst[dst_off:] <- the nblocks blocks of 32·steps weights at w[w_off:] (scales at absmax[am_off:])."""
    if not _c_arrays(w, absmax, lut, dst):
        return None
    sig = types.void(w, w_off, absmax, am_off, lut, nblocks, steps, dst, dst_off)

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
        t = signature.args
        wp, mp = _pointer(context, builder, t[0], args[0], args[1]), _pointer(context, builder, t[2], args[2], args[3])
        dp = builder.bitcast(_pointer(context, builder, t[7], args[7], args[8]), _V16F.as_pointer())
        table = _table(context, builder, t[4], args[4])
        with cgutils.for_range(builder, args[5]) as blk:
            scale = _splat(builder, builder.load(builder.gep(mp, [blk.index])))
            with cgutils.for_range(builder, args[6]) as st:
                j = builder.add(builder.mul(blk.index, args[6]), st.index)
                at = builder.gep(dp, [builder.mul(j, ir.Constant(j.type, 2))])
                if BYTE_LUT:  # the byte shuffles give element order directly
                    src = builder.gep(wp, [builder.mul(j, ir.Constant(j.type, 16))])
                    first, second = (builder.fmul(v, scale) for v in lookup32(builder, src, table, ELEMENT_LANES))
                else:
                    hi, lo = _nibbles(builder, table, wp, j, scale)
                    first, second = builder.shuffle_vector(hi, lo, _EVEN), builder.shuffle_vector(hi, lo, _ODD)
                builder.store(first, at, align=4)
                builder.store(second, builder.gep(at, [_i32(1)]), align=4)
        return context.get_dummy_value()

    return sig, codegen


_dequant_blocks: Any = intrinsic(_dequant_blocks_ir)


def _make_dot(m: int) -> Any:
    """An intrinsic: out[out_off + i·out_stride] <- Σ_k act[i, k]·W[row, k] for the m rows of `split`
    (`[m, 2, K/2]`: each activation row's even k, then its odd k), W's row read once from w[w_off:]
    (nblocks blocks of 32·steps weights, their scales at absmax[am_off:])."""

    def dot(typingctx: Any, w: Any, w_off: Any, absmax: Any, am_off: Any, lut: Any, nblocks: Any, steps: Any,
            split: Any, out: Any, out_off: Any, out_stride: Any) -> Any:
        if not _c_arrays(w, absmax, lut, split, out):
            return None
        sig = types.void(w, w_off, absmax, am_off, lut, nblocks, steps, split, out, out_off, out_stride)

        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
            t = signature.args
            wp, mp = _pointer(context, builder, t[0], args[0], args[1]), _pointer(context, builder, t[2], args[2],
                                                                                    args[3])
            ap = builder.bitcast(_pointer(context, builder, t[7], args[7], _i32(0)), _V16F.as_pointer())
            op = _pointer(context, builder, t[8], args[8], args[9])
            half = builder.mul(args[5], args[6])  # vectors in half a row: K/32
            table = _table(context, builder, t[4], args[4])
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32")
            accs = [cgutils.alloca_once_value(builder, _ZERO) for _ in range(2 * m)]
            with cgutils.for_range(builder, args[5]) as blk:
                scale = _splat(builder, builder.load(builder.gep(mp, [blk.index])))
                with cgutils.for_range(builder, args[6]) as st:
                    j = builder.add(builder.mul(blk.index, args[6]), st.index)
                    hi, lo = _nibbles(builder, table, wp, j, scale)
                    for i in range(m):
                        even = builder.gep(ap, [builder.add(builder.mul(half, ir.Constant(j.type, 2 * i)), j)])
                        for acc, p, a in ((accs[2 * i], hi, even), (accs[2 * i + 1], lo, builder.gep(even, [half]))):
                            builder.store(builder.call(fma, [p, builder.load(a, align=4), builder.load(acc)]), acc)
            for i in range(m):
                total = _hsum(builder, builder.fadd(builder.load(accs[2 * i]), builder.load(accs[2 * i + 1])))
                builder.store(total, builder.gep(op, [builder.mul(args[10], ir.Constant(args[10].type, i))]))
            return context.get_dummy_value()

        return sig, codegen

    dot.__name__ = dot.__qualname__ = f"_nf4_dot{m}"
    return intrinsic(dot)


_dot1, _dot2, _dot3, _dot4 = (_make_dot(m) for m in range(1, DECODE_MAX_ROWS + 1))


@njit(cache=True)
def _decode_args(a: Any, w: Any, absmax: Any, lut: Any, out: Any, bs: int, argv: Any) -> Any:
    """The activation rows split into their even and odd k (rows·K floats, the path's only allocation),
    and argv <- the addresses and sizes `_decode` reads."""
    rows = a.shape[0]
    kh = w.shape[1]
    split = np.empty((rows, 2, kh), np.float32)
    for i in range(rows):
        for j in range(kh):
            split[i, 0, j] = a[i, 2 * j]
            split[i, 1, j] = a[i, 2 * j + 1]
    argv[0], argv[1], argv[2], argv[3], argv[4] = split.ctypes.data, rows, kh, w.ctypes.data, w.shape[0]
    argv[5], argv[6], argv[7], argv[8], argv[9] = absmax.ctypes.data, absmax.shape[1], lut.ctypes.data, \
        out.ctypes.data, bs
    return split


@spin.task()
def _decode(part: int, parts: int, argv: int) -> None:
    """Part `part` of out [rows, N] <- a [rows, K] @ dequant(W)ᵀ for rows <= 4, bs a multiple of 32: its
    share of the fixed row chunks (whoever runs a chunk, its bytes are the same)."""
    v = carray(pointer(argv, np.int64), (10,))
    rows, kh, n, nb = v[1], v[2], v[4], v[6]
    split = carray(pointer(v[0], np.float32), (rows, 2, kh))
    w = carray(pointer(v[3], np.uint8), (n, kh))
    absmax = carray(pointer(v[5], np.float32), (n, nb))
    lut = carray(pointer(v[7], np.float32), (16,))
    out = carray(pointer(v[8], np.float32), (rows, n))
    steps = v[9] // 32
    chunks = chunk_count(n)
    for c in range(part * chunks // parts, (part + 1) * chunks // parts):
        lo, hi = chunk_bounds(c, n, chunks)
        for r in range(lo, hi):
            if rows == 1:
                _dot1(w, r * kh, absmax, r * nb, lut, nb, steps, split, out, r, n)
            elif rows == 2:
                _dot2(w, r * kh, absmax, r * nb, lut, nb, steps, split, out, r, n)
            elif rows == 3:
                _dot3(w, r * kh, absmax, r * nb, lut, nb, steps, split, out, r, n)
            else:
                _dot4(w, r * kh, absmax, r * nb, lut, nb, steps, split, out, r, n)


USE_TABLE = LUT32  # one row by table (`nf4_table`); tests turn it off to run the portable path here too


def _decode_rows(x: np.ndarray, w: np.ndarray, absmax: np.ndarray, bs: int, out: np.ndarray) -> None:
    """The decode path (rows <= DECODE_MAX_ROWS) on the spinning pool."""
    if USE_TABLE and x.shape[0] == 1:
        decode_one_row(x, w, absmax, _LUT, out, bs)
        return
    argv = np.empty(10, np.int64)
    split = _decode_args(x, w, absmax, _LUT, out, bs, argv)
    n = w.shape[0]
    seconds = x.shape[0] * n * x.shape[1] / WEIGHTS_PER_SECOND
    spin.run(_decode, argv, spin.parts_for(seconds, chunk_count(n)))
    del split  # alive until here: the tasks read it by address


@njit(cache=True, nogil=True)
def _dequant_tile(w: Any, absmax: Any, lut: Any, bs: int, n0: int, n1: int, b0: int, b1: int, dst: Any) -> None:
    """dst [n1-n0, (b1-b0)·bs] <- the weights of rows [n0, n1), blocks [b0, b1), in the calling thread (no
    Numba pool: a BLAS call follows, and its idle workers would fight one); without the GIL, so the forward's
    parts dequantise concurrently."""
    kh, nb = w.shape[1], absmax.shape[1]
    width = (b1 - b0) * bs
    if bs % 32 == 0:
        for r in range(n0, n1):
            _dequant_blocks(w, r * kh + b0 * bs // 2, absmax, r * nb + b0, lut, b1 - b0, bs // 32, dst,
                            (r - n0) * width)
        return
    for r in range(n0, n1):
        row = dst[r - n0]
        for b in range(b0, b1):
            scale = absmax[r, b]
            for j in range(bs // 2):
                byte = w[r, (b * bs) // 2 + j]
                at = (b - b0) * bs + 2 * j
                row[at] = lut[byte >> 4] * scale
                row[at + 1] = lut[byte & 15] * scale


@spin.task()
def _tiles(part: int, parts: int, argv: int) -> None:
    """Part `part` of the many-row product on the spinning pool (`weight_tiles`): its tiles of W rows
    dequantised into a scratch slot, each multiplied (`weight_tiles.multiply_tile`). W's fields: w, K/2,
    absmax, blocks, LUT."""
    v = job(argv)
    f = carray(pointer(argv, np.int64), (WEIGHT + 5,))
    n, kh, nb = v[N], f[WEIGHT + 1], f[WEIGHT + 3]
    w = carray(pointer(f[WEIGHT], np.uint8), (n, kh))
    absmax = carray(pointer(f[WEIGHT + 2], np.float32), (n, nb))
    lut = carray(pointer(f[WEIGHT + 4], np.float32), (16,))
    slot = claim_slot(v)
    tile = tile_of(v, slot)
    i0, i1 = part_tiles(v, part, parts)
    for i in range(i0, i1):
        r0, r1 = tile_span(v, i)
        _dequant_tile(w, absmax, lut, 2 * kh // nb, r0, r1, 0, nb, tile)
        multiply_tile(v, slot, r0, r1)
    release_slot(v, slot)


def _scratch(rows: int, cols: int, buf: np.ndarray | None) -> np.ndarray:
    """A contiguous [rows, cols] f32 view of the tile buffer (one per call, reused by every tile)."""
    assert buf is not None
    return buf[: rows * cols].reshape(rows, cols)


USE_AMX = True  # large products on AMX tiles where the host has them (`nf4_amx`); tests turn it off
AMX_MIN_K = 2048  # the smallest contraction, and
AMX_MIN_WEIGHTS = 1 << 23  # the smallest weight (N·K), the AMX path takes (below, it measured 0.9-1.3x)


def _forward(x: np.ndarray, w: np.ndarray, absmax: np.ndarray, bs: int, out: np.ndarray,
             x_pieces: int = nf4_amx.PIECES) -> None:
    """out [R, N] <- x [R, K] @ dequant(W)ᵀ, all f32 and contiguous (x holding values of `x_pieces` bf16
    pieces, `nf4_amx.forward`): the decode path; large products on AMX tiles where the host has them;
    else tiles each dequantised and multiplied in one thread, the tiles split over fuel's threads
    (`weight_tiles`, as QMatMul's). One serial dequantisation of 8 MiB tiles before a two-thread GEMM took
    1.8x as long at 4096 x 4096, M = 64. Each output element's sum is fixed by the shape and the host,
    whatever the tiling and the thread count."""
    rows, k = x.shape
    n = w.shape[0]
    if rows <= DECODE_MAX_ROWS and bs % 32 == 0:
        _decode_rows(x, w, absmax, bs, out)
        return
    if (USE_AMX and k >= AMX_MIN_K and n * k >= AMX_MIN_WEIGHTS
            and nf4_amx.forward(x, w, absmax, bs, out, x_pieces)):
        return
    nb = k // bs
    if not post_tiles(_tiles, x, n, out, (w.ctypes.data, w.shape[1], absmax.ctypes.data, nb, _LUT.ctypes.data)):
        tiled_product(x, n, lambda n0, n1, tile: _dequant_tile(w, absmax, _LUT, bs, n0, n1, 0, nb, tile), out)


def _transposed(g: np.ndarray, w: np.ndarray, absmax: np.ndarray, bs: int, out: np.ndarray) -> None:
    """out [R, K] <- g [R, N] @ dequant(W), over column tiles of whole blocks (one GEMM each: every
    output element's sum over N stays inside one BLAS call)."""
    n, k = w.shape[0], out.shape[1]
    nb = k // bs
    per_tile = max(1, min(nb, TILE_BYTES // (4 * n * bs)))
    buf = POOL.empty((per_tile * bs * n,), np.dtype(np.float32))
    for b0 in range(0, nb, per_tile):
        b1 = min(nb, b0 + per_tile)
        t = _scratch(n, (b1 - b0) * bs, buf)
        _dequant_tile(w, absmax, _LUT, bs, 0, n, b0, b1, t)
        row_blocks.matmul(g, t, out[:, b0 * bs:b1 * bs])


# bf16 pieces (`nf4_amx`) of the values an activation dtype widens to: f32 takes three.
_PIECES = {DType.BF16.np: 1, DType.F16.np: 2}


def nf4_kernel(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
    act, w, absmax = inputs
    if out.size == 0:
        return
    acc = out if out.dtype == np.float32 else POOL.empty(out.shape, np.dtype(np.float32))
    x = act if act.dtype == np.float32 else widened(act)
    rows = math.prod(act.shape[:-1])
    x2, o2 = x.reshape(rows, act.shape[-1]), acc.reshape(rows, out.shape[-1])
    if x2.shape[1] == 0:  # an empty contraction (K = 0, or N = 0 for the transposed product)
        o2.fill(0)
    elif params.transpose:
        _transposed(x2, w, absmax, params.block_size, o2)
    else:
        _forward(x2, w, absmax, params.block_size, o2, _PIECES.get(act.dtype, nf4_amx.PIECES))
    if acc is not out:
        narrow_into(acc, out)


@native.fused_form(nf4_kernel)
def nf4_form(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> native.Forms | None:
    """One f32 activation row of the forward product by table: the jobs `_decode_rows` runs a call."""
    return table_forms(inputs, out, params, _LUT) if USE_TABLE else None


def nf4_cost(shapes: Sequence[Shape], dtypes: Sequence[DType], params: Any) -> CostEstimate:
    """2·N·K flops per activation row (plus the N·K scale products); the packed weight, absmax, the
    activations and the output each move once."""
    act, w = shapes[0], shapes[1]
    rows = math.prod(act[:-1])
    n, k = w[0], 2 * w[1]
    moved = sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes, strict=True))
    return CostEstimate(flops=2 * rows * n * k + n * k, bytes_moved=moved)


# |out - ref| <= max_relative·|ref| + max_absolute·S against float64 dequant-then-matmul, with
# S = |act| @ |dequant(W)|ᵀ per element (the contraction rule). Twice the worst error
# `python -m fuel.testing.measure Nf4Matmul` found over seeds 0-59; the half types compute in f32 and
# round once on store, so their absolute part is the f32 impl's.
PRECISION = {
    DType.F32: PrecisionGuarantee(True, None, 8.5e-7, 3.4e-7, "exact f32 weights, f32 FMA / sgemm accumulation"),
    DType.BF16: PrecisionGuarantee(True, None, 7.9e-3, 3.4e-7, "exact widening, f32 compute, one RNE rounding"),
    DType.F16: PrecisionGuarantee(True, None, 9.8e-4, 3.4e-7, "exact widening, f32 compute, one rounding on store"),
}


def register(registry: FusedKernelRegistry) -> None:
    rev = revision_of(nf4_kernel)
    for dt in (DType.F32, DType.BF16, DType.F16):
        registry.register(BackendImpl(FusedOps.NF4_MATMUL, "cpu", nf4_kernel, (dt, DType.U8, DType.F32, dt),
                                      nf4_cost, PRECISION[dt], CONTIGUOUS_ONLY, rev))
