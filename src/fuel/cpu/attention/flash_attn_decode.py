"""FlashAttn's decode path: a few queries (Sq <= DECODE_MAX_QUERIES) over a long cache, as a task on the
spinning pool (`fuel.runtime.pool`).

A decode step's attention is too little work for a pool of its own and too much for one core beside an
idle one (see docs/performance/attention.md, "decode job"). One item is one (batch, kv head) group and
one query: it does all G query heads that share the kv head, so each live K and V row is read once per
query, with the scores in a [G, keys] scratch, their exact max, then exp and P·V. Items are independent
and each is computed whole by one thread in one fixed order, so the bytes never depend on the part count.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit, types
from numba.extending import overload

from fuel.cpu.attention.flash_attn_rows import FASTMATH, Window, exp_shifted, row_window, transform_row
from fuel.cpu.simd.simd16 import fma, fmas, hsum, vload, vmul, vstore, vzero
from fuel.errors import KernelError
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.jobs import ADDRESS, INT, REAL, Job, record_at

DECODE_MAX_QUERIES = 4  # up to this many queries, rows read the cache directly (no BLAS blocks)
FLOPS_PER_SECOND = 30e9  # one core, this path's vectorised dot products, for the part count
ITEMS = 16  # a group's heads are cut into chunks until a call has about this many items (of one head or more)
DECODE_ARGS = jobs.record(q=ADDRESS, k=ADDRESS, v=ADDRESS, out=ADDRESS, slopes=ADDRESS, groups=INT, heads=INT,
                          queries=INT, d=INT, sk=INT, kl=INT, sq=INT, left=INT, right=INT, scale=REAL, softcap=REAL,
                          head_chunks=INT)
KEYS = jobs.word(DECODE_ARGS, "kl")  # the live key count: the time estimate is per key, replay sets it per call


# ---- the two products of an item, per dtype: f32 rows of whole 16-lane vectors in registers -----------


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _scores_loop(qw: Any, kk: Any, s: Any, lo: int, w: int) -> None:
    """s[h, j] <- qw[h] · kk[lo + j] for the item's heads h and live keys j, each key row read once."""
    g, d = qw.shape
    for j in range(w):
        krow = kk[lo + j]
        for h in range(g):
            dot = qw[h, 0] * 0
            for c in range(d):
                dot += qw[h, c] * krow[c]
            s[h, j] = dot


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _weighted_loop(s: Any, vv: Any, acc: Any, lo: int, w: int) -> None:
    """acc[h] <- Σ_j s[h, j] · vv[lo + j], j in order."""
    g, d = acc.shape
    for j in range(w):
        vrow = vv[lo + j]
        for h in range(g):
            pr = s[h, j]
            for c in range(d):
                acc[h, c] += pr * vrow[c]


@njit(inline="always", cache=True)
def _scores_f32(qw: Any, kk: Any, s: Any, lo: int, w: int) -> None:
    """`_scores_loop` for f32 and a head size in whole vectors: each dot is the fixed sequence
    fma over the 16-lane slices in order, then the lanes summed in simd16's fixed tree, so no loop's
    reduction is left to the compiler (see docs/performance/attention.md, "decode products")."""
    g, d = qw.shape
    if d % 16:
        _scores_loop(qw, kk, s, lo, w)
        return
    qf, kf = qw.reshape(g * d), kk.reshape(kk.size)
    for j in range(w):
        o = (lo + j) * d
        for h in range(g):
            a = vmul(vload(qf, h * d), vload(kf, o))
            for c in range(16, d, 16):
                a = fma(vload(qf, h * d + c), vload(kf, o + c), a)
            s[h, j] = hsum(a)


