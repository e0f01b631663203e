"""SelectiveScan (entry 19) on the CPU: the Mamba-1 recurrence in f64 (its reverse scan is
`selective_scan_grad`).

A work item owns one batch row and a fixed block of `DB` channels: each channel's state h[:, d] evolves
on its own (b_t and c_t are shared by all channels), so the item's inner loops run across the block's
channels, contiguous in u, delta and y, and LLVM vectorises them; the sum y_t = Σ_n h·c_t adds the N
states in order in every lane. The state, exp(d·a) and every product are f64 whatever the dtype (the
spec's F64 accumulator), with `selective_math`'s exp and softplus. Each output is rounded once: f32
directly, bf16 through an f32 rounded to odd, f16 by NumPy from an f64 buffer (Numba has no f16; its
inputs are widened to f32 first, exactly). The items are one pool task's; they depend on the shape
only, so the bytes do not depend on the part count. The eager kernel runs the job and native replay
posts the same one (f32, f64 and bf16). Timings: docs/performance/conv.md, "selective_scan".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.scans.selective_math import (
    DB,
    FASTMATH,
    SCAN_SECONDS_PER_STATE_STEP,
    channel,
    exp64,
    kernel_out,
    kernel_view,
    load_a,
    load_step,
    scan_inputs,
)
from fuel.cpu.scans.selective_scan_grad import selective_scan_grad
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
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import ADDRESS, INT, record_at

__all__ = ["register", "selective_scan", "selective_scan_grad"]  # the gradient is looked up here (prims)

SCAN_ARGS = jobs.record(u=ADDRESS, delta=ADDRESS, a=ADDRESS, b=ADDRESS, c=ADDRESS, y=ADDRESS, last=ADDRESS,
                        batch=INT, length=INT, dim=INT, n=INT, softplus=INT)


@njit(inline="always", cache=True, fastmath=FASTMATH, error_model="numpy")
def _forward_items(part: int, parts: int, argv: int, din: Any, dout: Any) -> None:
    """Items [part·I/parts, (part+1)·I/parts) of the I = B·ceil(dim/DB) (batch row, channel block) items:
    u, delta, y [B, L, dim]; a [dim, N]; b, c [B, L, N]; last [B, dim, N]; inputs of type din, outputs
    of type dout."""
    r = record_at(argv, SCAN_ARGS)
    nb, seq, dim, ns = r.batch, r.length, r.dim, r.n
    u, delta, a, bm, cm = scan_inputs(r, din)
    y = carray(pointer(r.y, dout), (nb, seq, dim))
    last = carray(pointer(r.last, dout), (nb, dim, ns))
    nblk = (dim + DB - 1) // DB
    for item in range(part * nb * nblk // parts, (part + 1) * nb * nblk // parts):
        bi, d0 = item // nblk, (item % nblk) * DB
        w = min(DB, dim - d0)
        at = np.zeros((ns, DB))
        load_a(a, d0, w, at)
        h = np.zeros((ns, DB))
        dt, uu, dtu, acc = np.zeros(DB), np.zeros(DB), np.zeros(DB), np.empty(DB)
        for t in range(seq):
            load_step(u, delta, bi, t, d0, w, r.softplus != 0, dt, uu, dtu)
            acc[:] = 0.0
            for n in range(ns):
                bn, cn = widen64(bm[bi, t, n]), widen64(cm[bi, t, n])
                hn, an = h[n], at[n]
                for j in range(DB):
                    hv = exp64(dt[j] * an[j]) * hn[j] + dtu[j] * bn
                    hn[j] = hv
                    acc[j] += hv * cn
            for j in range(w):
                y[bi, t, channel(d0, j)] = narrow64(acc[j], y)
        for j in range(w):
            for n in range(ns):
                last[bi, d0 + j, n] = narrow64(h[n, j], last)


@pool.task(fastmath=FASTMATH, error_model="numpy")
def _forward_f32_part(part: int, parts: int, argv: int) -> None:
    _forward_items(part, parts, argv, np.float32, np.float32)


@pool.task(fastmath=FASTMATH, error_model="numpy")
def _forward_f64_part(part: int, parts: int, argv: int) -> None:
    _forward_items(part, parts, argv, np.float64, np.float64)


@pool.task(fastmath=FASTMATH, error_model="numpy")
def _forward_bf16_part(part: int, parts: int, argv: int) -> None:
    _forward_items(part, parts, argv, np.uint16, np.uint16)


@pool.task(fastmath=FASTMATH, error_model="numpy")
def _forward_f32_to_f64_part(part: int, parts: int, argv: int) -> None:
    """f16's form: inputs widened exactly to f32, outputs in f64 buffers."""
    _forward_items(part, parts, argv, np.float32, np.float64)


