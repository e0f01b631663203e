"""64-byte float vectors as Numba values of the element type of an array: 16 float32 lanes or 8 float64.

`simd16` is float32 only; kernels compiled for both float types (one source, a task per dtype) take their
vectors from here: `vload(x, off)` is a vector of x's dtype, and every other operation takes the lane type
from its vector arguments. A vector is an LLVM `<16 x float>` or `<8 x double>` value that a kernel keeps in
local variables (registers across a loop, no store and reload).

Arrays are addressed by element offset, unchecked: the caller keeps every lane inside the array.
Arithmetic is plain IEEE in the lane type, each operation rounded once: `fmas` and `fma1` are fused
multiply-adds by `llvm.fma` (one rounding), with no fast-math flags, so no compiler choice changes a result.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.datamodel import models, register_default
from numba.extending import intrinsic

BYTES = 64  # a vector's size: one cache line, one zmm register (or two ymm)
_IR_I32 = ir.IntType(32)
_FLOATS = {types.float32: (ir.FloatType(), "f32"), types.float64: (ir.DoubleType(), "f64")}


class Vec64(types.Type):
    """Numba's type of a 64-byte vector of `dtype` (float32 or float64) lanes."""

    def __init__(self, dtype: Any) -> None:
        self.dtype = dtype
        self.lanes = BYTES // (dtype.bitwidth // 8)
        super().__init__(name=f"vec64({dtype})")


@register_default(Vec64)
class _Vec64Model(models.PrimitiveModel):
    def __init__(self, dmm: Any, fe_type: Any) -> None:
        super().__init__(dmm, fe_type, ir.VectorType(_FLOATS[fe_type.dtype][0], fe_type.lanes))


def _float_array(ty: Any) -> bool:
    return isinstance(ty, types.Array) and ty.dtype in _FLOATS


def _vector_pointer(context: Any, builder: Any, aryty: Any, ary: Any, off: Any, vty: Vec64) -> Any:
    """A pointer to the vector at element `off` of the array (any layout: `off` counts from its data)."""
    data = context.make_array(aryty)(context, builder, ary).data
    ir_type = context.get_value_type(vty)
    return builder.bitcast(builder.gep(data, [off]), ir_type.as_pointer())


def _fma(builder: Any, ir_type: Any, name: str, a: Any, b: Any, c: Any) -> Any:
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir_type, [ir_type] * 3), f"llvm.fma.{name}")
    return builder.call(fn, [a, b, c])


def _splat(builder: Any, v: Any, ir_type: Any) -> Any:
    undef = ir.Constant(ir_type, ir.Undefined)
    one = builder.insert_element(undef, v, ir.Constant(_IR_I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(_IR_I32, ir_type.count), [0] * ir_type.count))


@intrinsic
def _load(typingctx: Any, x: Any, off: Any) -> Any:
    """x[off:off + lanes] (a float32 or float64 array x)."""
    if not _float_array(x):
        return None
    vty = Vec64(x.dtype)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.load(_vector_pointer(context, builder, signature.args[0], args[0], args[1], vty),
                            align=x.dtype.bitwidth // 8)

    return vty(x, off), codegen


@intrinsic
def _store(typingctx: Any, x: Any, off: Any, v: Any) -> Any:
    """x[off:off + lanes] = v (v of x's dtype)."""
    if not (_float_array(x) and isinstance(v, Vec64) and v.dtype == x.dtype):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        builder.store(args[2], _vector_pointer(context, builder, signature.args[0], args[0], args[1], v),
                      align=x.dtype.bitwidth // 8)
        return context.get_dummy_value()

    return types.void(x, off, v), codegen


@intrinsic
def _zero(typingctx: Any, x: Any) -> Any:
    """A vector of x's dtype (x a float array, read for its type only), every lane +0."""
    if not _float_array(x):
        return None
    vty = Vec64(x.dtype)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return ir.Constant(context.get_value_type(vty), None)

    return vty(x), codegen


@intrinsic
def _fmas(typingctx: Any, s: Any, v: Any, acc: Any) -> Any:
    """acc + s * v, fused (s a scalar, converted to the lane type, in every lane)."""
    if not (isinstance(v, Vec64) and acc == v and isinstance(s, (types.Float, types.Integer))):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ir_type = context.get_value_type(v)
        lane = context.cast(builder, args[0], signature.args[0], v.dtype)
        return _fma(builder, ir_type, f"v{v.lanes}{_FLOATS[v.dtype][1]}", _splat(builder, lane, ir_type), args[1],
                    args[2])

    return v(s, v, acc), codegen


@intrinsic
def _add(typingctx: Any, x: Any, y: Any) -> Any:
    """x + y, lane by lane."""
    if not (isinstance(x, Vec64) and x == y):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fadd(args[0], args[1])

    return x(x, y), codegen


@intrinsic
def _fma1(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    """c + a * b for scalars of one float type, fused: the arithmetic of one lane of `fmas`."""
    if not (a in _FLOATS and a == b == c):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ir_type, name = _FLOATS[a]
        return _fma(builder, ir_type, name, *args)

    return a(a, b, c), codegen


# Typed as Any: Numba fills in the typing context when jitted code calls an intrinsic.
vload: Any = _load
vstore: Any = _store
vzero: Any = _zero
fmas: Any = _fmas
vadd: Any = _add
fma1: Any = _fma1
