"""FlashAttn's blocked forward as steps: NumPy's BLAS for the products, the row passes as jobs.

The problem's layout (`Problem`): the G = Hq/Hkv query heads that share a kv head are stacked into the
rows of one matrix, so a block of queries is a `[G·rows, D]` operand and K/V are never repeated. For
each query block, the keys it may see (the union of its rows' windows) are visited in blocks of BK:
  1. `S = Q·Kᵀ` on BLAS (NumPy's stacked matmul: one BLAS call per group);
  2. the row pass (`online_row` per row, a job over the rows): scale, softcap, ALiBi, mask, the running
     max and sum, the rescaling of the accumulator, and `P = exp(S − max)` in place;
  3. `acc += P·V` on BLAS.
Memory is O(rows·BK) per step whatever the sequence length. Each row's arithmetic is fixed by the block
sizes, and OpenBLAS splits a product over M and N, never over K, so the bytes are the same at any thread
count. This is the path of a call the tasks (`flash_attn_tasks`) do not serve: no gemm to call from a task,
or a block product NumPy computes without gemm. The tasks call this module's row-pass and store tasks, so
both paths give the same bytes; the backward's steps recompute the forward with `forward_block`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.attention.flash_attn_rows import FASTMATH, Window, online_row, store_row, window_of
from fuel.cpu.simd.half import widened
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.buffers import POOL
from fuel.runtime.jobs import ADDRESS, INT, REAL, record_at

BK = 512  # keys per block
SECONDS_PER_SCORE = 1e-9  # one core's time a score in a row pass (max, exp, sum), for the part count

# One key block's row pass over s [n, rows, cols]: m, l [n, rows], acc [n, rows, d], slopes [n, heads].
ONLINE_ARGS = jobs.record(s=ADDRESS, m=ADDRESS, l=ADDRESS, acc=ADDRESS, slopes=ADDRESS, n=INT, rows=INT, cols=INT,
                          d=INT, heads=INT, i0=INT, bq=INT, j0=INT, kl=INT, sq=INT, left=INT, right=INT,
                          scale=REAL, softcap=REAL)
# acc [n, rows, d] / l [n, rows] into out [n, heads, sq, d] from query i0.
STORE_ARGS = jobs.record(acc=ADDRESS, l=ADDRESS, out=ADDRESS, n=INT, rows=INT, d=INT, heads=INT, sq=INT, i0=INT)


def grouped(x: np.ndarray, hkv: int) -> np.ndarray:
    """[B, Hq, S, D] as [B·Hkv, G, S, D] (a view): the query heads that share each kv head."""
    b, hq, s, d = x.shape
    return x.reshape(b * hkv, hq // hkv, s, d)


def query_block(x: np.ndarray, i0: int, i1: int) -> np.ndarray:
    """Rows [i0, i1) of every head of a grouped [n, G, S, D] array as one contiguous [n, G·rows, D]."""
    n, g, _, d = x.shape
    return np.ascontiguousarray(x[:, :, i0:i1]).reshape(n, g * (i1 - i0), d)


@dataclass
class Problem:
    """One call in the accumulation type: q, k, v grouped per kv head, the mask and the options."""

    q: np.ndarray  # [n, G, Sq, D]
    k: np.ndarray  # [n, Sk, D]
    v: np.ndarray
    win: Window
    scale: Any
    softcap: Any
    slopes: np.ndarray  # [n, G]: the ALiBi slope of each query head, per group (0 without ALiBi)
    hkv: int

    def part(self, g0: int, g1: int) -> Problem:
        """The groups [g0, g1) in the accumulation type: an independent problem (each group's arithmetic
        is its own). Half-type q, k and v are widened here, a chunk of groups at a time."""
        acc = self.slopes.dtype
        if g0 == 0 and g1 == self.q.shape[0] and self.q.dtype == self.k.dtype == self.v.dtype == acc:
            return self  # all of it, nothing to widen
        q, k, v = (a[g0:g1] if a.dtype == acc else widened(a[g0:g1]) for a in (self.q, self.k, self.v))
        return replace(self, q=q, k=k, v=v, slopes=self.slopes[g0:g1])


def problem(inputs: Sequence[np.ndarray], params: Any, acc: np.dtype[Any]) -> Problem:
    """The call, grouped per kv head; `part` gives its groups in the accumulation type. K and V hold their
    live rows only and stay C-contiguous in the accumulation type (Numba vectorises only arrays it knows
    to be contiguous)."""
    win = window_of(params, inputs[0].shape[2], inputs[1].shape[2])
    q = inputs[0]
    k, v = (a if a.dtype == acc else a[:, :, :win.kl] for a in inputs[1:3])
    b, hkv, sk, d = k.shape
    # Without ALiBi every slope is 0, which the row pass skips.
    hq = q.shape[1]
    if inputs[-1].ndim == 1:
        per_head = np.asarray(inputs[-1], acc).reshape(1, hkv, hq // hkv)
        slopes = np.ascontiguousarray(np.broadcast_to(per_head, (b, hkv, hq // hkv))).reshape(b * hkv, hq // hkv)
    else:
        slopes = np.zeros((b * hkv, hq // hkv), acc)
    return Problem(grouped(q, hkv), k.reshape(b * hkv, sk, d), v.reshape(b * hkv, sk, d), win,
                   acc.type(params.softmax_scale), acc.type(params.softcap or 0), slopes, hkv)


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _online_rows(part: int, parts: int, argv: int, dt: Any) -> None:
    """Rows [part·n·rows/parts, (part+1)·n·rows/parts) of one key block of the online softmax, in dt."""
    a = record_at(argv, ONLINE_ARGS)
    n, rows = a.n, a.rows
    s = carray(pointer(a.s, dt), (n, rows, a.cols))
    m = carray(pointer(a.m, dt), (n, rows))
    l = carray(pointer(a.l, dt), (n, rows))
    acc = carray(pointer(a.acc, dt), (n, rows, a.d))
    slopes = carray(pointer(a.slopes, dt), (n, a.heads))
    scale, softcap = dt(a.scale), dt(a.softcap)
    for t in range(part * n * rows // parts, (part + 1) * n * rows // parts):
        online_row(s, m, l, acc, t, a.i0, a.bq, a.j0, a.kl, a.sq, a.left, a.right, scale, softcap, slopes)


@pool.task(fastmath=FASTMATH)
def _online_f32(part: int, parts: int, argv: int) -> None:
    _online_rows(part, parts, argv, np.float32)


@pool.task(fastmath=FASTMATH)
def _online_f64(part: int, parts: int, argv: int) -> None:
    _online_rows(part, parts, argv, np.float64)


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _store_rows(part: int, parts: int, argv: int, dt: Any, st: Any) -> None:
    """Rows of acc (dt) divided by their sums into out (st: f32, f64 or bf16 bits, rounded once)."""
    a = record_at(argv, STORE_ARGS)
    n, rows = a.n, a.rows
    acc = carray(pointer(a.acc, dt), (n, rows, a.d))
    l = carray(pointer(a.l, dt), (n, rows))
    out = carray(pointer(a.out, st), (n, a.heads, a.sq, a.d))
    for t in range(part * n * rows // parts, (part + 1) * n * rows // parts):
        store_row(acc, l, out, a.i0, t)


@pool.task(fastmath=FASTMATH)
def _store_f32(part: int, parts: int, argv: int) -> None:
    _store_rows(part, parts, argv, np.float32, np.float32)


@pool.task(fastmath=FASTMATH)
def _store_f64(part: int, parts: int, argv: int) -> None:
    _store_rows(part, parts, argv, np.float64, np.float64)


@pool.task(fastmath=FASTMATH)
def _store_bf16(part: int, parts: int, argv: int) -> None:
    _store_rows(part, parts, argv, np.float32, np.uint16)


ONLINE_TASKS = {np.dtype(np.float32): _online_f32, np.dtype(np.float64): _online_f64}
STORE_TASKS = {(np.dtype(np.float32), np.dtype(np.float32)): _store_f32,
               (np.dtype(np.float64), np.dtype(np.float64)): _store_f64,
               (np.dtype(np.float32), np.dtype(np.uint16)): _store_bf16}


@njit(cache=True)
def _fill_online(s: Any, m: Any, l: Any, acc: Any, slopes: Any, argv: Any) -> None:
    a = argv[0]
    a.s, a.m, a.l, a.acc, a.slopes = s.ctypes.data, m.ctypes.data, l.ctypes.data, acc.ctypes.data, slopes.ctypes.data
    a.n, a.rows, a.cols, a.d, a.heads = s.shape[0], s.shape[1], s.shape[2], acc.shape[2], slopes.shape[1]


def set_block(argv: np.ndarray, p: Problem, i0: int, bq: int, j0: int) -> None:
    """The fields of a key block's row pass every such record shares: its rows (from query i0, bq a head),
    its first key j0, the mask and the scales."""
    a, w = argv[0], p.win
    a["i0"], a["bq"], a["j0"], a["kl"], a["sq"], a["left"], a["right"] = i0, bq, j0, w.kl, w.sq, w.left, w.right
    a["scale"], a["softcap"] = p.scale, p.softcap


def row_pass_job(s: np.ndarray, m: np.ndarray, l: np.ndarray, acc: np.ndarray, p: Problem, i0: int, bq: int,
                 j0: int) -> jobs.Job:
    """The job of one key block's row pass (`online_row` on every row of s), for rows i0.. of bq queries a head."""
    argv = jobs.argv_of(ONLINE_ARGS)
    _fill_online(s, m, l, acc, p.slopes, argv)
    set_block(argv, p, i0, bq, j0)
    return jobs.job(ONLINE_TASKS[s.dtype], argv, s.size * SECONDS_PER_SCORE, s.shape[0] * s.shape[1])


