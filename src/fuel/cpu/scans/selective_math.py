"""SelectiveScan's per-step arithmetic in f64, shared by the forward (`selective_scan`) and the reverse scan
(`selective_scan_grad`): a vectorisable exp and softplus, and the loads of a block of DB channels.

exp is a polynomial (`exp64`, within 1 ulp of f64; libm's exp stays scalar in Numba) and softplus is
`max(x, 0) + log1p(exp(−|x|))` with a vectorisable log1p, PyTorch's threshold 20 kept. Every jitted
function here uses NumPy's error model: a float division by zero gives inf/NaN instead of a Python
exception check, which would keep softplus's loop scalar (docs/performance/conv.md, "selective_scan").
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic

from fuel.cpu.simd.half import bits
from fuel.cpu.simd.vecmath import widen64
from fuel.dtype import DType
from fuel.runtime.atomics import pointer

FASTMATH = {"contract"}  # FMAs only: no reassociation, NaN and inf propagate
DB = 64  # channels per work item: eight 8-wide f64 vectors, a 16-state block of 8 KiB

_I64 = ir.IntType(64)


@intrinsic
def _pow2_f64(typingctx: Any, n: Any) -> Any:
    """2**n as float64 for an integral float64 n in [-1022, 1023] (exponent bits, no multiply)."""
    if n != types.float64:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        biased = builder.add(builder.fptosi(args[0], _I64), ir.Constant(_I64, 1023))
        return builder.bitcast(builder.shl(biased, ir.Constant(_I64, 52)), ir.DoubleType())

    return types.float64(types.float64), codegen


pow2_f64: Any = _pow2_f64
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_LN2 = 0.6931471805599453
# exp on [−ln2/2, ln2/2]: mpmath's chebyfit of degree 11 (3e-18 relative), highest power first.
_E = (2.5110037605963777e-08, 2.763263963904103e-07, 2.755724091857897e-06, 2.4801485482328494e-05,
      0.00019841269890047113, 0.0013888888952314775, 0.008333333333319601, 0.0416666666664881,
      0.1666666666666668, 0.5000000000000019)
_EXP_HI = 709.43  # n = 1024 above: exp is within 0.5% of f64's largest, and inf here
_EXP_LO = -708.0  # 0 below: the decays' absolute error there is < 4e-308


@njit(inline="always", cache=True, fastmath=FASTMATH, error_model="numpy")
def exp64(x: float) -> float:
    """exp(x) in f64, within 1 ulp (measured): Cody-Waite reduction to |r| <= ln2/2, a degree-11
    polynomial, 2^n from its exponent bits. NaN propagates through r; out of [_EXP_LO, _EXP_HI] the
    result is 0 or inf (no clamp: those lanes' garbage is replaced)."""
    n = np.floor(x * 1.4426950408889634 + 0.5)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = ((((_E[0] * r + _E[1]) * r + _E[2]) * r + _E[3]) * r + _E[4]) * r + _E[5]  # Horner, FMAs
    p = ((((((p * r + _E[6]) * r + _E[7]) * r + _E[8]) * r + _E[9]) * r + 1.0) * r + 1.0)
    e = p * pow2_f64(n)
    e = 0.0 if x < _EXP_LO else e
    return np.inf if x > _EXP_HI else e


@njit(inline="always", cache=True, fastmath=FASTMATH, error_model="numpy")
def softplus(x: float) -> float:
    """log1p(exp(x)) as max(x, 0) + log1p(e), e = exp(−|x|) in (0, 1]; x > 20 gives x (PyTorch's
    threshold). log1p(e) = 2·atanh(z), z = s/(2 + s), with s = e (e <= √2 − 1) or s = (e − 1)/2 plus
    ln 2 (1 + e = 2(1 + s)), so |z| <= 0.172 and eleven odd terms reach f64's roundoff."""
    e = exp64(-abs(x))
    big = e > 0.41421356237309503
    s = (e - 1.0) * 0.5 if big else e
    z = s / (2.0 + s)
    z2 = z * z
    q = ((((1.0 / 23.0 * z2 + 1.0 / 21.0) * z2 + 1.0 / 19.0) * z2 + 1.0 / 17.0) * z2 + 1.0 / 15.0) * z2
    q = (((((q + 1.0 / 13.0) * z2 + 1.0 / 11.0) * z2 + 1.0 / 9.0) * z2 + 1.0 / 7.0) * z2 + 1.0 / 5.0) * z2
    q = q + 1.0 / 3.0
    lg = 2.0 * z + (2.0 * z) * (z2 * q)
    lg = lg + _LN2 if big else lg
    pos = x if x > 0.0 else 0.0
    return x if x > 20.0 else pos + lg


@njit(inline="always", cache=True, fastmath=FASTMATH, error_model="numpy")
def softplus_slope(x: float) -> float:
    """d softplus / dx = σ(x) = 1/(1 + exp(−x)); 1 above the threshold, as PyTorch's backward."""
    return 1.0 if x > 20.0 else 1.0 / (1.0 + exp64(-x))


@njit(inline="always", cache=True, fastmath=FASTMATH, error_model="numpy")
def load_a(a: Any, d0: int, w: int, at: Any) -> None:
    """at[n, j] = a[d0 + j, n] for the block's channels (lanes past the last one are left as they are)."""
    for j in range(w):
        for n in range(at.shape[0]):
            at[n, j] = widen64(a[d0 + j, n])


@njit(inline="always", cache=True, fastmath=FASTMATH, error_model="numpy")
def channel(d0: int, j: int) -> Any:
    """A channel index as uint64: Numba then emits no negative-index wrap-around (a select per load
    that kept the per-step loops scalar)."""
    return np.uint64(d0 + j)


@njit(inline="always", cache=True, fastmath=FASTMATH, error_model="numpy")
def load_step(u: Any, delta: Any, bi: int, t: int, d0: int, w: int, use_softplus: bool, dt: Any, uu: Any,
              dtu: Any) -> None:
    """dt = softplus(delta) or delta, uu = u, dtu = dt·u over the block's channels at step t (lanes
    past the last channel stay zero). Two loops, so the one without softplus vectorises too."""
    if use_softplus:
        for j in range(w):
            dt[j] = softplus(widen64(delta[bi, t, channel(d0, j)]))
    else:
        for j in range(w):
            dt[j] = widen64(delta[bi, t, channel(d0, j)])
    for j in range(w):
        uu[j] = widen64(u[bi, t, channel(d0, j)])
        dtu[j] = dt[j] * uu[j]


def kernel_view(x: np.ndarray) -> np.ndarray:
    """What the jitted code reads: bf16 as its uint16 bits, f16 widened exactly to f32 (Numba has no
    f16 loads), f32 and f64 as they are."""
    if x.dtype == DType.BF16.np:
        return bits(x)
    return x.astype(np.float32) if x.dtype == DType.F16.np else x


def kernel_out(x: np.ndarray) -> tuple[np.ndarray, bool]:
    """Where the jitted code writes an output, and whether it is a buffer to copy into x afterwards:
    bf16 as its bits, an f64 buffer for f16 (NumPy rounds f64 to f16 once, correctly), else x."""
    if x.dtype == DType.BF16.np:
        return bits(x), False
    if x.dtype == DType.F16.np:
        return np.zeros(x.shape), True
    return x, False


SCAN_SECONDS_PER_STATE_STEP = 3e-9  # one core's time per state element and step (an exp and 5 flops)


@njit(inline="always", cache=True)
def scan_inputs(r: Any, din: Any) -> tuple[Any, Any, Any, Any, Any]:
    """u, delta [B, L, dim], a [dim, N], b, c [B, L, N] of type din, from a record with fields u, delta,
    a, b, c, batch, length, dim and n (the forward's and the gradient's)."""
    nb, seq, dim, ns = r.batch, r.length, r.dim, r.n
    return (carray(pointer(r.u, din), (nb, seq, dim)), carray(pointer(r.delta, din), (nb, seq, dim)),
            carray(pointer(r.a, din), (dim, ns)), carray(pointer(r.b, din), (nb, seq, ns)),
            carray(pointer(r.c, din), (nb, seq, ns)))
