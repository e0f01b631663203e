"""FlashAttn's backward (`flash_attn_backward.gradients`) as one job: the same products through sgemm or
dgemm called from the task, the same row passes, no Python between blocks.

An item is one (batch, kv head) group, whose dK and dV sum over its query blocks in a fixed order. For each
query block of BQ queries (the G heads stacked in rows, as the forward lays them out):
  1. the forward is recomputed (`flash_attn_tasks.forward_item`, the NumPy steps' blocks and arithmetic),
     then the delta task normalises acc into O and forms Δ = rowsum(dO ∘ O);
  2. for each key block: `S = Q·Kᵀ`, `dP = dO·Vᵀ` (gemm), the gradient task (S -> P, dP -> dS), then
     `dV += Pᵀ·dO`, `dK += dSᵀ·Q` (gemm with a transposed A) and `dQ += dS·K`, each product its own and
     added as NumPy's `+=` adds it.
The row passes are the steps' own tasks (`flash_attn_backward`'s delta and gradient tasks), called with one
part, so every byte is the steps'. BLAS runs one-threaded inside the task (the BLAS policy of
`fuel.runtime.threads`); which thread runs a group never changes its bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from numba import carray, njit

from fuel.cpu.attention.flash_attn_grad_rows import DELTA_ARGS, GRAD_ARGS
from fuel.cpu.attention.flash_attn_rows import FASTMATH, window_keys
from fuel.cpu.attention.flash_attn_steps import ONLINE_TASKS
from fuel.cpu.attention.flash_attn_tasks import (
    ATTEND_ARGS,
    FLOPS_PER_SECOND,
    RECORD_BYTES,
    degenerate,
    forward_item,
    slot_of,
)
from fuel.cpu.simd.sgemm import gemm
from fuel.runtime import jobs, pool, threads
from fuel.runtime.atomics import call_task, claim_slot, pointer, release_slot
from fuel.runtime.buffers import POOL
from fuel.runtime.jobs import ADDRESS, INT, record_at

if TYPE_CHECKING:
    from fuel.cpu.attention.flash_attn_steps import Problem

# The forward's fields (q [n, G, sq, d], k and v rows of d values, the mask, the row-pass task) and the
# gradients': do and dq [n, G, sq, d], dk [n, dkgroup / d, d], dv alike, all in the accumulation type.
GRADS_ARGS = jobs.record(**{name: field[0].type for name, field in (ATTEND_ARGS.fields or {}).items()},
                         do=ADDRESS, dq=ADDRESS, dk=ADDRESS, dv=ADDRESS, dkgroup=INT, dvgroup=INT, delta_task=ADDRESS,
                         grad_task=ADDRESS)


def grads_job(p: Problem, do: np.ndarray, dq: np.ndarray, dk: np.ndarray, dv: np.ndarray, bq: int, bk: int,
              delta_task: pool.Task, grad_task: pool.Task) -> jobs.Job | None:
    """The job of dq `[n, G, Sq, D]`, dk and dv `[n, Sk, D]` (accumulation type, zeroed, C-contiguous) for
    p (q, k, v in the accumulation type, K and V rows contiguous) and do `[n, G, Sq, D]`, query blocks of
    bq, key blocks of bk, with the steps' delta and gradient tasks; None where there is no gemm to call
    from jitted code or the call is `degenerate`."""
    acc = p.slopes.dtype
    address = threads.blas_sgemm_address() if acc == np.float32 else threads.blas_address("dgemm")
    n, g, sq, d = p.q.shape
    arrays = (p.q, p.k, p.v, do, dq, dk, dv)
    rows_contiguous = all(x.strides[-2:] == (d * x.itemsize, x.itemsize) for x in arrays)
    if (not address or not rows_contiguous or any(x.dtype != acc for x in arrays) or not do.flags.c_contiguous
            or not dq.flags.c_contiguous or not p.q.flags.c_contiguous or degenerate(p, bq, bk)):
        return None
    lo, hi = p.win.keys(0, sq)
    cols = min(bk, max(1, hi - lo))
    rows = g * min(bq, sq)
    slots = threads.get_num_threads()
    slot_size = slot_of(rows, d, cols) + _extra_of(rows, d, cols)
    scratch = POOL.empty((slots * slot_size,), acc)
    claims = np.zeros(slots, np.int64)
    records = np.zeros(slots * RECORD_BYTES // 8, np.int64)
    argv = jobs.argv_of(GRADS_ARGS)
    a = argv[0]
    for name, x in zip(("q", "k", "v", "do", "dq", "dk", "dv", "slopes"), (*arrays, p.slopes), strict=True):
        a[name] = x.ctypes.data
    a["groups"], a["heads"], a["sq"], a["d"] = n, g, sq, d
    a["kgroup"], a["vgroup"] = p.k.strides[0] // p.k.itemsize, p.v.strides[0] // p.v.itemsize
    a["dkgroup"], a["dvgroup"] = dk.strides[0] // dk.itemsize, dv.strides[0] // dv.itemsize
    a["kl"], a["left"], a["right"], a["scale"], a["softcap"] = p.win.kl, p.win.left, p.win.right, p.scale, p.softcap
    a["bq"], a["bk"], a["cols"], a["qblocks"], a["gemm"] = bq, bk, cols, -(-sq // bq), address
    a["online"], a["delta_task"], a["grad_task"] = ONLINE_TASKS[acc].address, delta_task.address, grad_task.address
    a["scratch"], a["slot_size"], a["records"] = scratch.ctypes.data, slot_size, records.ctypes.data
    a["slots"], a["claims"] = slots, claims.ctypes.data
    work = 14.0 * n * g * sq * max(1, hi - lo) * d
    task = _grads_f32 if acc == np.float32 else _grads_f64
    return jobs.job(task, argv, work / FLOPS_PER_SECOND, n, keep=(scratch, claims, records))


def _extra_of(rows: int, d: int, cols: int) -> int:
    """Values past the forward's slot (`slot_of`): dob, dqb and a product [rows, d]; delta [rows]; dP
    [rows, cols]; a product [cols, d]."""
    return 3 * rows * d + rows + rows * cols + cols * d


@njit(inline="always", cache=True)
def _add_into(dst: Any, at: int, src: Any, count: int) -> None:
    """dst[at:at + count] += src[:count], value by value (NumPy's `+=` of a product)."""
    for x in range(count):
        dst[at + x] += src[x]


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _group(a: Any, base: int, rec: int, grp: int, dt: Any, w: int) -> None:
    """dq, dk and dv of group grp, its query blocks in order, in the scratch slot at `base`."""
    n, g, sq, d, bk = a.groups, a.heads, a.sq, a.d, a.bk
    most = g * min(a.bq, sq)
    extra = base + w * slot_of(most, d, a.cols)
    at_dob, at_dqb, at_t = extra, extra + w * most * d, extra + 2 * w * most * d
    at_delta = at_t + w * most * d
    at_dp = at_delta + w * most
    at_tk = at_dp + w * most * a.cols
    do = carray(pointer(a.do, dt), (n, g, sq, d))
    dq = carray(pointer(a.dq, dt), (n, g, sq, d))
    dk = carray(pointer(a.dk, dt), (n * a.dkgroup,))
    dv = carray(pointer(a.dv, dt), (n * a.dvgroup,))
    for i0 in range(0, sq, a.bq):
        i1 = min(sq, i0 + a.bq)
        br = i1 - i0
        rows = g * br
        forward_item(a, base, rec, grp, i0, i1, dt, dt, w, False, True)
        at_acc, at_m = base + w * rows * d, base + w * 3 * rows * d
        at_s = at_m + 2 * w * rows
        dob = carray(pointer(at_dob, dt), (rows, d))
        for h in range(g):
            dob[h * br:(h + 1) * br] = do[grp, h, i0:i1]
        r = record_at(rec, DELTA_ARGS)
        r.acc, r.l, r.do, r.delta, r.n, r.rows, r.d = at_acc, at_m + w * rows, at_dob, at_delta, 1, rows, d
        call_task(a.delta_task, 0, 1, rec)
        dqb = carray(pointer(at_dqb, dt), (rows * d,))
        dqb[:] = 0
        lo, hi = window_keys(i0, i1, a.kl, sq, a.left, a.right)
        for j0 in range(lo, hi, bk):
            cols = min(hi, j0 + bk) - j0
            kb, vb = a.k + w * (grp * a.kgroup + j0 * d), a.v + w * (grp * a.vgroup + j0 * d)
            gemm(w, a.gemm, 1, 0, rows, cols, d, base, d, kb, d, at_s, cols)
            gemm(w, a.gemm, 1, 0, rows, cols, d, at_dob, d, vb, d, at_dp, cols)
            gr = record_at(rec, GRAD_ARGS)
            gr.s, gr.dp, gr.m, gr.l, gr.delta = at_s, at_dp, at_m, at_m + w * rows, at_delta
            gr.slopes, gr.n, gr.rows, gr.cols, gr.heads = a.slopes + w * grp * g, 1, rows, cols, g
            gr.i0, gr.bq, gr.j0, gr.kl, gr.sq, gr.left, gr.right = i0, br, j0, a.kl, sq, a.left, a.right
            gr.scale, gr.softcap = a.scale, a.softcap
            call_task(a.grad_task, 0, 1, rec)
            tk = carray(pointer(at_tk, dt), (cols * d,))
            gemm(w, a.gemm, 2, 0, cols, d, rows, at_s, cols, at_dob, d, at_tk, d)  # Pᵀ·dO
            _add_into(dv, grp * a.dvgroup + j0 * d, tk, cols * d)
            gemm(w, a.gemm, 2, 0, cols, d, rows, at_dp, cols, base, d, at_tk, d)  # dSᵀ·Q
            _add_into(dk, grp * a.dkgroup + j0 * d, tk, cols * d)
            gemm(w, a.gemm, 0, 0, rows, d, cols, at_dp, cols, kb, d, at_t, d)  # dS·K
            _add_into(dqb, 0, carray(pointer(at_t, dt), (rows * d,)), rows * d)
        dqr = carray(pointer(at_dqb, dt), (rows, d))
        for h in range(g):
            dq[grp, h, i0:i1] = dqr[h * br:(h + 1) * br]


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _groups(part: int, parts: int, argv: int, dt: Any, w: int) -> None:
    """Part `part` of the call: its share of the groups, in one scratch slot."""
    a = record_at(argv, GRADS_ARGS)
    slot = claim_slot(a.claims, a.slots)
    base = a.scratch + w * slot * a.slot_size
    rec = a.records + RECORD_BYTES * slot
    for grp in range(part * a.groups // parts, (part + 1) * a.groups // parts):
        _group(a, base, rec, grp, dt, w)
    release_slot(a.claims, a.slots, slot)


@pool.task(fastmath=FASTMATH)
def _grads_f32(part: int, parts: int, argv: int) -> None:
    _groups(part, parts, argv, np.float32, 4)


@pool.task(fastmath=FASTMATH)
def _grads_f64(part: int, parts: int, argv: int) -> None:
    _groups(part, parts, argv, np.float64, 8)