_TASKS = {(np.dtype(np.float32),) * 2: _forward_f32_part, (np.dtype(np.float64),) * 2: _forward_f64_part,
          (np.dtype(np.uint16),) * 2: _forward_bf16_part,
          (np.dtype(np.float32), np.dtype(np.float64)): _forward_f32_to_f64_part}


@njit(cache=True)
def _fill(u: Any, delta: Any, a: Any, b: Any, c: Any, y: Any, last: Any, softplus: bool, argv: Any) -> None:
    r = argv[0]
    r.u, r.delta, r.a, r.b, r.c = u.ctypes.data, delta.ctypes.data, a.ctypes.data, b.ctypes.data, c.ctypes.data
    r.y, r.last = y.ctypes.data, last.ctypes.data
    r.batch, r.length, r.dim, r.n, r.softplus = u.shape[0], u.shape[1], u.shape[2], a.shape[1], 1 if softplus else 0


def _forward_job(inputs: list[np.ndarray], y: np.ndarray, last: np.ndarray, softplus: bool) -> jobs.Job | None:
    """The forward over the arrays the tasks read (`kernel_view`, `kernel_out`): C-contiguous inputs of one
    dtype and outputs of one, a pair `_TASKS` holds (None otherwise)."""
    task = _TASKS.get((inputs[0].dtype, y.dtype))
    if task is None or last.dtype != y.dtype or not all(
            v.flags.c_contiguous and v.dtype == inputs[0].dtype for v in inputs) or not (
            y.flags.c_contiguous and last.flags.c_contiguous):
        return None
    argv = jobs.argv_of(SCAN_ARGS)
    u, delta, a, b, c = inputs
    _fill(u, delta, a, b, c, y, last, softplus, argv)
    nb, seq, dim = inputs[0].shape
    seconds = nb * seq * dim * (inputs[2].shape[1] + 2) * SCAN_SECONDS_PER_STATE_STEP
    return jobs.job(task, argv, seconds, nb * -(-dim // DB))


def selective_scan_job(inputs: list[np.ndarray], out: Any, params: Any) -> jobs.Jobs | None:
    """f32, f64 and bf16 (bf16 as its bits): (y, last_state) straight into out."""
    if not isinstance(out, tuple) or len(out) != 2:
        return None  # a step that does not hand over both outputs
    y, last = out
    if y.dtype == DType.F16.np or inputs[0].dtype == DType.F16.np:
        return None  # computed into f64 buffers by the eager kernel
    if not (y.size or last.size):
        return ()
    return _forward_job([kernel_view(x) for x in inputs], kernel_out(y)[0], kernel_out(last)[0],
                        bool(params.delta_softplus))


def selective_scan(inputs: list[np.ndarray], out: tuple[np.ndarray, ...], params: Any) -> None:
    """Every dtype: (y, last_state) into out."""
    bufs = [kernel_out(o) for o in out]
    if any(o.size for o in out):
        views = [kernel_view(x) for x in inputs]  # alive until the job has run
        found = _forward_job(views, bufs[0][0], bufs[1][0], bool(params.delta_softplus))
        if found is None:
            raise RuntimeError("selective_scan: no task for a call its impl is registered for")
        jobs.run(found)
    for (buf, copy), o in zip(bufs, out, strict=True):
        if copy:
            np.copyto(o, buf, casting="unsafe")


jobs.replays(selective_scan)(selective_scan_job)


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