@njit(inline="always", cache=True)
def _weighted_f32(s: Any, vv: Any, acc: Any, lo: int, w: int) -> None:
    """`_weighted_loop` for f32 and a head size in whole vectors, the same fused operations in the same
    order, with each head's 64 output columns in four registers over all keys, never stored and reloaded
    per key (see docs/performance/attention.md, "decode products")."""
    g, d = acc.shape
    if d % 16:
        _weighted_loop(s, vv, acc, lo, w)
        return
    vf, af = vv.reshape(vv.size), acc.reshape(acc.size)
    for h in range(g):
        c0 = 0
        while c0 + 64 <= d:
            a0, a1, a2, a3 = vzero(), vzero(), vzero(), vzero()
            for j in range(w):
                p, o = s[h, j], (lo + j) * d + c0
                a0 = fmas(p, vload(vf, o), a0)
                a1 = fmas(p, vload(vf, o + 16), a1)
                a2 = fmas(p, vload(vf, o + 32), a2)
                a3 = fmas(p, vload(vf, o + 48), a3)
            at = h * d + c0
            vstore(af, at, a0)
            vstore(af, at + 16, a1)
            vstore(af, at + 32, a2)
            vstore(af, at + 48, a3)
            c0 += 64
        while c0 < d:
            a0 = vzero()
            for j in range(w):
                a0 = fmas(s[h, j], vload(vf, (lo + j) * d + c0), a0)
            vstore(af, h * d + c0, a0)
            c0 += 16


def _scores(qw: Any, kk: Any, s: Any, lo: int, w: int) -> None:
    raise NotImplementedError("jitted code only")


def _weighted(s: Any, vv: Any, acc: Any, lo: int, w: int) -> None:
    raise NotImplementedError("jitted code only")


@overload(_scores, inline="always")
def _scores_typed(qw: Any, kk: Any, s: Any, lo: Any, w: Any) -> Any:
    body = _scores_f32 if qw.dtype == types.float32 else _scores_loop

    def impl(qw: Any, kk: Any, s: Any, lo: Any, w: Any) -> Any:
        body(qw, kk, s, lo, w)
    return impl


@overload(_weighted, inline="always")
def _weighted_typed(s: Any, vv: Any, acc: Any, lo: Any, w: Any) -> Any:
    body = _weighted_f32 if acc.dtype == types.float32 else _weighted_loop

    def impl(s: Any, vv: Any, acc: Any, lo: Any, w: Any) -> Any:
        body(s, vv, acc, lo, w)
    return impl


