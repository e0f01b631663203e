"""SelectiveScan (entry 19) on the CPU: the Mamba-1 recurrence in f64, and its reverse scan.

A job owns one batch row and a fixed block of `DB` channels: each channel's state h[:, d] evolves on
its own (b_t and c_t are shared by all channels), so the job's inner loops run across the block's
channels, contiguous in u, delta and y, and LLVM vectorises them; the sum y_t = Σ_n h·c_t adds the N
states in order in every lane. The state, exp(d·a) and every product are f64 whatever the dtype (the
spec's F64 accumulator); exp is a polynomial that vectorises (`_exp64`, ~1 ulp of f64; libm's exp stays
scalar in Numba) and softplus is `max(x, 0) + log1p(exp(−|x|))` with a vectorisable log1p, PyTorch's
threshold 20 kept. Each output is rounded once: f32 directly, bf16 through an f32 rounded to odd, f16
by NumPy from an f64 buffer (Numba has no f16; its inputs are widened to f32 first, exactly). The block
split depends on the shape only, so the bytes do not depend on the thread count. B2 L1024 dim1536 N16
f32 on 2 cores: 35-45 ms (torch's selective_scan_ref loop: 450-700 ms).

The gradient (`selective_scan_grad`) recomputes the forward per job, keeping the state only at every
`CHUNK`-th step, then walks the chunks backwards: each chunk's states and decays are recomputed into a
CHUNK×N×DB buffer and the adjoint runs over them (no [L, N] history per channel). du and ddelta are
the job's own channels; db and dc (sums over channels) are summed per job in a fixed order into one
partial per channel block, and da (a sum over the batch) into one partial per batch row; the partials
are then added in index order. The gradient kernel at that size: ~140 ms (torch autograd through the
reference loop: minutes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from fuel.cpu.simd.driver import row_kernel
from fuel.cpu.simd.half import bits
from fuel.cpu.simd.vecmath import narrow64, widen64
from fuel.dispatch.impls import (
    CONTIGUOUS_ONLY,
    BackendImpl,
    CostEstimate,
    FusedKernelRegistry,
    PrecisionGuarantee,
    revision_of,
)
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.node import Shape
from fuel.graph.registry import FusedOps

FASTMATH = {"contract"}  # FMAs only: no reassociation, NaN and inf propagate
# Every jitted function here uses NumPy's error model: a float division by zero gives inf/NaN instead
# of a Python exception check, which kept softplus's loop scalar (18 ns against 1.6 ns per element).
DB = 64  # channels per job: eight 8-wide f64 vectors, a 16-state block of 8 KiB
CHUNK = 32  # steps between the gradient's state checkpoints

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
def _exp64(x: float) -> float:
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
def _softplus(x: float) -> float:
    """log1p(exp(x)) as max(x, 0) + log1p(e), e = exp(−|x|) in (0, 1]; x > 20 gives x (PyTorch's
    threshold). log1p(e) = 2·atanh(z), z = s/(2 + s), with s = e (e <= √2 − 1) or s = (e − 1)/2 plus
    ln 2 (1 + e = 2(1 + s)), so |z| <= 0.172 and eleven odd terms reach f64's roundoff."""
    e = _exp64(-abs(x))
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
def _softplus_slope(x: float) -> float:
    """d softplus / dx = σ(x) = 1/(1 + exp(−x)); 1 above the threshold, as PyTorch's backward."""
    return 1.0 if x > 20.0 else 1.0 / (1.0 + _exp64(-x))


@njit(inline="always", cache=True, fastmath=FASTMATH, error_model="numpy")
def _load_a(a: Any, d0: int, w: int, at: Any) -> None:
    """at[n, j] = a[d0 + j, n] for the block's channels (lanes past the last one are left as they are)."""
    for j in range(w):
        for n in range(at.shape[0]):
            at[n, j] = widen64(a[d0 + j, n])


@njit(inline="always", cache=True, fastmath=FASTMATH, error_model="numpy")
def _ch(d0: int, j: int) -> Any:
    """A channel index as uint64: Numba then emits no negative-index wrap-around (a select per load
    that kept the per-step loops scalar)."""
    return np.uint64(d0 + j)


