"""CausalConv1d (entry 18) on the CPU: one task over (batch, channel) rows, SiLU fused.

Each output row is seeded with the bias, takes its K taps in ascending order as whole-row vector
passes (`o[t] += w[k]·x[t + k]`, fused multiply-adds, in L1), then the SiLU in place, so x is read
once and the output written once. A row is one item of the task: the bytes never depend on the part
count.
SiLU is `y·σ(y)` with σ from a vectorised expf on −|y| (f32; libm exp for f64). bf16 rows are widened
into f32 scratch and rounded once on store; f16 runs the f32 kernel on a widened copy; f64 computes in
f64. The decode step (`causal_conv1d_step`, one new column over a K − 1 state) is this kernel on a
[B, C, K] window; its time estimate runs it in the calling thread. The eager kernel runs the job and
native replay posts the same one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import carray, njit

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
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import ADDRESS, INT, record_at

# Contraction into FMAs only: no reassociation (the taps keep their order), no nnan/ninf (NaN and inf
# propagate as in IEEE arithmetic).
FASTMATH = {"contract"}
# The tasks use NumPy's error model: SiLU's divisions (by 1 + e >= 1) then carry no zero check, which kept
# the SiLU loop scalar (docs/performance/conv.md, "causal_conv1d").


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


CAUSAL_ARGS = jobs.record(x=ADDRESS, w=ADDRESS, bias=ADDRESS, out=ADDRESS, rows=INT, length_in=INT, length=INT,
                          channels=INT, taps=INT, silu=INT)
SECONDS_PER_FLOP = 0.25e-9  # one core's time per flop of the taps and SiLU, for the part count


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _causal_rows(part: int, parts: int, argv: int, dt: Any) -> None:
    """Rows [part·rows/parts, (part+1)·rows/parts) of x [rows, L + K − 1], w [C, K], bias [C] and
    out [rows, L], all of type dt (row r is channel r % C)."""
    a = record_at(argv, CAUSAL_ARGS)
    rows, c, k = a.rows, a.channels, a.taps
    x = carray(pointer(a.x, dt), (rows, a.length_in))
    w = carray(pointer(a.w, dt), (c, k))
    bias = carray(pointer(a.bias, dt), (c,))
    out = carray(pointer(a.out, dt), (rows, a.length))
    for r in range(part * rows // parts, (part + 1) * rows // parts):
        ch = r % c
        _taps(x[r], w[ch], bias[ch], out[r], a.silu != 0)


@pool.task(fastmath=FASTMATH, error_model="numpy")
def _causal_f32_part(part: int, parts: int, argv: int) -> None:
    _causal_rows(part, parts, argv, np.float32)


@pool.task(fastmath=FASTMATH, error_model="numpy")
def _causal_f64_part(part: int, parts: int, argv: int) -> None:
    _causal_rows(part, parts, argv, np.float64)


@pool.task(fastmath=FASTMATH, error_model="numpy")
def _causal_bf16_part(part: int, parts: int, argv: int) -> None:
    """bf16 bits in and out; each row widened into f32 scratch (fully rewritten per row), computed in
    f32, rounded once."""
    a = record_at(argv, CAUSAL_ARGS)
    rows, lin, n, c, k = a.rows, a.length_in, a.length, a.channels, a.taps
    x = carray(pointer(a.x, np.uint16), (rows, lin))
    w = carray(pointer(a.w, np.uint16), (c, k))
    bias = carray(pointer(a.bias, np.uint16), (c,))
    out = carray(pointer(a.out, np.uint16), (rows, n))
    wide = np.empty(lin, np.float32)
    acc = np.empty(n, np.float32)
    wr = np.empty(k, np.float32)
    for r in range(part * rows // parts, (part + 1) * rows // parts):
        ch = r % c
        xr = x[r]
        for j in range(lin):
            wide[j] = bf16_to_f32(xr[j])
        for j in range(k):
            wr[j] = bf16_to_f32(w[ch, j])
        _taps(wide, wr, bf16_to_f32(bias[ch]), acc, a.silu != 0)
        o = out[r]
        for t in range(n):
            o[t] = f32_to_bf16(acc[t])


_TASKS = {np.dtype(np.float32): _causal_f32_part, np.dtype(np.float64): _causal_f64_part,
          DType.BF16.np: _causal_bf16_part}


@njit(cache=True)
def _fill(x: Any, w: Any, bias: Any, out: Any, silu: bool, argv: Any) -> None:
    a = argv[0]
    a.x, a.w, a.bias, a.out = x.ctypes.data, w.ctypes.data, bias.ctypes.data, out.ctypes.data
    a.rows, a.length_in, a.length = x.shape[0] * x.shape[1], x.shape[2], out.shape[2]
    a.channels, a.taps, a.silu = w.shape[0], w.shape[2], 1 if silu else 0


def causal_conv1d_job(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> jobs.Jobs | None:
    """x [B, C, L + K − 1], w [C, 1, K], bias [C] and out [B, C, L] of one dtype among f32, f64 and bf16,
    C-contiguous (None otherwise)."""
    task = _TASKS.get(out.dtype)
    if not out.size:
        return ()
    if task is None or not all(v.flags.c_contiguous and v.dtype == out.dtype for v in (*inputs, out)):
        return None
    x, w, bias = inputs
    if out.dtype == DType.BF16.np:  # the task reads the bits
        x, w, bias, out = bits(x), bits(w), bits(bias), bits(out)
    argv = jobs.argv_of(CAUSAL_ARGS)
    _fill(x, w, bias, out, bool(params.use_silu), argv)
    flops = out.size * (2 * w.shape[2] + (10 if params.use_silu else 0))
    return jobs.job(task, argv, flops * SECONDS_PER_FLOP, x.shape[0] * x.shape[1])


causal_conv1d_kernel = jobs.kernel(causal_conv1d_job)
causal_conv1d_f16 = via_f32(causal_conv1d_kernel)


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
    rev = revision_of(causal_conv1d_job)
    for dt in FLOAT_DTYPES:
        kernel = causal_conv1d_f16 if dt == DType.F16 else causal_conv1d_kernel
        registry.register(BackendImpl(FusedOps.CAUSAL_CONV1D, "cpu", kernel, (dt,) * 4, causal_conv1d_cost,
                                      CAUSAL_CONV1D_PRECISION[dt], CONTIGUOUS_ONLY, rev))
