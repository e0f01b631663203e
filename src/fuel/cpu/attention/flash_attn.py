"""FlashAttn (entry 12) on the CPU: blocked online softmax, products on BLAS, never the [Sq, Sk] matrix.

Layout of the work: the G = Hq/Hkv query heads that share a kv head are stacked into the rows of one
matrix, so a block of Bq queries is a `[G·Bq, D]` operand and K/V are never repeated. Several
B·Hkv groups share each step (NumPy's stacked matmul runs one BLAS call per group; the step's Python
cost is paid once), as many as keep its scores near SCORE_BYTES, in L2. For each query block, the
keys it may see (the union of its rows' windows) are visited in blocks of BK:
  1. `S = Q·Kᵀ` on BLAS;
  2. one Numba pass per row: scale, softcap, ALiBi, mask, the running max and sum, the rescaling of
     the accumulator, and `P = exp(S − max)` in place;
  3. `acc += P·V` on BLAS.
Memory is O(rows·BK) per step whatever the sequence length. In f32 the same steps run as a task of the
spinning pool (`attention_tasks`: no Python between them); the steps below are the other dtypes' path,
and f32's where NumPy's BLAS offers no sgemm to call from jitted code. Block sizes are constants and each
row's arithmetic is fixed by them, so results are the same bytes at any thread count (OpenBLAS
splits a product over M and N, never over K). A row with no admissible key gives 0.

Half types are widened exactly to f32 once, computed in f32 and rounded once on store; f64 runs in
f64 throughout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from numba import prange

from fuel.cpu.attention import flash_attn_decode as attention_decode
from fuel.cpu.attention.flash_attn_decode import DECODE_MAX_QUERIES, decode
from fuel.cpu.attention.flash_attn_rows import FASTMATH, Window, online_row, store_row, window_of
from fuel.cpu.attention.flash_attn_tasks import attend
from fuel.cpu.simd.driver import row_kernel
from fuel.cpu.simd.half import narrow_into, widened
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
from fuel.runtime import jobs, replay
from fuel.runtime.buffers import POOL
from fuel.runtime.threads import split_work

BQ = 128  # queries per block, per head
BK = 512  # keys per block
QUERY_TASKS = 4  # query blocks a one-group call is cut into at least (`query_rows`)
# Groups per step: a step's scores [groups, G·BQ, BK] stay about this size so they are still in L2 when
# the row pass and P·V read them (all 8 groups of a thread at once, 2 MiB, ran ~10% slower on a 1 MiB L2).
SCORE_BYTES = 512 * 1024

@row_kernel(fastmath=FASTMATH, nogil=True)
def _online_block(s: Any, m: Any, l: Any, acc: Any, i0: int, bq: int, j0: int, kl: int, sq: int, left: int,
                  right: int, scale: Any, softcap: Any, slopes: Any) -> None:
    """One key block of the online softmax, rows in parallel (`online_row`)."""
    n, rows, _ = s.shape
    for t in prange(n * rows):
        online_row(s, m, l, acc, t, i0, bq, j0, kl, sq, left, right, scale, softcap, slopes)


@row_kernel(fastmath=FASTMATH, nogil=True)
def _store(acc: Any, l: Any, out: Any, i0: int) -> None:
    """out[:, r // bq, i0 + r % bq] <- acc[:, r] / l[:, r] (`store_row`), rows in parallel. One pass: no
    normalised copy of acc, no f32 scratch for a bf16 output."""
    n, rows, _ = acc.shape
    for t in prange(n * rows):
        store_row(acc, l, out, i0, t)


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
        is its own). Half-type q, k and v are widened here, so each thread widens its own groups right
        before it reads them."""
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


def forward_block(p: Problem, i0: int, i1: int, qb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(acc, m, l) of query rows [i0, i1): the unnormalised output and the softmax's max and sum (the max
    in raw q·k units for a plain row, `attention_rows.online_row`)."""
    n, rows, d = qb.shape
    dt = qb.dtype
    acc = np.zeros((n, rows, d), dt)
    m = np.full((n, rows), -np.inf, dt)
    l = np.zeros((n, rows), dt)
    lo, hi = p.win.keys(i0, i1)
    w = p.win
    for j0 in range(lo, hi, BK):
        j1 = min(hi, j0 + BK)
        s = np.matmul(qb, p.k[:, j0:j1].transpose(0, 2, 1), out=POOL.empty((n, rows, j1 - j0), dt))
        _online_block(s, m, l, acc, i0, i1 - i0, j0, w.kl, w.sq, w.left, w.right, p.scale, p.softcap,
                      p.slopes)
        if j0 == lo:  # the first block's product is the accumulator (it was all zeros)
            np.matmul(s, p.v[:, j0:j1], out=acc)
        else:
            acc += np.matmul(s, p.v[:, j0:j1])
    return acc, m, l


def query_rows(sq: int) -> int:
    """Queries per block of a call with one (batch, kv head) group, whose query blocks are its only
    independent work: at least QUERY_TASKS blocks (a multiple of 16 rows, up to BQ), fixed by the length
    and never by the thread count. Gemma-3's 128-token prefill was one block of 128: one thread ran it,
    through a two-thread BLAS whose idle worker then spun against the next steps' threads."""
    return min(BQ, max(16, 16 * -(-sq // (16 * QUERY_TASKS))))


def attention(p: Problem, out: np.ndarray) -> None:
    """out `[n, G, Sq, D]` (accumulation type) <- attention of every query block."""
    sq = p.q.shape[2]
    n, g, _, _ = p.q.shape
    if sq <= DECODE_MAX_QUERIES or n == 1:
        p = p.part(0, n)
    if sq <= DECODE_MAX_QUERIES:
        decode(p.q, p.k, p.v, out, p.win, p.scale, p.softcap, p.slopes)
        return

    f32 = np.dtype(np.float32)
    if p.q.dtype == p.k.dtype == p.v.dtype == out.dtype == f32 and attend(p, out, BQ, BK):
        return
    bq = query_rows(sq) if n == 1 else BQ

    def block(part: Problem, g0: int, g1: int, i0: int) -> None:
        i1 = min(sq, i0 + bq)
        acc, _, l = forward_block(part, i0, i1, query_block(part.q, i0, i1))
        _store(acc, l, out[g0:g1], i0)

    def groups(tasks: range) -> None:
        for g0 in range(tasks.start, tasks.stop, chunk):
            g1 = min(tasks.stop, g0 + chunk)
            part = p.part(g0, g1)
            for i0 in range(0, sq, bq):
                block(part, g0, g1, i0)

    def query_blocks(tasks: range) -> None:
        for t in tasks:
            block(p, 0, 1, t * bq)

    # A step's scores are [groups, G·rows, keys] with the block sizes clipped to the problem: short
    # sequences (BERT's 32 tokens) put hundreds of groups in one step. Groups are independent, so the
    # count never changes the bytes.
    lo, hi = p.win.keys(0, sq)
    score = g * min(sq, bq) * max(1, min(hi - lo, BK)) * p.slopes.dtype.itemsize
    chunk = max(1, SCORE_BYTES // score)
    if n == 1:  # one (batch, kv head) group: its query blocks are the independent work
        split_work(query_blocks, -(-sq // bq), strided=True)
    else:
        split_work(groups, n)


def flash_attn_kernel(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> None:
    if _decode_direct(inputs, out, params):
        return
    acc_t = np.dtype(np.float64) if out.dtype == np.float64 else np.dtype(np.float32)
    p = problem(inputs, params, acc_t)
    if out.size == 0:
        return
    # The blocked path stores f32/f64 and bf16 itself (rounded once); f16 and decode go through a scratch.
    if out.dtype == acc_t or (out.dtype == DType.BF16.np and inputs[0].shape[2] > DECODE_MAX_QUERIES):
        attention(p, grouped(out.view(np.uint16) if out.dtype == DType.BF16.np else out, p.hkv))
        return
    tmp = POOL.empty(out.shape, acc_t)
    attention(p, grouped(tmp, p.hkv))
    narrow_into(tmp, out)


_ZERO_SLOPES: dict[tuple[int, int, np.dtype[Any]], np.ndarray] = {}
_LAUNCHES = jobs.JobCache()  # decode calls of replayed steps: q, k, v and out (`fuel.runtime.jobs`)


def _decode_direct(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> bool:
    """A decode call (at most DECODE_MAX_QUERIES queries) all in f32 or all in f64, without ALiBi: straight
    to the decode task, as `attention` would run it, without `problem`'s grouping (a decode step's
    attention is ~30 µs, and that took 4-5). The job is prepared once per (q, k, v, out) and its mask
    set per call (k_len moves every token)."""
    if len(inputs) != 3:
        return False
    q, k, v = inputs
    launch = _LAUNCHES.find((q, k, v, out), None)
    if launch is None:
        launch = _decode_job(q, k, v, out)
        if launch is None:
            return False
        _LAUNCHES.remember((q, k, v, out), None, launch)
    attention_decode.run(launch, window_of(params, q.shape[2], k.shape[2]), params.softmax_scale, params.softcap or 0.0)
    return True


def _decode_job(q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray) -> jobs.Job | None:
    """The decode task's job for these arrays (C-contiguous: the executor hands them so), its mask and scales
    still to set; None where the decode path does not serve the call."""
    if (not 0 < q.shape[2] <= DECODE_MAX_QUERIES or out.size == 0
            or not q.dtype == k.dtype == v.dtype == out.dtype or q.dtype not in (np.float32, np.float64)):
        return None
    b, hkv, sk, d = k.shape
    key = (b * hkv, q.shape[1] // hkv, q.dtype)
    slopes = _ZERO_SLOPES.get(key)
    if slopes is None:  # no ALiBi: every slope 0 (read-only, shared by every call of this shape)
        slopes = _ZERO_SLOPES.setdefault(key, np.zeros(key[:2], q.dtype))
        slopes.flags.writeable = False
    return attention_decode.prepare(grouped(q, hkv), k.reshape(b * hkv, sk, d), v.reshape(b * hkv, sk, d),
                                    grouped(out, hkv), slopes)


@jobs.replays(flash_attn_kernel)
def flash_attn_form(inputs: list[np.ndarray], out: np.ndarray, params: Any) -> jobs.Job | None:
    """A decode call (`_decode_direct`'s) as its job with the mask and scales set, the live keys (argv
    entry `KEYS`) bound per call where k_len is a DynScalar."""
    if len(inputs) != 3 or not all(x.flags.c_contiguous for x in (*inputs, out)):
        return None
    q, k, v = inputs
    job = _decode_job(q, k, v, out)
    if job is None:
        return None
    sk = k.shape[2]
    name = replay.dyn_name(params.k_len)
    win = window_of(replace(params, k_len=sk) if name else params, q.shape[2], sk)
    attention_decode.set_mask(job.argv, win, params.softmax_scale, params.softcap or 0.0)
    dyn = ((attention_decode.KEYS, name, 0, sk),) if name else ()
    return job._replace(unit=attention_decode.KEYS, dyn=dyn)


def attention_cost(shapes: Sequence[Shape], dtypes: Sequence[DType], params: Any) -> CostEstimate:
    """Two products over the live keys (a causal mask halves them), plus reading q, the live rows of k
    and v, and writing out. A DynScalar k_len (unknown at plan time) counts the whole cache; the
    executor sizes such a step again with the bound value at each run."""
    b, hq, sq, d = shapes[0]
    hkv, sk = shapes[1][1], shapes[1][2]
    kl = sk if params.k_len is None or not isinstance(params.k_len, int) else min(params.k_len, sk)
    pairs = b * hq * sq * kl
    if params.causal and sq > 1:
        pairs = pairs // 2
    q_out = b * hq * sq * d * (dtypes[0].itemsize + dtypes[-1].itemsize)
    kv = b * hkv * kl * d * (dtypes[1].itemsize + dtypes[2].itemsize)
    alibi = hq * dtypes[3].itemsize if len(shapes) == 5 else 0
    return CostEstimate(flops=4 * pairs * d, bytes_moved=q_out + kv + alibi)


# |out - ref| <= max_relative·|ref| + max_absolute·S against float64, S = Σ_j p_ij·|v_j| per element
# (the size of what the output averages). Twice the worst error `python -m fuel.testing.measure
# FlashAttn` found, rounded up; the half types compute in f32 and round once on store.
PRECISION = {
    DType.F32: PrecisionGuarantee(True, None, 2e-6, 1e-6, "f32 BLAS products, Cephes expf, f32 online softmax"),
    DType.F64: PrecisionGuarantee(True, None, 5e-15, 3e-15, "f64 BLAS products, libm exp"),
    DType.BF16: PrecisionGuarantee(True, None, 7.9e-3, 5e-7, "f32 compute, one RNE rounding on store"),
    DType.F16: PrecisionGuarantee(True, None, 9.8e-4, 5e-7, "f32 compute, one RNE rounding on store"),
}


def register(registry: FusedKernelRegistry) -> None:
    rev = revision_of(_online_block)
    for dt in FLOAT_DTYPES:
        slopes = DType.F64 if dt is DType.F64 else DType.F32
        for tail in ((), (slopes,)):
            registry.register(BackendImpl(FusedOps.FLASH_ATTN, "cpu", flash_attn_kernel, (dt, dt, dt, *tail, dt),
                                          attention_cost, PRECISION[dt], CONTIGUOUS_ONLY, rev))
