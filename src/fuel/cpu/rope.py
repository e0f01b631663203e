"""Rope (entry 5): rotate-half rotary embedding in one Numba pass, parallel over (outer, s) rows.

x is seen as `[outer·S, D]`; row r uses table row `r % S`. Per pair (i, i + D/2):
`out_lo = x_lo·c_lo - x_hi·s_lo`, `out_hi = x_hi·c_hi + x_lo·s_hi`, computed in f32 (f64 for f64)
with a fixed operation order, so results are bit-stable. bf16 rows are widened from their uint16
bits and rounded once (RNE) on store; f16 goes through exact f32 copies.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit, prange

from fuel.cpu.simd.driver import chunk_bounds, chunk_count, row_kernel
from fuel.cpu.simd.half import bits, narrow_bf16_row, via_f32
from fuel.cpu.simd.vecmath import bf16_to_f32
from fuel.dispatch.impls import (
    CONTIGUOUS_ONLY,
    BackendImpl,
    FusedKernelRegistry,
    PrecisionGuarantee,
    elementwise_cost,
    revision_of,
)
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.registry import FusedOps
from fuel.runtime import jobs as launches
from fuel.runtime import pool as spin
from fuel.runtime import replay as native
from fuel.runtime.atomics import pointer

# `contract` lets LLVM use FMA (fixed per build, so still bit-stable; error stays below the bound);
# no reassociation is needed since there are no reductions.
FASTMATH = {"nsz", "contract"}


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _rope_row(x: Any, c: Any, s: Any, o: Any, h: int) -> None:
    for i in range(h):
        lo = x[i]
        hi = x[i + h]
        o[i] = lo * c[i] - hi * s[i]
        o[i + h] = hi * c[i + h] + lo * s[i + h]


@row_kernel(fastmath=FASTMATH)
def _rope(x: Any, cos: Any, sin: Any, out: Any) -> None:
    """x, out [rows, D]; cos, sin [S, D]; f32 or f64 (the arrays' own type)."""
    rows, d = x.shape
    seq = cos.shape[0]
    h = d // 2
    chunks = chunk_count(rows)
    for c in prange(chunks):
        start, stop = chunk_bounds(c, rows, chunks)
        for r in range(start, stop):
            t = r % seq
            _rope_row(x[r], cos[t], sin[t], out[r], h)


@row_kernel(fastmath=FASTMATH)
def _rope_bf16(x: Any, cos: Any, sin: Any, out: Any) -> None:
    """bf16 bits: x, out [rows, D] uint16; cos, sin [S, D] already widened to f32.

    Widen the two halves into scratch, rotate, round: three short loops that each vectorise.
    """
    rows, d = x.shape
    seq = cos.shape[0]
    h = d // 2
    chunks = chunk_count(rows)
    for c in prange(chunks):
        lo = np.empty(h, np.float32)
        hi = np.empty(h, np.float32)
        res = np.empty(d, np.float32)
        start, stop = chunk_bounds(c, rows, chunks)
        for r in range(start, stop):
            t = r % seq
            xr = x[r]
            for i in range(h):
                lo[i] = bf16_to_f32(xr[i])
                hi[i] = bf16_to_f32(xr[i + h])
            ct = cos[t]
            st = sin[t]
            for i in range(h):
                res[i] = lo[i] * ct[i] - hi[i] * st[i]
                res[i + h] = hi[i] * ct[i + h] + lo[i] * st[i + h]
            narrow_bf16_row(res.view(np.uint32), out[r])


def _rows(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1, a.shape[-1])


def rope_f64(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
    x, cos, sin = inputs
    if out.size:
        _rope(_rows(x), cos, sin, _rows(out))


# f32 runs as a task of the spinning pool, in the calling thread for a decode step's few rows (Numba's
# parallel region took ~5 µs to enter for ~0.3 µs of work), and the native replay posts the same task
# (`fuel.runtime.replay`): one machine code, so the same bytes, whoever runs it.
SECONDS_PER_VALUE = 0.5e-9  # one core
_ARGS = 7  # x, cos, sin, out, rows, head dim, table rows


@spin.task(fastmath=FASTMATH)
def _rope_f32_part(part: int, parts: int, argv: int) -> None:
    v = carray(pointer(argv, np.int64), (_ARGS,))
    rows, d, seq = v[4], v[5], v[6]
    x = carray(pointer(v[0], np.float32), (rows, d))
    cos = carray(pointer(v[1], np.float32), (seq, d))
    sin = carray(pointer(v[2], np.float32), (seq, d))
    out = carray(pointer(v[3], np.float32), (rows, d))
    for r in range(part * rows // parts, (part + 1) * rows // parts):
        t = r % seq
        _rope_row(x[r], cos[t], sin[t], out[r], d // 2)


@njit(cache=True)
def _fill_rope(x: Any, cos: Any, sin: Any, out: Any, argv: Any) -> None:
    argv[0], argv[1], argv[2], argv[3] = x.ctypes.data, cos.ctypes.data, sin.ctypes.data, out.ctypes.data
    argv[4], argv[5], argv[6] = out.size // out.shape[-1], out.shape[-1], cos.shape[0]


def _rope_job(inputs: list[np.ndarray], out: np.ndarray) -> launches.Launch:
    """The task's job for x, cos, sin and out (f32, C-contiguous)."""
    x, cos, sin = inputs
    argv = np.empty(_ARGS, np.int64)
    _fill_rope(x, cos, sin, out, argv)
    return launches.prepare(_rope_f32_part, argv, out.size * SECONDS_PER_VALUE, int(argv[4]))


def rope_f32(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
    if out.size:
        launches.run(_rope_job(inputs, out))


@native.fused_form(rope_f32)
def rope_form(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> native.Form | None:
    if not (out.size and all(a.flags.c_contiguous and a.dtype == np.float32 for a in (*inputs, out))):
        return None
    return native.form(_rope_job(inputs, out))


rope_f16 = via_f32(rope_f32)


def rope_bf16(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
    x, cos, sin = inputs
    if out.size:
        # The tables are only [S, D]: widen them once (exactly) instead of per row.
        c32, s32 = cos.astype(np.float32), sin.astype(np.float32)
        _rope_bf16(_rows(bits(x)), c32, s32, _rows(bits(out)))


# |out - ref| <= max_relative·|ref| + max_absolute·S with S = |x|·|cos| + |rotate_half(x)|·|sin| per
# element (the two products can cancel). Twice the worst error `python -m fuel.testing.measure Rope`
# found over seeds 0-59; the relative part is at least the output's unit roundoff. The half types
# compute in f32 and round once, so their absolute part is the f32 impl's.
ROPE_PRECISION = {
    DType.F32: PrecisionGuarantee(True, None, 2.5e-7, 5.8e-8, "two products and one add in f32"),
    DType.F64: PrecisionGuarantee(True, None, 4.5e-16, 1.1e-16, "two products and one add in f64"),
    DType.BF16: PrecisionGuarantee(True, None, 7.9e-3, 5.8e-8, "f32 compute, one RNE rounding on store"),
    DType.F16: PrecisionGuarantee(True, None, 9.8e-4, 5.8e-8, "f32 compute, one rounding on store"),
}


def register(registry: FusedKernelRegistry) -> None:
    rev = revision_of(_rope)
    kernels = {DType.F32: rope_f32, DType.F64: rope_f64, DType.BF16: rope_bf16, DType.F16: rope_f16}
    for dt in FLOAT_DTYPES:
        registry.register(BackendImpl(FusedOps.ROPE, "cpu", kernels[dt], (dt, dt, dt, dt),
                                      elementwise_cost(3), ROPE_PRECISION[dt], CONTIGUOUS_ONLY, rev))
