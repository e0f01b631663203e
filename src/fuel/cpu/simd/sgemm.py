"""OpenBLAS's `cblas_sgemm` called from jitted code, through the address `threads.blas_sgemm_address()`
found in the OpenBLAS NumPy loaded (its ILP64 build: 64-bit sizes and strides, 32-bit enums).

For tasks of the spinning pool (`fuel.runtime.pool`): a tile product then runs with no Python around it,
where `split_work`'s Python threads hand the GIL over through the operating system at every step
(measured on 2 cores: an empty `split_work` 55 µs; two 37 µs products in it 163 µs, against 74 µs in
one thread). The caller sets OpenBLAS to one thread around the job (`threads.one_blas_thread`), so each
call runs in the thread that makes it, and its bytes are those of the same call made through NumPy.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
_I32, _I64, _F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
_P32 = _F32.as_pointer()
_SGEMM = ir.FunctionType(ir.VoidType(), [_I32, _I32, _I32, _I64, _I64, _I64, _F32, _P32, _I64, _P32, _I64, _F32,
                                         _P32, _I64])


@intrinsic
def _sgemm(typingctx: Any, address: Any, trans_b: Any, add: Any, m: Any, n: Any, k: Any, a: Any, lda: Any, b: Any,
           ldb: Any, c: Any, ldc: Any) -> Any:
    """Row-major C[m, n] <- A[m, k] @ op(B) (op: transposed where trans_b), plus C where `add` (beta 1,
    else 0); the matrices by address (int64), B stored [n, k] when transposed, [k, n] otherwise."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        v = [context.cast(builder, x, t, types.int64) for x, t in zip(args, signature.args, strict=True)]
        fn = builder.inttoptr(v[0], _SGEMM.as_pointer())
        tb = builder.select(builder.icmp_signed("!=", v[1], ir.Constant(_I64, 0)), ir.Constant(_I32, TRANS),
                            ir.Constant(_I32, NO_TRANS))
        beta = builder.select(builder.icmp_signed("!=", v[2], ir.Constant(_I64, 0)), ir.Constant(_F32, 1.0),
                              ir.Constant(_F32, 0.0))
        builder.call(fn, [ir.Constant(_I32, ROW_MAJOR), ir.Constant(_I32, NO_TRANS), tb, v[3], v[4], v[5],
                          ir.Constant(_F32, 1.0), builder.inttoptr(v[6], _P32), v[7], builder.inttoptr(v[8], _P32),
                          v[9], beta, builder.inttoptr(v[10], _P32), v[11]])
        return context.get_dummy_value()

    return types.void(*[types.int64] * 12), codegen


sgemm: Any = _sgemm  # typed as Any: Numba fills in the typing context when jitted code calls an intrinsic


@njit(cache=True, nogil=True)
def sgemm_nt(address: int, a: Any, b: Any, c: Any) -> None:
    """c [m, n] <- a [m, k] @ b [n, k]ᵀ, all C-contiguous f32 (for tests: the call NumPy makes for this)."""
    m, k = a.shape
    n = b.shape[0]
    sgemm(address, 1, 0, m, n, k, a.ctypes.data, k, b.ctypes.data, k, c.ctypes.data, n)
