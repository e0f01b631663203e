"""How a GGUF block is decoded (`Emit`, `block_intrinsic`), and the K-quant decoders (Q2_K..Q6_K).

Each block type is a short Python function that emits its decode as LLVM vector IR through `Emit`:
byte loads (16 or 32 lanes at once), integer lane ops in 32 bits, float32 ops, vector stores.
`block_intrinsic` turns it into a Numba intrinsic `(block, out) -> None` that `gguf_dequant` wraps in
the public `dequant_*` functions. As Numba loops the same decoders are slower: unrolled,
their stores may alias the block's loads, so LLVM keeps them scalar; as loops, the vectoriser adds alias
checks and scalar tails to every block (docs/performance/quant.md, "gguf_kquants").

Every float32 operation is gguf-py's, in its order, one rounding each (LLVM forms no fused
multiply-add without fast-math flags): `(d * sc) * q - (dmin * m)` for the K-quants, with d, dmin
widened exactly from fp16 (subnormals, inf and NaN included). `gguf_blocks` is the entry point.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from fuel.cpu.simd.vecmath import f16_bits_to_f32

_I8, _I32, _F32 = ir.IntType(8), ir.IntType(32), ir.FloatType()


def _f16_to_f32(builder: Any, lo: Any, hi: Any) -> Any:
    """The float32 value of the little-endian f16 in bytes lo, hi (i8), exactly (`f16_bits_to_f32`)."""
    x = builder.or_(builder.zext(lo, _I32), builder.shl(builder.zext(hi, _I32), ir.Constant(_I32, 8)))
    return f16_bits_to_f32(builder, x)


class Emit:
    """The IR of one block's decode: reads `block` (uint8), writes `out` (float32).

    Integers are i32 scalars or <n x i32> lanes, floats f32 or <n x float>. An integer operand may be a
    Python int (a constant); a scalar operand of a vector one is splatted."""

    def __init__(self, context: Any, builder: Any, signature: Any, args: Any) -> None:
        self.b = builder
        self.src = context.make_array(signature.args[0])(context, builder, args[0]).data
        self.dst = context.make_array(signature.args[1])(context, builder, args[1]).data

    def _load(self, i: int, n: int) -> Any:
        at = self.b.gep(self.src, [ir.Constant(_I32, i)])
        if n == 1:
            return self.b.load(at)
        return self.b.load(self.b.bitcast(at, ir.VectorType(_I8, n).as_pointer()), align=1)

    def byte(self, i: int) -> Any:
        """block[i], as i32."""
        return self.b.zext(self._load(i, 1), _I32)

    def bytes(self, i: int, n: int, signed: bool = False) -> Any:
        """block[i:i + n] as n i32 lanes (sign-extended: the bytes as int8)."""
        v = self._load(i, n)
        ty = ir.VectorType(_I32, n)
        return self.b.sext(v, ty) if signed else self.b.zext(v, ty)

    def f16(self, i: int) -> Any:
        """The f16 at block[i:i + 2] as float32."""
        return _f16_to_f32(self.b, self._load(i, 1), self._load(i + 1, 1))

    def _pair(self, x: Any, y: Any) -> tuple[Any, Any]:
        """x and y as values of one type: a vector if either is, ints made constants, scalars splatted."""
        values = [v for v in (x, y) if not isinstance(v, int)]
        ty = next((v.type for v in values if isinstance(v.type, ir.VectorType)), values[0].type)
        return self._as(x, ty), self._as(y, ty)

    def _as(self, v: Any, ty: Any) -> Any:
        """v (a Python int, a scalar or a vector) as a value of type ty."""
        if isinstance(v, int):
            return ir.Constant(ty, [v] * ty.count if isinstance(ty, ir.VectorType) else v)
        if isinstance(ty, ir.VectorType) and not isinstance(v.type, ir.VectorType):
            one = self.b.insert_element(ir.Constant(ty, ir.Undefined), v, ir.Constant(_I32, 0))
            return self.b.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, ty.count), [0] * ty.count))
        return v

    def word(self, i: int) -> Any:
        """The little-endian uint32 at block[i:i + 4], as i32."""
        w = self.byte(i)
        for k in range(1, 4):
            w = self.or_(w, self.shl(self.byte(i + k), 8 * k))
        return w

    def bits(self, x: Any, shift: int, mask: int) -> Any:
        """(x >> shift) & mask."""
        return self.b.and_(self.b.lshr(*self._pair(x, shift)), self._as(mask, x.type))

    def shl(self, x: Any, k: int) -> Any:
        return self.b.shl(*self._pair(x, k))

    def or_(self, x: Any, y: Any) -> Any:
        return self.b.or_(*self._pair(x, y))

    def isub(self, x: Any, y: Any) -> Any:
        return self.b.sub(*self._pair(x, y))

    def lane_bits(self, word: Any, first: int, n: int) -> Any:
        """Bits first .. first + n - 1 of the scalar word, one a lane."""
        shifts = ir.Constant(ir.VectorType(_I32, n), list(range(first, first + n)))
        return self.bits(self.b.lshr(self._as(word, shifts.type), shifts), 0, 1)

    def f32(self, x: Any) -> Any:
        """Integers (|x| < 2^24) as float32, exactly."""
        ty = ir.VectorType(_F32, x.type.count) if isinstance(x.type, ir.VectorType) else _F32
        return self.b.sitofp(x, ty)

    def mul(self, x: Any, y: Any) -> Any:
        return self.b.fmul(*self._pair(x, y))

    def sub(self, x: Any, y: Any) -> Any:
        return self.b.fsub(*self._pair(x, y))

    def add_first_nan(self, x: Any, y: Any) -> Any:
        """x + y, returning x's NaN where x is NaN, as NumPy's x + y does on x86 (which returns the first
        operand's NaN; LLVM may swap the operands of an add)."""
        x, y = self._pair(x, y)
        return self.b.select(self.b.fcmp_unordered("uno", x, x), x, self.b.fadd(x, y))

    def halves(self, x: Any, y: Any, n: int) -> Any:
        """n lanes: x in the first n/2, y in the rest (the scales of two 16-element sub-blocks)."""
        ty = ir.VectorType(x.type, n)
        first = ir.Constant(ir.VectorType(ir.IntType(1), n), [j < n // 2 for j in range(n)])
        return self.b.select(first, self._as(x, ty), self._as(y, ty))

    def store(self, at: int, v: Any) -> None:
        """out[at:at + lanes] = v."""
        ptr = self.b.gep(self.dst, [ir.Constant(_I32, at)])
        self.b.store(v, self.b.bitcast(ptr, v.type.as_pointer()), align=4)


def block_intrinsic(emit: Callable[[Emit], None]) -> Any:
    """A Numba intrinsic `(block, out) -> None` running `emit`'s IR: block a C-contiguous uint8 1-D
    array, out a C-contiguous float32 1-D array (their lengths are not checked)."""

    def typer(typingctx: Any, block: Any, out: Any) -> Any:
        for a, dtype in ((block, types.uint8), (out, types.float32)):
            if not (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == dtype):
                return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            emit(Emit(context, builder, signature, args))
            return context.get_dummy_value()

        return types.none(block, out), codegen

    typer.__name__ = typer.__qualname__ = f"ir_{emit.__name__.lstrip('_')}"
    return intrinsic(typer)


@intrinsic
def _f16_bytes_intrinsic(typingctx: Any, lo: Any, hi: Any) -> Any:
    """The float32 value of the f16 in bytes (lo, hi), exactly (for callers reading scales by hand)."""
    if lo != types.uint8 or hi != types.uint8:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return _f16_to_f32(builder, args[0], args[1])

    return types.float32(types.uint8, types.uint8), codegen


# Typed as Any: Numba fills in the typing context when jitted code calls an intrinsic.
f16_bytes: Any = _f16_bytes_intrinsic


def _q2k(e: Emit) -> None:
    """Q2_K (84 bytes): 16 scale bytes (per 16 elements: low nibble scale, high nibble min), 64 bytes
    of 2-bit codes (byte 32h + l, bits 2s: element 128h + 32s + l), f16 d, f16 dmin."""
    d, dmin = e.f16(80), e.f16(82)
    for h in range(2):
        qs = e.bytes(16 + 32 * h, 32)
        for s in range(4):
            sc0, sc1 = e.byte(8 * h + 2 * s), e.byte(8 * h + 2 * s + 1)
            dl = e.halves(e.mul(d, e.f32(e.bits(sc0, 0, 15))), e.mul(d, e.f32(e.bits(sc1, 0, 15))), 32)
            ml = e.halves(e.mul(dmin, e.f32(e.bits(sc0, 4, 15))), e.mul(dmin, e.f32(e.bits(sc1, 4, 15))), 32)
            e.store(128 * h + 32 * s, e.sub(e.mul(dl, e.f32(e.bits(qs, 2 * s, 3))), ml))


def _scale_k3(e: Emit, i: int) -> Any:
    """Q3_K's 6-bit scale i: low 4 bits from block[96:104], high 2 from block[104:108]."""
    low = e.bits(e.byte(96 + i % 8), 4 * (i // 8), 15)
    return e.or_(low, e.shl(e.bits(e.byte(104 + i % 4), 2 * (i // 4), 3), 4))


def _q3k(e: Emit) -> None:
    """Q3_K (110 bytes): 32 bytes of high bits (bit b of byte l: element 32b + l), 64 bytes of 2-bit
    codes (as Q2_K), 12 bytes of 6-bit scales (per 16 elements), f16 d; (d * (sc - 32)) * q, where
    q = code - 4 when the high bit is clear (= (code | high << 2) - 4)."""
    d = e.f16(108)
    hmask = e.bytes(0, 32)
    for h in range(2):
        qs = e.bytes(32 + 32 * h, 32)
        for s in range(4):
            i = 8 * h + 2 * s
            dl = e.halves(e.mul(d, e.f32(e.isub(_scale_k3(e, i), 32))),
                          e.mul(d, e.f32(e.isub(_scale_k3(e, i + 1), 32))), 32)
            q = e.isub(e.or_(e.bits(qs, 2 * s, 3), e.shl(e.bits(hmask, 4 * h + s, 1), 2)), 4)
            e.store(128 * h + 32 * s, e.mul(dl, e.f32(q)))


def _scale_min_k4(e: Emit, j: int) -> tuple[Any, Any]:
    """Sub-block j's 6-bit scale and min, packed in the 12 bytes block[4:16] (Q4_K, Q5_K)."""
    if j < 4:
        return e.bits(e.byte(4 + j), 0, 63), e.bits(e.byte(8 + j), 0, 63)
    packed = e.byte(8 + j)
    return (e.or_(e.bits(packed, 0, 15), e.shl(e.bits(e.byte(j), 6, 3), 4)),
            e.or_(e.bits(packed, 4, 15), e.shl(e.bits(e.byte(4 + j), 6, 3), 4)))


def _q4k_q5k(e: Emit, high: bool) -> None:
    """Q4_K (144 bytes): f16 d, f16 dmin, 12 bytes of 6-bit scales and mins (per 32 elements), 128
    bytes of nibbles (byte 32c + l: element 64c + l low, 64c + 32 + l high). Q5_K (176 bytes): the
    same with 32 bytes of high bits (bit b of byte l: element 32b + l) before the nibbles."""
    d, dmin = e.f16(0), e.f16(2)
    qh = e.bytes(16, 32) if high else None
    for c in range(4):
        qs = e.bytes((48 if high else 16) + 32 * c, 32)
        for nib in range(2):
            sub = 2 * c + nib
            sc, m = _scale_min_k4(e, sub)
            q = e.bits(qs, 4 * nib, 15)
            if qh is not None:
                q = e.or_(q, e.shl(e.bits(qh, sub, 1), 4))
            e.store(32 * sub, e.sub(e.mul(e.mul(d, e.f32(sc)), e.f32(q)), e.mul(dmin, e.f32(m))))


def _q4k(e: Emit) -> None:
    _q4k_q5k(e, high=False)


def _q5k(e: Emit) -> None:
    _q4k_q5k(e, high=True)


def _q6k(e: Emit) -> None:
    """Q6_K (210 bytes): 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales (per
    16 elements), f16 d; (d * sc) * (q - 32). Element 128h + 32s + l: low nibble of byte 64h + 32(s % 2)
    + l (the high nibble for s >= 2), high part bits 2s of byte 128 + 32h + l."""
    d = e.f16(208)
    scales = [e.f32(e.bytes(192 + 8 * h, 8, signed=True)) for h in range(2)]
    for h in range(2):
        ql = [e.bytes(64 * h + 32 * half, 32) for half in range(2)]
        qh = e.bytes(128 + 32 * h, 32)
        for s in range(4):
            sc = [e.b.extract_element(scales[h], ir.Constant(_I32, 2 * s + k)) for k in range(2)]
            dl = e.halves(e.mul(d, sc[0]), e.mul(d, sc[1]), 32)
            q = e.or_(e.bits(ql[s % 2], 4 * (s // 2), 15), e.shl(e.bits(qh, 2 * s, 3), 4))
            e.store(128 * h + 32 * s, e.mul(dl, e.f32(e.isub(q, 32))))


ir_q2k = block_intrinsic(_q2k)
ir_q3k = block_intrinsic(_q3k)
ir_q4k = block_intrinsic(_q4k)
ir_q5k = block_intrinsic(_q5k)
ir_q6k = block_intrinsic(_q6k)