@njit(inline="always", cache=True, fastmath=FASTMATH, error_model="numpy")
def _load_step(u: Any, delta: Any, bi: int, t: int, d0: int, w: int, softplus: bool, dt: Any, uu: Any,
               dtu: Any) -> None:
    """dt = softplus(delta) or delta, uu = u, dtu = dt·u over the block's channels at step t (lanes
    past the last channel stay zero). Two loops, so the one without softplus vectorises too."""
    if softplus:
        for j in range(w):
            dt[j] = _softplus(widen64(delta[bi, t, _ch(d0, j)]))
    else:
        for j in range(w):
            dt[j] = widen64(delta[bi, t, _ch(d0, j)])
    for j in range(w):
        uu[j] = widen64(u[bi, t, _ch(d0, j)])
        dtu[j] = dt[j] * uu[j]


@row_kernel(fastmath=FASTMATH, error_model="numpy")
def _forward(u: Any, delta: Any, a: Any, bm: Any, cm: Any, y: Any, last: Any, softplus: bool) -> None:
    """u, delta, y [B, L, dim]; a [dim, N]; bm, cm [B, L, N]; last [B, dim, N]."""
    nb, seq, dim = u.shape
    ns = a.shape[1]
    nblk = (dim + DB - 1) // DB
    for job in prange(nb * nblk):
        bi, d0 = job // nblk, (job % nblk) * DB
        w = min(DB, dim - d0)
        at = np.zeros((ns, DB))
        _load_a(a, d0, w, at)
        h = np.zeros((ns, DB))
        dt, uu, dtu, acc = np.zeros(DB), np.zeros(DB), np.zeros(DB), np.empty(DB)
        for t in range(seq):
            _load_step(u, delta, bi, t, d0, w, softplus, dt, uu, dtu)
            acc[:] = 0.0
            for n in range(ns):
                bn, cn = widen64(bm[bi, t, n]), widen64(cm[bi, t, n])
                hn, an = h[n], at[n]
                for j in range(DB):
                    hv = _exp64(dt[j] * an[j]) * hn[j] + dtu[j] * bn
                    hn[j] = hv
                    acc[j] += hv * cn
            for j in range(w):
                y[bi, t, _ch(d0, j)] = narrow64(acc[j], y)
        for j in range(w):
            for n in range(ns):
                last[bi, d0 + j, n] = narrow64(h[n, j], last)


@njit(inline="always", cache=True, fastmath=FASTMATH, error_model="numpy")
def _dot8(x: Any, z: Any, p: Any) -> float:
    """Σ_j x[j]·z[j] over DB lanes with eight fixed partial sums (no latency chain, a fixed order)."""
    p[:] = 0.0
    for j0 in range(0, DB, 8):
        for k in range(8):
            p[k] += x[j0 + k] * z[j0 + k]
    return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))


