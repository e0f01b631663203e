"""CausalConv1d (entry 18) on the CPU: a Numba pass per (batch, channel) row, SiLU fused.

Each output row is seeded with the bias, takes its K taps in ascending order as whole-row vector
passes (`o[t] += w[k]·x[t + k]`, fused multiply-adds, in L1), then the SiLU in place, so x is read
once and the output written once. One thread owns a row: the bytes never depend on the thread count.
SiLU is `y·σ(y)` with σ from a vectorised expf on −|y| (f32; libm exp for f64). bf16 rows are widened
into f32 scratch and rounded once on store; f16 runs the f32 kernel on a widened copy; f64 computes in
f64. The decode step (`causal_conv1d_step`, one new column over a K − 1 state) is this kernel on a
[B, C, K] window; its cost puts it on the serial path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import njit, prange

from fuel.cpu.simd.driver import chunk_bounds, chunk_count, row_kernel
from fuel.cpu.simd.half import bits, via_f32
from fuel.cpu.simd.vecmath import bf16_to_f32, cast_like, exp_nonpositive, f32_to_bf16
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

# Contraction into FMAs only: no reassociation (the taps keep their order), no nnan/ninf (NaN and inf
# propagate as in IEEE arithmetic).
FASTMATH = {"contract"}


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _silu(y: Any) -> Any:
    """y·σ(y), σ from exp(−|y|) <= 1 (no overflow either side)."""
    e = exp_nonpositive(-abs(y))
    one = cast_like(1, y)
    s = one / (one + e) if y >= 0 else e / (one + e)
    return y * s


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _taps(xr: Any, wr: Any, bv: Any, o: Any, silu: bool) -> None:
    """o[t] = bias + Σ_k w[k]·x[t + k] in tap order, then SiLU in place."""
    n = o.shape[0]
    for t in range(n):
        o[t] = bv
    for j in range(wr.shape[0]):
        wv = wr[j]
        for t in range(n):
            o[t] += wv * xr[t + j]
    if silu:
        for t in range(n):
            o[t] = _silu(o[t])


@row_kernel(fastmath=FASTMATH)
def _causal(x: Any, w: Any, bias: Any, out: Any, silu: bool) -> None:
    """x [rows, L + K − 1], w [C, K], bias [C], out [rows, L] with rows = B·C (channel = row % C)."""
    c = w.shape[0]
    for r in prange(x.shape[0]):
        ch = r % c
        _taps(x[r], w[ch], bias[ch], out[r], silu)


@row_kernel(fastmath=FASTMATH)
def _causal_bf16(x: Any, w: Any, bias: Any, out: Any, silu: bool) -> None:
    """bf16 bits in and out; each row widened into f32 scratch, computed in f32, rounded once."""
    rows, lin = x.shape
    n = out.shape[1]
    c, k = w.shape
    chunks = chunk_count(rows)
    for ck in prange(chunks):
        wide = np.empty(lin, np.float32)
        acc = np.empty(n, np.float32)
        wr = np.empty(k, np.float32)
        start, stop = chunk_bounds(ck, rows, chunks)
        for r in range(start, stop):
            ch = r % c
            xr = x[r]
            for j in range(lin):
                wide[j] = bf16_to_f32(xr[j])
            for j in range(k):
                wr[j] = bf16_to_f32(w[ch, j])
            _taps(wide, wr, bf16_to_f32(bias[ch]), acc, silu)
            o = out[r]
            for t in range(n):
                o[t] = f32_to_bf16(acc[t])


def _rows(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    b, c, lin = x.shape
    return x.reshape(b * c, lin), w.reshape(c, w.shape[2]), out.reshape(b * c, out.shape[2])


def causal_conv1d_f32(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
    """f32 and f64: computed in the input type, straight into out."""
    if out.size == 0:
        return
    x, w, bias = inputs
    xr, wr, orow = _rows(x, w, out)
    _causal(xr, wr, bias, orow, params.use_silu)


causal_conv1d_f64 = causal_conv1d_f32
causal_conv1d_f16 = via_f32(causal_conv1d_f32)


def causal_conv1d_bf16(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
    if out.size == 0:
        return
    x, w, bias = inputs
    xr, wr, orow = _rows(bits(x), bits(w), bits(out))
    _causal_bf16(xr, wr, bits(bias), orow, params.use_silu)


def causal_conv1d_cost(shapes: Sequence[Shape], dtypes: Sequence[DType], params: Any) -> CostEstimate:
    """2K flops per output element, 10 more for the SiLU; every operand moves once."""
    k = shapes[1][2]
    flops = math.prod(shapes[-1]) * (2 * k + (10 if params.use_silu else 0))
    moved = sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes, strict=True))
    return CostEstimate(flops=flops, bytes_moved=moved)


# |out - ref| <= max_relative·|ref| + max_absolute·S, S = |bias| + Σ_k |w_k|·|x_{t+k}| per output
# element (of the pre-activation). Twice the worst error `python -m fuel.testing.measure CausalConv1d`
# found over seeds 0-59; the relative part is at least the output's unit roundoff, and the half types'
# absolute part is the f32 impl's.
CAUSAL_CONV1D_PRECISION = {
    DType.F32: PrecisionGuarantee(True, None, 5.9e-7, 1.2e-7, "f32 FMAs in tap order; SiLU with a polynomial expf"),
    DType.F64: PrecisionGuarantee(True, None, 1.7e-15, 3.6e-16, "f64 FMAs in tap order; SiLU with libm exp"),
    DType.BF16: PrecisionGuarantee(True, None, 7.9e-3, 1.2e-7, "widened exactly, f32 as for f32, one RNE store"),
    DType.F16: PrecisionGuarantee(True, None, 9.8e-4, 1.2e-7, "widened exactly, f32 as for f32, one rounding"),
}


def register(registry: FusedKernelRegistry) -> None:
    rev = revision_of(causal_conv1d_f32)
    kernels = {DType.F32: causal_conv1d_f32, DType.F64: causal_conv1d_f64, DType.BF16: causal_conv1d_bf16,
               DType.F16: causal_conv1d_f16}
    for dt in FLOAT_DTYPES:
        registry.register(BackendImpl(FusedOps.CAUSAL_CONV1D, "cpu", kernels[dt], (dt,) * 4, causal_conv1d_cost,
                                      CAUSAL_CONV1D_PRECISION[dt], CONTIGUOUS_ONLY, rev))
