"""Attention against PyTorch, side by side in one process: forward, backward, decode, paged decode,
and the peak memory of a long causal forward.

Cases (f32; the forward in bf16 too when a bf16 FlashAttn kernel is registered):
1. forward: B1 H16 S1024 D64 causal. fuel (build + realize each call, and through `fl.jit`) against
   `F.scaled_dot_product_attention(is_causal=True)` eager and torch.compile'd (for Sq == Sk top-left
   and bottom-right causal agree).
2. backward of the same: fuel's dq, dk, dv in one realize against torch autograd of SDPA, torch's
   backward alone (`torch.autograd.grad(out, (q, k, v), g, retain_graph=True)` on a kept forward).
3. decode: Sq 1, Hq 32 over Hkv 8 (GQA), D 64, k_len 2048 live of a [1, 8, 4096, 64] capacity cache:
   fuel with `k_len=fl.dyn("k_len")` against torch SDPA on `k[:, :, :2048]` with `enable_gqa=True`.
4. paged decode: B4, Hq 32, Hkv 8, D 64, block_size 16, 2048 tokens each through a shuffled block
   table: fuel's paged_attn against torch SDPA on the dense cache gathered beforehand (the gather is
   excluded from torch's time; it is reported on its own).
5. long-sequence memory: S 16384, D 64, B1, H1 and H2, causal, f32, each in a fresh subprocess: peak
   RSS (VmHWM after a reset, see `memory_child`) minus the RSS once the inputs are allocated, next to
   the score matrix one head would need (S^2 * 4 bytes = 1 GiB). Only run when a FlashAttn CPU kernel
   for f32 is registered (the primitive decomposition materialises the score matrix).

Every way of a case runs interleaved (one call of each per round, medians over `repeat` rounds, fewer
when a case's rounds would take over a minute), so drift and other load hit them alike; the load
average is recorded, since two cores shared with anything else skew every number.
The roofline is the larger of the fuel impl's own cost estimate (`impl.cost`): bytes over the measured
copy bandwidth and flops over the measured sgemm peak; without a fused kernel it falls back to the
analytic counts (causal forward flops 2*2*B*H*S^2*D/2). It is reported as floor / fuel's best time.
Run it through `fuel bench --attention` or, from the checkout, `python -m benchmarks.bench_attention`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import fuel as fl
from benchmarks.bench_ops import blas_info, machine_limits
from fuel.dtype import DType, as_dtype
from fuel.graph.registry import FusedOps

# torch's OpenMP pool waits passively, as fuel's does (bench_latency says why: spinning, each pool
# starves the other on two cores). Set before torch loads, which is why torch is imported inside the
# functions below.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

ROOT = Path(__file__).resolve().parents[1]
THREADS = 2
FUEL_WAYS = ("fuel", "fuel_jit")
TORCH_WAYS = ("torch_eager", "torch_compile")
WAYS = FUEL_WAYS + TORCH_WAYS


@dataclass(frozen=True)
class Sizes:
    """Every size the cases use; `Sizes.tiny()` runs the whole harness in seconds."""

    batch: int = 1
    heads: int = 16
    seq: int = 1024
    head_dim: int = 64
    decode_hq: int = 32
    decode_hkv: int = 8
    decode_capacity: int = 4096
    decode_len: int = 2048
    paged_batch: int = 4
    block_size: int = 16
    paged_context: int = 2048
    long_seq: int = 16384
    long_heads: tuple[int, ...] = (1, 2)

    @staticmethod
    def tiny() -> Sizes:
        return Sizes(batch=1, heads=2, seq=32, head_dim=16, decode_hq=4, decode_hkv=2, decode_capacity=64,
                     decode_len=40, paged_batch=2, block_size=4, paged_context=24, long_seq=256, long_heads=(1,))


# ---------------------------------------------------------------------------------------------- helpers

def timed_ms(fns: dict[str, Callable[[], Any]], repeat: int, budget_s: float = 60.0) -> tuple[dict[str, float], int]:
    """(median ms per call of each fn, rounds timed). Each round runs every fn once, so a slow patch of
    the machine lands on all of them. One warm-up round first; it also sizes the run: at most `repeat`
    rounds, fewer (but at least 3) when `repeat` rounds would take longer than `budget_s`."""
    start = time.perf_counter()
    for fn in fns.values():
        fn()
    round_s = time.perf_counter() - start
    rounds = max(1, min(repeat, max(3, int(budget_s / max(round_s, 1e-9)))))
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}, rounds


def _torch_dtype(dt: DType) -> Any:
    import torch

    return {DType.F32: torch.float32, DType.F64: torch.float64, DType.BF16: torch.bfloat16,
            DType.F16: torch.float16}[dt]


def _randn(rng: np.random.Generator, shape: tuple[int, ...], dt: DType) -> np.ndarray:
    """Standard normal values, rounded once to `dt` (fuel and torch then read the same numbers)."""
    return rng.standard_normal(shape, dtype=np.float32).astype(dt.np)


def _to_torch(a: np.ndarray, dt: DType, requires_grad: bool = False) -> Any:
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a.astype(np.float32))).to(_torch_dtype(dt))
    return t.requires_grad_(requires_grad)


def _as_f32(x: Any) -> np.ndarray:
    """A fuel Tensor, a torch tensor or an array, as a float32 array (for comparing)."""
    if hasattr(x, "detach"):
        return np.asarray(x.detach().float().numpy())
    if hasattr(x, "numpy"):
        x = x.numpy()
    return np.asarray(x).astype(np.float32)


def compare(ref: list[Any], got: list[Any], rtol: float, atol: float) -> dict[str, Any]:
    """np.allclose of every output against torch's, with the worst absolute difference."""
    r32, g32 = [_as_f32(r) for r in ref], [_as_f32(g) for g in got]
    if len(r32) != len(g32) or any(r.shape != g.shape for r, g in zip(r32, g32, strict=False)):
        return {"ok": False, "max_abs": float("nan"), "rtol": rtol, "atol": atol,
                "error": f"shapes {[g.shape for g in g32]} != torch's {[r.shape for r in r32]}"}
    ok = all(np.allclose(g, r, rtol=rtol, atol=atol) for r, g in zip(r32, g32, strict=True))
    worst = max(float(np.max(np.abs(g.astype(np.float64) - r), initial=0.0)) for r, g in zip(r32, g32, strict=True))
    return {"ok": bool(ok), "max_abs": worst, "rtol": rtol, "atol": atol}


