"""RmsNorm (3), LayerNorm (4) and their backwards (9, 8) over the last axis: Numba, row-parallel.

One thread owns a row (the row functions, and how they survive rows whose squares overflow, are in
norm_rows), so results are bit-stable; the result goes straight into `out`. f32 and f64 run the
same kernels, bf16 rows are widened into an f32 scratch row and rounded once on store, f16 runs
the f32 kernel on a widened copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numba import carray, njit, prange

from fuel.cpu.norms.norm_rows import (
    ln_bwd_row,
    ln_bwd_row_rescaled,
    ln_row,
    ln_row_rescaled,
    rms_bwd_row,
    rms_bwd_row_rescaled,
    rms_row,
    rms_row_rescaled,
    widened,
)
from fuel.cpu.simd.driver import chunk_bounds, chunk_count, row_kernel
from fuel.cpu.simd.half import bits, narrow_bf16_row, rows2d, via_f32, widen_bf16_row
from fuel.dispatch.impls import (
    CONTIGUOUS_ONLY,
    BackendImpl,
    CostEstimate,
    CostFn,
    FusedKernelRegistry,
    PrecisionGuarantee,
    revision_of,
)
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.node import Shape
from fuel.graph.registry import FusedOps
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer

Kernel = Callable[[list[np.ndarray], np.ndarray, Any], None]
_BF16 = DType.BF16.np


# ---- whole tensors: f32/f64 directly, bf16 through per-chunk scratch rows ---------------------
# The fast pass flags the rows whose sums overflowed; a second pass redoes only those, so the fast
# loop holds no call to the fallback (one there cost the bf16 loop ~10% on rows in cache).


@njit(cache=True)
def _any(flags: Any) -> bool:
    for f in flags:  # noqa: SIM110  (a loop Numba compiles; any() of a generator it does not)
        if f:
            return True
    return False


@row_kernel()
def _rms(x: Any, out: Any, eps: Any, inv_n: Any, one: Any) -> None:
    bad = np.empty(x.shape[0], np.bool_)  # every row sets its flag
    for r in prange(x.shape[0]):
        bad[r] = not rms_row(x[r], out[r], eps, inv_n, one)
    if _any(bad):  # rare; serial, as Numba would make bad.any() (or np.zeros) a parallel region of its own
        redo = np.flatnonzero(bad)
        for i in prange(redo.size):
            rms_row_rescaled(x[redo[i]], out[redo[i]], eps, inv_n, one)


@row_kernel()
def _ln(x: Any, out: Any, eps: Any, inv_n: Any, one: Any) -> None:
    bad = np.empty(x.shape[0], np.bool_)  # every row sets its flag
    for r in prange(x.shape[0]):
        bad[r] = not ln_row(x[r], out[r], eps, inv_n, one)
    if _any(bad):  # rare; serial, as Numba would make bad.any() (or np.zeros) a parallel region of its own
        redo = np.flatnonzero(bad)
        for i in prange(redo.size):
            ln_row_rescaled(x[redo[i]], out[redo[i]], eps, inv_n, one)


@row_kernel()
def _ln_bwd(x: Any, g: Any, out: Any, eps: Any, inv_n: Any, one: Any) -> None:
    bad = np.empty(x.shape[0], np.bool_)  # every row sets its flag
    for r in prange(x.shape[0]):
        bad[r] = not ln_bwd_row(x[r], g[r], out[r], eps, inv_n, one, True)
    if _any(bad):  # rare; serial, as Numba would make bad.any() (or np.zeros) a parallel region of its own
        redo = np.flatnonzero(bad)
        for i in prange(redo.size):
            ln_bwd_row_rescaled(x[redo[i]], g[redo[i]], out[redo[i]], eps, inv_n, one)


@row_kernel()
def _rms_bwd(x: Any, g: Any, out: Any, eps: Any, inv_n: Any, one: Any) -> None:
    bad = np.empty(x.shape[0], np.bool_)  # every row sets its flag
    for r in prange(x.shape[0]):
        bad[r] = not rms_bwd_row(x[r], g[r], out[r], eps, inv_n, one, True)
    if _any(bad):  # rare; serial, as Numba would make bad.any() (or np.zeros) a parallel region of its own
        redo = np.flatnonzero(bad)
        for i in prange(redo.size):
            rms_bwd_row_rescaled(x[redo[i]], g[redo[i]], out[redo[i]], eps, inv_n, one)


@row_kernel()
def _rms_bf16(x: Any, out: Any, eps: Any, inv_n: Any, one: Any) -> None:
    rows, n = x.shape
    chunks = chunk_count(rows)
    bad = np.empty(rows, np.bool_)  # every row sets its flag
    for c in prange(chunks):
        wide = np.empty(n, np.uint32)
        res = np.empty(n, np.float32)
        start, stop = chunk_bounds(c, rows, chunks)
        for r in range(start, stop):
            widen_bf16_row(x[r], wide)
            bad[r] = not rms_row(wide.view(np.float32), res, eps, inv_n, one)
            narrow_bf16_row(res.view(np.uint32), out[r])
    if _any(bad):  # rare; serial, as Numba would make bad.any() (or np.zeros) a parallel region of its own
        redo = np.flatnonzero(bad)
        for i in prange(redo.size):
            res = np.empty(n, np.float32)
            rms_row_rescaled(widened(x[redo[i]]), res, eps, inv_n, one)
            narrow_bf16_row(res.view(np.uint32), out[redo[i]])


@row_kernel()
def _ln_bf16(x: Any, out: Any, eps: Any, inv_n: Any, one: Any) -> None:
    rows, n = x.shape
    chunks = chunk_count(rows)
    bad = np.empty(rows, np.bool_)  # every row sets its flag
    for c in prange(chunks):
        wide = np.empty(n, np.uint32)
        res = np.empty(n, np.float32)
        start, stop = chunk_bounds(c, rows, chunks)
        for r in range(start, stop):
            widen_bf16_row(x[r], wide)
            bad[r] = not ln_row(wide.view(np.float32), res, eps, inv_n, one)
            narrow_bf16_row(res.view(np.uint32), out[r])
    if _any(bad):  # rare; serial, as Numba would make bad.any() (or np.zeros) a parallel region of its own
        redo = np.flatnonzero(bad)
        for i in prange(redo.size):
            res = np.empty(n, np.float32)
            ln_row_rescaled(widened(x[redo[i]]), res, eps, inv_n, one)
            narrow_bf16_row(res.view(np.uint32), out[redo[i]])


@row_kernel()
def _ln_bwd_bf16(x: Any, g: Any, out: Any, eps: Any, inv_n: Any, one: Any) -> None:
    rows, n = x.shape
    chunks = chunk_count(rows)
    bad = np.empty(rows, np.bool_)  # every row sets its flag
    for c in prange(chunks):
        wx = np.empty(n, np.uint32)
        wg = np.empty(n, np.uint32)
        res = np.empty(n, np.float32)
        start, stop = chunk_bounds(c, rows, chunks)
        for r in range(start, stop):
            widen_bf16_row(x[r], wx)
            widen_bf16_row(g[r], wg)
            bad[r] = not ln_bwd_row(wx.view(np.float32), wg.view(np.float32), res, eps, inv_n, one, True)
            narrow_bf16_row(res.view(np.uint32), out[r])
    if _any(bad):  # rare; serial, as Numba would make bad.any() (or np.zeros) a parallel region of its own
        redo = np.flatnonzero(bad)
        for i in prange(redo.size):
            res = np.empty(n, np.float32)
            ln_bwd_row_rescaled(widened(x[redo[i]]), widened(g[redo[i]]), res, eps, inv_n, one)
            narrow_bf16_row(res.view(np.uint32), out[redo[i]])


@row_kernel()
def _rms_bwd_bf16(x: Any, g: Any, out: Any, eps: Any, inv_n: Any, one: Any) -> None:
    rows, n = x.shape
    chunks = chunk_count(rows)
    bad = np.empty(rows, np.bool_)  # every row sets its flag
    for c in prange(chunks):
        wx = np.empty(n, np.uint32)
        wg = np.empty(n, np.uint32)
        res = np.empty(n, np.float32)
        start, stop = chunk_bounds(c, rows, chunks)
        for r in range(start, stop):
            widen_bf16_row(x[r], wx)
            widen_bf16_row(g[r], wg)
            bad[r] = not rms_bwd_row(wx.view(np.float32), wg.view(np.float32), res, eps, inv_n, one, True)
            narrow_bf16_row(res.view(np.uint32), out[r])
    if _any(bad):  # rare; serial, as Numba would make bad.any() (or np.zeros) a parallel region of its own
        redo = np.flatnonzero(bad)
        for i in prange(redo.size):
            res = np.empty(n, np.float32)
            rms_bwd_row_rescaled(widened(x[redo[i]]), widened(g[redo[i]]), res, eps, inv_n, one)
            narrow_bf16_row(res.view(np.uint32), out[redo[i]])


# ---- kernel entry points: kernel(inputs, out, params) ----------------------------------------


@functools.lru_cache(maxsize=256)
def _scalars_for(wide: bool, eps: float, n: int) -> tuple[Any, Any, Any]:
    w = np.float64 if wide else np.float32
    return w(eps), w(1.0) / w(n), w(1.0)


def _scalars(out: np.ndarray, eps: float) -> tuple[Any, Any, Any]:
    """eps, 1/n and 1 in the working type: f64 for f64, else f32 (eps rounded once, as upstream)."""
    return _scalars_for(out.dtype == np.float64, eps, out.shape[-1])


def _native(run: Callable[..., None]) -> Kernel:
    """An f32/f64/bf16 kernel: rows of every input and of out, bf16 seen as its uint16 bits."""

    def kernel(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
        if not out.size:
            return
        scalars = _scalars(out, params.eps)
        half = out.dtype == _BF16
        arrays = [rows2d(bits(a) if half else a) for a in (*inputs, out)]
        run(*arrays, *scalars)

    kernel.__wrapped__ = run  # type: ignore[attr-defined]
    return kernel


def _kernels(native: Callable[..., None], bf16: Callable[..., None]) -> dict[DType, Kernel]:
    f32 = _native(native)
    return {DType.F32: f32, DType.F64: f32, DType.BF16: _native(bf16), DType.F16: via_f32(f32)}


# ---- RmsNorm in f32: a task of the spinning pool, the same machine code for every caller ----------
# A decode step's norm is one row of 576-1024 values, ~0.5 µs of work: entering Numba's parallel region
# took 5 µs of it. The task runs in the calling thread for such a row, is posted for many rows, and is
# what the native replay posts too (`fuel.runtime.replay`), so every path gives the same bytes.
RMS_SECONDS_PER_VALUE = 0.5e-9  # one core
_RMS_ARGS = 6  # x, out, rows, cols, eps and 1/cols (f32, in the low half of their entries)


@pool.task()
def _rms_f32_part(part: int, parts: int, argv: int) -> None:
    v = carray(pointer(argv, np.int64), (_RMS_ARGS,))
    rows, cols = v[2], v[3]
    x = carray(pointer(v[0], np.float32), (rows, cols))
    out = carray(pointer(v[1], np.float32), (rows, cols))
    eps = carray(pointer(argv + 32, np.float32), (1,))[0]
    inv_n = carray(pointer(argv + 40, np.float32), (1,))[0]
    one = np.float32(1)
    for r in range(part * rows // parts, (part + 1) * rows // parts):
        if not rms_row(x[r], out[r], eps, inv_n, one):
            rms_row_rescaled(x[r], out[r], eps, inv_n, one)


@njit(cache=True)
def _fill_rms(x: Any, out: Any, eps: Any, inv_n: Any, argv: Any) -> None:
    argv[0], argv[1], argv[2], argv[3] = x.ctypes.data, out.ctypes.data, out.size // out.shape[-1], out.shape[-1]
    f = argv.view(np.float32)  # eps and 1/cols in the low halves of entries 4 and 5 (little-endian)
    f[8], f[10] = eps, inv_n


def _rms_job(x: np.ndarray, out: np.ndarray, eps: float) -> jobs.Job:
    """The task's job for x and out (f32, C-contiguous, one shape)."""
    argv = np.zeros(_RMS_ARGS, np.int64)
    e, inv_n, _ = _scalars_for(False, eps, out.shape[-1])
    _fill_rms(x, out, e, inv_n, argv)
    return jobs.job(_rms_f32_part, argv, out.size * RMS_SECONDS_PER_VALUE, int(argv[2]))


