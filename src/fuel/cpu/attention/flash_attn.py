"""FlashAttn (entry 12) on the CPU: blocked online softmax, products on BLAS, never the [Sq, Sk] matrix.

A call of at most DECODE_MAX_QUERIES queries runs the decode job (`flash_attn_decode`: rows read the
cache directly). A longer one runs blocked (`flash_attn_steps` describes the layout and the steps): as one
job whose task calls sgemm or dgemm (`flash_attn_tasks`), or, where there is no gemm to call from a task
or a block product NumPy computes without gemm, as NumPy BLAS products with the row passes as jobs
between them. Block sizes are
constants and each row's arithmetic is fixed by them, so results are the same bytes at any thread count.
A row with no admissible key gives 0. Half types are widened exactly to f32, computed in f32 and rounded
once on store; f64 runs in f64 throughout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from fuel.cpu.attention import flash_attn_decode as attention_decode
from fuel.cpu.attention.flash_attn_decode import DECODE_MAX_QUERIES, decode
from fuel.cpu.attention.flash_attn_rows import window_of
from fuel.cpu.attention.flash_attn_steps import BK, Problem, grouped, problem, steps
from fuel.cpu.attention.flash_attn_tasks import attend_job
from fuel.cpu.simd.half import narrow_into
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
from fuel.runtime import jobs, replay, threads
from fuel.runtime.buffers import POOL

BQ = 128  # queries per block, per head
QUERY_TASKS = 4  # query blocks a one-group call is cut into at least (`query_rows`)
# Groups per step: a step's scores [groups, G·BQ, BK] stay about this size, so they are still in L2 when
# the row pass and P·V read them (see docs/performance/attention.md, "score bytes").
SCORE_BYTES = 512 * 1024


def query_rows(sq: int) -> int:
    """Queries per block of a call with one (batch, kv head) group, whose query blocks are its only
    independent work: at least QUERY_TASKS blocks (a multiple of 16 rows, up to BQ), fixed by the length
    and never by the thread count (see docs/performance/attention.md, "one-group prefill")."""
    return min(BQ, max(16, 16 * -(-sq // (16 * QUERY_TASKS))))


def attention(p: Problem, out: np.ndarray) -> None:
    """out `[n, G, Sq, D]` (accumulation type, or bf16 bits for a blocked call) <- attention of every
    query block."""
    sq = p.q.shape[2]
    n, g, _, _ = p.q.shape
    if sq <= DECODE_MAX_QUERIES:
        p = p.part(0, n)
        decode(p.q, p.k, p.v, out, p.win, p.scale, p.softcap, p.slopes)
        return
    if n == 1 and out.dtype == p.slopes.dtype:
        # One f16 group (its output an f32 scratch) is widened whole and runs as an f32 call: its bytes are
        # that path's. A bf16 group is widened a key block at a time by its own task.
        p = p.part(0, n)
    bq = query_rows(sq) if n == 1 else BQ
    f32 = np.dtype(np.float32)
    all_f32 = p.q.dtype == p.k.dtype == p.v.dtype == out.dtype == f32
    job = attend_job(p, out, BQ, BK, False) if all_f32 else attend_job(p, out, bq, BK, True)
    if job is not None:
        with threads.one_blas_thread():  # the task's gemm runs in the thread that calls it
            jobs.run(job)
        return
    if n == 1:
        p = p.part(0, n)
    # A step's scores are [groups, G·rows, keys] with the block sizes clipped to the problem: short
    # sequences put hundreds of groups in one step.
    lo, hi = p.win.keys(0, sq)
    score = g * min(sq, bq) * max(1, min(hi - lo, BK)) * p.slopes.dtype.itemsize
    # One BLAS thread: a multi-threaded product's workers spin on after it, against the row passes' parts
    # on the pool (see docs/performance/attention.md, "steps on one BLAS thread").
    with threads.one_blas_thread():
        steps(p, out, bq, max(1, SCORE_BYTES // score))


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
    to the decode task, as `attention` would run it, without `problem`'s grouping (see
    docs/performance/attention.md, "decode direct"). The job is prepared once per (q, k, v, out) and its
    mask set per call (k_len moves every token)."""
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
    word `KEYS`) bound per call where k_len is a DynScalar."""
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
    return job._replace(dyn=dyn)


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
    rev = revision_of(flash_attn_kernel)
    for dt in FLOAT_DTYPES:
        slopes = DType.F64 if dt is DType.F64 else DType.F32
        for tail in ((), (slopes,)):
            registry.register(BackendImpl(FusedOps.FLASH_ATTN, "cpu", flash_attn_kernel, (dt, dt, dt, *tail, dt),
                                          attention_cost, PRECISION[dt], CONTIGUOUS_ONLY, rev))