def _tolerance(dt: DType, backward: bool = False) -> tuple[float, float]:
    """(rtol, atol) against torch: f32 accumulation-order noise, or bf16's 8-bit mantissa."""
    if dt is DType.BF16:
        return 2e-2, 2e-2
    return (1e-3, 1e-4) if backward else (1e-4, 2e-5)


def has_impl(op_id: int, dt: DType) -> bool:
    """A CPU kernel for this op whose first input has dtype `dt` is registered."""
    return any(i.backend == "cpu" and i.dtypes[0] is dt for i in fl.kernels().impls(op_id))


def _fused_impls(build: Callable[[], list[fl.Tensor]], op_ids: tuple[int, ...],
                 env: dict[str, int] | None = None) -> list[Any]:
    """The impls (BackendImpl) of ops `op_ids` that realising `build()` runs, in order, each once (none when
    fuel ran the op's primitive decomposition, whose own fused pieces, a softmax, say, are not the op)."""
    with fl.trace() as t:
        fl.realize(*build(), env=env)
    names: list[str] = []
    for r in t.records:
        # a joint step (the three backward entries in one pass) records "A[..] + B[..] + C[..]"
        for name in r.impl.split(" + "):
            if not name.startswith("prim:") and name not in names:
                names.append(name)
    by_name = {i.name: i for i in fl.kernels()}
    return [by_name[n] for n in names if n in by_name and by_name[n].op_id in op_ids]


def impl_cost(impl: Any, shapes: Sequence[tuple[int, ...]], params: Any, k_len: int | None = None) -> tuple[int, int]:
    """(flops, bytes) from the impl's own cost estimate; a DynScalar k_len is bound to `k_len` first."""
    if k_len is not None and dataclasses.is_dataclass(params) and hasattr(params, "k_len"):
        params = dataclasses.replace(params, k_len=k_len)  # type: ignore[type-var]
    c = impl.cost(shapes, impl.dtypes, params)
    return int(c.flops), int(c.bytes_moved)


def floor_ms(flops: int, nbytes: int, limits: dict[str, float]) -> float:
    return max(nbytes / (limits["bandwidth_gbs"] * 1e6), flops / (limits["gemm_gflops"] * 1e6))


def _compiled(fn: Callable[..., Any], args: tuple[Any, ...], notes: list[str]) -> Callable[[], Any] | None:
    """torch.compile(fn) called once on `args` (compiling), or None with the reason in `notes`."""
    import torch

    try:
        compiled = torch.compile(fn)
        start = time.perf_counter()
        with torch.inference_mode():
            compiled(*args)
        notes.append(f"torch.compile took {time.perf_counter() - start:.1f} s to compile")
    except Exception as e:  # torch.compile is optional: report why, eager still counts
        notes.append(f"torch.compile failed: {type(e).__name__}: {str(e)[:200]}")
        return None

    def call() -> Any:
        with torch.inference_mode():
            return compiled(*args)

    return call


