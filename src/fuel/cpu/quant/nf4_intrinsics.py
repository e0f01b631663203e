"""Nf4Matmul's LLVM-IR building blocks: the 16-entry NF4 table held in a vector register, the packed
nibbles of 16 bytes looked up at once (`nibble_tables`), blocks dequantised to memory, and the fused
dot products of one weight row with up to four activation rows that the decode path calls."""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from fuel.cpu.quant.nibble_tables import BYTE_LUT, ELEMENT_LANES, lookup32, permute16

DOT_MAX_ROWS = 4  # the largest activation row count a fused dot intrinsic takes

_I32 = ir.IntType(32)
_V16I = ir.VectorType(_I32, 16)
_V16F = ir.VectorType(ir.FloatType(), 16)
_V16B = ir.VectorType(ir.IntType(8), 16)
_EVEN = ir.Constant(_V16I, [x for i in range(8) for x in (i, 16 + i)])  # interleave (hi, lo): k 0..15
_ODD = ir.Constant(_V16I, [x for i in range(8, 16) for x in (i, 16 + i)])  # k 16..31
_ZERO = ir.Constant(_V16F, [0.0] * 16)
SPLIT_LANES = [(b, 1) for b in range(16)] + [(b, 0) for b in range(16)]  # `lookup32`: even k, then odd k


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
        hi, lo = lookup32(builder, at, table, SPLIT_LANES)
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


dequant_blocks: Any = intrinsic(_dequant_blocks_ir)


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


dot1, dot2, dot3, dot4 = (_make_dot(m) for m in range(1, DOT_MAX_ROWS + 1))
