"""Scalar building blocks that LLVM vectorises inside Numba loops: bit casts and a polynomial expf.

Numba has no scalar bit casts and widens 32-bit integer arithmetic to 64 bits, which halves the
vector width; these intrinsics emit the 32-bit LLVM instructions directly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

_I32 = ir.IntType(32)


def _c(k: int) -> ir.Constant:
    return ir.Constant(_I32, k)


@intrinsic
def _pow2_f32(typingctx: Any, n: Any) -> Any:
    """2**n as float32 for an integral float32 n in [-126, 127] (exponent bits, no multiply)."""
    if n != types.float32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        biased = builder.add(builder.fptosi(args[0], _I32), _c(127))
        return builder.bitcast(builder.shl(biased, _c(23)), ir.FloatType())

    return types.float32(types.float32), codegen


@intrinsic
def _bf16_to_f32(typingctx: Any, h: Any) -> Any:
    """Widen bf16 bits (uint16) to float32, exactly."""
    if h != types.uint16:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(builder.shl(builder.zext(args[0], _I32), _c(16)), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _f32_to_bf16(typingctx: Any, x: Any) -> Any:
    """Round float32 to bf16 bits (uint16), nearest-even; NaN stays a quiet NaN."""
    if x != types.float32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        b = builder.bitcast(args[0], _I32)
        top = builder.lshr(b, _c(16))
        rounded = builder.lshr(builder.add(builder.add(b, _c(0x7FFF)), builder.and_(top, _c(1))), _c(16))
        is_nan = builder.icmp_unsigned(">", builder.and_(b, _c(0x7FFFFFFF)), _c(0x7F800000))
        return builder.trunc(builder.select(is_nan, builder.or_(top, _c(0x40)), rounded), ir.IntType(16))

    return types.uint16(types.float32), codegen


def f16_bits_to_f32(builder: Any, x: Any) -> Any:
    """IR: the float32 value of the f16 whose bits are the low half of the i32 `x`, exactly. Normal
    numbers, inf and NaN (payload kept) by moving the bits into place; zeros and subnormals as
    mantissa · 2^-24 (a normal float32). No half support, libcall or subnormal float operand is used, so
    flush-to-zero or denormals-are-zero modes cannot change it. Shared by the kernels that read f16."""
    exp, em = builder.and_(x, _c(0x7C00)), builder.shl(builder.and_(x, _c(0x7FFF)), _c(13))
    wide = builder.select(builder.icmp_unsigned("==", exp, _c(0x7C00)), builder.or_(em, _c(0x7F800000)),
                          builder.add(em, _c(112 << 23)))  # rebias the exponent: 127 - 15
    tiny = builder.fmul(builder.sitofp(builder.and_(x, _c(0x3FF)), ir.FloatType()),
                        ir.Constant(ir.FloatType(), 2.0**-24))
    wide = builder.select(builder.icmp_unsigned("==", exp, _c(0)), builder.bitcast(tiny, _I32), wide)
    return builder.bitcast(builder.or_(wide, builder.shl(builder.and_(x, _c(0x8000)), _c(16))), ir.FloatType())


# Typed as Any: Numba calls intrinsics from jitted code with the typing context filled in.
pow2_f32: Any = _pow2_f32
bf16_to_f32: Any = _bf16_to_f32
f32_to_bf16: Any = _f32_to_bf16

@intrinsic
def _f16_to_f32_intrinsic(typingctx: Any, h: Any) -> Any:
    """Widen f16 bits (int16) to float32, exactly (`f16_bits_to_f32`; vectorisable)."""
    if h != types.int16:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return f16_bits_to_f32(builder, builder.zext(args[0], _I32))

    return types.float32(types.int16), codegen


f16_to_f32: Any = _f16_to_f32_intrinsic


def widen(x: Any) -> Any:
    """A stored element in the compute type (bf16 bits as uint16, f16 bits as int16); jitted only."""
    raise NotImplementedError("widen is callable from jitted code only")


@overload(widen, inline="always")
def _widen(x: Any) -> Any:
    def bf16(x: Any) -> Any:
        return bf16_to_f32(x)

    def f16(x: Any) -> Any:
        return f16_to_f32(x)

    def same(x: Any) -> Any:
        return x

    return bf16 if x == types.uint16 else f16 if x == types.int16 else same


def narrow(v: Any, out: Any) -> Any:
    """v (f32 or f64) as an element of `out`: bf16 bits rounded to nearest-even, else as is; jitted only."""
    raise NotImplementedError("narrow is callable from jitted code only")


@overload(narrow, inline="always")
def _narrow(v: Any, out: Any) -> Any:
    def impl(v: Any, out: Any) -> Any:
        return store_as(out, v)

    return impl


_LOG2E = np.float32(1.44269504088896341)
_C1 = np.float32(0.693359375)
_C2 = np.float32(-2.12194440e-4)
_P0 = np.float32(1.9875691500e-4)
_P1 = np.float32(1.3981999507e-3)
_P2 = np.float32(8.3334519073e-3)
_P3 = np.float32(4.1665795894e-2)
_P4 = np.float32(1.6666665459e-1)
_P5 = np.float32(5.0000001201e-1)
_HALF = np.float32(0.5)
_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)
EXP_LOW = np.float32(-87.33)


@njit(inline="always", cache=True)
def expf_parts(t: Any) -> tuple[Any, Any]:
    """(p, fx) with exp(t) = p·2^fx, p in [0.7, 1.5], fx integral (float32 t <= 0; Cephes reduction and
    polynomial): a caller may scale by 2^fx in steps, past where 2^fx alone leaves the normal range."""
    fx = np.floor(t * _LOG2E + _HALF)
    r = t - fx * _C1
    r = r - fx * _C2
    return ((((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5) * (r * r) + r) + _ONE, fx


@njit(inline="always", cache=True)
def expf_nonpositive(t: Any) -> Any:
    """exp(t) in float32 for t <= 0 (Cephes expf polynomial, ~1 ulp); 0 below -87.33; NaN stays NaN."""
    p, fx = expf_parts(EXP_LOW if t < EXP_LOW else t)
    e = p * pow2_f32(fx)
    return _ZERO if t < EXP_LOW else e


def exp_nonpositive(t: Any) -> Any:
    """exp(t) for t <= 0 in t's own type: expf_nonpositive for float32, libm exp for float64 (jitted only)."""
    raise NotImplementedError("exp_nonpositive is callable from jitted code only")