@row_kernel(fastmath=FASTMATH, error_model="numpy")
def _backward(u: Any, delta: Any, a: Any, bm: Any, cm: Any, dy: Any, dlast: Any, softplus: bool,
              du: Any, dd: Any, da_part: Any, db_part: Any, dc_part: Any) -> None:
    """The reverse scan. du, dd [B, L, dim] in the input type; da_part [B, dim, N], db_part and dc_part
    [blocks, B, L, N] f64 partials (this job's block and batch row)."""
    nb, seq, dim = u.shape
    ns = a.shape[1]
    nblk = (dim + DB - 1) // DB
    nck = (seq + CHUNK - 1) // CHUNK
    for job in prange(nb * nblk):
        bi, blk = job // nblk, job % nblk
        d0 = blk * DB
        w = min(DB, dim - d0)
        at = np.zeros((ns, DB))
        _load_a(a, d0, w, at)
        # Pass 1: the forward, keeping the state before every chunk.
        ckpt = np.empty((nck, ns, DB))
        h = np.zeros((ns, DB))
        dts, us, dtus = np.zeros((CHUNK, DB)), np.zeros((CHUNK, DB)), np.zeros((CHUNK, DB))
        for t in range(seq):
            if t % CHUNK == 0:
                ckpt[t // CHUNK] = h
            _load_step(u, delta, bi, t, d0, w, softplus, dts[0], us[0], dtus[0])
            dt0, dtu0 = dts[0], dtus[0]
            for n in range(ns):
                bn = widen64(bm[bi, t, n])
                hn, an = h[n], at[n]
                for j in range(DB):
                    hn[j] = _exp64(dt0[j] * an[j]) * hn[j] + dtu0[j] * bn
        # Pass 2: chunks in reverse; g is the adjoint of the state, seeded with dlast.
        g = np.zeros((ns, DB))
        for j in range(w):
            for n in range(ns):
                g[n, j] = widen64(dlast[bi, d0 + j, n])
        hs = np.empty((CHUNK + 1, ns, DB))
        decay = np.empty((CHUNK, ns, DB))
        gy, ddv, duv, gda, p8 = np.zeros(DB), np.zeros(DB), np.zeros(DB), np.zeros((ns, DB)), np.zeros(8)
        for ck in range(nck - 1, -1, -1):
            t0 = ck * CHUNK
            t1 = min(seq, t0 + CHUNK)
            hs[0] = ckpt[ck]
            for t in range(t0, t1):
                k = t - t0
                _load_step(u, delta, bi, t, d0, w, softplus, dts[k], us[k], dtus[k])
                dtk, dtuk = dts[k], dtus[k]
                for n in range(ns):
                    bn = widen64(bm[bi, t, n])
                    hp, hn, dk, an = hs[k, n], hs[k + 1, n], decay[k, n], at[n]
                    for j in range(DB):
                        e = _exp64(dtk[j] * an[j])
                        dk[j] = e
                        hn[j] = e * hp[j] + dtuk[j] * bn
            for t in range(t1 - 1, t0 - 1, -1):
                k = t - t0
                for j in range(w):
                    gy[j] = widen64(dy[bi, t, _ch(d0, j)])
                ddv[:] = 0.0
                duv[:] = 0.0
                dtk, uk, dtuk = dts[k], us[k], dtus[k]
                for n in range(ns):
                    bn, cn = widen64(bm[bi, t, n]), widen64(cm[bi, t, n])
                    gn, hp, hn, dk, an, gdn = g[n], hs[k, n], hs[k + 1, n], decay[k, n], at[n], gda[n]
                    dc_part[blk, bi, t, n] = _dot8(gy, hn, p8)  # y_t = Σ_n h_t·c_t
                    for j in range(DB):
                        gn[j] += gy[j] * cn
                    db_part[blk, bi, t, n] = _dot8(gn, dtuk, p8)  # h_t = e·h_{t−1} + d·u·b_t
                    for j in range(DB):
                        gh = gn[j]
                        x = gh * hp[j] * dk[j]  # the adjoint of d·a inside exp(d·a)
                        ddv[j] += x * an[j] + gh * uk[j] * bn
                        gdn[j] += x * dtk[j]
                        duv[j] += gh * bn
                        gn[j] = gh * dk[j]
                for j in range(w):
                    du[bi, t, _ch(d0, j)] = narrow64(duv[j] * dtk[j], du)
                if softplus:
                    for j in range(w):
                        ddv[j] *= _softplus_slope(widen64(delta[bi, t, _ch(d0, j)]))
                for j in range(w):
                    dd[bi, t, _ch(d0, j)] = narrow64(ddv[j], dd)
        for j in range(w):
            for n in range(ns):
                da_part[bi, d0 + j, n] = gda[n, j]


@row_kernel()
def _sum_parts(part: Any, out: Any) -> None:
    """out[i] = Σ_k part[k, i] in k order, rounded once (part [K, M] f64, out [M])."""
    for i in prange(out.shape[0]):
        s = 0.0
        for k in range(part.shape[0]):
            s += part[k, i]
        out[i] = narrow64(s, out)


def _kernel_view(x: np.ndarray) -> np.ndarray:
    """What the jitted code reads: bf16 as its uint16 bits, f16 widened exactly to f32 (Numba has no
    f16 loads), f32 and f64 as they are."""
    if x.dtype == DType.BF16.np:
        return bits(x)
    return x.astype(np.float32) if x.dtype == DType.F16.np else x


def _kernel_out(x: np.ndarray) -> tuple[np.ndarray, bool]:
    """Where the jitted code writes an output, and whether it is a buffer to copy into x afterwards:
    bf16 as its bits, an f64 buffer for f16 (NumPy rounds f64 to f16 once, correctly), else x."""
    if x.dtype == DType.BF16.np:
        return bits(x), False
    if x.dtype == DType.F16.np:
        return np.zeros(x.shape), True
    return x, False


def selective_scan(inputs: list[np.ndarray], out: tuple[np.ndarray, ...], params: Any) -> None:
    """Every dtype: (y, last_state) into out."""
    bufs = [_kernel_out(o) for o in out]
    if any(o.size for o in out):
        _forward(*(_kernel_view(x) for x in inputs), *(b for b, _ in bufs), params.delta_softplus)
    for (buf, copy), o in zip(bufs, out, strict=True):
        if copy:
            np.copyto(o, buf, casting="unsafe")


def selective_scan_grad(inputs: list[np.ndarray], params: Any) -> tuple[np.ndarray, ...]:
    """(u, delta, a, b, c, dy, dlast_state) -> (du, ddelta, da, db, dc), each in its input's dtype."""
    nb, seq, dim = inputs[0].shape
    ns = inputs[2].shape[1]
    nblk = (dim + DB - 1) // DB
    outs = tuple(np.zeros(x.shape, x.dtype) for x in inputs[:5])
    bufs = [_kernel_out(o) for o in outs]
    (du, _), (dd, _), (da, _), (db, _), (dc, _) = bufs
    da_part = np.zeros((nb, dim, ns))
    db_part = np.zeros((nblk, nb, seq, ns))
    dc_part = np.zeros((nblk, nb, seq, ns))
    if du.size or da_part.size:
        _backward(*(_kernel_view(x) for x in inputs), params.delta_softplus, du, dd, da_part, db_part, dc_part)
    for part, o in ((da_part, da), (db_part, db), (dc_part, dc)):
        if o.size:  # an empty sum leaves the zeros
            _sum_parts(part.reshape(part.shape[0], o.size), o.reshape(o.size))
    for (buf, copy), o in zip(bufs, outs, strict=True):
        if copy:
            np.copyto(o, buf, casting="unsafe")
    return outs


def selective_scan_cost(shapes: Sequence[Shape], dtypes: Sequence[DType], params: Any) -> CostEstimate:
    """Per state element and step: a 12-term exp (~22 flops) and 5 more; softplus ~40 per (b, t, d)."""
    nb, seq, dim = shapes[0]
    ns = shapes[2][1]
    flops = nb * seq * dim * (ns * 27 + (40 if params.delta_softplus else 0))
    moved = sum(math.prod(s) * d.itemsize for s, d in zip(shapes[:5], dtypes[:5], strict=True))
    moved += (nb * seq * dim + nb * dim * ns) * dtypes[0].itemsize
    return CostEstimate(flops=flops, bytes_moved=moved)


# |out − ref| <= max_relative·|ref| + max_absolute·S, S the recurrence over |d·u|, |b|, |c| (see the
# reference). `python -m fuel.testing.measure SelectiveScan` over seeds 0-59: f64 9.7e-16 relative and
# 3.0e-16·S (the polynomial exp's ~1 ulp per step, and the reference's own roundings); the other
# dtypes exactly their unit roundoff (one rounding of the f64 result) and nothing on S. Bounds are twice
# the measured worst; the narrow types keep the f64 state's 6e-16·S as their absolute part.
SELECTIVE_SCAN_PRECISION = {
    DType.F32: PrecisionGuarantee(True, None, 1.2e-7, 6e-16, "f64 state and exp, one rounding to f32"),
    DType.F64: PrecisionGuarantee(True, None, 2e-15, 6e-16, "f64 state, polynomial exp (~1 ulp)"),
    DType.BF16: PrecisionGuarantee(True, None, 7.9e-3, 6e-16, "f64 state, one rounding (f32 to odd, then bf16)"),
    DType.F16: PrecisionGuarantee(True, None, 9.8e-4, 6e-16, "f64 state, one rounding (NumPy f64 to f16)"),
}


def register(registry: FusedKernelRegistry) -> None:
    rev = revision_of(selective_scan)
    for dt in FLOAT_DTYPES:
        registry.register(BackendImpl(FusedOps.SELECTIVE_SCAN, "cpu", selective_scan, (dt,) * 6,
                                      selective_scan_cost, SELECTIVE_SCAN_PRECISION[dt], CONTIGUOUS_ONLY, rev))
