"""16-lane float vectors as Numba values (`f32x16`), for kernels that need code the vectoriser will not write.

A Numba loop over a 16- or 32-element block is either unrolled to scalar code (its stores may alias its
loads, which the SLP vectoriser does not check at run time) or vectorised behind alias checks run for every
block; both are slower than straight-line vector code (docs/performance/runtime.md, "simd16"). Here a
vector is a value of its own Numba type, an LLVM `<16 x float>`: a kernel keeps its accumulators in local
variables (registers: no store and reload between blocks) and builds each block's codes straight from the
packed bytes. LLVM lowers the 16 lanes to one zmm or two ymm registers, whichever the host has.

Arrays are addressed by element offset, unchecked: the caller keeps every lane inside the array.
Arithmetic is plain IEEE f32, each operation rounded once in the order its docstring gives (`fma` and
`fmas` are fused multiply-adds: one rounding, by `llvm.fma`); no fast-math flags, so no compiler choice
changes a result.
"""

from __future__ import annotations

from typing import Any

from llvmlite import binding, ir
from numba import types
from numba.core import cgutils
from numba.core.datamodel import models, register_default
from numba.extending import intrinsic

from fuel.cpu.simd.vecmath import f16_bits_to_f32

LANES = 16  # lanes of a vector value
_HOST = binding.get_host_cpu_features()  # Numba compiles for the host CPU
_F16C = bool(_HOST.get("f16c"))
# `codes` works in 32-bit lanes without AVX-512: two vpmovzxbd straight from memory and the shifts on
# whole lanes, where 8-bit lanes take a shift, a mask, two shuffles and four widenings per 16 bytes
# (docs/performance/runtime.md, "simd16").
_CODE_BITS = 8 if _HOST.get("avx512f") else 32
IR_I8, IR_I32, IR_F32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
IR_V8, IR_VF = ir.VectorType(IR_I8, LANES), ir.VectorType(IR_F32, LANES)


class F32x16(types.Type):
    """Numba's type of a 16-lane float32 vector value."""

    def __init__(self) -> None:
        super().__init__(name="f32x16")


VEC = F32x16()


@register_default(F32x16)
class _F32x16Model(models.PrimitiveModel):
    def __init__(self, dmm: Any, fe_type: Any) -> None:
        super().__init__(dmm, fe_type, IR_VF)


def element_pointer(context: Any, builder: Any, aryty: Any, ary: Any, off: Any, ty: Any) -> Any:
    """A ty* at element `off` of the array."""
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [off]), ty.as_pointer())


def splat_lanes(builder: Any, v: Any, vty: Any) -> Any:
    """v in every lane of a vty."""
    undef = ir.Constant(vty, ir.Undefined)
    one = builder.insert_element(undef, v, ir.Constant(IR_I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(IR_I32, vty.count), [0] * vty.count))


def _s8(context: Any, builder: Any, v: Any, ty: Any) -> Any:
    return splat_lanes(builder, context.cast(builder, v, ty, types.int8), IR_V8)


def splat_f32(context: Any, builder: Any, v: Any, ty: Any) -> Any:
    """The scalar v (of numba type ty) as f32 in every lane of a 16-float vector."""
    return splat_lanes(builder, context.cast(builder, v, ty, types.float32), IR_VF)


def fma_lanes(builder: Any, a: Any, b: Any, c: Any) -> Any:
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(IR_VF, [IR_VF] * 3), "llvm.fma.v16f32")
    return builder.call(fn, [a, b, c])


def _xload(context: Any, builder: Any, aryty: Any, ary: Any, off: Any) -> Any:
    return builder.load(element_pointer(context, builder, aryty, ary, off, IR_VF), align=4)


