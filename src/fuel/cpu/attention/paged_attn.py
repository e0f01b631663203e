"""PagedAttn (entry 13): causal attention over a block-paged KV cache in one Numba kernel.

One task per (sequence b, chunk of kv heads, chunk of query positions): the task holds every query
head that reads its kv heads (the G = Hq/Hkv heads of each GQA group) for its query positions, so each
cached K and V row is fetched once per task through the block table, and a token's rows of all the
chunk's heads are one contiguous read (`head_chunk`: all heads unless the threads need more tasks).
For each key it computes the scores of every row into a key-major buffer (-inf where the row may not
see the key), then the softmax of all rows at once (exact max, then exp and sum), and the
probability-weighted sum of V rows in key order (`paged_tiles`). Both sweeps walk the table block by
block and prefetch a couple of blocks ahead through it, with no array view and no division per key.
Every output row is computed by one thread in an order fixed by its own position, so results are
bit-stable at any thread count and any task split. Nothing of size [Sq, L] for all heads is ever built; the buffer per
task is bounded by `SCORE_BUFFER`.

Compute is f32 (f64 for f64). bf16 is read as uint16 bits and f16 as int16 bits, widened exactly in
the kernel (so only the live cache rows are ever converted); bf16 is rounded once on store, f16 is
stored through an f32 scratch and NumPy's exact rounding.

A call is two jobs over one record, both built from the shapes alone, so native replay posts them with
a new block table and new lengths at every call: the check (one part) finds a length past the table's
capacity or a block id outside the cache among the blocks a sequence reads, records it in the job's
status words, and otherwise stores the longest length and the chunks it gives (`query_chunk`,
`head_chunk`) into the record; the attention then reads those, and does nothing but zero its output when
the check found a problem. The check job's hook raises it (`IndexOutOfRange`) once the job has run,
eagerly before the attention, in replay after the stretch. So the cache is never read out of range.

A left window (`window_size`, FlashAttn's meaning) skips the keys left of the window of a task's first
query: their blocks are neither read nor checked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import carray, njit

from fuel.cpu.attention.paged_attn_check import STATUS_WORDS, find_problem, raise_problem
from fuel.cpu.attention.paged_attn_tiles import accumulate, dots, prefetch, vector_path
from fuel.cpu.simd.vecmath import cast_like, exp_nonpositive, neg_inf_like, store_as, widen
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
from fuel.graph.registry.paged_attn import PagedAttnParams
from fuel.runtime import jobs, pool
from fuel.runtime.atomics import pointer
from fuel.runtime.buffers import POOL
from fuel.runtime.jobs import ADDRESS, INT, REAL, record_at

# Reassociation lets the dot products, maxima and sums vectorise (one fixed order per build, so still
# bit-stable); no nnan/ninf, so NaN and inf keep IEEE behaviour.
FASTMATH = {"nsz", "reassoc", "contract", "arcp"}

# Scores a task may buffer (rows × live length). Long prompts are split into query chunks under it;
# a chunk re-reads K and V, so it is large enough to amortise that (64 Ki f32 = 256 KiB, L2-sized).
SCORE_BUFFER = 1 << 16

# How many tokens ahead the K and V passes prefetch (through the block table, so across blocks the
# hardware prefetchers cannot guess): two blocks of 16 (see docs/performance/attention.md, "paged prefetch").
PREFETCH_TOKENS = 32
ITEMS = 8  # a call's kv heads are cut into chunks until it has about this many tasks (see `head_chunk`)
SECONDS_PER_VALUE = 1e-9  # one core's time per (query row, live key, head column): a dot and an axpy
SECONDS_PER_ENTRY = 1e-9  # one core's time per block table entry checked


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _softmax_in_place(buf: Any, n: Any, rows: Any, total: Any) -> None:
    """exp(s - row max) over the first n keys of every row at once, vectorised across rows (a key's
    scores are contiguous); total[row] += each row's sum. Masked keys hold -inf, which leaves the max and (adding
    exact zeros) the sum as they are; a row without keys is never read."""
    mx = np.full(rows, neg_inf_like(buf[0, 0]))
    for t in range(n):
        for rr in range(rows):
            x = buf[t, rr]
            mx[rr] = x if x > mx[rr] else mx[rr]
    for t in range(n):
        for rr in range(rows):
            e = exp_nonpositive(buf[t, rr] - mx[rr])
            buf[t, rr] = e
            total[rr] += e


# status: `paged_attn_check`'s words; window: the left window, < 0 for none; qc, hc, longest: set by the
# check at every call (`budget` is SCORE_BUFFER when the job was built).
PAGED_ARGS = jobs.record(q=ADDRESS, kc=ADDRESS, vc=ADDRESS, bt=ADDRESS, cl=ADDRESS, slopes=ADDRESS, out=ADDRESS,
                        status=ADDRESS, batch=INT, heads=INT, sq=INT, d=INT, blocks=INT, block_size=INT,
                        kv_heads=INT, table=INT, n_slopes=INT, window=INT, budget=INT, qc=INT, hc=INT, longest=INT,
                        scale=REAL, softcap=REAL)
LONGEST = jobs.word(PAGED_ARGS, "longest")  # the attention job's time estimate is per unit of it


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _paged(q: Any, kc: Any, vc: Any, bt: Any, cl: Any, slopes: Any, out: Any, scale: Any, softcap: Any,
           window: int, qc: int, hc: int, first_task: int, last_task: int) -> None:
    """Tasks [first_task, last_task) of the call. q [B,Hq,Sq,D]; kc, vc [NB,bs,Hkv,D]; bt [B,M] u32; cl [B]
    u32 (checked); slopes [Hq] or [0] in the compute type; out [B,Hq,Sq,D]; scale, softcap (0: none) in the
    compute type; window the left window (< 0: none); qc queries and hc kv heads per task."""
    _, hq, sq, dh = q.shape
    bs, hkv = kc.shape[1], kc.shape[2]
    g = hq // hkv
    nqc = (sq + qc - 1) // qc
    nhc = (hkv + hc - 1) // hc
    per_b = nhc * nqc
    has_alibi = slopes.shape[0] > 0
    capped = softcap > 0
    simd = vector_path(kc, dh)
    tok = hkv * dh  # elements from one token of a block to the next
    line = 64 // kc.itemsize  # elements per cache line
    for task in range(first_task, last_task):
        tk = np.int64(task)
        b = tk // per_b
        h0 = (tk % per_b) // nqc * hc
        nh = min(hkv, h0 + hc) - h0
        i0 = (tk % nqc) * qc
        i1 = min(sq, i0 + qc)
        ln = np.int64(cl[b])
        shift = ln - sq  # query i sits at absolute position i + shift
        rh = (i1 - i0) * g  # rows per kv head: row r of head h is query i0 + r // g, q head h·g + r % g
        rows = nh * rh  # row R = hl·rh + r for kv head h0 + hl
        nmax = max(0, min(ln, i1 + shift))  # keys the last query of the chunk may read
        # The first key the chunk's first query may read: keys before it (and their blocks) are skipped.
        ts = 0 if window < 0 else min(nmax, max(0, i0 + shift - window))
        qw = np.empty((rows, dh), slopes.dtype)
        buf = np.empty((max(nmax - ts, 1), rows), slopes.dtype)  # key-major (key t at t − ts): one write a key
        acc = np.zeros((rows, dh), slopes.dtype)
        total = np.zeros(rows, slopes.dtype)
        # The scale is folded into the queries, so the common score (no softcap, no ALiBi) is final as
        # the dot product leaves it: no pass over the scores to scale them.
        for rr in range(rows):
            hl, r = rr // rh, rr % rh
            qh, qi = (h0 + hl) * g + r % g, i0 + r // g
            for d in range(dh):
                qw[rr, d] = widen(q[b, qh, qi, d]) * scale
        for sweep in range(2):  # the scores of every key (K), then the weighted sum of V rows
            cache = kc if sweep == 0 else vc
            if sweep == 1:
                _softmax_in_place(buf, nmax - ts, rows, total)
            # Prefetch cursor: token pt, at offset po of the table's block pb (no division per key).
            pt = ts + PREFETCH_TOKENS
            pb, po = pt // bs, pt % bs
            for t0 in range(ts - ts % bs, nmax, bs):  # block by block: one table lookup per block
                row0 = np.int64(bt[b, t0 // bs]) * bs * tok + h0 * dh
                for t in range(max(t0, ts), min(nmax, t0 + bs)):
                    if pt < nmax:
                        ahead = (np.int64(bt[b, pb]) * bs + po) * tok + h0 * dh
                        for j in range(0, nh * dh, line):
                            prefetch(cache, ahead + j)
                        pt, po = pt + 1, po + 1
                        if po == bs:
                            pb, po = pb + 1, 0
                    off = row0 + (t - t0) * tok
                    first = max(0, t - shift - i0) * g  # queries before i = t − shift may not see key t
                    # nor may queries after i = t − shift + window (key t is left of their window)
                    last = rh if window < 0 else max(first, min(rh, (t - shift + window - i0 + 1) * g))
                    kt = t - ts
                    for hl in range(nh):
                        lo, hi = hl * rh + first, hl * rh + last
                        if sweep == 1:
                            accumulate(acc, lo, hi - lo, buf, kt, vc, off + hl * dh, simd)
                            continue
                        for r in range(hl * rh, lo):  # -inf: exp gives an exact 0, the max ignores it
                            buf[kt, r] = neg_inf_like(scale)
                        for r in range(hi, (hl + 1) * rh):
                            buf[kt, r] = neg_inf_like(scale)
                        dots(qw, lo, hi - lo, kc, off + hl * dh, buf, kt, simd)
                        if capped or has_alibi:
                            for r in range(first, last):
                                s = buf[kt, hl * rh + r]
                                if capped:
                                    s = softcap * math.tanh(s / softcap)
                                if has_alibi:
                                    s -= slopes[(h0 + hl) * g + r % g] * cast_like(abs(i0 + r // g + shift - t), scale)
                                buf[kt, hl * rh + r] = s
        for rr in range(rows):
            hl, r = rr // rh, rr % rh
            qi = i0 + r // g
            inv = cast_like(1, scale) / total[rr] if min(ln, qi + shift + 1) > 0 else cast_like(0, scale)
            for d in range(dh):
                out[b, (h0 + hl) * g + r % g, qi, d] = store_as(out, acc[rr, d] * inv)


@njit(inline="always", cache=True, fastmath=FASTMATH)
def _paged_part(part: int, parts: int, argv: int, st: Any, dt: Any, ot: Any) -> None:
    """This part's share of the call's tasks: q and the caches in storage type st, compute in dt, out in ot."""
    a = record_at(argv, PAGED_ARGS)
    nb, hq, sq, dh, hkv = a.batch, a.heads, a.sq, a.d, a.kv_heads
    q = carray(pointer(a.q, st), (nb, hq, sq, dh))
    kc = carray(pointer(a.kc, st), (a.blocks, a.block_size, hkv, dh))
    vc = carray(pointer(a.vc, st), (a.blocks, a.block_size, hkv, dh))
    bt = carray(pointer(a.bt, np.uint32), (nb, a.table))
    cl = carray(pointer(a.cl, np.uint32), (nb,))
    slopes = carray(pointer(a.slopes, dt), (a.n_slopes,))
    out = carray(pointer(a.out, ot), (nb, hq, sq, dh))
    if carray(pointer(a.status, np.int64), (4,))[0] != 0:  # the check found a problem: read nothing
        if part == 0:
            out[:] = 0
        return
    tasks = nb * -(-hkv // a.hc) * -(-sq // a.qc)
    _paged(q, kc, vc, bt, cl, slopes, out, dt(a.scale), dt(a.softcap), a.window, a.qc, a.hc, part * tasks // parts,
           (part + 1) * tasks // parts)


@pool.task(fastmath=FASTMATH)
def _paged_f32(part: int, parts: int, argv: int) -> None:
    _paged_part(part, parts, argv, np.float32, np.float32, np.float32)


@pool.task(fastmath=FASTMATH)
def _paged_f64(part: int, parts: int, argv: int) -> None:
    _paged_part(part, parts, argv, np.float64, np.float64, np.float64)


@pool.task(fastmath=FASTMATH)
def _paged_bf16(part: int, parts: int, argv: int) -> None:
    _paged_part(part, parts, argv, np.uint16, np.float32, np.uint16)


@pool.task(fastmath=FASTMATH)
def _paged_f16(part: int, parts: int, argv: int) -> None:
    _paged_part(part, parts, argv, np.int16, np.float32, np.float32)


_TASKS = {np.dtype(np.float32): _paged_f32, np.dtype(np.float64): _paged_f64, DType.BF16.np: _paged_bf16,
          DType.F16.np: _paged_f16}


@njit(cache=True)
def _query_chunk(sq: int, g: int, longest: int, budget: int) -> int:
    return max(1, min(sq, budget // max(1, g * longest)))


@njit(cache=True)
def _head_chunk(hkv: int, rows: int, longest: int, tasks: int, budget: int) -> int:
    hc = -(-hkv // max(1, min(hkv, -(-ITEMS // max(1, tasks)))))
    return max(1, min(hc, budget // max(1, rows * longest)))


def query_chunk(sq: int, g: int, longest: int) -> int:
    """Query positions per task: all of them unless their score rows would pass SCORE_BUFFER. Each row
    is computed on its own, so the split (which follows the longest live length) changes no output byte."""
    return int(_query_chunk(sq, g, longest, SCORE_BUFFER))


def head_chunk(hkv: int, rows: int, longest: int, tasks: int) -> int:
    """KV heads per task: all of them (each token's rows of every head are one contiguous read) unless
    the call would have fewer than ITEMS tasks, or the score rows would pass SCORE_BUFFER. Fixed by the
    shape and the longest length; each row is computed on its own, so the split changes no output byte."""
    return int(_head_chunk(hkv, rows, longest, tasks, SCORE_BUFFER))


@pool.task()
def _check(part: int, parts: int, argv: int) -> None:
    """The whole check (one item), then the chunks for the longest length, stored into the record."""
    a = record_at(argv, PAGED_ARGS)
    for _ in range(part // parts, (part + 1) // parts):
        status = carray(pointer(a.status, np.int64), (STATUS_WORDS,))
        bt = carray(pointer(a.bt, np.uint32), (a.batch, a.table))
        cl = carray(pointer(a.cl, np.uint32), (a.batch,))
        longest = find_problem(bt, cl, a.blocks, a.block_size, a.sq, a.window, status)
        g = a.heads // a.kv_heads
        qc = _query_chunk(a.sq, g, longest, a.budget)
        a.qc, a.longest = qc, longest
        a.hc = _head_chunk(a.kv_heads, g * qc, longest, a.batch * -(-a.sq // qc), a.budget)


def _storage(a: np.ndarray) -> np.ndarray:
    """What the task reads: bf16 as uint16 bits, f16 as int16 bits (so Numba tells them apart)."""
    if a.dtype == DType.BF16.np:
        return a.view(np.uint16)
    if a.dtype == DType.F16.np:
        return a.view(np.int16)
    return a


@njit(cache=True)
def _fill(q: Any, kc: Any, vc: Any, bt: Any, cl: Any, slopes: Any, out: Any, status: Any, argv: Any) -> None:
    a = argv[0]
    a.q, a.kc, a.vc, a.bt, a.cl = q.ctypes.data, kc.ctypes.data, vc.ctypes.data, bt.ctypes.data, cl.ctypes.data
    a.slopes, a.out, a.n_slopes, a.table = slopes.ctypes.data, out.ctypes.data, slopes.shape[0], bt.shape[1]
    a.status = status.ctypes.data
    a.batch, a.heads, a.sq, a.d = q.shape
    a.blocks, a.block_size, a.kv_heads = kc.shape[0], kc.shape[1], kc.shape[2]
    a.qc = a.hc = 1


def paged_job(inputs: list[np.ndarray], out: np.ndarray, params: PagedAttnParams) -> tuple[jobs.Job, ...]:
    """The call's jobs over C-contiguous arrays, from their shapes alone: the check, then (for a non-empty
    output) the attention. f16 goes through an f32 scratch the attention job keeps, which the caller rounds
    into out."""
    q, kc, vc, bt, cl = inputs[:5]
    acc = np.dtype(np.float64) if q.dtype == np.float64 else np.dtype(np.float32)
    slopes = inputs[5] if len(inputs) == 6 else np.empty(0, acc)
    dst = POOL.empty(out.shape, acc) if out.dtype == DType.F16.np else _storage(out)
    status = np.zeros(STATUS_WORDS, np.int64)
    argv = jobs.argv_of(PAGED_ARGS)
    _fill(_storage(q), _storage(kc), _storage(vc), bt, cl, slopes, dst, status, argv)
    a = argv[0]
    a["window"] = -1 if params.window_size is None else params.window_size
    a["budget"] = SCORE_BUFFER
    a["scale"], a["softcap"] = params.softmax_scale, 0 if params.softcap is None else params.softcap
    nb, m, bs, hkv, blocks = bt.shape[0], bt.shape[1], kc.shape[1], kc.shape[2], kc.shape[0]
    check = jobs.job(_check, argv, nb * m * SECONDS_PER_ENTRY, 1, keep=(status,),
                     check=lambda: raise_problem(status, bs, m, blocks))
    if out.size == 0:
        return (check,)
    g, sq = q.shape[1] // hkv, q.shape[2]
    most = nb * hkv * -(-sq // query_chunk(sq, g, m * bs))  # the tasks of the longest length the table holds
    per_key = nb * q.shape[1] * sq * q.shape[3] * SECONDS_PER_VALUE
    return check, jobs.job(_TASKS[q.dtype], argv, per_key, max(1, most), unit=LONGEST, keep=(dst,))


def paged_attention(inputs: list[np.ndarray], out: np.ndarray, params: PagedAttnParams) -> None:
    """The impl's kernel: the call's jobs, then f16's rounding from the attention job's scratch."""
    found = paged_job(inputs, out, params)
    jobs.run(found)
    if out.dtype == DType.F16.np and len(found) == 2:
        np.copyto(out, found[1].keep[0], casting="unsafe")


@jobs.replays(paged_attention)
def paged_attn_form(inputs: list[np.ndarray], out: np.ndarray, params: PagedAttnParams) -> tuple[jobs.Job, ...] | None:
    """What native replay posts: the eager kernel's jobs, but for f16 (rounded in NumPy) and arrays the
    tasks do not read as they are."""
    if out.dtype == DType.F16.np or not all(x.flags.c_contiguous for x in (*inputs, out)):
        return None
    return paged_job(inputs, out, params)


def cost(shapes: Sequence[Shape], dtypes: Sequence[DType], params: PagedAttnParams) -> CostEstimate:
    """Work for the table's full capacity (the live lengths are only known at run time): a dot and an
    axpy of length D per (query row, key); K and V read once per kv head, q read and out written."""
    q, kc, bt = shapes[0], shapes[1], shapes[3]
    b, hq, sq, d = q
    capacity = bt[1] * kc[1]
    qbytes = b * hq * sq * d * dtypes[0].itemsize
    return CostEstimate(flops=4 * b * hq * sq * capacity * d,
                        bytes_moved=2 * b * kc[2] * capacity * d * dtypes[1].itemsize + 2 * qbytes)


# |out - ref| <= max_relative·|ref| + max_absolute·S against float64, S = Σ_t p_t·|v_t| per element (what
# the output averages). Twice the worst error `python -m fuel.testing.measure PagedAttn` found over seeds
# 0-59 (both arities), rounded up. The f32 relative part (~25 ulp) is the score's own rounding, about
# ε·scale·Σ|q·k|, carried through exp: it grows with |s|, as in any f32 attention. The half types compute
# in f32 and round once, so their relative part is the output's rounding and their absolute part the
# f32 impl's.
PAGED_PRECISION = {
    DType.F32: PrecisionGuarantee(True, None, 3.3e-6, 1.1e-6, "f32 dots, Cephes-style expf, f32 accumulation"),
    DType.F64: PrecisionGuarantee(True, None, 9.3e-15, 5.4e-15, "f64 dots, libm exp, f64 accumulation"),
    DType.BF16: PrecisionGuarantee(True, None, 7.9e-3, 1.1e-6, "f32 compute, one RNE rounding on store"),
    DType.F16: PrecisionGuarantee(True, None, 9.8e-4, 1.1e-6, "f32 compute, one rounding on store"),
}


def register(registry: FusedKernelRegistry) -> None:
    rev = revision_of(paged_attention)
    u32 = DType.U32
    for dt in FLOAT_DTYPES:
        plain = (dt, dt, dt, u32, u32)
        slopes = DType.F64 if dt is DType.F64 else DType.F32
        for dtypes in ((*plain, dt), (*plain, slopes, dt)):
            registry.register(BackendImpl(FusedOps.PAGED_ATTN, "cpu", paged_attention, dtypes, cost,
                                          PAGED_PRECISION[dt], CONTIGUOUS_ONLY, rev))