@overload(exp_nonpositive)
def _exp_nonpositive(t: Any) -> Any:
    def f32(t: Any) -> Any:
        return expf_nonpositive(t)

    def other(t: Any) -> Any:
        return np.exp(t)

    return f32 if t == types.float32 else other


def neg_inf_like(x: Any) -> Any:
    """-inf in x's own float type (a plain -np.inf would widen float32 arithmetic to float64; jitted only)."""
    raise NotImplementedError("neg_inf_like is callable from jitted code only")


@overload(neg_inf_like, inline="always")
def _neg_inf_like(x: Any) -> Any:
    def f32(x: Any) -> Any:
        return np.float32(-np.inf)

    def f64(x: Any) -> Any:
        return -np.inf

    return f32 if x == types.float32 else f64


def cast_like(x: Any, like: Any) -> Any:
    """x (e.g. an integer distance) in the float type of `like`, so float32 math stays float32 (NumPy's
    rules would widen float32·int64 to float64); jitted only."""
    raise NotImplementedError("cast_like is callable from jitted code only")


@overload(cast_like, inline="always")
def _cast_like(x: Any, like: Any) -> Any:
    def f32(x: Any, like: Any) -> Any:
        return np.float32(x)

    def f64(x: Any, like: Any) -> Any:
        return np.float64(x)

    return f32 if like == types.float32 else f64


@intrinsic
def _maxnum_intrinsic(typingctx: Any, a: Any, b: Any) -> Any:
    """llvm.maxnum: the larger of a and b, the other one where one is NaN. LLVM vectorises a row max
    written with it; a `x > m` select does not vectorise without nnan (docs/performance/runtime.md,
    "vecmath").
    It agrees with `x if x > m else m` from m = -inf: a NaN never becomes the max."""
    if a != b or a not in (types.float32, types.float64):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ty = args[0].type
        name = "llvm.maxnum.f32" if ty == ir.FloatType() else "llvm.maxnum.f64"
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty, ty]), name)
        return builder.call(fn, args)

    return a(a, b), codegen


maxnum: Any = _maxnum_intrinsic


def store_as(out: Any, x: Any) -> Any:
    """x (computed in f32 or f64) as an element of `out`: bf16 bits (uint16) rounded once to nearest-even,
    otherwise as is; jitted only."""
    raise NotImplementedError("store_as is callable from jitted code only")


@overload(store_as, inline="always")
def _store_as(out: Any, x: Any) -> Any:
    def bf16(out: Any, x: Any) -> Any:
        return f32_to_bf16(x)

    def same(out: Any, x: Any) -> Any:
        return x

    return bf16 if out.dtype == types.uint16 else same


@njit(cache=True)
def f64_to_bf16(v: float) -> Any:
    """float64 -> bf16 bits, rounded once to nearest-even: round to odd in f32 first (an inexact result
    gets an odd last bit, which carries the sticky information the second rounding needs)."""
    r = np.float32(v)
    back = np.float64(r)
    if back != v and v == v:
        k = np.int64(r.view(np.uint32))
        if k % 2 == 0:
            k = k + 1 if abs(v) > abs(back) else k - 1
            r = np.uint32(k).view(np.float32)
    return f32_to_bf16(r)


def widen64(v: Any) -> float:
    """A stored element as float64 (bf16 bits, uint16, widened exactly); jitted only."""
    raise NotImplementedError("widen64 is callable from jitted code only")


@overload(widen64, inline="always")
def _widen64(v: Any) -> Any:
    def from_bf16(v: Any) -> Any:
        return np.float64(bf16_to_f32(v))

    def other(v: Any) -> Any:
        return np.float64(v)

    return from_bf16 if v == types.uint16 else other


def narrow64(v: float, like: Any) -> Any:
    """A float64 result as an element of the array `like`, rounded once (uint16 = bf16 bits); jitted only."""
    raise NotImplementedError("narrow64 is callable from jitted code only")


@overload(narrow64, inline="always")
def _narrow64(v: Any, like: Any) -> Any:
    def to_bf16(v: Any, like: Any) -> Any:
        return f64_to_bf16(v)

    def to_f32(v: Any, like: Any) -> Any:
        return np.float32(v)

    def same(v: Any, like: Any) -> Any:
        return v

    if like.dtype == types.uint16:
        return to_bf16
    return to_f32 if like.dtype == types.float32 else same