def _code_ints(context: Any, builder: Any, at: Any, args: Any, flags: int, lanes: int, bits: int = 8) -> Any:
    """`codes`' integer work on `lanes` lanes of `bits` bits: (src[off + t] >> sh & mask | high_t << hshl) - sub."""
    vt = ir.VectorType(ir.IntType(bits), lanes)
    wide = bits > 8

    def splat(i: int) -> Any:
        return splat_lanes(builder, context.cast(builder, args[i], at[i], types.int32 if wide else types.int8), vt)

    def load(i: int, signed: bool = False) -> Any:
        at_i = element_pointer(context, builder, at[0], args[0], args[i], ir.VectorType(IR_I8, lanes))
        x = builder.load(at_i, align=1)
        return (builder.sext if signed else builder.zext)(x, vt) if wide else x

    x = load(1, signed=bool(flags & 1))
    if not flags & 1:
        x = builder.and_(builder.lshr(x, splat(2)), splat(3))
    if flags & 2:
        h = builder.and_(builder.lshr(load(4), splat(5)), splat(6))
        x = builder.or_(x, builder.shl(h, splat(7)))
    if flags & 4:  # lane t takes bit t of (word >> hsh)
        word = builder.lshr(context.cast(builder, args[4], at[4], types.uint32),
                            context.cast(builder, args[5], at[5], types.uint32))
        if wide:
            bit = builder.and_(builder.lshr(splat_lanes(builder, word, vt), ir.Constant(vt, list(range(lanes)))),
                               ir.Constant(vt, [1] * lanes))
        else:  # byte t >> 3 of the word, bit t & 7
            by = builder.bitcast(word, ir.VectorType(IR_I8, 4))
            spread = builder.shuffle_vector(by, ir.Constant(ir.VectorType(IR_I8, 4), ir.Undefined),
                                            ir.Constant(ir.VectorType(IR_I32, lanes), [t >> 3 for t in range(lanes)]))
            on = builder.and_(spread, ir.Constant(vt, [1 << (t & 7) for t in range(lanes)]))
            bit = builder.zext(builder.icmp_unsigned("!=", on, ir.Constant(vt, [0] * lanes)), vt)
        x = builder.or_(x, builder.shl(bit, splat(7)))
    return builder.sub(x, splat(8))


@intrinsic(prefer_literal=True)
def _codes(typingctx: Any, src: Any, off: Any, sh: Any, mask: Any, hi: Any, hsh: Any, hmask: Any, hshl: Any,
           sub: Any, mode: Any) -> Any:
    """16 packed integer codes as exact floats: (src[off + t] >> sh & mask | high_t << hshl) - sub, t < 16,
    worked in 8-bit lanes (every code of every GGUF type fits one) on AVX-512 hosts, in 32-bit lanes
    elsewhere (`_CODE_BITS`); the same integers either way. mode & 1: the signed byte src[off + t]
    itself; mode & 2: high_t = src[hi + t] >> hsh & hmask; mode & 4: high_t = bit hsh + t of the 32-bit
    word `hi`. Shifts are below 8. mode must be a literal."""
    if not isinstance(mode, types.IntegerLiteral):
        return None
    flags = int(mode.literal_value)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.sitofp(_code_ints(context, builder, signature.args, args, flags, LANES, _CODE_BITS), IR_VF)

    return VEC(src, off, sh, mask, hi, hsh, hmask, hshl, sub, mode), codegen


@intrinsic(prefer_literal=True)
def _codes2(typingctx: Any, src: Any, off: Any, sh: Any, mask: Any, hi: Any, hsh: Any, hmask: Any, hshl: Any,
            sub: Any, mode: Any) -> Any:
    """`codes` of 32 adjacent bytes as two vectors (lanes 0-15, 16-31), the integer work done once on 32
    8-bit lanes (one 256-bit operation where two 128-bit ones were: Q6_K's one-row decode 8% faster).
    mode 1 or 2 (mode 4's bits are per 16 lanes)."""
    if not isinstance(mode, types.IntegerLiteral) or int(mode.literal_value) & 4:
        return None
    flags = int(mode.literal_value)
    pair = types.UniTuple(VEC, 2)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        x = _code_ints(context, builder, signature.args, args, flags, 2 * LANES)
        halves = [builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(IR_I32, LANES), list(range(h, h + LANES))))
                  for h in (0, LANES)]
        return context.make_tuple(builder, pair, [builder.sitofp(v, IR_VF) for v in halves])

    return pair(src, off, sh, mask, hi, hsh, hmask, hshl, sub, mode), codegen


