"""OpenBLAS's `cblas_?gemm` and `cblas_?gemv` called from jitted code, through the addresses
`threads.blas_address` finds in the OpenBLAS NumPy loaded (its ILP64 build: 64-bit sizes and strides,
32-bit enums).

For tasks of the spinning pool (`fuel.runtime.pool`): a product then runs with no Python around it. BLAS
inside a task runs one-threaded (the BLAS policy of `fuel.runtime.threads`): whoever posts the job sets
OpenBLAS to one thread around it (`threads.one_blas_thread`), so each call runs in the thread that makes
it, and its bytes are those of the same call made through NumPy.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

ROW_MAJOR, COL_MAJOR, NO_TRANS, TRANS = 101, 102, 111, 112
_I32, _I64 = ir.IntType(32), ir.IntType(64)


def _gemm_intrinsic(real: ir.Type) -> Any:
    """The gemm intrinsic for elements of type `real` (float: sgemm, double: dgemm)."""
    ptr = real.as_pointer()
    signature = ir.FunctionType(ir.VoidType(), [_I32, _I32, _I32, _I64, _I64, _I64, real, ptr, _I64, ptr, _I64, real,
                                                ptr, _I64])

    def gemm(typingctx: Any, address: Any, trans_b: Any, add: Any, m: Any, n: Any, k: Any, a: Any, lda: Any, b: Any,
             ldb: Any, c: Any, ldc: Any) -> Any:
        """Row-major C[m, n] <- op(A) @ op(B), plus C where `add` (beta 1, else 0); the matrices by address
        (int64). trans_b's bit 0 transposes B (stored [n, k], else [k, n]), its bit 1 A (stored [k, m],
        else [m, k])."""

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            v = [context.cast(builder, x, t, types.int64) for x, t in zip(args, sig.args, strict=True)]
            fn = builder.inttoptr(v[0], signature.as_pointer())
            tb, ta = (builder.select(builder.icmp_signed("!=", builder.and_(v[1], ir.Constant(_I64, bit)),
                                                         ir.Constant(_I64, 0)),
                                     ir.Constant(_I32, TRANS), ir.Constant(_I32, NO_TRANS)) for bit in (1, 2))
            beta = builder.select(builder.icmp_signed("!=", v[2], ir.Constant(_I64, 0)), ir.Constant(real, 1.0),
                                  ir.Constant(real, 0.0))
            builder.call(fn, [ir.Constant(_I32, ROW_MAJOR), ta, tb, v[3], v[4], v[5],
                              ir.Constant(real, 1.0), builder.inttoptr(v[6], ptr), v[7], builder.inttoptr(v[8], ptr),
                              v[9], beta, builder.inttoptr(v[10], ptr), v[11]])
            return context.get_dummy_value()

        return types.void(*[types.int64] * 12), codegen

    return intrinsic(gemm)


def _gemv_intrinsic(real: ir.Type) -> Any:
    """The transposed gemv intrinsic for elements of type `real` (float: sgemv, double: dgemv)."""
    ptr = real.as_pointer()
    signature = ir.FunctionType(ir.VoidType(), [_I32, _I32, _I64, _I64, real, ptr, _I64, ptr, _I64, real, ptr, _I64])

    def gemv_t(typingctx: Any, address: Any, col_major: Any, rows: Any, cols: Any, a: Any, lda: Any, x: Any,
               incx: Any, y: Any, incy: Any) -> Any:
        """y[cols] <- A[rows, cols]ᵀ @ x[rows] (beta 0), A row-major, or column-major where col_major; the
        arrays by address (int64), x and y with strides incx and incy (in elements)."""

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            v = [context.cast(builder, x, t, types.int64) for x, t in zip(args, sig.args, strict=True)]
            fn = builder.inttoptr(v[0], signature.as_pointer())
            order = builder.select(builder.icmp_signed("!=", v[1], ir.Constant(_I64, 0)),
                                   ir.Constant(_I32, COL_MAJOR), ir.Constant(_I32, ROW_MAJOR))
            builder.call(fn, [order, ir.Constant(_I32, TRANS), v[2], v[3], ir.Constant(real, 1.0),
                              builder.inttoptr(v[4], ptr), v[5], builder.inttoptr(v[6], ptr), v[7],
                              ir.Constant(real, 0.0), builder.inttoptr(v[8], ptr), v[9]])
            return context.get_dummy_value()

        return types.void(*[types.int64] * 10), codegen

    return intrinsic(gemv_t)


# Typed as Any: Numba fills in the typing context when jitted code calls an intrinsic.
sgemm: Any = _gemm_intrinsic(ir.FloatType())
dgemm: Any = _gemm_intrinsic(ir.DoubleType())
sgemv_t: Any = _gemv_intrinsic(ir.FloatType())
dgemv_t: Any = _gemv_intrinsic(ir.DoubleType())


@njit(inline="always", cache=True)
def gemm(itemsize: int, address: int, trans: int, add: int, m: int, n: int, k: int, a: int, lda: int, b: int,
         ldb: int, c: int, ldc: int) -> None:
    """`sgemm` for 4-byte values, else `dgemm`: one call site for a kernel compiled for both (the address
    is that routine's). trans bit 0 transposes B (stored [n, k]), bit 1 A (stored [k, m]): `Aᵀ·B` as
    NumPy computes `a.T @ b` for a C-contiguous a."""
    if itemsize == 4:
        sgemm(address, trans, add, m, n, k, a, lda, b, ldb, c, ldc)
    else:
        dgemm(address, trans, add, m, n, k, a, lda, b, ldb, c, ldc)


@njit(cache=True, nogil=True)
def sgemm_nt(address: int, a: Any, b: Any, c: Any) -> None:
    """c [m, n] <- a [m, k] @ b [n, k]ᵀ, all C-contiguous f32 (for tests: the call NumPy makes for this)."""
    m, k = a.shape
    n = b.shape[0]
    sgemm(address, 1, 0, m, n, k, a.ctypes.data, k, b.ctypes.data, k, c.ctypes.data, n)
