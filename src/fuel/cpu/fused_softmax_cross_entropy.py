"""FusedSoftmaxCrossEntropy (entry 17) and its logits gradient (primitive CROSS_ENTROPY_GRAD): tasks over rows.

One thread per row, rows independent, so the bytes do not depend on how the rows are split. A row is
read twice (its max, then Σ exp(x − max)); the row of a 32k vocabulary (128 KiB of f32) stays in L2
between the passes. For f32, bf16 and f16 logits the difference x − max is formed in f32 and
exponentiated with the vectorisable Cephes-style expf; every exponential is summed in f64, the target's
own term apart from the others, and the loss is formed in f64 as `(max − x_t) + log1p((e_t − 1) +
Σ_{j≠t} e_j)` (f64 logits use libm exp throughout), so a loss near 0 keeps its relative accuracy.
Per-row losses go to an f64 buffer and are summed serially in row order, so the mean and sum do not
depend on the thread count either. bf16 is read as uint16 bits and f16 as int16 bits and widened
exactly inside the loops; the forward allocates nothing of size [..., V].

Targets are checked before any row is read: a target outside [0, V) that is not ignore_index raises
IndexOutOfRange naming the value, its position and V.

The gradient `(softmax(row) − onehot(t))·scale` (scale = g/n_valid, g or g[row]) recomputes the row's
max; it stores each exponential once into the output row and scales it in place (f16 through an f32
scratch and NumPy's exact rounding; bf16 computes the exponentials twice and rounds once on store).
The target element is −Σ_{j≠t} e_j / Σ_j e_j · scale in f64, so it does not cancel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.norms.row_tasks import row_at, row_layout
from fuel.cpu.simd.vecmath import cast_like, exp_nonpositive, maxnum, narrow, widen
from fuel.dispatch.impls import (
    BackendImpl,
    CostEstimate,
    FusedKernelRegistry,
    KernelCaps,
    PrecisionGuarantee,
    revision_of,
)
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.errors import IndexOutOfRange
from fuel.graph.node import Shape
from fuel.graph.registry import FusedOps
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.buffers import POOL
from fuel.runtime.jobs import ADDRESS, INT, record_at

NAME = "fused_softmax_cross_entropy"

# Reassociation lets the row max and the f64 sum vectorise (a fixed order per build: still bit-stable);
# no nnan/ninf, so NaN and inf rows keep IEEE behaviour.
FASTMATH = {"nsz", "reassoc", "contract", "arcp"}
SECONDS_PER_VALUE = 1.5e-9  # one core's time a logit (a max pass and an exp pass), for the part count
# logits x [rows, cols] (bf16 as uint16 bits, f16 as int16 bits) wherever its rows lie (x_*: its
# `row_tasks.row_layout`), flat i64 targets t, the f64 per-row losses or scales, out [rows, cols] (the
# gradient's; unused by the forward)
CE_ARGS = jobs.record(x=ADDRESS, t=ADDRESS, rowwise=ADDRESS, out=ADDRESS, rows=INT, cols=INT, ignore=INT,
                      gradient=INT, x_s0=INT, x_n1=INT, x_s1=INT, x_n2=INT, x_s2=INT)


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _exp_sum(seg: Any, m: Any) -> float:
    """Σ exp(x − m) over a segment of a row, each exponential in the compute type, summed in f64. A loop
    over a slice from 0 (see docs/performance/rows.md, "fused_softmax_cross_entropy")."""
    s = 0.0
    for j in range(seg.shape[0]):
        s += np.float64(exp_nonpositive(widen(seg[j]) - m))
    return s


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _row_stats(xr: Any, t: int) -> Any:
    """(max, e_t = exp(x[t] − max), Σ_{j≠t} exp(x[j] − max)) of one row. The target is left out of the
    f64 sum (two vectorised ranges), so when it holds nearly all the mass the others keep their own
    relative accuracy: 1 − softmax_t and a loss near 0 come out without cancellation."""
    m = widen(xr[0])
    for j in range(1, xr.shape[0]):
        m = maxnum(m, widen(xr[j]))
    others = _exp_sum(xr[:t], m) + _exp_sum(xr[t + 1:], m)
    return m, np.float64(exp_nonpositive(widen(xr[t]) - m)), others


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _arrays(argv: int, out_dt: Any) -> tuple[Any, Any, Any, Any]:
    """(record, t, rowwise, out) of a cross-entropy job, out of out_dt (x's rows: `row_at`)."""
    a = record_at(argv, CE_ARGS)
    return (a, carray(pointer(a.t, np.int64), (a.rows,)), carray(pointer(a.rowwise, np.float64), (a.rows,)),
            carray(pointer(a.out, out_dt), (a.rows, a.cols)))


@njit(inline="always", cache=True)
def _x_where(a: Any) -> Any:
    """`row_at`'s `where` of the logits, read out of the record once, before a row loop."""
    return a.x, a.x_s0, a.x_n1, a.x_s1, a.x_n2, a.x_s2


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _losses(part: int, parts: int, argv: int, dt: Any) -> None:
    """losses[r] = logsumexp(x[r]) − x[r, t[r]] in f64, or 0 where t[r] == ignore (targets pre-checked),
    for rows [part·rows/parts, (part+1)·rows/parts).

    As (max − x_t) + log1p((e_t − 1) + Σ_{j≠t} e_j): e_t − 1 is exactly 0 when the target is the max,
    and otherwise the sum holds the max's own 1, so nothing cancels."""
    a, t, losses, _ = _arrays(argv, dt)
    xw, cols = _x_where(a), a.cols
    ignore = a.ignore
    for r in range(part * a.rows // parts, (part + 1) * a.rows // parts):
        tr = t[r]
        if tr == ignore:
            losses[r] = 0.0
        else:
            xr = row_at(xw, r, cols, dt)
            m, et, others = _row_stats(xr, tr)
            losses[r] = (np.float64(m) - np.float64(widen(xr[tr]))) + math.log1p((et - 1.0) + others)


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _grad(part: int, parts: int, argv: int, dt: Any, out_dt: Any) -> None:
    """out[r] = (softmax(x[r]) − onehot(t[r]))·scales[r], zero where t[r] == ignore (targets pre-checked);
    at the target softmax_t − 1 = −Σ_{j≠t} e_j / Σ_j e_j, formed in f64. x of type dt, out of out_dt."""
    a, t, scales, out = _arrays(argv, out_dt)
    xw, cols = _x_where(a), a.cols
    ignore = a.ignore
    for r in range(part * a.rows // parts, (part + 1) * a.rows // parts):
        tr = t[r]
        xr, o = row_at(xw, r, cols, dt), out[r]
        if tr == ignore:
            for j in range(xr.shape[0]):
                o[j] = 0
        else:
            m, et, others = _row_stats(xr, tr)
            total = et + others
            c = cast_like(scales[r] / total, m)
            for j in range(xr.shape[0]):
                o[j] = narrow(exp_nonpositive(widen(xr[j]) - m) * c, o)
            o[tr] = narrow(cast_like(-others / total * scales[r], m), o)


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _exp_store_sum(seg: Any, m: Any, o: Any) -> float:
    """o <- exp(seg − m) in the compute type; returns their sum in f64. The store and the sum are loops of
    their own: a loop that reads seg and writes o gets a runtime check of the distance between them, and
    its scalar fallback (o just past seg, as the buffer pool may hand it out) would sum in another order.
    An f32 o is summed as stored; an f64 row's exponentials are summed as `_exp_sum` forms them (that
    loop's order is the one a sum of o would not reproduce; see docs/performance/rows.md,
    "fused_softmax_cross_entropy")."""
    for j in range(seg.shape[0]):
        o[j] = exp_nonpositive(widen(seg[j]) - m)
    if o.itemsize == 8:
        return _exp_sum(seg, m)
    s = 0.0
    for j in range(seg.shape[0]):
        s += np.float64(o[j])
    return s


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _grad_in_place(part: int, parts: int, argv: int, dt: Any, out_dt: Any) -> None:
    """`_grad` for an out in the compute type (f32, or f64 for f64 rows): each exponential is computed
    once, stored, and scaled in place while the row is still in cache (one exp pass instead of two)."""
    a, t, scales, out = _arrays(argv, out_dt)
    xw, cols = _x_where(a), a.cols
    ignore = a.ignore
    for r in range(part * a.rows // parts, (part + 1) * a.rows // parts):
        tr = t[r]
        xr, o = row_at(xw, r, cols, dt), out[r]
        if tr == ignore:
            for j in range(xr.shape[0]):
                o[j] = 0
        else:
            m = widen(xr[0])
            for j in range(1, xr.shape[0]):
                m = maxnum(m, widen(xr[j]))
            others = _exp_store_sum(xr[:tr], m, o[:tr]) + _exp_store_sum(xr[tr + 1:], m, o[tr + 1:])
            total = np.float64(exp_nonpositive(widen(xr[tr]) - m)) + others
            c = cast_like(scales[r] / total, m)
            for j in range(xr.shape[0]):
                o[j] = o[j] * c
            o[tr] = cast_like(-others / total * scales[r], m)


# One task per logits dtype; a job's `gradient` field picks the forward's losses (0) or the gradient (1).
# bf16 computes the gradient's exponentials twice and rounds once on store, f16's gradient goes into an
# f32 scratch.
@njit(inline="always", cache=True, fastmath=FASTMATH)
def _rows(part: int, parts: int, argv: int, dt: Any, out_dt: Any, grad: Any) -> None:
    if record_at(argv, CE_ARGS).gradient:
        grad(part, parts, argv, dt, out_dt)
    else:
        _losses(part, parts, argv, dt)


@pool.task(fastmath=FASTMATH, error_model="numpy")
def _f32_part(part: int, parts: int, argv: int) -> None:
    _rows(part, parts, argv, np.float32, np.float32, _grad_in_place)


@pool.task(fastmath=FASTMATH, error_model="numpy")
def _f64_part(part: int, parts: int, argv: int) -> None:
    _rows(part, parts, argv, np.float64, np.float64, _grad_in_place)


@pool.task(fastmath=FASTMATH, error_model="numpy")
def _f16_part(part: int, parts: int, argv: int) -> None:
    _rows(part, parts, argv, np.int16, np.float32, _grad_in_place)


@pool.task(fastmath=FASTMATH, error_model="numpy")
def _bf16_part(part: int, parts: int, argv: int) -> None:
    _rows(part, parts, argv, np.uint16, np.uint16, _grad)


_TASKS = {DType.F32.np: _f32_part, DType.F64.np: _f64_part, DType.BF16.np: _bf16_part, DType.F16.np: _f16_part}


def _run(gradient: bool, logits: np.ndarray, t: np.ndarray, ignore: int, rowwise: np.ndarray, out: np.ndarray) -> None:
    """Run the losses or the gradient over rows: x the logits as [rows, V] (bf16/f16 as their bits), t the
    flat targets, rowwise f64 per row, out [rows, V] (or rowwise again for the forward)."""
    v = logits.shape[-1]
    x = logits.view(_BITS.get(logits.dtype, logits.dtype))
    layout = row_layout(x)
    if layout is None:  # rows no layout describes: the gradient primitive's are read from a contiguous copy
        x = np.ascontiguousarray(x)
        layout = row_layout(x)
        assert layout is not None
    t = np.ascontiguousarray(t, np.int64)
    rows = x.size // v
    argv = jobs.argv_of(CE_ARGS)
    row = argv[0]
    row["x"], row["t"], row["rowwise"], row["out"] = x.ctypes.data, t.ctypes.data, rowwise.ctypes.data, out.ctypes.data
    row["rows"], row["cols"], row["ignore"], row["gradient"] = rows, v, ignore, gradient
    for name, value in zip(("x_s0", "x_n1", "x_s1", "x_n2", "x_s2"), layout, strict=True):
        row[name] = value
    jobs.run(jobs.job(_TASKS[logits.dtype], argv, x.size * SECONDS_PER_VALUE, rows))


def reads_logits(k: int, a: np.ndarray) -> bool:
    """`KernelCaps.reads` of the forward: logits whose rows have a `row_layout` are read in place; strided
    targets are copied (the kernel reads them flat)."""
    return k == 0 and row_layout(a) is not None


_BITS = {DType.BF16.np: np.dtype(np.uint16), DType.F16.np: np.dtype(np.int16)}



@njit(cache=True)
def _first_bad(t: Any, v: int, ignore: int) -> int:
    """The flat position of the first target outside [0, v) that is not `ignore`, or −1."""
    for r in range(t.shape[0]):
        tr = t[r]
        if tr != ignore and (tr < 0 or tr >= v):
            return r
    return -1


def check_targets(targets: np.ndarray, v: int, ignore: int) -> None:
    """Raise IndexOutOfRange for the first target that is neither in [0, v) nor `ignore`."""
    flat = targets.reshape(-1)
    if flat.size == 0:
        return
    bad = int(_first_bad(flat, v, ignore))
    if bad >= 0:
        where = tuple(int(i) for i in np.unravel_index(bad, targets.shape))
        raise IndexOutOfRange(f"{NAME}: target {int(flat[bad])} at position {list(where)} is out of range "
                              f"[0, {v}) (V = {v}; ignore_index is {ignore})")


@njit(cache=True)
def _reduce(losses: Any, t: Any, ignore: int, mean: bool) -> float:
    """The sum of the per-row losses in row order (serial: the same at any thread count), divided by
    the number of non-ignored rows for the mean (0 when there is none)."""
    total = 0.0
    count = 0
    for r in range(losses.shape[0]):
        total += losses[r]
        count += t[r] != ignore
    if mean:
        return total / count if count else 0.0
    return total


def cross_entropy(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
    """The forward kernel for every logits dtype: out (f32) is the mean, the sum, or one loss per row."""
    logits, targets = inputs
    v, flat_t, ignore = logits.shape[-1], targets.reshape(-1), params.ignore_index
    check_targets(targets, v, ignore)
    losses = np.zeros(flat_t.size, np.float64)
    if flat_t.size and v:  # with V = 0 every target is ignored (else check_targets raised): all zero
        _run(False, logits, flat_t, ignore, losses, losses)
    if params.reduction == "none":
        out[...] = losses.reshape(out.shape)
    else:
        out[...] = np.float32(_reduce(losses, flat_t, ignore, params.reduction == "mean"))


def row_scales(targets: np.ndarray, g: np.ndarray, params: Any) -> np.ndarray:
    """The cotangent each row's gradient is scaled by (f64, flat): g/n_valid, g, or g[row]."""
    rows = targets.size
    if params.reduction == "none":
        return np.ascontiguousarray(g, np.float64).reshape(rows)
    scale = float(g.reshape(()))
    if params.reduction == "mean":
        n_valid = int(np.count_nonzero(targets != params.ignore_index))
        scale = scale / n_valid if n_valid else 0.0
    return np.full(rows, scale, np.float64)


def cross_entropy_grad(inputs: list[np.ndarray], params: Any, out: np.ndarray | None = None) -> np.ndarray:
    """d loss / d logits for inputs (logits, targets, g), written into `out` when it is given (C-contiguous, of
    the logits' shape and dtype: a capture's arena buffer, so no second logits-sized array is resident), else
    into a fresh array."""
    logits, targets, g = inputs
    v = logits.shape[-1]
    check_targets(targets, v, params.ignore_index)
    if out is None or not (out.flags.c_contiguous and out.shape == logits.shape and out.dtype == logits.dtype):
        out = POOL.empty(logits.shape, logits.dtype)  # pooled as the executor's outputs: no page faults
    if out.size == 0:
        return out
    scales = row_scales(targets, g, params)
    flat_t = targets.reshape(-1)
    half = logits.dtype == DType.F16.np  # no f16 store in Numba: f32 scratch, rounded once by NumPy
    dst = POOL.empty(logits.shape, np.dtype(np.float32)) if half else out
    _run(True, logits, flat_t, params.ignore_index, scales, dst)
    if half:
        np.copyto(out, dst, casting="unsafe")
    return out


def cross_entropy_cost(shapes: Sequence[Shape], dtypes: Sequence[DType], params: Any) -> CostEstimate:
    """Per row: a max pass, an exp-and-sum pass (~11 flops an element for the polynomial exp), the log."""
    logits, targets = shapes[0], shapes[1]
    rows, v = math.prod(targets), logits[-1]
    moved = sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes, strict=True))
    return CostEstimate(flops=rows * (13 * v + 10), bytes_moved=moved)


# |out - ref| <= max_relative·|ref| + max_absolute·S, S per row = 1 + Σ_j softmax_j·|x_j − max| (summed
# over rows for "sum", averaged for "mean"): rounding x − max in f32 and the expf's relative error are
# absolute errors of the log-sum-exp of about u_f32·S. `python -m fuel.testing.measure
# FusedSoftmaxCrossEntropy` over seeds 0-59 found every output within the F32 output's unit roundoff
# (5.96e-8·|ref|, one rounding of the f64 result) and no absolute part needed; the relative bound is
# twice that (one ulp), the absolute part for the f32 path that u_f32·S estimate, never reached.
CE_PRECISION = {
    DType.F32: PrecisionGuarantee(True, None, 1.2e-7, 6e-8, "f32 x − max and expf, f64 sums and log"),
    DType.F64: PrecisionGuarantee(True, None, 1.2e-7, 1e-15, "f64 throughout, one rounding to f32"),
    DType.BF16: PrecisionGuarantee(True, None, 1.2e-7, 6e-8, "widened exactly, then as for f32"),
    DType.F16: PrecisionGuarantee(True, None, 1.2e-7, 6e-8, "widened exactly, then as for f32"),
}


def register(registry: FusedKernelRegistry) -> None:
    """Every logits dtype; logits whose rows have a `row_layout` are read in place."""
    rev = revision_of(cross_entropy)
    caps = KernelCaps(strided_input=True, reads=reads_logits)
    for dt in FLOAT_DTYPES:
        registry.register(BackendImpl(FusedOps.FUSED_SOFTMAX_CROSS_ENTROPY, "cpu", cross_entropy,
                                      (dt, DType.I64, DType.F32), cross_entropy_cost, CE_PRECISION[dt],
                                      caps, rev))