@intrinsic
def _bytes16(typingctx: Any, w0: Any, w1: Any, w2: Any, w3: Any, sub: Any) -> Any:
    """The 16 bytes of four little-endian 32-bit words, each less sub, as exact floats (8-bit lanes)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        words = ir.Constant(ir.VectorType(IR_I32, 4), ir.Undefined)
        for i in range(4):
            words = builder.insert_element(words, context.cast(builder, args[i], signature.args[i], types.uint32),
                                           ir.Constant(IR_I32, i))
        x = builder.sub(builder.bitcast(words, IR_V8), _s8(context, builder, args[4], signature.args[4]))
        return builder.sitofp(x, IR_VF)

    return VEC(w0, w1, w2, w3, sub), codegen


@intrinsic
def _f16_intrinsic(typingctx: Any, row: Any, off: Any) -> Any:
    """The little-endian f16 at row[off:off + 2] widened to float32, exactly. With F16C, LLVM's `fpext`
    (one vcvtph2ps); else integer work: exponent and mantissa shifted into place and scaled by 2^112
    (which normalises subnormals too), inf/NaN re-marked. The two differ only in a signalling NaN's
    quiet bit."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        h16 = builder.load(element_pointer(context, builder, signature.args[0], args[0], args[1], ir.IntType(16)),
                           align=1)
        if _F16C:
            return builder.fpext(builder.bitcast(h16, ir.HalfType()), IR_F32)
        return f16_bits_to_f32(builder, builder.zext(h16, IR_I32))

    return types.float32(row, off), codegen


@intrinsic
def _u32_intrinsic(typingctx: Any, row: Any, off: Any) -> Any:
    """The little-endian 32-bit word at row[off:off + 4] (uint8 row, unchecked), zero-extended to int64:
    one load, where four indexed byte reads cost a wraparound test each (Q5_0's high bits, per block)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        word = builder.load(element_pointer(context, builder, signature.args[0], args[0], args[1], IR_I32), align=1)
        return builder.zext(word, ir.IntType(64))

    return types.int64(row, off), codegen


def _with_scalar(op: str) -> Any:
    """The intrinsic `v op s` (s a scalar, in every lane) for the IR builder's float operation `op`."""

    def typer(typingctx: Any, v: Any, s: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return getattr(builder, op)(args[0], splat_f32(context, builder, args[1], signature.args[1]))

        return VEC(v, s), codegen

    return intrinsic(typer)


_muls = _with_scalar("fmul")  # v * s
_adds = _with_scalar("fadd")  # v + s


@intrinsic
def _muls2(typingctx: Any, v: Any, s0: Any, s1: Any) -> Any:
    """v * s0 in lanes 0-7, v * s1 in lanes 8-15."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        at = signature.args
        a, b = (context.cast(builder, args[i], at[i], types.float32) for i in (1, 2))
        s = ir.Constant(IR_VF, ir.Undefined)
        for t in range(LANES):
            s = builder.insert_element(s, a if t < 8 else b, ir.Constant(IR_I32, t))
        return builder.fmul(args[0], s)

    return VEC(v, s0, s1), codegen


@intrinsic
def _fmas(typingctx: Any, s: Any, v: Any, acc: Any) -> Any:
    """acc + s * v (s a scalar), fused."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return fma_lanes(builder, splat_f32(context, builder, args[0], signature.args[0]), args[1], args[2])

    return VEC(s, v, acc), codegen


@intrinsic
def _fma_intrinsic(typingctx: Any, a: Any, b: Any, acc: Any) -> Any:
    """acc + a * b, fused."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return fma_lanes(builder, args[0], args[1], args[2])

    return VEC(a, b, acc), codegen


@intrinsic
def _fmax(typingctx: Any, w: Any, x: Any, xoff: Any, acc: Any) -> Any:
    """acc + w * x[xoff:xoff + 16], fused."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return fma_lanes(builder, args[0], _xload(context, builder, signature.args[1], args[1], args[2]), args[3])

    return VEC(w, x, xoff, acc), codegen


@intrinsic
def _mul(typingctx: Any, a: Any, b: Any) -> Any:
    """a * b."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fmul(args[0], args[1])

    return VEC(a, b), codegen


@intrinsic
def _add(typingctx: Any, a: Any, b: Any) -> Any:
    """a + b."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fadd(args[0], args[1])

    return VEC(a, b), codegen


@intrinsic
def _hi8(typingctx: Any, v: Any) -> Any:
    """v with lanes 0-7 zero (exactly: a lane select, no arithmetic)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        idx = ir.Constant(ir.VectorType(IR_I32, LANES), [LANES + t if t < 8 else t for t in range(LANES)])
        return builder.shuffle_vector(args[0], ir.Constant(IR_VF, [0.0] * LANES), idx)

    return VEC(v), codegen


@intrinsic
def _prefetch(typingctx: Any, a: Any, off: Any) -> Any:
    """A read prefetch of the cache line holding a[off] into L1 (a hint: no fault, no effect on any value)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ptr = element_pointer(context, builder, signature.args[0], args[0], args[1], IR_I8)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [IR_I8.as_pointer(), IR_I32,
                                            IR_I32, IR_I32]), "llvm.prefetch.p0i8")
        builder.call(fn, [ptr, ir.Constant(IR_I32, 0), ir.Constant(IR_I32, 3), ir.Constant(IR_I32, 1)])
        return context.get_dummy_value()

    return types.void(a, off), codegen