@njit(cache=True)
def _fill_store(acc: Any, l: Any, out: Any, i0: int, argv: Any) -> None:
    a = argv[0]
    a.acc, a.l, a.out = acc.ctypes.data, l.ctypes.data, out.ctypes.data
    a.n, a.rows, a.d, a.heads, a.sq, a.i0 = acc.shape[0], acc.shape[1], acc.shape[2], out.shape[1], out.shape[2], i0


def store_job(acc: np.ndarray, l: np.ndarray, out: np.ndarray, i0: int) -> jobs.Job:
    """The job of out[:, r // bq, i0 + r % bq] <- acc[:, r] / l[:, r] (`store_row`) for every row r: one pass,
    no normalised copy of acc, no f32 scratch for a bf16 output (out C-contiguous in its storage type)."""
    argv = jobs.argv_of(STORE_ARGS)
    _fill_store(acc, l, out, i0, argv)
    return jobs.job(STORE_TASKS[acc.dtype, out.dtype], argv, acc.size * SECONDS_PER_SCORE, acc.shape[0] * acc.shape[1])


def forward_block(p: Problem, i0: int, i1: int, qb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(acc, m, l) of query rows [i0, i1): the unnormalised output and the softmax's max and sum (the max
    in raw q·k units for a plain row, `flash_attn_rows.online_row`)."""
    n, rows, d = qb.shape
    dt = qb.dtype
    acc = np.zeros((n, rows, d), dt)
    m = np.full((n, rows), -np.inf, dt)
    l = np.zeros((n, rows), dt)
    lo, hi = p.win.keys(i0, i1)
    for j0 in range(lo, hi, BK):
        j1 = min(hi, j0 + BK)
        s = np.matmul(qb, p.k[:, j0:j1].transpose(0, 2, 1), out=POOL.empty((n, rows, j1 - j0), dt))
        jobs.run(row_pass_job(s, m, l, acc, p, i0, i1 - i0, j0))
        if j0 == lo:  # the first block's product is the accumulator (it was all zeros)
            np.matmul(s, p.v[:, j0:j1], out=acc)
        else:
            acc += np.matmul(s, p.v[:, j0:j1])
    return acc, m, l


def steps(p: Problem, out: np.ndarray, bq: int, chunk: int) -> None:
    """out `[n, G, Sq, D]` (f32, f64 or bf16 bits) <- attention of every query block of bq queries, chunk
    groups a step (groups are independent: the chunk never changes the bytes)."""
    n, _, sq, _ = p.q.shape
    for g0 in range(0, n, chunk):
        g1 = min(n, g0 + chunk)
        part = p.part(g0, g1)
        for i0 in range(0, sq, bq):
            i1 = min(sq, i0 + bq)
            acc, _, l = forward_block(part, i0, i1, query_block(part.q, i0, i1))
            jobs.run(store_job(acc, l, out[g0:g1], i0))