def _result(case: str, label: str, dt: DType, fns: dict[str, Callable[[], Any]], repeat: int,
            limits: dict[str, float], analytic: tuple[int, int], cost: tuple[int, int] | None,
            impls: list[Any], correctness: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """Time `fns` interleaved and assemble one case's record."""
    ms: dict[str, float | None] = {w: None for w in WAYS}
    medians, rounds = timed_ms(fns, repeat)
    ms.update(medians)
    fuel_times: dict[str, float] = {w: t for w in FUEL_WAYS if (t := ms[w]) is not None}
    best_way = min(fuel_times, key=lambda w: fuel_times[w]) if fuel_times else None
    fuel_ms = fuel_times[best_way] if best_way else None

    def ratio(torch_way: str) -> float | None:
        t = ms[torch_way]
        return None if fuel_ms is None or t is None else fuel_ms / t

    analytic_ms = floor_ms(*analytic, limits)
    roof_ms, source = (floor_ms(*cost, limits), "impl cost") if cost else (analytic_ms, "analytic")
    if fuel_ms and roof_ms > fuel_ms:
        notes.append(f"the floor ({roof_ms:.3f} ms) is above fuel's time: the cost estimate over-counts "
                     f"({source}: {(cost or analytic)[1]} bytes, {(cost or analytic)[0]} flops; the analytic "
                     f"minimum is {analytic[1]} bytes, {analytic[0]} flops) or the measured limits are low")
    return {
        "case": case, "shape": label, "dtype": dt.value, "ms": ms, "rounds": rounds,
        "fuel_best_way": best_way, "fuel_ms": fuel_ms,
        "fuel_over_torch": ratio("torch_eager"), "fuel_over_compile": ratio("torch_compile"),
        "impls": [i.name for i in impls],
        "flops": (cost or analytic)[0], "bytes": (cost or analytic)[1],
        "analytic_flops": analytic[0], "analytic_bytes": analytic[1],
        "roofline_ms": roof_ms, "roofline_source": source, "analytic_floor_ms": analytic_ms,
        "roofline_fraction": roof_ms / fuel_ms if fuel_ms else None,
        "correctness": correctness, "notes": notes, "skipped": None,
    }


def skipped(case: str, label: str, dt: DType, reason: str) -> dict[str, Any]:
    print(f"  {case} {dt.value}: skipped: {reason}", flush=True)
    return {"case": case, "shape": label, "dtype": dt.value, "ms": {w: None for w in WAYS}, "fuel_best_way": None,
            "fuel_ms": None, "fuel_over_torch": None, "fuel_over_compile": None, "impls": [],
            "roofline_ms": None, "roofline_fraction": None, "correctness": None, "notes": [reason],
            "skipped": reason}


# ---------------------------------------------------------------------------------------------- cases

def case_forward(limits: dict[str, float], repeat: int, compile_torch: bool = True, *, batch: int = 1,
                 heads: int = 16, seq: int = 1024, head_dim: int = 64, dtype: str = "f32") -> dict[str, Any]:
    """Causal self-attention forward: fuel (build + realize, and jit) vs torch SDPA eager and compiled."""
    import torch
    import torch.nn.functional as F

    dt = as_dtype(dtype)
    label = f"B{batch} H{heads} S{seq} D{head_dim} causal"
    if dt is not DType.F32 and not has_impl(FusedOps.FLASH_ATTN, dt):
        return skipped("forward", label, dt, f"no FlashAttn CPU kernel for {dt.value} (the decomposition would "
                                             f"only time primitives in {dt.value})")
    rng = np.random.default_rng(0)
    shape = (batch, heads, seq, head_dim)
    arrays = [_randn(rng, shape, dt) for _ in range(3)]
    tensors = [fl.tensor(a) for a in arrays]
    tq = [_to_torch(a, dt) for a in arrays]
    notes: list[str] = []

    def build() -> list[fl.Tensor]:
        return [fl.ops.flash_attn(*tensors, causal=True)]

    jitted = fl.jit(lambda q, k, v: fl.ops.flash_attn(q, k, v, causal=True))

    def sdpa(q: Any, k: Any, v: Any) -> Any:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def torch_eager() -> Any:
        with torch.inference_mode():
            return sdpa(*tq)

    want = torch_eager()
    correctness = {"fuel": compare([want], build(), *_tolerance(dt)),
                   "fuel_jit": compare([want], [jitted(*arrays)], *_tolerance(dt))}
    fns: dict[str, Callable[[], Any]] = {"fuel": lambda: fl.realize(*build()), "fuel_jit": lambda: jitted(*arrays),
                                         "torch_eager": torch_eager}
    if compile_torch:
        call = _compiled(sdpa, tuple(tq), notes)
        if call is not None:
            fns["torch_compile"] = call
    impls = _fused_impls(build, (FusedOps.FLASH_ATTN,))
    out = build()[0]
    cost = impl_cost(impls[0], [shape, shape, shape, shape], out.node.arg[1]) if impls else None
    n = batch * heads * seq * seq * head_dim
    analytic = (2 * 2 * n // 2, dt.np.itemsize * 4 * batch * heads * seq * head_dim)
    if not impls:
        notes.append("no fused kernel ran: fuel timed its primitive decomposition")
    return _result("forward", label, dt, fns, repeat, limits, analytic, cost, impls, correctness, notes)


def case_backward(limits: dict[str, float], repeat: int, compile_torch: bool = True, *, batch: int = 1,
                  heads: int = 16, seq: int = 1024, head_dim: int = 64) -> dict[str, Any]:
    """dq, dk, dv of causal attention: fuel's three grads in one realize vs torch autograd's backward."""
    import torch
    import torch.nn.functional as F

    dt = DType.F32
    label = f"B{batch} H{heads} S{seq} D{head_dim} causal"
    rng = np.random.default_rng(1)
    shape = (batch, heads, seq, head_dim)
    arrays = [_randn(rng, shape, dt) for _ in range(4)]  # q, k, v and the upstream gradient
    tensors = [fl.tensor(a) for a in arrays]
    notes = ["torch: the backward alone (autograd.grad on a kept forward, retain_graph=True); "
             "fuel: dq, dk, dv realised together from q, k, v, dO (fuel recomputes the softmax)"]

    def grads(q: fl.Tensor, k: fl.Tensor, v: fl.Tensor, g: fl.Tensor) -> list[fl.Tensor]:
        return fl.grad(fl.ops.flash_attn(q, k, v, causal=True), [q, k, v], grad_out=g)

    def build() -> list[fl.Tensor]:
        return grads(*tensors)

    jitted = fl.jit(grads)
    tq, tk, tv = (_to_torch(a, dt, requires_grad=True) for a in arrays[:3])
    tg = _to_torch(arrays[3], dt)
    out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)

    def torch_backward() -> Any:
        return torch.autograd.grad(out, (tq, tk, tv), tg, retain_graph=True)

    want = list(torch_backward())
    tol = _tolerance(dt, backward=True)
    correctness = {"fuel": compare(want, list(fl.realize(*build())), *tol),
                   "fuel_jit": compare(want, list(jitted(*arrays)), *tol)}
    fns: dict[str, Callable[[], Any]] = {"fuel": lambda: fl.realize(*build()), "fuel_jit": lambda: jitted(*arrays),
                                         "torch_eager": torch_backward}
    if compile_torch:
        notes.append("torch.compile not timed for the backward")
    impls = _fused_impls(build, (FusedOps.FLASH_ATTN_BACKWARD_Q, FusedOps.FLASH_ATTN_BACKWARD_K,
                                 FusedOps.FLASH_ATTN_BACKWARD_V))
    cost = None
    if impls:
        node = build()[0].node
        shapes = [shape] * 5  # q, k, v, dO, then the output (each grad has q's shape here)
        costs = [impl_cost(i, shapes, node.arg[1]) for i in impls]
        # The CPU kernel computes dq, dk and dv in one pass for the three entries: one impl's estimate is
        # the pass when they agree; take the largest so a per-entry estimate is not counted three times.
        cost = max(costs)
        notes.append(f"impl cost: the largest of {len(costs)} backward impl estimates {costs}")
    n = batch * heads * seq * seq * head_dim
    # Five S x S x D products (s, dP, dV, dQ, dK), half of each masked: 5 * 2 * n / 2.
    analytic = (5 * n, dt.np.itemsize * 7 * batch * heads * seq * head_dim)
    if not impls:
        notes.append("no fused kernel ran: fuel timed its primitive decomposition")
    return _result("backward", label, dt, fns, repeat, limits, analytic, cost, impls, correctness, notes)


def case_decode(limits: dict[str, float], repeat: int, compile_torch: bool = True, *, hq: int = 32, hkv: int = 8,
                capacity: int = 4096, k_len: int = 2048, head_dim: int = 64) -> dict[str, Any]:
    """One query over the first k_len rows of a capacity cache, k_len a DynScalar bound per call."""
    import torch
    import torch.nn.functional as F

    dt = DType.F32
    label = f"Sq1 Hq{hq} Hkv{hkv} D{head_dim} k_len {k_len} of {capacity}"
    rng = np.random.default_rng(2)
    q = _randn(rng, (1, hq, 1, head_dim), dt)
    k, v = (_randn(rng, (1, hkv, capacity, head_dim), dt) for _ in range(2))
    tensors = [fl.tensor(a) for a in (q, k, v)]
    notes = ["fuel causal=True (bottom-right: the one query sees all k_len keys); torch without a mask "
             "(its is_causal aligns top-left)"]
    kl: Any = fl.dyn("k_len")
    env: dict[str, int] | None = {"k_len": k_len}
    if not has_impl(FusedOps.FLASH_ATTN, dt):
        kl, env = k_len, None
        notes.append("no FlashAttn CPU kernel: a DynScalar k_len has no decomposition, so fuel ran with a "
                     "static k_len (its primitive decomposition)")

    def build() -> list[fl.Tensor]:
        return [fl.ops.flash_attn(*tensors, causal=True, k_len=kl)]

    jitted = fl.jit(lambda a, b, c: fl.ops.flash_attn(a, b, c, causal=True, k_len=kl))
    env_kw = env or {}
    tq, tk, tv = (_to_torch(a, dt) for a in (q, k, v))

    def sdpa(a: Any, b: Any, c: Any) -> Any:
        return F.scaled_dot_product_attention(a, b[:, :, :k_len], c[:, :, :k_len], enable_gqa=True)

    def torch_eager() -> Any:
        with torch.inference_mode():
            return sdpa(tq, tk, tv)

    want = torch_eager()
    tol = _tolerance(dt)
    correctness = {"fuel": compare([want], list(fl.realize(*build(), env=env)), *tol),
                   "fuel_jit": compare([want], [jitted(q, k, v, **env_kw)], *tol)}
    fns: dict[str, Callable[[], Any]] = {"fuel": lambda: fl.realize(*build(), env=env),
                                         "fuel_jit": lambda: jitted(q, k, v, **env_kw), "torch_eager": torch_eager}
    if compile_torch:
        call = _compiled(sdpa, (tq, tk, tv), notes)
        if call is not None:
            fns["torch_compile"] = call
    impls = _fused_impls(build, (FusedOps.FLASH_ATTN,), env)
    node = build()[0].node
    cost = impl_cost(impls[0], [q.shape, k.shape, v.shape, q.shape], node.arg[1], k_len) if impls else None
    analytic = (4 * hq * k_len * head_dim, dt.np.itemsize * (2 * hkv * k_len * head_dim + 2 * hq * head_dim))
    return _result("decode", label, dt, fns, repeat, limits, analytic, cost, impls, correctness, notes)


def case_paged(limits: dict[str, float], repeat: int, compile_torch: bool = True, *, batch: int = 4, hq: int = 32,
               hkv: int = 8, head_dim: int = 64, block_size: int = 16, context: int = 2048) -> dict[str, Any]:
    """Paged decode through a shuffled block table vs torch SDPA on the dense cache gathered beforehand."""
    import torch
    import torch.nn.functional as F

    dt = DType.F32
    label = f"B{batch} Hq{hq} Hkv{hkv} D{head_dim} bs{block_size} ctx {context}"
    paged = getattr(fl.ops, "paged_attn", None)
    if paged is None:
        return skipped("paged", label, dt, "fl.ops.paged_attn is not available yet")
    rng = np.random.default_rng(3)
    per_seq = -(-context // block_size)
    n_blocks = batch * per_seq
    q = _randn(rng, (batch, hq, 1, head_dim), dt)
    k_cache, v_cache = (_randn(rng, (n_blocks, block_size, hkv, head_dim), dt) for _ in range(2))
    table = rng.permutation(n_blocks).astype(np.uint32).reshape(batch, per_seq)
    lens = np.full(batch, context, np.uint32)
    inputs = [q, k_cache, v_cache, table, lens]
    tensors = [fl.tensor(a) for a in inputs]
    notes = [f"torch runs on the dense cache gathered beforehand (gather excluded from its time), "
             f"{n_blocks} blocks shuffled"]

    def build() -> list[fl.Tensor]:
        return [paged(*tensors)]

    jitted = fl.jit(lambda *a: paged(*a))

    def gather(cache: Any) -> Any:  # [NB, bs, Hkv, D] -> [B, Hkv, context, D], contiguous
        idx = torch.from_numpy(table.astype(np.int64))
        return cache[idx].reshape(batch, per_seq * block_size, hkv, head_dim)[:, :context].permute(0, 2, 1, 3) \
            .contiguous()

    tq, tkc, tvc = (_to_torch(a, dt) for a in (q, k_cache, v_cache))
    with torch.inference_mode():
        dense_k, dense_v = gather(tkc), gather(tvc)

    def sdpa(a: Any, b: Any, c: Any) -> Any:
        return F.scaled_dot_product_attention(a, b, c, enable_gqa=True)

    def torch_eager() -> Any:
        with torch.inference_mode():
            return sdpa(tq, dense_k, dense_v)

    want = torch_eager()
    tol = _tolerance(dt)
    try:
        correctness = {"fuel": compare([want], build(), *tol), "fuel_jit": compare([want], [jitted(*inputs)], *tol)}
    except Exception as e:  # a kernel still landing must not stop the other cases
        return skipped("paged", label, dt, f"fuel paged_attn failed: {type(e).__name__}: {str(e)[:200]}")
    fns: dict[str, Callable[[], Any]] = {"fuel": lambda: fl.realize(*build()), "fuel_jit": lambda: jitted(*inputs),
                                         "torch_eager": torch_eager}
    if compile_torch:
        call = _compiled(sdpa, (tq, dense_k, dense_v), notes)
        if call is not None:
            fns["torch_compile"] = call
    impls = _fused_impls(build, (FusedOps.PAGED_ATTN,))
    node = build()[0].node
    shapes = [a.shape for a in inputs] + [q.shape]
    cost = impl_cost(impls[0], shapes, node.arg[1]) if impls else None
    kv_bytes = dt.np.itemsize * batch * (2 * hkv * context * head_dim + 2 * hq * head_dim)
    analytic = (4 * batch * hq * context * head_dim, kv_bytes + table.nbytes + lens.nbytes)
    if not impls:
        notes.append("no fused kernel ran: fuel timed its primitive decomposition")
    r = _result("paged", label, dt, fns, repeat, limits, analytic, cost, impls, correctness, notes)
    with torch.inference_mode():
        r["torch_gather_ms"] = timed_ms({"gather": lambda: (gather(tkc), gather(tvc))}, repeat)[0]["gather"]
    return r


# ---------------------------------------------------------------------------------------------- memory

def _status_kib(field: str) -> int:
    """A /proc/self/status memory field (VmRSS: resident now, VmHWM: its peak), KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def memory_child(spec: str) -> None:
    """Run in a fresh process: one causal forward of [1, H, S, D] f32 by `way`; prints a JSON line.
    The kernels are loaded (compiled) on a smaller problem first, the inputs allocated, then the peak RSS
    reset to the current RSS (/proc/self/clear_refs); the peak is then VmHWM after the run (the counter
    ru_maxrss reads for this process). ru_maxrss itself is kept in the record but not used when the
    reset worked: a forked child's ru_maxrss starts at its parent's RSS at the fork (the kernel carries
    the old mm's peak across exec), here the whole benchmark process, and clear_refs does not lower it."""
    args = json.loads(spec)
    s, h, d, way = args["seq"], args["heads"], args["head_dim"], args["way"]
    rng = np.random.default_rng(4)
    if way == "fuel":
        def run(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> Any:
            return fl.ops.flash_attn(fl.tensor(q), fl.tensor(k), fl.tensor(v), causal=True).numpy()
    else:
        import torch
        import torch.nn.functional as F

        torch.set_num_threads(THREADS)

        def run(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> Any:
            with torch.inference_mode():
                tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
                return F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
    # Big enough to take the kernel's parallel path too (a tiny problem runs a serial variant), small
    # enough that its score matrix would not matter (4 MiB per head).
    small = rng.standard_normal((1, h, min(s, 1024), d), dtype=np.float32)
    run(small, small, small)
    q, k, v = (rng.standard_normal((1, h, s, d), dtype=np.float32) for _ in range(3))
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS to the current RSS
        reset = True
    except OSError:
        reset = False
    base_kib = _status_kib("VmRSS")
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    out = run(q, k, v)
    first_s = time.perf_counter() - start
    maxrss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    hwm_kib = _status_kib("VmHWM")
    peak_kib = hwm_kib if reset else maxrss_kib
    del out
    start = time.perf_counter()
    run(q, k, v)
    second_s = time.perf_counter() - start
    print(json.dumps({"base_kib": base_kib, "maxrss_before_kib": before_kib, "maxrss_kib": maxrss_kib,
                      "hwm_kib": hwm_kib, "peak_kib": peak_kib, "hwm_reset": reset, "first_s": first_s,
                      "second_s": second_s}))


def case_memory(seq: int = 16384, heads: int = 1, head_dim: int = 64, require_kernel: bool = True,
                ways: tuple[str, ...] = ("fuel", "torch"), timeout: float = 600) -> dict[str, Any]:
    """Peak RSS over the RSS with the inputs allocated, for one causal forward per way, each in a fresh
    subprocess, next to the score matrix the decomposition would materialise (S^2 * 4 bytes per head)."""
    label = f"B1 H{heads} S{seq} D{head_dim} causal"
    score_mib = heads * seq * seq * 4 / 2**20
    record: dict[str, Any] = {"case": "memory", "shape": label, "dtype": "f32", "seq": seq, "heads": heads,
                              "score_matrix_mib": score_mib, "output_mib": heads * seq * head_dim * 4 / 2**20,
                              "ways": {}, "skipped": None}
    if require_kernel and not has_impl(FusedOps.FLASH_ATTN, DType.F32):
        record["skipped"] = ("no FlashAttn CPU kernel for f32: the decomposition would materialise the "
                             f"{score_mib:.0f} MiB score matrix")
        print(f"  memory {label}: skipped: {record['skipped']}", flush=True)
        return record
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
            "from benchmarks.bench_attention import memory_child; memory_child(sys.argv[1])")
    for way in ways:
        spec = json.dumps({"seq": seq, "heads": heads, "head_dim": head_dim, "way": way})
        try:
            proc = subprocess.run([sys.executable, "-c", code, spec], capture_output=True, text=True,
                                  timeout=timeout, env=os.environ.copy())
        except subprocess.TimeoutExpired:
            record["ways"][way] = {"error": f"timed out after {timeout:.0f} s"}
            continue
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            record["ways"][way] = {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"}
            continue
        m = json.loads(lines[-1])
        extra_mib = (m["peak_kib"] - m["base_kib"]) / 1024
        m.update({"extra_mib": extra_mib, "extra_over_score_matrix": extra_mib / score_mib,
                  # without a reset, a peak under an earlier high-water mark hides behind it: an upper bound
                  "extra_is_upper_bound": (not m["hwm_reset"]) and m["maxrss_kib"] == m["maxrss_before_kib"]})
        record["ways"][way] = m
    return record


# ---------------------------------------------------------------------------------------------- output

def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "n/a" if v is None else f"{v:{spec}}"


def print_table(results: list[dict[str, Any]], memory: list[dict[str, Any]]) -> None:
    print("\n| case | shape | dtype | fuel ms | fuel jit ms | torch ms | torch.compile ms | fuel/torch "
          "| fuel/compile | roofline ms | roofline frac | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ms = r["ms"]
        ok = "skipped" if r["skipped"] else ("yes" if all(c["ok"] for c in r["correctness"].values()) else "NO")
        frac = r["roofline_fraction"]
        print(f"| {r['case']} | {r['shape']} | {r['dtype']} | {_fmt(ms['fuel'])} | {_fmt(ms['fuel_jit'])} | "
              f"{_fmt(ms['torch_eager'])} | {_fmt(ms['torch_compile'])} | {_fmt(r['fuel_over_torch'])} | "
              f"{_fmt(r['fuel_over_compile'])} | {_fmt(r['roofline_ms'], '.3f')} | "
              f"{'n/a' if frac is None else f'{100 * frac:.1f}%'} | {ok} |")
    if memory:
        print("\n| memory | score matrix MiB | way | extra peak RSS MiB | / score matrix | first s | second s |")
        print("|---|---|---|---|---|---|---|")
        for m in memory:
            if m["skipped"]:
                print(f"| {m['shape']} | {m['score_matrix_mib']:.0f} | - | skipped | | | |")
            for way, w in m["ways"].items():
                if "error" in w:
                    print(f"| {m['shape']} | {m['score_matrix_mib']:.0f} | {way} | error: {w['error'][:80]} | | | |")
                    continue
                bound = " (upper bound)" if w["extra_is_upper_bound"] else ""
                print(f"| {m['shape']} | {m['score_matrix_mib']:.0f} | {way} | {w['extra_mib']:.1f}{bound} | "
                      f"{w['extra_over_score_matrix']:.3f} | {w['first_s']:.2f} | {w['second_s']:.2f} |")


def plot(results: list[dict[str, Any]], memory: list[dict[str, Any]], path: Path) -> None:
    """One panel per timed case (their scales differ), bars fuel / fuel jit / torch / torch.compile with
    the ratio to torch eager over each fuel bar; one panel of peak memory against the score matrix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in results if not r["skipped"]]
    mem = [m for m in memory if not m["skipped"] and m["ways"]]
    panels = max(len(timed) + (1 if mem else 0), 1)
    cols = min(panels, 3)
    rows = -(-panels // cols)
    fig, grid = plt.subplots(rows, cols, figsize=(4.6 * cols, 4.2 * rows), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[panels:]:
        ax.axis("off")
    labels = {"fuel": "fuel", "fuel_jit": "fuel jit", "torch_eager": "torch", "torch_compile": "torch\ncompile"}
    for ax, r in zip(axes, timed, strict=False):
        vals = [r["ms"][w] for w in WAYS]
        top = max((v for v in vals if v is not None), default=1.0)
        bars = ax.bar(range(len(WAYS)), [v or 0.0 for v in vals], color=["C0", "C1", "C3", "C2"])
        torch_ms = r["ms"]["torch_eager"]
        for way, bar, v in zip(WAYS, bars, vals, strict=True):
            text = "n/a" if v is None else f"{v:.2f}"
            if v is not None and way in FUEL_WAYS and torch_ms:
                text += f"\n{v / torch_ms:.2f}x torch"
            ax.text(bar.get_x() + bar.get_width() / 2, (v or 0.0) + 0.01 * top, text, ha="center", va="bottom",
                    fontsize=7)
        if r["roofline_ms"]:
            ax.axhline(r["roofline_ms"], color="black", linestyle=":", linewidth=1, label="roofline")
            ax.legend(fontsize=7, loc="upper left")
        ax.set_xticks(range(len(WAYS)), [labels[w] for w in WAYS], fontsize=8)
        ax.set_ylim(0, top * 1.3)
        ax.set_ylabel("median ms (lower is better)")
        ax.set_title(f"{r['case']} {r['dtype']}\n{r['shape']}", fontsize=8)
    if mem:
        ax = axes[len(timed)]
        names, vals = [], []
        for m in mem:
            names.append(f"score matrix\nH{m['heads']}")
            vals.append(m["score_matrix_mib"])
            for way, w in m["ways"].items():
                if "extra_mib" in w:
                    names.append(f"{way}\nH{m['heads']}")
                    vals.append(w["extra_mib"])
        colours = {"score": "C7", "fuel": "C0", "torch": "C3"}
        bars = ax.bar(range(len(vals)), vals, color=[colours[n.split()[0]] for n in names])
        for bar, v in zip(bars, vals, strict=True):
            ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(vals)), names, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("MiB above the inputs (peak RSS, log scale)")
        ax.set_title(f"causal forward S{mem[0]['seq']}: peak memory", fontsize=8)
    fig.suptitle("Fuel attention vs PyTorch, this CPU", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write(out_dir: Path, meta: dict[str, Any], results: list[dict[str, Any]], memory: list[dict[str, Any]]) -> None:
    """JSON and PNG of the results so far (rewritten after each case, so a long run keeps its results)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "attention.json").write_text(json.dumps({"meta": meta, "results": results, "memory": memory},
                                                       indent=2))
    plot(results, memory, out_dir / "attention.png")


def _report(r: dict[str, Any]) -> None:
    if r["skipped"]:
        return
    ms = r["ms"]
    bad = [w for w, c in r["correctness"].items() if not c["ok"]]
    print(f"  {r['case']:8} {r['dtype']:4} fuel {_fmt(ms['fuel'])} | jit {_fmt(ms['fuel_jit'])} | torch "
          f"{_fmt(ms['torch_eager'])} | compile {_fmt(ms['torch_compile'])} ms | fuel/torch "
          f"{_fmt(r['fuel_over_torch'])} | roofline {_fmt(r['roofline_fraction'], '.3f')} ({r['roofline_source']})"
          + (f" | DISAGREES with torch: {bad}" if bad else ""), flush=True)
    for w in bad:
        c = r["correctness"][w]
        print(f"    WARNING: {w} max |diff| {c['max_abs']:.3g} (rtol {c['rtol']}, atol {c['atol']}) "
              f"{c.get('error', '')}", flush=True)


def main(out_dir: str, repeat: int, compile_torch: bool = True, sizes: Sizes | None = None,
         limits: dict[str, float] | None = None) -> int:
    """Run every case, print the markdown table, write attention.json and attention.png in `out_dir`.
    `sizes` defaults to the real sizes; tests pass `Sizes.tiny()` (and `limits`, skipping the measurement)."""
    import torch

    sz = sizes or Sizes()
    torch.set_num_threads(THREADS)
    fl.set_num_threads(THREADS)
    attn = [i.name for i in fl.kernels() if "Attn" in i.name]
    print(f"attention: {THREADS} threads, repeat {repeat}; attention kernels registered: {attn or 'none'}",
          flush=True)
    limits = limits or machine_limits()
    folder = Path(out_dir)
    meta = {"machine": platform.processor() or platform.machine(), "threads": THREADS, "blas": blas_info(),
            "torch": torch.__version__, "repeat": repeat, "limits": limits, "sizes": dataclasses.asdict(sz),
            "attention_kernels": attn, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
            # two cores: a load average above ~2 means something else competed with the timings
            "loadavg_start": os.getloadavg()}
    results: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    base: dict[str, Any] = {"batch": sz.batch, "heads": sz.heads, "seq": sz.seq, "head_dim": sz.head_dim}
    fwd_label = f"B{sz.batch} H{sz.heads} S{sz.seq} D{sz.head_dim} causal"
    runs: list[Callable[[], dict[str, Any]]] = [
        lambda: case_forward(limits, repeat, compile_torch, **base),
        lambda: case_forward(limits, repeat, compile_torch, **base, dtype="bf16"),
        lambda: case_backward(limits, repeat, compile_torch, **base),
        lambda: case_decode(limits, repeat, compile_torch, hq=sz.decode_hq, hkv=sz.decode_hkv,
                            capacity=sz.decode_capacity, k_len=sz.decode_len, head_dim=sz.head_dim),
        lambda: case_paged(limits, repeat, compile_torch, batch=sz.paged_batch, hq=sz.decode_hq, hkv=sz.decode_hkv,
                           head_dim=sz.head_dim, block_size=sz.block_size, context=sz.paged_context),
    ]
    labels = [("forward", "f32", fwd_label), ("forward", "bf16", fwd_label), ("backward", "f32", fwd_label),
              ("decode", "f32", "decode"), ("paged", "f32", "paged")]
    for run, (case, dtype, label) in zip(runs, labels, strict=True):
        try:
            results.append(run())
        except Exception as e:  # one broken case (a kernel still landing, say) must not stop the others
            results.append(skipped(case, label, as_dtype(dtype), f"failed: {type(e).__name__}: {str(e)[:300]}"))
        _report(results[-1])
        _write(folder, meta, results, memory)
    for h in sz.long_heads:
        memory.append(case_memory(sz.long_seq, h, sz.head_dim, require_kernel=sizes is None))
        _write(folder, meta, results, memory)
    meta["loadavg_end"] = os.getloadavg()
    _write(folder, meta, results, memory)
    print_table(results, memory)
    print(f"load average (1, 5, 15 min) at start {meta['loadavg_start']}, at end {meta['loadavg_end']} "
          f"({THREADS} cores: above ~{THREADS} something else competed with these timings)")
    print(f"\nroofline: max(bytes / {limits['bandwidth_gbs']:.1f} GB/s copy, flops / {limits['gemm_gflops']:.0f} "
          f"GFLOP/s sgemm) from the fuel impl's cost (analytic counts without a kernel), over fuel's best time; "
          f"ratios use fuel's best way. BLAS {blas_info()}")
    for r in results:
        for n in r["notes"]:
            print(f"note ({r['case']} {r['dtype']}): {n}")
    print(f"wrote {folder / 'attention.json'} and {folder / 'attention.png'}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results", help="folder for attention.json and attention.png")
    parser.add_argument("--repeat", type=int, default=10, help="timed rounds per way (median reported)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    args = parser.parse_args()
    raise SystemExit(main(args.out, max(1, args.repeat), not args.no_compile))
