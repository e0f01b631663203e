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

from fuel.cpu.attention.flash_attn import BQ
from fuel.cpu.attention.flash_attn_grad_rows import DELTA_TASKS, GRAD_TASKS, delta_job, grad_job
from fuel.cpu.attention.flash_attn_grad_tasks import grads_job
from fuel.cpu.attention.flash_attn_steps import BK, Problem, forward_block, grouped, problem, query_block
from fuel.cpu.simd.half import narrow_into, widened
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
from fuel.runtime import jobs, threads
from fuel.runtime.buffers import POOL

GRADIENT_IDS = (FusedOps.FLASH_ATTN_BACKWARD_Q, FusedOps.FLASH_ATTN_BACKWARD_K, FusedOps.FLASH_ATTN_BACKWARD_V)


def gradients(p: Problem, do: np.ndarray, dq: np.ndarray, dk: np.ndarray, dv: np.ndarray) -> None:
    """dq `[n, G, Sq, D]`, dk and dv `[n, Sk, D]` (accumulation type, zeroed by the caller): one job whose
    task calls gemm (`flash_attn_grad_tasks`), or, where that does not serve the call, the steps below: the
    row passes as jobs, the products NumPy's BLAS (one call per group: each group's arithmetic is its own).
    Both give the same bytes."""
    p = p.part(0, p.q.shape[0])
    job = grads_job(p, do, dq, dk, dv, BQ, BK, DELTA_TASKS[p.slopes.dtype], GRAD_TASKS[p.slopes.dtype])
    if job is not None:
        jobs.run(job)
        return
    sq, g = p.q.shape[2], p.q.shape[1]
    w = p.win
    for i0 in range(0, sq, BQ):
        i1 = min(sq, i0 + BQ)
        qb, dob = query_block(p.q, i0, i1), query_block(do, i0, i1)
        acc, m, l = forward_block(p, i0, i1, qb)
        delta = np.empty_like(l)
        jobs.run(delta_job(acc, l, dob, delta))
        dqb = np.zeros_like(qb)
        lo, hi = w.keys(i0, i1)
        for j0 in range(lo, hi, BK):
            j1 = min(hi, j0 + BK)
            kb, vb = p.k[:, j0:j1], p.v[:, j0:j1]
            scores = (qb.shape[0], qb.shape[1], j1 - j0)  # reused buffers: a fresh 4 MB array costs page faults
            s = np.matmul(qb, kb.transpose(0, 2, 1), out=POOL.empty(scores, qb.dtype))
            dp = np.matmul(dob, vb.transpose(0, 2, 1), out=POOL.empty(scores, qb.dtype))
            jobs.run(grad_job(s, dp, m, l, delta, p, i0, i1 - i0, j0))
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