@intrinsic
def _zero(typingctx: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return ir.Constant(IR_VF, [0.0] * LANES)

    return VEC(), codegen


@intrinsic
def _load(typingctx: Any, a: Any, off: Any) -> Any:
    """a[off:off + 16] (float32 a)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return _xload(context, builder, signature.args[0], args[0], args[1])

    return VEC(a, off), codegen


@intrinsic
def _store(typingctx: Any, a: Any, off: Any, v: Any) -> Any:
    """a[off:off + 16] = v (float32 a)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        builder.store(args[2], element_pointer(context, builder, signature.args[0], args[0], args[1], IR_VF), align=4)
        return context.get_dummy_value()

    return types.void(a, off, v), codegen


@intrinsic
def _hsum(typingctx: Any, v: Any) -> Any:
    """Σ of the lanes, a fixed tree: lanes t and t + 8 added, then t and t + 4, t + 2, t + 1."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        x, n = args[0], LANES
        while n > 1:
            n //= 2
            ty = ir.VectorType(IR_I32, n)
            lo = builder.shuffle_vector(x, x, ir.Constant(ty, list(range(n))))
            hi = builder.shuffle_vector(x, x, ir.Constant(ty, list(range(n, 2 * n))))
            x = builder.fadd(lo, hi)
        return builder.extract_element(x, ir.Constant(IR_I32, 0))

    return types.float32(v), codegen


@intrinsic
def _stack_f32_intrinsic(typingctx: Any, size: Any) -> Any:
    """A pointer to `size` (a literal) float32 on the calling function's stack (its entry block), passed
    through an empty asm statement: LLVM then keeps the scratch in memory rather than promoting it to
    registers, so a scalar read from it is a broadcast load folded into its FMA ({1to16}) rather than a few
    shuffles (docs/performance/runtime.md, "simd16")."""
    if not isinstance(size, types.IntegerLiteral):
        return None
    count = int(size.literal_value)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ptr = cgutils.alloca_once(builder, IR_F32, size=count)
        opaque = ir.InlineAsm(ir.FunctionType(ptr.type, [ptr.type]), "", "=r,0")
        return builder.call(opaque, [ptr])

    return types.CPointer(types.float32)(size), codegen


# Typed as Any: Numba fills in the typing context when jitted code calls an intrinsic.
codes: Any = _codes
codes2: Any = _codes2
bytes16: Any = _bytes16
f16_at: Any = _f16_intrinsic
u32_at: Any = _u32_intrinsic
muls: Any = _muls
muls2: Any = _muls2
adds: Any = _adds
fmas: Any = _fmas
fma: Any = _fma_intrinsic
fmax: Any = _fmax
vmul: Any = _mul
vadd: Any = _add
vzero: Any = _zero
prefetch: Any = _prefetch
hi8: Any = _hi8
vload: Any = _load
vstore: Any = _store
hsum: Any = _hsum
stack_f32: Any = _stack_f32_intrinsic
