"""FlashAttnBackward Q, K and V (entries 22-24) on the CPU: one recomputation of the softmax gives all three.

For each query block (laid out as in the forward: the G query heads of a kv head stacked in rows):
  1. the forward is recomputed block by block (`forward_block`), giving O and each row's softmax max
     and sum, and so Δ = rowsum(dO ∘ O);
  2. for each key block: `S = Q·Kᵀ` and `dP = dO·Vᵀ` on BLAS; a job over the rows turns S into
     P = exp(s − max)/sum and dP into dS = P ∘ (dP − Δ) ∘ (1 − tanh²) [softcap] · scale; then
     `dV += Pᵀ·dO`, `dK += dSᵀ·Q`, `dQ += dS·K` on BLAS (the stacked heads sum into their kv head).
The mask, k_len, softcap and ALiBi are the forward's exactly. dK and dV accumulate over query blocks
in a fixed order, so the result is the same bytes at any thread count. Keys past k_len get zero
gradient.

The executor runs `flash_attn_backward_all` once when the three entries share their inputs (see
`fuel.dispatch.impls.JointKernel`); each entry's own kernel computes all three and keeps its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.attention.flash_attn import BQ
from fuel.cpu.attention.flash_attn_rows import FASTMATH, plain_row, row_window, transform_row, zero_outside
from fuel.cpu.attention.flash_attn_steps import BK, Problem, forward_block, grouped, problem, query_block, set_block
from fuel.cpu.simd.half import narrow_into, widened
from fuel.cpu.simd.vecmath import cast_like, exp_nonpositive
from fuel.dispatch.impls import (
    CONTIGUOUS_ONLY,
    BackendImpl,
    CostEstimate,
    FusedKernelRegistry,
    JointKernel,
    PrecisionGuarantee,
    revision_of,
)
from fuel.dtype import FLOAT_DTYPES, DType
from fuel.graph.node import Shape
from fuel.graph.registry import FusedOps
from fuel.runtime import jobs, pool, threads
from fuel.runtime.atomics import pointer
from fuel.runtime.buffers import POOL
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


_DELTA_TASKS = {np.dtype(np.float32): _delta_f32, np.dtype(np.float64): _delta_f64}
_GRAD_TASKS = {np.dtype(np.float32): _grad_f32, np.dtype(np.float64): _grad_f64}


def _delta_job(acc: np.ndarray, l: np.ndarray, do: np.ndarray, delta: np.ndarray) -> jobs.Job:
    argv = jobs.argv_of(DELTA_ARGS)
    _fill_delta(acc, l, do, delta, argv)
    return jobs.job(_DELTA_TASKS[acc.dtype], argv, acc.size * SECONDS_PER_SCORE, acc.shape[0] * acc.shape[1])


def _grad_job(s: np.ndarray, dp: np.ndarray, m: np.ndarray, l: np.ndarray, delta: np.ndarray, p: Problem, i0: int,
              bq: int, j0: int) -> jobs.Job:
    argv = jobs.argv_of(GRAD_ARGS)
    _fill_grad(s, dp, m, l, delta, p.slopes, argv)
    set_block(argv, p, i0, bq, j0)
    return jobs.job(_GRAD_TASKS[s.dtype], argv, s.size * SECONDS_PER_SCORE, s.shape[0] * s.shape[1])


GRADIENT_IDS = (FusedOps.FLASH_ATTN_BACKWARD_Q, FusedOps.FLASH_ATTN_BACKWARD_K, FusedOps.FLASH_ATTN_BACKWARD_V)


def gradients(p: Problem, do: np.ndarray, dq: np.ndarray, dk: np.ndarray, dv: np.ndarray) -> None:
    """dq `[n, G, Sq, D]`, dk and dv `[n, Sk, D]` (accumulation type, zeroed by the caller); the row passes
    are jobs, the products NumPy's BLAS (one call per group: each group's arithmetic is its own)."""
    p = p.part(0, p.q.shape[0])
    sq, g = p.q.shape[2], p.q.shape[1]
    w = p.win
    for i0 in range(0, sq, BQ):
        i1 = min(sq, i0 + BQ)
        qb, dob = query_block(p.q, i0, i1), query_block(do, i0, i1)
        acc, m, l = forward_block(p, i0, i1, qb)
        delta = np.empty_like(l)
        jobs.run(_delta_job(acc, l, dob, delta))
        dqb = np.zeros_like(qb)
        lo, hi = w.keys(i0, i1)
        for j0 in range(lo, hi, BK):
            j1 = min(hi, j0 + BK)
            kb, vb = p.k[:, j0:j1], p.v[:, j0:j1]
            scores = (qb.shape[0], qb.shape[1], j1 - j0)  # reused buffers: a fresh 4 MB array costs page faults
            s = np.matmul(qb, kb.transpose(0, 2, 1), out=POOL.empty(scores, qb.dtype))
            dp = np.matmul(dob, vb.transpose(0, 2, 1), out=POOL.empty(scores, qb.dtype))
            jobs.run(_grad_job(s, dp, m, l, delta, p, i0, i1 - i0, j0))
            dv[:, j0:j1] += np.matmul(s.transpose(0, 2, 1), dob)
            dk[:, j0:j1] += np.matmul(dp.transpose(0, 2, 1), qb)
            dqb += np.matmul(dp, kb)
        dq[:, :, i0:i1] = dqb.reshape(dqb.shape[0], g, i1 - i0, -1)


def flash_attn_backward_all(inputs: Sequence[np.ndarray], outs: dict[int, np.ndarray], params: Any) -> None:
    """Every gradient `outs` asks for (keyed by entry id), from one recomputation of the softmax."""
    any_out = next(iter(outs.values()))
    acc_t = np.dtype(np.float64) if any_out.dtype == np.float64 else np.dtype(np.float32)
    p = problem(inputs, params, acc_t)
    do = inputs[3] if inputs[3].dtype == acc_t else widened(inputs[3])
    # A gradient asked for in the accumulation type accumulates straight into its output; the others
    # (a sibling not asked for, or a half-type output) get a scratch buffer.
    grads: dict[int, np.ndarray] = {}
    for gid, like in zip(GRADIENT_IDS, inputs[:3], strict=True):
        given = outs.get(gid)
        if given is not None and given.dtype == acc_t and given.flags.c_contiguous:
            given.fill(0)
            grads[gid] = given
        else:
            grads[gid] = np.zeros(like.shape, acc_t)
    if any(a.size for a in grads.values()) and p.q.size:
        hkv = p.hkv
        b, _, sk, d = inputs[1].shape
        with threads.one_blas_thread():  # as the forward's steps (`flash_attn.attention`)
            gradients(p, grouped(do, hkv), grouped(grads[FusedOps.FLASH_ATTN_BACKWARD_Q], hkv),
                      grads[FusedOps.FLASH_ATTN_BACKWARD_K].reshape(b * hkv, sk, d),
                      grads[FusedOps.FLASH_ATTN_BACKWARD_V].reshape(b * hkv, sk, d))
    for op_id, out in outs.items():
        if grads[op_id] is out:
            continue
        if out.dtype == acc_t:
            np.copyto(out, grads[op_id])
        else:
            narrow_into(grads[op_id], out)


def kernel_for(op_id: int) -> Any:
    def kernel(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
        flash_attn_backward_all(inputs, {op_id: out}, params)

    kernel.__name__ = kernel.__qualname__ = f"flash_attn_backward_{'qkv'[op_id - FusedOps.FLASH_ATTN_BACKWARD_Q]}"
    return kernel


def backward_cost(shapes: Sequence[Shape], dtypes: Sequence[DType], params: Any) -> CostEstimate:
    """Seven products over the live keys (two for the recomputed forward, five for the gradients)."""
    b, hq, sq, d = shapes[0]
    kl = shapes[1][2] if params.k_len is None or not isinstance(params.k_len, int) else params.k_len
    pairs = b * hq * sq * kl // (2 if params.causal and sq > 1 else 1)
    moved = sum(math.prod(s) * t.itemsize for s, t in zip(shapes, dtypes, strict=True))
    return CostEstimate(flops=14 * pairs * d, bytes_moved=moved)


# Against float64 per element, S = the size of the terms each gradient sums (the reference's magnitude
# form): about twice the worst error `python -m fuel.testing.measure FlashAttnBackwardQ …` found.
BACKWARD_PRECISION = {
    DType.F32: PrecisionGuarantee(True, None, 2e-6, 1e-6, "f32 BLAS products, recomputed f32 softmax"),
    DType.F64: PrecisionGuarantee(True, None, 5e-15, 3e-15, "f64 throughout"),
    DType.BF16: PrecisionGuarantee(True, None, 7.9e-3, 5e-7, "f32 compute, one RNE rounding on store"),
    DType.F16: PrecisionGuarantee(True, None, 9.8e-4, 5e-7, "f32 compute, one RNE rounding on store"),
}


def register(registry: FusedKernelRegistry) -> None:
    rev = revision_of(gradients)
    registry.register_joint(JointKernel(frozenset(GRADIENT_IDS), "cpu", flash_attn_backward_all))
    for op_id in GRADIENT_IDS:
        kernel = kernel_for(op_id)
        for dt in FLOAT_DTYPES:
            slopes = DType.F64 if dt is DType.F64 else DType.F32
            for tail in ((), (slopes,)):
                registry.register(BackendImpl(op_id, "cpu", kernel, (dt, dt, dt, dt, *tail, dt), backward_cost,
                                              BACKWARD_PRECISION[dt], CONTIGUOUS_ONLY, rev))
