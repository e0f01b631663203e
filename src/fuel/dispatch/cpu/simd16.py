"""16-lane LLVM vector operations for Numba kernels, as intrinsics: code a loop would leave to the vectoriser.

A Numba loop over a 16- or 32-element block is either unrolled to scalar code (its stores may alias
its loads, which the SLP vectoriser does not check at run time) or vectorised behind alias checks run
for every block; for GGUF decoding that was 2.7x slower than these straight-line vector operations.
Arrays are addressed by element offset, unchecked: the caller keeps every lane inside the array.
Floating-point operations are plain IEEE ones (no fast-math, no fused multiply-add) in the order each
docstring gives, so no compiler choice changes a result.
"""

from __future__ import annotations

from typing import Any

from llvmlite import binding, ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from fuel.dispatch.cpu.vecmath import f16_bits_to_f32

_W = 16  # lanes
_F16C = bool(binding.get_host_cpu_features().get("f16c"))  # Numba compiles for the host CPU
_I32, _F32 = ir.IntType(32), ir.FloatType()
_V8, _V32, _VF = ir.VectorType(ir.IntType(8), _W), ir.VectorType(_I32, _W), ir.VectorType(_F32, _W)


def _ptr(context: Any, builder: Any, aryty: Any, ary: Any, off: Any, vty: Any, offset: int = 0) -> Any:
    """A vty* at element off + offset of the array."""
    data = context.make_array(aryty)(context, builder, ary).data
    ptr = builder.gep(builder.gep(data, [off]), [ir.Constant(ir.IntType(64), offset)])
    return builder.bitcast(ptr, vty.as_pointer())


def _splat(builder: Any, v: Any, vty: Any) -> Any:
    undef = ir.Constant(vty, ir.Undefined)
    one = builder.insert_element(undef, v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(_I32, _W), [0] * _W))


@intrinsic(prefer_literal=True)
def _unpack16_intrinsic(typingctx: Any, dst: Any, doff: Any, src: Any, off: Any, sh: Any, mask: Any, hi: Any,
                        hsh: Any, hmask: Any, hshl: Any, sub: Any, scale: Any, bias: Any, mode: Any) -> Any:
    """Packed integer codes to floats: dst[doff + t] = scale * (code_t - sub) (+ bias) for t < 16, in
    f32 (the integer difference is exact, then one multiply and one add, each rounded).

    code_t = src[off + t] >> sh & mask (uint8 src), or the signed byte src[off + t] (mode & 1); OR'd
    with a high part shifted left by hshl: src[hi + t] >> hsh & hmask (mode & 2), or bit hsh + t of the
    32-bit word `hi` (mode & 4). mode & 8 adds the bias (else it is ignored). mode must be a literal."""
    if not isinstance(mode, types.IntegerLiteral):
        return None
    flags = int(mode.literal_value)
    sig = types.void(dst, doff, src, off, sh, mask, hi, hsh, hmask, hshl, sub, scale, bias, mode)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        at = signature.args

        def vec(i: int) -> Any:
            return _splat(builder, context.cast(builder, args[i], at[i], types.int32), _V32)

        def load8(i: int) -> Any:
            return builder.load(_ptr(context, builder, at[2], args[2], args[i], _V8), align=1)

        if flags & 1:
            x = builder.sext(load8(3), _V32)
        else:
            x = builder.and_(builder.lshr(builder.zext(load8(3), _V32), vec(4)), vec(5))
        if flags & 2:
            h = builder.and_(builder.lshr(builder.zext(load8(6), _V32), vec(7)), vec(8))
            x = builder.or_(x, builder.shl(h, vec(9)))
        if flags & 4:
            bits = builder.lshr(vec(6), builder.add(vec(7), ir.Constant(_V32, list(range(_W)))))
            x = builder.or_(x, builder.shl(builder.and_(bits, ir.Constant(_V32, [1] * _W)), vec(9)))
        f = builder.sitofp(builder.sub(x, vec(10)), _VF)
        f = builder.fmul(f, _splat(builder, context.cast(builder, args[11], at[11], types.float32), _VF))
        if flags & 8:
            f = builder.fadd(f, _splat(builder, context.cast(builder, args[12], at[12], types.float32), _VF))
        builder.store(f, _ptr(context, builder, at[0], args[0], args[1], _VF), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _f16_intrinsic(typingctx: Any, row: Any, off: Any) -> Any:
    """The little-endian f16 at row[off:off + 2] widened to float32, exactly. With F16C, LLVM's `fpext`
    (one vcvtph2ps); else integer work: exponent and mantissa shifted into place and scaled by 2^112
    (which normalises subnormals too), inf/NaN re-marked. The two differ only in a signalling NaN's
    quiet bit."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        h16 = builder.load(_ptr(context, builder, signature.args[0], args[0], args[1], ir.IntType(16)), align=1)
        if _F16C:
            return builder.fpext(builder.bitcast(h16, ir.HalfType()), _F32)
        return f16_bits_to_f32(builder, builder.zext(h16, _I32))

    return types.float32(row, off), codegen


@intrinsic
def _mac16_intrinsic(typingctx: Any, acc: Any, aoff: Any, w: Any, woff: Any, x: Any, xoff: Any) -> Any:
    """acc[aoff + t] += w[woff + t] * x[xoff + t], t < 16 (a multiply, then an add)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        p = [_ptr(context, builder, signature.args[i], args[i], args[i + 1], _VF) for i in (0, 2, 4)]
        prod = builder.fmul(builder.load(p[1], align=4), builder.load(p[2], align=4))
        builder.store(builder.fadd(builder.load(p[0], align=4), prod), p[0], align=4)
        return context.get_dummy_value()

    return types.void(acc, aoff, w, woff, x, xoff), codegen


@intrinsic
def _dot256_intrinsic(typingctx: Any, acc: Any, aoff: Any, w: Any, woff: Any, x: Any, xoff: Any) -> Any:
    """acc[aoff + t] += Σ_c w[woff + 16c + t] * x[xoff + 16c + t] over c < 16, for t < 16: the 16
    products of each lane summed pairwise (a fixed tree), then added to the lane."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        at = signature.args

        def chunk(i: int, c: int) -> Any:
            return builder.load(_ptr(context, builder, at[i], args[i], args[i + 1], _VF, 16 * c), align=4)

        terms = [builder.fmul(chunk(2, c), chunk(4, c)) for c in range(16)]
        while len(terms) > 1:
            terms = [builder.fadd(terms[i], terms[i + 1]) for i in range(0, len(terms), 2)]
        pa = _ptr(context, builder, at[0], args[0], args[1], _VF)
        builder.store(builder.fadd(builder.load(pa, align=4), terms[0]), pa, align=4)
        return context.get_dummy_value()

    return types.void(acc, aoff, w, woff, x, xoff), codegen


@intrinsic
def _stack_f32_intrinsic(typingctx: Any, size: Any) -> Any:
    """A pointer to `size` (a literal) float32 on the calling function's stack (its entry block)."""
    if not isinstance(size, types.IntegerLiteral):
        return None
    count = int(size.literal_value)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return cgutils.alloca_once(builder, _F32, size=count)

    return types.CPointer(types.float32)(size), codegen


# Typed as Any: Numba fills in the typing context when jitted code calls an intrinsic.
unpack16: Any = _unpack16_intrinsic
f16_at: Any = _f16_intrinsic
mac16: Any = _mac16_intrinsic
dot256: Any = _dot256_intrinsic
stack_f32: Any = _stack_f32_intrinsic