def rms_norm_f32(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
    if out.size:
        jobs.run(_rms_job(inputs[0], out, params.eps))


@jobs.replays(rms_norm_f32)
def rms_norm_form(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> jobs.Job | None:
    x = inputs[0]
    if not (out.size and x.dtype == out.dtype == np.float32 and x.flags.c_contiguous and out.flags.c_contiguous):
        return None
    return _rms_job(x, out, params.eps)


rms_norm_kernels = {**_kernels(_rms, _rms_bf16), DType.F32: rms_norm_f32, DType.F16: via_f32(rms_norm_f32)}
layer_norm_kernels = _kernels(_ln, _ln_bf16)
layer_norm_backward_kernels = _kernels(_ln_bwd, _ln_bwd_bf16)
rms_norm_backward_kernels = _kernels(_rms_bwd, _rms_bwd_bf16)


def norm_cost(flops_per_element: int) -> CostFn:
    """k flops per element plus one rsqrt per row; every input and the output move once."""

    def cost(shapes: Sequence[Shape], dtypes: Sequence[DType], params: Any) -> CostEstimate:
        out = shapes[-1]
        n = int(np.prod(out))
        rows = n // out[-1] if out and out[-1] else 0
        moved = sum(int(np.prod(s)) * d.itemsize for s, d in zip(shapes, dtypes, strict=True))
        return CostEstimate(flops=flops_per_element * n + 4 * rows, bytes_moved=moved)

    return cost


# (max_relative, max_absolute, measured) per dtype: |out - ref| <= max_relative·|ref| +
# max_absolute·S against float64, S = max|ref| over the row. Twice the worst error
# `python -m fuel.testing.measure RmsNormLastDim ...` found over seeds 0-59 of
# fuel.testing.reference.norms (huge rows included); the relative part is at least the output's
# unit roundoff. The half types compute in f32 and round once, so their absolute part is at least
# the f32 impl's. RmsNorm's error is relative only (x times one rounded factor). `measured` is the
# worst error the contract check saw over seeds 0-199, as a fraction of the bound.
_BOUNDS: dict[str, dict[DType, tuple[float, float, float]]] = {
    "rms": {DType.F32: (4.6e-7, 0.0, 0.49), DType.F64: (1.2e-15, 0.0, 0.47),
            DType.BF16: (7.9e-3, 0.0, 0.49), DType.F16: (9.8e-4, 0.0, 0.50)},
    "ln": {DType.F32: (5.6e-7, 4.3e-8, 0.74), DType.F64: (3.1e-14, 1.6e-14, 0.48),
           DType.BF16: (7.9e-3, 5.4e-8, 0.53), DType.F16: (9.8e-4, 4.3e-8, 0.78)},
    "ln_bwd": {DType.F32: (8.4e-6, 1.1e-6, 0.53), DType.F64: (6.8e-15, 4.6e-15, 0.55),
               DType.BF16: (7.9e-3, 1.1e-6, 0.49), DType.F16: (9.8e-4, 1.1e-6, 0.50)},
    "rms_bwd": {DType.F32: (1.5e-6, 8.1e-7, 0.50), DType.F64: (2.8e-15, 3.2e-15, 0.49),
                DType.BF16: (7.9e-3, 8.1e-7, 0.49), DType.F16: (9.8e-4, 8.1e-7, 0.50)},
}
_ACC = {DType.F32: "f32 accumulation", DType.F64: "f64 accumulation",
        DType.BF16: "f32 compute, one RNE store", DType.F16: "f32 compute, one RNE store"}


def _precision(kind: str) -> dict[DType, PrecisionGuarantee]:
    return {dt: PrecisionGuarantee(True, None, rel, abs_, f"{_ACC[dt]}; worst measured error "
                                   f"{seen:.2f} of this bound (seeds 0-199)")
            for dt, (rel, abs_, seen) in _BOUNDS[kind].items()}


def register(registry: FusedKernelRegistry) -> None:
    rev = revision_of(_rms, rms_row)
    table: list[tuple[Any, dict[DType, Kernel], CostFn, dict[DType, PrecisionGuarantee], int]] = [
        (FusedOps.RMS_NORM_LAST_DIM, rms_norm_kernels, norm_cost(3), _precision("rms"), 1),
        (FusedOps.LAYER_NORM_LAST_DIM, layer_norm_kernels, norm_cost(6), _precision("ln"), 1),
        (FusedOps.LAYER_NORM_LAST_DIM_BACKWARD, layer_norm_backward_kernels, norm_cost(12),
         _precision("ln_bwd"), 2),
        (FusedOps.RMS_NORM_LAST_DIM_BACKWARD, rms_norm_backward_kernels, norm_cost(7),
         _precision("rms_bwd"), 2),
    ]
    for op_id, kernels, cost, precision, arity in table:
        for dt in FLOAT_DTYPES:
            registry.register(BackendImpl(op_id, "cpu", kernels[dt], (dt,) * (arity + 1), cost,
                                          precision[dt], CONTIGUOUS_ONLY, rev))
