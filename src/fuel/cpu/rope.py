"""Rope (entry 5): rotate-half rotary embedding, one task over (outer, s) rows.

x is seen as `[outer·S, D]`; row r uses table row `r % S`. x, cos and sin are read in place wherever their
rows lie (`row_tasks.row_layout`: a unit-stride last axis, up to three row strides: heads transposed,
sliced tables, offset starts), out is C-contiguous. Per pair (i, i + D/2):
`out_lo = x_lo·c_lo - x_hi·s_lo`, `out_hi = x_hi·c_hi + x_lo·s_hi`, computed in f32 (f64 for f64)
with a fixed operation order, so results are bit-stable. bf16 rows and table rows are widened from their
uint16 bits (exactly) and rounded once (RNE) on store; f16 goes through exact f32 copies.
One job serves every dtype the task reads: the eager kernel runs it and native replay posts it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.norms.row_tasks import Layout, reads_rows, row_at, row_layout
from fuel.cpu.simd.half import bits, narrow_bf16_row, via_f32
from fuel.cpu.simd.vecmath import bf16_to_f32
from fuel.dispatch.impls import (
    BackendImpl,
    FusedKernelRegistry,
    KernelCaps,
    PrecisionGuarantee,
    elementwise_cost,
    revision_of,
)
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.registry import FusedOps
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import ADDRESS, INT, record_at

# `contract` lets LLVM use FMA (fixed per build, so still bit-stable; error stays below the bound);
# no reassociation is needed since there are no reductions.
FASTMATH = {"nsz", "contract"}
SECONDS_PER_VALUE = 0.5e-9  # one core's time a value, for the part count

# x_*, c_* and s_* are the `row_layout`s of x, cos and sin
ROPE_ARGS = jobs.record(x=ADDRESS, cos=ADDRESS, sin=ADDRESS, out=ADDRESS, rows=INT, dim=INT, table_rows=INT,
                        x_s0=INT, x_n1=INT, x_s1=INT, x_n2=INT, x_s2=INT,
                        c_s0=INT, c_n1=INT, c_s1=INT, c_n2=INT, c_s2=INT,
                        s_s0=INT, s_n1=INT, s_s1=INT, s_n2=INT, s_s2=INT)


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _rope_row(x: Any, c: Any, s: Any, o: Any, h: int) -> None:
    for i in range(h):
        lo = x[i]
        hi = x[i + h]
        o[i] = lo * c[i] - hi * s[i]
        o[i + h] = hi * c[i + h] + lo * s[i + h]


@njit(inline="always", cache=True)
def _where(a: Any) -> tuple[Any, Any, Any]:
    """`row_at`'s `where` of x, cos and sin, read out of the record once, before a row loop."""
    return ((a.x, a.x_s0, a.x_n1, a.x_s1, a.x_n2, a.x_s2), (a.cos, a.c_s0, a.c_n1, a.c_s1, a.c_n2, a.c_s2),
            (a.sin, a.s_s0, a.s_n1, a.s_s1, a.s_n2, a.s_s2))


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _rope_rows(part: int, parts: int, argv: int, dt: Any) -> None:
    """Rows [part·rows/parts, (part+1)·rows/parts) of x, cos, sin and out, all of type dt."""
    a = record_at(argv, ROPE_ARGS)
    rows, d, seq = a.rows, a.dim, a.table_rows
    out = carray(pointer(a.out, dt), (rows, d))
    xw, cw, sw = _where(a)
    for r in range(part * rows // parts, (part + 1) * rows // parts):
        t = r % seq
        _rope_row(row_at(xw, r, d, dt), row_at(cw, t, d, dt), row_at(sw, t, d, dt), out[r], d // 2)


@pool.task(fastmath=FASTMATH)
def _rope_f32_part(part: int, parts: int, argv: int) -> None:
    _rope_rows(part, parts, argv, np.float32)


@pool.task(fastmath=FASTMATH)
def _rope_f64_part(part: int, parts: int, argv: int) -> None:
    _rope_rows(part, parts, argv, np.float64)


@pool.task(fastmath=FASTMATH)
def _rope_bf16_part(part: int, parts: int, argv: int) -> None:
    """bf16 bits: widen the row's two halves and its table rows into scratch, rotate, round: short loops
    that each vectorise."""
    a = record_at(argv, ROPE_ARGS)
    rows, d, seq = a.rows, a.dim, a.table_rows
    h = d // 2
    out = carray(pointer(a.out, np.uint16), (rows, d))
    xl, cl, sl = _where(a)
    xw = np.empty(d, np.float32)
    cw = np.empty(d, np.float32)
    sw = np.empty(d, np.float32)
    res = np.empty(d, np.float32)
    for r in range(part * rows // parts, (part + 1) * rows // parts):
        t = r % seq
        x, c, s = row_at(xl, r, d, np.uint16), row_at(cl, t, d, np.uint16), row_at(sl, t, d, np.uint16)
        for i in range(d):
            xw[i] = bf16_to_f32(x[i])
            cw[i] = bf16_to_f32(c[i])
            sw[i] = bf16_to_f32(s[i])
        for i in range(h):
            res[i] = xw[i] * cw[i] - xw[i + h] * sw[i]
            res[i + h] = xw[i + h] * cw[i + h] + xw[i] * sw[i + h]
        narrow_bf16_row(res.view(np.uint32), out[r])


_TASKS = {np.dtype(np.float32): _rope_f32_part, np.dtype(np.float64): _rope_f64_part,
          DType.BF16.np: _rope_bf16_part}


@njit(cache=True)
def _fill(x: int, cos: int, sin: int, out: Any, table_rows: int, xl: Layout, cl: Layout, sl: Layout,
          argv: Any) -> None:
    a = argv[0]
    a.x, a.cos, a.sin, a.out = x, cos, sin, out.ctypes.data
    a.rows, a.dim, a.table_rows = out.size // out.shape[-1], out.shape[-1], table_rows
    a.x_s0, a.x_n1, a.x_s1, a.x_n2, a.x_s2 = xl
    a.c_s0, a.c_n1, a.c_s1, a.c_n2, a.c_s2 = cl
    a.s_s0, a.s_n1, a.s_s1, a.s_n2, a.s_s2 = sl


def rope_job(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> jobs.Jobs | None:
    """x, cos, sin and out of one dtype among f32, f64 and bf16; out C-contiguous and each input with a
    `row_layout` (None otherwise)."""
    x, cos, sin = inputs
    task = _TASKS.get(out.dtype)
    if not out.size:
        return ()
    if task is None or not out.flags.c_contiguous or not all(a.dtype == out.dtype for a in inputs):
        return None
    xl, cl, sl = row_layout(x), row_layout(cos), row_layout(sin)
    if xl is None or cl is None or sl is None:
        return None
    argv = jobs.argv_of(ROPE_ARGS)
    _fill(x.ctypes.data, cos.ctypes.data, sin.ctypes.data, bits(out) if out.dtype == DType.BF16.np else out,
          cos.size // cos.shape[-1], xl, cl, sl, argv)
    return jobs.job(task, argv, out.size * SECONDS_PER_VALUE, int(argv[0]["rows"]))


rope_kernel = jobs.kernel(rope_job)


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
    """Every float dtype; inputs whose rows have a `row_layout` are read in place."""
    rev = revision_of(_rope_rows, _rope_bf16_part.fn)
    caps = KernelCaps(strided_input=True, reads=reads_rows)
    for dt in FLOAT_DTYPES:
        kernel = via_f32(rope_kernel) if dt == DType.F16 else rope_kernel
        registry.register(BackendImpl(FusedOps.ROPE, "cpu", kernel, (dt, dt, dt, dt),
                                      elementwise_cost(3), ROPE_PRECISION[dt], caps, rev))
