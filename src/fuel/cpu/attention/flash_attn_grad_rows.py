"""FlashAttn backward's row passes as tasks: the delta pass (O = acc / l, Δ = rowsum(dO ∘ O)) and the gradient
pass (S -> P, dP -> dS) of one key block, for the NumPy steps of `flash_attn_backward.gradients` and, called
with one part, for the task of `flash_attn_grad_tasks`: one compiled row pass for both."""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.attention.flash_attn_rows import FASTMATH, plain_row, row_window, transform_row, zero_outside
from fuel.cpu.attention.flash_attn_steps import Problem, set_block
from fuel.cpu.simd.vecmath import cast_like, exp_nonpositive
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import ADDRESS, INT, REAL, record_at

SECONDS_PER_SCORE = 2e-9  # one core's time a score in the gradient row pass (exp, dS), for the part count

# acc [n, rows, d] normalised by l [n, rows]; delta [n, rows] <- rowsum(do ∘ acc).
DELTA_ARGS = jobs.record(acc=ADDRESS, l=ADDRESS, do=ADDRESS, delta=ADDRESS, n=INT, rows=INT, d=INT)
# One key block: s, dp [n, rows, cols]; m, l, delta [n, rows]; slopes [n, heads].
GRAD_ARGS = jobs.record(s=ADDRESS, dp=ADDRESS, m=ADDRESS, l=ADDRESS, delta=ADDRESS, slopes=ADDRESS, n=INT, rows=INT,
                        cols=INT, heads=INT, i0=INT, bq=INT, j0=INT, kl=INT, sq=INT, left=INT, right=INT, scale=REAL,
                        softcap=REAL)


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _delta_rows(part: int, parts: int, argv: int, dt: Any) -> None:
    """acc /= l per row (0 where no key was admissible), then delta = rowsum(do ∘ acc), for this part's rows."""
    a = record_at(argv, DELTA_ARGS)
    n, rows, d = a.n, a.rows, a.d
    acc = carray(pointer(a.acc, dt), (n, rows, d))
    l = carray(pointer(a.l, dt), (n, rows))
    do = carray(pointer(a.do, dt), (n, rows, d))
    delta = carray(pointer(a.delta, dt), (n, rows))
    for t in range(part * n * rows // parts, (part + 1) * n * rows // parts):
        g, r = t // rows, t % rows
        x = acc[g, r]
        total = l[g, r]
        dot = total * 0
        for k in range(d):
            x[k] = x[k] / total if total > 0 else total * 0
            dot += x[k] * do[g, r, k]
        delta[g, r] = dot


@pool.task(fastmath=FASTMATH)
def _delta_f32(part: int, parts: int, argv: int) -> None:
    _delta_rows(part, parts, argv, np.float32)


@pool.task(fastmath=FASTMATH)
def _delta_f64(part: int, parts: int, argv: int) -> None:
    _delta_rows(part, parts, argv, np.float64)


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _grad_row(s: Any, dp: Any, m: Any, l: Any, delta: Any, t: int, i0: int, bq: int, j0: int, kl: int, sq: int,
              left: int, right: int, scale: Any, softcap: Any, slopes: Any) -> None:
    """Row t of s (raw q·k) <- P and of dp (dO·vᵀ) <- dS for one key block, from the row's final max and sum."""
    rows, cols = s.shape[1], s.shape[2]
    g, r = t // rows, t % rows
    i = i0 + r % bq
    row, drow = s[g, r], dp[g, r]
    lo, hi = row_window(i, j0, cols, kl, sq, left, right)
    zero_outside(row, lo, hi)
    zero_outside(drow, lo, hi)
    total = l[g, r]
    if lo == hi:
        return
    if not total > 0:
        row[lo:hi] = 0
        drow[lo:hi] = 0
        return
    seg, dseg = row[lo:hi], drow[lo:hi]
    aq = i + kl - sq
    slope = slopes[g, r // bq]
    # P exactly as the forward formed it (`online_row`): a plain row's max is in raw q·k units and
    # its scale is folded into exp; every other row's scores are transformed first.
    sc = scale
    if not plain_row(scale, softcap, slope):
        transform_row(seg, aq, j0 + lo, scale, softcap, slope)
        sc = cast_like(1, scale)
    shift, inv, dl = m[g, r], 1 / total, delta[g, r]
    for c in range(hi - lo):
        pr = exp_nonpositive((seg[c] - shift) * sc) * inv
        ds = pr * (dseg[c] - dl) * scale
        if softcap > 0:
            capped = (seg[c] + slope * cast_like(abs(aq - (j0 + lo + c)), scale)) / softcap
            ds *= 1 - capped * capped
        seg[c] = pr
        dseg[c] = ds


@njit(cache=True, fastmath=FASTMATH)
def _grad_block(s: Any, dp: Any, m: Any, l: Any, delta: Any, first: int, last: int, i0: int, bq: int, j0: int,
                kl: int, sq: int, left: int, right: int, scale: Any, softcap: Any, slopes: Any) -> None:
    """Rows [first, last) of one key block (`_grad_row`), compiled on its own as a function of its arrays,
    which fixes how LLVM contracts f64's dS: inlined into the task it chose another order (other bytes)."""
    for t in range(first, last):
        _grad_row(s, dp, m, l, delta, t, i0, bq, j0, kl, sq, left, right, scale, softcap, slopes)


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _grad_rows(part: int, parts: int, argv: int, dt: Any) -> None:
    a = record_at(argv, GRAD_ARGS)
    n, rows, cols = a.n, a.rows, a.cols
    s = carray(pointer(a.s, dt), (n, rows, cols))
    dp = carray(pointer(a.dp, dt), (n, rows, cols))
    m = carray(pointer(a.m, dt), (n, rows))
    l = carray(pointer(a.l, dt), (n, rows))
    delta = carray(pointer(a.delta, dt), (n, rows))
    slopes = carray(pointer(a.slopes, dt), (n, a.heads))
    scale, softcap = dt(a.scale), dt(a.softcap)
    _grad_block(s, dp, m, l, delta, part * n * rows // parts, (part + 1) * n * rows // parts, a.i0, a.bq, a.j0,
                a.kl, a.sq, a.left, a.right, scale, softcap, slopes)


@pool.task(fastmath=FASTMATH)
def _grad_f32(part: int, parts: int, argv: int) -> None:
    _grad_rows(part, parts, argv, np.float32)


@pool.task(fastmath=FASTMATH)
def _grad_f64(part: int, parts: int, argv: int) -> None:
    _grad_rows(part, parts, argv, np.float64)


@njit(cache=True)
def _fill_delta(acc: Any, l: Any, do: Any, delta: Any, argv: Any) -> None:
    a = argv[0]
    a.acc, a.l, a.do, a.delta = acc.ctypes.data, l.ctypes.data, do.ctypes.data, delta.ctypes.data
    a.n, a.rows, a.d = acc.shape[0], acc.shape[1], acc.shape[2]


@njit(cache=True)
def _fill_grad(s: Any, dp: Any, m: Any, l: Any, delta: Any, slopes: Any, argv: Any) -> None:
    a = argv[0]
    a.s, a.dp, a.m, a.l, a.delta, a.slopes = (s.ctypes.data, dp.ctypes.data, m.ctypes.data, l.ctypes.data,
                                              delta.ctypes.data, slopes.ctypes.data)
    a.n, a.rows, a.cols, a.heads = s.shape[0], s.shape[1], s.shape[2], slopes.shape[1]


DELTA_TASKS = {np.dtype(np.float32): _delta_f32, np.dtype(np.float64): _delta_f64}
GRAD_TASKS = {np.dtype(np.float32): _grad_f32, np.dtype(np.float64): _grad_f64}


def delta_job(acc: np.ndarray, l: np.ndarray, do: np.ndarray, delta: np.ndarray) -> jobs.Job:
    argv = jobs.argv_of(DELTA_ARGS)
    _fill_delta(acc, l, do, delta, argv)
    return jobs.job(DELTA_TASKS[acc.dtype], argv, acc.size * SECONDS_PER_SCORE, acc.shape[0] * acc.shape[1])


def grad_job(s: np.ndarray, dp: np.ndarray, m: np.ndarray, l: np.ndarray, delta: np.ndarray, p: Problem, i0: int,
              bq: int, j0: int) -> jobs.Job:
    argv = jobs.argv_of(GRAD_ARGS)
    _fill_grad(s, dp, m, l, delta, p.slopes, argv)
    set_block(argv, p, i0, bq, j0)
    return jobs.job(GRAD_TASKS[s.dtype], argv, s.size * SECONDS_PER_SCORE, s.shape[0] * s.shape[1])