# ---- one item, a part of a job -----------------------------------------------------------------------


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _item(q: Any, k: Any, v: Any, out: Any, grp: int, i: int, h0: int, h1: int, kl: int, sq: int, left: int,
          right: int, scale: Any, softcap: Any, slopes: Any) -> None:
    """out[grp, h0:h1, i]: query i of heads [h0, h1) of group grp over their live keys (each head's
    arithmetic is its own, whichever heads share the item)."""
    d = q.shape[3]
    g = h1 - h0
    lo, hi = row_window(i, 0, kl, kl, sq, left, right)
    w = hi - lo
    qw = np.empty((g, d), q.dtype)
    acc = np.zeros((g, d), q.dtype)
    s = np.empty((g, max(w, 1)), q.dtype)
    for h in range(g):
        qw[h] = q[grp, h0 + h, i]
    _scores(qw, k[grp], s, lo, w)
    inv = np.zeros(g, q.dtype)
    for h in range(g):
        seg = s[h, :w]
        mx = transform_row(seg, i + kl - sq, lo, scale, softcap, slopes[grp, h0 + h])
        if mx > -np.inf:
            inv[h] = 1 / exp_shifted(seg, mx)
        else:
            seg[:] = 0
    _weighted(s, v[grp], acc, lo, w)
    for h in range(g):
        for c in range(d):
            out[grp, h0 + h, i, c] = acc[h, c] * inv[h]


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _run_part(part: int, parts: int, argv: int, like: Any) -> None:
    """Items [part·items/parts, (part+1)·items/parts) of the job at argv, in the dtype of `like`."""
    a = record_at(argv, DECODE_ARGS)
    n, g, nq, d, sk = a.groups, a.heads, a.queries, a.d, a.sk
    q = carray(pointer(a.q, like), (n, g, nq, d))
    k = carray(pointer(a.k, like), (n, sk, d))
    v = carray(pointer(a.v, like), (n, sk, d))
    out = carray(pointer(a.out, like), (n, g, nq, d))
    slopes = carray(pointer(a.slopes, like), (n, g))
    scale, softcap = like(a.scale), like(a.softcap)
    hs = a.head_chunks
    items = n * nq * hs
    for t in range(part * items // parts, (part + 1) * items // parts):
        grp, i, hc = t // (nq * hs), t // hs % nq, t % hs
        _item(q, k, v, out, grp, i, hc * g // hs, (hc + 1) * g // hs, a.kl, a.sq, a.left, a.right, scale, softcap,
              slopes)


@pool.task(fastmath=FASTMATH, error_model="numpy")
def _decode_f32(part: int, parts: int, argv: int) -> None:
    _run_part(part, parts, argv, np.float32)


@pool.task(fastmath=FASTMATH, error_model="numpy")
def _decode_f64(part: int, parts: int, argv: int) -> None:
    _run_part(part, parts, argv, np.float64)


# The decode tasks by dtype: each reads its arrays' raw addresses as that type, so no other dtype may reach one.
TASKS: dict[np.dtype[Any], pool.Task] = {np.dtype(np.float32): _decode_f32, np.dtype(np.float64): _decode_f64}


@njit(cache=True)
def _fill(q: Any, k: Any, v: Any, out: Any, slopes: Any, argv: Any) -> int:
    """argv <- the arrays and sizes `_run_part` reads (the mask and scales are set per call, `set_mask`);
    returns the item count."""
    a = argv[0]
    n, g, nq, d = q.shape
    a.q, a.k, a.v, a.out, a.slopes = q.ctypes.data, k.ctypes.data, v.ctypes.data, out.ctypes.data, slopes.ctypes.data
    a.groups, a.heads, a.queries, a.d, a.sk = n, g, nq, d, k.shape[1]
    a.head_chunks = min(g, max(1, -(-ITEMS // max(n * nq, 1))))
    return n * nq * a.head_chunks


def prepare(q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray, slopes: np.ndarray) -> Job:
    """The job of out [n, G, nq, D] <- attention of q [n, G, nq, D] over k, v [n, Sk, D] (f32 or f64,
    C-contiguous, one dtype; slopes [n, G]), its mask and scales still to set (`set_mask`). Its `seconds`
    is the estimate per live key (argv word `KEYS`)."""
    task = TASKS.get(q.dtype)
    if task is None:
        raise KernelError(f"flash_attn: the decode path runs on f32 or f64, got {q.dtype}")
    if not all(x.flags.c_contiguous and x.dtype == q.dtype for x in (q, k, v, out, slopes)):
        raise KernelError("flash_attn: the decode path reads C-contiguous arrays of one dtype")
    argv = jobs.argv_of(DECODE_ARGS)
    items = _fill(q, k, v, out, slopes, argv)
    n, g, nq, d = q.shape
    return jobs.job(task, argv, 4 * n * nq * g * d / FLOPS_PER_SECOND, items, unit=KEYS)


def set_mask(argv: np.ndarray, win: Window, scale: float, softcap: float) -> None:
    """Store the mask `win` and the scales into a prepared job's argv."""
    a = argv[0]
    a["kl"], a["sq"], a["left"], a["right"], a["scale"], a["softcap"] = win.kl, win.sq, win.left, win.right, scale, \
        softcap


def run(job: Job, win: Window, scale: float, softcap: float) -> None:
    """Post a prepared job under the mask `win` with these scales, and wait for it."""
    set_mask(job.argv, win, scale, softcap)
    jobs.run(job)


def decode(q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray, win: Window, scale: Any, softcap: Any,
           slopes: np.ndarray) -> None:
    """out [n, G, nq, D] <- attention of q [n, G, nq, D] over k, v [n, Sk, D] (f32 or f64, C-contiguous,
    one dtype; slopes [n, G]) under the mask `win`."""
    run(prepare(q, k, v, out, slopes), win, float(scale), float(softcap))
